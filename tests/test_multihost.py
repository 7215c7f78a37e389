"""Multi-host: two local processes of 4 fake CPU devices each (one 8-device mesh over both,
gloo collectives) give the single-process 8-device results, through the API and the CLI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import cpu_env
import jax
import numpy as np
import pytest
import spec_pair
from test_export import random_target, random_tree, tiny_tokenizer

from checkpoints_convert.convert import convert
from checkpoints_convert.export import export_draft, export_target
from jaxspec import checkpoint, distributed, generate
from jaxspec.draft import init_params as draft_init
from jaxspec.engine import Engine
from jaxspec.model import abstract_params, per_layer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["abcab", "bca"]
CLI_PROMPT = "cabbage"

# One process of a run. First the CLI (it joins the group when given the multi-host flags and prints
# from process 0 only), then, in the same process, the Python API; its results go to the file OUT.
WORKER = r"""
import json, os, sys
ckpt, out, n, pid, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
prompts, cli_prompt = json.loads(sys.argv[6]), sys.argv[7]
from jaxspec import distributed, generate
cli = ["--model", ckpt, "--prompt", cli_prompt, "--max-new-tokens", "24", "--steps", "3", "--topk", "2",
       "--draft-tokens", "6", "--dtype", "float32", "--num-devices", "8"]
if n > 1:
    cli += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(pid)]
assert generate.main(cli) == 0
sys.stdout.flush()
os.dup2(2, 1)  # what follows is not the CLI's output
import jax
from jaxspec.engine import Engine
from jaxspec.spec import SpecConfig
distributed.initialize(f"127.0.0.1:{port}" if n > 1 else None, n if n > 1 else None, pid if n > 1 else None)
engine = Engine.load(ckpt, dtype="float32", num_devices=8)
experts = engine.params["layers"]["moe"]["gate"].packed  # the stacked MoE layers
res = {"processes": jax.process_count(), "devices": len(jax.devices()), "local": len(jax.local_devices()),
       "mesh": engine.mesh.devices.size, "expert_spec": str(experts.sharding.spec),
       "expert_addressable": len(experts.addressable_shards), "expert_bytes": experts.nbytes,
       "local_expert_bytes": sum(s.data.nbytes for s in experts.addressable_shards)}
res["plain"] = [r.tokens for r in engine.generate(prompts, 24)]
(tree,) = engine.generate([cli_prompt], 24, spec=SpecConfig(3, 2, 6))  # the CLI's program: compiled already
res["tree"], res["tree_accept"], res["tree_text"] = tree.tokens, tree.stats["accept_lengths"], tree.text
(plain_cli,) = engine.generate([cli_prompt], 24)
res["plain_cli"] = plain_cli.tokens
res["logits"] = engine.target_logits(list(range(3, 40))).tolist()
with open(out, "w") as f:
    json.dump(res, f)
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A converted INT4 target + draft pair whose heads, experts and vocab divide 8, written in small
    chunks so that every process restores its own shards of the sharded leaves."""
    root = tmp_path_factory.mktemp("multihost")
    V = 320  # 62 letters + [BOS], [EOS] + the 256 reserved special ids
    cfg, _ = random_target(V, seed=0)
    cfg = cfg.replace(num_heads=8, num_experts=16, num_experts_per_tok=4)
    tiny_tokenizer(str(root / "tok"), 62)
    export_target(
        cfg,
        random_tree(per_layer(cfg, abstract_params(cfg)[0]), 0),
        str(root / "target"),
        tokenizer_dir=str(root / "tok"),
    )
    # A draft that always proposes the token the target repeats most in its greedy continuation of the CLI
    # prompt (a zero final norm makes every draft logit 0, so the top-k ties resolve to draft ids 0, 1, and
    # draft id 0 maps to that token): multi-token cycles are certain, not luck.
    convert(str(root / "target"), str(root / "target_ck"), dtype="float32", progress=False)
    target = Engine.load(str(root / "target_ck"), dtype="float32", num_devices=1)
    greedy = target.generate([target.tokenizer.encode(CLI_PROMPT)], 24)[0].tokens
    favourite = int(np.bincount(greedy).argmax())
    dcfg = spec_pair.draft_config(V, 200)
    dparams = random_tree(jax.eval_shape(lambda: draft_init(dcfg, jax.random.key(0))), 1)
    dparams["norm"]["scale"] = np.zeros_like(dparams["norm"]["scale"])
    others = [t for t in np.random.default_rng(1).permutation(V)[:201].tolist() if t != favourite][:199]
    keep = np.array([favourite] + sorted(others))
    d2t = (keep - np.arange(200)).astype(np.int64)
    t2d = np.zeros(V, bool)
    t2d[keep] = True
    export_draft(dcfg, dparams, d2t, t2d, str(root / "draft"))
    chunk, checkpoint.CHUNK_BYTES = checkpoint.CHUNK_BYTES, 4096
    try:
        convert(str(root / "target"), str(root / "ck"), draft_dir=str(root / "draft"), dtype="float32", progress=False)
    finally:
        checkpoint.CHUNK_BYTES = chunk
    return str(root / "ck"), root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}  # gRPC to 127.0.0.1, never a proxy
    return cpu_env.fake_devices(devices, env, PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))


def run_group(cmds: list[list[str]], devices: int, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Run the processes of one job together; the first failure (or the timeout) kills the rest."""
    procs = [
        subprocess.Popen(c, cwd=ROOT, env=child_env(devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in cmds
    ]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        outs = [p.communicate() for p in procs]
    done = [subprocess.CompletedProcess(c, p.returncode, o, e) for c, p, (o, e) in zip(cmds, procs, outs)]
    for i, d in enumerate(done):
        assert d.returncode == 0, f"process {i} of {len(done)} exited {d.returncode}:\n{d.stderr[-3000:]}"
    return done


def run_workers(ckpt: str, out_dir, n: int) -> tuple[list[dict], list[subprocess.CompletedProcess]]:
    port = str(free_port())
    outs = [str(out_dir / f"{n}proc_{i}.json") for i in range(n)]
    procs = run_group(
        [
            [sys.executable, "-c", WORKER, ckpt, outs[i], str(n), str(i), port, json.dumps(PROMPTS), CLI_PROMPT]
            for i in range(n)
        ],
        8 // n,
    )
    results = []
    for path in outs:
        with open(path) as f:
            results.append(json.load(f))
    return results, procs


def test_two_processes_equal_one_process(pair):
    """Greedy output (plain, and speculative with a 3/2/6 tree), acceptance per cycle and the target's
    logits of the 2 x 4-device run equal the 1 x 8-device run; each process holds only its own shards
    of a sharded leaf; the CLI prints from process 0 only, exactly what the single-process CLI prints."""
    ckpt, root = pair
    (one,), (cli_one,) = run_workers(ckpt, root, 1)
    two, (cli0, cli1) = run_workers(ckpt, root, 2)
    assert one["devices"] == 8 and one["processes"] == 1
    for i, r in enumerate(two):
        assert (r["processes"], r["devices"], r["local"], r["mesh"]) == (2, 8, 4, 8), r
        assert r["expert_spec"] == one["expert_spec"] and "model" in r["expert_spec"]
        assert r["expert_addressable"] == 4 and r["local_expert_bytes"] * 2 == r["expert_bytes"]
        assert r["plain"] == one["plain"], f"process {i}: plain greedy differs"
        assert r["tree"] == one["tree"], f"process {i}: speculative greedy differs"
        assert r["tree_accept"] == one["tree_accept"]
        # float32; gloo's all-reduces sum the devices' partials in another order than in-process ones.
        np.testing.assert_allclose(r["logits"], one["logits"], rtol=1e-4, atol=1e-4)
    assert one["tree"] == one["plain_cli"]  # lossless on the mesh, too
    assert any(a > 1 for a in one["tree_accept"])  # the random draft is right sometimes: multi-token cycles ran

    assert cli_one.stdout == CLI_PROMPT + one["tree_text"]
    assert cli0.stdout == cli_one.stdout  # streamed by process 0, no library chatter in it
    assert "[speculative]" in cli0.stderr and "mean acceptance length" in cli0.stderr
    assert cli1.stdout == "" and "[speculative]" not in cli1.stderr


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (
            ["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "3"],
            ["--process-id 3", "--num-processes 2", "0..1"],
        ),
        (["--coordinator", "127.0.0.1:1234"], ["--coordinator", "without --num-processes"]),
        (["--num-processes", "2", "--process-id", "0"], ["--num-processes 2", "--coordinator HOST:PORT"]),
        (
            ["--coordinator", "node0", "--num-processes", "2", "--process-id", "0"],
            ["--coordinator 'node0'", "HOST:PORT"],
        ),
        (["--coordinator", "node0:99999", "--num-processes", "2", "--process-id", "0"], ["1..65535"]),
        (["--coordinator", "node0:1234", "--num-processes", "2"], ["--process-id I", "0..1"]),
        (
            ["--coordinator", "node0:1234", "--num-processes", "0", "--process-id", "0"],
            ["--num-processes must be >= 1"],
        ),
    ],
)
def test_cli_rejects_bad_multihost_flags(argv, fragments, capsys):
    assert generate.main(["--model", "unused", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    for fragment in fragments:
        assert fragment in err, err


def test_api_names_its_arguments():
    with pytest.raises(ValueError, match=r"process_id 2 is out of range for num_processes 2"):
        distributed.initialize("127.0.0.1:1234", 2, 2)
    with pytest.raises(ValueError, match=r"coordinator given without num_processes"):
        distributed.check_args("127.0.0.1:1234", None, None)
    assert distributed.initialize() is False  # nothing asked: a single-process run, nothing to join
    assert distributed.check_args(None, 1, 0) is False
