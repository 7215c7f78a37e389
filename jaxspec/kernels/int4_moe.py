"""Fused INT4 (W4A16, group 32) routed-expert kernel: Pallas with the Triton lowering.

``moe_int4(x, experts, weights, ops, num_local=E)`` (``ops``: the layer's ``Int4Weight`` experts in
the ``"tiles"`` layout, from ``relayout``) computes the routed part of a
DeepSeek-V3 / Kimi-K2.5 MoE layer for the experts held locally:

    y[t] = sum_k weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = experts[t, k]

where ids outside ``[0, num_local)`` (other devices' experts) contribute zero. It
runs as two Pallas kernels plus a little XLA glue:

1. Routing metadata (integer only): the (token, k) assignments are grouped by
   expert into blocks of ``BLOCK_M = 16`` rows, as in a grouped matmul. An expert
   with c assignments owns ceil(c / 16) consecutive blocks; experts with no
   assignments own none, so their weights are never read. The static number of
   block slots is ``(T*k + 15 * min(E, T*k)) // 16``; unused slots have zero rows
   and their programs return at once. Up to ``meta_max_assignments`` (512) one Pallas
   program builds it (``kernels.block_routing``), above that XLA, whose launches are
   faster there; both give the same metadata.
   On one device's share of a mesh (``share > 1``, benchmarks) the ids are global and
   the busiest device's experts are kept (``busiest_share``), in that program too.
2. ``gate_up`` kernel, grid (F tile, block slot): for one block (<= 16 rows of one
   expert) and ``BLOCK_N`` rows of the gate and up projections it streams both
   weight tiles over K once, runs the products on the tensor cores
   (``[BLOCK_N, 32] x [32, 16]`` per nibble plane, tokens padded to 16 columns),
   and writes ``h = silu(g) * u`` for those rows to an intermediate ``[slots*16, F]``.
   With ``gu_ksplit = S > 1`` the K loop is S leaves, each summed from zero in ascending
   order and added as a pairwise tree (``tree_sum``); the leaves may be split over up to S
   programs (a third grid axis; ``gu_programs``), each writing its subtree's float32
   partials, and the last program of each tile to store its partials (found by an atomic counter
   that the metadata program zeroes; ``gu_last_finishes``, the default) completes the tree and
   applies the SiLU-multiply, or without it a third small kernel (live blocks only): more, shorter
   programs when a call touches few experts. S follows D
   alone (2 for Kimi's D = 7168, ``default_ksplit``) unless the configuration forces it;
   the program count may follow T, since every count computes the same tree.
   The output tiles run along the fastest launch axis: the slots in use come first, so a call
   that touches few experts launches its live programs contiguously, spread over all
   SMs, rather than strided among the unused slots' programs, which return at once (on
   the H200 0.069 ms against 0.089 with the slots there, at T = 1 on a mesh share). When an expert has more than
   16 assignments, its next block's programs for the same tile are in flight at the
   same time and re-read the weight tile from L2.
3. ``down`` kernel, grid (D tile, block slot): the down projection of ``h``, times
   each row's routing weight, written in float32 to the row of its assignment,
   ``[T*k + 1, D]`` (a scattered row store; padding rows are masked off; the last row
   is a spare that is never written on the GPU). Its K sum is one chain over the K blocks
   in ascending order, unless ``dn_ksplit`` (opt-in, not yet timed on a device) makes it a
   tree of leaves as the gate/up one, over up to that many programs (``dn_programs``) whose
   last to count completes the tree and writes the rows; its counters follow the gate/up ones
   in the array the metadata program zeroes.
4. Combine (XLA): ``y[t] = ((r[t,0] + r[t,1]) + r[t,2]) + ...`` over the k
   assignments of token t in that fixed order, assignments to non-local experts
   replaced by 0 (their rows are never written), cast to the output dtype.

Weight layout (``relayout``, lossless, done once at load time)
-----------------------------------------------------------------
The checkpoint stores each projection as ``packed`` int32 ``[E, N, K/8]`` (element
``8j + i`` of a row in bits ``4i..4i+3`` of word ``j``, offset 8) and ``scale`` bf16
``[E, N, K/32]``. ``relayout`` rewrites them as

* ``w`` int32 ``[E, K/256, N, 32]``: for K block ``b`` (inputs ``256b .. 256b+255``)
  and row ``n``, the 32 words hold the block's 8 planes (scale groups: plane ``p`` is
  inputs ``256b + 32p .. +31``) in column pairs: word ``2m`` holds planes 0-3 of columns
  ``2m`` (nibbles 0-3) and ``2m + 1`` (nibbles 4-7), word ``2m + 1`` the same for planes
  4-7 (``_word_inputs``). So plane ``p`` of the ``[BLOCK_N, 32]`` tile, as the bf16x2
  registers a tensor-core operand holds (two adjacent columns each), is one shift and one
  ``lop3`` of one word per register: no in-kernel reshape or scale broadcast along K.
  A word tile is ``BLOCK_N * 128`` contiguous bytes. (Until 2026-12-04 word ``j`` held
  column ``j`` of all 8 planes, which took a ``prmt`` per register to pair two words'
  nibbles: 8% more instructions a K step, see docs/notes/int4_kernel.md, run 23.)
* ``s`` int32 ``[E, K/256, N, 4]``: word ``q`` of K block ``b`` for row ``n`` holds the
  bf16 bits of the scales of planes ``q`` (low half) and ``q + 4`` (high half). A row's
  four words are 16 contiguous bytes, so a K step loads its scales as one
  ``[BLOCK_N, 4]`` tile (one 16-byte copy per row) and splits it in registers. (An
  earlier ``[E, K/256, 4, N]`` order loaded four ``[BLOCK_N]`` vectors per step, which
  Triton copied 4 bytes at a time with an address each: 72 more instructions per warp
  and K step and 193 instead of 127 registers in a local sm_90 compile.)

``restore`` inverts it bit for bit. The bytes are the same as the checkpoint's, so
the re-layout costs no memory beyond the one layer being converted.

Unpack
------
Two formulations with the same numbers, chosen statically:

* ``"jnp"`` (interpret mode, float32, any backend): the tile split into its even and odd
  words, plane ``p``'s two columns of a pair as nibbles ``p % 4`` and ``p % 4 + 4`` of one of
  them, joined, minus 8, converted to the activation dtype.
* ``"asm"`` (GPU, bf16 activations): inline PTX on pairs of words (``pack=2``; Pallas'
  inline asm has one result, so one call per plane): the tile shifted right by 4 (p % 4)
  (three shifted copies serve the 8 planes), one ``lop3`` computes ``(w & 0x000F000F) |
  0x43004300`` on the pair's even (p < 4) or odd word (two bf16 numbers ``128 + nibble``), one
  ``fma.rn.bf16x2 t * 1 - 136`` makes them ``nibble - 8`` exactly. About 0.9 instructions
  per weight, against ~3 for shift/mask/convert/subtract ("jnp" on the GPU: 1.6-1.9x slower
  kernels).

Both give the exact integers -8..7 as bf16. The group scale is then folded into the bf16
weights before each plane's dot: ``(nibble - 8) * s`` rounded once to bf16, exactly what a
dequantize-to-bf16 gives (one more ``fma.rn.bf16x2`` per pair). Applying it to each plane's
float32 product instead measured 3-5% slower and was removed.

An "offset" form (planes of ``128 + nibble``, the offset taken off after the K loop by a
product of the scales with the rows' group sums) had fewer instructions in a local compile but
measured 1.5x slower on the H200 (255 registers) and was removed; ``docs/notes/int4_kernel.md``.

Batch invariance
----------------
A token's output does not depend on T or on which other tokens share its experts:

* Every block size is a constant (``BLOCK_M = 16`` token rows, ``BLOCK_N``, the K block
  of 256, ``num_warps``, ``num_stages``), never a function of T, so the same MMA
  instructions run in the same order for every T.
* Each output element ``[row n, token column m]`` of a block's product depends only on
  weight row n and that token's activations: its K reduction runs over the K blocks
  in ascending order and, inside a block, over the 8 planes in ascending order, each
  plane a fixed-shape ``[BLOCK_N, 32] x [32, 16]`` tensor-core product whose
  accumulation order over its 32 inputs is fixed by the instruction and does not
  depend on the other columns (the other tokens) or on which column the token is in.
  Padding columns are zero activations and never mix into other columns. With a K
  split (``gu_ksplit`` = S > 1; Kimi's gate/up default S = 2) the S leaf
  sums are added as one fixed pairwise tree, and S follows the layer's shape (or the
  configuration), never T. How many programs share the tree may follow T: a program
  sums a whole subtree (a power-of-two run of leaves, or all of them) and the combine kernel
  or a tile's last program adds the subtrees in the same tree, so every count gives the same bits
  (the configuration must be the same for every call of a deployment).
* The routing-weight multiply is per row, and the sum over a token's k experts is a
  chain of float32 adds in k order in XLA (elementwise adds are not reassociated).
  No atomic adds into a result: the one atomic (``gu_last_finishes``) only counts the programs of a
  tile that are done, and the last one adds the stored partials in the tree's fixed order.

On the GPU the same argument holds for the compiled kernel: the Triton program is
one binary per (shape, config), the config is fixed, every product is the same
tensor-core instruction sequence on the same K order (``mma.sync m16n8k16`` at the
default gate/up tile of 32 rows and 2 warps, ``wgmma m64n16k16`` at 64 rows and 4
warps, the down kernel's default), and a tensor-core MMA computes each
output element with a datapath that does not see the other columns. Handling several
16-row blocks of one expert in one program (``m_group``) only shares the unpacked
weights between blocks; each block's dots are unchanged, so the bits are too. The CPU
tests check it bit for bit in float32 in interpret mode (a token alone vs. in batches
of several T, 1, 2 and 4 blocks per program); on an H200 the benchmark checked, for
every configuration and T = 1..512 in bf16, that token 0's output in the batch has the
same bits as token 0 alone.

Performance (H200, one device's share of Kimi-K2.5: 48 experts, D=7168, F=2048)
----------------------------------------------------------------------------------
With the default configuration, whole calls device-timed: 2.4-2.7 TB/s over the touched
experts' bytes at T = 8..64 with all experts local (1.46 at T = 128 with the grid of before,
not re-measured: each expert has several 16-row blocks and every block unpacks the weights
again), and 1.01 / 2.20 / 2.50 TB/s at T = 1 / 4 / 8 on a mesh share (2 / 7 / 12 experts
touched: few programs for the GPU; docs/PERFORMANCE.md, run 24). The kernels are neither at
the memory nor at an ALU roofline; the unpack is about two thirds of their instructions: see
``docs/notes/int4_kernel.md`` for the measurements and what limits them.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxspec import quant
from jaxspec.kernels import block_routing, grouped_matmul, stacked_matmul

try:  # the Triton-specific module; present in jax 0.10 and 0.11
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - depends on the installed jax
    plgpu = None

BLOCK_M = 16
"""Token rows per block (the MMA's N dimension); fixed for batch invariance."""

K_BLOCK = 256
"""Inputs per K step: 32 words x 8 nibble planes, each plane one group of 32."""

GROUP = 32
PLANES = K_BLOCK // GROUP  # 8

PROJECTIONS = ("gate", "up", "down")


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------

DEFAULT_CONFIG: dict[str, Any] = {
    # gate/up kernel
    "gu_block_n": 32,
    "gu_warps": 2,
    "gu_stages": 3,
    # the gate/up pipeline's stages by T: [[t_max, stages], ...], the first pair with T <= t_max, else
    # `gu_stages`. Stages load the same tiles further ahead and leave the products, their order and the K tree
    # as they are (Triton 3.6's sm_90 IR after pipelining has the same dots, adds and multiplies at 3 and 6
    # stages, docs/notes/int4_kernel.md run 52), so they may follow T; the device's probe checks a row alone
    # against the same row in a batch before the kernel is used. More stages also take more shared memory a
    # program (17,408 B a stage past the first at BN 32), which bounds the programs an SM holds: at 6 stages two.
    # Not yet timed on a device.
    "gu_stage_rules": (),
    # down kernel
    "dn_block_n": 64,
    # 2 warps (mma.sync) over 4 (wgmma): 4-6% faster whole calls at T = 8..64 on the H200 (docs/PERFORMANCE.md)
    "dn_warps": 2,
    "dn_stages": 3,
    # None: "asm" on GPU with bf16 activations, else "jnp"
    "unpack": None,
    # 16-row blocks of one expert per program (weights unpacked once for all); None: auto_group(T)
    "m_group": None,
    # cap of auto_group: 1 keeps one block per program (4 was slower on the H200, see the notes)
    "m_group_max": 1,
    # gate/up kernel: its K sum (D / 256 blocks) as this many leaves, each summed from zero in ascending order,
    # then added as a pairwise tree (`tree_sum`): a constant of the layer's shape, part of the numerics. None:
    # `default_ksplit` (2 where the K blocks divide evenly: Kimi's 28; on the H200 share at full depth plain
    # steps 3.0% faster at batch 1 and within noise at batch 8 against one leaf, docs/PERFORMANCE.md).
    "gu_ksplit": None,
    # how many programs share a gate/up tile's tree, by T: [[t_max, programs], ...], the first pair with
    # T <= t_max, else one program per leaf (the split measured so far). Each program sums a whole subtree
    # (float32 partials; a small combine kernel completes the tree and applies the SiLU-multiply), so every
    # count gives the same bits and it may follow T (`split_programs`): more, shorter programs when a call
    # touches few experts, one program (no partials) when it touches many.
    "gu_programs": (),
    # with the gate/up K tree on several programs: the last program of a tile to finish (an atomic counter
    # per tile, zeroed by the metadata program) completes the tree and applies the SiLU-multiply, where
    # otherwise a combine kernel does. The same sums in the same order: the same bits (on the H200 too, at
    # T = 1 and 4, 3 runs each). In the layer at batch 1: one kernel fewer, gate/up 24.2 -> 25.5 us and the
    # combine's 2.1 us gone, 108.9 -> 108.3 us a stacked layer; at batch 8, gate/up 61.9 -> 64.1 us and the
    # combine's 3.3 us gone, 174.2 -> 173.0 us (same bits at T = 8 and 64 too; docs/PERFORMANCE.md, run 20).
    "gu_last_finishes": True,
    # how a program with several K leaves of the gate/up tree (more leaves than programs) runs them, the same bits
    # every way: "interleave" (one K loop, each iteration a block of every leaf, each leaf in accumulators and
    # pipeline buffers of its own: run 43) or "flat" (one K loop over the program's blocks in order, a leaf's end
    # inside it: its sum moved aside and the accumulator restarted, by selects; one leaf's buffers, `_flat_leaves`).
    # Neither timed on a device yet; a program of one leaf (the default tree) is the same code either way. The
    # 4-leaf tree they were built for gained nothing at T = 1, where it runs a program per leaf (H100, run 46: the
    # layer's gate/up 24.45 -> 25.02 us), so no default needs them.
    "gu_leaf_loop": "interleave",
    # the down kernel's K sum (F / 256 blocks) as this many leaves, summed as the gate/up tree is (`tree_sum`): part
    # of the numerics. None: one leaf (no tree). `dn_programs`: the programs sharing an output tile's tree by T, as
    # `gu_programs` (rules [[t_max, programs], ...], else one a leaf); with several, the last program of a tile to
    # store its float32 partials (an atomic counter per slot and tile, zeroed by the metadata program) completes
    # the tree, rounds and weights the rows. `dn_leaf_loop`: a program's several leaves as `gu_leaf_loop`.
    # Run 12 timed a 2-leaf tree on 2 programs at T = 1 with a finishing kernel of its own (down 14.9 -> 12.2 us a
    # layer, the kernel and a pad 3.7 us more); this form has no such launch. Not yet timed on a device.
    "dn_ksplit": None,
    "dn_programs": (),
    "dn_leaf_loop": "flat",
    # down kernel: load only a block's live rows of h (masked; the padding rows read as 0) instead of all 16.
    # A padding row's products go to output columns that are never stored, so no stored bit changes (the
    # same bits on the H200 at T = 1). In the layer at batch 1: down 14.93 -> 14.70 us (docs/PERFORMANCE.md,
    # run 21): at T = 1 a block holds one live row, so the h tiles were 16x the bytes needed.
    "dn_live_rows": True,
    # the model's switch (`model._shared_down_in_launch`): a MoE layer's shared expert's down projection runs as
    # extra programs of the down kernel's launch (``moe_int4(dense=...)``, `stacked_matmul`'s programs and tiles),
    # not as a dense kernel launch of its own. On the H200 (docs/PERFORMANCE.md, run 29): 99.6 -> 96.0 us a
    # stacked layer at batch 1 and 160.2 -> 159.2 at batch 8; the share's plain step at full depth 6.21 -> 5.99 ms
    # (batch 1) and 9.41 -> 9.23 (batch 8); the demo pair 0/64 and invariance clean with it on.
    "dn_dense": True,
    # where a compiled call builds its routing metadata with the metadata program (T * k assignments up to this,
    # at most `block_routing.MAX_ASSIGNMENTS`) rather than with XLA; the same metadata either way, so a speed
    # choice only. Interpret mode runs the program wherever it can (its tests). The one program walks the
    # assignments serially, XLA's ten launches do not: on an H100 (docs/PERFORMANCE.md, run 47) the program takes
    # 12 us at 256 assignments against XLA's 37, 23 against 17 at 512 and 41 against 18 at 1024; in the share's
    # layer the batch-16 verify (512) ties, and the batch-32 verify (1024) is 1.9% faster a cycle with XLA's.
    "meta_max_assignments": 512,
    # the launch order of a gate/up or down grid whose K tree runs on several programs a tile: False puts the
    # K-tree part on the slowest grid axis, so each part's live block slots are followed by every dead slot's
    # programs before the next part's live ones; True puts the block slots there, so every live program of every
    # part is launched before any dead slot's. Only the order changes (each program computes and stores the same
    # values): the same bits. The GPU's timer in the probe (run 49, an H100) found the default gate/up call at
    # T = 1 with its 256 live programs all started within 0.2 us, their K loops 14.6 (fastest) to 23.6 us
    # (slowest), and with 4 programs a tile 8.0 to 19.2 us: uneven, as if the later part's programs landed on
    # SMs unevenly among the dead ones. Timed in run 51 (an H100): the SMs holding 3 of the 256 live programs
    # end the call in either order, so the kernel is 25.07 against 25.36 us in the probe and the layer's gate/up
    # 23.64 against 23.46 / 23.60 us: no gain, off.
    "live_first": False,
}
"""Kernel configuration used by :func:`moe_int4` unless ``config=`` overrides it.

It is a constant, never chosen from T: changing a block size, the warps / stages or the K leaves
may change rounding (see the module docstring), so the values here are part of the numerics. Only the
program counts (``gu_programs``, ``dn_programs``) and the gate/up pipeline stages (``gu_stage_rules``) may
follow T: none of them changes a bit (the stages checked offline; the device's probe compares a row alone
against the same row in a batch before the kernel is used). The defaults are the fastest
of the configurations swept on an H200 (docs/notes/int4_kernel.md); every configuration swept was
checked there against a float32 reference and for batch invariance by
``scripts/bench_grouped_matmul.py --sweep``.

Options measured on the H200, slower there, and removed (docs/notes/int4_kernel.md, run 23, lists the
commits that hold them): the scale applied to each plane's float32 product (``scale="post"``), gate and
up in two K loops (``gu_split``), the next K step's scales loaded one step ahead
(``prefetch_scales``), a hand-unrolled K loop (``k_unroll``), the block slots on the fastest grid
axis (``tile_major=False``), the down kernel's K tree over several programs with its finishing
kernel (``dn_ksplit`` / ``dn_programs``), and a program's gate/up K leaves side by side on warps of their own
(``gu_leaf_rows``, run 31: Triton's wgmma form at 4 warps, 15-35% slower whole calls from T = 4 on). Measured on an
H100 and removed for gaining too little: the gate/up products in float16 (``gu_f16``, run 37: one shift a word
instead of three, 8% fewer instructions a K step, whole calls -2% to +3%, new numerics and a range condition on x);
the weights as the MMA's columns (``gu_swap`` / ``dn_swap``, run 38: 8 weight rows a warp, so a tile on twice the
warps; on the share within noise, 11-17% faster at T = 1 with 8 experts local, 6-17% slower from T = 64 on) and
the expert id loaded beside the row count (``hoist_meta``, run 38: the share's calls within noise). Commit
``1e5fafe`` holds the last two. Also without effect there: the down kernel's routing weights and assignment ids
loaded ahead of its K loop instead of after it (run 39, ``0e1e26b``: the same bits, 19 more registers).
"""


def _config(overrides: dict[str, Any] | None) -> dict[str, Any]:
    cfg = dict(DEFAULT_CONFIG)
    if overrides:
        unknown = set(overrides) - set(cfg)
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}; known: {sorted(cfg)}")
        cfg.update(overrides)
    if cfg["unpack"] not in (None, "jnp", "asm"):
        raise ValueError(f"config['unpack']: expected None, 'jnp' or 'asm', found {cfg['unpack']!r}")
    for key in ("gu_leaf_loop", "dn_leaf_loop"):
        if cfg[key] not in ("interleave", "flat"):
            raise ValueError(f"config['{key}']: expected 'interleave' or 'flat', found {cfg[key]!r}")
    if not isinstance(cfg["live_first"], bool):
        raise ValueError(f"config['live_first']: expected true or false, found {cfg['live_first']!r}")
    return cfg


# ---------------------------------------------------------------------------
# Availability
# ---------------------------------------------------------------------------


PROBE_TOLERANCE = 3e-2
"""The probe's bound on the relative error against the float32 reference (bf16 activations on the GPU:
the kernel's rounding of the weights, h and the output, ~5e-3 at Kimi's shapes; a wrong index, nibble or
scale is off by far more)."""


@functools.cache
def _probe(interpret: bool = False) -> str | None:
    """Compiles and runs a tiny call on the default GPU (interpret=True: in Pallas interpret mode,
    for tests of the probe itself); returns why it failed, or None. The call is compiled and run at
    once (``run_compiled``): the model may first ask while a decode step is being traced.

    It fails where the result is not finite, is off the float32 reference by more than
    :data:`PROBE_TOLERANCE`, or gives token 0 other bits alone than in the call's batch: a lowering
    that compiles but computes wrongly, or whose rows depend on the batch, leaves the kernel unused."""
    from jaxspec.kernels import run_compiled

    try:
        x, ex, wt, arrays, raw_of, e = _probe_inputs(interpret)

        def call(x, ex, wt, *arrays):
            return moe_int4(x, ex, wt, relayout(raw_of(arrays)), num_local=e, interpret=interpret).astype(jnp.float32)

        y = run_compiled(call, x, ex, wt, *arrays)
        if not bool(np.all(np.isfinite(y))):
            return "the probe call returned non-finite values"
        # the portable path in float32: exact float32 products and sums (no matmul precision involved)
        ref = run_compiled(
            lambda x, ex, wt, *a: grouped_matmul.gathered_expert_ffn(x.astype(jnp.float32), ex, wt, raw_of(a), e),
            x,
            ex,
            wt,
            *arrays,
        )
        err = float(np.linalg.norm(y - ref) / max(float(np.linalg.norm(ref)), 1e-30))
        if not err < PROBE_TOLERANCE:
            return (
                f"the probe call is off the float32 reference: relative error {err:.2e}, expected < {PROBE_TOLERANCE}"
            )
        alone = run_compiled(call, x[:1], ex[:1], wt[:1], *arrays)
        if not np.array_equal(alone[0], y[0]):
            return "the probe call's token 0 has other bits alone than in a batch of 3"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"the probe call failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None


def _probe_inputs(interpret: bool):
    """The probes' tiny call: (x, experts, weights, the checkpoint arrays, a builder of the raw experts from them,
    the expert count)."""
    rng = np.random.default_rng(12345)
    # As many K blocks as the configured K leaves of each kernel (gate/up: two at least, so the default split and
    # its combine run too), so that a configuration with more leaves (a timing sweep's `--kernel-config`) is
    # probed, not refused.
    gu, dn = DEFAULT_CONFIG["gu_ksplit"], DEFAULT_CONFIG["dn_ksplit"]
    e, d, f, t, k = 2, K_BLOCK * max(2, int(gu or 2)), K_BLOCK * int(dn or 1), 3, 2
    names = {"gate": (f, d), "up": (f, d), "down": (d, f)}
    arrays = []
    for n_out, n_in in names.values():
        arrays.append(rng.integers(-(2**31), 2**31, (e, n_out, n_in // 8)).astype(np.int32))
        scale = rng.uniform(0.5, 1.5, (e, n_out, n_in // GROUP)) * rng.choice([-1.0, 1.0], (e, n_out, n_in // GROUP))
        arrays.append((scale / np.sqrt(n_in)).astype(jnp.bfloat16))
    x = rng.normal(size=(t, d)).astype(np.float32 if interpret else jnp.bfloat16)
    ex = np.asarray([[0, 1], [1, 0], [0, 5]], np.int32)
    wt = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)

    def raw_of(arrays):
        return {n: quant.Int4Weight(arrays[2 * i], arrays[2 * i + 1]) for i, n in enumerate(names)}

    return x, ex, wt, arrays, raw_of, e


@functools.cache
def _dense_probe(interpret: bool = False) -> str | None:
    """The probe of the down launch with a dense product beside it (``moe_int4(dense=...)``, `_dense_plan`):
    a tiny call compiled and run now; returns why it failed, or None. The dense product has two row blocks and
    a K split of 2, as the model's shared down takes them in a verify (bfloat16 compiled, float32 interpreted).
    The routed output must have the bits of the plain launch (the same program, one branch more), the dense
    partials must be `stacked_matmul`'s own within float32 rounding (the same tile products; the launch's
    warps may differ), and row 0's partials must have the same bits alone (one row block) as among 20 rows."""
    from jaxspec.kernels import run_compiled

    try:
        x, ex, wt, arrays, raw_of, e = _probe_inputs(interpret)
        rng = np.random.default_rng(54321)
        live, fs, n = 20, 512 if not interpret else 128, 1024  # bf16: 4 K steps of 128; float32: of 32
        rows = np.zeros((stacked_matmul.padded_rows(live), fs), np.float32)
        rows[:live] = rng.normal(size=(live, fs))
        rows = rows.astype(x.dtype)
        stack = (rng.normal(size=(2, fs, n)) / np.sqrt(fs)).astype(x.dtype)

        def call(x, ex, wt, rows, stack, *arrays, dense=True):
            ops = relayout(raw_of(arrays))
            if not dense:
                y = moe_int4(x, ex, wt, ops, num_local=e, interpret=interpret)
                return y.astype(jnp.float32), stacked_matmul.stacked_matmuls(
                    rows, (stack,), 1, interpret=interpret, rows=live, raw=(True,)
                )[0]
            y, parts = moe_int4(x, ex, wt, ops, num_local=e, interpret=interpret, dense=(rows, stack, 1))
            return y.astype(jnp.float32), parts

        y, parts = run_compiled(call, x, ex, wt, rows, stack, *arrays)
        y0, parts0 = run_compiled(functools.partial(call, dense=False), x, ex, wt, rows, stack, *arrays)
        if parts.shape != parts0.shape or parts.shape[0] != 2 or parts.shape[1] != 2 * stacked_matmul.BLOCK_M:
            return f"the probe call's dense partials have shape {parts.shape}, stacked_matmul's {parts0.shape}"
        if not (np.all(np.isfinite(y)) and np.all(np.isfinite(parts))):
            return "the probe call with a dense product returned non-finite values"
        if not np.array_equal(y, y0):
            return "the probe call's routed output has other bits with a dense product beside it"
        if not np.allclose(parts, parts0, rtol=1e-5, atol=1e-5):
            return "the probe call's dense partials differ from stacked_matmul's"
        one = np.zeros((stacked_matmul.BLOCK_M, fs), rows.dtype)
        one[0] = rows[0]
        _, alone = run_compiled(call, x[:1], ex[:1], wt[:1], one, stack, *arrays)
        if not np.array_equal(alone[:, 0], parts[:, 0]):
            return "the probe call's dense row 0 has other bits alone than among 20 rows"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"the probe call with a dense product failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None


def dense_available() -> str | None:
    """Why the compiled down kernel cannot run a dense product beside its own programs here, or None: the
    kernel's own availability, then :func:`_dense_probe`. Where it fails the model runs the product as a
    `stacked_matmul` launch of its own (`model._shared_down_in_launch`)."""
    return available() or _dense_probe()


def available() -> str | None:
    """Why the compiled (non-interpret) kernel cannot run here, or None if it can.

    Needs a CUDA GPU backend and the Pallas Triton lowering; the first call compiles
    and runs a tiny problem once (cached) to prove the lowering works.
    """
    from jaxspec.kernels import gpu_problem

    if (problem := gpu_problem(plgpu)) is not None:
        return problem
    dev = jax.devices()[0]
    if "NVIDIA" not in getattr(dev, "device_kind", "") and getattr(dev, "platform", "") != "gpu":
        return f"needs an NVIDIA GPU, found {dev.device_kind!r}"
    cc = getattr(dev, "compute_capability", None)
    if cc is not None:
        try:
            if float(cc) < 8.0:
                return f"needs compute capability >= 8.0 (bf16 tensor cores), found {cc}"
        except ValueError:
            pass
    return _probe()


# ---------------------------------------------------------------------------
# Re-layout (load time)
# ---------------------------------------------------------------------------


def _word_inputs() -> np.ndarray:
    """``[32, 8]``: the input (0..255, within a K block) held by nibble s of tile word j. Word 2m holds
    planes 0-3 (scale groups: inputs 32p ..) of columns 2m (nibbles 0-3) and 2m + 1 (nibbles 4-7); word
    2m + 1 holds planes 4-7 of the same columns. So plane p of a word pair is nibbles p % 4 and p % 4 + 4
    of one of its words: one ``lop3`` after a shift makes both bf16 of the pair (:func:`_asm_plane`)."""
    j, s = np.arange(32)[:, None], np.arange(8)[None, :]
    return 32 * (4 * (j % 2) + s % 4) + 2 * (j // 2) + s // 4


def _relayout_words(packed: jax.Array) -> jax.Array:
    """``[E, N, K/8]`` checkpoint words -> ``[E, K/256, N, 32]`` tile words (:func:`_word_inputs`)."""
    e, n, words = packed.shape
    k = words * 8
    if k % K_BLOCK:
        raise ValueError(f"packed: K={k} (from {words} words) must be a multiple of {K_BLOCK}")
    old = packed.astype(jnp.uint32).reshape(e, n, k // K_BLOCK, 32)  # 32 old words per K block
    table = _word_inputs()
    out = jnp.zeros((e, n, k // K_BLOCK, 32), jnp.uint32)
    for s in range(8):
        # input i of the block is old word i // 8, nibble i % 8
        src = jnp.take(old, jnp.asarray(table[:, s] // 8), axis=3)
        nib = (src >> jnp.asarray(4 * (table[:, s] % 8), jnp.uint32)) & jnp.uint32(0xF)
        out = out | (nib << jnp.uint32(4 * s))
    return jnp.transpose(out, (0, 2, 1, 3)).astype(jnp.int32)


def _restore_words(w: jax.Array) -> jax.Array:
    """Inverse of :func:`_relayout_words`."""
    e, kb, n, _ = w.shape
    new = jnp.transpose(w.astype(jnp.uint32), (0, 2, 1, 3))  # [E, N, KB, 32]
    table = _word_inputs()
    where = np.zeros((K_BLOCK, 2), np.int64)  # input -> (tile word, nibble)
    where[table.ravel()] = np.stack(np.meshgrid(np.arange(32), np.arange(8), indexing="ij"), -1).reshape(-1, 2)
    i = np.arange(8)
    out = []
    for word in range(32):  # old word `word` holds inputs 8*word + i, i = 0..7
        j, s = where[8 * word + i, 0], where[8 * word + i, 1]
        nib = (jnp.take(new, jnp.asarray(j), axis=3) >> jnp.asarray(4 * s, jnp.uint32)) & jnp.uint32(0xF)
        out.append(jnp.sum(nib << jnp.asarray(4 * i, jnp.uint32), axis=-1, dtype=jnp.uint32))
    return jnp.stack(out, axis=-1).reshape(e, n, kb * 32).astype(jnp.int32)


def _relayout_scales(scale: jax.Array) -> jax.Array:
    """``[E, N, K/32]`` bf16 -> ``[E, K/256, N, 4]`` int32 pairs (planes q | q+4 << 16)."""
    e, n, groups = scale.shape
    if groups % PLANES:
        raise ValueError(f"scale: K/32={groups} groups must be a multiple of {PLANES}")
    bits = jax.lax.bitcast_convert_type(scale.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
    bits = bits.reshape(e, n, groups // PLANES, 2, 4)  # [.., half, q]: plane = 4*half + q
    pairs = bits[..., 0, :] | (bits[..., 1, :] << jnp.uint32(16))  # [E, N, KB, 4]
    return jnp.transpose(pairs, (0, 2, 1, 3)).astype(jnp.int32)


def _restore_scales(s: jax.Array) -> jax.Array:
    e, kb, n, _ = s.shape
    u = jnp.transpose(s.astype(jnp.uint32), (0, 2, 1, 3))  # [E, N, KB, 4]
    lo, hi = u & jnp.uint32(0xFFFF), u >> jnp.uint32(16)
    bits = jnp.concatenate([lo, hi], axis=-1).reshape(e, n, kb * PLANES).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def relayout(experts: dict[str, quant.Int4Weight]) -> dict[str, quant.Int4Weight]:
    """Kernel operands from one MoE layer's INT4 experts (jittable, lossless).

    Args:
      experts: ``gate`` / ``up`` ``Int4Weight`` (rows layout) ``[E, F, D]`` and ``down``
        ``[E, D, F]``, group 32 (bf16 scales; other keys are ignored). D and F must be
        multiples of 256.

    Returns:
      ``gate`` / ``up`` / ``down`` as ``Int4Weight`` in the ``"tiles"`` layout: words int32
      ``[E, K/256, N, 32]`` and scale pairs int32 ``[E, K/256, N, 4]`` (see the module
      docstring); the same bytes as the input. Scales are stored as bf16 bits: a float32
      scale is rounded to bf16.
    """
    out = {}
    for name in PROJECTIONS:
        w = experts[name].check(name)
        if w.layout != quant.ROWS or w.group_size != GROUP:
            raise ValueError(
                f"{name}: relayout takes the rows layout with groups of {GROUP}, found {w.layout!r}, "
                f"group_size={w.group_size}"
            )
        out[name] = quant.Int4Weight(_relayout_words(w.packed), _relayout_scales(w.scale), GROUP, quant.TILES)
    return out


def restore(experts: dict[str, quant.Int4Weight]) -> dict[str, quant.Int4Weight]:
    """Inverse of :func:`relayout`: the checkpoint's packed words and bf16 scales, rows layout."""
    return {
        name: quant.Int4Weight(_restore_words(experts[name].packed), _restore_scales(experts[name].scale), GROUP)
        for name in PROJECTIONS
    }


def operand_bytes(experts: dict[str, quant.Int4Weight], experts_read: int | None = None) -> int:
    """Bytes of the layer's INT4 experts (all of them, or ``experts_read`` of them)."""
    total = sum(experts[n].nbytes for n in PROJECTIONS)
    if experts_read is None:
        return total
    return total * experts_read // int(experts["gate"].packed.shape[0])


# ---------------------------------------------------------------------------
# In-kernel unpack
# ---------------------------------------------------------------------------


def _asm_plane(p: int) -> str:
    """PTX for nibble plane p of a word pair ($1: the even word, $2: the odd one) and its bf16 scale pair
    ($3) -> one bf16x2 register ($0): plane p of the pair's two columns.

    Plane p < 4 lies in the even word, p >= 4 in the odd one (:func:`_word_inputs`), both columns in one
    word: nibble p % 4 (low half) and nibble p % 4 + 4 (high half), brought to bits 0-3 of each half by
    the tile's shift by 4 (p % 4) (three shifted copies of the tile serve the 8 planes). One ``lop3``
    computes ``(t & 0x000F000F) | 0x43004300``, two bf16 numbers ``128 + nibble``; one
    ``fma.rn.bf16x2 t * 1 + (-136)`` makes them ``nibble - 8`` exactly; a second ``fma`` (addend -0)
    multiplies by the scale pair and rounds once. Three instructions per two weights, plus three
    shifts per word of eight.

    Not elementwise: both columns come from one word of the pair, so the instance must see the two words
    of a pair, even one first (``pack=2`` on a layout whose threads hold consecutive column pairs, as the
    layouts this kernel compiles to do). :func:`_probe` checks the values on the device before the kernel
    is used.
    """
    word = "$1" if p < 4 else "$2"
    # lop3 truth table 0xEA = (a & b) | c
    return (
        "{\n.reg .b32 t, one, c, z;\n"
        "mov.b32 one, 0x3F803F80;\nmov.b32 c, 0xC308C308;\nmov.b32 z, 0x80008000;\n"
        f"lop3.b32 t, {word}, 0x000F000F, 0x43004300, 0xEA;\n"
        "fma.rn.bf16x2 t, t, one, c;\n"
        "fma.rn.bf16x2 $0, t, $3, z;\n}"
    )


def _scale_f32(pair: jax.Array, p: int) -> jax.Array:
    """Plane p's scale (float32) from a packed pair word (planes p % 4 | p % 4 + 4)."""
    bits = pair << 16 if p < 4 else pair & jnp.int32(-65536)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _planes(w, pairs, dtype, unpack: str):
    """The 8 scaled weight planes ``[BN, 32]`` of a word tile, in ``dtype``: ``(nibble - 8) * scale``,
    rounded once. ``pairs``: the 4 scale-pair vectors ``[BN]`` (int32) of this K block."""
    bn = w.shape[0]
    if unpack == "asm":
        out_t = [jax.ShapeDtypeStruct(w.shape, jnp.bfloat16)]
        shifted = [w] + [jax.lax.shift_right_logical(w, 4 * i) for i in (1, 2, 3)]
        planes = []
        for p in range(PLANES):
            src = shifted[p % 4]
            sp = jnp.broadcast_to(_scale_f32(pairs[p % 4], p).astype(jnp.bfloat16)[:, None], w.shape)
            # pack=2: each instance sees two elements of the thread's registers ($1, $2: the int32 words
            # of columns 2m and 2m + 1; $3: their two bf16 scales in one register) and writes the plane's
            # two bf16 of those columns in one register ($0); see _asm_plane.
            (plane,) = plgpu.elementwise_inline_asm(
                _asm_plane(p),
                args=[src, sp],
                constraints="=r,r,r,r",
                pack=2,
                result_shape_dtypes=out_t,
            )
            planes.append(plane)
        return planes
    words = jnp.split(w.reshape(bn, 32 // 2, 2), 2, axis=2)  # the pairs' even and odd words, [BN, 16, 1]
    planes = []
    for p in range(PLANES):
        src = words[p // 4].reshape(bn, 32 // 2)
        shift = 4 * (p % 4)
        cols = jnp.stack([(src >> shift) & 0xF, (src >> (shift + 16)) & 0xF], axis=-1).reshape(bn, 32)
        q = cols.astype(jnp.float32) - float(quant.INT4_OFFSET)  # nibble - 8
        planes.append((q * _scale_f32(pairs[p % 4], p).reshape(bn, 1)).astype(dtype))
    return planes


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


def _dot_t(a, b, dtype):
    """``a [BN, 32] @ b[16, 32].T`` in float32 (IEEE for float32 inputs)."""
    prec = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def _multi_project(specs, kblocks, loaders, bn, dtype, unpack, e, n0, kb_start=0):
    """Several projections of several 16-row blocks, unpacking each K step's weights once.

    ``specs``: ``(w_ref, s_ref)`` per projection (all of expert e, rows n0..n0+BN);
    ``loaders``: one ``k0 -> [16, 32]`` activation loader per block. Returns
    ``accs[i][g]``: the ``[BN, 16]`` float32 product of projection i with block g. Every
    block's product is the same sequence of ``[BN, 32] x [32, 16]`` dots whatever the
    number of blocks or projections, so grouping blocks does not change any result bit.

    The K loop covers blocks ``kb_start .. kb_start + kblocks - 1`` (one leaf of the K tree).
    """
    return _leaves_project(specs, kblocks, loaders, bn, dtype, unpack, e, n0, (kb_start,))[0]


def _k_step(specs, loaders, bn, dtype, unpack, e, n0):
    """``step(kb, accs) -> accs``: K block ``kb``'s dots added to ``accs[i][g]`` (projection i, block g), each
    projection's weights unpacked once for every block."""

    def load_pairs(kb):
        # one [BN, 4] tile per projection (16 contiguous bytes per row), split into the 4 pair vectors
        return tuple(
            tuple(q.reshape(bn) for q in jnp.split(s_ref[e, kb, pl.ds(n0, bn), :], 4, axis=1)) for _, s_ref in specs
        )

    def step(kb, accs):
        planes = [
            _planes(w_ref[e, kb, pl.ds(n0, bn), :], pairs, dtype, unpack)
            for (w_ref, _), pairs in zip(specs, load_pairs(kb))
        ]
        accs = [list(a) for a in accs]
        for p in range(PLANES):
            for g, load_act in enumerate(loaders):
                act = load_act(kb * K_BLOCK + p * GROUP)
                for i, tiles in enumerate(planes):
                    accs[i][g] = accs[i][g] + _dot_t(tiles[p], act, dtype)
        return tuple(tuple(a) for a in accs)

    return step


def _zeros(specs, loaders, bn):
    return tuple(tuple(jnp.zeros((bn, BLOCK_M), jnp.float32) for _ in loaders) for _ in specs)


def _leaves_project(specs, kblocks, loaders, bn, dtype, unpack, e, n0, kb_starts):
    """:func:`_multi_project` for several leaves of the K tree in one K loop: ``accs[leaf][i][g]``, leaf j over
    blocks ``kb_starts[j] ..`` + ``kblocks``. Each iteration takes the next block of every leaf, each leaf's sum
    in its own accumulators, so a leaf's sum is the same sequence of dots as alone (the same bits), while the
    program keeps one pipelined loop where leaves one after another would each start their own."""
    step = _k_step(specs, loaders, bn, dtype, unpack, e, n0)

    def body(kb, accs):
        return tuple(step(kb + start, a) for start, a in zip(kb_starts, accs))

    return jax.lax.fori_loop(0, kblocks, body, (_zeros(specs, loaders, bn),) * len(kb_starts))


def _counter_pushes(leaves: int):
    """The binary counter that sums ``leaves`` leaves in `tree_sum`'s order as they complete: for each leaf j,
    ``(slot, merged)``, the slot of held sums its push writes and the slots (deepest first) added in front of it,
    ``held[merged[0]] + (held[merged[1]] + (... + leaf))``; and the slots held at the end, which fold from the
    right to the total. Equal subtrees merge as they complete, so this is `tree_sum`'s order for every count (a
    test checks)."""
    stack, pushes = [], []  # stack: (size, slot), sizes strictly decreasing
    for _ in range(leaves):
        size, merged = 1, []
        while stack and stack[-1][0] == size:
            merged.insert(0, stack.pop()[1])
            size *= 2
        slot = len(stack)
        stack.append((size, slot))
        pushes.append((slot, merged))
    return pushes, [sl for _, sl in stack]


def _flat_leaves(specs, kcount, mine, loaders, bn, dtype, unpack, e, n0, kb0):
    """A program's ``mine`` consecutive K leaves (from block ``kb0``, ``kcount`` blocks each) summed as
    `tree_sum` of the leaves (``[projection][block]``), in one K loop over the blocks in order: each iteration
    adds its block's dots to the current leaf's accumulators; where a leaf ends, its sum is pushed into the held
    sums (:func:`_counter_pushes`) and the accumulators restart from zero, both as selects, so the loop has no
    branch and keeps one leaf's pipeline buffers. Each leaf is the same sequence of dots from zero as alone:
    the bits of the interleaved form and of one leaf a program."""
    step = _k_step(specs, loaders, bn, dtype, unpack, e, n0)
    pushes, final = _counter_pushes(mine)
    slots = 1 + max(slot for slot, _ in pushes)
    zeros = _zeros(specs, loaders, bn)

    def add(a, b):
        return jax.tree.map(jnp.add, a, b)

    def where(c, a, b):
        return jax.tree.map(lambda x, y: jnp.where(c, x, y), a, b)

    def body(i, carry):
        cur, held = carry
        cur = step(kb0 + i, cur)
        held = list(held)
        for j, (slot, merged) in enumerate(pushes[:-1]):  # leaf j ends at i == (j + 1) * kcount - 1
            value = cur
            for m in reversed(merged):
                value = add(held[m], value)
            held[slot] = where(i == (j + 1) * kcount - 1, value, held[slot])
        ends = jnp.logical_and(jax.lax.rem(i, kcount) == kcount - 1, i < (mine - 1) * kcount)
        return where(ends, zeros, cur), tuple(held)

    cur, held = jax.lax.fori_loop(0, mine * kcount, body, (zeros, (zeros,) * slots))
    held = list(held)
    slot, merged = pushes[-1]  # the last leaf's push, after the loop
    for m in reversed(merged):
        cur = add(held[m], cur)
    held[slot] = cur
    total = held[final[-1]]
    for sl in reversed(final[:-1]):  # the subtrees left, folded from the right
        total = add(held[sl], total)
    return [list(t) for t in total]


def _gate_up_kernel(*refs, programs=1, live_first=False, **kw):
    """The gate/up kernel: its program's (block slot, output tile, part) from the grid, then
    :func:`_gate_up_program`."""
    slot, tile, part = _grid_ids(programs, live_first)
    _gate_up_program(slot, tile, part, *refs, programs=programs, **kw)


def _atomic_add(ref, i, v, interpret):
    """``ref[i] += v`` as one atomic; returns the old value (a scalar)."""
    if interpret:  # interpret mode's atomics take an array index
        return jnp.max(plgpu.atomic_add(ref, pl.ds(i, 1), jnp.full((1,), v, jnp.int32)))
    return plgpu.atomic_add(ref, i, jnp.int32(v))


def _last_to_count(cnt_ref, i, programs, interpret):
    """Counts this program's partials as stored at counter ``i`` (after a barrier: every thread's stores first;
    interpret mode runs in order) and tells whether it was the last of the tile's ``programs``: then the others'
    partials are stored and it completes the tree."""
    if not interpret:
        plgpu.debug_barrier()
    return _atomic_add(cnt_ref, i, 1, interpret) == programs - 1


def _gate_up_program(
    slot,
    tile,
    part,
    rows_ref,
    expert_ref,
    packed_ref,
    x_ref,
    gw_ref,
    gs_ref,
    uw_ref,
    us_ref,
    *out_refs,
    bn,
    kblocks,
    dtype,
    unpack,
    group,
    leaves=1,
    programs=1,
    finish=False,
    interpret=False,
    tiles=0,
    flat=False,
):
    """One program of the gate/up kernel: block slot ``slot``, output tile ``tile``, ``part`` of its K tree.

    out_refs: (h,) with one program per tile; (g, u) float32 partials [programs, S*16, F] with several.
    The K sum is :func:`tree_sum` over ``leaves`` leaves; each program sums a subtree of ``leaves / programs``
    and :func:`_silu_combine_kernel` completes the tree over the programs. With ``finish``, out_refs are
    (counters in, g, u, h, counters): the last program of a tile to store its partials (an atomic count at
    ``slot * tiles + tile``) completes the tree and writes h itself. ``flat``: a program's several leaves in one
    K loop in order (:func:`_flat_leaves`), else side by side (:func:`_leaves_project`)."""
    b0 = slot * group  # this program's blocks: b0 .. b0 + group - 1, all of one expert
    n0 = tile * bn
    kcount = kblocks // leaves
    mine = leaves // programs

    @pl.when(rows_ref[b0] > 0)
    def _():
        e = expert_ref[b0]
        cols = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M, GROUP), 1)
        loaders = []
        for g in range(group):
            tok = packed_ref[0, pl.ds((b0 + g) * BLOCK_M, BLOCK_M)]  # [16] token ids
            live = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M, GROUP), 0) < rows_ref[b0 + g]
            rows_idx = jnp.broadcast_to(tok[:, None], (BLOCK_M, GROUP))

            def load_x(k0, rows_idx=rows_idx, live=live):  # gathered token rows; padding rows read as 0
                return plgpu.load(x_ref.at[rows_idx, cols + k0], mask=live, other=0).astype(dtype)

            loaders.append(load_x)

        specs = [(gw_ref, gs_ref), (uw_ref, us_ref)]
        if flat and mine > 1:
            gs, us = _flat_leaves(specs, kcount, mine, loaders, bn, dtype, unpack, e, n0, part * mine * kcount)
        else:

            def project(kb_starts):
                return _leaves_project(specs, kcount, loaders, bn, dtype, unpack, e, n0, kb_starts)

            gs, us = _subtree(project, part, mine, kcount)
        if finish:
            _, g_ref, u_ref, h_ref, cnt_ref = out_refs
        elif programs > 1:
            g_ref, u_ref = out_refs
        else:
            (h_ref,) = out_refs
        for g in range(group):
            rows = pl.ds((b0 + g) * BLOCK_M, BLOCK_M)
            if programs > 1:  # this program's subtree, float32; the combine kernel or the last program completes it
                live = _live_rows(rows_ref[b0 + g], bn)  # padding rows are not stored (`_complete_tree`)
                plgpu.store(g_ref.at[part, rows, pl.ds(n0, bn)], gs[g].T, mask=live)
                plgpu.store(u_ref.at[part, rows, pl.ds(n0, bn)], us[g].T, mask=live)
            else:
                h_ref[rows, pl.ds(n0, bn)] = _silu_mul(gs[g].T, us[g].T, dtype).astype(h_ref.dtype)
        if finish:

            @pl.when(_last_to_count(cnt_ref, slot * tiles + tile, programs, interpret))
            def _():
                for g in range(group):
                    live = rows_ref[b0 + g]
                    _complete_tree(g_ref, u_ref, h_ref, (b0 + g) * BLOCK_M, n0, bn, programs, dtype, live)


def _grid_ids(programs: int = 1, live_first: bool = False):
    """(block slot, output tile, part of the K tree) of this program. Grid axis 0 is the fastest in launch order
    and walks the output tiles, so the live slots' programs (the slots in use come first) are launched
    contiguously and spread over all SMs, not interleaved with dead slots' programs (with the slots there
    instead: on the H200 0.089 ms against 0.069 at T = 1 on a mesh share, docs/notes/int4_kernel.md run 7).
    With several programs a tile, the part is axis 2 (the slowest) or, with ``live_first``, axis 1 (`_grid`)."""
    if programs == 1:
        return pl.program_id(1), pl.program_id(0), 0
    if live_first:
        return pl.program_id(2), pl.program_id(0), pl.program_id(1)
    return pl.program_id(1), pl.program_id(0), pl.program_id(2)


def _grid(slots, tiles, programs: int = 1, live_first: bool = False):
    """The grid of ``slots`` block slots x ``tiles`` output tiles x ``programs`` K-tree parts, in the axis
    order `_grid_ids` reads."""
    if programs == 1:
        return (tiles, slots)
    return (tiles, programs, slots) if live_first else (tiles, slots, programs)


def _silu_mul(g, u, dtype):
    """silu(g) * u with g and u rounded to the activation dtype first, as the portable path does."""
    gv = g.astype(dtype).astype(jnp.float32)
    uv = u.astype(dtype).astype(jnp.float32)
    return gv * jax.nn.sigmoid(gv) * uv


def _live_rows(count, bn):
    """``[16, bn]``: which rows of a block are live (the block's first ``count``)."""
    return jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M, bn), 0) < count


def _complete_tree(g_ref, u_ref, h_ref, r0, n0, bn, programs, dtype, count):
    """h = silu(g) * u for 16 block rows from r0 and BN columns from n0, g and u the tree sums of the
    programs' stored subtrees (the combine kernel's, or a gate/up tile's last program's). Only the block's
    ``count`` live rows of the partials are stored and read: a padding row reads as 0, as its x row did, so its
    h row is 0 as before (at T = 1 a block has one live row of 16, and a program per K leaf stores 16x less)."""
    rows, cols = pl.ds(r0, BLOCK_M), pl.ds(n0, bn)
    live = _live_rows(count, bn)
    parts = [jnp.int32(p) for p in range(programs)]  # array indices: interpret mode's masked load takes no int
    g = tree_sum([plgpu.load(g_ref.at[p, rows, cols], mask=live, other=0) for p in parts])
    u = tree_sum([plgpu.load(u_ref.at[p, rows, cols], mask=live, other=0) for p in parts])
    h_ref[rows, cols] = _silu_mul(g, u, dtype).astype(h_ref.dtype)


def _silu_combine_kernel(rows_ref, g_ref, u_ref, h_ref, *, bn, programs, dtype):
    """h = silu(g) * u for one live block, g and u the tree sums of the programs' subtrees."""
    b, tile, _ = _grid_ids()

    @pl.when(rows_ref[b] > 0)
    def _():
        _complete_tree(g_ref, u_ref, h_ref, b * BLOCK_M, tile * bn, bn, programs, dtype, rows_ref[b])


def _down_kernel(*refs, poisoned=False, dense=None, programs=1, live_first=False, **kw):
    """The down kernel: its program's (block slot, output tile[, part of the K tree]) from the grid, then
    :func:`_down_program` (refs: the inputs, [a poisoned input aliased to y,] [the counters in,] [the dense
    product's layer, rows and weight stack,] y [, the dense product's partials] [, the K tree's partials, the
    counters]). With ``dense`` (:func:`_dense_plan`), the grid's block slots past the routed ones run that
    product's programs (`stacked_matmul.product`; those of part 0 only where the K tree has several programs)."""
    slot, tile, part = _grid_ids(programs, live_first)
    tree = programs > 1
    n_in = 6 + int(poisoned) + int(tree) + (3 if dense else 0)
    ins, outs = refs[:n_in], refs[n_in:]
    tree_refs = tuple(outs[-2:]) if tree else ()
    kw = dict(kw, programs=programs)
    if dense is None:
        _down_program(slot, tile, part, *ins[:6], outs[0], *tree_refs, **kw)
        return
    slots = dense["slots"]

    @pl.when(slot < slots)
    def _():
        _down_program(slot, tile, part, *ins[:6], outs[0], *tree_refs, **kw)

    @pl.when(jnp.logical_and(slot >= slots, part == 0))
    def _():
        q = (slot - slots) * dense["tiles"] + tile  # the row block fastest, as in `stacked_matmul`'s grid
        m, rest = q % dense["mblocks"], q // dense["mblocks"]
        j, part = rest % dense["ntiles"], rest // dense["ntiles"]

        @pl.when(q < dense["programs"])
        def _():
            layer_ref, x_ref, w_ref = ins[n_in - 3 :]
            stacked_matmul.product(
                layer_ref,
                x_ref,
                w_ref,
                outs[1],
                m0=m * stacked_matmul.BLOCK_M,
                n0=j * dense["bn"],
                part=part,
                bn=dense["bn"],
                bk=dense["bk"],
                steps=dense["steps"],
                precision=dense["precision"],
            )


def _dense_plan(dense, slots: int, tiles: int) -> dict[str, Any]:
    """How the down launch runs a dense product beside its own programs (``dense = (x, stack, layer)``: the padded
    rows ``[Mp, K]``, the weights ``[L, K, N]``, the layer): `stacked_matmul`'s tiles and K split for those shapes
    (`stacked_matmul.tiles_for`, its default configuration), its programs counted, and the block-slot rows of
    ``tiles`` programs each that the grid gains for them."""
    x, stack, _ = dense
    mp, k = x.shape
    if stack.ndim != 3 or stack.shape[1] != k or mp % stacked_matmul.BLOCK_M or x.dtype != stack.dtype:
        raise ValueError(
            f"moe_int4: the dense product needs padded rows [Mp, K] (Mp a multiple of {stacked_matmul.BLOCK_M}) and a "
            f"weight stack [L, K, N] of their dtype; found rows {tuple(x.shape)} {x.dtype}, stack {tuple(stack.shape)} "
            f"{stack.dtype}"
        )
    bn, bk, ksplit = stacked_matmul.tiles_for(k, [stack.shape[2]], stack.dtype)
    mblocks, ntiles = mp // stacked_matmul.BLOCK_M, stack.shape[2] // bn
    programs = mblocks * ntiles * ksplit
    return {
        "slots": slots,
        "tiles": tiles,
        "mblocks": mblocks,
        "ntiles": ntiles,
        "programs": programs,
        "rows": -(-programs // tiles),
        "bn": bn,
        "bk": bk,
        "ksplit": ksplit,
        "steps": k // bk // ksplit,
        "precision": stacked_matmul.precision_for(stack.dtype),
    }


def _down_program(
    slot,
    tile,
    part,
    rows_ref,
    expert_ref,
    packed_ref,
    h_ref,
    dw_ref,
    ds_ref,
    y_ref,
    p_ref=None,
    cnt_ref=None,
    *,
    bn,
    kblocks,
    dtype,
    unpack,
    group,
    live_rows=True,
    leaves=1,
    programs=1,
    flat=False,
    tiles=0,
    counter0=0,
    interpret=False,
):
    """One program of the down kernel: block slot ``slot``, output tile ``tile``, ``part`` of its K tree.

    y_ref: weight * output per assignment row ``[a + 1, D]``. With one leaf the K sum runs over the K blocks in
    ascending order; with ``leaves`` > 1 it is :func:`tree_sum` over the leaves, each summed from zero in
    ascending order. Over several ``programs``, each stores its subtree's float32 sums of a block's live rows in
    ``p_ref`` ``[programs, S*16, D]`` and counts at ``cnt_ref[counter0 + slot * tiles + tile]``; the last to
    count completes the tree and writes the rows (as the gate/up kernel's last program does)."""
    b0 = slot * group
    n0 = tile * bn
    kcount = kblocks // leaves
    mine = leaves // programs

    @pl.when(rows_ref[b0] > 0)
    def _():
        e = expert_ref[b0]
        loaders = []
        for g in range(group):
            r0 = (b0 + g) * BLOCK_M
            live_h = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M, GROUP), 0) < rows_ref[b0 + g]

            def load_h(k0, r0=r0, live_h=live_h):
                tile = h_ref.at[pl.ds(r0, BLOCK_M), pl.ds(k0, GROUP)]
                if not live_rows:  # every row of the block, the padding rows' (unused) values too
                    return tile[...].astype(dtype)
                # the block's live rows only: a padding row's products land in output columns never stored
                return plgpu.load(tile, mask=live_h, other=0).astype(dtype)

            loaders.append(load_h)
        specs = [(dw_ref, ds_ref)]
        if leaves == 1:
            (accs,) = _multi_project(specs, kblocks, loaders, bn, dtype, unpack, e, n0)
        elif flat and mine > 1:
            (accs,) = _flat_leaves(specs, kcount, mine, loaders, bn, dtype, unpack, e, n0, part * mine * kcount)
        else:

            def project(kb_starts):
                return _leaves_project(specs, kcount, loaders, bn, dtype, unpack, e, n0, kb_starts)

            (accs,) = _subtree(project, part, mine, kcount)
        cols = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_M, bn), 1) + n0

        def write(g, acc):  # the rows of block b0 + g: rounded, weighted, at their assignments' rows
            r0 = (b0 + g) * BLOCK_M
            wt = jax.lax.bitcast_convert_type(packed_ref[2, pl.ds(r0, BLOCK_M)], jnp.float32)  # [16] weights
            aid = packed_ref[1, pl.ds(r0, BLOCK_M)]
            live = _live_rows(rows_ref[b0 + g], bn)
            y = _round_weight(acc, wt, dtype)  # [16, BN]
            plgpu.store(y_ref.at[jnp.broadcast_to(aid[:, None], (BLOCK_M, bn)), cols], y, mask=live)

        if programs == 1:
            for g in range(group):
                write(g, accs[g].T)
            return
        for g in range(group):  # this program's subtree, the block's live rows
            rows = pl.ds((b0 + g) * BLOCK_M, BLOCK_M)
            plgpu.store(p_ref.at[part, rows, pl.ds(n0, bn)], accs[g].T, mask=_live_rows(rows_ref[b0 + g], bn))

        @pl.when(_last_to_count(cnt_ref, counter0 + slot * tiles + tile, programs, interpret))
        def _():
            parts = [jnp.int32(p) for p in range(programs)]
            for g in range(group):
                rows = pl.ds((b0 + g) * BLOCK_M, BLOCK_M)
                live = _live_rows(rows_ref[b0 + g], bn)
                write(g, tree_sum([plgpu.load(p_ref.at[p, rows, pl.ds(n0, bn)], mask=live, other=0) for p in parts]))


def _subtree(project, part, mine, kcount):
    """This program's subtree of the K tree: ``project(kb_starts)`` (``accs[leaf][projection][block]``, each leaf
    over its ``kcount`` K blocks from its start, in one loop) for its ``mine`` leaves, added by :func:`tree_sum`
    per projection and block."""
    leaves = project(tuple((part * mine + i) * kcount for i in range(mine)))
    return [[tree_sum([lf[j][g] for lf in leaves]) for g in range(len(leaves[0][j]))] for j in range(len(leaves[0]))]


def tree_sum(xs):
    """The pairwise sum, level by level: ``((x0 + x1) + (x2 + x3))``; an odd one out at a level is carried
    to the next (``(x0 + x1) + x2``). Its shape depends on the count alone."""
    xs = list(xs)
    while len(xs) > 1:
        xs = [xs[i] + xs[i + 1] for i in range(0, len(xs) - 1, 2)] + ([xs[-1]] if len(xs) % 2 else [])
    return xs[0]


def _t_rules(rules, what: str, value: str) -> list[tuple[int, int]]:
    """A configuration's rules by T, ``[[t_max, value], ...]``, as int pairs; a clear error naming ``what``."""
    try:
        return [(int(t_max), int(v)) for t_max, v in rules]
    except (TypeError, ValueError):
        raise ValueError(f"config['{what}']: expected [[t_max, {value}], ...], found {rules!r}") from None


def split_programs(tokens: int, leaves: int, rules, what: str) -> int:
    """Programs sharing a tile's K tree of ``leaves`` leaves for a call of ``tokens`` tokens: the first
    ``[t_max, programs]`` of ``rules`` with ``tokens <= t_max``, else one program per leaf. Safe to follow T:
    each program sums a subtree of the one tree (``leaves / programs`` a power of two, or all leaves in one
    program), so every count gives the same bits. Every rule is checked, not only the one T picks."""
    pairs = _t_rules(rules, what, "programs")
    for _, p in pairs:
        per = leaves // p if p >= 1 and leaves % p == 0 else 0
        if not (p == 1 or (per and per & (per - 1) == 0)):
            raise ValueError(
                f"config['{what}'] asks for {p} programs: expected 1, or a count that leaves each a "
                f"power-of-two share of the {leaves} K leaves"
            )
    return next((p for t_max, p in pairs if tokens <= t_max), leaves)


def _round_weight(acc, wt, dtype):
    """An expert's float32 output rows rounded to the activation dtype (as the portable path's product is),
    times each row's routing weight: ``[16, BN]``, ``wt`` ``[16]``."""
    return acc.astype(dtype).astype(jnp.float32) * wt[:, None]


# ---------------------------------------------------------------------------
# Routing metadata
# ---------------------------------------------------------------------------


def num_block_slots(tokens: int, k: int, num_local: int, group: int = 1) -> int:
    """Static bound on the 16-row blocks a call of ``tokens`` x top-``k`` can need.

    With ``group`` > 1 each expert's block count is rounded up to a multiple of ``group``
    (one program handles ``group`` consecutive blocks of one expert), and so is the bound.
    """
    a = tokens * k
    used = min(num_local, a)
    s = max(1, (a + (BLOCK_M - 1) * used) // BLOCK_M + (group - 1) * used)
    return -(-s // group) * group


def auto_group(tokens: int, k: int, num_local: int, cap: int = 4) -> int:
    """Blocks per program: 1 while an expert averages <= 16 rows at this T, else 2 or 4 (static shapes only).

    Any value gives the same bits (see :func:`_multi_project`); it only trades the
    weight unpacking, done once per program, against wasted products on empty blocks.
    """
    a = tokens * k
    rows = a / max(1, min(num_local, a))
    return int(min(cap, 1 if rows <= BLOCK_M else (2 if rows <= 2 * BLOCK_M else 4)))


METADATA_IMPLS = ("xla", "kernel", "interpret")


def num_slots(meta) -> int:
    """The block slots S of :func:`route_blocks`'s metadata (static: its ``rows`` hold S + 1)."""
    return meta["rows"].shape[0] - 1


def busiest_share(experts_TK: jax.Array, local: int, share: int) -> jax.Array:
    """Global expert ids -> local ids of the device (of ``share``, ``local`` experts each, in id order)
    that receives the most of this call's assignments, the lowest device on ties (``jnp.argmax``);
    other devices' ids fall outside ``[0, local)``. For one device's share of a mesh
    (``ModelConfig.share``), which emulates the device that sets the pace.

    The counts are a scatter-add at ``id // local``, so an id outside ``[0, share * local)`` counts as
    JAX's indexing counts it: one in ``[-share * local, 0)`` for device ``id // local + share`` (a
    negative index counts from the end), any other for no device (past the end: dropped). Every id,
    these too, is moved by the chosen device's first id. The metadata kernel
    (``block_routing.block_metadata``) does exactly this inside its program."""
    counts = jnp.zeros((share,), jnp.int32).at[experts_TK.reshape(-1) // local].add(1)
    return experts_TK - jnp.argmax(counts).astype(jnp.int32) * local


def route_blocks(
    experts_TK: jax.Array,
    weights_TK: jax.Array,
    num_local: int,
    group: int = 1,
    impl: str = "xla",
    share: int = 1,
    layer: jax.Array | int | None = None,
    counters: int = 0,
):
    """Groups the (token, k) assignments into 16-row blocks of one local expert each.

    Each expert's blocks are padded with empty ones to a multiple of ``group``.

    Returns a dict of int32 / float32 arrays (S = :func:`num_block_slots`):
      ``rows [S + 1]`` live rows per block slot (0 for unused slots and for the last, a spare that no
      kernel reads: :func:`num_slots` is S), ``expert [S + 1]``,
      ``token [S*16]``, ``assign [S*16]`` (t*k + j; T*k on padding rows), ``weight [S*16]`` (float32; 0 on
      padding rows), the three as rows of one int32 ``packed [3, S*16]`` (the weight as its bits; what the
      kernels read), ``weight_A [T*k]`` (the float32 routing weight in assignment order) and ``valid [T*k]``
      (bool: the assignment's expert is local).
    Assignments keep their (t, j) order inside an expert's blocks. Integer work only.

    ``share > 1``: ``experts_TK`` holds global ids of ``share`` devices of ``num_local`` experts each, and
    the blocks are those of the busiest device's experts (:func:`busiest_share`, then as above).

    ``impl`` 'kernel' / 'interpret' builds ``rows``, ``expert``, ``packed`` and ``valid`` (and with
    ``share > 1`` the busiest device's choice and shift) in one Pallas program
    (`jaxspec.kernels.block_routing`, up to its ``MAX_ASSIGNMENTS``), with the same values; ``packed`` is
    then longer than S*16 (padding the kernels never read).

    ``layer`` (a scalar int, may be traced): the experts are layer ``layer``'s of several layers' seen as
    one array, and ``expert`` holds ``layer * num_local`` plus the layer's id (the kernels' index; in the
    metadata program, where an XLA add would be a launch of its own). The rest is the layer's alone.
    ``counters`` > 0: ``counters`` [counters] int32 zeros too (the gate/up kernel's atomic counters, made by
    the metadata program where it runs: a memset would be a launch of its own).
    """
    if impl not in METADATA_IMPLS:
        raise ValueError(f"route_blocks: impl must be one of {METADATA_IMPLS}, found {impl!r}")
    if not isinstance(share, (int, np.integer)) or share < 1:
        raise ValueError(f"route_blocks: share must be an int >= 1, found {share!r}")
    share = int(share)
    T, k = experts_TK.shape
    a = T * k
    S = num_block_slots(T, k, num_local, group)
    flat = experts_TK.reshape(a).astype(jnp.int32)
    wbits = jax.lax.bitcast_convert_type(weights_TK.reshape(a).astype(jnp.float32), jnp.int32)
    if impl != "xla":
        outs = block_routing.block_metadata(
            flat,
            wbits,
            k=k,
            num_local=num_local,
            slots=S,
            block=BLOCK_M,
            group=group,
            interpret=impl == "interpret",
            share=share,
            layer=layer,
            counters=counters,
        )
        return kernel_metadata(outs, weights_TK)
    if share > 1:
        flat = busiest_share(flat, num_local, share)
    valid = (flat >= 0) & (flat < num_local)
    onehot = (flat[:, None] == jnp.arange(num_local, dtype=jnp.int32)[None, :]).astype(jnp.int32)  # [A, E]
    counts = onehot.sum(0)  # [E]
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)  # [A] position inside its expert
    nblk = ((counts + BLOCK_M - 1) // BLOCK_M + group - 1) // group * group
    bend = jnp.cumsum(nblk)
    bstart = bend - nblk
    e_safe = jnp.clip(flat, 0, num_local - 1)
    row = jnp.where(valid, bstart[e_safe] * BLOCK_M + rank, S * BLOCK_M)  # out of range -> dropped
    ids = jnp.arange(a, dtype=jnp.int32)
    # token, assignment and routing weight (its float32 bits) of each block row, in one scatter (three
    # were three kernels, ~9.6 us per layer at T = 1 on the H200). Padding rows name assignment A, one
    # past the last: their stores are masked off on the GPU; interpret mode writes a masked store back
    # as the old value, so it must not alias a live row.
    init = jnp.broadcast_to(jnp.array([[0], [a], [0]], jnp.int32), (3, S * BLOCK_M))
    packed = init.at[:, row].set(jnp.stack([ids // k, ids, wbits]), mode="drop")  # [3, S*16]
    slot = jnp.arange(S, dtype=jnp.int32)
    expert = jnp.sum(bend[None, :] <= slot[:, None], axis=1).astype(jnp.int32)  # owner of each slot
    e_clip = jnp.minimum(expert, num_local - 1)
    rows = jnp.where(
        expert < num_local, jnp.clip(counts[e_clip] - (slot - bstart[e_clip]) * BLOCK_M, 0, BLOCK_M), 0
    ).astype(jnp.int32)
    rows = jnp.concatenate([rows, jnp.zeros((1,), jnp.int32)])  # the spare slot (see num_slots)
    e_clip = jnp.concatenate([e_clip, jnp.zeros((1,), e_clip.dtype)]).astype(jnp.int32)
    if layer is not None:
        e_clip = e_clip + jnp.asarray(layer, jnp.int32) * num_local
    return {
        **({"counters": jnp.zeros((counters,), jnp.int32)} if counters else {}),
        "rows": rows,
        "expert": e_clip,
        "packed": packed,
        "token": packed[0],
        "assign": packed[1],
        "weight": jax.lax.bitcast_convert_type(packed[2], jnp.float32),
        "weight_A": jax.lax.bitcast_convert_type(wbits, jnp.float32),
        "valid": valid,
    }


def kernel_metadata(outs, weights_TK: jax.Array, plan: block_routing.Plan | None = None) -> dict[str, Any]:
    """:func:`route_blocks`' dict from the metadata program's outputs ``outs`` (`block_routing.block_metadata`'s,
    or those `kernels.routing.route_topk` builds beside the routing) for the routing weights ``weights_TK``.
    ``plan``: the `block_routing.Plan` they were built with, kept in the dict (``"plan"``) for
    :func:`moe_int4`'s check; without it, blocks of ``BLOCK_M`` rows."""
    rows, expert, packed, valid, *zeros = outs
    n = (rows.shape[0] - 1) * (BLOCK_M if plan is None else plan.block)  # S slots (and the spare)
    return {
        **({"plan": plan} if plan is not None else {}),
        **({"counters": zeros[0]} if zeros else {}),
        "rows": rows,
        "expert": expert,
        "packed": packed,
        "token": packed[0, :n],
        "assign": packed[1, :n],
        "weight": jax.lax.bitcast_convert_type(packed[2, :n], jnp.float32),
        "weight_A": weights_TK.reshape(-1).astype(jnp.float32),
        "valid": valid.astype(bool),  # a conversion XLA fuses into the combine that reads it
    }


def metadata_plan(
    tokens: int, k: int, num_local: int, d: int, f: int, *, share: int = 1, config: dict[str, Any] | None = None
) -> block_routing.Plan:
    """The static shape of the metadata :func:`moe_int4` builds for a call of ``tokens`` x top-``k`` over
    ``num_local`` experts of ``d`` inputs and ``f`` hidden units (``config`` as ``moe_int4``'s): what
    `kernels.routing.route_topk(blocks=...)` takes to build it in the routing's launch, for ``moe_int4(meta=...)``."""
    cfg = _config(config)
    group = cfg["m_group"] or auto_group(tokens, k, num_local, cfg["m_group_max"])
    counters = num_counters(cfg, tokens, k, num_local, group, d, f)
    return block_routing.Plan(num_local, num_block_slots(tokens, k, num_local, group), BLOCK_M, group, share, counters)


def metadata_impl(
    assignments: int, num_local: int, interpret: bool = False, config: dict[str, Any] | None = None
) -> str:
    """How :func:`moe_int4` builds its routing metadata for a call of ``assignments`` = T*k over ``num_local``
    experts: one Pallas program (interpret mode with the interpreted kernels, from 1 to
    ``block_routing.MAX_ASSIGNMENTS``; compiled where :func:`metadata_problem` finds none, from 1 to the
    config's ``meta_max_assignments``), else XLA. Either gives the same metadata."""
    if not 1 <= assignments <= block_routing.MAX_ASSIGNMENTS:
        return "xla"
    if interpret:
        return "interpret"
    limit = _config(config)["meta_max_assignments"]
    if not (isinstance(limit, int) and 0 <= limit <= block_routing.MAX_ASSIGNMENTS):
        raise ValueError(
            f"config['meta_max_assignments']: expected an int in 0..{block_routing.MAX_ASSIGNMENTS}, found {limit!r}"
        )
    if assignments > limit:
        return "xla"
    return "kernel" if metadata_problem(num_local) is None else "xla"


def same_metadata(want, got) -> bool:
    """Whether a metadata program's ``got`` = (rows, expert, packed, valid) equals XLA's ``want`` (the same fields of
    :func:`route_blocks` with ``impl="xla"``) exactly; ``got``'s packed may be wider (its columns past ``want``'s
    unused), its valid int32 where XLA's is bool."""
    width = np.shape(want[2])[1]
    return all(np.array_equal(w, g[:, :width] if np.ndim(g) == 2 else g) for w, g in zip(want, got))


@functools.cache
def metadata_problem(num_local: int = 48) -> str | None:
    """Why the compiled metadata kernel cannot serve ``num_local`` experts here, or None: a GPU backend,
    and first calls (8, 320 and 1024 top-8 assignments, a quarter on other devices; the second in blocks
    of two; and 128 of an 8-way mesh share's global ids, busiest device chosen in the program) whose
    metadata equals XLA's :func:`route_blocks` exactly, ``valid`` included. Safe to call while a jit is
    being traced (the model first asks inside one)."""
    from jaxspec.kernels import gpu_problem, run_compiled

    if (problem := gpu_problem(plgpu)) is not None:
        return problem
    try:

        def fields(a, b, group, impl, share):
            m = route_blocks(a, b, num_local, group, impl, share)
            return m["rows"], m["expert"], m["packed"], m["valid"]

        rng = np.random.default_rng(7)
        k = 8
        spread = max(k + 2, num_local + num_local // 3)  # ids past num_local: other devices' experts
        for t, group, share in ((1, 1, 1), (40, 2, 1), (128, 1, 1), (16, 1, 8)):
            if share == 1:
                ids = np.stack([rng.choice(spread, k, replace=False) for _ in range(t)]) - num_local // 6
            else:  # global ids over the share's devices
                ids = np.stack([rng.choice(share * num_local, k, replace=False) for _ in range(t)])
            ex = ids.astype(np.int32)
            wt = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
            want = run_compiled(functools.partial(fields, group=group, impl="xla", share=share), ex, wt)
            got = run_compiled(functools.partial(fields, group=group, impl="kernel", share=share), ex, wt)
            if not same_metadata(want, got):
                return f"the probe call's metadata ({t * k} assignments, share={share}) differs from XLA's"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"the probe call failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def _operands(experts) -> dict[str, jax.Array]:
    """The kernels' operand arrays (``gate_w``, ``gate_s``, ...) from the tiles-layout experts,
    every shape checked."""
    for name in PROJECTIONS:
        w = experts.get(name) if isinstance(experts, dict) else None
        if not quant.is_int4(w) or w.layout != quant.TILES:
            found = "missing" if w is None else f"{type(w).__name__} {getattr(w, 'layout', '')}".strip()
            raise ValueError(
                f"experts[{name!r}]: expected an Int4Weight in the tiles layout (relayout()), found {found}"
            )
        w.check(name)
    ops = {}
    for name in PROJECTIONS:
        ops[name + "_w"], ops[name + "_s"] = experts[name].packed, experts[name].scale
    return ops


def _shapes(ops):
    e, kb_d, f, _ = ops["gate_w"].shape
    _, kb_f, d, _ = ops["down_w"].shape
    expect = {
        "gate_w": (e, kb_d, f, 32),
        "up_w": (e, kb_d, f, 32),
        "down_w": (e, kb_f, d, 32),
        "gate_s": (e, kb_d, f, 4),
        "up_s": (e, kb_d, f, 4),
        "down_s": (e, kb_f, d, 4),
    }
    for name, shape in expect.items():
        if tuple(ops[name].shape) != shape or ops[name].dtype != jnp.int32:
            proj, part = name.split("_")
            part = "packed" if part == "w" else "scale"
            raise ValueError(
                f"experts[{proj!r}].{part}: expected int32 {shape}, found {ops[name].dtype} {tuple(ops[name].shape)}"
            )
    if kb_d * K_BLOCK != d or kb_f * K_BLOCK != f:
        raise ValueError(f"experts: inconsistent D={d}, F={f} with K blocks {kb_d}, {kb_f}")
    return e, d, f


def moe_int4(
    x_TD: jax.Array,
    experts_TK: jax.Array,
    weights_TK: jax.Array,
    experts: dict[str, quant.Int4Weight],
    *,
    num_local: int,
    interpret: bool = False,
    out_dtype=None,
    config: dict[str, Any] | None = None,
    poison_rows: bool = False,
    expert_layer: jax.Array | int | None = None,
    share: int = 1,
    dense=None,
    meta: dict[str, jax.Array] | None = None,
):
    """Routed-expert FFN with INT4 experts: ``y[t] = sum_k w[t,k] * FFN_{e[t,k]}(x[t])``.

    Args:
      x_TD: ``[T, D]`` activations (bf16 on GPU; float32 in interpret mode too); it may hold more rows
        than T (the zero-padded rows of `kernels.rms_norm`): only rows ``0 .. T-1`` are read.
      experts_TK: int ``[T, k]`` local expert ids; ids outside ``[0, num_local)`` belong to
        other devices: they contribute zero and their weights are not read. With ``share > 1``: global
        ids of ``share`` devices of ``num_local`` experts each, of which only the busiest device's
        contribute (:func:`busiest_share`; inside the metadata program where that builds the metadata).
      weights_TK: float ``[T, k]`` routing weights.
      experts: :func:`relayout` of the layer's local INT4 experts (``num_local`` of them), or with
        ``expert_layer`` several layers' experts seen as one array (``[L * num_local, ...]``, a free
        reshape of the stacked layers' ``[L, num_local, ...]``).
      num_local: number of local experts of one layer.
      expert_layer: with several layers' experts, this layer's index among them (may be traced, e.g.
        inside a scan over layers): its experts start at ``expert_layer * num_local``. The routing
        metadata is built over ``num_local`` experts and only the kernels' expert index is moved (by
        the metadata program itself where it builds the metadata), so the block count and the
        metadata's cost are those of one layer.
      share: devices whose experts ``experts_TK`` names (one device's share of a mesh,
        ``ModelConfig.share``: benchmarks); 1: the ids are local.
      interpret: run the kernels in Pallas interpret mode (CPU tests).
      out_dtype: output dtype; default ``x_TD.dtype``.
      config: overrides of :data:`DEFAULT_CONFIG` (benchmarks and tests only).
      poison_rows: fill the down kernel's output buffer (per-assignment rows) with NaN before it writes
        it (tests: proves that every row the combine keeps was written).
      dense: ``(x, stack, layer)``: a dense product ``x @ stack[layer]`` that the down kernel's launch runs
        beside its own programs (a MoE layer's shared expert's down projection: its padded rows ``[Mp, F]``
        from `kernels.routing`, its weights ``[L, F, D]`` read in place), as `stacked_matmul`'s programs
        with its tiles (:func:`down_rows`): one launch fewer a layer, on SMs the down kernel leaves idle.
      meta: the routing metadata built already (:func:`kernel_metadata` of the outputs of
        `kernels.routing.route_topk(blocks=metadata_plan(...))`, which routed ``experts_TK``, with this
        call's ``share`` and ``expert_layer``); None: built here (:func:`route_blocks`).

    Returns:
      ``[T, D]`` in ``out_dtype``; with ``dense``, ``(y, parts)``: parts the dense product's float32
      partials ``[ksplit, Mp, N]``, as `stacked_matmul` returns them (`stacked.Parts`).
    """
    cfg = _config(config)
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.triton is not importable")
    ops = _operands(experts)
    e, d, f = _shapes(ops)
    if (e != num_local) if expert_layer is None else (num_local < 1 or e % num_local):
        want = "num_local" if expert_layer is None else "a multiple of num_local (expert_layer given)"
        raise ValueError(f"experts hold {e} experts, expected {want}; num_local={num_local}")
    if x_TD.ndim != 2 or x_TD.shape[1] != d:
        raise ValueError(f"x_TD: expected [T, {d}], found {tuple(x_TD.shape)}")
    T, k = experts_TK.shape
    if x_TD.shape[0] < T or weights_TK.shape != (T, k):
        raise ValueError(
            f"experts_TK {tuple(experts_TK.shape)} and weights_TK {tuple(weights_TK.shape)} must agree on [T, k], "
            f"and x_TD needs at least T={T} rows; found x_TD {tuple(x_TD.shape)}"
        )
    dtype = jnp.dtype(x_TD.dtype)
    out_dtype = dtype if out_dtype is None else jnp.dtype(out_dtype)
    unpack = cfg["unpack"] or ("asm" if (not interpret and dtype == jnp.bfloat16) else "jnp")
    if unpack == "asm" and (interpret or dtype != jnp.bfloat16):
        raise ValueError("unpack='asm' needs the compiled kernel (interpret=False) and bf16 activations")
    plan = metadata_plan(T, k, num_local, d, f, share=share, config=config)
    group = plan.group
    if meta is None:
        impl = metadata_impl(T * k, num_local, interpret, config)
        # with expert_layer, `expert` indexes this layer's experts inside the stacked layers' array
        meta = route_blocks(experts_TK, weights_TK, num_local, group, impl, share, expert_layer, plan.counters)
    elif meta.get("plan") != plan:
        raise ValueError(
            f"moe_int4: meta was built for {meta.get('plan')}; this call's plan is {plan} (metadata_plan with the "
            "call's tokens, experts, share and config; kernel_metadata(..., plan) records it)"
        )
    y_rows = expert_rows(
        x_TD,
        meta,
        experts,
        group=group,
        interpret=interpret,
        config=cfg,
        poison_rows=poison_rows,
        _unpack=unpack,
        tokens=T,
        dense=dense,
    )
    if dense is not None:
        y_rows, parts = y_rows
        return combine(y_rows, meta["valid"], T, k, out_dtype), parts
    return combine(y_rows, meta["valid"], T, k, out_dtype)


def expert_rows(
    x_TD,
    meta,
    experts,
    *,
    group: int = 1,
    interpret: bool = False,
    config: dict[str, Any] | None = None,
    poison_rows: bool = False,
    _unpack: str | None = None,
    tokens: int | None = None,
    dense=None,
):
    """The expert kernels alone: float32 ``[T*k + 1, D]``, row ``t*k + j`` = weight * expert output.

    ``tokens``: the call's T where x holds padding rows past it (default: x's rows). ``dense``: see
    :func:`moe_int4` (then a pair: the rows and the dense product's partials).

    ``meta`` is :func:`route_blocks`'s result for the same ``group``. Rows of non-local assignments (and the last,
    spare row) are not written. :func:`moe_int4` = ``route_blocks`` + this + :func:`combine`.
    """
    cfg = _config(config)
    ops = _operands(experts)
    _, d, f = _shapes(ops)
    dtype = jnp.dtype(x_TD.dtype)
    unpack = _unpack or cfg["unpack"] or ("asm" if (not interpret and dtype == jnp.bfloat16) else "jnp")
    gu_bn, dn_bn = cfg["gu_block_n"], cfg["dn_block_n"]
    if f % gu_bn or d % dn_bn:
        raise ValueError(f"block sizes {gu_bn} / {dn_bn} must divide F={f} / D={d}")
    a = meta["valid"].shape[0]
    common = _common(dtype, unpack)
    tokens = x_TD.shape[0] if tokens is None else tokens
    n_gu, n_dn = counter_counts(cfg, tokens, num_slots(meta) // group, d, f)
    if n_gu + n_dn:  # the metadata program's zeroed counters where it built them (`metadata_plan`), else zeros
        counters = meta.get("counters")
        if counters is None or counters.shape != (n_gu + n_dn,):
            counters = jnp.zeros((n_gu + n_dn,), jnp.int32)
        h, counters = gate_up_rows(
            x_TD, meta, ops, gu_bn, cfg, common, interpret, group, tokens=tokens, counters=counters
        )
    else:
        h, counters = gate_up_rows(x_TD, meta, ops, gu_bn, cfg, common, interpret, group, tokens=tokens), None
    return down_rows(
        h,
        meta,
        ops,
        dn_bn,
        cfg,
        common,
        interpret,
        a,
        group,
        poison_rows,
        dense=dense,
        tokens=tokens,
        counters=counters,
        counter0=n_gu,
    )


def _common(dtype, unpack):
    return {"dtype": jnp.dtype(dtype), "unpack": unpack}


def _params(interpret, warps, stages):
    return None if interpret else plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def gu_plan(tokens: int, cfg: dict[str, Any], d: int) -> tuple[int, int]:
    """(K leaves, programs per tile) of the gate/up kernel for a call of ``tokens`` tokens at width ``d``."""
    kblocks = d // K_BLOCK
    leaves = default_ksplit(kblocks) if cfg["gu_ksplit"] is None else int(cfg["gu_ksplit"])
    if leaves < 1 or kblocks % leaves:
        raise ValueError(f"config['gu_ksplit']={leaves} must divide the {kblocks} K blocks of D={d}")
    programs = split_programs(tokens, leaves, cfg["gu_programs"], "gu_programs")
    return leaves, programs


def dn_plan(tokens: int, cfg: dict[str, Any], f: int) -> tuple[int, int]:
    """(K leaves, programs per tile) of the down kernel for a call of ``tokens`` tokens at hidden width ``f``."""
    kblocks = f // K_BLOCK
    leaves = 1 if cfg["dn_ksplit"] is None else int(cfg["dn_ksplit"])
    if leaves < 1 or kblocks % leaves:
        raise ValueError(f"config['dn_ksplit']={leaves} must divide the {kblocks} K blocks of F={f}")
    return leaves, split_programs(tokens, leaves, cfg["dn_programs"], "dn_programs")


def gu_stages(tokens: int, cfg: dict[str, Any]) -> int:
    """The gate/up kernel's pipeline stages for a call of ``tokens`` tokens: the first ``[t_max, stages]`` of
    ``gu_stage_rules`` with ``tokens <= t_max``, else ``gu_stages``. Every rule is checked, not only the one T
    picks."""
    pairs = _t_rules(cfg["gu_stage_rules"], "gu_stage_rules", "stages")
    for _, n in pairs + [(0, cfg["gu_stages"])]:
        if n < 1:
            raise ValueError(f"config['gu_stage_rules'] / ['gu_stages']: stages must be >= 1, found {n}")
    return next((n for t_max, n in pairs if tokens <= t_max), int(cfg["gu_stages"]))


def gu_finishes(cfg: dict[str, Any], programs: int) -> bool:
    """Whether the gate/up kernel's last program of a tile completes its tree (``gu_last_finishes``)."""
    return bool(cfg["gu_last_finishes"]) and programs > 1


def default_ksplit(kblocks: int) -> int:
    """The gate/up kernel's K leaves when the configuration leaves them open: 2 where the K blocks
    divide evenly, else 1. A function of the layer's width D alone (``kblocks = D / 256``), never of T."""
    return 2 if kblocks % 2 == 0 else 1


def gate_up_rows(x_TD, meta, ops, bn, cfg, common, interpret, group=1, *, tokens=None, counters=None):
    """First kernel: ``h = silu(x @ gate.T) * (x @ up.T)`` per block row, ``[S*16, F]`` in x's dtype.
    ``tokens``: the call's T, which picks the program count (``gu_programs``; default: x's rows). ``counters``:
    the call's zeroed counters (:func:`counter_counts`: the gate/up tiles' first, where its last programs finish);
    with them, returns ``(h, counters)``."""
    _, d, f = _shapes(ops)
    S = num_slots(meta)
    kblocks = d // K_BLOCK
    tokens = x_TD.shape[0] if tokens is None else tokens
    leaves, programs = gu_plan(tokens, cfg, d)
    finish = gu_finishes(cfg, programs)
    pair = counters is not None
    if finish and counters is None:
        counters = jnp.zeros(((S // group) * (f // bn),), jnp.int32)
    if programs == 1:
        out_shape = jax.ShapeDtypeStruct((S * BLOCK_M, f), x_TD.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((programs, S * BLOCK_M, f), jnp.float32),) * 2
    extra, aliases = (), {}
    if finish:  # h and the counters (zeroed by the metadata program where it runs) come out as well
        extra = (counters,)
        out_shape = (*out_shape, jax.ShapeDtypeStruct((S * BLOCK_M, f), x_TD.dtype), counters)
        aliases = {8: 3}
    out = pl.pallas_call(
        functools.partial(
            _gate_up_kernel,
            bn=bn,
            kblocks=kblocks,
            group=group,
            leaves=leaves,
            programs=programs,
            finish=finish,
            interpret=interpret,
            tiles=f // bn,
            flat=cfg["gu_leaf_loop"] == "flat",
            live_first=cfg["live_first"],
            **common,
        ),
        out_shape=out_shape,
        input_output_aliases=aliases,
        grid=_grid(S // group, f // bn, programs, cfg["live_first"]),
        interpret=interpret,
        compiler_params=_params(interpret, cfg["gu_warps"], gu_stages(tokens, cfg)),
        name="int4_moe_gate_up",
    )(
        meta["rows"],
        meta["expert"],
        meta["packed"],
        x_TD,
        ops["gate_w"],
        ops["gate_s"],
        ops["up_w"],
        ops["up_s"],
        *extra,
    )
    if finish:
        return (out[2], out[3]) if pair else out[2]
    if programs == 1:
        return (out, counters) if pair else out
    # The gate/up tile width: at T = 1 on a mesh share (~2 live slots) that is ~128 programs of 16 KB
    # each; 256-wide tiles made 16 programs of 128 KB, 5.3 us per layer on the H200 (docs/PERFORMANCE.md).
    # The tile partitions the outputs only: every element's sum over the splits is the same either way.
    cbn = bn
    h = pl.pallas_call(
        functools.partial(_silu_combine_kernel, bn=cbn, programs=programs, dtype=common["dtype"]),
        out_shape=jax.ShapeDtypeStruct((S * BLOCK_M, f), x_TD.dtype),
        grid=_grid(S, f // cbn),
        interpret=interpret,
        compiler_params=_params(interpret, 2, 1),
        name="int4_moe_silu_combine",
    )(meta["rows"], *out)
    return (h, counters) if pair else h


def down_rows(
    h,
    meta,
    ops,
    bn,
    cfg,
    common,
    interpret,
    a,
    group=1,
    poison_rows=False,
    dense=None,
    *,
    tokens=None,
    counters=None,
    counter0=0,
):
    """Second kernel: ``weight * (h @ down.T)`` at each assignment's row of ``[a + 1, D]`` float32.

    ``dense``: ``(x, stack, layer)``, a dense product run by the same launch's spare programs (``x @
    stack[layer]``: padded rows ``[Mp, K]``, weights ``[L, K, N]`` of their dtype): then ``(rows, parts)``, parts
    the float32 partials ``[ksplit, Mp, N]`` that `stacked_matmul` would return for it (`stacked.Parts`).
    ``tokens``: the call's T, which picks the K tree's program count (``dn_programs``; default: ``a``, the
    assignments). ``counters``: zeroed int32 counters, the tiles' from ``counter0`` (where the tree has several
    programs; default: zeros of its own)."""
    _, d, f = _shapes(ops)
    S = num_slots(meta)
    tiles = d // bn
    leaves, programs = dn_plan(a if tokens is None else tokens, cfg, f)
    plan = None if dense is None else _dense_plan(dense, S // group, tiles)
    # Rows of assignments to non-local experts are never written: the combine masks them. The
    # output buffer is not initialised (no memset), unless poison_rows asks for NaN in it.
    # One spare row (index a) for the padding rows of blocks (never written on the GPU).
    extra = (jnp.full((a + 1, d), jnp.nan, jnp.float32),) if poison_rows else ()
    out_shape = [jax.ShapeDtypeStruct((a + 1, d), jnp.float32)]
    aliases = {6: 0} if poison_rows else {}
    if programs > 1:  # the counters in (aliased to the last output); partials and counters out, after the rest
        if counters is None:
            counters, counter0 = jnp.zeros(((S // group) * tiles,), jnp.int32), 0
        aliases[len(extra) + 6] = 2 + int(plan is not None)
        extra = (*extra, counters)
    if plan is not None:
        x, stack, layer = dense
        extra = (*extra, jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1), x, stack)
        out_shape.append(jax.ShapeDtypeStruct((plan["ksplit"], x.shape[0], stack.shape[2]), jnp.float32))
    if programs > 1:
        out_shape += [jax.ShapeDtypeStruct((programs, S * BLOCK_M, d), jnp.float32), counters]
    out = pl.pallas_call(
        functools.partial(
            _down_kernel,
            bn=bn,
            kblocks=f // K_BLOCK,
            group=group,
            live_rows=bool(cfg["dn_live_rows"]),
            poisoned=poison_rows,
            dense=plan,
            leaves=leaves,
            programs=programs,
            flat=cfg["dn_leaf_loop"] == "flat",
            tiles=tiles,
            counter0=counter0,
            interpret=interpret,
            live_first=cfg["live_first"],
            **common,
        ),
        out_shape=tuple(out_shape),
        grid=_grid(S // group + (0 if plan is None else plan["rows"]), tiles, programs, cfg["live_first"]),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=_params(interpret, cfg["dn_warps"], cfg["dn_stages"]),
        name="int4_moe_down",
    )(meta["rows"], meta["expert"], meta["packed"], h, ops["down_w"], ops["down_s"], *extra)
    return (out[0], out[1]) if plan is not None else out[0]


def counter_counts(cfg: dict[str, Any], tokens: int, slots: int, d: int, f: int) -> tuple[int, int]:
    """The int32 counters of a call's gate/up and down kernels (in that order in one array), for ``slots`` block
    slots (of ``group`` blocks): one per gate/up tile where the last of a tile's programs finishes it
    (``gu_last_finishes``), one per down tile where its K tree has several programs (``dn_programs``)."""
    _, gu = gu_plan(tokens, cfg, d)
    _, dn = dn_plan(tokens, cfg, f)
    return (
        slots * (f // cfg["gu_block_n"]) if gu_finishes(cfg, gu) else 0,
        slots * (d // cfg["dn_block_n"]) if dn > 1 else 0,
    )


def num_counters(cfg: dict[str, Any], tokens: int, k: int, num_local: int, group: int, d: int, f: int) -> int:
    """The int32 counters the expert kernels of a call count in (zeroed by the metadata program):
    :func:`counter_counts`, both kernels'."""
    return sum(counter_counts(cfg, tokens, num_block_slots(tokens, k, num_local, group) // group, d, f))


def combine(y_rows: jax.Array, valid: jax.Array, T: int, k: int, out_dtype) -> jax.Array:
    """``y[t] = ((r[t*k] + r[t*k+1]) + ...)`` in k order, non-local rows as 0, cast to out_dtype."""
    a, d = valid.shape[0], y_rows.shape[1]
    y = jnp.where(valid[:, None], y_rows[:a], 0.0).reshape(T, k, d)
    acc = y[:, 0]
    for j in range(1, k):  # fixed order over the token's k experts
        acc = acc + y[:, j]
    return acc.astype(out_dtype)
