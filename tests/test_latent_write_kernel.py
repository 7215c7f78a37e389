"""The cache write's kernel (`jaxspec.kernels.latent_write`: kv_a's K parts added, its norm, the rope key's
rotation and the store into the latent cache), in Pallas interpret mode.

References: a float64 numpy norm and rotation of the same inputs, and the XLA form the model runs
without the kernel (`layers.rms_norm`, `layers.rope`, `layers.write_slots`: `latent_write.reference`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import stacked
from jaxspec.kernels import latent_write as lw
from jaxspec.kernels import stacked_matmul as sm
from jaxspec.layers import base_inv_freq


def _inputs(rng, B, T, S, lat, r, dtype, layers_=3, scales=4):
    cache = rng.normal(size=(layers_, B, S, lat + r))
    kv = rng.normal(size=(B, T, lat + r)) * 3
    pos = rng.integers(0, 5000, size=(B, T)).astype(np.int32)
    scale = 1 + rng.normal(size=(scales, lat)) / 4
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(cache), cast(kv), jnp.asarray(pos), cast(scale), base_inv_freq(r, 10000.0)


def _f64_row(kv_row, pos, freq, factor, scale, eps, lat, interleaved):
    kv_row = np.asarray(kv_row, np.float64)
    x = kv_row[:lat]
    latent = np.asarray(scale, np.float64) * x / np.sqrt(np.mean(x * x) + eps)
    rope = kv_row[lat:]
    x1, x2 = (rope[0::2], rope[1::2]) if interleaved else np.split(rope, 2)
    angle = (np.float32(pos) * freq).astype(np.float64)  # the float32 angle, as the model's tables take it
    c, s = np.cos(angle) * factor, np.sin(angle) * factor
    return np.concatenate([latent, x1 * c - x2 * s, x2 * c + x1 * s])


def _write(cache, kv, slots, pos, scale, freq, *, layer, scale_layer, interleaved=False, factor=1.0):
    return lw.write_latents(
        cache,
        kv,
        slots,
        pos,
        scale,
        1e-6,
        inv_freq=freq,
        attention_factor=factor,
        layer=layer,
        scale_layer=scale_layer,
        interleaved=interleaved,
        interpret=True,
    )


@pytest.mark.parametrize(
    "B,T,S,lat,r,interleaved",
    [(1, 2, 64, 512, 64, True), (2, 5, 16, 512, 64, False), (3, 3, 9, 40, 8, True), (2, 4, 20, 96, 6, False)],
)
def test_written_rows_match_float64_and_nothing_else_moves(B, T, S, lat, r, interleaved):
    rng = np.random.default_rng()
    cache, kv, pos, scale, freq = _inputs(rng, B, T, S, lat, r, jnp.float32)
    cache = cache.at[0].set(jnp.nan)  # a layer the call must not touch, poisoned
    # distinct slots per sequence, one padding row aimed at S (dropped), the last slot used
    slots = np.stack([rng.permutation(S - 1)[:T] for _ in range(B)]).astype(np.int32)
    slots[0, -1] = S
    slots[-1, 0] = S - 1
    got = jax.jit(
        lambda c, kv, p, w: _write(
            c, kv, jnp.asarray(slots), p, w, freq, layer=1, scale_layer=2, interleaved=interleaved, factor=1.25
        )  # fmt: skip
    )(cache, kv, pos, scale)
    got, before = np.asarray(got), np.asarray(cache)
    written = np.zeros(before.shape[:3], bool)
    for b in range(B):
        for t in range(T):
            if slots[b, t] < S:
                written[1, b, slots[b, t]] = True
                want = _f64_row(kv[b, t], pos[b, t], freq, 1.25, scale[2], 1e-6, lat, interleaved)
                assert np.abs(got[1, b, slots[b, t]] - want).max() < 4e-6 * np.abs(want).max()
    np.testing.assert_array_equal(got[~written], before[~written])  # NaN-poisoned layer 0 included
    assert np.isnan(got[0]).all()


@pytest.mark.parametrize("interleaved", [True, False])
def test_bfloat16_rows_are_the_xla_forms_bits_up_to_the_sum_of_squares(interleaved):
    """The norm rounds as `layers.rms_norm` and the rotation as `layers.rope` (each bfloat16 op rounded): the same
    bits, but XLA sums a row's squares in its own order, so a rare latent element may be one step off."""
    rng = np.random.default_rng()
    B, T, S, lat, r = 4, 4, 32, 512, 64
    cache, kv, pos, scale, freq = _inputs(rng, B, T, S, lat, r, jnp.bfloat16)
    slots = jnp.asarray(np.stack([rng.permutation(S)[:T] for _ in range(B)]), jnp.int32)
    got = _write(cache, kv, slots, pos, scale, freq, layer=2, scale_layer=1, interleaved=interleaved, factor=0.8)
    want = lw.reference(cache, kv, slots, pos, freq, 0.8, scale[1], 1e-6, 2, interleaved)
    assert got.dtype == jnp.bfloat16
    g, w = np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)
    np.testing.assert_array_equal(g[[0, 1]], np.asarray(cache[:2]).view(np.uint16))  # layers not written
    rows = np.asarray(slots)
    g, w = g[2, np.arange(B)[:, None], rows], w[2, np.arange(B)[:, None], rows]  # the written rows alone
    assert np.mean(g != w) < 0.002, np.mean(g != w)
    assert np.abs(g.astype(np.int32) - w.astype(np.int32)).max() <= 1
    # into a float32 cache the bfloat16 row is stored exactly (widened), as `write_slots` would
    got32 = _write(cache.astype(jnp.float32), kv, slots, pos, scale, freq, layer=2, scale_layer=1,
                   interleaved=interleaved, factor=0.8)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got32), np.asarray(got.astype(jnp.float32)))


def test_the_dense_kernels_partials_are_added_as_einsums_adds_them():
    """kv as `stacked.Parts` (q_a and kv_a's kernel call, its K parts not yet added): the same cache bits as
    the summed array `stacked.einsums` gives otherwise, for bfloat16 and float32."""
    rng = np.random.default_rng()
    B, T, S, lat, r, K = 2, 3, 16, 64, 16, 512
    for dtype in (jnp.bfloat16, jnp.float32):
        cache, _, pos, scale, freq = _inputs(rng, B, T, S, lat, r, dtype)
        x = jnp.asarray(rng.normal(size=(B, T, K)), dtype)
        w = stacked.LayerOf(jnp.asarray(rng.normal(size=(2, K, 24)) / 16, dtype), jnp.int32(1), "interpret")
        w_kv = stacked.LayerOf(jnp.asarray(rng.normal(size=(2, K, lat + r)) / 16, dtype), jnp.int32(1), "interpret")
        contracts = ("btk,kn->btn", "btk,kn->btn")
        q_raw, kv_raw = stacked.einsums(contracts, x, (w, w_kv), raw=(False, True))
        q, kv = stacked.einsums(contracts, x, (w, w_kv))
        assert isinstance(kv_raw, stacked.Parts) and kv_raw.parts.shape[0] > 1  # a K split: partials to add
        assert kv_raw.parts.shape[1] == sm.padded_rows(B * T) and kv_raw.shape == kv.shape
        np.testing.assert_array_equal(np.asarray(q_raw), np.asarray(q))
        np.testing.assert_array_equal(np.asarray(kv_raw.value), np.asarray(kv))
        slots = jnp.asarray([[0, 1, 2], [7, S, 9]], jnp.int32)
        got = _write(cache, kv_raw, slots, pos, scale, freq, layer=1, scale_layer=3)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(_write(cache, kv, slots, pos, scale, freq, layer=1,
                                                                         scale_layer=3)))  # fmt: skip


def test_a_row_has_the_same_bits_alone_and_among_others():
    """A verify's rows and a decode step's: the same token written alone or beside others is the same row."""
    rng = np.random.default_rng()
    B, T, S, lat, r = 3, 6, 16, 512, 64
    for dtype in (jnp.float32, jnp.bfloat16):
        cache, kv, pos, scale, freq = _inputs(rng, B, T, S, lat, r, dtype)
        slots = jnp.asarray(np.tile(np.arange(T), (B, 1)), jnp.int32)
        run = jax.jit(
            lambda c, kv, sl, p, w, f=freq: _write(c, kv, sl, p, w, f, layer=0, scale_layer=3, interleaved=True)
        )
        together = np.asarray(run(cache, kv, slots, pos, scale))
        for t in range(T):
            one = lambda a, t=t: a[1:2, t : t + 1]  # noqa: E731
            alone = np.asarray(run(cache[:, 1:2], one(kv), one(slots), one(pos), scale))
            np.testing.assert_array_equal(alone[0, 0, t], together[0, 1, t])


def test_under_a_scan_each_layer_writes_its_own_cache_layer_with_its_own_scale():
    rng = np.random.default_rng()
    B, T, S, lat, r, L = 2, 2, 8, 64, 16, 3
    cache, kv, pos, scale, freq = _inputs(rng, B, T, S, lat, r, jnp.float32, layers_=L + 1, scales=L)
    slots = jnp.asarray([[2, 3], [0, S]], jnp.int32)

    def body(write):
        def step(c, i):
            return write(c, kv * (i + 1), i + 1, i), None

        return jax.lax.scan(step, cache, jnp.arange(L))[0]

    got = jax.jit(lambda: body(lambda c, x, lyr, i: _write(c, x, slots, pos, scale, freq, layer=lyr, scale_layer=i)))()
    want = body(lambda c, x, lyr, i: lw.reference(c, x, slots, pos, freq, 1.0, scale[i], 1e-6, lyr, False))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(cache[0]))
    assert float(jnp.abs(got - want).max()) < 4e-6 * float(jnp.abs(want).max())


def test_gradients_match_the_xla_form():
    """The custom VJP (XLA's of `reference`) wired to the right inputs: each cotangent where the XLA form puts it."""
    rng = np.random.default_rng(5)
    B, T, S, lat, r = 2, 3, 8, 32, 8
    cache, kv, pos, scale, freq = _inputs(rng, B, T, S, lat, r, jnp.float32, layers_=2, scales=2)
    slots = jnp.asarray([[0, 1, 2], [4, S, 5]], jnp.int32)
    probe = jnp.asarray(rng.normal(size=cache.shape), jnp.float32)

    def loss(write, c, x, w):
        return jnp.sum(jnp.sin(write(c, x, w)) * probe)

    kernel = lambda c, x, w: _write(c, x, slots, pos, w, freq, layer=1, scale_layer=1, interleaved=True)  # noqa: E731
    ref = lambda c, x, w: lw.reference(c, x, slots, pos, freq, 1.0, w[1], 1e-6, 1, True)  # noqa: E731
    got = jax.grad(lambda *a: loss(kernel, *a), argnums=(0, 1, 2))(cache, kv, scale)
    want = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2))(cache, kv, scale)
    for g, w in zip(got, want):
        assert float(jnp.abs(g - w).max()) <= 1e-5 * max(float(jnp.abs(w).max()), 1e-30)
    assert float(jnp.abs(want[1]).max()) > 0 and float(jnp.abs(want[2]).max()) > 0


def test_gradients_reach_the_kernel_partials_as_the_summed_product_s():
    """Training through the raw partials (`stacked.einsums(raw=...)` into the kernel): the gradients of x and of
    the stacked weight are those of the summed product."""
    rng = np.random.default_rng(6)
    B, T, S, lat, r, K = 1, 3, 8, 64, 16, 256
    cache, _, pos, scale, freq = _inputs(rng, B, T, S, lat, r, jnp.float32, layers_=2, scales=2)
    x = jnp.asarray(rng.normal(size=(B, T, K)), jnp.float32)
    stack = jnp.asarray(rng.normal(size=(2, K, lat + r)) / 16, jnp.float32)
    slots = jnp.asarray([[0, 3, 5]], jnp.int32)
    probe = jnp.asarray(rng.normal(size=cache.shape), jnp.float32)

    def loss(x, stack, raw):
        (kv,) = stacked.einsums(("btk,kn->btn",), x, (stacked.LayerOf(stack, jnp.int32(1), "interpret"),), raw=(raw,))
        assert isinstance(kv, stacked.Parts) == raw
        return jnp.sum(jnp.sin(_write(cache, kv, slots, pos, scale, freq, layer=1, scale_layer=0)) * probe)

    got = jax.grad(loss, argnums=(0, 1))(x, stack, True)
    want = jax.grad(loss, argnums=(0, 1))(x, stack, False)
    for g, w in zip(got, want):
        assert float(jnp.abs(w).max()) > 0
        assert float(jnp.abs(g - w).max()) <= 1e-5 * float(jnp.abs(w).max())


def test_bad_input_is_refused_with_the_shapes():
    rng = np.random.default_rng()
    cache, kv, pos, scale, freq = _inputs(rng, 2, 3, 8, 32, 8, jnp.float32)
    slots = jnp.zeros((2, 3), jnp.int32)

    def write(**kw):
        args = {"cache": cache, "kv": kv, "slots": slots, "pos": pos, "scale": scale, "freq": freq, **kw}
        return _write(
            args["cache"], args["kv"], args["slots"], args["pos"], args["scale"], args["freq"], layer=0,
            scale_layer=kw.get("scale_layer", 0),
        )  # fmt: skip

    with pytest.raises(ValueError, match=r"kv \(2, 3, 39\)"):
        write(kv=kv[..., :39])
    with pytest.raises(ValueError, match=r"slots \(2, 2\)"):
        write(slots=slots[:, :2])
    with pytest.raises(ValueError, match=r"positions \(2, 1\)"):
        write(pos=pos[:, :1])
    with pytest.raises(ValueError, match=r"inv_freq \(3,\), expected \(4,\)"):
        write(freq=freq[:3])
    with pytest.raises(ValueError, match=r"scale \[L\]"):
        write(scale_layer=None)
    with pytest.raises(ValueError, match=r"rope key of 7"):
        write(cache=cache[..., :39], kv=kv[..., :39])
    with pytest.raises(ValueError, match=r"partials \(2, 4, 40\) do not hold 6 rows"):
        write(kv=stacked.Parts(jnp.zeros((2, 4, 40)), (2, 3, 40), jnp.float32))


def _query_inputs(rng, B, T, Dq, dtype, parts: bool, scales=3):
    M = B * T
    if parts:  # q_a's product as the dense kernel's K parts over its padded rows, not yet added
        q = stacked.Parts(jnp.asarray(rng.normal(size=(3, sm.padded_rows(M), Dq)), jnp.float32), (B, T, Dq), dtype)
    else:
        q = jnp.asarray(rng.normal(size=(B, T, Dq)), dtype)
    return q, jnp.asarray(1 + rng.normal(size=(scales, Dq)) / 4, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("B,T,Dq,parts", [(1, 1, 1536, True), (2, 3, 1536, False), (3, 5, 96, True), (4, 4, 40, False)])
def test_q_a_norm_in_the_same_launch_has_the_bits_of_the_two_kernels(B, T, Dq, parts, dtype):
    """With a query the launch also writes q_a's norm as the dense kernel's padded rows: the cache has the bits
    of the write alone, the rows the bits of `rms_norm.rms_norm_rows` (zero padding rows included: interpret mode
    fills a kernel's outputs with NaN before it runs); and the rows are XLA's norm (`rms_norm.reference`) up
    to the order of the sum of squares."""
    from jaxspec.kernels import rms_norm as rn

    rng = np.random.default_rng()
    S, lat, r = 16, 64, 16
    cache, kv, pos, scale, freq = _inputs(rng, B, T, S, lat, r, dtype)
    q, q_scale = _query_inputs(rng, B, T, Dq, dtype, parts)
    slots = jnp.asarray(rng.permutation(S + 2)[: B * T].reshape(B, T), jnp.int32)  # some past S: no write
    alone = _write(cache, kv, slots, pos, scale, freq, layer=2, scale_layer=1)
    got, rows = lw.write_latents(
        cache, kv, slots, pos, scale, 1e-6, inv_freq=freq, layer=2, scale_layer=1, interpret=True,
        query=q, query_scale=q_scale, query_eps=1e-5, query_scale_layer=2,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got), np.asarray(alone))
    M, Mp = B * T, sm.padded_rows(B * T)
    q2 = stacked.Parts(q.parts, (M, Dq), dtype) if parts else q.reshape(M, Dq)
    want, _ = rn.rms_norm_rows(q2, q_scale, 1e-5, layer=2, dtype=dtype, interpret=True)
    assert rows.shape == (Mp, Dq) and rows.dtype == dtype
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(want))
    assert not np.any(np.asarray(rows[M:], np.float32))
    ref, _ = rn.reference(stacked.value(q2), q_scale[2], 1e-5, dtype=dtype)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    assert float(jnp.abs(rows[:M].astype(jnp.float32) - ref.astype(jnp.float32)).max()) <= tol * float(
        jnp.abs(ref.astype(jnp.float32)).max()
    )


def test_q_a_norm_rows_are_the_same_alone_and_among_others():
    """A query row's norm in the launch depends on that row alone (a verify row equals the decode step's)."""
    rng = np.random.default_rng()
    B, T, S, lat, r, Dq = 2, 5, 16, 64, 16, 1536
    for dtype in (jnp.float32, jnp.bfloat16):
        cache, kv, pos, scale, freq = _inputs(rng, B, T, S, lat, r, dtype)
        q, q_scale = _query_inputs(rng, B, T, Dq, dtype, parts=False)
        slots = jnp.asarray(np.tile(np.arange(T), (B, 1)), jnp.int32)

        @jax.jit
        def run(c, kv, sl, p, q, w, qw, freq=freq):
            return lw.write_latents(
                c, kv, sl, p, w, 1e-6, inv_freq=freq, layer=0, scale_layer=3, interpret=True, query=q,
                query_scale=qw,
            )  # fmt: skip

        together_c, together = run(cache, kv, slots, pos, q, scale, q_scale[1])
        for t in range(T):
            one = lambda a, t=t: a[1:2, t : t + 1]  # noqa: E731
            c1, rows1 = run(cache[:, 1:2], one(kv), one(slots), one(pos), one(q), scale, q_scale[1])
            np.testing.assert_array_equal(np.asarray(rows1[0]), np.asarray(together[T + t]))
            np.testing.assert_array_equal(np.asarray(c1[0, 0, t]), np.asarray(together_c[0, 1, t]))


def test_gradients_with_a_query_match_the_xla_forms():
    """The launch with a query is differentiable as the write and the norm in XLA ops: each cotangent (the
    cache's, kv's partials', q's partials' and both scales') where the XLA forms put it."""
    from jaxspec.kernels import rms_norm as rn

    rng = np.random.default_rng(7)
    B, T, S, lat, r, Dq = 2, 3, 8, 32, 8, 48
    M, Mp = B * T, sm.padded_rows(B * T)
    cache, kv, pos, scale, freq = _inputs(rng, B, T, S, lat, r, jnp.float32, layers_=2, scales=2)
    q, q_scale = _query_inputs(rng, B, T, Dq, jnp.float32, parts=True)
    slots = jnp.asarray([[0, 1, 2], [4, S, 5]], jnp.int32)
    probe_c = jnp.asarray(rng.normal(size=cache.shape), jnp.float32)
    probe_y = jnp.asarray(rng.normal(size=(Mp, Dq)), jnp.float32)

    def kernel(c, x, w, qp, qw):
        return lw.write_latents(
            c, x, slots, pos, w, 1e-6, inv_freq=freq, layer=1, scale_layer=1, interleaved=True, interpret=True,
            query=stacked.Parts(qp, (B, T, Dq), jnp.float32), query_scale=qw, query_scale_layer=2,
        )  # fmt: skip

    def ref(c, x, w, qp, qw):
        y, _ = rn.reference(sm.sum_parts(qp, M), qw[2], 1e-6, dtype=jnp.float32)
        return lw.reference(c, x, slots, pos, freq, 1.0, w[1], 1e-6, 1, True), jnp.pad(y, ((0, Mp - M), (0, 0)))

    def loss(fn, *a):
        c, y = fn(*a)
        return jnp.sum(jnp.sin(c) * probe_c) + jnp.sum(jnp.sin(y) * probe_y)

    args = (cache, kv, scale, q.parts, q_scale)
    got = jax.grad(lambda *a: loss(kernel, *a), argnums=range(5))(*args)
    want = jax.grad(lambda *a: loss(ref, *a), argnums=range(5))(*args)
    for g, w in zip(got, want):
        assert float(jnp.abs(w).max()) > 0
        assert float(jnp.abs(g - w).max()) <= 1e-5 * float(jnp.abs(w).max())


def test_the_probe_passes_the_kernel_and_refuses_wrong_results():
    """`latent_write.probe` (the device check before the model uses either form) run in interpret mode: it
    passes the kernel as written, with and without the query, and refuses a launch whose query rows or cache
    rows are wrong, that writes a row it was not given, or (with the query) whose cache or rows are one
    float32 step from those of the two launches apart."""

    def scaled_row(c, rows):
        rows = rows.copy()
        rows[4] = rows[4] * 1.5
        return c, rows

    def padding(c, rows):
        rows = rows.copy()
        rows[-1, 0] = 1
        return c, rows

    def stray(c, rows):
        c = c.copy()
        c[0, 0, 0] = c[0, 0, 0] + 1
        return c, rows

    def one_step(c, rows):  # a written value and a row value one float32 step off: within any tolerance
        c, rows = c.copy(), rows.copy()
        c[1, 0, 0, 0] = np.nextafter(c[1, 0, 0, 0], np.float32(np.inf))
        return c, rows

    def one_step_row(c, rows):
        rows = rows.copy()
        rows[2, 5] = np.nextafter(rows[2, 5], np.float32(np.inf))
        return c, rows

    for dtype in ("float32", "bfloat16"):
        assert lw.probe(dtype, interpret=True) is None
        assert lw.probe(dtype, query=True, interpret=True) is None
    assert "query norm returned wrong values" in lw.probe(query=True, interpret=True, fault=scaled_row)
    assert "zero padding rows" in lw.probe(query=True, interpret=True, fault=padding)
    assert "changed cache rows it was not given" in lw.probe(interpret=True, fault=stray)
    # with the query, the bits of the two launches apart, exactly
    assert "cache differs from the write's own launch" in lw.probe("float32", True, True, fault=one_step)
    assert "differ from the norm's own launch" in lw.probe("float32", True, True, fault=one_step_row)
    if jax.default_backend() != "gpu":
        assert "needs a GPU backend" in lw.query_available()


def test_bad_query_input_is_refused_with_the_shapes():
    rng = np.random.default_rng()
    cache, kv, pos, scale, freq = _inputs(rng, 2, 3, 8, 32, 8, jnp.float32)
    slots = jnp.zeros((2, 3), jnp.int32)
    q, q_scale = _query_inputs(rng, 2, 3, 48, jnp.float32, parts=False)

    def write(**kw):
        return lw.write_latents(
            cache, kv, slots, pos, scale, 1e-6, inv_freq=freq, layer=0, scale_layer=0, interpret=True,
            **{"query": q, "query_scale": q_scale[0], **kw},
        )  # fmt: skip

    with pytest.raises(ValueError, match=r"query \[B, T, Dq\] with B \* T = 6 .* found \(2, 2, 48\) and \(48,\)"):
        write(query=q[:, :2])
    with pytest.raises(ValueError, match=r"query_scale \[Dq\]; found \(2, 3, 48\) and \(47,\)"):
        write(query_scale=q_scale[0, :47])
    with pytest.raises(ValueError, match=r"query_scale \[Ls, Dq\] \(query_scale_layer given\)"):
        write(query_scale_layer=1)
    with pytest.raises(ValueError, match=r"query's dtype bfloat16 is not kv's float32"):
        write(query=q.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"without query_scale"):
        write(query_scale=None)
    # rows whose own norm launch runs with other warps (a sum of squares in another order) stay apart
    assert lw.query_fits(1536) and not lw.query_fits(4096)
    q_wide, w_wide = _query_inputs(rng, 2, 3, 4096, jnp.float32, parts=False)
    with pytest.raises(ValueError, match=r"query row of 4096 does not fit one block of the write's 4 warps"):
        write(query=q_wide, query_scale=w_wide[0])
    with pytest.raises(ValueError, match=r"query's partials \(2, 4, 48\) do not hold 6 rows of 48"):
        write(query=stacked.Parts(jnp.zeros((2, 4, 48)), (2, 3, 48), jnp.float32))
