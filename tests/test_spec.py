"""Speculative decoding is lossless, batched correctly, and runs without host round trips."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spec_pair

from jaxspec.engine import Engine
from jaxspec.spec import SpecConfig

CONFIGS = [
    SpecConfig(3, 1, 4),
    SpecConfig(5, 1, 6),
    SpecConfig(1, 1, 2),
    SpecConfig(2, 2, 4),
    SpecConfig(3, 2, 6),
    SpecConfig(4, 3, 8),
]


@pytest.fixture(scope="module")
def trained():
    """Target and a fully trained draft on a deterministic successor corpus."""
    engine, corpus, *_ = spec_pair.train_pair(p_main=1.0)
    return engine, corpus


@pytest.fixture(scope="module")
def noisy():
    """Target trained on a 70/30 branching corpus; draft trained briefly, so it is often wrong."""
    engine, corpus, *_ = spec_pair.train_pair(p_main=0.7, draft_steps=60, seed=1)
    return engine, corpus


def prompts_of(corpus, lengths, seed):
    rng = np.random.default_rng(seed)
    return [corpus.sample(1, n)[0].tolist() for n in lengths] if rng else None


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.num_steps}-{c.topk}-{c.num_draft_tokens}")
def test_greedy_lossless_high_acceptance(trained, cfg):
    engine, corpus = trained
    prompts = prompts_of(corpus, [3, 9, 5, 12], seed=0)
    plain = [r.tokens for r in engine.generate(prompts, 24)]
    for batch in ([prompts[0]], prompts):  # batch 1 and batch 4 with mixed prompt lengths
        res = engine.generate(batch, 24, spec=cfg)
        assert [r.tokens for r in res] == plain[: len(batch)]
        mean_accept = np.mean([r.stats["mean_accept_len"] for r in res])
        assert mean_accept >= min(2.0, cfg.num_steps + 1) and mean_accept >= 0.8 * (cfg.num_steps + 1)


@pytest.mark.parametrize(
    "cfg",
    [SpecConfig(3, 1, 4), SpecConfig(3, 2, 6), SpecConfig(4, 3, 8)],
    ids=lambda c: f"{c.num_steps}-{c.topk}-{c.num_draft_tokens}",
)
def test_greedy_lossless_with_rejections(noisy, cfg):
    """A weaker draft: cycles end in rejections, trees accept off-chain nodes; output is unchanged."""
    engine, corpus = noisy
    prompts = prompts_of(corpus, [4, 7, 10, 6, 3], seed=1)
    plain = [r.tokens for r in engine.generate(prompts, 32)]
    res = engine.generate(prompts, 32, spec=cfg)
    assert [r.tokens for r in res] == plain
    lengths = np.concatenate([r.stats["accept_lengths"] for r in res])
    assert lengths.min() < cfg.num_steps + 1  # rejections happened
    assert lengths.mean() >= 2.0


def test_batch_equals_single(noisy):
    """A batch of 4 and each of its prompts alone: the shapes (batch 4 and 1, 24 new tokens, prompts of up to 16
    tokens) and the setting of test_greedy_lossless_high_acceptance[3-2-6], whose compiled programs serve them."""
    engine, corpus = noisy
    prompts = prompts_of(corpus, [3, 11, 6, 9], seed=2)
    cfg = SpecConfig(3, 2, 6)
    together = engine.generate(prompts, 24, spec=cfg)
    for p, r in zip(prompts, together):
        alone = engine.generate([p], 24, spec=cfg)[0]
        assert r.tokens == alone.tokens
        assert r.stats["accept_lengths"] == alone.stats["accept_lengths"]


def test_chunked_prefill_gives_the_same_generation(noisy):
    """Prompts of 3..17 tokens prefilled 4 at a time (target and draft extend): plain and
    speculative outputs and per-cycle acceptance equal a whole-prompt prefill."""
    engine, corpus = noisy
    prompts = prompts_of(corpus, [3, 17, 6, 11], seed=3)
    cfg = SpecConfig(3, 2, 6)
    whole_plain = [r.tokens for r in engine.generate(prompts, 16)]
    whole_spec = engine.generate(prompts, 16, spec=cfg)
    default, engine.prefill_chunk = engine.prefill_chunk, 4
    try:
        assert [r.tokens for r in engine.generate(prompts, 16)] == whole_plain
        chunked = engine.generate(prompts, 16, spec=cfg)
    finally:
        engine.prefill_chunk = default
    assert [r.tokens for r in chunked] == [r.tokens for r in whole_spec] == whole_plain
    assert [r.stats["accept_lengths"] for r in chunked] == [r.stats["accept_lengths"] for r in whole_spec]


def test_eos_and_budget_per_row(trained):
    engine, corpus = trained
    prompts = prompts_of(corpus, [4, 8], seed=3)
    full = [r.tokens for r in engine.generate(prompts, 20)]
    stop = full[0][5]
    eng = Engine(dataclasses.replace(engine.cfg, eos_token_id=stop), engine.params, None, "float32")
    eng.draft = engine.draft
    res = eng.generate(prompts, 20, spec=SpecConfig(3, 1, 4))
    for f, r in zip(full, res):
        expect = f[: f.index(stop) + 1] if stop in f else f
        assert r.tokens == expect
    assert len(res[0].tokens) <= 6 < len(res[1].tokens) or stop in full[1]
    short = engine.generate(prompts, 7, spec=SpecConfig(5, 1, 6))  # budget cuts a cycle's tokens
    assert [r.tokens for r in short] == [f[:7] for f in full]


def test_stats_are_consistent(trained):
    engine, corpus = trained
    # 24 new tokens, batch 1: the shapes of test_greedy_lossless_high_acceptance[3-1-4], whose programs serve these.
    (r,) = engine.generate(prompts_of(corpus, [5], seed=4), 24, spec=SpecConfig(3, 1, 4))
    s = r.stats
    assert s["cycles"] == len(s["accept_lengths"]) == sum(s["accept_histogram"])
    # the first token comes from prefill; every cycle then emits accepted + bonus tokens
    assert 1 + sum(s["accept_lengths"]) >= s["new_tokens"] == 24
    assert s["mean_accept_len"] == pytest.approx(np.mean(s["accept_lengths"]))
    assert "compiled_tokens_per_second" not in s  # one loop call: no compiled-only rate to report
    # Streaming runs the loop in chunks: the rate after the first (compiling) chunk is reported too. A cycle emits at
    # most 4 tokens, so the 23 after the first take at least 6 cycles: two chunks of 4 or more (STREAM_STEPS).
    seen = []
    (r,) = engine.generate(prompts_of(corpus, [5], seed=4), 24, spec=SpecConfig(3, 1, 4), on_tokens=seen.append)
    s = r.stats
    assert len(seen) >= 2 and r.tokens == seen[-1][0]
    assert 0 < s["first_chunk_seconds"] <= s["seconds"] and s["compiled_tokens_per_second"] > 0


def test_chunk_runs_without_host_transfers(trained):
    """A chunk of cycles is one compiled while_loop: no host<->device copies inside it."""
    engine, corpus = trained
    cfg, max_new = SpecConfig(3, 2, 6), 16
    ids = prompts_of(corpus, [5, 7], seed=5)
    chunk = jnp.int32(3)
    engine.prepare(ids, max_new, spec=cfg, stop_ids=[-1]).run(chunk)  # compile
    session = engine.prepare(ids, max_new, spec=cfg, stop_ids=[-1])
    jax.block_until_ready(session.state)
    with jax.transfer_guard("disallow"):
        state = session.run(chunk).state
        jax.block_until_ready(state)
    assert int(state.cycles) == 3


def test_draft_logits_predict_the_target(trained):
    """engine.draft_logits row t predicts the token at t+2 (the target's greedy choice)."""
    engine, corpus = trained
    ids = corpus.sample(1, 20)[0].tolist()
    logits = engine.draft_logits(ids)
    assert logits.shape == (19, engine.draft.cfg.draft_vocab_size)
    d2t = np.asarray(engine.draft.d2t)
    pred = np.argmax(logits, -1)
    pred_target = pred + d2t[pred]
    assert np.mean(pred_target[:-1] == np.asarray(ids[2:])) > 0.9


def test_speculative_requires_a_draft(trained):
    engine, _ = trained
    bare = Engine(engine.cfg, engine.params, None, "float32")
    with pytest.raises(ValueError, match="--draft"):
        bare.generate([[9, 10]], 4, spec=SpecConfig())
