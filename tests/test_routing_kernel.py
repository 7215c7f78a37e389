"""jaxspec.kernels.routing (Pallas interpret mode on the CPU) against transformers' DeepseekV3TopkRouter,
the model's XLA routing and lax.top_k; and inside the model.

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

from jaxspec.kernels import routing
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
    routing.available.cache_clear()
    im.metadata_problem.cache_clear()
    im._probe.cache_clear()
    answers = {}

    def step(x):
        answers["routing"] = routing.available(32, 4, 4, 2, True, 2.5)
        answers["routing_kimi"] = routing.available(384, 8, 1, 1, True, 2.827)
        answers["metadata"] = im.metadata_problem(12)
        answers["experts"] = im._probe(interpret=True)  # the expert kernel's own probe call
        return x + 1

    try:
        jax.jit(step).lower(jnp.zeros(3))
        assert answers == {"routing": None, "routing_kimi": None, "metadata": None, "experts": None}, answers
    finally:  # the real answers (no GPU here) for the rest of the session
        routing.available.cache_clear()
        im.metadata_problem.cache_clear()
        im._probe.cache_clear()
