"""Token choice from target logits: greedy, or temperature / top-k / top-p sampling.

Sampling every tree node independently from the target's own distribution, then walking from the
root, keeps speculative decoding lossless: each emitted token is a target sample given its
accepted prefix.
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """temperature 0 = greedy argmax; top_k 0 = off; top_p 1.0 = off."""

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"{self.temperature=} must be >= 0")
    if self.top_k < 0:
      raise ValueError(f"{self.top_k=} must be >= 0")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"{self.top_p=} must be in (0, 1]")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def filtered_logits(logits, cfg: SamplingConfig):
  """Logits / temperature with everything outside top-k and the top-p nucleus set to -inf."""
  x = logits.astype(jnp.float32) / cfg.temperature
  if cfg.top_k:
    kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
    x = jnp.where(x < kth, -jnp.inf, x)
  if cfg.top_p < 1.0:
    order = jnp.argsort(-x, axis=-1)
    sorted_x = jnp.take_along_axis(x, order, axis=-1)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
    keep_sorted = before < cfg.top_p
    keep = jnp.zeros_like(keep_sorted).at[
        tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)
    x = jnp.where(keep, x, -jnp.inf)
  return x


def choose(logits, key, cfg: SamplingConfig):
  """[..., V] logits -> [...] int32 token ids (argmax, or one independent sample per position)."""
  if cfg.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, filtered_logits(logits, cfg), axis=-1).astype(jnp.int32)


def target_choice(spec, tree, logits_bnv, key, room_b):
  """The target's own choice at every node [B, N] (per `spec.sampling`) and the commit room,
  unchanged: what `SpecConfig.target_choice` is outside benchmarks. `tree` is unused here."""
  del tree
  return choose(logits_bnv, key, spec.sampling), room_b
