"""The built-in demo pair: converts through the real path, is lossless, accepts well, caches."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxspec import demo
from jaxspec.engine import Engine
from jaxspec.spec import SpecConfig

pytestmark = pytest.mark.skipif(not demo.available(), reason="no built-in demo pair in this checkout")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("demo") / "ck")
    return demo.ensure_converted(out, progress=False, log=lambda m: None)


def heldout_prompts():
    with open(os.path.join(demo.DEMO_DIR, "heldout_prompts.json")) as f:
        return json.load(f)["prompts"]


@pytest.mark.parametrize(
    "cfg,floor", [(SpecConfig(3, 1, 4), 2.5), (SpecConfig(5, 4, 12), 3.7)], ids=["chain-3-1-4", "tree-5-4-12"]
)
def test_heldout_greedy_is_lossless_with_high_acceptance(converted, cfg, floor):
    """Held-out prompts: speculative greedy == plain greedy, and the draft really predicts the target.

    Floors sit below the measured values (chain 2.72, tree 4.06 on these prompts; see
    jaxspec/demo/MODEL_CARD.md) and far above what a draft that predicts nothing gets (1.0).
    """
    engine = Engine.load(converted)
    prompts = [engine.tokenizer.encode(p) for p in heldout_prompts()]
    plain = [r.tokens for r in engine.generate(prompts, 48)]
    res = engine.generate(prompts, 48, spec=cfg)
    assert [r.tokens for r in res] == plain
    lengths = np.concatenate([r.stats["accept_lengths"] for r in res])
    assert lengths.mean() >= floor, lengths.mean()


def test_cache_is_reused_then_rebuilt_when_broken(converted, tmp_path):
    out = str(tmp_path / "cache")
    logs = []
    demo.ensure_converted(out, progress=False, log=logs.append)
    assert any("converting" in m for m in logs)
    logs.clear()
    marker = os.path.join(out, "COMPLETE")
    stamp = os.path.getmtime(marker)
    assert demo.ensure_converted(out, progress=False, log=logs.append) == out
    assert not logs and os.path.getmtime(marker) == stamp  # reused as is
    os.remove(marker)  # an interrupted conversion
    demo.ensure_converted(out, progress=False, log=logs.append)
    assert any("incomplete" in m for m in logs) and os.path.exists(marker)
    logs.clear()
    with open(os.path.join(out, demo.SOURCE_FILE), "w") as f:
        json.dump({"fingerprint": "from-an-older-version"}, f)
    demo.ensure_converted(out, progress=False, log=logs.append)
    assert any("another version" in m for m in logs)


def test_processes_starting_together_convert_once(tmp_path):
    """Two processes asking for the demo at once on a fresh cache: one converts while the other waits for
    it (a file lock), and both get the complete checkpoint."""
    out = str(tmp_path / "cache")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from jaxspec import demo; "
        "print(demo.ensure_converted(sys.argv[2], progress=False, log=lambda m: print('LOG', m)))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, root, out], stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert all(o.strip().splitlines()[-1] == out for o in outputs)
    assert sum("converting" in o for o in outputs) == 1, outputs
    logs = []
    assert demo.ensure_converted(out, progress=False, log=logs.append) == out and not logs  # complete


def test_xdg_cache_home_is_respected(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert demo.cache_root() == os.path.join(str(tmp_path), "jaxspec")


def test_training_time_test_predicts_the_chain_decode(converted):
    """The draft trainer's unrolled steps and the speculative loop are the same computation.

    On the target's own greedy text, the per-row, per-step hits of `draft_ttt_hits`
    (what the trainer optimises) replay a chain decode: a cycle rooted at position r
    accepts the leading hits of row r-1. The replayed accept lengths must be the ones
    the engine reports, cycle by cycle; a position, mask or cache mismatch between
    training and inference would break this while leaving the output lossless.
    """
    import jax
    import jax.numpy as jnp

    from jaxspec import training

    engine = Engine.load(converted, dtype="float32")
    draft, steps = engine.draft, 3
    prompts = [engine.tokenizer.encode(p) for p in heldout_prompts()]
    plain = [r.tokens for r in engine.generate(prompts, 48)]
    spec = engine.generate(prompts, 48, spec=SpecConfig(steps, 1, steps + 1))
    t2d = np.zeros(engine.cfg.vocab_size, bool)
    t2d[np.asarray(draft.d2t) + np.arange(len(draft.d2t))] = True
    to_draft = jnp.asarray(training.target_to_draft_ids(t2d))
    # One causal batch: padding after a row's end changes nothing before it.
    seqs = [p + o for p, o in zip(prompts, plain)]
    batch = jnp.asarray([s + [0] * (max(map(len, seqs)) - len(s)) for s in seqs], jnp.int32)
    logits, aux = jax.jit(training.target_forward, static_argnums=(0, 3))(
        engine.model, engine.params, batch, draft.aux_ids
    )
    hits_all = np.asarray(
        training.draft_ttt_hits(
            draft.params,
            draft.cfg,
            engine.params["embed"]["embedding"],
            aux,
            batch,
            to_draft[jnp.argmax(logits, -1)],
            steps,
        )
    )
    rows_equal = cycles = 0
    for prompt, seq, hits, res in zip(prompts, seqs, hits_all, spec):
        replay, r = [], len(prompt)  # the first root is the first generated token, at len(prompt)
        while r + steps < len(seq):  # cycles whose drafts all lie inside the known text
            a = 0
            while a < steps and hits[r - 1, a]:
                a += 1
            replay.append(a + 1)
            r += a + 1
        actual = res.stats["accept_lengths"][: len(replay)]
        cycles += len(replay)
        rows_equal += actual == replay
        assert sum(a == b for a, b in zip(actual, replay)) >= 0.9 * len(replay), (actual, replay)
    assert rows_equal >= len(prompts) - 1 and cycles > 50
