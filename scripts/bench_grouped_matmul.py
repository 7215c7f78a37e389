"""Grouped matmul (MoE experts) at Kimi-K2.5 shape: correctness and time of each implementation.

    python scripts/bench_grouped_matmul.py [--tokens 1 8 64]

For T tokens routed to 8 experts each, the MoE layer gathers the touched experts
(INT4 words + bf16 group scales) and runs gate/up/down grouped matmuls. This times
the three projections of `jaxspec.model.expert_ffn` with every implementation
(xla: gathered experts dequantised + XLA ragged_dot; gather: fused INT4 gather-
matvec per assignment; tokamax: Mosaic GPU grouped matmul), checks them against
the XLA path, and reports achieved bandwidth over the bytes of the touched experts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels import grouped_matmul
from jaxspec.model import expert_ffn

E, D, F, K = 384, 7168, 2048, 8  # Kimi-K2.5 routed experts


def timeit(f, *args, reps=20):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    args = p.parse_args()
    key = jax.random.key(0)
    ks = jax.random.split(key, 8)
    w = {}
    for i, (name, (out, inn)) in enumerate({"gate": (F, D), "up": (F, D), "down": (D, F)}.items()):
        w[name + "_packed"] = jax.random.bits(ks[2 * i], (E, out, inn // 8), jnp.uint32).astype(jnp.int32)
        w[name + "_scale"] = (jax.random.uniform(ks[2 * i + 1], (E, out, inn // 32), jnp.float32) * 0.01
                              ).astype(jnp.bfloat16)
    impls = ["xla", "gather"] + (["tokamax"] if grouped_matmul.tokamax_unavailable_reason() is None else [])
    print(f"device {jax.devices()[0].device_kind}; implementations {impls}; "
          f"tokamax: {grouped_matmul.tokamax_unavailable_reason() or 'available'}", flush=True)
    per_expert = sum(v[0].nbytes for v in w.values())
    rows = []
    for T in args.tokens:
        x = (jax.random.normal(ks[6], (T, D), jnp.float32)).astype(jnp.bfloat16)
        experts = jax.random.randint(ks[7], (T, K), 0, E)
        weights = jnp.ones((T, K), jnp.float32) / K
        touched = len(np.unique(np.asarray(experts)))
        ref = None
        for impl in impls:
            f = jax.jit(lambda x, e, wt, w, impl=impl: expert_ffn(x, e, wt, w, E, True, impl))
            try:
                out = f(x, experts, weights, w)
                secs = timeit(f, x, experts, weights, w)
            except Exception as exc:  # report and go on: one failing implementation must not hide the others
                rows.append((T, impl, touched, float("nan"), float("nan"), f"failed: {type(exc).__name__}: {exc}"[:200]))
                continue
            out = np.asarray(out, np.float32)
            if ref is None:
                ref, err = out, 0.0
            else:
                err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            rows.append((T, impl, touched, secs * 1e3, touched * per_expert / secs / 1e12, f"rel err vs xla {err:.1e}"))
    print(f"{'tokens':>6} {'impl':>8} {'experts':>7} {'ms (3 proj)':>11} {'TB/s':>6}  check")
    for r in rows:
        print(f"{r[0]:>6} {r[1]:>8} {r[2]:>7} {r[3]:>11.3f} {r[4]:>6.2f}  {r[5]}")


if __name__ == "__main__":
    main()
