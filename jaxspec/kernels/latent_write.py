"""The MLA cache write in one launch: kv_a's product summed, its norm, the rope key's rotation, and
the store into the stacked latent cache in place. Pallas, Triton lowering.

``write_latents(cache, kv, slots, positions, scale, eps, inv_freq=f, layer=l)`` returns the cache
``[Lc, B, S, C]`` with, for every token row ``m`` of ``kv [B, T, L + r]`` (flattened) at slot ``slots[m]`` of its
sequence in layer ``l``, the row ``[rms_norm(kv[m, :L]) * scale, rope(kv[m, L:], positions[m])]``
(the latent, then the rotated rope key): what `layers.rms_norm`, `layers.rope` and
`layers.write_slots` give in XLA, where a decode layer ran them as four kernels (the norm, the
rotation fused with the latent's concatenate, the scatter, and the scale's slice out of its stack),
after a fifth that added the dense kernel's K parts of kv (`stacked.Parts`: the kernel reads them).

Grid ``(B*T,)``, one token row per program: the program loads its row whole (the latent as one
masked block of the next power of two, the rope key's two halves as two; each as the sum of the dense
kernel's K parts in ascending order, `stacked_matmul.sum_parts`, rounded to the compute dtype), the
layer's norm scale (read in place from the stacked layers' scales), computes the rope tables of its
position (float32 angles, cos and sin scaled and rounded, as `layers.rope` makes them), normalises,
rotates, and stores the row at its slot. The cache is the call's output aliased to its input, so
nothing but the written rows moves; a slot at or past ``S`` writes nothing (padding rows aim at ``S``),
as in `layers.write_slots`; a negative slot, which `layers.write_slots` would wrap, writes nothing here
either (the model never makes one). A row's bits depend on that row alone, never on how many rows
the call holds (a verify row equals the decode step's).

With ``query`` (q_a's product, which the same dense kernel call makes beside kv's) the launch also runs
q_a's norm, as `kernels.rms_norm` writes it: grid ``(padded_rows(B*T), 2)``, program ``(m, 0)`` writes token
row m's latents (none for the padding rows), program ``(m, 1)`` normalises the query's row m into the dense
kernel's padded rows (`rms_norm.norm_row`, zeros past the last row). The two jobs of a layer's attention that
read the same dense call's products so take one launch, not two, side by side in separate programs; each row
is still a function of that row alone.

Rounding is the reference's (`reference`): the norm as `layers.rms_norm` (float32 statistics, the
normalised row rounded to the compute dtype, times the scale, rounded); the rotation as `layers.rope`
does it in the compute dtype, each product and sum rounded (as HF's eager bfloat16 does). The order of
the sum of squares may differ from XLA's reduction, and on the GPU the kernel's cos and sin (Triton's)
from XLA's: the query's rotation (XLA) and the key's (here) are each the same for every call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxspec import layers, stacked
from jaxspec.kernels import rms_norm, stacked_matmul, with_reference_gradient

try:  # the Triton lowering's compiler parameters (GPU builds)
    from jax.experimental.pallas import triton as plgpu
except Exception:  # noqa: BLE001 - optional
    plgpu = None

MAX_WIDTH = 16384  # the widest latent a program holds at once
WARPS = 4  # a program's warps, with or without the query's norm (the reductions' order follows them)
DEFAULT_CONFIG = {"query": True}
"""``query``: whether the model runs q_a's norm in the cache write's launch (``write_latents(query=...)``)
where both kernels serve its layer, or as a `kernels.rms_norm` launch of its own (False; an A/B switch for
timings: ``--kernel-config latent_write='{"query": false}'``). The rows' bits are the same either way."""


def _block(n: int) -> int:
    """The power-of-two block a program loads ``n`` values into (Triton's blocks are powers of two)."""
    return max(16, 1 << (n - 1).bit_length())


def shapes_ok(latent: int, rope_dim: int) -> bool:
    """Whether the kernel takes a latent of ``latent`` values and a rope key of ``rope_dim``."""
    return 16 <= latent <= MAX_WIDTH and rope_dim >= 2 and rope_dim % 2 == 0 and rope_dim <= 1024


def _kernel(layer_ref, scale_layer_ref, slots_ref, pos_ref, freq_ref, kv_ref, scale_ref, _cache_in, *refs, query, **kw):
    t, s, lat, half, eps, il, factor, dt, off, rows = (
        kw[k] for k in ("t", "s", "lat", "half", "eps", "il", "factor", "dt", "off", "rows")
    )
    m = pl.program_id(0)
    write = m < rows
    if query is not None:  # grid (padded rows, 2): program (m, 1) is the query norm's row m
        q_layer_ref, q_ref, q_scale_ref, cache_ref, y_ref = refs
        job = pl.program_id(1)
        write = write & (job == 0)

        @pl.when(job == 1)
        def _():
            rms_norm.norm_row(m, q_layer_ref, q_ref, q_scale_ref, y_ref, m=rows, dtype=dt, **query)

    else:
        (cache_ref,) = refs
    f32 = jnp.float32
    wl, wr = _block(lat), _block(half)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, wl), 1)
    live = cols < lat
    pair = jax.lax.broadcasted_iota(jnp.int32, (1, wr), 1)
    plive = pair < half
    row_l = jnp.full((1, wl), m, jnp.int32)
    row_r = jnp.full((1, wr), m, jnp.int32)
    slot = slots_ref[jnp.minimum(m, rows - 1)]  # the padding rows' programs (query) write no latent

    def row(cols_, mask, rows_):
        # kv's row: the dense kernel's K parts added in ascending order, rounded to the compute dtype
        # (`stacked_matmul.sum_parts`); a row given whole is one part of the compute dtype already
        acc = None
        for p in range(kv_ref.shape[0]):
            v = plgpu.load(kv_ref.at[jnp.full(cols_.shape, p, jnp.int32), rows_, cols_], mask=mask, other=0)
            acc = v.astype(f32) if acc is None else acc + v.astype(f32)
        return acc.astype(dt).astype(f32)

    @pl.when(write & (slot >= 0) & (slot < s))
    def _():
        # every load first: at decode sizes a program waits on memory, not on math
        sl = jnp.full((1, wl), scale_layer_ref[0], jnp.int32)
        w = plgpu.load(scale_ref.at[sl, cols], mask=live, other=0).astype(dt).astype(f32)
        x = row(cols, live, row_l)
        first = lat + (2 * pair if il else pair)
        second = lat + (2 * pair + 1 if il else half + pair)
        x1, x2 = row(first, plive, row_r), row(second, plive, row_r)
        freq = plgpu.load(freq_ref.at[pair], mask=plive, other=0)
        # the rope tables as `layers.rope` makes them: float32 angles, scaled, rounded
        angle = pos_ref[m].astype(f32) * freq
        c, sn = jnp.cos(angle), jnp.sin(angle)
        if factor != 1.0:
            c, sn = c * factor, sn * factor
        c, sn = c.astype(dt).astype(f32), sn.astype(dt).astype(f32)
        inv = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / lat + eps)
        latent = (w * (x * inv).astype(dt).astype(f32)).astype(dt)
        rnd = lambda v: v.astype(dt).astype(f32)  # noqa: E731 - one op of the compute dtype
        r1 = (rnd(x1 * c) - rnd(x2 * sn)).astype(dt)
        r2 = (rnd(x2 * c) + rnd(x1 * sn)).astype(dt)
        out = cache_ref.dtype
        b = m // t
        full = lambda v, like: jnp.full(like.shape, v, jnp.int32)  # noqa: E731
        lyr = layer_ref[0] + off
        plgpu.store(cache_ref.at[full(lyr, cols), full(b, cols), full(slot, cols), cols], latent.astype(out), mask=live)
        at = (full(lyr, pair), full(b, pair), full(slot, pair))
        plgpu.store(cache_ref.at[(*at, lat + pair)], r1.astype(out), mask=plive)
        plgpu.store(cache_ref.at[(*at, lat + half + pair)], r2.astype(out), mask=plive)


def reference(cache, kv_BTC, slots_BT, positions_BT, inv_freq, attention_factor, scale_D, eps, layer, interleaved):
    """The same in XLA ops (`layers.rms_norm`, `layers.rope`, `layers.write_slots`); kv an array or
    `stacked.Parts`."""
    kv_BTC = stacked.value(kv_BTC)
    lat = scale_D.shape[-1]
    latent = layers.rms_norm(kv_BTC[..., :lat], scale_D, eps)
    rope = layers.rope(kv_BTC[..., lat:], positions_BT, inv_freq, attention_factor, interleaved)
    return layers.write_slots(cache, jnp.concatenate([latent, rope], axis=-1), slots_BT, layer)


def write_latents(
    cache_LBSC,
    kv_BTC,
    slots_BT,
    positions_BT,
    scale,
    eps: float,
    *,
    inv_freq,
    attention_factor: float = 1.0,
    layer,
    scale_layer=None,
    interleaved: bool = False,
    interpret: bool = False,
    layer_offset: int = 0,
    query=None,
    query_scale=None,
    query_eps: float = 1e-6,
    query_scale_layer=None,
):
    """The cache with this call's latents written in layer ``layer`` (see the module docstring).

    cache [Lc, B, S, L + r]; kv [B, T, L + r]: kv_a's output in the compute dtype, or its
    `stacked.Parts` (the dense kernel's float32 partials, added here as `stacked.Parts.value` adds
    them); slots [B, T] int; positions [B, T] int (the rope key's angles: positions x ``inv_freq``
    [r / 2], cos and sin times ``attention_factor``, as `layers.rope`); scale: the norm's [L], or with
    ``scale_layer`` (a scalar int, may be traced) the stacked layers' scales [Ls, L], read in place.
    ``layer``: the cache's layer (a scalar int, may be traced), plus the static ``layer_offset`` (added in
    the kernel: a stacked layer's index counts from the stack's first layer). ``interleaved``: the rope key's
    pairs are (2i, 2i + 1) (`layers.rope`). Differentiable (the backward pass is XLA's, of `reference`).

    ``query`` [B, T, Dq] (q_a's product, of kv's dtype: an array or the dense kernel's `stacked.Parts`) runs
    q_a's norm in the same launch and returns ``(cache, rows)``: ``rows`` are `kernels.rms_norm`'s padded
    rows [padded_rows(B T), Dq] of the query's norm with ``query_scale`` ([Dq], or with
    ``query_scale_layer`` the stacked scales [Ls, Dq], read in place) and ``query_eps``, the bits that
    ``rms_norm.rms_norm_rows(query, query_scale, query_eps)`` gives (the same program code)."""
    stack = scale if scale_layer is not None else scale[None]
    parts = kv_BTC.parts if isinstance(kv_BTC, stacked.Parts) else None
    dt = jnp.dtype(kv_BTC.dtype)
    shape = tuple(kv_BTC.shape)
    if cache_LBSC.ndim != 4 or len(shape) != 3 or stack.ndim != 2:
        want = "[Ls, L] (scale_layer given)" if scale_layer is not None else "[L]"
        raise ValueError(
            f"write_latents: expected cache [Lc, B, S, C], kv [B, T, C] and scale {want}, found "
            f"{cache_LBSC.shape}, {shape} and {scale.shape}"
        )
    _, B, S, C = cache_LBSC.shape
    T = shape[1]
    lat = stack.shape[1]
    r = C - lat
    if shape != (B, T, C) or tuple(slots_BT.shape) != (B, T) or tuple(positions_BT.shape) != (B, T):
        raise ValueError(
            f"write_latents: kv {shape}, slots {tuple(slots_BT.shape)} and positions {tuple(positions_BT.shape)} "
            f"do not match the cache's batch and row width (B={B}, C={C})"
        )
    if not shapes_ok(lat, r):
        raise ValueError(f"write_latents: a latent of {lat} and a rope key of {r} do not fit the kernel")
    inv_freq = np.asarray(inv_freq, np.float32)  # static: a constant of the program
    if inv_freq.shape != (r // 2,):
        raise ValueError(f"write_latents: inv_freq {inv_freq.shape}, expected ({r // 2},) (a rope key of {r})")
    M = B * T
    if parts is None:
        parts = kv_BTC.reshape(1, M, C)
    elif parts.ndim != 3 or parts.shape[2] != C or parts.shape[1] < M:
        raise ValueError(f"write_latents: kv's partials {parts.shape} do not hold {M} rows of {C}")
    as_scalar = lambda v: jnp.asarray(0 if v is None else v, jnp.int32).reshape(1)  # noqa: E731
    statics = dict(
        t=T,
        s=S,
        lat=lat,
        half=r // 2,
        eps=float(eps),
        il=interleaved,
        factor=float(attention_factor),
        dt=dt,
        off=int(layer_offset),
        rows=M,
    )
    q_in, q_stack, q_parts, Mp, Dq = _query(query, query_scale, query_scale_layer, M, dt)
    if query is not None:
        width = rms_norm.width_for(Dq)
        statics["query"] = dict(d=Dq, width=width, eps=float(query_eps), x_parts=q_parts)
    else:
        statics["query"] = None

    def forward(cache, parts, stack, *rest):
        if query is not None:
            q, q_st, layer, scale_layer, slots, pos, q_layer = rest
            extra, grid = (q_layer, q, q_st), (Mp, 2)
            out_shape = (jax.ShapeDtypeStruct(cache.shape, cache.dtype), jax.ShapeDtypeStruct((Mp, Dq), dt))
        else:
            layer, scale_layer, slots, pos = rest
            extra, grid, out_shape = (), (M,), jax.ShapeDtypeStruct(cache.shape, cache.dtype)
        params = None
        if not interpret and plgpu is not None:
            params = plgpu.CompilerParams(num_warps=WARPS, num_stages=1)
        return pl.pallas_call(
            functools.partial(_kernel, **statics),
            out_shape=out_shape,
            grid=grid,
            input_output_aliases={7: 0},
            interpret=interpret,
            compiler_params=params,
            name="write_latents",
        )(layer, scale_layer, slots.reshape(M), pos.reshape(M), jnp.asarray(inv_freq), parts, stack, cache, *extra)

    def ref(cache, parts, stack, *rest):
        if query is not None:
            q, q_st, layer, scale_layer, slots, pos, q_layer = rest
        else:
            layer, scale_layer, slots, pos = rest
        kv = stacked.Parts(parts, shape, dt) if isinstance(kv_BTC, stacked.Parts) else parts.reshape(shape)
        w = jax.lax.dynamic_index_in_dim(stack, scale_layer[0], axis=0, keepdims=False)
        out = reference(cache, kv, slots, pos, inv_freq, attention_factor, w, eps, layer[0] + layer_offset, interleaved)
        if query is None:
            return out
        qv = q if q_parts is None else stacked_matmul.sum_parts(q, M).astype(q_parts)
        y, _ = rms_norm.reference(qv, jax.lax.dynamic_index_in_dim(q_st, q_layer[0], 0, False), query_eps, dtype=dt)
        return out, jnp.pad(y, ((0, Mp - M), (0, 0)))

    ints = (as_scalar(layer), as_scalar(scale_layer), slots_BT.astype(jnp.int32), positions_BT.astype(jnp.int32))
    if query is None:
        return with_reference_gradient(forward, ref, nondiff=len(ints))(cache_LBSC, parts, stack, *ints)
    ints = (*ints, as_scalar(query_scale_layer))
    return with_reference_gradient(forward, ref, nondiff=len(ints))(cache_LBSC, parts, stack, q_in, q_stack, *ints)


def query_fits(width: int) -> bool:
    """Whether q_a's norm over rows of ``width`` may run in the write's launch: `kernels.rms_norm` runs such
    rows with the write's `WARPS` (its sum of squares then reduces in the same order in either launch)."""
    w = rms_norm.width_for(width)
    return w is not None and rms_norm.warps_for(w) == WARPS


def _query(q, scale, scale_layer, M: int, dt):
    """(the array the kernel reads, the scales' stack [Ls, Dq], the partials' dtype or None, the padded rows,
    Dq) of `write_latents`' ``query``; Nones without one. Bad shapes or dtypes are refused, naming them."""
    if q is None:
        return None, None, None, None, None
    if scale is None:
        raise ValueError("write_latents: query given without query_scale")
    stack = scale if scale_layer is not None else scale[None]
    shape = tuple(q.shape)
    Dq = shape[-1] if shape else 0
    if len(shape) != 3 or shape[0] * shape[1] != M or stack.ndim != 2 or stack.shape[1] != Dq:
        want = "[Ls, Dq] (query_scale_layer given)" if scale_layer is not None else "[Dq]"
        raise ValueError(
            f"write_latents: expected query [B, T, Dq] with B * T = {M} (kv's rows) and query_scale {want}; "
            f"found {shape} and {tuple(scale.shape)}"
        )
    if jnp.dtype(q.dtype) != dt:
        raise ValueError(f"write_latents: query's dtype {jnp.dtype(q.dtype).name} is not kv's {dt.name}")
    if not query_fits(Dq):
        raise ValueError(
            f"write_latents: a query row of {Dq} does not fit one block of the write's {WARPS} warps "
            "(query_fits: the norm's own launch would run it with other warps)"
        )
    Mp = stacked_matmul.padded_rows(M)
    if isinstance(q, stacked.Parts):
        p = q.parts
        if p.ndim != 3 or p.shape[2] != Dq or p.shape[1] < M:
            raise ValueError(f"write_latents: query's partials {tuple(p.shape)} do not hold {M} rows of {Dq}")
        return p, stack, dt, Mp, Dq
    return q.reshape(M, Dq), stack, None, Mp, Dq


def available(dtype="bfloat16") -> str | None:
    """Why the compiled kernel cannot run here for a ``dtype`` model, or None (one probe per dtype)."""
    return _available(jnp.dtype(dtype).name)


def query_available(dtype="bfloat16") -> str | None:
    """Why the compiled launch with q_a's norm beside the write (``write_latents(query=...)``) cannot run here
    for a ``dtype`` model, or None. Probed apart from the plain write, which stays in use where this fails."""
    return available(dtype) or _query_available(jnp.dtype(dtype).name)


@functools.cache
def _available(dtype: str) -> str | None:
    """Needs a GPU backend with Pallas' Triton lowering; the first call compiles a small write and checks it
    (`probe`; run at once, so it may be asked inside a trace)."""
    from jaxspec.kernels import gpu_problem

    return gpu_problem(plgpu) or probe(dtype)


@functools.cache
def _query_available(dtype: str) -> str | None:
    return probe(dtype, query=True)


def probe(dtype="bfloat16", query: bool = False, interpret: bool = False, fault=None) -> str | None:
    """A small write compiled and run now (two layers, a padding slot, the rope key interleaved), checked
    against `reference`: the cache rows it should not touch keep their bits, the written ones are within
    rounding. With ``query`` also q_a's norm in the same launch, checked against `rms_norm.reference`, its
    padding rows zero, and the cache and rows against the two launches apart, bit for bit. Returns what went
    wrong, or None. ``fault(cache, rows)`` alters the kernel's results before the checks (tests: that the
    probe refuses a wrong kernel)."""
    from jaxspec.kernels import run_compiled

    try:
        dt = jnp.dtype(dtype)
        rng = np.random.default_rng(0)
        B, T, S, lat, r, Dq = 2, 3, 8, 512, 64, 1536
        M, Mp = B * T, stacked_matmul.padded_rows(B * T)
        cache = rng.normal(size=(2, B, S, lat + r)).astype(dt)
        parts = rng.normal(size=(2, Mp, lat + r)).astype(np.float32)  # two K parts, padded rows
        q_parts = rng.normal(size=(3, Mp, Dq)).astype(np.float32)
        slots = np.array([[0, 1, S], [5, 6, 7]], np.int32)
        pos = np.array([[0, 1, 2], [700, 9000, 3]], np.int32)
        freq = (1.0 / 10000 ** (np.arange(0, r, 2) / r)).astype(np.float32)
        scale = (1 + rng.normal(size=(3, lat)) / 4).astype(dt)
        q_scale = (1 + rng.normal(size=(3, Dq)) / 4).astype(dt)

        def write(c, p, w, **extra):
            kv = stacked.Parts(p, (B, T, lat + r), dt)
            return write_latents(
                c, kv, slots, pos, w, 1e-6, inv_freq=freq, attention_factor=1.25, layer=1, scale_layer=2,
                interleaved=True, interpret=interpret, **extra,
            )  # fmt: skip

        def call(c, p, w, qp, qw):
            if not query:
                return write(c, p, w), None
            return write(c, p, w, query=stacked.Parts(qp, (B, T, Dq), dt), query_scale=qw, query_scale_layer=1)

        def apart(c, p, w, qp, qw):  # the write alone and q's norm in a launch of its own
            q = stacked.Parts(qp, (M, Dq), dt)
            return write(c, p, w), rms_norm.rms_norm_rows(q, qw, 1e-6, dtype=dt, layer=1, interpret=interpret)[0]

        def want_fn(c, p, w, qp, qw):
            kv = stacked.Parts(p, (B, T, lat + r), dt)
            y, _ = rms_norm.reference(stacked_matmul.sum_parts(qp, M).astype(dt), qw[1], 1e-6, dtype=dt)
            return reference(c, kv, slots, pos, freq, 1.25, w[2], 1e-6, 1, True), y

        args = (cache, parts, scale, q_parts, q_scale)
        got, rows = run_compiled(call, *args)
        if fault is not None:
            got, rows = fault(got, rows)
        want, want_rows = run_compiled(want_fn, *args)
        written = np.zeros(cache.shape, bool)
        for b in range(B):
            for t in range(T):
                if slots[b, t] < S:
                    written[1, b, slots[b, t]] = True
        if not np.array_equal(got[~written], cache[~written]):
            return "the probe call changed cache rows it was not given"
        g, w = got[written].astype(np.float64), want[written].astype(np.float64)
        if np.abs(g - w).max() > 0.02 * np.abs(w).max():
            return f"the probe call returned wrong values (error {np.abs(g - w).max():.3g})"
        if query:
            if rows.shape != (Mp, Dq) or np.any(rows[M:].astype(np.float32) != 0):
                return f"the probe call's query rows {rows.shape} are not {(Mp, Dq)} with zero padding rows"
            g, w = rows[:M].astype(np.float64), want_rows.astype(np.float64)
            if np.abs(g - w).max() > 0.02 * np.abs(w).max():
                return f"the probe call's query norm returned wrong values (error {np.abs(g - w).max():.3g})"
            # the model counts on the bits of the two launches apart: the same programs' code and warps
            got_apart, rows_apart = run_compiled(apart, *args)
            if not np.array_equal(got, got_apart):
                return "the probe call's cache differs from the write's own launch"
            if not np.array_equal(rows, rows_apart):
                return "the probe call's query rows differ from the norm's own launch (rms_norm_rows)"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"the probe call failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None
