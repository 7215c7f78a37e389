"""jaxspec.kernels.grouped_matmul on CPU (the xla path) against numpy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints_convert import quant_np
from jaxspec import quant
from jaxspec.kernels import grouped_matmul as gm

W = quant.Int4Weight


def _reference(lhs: np.ndarray, rhs_gkn: np.ndarray, group_sizes) -> np.ndarray:
    """Per-group dense matmul; rows past the last group stay zero."""
    out = np.zeros((lhs.shape[0], rhs_gkn.shape[2]), np.float64)
    start = 0
    for g, size in enumerate(group_sizes):
        out[start : start + size] = lhs[start : start + size].astype(np.float64) @ rhs_gkn[g]
        start += size
    return out


GROUP_SIZES = [
    [3, 0, 5, 2],  # an empty group in the middle, sum == M
    [0, 0, 0, 10],  # all rows in the last group
    [2, 0, 1, 0],  # sum < M: trailing rows must be zero
    [0, 0, 0, 0],  # no rows at all
]


@pytest.mark.parametrize("group_sizes", GROUP_SIZES)
def test_ragged_dot_matches_reference(group_sizes):
    rng = np.random.default_rng(0)
    m, k, n = 10, 48, 24
    lhs = rng.normal(size=(m, k)).astype(np.float32)
    rhs = rng.normal(size=(len(group_sizes), k, n)).astype(np.float32)
    gs = jnp.asarray(group_sizes, jnp.int32)

    out = jax.jit(gm.ragged_dot)(lhs, rhs, gs)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), _reference(lhs, rhs, group_sizes), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[sum(group_sizes) :], 0.0)


def test_ragged_dot_bf16_inputs_f32_output():
    rng = np.random.default_rng(1)
    m, k, n = 12, 64, 16
    lhs = rng.normal(size=(m, k)).astype(ml_dtypes.bfloat16)
    rhs = rng.normal(size=(3, k, n)).astype(ml_dtypes.bfloat16)
    group_sizes = [4, 5, 3]
    out = gm.ragged_dot(
        jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes), preferred_element_type=jnp.float32
    )
    assert out.dtype == jnp.float32
    ref = _reference(lhs.astype(np.float32), rhs.astype(np.float32), group_sizes)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-4)


def test_backend_selection_on_cpu():
    assert jax.default_backend() == "cpu"
    assert gm.backend_name() == "xla"
    assert gm.backend_name("xla") == "xla"
    assert gm.tokamax_unavailable_reason() is not None
    with pytest.raises(RuntimeError, match="impl='tokamax' requested but"):
        gm.backend_name("tokamax")
    with pytest.raises(ValueError, match=r"impl: expected one of \('tokamax', 'xla'\) or None, found 'cuda'"):
        gm.backend_name("cuda")
    lhs, rhs, gs = jnp.zeros((4, 8)), jnp.zeros((2, 8, 4)), jnp.array([2, 2])
    with pytest.raises(RuntimeError, match="impl='tokamax'"):
        gm.ragged_dot(lhs, rhs, gs, impl="tokamax")


def test_ragged_dot_argument_errors():
    lhs, rhs = jnp.zeros((4, 8)), jnp.zeros((2, 8, 4))
    with pytest.raises(ValueError, match=r"rhs: expected K=8 .* found rhs shape \(2, 6, 4\)"):
        gm.ragged_dot(lhs, jnp.zeros((2, 6, 4)), jnp.array([2, 2]))
    with pytest.raises(ValueError, match=r"group_sizes: expected shape \(2,\) .* found \(3,\)"):
        gm.ragged_dot(lhs, rhs, jnp.array([1, 1, 2]))
    with pytest.raises(ValueError, match=r"group_sizes: expected an integer dtype, found float32"):
        gm.ragged_dot(lhs, rhs, jnp.array([2.0, 2.0]))
    with pytest.raises(ValueError, match=r"lhs: expected shape \[M, K\], found \(4,\)"):
        gm.ragged_dot(jnp.zeros((4,)), rhs, jnp.array([2, 2]))


# ---------------------------------------------------------------------------
# INT4
# ---------------------------------------------------------------------------


def _int4_experts(rng, g, n, k):
    q = rng.integers(-8, 8, size=(g, n, k), dtype=np.int8)
    scale = rng.uniform(0.01, 0.1, size=(g, n, k // 32)).astype(ml_dtypes.bfloat16)
    return quant_np.pack_int4_np(q), scale


@pytest.mark.parametrize("group_sizes", GROUP_SIZES)
def test_ragged_dot_int4_equals_dequant_then_matmul(group_sizes):
    rng = np.random.default_rng(2)
    m, n, k = 10, 24, 64
    packed, scale = _int4_experts(rng, len(group_sizes), n, k)
    lhs = rng.normal(size=(m, k)).astype(np.float32)

    w_gnk = quant_np.dequant_int4_np(packed, scale)  # [G, N, K], the checkpoint layout
    ref = _reference(lhs, np.swapaxes(w_gnk, 1, 2), group_sizes)

    gs = jnp.asarray(group_sizes, jnp.int32)
    out = jax.jit(gm.ragged_dot_int4)(lhs, W(packed, scale), gs)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[sum(group_sizes) :], 0.0)

    # Pre-converted native int4 weights (the GPU load-time format) give the same result.
    q4 = quant.packed_to_int4(jnp.asarray(packed))
    out4 = jax.jit(gm.ragged_dot_int4)(lhs, W(q4, scale), gs)
    np.testing.assert_array_equal(np.asarray(out4), np.asarray(out))


def test_ragged_dot_int4_bf16():
    rng = np.random.default_rng(3)
    m, n, k, group_sizes = 8, 16, 96, [3, 0, 5]
    packed, scale = _int4_experts(rng, 3, n, k)
    lhs = rng.normal(size=(m, k)).astype(ml_dtypes.bfloat16)
    out = gm.ragged_dot_int4(
        jnp.asarray(lhs), W(packed, scale), jnp.asarray(group_sizes), preferred_element_type=jnp.float32
    )
    assert out.dtype == jnp.float32
    w = quant_np.dequant_int4_np(packed, scale, dtype=ml_dtypes.bfloat16).astype(np.float32)
    ref = _reference(lhs.astype(np.float32), np.swapaxes(w, 1, 2), group_sizes)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-4)


def test_int4_tokamax_operands_layout():
    # The QArray handed to tokamax must dequantize to the same [G, K, N] rhs.
    rng = np.random.default_rng(4)
    g, n, k = 3, 16, 64
    packed, scale = _int4_experts(rng, g, n, k)
    for weights in (jnp.asarray(packed), quant.packed_to_int4(jnp.asarray(packed))):
        qvalue, qscale = gm.int4_tokamax_operands(weights, jnp.asarray(scale))
        assert qvalue.dtype == jnp.int4 and qvalue.shape == (g, k, n)
        assert qscale.shape == (g, k // 32, n)
        tile = tuple(a // b for a, b in zip(qvalue.shape, qscale.shape))
        assert tile == (1, 32, 1)
        rhs = qvalue.astype(jnp.float32) * jnp.repeat(qscale.astype(jnp.float32), 32, axis=1)
        expected = np.swapaxes(quant_np.dequant_int4_np(packed, scale), 1, 2)
        np.testing.assert_array_equal(np.asarray(rhs), expected)


def test_ragged_dot_int4_argument_errors():
    packed = jnp.zeros((2, 16, 8), jnp.int32)  # K = 64
    scale = jnp.ones((2, 16, 2), jnp.bfloat16)
    gs = jnp.array([1, 1])
    with pytest.raises(ValueError, match=r"scale: expected shape \(2, 16, 2\) .* found \(2, 16, 3\)"):
        gm.ragged_dot_int4(jnp.zeros((2, 64)), W(packed, jnp.ones((2, 16, 3))), gs)
    with pytest.raises(ValueError, match=r"lhs: expected K=64 .* found lhs shape \(2, 32\)"):
        gm.ragged_dot_int4(jnp.zeros((2, 32)), W(packed, scale), gs)
    with pytest.raises(ValueError, match=r"packed: expected int32 words .* found int8"):
        gm.ragged_dot_int4(jnp.zeros((2, 64)), W(packed.astype(jnp.int8), scale), gs)
    with pytest.raises(RuntimeError, match="impl='tokamax'"):
        gm.ragged_dot_int4(jnp.zeros((2, 64)), W(packed, scale), gs, impl="tokamax")


# ---------------------------------------------------------------------------
# Dispatch to tokamax, with a stand-in for the GPU-only library
# ---------------------------------------------------------------------------


class _FakeQArray:
    def __init__(self, qvalue, scale, zero_point, qtype):
        self.qvalue, self.scale, self.zero_point, self.qtype = qvalue, scale, zero_point, qtype


class _FakeTokamax:
    """Mimics tokamax.ragged_dot, including leaving rows past the groups unwritten."""

    def __init__(self):
        self.calls = []

    def ragged_dot(self, lhs, rhs, group_sizes, preferred_element_type=None, implementation=None):
        self.calls.append({"implementation": implementation, "rhs": rhs})
        if isinstance(rhs, _FakeQArray):
            tile = rhs.qvalue.shape[1] // rhs.scale.shape[1]
            s = jnp.repeat(rhs.scale.astype(jnp.float32), tile, axis=1)
            rhs = (rhs.qvalue.astype(jnp.float32) * s).astype(rhs.scale.dtype)
        out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)
        unwritten = jnp.arange(out.shape[0])[:, None] >= jnp.sum(group_sizes)
        return jnp.where(unwritten, jnp.nan, out)


@pytest.fixture
def fake_gpu(monkeypatch):
    fake = _FakeTokamax()
    qwix = type("qwix", (), {"QArray": _FakeQArray})
    monkeypatch.setattr(gm, "_platform", lambda: "gpu")
    monkeypatch.setattr(gm, "_load_tokamax", lambda: (fake, qwix, None))
    return fake


def test_dispatch_to_tokamax(fake_gpu):
    assert gm.backend_name() == "tokamax"
    rng = np.random.default_rng(5)
    m, k, n, group_sizes = 10, 64, 128, [3, 0, 4]
    lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(3, k, n)), jnp.bfloat16)
    gs = jnp.asarray(group_sizes, jnp.int32)

    out = gm.ragged_dot(lhs, rhs, gs)
    assert fake_gpu.calls[-1]["implementation"] == "mosaic"
    np.testing.assert_array_equal(np.asarray(out, np.float32)[7:], 0.0)  # masked, not NaN
    np.testing.assert_array_equal(
        np.asarray(out, np.float32), np.asarray(gm.ragged_dot(lhs, rhs, gs, impl="xla"), np.float32)
    )

    # float32 operands: auto mode falls back to xla, forcing tokamax is an error.
    n_calls = len(fake_gpu.calls)
    gm.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs)
    assert len(fake_gpu.calls) == n_calls
    with pytest.raises(ValueError, match=r"both bf16 or both f16, found float32 and float32"):
        gm.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs, impl="tokamax")


def test_dispatch_int4_to_tokamax(fake_gpu):
    """Kimi's group-32 INT4: the Mosaic int4 kernel cannot tile K by 32 (no swizzle on H200), so
    auto mode dequantises the gathered experts and calls the dense Mosaic kernel; forcing the
    int4 kernel raises with the reason."""
    rng = np.random.default_rng(6)
    m, n, k, group_sizes = 9, 128, 64, [2, 4, 0]
    packed, scale = _int4_experts(rng, 3, n, k)
    lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    gs = jnp.asarray(group_sizes, jnp.int32)

    out = gm.ragged_dot_int4(lhs, W(jnp.asarray(packed), jnp.asarray(scale)), gs, preferred_element_type=jnp.float32)
    call = fake_gpu.calls[-1]
    assert call["implementation"] == "mosaic"
    assert call["rhs"].shape == (3, k, n) and call["rhs"].dtype == jnp.bfloat16  # dense, dequantised
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out)[6:], 0.0)
    ref = gm.ragged_dot_int4(lhs, W(packed, scale), gs, preferred_element_type=jnp.bfloat16, impl="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref, np.float32), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match=r"groups of at least 64 inputs, found 32"):
        gm.ragged_dot_int4(lhs, W(packed, scale), gs, impl="tokamax")
