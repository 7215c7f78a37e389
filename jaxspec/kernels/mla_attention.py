"""MLA attention over the latent cache in two kernels: Pallas with the Triton lowering.

``mla_attention(q_lat, q_rope, cache, mask, scale)`` computes, for every query row (token t,
head h of sequence b),

    out[b, t, h] = softmax_s(scale * (q_lat . cache[b, s, :L] + q_rope . cache[b, s, L:]) | mask[b, t, s])
                   @ cache[b, :, :L]

the absorbed-key attention of DeepSeek-V3 / Kimi-K2.5 decoding (`model.MLAttention`): the
latent part of the cache is both the key and the value, the rope part only a key. In XLA it
is two score einsums, a masked softmax (max, exp, sum, divide) and the output einsum, about
ten kernels per layer at decode sizes; here it is two.

Two kernels, split over the slots as flash decoding does (at batch 1 one program per 16 rows
walking the whole cache leaves the GPU idle). The first has grid ``(B, rows / 16, splits)``: a
program takes 16 query rows (the T x H rows of one sequence, zero-padded) and one split's range of
slots, and walks it in blocks of ``block_s`` slots in ascending order with an online softmax
(running max and sum in float32, the accumulator rescaled per block), the probabilities rounded
to the compute dtype for the value product as the XLA path rounds them; it writes the split's
float32 accumulator, max and sum. The second combines the splits in ascending order (rescaled to
the largest max) and normalises. The split count depends on the slot count alone (the fewest
whole-block splits, at most ``max_splits``), never on T or on which tokens share a call, so every
row's result comes from its own query, its mask row and the cache through the same sequence of
fixed-shape products, and a verify row equals the decode step for the same token (tested bit for
bit in interpret mode). The values differ from the XLA path's by rounding (the normalisation
comes last, per block rescaling), not in kind; a row whose slots are all masked gets the uniform
average, as the XLA path's MASK_FILL gives.

Given `layer`, the kernel reads that layer of the whole stacked cache [num_layers, B, S, L + r]
in place, where XLA's einsums get the layer's cache copied out by a dynamic-slice first (a read and
a write of B x S x (L + r) per layer, large at long contexts). The queries, the output and an
int32 mask pass to and from the kernels as views (rows past
T x H are masked inside: they load zeros, see no slot and are never stored), so no XLA kernel
runs around them; a bool mask costs one cast (the model makes its int32 mask once per forward,
not per layer).

`available()` probes the compiled kernel; anything it does not serve (dims that are not powers
of two, a slot count that `block_s` does not divide) is for the caller to send to XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

try:  # the Triton lowering's compiler parameters and gather loads (GPU builds)
    from jax.experimental.pallas import triton as plgpu
except Exception:  # noqa: BLE001 - optional
    plgpu = None

ROWS = 16  # query rows per program (tensor-core minimum for 16-bit inputs)
MASK_FILL = -1e30  # as jaxspec.layers.MASK_FILL: finite, so fully masked rows stay NaN-free
DEFAULT_CONFIG = {"block_s": 0, "warps": 4, "stages": 2, "max_splits": 32}  # block_s 0: see _block_s
MAX_BLOCK_S = 64
COMBINE_COLS = 128  # latent columns per program of the combine


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _block_s(slots: int, block_s: int | None) -> int:
    """The slots per block: `block_s`, or for 0 / None the largest power of two up to MAX_BLOCK_S
    (and at least 16) that divides `slots` (0 where none does)."""
    if block_s:
        return int(block_s)
    bs = MAX_BLOCK_S
    while bs >= 16 and slots % bs:
        bs //= 2
    return bs if bs >= 16 else 0


def shapes_ok(latent: int, rope: int, slots: int, block_s: int | None = None) -> bool:
    """Whether the kernel takes a latent cache of `latent` + `rope` dims and `slots` slots."""
    bs = _block_s(slots, block_s)
    return _pow2(latent) and _pow2(rope) and bs > 0 and slots % bs == 0


def splits_for(slots: int, block_s: int, max_splits: int) -> int:
    """How many splits the slots are cut into: the fewest whole-block splits, at most `max_splits` (a
    function of the slot count alone, so that a row's reduction order never depends on T)."""
    blocks = slots // block_s
    for n in range(min(max_splits, blocks), 0, -1):
        if blocks % n == 0:
            return n
    return 1


def _query_rows(j, width, H, R, per_token):
    """(query row index, real) ``[16, width]`` of program j's 16 rows, and each row's token ``[16, width]``.
    Packed (``per_token`` 0): rows 16j .. 16j + 15 of the T x H rows, those past R not real. Per token:
    program j holds heads 16 (j % per_token) .. of token j // per_token, those past H not real."""
    i = jax.lax.broadcasted_iota(jnp.int32, (ROWS, width), 0)
    if not per_token:
        rows = j * ROWS + i
        return rows, rows < R, rows // H
    t, h = j // per_token, (j % per_token) * ROWS + i
    return t * H + h, h < H, jnp.broadcast_to(t, (ROWS, width))


def _partial_kernel(
    layer_ref,
    ql_ref,
    qr_ref,
    mask_ref,
    c_ref,
    *refs,
    L,
    r,
    H,
    R,
    bs,
    steps,
    scale,
    dtype,
    precision,
    per_token=0,
    W=0,
    bounded=False,
    layer_offset=0,
):
    """refs: (bound [B],) (window start [B], window slots [B, T, W],) then the outputs acc, m, l."""
    refs = list(refs)
    bound_ref = refs.pop(0) if bounded else None
    if per_token:
        start_ref, slots_ref, acc_ref, m_ref, l_ref = refs
    else:
        acc_ref, m_ref, l_ref = refs
    b, j, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lyr = layer_ref[0] + layer_offset
    r0 = j * ROWS
    base = sp * (steps * bs)

    def queries(ref, width):  # the program's 16 query rows; rows not real read zeros and see no slot
        rows, real, _ = _query_rows(j, width, H, R, per_token)
        return plgpu.load(ref.at[b, rows, jax.lax.broadcasted_iota(jnp.int32, (ROWS, width), 1)], mask=real, other=0)

    q_lat = queries(ql_ref, L)  # [16, L]
    q_rope = queries(qr_ref, r).astype(dtype)  # [16, r]
    _, real, t_idx = _query_rows(j, bs, H, R, per_token)  # t_idx: each row's token
    cols = jax.lax.broadcasted_iota(jnp.int32, (ROWS, bs), 1)

    def plain_block(s0):
        """(c_lat [bs, L], c_rope [bs, r], seen [16, bs]) of the slots s0 .. s0 + bs - 1 as they lie."""
        c_lat = c_ref[lyr, b, pl.ds(s0, bs), pl.ds(0, L)]
        c_rope = c_ref[lyr, b, pl.ds(s0, bs), pl.ds(L, r)]
        seen = plgpu.load(mask_ref.at[b, t_idx, cols + s0], mask=real, other=0)  # its token's mask row
        return c_lat, c_rope, seen != 0

    def window_block(s0):
        """`plain_block` where the slots start .. start + W - 1 are virtual: slot start + k is the token's k-th
        window slot (-1: none, unseen and read as zeros), so a row meets its slots at the positions a decode
        step has them. Every slot is gathered, so only the blocks from the window's first one on come here."""
        t = j // per_token
        v = s0 + jax.lax.broadcasted_iota(jnp.int32, (bs,), 0)
        k = v - start_ref[b]
        in_win = (k >= 0) & (k < W)
        mapped = plgpu.load(slots_ref.at[b, t, jnp.clip(k, 0, W - 1)], mask=in_win, other=-1)
        phys = jnp.where(in_win, mapped, v)
        ok = phys >= 0
        phys = jnp.where(ok, phys, 0)

        def gather(c0, width):
            idx = jax.lax.broadcasted_iota(jnp.int32, (bs, width), 1) + c0
            return plgpu.load(c_ref.at[lyr, b, phys[:, None] + 0 * idx, idx], mask=ok[:, None], other=0)

        plain = plgpu.load(mask_ref.at[b, t_idx, cols + s0], mask=real, other=0) != 0
        seen = jnp.where(in_win[None, :], ok[None, :] & real, plain)
        return gather(0, L), gather(L, r), seen

    def step(load_block, i, carry):
        m, l, acc = carry
        s0 = base + i * bs
        c_lat, c_rope, seen = load_block(s0)  # [bs, L], [bs, r], [16, bs]
        dims = (((1,), (1,)), ((), ()))
        s = jax.lax.dot_general(q_lat, c_lat, dims, precision=precision, preferred_element_type=jnp.float32)
        s = s + jax.lax.dot_general(q_rope, c_rope, dims, precision=precision, preferred_element_type=jnp.float32)
        s = jnp.where(seen, s * scale, MASK_FILL)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        pv = jnp.dot(p.astype(dtype), c_lat, precision=precision, preferred_element_type=jnp.float32)
        return m_new, l, acc * alpha[:, None] + pv

    init = (
        jnp.full((ROWS,), MASK_FILL, jnp.float32),
        jnp.zeros((ROWS,), jnp.float32),
        jnp.zeros((ROWS, L), jnp.float32),
    )

    def walk():
        if not per_token:
            m, l, acc = jax.lax.fori_loop(0, steps, functools.partial(step, plain_block), init)
        else:  # the blocks before the window's first one as they lie, then the rest through the window
            plain = jnp.clip(start_ref[b] // bs - base // bs, 0, steps)
            carry = jax.lax.fori_loop(0, plain, functools.partial(step, plain_block), init)
            m, l, acc = jax.lax.fori_loop(plain, steps, functools.partial(step, window_block), carry)
        acc_ref[b, sp, pl.ds(r0, ROWS), :] = acc
        m_ref[b, sp, pl.ds(r0, ROWS)] = m
        l_ref[b, sp, pl.ds(r0, ROWS)] = l

    if not bounded:
        walk()
    else:  # a split wholly past the bound sees nothing: the combine weighs it 0 whatever it holds
        live = base < bound_ref[b]
        pl.when(live)(walk)

        @pl.when(jnp.logical_not(live))
        def _():
            acc_ref[b, sp, pl.ds(r0, ROWS), :] = jnp.zeros((ROWS, L), jnp.float32)
            m_ref[b, sp, pl.ds(r0, ROWS)] = jnp.full((ROWS,), MASK_FILL, jnp.float32)
            l_ref[b, sp, pl.ds(r0, ROWS)] = jnp.zeros((ROWS,), jnp.float32)


def _combine_kernel(acc_ref, m_ref, l_ref, o_ref, *, n, cols, R, H, per_token):
    b, j, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, cs = pl.ds(j * ROWS, ROWS), pl.ds(k * cols, cols)
    ms = [m_ref[b, i, rows] for i in range(n)]
    top = ms[0]
    for m in ms[1:]:
        top = jnp.maximum(top, m)
    num = jnp.zeros((ROWS, cols), jnp.float32)
    den = jnp.zeros((ROWS,), jnp.float32)
    for i in range(n):  # ascending split order, whatever the other rows are
        w = jnp.exp(ms[i] - top)
        num = num + acc_ref[b, i, rows, cs] * w[:, None]
        den = den + l_ref[b, i, rows] * w
    # rows past R stay unwritten: masked off, and their (out of bounds) indices kept distinct, as
    # interpret mode's scatter needs to drop them rather than write a real row twice
    out_rows, real, _ = _query_rows(j, cols, H, R, per_token)
    if per_token:  # rows not real: distinct out-of-bounds indices past every token's rows
        out_rows = jnp.where(real, out_rows, R + j * ROWS + jax.lax.broadcasted_iota(jnp.int32, (ROWS, cols), 0))
    out_cols = k * cols + jax.lax.broadcasted_iota(jnp.int32, (ROWS, cols), 1)
    plgpu.store(o_ref.at[b, out_rows, out_cols], (num / den[:, None]).astype(o_ref.dtype), mask=real)


def mla_attention(
    q_lat,
    q_rope,
    cache,
    mask,
    scale: float,
    *,
    layer=None,
    config=None,
    interpret: bool = False,
    window=None,
    bound=None,
    layer_offset: int = 0,
):
    """q_lat [B, T, H, L], q_rope [B, T, H, r], cache [B, S, L + r], mask [B, T, S] (True or nonzero: the
    row sees the slot; bool or int32) -> [B, T, H, L] in q_lat's dtype. See the module docstring.

    With `layer` (a scalar int, traced or not), `cache` is the whole stacked cache [num_layers, B, S, L + r]
    and the kernel reads that layer of it in place: no copy of the layer's cache, as slicing it for XLA's
    einsums makes. The layer read is ``layer + layer_offset`` (a static int, added in the kernel: a
    stacked layer's index counts from the stack's first layer, and an add outside would be a launch).

    `window` ``(start [B], slots [B, T, W])`` (int32) makes the slots ``start .. start + W - 1`` virtual:
    token t's slot ``start + k`` is the cache slot ``slots[b, t, k]`` (-1: none; unseen), whatever the mask
    says there. A tree verify passes each node's ancestors and itself in depth order (`window_of_tree`), so
    the node meets them at the slots where a decode step of the same tokens has them, and its sums pair
    the same slots: the decode step's bits (with the nodes at their own slots, masked siblings between
    them moved the pairing). Each program then holds one token's heads.

    `bound` [B] (int32): no row of sequence b sees a slot at or past ``bound[b]`` (the caller's promise,
    e.g. the highest slot its mask sets, plus one). The splits wholly past it skip their walk: a cache
    sized for the whole generation is then read only as far as it is filled. Exact: such a split's
    partial sums get weight 0 in the combine either way (its max is the mask's fill), so the result has
    the bits of the call without `bound` (save for a row that sees no slot at all, whose uniform average
    then spans the live splits' slots only: give such a sequence bound S)."""
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.triton is not importable")
    unknown = set(config or {}) - set(DEFAULT_CONFIG)
    if unknown:
        raise ValueError(f"mla_attention config: unknown keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    B, T, H, L = q_lat.shape
    r = q_rope.shape[-1]
    stacked = layer is not None
    cache_LBSC = cache if stacked else cache.reshape(1, *cache.shape)
    S = cache_LBSC.shape[2] if cache_LBSC.ndim == 4 else -1
    bs = _block_s(S, cfg["block_s"])
    want = "cache [num_layers, B, S, L + r] with layer=" if stacked else "cache [B, S, L + r]"
    if (
        q_rope.shape[:3] != (B, T, H)
        or cache_LBSC.ndim != 4
        or cache_LBSC.shape[1:] != (B, S, L + r)
        or mask.shape != (B, T, S)
    ):
        raise ValueError(
            f"mla_attention: expected q_lat [B, T, H, L], q_rope [B, T, H, r], {want}, mask [B, T, S]; "
            f"found {q_lat.shape}, {q_rope.shape}, {cache.shape}, {mask.shape}"
        )
    if not shapes_ok(L, r, S, bs):
        raise ValueError(
            f"mla_attention: needs L={L} and r={r} powers of two >= 16 and block_s={cfg['block_s'] or bs} "
            f"dividing S={S} (block_s 0 picks a power of two from 16 to {MAX_BLOCK_S})"
        )
    dtype = q_lat.dtype
    R = T * H
    per_token = 0
    extra = ()
    if window is not None:
        start, slots = window
        if start.shape != (B,) or slots.ndim != 3 or slots.shape[:2] != (B, T):
            raise ValueError(
                f"mla_attention: expected window (start [B], slots [B, T, W]) with B={B}, T={T}; "
                f"found {start.shape} and {slots.shape}"
            )
        per_token = -(-H // ROWS)
        extra = (start.astype(jnp.int32), slots.astype(jnp.int32))
    Rp = T * per_token * ROWS if per_token else -(-R // ROWS) * ROWS
    if bound is not None:
        if bound.shape != (B,):
            raise ValueError(f"mla_attention: expected bound [B] with B={B}; found {bound.shape}")
        extra = (bound.astype(jnp.int32), *extra)
    # no copies around the kernels: the queries and the output as [B, T*H, .] views, the mask as given
    q_l, q_r = q_lat.reshape(B, R, L), q_rope.reshape(B, R, r)
    # int32 (nonzero: seen): narrower masks cost the kernel ~70 registers in its gathers (sm_90 compile)
    mask_i = mask if mask.dtype == jnp.int32 else mask.astype(jnp.int32)
    params = None
    if not interpret and plgpu is not None:
        params = plgpu.CompilerParams(num_warps=cfg["warps"], num_stages=cfg["stages"])
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    n = splits_for(S, bs, int(cfg["max_splits"]))
    f32 = jnp.float32
    acc, m, l = pl.pallas_call(
        functools.partial(
            _partial_kernel,
            L=L,
            r=r,
            H=H,
            R=R,
            bs=bs,
            steps=S // bs // n,
            scale=float(scale),
            dtype=dtype,
            precision=precision,
            per_token=per_token,
            W=extra[-1].shape[2] if window is not None else 0,
            bounded=bound is not None,
            layer_offset=int(layer_offset),
        ),
        out_shape=(
            jax.ShapeDtypeStruct((B, n, Rp, L), f32),
            jax.ShapeDtypeStruct((B, n, Rp), f32),
            jax.ShapeDtypeStruct((B, n, Rp), f32),
        ),
        grid=(B, Rp // ROWS, n),
        interpret=interpret,
        compiler_params=params,
        name="mla_attention",
    )(
        jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1),
        q_l,
        q_r,
        mask_i,
        cache_LBSC.astype(dtype),
        *extra,
    )
    cols = min(L, COMBINE_COLS)
    out = pl.pallas_call(
        functools.partial(_combine_kernel, n=n, cols=cols, R=R, H=H, per_token=per_token),
        out_shape=jax.ShapeDtypeStruct((B, R, L), dtype),
        grid=(B, Rp // ROWS, L // cols),
        interpret=interpret,
        compiler_params=None if params is None else plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="mla_attention_combine",
    )(acc, m, l)
    return out.reshape(B, T, H, L)


def window_of_tree(lengths_B, tree_BNN):
    """The `window` of a tree verify: nodes written at slots P .. P + N - 1 (P = lengths), node i's
    ancestors and itself (``tree_BNN[b, i, j]``, ancestors before descendants) in depth order -> (P [B],
    slots [B, N, N]): slot k of node i is the cache slot of its depth-k ancestor (k = its depth: itself),
    -1 past its depth."""
    B, N, _ = tree_BNN.shape
    seen = tree_BNN.astype(bool)
    rank = jnp.cumsum(seen, axis=-1) - 1  # [B, N, N]: node i's j-th slot, counted among those it sees
    k = jnp.arange(N, dtype=jnp.int32)
    hit = seen[..., None, :] & (rank[..., None, :] == k[:, None])  # [B, N(i), N(k), N(j)]
    src = lengths_B.astype(jnp.int32)[:, None, None, None] + k[None, None, None, :]
    slots = jnp.max(jnp.where(hit, src, -1), axis=-1)
    return lengths_B.astype(jnp.int32), slots.astype(jnp.int32)


def available(dtype="bfloat16") -> str | None:
    """Why the compiled kernel cannot attend with ``dtype`` operands here, or None if it can (see
    `_available`; one probe per dtype however it is named)."""
    return _available(jnp.dtype(dtype).name)


@functools.cache
def _available(dtype: str) -> str | None:
    """Why the compiled kernel cannot run here, or None if it can (a GPU with Pallas' Triton lowering;
    the first call per dtype compiles and checks a small case against a float64 numpy reference,
    compiled and run at once: the model first asks while a decode step is being traced). bfloat16
    within 2e-2; float32 within 1e-5, which products rounded to TF32 or bfloat16 miss (the float32
    model's XLA attention multiplies exactly)."""
    from jaxspec.kernels import gpu_problem, run_compiled

    if (problem := gpu_problem(plgpu)) is not None:
        return problem
    try:
        dt = jnp.dtype(dtype)
        rng = np.random.default_rng(0)
        ql = rng.normal(size=(1, 2, 8, 64)).astype(dt)
        qr = rng.normal(size=(1, 2, 8, 16)).astype(dt)
        c = rng.normal(size=(1, 128, 80)).astype(dt)
        mask = np.arange(128)[None, None, :] <= np.array([40, 41])[None, :, None]
        bound = np.array([42], np.int32)  # the second of two splits wholly past it (the model's form)
        got = run_compiled(
            lambda q, k, cc, m, bd: mla_attention(q, k, cc, m, 0.1, bound=bd).astype(jnp.float32),
            ql,
            qr,
            c,
            mask,
            bound,
        )
        if (problem := _value_problem(got, _reference_np(ql, qr, c, mask, 0.1), dt, "probe call")) is not None:
            return problem
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"the probe call failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None


def window_problem(dtype="bfloat16", interpret: bool = False) -> str | None:
    """Why the kernel cannot take a `window` with ``dtype`` operands here, or None if it can. Compiled, the
    first call per dtype checks a small branching tree on the device (`_window_available`); the model then
    passes a tree verify's window only where it passed (else the tree's nodes read their slots as they lie).
    ``interpret``: the same check in interpret mode (tests)."""
    if not interpret and (problem := available(dtype)) is not None:
        return problem
    return _window_available(jnp.dtype(dtype).name, interpret)


@functools.cache
def _window_available(dtype: str, interpret: bool) -> str | None:
    return _window_check(dtype, interpret)


def _window_check(dtype: str, interpret: bool) -> str | None:
    """A 4-node tree (root, two children, a grandchild under the first) in the first of two 64-slot blocks,
    the sibling's slot holding NaN: the grandchild's row through the window must equal a decode step of its
    path bit for bit and a float64 reference within the dtype's tolerance (a kernel that read the sibling
    returns NaN). Both calls with the model's `bound` (the second block's split skipped)."""
    from jaxspec.kernels import run_compiled

    try:
        dt = jnp.dtype(dtype)
        rng = np.random.default_rng(1)
        H, L, r, S, P = 8, 64, 16, 128, 30
        ql = rng.normal(size=(1, 4, H, L)).astype(dt)
        qr = rng.normal(size=(1, 4, H, r)).astype(dt)
        c = rng.normal(size=(1, S, L + r)).astype(dt)
        tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)[None]
        mask = (np.arange(S) < P)[None, None, :] | np.pad(tree, ((0, 0), (0, 0), (P, S - P - 4)))
        start, slots = np.array([P], np.int32), np.array([[[P, -1, -1, -1], [P, P + 1, -1, -1]] * 2], np.int32)
        slots[0, 2] = [P, P + 2, -1, -1]
        slots[0, 3] = [P, P + 1, P + 3, -1]
        poisoned = c.copy()
        poisoned[0, P + 2] = np.nan  # the sibling of the grandchild's parent: never seen by node 3
        got = run_compiled(
            lambda *a: mla_attention(*a[:4], 0.1, window=(a[4], a[5]), bound=a[6], interpret=interpret).astype(
                jnp.float32
            ),
            ql,
            qr,
            poisoned,
            mask,
            start,
            slots,
            np.array([P + 4], np.int32),
        )[0, 3]
        dec = c.copy()
        dec[0, P + 2] = c[0, P + 3]  # the decode step of node 3: its path at P, P + 1, P + 2
        dmask = (np.arange(S) <= P + 2)[None, None, :]
        want = run_compiled(
            lambda *a: mla_attention(*a[:4], 0.1, bound=a[4], interpret=interpret).astype(jnp.float32),
            ql[:, 3:],
            qr[:, 3:],
            dec,
            dmask,
            np.array([P + 3], np.int32),
        )[0, 0]
        if not np.array_equal(got, want):
            bad, nan = int(np.sum(got != want)), int(np.isnan(got).sum())
            return f"the {dt.name} window probe's tree row differs from its decode step ({bad} values, {nan} NaN)"
        return _value_problem(got, _reference_np(ql[:, 3:], qr[:, 3:], dec, dmask, 0.1)[0, 0], dt, "window probe")
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"the window probe call failed: {type(exc).__name__}: {str(exc)[:300]}"


def _value_problem(got, ref, dt, what: str) -> str | None:
    """Why a probe's values are wrong against the float64 reference, or None: bfloat16 within 2e-2 of the
    largest value, float32 within 1e-5 (products rounded to TF32 or bfloat16 miss it)."""
    err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    tol = 1e-5 if dt == jnp.float32 else 2e-2
    if not err < tol:
        return f"the {dt.name} {what} returned wrong values (relative error {err:.2e}, limit {tol:.0e})"
    return None


def _reference_np(q_lat, q_rope, cache, mask, scale):
    """`reference` in float64 numpy (the inputs' values exactly)."""
    f = np.float64
    L = q_lat.shape[-1]
    lat, rope = cache[..., :L].astype(f), cache[..., L:].astype(f)
    s = np.einsum("bthd,bsd->bhts", q_lat.astype(f), lat) + np.einsum("bthd,bsd->bhts", q_rope.astype(f), rope)
    s = np.where(mask[:, None], s * scale, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bse->bthe", p, lat)


def reference(q_lat, q_rope, cache, mask, scale):
    """The XLA formula (as `layers.attention` computes it for MLA)."""
    L = q_lat.shape[-1]
    dt = q_lat.dtype
    lat, rope = cache[..., :L].astype(dt), cache[..., L:].astype(dt)
    s = jnp.einsum("bthd,bsd->bhts", q_lat, lat, preferred_element_type=jnp.float32)
    s = s + jnp.einsum("bthd,bsd->bhts", q_rope.astype(dt), rope, preferred_element_type=jnp.float32)
    p = jax.nn.softmax(jnp.where(mask[:, None], s * scale, MASK_FILL), axis=-1).astype(dt)
    return jnp.einsum("bhts,bse->bthe", p, lat)
