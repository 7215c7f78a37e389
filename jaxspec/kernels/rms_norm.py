"""Residual add + RMSNorm, written as the zero-padded rows the dense kernel reads: Pallas, Triton lowering.

``rms_norm_rows(x, scale, eps, residual=h)`` returns ``(y, s)``: ``s = x + h`` in float32 ``[M, D]``
(the residual stream after the add; no ``s`` without ``h``) and ``y = rms_norm(s)`` rounded to the
compute dtype, as ``stacked_matmul.padded_rows(M)`` rows of which the last ones are zero.

Why: at decode sizes every small XLA kernel of a decoder layer costs about as much as the bytes it
moves is worth, and before each dense projection a layer ran three to five of them: the residual
add, the norm's reduce and its multiply, and one pad per dense kernel call (`stacked_matmul` reads a
zero-padded copy of its rows, for a reason its docstring gives). This kernel is one launch for all of
them: the dense kernels take its rows as their own copy (`stacked.Rows`), and the add's float32 sum
comes out beside them for the residual stream.

Grid ``(padded_rows(M),)``, one row per program: a row is read in chunks of up to 1024 columns, once
for its sum of squares (a float32 vector accumulated chunk by chunk in column order, then reduced
across the vector) and once to scale and round it. A row's bits so depend on that row alone, never on
M or on the other rows (a verify row equals the decode step's row). The rounding is the reference's
(`layers.rms_norm`): the sum rounded to the compute dtype, normalised in float32, rounded, times the
scale, rounded; only the order of the sum of squares differs from XLA's reduction.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxspec.kernels import stacked_matmul

try:  # the Triton lowering's compiler parameters (GPU builds)
    from jax.experimental.pallas import triton as plgpu
except Exception:  # noqa: BLE001 - optional
    plgpu = None

MAX_CHUNK = 1024  # columns a program holds at once (a power of two, as Triton's blocks must be)


def chunk_for(d: int) -> int | None:
    """The columns a program reads at once for a row of ``d``: the largest power of two up to
    `MAX_CHUNK` dividing ``d`` (at least 16), or None if there is none."""
    c = MAX_CHUNK
    while c >= 16:
        if d % c == 0:
            return c
        c //= 2
    return None


def shapes_ok(rows: int, d: int) -> bool:
    """Whether the kernel serves ``rows`` rows of width ``d`` (the dense kernel's row range, and a
    chunk that divides d)."""
    return stacked_matmul.use_kernel(rows) and chunk_for(d) is not None


def _kernel(*refs, m, d, chunk, eps, residual, dtype):
    if residual:
        x_ref, h_ref, scale_ref, y_ref, s_ref = refs
    else:
        (x_ref, scale_ref, y_ref), h_ref, s_ref = refs, None, None
    r = pl.program_id(0)
    n = d // chunk
    f32 = jnp.float32

    def summed(c):  # chunk c of the row after the residual add, float32 [1, chunk]
        s = x_ref[pl.ds(r, 1), pl.ds(c * chunk, chunk)].astype(f32)
        if residual:
            s = s + h_ref[pl.ds(r, 1), pl.ds(c * chunk, chunk)].astype(f32)
        return s

    @pl.when(r < m)
    def _():
        def squares(c, acc):
            s = summed(c)
            if residual:
                s_ref[pl.ds(r, 1), pl.ds(c * chunk, chunk)] = s
            v = s.astype(dtype).astype(f32)
            return acc + v * v

        acc = jax.lax.fori_loop(0, n, squares, jnp.zeros((1, chunk), f32))
        inv = jax.lax.rsqrt(jnp.sum(acc, axis=1, keepdims=True) / d + eps)

        def scaled(c, carry):
            v = summed(c).astype(dtype).astype(f32)
            normed = (v * inv).astype(dtype).astype(f32)
            w = scale_ref[pl.ds(c * chunk, chunk)].astype(f32)
            y_ref[pl.ds(r, 1), pl.ds(c * chunk, chunk)] = (w[None, :] * normed).astype(y_ref.dtype)
            return carry

        jax.lax.fori_loop(0, n, scaled, 0)

    @pl.when(r >= m)
    def _():
        def zero(c, carry):
            y_ref[pl.ds(r, 1), pl.ds(c * chunk, chunk)] = jnp.zeros((1, chunk), y_ref.dtype)
            return carry

        jax.lax.fori_loop(0, n, zero, 0)


def reference(x_MD, scale_D, eps: float, residual=None, dtype=None):
    """The same in XLA ops: (y [M, D] in ``dtype``, unpadded; s [M, D] float32 or None)."""
    dtype = jnp.dtype(dtype or scale_D.dtype)
    s = x_MD.astype(jnp.float32)
    if residual is not None:
        s = s + residual.astype(jnp.float32)
    v = s.astype(dtype).astype(jnp.float32)
    normed = (v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)).astype(dtype)
    return scale_D.astype(dtype) * normed, (s if residual is not None else None)


def rms_norm_rows(x_MD, scale_D, eps: float, *, residual=None, dtype=None, interpret: bool = False):
    """``(y, s)``: ``s = x + residual`` in float32 [M, D] (None without ``residual``), and ``y`` =
    RMSNorm of ``s`` rounded to ``dtype`` (default: the scale's), times ``scale``, in ``dtype``, as
    ``stacked_matmul.padded_rows(M)`` rows [Mp, D] whose rows M.. are zero.

    x: [M, D] float (the float32 residual stream, or a bf16 activation); residual: [M, D] float or
    None; scale: [D]. Differentiable (the backward pass is XLA's, of `reference`)."""
    if x_MD.ndim != 2 or scale_D.shape != (x_MD.shape[1],):
        raise ValueError(f"rms_norm_rows: expected x [M, D] and scale [D], found {x_MD.shape} and {scale_D.shape}")
    if residual is not None and residual.shape != x_MD.shape:
        raise ValueError(f"rms_norm_rows: residual {residual.shape} does not match x {x_MD.shape}")
    M, D = x_MD.shape
    chunk = chunk_for(D)
    if chunk is None:
        raise ValueError(f"rms_norm_rows: D={D} has no power-of-two chunk of at least 16 columns")
    dtype = jnp.dtype(dtype or scale_D.dtype)
    Mp = stacked_matmul.padded_rows(M)
    has_res = residual is not None

    def forward(x, h, scale):
        params = None
        if not interpret and plgpu is not None:
            params = plgpu.CompilerParams(num_warps=4, num_stages=1)
        out_shape = [jax.ShapeDtypeStruct((Mp, D), dtype)]
        if has_res:
            out_shape.append(jax.ShapeDtypeStruct((M, D), jnp.float32))
        outs = pl.pallas_call(
            functools.partial(_kernel, m=M, d=D, chunk=chunk, eps=float(eps), residual=has_res, dtype=dtype),
            out_shape=tuple(out_shape),
            grid=(Mp,),
            interpret=interpret,
            compiler_params=params,
            name="rms_norm_rows",
        )(*((x, h, scale) if has_res else (x, scale)))
        return outs[0], (outs[1] if has_res else None)

    def padded_reference(x, h, scale):
        y, s = reference(x, scale, eps, h, dtype)
        return jnp.pad(y, ((0, Mp - M), (0, 0))), s

    @jax.custom_vjp
    def norm(x, h, scale):
        return forward(x, h, scale)

    def fwd(x, h, scale):
        return forward(x, h, scale), (x, h, scale)

    def bwd(res, gs):
        x, h, scale = res
        gy, gs_ = gs
        _, vjp = jax.vjp(padded_reference, x, h, scale)
        if gs_ is None or not has_res:
            gs_ = None if not has_res else jnp.zeros((M, D), jnp.float32)
        return vjp((gy, gs_))

    norm.defvjp(fwd, bwd)
    return norm(x_MD, residual, scale_D)


def available(dtype="bfloat16") -> str | None:
    """Why the compiled kernel cannot run here for ``dtype`` rows, or None (one probe per dtype)."""
    return _available(jnp.dtype(dtype).name)


@functools.cache
def _available(dtype: str) -> str | None:
    """Needs a GPU backend with Pallas' Triton lowering; the first call compiles and checks a small
    norm against the XLA reference (run at once, so it may be asked inside a trace)."""
    from jaxspec.kernels import gpu_problem, run_compiled

    if (problem := gpu_problem(plgpu)) is not None:
        return problem
    try:
        dt = jnp.dtype(dtype)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(3, 2048)).astype(np.float32)
        h = rng.normal(size=(3, 2048)).astype(dt)
        scale = (1 + rng.normal(size=(2048,)) / 4).astype(dt)
        y, s = run_compiled(lambda x, h, w: rms_norm_rows(x, w, 1e-6, residual=h), x, h, scale)
        want, want_s = run_compiled(lambda x, h, w: reference(x, w, 1e-6, h), x, h, scale)
        if y.shape[0] != stacked_matmul.padded_rows(3) or np.any(y[3:].astype(np.float32) != 0):
            return "the probe call did not zero its padding rows"
        if not np.array_equal(s, want_s):
            return "the probe call's residual sum differs from x + h"
        err = np.abs(y[:3].astype(np.float64) - want.astype(np.float64)).max()
        if err > 0.02 * np.abs(want.astype(np.float64)).max():
            return f"the probe call returned wrong values (error {err:.3g})"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"the probe call failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None
