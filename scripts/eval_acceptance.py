"""Held-out greedy acceptance of a converted target + draft pair, per speculative config.

    python scripts/eval_acceptance.py --model DIR --tokens heldout.npy --configs 3,1,4 4,2,8 6,4,16

Prompts are windows of held-out token ids (seeded, never seen in training). For
every config the script checks that speculative greedy output equals plain greedy
output and reports the mean acceptance length (tokens per target forward, bonus
included), averaged over all cycles of all prompts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import jax
import numpy as np
import share_model

from jaxspec.dtypes import COMPUTE_DTYPES
from jaxspec.engine import Engine
from jaxspec.spec import SpecConfig


def heldout_prompts(tokens: np.ndarray, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - length, size=n)
    return [tokens[s : s + length].astype(np.int64).tolist() for s in starts]


def evaluate(engine: Engine, prompts, configs, max_new: int, batch: int) -> list[dict]:
    plain = []
    for i in range(0, len(prompts), batch):
        plain += [r.tokens for r in engine.generate(prompts[i : i + batch], max_new)]
    rows = []
    for cfg in configs:
        lengths, differing = [], 0
        for i in range(0, len(prompts), batch):
            res = engine.generate(prompts[i : i + batch], max_new, spec=cfg)
            differing += sum(r.tokens != p for r, p in zip(res, plain[i : i + batch]))
            for r in res:
                lengths += r.stats["accept_lengths"]
        rows.append(
            {
                "config": f"{cfg.num_steps},{cfg.topk},{cfg.num_draft_tokens}",
                "mean_accept_len": float(np.mean(lengths)),
                "cycles": len(lengths),
                "lossless": differing == 0,
                "differing_prompts": int(differing),
            }
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="converted checkpoint with a draft, or 'demo' (the built-in pair)")
    p.add_argument("--tokens", required=True, help=".npy of held-out token ids")
    p.add_argument("--configs", nargs="+", default=["3,1,4"])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype", choices=COMPUTE_DTYPES, help="compute dtype (default: float32 on CPU, bfloat16 otherwise)"
    )
    p.add_argument(
        "--matmul-precision",
        choices=["default", "high", "highest"],
        default="default",
        help="jax_default_matmul_precision; on GPU, 'default' runs float32 matmuls in TF32, whose "
        "rounding differs between a one-token decode step and a batched verify",
    )
    p.add_argument(
        "--expert-impl",
        nargs="+",
        default=[None],
        choices=["kernel", "gather"],
        help="INT4 expert path(s) to evaluate in turn (default: the engine's choice)",
    )
    p.add_argument(
        "--dense-impl",
        nargs="+",
        default=[None],
        choices=["kernel", "slice", "interpret"],
        help="how the stacked layers read their dense weights, each evaluated in turn (default: the engine's choice)",
    )
    p.add_argument(
        "--attention-impl",
        nargs="+",
        default=[None],
        choices=["xla", "kernel", "interpret"],
        help="attention over the latent cache, each evaluated in turn (default: the engine's; the kernel on GPU)",
    )
    share_model.add_kernel_config_flag(p)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.matmul_precision != "default":
        jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    if args.kernel_config:  # after the precision: on a GPU the configurations' probes run now
        print(f"kernel configurations set: {share_model.apply_kernel_configs(args.kernel_config)}", flush=True)
    if args.model == "demo":
        from jaxspec import demo

        args.model = demo.ensure_converted(progress=False)
    prompts = heldout_prompts(np.load(args.tokens), args.prompts, args.prompt_len, args.seed)
    configs = [SpecConfig(*map(int, c.split(","))) for c in args.configs]
    rows = []
    for impl, dense, attn in itertools.product(args.expert_impl, args.dense_impl, args.attention_impl):
        engine = Engine.load(args.model, dtype=args.dtype, expert_impl=impl, dense_impl=dense, attention_impl=attn)
        for r in evaluate(engine, prompts, configs, args.max_new, args.batch):
            layout = "kernel" if engine.expert_layout == "tiles" else "gather"
            rows.append(
                {**r, "expert_impl": layout, "dense_impl": engine.dense_impl, "attention": engine.attention_impl}
            )
    print(
        f"{'experts':>7} {'dense':>9} {'attention':>9} {'config':>8} {'accept':>7} {'cycles':>7} {'lossless':>8} "
        f"{'differing':>9}"
    )
    for r in rows:
        print(
            f"{r['expert_impl']:>7} {r['dense_impl']:>9} {r['attention']:>9} {r['config']:>8} "
            f"{r['mean_accept_len']:>7.2f} {r['cycles']:>7} "
            f"{str(r['lossless']):>8} {r['differing_prompts']:>5}/{len(prompts)}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
