"""python -m jaxspec.tune --model DIR [--prompts FILE] [--batch 1 8 32] [--time-budget S]

Chooses the speculative settings (steps / topk / draft tokens, or plain decoding) per batch
size from measurements on the present devices, and writes them to DIR/spec_config.json, where
`python -m jaxspec.generate` and `Engine.generate(spec="auto")` find them.

Costs
-----
Per batch size B, each (but the plain step and the whole cycles: below) as device time inside
one compiled loop (n + 1 repetitions against one, difference / n, fastest of --reps runs, a
non-positive difference timed again with more repetitions: `jaxspec.timing.loop_time`), on a
state prefilled with the sample prompts, every loop state
carried from one repetition to the next as the real loop does, with caches sized for those
prompts plus --max-new-tokens (shapes are static: attention reads the whole cache, so a longer
context costs more):

* plain: one plain decode step;
* verify(N): one tree-masked target forward over N tokens per row (root included), N = 1..16;
* draft(S, K): drafting a tree of S steps and frontier width K (S - 1 draft forwards over
  B x K tokens, plus the top-k and tree bookkeeping), measured at S = 1 and the largest S and
  taken as linear in S between;
* extend(W): the draft extend over W = steps + 1 accepted tokens (W = 2..7);
* whole cycles of the chains of 3, 6 and 1 steps: what they cost beyond draft + verify + extend
  (accept, commit, the loop's own updates) is the per-cycle overhead, piecewise linear in the
  step count through those points and the same for chains and trees of a step count.

The plain step and the whole cycles are timed in the real loop, not inside `loop_time`'s: a
`Session.run` (the compiled `loop.run_loop`: its `while_loop` with the every-row done check, the
output append, the donated state) on a session prepared for that setting (its own cache and
buffer shapes), rows stopping only at --max-new-tokens, once for one iteration and once for the
whole generation (N iterations, read back): per iteration (t(N) - t(1)) / (N - 1), and what a
call costs beyond its iterations (dispatch, the loop's entry and exit), t(1) - per iteration.
`loop_time` cancels that per-call cost by design, but a generation pays it once, spread over
only N iterations (about 20 cycles of 64 tokens); the per-call cost of a speculative setting is
taken as the median of the measured ones.

A cycle of (S, K, N) is predicted to take draft(S, K) + verify(N) + extend(S + 1) + overhead(S)
(a whole cycle that was measured takes what it measured); between two measured points a cost is
interpolated linearly, and a setting that needs a cost outside the measured points (the time
budget ran out) is not considered. Timing noise (other work on the machine) only ever adds time,
so the measurements every prediction rests on (plain step, the chain costs, the 3/1/4 cycle) and
any verify or extend point that costs more than a larger one by over 15% are measured a second
time at the end, time permitting, and the faster of the two kept.

Acceptance (the estimator)
--------------------------
The target generates its own greedy continuation of each sample prompt (by default the
built-in held-out prompts `jaxspec/demo/heldout_prompts.json`). One target forward over
prompt + continuation gives the aux states, and one draft pass over them gives the draft's
cache, hidden state and log-probs at every position: what the speculative loop holds after
committing those tokens (the aux states come from a prefill instead of the verify passes;
they differ by rounding only). From every root position t of the continuation:

* teacher-forced ranks: the draft rolled out along the target's own next 6 tokens (each
  step's input is the target's token, the draft's hidden state carried, as a tree drafts the
  node on the target's path) gives the rank r_d of the target's token among the draft's
  candidates at depth d = 1..6 (a token outside the draft vocabulary has none). The profile
  p_K(d, j) = P(r_d = j | r_1 .. r_{d-1} <= K) is the per-rank acceptance of tree children
  (the chance that the target's token is the j-th child of the node on its path, given that
  path is in reach of a K-wide tree); K = 1 is the chain's conditional acceptance per depth.
* replay: the loop's own tree drafting (`jaxspec.tree` steps, the draft on each frontier) for
  K = 1..4 and 6 steps records every candidate's score, token and parent; any (S, K, N) tree is
  the best N - 1 of its first K + (S - 1) K^2 candidates, and greedy verification accepts the
  longest path of the target's tokens in it. That is exact for greedy decoding of these
  continuations (up to rounding), for every setting at once.

A cycle's expected tokens (bonus included) is then averaged as the loop meets the roots: from
each continuation's first token, jump by the tokens accepted there, so that stretches the draft
predicts well count once per cycle, not once per position (what `mean_accept_len` measures).
Assumptions: greedy verification (sampling accepts differently), the sample prompts stand for
the traffic, and rows of a batch accept independently. Where no replay exists (a profile given
by hand, as in the tests), a positional model of p_K stands in: a node reached by ranks
j_1 .. j_d is accepted with probability prod_i p_K(i, j_i) (a depth's rank does not depend on
its ancestors' exact ranks), and the draft keeps the tree that `jaxspec.tree` keeps with those
probabilities as scores.

The profile also keeps, per setting, the distribution of the tokens those replayed cycles emitted
(P(l), l = 1 .. steps + 1), whose mean is the table's. Without a replay, the positional model
gives it: the target's path is one path, so P(at least d accepted) is the sum of the kept depth-d
nodes' probabilities (for a chain: P(l) = a_1 .. a_{l-1} (1 - a_l)).

Prediction, for every setting with steps 1..6, topk 1..4 and draft tokens up to 16 (a chain has
steps + 1) and for plain decoding:

* steady state (`steady_tok_s`): B x expected tokens per cycle / cycle time (plain: B / step
  time), what a loop that never ends would reach;
* generations of --max-new-tokens M (`tok_s`), as `scripts/bench_spec.py` measures them (the
  tokens emitted after the prefill's first, B x (M - 1), over the loop call's time): the call
  costs its per-call cost plus E[iterations] x cycle time, where E[iterations] is the expected
  number of cycles until the slowest of B rows has its M tokens (the batch runs until every row
  is done): exactly, from the distribution of one row's tokens so far cycle by cycle (capped at
  M - 1, as the loop caps a row), its CDF F(c) of cycles to finish, and E[max of B] =
  sum_c (1 - F(c)^B). Plain decoding takes exactly M - 1 steps. Rows are taken as independent,
  each cycle's tokens drawn from the setting's distribution (a batch of repeated or alike prompts
  has a shorter tail; a mixed one of easier and harder prompts a longer one).

The best `tok_s` is the pick for that batch size (of settings within 1% of the best, the
simplest: plain decoding, else the fewest draft tokens, smallest topk, fewest steps).

Using it
--------
DIR/spec_config.json records what was measured (costs, profile, the best predictions), on
which device kind and count, dtype and draft placement, with which jax version, the model's
fingerprint, and the pick per batch size. `generate` (when none of --steps/--topk/
--draft-tokens is given) and `Engine.generate(spec="auto")` take the pick of the nearest
measured batch size at or above the batch at hand (the largest measured one above all of
them) and say which and why (one line on stderr; `stats["spec_choice"]`). Without the file
they use 3/1/4 (SGLang's default for DeepSeek-family targets). A file measured for another
model (fingerprint) or another device kind, device count, dtype or draft placement is ignored
with a warning.

The time budget counts from after loading the model. Measurements run in order of use: the
first batch size's plain step, the acceptance, what every batch size needs for chains (verify
at 2 and 7 tokens, draft at 1 and 6 steps, extend at 2 and 7 tokens, one 3/1/4 cycle), then
trees and the remaining points; a measurement that would not fit in what is left is skipped and
recorded as such. When not even the first batch size's chain measurements fit, it stops with an
error saying how long they would take.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import cli
from jaxspec.cli import UsageError
from jaxspec.dtypes import COMPUTE_DTYPES

MAX_STEPS, MAX_TOPK, MAX_TOKENS, DEPTH = 6, 4, 16, 6
CONFIG_FILE = "spec_config.json"
FORMAT = 1
DEFAULT = (3, 1, 4)
MISS = 99  # rank of a target token the draft cannot propose
log = logging.getLogger("jaxspec")


class TuneError(UsageError):
    """A setting or input the tuner cannot use; the message names the flag or path, expected and found."""


# ---------------------------------------------------------------------------
# Acceptance profile and prediction (pure Python: no devices)


@dataclasses.dataclass(frozen=True)
class AcceptanceProfile:
    """What the prediction knows about acceptance.

    cond[K][d][j]: P(the target's token at depth d+1 is the draft's (j+1)-th child | depths <= d within the
    top K), from the teacher-forced ranks (K = 1 is the chain's conditional acceptance per depth).
    table[(steps, topk, draft tokens)]: tokens per cycle measured by replaying the loop's tree drafting on
    the sample continuations; where it has a setting it is used, elsewhere the positional model of `cond`.
    """

    cond: dict[int, tuple[tuple[float, ...], ...]]
    samples: int = 0
    table: dict = dataclasses.field(default_factory=dict)
    # dists[(steps, topk, draft tokens)][l - 1]: the share of the replayed cycles that emitted l tokens (bonus
    # included), l = 1 .. steps + 1, over the same cycles as `table`'s mean
    dists: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_ranks(cls, ranks, table=None, dists=None) -> AcceptanceProfile:
        """ranks [n, depth]: the rank (1 = the draft's best) of the target's token at each depth."""
        ranks = np.asarray(ranks)
        n, depth = ranks.shape
        cond = {}
        for k in range(1, MAX_TOPK + 1):
            alive = np.ones(n, bool)
            rows = []
            for d in range(depth):
                m = int(alive.sum())
                rows.append(tuple(float(((ranks[:, d] == j + 1) & alive).sum() / m) if m else 0.0 for j in range(k)))
                alive &= ranks[:, d] <= k
            cond[k] = tuple(rows)
        return cls(cond, n, dict(table or {}), dict(dists or {}))

    def chain(self) -> list[float]:
        """Conditional acceptance per depth for a chain (topk 1)."""
        return [row[0] for row in self.cond[1]]

    def to_dict(self) -> dict:
        return {
            "samples": self.samples,
            "cond": {str(k): [list(r) for r in rows] for k, rows in self.cond.items()},
            "table": [[s, k, n, v] for (s, k, n), v in sorted(self.table.items())],
            "dists": [[s, k, n, list(p)] for (s, k, n), p in sorted(self.dists.items())],
        }

    @classmethod
    def from_dict(cls, d: dict) -> AcceptanceProfile:
        return cls(
            {int(k): tuple(tuple(float(x) for x in r) for r in rows) for k, rows in d["cond"].items()},
            int(d.get("samples", 0)),
            {(int(s), int(k), int(n)): float(v) for s, k, n, v in d.get("table", [])},
            {(int(s), int(k), int(n)): tuple(float(x) for x in p) for s, k, n, p in d.get("dists", [])},
        )


def expected_accept(profile: AcceptanceProfile, steps: int, topk: int, tokens: int) -> float:
    """Expected tokens per cycle (bonus included): the measured table's value, else the positional model."""
    if (steps, topk, tokens) in profile.table:
        return profile.table[(steps, topk, tokens)]
    return positional_accept(profile, steps, topk, tokens)


def positional_accept(profile: AcceptanceProfile, steps: int, topk: int, tokens: int) -> float:
    """Expected tokens per cycle of a (steps, topk, draft tokens) tree under the profile's positional model.

    Mirrors `jaxspec.tree.grow_tree` with acceptance probabilities as scores: the K children of a
    node ordered best first (ties: lower rank), the best K of a step's K*K children as the next
    frontier, the best `tokens - 1` of all candidates kept (ties: lower candidate index).
    """
    return 1.0 + sum(v for v, _ in _positional_kept(profile, steps, topk, tokens))


def _positional_kept(profile: AcceptanceProfile, steps: int, topk: int, tokens: int) -> list[tuple[float, int]]:
    """(acceptance probability, depth) of the kept candidates of `positional_accept`'s tree, best first."""
    p = profile.cond[topk]

    def children(d):
        vals = [p[d][j] for j in range(topk)]
        return [vals[j] for j in sorted(range(topk), key=lambda j: (-vals[j], j))]

    cands = children(0)
    depth = [1] * len(cands)
    frontier = list(cands)
    for d in range(1, steps):
        ch = children(d)
        step_vals = [f * c for f in frontier for c in ch]
        cands += step_vals
        depth += [d + 1] * len(step_vals)
        frontier = [step_vals[i] for i in sorted(range(len(step_vals)), key=lambda i: (-step_vals[i], i))[:topk]]
    kept = sorted(range(len(cands)), key=lambda i: (-cands[i], i))[: tokens - 1]
    return [(cands[i], depth[i]) for i in kept]


def positional_dist(profile: AcceptanceProfile, steps: int, topk: int, tokens: int) -> np.ndarray:
    """P(a cycle emits l tokens), l = 1 .. steps + 1, under the positional model of `positional_accept`.

    The target's token at depth d is one token, so at most one kept node of each depth is accepted and
    P(at least d accepted) = the sum of the kept depth-d nodes' probabilities (a kept node's ancestors are
    kept: a child never scores above its parent). For a chain that is P(l) = a_1 .. a_{l-1} (1 - a_l) with
    the conditional acceptances a_d per depth (and a_1 .. a_steps for l = steps + 1). Its mean is
    `positional_accept`.
    """
    at_least = np.zeros(steps + 2)
    at_least[0] = 1.0
    for v, d in _positional_kept(profile, steps, topk, tokens):
        at_least[d] += v
    at_least = np.minimum.accumulate(np.clip(at_least, 0.0, 1.0))
    return at_least[:-1] - at_least[1:]


def accept_dist(profile: AcceptanceProfile, steps: int, topk: int, tokens: int) -> np.ndarray:
    """P(a cycle emits l tokens), l = 1 .. steps + 1: the replayed cycles' shares where the profile has them,
    else the positional model (`positional_dist`)."""
    if (steps, topk, tokens) in profile.dists:
        return np.asarray(profile.dists[(steps, topk, tokens)], np.float64)
    return positional_dist(profile, steps, topk, tokens)


# ---------------------------------------------------------------------------
# The tail of a fixed-length batch


def cycles_cdf(dist, need: int) -> np.ndarray:
    """F[c] = P(one row has its `need` tokens after c cycles), c = 0 .. need, when every cycle emits l tokens
    with probability dist[l - 1] independently (l >= 1, so F[need] = 1).

    Exact: the distribution of the row's tokens so far, capped at `need` (a finished row emits nothing more,
    as `loop.append_tokens` caps a row at its budget), advanced one cycle at a time.
    """
    dist = np.asarray(dist, np.float64)
    F = np.ones(need + 1)
    if need <= 0:
        return F
    tail = np.cumsum(dist[::-1])[::-1]  # tail[j]: P(l >= j + 1)
    v = np.zeros(need + 1)
    v[0] = 1.0
    F[0] = 0.0
    for c in range(1, need + 1):
        nxt = np.zeros(need + 1)
        nxt[need] = v[need]
        for l, q in enumerate(dist, start=1):
            if q and l < need:
                nxt[l:need] += q * v[: need - l]
        # rows at t < need that reach `need` or beyond this cycle: P(l >= need - t)
        reach = np.arange(max(need - len(dist), 0), need)
        nxt[need] += np.sum(v[reach] * tail[need - reach - 1])
        v = nxt
        F[c] = v[need]
        if F[c] >= 1.0 - 1e-15:  # done for good (the rest would only add rounding)
            F[c:] = 1.0
            break
    return F


def expected_cycles(dist, max_new: int, batch: int) -> float:
    """Expected loop iterations until every one of `batch` independent rows has `max_new` tokens.

    The first token of a row comes from the prefill (`start`), so the loop's iterations must add
    max_new - 1 more: with N_b the cycles row b needs (`cycles_cdf`), the loop runs max_b N_b and
    E[max] = sum over c >= 0 of (1 - F(c)^batch). One token per step (plain decoding) gives max_new - 1.
    """
    need = max_new - 1
    if need <= 0:
        return 0.0
    F = cycles_cdf(dist, need)
    return float(np.sum(1.0 - F[:need] ** batch))


def candidates(max_steps: int = MAX_STEPS, max_topk: int = MAX_TOPK, max_tokens: int = MAX_TOKENS):
    """Every valid (steps, topk, draft tokens): chains have steps + 1 tokens; trees 2 .. min(max, 1 + candidates)."""
    out = []
    for s in range(1, max_steps + 1):
        for k in range(1, max_topk + 1):
            if k == 1:
                if s + 1 <= max_tokens:
                    out.append((s, 1, s + 1))
                continue
            for n in range(2, min(max_tokens, 1 + k + (s - 1) * k * k) + 1):
                out.append((s, k, n))
    return out


def _interp(points: dict[int, float], x: int) -> float | None:
    """Piecewise-linear value at x between measured points; None outside them."""
    if x in points:
        return points[x]
    lo = [p for p in points if p < x]
    hi = [p for p in points if p > x]
    if not lo or not hi:
        return None
    a, b = max(lo), min(hi)
    return points[a] + (points[b] - points[a]) * (x - a) / (b - a)


@dataclasses.dataclass
class Costs:
    """Measured seconds for one batch size (see the module docstring)."""

    plain: float
    verify: dict[int, float]  # N -> s
    draft: dict[int, dict[int, float]]  # K -> {steps: s}
    extend: dict[int, float]  # accepted tokens W -> s
    cycles: dict = dataclasses.field(default_factory=dict)  # (steps, topk, tokens) -> s of a whole cycle
    # what one call of the real loop costs beyond its iterations (dispatch, the donated state, the loop's entry
    # and exit): "plain" or (steps, topk, tokens) -> s, from the timings of `Bench.plain` and `Bench.cycle`
    calls: dict = dataclasses.field(default_factory=dict)

    def _parts(self, steps: int, topk: int, tokens: int):
        parts = [self.draft_s(steps, topk), self.verify_s(tokens), self.extend_s(steps + 1)]
        return None if None in parts else sum(parts)

    def overhead(self, steps: int) -> float:
        """Per-cycle cost beyond draft + verify + extend (accept, commit, the loop's own updates): what the
        measured whole cycles took beyond their parts, piecewise linear in the step count through them
        (extended linearly past the outer ones; constant with one, 0 with none), never below 0."""
        pts = {}
        for (s, k, n), t in self.cycles.items():
            parts = self._parts(s, k, n)
            if parts is not None:
                pts[s] = t - parts
        if not pts:
            return 0.0
        xs = sorted(pts)
        if len(xs) == 1:
            return max(pts[xs[0]], 0.0)
        inside = _interp(pts, steps)
        if inside is not None:
            return max(inside, 0.0)
        a, b = (xs[0], xs[1]) if steps < xs[0] else (xs[-2], xs[-1])
        return max(pts[a] + (pts[b] - pts[a]) * (steps - a) / (b - a), 0.0)

    def verify_s(self, n: int):
        return _interp(self.verify, n)

    def draft_s(self, steps: int, topk: int):
        return _interp(self.draft.get(topk, {}), steps)

    def extend_s(self, width: int):
        return _interp(self.extend, width)

    def cycle_s(self, steps: int, topk: int, tokens: int):
        """A measured whole cycle as measured; any other as its parts plus the overhead."""
        if (steps, topk, tokens) in self.cycles:
            return self.cycles[(steps, topk, tokens)]
        parts = self._parts(steps, topk, tokens)
        return None if parts is None else parts + self.overhead(steps)

    def call_s(self, setting=None) -> float:
        """One real loop call's cost beyond its iterations: plain decoding's (setting None) as measured; for
        every speculative setting the median of the measured ones (what a call does around its iterations
        hardly depends on the tree, and the median keeps one disturbed timing out); 0 where none was measured."""
        if setting is None:
            return self.calls.get("plain", 0.0)
        spec = [t for c, t in self.calls.items() if c != "plain"]
        return float(np.median(spec)) if spec else 0.0

    def to_dict(self) -> dict:
        ms = lambda d: {str(k): v * 1e3 for k, v in sorted(d.items())}
        return {
            "plain_ms": self.plain * 1e3,
            "verify_ms": ms(self.verify),
            "draft_ms": {str(k): ms(v) for k, v in sorted(self.draft.items())},
            "extend_ms": ms(self.extend),
            "cycle_ms": {"/".join(map(str, c)): t * 1e3 for c, t in sorted(self.cycles.items())},
            "overhead_ms": {str(s): self.overhead(s) * 1e3 for s in range(1, MAX_STEPS + 1)},
            "call_ms": {
                (c if c == "plain" else "/".join(map(str, c))): t * 1e3
                for c, t in sorted(self.calls.items(), key=lambda x: (x[0] != "plain", str(x[0])))
            },
        }

    @classmethod
    def from_dict(cls, d: dict) -> Costs:
        s = lambda m: {int(k): v * 1e-3 for k, v in m.items()}
        return cls(
            d["plain_ms"] * 1e-3,
            s(d["verify_ms"]),
            {int(k): s(v) for k, v in d["draft_ms"].items()},
            s(d["extend_ms"]),
            {tuple(int(x) for x in c.split("/")): t * 1e-3 for c, t in d.get("cycle_ms", {}).items()},
            {
                (c if c == "plain" else tuple(int(x) for x in c.split("/"))): t * 1e-3
                for c, t in d.get("call_ms", {}).items()
            },
        )


def predict(
    costs: Costs,
    profile: AcceptanceProfile,
    batch: int,
    max_steps: int = MAX_STEPS,
    max_topk: int = MAX_TOPK,
    max_tokens: int = MAX_TOKENS,
    max_new: int | None = None,
) -> list[dict]:
    """Predicted tok/s of plain decoding and of every candidate whose costs were measured, best first.

    steady_tok_s: batch x expected tokens per cycle / cycle time (plain: batch / step time), what a loop
    that never ends would reach. With `max_new`, tok_s is what a batch of `batch` rows generating max_new
    tokens each (rows that never stop early) measures as `scripts/bench_spec.py` does: the max_new - 1
    tokens per row after the prefill's first, over the loop's time, one call of cost `Costs.call_s` plus
    the expected iterations until the slowest row has its tokens (`expected_cycles`, from the setting's
    distribution of tokens per cycle) times the cycle time; without it tok_s is the steady state.
    """

    def row(setting, accept, t, dist):
        r = {"accept": accept, "cycle_ms": t * 1e3, "steady_tok_s": batch * accept / t}
        if max_new is None:
            r["tok_s"] = r["steady_tok_s"]
            return r
        cycles = expected_cycles(dist, max_new, batch)
        loop_s = costs.call_s(setting) + cycles * t
        r.update(
            tok_s=batch * (max_new - 1) / loop_s if loop_s > 0 else 0.0,
            cycles=cycles,
            loop_ms=loop_s * 1e3,
            max_new_tokens=max_new,
        )
        return r

    rows = [{"mode": "plain", **row(None, 1.0, costs.plain, [1.0])}]
    for s, k, n in candidates(max_steps, max_topk, max_tokens):
        t = costs.cycle_s(s, k, n)
        if t is None or t <= 0:
            continue
        e = expected_accept(profile, s, k, n)
        dist = None if max_new is None else accept_dist(profile, s, k, n)
        rows.append({"mode": "spec", "steps": s, "topk": k, "draft_tokens": n, **row((s, k, n), e, t, dist)})
    rows.sort(key=lambda r: (-r["tok_s"], r.get("draft_tokens", 0), r.get("steps", 0), r.get("topk", 0)))
    return rows


TIE = 0.01  # settings within 1% of the best are taken as equal: the simplest of them is picked


def simplest(rows: list[dict]) -> dict:
    """Of the settings within TIE of the best predicted tok/s, the simplest: plain decoding, else the fewest
    draft tokens, then the smallest topk, then the fewest steps (equal trees drafted wider cost the same
    within noise; a speculative setting 1% ahead of plain decoding is not worth a draft)."""
    top = max(r["tok_s"] for r in rows)
    near = [r for r in rows if r["tok_s"] >= top * (1 - TIE)]
    return min(
        near, key=lambda r: (r["mode"] != "plain", r.get("draft_tokens", 0), r.get("topk", 0), r.get("steps", 0))
    )


def pick(
    costs: Costs,
    profile: AcceptanceProfile,
    batch: int,
    max_steps: int = MAX_STEPS,
    max_topk: int = MAX_TOPK,
    max_tokens: int = MAX_TOKENS,
    max_new: int | None = None,
) -> dict:
    """The setting for the batch size: the best predicted tok/s (`simplest` of those within 1% of it), for
    generations of `max_new` tokens when given (`predict`), else in the steady state."""
    rows = predict(costs, profile, batch, max_steps, max_topk, max_tokens, max_new)
    best = dict(simplest(rows))
    by_key = {(r.get("steps"), r.get("topk"), r.get("draft_tokens")): r for r in rows}
    best["plain_tok_s"] = by_key[(None, None, None)]["tok_s"]
    best["plain_steady_tok_s"] = by_key[(None, None, None)]["steady_tok_s"]
    default = by_key.get(DEFAULT)
    best["default_tok_s"] = None if default is None else default["tok_s"]
    best["default_steady_tok_s"] = None if default is None else default["steady_tok_s"]
    spec = [r for r in rows if r["mode"] == "spec"]
    best["best_spec"] = (
        None if not spec else {k: simplest(spec)[k] for k in ("steps", "topk", "draft_tokens", "tok_s", "steady_tok_s")}
    )
    return best


def _setting(r: dict) -> str:
    return "plain" if r["mode"] == "plain" else f"{r['steps']}/{r['topk']}/{r['draft_tokens']}"


# ---------------------------------------------------------------------------
# spec_config.json


def fingerprint(model_dir: str) -> str:
    """Identity of a converted checkpoint: its config, its COMPLETE summary, and the draft's files
    (relative path, size, first and last MiB each; the draft decides acceptance and is small)."""
    from jaxspec import checkpoint

    h = hashlib.sha256()
    for name in (checkpoint.CONFIG_FILE, checkpoint.MARKER):
        with open(os.path.join(model_dir, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    draft = os.path.join(model_dir, "draft")
    for root, dirs, files in os.walk(draft):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            h.update(f"{os.path.relpath(path, draft)}\0{size}\0".encode())
            with open(path, "rb") as f:
                h.update(f.read(1 << 20))
                if size > 2 << 20:
                    f.seek(-(1 << 20), os.SEEK_END)
                    h.update(f.read())
    return h.hexdigest()[:16]


def device_key(engine) -> dict:

    return {
        "platform": jax.default_backend(),
        "kind": jax.devices()[0].device_kind,
        "count": engine.mesh.size if engine.mesh is not None else 1,
        "dtype": engine.dtype,
        "draft_placement": engine.draft.placement if engine.draft is not None else None,
    }


def write_config(path: str, payload: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


def read_config(path: str) -> dict:
    """The parsed spec_config.json; TuneError when it does not parse or lacks what generate needs."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise TuneError(f"{path}: not valid JSON ({e})") from None
    if (
        not isinstance(data, dict)
        or data.get("format") != FORMAT
        or not isinstance(data.get("picks"), dict)
        or not data["picks"]
    ):
        raise TuneError(
            f"{path}: expected a jaxspec spec_config.json of format {FORMAT} with picks, found "
            + (
                f"format {data.get('format')}, picks {data.get('picks')!r:.40}"
                if isinstance(data, dict)
                else type(data).__name__
            )
        )
    return data


def stale_reason(data: dict, model_fp: str, device: dict) -> str | None:
    """Why a spec_config.json does not apply to this model and these devices, or None when it does."""
    if data.get("model", {}).get("fingerprint") != model_fp:
        return (
            f"it was measured for another model (fingerprint {data.get('model', {}).get('fingerprint')}, "
            f"this checkpoint is {model_fp})"
        )
    measured = data.get("device", {})
    for key in ("kind", "count", "dtype", "draft_placement"):
        if measured.get(key) != device.get(key):
            return f"it was measured with device {key} {measured.get(key)!r}, this run has {device.get(key)!r}"
    return None


@dataclasses.dataclass(frozen=True)
class Choice:
    """Speculative settings for a generation (None: plain decoding) and why."""

    spec: object
    reason: str
    warning: str | None = None


def _spec(steps, topk, tokens):
    from jaxspec.spec import SpecConfig

    return SpecConfig(steps, topk, tokens)


def explicit_choice(
    steps: int | None,
    topk: int | None,
    draft_tokens: int | None,
    flag_names: tuple[str, str, str] = ("--steps", "--topk", "--draft-tokens"),
) -> Choice | None:
    """The setting the given values ask for (missing ones from 3/1/4, a chain's draft tokens =
    steps + 1), None when none is given; TuneError naming the flags when they make no tree.
    Needs no model: a CLI checks its flags with it before loading one."""
    given = [n for n, v in zip(flag_names, (steps, topk, draft_tokens)) if v is not None]
    if not given:
        return None
    s = DEFAULT[0] if steps is None else steps
    k = DEFAULT[1] if topk is None else topk
    n = draft_tokens if draft_tokens is not None else (s + 1 if k == 1 else DEFAULT[2])
    try:
        spec = _spec(s, k, n)
    except ValueError as e:
        raise TuneError(f"{'/'.join(flag_names)} = {s}/{k}/{n}: {e}") from None
    return Choice(spec, f"speculative {s}/{k}/{n} (steps/topk/draft tokens): from {', '.join(given)}")


def choose(
    engine,
    batch: int,
    steps: int | None = None,
    topk: int | None = None,
    draft_tokens: int | None = None,
    no_spec: bool = False,
    flag_names: tuple[str, str, str] = ("--steps", "--topk", "--draft-tokens"),
) -> Choice:
    """The settings for `batch` rows: explicit values win (missing ones from 3/1/4, a chain's draft tokens =
    steps + 1), else the tuned pick in the checkpoint's spec_config.json, else 3/1/4."""
    if engine.draft is None:
        return Choice(None, "plain decoding: the checkpoint has no draft")
    if no_spec:
        return Choice(None, "plain decoding: --no-spec")
    explicit = explicit_choice(steps, topk, draft_tokens, flag_names)
    if explicit is not None:
        return explicit
    default = _spec(*DEFAULT)
    base = f"speculative {'/'.join(map(str, DEFAULT))} (steps/topk/draft tokens)"
    model_dir = getattr(engine, "path", None)
    if model_dir is None:
        return Choice(default, f"{base}: the default (the engine was not loaded from a checkpoint directory)")
    path = os.path.join(model_dir, CONFIG_FILE)
    if not os.path.exists(path):
        return Choice(
            default, f"{base}: the default, no {path} (`python -m jaxspec.tune --model {model_dir}` measures the best)"
        )
    try:
        data = read_config(path)
        why = stale_reason(data, fingerprint(model_dir), device_key(engine))
    except (TuneError, OSError) as e:
        why = str(e)
    if why is not None:
        warning = f"ignoring {path}: {why}; run `python -m jaxspec.tune --model {model_dir}` again"
        log.warning(warning)
        return Choice(default, f"{base}: the default ({path} ignored: {why})", warning)
    picks = {int(b): p for b, p in data["picks"].items()}
    at_or_above = [b for b in picks if b >= batch]
    b = min(at_or_above) if at_or_above else max(picks)
    p = picks[b]
    dev = data["device"]
    where = f"tuned for batch {b} by {path} ({dev['count']} x {dev['kind']}, {data.get('created', '?')[:10]})"
    if p["mode"] == "plain":
        best = p.get("best_spec")
        alt = (
            f", best speculative {best['steps']}/{best['topk']}/{best['draft_tokens']} {best['tok_s']:.1f}"
            if best
            else ""
        )
        return Choice(None, f"plain decoding: {where}: predicted {p['tok_s']:.1f} tok/s{alt}")
    spec = _spec(p["steps"], p["topk"], p["draft_tokens"])
    ref = f", 3/1/4 {p['default_tok_s']:.1f}" if p.get("default_tok_s") else ""
    return Choice(
        spec,
        f"speculative {_setting(p)} (steps/topk/draft tokens): {where}: predicted "
        f"{p['tok_s']:.1f} tok/s, plain {p['plain_tok_s']:.1f}{ref}",
    )


def resolve(engine, spec, batch: int):
    """`Engine.generate(spec="auto")`: (SpecConfig or None, the reason)."""
    if spec != "auto":
        raise ValueError(f"spec: expected None, a SpecConfig or 'auto', found {spec!r}")
    c = choose(engine, batch)
    return c.spec, c.reason


# ---------------------------------------------------------------------------
# Prompts


def builtin_prompts_path() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "heldout_prompts.json")


def load_prompts(path: str, flag: str = "--prompts") -> list:
    """Prompts from JSON (a list, or {"prompts": [...]}) or JSON lines (one prompt, or {"prompt"|"text": ...}, per
    line); a prompt is a non-empty string or a non-empty list of token ids."""
    expected = (
        'JSON (a list of prompts or {"prompts": [...]}) or JSON lines (a prompt or {"prompt": ...} per '
        "line), each prompt a non-empty string or list of token ids"
    )
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise TuneError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise TuneError(f"{flag} {path}: expected UTF-8 text, found {e.reason} at byte {e.start}") from None
    try:
        data = json.loads(text)
        items = data.get("prompts") if isinstance(data, dict) else data
    except json.JSONDecodeError as e:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        try:
            items = [json.loads(ln) for ln in lines]
        except json.JSONDecodeError:
            raise TuneError(f"{flag} {path}: expected {expected}; found text that is neither ({e})") from None
        items = [x.get("prompt", x.get("text")) if isinstance(x, dict) else x for x in items]
    if not isinstance(items, list) or not items:
        raise TuneError(
            f"{flag} {path}: expected {expected}; found {type(items).__name__ if items is not None else 'no prompts'}"
            + (" (empty)" if isinstance(items, list) else "")
        )
    for i, x in enumerate(items):
        ok = (isinstance(x, str) and x != "") or (
            isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        )
        if not ok:
            raise TuneError(
                f"{flag} {path}: prompt {i}: expected a non-empty string or list of token ids, "
                f"found {json.dumps(x)[:60]}"
            )
    return items


# ---------------------------------------------------------------------------
# Measurements (devices)


def _rank(logits, target):
    """1-based rank of `target` among `logits` along the last axis (ties: lower index first); MISS for target < 0."""

    x = jnp.maximum(target, 0)
    lx = jnp.take_along_axis(logits, x[..., None], axis=-1)
    idx = jnp.arange(logits.shape[-1])
    r = 1 + jnp.sum(logits > lx, -1) + jnp.sum((logits == lx) & (idx < x[..., None]), -1)
    return jnp.where(target < 0, MISS, r).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("model", "chunk"))
def _teacher_forced(model, tparams, draft, tokens_BT, lens_B, target_cache, draft_cache, t2d, chunk: int = 0):
    """Target aux states over whole sequences, then the draft's pass over them (state at q, token q+1).

    Returns (the rank of token t+1 under the draft's prediction at t-1, for every t [B,T]; draft
    log-probs [B,T,Vd] and h_out [B,T,D] at every position; the draft cache).
    """
    from jaxspec import decode
    from jaxspec import draft as eagle
    from jaxspec.layers import causal_mask
    from jaxspec.spec import embed_tokens

    B, T = tokens_BT.shape
    _, _, aux = decode.prefill(model, tparams, tokens_BT, lens_B, target_cache, draft.aux_ids, chunk=chunk)
    nxt = jnp.concatenate([tokens_BT[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = causal_mask(pos, draft_cache.k.shape[1])
    h = eagle.project_aux(draft.params, draft.cfg, aux)
    logits, h_out, cache = eagle.draft_forward(
        draft.params, draft.cfg, embed_tokens(model, tparams, draft, nxt), h, pos, draft_cache, pos, mask
    )
    logits = logits.astype(jnp.float32)
    # Root t: the draft's prediction at t-1 (state t-1, token t) proposes token t+1.
    tgt = jnp.take(t2d, jnp.concatenate([tokens_BT[:, 2:], jnp.zeros((B, 2), jnp.int32)], axis=1))
    ranks = _rank(logits, tgt)
    ranks = jnp.concatenate([jnp.full((B, 1), MISS, jnp.int32), ranks[:, :-1]], axis=1)
    return ranks, jax.nn.log_softmax(logits, axis=-1), h_out, cache


def _draft_step(model, tparams, draft, tokens_RK, h_RKD, pos_R, cache, write_RK, mask_RKS):
    from jaxspec import draft as eagle
    from jaxspec.spec import embed_tokens

    R, K = tokens_RK.shape
    logits, h, cache = eagle.draft_forward(
        draft.params,
        draft.cfg,
        embed_tokens(model, tparams, draft, tokens_RK),
        h_RKD,
        jnp.broadcast_to(pos_R[:, None], (R, K)),
        cache,
        write_RK,
        mask_RKS,
    )
    return logits.astype(jnp.float32), h, cache


@functools.partial(jax.jit, static_argnames=("model", "depth", "S_commit"))
def _forced_rollout(model, tparams, draft, seq_RT, root_R, h0_RD, cache, t2d, depth: int, S_commit: int):
    """Draft steps 1..depth-1 along the target's tokens from each root; ranks of the target's tokens [R, depth-1]."""
    from jaxspec.layers import prefix_span_mask

    R = seq_RT.shape[0]
    rows = jnp.arange(R)
    h = h0_RD[:, None]
    out = []
    for i in range(1, depth):
        tok = seq_RT[rows, root_R + i]
        write = jnp.full((R, 1), S_commit + i - 1, jnp.int32)
        # the committed slots below the root, and the chain's own scratch slots so far (steps 1 .. i)
        mask = prefix_span_mask(root_R, S_commit, i, cache.k.shape[1])
        logits, h, cache = _draft_step(model, tparams, draft, tok[:, None], h, root_R + i - 1, cache, write, mask)
        out.append(_rank(logits[:, 0], jnp.take(t2d, seq_RT[rows, root_R + i + 1])))
    return jnp.stack(out, axis=1)


@functools.partial(jax.jit, static_argnames=("model", "topk", "depth", "S_commit"))
def _tree_replay(model, tparams, draft, root_logp_RV, root_R, h0_RD, cache, topk: int, depth: int, S_commit: int):
    """The speculative loop's own tree drafting (`spec.tree_drafter` on each frontier of `jaxspec.tree`) from
    each root.

    Returns every candidate's score, draft token and parent candidate ([R, K + (depth-1) K^2] each), in the
    candidate order of `jaxspec.tree`, so that any (steps <= depth, topk, draft tokens) tree can be rebuilt.
    The cache's slots from S_commit on are the scratch region (at least (depth - 1) * K slots).
    """
    from jaxspec.spec import tree_drafter
    from jaxspec.tree import grow_candidates

    step, carry = tree_drafter(model, tparams, draft, root_R, h0_RD, cache, topk, S_commit)
    scores, tokens, parents, _ = grow_candidates(root_logp_RV, step, depth, topk, carry)
    return scores, tokens, parents


def accepted_lengths(scores, tokens, parents, target, steps: int, topk: int, draft_tokens: int):
    """Tokens a greedy cycle emits (bonus included) from each root for one tree setting, rebuilt from the
    candidates of `_tree_replay` as `jaxspec.tree.build_tree` keeps them: the best draft_tokens - 1 of the
    first K + (steps-1) K^2 candidates by score, ties to the lower index. target [R, >= steps]: the
    target's next tokens as draft ids (-1: not in the draft vocabulary)."""
    C = topk + (steps - 1) * topk * topk
    sc = np.asarray(scores)[:, :C].astype(np.float64)
    sc = np.where(sc == 0, 0.0, sc)
    sc = np.where(np.isnan(sc), -np.inf, sc)
    R = sc.shape[0]
    order = np.lexsort((np.broadcast_to(np.arange(C), sc.shape), -sc), axis=1)[:, : draft_tokens - 1]
    kept = np.zeros((R, C), bool)
    kept[np.arange(R)[:, None], order] = True
    tok, par = np.asarray(tokens)[:, :C], np.asarray(parents)[:, :C]
    cur = np.full(R, -1)
    alive = np.ones(R, bool)
    m = np.zeros(R, np.int64)
    for d in range(steps):
        hit = kept & (par == cur[:, None]) & (tok == np.asarray(target)[:, d][:, None]) & alive[:, None]
        found = hit.any(1)
        cur = np.where(found, hit.argmax(1), cur)
        m += found
        alive &= found
    return 1 + m


def loop_lengths(per_root: dict, acc: np.ndarray) -> list[int]:
    """Tokens of each cycle as the loop meets them: from each sequence's first root, jump by the tokens accepted.

    per_root: {sequence: [(root position, row in acc), ...] in position order}.
    """
    out = []
    for roots in per_root.values():
        where = {t: r for t, r in roots}
        t = roots[0][0]
        while t in where:
            a = int(acc[where[t]])
            out.append(a)
            t += a
    return out


def loop_mean(per_root: dict, acc: np.ndarray) -> float:
    """Mean tokens per cycle as the loop meets them (`loop_lengths`)."""
    lengths = loop_lengths(per_root, acc)
    return sum(lengths) / len(lengths) if lengths else 0.0


def measure_acceptance(
    engine, prompts, new_tokens: int = 64, depth: int = DEPTH, max_topk: int = MAX_TOPK, chunk: int = 64
):
    """Acceptance on the target's own greedy continuations of `prompts` (module docstring).

    Returns (ranks [roots, depth] of the target's tokens under the teacher-forced draft, the tokens per cycle
    of every (steps, topk, draft tokens) setting with topk <= max_topk as the loop would meet them, the
    distribution of those cycles' tokens per setting (P(l), l = 1 .. steps + 1), info).
    """
    from jaxspec.engine import round_up

    ids = engine.encode_prompts(prompts)
    results = engine.generate(ids, max_new_tokens=new_tokens, spec=None)
    seqs = [x + r.tokens for x, r in zip(ids, results)]
    lens = np.array([len(s) for s in seqs], np.int32)
    T = round_up(int(lens.max()) + depth + 1, 16)
    tokens = np.zeros((len(seqs), T), np.int32)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = s
    d = engine.draft
    d2t = np.asarray(jax.device_get(d.d2t))
    t2d_np = np.full(engine.cfg.vocab_size, -1, np.int32)
    t2d_np[np.arange(len(d2t)) + d2t] = np.arange(len(d2t))
    t2d = jnp.asarray(t2d_np)
    S = round_up(T, 64)
    ranks1, logp, h_out, cache = _teacher_forced(
        engine.model,
        engine.params,
        d,
        jnp.asarray(tokens),
        jnp.asarray(lens),
        engine.init_cache(len(seqs), S),
        engine.init_draft_cache(len(seqs), S),
        t2d,
        chunk=engine.prefill_chunk,
    )
    roots = [(b, t) for b in range(len(seqs)) for t in range(len(ids[b]), int(lens[b]) - depth)]
    if not roots:
        raise TuneError(
            f"no root positions: the continuations are shorter than {depth + 1} tokens "
            "(raise --acceptance-tokens or use prompts the target does not end at once)"
        )
    ranks1 = np.asarray(ranks1)
    tok_dev = jnp.asarray(tokens)
    scratch = (depth - 1) * max_topk
    pad = jax.tree.map(lambda a: jnp.pad(a, ((0, 0), (0, scratch)) + ((0, 0),) * (a.ndim - 2)), cache)
    rank_parts, cand_parts = [], {k: [] for k in range(1, max_topk + 1)}
    for i in range(0, len(roots), chunk):
        part = roots[i : i + chunk]
        full = part + [part[-1]] * (chunk - len(part))
        b_idx = jnp.asarray([b for b, _ in full], jnp.int32)
        t_idx = jnp.asarray([t for _, t in full], jnp.int32)
        sub = jax.tree.map(functools.partial(jnp.take, indices=b_idx, axis=0), pad)
        h0 = h_out[b_idx, t_idx - 1]
        r = _forced_rollout(
            engine.model,
            engine.params,
            d,
            jnp.take(tok_dev, b_idx, axis=0),
            t_idx,
            h0,
            sub,
            t2d,
            depth=depth,
            S_commit=S,
        )
        first = np.array([ranks1[b, t] for b, t in part])[:, None]
        rank_parts.append(np.concatenate([first, np.asarray(r)[: len(part)]], axis=1))
        for k, parts_k in cand_parts.items():
            out = _tree_replay(
                engine.model, engine.params, d, logp[b_idx, t_idx - 1], t_idx, h0, sub, topk=k, depth=depth, S_commit=S
            )
            parts_k.append([np.asarray(x)[: len(part)] for x in out])
    ranks = np.concatenate(rank_parts, axis=0)
    target = np.stack([t2d_np[tokens[b, t + 1 : t + 1 + depth]] for b, t in roots])
    per_seq: dict[int, list] = {}
    for row, (b, t) in enumerate(roots):
        per_seq.setdefault(b, []).append((t, row))
    table, dists, chain_rows = {}, {}, {}
    for k, parts in cand_parts.items():
        sc, tk, pa = (np.concatenate([p[j] for p in parts], axis=0) for j in range(3))
        for s, kk, n in candidates(depth, k):
            if kk != k:
                continue
            acc = accepted_lengths(sc, tk, pa, target, s, k, n)
            lengths = loop_lengths(per_seq, acc)
            table[(s, k, n)] = sum(lengths) / len(lengths) if lengths else 0.0
            if lengths:
                counts = np.bincount(lengths, minlength=s + 2)[1 : s + 2]
                dists[(s, k, n)] = tuple(float(c) for c in counts / counts.sum())
            if k == 1 and s == depth:
                chain_rows = acc
    leading = np.cumprod(ranks == 1, axis=1).sum(1) + 1
    info = {
        "prompts": len(ids),
        "roots": len(roots),
        "new_tokens": new_tokens,
        "continuation_tokens": int(sum(len(r.tokens) for r in results)),
        # the replayed chain and the teacher-forced ranks are the same drafting: they should agree per root
        "chain_replay_agreement": float(np.mean(chain_rows == leading)) if len(chain_rows) else None,
    }
    return ranks, table, dists, info


class Bench:
    """Cost measurements for one batch size on a state prefilled with real prompts."""

    def __init__(self, engine, prompt_ids, batch: int, reps: int = 3, max_new: int = 128):

        from jaxspec import spec as S

        self.engine, self.batch, self.reps, self.max_new = engine, batch, reps, max_new
        self.ids = [prompt_ids[i % len(prompt_ids)] for i in range(batch)]
        self.widest = S.SpecConfig(MAX_STEPS, MAX_TOPK, MAX_TOKENS)
        self.prompt, self.lens, _ = engine.pad_prompts(self.ids, max_new)
        self.S_t, _ = S.cache_lengths(int(self.lens.max()), max_new, self.widest)
        # Rows never stop: every iteration does the full work.
        session = engine.prepare(self.ids, max_new, spec=self.widest, stop_ids=[-1])
        self.sp, self.stop, self.state = session.method.sp, session.stop_ids, session.state
        jax.block_until_ready(self.state)

    def _with_draft_cache(self, steps: int, topk: int):

        L = self.S_t + (steps - 1) * topk
        return self.state.replace(draft_cache=jax.tree.map(lambda a: a[:, :L], self.state.draft_cache))

    def _real_loop(self, spec, fallback) -> tuple[float, float]:
        """(seconds per iteration, seconds per call beyond its iterations) of the real generation loop.

        The loop as `generate` and `scripts/bench_spec.py` run it: `Session.run` (the compiled `loop.run_loop`,
        its `while_loop` checking every row's done flag, the state donated) on a state prefilled with the
        sample prompts, rows stopping only at their max_new tokens, shapes (caches, output buffers) as the
        setting allocates them. Timed for one iteration and for the whole generation (the loop runs until
        the slowest row has its tokens: N iterations, read back), each the fastest of `reps` runs (after one
        compiling run) on a fresh copy of the state: per iteration = (t(N) - t(1)) / (N - 1), per call =
        t(1) - per iteration.
        With N < 3 the iteration comes from `fallback()` (the step inside `loop_time`'s loop).
        """
        from jaxspec.engine import Session

        session = self.engine.prepare(self.ids, self.max_new, spec=spec, stop_ids=[-1])
        state0, stop = session.state, session.stop_ids
        jax.block_until_ready(state0)
        ran = {}

        def run(k):
            s = Session(self.engine, session.method, session.weights, jax.tree.map(jnp.copy, state0), stop)
            jax.block_until_ready(s.state)
            t = time.perf_counter()
            s.run(k)
            jax.block_until_ready(s.state)
            ran[k] = int(s.state.steps - state0.steps)
            return time.perf_counter() - t

        run(1)  # compiles: the iteration count is an argument, so both counts share the executable
        one = min(run(1) for _ in range(self.reps))  # the fastest of `reps` runs, as `best_time`
        whole = min(run(self.max_new) for _ in range(self.reps))
        n = ran[self.max_new]
        per = (whole - one) / (n - 1) if n >= 3 else fallback()
        return max(per, 0.0), max(one - per, 0.0)

    def plain(self) -> tuple[float, float]:
        """(seconds per plain decode step, per call) of the real loop (`_real_loop`)."""
        from jaxspec.timing import loop_time

        def fallback():
            session = self.engine.prepare(self.ids, self.max_new, stop_ids=[-1])
            step = session.method.step
            return loop_time(lambda a, s: step(a[0], s, a[1]), session.state, (session.weights, self.stop), self.reps)

        return self._real_loop(None, fallback)

    def verify(self, n: int) -> float:

        from jaxspec import spec as S
        from jaxspec.timing import loop_time
        from jaxspec.tree import DraftTree

        B = self.batch
        i = jnp.arange(n, dtype=jnp.int32)
        tokens = jnp.broadcast_to(jnp.take(self.prompt, jnp.minimum(i, self.prompt.shape[1] - 1), axis=1), (B, n))
        tree = DraftTree(
            tokens=tokens,
            parents=jnp.broadcast_to(i - 1, (B, n)),
            depth=jnp.broadcast_to(i, (B, n)),
            mask=jnp.broadcast_to(i[None, :] <= i[:, None], (B, n, n)),
            cand_index=jnp.broadcast_to(i - 1, (B, n)),
        )
        m = self.engine.model

        def body(a, carry):
            p, d, st, tr = a
            cache, c = carry
            logits, cache, aux = S.verify(m, p, d, st.replace(target_cache=cache, P_B=st.P_B + jnp.minimum(c, 0)), tr)
            c = jnp.maximum(c, jnp.argmax(logits, -1).max().astype(jnp.int32))
            return cache, jnp.maximum(c, (aux.max() > 1e30).astype(jnp.int32))

        st = self.state
        return loop_time(
            body, (st.target_cache, jnp.int32(0)), (self.engine.params, self.engine.draft, st, tree), self.reps
        )

    def draft(self, steps: int, topk: int) -> float:

        from jaxspec import spec as S
        from jaxspec.timing import loop_time
        from jaxspec.tree import TreeShape

        n = steps + 1 if topk == 1 else min(MAX_TOKENS, 1 + topk + (steps - 1) * topk * topk)
        shape = TreeShape(steps, topk, n)
        m, S_t = self.engine.model, self.S_t

        def body(a, carry):
            p, d, st = a
            dc, c = carry
            z = jnp.minimum(c, 0)  # 0, but it makes every iteration depend on the previous one
            st = st.replace(draft_cache=dc, P_B=st.P_B + z, root_logp_BV=st.root_logp_BV + z.astype(jnp.float32))
            tree, dc = S.draft_tree(m, p, d, st, shape, S_t)
            return dc, jnp.maximum(c, tree.tokens.max().astype(jnp.int32))

        st = self._with_draft_cache(steps, topk)
        return loop_time(body, (st.draft_cache, jnp.int32(0)), (self.engine.params, self.engine.draft, st), self.reps)

    def extend(self, width: int) -> float:

        from jaxspec import spec as S
        from jaxspec.timing import loop_time

        B, m, S_t = self.batch, self.engine.model, self.S_t
        d = self.engine.draft
        aux = jnp.zeros((B, width, 3 * d.cfg.target_hidden_size), self.state.root_h_BD.dtype)
        toks = jnp.take(self.prompt, jnp.arange(width) % self.prompt.shape[1], axis=1)

        def body(a, carry):
            p, dr, st, ax, tk = a
            dc, c = carry
            logp, _, dc = S.draft_extend(m, p, dr, dc, ax, tk, st.P_B + jnp.minimum(c, 0), jnp.full((B,), width), S_t)
            return dc, jnp.maximum(c, jnp.argmax(logp, -1).max().astype(jnp.int32))

        st = self._with_draft_cache(MAX_STEPS, MAX_TOPK)
        return loop_time(body, (st.draft_cache, jnp.int32(0)), (self.engine.params, d, st, aux, toks), self.reps)

    def cycle(self, steps: int, topk: int, tokens: int) -> tuple[float, float]:
        """(seconds per cycle, per call) of the real speculative loop for this setting (`_real_loop`)."""
        from jaxspec import spec as S
        from jaxspec.timing import loop_time

        cfg = S.SpecConfig(steps, topk, tokens)

        def fallback():
            method = S.Speculative(self.engine.model, self.sp, self.max_new, cfg)
            body = lambda a, st: method.step((a[0], a[1]), st, a[2])
            return loop_time(
                body, self._with_draft_cache(steps, topk), (self.engine.params, self.engine.draft, self.stop), self.reps
            )

        return self._real_loop(cfg, fallback)


@dataclasses.dataclass
class Task:
    batch: int
    kind: str  # plain, verify, draft, extend, cycle
    arg: tuple
    essential: bool

    @property
    def label(self) -> str:
        a = {"verify": "N={}", "draft": "S={} K={}", "extend": "W={}", "cycle": "{}/{}/{}", "plain": ""}[self.kind]
        return f"batch {self.batch} {self.kind} {a.format(*self.arg)}".strip()


def plan(batches, max_steps: int = MAX_STEPS, max_topk: int = MAX_TOPK, max_tokens: int = MAX_TOKENS) -> list[Task]:
    """Measurements in order of use (module docstring), for settings within the limits."""
    top = max_steps + 1  # the longest chain's draft tokens
    essential = [
        ("plain", ()),
        ("verify", (2,)),
        ("verify", (top,)),
        ("draft", (1, 1)),
        ("draft", (max_steps, 1)),
        ("extend", (2,)),
        ("extend", (top,)),
        ("cycle", (min(3, max_steps), 1, min(3, max_steps) + 1)),
    ]
    largest = max_tokens if max_topk > 1 else top
    later = [("cycle", (max_steps, 1, top)), ("cycle", (1, 1, 2))]
    for k in (2, 4, 3):
        if k <= max_topk:
            later += [("draft", (1, k)), ("draft", (max_steps, k))]
    later += [("verify", (n,)) for n in (16, 4, 8, 12, 3, 5, 6, 10, 14, 9, 11, 13, 15, 7, 1) if n <= largest]
    later += [("extend", (w,)) for w in (4, 3, 5, 6) if w < top]
    tasks, seen = [], set()
    for b in batches:
        for kind, arg in essential:
            if (b, kind, arg) not in seen:
                seen.add((b, kind, arg))
                tasks.append(Task(b, kind, arg, True))
    for kind, arg in later:
        for b in batches:
            if (b, kind, arg) not in seen:
                seen.add((b, kind, arg))
                tasks.append(Task(b, kind, arg, False))
    return tasks


def _per_iteration(value) -> float:
    """A measurement's seconds per iteration: plain steps and cycles are (per iteration, per call)."""
    return value[0] if isinstance(value, tuple) else value


def _costs_of(measured: dict, max_steps: int = MAX_STEPS) -> Costs | None:
    """Costs from a batch size's measurements, or None when what chains need is missing."""
    calls = {("plain" if k == "plain" else a): t[1] for (k, a), t in measured.items() if isinstance(t, tuple)}
    measured = {key: _per_iteration(t) for key, t in measured.items()}
    v = {a[0]: t for (k, a), t in measured.items() if k == "verify"}
    dr: dict[int, dict[int, float]] = {}
    for (k, a), t in measured.items():
        if k == "draft":
            dr.setdefault(a[1], {})[a[0]] = t
    ex = {a[0]: t for (k, a), t in measured.items() if k == "extend"}
    plain = measured.get(("plain", ()))
    top = max_steps + 1
    if plain is None or not {2, top} <= set(v) or not {1, max_steps} <= set(dr.get(1, {})) or not {2, top} <= set(ex):
        return None
    return Costs(plain, v, dr, ex, {a: t for (k, a), t in measured.items() if k == "cycle"}, calls)


def _suspects(batch: int, measured: dict, ratio: float = 1.15) -> list[Task]:
    """Verify and extend points that cost more than some larger point by over `ratio` (cost grows with size)."""
    out = []
    for kind in ("verify", "extend"):
        pts = {a[0]: t for (k, a), t in measured.items() if k == kind}
        for x, t in pts.items():
            if any(t > ratio * u for y, u in pts.items() if y > x):
                out.append(Task(batch, kind, (x,), False))
    return out


def tune(
    engine,
    prompts,
    batches,
    budget: float,
    new_tokens: int = 64,
    reps: int = 3,
    progress: bool = True,
    prompts_label: str = "",
    max_steps: int = MAX_STEPS,
    max_topk: int = MAX_TOPK,
    max_tokens: int = MAX_TOKENS,
    max_new: int = 128,
    profile: AcceptanceProfile | None = None,
) -> dict:
    """Measure, predict and pick; returns the spec_config.json payload (module docstring).

    profile: an acceptance profile measured elsewhere (another engine's spec_config.json, e.g. the
    demo pair's applied to a model of another size, `scripts/tune_share.py`): the costs are measured
    here, the acceptance is not."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    tasks = plan(batches, max_steps, max_topk, max_tokens)
    bar = tqdm(
        total=len(tasks) + 1, desc="tuning", unit="step", file=sys.stderr, disable=not progress, dynamic_ncols=True
    )
    spent: dict[str, list[float]] = {}
    measured: dict[int, dict] = {b: {} for b in batches}
    benches: dict[int, Bench] = {}
    skipped: list[str] = []
    prompt_ids = engine.encode_prompts(prompts)

    def estimate(kind):
        pool = spent.get(kind) or [t for ts in spent.values() for t in ts]
        return max(pool) if pool else 0.0

    def run(task: Task):
        t = time.perf_counter()
        if task.batch not in benches:
            benches[task.batch] = Bench(engine, prompt_ids, task.batch, reps, max_new)
            spent.setdefault("setup", []).append(time.perf_counter() - t)
            t = time.perf_counter()
        bench = benches[task.batch]
        measured[task.batch][(task.kind, task.arg)] = getattr(bench, task.kind)(*task.arg)
        spent.setdefault(task.kind, []).append(time.perf_counter() - t)

    bar.set_postfix_str(tasks[0].label)
    run(tasks[0])  # the first measurement gives the time scale
    bar.update(1)
    first = time.perf_counter() - t0
    need = spent["plain"][0] * (sum(t.essential and t.batch == batches[0] for t in tasks) - 1 + 3)
    if first + need > budget:
        raise TuneError(
            f"--time-budget {budget:g} s is too small to measure anything: the first measurement "
            f"(batch {batches[0]}: prefill and a plain step, compilation included) took {first:.1f} s, "
            f"and the least that predicts anything (the acceptance profile and the chain measurements "
            f"of one batch size) needs about {first + need:.0f} s; expected --time-budget >= "
            f"{first + need:.0f}"
        )
    if profile is None:
        bar.set_postfix_str("acceptance profile")
        ranks, table, dists, info = measure_acceptance(engine, prompts, new_tokens, max_topk=max_topk)
        profile = AcceptanceProfile.from_ranks(ranks, table, dists)
        info["seconds"] = time.perf_counter() - t0 - first
    else:
        info = {"measured_here": False, "roots": profile.samples, "seconds": 0.0}
    bar.update(1)
    for task in tasks[1:]:
        setup = 0.0 if task.batch in benches else estimate("setup")
        if time.perf_counter() - t0 + estimate(task.kind) + setup > budget:
            skipped.append(task.label)
            bar.update(1)
            continue
        bar.set_postfix_str(task.label)
        run(task)
        bar.update(1)
    # Second look: the measurements every prediction rests on (plain step, chain costs, the 3/1/4 cycle), and any
    # verify or extend point above a larger one by > 15% (disturbed), once more; the faster of the two counts.
    again = [t for t in tasks if t.essential and (t.kind, t.arg) in measured[t.batch]]
    again += [
        t
        for b in batches
        for t in _suspects(b, measured[b])
        if (t.kind, t.arg) not in {(a.kind, a.arg) for a in again if a.batch == b}
    ]
    remeasured = []
    for task in again:
        if time.perf_counter() - t0 + estimate(task.kind) > budget:
            skipped.append(task.label + " (again)")
            continue
        bar.set_postfix_str(task.label + " (again)")
        old = measured[task.batch][(task.kind, task.arg)]
        run(task)
        measured[task.batch][(task.kind, task.arg)] = min(
            old, measured[task.batch][(task.kind, task.arg)], key=_per_iteration
        )
        remeasured.append(task.label)
    bar.close()
    costs = {b: _costs_of(measured[b], max_steps) for b in batches}
    if not any(c is not None for c in costs.values()):
        raise TuneError(
            f"--time-budget {budget:g} s is too small to measure anything: not even one batch size's "
            f"chain measurements fitted ({len(skipped)} skipped: {', '.join(skipped[:4])} ...); "
            "expected a larger --time-budget"
        )
    picks, preds = {}, {}
    for b, c in costs.items():
        if c is not None:
            preds[str(b)] = predict(c, profile, b, max_steps, max_topk, max_tokens, max_new)
            picks[str(b)] = pick(c, profile, b, max_steps, max_topk, max_tokens, max_new)
    return {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "device": device_key(engine),
        "model": (
            {"fingerprint": fingerprint(engine.path), "path": os.path.abspath(engine.path)}
            if getattr(engine, "path", None)
            else {"fingerprint": None, "path": None}
        ),
        "limits": {"max_steps": max_steps, "max_topk": max_topk, "max_draft_tokens": max_tokens},
        "acceptance": {"source": prompts_label, **info, **profile.to_dict(), "chain": profile.chain()},
        "costs": {str(b): c.to_dict() for b, c in costs.items() if c is not None},
        "not_measured": {"batches": [b for b, c in costs.items() if c is None], "skipped": skipped},
        "measured_again": remeasured,
        "budget": {"seconds": budget, "used": time.perf_counter() - t0, "reps": reps},
        # the costs are for caches sized for the sample prompts plus this many new tokens (static shapes)
        "cost_context": {"max_new_tokens": max_new, "prompt_tokens": [len(x) for x in prompt_ids]},
        "predictions": {b: rows[:12] for b, rows in preds.items()},
        "picks": picks,
    }


def summary(payload: dict) -> str:
    lines = [
        "chain acceptance per depth: "
        + " ".join(f"{a:.2f}" for a in payload["acceptance"]["chain"])
        + f" ({payload['acceptance']['roots']} roots)"
    ]
    for b, p in payload["picks"].items():
        steady = lambda key, p=p: f" (steady {p[key]:.1f})" if p.get(key) and "max_new_tokens" in p else ""
        ref = f", 3/1/4 {p['default_tok_s']:.1f}{steady('default_steady_tok_s')}" if p.get("default_tok_s") else ""
        length = (
            f" for {p['max_new_tokens']}-token generations ({p['cycles']:.1f} loop iterations; "
            f"steady state {p['steady_tok_s']:.1f})"
            if "max_new_tokens" in p
            else ""
        )
        lines.append(
            f"batch {b}: {_setting(p)} predicted {p['tok_s']:.1f} tok/s{length}, accept {p['accept']:.2f}, "
            f"{p['cycle_ms']:.2f} ms per cycle; plain {p['plain_tok_s']:.1f}{steady('plain_steady_tok_s')}{ref}"
        )
    missing = payload["not_measured"]["batches"]
    if missing:
        lines.append(f"not measured (time budget): batch {', '.join(map(str, missing))}")
    return "\n".join(lines)


@cli.entry_point
def main(argv=None) -> int:
    p = cli.ArgumentParser(prog="python -m jaxspec.tune", description=__doc__)
    p.add_argument("--model", help="converted jaxspec checkpoint with a draft (default: the built-in demo pair)")
    p.add_argument(
        "--prompts",
        help='sample prompts: JSON list (or {"prompts": [...]}) or JSON lines (default: the built-in held-out prompts)',
    )
    p.add_argument(
        "--batch", type=int, nargs="+", default=[1, 8, 32], action=cli.at_least(1), help="batch sizes to tune for"
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=600.0,
        action=cli.above(0.0),
        metavar="S",
        help="seconds for the measurements, counted after loading (default: 600)",
    )
    p.add_argument(
        "--acceptance-tokens",
        type=int,
        default=64,
        action=cli.at_least(DEPTH + 1),
        help="tokens of the target's greedy continuation per prompt for the acceptance profile",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        action=cli.at_least(1),
        help="generation length the costs are measured for: the caches hold the sample prompts plus "
        "this many tokens, and attention reads the whole cache (default: 128, as generate)",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=3,
        action=cli.at_least(1),
        help="timed repetitions per measurement (the fastest counts)",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=MAX_STEPS,
        action=cli.in_range(1, MAX_STEPS),
        help="most draft steps considered",
    )
    p.add_argument(
        "--max-topk",
        type=int,
        default=MAX_TOPK,
        action=cli.in_range(1, MAX_TOPK),
        help="largest topk considered (1: chains only)",
    )
    p.add_argument(
        "--max-draft-tokens",
        type=int,
        default=MAX_TOKENS,
        help="most draft tokens (tree nodes, root included) considered",
    )
    p.add_argument("--dtype", choices=COMPUTE_DTYPES, help="default: float32 on CPU, bfloat16 otherwise")
    p.add_argument("--num-devices", type=int, action=cli.at_least(1), help="devices of the mesh (default: as generate)")
    p.add_argument("--draft-placement", choices=["replicated", "sharded"], default="replicated", help="as generate's")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    if not args.max_steps + 1 <= args.max_draft_tokens <= MAX_TOKENS:
        raise UsageError(
            f"--max-draft-tokens must be in [{args.max_steps + 1}, {MAX_TOKENS}] (a chain of --max-steps "
            f"{args.max_steps} verifies {args.max_steps + 1}), found {args.max_draft_tokens}"
        )
    batches = list(dict.fromkeys(args.batch))
    prompts_path = args.prompts or builtin_prompts_path()
    prompts = load_prompts(prompts_path)
    from jaxspec import checkpoint

    model_dir = args.model
    if model_dir is None:
        from jaxspec import demo

        if not demo.available():
            raise UsageError("no --model given and this installation has no built-in demo model; pass --model DIR")
        model_dir = demo.ensure_converted(log=lambda m: print(m, file=sys.stderr))
    payload = checkpoint.read_config(model_dir, flag="--model")
    if "draft" not in payload:
        raise UsageError(
            f"--model {model_dir}: the checkpoint has no draft (expected {model_dir}/draft, written by "
            "`python -m checkpoints_convert --target ... --draft ...`); there is nothing to tune without one"
        )
    from jaxspec.engine import Engine

    engine = Engine.load(
        model_dir, dtype=args.dtype, num_devices=args.num_devices, draft_placement=args.draft_placement
    )
    engine.path = model_dir
    if engine.tokenizer is None and any(isinstance(x, str) for x in prompts):
        raise UsageError(
            f"--prompts {prompts_path}: text prompts need a tokenizer, and {model_dir} has none; "
            "expected lists of token ids"
        )
    label = "builtin held-out prompts" if args.prompts is None else os.path.abspath(prompts_path)
    result = tune(
        engine,
        prompts,
        batches,
        args.time_budget,
        args.acceptance_tokens,
        args.reps,
        progress=not args.quiet,
        prompts_label=label,
        max_steps=args.max_steps,
        max_topk=args.max_topk,
        max_tokens=args.max_draft_tokens,
        max_new=args.max_new_tokens,
    )
    out = os.path.join(model_dir, CONFIG_FILE)
    write_config(out, result)
    print(summary(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
