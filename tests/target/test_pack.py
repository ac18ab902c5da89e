"""target.pack's decode layout (q_a | kv_a, gate | up, router | shared gate | up as one dot each):
the same logits as the per-layer weights through the HF-parity path (f32), on the HF fixtures
(every fixture's MLA / routing variant), in prefill, one-token decode and tree decode; the packed
prefill still matches HF's own logits; speculative decoding on packed params stays lossless."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax
from kdtree_jax.decoding import loop
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.draft import model as DM
from kdtree_jax.draft.config import DraftConfig
from kdtree_jax.pair import Pair
from kdtree_jax.target import config as C
from kdtree_jax.target import mla
from kdtree_jax.target import pack
from kdtree_jax.target import params as P
from kdtree_jax.target import transformer as T
from kdtree_jax.target.cache import LatentCache

FIXTURE_ROOT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
FIXTURES = sorted(d for d in (os.listdir(FIXTURE_ROOT) if os.path.isdir(FIXTURE_ROOT) else [])
                  if os.path.exists(os.path.join(FIXTURE_ROOT, d, "reference.npz")))
# f32 rounding: the packed layout's out-major dots (`pack.dot_t`) sum in another order than the
# per-layer weights' dots on XLA's CPU backend (not bitwise equal: a [1, 256] x [256, 96] dot
# differs by ~1e-6 relative, each form within f32 rounding of the float64 product), and the
# order depends on the CPU's vector ISA (1.09e-6 on k2_qlora_yarn32's one-token step on an AMD
# EPYC, under 1e-6 on the machines before). The brief's f32 bound; a wrong packing is >= 1e-3.
SAME_REL = 1e-5
HF_REL = 1e-4    # tests/target/test_hf_parity.py's tolerance against HF's own logits


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_packed_layout_replaces_the_per_layer_weights():
  cfg = C.tiny()
  params = P.init_params(jax.random.key(0), cfg, jnp.bfloat16)
  packed = pack.pack_for_decode(cfg, params)
  assert "qkv_a_t" in packed["layers"][0]["attn"] and "qkv_a_t" not in params["layers"][0]["attn"]
  attn, moe = packed["layers"][1]["attn"], packed["layers"][1]["moe"]
  mlp = packed["layers"][0]["mlp"]
  assert "q_a" not in attn and "kv_a" not in attn and "kv_b" not in attn
  assert attn["qkv_a_t"].shape == (cfg.q_lora_rank + cfg.cache_dim, cfg.hidden_size)
  h, r = cfg.num_attention_heads, cfg.kv_lora_rank
  dn, pe = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
  assert attn["w_qc_t"].shape == (h, r + pe, dn + pe)
  kv_b = params["layers"][1]["attn"]["kv_b"]  # [[key half, 0], [0, I]], out-major
  np.testing.assert_array_equal(attn["w_qc_t"][:, :r, :dn], jnp.transpose(kv_b[..., :dn], (1, 0, 2)))
  np.testing.assert_array_equal(attn["w_qc_t"][:, r:, dn:],
                                jnp.broadcast_to(jnp.eye(pe), (h, pe, pe)))
  assert not jnp.any(attn["w_qc_t"][:, :r, dn:]) and not jnp.any(attn["w_qc_t"][:, r:, :dn])
  assert attn["w_uv"].shape == (h, cfg.v_head_dim, r)
  q_b, o = params["layers"][1]["attn"]["q_b"], params["layers"][1]["attn"]["o"]
  assert "q_b" not in attn and "o" not in attn
  np.testing.assert_array_equal(attn["q_b_t"], q_b.reshape(cfg.q_lora_rank, -1).T)
  np.testing.assert_array_equal(attn["o_t"], o.reshape(h * cfg.v_head_dim, -1).T)
  assert set(mlp) == {"gate_up_t", "down"}
  shared = params["layers"][1]["moe"]["shared"]
  assert "router" not in moe and set(moe["shared"]) == {"down_t"}
  np.testing.assert_array_equal(moe["shared"]["down_t"], shared["down"].T)
  fs = shared["gate"].shape[1]
  assert moe["router_gate_up_t"].shape == (cfg.n_routed_experts + 2 * fs, cfg.hidden_size)
  assert "q_a" in params["layers"][1]["attn"]  # the input is not changed


def test_an_f32_router_beside_bf16_weights_stays_apart():
  cfg = C.tiny()
  params = P.init_params(jax.random.key(0), cfg, jnp.bfloat16)
  moe = dict(params["layers"][1]["moe"])
  moe["router"] = moe["router"].astype(jnp.float32)
  packed = pack.pack_layer(cfg, dict(params["layers"][1], moe=moe))["moe"]
  assert packed["router"].dtype == jnp.float32 and "router_gate_up_t" not in packed
  assert set(packed["shared"]) == {"gate_up_t", "down_t"}


@pytest.fixture(scope="module", params=FIXTURES)
def fixture_model(request):
  path = os.path.join(FIXTURE_ROOT, request.param)
  cfg, params = kdtree_jax.load_hf_checkpoint(path, dtype=jnp.float32)
  with np.load(os.path.join(path, "reference.npz")) as z:
    tokens, hf_logits = z["tokens"], z["logits"]
  return request.param, cfg, params, pack.pack_for_decode(cfg, params), tokens, hf_logits


def test_packed_prefill_matches_per_layer_and_hf(fixture_model):
  name, cfg, params, packed, tokens, hf_logits = fixture_model
  want = kdtree_jax.forward(cfg, params, tokens)
  got = kdtree_jax.forward(cfg, packed, tokens)
  assert rel(got, want) <= SAME_REL, name
  assert rel(got, hf_logits) < HF_REL, name


def _decode(cfg, params, tokens, split, tree_mask, dtype=jnp.float32, routes=False):
  """Prefill tokens[:, :split], then decode the rest as one step of N tokens at consecutive
  positions under tree_mask [N, N]. Returns (prefill logits, decode logits) and, with routes,
  the decode step's expert ids per MoE layer."""
  b, s = tokens.shape
  cache = LatentCache.zeros(cfg, b, s + 4, dtype)
  first, cache, _ = T.prefill(cfg, params, cache, jnp.asarray(tokens[:, :split]))
  cache = cache.replace(lengths=jnp.full((b,), split, jnp.int32))
  n = s - split
  pos = jnp.broadcast_to(split + jnp.arange(n, dtype=jnp.int32), (b, n))
  mask = jnp.broadcast_to(jnp.asarray(tree_mask), (b, n, n))

  def step(c, t):
    ids = []
    logits = T.decode(cfg, params, c, t, pos, mask, routes=ids)[0]
    return logits, ids

  logits, ids = jax.jit(step)(cache, jnp.asarray(tokens[:, split:]))
  return (first, logits, [np.asarray(i) for i in ids]) if routes else (first, logits)


@pytest.mark.parametrize("n", [1, 5])
def test_packed_decode_matches_per_layer(fixture_model, n):
  """One-token (ar) and 5-node (chain: causal mask) decode steps after a prefill."""
  name, cfg, params, packed, tokens, _ = fixture_model
  split = tokens.shape[1] - n
  mask = np.tril(np.ones((n, n), bool))
  want = _decode(cfg, params, tokens, split, mask)
  got = _decode(cfg, packed, tokens, split, mask)
  for g, w in zip(got, want):
    assert rel(g, w) <= SAME_REL, name


@pytest.mark.parametrize("rq,r", [(96, 32), (24, 16), (16, 16), (40, 16)])
def test_lora_mean_squares_from_one_reduction(rq, r):
  """The c_q and c_kv mean squares of the joined dot's output equal each norm's own mean (f32),
  K2's 1536 | 512 shape among them (as 96 | 32); 40 | 16 (7 rows of 8) too; beyond
  JOINT_NORM_ROWS rows, none."""
  cfg = C.tiny(q_lora_rank=rq, kv_lora_rank=r)
  y = jax.random.normal(jax.random.key(rq), (2, 3, rq + cfg.cache_dim), jnp.float32) * 3
  ms_q, ms_kv = mla.lora_mean_squares(cfg, y)
  for got, part in ((ms_q, y[..., :rq]), (ms_kv, y[..., rq:rq + r])):
    np.testing.assert_allclose(got, jnp.mean(part * part, axis=-1, keepdims=True), rtol=1e-6)
  assert mla.lora_mean_squares(C.tiny(q_lora_rank=17, kv_lora_rank=16), y) == (None, None)


@pytest.mark.parametrize("out_major", [True, False])
def test_packed_decode_matches_per_layer_at_k2_lora_ratio(out_major):
  """Rq = 3 R as in K2 (1536 | 512): packed prefill and 1- / 5-token decode vs per-layer (f32),
  with random norm gains; the fifth session's layout too (out_major=False, the GPU A/B's
  packed_s5)."""
  cfg = C.tiny(q_lora_rank=96, kv_lora_rank=32)
  params = P.init_params(jax.random.key(5), cfg, jnp.float32, std=0.1)
  params["layers"] = [_random_gains(lp, i) for i, lp in enumerate(params["layers"])]
  packed = pack.pack_for_decode(cfg, params, out_major)
  tokens = np.asarray(jax.random.randint(jax.random.key(6), (2, 12), 0, cfg.vocab_size))
  for n in (1, 5):
    mask = np.tril(np.ones((n, n), bool))
    want = _decode(cfg, params, tokens, 12 - n, mask)
    for g, w in zip(_decode(cfg, packed, tokens, 12 - n, mask), want):
      assert rel(g, w) <= SAME_REL, n


def _random_gains(lp, seed):
  """The layer with its attention and q LoRA norm gains drawn around 1 (init_params' are ones:
  a layout that dropped a gain would still pass)."""
  k = jax.random.split(jax.random.key(100 + seed), 2)
  g = lambda key, w: (1 + 0.3 * jax.random.normal(key, w.shape)).astype(w.dtype)
  attn = dict(lp["attn"])
  if "q_a_norm" in attn:
    attn["q_a_norm"] = g(k[1], attn["q_a_norm"])
  return dict(lp, attn_norm=g(k[0], lp["attn_norm"]), attn=attn)


def test_packed_bf16_decode_matches_per_layer():
  """bf16 weights (the 16-bit router branch: router | shared gate | up in one dot with f32
  accumulation, gate/up rounded to bf16): the same expert choices and logits within bf16
  rounding (rel 1e-2) as the per-layer weights, one token and five."""
  cfg = C.tiny()
  params = P.init_params(jax.random.key(3), cfg, jnp.bfloat16, std=0.1)
  packed = pack.pack_for_decode(cfg, params)
  tokens = np.asarray(jax.random.randint(jax.random.key(4), (2, 12), 0, cfg.vocab_size))
  for n in (1, 5):
    mask = np.tril(np.ones((n, n), bool))
    want = _decode(cfg, params, tokens, 12 - n, mask, jnp.bfloat16, routes=True)
    got = _decode(cfg, packed, tokens, 12 - n, mask, jnp.bfloat16, routes=True)
    for g, w in zip(got[:2], want[:2]):
      assert rel(g, w) < 1e-2, n
    for g, w in zip(got[2], want[2]):
      np.testing.assert_array_equal(np.sort(g, -1), np.sort(w, -1))


def _weight_contractions(hlo_text, leaf):
  """[(contracting dims, rank)] of every dot operand that is a parameter named ...____{leaf}__
  in the (pre-optimisation) HLO text: the parameters carry their pytree path as their name."""
  name = re.compile(r"^(\S*____" + leaf + r"__\.\d+)$")
  ranks = {m[1]: len(m[2].split(",")) for m in
           re.finditer(r"(\S+) = \w+\[([\d,]+)\]\S* parameter\(", hlo_text)}
  found = []
  for m in re.finditer(r"dot\((\S+), (\S+)\),([^\n]*)", hlo_text):
    for side, operand in (("lhs", m[1]), ("rhs", m[2])):
      if name.match(operand):
        dims = re.search(side + r"_contracting_dims=\{([\d,]*)\}", m[3])[1]
        found.append((tuple(int(d) for d in dims.split(",")), ranks[operand]))
  return found


def _one_token_step_hlo(cfg, params):
  cache = LatentCache.zeros(cfg, 1, 16, jnp.float32)
  tok, pos = jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32)
  step = lambda p, c: T.decode(cfg, p, c, tok, pos, jnp.ones((1, 1, 1), bool))[0]
  return jax.jit(step).lower(params, cache).compiler_ir("hlo").as_hlo_text()


def test_one_token_dots_contract_the_packed_weights_minor_dim():
  """XLA:GPU rewrites a one-row dot with (N + 1) * K < 10M into multiply + reduce, one row
  reduction when K is the weight's minor dim, else a column reduction in two kernels (target/
  pack.py): in the one-token step's HLO, q_b_t, w_qc_t, o_t and the shared down_t (and the
  joined dots) are contracted on their last (minor, row-major) dim only; in the fifth session's
  layout (out_major=False: q_b, o and the shared down per layer, w_qc [H, Dn + P, R + P]) none
  of those four is (the check can fail)."""
  cfg = C.tiny(v_head_dim=12, moe_intermediate_size=24)  # no square weight: H * Dv != D
  params = P.init_params(jax.random.key(0), cfg, jnp.float32)
  packed = pack.pack_for_decode(cfg, params)
  hlo = _one_token_step_hlo(cfg, packed)
  mla_layers, moe_layers = cfg.num_hidden_layers, cfg.num_hidden_layers - cfg.first_k_dense_replace
  for leaf, layers in (("q_b_t", mla_layers), ("o_t", mla_layers),
                       ("shared____down_t", moe_layers), ("qkv_a_t", mla_layers),
                       ("router_gate_up_t", moe_layers), ("gate_up_t", 1)):
    found = _weight_contractions(hlo, leaf)
    assert len(found) == layers, (leaf, found)
    assert all(dims == (rank - 1,) for dims, rank in found), (leaf, found)
  # w_qc_t at one token: mla._one_token_queries' multiply + sum over its minor dim, no dot
  assert _weight_contractions(hlo, "w_qc_t") == []
  assert len(re.findall(r"reduce\([^\n]*dimensions=\{4\}", hlo)) >= mla_layers
  fifth = _one_token_step_hlo(cfg, pack.pack_for_decode(cfg, params, out_major=False))
  for leaf, layers in (("q_b", mla_layers), ("w_qc", mla_layers), ("o", mla_layers),
                       ("shared____down", moe_layers)):
    found = _weight_contractions(fifth, leaf)
    assert len(found) == layers and all(dims != (rank - 1,) for dims, rank in found), (leaf, found)


@pytest.mark.slow
def test_speculative_decoding_on_packed_params_is_lossless():
  """ar / chain / ddtree on the packed target (loader.load_pair's layout) emit the greedy tokens
  of ar on the per-layer params."""
  tcfg = C.tiny(eos_token_id=None, bos_token_id=None, pad_token_id=None)
  tp = P.init_params(jax.random.key(4), tcfg, jnp.float32, std=0.15)
  dcfg = DraftConfig.tiny(hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size,
                          mask_token_id=tcfg.vocab_size - 1, target_layer_ids=(0, 2),
                          num_target_layers=3, block_size=6)
  dp = DM.init_draft_params(jax.random.key(104), dcfg, tcfg.hidden_size, 2)
  pair = Pair(tcfg, tp, dcfg, dp)
  packed = pair.replace(tparams=pack.pack_for_decode(tcfg, tp))
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
  spec = lambda m: SpecConfig(mode=m, budget=5, max_new_tokens=16, block_size=6)
  want = loop.generate(pair, spec("ar"), prompts, max_len=48).tokens
  for mode in ("ar", "chain", "ddtree"):
    assert loop.generate(packed, spec(mode), prompts, max_len=48).tokens == want, mode


def test_packed_params_are_refused_under_a_mesh():
  """The packed layout is one device's: the sharded MoE path names the error (no KeyError)."""
  from kdtree_jax import sharding  # pylint: disable=import-outside-toplevel
  from kdtree_jax.target import moe  # pylint: disable=import-outside-toplevel
  cfg = C.tiny()
  lp = pack.pack_layer(cfg, P.init_params(jax.random.key(0), cfg, jnp.float32)["layers"][1])
  mesh = sharding.make_mesh("data=1", jax.devices()[:1])
  with sharding.use_mesh(mesh), pytest.raises(ValueError, match="one device"):
    moe.moe(lp["moe"], cfg, jnp.zeros((1, 2, cfg.hidden_size)))


def test_layer_launch_script_counts_fewer_kernels_packed():
  """scripts/target_layer_launches.py (CPU HLO, tiny target, one token): the packed layer runs
  4 fewer matmuls (q_a|kv_a and router|gate|up joined; the one-token kernel queries a
  multiply + reduce, mla._one_token_queries) and fewer kernel-like instructions."""
  import re  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  root = os.path.join(os.path.dirname(__file__), "..", "..")
  out = subprocess.run([sys.executable, os.path.join(root, "scripts", "target_layer_launches.py"),
                        "--model=tiny", "--n=1", "--dtype=float32"], check=True, cwd=root,
                       capture_output=True, text=True).stdout
  assert out.startswith("CPU HLO")
  line = r"(per-layer|packed)\s*:\s+(\d+) kernel-like instructions, (\d+) matmuls"
  counts = {m[0]: (int(m[1]), int(m[2])) for m in re.findall(line, out)}
  assert counts["packed"][1] == counts["per-layer"][1] - 4, out
  assert counts["packed"][0] < counts["per-layer"][0], out


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_packed_int4_experts_are_k_packed_and_give_the_same_moe(backend):
  """pack_for_decode stores INT4 routed stacks K-packed (int4.pack_k: the kernel's 32-bit
  loads); the dequantised weights are unchanged, and the packed MoE layer (XLA, or the
  grouped-matmul kernel in GPU interpret mode reading the K-packed stacks) gives the per-layer
  layer's output: f32 rounding on XLA (the router | shared join reorders no sum), one bf16
  rounding of each product on the kernel."""
  from kdtree_jax.checkpoint import int4  # pylint: disable=import-outside-toplevel
  from kdtree_jax.target import moe  # pylint: disable=import-outside-toplevel
  cfg = C.tiny(hidden_size=128, moe_intermediate_size=64, n_routed_experts=8,
               num_experts_per_tok=3, n_group=1, topk_group=1, expert_backend=backend)
  params = P.init_params(jax.random.key(2), cfg, jnp.bfloat16, int4_experts=True)
  layer = cfg.first_k_dense_replace
  plain = params["layers"][layer]["moe"]
  packed = pack.pack_for_decode(cfg, params)["layers"][layer]["moe"]
  for name in ("gate", "up", "down"):
    assert packed[name].k_packed and not plain[name].k_packed
    np.testing.assert_array_equal(np.asarray(int4.dequantize(packed[name]), np.float32),
                                  np.asarray(int4.dequantize(plain[name]), np.float32))
  x = jax.random.normal(jax.random.key(5), (5, cfg.hidden_size), jnp.bfloat16)
  want = np.asarray(moe.moe(plain, cfg, x), np.float32)
  got = np.asarray(moe.moe(packed, cfg, x), np.float32)
  assert rel(got, want) < (1e-6 if backend == "xla" else 1e-2)


def test_int4_experts_the_packs_cannot_take_stay_plain_together():
  """F = 32 (down's in-dim below the packs' 64-column block): pack_for_decode keeps all three INT4
  stacks plain, not gate and up packed beside a plain down (one expert call reads its stacks in
  one K layout: a mixed set was a ValueError at the first MoE layer), and the layer runs."""
  from kdtree_jax.target import moe  # pylint: disable=import-outside-toplevel
  cfg = C.tiny(hidden_size=128, moe_intermediate_size=32, n_routed_experts=8,
               num_experts_per_tok=3, n_group=1, topk_group=1)
  params = P.init_params(jax.random.key(2), cfg, jnp.bfloat16, int4_experts=True)
  layer = cfg.first_k_dense_replace
  plain = params["layers"][layer]["moe"]
  packed = pack.pack_for_decode(cfg, params)["layers"][layer]["moe"]
  assert [packed[n].k_layout for n in ("gate", "up", "down")] == ["plain"] * 3
  x = jax.random.normal(jax.random.key(5), (5, cfg.hidden_size), jnp.bfloat16)
  assert rel(np.asarray(moe.moe(packed, cfg, x), np.float32),
             np.asarray(moe.moe(plain, cfg, x), np.float32)) < 1e-6


def test_donated_expert_packing_frees_the_input_stacks():
  """pack_for_decode(donate_experts=True) (the loader's): the same K-packed stacks, and the
  input's INT4 buffers are deleted (donated), so a loaded model is not held twice."""
  from kdtree_jax.checkpoint import int4  # pylint: disable=import-outside-toplevel
  cfg = C.tiny(hidden_size=128, moe_intermediate_size=64, n_routed_experts=8,
               num_experts_per_tok=3, n_group=1, topk_group=1)
  params = P.init_params(jax.random.key(2), cfg, jnp.bfloat16, int4_experts=True)
  layer = cfg.first_k_dense_replace
  want = pack.pack_for_decode(cfg, params)["layers"][layer]["moe"]
  stacks = {n: params["layers"][layer]["moe"][n] for n in ("gate", "up", "down")}
  got = pack.pack_for_decode(cfg, params, donate_experts=True)["layers"][layer]["moe"]
  for name, w in stacks.items():
    assert w.packed.is_deleted() and not w.scale.is_deleted()
    assert got[name].k_packed
    np.testing.assert_array_equal(np.asarray(got[name].packed.astype(jnp.int8)),
                                  np.asarray(want[name].packed.astype(jnp.int8)))
    np.testing.assert_array_equal(np.asarray(int4.dequantize(got[name]), np.float32),
                                  np.asarray(int4.dequantize(want[name]), np.float32))


def test_layout_params_hold_one_copy_of_the_experts():
  """pack.layout_params (probe_xla_options --layouts): packed K-packs the experts, donating the
  loaded stacks unless per_layer (which reads them) is asked for too; unknown names are refused."""
  cfg = C.tiny(hidden_size=128, moe_intermediate_size=64, n_routed_experts=8,
               num_experts_per_tok=3, n_group=1, topk_group=1)
  layer = cfg.first_k_dense_replace
  params = P.init_params(jax.random.key(3), cfg, jnp.bfloat16, int4_experts=True)
  both = pack.layout_params(cfg, params, ["per_layer", "packed"])
  assert both["per_layer"] is params and not params["layers"][layer]["moe"]["gate"].packed.is_deleted()
  assert both["packed"]["layers"][layer]["moe"]["gate"].k_packed
  got = pack.layout_params(cfg, params, {"packed"})
  assert params["layers"][layer]["moe"]["gate"].packed.is_deleted()
  for name in ("gate", "up", "down"):
    assert got["packed"]["layers"][layer]["moe"][name].k_packed
  with pytest.raises(ValueError, match="unknown layouts"):
    pack.layout_params(cfg, params, ["packed", "packd"])
