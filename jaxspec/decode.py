"""Prefill and plain (non-speculative) decoding as one compiled `lax.while_loop`.

Rows of a batch carry their own lengths: prompts are right-padded, row b's token
at position p lives in cache slot p, and a row that hits EOS or its token budget
stops growing while the others go on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.layers import causal_mask
from jaxspec.model import LatentCache, Transformer, int4_grouped_impl
from jaxspec.sampling import SamplingParams, sample
from jaxspec.sharding import shards


@struct.dataclass
class DecodeState:
    """Loop carry. Shapes are static; values change every step."""

    out_BN: jax.Array  # generated tokens, -1 where none yet
    num_out_B: jax.Array  # tokens generated so far per row
    done_B: jax.Array  # row finished (EOS or budget)
    cache_len_B: jax.Array  # tokens already in the cache (the last output is not yet)
    cache: LatentCache
    key: jax.Array
    steps: jax.Array  # target forwards run by the loop (scalar)


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

    INT4 routed experts run as grouped matmuls over each layer's dequantized local
    experts when a chunk's assignments would read more bytes through the per-assignment
    gather (`model.int4_grouped_impl`); an `impl` set on the model is kept.
    """
    B, P = prompt_BP.shape
    C = P if chunk <= 0 or chunk >= P else chunk
    if model.impl is None:
        impl = int4_grouped_impl(
            model.cfg, B * C, shards(model.mesh, "expert", model.rules), jnp.dtype(model.dtype).itemsize
        )
        if impl is not None:
            model = model.clone(impl=impl)
    n = -(-P // C)
    tokens = jnp.pad(prompt_BP, ((0, 0), (0, n * C - P)))
    last_idx = prompt_len_B - 1

    def run_chunk(carry, c):
        cache, last = carry
        start = c * C
        positions = jnp.broadcast_to(start + jnp.arange(C, dtype=jnp.int32), (B, C))
        toks = jax.lax.dynamic_slice_in_dim(tokens, start, C, axis=1)
        logits, cache, aux = forward(model, params, toks, positions, cache, capture)
        rel = last_idx - start
        row = jnp.take_along_axis(logits, jnp.clip(rel, 0, C - 1)[:, None, None], axis=1)[:, 0]
        if last is not None:
            row = jnp.where(((rel >= 0) & (rel < C))[:, None], row, last)
        return (cache, row), aux

    if n == 1:
        (cache, last), aux = run_chunk((cache, None), jnp.int32(0))
        return last, cache, aux
    V = model.cfg.vocab_size
    (cache, last), aux = jax.lax.scan(
        run_chunk, (cache, jnp.zeros((B, V), jnp.float32)), jnp.arange(n, dtype=jnp.int32)
    )
    if aux is not None:  # [n, B, C, A] -> [B, P, A]
        aux = jnp.moveaxis(aux, 0, 1).reshape(B, n * C, -1)[:, :P]
    return last, cache, aux


def record(state_out, num_out, done, token_B, stop_ids, max_new: int):
    """Append token_B to rows that are still running; update done flags."""
    B, N = state_out.shape
    live = ~done
    out = state_out.at[jnp.arange(B), jnp.minimum(num_out, N - 1)].set(
        jnp.where(live, token_B, state_out[jnp.arange(B), jnp.minimum(num_out, N - 1)])
    )
    num_out = num_out + live.astype(num_out.dtype)
    hit_stop = jnp.isin(token_B, stop_ids) & live
    done = done | hit_stop | (num_out >= max_new)
    return out, num_out, done


@functools.partial(jax.jit, static_argnames=("model", "sp", "max_new", "prefill_chunk"), donate_argnames=("cache",))
def start(
    model: Transformer,
    params,
    prompt_BP,
    prompt_len_B,
    cache,
    key,
    stop_ids,
    sp: SamplingParams,
    max_new: int,
    prefill_chunk: int = 0,
) -> DecodeState:
    """Prefill (in chunks of `prefill_chunk` tokens when > 0) and sample the first token."""
    logits, cache, _ = prefill(model, params, prompt_BP, prompt_len_B, cache, chunk=prefill_chunk)
    key, sub = jax.random.split(key)
    first = sample(logits, sub, sp)
    B = prompt_BP.shape[0]
    out = jnp.full((B, max_new), -1, jnp.int32)
    out, num_out, done = record(out, jnp.zeros(B, jnp.int32), jnp.zeros(B, bool), first, stop_ids, max_new)
    return DecodeState(out, num_out, done, prompt_len_B, cache, key, jnp.zeros((), jnp.int32))


def decode_step(model: Transformer, params, state: DecodeState, stop_ids, sp: SamplingParams) -> DecodeState:
    B, N = state.out_BN.shape
    last = state.out_BN[jnp.arange(B), jnp.maximum(state.num_out_B - 1, 0)]
    pos = state.cache_len_B[:, None]
    with jax.named_scope("target_decode"):
        logits, cache, _ = forward(model, params, last[:, None], pos, state.cache)
    key, sub = jax.random.split(state.key)
    token = sample(logits[:, 0], sub, sp)
    live = ~state.done_B
    out, num_out, done = record(state.out_BN, state.num_out_B, state.done_B, token, stop_ids, N)
    return DecodeState(out, num_out, done, state.cache_len_B + live.astype(jnp.int32), cache, key, state.steps + 1)


@functools.partial(jax.jit, static_argnames=("model", "sp"), donate_argnames=("state",))
def decode_chunk(model: Transformer, params, state: DecodeState, stop_ids, max_steps, sp: SamplingParams):
    """Run up to `max_steps` decode steps (a traced scalar) or until every row is done."""
    limit = state.steps + max_steps

    def cond(s):
        return (s.steps < limit) & ~jnp.all(s.done_B)

    return jax.lax.while_loop(cond, lambda s: decode_step(model, params, s, stop_ids, sp), state)
