"""Reading measured results (JSON lines, text logs) and drawing them; used by scripts and notebooks.

Readers turn every format in results/ into rows with a `kind` (accept, phases, throughput,
sweep, kernel) and a `source` (file stem). Plot functions draw on a given matplotlib Axes.
"""

import collections
import json
import math
import os
import re

import numpy as np

TOP_PHASES = ("draft_ctx", "draft_block", "tree", "verify", "accept", "commit")
STACK_PHASES = ("draft_ctx", "draft_block", "tree", "attention", "moe", "rest", "accept", "commit")
PHASE_COLORS = dict(zip(STACK_PHASES, ("#8dd3c7", "#80b1d3", "#bebada", "#fb8072", "#fdb462",
                                       "#fccde5", "#b3de69", "#d9d9d9")))
MODE_STYLE = {"ar": "s-", "chain": "^-", "ddtree": "o-"}


# ---- reading ------------------------------------------------------------------------------
def _stem(path):
  return os.path.splitext(os.path.basename(path))[0]


def classify(row: dict) -> str | None:
  """The kind of one JSON record from eval_acceptance / bench_context_decode / sweep / kernels."""
  if "kind" in row:
    return row["kind"]
  if "part" in row:  # pallas_kernels/grouped_matmul/bench.py: ffn / tune / layer
    return "moe"
  if "mean_accept_len" in row:
    return "accept"
  if "impl" in row and "tbps" in row:
    return "kernel"
  return None


def read_jsonl(path) -> list[dict]:
  """Classified rows of a JSON-lines file (kernel rows get the file's ceilings; unknown rows and
  rows whose `status` is not "ok" dropped)."""
  rows, ceil = [], None
  with open(path) as f:
    for line in f:
      if not line.strip():
        continue
      r = json.loads(line)
      if "ceilings" in r and "impl" not in r:
        ceil = r["ceilings"]
        continue
      kind = classify(r)
      if kind is None or r.get("status", "ok") != "ok":
        continue  # unknown, or a measurement that did not complete (e.g. cut by its time box)
      r = dict(r, kind=kind, source=_stem(path))
      if kind == "kernel" and ceil:
        r.setdefault("ceil", ceil)
      rows.append(r)
  return rows


_ACCEPT_RE = re.compile(r"^\s*(ar|chain|ddtree)\s+(\S+):\s+accept/step\s+([\d.]+)\s+([\d.]+) tok/s"
                        r"\s+x([\d.]+)\s+lossless=(True|False)")
_CEIL_RE = re.compile(r"ceilings: copy ([\d.]+) TB/s, matmul ([\d.]+) TFLOP/s")
_TABLE_RE = re.compile(r"== phase table: mode=(\w+) ctx=(\d+)")
_PHASE_RE = re.compile(r"^\s*(\w+)" + r"\s+([\d.]+)" * 6 + "$")
_THRU_RE = re.compile(r"ctx=\s*(\d+)\s+(\w+):\s+([\d.]+) ms/step\s+([\d.]+) tok/s")
_DEVICE_RE = re.compile(r"device=(.+?) layers=(\d+)")


def read_text(path) -> list[dict]:
  """Rows parsed from the printed output of eval_acceptance.py / bench_context_decode.py."""
  rows, table, ceil, device, layers = [], None, None, None, None
  src = _stem(path)
  with open(path, errors="replace") as f:
    for line in f:
      if m := _DEVICE_RE.search(line):
        device, layers = m.group(1), int(m.group(2))
      elif m := _CEIL_RE.search(line):
        ceil = dict(copy_tbps=float(m.group(1)), mm_tflops=float(m.group(2)))
      elif m := _TABLE_RE.search(line):
        table = dict(kind="phases", mode=m.group(1), ctx=int(m.group(2)), ceil=ceil, rows=[],
                     source=src, device=device)
        rows.append(table)
      elif m := _ACCEPT_RE.match(line):
        budget = None if m.group(2) == "-" else int(m.group(2))
        rows.append(dict(kind="accept", mode=m.group(1), budget=budget,
                         mean_accept_len=float(m.group(3)), tokens_per_s=float(m.group(4)),
                         speedup_vs_ar=float(m.group(5)), same_tokens_as_ar=m.group(6) == "True",
                         source=src))
      elif (m := _PHASE_RE.match(line)) and table is not None:
        ms, _, mb, gf, floor, pct = map(float, m.groups()[1:])
        table["rows"].append(dict(phase=m.group(1), ms=ms, bytes=mb * 1e6, flops=gf * 1e9,
                                  floor_ms=floor, pct_roofline=pct))
      elif m := _THRU_RE.search(line):
        ctx, mode, ms, tps = int(m.group(1)), m.group(2), float(m.group(3)), float(m.group(4))
        rows.append(dict(kind="throughput", mode=mode, ctx=ctx, ms_per_step=ms,
                         tokens_per_s=tps, source=src, device=device, layers=layers))
  return rows


def load(paths) -> dict[str, list[dict]]:
  """{kind: rows} over files (.jsonl / .json read as JSON lines, anything else as text)."""
  out = collections.defaultdict(list)
  for p in paths:
    rows = read_jsonl(p) if p.endswith((".jsonl", ".json")) else read_text(p)
    for r in rows:
      out[r["kind"]].append(r)
  return dict(out)


def find_results(root="results") -> list[str]:
  """Every .jsonl / .txt under `root` (sorted; no training logs; X.txt skipped next to X.jsonl)."""
  found = []
  for d, _, files in os.walk(root):
    found += [os.path.join(d, f) for f in files if f.endswith((".jsonl", ".txt"))
              and not f.startswith("train_") and not (f.endswith(".txt") and
                                                      f[:-4] + ".jsonl" in files)]
  return sorted(found)


# ---- acceptance and throughput --------------------------------------------------------------
def plot_acceptance(ax, rows):
  """Mean accepted tokens per step vs DDTree budget, one series per source, chain as a line."""
  for i, (src, rs) in enumerate(_by(rows, "source").items()):
    tree = sorted((r for r in rs if r["mode"] == "ddtree"), key=lambda r: r["budget"])
    color = f"C{i}"
    ax.plot([r["budget"] for r in tree], [r["mean_accept_len"] for r in tree], "o-", color=color,
            label=f"ddtree ({src})")
    for r in rs:
      if r["mode"] == "chain":
        ax.axhline(r["mean_accept_len"], color=color, ls="--", lw=1, label=f"chain ({src})")
  ax.set_xscale("log", base=2)
  ax.set(xlabel="tree budget (nodes)", ylabel="mean accepted tokens / step",
         title="acceptance vs budget")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)


def plot_throughput(ax, rows, key="tokens_per_s"):
  """Tokens/s (or ms/step) vs context, one line per (source, mode)."""
  for (src, mode), rs in _by(rows, "source", "mode").items():
    rs = sorted(rs, key=lambda r: r["ctx"])
    ax.plot([r["ctx"] for r in rs], [r[key] for r in rs], MODE_STYLE.get(mode, "o-"),
            label=f"{mode} ({src})")
  ax.set_xscale("log")
  ax.set(xlabel="context length", ylabel=key.replace("_", " "),
         title="decode throughput vs context")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)


def plot_budget_eval(ax, rows, title="simulated tokens/s vs context"):
  """scripts/eval_budget.py rows of one cost model: simulated tokens/s vs context per run
  (ar, chain, each fixed budget, the per-step switch 'auto' bold, decode's whole-program auto
  dashed)."""
  for (mode, budget), rs in _by(rows, "mode", "budget").items():
    rs = sorted(rs, key=lambda r: r["ctx"])
    name = {"ddtree": f"budget {budget}", "auto": "auto (per-step switch)",
            "auto_program": "auto (whole program)"}.get(mode, mode)
    style = {"auto": "s-", "auto_program": "D--"}.get(mode, "o-")
    ax.plot([r["ctx"] for r in rs], [r["simulated_tokens_per_s"] for r in rs], style,
            lw=3 if mode.startswith("auto") else 1, label=name)
  ax.set_xscale("log")
  ax.set(xlabel="context length", ylabel="simulated tokens / s", title=title)
  ax.title.set_fontsize(8)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)


def plot_moe(ax, rows):
  """Routed-expert FFN (grouped_matmul/bench.py `ffn`): % of the copy bandwidth vs verify width T,
  one line per (file, weight format, grouped matmul)."""
  ffn = [r for r in rows if r.get("part") == "ffn" and "pct_copy" in r]
  for (src, fmt, impl), rs in sorted(_by(ffn, "source", "fmt", "impl").items()):
    rs = sorted(rs, key=lambda r: r["T"])
    ax.plot([r["T"] for r in rs], [r["pct_copy"] for r in rs], marker="o",
            linestyle="-" if impl == "pallas" else "--", label=f"{fmt} {impl} ({src})")
  ax.set_xlabel("verify width T (tokens)")
  ax.set_ylabel("% of copy bandwidth (bytes of the experts touched)")
  ax.set_title("routed experts: top-8 of 384, 48 held")
  ax.set_ylim(0, 110)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _by(rows, *keys):
  groups = collections.OrderedDict()
  for r in rows:
    groups.setdefault(tuple(r.get(k) for k in keys) if len(keys) > 1 else r.get(keys[0]),
                      []).append(r)
  return groups


# ---- phases and roofline --------------------------------------------------------------------
def phase_dict(table) -> dict[str, dict]:
  return {r["phase"]: r for r in table["rows"]}


def plot_phases(ax, table):
  """Stacked bars: phases' ms (each compiled alone) vs their roofline floors; fused step dashed."""
  ph = phase_dict(table)
  names = [p for p in STACK_PHASES if p in ph]
  for x, key in enumerate(("ms", "floor_ms")):
    bottom = 0.0
    for p in names:
      v = max(ph[p][key], 0.0)
      ax.bar(x, v, bottom=bottom, color=PHASE_COLORS[p], edgecolor="k", lw=0.4,
             label=p if x == 0 else None)
      if v > 0.04 * max(ph.get("step", {}).get("ms", 1.0), 1e-9):
        ax.text(x, bottom + v / 2, f"{p} {v:.2f}", ha="center", va="center", fontsize=7)
      bottom += v
  if "step" in ph:
    ax.axhline(ph["step"]["ms"], color="k", ls="--", lw=1,
               label=f"fused step {ph['step']['ms']:.2f} ms")
  ax.set_xticks([0, 1], ["measured (alone)", "roofline floor"])
  ax.set_xlim(-0.6, 2.6)
  ax.set_ylabel("ms per step")
  ax.set_title(f"phases: {table['mode']} ctx={table['ctx']} ({table.get('source', '')})",
               fontsize=9)
  handles, labels = ax.get_legend_handles_labels()
  ax.legend(handles[::-1], labels[::-1], fontsize=7, loc="upper right")


def achieved(row):
  """(TB/s, TFLOP/s) a phase row achieved."""
  s = row["ms"] / 1e3
  return (row["bytes"] / s / 1e12, row["flops"] / s / 1e12) if s > 0 else (0.0, 0.0)


def plot_roofline(ax, table, kernels=()):
  """Log-log roofline: achieved TFLOP/s vs FLOP/byte per phase (and kernel rows) under ceilings."""
  ceil = table.get("ceil") or (kernels[0].get("ceil") if kernels else None)
  if ceil:
    ai = np.logspace(-1, 4, 200)
    ax.plot(ai, np.minimum(ceil["mm_tflops"], ai * ceil["copy_tbps"]), "k-", lw=1.5,
            label=f"ceiling: {ceil['copy_tbps']:.2f} TB/s, {ceil['mm_tflops']:.0f} TFLOP/s")
  for p, r in phase_dict(table).items():
    if r["bytes"] > 0 and r["flops"] > 0 and r["ms"] > 0:
      _, tf = achieved(r)
      ax.plot(r["flops"] / r["bytes"], tf, "o", color=PHASE_COLORS.get(p, "k"), mec="k",
              ms=8 if p == "step" else 6)
      ax.annotate(p, (r["flops"] / r["bytes"], tf), fontsize=7, xytext=(4, 2),
                  textcoords="offset points")
  for r in kernels:
    if r.get("bytes") and r.get("flops"):
      ax.plot(r["flops"] / r["bytes"], r["tflops"], "x", color="gray",
              label=f"attn kernels ({r['source']})" if r is kernels[0] else None)
  ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)",
         ylabel="achieved TFLOP/s", title="roofline (phases alone)")
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=7, loc="lower right")


def plot_bandwidth(ax, table):
  """Achieved TB/s per phase (bars) vs the measured copy ceiling; % of roofline as text."""
  ph = phase_dict(table)
  names = [p for p in STACK_PHASES + ("step",) if p in ph]
  tbps = [achieved(ph[p])[0] for p in names]
  ax.barh(names, tbps, color=[PHASE_COLORS.get(p, "#999999") for p in names], edgecolor="k", lw=0.4)
  for y, p in enumerate(names):
    ax.text(tbps[y], y, f" {ph[p].get('pct_roofline', 0):.0f}% roof", va="center", fontsize=7)
  if table.get("ceil"):
    ax.axvline(table["ceil"]["copy_tbps"], color="k", ls="--", label="copy ceiling")
    ax.legend(fontsize=7)
  ax.invert_yaxis()
  ax.set(xlabel="achieved TB/s (minimum bytes / time)", title="bandwidth per phase")


# ---- sweep heatmaps -------------------------------------------------------------------------
def sweep_grid(rows, ctx, backend, key="tokens_per_s"):
  """(blocks, columns, values[block, column]) of one context: ddtree budgets, then 'chain'."""
  rs = [r for r in rows if r["ctx"] == ctx and str(r.get("attn_backend")) == str(backend)]
  blocks = sorted({r["block_size"] for r in rs if r["block_size"] is not None})
  budgets = sorted({r["budget"] for r in rs if r["mode"] == "ddtree"})
  cols = [str(b) for b in budgets] + (["chain"] if any(r["mode"] == "chain" for r in rs) else [])
  val = np.full((len(blocks), len(cols)), np.nan)
  for r in rs:
    if r["mode"] == "ar":
      continue
    col = "chain" if r["mode"] == "chain" else str(r["budget"])
    val[blocks.index(r["block_size"]), cols.index(col)] = r[key]
  ar = [r[key] for r in rs if r["mode"] == "ar"]
  return blocks, cols, val, (ar[0] if ar else None)


def plot_sweep(fig, rows, key="tokens_per_s"):
  """One heatmap per (backend, context): block size x budget (+ chain column), cells annotated."""
  panels = sorted({(str(r.get("attn_backend")), r["ctx"]) for r in rows})
  cols = min(len(panels), 3)
  nrows = math.ceil(len(panels) / cols)
  for i, (backend, ctx) in enumerate(panels):
    ax = fig.add_subplot(nrows, cols, i + 1)
    blocks, names, val, ar = sweep_grid(rows, ctx, backend, key)
    im = ax.imshow(val, cmap="viridis", aspect="auto")
    for (y, x), v in np.ndenumerate(val):
      if not np.isnan(v):
        ax.text(x, y, f"{v:.0f}" if v >= 100 else f"{v:.2f}", ha="center", va="center",
                fontsize=7, color="w" if v < np.nanmean(val) else "k")
    ax.set_xticks(range(len(names)), names)
    ax.set_yticks(range(len(blocks)), blocks)
    ax.set(xlabel="budget", ylabel="block size")
    extra = f", ar {ar:.0f}" if ar is not None else ""
    ax.set_title(f"{key} ctx={ctx} {backend}{extra}", fontsize=8)
    fig.colorbar(im, ax=ax, shrink=0.8)
  fig.tight_layout()


# ---- one speculative step: the tree and acceptance --------------------------------------------
def byte_label(tok: int) -> str:
  """A readable label for a byte-level token id."""
  special = {256: "<bos>", 257: "<eos>", 258: "<pad>", 259: "<mask>", 10: "\\n", 9: "\\t",
             32: "␣"}
  if tok in special:
    return special[tok]
  if 33 <= tok < 127:
    return chr(tok)
  return f"x{tok:02x}"


def tree_layout(parents):
  """(x = depth, y = leaf order) per tree index from parents [N] (-1 root / invalid)."""
  n = len(parents)
  kids = [[] for _ in range(n)]
  for i in range(1, n):
    if parents[i] >= 0:
      kids[parents[i]].append(i)
  pos, nxt = {}, [0]

  def place(i, d):
    if not kids[i]:
      pos[i] = (d, float(nxt[0]))
      nxt[0] += 1
    else:
      for k in kids[i]:
        place(k, d + 1)
      pos[i] = (d, float(np.mean([pos[k][1] for k in kids[i]])))

  place(0, 0)
  return pos


def plot_tree(ax, node_tokens, parents, accepted_path=(), root_token=None, label=byte_label):
  """Draws one DDTree (root = bonus token); nodes labelled with tokens, accepted path in red."""
  parents = [int(p) for p in parents]
  pos = tree_layout(parents)
  on_path = set(int(i) for i in accepted_path)
  for i, (x, y) in pos.items():
    if i:
      px, py = pos[parents[i]]
      hot = i in on_path and parents[i] in on_path
      ax.plot([px, x], [py, y], "-", color="C3" if hot else "0.7", lw=2 if hot else 0.8,
              zorder=1)
  for i, (x, y) in pos.items():
    tok = root_token if i == 0 else int(node_tokens[i - 1])
    text = "root" if tok is None else label(tok)
    ax.text(x, y, text, ha="center", va="center", fontsize=7, zorder=3,
            bbox=dict(boxstyle="round,pad=0.2", fc="#fbb4ae" if i in on_path else "w",
                      ec="C3" if i in on_path else "0.5"))
  ax.set_xlim(-0.5, max(x for x, _ in pos.values()) + 0.5)
  ax.set_ylim(max(y for _, y in pos.values()) + 0.5, -0.5)
  ax.set_xlabel("depth (draft position)")
  ax.set_yticks([])
  ax.set_title(f"DDTree: {len(pos) - 1} nodes, {len(on_path) - 1 if on_path else 0} accepted")


def plot_accept_hist(ax, accepted_per_step: dict[str, list[int]]):
  """Histogram of tokens committed per step (root included), one series per mode."""
  hi = max(max(v) for v in accepted_per_step.values() if v)
  bins = np.arange(0.5, hi + 1.5)
  ax.hist(list(accepted_per_step.values()), bins=bins, label=[
      f"{k} (mean {np.mean(v):.2f})" for k, v in accepted_per_step.items()])
  ax.set(xlabel="tokens committed per step", ylabel="steps", title="acceptance per step")
  ax.legend(fontsize=8)
