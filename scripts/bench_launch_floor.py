"""What a launch costs inside the loop that times the INT4 expert kernels (``--loop-timing``).

    python scripts/bench_launch_floor.py [--tokens 1 8] [--experts 48] [--live 2] [--chain 1 4]

``bench_grouped_matmul.py --loop-timing`` times a call inside one compiled loop, each call followed by a small
elementwise op that makes the next call depend on it (``jaxspec.timing.chain_time``). This script times, the same
way, one loop iteration holding ``m`` chained calls (``--chain``, each m in turn) of:

* the elementwise op alone;
* an empty Pallas grid of the gate/up and the down kernel's shapes at T tokens (output tiles x block slots, x the
  gate/up K tree's programs), where ``--live`` slots hold rows and the others exit at once, as the kernels'
  programs do when their slot is empty; compiled with the kernels' warps;
* the same grid with one 64-byte store per live program.

With one call an iteration every row sits at the loop's own per-iteration cost (~25 us on an H100, run 39,
docs/PERFORMANCE.md), far above a launch. ``chain_time`` fits ``t(m) = c * m + O`` per row: the slope ``c`` is
what one more call costs in the loop (the op or the grid with its op), the intercept ``O`` the iteration's own
cost (21-31 us on an H100, run 40). Where a call's device work is shorter than its launch from the host (the empty
grids), the loop runs at the host's pace and ``c`` measures that, not the device. Consecutive elementwise ops may
fuse into one kernel, so their slope is a lower bound; Pallas calls never fuse. On the CPU the grids run in
Pallas interpret mode (a check that the script runs, not a timing).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec import timing
from jaxspec.kernels import int4_moe as im

KIMI = {"D": 7168, "F": 2048, "k": 8}


def _kernel(rows_ref, x_ref, o_ref, *, store):  # x: the loop's carry, unread (the call depends on it)
    tile, slot = pl.program_id(0), pl.program_id(1)

    @pl.when(rows_ref[slot] > 0)
    def _():
        if store:
            o_ref[pl.ds(tile * 16, 16)] = jnp.full((16,), 1.0, jnp.float32)


def grid_call(grid, warps, store, rows, interpret, x):
    """An empty (or one-store) Pallas call over ``grid``, taking x as an operand so that a loop cannot hoist it;
    returns ``[tiles * 16]`` float32."""
    return pl.pallas_call(
        functools.partial(_kernel, store=store),
        out_shape=jax.ShapeDtypeStruct((grid[0] * 16,), jnp.float32),
        grid=grid,
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=warps, num_stages=1),
    )(rows, x)


def chained(fn, x, chains) -> timing.ChainTime:
    """``timing.chain_time`` of ``fn(x)``, each call followed by ``x + 0 * y[0]`` (the kernel benchmark's
    harness), so that every call depends on the one before."""

    def step(_, __, x):
        return timing.feed(x, fn(x))

    return timing.chain_time(step, x, [()], chains=tuple(chains))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    p.add_argument("--experts", type=int, default=48, help="local experts (48: one device's share of 8)")
    p.add_argument("--live", type=int, default=2, help="block slots that hold rows (the share at T = 1: ~2)")
    p.add_argument("--chain", type=int, nargs="+", default=[1, 4], help="calls chained in one loop iteration")
    args = p.parse_args()
    if any(m < 1 for m in args.chain) or len(set(args.chain)) < 2:
        p.error(f"--chain: expected two or more distinct counts >= 1, found {args.chain}")
    interpret = jax.default_backend() != "gpu"
    cfg = im.DEFAULT_CONFIG
    D, F, k = KIMI["D"], KIMI["F"], KIMI["k"]
    print(f"device {jax.devices()[0].device_kind}; jax {jax.__version__}; interpret={interpret}", flush=True)
    out = []
    for T in args.tokens:
        x = jnp.ones((T, D), jnp.bfloat16)
        slots = im.num_block_slots(T, k, args.experts)
        live = min(args.live, slots)
        rows = jnp.zeros((slots,), jnp.int32).at[:live].set(1)
        _, programs = im.gu_plan(T, cfg, D)
        gu_grid = (F // cfg["gu_block_n"], slots) + ((programs,) if programs > 1 else ())
        dn_grid = (D // cfg["dn_block_n"], slots)
        cases = [("elementwise op alone", "-", lambda x: x[0, :16].astype(jnp.float32))]
        for name, grid, warps in (("gate/up grid", gu_grid, cfg["gu_warps"]), ("down grid", dn_grid, cfg["dn_warps"])):
            for store in (False, True):
                label = f"{name}{', a store per live program' if store else ', empty'}"
                cases.append(
                    (label, "x".join(map(str, grid)), functools.partial(grid_call, grid, warps, store, rows, interpret))
                )
        for label, grid, fn in cases:
            out.append((T, label, grid, chained(fn, x, args.chain)))
        print(f"T={T} done", flush=True)
    chains = " ".join(f"{'m=' + str(m):>8s}" for m in args.chain)
    print(
        f"\nus a loop iteration of m chained calls, and the fit t(m) = c * m + O\n{'T':>4}  {'what':40s} {'grid':>10s} "
        f"{chains} {'c':>8s} {'O':>8s}"
    )
    for T, what, grid, ct in out:
        line = " ".join(f"{t * 1e6:8.2f}" for _, t in ct.points)
        print(f"{T:4d}  {what:40s} {grid:>10s} {line} {ct.per_call * 1e6:8.2f} {ct.per_iteration * 1e6:8.2f}")


if __name__ == "__main__":
    main()
