"""Learning-rate schedule and wall-clock step budgets of the trainers."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from jaxspec import training


@pytest.mark.parametrize("total", [7, 150, 4000])
def test_schedules_match_optax_warmup_cosine(total):
    """lr_at (the host-side schedule of the settable optimizer) equals make_optimizer's optax schedule."""
    ref = optax.warmup_cosine_decay_schedule(0.0, 3e-3, min(20, max(total // 10, 1)), total, 3e-4)
    steps = np.unique(np.linspace(0, total + 5, 60).astype(int))
    want = np.array([float(ref(s)) for s in steps])
    host = np.array([training.lr_at(int(s), 3e-3, total) for s in steps])
    np.testing.assert_allclose(host, want, rtol=1e-5, atol=1e-9)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_budget(monkeypatch, seconds, step_seconds, max_steps=10**6):
    """Drive a StepBudget with a fake clock; step_seconds(i) is the duration of step i (1-based)."""
    clock = FakeClock()
    monkeypatch.setattr(training.time, "perf_counter", clock)
    budget = training.StepBudget(seconds, max_steps)
    step = 0
    while step < budget.total:
        step += 1
        clock.now += step_seconds(step)
        budget.update(step, None)
    return step, clock.now


def test_budget_fixes_the_step_count_after_compilation(monkeypatch):
    # 10 s compile, an 8 s recompile at step 2 (as seen on the GPU), then 0.1 s per step; 60 s budget.
    steps, elapsed = run_budget(monkeypatch, 60.0, lambda i: {1: 10.0, 2: 8.0}.get(i, 0.1))
    assert abs(steps - (5 + (60.0 - 18.3) / 0.1)) <= 1 and elapsed == pytest.approx(60.0, abs=0.2)


def test_budget_never_exceeds_max_steps(monkeypatch):
    steps, _ = run_budget(monkeypatch, 60.0, lambda i: 0.1, max_steps=100)
    assert steps == 100


def test_budget_refines_once_and_stops_an_overspending_run(monkeypatch):
    # Steps slow down 2x after the first estimate (which planned ~1000 steps): the refinement
    # at step 125 shortens the run to what is left of the budget.
    steps, elapsed = run_budget(monkeypatch, 100.0, lambda i: 0.1 if i <= 25 else 0.2)
    assert abs(steps - (125 + (100.0 - 22.5) / 0.2)) <= 1 and elapsed == pytest.approx(100.0, abs=0.3)
    # Slowdown after the refinement: the 10% overspend guard ends the run at the next check.
    steps, elapsed = run_budget(monkeypatch, 100.0, lambda i: 0.1 if i <= 125 else 5.0)
    assert elapsed <= 1.1 * 100.0 + 50 * 5.0 and steps % 50 == 0
