"""The fused residual add + RMSNorm + pad (`jaxspec.kernels.rms_norm`) against XLA's ops, on the GPU.

    python scripts/bench_rms_norm.py                       # Kimi's widths (7168, and q_a's 1536)
    python scripts/bench_rms_norm.py --rows 1 8 64 --reps 5

For each width D and row count M, checks the compiled kernel first, then times it:

* against `rms_norm.reference` (XLA: the add, the norm, the pad the dense kernel would make) in float64
  terms: the max error of both against a float64 norm of the same bfloat16 inputs;
* for its row invariance: every row of the M-row call has the bits of the same row in a call of its
  own (M = 1), so a decode step and a verify normalise a token alike; its padding rows are zero;
* for time: N norms chained in straight-line code (the next norm's input is this one's sum, every
  norm's rows an output of the call), kernel vs XLA in the same run, us per norm (one launch and its
  dispatch spread over the N).
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

from jaxspec.kernels import rms_norm, stacked_matmul

INTERP = jax.default_backend() != "gpu"  # Pallas interpret mode off the GPU (a smoke run only)


def _f64_norm(s: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    v = s.astype(np.float64)
    return scale.astype(np.float64) * v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)


def check(d: int, rows: list[int], eps: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    m_max = max(rows)
    x = rng.normal(size=(m_max, d)).astype(np.float32)
    h = rng.normal(size=(m_max, d)).astype(jnp.bfloat16)
    scale = (1 + rng.normal(size=(d,)) / 4).astype(jnp.bfloat16)
    run = jax.jit(lambda x, h, w: rms_norm.rms_norm_rows(x, w, eps, residual=h, interpret=INTERP))
    ref = jax.jit(lambda x, h, w: rms_norm.reference(x, w, eps, h))
    alone = [np.asarray(run(x[i : i + 1], h[i : i + 1], scale)[0][0]) for i in range(m_max)]
    out = {"d": d, "rows": {}}
    for m in rows:
        y, s = (np.asarray(a) for a in run(x[:m], h[:m], scale))
        yr, sr = (np.asarray(a) for a in ref(x[:m], h[:m], scale))
        exact = _f64_norm(
            np.asarray(jnp.asarray(sr, jnp.bfloat16).astype(jnp.float32)), np.asarray(scale, np.float32), eps
        )

        def err(a, m=m, exact=exact):
            return float(np.abs(a[:m].astype(np.float64) - exact).max() / np.abs(exact).max())

        out["rows"][m] = {
            "padded_rows": int(y.shape[0]),
            "pad_zero": bool(y.shape[0] == stacked_matmul.padded_rows(m) and not np.any(y[m:].astype(np.float32))),
            "sum_exact": bool(np.array_equal(s, sr)),
            "row_invariant": all(np.array_equal(y[i], alone[i]) for i in range(m)),
            "err_kernel": err(y),
            "err_xla": err(yr),
            "bits_equal_xla": float(np.mean(y[:m].view(np.uint16) == yr.view(np.uint16))),
        }
    return out


def timing(d: int, m: int, eps: float, n: int, reps: int) -> dict:
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    h = jnp.asarray(rng.normal(size=(m, d)), jnp.bfloat16)
    w = jnp.asarray(1 + rng.normal(size=(d,)) / 4, jnp.bfloat16)
    mp = stacked_matmul.padded_rows(m)

    def kernel(x):
        y, s = rms_norm.rms_norm_rows(x, w, eps, residual=h, interpret=INTERP)
        return y, s

    def xla(x):
        y, s = rms_norm.reference(x, w, eps, h)
        return jnp.pad(y, ((0, mp - m), (0, 0))), s

    def chained(norm):
        # straight-line code, no loop: a GPU while loop costs ~10+ us an iteration of its own (run 13's
        # first form of this script measured that, not the norms); every y is an output, so none is dropped
        def run(x):
            ys = []
            for _ in range(n):
                y, x = norm(x)
                ys.append(y)
            return x, ys

        return jax.jit(run)

    res = {}
    for name, f in (("kernel", chained(kernel)), ("xla", chained(xla))):
        jax.block_until_ready(f(x))
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(f(x))
            ts.append(time.perf_counter() - t)
        res[name] = statistics.median(ts) / n * 1e6
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[7168, 1536])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 48, 63, 64, 512])
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--chain", type=int, default=64, help="norms per timed call")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if not INTERP and (problem := rms_norm.available()) is not None:
        print(f"the compiled kernel is not available here: {problem}", file=sys.stderr)
        return 1
    results = []
    for d in args.dims:
        c = check(d, args.rows, args.eps, args.seed)
        for m in args.rows:
            r = {"d": d, "m": m, **c["rows"][m]}
            if not INTERP:
                r.update(timing(d, m, args.eps, args.chain, args.reps))
            results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"backend {jax.default_backend()}{' (interpret mode)' if INTERP else ''}")
    print(
        f"{'D':>5} {'M':>4} {'pad ok':>6} {'sum ok':>6} {'row inv':>7} {'err kernel':>10} {'err xla':>9} "
        f"{'bits = xla':>10} {'kernel us':>9} {'xla us':>7} {'ratio':>6}"
    )
    bad = 0
    for r in results:
        ok = r["pad_zero"] and r["sum_exact"] and r["row_invariant"]
        bad += not ok
        t = (f"{r['kernel']:>9.2f} {r['xla']:>7.2f} {r['xla'] / r['kernel']:>6.2f}") if "kernel" in r else ""
        print(
            f"{r['d']:>5} {r['m']:>4} {str(r['pad_zero']):>6} {str(r['sum_exact']):>6} {str(r['row_invariant']):>7} "
            f"{r['err_kernel']:>10.2e} {r['err_xla']:>9.2e} {r['bits_equal_xla']:>10.3f} {t}"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
