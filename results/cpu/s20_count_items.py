# s20 (CPU): rows per local expert and live work items of the layer part's own routing at T = 65, 16, 9
# run: .venv/bin/python results/cpu/s20_count_items.py (~2 min on 2 cores)
import jax, jax.numpy as jnp, numpy as np
from absl import flags
from kdtree_jax import bench_models
from kdtree_jax.target import params as P, experts
from pallas_kernels.grouped_matmul import bench, work
flags.FLAGS(["x"])
base = bench_models.k26_share(layers=2)
p = P.init_params(jax.random.key(0), base, jnp.bfloat16, int4_experts=True)["layers"][1]["moe"]
for t in (65, 16, 9):
  x, idx = bench._typical_tokens(p, base, t)
  e_l = base.num_local_experts
  ids = np.asarray(idx).reshape(-1)
  sizes = np.bincount(ids[ids < e_l], minlength=e_l)
  live = sizes[sizes > 0]
  row = [t, int(live.size), int(live.sum()), int(live.max())]
  for r in (8, 16, 32):
    it = np.asarray(work.work_list(jnp.asarray(sizes, jnp.int32), t * 8, r)).T
    row.append((r, int((it[:, 3] > 0).sum()), int(sum(1 for a in it if a[3] > 0 and a[2] + a[3] <= 8))))
  print("T, experts, pairs, max rows, (R, live items, items fitting 8 rows):", row, "sizes:", sorted(live.tolist(), reverse=True)[:12])
# the mlp_tune case 65:36 for comparison
flags.FLAGS.unparse_flags(); flags.FLAGS(["x"])
s = np.asarray(bench._mlp_sizes(65, 36))
for r in (8, 16):
  it = np.asarray(work.work_list(jnp.asarray(s, jnp.int32), 520, r)).T
  print("mlp_tune 65:36 R", r, "live items", int((it[:, 3] > 0).sum()))
