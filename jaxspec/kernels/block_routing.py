"""The INT4 expert kernels' routing metadata in one Pallas program (Triton lowering).

``block_metadata(flat, wbits, ...)`` computes what :func:`jaxspec.kernels.int4_moe.route_blocks`
computes with XLA: the (token, k) assignments grouped by local expert into blocks of ``block`` rows
(each expert's block count rounded up to a multiple of ``group``), as

* ``rows [S + 1]``: live rows per block slot (0 for unused slots), ``expert [S + 1]``: each slot's
  expert; the last slot is a spare that no kernel reads;
* ``packed [3, P]``: per block row the token, the assignment ``t*k + j`` and the routing weight's
  float32 bits (padding rows: 0, ``A`` and 0), ``P >= S*block + 1``: rows past ``S*block`` are spare.

Every store is unmasked or sends its masked-off lanes to a spare entry, so the lanes of one store
that are on never share an address with lanes that are off (Pallas interpret mode writes a masked
lane back as the old value, which would race with a live lane at the same address).

Why: under XLA the metadata is 4-5 small kernels per layer (the one-hot compare, its sums and
cumulative sums, the scatter of the block rows, the slot owners; ~7 us per layer at batch 1 on
the H200, docs/PERFORMANCE.md); here it is one program of a few passes over the assignments, for
the small calls of decode and verify (``MAX_ASSIGNMENTS``). The layout of the blocks does not enter
any product, so which of the two builds it never changes an output bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # the Triton lowering's load / store with masks, barrier and compiler parameters (GPU builds)
    from jax.experimental.pallas import triton as plgpu
except Exception:  # noqa: BLE001 - optional
    plgpu = None

MAX_ASSIGNMENTS = 1024  # T * k up to this: the kernel (batch 32 x 4 verify tokens x top-8); above: XLA
CHUNK = 128  # assignments per pass step (fewer when the call has fewer)
ROWS = 128  # block rows per default-filling step
SLOTS = 64  # block slots per step


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def packed_rows(slots: int, block: int) -> int:
    """P: the length of ``packed``'s rows (whole default-filling steps, at least one spare row)."""
    return -(-(slots * block + 1) // ROWS) * ROWS


def _kernel(flat_ref, wbits_ref, rows_ref, expert_ref, packed_ref, *, A, k, E, EP, S, group, block, C, barrier):
    p = packed_rows(S, block)
    ecol = jax.lax.broadcasted_iota(jnp.int32, (EP,), 0)
    is_expert = ecol < E

    def chunk(c):
        idx = c * C + jax.lax.broadcasted_iota(jnp.int32, (C,), 0)
        inside = idx < A
        src = jnp.minimum(idx, A - 1)
        e = plgpu.load(flat_ref.at[src], mask=inside, other=-1)
        valid = inside & (e >= 0) & (e < E)
        onehot = ((e[:, None] == ecol[None, :]) & valid[:, None]).astype(jnp.int32)  # [C, EP]
        return idx, src, valid, onehot

    steps = -(-A // C)
    counts = jax.lax.fori_loop(0, steps, lambda c, acc: acc + jnp.sum(chunk(c)[3], axis=0), jnp.zeros((EP,), jnp.int32))
    nblk = ((counts + block - 1) // block + group - 1) // group * group
    bend = jnp.cumsum(nblk)
    bstart = bend - nblk

    def fill(c, carry):  # padding rows' defaults, all P rows (the live ones are overwritten below)
        r = c * ROWS + jax.lax.broadcasted_iota(jnp.int32, (ROWS,), 0)
        zero = jnp.zeros((ROWS,), jnp.int32)
        plgpu.store(packed_ref.at[0, r], zero)
        plgpu.store(packed_ref.at[1, r], zero + A)
        plgpu.store(packed_ref.at[2, r], zero)
        return carry

    jax.lax.fori_loop(0, p // ROWS, fill, 0)

    def slots(c, carry):
        s = c * SLOTS + jax.lax.broadcasted_iota(jnp.int32, (SLOTS,), 0)
        owner = jnp.sum(((bend[None, :] <= s[:, None]) & is_expert[None, :]).astype(jnp.int32), axis=1)
        e = jnp.minimum(owner, E - 1)
        pick = (e[:, None] == ecol[None, :]).astype(jnp.int32)  # [SLOTS, EP]
        first = jnp.sum(pick * bstart[None, :], axis=1)
        count = jnp.sum(pick * counts[None, :], axis=1)
        live = jnp.where(owner < E, jnp.clip(count - (s - first) * block, 0, block), 0)
        on = s < S
        at = jnp.where(on, s, S)  # lanes past the last slot all go to the spare one
        plgpu.store(rows_ref.at[at], jnp.where(on, live, 0))
        plgpu.store(expert_ref.at[at], jnp.where(on, e, 0))
        return carry

    jax.lax.fori_loop(0, -(-(S + 1) // SLOTS), slots, 0)
    if barrier:  # the defaults above land before the live rows below overwrite them (interpret: in order)
        plgpu.debug_barrier()

    def scatter(c, running):
        idx, src, valid, onehot = chunk(c)
        before = jnp.cumsum(onehot, axis=0) - onehot + running[None, :]  # earlier assignments, same expert
        rank = jnp.sum(before * onehot, axis=1)
        row = jnp.sum(onehot * bstart[None, :], axis=1) * block + rank
        row = jnp.where(valid, row, p - 1)  # the spare row: never read, so lanes off the mask never collide
        w = plgpu.load(wbits_ref.at[src], mask=valid, other=0)
        plgpu.store(packed_ref.at[0, row], idx // k, mask=valid)
        plgpu.store(packed_ref.at[1, row], idx, mask=valid)
        plgpu.store(packed_ref.at[2, row], w, mask=valid)
        return running + jnp.sum(onehot, axis=0)

    jax.lax.fori_loop(0, steps, scatter, jnp.zeros((EP,), jnp.int32))


def block_metadata(
    flat: jax.Array, wbits: jax.Array, *, k: int, num_local: int, slots: int, block: int, group: int, interpret: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(rows [S + 1], expert [S + 1], packed [3, P]) int32 for the assignments ``flat`` [A] (local expert ids;
    others are not local) with weights' float32 bits ``wbits`` [A]; see the module docstring."""
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.triton is not importable")
    (a,) = flat.shape
    if wbits.shape != (a,) or flat.dtype != jnp.int32 or wbits.dtype != jnp.int32:
        raise ValueError(f"block_metadata: expected int32 [A] ids and weight bits, found {flat.shape}, {wbits.shape}")
    if not 1 <= a <= MAX_ASSIGNMENTS:
        raise ValueError(f"block_metadata: {a} assignments; the kernel serves 1..{MAX_ASSIGNMENTS}")
    p = packed_rows(slots, block)
    kernel = functools.partial(
        _kernel,
        A=a,
        k=k,
        E=num_local,
        EP=_pow2(num_local),
        S=slots,
        group=group,
        block=block,
        C=min(CHUNK, _pow2(a)),
        barrier=not interpret,
    )
    params = None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=1)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((slots + 1,), jnp.int32),
            jax.ShapeDtypeStruct((slots + 1,), jnp.int32),
            jax.ShapeDtypeStruct((3, p), jnp.int32),
        ),
        grid=(1,),
        interpret=interpret,
        compiler_params=params,
        name="int4_moe_blocks",
    )(flat, wbits)
