"""A few `moe_int4` calls on one Kimi-width layer, for Nsight Compute to profile one of them.

    ncu --clock-control none --kernel-name regex:int4_moe_gate_up --launch-skip 1 --launch-count 1 \\
        --set full python scripts/ncu_moe_int4.py --tokens 1 --global-experts 384 [--config '{"gu_ksplit": 4}']

Weights, routing and activations are those of ``bench_grouped_matmul.py`` (same ``--seed``), so a
profiled call is the benchmark's row. The first call compiles and runs; ``--launch-skip 1`` skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_grouped_matmul import make_layer, routing  # noqa: E402

from jaxspec.kernels import int4_moe as im  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--experts", type=int, default=48, help="local experts")
    p.add_argument("--global-experts", type=int, help="route top-8 of these; keep the busiest device's")
    p.add_argument("--config", default="{}", help="JSON overrides of int4_moe.DEFAULT_CONFIG")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    E, D, F, T = args.experts, 7168, 2048, args.tokens
    cfg = json.loads(args.config)
    ops = im.relayout(make_layer(jax.random.key(args.seed), E, D, F))
    rng = np.random.default_rng(args.seed + T)
    ex, wt = routing(rng, T, E, args.global_experts)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32).astype(jnp.bfloat16)
    fn = jax.jit(lambda x, e, w, o: im.moe_int4(x, e, w, o, num_local=E, config=cfg))
    local = np.asarray(ex)[(np.asarray(ex) >= 0) & (np.asarray(ex) < E)]
    print(f"T={T}, experts touched {len(np.unique(local))} of {E}, config {cfg}", flush=True)
    for _ in range(args.calls):
        fn(x, ex, wt, ops).block_until_ready()
    print("done", flush=True)


if __name__ == "__main__":
    main()
