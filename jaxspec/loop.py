"""The generation loop that plain decoding (`jaxspec.decode`) and speculative decoding (`jaxspec.spec`) share.

A decoding method is a static, hashable object (`decode.Plain`, `spec.Speculative`) with

    start(weights, prompt_BP, prompt_len_B, caches, key, stop_ids) -> state   # prefill + first token
    step(weights, state, stop_ids) -> state                                   # one loop iteration

whose state extends `LoopState`: the output buffer, per-row counts and done flags, the
sampling key and the iteration count. `start` and `run_loop` compile a method's two
halves: the prefill, and up to `max_steps` iterations as one `lax.while_loop` that stops
early once every row is done. Weights (parameters, the draft) are arguments of both,
never closed over, and nothing in them leaves the device.

Rows carry their own lengths: prompts are right-padded, and a row that hits a stop
token or its token budget stops growing while the others go on (`append_tokens`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.layers import write_slots


@struct.dataclass
class LoopState:
    """What every loop carry holds; shapes are static, values change every iteration."""

    out_BN: jax.Array  # emitted tokens (target ids), -1 where none yet
    num_out_B: jax.Array  # tokens emitted so far per row
    done_B: jax.Array  # row finished (stop token or budget)
    key: jax.Array
    steps: jax.Array  # loop iterations run (scalar)


SHARED_SLACK = 64  # slots past prompt + max_new that every method's cache has (see `cache_slots`)


def cache_slots(tokens: int, slack: int, limit: int | None = None) -> int:
    """Cache slots for `tokens` (prompt + new tokens) and `slack` more that a method writes past them:
    a multiple of 64, with at least `SHARED_SLACK` of slack. So plain decoding (slack 1) and speculation
    with a tree of up to `SHARED_SLACK` slots of slack (draft tokens + steps + 2) get the same slot
    count: the attention kernel's split plan follows the slot count, and with the same plan a verify row
    has the decode step's bits at any length. Past `limit` (the model's positions) the shared slack
    gives way: only `slack` is added."""
    slots = -(-(tokens + max(slack, SHARED_SLACK)) // 64) * 64
    if limit is not None and slots > limit:
        slots = -(-(tokens + slack) // 64) * 64
    return slots


def fresh(batch: int, width: int, key) -> dict:
    """The `LoopState` fields of a loop that has emitted nothing: an output buffer [batch, width]."""
    return dict(
        out_BN=jnp.full((batch, width), -1, jnp.int32),
        num_out_B=jnp.zeros(batch, jnp.int32),
        done_B=jnp.zeros(batch, bool),
        key=key,
        steps=jnp.zeros((), jnp.int32),
    )


def append_tokens(state: LoopState, new_BT, count_B, stop_ids, max_new: int) -> LoopState:
    """`state` with up to `count` tokens of new_BT appended to each live row, stopping after a stop
    token or at `max_new` tokens; rows that reach either are marked done."""
    B, T = new_BT.shape
    live = ~state.done_B
    d = jnp.arange(T)[None]
    is_stop = jnp.isin(new_BT, stop_ids) & (d < count_B[:, None])
    keep = (d < count_B[:, None]) & (state.num_out_B[:, None] + d < max_new) & live[:, None]
    if T > 1:
        keep = keep & ~(jnp.cumsum(is_stop, axis=1) - is_stop > 0)  # no stop token earlier in this call
    n = keep.sum(1).astype(jnp.int32)
    slots = jnp.where(keep, state.num_out_B[:, None] + d, state.out_BN.shape[1])  # out of range: dropped
    num_out = state.num_out_B + n
    done = state.done_B | (is_stop & keep).any(1) | (num_out >= max_new)
    return state.replace(out_BN=write_slots(state.out_BN, new_BT, slots), num_out_B=num_out, done_B=done)


def chunk_size(length: int, chunk: int) -> int:
    """Tokens per chunk of a `length`-token prompt: `chunk`, or the whole prompt when chunk <= 0 or >= length."""
    return length if chunk <= 0 or chunk >= length else chunk


def scan_chunks(run, carry, length: int, chunk: int, last_B):
    """Chunked prefill: `run` over the chunks [start, start + C) of a `length`-token prompt, C = chunk_size.

    `run(carry, start) -> (carry, at_last, out)`: `at_last` [B, ...] holds each row's values at
    its position `last_B` when that lies in the chunk (anything otherwise); `out` [B, C, ...]
    per-token values, or None. One chunk is one call; more are a `lax.scan`, each chunk seeing
    the carry (caches) the earlier ones wrote. Returns (carry, at_last from the chunk holding
    each row's last position, out over the whole prompt [B, length, ...] or None).
    """
    C = chunk_size(length, chunk)
    n = -(-length // C)
    if n == 1:
        return run(carry, jnp.int32(0))

    def body(c, i):
        carry, kept = c
        carry, at_last, out = run(carry, i * C)
        mine = last_B // C == i  # the chunk holding the row's last position
        pick = lambda new, old: jnp.where(mine.reshape(mine.shape + (1,) * (new.ndim - 1)), new, old)
        return (carry, jax.tree.map(pick, at_last, kept)), out

    at_last_shape = jax.eval_shape(run, carry, jnp.int32(0))[1]
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), at_last_shape)
    (carry, at_last), out = jax.lax.scan(body, (carry, init), jnp.arange(n, dtype=jnp.int32))
    if out is not None:  # [n, B, C, ...] -> [B, length, ...]
        out = jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1).reshape((a.shape[1], n * C) + a.shape[3:])[:, :length], out)
    return carry, at_last, out


def run_steps(method, weights, state: LoopState, stop_ids, max_steps) -> LoopState:
    """Up to `max_steps` (traced) more iterations of `method.step`, or until every row is done."""
    limit = state.steps + max_steps

    def cond(s):
        return (s.steps < limit) & ~jnp.all(s.done_B)

    return jax.lax.while_loop(cond, lambda s: method.step(weights, s, stop_ids), state)


@functools.partial(jax.jit, static_argnames=("method",), donate_argnames=("caches",))
def start(method, weights, prompt_BP, prompt_len_B, caches, key, stop_ids) -> LoopState:
    """Compiled `method.start`: prefill right-padded prompts and emit the first token (the caches are donated)."""
    return method.start(weights, prompt_BP, prompt_len_B, caches, key, stop_ids)


@functools.partial(jax.jit, static_argnames=("method",), donate_argnames=("state",))
def run_loop(method, weights, state: LoopState, stop_ids, max_steps) -> LoopState:
    """Compiled `run_steps`: one `lax.while_loop`, no host transfers inside (the state is donated)."""
    return run_steps(method, weights, state, stop_ids, max_steps)
