"""The cache write's kernel (`jaxspec.kernels.latent_write`: kv_a's norm, the rope key's rotation and the
store into the latent cache), in Pallas interpret mode.

References: a float64 numpy norm and rotation of the same inputs, and the XLA form the model runs
without the kernel (`layers.rms_norm`, `layers.rotate`, `layers.write_slots`: `latent_write.reference`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import latent_write as lw


def _inputs(rng, B, T, S, lat, r, dtype, layers_=3, scales=4):
    cache = rng.normal(size=(layers_, B, S, lat + r))
    kv = rng.normal(size=(B, T, lat + r)) * 3
    angle = rng.uniform(0, 40, size=(B, T, r // 2))
    scale = 1 + rng.normal(size=(scales, lat)) / 4
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(cache), cast(kv), cast(np.cos(angle)), cast(np.sin(angle)), cast(scale)


def _f64_row(kv_row, cos, sin, scale, eps, lat, interleaved):
    kv_row = np.asarray(kv_row, np.float64)
    x = kv_row[:lat]
    latent = np.asarray(scale, np.float64) * x / np.sqrt(np.mean(x * x) + eps)
    rope = kv_row[lat:]
    x1, x2 = (rope[0::2], rope[1::2]) if interleaved else np.split(rope, 2)
    c, s = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    return np.concatenate([latent, x1 * c - x2 * s, x2 * c + x1 * s])


@pytest.mark.parametrize(
    "B,T,S,lat,r,interleaved",
    [(1, 1, 64, 512, 64, True), (2, 5, 16, 512, 64, False), (3, 3, 9, 40, 8, True), (2, 4, 20, 96, 6, False)],
)
def test_written_rows_match_float64_and_nothing_else_moves(B, T, S, lat, r, interleaved):
    rng = np.random.default_rng()
    cache, kv, cos, sin, scale = _inputs(rng, B, T, S, lat, r, jnp.float32)
    cache = cache.at[0].set(jnp.nan)  # a layer the call must not touch, poisoned
    # distinct slots per sequence, one padding row aimed at S (dropped), the last slot used
    slots = np.stack([rng.permutation(S - 1)[:T] for _ in range(B)]).astype(np.int32)
    slots[0, -1] = S
    slots[-1, 0] = S - 1
    got = jax.jit(
        lambda c, kv, co, si, w: lw.write_latents(
            c, kv, jnp.asarray(slots), co, si, w, 1e-6, layer=1, scale_layer=2, interleaved=interleaved, interpret=True
        )
    )(cache, kv, cos, sin, scale)
    got, before = np.asarray(got), np.asarray(cache)
    written = np.zeros(before.shape[:3], bool)
    for b in range(B):
        for t in range(T):
            if slots[b, t] < S:
                written[1, b, slots[b, t]] = True
                want = _f64_row(kv[b, t], cos[b, t], sin[b, t], scale[2], 1e-6, lat, interleaved)
                assert np.abs(got[1, b, slots[b, t]] - want).max() < 2e-6 * np.abs(want).max()
    np.testing.assert_array_equal(got[~written], before[~written])  # NaN-poisoned layer 0 included
    assert np.isnan(got[0]).all()


@pytest.mark.parametrize("interleaved", [True, False])
def test_bfloat16_rows_are_the_xla_forms_bits_up_to_the_sum_of_squares(interleaved):
    """The norm rounds as `layers.rms_norm` and the rotation as `layers.rotate` (each bfloat16 op rounded): the same
    bits, but XLA sums a row's squares in its own order, so a rare latent element may be one step off."""
    rng = np.random.default_rng()
    B, T, S, lat, r = 4, 4, 32, 512, 64
    cache, kv, cos, sin, scale = _inputs(rng, B, T, S, lat, r, jnp.bfloat16)
    slots = jnp.asarray(np.stack([rng.permutation(S)[:T] for _ in range(B)]), jnp.int32)
    got = lw.write_latents(cache, kv, slots, cos, sin, scale, 1e-6, layer=2, scale_layer=1, interleaved=interleaved,
                           interpret=True)  # fmt: skip
    want = lw.reference(cache, kv, slots, cos, sin, scale[1], 1e-6, 2, interleaved)
    assert got.dtype == jnp.bfloat16
    g, w = np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)
    assert np.mean(g != w) < 0.002, np.mean(g != w)
    assert np.abs(g.astype(np.int32) - w.astype(np.int32)).max() <= 1
    # into a float32 cache the bfloat16 row is stored exactly (widened), as `write_slots` would
    got32 = lw.write_latents(cache.astype(jnp.float32), kv, slots, cos, sin, scale, 1e-6, layer=2, scale_layer=1,
                             interleaved=interleaved, interpret=True)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got32), np.asarray(got.astype(jnp.float32)))


def test_a_row_has_the_same_bits_alone_and_among_others():
    """A verify's rows and a decode step's: the same token written alone or beside others is the same row."""
    rng = np.random.default_rng()
    B, T, S, lat, r = 3, 6, 16, 512, 64
    for dtype in (jnp.float32, jnp.bfloat16):
        cache, kv, cos, sin, scale = _inputs(rng, B, T, S, lat, r, dtype)
        slots = jnp.asarray(np.tile(np.arange(T), (B, 1)), jnp.int32)
        run = jax.jit(
            lambda c, kv, sl, co, si, w: lw.write_latents(
                c, kv, sl, co, si, w, 1e-6, layer=0, scale_layer=3, interleaved=True, interpret=True
            )
        )
        together = np.asarray(run(cache, kv, slots, cos, sin, scale))
        for t in range(T):
            one = lambda a, t=t: a[1:2, t : t + 1]  # noqa: E731
            alone = np.asarray(run(cache[:, 1:2], one(kv), one(slots), one(cos), one(sin), scale))
            np.testing.assert_array_equal(alone[0, 0, t], together[0, 1, t])


def test_under_a_scan_each_layer_writes_its_own_cache_layer_with_its_own_scale():
    rng = np.random.default_rng()
    B, T, S, lat, r, L = 2, 2, 8, 64, 16, 3
    cache, kv, cos, sin, scale = _inputs(rng, B, T, S, lat, r, jnp.float32, layers_=L + 1, scales=L)
    slots = jnp.asarray([[2, 3], [0, S]], jnp.int32)

    def body(write):
        def step(c, i):
            return write(c, kv * (i + 1), i + 1, i), None

        return jax.lax.scan(step, cache, jnp.arange(L))[0]

    got = jax.jit(
        lambda: body(
            lambda c, x, lyr, i: lw.write_latents(
                c, x, slots, cos, sin, scale, 1e-6, layer=lyr, scale_layer=i, interpret=True
            )
        )
    )()
    want = body(lambda c, x, lyr, i: lw.reference(c, x, slots, cos, sin, scale[i], 1e-6, lyr, False))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(cache[0]))
    assert float(jnp.abs(got - want).max()) < 2e-6 * float(jnp.abs(want).max())


def test_gradients_match_the_xla_form():
    rng = np.random.default_rng(5)
    B, T, S, lat, r = 2, 3, 8, 32, 8
    cache, kv, cos, sin, scale = _inputs(rng, B, T, S, lat, r, jnp.float32, layers_=2, scales=2)
    slots = jnp.asarray([[0, 1, 2], [4, S, 5]], jnp.int32)
    probe = jnp.asarray(rng.normal(size=cache.shape), jnp.float32)

    def loss(write, c, x, co, si, w):
        return jnp.sum(jnp.sin(write(c, x, co, si, w)) * probe)

    kernel = lambda c, x, co, si, w: lw.write_latents(  # noqa: E731
        c, x, slots, co, si, w, 1e-6, layer=1, scale_layer=1, interleaved=True, interpret=True
    )
    ref = lambda c, x, co, si, w: lw.reference(c, x, slots, co, si, w[1], 1e-6, 1, True)  # noqa: E731
    got = jax.grad(lambda *a: loss(kernel, *a), argnums=(0, 1, 2, 3, 4))(cache, kv, cos, sin, scale)
    want = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2, 3, 4))(cache, kv, cos, sin, scale)
    for g, w in zip(got, want):
        assert float(jnp.abs(g - w).max()) <= 1e-5 * max(float(jnp.abs(w).max()), 1e-30)
    assert float(jnp.abs(want[1]).max()) > 0 and float(jnp.abs(want[4]).max()) > 0


def test_bad_input_is_refused_with_the_shapes():
    rng = np.random.default_rng()
    cache, kv, cos, sin, scale = _inputs(rng, 2, 3, 8, 32, 8, jnp.float32)
    slots = jnp.zeros((2, 3), jnp.int32)
    write = lambda **kw: lw.write_latents(  # noqa: E731
        **{
            "cache_LBSC": cache,
            "kv_BTC": kv,
            "slots_BT": slots,
            "cos_BTR": cos,
            "sin_BTR": sin,
            "scale": scale,
            "eps": 1e-6,
            "layer": 0,
            "scale_layer": 0,
            "interpret": True,
            **kw,
        }  # fmt: skip
    )
    with pytest.raises(ValueError, match=r"kv \(2, 3, 39\)"):
        write(kv_BTC=kv[..., :39])
    with pytest.raises(ValueError, match=r"slots \(2, 2\)"):
        write(slots_BT=slots[:, :2])
    with pytest.raises(ValueError, match=r"cos \(2, 3, 3\).*expected \(2, 3, 4\)"):
        write(cos_BTR=cos[..., :3])
    with pytest.raises(ValueError, match=r"scale \[L\]"):
        write(scale_layer=None)
    with pytest.raises(ValueError, match=r"rope key of 7"):
        write(cache_LBSC=cache[..., :39], kv_BTC=kv[..., :39])
