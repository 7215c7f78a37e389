"""`jaxspec.timing.loop_time`: a disturbed (non-positive) difference is timed again, not taken as a cost."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest

from jaxspec import timing


def _scripted(values):
    calls = []

    def timer(fn, reps):
        calls.append(reps)
        return values[len(calls) - 1]

    return timer, calls


def _body(args, c):
    return c + 1


def test_a_negative_difference_is_measured_again_with_more_iterations():
    # once 1.0, n + 1 = 5 iterations 0.9 (disturbed); again: once 1.0, 9 iterations 1.4 -> 0.4 / 8
    timer, calls = _scripted([1.0, 0.9, 1.0, 1.4])
    t = timing.loop_time(_body, jnp.int32(0), n=4, timer=timer)
    assert t == pytest.approx(0.4 / 8) and len(calls) == 4


def test_a_clean_difference_is_taken_at_once():
    timer, calls = _scripted([1.0, 1.8])
    assert timing.loop_time(_body, jnp.int32(0), n=4, timer=timer) == pytest.approx(0.2) and len(calls) == 2


def test_zero_only_when_every_try_comes_out_non_positive():
    timer, calls = _scripted([1.0, 1.0] * 4)
    assert timing.loop_time(_body, jnp.int32(0), n=4, timer=timer, retries=3) == 0.0 and len(calls) == 8


def test_a_real_loop_gives_a_positive_time():
    t = timing.loop_time(lambda a, c: jnp.sin(c) + a, jnp.ones((256, 256)), jnp.float32(1.0), reps=2, n=8)
    assert t > 0


def _counting_loop_timer(per_call, per_iteration, seen):
    """A stand-in for `loop_time`: runs the body once in Python, counts the steps it chains, and answers
    per_call * steps + per_iteration (the model `chain_time` fits)."""

    def loop_timer(body, carry, args, reps, target_s):
        steps = []
        body(args, (carry, steps))
        seen.append(len(steps))
        return per_call * len(steps) + per_iteration

    return loop_timer


def test_chain_time_fits_the_call_and_the_iteration_apart():
    seen = []

    def step(k, a, c):
        carry, steps = c
        steps.append((k, a))
        return carry, steps

    arg_sets = ["a", "b", "c"]
    ct = timing.chain_time(step, 0, arg_sets, chains=(1, 4), loop_timer=_counting_loop_timer(40e-6, 23e-6, seen))
    assert seen == [3, 12]
    assert ct.per_call == pytest.approx(40e-6) and ct.per_iteration == pytest.approx(23e-6)
    assert [k for k, _ in ct.points] == [3, 12]


def test_chain_time_passes_each_argument_set_with_its_index_in_turn():
    order = []

    def step(k, a, c):
        order.append((k, a))
        return c

    timing.chain_time(step, 0, ["x", "y"], chains=(1, 2), loop_timer=_counting_loop_timer(1.0, 0.0, []))
    assert order == [(0, "x"), (1, "y")] + [(0, "x"), (1, "y")] * 2


@pytest.mark.parametrize("chains", [(1,), (2, 2), (0, 3)])
def test_chain_time_needs_two_distinct_positive_chain_lengths(chains):
    with pytest.raises(ValueError, match="chains"):
        timing.chain_time(lambda k, a, c: c, 0, [()], chains=chains)


def test_chain_time_on_a_real_loop():
    # six chained sines over 1 MB against one: milliseconds apart on any CPU, far above its noise
    ct = timing.chain_time(
        lambda k, a, c: jnp.sin(c) + a, jnp.ones((512, 512)), [jnp.float32(1.0)], chains=(1, 6), reps=3, target_s=0.05
    )
    assert ct.per_call > 0 and [k for k, _ in ct.points] == [1, 6] and ct.points[1][1] > ct.points[0][1]


def _while_body_text(hlo: str) -> str:
    """The text of the compiled module's while loop body computation (the only while loop in it)."""
    import re

    name = re.search(r"while\(.*?body=%?([\w.\-]+)", hlo).group(1)
    start = re.search(rf"^(?:%)?{re.escape(name)} .*\{{\s*$", hlo, re.M).start()
    return hlo[start : hlo.index("\n}", start)]


def _loop_builds(monkeypatch, loop_timeit, fn, arg_sets):
    """Sorts inside the compiled loop's body for each chain length `loop_timeit` times (`_sorts_per_chain`)."""
    return _sorts_per_chain(monkeypatch, lambda: loop_timeit(fn, arg_sets))


def test_the_int4_bench_builds_every_chained_calls_routing_on_its_own(monkeypatch):
    """`scripts/bench_grouped_matmul.loop_timeit` chains calls that all get the same expert ids. Work that depends
    on the ids alone (the routing metadata; here a sort) would be computed once, out of the loop, and the
    per-call figure would leave it out: the bench makes integer arguments depend on the loop's carry, so the
    compiled loop's body holds one such build per call, for one round of the 3 argument sets and for 4."""
    _scripts_on_path(monkeypatch)
    import bench_grouped_matmul

    def call(x, ids, w):  # a routed call: the sort stands for the metadata built from the ids
        order = jnp.sort(ids, axis=-1)
        return x * w + order[:, :1].astype(x.dtype)

    ids = jnp.array([[3, 1, 2, 0], [2, 2, 1, 3]], jnp.int32)
    x = jnp.ones((2, 4), jnp.float32)
    arg_sets = [(x, ids, jnp.float32(s)) for s in (1.0, 2.0, 3.0)]
    assert _loop_builds(monkeypatch, bench_grouped_matmul.loop_timeit, call, arg_sets) == [3, 12]

    def unlinked(fn, sets):  # the same chain without the ids' dependency on the carry: the builds leave the loop
        def step(k, a, c):
            return c + fn(c, *a).reshape(-1)[0] * 0

        return timing.chain_time(step, sets[0][0], [a[1:] for a in sets], reps=1).per_call

    assert _loop_builds(monkeypatch, unlinked, call, arg_sets) == [0, 0]


def test_chain_time_reports_no_measurement_when_a_chain_length_has_none():
    timer = iter([30e-6, 0.0])
    ct = timing.chain_time(lambda k, a, c: c, 0, [()], loop_timer=lambda *a, **kw: next(timer))
    assert (ct.per_call, ct.per_iteration) == (0.0, 0.0) and [t for _, t in ct.points] == [30e-6, 0.0]


def test_the_int4_bench_gives_each_call_its_own_sets_static_ints(monkeypatch):
    """`loop_timeit` passes a set's static ints (a block-group count) to that set's calls, in every round."""
    _scripts_on_path(monkeypatch)
    import bench_grouped_matmul

    seen = []

    def fn(x, ids, group, w):
        seen.append(group)
        return x * w + ids[:, :1].astype(x.dtype)

    def run_once(body, carry, args, reps, target_s):
        body(args, carry)
        return 1e-6

    monkeypatch.setattr(timing, "loop_time", run_once)
    x, ids = jnp.ones((2, 4), jnp.float32), jnp.zeros((2, 4), jnp.int32)
    bench_grouped_matmul.loop_timeit(fn, [(x, ids, g, jnp.float32(g)) for g in (1, 2, 4)])
    assert seen == [1, 2, 4] + [1, 2, 4] * 4


def _sorts_per_chain(monkeypatch, run):
    """Sorts inside the compiled loop body for each chain length that `run()` times through `chain_time`
    (`loop_time` replaced by a stand-in that compiles the same `fori_loop` and reads its HLO)."""
    import re

    import jax

    builds = []

    def compiled_builds(body, carry, args, reps, target_s):
        loop = jax.jit(lambda a, c, n: jax.lax.fori_loop(0, n, lambda i, c: body(a, c), c))
        hlo = loop.lower(args, carry, jnp.int32(3)).compile().as_text()
        body = _while_body_text(hlo) if re.search(r"\bwhile\(", hlo) else ""  # no loop left: nothing in one
        builds.append(len(re.findall(r"= [^ ]+ sort\(", body)))
        return 1e-6 * len(builds)

    monkeypatch.setattr(timing, "loop_time", compiled_builds)
    run()
    return builds


def _scripts_on_path(monkeypatch):
    import os

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))


def test_the_dense_bench_keeps_every_chained_product_in_the_loop(monkeypatch):
    """`scripts/bench_stacked_dense._chained` feeds each product's output back into the next call's input, so a
    product of a loop-invariant x and weight (which XLA would compute once, out of the loop) runs once per call:
    one round of 2 weight sets and four rounds. The same chain without the feedback leaves the loop empty."""
    _scripts_on_path(monkeypatch)
    import bench_stacked_dense

    product = lambda x, w: jnp.sort(x, axis=-1) * w[0, 0, 0]  # noqa: E731 - a sort stands for the matmul
    x = jnp.array([[3.0, 1.0, 2.0]], jnp.float32)
    ws = [jnp.full((1, 3, 3), s, jnp.float32) for s in (1.0, 2.0)]
    run = lambda: bench_stacked_dense._chained(product, x, ws, reps=1, target_s=0.01)  # noqa: E731
    assert _sorts_per_chain(monkeypatch, run) == [2, 8]

    def unlinked():
        step = lambda k, w, c: c + product(x, w)  # noqa: E731 - the product does not read the carry
        timing.chain_time(step, jnp.zeros_like(x), ws, reps=1, target_s=0.01)

    assert _sorts_per_chain(monkeypatch, unlinked) == [0, 0]


def test_the_metadata_bench_keeps_every_chained_build_in_the_loop(monkeypatch):
    """`scripts/bench_metadata.time_metadata` reads the metadata's integer outputs into the float carry. XLA
    folds an integer `x * 0` to 0 and would then drop the build whose output it was; the bench widens them
    first, so the compiled loop holds one build per call (3 routings, one round and four)."""
    import argparse

    _scripts_on_path(monkeypatch)
    import bench_metadata

    def route_blocks(ids, w, num_local, group, impl, share, counters):  # a sort stands for the metadata build
        order = jnp.sort(ids.reshape(-1))
        return {"rows": order[:4], "packed": jnp.stack([order, order, order])}

    monkeypatch.setattr(bench_metadata.int4_moe, "route_blocks", route_blocks)
    args = argparse.Namespace(experts=48, global_experts=384, sets=3, counters=0, seed=0, reps=1, target_s=0.01)
    run = lambda: bench_metadata.time_metadata(2, args, "xla")  # noqa: E731
    assert _sorts_per_chain(monkeypatch, run) == [3, 12]

    def integer_zero(ids, w, *a, **kw):  # the pitfall: the same build read through an integer multiply by 0
        m = route_blocks(ids, w, *a, **kw)
        return {"rows": m["rows"] * 0, "packed": m["packed"] * 0}

    monkeypatch.setattr(bench_metadata.int4_moe, "route_blocks", integer_zero)
    assert _sorts_per_chain(monkeypatch, run) == [0, 0]


def test_feed_and_follow_keep_the_values_and_link_only_what_they_should():
    """`timing.feed` returns the carry's value (NaN only where an output is NaN or infinite, which a bench's
    checks catch); `timing.follow` adds the carry's 0 to the sequence's own integer arrays and leaves floats,
    non-arrays and every array inside a nested entry (a weights pytree, packed INT4 ones too) as they are."""
    c = jnp.float32(2.5)
    assert float(timing.feed(c, jnp.arange(3, dtype=jnp.int32), {"a": jnp.ones((2,), jnp.bfloat16)})) == 2.5
    ids, w = jnp.array([[3, 1]], jnp.int32), jnp.ones((2,), jnp.float32)
    packed = {"q": jnp.ones((4,), jnp.uint8)}
    out = timing.follow([ids, w, packed, 7], c)
    assert out[1] is w and out[2] is packed and out[3] == 7
    assert out[0].dtype == jnp.int32 and (out[0] == ids).all()
    jaxpr = str(jax.make_jaxpr(lambda c: timing.follow([ids, packed], c))(c))
    assert jaxpr.count(" add ") == 1  # the ids' add; none on the packed weight


def test_feed_keeps_a_call_with_integer_outputs_in_the_loop(monkeypatch):
    """An integer output read through `x * 0` is folded to 0 by XLA, which then drops the call (0 sorts in the
    loop); read through `timing.feed`, which widens it first, the call stays: one per chained call."""

    def step(k, a, c):
        ids = timing.follow([a], c)[0]
        return timing.feed(c, jnp.sort(ids))

    sets = [jnp.array([3, 1, 2], jnp.int32), jnp.array([2, 0, 1], jnp.int32)]
    run = lambda s: lambda: timing.chain_time(s, jnp.float32(0), sets, reps=1, target_s=0.01)  # noqa: E731
    assert _sorts_per_chain(monkeypatch, run(step)) == [2, 8]

    def folded(k, a, c):
        ids = timing.follow([a], c)[0]
        return c + (jnp.sort(ids)[0] * 0).astype(c.dtype)

    assert _sorts_per_chain(monkeypatch, run(folded)) == [0, 0]


class _State(NamedTuple):  # the loop state's one field `phase_time` touches, with the state's `replace`
    P_B: jax.Array

    def replace(self, P_B):
        return self._replace(P_B=P_B)


def test_phase_time_takes_the_loops_own_iteration_off():
    # `bench_spec`'s bookkeeping column is the cycle less its draft and verify phases; the cycle pays one loop
    # iteration, so each phase is timed without the iteration it would otherwise carry.
    answers, bodies = [5e-4, 3e-5], []

    def loop_timer(body, carry, args, reps, n, timer):
        bodies.append(body)
        return answers[len(bodies) - 1]

    State = lambda: _State(jnp.zeros((2,), jnp.int32))  # noqa: E731

    phase = lambda p, d, s: jnp.arange(3) + p  # noqa: E731
    t = timing.phase_time(phase, lambda out: out.max(), State(), (jnp.int32(1), None), loop_timer=loop_timer)
    assert t == pytest.approx(5e-4 - 3e-5) and len(bodies) == 2
    # the phase's body feeds its output to the carry; the iteration's own body leaves a carry of 0 at 0
    assert int(bodies[0]((State(), (jnp.int32(1), None)), jnp.int32(0))) == 3
    assert int(jax.jit(bodies[1])(None, jnp.int32(0))) == 0


def test_phase_time_reports_no_measurement_as_zero_and_never_goes_below_zero():
    def scripted(values):
        def loop_timer(body, carry, args, reps, n, timer):
            return values.pop(0)

        return loop_timer

    State = lambda: _State(jnp.zeros((1,), jnp.int32))  # noqa: E731

    args = (State(), lambda p, d, s: p, lambda out: out)
    assert timing.phase_time(args[1], args[2], args[0], (jnp.int32(0), None), loop_timer=scripted([0.0])) == 0.0
    assert timing.phase_time(args[1], args[2], args[0], (jnp.int32(0), None), loop_timer=scripted([2e-5, 3e-5])) == 0.0


def test_phase_times_idle_iteration_is_a_loop_that_runs():
    # the iteration timed without a phase must still be a loop of work XLA keeps, or nothing is taken off
    many = jax.jit(lambda c, n: jax.lax.fori_loop(0, n, lambda i, c: timing.idle_iteration(None, c), c))
    assert int(many(jnp.int32(0), jnp.int32(7))) == 0
    hlo = many.lower(jnp.int32(0), jnp.int32(7)).compile().as_text()
    assert " while(" in hlo and "xor" in hlo
