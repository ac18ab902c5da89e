"""The 8-GPU full-depth K2.6 step projected from parts measured on this hardware.

  step(8 GPUs) = step of one GPU's share (bench_k26_full, measured on one H200)
               + collectives per step x one all-reduce of the hidden vector (measured on n GPUs)

Assumptions, printed with the table:
- one GPU's share (bench_k26_full: 8 heads, 48 of 384 INT4 experts, F/8 shared and dense MLP,
  V/8 head) runs on each of the 8 GPUs in the time one H200 took for it alone: no expert
  load imbalance (exact for F-sliced experts, `tensor=8`; expert-sharded `expert=8` adds the
  busiest GPU's extra experts), no contention between the GPUs' HBM;
- every collective of the step is latency-bound and costs one measured all-reduce of the
  [1, 7168] hidden vector (bf16; the step's all-gathers are smaller); the count per step is the
  one read from the compiled HLO on 8 simulated devices (tests/test_collectives.py: 2 per target
  layer; once per step 3 in `ar`, 3 + 4 + 2 per draft layer in ddtree);
- the all-reduce latency of 8 GPUs is the one measured on `n` GPUs (NCCL on NVLink: a lower bound
  when n < 8, said in the table).
"""

import dataclasses
import json

PER_TARGET_LAYER = 2        # o all-reduce + one routed+shared psum (tests/test_collectives.py)
ONCE_PER_STEP_AR = 3        # embedding all-reduce + 2 sampling all-gathers
ONCE_PER_STEP_DRAFT = 4     # draft embedding+fc, draft-logits gather, 2 log-softmax all-reduces


def collectives_per_step(mode: str, target_layers: int, draft_layers: int) -> int:
  n = PER_TARGET_LAYER * target_layers + ONCE_PER_STEP_AR
  if mode != "ar":
    n += ONCE_PER_STEP_DRAFT + 2 * draft_layers
  return n


@dataclasses.dataclass(frozen=True)
class Projection:
  mode: str
  budget: int | None
  share_step_ms: float      # measured: one GPU's share, full depth
  collectives: int          # counted (HLO), extrapolated to full depth
  allreduce_us: float       # measured on `gpus` GPUs
  gpus: int

  @property
  def collective_ms(self) -> float:
    return self.collectives * self.allreduce_us / 1e3

  @property
  def step_ms(self) -> float:
    return self.share_step_ms + self.collective_ms


def share_steps(bench_jsonl: str) -> dict[tuple[str, int | None], float]:
  """{(mode, budget): CUPTI ms of the fused step} from bench_k26_full.jsonl's phase tables."""
  out = {}
  with open(bench_jsonl) as f:
    for line in f:
      row = json.loads(line)
      if row.get("kind") != "phases" or row.get("status") != "ok":
        continue
      for r in row["rows"]:
        if r.get("phase") == "step" and r.get("timer") == "cupti":
          out[(row["mode"], row.get("budget"))] = r["ms"]
  return out


def table(projections: list[Projection]) -> str:
  lines = ["| mode | budget | share step ms (1 H200) | collectives/step | all-reduce us "
           "(GPUs) | collectives ms | projected 8-GPU step ms |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for p in projections:
    lines.append(f"| {p.mode} | {p.budget or '-'} | {p.share_step_ms:.2f} | {p.collectives} | "
                 f"{p.allreduce_us:.1f} ({p.gpus}) | {p.collective_ms:.2f} | {p.step_ms:.2f} |")
  return "\n".join(lines)
