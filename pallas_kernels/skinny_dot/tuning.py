"""The skinny dot's launch shape: a frozen Tuning and the shape heuristic that picks it.

Letters: M rows of x (<= MAX_ROWS), N rows of w_t (outputs), K the contracted size; BN rows of
w_t per program, BK columns per loop step, S K-splits.

Weight streaming is latency bound at one token: the GPU needs ~4 MB of loads in flight
(4.1 TB/s x ~1 us) spread over 132 SMs, so the heuristic gives every SM >= PROGRAMS_PER_SM
programs (small BN where N is small) and each program ~LOAD_ELEMS weights per loop step (a
16 KB load of bf16). M > 1 uses tl.dot ([16, BK] x [BK, BN]: BN >= 16), so where N / 16 gives
too few programs K is split S ways (partials [S, M, N] f32, then one small XLA sum).
Not yet timed on a GPU: `python -m pallas_kernels.skinny_dot.bench` A/Bs the variants.
"""

import dataclasses

MAX_ROWS = 16        # M up to this: one [16, BK] x tile (tl.dot's smallest M); more: XLA
NUM_SMS = 132        # H200
PROGRAMS_PER_SM = 2
LOAD_ELEMS = 8192    # weights per program per load (16 KB of bf16)
INFLIGHT_ELEMS = 16384  # M = 1: weights per program per loop step, up to (unroll x one load)
MAX_BN = 64


@dataclasses.dataclass(frozen=True)
class Tuning:
  bn: int            # rows of w_t (outputs) per program, a power of 2
  bk: int            # K per loop step, a power of 2 dividing K / splits
  num_warps: int = 4
  num_stages: int = 3
  splits: int = 1    # K split this many ways (partials summed by XLA); 1: none
  unroll: int = 1    # M = 1: BK chunks loaded per loop step before their multiply-adds

  def __str__(self):
    return (f"n{self.bn}k{self.bk}w{self.num_warps}s{self.num_stages}x{self.splits}"
            f"u{self.unroll}")


def parse(name: str) -> Tuning:
  """'n16k512w4s3x1u1' (str(Tuning)) -> Tuning; the w, s, x and u parts are optional."""
  fields, key, num = {}, None, ""
  for ch in name + "$":
    if ch.isdigit():
      num += ch
      continue
    if key is not None:
      fields[key] = int(num)
    key, num = {"n": "bn", "k": "bk", "w": "num_warps", "s": "num_stages", "x": "splits",
                "u": "unroll", "$": None}[ch], ""
  return Tuning(**fields)


def _pow2_divisors(n: int, lo: int, hi: int):
  """Powers of 2 in [lo, hi] that divide n, largest first."""
  return [p for p in (1 << i for i in range(hi.bit_length() - 1, -1, -1)) if lo <= p <= hi
          and n % p == 0]


def rows_block_min(m: int) -> int:
  """The least BN for M rows: 1 for the multiply-sum (M = 1), 16 for tl.dot (M > 1)."""
  return 1 if m == 1 else 16


def default_tuning(m: int, n: int, k: int) -> Tuning:
  """BN: the largest power of 2 (<= MAX_BN) dividing N that still gives PROGRAMS_PER_SM
  programs per SM (else the least BN); S: where N / BN programs are still fewer than that, the
  least divisor of K / BK that reaches it; BK: the largest power of 2 <= LOAD_ELEMS / BN
  dividing K / S; at M = 1 (no tl.dot, so no pipelined shared-memory stages) the unroll: the
  most BK chunks per step (a divisor of the steps) within INFLIGHT_ELEMS, so a small BN
  (K2.6's router: BN 2, BK 1024 by K = 7 x 1024) still has ~28 KB of loads in flight."""
  want = PROGRAMS_PER_SM * NUM_SMS
  lo = rows_block_min(m)
  bns = _pow2_divisors(n, lo, MAX_BN)
  if not bns:
    raise ValueError(f"skinny dot: N={n} has no power-of-2 divisor >= {lo}")
  bn = next((b for b in bns if n // b >= want), bns[-1])
  bk = _pow2_divisors(k, 16, max(16, LOAD_ELEMS // bn))[0]
  steps = k // bk
  splits = next((s for s in range(1, steps + 1) if steps % s == 0 and n // bn * s >= want),
                steps)
  unroll = 1
  if m == 1:
    per = k // splits // bk
    unroll = max(u for u in range(1, per + 1) if per % u == 0 and u * bn * bk <= INFLIGHT_ELEMS)
  return Tuning(bn=bn, bk=bk, splits=splits, unroll=unroll)
