"""Offline look at the INT4 MoE kernels' machine code: registers, spills, shared memory, loop instruction mix.

    python scripts/kernel_sass.py [--config '{"gu_block_n": 32}'] [--tokens 8] [--dense] [--out DIR]

Runs on the CPU, no GPU: lowers ``moe_int4`` for CUDA (Pallas' Triton lowering), takes each
``pallas_call``'s Triton module as it is handed to XLA, compiles it with a local ``triton``
package (``pip install triton``) for sm_90 and disassembles it with the ``cuobjdump`` that
package carries. Prints, per kernel: registers per thread, spill bytes, shared memory, and the
SASS opcode counts of the innermost loop (the K loop), and writes ``.ttir``, ``.ptx`` and
``.sass`` files under ``--out``.

Caveats: the GPU runs the Triton bundled with its jaxlib, not this one, and starting from the
Triton IR skips nothing XLA does on the device (XLA hands the same module to its Triton), but
the Triton versions differ; treat counts as a guide and confirm on the device.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.pallas.triton import lowering as pallas_lowering

from jaxspec import quant
from jaxspec.kernels import int4_moe as im

_CAPTURED: list[tuple[str, str]] = []


def _capture_modules():
    """Wraps the Pallas Triton lowering so each kernel's module text (no debug info) is recorded."""
    orig = pallas_lowering.lower_jaxpr_to_triton_module

    def wrapped(jaxpr, *args, **kwargs):
        res = orig(jaxpr, *args, **kwargs)
        name = jaxpr.debug_info.func_name if jaxpr.debug_info else "kernel"
        _CAPTURED.append((name, res.module.operation.get_asm(enable_debug_info=False)))
        return res

    pallas_lowering.lower_jaxpr_to_triton_module = wrapped
    # the registration module imported the function by module attribute; patch it there too
    from jax._src.pallas.triton import pallas_call_registration as reg

    reg.lowering.lower_jaxpr_to_triton_module = wrapped


def _layer(E, D, F):
    rng = np.random.default_rng(0)
    raw = {}
    for name, (n_out, n_in) in {"gate": (F, D), "up": (F, D), "down": (D, F)}.items():
        raw[name] = quant.Int4Weight(
            jnp.asarray(rng.integers(-(2**31), 2**31, (E, n_out, n_in // 8)), jnp.int32),
            jnp.asarray(rng.uniform(0.01, 0.02, (E, n_out, n_in // 32)), jnp.bfloat16),
        )
    return raw


def _loop_body(sass: str) -> list[str]:
    """Instructions of the largest backward-branch region (the hot loop)."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    addr = []
    for ln in lines:
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        addr.append((int(m.group(1), 16), m.group(2)) if m else (None, ln))
    best = (0, 0, 0)
    for i, (a, ins) in enumerate(addr):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", ins or "")
        if a is None or not m:
            continue
        target = int(m.group(1), 16)
        if target < a:
            j = next((k for k, (b, _) in enumerate(addr) if b == target), None)
            if j is not None and i - j > best[0]:
                best = (i - j, j, i)
    _, j, i = best
    return [ins for _, ins in addr[j : i + 1]]


def _ttir_passes(path: str) -> str:
    """Runs Triton's own TTIR passes (inliner, canonicalize, the dot-add combine, ...) on a module file, as
    a compile from Python would; ``triton.compile`` of a ``.ttir`` file starts after them."""
    from triton._C.libtriton import ir
    from triton.backends.nvidia.compiler import CUDABackend

    ctx = ir.context()
    ir.load_dialects(ctx)
    from triton.backends.compiler import GPUTarget

    CUDABackend(GPUTarget("cuda", 90, 32)).load_dialects(ctx)
    mod = ir.parse_mlir_module(path, ctx)
    mod.context = ctx
    CUDABackend.make_ttir(mod, {}, None, 90)
    out = path.replace(".ttir", ".opt.ttir")
    with open(out, "w") as f:
        f.write(str(mod))
    return out


def _cuobjdump(bindir: str, flag: str, cubin: str) -> str:
    return subprocess.run(
        [os.path.join(bindir, "cuobjdump"), flag, cubin], capture_output=True, text=True, check=True
    ).stdout


def _opcode(ins: str) -> str:
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins.strip())
    return ins.split()[0] if ins else "?"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=json.loads, default=None)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--experts", type=int, default=48)
    p.add_argument("--out", default="/tmp/kernel_sass")
    p.add_argument(
        "--dense",
        action="store_true",
        help="the down launch with the share's shared expert down projection beside it (moe_int4's dense=)",
    )
    args = p.parse_args()
    try:
        import triton
    except ImportError:
        p.error("needs the triton package on this machine (pip install triton): it compiles the kernels for sm_90")
    from triton.backends.compiler import GPUTarget

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    os.makedirs(args.out, exist_ok=True)
    _capture_modules()
    E, D, F = args.experts, 7168, 2048
    ops = jax.eval_shape(im.relayout, _layer(E, D, F))
    x = jax.ShapeDtypeStruct((args.tokens, D), jnp.bfloat16)
    ex = jax.ShapeDtypeStruct((args.tokens, 8), jnp.int32)
    wt = jax.ShapeDtypeStruct((args.tokens, 8), jnp.float32)
    cfg = im._config(args.config)
    from jaxspec.kernels import stacked_matmul

    rows = jax.ShapeDtypeStruct((stacked_matmul.padded_rows(args.tokens), F // 8), jnp.bfloat16)
    stack = jax.ShapeDtypeStruct((60, F // 8, D), jnp.bfloat16)

    def call(x, e, w, o, rows, stack):
        dense = (rows, stack, 3) if args.dense else None
        return im.moe_int4(x, e, w, o, num_local=E, config=args.config, dense=dense)

    jax.jit(call).trace(x, ex, wt, ops, rows, stack).lower(lowering_platforms=("cuda",))
    warps = {"gate_up": cfg["gu_warps"], "down": cfg["dn_warps"]}
    stages = {"gate_up": im.gu_stages(args.tokens, cfg), "down": cfg["dn_stages"]}
    for name, ttir in _CAPTURED:
        kind = "gate_up" if "gate_up" in name else ("down" if "down" in name else "other")
        path = os.path.join(args.out, f"{name}.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        opts = {"num_warps": warps.get(kind, 4), "num_stages": stages.get(kind, 1)}
        path = _ttir_passes(path)
        k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=opts)
        for ext in ("ttgir", "ptx", "cubin"):
            mode = "wb" if ext == "cubin" else "w"
            with open(os.path.join(args.out, f"{name}.{ext}"), mode) as f:
                f.write(k.asm[ext])
        cubin = os.path.join(args.out, f"{name}.cubin")
        sass = _cuobjdump(bindir, "-sass", cubin)
        with open(os.path.join(args.out, f"{name}.sass"), "w") as f:
            f.write(sass)
        res = _cuobjdump(bindir, "-res-usage", cubin)
        regs = re.search(r"REG:(\d+)", res)
        spill = re.search(r"STACK:(\d+)", res)
        md = k.metadata
        body = _loop_body(sass)
        counts = collections.Counter(_opcode(i).split(".")[0] for i in body)
        print(
            f"{name}: warps {opts['num_warps']} stages {opts['num_stages']} registers {regs and regs.group(1)} "
            f"stack {spill and spill.group(1)} B shared {md.shared} B; hot loop {len(body)} instructions"
        )
        print("   ", ", ".join(f"{op} {n}" for op, n in counts.most_common()))


if __name__ == "__main__":
    main()
