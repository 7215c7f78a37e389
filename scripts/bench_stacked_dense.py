"""Dense matmuls of stacked layers under `lax.scan`: what reading a layer's weight costs, three ways.

    python scripts/bench_stacked_dense.py --layers 4 --rows 1 8 32 128
    python scripts/bench_stacked_dense.py --share 8 --layers 8 --rows 1 8 32 64   # Kimi's own projections
    python scripts/bench_stacked_dense.py --share 8 --rows 1 64 --configs "{}" "{\"bk\": 128}"   # a sweep
    python scripts/bench_stacked_dense.py --share 8 --tables heads --rows 1 8 32 64   # lm_head and the draft

A toy decoder of `--layers` layers, each two bf16 matmuls at Kimi-K2.5 width
(x [M, 7168] @ [7168, F] -> tanh -> @ [F, 7168], added to x), timed per layer:

* `unrolled`: one weight array per layer, a Python loop (what the layers cost before stacking);
* `scan`: the weights stacked [L, ...] and sliced by `lax.scan` (XLA copies each slice first);
* `kernel`: the same scan, each matmul `jaxspec.kernels.stacked_matmul` reading the stack in place;

for each row count, against the HBM time of the layer's weight bytes at the device's measured
copy bandwidth. With `--share N` the tables are Kimi's own shapes instead (`--tables`): a layer's
projections, the pairs that share an input, and lm_head (its 1/N of the vocab and the whole) with
each product of the replicated Kimi-sized EAGLE-3 draft, each of the last timed as chained calls in
one compiled loop (`jaxspec.timing.chain_time`). Each kernel configuration in `--configs` is first
checked against XLA's matmul on the GPU (max relative error) before it is timed.
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

from jaxspec.kernels import stacked_matmul as sm

INTERP = jax.default_backend() != "gpu"  # Pallas interpret mode off the GPU (a smoke run only)
TABLES = ("projections", "pairs", "heads")
# The Kimi-sized EAGLE-3 draft that `scripts/bench_spec.py --share` builds by default (its --draft-* flags): one
# Llama layer at the target's width, replicated on every device.
DRAFT = {"heads": 64, "kv_heads": 8, "intermediate": 18432, "vocab": 32000}
ROTATE_BYTES = 128 << 20  # weight sets rotated per chained product: past a 50 MB L2 (H100 / H200) several times


def copy_bandwidth(gib: float = 2.0, reps: int = 10) -> float:
    n = int(gib * 2**30) // 4
    a = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(f(a))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(a))
        ts.append(time.perf_counter() - t)
    return 2 * n * 4 / min(ts)


def timed(f, *args, reps):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inner", type=int, default=8192)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--iters", type=int, default=8, help="forward passes per timed call (a fori_loop)")
    p.add_argument(
        "--configs",
        nargs="*",
        default=["{}"],
        help="kernel configurations as JSON objects (keys of stacked_matmul.DEFAULT_CONFIG)",
    )
    p.add_argument("--chain-reps", type=int, default=3, help="heads table: timed runs of each chained loop")
    p.add_argument("--chain-s", type=float, default=0.1, help="heads table: seconds of extra iterations a run")
    p.add_argument("--json")
    p.add_argument("--hlo", help="write the compiled HLO of the scan variant (first row count) here")
    p.add_argument(
        "--share",
        type=int,
        help="instead of the toy: each dense projection of a Kimi-K2.5 layer at its shape on one device of "
        "an N-way mesh (heads and shared-expert width split N ways), alone, in a scan of --layers layers",
    )
    p.add_argument(
        "--tables",
        nargs="+",
        choices=TABLES,
        default=list(TABLES),
        help="--share: which tables to run (projections: a layer's projections in a scan; pairs: the projections "
        "that share an input, in one call or two; heads: lm_head and the draft's products, chained calls)",
    )
    p.add_argument(
        "--div",
        type=int,
        default=1,
        help="--share heads table: every dimension divided by this (a quick run off the GPU); 1 on the GPU",
    )
    args = p.parse_args(argv)
    if args.share:
        return projections(args)

    L, D, F = args.layers, args.hidden, args.inner
    dt = jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 2)
    wa = (jax.random.normal(keys[0], (L, D, F), jnp.float32) / np.sqrt(D)).astype(dt)
    wb = (jax.random.normal(keys[1], (L, F, D), jnp.float32) / np.sqrt(F)).astype(dt)
    wa_list, wb_list = [wa[i] for i in range(L)], [wb[i] for i in range(L)]
    layer_bytes = 2 * D * F * 2
    bw = copy_bandwidth()
    print(
        f"device {jax.devices()[0].device_kind}; copy bandwidth {bw / 1e12:.2f} TB/s; "
        f"weights {layer_bytes / 1e6:.0f} MB/layer, {L} layers",
        flush=True,
    )

    def layer_xla(x, a, b):
        return x + jnp.dot(jnp.tanh(jnp.dot(x, a)), b)

    def many(fwd):
        def run(x, *w):
            return jax.lax.fori_loop(0, args.iters, lambda _, x: fwd(x, *w), x)

        return jax.jit(run)

    def unrolled(x, la, lb):
        for a, b in zip(la, lb):
            x = layer_xla(x, a, b)
        return x

    def scanned(x, a, b):
        return jax.lax.scan(lambda x, w: (layer_xla(x, *w), None), x, (a, b))[0]

    def kernel_fwd(cfg):
        def fwd(x, a, b):
            def step(c, i):
                h = jnp.tanh(sm.stacked_matmul(c, a, i, config=cfg, interpret=INTERP))
                return c + sm.stacked_matmul(h, b, i, config=cfg, interpret=INTERP), None

            return jax.lax.scan(step, x, jnp.arange(L))[0]

        return fwd

    rows_out = []
    for M in args.rows:
        x = (jax.random.normal(jax.random.key(M), (M, D), jnp.float32) * 0.1).astype(dt)
        # correctness of each configuration on one layer pair, against XLA's matmul
        ref = jnp.dot(x, wa[L - 1]).astype(jnp.float32)
        t = {
            "unrolled": timed(many(unrolled), x, wa_list, wb_list, reps=args.reps),
            "scan": timed(many(scanned), x, wa, wb, reps=args.reps),
        }
        if args.hlo and M == args.rows[0]:
            with open(args.hlo, "w") as f:
                f.write(many(scanned).lower(x, wa, wb).compile().as_text())
        errs = {}
        for c in args.configs:
            cfg = json.loads(c)
            got = jax.jit(lambda x, w, cfg=cfg: sm.stacked_matmul(x, w, L - 1, config=cfg, interpret=INTERP))(
                x, wa
            ).astype(jnp.float32)
            errs[c] = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
            t[f"kernel {c}"] = timed(many(kernel_fwd(cfg)), x, wa, wb, reps=args.reps)
        per_layer = {k: v / args.iters / L for k, v in t.items()}
        floor = layer_bytes / bw
        for k, v in per_layer.items():
            err = errs.get(k[len("kernel ") :], None) if k.startswith("kernel") else None
            rows_out.append(
                {"rows": M, "variant": k, "us_per_layer": v * 1e6, "x_floor": v / floor, "max_rel_err": err}
            )
            e = "" if err is None else f"   max rel err {err:.2e}"
            print(
                f"rows {M:>4} {k:>40}: {v * 1e6:8.1f} us/layer  {v / floor:5.2f}x floor  "
                f"{layer_bytes / v / 1e12:5.2f} TB/s{e}",
                flush=True,
            )
    print(f"\nfloor = {layer_bytes / 1e6:.0f} MB / {bw / 1e12:.2f} TB/s = {floor * 1e6:.1f} us/layer")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "copy_bw": bw, "rows": rows_out}, f, indent=1)
    return 0


def _accumulated(body, iters, shape, dt):
    """jit of `iters` passes of acc = body(acc, x, w) from zeros: one timed call."""

    def f(x, w):
        return jax.lax.fori_loop(0, iters, lambda _, acc: body(acc, x, w), jnp.zeros(shape, dt))

    return jax.jit(f)


def _unrolled(acc, x, ws):
    for wl in ws:
        acc = acc + jnp.dot(x, wl)
    return acc


def _scanned(acc, x, w):
    return jax.lax.scan(lambda a, wl: (a + jnp.dot(x, wl), None), acc, w)[0]


def _in_place(cfg):
    def body(acc, x, w):
        def step(a, i):
            return a + sm.stacked_matmul(x, w, i, config=cfg, interpret=INTERP), None

        return jax.lax.scan(step, acc, jnp.arange(w.shape[0]))[0]

    return body


def kimi_projections(share: int) -> dict[str, tuple[int, int]]:
    """(K, N) of each dense projection of one Kimi-K2.5 MoE layer on one device of a `share`-way mesh
    (the sharding table's splits: heads and the shared expert's width; q_a and kv_a replicated)."""
    from jaxspec.config import preset

    cfg = preset("kimi-k2.5")
    heads = cfg.num_heads // share
    shared = cfg.moe_intermediate_size * cfg.num_shared_experts // share
    return {
        "q_a": (cfg.hidden_size, cfg.q_lora_rank),
        "q_b": (cfg.q_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)),
        "kv_a": (cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
        "o": (heads * cfg.v_head_dim, cfg.hidden_size),
        "shared gate/up": (cfg.hidden_size, shared),
        "shared down": (shared, cfg.hidden_size),
    }


def projections(args) -> int:
    """Each projection as `--layers` stacked layers of y += x @ W[l]: unrolled arrays, scan slices, and the
    kernel in each of `--configs` (each checked first: error against XLA, and a row's bits alone vs among 64).
    Then the pairs that share an input, and lm_head and the draft's products (`--tables`)."""
    bw = copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {bw / 1e12:.2f} TB/s; share of {args.share}")
    out = layer_projections(args, bw) if "projections" in args.tables else []
    fused = fused_pairs(args, bw) if "pairs" in args.tables else []
    heads = heads_and_draft(args, bw) if "heads" in args.tables else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": jax.devices()[0].device_kind,
                    "copy_bw": bw,
                    "share": args.share,
                    "rows": out,
                    "fused": fused,
                    "heads": heads,
                },
                f,
                indent=1,
            )
    return 0


def layer_projections(args, bw) -> list[dict]:
    L, dt = args.layers, jnp.bfloat16
    configs = [json.loads(c) for c in args.configs]
    print(
        f"{'projection':>15} {'K x N':>12} {'rows':>4} {'unrolled us':>11} {'scan us':>8} {'kernel us':>9} "
        f"{'% of copy: unrolled / scan / kernel':>36} {'kernel err':>10} {'invariant':>9}  config",
        flush=True,
    )
    out = []
    for name, (K, N) in kimi_projections(args.share).items():
        w = (jax.random.normal(jax.random.key(K * 7 + N), (L, K, N), jnp.float32) / np.sqrt(K)).astype(dt)
        w_list = [w[i] for i in range(L)]
        floor = K * N * 2 / bw
        x64 = (jax.random.normal(jax.random.key(K), (64, K), jnp.float32)).astype(dt)
        for M in args.rows:
            x = (jax.random.normal(jax.random.key(M), (M, K), jnp.float32)).astype(dt)
            base = [
                timed(_accumulated(body, args.iters, (M, N), dt), x, ws, reps=args.reps) / args.iters / L
                for body, ws in ((_unrolled, w_list), (_scanned, w))
            ]
            ref = jnp.dot(x, w[L - 1], preferred_element_type=jnp.float32)
            for cfg in configs:
                one = jax.jit(lambda x, w, cfg=cfg: sm.stacked_matmul(x, w, L - 1, config=cfg, interpret=INTERP))
                got = one(x, w).astype(jnp.float32)
                err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
                many = np.asarray(one(x64, w))
                invariant = all(np.array_equal(np.asarray(one(x64[r : r + 1], w))[0], many[r]) for r in (0, 17, 63))
                tk = timed(_accumulated(_in_place(cfg), args.iters, (M, N), dt), x, w, reps=args.reps) / args.iters / L
                t = base + [tk]
                pct = " / ".join(f"{100 * floor / v:5.1f}" for v in t)
                print(
                    f"{name:>15} {f'{K}x{N}':>12} {M:>4} {t[0] * 1e6:>11.1f} {t[1] * 1e6:>8.1f} {t[2] * 1e6:>9.1f} "
                    f"{pct:>36} {err:>10.1e} {str(invariant):>9}  {json.dumps(cfg)}",
                    flush=True,
                )
                out.append(
                    {
                        "projection": name,
                        "k": K,
                        "n": N,
                        "rows": M,
                        "config": cfg,
                        "unrolled_us": t[0] * 1e6,
                        "scan_us": t[1] * 1e6,
                        "kernel_us": t[2] * 1e6,
                        "floor_us": floor * 1e6,
                        "max_rel_err": err,
                        "invariant": invariant,
                    }
                )
    return out


def heads_and_draft_shapes(share: int, div: int = 1) -> dict[str, tuple[int, int, bool, bool]]:
    """(K, N, float32 out, through the kernel) of lm_head on one device of a `share`-way mesh (its vocab split
    `share` ways), of the whole lm_head (one device), and of each product of the replicated draft (`DRAFT`), every
    dim divided by `div` (a quick run). As the model runs them on a GPU: lm_head by `stacked_matmul` as a stack of
    one, float32 out; the draft's products by XLA einsums in bfloat16, its lm_head float32 out."""
    from jaxspec.config import preset

    cfg = preset("kimi-k2.5")
    D, V = cfg.hidden_size, cfg.vocab_size
    hd = D // DRAFT["heads"]
    shapes = {f"lm_head, vocab/{share}": (D, V // share, True, True)}
    if share > 1:
        shapes["lm_head, whole"] = (D, V, True, True)
    shapes |= {
        "draft fc": (3 * D, D, False, False),
        "draft q": (2 * D, DRAFT["heads"] * hd, False, False),
        "draft k": (2 * D, DRAFT["kv_heads"] * hd, False, False),
        "draft v": (2 * D, DRAFT["kv_heads"] * hd, False, False),
        "draft o": (DRAFT["heads"] * hd, D, False, False),
        "draft gate": (D, DRAFT["intermediate"], False, False),
        "draft up": (D, DRAFT["intermediate"], False, False),
        "draft down": (DRAFT["intermediate"], D, False, False),
        "draft lm_head": (D, DRAFT["vocab"], True, False),
    }
    cut = lambda n: max(16, n // div // 16 * 16)  # noqa: E731
    return {k: (cut(K), cut(N), f32, kern) for k, (K, N, f32, kern) in shapes.items()}


def _chained(product, x, ws, reps: int, target_s: float) -> float:
    """Seconds of one `product(x, w)` inside a compiled loop, the loop's own cost fitted away
    (`jaxspec.timing.chain_time`), the weight sets `ws` taken in turn. Each call's input depends on the previous
    call's output through one elementwise op on x (part of the figure), so no call is hoisted out of the loop
    (XLA moves a loop-invariant product out of it) and none overlaps the next."""
    from jaxspec.timing import chain_time, feed

    def step(k, w, x):
        return feed(x, product(x, w))

    return chain_time(step, x, [w for w in ws], reps=reps, target_s=target_s).per_call


def heads_and_draft(args, bw) -> list[dict]:
    """lm_head (the share's and the whole) and the draft's products at each of `--rows`, timed in a compiled loop
    as XLA's dot and, for lm_head, as the model's `stacked_matmul` (a stack of one), against the copy ceiling over
    the weight's bytes. The kernel is checked first: error against XLA's product, a row's bits alone vs among 64."""
    dt = jnp.bfloat16
    shapes = heads_and_draft_shapes(args.share, args.div)
    print(
        f"\n{'product':>18} {'K x N':>13} {'MB':>6} {'sets':>4} {'rows':>4} {'xla us':>8} {'kernel us':>9} "
        f"{'% of copy: xla / kernel':>24} {'kernel err':>10} {'invariant':>9}",
        flush=True,
    )
    out, totals = [], {}
    for name, (K, N, f32, kern) in shapes.items():
        odt = jnp.float32 if f32 else dt
        nbytes = K * N * 2
        sets = int(min(8, max(1, -(-ROTATE_BYTES // nbytes))))
        keys = jax.random.split(jax.random.key(K * 13 + N), sets)
        ws = [(jax.random.normal(k, (1, K, N), jnp.float32) / np.sqrt(K)).astype(dt) for k in keys]
        floor = nbytes / bw
        xla = lambda x, w, odt=odt: jnp.dot(x, w[0], preferred_element_type=odt).astype(odt)  # noqa: E731
        knl = lambda x, w, odt=odt: sm.stacked_matmul(x, w, 0, out_dtype=odt, interpret=INTERP)  # noqa: E731
        err = invariant = None
        if kern:
            x64 = (jax.random.normal(jax.random.key(K), (64, K), jnp.float32)).astype(dt)
            one = jax.jit(knl)
            many = np.asarray(one(x64, ws[0]))
            ref = np.asarray(jax.jit(lambda x, w: jnp.dot(x, w[0], preferred_element_type=jnp.float32))(x64, ws[0]))
            err = float(np.max(np.abs(many.astype(np.float32) - ref)) / np.max(np.abs(ref)))
            invariant = all(np.array_equal(np.asarray(one(x64[r : r + 1], ws[0]))[0], many[r]) for r in (0, 17, 63))
        for M in args.rows:
            x = (jax.random.normal(jax.random.key(M), (M, K), jnp.float32)).astype(dt)
            t_xla = _chained(xla, x, ws, args.chain_reps, args.chain_s)
            t_knl = _chained(knl, x, ws, args.chain_reps, args.chain_s) if kern else None
            pct = " / ".join(
                "-" if v is None else f"{100 * floor / v:5.1f}" if v > 0 else "n/a" for v in (t_xla, t_knl)
            )
            print(
                f"{name:>18} {f'{K}x{N}':>13} {nbytes / 1e6:>6.1f} {sets:>4} {M:>4} {t_xla * 1e6:>8.1f} "
                f"{'-' if t_knl is None else f'{t_knl * 1e6:.1f}':>9} {pct:>24} "
                f"{'-' if err is None else f'{err:.1e}':>10} {'-' if invariant is None else str(invariant):>9}",
                flush=True,
            )
            if name.startswith("draft"):
                b, t = totals.get(M, (0, 0.0))
                totals[M] = (b + nbytes, t + t_xla)
            out.append(
                {
                    "product": name,
                    "k": K,
                    "n": N,
                    "rows": M,
                    "sets": sets,
                    "xla_us": t_xla * 1e6,
                    "kernel_us": None if t_knl is None else t_knl * 1e6,
                    "floor_us": floor * 1e6,
                    "max_rel_err": err,
                    "invariant": invariant,
                }
            )
    for M, (b, t) in totals.items():
        pct = f"{100 * b / bw / t:.1f}%" if t > 0 else "n/a"
        print(
            f"the draft's products at {M} rows: {t * 1e6:.1f} us for {b / 1e6:.0f} MB "
            f"(floor {b / bw * 1e6:.1f} us, {pct} of copy)"
        )
    return out


def _two_calls(acc, x, ws):
    def step(a, i):
        ys = [sm.stacked_matmul(x, w, i, interpret=INTERP) for w in ws]
        return a + sum(jnp.sum(y, axis=1, keepdims=True) for y in ys), None

    return jax.lax.scan(step, acc, jnp.arange(ws[0].shape[0]))[0]


def _one_call(acc, x, ws):
    def step(a, i):
        ys = sm.stacked_matmuls(x, ws, i, interpret=INTERP)
        return a + sum(jnp.sum(y, axis=1, keepdims=True) for y in ys), None

    return jax.lax.scan(step, acc, jnp.arange(ws[0].shape[0]))[0]


def fused_pairs(args, bw) -> list[dict]:
    """Projections that share their input, as two kernel calls per layer against one (`stacked_matmuls`)."""
    L, dt = args.layers, jnp.bfloat16
    shapes = kimi_projections(args.share)
    pairs = {"q_a + kv_a": ("q_a", "kv_a"), "shared gate + up": ("shared gate/up", "shared gate/up")}
    head = f"{'two calls us':>12} {'one call us':>11} {'% of copy: two / one':>21} {'invariant':>9}"
    print(f"\n{'pair':>17} {'rows':>4} {head}")
    out = []
    for label, names in pairs.items():
        K = shapes[names[0]][0]
        keys = jax.random.split(jax.random.key(K), len(names))
        ws = tuple(
            (jax.random.normal(k, (L, K, shapes[n][1]), jnp.float32) / np.sqrt(K)).astype(dt)
            for k, n in zip(keys, names)
        )
        floor = sum(w[0].size for w in ws) * 2 / bw
        x64 = (jax.random.normal(jax.random.key(K), (64, K), jnp.float32)).astype(dt)
        f = jax.jit(lambda x, ws: sm.stacked_matmuls(x, ws, L - 1, interpret=INTERP))
        many = [np.asarray(y) for y in f(x64, ws)]
        invariant = all(
            np.array_equal(np.asarray(a)[0], m[r]) for r in (0, 17, 63) for a, m in zip(f(x64[r : r + 1], ws), many)
        )
        for M in args.rows:
            x = (jax.random.normal(jax.random.key(M), (M, K), jnp.float32)).astype(dt)
            t = [
                timed(_accumulated(body, args.iters, (M, 1), dt), x, ws, reps=args.reps) / args.iters / L
                for body in (_two_calls, _one_call)
            ]
            pct = " / ".join(f"{100 * floor / v:5.1f}" for v in t)
            print(
                f"{label:>17} {M:>4} {t[0] * 1e6:>12.1f} {t[1] * 1e6:>11.1f} {pct:>21} {str(invariant):>9}", flush=True
            )
            out.append({"pair": label, "rows": M, "two_us": t[0] * 1e6, "one_us": t[1] * 1e6, "invariant": invariant})
    return out


if __name__ == "__main__":
    sys.exit(main())
