"""Skinny matmul that reads one layer of a stacked weight in place: Pallas with the Triton lowering.

``stacked_matmul(x, w, layer)`` computes ``x @ w[layer]`` for ``x [M, K]`` and ``w [L, K, N]``
without first copying ``w[layer]`` out of the stack.

Why: the decoder's identical layers run under one ``lax.scan`` over stacked parameters, so
compile time does not grow with depth. Inside the loop body XLA slices each dense weight out
of its ``[L, ...]`` stack with a dynamic-slice, and on the GPU a matmul operand that is a
dynamic-slice is materialised first: every decode step copies every layer's dense weights
(a read and a write of the whole weight) before the matmul reads them again. At decode sizes
(a few rows) the matmuls are memory-bound, so the copy triples their cost. This kernel takes
the whole stack and the layer index, and streams only that layer's tiles.

Grid ``(M / BLOCK_M, N / bn, ksplit)``; program ``(i, j, s)`` multiplies rows
``16i .. 16i + 15`` (zero-padded) by columns ``bn j ..`` over the s-th of ``ksplit`` equal
parts of K, in steps of ``bk``, accumulating in float32 on the tensor cores, and writes its
float32 partial product; XLA then adds the ``ksplit`` partials in ascending order and casts
(`sum_parts`), or a consumer kernel does (``raw``: `kernels.latent_write`).
The row block is the fastest grid axis, so programs sharing a weight tile run side by side
and re-read it from L2. Every row goes through the same sequence of tile products whatever
M is, so a row's result does not depend on how many rows are in the call (a verify of T
tokens and a decode of one token give the same product bits for the same row).

Use it where M is small (decode and verify); for prefill-sized M the copy is amortised over
many rows and XLA's own matmul on the slice is the better choice (``use_kernel``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxspec.kernels import with_gradient

try:  # the Triton lowering's compiler parameters (GPU builds)
    from jax.experimental.pallas import triton as plgpu
except Exception:  # noqa: BLE001 - optional
    plgpu = None

BLOCK_M = 16  # rows per program (tensor-core minimum for 16-bit inputs)
MAX_ROWS = 512  # above this many rows, XLA's matmul on a copied slice wins (`use_kernel`)

# Tile sizes and Triton options; any of them may be overridden per call (`config=`). bk 128 over 64: on the H200
# share's layer (8 stacked layers, docs/PERFORMANCE.md, run 24) 103.7 -> 100.3 us at batch 1 and 165.3 -> 161.5 at
# batch 8. Twice the bytes a pipeline stage keeps more of the weight in flight (q_a + kv_a 12.1 -> 10.1 us at
# batch 1), and where the K steps stop the split's doubling sooner, fewer partials for the kernels that add them
# (the router's 16 -> 8 for route_topk: 4.5 -> 3.5 us; q_b's 8 -> 4 for absorb_keys: 3.9 -> 3.1). o_proj (K = 1024
# at the share, 4 steps a program) is 0.3 us slower. The tiles are part of the numerics (the K order of the
# partials), the same for every row count.
DEFAULT_CONFIG: dict[str, Any] = {"bn": 64, "bk": 128, "ksplit": 0, "warps": 4, "stages": 4}
# float32 operands (a float32 model's router) step K by 32 unless `config` says otherwise: on the H200 the router's
# [M, 7168] x [7168, 384] product ran 5-22% faster than at 64 for M = 1..32 (docs/PERFORMANCE.md)
F32_BK = 32
# ksplit 0: pick the smallest power of two that gives at least `min_programs` programs for
# one row block, subject to dividing K into whole bk steps.
MIN_PROGRAMS = 128  # about one per SM of an H100/H200 (more, shorter programs measured slower)


def padded_rows(m: int) -> int:
    """Rows of the zero-padded copy the kernel reads for ``m`` rows: whole 16-row blocks, always at
    least one padding row (`_call` says why)."""
    return (m // BLOCK_M + 1) * BLOCK_M


def _config(overrides: dict[str, Any] | None) -> dict[str, Any]:
    cfg = dict(DEFAULT_CONFIG)
    if overrides:
        unknown = set(overrides) - set(cfg)
        if unknown:
            raise ValueError(f"stacked_matmul config: unknown keys {sorted(unknown)}; known: {sorted(cfg)}")
        cfg.update(overrides)
    return cfg


def _tile(n: int, want: int) -> int:
    """The largest power of two <= want that divides n (at least 16), or n itself if none."""
    t = want
    while t >= 16:
        if n % t == 0:
            return t
        t //= 2
    return n


def ksplit_for(k: int, n: int, bn: int, bk: int, requested: int = 0) -> int:
    """K parts per column tile: the requested one, or (0) enough for MIN_PROGRAMS programs."""
    steps = k // bk
    if requested:
        if steps % requested:
            raise ValueError(f"stacked_matmul: ksplit={requested} must divide the {steps} K steps of K={k}, bk={bk}")
        return requested
    s = 1
    while (n // bn) * s < MIN_PROGRAMS and steps % (2 * s) == 0 and steps // (2 * s) >= 2:
        s *= 2
    return s


def product(layer_ref, x_ref, w_ref, o_ref, *, m0, n0, part, bn, bk, steps, precision):
    """One program's partial product: rows ``m0 .. m0 + 15`` of x times columns ``n0 .. n0 + bn - 1`` of the
    layer's weight over the K steps ``part * steps ..`` (``bk`` inputs each, ascending), in float32, stored at
    ``o_ref[part, rows, cols]``. Shared with the kernels that run a dense product beside their own
    (`kernels.int4_moe`'s down launch: the shared expert's down projection), so a product has these bits
    wherever it runs (in interpret mode; compiled, where the compiler picks the same instructions)."""
    lyr = layer_ref[0]

    def body(i, acc):
        k0 = (part * steps + i) * bk
        wb = w_ref[lyr, pl.ds(k0, bk), pl.ds(n0, bn)]
        xb = x_ref[pl.ds(m0, BLOCK_M), pl.ds(k0, bk)].astype(wb.dtype)
        return acc + jnp.dot(xb, wb, precision=precision, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((BLOCK_M, bn), jnp.float32))
    o_ref[part, pl.ds(m0, BLOCK_M), pl.ds(n0, bn)] = acc


def _kernel(layer_ref, x_ref, *refs, bn, bk, steps, precision, tiles):
    """refs: the weights' stacks, then their outputs. Column tile j belongs to the weight whose
    range of `tiles` holds it (one weight: no branch)."""
    n_w = len(tiles)
    w_refs, o_refs = refs[:n_w], refs[n_w:]
    m0 = pl.program_id(0) * BLOCK_M
    j = pl.program_id(1)
    part = pl.program_id(2)
    run = functools.partial(product, layer_ref, x_ref, m0=m0, part=part, bn=bn, bk=bk, steps=steps, precision=precision)
    if n_w == 1:
        run(w_refs[0], o_refs[0], n0=j * bn)
        return
    start = 0
    for w_ref, o_ref, t in zip(w_refs, o_refs, tiles):

        @pl.when((j >= start) & (j < start + t))
        def _(w_ref=w_ref, o_ref=o_ref, start=start):
            run(w_ref, o_ref, n0=(j - start) * bn)

        start += t


def precision_for(dtype):
    """The dot precision of `product` for weights of ``dtype``: float32 ones exactly (IEEE on the CUDA cores)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def tiles_for(k: int, ns, dtype, config: dict[str, Any] | None = None) -> tuple[int, int, int]:
    """(bn, bk, ksplit) of a `stacked_matmuls` call of weights [L, k, n] for each n of ``ns``, of ``dtype``:
    the column tile (the largest power of two up to the configured ``bn`` dividing every n), the K step and the
    K split. Functions of the shapes alone, never of the rows. Raises where no tile of at least 16 fits."""
    cfg = _config(config)
    ns = [int(n) for n in ns]
    bn = int(cfg["bn"])
    while bn > 16 and any(n % bn for n in ns):
        bn //= 2
    if len(ns) == 1:
        bn = _tile(ns[0], int(cfg["bn"]))
    bk = _tile(k, int(cfg["bk"] if jnp.dtype(dtype) != jnp.float32 or (config and "bk" in config) else F32_BK))
    if any(n % bn for n in ns) or k % bk:
        raise ValueError(f"stacked_matmul: N={ns}, K={k} have no tile of at least 16 (bn={bn}, bk={bk})")
    return bn, bk, ksplit_for(k, sum(ns), bn, bk, int(cfg["ksplit"]))


def stacked_matmul(
    x_MK: jax.Array,
    w_LKN: jax.Array,
    layer,
    *,
    out_dtype=None,
    config: dict[str, Any] | None = None,
    interpret: bool = False,
    rows: int | None = None,
) -> jax.Array:
    """``x @ w[layer]`` ([M, N], ``out_dtype`` or x's dtype) reading only that layer of the stack.

    x [M, K], w [L, K, N] of x's dtype; ``layer``: a scalar int (traced or not) in [0, L).
    Differentiable in x and w (the backward pass is XLA's matmuls on the layer's slice; the
    gradient of w is zero outside that layer).
    """
    return stacked_matmuls(x_MK, (w_LKN,), layer, out_dtype=out_dtype, config=config, interpret=interpret, rows=rows)[0]


def stacked_matmuls(
    x_MK: jax.Array,
    ws: tuple[jax.Array, ...] | list[jax.Array],
    layer,
    *,
    out_dtype=None,
    config: dict[str, Any] | None = None,
    interpret: bool = False,
    rows: int | None = None,
    raw: tuple[bool, ...] | None = None,
) -> tuple[jax.Array, ...]:
    """``x @ w[layer]`` for each stack ``w`` of `ws` (all [L, K, N_i] of x's dtype): one kernel call.

    Projections that share their input (an attention's q_a and kv_a, a gated MLP's gate and up)
    cost one launch and one pass of setup instead of one each. The column tile is the largest
    power of two up to the configured ``bn`` that divides every N_i; the K split is chosen from
    the shapes as for one weight (the total column tiles), never from M, so a row's bits still do
    not depend on the rows beside it.

    ``rows``: x is already the zero-padded copy of ``rows`` rows (``padded_rows(rows)`` rows, the last
    ones zero, written by a Pallas kernel such as `kernels.rms_norm`), read as it is; the results
    have ``rows`` rows. x may then be bfloat16 for float32 weights (each block is widened in the
    kernel, exactly).

    ``out_dtype``: one dtype for every result, or one per weight (the router's float32 logits beside
    the shared expert's bfloat16 gate and up); the float32 sums are cast to it once.

    ``raw``: one flag per weight; a flagged weight's result is its float32 partial products as the
    kernel wrote them, ``[ksplit, padded_rows, N]``, for a consumer kernel that adds them itself
    (`sum_parts` is the sum every other result gets; `kernels.latent_write` does it in its own launch).
    """
    cfg = _config(config)
    ws = tuple(ws)
    if x_MK.ndim != 2 or not ws:
        raise ValueError(f"stacked_matmul: expected x [M, K] and weights [L, K, N], found {x_MK.shape}, {len(ws)}")
    for w in ws:
        if w.ndim != 3 or x_MK.shape[1] != w.shape[1]:
            raise ValueError(f"stacked_matmul: expected x [M, K] and w [L, K, N], found {x_MK.shape} and {w.shape}")
        if x_MK.dtype != w.dtype and not (rows is not None and w.dtype == jnp.float32):
            raise ValueError(
                f"stacked_matmul: x and w must share a dtype (or x be given padded, `rows`, for float32 w), "
                f"found {x_MK.dtype} and {w.dtype}"
            )
        if w.shape[0] != ws[0].shape[0]:
            raise ValueError(f"stacked_matmul: the stacks hold different layer counts, {[v.shape for v in ws]}")
    if rows is not None and x_MK.shape[0] != padded_rows(rows):
        raise ValueError(f"stacked_matmul: {rows} padded rows are {padded_rows(rows)}, found x {x_MK.shape}")
    if len({w.dtype for w in ws}) != 1:
        raise ValueError(f"stacked_matmul: the weights must share a dtype, found {[w.dtype for w in ws]}")
    K = x_MK.shape[1]
    bn, bk, ksplit = tiles_for(K, [w.shape[2] for w in ws], ws[0].dtype, config)
    if isinstance(out_dtype, (tuple, list)):
        if len(out_dtype) != len(ws):
            raise ValueError(f"stacked_matmul: {len(out_dtype)} output dtypes for {len(ws)} weights")
        out_dtypes = tuple(jnp.dtype(d or x_MK.dtype) for d in out_dtype)
    else:
        out_dtypes = (jnp.dtype(out_dtype or x_MK.dtype),) * len(ws)

    raw = tuple(raw) if raw is not None else (False,) * len(ws)
    if len(raw) != len(ws):
        raise ValueError(f"stacked_matmul: {len(raw)} raw flags for {len(ws)} weights")
    M = rows if rows is not None else x_MK.shape[0]

    def forward(x, ws, layer):
        parts = _call(x, ws, layer, bn, bk, ksplit, cfg, interpret, rows)
        return tuple(p if r else sum_parts(p, M).astype(d) for p, r, d in zip(parts, raw, out_dtypes))

    def backward(res, gs):
        x, ws, layer = res
        dx = jnp.zeros(x.shape, jnp.float32)
        dws = []
        for w, g, r in zip(ws, gs, raw):
            w_l = jax.lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)
            if r:  # part s is the product over the s-th K range: its gradient reaches that range alone
                gp = g[:, : x.shape[0]]  # x without its padding rows (`rows` None) has fewer
            else:  # the summed product: every K range sees the whole cotangent
                if x.shape[0] != M:  # the padding rows' products are not outputs: their gradient is zero
                    g = jnp.pad(g, ((0, x.shape[0] - M), (0, 0)))
                gp = jnp.broadcast_to(g[None], (ksplit, *g.shape))
            gp = gp.astype(w.dtype)
            xs, gw = x.reshape(x.shape[0], ksplit, -1), w_l.reshape(ksplit, -1, w_l.shape[1])
            dx = dx + jnp.einsum("smn,skn->msk", gp, gw, preferred_element_type=jnp.float32).reshape(x.shape)
            dw_l = jnp.einsum("msk,smn->skn", xs.astype(w.dtype), gp, preferred_element_type=jnp.float32)
            dw_l = dw_l.reshape(w_l.shape).astype(w.dtype)
            dws.append(jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(w), dw_l, layer, axis=0))
        return dx.astype(x.dtype), tuple(dws)

    return with_gradient(forward, backward, nondiff=1)(x_MK, ws, jnp.asarray(layer, jnp.int32))


def sum_parts(parts, m: int) -> jax.Array:
    """A call's float32 products [m, N] from its partials [ksplit, padded rows, N]: the K parts added in
    ascending order (independent of m), the padding rows dropped."""
    out = parts[0]
    for s in range(1, parts.shape[0]):
        out = out + parts[s]
    return out[:m]


def _call(x_MK, ws, layer, bn, bk, ksplit, cfg, interpret, rows=None):
    """The kernel's float32 partial products [ksplit, Mp, N_i] (`sum_parts` adds them); with ``rows``,
    x is already the padded copy of ``rows`` rows."""
    M, K = x_MK.shape
    # Always at least one padding row, so the kernel reads a copy of its own. Read in place (the
    # caller's buffer straight in, or masked loads and stores: 4.5% off a batch-1 step), the decode
    # steps' rows parted from the verify's after the first stacked layer on the H200 (JAX 0.11.2,
    # `scripts/check_invariance.py`) although the kernel's own products are bit-invariant: without
    # the pad XLA fuses the ops around the call differently in the decode and the verify programs,
    # and where XLA may keep bfloat16 intermediates in float32 (excess precision, its default) their
    # rounding follows the fusion (`--xla_allow_excess_precision=false` made that check pass and broke
    # others: docs/PERFORMANCE.md, run 11). With the copy the two match at every batch measured.
    if rows is None:
        Mp = padded_rows(M)
        x = jnp.pad(x_MK, ((0, Mp - M), (0, 0)))
    else:  # a copy of the kernel's own already (`kernels.rms_norm`)
        M, Mp, x = rows, x_MK.shape[0], x_MK
    precision = precision_for(ws[0].dtype)
    params = None
    if not interpret and plgpu is not None:
        params = plgpu.CompilerParams(num_warps=cfg["warps"], num_stages=cfg["stages"])
    tiles = tuple(w.shape[2] // bn for w in ws)
    parts = pl.pallas_call(
        functools.partial(_kernel, bn=bn, bk=bk, steps=K // bk // ksplit, precision=precision, tiles=tiles),
        out_shape=tuple(jax.ShapeDtypeStruct((ksplit, Mp, w.shape[2]), jnp.float32) for w in ws),
        grid=(Mp // BLOCK_M, sum(tiles), ksplit),
        interpret=interpret,
        compiler_params=params,
        name="stacked_matmul",
    )(layer.reshape(1), x, *ws)
    return tuple(parts)


def use_kernel(rows: int) -> bool:
    """Whether `stacked_matmul` should serve a product of `rows` rows (else: XLA on a slice)."""
    return 0 < rows <= MAX_ROWS


def shapes_ok(k: int, n: int) -> bool:
    """Whether a [.., k] x [k, n] product has tiles the kernel takes (multiples of 16)."""
    return k % 16 == 0 and n % 16 == 0


def available(dtype="bfloat16") -> str | None:
    """Why the compiled (non-interpret) kernel cannot multiply ``dtype`` operands here, or None (see
    `_available`; one probe per dtype however it is named)."""
    return _available(jnp.dtype(dtype).name)


@functools.cache
def _available(dtype: str) -> str | None:
    """Why the compiled (non-interpret) kernel cannot multiply ``dtype`` operands here, or None if it
    can: needs a GPU backend with Pallas' Triton lowering; the first call per dtype compiles and
    checks a tiny product (compiled and run at once, so it may first be asked inside a trace).
    bfloat16 serves the dense projections and a bfloat16 model's router; float32 a float32 model's
    (its exact products run as IEEE float32 on the CUDA cores, not TF32)."""
    from jaxspec.kernels import gpu_problem, run_compiled

    if (problem := gpu_problem(plgpu)) is not None:
        return problem
    try:
        dt = jnp.dtype(dtype)
        # 1 + 2^-12 is neither a bfloat16 nor a TF32 value: a product rounded to either would lose it
        x = np.full((3, 256), 1.0 + 2.0**-12 if dt == jnp.float32 else 1.0, dt)
        w = np.stack([np.zeros((256, 128), dt), np.full((256, 128), 0.5, dt)])
        y = run_compiled(lambda x, w: stacked_matmul(x, w, 1), x, w)
        want = 256 * 0.5 * float(x[0, 0])
        if not np.all(y.astype(np.float64) == want):
            return f"the {dt.name} probe call returned wrong values ({float(y.ravel()[0])} for {want})"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"the probe call failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None
