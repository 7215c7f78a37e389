"""MLA's absorbed kv_b products per head (`jaxspec.kernels.absorb`), Pallas interpret mode.

Checked against float64 numpy, for a row's bits not depending on the other rows of the call (a verify
row equals the decode step), for the padded rows `stacked_matmul` reads as they are, and for gradients
against XLA's einsums on the layer's slice. `absorb_keys` given q_b's K parts (`stacked.Parts`) and the
query's rotation (``rope=``): against the summed query's product and XLA's `layers.rope` of it (jitted, as
the model runs it: XLA contracts float32 products into FMAs under jit, and so does the kernel's body).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import eqns

from jaxspec import layers, stacked
from jaxspec.kernels import absorb as ab
from jaxspec.kernels import stacked_matmul as sm

F64 = np.float64


def _rel(a, b):
    a, b = np.asarray(a, F64), np.asarray(b, F64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _case(rng, lead, H=4, L=64, nope=32, v=48, r=16, layers=3, dtype=jnp.float32):
    q = jnp.asarray(rng.normal(size=(*lead, H, nope + r)), dtype)
    o = jnp.asarray(rng.normal(size=(*lead, H, L)), dtype)
    kv_b = jnp.asarray(rng.normal(size=(layers, L, H, nope + v)) / 8, dtype)
    return q, o, kv_b


def _keys_np(q, kv_b, nope):
    return np.einsum("...hj,lhj->...hl", np.asarray(q, F64)[..., :nope], np.asarray(kv_b, F64)[..., :nope])


def _values_np(o, kv_b, nope):
    return np.einsum("...hl,lhc->...hc", np.asarray(o, F64), np.asarray(kv_b, F64)[..., nope:])


keys = jax.jit(lambda q, w, i: ab.absorb_keys(q, w, 32, layer=i, interpret=True))
values = jax.jit(lambda o, w, i: ab.absorb_values(o, w, 32, layer=i, interpret=True))
values_padded = jax.jit(lambda o, w, i: ab.absorb_values(o, w, 32, layer=i, padded=True, interpret=True))


@pytest.mark.parametrize("lead", [(1, 1), (2, 3), (1, 16), (3, 7), (40,)])
def test_both_products_match_numpy_for_the_layer_read(lead):
    rng = np.random.default_rng()
    q, o, kv_b = _case(rng, lead)
    for i in (0, 2):
        got_k, got_v = keys(q, kv_b, i), values(o, kv_b, i)
        assert got_k.shape == (*lead, 4, 64) and got_v.shape == (*lead, 4, 48)
        assert _rel(got_k, _keys_np(q, kv_b[i], 32)) < 1e-5
        assert _rel(got_v, _values_np(o, kv_b[i], 32)) < 1e-5
    # one layer given as it is (no stack) is the same product
    unstacked = ab.absorb_keys(q, kv_b[1], 32, interpret=True)
    np.testing.assert_array_equal(np.asarray(unstacked), np.asarray(keys(q, kv_b, 1)))


def test_a_row_is_the_same_bits_alone_and_among_others():
    rng = np.random.default_rng()
    q, o, kv_b = _case(rng, (37,))
    many_k, many_v = np.asarray(keys(q, kv_b, 1)), np.asarray(values(o, kv_b, 1))
    for r in (0, 15, 16, 36):
        np.testing.assert_array_equal(np.asarray(keys(q[r : r + 1], kv_b, 1))[0], many_k[r], err_msg=f"row {r}")
        np.testing.assert_array_equal(np.asarray(values(o[r : r + 1], kv_b, 1))[0], many_v[r], err_msg=f"row {r}")


@pytest.mark.parametrize("m", [1, 15, 16, 33])
def test_padded_values_are_the_rows_stacked_matmul_reads_as_they_are(m):
    """The padded form holds the same rows, zero rows after them (one block more where M fills whole
    blocks), and o_proj's in-place product reads it as its own copy: no pad, the same result."""
    rng = np.random.default_rng()
    _, o, kv_b = _case(rng, (1, m))
    p = np.asarray(values_padded(o, kv_b, 2))
    assert p.shape == (sm.padded_rows(m), 4 * 48)
    np.testing.assert_array_equal(p[:m].reshape(1, m, 4, 48), np.asarray(values(o, kv_b, 2)))
    assert not p[m:].any()
    w_o = stacked.LayerOf(jnp.asarray(rng.normal(size=(2, 4, 48, 80)) / 8, jnp.float32), jnp.int32(1), "interpret")
    rows = stacked.Rows(jnp.asarray(p), (1, m, 4, 48), width=2)
    f = jax.jit(lambda x: stacked.einsum("bthv,hvd->btd", x, w_o))
    got = f(rows)
    want = np.einsum("bthv,hvd->btd", np.asarray(values(o, kv_b, 2), F64), np.asarray(w_o.stack[1], F64))
    assert got.shape == (1, m, 80) and _rel(got, want) < 1e-5
    calls = [e for e in eqns(jax.make_jaxpr(f)(rows).jaxpr) if e.primitive.name == "pallas_call"]
    assert len(calls) == 1 and calls[0].invars[1].aval.shape == (sm.padded_rows(m), 4 * 48)
    assert "pad" not in {e.primitive.name for e in eqns(jax.make_jaxpr(f)(rows).jaxpr)}
    np.testing.assert_array_equal(np.asarray(got), np.asarray(f(stacked.Rows(jnp.asarray(p), (1, m, 4, 48), 2))))
    # seen as other leading dims, the same rows
    assert rows.reshape(m, 4, 48).rows == m and rows.value.shape == (1, m, 4, 48)
    with pytest.raises(ValueError, match="must keep the rows and the last 2 dims"):
        rows.reshape(1, m, 48, 4)


def test_gradients_match_xla_on_the_layer_slice():
    rng = np.random.default_rng()
    q, o, kv_b = _case(rng, (2, 3))

    def loss(q, o, w, k_fn, v_fn):
        return jnp.sum(jnp.tanh(k_fn(q, w)) ** 2) + jnp.sum(jnp.sin(v_fn(o, w)))

    ours = jax.grad(loss, (0, 1, 2))(
        q,
        o,
        kv_b,
        lambda q, w: ab.absorb_keys(q, w, 32, layer=2, interpret=True),
        lambda o, w: ab.absorb_values(o, w, 32, layer=2, interpret=True),
    )
    hi = jax.lax.Precision.HIGHEST
    ref = jax.grad(loss, (0, 1, 2))(
        q,
        o,
        kv_b,
        lambda q, w: jnp.einsum("mhj,lhj->mhl", q.reshape(6, 4, -1)[..., :32], w[2, ..., :32], precision=hi),
        lambda o, w: jnp.einsum("mhl,lhc->mhc", o.reshape(6, 4, -1), w[2, ..., 32:], precision=hi),
    )
    for g, r in zip(ours, ref):
        assert g.shape == r.shape and _rel(g, r) < 1e-5
    assert not np.asarray(ours[2])[:2].any()  # only the layer read has a gradient
    # and through the padded rows: the padding rows are not outputs
    gp = jax.grad(lambda o: jnp.sum(ab.absorb_values(o, kv_b, 32, layer=2, padded=True, interpret=True) ** 2))(o)
    gu = jax.grad(lambda o: jnp.sum(ab.absorb_values(o, kv_b, 32, layer=2, interpret=True) ** 2))(o)
    assert _rel(gp, gu) < 1e-6


def test_bad_input_names_what_it_expected():
    rng = np.random.default_rng(0)
    q, o, kv_b = _case(rng, (1, 2))
    with pytest.raises(ValueError, match=r"absorb_keys: expected x \[\.\.\., H, Q >= nope\] and kv_b"):
        ab.absorb_keys(q, kv_b.astype(jnp.bfloat16), 32, layer=0, interpret=True)
    with pytest.raises(ValueError, match=r"kv_b \[L, H, nope \+ v\] of x's dtype"):
        ab.absorb_keys(q, kv_b, 32, interpret=True)  # a stack without layer=
    with pytest.raises(ValueError, match="absorb_keys: nope=64 must fit q's 48 dims"):
        ab.absorb_keys(q, kv_b, 64, layer=0, interpret=True)
    with pytest.raises(ValueError, match="absorb_values: o's last dim 48 must be kv_b's L=64"):
        ab.absorb_values(q, kv_b, 32, layer=0, interpret=True)
    with pytest.raises(ValueError, match=r"absorb config: unknown keys \['bn'\]"):
        ab.absorb_values(o, kv_b, 32, layer=0, config={"bn": 32}, interpret=True)
    assert ab.shapes_ok(512, 128, 128) and not ab.shapes_ok(512, 120, 128)
    if jax.default_backend() != "gpu":
        assert "needs a GPU backend" in ab.available()


# --- absorb_keys from q_b's K parts, with the query's rope rotation -------------------------------------------------


def _seeded():
    seed = int(np.random.default_rng().integers(2**31))
    return np.random.default_rng(seed), f"seed {seed}"


def _parts(rng, lead, dtype, H=2, Q=48, ksplit=3):
    """q [*lead, H, Q] as float32 K parts [ksplit, padded_rows(M), H * Q] (the padding rows nonzero: never read)."""
    M = int(np.prod(lead))
    parts = jnp.asarray(rng.normal(size=(ksplit, sm.padded_rows(M), H * Q)), jnp.float32)
    return stacked.Parts(parts, (*lead, H, Q), jnp.dtype(dtype))


def _rope_inputs(rng, lead, r=16):
    return jnp.asarray(rng.integers(0, 5000, size=lead), jnp.int32), layers.base_inv_freq(r, 10000.0)


def _keys_rope(q, kv_b, i, pos, freq, factor, il):
    return ab.absorb_keys(q, kv_b, 32, layer=i, interpret=True, rope=(pos, freq, factor, il))


def _bits(a):
    a = np.asarray(a)
    return a.view(np.int16).astype(np.int32) if a.dtype == jnp.bfloat16 else a.view(np.int32)


def rope_ref(x, pos, freq, factor, il):
    """`layers.rope` compiled, as the model runs it."""
    return jax.jit(lambda x, pos: layers.rope(x, pos, freq, factor, il))(x, pos)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_q_as_q_b_partials_is_the_summed_querys_product(dtype):
    """q_b's product as the dense kernel leaves it (K parts not added): the bits of the summed query's product,
    the summed query being the one `stacked.einsums` returns otherwise."""
    rng, seed = _seeded()
    B, T, H, K, L = 2, 3, 2, 512, 64
    x = jnp.asarray(rng.normal(size=(B, T, K)), dtype)
    w_qb = stacked.LayerOf(jnp.asarray(rng.normal(size=(2, K, H, 48)) / 16, dtype), jnp.int32(1), "interpret")
    (q_raw,) = stacked.einsums(("btq,qhk->bthk",), x, (w_qb,), raw=(True,))
    (q,) = stacked.einsums(("btq,qhk->bthk",), x, (w_qb,))
    assert isinstance(q_raw, stacked.Parts) and q_raw.parts.shape[0] > 1, seed  # a K split: partials to add
    assert q_raw.shape == q.shape == (B, T, H, 48) and q_raw.parts.shape[1] > B * T
    np.testing.assert_array_equal(np.asarray(ab.summed(q_raw)), np.asarray(q), err_msg=seed)
    kv_b = jnp.asarray(rng.normal(size=(3, L, H, 80)) / 8, dtype)
    got = keys(q_raw, kv_b, 2)
    assert got.shape == (B, T, H, L) and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(keys(q, kv_b, 2)), err_msg=seed)
    assert _rel(got, _keys_np(q, kv_b[2], 32)) < (1e-5 if dtype == jnp.float32 else 1e-2), seed


@pytest.mark.parametrize("lead,interleaved", [((2, 3), False), ((2, 3), True), ((1, 19), True), ((19, 1), False)])
def test_rope_output_is_layers_rope_of_the_summed_query(lead, interleaved):
    """q_rope: `layers.rope` of the query's rope part, exactly in float32, within one step in bfloat16 (where
    rounding a float32 difference twice may differ from XLA's); q_lat the same bits with and without it."""
    rng, seed = _seeded()
    pos, freq = _rope_inputs(rng, lead)
    assert len(set(np.asarray(pos).ravel().tolist())) > 1
    for dtype in (jnp.float32, jnp.bfloat16):
        kv_b = jnp.asarray(rng.normal(size=(2, 64, 2, 80)) / 8, dtype)
        q_parts = _parts(rng, lead, dtype)
        for q in (q_parts, ab.summed(q_parts)):
            q_lat, q_rope = _keys_rope(q, kv_b, 1, pos, freq, 1.25, interleaved)
            qv = ab.summed(q)
            want = rope_ref(qv[..., 32:], pos, freq, 1.25, interleaved)
            assert q_rope.shape == (*lead, 2, 16) and q_rope.dtype == dtype
            if dtype == jnp.float32:
                np.testing.assert_array_equal(np.asarray(q_rope), np.asarray(want), err_msg=seed)
            else:
                assert np.abs(_bits(q_rope) - _bits(want)).max() <= 1, seed
            np.testing.assert_array_equal(np.asarray(q_lat), np.asarray(keys(qv, kv_b, 1)), err_msg=seed)


def test_a_rotated_row_is_the_same_bits_alone_and_among_others():
    rng, seed = _seeded()
    M = 19
    pos, freq = _rope_inputs(rng, (M,))
    kv_b = jnp.asarray(rng.normal(size=(2, 64, 2, 80)) / 8, jnp.bfloat16)
    q = _parts(rng, (M,), jnp.bfloat16)
    run = jax.jit(lambda parts, pos, w: _keys_rope(stacked.Parts(parts, (pos.shape[0], 2, 48), jnp.bfloat16), w, 0,
                                                   pos, freq, 0.75, True))  # fmt: skip
    many_lat, many_rope = map(np.asarray, run(q.parts, pos, kv_b))
    for m in (0, 15, 16, 18):
        one = jnp.pad(q.parts[:, m : m + 1], ((0, 0), (0, 15), (0, 0)))  # a decode step's partials: one row, padded
        lat, rope = map(np.asarray, run(one, pos[m : m + 1], kv_b))
        np.testing.assert_array_equal(lat[0], many_lat[m], err_msg=f"row {m}, {seed}")
        np.testing.assert_array_equal(rope[0], many_rope[m], err_msg=f"row {m}, {seed}")


def test_partials_and_rope_are_one_launch_with_xlas_gradients():
    """Nothing left to XLA around the kernel (no sum of the parts, no cos / sin), and the gradients of the parts
    and of the stack are those of the XLA form (`absorb.reference`: summed parts, einsum, `layers.rope`)."""
    rng, seed = _seeded()
    lead = (2, 3)
    pos, freq = _rope_inputs(rng, lead)
    kv_b = jnp.asarray(rng.normal(size=(2, 64, 2, 80)) / 8, jnp.float32)
    q = _parts(rng, lead, jnp.float32)
    probe = jnp.asarray(rng.normal(size=(*lead, 2, 64 + 16)), jnp.float32)

    def loss(parts, w, fn):
        q_lat, q_rope = fn(stacked.Parts(parts, q.shape, q.dtype), w)
        return jnp.sum(jnp.sin(jnp.concatenate([q_lat, q_rope], axis=-1)) * probe)

    kernel = lambda q, w: _keys_rope(q, w, 1, pos, freq, 1.25, False)  # noqa: E731
    xla = lambda q, w: ab.reference(q, w, 32, layer=1, rope=(pos, freq, 1.25, False))  # noqa: E731
    jaxpr = jax.make_jaxpr(lambda p, w: kernel(stacked.Parts(p, q.shape, q.dtype), w))(q.parts, kv_b).jaxpr
    outside = [e.primitive.name for e in eqns(jaxpr, skip=("pallas_call",))]
    assert outside.count("pallas_call") == 1 and not {"add", "cos", "sin", "concatenate"} & set(outside), outside
    got = jax.grad(loss, (0, 1))(q.parts, kv_b, kernel)
    want = jax.grad(loss, (0, 1))(q.parts, kv_b, xla)
    for g, w in zip(got, want):
        assert g.shape == w.shape and float(jnp.abs(w).max()) > 0
        assert _rel(g, w) < 1e-5, seed
    assert not np.asarray(got[0])[:, 6:].any()  # the padding rows are not read
    assert not np.asarray(got[1])[0].any()  # only the layer read


def test_bad_partials_or_rope_name_the_argument():
    rng = np.random.default_rng(0)
    pos, freq = _rope_inputs(rng, (2, 3))
    kv_b = jnp.asarray(rng.normal(size=(2, 64, 2, 80)) / 8, jnp.float32)
    q = _parts(rng, (2, 3), jnp.float32)

    def call(q=q, w=kv_b, rope=(pos, freq, 1.0, False)):
        return ab.absorb_keys(q, w, 32, layer=0, interpret=True, rope=rope)

    with pytest.raises(ValueError, match=r"q's partials \(3, 4, 96\) do not hold its 6 rows of H \* Q = 96"):
        call(q=stacked.Parts(q.parts[:, :4], q.shape, q.dtype))
    with pytest.raises(ValueError, match=r"q's partials \(3, 16, 90\) .* expected \[ksplit, >= 6, 96\]"):
        call(q=stacked.Parts(q.parts[..., :90], q.shape, q.dtype))
    with pytest.raises(ValueError, match="q's partials must be float32, found bfloat16"):
        call(q=stacked.Parts(q.parts.astype(jnp.bfloat16), q.shape, q.dtype))
    with pytest.raises(ValueError, match="q's compute dtype bfloat16 .* must be kv_b's float32"):
        call(q=stacked.Parts(q.parts, q.shape, jnp.bfloat16))
    with pytest.raises(ValueError, match=r"rope's positions \(2, 2\) int32, expected ints of q's leading shape"):
        call(rope=(pos[:, :2], freq, 1.0, False))
    with pytest.raises(ValueError, match=r"rope's positions \(2, 3\) float32"):
        call(rope=(pos.astype(jnp.float32), freq, 1.0, False))
    with pytest.raises(ValueError, match=r"rope's inv_freq \(7,\), expected \(8,\)"):
        call(rope=(pos, freq[:7], 1.0, False))
    with pytest.raises(ValueError, match=r"rope must be \(positions, inv_freq, attention_factor, interleaved\)"):
        call(rope=(pos, freq))
    with pytest.raises(ValueError, match="q's rope part, Q - nope = 47 - 32 = 15, must be even"):
        call(q=stacked.Parts(q.parts[..., :94], (2, 3, 2, 47), q.dtype))
