"""DeepSeek-V3 "noaux_tc" routing of a call's tokens in one Pallas kernel (Triton lowering), and beside
it the shared expert's SiLU-gated product.

``route_topk(logits_TE, bias_E, ...)`` returns the same ``(experts [T, k] int32, weights [T, k] float32)``
as :func:`jaxspec.model.route`:

* scores = sigmoid(logits); the selection uses scores + bias (the bias never enters a weight);
* with ``n_group > 1`` a group's score is the sum of its two largest biased scores, and only the
  ``topk_group`` best groups stay eligible;
* the ``k`` largest biased scores are chosen, the lower expert id first among equal values (the
  order of ``lax.top_k``); their weights are the unbiased scores, divided by their sum (when
  ``norm``) and multiplied by ``scale``.

Why a kernel: under XLA the routing of a decode step is several launches (the sigmoid and the
bias, a sort-based top-k, the gather of the weights and their normalisation), about 8 us per
layer at batch 1 and 11 at batch 8 on the H200 (``scripts/profile_layer.py``, docs/PERFORMANCE.md),
for a few kilobytes of data. Here it is one launch.

What it reads. In a MoE layer one dense kernel call (`kernels.stacked_matmul`) makes three products of
the norm's rows: the router's logits [T, E] and the shared expert's gate and up [T, F]. It leaves them as
float32 K-split partials ``[ksplit, padded_rows(T), N]`` (`stacked.Parts`), which XLA would add in two
launches of its own: a slice-and-add of the logits (~1.0 us at batch 1) and a fusion that adds gate's
and up's partials, rounds them, multiplies ``silu(gate) * up`` and zero-pads the rows for the shared
expert's down projection (~1.9 us). This kernel takes both jobs, two XLA launches fewer per layer. On
the H200 under Nsight Compute (Kimi's E = 384, k = 8, 16 K parts, one token; profiled kernels run slower
than unprofiled ones) the three kernels took 2.3 + 3.8 + 2.8 us at F = 256 (2.3 + 3.8 + 3.1 at 2048) and
this one 6.5 (6.7):

* the logits may be a `stacked.Parts`; the kernel adds a value's partials in ascending order in float32
  and rounds to the logits' dtype, as `stacked.Parts.value` does (`stacked_matmul.sum_parts`), so the
  routing has the bits of ``route_topk(logits.value, ...)``. The picked experts' unbiased scores are
  read again afterwards (their partials added again, in the same order: the same bits);
* with ``gate_up=(gate, up)`` (each a `stacked.Parts` or an array [T, F], of the compute dtype) it also
  writes ``h = silu(gate) * up`` as ``padded_rows(T)`` rows [Mp, F] of that dtype, rows T.. zero: the
  zero-padded copy the down projection's dense kernel reads as its own (`stacked.Rows`).

Grid. Without ``gate_up``: ``(T,)``, one program (one warp) routes one token. With it: ``(padded_rows(T),
1 + ceil(F / H_BLOCK))``: program ``(t, 0)`` routes token t (none past T), program ``(t, c)`` for c >= 1
writes columns ``H_BLOCK (c - 1) ..`` of h's row t (zeros for t >= T). The routing (k dependent
reductions, latency-bound) and the gated product (loads of 2 x ksplit partials, memory-bound) so run in
separate warps side by side, and a wide F (2048) spreads over 8 programs a row rather than one warp.

A token's row goes through the same instructions whatever T is and whichever tokens share the call
(selections by max and lowest index are exact; the weights' sum is taken in selection order; h's column
blocks depend on F alone), so a token is routed, and its h row made, alike in a decode step and in a
verify. Compiled, the sigmoid is Triton's ``1 / (1 + exp(-x))`` (a hardware exp2) and may differ from
XLA's in the last bits, so near-ties can pick differently from :func:`jaxspec.model.route`; in interpret
mode it is XLA's. Availability is probed per routing configuration on the device (:func:`available`).

h's rounding, fixed for every call: g and u (the summed partials) rounded to the dtype; ``silu(g) = g *
sigmoid(g)`` in float32 from the rounded g, rounded to the dtype; the product of the two rounded values in
float32, rounded to the dtype (:func:`reference_h` in XLA ops). In float32 that is XLA's ``jax.nn.silu(g)
* u`` bit for bit (interpret mode). In bfloat16 XLA's own form is not one rounding: it may fuse the chain
with float32 intermediates (excess precision), and its bfloat16 sigmoid, expanded as ``1 / (1 + exp(-x))``,
rounds every step to bfloat16 (seen on the CPU and on the H200 alike), so the kernel's h differs from it by
up to a few ulps (3 seen; a third of the values by one or more): the XLA path and this one are two
roundings of the same product, each the same for every call and every T.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxspec import stacked
from jaxspec.kernels import block_routing, stacked_matmul

try:  # the Triton lowering's load / store with masks and compiler parameters (GPU builds)
    from jax.experimental.pallas import triton as plgpu
except Exception:  # noqa: BLE001 - optional
    plgpu = None

BLOCK_T = 1  # tokens per program: a row's reductions stay within one warp (no barrier)
WARPS = 1
# "fused_max_tokens": `route_topk(blocks=...)` (one program routes every token, then builds the experts' metadata
# with `block_routing.WARPS` warps) serves calls up to this many tokens, and the model asks for it up to this many.
# 0: the metadata's own launch always. 2, measured (H100, the share of 8, docs/PERFORMANCE.md run 43): against the
# two launches the one program gains 1.3 us a layer at 1 token and 0.4 at 2, and loses 8 at 4 (the batch-1
# verify: 16.3 us against 3.8 + 4.6) and 35 at 8 (a batch-8 decode step: 45.0 against 3.7 + 5.8). Its routing of T
# tokens in one [pow2(T), E] block on 4 warps grows with T where T programs of one warp each do not.
DEFAULT_CONFIG = {"fused_max_tokens": 2}
H_BLOCK = 256  # h's columns per program (gate_up): 8 a thread of the one warp, 2 x ksplit loads of each


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _first_max(v, cols, width):
    """(row max, lowest column holding it) of v [BT, width]."""
    m = jnp.max(v, axis=1)
    i = jnp.min(jnp.where(v == m[:, None], cols, width), axis=1)
    return m, i


def _summed(ref, rows, cols, mask, dtype):
    """The values at (rows, cols) of a product held as partials ``ref [ksplit, rows, N]``, in float32: the
    parts added in ascending order in float32 and rounded to ``dtype`` (`stacked.Parts.value`); an array
    given whole is one part of its own dtype (the rounding then changes nothing)."""
    acc = None
    for p in range(ref.shape[0]):
        v = plgpu.load(ref.at[jnp.full(cols.shape, p, jnp.int32), rows, cols], mask=mask, other=0.0)
        acc = v.astype(jnp.float32) if acc is None else acc + v.astype(jnp.float32)
    return acc.astype(dtype).astype(jnp.float32)


def _route(
    t0,
    layer_ref,
    logits_ref,
    bias_ref,
    ex_ref,
    wt_ref,
    *,
    bt=1,
    T,
    E,
    EP,
    k,
    KP,
    n_group,
    topk_group,
    norm,
    scale,
    ldt,
    interpret,
):
    """Routes tokens ``t0 .. t0 + bt - 1``: their experts and weights into rows t0.. of ex_ref, wt_ref. A
    token's row takes the same steps whatever ``bt`` is (elementwise, and reductions by max and lowest index)."""
    rows = t0 + jax.lax.broadcasted_iota(jnp.int32, (bt, EP), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (bt, EP), 1)
    live = (rows < T) & (cols < E)
    # interpret mode reads the masked addresses too: there they are clamped into the arrays. Compiled, the
    # masks alone guard them, and the columns stay an iota the Triton compiler sees as contiguous (vector
    # loads: 8.0 -> 6.6 us a 19-token call with 16 K parts on the H200, under ncu)
    cl = (lambda v, n: jnp.minimum(v, n - 1)) if interpret else (lambda v, n: v)  # noqa: E731
    logits = _summed(logits_ref, cl(rows, T), cl(cols, E), live, ldt)
    c1 = jax.lax.broadcasted_iota(jnp.int32, (EP,), 0)
    lyr = jnp.full((EP,), layer_ref[0], jnp.int32)  # the bias stack's row, read in place
    bias = plgpu.load(bias_ref.at[lyr, cl(c1, E)], mask=c1 < E, other=0.0).astype(jnp.float32)
    scores = jax.nn.sigmoid(logits)
    neg = jnp.float32(-jnp.inf)
    choice = jnp.where(cols < E, scores + bias[None, :], neg)
    if n_group > 1:
        size = E // n_group
        grp = cols // size  # pad columns fall in no group below n_group
        gscore = []
        for g in range(n_group):
            v = jnp.where(grp == g, choice, neg)
            m1, i1 = _first_max(v, cols, EP)
            m2 = jnp.max(jnp.where(cols == i1[:, None], neg, v), axis=1)
            gscore.append(m1 + m2)
        kept = [jnp.zeros((bt,), jnp.bool_) for _ in range(n_group)]
        for _ in range(topk_group):  # best remaining group, the lower index first among equal scores
            best = jnp.full((bt,), neg)
            best_g = jnp.full((bt,), n_group, jnp.int32)
            for g in range(n_group):
                s = jnp.where(kept[g], neg, gscore[g])
                better = s > best
                best = jnp.where(better, s, best)
                best_g = jnp.where(better, g, best_g)
            kept = [kept[g] | (best_g == g) for g in range(n_group)]
        eligible = jnp.zeros((bt, EP), jnp.bool_)
        for g in range(n_group):
            eligible = eligible | (kept[g][:, None] & (grp == g))
        choice = jnp.where(eligible, choice, neg)
    kcols = jax.lax.broadcasted_iota(jnp.int32, (bt, KP), 1)
    experts = jnp.zeros((bt, KP), jnp.int32)
    for j in range(k):  # one (value, index) reduction per pick: the lower index among equal values
        i = jnp.argmax(choice, axis=1).astype(jnp.int32)
        choice = jnp.where(cols == i[:, None], neg, choice)
        experts = jnp.where(kcols == j, i[:, None], experts)
    # the picks' unbiased scores: their logits read (their partials added) again, through the same
    # sigmoid: the same bits (on the H200 a reload beat k masked reductions of the scores held)
    krows = t0 + jax.lax.broadcasted_iota(jnp.int32, (bt, KP), 0)
    kmask = (krows < T) & (kcols < k)
    picked = _summed(logits_ref, jnp.minimum(krows, T - 1), jnp.minimum(experts, E - 1), kmask, ldt)
    weights = jnp.where(kmask, jax.nn.sigmoid(picked), 0.0)
    if norm:
        total = None
        for j in range(k):  # added in pick order (each term is one element: exact)
            w = jnp.sum(jnp.where(kcols == j, weights, 0.0), axis=1)
            total = w if total is None else total + w
        weights = weights / (total + jnp.float32(1e-20))[:, None]
    weights = weights * jnp.float32(scale)
    ex_ref[pl.ds(t0, bt), :] = experts
    wt_ref[pl.ds(t0, bt), :] = weights


def _gated(t, c, gate_ref, up_ref, h_ref, *, T, F, FB, hdt):
    """Columns ``FB c ..`` of h's row t: silu(g) * u with the module docstring's rounding, or zeros past T."""
    cols = c * FB + jax.lax.broadcasted_iota(jnp.int32, (1, FB), 1)
    live = cols < F
    row = jnp.full((1, FB), t, jnp.int32)

    @pl.when(t < T)
    def _():
        g = _summed(gate_ref, row, cols, live, hdt)  # every load first: the program waits on memory
        u = _summed(up_ref, row, cols, live, hdt)
        act = (g * jax.nn.sigmoid(g)).astype(hdt).astype(jnp.float32)
        plgpu.store(h_ref.at[row, cols], (act * u).astype(hdt), mask=live)

    @pl.when(t >= T)
    def _():
        plgpu.store(h_ref.at[row, cols], jnp.zeros((1, FB), hdt), mask=live)


def _kernel(*refs, gate_up, FB, F, hdt, blocks, **kw):
    refs = list(refs)
    layer_ref, logits_ref, bias_ref = refs[:3]
    gate_ref, up_ref = refs[3:5] if gate_up else (None, None)
    refs = refs[5 if gate_up else 3 :]
    elayer_ref = refs.pop(0) if blocks is not None else None
    ex_ref, wt_ref = refs[:2]
    h_ref = refs[2] if gate_up else None
    meta_refs = refs[3 if gate_up else 2 :]
    t = pl.program_id(0)
    c = pl.program_id(1) if gate_up else 0

    if blocks is not None:  # one program routes every token, then builds the experts' block metadata

        @pl.when((t == 0) & (c == 0))
        def _():
            _route(0, layer_ref, logits_ref, bias_ref, ex_ref, wt_ref, bt=ex_ref.shape[0], **kw)
            if not kw["interpret"]:  # the routing's stores land before the other threads read them back
                plgpu.debug_barrier()
            k = kw["k"]
            rows_ref, expert_ref, packed_ref, valid_ref, *zero_refs = meta_refs
            block_routing.build(
                lambda src: plgpu.load(ex_ref.at[src // k, src % k]),
                lambda src, mask: jax.lax.bitcast_convert_type(
                    plgpu.load(wt_ref.at[src // k, src % k], mask=mask, other=0.0), jnp.int32
                ),
                elayer_ref[0],
                rows_ref,
                expert_ref,
                packed_ref,
                valid_ref,
                zero_refs,
                **blocks,
            )

    elif not gate_up:
        _route(t * BLOCK_T, layer_ref, logits_ref, bias_ref, ex_ref, wt_ref, bt=BLOCK_T, **kw)
    else:

        @pl.when((c == 0) & (t < kw["T"]))
        def _():
            _route(t, layer_ref, logits_ref, bias_ref, ex_ref, wt_ref, bt=BLOCK_T, **kw)

    if gate_up:

        @pl.when(c > 0)
        def _():
            _gated(t, c - 1, gate_ref, up_ref, h_ref, T=kw["T"], F=F, FB=FB, hdt=hdt)


def _operand(name: str, v, what: str):
    """(the partials ``[ksplit, rows, N]`` the kernel reads, the value's dtype, its [T, N] shape) of a
    `stacked.Parts` or an array (one part of its own)."""
    if isinstance(v, stacked.Parts):
        p, shape = v.parts, tuple(v.shape)
        if len(shape) != 2 or p.ndim != 3 or p.shape[2] != shape[1] or p.shape[1] < shape[0]:
            raise ValueError(
                f"route_topk: {name} as stacked.Parts must be {what} held as partials [ksplit, >= T, N]; "
                f"found shape {shape}, partials {tuple(p.shape)}"
            )
        return p, jnp.dtype(v.dtype), shape
    if v.ndim != 2:
        raise ValueError(f"route_topk: {name} must be {what}, found shape {tuple(v.shape)}")
    return v[None], jnp.dtype(v.dtype), tuple(v.shape)


def route_topk(
    logits_TE,
    bias_E: jax.Array,
    *,
    k: int,
    n_group: int = 1,
    topk_group: int = 1,
    norm: bool = True,
    scale: float = 1.0,
    interpret: bool = False,
    layer: jax.Array | int | None = None,
    gate_up=None,
    blocks: block_routing.Plan | None = None,
    expert_layer: jax.Array | int | None = None,
):
    """(experts [T, k] int32, weights [T, k] float32): the routing of :func:`jaxspec.model.route`; with
    ``gate_up``, (experts, weights, h); with ``blocks``, one more entry: the metadata tuple.

    logits_TE: the router's logits [T, E] (float32 or narrower; upcast in the kernel), or their
    `stacked.Parts` (the dense kernel's float32 partials, added here in ascending order and rounded to the
    Parts' dtype: the routing of ``logits.value``); bias_E: the selection bias [E], or with ``layer`` (a
    scalar int, may be traced) the stacked layers' biases [L, E], of which the kernel reads row ``layer`` in
    place (a slice would be a launch of its own inside a scan).
    gate_up: None, or ``(gate, up)``, the shared expert's products [T, F] of one (compute) dtype, each an
    array or a `stacked.Parts`; then ``h`` [padded_rows(T), F] of that dtype is returned as well, its rows
    < T ``silu(gate) * up`` (rounded as the module docstring says), the rest zero: the padded rows the down
    projection's dense kernel reads (`stacked.Rows`).
    blocks: a `block_routing.Plan`: the launch also builds the INT4 expert kernels' routing metadata of the
    picked experts (`block_routing.block_metadata`'s outputs for ``experts.reshape(-1)`` and the weights'
    bits: rows, expert, packed, valid and, with ``blocks.counters``, the zeroed counters), one launch where
    there were two. One program then routes all T tokens (at most the ``fused_max_tokens`` config) and goes on
    to the metadata passes; the routing's values are the same as one token a program (module docstring).
    ``expert_layer`` (a scalar int, may be traced): the metadata's ``expert`` counts from
    ``expert_layer * blocks.num_local`` (`block_routing`'s ``layer``).
    ``interpret``: Pallas interpret mode (CPU tests).
    """
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.triton is not importable")
    lparts, ldt, (T, E) = _operand("logits", logits_TE, "[T, E]")
    most = DEFAULT_CONFIG["fused_max_tokens"]
    if blocks is not None and not 1 <= T <= most:
        raise ValueError(f"route_topk: blocks= serves 1..{most} tokens (the fused_max_tokens config), found T={T}")
    if blocks is None and expert_layer is not None:
        raise ValueError("route_topk: expert_layer= places the metadata that blocks= builds; found no blocks")
    if layer is None and bias_E.shape != (E,):
        raise ValueError(f"route_topk: bias must be [{E}] (one per expert), found shape {tuple(bias_E.shape)}")
    if layer is not None and (bias_E.ndim != 2 or bias_E.shape[1] != E):
        raise ValueError(f"route_topk: with layer=, bias must be [L, {E}] (stacked), found {tuple(bias_E.shape)}")
    if n_group < 1 or E % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"route_topk: n_group={n_group}, topk_group={topk_group} do not fit E={E}")
    if n_group > 1 and E // n_group < 2:
        raise ValueError(f"route_topk: groups of {E // n_group} expert(s); a group's score needs two")
    if not 1 <= k <= (E // n_group) * topk_group:
        raise ValueError(f"route_topk: k={k} must be in [1, {(E // n_group) * topk_group}] (the eligible experts)")
    has_h = gate_up is not None
    F, hdt, hparts = 0, None, ()
    if has_h:
        if not isinstance(gate_up, (tuple, list)) or len(gate_up) != 2:
            raise ValueError(f"route_topk: gate_up must be a pair (gate, up), found {type(gate_up).__name__}")
        (gp, gdt, gshape), (up, udt, ushape) = (_operand(n, v, "[T, F]") for n, v in zip(("gate", "up"), gate_up))
        if gshape[0] != T or ushape != gshape:
            raise ValueError(
                f"route_topk: gate_up's gate and up must both be [T, F] with the logits' T={T}; found gate "
                f"{gshape} and up {ushape}"
            )
        if gdt != udt or not jnp.issubdtype(gdt, jnp.floating):
            raise ValueError(f"route_topk: gate_up's gate and up must share a float dtype, found {gdt} and {udt}")
        F, hdt, hparts = gshape[1], gdt, (gp, up)
    Mp = stacked_matmul.padded_rows(T)
    if T == 0:
        empty = (jnp.zeros((0, k), jnp.int32), jnp.zeros((0, k), jnp.float32))
        return (*empty, jnp.zeros((Mp, F), hdt)) if has_h else empty
    EP, KP = _pow2(E), _pow2(k)
    fused = blocks is not None
    tp = _pow2(T) if fused else -(-T // BLOCK_T) * BLOCK_T
    FB = min(H_BLOCK, max(16, _pow2(F)))
    meta_kw = None
    if fused:  # the metadata program's static keywords: the plan's but the counters' count (an output shape)
        shape = {n: v for n, v in blocks._asdict().items() if n != "counters"}
        meta_kw = block_routing.statics(T * k, k=k, **shape)
    kernel = functools.partial(
        _kernel,
        gate_up=has_h,
        FB=FB,
        F=F,
        hdt=hdt,
        blocks=meta_kw,
        T=T,
        E=E,
        EP=EP,
        k=k,
        KP=KP,
        n_group=n_group,
        topk_group=topk_group,
        norm=bool(norm),
        scale=float(scale),
        ldt=ldt,
        interpret=bool(interpret),
    )
    warps = block_routing.WARPS if fused else WARPS
    params = None if interpret else plgpu.CompilerParams(num_warps=warps, num_stages=1)
    out_shape = [jax.ShapeDtypeStruct((tp, KP), jnp.int32), jax.ShapeDtypeStruct((tp, KP), jnp.float32)]
    grid = (1,) if fused else (tp // BLOCK_T,)
    if has_h:
        out_shape.append(jax.ShapeDtypeStruct((Mp, F), hdt))
        grid = (Mp, 1 + -(-F // FB))
    extra = ()
    if fused:
        out_shape += block_routing.out_shapes(T * k, blocks.slots, blocks.block, blocks.counters)
        extra = (jnp.asarray(0 if expert_layer is None else expert_layer, jnp.int32).reshape(1),)
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=grid,
        interpret=interpret,
        compiler_params=params,
        name="route_topk_blocks" if fused else "route_topk",
    )(
        jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1),
        lparts,
        bias_E[None] if layer is None else bias_E,
        *hparts,
        *extra,
    )
    experts, weights = outs[0][:T, :k], outs[1][:T, :k]
    head = (experts, weights, outs[2]) if has_h else (experts, weights)
    return (*head, tuple(outs[len(head) :])) if fused else head


def probe_inputs(T: int, E: int, n_group: int = 1, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(logits [T, E], bias [E]) whose biased scores lie far apart, so that any correct routing picks the
    same experts: each row of logits a permutation of an evenly spaced grid; the bias a step of 2 per
    group (a group's score, the sum of its two best, then differs from the next group's by more than 2)
    plus a spread below the grid's step. The availability probe's input."""
    rng = np.random.default_rng(seed)
    grid = np.linspace(-3.0, 3.0, E, dtype=np.float32)
    logits = np.stack([rng.permutation(grid) for _ in range(T)])
    bias = 2.0 * (np.arange(E) // (E // n_group)) + np.linspace(0.0, 1e-4, E)
    return logits, bias.astype(np.float32)


def reference_h(gate, up) -> jax.Array:
    """h's real rows [T, F] in XLA ops with the kernel's rounding (the module docstring): gate and up arrays
    or `stacked.Parts` of one dtype. (XLA may still fuse the rounding away on the GPU: bits not guaranteed
    there.)"""
    g, u = stacked.value(gate), stacked.value(up)
    dt, f32 = g.dtype, jnp.float32
    g32 = g.astype(f32)
    act = (g32 * jax.nn.sigmoid(g32)).astype(dt).astype(f32)
    return (act * u.astype(f32)).astype(dt)


def reference_route(logits, bias, k: int, n_group: int, topk_group: int, norm: bool, scale: float):
    """:func:`route_topk`'s definition in numpy (float64): (experts [T, k], weights [T, k])."""
    scores = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))
    choice = scores + np.asarray(bias, np.float64)
    T, E = choice.shape
    if n_group > 1:
        top2 = np.sort(choice.reshape(T, n_group, E // n_group), axis=-1)[..., -2:].sum(-1)
        keep = np.argsort(-top2, axis=1, kind="stable")[:, :topk_group]
        mask = np.zeros((T, n_group), bool)
        np.put_along_axis(mask, keep, True, axis=1)
        choice = np.where(np.repeat(mask, E // n_group, axis=1), choice, -np.inf)
    experts = np.argsort(-choice, axis=1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, experts, axis=1)
    if norm:
        weights = weights / (weights.sum(1, keepdims=True) + 1e-20)
    return experts.astype(np.int32), weights * scale


@functools.cache
def available(
    num_experts: int = 384, k: int = 8, n_group: int = 1, topk_group: int = 1, norm: bool = True, scale: float = 2.5
) -> str | None:
    """Why the compiled kernel cannot route this configuration here, or None if it can: a GPU backend with
    Pallas' Triton lowering, and first calls at this configuration (1 and 19 tokens of logits, then 3
    tokens in a decode layer's form: the logits, gate and up as `stacked.Parts`) that pick the experts of
    :func:`reference_route` in its order, with weights within 1e-5 of its, and (the last call) an h whose
    padding rows are zero and whose rows are :func:`reference_h`'s within a few bfloat16 ulps. Safe to call
    while a jit is being traced (the model first asks inside one)."""
    from jaxspec.kernels import gpu_problem, run_compiled

    if (problem := gpu_problem(plgpu)) is not None:
        return problem
    try:
        opts = dict(k=k, n_group=n_group, topk_group=topk_group, norm=norm, scale=scale)
        for T in (1, 19):
            logits, bias = probe_inputs(T, num_experts, n_group)
            ex, wt = run_compiled(lambda a, b: route_topk(a, b, **opts), logits, bias)
            want_e, want_w = reference_route(logits, bias, **opts)
            if not np.array_equal(ex, want_e):
                return f"the probe call ({T} tokens) chose other experts than the reference"
            if not np.allclose(wt, want_w, rtol=1e-5, atol=0):
                return f"the probe call's ({T} tokens) weights differ from the reference"
        # a decode layer's call: the logits and the shared expert's gate and up as two K parts each (the
        # logits' halves, which add back exactly), h two column blocks wide
        T, F, E = 3, 2 * H_BLOCK, num_experts
        logits, bias = probe_inputs(T, E, n_group)
        mp = stacked_matmul.padded_rows(T)
        lp = np.zeros((2, mp, E), np.float32)
        lp[:, :T] = logits / 2
        gu = np.random.default_rng(0).normal(size=(2, 2, mp, F)).astype(np.float32)
        part = lambda p, n, dt: stacked.Parts(p, (T, n), jnp.dtype(dt))  # noqa: E731
        gated = lambda g, u: (part(g, F, jnp.bfloat16), part(u, F, jnp.bfloat16))  # noqa: E731
        ex, wt, h = run_compiled(
            lambda a, b, g, u: route_topk(part(a, E, jnp.float32), b, **opts, gate_up=gated(g, u)), lp, bias, *gu
        )
        want_e, want_w = reference_route(logits, bias, **opts)
        want_h = run_compiled(lambda g, u: reference_h(*gated(g, u)), *gu).astype(np.float64)
        if not np.array_equal(ex, want_e) or not np.allclose(wt, want_w, rtol=1e-5, atol=0):
            return "the probe call with partials and gate_up routed otherwise than the reference"
        if h.shape != (mp, F) or np.any(h[T:].astype(np.float32) != 0):
            return "the probe call with gate_up did not zero h's padding rows"
        if not np.allclose(h[:T].astype(np.float64), want_h, rtol=2**-5, atol=1e-6):
            return "the probe call's h differs from the reference"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"the probe call failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None


def blocks_problem(
    num_experts: int = 384,
    k: int = 8,
    n_group: int = 1,
    topk_group: int = 1,
    norm: bool = True,
    scale: float = 2.5,
    num_local: int = 48,
    share: int = 8,
) -> str | None:
    """Why the compiled `route_topk(blocks=...)` (the routing and the experts' metadata in one launch) cannot
    serve this configuration here up to the ``fused_max_tokens`` config, or None (`_blocks_problem`, cached
    per configuration and limit). Safe to call while a jit is being traced."""
    most = DEFAULT_CONFIG["fused_max_tokens"]
    return _blocks_problem(num_experts, k, n_group, topk_group, bool(norm), float(scale), num_local, share, most)


@functools.cache
def _blocks_problem(num_experts, k, n_group, topk_group, norm, scale, num_local, share, most) -> str | None:
    """The routing kernel (:func:`available`) and the metadata program (`int4_moe.metadata_problem`) pass their
    own probes, and first calls of the fused launch at 1, 5 and ``most`` tokens (as many as ``most`` allows), in
    the form a decode layer calls it (the logits and the shared expert's gate and up as the dense kernel's
    `stacked.Parts`; global ids of ``share`` devices where ``share > 1``; blocks of one and of two; counters to
    zero) give:

    * experts, weights and h of the same bytes as the one-token-a-program launch (`route_topk` without
      ``blocks``), which serves the calls past ``most``: a token is routed alike in a decode step and in a
      larger verify. The logits hold near-ties (values repeated across experts, so the lowest index decides);
    * the experts and weights of :func:`reference_route` (weights within 1e-5) on the probe's spread inputs;
    * from the experts picked, the metadata of XLA's `int4_moe.route_blocks` exactly, every counter zero."""
    from jaxspec.kernels import int4_moe, run_compiled

    opts = dict(k=k, n_group=n_group, topk_group=topk_group, norm=norm, scale=scale)
    if (problem := available(num_experts, **opts)) is not None:
        return problem
    if (problem := int4_moe.metadata_problem(num_local)) is not None:
        return problem
    if most < 1:
        return "the fused_max_tokens config is 0"
    try:
        F = 2 * H_BLOCK
        for T, group in sorted({(1, 1), (min(5, most), 2), (most, 1)}):
            slots = int4_moe.num_block_slots(T, k, num_local, group)
            plan = block_routing.Plan(num_local, slots, int4_moe.BLOCK_M, group, share, counters=3 * T + 5)
            mp = stacked_matmul.padded_rows(T)
            rng = np.random.default_rng(T)
            # near-ties: each row's logits drawn from a few values, split over two exact halves
            ties = rng.choice(np.linspace(-2.0, 2.0, 7, dtype=np.float32), size=(T, num_experts))
            spread, bias = probe_inputs(T, num_experts, n_group, seed=T)
            gu = rng.normal(size=(2, 2, mp, F)).astype(np.float32)

            def parts(lp, g, u, T=T):
                part = lambda p, w, dt: stacked.Parts(p, (T, w), jnp.dtype(dt))  # noqa: E731
                return part(lp, num_experts, jnp.float32), (part(g, F, jnp.bfloat16), part(u, F, jnp.bfloat16))

            def fused(lp, b, g, u, plan=plan):
                lg, gate_up = parts(lp, g, u)
                ex, wt, h, outs = route_topk(lg, b, **opts, gate_up=gate_up, blocks=plan, expert_layer=2)
                return ex, wt, h, *outs

            def apart(lp, b, g, u):
                lg, gate_up = parts(lp, g, u)
                return route_topk(lg, b, **opts, gate_up=gate_up)

            for name, logits in (("near-tie", ties), ("spread", spread)):
                lp = np.zeros((2, mp, num_experts), np.float32)
                lp[:, :T] = logits / 2  # two K parts that add back exactly
                ex, wt, h, rows, expert, packed, valid, zeros = run_compiled(fused, lp, bias, *gu)
                one = run_compiled(apart, lp, bias, *gu)
                if any(a.tobytes() != b.tobytes() for a, b in zip((ex, wt, h), one)):
                    return f"the probe call with blocks ({T} tokens, {name}) routed otherwise than route_topk alone"
                if name == "spread":
                    want_e, want_w = reference_route(logits, bias, **opts)
                    if not np.array_equal(ex, want_e) or not np.allclose(wt, want_w, rtol=1e-5, atol=0):
                        return f"the probe call with blocks ({T} tokens) routed otherwise than the reference"
                ref = run_compiled(
                    lambda e, w, g=group: int4_moe.route_blocks(e, w, num_local, g, "xla", share, 2), ex, wt
                )
                want = tuple(ref[f] for f in ("rows", "expert", "packed", "valid"))
                if not int4_moe.same_metadata(want, (rows, expert, packed, valid)):
                    return f"the probe call with blocks ({T} tokens, {name}) built other metadata than XLA's"
                if zeros.shape != (plan.counters,) or np.any(zeros != 0):
                    return f"the probe call with blocks ({T} tokens) left counters unzeroed"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"the probe call with blocks failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None
