"""MLA's absorbed kv_b products per head (`jaxspec.kernels.absorb`), Pallas interpret mode.

Checked against float64 numpy, for a row's bits not depending on the other rows of the call (a verify
row equals the decode step), for the padded rows `stacked_matmul` reads as they are, and for gradients
against XLA's einsums on the layer's slice.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import eqns

from jaxspec import stacked
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
