"""Sampled speculative decoding reproduces the target's exact sequence distribution.

A target with a 16-token vocabulary is trained on a branching Markov corpus (so its
next-token distributions are genuinely spread); a draft is trained on it. The exact
probability of every 3-token continuation under the target (temperature, top-p
filtering included) is enumerated with the target itself; thousands of speculative
samples drawn in one batch must match it by a chi-square test. The same test must
reject a sampler whose acceptance rule is deliberately wrong.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spec_pair

from jaxspec import spec, training
from jaxspec.sampling import SamplingParams, target_probs
from jaxspec.spec import SpecConfig

N_SAMPLES, N_NEW = 3000, 3
SP = SamplingParams(temperature=0.8, top_p=0.95)


@pytest.fixture(scope="module")
def setup():
    engine, corpus, *_ = spec_pair.train_pair(vocab=16, p_main=0.6, target_steps=150, draft_steps=80, seed=2)
    prompt = corpus.sample(1, 4)[0].tolist()
    return engine, prompt, exact_distribution(engine, prompt)


def exact_distribution(engine, prompt):
    """{(x1, x2, x3): probability} under the target's filtered sampling distribution."""
    V = engine.cfg.vocab_size
    pairs = np.array(list(itertools.product(range(V), repeat=2)), np.int32)
    seqs = np.concatenate([np.tile(prompt, (len(pairs), 1)), pairs], axis=1)
    logits, _ = jax.jit(training.target_forward, static_argnums=0)(engine.model, engine.params, jnp.asarray(seqs))
    P = len(prompt)
    probs = np.asarray(target_probs(logits[:, P - 1 : P + 2], SP), np.float64)  # [V*V, 3, V]
    dist = {}
    for row, (a, b) in enumerate(pairs):
        p_ab = probs[row, 0, a] * probs[row, 1, b]
        if p_ab == 0:
            continue
        for c in np.nonzero(probs[row, 2])[0]:
            dist[(int(a), int(b), int(c))] = p_ab * probs[row, 2, c]
    total = sum(dist.values())
    assert abs(total - 1) < 1e-4
    return dist


def chi_square_pvalue(samples, dist):
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    big = [k for k, p in dist.items() if p * n >= 5]
    observed = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    expected = [dist[k] * n for k in big] + [n * (1 - sum(dist[k] for k in big))]
    if expected[-1] < 5:  # fold a tiny remainder into the last real bin
        observed[-2] += observed.pop()
        expected[-2] += expected.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(expected) - 1
    # Wilson-Hilferty approximation of the chi-square upper tail.
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2)), len(expected)


def draw(engine, prompt, cfg, seed):
    res = engine.generate([prompt] * N_SAMPLES, N_NEW, temperature=SP.temperature, top_p=SP.top_p, seed=seed, spec=cfg)
    return [tuple(r.tokens) for r in res], np.mean([r.stats["mean_accept_len"] for r in res])


@pytest.mark.parametrize("cfg", [SpecConfig(2, 2, 4), SpecConfig(3, 1, 4)], ids=["tree-2-2-4", "chain-3-1-4"])
def test_speculative_sampling_matches_target_distribution(setup, cfg):
    engine, prompt, dist = setup
    samples, accept = draw(engine, prompt, cfg, seed=0)
    assert accept >= 1.5, accept  # the draft proposes plausible tokens: acceptance means something
    p, bins = chi_square_pvalue(samples, dist)
    assert bins >= 6
    assert p > 1e-3, f"speculative samples deviate from the target distribution (p={p:.2e})"


def test_plain_sampling_matches_target_distribution(setup):
    engine, prompt, dist = setup
    res = engine.generate([prompt] * N_SAMPLES, N_NEW, temperature=SP.temperature, top_p=SP.top_p, seed=1)
    p, _ = chi_square_pvalue([tuple(r.tokens) for r in res], dist)
    assert p > 1e-3


def accept_without_residual(tree, logits_BNV, num_steps, key, sp):
    """A classic mistake: on rejection the next sibling (and the bonus) is tested against the
    unmodified target distribution instead of the residual. Biased towards draft tokens."""
    probs = target_probs(logits_BNV, sp)
    B, N, V = probs.shape
    rows = jnp.arange(B)
    u = jax.random.uniform(key, (num_steps, N, B))
    cur, alive, m, path = jnp.zeros(B, jnp.int32), jnp.ones(B, bool), jnp.zeros(B, jnp.int32), []
    for d in range(num_steps):
        taken, nxt = jnp.zeros(B, bool), cur
        for j in range(1, N):
            cand = alive & ~taken & (tree.parents[:, j] == cur)
            ok = cand & (u[d, j] < probs[rows, cur, tree.tokens[:, j]])
            nxt, taken = jnp.where(ok, j, nxt), taken | ok
        cur = nxt
        path.append(jnp.where(taken, cur, -1))
        m, alive = m + taken, alive & taken
    bonus = jax.random.categorical(jax.random.fold_in(key, 1), jnp.log(probs[rows, cur]), axis=-1)
    return jnp.stack(path, 1), m, bonus.astype(jnp.int32)


def test_broken_acceptance_rule_is_detected(setup, monkeypatch):
    engine, prompt, dist = setup
    monkeypatch.setattr(spec, "accept_sampling", accept_without_residual)
    jax.clear_caches()  # the loop was compiled with the real rule
    try:
        samples, _ = draw(engine, prompt, SpecConfig(2, 2, 4), seed=0)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    p, _ = chi_square_pvalue(samples, dist)
    assert p < 1e-6, f"a biased sampler went unnoticed (p={p:.2e})"
