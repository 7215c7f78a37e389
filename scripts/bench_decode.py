"""Plain decode step time for a preset at full width, few layers, random weights.

    python scripts/bench_decode.py --layers 3 --batch 1 8 [--bf16-experts] [--context 1024]

Runs the real compiled decode loop (`jaxspec.loop.run_loop` of `decode.Plain`) for a fixed
number of steps and reports ms/step, tok/s, the bytes a step must read (every
non-expert weight, the lm_head, the experts the batch actually routes to, and the
latent cache), and the achieved bandwidth against this device's measured copy
bandwidth, all from one process.
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

from jaxspec import checkpoint, decode, loop, quant
from jaxspec.config import preset
from jaxspec.kernels import grouped_matmul
from jaxspec.model import (
    Transformer,
    choose_attention_impl,
    choose_dense_impl,
    expert_layout,
    init_cache,
    init_params,
    per_layer,
    route,
    routed_expert_path,
    to_kernel_layout,
)
from jaxspec.sampling import SamplingParams


def copy_bandwidth(gib: float = 4.0, reps: int = 10) -> float:
    """Bytes moved per second (read + write) by an elementwise op over a large array."""
    n = int(gib * 2**30 / 2)
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 1.0001)
    f(x).block_until_ready()
    # Busy for half a second before timing: in a fresh process the first copies ran at 2.7 (H100) and 3.0-3.2 TB/s
    # (H200) where the same copy after a benchmark's runs gave 3.6-3.8 on the H200 (docs/PERFORMANCE.md, run 31).
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        f(x).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * x.nbytes / statistics.median(times)


def step_bytes(cfg, params, batch: int, context: int, dtype_bytes: int, tokens_B) -> dict:
    """Bytes one decode step must read: non-expert weights, touched experts, latent cache."""
    params = per_layer(cfg, params)
    flat = checkpoint.flatten(params)
    expert_leaf = routed_expert_path
    dense = sum(v.nbytes for p, v in flat.items() if not expert_leaf(p) and p[0] != "embed")
    dense += batch * cfg.hidden_size * dtype_bytes  # embedding rows
    per_expert = sum(v.nbytes for p, v in flat.items() if expert_leaf(p) and p[0] == f"layers_{cfg.num_layers - 1}")
    per_expert //= cfg.num_experts
    # Experts the batch really routes to, per MoE layer, from the router on the embeddings of this batch
    # (random weights route near-uniformly; the count is what matters for bytes).
    touched = 0
    emb = params["embed"]["embedding"][tokens_B].astype(jnp.float32)
    for i in range(cfg.num_layers):
        if cfg.is_moe_layer(i):
            moe = params[f"layers_{i}"]["moe"]
            experts, _ = route(emb @ moe["router"], moe["router_bias"], cfg)
            touched += len(np.unique(np.asarray(experts)))
    cache = cfg.num_layers * batch * context * cfg.latent_dim * dtype_bytes
    return {
        "weights": dense,
        "experts": touched * per_expert,
        "cache": cache,
        "touched_experts": touched,
        "total": dense + touched * per_expert + cache,
    }


def bench(cfg, params, model, batch: int, context: int, steps: int, reps: int) -> dict:
    sp = SamplingParams()
    rng = np.random.default_rng(batch)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(batch, 16)), jnp.int32)
    lens = jnp.full((batch,), 16, jnp.int32)
    stop = jnp.asarray([-1], jnp.int32)
    plain = decode.Plain(model, sp, steps + 2)
    times = []
    for r in range(reps + 1):
        cache = init_cache(cfg, batch, context, params["embed"]["embedding"].dtype)
        state = loop.start(plain, params, prompt, lens, cache, jax.random.key(0), stop)
        jax.block_until_ready(state)
        t = time.perf_counter()
        state = loop.run_loop(plain, params, state, stop, jnp.int32(steps))
        jax.block_until_ready(state)
        if r:  # the first run compiles
            times.append((time.perf_counter() - t) / steps)
    ms = statistics.median(times) * 1e3
    return {
        "ms_per_step": ms,
        "ms_spread": (max(times) - min(times)) * 1e3,
        "tok_s": batch / ms * 1e3,
        "tokens": prompt[:, 0],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="kimi-k2.5")
    p.add_argument("--layers", type=int, default=3, help="decoder layers (layer 0 dense, the rest MoE)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=1024, help="cache length attended every step")
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed loop")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--bf16-experts", action="store_true", help="unquantized experts instead of INT4")
    p.add_argument(
        "--impl",
        choices=["kernel", "gather", "tokamax", "xla"],
        help="expert implementation (default: the engine's choice, `model.choose_expert_impl`)",
    )
    p.add_argument(
        "--dense-impl",
        choices=["kernel", "slice", "interpret"],
        help="how the stacked layers read their dense weights (default: `model.choose_dense_impl`)",
    )
    p.add_argument(
        "--attention-impl",
        choices=["xla", "kernel", "interpret"],
        help="attention over the latent cache: XLA's or the Pallas kernel (`model.ATTENTION_IMPLS`; default: "
        "`model.choose_attention_impl`, the kernel on a GPU)",
    )
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE",
        help="override config fields, e.g. for a small smoke run: --set hidden_size=256 num_experts=16",
    )
    p.add_argument("--json", help="write results here")
    args = p.parse_args(argv)

    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    overrides = {k: type(getattr(preset(args.preset), k))(v) for k, v in (kv.split("=") for kv in args.set)}
    cfg = preset(args.preset, num_layers=args.layers, **overrides)
    if args.bf16_experts:
        cfg = cfg.replace(expert_format=None)
    params = init_params(cfg, jax.random.key(0), dtype)
    layout = expert_layout(cfg, args.impl)
    model = Transformer(
        cfg,
        dtype,
        expert_impl=args.impl,
        expert_layout=layout,
        dense_impl=args.dense_impl,
        attention_impl=args.attention_impl,
    )
    if layout == quant.TILES:
        params = jax.jit(lambda p: to_kernel_layout(cfg, p), donate_argnums=0)(params)
    bw = copy_bandwidth() if jax.default_backend() != "cpu" else copy_bandwidth(0.25, 3)
    dbytes = jnp.dtype(dtype).itemsize
    print(
        f"device {jax.devices()[0].device_kind}, experts impl: {args.impl or 'auto'} ({layout} layout) "
        f"(grouped matmul: {grouped_matmul.backend_name()}), "
        f"copy bandwidth {bw / 1e12:.2f} TB/s, {cfg.num_layers} layers, experts "
        f"{'bf16' if args.bf16_experts else 'int4'}, dense weights: {choose_dense_impl(args.dense_impl)}, "
        f"attention: {choose_attention_impl(args.attention_impl, dtype)}",
        flush=True,
    )
    rows = []
    for b in args.batch:
        r = bench(cfg, params, model, b, args.context, args.steps, args.reps)
        need = step_bytes(cfg, params, b, args.context, dbytes, r.pop("tokens"))
        achieved = need["total"] / (r["ms_per_step"] / 1e3)
        rows.append(
            dict(
                batch=b,
                **r,
                bytes_per_step=need["total"],
                touched_experts=need["touched_experts"],
                weights_bytes=need["weights"],
                expert_bytes=need["experts"],
                cache_bytes=need["cache"],
                achieved_tb_s=achieved / 1e12,
                fraction_of_copy_bw=achieved / bw,
                floor_ms=need["total"] / bw * 1e3,
            )
        )
    print(
        f"{'batch':>5} {'ms/step':>8} {'spread':>7} {'tok/s':>8} {'GB/step':>8} {'experts':>7} "
        f"{'floor ms':>8} {'TB/s':>6} {'of copy':>7}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['ms_per_step']:>8.3f} {r['ms_spread']:>7.3f} {r['tok_s']:>8.1f} "
            f"{r['bytes_per_step'] / 1e9:>8.3f} {r['touched_experts']:>7} {r['floor_ms']:>8.3f} "
            f"{r['achieved_tb_s']:>6.2f} {r['fraction_of_copy_bw']:>7.1%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "copy_bw": bw, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
