"""DeepSeek-V3 "noaux_tc" routing of a call's tokens in one Pallas kernel (Triton lowering).

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

Each program (one warp) routes one token; a token's row goes through the same instructions whatever T is and
whichever tokens share its program (selections by max and lowest index are exact; the weights'
sum is taken in selection order), so a token is routed alike in a decode step and in a verify.
Compiled, its sigmoid is Triton's ``1 / (1 + exp(-x))`` (a hardware exp2) and may differ from XLA's in
the last bits, so near-ties can pick differently from :func:`jaxspec.model.route`; in interpret mode it
is XLA's. Availability is probed per routing configuration on the device (:func:`available`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

try:  # the Triton lowering's load / store with masks and compiler parameters (GPU builds)
    from jax.experimental.pallas import triton as plgpu
except Exception:  # noqa: BLE001 - optional
    plgpu = None

BLOCK_T = 1  # tokens per program: a row's reductions stay within one warp (no barrier)
WARPS = 1


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _first_max(v, cols, width):
    """(row max, lowest column holding it) of v [BT, width]."""
    m = jnp.max(v, axis=1)
    i = jnp.min(jnp.where(v == m[:, None], cols, width), axis=1)
    return m, i


def _kernel(layer_ref, logits_ref, bias_ref, ex_ref, wt_ref, *, T, E, EP, k, KP, n_group, topk_group, norm, scale):
    t0 = pl.program_id(0) * BLOCK_T
    rows = t0 + jax.lax.broadcasted_iota(jnp.int32, (BLOCK_T, EP), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_T, EP), 1)
    live = (rows < T) & (cols < E)
    # clamped indices keep every address inside the arrays (interpret mode reads them too)
    r_idx, c_idx = jnp.minimum(rows, T - 1), jnp.minimum(cols, E - 1)
    logits = plgpu.load(logits_ref.at[r_idx, c_idx], mask=live, other=0.0).astype(jnp.float32)
    c1 = jax.lax.broadcasted_iota(jnp.int32, (EP,), 0)
    lyr = jnp.full((EP,), layer_ref[0], jnp.int32)  # the bias stack's row, read in place
    bias = plgpu.load(bias_ref.at[lyr, jnp.minimum(c1, E - 1)], mask=c1 < E, other=0.0).astype(jnp.float32)
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
        kept = [jnp.zeros((BLOCK_T,), jnp.bool_) for _ in range(n_group)]
        for _ in range(topk_group):  # best remaining group, the lower index first among equal scores
            best = jnp.full((BLOCK_T,), neg)
            best_g = jnp.full((BLOCK_T,), n_group, jnp.int32)
            for g in range(n_group):
                s = jnp.where(kept[g], neg, gscore[g])
                better = s > best
                best = jnp.where(better, s, best)
                best_g = jnp.where(better, g, best_g)
            kept = [kept[g] | (best_g == g) for g in range(n_group)]
        eligible = jnp.zeros((BLOCK_T, EP), jnp.bool_)
        for g in range(n_group):
            eligible = eligible | (kept[g][:, None] & (grp == g))
        choice = jnp.where(eligible, choice, neg)
    kcols = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_T, KP), 1)
    experts = jnp.zeros((BLOCK_T, KP), jnp.int32)
    for j in range(k):  # one (value, index) reduction per pick: the lower index among equal values
        i = jnp.argmax(choice, axis=1).astype(jnp.int32)
        choice = jnp.where(cols == i[:, None], neg, choice)
        experts = jnp.where(kcols == j, i[:, None], experts)
    # the picks' unbiased scores: their logits read again, through the same sigmoid (the same bits)
    krows = t0 + jax.lax.broadcasted_iota(jnp.int32, (BLOCK_T, KP), 0)
    kmask = (krows < T) & (kcols < k)
    picked = plgpu.load(
        logits_ref.at[jnp.minimum(krows, T - 1), jnp.minimum(experts, E - 1)], mask=kmask, other=0.0
    ).astype(jnp.float32)
    weights = jnp.where(kmask, jax.nn.sigmoid(picked), 0.0)
    if norm:
        total = None
        for j in range(k):  # added in pick order (each term is one element: exact)
            w = jnp.sum(jnp.where(kcols == j, weights, 0.0), axis=1)
            total = w if total is None else total + w
        weights = weights / (total + jnp.float32(1e-20))[:, None]
    weights = weights * jnp.float32(scale)
    ex_ref[pl.ds(t0, BLOCK_T), :] = experts
    wt_ref[pl.ds(t0, BLOCK_T), :] = weights


def route_topk(
    logits_TE: jax.Array,
    bias_E: jax.Array,
    *,
    k: int,
    n_group: int = 1,
    topk_group: int = 1,
    norm: bool = True,
    scale: float = 1.0,
    interpret: bool = False,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(experts [T, k] int32, weights [T, k] float32): the routing of :func:`jaxspec.model.route`.

    logits_TE: the router's logits [T, E] (float32 or narrower; upcast in the kernel); bias_E: the
    selection bias [E], or with ``layer`` (a scalar int, may be traced) the stacked layers' biases [L, E],
    of which the kernel reads row ``layer`` in place (a slice would be a launch of its own inside a scan).
    ``interpret``: Pallas interpret mode (CPU tests).
    """
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.triton is not importable")
    if logits_TE.ndim != 2:
        raise ValueError(f"route_topk: logits must be [T, E], found shape {tuple(logits_TE.shape)}")
    T, E = logits_TE.shape
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
    if T == 0:
        return jnp.zeros((0, k), jnp.int32), jnp.zeros((0, k), jnp.float32)
    EP, KP = _pow2(E), _pow2(k)
    tp = -(-T // BLOCK_T) * BLOCK_T
    kernel = functools.partial(
        _kernel,
        T=T,
        E=E,
        EP=EP,
        k=k,
        KP=KP,
        n_group=n_group,
        topk_group=topk_group,
        norm=bool(norm),
        scale=float(scale),
    )
    params = None if interpret else plgpu.CompilerParams(num_warps=WARPS, num_stages=1)
    experts, weights = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((tp, KP), jnp.int32), jax.ShapeDtypeStruct((tp, KP), jnp.float32)),
        grid=(tp // BLOCK_T,),
        interpret=interpret,
        compiler_params=params,
        name="route_topk",
    )(
        jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1),
        logits_TE,
        bias_E[None] if layer is None else bias_E,
    )
    return experts[:T, :k], weights[:T, :k]


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
    Pallas' Triton lowering, and first calls at this configuration (1 and 19 tokens) that pick the
    experts of :func:`reference_route` in its order, with weights within 1e-5 of its. Safe to call while
    a jit is being traced (the model first asks inside one)."""
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
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"the probe call failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None
