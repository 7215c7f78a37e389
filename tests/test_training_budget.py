"""Learning-rate schedule and wall-clock step budgets of the trainers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxspec import training


@pytest.mark.parametrize("total", [7, 150, 4000])
def test_schedules_match_optax_warmup_cosine(total):
    """lr_at (the rate each train_step is given) equals optax's warmup-cosine schedule."""
    ref = optax.warmup_cosine_decay_schedule(0.0, 3e-3, min(20, max(total // 10, 1)), total, 3e-4)
    steps = np.unique(np.linspace(0, total + 5, 60).astype(int))
    want = np.array([float(ref(s)) for s in steps])
    host = np.array([training.lr_at(int(s), 3e-3, total) for s in steps])
    np.testing.assert_allclose(host, want, rtol=1e-5, atol=1e-9)


def previous_formula(step: int, peak: float, total: int, warmup: int = 20) -> float:
    """The trainers' schedule as a closed form: linear warmup, then cosine to peak/10 at `total`."""
    warm = min(warmup, max(total // 10, 1))
    if step < warm:
        return peak * step / warm
    frac = min((step - warm) / max(total - warm, 1), 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


@pytest.mark.parametrize("total", [1, 2, 3, 7, 60, 150, 4000])
def test_schedule_keeps_the_closed_form_rates(total):
    """lr_schedule (and lr_at) give the rates of the closed form at every step a run of `total` steps takes."""
    steps = sorted({0, 1, total // 2, total - 1, *np.linspace(0, total - 1, 25).astype(int).tolist()} - {total})
    want = np.array([previous_formula(s, 1e-2, total) for s in steps if s < total])
    sched = training.lr_schedule(1e-2, total)
    got = np.array([float(sched(s)) for s in steps if s < total])
    host = np.array([float(training.lr_at(s, 1e-2, total)) for s in steps if s < total])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(host, want, rtol=1e-6, atol=1e-12)


def test_train_step_is_clipped_adamw_at_the_given_rate():
    """One train_step = global-norm clipping to 1, then AdamW (weight decay 0.01) at rate lr; the
    loss function's metrics come back as they are."""

    def loss(p, batch):
        x, y = batch
        err = x @ p["w"] + p["b"] - y
        return jnp.mean(err**2), {"max_err": jnp.max(jnp.abs(err))}

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.zeros(3, jnp.float32)}
    batch = (jnp.asarray(rng.normal(size=(8, 4)) * 10, jnp.float32), jnp.asarray(rng.normal(size=(8, 3)), jnp.float32))
    ref_opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-2, weight_decay=0.01))
    ref_params, ref_state = params, ref_opt.init(params)
    new_params, new_state = jax.tree.map(jnp.array, params), training.make_optimizer().init(params)
    for _ in range(3):
        want_loss, want_metrics = loss(ref_params, batch)
        grads = jax.grad(lambda p: loss(p, batch)[0])(ref_params)
        assert optax.tree.norm(grads) > 1.0  # the clipping matters
        updates, ref_state = ref_opt.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        new_params, new_state, value, metrics = training.train_step(loss, new_params, new_state, 3e-2, batch)
        np.testing.assert_allclose(float(value), float(want_loss), rtol=1e-5)  # the loss before the update
        np.testing.assert_allclose(float(metrics["max_err"]), float(want_metrics["max_err"]), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), new_params, ref_params)


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
