"""DDTree's builder alone, per budget: XLA's sorts vs the one-program Triton kernel
(pallas_kernels.ddtree_build, per --num_warps), CUPTI kernel us per build, every tree checked node
for node against XLA's first.

It decides `ddtree_build.AUTO_MAX_PADDED_CANDIDATES` (the largest padded candidate count at which
`tree_impl="auto"` takes the kernel) and `ddtree_build.BITONIC_WARPS`. Rows per budget: `xla`,
then `bitonic w<W>` per warp count. Input: top-k log-probs and ids of random draft logits
[B, J, V] (B = --batch, J = --block - 1, V = --vocab; K2.6's V/8 by default), the same for every
row; the top-k itself is common to both builders and not timed. Rows are printed as timed
(budget, builder, Cp, us, x XLA, ok), JSON lines in --out; the time box stops before a row it
cannot finish (compiles included: ~8-70 s a kernel program on an H100). Off a GPU the kernel runs
in interpret mode (one row, `interpret`) and only correctness is reported (no us).

  python scripts/bench_tree_builder.py --budgets 47,63,31,15 --out runs/tree_builder.jsonl
"""

import functools
import json
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import runtime, timing, tree
from pallas_kernels import ddtree_build

runtime.define_flags()
_BUDGETS = flags.DEFINE_list("budgets", ["7", "15", "31", "47", "63"], "Tree budgets n.")
_WARPS = flags.DEFINE_list("num_warps", ["4", "8"], "Triton warps of the kernel rows.")
_BLOCK = flags.DEFINE_integer("block", 16, "Draft block size (J = block - 1 depths).")
_VOCAB = flags.DEFINE_integer("vocab", 20480, "Draft vocabulary (K2.6's V/8 per GPU share).")
_BATCH = flags.DEFINE_integer("batch", 1, "Trees per call.")
_ITERS = flags.DEFINE_integer("iters", 20, "Calls per CUPTI trace.")
_BOX = flags.DEFINE_float("time_budget_s", 150.0, "Stop before starting a row after this.")
_OUT = flags.DEFINE_string("out", "", "JSON lines output ('' = none).")


def topk_inputs(budget, batch, block, vocab, seed=0):
  """(log-probs, ids) [B, J, K] of random draft logits, K = min(budget, vocab)."""
  logits = jax.random.normal(jax.random.key(seed), (batch, block - 1, vocab), jnp.float32) * 3
  k = min(budget, vocab)
  return jax.jit(jax.vmap(lambda x: tree.topk_logprobs(x, k)))(logits)


def row_name(warps, on_gpu):
  """'bitonic w<W>' (the name of the H100 tables of 2026-12-05), or off a GPU 'interpret'."""
  return f"bitonic w{warps}" if on_gpu else "interpret"


def builders(budget, warps, on_gpu):
  """{name: jitted batched builder from (lp, ids)}: 'xla', then the kernel per warp count (one
  interpret-mode row off a GPU)."""
  out = {"xla": jax.jit(jax.vmap(functools.partial(tree._build_from_topk, n=budget)))}  # pylint: disable=protected-access
  for w in (warps if on_gpu else warps[:1]):
    out[row_name(w, on_gpu)] = jax.jit(jax.vmap(functools.partial(
        ddtree_build.build_from_topk, n=budget, interpret=not on_gpu, num_warps=w)))
  return out


def run_row(name, fn, args, ref, budget, k, iters):
  """One builder at one budget: compile, check against `ref` (XLA's trees), CUPTI us."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  compile_s = time.perf_counter() - t0
  ok = ref is None or all(np.array_equal(a, b) for a, b in zip(out, ref))
  ms, _ = timing.kernel_ms(fn, args, iters=iters)
  return dict(budget=budget, builder=name, k=k,
              padded_candidates=ddtree_build.padded_candidates(budget, k),
              us=None if ms is None else 1e3 * ms, compile_s=compile_s, ok=bool(ok),
              auto_takes_kernel=ddtree_build.suits_auto(budget, k),
              device=jax.devices()[0].device_kind), out


def line(r, xla_us):
  us = "-" if r["us"] is None else f"{r['us']:.1f}"
  ratio = "-" if r["us"] is None or not xla_us else f"{r['us'] / xla_us:.2f}"
  return (f"{r['budget']:>6} {r['builder']:>17} {r['padded_candidates']:>5} {us:>9} {ratio:>6} "
          f"{'ok' if r['ok'] else 'FAIL':>4} {r['compile_s']:7.1f}")


def timed_rows(budgets, warps, on_gpu, start):
  """Every (budget, builder) row in order, XLA's first per budget (the reference trees), printed
  as timed; stops before a row once the time box is spent."""
  rows = []
  for budget in budgets:
    args = topk_inputs(budget, _BATCH.value, _BLOCK.value, _VOCAB.value)
    k = args[0].shape[-1]
    ref, xla_us = None, None
    for name, fn in builders(budget, warps, on_gpu).items():
      if time.perf_counter() - start > _BOX.value:
        print(f"NOT DONE: budget {budget} {name} and later rows (time box {_BOX.value:.0f} s)")
        return rows
      row, out = run_row(name, fn, args, ref, budget, k, _ITERS.value)
      ref = out if ref is None else ref
      xla_us = row["us"] if name == "xla" else xla_us
      rows.append(row)
      print(line(row, xla_us), flush=True)
  return rows


def main(_):
  on_gpu = jax.devices()[0].platform == "gpu"
  print(f"{'budget':>6} {'builder':>17} {'Cp':>5} {'us':>9} {'x xla':>6} {'ok':>4} {'comp s':>7}"
        f"   ({jax.devices()[0].device_kind}, CUPTI kernel us per build of {_BATCH.value} tree(s))")
  rows = timed_rows([int(b) for b in _BUDGETS.value], [int(w) for w in _WARPS.value],
                    on_gpu, time.perf_counter())
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
  app.run(main)
