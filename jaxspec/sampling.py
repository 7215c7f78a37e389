"""Token sampling: temperature, top-k, top-p, with greedy as a static special case.

`target_probs` defines the distribution plain decoding samples from; speculative
verification accepts and resamples against exactly the same distribution, which
is what makes it lossless.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static (hashable): changing it recompiles the loop."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, found {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), found {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], found {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(logits_V: jax.Array, sp: SamplingParams) -> jax.Array:
    """Probabilities [..., V] after temperature, top-k and top-p filtering (float32)."""
    logits = logits_V.astype(jnp.float32) / sp.temperature
    if sp.top_k:
        kth = jax.lax.top_k(logits, sp.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    if sp.top_p < 1.0:
        # Keep the smallest prefix of tokens (by probability) whose mass reaches top_p.
        sorted_p = jnp.sort(probs, axis=-1)[..., ::-1]
        mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        keep_sorted = mass_before < sp.top_p
        threshold = jnp.min(jnp.where(keep_sorted, sorted_p, jnp.inf), axis=-1, keepdims=True)
        probs = jnp.where(probs >= threshold, probs, 0.0)
        probs = probs / probs.sum(-1, keepdims=True)
    return probs


def sample(logits_BV: jax.Array, key: jax.Array, sp: SamplingParams) -> jax.Array:
    """Next token ids [B] (int32)."""
    if sp.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    probs = target_probs(logits_BV, sp)
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
