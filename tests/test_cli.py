"""`python -m jaxspec.generate` end to end on a converted target + draft pair with a tokenizer."""

import glob
import gzip
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import spec_pair
from test_export import random_target, random_tree, tiny_tokenizer

from checkpoints_convert.convert import convert
from checkpoints_convert.export import export_draft, export_target
from jaxspec import training
from jaxspec.draft import init_params as draft_init

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    V = 320  # 62 letter tokens + the 256 special ids every Kimi-style tokenizer reserves
    cfg, params = random_target(V, seed=0)
    tok = str(root / "tok")
    tiny_tokenizer(tok, 62)  # ids 0..61 are letters, 62/63 are [BOS]/[EOS]
    export_target(cfg, params, str(root / "target"), tokenizer_dir=tok)
    dcfg = spec_pair.draft_config(V, 200)
    dparams = random_tree(jax.eval_shape(lambda: draft_init(dcfg, jax.random.key(0))), 1)
    d2t, t2d = training.vocab_map(np.random.default_rng(1).integers(0, 100, V), 200)
    export_draft(dcfg, dparams, d2t, t2d, str(root / "draft"))
    out = str(root / "ck")
    convert(str(root / "target"), out, draft_dir=str(root / "draft"), dtype="float32", progress=False)
    return out


def run_cli(*args):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxspec.generate", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_speculative_cli_streams_and_profiles(pair_dir, tmp_path):
    prof = str(tmp_path / "trace")
    proc = run_cli(
        "--model",
        pair_dir,
        "--prompt",
        "abcab",
        "--max-new-tokens",
        "12",
        "--steps",
        "2",
        "--topk",
        "2",
        "--draft-tokens",
        "4",
        "--profile",
        prof,
    )
    assert proc.stdout.startswith("abcab") and len(proc.stdout.strip()) > len("abcab")
    assert "[speculative]" in proc.stderr and "tok/s" in proc.stderr
    assert "mean acceptance length" in proc.stderr
    traces = glob.glob(os.path.join(prof, "**", "*.xplane.pb"), recursive=True) + glob.glob(
        os.path.join(prof, "**", "*.trace.json.gz"), recursive=True
    )
    assert traces, f"no profiler trace under {prof}"
    blob = b"".join(open(t, "rb").read() if t.endswith(".pb") else gzip.open(t).read() for t in traces)
    for scope in (b"draft", b"verify", b"accept", b"commit"):
        assert scope in blob, f"named scope {scope!r} missing from the trace"


def test_plain_cli_matches_speculative_greedy_text(pair_dir):
    a = run_cli("--model", pair_dir, "--prompt", "bca", "--max-new-tokens", "10", "--no-spec")
    b = run_cli("--model", pair_dir, "--prompt", "bca", "--max-new-tokens", "10")
    assert "[plain]" in a.stderr and "[speculative]" in b.stderr
    assert a.stdout == b.stdout


def test_cli_reports_bad_model_dir(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxspec.generate", "--model", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "COMPLETE" in proc.stderr or "not a complete jaxspec checkpoint" in proc.stderr
