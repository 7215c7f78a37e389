"""Device time of one phase of a compiled loop, without launch and dispatch costs.

A phase runs inside one compiled `lax.fori_loop`, n + 1 times against once, and the
difference is divided by n: what a call costs around the phase (dispatch, launch,
argument handling, the copy of a non-donated input) is the same in both and drops
out, which matters when the phase takes well under a millisecond. What does not drop out is the
loop's own cost per iteration (its predicate read back to the host, tens of microseconds on a GPU):
`chain_time` fits it away for calls that short. Each iteration
consumes the previous one's output, so the compiler cannot hoist the phase out of
the loop. Weights travel as arguments, never closed over: closed-over arrays become
constants baked into the executable (tens of GB at Kimi width; compilation then
never finishes).

    seconds = loop_time(lambda args, carry: step(*args, carry), carry0, (params, draft))
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def _times(fn: Callable, reps: int) -> list[float]:
    """Wall seconds of `fn()` (blocked on its result) over `reps` runs after one warm-up run."""
    times = []
    for r in range(reps + 1):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        if r:
            times.append(time.perf_counter() - t)
    return times


def median_time(fn: Callable, reps: int) -> float:
    """Median wall seconds of `fn()` over `reps` runs after one warm-up run."""
    return statistics.median(_times(fn, reps))


def best_time(fn: Callable, reps: int) -> float:
    """Fastest wall seconds of `fn()` over `reps` runs after one warm-up run: on a shared machine other
    work only ever adds time, so the minimum is the least disturbed run."""
    return min(_times(fn, reps))


def loop_time(
    body: Callable,
    carry,
    args=(),
    reps: int = 3,
    n: int | None = None,
    target_s: float = 0.2,
    max_n: int = 64,
    timer: Callable = best_time,
    retries: int = 3,
) -> float:
    """Seconds of one `carry = body(args, carry)` inside a compiled loop: (time(n + 1) - time(1)) / n.

    The carry is the phase's real loop state (a cache updated in place, a decode state), so an
    iteration costs what it costs in the real loop. n=None picks n from one timed call so that the
    n extra iterations take about `target_s` (between 4 and `max_n`). `timer(fn, reps)` turns runs
    into one time: the fastest (default) or `median_time`.

    A difference that comes out zero or negative (other work on the machine slowed the one-iteration
    run more than the n + 1 one) is no measurement: both are timed again, with twice the extra
    iterations each time, up to `retries` times; 0.0 only if every try came out so.
    """

    @jax.jit
    def many(args, carry, count):
        return jax.lax.fori_loop(0, count, lambda i, c: body(args, c), carry)

    once = timer(lambda: many(args, carry, jnp.int32(1)), reps)
    if n is None:
        n = int(min(max(target_s / max(once, 1e-6), 4), max_n))
    for attempt in range(retries + 1):
        if attempt:
            n *= 2
            once = timer(lambda: many(args, carry, jnp.int32(1)), reps)
        more = timer(lambda n=n: many(args, carry, jnp.int32(n + 1)), reps)
        if more > once:
            return (more - once) / n
    return 0.0


class ChainTime(NamedTuple):
    per_call: float  # seconds one more call in the chain costs: the fitted slope
    per_iteration: float  # seconds the loop's iteration costs besides its calls: the fitted intercept
    points: tuple  # (calls an iteration, seconds an iteration) as measured


def chain_time(
    step: Callable,
    carry,
    arg_sets,
    chains: tuple[int, ...] = (1, 4),
    reps: int = 5,
    target_s: float = 0.3,
    loop_timer: Callable | None = None,
) -> ChainTime:
    """Seconds of one `carry = step(k, arg_sets[k], carry)` in a chain of such calls, without the loop's
    own cost (k: the argument set's index, for what cannot be traced, such as static sizes).

    An iteration of `loop_time`'s loop costs something whatever it holds: 21-32 us on an H100
    (docs/PERFORMANCE.md, run 40), where its trip count is a runtime value whose predicate the host
    reads back every iteration (a static count cost less there, not nothing). For a call of tens of
    microseconds that is no small part of one iteration. Here an iteration chains `m` rounds of
    `step` over every entry of `arg_sets` in turn, for each m in `chains`, and the least-squares line
    t = c * calls + O through the iterations' times gives c, what one more call costs, and O, the
    iteration's own cost. Each call consumes the previous one's carry, so calls neither overlap nor
    get hoisted. Work inside `step` that depends on an argument set alone, not on the carry, may be
    computed once, out of the loop (XLA's loop-invariant code motion): the slope then leaves it out.
    Make such work depend on the carry where it belongs to the call (`bench_grouped_matmul.loop_timeit`
    does so for the routing's expert ids). Like `loop_time`, 0.0 (both figures) means no measurement:
    some chain length timed no positive difference.
    """
    if len(set(chains)) < 2 or min(chains) < 1:
        raise ValueError(f"chain_time: chains must hold two or more distinct counts >= 1, found {chains}")
    loop_timer = loop_time if loop_timer is None else loop_timer
    points = []
    for m in chains:

        def body(args, c, m=m):
            for _ in range(m):
                for k, a in enumerate(args):
                    c = step(k, a, c)
            return c

        points.append((m * len(arg_sets), loop_timer(body, carry, tuple(arg_sets), reps=reps, target_s=target_s)))
    if any(t <= 0.0 for _, t in points):  # loop_time's "no measurement": no line either
        return ChainTime(0.0, 0.0, tuple(points))
    a = [[k, 1.0] for k, _ in points]
    (c, o), *_ = np.linalg.lstsq(np.array(a), np.array([t for _, t in points]), rcond=None)
    return ChainTime(float(c), float(o), tuple(points))


def _zero_from(value) -> jax.Array:
    """0.0 (float32) computed from `value`'s first element: a multiply XLA keeps (NaN * 0 is NaN). An integer
    `x * 0` it folds to 0, and then drops whatever computed x: the element is widened first."""
    return jnp.asarray(value).reshape(-1)[0].astype(jnp.float32) * 0


def feed(carry: jax.Array, *outs) -> jax.Array:
    """`carry` made to depend on every array leaf of `outs` (one call's outputs): the next call of a chain
    that reads this carry cannot start before this one ends, nor be hoisted out of the loop. Adds 0 computed
    from each leaf's first element (`_zero_from`: integer outputs too), a few scalar ops."""
    for leaf in jax.tree.leaves(outs):
        carry = carry + _zero_from(leaf).astype(carry.dtype)
    return carry


def follow(values, carry) -> list:
    """`values` (a sequence) with each integer array among them made to depend on the chain's `carry` (0 from
    its first element added): work that depends on such an array alone (the routing metadata of fixed expert
    ids) would otherwise be computed once, out of the loop (XLA's loop-invariant code motion; `chain_time`).
    Only the sequence's own entries: arrays inside a pytree entry (weights, packed INT4 ones among them) are
    left alone, as are floats and non-arrays; an add on a weight would copy it every call."""
    dep = _zero_from(carry).astype(jnp.int32)
    integer = lambda v: isinstance(v, jax.Array) and jnp.issubdtype(v.dtype, jnp.integer)  # noqa: E731
    return [v + dep.astype(v.dtype) if integer(v) else v for v in values]


def idle_iteration(args, c: jax.Array) -> jax.Array:
    """`phase_time`'s loop body without a phase: the carry (an int32 >= 0, 0 here) stays 0, and `c ^ 1`
    keeps XLA from folding the iteration away, so the loop still pays its own cost each iteration."""
    return jnp.maximum(c, c ^ 1) - 1


def phase_time(
    phase: Callable,
    extract: Callable,
    st,
    args,
    reps: int = 3,
    n: int = 64,
    timer: Callable = median_time,
    loop_timer: Callable | None = None,
) -> float:
    """Seconds of one `phase(*args[:2], st, *args[2:])` on a loop state `st` that the phase does not change.

    The phase's output feeds the next iteration through the row lengths (offset by
    min(c, 0) = 0 with c >= 0 derived from the output by `extract`). The loop's own cost per iteration
    (tens of us on a GPU: `chain_time`) is timed with an iteration of the same scalar bookkeeping and no
    phase, and taken off, so that the phases of a cycle can be subtracted from the cycle as the real loop
    runs it, which pays that cost once a cycle, not once a phase. The answer is never below 0.
    """
    loop_timer = loop_time if loop_timer is None else loop_timer

    def body(a, c):
        s, w = a
        out = phase(*w[:2], s.replace(P_B=s.P_B + jnp.minimum(c, 0)), *w[2:])
        return jnp.maximum(c, extract(out).astype(jnp.int32))

    with_phase = loop_timer(body, jnp.int32(0), (st, args), reps, n, timer=timer)
    if with_phase <= 0.0:  # loop_time's "no measurement"
        return with_phase
    return max(with_phase - loop_timer(idle_iteration, jnp.int32(0), (st, args), reps, n, timer=timer), 0.0)
