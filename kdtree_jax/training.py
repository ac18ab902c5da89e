"""Training: optimiser + schedule, target and DFlash-draft losses and steps, and the shared loop.

`fit` runs a jitted step, evaluates on fixed held-out batches, prints progress (step / loss /
eval / tokens/s / ETA), appends JSON lines to a log and saves / resumes the train state with
orbax. A run stops at `steps` or `max_seconds` (if > 0), whichever comes first; the learning
rate follows progress = max(step / steps, elapsed / max_seconds), so a time-budgeted run
still warms up and anneals fully.
"""

from __future__ import annotations

import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from kdtree_jax.draft import model as draft_model
from kdtree_jax.target import transformer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# ---- optimiser ---------------------------------------------------------------------------
def lr_at(c, progress: float) -> float:
  """Linear warmup over warmup_frac, then cosine from lr down to lr * min_lr_frac."""
  if progress < c.warmup_frac:
    return c.lr * max(progress, 1e-3 * c.warmup_frac) / c.warmup_frac
  t = min(1.0, (progress - c.warmup_frac) / max(1e-9, 1.0 - c.warmup_frac))
  return c.lr * (c.min_lr_frac + (1 - c.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(c) -> optax.GradientTransformation:
  """AdamW without the lr (applied per step): clip, Adam, decoupled decay of matrices only."""
  return optax.chain(
      optax.clip_by_global_norm(c.grad_clip),
      optax.scale_by_adam(b1=c.b1, b2=c.b2, eps=1e-8),
      optax.add_decayed_weights(c.weight_decay, mask=_matrices))


def _matrices(params):
  """Weight-decay mask: matrices only (no norms, no routing bias)."""
  return jax.tree.map(lambda x: x.ndim >= 2, params)


def apply_updates(opt, params, opt_state, grads, lr):
  """One optimiser step: params - lr * update."""
  updates, opt_state = opt.update(grads, opt_state, params)
  params = jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)
  return params, opt_state


def cast_params(tree, dtype):
  """Casts floating leaves to the compute dtype; MoE `bias` stays f32 (selection only)."""
  def cast(path, x):
    is_bias = jax.tree_util.keystr(path).endswith("['bias']")
    return x if is_bias or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)
  return jax.tree_util.tree_map_with_path(cast, tree)


def cross_entropy(logits, labels):
  """Per-position -log p(label), f32."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


# ---- target: next-token loss + aux-loss-free MoE balancing ---------------------------------
def stop_bias(params):
  """e_score_correction_bias is set by balancing, not by gradient."""
  layers = [dict(lp, moe=dict(lp["moe"], bias=jax.lax.stop_gradient(lp["moe"]["bias"])))
            if "moe" in lp else lp for lp in params["layers"]]
  return dict(params, layers=layers)


def target_loss(cfg, compute_dtype, params, tokens_bs1):
  """Mean next-token cross-entropy on windows [B, S + 1]; aux = per-MoE-layer expert loads [E]."""
  p = cast_params(stop_bias(params), compute_dtype)
  routes = []  # each MoE layer's expert ids [T, K], appended while tracing
  logits, _, _ = transformer.prefill(cfg, p, None, tokens_bs1[:, :-1], routes=routes)
  if len(routes) != cfg.num_moe_layers:
    raise RuntimeError(f"the prefill recorded {len(routes)} MoE layers, not {cfg.num_moe_layers}")
  loss = jnp.mean(cross_entropy(logits, tokens_bs1[:, 1:]))
  loads = [jnp.bincount(idx.reshape(-1), length=cfg.n_routed_experts) / idx.size for idx in routes]
  return loss, loads


def balance_bias(params, loads, rate):
  """DeepSeek-V3 aux-loss-free balancing: bias_e += rate * sign(mean load - load_e)."""
  loads = iter(loads)
  layers = []
  for lp in params["layers"]:
    if "moe" in lp:
      load = next(loads)
      bias = lp["moe"]["bias"] + rate * jnp.sign(jnp.mean(load) - load)
      lp = dict(lp, moe=dict(lp["moe"], bias=bias.astype(lp["moe"]["bias"].dtype)))
    layers.append(lp)
  return dict(params, layers=layers)


def imbalance(loads):
  """Mean over MoE layers of max load / mean load - 1 (0 = perfectly balanced)."""
  if not loads:
    return jnp.zeros(())
  return jnp.mean(jnp.stack([jnp.max(l) / jnp.mean(l) - 1 for l in loads]))


def make_target_step(cfg, opt, c):
  """Jitted (state, (tokens,), lr) -> (state, metrics): AdamW step, then bias balancing."""
  dtype = DTYPES[c.compute_dtype]

  def step(state, batch, lr):
    (loss, loads), grads = jax.value_and_grad(
        lambda p: target_loss(cfg, dtype, p, batch[0]), has_aux=True)(state["params"])
    params, opt_state = apply_updates(opt, state["params"], state["opt_state"], grads, lr)
    params = balance_bias(params, loads, c.bias_update_rate)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "imbalance": imbalance(loads)}
    return {"params": params, "opt_state": opt_state}, metrics

  return jax.jit(step, donate_argnums=0)


def make_target_eval(cfg, batches, compute_dtype):
  """() -> {"eval_loss"} over fixed held-out batches [B, S + 1]."""
  dtype = DTYPES[compute_dtype]
  loss = jax.jit(lambda p, t: target_loss(cfg, dtype, p, t)[0])

  def evaluate(state):
    return {"eval_loss": float(np.mean([loss(state["params"], b) for b in batches]))}

  return evaluate


# ---- draft: DFlash block loss against a frozen target ------------------------------------
def sample_anchors(rng: np.random.Generator, batch: int, seq_len: int, n_anchors: int,
                   block: int) -> np.ndarray:
  """Sorted distinct anchors [B, A] in [1, seq_len - block] (so a + block <= seq_len)."""
  n = seq_len - block
  if n < n_anchors:
    raise ValueError(f"seq_len {seq_len} - block {block} leaves {n} anchor slots < {n_anchors}")
  pick = np.argsort(rng.random((batch, n)), axis=1)[:, :n_anchors]
  return (np.sort(pick, axis=1) + 1).astype(np.int32)


def block_weights(block: int, gamma: float):
  """w_k = exp(-(k - 1) / gamma) for k = 1..block-1; 0 at k = 0 (the known anchor token)."""
  k = jnp.arange(block, dtype=jnp.float32)
  return jnp.where(k >= 1, jnp.exp(-(k - 1) / gamma), 0.0)


def target_taps(tcfg, tparams, tokens_bs, tap_layers, compute_dtype):
  """Teacher-forced target hidden states at tap_layers [B, S, n_tap * D] (no gradient)."""
  _, _, taps = transformer.prefill(tcfg, cast_params(tparams, compute_dtype), None, tokens_bs,
                                   tuple(tap_layers))
  return jax.lax.stop_gradient(taps)


def draft_loss(dcfg, tcfg, compute_dtype, gamma, dparams, tparams, tokens_bs, anchors_ba):
  """Weighted block cross-entropy (normalised by sum of weights) and metrics."""
  taps = target_taps(tcfg, tparams, tokens_bs, dcfg.target_layer_ids, compute_dtype)
  n_block = dcfg.block_size
  pos = anchors_ba[..., None] + jnp.arange(n_block)  # [B, A, block_size]
  labels = jnp.take_along_axis(tokens_bs[:, None, :], pos, axis=-1)
  block = labels.at[..., 1:].set(dcfg.mask_token_id)
  logits = draft_model.draft_train_forward(
      cast_params(dparams, compute_dtype), dcfg, taps, anchors_ba, block,
      tparams["embed"].astype(compute_dtype), tparams["lm_head"].astype(compute_dtype))
  w = block_weights(n_block, gamma)
  ce = cross_entropy(logits, labels)
  loss = jnp.sum(jnp.mean(ce, axis=(0, 1)) * w) / jnp.sum(w)
  hit = (jnp.argmax(logits, -1) == labels)[..., 1:]
  metrics = {"acc1": jnp.mean(hit[..., 0]),  # first masked position
             "prefix_len": 1 + jnp.mean(jnp.sum(jnp.cumprod(hit, axis=-1), axis=-1))}
  return loss, metrics


def make_draft_step(dcfg, tcfg, opt, c):
  """Jitted (state, tparams, (tokens, anchors), lr) -> (state, metrics)."""
  dtype = DTYPES[c.compute_dtype]

  def step(state, tparams, batch, lr):
    tokens, anchors = batch
    (loss, m), grads = jax.value_and_grad(
        lambda p: draft_loss(dcfg, tcfg, dtype, c.gamma, p, tparams, tokens, anchors),
        has_aux=True)(state["params"])
    params, opt_state = apply_updates(opt, state["params"], state["opt_state"], grads, lr)
    m = dict(m, loss=loss, grad_norm=optax.tree.norm(grads))
    return {"params": params, "opt_state": opt_state}, m

  return jax.jit(step, donate_argnums=0)


def make_draft_eval(dcfg, tcfg, tparams, batches, c):
  """() -> {"eval_loss", "eval_acc1", "eval_prefix_len"} over fixed (tokens, anchors) batches."""
  dtype = DTYPES[c.compute_dtype]
  fn = jax.jit(lambda p, tp, t, a: draft_loss(dcfg, tcfg, dtype, c.gamma, p, tp, t, a))

  def evaluate(state):
    outs = [fn(state["params"], tparams, t, a) for t, a in batches]
    res = {"eval_loss": float(np.mean([o[0] for o in outs]))}
    for k in outs[0][1]:
      res["eval_" + k] = float(np.mean([o[1][k] for o in outs]))
    return res

  return evaluate


# ---- the loop ----------------------------------------------------------------------------
def checkpoint_manager(directory: str, keep: int = 2) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(os.path.abspath(directory),
                               options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def restore(mngr, state):
  """(state, step, elapsed) from the latest orbax checkpoint, or the given state at step 0."""
  latest = mngr.latest_step()
  if latest is None:
    return state, 0, 0.0
  full = {"train": state, "step": np.zeros((), np.int64), "elapsed": np.zeros((), np.float64)}
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, full)
  got = mngr.restore(latest, args=ocp.args.StandardRestore(abstract))
  print(f"resumed from {mngr.directory} step {int(got['step'])}", flush=True)
  return got["train"], int(got["step"]), float(got["elapsed"])


def save(mngr, state, step, elapsed):
  full = {"train": state, "step": np.asarray(step, np.int64), "elapsed": np.asarray(elapsed)}
  mngr.save(step, args=ocp.args.StandardSave(full), force=True)


def _fmt_eta(s: float) -> str:
  return f"{s / 60:.1f} min" if s >= 120 else f"{s:.0f} s"


class Logger:
  """Progress lines on stdout and JSON lines in a file."""

  def __init__(self, path: str, c, tokens_per_step: int):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self.f = open(path, "a")
    self.c, self.tokens_per_step = c, tokens_per_step
    self.last_t, self.last_step, self.last_eval = time.time(), None, None

  def train(self, step, elapsed, progress, lr, metrics):
    now = time.time()
    tps = None if self.last_step is None else (
        (step - self.last_step) * self.tokens_per_step / max(now - self.last_t, 1e-9))
    self.last_t, self.last_step = now, step
    eta = elapsed * (1 - progress) / max(progress, 1e-9)
    rec = {"step": step, "elapsed": round(elapsed, 2), "lr": lr,
           "tokens_per_s": None if tps is None else round(tps), **metrics}
    self.write(rec)
    extra = " ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k != "loss")
    ev = "-" if self.last_eval is None else f"{self.last_eval:.4f}"
    speed = "-" if tps is None else f"{tps / 1e3:.1f}k"
    print(f"step {step}/{self.c.steps} ({100 * progress:.0f}%) loss {metrics['loss']:.4f} "
          f"eval {ev} {extra} lr {lr:.2e} | {speed} tok/s | {elapsed:.0f} s | "
          f"ETA {_fmt_eta(eta)}", flush=True)

  def eval(self, step, elapsed, metrics):
    self.last_eval = metrics["eval_loss"]
    self.write({"step": step, "elapsed": round(elapsed, 2), **metrics})
    print(f"  eval @ {step}: " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)

  def write(self, rec):
    self.f.write(json.dumps(rec) + "\n")
    self.f.flush()


def _progress(c, step, elapsed):
  p = step / c.steps
  if c.max_seconds > 0:
    p = max(p, elapsed / c.max_seconds)
  return min(p, 1.0)


def fit(c, state, step_fn, batch_fn, eval_fn, tokens_per_step: int, work_dir: str):
  """Trains until `steps` or `max_seconds`; resumes from work_dir/state. Returns (state, step)."""
  mngr = checkpoint_manager(os.path.join(work_dir, "state"))
  state, step, elapsed0 = restore(mngr, state)
  log = Logger(os.path.join(work_dir, "log.jsonl"), c, tokens_per_step)
  t0 = time.time() - elapsed0
  elapsed = elapsed0
  while _progress(c, step, elapsed) < 1.0:
    lr = lr_at(c, _progress(c, step, elapsed))
    state, metrics = step_fn(state, batch_fn(step), jnp.float32(lr))
    step += 1
    elapsed = time.time() - t0
    done = _progress(c, step, elapsed) >= 1.0
    if step % c.log_every == 0 or done or step == 1:
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
      elapsed = time.time() - t0
      log.train(step, elapsed, _progress(c, step, elapsed), lr, metrics)
    if step % c.eval_every == 0 or done:
      log.eval(step, elapsed, eval_fn(state))
    if c.ckpt_every and (step % c.ckpt_every == 0 or done):
      save(mngr, state, step, elapsed)
  mngr.wait_until_finished()
  mngr.close()
  return state, step
