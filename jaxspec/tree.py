"""Static-shape draft trees for EAGLE-2 / EAGLE-3 drafting.

The draft model grows a tree of guesses below the *root* (the last committed
token) in ``num_steps`` rounds:

* step 0 takes the draft's top ``topk`` tokens at the root; their scores are
  their log-probs.  These nodes are the first candidates and the first
  *frontier*.
* every later step gives each of the ``topk`` frontier nodes its own top
  ``topk`` children (score = parent score + child log-prob).  All
  ``topk * topk`` children become candidates and the best ``topk`` of them
  become the next frontier.

Candidates are numbered in the order they are generated: step 0 owns indices
``0 .. K-1`` and step ``i >= 1`` owns ``K + (i-1)*K*K .. K + i*K*K - 1``, where
child ``j`` of frontier slot ``s`` sits at offset ``s*K + j`` inside its step.
A parent therefore always has a lower candidate index than its children.

The final tree keeps the best ``num_draft_tokens - 1`` candidates (ties go to
the lower candidate index) and lays them out by candidate index after the root
at node 0, so a parent always precedes its children.

Since log-probs are ``<= 0`` a child never scores above its parent; together
with the tie rule this guarantees that the ancestors of every kept candidate
are kept as well.

Every array function here is pure ``jax.numpy`` with shapes fixed by the
static :class:`TreeShape`, batched over a leading row axis ``B``, and can be
traced under :func:`jax.jit`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "TreeShape",
    "DraftTree",
    "FrontierInfo",
    "root_step",
    "expand_step",
    "build_tree",
    "grow_candidates",
    "grow_tree",
]


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int >= {minimum}, found {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, found {value}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeShape:
    """Static size of a draft tree.

    Attributes:
      num_steps: S, number of drafting rounds (tree depth below the root).
      topk: K, children per expanded node and frontier width.
      num_draft_tokens: N, number of tree nodes *including* the root.

    All fields are static metadata: the instance is hashable and a pytree
    without leaves, so it can be passed to a jitted function either as a
    regular argument or through ``static_argnames``.
    """

    num_steps: int = dataclasses.field(metadata=dict(static=True))
    topk: int = dataclasses.field(metadata=dict(static=True))
    num_draft_tokens: int = dataclasses.field(metadata=dict(static=True))

    def __post_init__(self):
        _check_int("num_steps", self.num_steps, 1)
        _check_int("topk", self.topk, 1)
        _check_int("num_draft_tokens", self.num_draft_tokens, 2)
        if self.topk == 1:
            # A chain drafts exactly one token per step; a shorter tree would
            # waste the last steps, a longer one does not exist.
            expected = self.num_steps + 1
            if self.num_draft_tokens != expected:
                raise ValueError(
                    f"num_draft_tokens: expected num_steps + 1 = {expected} "
                    f"when topk == 1, found {self.num_draft_tokens}"
                )
        elif self.num_draft_tokens - 1 > self.num_candidates:
            raise ValueError(
                "num_draft_tokens: expected <= 1 + num_candidates = "
                f"{1 + self.num_candidates} for num_steps={self.num_steps}, "
                f"topk={self.topk}, found {self.num_draft_tokens}"
            )

    @property
    def num_candidates(self) -> int:
        """C = K + (S - 1) * K * K, every node generated while drafting."""
        k = self.topk
        return k + (self.num_steps - 1) * k * k


# --------------------------------------------------------------------------
# Pytrees handed between the pieces
# --------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees, N nodes each, node 0 being the root.

    Attributes:
      tokens: [B, N] int32 draft-vocab token of each node.  ``tokens[:, 0]``
        is ``-1``: the root token comes from the caller (it is usually a
        target-vocab token and is not known here).
      parents: [B, N] int32 node index of each node's parent, ``-1`` for the
        root.  ``parents[:, i] < i`` for every ``i >= 1``.
      depth: [B, N] int32 distance from the root (root 0).
      mask: [B, N, N] bool; ``mask[b, i, j]`` is true iff node ``j`` is node
        ``i`` or one of its ancestors (the attention mask inside the tree).
      cand_index: [B, N] int32 candidate index of each node, ``-1`` for the
        root; increasing along each row.
    """

    tokens: jax.Array
    parents: jax.Array
    depth: jax.Array
    mask: jax.Array
    cand_index: jax.Array

    def positions(self, lengths: jax.Array) -> jax.Array:
        """Sequence positions of the nodes, [B, N] = ``lengths[:, None] + depth``.

        The root lands on ``lengths`` itself, so pass the position the root
        token occupies (for example the number of tokens already in the KV
        cache when the root has not been written yet, or that number minus
        one when it has).  Siblings share a position.

        Args:
          lengths: [B] integer array.
        """
        return lengths.astype(self.depth.dtype)[:, None] + self.depth


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FrontierInfo:
    """Where the current frontier nodes sit, handed to ``child_logp_fn``.

    Attributes:
      cand_index: [B, K] int32 candidate index of each frontier node.
      parent_slot: [B, K] int32 slot, in the previous frontier, of each
        frontier node's parent; ``-1`` for the step-0 frontier (whose parent
        is the root).  This is what a drafting loop gathers its previous
        hidden states / cache rows with.
    """

    cand_index: jax.Array
    parent_slot: jax.Array


# --------------------------------------------------------------------------
# Ranking helpers
# --------------------------------------------------------------------------


def _canonical_scores(scores: jax.Array) -> jax.Array:
    """Makes equal scores compare equal under any total float order.

    ``-0.0`` becomes ``+0.0`` (otherwise a child ``+0.0`` under a ``-0.0``
    parent could rank above it) and NaN becomes ``-inf`` (a NaN has no place
    in a ranking, it just goes last).
    """
    scores = jnp.where(scores == 0, jnp.zeros_like(scores), scores)
    return jnp.where(jnp.isnan(scores), -jnp.inf, scores)


def _best_first(scores: jax.Array, k: int) -> jax.Array:
    """Indices of the k best scores along the last axis, best first.

    Equal scores are ordered by lower index.  The rule is spelled out with a
    two-key sort rather than left to a top-k primitive because the ancestor
    guarantee of the tree depends on it.

    Args:
      scores: [..., M] float.
      k: static int, ``k <= M``.
    Returns:
      [..., k] int32.
    """
    keys = -_canonical_scores(scores)
    index = lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1)
    _, order = lax.sort((keys, index), dimension=scores.ndim - 1, num_keys=2)
    return order[..., :k]


def _top_tokens(logp: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """The topk most likely tokens along the last (vocab) axis.

    Ties go to the lower token id.  Returns (log-probs, int32 token ids),
    each [..., topk], best first.
    """
    vocab = logp.shape[-1]
    if topk > vocab:
        raise ValueError(f"topk: expected <= vocab size {vocab}, found {topk}")
    values, tokens = lax.top_k(logp, topk)
    return values, tokens.astype(jnp.int32)


# --------------------------------------------------------------------------
# Drafting steps
# --------------------------------------------------------------------------


def root_step(root_logp: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """Step 0: the topk tokens at the root.

    Args:
      root_logp: [B, V] draft log-probs at the root.
      topk: static K.
    Returns:
      scores: [B, K] their log-probs, best first (also candidates 0..K-1).
      tokens: [B, K] int32 token ids.
    """
    return _top_tokens(root_logp, topk)


def expand_step(
    frontier_scores: jax.Array, child_logp: jax.Array, topk: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Step i >= 1: give every frontier node topk children, pick a new frontier.

    Args:
      frontier_scores: [B, K] scores of the current frontier.
      child_logp: [B, K, V] draft log-probs at each frontier node.
      topk: static K (must equal the frontier width).
    Returns:
      cand_scores: [B, K*K] child scores (parent score + log-prob); child j
        of frontier slot s is at ``s*K + j``.
      cand_tokens: [B, K*K] int32 child tokens.
      cand_parent: [B, K*K] int32 frontier slot of each child's parent.
      frontier_sel: [B, K] int32 indices into the K*K children chosen as
        the new frontier, best first (ties: lower index).
      new_scores: [B, K] scores of the new frontier.
    """
    batch, width = frontier_scores.shape
    if width != topk or child_logp.shape[:2] != (batch, topk):
        raise ValueError(
            f"expand_step: expected frontier_scores [B, {topk}] and child_logp "
            f"[B, {topk}, V], found {frontier_scores.shape} and {child_logp.shape}"
        )
    child_scores, child_tokens = _top_tokens(child_logp, topk)  # [B, K, K]
    cand_scores = (frontier_scores[:, :, None] + child_scores).reshape(batch, -1)
    cand_tokens = child_tokens.reshape(batch, -1)
    slot = lax.broadcasted_iota(jnp.int32, (batch, topk, topk), 1)
    cand_parent = slot.reshape(batch, -1)
    frontier_sel = _best_first(cand_scores, topk)
    new_scores = jnp.take_along_axis(cand_scores, frontier_sel, axis=1)
    return cand_scores, cand_tokens, cand_parent, frontier_sel, new_scores


# --------------------------------------------------------------------------
# Tree assembly
# --------------------------------------------------------------------------


def _candidate_depth(cand_index: jax.Array, topk: int) -> jax.Array:
    """Depth of candidates from their index alone (step-0 candidates are 1)."""
    later = (cand_index - topk) // (topk * topk) + 2
    return jnp.where(cand_index < topk, 1, later).astype(jnp.int32)


def _node_of_candidate(kept: jax.Array, num_candidates: int) -> jax.Array:
    """Inverse of the node -> candidate map.

    Args:
      kept: [B, N-1] candidate index of nodes 1..N-1.
    Returns:
      [B, C] int32 node index of each candidate, ``-1`` where dropped.
    """
    batch, n_kept = kept.shape
    rows = jnp.arange(batch)[:, None]
    nodes = jnp.broadcast_to(jnp.arange(1, n_kept + 1, dtype=jnp.int32), kept.shape)
    empty = jnp.full((batch, num_candidates), -1, jnp.int32)
    return empty.at[rows, kept].set(nodes)


def _ancestor_mask(parents: jax.Array, max_depth: int) -> jax.Array:
    """[B, N, N] bool: node j is node i or an ancestor of node i.

    Walks every node up ``max_depth`` parent links at once; the root is made
    its own parent so walks that reach it stay there.
    """
    n = parents.shape[1]
    columns = jnp.arange(n, dtype=jnp.int32)
    step_up = jnp.maximum(parents, 0)
    current = jnp.broadcast_to(columns, parents.shape)
    mask = current[:, :, None] == columns
    for _ in range(max_depth):
        current = jnp.take_along_axis(step_up, current, axis=1)
        mask = mask | (current[:, :, None] == columns)
    return mask


def build_tree(
    cand_scores: jax.Array,
    cand_tokens: jax.Array,
    cand_parent: jax.Array,
    shape: TreeShape,
) -> DraftTree:
    """Keeps the best N-1 candidates and lays them out as a tree.

    Args:
      cand_scores: [B, C] score of every candidate.
      cand_tokens: [B, C] token of every candidate.
      cand_parent: [B, C] candidate index of each candidate's parent, ``-1``
        for children of the root.  Parents must have lower indices than
        their children and scores must not increase from parent to child.
      shape: static tree shape; C must equal ``shape.num_candidates``.
    Returns:
      DraftTree with N = ``shape.num_draft_tokens`` nodes; nodes 1.. are
      the kept candidates in increasing candidate index.
    """
    num_cand = shape.num_candidates
    if cand_scores.shape[-1] != num_cand:
        raise ValueError(f"cand_scores: expected {num_cand} candidates for {shape}, found {cand_scores.shape[-1]}")
    batch = cand_scores.shape[0]
    n_kept = shape.num_draft_tokens - 1

    # Select by score, then order by candidate index so parents come first.
    kept = jnp.sort(_best_first(cand_scores, n_kept), axis=1)

    tokens = jnp.take_along_axis(cand_tokens.astype(jnp.int32), kept, axis=1)
    parent_cand = jnp.take_along_axis(cand_parent.astype(jnp.int32), kept, axis=1)
    node_of = _node_of_candidate(kept, num_cand)
    parent_node = jnp.take_along_axis(node_of, jnp.maximum(parent_cand, 0), axis=1)
    parent_node = jnp.where(parent_cand < 0, 0, parent_node)

    root = jnp.full((batch, 1), -1, jnp.int32)
    parents = jnp.concatenate([root, parent_node], axis=1)
    depth = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), _candidate_depth(kept, shape.topk)], axis=1)
    return DraftTree(
        tokens=jnp.concatenate([root, tokens], axis=1),
        parents=parents,
        depth=depth,
        mask=_ancestor_mask(parents, shape.num_steps),
        cand_index=jnp.concatenate([root, kept], axis=1),
    )


# --------------------------------------------------------------------------
# Reference driver
# --------------------------------------------------------------------------

ChildLogpFn = Callable[[Any, int, jax.Array, FrontierInfo], tuple[jax.Array, Any]]


def grow_candidates(
    root_logp: jax.Array, child_logp_fn: ChildLogpFn, num_steps: int, topk: int, carry: Any = None
) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
    """Runs the whole drafting recursion: every candidate, in candidate order.

    Args:
      root_logp: [B, V] draft log-probs at the root.
      child_logp_fn: ``child_logp_fn(carry, step, frontier_tokens, info)``
        returns ``(child_logp, carry)``: the [B, K, V] draft log-probs at each
        frontier node and the drafter's state for the next step.  It is called
        for ``step = 1 .. num_steps-1``; at step i the frontier holds nodes of
        depth i, ``frontier_tokens`` is [B, K] and ``info`` a
        :class:`FrontierInfo`.  Everything the drafter keeps between steps
        (caches, hidden states) travels in ``carry``, so the function changes
        nothing while it is traced.  Traceable under jit when the callable is.
      num_steps, topk: static S and K.
      carry: the drafter's state before step 1, handed to the first call.
    Returns:
      (cand_scores, cand_tokens, cand_parent) [B, C] each, as :func:`build_tree`
      takes them, and the carry the last call returned (``carry`` itself when
      ``num_steps == 1``).
    """
    k = topk
    scores, tokens = root_step(root_logp, k)
    batch = scores.shape[0]

    all_scores, all_tokens = [scores], [tokens]
    all_parents = [jnp.full((batch, k), -1, jnp.int32)]
    frontier_tokens = tokens
    frontier_cand = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k))
    parent_slot = jnp.full((batch, k), -1, jnp.int32)
    offset = k  # candidate index of the first child made by the next step

    for step in range(1, num_steps):
        info = FrontierInfo(cand_index=frontier_cand, parent_slot=parent_slot)
        child_logp, carry = child_logp_fn(carry, step, frontier_tokens, info)
        cand_scores, cand_tokens, cand_slot, sel, scores = expand_step(scores, child_logp, k)

        # Frontier slots are only meaningful within a step; store parents as
        # global candidate indices instead.
        all_parents.append(jnp.take_along_axis(frontier_cand, cand_slot, axis=1))
        all_scores.append(cand_scores)
        all_tokens.append(cand_tokens)

        frontier_tokens = jnp.take_along_axis(cand_tokens, sel, axis=1)
        parent_slot = jnp.take_along_axis(cand_slot, sel, axis=1)
        frontier_cand = offset + sel
        offset += k * k

    cat = lambda parts: jnp.concatenate(parts, axis=1)
    return cat(all_scores), cat(all_tokens), cat(all_parents), carry


def grow_tree(
    root_logp: jax.Array, child_logp_fn: ChildLogpFn, shape: TreeShape, carry: Any = None
) -> tuple[DraftTree, Any]:
    """Runs the whole drafting recursion and builds the tree.

    This is the reference for the real drafting loop, which does the same
    bookkeeping around draft-model calls.

    Args:
      root_logp: [B, V] draft log-probs at the root.
      child_logp_fn: ``child_logp_fn(carry, step, frontier_tokens, info) ->
        (child_logp, carry)``, as :func:`grow_candidates` calls it.
      shape: static tree shape.
      carry: the drafter's state before step 1.
    Returns:
      (the DraftTree of :func:`build_tree`, the drafter's final carry).
    """
    scores, tokens, parents, carry = grow_candidates(root_logp, child_logp_fn, shape.num_steps, shape.topk, carry)
    return build_tree(scores, tokens, parents, shape), carry
