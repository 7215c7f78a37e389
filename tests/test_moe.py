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
            w[name + "_packed"], w[name + "_scale"] = (
                jnp.asarray(np.stack(packed)),
                jnp.asarray(np.stack(scale).astype(np.float32)),
            )
        else:
            w[name] = jnp.asarray(np.swapaxes(dense, 1, 2))
    gathered = expert_ffn(x, experts, weights, w, E, int4, impl="gather")
    grouped = expert_ffn(x, experts, weights, w, E, int4, impl="xla")
    np.testing.assert_allclose(np.asarray(gathered), np.asarray(grouped), rtol=1e-5, atol=1e-5)
    # Reference by hand: only in-range experts contribute.
    deq = {
        n: (
            np.asarray(quant.dequant_int4(w[n + "_packed"], w[n + "_scale"], jnp.float32))
            if int4
            else np.swapaxes(np.asarray(w[n]), 1, 2)
        )
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
        w[name + "_packed"], w[name + "_scale"] = (
            jnp.asarray(np.stack(packed)),
            jnp.asarray(np.stack(scale), jnp.float32),
        )
    auto = jax.jit(lambda *a: expert_ffn(*a, E, True))(x, experts, weights, w)
    grouped = np.asarray(expert_ffn(x, experts, weights, w, E, True, impl="xla"))
    np.testing.assert_allclose(np.asarray(auto), grouped, rtol=1e-4, atol=1e-5 * np.abs(grouped).max())


def test_int4_grouped_choice_at_kimi_size():
    """Kimi-K2.5 in bf16: on 8 devices a 512-token prefill chunk (4096 assignments) runs grouped over the
    48 local experts (4.2 GB dequantized); decode-sized calls keep the gather path; on one device the
    dequantized layer (34 GB) is over the limit, so everything gathers."""
    from jaxspec.config import preset
    from jaxspec.model import INT4_DEQUANT_LIMIT, int4_grouped_impl

    cfg = preset("kimi-k2.5")
    assert cfg.expert_format is not None
    layer = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    assert 48 * layer <= INT4_DEQUANT_LIMIT < 384 * layer
    assert int4_grouped_impl(cfg, 512, 8, 2) == "xla"
    assert [int4_grouped_impl(cfg, t, 8, 2) for t in (1, 8, 32)] == [None] * 3
    assert int4_grouped_impl(cfg, 512, 1, 2) is None
    assert int4_grouped_impl(cfg.replace(expert_format=None), 512, 8, 2) is None
