"""What a launch costs inside the loop that times the INT4 expert kernels (``--loop-timing``).

    python scripts/bench_launch_floor.py [--tokens 1 8] [--experts 48] [--live 2]

``bench_grouped_matmul.py --loop-timing`` times a call inside one compiled loop, each call followed by a small
elementwise op that makes the next call depend on it (``jaxspec.timing.loop_time``). This script times, the same
way and per call:

* the elementwise op alone: the harness's own cost;
* an empty Pallas grid of the gate/up and the down kernel's shapes at T tokens (output tiles x block slots, x the
  gate/up K tree's programs), where ``--live`` slots hold rows and the others exit at once, as the kernels'
  programs do when their slot is empty; compiled with the kernels' warps;
* the same grid with one 64-byte store per live program.

A kernel's loop-timed figure less these is what its own prologue, K loop and tail cost. On the CPU the grids run
in Pallas interpret mode (a check that the script runs, not a timing).
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


def per_call(fn, x) -> float:
    """Seconds per ``fn(x)`` in a compiled loop, each followed by ``x + 0 * y[0]`` (the kernel benchmark's
    harness)."""

    def body(_, x):
        y = fn(x)
        return x + (y.reshape(-1)[0] * 0).astype(x.dtype)

    return timing.loop_time(body, x, (), reps=5, target_s=0.3)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    p.add_argument("--experts", type=int, default=48, help="local experts (48: one device's share of 8)")
    p.add_argument("--live", type=int, default=2, help="block slots that hold rows (the share at T = 1: ~2)")
    args = p.parse_args()
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
        out.append((T, "elementwise op alone", "-", per_call(lambda x: x[0, :16].astype(jnp.float32), x)))
        for name, grid, warps in (("gate/up grid", gu_grid, cfg["gu_warps"]), ("down grid", dn_grid, cfg["dn_warps"])):
            for store in (False, True):
                fn = functools.partial(grid_call, grid, warps, store, rows, interpret)
                label = f"{name}{', a store per live program' if store else ', empty'}"
                out.append((T, label, "x".join(map(str, grid)), per_call(fn, x)))
            print(f"T={T} done", flush=True)
    print(f"\n{'T':>4}  {'what':40s} {'grid':>12s} {'us per call':>12s}")
    for T, what, grid, s in out:
        print(f"{T:4d}  {what:40s} {grid:>12s} {s * 1e6:12.2f}")


if __name__ == "__main__":
    main()
