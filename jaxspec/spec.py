"""EAGLE-3 speculative decoding: `Speculative`, the `jaxspec.loop` method whose step is one cycle.

A cycle, per batch row (all rows in lockstep, each with its own length):

    draft_tree   grow a static-shape tree from the root (the last emitted token)
                 with the draft running on the frontier nodes
    verify       one target forward over root + tree nodes, tree-masked, on top of
                 the latent cache; tree nodes are written at slots P .. P+N-1
    accept       greedy: follow children equal to the target argmax; sampling:
                 recursive rejection over siblings against the target distribution;
                 then a bonus token from the target at the last accepted node
    commit       move accepted latents to consecutive slots, append the tokens,
                 and extend the draft over the accepted tokens with the target's
                 aux hidden states, which yields the next root's draft log-probs

Positions: P = tokens in the target cache; the root token sits at position P (it
is not in the cache yet). The draft cache slot q holds the draft's entry built
from the target state at q and the token at q + 1. Tree drafting writes into a
scratch region after the committed slots, so rejected branches never leak.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxspec import draft as eagle
from jaxspec import loop
from jaxspec.decode import prefill
from jaxspec.kernels.mla_attention import window_of_tree
from jaxspec.layers import causal_mask, move_slots, prefix_mask, tree_mask, write_slots
from jaxspec.model import LatentCache, Transformer
from jaxspec.sampling import SamplingParams, sample, target_probs
from jaxspec.tree import DraftTree, TreeShape, grow_tree


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Tree shape of a speculative cycle (static: a change recompiles the loop).

    num_steps: draft steps (tree depth); topk: branching (1 = chain);
    num_draft_tokens: tree nodes verified per cycle, root included.
    """

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4

    @property
    def tree(self) -> TreeShape:
        return TreeShape(self.num_steps, self.topk, self.num_draft_tokens)

    def __post_init__(self):
        _ = self.tree  # validates


@struct.dataclass
class Draft:
    """A loaded EAGLE-3 draft: params, its config, vocab map and aux layer ids.

    With `embed` (a replicated copy of the target's token embeddings) and a `mesh`
    of several devices, the 'replicated' placement runs every draft computation
    under a `shard_map` over replicated inputs: each device computes the whole
    draft locally and no collective can appear. Without `embed` the draft embeds
    tokens through the target's own (possibly vocab-sharded) table; the 'sharded'
    placement does that, with its weights split over the mesh (GSPMD).
    """

    params: dict
    d2t: jax.Array  # [Vd] int32
    cfg: eagle.DraftConfig = struct.field(pytree_node=False)
    aux_ids: tuple[int, ...] = struct.field(pytree_node=False)
    embed: jax.Array | None = None  # [V, D] replicated token embeddings, or None: the target's table
    placement: str = struct.field(pytree_node=False, default="replicated")
    mesh: Mesh | None = struct.field(pytree_node=False, default=None)

    @property
    def local(self) -> bool:
        """Draft computations run on every device on its own (no collectives)."""
        return (
            self.placement == "replicated" and self.embed is not None and self.mesh is not None and self.mesh.size > 1
        )


@struct.dataclass
class SpecState(loop.LoopState):
    """Loop carry: `LoopState` (`steps` counts cycles) plus the caches and the draft's root; every
    field changes each cycle, shapes never do."""

    P_B: jax.Array  # committed target length = position of the root
    root_B: jax.Array  # last emitted token, not yet in the target cache
    target_cache: LatentCache
    draft_cache: eagle.DraftCache
    root_logp_BV: jax.Array  # draft log-probs for the token after the root [B, Vd]
    root_h_BD: jax.Array  # draft h_out at position P-1 (feeds the root's children)
    row_cycles_B: jax.Array  # cycles in which the row was live
    accept_log_BC: jax.Array  # tokens produced per cycle (accepted + bonus), -1 padded
    accepted_B: jax.Array  # sum of tokens produced per live cycle

    @property
    def cycles(self) -> jax.Array:
        """Speculative cycles run by the loop (scalar): its `steps`."""
        return self.steps


# ---------------------------------------------------------------------------
# Draft side


def embed_tokens(model: Transformer, tparams, draft: Draft, tokens):
    """The target's embeddings of `tokens` (target ids), from the draft's replicated copy when it has one."""
    if draft.embed is not None:
        return jnp.take(draft.embed, tokens, axis=0)
    return model.apply({"params": tparams}, tokens, method=Transformer.embed_tokens)


def _on_every_device(draft: Draft, fn, *args):
    """`fn(*args)`; for a local draft, on each device with replicated inputs and outputs (no collectives)."""
    if not draft.local:
        return fn(*args)
    return jax.shard_map(fn, mesh=draft.mesh, in_specs=P(), out_specs=P())(*args)


def draft_extend(model, tparams, draft: Draft, cache, aux_BTA, next_tokens_BT, start_B, count_B, S_commit: int):
    """Draft pass over committed positions q = start .. start+count-1 (causal).

    aux_BTA: the target's aux states at those positions; next_tokens_BT: the token at q+1.
    Rows use their first `count` entries; the rest are dropped. Returns
    (root_logp [B,Vd] and root_h [B,D] at the row's last entry, cache).
    """
    if draft.local:
        return _on_every_device(
            draft,
            lambda d, *a: _draft_extend(None, None, d, *a, S_commit),
            draft,
            cache,
            aux_BTA,
            next_tokens_BT,
            start_B,
            count_B,
        )
    return _draft_extend(model, tparams, draft, cache, aux_BTA, next_tokens_BT, start_B, count_B, S_commit)


def _draft_extend(model, tparams, draft: Draft, cache, aux_BTA, next_tokens_BT, start_B, count_B, S_commit: int):
    B, T = next_tokens_BT.shape
    d = jnp.arange(T, dtype=jnp.int32)
    pos = start_B[:, None] + d
    valid = d[None, :] < count_B[:, None]
    slots = jnp.where(valid, pos, cache.k.shape[1])  # out of range: dropped
    mask = causal_mask(pos, cache.k.shape[1], limit=S_commit)
    h = eagle.project_aux(draft.params, draft.cfg, aux_BTA)
    logits, h_out, cache = eagle.draft_forward(
        draft.params, draft.cfg, embed_tokens(model, tparams, draft, next_tokens_BT), h, pos, cache, slots, mask
    )
    last = jnp.maximum(count_B - 1, 0)[:, None]
    root_logp = jax.nn.log_softmax(jnp.take_along_axis(logits, last[..., None], axis=1)[:, 0], axis=-1)
    root_h = jnp.take_along_axis(h_out, last[..., None], axis=1)[:, 0]
    return root_logp, root_h, cache


@struct.dataclass
class DrafterCarry:
    """What tree drafting carries from one frontier to the next (`tree_drafter`)."""

    cache: eagle.DraftCache
    h_BKD: jax.Array  # draft h_out of the previous frontier's nodes (step 1: the root's, per slot)
    anc_BKW: jax.Array  # scratch slots each previous frontier node sees: its ancestors and itself


def tree_drafter(model, tparams, draft: Draft, P_B, root_h_BD, cache, topk: int, S_commit: int):
    """(step function for `tree.grow_tree`, its initial carry): the draft run on each frontier.

    Frontier node j of step i (depth i) writes its K/V into scratch slot S_commit + (i-1)*K + j
    at position P + i - 1 and attends to the committed draft slots < P plus the scratch slots
    of its ancestors and itself. The carry holds the draft cache, each frontier node's h_out
    and its scratch ancestry; nothing else changes.
    """
    K, B = topk, P_B.shape[0]
    W = cache.k.shape[1] - S_commit  # the scratch region, at least (num_steps - 1) * K slots
    committed = prefix_mask(P_B, S_commit)

    def step(carry: DrafterCarry, i: int, frontier_tokens, info):
        if i == 1:
            h, anc = carry.h_BKD, carry.anc_BKW
        else:
            ps = info.parent_slot[..., None]
            h = jnp.take_along_axis(carry.h_BKD, ps, axis=1)
            anc = jnp.take_along_axis(carry.anc_BKW, ps, axis=1)
        own = (i - 1) * K + jnp.arange(K, dtype=jnp.int32)
        anc = anc | (jnp.arange(W)[None, None, :] == own[None, :, None])
        mask = jnp.concatenate([jnp.broadcast_to(committed, (B, K, S_commit)), anc], axis=-1)
        pos = jnp.broadcast_to(P_B[:, None] + i - 1, (B, K))
        slots = jnp.broadcast_to(S_commit + own[None], (B, K))
        tokens = eagle.draft_to_target_ids(draft.d2t, frontier_tokens)
        logits, h_out, cache = eagle.draft_forward(
            draft.params, draft.cfg, embed_tokens(model, tparams, draft, tokens), h, pos, carry.cache, slots, mask
        )
        return jax.nn.log_softmax(logits, axis=-1), DrafterCarry(cache, h_out, anc)

    h0 = jnp.broadcast_to(root_h_BD[:, None], (B, K, root_h_BD.shape[-1]))
    return step, DrafterCarry(cache, h0, jnp.zeros((B, K, W), bool))


def draft_tree(model, tparams, draft: Draft, state: SpecState, shape: TreeShape, S_commit: int):
    """Returns (tree with target-id tokens and the root filled in, draft cache)."""
    args = (state.P_B, state.root_h_BD, state.draft_cache, state.root_logp_BV, state.root_B)
    if draft.local:
        return _on_every_device(draft, lambda d, *a: _draft_tree(None, None, d, *a, shape, S_commit), draft, *args)
    return _draft_tree(model, tparams, draft, *args, shape, S_commit)


def _draft_tree(
    model, tparams, draft: Draft, P_B, root_h_BD, cache, root_logp_BV, root_B, shape: TreeShape, S_commit: int
):
    step, carry = tree_drafter(model, tparams, draft, P_B, root_h_BD, cache, shape.topk, S_commit)
    tree, carry = grow_tree(root_logp_BV, step, shape, carry)
    tokens = eagle.draft_to_target_ids(draft.d2t, jnp.maximum(tree.tokens, 0))
    tokens = tokens.at[:, 0].set(root_B)
    return dataclasses.replace(tree, tokens=tokens), carry.cache


# ---------------------------------------------------------------------------
# Target side


def verify(model, tparams, draft: Draft, state: SpecState, tree: DraftTree, branching: bool = False):
    """Target forward over the tree: logits [B,N,V], aux [B,N,A], cache with nodes at slots P+i.

    `branching` (a tree with siblings, `SpecConfig.topk` > 1): the attention kernel reads each node's
    ancestors at the slots a decode step has them (`kernels.mla_attention.window_of_tree`), so that a
    node's logits have the decode step's bits; a chain's nodes are there already."""
    N = tree.tokens.shape[1]
    P = state.P_B
    mask = tree_mask(P, tree.mask, state.target_cache.max_len)
    write = P[:, None] + jnp.arange(N, dtype=jnp.int32)
    window = window_of_tree(P, tree.mask) if branching else None
    return model.apply(
        {"params": tparams},
        tree.tokens,
        tree.positions(P),
        state.target_cache,
        write,
        mask,
        draft.aux_ids,
        window=window,
    )


def accept_greedy(tree: DraftTree, logits_BNV, num_steps: int):
    """Walk down children equal to the target argmax. Returns (path [B,S] node per depth or -1, m [B], bonus [B])."""
    pred = jnp.argmax(logits_BNV, axis=-1).astype(jnp.int32)  # [B,N]
    B, N = pred.shape
    rows = jnp.arange(B)
    cur, alive, m, path = jnp.zeros(B, jnp.int32), jnp.ones(B, bool), jnp.zeros(B, jnp.int32), []
    for _ in range(num_steps):
        hit = (tree.parents == cur[:, None]) & (tree.tokens == pred[rows, cur][:, None])
        hit = hit & alive[:, None]
        found = hit.any(-1)
        nxt = jnp.argmax(hit, axis=-1).astype(jnp.int32)
        cur = jnp.where(found, nxt, cur)
        path.append(jnp.where(found, nxt, -1))
        m, alive = m + found, alive & found
    return jnp.stack(path, 1), m, pred[rows, cur]


def accept_sampling(tree: DraftTree, logits_BNV, num_steps: int, key, sp: SamplingParams):
    """Lossless recursive rejection over siblings (draft tokens treated as one-hot proposals).

    At the current node with target distribution p, children x1, x2, ... are tried in
    order: x accepted with probability p(x); on rejection x is removed from p and p is
    renormalised. If no child is accepted, the bonus is drawn from the residual p. The
    emitted token is therefore distributed exactly as p.
    """
    probs = target_probs(logits_BNV, sp)  # [B,N,V]
    B, N, V = probs.shape
    rows = jnp.arange(B)
    u = jax.random.uniform(key, (num_steps, N, B))
    cur, alive, m, path = jnp.zeros(B, jnp.int32), jnp.ones(B, bool), jnp.zeros(B, jnp.int32), []
    res = probs[:, 0]
    for d in range(num_steps):
        taken = jnp.zeros(B, bool)
        nxt = cur
        for j in range(1, N):
            cand = alive & ~taken & (tree.parents[:, j] == cur)
            x = tree.tokens[:, j]
            px = res[rows, x]
            ok = cand & (u[d, j] < px)
            drop = cand & ~ok
            removed = res.at[rows, x].set(0.0)
            removed = removed / jnp.maximum(removed.sum(-1, keepdims=True), 1e-30)
            res = jnp.where(drop[:, None], removed, res)
            nxt = jnp.where(ok, j, nxt)
            taken = taken | ok
        cur = nxt
        res = jnp.where(taken[:, None], probs[rows, cur], res)
        path.append(jnp.where(taken, cur, -1))
        m, alive = m + taken, alive & taken
    bonus = jax.random.categorical(jax.random.fold_in(key, 1), jnp.log(res), axis=-1).astype(jnp.int32)
    return jnp.stack(path, 1), m, bonus


# ---------------------------------------------------------------------------
# Commit


def commit_target_cache(cache: LatentCache, P_B, path_BS) -> LatentCache:
    """Move accepted nodes' latents (slot P+node) to consecutive slots P+1 .. P+m."""
    depth = jnp.arange(1, path_BS.shape[1] + 1, dtype=jnp.int32)[None]
    src = P_B[:, None] + jnp.where(path_BS >= 0, path_BS, depth)
    dst = P_B[:, None] + depth
    return LatentCache(move_slots(cache.latent_LBSC, src, dst, lead=1))


@dataclasses.dataclass(frozen=True)
class Speculative:
    """Speculative decoding as a `jaxspec.loop` method: weights are (target params, `Draft`),
    caches (target `LatentCache`, `DraftCache`); a step is one cycle (module docstring)."""

    model: Transformer
    sp: SamplingParams
    max_new: int
    spec: SpecConfig
    prefill_chunk: int = 0  # prompt tokens per prefill forward and draft extend (0: the whole prompt)

    name = "speculative"

    def cache_lengths(self, max_prompt: int) -> tuple[int, int]:
        """(target cache slots, draft cache slots) for prompts of up to `max_prompt` tokens."""
        return cache_lengths(max_prompt, self.max_new, self.spec)

    def start(self, weights, prompt_BP, prompt_len_B, caches, key, stop_ids) -> SpecState:
        """Prefill the target (capturing aux states), emit the first token, extend the draft over the prompt.

        With prefill_chunk > 0 both the target prefill and the draft extend run the
        prompt in chunks of that many tokens (`decode.prefill`).
        """
        (tparams, draft), (target_cache, draft_cache) = weights, caches
        model, B = self.model, prompt_BP.shape[0]
        logits, target_cache, aux = prefill(
            model, tparams, prompt_BP, prompt_len_B, target_cache, draft.aux_ids, chunk=self.prefill_chunk
        )
        key, sub = jax.random.split(key)
        first = sample(logits, sub, self.sp)
        # Draft input at q: target state at q and the token at q+1 (the prompt shifted, then the first token).
        nxt = jnp.concatenate([prompt_BP[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
        nxt = nxt.at[jnp.arange(B), prompt_len_B - 1].set(first)
        root_logp, root_h, draft_cache = extend_prompt(
            model, tparams, draft, draft_cache, aux, nxt, prompt_len_B, target_cache.max_len, self.prefill_chunk
        )
        state = SpecState(
            **loop.fresh(B, self.max_new + self.spec.num_steps + 1, key),
            P_B=prompt_len_B,
            root_B=first,
            target_cache=target_cache,
            draft_cache=draft_cache,
            root_logp_BV=root_logp,
            root_h_BD=root_h,
            row_cycles_B=jnp.zeros(B, jnp.int32),
            accept_log_BC=jnp.full((B, self.max_new), -1, jnp.int32),
            accepted_B=jnp.zeros(B, jnp.int32),
        )
        return loop.append_tokens(state, first[:, None], jnp.ones(B, jnp.int32), stop_ids, self.max_new)

    def step(self, weights, state: SpecState, stop_ids) -> SpecState:
        """One cycle: draft a tree, verify it, accept, commit, extend the draft."""
        (tparams, draft), model, spec = weights, self.model, self.spec
        shape, S_steps = spec.tree, spec.num_steps
        S_commit = state.target_cache.max_len
        B = state.P_B.shape[0]
        key, k_acc = jax.random.split(state.key)
        with jax.named_scope("draft"):
            tree, draft_cache = draft_tree(model, tparams, draft, state, shape, S_commit)
        with jax.named_scope("verify"):
            logits, target_cache, aux = verify(model, tparams, draft, state, tree, spec.topk > 1)
        with jax.named_scope("accept"):
            if self.sp.greedy:
                path, m, bonus = accept_greedy(tree, logits, S_steps)
            else:
                path, m, bonus = accept_sampling(tree, logits, S_steps, k_acc, self.sp)
        with jax.named_scope("commit"):
            live = ~state.done_B
            target_cache = commit_target_cache(target_cache, state.P_B, path)
            path_tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(path, 0), axis=1)
            d = jnp.arange(S_steps + 1)[None]
            new_tokens = jnp.where(d < m[:, None], jnp.pad(path_tokens, ((0, 0), (0, 1))), 0)
            new_tokens = jnp.where(d == m[:, None], bonus[:, None], new_tokens)  # [B, S+1]
            appended = loop.append_tokens(state, new_tokens, m + 1, stop_ids, self.max_new)
            nodes = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.maximum(path, 0)], axis=1)
            aux_acc = jnp.take_along_axis(aux, nodes[..., None], axis=1)  # [B, S+1, A]
        with jax.named_scope("draft_extend"):
            root_logp, root_h, draft_cache = draft_extend(
                model, tparams, draft, draft_cache, aux_acc, new_tokens, state.P_B, m + 1, S_commit
            )
        with jax.named_scope("commit"):
            keep = lambda new, old: jnp.where(live.reshape((B,) + (1,) * (new.ndim - 1)), new, old)
            produced = jnp.where(live, m + 1, -1)[:, None]
            return appended.replace(
                P_B=keep(state.P_B + m + 1, state.P_B),
                root_B=keep(bonus, state.root_B),
                target_cache=target_cache,
                draft_cache=draft_cache,
                root_logp_BV=keep(root_logp, state.root_logp_BV),
                root_h_BD=keep(root_h, state.root_h_BD),
                key=key,
                steps=state.steps + 1,
                row_cycles_B=state.row_cycles_B + live,
                accept_log_BC=write_slots(state.accept_log_BC, produced, state.row_cycles_B[:, None]),
                accepted_B=state.accepted_B + jnp.where(live, m + 1, 0),
            )


# ---------------------------------------------------------------------------
# Prompt extend


def extend_prompt(
    model, tparams, draft: Draft, cache, aux_BPA, next_tokens_BP, prompt_len_B, S_commit: int, chunk: int = 0
):
    """`draft_extend` over whole prompts (positions 0 .. len-1), in chunks of `chunk` tokens when 0 < chunk < P.

    Returns (root_logp, root_h) at each row's last prompt position, and the cache.
    """
    if draft.local:
        return _on_every_device(
            draft,
            lambda d, *a: _extend_prompt(None, None, d, *a, S_commit, chunk),
            draft,
            cache,
            aux_BPA,
            next_tokens_BP,
            prompt_len_B,
        )
    return _extend_prompt(model, tparams, draft, cache, aux_BPA, next_tokens_BP, prompt_len_B, S_commit, chunk)


def _extend_prompt(
    model, tparams, draft: Draft, cache, aux_BPA, next_tokens_BP, prompt_len_B, S_commit: int, chunk: int
):
    B, P = next_tokens_BP.shape
    C = loop.chunk_size(P, chunk)
    pad = -(-P // C) * C - P
    aux = jnp.pad(aux_BPA, ((0, 0), (0, pad), (0, 0)))
    nxt = jnp.pad(next_tokens_BP, ((0, 0), (0, pad)))

    def extend_chunk(cache, start):
        logp, h, cache = _draft_extend(
            model,
            tparams,
            draft,
            cache,
            jax.lax.dynamic_slice_in_dim(aux, start, C, axis=1),
            jax.lax.dynamic_slice_in_dim(nxt, start, C, axis=1),
            jnp.full((B,), start, jnp.int32),
            jnp.clip(prompt_len_B - start, 0, C),
            S_commit,
        )
        return cache, (logp, h), None

    cache, (logp, h), _ = loop.scan_chunks(extend_chunk, cache, P, chunk, prompt_len_B - 1)
    return logp, h, cache


def cache_lengths(max_prompt: int, max_new: int, spec: SpecConfig) -> tuple[int, int]:
    """(target cache slots, draft cache slots incl. the tree scratch region). The target's equals plain
    decoding's where the tree's slack fits `loop.SHARED_SLACK` (`loop.cache_slots`)."""
    target = loop.cache_slots(max_prompt + max_new, spec.num_draft_tokens + spec.num_steps + 2)
    return target, target + (spec.num_steps - 1) * spec.topk
