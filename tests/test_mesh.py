"""The target sharded over fake CPU meshes, the draft replicated (or sharded), checked against one device.

Each test runs a child process with 8 fake CPU devices (the device count is fixed
when JAX starts) and reports JSON. Checked there:

* speculative greedy on 2, 4 and 8 devices, draft replicated and draft sharded,
  equals plain greedy on one device, with the acceptance a trained pair reaches;
* collectives counted from the compiled programs on 4 and 8 devices: none in any
  draft phase of the replicated placement; decode and verify at most 2 per target
  layer plus EMBED_LOGITS_CONSTANT;
* sampled speculative decoding on a 4-device mesh, both placements, follows the
  target's exact distribution (the chi-square test of test_spec_sampling);
* a different sharding is a change to the table: routed INT4 experts split within
  experts instead of across devices give the same logits.
"""

import json
import os
import subprocess
import sys

import cpu_env
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Decode and verify: one all-reduce for the vocab-sharded embedding lookup, and up to two
# collectives for the vocab-sharded logits (argmax / sampling over the vocab).
EMBED_LOGITS_CONSTANT = 3


def start(args, devices: int, **env_extra) -> subprocess.Popen:
    """A child process with `devices` fake CPU devices. Children run side by side: most of their
    time is single-threaded compilation, and this machine has two cores."""
    env = cpu_env.fake_devices(devices, **env_extra)
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: int = 900) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def report(proc: subprocess.Popen) -> dict:
    rc, out, err = finish(proc)
    assert rc == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


_EARLY: dict = {}  # the children, when conftest started them at collection (start_early)


def _start_children() -> dict:
    return {
        name: start([sys.executable, "-c", script, ROOT], devices)
        for name, (script, devices) in {
            "greedy": (GREEDY_SCRIPT, 8),
            "sampling": (SAMPLING_SCRIPT, 8),
            "table": (TABLE_SCRIPT, 4),
        }.items()
    }


def start_early() -> None:
    """Starts the three children as soon as the tests are collected (tests/conftest.py). They are minutes
    of single-threaded compilation; started then, they use the core the other tests leave idle instead
    of running after them."""
    if "procs" not in _EARLY:
        _EARLY["procs"] = _start_children()


def stop_early() -> None:
    """At the end of the session (tests/conftest.py): children started early but never used are stopped."""
    for p in _EARLY.pop("procs", {}).values():
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture(scope="module")
def children():
    """The three child scripts below, started together (at collection, or now)."""
    procs = _EARLY.pop("procs", None) or _start_children()
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
        p.wait()
    stop_early()


def test_counter_counts_a_loop_body_once_per_trip():
    """The stacked decoder layers run as a while loop: its body's collectives count once per layer."""
    from jaxspec.collectives import count_collectives

    hlo = """HloModule m
%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(%a, %b)
}
%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ar = f32[4]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1}}, to_apply=%add
}
%cond (p: (s32[], f32[4])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
ENTRY %main (a: f32[4]) -> f32[4] {
  %g = bf16[2,8]{1,0} all-gather(%a), channel_id=2, dimensions={1}
  %w = (s32[], f32[4]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"61"}}
  %v = (s32[], f32[4]) while(%t2), condition=%cond, body=%body
}
"""
    c = count_collectives(hlo)
    assert c["all-reduce"] == {"count": 62, "bytes": 62 * 16}  # 61 trips, plus once for the loop of unknown count
    assert c["all-gather"] == {"count": 1, "bytes": 32}
    assert c["reduce-scatter"]["count"] == c["all-to-all"]["count"] == c["collective-permute"]["count"] == 0


GREEDY_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
import numpy as np
import spec_pair
from jaxspec.collectives import DRAFT_PHASES, phase_collectives, total
from jaxspec.spec import SpecConfig

# Heads, experts, vocab and the draft's heads all divide 8. 75 steps each, half of train_pair's default: on one
# device, seeds 0-4 reach the full acceptance (4.0 at 3/1/4 and at 3/2/6) with 75 and seeds 0-3 with 50, where
# 25 gives 1.98-2.93; the tests ask for 2.5.
engine, corpus, *_ = spec_pair.train_pair(vocab=64, p_main=1.0, heads=8, draft_heads=8, draft_kv_heads=8, seed=0,
                                          target_steps=75, draft_steps=75)
prompts = [corpus.sample(1, 8)[0].tolist(), corpus.sample(1, 5)[0].tolist()]
ref = [r.tokens for r in engine.generate(prompts, 12)]
out = {"layers": engine.cfg.num_layers, "runs": {}, "collectives": {}}
for n in (2, 4, 8):
    for placement in ("replicated", "sharded"):
        e = spec_pair.on_mesh(engine, n, placement)
        res = e.generate(prompts, 12, spec=SpecConfig(3, 1, 4))
        run = {"devices": int(e.mesh.size), "same": [r.tokens for r in res] == ref,
               "accept": float(np.mean([r.stats["mean_accept_len"] for r in res]))}
        if n == 8:
            tree = e.generate(prompts, 12, spec=SpecConfig(3, 2, 6))
            run["tree_same"] = [r.tokens for r in tree] == ref
            run["plain_same"] = [r.tokens for r in e.generate(prompts, 12)] == ref
        out["runs"][f"{n}-{placement}"] = run
        if n in (4, 8):
            table = phase_collectives(e, batch=2, spec=SpecConfig(3, 1, 4))
            out["collectives"][f"{n}-{placement}"] = {p: total(c) for p, c in table.items()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def greedy(children):
    return report(children["greedy"])


@pytest.mark.parametrize("placement", ["replicated", "sharded"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_speculative_greedy_on_a_mesh_equals_one_device(greedy, n, placement):
    run = greedy["runs"][f"{n}-{placement}"]
    assert run["devices"] == n
    assert run["same"], run
    assert run["accept"] >= 2.5, run  # the trained pair drafts well: equality means something
    if n == 8:
        assert run["tree_same"] and run["plain_same"], run


@pytest.mark.parametrize("n", [4, 8])
def test_replicated_draft_has_no_collectives(greedy, n):
    counts = greedy["collectives"][f"{n}-replicated"]
    assert {p: counts[p] for p in ("draft_tree", "draft_extend", "prompt_extend")} == {
        "draft_tree": 0,
        "draft_extend": 0,
        "prompt_extend": 0,
    }, counts
    # A whole cycle adds to the verify's collectives only the accept step's reduction over the
    # vocab-sharded logits (the target's argmax); commit and the draft add none.
    assert counts["verify"] <= counts["cycle"] <= counts["verify"] + 2, counts


@pytest.mark.parametrize("placement", ["replicated", "sharded"])
@pytest.mark.parametrize("n", [4, 8])
def test_target_collectives_per_layer(greedy, n, placement):
    counts = greedy["collectives"][f"{n}-{placement}"]
    bound = 2 * greedy["layers"] + EMBED_LOGITS_CONSTANT
    assert 0 < counts["decode"] <= bound, counts
    assert 0 < counts["verify"] <= bound, counts


def test_sharded_draft_pays_collectives(greedy):
    """The counter sees the sharded draft's all-reduces (so zero for the replicated one is a real zero)."""
    counts = greedy["collectives"]["8-sharded"]
    assert counts["draft_tree"] >= 3 and counts["draft_extend"] >= 2, counts


SAMPLING_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
import spec_pair
import test_spec_sampling as ts
from jaxspec.spec import SpecConfig

engine, corpus, *_ = spec_pair.train_pair(vocab=16, p_main=0.6, target_steps=150, draft_steps=80, seed=2,
                                          draft_kv_heads=4)
prompt = corpus.sample(1, 4)[0].tolist()
dist = ts.exact_distribution(engine, prompt)
out = {}
for placement in ("replicated", "sharded"):
    e = spec_pair.on_mesh(engine, 4, placement)
    samples, accept = ts.draw(e, prompt, SpecConfig(2, 2, 4), seed=0)
    p, bins = ts.chi_square_pvalue(samples, dist)
    out[placement] = {"devices": int(e.mesh.size), "accept": float(accept), "p": p, "bins": bins}
print(json.dumps(out))
"""


def test_speculative_sampling_on_a_mesh_matches_target_distribution(children):
    res = report(children["sampling"])
    for placement, r in res.items():
        assert r["devices"] == 4
        assert r["accept"] >= 1.5, (placement, r)
        assert r["bins"] >= 6
        assert r["p"] > 1e-3, (placement, r)


TABLE_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
import numpy as np
from jaxspec import demo
from jaxspec.engine import Engine
from jaxspec.sharding import MODEL, RULES

path = demo.ensure_converted(progress=False, log=lambda m: None)  # the user cache's copy, shared
within = tuple((name, {"expert": None, "moe_mlp": MODEL}.get(name, axis)) for name, axis in RULES)
one = Engine.load(path, dtype="float32", num_devices=1)
across = Engine.load(path, dtype="float32", num_devices=4)
inside = Engine.load(path, dtype="float32", num_devices=4, rules=within)
# The fused kernel's tiles layout (Pallas interpret mode) split across the 4 devices.
tiles = Engine.load(path, dtype="float32", num_devices=4, expert_impl="interpret")
# The stacked layers' dense kernels read in place (Pallas interpret mode) inside shard_maps over
# the weights' own sharding, alone and with the kernel's experts, and with the experts split within.
inplace = Engine.load(path, dtype="float32", num_devices=4, dense_impl="interpret")
both = Engine.load(path, dtype="float32", num_devices=4, expert_impl="interpret", dense_impl="interpret")
inplace_within = Engine.load(path, dtype="float32", num_devices=4, rules=within, dense_impl="interpret")
# Attention over the latent cache in one kernel (interpret mode), inside a shard_map over the heads.
attn = Engine.load(path, dtype="float32", num_devices=4, attention_impl="interpret")
ids = list(range(100, 160))
a, b, c, d, f, g, h, k = (
    e.target_logits(ids) for e in (one, across, inside, tiles, inplace, both, inplace_within, attn))
from jaxspec.collectives import phase_collectives, total
from jaxspec.spec import SpecConfig
counts = {name: {p: total(t) for p, t in phase_collectives(e, batch=2, spec=SpecConfig(3, 1, 4)).items()}
          for name, e in (("slice", across), ("inplace", inplace), ("attention", attn), ("tiles", tiles))}
experts = inside.params["layers"]["moe"]  # the stacked MoE layers: [layer, E, ...]
# A MoE layer's all-reduced output added to the residual stream by the next layer's norm kernel (switch on) or
# by an XLA launch of its own (off): the scan's carry, and the bits of the logits, cache and captured states.
import jax, jax.numpy as jnp
from jaxpr_walk import eqns
from jaxspec import decode
from jaxspec.kernels import rms_norm
from jaxspec.model import moe_output_all_reduced
L = inplace.cfg.num_layers
toks = jnp.asarray([np.random.default_rng().integers(0, inplace.cfg.vocab_size, 12)], jnp.int32)
pos, capture, deferred = jnp.arange(12, dtype=jnp.int32)[None], (0, 1, L // 2, L - 1), {}
from jaxspec import sharding
forms = {}
def forward():
    # The forward pass traced once (its jaxpr, then compiled and run). Tokens and positions are its arguments, not
    # constants: the program is the same for every draw of toks, and the persistent compilation cache serves it.
    # Each form (the two switches and the sums' order) is traced, compiled and run once: the default form
    # and the switch-off form of the MoE add are compared again below, and take the same program and bits.
    form = (rms_norm.DEFAULT_CONFIG["moe_add"], rms_norm.DEFAULT_CONFIG["capture"], sharding.ORDERED_SUMS)
    if form not in forms:
        args = (inplace.params, inplace.init_cache(1, 16), toks, pos)
        traced = jax.jit(lambda p, c, t, q: decode.forward(inplace.model, p, t, q, c, capture)).trace(*args)
        compiled = traced.lower().compile()  # the program whose collectives are counted is the one run
        forms[form] = traced, compiled, [np.asarray(v) for v in jax.tree.leaves(compiled(*args))]
    return forms[form]
for on in (True, False):
    rms_norm.DEFAULT_CONFIG["moe_add"] = on
    traced, _, out = forward()
    (scan,) = [q for q in eqns(traced.jaxpr.jaxpr, ("pallas_call",))
               if q.primitive.name == "scan" and q.params["length"] == L - 1]
    carry = scan.params["jaxpr"].jaxpr.outvars[: scan.params["num_carry"]]
    D = inplace.cfg.hidden_size
    deferred[on] = {"hidden": len([v for v in carry if v.aval.ndim == 3 and v.aval.shape[-1] == D]), "out": out}
rms_norm.DEFAULT_CONFIG["moe_add"] = True
captured = np.abs(deferred[True]["out"][2]).reshape(-1, len(capture), inplace.cfg.hidden_size).max(axis=(0, 2))
deferred = {"all_reduced": moe_output_all_reduced(inplace.cfg, inplace.mesh, inplace.rules),
            "hidden": [deferred[True]["hidden"], deferred[False]["hidden"]],
            "same": [bool(np.array_equal(a, b)) for a, b in zip(deferred[True]["out"], deferred[False]["out"])],
            "captured": bool(np.all(captured > 0))}
# A stacked layer's output written into the captured states by the next layer's attention norm launch (the
# default) or by an XLA update of its own: the bits of the logits, cache and captured states, and the update gone
# from the scan's body (the norm inside its shard_map on the mesh).
in_norm = {}
for on in (True, False):
    rms_norm.DEFAULT_CONFIG.update(capture=on, moe_add=False)
    traced, _, out = forward()
    (scan,) = [q for q in eqns(traced.jaxpr.jaxpr, ("pallas_call",))
               if q.primitive.name == "scan" and q.params["length"] == L - 1]
    body = eqns(scan.params["jaxpr"].jaxpr, ("pallas_call",))
    in_norm[on] = {"updates": len([q for q in body if q.primitive.name == "dynamic_update_slice"]), "out": out}
rms_norm.DEFAULT_CONFIG.update(capture=True, moe_add=True)
in_norm = {"updates": [in_norm[True]["updates"], in_norm[False]["updates"]],
           "same": [bool(np.array_equal(a, b)) for a, b in zip(in_norm[True]["out"], in_norm[False]["out"])]}
# The target's sums over the mesh in device order (`sharding.ordered_psum`, the default) or as psums: on the CPU
# XLA's all-reduce adds in that order too, so the bits must match; the collectives move from all-reduce to
# all-gather.
from jaxspec.collectives import count_collectives
ordered = {}
for on in (True, False):
    sharding.ORDERED_SUMS = on
    _, compiled, out = forward()
    ordered[on] = {"out": out,
                   "kinds": {k: v["count"] for k, v in count_collectives(compiled.as_text()).items() if v["count"]}}
sharding.ORDERED_SUMS = True
ordered = {"same": [bool(np.array_equal(a, b)) for a, b in zip(ordered[True]["out"], ordered[False]["out"])],
           "kinds": [ordered[True]["kinds"], ordered[False]["kinds"]], "layers": L}
print(json.dumps({"deferred": deferred, "in_norm": in_norm, "ordered": ordered,
                  "across": float(np.abs(b - a).max() / np.abs(a).max()),
                  "within": float(np.abs(c - a).max() / np.abs(a).max()),
                  "tiles": float(np.abs(d - a).max() / np.abs(a).max()),
                  "inplace": [float(np.abs(x - a).max() / np.abs(a).max()) for x in (f, g, h)],
                  "attention": float(np.abs(k - a).max() / np.abs(a).max()), "attention_impl": attn.attention_impl,
                  "dense_impl": [e.dense_impl for e in (across, inplace)], "collectives": counts,
                  "tiles_layout": tiles.expert_layout,
                  "tiles_spec": list(tiles.params["layers"]["moe"]["gate"].packed.sharding.spec),
                  "gate_spec": list(experts["gate"].packed.sharding.spec),
                  "down_scale_spec": list(experts["down"].scale.sharding.spec)}))
"""


def test_experts_split_within_is_a_table_change(children):
    res = report(children["table"])
    assert res["across"] < 1e-5 and res["within"] < 1e-5, res
    assert res["gate_spec"] == [None, None, "model", None], res  # [layer, E, F, D/8]: F split
    assert res["down_scale_spec"] == [None, None, None, "model"], res  # [layer, E, D, F/32]: F groups split
    # The kernel's layout on the mesh: experts split across devices, [layer, E, K/256, N, 32].
    assert res["tiles_layout"] == "tiles" and res["tiles_spec"] == [None, "model", None, None, None], res
    assert res["tiles"] < 1e-5, res
    # ... routed by the routing kernel on each device's rows: no collective beyond the XLA path's.
    assert res["collectives"]["tiles"] == res["collectives"]["slice"], res
    # Dense kernels read in place from the stack: the same logits, and the same collectives per phase
    # (a weight split along its inputs adds its partial products in the one psum GSPMD would insert).
    assert res["dense_impl"] == ["slice", "interpret"], res
    assert max(res["inplace"]) < 1e-5, res
    assert res["collectives"]["inplace"] == res["collectives"]["slice"], res
    # Attention in one kernel per device (its heads, its rows' cache): the same logits and collectives.
    assert res["attention_impl"] == "interpret" and res["attention"] < 1e-5, res
    assert res["collectives"]["attention"] == res["collectives"]["slice"], res
    # On the mesh the MoE output leaves its all-reduce as it is, and the next layer's norm kernel adds it to
    # the residual stream (one XLA launch fewer a layer), with the bits of XLA's add: the logits, the cache
    # and the captured states (the unrolled layer, the stack's first, a middle and its last layer). The
    # in-place logits and collectives above are of the default form (the switch off).
    d = res["deferred"]
    assert d["all_reduced"] and d["hidden"] == [2, 1], d  # the carry holds x and the add's term (on) or x (off)
    assert d["same"] == [True, True, True] and d["captured"], d
    # The captured states written by the next layer's attention norm launch (the default; its `shard_map` on the
    # mesh): no update left in the layers' scan, where XLA's form has one a layer, and the same bits.
    c = res["in_norm"]
    assert c["updates"] == [0, 1] and c["same"] == [True, True, True], c
    # The sums over the mesh in device order (the default): psum's bits on the CPU, where XLA's all-reduce adds in
    # that order; per layer two all-gathers (o_proj's and the MLP's / experts') where psum had two all-reduces,
    # the embedding's all-reduce left (a sum of one term and zeros: exact in any order).
    o = res["ordered"]
    assert o["same"] == [True, True, True], o
    L = o["layers"]
    assert o["kinds"] == [{"all-reduce": 1, "all-gather": 2 * L}, {"all-reduce": 1 + 2 * L}], o


@pytest.fixture(scope="module")
def cli_runs():
    """The README's first command on 1, 2, 4 and 8 fake devices and `--num-devices 3`, side by side,
    sharing one converted demo pair (in the user's cache, where the command looks for it)."""
    from jaxspec import demo

    demo.ensure_converted(progress=False, log=lambda m: None)
    gen = [sys.executable, "-m", "jaxspec.generate"]
    runs = {n: start(gen + ["--max-new-tokens", "8"], n) for n in (1, 2, 4, 8)}
    runs["bad"] = start(gen + ["--num-devices", "3", "--max-new-tokens", "4"], 8)
    return {k: finish(p, timeout=600) for k, p in runs.items()}


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_default_command_on_fake_devices(cli_runs, devices):
    """The README's first command (the built-in demo pair, all defaults) on 1, 2, 4 and 8 devices. The demo
    target has 4 heads, so on 8 devices the engine uses 4 and says so in one line."""
    rc, _, err = cli_runs[devices]
    assert rc == 0, err[-3000:]
    assert "[speculative] 8 tokens" in err and "mean acceptance length" in err, err[-2000:]
    notes = [line for line in err.splitlines() if "devices:" in line and "using" in line]
    if devices == 8:
        assert len(notes) == 1 and "using 4 of 8 devices" in notes[0] and "heads 4" in notes[0], notes
    else:
        assert not notes, notes


def test_num_devices_that_cannot_split_the_model_is_a_clear_error(cli_runs):
    rc, _, err = cli_runs["bad"]
    assert rc == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: cannot split the model over 3 devices"), last
    assert "'heads' dimension has size 4" in last and "Traceback" not in err, err[-2000:]
