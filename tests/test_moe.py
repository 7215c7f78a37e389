"""The two routed-expert paths (decode-time gather-matvec, prefill-time grouped matmul) agree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints_convert import quant_np
from jaxspec import quant
from jaxspec.model import expert_ffn


@pytest.mark.parametrize("int4", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 12])
def test_gather_and_grouped_paths_agree(int4, tokens):
    rng = np.random.default_rng(tokens)
    E, D, F, k = 8, 64, 32, 3
    x = jnp.asarray(rng.normal(size=(tokens, D)), jnp.float32)
    experts = jnp.asarray(rng.integers(-2, E + 2, size=(tokens, k)), jnp.int32)  # some ids belong elsewhere
    weights = jnp.asarray(rng.uniform(size=(tokens, k)), jnp.float32)
    w = {}
    for name, (out, inn) in {"gate": (F, D), "up": (F, D), "down": (D, F)}.items():
        dense = rng.normal(size=(E, out, inn)).astype(np.float32) / np.sqrt(inn)
        if int4:
            packed, scale = zip(*(quant_np.quantize_int4_np(d) for d in dense))
            w[name] = quant.Int4Weight(jnp.asarray(np.stack(packed)), jnp.asarray(np.stack(scale).astype(np.float32)))
        else:
            w[name] = jnp.asarray(np.swapaxes(dense, 1, 2))
    gathered = expert_ffn(x, experts, weights, w, E, impl="gather")
    grouped = expert_ffn(x, experts, weights, w, E, impl="xla")
    np.testing.assert_allclose(np.asarray(gathered), np.asarray(grouped), rtol=1e-5, atol=1e-5)
    # Reference by hand: only in-range experts contribute.
    deq = {
        n: (np.asarray(w[n].dequant(jnp.float32)) if int4 else np.swapaxes(np.asarray(w[n]), 1, 2))
        for n in ("gate", "up", "down")
    }
    ref = np.zeros((tokens, D), np.float32)
    silu = lambda v: v / (1 + np.exp(-v))
    for t in range(tokens):
        for j in range(k):
            e = int(experts[t, j])
            if 0 <= e < E:
                h = silu(deq["gate"][e] @ np.asarray(x[t])) * (deq["up"][e] @ np.asarray(x[t]))
                ref[t] += float(weights[t, j]) * (deq["down"][e] @ h)
    np.testing.assert_allclose(np.asarray(gathered), ref, rtol=1e-4, atol=1e-4)


def test_int4_prefill_runs_in_chunks_and_matches_grouped():
    """INT4 calls with more assignments than experts run the gather path in chunks (no full dequant)."""
    rng = np.random.default_rng(7)
    E, D, F, k, T = 8, 64, 32, 3, 13
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    experts = jnp.asarray(rng.integers(0, E, size=(T, k)), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(T, k)), jnp.float32)
    w = {}
    for name, (out, inn) in {"gate": (F, D), "up": (F, D), "down": (D, F)}.items():
        packed, scale = zip(
            *(quant_np.quantize_int4_np(rng.normal(size=(out, inn)).astype(np.float32)) for _ in range(E))
        )
        w[name] = quant.Int4Weight(jnp.asarray(np.stack(packed)), jnp.asarray(np.stack(scale), jnp.float32))
    chunked = jax.jit(lambda *a: expert_ffn(*a, E, "gather"))(x, experts, weights, w)
    grouped = np.asarray(expert_ffn(x, experts, weights, w, E, impl="xla"))
    np.testing.assert_allclose(np.asarray(chunked), grouped, rtol=1e-4, atol=1e-5 * np.abs(grouped).max())


def test_int4_grouped_choice_at_kimi_size():
    """Kimi-K2.5 in bf16: on 8 devices a 512-token prefill chunk (4096 assignments) runs grouped over the
    48 local experts (4.2 GB dequantized); decode-sized calls keep the gather path; on one device the
    dequantized layer (34 GB) is over the limit, so everything gathers."""
    from jaxspec.config import preset
    from jaxspec.model import INT4_DEQUANT_LIMIT, choose_expert_impl, int4_grouped_wins

    cfg = preset("kimi-k2.5")
    assert cfg.expert_format is not None
    layer = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    assert 48 * layer <= INT4_DEQUANT_LIMIT < 384 * layer
    assert int4_grouped_wins(cfg, 512, 8, 2)
    assert [int4_grouped_wins(cfg, t, 8, 2) for t in (1, 8, 32)] == [False] * 3
    assert not int4_grouped_wins(cfg, 512, 1, 2)
    assert not int4_grouped_wins(cfg.replace(expert_format=None), 512, 8, 2)
    # The MoE layer's one choice (rows layout: the kernel is not in play) follows it.
    choose = lambda t, shards: choose_expert_impl(cfg, quant.ROWS, t, shards, jnp.bfloat16)
    assert choose(512, 8) == "xla"
    assert [choose(t, 8) for t in (1, 8, 32)] == ["gather"] * 3
    assert choose(512, 1) == "gather"


def test_expert_impl_choice_is_made_in_one_place_and_forced_from_one_setting():
    """`choose_expert_impl`: tiles -> the kernel; unquantized -> gather while the assignments fit the
    local experts, grouped beyond; a forced choice wins, and one that does not suit the layout is an
    error naming the setting."""
    from jaxspec.config import preset
    from jaxspec.model import choose_expert_impl, expert_layout

    cfg = preset("kimi-k2.5")
    bf16 = cfg.replace(expert_format=None)
    assert choose_expert_impl(cfg, quant.TILES, 1, 8, jnp.bfloat16) == "kernel"
    assert choose_expert_impl(cfg, quant.TILES, 512, 8, jnp.bfloat16, "interpret") == "interpret"
    assert choose_expert_impl(bf16, quant.ROWS, 6, 8, jnp.bfloat16) == "gather"  # 48 assignments, 48 local
    assert choose_expert_impl(bf16, quant.ROWS, 7, 8, jnp.float32) == "xla"  # tokamax takes no float32
    for forced in ("gather", "xla", "tokamax"):
        assert choose_expert_impl(cfg, quant.ROWS, 1, 8, jnp.bfloat16, forced) == forced
    with pytest.raises(ValueError, match="expert_impl='xla'.*tiles"):
        choose_expert_impl(cfg, quant.TILES, 1, 8, jnp.bfloat16, "xla")
    with pytest.raises(ValueError, match="expert_impl='kernel' needs the experts in the kernel's tiles layout"):
        choose_expert_impl(cfg, quant.ROWS, 1, 8, jnp.bfloat16, "kernel")
    with pytest.raises(ValueError, match="expert_impl: expected None .* found 'fast'"):
        choose_expert_impl(cfg, quant.ROWS, 1, 8, jnp.bfloat16, "fast")
    # The layout: the kernel's where it runs (never on this CPU), forced by 'interpret' / 'kernel'.
    assert expert_layout(cfg) == (quant.TILES if jax.default_backend() == "gpu" else quant.ROWS)
    assert expert_layout(cfg, "interpret") == quant.TILES
    assert expert_layout(cfg, "gather") == quant.ROWS
    with pytest.raises(ValueError, match="expert_impl='interpret': the routed experts are not INT4"):
        expert_layout(bf16, "interpret")


def test_abstract_params_are_traced_once_per_config_and_each_call_gets_its_own_copy():
    """Loading an engine asks for the abstract tree two or three times: the trace is made once per (config,
    dtype, layout), and a caller that edits its tree leaves the next caller's alone."""
    from jaxspec.config import preset
    from jaxspec.model import _abstract_params, abstract_params

    cfg = preset("kimi-k2.5", num_layers=3)
    _abstract_params.cache_clear()  # the counts below, whatever this process traced before
    first = abstract_params(cfg, jnp.bfloat16)
    misses = _abstract_params.cache_info().misses
    assert misses == 1
    again = abstract_params(cfg, "bfloat16")  # the same dtype by another name
    assert _abstract_params.cache_info().misses == misses
    assert jax.tree.structure(first) == jax.tree.structure(again)
    assert all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(*map(jax.tree.leaves, (first[0], again[0]))))
    first[0]["layers"].pop("moe")
    first[1]["layers"]["attn"] = None
    fresh = abstract_params(cfg, jnp.bfloat16)
    assert "moe" in fresh[0]["layers"] and fresh[1]["layers"]["attn"] is not None
    assert jax.tree.structure(fresh) == jax.tree.structure(again)
    other = abstract_params(cfg, jnp.float32)[0]["layers"]["moe"]["gate"].scale.dtype
    assert other == jnp.float32 and _abstract_params.cache_info().misses == misses + 1


def test_int4_parameters_keep_the_model_dtype():
    """The INT4 scales are made in the model's dtype (bf16 scales are Kimi's own; float32 scales would
    double the scale bytes every decode step reads): words int32, scales the compute dtype."""
    from jaxspec.config import preset
    from jaxspec.model import abstract_params

    cfg = preset("kimi-k2.5", num_layers=3)
    for dtype in (jnp.bfloat16, jnp.float32):
        moe = abstract_params(cfg, dtype)[0]["layers"]["moe"]
        for name in ("gate", "up", "down"):
            assert quant.is_int4(moe[name]) and moe[name].group_size == 32
            assert (moe[name].packed.dtype, moe[name].scale.dtype) == (jnp.int32, dtype), name
    tiles = abstract_params(cfg, jnp.bfloat16, quant.TILES)[0]["layers"]["moe"]["gate"]
    assert tiles.layout == quant.TILES and tiles.packed.shape == (2, 384, 7168 // 256, 2048, 32)
