"""Tests for jaxspec.tree (static-shape EAGLE draft trees)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.tree import (
    DraftTree,
    FrontierInfo,
    TreeShape,
    build_tree,
    expand_step,
    grow_tree,
    root_step,
)

CONFIGS = [
    (1, 1, 2),
    (3, 1, 4),
    (5, 1, 6),
    (2, 2, 4),
    (3, 2, 6),
    (4, 3, 8),
    (3, 4, 10),
    (6, 4, 16),
]


# --------------------------------------------------------------------------
# Independent brute-force reference (plain Python / numpy)
# --------------------------------------------------------------------------


@dataclasses.dataclass
class RefNode:
    index: int  # generation order over the whole drafting run
    token: int
    score: np.float32
    parent: RefNode | None

    @property
    def path(self) -> tuple:
        node, tokens = self, []
        while node is not None:
            tokens.append(node.token)
            node = node.parent
        return tuple(reversed(tokens))


def ref_top_tokens(logp: np.ndarray, k: int) -> list:
    """Best k token ids, higher log-prob first, lower id first among equals."""
    return sorted(range(len(logp)), key=lambda t: (-float(logp[t]), t))[:k]


def ref_best(nodes: list, k: int) -> list:
    """Best k nodes, higher score first, lower generation index among equals."""
    return sorted(nodes, key=lambda n: (-float(n.score), n.index))[:k]


def reference_tree(root_logp, logp_of_path: Callable, S: int, K: int, N: int) -> dict:
    """One row's tree, built by enumerating every candidate explicitly."""
    candidates = []

    def new_node(token, score, parent):
        node = RefNode(len(candidates), int(token), np.float32(score), parent)
        candidates.append(node)
        return node

    frontier = [new_node(t, root_logp[t], None) for t in ref_top_tokens(root_logp, K)]
    for _ in range(1, S):
        children = []
        for parent in frontier:
            logp = logp_of_path(parent.path)
            for t in ref_top_tokens(logp, K):
                # float32 + float32 -> float32, same rounding as the jax side.
                children.append(new_node(t, parent.score + np.float32(logp[t]), parent))
        frontier = ref_best(children, K)
    assert len(candidates) == K + (S - 1) * K * K

    kept = ref_best(candidates, N - 1)
    kept_ids = {id(n) for n in kept}
    for node in kept:  # every ancestor of a kept node is kept
        ancestor = node.parent
        while ancestor is not None:
            assert id(ancestor) in kept_ids
            ancestor = ancestor.parent

    kept.sort(key=lambda n: n.index)
    node_of = {id(n): i + 1 for i, n in enumerate(kept)}
    tokens = [-1] + [n.token for n in kept]
    parents = [-1] + [0 if n.parent is None else node_of[id(n.parent)] for n in kept]
    depth = [0] * N
    mask = np.zeros((N, N), bool)
    for i in range(N):
        j = i
        mask[i, i] = True
        while parents[j] != -1:
            j = parents[j]
            mask[i, j] = True
            depth[i] += 1
    return dict(
        tokens=np.array(tokens),
        parents=np.array(parents),
        depth=np.array(depth),
        mask=mask,
        cand_index=np.array([-1] + [n.index for n in kept]),
        candidates=candidates,
    )


# --------------------------------------------------------------------------
# Deterministic toy draft models
# --------------------------------------------------------------------------


def log_softmax_f32(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return (shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class PathCarry:
    """What PathModel carries between drafting steps (grow_tree's explicit carry)."""

    frontier_paths: tuple = ()  # per row, the path of every frontier slot
    steps_seen: tuple = ()  # the steps it was called for, in order
    cand_paths: tuple = ()  # ((row, candidate index), path) for every frontier node seen


class PathModel:
    """Draft model whose log-probs at a node depend on (row, path from root).

    ``__call__`` is a ``child_logp_fn`` for grow_tree: from the carry it rebuilds
    the path of every frontier node from its parent's slot in the previous
    frontier, just like a drafting loop gathers hidden states, and records the
    path under the node's candidate index so the tests can check FrontierInfo.
    It changes nothing of its own: everything it learns goes into the carry it
    returns.
    """

    def __init__(self, logp_of: Callable, batch: int):
        self.logp_of = logp_of  # (row, path) -> [V] float32
        self.batch = batch

    def root_logp(self) -> np.ndarray:
        return np.stack([self.logp_of(b, ()) for b in range(self.batch)])

    def __call__(self, carry: PathCarry, step, frontier_tokens, info: FrontierInfo):
        tokens = np.asarray(frontier_tokens)
        slots = np.asarray(info.parent_slot)
        cands = np.asarray(info.cand_index)
        paths, out, seen = [], [], []
        for b in range(self.batch):
            row_paths = []
            for s in range(tokens.shape[1]):
                prefix = () if slots[b, s] < 0 else carry.frontier_paths[b][slots[b, s]]
                path = prefix + (int(tokens[b, s]),)
                row_paths.append(path)
                seen.append(((b, int(cands[b, s])), path))
            paths.append(tuple(row_paths))
            out.append(np.stack([self.logp_of(b, p) for p in row_paths]))
        carry = PathCarry(tuple(paths), carry.steps_seen + (step,), carry.cand_paths + tuple(seen))
        return jnp.asarray(np.stack(out)), carry


def random_path_logp(seed: int, vocab: int) -> Callable:
    def logp_of(row, path):
        rng = np.random.default_rng([seed, row, len(path), *path])
        return log_softmax_f32(2.0 * rng.normal(size=vocab))

    return logp_of


def check_against_reference(model: PathModel, shape: TreeShape) -> DraftTree:
    S, K, N = shape.num_steps, shape.topk, shape.num_draft_tokens
    tree, carry = grow_tree(jnp.asarray(model.root_logp()), model, shape, PathCarry())
    assert list(carry.steps_seen) == list(range(1, S))
    for b in range(model.batch):
        ref = reference_tree(model.logp_of(b, ()), lambda p, b=b: model.logp_of(b, p), S, K, N)
        for name in ("tokens", "parents", "depth", "mask", "cand_index"):
            np.testing.assert_array_equal(np.asarray(getattr(tree, name))[b], ref[name], err_msg=f"{name}, row {b}")
        # FrontierInfo named the right candidates.
        for (row, cand), path in dict(carry.cand_paths).items():
            if row == b:
                assert ref["candidates"][cand].path == path
    assert_well_formed(tree)
    return tree


def assert_well_formed(tree: DraftTree) -> None:
    """Structural invariants every tree must satisfy, whatever the scores."""
    tokens, parents, depth, mask, cand = map(
        np.asarray, (tree.tokens, tree.parents, tree.depth, tree.mask, tree.cand_index)
    )
    B, N = parents.shape
    assert tokens.shape == depth.shape == cand.shape == (B, N)
    assert mask.shape == (B, N, N) and mask.dtype == bool
    for b in range(B):
        assert parents[b, 0] == -1 and depth[b, 0] == 0 and cand[b, 0] == -1
        assert np.all(np.diff(cand[b, 1:]) > 0)
        for i in range(1, N):
            p = parents[b, i]
            assert 0 <= p < i, f"row {b} node {i} has parent {p}"
            assert depth[b, i] == depth[b, p] + 1
            np.testing.assert_array_equal(mask[b, i], mask[b, p] | (np.arange(N) == i))


# --------------------------------------------------------------------------
# (1) brute-force comparison on random draft models
# --------------------------------------------------------------------------


@pytest.mark.parametrize("S,K,N", CONFIGS)
def test_matches_brute_force(S, K, N):
    shape = TreeShape(num_steps=S, topk=K, num_draft_tokens=N)
    for seed in range(2):
        model = PathModel(random_path_logp(seed=1000 * S + 10 * K + seed, vocab=12), batch=3)
        check_against_reference(model, shape)


# --------------------------------------------------------------------------
# (2) hand-worked example
# --------------------------------------------------------------------------


def test_hand_worked_example():
    # S=2, K=2, N=5, vocabulary {0, 1, 2, 3}, one row.  Written as
    # probabilities; scores are sums of logs, i.e. logs of these products.
    #
    # Step 0, root probs [.10, .50, .30, .10]:
    #   c0 = tok 1, .50        c1 = tok 2, .30           (frontier, best first)
    # Step 1, children of each frontier slot (its own top 2):
    #   slot 0 (tok 1), probs [.70, .10, .15, .05]:
    #     c2 = tok 0, .50*.70 = .350     c3 = tok 2, .50*.15 = .075
    #   slot 1 (tok 2), probs [.05, .15, .10, .70]:
    #     c4 = tok 3, .30*.70 = .210     c5 = tok 1, .30*.15 = .045
    #   new frontier = best 2 of the K*K children [.350, .075, .210, .045]
    #     -> children 0 (c2) and 2 (c4)
    # Keep N-1 = 4 of [.50, .30, .350, .075, .210, .045]:
    #   by score c0 .50 > c2 .35 > c1 .30 > c4 .21; by index c0, c1, c2, c4.
    # Tree:
    #   node 0 root
    #   node 1 = c0 tok 1, parent 0, depth 1
    #   node 2 = c1 tok 2, parent 0, depth 1
    #   node 3 = c2 tok 0, parent 1 (c0), depth 2
    #   node 4 = c4 tok 3, parent 2 (c1), depth 2
    shape = TreeShape(num_steps=2, topk=2, num_draft_tokens=5)
    root_probs = np.array([[0.10, 0.50, 0.30, 0.10]])
    next_probs = np.array(  # bigram table: row = frontier token
        [
            [0.25, 0.25, 0.25, 0.25],
            [0.70, 0.10, 0.15, 0.05],
            [0.05, 0.15, 0.10, 0.70],
            [0.25, 0.25, 0.25, 0.25],
        ]
    )
    root_logp = jnp.log(jnp.asarray(root_probs, jnp.float32))
    table = jnp.log(jnp.asarray(next_probs, jnp.float32))

    scores, tokens = root_step(root_logp, 2)
    np.testing.assert_array_equal(tokens, [[1, 2]])
    np.testing.assert_allclose(scores, np.log([[0.5, 0.3]]), rtol=1e-6)

    cand_scores, cand_tokens, cand_parent, sel, new_scores = expand_step(scores, table[tokens], 2)
    np.testing.assert_allclose(cand_scores, np.log([[0.35, 0.075, 0.21, 0.045]]), rtol=1e-5)
    np.testing.assert_array_equal(cand_tokens, [[0, 2, 3, 1]])
    np.testing.assert_array_equal(cand_parent, [[0, 0, 1, 1]])
    np.testing.assert_array_equal(sel, [[0, 2]])
    np.testing.assert_allclose(new_scores, np.log([[0.35, 0.21]]), rtol=1e-5)

    tree, _ = grow_tree(root_logp, lambda carry, step, tok, info: (table[tok], carry), shape)
    np.testing.assert_array_equal(tree.tokens, [[-1, 1, 2, 0, 3]])
    np.testing.assert_array_equal(tree.parents, [[-1, 0, 0, 1, 2]])
    np.testing.assert_array_equal(tree.depth, [[0, 1, 1, 2, 2]])
    np.testing.assert_array_equal(tree.cand_index, [[-1, 0, 1, 2, 4]])
    np.testing.assert_array_equal(
        tree.mask,
        [
            [
                [1, 0, 0, 0, 0],  # root
                [1, 1, 0, 0, 0],  # tok 1
                [1, 0, 1, 0, 0],  # tok 2
                [1, 1, 0, 1, 0],  # tok 1 -> tok 0
                [1, 0, 1, 0, 1],  # tok 2 -> tok 3
            ]
        ],
    )
    np.testing.assert_array_equal(tree.positions(jnp.array([10])), [[10, 11, 11, 12, 12]])

    # Same tree straight from the candidate lists (parents as candidate ids).
    direct = build_tree(
        jnp.concatenate([scores, cand_scores], axis=1),
        jnp.concatenate([tokens, cand_tokens], axis=1),
        jnp.array([[-1, -1, 0, 0, 1, 1]]),
        shape,
    )
    for a, b in zip(jax.tree_util.tree_leaves(direct), jax.tree_util.tree_leaves(tree)):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------
# (3) configuration errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(num_steps=0, topk=2, num_draft_tokens=3), "num_steps"),
        (dict(num_steps=2.0, topk=2, num_draft_tokens=3), "num_steps"),
        (dict(num_steps=2, topk=0, num_draft_tokens=3), "topk"),
        (dict(num_steps=2, topk=True, num_draft_tokens=3), "topk"),
        (dict(num_steps=2, topk=2, num_draft_tokens=1), "num_draft_tokens"),
        (dict(num_steps=2, topk=2, num_draft_tokens=8), "num_draft_tokens"),  # C=6
        (dict(num_steps=3, topk=1, num_draft_tokens=3), "num_draft_tokens"),
        (dict(num_steps=3, topk=1, num_draft_tokens=5), "num_draft_tokens"),
    ],
)
def test_invalid_shape(kwargs, name):
    with pytest.raises(ValueError, match=name):
        TreeShape(**kwargs)


def test_valid_shape_limits():
    assert TreeShape(2, 2, 7).num_candidates == 6  # N - 1 == C is allowed
    assert TreeShape(6, 4, 16).num_candidates == 4 + 5 * 16
    assert TreeShape(5, 1, 6).num_candidates == 5
    with pytest.raises(ValueError, match=r"expected num_steps \+ 1 = 6 .* found 7"):
        TreeShape(5, 1, 7)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="topk"):
        root_step(jnp.zeros((2, 3)), 4)
    with pytest.raises(ValueError, match="expand_step"):
        expand_step(jnp.zeros((2, 3)), jnp.zeros((2, 3, 5)), 2)
    with pytest.raises(ValueError, match="cand_scores"):
        build_tree(jnp.zeros((1, 5)), jnp.zeros((1, 5), jnp.int32), jnp.zeros((1, 5), jnp.int32), TreeShape(2, 2, 4))


# --------------------------------------------------------------------------
# (4) jit with static shapes
# --------------------------------------------------------------------------


@pytest.mark.parametrize("S,K,N", [(3, 1, 4), (4, 3, 8), (6, 4, 16)])
def test_jit_matches_eager(S, K, N):
    shape = TreeShape(S, K, N)
    B, V = 3, 16
    rng = np.random.default_rng(7)
    root_logp = jnp.asarray(log_softmax_f32(rng.normal(size=(B, V))))
    table = jnp.asarray(log_softmax_f32(2.0 * rng.normal(size=(V, V))))

    def bigram(carry, step, frontier_tokens, info):
        return table[frontier_tokens], carry + 1  # the carry counts the calls

    eager, calls = grow_tree(root_logp, bigram, shape, 0)
    assert calls == S - 1
    # TreeShape is a leafless pytree, so it can be an ordinary jit argument.
    jitted, _ = jax.jit(lambda logp, shp: grow_tree(logp, bigram, shp, jnp.int32(0)))(root_logp, shape)
    for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted)):
        np.testing.assert_array_equal(a, b)
    assert jitted.tokens.shape == (B, N) and jitted.mask.shape == (B, N, N)
    assert jitted.tokens.dtype == jnp.int32 and jitted.mask.dtype == jnp.bool_

    # The bigram table is a path model too, so the reference must agree.
    model = PathModel(lambda b, path: np.asarray(root_logp[b] if not path else table[path[-1]]), B)
    check_against_reference(model, shape)

    # The pieces also compile on their own with static topk / shape.
    scores, tokens = jax.jit(root_step, static_argnames="topk")(root_logp, topk=K)
    out = jax.jit(expand_step, static_argnames="topk")(scores, table[tokens], topk=K)
    assert [o.shape for o in out] == [(B, K * K)] * 3 + [(B, K)] * 2
    C = shape.num_candidates
    compiled = (
        jax.jit(build_tree, static_argnames="shape")
        .lower(
            jnp.zeros((B, C)),
            jnp.zeros((B, C), jnp.int32),
            jnp.full((B, C), -1, jnp.int32),
            shape=shape,
        )
        .compile()
    )
    assert compiled is not None
    positions = jax.jit(DraftTree.positions)(jitted, jnp.arange(B))
    np.testing.assert_array_equal(positions, np.arange(B)[:, None] + np.asarray(jitted.depth))


# --------------------------------------------------------------------------
# (5) ties never orphan a node
# --------------------------------------------------------------------------


def constant_logp(root_row: np.ndarray, child_row: np.ndarray) -> Callable:
    return lambda row, path: (root_row if not path else child_row).astype(np.float32)


def quantized_logp(seed: int, vocab: int) -> Callable:
    """Log-probs in {0, -1, -2}: ties everywhere, at every depth."""

    def logp_of(row, path):
        rng = np.random.default_rng([seed, row, len(path), *path])
        return -rng.integers(0, 3, size=vocab).astype(np.float32)

    return logp_of


V = 6
TIE_MODELS = {
    # Every score is 0: the tree is simply the first N-1 candidates.
    "all_zero": constant_logp(np.zeros(V), np.zeros(V)),
    # One certain token per node: a child ties its parent exactly.
    "certain": constant_logp(np.array([0.0] + [-np.inf] * (V - 1)), np.array([0.0] + [-np.inf] * (V - 1))),
    # A -0.0 parent with +0.0 children (the sum is +0.0, which a total
    # float order would rank above the parent's -0.0).
    "signed_zero": constant_logp(np.full(V, -0.0), np.zeros(V)),
    "uniform": constant_logp(np.full(V, -np.log(V)), np.full(V, -np.log(V))),
    "quantized": quantized_logp(seed=3, vocab=V),
}


@pytest.mark.parametrize("model_name", sorted(TIE_MODELS))
@pytest.mark.parametrize("S,K,N", CONFIGS)
def test_ties_keep_parents(model_name, S, K, N):
    shape = TreeShape(S, K, N)
    model = PathModel(TIE_MODELS[model_name], batch=3)
    tree = check_against_reference(model, shape)
    if model_name in ("all_zero", "signed_zero"):
        expected = np.arange(-1, N - 1)
        np.testing.assert_array_equal(np.asarray(tree.cand_index), np.tile(expected, (3, 1)))


def test_ties_in_build_tree_directly():
    # Hand-made candidates where children tie their parents and each other
    # (never exceeding them); C = 2 + 4 = 6 for S=2, K=2, candidates 2 and 3
    # are children of 1, candidates 4 and 5 children of 0.  Whatever N, every
    # kept node's parent is in the tree.
    scores = jnp.array(
        [
            [0.0, -0.0, 0.0, 0.0, -0.0, 0.0],
            [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0],
            [-jnp.inf, 0.0, 0.0, -jnp.inf, -jnp.inf, -jnp.inf],
        ]
    )
    tokens = jnp.arange(6)[None].repeat(3, 0)
    parent = jnp.array([[-1, -1, 1, 1, 0, 0]]).repeat(3, 0)
    for n in range(2, 8):
        tree = jax.jit(build_tree, static_argnames="shape")(scores, tokens, parent, TreeShape(2, 2, n))
        assert_well_formed(tree)
        cand = np.asarray(tree.cand_index)
        par = np.asarray(tree.parents)
        for b in range(3):
            for i in range(1, n):
                want = int(parent[b, cand[b, i]])
                assert (cand[b, par[b, i]] if par[b, i] > 0 else -1) == want
