"""`jaxspec.timing.loop_time`: a disturbed (non-positive) difference is timed again, not taken as a cost."""

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
