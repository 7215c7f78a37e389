"""The fused INT4 expert kernel inside the model (Pallas interpret mode on the CPU).

On a GPU the engine runs INT4 routed experts through `jaxspec.kernels.int4_moe` (each
used expert read once per call, however many tokens route to it); here the same
layout and arithmetic run in interpret mode (`expert_impl="interpret"`) and are
checked against the portable per-assignment path, and for batch invariance: a token's
expert output is the same bits whichever tokens share its experts, so a verify row
equals the decode step for the same token.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import eqns

from jaxspec import demo, quant
from jaxspec.engine import Engine
from jaxspec.kernels import int4_moe
from jaxspec.model import abstract_params, expert_ffn, per_layer, route, to_kernel_layout
from jaxspec.spec import SpecConfig


@pytest.fixture(scope="module")
def pair():
    path = demo.ensure_converted(progress=False, log=lambda m: None)  # the user cache's copy, shared
    return Engine.load(path, dtype="float32", expert_impl="gather"), Engine.load(
        path, dtype="float32", expert_impl="interpret"
    )


def test_kernel_layout_is_loaded_and_the_model_agrees_with_the_portable_path(pair):
    portable, kernel = pair
    assert kernel.expert_layout == quant.TILES and portable.expert_layout == quant.ROWS
    moe = kernel.params["layers"]["moe"]
    assert all(quant.is_int4(moe[n]) and moe[n].layout == quant.TILES for n in int4_moe.PROJECTIONS)
    assert moe["gate"].packed.dtype == jnp.int32 and moe["gate"].scale.dtype == jnp.int32
    assert portable.params["layers"]["moe"]["gate"].layout == quant.ROWS
    shapes, _ = abstract_params(kernel.cfg, jnp.float32, quant.TILES)
    assert jax.tree.map(lambda s: s.shape, shapes) == jax.tree.map(lambda a: a.shape, kernel.params)
    ids = np.random.default_rng().integers(0, kernel.cfg.vocab_size, size=40).tolist()
    a, b = portable.target_logits(ids), kernel.target_logits(ids)
    assert np.abs(a - b).max() / np.abs(a).max() < 1e-5


def test_speculative_greedy_through_the_kernel_equals_plain(pair):
    portable, kernel = pair
    prompts = [
        kernel.tokenizer.encode('def read_lines(path):\n    """Return the lines."""\n'),
        kernel.tokenizer.encode("import os\n\n\ndef main(argv):\n"),
    ]
    plain = [r.tokens for r in portable.generate(prompts, 24)]
    res = kernel.generate(prompts, 24, spec=SpecConfig(3, 1, 4))
    assert [r.tokens for r in res] == plain
    assert np.mean([r.stats["mean_accept_len"] for r in res]) >= 2.0  # the demo draft is good: equality is tested


def test_verify_row_equals_the_decode_step_bit_for_bit(pair):
    """A token's routed-expert output through the model's expert dispatch (kernel layout, float32, the demo's
    experts, real routing) is the same bits alone (a decode step) and among tokens that share its experts (a
    verify over tree tokens). The router and the shared expert are dense matmuls whose rounding may depend on
    the row count on the CPU; the kernel's part does not."""
    _, kernel = pair
    cfg = kernel.cfg
    layer = per_layer(cfg, kernel.params)[f"layers_{cfg.first_k_dense_replace}"]["moe"]
    ops = {k: layer[k] for k in int4_moe.PROJECTIONS}
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(13, cfg.hidden_size)), jnp.float32)
    experts, weights = route(x @ layer["router"], layer["router_bias"], cfg)
    experts = experts.at[3].set(experts[0]).at[9].set(experts[0])  # tokens 0, 3, 9 share all their experts
    run = jax.jit(lambda o, v, e, w: expert_ffn(v, e, w, o, cfg.num_experts, "interpret"))
    batch = np.asarray(run(ops, x, experts, weights))
    for t in (0, 3, 9, 12):
        alone = np.asarray(run(ops, x[t : t + 1], experts[t : t + 1], weights[t : t + 1]))
        np.testing.assert_array_equal(alone[0], batch[t], err_msg=f"token {t}")
    portable = per_layer(cfg, pair[0].params)[f"layers_{cfg.first_k_dense_replace}"]["moe"]
    ref = np.asarray(expert_ffn(x, experts, weights, portable, cfg.num_experts, "gather"))
    assert np.abs(batch - ref).max() / np.abs(ref).max() < 1e-5


def test_relayout_for_the_kernel_is_lossless(pair):
    portable, kernel = pair
    tiles = kernel.params["layers"]["moe"]
    back = jax.vmap(int4_moe.restore)({k: tiles[k] for k in int4_moe.PROJECTIONS})
    orig = portable.params["layers"]["moe"]
    for name, w in back.items():
        for field in quant.Int4Weight.LEAVES:
            value, ref = getattr(w, field), getattr(orig[name], field)
            np.testing.assert_array_equal(
                np.asarray(value), np.asarray(ref.astype(value.dtype)), err_msg=f"{name}.{field}"
            )
    again = to_kernel_layout(portable.cfg, portable.params)["layers"]["moe"]
    np.testing.assert_array_equal(np.asarray(again["down"].packed), np.asarray(tiles["down"].packed))
    np.testing.assert_array_equal(np.asarray(again["down"].scale), np.asarray(tiles["down"].scale))


def test_stacked_layers_route_over_one_layers_experts(pair):
    """Inside the scan over layers the kernels read every layer's experts in place as one [L*E] array, but
    the routing metadata and the kernels' block slots follow one layer's E experts (not L*E: at 61 layers
    that was 61x wider metadata and up to 4x the block slots at a batch-8 verify); the output is layer l's,
    bit for bit as with that layer's experts alone."""
    _, kernel = pair
    cfg = kernel.cfg
    stacked = {k: kernel.params["layers"]["moe"][k] for k in int4_moe.PROJECTIONS}
    n_layers = stacked["gate"].packed.shape[0]
    assert n_layers >= 2, n_layers
    E, T = cfg.num_experts, 11
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(T, cfg.hidden_size)), jnp.float32)
    experts = jnp.asarray(
        np.stack([rng.choice(E, cfg.num_experts_per_tok, replace=False) for _ in range(T)]), jnp.int32
    )
    weights = jnp.asarray(rng.uniform(0.1, 1.0, experts.shape), jnp.float32)
    run = jax.jit(lambda o, v, e, w, layer: expert_ffn(v, e, w, o, E, "interpret", layer=layer))
    grids = [
        eq.params["grid_mapping"].grid
        for eq in eqns(jax.make_jaxpr(run)(stacked, x, experts, weights, jnp.int32(1)).jaxpr)
        if eq.primitive.name == "pallas_call" and eq.params.get("name") in ("int4_moe_gate_up", "int4_moe_down")
    ]
    slots = int4_moe.num_block_slots(T, cfg.num_experts_per_tok, E, 1)
    assert len(grids) == 2 and all(g[1] == slots for g in grids), (grids, slots)  # tile-major: (tiles, slots)
    layer = n_layers - 1
    one = {k: jax.tree.map(lambda a: a[layer], v) for k, v in stacked.items()}
    alone = np.asarray(jax.jit(lambda o, v, e, w: expert_ffn(v, e, w, o, E, "interpret"))(one, x, experts, weights))
    np.testing.assert_array_equal(np.asarray(run(stacked, x, experts, weights, jnp.int32(layer))), alone)


@pytest.mark.parametrize("at_limit", [False, True])
def test_a_small_calls_metadata_is_built_in_the_routing_launch(pair, monkeypatch, at_limit):
    """Up to the routing kernel's `fused_max_tokens` config the MoE layer's routing kernel also builds the expert
    kernels' routing metadata (`route_topk_blocks`: no `route_topk` and no `int4_moe_blocks` launch), and the logits
    are the same bits as with the metadata program in its own launch (the limit set to 0). Past the limit the
    two launches stay. One token (a batch-1 decode step's call) and the limit's count."""
    from jaxspec.engine import _full_forward
    from jaxspec.kernels import routing

    _, kernel = pair
    rng = np.random.default_rng()
    T = routing.DEFAULT_CONFIG["fused_max_tokens"] if at_limit else 1
    tokens = jnp.asarray(rng.integers(0, kernel.cfg.vocab_size, size=(1, T)), jnp.int32)
    cache = kernel.init_cache(1, 16)

    def run(toks):
        names = [
            eq.params.get("name")
            for eq in eqns(jax.make_jaxpr(lambda t: _full_forward(kernel.model, kernel.params, t, cache))(toks).jaxpr)
            if eq.primitive.name == "pallas_call"
        ]
        logits = np.asarray(jax.jit(lambda t: _full_forward(kernel.model, kernel.params, t, cache))(toks))
        return {n: names.count(n) for n in ("route_topk_blocks", "route_topk", "int4_moe_blocks")}, logits

    fused, logits = run(tokens)
    assert fused["route_topk_blocks"] >= 1 and fused["route_topk"] == fused["int4_moe_blocks"] == 0, fused
    monkeypatch.setitem(routing.DEFAULT_CONFIG, "fused_max_tokens", 0)
    jax.clear_caches()  # the forward's inner jits were traced with the limit as it was
    apart, want = run(tokens)
    assert apart["route_topk_blocks"] == 0 and apart["route_topk"] == apart["int4_moe_blocks"] >= 1, apart
    np.testing.assert_array_equal(logits, want)
    monkeypatch.undo()
    jax.clear_caches()
    if at_limit:
        longer = jnp.concatenate([tokens, tokens[:, :1]], axis=1)  # one token past the limit
        past, _ = run(longer)
        assert past["route_topk_blocks"] == 0 and past["route_topk"] == past["int4_moe_blocks"] >= 1, past
