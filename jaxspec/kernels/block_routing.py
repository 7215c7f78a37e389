"""The INT4 expert kernels' routing metadata in one Pallas program (Triton lowering).

``block_metadata(flat, wbits, ...)`` computes what :func:`jaxspec.kernels.int4_moe.route_blocks`
computes with XLA: the (token, k) assignments grouped by local expert into blocks of ``block`` rows
(each expert's block count rounded up to a multiple of ``group``), as

* ``rows [S + 1]``: live rows per block slot (0 for unused slots), ``expert [S + 1]``: each slot's
  expert; the last slot is a spare that no kernel reads;
* ``packed [3, P]``: per block row the token, the assignment ``t*k + j`` and the routing weight's
  float32 bits (padding rows: 0, ``A`` and 0), ``P >= S*block + 1``: rows past ``S*block`` are spare (unwritten);
  With ``layer`` (several layers' experts seen as one array), ``expert`` holds ``layer * num_local`` plus
  the layer's own id: the kernels' index into the stack (an add in XLA would be a launch of its own);
* ``valid [A]``: 1 where the assignment's expert is local (its id, shifted as below, in
  ``[0, num_local)``), else 0: what the combine masks with.

With ``share > 1`` (one device's share of a ``share``-way mesh, ``ModelConfig.share``: benchmarks)
the ids are global, ``share * num_local`` of them, and the program first picks the device that
receives the most of the call's assignments (the lowest device on ties) and moves every id down by
that device's first id, as :func:`jaxspec.kernels.int4_moe.busiest_share` does in XLA; the same
rule for ids outside ``[0, share * num_local)`` too (see ``block_metadata``).

Every store is unmasked or sends its masked-off lanes to a spare entry, so the lanes of one store
that are on never share an address with lanes that are off (Pallas interpret mode writes a masked
lane back as the old value, which would race with a live lane at the same address). Where the lanes
of an unmasked store share an address (``valid``'s lanes past ``A``, clamped to ``A - 1``), they
store the same value.

Why: under XLA the metadata is 4-5 small kernels per layer (the one-hot compare, its sums and
cumulative sums, the scatter of the block rows, the slot owners; ~7 us per layer at batch 1 on
the H200, docs/PERFORMANCE.md); here it is one program of a few passes over the assignments, for
the small calls of decode and verify (``MAX_ASSIGNMENTS``). ``valid`` and, on a mesh share, the
busiest device's choice and shift come with it: in XLA they were four more kernels per layer (the
device counts' scatter-add, their argmax, the subtract and ``valid``'s compare, ~0.8-1 us each at
batch 1 on the H200). The layout of the blocks does not enter any product, so which of the two
builds it never changes an output bit.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # the Triton lowering's load / store with masks and compiler parameters (GPU builds)
    from jax.experimental.pallas import triton as plgpu
except Exception:  # noqa: BLE001 - optional
    plgpu = None

# T * k up to this: the kernel serves (batch 32 x 4 verify tokens x top-8); where a compiled call uses it is
# int4_moe's `meta_max_assignments` (512: XLA's launches are faster on the larger calls)
MAX_ASSIGNMENTS = 1024
ROWS = 128  # packed's length is a multiple of this
ZERO_ROWS = 128  # counters zeroed per step (fewer when the call asks for fewer)
SLOTS = 64  # block slots per step
WARPS = 4  # the warps of `kernels.routing`'s launch where it runs the program after the routing

DEFAULT_CONFIG: dict[str, Any] = {
    # assignments per pass step (fewer when the call has fewer; a power of two from 16 to MAX_ASSIGNMENTS): each
    # pass over the call is ceil(A / chunk) dependent steps. The metadata are the same at any value (integer
    # compares, sums and copies; tested), so it is a speed choice only, as is:
    "chunk": 128,
    # the warps of the program's own launch (`block_metadata`; 1, 2, 4, 8 or 16)
    "warps": 4,
}
"""The metadata program's shape, used unless a sweep sets it (`--kernel-config block_routing=...`): both keys leave
every output bit as it is, so only speed depends on them. On an H100 (docs/PERFORMANCE.md, run 47) the program
took 4.4 us at 8 assignments, 12 at 256 and 42 at 1,024 with chunks of 128 on 4 warps."""


def _config() -> dict[str, Any]:
    cfg = DEFAULT_CONFIG
    chunk, warps = cfg["chunk"], cfg["warps"]
    if not (isinstance(chunk, int) and 16 <= chunk <= MAX_ASSIGNMENTS and chunk & (chunk - 1) == 0):
        raise ValueError(
            f"block_routing.DEFAULT_CONFIG['chunk']: expected a power of two from 16 to {MAX_ASSIGNMENTS}, "
            f"found {chunk!r}"
        )
    if warps not in (1, 2, 4, 8, 16) or not isinstance(warps, int):
        raise ValueError(f"block_routing.DEFAULT_CONFIG['warps']: expected 1, 2, 4, 8 or 16, found {warps!r}")
    return cfg


def available() -> str | None:
    """Why the compiled metadata program cannot run here with :data:`DEFAULT_CONFIG`, or None: the device probe
    that decides where the model uses it (`int4_moe.metadata_problem`, cached per process, so a sweep sets the
    configuration before anything asks)."""
    from jaxspec.kernels import int4_moe  # int4_moe imports this module at its top

    _config()
    return int4_moe.metadata_problem()


class Plan(NamedTuple):
    """The static shape of one call's metadata: what :func:`block_metadata` takes besides the assignments
    (`kernels.routing.route_topk` builds it in its own launch from such a plan)."""

    num_local: int
    slots: int
    block: int
    group: int
    share: int = 1
    counters: int = 0


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def packed_rows(slots: int, block: int) -> int:
    """P: the length of ``packed``'s rows (a multiple of ROWS, at least one spare row past S * block)."""
    return -(-(slots * block + 1) // ROWS) * ROWS


def _busiest_shift(load_ids, steps, *, E, share):
    """The first id of the device (of ``share``, ``E`` experts each) that receives the most of the call's
    assignments, the lowest device on ties: a traced int32 scalar. ``load_ids(c)`` gives chunk c's
    (lanes inside the call, ids). An id in ``[0, share*E)`` counts for device ``id // E``, one in
    ``[-share*E, 0)`` for device ``id // E + share`` and any other for none: ``busiest_share``'s counts
    (an XLA scatter-add, whose negative indices count from the end and whose others past the end are
    dropped). Where no id counts for any device: device 0, as ``argmax`` of zeros. Each id is compared
    with every device's range (no integer division: ``id // E`` of a negative id must round down)."""
    SP = _pow2(share)
    dcol = jax.lax.broadcasted_iota(jnp.int32, (SP,), 0)
    first, is_device = dcol * E, dcol < share

    def tally(c, acc):
        inside, e = load_ids(c)
        g = jnp.where(e < 0, e + share * E, e)  # negative ids count from the last device back
        hit = (g[:, None] >= first[None, :]) & (g[:, None] < first[None, :] + E)
        hit = hit & inside[:, None] & is_device[None, :]
        return acc + jnp.sum(hit.astype(jnp.int32), axis=0)

    counts = jax.lax.fori_loop(0, steps, tally, jnp.zeros((SP,), jnp.int32))
    most = jnp.max(counts)
    device = jnp.min(jnp.where(is_device & (counts == most), dcol, SP))  # the lowest of the busiest
    return device * E


def build(
    read_ids,
    read_wbits,
    layer,
    rows_ref,
    expert_ref,
    packed_ref,
    valid_ref,
    zero_refs,
    *,
    A,
    k,
    E,
    EP,
    S,
    group,
    block,
    C,
    share,
):
    """The metadata program's passes, inside a kernel (this module's own, or `kernels.routing`'s launch that
    routes the tokens first): ``read_ids(src)`` gives the assignments' expert ids at the int32 indices ``src``
    [C] (all in ``[0, A)``), ``read_wbits(src, mask)`` their weights' float32 bits (0 where ``mask`` is off);
    ``layer`` the stacked layer's index (a scalar); the refs are :func:`block_metadata`'s outputs. The static
    keywords come from :func:`statics`."""
    p = packed_rows(S, block)
    base = layer * E  # the layer's first expert in the stacked layers' array (0: one layer)
    ecol = jax.lax.broadcasted_iota(jnp.int32, (EP,), 0)
    is_expert = ecol < E
    steps = -(-A // C)

    def load_ids(c):  # lanes past the call read its last id (always in bounds, so no mask)
        idx = c * C + jax.lax.broadcasted_iota(jnp.int32, (C,), 0)
        return idx < A, read_ids(jnp.minimum(idx, A - 1))

    # With a mesh share the global ids move to the busiest device's local ones (int32 arithmetic, as XLA's
    # subtract: ids far outside wrap alike); otherwise they are local already.
    shift = _busiest_shift(load_ids, steps, E=E, share=share) if share > 1 else 0

    def chunk(c):
        idx = c * C + jax.lax.broadcasted_iota(jnp.int32, (C,), 0)
        inside, e = load_ids(c)
        e = e - shift
        local = (e >= 0) & (e < E)
        valid = inside & local
        onehot = ((e[:, None] == ecol[None, :]) & valid[:, None]).astype(jnp.int32)  # [C, EP]
        return idx, jnp.minimum(idx, A - 1), local, valid, onehot

    def count(c, acc):
        _, src, local, _, onehot = chunk(c)
        # lanes past the call store lane A - 1's value at its address (they read its id): no mask needed
        plgpu.store(valid_ref.at[src], local.astype(jnp.int32))
        return acc + jnp.sum(onehot, axis=0)

    counts = jax.lax.fori_loop(0, steps, count, jnp.zeros((EP,), jnp.int32))
    nblk = ((counts + block - 1) // block + group - 1) // group * group
    bend = jnp.cumsum(nblk)
    bstart = bend - nblk

    for zero_ref in zero_refs:  # the zeroed counters a later kernel of the call asks for (`counters`)
        n = zero_ref.shape[0]
        w = min(ZERO_ROWS, _pow2(n))

        def zeros(c, carry, zero_ref=zero_ref, n=n, w=w):  # lanes past n store 0 at n - 1 too: no mask needed
            r = jnp.minimum(c * w + jax.lax.broadcasted_iota(jnp.int32, (w,), 0), n - 1)
            plgpu.store(zero_ref.at[r], jnp.zeros((w,), jnp.int32))
            return carry

        jax.lax.fori_loop(0, -(-n // w), zeros, 0)

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
        plgpu.store(expert_ref.at[at], jnp.where(on, e, 0) + base)
        # the padding rows' defaults: each slot's rows from its live count on (all of an unused slot's). The
        # live rows are the scatter's below, so no row is stored twice and the two passes need no order. Rows
        # past S * block are spare: no kernel reads them.
        j = jax.lax.broadcasted_iota(jnp.int32, (SLOTS, block), 1)
        pad = on[:, None] & (j >= live[:, None])
        r = jnp.where(pad, s[:, None] * block + j, p - 1)  # lanes off the mask to the spare row
        zero = jnp.zeros((SLOTS, block), jnp.int32)
        plgpu.store(packed_ref.at[0, r], zero, mask=pad)
        plgpu.store(packed_ref.at[1, r], zero + A, mask=pad)
        plgpu.store(packed_ref.at[2, r], zero, mask=pad)
        return carry

    jax.lax.fori_loop(0, -(-(S + 1) // SLOTS), slots, 0)

    def scatter(c, running):
        idx, src, _, valid, onehot = chunk(c)
        before = jnp.cumsum(onehot, axis=0) - onehot + running[None, :]  # earlier assignments, same expert
        rank = jnp.sum(before * onehot, axis=1)
        row = jnp.sum(onehot * bstart[None, :], axis=1) * block + rank
        row = jnp.where(valid, row, p - 1)  # the spare row: never read, so lanes off the mask never collide
        w = read_wbits(src, valid)
        plgpu.store(packed_ref.at[0, row], idx // k, mask=valid)
        plgpu.store(packed_ref.at[1, row], idx, mask=valid)
        plgpu.store(packed_ref.at[2, row], w, mask=valid)
        return running + jnp.sum(onehot, axis=0)

    jax.lax.fori_loop(0, steps, scatter, jnp.zeros((EP,), jnp.int32))


def _kernel(layer_ref, flat_ref, wbits_ref, rows_ref, expert_ref, packed_ref, valid_ref, *zero_refs, **kw):
    build(
        lambda src: plgpu.load(flat_ref.at[src]),
        lambda src, mask: plgpu.load(wbits_ref.at[src], mask=mask, other=0),
        layer_ref[0],
        rows_ref,
        expert_ref,
        packed_ref,
        valid_ref,
        zero_refs,
        **kw,
    )


def statics(a: int, *, k: int, num_local: int, slots: int, block: int, group: int, share: int = 1) -> dict:
    """:func:`build`'s static keywords for ``a`` assignments (checked as :func:`block_metadata` says)."""
    if not 1 <= a <= MAX_ASSIGNMENTS:
        raise ValueError(f"block_metadata: {a} assignments; the kernel serves 1..{MAX_ASSIGNMENTS}")
    if not isinstance(share, int) or share < 1:
        raise ValueError(f"block_metadata: share must be an int >= 1, found {share!r}")
    C = min(_config()["chunk"], _pow2(a))
    return dict(A=a, k=k, E=num_local, EP=_pow2(num_local), S=slots, group=group, block=block, C=C, share=share)


def out_shapes(a: int, slots: int, block: int, counters: int = 0) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes of :func:`block_metadata`'s outputs for ``a`` assignments (the counters' where asked)."""
    return (
        jax.ShapeDtypeStruct((slots + 1,), jnp.int32),
        jax.ShapeDtypeStruct((slots + 1,), jnp.int32),
        jax.ShapeDtypeStruct((3, packed_rows(slots, block)), jnp.int32),
        jax.ShapeDtypeStruct((a,), jnp.int32),
        *((jax.ShapeDtypeStruct((counters,), jnp.int32),) if counters else ()),
    )


def block_metadata(
    flat: jax.Array,
    wbits: jax.Array,
    *,
    k: int,
    num_local: int,
    slots: int,
    block: int,
    group: int,
    interpret: bool,
    share: int = 1,
    layer: jax.Array | int | None = None,
    counters: int = 0,
) -> tuple[jax.Array, ...]:
    """(rows [S + 1], expert [S + 1], packed [3, P], valid [A]) int32 for the assignments ``flat`` [A] with
    weights' float32 bits ``wbits`` [A]; see the module docstring.

    ``flat``: local expert ids (others are not local), or with ``share > 1`` global ids of ``share``
    devices of ``num_local`` experts each, of which the busiest device's are kept (lowest device on ties)
    and moved to ``[0, num_local)``. Ids outside ``[0, share * num_local)`` count as
    ``busiest_share``'s scatter-add counts them: one in ``[-share * num_local, 0)`` for device
    ``id // num_local + share`` (a negative index counts from the end), any other for no device; every
    id, these too, is then moved by the same offset. ``layer`` (a scalar int, may be traced): ``expert``
    counts from ``layer * num_local`` (module docstring). ``counters`` > 0: a fifth output, that many
    int32 zeros (a later kernel's atomic counters; zeroed here, where a memset would be a launch)."""
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.triton is not importable")
    (a,) = flat.shape
    if wbits.shape != (a,) or flat.dtype != jnp.int32 or wbits.dtype != jnp.int32:
        raise ValueError(f"block_metadata: expected int32 [A] ids and weight bits, found {flat.shape}, {wbits.shape}")
    kw = statics(a, k=k, num_local=num_local, slots=slots, block=block, group=group, share=share)
    params = None if interpret else plgpu.CompilerParams(num_warps=_config()["warps"], num_stages=1)
    return pl.pallas_call(
        functools.partial(_kernel, **kw),
        out_shape=out_shapes(a, slots, block, counters),
        grid=(1,),
        interpret=interpret,
        compiler_params=params,
        name="int4_moe_blocks",
    )(jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1), flat, wbits)
