"""The MLA cache write in one launch: kv_a's norm, the rope key's rotation, and the store into the
stacked latent cache in place. Pallas, Triton lowering.

``write_latents(cache, kv, slots, cos, sin, scale, eps, layer=l)`` returns the cache ``[Lc, B, S, C]``
with, for every token row ``m`` of ``kv [B*T, L + r]`` at slot ``slots[m]`` of its sequence in layer
``l``, the row ``[rms_norm(kv[m, :L]) * scale, rope(kv[m, L:])]`` (the latent, then the rotated rope
key): what `layers.rms_norm`, `layers.rotate` and `layers.write_slots` give in XLA, where a decode
layer ran them as four kernels (the norm, the rotation fused with the latent's concatenate, the
scatter, and the scale's slice out of its stack).

Grid ``(B*T,)``, one token row per program: the program loads its row whole (the latent as one
masked block of the next power of two, the rope key's two halves as two), its cos / sin and the
layer's norm scale (read in place from the stacked layers' scales), normalises, rotates, and stores
the row at its slot. The cache is the call's output aliased to its input, so nothing but the written
rows moves; a slot outside ``[0, S)`` writes nothing (padding rows aim at ``S``). A row's bits depend
on that row alone, never on how many rows the call holds (a verify row equals the decode step's).

Rounding is the reference's (`reference`): the norm as `layers.rms_norm` (float32 statistics, the
normalised row rounded to the compute dtype, times the scale, rounded); the rotation as `layers.rotate`
does it in the compute dtype, each product and sum rounded (as HF's eager bfloat16 does). Only the
order of the sum of squares may differ from XLA's reduction.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxspec import layers

try:  # the Triton lowering's compiler parameters (GPU builds)
    from jax.experimental.pallas import triton as plgpu
except Exception:  # noqa: BLE001 - optional
    plgpu = None

MAX_WIDTH = 16384  # the widest latent a program holds at once


def _block(n: int) -> int:
    """The power-of-two block a program loads ``n`` values into (Triton's blocks are powers of two)."""
    return max(16, 1 << (n - 1).bit_length())


def shapes_ok(latent: int, rope_dim: int) -> bool:
    """Whether the kernel takes a latent of ``latent`` values and a rope key of ``rope_dim``."""
    return 16 <= latent <= MAX_WIDTH and rope_dim >= 2 and rope_dim % 2 == 0 and rope_dim <= 1024


def _kernel(
    layer_ref, slots_ref, kv_ref, cos_ref, sin_ref, scale_ref, _cache_in, cache_ref, *, t, s, lat, half, eps, il
):
    m = pl.program_id(0)
    f32 = jnp.float32
    dt = kv_ref.dtype
    wl, wr = _block(lat), _block(half)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, wl), 1)
    live = cols < lat
    pair = jax.lax.broadcasted_iota(jnp.int32, (1, wr), 1)
    plive = pair < half
    row_l = jnp.full((1, wl), m, jnp.int32)
    row_r = jnp.full((1, wr), m, jnp.int32)
    slot = slots_ref[m]

    @pl.when((slot >= 0) & (slot < s))
    def _():
        # every load first: at decode sizes a program waits on memory, not on math
        sl = jnp.full((1, wl), layer_ref[1], jnp.int32)
        w = plgpu.load(scale_ref.at[sl, cols], mask=live, other=0).astype(dt).astype(f32)
        x = plgpu.load(kv_ref.at[row_l, cols], mask=live, other=0).astype(f32)
        first = lat + (2 * pair if il else pair)
        second = lat + (2 * pair + 1 if il else half + pair)
        x1 = plgpu.load(kv_ref.at[row_r, first], mask=plive, other=0).astype(f32)
        x2 = plgpu.load(kv_ref.at[row_r, second], mask=plive, other=0).astype(f32)
        c = plgpu.load(cos_ref.at[row_r, pair], mask=plive, other=0).astype(f32)
        sn = plgpu.load(sin_ref.at[row_r, pair], mask=plive, other=0).astype(f32)
        inv = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / lat + eps)
        latent = (w * (x * inv).astype(dt).astype(f32)).astype(dt)
        rnd = lambda v: v.astype(dt).astype(f32)  # noqa: E731 - one op of the compute dtype
        r1 = (rnd(x1 * c) - rnd(x2 * sn)).astype(dt)
        r2 = (rnd(x2 * c) + rnd(x1 * sn)).astype(dt)
        out = cache_ref.dtype
        b = m // t
        lyr_l = jnp.full((1, wl), layer_ref[0], jnp.int32)
        lyr_r = jnp.full((1, wr), layer_ref[0], jnp.int32)
        b_l = jnp.full((1, wl), b, jnp.int32)
        b_r = jnp.full((1, wr), b, jnp.int32)
        s_l = jnp.full((1, wl), slot, jnp.int32)
        s_r = jnp.full((1, wr), slot, jnp.int32)
        plgpu.store(cache_ref.at[lyr_l, b_l, s_l, cols], latent.astype(out), mask=live)
        plgpu.store(cache_ref.at[lyr_r, b_r, s_r, lat + pair], r1.astype(out), mask=plive)
        plgpu.store(cache_ref.at[lyr_r, b_r, s_r, lat + half + pair], r2.astype(out), mask=plive)


def reference(cache, kv_BTC, slots_BT, cos_BTR, sin_BTR, scale_D, eps: float, layer, interleaved: bool):
    """The same in XLA ops (`layers.rms_norm`, `layers.rotate`, `layers.write_slots`)."""
    lat = scale_D.shape[-1]
    latent = layers.rms_norm(kv_BTC[..., :lat], scale_D, eps)
    rope = layers.rotate(kv_BTC[..., lat:], cos_BTR, sin_BTR, interleaved)
    return layers.write_slots(cache, jnp.concatenate([latent, rope], axis=-1), slots_BT, layer)


def write_latents(
    cache_LBSC,
    kv_BTC,
    slots_BT,
    cos_BTR,
    sin_BTR,
    scale,
    eps: float,
    *,
    layer,
    scale_layer=None,
    interleaved: bool = False,
    interpret: bool = False,
):
    """The cache with this call's latents written in layer ``layer`` (see the module docstring).

    cache [Lc, B, S, L + r]; kv [B, T, L + r] (kv_a's output, the compute dtype); slots [B, T] int;
    cos / sin [B, T, r / 2] in kv's dtype (`layers.rope_tables`); scale: the norm's [L], or with
    ``scale_layer`` (a scalar int, may be traced) the stacked layers' scales [Ls, L], read in place.
    ``layer``: the cache's layer (a scalar int, may be traced). ``interleaved``: the rope key's
    pairs are (2i, 2i + 1) (`layers.rope`). Differentiable (the backward pass is XLA's, of `reference`)."""
    stack = scale if scale_layer is not None else scale[None]
    if cache_LBSC.ndim != 4 or kv_BTC.ndim != 3 or stack.ndim != 2:
        want = "[Ls, L] (scale_layer given)" if scale_layer is not None else "[L]"
        raise ValueError(
            f"write_latents: expected cache [Lc, B, S, C], kv [B, T, C] and scale {want}, found "
            f"{cache_LBSC.shape}, {kv_BTC.shape} and {scale.shape}"
        )
    _, B, S, C = cache_LBSC.shape
    _, T, _ = kv_BTC.shape
    lat = stack.shape[1]
    r = C - lat
    if kv_BTC.shape != (B, T, C) or slots_BT.shape != (B, T):
        raise ValueError(
            f"write_latents: kv {kv_BTC.shape} and slots {slots_BT.shape} do not match the cache's "
            f"batch and row width (B={B}, C={C})"
        )
    if not shapes_ok(lat, r):
        raise ValueError(f"write_latents: a latent of {lat} and a rope key of {r} do not fit the kernel")
    if cos_BTR.shape != (B, T, r // 2) or sin_BTR.shape != cos_BTR.shape:
        raise ValueError(
            f"write_latents: cos {cos_BTR.shape} / sin {sin_BTR.shape}, expected {(B, T, r // 2)} "
            f"(the rope key has {r} values)"
        )
    M = B * T
    layers_ = jnp.stack(
        [jnp.asarray(layer, jnp.int32), jnp.asarray(0 if scale_layer is None else scale_layer, jnp.int32)]
    )

    def forward(cache, kv, slots, cos, sin, stack, layers_):
        params = None
        if not interpret and plgpu is not None:
            params = plgpu.CompilerParams(num_warps=4, num_stages=1)
        kernel = functools.partial(_kernel, t=T, s=S, lat=lat, half=r // 2, eps=float(eps), il=interleaved)
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
            grid=(M,),
            input_output_aliases={6: 0},
            interpret=interpret,
            compiler_params=params,
            name="write_latents",
        )(
            layers_,
            slots.reshape(M).astype(jnp.int32),
            kv.reshape(M, C),
            cos.reshape(M, r // 2),
            sin.reshape(M, r // 2),
            stack,
            cache,
        )

    def ref(cache, kv, cos, sin, stack, layers_):
        w = jax.lax.dynamic_index_in_dim(stack, layers_[1], axis=0, keepdims=False)
        return reference(cache, kv, slots_BT, cos, sin, w, eps, layers_[0], interleaved)

    @jax.custom_vjp
    def write(cache, kv, cos, sin, stack, layers_):
        return forward(cache, kv, slots_BT, cos, sin, stack, layers_)

    def fwd(cache, kv, cos, sin, stack, layers_):
        return write(cache, kv, cos, sin, stack, layers_), (cache, kv, cos, sin, stack, layers_)

    def bwd(res, g):
        *prim, layers_ = res
        _, vjp = jax.vjp(lambda *p: ref(*p, layers_), *prim)
        return (*vjp(g), None)

    write.defvjp(fwd, bwd)
    return write(cache_LBSC, kv_BTC, cos_BTR, sin_BTR, stack, layers_)


def available(dtype="bfloat16") -> str | None:
    """Why the compiled kernel cannot run here for a ``dtype`` model, or None (one probe per dtype)."""
    return _available(jnp.dtype(dtype).name)


@functools.cache
def _available(dtype: str) -> str | None:
    """Needs a GPU backend with Pallas' Triton lowering; the first call compiles a small write
    (two layers, a padding slot, the rope key interleaved) and checks it against `reference`: the
    rows it should not touch keep their bits, the written ones are within rounding (run at once, so
    it may be asked inside a trace)."""
    from jaxspec.kernels import gpu_problem, run_compiled

    if (problem := gpu_problem(plgpu)) is not None:
        return problem
    try:
        dt = jnp.dtype(dtype)
        rng = np.random.default_rng(0)
        B, T, S, lat, r = 2, 3, 8, 512, 64
        cache = rng.normal(size=(2, B, S, lat + r)).astype(dt)
        kv = rng.normal(size=(B, T, lat + r)).astype(dt)
        slots = np.array([[0, 1, S], [5, 6, 7]], np.int32)
        angle = rng.uniform(0, 6, size=(B, T, r // 2))
        cos, sin = np.cos(angle).astype(dt), np.sin(angle).astype(dt)
        scale = (1 + rng.normal(size=(3, lat)) / 4).astype(dt)
        got = run_compiled(
            lambda c, kv, co, si, w: write_latents(
                c, kv, slots, co, si, w, 1e-6, layer=1, scale_layer=2, interleaved=True
            ),
            cache,
            kv,
            cos,
            sin,
            scale,
        )
        want = run_compiled(
            lambda c, kv, co, si, w: reference(c, kv, slots, co, si, w[2], 1e-6, 1, True), cache, kv, cos, sin, scale
        )
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
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"the probe call failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None
