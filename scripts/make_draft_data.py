"""Self-distillation data for `python -m jaxspec.train_draft`: the target's own continuations.

    python scripts/make_draft_data.py --model CKPT --tokens data/train.npy --out selfgen.npy \
        [--prompts 2048 --prompt-len 32 --max-new 224 --batch 256 --temperatures 0 0 0 0.7]

A draft is used on text the target writes itself, so it learns best from that
text. Prompts are windows of --tokens (seeded); each batch is continued by the
target (plain decoding) at the next temperature of --temperatures, in turn. The
output is one 1-D int32 array: prompt + continuation of every row, each followed
by the EOS id, which train_draft reads as one document (a model without an EOS id
gives a 2-D array, one row per prompt).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from jaxspec.engine import Engine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="converted jaxspec target checkpoint")
    p.add_argument("--tokens", required=True, help=".npy of token ids to cut prompts from")
    p.add_argument("--out", required=True, help="output .npy")
    p.add_argument("--prompts", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.0, 0.0, 0.7])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    engine = Engine.load(args.model)
    tokens = np.load(args.tokens)
    if tokens.ndim != 1 or len(tokens) <= args.prompt_len:
        print(
            f"error: --tokens {args.tokens}: expected a 1-D array longer than --prompt-len {args.prompt_len}, "
            f"found shape {tokens.shape}",
            file=sys.stderr,
        )
        return 1
    eos = engine.cfg.eos_token_id
    if eos is None and engine.tokenizer is not None:
        eos = engine.tokenizer.eos_id
    rng = np.random.default_rng(args.seed)
    starts = rng.integers(0, len(tokens) - args.prompt_len, size=args.prompts)
    parts, new_tokens, t0 = [], 0, time.perf_counter()
    for n, i in enumerate(range(0, args.prompts, args.batch)):
        prompts = [tokens[s : s + args.prompt_len].astype(np.int64).tolist() for s in starts[i : i + args.batch]]
        temp = args.temperatures[n % len(args.temperatures)]
        results = engine.generate(prompts, max_new_tokens=args.max_new, temperature=temp, seed=args.seed + n)
        for prompt, r in zip(prompts, results):
            parts.append(np.asarray(prompt + r.tokens + ([eos] if eos is not None else []), np.int32))
            new_tokens += len(r.tokens)
        print(
            f"batch {n}: {len(prompts)} prompts at temperature {temp}, {new_tokens} new tokens so far, "
            f"{time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
    # Without an EOS id nothing stops early: every row has the same length and is saved as one
    # row of a 2-D array (train_draft reads a row as a document).
    out = np.concatenate(parts) if eos is not None else np.stack(parts)
    np.save(args.out, out)
    print(
        json.dumps(
            {
                "out": args.out,
                "tokens": int(out.size),
                "new_tokens": new_tokens,
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
