"""MLA's per-head products with the absorbed ``kv_b_proj``: Pallas with the Triton lowering.

DeepSeek-V3 / Kimi-K2.5 decoding attends in the latent space: ``kv_b_proj`` ``[L, H, nope + v]``
(L the latent rank) is split into a key half ``w_uk = kv_b[..., :nope]`` and a value half
``w_uv = kv_b[..., nope:]``, and each head's query is taken into the latent space before the
attention, its output out of it after (`model.MLAttention`):

    q_lat[m, h, l] = sum_j q[m, h, j] * kv_b[l, h, j]                 (j < nope)     `absorb_keys`
    out[m, h, c]   = sum_l o[m, h, l] * kv_b[l, h, nope + c]          (c < v)        `absorb_values`

Why kernels: inside the stacked layers' scan XLA slices the layer's ``kv_b`` out of its stack and
transposes each half for its batched dot, so at decode sizes the two products were three dot / copy
kernels (6.3 us a layer at batch 1 on the H200 share, plus o_proj's pad; docs/PERFORMANCE.md, run 15)
for 2 MB of weight. Here each product is one launch that reads the layer's weight in place
(``layer``: the index into the stack ``[num_layers, L, H, nope + v]``) and the query rows where they
are (5.7 us for the two).

Grid ``(rows / 16, H, tiles)``: a program multiplies 16 rows (zero-padded, masked loads) of one
head by one tile of that head's weight on the tensor cores, accumulating in float32 over the
contracted dim in ascending fixed steps, and rounds once to the rows' dtype. Every row goes through
the same sequence of fixed-shape products whatever the row count, so a row's result does not
depend on the rows beside it (a verify row equals the decode step), as for `stacked_matmul`.

``absorb_values(..., padded=True)`` writes the zero-padded rows ``[padded_rows(M), H * v]`` that
`stacked_matmul` reads as its own copy (`stacked.Rows`): ``o_proj`` then needs no pad of its own.

`absorb_keys` also takes over the two small XLA kernels that ran between ``q_b_proj`` and the attention
(at batch 1 on the H200 about 1.0 us and 1.45 us a layer): the query may come as q_b's `stacked.Parts`
(the dense kernel's float32 K parts, not yet added), and with ``rope=`` the call also returns the
query's rotated rope part. Each load of the query adds its K parts in ascending order in float32 and
rounds to the compute dtype, as `stacked.Parts.value` does, so ``q_lat`` has the bits it has from the
summed array. The rotation runs in one extra column tile per (row block, head): grid
``(rows / 16, H, L / bl + 1)``, program ``(i, h, L / bl)`` loads head h's rope columns (the pairs'
first and second members), the rows' positions, builds the float32 angles and the scaled cos / sin
rounded to the compute dtype, and rotates with each product and sum rounded, as `layers.rope` does in
the compute dtype (as `kernels.latent_write` rotates the rope key). One launch for what was three.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxspec import layers, stacked
from jaxspec.kernels import stacked_matmul, with_gradient, with_reference_gradient

try:  # the Triton lowering's masked loads / stores and compiler parameters (GPU builds)
    from jax.experimental.pallas import triton as plgpu
except Exception:  # noqa: BLE001 - optional
    plgpu = None

ROWS = 16  # rows per program (tensor-core minimum for 16-bit inputs)
DEFAULT_CONFIG = {"bl": 64, "bk": 512, "bv": 16, "warps": 4, "stages": 2}
"""``bl``: latent columns per program of `absorb_keys`; ``bk``: latent step and ``bv`` output columns per
program of `absorb_values` (each capped at the dim it tiles). Fixed shapes (never chosen from the row count):
part of the numerics. On the H200 share (8 heads, L = 512, v = 128, one row) `absorb_values` took 7.10 us
a layer with bk 64 / bv 32 (32 programs, each a chain of 8 steps) and 3.45 us with the whole latent dim in
one step and bv 16 (64 programs): docs/PERFORMANCE.md, run 15."""


def _config(overrides) -> dict:
    unknown = set(overrides or {}) - set(DEFAULT_CONFIG)
    if unknown:
        raise ValueError(f"absorb config: unknown keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    return dict(DEFAULT_CONFIG, **(overrides or {}))


def _tile(n: int, want: int) -> int:
    t = int(want)
    while t > 16 and n % t:
        t //= 2
    return t


def shapes_ok(latent: int, nope: int, v: int) -> bool:
    """Whether the kernels take a ``kv_b`` of latent rank `latent` and head dims `nope` + `v`
    (tiles of at least 16 that divide them)."""
    return all(d >= 16 and d % 16 == 0 for d in (latent, nope, v))


def _rows(m0, M, width, clamp=True):
    """The program's 16 rows as indices and which of them are real. Loads clamp the indices inside the
    array; stores keep the rows past M out of bounds and distinct, so that interpret mode's scatter drops
    them rather than write a masked lane's old value over a real row."""
    rows = m0 + jax.lax.broadcasted_iota(jnp.int32, (ROWS, width), 0)
    return (jnp.minimum(rows, M - 1) if clamp else rows), rows < M


def _block(n: int) -> int:
    """The power-of-two block (at least 16) a program holds ``n`` values in (Triton's blocks are powers of two)."""
    return max(16, 1 << (n - 1).bit_length())


def _load_q(q_ref, rows, cols, mask, dt):
    """q at (rows, cols) in the compute dtype ``dt``: q given whole ``[M, H * Q]`` as it lies; q's K parts
    ``[ksplit, Mp, H * Q]`` added in ascending order in float32 and rounded to ``dt`` (`stacked.Parts.value`)."""
    if len(q_ref.shape) == 2:
        return plgpu.load(q_ref.at[rows, cols], mask=mask, other=0)
    acc = None
    for p in range(q_ref.shape[0]):
        v = plgpu.load(q_ref.at[jnp.full(cols.shape, p, jnp.int32), rows, cols], mask=mask, other=0)
        acc = v if acc is None else acc + v
    return acc.astype(dt)


def _keys_kernel(*refs, M, Q, nope, L, wcols, bl, precision, dt, rope):
    if rope is None:
        layer_ref, q_ref, w_ref, o_ref = refs
    else:
        layer_ref, pos_ref, freq_ref, q_ref, w_ref, o_ref, rope_ref = refs
    i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0 = i * ROWS

    def product():
        l0 = j * bl
        lyr = layer_ref[0]
        r_idx, live = _rows(m0, M, nope)
        cols = h * Q + jax.lax.broadcasted_iota(jnp.int32, (ROWS, nope), 1)
        x = _load_q(q_ref, r_idx, cols, live, dt)  # [16, nope]: head h's query rows
        w = w_ref[lyr, pl.ds(l0, bl), pl.ds(h * wcols, nope)]  # [bl, nope]: head h's key half
        acc = jax.lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        r_out, live_out = _rows(m0, M, bl, clamp=False)
        out_cols = h * L + l0 + jax.lax.broadcasted_iota(jnp.int32, (ROWS, bl), 1)
        plgpu.store(o_ref.at[r_out, out_cols], acc.astype(o_ref.dtype), mask=live_out)

    if rope is None:
        product()
        return
    pl.when(j < L // bl)(product)

    @pl.when(j == L // bl)
    def _():
        # head h's rope part of the 16 rows: pair k is (k, half + k), or (2k, 2k + 1) interleaved
        half, il, factor = rope
        r = 2 * half
        f32 = jnp.float32
        wr = _block(half)
        pair = jax.lax.broadcasted_iota(jnp.int32, (ROWS, wr), 1)
        plive = pair < half
        k = jnp.minimum(pair, half - 1)  # the masked lanes load inside the head's columns
        r_idx, live = _rows(m0, M, wr)
        base = h * Q + nope
        first, second = (base + 2 * k, base + 2 * k + 1) if il else (base + k, base + half + k)
        x1 = _load_q(q_ref, r_idx, first, live, dt).astype(f32)
        x2 = _load_q(q_ref, r_idx, second, live, dt).astype(f32)
        pos_rows, pos_live = _rows(m0, M, 1)
        pos = plgpu.load(pos_ref.at[pos_rows], mask=pos_live, other=0)  # [16, 1]: one position a row
        fcol = jax.lax.broadcasted_iota(jnp.int32, (1, wr), 1)
        freq = plgpu.load(freq_ref.at[jnp.minimum(fcol, half - 1)], mask=fcol < half, other=0)  # [1, wr]
        # the rope tables as `layers.rope` makes them: float32 angles, cos and sin scaled, rounded
        angle = pos.astype(f32) * freq
        c, sn = jnp.cos(angle), jnp.sin(angle)
        if factor != 1.0:
            c, sn = c * factor, sn * factor
        rnd = lambda v: v.astype(dt).astype(f32)  # noqa: E731 - one op of the compute dtype
        c, sn = rnd(c), rnd(sn)
        r1 = (rnd(x1 * c) - rnd(x2 * sn)).astype(dt)
        r2 = (rnd(x2 * c) + rnd(x1 * sn)).astype(dt)
        r_out, live_out = _rows(m0, M, wr, clamp=False)
        mask = live_out & plive
        plgpu.store(rope_ref.at[r_out, h * r + pair], r1.astype(rope_ref.dtype), mask=mask)
        plgpu.store(rope_ref.at[r_out, h * r + half + pair], r2.astype(rope_ref.dtype), mask=mask)


def _values_kernel(layer_ref, x_ref, w_ref, o_ref, *, M, L, nope, v, wcols, bk, bv, padded, precision):
    i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0, c0 = i * ROWS, j * bv
    lyr = layer_ref[0]
    r_idx, live = _rows(m0, M, bk)
    kcols = jax.lax.broadcasted_iota(jnp.int32, (ROWS, bk), 1)

    def body(s, acc):
        k0 = s * bk
        x = plgpu.load(x_ref.at[r_idx, h * L + k0 + kcols], mask=live, other=0)  # [16, bk]
        w = w_ref[lyr, pl.ds(k0, bk), pl.ds(h * wcols + nope + c0, bv)]  # [bk, bv]: head h's value half
        return acc + jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, L // bk, body, jnp.zeros((ROWS, bv), jnp.float32))
    y = acc.astype(o_ref.dtype)
    if padded:  # rows past M are zero products (zero inputs): the padded copy's zero rows
        o_ref[pl.ds(m0, ROWS), pl.ds(h * v + c0, bv)] = y
        return
    r_out, live_out = _rows(m0, M, bv, clamp=False)
    out_cols = h * v + c0 + jax.lax.broadcasted_iota(jnp.int32, (ROWS, bv), 1)
    plgpu.store(o_ref.at[r_out, out_cols], y, mask=live_out)


def _check(name, x, kv_b, layer, want_last):
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.triton is not importable")
    in_stack = layer is not None
    w = kv_b if in_stack else kv_b.reshape(1, *kv_b.shape)
    if len(x.shape) < 2 or w.ndim != 4 or x.shape[-2] != w.shape[2] or jnp.dtype(x.dtype) != w.dtype:
        form = "[num_layers, L, H, nope + v] with layer=" if in_stack else "[L, H, nope + v]"
        raise ValueError(
            f"{name}: expected x [..., H, {want_last}] and kv_b {form} of x's dtype; "
            f"found x {x.shape} {x.dtype}, kv_b {kv_b.shape} {kv_b.dtype}"
        )
    return w


def _params(cfg, interpret):
    if interpret or plgpu is None:
        return None
    return plgpu.CompilerParams(num_warps=cfg["warps"], num_stages=cfg["stages"])


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def absorb_keys(q, kv_b, nope: int, *, layer=None, config=None, interpret: bool = False, rope=None):
    """``q_lat [..., H, L]``: each head's first `nope` query dims taken into the latent space by that
    head's key half of ``kv_b``; with ``rope``, ``(q_lat, q_rope)``, ``q_rope [..., H, r]`` the query's
    rope part (its last r = Q - nope dims) rotated as `layers.rope` rotates it.

    q [..., H, Q] (Q >= nope) in the compute dtype, or q_b's `stacked.Parts` of that shape (float32 K parts
    ``[ksplit, Mp >= M, H * Q]``, M the rows of q), added in the kernel as `stacked.Parts.value` adds them:
    the same bits as from the summed array. kv_b [L, H, nope + v] of q's dtype, or with ``layer`` (a scalar
    int, traced or not) the whole stack [num_layers, L, H, nope + v], read in place. Float32 sums, rounded
    once to q's dtype.

    ``rope = (positions, inv_freq, attention_factor, interleaved)``: positions, int, of q's leading shape;
    inv_freq a static float32 [r / 2]; the angles positions x inv_freq in float32, cos and sin times
    ``attention_factor`` rounded to the compute dtype, each product and sum of the rotation rounded, as
    `layers.rope` computes in that dtype; ``interleaved``: the pairs are (2i, 2i + 1), else (i, i + r / 2).
    q_rope is laid out as `layers.rope` returns it: the rotated first members, then the second ones.
    Without ``rope`` the rope part of q is not read.

    Differentiable in q (array or partials) and kv_b: the backward pass is XLA's (the einsums on the layer's
    slice; with partials or ``rope``, XLA's of `reference`)."""
    parts = q.parts if isinstance(q, stacked.Parts) else None
    shape = tuple(q.shape)
    dt = jnp.dtype(q.dtype)
    if parts is not None and dt != jnp.dtype(kv_b.dtype):
        raise ValueError(f"absorb_keys: q's compute dtype {dt.name} (its Parts' dtype) must be kv_b's {kv_b.dtype}")
    w = _check("absorb_keys", q, kv_b, layer, "Q >= nope")
    cfg = _config(config)
    _, L, H, wcols = w.shape
    Q = shape[-1]
    if not (nope <= Q and nope < wcols and shapes_ok(L, nope, wcols - nope)):
        raise ValueError(f"absorb_keys: nope={nope} must fit q's {Q} dims and kv_b's {wcols}; L={L} tiles of 16")
    lead = shape[:-2]
    M = int(np.prod(lead, dtype=np.int64))
    bl = _tile(L, cfg["bl"])
    if parts is not None and (parts.ndim != 3 or parts.shape[1] < M or parts.shape[2] != H * Q):
        raise ValueError(
            f"absorb_keys: q's partials {tuple(parts.shape)} do not hold its {M} rows of H * Q = {H * Q}: "
            f"expected [ksplit, >= {M}, {H * Q}] for q of shape {shape}"
        )
    if parts is not None and parts.dtype != jnp.float32:
        raise ValueError(f"absorb_keys: q's partials must be float32, found {parts.dtype}")
    r = Q - nope
    statics = freq = None  # the rotation's (half, interleaved, attention_factor); inv_freq
    positions = jnp.zeros((0,), jnp.int32)
    if rope is not None:
        if not (isinstance(rope, (tuple, list)) and len(rope) == 4):
            raise ValueError("absorb_keys: rope must be (positions, inv_freq, attention_factor, interleaved)")
        positions, inv_freq, factor, il = rope
        if tuple(positions.shape) != lead or not jnp.issubdtype(positions.dtype, jnp.integer):
            raise ValueError(
                f"absorb_keys: rope's positions {tuple(positions.shape)} {positions.dtype}, expected ints of q's "
                f"leading shape {lead}"
            )
        if r < 2 or r % 2:
            raise ValueError(f"absorb_keys: q's rope part, Q - nope = {Q} - {nope} = {r}, must be even and > 0")
        freq = np.asarray(inv_freq, np.float32)  # static: a constant of the program
        if freq.shape != (r // 2,):
            raise ValueError(f"absorb_keys: rope's inv_freq {freq.shape}, expected ({r // 2},) (r = {r})")
        statics = (r // 2, bool(il), float(factor))
        positions = positions.reshape(M).astype(jnp.int32)

    def forward(q2, w, lyr, pos):
        extra = () if statics is None else (pos, jnp.asarray(freq))
        outs = jax.ShapeDtypeStruct((M, H * L), dt)
        if statics is not None:
            outs = (outs, jax.ShapeDtypeStruct((M, H * r), dt))
        res = pl.pallas_call(
            functools.partial(
                _keys_kernel,
                M=M,
                Q=Q,
                nope=nope,
                L=L,
                wcols=wcols,
                bl=bl,
                precision=_precision(dt),
                dt=dt,
                rope=statics,
            ),
            out_shape=outs,
            grid=(-(-M // ROWS), H, L // bl + (statics is not None)),
            interpret=interpret,
            compiler_params=_params(cfg, interpret),
            name="absorb_keys",
        )(lyr.reshape(1), *extra, q2, w.reshape(w.shape[0], L, H * wcols))
        if statics is None:
            return res.reshape(*lead, H, L)
        return res[0].reshape(*lead, H, L), res[1].reshape(*lead, H, r)

    if parts is None and statics is None:  # the plain product: its own backward pass, no reference traced

        def backward(res, g):
            q, w, lyr = res
            w_uk = jax.lax.dynamic_index_in_dim(w, lyr, 0, False)[..., :nope]
            f32 = jnp.float32
            dq = jnp.einsum("...hl,lhj->...hj", g, w_uk.astype(g.dtype), preferred_element_type=f32)
            dq = jnp.concatenate([dq, jnp.zeros((*dq.shape[:-1], Q - nope), f32)], axis=-1)
            dw = jnp.einsum("...hl,...hj->lhj", g, q[..., :nope].astype(g.dtype), preferred_element_type=f32)
            dw = jnp.concatenate([dw, jnp.zeros((*dw.shape[:-1], wcols - nope), f32)], axis=-1)
            return dq.astype(q.dtype), _into_layer(w, dw, lyr)

        plain = lambda q, w, lyr: forward(q.reshape(M, H * Q), w, lyr, positions)  # noqa: E731
        return with_gradient(plain, backward, nondiff=1)(q, w, _layer(layer))

    def ref(q2, w, lyr, pos):
        qr = stacked.Parts(q2, shape, dt) if parts is not None else q2.reshape(shape)
        _, il, factor = statics or (0, False, 1.0)
        return reference(
            qr, w, nope, layer=lyr, rope=None if statics is None else (pos.reshape(lead), freq, factor, il)
        )

    q2 = parts if parts is not None else q.reshape(M, H * Q)
    return with_reference_gradient(forward, ref, nondiff=2)(q2, w, _layer(layer), positions)


def summed(q):
    """q as an array: q's K parts added in ascending order and rounded (`stacked.Parts.value`, reading the
    partials' ``[ksplit, Mp, H * Q]`` rows as the rows of q [..., H, Q]), or q itself."""
    if not isinstance(q, stacked.Parts):
        return q
    n = int(np.prod(q.shape, dtype=np.int64)) // q.parts.shape[-1]
    return stacked_matmul.sum_parts(q.parts, n).astype(q.dtype).reshape(q.shape)


def reference(q, kv_b, nope: int, *, layer=None, rope=None):
    """`absorb_keys` in XLA ops: q's value (`summed`), its first `nope` dims by the key half of kv_b
    (layer ``layer`` of the stack if given) in float32, rounded to q's dtype; with ``rope`` also
    `layers.rope` of q's rope part."""
    qv = summed(q)
    w = kv_b if layer is None else jax.lax.dynamic_index_in_dim(kv_b, layer, 0, False)
    q_lat = jnp.einsum(
        "...hj,lhj->...hl",
        qv[..., :nope],
        w[..., :nope].astype(qv.dtype),
        precision=_precision(qv.dtype),
        preferred_element_type=jnp.float32,
    ).astype(qv.dtype)
    if rope is None:
        return q_lat
    positions, inv_freq, factor, il = rope
    *lead, H, Q = qv.shape
    M = int(np.prod(lead, dtype=np.int64))
    x = qv[..., nope:].reshape(1, M, H, Q - nope)  # `layers.rope` takes [B, T, ...] rows
    q_rope = layers.rope(x, positions.reshape(1, M), inv_freq, factor, il)
    return q_lat, q_rope.reshape(*lead, H, Q - nope)


def absorb_values(
    o, kv_b, nope: int, *, layer=None, padded: bool = False, config=None, interpret: bool = False
) -> jax.Array:
    """``out [..., H, v]``: each head's latent attention output `o` [..., H, L] taken out of the latent
    space by that head's value half of ``kv_b`` (as `absorb_keys`; float32 sums rounded once to o's dtype).

    ``padded``: return the zero-padded rows ``[stacked_matmul.padded_rows(M), H * v]`` (M: the rows of o,
    the rows past M zero) that `stacked_matmul` takes as its own copy, instead of ``[..., H, v]``."""
    w = _check("absorb_values", o, kv_b, layer, "L")
    cfg = _config(config)
    _, L, H, wcols = w.shape
    v = wcols - nope
    if o.shape[-1] != L or not (0 < nope < wcols and shapes_ok(L, nope, v)):
        raise ValueError(f"absorb_values: o's last dim {o.shape[-1]} must be kv_b's L={L}; nope={nope} of {wcols}")
    lead = o.shape[:-2]
    M = int(np.prod(lead, dtype=np.int64))
    Mp = stacked_matmul.padded_rows(M) if padded else -(-M // ROWS) * ROWS
    bk, bv = _tile(L, cfg["bk"]), _tile(v, cfg["bv"])

    def forward(o, w, lyr):
        out = pl.pallas_call(
            functools.partial(
                _values_kernel,
                M=M,
                L=L,
                nope=nope,
                v=v,
                wcols=wcols,
                bk=bk,
                bv=bv,
                padded=padded,
                precision=_precision(o.dtype),
            ),
            out_shape=jax.ShapeDtypeStruct((Mp if padded else M, H * v), o.dtype),
            grid=(Mp // ROWS, H, v // bv),
            interpret=interpret,
            compiler_params=_params(cfg, interpret),
            name="absorb_values",
        )(lyr.reshape(1), o.reshape(M, H * L), w.reshape(w.shape[0], L, H * wcols))
        return out if padded else out.reshape(*lead, H, v)

    def backward(res, g):
        o, w, lyr = res
        if padded:  # the padding rows are not outputs: their gradient is dropped
            g = g[:M].reshape(*lead, H, v)
        w_uv = jax.lax.dynamic_index_in_dim(w, lyr, 0, False)[..., nope:]
        f32 = jnp.float32
        do = jnp.einsum("...hc,lhc->...hl", g, w_uv.astype(g.dtype), preferred_element_type=f32)
        dw = jnp.einsum("...hl,...hc->lhc", o.astype(g.dtype), g, preferred_element_type=f32)
        dw = jnp.concatenate([jnp.zeros((*dw.shape[:-1], nope), f32), dw], axis=-1)
        return do.astype(o.dtype), _into_layer(w, dw, lyr)

    return with_gradient(forward, backward, nondiff=1)(o, w, _layer(layer))


def _into_layer(w, dw_layer, lyr):
    """The gradient of the whole stack w: `dw_layer` at layer `lyr`, zero elsewhere."""
    return jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(w), dw_layer.astype(w.dtype), lyr, axis=0)


def _layer(layer):
    return jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())


def available(dtype="bfloat16") -> str | None:
    """Why the compiled kernels cannot run with ``dtype`` operands here, or None (one probe per dtype)."""
    return _available(jnp.dtype(dtype).name)


@functools.cache
def _available(dtype: str) -> str | None:
    """A GPU with Pallas' Triton lowering, and first calls of both kernels (a stack of two layers, the
    second read, 3 rows, padded and not; `absorb_keys` also from two K parts with the rope rotation,
    interleaved) within 1e-5 (float32: products that TF32 or bfloat16 would round miss it) or 1e-2
    (bfloat16) of a float64 reference; compiled and run at once (the model first asks inside a trace)."""
    from jaxspec.kernels import gpu_problem, run_compiled

    if (problem := gpu_problem(plgpu)) is not None:
        return problem
    try:
        dt = jnp.dtype(dtype)
        rng = np.random.default_rng(0)
        q = rng.normal(size=(3, 2, 48)).astype(dt)
        o = rng.normal(size=(3, 2, 64)).astype(dt)
        kv_b = (rng.normal(size=(2, 64, 2, 64)) / 8).astype(dt)
        f = np.float64
        want_k = np.einsum("mhj,lhj->mhl", q[..., :32].astype(f), kv_b[1, ..., :32].astype(f))
        want_v = np.einsum("mhl,lhc->mhc", o.astype(f), kv_b[1, ..., 32:].astype(f))
        # q as two K parts (halves: their float32 sum is q exactly), padded rows, rotated at positions pos
        half = np.float32(0.5) * q.astype(np.float32).reshape(3, 96)
        parts = np.stack([np.pad(half, ((0, 13), (0, 0)))] * 2)
        pos = np.array([[0, 7, 9000]], np.int32)
        freq = (1.0 / 10000 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
        angle = (pos[0].astype(np.float32)[:, None] * freq).astype(f)[:, None]  # [3, 1, 8]
        x1, x2 = q[..., 32::2].astype(f), q[..., 33::2].astype(f)
        c, s = 1.25 * np.cos(angle), 1.25 * np.sin(angle)
        want_r = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

        def probe(q, o, w, parts):
            lat, rot = absorb_keys(
                stacked.Parts(parts, (1, 3, 2, 48), dt), w, 32, layer=1, rope=(jnp.asarray(pos), freq, 1.25, True)
            )
            return (
                absorb_keys(q, w, 32, layer=1).astype(jnp.float32),
                absorb_values(o, w, 32, layer=1).astype(jnp.float32),
                absorb_values(o, w, 32, layer=1, padded=True).astype(jnp.float32),
                lat[0].astype(jnp.float32),
                rot[0].astype(jnp.float32),
            )

        got_k, got_v, got_p, got_kp, got_r = run_compiled(probe, q, o, kv_b, parts)
        if not np.array_equal(got_kp, got_k):
            return f"the {dt.name} probe call's product from K parts differs from the summed query's"
        tol = 1e-5 if dt == jnp.float32 else 1e-2
        for got, want in ((got_k, want_k), (got_v, want_v), (got_p[:3].reshape(want_v.shape), want_v), (got_r, want_r)):
            err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            if not err < tol:
                return f"the {dt.name} probe call returned wrong values (relative error {err:.2e}, limit {tol:.0e})"
        if np.any(got_p[3:] != 0):
            return f"the {dt.name} probe call's padding rows are not zero"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"the probe call failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None
