"""Plain vs speculative decoding in one run, with the cycle split into draft / verify / bookkeeping.

    # a converted target + draft pair, real prompts:
    python scripts/bench_spec.py --model DIR --batch 1 8 --configs 3,1,4 4,2,8
    # random weights at Kimi-K2.5 width (timing split only: acceptance is meaningless there):
    python scripts/bench_spec.py --random --layers 3 --batch 1 8

For every batch size: plain greedy decode tok/s; then for every speculative
config: tok/s, mean acceptance length (tokens per target forward, bonus included)
and ms per cycle of the whole loop (ms/cyc), split into draft (tree drafting,
tree build and the draft extend over accepted tokens), verify (one target
forward over the tree) and bookkeeping (accept, cache commit, output append and
the loop's own state updates: ms/cyc minus draft minus verify). Draft and verify
are timed on a mid-generation state, each as n repetitions inside one compiled
loop minus one repetition, so launch and dispatch costs drop out (`loop_time`),
less the loop's own cost per iteration, which the real loop pays once a cycle
and the bookkeeping column therefore holds (`jaxspec.timing.phase_time`).
Medians of --reps runs, after a compile run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

# The full-depth share's parameters take 76 GB: JAX's default pool (0.75 of the card) holds them on an H200 but not
# on an 80 GB H100; this larger pool may (`share_model.check_fits` stops a run that cannot fit, naming both). A value
# set in the environment wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import spec as S
from jaxspec.engine import Engine
from jaxspec.model import init_params
from jaxspec.timing import phase_time

DEFAULT_PROMPTS = [
    'def read_config(path):\n    """Read a JSON config file."""\n',
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "    for i, line in enumerate(lines):\n        if line.startswith('#'):\n",
]


_T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# The in-loop phase timer lives in the package (jaxspec.timing), shared with `python -m jaxspec.tune`:
# n + 1 repetitions against one inside one compiled loop, difference / n, median of `reps` runs.
loop_time = phase_time


def random_engine(args) -> Engine:
    from jaxspec.config import preset

    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    cfg = preset(args.preset, num_layers=args.layers, max_position_embeddings=1 << 20)
    overrides = {k: type(getattr(cfg, k))(v) for k, v in (kv.split("=") for kv in args.set)}
    cfg = cfg.replace(**overrides)
    params = init_params(cfg, jax.random.key(0), dtype)
    engine = Engine(cfg, params, None, "bfloat16" if dtype == jnp.bfloat16 else "float32", expert_impl="gather")
    import share_model

    args.draft_vocab = min(args.draft_vocab, cfg.vocab_size)
    aux = (0, cfg.num_layers // 2, cfg.num_layers - 2)
    engine.draft = share_model.random_draft(args, cfg.hidden_size, cfg.vocab_size, cfg.vocab_size, aux, 10000.0, dtype)
    return engine


def draft_bytes_per_placement(engine, n: int) -> dict:
    """Draft weight bytes one device reads per draft step, replicated vs sharded n ways (heads, MLP, vocab)."""
    from jaxspec.draft import step_param_bytes

    split = {"draft_heads": n, "draft_kv_heads": n, "draft_mlp": n, "draft_vocab": n}
    return {
        "replicated": step_param_bytes(engine.draft.params),
        "sharded": step_param_bytes(engine.draft.params, split),
    }


def prompts_for(engine, batch, args):
    if engine.tokenizer is not None:
        texts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(batch)]
        return [engine.tokenizer.encode(t) for t in texts]
    rng = np.random.default_rng(batch)
    return [rng.integers(0, engine.cfg.vocab_size, size=args.prompt_len).tolist() for _ in range(batch)]


def bench_plain(engine, ids, max_new, reps):
    def run():
        session = engine.prepare(ids, max_new, stop_ids=[-1])
        jax.block_until_ready(session.state)
        t = time.perf_counter()
        st = session.run(max_new).state
        jax.block_until_ready(st)
        return time.perf_counter() - t, int(st.steps)

    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    log(f"  plain: first run (compile + run) {first:.1f} s")
    times = [run() for _ in range(reps)]
    secs = statistics.median(t for t, _ in times)
    steps = times[0][1]
    # compile_s: the first run's extra time over a timed run (the prefill's compile included)
    return {"tok_s": len(ids) * steps / secs, "ms_per_step": secs / steps * 1e3, "compile_s": first - secs}


def bench_spec_cfg(engine, ids, max_new, cfg: S.SpecConfig, reps):
    _, lens, _ = engine.pad_prompts(ids, max_new)
    S_t, _ = S.cache_lengths(int(lens.max()), max_new, cfg)
    dtype = engine.params["embed"]["embedding"].dtype
    m, p, d = engine.model, engine.params, engine.draft

    def fresh():
        return engine.prepare(ids, max_new, spec=cfg, stop_ids=[-1])

    def run():
        session = fresh()
        jax.block_until_ready(session.state)
        t = time.perf_counter()
        st = session.run(max_new).state
        jax.block_until_ready(st)
        secs = time.perf_counter() - t
        # the counts only: a kept state would hold its caches through the next run (out of memory at batch 32
        # on an 80 GB card at full depth)
        return secs, jax.device_get((st.cycles, st.num_out_B, st.accepted_B, st.row_cycles_B))

    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    log(f"  spec {cfg}: first run (compile + run) {first:.1f} s")
    results = [run() for _ in range(reps)]
    secs = statistics.median(t for t, _ in results)
    log(f"  spec {cfg}: timed runs {[round(t, 3) for t, _ in results]} s")
    cycles, num_out_B, accepted_B, row_cycles_B = results[0][1]
    cycles = int(cycles)
    emitted = int(np.asarray(num_out_B).sum()) - len(ids)  # the first token comes from prefill
    accept = float(np.asarray(accepted_B).sum() / np.asarray(row_cycles_B).sum())

    # Phase split on one mid-generation state.
    st = fresh().run(2).state
    shape = cfg.tree

    # Weights are arguments, never closed over: closed-over arrays become constants baked into
    # the executable (tens of GB at Kimi width; compilation then never finishes).
    def draft_phase(p, d, st):
        tree, dc = S.draft_tree(m, p, d, st, shape, S_t)
        B = st.P_B.shape[0]
        A = 3 * engine.cfg.hidden_size
        aux = jnp.zeros((B, cfg.num_steps + 1, A), dtype)
        toks = jnp.zeros((B, cfg.num_steps + 1), jnp.int32)
        return tree, S.draft_extend(m, p, d, dc, aux, toks, st.P_B, jnp.full((B,), cfg.num_steps + 1), S_t)

    def verify_phase(p, d, st, tree):
        return S.verify(m, p, d, st, tree)[0]

    tree = jax.jit(draft_phase)(p, d, st)[0]
    t_draft = loop_time(
        draft_phase, lambda out: jnp.maximum(out[0].tokens.max(), jnp.argmax(out[1][0], -1).max()), st, (p, d), reps
    )
    t_verify = loop_time(verify_phase, lambda logits: jnp.argmax(logits, -1).max(), st, (p, d, tree), reps)
    log(f"  spec {cfg}: phases timed")
    t_cycle = secs / cycles
    return {
        "tok_s": emitted / secs,
        "mean_accept_len": accept,
        "cycles": cycles,
        "ms_per_cycle": t_cycle * 1e3,
        "draft_ms": t_draft * 1e3,
        "verify_ms": t_verify * 1e3,
        "bookkeeping_ms": (t_cycle - t_draft - t_verify) * 1e3,
        "compile_s": first - secs,
    }


def main(argv=None) -> int:
    import share_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="converted jaxspec checkpoint with a draft")
    p.add_argument("--random", action="store_true", help="random weights at preset width (timing only)")
    p.add_argument("--preset", default="kimi-k2.5")
    p.add_argument("--layers", type=int, help="target layers (default: 3 with --random, the full depth with --share)")
    p.add_argument(
        "--share",
        type=int,
        metavar="N",
        help="random weights: one device's exact share of an N-way mesh at full depth (scripts/share_model.py)",
    )
    p.add_argument("--allreduce-us", type=float, default=15.0, help="--share: cost of one collective, microseconds")
    p.add_argument(
        "--accepts", type=float, nargs="+", default=[2.3, 3.0], help="--share: acceptance lengths to predict"
    )
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="override preset fields")
    p.add_argument("--draft-heads", type=int, default=64)
    p.add_argument("--draft-kv-heads", type=int, default=8)
    p.add_argument("--draft-intermediate", type=int, default=18432)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--configs", nargs="+", default=["3,1,4"], help="steps,topk,draft_tokens")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64, help="random-token prompt length without a tokenizer")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--expert-impl",
        nargs="+",
        default=[None],
        choices=["kernel", "gather"],
        help="INT4 expert path(s), each benchmarked in turn in this run (default: the engine's choice)",
    )
    p.add_argument(
        "--dense-impl",
        nargs="+",
        default=[None],
        choices=["kernel", "slice", "interpret"],
        help="how the stacked layers read their dense weights, each benchmarked in turn (default: the "
        "engine's choice, `model.choose_dense_impl`: in place on a GPU)",
    )
    p.add_argument(
        "--attention-impl",
        nargs="+",
        default=[None],
        choices=["xla", "kernel", "interpret"],
        help="attention over the latent cache, each benchmarked in turn (default: the engine's choice, "
        "`model.choose_attention_impl`: the Pallas kernel on a GPU)",
    )
    p.add_argument(
        "--mesh-devices",
        type=int,
        default=8,
        help="mesh size for the per-device draft bytes printed for each draft placement",
    )
    share_model.add_kernel_config_flag(p)
    p.add_argument("--json", help="write results here")
    args = p.parse_args(argv)
    if args.kernel_config:
        log(f"kernel configurations set: {share_model.apply_kernel_configs(args.kernel_config)}")
    if sum(map(bool, (args.model, args.random, args.share))) != 1:
        p.error("give exactly one of --model DIR, --random or --share N")
    if args.share:
        return share_main(args)
    args.layers = args.layers or 3
    base = Engine.load(args.model, expert_impl="gather") if args.model else random_engine(args)
    if base.draft is None:
        p.error(f"{args.model} has no draft (convert it with --draft)")
    rows = []
    for impl, dense, attn in itertools.product(args.expert_impl, args.dense_impl, args.attention_impl):
        engine = Engine(
            base.cfg,
            base.params,
            base.tokenizer,
            base.dtype,
            base.mesh,
            base.draft,
            base.prefill_chunk,
            base.rules,
            expert_impl=impl,
            dense_impl=dense,
            attention_impl=attn,
        )
        name = "kernel" if engine.expert_layout == "tiles" else "gather"
        log(f"experts: {name}, dense weights: {engine.dense_impl}, attention: {engine.attention_impl}")
        rows += [
            {"experts": name, "dense": engine.dense_impl, "attention": engine.attention_impl, **r}
            for r in bench_engine(engine, args)
        ]
        del engine
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "rows": rows,
                    "draft_bytes_per_device": draft_bytes_per_placement(base, args.mesh_devices),
                },
                f,
                indent=2,
            )
    return 0


def share_main(args) -> int:
    """--share N: one device's share at full depth, plus the N-GPU prediction from the collective count."""
    import share_model

    if len(args.expert_impl) != 1 or len(args.dense_impl) != 1 or len(args.attention_impl) != 1:
        raise SystemExit("error: --share takes one --expert-impl, one --dense-impl and one --attention-impl")
    if len(args.configs) != 1:
        raise SystemExit("error: --share takes one --configs entry")
    full, _ = share_model.share_config(args.preset, args.share, args.layers, args.set)
    # The floor's copy bandwidth: measured before the weights take the device (a full-depth share leaves an 80 GB
    # card too little room, or too fragmented a pool, for the copy's two 4 GiB arrays) and again after the runs
    # where it fits; the higher of the two (the lower floor) is used.
    bw_before = _copy_bandwidth()
    counting = share_model.start_collective_count(full, args.share, 1, args.configs[0])
    log(f"share of {args.share}: building {full.num_layers} layers of random weights")
    t0 = time.perf_counter()
    full, engine = share_model.share_engine(args)
    log(f"  weights ready in {time.perf_counter() - t0:.1f} s")
    name = "kernel" if engine.expert_layout == "tiles" else "gather"
    rows = [
        {"experts": name, "dense": engine.dense_impl, "attention": engine.attention_impl, **r}
        for r in bench_engine(engine, args)
    ]
    print_rows(rows)
    log("waiting for the collective count")
    counts = share_model.finish_collective_count(counting)
    spec = S.SpecConfig(*map(int, args.configs[0].split(",")))
    context = args.prompt_len + args.max_new
    report = []
    for b in args.batch:
        plain = next(r for r in rows if r["batch"] == b and r["config"] == "plain")
        sp = next(r for r in rows if r["batch"] == b and r["config"] != "plain")
        by = share_model.step_bytes(engine, 1, b, context)
        by_v = share_model.step_bytes(engine, spec.num_draft_tokens, b, context)
        pred = share_model.predict_mesh(plain, sp, b, counts, args.allreduce_us, args.accepts)
        report.append({"batch": b, "plain": plain, "spec": sp, "bytes_step": by, "bytes_verify": by_v, **pred})
    try:
        bw_after = _copy_bandwidth()
    except jax.errors.JaxRuntimeError as e:  # out of memory beside the weights
        log(f"copy bandwidth after the runs not measured ({str(e).splitlines()[0][:120]})")
        bw_after = 0.0
    log(f"copy bandwidth before the weights {bw_before / 1e12:.2f} TB/s, after the runs {bw_after / 1e12:.2f} TB/s")
    bw = max(bw_before, bw_after)
    print(
        f"\none device's share of {args.share}: {full.num_layers} layers, {engine.cfg.local_experts} of "
        f"{full.num_experts} experts, {engine.cfg.num_heads} heads, vocab {engine.cfg.vocab_size}; experts {name}; "
        f"copy bandwidth {bw / 1e12:.2f} TB/s; collectives per step / cycle: "
        + (f"{counts['decode']} / {counts['cycle']} at {args.allreduce_us} us" if counts else "not counted")
    )
    acc = args.accepts
    head = (
        f"{'batch':>5} {'plain ms':>8} {'GB/step':>7} {'floor ms':>8} {'x floor':>7} {'cycle':>6} {'draft':>6} "
        f"{'verify':>6} {'bookk':>6} {'b-even':>6} {'compile s':>9} "
        + " ".join(f"{'tok/s@' + str(a):>10}" for a in acc)
        + f" {'plain tok/s':>11}"
        + (" " + " ".join(f"{'mesh@' + str(a):>9}" for a in acc) + f" {'mesh plain':>10}" if counts else "")
    )
    print(head)
    for r in report:
        floor = r["bytes_step"]["total"] / bw * 1e3
        r["floor_ms"] = floor
        r["copy_bandwidth"] = bw
        line = (
            f"{r['batch']:>5} {r['plain']['ms_per_step']:>8.3f} {r['bytes_step']['total'] / 1e9:>7.2f} {floor:>8.3f} "
            f"{r['plain']['ms_per_step'] / floor:>7.2f} {r['spec']['ms_per_cycle']:>6.2f} "
            f"{r['spec']['draft_ms']:>6.2f} "
            f"{r['spec']['verify_ms']:>6.2f} {r['spec']['bookkeeping_ms']:>6.2f} {r['break_even']:>6.2f} "
            f"{r['plain']['compile_s']:>4.0f}/{r['spec']['compile_s']:<4.0f} "
            + " ".join(f"{r[f'spec_tok_s@{a}']:>10.1f}" for a in acc)
            + f" {r['plain_tok_s']:>11.1f}"
        )
        if counts:
            line += " " + " ".join(f"{r[f'mesh_spec_tok_s@{a}']:>9.1f}" for a in acc)
            line += f" {r['mesh_plain_tok_s']:>10.1f}"
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "rows": rows,
                    "share": report,
                    "collectives": counts,
                    "copy_bandwidth_before_after": [bw_before, bw_after],
                },
                f,
                indent=2,
            )
    return 0


def _copy_bandwidth() -> float:
    from bench_decode import copy_bandwidth

    return copy_bandwidth() if jax.default_backend() != "cpu" else copy_bandwidth(0.25, 3)


def bench_engine(engine, args) -> list[dict]:
    configs = [S.SpecConfig(*map(int, c.split(","))) for c in args.configs]
    print(
        f"device {jax.devices()[0].device_kind}; target {engine.cfg.num_layers} layers, hidden "
        f"{engine.cfg.hidden_size}; draft hidden {engine.draft.cfg.hidden_size}, vocab "
        f"{engine.draft.cfg.draft_vocab_size}; max_new {args.max_new}",
        flush=True,
    )
    draft_bytes = draft_bytes_per_placement(engine, args.mesh_devices)
    print(
        "draft weight bytes each device reads per draft step on a "
        f"{args.mesh_devices}-device mesh: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in draft_bytes.items()),
        flush=True,
    )
    rows = []
    for b in args.batch:
        ids = prompts_for(engine, b, args)
        plain = bench_plain(engine, ids, args.max_new, args.reps)
        rows.append({"batch": b, "config": "plain", **plain})
        print(f"batch {b} plain: {plain['tok_s']:.1f} tok/s ({plain['ms_per_step']:.3f} ms/step)", flush=True)
        for cfg in configs:
            r = bench_spec_cfg(engine, ids, args.max_new, cfg, args.reps)
            r["speedup"] = r["tok_s"] / plain["tok_s"]
            rows.append({"batch": b, "config": f"{cfg.num_steps},{cfg.topk},{cfg.num_draft_tokens}", **r})
            print(
                f"batch {b} spec {rows[-1]['config']}: {json.dumps({k: round(v, 3) for k, v in r.items()})}", flush=True
            )
    return rows


def print_rows(rows):
    print(
        f"\n{'experts':>7} {'dense':>9} {'attention':>9} {'batch':>5} {'config':>8} {'tok/s':>9} {'speedup':>7} "
        f"{'accept':>6} "
        f"{'ms/cyc':>7} {'draft':>6} {'verify':>6} {'bookk.':>6} {'bookk.%':>7}"
    )
    for r in rows:
        if r["config"] == "plain":
            print(
                f"{r['experts']:>7} {r.get('dense', ''):>9} {r.get('attention', ''):>9} {r['batch']:>5} {'plain':>8} "
                f"{r['tok_s']:>9.1f} "
                f"{'1.00':>7} {'1.00':>6} {r['ms_per_step']:>7.3f}"
            )
        else:
            print(
                f"{r['experts']:>7} {r.get('dense', ''):>9} {r.get('attention', ''):>9} {r['batch']:>5} "
                f"{r['config']:>8} {r['tok_s']:>9.1f} "
                f"{r['speedup']:>7.2f} {r['mean_accept_len']:>6.2f} {r['ms_per_cycle']:>7.3f} {r['draft_ms']:>6.3f} "
                f"{r['verify_ms']:>6.3f} {r['bookkeeping_ms']:>6.3f} "
                f"{r['bookkeeping_ms'] / r['ms_per_cycle']:>7.1%}"
            )


if __name__ == "__main__":
    sys.exit(main())
