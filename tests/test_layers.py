"""jaxspec.layers and jaxspec.loop's helpers against hand-written numpy (the models' parity tests cover the rest)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import layers, loop


def np_attention(q, k, v, mask, scale):
    """Grouped-query attention in float64: q [B,T,K,G,D], k [B,S,K,D], v [B,S,K,E], mask [B,T,S]."""
    s = np.einsum("btkgd,bskd->bkgts", q, k).astype(np.float64) * scale
    s = np.where(mask[:, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bkgts,bske->btkge", p / p.sum(-1, keepdims=True), v)


def test_attention_matches_numpy_and_a_fully_masked_row_stays_finite():
    rng = np.random.default_rng(0)
    B, T, S, K, G, D = 2, 3, 5, 2, 2, 4
    q, k, v = (rng.normal(size=shape).astype(np.float32) for shape in ((B, T, K, G, D), (B, S, K, D), (B, S, K, D)))
    mask = rng.random((B, T, S)) < 0.6
    mask[:, :, 0] = True
    out = np.asarray(layers.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), 0.5))
    np.testing.assert_allclose(out, np_attention(q, k, v, mask, 0.5), rtol=1e-5, atol=1e-6)

    mask[1, 2] = False  # a padding row that sees nothing: uniform weights, no NaN
    out = np.asarray(layers.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), 0.5))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[1, 2], np.broadcast_to(v[1].mean(0)[:, None], (K, G, D)), rtol=1e-5, atol=1e-6)

    # The single key/value form with a second score term is the grouped form with one kv head
    # and the two terms' features side by side.
    mask[1, 2, 0] = True
    q2, k2 = rng.normal(size=(B, T, G, 3)).astype(np.float32), rng.normal(size=(B, S, 3)).astype(np.float32)
    mqa = layers.attention(
        jnp.asarray(q[:, :, 0]), jnp.asarray(k[:, :, 0]), jnp.asarray(v[:, :, 0]), jnp.asarray(mask), 0.5, q2, k2
    )
    qq = np.concatenate([q[:, :, :1], q2[:, :, None]], -1)
    kk = np.concatenate([k[:, :, :1], k2[:, :, None]], -1)
    ref = np_attention(qq, kk, v[:, :, :1], mask, 0.5)[:, :, 0]
    np.testing.assert_allclose(np.asarray(mqa), ref, rtol=1e-5, atol=1e-6)


def test_rope_layouts_agree_and_rotate_pairs():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 4, 3, 8)).astype(np.float32)
    pos = jnp.asarray(rng.integers(0, 50, size=(2, 4)), jnp.int32)
    inv = layers.base_inv_freq(8, 10000.0)
    half = layers.rope(jnp.asarray(x), pos, inv)
    # Interleaved pairs (x0, x1), (x2, x3), ... give the same result as the halves layout of the same pairs.
    inter = np.empty_like(x)
    inter[..., 0::2], inter[..., 1::2] = x[..., :4], x[..., 4:]
    np.testing.assert_allclose(np.asarray(layers.rope(jnp.asarray(inter), pos, inv, interleaved=True)), half, atol=1e-6)
    angle = np.asarray(pos, np.float64)[..., None, None] * inv
    a, b = x[..., :4], x[..., 4:]
    ref = np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], -1)
    np.testing.assert_allclose(np.asarray(half), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(layers.rope(jnp.asarray(x), pos, inv, 2.0)), 2 * ref, rtol=1e-5, atol=1e-5)


def test_masks_and_slot_writes():
    pos = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32)
    causal = np.asarray(layers.causal_mask(pos, 8, limit=5))
    for b in range(2):
        for t in range(3):
            np.testing.assert_array_equal(causal[b, t], [(s <= pos[b, t]) and s < 5 for s in range(8)])
    lengths = jnp.asarray([2, 4], jnp.int32)
    tree = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)  # root, two children of the root
    mask = np.asarray(layers.tree_mask(lengths, jnp.asarray(np.stack([tree, tree])), 8))
    for b, P in enumerate([2, 4]):
        for i in range(3):
            want = [s < P or (P <= s < P + 3 and tree[i, s - P]) for s in range(8)]
            np.testing.assert_array_equal(mask[b, i], want)
    np.testing.assert_array_equal(np.asarray(layers.prefix_mask(lengths, 5))[:, 0], [[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])

    buf = jnp.zeros((2, 4), jnp.int32)
    out = layers.write_slots(buf, jnp.asarray([[7, 8], [9, 6]]), jnp.asarray([[1, 4], [0, 3]]))
    np.testing.assert_array_equal(out, [[0, 7, 0, 0], [9, 0, 0, 6]])  # slot 4 is out of range: dropped
    stacked = jnp.arange(2 * 2 * 4).reshape(2, 2, 4)
    moved = np.asarray(layers.move_slots(stacked, jnp.asarray([[3], [2]]), jnp.asarray([[0], [5]]), lead=1))
    ref = np.asarray(stacked).copy()
    ref[:, 0, 0] = ref[:, 0, 3]
    np.testing.assert_array_equal(moved, ref)


def test_append_tokens_stops_at_a_stop_token_and_the_budget():
    state = loop.LoopState(**loop.fresh(3, 6, jax.random.key(0)))
    stop = jnp.asarray([5], jnp.int32)
    new = jnp.asarray([[1, 2, 3], [4, 5, 6], [7, 8, 9]], jnp.int32)
    state = loop.append_tokens(state, new, jnp.asarray([3, 3, 2]), stop, max_new=4)
    np.testing.assert_array_equal(state.num_out_B, [3, 2, 2])
    np.testing.assert_array_equal(state.done_B, [False, True, False])
    state = loop.append_tokens(state, new, jnp.asarray([3, 3, 1]), stop, max_new=4)
    np.testing.assert_array_equal(state.num_out_B, [4, 2, 3])  # row 0 at its budget, row 1 done, row 2 one more
    np.testing.assert_array_equal(state.done_B, [True, True, False])
    np.testing.assert_array_equal(state.out_BN[:, :4], [[1, 2, 3, 1], [4, 5, -1, -1], [7, 8, 7, -1]])


@pytest.mark.parametrize("chunk", [0, 2, 3, 7])
def test_scan_chunks_equals_one_pass(chunk):
    """A running sum over chunks: the carry, each row's value at its last position and the per-token outputs."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(3, 7)).astype(np.float32))
    last = jnp.asarray([6, 2, 4], jnp.int32)
    C = loop.chunk_size(7, chunk)
    xp = jnp.pad(x, ((0, 0), (0, -(-7 // C) * C - 7)))

    def run(total, start):
        part = jax.lax.dynamic_slice_in_dim(xp, start, C, axis=1)
        sums = total[:, None] + jnp.cumsum(part, axis=1)
        at_last = jnp.take_along_axis(sums, jnp.clip(last - start, 0, C - 1)[:, None], axis=1)[:, 0]
        return sums[:, -1], at_last, sums[..., None]

    total, at_last, out = loop.scan_chunks(run, jnp.zeros(3), 7, chunk, last)
    ref = np.cumsum(np.asarray(x), axis=1)
    np.testing.assert_allclose(out[..., 0], ref, rtol=1e-6)
    np.testing.assert_allclose(at_last, ref[np.arange(3), np.asarray(last)], rtol=1e-6)
    np.testing.assert_allclose(total, np.cumsum(np.asarray(xp), axis=1)[:, -1], rtol=1e-6)
