"""The JAX target against transformers' DeepseekV3ForCausalLM (CPU, fp32).

Each variant is saved by transformers, converted by our converter, loaded by the
engine; logits must match for the full forward and for prefill + cached decode
at every position of a batch that mixes prompt lengths.
"""

import hf_models
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints_convert.convert import convert
from jaxspec import decode
from jaxspec.engine import Engine
from jaxspec.model import Transformer, init_cache

RTOL = 1e-4


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def assert_close(ours, ref, what):
    err = rel_err(ours, ref)
    assert err < RTOL, f"{what}: relative error {err:.2e}"
    np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=1e-4 * np.abs(ref).max(), err_msg=what)


@pytest.fixture(scope="module", params=sorted(hf_models.VARIANTS))
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf_dir, out = str(root / "hf"), str(root / "jaxspec")
    model = hf_models.build(hf_dir, seed=1, **hf_models.VARIANTS[request.param])
    if request.param == "groups":
        hf_models.wrap_as_kimi(hf_dir)  # also exercises the Kimi-K2.5 wrapper layout
    convert(hf_dir, out, dtype="float32", progress=False)
    return request.param, model, Engine.load(out, dtype="float32")


def test_full_forward_matches_transformers(pair):
    name, hf, engine = pair
    rng = np.random.default_rng(0)
    ids = rng.integers(0, engine.cfg.vocab_size, size=23).tolist()
    assert_close(engine.target_logits(ids), hf_models.hf_logits(hf, ids), f"{name} full forward")


def test_cached_decode_every_position(pair):
    """Batch of 3 rows, prompt lengths 3/7/5; then one token per step up to each row's end."""
    name, hf, engine = pair
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, engine.cfg.vocab_size, size=n).tolist() for n in (12, 15, 10)]
    prompt_lens = np.array([3, 7, 5], np.int32)
    refs = [hf_models.hf_logits(hf, s) for s in seqs]
    B, S = len(seqs), 32
    prompt = np.zeros((B, 8), np.int32)
    for b, s in enumerate(seqs):
        prompt[b, : prompt_lens[b]] = s[: prompt_lens[b]]
    cache = init_cache(engine.cfg, B, S, jnp.float32)
    last, cache, _ = decode.prefill(engine.model, engine.params, jnp.asarray(prompt), jnp.asarray(prompt_lens), cache)
    for b in range(B):
        assert_close(np.asarray(last[b]), refs[b][prompt_lens[b] - 1], f"{name} prefill row {b}")
    step = jax.jit(lambda p, t, pos, c: decode.forward(engine.model, p, t, pos, c))
    pos = prompt_lens.copy()
    for _ in range(max(len(s) for s in seqs) - prompt_lens.min()):
        toks = np.array([[s[min(p, len(s) - 1)]] for s, p in zip(seqs, pos)], np.int32)
        logits, cache, _ = step(engine.params, jnp.asarray(toks), jnp.asarray(pos[:, None]), cache)
        for b, s in enumerate(seqs):
            if pos[b] < len(s):
                assert_close(np.asarray(logits[b, 0]), refs[b][pos[b]], f"{name} row {b} position {pos[b]}")
        pos = pos + 1


def test_chunked_prefill_matches_transformers_and_whole_prefill(pair):
    """Prefill in chunks of 3 (prompt padded to 8, so the last chunk is part padding): last-token
    logits match HF; cache entries and captured aux states equal a whole-prompt prefill."""
    name, hf, engine = pair
    rng = np.random.default_rng(4)
    lens = np.array([8, 2, 6], np.int32)
    seqs = [rng.integers(0, engine.cfg.vocab_size, size=n).tolist() for n in lens]
    prompt = np.zeros((3, 8), np.int32)
    for b, s in enumerate(seqs):
        prompt[b, : len(s)] = s
    capture = (0, 1)
    run = lambda chunk: decode.prefill(
        engine.model,
        engine.params,
        jnp.asarray(prompt),
        jnp.asarray(lens),
        init_cache(engine.cfg, 3, 16, jnp.float32),
        capture,
        chunk=chunk,
    )
    last, cache, aux = run(3)
    whole_last, whole_cache, whole_aux = run(0)
    for b, s in enumerate(seqs):
        assert_close(np.asarray(last[b]), hf_models.hf_logits(hf, s)[-1], f"{name} chunked prefill row {b}")
        n = lens[b]
        np.testing.assert_allclose(np.asarray(aux[b, :n]), np.asarray(whole_aux[b, :n]), rtol=1e-5, atol=1e-5)
        for layer, whole in zip(cache.latent, whole_cache.latent):
            np.testing.assert_allclose(np.asarray(layer[b, :n]), np.asarray(whole[b, :n]), rtol=1e-5, atol=1e-5)
    assert aux.shape == whole_aux.shape


def test_aux_hidden_capture(pair):
    """Captured layer i equals HF's hidden_states[i + 1] (the output of decoder layer i)."""
    name, hf, engine = pair
    ids = list(range(3, 14))
    hidden = hf_models.hf_hidden_states(hf, ids)
    T = len(ids)
    cache = init_cache(engine.cfg, 1, 16, jnp.float32)
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    capture = (0, 1)
    _, _, aux = decode.forward(engine.model, engine.params, jnp.asarray([ids]), positions, cache, capture)
    D = engine.cfg.hidden_size
    for j, layer in enumerate(capture):
        assert_close(np.asarray(aux[0, :, j * D : (j + 1) * D]), hidden[layer + 1], f"{name} aux layer {layer}")


def test_gathered_expert_path_matches_transformers(pair):
    """The decode-time expert path (fused gather-matvec per assignment) on a whole sequence."""
    name, hf, engine = pair
    model = Transformer(engine.cfg, jnp.float32, expert_impl="gather")
    ids = np.random.default_rng(3).integers(0, engine.cfg.vocab_size, size=17)
    T = len(ids)
    cache = init_cache(engine.cfg, 1, T, jnp.float32)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    logits, _, _ = decode.forward(model, engine.params, jnp.asarray(ids[None], jnp.int32), pos, cache)
    assert_close(np.asarray(logits[0]), hf_models.hf_logits(hf, ids.tolist()), f"{name} gathered experts")


def test_bfloat16_model_gives_float32_logits(pair):
    """Logits leave the lm_head matmul in float32, not rounded to bfloat16's grid (1/16 apart at
    magnitude 8-16, where greedy argmax would tie and resolve by rounding)."""
    from jaxspec.training import target_forward

    name, hf, engine = pair
    to_bf16 = lambda a: a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a
    params = jax.tree.map(to_bf16, engine.params)
    ids = np.random.default_rng(3).integers(0, engine.cfg.vocab_size, size=(1, 11)).astype(np.int32)
    logits, _ = target_forward(Transformer(engine.cfg, jnp.bfloat16), params, jnp.asarray(ids))
    logits = np.asarray(logits[0])
    assert logits.dtype == np.float32
    on_grid = logits == logits.astype(jnp.bfloat16).astype(np.float32)
    assert on_grid.mean() < 0.5, f"{name}: {on_grid.mean():.0%} of the logits sit on the bfloat16 grid"
    # And still the same model. In bfloat16 a near-tie in expert selection flips an expert now and then, so
    # one prompt's error is bimodal (about 0.02, or 0.1-0.4 after a flip): judge the median of 12 prompts.
    more = np.random.default_rng(4).integers(0, engine.cfg.vocab_size, size=(11, 11)).astype(np.int32)
    batch = np.concatenate([ids, more])
    bf16, _ = target_forward(Transformer(engine.cfg, jnp.bfloat16), params, jnp.asarray(batch))
    errs = [rel_err(np.asarray(bf16[b]), engine.target_logits(batch[b].tolist())) for b in range(len(batch))]
    assert np.median(errs) < 0.05, errs
