"""Residual add + RMSNorm, written as the zero-padded rows the dense kernel reads: Pallas, Triton lowering.

``rms_norm_rows(x, scale, eps, residual=h)`` returns ``(y, s)``: ``s = x + h`` in float32 ``[M, D]``
(the residual stream after the add; no ``s`` without ``h``) and ``y = rms_norm(s)`` rounded to the
compute dtype, as ``stacked_matmul.padded_rows(M)`` rows of which the last ones are zero.

Why: at decode sizes every small XLA kernel of a decoder layer costs about as much as the bytes it
moves is worth, and before each dense projection a layer ran three to five of them: the residual
add, the norm's reduce and its multiply, and one pad per dense kernel call (`stacked_matmul` reads a
zero-padded copy of its rows, for a reason its docstring gives). This kernel is one launch for all of
them: the dense kernels take its rows as their own copy (`stacked.Rows`), and the add's float32 sum
comes out beside them for the residual stream. x or the residual may also be a dense kernel's float32
K-split partials (`stacked.Parts`: q_a's product before its norm, o_proj's before the residual add),
which the kernel adds itself, where XLA would add them in a launch of its own. With ``capture=(buf, slot)``
the kernel also stores the residual stream's rows (``s``, or x itself without a residual), rounded to the
buffer's dtype, as row ``slot`` of ``buf`` ``[R, M, D]``, updated in place: the stacked layers' captured
hidden states (EAGLE-3's), which an XLA `dynamic_update_slice` launch of its own wrote every layer. ``slot``
may be the stacked layers' table of rows, read at the layer's index in the kernel (a lookup of it in XLA
would be a launch of its own too).

Grid ``(padded_rows(M),)``, one row per program: the program loads its whole row at once (a block of
the next power of two of D, the columns past D masked off; a loop over narrower chunks was latency-bound,
twice XLA's time on the H200), sums the squares across the block, scales, rounds and stores. A row's
bits so depend on that row alone, never on M or on the other rows (a verify row equals the decode
step's row). With the stacked layers' scales ``[L, D]`` and the layer's index, the kernel reads that
layer's scale in place (a slice of it was a kernel of its own). The rounding is the reference's
(`layers.rms_norm`): the sum rounded to the compute dtype, normalised in float32, rounded, times the
scale, rounded; only the order of the sum of squares differs from XLA's reduction.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxspec import stacked
from jaxspec.kernels import stacked_matmul, with_reference_gradient

try:  # the Triton lowering's compiler parameters (GPU builds)
    from jax.experimental.pallas import triton as plgpu
except Exception:  # noqa: BLE001 - optional
    plgpu = None

MAX_WIDTH = 16384  # the widest row a program holds at once (in registers: ~64 values a thread at 8 warps)
DEFAULT_CONFIG = {"moe_add": False, "capture": True}
"""``moe_add``: whether the stacked layers leave a MoE layer's closing add (routed output + the shared down's
partials, or on a mesh the experts' sum over the mesh, added to the residual stream) to the next layer's norm launch
(`stacked.Deferred`), or make it in an
XLA launch of their own (False, the default: on the H200 the deferral lost ~1 us a layer, since the INT4 down
kernel's combine stays an XLA launch of its own; ``--kernel-config rms_norm='{"moe_add": true}'`` for A/B timings).
The combine taken into the norm's launch as well (the down kernel's k weighted rows a token read and added there, no
XLA launch left between the two kernels) lost 1.3-1.6 us a layer on an H100 at batch 1 and 2.5 at batch 8: a row's
one program then waits on the k rows' valid flags and loads, longer than the XLA launch took (docs/PERFORMANCE.md,
run 43; `3c04658`).
The rounding is the same either way (the MoE output rounded to the compute dtype before its add), where XLA
keeps it: XLA may fuse it away (excess precision), each form then fixed for every call and every T.

``capture``: whether the stacked layers write a layer's output into the captured hidden states (a verify's or a
prompt's, for the draft) from the next layer's attention norm launch (``rms_norm_rows(capture=...)``), not with an
XLA `dynamic_update_slice` launch of their own each layer (`model.capture_in_norm_ok`). The same bits either way
(a float32 row rounded to the buffer's dtype). On by default: it takes one launch out of every stacked layer of a
verify (on an H100, a share of 8 at batch 1: 18 -> 17 kernels and 120.4 -> 119.1 us a verify layer; at batch 8
within noise, docs/PERFORMANCE.md); ``--kernel-config rms_norm='{"capture": false}'`` turns it off."""


def width_for(d: int) -> int | None:
    """The block a program loads a row of ``d`` into: the next power of two (Triton's blocks are
    powers of two; the columns past d are masked off), or None past `MAX_WIDTH` or below 16."""
    if d < 16 or d > MAX_WIDTH:
        return None
    return 1 << (d - 1).bit_length()


def shapes_ok(rows: int, d: int) -> bool:
    """Whether the kernel serves ``rows`` rows of width ``d`` (the dense kernel's row range, a row
    that fits one block)."""
    return stacked_matmul.use_kernel(rows) and width_for(d) is not None


def _load_row(ref, row, cols, live, parts_dtype):
    """Row ``row`` of x or the residual in float32: an array's row widened, or (``parts_dtype`` given) a
    `stacked.Parts`' partials ``[ksplit, Mp, D]`` added in ascending order and rounded to its dtype, as
    `stacked.Parts.value` adds them (`stacked_matmul.sum_parts`)."""
    f32 = jnp.float32
    if parts_dtype is None:
        return plgpu.load(ref.at[row, cols], mask=live, other=0).astype(f32)
    acc = None
    for p in range(ref.shape[0]):
        v = plgpu.load(ref.at[jnp.full(cols.shape, p, jnp.int32), row, cols], mask=live, other=0).astype(f32)
        acc = v if acc is None else acc + v
    return acc.astype(parts_dtype).astype(f32)


def norm_row(r, layer_ref, x_ref, scale_ref, y_ref, *, m, d, width, eps, dtype, x_parts, h=None, cap=None):
    """Row ``r`` of the norm's padded rows: for ``r < m`` the norm of x's row (plus the residual's, ``h`` =
    ``(h_refs, h_parts, h_sum, s_ref)``: the float32 sum stored in s's row too) times layer ``layer_ref[0]``'s
    scale, rounded to ``dtype``; zeros for the padding rows ``r >= m``. One program's work, shared with the
    kernels that run a norm beside their own rows (`kernels.latent_write`). A residual of two terms (a
    `stacked.Sum`: ``h_sum`` its dtype) is their float32 sum rounded to that dtype, as `stacked.Sum.value`.
    ``cap`` = ``(slot_ref, cap_ref, by_layer)``: the stream's row (the float32 sum, or x's row) also stored,
    rounded to ``cap_ref``'s dtype, as row ``r`` of ``cap_ref[slot]``, slot ``slot_ref[layer_ref[0]]`` with
    ``by_layer`` (a table of rows by layer), else ``slot_ref[0]``."""
    f32 = jnp.float32
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
    live = cols < d
    row = jnp.full((1, width), r, jnp.int32)

    @pl.when(r < m)
    def _():
        # every load first, the scale's too: at decode sizes a program waits on memory, not on math
        lyr = jnp.full((1, width), layer_ref[0], jnp.int32)
        w = plgpu.load(scale_ref.at[lyr, cols], mask=live, other=0).astype(dtype).astype(f32)
        s = _load_row(x_ref, row, cols, live, x_parts)
        if h is not None:
            h_refs, h_parts, h_sum, s_ref = h
            add = None
            for ref, parts in zip(h_refs, h_parts):
                v = _load_row(ref, row, cols, live, parts)
                add = v if add is None else add + v
            if h_sum is not None:
                add = add.astype(h_sum).astype(f32)
            s = s + add
            plgpu.store(s_ref.at[row, cols], s, mask=live)
        if cap is not None:
            slot_ref, cap_ref, by_layer = cap
            slot = jnp.full((1, width), slot_ref[layer_ref[0] if by_layer else 0], jnp.int32)
            plgpu.store(cap_ref.at[slot, row, cols], s.astype(cap_ref.dtype), mask=live)
        v = s.astype(dtype).astype(f32)  # the masked columns are 0: they add nothing to the sum
        inv = jax.lax.rsqrt(jnp.sum(v * v, axis=1, keepdims=True) / d + eps)
        normed = (v * inv).astype(dtype).astype(f32)
        plgpu.store(y_ref.at[row, cols], (w * normed).astype(y_ref.dtype), mask=live)

    @pl.when(r >= m)
    def _():
        plgpu.store(y_ref.at[row, cols], jnp.zeros((1, width), y_ref.dtype), mask=live)


def warps_for(width: int) -> int:
    """The warps a program of `norm_row` runs with (a row of ``width`` columns held at once)."""
    return 8 if width >= 4096 else 4


def _kernel(*refs, h_parts, h_sum, capture, by_layer, **kw):
    # inputs: layer, x, the residual's terms, the scales, [slot, the capture buffer]; outputs: y, [s], [the
    # buffer, aliased to its input: only its output ref is written]
    n = len(h_parts)
    layer_ref, x_ref, *rest = refs
    h_refs, (scale_ref, *rest) = rest[:n], rest[n:]
    cap = None
    if capture:
        slot_ref, _, *rest = rest
        rest, cap = rest[:-1], (slot_ref, rest[-1], by_layer)
    y_ref, *rest = rest
    assert len(rest) == (1 if n else 0)
    h = (h_refs, h_parts, h_sum, rest[0]) if n else None
    norm_row(pl.program_id(0), layer_ref, x_ref, scale_ref, y_ref, h=h, cap=cap, **kw)


def reference(x_MD, scale_D, eps: float, residual=None, dtype=None):
    """The same in XLA ops: (y [M, D] in ``dtype``, unpadded; s [M, D] float32 or None)."""
    dtype = jnp.dtype(dtype or scale_D.dtype)
    s = x_MD.astype(jnp.float32)
    if residual is not None:
        s = s + residual.astype(jnp.float32)
    v = s.astype(dtype).astype(jnp.float32)
    normed = (v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)).astype(dtype)
    return scale_D.astype(dtype) * normed, (s if residual is not None else None)


def _operand(name, v):
    """(the array the kernel reads, the `stacked.Parts` dtype or None, the [M, D] shape) of x or the residual."""
    if isinstance(v, stacked.Parts):
        p = v.parts
        if len(v.shape) != 2 or p.ndim != 3 or p.shape[2] != v.shape[1] or p.shape[1] < v.shape[0]:
            raise ValueError(
                f"rms_norm_rows: {name} as partials must be [M, D] held as [ksplit, >= M, D]; "
                f"found shape {v.shape}, partials {p.shape}"
            )
        return p, jnp.dtype(v.dtype), tuple(v.shape)
    return v, None, tuple(v.shape)


def _residual(v):
    """(the arrays the kernel reads, each one's `stacked.Parts` dtype or None, the `stacked.Sum`'s dtype or None,
    the [M, D] shape) of the residual: an array, a `stacked.Parts`, or a `stacked.Sum` of the two kinds."""
    if not isinstance(v, stacked.Sum):
        h, parts, shape = _operand("residual", v)
        return (h,), (parts,), None, shape
    a, a_parts, a_shape = _operand("residual's first term", v.a)
    b, b_parts, b_shape = _operand("residual's second term", v.b)
    if a_shape != b_shape or jnp.dtype(v.a.dtype) != jnp.dtype(v.b.dtype):
        raise ValueError(
            f"rms_norm_rows: a residual Sum's terms must match: found {a_shape} {jnp.dtype(v.a.dtype).name} and "
            f"{b_shape} {jnp.dtype(v.b.dtype).name}"
        )
    return (a, b), (a_parts, b_parts), jnp.dtype(v.dtype), a_shape


def rms_norm_rows(
    x_MD, scale, eps: float, *, residual=None, dtype=None, layer=None, capture=None, interpret: bool = False
):
    """``(y, s)``: ``s = x + residual`` in float32 [M, D] (None without ``residual``), and ``y`` =
    RMSNorm of ``s`` rounded to ``dtype`` (default: the scale's), times the scale, in ``dtype``, as
    ``stacked_matmul.padded_rows(M)`` rows [Mp, D] whose rows M.. are zero.

    x: [M, D] float (the float32 residual stream, or a bf16 activation); residual: [M, D] float or
    None; either may also be a dense kernel's `stacked.Parts` (its float32 K-split partials, not yet
    added): the kernel adds them in ascending order and rounds to their dtype, as `stacked.Parts.value`
    would in an XLA kernel of its own (q_a's product before its norm, o_proj's before the residual
    add). The residual may also be a `stacked.Sum` of an array and an array or `stacked.Parts` (a MoE
    layer's routed and shared products, for the next layer's norm to add), added as `stacked.Sum.value`.
    scale: [D], or with ``layer`` (a scalar int, may be traced) the stacked layers' scales [L, D], of which
    layer ``layer`` is read in place (a slice of it would be a kernel of its own).
    capture: ``(buf, slot)``, buf [R, M, D] of any float dtype and slot a scalar int (may be traced), or with
    ``layer`` a table [L] of rows by layer (``slot[layer]``, read in the kernel): the call then returns
    ``(y, s, buf)`` with that row of buf the residual stream's rows (``s``, or x without a residual; x an array
    then) rounded to buf's dtype, the other rows as they were (updated in place).
    Differentiable (the backward pass is XLA's, of `reference`)."""
    stack = scale if layer is not None else scale[None]
    x_in, x_parts, x_shape = _operand("x", x_MD)
    h_in, h_parts, h_sum, h_shape = ((), (), None, None) if residual is None else _residual(residual)
    if len(x_shape) != 2 or stack.ndim != 2 or stack.shape[1] != x_shape[1]:
        want = "[L, D] (layer given)" if layer is not None else "[D]"
        raise ValueError(f"rms_norm_rows: expected x [M, D] and scale {want}, found {x_shape} and {scale.shape}")
    if residual is not None and h_shape != x_shape:
        raise ValueError(f"rms_norm_rows: residual {h_shape} does not match x {x_shape}")
    M, D = x_shape
    width = width_for(D)
    if width is None:
        raise ValueError(f"rms_norm_rows: rows of D={D} do not fit one block (16 to {MAX_WIDTH} columns)")
    dtype = jnp.dtype(dtype or stack.dtype)
    Mp = stacked_matmul.padded_rows(M)
    has_res = residual is not None
    layer_given = layer is not None
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
    buf, slot = (None, None) if capture is None else capture
    if capture is not None:
        if x_parts is not None:
            raise ValueError("rms_norm_rows: capture needs x as an array (the residual stream), found partials")
        if buf.ndim != 3 or tuple(buf.shape[1:]) != (M, D) or not jnp.issubdtype(buf.dtype, jnp.floating):
            raise ValueError(f"rms_norm_rows: capture buffer must be float [R, {M}, {D}], found {buf.dtype}{buf.shape}")
        slot = jnp.asarray(slot, jnp.int32)
        if slot.ndim > 1 or (slot.ndim == 1 and (not layer_given or slot.shape[0] != stack.shape[0])):
            raise ValueError(
                f"rms_norm_rows: capture's slot must be a scalar, or with layer a table [{stack.shape[0]}] of rows by "
                f"layer; found shape {slot.shape} (layer {'given' if layer_given else 'not given'})"
            )
    by_layer = capture is not None and slot.ndim == 1  # a table: its row for the layer, read in the kernel
    slot = None if capture is None else slot.reshape(-1)

    def forward(x, h, stack, buf, slot, layer):
        params = None
        if not interpret and plgpu is not None:
            params = plgpu.CompilerParams(num_warps=warps_for(width), num_stages=1)
        out_shape = [jax.ShapeDtypeStruct((Mp, D), dtype)]
        if has_res:
            out_shape.append(jax.ShapeDtypeStruct((M, D), jnp.float32))
        cap_in, aliases = (), {}
        if buf is not None:
            cap_in = (slot, buf)
            aliases = {2 + len(h) + 1 + 1: len(out_shape)}  # layer, x, h.., the scales, slot: the buffer
            out_shape.append(jax.ShapeDtypeStruct(buf.shape, buf.dtype))
        outs = pl.pallas_call(
            functools.partial(
                _kernel,
                m=M,
                d=D,
                width=width,
                eps=float(eps),
                dtype=dtype,
                x_parts=x_parts,
                h_parts=h_parts,
                h_sum=h_sum,
                capture=buf is not None,
                by_layer=by_layer,
            ),
            out_shape=tuple(out_shape),
            grid=(Mp,),
            input_output_aliases=aliases,
            interpret=interpret,
            compiler_params=params,
            name="rms_norm_rows",
        )(layer.reshape(1), x, *h, stack, *cap_in)
        return (outs[0], (outs[1] if has_res else None)) + ((outs[-1],) if buf is not None else ())

    def summed(v, parts_dtype):  # an operand as the array it stands for (`stacked.Parts.value`)
        return v if parts_dtype is None else stacked_matmul.sum_parts(v, M).astype(parts_dtype)

    def padded_reference(x, h, stack, buf, slot, layer):
        w = jax.lax.dynamic_index_in_dim(stack, layer, axis=0, keepdims=False)
        terms = [summed(v, p) for v, p in zip(h, h_parts)]
        res = None if not terms else terms[0] if h_sum is None else stacked.Sum(*terms).value
        x = summed(x, x_parts)
        y, s = reference(x, w, eps, res, dtype)
        out = (jnp.pad(y, ((0, Mp - M), (0, 0))), s)
        if buf is None:
            return out
        stream = (s if res is not None else x.astype(jnp.float32)).astype(buf.dtype)
        row = slot[layer] if by_layer else slot[0]
        return out + (jax.lax.dynamic_update_index_in_dim(buf, stream, row, axis=0),)

    # the slot and the layer are integer operands (no cotangent); the buffer is differentiable, as a
    # `dynamic_update_slice` of it would be
    return with_reference_gradient(forward, padded_reference, nondiff=2)(x_in, h_in, stack, buf, slot, layer)


def available(dtype="bfloat16") -> str | None:
    """Why the compiled kernel cannot run here for ``dtype`` rows, or None (one probe per dtype)."""
    return _available(jnp.dtype(dtype).name)


def sum_available(dtype="bfloat16") -> str | None:
    """Why the compiled kernel cannot take a two-term residual (`stacked.Sum`: the MoE add left to the next
    norm) here for ``dtype`` rows, or None. Probed apart: where it fails, the layers make that add in XLA."""
    return available(dtype) or _sum_available(jnp.dtype(dtype).name)


def capture_available(dtype="bfloat16") -> str | None:
    """Why the compiled kernel cannot also store the stream's rows into a captured-states buffer in place
    (``capture=``) here for ``dtype`` rows and buffer, or None. Probed apart: where it fails, the layers keep
    XLA's `dynamic_update_slice`."""
    return available(dtype) or _capture_available(jnp.dtype(dtype).name)


@functools.cache
def _available(dtype: str) -> str | None:
    """Needs a GPU backend with Pallas' Triton lowering; the first call compiles and checks a small
    norm (`probe`; run at once, so it may be asked inside a trace)."""
    from jaxspec.kernels import gpu_problem

    return gpu_problem(plgpu) or probe(dtype)


@functools.cache
def _sum_available(dtype: str) -> str | None:
    return probe(dtype, two_terms=True)


@functools.cache
def _capture_available(dtype: str) -> str | None:
    return probe(dtype, capture=True)


def probe(
    dtype="bfloat16", two_terms: bool = False, interpret: bool = False, fault=None, capture: bool = False
) -> str | None:
    """A small norm with a residual compiled and run now, checked: padding rows zero, the float32 sum exactly
    x + h (computed in numpy), the rows within rounding of `reference`. ``two_terms``: the residual a
    `stacked.Sum` of an array and two K parts, whose sum must be numpy's: the parts added in order, rounded
    to ``dtype``, added to the array in float32, rounded, added to x. ``capture``: the call, its scale read at
    layer 1 of a stack of two, also stores the sum into row 1 of a buffer [3, M, D] of ``dtype`` (``capture=``
    with a table of rows by layer, [2, 1]), and a second call without a residual stores x there (a scalar
    slot): row 1 must be numpy's rounding of each, rows 0 and 2 untouched, and y the same bits as the calls
    without a buffer. Returns what went wrong, or None. ``fault(y, s)`` (``fault(y, s, buf)`` with
    ``capture``) alters the kernel's results before the checks (tests: that the probe refuses them)."""
    from jaxspec.kernels import run_compiled

    try:
        dt = jnp.dtype(dtype)
        rng = np.random.default_rng(0)
        M, D = 3, 2048
        Mp = stacked_matmul.padded_rows(M)
        x = rng.normal(size=(M, D)).astype(np.float32)
        h = rng.normal(size=(M, D)).astype(dt)
        parts = rng.normal(size=(2, Mp, D)).astype(np.float32)
        scale = (1 + rng.normal(size=(D,)) / 4).astype(dt)

        def residual(h, p):
            return stacked.Sum(h, stacked.Parts(p, (M, D), dt)) if two_terms else h

        def call(x, h, p, w):
            return rms_norm_rows(x, w, 1e-6, residual=residual(h, p), interpret=interpret)

        y, s = run_compiled(call, x, h, parts, scale)
        if capture:
            buf = np.full((3, M, D), 7.0, dt)  # a value no row rounds to

            def call_cap(x, h, p, w, buf):
                # the stacked layers' form first: scales [2, D] read at layer 1, the row from a table by layer
                stack, table = jnp.stack([w * 2, w]), jnp.asarray([2, 1], jnp.int32)
                res = residual(h, p)
                first = rms_norm_rows(x, stack, 1e-6, residual=res, layer=1, capture=(buf, table), interpret=interpret)
                alone = rms_norm_rows(x, w, 1e-6, capture=(buf, 1), interpret=interpret)
                return first, alone

            (y_cap, s_cap, buf_sum), (y_alone, _, buf_x) = run_compiled(call_cap, x, h, parts, scale, buf)
            y_plain, _ = run_compiled(lambda x, w: rms_norm_rows(x, w, 1e-6, interpret=interpret), x, scale)
            if fault is not None:
                y_cap, s_cap, buf_sum = fault(y_cap, s_cap, buf_sum)
            if not (np.array_equal(y_cap, y) and np.array_equal(s_cap, s) and np.array_equal(y_alone, y_plain)):
                return "the probe call with a capture buffer gave other rows than the calls without one"
            for got, stream in ((buf_sum, s), (buf_x, x)):
                if not np.array_equal(got[1], stream.astype(dt)):
                    return "the probe call's captured rows are not the stream rounded to the buffer's dtype"
                if np.any(got[0] != buf[0]) or np.any(got[2] != buf[2]):
                    return "the probe call's capture touched the buffer's other rows"
        elif fault is not None:
            y, s = fault(y, s)
        add = h.astype(np.float32)
        if two_terms:
            shared = (parts[0, :M] + parts[1, :M]).astype(dt).astype(np.float32)
            add = (add + shared).astype(dt).astype(np.float32)
        want_s = x + add
        want, _ = run_compiled(lambda x, w: reference(x, w, 1e-6), want_s, scale)
        if y.shape[0] != Mp or np.any(y[M:].astype(np.float32) != 0):
            return "the probe call did not zero its padding rows"
        if not np.array_equal(s, want_s):
            return "the probe call's residual sum differs from x + h" + (" (h of two terms)" if two_terms else "")
        err = np.abs(y[:M].astype(np.float64) - want.astype(np.float64)).max()
        if err > 0.02 * np.abs(want.astype(np.float64)).max():
            return f"the probe call returned wrong values (error {err:.3g})"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"the probe call failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None
