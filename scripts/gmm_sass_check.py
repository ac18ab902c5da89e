"""SASS facts of the grouped-matmul kernels whose PTX `scripts/gmm_ptxas_rows.py --ptx_dir DIR`
kept (CPU only): per kernel, the K loop's closing wgmma wait, how many HGMMA A-operand registers
are still in flight across the loop's back edge, and how many instructions of the next
iteration write one of them before its first wait (must be 0 for any K loop that ends without
wgmma_wait(0), as the removed `int4_step_overlap` did: ptxas does not guard the back edge,
notes/int4_small_t.md), and the K step's instruction mix.

  .venv/bin/python scripts/gmm_sass_check.py --ptx_dir DIR --nvdisasm PATH/nvdisasm

nvdisasm is not part of the venv: the pip wheel nvidia-cuda-nvdisasm has one; installed beside
the deviceless compiler (WORKSPACE.md "Setup": `pip install --no-deps --target .deviceless
"nvidia-cuda-nvdisasm>=13,<14"`) it is the default.
"""

import collections
import glob
import os
import re
import subprocess

from absl import app, flags

from kdtree_jax import deviceless

_PTX_DIR = flags.DEFINE_string("ptx_dir", None, "gmm_ptxas_rows.py's --ptx_dir.", required=True)
_NVDISASM = flags.DEFINE_string(
    "nvdisasm", deviceless.NVDISASM if os.path.exists(deviceless.NVDISASM) else "nvdisasm",
    "nvdisasm binary (default: .deviceless's, else the PATH's).")
_PTXAS = flags.DEFINE_string("ptxas", "/usr/local/cuda-13.0/bin/ptxas", "ptxas binary.")

_INS = re.compile(r"/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
MIX = ("HGMMA", "PRMT", "LOP3", "SHF", "HADD2", "HMUL2", "LDSM", "LDS")  # LDSM before LDS


def sass(ptx: str) -> list[str]:
  """The kernel's instructions (predicates stripped), in order."""
  cubin = ptx[:-len(".ptx")] + ".cubin"
  subprocess.run([_PTXAS.value, "-arch=sm_90a", ptx, "-o", cubin], check=True)
  text = subprocess.run([_NVDISASM.value, "-c", cubin], capture_output=True, text=True,
                        check=True).stdout
  return [re.sub(r"^@!?U?P\w+\s+", "", m[2]) for m in _INS.finditer(text)]


def _a_regs(op: str) -> set[int]:
  """The 4 registers of an HGMMA's A operand (its second register)."""
  first = int(re.findall(r"\bR(\d+)\b", op)[1])
  return set(range(first, first + 4))


def _pending(ins, after: int) -> int:
  """Groups still in flight after the waits that follow instruction `after`."""
  waits = []
  for op in ins[after + 1:]:
    if not op.startswith("WARPGROUP.DEPBAR"):
      if waits:
        break
      continue
    waits.append(int(op.split(",")[-1], 16))
  return min(waits)


def check(ins: list[str]) -> dict:
  """The K loop: from the slot barrier wait before the first HGMMA to the waits after the last."""
  hgmma = [i for i, op in enumerate(ins) if op.startswith("HGMMA")]
  head = max(i for i in range(hgmma[0]) if "TRYWAIT" in ins[i])
  pending = _pending(ins, hgmma[-1])
  groups, cur = [], []
  for i in hgmma:
    cur.append(i)
    if "gsb0" in ins[i]:
      groups, cur = groups + [cur], []
  live = set()
  for group in groups[len(groups) - pending:] if pending else []:
    for i in group:
      live |= _a_regs(ins[i])
  first_wait = next(i for i in range(head, len(ins)) if ins[i].startswith("WARPGROUP.DEPBAR"))
  skip = ("HGMMA", "WARPGROUP", "BRA", "SYNCS", "UTMA", "ST")
  dests = [re.match(r"\S+\s+R(\d+)\b", op) for op in ins[head:first_wait]
           if not op.startswith(skip)]
  clobbers = sum(1 for d in dests if d and int(d[1]) in live)
  mix = collections.Counter(next((k for k in MIX if op.startswith(k)), "other")
                            for op in ins[head:hgmma[-1] + 1])
  return dict(in_flight_groups=pending, in_flight_a_regs=len(live), rewritten=clobbers,
              step_instructions=hgmma[-1] + 1 - head, **{k: mix[k] for k in MIX})


def main(_):
  for ptx in sorted(glob.glob(os.path.join(_PTX_DIR.value, "*", "*.ptx"))):
    facts = check(sass(ptx))
    print(os.path.relpath(ptx, _PTX_DIR.value), " ".join(f"{k}={v}" for k, v in facts.items()),
          flush=True)


if __name__ == "__main__":
  app.run(main)
