"""jaxspec.tune: the predictor against a brute force over `jaxspec.tree`, spec_config.json, the CLI end to end."""

import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import tune
from jaxspec.spec import SpecConfig, accept_greedy
from jaxspec.tree import TreeShape, build_tree, grow_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------
# Brute force, written from the definitions and the real tree code


def random_profile(rng, peaked=False) -> tune.AcceptanceProfile:
    """Random per-depth, per-rank acceptance; `peaked`: like a trained draft's (rank 1 at 0.6-0.95)."""
    cond = {}
    for k in range(1, 5):
        rows = []
        for _ in range(6):
            p = rng.dirichlet(np.ones(k + 1) * 0.7)[:k] * rng.uniform(0.5, 1.0)  # the rest: beyond rank k
            if peaked:
                top = rng.uniform(0.6, 0.95)
                p = np.concatenate([[top], np.sort(rng.dirichlet(np.ones(k)))[::-1][: k - 1] * (1 - top) * 0.8])
            rows.append(tuple(float(x) for x in p))
        cond[k] = tuple(rows)
    return tune.AcceptanceProfile(cond, 0)


def brute_accept(profile, steps, topk, tokens) -> float:
    """Grow the tree with `jaxspec.tree.grow_tree` on log-probs that give rank j's probability to token j,
    then add up the kept nodes' acceptance probabilities (products along their paths)."""
    p = np.array(profile.cond[topk], np.float64)  # [depth, K]
    logp = np.log(np.maximum(p, 1e-300)).astype(np.float32)
    grow = jax.jit(
        lambda lp: grow_tree(
            lp[0][None],
            lambda carry, step, tok, info: (jnp.broadcast_to(lp[step], (1, topk, topk)), carry),
            TreeShape(steps, topk, tokens),
        )[0]
    )
    tree = grow(jnp.asarray(logp))
    toks, parents, depth = (np.asarray(a)[0] for a in (tree.tokens, tree.parents, tree.depth))
    value = np.ones(tokens)
    for i in range(1, tokens):
        value[i] = value[parents[i]] * p[depth[i] - 1, toks[i]]
    return 1.0 + float(value[1:].sum())


def brute_accept_enumerated(profile, steps, topk, tokens) -> float:
    """The same tree in plain Python from `jaxspec.tree`'s description: a node is its path of ranks; step 0
    keeps the root's K children as the frontier, every later step gives each frontier node (best first) its K
    children (best first) and keeps the best K of those; the tree is the best N - 1 nodes (ties: generated first).
    """
    p = profile.cond[topk]

    def kids(path, value):
        depth = len(path)
        out = [(path + (j,), value * p[depth][j]) for j in range(topk)]
        return sorted(out, key=lambda x: -x[1])  # stable: equal values keep rank order

    nodes = kids((), 1.0)
    frontier = list(nodes)
    for _ in range(1, steps):
        made = [c for f in frontier for c in kids(*f)]
        nodes += made
        frontier = sorted(made, key=lambda x: -x[1])[:topk]
    kept = sorted(nodes, key=lambda x: -x[1])[: tokens - 1]
    return 1.0 + sum(v for _, v in kept)


_ACCEPT = {}


def brute_accepts(profile):
    """Every valid tree shape (steps 1..6, topk 1..4, 2..16 tokens, as `TreeShape` validates them), enumerated."""
    key = id(profile)
    if key not in _ACCEPT:
        table = {}
        for s, k, n in itertools.product(range(1, 7), range(1, 5), range(2, 17)):
            try:
                TreeShape(s, k, n)
            except ValueError:
                continue
            table[(s, k, n)] = brute_accept_enumerated(profile, s, k, n)
        _ACCEPT[key] = (profile, table)
    return _ACCEPT[key][1]


def brute_best(true_costs, profile, batch):
    """Every setting by enumeration, from the cost functions themselves; of those within 1% of the fastest,
    plain decoding, else the fewest draft tokens, then the smallest topk, then the fewest steps."""
    rates = {"plain": batch / true_costs["plain"]}
    for (s, k, n), e in brute_accepts(profile).items():
        t = true_costs["draft"](s, k) + true_costs["verify"](n) + true_costs["extend"](s + 1) + true_costs["ov"]
        rates[(s, k, n)] = batch * e / t
    top = max(rates.values())
    near = [c for c, r in rates.items() if r >= 0.99 * top]
    best = "plain" if "plain" in near else min(near, key=lambda c: (c[2], c[1], c[0]))
    return best, rates[best]


def brute_dist_enumerated(profile, steps, topk, tokens) -> np.ndarray:
    """P(a cycle emits l tokens), l = 1 .. steps + 1, from the enumerated tree of `brute_accept_enumerated`: the
    target's path is one path, so "at least d accepted" is the union of the disjoint events "this kept depth-d
    node is on it"."""
    p = profile.cond[topk]

    def kids(path, value):
        out = [(path + (j,), value * p[len(path)][j]) for j in range(topk)]
        return sorted(out, key=lambda x: -x[1])

    nodes = kids((), 1.0)
    frontier = list(nodes)
    for _ in range(1, steps):
        made = [c for f in frontier for c in kids(*f)]
        nodes += made
        frontier = sorted(made, key=lambda x: -x[1])[:topk]
    kept = sorted(nodes, key=lambda x: -x[1])[: tokens - 1]
    at_least = [1.0] + [sum(v for path, v in kept if len(path) == d) for d in range(1, steps + 1)] + [0.0]
    return np.array([at_least[i] - at_least[i + 1] for i in range(steps + 1)])


def brute_cycles(dist, max_new, batch) -> float:
    """E[iterations until all `batch` rows have max_new tokens] from the uncapped sum of c cycles' tokens:
    P(a row is done after c cycles) = P(its first token + c cycles' tokens >= max_new)."""
    need = max_new - 1
    pmf, total = np.array([1.0]), 0.0
    step = np.concatenate([[0.0], dist])  # tokens 0 (never) .. steps + 1
    for _ in range(need):
        done = pmf[need:].sum() if len(pmf) > need else 0.0
        total += 1.0 - done**batch
        pmf = np.convolve(pmf, step)
    return total


def brute_best_fixed_length(true_costs, profile, batch, max_new):
    """`brute_best` for generations of max_new tokens: each setting's tok/s is batch x (max_new - 1) over one
    loop call (true_costs["call"], plain: ["plain_call"]) plus the expected iterations times the cycle."""
    need = max_new - 1
    rates = {"plain": batch * need / (true_costs["plain_call"] + need * true_costs["plain"])}
    for (s, k, n), _ in brute_accepts(profile).items():
        t = true_costs["draft"](s, k) + true_costs["verify"](n) + true_costs["extend"](s + 1) + true_costs["ov"]
        cycles = brute_cycles(brute_dist_enumerated(profile, s, k, n), max_new, batch)
        rates[(s, k, n)] = batch * need / (true_costs["call"] + cycles * t)
    top = max(rates.values())
    near = [c for c, r in rates.items() if r >= 0.99 * top]
    best = "plain" if "plain" in near else min(near, key=lambda c: (c[2], c[1], c[0]))
    return best, rates[best]


def synthetic(rng, plain, verify_slope, curvature=0.0):
    base = plain * rng.uniform(1.0, 1.3)
    a, b, c = rng.uniform(0.01, 0.05) * plain, rng.uniform(0.05, 0.3) * plain, rng.uniform(0.05, 0.2) * plain
    true = {
        "plain": plain,
        "verify": lambda n: base + verify_slope * (n - 1) + curvature * (n - 1) ** 2,
        "draft": lambda s, k: a * k**0.3 + (s - 1) * b * (1 + 0.2 * (k - 1)),
        "extend": lambda w: c * (1 + 0.05 * w),
        "ov": rng.uniform(0.0, 0.2) * plain,
        "call": rng.uniform(0.0, 5.0) * plain,  # one loop call beyond its iterations
        "plain_call": rng.uniform(0.0, 5.0) * plain,
    }
    costs = tune.Costs(
        plain,
        {n: true["verify"](n) for n in range(1, 17)},
        {k: {1: true["draft"](1, k), 6: true["draft"](6, k)} for k in range(1, 5)},
        {w: true["extend"](w) for w in range(2, 8)},
        {(3, 1, 4): true["draft"](3, 1) + true["verify"](4) + true["extend"](4) + true["ov"]},
        {"plain": true["plain_call"], (3, 1, 4): true["call"]},
    )
    return true, costs


# ---------------------------------------------------------------------------
# The predictor


def test_positional_acceptance_matches_the_enumeration_and_the_tree_code():
    profile = random_profile(np.random.default_rng(0))
    brute = brute_accepts(profile)
    assert set(brute) == set(tune.candidates())
    for (s, k, n), want in brute.items():
        assert tune.expected_accept(profile, s, k, n) == pytest.approx(want, rel=1e-9), (s, k, n)
    # and the real tree code on a sample of shapes (every topk, the smallest and largest trees)
    sample = [
        (1, 1, 2),
        (6, 1, 7),
        (1, 2, 3),
        (3, 2, 6),
        (6, 2, 16),
        (2, 3, 5),
        (4, 3, 12),
        (2, 4, 16),
        (6, 4, 16),
        (5, 4, 9),
    ]
    for s, k, n in sample:
        assert tune.expected_accept(profile, s, k, n) == pytest.approx(brute_accept(profile, s, k, n), rel=1e-5)
    # chains in closed form: 1 + sum over depths of the product of the conditional acceptances
    a = profile.chain()
    for s in range(1, 7):
        assert tune.expected_accept(profile, s, 1, s + 1) == pytest.approx(
            1 + sum(np.prod(a[: d + 1]) for d in range(s))
        )


@pytest.mark.parametrize("seed", range(4))
def test_pick_matches_brute_force_on_synthetic_curves(seed):
    rng = np.random.default_rng(seed + 10)
    profile = random_profile(rng, peaked=seed % 2 == 1)
    for batch, slope in ((1, 0.02), (8, 0.15), (32, 0.6)):
        true, costs = synthetic(
            rng, plain=rng.uniform(1e-3, 1e-2), verify_slope=slope * 1e-3, curvature=rng.uniform(0, 1e-5)
        )
        got = tune.pick(costs, profile, batch)
        want, rate = brute_best(true, profile, batch)
        setting = "plain" if got["mode"] == "plain" else (got["steps"], got["topk"], got["draft_tokens"])
        assert setting == want and got["tok_s"] == pytest.approx(rate, rel=1e-5), (batch, got, want, rate)


@pytest.mark.parametrize("seed", range(4))
def test_pick_matches_brute_force_for_fixed_length_generations(seed):
    """With max_new the pick and its tok/s are those of whole generations (the tail and the call cost in), and
    the steady state is kept beside them."""
    rng = np.random.default_rng(seed + 20)
    profile = random_profile(rng, peaked=seed % 2 == 1)
    for batch, slope, max_new in ((1, 0.02, 64), (8, 0.15, 16), (32, 0.6, 64), (8, 0.05, 128)):
        true, costs = synthetic(
            rng, plain=rng.uniform(1e-3, 1e-2), verify_slope=slope * 1e-3, curvature=rng.uniform(0, 1e-5)
        )
        got = tune.pick(costs, profile, batch, max_new=max_new)
        want, rate = brute_best_fixed_length(true, profile, batch, max_new)
        setting = "plain" if got["mode"] == "plain" else (got["steps"], got["topk"], got["draft_tokens"])
        assert setting == want and got["tok_s"] == pytest.approx(rate, rel=1e-6), (batch, got, want, rate)
        steady = tune.pick(costs, profile, batch)
        rows = {(r.get("steps"), r.get("topk"), r.get("draft_tokens")): r for r in tune.predict(costs, profile, batch)}
        key = (got.get("steps"), got.get("topk"), got.get("draft_tokens"))
        assert got["steady_tok_s"] == pytest.approx(rows[key]["tok_s"], rel=1e-12)
        assert got["plain_steady_tok_s"] == pytest.approx(steady["plain_tok_s"], rel=1e-12)
        assert got["cycles"] >= (max_new - 1) / max(got["accept"], 1.0) - 1e-9 and got["max_new_tokens"] == max_new


def test_plain_decoding_when_speculation_loses():
    profile = random_profile(np.random.default_rng(3))
    rng = np.random.default_rng(4)
    true, costs = synthetic(rng, plain=1e-3, verify_slope=5e-3)  # every extra verified token: 5 plain steps
    got = tune.pick(costs, profile, 8)
    assert got["mode"] == "plain" and brute_best(true, profile, 8)[0] == "plain"
    assert got["best_spec"]["tok_s"] < got["tok_s"] and got["default_tok_s"] < got["tok_s"]
    for max_new in (8, 64):  # the tail only adds to speculation's cost
        got = tune.pick(costs, profile, 8, max_new=max_new)
        assert got["mode"] == "plain" and brute_best_fixed_length(true, profile, 8, max_new)[0] == "plain"
        assert got["best_spec"]["tok_s"] < got["tok_s"] and got["default_tok_s"] < got["tok_s"]


# ---------------------------------------------------------------------------
# Tokens per cycle as a distribution, and the tail of a fixed-length batch


def test_accept_dist_of_chains_and_trees():
    profile = random_profile(np.random.default_rng(11))
    a = profile.chain()
    for s in range(1, 7):  # chains in closed form: P(l) = a_1 .. a_{l-1} (1 - a_l)
        want = [np.prod(a[: l - 1]) * (1 - a[l - 1]) for l in range(1, s + 1)] + [np.prod(a[:s])]
        np.testing.assert_allclose(tune.accept_dist(profile, s, 1, s + 1), want, rtol=1e-12, atol=1e-15)
    for s, k, n in tune.candidates():
        dist = tune.accept_dist(profile, s, k, n)
        assert len(dist) == s + 1 and (dist >= 0).all() and dist.sum() == pytest.approx(1.0, abs=1e-12)
        np.testing.assert_allclose(dist, brute_dist_enumerated(profile, s, k, n), atol=1e-12)
        assert (np.arange(1, s + 2) * dist).sum() == pytest.approx(tune.expected_accept(profile, s, k, n), rel=1e-12)
    # measured shares win, and travel through spec_config.json
    measured = tune.AcceptanceProfile(profile.cond, 0, {(2, 1, 3): 2.0}, {(2, 1, 3): (0.25, 0.5, 0.25)})
    assert list(tune.accept_dist(measured, 2, 1, 3)) == [0.25, 0.5, 0.25]
    assert tune.AcceptanceProfile.from_dict(json.loads(json.dumps(measured.to_dict()))) == measured


def monte_carlo_cycles(dist, max_new, batch, rows=160_000, seed=0):
    """Loop iterations until all `batch` rows have max_new tokens (the first from the prefill), each cycle's
    tokens drawn from `dist`: (mean, standard error) over rows // batch simulated batches."""
    rng = np.random.default_rng(seed)
    trials, need = rows // batch, max_new - 1
    draws = rng.choice(len(dist), p=dist, size=(trials, batch, need)).astype(np.int16) + 1
    have = np.cumsum(draws, axis=2, dtype=np.int32)
    cycles = (have >= need).argmax(axis=2) + 1  # every row is done by `need` cycles (>= 1 token each)
    worst = cycles.max(axis=1)
    return worst.mean(), worst.std() / np.sqrt(trials)


@pytest.mark.parametrize("shape", [(3, 1, 4), (6, 1, 7), (4, 2, 8), (1, 1, 2)])
def test_tail_model_against_monte_carlo(shape):
    """Exact expected iterations against a simulation of B rows; agreement within 4 standard errors (+ 0.01)."""
    profile = random_profile(np.random.default_rng(12), peaked=True)
    dist = tune.accept_dist(profile, *shape)
    for max_new, batch in ((64, 1), (64, 8), (16, 32), (128, 8)):
        got = tune.expected_cycles(dist, max_new, batch)
        mean, se = monte_carlo_cycles(dist, max_new, batch)
        assert abs(got - mean) <= 4 * se + 0.01, (shape, max_new, batch, got, mean, se)
        assert got == pytest.approx(brute_cycles(dist, max_new, batch), rel=1e-9)
        steady = (max_new - 1) / tune.expected_accept(profile, *shape)
        if batch > 1:  # the slowest row sets the pace
            assert got > steady
    # one row's CDF against the simulated one
    F = tune.cycles_cdf(dist, 63)
    rng = np.random.default_rng(1)
    have = np.cumsum(rng.choice(len(dist), p=dist, size=(50_000, 63)) + 1, axis=1)
    empirical = [(have[:, c - 1] >= 63).mean() if c else 0.0 for c in range(64)]
    np.testing.assert_allclose(F, empirical, atol=0.01)


def test_cycles_of_a_fixed_accept_length_match_the_real_loop():
    """A row emitting exactly L tokens per cycle needs ceil((max_new - 1) / L) iterations of the real
    `loop.run_loop` (the first token comes from `start`); L = 1 is plain decoding's max_new - 1."""
    from jaxspec import loop

    @dataclasses.dataclass(frozen=True)
    class Fixed:  # a `jaxspec.loop` method emitting `weights` tokens per iteration (at most 7)
        max_new: int

        def start(self, weights, prompt_BP, prompt_len_B, caches, key, stop_ids):
            B = prompt_BP.shape[0]
            state = loop.LoopState(**loop.fresh(B, self.max_new + 7, key))
            return loop.append_tokens(state, prompt_BP[:, :1], jnp.ones(B, jnp.int32), stop_ids, self.max_new)

        def step(self, weights, state, stop_ids):
            B = state.out_BN.shape[0]
            new = jnp.full((B, 7), 5, jnp.int32)
            state = loop.append_tokens(state, new, jnp.full((B,), weights, jnp.int32), stop_ids, self.max_new)
            return state.replace(steps=state.steps + 1)

    stop = jnp.asarray([-1], jnp.int32)
    for max_new in (1, 2, 5, 16, 64):
        method = Fixed(max_new)
        for L in range(1, 8):
            w = jnp.int32(L)
            state = loop.start(method, w, jnp.ones((2, 4), jnp.int32), jnp.full((2,), 4), (), jax.random.key(0), stop)
            state = loop.run_loop(method, w, state, stop, jnp.int32(max_new))
            dist = [0.0] * (L - 1) + [1.0]
            want = -(-(max_new - 1) // L)
            assert (
                int(state.steps)
                == want
                == tune.expected_cycles(dist, max_new, 1)
                == tune.expected_cycles(dist, max_new, 8)
            ), (max_new, L)
            assert (np.asarray(state.num_out_B) == max_new).all()


def test_loop_call_costs_from_the_measurements():
    _, costs = synthetic(np.random.default_rng(13), plain=1e-3, verify_slope=1e-4)
    costs.calls = {"plain": 0.5e-3, (1, 1, 2): 1e-3, (3, 1, 4): 2e-3, (6, 1, 7): 5e-3}
    assert costs.call_s() == 0.5e-3  # plain decoding's own
    assert costs.call_s((3, 1, 4)) == costs.call_s((1, 1, 2)) == costs.call_s((5, 4, 16)) == 2e-3  # the median
    assert tune.Costs(1e-3, {}, {}, {}).call_s((3, 1, 4)) == 0.0
    back = tune.Costs.from_dict(json.loads(json.dumps(costs.to_dict())))
    assert back.calls == pytest.approx(costs.calls)
    # plain steps and cycles are measured as (per iteration, per call)
    measured = {("plain", ()): (1e-3, 4e-4), ("cycle", (3, 1, 4)): (3e-3, 6e-4)}
    measured.update({("verify", (n,)): 1e-3 * n for n in (2, 7)})
    measured.update({("draft", (s, 1)): 1e-4 * s for s in (1, 6)})
    measured.update({("extend", (w,)): 1e-4 * w for w in (2, 7)})
    c = tune._costs_of(measured)
    assert c.plain == 1e-3 and c.cycles == {(3, 1, 4): 3e-3} and c.calls == {"plain": 4e-4, (3, 1, 4): 6e-4}


def test_settings_outside_the_measured_costs_are_not_considered():
    profile = random_profile(np.random.default_rng(5))
    _, costs = synthetic(np.random.default_rng(6), plain=2e-3, verify_slope=1e-5)
    costs.verify = {n: t for n, t in costs.verify.items() if n <= 7}
    costs.draft = {1: costs.draft[1]}
    rows = tune.predict(costs, profile, 1)
    assert {r.get("topk") for r in rows} <= {None, 1} and max(r.get("draft_tokens", 0) for r in rows) == 7


def test_disturbed_points_are_measured_again_and_measured_cycles_kept():
    measured = {
        ("verify", (2,)): 1.0,
        ("verify", (4,)): 3.0,
        ("verify", (5,)): 2.0,
        ("verify", (7,)): 2.9,
        ("extend", (2,)): 0.2,
        ("extend", (7,)): 0.3,
        ("plain", ()): 0.5,
    }
    assert [(t.kind, t.arg) for t in tune._suspects(1, measured)] == [("verify", (4,))]
    _, costs = synthetic(np.random.default_rng(9), plain=1e-3, verify_slope=1e-4)
    costs.cycles[(2, 1, 3)] = 0.123
    assert costs.cycle_s(2, 1, 3) == 0.123 and costs.cycle_s(2, 2, 3) != 0.123


def test_measured_table_wins_over_the_positional_model():
    profile = random_profile(np.random.default_rng(7))
    table = tune.AcceptanceProfile(profile.cond, 0, {(4, 2, 8): 7.5})
    assert tune.expected_accept(table, 4, 2, 8) == 7.5
    assert tune.expected_accept(table, 3, 1, 4) == tune.positional_accept(profile, 3, 1, 4)


def test_profile_from_ranks_conditions_on_the_ancestors():
    ranks = np.array([[1, 1, 2], [1, 2, 1], [2, 1, 1], [1, 1, 1], [3, 1, 1], [1, tune.MISS, 1]])
    p = tune.AcceptanceProfile.from_ranks(ranks)
    assert p.cond[1][0] == (4 / 6,)
    assert p.cond[1][1] == (2 / 4,)  # of the 4 rows with rank 1 at depth 1
    assert p.cond[1][2] == (1 / 2,)
    assert p.cond[2][1] == pytest.approx((3 / 5, 1 / 5))  # rows with depth-1 rank <= 2: all but the 3
    assert p.cond[3][0] == pytest.approx((4 / 6, 1 / 6, 1 / 6))


def test_accepted_lengths_rebuild_the_tree_and_the_greedy_accept_of_the_loop():
    """The numpy rebuild from replayed candidates against `tree.build_tree` + `spec.accept_greedy`."""
    rng = np.random.default_rng(8)
    R, V, depth = 64, 5, 4
    for k in (1, 2, 3):
        C = k + (depth - 1) * k * k
        # candidates in jaxspec.tree order: step 0 children of the root, then k children per frontier slot
        parents, tokens, scores = [], [], []
        for _ in range(R):
            par, tok, sc = [-1] * k, list(rng.permutation(V)[:k]), list(np.sort(-rng.exponential(1, k))[::-1])
            frontier = list(range(k))
            for _ in range(1, depth):
                step_par, step_tok, step_sc = [], [], []
                for f in frontier:
                    step_par += [f] * k
                    step_tok += list(rng.permutation(V)[:k])
                    step_sc += list(sc[f] + np.sort(-rng.exponential(1, k))[::-1])
                base = len(par)
                par, tok, sc = par + step_par, tok + step_tok, sc + step_sc
                frontier = [base + i for i in np.argsort(-np.array(step_sc), kind="stable")[:k]]
            parents.append(par)
            tokens.append(tok)
            scores.append(sc)
        parents, tokens, scores = (np.array(a) for a in (parents, tokens, scores))
        assert parents.shape == (R, C)
        target = rng.integers(0, V, (R, depth))
        target[: R // 2] = tokens[: R // 2, [0] + [k + j * k * k for j in range(depth - 1)]]  # some long paths
        shapes = [(s, k, s + 1) for s in (1, 4)] if k == 1 else [(1, k, 2), (2, k, k + 2), (4, k, 10), (3, k, 7)]
        for s, _, n in shapes:
            got = tune.accepted_lengths(scores, tokens, parents, target, s, k, n)
            Cs = k + (s - 1) * k * k
            nxt = jnp.asarray(np.concatenate([target, np.zeros((R, 1), int)], 1))

            @jax.jit
            def loop_accept(sc, tk, pa, nxt, s=s, k=k, n=n):
                tree = build_tree(sc, tk, pa, TreeShape(s, k, n))
                # target logits: at a node of depth d the argmax is the target's token at depth d + 1
                logits = jax.nn.one_hot(jnp.take_along_axis(nxt, tree.depth, axis=1), V)
                return accept_greedy(tree, logits, s)[1]

            m = loop_accept(
                jnp.asarray(scores[:, :Cs], jnp.float32), jnp.asarray(tokens[:, :Cs]), jnp.asarray(parents[:, :Cs]), nxt
            )
            np.testing.assert_array_equal(got, np.asarray(m) + 1, err_msg=f"{s},{k},{n}")


def test_loop_mean_jumps_like_the_loop():
    acc = np.array([3, 1, 2, 1, 4, 1, 1, 2])
    # sequence 0: roots at 10..13 -> visits 10 (3), 13 (1) then 14 is missing; sequence 1: 20..23 -> 20 (4)
    per = {0: [(10, 0), (11, 1), (12, 2), (13, 3)], 1: [(20, 4), (21, 5), (22, 6), (23, 7)]}
    assert tune.loop_mean(per, acc) == pytest.approx((3 + 1 + 4) / 3)


# ---------------------------------------------------------------------------
# spec_config.json


def fake_checkpoint(path, draft=True):
    os.makedirs(os.path.join(path, "draft", "params"), exist_ok=True)
    with open(os.path.join(path, "jaxspec_config.json"), "w") as f:
        json.dump({"format_version": 1, "target": {}, **({"draft": {}} if draft else {})}, f)
    with open(os.path.join(path, "COMPLETE"), "w") as f:
        f.write("{}")
    with open(os.path.join(path, "draft", "params", "w"), "wb") as f:
        f.write(b"\1" * 1000)
    return path


def fake_engine(path, kind_dtype="float32"):
    return types.SimpleNamespace(
        path=path, draft=types.SimpleNamespace(placement="replicated"), mesh=None, dtype=kind_dtype
    )


def payload_for(engine, picks):
    profile = random_profile(np.random.default_rng(0))
    _, costs = synthetic(np.random.default_rng(1), 2e-3, 1e-4)
    return {
        "format": tune.FORMAT,
        "created": "2026-12-01T00:00:00+00:00",
        "jax_version": jax.__version__,
        "device": tune.device_key(engine),
        "model": {"fingerprint": tune.fingerprint(engine.path)},
        "acceptance": profile.to_dict(),
        "costs": {"1": costs.to_dict()},
        "picks": picks,
    }


PICKS = {
    "1": {
        "mode": "spec",
        "steps": 4,
        "topk": 1,
        "draft_tokens": 5,
        "tok_s": 50.0,
        "plain_tok_s": 30.0,
        "default_tok_s": 45.0,
        "accept": 3.1,
        "cycle_ms": 1.0,
    },
    "8": {
        "mode": "spec",
        "steps": 2,
        "topk": 1,
        "draft_tokens": 3,
        "tok_s": 200.0,
        "plain_tok_s": 190.0,
        "default_tok_s": 180.0,
        "accept": 2.1,
        "cycle_ms": 1.0,
    },
    "32": {
        "mode": "plain",
        "tok_s": 600.0,
        "plain_tok_s": 600.0,
        "default_tok_s": 400.0,
        "accept": 1.0,
        "cycle_ms": 1.0,
        "best_spec": {"steps": 2, "topk": 1, "draft_tokens": 3, "tok_s": 500.0},
    },
}


def test_spec_config_round_trips_and_picks_the_nearest_batch_at_or_above(tmp_path):
    engine = fake_engine(fake_checkpoint(str(tmp_path / "ck")))
    path = os.path.join(engine.path, tune.CONFIG_FILE)
    data = payload_for(engine, PICKS)
    tune.write_config(path, data)
    back = tune.read_config(path)
    assert back == json.loads(json.dumps(data))
    assert tune.AcceptanceProfile.from_dict(back["acceptance"]) == tune.AcceptanceProfile.from_dict(data["acceptance"])
    c = tune.Costs.from_dict(back["costs"]["1"])
    assert c.cycle_s(4, 2, 8) == pytest.approx(tune.Costs.from_dict(data["costs"]["1"]).cycle_s(4, 2, 8))
    for batch, want in (
        (1, SpecConfig(4, 1, 5)),
        (2, SpecConfig(2, 1, 3)),
        (8, SpecConfig(2, 1, 3)),
        (9, None),
        (32, None),
        (64, None),
    ):
        choice = tune.choose(engine, batch)
        assert choice.spec == want and choice.warning is None, (batch, choice)
    assert "tuned for batch 8 by" in tune.choose(engine, 3).reason
    assert tune.choose(engine, 64).reason.startswith("plain decoding: tuned for batch 32")
    # explicit settings win; a chain's draft tokens follow its steps
    assert tune.choose(engine, 1, steps=5).spec == SpecConfig(5, 1, 6)
    assert tune.choose(engine, 1, topk=2, draft_tokens=6).spec == SpecConfig(3, 2, 6)
    assert tune.choose(engine, 1, no_spec=True).spec is None
    with pytest.raises(tune.TuneError, match="--steps/--topk/--draft-tokens = 3/1/7"):
        tune.choose(engine, 1, draft_tokens=7)


def test_no_file_means_the_default(tmp_path):
    engine = fake_engine(fake_checkpoint(str(tmp_path / "ck")))
    c = tune.choose(engine, 4)
    assert c.spec == SpecConfig(3, 1, 4) and "the default, no" in c.reason and c.warning is None
    assert tune.choose(types.SimpleNamespace(draft=None), 1).spec is None


@pytest.mark.parametrize("change", ["weights", "device", "broken"])
def test_a_stale_file_is_ignored_with_a_warning(tmp_path, change):
    engine = fake_engine(fake_checkpoint(str(tmp_path / "ck")))
    path = os.path.join(engine.path, tune.CONFIG_FILE)
    tune.write_config(path, payload_for(engine, PICKS))
    if change == "weights":  # a retrained draft converted into the same directory
        with open(os.path.join(engine.path, "draft", "params", "w"), "wb") as f:
            f.write(b"\2" * 1000)
    elif change == "device":
        engine = fake_engine(engine.path, kind_dtype="bfloat16")
    else:
        with open(path, "w") as f:
            f.write('{"format": 1, "picks": {')
    c = tune.choose(engine, 1)
    assert c.spec == SpecConfig(3, 1, 4) and c.warning is not None and "ignoring" in c.warning
    assert {"weights": "another model", "device": "device dtype", "broken": "not valid JSON"}[change] in c.warning
    assert "ignored" in c.reason


def test_prompts_files(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "def f():"}\n"import os"\n[1, 2, 3]\n')
    assert tune.load_prompts(str(good)) == ["def f():", "import os", [1, 2, 3]]
    (tmp_path / "d.json").write_text(json.dumps({"prompts": ["a", "b"]}))
    assert tune.load_prompts(str(tmp_path / "d.json")) == ["a", "b"]
    for text, msg in (
        ("{not json", "neither"),
        ("[]", "empty"),
        ('["ok", 3]', "prompt 1"),
        ('{"other": 1}', "no prompts"),
    ):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(tune.TuneError, match=msg) as e:
            tune.load_prompts(str(tmp_path / "bad.json"))
        assert str(e.value).startswith(f"--prompts {tmp_path / 'bad.json'}: ")


# ---------------------------------------------------------------------------
# The CLI on the demo pair


def run(module, *args, env=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def demo_copy(tmp_path_factory):
    """The converted demo pair in a directory of its own (tuning writes into the checkpoint)."""
    from jaxspec import demo

    if not demo.available():
        pytest.skip("no built-in demo pair in this checkout")
    src = demo.ensure_converted(progress=False, log=lambda m: None)
    dst = str(tmp_path_factory.mktemp("tune") / "demo")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(tune.CONFIG_FILE))
    return dst


def test_cli_errors(demo_copy, tmp_path):
    no_draft = str(tmp_path / "nodraft")
    shutil.copytree(demo_copy, no_draft, ignore=shutil.ignore_patterns("draft"))
    with open(os.path.join(no_draft, "jaxspec_config.json")) as f:
        cfg = json.load(f)
    cfg.pop("draft")
    with open(os.path.join(no_draft, "jaxspec_config.json"), "w") as f:
        json.dump(cfg, f)
    bad = tmp_path / "bad.json"
    bad.write_text("def f(:\n")
    procs = {
        "draft": ["--model", no_draft],
        "prompts": ["--model", demo_copy, "--prompts", str(bad)],
        "budget": ["--model", demo_copy, "--time-budget", "0.01", "--batch", "1", "--quiet"],
    }
    procs = {
        k: subprocess.Popen(
            [sys.executable, "-m", "jaxspec.tune", *a],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k, a in procs.items()
    }
    out = {k: (p.wait(600), p.stderr.read()) for k, p in procs.items()}
    for k, (rc, err) in out.items():
        last = err.strip().splitlines()[-1]
        assert rc == 2 and last.startswith("error: ") and "Traceback" not in err, (k, err[-2000:])
    assert f"--model {no_draft}: the checkpoint has no draft" in out["draft"][1]
    assert f"--prompts {bad}: expected JSON" in out["prompts"][1]
    assert "--time-budget 0.01 s is too small to measure anything" in out["budget"][1]
    assert "expected --time-budget >=" in out["budget"][1]
    assert not os.path.exists(os.path.join(demo_copy, tune.CONFIG_FILE))


def test_tune_end_to_end_then_generate_uses_it(demo_copy, tmp_path):
    prompts = tmp_path / "prompts.json"
    with open(tune.builtin_prompts_path()) as f:
        prompts.write_text(json.dumps(json.load(f)["prompts"][:2]))
    proc = run(
        "jaxspec.tune",
        "--model",
        demo_copy,
        "--prompts",
        str(prompts),
        "--batch",
        "1",
        # the limits below bound the work; the budget only has to never refuse on a slow, loaded machine
        "--time-budget",
        "1000",
        "--max-steps",
        "1",
        "--max-topk",
        "1",
        "--max-draft-tokens",
        "2",
        "--acceptance-tokens",
        "16",
        "--reps",
        "1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tuning" in proc.stderr  # the progress bar
    path = os.path.join(demo_copy, tune.CONFIG_FILE)
    data = tune.read_config(path)
    assert data["device"]["kind"] == jax.devices()[0].device_kind and data["jax_version"] == jax.__version__
    assert data["model"]["fingerprint"] == tune.fingerprint(demo_copy)
    assert data["acceptance"]["chain_replay_agreement"] >= 0.95
    pick = data["picks"]["1"]
    costs = tune.Costs.from_dict(data["costs"]["1"])
    assert costs.plain > 0 and costs.verify_s(2) > 0 and costs.draft_s(1, 1) >= 0 and costs.extend_s(2) > 0
    assert {r.get("draft_tokens") for r in data["predictions"]["1"]} == {None, 2}  # plain and 1/1/2
    assert pick["tok_s"] == max(r["tok_s"] for r in data["predictions"]["1"])
    setting = (
        "plain decoding"
        if pick["mode"] == "plain"
        else f"speculative {pick['steps']}/{pick['topk']}/{pick['draft_tokens']}"
    )
    gen = run("jaxspec.generate", "--model", demo_copy, "--max-new-tokens", "4")
    assert gen.returncode == 0, gen.stderr[-3000:]
    lines = [ln for ln in gen.stderr.splitlines() if "tuned for batch 1 by" in ln]
    assert len(lines) == 1 and lines[0].startswith(f"jaxspec: {setting}") and path in lines[0], gen.stderr[-2000:]
    assert ("[plain]" if pick["mode"] == "plain" else "[speculative]") in gen.stderr
    # the Python API: spec="auto" resolves the same way and says so in stats
    from jaxspec.engine import Engine

    (res,) = Engine.load(demo_copy).generate(["def f(x):"], max_new_tokens=3, spec="auto")
    assert res.stats["spec_choice"] == lines[0][len("jaxspec: ") :]
    assert res.stats["mode"] == ("plain" if pick["mode"] == "plain" else "speculative")


def test_tune_share_measures_costs_and_takes_the_acceptance_profile_from_a_file(tmp_path):
    """scripts/tune_share.py: the share's costs are measured here, the acceptance profile is the given
    file's (never re-measured on the random-weight share), and the printed gains are the pick's ratios."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import tune_share

    ranks = np.random.default_rng(0).choice([1, 1, 1, 2, 3, tune.MISS], size=(300, tune.DEPTH))
    profile = tune.AcceptanceProfile.from_ranks(ranks)
    src = tmp_path / "spec_config.json"
    src.write_text(json.dumps({"acceptance": {"source": "synthetic", **profile.to_dict()}, "model": {"path": "x"}}))
    out = tmp_path / "share.json"
    small = "hidden_size=256 num_heads=8 q_lora_rank=64 kv_lora_rank=32 qk_nope_head_dim=16 qk_rope_head_dim=8"
    small += " v_head_dim=16 moe_intermediate_size=64 num_experts=16 vocab_size=4096 intermediate_size=256"
    args = ["--share", "4", "--layers", "3", "--set", *small.split(), "--draft-heads", "4", "--draft-kv-heads", "2"]
    # the --max-* limits bound the work; the budget only has to never refuse on a slow, loaded machine
    args += ["--draft-intermediate", "128", "--draft-vocab", "512", "--batch", "1", "--time-budget", "1000"]
    args += ["--max-steps", "3", "--max-topk", "1", "--max-draft-tokens", "4", "--max-new-tokens", "16"]
    args += ["--prompt-len", "16", "--reps", "1", "--quiet", "--profile", str(src), "--json", str(out)]
    assert tune_share.main(args) == 0
    payload = json.loads(out.read_text())
    assert payload["acceptance"]["measured_here"] is False
    assert tune.AcceptanceProfile.from_dict(payload["acceptance"]).cond == profile.cond
    assert payload["share"] == {"n": 4, "layers": 3, "preset": "kimi-k2.5"}
    (row,) = payload["gains"]
    pick = payload["picks"]["1"]
    assert row["tok_s"] == pick["tok_s"] and row["vs_plain"] == pytest.approx(pick["tok_s"] / pick["plain_tok_s"])
    if pick.get("default_tok_s"):
        assert row["vs_default"] == pytest.approx(pick["tok_s"] / pick["default_tok_s"])
    # The pick is the predictor's best over the measured costs with this profile.
    costs = tune.Costs.from_dict(payload["costs"]["1"])
    again = tune.pick(costs, profile, 1, 3, 1, 4, 16)
    assert (again.get("steps"), again.get("topk"), again.get("draft_tokens")) == (
        pick.get("steps"),
        pick.get("topk"),
        pick.get("draft_tokens"),
    )
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"picks": {}}))
    with pytest.raises(SystemExit, match="--profile .*bad.json: expected a spec_config.json written by jaxspec.tune"):
        tune_share.load_profile(str(bad))
    with pytest.raises(SystemExit, match="--profile .*missing.json: no such file"):
        tune_share.load_profile(str(tmp_path / "missing.json"))
