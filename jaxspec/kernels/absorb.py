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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxspec.kernels import stacked_matmul

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


def _keys_kernel(layer_ref, q_ref, w_ref, o_ref, *, M, Q, nope, L, wcols, bl, precision):
    i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0, l0 = i * ROWS, j * bl
    lyr = layer_ref[0]
    r_idx, live = _rows(m0, M, nope)
    cols = h * Q + jax.lax.broadcasted_iota(jnp.int32, (ROWS, nope), 1)
    x = plgpu.load(q_ref.at[r_idx, cols], mask=live, other=0)  # [16, nope]: head h's query rows
    w = w_ref[lyr, pl.ds(l0, bl), pl.ds(h * wcols, nope)]  # [bl, nope]: head h's key half
    acc = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
    r_out, live_out = _rows(m0, M, bl, clamp=False)
    out_cols = h * L + l0 + jax.lax.broadcasted_iota(jnp.int32, (ROWS, bl), 1)
    plgpu.store(o_ref.at[r_out, out_cols], acc.astype(o_ref.dtype), mask=live_out)


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
    stacked = layer is not None
    w = kv_b if stacked else kv_b.reshape(1, *kv_b.shape)
    if x.ndim < 2 or w.ndim != 4 or x.shape[-2] != w.shape[2] or x.dtype != w.dtype:
        form = "[num_layers, L, H, nope + v] with layer=" if stacked else "[L, H, nope + v]"
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


def absorb_keys(q, kv_b, nope: int, *, layer=None, config=None, interpret: bool = False) -> jax.Array:
    """``q_lat [..., H, L]``: each head's first `nope` query dims taken into the latent space by that
    head's key half of ``kv_b`` (columns of q past `nope`, the rope part, are not read).

    q [..., H, Q] (Q >= nope); kv_b [L, H, nope + v] of q's dtype, or with ``layer`` (a scalar int, traced
    or not) the whole stack [num_layers, L, H, nope + v], read in place. Float32 sums, rounded once to
    q's dtype. Differentiable in q and kv_b (the backward pass is XLA's einsums on the layer's slice)."""
    w = _check("absorb_keys", q, kv_b, layer, "Q >= nope")
    cfg = _config(config)
    _, L, H, wcols = w.shape
    Q = q.shape[-1]
    if not (nope <= Q and nope < wcols and shapes_ok(L, nope, wcols - nope)):
        raise ValueError(f"absorb_keys: nope={nope} must fit q's {Q} dims and kv_b's {wcols}; L={L} tiles of 16")
    lead = q.shape[:-2]
    M = int(np.prod(lead, dtype=np.int64))
    bl = _tile(L, cfg["bl"])

    def forward(q, w, lyr):
        out = pl.pallas_call(
            functools.partial(
                _keys_kernel, M=M, Q=Q, nope=nope, L=L, wcols=wcols, bl=bl, precision=_precision(q.dtype)
            ),
            out_shape=jax.ShapeDtypeStruct((M, H * L), q.dtype),
            grid=(-(-M // ROWS), H, L // bl),
            interpret=interpret,
            compiler_params=_params(cfg, interpret),
            name="absorb_keys",
        )(lyr.reshape(1), q.reshape(M, H * Q), w.reshape(w.shape[0], L, H * wcols))
        return out.reshape(*lead, H, L)

    def backward(res, g):
        q, w, lyr = res
        w_uk = jax.lax.dynamic_index_in_dim(w, lyr, 0, False)[..., :nope]
        f32 = jnp.float32
        dq = jnp.einsum("...hl,lhj->...hj", g, w_uk.astype(g.dtype), preferred_element_type=f32)
        dq = jnp.concatenate([dq, jnp.zeros((*dq.shape[:-1], Q - nope), f32)], axis=-1)
        dw = jnp.einsum("...hl,...hj->lhj", g, q[..., :nope].astype(g.dtype), preferred_element_type=f32)
        dw = jnp.concatenate([dw, jnp.zeros((*dw.shape[:-1], wcols - nope), f32)], axis=-1)
        return dq.astype(q.dtype), _into_layer(w, dw, lyr), None

    return _differentiable(forward, backward)(q, w, _layer(layer))


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
        return do.astype(o.dtype), _into_layer(w, dw, lyr), None

    return _differentiable(forward, backward)(o, w, _layer(layer))


def _differentiable(forward, backward):
    product = jax.custom_vjp(forward)
    product.defvjp(lambda x, w, lyr: (forward(x, w, lyr), (x, w, lyr)), backward)
    return product


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
    second read, 3 rows, padded and not) within 1e-5 (float32: products that TF32 or bfloat16 would
    round miss it) or 1e-2 (bfloat16) of a float64 reference; compiled and run at once (the model first
    asks inside a trace)."""
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
        got_k, got_v, got_p = run_compiled(
            lambda q, o, w: (
                absorb_keys(q, w, 32, layer=1).astype(jnp.float32),
                absorb_values(o, w, 32, layer=1).astype(jnp.float32),
                absorb_values(o, w, 32, layer=1, padded=True).astype(jnp.float32),
            ),
            q,
            o,
            kv_b,
        )
        tol = 1e-5 if dt == jnp.float32 else 1e-2
        for got, want in ((got_k, want_k), (got_v, want_v), (got_p[:3].reshape(want_v.shape), want_v)):
            err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            if not err < tol:
                return f"the {dt.name} probe call returned wrong values (relative error {err:.2e}, limit {tol:.0e})"
        if np.any(got_p[3:] != 0):
            return f"the {dt.name} probe call's padding rows are not zero"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"the probe call failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None
