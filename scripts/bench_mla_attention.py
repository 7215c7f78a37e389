"""MLA decode attention over the latent cache: XLA's einsums + softmax against the one-kernel form.

    python scripts/bench_mla_attention.py --share 8 --batch 1 8 --tokens 1 4 --slots 256 1024 4096

For one device's share of Kimi-K2.5 on an N-way mesh (64 / N heads, latent 512 + rope 64), each
(batch, tokens, slots) case: the model's XLA attention (`layers.attention`, as `MLAttention` calls
it) and `kernels.mla_attention` in each of `--configs`, every configuration first checked on the
device (relative error against a float32 evaluation of the formula, and a token's bits alone vs
among the call's tokens), then timed as `--iters` calls in one compiled loop (median of `--reps`).
Also the cache bytes a call reads and the time they take at the device's copy bandwidth, and the
kernel again with the model's `bound` (one past the last slot a sequence's rows see: the splits past
it skip their walk; prompts end at random in the cache's second half), checked for the same bits.

With `--tree`, a case of T > 1 tokens is a random tree of T nodes at the slots after the prompt (node i
sees its ancestors and itself), as a branching verify has it: the kernel is timed as before (the nodes
read at their own slots, the tree in the mask) and again with the tree's `window` (each node's ancestors
read through a slot map at the slots a decode step has them; `window_of_tree`), both checked against
the float32 formula.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import preset
from jaxspec.kernels import mla_attention as ma
from jaxspec.layers import attention, causal_mask

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_stacked_dense import copy_bandwidth, timed  # noqa: E402

INTERP = jax.default_backend() != "gpu"


def xla_attention(ql, qr, c, mask, scale):
    L = ql.shape[-1]
    return attention(ql, c[..., :L], c[..., :L], mask, scale, qr, c[..., L:])


def looped(fn, iters):
    """`iters` calls in one compiled loop, each call's query nudged by the last output (a dependency)."""

    def run(ql, qr, c, mask):
        def body(_, acc):
            out = fn(ql + acc[..., :1].astype(ql.dtype) * 0, qr, c, mask)
            return acc + out.astype(jnp.float32)

        return jax.lax.fori_loop(0, iters, body, jnp.zeros(ql.shape[:3] + (ql.shape[-1],), jnp.float32))

    return jax.jit(run)


def random_tree(rng, B, T):
    """[B, T, T] bool: node 0 the root, node i's parent a random earlier node; row i its ancestors and itself."""
    tree = np.zeros((B, T, T), bool)
    for b in range(B):
        for i in range(T):
            tree[b, i, i] = True
            if i:
                tree[b, i] |= tree[b, rng.integers(0, i)]
    return tree


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--share", type=int, default=8)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--slots", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--configs", nargs="*", default=["{}"], help="kernel configurations as JSON objects")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tree", action="store_true", help="T > 1: a random tree verify, also timed with its window")
    p.add_argument("--json")
    args = p.parse_args(argv)
    cfg = preset("kimi-k2.5")
    H, L, r = cfg.num_heads // args.share, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    scale = cfg.softmax_scale
    dt = jnp.bfloat16
    bw = copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {bw / 1e12:.2f} TB/s; {H} heads, latent {L} + {r}")
    print(
        f"{'batch':>5} {'tokens':>6} {'slots':>6} {'floor us':>8} {'xla us':>8} {'kernel us':>9} {'x faster':>8} "
        f"{'err':>8} {'invariant':>9}  config"
    )
    rows = []
    for B in args.batch:
        for T in args.tokens:
            for S in args.slots:
                rng = np.random.default_rng(B * 1000 + T * 10 + S)
                ql = jnp.asarray(rng.normal(size=(B, T, H, L)), dt)
                qr = jnp.asarray(rng.normal(size=(B, T, H, r)), dt)
                c = jnp.asarray(rng.normal(size=(B, S, L + r)) * 0.5, dt)
                pos = rng.integers(S // 2, S - T, size=B)
                mask = causal_mask(jnp.asarray(pos[:, None] + np.arange(T), jnp.int32), S)
                window = None
                if args.tree and T > 1:
                    tree = random_tree(rng, B, T)
                    rel = np.arange(S)[None, None, :] - pos[:, None, None]  # [B, 1, S]
                    inside = (rel >= 0) & (rel < T)
                    seen = np.take_along_axis(tree, np.clip(rel, 0, T - 1).repeat(T, axis=1), axis=2)
                    mask = jnp.asarray((rel < 0) | (inside & seen))
                    window = ma.window_of_tree(jnp.asarray(pos, jnp.int32), jnp.asarray(tree))
                ref = ma.reference(*(a.astype(jnp.float32) for a in (ql, qr, c)), mask, scale)
                floor = c.nbytes / bw
                t_xla = timed(looped(lambda *a: xla_attention(*a, scale), args.iters), ql, qr, c, mask, reps=args.reps)
                for conf in args.configs:
                    kcfg = json.loads(conf)
                    one = jax.jit(lambda *a, kcfg=kcfg: ma.mla_attention(*a, scale, config=kcfg, interpret=INTERP))
                    try:
                        got = one(ql, qr, c, mask).astype(jnp.float32)
                    except Exception as e:  # a configuration the device cannot compile: say so, go on
                        print(f"{B:>5} {T:>6} {S:>6} config {conf} failed: {type(e).__name__}: {str(e)[:300]}")
                        rows.append({"batch": B, "tokens": T, "slots": S, "config": kcfg, "error": str(e)[:1000]})
                        continue
                    err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
                    many = np.asarray(one(ql, qr, c, mask))
                    t_last = T - 1
                    alone = np.asarray(one(ql[:, t_last:], qr[:, t_last:], c, mask[:, t_last:]))
                    invariant = bool(np.array_equal(alone[:, 0], many[:, t_last]))
                    fn = lambda *a, kcfg=kcfg: ma.mla_attention(*a, scale, config=kcfg, interpret=INTERP)  # noqa: E731
                    t_k = timed(looped(fn, args.iters), ql, qr, c, mask, reps=args.reps)
                    # the model's form: a bound one past the last slot any row sees (splits past it skip)
                    bound = jnp.asarray(pos + T, jnp.int32)
                    fb = lambda *a, kcfg=kcfg, bound=bound: ma.mla_attention(  # noqa: E731
                        *a, scale, config=kcfg, interpret=INTERP, bound=bound
                    )
                    same = bool(np.array_equal(np.asarray(jax.jit(fb)(ql, qr, c, mask)), many))
                    t_b = timed(looped(fb, args.iters), ql, qr, c, mask, reps=args.reps)
                    t_w = err_w = None
                    if window is not None:
                        fw = lambda *a, kcfg=kcfg, window=window: ma.mla_attention(  # noqa: E731
                            *a, scale, config=kcfg, interpret=INTERP, window=window
                        )
                        got_w = jax.jit(fw)(ql, qr, c, mask).astype(jnp.float32)
                        err_w = float(jnp.max(jnp.abs(got_w - ref)) / jnp.max(jnp.abs(ref)))
                        t_w = timed(looped(fw, args.iters), ql, qr, c, mask, reps=args.reps)
                    row = {
                        "batch": B,
                        "tokens": T,
                        "slots": S,
                        "config": kcfg,
                        "floor_us": floor * 1e6,
                        "xla_us": t_xla / args.iters * 1e6,
                        "kernel_us": t_k / args.iters * 1e6,
                        "max_rel_err": err,
                        "invariant": invariant,
                        "bound_us": t_b / args.iters * 1e6,
                        "bound_same_bits": same,
                        "window_us": None if t_w is None else t_w / args.iters * 1e6,
                        "window_err": err_w,
                    }
                    rows.append(row)
                    print(
                        f"{B:>5} {T:>6} {S:>6} {row['floor_us']:>8.1f} {row['xla_us']:>8.1f} {row['kernel_us']:>9.1f} "
                        f"{t_xla / t_k:>8.2f} {err:>8.1e} {str(invariant):>9}  {conf}"
                        + f"  bound {row['bound_us']:.1f} us (x{t_b / t_k:.2f}, same bits: {same})"
                        + (
                            ""
                            if t_w is None
                            else f"  window {row['window_us']:.1f} us (x{t_w / t_k:.2f}), err {err_w:.1e}"
                        ),
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "copy_bw": bw, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
