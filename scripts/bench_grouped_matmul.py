"""INT4 routed experts at Kimi-K2.5 shape: the fused Pallas kernel vs the other paths, TB/s over touched bytes.

    python scripts/bench_grouped_matmul.py [--experts 48] [--tokens 1 4 8 16 32 64 128 512] [--json out.json]
    python scripts/bench_grouped_matmul.py --sweep [--bench]    # kernel configurations, then the table
    python scripts/bench_grouped_matmul.py --smoke              # CPU: tiny shapes, interpret mode

For T tokens routed top-8 over E local experts (random distinct experts per token, as
top-8 of random scores), every implementation computes the routed-expert FFN
``y[t] = sum_k w[t,k] * down(silu(gate(x)) * up(x))`` and is timed over the bytes of
the experts the tokens touch (INT4 words + bf16 scales of gate, up and down; bf16
weights for the bf16 peer), in one run:

* ``int4_moe``: :func:`jaxspec.kernels.int4_moe.moe_int4` (routing metadata, two Pallas
  Triton kernels, combine); ``kernels``: the two kernels alone.
* ``gather``: the model's fused XLA gather-matvec path (``expert_ffn(impl="gather")``).
* ``xla``: dequantize the touched experts + ``jax.lax.ragged_dot`` (``impl="xla"``).
* ``tokamax_bf16``: tokamax's Mosaic GPU grouped matmul on bf16 experts (4x the bytes).
* ``tokamax_int4``: tokamax's quantized ragged_dot, where it accepts group-32 scales.
* ``tinygemm``: torch's ``_weight_int4pack_mm`` (group 32) on a dense 32768 x 7168 INT4
  matrix with M = T rows: a library INT4 GEMM anchor over the same kind of bytes, not
  a MoE.

Weights are random bits (never zeros), and several weight sets larger than the L2
are rotated so that HBM, not the cache, is measured. Each of our configurations is
checked on the device against a float32 evaluation of the portable path (relative
error) and for batch invariance (token 0's output bits alone == in the batch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # leave room for torch

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import quant, timing
from jaxspec.kernels import grouped_matmul
from jaxspec.kernels import int4_moe as im
from jaxspec.kernels.grouped_matmul import gathered_expert_ffn
from jaxspec.model import expert_ffn

TOPK = 8
LOOP_TIMING = False  # --loop-timing: time our kernels inside one compiled loop (loop_timeit)
KIMI = {"D": 7168, "F": 2048}

# Configurations tried (docs/notes/int4_kernel.md has each one's numbers). Earlier sweeps on the
# H200 also ran stages 2, BN 128 with 8 warps, 8 warps at BN 64 and the jnp unpack, and options since
# removed from the kernel as slower (scale "post", gate/up in two loops, scale prefetch, K unroll,
# slot-major grid, the down kernel's K tree with a finishing kernel of its own (run 12; the tree is back since run 46,
# its last program finishing it), a program's gate/up K leaves side by side on warps of their own), as
# not worth their new numerics (the gate/up products in float16; the weights as the MMA's columns) or as gaining
# nothing measurable (the expert id loaded beside the row count): see the notes.
SWEEP = {
    # narrower gate/up tiles: more programs when few experts are touched (decode on a share of the mesh)
    "gu_bn32_w2": {"gu_block_n": 32, "gu_warps": 2},
    "gu_bn32_w4": {"gu_block_n": 32, "gu_warps": 4},
    "gu_bn16_w1": {"gu_block_n": 16, "gu_warps": 1},
    "gu_bn64_w4": {"gu_block_n": 64, "gu_warps": 4},
    "bn32_w2_both": {"gu_block_n": 32, "gu_warps": 2, "dn_block_n": 32, "dn_warps": 2},
    "stages4": {"gu_stages": 4, "dn_stages": 4},
    "gu_bn32_w2_s4": {"gu_block_n": 32, "gu_warps": 2, "gu_stages": 4},
    # K split over programs (the gate/up kernel's chain of 28 K blocks is what bounds decode on a share)
    "gu_ksplit1": {"gu_ksplit": 1},  # no split (the default until run 10; now 2 at D = 7168)
    "gu_ksplit2": {"gu_ksplit": 2},
    "gu_ksplit4": {"gu_ksplit": 4},
    "gu_ksplit7": {"gu_ksplit": 7},
    # the gate/up tree of 4 leaves (Kimi's 28 K blocks: 7 a leaf) over 4 programs at T = 1, 1 program from T = 8
    "gu_tree4_by_t": {"gu_ksplit": 4, "gu_programs": ((1, 4), (4, 2), (1 << 30, 1))},
    "gu_tree2_by_t": {"gu_programs": ((4, 2), (1 << 30, 1))},
    # the tree of 4 leaves on 4 programs up to T = 4 (decode at batch 1 and its verify), on 2 above
    "gu_tree4_4_2": {"gu_ksplit": 4, "gu_programs": ((4, 4), (1 << 30, 2))},
    # 4 programs up to T = 8 (plain decode at batch 8), 2 above
    "gu_tree4_8_2": {"gu_ksplit": 4, "gu_programs": ((8, 4), (1 << 30, 2))},
    # G4: the tree of 4 leaves on a program each at T = 1, two leaves in each of 2 programs above (run 48: 1.2 us
    # faster a layer at batch 1 on the H200; the candidate default)
    "gu_tree4_g4": {"gu_ksplit": 4, "gu_programs": ((1, 4), (1 << 30, 2)), "gu_leaf_loop": "flat"},
    # every K-tree part's live programs launched before the dead slots' (the same bits; run 49's timeline found the
    # default's T = 1 programs' K loops uneven, 14.6 to 23.6 us): with the default tree, and with G4
    "live_first": {"live_first": True},
    "gu_tree4_g4_live": {
        "gu_ksplit": 4,
        "gu_programs": ((1, 4), (1 << 30, 2)),
        "gu_leaf_loop": "flat",
        "live_first": True,
    },
    # the default configuration, timed beside the others in the same process
    "default": {},
    # the down kernel (8 K blocks per program at F = 2048)
    "dn32_w2": {"dn_block_n": 32, "dn_warps": 2},
    "dn64_w4": {"dn_block_n": 64, "dn_warps": 4},
    "dn_stages4": {"dn_stages": 4},
    "dn32_w2_s4": {"dn_block_n": 32, "dn_warps": 2, "dn_stages": 4},
    "dn128_w4": {"dn_block_n": 128, "dn_warps": 4},
    # the down kernel's K tree (run 46): 2 or 4 leaves, a program per leaf at T = 1, all in one program (flat) above
    "dn_tree2_by_t": {"dn_ksplit": 2, "dn_programs": ((1, 2), (1 << 30, 1))},
    "dn_tree4_by_t": {"dn_ksplit": 4, "dn_programs": ((1, 4), (1 << 30, 1))},
    # both trees of 4 leaves, a program per leaf at T = 1, gate/up on 2 programs above
    "trees4_by_t": {
        "gu_ksplit": 4,
        "gu_programs": ((1, 4), (1 << 30, 2)),
        "gu_leaf_loop": "flat",
        "dn_ksplit": 4,
        "dn_programs": ((1, 4), (1 << 30, 1)),
    },
}


# ---------------------------------------------------------------------------
# Problem
# ---------------------------------------------------------------------------


def make_layer(key, E, D, F):
    """Random INT4 experts in the checkpoint layout: random word bits, bf16 scales of both signs."""
    raw = {}
    for i, (name, (n_out, n_in)) in enumerate({"gate": (F, D), "up": (F, D), "down": (D, F)}.items()):
        kw, ks, kg = jax.random.split(jax.random.fold_in(key, i), 3)
        packed = jax.random.bits(kw, (E, n_out, n_in // 8), jnp.uint32).astype(jnp.int32)
        mag = jax.random.uniform(ks, (E, n_out, n_in // 32), jnp.float32, 0.5, 1.5) * (0.05 / np.sqrt(n_in))
        sign = jnp.where(jax.random.bernoulli(kg, 0.5, mag.shape), 1.0, -1.0)
        raw[name] = quant.Int4Weight(packed, (mag * sign).astype(jnp.bfloat16), 32)
    return raw


def routing(rng, T, E, G=None, repeat=False):
    """Top-8 of E local experts; with G: top-8 of G global experts, as ids local to the device (of G / E,
    E experts each) that receives the most assignments (ids of other devices fall outside [0, E)).
    ``repeat``: every token picks token 0's experts (a verify of one repeated draft token: each touched
    expert holds all T tokens, in one block up to 16)."""
    scores = rng.random((1 if repeat else T, G or E)).repeat(T if repeat else 1, axis=0)
    experts = np.argsort(-scores, axis=1)[:, :TOPK].astype(np.int32)
    if G:
        dev = np.bincount((experts // E).ravel(), minlength=G // E).argmax()
        experts = experts - dev * E
    w = rng.uniform(0.2, 1.0, (T, TOPK)).astype(np.float32)
    return jnp.asarray(experts), jnp.asarray(w / w.sum(1, keepdims=True) * 2.827)


def per_expert_bytes(raw):
    return sum(int(v[0].size) * v.dtype.itemsize for v in jax.tree.leaves(raw))


def block(out):
    jax.block_until_ready(out)
    return out


def loop_timeit(fn, arg_sets, reps=5):
    """Device seconds per call of ``fn(*args)`` inside one compiled loop, the loop's own cost fitted away
    (``jaxspec.timing.chain_time``: an iteration of 1 and of 4 rounds over the argument sets, the slope of
    its time over the calls it holds; launch and dispatch of the whole loop drop out too). Each call's first
    argument (the activations) is made to depend on the previous call's output (one elementwise op on
    [T, D], a few microseconds, part of the figure), so nothing can be hoisted or overlapped. Where the
    host-timed :func:`timeit` measures dispatch too, this is what the call costs inside a model's compiled
    step. Integer array arguments (the routing's expert ids) are made to depend on it as well: with fixed ids
    XLA computes what depends on them alone (the routing metadata, the XLA peer's gather and dequant) once,
    out of the loop (seen in the CPU's compiled loop; test_timing.py), and a call's figure would leave it
    out. Only top-level integer arrays get the dependency (one small integer op each a call): pass weights
    inside a pytree, never as a bare integer array. Before run 40 the figure was an iteration of one round
    divided by its calls, which kept a third of the loop's 21-32 us per iteration (H100) in each of 3
    calls."""
    first = arg_sets[0][0]
    is_static = [isinstance(v, int) for v in arg_sets[0][1:]]  # e.g. a static block-group count
    rest = [tuple(v for v, st in zip(a[1:], is_static) if not st) for a in arg_sets]
    statics = [[v for v, st in zip(a[1:], is_static) if st] for a in arg_sets]

    def step(k, a, x):
        # integer arrays (the routing's expert ids) also depend on the carry, so that every call builds its own
        # routing metadata as a model's layer does: with fixed ids XLA hoists it out of the loop
        it_a, it_s = iter(timing.follow(a, x)), iter(statics[k])
        y = fn(x, *[next(it_s) if flag else next(it_a) for flag in is_static])
        return timing.feed(x, jax.tree.leaves(y)[0])

    return timing.chain_time(step, first, rest, reps=reps).per_call


def timeit(fn, arg_sets, target_s=0.3, repeats=5):
    """Median seconds per call over ``repeats`` batches of calls rotating through ``arg_sets`` (host-timed:
    includes dispatch; see :func:`loop_timeit`)."""
    if LOOP_TIMING:
        return loop_timeit(fn, arg_sets)
    for a in arg_sets:
        block(fn(*a))
    t = time.perf_counter()
    block(fn(*arg_sets[0]))
    one = time.perf_counter() - t
    n = int(max(1, min(40, target_s / repeats / max(one, 1e-6) / len(arg_sets))))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = None
        for _ in range(n):
            for a in arg_sets:
                out = fn(*a)
        block(out)
        ts.append((time.perf_counter() - t) / (n * len(arg_sets)))
    return statistics.median(ts)


def rel_err(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(y).all():
        return float("inf")
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


# ---------------------------------------------------------------------------
# Our kernel
# ---------------------------------------------------------------------------


def ours_fns(E, cfg, interpret):
    whole = jax.jit(lambda x, e, w, o: im.moe_int4(x, e, w, o, num_local=E, interpret=interpret, config=cfg))
    rows = jax.jit(
        lambda x, m, o, g: im.expert_rows(x, m, o, group=g, interpret=interpret, config=cfg), static_argnums=3
    )
    return whole, rows


def check_and_time_ours(name, cfg, T, ctx, interpret, kernels_too=True):
    """Correctness (vs float32 portable path, batch invariance) and time of one config at one T."""
    E, opss, x, ex, wt, ref = ctx["E"], ctx["opss"], ctx["x"], ctx["ex"], ctx["wt"], ctx["ref"]
    whole, rows = ours_fns(E, cfg, interpret)
    row = {"impl": "int4_moe", "config": name, "T": T}
    try:
        t0 = time.perf_counter()
        y = block(whole(x, ex, wt, opss[0]))
        row["compile_s"] = round(time.perf_counter() - t0, 2)
        row["rel_err"] = rel_err(np.asarray(y.astype(jnp.float32)), ref)
        alone = block(whole(x[:1], ex[:1], wt[:1], opss[0]))
        row["invariant"] = bool(np.array_equal(np.asarray(alone[0]).view(np.uint16), np.asarray(y[0]).view(np.uint16)))
        row["y0_bits"] = np.asarray(y).view(np.uint16)
        row["s"] = timeit(whole, [(x, ex, wt, o) for o in opss])
        if kernels_too:
            full = im._config(cfg)
            grp = full["m_group"] or im.auto_group(*ex.shape, E, full["m_group_max"])
            row["group"] = grp
            meta = block(jax.jit(lambda e, w: im.route_blocks(e, w, E, grp))(ex, wt))
            row["kernels_s"] = timeit(rows, [(x, meta, o, grp) for o in opss])
            common = im._common(x.dtype, full["unpack"] or ("jnp" if interpret else "asm"))
            gu = jax.jit(
                lambda x, m, o: im.gate_up_rows(x, m, im._operands(o), full["gu_block_n"], full, common, interpret, grp)
            )
            dn = jax.jit(
                lambda h, m, o: im.down_rows(
                    h, m, im._operands(o), full["dn_block_n"], full, common, interpret, ex.size, grp
                )
            )
            h = block(gu(x, meta, opss[0]))
            row["gate_up_s"] = timeit(gu, [(x, meta, o) for o in opss])
            row["down_s"] = timeit(dn, [(h, meta, o) for o in opss])
    except Exception as exc:  # noqa: BLE001 - one failing config must not hide the others
        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
    return row


# ---------------------------------------------------------------------------
# Peers
# ---------------------------------------------------------------------------


def _sorted_grouped_ffn(x, ex, wt, w_bf16, E, impl):
    """bf16 experts through a grouped matmul over all E groups (empty groups are not read)."""
    T, k = ex.shape
    flat = ex.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    tok = order // k
    xs = x[tok]
    mm = lambda h, name: grouped_matmul.ragged_dot(h, w_bf16[name], sizes, impl=impl)
    h = jax.nn.silu(mm(xs, "gate")) * mm(xs, "up")
    y = mm(h, "down").astype(jnp.float32) * wt.reshape(-1)[order][:, None]
    return jnp.zeros((T, x.shape[1]), jnp.float32).at[tok].add(y).astype(x.dtype)


def int4_peer_rows(T, ctx, args):
    """The model's INT4 paths (gather, xla) and tokamax's quantized ragged_dot."""
    E, raws, x, ex, wt, ref = ctx["E"], ctx["raws"], ctx["x"], ctx["ex"], ctx["wt"], ctx["ref"]
    rows = []
    for impl in ("gather", "xla"):
        f = jax.jit(lambda x, e, w, r, impl=impl: expert_ffn(x, e, w, r, E, impl))
        row = {"impl": impl, "T": T}
        try:
            row["rel_err"] = rel_err(np.asarray(block(f(x, ex, wt, raws[0])).astype(jnp.float32)), ref)
            row["s"] = timeit(f, [(x, ex, wt, r) for r in raws], target_s=args.peer_seconds)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    if grouped_matmul.tokamax_unavailable_reason() is None:
        row = {"impl": "tokamax_int4", "T": T}
        try:  # raises ValueError at once where the Mosaic kernel rejects the operands
            grouped_matmul.ragged_dot_int4(x, raws[0]["gate"], jnp.zeros((E,), jnp.int32), impl="tokamax")
            f = jax.jit(lambda x, e, w, r: expert_ffn(x, e, w, r, E, "tokamax"))
            row["rel_err"] = rel_err(np.asarray(block(f(x, ex, wt, raws[0])).astype(jnp.float32)), ref)
            row["s"] = timeit(f, [(x, ex, wt, r) for r in raws], target_s=args.peer_seconds)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        rows.append(row)
    return rows


def bf16_peer_row(T, ctx, w_bf16, args):
    """tokamax's Mosaic GPU grouped matmul on the same experts dequantized to bf16."""
    E, x, ex, wt, ref = ctx["E"], ctx["x"], ctx["ex"], ctx["wt"], ctx["ref"]
    f = jax.jit(lambda x, e, w, wb: _sorted_grouped_ffn(x, e, w, wb, E, "tokamax"))
    row = {"impl": "tokamax_bf16", "T": T, "bytes_factor": ctx["bf16_factor"]}
    try:
        row["rel_err"] = rel_err(np.asarray(block(f(x, ex, wt, w_bf16)).astype(jnp.float32)), ref)
        row["s"] = timeit(f, [(x, ex, wt, w_bf16)], target_s=args.peer_seconds)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def tinygemm_rows(tokens, n_sets=3, N=32768, Kdim=7168):
    """torch's tinygemm INT4 (group 32) on a dense N x K matrix at M = T; TB/s over its bytes."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return [{"impl": "tinygemm", "T": T, "error": f"torch not importable: {exc}"} for T in tokens]
    if not torch.cuda.is_available():
        return [{"impl": "tinygemm", "T": T, "error": "torch sees no CUDA device"} for T in tokens]
    rows = []
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(int.from_bytes(os.urandom(4), "little"))
    mats = []
    try:
        for _ in range(n_sets):
            q = torch.randint(0, 16, (N, Kdim), dtype=torch.int32, device=dev, generator=gen)
            w_u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)  # even element in the high nibble
            packed = torch._convert_weight_to_int4pack(w_u8, 8)
            scale = (torch.rand((Kdim // 32, N), device=dev, generator=gen) * 0.01 + 0.005).to(torch.bfloat16)
            sz = torch.stack([scale, torch.zeros_like(scale)], dim=-1).contiguous()  # [K/32, N, 2]
            mats.append((q, packed, sz))
        nbytes = N * Kdim // 2 + 2 * (Kdim // 32) * N * 2
        for T in tokens:
            row = {"impl": "tinygemm", "T": T, "bytes": nbytes}
            try:
                x = torch.randn((T, Kdim), device=dev, generator=gen).to(torch.bfloat16)
                q, packed, sz = mats[0]
                out = torch._weight_int4pack_mm(x, packed, 32, sz)
                deq = (q.float() - 8.0) * sz[..., 0].float().repeat_interleave(32, dim=0).T
                ref = x.float() @ deq.T
                row["rel_err"] = float((out.float() - ref).norm() / ref.norm())
                del deq, ref
                for _ in range(3):
                    for _, p, s in mats:
                        torch._weight_int4pack_mm(x, p, 32, s)
                torch.cuda.synchronize()
                ts = []
                for _ in range(5):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(10):
                        for _, p, s in mats:
                            torch._weight_int4pack_mm(x, p, 32, s)
                    end.record()
                    torch.cuda.synchronize()
                    ts.append(start.elapsed_time(end) / 1e3 / (10 * len(mats)))
                row["s"] = statistics.median(ts)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return [{"impl": "tinygemm", "T": T, "error": f"{type(exc).__name__}: {exc}"[:300]} for T in tokens]
    finally:
        del mats
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def build_ctx(args, E, D, F, T, raws, opss, seed):
    rng = np.random.default_rng(seed + T)
    ex, wt = routing(rng, T, E, args.global_experts, args.repeat_token)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32).astype(jnp.bfloat16)
    raw32 = {k: v.replace(scale=v.scale.astype(jnp.float32)) for k, v in raws[0].items()}
    ref_fn = jax.jit(lambda x, e, w, r: gathered_expert_ffn(x, e, w, r, E))
    ref = np.asarray(block(ref_fn(x.astype(jnp.float32), ex, wt, raw32)))
    local = np.asarray(ex)[(np.asarray(ex) >= 0) & (np.asarray(ex) < E)]
    touched = len(np.unique(local))
    return {
        "E": E,
        "raws": raws,
        "opss": opss,
        "x": x,
        "ex": ex,
        "wt": wt,
        "ref": ref,
        "touched": touched,
        "bytes": touched * per_expert_bytes(raws[0]),
        "bf16_factor": (3 * D * F * 2) / per_expert_bytes(raws[0]),
    }


def fmt_table(rows):
    out = [
        (
            f"{'T':>4} {'impl':>13} {'config':>12} {'experts':>7} {'ms':>8} {'TB/s':>6} {'kern ms':>8} "
            f"{'kern TB/s':>9} {'rel err':>8} {'inv':>4}  note"
        )
    ]
    for r in rows:
        ms = r.get("s", float("nan")) * 1e3
        tb = r["bytes"] / r["s"] / 1e12 if "s" in r and "bytes" in r else float("nan")
        kms = r.get("kernels_s", float("nan")) * 1e3
        ktb = r["bytes"] / r["kernels_s"] / 1e12 if "kernels_s" in r and "bytes" in r else float("nan")
        inv = {True: "yes", False: "NO"}.get(r.get("invariant"), "")
        note = r.get("error", "") or (f"compile {r['compile_s']} s" if "compile_s" in r else "")
        if "group" in r:
            note += f"; {r['group']} block(s)/program"
        if "gate_up_s" in r:
            gu_b, dn_b = r["bytes"] * 2 / 3, r["bytes"] / 3
            note += (
                f"; gate_up {r['gate_up_s'] * 1e3:.3f} ms {gu_b / r['gate_up_s'] / 1e12:.2f} TB/s, "
                f"down {r['down_s'] * 1e3:.3f} ms {dn_b / r['down_s'] / 1e12:.2f} TB/s"
            )
        if r.get("bytes_factor"):
            note = f"bytes = bf16 weights ({r['bytes_factor']:.2f}x the INT4 bytes)"
        out.append(
            f"{r['T']:>4} {r['impl']:>13} {r.get('config', ''):>12} {r.get('experts', ''):>7} {ms:>8.3f} "
            f"{tb:>6.2f} {kms:>8.3f} {ktb:>9.2f} {r.get('rel_err', float('nan')):>8.1e} {inv:>4}  {note}"
        )
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=48, help="local experts (48 = one device's share of 8; 384 = all)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 512])
    p.add_argument(
        "--global-experts",
        type=int,
        help="route top-8 of this many experts and keep the busiest device's (e.g. 384 with --experts 48)",
    )
    p.add_argument(
        "--repeat-token", action="store_true", help="every token routed as token 0 (all tokens share their experts)"
    )
    p.add_argument("--sets", type=int, default=3, help="weight sets rotated while timing")
    p.add_argument("--sweep", action="store_true", help="check and time the kernel configurations in SWEEP")
    p.add_argument("--sweep-tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    p.add_argument("--sweep-only", nargs="*", default=None, help="subset of SWEEP names")
    p.add_argument("--bench", action="store_true", help="with --sweep: then the full table with the best config")
    p.add_argument("--config", type=json.loads, default=None, help="JSON overrides of int4_moe.DEFAULT_CONFIG")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--peer-seconds", type=float, default=0.4)
    p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU smoke test)")
    p.add_argument("--json", default=None)
    p.add_argument("--seed", type=int, default=None, help="weights and routing (default: random, printed)")
    p.add_argument(
        "--calls-only",
        action="store_true",
        help="time whole calls only, not the two kernels apart as well (about half the compiles per row: more "
        "configurations per GPU call)",
    )
    p.add_argument(
        "--loop-timing",
        action="store_true",
        help="time our kernels inside one compiled loop (device time, no dispatch) instead of host-timed calls",
    )
    args = p.parse_args()
    global LOOP_TIMING
    LOOP_TIMING = args.loop_timing

    interpret = args.smoke or jax.default_backend() != "gpu"
    E = args.experts
    D, F = (512, 256) if args.smoke else (KIMI["D"], KIMI["F"])
    if args.smoke:
        E, args.sets = min(E, 8), 1
        args.tokens = [t for t in args.tokens if t <= 5] or [1, 5]
        args.sweep_tokens = [1, 5]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = "?"
    print(
        f"device {jax.devices()[0].device_kind}; jax {jax.__version__}; commit {commit}; E={E} D={D} F={F}; "
        f"interpret={interpret}; kernel {os.path.relpath(im.__file__)}; kernel available: {im.available() or 'yes'}; "
        f"tokamax: {grouped_matmul.tokamax_unavailable_reason() or 'available'}",
        flush=True,
    )
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}", flush=True)
    key = jax.random.key(seed)
    raws = [make_layer(jax.random.fold_in(key, s), E, D, F) for s in range(args.sets)]
    relayout = jax.jit(im.relayout)
    opss = [block(relayout(r)) for r in raws]
    print(
        f"per expert {per_expert_bytes(raws[0]) / 1e6:.2f} MB (INT4 words + bf16 scales, 3 projections); "
        f"{args.sets} sets of {E} experts",
        flush=True,
    )
    results = []

    cfg = args.config
    if args.sweep:
        names = args.sweep_only or list(SWEEP)
        sweep_rows = []
        bits = {}
        for T in args.sweep_tokens:
            ctx = build_ctx(args, E, D, F, T, raws, opss, seed)
            for name in names:
                row = check_and_time_ours(name, SWEEP[name], T, ctx, interpret, not args.calls_only)
                row.update(bytes=ctx["bytes"], experts=ctx["touched"])
                bits[(name, T)] = row.pop("y0_bits", None)
                sweep_rows.append(row)
                print(fmt_table([row]).split("\n")[1], flush=True)
        # Same numbers from different code paths are a check of each (asm vs jnp unpack; unrolled K loop).
        for ref_name, other in (
            ("base", "unpack_jnp"),
            ("split_np_pre", "split_np_pre_u2"),
            ("split_np_pre", "split_np_pre_dn4"),
        ):
            for T in args.sweep_tokens:
                a, b = bits.get((ref_name, T)), bits.get((other, T))
                if a is not None and b is not None:
                    print(f"T={T}: {ref_name} and {other} outputs bit-identical: {bool(np.array_equal(a, b))}")
        results += sweep_rows
        print("\nsweep:\n" + fmt_table(sweep_rows))
        ok = {}
        for r in sweep_rows:
            good = "s" in r and r.get("rel_err", 1) < 3e-2 and r.get("invariant")
            ok.setdefault(r["config"], []).append(r["bytes"] / r["s"] / 1e12 if good else 0.0)
        best = max(ok, key=lambda n: (min(ok[n]), statistics.mean(ok[n])))
        print(f"best config by the smallest TB/s over T: {best} {SWEEP[best]} ({min(ok[best]):.2f} TB/s)")
        cfg = SWEEP[best]
        if not args.bench:
            _write(args.json, results, commit)
            return

    rows = []
    for T in args.tokens:
        ctx = build_ctx(args, E, D, F, T, raws, opss, seed)
        row = check_and_time_ours("best" if args.sweep else "default", cfg, T, ctx, interpret, not args.calls_only)
        row.pop("y0_bits", None)
        row.update(bytes=ctx["bytes"], experts=ctx["touched"])
        rows.append(row)
        print(fmt_table([row]).split("\n")[1], flush=True)
        if not args.no_peers:
            for pr in int4_peer_rows(T, ctx, args):
                pr.update(bytes=ctx["bytes"], experts=ctx["touched"])
                rows.append(pr)
                print(fmt_table([pr]).split("\n")[1], flush=True)
    if not args.no_peers and not interpret and grouped_matmul.tokamax_unavailable_reason() is None:
        # bf16 experts for the tokamax peer: one set (its touched bytes alone are far beyond the L2)
        deq = jax.jit(lambda w: jnp.swapaxes(w.dequant(jnp.bfloat16), 1, 2))
        w_bf16 = {n: block(deq(raws[0][n])) for n in ("gate", "up", "down")}
        for T in args.tokens:
            ctx = build_ctx(args, E, D, F, T, raws, opss, seed)
            pr = bf16_peer_row(T, ctx, w_bf16, args)
            pr.update(bytes=ctx["bytes"] * pr["bytes_factor"], experts=ctx["touched"])
            rows.append(pr)
            print(fmt_table([pr]).split("\n")[1], flush=True)
        del w_bf16
    if not args.no_peers and not interpret:
        for r in tinygemm_rows(args.tokens):
            rows.append(r)
            print(fmt_table([r]).split("\n")[1], flush=True)
    results += rows
    rows.sort(key=lambda r: (r["T"], r["impl"]))
    print("\n" + fmt_table(rows))
    _write(args.json, results, commit)


def _write(path, results, commit):
    if not path:
        return
    clean = [{k: v for k, v in r.items() if not isinstance(v, np.ndarray)} for r in results]
    with open(path, "w") as fh:
        json.dump(
            {
                "commit": commit,
                "device": jax.devices()[0].device_kind,
                "jax": jax.__version__,
                "argv": sys.argv[1:],
                "rows": clean,
            },
            fh,
            indent=1,
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
