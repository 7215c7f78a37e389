"""The tuner's pick on one device's share of an N-way Kimi-K2.5 mesh, with a measured acceptance profile.

    python scripts/tune_share.py --share 8 --profile DEMO/spec_config.json --batch 1 8 32 --time-budget 400

The share (`scripts/share_model.py`: full depth, 1/N of the heads, vocab and shared expert, the busiest
device's routed experts, a Kimi-EAGLE-3-sized replicated draft, random weights) has no trained draft,
so its own acceptance would mean nothing. The costs are measured here exactly as `python -m
jaxspec.tune` measures them (`jaxspec.tune.tune`: plain step, verify for 1..16 tree tokens, draft steps,
draft extend, whole cycles in the real loop); the acceptance profile is read from a spec_config.json
that the tuner wrote for a real pair (the demo pair's by default). Prints the pick per batch size and
its predicted gain over SGLang's static 3/1/4 and over plain decoding; `--json` keeps the whole
payload. Collectives are not in the share's costs (see `bench_spec.py --share` for the mesh
prediction).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--share", type=int, default=8, help="mesh size N whose one-device share is tuned")
    p.add_argument("--preset", default="kimi-k2.5")
    p.add_argument("--layers", type=int, help="target layers (default: the preset's full depth)")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="override preset fields")
    p.add_argument(
        "--profile",
        help="spec_config.json whose acceptance profile is used (default: the built-in demo pair's, "
        "which must have been tuned: python -m jaxspec.tune --model DEMO)",
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--time-budget", type=float, default=400.0, help="seconds for the cost measurements")
    p.add_argument("--max-new-tokens", type=int, default=64, help="generation length the costs and tail are for")
    p.add_argument("--prompt-len", type=int, default=64, help="random-token prompt length")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--max-topk", type=int, default=4)
    p.add_argument("--max-draft-tokens", type=int, default=16)
    p.add_argument("--draft-heads", type=int, default=64)
    p.add_argument("--draft-kv-heads", type=int, default=8)
    p.add_argument("--draft-intermediate", type=int, default=18432)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--expert-impl", nargs=1, default=[None], choices=["kernel", "gather"])
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", help="write the payload here")
    return p.parse_args(argv)


def load_profile(path: str):
    """The acceptance profile (and where it came from) of a tuner payload."""
    from jaxspec import tune

    try:
        with open(path) as f:
            payload = json.load(f)
        acc = payload["acceptance"]
        return tune.AcceptanceProfile.from_dict(acc), {
            "file": os.path.abspath(path),
            "source": acc.get("source", ""),
            "model": payload.get("model", {}).get("path"),
            "chain": acc.get("chain"),
        }
    except FileNotFoundError:
        raise SystemExit(
            f"error: --profile {path}: no such file (tune the pair first: python -m jaxspec.tune --model DIR)"
        ) from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise SystemExit(
            f"error: --profile {path}: expected a spec_config.json written by jaxspec.tune ({e})"
        ) from None


def gains(payload: dict) -> list[dict]:
    """Per batch size: the pick, its predicted tok/s, and its ratio to 3/1/4 and to plain."""
    rows = []
    for b, p in payload["picks"].items():
        setting = "plain" if p.get("mode") == "plain" else f"{p['steps']}/{p['topk']}/{p['draft_tokens']}"
        default = p.get("default_tok_s")
        rows.append(
            {
                "batch": int(b),
                "pick": setting,
                "tok_s": p["tok_s"],
                "accept": p["accept"],
                "cycle_ms": p["cycle_ms"],
                "plain_tok_s": p["plain_tok_s"],
                "default_tok_s": default,
                "vs_default": p["tok_s"] / default if default else None,
                "vs_plain": p["tok_s"] / p["plain_tok_s"],
            }
        )
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import share_model

    from jaxspec import demo, tune

    path = args.profile or os.path.join(demo.ensure_converted(progress=False, log=lambda m: None), tune.CONFIG_FILE)
    profile, source = load_profile(path)
    full, engine = share_model.share_engine(args)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, engine.cfg.vocab_size, args.prompt_len).tolist() for _ in range(4)]
    payload = tune.tune(
        engine,
        prompts,
        args.batch,
        args.time_budget,
        reps=args.reps,
        progress=not args.quiet,
        prompts_label=f"random {args.prompt_len}-token prompts",
        max_steps=args.max_steps,
        max_topk=args.max_topk,
        max_tokens=args.max_draft_tokens,
        max_new=args.max_new_tokens,
        profile=profile,
    )
    payload["acceptance"]["profile_from"] = source
    payload["share"] = {"n": args.share, "layers": full.num_layers, "preset": args.preset}
    rows = gains(payload)
    payload["gains"] = rows
    print(tune.summary(payload))
    print(f"share of {args.share}, {full.num_layers} layers; acceptance profile of {source['model'] or source['file']}")
    print(f"{'batch':>5} {'pick':>8} {'tok/s':>10} {'accept':>6} {'ms/cyc':>7} {'vs 3/1/4':>8} {'vs plain':>8}")
    for r in rows:
        vs_default = f"{r['vs_default']:.2f}x" if r["vs_default"] else "-"
        print(
            f"{r['batch']:>5} {r['pick']:>8} {r['tok_s']:>10.1f} {r['accept']:>6.2f} {r['cycle_ms']:>7.3f} "
            f"{vs_default:>8} {r['vs_plain']:>7.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
