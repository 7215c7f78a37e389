"""The residual add + RMSNorm kernel (`jaxspec.kernels.rms_norm`) and the padded rows it hands the dense
kernel (`jaxspec.stacked.Rows`), in Pallas interpret mode.

References: a float64 numpy norm of the same inputs, the layers' own `rms_norm` (the XLA form the model
ran before), and `stacked_matmul` on the unpadded rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import eqns

from jaxspec import stacked
from jaxspec.kernels import rms_norm as rn
from jaxspec.kernels import stacked_matmul as sm
from jaxspec.layers import RMSNorm, rms_norm


def _f64_norm(s, scale, eps):
    v = np.asarray(s, np.float64)
    return np.asarray(scale, np.float64) * v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)


@pytest.mark.parametrize("m,d", [(1, 7168), (5, 1536), (16, 96), (17, 512)])
def test_add_and_norm_match_float64_with_zero_padding_rows(m, d):
    rng = np.random.default_rng()
    x = rng.normal(size=(m, d)).astype(np.float32) * 3
    h = rng.normal(size=(m, d)).astype(np.float32)
    scale = (1 + rng.normal(size=(d,)) / 4).astype(np.float32)
    y, s = jax.jit(lambda x, h, w: rn.rms_norm_rows(x, w, 1e-6, residual=h, interpret=True))(x, h, scale)
    assert y.shape == (sm.padded_rows(m), d) and y.dtype == jnp.float32 and s.shape == (m, d)
    np.testing.assert_array_equal(s, x + h)  # the residual stream's sum is float32 x + h, exactly
    want = _f64_norm(x.astype(np.float64) + h, scale, 1e-6)
    assert np.abs(np.asarray(y[:m], np.float64) - want).max() < 2e-6 * np.abs(want).max()
    assert not np.any(np.asarray(y[m:]))  # the dense kernel's padding rows
    # without a residual: the norm of x alone, no sum returned
    y1, s1 = rn.rms_norm_rows(jnp.asarray(x), jnp.asarray(scale), 1e-6, interpret=True)
    assert s1 is None
    want1 = _f64_norm(x, scale, 1e-6)
    assert np.abs(np.asarray(y1[:m], np.float64) - want1).max() < 2e-6 * np.abs(want1).max()


def test_bfloat16_rounding_is_the_layers_rms_norm():
    """The float32 stream rounded to bfloat16, normalised, rounded, times the scale, rounded: `layers.rms_norm`
    of ``(x + h).astype(bf16)``. The kernel sums a row's squares over its own (padded, masked) row and XLA over
    the [m, d] array, in orders that usually agree on the CPU but not always (seen in CI: 4 of 18432
    elements): where they differ, an element may be one bfloat16 step off, and only rarely."""
    rng = np.random.default_rng()
    m, d = 9, 2048
    x = jnp.asarray(rng.normal(size=(m, d)) * 4, jnp.float32)
    h = jnp.asarray(rng.normal(size=(m, d)), jnp.bfloat16)
    scale = jnp.asarray(1 + rng.normal(size=(d,)) / 4, jnp.bfloat16)
    y, s = rn.rms_norm_rows(x, scale, 1e-5, residual=h, interpret=True)
    want = rms_norm((x + h.astype(jnp.float32)).astype(jnp.bfloat16), scale, 1e-5)
    assert y.dtype == jnp.bfloat16
    got_bits, want_bits = np.asarray(y[:m]).view(np.uint16), np.asarray(want).view(np.uint16)
    mismatch = np.mean(got_bits != want_bits)
    assert mismatch < (0.001 if jax.default_backend() == "cpu" else 0.01), mismatch
    # every element that differs is one bfloat16 step away (same sign, adjacent bit patterns)
    steps = np.abs(got_bits.astype(np.int32) - want_bits.astype(np.int32))
    assert steps.max() <= 1, steps.max()
    # and a norm that skipped a rounding step is caught by the same comparison
    sloppy = (scale.astype(jnp.float32) * (s * jax.lax.rsqrt(jnp.mean(s * s, -1, keepdims=True) + 1e-5))).astype(
        jnp.bfloat16
    )
    assert np.mean(np.asarray(sloppy).view(np.uint16) != np.asarray(want).view(np.uint16)) > 0.05


def test_a_row_has_the_same_bits_alone_and_among_others():
    """A decode step normalises its one token as a verify normalises it among T tokens."""
    rng = np.random.default_rng()
    d = 1536
    x = jnp.asarray(rng.normal(size=(40, d)), jnp.float32)
    h = jnp.asarray(rng.normal(size=(40, d)), jnp.bfloat16)
    scale = jnp.asarray(1 + rng.normal(size=(d,)) / 4, jnp.bfloat16)
    run = jax.jit(lambda x, h: rn.rms_norm_rows(x, scale, 1e-6, residual=h, interpret=True)[0])
    full = np.asarray(run(x, h)).view(np.uint16)
    for m, rows in ((1, [0]), (3, [0, 1, 2]), (17, [5, 16])):
        part = np.asarray(run(x[:m], h[:m])).view(np.uint16)
        for i in rows:
            np.testing.assert_array_equal(part[i], full[i])


def test_a_stacked_layer_scale_is_read_in_place_under_a_scan():
    rng = np.random.default_rng()
    layers, m, d = 3, 4, 256
    stack = jnp.asarray(1 + rng.normal(size=(layers, d)) / 4, jnp.float32)
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)

    def step(c, i):
        y, _ = rn.rms_norm_rows(c, stack, 1e-6, layer=i, interpret=True)
        return jnp.tanh(y[:m]), None

    got = jax.jit(lambda x: jax.lax.scan(step, x, jnp.arange(layers))[0])(x)
    ref = np.asarray(x, np.float64)
    for i in range(layers):
        ref = np.tanh(_f64_norm(ref, stack[i], 1e-6))
    assert np.abs(np.asarray(got) - ref).max() < 1e-5


def test_gradients_match_the_xla_norm():
    rng = np.random.default_rng(2)
    m, d = 3, 128
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    h = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    stack = jnp.asarray(1 + rng.normal(size=(2, d)) / 4, jnp.float32)
    probe = jnp.asarray(rng.normal(size=(sm.padded_rows(m), d)), jnp.float32)

    def loss(x, h, stack, norm):
        y, s = norm(x, h, stack)
        return jnp.sum(y * probe) + jnp.sum(jnp.sin(s))

    def kernel(x, h, stack):
        return rn.rms_norm_rows(x, stack, 1e-6, residual=h, layer=1, interpret=True)

    def xla(x, h, stack):
        s = x + h
        y = rms_norm(s, stack[1], 1e-6)
        return jnp.pad(y, ((0, sm.padded_rows(m) - m), (0, 0))), s

    got = jax.grad(loss, (0, 1, 2))(x, h, stack, kernel)
    want = jax.grad(loss, (0, 1, 2))(x, h, stack, xla)
    for g, w in zip(got, want):
        assert float(jnp.abs(g - w).max()) < 1e-5 * float(jnp.abs(w).max())
    assert not np.any(np.asarray(got[2][0]))  # layer 0's scale is not used


def test_bad_input_is_refused_with_the_shapes():
    x = jnp.zeros((2, 64))
    with pytest.raises(ValueError, match=r"expected x \[M, D\] and scale \[D\].*\(2, 64\) and \(32,\)"):
        rn.rms_norm_rows(x, jnp.ones((32,)), 1e-6, interpret=True)
    with pytest.raises(ValueError, match=r"scale \[L, D\] \(layer given\)"):
        rn.rms_norm_rows(x, jnp.ones((64,)), 1e-6, layer=0, interpret=True)
    with pytest.raises(ValueError, match=r"residual \(3, 64\) does not match x \(2, 64\)"):
        rn.rms_norm_rows(x, jnp.ones((64,)), 1e-6, residual=jnp.zeros((3, 64)), interpret=True)
    with pytest.raises(ValueError, match="D=32768 do not fit one block"):
        rn.rms_norm_rows(jnp.zeros((1, 32768)), jnp.ones((32768,)), 1e-6, interpret=True)
    assert rn.shapes_ok(1, 7168) and rn.shapes_ok(512, 1536)
    assert not rn.shapes_ok(513, 7168) and not rn.shapes_ok(4, 8)
    if jax.default_backend() != "gpu":
        assert "needs a GPU backend" in rn.available()


def test_rows_feed_the_dense_kernel_as_its_own_copy():
    """`stacked.Rows` reach `stacked_matmul` unpadded again (no pad of its own) with the bits of the plain
    call; bfloat16 rows meet float32 weights (the router) widened exactly."""
    rng = np.random.default_rng()
    m, k, n = 5, 256, 64
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    w32 = jnp.asarray(rng.normal(size=(2, k, n)), jnp.float32)
    w16 = w32.astype(jnp.bfloat16)
    padded = jnp.pad(x, ((0, sm.padded_rows(m) - m), (0, 0)))
    plain = sm.stacked_matmul(x, w16, 1, interpret=True)
    given = sm.stacked_matmul(padded, w16, 1, rows=m, interpret=True)
    np.testing.assert_array_equal(np.asarray(given).view(np.uint16), np.asarray(plain).view(np.uint16))
    wide = sm.stacked_matmul(padded, w32, 1, rows=m, out_dtype=jnp.float32, interpret=True)
    np.testing.assert_array_equal(wide, sm.stacked_matmul(x.astype(jnp.float32), w32, 1, interpret=True))
    with pytest.raises(ValueError, match=r"5 padded rows are 16, found x \(5, 256\)"):
        sm.stacked_matmul(x, w16, 1, rows=m, interpret=True)
    # through `stacked.einsums`, as the model calls it, with no pad in the traced program
    rows = stacked.Rows(padded, (1, m, k))
    layer = stacked.LayerOf(w32, jnp.int32(1), "interpret")
    (y,) = stacked.einsums(("btk,kn->btn",), rows, (layer,), jnp.float32)
    np.testing.assert_array_equal(y[0], wide)
    jaxpr = jax.make_jaxpr(lambda r: stacked.einsums(("btk,kn->btn",), r, (layer,), jnp.float32))(rows)
    assert "pad" not in {e.primitive.name for e in eqns(jaxpr.jaxpr)}
    plain_rows = jax.make_jaxpr(lambda v: stacked.einsums(("btk,kn->btn",), v, (layer,), jnp.float32))(
        rows.value.astype(jnp.float32)
    )
    assert "pad" in {e.primitive.name for e in eqns(plain_rows.jaxpr)}  # the check sees the kernel's own pad
    np.testing.assert_array_equal(rows.value, x[None])
    assert rows.reshape(m, k).shape == (m, k) and rows.ndim == 3 and rows.rows == m
    with pytest.raises(ValueError, match="must keep the rows and the last dim"):
        rows.reshape(m * k)


def test_the_norm_module_gives_rows_and_the_sum_with_its_own_parameter():
    """`layers.RMSNorm` with ``rows``: the same parameter tree, the XLA form's values (float32)."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(2, 3, 256)), jnp.float32)
    h = jnp.asarray(rng.normal(size=(2, 3, 256)), jnp.float32)
    norm = RMSNorm(1e-6, 256, jnp.float32)
    params = norm.init(jax.random.key(0), x)
    params = jax.tree.map(lambda p: p * jnp.asarray(1 + rng.normal(size=p.shape) / 4, p.dtype), params)
    rows, s = norm.apply(params, x, "interpret", h)
    assert isinstance(rows, stacked.Rows) and rows.shape == x.shape
    np.testing.assert_array_equal(s, x + h)
    want = norm.apply(params, x + h)
    assert float(jnp.abs(rows.value - want).max()) < 2e-6 * float(jnp.abs(want).max())
    with pytest.raises(ValueError, match="a residual is added only with rows="):
        norm.apply(params, x, None, h)


def test_a_float32_scale_is_rounded_to_the_output_dtype_as_the_reference_does():
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(4, 512)), jnp.float32)
    scale = jnp.asarray(1 + rng.normal(size=(512,)) / 4, jnp.float32)  # not a bfloat16 value
    y, _ = rn.rms_norm_rows(x, scale, 1e-6, dtype=jnp.bfloat16, interpret=True)
    want, _ = rn.reference(x, scale, 1e-6, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y[:4]).view(np.uint16), np.asarray(want).view(np.uint16))


def test_gradients_without_a_residual_and_in_bfloat16():
    rng = np.random.default_rng(5)
    m, d = 2, 64
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    scale = jnp.asarray(1 + rng.normal(size=(d,)) / 4, jnp.bfloat16)
    probe = jnp.asarray(rng.normal(size=(sm.padded_rows(m), d)), jnp.float32)

    def loss(x, scale, kernel):
        if kernel:
            y, _ = rn.rms_norm_rows(x, scale, 1e-6, interpret=True)
        else:
            y = jnp.pad(rms_norm(x.astype(jnp.bfloat16), scale, 1e-6), ((0, sm.padded_rows(m) - m), (0, 0)))
        return jnp.sum(y.astype(jnp.float32) * probe)

    got = jax.grad(loss, (0, 1))(x, scale, True)
    want = jax.grad(loss, (0, 1))(x, scale, False)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_dense_kernel_gradients_with_padded_rows():
    """`stacked_matmul(..., rows=)`: the padding rows get no gradient, and bfloat16 rows meeting float32
    weights get a bfloat16 gradient of the float32 product."""
    rng = np.random.default_rng(6)
    m, k, n = 3, 64, 32
    w = jnp.asarray(rng.normal(size=(2, k, n)) / 8, jnp.float32)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    padded = jnp.pad(x, ((0, sm.padded_rows(m) - m), (0, 0)))
    probe = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)

    def loss(p, w):
        return jnp.sum(sm.stacked_matmul(p, w, 1, rows=m, out_dtype=jnp.float32, interpret=True) * probe)

    gx, gw = jax.grad(loss, (0, 1))(padded, w)
    assert gx.dtype == jnp.bfloat16 and not np.any(np.asarray(gx[m:], np.float32))
    want_x = (probe @ w[1].T).astype(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(gx[:m], np.float32), np.asarray(want_x, np.float32), rtol=1e-2, atol=1e-2)
    want_w = np.asarray(x, np.float32).T @ np.asarray(probe)
    np.testing.assert_allclose(np.asarray(gw[1]), want_w, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(gw[0]))


def test_the_gpu_check_script_runs_here_in_interpret_mode(capsys):
    """`scripts/bench_rms_norm.py` (the kernel's checks and timing on the GPU) in interpret mode: its checks
    pass and report, and its timing runs."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_rms_norm.py")
    spec = importlib.util.spec_from_file_location("bench_rms_norm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--dims", "256", "--rows", "1", "17"]) == 0
    out = capsys.readouterr().out
    assert "interpret mode" in out and out.count("True") == 6
    t = bench.timing(256, 3, 1e-6, 2, 1)
    assert t["kernel"] > 0 and t["xla"] > 0


def test_the_dense_kernels_partials_are_added_as_einsums_adds_them():
    """x or the residual as `stacked.Parts` (q_a's product before its norm, o_proj's before the residual add:
    the dense kernel's K parts not yet added): the same rows and the same float32 sum, bit for bit, as the
    summed arrays `stacked.einsums` gives otherwise, for bfloat16 and float32, with and without a residual."""
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 31))
    rng = np.random.default_rng(seed)
    M, K, D = 5, 512, 96
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jnp.asarray(rng.normal(size=(M, K)), dtype)
        w = stacked.LayerOf(jnp.asarray(rng.normal(size=(2, K, D)) / 16, dtype), jnp.int32(1), "interpret")
        (raw,) = stacked.einsums(("mk,kd->md",), x, (w,), raw=(True,))
        (summed,) = stacked.einsums(("mk,kd->md",), x, (w,))
        assert isinstance(raw, stacked.Parts) and raw.parts.shape[0] > 1, seed  # a K split: partials to add
        np.testing.assert_array_equal(np.asarray(raw.value), np.asarray(summed))
        stream = jnp.asarray(rng.normal(size=(M, D)) * 3, jnp.float32)
        scale = jnp.asarray(1 + rng.normal(size=(3, D)) / 4, dtype)
        norm = lambda x, h=None, w=scale: rn.rms_norm_rows(x, w, 1e-6, residual=h, layer=2, interpret=True)  # noqa: E731
        for got, want in (
            (norm(raw), norm(summed)),  # q_a's product before its norm
            (norm(stream, raw), norm(stream, summed)),  # o_proj's before the residual add
            (norm(raw, stream), norm(summed, stream)),
        ):
            for g, v in zip(got, want):
                assert (g is None) == (v is None)
                if g is not None:
                    np.testing.assert_array_equal(np.asarray(g), np.asarray(v), err_msg=f"{dtype} seed {seed}")
        # the float64 reference of the rows the partials stand for
        y, s = norm(stream, raw)
        want = _f64_norm(np.asarray(stream, np.float64) + np.asarray(summed.astype(jnp.float32)), scale[2], 1e-6)
        tol = 2e-6 if dtype == jnp.float32 else 2e-2
        assert np.abs(np.asarray(y[:M], np.float64) - want).max() < tol * np.abs(want).max(), seed
    bad = stacked.Parts(jnp.zeros((2, 3, D)), (M, D), jnp.float32)  # fewer partial rows than M
    with pytest.raises(ValueError, match="x as partials"):
        rn.rms_norm_rows(bad, scale, 1e-6, layer=0, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_moe_outputs_two_terms_are_added_as_xla_adds_them(dtype):
    """The residual as a `stacked.Sum` (a MoE layer's routed output and the shared down's partials, left to the
    next layer's norm): the rows and the float32 sum have the bits of the residual given as `Sum.value` (the
    terms added in float32, rounded once, as the code's add of two arrays of the dtype states), the sum that of
    `stacked.Deferred.value`; with the second term an array too; rows past M zero (interpret mode fills a
    kernel's outputs with NaN first); and within rounding of a float64 norm."""
    rng = np.random.default_rng()
    M, D, K = 5, 7168, 256
    Mp = sm.padded_rows(M)
    stream = jnp.asarray(rng.normal(size=(M, D)) * 3, jnp.float32)
    routed = jnp.asarray(rng.normal(size=(M, D)), dtype)
    x = jnp.asarray(rng.normal(size=(M, K)), dtype)
    w = stacked.LayerOf(jnp.asarray(rng.normal(size=(2, K, D)) / 16, dtype), jnp.int32(1), "interpret")
    (shared,) = stacked.einsums(("mk,kd->md",), x, (w,), raw=(True,))
    assert isinstance(shared, stacked.Parts)
    scale = jnp.asarray(1 + rng.normal(size=(3, D)) / 4, dtype)
    norm = lambda h: rn.rms_norm_rows(stream, scale, 1e-6, residual=h, layer=1, interpret=True)  # noqa: E731
    for term in (shared, shared.value):
        h = stacked.Sum(routed, term)
        (y, s), (y2, s2) = norm(h), norm(h.value)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s2))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(stacked.Deferred(stream, h).value))
        assert y.shape == (Mp, D) and not np.any(np.asarray(y[M:], np.float32))
    total = np.asarray(stream, np.float64) + np.asarray(routed, np.float64) + np.asarray(shared.value, np.float64)
    want = _f64_norm(total, scale[1], 1e-6)
    tol = 2e-6 if dtype == jnp.float32 else 2e-2
    assert np.abs(np.asarray(y[:M], np.float64) - want).max() < tol * np.abs(want).max()


def test_gradients_through_a_two_term_residual_match_xlas_and_bad_terms_are_refused():
    rng = np.random.default_rng(11)
    M, D = 3, 96
    Mp = sm.padded_rows(M)
    stream = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
    routed = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
    parts = jnp.asarray(rng.normal(size=(2, Mp, D)), jnp.float32)
    scale = jnp.asarray(1 + rng.normal(size=(D,)) / 4, jnp.float32)
    probe = jnp.asarray(rng.normal(size=(Mp, D)), jnp.float32)

    def loss(x, a, p, w, kernel):
        h = stacked.Sum(a, stacked.Parts(p, (M, D), jnp.float32))
        if kernel:
            y, s = rn.rms_norm_rows(x, w, 1e-6, residual=h, interpret=True)
        else:
            y, s = rn.reference(x, w, 1e-6, h.value)
            y = jnp.pad(y, ((0, Mp - M), (0, 0)))
        return jnp.sum(y * probe) + jnp.sum(jnp.sin(s))

    got = jax.grad(loss, argnums=(0, 1, 2, 3))(stream, routed, parts, scale, True)
    want = jax.grad(loss, argnums=(0, 1, 2, 3))(stream, routed, parts, scale, False)
    for g, w in zip(got, want):
        assert float(jnp.abs(w).max()) > 0
        assert float(jnp.abs(g - w).max()) <= 1e-5 * float(jnp.abs(w).max())
    with pytest.raises(ValueError, match=r"Sum's terms must match: found \(3, 96\) float32 and \(3, 96\) bfloat16"):
        rn.rms_norm_rows(stream, scale, 1e-6, residual=stacked.Sum(routed, routed.astype(jnp.bfloat16)), interpret=True)
    with pytest.raises(ValueError, match=r"residual's second term as partials"):
        bad = stacked.Parts(jnp.zeros((2, 2, D)), (M, D), jnp.float32)
        rn.rms_norm_rows(stream, scale, 1e-6, residual=stacked.Sum(routed, bad), interpret=True)


def test_the_probe_passes_the_kernel_and_refuses_wrong_results():
    """`rms_norm.probe` (the device check before the model uses the kernel, and apart from it the two-term
    residual) run in interpret mode: it passes the kernel as written and refuses a sum off by one float32
    step, a padding row not zero, or rows off by more than rounding."""

    def nudged_sum(y, s):
        s = s.copy()
        s[1, 7] = np.nextafter(s[1, 7], np.float32(np.inf))
        return y, s

    def padding(y, s):
        y = y.copy()
        y[-1, 3] = 1
        return y, s

    def scaled(y, s):
        return (y.astype(np.float32) * 1.5).astype(y.dtype), s

    for dtype in ("bfloat16", "float32"):
        assert rn.probe(dtype, interpret=True) is None
        assert rn.probe(dtype, two_terms=True, interpret=True) is None
    assert "residual sum differs from x + h (h of two terms)" in rn.probe(
        two_terms=True, interpret=True, fault=nudged_sum
    )
    assert "residual sum differs" in rn.probe(interpret=True, fault=nudged_sum)
    assert "did not zero its padding rows" in rn.probe(interpret=True, fault=padding)
    assert "wrong values" in rn.probe(two_terms=True, interpret=True, fault=scaled)
    if jax.default_backend() != "gpu":
        assert "needs a GPU backend" in rn.sum_available()


def test_terms_of_negative_zero_leave_the_stream_as_it_is():
    """The stacked layers enter their first layer with a two-term residual of -0.0 (`model.StackedLayers`):
    the kernel's float32 sum is x bit for bit, a -0.0 of x included (+0.0 terms would make it +0.0), and the
    rows are those of x's norm without a residual."""
    rng = np.random.default_rng()
    M, D = 3, 512
    x = np.asarray(rng.normal(size=(M, D)), np.float32)
    x[0, :7] = -0.0
    x = jnp.asarray(x)
    scale = jnp.asarray(1 + rng.normal(size=(D,)) / 4, jnp.bfloat16)
    fill = lambda shape, dt: jnp.full(shape, -0.0, dt)  # noqa: E731
    h = stacked.Sum(fill((M, D), jnp.bfloat16), stacked.Parts(fill((2, sm.padded_rows(M), D), jnp.float32), (M, D),
                                                              jnp.bfloat16))  # fmt: skip
    y, s = rn.rms_norm_rows(x, scale, 1e-6, residual=h, interpret=True)
    np.testing.assert_array_equal(np.asarray(s).view(np.uint32), np.asarray(x).view(np.uint32))
    y0, _ = rn.rms_norm_rows(x, scale, 1e-6, interpret=True)
    np.testing.assert_array_equal(np.asarray(y).view(np.uint16), np.asarray(y0).view(np.uint16))


@pytest.mark.parametrize(("m", "residual", "cap_dtype"), [(5, True, jnp.bfloat16), (17, False, jnp.float32)])
def test_the_stream_is_captured_in_place_in_one_row_of_the_buffer(m, residual, cap_dtype):
    """``capture=(buf, slot)``: the launch also stores the residual stream (x + h, or x alone) rounded to the
    buffer's dtype as ``buf[slot]`` (numpy's rounding of numpy's sum), leaves the buffer's other rows as they
    were (a buffer of poison values), and gives the rows and the sum the call without a buffer gives."""
    rng = np.random.default_rng()
    d, slot = 512, int(rng.integers(0, 3))
    x = rng.normal(size=(m, d)).astype(np.float32)
    h = rng.normal(size=(m, d)).astype(np.float32) if residual else None
    scale = jnp.asarray(1 + rng.normal(size=(d,)) / 4, jnp.bfloat16)
    buf = jnp.full((3, m, d), np.nan, cap_dtype)
    kw = dict(residual=None if h is None else jnp.asarray(h), dtype=jnp.bfloat16, interpret=True)
    y, s, got = jax.jit(lambda x, buf, slot: rn.rms_norm_rows(x, scale, 1e-6, capture=(buf, slot), **kw))(
        jnp.asarray(x), buf, slot
    )
    y0, s0 = rn.rms_norm_rows(jnp.asarray(x), scale, 1e-6, **kw)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    if residual:
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
    stream = x + h if residual else x
    got = np.asarray(got)
    assert got.dtype == np.dtype(cap_dtype)
    np.testing.assert_array_equal(got[slot], stream.astype(got.dtype))
    others = [i for i in range(3) if i != slot]
    assert np.all(np.isnan(got[others].astype(np.float32)))


def test_a_table_of_rows_by_layer_is_read_at_the_layers_index_under_a_scan():
    """``capture=(buf, table)`` with the stacked scales and a traced layer index (the stacked layers' form): each
    step of a scan stores its stream as row ``table[layer]`` (the kernel reads the table; the spare row R - 1
    taken by several layers keeps the last one's), the same buffer XLA's updates give."""
    rng = np.random.default_rng()
    L, m, d = 4, 3, 256
    stack = jnp.asarray(1 + rng.normal(size=(L, d)) / 4, jnp.float32)
    xs = jnp.asarray(rng.normal(size=(L, m, d)), jnp.float32)
    table = jnp.asarray([3, 0, 3, 1], jnp.int32)  # rows of a [4, m, d] buffer; row 3 the spare one
    buf0 = jnp.full((4, m, d), np.nan, jnp.float32)

    def body(buf, i, norm):
        y, buf = norm(xs[i], buf, i)
        return buf, y

    def kernel(x, buf, i):
        y, _, buf = rn.rms_norm_rows(x, stack, 1e-6, layer=i, capture=(buf, table), interpret=True)
        return y, buf

    def xla(x, buf, i):
        y = jnp.pad(rms_norm(x, stack[i], 1e-6), ((0, sm.padded_rows(m) - m), (0, 0)))
        return y, jax.lax.dynamic_update_index_in_dim(buf, x, table[i], axis=0)

    got = jax.jit(lambda b: jax.lax.scan(lambda c, i: body(c, i, kernel), b, jnp.arange(L)))(buf0)
    want = jax.lax.scan(lambda c, i: body(c, i, xla), buf0, jnp.arange(L))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[0])[[0, 1, 3]], np.asarray(xs)[[1, 3, 2]])
    assert np.all(np.isnan(np.asarray(got[0][2])))
    assert float(jnp.abs(got[1] - want[1]).max()) < 2e-6 * float(jnp.abs(want[1]).max())


def test_gradients_through_the_captured_rows_match_xlas_update_and_bad_captures_are_refused():
    """The backward pass of a call with a capture buffer is XLA's, of the reference: the buffer's rows carry
    their cotangents to x and h (the captured row) and to the buffer (the rows not overwritten), as
    `dynamic_update_slice` gives them. A capture of partials, or a buffer of the wrong rows, is refused."""
    rng = np.random.default_rng(4)
    m, d = 3, 128
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    h = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    buf = jnp.asarray(rng.normal(size=(2, m, d)), jnp.float32)
    scale = jnp.asarray(1 + rng.normal(size=(d,)) / 4, jnp.float32)
    w_y = jnp.asarray(rng.normal(size=(sm.padded_rows(m), d)), jnp.float32)
    w_b = jnp.asarray(rng.normal(size=(2, m, d)), jnp.float32)

    def loss(x, h, buf, norm):
        y, s, b = norm(x, h, buf)
        return jnp.sum(y * w_y) + jnp.sum(jnp.sin(s)) + jnp.sum(jnp.cos(b) * w_b)

    def kernel(x, h, buf):
        return rn.rms_norm_rows(x, scale, 1e-6, residual=h, capture=(buf, 1), interpret=True)

    def xla(x, h, buf):
        s = x + h
        y = jnp.pad(rms_norm(s, scale, 1e-6), ((0, sm.padded_rows(m) - m), (0, 0)))
        return y, s, buf.at[1].set(s)

    got = jax.grad(loss, (0, 1, 2))(x, h, buf, kernel)
    want = jax.grad(loss, (0, 1, 2))(x, h, buf, xla)
    for g, w in zip(got, want):
        assert float(jnp.abs(g - w).max()) < 1e-5 * float(jnp.abs(w).max())
    assert not np.any(np.asarray(got[2][1])) and np.all(np.asarray(got[2][0]) != 0)  # row 1 overwritten
    parts = stacked.Parts(jnp.zeros((2, sm.padded_rows(m), d)), (m, d), jnp.float32)
    with pytest.raises(ValueError, match="capture needs x as an array"):
        rn.rms_norm_rows(parts, scale, 1e-6, capture=(buf, 0), interpret=True)
    with pytest.raises(ValueError, match=r"capture buffer must be float \[R, 3, 128\], found float32\(2, 4, 128\)"):
        rn.rms_norm_rows(x, scale, 1e-6, capture=(jnp.zeros((2, 4, d)), 0), interpret=True)
    with pytest.raises(
        ValueError, match=r"slot must be a scalar, or with layer a table \[1\].*\(2,\) \(layer not given"
    ):
        rn.rms_norm_rows(x, scale, 1e-6, capture=(buf, jnp.zeros(2, jnp.int32)), interpret=True)
    # through the module: [R, *x.shape] buffers, the result beside the rows; only as the kernel's rows
    norm = RMSNorm(1e-6, d, jnp.float32)
    x3, h3, buf3 = x.reshape(1, m, d), h.reshape(1, m, d), buf.reshape(2, 1, m, d)
    params = norm.init(jax.random.key(0), x3)
    (rows, s), got_buf = norm.apply(params, x3, "interpret", h3, capture=(buf3, 0))
    assert got_buf.shape == buf3.shape and isinstance(rows, stacked.Rows)
    np.testing.assert_array_equal(np.asarray(got_buf[0]), np.asarray(s))
    np.testing.assert_array_equal(np.asarray(got_buf[1]), np.asarray(buf3[1]))
    with pytest.raises(ValueError, match="the stream is captured only with rows="):
        norm.apply(params, x3, None, capture=(buf3, 0))


def test_the_capture_probe_passes_the_kernel_and_refuses_a_wrong_store():
    """`rms_norm.probe(capture=True)` (the device check before the layers capture in the norm's launch) run
    in interpret mode: it passes the kernel as written and refuses a captured value that is not the stream's,
    a store into another row of the buffer, or rows that differ from the call without one."""

    def nudged(y, s, b):
        b = b.copy()
        b[1, 2, 5] = (b[1, 2, 5].astype(np.float32) * 2 + 1).astype(b.dtype)
        return y, s, b

    def other_row(y, s, b):
        b = b.copy()
        b[2, 0] = b[1, 0]
        return y, s, b

    def rows(y, s, b):
        y = y.copy()
        y[0, 0] = -y[0, 0] if y[0, 0] != 0 else 1
        return y, s, b

    for dtype in ("bfloat16", "float32"):
        assert rn.probe(dtype, interpret=True, capture=True) is None
    assert "captured rows are not the stream" in rn.probe(interpret=True, capture=True, fault=nudged)
    assert "touched the buffer's other rows" in rn.probe(interpret=True, capture=True, fault=other_row)
    assert "gave other rows than the calls without one" in rn.probe(interpret=True, capture=True, fault=rows)
    if jax.default_backend() != "gpu":
        assert "needs a GPU backend" in rn.capture_available()
