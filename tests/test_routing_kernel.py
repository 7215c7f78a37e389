"""jaxspec.kernels.routing (Pallas interpret mode on the CPU) against transformers' DeepseekV3TopkRouter,
the model's XLA routing and lax.top_k; and inside the model. With the dense kernel's partials as input and
the shared expert's SiLU-gated product as a third output, against the same values summed and multiplied in XLA.

Every test draws fresh random inputs (seeded from os.urandom; the seed is in each failure message).
"""

from __future__ import annotations

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jaxpr_walk import eqns
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from jaxspec import stacked
from jaxspec.kernels import routing
from jaxspec.kernels import stacked_matmul as sm
from jaxspec.model import route

# name: (tokens, experts, top-k, n_group, topk_group, norm_topk_prob)
CASES = {
    "kimi_one_token": (1, 384, 8, 1, 1, True),
    "kimi_verify": (19, 384, 8, 1, 1, True),
    "groups": (7, 64, 6, 8, 4, True),
    "small_groups_no_norm": (33, 16, 4, 4, 2, False),
    "top_2_of_8": (5, 8, 2, 1, 1, True),
}


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _cfg(E, k, n_group, topk_group, norm, scale=2.827):
    return types.SimpleNamespace(
        num_experts=E,
        num_experts_per_tok=k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )


def _kernel(logits, bias, cfg):
    fn = jax.jit(
        lambda a, b: routing.route_topk(
            a,
            b,
            k=cfg.num_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            norm=cfg.norm_topk_prob,
            scale=cfg.routed_scaling_factor,
            interpret=True,
        )
    )
    experts, weights = fn(jnp.asarray(logits), jnp.asarray(bias))
    return np.asarray(experts), np.asarray(weights)


def _by_expert(experts, weights):
    """Rows sorted by expert id (transformers' top-k is unsorted)."""
    order = np.argsort(experts, axis=1)
    return np.take_along_axis(experts, order, 1), np.take_along_axis(weights, order, 1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers_router(case):
    seed = _seed()
    rng = np.random.default_rng(seed)
    T, E, k, n_group, topk_group, norm = CASES[case]
    D = 32
    hf_cfg = DeepseekV3Config(
        hidden_size=D,
        n_routed_experts=E,
        num_experts_per_tok=k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=2.827,
    )
    router = DeepseekV3TopkRouter(hf_cfg)
    w = rng.normal(size=(E, D)).astype(np.float32)
    bias = (rng.normal(size=E) * 0.3).astype(np.float32)
    x = rng.normal(size=(T, D)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        logits, ref_w, ref_e = router(torch.from_numpy(x))
    experts, weights = _kernel(logits.numpy(), bias, _cfg(E, k, n_group, topk_group, norm))
    assert experts.shape == (T, k) and experts.dtype == np.int32 and weights.dtype == np.float32
    got_e, got_w = _by_expert(experts, weights)
    want_e, want_w = _by_expert(ref_e.numpy().astype(np.int32), ref_w.numpy())
    assert np.array_equal(got_e, want_e), (case, seed)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-6, atol=0, err_msg=f"{case}, seed {seed}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_models_xla_routing_in_order(case):
    """Same experts in the same (descending) order as lax.top_k, same weights."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    T, E, k, n_group, topk_group, norm = CASES[case]
    cfg = _cfg(E, k, n_group, topk_group, norm)
    logits = rng.normal(size=(T, E)).astype(np.float32) * 2
    bias = (rng.normal(size=E) * 0.3).astype(np.float32)
    experts, weights = _kernel(logits, bias, cfg)
    want_e, want_w = route(jnp.asarray(logits), jnp.asarray(bias), cfg)
    assert np.array_equal(experts, np.asarray(want_e)), (case, seed)
    np.testing.assert_allclose(weights, np.asarray(want_w), rtol=1e-6, atol=0, err_msg=f"{case}, seed {seed}")


def test_equal_scores_pick_the_lower_expert_first():
    """Ties (within the top-k, within a group's top 2, between groups' scores) resolve as lax.top_k."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    for E, k, n_group, topk_group in ((384, 8, 1, 1), (32, 4, 4, 2)):
        cfg = _cfg(E, k, n_group, topk_group, True)
        logits = rng.integers(-2, 3, size=(9, E)).astype(np.float32)  # five values: ties everywhere
        bias = np.zeros(E, np.float32)
        experts, weights = _kernel(logits, bias, cfg)
        want_e, want_w = route(jnp.asarray(logits), jnp.asarray(bias), cfg)
        assert np.array_equal(experts, np.asarray(want_e)), (E, seed)
        np.testing.assert_allclose(weights, np.asarray(want_w), rtol=1e-6, atol=0)


def test_a_tokens_routing_does_not_depend_on_the_call():
    """A token's experts and weights are the same bits alone, first or last among other tokens."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    cfg = _cfg(384, 8, 1, 1, True)
    logits = rng.normal(size=(21, 384)).astype(np.float32)
    bias = (rng.normal(size=384) * 0.1).astype(np.float32)
    all_e, all_w = _kernel(logits, bias, cfg)
    for t in (0, 7, 20):
        one_e, one_w = _kernel(logits[t : t + 1], bias, cfg)
        assert np.array_equal(one_e[0], all_e[t]) and np.array_equal(one_w[0], all_w[t]), (t, seed)
    tail_e, tail_w = _kernel(logits[15:], bias, cfg)
    assert np.array_equal(tail_e, all_e[15:]) and np.array_equal(tail_w, all_w[15:]), seed


def test_rejects_bad_input():
    lg, b = jnp.zeros((3, 16)), jnp.zeros((16,))
    with pytest.raises(ValueError, match=r"bias must be \[16\]"):
        routing.route_topk(lg, jnp.zeros((15,)), k=2, interpret=True)
    with pytest.raises(ValueError, match="logits must be"):
        routing.route_topk(jnp.zeros((16,)), b, k=2, interpret=True)
    with pytest.raises(ValueError, match="n_group=3"):
        routing.route_topk(lg, b, k=2, n_group=3, interpret=True)
    with pytest.raises(ValueError, match=r"k=9 must be in \[1, 8\]"):
        routing.route_topk(lg, b, k=9, n_group=4, topk_group=2, interpret=True)
    e, w = routing.route_topk(jnp.zeros((0, 16)), b, k=2, interpret=True)
    assert e.shape == (0, 2) and w.shape == (0, 2)


def test_stacked_biases_read_in_place_route_as_the_layers_own_bias():
    """With ``layer=`` the kernel reads row ``layer`` of the stacked biases [L, E] in place (a traced index, as
    in the layers' scan): the same experts and weight bits as that layer's bias alone, for every layer; a bias
    of the wrong shape for either form is refused by name."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    cfg = _cfg(32, 4, 4, 2, True)
    logits = rng.normal(size=(9, 32)).astype(np.float32)
    stack = rng.normal(scale=0.5, size=(5, 32)).astype(np.float32)
    opts = dict(k=4, n_group=4, topk_group=2, norm=True, scale=2.827, interpret=True)
    fn = jax.jit(lambda a, b, i: routing.route_topk(a, b, layer=i, **opts))
    for layer in range(5):
        want_e, want_w = _kernel(logits, stack[layer], cfg)
        got_e, got_w = (np.asarray(v) for v in fn(jnp.asarray(logits), jnp.asarray(stack), jnp.int32(layer)))
        assert np.array_equal(got_e, want_e) and np.array_equal(got_w, want_w), (layer, seed)
    ref_e, ref_w = routing.reference_route(logits, stack[4], 4, 4, 2, True, 2.827)
    assert np.array_equal(got_e, ref_e) and np.allclose(got_w, ref_w, rtol=1e-5, atol=0), seed
    with pytest.raises(ValueError, match=r"with layer=, bias must be \[L, 32\]"):
        routing.route_topk(jnp.asarray(logits), jnp.asarray(stack[0]), layer=0, **opts)


def test_probe_logits_leave_no_near_ties():
    """The GPU availability probe compares experts exactly: its scores must be far apart."""
    for E, n_group, topk_group in ((384, 1, 1), (64, 8, 4), (32, 4, 2)):
        logits, bias = routing.probe_inputs(19, E, n_group)
        s = 1 / (1 + np.exp(-logits.astype(np.float64))) + bias
        assert np.diff(np.sort(s, axis=1), axis=1).min() > 1e-4, E
        if n_group > 1:  # group scores (the sum of a group's two best) far apart as well
            top2 = np.sort(s.reshape(19, n_group, -1), axis=-1)[..., -2:].sum(-1)
            assert np.diff(np.sort(top2, axis=1), axis=1).min() > 1.0, E
        want_e, want_w = routing.reference_route(logits, bias, 4, n_group, topk_group, True, 2.5)
        got_e, got_w = _kernel(logits, bias, _cfg(E, 4, n_group, topk_group, True, 2.5))
        assert np.array_equal(got_e, want_e) and np.allclose(got_w, want_w, rtol=1e-6, atol=0), E


def test_the_kernel_path_of_the_model_routes_through_the_kernel():
    """With the experts in the kernel's layout (expert_impl 'interpret') the MoE layer routes with
    route_topk; with the checkpoint's layout it keeps XLA's routing."""
    from jaxspec import model as model_mod

    cfg = _cfg(16, 4, 4, 2, True)
    logits, bias = jnp.zeros((3, 16)), jnp.zeros((16,))
    names = lambda impl: {  # noqa: E731
        e.params.get("name")
        for e in eqns(jax.make_jaxpr(lambda a, b: model_mod.route_tokens(a, b, cfg, impl))(logits, bias).jaxpr)
    }
    assert "route_topk" in names("interpret")
    assert "route_topk" not in names("gather") and "route_topk" not in names("xla")


def test_probes_pass_when_first_asked_inside_a_trace(monkeypatch):
    """On a GPU the model first asks the routing and metadata kernels' probes while a decode step is being
    traced; the probes must still run their calls at once (compiled), not stage them into that trace and
    fail on its tracers. Faked here: the backend reads 'gpu' and the kernels run interpreted."""
    from jaxspec.kernels import int4_moe as im

    route_topk, route_blocks = routing.route_topk, im.route_blocks
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(routing, "route_topk", lambda *a, **kw: route_topk(*a, **{**kw, "interpret": True}))
    monkeypatch.setattr(
        im, "route_blocks", lambda *a: route_blocks(*[("interpret" if v == "kernel" else v) for v in a])
    )
    caches = (routing.available, im.metadata_problem, im._probe, routing._blocks_problem)
    for probe in caches:
        probe.cache_clear()
    answers = {}

    def step(x):
        answers["routing"] = routing.available(32, 4, 4, 2, True, 2.5)
        answers["routing_kimi"] = routing.available(384, 8, 1, 1, True, 2.827)
        answers["metadata"] = im.metadata_problem(12)
        answers["experts"] = im._probe(interpret=True)  # the expert kernel's own probe call
        answers["blocks"] = routing.blocks_problem(384, 8, 1, 1, True, 2.827, num_local=48, share=8)
        answers["blocks_groups"] = routing.blocks_problem(32, 4, 4, 2, True, 2.5, num_local=12, share=1)
        return x + 1

    try:
        jax.jit(step).lower(jnp.zeros(3))
        want = dict.fromkeys(("routing", "routing_kimi", "metadata", "experts", "blocks", "blocks_groups"))
        assert answers == want, answers
    finally:  # the real answers (no GPU here) for the rest of the session
        for probe in caches:
            probe.cache_clear()


def _ulps(a, b) -> np.ndarray:
    """How many representable values of their (common) float dtype lie between a and b."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    ints = {2: np.int16, 4: np.int32}[a.dtype.itemsize]
    sign = np.iinfo(ints).max

    def ordered(x):
        i = x.view(ints).astype(np.int64)
        return np.where(i < 0, -(i & sign), i)

    return np.abs(ordered(a) - ordered(b))


def _dense_parts(rng, x, widths, dtype, out_dtype=None):
    """x's products with random [K, n] weights (layer 1 of a stack; one kernel call for all) as the dense
    kernel's `stacked.Parts`, the way a MoE layer gets its logits and the shared expert's gate and up (K
    split: several parts)."""
    K = x.shape[-1]
    ws = tuple(
        stacked.LayerOf(jnp.asarray(rng.normal(size=(2, K, n)) / np.sqrt(K), dtype), jnp.int32(1), "interpret")
        for n in widths
    )
    ys = stacked.einsums(("td,dn->tn",) * len(ws), x, ws, out_dtype=(out_dtype,) * len(ws), raw=(True,) * len(ws))
    for y, n in zip(ys, widths):
        assert isinstance(y, stacked.Parts) and y.parts.shape[0] > 1, type(y)  # partials left to add
        assert y.parts.shape[1] == sm.padded_rows(x.shape[0]) and y.shape == (x.shape[0], n)
    return ys


def _rows(rng, T, K, dtype):
    """A norm's zero-padded rows (`stacked.Rows`), as `kernels.rms_norm` writes them."""
    x = rng.normal(size=(T, K)).astype(np.float32)
    return stacked.Rows(jnp.pad(jnp.asarray(x, dtype), ((0, sm.padded_rows(T) - T), (0, 0))), (T, K))


def test_logits_as_the_dense_kernels_partials_route_as_their_sum():
    """Logits as `stacked.Parts` (the router's product before XLA adds its K parts; from a norm's padded
    bfloat16 rows and a float32 router, as in the model, or from a plain float32 array; float32 logits, and
    the same partials as bfloat16 ones): the same experts and weight bits as `route_topk` on `Parts.value`,
    with expert groups and without."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    E, K = 64, 512
    bias = jnp.asarray(rng.normal(size=E) * 0.1, jnp.float32)
    cases = ((3, _rows(rng, 3, K, jnp.bfloat16), 8, 4), (19, jnp.asarray(rng.normal(size=(19, K)), jnp.float32), 1, 1))
    for T, x, n_group, topk_group in cases:
        (logits,) = _dense_parts(rng, x, (E,), jnp.float32, jnp.float32)
        assert logits.dtype == jnp.float32 and logits.shape == (T, E)
        opts = dict(k=6, n_group=n_group, topk_group=topk_group, scale=2.5, interpret=True)
        # the same partials standing for bfloat16 logits (a bfloat16 router's): rounded to bfloat16 once added
        for lg in (logits, stacked.Parts(logits.parts, logits.shape, jnp.bfloat16)):
            want_e, want_w = routing.route_topk(lg.value, bias, **opts)
            got_e, got_w = routing.route_topk(lg, bias, **opts)
            case = (T, n_group, lg.dtype, seed)
            assert np.array_equal(np.asarray(got_e), np.asarray(want_e)), case
            assert np.array_equal(np.asarray(got_w), np.asarray(want_w)), case


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gate_up_gives_the_padded_silu_product(dtype):
    """``gate_up``: h [padded_rows(T), F] with rows T.. exactly zero and rows < T the kernel's rounding of
    silu(gate) * up (`routing.reference_h`) bit for bit, for gate and up as the dense kernel's partials, as
    arrays or one of each, T below and above one 16-row block, F one and four column blocks. In float32 that
    is also XLA's ``jax.nn.silu(g) * u`` bit for bit; in bfloat16 XLA on the CPU rounds every step of its
    sigmoid (1 / (1 + exp(-x))) to bfloat16, so it is within 4 ulps (3 seen) of the kernel's. The routing
    is the same as without gate_up."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    E, K = 16, 512
    bias = jnp.asarray(rng.normal(size=E) * 0.1, jnp.float32)
    opts = dict(k=4, n_group=4, topk_group=2, interpret=True)
    xla = jax.jit(lambda g, u: jax.nn.silu(g) * u)
    for T, F, form in ((19, 1024, "parts"), (3, 256, "arrays"), (3, 256, "mixed")):
        if form == "arrays":  # products of a few units, as the shared expert's
            gate, up = (jnp.asarray(rng.normal(size=(T, F)) * 3, dt) for _ in range(2))
        else:
            gate, up = _dense_parts(rng, jnp.asarray(rng.normal(size=(T, K)), dt), (F, F), dt)
            if form == "mixed":
                gate = gate.value
        logits = jnp.asarray(rng.normal(size=(T, E)), jnp.float32)
        ex, wt, h = (np.asarray(v) for v in routing.route_topk(logits, bias, gate_up=(gate, up), **opts))
        case = (T, F, form, seed)
        assert h.shape == (sm.padded_rows(T), F) and h.dtype == dt, (h.shape, h.dtype, case)
        assert np.all(h[T:] == 0) and not np.any(np.signbit(h[T:])), case
        np.testing.assert_array_equal(h[:T], np.asarray(routing.reference_h(gate, up)), err_msg=str(case))
        off = _ulps(h[:T], np.asarray(xla(stacked.value(gate), stacked.value(up))))
        assert off.max() <= (0 if dt == jnp.float32 else 4), (off.max(), case)
        if form == "parts":
            want_e, want_w = routing.route_topk(logits, bias, **opts)
            assert np.array_equal(ex, np.asarray(want_e)) and np.array_equal(wt, np.asarray(want_w)), case


def test_a_tokens_experts_weights_and_h_row_do_not_depend_on_the_call():
    """With partials in and gate_up: a token's experts, weights and h row are the same bits alone, first or
    last among other tokens (a decode step's and a verify's), and a call's rows past its tokens are zero."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    T, E, F, ks = 19, 384, 512, 16
    lp = rng.normal(scale=0.5, size=(ks, T, E)).astype(np.float32)
    gp, upp = (rng.normal(scale=0.8, size=(ks, T, F)).astype(np.float32) for _ in range(2))
    bias = jnp.asarray(rng.normal(size=E) * 0.1, jnp.float32)

    @jax.jit
    def run(lp, gp, upp):  # partials of exactly the call's rows: Parts may hold T rows or more
        part = lambda p, dt: stacked.Parts(p, p.shape[1:], dt)  # noqa: E731
        gate_up = (part(gp, jnp.bfloat16), part(upp, jnp.bfloat16))
        return routing.route_topk(part(lp, jnp.float32), bias, k=8, scale=2.827, interpret=True, gate_up=gate_up)

    def call(rows):
        return [np.asarray(v) for v in run(lp[:, rows], gp[:, rows], upp[:, rows])]

    all_e, all_w, all_h = call(slice(0, T))
    for t in (0, 7, 18):
        one_e, one_w, one_h = call(slice(t, t + 1))
        assert np.array_equal(one_e[0], all_e[t]) and np.array_equal(one_w[0], all_w[t]), (t, seed)
        assert np.array_equal(one_h[0], all_h[t]) and np.all(one_h[1:] == 0), (t, seed)
    tail_e, tail_w, tail_h = call(slice(15, T))
    assert np.array_equal(tail_e, all_e[15:]) and np.array_equal(tail_w, all_w[15:]), seed
    assert np.array_equal(tail_h[: T - 15], all_h[15:T]) and np.all(tail_h[T - 15 :] == 0), seed


def test_rejects_bad_partials_and_gate_up():
    """Wrong `stacked.Parts` shapes, partials with fewer rows than tokens, gate and up that disagree in
    shape or dtype or with the logits' tokens: a ValueError naming the argument. No tokens: empty routing and
    an h of one block of zero rows."""
    b = jnp.zeros((16,))
    lg = jnp.zeros((3, 16))
    g = jnp.zeros((3, 32), jnp.bfloat16)
    opts = dict(k=2, interpret=True)
    bad_logits = {
        "3-d shape": stacked.Parts(jnp.zeros((2, 16, 16)), (1, 3, 16), jnp.float32),
        "columns": stacked.Parts(jnp.zeros((2, 16, 8)), (3, 16), jnp.float32),
        "rows": stacked.Parts(jnp.zeros((2, 2, 16)), (3, 16), jnp.float32),
        "2-d partials": stacked.Parts(jnp.zeros((16, 16)), (3, 16), jnp.float32),
    }
    for what, parts in bad_logits.items():
        with pytest.raises(ValueError, match=r"logits as stacked.Parts must be \[T, E\]"):
            routing.route_topk(parts, b, **opts)
            pytest.fail(what)
    with pytest.raises(ValueError, match=r"gate as stacked.Parts must be \[T, F\].*partials \(2, 2, 32\)"):
        routing.route_topk(lg, b, gate_up=(stacked.Parts(jnp.zeros((2, 2, 32)), (3, 32), jnp.bfloat16), g), **opts)
    with pytest.raises(ValueError, match=r"up must be \[T, F\], found shape \(3, 32, 1\)"):
        routing.route_topk(lg, b, gate_up=(g, jnp.zeros((3, 32, 1), jnp.bfloat16)), **opts)
    with pytest.raises(ValueError, match=r"gate and up must both be \[T, F\].*found gate \(3, 32\) and up \(3, 16\)"):
        routing.route_topk(lg, b, gate_up=(g, jnp.zeros((3, 16), jnp.bfloat16)), **opts)
    with pytest.raises(ValueError, match=r"logits' T=3; found gate \(4, 32\)"):
        routing.route_topk(lg, b, gate_up=(jnp.zeros((4, 32), jnp.bfloat16),) * 2, **opts)
    with pytest.raises(ValueError, match="gate and up must share a float dtype, found bfloat16 and float32"):
        routing.route_topk(lg, b, gate_up=(g, jnp.zeros((3, 32), jnp.float32)), **opts)
    with pytest.raises(ValueError, match="gate_up must be a pair"):
        routing.route_topk(lg, b, gate_up=g, **opts)
    e, w, h = routing.route_topk(jnp.zeros((0, 16)), b, gate_up=(g[:0], g[:0]), **opts)
    assert e.shape == (0, 2) and w.shape == (0, 2) and h.shape == (16, 32) and h.dtype == jnp.bfloat16
    assert not np.any(np.asarray(h, np.float32))


# name: (tokens, experts, top-k, n_group, topk_group, local experts, share, block group, gate_up)
BLOCK_CASES = {
    "kimi_share_decode": (1, 384, 8, 1, 1, 48, 8, 1, True),
    "kimi_share_verify": (4, 384, 8, 1, 1, 48, 8, 1, False),
    "share_batch_8_groups_of_2": (8, 64, 6, 8, 4, 16, 4, 2, True),
    "one_device_some_not_local": (3, 16, 4, 4, 2, 12, 1, 1, False),
    "odd_k": (5, 24, 3, 1, 1, 24, 1, 1, True),
}


@pytest.mark.parametrize("case", sorted(BLOCK_CASES))
def test_route_topk_with_blocks_builds_the_metadata_of_its_routing(case, monkeypatch):
    """`route_topk(blocks=...)` (one program routes every token, then builds the expert kernels' metadata):
    experts, weights and h the same bits as `route_topk` alone, and metadata equal to the metadata program's
    own launch (`block_routing.block_metadata`) and to XLA's `int4_moe.route_blocks` on those experts (packed's
    first S*16 rows; a mesh share's busiest device, the layer's expert offset), every counter zero. Up to 8
    tokens, the limit set that high (the default stops lower, where the two launches were faster on a device)."""
    from jaxspec.kernels import block_routing
    from jaxspec.kernels import int4_moe as im

    monkeypatch.setitem(routing.DEFAULT_CONFIG, "fused_max_tokens", 8)

    T, E, k, n_group, topk_group, num_local, share, group, with_h = BLOCK_CASES[case]
    seed = _seed()
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(T, E)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=E) * 0.1, jnp.float32)
    F = 48
    gate_up = tuple(jnp.asarray(rng.normal(size=(T, F)), jnp.bfloat16) for _ in range(2)) if with_h else None
    S = im.num_block_slots(T, k, num_local, group)
    plan = block_routing.Plan(num_local, S, im.BLOCK_M, group, share, counters=2 * T + 3)
    opts = dict(k=k, n_group=n_group, topk_group=topk_group, scale=2.5, interpret=True, gate_up=gate_up)
    layer = int(rng.integers(0, 4))
    *head, outs = jax.jit(lambda a, b: routing.route_topk(a, b, **opts, blocks=plan, expert_layer=layer))(logits, bias)
    alone = jax.jit(lambda a, b: routing.route_topk(a, b, **opts))(logits, bias)
    assert len(head) == len(alone) == (3 if with_h else 2), (case, seed)
    for got, want in zip(head, alone):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), (case, seed)
    ex, wt = alone[:2]
    wbits = jax.lax.bitcast_convert_type(wt.reshape(-1), jnp.int32)
    own = block_routing.block_metadata(
        ex.reshape(-1), wbits, k=k, num_local=num_local, slots=S, block=im.BLOCK_M, group=group,
        interpret=True, share=share, layer=layer, counters=plan.counters,
    )  # fmt: skip
    xla = jax.tree.map(np.asarray, im.route_blocks(ex, wt, num_local, group, "xla", share, layer))
    n = S * im.BLOCK_M
    names = ("rows", "expert", "packed", "valid", "counters")
    for name, got, want in zip(names, outs, own):
        got, want = np.asarray(got), np.asarray(want)
        got, want = (got[:, :n], want[:, :n]) if name == "packed" else (got, want)
        np.testing.assert_array_equal(got, want, err_msg=f"{name}, {case}, seed {seed}")
        if name in xla:
            np.testing.assert_array_equal(got, xla[name].astype(got.dtype), err_msg=f"{name} vs XLA, {case}, {seed}")
    np.testing.assert_array_equal(np.asarray(outs[4]), np.zeros(plan.counters, np.int32), err_msg=f"{case} {seed}")
    meta = im.kernel_metadata(outs, wt, plan)
    for name in ("token", "assign", "weight", "weight_A"):
        np.testing.assert_array_equal(np.asarray(meta[name]), xla[name], err_msg=f"{name}, {case}, seed {seed}")
    assert im.num_slots(meta) == S and meta["valid"].dtype == jnp.bool_ and meta["plan"] == plan, case


def test_route_topk_with_blocks_takes_only_the_tokens_one_program_routes():
    from jaxspec.kernels import block_routing

    plan = block_routing.Plan(8, 4, 16, 1)
    b = jnp.zeros((16,), jnp.float32)
    most = routing.DEFAULT_CONFIG["fused_max_tokens"]
    T = most + 1
    with pytest.raises(
        ValueError, match=rf"blocks= serves 1..{most} tokens \(the fused_max_tokens config\), found T={T}"
    ):
        routing.route_topk(jnp.zeros((T, 16)), b, k=2, interpret=True, blocks=plan)
    with pytest.raises(ValueError, match="found T=0"):
        routing.route_topk(jnp.zeros((0, 16)), b, k=2, interpret=True, blocks=plan)
    with pytest.raises(ValueError, match="expert_layer= places the metadata that blocks= builds; found no blocks"):
        routing.route_topk(jnp.zeros((1, 16)), b, k=2, interpret=True, expert_layer=3)


def test_route_tokens_keeps_two_launches_where_the_fused_launchs_probe_fails(monkeypatch):
    """`model.route_tokens(blocks=...)` with the compiled kernel: where `routing.blocks_problem` reports a problem
    the routing runs alone and the metadata entry is None (the expert kernel builds its own); where it reports
    none the launch builds the metadata, recorded with its plan. Faked here: both probes answer, the kernel
    runs interpreted."""
    from jaxspec import model as model_mod
    from jaxspec.kernels import block_routing
    from jaxspec.kernels import int4_moe as im

    route_topk, calls = routing.route_topk, []

    def interpreted(*a, **kw):
        calls.append("blocks" in kw)
        return route_topk(*a, **{**kw, "interpret": True})

    monkeypatch.setattr(routing, "route_topk", interpreted)
    monkeypatch.setattr(routing, "available", lambda *a, **kw: None)
    monkeypatch.setitem(routing.DEFAULT_CONFIG, "fused_max_tokens", 8)  # the call's 3 tokens served
    cfg = _cfg(16, 4, 4, 2, True)
    logits = jnp.asarray(np.random.default_rng(_seed()).normal(size=(3, 16)), jnp.float32)
    bias = jnp.zeros((16,))
    plan = block_routing.Plan(8, im.num_block_slots(3, 4, 8), im.BLOCK_M, 1, 2, 0)
    monkeypatch.setattr(routing, "blocks_problem", lambda *a, **kw: "no device")
    out = model_mod.route_tokens(logits, bias, cfg, "kernel", blocks=plan)
    assert len(out) == 4 and out[2] is None and out[3] is None and calls == [False], (len(out), calls)
    monkeypatch.setattr(routing, "blocks_problem", lambda *a, **kw: None)
    e, w, h, meta = model_mod.route_tokens(logits, bias, cfg, "kernel", blocks=plan)
    assert calls == [False, True] and h is None and meta["plan"] == plan, calls
    np.testing.assert_array_equal(np.asarray(e), np.asarray(out[0]))
    with pytest.raises(ValueError, match="off a mesh only"):
        model_mod.route_tokens(logits, bias, cfg, "interpret", mesh=object(), blocks=plan)
