"""MLA attention over the latent cache in one kernel (`jaxspec.kernels.mla_attention`), Pallas interpret mode.

Checked against the model's own XLA attention (`layers.attention`, the absorbed form `MLAttention` uses)
on causal, tree and fully masked rows, and for a row's bits not depending on the other tokens of the
call (a verify row equals the decode step).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import mla_attention as ma
from jaxspec.layers import attention, causal_mask, tree_mask


def _inputs(rng, B, T, H, L, r, S, dtype=jnp.float32):
    q_lat = jnp.asarray(rng.normal(size=(B, T, H, L)), dtype)
    q_rope = jnp.asarray(rng.normal(size=(B, T, H, r)), dtype)
    cache = jnp.asarray(rng.normal(size=(B, S, L + r)), dtype)
    return q_lat, q_rope, cache


def _model_attention(q_lat, q_rope, cache, mask, scale):
    L = q_lat.shape[-1]
    return attention(q_lat, cache[..., :L], cache[..., :L], mask, scale, q_rope, cache[..., L:])


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


run = jax.jit(lambda ql, qr, c, m: ma.mla_attention(ql, qr, c, m, 0.125, interpret=True))


@pytest.mark.parametrize("B,T,H,L,r,S", [(2, 1, 4, 64, 16, 64), (2, 3, 4, 64, 16, 96), (1, 5, 8, 32, 16, 128)])
def test_matches_the_model_attention_on_causal_rows(B, T, H, L, r, S):
    rng = np.random.default_rng(B * 100 + T)
    ql, qr, c = _inputs(rng, B, T, H, L, r, S)
    start = rng.integers(0, S - T, size=B)
    mask = causal_mask(jnp.asarray(start[:, None] + np.arange(T), jnp.int32), S)
    got = run(ql, qr, c, mask)
    assert got.shape == (B, T, H, L) and got.dtype == jnp.float32
    assert _rel(got, _model_attention(ql, qr, c, mask, 0.125)) < 1e-5


def test_tree_mask_and_a_row_that_sees_nothing():
    rng = np.random.default_rng(7)
    B, N, H, L, r, S = 2, 4, 4, 64, 16, 64
    ql, qr, c = _inputs(rng, B, N, H, L, r, S)
    tree = np.tril(np.ones((N, N), bool))
    tree[3, 1] = False  # node 3 hangs off node 0's second child: not a chain
    mask = tree_mask(jnp.asarray([20, 33]), jnp.asarray(np.broadcast_to(tree, (B, N, N))), S)
    mask = mask.at[1, 2].set(False)  # a padding row: every slot masked
    got = run(ql, qr, c, mask)
    ref = _model_attention(ql, qr, c, mask, 0.125)
    assert np.all(np.isfinite(np.asarray(got)))
    assert _rel(got, ref) < 1e-5
    np.testing.assert_allclose(
        np.asarray(got[1, 2]), np.broadcast_to(np.asarray(c[1, :, :L]).mean(0), (H, L)), atol=1e-5
    )


def test_a_row_is_the_same_bits_alone_and_among_the_tokens_of_a_verify():
    rng = np.random.default_rng(3)
    B, T, H, L, r, S = 2, 4, 8, 64, 16, 96
    ql, qr, c = _inputs(rng, B, T, H, L, r, S)
    mask = causal_mask(jnp.asarray([[50, 51, 52, 53], [7, 8, 9, 10]], jnp.int32), S)
    many = np.asarray(run(ql, qr, c, mask))
    for t in range(T):
        alone = np.asarray(run(ql[:, t : t + 1], qr[:, t : t + 1], c, mask[:, t : t + 1]))
        np.testing.assert_array_equal(alone[:, 0], many[:, t], err_msg=f"token {t}")


def test_bfloat16_is_close_to_the_model_attention():
    rng = np.random.default_rng(5)
    ql, qr, c = _inputs(rng, 2, 2, 8, 64, 16, 128, jnp.bfloat16)
    mask = causal_mask(jnp.asarray([[90, 91], [3, 4]], jnp.int32), 128)
    got = run(ql, qr, c, mask)
    assert got.dtype == jnp.bfloat16
    assert _rel(got.astype(jnp.float32), _model_attention(ql, qr, c, mask, 0.125).astype(jnp.float32)) < 2e-2


def test_shapes_it_does_not_take_are_clear_errors():
    rng = np.random.default_rng(0)
    ql, qr, c = _inputs(rng, 1, 1, 4, 64, 16, 64)
    mask = jnp.ones((1, 1, 64), bool)
    assert ma.shapes_ok(512, 64, 4096) and not ma.shapes_ok(48, 16, 64) and not ma.shapes_ok(64, 16, 40)
    with pytest.raises(ValueError, match=r"expected q_lat \[B, T, H, L\].*\(1, 64, 80\).*\(1, 1, 32\)"):
        ma.mla_attention(ql, qr, c, jnp.ones((1, 1, 32), bool), 0.1, interpret=True)
    with pytest.raises(ValueError, match="block_s=48 dividing S=64"):
        ma.mla_attention(ql, qr, c, mask, 0.1, config={"block_s": 48}, interpret=True)
