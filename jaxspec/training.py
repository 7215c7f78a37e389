"""Training of small targets and of EAGLE-3 drafts (training-time test), with optax.

Used by the demo-pair scripts, by `python -m jaxspec.train_draft`, and by the
tests that need a draft which really predicts its target.

Draft training follows EAGLE-3's training-time test: every position t of a
sequence is unrolled for `ttt_steps` draft steps. Step 0 sees fc(target aux
states at t) and the embedding of token t+1; step k sees the draft's own h from
step k-1 and the embedding of token t+1+k, at position t+k, attending to the
step-0 entries 0..t plus its own entries of steps 1..k, exactly the attention
pattern of tree drafting. Each step is trained to predict the target's argmax
for token t+2+k (the target's own next-token choice, mapped to the draft vocab).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec import draft as eagle
from jaxspec.layers import causal_mask
from jaxspec.model import Transformer, init_cache

# ---------------------------------------------------------------------------
# Target


def target_forward(model: Transformer, params, tokens_BT, capture=()):
    """Causal forward over whole sequences: (logits [B,T,V], aux or None)."""
    B, T = tokens_BT.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = causal_mask(pos, T)
    dtype = params["embed"]["embedding"].dtype
    logits, _, aux = model.apply(
        {"params": params}, tokens_BT, pos, init_cache(model.cfg, B, T, dtype), pos, mask, capture
    )
    return logits, aux


def lm_loss(model, params, tokens_BT):
    logits, _ = target_forward(model, params, tokens_BT)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens_BT[:, 1:]).mean()


def lr_schedule(peak: float, total: int, warmup: int = 20) -> optax.Schedule:
    """The trainers' learning-rate schedule (optax): linear warmup from 0 to `peak` over
    min(`warmup`, total // 10, at least 1) steps, then cosine decay to peak / 10 at step `total`."""
    warm = min(warmup, max(total // 10, 1))
    # optax wants a cosine phase of at least one step; a run of `warm` steps or fewer never reaches it.
    return optax.warmup_cosine_decay_schedule(0.0, peak, warm, max(total, warm + 1), peak * 0.1)


@functools.lru_cache(maxsize=8)
def _compiled_schedule(peak: float, total: int, warmup: int):
    return jax.jit(lr_schedule(peak, total, warmup))


def lr_at(step: int, peak: float, total: int, warmup: int = 20) -> jax.Array:
    """`lr_schedule(peak, total, warmup)` at `step`, as a float32 scalar for `train_step`.

    Computed on the device without waiting for it (a run's `total` may change while it trains,
    as with a time budget, so the rate is an argument of the step rather than optimizer state)."""
    return _compiled_schedule(float(peak), int(total), int(warmup))(step)


CLIP_NORM = 1.0  # gradients are clipped to this global norm
WEIGHT_DECAY = 0.01  # AdamW's


def make_optimizer():
    """The trainers' optimizer: gradients clipped to global norm CLIP_NORM, then AdamW (WEIGHT_DECAY)
    whose learning rate the caller sets for every step (`with_lr`, done by `train_step`) from `lr_schedule`.

    The step function takes the rate as an argument, so a schedule whose length is only known
    after training started (a time budget) costs no recompilation.
    """
    return optax.chain(
        optax.clip_by_global_norm(CLIP_NORM),
        optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=WEIGHT_DECAY),
    )


def with_lr(opt_state, lr):
    """`opt_state` of `make_optimizer` with its learning rate replaced by `lr` (traceable)."""
    clip_state, adam_state = opt_state
    hyper = dict(adam_state.hyperparams)
    hyper["learning_rate"] = jnp.asarray(lr, hyper["learning_rate"].dtype)
    return clip_state, adam_state._replace(hyperparams=hyper)


@functools.partial(jax.jit, static_argnames=("loss_fn",), donate_argnames=("params", "opt_state"))
def train_step(loss_fn, params, opt_state, lr, batch):
    """One optimizer step of `make_optimizer` at learning rate `lr`, shared by the trainers.

    loss_fn(params, batch) -> (loss, metrics) is each trainer's own loss (`LMLoss`, `DraftTTTLoss`);
    it is a static argument, so it must be hashable and compare equal across calls that may share
    a compilation (a frozen dataclass of static settings). `batch` is any tree of arrays (frozen
    weights included: as an argument they are not baked into the executable). `params` and
    `opt_state` are donated. Returns (params, opt_state, loss, metrics).
    """
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, opt_state = make_optimizer().update(grads, with_lr(opt_state, lr), params)
    return optax.apply_updates(params, updates), opt_state, loss, metrics


@dataclasses.dataclass(frozen=True)
class LMLoss:
    """Next-token cross-entropy of a target on `batch` = tokens [B, T] (no metrics)."""

    model: Transformer

    def __call__(self, params, tokens_BT):
        return lm_loss(self.model, params, tokens_BT), None


@dataclasses.dataclass(frozen=True)
class DraftTTTLoss:
    """EAGLE-3 training-time-test loss of a draft on a frozen target (`draft_ttt_loss`).

    `batch` = (target params, target-to-draft id map [V] (`target_to_draft_ids`), tokens [B, T]);
    the labels are the target's own argmax predictions mapped to the draft vocab. Metrics: the
    per-step accuracy [ttt_steps].
    """

    model: Transformer
    dcfg: eagle.DraftConfig
    aux_ids: tuple[int, int, int]  # target layers whose outputs feed the draft
    ttt_steps: int
    step_decay: float = 1.0

    def __call__(self, dparams, batch):
        tparams, to_draft_V, tokens_BT = batch
        logits, aux = target_forward(self.model, tparams, tokens_BT, self.aux_ids)
        labels = to_draft_V[jnp.argmax(logits, -1)]  # target's own next-token choice, -1 outside the draft vocab
        aux = jax.lax.stop_gradient(aux)
        embed = tparams["embed"]["embedding"]
        return draft_ttt_loss(dparams, self.dcfg, embed, aux, tokens_BT, labels, self.ttt_steps, self.step_decay)


def _fresh(tree):
    """A copy of `tree` on the device, so that `train_step` may donate it without touching the caller's."""
    return jax.tree.map(jnp.array, tree)


class StepBudget:
    """Fixes a run's total step count from a wall-clock budget.

    Call `update(step, value)` after every step with an output of that step; it
    returns the run's total step count. The first `skip` steps (compilation, and
    any recompilation as buffers settle) are not timed; the rate measured over
    the next 20 steps sets total = min(max_steps, step + remaining / seconds_per_step),
    and the rate over the 100 steps after that refines it once (the schedule has
    barely moved by then). Until the first estimate the total is `max_steps`. The
    run is also stopped (total = step) once the budget is overspent by 10%.
    """

    def __init__(self, seconds: float, max_steps: int, skip: int = 5, windows: tuple[int, ...] = (20, 100)):
        self.seconds, self.total, self.max_steps = seconds, max_steps, max_steps
        self.t0 = time.perf_counter()
        self._points = [skip]
        for w in windows:
            self._points.append(self._points[-1] + w)
        self._last: tuple[int, float] | None = None

    def update(self, step: int, value) -> int:
        if step in self._points or step % 50 == 0:
            jax.block_until_ready(value)
            now = time.perf_counter()
            if step in self._points:
                if self._last is not None:
                    per_step = (now - self._last[1]) / (step - self._last[0])
                    remaining = self.seconds - (now - self.t0)
                    self.total = max(step, min(self.max_steps, step + int(remaining / per_step)))
                self._last = (step, now)
            if now - self.t0 > 1.1 * self.seconds:
                self.total = step
        return self.total


def train_target(model: Transformer, params, batches: Iterator[np.ndarray], steps: int, lr: float = 3e-3, log=None):
    """Plain next-token training; returns (params, last loss)."""
    params = _fresh(params)
    opt_state = make_optimizer().init(params)
    loss_fn = LMLoss(model)
    loss = None
    for i in range(steps):
        params, opt_state, loss, _ = train_step(loss_fn, params, opt_state, lr_at(i, lr, steps), next(batches))
        if log is not None:
            log(i, float(loss))
    return params, float(loss)


# ---------------------------------------------------------------------------
# Draft vocabulary


def vocab_map(token_counts: np.ndarray, draft_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The `draft_vocab` most frequent target tokens: (d2t int64 [Vd], t2d bool [V]).

    Draft id i stands for target id i + d2t[i]; draft ids follow increasing target ids.
    """
    V = len(token_counts)
    if not 0 < draft_vocab <= V:
        raise ValueError(f"draft_vocab must be in [1, {V}], found {draft_vocab}")
    keep = np.sort(np.argsort(-np.asarray(token_counts), kind="stable")[:draft_vocab])
    t2d = np.zeros(V, bool)
    t2d[keep] = True
    return (keep - np.arange(draft_vocab)).astype(np.int64), t2d


def target_to_draft_ids(t2d: np.ndarray) -> np.ndarray:
    """[V] int32: draft id of each target token, -1 where the draft vocab lacks it."""
    out = np.full(len(t2d), -1, np.int32)
    out[np.nonzero(t2d)[0]] = np.arange(int(t2d.sum()), dtype=np.int32)
    return out


# ---------------------------------------------------------------------------
# Draft (training-time test)


def ttt_mask(n: int, steps: int) -> jax.Array:
    """[steps, n, steps*n] attention masks of the unrolled draft steps (cache block k = step k)."""
    t = jnp.arange(n)
    slot = jnp.arange(steps * n)
    block, col = slot // n, slot % n
    masks = []
    for k in range(steps):
        first = (block == 0)[None, :] & (col[None, :] <= t[:, None])
        own = (block >= 1)[None, :] & (block <= k)[None, :] & (col[None, :] == t[:, None])
        masks.append(first | own)
    return jnp.stack(masks)


def _ttt_unroll(dparams, dcfg, embed, aux_BTA, tokens_BT, ttt_steps: int):
    """Yields (k, logits [B, n, Vd]) of the unrolled draft steps; row t of step k predicts token t+2+k."""
    B, T = tokens_BT.shape
    n = T - 1 - ttt_steps
    if n < 1:
        raise ValueError(f"sequence length {T} too short for {ttt_steps} draft steps")
    masks = ttt_mask(n, ttt_steps)
    cache = eagle.init_draft_cache(dcfg, B, ttt_steps * n, embed.dtype)
    h = eagle.project_aux(dparams, dcfg, aux_BTA[:, :n])
    t = jnp.arange(n, dtype=jnp.int32)
    for k in range(ttt_steps):
        emb = jnp.take(embed, tokens_BT[:, 1 + k : 1 + k + n], axis=0)
        pos = jnp.broadcast_to(t + k, (B, n))
        slots = jnp.broadcast_to(k * n + t, (B, n))
        logits, h, cache = eagle.draft_forward(
            dparams, dcfg, emb, h, pos, cache, slots, jnp.broadcast_to(masks[k], (B, n, ttt_steps * n))
        )
        yield k, logits


def draft_ttt_loss(dparams, dcfg, embed, aux_BTA, tokens_BT, labels_BT, ttt_steps: int, step_decay: float = 1.0):
    """CE averaged over the unrolled steps, step k weighted by step_decay**k (weights
    normalised to sum to 1); also returns per-step accuracy [ttt_steps].

    labels_BT[b, p]: draft-vocab id of the target's prediction for token p+1 (-1: ignore).
    Row t at step k predicts labels[t+1+k]. A decay below 1 favours the early steps,
    which every speculative cycle uses, over the late ones, which only long chains reach.
    """
    n = tokens_BT.shape[1] - 1 - ttt_steps
    losses, accs = [], []
    for k, logits in _ttt_unroll(dparams, dcfg, embed, aux_BTA, tokens_BT, ttt_steps):
        lab = labels_BT[:, 1 + k : 1 + k + n]
        valid = lab >= 0
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(lab, 0))
        losses.append(jnp.sum(ce * valid) / jnp.maximum(valid.sum(), 1))
        accs.append(jnp.sum((jnp.argmax(logits, -1) == lab) & valid) / jnp.maximum(valid.sum(), 1))
    weights = jnp.asarray([step_decay**k for k in range(ttt_steps)], jnp.float32)
    return jnp.sum(weights * jnp.stack(losses)) / jnp.sum(weights), jnp.stack(accs)


def draft_ttt_hits(dparams, dcfg, embed, aux_BTA, tokens_BT, labels_BT, ttt_steps: int):
    """bool [B, n, ttt_steps]: whether row t's step-k argmax equals labels[t+1+k].

    On text the target wrote greedily, this is what a chain speculative decode sees:
    a cycle whose root sits at position r drafts rows r-1, steps 0, 1, ... and accepts
    the leading hits (each accepted token is the one the next step was fed).
    """
    n = tokens_BT.shape[1] - 1 - ttt_steps
    return jnp.stack(
        [
            jnp.argmax(logits, -1) == labels_BT[:, 1 + k : 1 + k + n]
            for k, logits in _ttt_unroll(dparams, dcfg, embed, aux_BTA, tokens_BT, ttt_steps)
        ],
        -1,
    )


def train_draft(
    model: Transformer,
    tparams,
    dcfg,
    dparams,
    aux_ids,
    t2d: np.ndarray,
    batches: Iterator[np.ndarray],
    steps: int,
    ttt_steps: int = 3,
    lr: float = 3e-3,
    log=None,
):
    """Train draft params on the frozen target's aux states and argmax labels.

    Returns (params, last loss, last per-step accuracy).
    """
    to_draft = jnp.asarray(target_to_draft_ids(t2d))
    dparams = _fresh(dparams)
    opt_state = make_optimizer().init(dparams)
    loss_fn = DraftTTTLoss(model, dcfg, tuple(int(i) for i in aux_ids), ttt_steps)
    loss = acc = None
    for i in range(steps):
        batch = (tparams, to_draft, jnp.asarray(next(batches)))
        dparams, opt_state, loss, acc = train_step(loss_fn, dparams, opt_state, lr_at(i, lr, steps), batch)
        if log is not None:
            log(i, float(loss), np.asarray(acc))
    return dparams, float(loss), np.asarray(acc)
