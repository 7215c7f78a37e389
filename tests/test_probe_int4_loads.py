"""scripts/probe_int4_loads.py on the CPU: its programs read exactly the touched experts' gate and up
bytes, in the kernel's layout and in the tile layout, since the probe's TB/s divide those bytes."""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import int4_moe as im

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def probe():
    sys.path.insert(0, str(SCRIPTS))  # the probe imports the benchmark's problem from its own folder
    try:
        spec = importlib.util.spec_from_file_location("probe_int4_loads", SCRIPTS / "probe_int4_loads.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


@pytest.fixture(scope="module")
def problem(probe):
    E, D, F = 8, 1024, 256
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    ex, wt = probe.routing(rng, 2, E, 32)  # two tokens, top-8 of 32, the busiest of 4 devices' experts
    x = jnp.asarray(rng.integers(-4, 5, size=(2, D)), jnp.float32)
    meta = im.route_blocks(ex, wt, E, 1)
    ops = im._operands(im.relayout(probe.make_layer(jax.random.key(seed), E, D, F)))
    return {"x": x, "meta": meta, "ops": ops, "seed": seed}


@pytest.mark.parametrize(
    "form",
    [
        {"what": "loads"},
        {"what": "loads", "x": 0, "programs": 1},
        {"what": "loads", "programs": 4, "x": 1},
        {"what": "loads", "layout": "tile"},
        {"what": "loads", "bn": 16, "warps": 1, "layout": "tile", "programs": 4},
        {"what": "unpack", "programs": 1, "stamps": True},
        {"what": "unpack", "programs": 4, "live_first": True, "stamps": True},
        {"what": "loads", "programs": 2, "steps": 1, "x": 0},
    ],
)
def test_a_probe_form_reads_every_byte_of_the_touched_experts_and_no_other(probe, problem, form):
    """The fold of the form's loads is numpy's fold of the tiles its programs read; a bit flipped in a touched
    expert's words or scales (gate and up; a random one of the four arrays, and all four for the kernel's own
    layout and the tile layout) changes it, and a bit flipped in an untouched expert's does not."""
    cfg = probe.form_config(form)
    x, meta, ops = problem["x"], problem["meta"], problem["ops"]
    rows, expert = np.asarray(meta["rows"]), np.asarray(meta["expert"])
    live = rows > 0
    touched = sorted(set(expert[live].tolist()))
    assert 1 <= len(touched) < ops["gate_w"].shape[0], (touched, problem["seed"])

    def run(ops):
        return np.asarray(probe.probe_call(cfg, x, meta, ops, interpret=True)[0])[:, live]

    base = run(ops)
    np.testing.assert_array_equal(base, probe.expected_fold(cfg, meta, ops)[:, live])
    rng = np.random.default_rng(problem["seed"])
    untouched = [e for e in range(ops["gate_w"].shape[0]) if e not in touched]
    names = ["gate_w", "up_w", "gate_s", "up_s"]
    if form.get("steps"):  # a K block past a program's first `steps` is not read
        kb = int(rng.integers(1, ops["gate_w"].shape[1] // cfg["programs"]))
        flipped = np.asarray(ops["gate_w"]).copy()
        flipped[touched[0], kb] ^= 1
        np.testing.assert_array_equal(run(dict(ops, gate_w=jnp.asarray(flipped))), base)
    if form.get("programs") or form.get("bn"):  # the other forms: one array at random
        names = [names[int(rng.integers(4))]]
    for name in names:
        arr = np.asarray(ops[name])
        for e, changes in ((int(rng.choice(touched)), True), (int(rng.choice(untouched)), False)):
            idx = (e,) + tuple(int(rng.integers(n)) for n in arr.shape[1:])
            if changes and form.get("steps"):  # a touched expert's flip lands in a K block its programs read
                kcount = arr.shape[1] // cfg["programs"]
                kb = int(rng.integers(cfg["programs"])) * kcount + int(rng.integers(cfg["steps"]))
                idx = (e, kb) + idx[2:]
            flipped = arr.copy()
            flipped[idx] ^= 1 << int(rng.integers(31))
            got = run(dict(ops, **{name: jnp.asarray(flipped)}))
            assert (not np.array_equal(got, base)) == changes, (name, idx, changes, problem["seed"])


def test_the_bytes_are_the_touched_experts_gate_and_up_words_and_scales(probe, problem):
    ops = problem["ops"]
    E, KB, F, W = ops["gate_w"].shape
    per = 2 * (KB * F * W * 4 + KB * F * 4 * 4)  # gate and up: int32 words and int32 scale pairs
    assert per == 2 * (KB * 256 * F // 2 + KB * 256 * F // 32 * 2)  # 4 bits a weight, a bf16 scale per 32
    assert probe._bytes(ops, 3) == 3 * per
    steps = probe.form_config({"what": "loads", "programs": 2, "steps": 1})
    assert probe.form_bytes(steps, 3 * per, KB) == 3 * per * 2 // KB  # one K block of each of two programs
    assert probe.form_bytes(probe.form_config({"what": "kernel"}), 3 * per, KB) == 3 * per


def test_bad_forms_are_refused_with_the_key_named(probe):
    with pytest.raises(ValueError, match="'what'"):
        probe.form_config({"what": "copy"})
    with pytest.raises(ValueError, match="unknown keys \\['blocks'\\]"):
        probe.form_config({"what": "loads", "blocks": 2})
    with pytest.raises(ValueError, match="layout"):
        probe.form_config({"what": "loads", "layout": "rows"})
    with pytest.raises(ValueError, match="x \\(activation loads"):
        probe.form_config({"what": "unpack", "x": 3})
    with pytest.raises(ValueError, match="steps must be a positive"):
        probe.form_config({"what": "unpack", "steps": 0})
    with pytest.raises(ValueError, match="steps=9 exceeds a program's 2 K blocks"):
        probe._steps(probe.form_config({"what": "unpack", "programs": 2, "steps": 9}), 4)
    assert probe.form_config({"what": "kernel", "config": {"gu_stages": 4}}) == {
        "what": "kernel",
        "config": {"gu_stages": 4},
    }


def test_the_timeline_reads_the_programs_timer_and_sm_stamps(probe):
    """Stamps are `STAMPS` pairs of the same int32 (the timer's low word at the start and after the K loop, the SM
    id); times are differences modulo 2**32 (here the low word wraps between the programs' starts and has its top
    bit set before, so it reads as negative); only the live slots' programs count."""
    base = 2**32 - 500  # the low word 500 ns before it wraps

    def stamp(start, end, sm):
        words = [np.int64(t % 2**32).astype(np.uint32).view(np.int32) for t in (start, end)] + [np.int32(sm)]
        return [w for w in words for _ in range(2)]

    stamps = np.zeros((1, 3, 1, 2 * probe.STAMPS), np.int32)  # [programs, slots, tiles, stamps as pairs]
    stamps[0, 0, 0] = stamp(base, base + 30_000, 7)
    stamps[0, 1, 0] = stamp(base + 1_000, base + 27_000, 7)
    stamps[0, 2, 0] = stamp(base + 400, base + 10_400, 9)
    line = probe.timeline(jnp.asarray(stamps), jnp.asarray([3, 0, 0]))
    assert line.startswith("1 programs;") and "K loop 30.00 / 30.00 / 30.00 us" in line, line
    line = probe.timeline(jnp.asarray(stamps), jnp.asarray([3, 1, 0]))
    assert "start +0.50 / +0.90 / +1.00 us" in line and "K loop 26.00 / 28.00 / 30.00 us" in line, line
    assert "; last loop ends +30.00 us;" in line, line
    assert "1 SMs, 2 / 2 / 2 live programs an SM" in line and line.endswith("its SM: 2: 28.00 us"), line
    line = probe.timeline(jnp.asarray(stamps), jnp.asarray([3, 1, 2]))
    assert "2 SMs, 1 / 1.5 / 2 live programs an SM" in line and line.endswith("its SM: 1: 10.00, 2: 28.00 us"), line
    assert probe.timeline(jnp.zeros((1, 2, 1, 2 * probe.STAMPS), jnp.int32), jnp.asarray([3, 1])).startswith(
        "no stamps"
    )
