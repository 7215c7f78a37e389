"""Prefill time and peak device memory, whole prompt vs chunked, at full width with random weights.

    python scripts/bench_prefill.py --layers 3 --prompt-len 2048 --chunks 512 0 [--expert-impls gather auto]

For each --chunks value (0 = the whole prompt in one forward) runs the compiled
prefill + first token (`jaxspec.loop.start` of `decode.Plain`) on one prompt of --prompt-len
random tokens and reports the median time and the device's peak memory after
that variant. The peak counter only grows, so list the variants from the
smallest expected footprint up (chunked first, gather before auto).

--expert-impls runs every chunk size once per routed-expert path: `auto` is the
engine's own choice (INT4 experts grouped over the dequantized local layer when
that reads fewer bytes and fits, `jaxspec.model.choose_expert_impl`), `gather`
forces one expert read per (token, expert) assignment. `--set num_experts=48`
gives one device's share of Kimi-K2.5's 384 experts on an 8-device mesh.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import decode, loop
from jaxspec.config import preset
from jaxspec.model import Transformer, init_cache, init_params
from jaxspec.sampling import SamplingParams


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="kimi-k2.5")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 0])
    p.add_argument("--expert-impls", nargs="+", choices=["auto", "gather"], default=["auto"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="override preset fields")
    p.add_argument("--json")
    args = p.parse_args(argv)

    overrides = {k: type(getattr(preset(args.preset), k))(v) for k, v in (kv.split("=") for kv in args.set)}
    cfg = preset(args.preset, num_layers=args.layers, **overrides)
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    params = init_params(cfg, jax.random.key(0), dtype)
    model = Transformer(cfg, dtype)
    P = args.prompt_len
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, P)), jnp.int32)
    lens = jnp.full((1,), P, jnp.int32)
    S = -(-(P + 8) // 64) * 64
    stop, sp = jnp.asarray([-1], jnp.int32), SamplingParams()
    base = peak_bytes()
    print(
        f"device {jax.devices()[0].device_kind}; {args.layers} layers, hidden {cfg.hidden_size}; prompt {P}; "
        f"peak after weights {None if base is None else round(base / 2**30, 2)} GiB",
        flush=True,
    )
    rows = []
    variants = [(impl, chunk) for impl in args.expert_impls for chunk in args.chunks]
    for impl, chunk in variants:
        m = model if impl == "auto" else model.clone(expert_impl=impl)

        def run(m=m, chunk=chunk):
            cache = init_cache(cfg, 1, S, dtype)
            jax.block_until_ready(cache)
            t = time.perf_counter()
            st = loop.start(decode.Plain(m, sp, 4, chunk), params, prompt, lens, cache, jax.random.key(0), stop)
            jax.block_until_ready(st)
            return time.perf_counter() - t

        t0 = time.perf_counter()
        run()
        compile_s = time.perf_counter() - t0
        secs = statistics.median(run() for _ in range(args.reps))
        peak = peak_bytes()
        rows.append(
            {
                "experts": impl,
                "chunk": chunk,
                "ms": secs * 1e3,
                "tok_s": P / secs,
                "first_call_s": compile_s,
                "peak_gib": None if peak is None else peak / 2**30,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'experts':>8} {'chunk':>6} {'ms':>9} {'tok/s':>9} {'1st call s':>10} {'peak GiB':>9}")
    for r in rows:
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(
            f"{r['experts']:>8} {r['chunk']:>6} {r['ms']:>9.1f} {r['tok_s']:>9.0f} {r['first_call_s']:>10.1f} {peak:>9}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
