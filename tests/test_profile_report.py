"""jaxspec.profile_report on CPU traces of the demo pair written by `python -m jaxspec.generate --profile`."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from jaxspec import demo, profile_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not demo.available(), reason="no built-in demo pair in this checkout")
# The phases (ops attributed through the HLO dump) against the loop's op time found from timestamps alone (every
# op of the program that started within the loop's span): the same ops if every loop op got exactly one phase;
# 2% allows for a few ops of the program outside the loop that the CPU runtime starts while the loop runs. The
# loop's wall time is not the reference: on a shared 2-core host the gaps between ops (the thread waiting for a
# core) were 10% of it on a quiet machine and 47% on a loaded one; it equals op time - overlap + idle exactly.
TOLERANCE = 0.02


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """A speculative (3/1/4) and a plain generation of the demo pair, profiled side by side."""
    model = demo.ensure_converted(progress=False, log=lambda m: None)
    root = tmp_path_factory.mktemp("profiles")
    runs = {"spec": ["--steps", "3", "--topk", "1", "--draft-tokens", "4"], "plain": ["--no-spec"]}
    procs = {
        k: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxspec.generate",
                "--model",
                model,
                "--max-new-tokens",
                "12",
                "--profile",
                str(root / k),
                *a,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k, a in runs.items()
    }
    out = {}
    for k, p in procs.items():
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        out[k] = (str(root / k), err)
    return out


def report_json(capsys, trace_dir):
    assert profile_report.main([trace_dir, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def check_totals(r):
    lp = r["loop"]
    phases = sum(p["ms"] for p in r["phases"].values())
    assert phases == pytest.approx(lp["op_ms"], rel=1e-9)
    assert sum(c["ms"] for c in r["classes"].values()) == pytest.approx(phases, rel=1e-9)
    for p in r["phases"].values():
        assert sum(p["classes_ms"].values()) == pytest.approx(p["ms"], rel=1e-9)
    # the loop's op time measured from the timestamps of its span against the phases' sum
    assert abs(phases - lp["span_op_ms"]) <= TOLERANCE * lp["span_op_ms"], lp
    assert lp["idle_ms"] >= 0 and lp["overlap_ms"] >= -1e-9
    assert phases == pytest.approx(lp["wall_ms"] - lp["idle_ms"] + lp["overlap_ms"], rel=1e-6)
    assert r["unmatched_ops"] == 0


def test_speculative_trace(traces, capsys):
    trace_dir, err = traces["spec"]
    r = report_json(capsys, trace_dir)
    lp = r["loop"]
    assert lp["kind"] == "speculative" and "run_loop" in lp["module"] and lp["devices"] == 1
    cycles = int(re.search(r"(\d+) cycles", err).group(1))
    assert lp["cycles"] == cycles
    assert list(r["phases"]) == ["draft", "verify", "accept", "commit", "draft_extend", "other"]
    for name in ("draft", "verify", "accept", "commit", "draft_extend"):
        assert r["phases"][name]["ms"] > 0, name
    check_totals(r)
    ph = r["phases"]
    assert max(ph, key=lambda p: ph[p]["ms"]) == "verify"
    # the target's routed experts run in verify only; the draft has attention but no experts; one device
    assert ph["verify"]["classes_ms"]["routed experts"] > 0 and ph["verify"]["classes_ms"]["attention"] > 0
    for name in ("draft", "draft_extend"):
        assert ph[name]["classes_ms"]["routed experts"] == 0 and ph[name]["classes_ms"]["attention"] > 0
        assert ph[name]["classes_ms"]["dense matmuls"] > 0
    assert r["classes"]["collectives"]["ms"] == 0
    assert "jit_start" in r["outside_loop_ms"]  # the prefill
    assert profile_report.main([trace_dir]) == 0
    table = capsys.readouterr().out
    for label in ("draft steps", "verify", "accept", "commit", "draft extend", "other", "total", "ms/cycle"):
        assert label in table, table


def test_plain_trace(traces, capsys):
    trace_dir, err = traces["plain"]
    r = report_json(capsys, trace_dir)
    lp = r["loop"]
    assert lp["kind"] == "plain" and "run_loop" in lp["module"]
    new_tokens = int(re.search(r"\[plain\] (\d+) tokens", err).group(1))
    assert lp["cycles"] == new_tokens - 1  # the first token comes from the prefill
    assert list(r["phases"]) == ["target_decode", "other"]
    assert r["phases"]["target_decode"]["share"] > 0.8
    check_totals(r)


def test_errors(traces, tmp_path, capsys):
    assert profile_report.main([str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert profile_report.main([str(tmp_path)]) == 2
    assert "no profiler run found" in capsys.readouterr().err
    copy = str(tmp_path / "nohlo")
    shutil.copytree(traces["spec"][0], copy, ignore=shutil.ignore_patterns("hlo"))
    assert profile_report.main([copy]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no optimized HLO dump" in err and "--profile" in err
