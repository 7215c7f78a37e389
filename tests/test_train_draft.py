"""`python -m jaxspec.train_draft` trains a draft that really speeds up its target, and resumes.

A tiny target trained on spec_pair's deterministic successor corpus is exported in
Kimi-K2.5 layout (INT4 experts) and converted; the CLI trains a draft on corpus
tokens saved as .npy, is interrupted half way, resumes, and writes a SpecForge
checkpoint that pairs with the target for lossless speculative decoding.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os

import cpu_env
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spec_pair
from test_export import random_tree

from checkpoints_convert.convert import convert
from checkpoints_convert.draft import read_draft
from checkpoints_convert.export import export_target
from checkpoints_convert.tokenizer_files import write_tiktoken_file, write_tokenizer_config
from jaxspec import quant, train_draft, training
from jaxspec.draft import DraftConfig
from jaxspec.draft import init_params as init_draft_params
from jaxspec.engine import Engine
from jaxspec.model import Transformer, abstract_params, choose_expert_impl, per_layer, stack_layers
from jaxspec.spec import SpecConfig
from jaxspec.tokenizer import KimiTokenizer


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(HF target dir, converted checkpoint dir, corpus, tokens.npy path)."""
    root = tmp_path_factory.mktemp("train_draft")
    corpus, cfg = spec_pair.Corpus(64, p_main=1.0), spec_pair.target_config(64)
    init = jax.tree.map(jnp.asarray, stack_layers(cfg, random_tree(per_layer(cfg, abstract_params(cfg)[0]), seed=0)))
    params, loss = training.train_target(Transformer(cfg), init, corpus.batches(), 40, lr=1e-2)
    assert loss < 0.1
    hf, ck, tokens = str(root / "hf"), str(root / "ck"), str(root / "tokens.npy")
    export_target(cfg, params, hf, dtype="float32")  # Kimi layout, INT4 experts
    convert(hf, ck, dtype="float32", progress=False)
    np.save(tokens, corpus.sample(64, 32))  # 64 documents of 32 tokens
    return hf, ck, corpus, tokens


def cli_args(ck, tokens, out, *extra):
    return [
        "--model",
        ck,
        "--data",
        tokens,
        "--out",
        out,
        "--steps",
        "60",
        "--batch",
        "16",
        "--seq-len",
        "32",
        "--lr",
        "1e-2",
        "--draft-vocab",
        "56",
        "--aux-layers",
        "0",
        "1",
        "1",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--save-every",
        "20",
        "--save-dtype",
        "float32",
        "--quiet",
        *extra,
    ]


def saved_step(out) -> int:
    with np.load(os.path.join(out, "train_state", "state.npz")) as z:
        return json.loads(str(z["meta"]))["step"]


@pytest.fixture(scope="module")
def resumed(target, tmp_path_factory):
    """A draft the CLI trained in three runs: interrupted at step 30, refused a silent restart, resumed to
    step 60. Returns (its directory, what each run returned and left). Two tests use it: the run itself is
    checked below, and its draft is the starting point `--init` fine-tunes."""
    _, ck, _, tokens = target
    out = str(tmp_path_factory.mktemp("resumed") / "draft")

    def interrupt_at_30(step):
        if step == 30:
            raise KeyboardInterrupt

    runs = {"interrupted": train_draft.main(cli_args(ck, tokens, out), on_step=interrupt_at_30)}
    runs["step_after_interrupt"] = saved_step(out)
    runs["draft_after_interrupt"] = os.path.exists(os.path.join(out, "config.json"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        runs["restart"] = train_draft.main(cli_args(ck, tokens, out))
    runs["restart_err"] = err.getvalue()
    runs["resumed"] = train_draft.main(cli_args(ck, tokens, out, "--resume"))
    runs["step_after_resume"] = saved_step(out)
    return out, runs


def test_train_interrupt_resume_and_speculate(target, resumed, tmp_path):
    hf, ck, corpus, tokens = target
    out, runs = resumed
    assert runs["interrupted"] == 130
    assert runs["step_after_interrupt"] == 30
    assert not runs["draft_after_interrupt"]  # no draft until training finishes
    assert runs["restart"] == 2  # refuses to silently restart
    assert "--resume" in runs["restart_err"]
    assert runs["resumed"] == 0
    assert runs["step_after_resume"] == 60

    with open(os.path.join(out, "train_log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    assert [r["step"] for r in log] == list(range(1, 61))  # continued at 31, nothing repeated
    assert log[30]["loss"] < 0.5 * log[0]["loss"]  # the resumed run starts from trained params
    assert min(log[-1]["acc"]) > 0.9

    dcfg = read_draft(out)[0]
    assert (dcfg.aux_layer_ids, dcfg.draft_vocab_size, dcfg.hidden_size) == ((0, 1, 1), 56, 64)
    pair = str(tmp_path / "pair")
    convert(hf, pair, draft_dir=out, dtype="float32", progress=False)
    engine = Engine.load(pair, dtype="float32")
    prompts = [corpus.sample(1, n)[0].tolist() for n in (3, 9, 5, 12)]
    plain = [r.tokens for r in engine.generate(prompts, 24)]
    res = engine.generate(prompts, 24, spec=SpecConfig(3, 1, 4))
    assert [r.tokens for r in res] == plain
    assert np.mean([r.stats["mean_accept_len"] for r in res]) >= 2.0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--hidden", "32"], "--hidden 32: the draft shares the target's embedding table"),
        (["--heads", "5"], "--heads 5"),
        (["--aux-layers", "0", "1", "2"], "--aux-layers"),
        (["--draft-vocab", "65"], "--draft-vocab 65"),
        (["--seq-len", "4"], "--seq-len 4 is too short for --ttt-steps 3"),
        (["--batch", "65"], "--batch 65 needs at least 65 sequences"),
        (["--resume", "--time-budget", "10"], "--time-budget applies to a fresh run"),
        (["--step-decay", "0"], "--step-decay must be > 0, found 0.0"),
    ],
)
def test_bad_flags_are_named(target, tmp_path, capsys, extra, message):
    _, ck, _, tokens = target
    assert train_draft.main(cli_args(ck, tokens, str(tmp_path / "d"), *extra)) == 2
    assert message in capsys.readouterr().err


def test_step_decay_weights_the_unrolled_steps():
    """The TTT loss is sum_k decay**k * CE_k / sum_k decay**k, CE_k the masked mean of step k."""
    rng = np.random.default_rng(0)
    dcfg = DraftConfig(
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=48,
        rms_norm_eps=1e-6,
        vocab_size=40,
        draft_vocab_size=24,
        target_hidden_size=32,
    )
    dparams = init_draft_params(dcfg, jax.random.key(1))
    embed = jnp.asarray(rng.normal(size=(40, 32)), jnp.float32)
    aux = jnp.asarray(rng.normal(size=(2, 12, 96)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 40, size=(2, 12)))
    labels = rng.integers(0, 24, size=(2, 12))
    labels[0, 3:6] = -1  # ignored positions
    labels = jnp.asarray(labels)
    ttt = 3
    n = 12 - 1 - ttt
    unroll = jax.jit(lambda p, e, a, t: [lg for _, lg in training._ttt_unroll(p, dcfg, e, a, t, ttt)])
    per_step = []
    for k, logits in enumerate(unroll(dparams, embed, aux, tokens)):
        lab = np.asarray(labels[:, 1 + k : 1 + k + n])
        logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1))
        rows, cols = np.nonzero(lab >= 0)
        per_step.append(-logp[rows, cols, lab[rows, cols]].mean())
    loss = jax.jit(training.draft_ttt_loss, static_argnums=(1, 6, 7))
    for decay in (1.0, 0.8, 0.3):
        w = decay ** np.arange(ttt)
        got, _ = loss(dparams, dcfg, embed, aux, tokens, labels, ttt, decay)
        np.testing.assert_allclose(float(got), np.sum(w * per_step) / w.sum(), rtol=1e-5, err_msg=f"decay {decay}")


def test_time_budget_ends_training_early_and_still_writes_the_draft(target, tmp_path):
    """A budget far below one step's time stops at the first check (step 5), saves and exports."""
    _, ck, _, tokens = target
    out = str(tmp_path / "d")
    assert train_draft.main(cli_args(ck, tokens, out, "--time-budget", "0.001")) == 0
    assert saved_step(out) == 5
    assert read_draft(out)[0].draft_vocab_size == 56


def test_make_draft_data_writes_prompts_and_greedy_continuations(target, tmp_path):
    """scripts/make_draft_data.py: each row is a corpus window followed by the target's own continuation."""
    _, ck, corpus, _ = target
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "make_draft_data.py")
    spec = importlib.util.spec_from_file_location("make_draft_data", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    stream, out = str(tmp_path / "stream.npy"), str(tmp_path / "selfgen.npy")
    np.save(stream, corpus.sample(1, 400)[0])
    assert (
        script.main(
            [
                "--model",
                ck,
                "--tokens",
                stream,
                "--out",
                out,
                "--prompts",
                "5",
                "--prompt-len",
                "6",
                "--max-new",
                "7",
                "--batch",
                "2",
                "--temperatures",
                "0",
            ]
        )
        == 0
    )
    rows = np.load(out)  # this target has no EOS id: one row per prompt
    assert rows.shape == (5, 13)
    windows = np.lib.stride_tricks.sliding_window_view(np.load(stream), 6)
    assert all((windows == row[:6]).all(1).any() for row in rows)  # prompts are windows of --tokens
    engine = Engine.load(ck, dtype="float32")
    want = [r.tokens for r in engine.generate([row[:6].tolist() for row in rows], 7)]
    assert rows[:, 6:].tolist() == want


def test_text_jsonl_and_npy_data_are_packed_in_a_fixed_order(tmp_path):
    write_tiktoken_file(tmp_path / "tiktoken.model", {bytes([i]): i for i in range(256)})
    write_tokenizer_config(tmp_path / "tokenizer_config.json", {256: "[BOS]", 257: "[EOS]"}, "[BOS]", "[EOS]")
    tok = KimiTokenizer.from_dir(tmp_path)
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "abc"}) + "\n\n" + json.dumps({"text": "de"}) + "\n")
    np.save(tmp_path / "c.npy", np.array([[1, 2], [3, 4]], np.int32))
    files = [str(tmp_path / n) for n in ("a.txt", "b.jsonl", "c.npy")]
    docs = train_draft.read_documents(files, tok, tok.vocab_size)
    assert [d.tolist() for d in docs] == [list(b"hello world"), list(b"abc"), list(b"de"), [1, 2], [3, 4]]

    seqs = train_draft.pack(docs, 4, sep=tok.eos_id)
    stream = sum(([*d.tolist(), 257] for d in docs), [])
    assert seqs.tolist() == np.array(stream[: len(stream) // 4 * 4]).reshape(-1, 4).tolist()
    batches = train_draft.Batches(seqs, 3, seed=0)
    again = train_draft.Batches(seqs, 3, seed=0)
    assert all(np.array_equal(batches.at(s), again.at(s)) for s in (5, 0, 2))  # any order, same batches
    epoch = np.concatenate([batches.at(s) for s in range(len(seqs) // 3)])
    assert len({tuple(r) for r in epoch.tolist()}) == len(epoch)  # no sequence repeats within an epoch

    with pytest.raises(train_draft.UsageError, match=r"c.npy: token ids must be in \[0, 3\)"):
        train_draft.read_documents(files[2:], tok, 3)
    with pytest.raises(train_draft.UsageError, match="text needs a tokenizer"):
        train_draft.read_documents(files[:1], None, 512)


def test_grouped_training_forward_matches_the_decode_expert_path(target):
    """The frozen target's training forward takes grouped matmuls over dequantized INT4 experts;
    its logits, argmax labels and aux states are those of the per-assignment (decode) path."""
    hf, ck, corpus, tokens = target
    engine = Engine.load(ck, dtype="float32")
    assert engine.cfg.expert_format is not None
    # The training forward's MoE layers choose for the batch's token count (the trainer forces nothing).
    impl = choose_expert_impl(engine.cfg, engine.expert_layout, 8 * 32, 1, jnp.float32)
    assert impl == "xla"
    toks = jnp.asarray(np.load(tokens)[:8])
    fwd = jax.jit(training.target_forward, static_argnums=(0, 3))
    ref_logits, ref_aux = fwd(engine.model.clone(expert_impl="gather"), engine.params, toks, (0, 1))
    logits, aux = fwd(engine.model, engine.params, toks, (0, 1))
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(aux, ref_aux, rtol=1e-4, atol=1e-4)
    assert (np.argmax(logits, -1) == np.argmax(ref_logits, -1)).mean() > 0.999


def test_expert_impl_choice_follows_the_dequantized_layer_size():
    from jaxspec.config import preset

    kimi = preset("kimi-k2.5")  # 384 experts of 7168 x 2048, INT4
    choose = lambda shards, force=None: choose_expert_impl(kimi, quant.ROWS, 64 * 256, shards, jnp.bfloat16, force)
    # One device would dequantize a whole layer (34 GB in bf16): stay on the gather path.
    assert choose(1) == "gather"
    # Over 8 devices each holds 48 experts: 4.2 GB, under the limit.
    assert choose(8) == "xla"
    assert choose(8, "gather") == "gather"


def test_init_fine_tunes_an_existing_draft(target, resumed, tmp_path, capsys):
    """--init starts from a SpecForge draft's weights and vocab map; architecture flags are refused."""
    hf, ck, corpus, tokens = target
    base, tuned = resumed[0], str(tmp_path / "tuned")  # base: the CLI's draft of 60 steps
    assert (
        train_draft.main(["--model", ck, "--data", tokens, "--out", tuned, "--init", base, "--intermediate", "64"]) == 2
    )
    assert "--intermediate" in capsys.readouterr().err
    # A step at a negligible rate keeps the weights: the start point is the --init draft itself.
    assert (
        train_draft.main(
            [
                "--model",
                ck,
                "--data",
                tokens,
                "--out",
                tuned,
                "--init",
                base,
                "--steps",
                "1",
                "--batch",
                "4",
                "--seq-len",
                "32",
                "--lr",
                "1e-12",
                "--save-dtype",
                "float32",
                "--quiet",
            ]
        )
        == 0
    )
    cfg_b, params_b, d2t_b, t2d_b = read_draft(base)
    cfg_t, params_t, d2t_t, t2d_t = read_draft(tuned)
    assert cfg_t.to_dict() | {"source": ""} == cfg_b.to_dict() | {"source": ""}
    np.testing.assert_array_equal(d2t_t, d2t_b)
    np.testing.assert_array_equal(t2d_t, t2d_b)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), params_t, params_b)
    # Its acceptance carries over: the tuned copy drafts as well as the base draft.
    pair = str(tmp_path / "pair")
    convert(hf, pair, draft_dir=tuned, dtype="float32", progress=False)
    engine = Engine.load(pair, dtype="float32")
    prompts = [corpus.sample(1, n)[0].tolist() for n in (3, 9, 5, 12)]
    res = engine.generate(prompts, 24, spec=SpecConfig(3, 1, 4))
    assert np.mean([r.stats["mean_accept_len"] for r in res]) >= 2.0


MESH_SCRIPT = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
import jax, jax.numpy as jnp
from jaxspec import train_draft, training
from jaxspec.draft import DraftConfig
from jaxspec.draft import init_params as init_draft_params
from jaxspec.engine import Engine
from jaxspec.model import choose_expert_impl
from jaxspec.sharding import MODEL
ck, tokens = sys.argv[1], np.load(sys.argv[3])[:4]
one = Engine.load(ck, dtype="float32", num_devices=1)
mesh = Engine.load(ck, dtype="float32", num_devices=4)
impl = choose_expert_impl(mesh.cfg, mesh.expert_layout, 4 * 32, mesh.mesh.shape[MODEL], jnp.float32)
fwd = jax.jit(training.target_forward, static_argnums=(0, 3))
ref_logits, ref_aux = fwd(one.model.clone(expert_impl="gather"), one.params, jnp.asarray(tokens), (0, 1))
logits, aux = fwd(mesh.model, mesh.params, jnp.asarray(tokens), (0, 1))
logits, aux, ref_logits, ref_aux = map(np.asarray, (logits, aux, ref_logits, ref_aux))
print(json.dumps({"impl": impl, "shards": int(mesh.mesh.shape[MODEL]),
                  "logits_err": float(np.abs(logits - ref_logits).max()),
                  "aux_err": float(np.abs(aux - ref_aux).max()),
                  "same_argmax": float((np.argmax(logits, -1) == np.argmax(ref_logits, -1)).mean())}))
"""


def test_grouped_training_forward_on_a_mesh(target):
    """The trainer's grouped INT4 expert path with experts split over 4 fake devices equals the
    single-device decode path (the setup of a draft trained for Kimi-K2.5 on one 8-GPU host)."""
    import subprocess
    import sys

    hf, ck, corpus, tokens = target
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = cpu_env.fake_devices(8)
    proc = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT, ck, root, tokens], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["impl"] == "xla" and res["shards"] == 4
    assert res["logits_err"] < 1e-4 and res["aux_err"] < 1e-4
    assert res["same_argmax"] > 0.999
