"""The INT4 experts' routing metadata (`kernels.block_routing`, one Pallas program) against the call's size.

    python scripts/bench_metadata.py --tokens 1 8 32 64 128      # the share of 8: top-8 of 384, 48 local

`int4_moe.route_blocks` builds the block rows of a call's (token, k) assignments before the two INT4 kernels
run. Where it runs as the metadata kernel (a compiled call up to `int4_moe`'s `meta_max_assignments`, the kernel
itself up to `block_routing.MAX_ASSIGNMENTS`) that is one program walking the assignments in chunks, so its time
grows with T x k while every other kernel of a decode layer spreads over the GPU; the last column says which
builder a call of that size uses. This times it at each T as chained calls in one compiled loop
(`jaxspec.timing.chain_time`, the loop's own cost fitted away), the expert ids depending on the previous call's
output so that nothing is hoisted out of the loop, next to the same chain without the metadata (the dependency's
own ops) and, where `--xla` asks, the XLA form of the same metadata. Random routing: top-8 of `--global-experts`,
the busiest device's share of `--experts` local experts (as `bench_grouped_matmul.py --global-experts` and the
share's model route).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels import block_routing, int4_moe
from jaxspec.timing import chain_time, feed, follow

K = 8  # Kimi-K2.5's experts per token
D, F = 7168, 2048  # Kimi-K2.5's hidden and expert widths (the gate/up kernel's tiles, so its counters)


def routing(T: int, global_experts: int, seed: int):
    """Expert ids [T, K] (K distinct of `global_experts` a token) and their weights."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(global_experts, K, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.random((T, K)).astype(np.float32)
    return jnp.asarray(ids), jnp.asarray(w / w.sum(1, keepdims=True))


def time_metadata(T: int, args, impl: str | None) -> float:
    """Seconds of one `route_blocks` call (None: the chain's dependency ops alone) at T tokens."""
    share = args.global_experts // args.experts
    counters = args.counters
    if counters < 0:  # as many as a Kimi-width call of the model's kernels asks the program to zero
        counters = int4_moe.num_counters(int4_moe.DEFAULT_CONFIG, T, K, args.experts, 1, D, F)
    sets = [routing(T, args.global_experts, args.seed + s) for s in range(args.sets)]

    def step(k, a, c):
        ids, w = follow(a, c)  # the ids follow the previous call: no hoisting
        if impl is None:
            return feed(c, ids)
        meta = int4_moe.route_blocks(ids, w, args.experts, 1, impl, share=share, counters=counters)
        # `feed` widens the integer outputs before its multiply by 0: XLA folds an integer x * 0 to 0 and then
        # drops the call whose output it was
        return feed(c, meta["rows"], meta["packed"])

    return chain_time(step, jnp.float32(0), sets, reps=args.reps, target_s=args.target_s).per_call


def parse_shape(text: str) -> dict:
    """``CHUNKxWARPS`` (``--program``): the metadata program's shape (`block_routing.DEFAULT_CONFIG`)."""
    chunk, sep, warps = text.partition("x")
    if not sep or not chunk.isdigit() or not warps.isdigit():
        raise argparse.ArgumentTypeError(f"expected CHUNKxWARPS such as 128x4, found {text!r}")
    return {"chunk": int(chunk), "warps": int(warps)}


def same_as_xla(T: int, args, impl: str) -> bool:
    """Whether the program builds XLA's metadata exactly at T (the first routing of the chain): a program shape
    that compiles but computes wrongly on the device must not be timed as if it were right."""
    ids, w = routing(T, args.global_experts, args.seed)
    share = args.global_experts // args.experts

    def fields(impl):
        m = int4_moe.route_blocks(ids, w, args.experts, 1, impl, share=share)
        return m["rows"], m["expert"], m["packed"], m["valid"].astype(jnp.int32)

    want = jax.tree.map(np.asarray, jax.jit(lambda: fields("xla"))())
    got = jax.tree.map(np.asarray, jax.jit(lambda: fields(impl))())
    return int4_moe.same_metadata(want, got)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    p.add_argument("--experts", type=int, default=48, help="local experts (one device's)")
    p.add_argument("--global-experts", type=int, default=384, help="experts over all devices (top-8 of these)")
    p.add_argument("--sets", type=int, default=3, help="routings rotated in the chain")
    p.add_argument(
        "--counters",
        type=int,
        default=-1,
        help="atomic counters the program zeroes (-1: as many as the model's gate/up kernel asks at each T)",
    )
    p.add_argument(
        "--program",
        type=parse_shape,
        nargs="+",
        metavar="CHUNKxWARPS",
        help="the metadata program's shapes to time, each a column (default: block_routing.DEFAULT_CONFIG's); "
        "each is first checked against XLA's metadata at every T",
    )
    p.add_argument("--xla", action="store_true", help="also time the XLA form of the same metadata")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--target-s", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.global_experts % args.experts:
        p.error(f"--global-experts {args.global_experts} is not a multiple of --experts {args.experts}")
    default = dict(block_routing.DEFAULT_CONFIG)
    shapes = args.program or [default]
    for shape in shapes:
        block_routing.DEFAULT_CONFIG.update(shape)
        try:
            block_routing._config()
        except ValueError as exc:
            p.error(f"--program {shape['chunk']}x{shape['warps']}: {exc}")
    block_routing.DEFAULT_CONFIG.update(default)
    gpu = jax.default_backend() == "gpu"
    kernel = "kernel" if gpu else "interpret"
    print(
        f"device {jax.devices()[0].device_kind}; {args.experts} local of {args.global_experts} experts, top-{K}; "
        f"metadata kernel up to {block_routing.MAX_ASSIGNMENTS} assignments ({kernel}); a compiled call uses it up to "
        f"{int4_moe.DEFAULT_CONFIG['meta_max_assignments']} (int4_moe's meta_max_assignments), XLA above; "
        f"columns: chunk x warps (us a call less the dependency's; '!' where its metadata differ from XLA's)",
        flush=True,
    )
    names = [f"{s['chunk']}x{s['warps']}" for s in shapes]
    head = f"{'T':>5} {'assignments':>11} {'dependency us':>13} " + " ".join(f"{n:>9}" for n in names)
    print(f"{head} {'xla us':>7} {'model':>6}")
    for T in args.tokens:
        A = T * K
        dep = time_metadata(T, args, None)
        cols = []
        for shape in shapes:
            block_routing.DEFAULT_CONFIG.update(shape)
            if A > block_routing.MAX_ASSIGNMENTS:
                cols.append(f"{'-':>9}")
                continue
            try:  # a shape the lowering or the device refuses leaves its column, not the sweep
                ok = same_as_xla(T, args, kernel)
                ker = time_metadata(T, args, kernel)
            except Exception as exc:  # noqa: BLE001 - reported below the table's row
                cols.append(f"{'error':>9}")
                print(f"  {shape['chunk']}x{shape['warps']} at T={T}: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            cols.append(f"{(ker - dep) * 1e6:>8.2f}{' ' if ok else '!'}")
        block_routing.DEFAULT_CONFIG.update(default)
        xla = (time_metadata(T, args, "xla") - dep) * 1e6 if args.xla else float("nan")
        used = int4_moe.metadata_impl(A, args.experts, interpret=not gpu)  # what `moe_int4` builds it with here
        print(f"{T:>5} {A:>11} {dep * 1e6:>13.2f} {' '.join(cols)} {xla:>7.2f} {used:>6}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
