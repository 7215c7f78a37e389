"""Kernels per decoder layer and where a decode step's time goes, from a profile of the plain loop.

    python scripts/profile_layer.py --share 8 --batch 1        # one device's share of 8, full depth
    python scripts/profile_layer.py --share 8 --batch 1 --spec 3,1,4   # the speculative cycle's verify

Runs the plain decoding loop of the random-weight share (`scripts/share_model.py`) under
`jax.profiler`, then reads the trace with `jaxspec.profile_report`'s readers. Prints: kernels
(device op executions) per step, per stacked layer and outside the layers; device time per step
and per layer; and the ops of one stacked layer grouped by scope, with their count per layer and
microseconds per layer, largest first.

With ``--spec STEPS,TOPK,TOKENS`` it traces the speculative loop instead (the share's random draft;
with random weights nearly every draft token is rejected, so each cycle verifies the full TOKENS).
Then "step" reads "cycle": the stacked layers are the verify's (the draft has layers of its own,
outside the stack), and a layer's ops are those of one verify of TOKENS tokens per sequence.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time

# The full-depth share's parameters take 76 GB: JAX's default pool (0.75 of the card) holds them on an H200 but not
# on an 80 GB H100; this larger pool may (`share_model.check_fits` stops a run that cannot fit, naming both). A value
# set in the environment wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    import share_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--share", type=int, default=8)
    p.add_argument("--layers", type=int, help="target layers (default: full depth)")
    p.add_argument("--preset", default="kimi-k2.5")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=16, help="decode steps traced")
    p.add_argument("--expert-impl", default=None, choices=["kernel", "gather"])
    p.add_argument("--dense-impl", default=None, choices=["kernel", "slice"], help="default: the device's")
    p.add_argument("--attention-impl", default=None, choices=["xla", "kernel"], help="default: the device's")
    p.add_argument("--dir", help="trace directory (default: a temporary one)")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--outside", type=int, default=0, help="also list this many of the ops outside the stack")
    p.add_argument("--spec", metavar="STEPS,TOPK,TOKENS", help="trace the speculative loop's cycles (see above)")
    share_model.add_kernel_config_flag(p)
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args(argv)
    from jaxspec import profile_report

    trace_dir = args.dir or tempfile.mkdtemp(prefix="profile_layer_")
    profile_report.dump_hlo(trace_dir)
    if args.kernel_config:  # after the dump's flags: on a GPU the configurations' probes start the backend
        print(f"kernel configurations set: {share_model.apply_kernel_configs(args.kernel_config)}", flush=True)

    import jax
    import numpy as np

    ns = argparse.Namespace(
        preset=args.preset,
        share=args.share,
        layers=args.layers,
        set=args.set,
        expert_impl=[args.expert_impl],
        dense_impl=[args.dense_impl],
        attention_impl=[args.attention_impl],
        draft_heads=64,
        draft_kv_heads=8,
        draft_intermediate=18432,
        draft_vocab=32000,
    )
    from jaxspec.spec import SpecConfig

    spec = None
    if args.spec:
        try:
            spec = SpecConfig(*map(int, args.spec.split(",")))
        except (TypeError, ValueError):
            p.error(f"--spec: expected STEPS,TOPK,TOKENS (three integers, e.g. 3,1,4), found {args.spec!r}")
    _, engine = share_model.share_engine(ns)
    if spec is None:
        engine.draft = None
    cfg = engine.cfg
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, 32).tolist() for _ in range(args.batch)]
    run = lambda: engine.generate(prompts, max_new_tokens=args.steps, spec=spec)  # noqa: E731
    run()  # compile
    t = time.perf_counter()
    results = run()
    wall = time.perf_counter() - t
    with jax.profiler.trace(trace_dir):
        run()

    path = profile_report.find_trace(trace_dir)
    events, meta = profile_report.read_events(path)
    modules = profile_report.load_hlo(os.path.join(trace_dir, "hlo", str(meta.get("process_id"))))
    loops = {pid: profile_report.find_loop(modules[pid], pid) for pid in modules}
    loops = {k: v for k, v in loops.items() if v is not None}
    busy = collections.Counter(e.program_id for e in events if e.program_id in loops)
    if not busy:
        seen = collections.Counter((e.module, e.program_id) for e in events)
        print(f"no loop program among the traced ops; dumped modules {sorted(modules)}, loops {sorted(loops)}")
        print("traced (module, program_id): count", seen.most_common(12))
        top = collections.Counter()
        for e in events:
            top[(e.module, e.op)] += e.dur_ns
        print("top ops:", [(m, o, round(t / 1e3)) for (m, o), t in top.most_common(15)])
        return 1
    pid = busy.most_common(1)[0][0]
    hlo = modules[pid]
    mine = [e for e in events if e.program_id == pid]
    with_events = {e.op for e in mine}
    ops = []
    for e in mine:
        instr = hlo.by_name.get(e.op)
        if instr is None or profile_report._is_container(hlo, instr, with_events):
            continue
        ops.append((e, instr))
    stack = f"layers_{min(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))}_{cfg.num_layers - 1}"
    n_stacked = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    in_stack = [(e, i) for e, i in ops if f"/{stack}/" in i.op_name]
    outside = [(e, i) for e, i in ops if f"/{stack}/" not in i.op_name]
    if spec is None:
        steps = args.steps - 1  # the first token comes from the prefill
    else:  # the loop's cycles (as many as the row that took most): one verify each
        steps = max(1, max(r.stats["cycles"] for r in results))
    unit = "step" if spec is None else "cycle"
    per_step = len(ops) / steps
    per_layer = len(in_stack) / (steps * n_stacked)
    us = lambda evs: sum(e.dur_ns for e, _ in evs) / 1e3
    groups = collections.defaultdict(lambda: [0, 0.0])
    for e, i in in_stack:
        tail = i.op_name.split(f"/{stack}/", 1)[1]
        tail = re.sub(r"while/body/(closed_call/)?", "", tail)
        key = f"{tail} [{i.opcode}{':' + i.target if i.target else ''}]"
        groups[key][0] += 1
        groups[key][1] += e.dur_ns / 1e3
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])
    norm = steps * n_stacked
    print(
        f"\n{jax.devices()[0].device_kind}; share of {args.share}, {cfg.num_layers} layers ({n_stacked} stacked), "
        f"batch {args.batch}, {steps} {unit}s{f' of {args.spec}' if spec else ''}; wall {wall / steps * 1e3:.3f} "
        f"ms/{unit} (untraced run)"
    )
    print(
        f"kernels per {unit} {per_step:.1f}: per stacked layer {per_layer:.1f}, outside the stack "
        f"{len(outside) / steps:.1f}; device time per {unit} {us(ops) / steps / 1e3:.3f} ms, per stacked layer "
        f"{us(in_stack) / norm:.1f} us, outside the stack {us(outside) / steps:.1f} us"
    )
    print(f"\n{'count/layer':>11} {'us/layer':>9}  op (scope within the layer) [opcode]")
    for key, (n, t) in rows[: args.top]:
        print(f"{n / norm:>11.2f} {t / norm:>9.2f}  {key[:150]}")
    if args.outside:  # the unrolled layers, lm_head and the loop's own kernels
        rest = collections.defaultdict(lambda: [0, 0.0])
        for e, i in outside:
            key = f"{re.sub(r'while/body/(closed_call/)?', '', i.op_name)} [{i.opcode}]"
            rest[key][0] += 1
            rest[key][1] += e.dur_ns / 1e3
        print(f"\n{'count/' + unit:>11} {'us/' + unit:>9}  op outside the stack [opcode]")
        for key, (n, t) in sorted(rest.items(), key=lambda kv: -kv[1][1])[: args.outside]:
            print(f"{n / steps:>11.2f} {t / steps:>9.2f}  {key[:150]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "unit": unit,
                    "spec": args.spec,
                    "kernels_per_step": per_step,
                    "kernels_per_layer": per_layer,
                    "us_per_layer": us(in_stack) / norm,
                    "ms_per_step_wall": wall / steps * 1e3,
                    "ops": [{"op": k, "per_layer": n / norm, "us_per_layer": t / norm} for k, (n, t) in rows],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
