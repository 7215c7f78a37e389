"""Grouped (ragged) matmul for the MoE experts.

Tokens are sorted by expert, so ``lhs`` rows form contiguous groups and group
``g`` is multiplied by expert ``g``'s weight:

    out[rows of group g] = lhs[rows of group g] @ rhs[g]

Two implementations:

* ``"tokamax"``: tokamax's Mosaic GPU ``ragged_dot``. It only reads the
  weights of groups that have rows, which is what makes decode fast (a step
  with 8 tokens touches at most 64 of Kimi's 384 experts per layer).
* ``"xla"``: ``jax.lax.ragged_dot``. Correct everywhere, but on GPU it reads
  every expert's weights whatever the group sizes (about 2.9 ms for 8 tokens at
  Kimi's shape), so it is the CPU / test path only.

The choice is made at trace time: GPU backend and tokamax importable ->
tokamax, else xla. Pass ``impl=`` to force one; there is deliberately no
environment-variable switch.

Rows at or past ``sum(group_sizes)`` are zero in the output on every path
(tokamax leaves them unwritten, so they are masked here). ``sum(group_sizes)``
must not exceed ``M``.

INT4 expert weights arrive from the checkpoint as ``[G, N, K/8]`` int32 words
(``[out, in/8]`` per expert, see :mod:`jaxspec.quant`) with ``[G, N, K/32]``
scales, i.e. already in the N-major ("transposed rhs") layout that the tokamax
quantized kernel reads; see :func:`ragged_dot_int4` for where transposes
happen.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import quant

IMPLS = ("tokamax", "xla")

# rhs [G, N, K] contracted on its last dim; used so the dequantized INT4
# weights never need an explicit transpose on the xla path.
_RHS_NK_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


# ---------------------------------------------------------------------------
# Implementation selection
# ---------------------------------------------------------------------------


@functools.cache
def _load_tokamax() -> tuple[Any, Any, str | None]:
    """Imports tokamax and qwix once; returns (tokamax, qwix, why_unavailable)."""
    try:
        import qwix
        import tokamax
    except Exception as e:  # tokamax needs Python >= 3.12 and a recent jax
        return None, None, f"cannot import tokamax: {type(e).__name__}: {e}"
    try:
        from tokamax._src.ops.ragged_dot import api as tokamax_api

        registered = tokamax_api.IMPLEMENTATIONS
    except Exception:
        registered = None  # internals moved; let the call itself report problems
    if registered is not None and "mosaic_gpu" not in registered:
        # tokamax imports but its Mosaic GPU kernels did not (e.g. jax too old).
        return None, None, "tokamax is importable but has no Mosaic GPU ragged_dot"
    return tokamax, qwix, None


def _platform() -> str:
    return jax.default_backend()


def tokamax_unavailable_reason() -> str | None:
    """Why the tokamax path cannot be used here, or None if it can."""
    if (platform := _platform()) != "gpu":
        return f"tokamax ragged_dot needs a GPU backend, found {platform!r}"
    return _load_tokamax()[2]


def backend_name(impl: str | None = None) -> str:
    """Which implementation :func:`ragged_dot` uses: 'tokamax' or 'xla'.

    Args:
      impl: None to auto-select, or 'tokamax' / 'xla' to force. Forcing
        'tokamax' where it cannot run raises ``RuntimeError``.
    """
    if impl is None:
        return "tokamax" if tokamax_unavailable_reason() is None else "xla"
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS} or None, found {impl!r}")
    if impl == "tokamax" and (reason := tokamax_unavailable_reason()) is not None:
        raise RuntimeError(f"impl='tokamax' requested but {reason}")
    return impl


# ---------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------


def _check_group_sizes(group_sizes: jax.Array, num_groups: int) -> jax.Array:
    if group_sizes.shape != (num_groups,):
        raise ValueError(
            f"group_sizes: expected shape ({num_groups},) (one per group of rhs), found {tuple(group_sizes.shape)}"
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes: expected an integer dtype, found {group_sizes.dtype}")
    return group_sizes.astype(jnp.int32)


def _zero_rows_past_groups(out: jax.Array, group_sizes: jax.Array) -> jax.Array:
    rows = jnp.arange(out.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), out, jnp.zeros((), out.dtype))


def _tokamax_dense_problem(lhs: jax.Array, rhs: jax.Array) -> str | None:
    """Why the Mosaic GPU kernel would reject these operands, or None."""
    if lhs.dtype != rhs.dtype or lhs.dtype not in (jnp.bfloat16, jnp.float16):
        return f"needs lhs and rhs both bf16 or both f16, found {lhs.dtype} and {rhs.dtype}"
    return tokamax_dense_problem(lhs.dtype, lhs.shape[1], rhs.shape[2])


def tokamax_dense_problem(dtype, k: int, n: int) -> str | None:
    """Why the Mosaic GPU kernel would reject ``[M, K] x [G, K, N]`` operands of `dtype`, or None."""
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"needs bf16 or f16 operands, found {jnp.dtype(dtype)}"
    # 128-byte swizzled K tiles and 64-wide N tiles.
    if k % 64 or n % 64:
        return f"needs K and N multiples of 64, found K={k}, N={n}"
    return None


# ---------------------------------------------------------------------------
# Dense grouped matmul
# ---------------------------------------------------------------------------


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type: Any = None,
    impl: str | None = None,
) -> jax.Array:
    """Grouped matmul: rows of ``lhs`` in group ``g`` times ``rhs[g]``.

    Args:
      lhs: ``[M, K]``, rows sorted by group.
      rhs: ``[G, K, N]``.
      group_sizes: integer ``[G]``, rows per group; ``sum <= M``.
      preferred_element_type: output / accumulation dtype as in
        ``jax.lax.ragged_dot`` (default: the inputs' result type).
      impl: None (auto), 'tokamax' or 'xla'. In auto mode operands the Mosaic
        kernel does not take (e.g. float32) go to the xla path; when 'tokamax'
        is forced they raise ``ValueError`` instead.

    Returns:
      ``[M, N]``; rows at or past ``sum(group_sizes)`` are zero.
    """
    if lhs.ndim != 2:
        raise ValueError(f"lhs: expected shape [M, K], found {tuple(lhs.shape)}")
    if rhs.ndim != 3:
        raise ValueError(f"rhs: expected shape [G, K, N], found {tuple(rhs.shape)}")
    if rhs.shape[1] != lhs.shape[1]:
        raise ValueError(
            f"rhs: expected K={lhs.shape[1]} (lhs.shape[1]) in rhs [G, K, N], found rhs shape {tuple(rhs.shape)}"
        )
    group_sizes = _check_group_sizes(group_sizes, rhs.shape[0])

    chosen = backend_name(impl)
    if chosen == "tokamax" and (problem := _tokamax_dense_problem(lhs, rhs)) is not None:
        if impl == "tokamax":
            raise ValueError(f"impl='tokamax': the Mosaic GPU ragged_dot {problem}")
        chosen = "xla"

    if chosen == "xla":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)

    tokamax = _load_tokamax()[0]
    out = tokamax.ragged_dot(
        lhs,
        rhs,
        group_sizes,
        preferred_element_type=preferred_element_type,
        implementation="mosaic",
    )
    return _zero_rows_past_groups(out, group_sizes)


# ---------------------------------------------------------------------------
# INT4 grouped matmul
# ---------------------------------------------------------------------------


def _int4_weights(packed_or_q: jax.Array, scale: jax.Array, group_size: int):
    """Validates INT4 expert weights; returns (G, N, K)."""
    if packed_or_q.ndim != 3 or scale.ndim != 3:
        raise ValueError(
            "packed, scale: expected [G, N, K/8] int32 (or [G, N, K] int4) and "
            f"[G, N, K/{group_size}], found {tuple(packed_or_q.shape)} and {tuple(scale.shape)}"
        )
    g, n, width = packed_or_q.shape
    if packed_or_q.dtype == jnp.int32:
        k = width * 8
    elif packed_or_q.dtype == jnp.int4:
        k = width
    else:
        raise ValueError(f"packed: expected int32 words [G, N, K/8] or int4 [G, N, K], found {packed_or_q.dtype}")
    if k % group_size:
        raise ValueError(f"packed: K={k} must be a multiple of group_size={group_size}")
    expected = (g, n, k // group_size)
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"scale: expected shape {expected} for K={k} with group_size={group_size}, found {tuple(scale.shape)}"
        )
    return g, n, k


def int4_tokamax_operands(packed_or_q: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Builds the ``(qvalue, scale)`` pair of the qwix QArray tokamax expects.

    tokamax takes rhs logically as ``[G, K, N]`` with scales ``[G, K/32, N]``
    (scale tile ``(1, 32, 1)``) and its sm90 kernel reads ``qvalue.mT``, i.e.
    ``[G, N, K]``: the checkpoint's own layout. The ``swapaxes`` here and the
    kernel's ``.mT`` cancel in XLA, so no data is moved for the transposes.

    Args:
      packed_or_q: int32 ``[G, N, K/8]`` or int4 ``[G, N, K]``.
      scale: ``[G, N, K/32]``.

    Returns:
      int4 ``[G, K, N]`` and ``scale`` as ``[G, K/32, N]``.
    """
    q = quant.packed_to_int4(packed_or_q) if packed_or_q.dtype == jnp.int32 else packed_or_q
    return jnp.swapaxes(q, 1, 2), jnp.swapaxes(scale, 1, 2)


def _tokamax_int4_problem(lhs: jax.Array, scale: jax.Array, n: int, group_size: int) -> str | None:
    if group_size < 64:
        # Measured on an H200 (tokamax 0.0.17): K tiles of 32 fail with "No possible swizzle".
        return f"needs INT4 groups of at least 64 inputs, found {group_size}"
    if lhs.dtype != jnp.bfloat16 or scale.dtype != jnp.bfloat16:
        return f"needs bf16 lhs and bf16 scales, found {lhs.dtype} and {scale.dtype}"
    if n % 128:  # two 64-wide N tiles per block
        return f"needs N to be a multiple of 128, found {n}"
    return None


def ragged_dot_int4(
    lhs: jax.Array,
    w: quant.Int4Weight,
    group_sizes: jax.Array,
    *,
    preferred_element_type: Any = None,
    impl: str | None = None,
) -> jax.Array:
    """Grouped matmul against INT4 expert weights in the checkpoint layout.

    ``out[rows of g] = lhs[rows of g] @ dequant(packed[g], scale[g]).T``

    Layout and transposes: the checkpoint stores each expert as ``[out, in]``
    = ``[N, K]``, so the weights here are ``[G, N, K/8]`` words and
    ``[G, N, K/32]`` scales.

    * xla path: dequantize to ``[G, N, K]`` in ``lhs.dtype`` and contract on
      the last rhs dim with ``ragged_dot_general`` (no transpose at all).
    * tokamax path: see :func:`int4_tokamax_operands`; the logical
      ``[G, K, N]`` view is a transpose that cancels against the kernel's own.

    On GPU, convert the int32 words once at load time with
    :func:`jaxspec.quant.packed_to_int4` and pass the int4 array: a Pallas
    kernel cannot fuse the conversion, so passing int32 words makes every call
    rewrite all experts' weights first, defeating the point of the kernel.

    Args:
      lhs: ``[M, K]``, rows sorted by group.
      w: rows-layout ``Int4Weight``: ``packed`` int32 ``[G, N, K/8]`` (checkpoint) or int4
        ``[G, N, K]``, ``scale`` ``[G, N, K/group_size]`` (bf16 in Kimi-K2.5).
      group_sizes: integer ``[G]``; ``sum <= M``.
      preferred_element_type: output dtype (default ``lhs.dtype``). The tokamax
        quantized kernel writes bf16, so other dtypes are a cast of that.
      impl: None (auto), 'tokamax' or 'xla'.

    Returns:
      ``[M, N]``; rows at or past ``sum(group_sizes)`` are zero.
    """
    if lhs.ndim != 2:
        raise ValueError(f"lhs: expected shape [M, K], found {tuple(lhs.shape)}")
    if not quant.is_int4(w) or w.layout != quant.ROWS:
        raise ValueError(f"w: expected a rows-layout Int4Weight, found {type(w).__name__}")
    packed, scale, group_size = w.packed, w.scale, w.group_size
    g, n, k = _int4_weights(packed, scale, group_size)
    if lhs.shape[1] != k:
        raise ValueError(f"lhs: expected K={k} (from packed {tuple(packed.shape)}), found lhs shape {tuple(lhs.shape)}")
    group_sizes = _check_group_sizes(group_sizes, g)
    out_dtype = lhs.dtype if preferred_element_type is None else preferred_element_type

    chosen = backend_name(impl)
    if chosen == "tokamax" and (problem := _tokamax_int4_problem(lhs, scale, n, group_size)) is not None:
        if impl == "tokamax":
            raise ValueError(f"impl='tokamax': the Mosaic GPU int4 ragged_dot {problem}")
        # Dequantise the (already gathered) experts and use the dense grouped kernel.
        w = quant.dequant_int4(packed, scale, lhs.dtype, group_size=group_size)
        return ragged_dot(lhs, jnp.swapaxes(w, 1, 2), group_sizes, preferred_element_type=out_dtype)

    if chosen == "xla":
        if packed.dtype == jnp.int32:
            w = quant.dequant_int4(packed, scale, lhs.dtype, group_size=group_size)
        else:
            q = packed.astype(jnp.float32).reshape(g, n, k // group_size, group_size)
            w = (q * scale.astype(jnp.float32)[..., None]).reshape(g, n, k).astype(lhs.dtype)
        return jax.lax.ragged_dot_general(lhs, w, group_sizes, _RHS_NK_DIMS, preferred_element_type=out_dtype)

    tokamax, qwix, _ = _load_tokamax()
    qvalue, qscale = int4_tokamax_operands(packed, scale)
    rhs = qwix.QArray(qvalue=qvalue, scale=qscale, zero_point=None, qtype=jnp.int4)
    # sm90's quantized kernel only supports the default (bf16) output.
    out = tokamax.ragged_dot(lhs, rhs, group_sizes, implementation="mosaic")
    return _zero_rows_past_groups(out, group_sizes).astype(out_dtype)


def gathered_matvec(h: jax.Array, weights: jax.Array, idx: jax.Array) -> jax.Array:
    """``out[a] = h[a] @ weights[idx[a]]`` for unquantized experts ``[G, K, N]``.

    One row per assignment: for decode-sized batches this reads each routed
    expert once and never touches the others (XLA fuses the gather into the
    contraction's operand).

    Args:
      h: ``[A, K]``; weights: ``[G, K, N]``; idx: int ``[A]`` in ``[0, G)``.
    Returns:
      ``[A, N]`` in float32.
    """
    w = jnp.take(weights, idx, axis=0)
    return jnp.einsum("ak,akn->an", h, w, preferred_element_type=jnp.float32)


def gathered_matvec_int4(h: jax.Array, w: quant.Int4Weight, idx: jax.Array) -> jax.Array:
    """``out[a] = h[a] @ dequant(w[idx[a]]).T`` straight from INT4 words.

    Written as gather -> unpack -> scale -> multiply -> row reduction so XLA emits
    one fused reduction per projection that reads each routed expert's packed
    words and scales exactly once; the bf16 weights never exist in memory.

    Args:
      h: ``[A, K]``; w: rows-layout ``Int4Weight``, ``packed`` int32 ``[G, N, K/8]``,
      ``scale`` ``[G, N, K/group_size]``; idx: int ``[A]`` in ``[0, G)``.
    Returns:
      ``[A, N]`` in float32.
    """
    if not quant.is_int4(w) or w.layout != quant.ROWS:
        raise ValueError(f"w: expected a rows-layout Int4Weight, found {type(w).__name__}")
    packed, scale, group_size = w.packed, w.scale, w.group_size
    a, k = h.shape
    g, n, words = packed.shape
    if words * 8 != k:
        raise ValueError(f"packed: expected {k // 8} words per row for K={k}, found shape {tuple(packed.shape)}")
    if scale.shape != (g, n, k // group_size):
        raise ValueError(f"scale: expected shape {(g, n, k // group_size)}, found {tuple(scale.shape)}")
    p = jnp.take(packed, idx, axis=0).astype(jnp.uint32)  # [A, N, K/8]
    s = jnp.take(scale, idx, axis=0).astype(jnp.float32)  # [A, N, K/g]
    shifts = jnp.arange(8, dtype=jnp.uint32) * 4
    q = ((p[..., None] >> shifts) & 0xF).astype(jnp.float32) - 8.0  # [A, N, K/8, 8]
    q = q.reshape(a, n, k // group_size, group_size)
    x = h.astype(jnp.float32).reshape(a, 1, k // group_size, group_size)
    return jnp.sum(q * x * s[..., None], axis=(-2, -1))


def gathered_expert_ffn(x_TD, experts_TK, weights_TK, w, num_local: int) -> jax.Array:
    """The routed experts' SwiGLU FFN, one gathered matvec per (token, expert) assignment, straight from
    the checkpoint's layout (INT4 ``Int4Weight``s or float arrays ``[E, in, out]``):

        y[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = experts[t, j]

    with ids outside ``[0, num_local)`` (another device's experts) contributing zero. The products and h
    are rounded to x's dtype, the weighted sum taken in float32 and rounded to x's dtype. In float32 it
    is exact float32 arithmetic on every backend (elementwise products and reductions, no matmul
    precision setting involved): the portable path of the MoE layer and the reference of the fused
    kernel's tests and availability probe."""
    T, k = experts_TK.shape
    flat = experts_TK.reshape(-1)
    valid = (flat >= 0) & (flat < num_local)
    idx = jnp.clip(flat, 0, num_local - 1)
    xa = jnp.repeat(x_TD, k, axis=0)  # [A, D], assignment a = t*k + j

    def project(h, name):
        if quant.is_int4(w[name]):
            y = gathered_matvec_int4(h, w[name], idx)
        else:
            y = gathered_matvec(h, w[name].astype(h.dtype), idx)
        return y.astype(h.dtype)

    h = jax.nn.silu(project(xa, "gate")) * project(xa, "up")
    y = project(h, "down").astype(jnp.float32)
    scale = jnp.where(valid, weights_TK.reshape(-1), 0.0)
    return (y * scale[:, None]).reshape(T, k, -1).sum(1).astype(x_TD.dtype)
