"""Plain (non-speculative) decoding: the target forward, the prompt prefill and one token per step.

`Plain` is the decoding method `jaxspec.loop` compiles into a prefill and a
`lax.while_loop`; `prefill` is shared with speculative decoding. Row b's token at
position p lives in cache slot p.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec import loop
from jaxspec.layers import causal_mask
from jaxspec.model import LatentCache, Transformer
from jaxspec.sampling import SamplingParams, sample


@struct.dataclass
class DecodeState(loop.LoopState):
    """Plain decoding's loop carry: `LoopState` plus the target cache."""

    cache_len_B: jax.Array  # tokens already in the cache (the last output is not yet)
    cache: LatentCache


def forward(model: Transformer, params, tokens_BT, positions_BT, cache, capture=()):
    """One target forward writing tokens at slot = position, causal attention over the cache."""
    mask = causal_mask(positions_BT, cache.max_len)
    return model.apply({"params": params}, tokens_BT, positions_BT, cache, positions_BT, mask, capture)


def prefill(model: Transformer, params, prompt_BP, prompt_len_B, cache, capture=(), chunk: int = 0):
    """Run right-padded prompts; returns (logits at each row's last prompt token [B,V], cache, aux).

    With 0 < chunk < P the prompt goes through the model `chunk` tokens at a time
    (a `lax.scan`; each chunk attends to the cache the earlier chunks wrote), so
    the attention scores [B,H,chunk,S], the logits and the MoE assignments held at
    once are bounded by the chunk instead of the prompt; the result is the same.
    aux is [B,P,A] for the captured layers (None without capture).

    Padding tokens are written at slots >= prompt_len; decoding overwrites those
    slots before any query can see them (a query at position p sees slots <= p).

    Each MoE layer picks its routed-expert path for the chunk's token count
    (`model.choose_expert_impl`: rows-layout INT4 experts run as grouped matmuls over the
    dequantized local experts when a chunk's assignments would read more bytes through the
    per-assignment gather).
    """
    B, P = prompt_BP.shape
    C = loop.chunk_size(P, chunk)
    tokens = jnp.pad(prompt_BP, ((0, 0), (0, -(-P // C) * C - P)))
    last_idx = prompt_len_B - 1

    def target_chunk(cache, start):
        positions = jnp.broadcast_to(start + jnp.arange(C, dtype=jnp.int32), (B, C))
        toks = jax.lax.dynamic_slice_in_dim(tokens, start, C, axis=1)
        logits, cache, aux = forward(model, params, toks, positions, cache, capture)
        at_last = jnp.take_along_axis(logits, jnp.clip(last_idx - start, 0, C - 1)[:, None, None], axis=1)[:, 0]
        return cache, at_last, aux

    cache, last, aux = loop.scan_chunks(target_chunk, cache, P, chunk, last_idx)
    return last, cache, aux


@dataclasses.dataclass(frozen=True)
class Plain:
    """Plain decoding as a `jaxspec.loop` method: weights are the target's params, caches its
    `LatentCache`; a step is one target forward over each row's last token."""

    model: Transformer
    sp: SamplingParams
    max_new: int
    prefill_chunk: int = 0  # prompt tokens per prefill forward (0: the whole prompt), see `prefill`

    name = "plain"

    def cache_length(self, max_prompt: int) -> int:
        """Cache slots for prompts of up to `max_prompt` tokens (`loop.cache_slots`)."""
        return loop.cache_slots(max_prompt + self.max_new, 1)

    def start(self, params, prompt_BP, prompt_len_B, cache, key, stop_ids) -> DecodeState:
        """Prefill (in chunks of `prefill_chunk` tokens when > 0) and sample the first token."""
        logits, cache, _ = prefill(self.model, params, prompt_BP, prompt_len_B, cache, chunk=self.prefill_chunk)
        key, sub = jax.random.split(key)
        first = sample(logits, sub, self.sp)
        B = prompt_BP.shape[0]
        state = DecodeState(**loop.fresh(B, self.max_new, key), cache_len_B=prompt_len_B, cache=cache)
        return loop.append_tokens(state, first[:, None], jnp.ones(B, jnp.int32), stop_ids, self.max_new)

    def step(self, params, state: DecodeState, stop_ids) -> DecodeState:
        B = state.out_BN.shape[0]
        last = state.out_BN[jnp.arange(B), jnp.maximum(state.num_out_B - 1, 0)]
        pos = state.cache_len_B[:, None]
        with jax.named_scope("target_decode"):
            logits, cache, _ = forward(self.model, params, last[:, None], pos, state.cache)
        key, sub = jax.random.split(state.key)
        token = sample(logits[:, 0], sub, self.sp)
        live = ~state.done_B
        state = loop.append_tokens(state, token[:, None], jnp.ones(B, jnp.int32), stop_ids, self.max_new)
        return state.replace(
            cache_len_B=state.cache_len_B + live.astype(jnp.int32), cache=cache, key=key, steps=state.steps + 1
        )
