"""What the INT4 gate/up kernel's access pattern can draw from memory, apart from its arithmetic.

    python scripts/probe_int4_loads.py [--tokens 1] [--global-experts 384] [--forms NAME=JSON ...]
    python scripts/probe_int4_loads.py --smoke        # CPU: tiny shapes, interpret mode

At T = 1 on one device's share of 8 (top-8 of 384 experts, the busiest device's kept: 2 experts touched) the
gate/up kernel (`int4_moe.gate_up_rows`) moves 33 MB in ~25 us on an H100, 39% of DRAM's peak, while ncu finds
no unit of the SM saturated (docs/PERFORMANCE.md, run 47). Twice the programs (a K tree of 4) timed no faster.
This probe separates the two halves of the kernel. Each form is one Pallas call on the kernel's grid (output
tiles x block slots x K-tree programs, the unused slots' programs returning at once, as in the kernel), timed
in one compiled loop with the loop's own cost fitted away (`jaxspec.timing.chain_time`), over the touched
experts' gate and up bytes (words and scales), with weight sets rotated so that DRAM, not the L2, is read:

* ``"kernel"``: the kernel itself (`gate_up_rows`, with ``config``: overrides of `int4_moe.DEFAULT_CONFIG`);
* ``"loads"``: a program with the kernel's loads and tensor-core products but no unpack: each K step loads the
  gate and up word tiles ``[bn, 32]`` and scale tiles ``[bn, 4]`` of its K block and ``x`` loads of the block's
  16 gathered token rows (32 inputs each), and runs the kernel's 16 products ``[bn, 32] x [32, 16]`` on the
  words (XORed with the scales, masked to finite values and converted, a few instructions a word) instead of
  the unpacked planes, so Triton pipelines the loads as in the kernel (loads that feed no product it does not
  pipeline): the ceiling of the loads and products;
* ``"unpack"``: the same with the kernel's unpack (`int4_moe._planes`) feeding the products: the kernel's K
  loop without its K tree's partials, its finish and its SiLU-multiply.

The loads and unpack forms take ``bn``, ``warps``, ``stages``, ``programs`` (K-tree programs a tile; each walks
D / 256 / programs K blocks), ``x`` (activation loads a K step: 8 as the kernel, one a plane; 0 none) and
``layout``: ``"kblock"`` (the kernel's ``[E, K/256, N, 32]`` words: a K step's tiles of all programs side by
side) or ``"tile"`` (the same bytes seen as ``[E, N/bn, K/256, bn, 32]``: each program's stream contiguous), and
``live_first`` (the K-tree part on grid axis 1 and the block slots on the slowest, so every part's live programs
launch before any dead slot's: the kernel's ``live_first``), ``steps`` (each program walks only the first this many
of its K blocks: loops of 14, 7 and 3 steps on the same grid tell a loop's fixed part from its cost a step; the
TB/s divide the bytes read), and ``stamps`` (true: each live program reads the GPU's global timer at its start and
after its K loop, and the SM it ran on; the row adds when the programs started after the first, how long their
loops took and how many live programs each SM held: the call's timeline, twice: "cold" on a weight set the last
calls did not read, then "hot" on the same set again, as much of it in the L2 as fits).
A "loads" form near the read ceiling leaves the kernel's gap to its arithmetic; one near the kernel's time
puts it in the access pattern, which the knobs then explore. The read row is XLA's sum over as many bytes (a
fused read; an elementwise copy whose result only feeds the chain would be cut down to the element it uses).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_grouped_matmul import make_layer, routing  # noqa: E402

from jaxspec import timing  # noqa: E402
from jaxspec.kernels import int4_moe as im  # noqa: E402

try:  # the Triton lowering's masked loads and compiler parameters (GPU builds)
    from jax.experimental.pallas import triton as plgpu
except Exception:  # noqa: BLE001 - optional
    plgpu = None

LOADS_DEFAULT = {
    "bn": 32,
    "warps": 2,
    "stages": 3,
    "programs": 2,
    "x": 8,
    "layout": "kblock",
    "live_first": False,
    "stamps": False,
    "steps": None,
}
"""The kernel's own shape at T = 1 on the share (`int4_moe.DEFAULT_CONFIG`: BN 32, 2 warps, 3 stages, a K tree of
2 leaves on 2 programs)."""

FORMS = {
    "kernel": {"what": "kernel"},
    "loads": {"what": "loads"},
    "unpack": {"what": "unpack"},
    "loads_x0": {"what": "loads", "x": 0},
    "loads_s2": {"what": "loads", "stages": 2},
    "loads_s5": {"what": "loads", "stages": 5},
    "loads_p1": {"what": "loads", "programs": 1},
    "loads_p4": {"what": "loads", "programs": 4},
    "loads_w4": {"what": "loads", "warps": 4},
    "loads_bn64w4": {"what": "loads", "bn": 64, "warps": 4},
    "loads_bn16w1": {"what": "loads", "bn": 16, "warps": 1},
    "loads_tile": {"what": "loads", "layout": "tile"},
}
"""The default sweep, in order."""


def form_config(spec: dict) -> dict:
    """A form's full settings: ``what`` and, for loads / unpack, `LOADS_DEFAULT` with the form's overrides."""
    what = spec.get("what")
    if what == "kernel":
        unknown = set(spec) - {"what", "config"}
    elif what in ("loads", "unpack"):
        unknown = set(spec) - {"what"} - set(LOADS_DEFAULT)
    else:
        raise ValueError(f"form: 'what' must be 'kernel', 'loads' or 'unpack', found {what!r}")
    if unknown:
        raise ValueError(f"form {spec}: unknown keys {sorted(unknown)}")
    if what == "kernel":
        return {"what": what, "config": dict(spec.get("config") or {})}
    cfg = dict(LOADS_DEFAULT, **{k: v for k, v in spec.items() if k != "what"}, what=what)
    if cfg["layout"] not in ("kblock", "tile"):
        raise ValueError(f"form {spec}: layout must be 'kblock' or 'tile', found {cfg['layout']!r}")
    if cfg["x"] not in (0, 1, im.PLANES):
        raise ValueError(f"form {spec}: x (activation loads a K step) must be 0, 1 or {im.PLANES}, found {cfg['x']}")
    if cfg["steps"] is not None and (not isinstance(cfg["steps"], int) or cfg["steps"] < 1):
        raise ValueError(f"form {spec}: steps must be a positive number of K blocks or null, found {cfg['steps']!r}")
    return cfg


def _steps(cfg, kblocks: int) -> int:
    """The K blocks a program of the form walks: its part's ``kblocks / programs``, or the form's ``steps``."""
    kcount = kblocks // cfg["programs"]
    if cfg["steps"] is None:
        return kcount
    if cfg["steps"] > kcount:
        raise ValueError(f"steps={cfg['steps']} exceeds a program's {kcount} K blocks ({cfg['programs']} programs)")
    return cfg["steps"]


def _view(w, cfg):
    """A word array ``[E, K/256, N, 32]`` as the form reads it (the tile layout: the same bytes reshaped)."""
    if cfg["layout"] == "kblock":
        return w
    E, KB, N, W = w.shape
    return w.reshape(E, N // cfg["bn"], KB, cfg["bn"], W)


STAMPS = 3
"""A program's stamps: the global timer's low word (ns) at its start and after its K loop, and its SM's id."""


def _special(register, like, interpret):
    """A PTX special register (``"globaltimer_lo"``: the GPU's timer in ns, low 32 bits; ``"smid"``) as an int32
    pair ``[2]`` holding the same value twice, read where the program reaches this point: inline PTX whose operand
    (``like``, an int32 scalar the program computes there) keeps it from being hoisted. Each element is one
    instance of the asm (no packing), so no word order is involved: run 48's form packed the timer's two words
    into one instance, and on the device the words came back in the other order (decoded, run 49's first
    timeline gave starts 32 ns apart as 2**32 ns apart). Interpret mode: zeros."""
    if interpret:
        return jnp.zeros((2,), jnp.int32)
    (t,) = plgpu.elementwise_inline_asm(
        f"mov.u32 $0, %{register};",
        args=[jnp.broadcast_to(like, (2,))],
        constraints="=r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct((2,), jnp.int32)],
    )
    return t


def _probe_kernel(
    rows_ref,
    expert_ref,
    packed_ref,
    x_ref,
    gw_ref,
    gs_ref,
    uw_ref,
    us_ref,
    o_ref,
    d_ref,
    st_ref,
    *,
    cfg,
    kcount,
    steps,
    interpret,
):
    """One program: the kernel's K loop over the first ``steps`` of its ``kcount`` K blocks with the form's
    weights for the products. Writes the fold of the word and scale tiles it loaded (``o_ref``, checked), the
    products' row sums (``d_ref``) and, with ``stamps``, the global timer at its start and after its K loop and
    its SM (``st_ref``: `STAMPS` pairs). (A stamp after the stores would need an operand that only the stores
    give; the compiler folds one that does not depend on them into the first stamp.)"""
    slot, tile, part = im._grid_ids(cfg["programs"], cfg["live_first"])
    bn, dtype = cfg["bn"], x_ref.dtype

    @pl.when(rows_ref[slot] > 0)
    def _():
        count = rows_ref[slot]
        stamps = [_special("globaltimer_lo", count, interpret)] if cfg["stamps"] else []
        e = expert_ref[slot]
        n0 = tile * bn
        kb0 = part * kcount
        tok = packed_ref[0, pl.ds(slot * im.BLOCK_M, im.BLOCK_M)]
        cols = jax.lax.broadcasted_iota(jnp.int32, (im.BLOCK_M, im.GROUP), 1)
        live = jax.lax.broadcasted_iota(jnp.int32, (im.BLOCK_M, im.GROUP), 0) < count
        rows_idx = jnp.broadcast_to(tok[:, None], (im.BLOCK_M, im.GROUP))
        unpack = "jnp" if dtype == jnp.float32 else "asm"

        def words(ref, kb):
            if cfg["layout"] == "kblock":
                return ref[e, kb, pl.ds(n0, bn), :]
            return ref[e, tile, kb, :, :]

        def body(i, carry):
            fold, sfold, acc = carry
            kb = kb0 + i
            projections = []
            for w_ref, s_ref in ((gw_ref, gs_ref), (uw_ref, us_ref)):
                w = words(w_ref, kb)
                s = s_ref[e, kb, pl.ds(n0, bn), :]
                fold, sfold = fold ^ w, sfold ^ s
                pairs = tuple(q.reshape(bn) for q in jnp.split(s, 4, axis=1))
                if cfg["what"] == "unpack":
                    projections.append(im._planes(w, pairs, dtype, unpack))
                else:  # the words and scales as the products' operand with one XOR and a convert: no unpack
                    mixed = w ^ (pairs[0] ^ pairs[1] ^ pairs[2] ^ pairs[3])[:, None]
                    finite = jax.lax.bitcast_convert_type(mixed & 0x3FFFFFFF, jnp.float32)  # below 2 for any bits
                    t = finite.astype(dtype)
                    projections.append([t] * im.PLANES)
            acts = [
                plgpu.load(x_ref.at[rows_idx, cols + kb * im.K_BLOCK + p * im.GROUP], mask=live, other=0)
                for p in range(cfg["x"])
            ] or [jnp.ones((im.BLOCK_M, im.GROUP), dtype)]
            for p in range(im.PLANES):
                for planes in projections:
                    acc = acc + im._dot_t(planes[p], acts[p % len(acts)].astype(dtype), dtype)
            return fold, sfold, acc

        init = (
            jnp.zeros((bn, im.GROUP), jnp.int32),
            jnp.zeros((bn, 4), jnp.int32),
            jnp.zeros((bn, im.BLOCK_M), jnp.float32),
        )
        fold, sfold, acc = jax.lax.fori_loop(0, steps, body, init)
        if stamps:  # after the loop: its result in hand
            done = count + (jnp.sum(acc) != 0).astype(jnp.int32)
            stamps += [_special("globaltimer_lo", done, interpret), _special("smid", done, interpret)]
        o_ref[part, slot, pl.ds(n0, bn)] = jnp.sum(fold, axis=1) + jnp.sum(sfold, axis=1)  # int32 sums wrap
        d_ref[part, slot, pl.ds(n0, bn)] = jnp.sum(acc, axis=1)
        if stamps:
            for i, t in enumerate(stamps):
                st_ref[part, slot, tile, pl.ds(2 * i, 2)] = t


def probe_call(cfg, x, meta, ops, interpret=False):
    """One "loads" / "unpack" form over the call's metadata: ``(fold, sums, stamps)``: the fold of the word and
    scale tiles each program loaded (int32 ``[programs, slots, F]``, `expected_fold`), its products' row sums
    (float32, the same shape) and, with ``stamps``, its stamps (int32 ``[programs, slots, F / bn, 2 * STAMPS]``,
    `timeline`); the unused slots' rows are not written."""
    E, KB, F, _ = ops["gate_w"].shape
    bn, programs = cfg["bn"], cfg["programs"]
    if KB % programs or F % bn:
        raise ValueError(f"programs={programs} must divide the {KB} K blocks and bn={bn} the {F} rows")
    slots = meta["rows"].shape[0]
    grid = im._grid(slots, F // bn, programs, cfg["live_first"])
    params = None if interpret else plgpu.CompilerParams(num_warps=cfg["warps"], num_stages=cfg["stages"])
    return pl.pallas_call(
        functools.partial(_probe_kernel, cfg=cfg, kcount=KB // programs, steps=_steps(cfg, KB), interpret=interpret),
        out_shape=(
            jax.ShapeDtypeStruct((programs, slots, F), jnp.int32),
            jax.ShapeDtypeStruct((programs, slots, F), jnp.float32),
            jax.ShapeDtypeStruct((programs, slots, F // bn, 2 * STAMPS), jnp.int32),
        ),
        grid=grid,
        interpret=interpret,
        compiler_params=params,
        name="int4_probe_" + cfg["what"],
    )(
        meta["rows"],
        meta["expert"],
        meta["packed"],
        x,
        _view(ops["gate_w"], cfg),
        ops["gate_s"],
        _view(ops["up_w"], cfg),
        ops["up_s"],
    )


def expected_fold(cfg, meta, ops) -> np.ndarray:
    """A form's fold in numpy (the check that it loads every tile a kernel program loads): per live slot, K-tree
    program and row n, the XOR over the program's K blocks (its first ``steps``) of row n of the word and scale
    tiles (gate and up), summed over the columns with int32 wraparound."""
    rows, expert = np.asarray(meta["rows"]), np.asarray(meta["expert"])
    gs, us = np.asarray(ops["gate_s"]), np.asarray(ops["up_s"])
    E, KB, F, W = ops["gate_w"].shape
    programs = cfg["programs"]
    views = [np.asarray(_view(ops[k], cfg)) for k in ("gate_w", "up_w")]

    def words(view, e, kb):  # [F, 32]: the word tiles the programs of expert e read at K block kb
        return view[e, kb] if cfg["layout"] == "kblock" else view[e, :, kb].reshape(F, W)

    kcount, steps = KB // programs, _steps(cfg, KB)
    out = np.zeros((programs, rows.shape[0], F), np.int32)
    for slot in np.flatnonzero(rows > 0):
        e = expert[slot]
        for part in range(programs):
            acc, sacc = np.zeros((F, W), np.int32), np.zeros((F, 4), np.int32)
            for view, s in zip(views, (gs, us)):
                for kb in range(part * kcount, part * kcount + steps):
                    acc ^= words(view, e, kb)
                    sacc ^= s[e, kb]
            with np.errstate(over="ignore"):
                out[part, slot] = acc.sum(axis=1, dtype=np.int32) + sacc.sum(axis=1, dtype=np.int32)
    return out


def timeline(stamps, rows) -> str:
    """A line on the live programs' stamps ``[programs, slots, tiles, 2 * STAMPS]`` (`_special` pairs: timer at the
    start, timer after the K loop, SM id): starts after the first program's (median, 90th percentile, last), K-loop
    durations (min, median, max), the last loop's end after the first start, in us; then how many live programs
    each SM held (min / median / max over the SMs that held any) and the median K loop of the programs on SMs
    holding each count. The timer's low word wraps every 4.3 s: times are differences modulo 2**32."""
    st = np.asarray(stamps)[:, np.asarray(rows) > 0].reshape(-1, 2 * STAMPS)[:, ::2].astype(np.int64) & 0xFFFFFFFF
    if not st.size or not st[:, :2].any():
        return "no stamps (interpret mode)"
    start, end, sm = st[:, 0], st[:, 1], st[:, 2]
    rel = (start - start[0] + 2**31) % 2**32 - 2**31  # signed ns from the first listed program's start
    rel -= rel.min()
    loop = (end - start) % 2**32
    finish = rel + loop
    us = lambda a: a / 1e3  # noqa: E731
    sms, per = np.unique(sm, return_counts=True)
    held = per[np.searchsorted(sms, sm)]  # live programs on this program's SM
    by = ", ".join(f"{c}: {us(np.median(loop[held == c])):.2f}" for c in np.unique(held))
    return (
        f"{start.size} programs; start +{us(np.median(rel)):.2f} / +{us(np.percentile(rel, 90)):.2f} / "
        f"+{us(rel.max()):.2f} us (median / p90 / last); K loop {us(loop.min()):.2f} / {us(np.median(loop)):.2f} / "
        f"{us(loop.max()):.2f} us; last loop ends +{us(finish.max()):.2f} us; {sms.size} SMs, "
        f"{per.min()} / {np.median(per):g} / {per.max()} live programs an SM; median K loop by programs on "
        f"its SM: {by} us"
    )


def form_bytes(cfg, nbytes: int, kblocks: int) -> int:
    """The bytes a form's call reads of the ``nbytes`` the kernel reads: all, or ``steps`` of every program's
    K blocks."""
    if cfg["what"] == "kernel" or cfg["steps"] is None:
        return nbytes
    return nbytes * _steps(cfg, kblocks) * cfg["programs"] // kblocks


def _bytes(ops, live_experts: int) -> int:
    per = sum(int(ops[k][0].size) * ops[k].dtype.itemsize for k in ("gate_w", "gate_s", "up_w", "up_s"))
    return per * live_experts


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--experts", type=int, default=48, help="local experts")
    p.add_argument("--global-experts", type=int, default=384, help="route top-8 of these, keep the busiest device's")
    p.add_argument("--forms", nargs="+", help="NAME=JSON forms, or names of the default sweep; default: the sweep")
    p.add_argument("--sets", type=int, default=4, help="weight sets rotated (together larger than the L2)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU), each form checked")
    args = p.parse_args()
    interpret = args.smoke or jax.default_backend() != "gpu"
    if plgpu is None:
        p.error("jax.experimental.pallas.triton is not importable")
    forms = {}
    for item in args.forms or list(FORMS):
        name, _, spec = item.partition("=")
        try:
            forms[name] = form_config(json.loads(spec) if spec else FORMS[name])
        except (KeyError, ValueError) as exc:
            p.error(f"--forms {item!r}: {exc}")
    E, D, F = (8, 1024, 256) if args.smoke else (args.experts, 7168, 2048)
    G = 32 if args.smoke else args.global_experts
    dtype = jnp.float32 if interpret else jnp.bfloat16
    rng = np.random.default_rng(args.seed + args.tokens)
    ex, wt = routing(rng, args.tokens, E, G)
    x = jnp.asarray(rng.normal(size=(args.tokens, D)), jnp.float32).astype(dtype)
    meta = jax.jit(lambda e, w: im.route_blocks(e, w, E, 1))(ex, wt)
    sets = 1 if args.smoke else args.sets
    opss = [
        jax.block_until_ready(im._operands(im.relayout(make_layer(jax.random.key(args.seed + i), E, D, F))))
        for i in range(sets)
    ]
    live_slots = np.asarray(meta["rows"]) > 0
    live = int(np.count_nonzero(live_slots))
    nbytes = _bytes(opss[0], len(np.unique(np.asarray(meta["expert"])[live_slots])))  # an expert's bytes once
    print(
        f"device {jax.devices()[0].device_kind}; jax {jax.__version__}; interpret={interpret}; T={args.tokens}, "
        f"{live} live slots, {nbytes / 1e6:.1f} MB of gate/up a call",
        flush=True,
    )

    def timed(fn, arg_sets):
        def step(_, a, x):
            return timing.feed(x, jax.tree.leaves(fn(x, a))[0])

        return timing.chain_time(step, x, arg_sets, reps=args.reps).per_call

    def row(name, t, tbs, note):
        settings = json.dumps({k: v for k, v in forms[name].items()}) if name in forms else ""
        return f"{name:28s} {t * 1e6:8.2f} {tbs:6.2f}  {settings} {note}"

    results = []
    if not interpret:  # XLA's read of as many bytes: a sum, whose one result the next call depends on
        bigs = [(jnp.full((nbytes // 4,), i, jnp.int32),) for i in range(sets)]
        read = timed(lambda x, a: jnp.sum(a[0] ^ (1 + (x[0, 0].astype(jnp.float32) * 0).astype(jnp.int32))), bigs)
        results.append(("read (XLA sum)", read, nbytes / read / 1e12 if read else 0.0, ""))
        print("done: " + row(*results[-1]), flush=True)
    for name, cfg in forms.items():
        note = ""
        try:
            if cfg["what"] == "kernel":
                full = im._config(cfg["config"])
                common = im._common(dtype, full["unpack"] or ("jnp" if interpret else "asm"))

                def fn(x, a, full=full, common=common):
                    return im.gate_up_rows(
                        x, meta, a[0], full["gu_block_n"], full, common, interpret, tokens=x.shape[0]
                    )

            else:

                def fn(x, a, cfg=cfg):
                    return probe_call(cfg, x, meta, a[0], interpret)

            fn = jax.jit(fn)
            out = jax.block_until_ready(fn(x, (opss[0],)))
            if cfg["what"] != "kernel":
                live_slots = np.asarray(meta["rows"]) > 0  # the unused slots' programs write nothing
                want = expected_fold(cfg, meta, opss[0])
                same = np.array_equal(np.asarray(out[0])[:, live_slots], want[:, live_slots])
                note = "reads match" if same else "READS DIFFER"
            if cfg.get("stamps"):
                for ops in opss[1:] * 2:  # compiled and warm, on the other sets: set 0 out of the L2 (sets >= 4)
                    jax.block_until_ready(fn(x, (ops,)))
                for when in ("cold", "hot"):  # set 0 after the others, then set 0 again
                    out = jax.block_until_ready(fn(x, (opss[0],)))
                    note += f"; {when}: " + timeline(out[2], meta["rows"])
            t = 0.0 if interpret else timed(fn, [(o,) for o in opss])
            read = form_bytes(cfg, nbytes, opss[0]["gate_w"].shape[1])
            results.append((name, t, read / t / 1e12 if t else 0.0, note))
        except Exception as exc:  # noqa: BLE001 - one failing form must not hide the others
            results.append((name, 0.0, 0.0, f"error: {type(exc).__name__}: {str(exc)[:160]}"))
        print("done: " + row(*results[-1]), flush=True)  # a call cut short keeps the rows done so far
    print(f"\n{'form':28s} {'us':>8s} {'TB/s':>6s}  settings / check")
    for result in results:
        print(row(*result))


if __name__ == "__main__":
    main()
