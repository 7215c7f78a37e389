"""Building blocks shared by the target (`jaxspec.model`) and the EAGLE-3 draft (`jaxspec.draft`).

RMSNorm, the bias-free dense projection, SwiGLU, rotary embeddings (the one rotation,
with the target's YaRN frequencies and the draft's Llama-style ones), the masked
softmax attention core, cache slot writes and the causal / prefix masks.

Parameters are created by `param`: with logical axis names (the target's, read by
`jaxspec.sharding`) they are boxed for partitioning, without them (the draft's, whose
axes live in `draft.param_axes`) they are plain arrays. Module and parameter names
are the callers' own, so checkpoint paths do not depend on this file.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxspec import stacked

# Scores of masked-out slots: finite, so a row with every slot masked (padding) gets a
# uniform, NaN-free softmax instead of 0/0; far below any real score, so it adds exactly
# zero probability to a row with one visible slot or more.
MASK_FILL = -1e30

Axes = tuple[str | None, ...]

# ---------------------------------------------------------------------------
# Parameters


def param(mod: nn.Module, name: str, shape, axes: Axes | None, dtype, scale: float | None = None):
    """A parameter of `mod`: integers random bits, `scale` 0.0 ones, otherwise normal with std `scale`
    (None: 1/sqrt(shape[0])). With `axes` it carries logical partitioning names."""
    if mod.has_variable(stacked.STACKED, name):  # a stacked layer's weight, read in place (`jaxspec.stacked`)
        return mod.get_variable(stacked.STACKED, name)
    if jnp.issubdtype(dtype, jnp.integer):
        init = lambda key, s, d: jax.random.bits(key, s, jnp.uint32).astype(d)
    elif scale == 0.0:
        init = nn.initializers.ones
    else:
        std = scale if scale is not None else 1.0 / np.sqrt(shape[0])
        init = nn.initializers.normal(std)
    if axes is not None:
        init = nn.with_logical_partitioning(init, axes)
    return mod.param(name, init, tuple(shape), dtype)


class Kernel(nn.Module):
    """A bare weight `kernel`, for matmuls done outside a flax call (inside a `shard_map`, say)."""

    shape: tuple[int, ...]
    axes: Axes | None = None
    dtype: jnp.dtype = jnp.float32
    scale: float | None = None

    @nn.compact
    def __call__(self):
        return param(self, "kernel", self.shape, self.axes, self.dtype, self.scale)


# ---------------------------------------------------------------------------
# Norm and projections


def rms_norm(x, scale, eps: float):
    """x / rms(x) computed in float32, rounded to x's dtype, then times `scale` (in x's dtype)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * y.astype(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (`dim`, or x's last dim when None); parameter `scale`, ones at init.

    Called with ``rows`` ('kernel' or 'interpret'), the norm runs as one `kernels.rms_norm` launch
    that also adds ``residual`` to x first (if given) and returns `stacked.Rows` in the module's dtype,
    the zero-padded rows the dense kernel reads as they are; with ``residual`` the result is
    ``(rows, x + residual)``, the float32 sum. x is then the float32 residual stream (or an activation
    of any float dtype), rounded to the module's dtype before the norm, as ``__call__(x.astype(dtype))``
    would; x and the residual may then also be the dense kernel's `stacked.Parts`, which the kernel adds
    itself. Called without x (the module's ``dim`` set), it returns its scale parameter, for a kernel
    that applies the norm itself (`kernels.latent_write`). With rows, ``capture=(buf, slot)`` (buf
    [R, *x.shape], slot a scalar int, or for a stacked layer's scale a table of rows by layer, read at the
    scale's index) also stores the residual stream (x + residual, or x) rounded to buf's dtype as that row
    of buf in the same launch, and the result is ``(result, buf)``."""

    eps: float
    dim: int | None = None
    dtype: jnp.dtype = jnp.float32
    axes: Axes | None = None
    mesh: jax.sharding.Mesh | None = None  # rows: the kernel runs on each device (x replicated there)

    @nn.compact
    def __call__(self, x=None, rows: str | None = None, residual=None, capture=None):
        if x is None and self.dim is None:
            raise ValueError("RMSNorm: called without x, the module needs its dim to make its scale")
        dim = x.shape[-1] if self.dim is None else self.dim
        scale = param(self, "scale", (dim,), self.axes, self.dtype, scale=0.0)
        if x is None:  # the scale itself (an array, or a stacked layer's `LayerOf`), for a fused kernel
            return scale
        if rows is None:
            if residual is not None:
                raise ValueError("RMSNorm: a residual is added only with rows='kernel' or 'interpret'")
            if capture is not None:
                raise ValueError("RMSNorm: the stream is captured only with rows='kernel' or 'interpret'")
            return rms_norm(stacked.value(x), scale.get() if isinstance(scale, stacked.LayerOf) else scale, self.eps)
        from jaxspec.kernels import rms_norm as kernel

        lead = x.shape[:-1]
        x2 = x.reshape(-1, dim)  # x and the residual may be the dense kernel's `stacked.Parts`: added in the kernel
        h2 = None if residual is None else residual.reshape(-1, dim)
        # a stacked layer's scale read in place from its stack (`model.INPLACE_LEAVES`)
        stack, index = stacked.stack_and_index(scale)
        cap = None if capture is None else (capture[0].reshape(capture[0].shape[0], -1, dim), capture[1])

        def run(x2, h2, stack, index, cap):
            interpret = rows == "interpret"
            return kernel.rms_norm_rows(
                x2, stack, self.eps, residual=h2, dtype=self.dtype, layer=index, capture=cap, interpret=interpret
            )

        if self.mesh is not None and self.mesh.size > 1:  # every device its own copy, no partitioning
            P = jax.sharding.PartitionSpec
            run = jax.shard_map(run, mesh=self.mesh, in_specs=P(), out_specs=P(), check_vma=False)
        y, s, *buf = run(x2, h2, stack, index, cap)
        out = stacked.Rows(y, x.shape)
        out = out if residual is None else (out, s.reshape(*lead, dim))
        return out if capture is None else (out, buf[0].reshape(capture[0].shape))


class Dense(nn.Module):
    """Bias-free projection `einsum(contract, x, kernel)` computed in x's dtype.

    `shape` is the kernel's ([in..., out...]); `scale` the init std (None: 1/sqrt(shape[0])).
    `out_dtype` is the matmul's accumulator/output dtype (e.g. float32 logits from bfloat16).
    """

    shape: tuple[int, ...]
    axes: Axes | None = None
    dtype: jnp.dtype = jnp.float32
    scale: float | None = None

    @nn.compact
    def __call__(self, x, contract: str = "...i,io->...o", out_dtype=None, raw: bool = False):
        """``raw``: the result may come back as the dense kernel's `stacked.Parts` (for a consumer kernel
        that adds them itself), where a stacked layer's kernel is read in place; else always an array."""
        kernel = param(self, "kernel", self.shape, self.axes, self.dtype, self.scale)
        if isinstance(kernel, stacked.LayerOf):
            return stacked.einsum(contract, x, kernel, out_dtype, raw)
        x = stacked.value(x)
        y = jnp.einsum(contract, x, kernel.astype(x.dtype), preferred_element_type=out_dtype)
        return y if out_dtype is None else y.astype(out_dtype)


def swiglu(x, w: dict, gate_up=None):
    """down(silu(gate(x)) * up(x)) for kernels w['gate'], w['up'] [D, F] and w['down'] [F, D], in x's dtype.
    ``gate_up``: the products gate(x), up(x) where the caller already has them (x is then unused)."""
    gate, up = matmuls(x, (w["gate"], w["up"])) if gate_up is None else gate_up
    return _matmul(jax.nn.silu(gate) * up, w["down"])


def matmuls(x, ws, contracts=None, raw=None):
    """`einsum(contracts[i], x, ws[i])` in x's dtype for kernels `ws` that share the input x (default
    contracts: x [..., K] @ w [K, N]). Stacked layers' weights read in place go through one kernel call
    together (`stacked.einsums`; `raw` flags results that may come back as its `stacked.Parts`); plain
    arrays are one einsum each, as ever."""
    if contracts is None:
        lead = "abcdefgh"[: x.ndim - 1]
        contracts = [f"{lead}k,kn->{lead}n"] * len(ws)
    if all(isinstance(w, stacked.LayerOf) for w in ws):
        return stacked.einsums(contracts, x, ws, raw=raw)
    x = stacked.value(x)
    return tuple(
        stacked.einsum(c, x, w) if isinstance(w, stacked.LayerOf) else jnp.einsum(c, x, w.astype(x.dtype))
        for c, w in zip(contracts, ws)
    )


def _matmul(x, w):
    """x [..., K] @ w [K, N] in x's dtype; w may be a stacked layer's weight read in place."""
    if isinstance(w, stacked.LayerOf):
        contract = "abcdefgh"[: x.ndim - 1]
        return stacked.einsum(f"{contract}k,kn->{contract}n", x, w)
    return jnp.einsum("...d,df->...f", x, w.astype(x.dtype))


class SwiGLU(nn.Module):
    """Gated MLP: kernels named `names` (gate, up, down) under this module; `axes` their logical
    axes (or None). Called with x it applies them; called without, it returns them (a dict keyed
    'gate', 'up', 'down') for a caller that does the matmuls itself."""

    hidden: int
    inner: int
    dtype: jnp.dtype = jnp.float32
    names: tuple[str, str, str] = ("gate", "up", "down")
    axes: tuple[Axes, Axes, Axes] | None = None
    scale: float | None = None

    @nn.compact
    def __call__(self, x=None):
        D, F = self.hidden, self.inner
        shapes = ((D, F), (D, F), (F, D))
        axes = self.axes or (None, None, None)
        w = {
            role: Kernel(shape, ax, self.dtype, self.scale, name=name)()
            for role, name, shape, ax in zip(("gate", "up", "down"), self.names, shapes, axes)
        }
        return w if x is None else swiglu(x, w)


# ---------------------------------------------------------------------------
# Rotary embeddings


def rope(x, positions_BT, inv_freq, attention_factor: float = 1.0, interleaved: bool = False):
    """Rotate the last dim of x [B, T, ..., r] by angle position * inv_freq [r/2].

    Pairs are (x[i], x[i + r/2]) (rotate-half), or (x[2i], x[2i+1]) when `interleaved`;
    the output is in the (half, half) layout either way: the rotated first members, then
    the second ones. cos and sin are scaled by `attention_factor` (YaRN's mscale), in float32 from
    float32 angles, then rounded to x's dtype.
    """
    angle = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, r/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    lead = angle.shape[:2] + (1,) * (x.ndim - 3) + angle.shape[2:]
    cos, sin = cos.astype(x.dtype).reshape(lead), sin.astype(x.dtype).reshape(lead)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def base_inv_freq(dim: int, theta: float) -> np.ndarray:
    """theta ** (-2i / dim) for i < dim/2, float32."""
    return (1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)


def yarn_inv_freq(
    dim: int,
    theta: float,
    factor: float,
    original_max_position: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool = True,
) -> np.ndarray:
    """YaRN (DeepSeek-V3) inverse frequencies: a linear ramp between interpolated (divided by
    `factor`) and extrapolated (plain) frequencies over the dims between the beta corrections."""
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrap = (1.0 / pos_freqs).astype(np.float32)
    interp = (1.0 / (factor * pos_freqs)).astype(np.float32)

    def correction_dim(rotations):
        return dim * np.log(original_max_position / (rotations * 2 * np.pi)) / (2 * np.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrap_factor = 1 - ramp
    return (interp * (1 - extrap_factor) + extrap * extrap_factor).astype(np.float32)


def llama_inv_freq(
    dim: int,
    theta: float,
    rope_type: str = "default",
    factor: float = 1.0,
    low_freq_factor: float | None = None,
    high_freq_factor: float | None = None,
    original_max_position: int | None = None,
) -> np.ndarray:
    """Llama inverse frequencies, float32: 'default', 'linear' (all divided by `factor`) or
    'llama3' (long wavelengths divided by `factor`, short ones kept, a smooth blend between)."""
    inv = base_inv_freq(dim, theta)
    if rope_type == "linear":
        # Linear scaling divides positions by the factor; same as dividing frequencies.
        inv = inv / np.float32(factor)
    elif rope_type == "llama3":
        lo, hi, orig = low_freq_factor, high_freq_factor, original_max_position
        wavelen = 2 * math.pi / inv
        if lo != hi:
            smooth = (orig / wavelen - lo) / (hi - lo)
        else:
            smooth = np.zeros_like(inv)
        scaled = np.where(wavelen > orig / lo, inv / factor, (1 - smooth) * inv / factor + smooth * inv)
        inv = np.where(wavelen < orig / hi, inv, scaled).astype(np.float32)
    return inv


# ---------------------------------------------------------------------------
# Attention


def masked_softmax(scores, mask):
    """Softmax over the last axis of `scores` where `mask` (broadcast), MASK_FILL elsewhere."""
    return jax.nn.softmax(jnp.where(mask, scores, MASK_FILL), axis=-1)


def attention(q, k, v, mask_BTS, scale: float, q2=None, k2=None):
    """Masked softmax attention; scores and softmax in float32, the rest in q's dtype.

    Grouped-query form: q [B,T,K,G,D] (K key/value heads, G query heads each), k [B,S,K,D],
    v [B,S,K,E] -> [B,T,K,G,E]. Single key/value form (MLA's latent cache): q [B,T,H,D],
    k [B,S,D], v [B,S,E] -> [B,T,H,E]. `q2`·`k2`, when given, is a second score term in the
    same form (MLA's decoupled rope part). mask [B,T,S]: True where a query sees a slot.
    """
    if k.ndim == 3:
        score_eq, out_eq, mask = "bthd,bsd->bhts", "bhts,bse->bthe", mask_BTS[:, None]
    else:
        score_eq, out_eq, mask = "btkgd,bskd->bkgts", "bkgts,bske->btkge", mask_BTS[:, None, None]
    scores = jnp.einsum(score_eq, q, k.astype(q.dtype), preferred_element_type=jnp.float32)
    if q2 is not None:
        scores = scores + jnp.einsum(score_eq, q2, k2.astype(q2.dtype), preferred_element_type=jnp.float32)
    probs = masked_softmax(scores * scale, mask).astype(q.dtype)
    return jnp.einsum(out_eq, probs, v.astype(q.dtype))


# ---------------------------------------------------------------------------
# Caches and masks


def write_slots(buf, new, slots_BT, layer=None):
    """buf [(L,) B, S, ...] with new [B, T, ...] written at slots [B, T] (of layer `layer`, a Python
    int or a traced index, when given); slots >= S are dropped, so padding can aim at S."""
    rows = jnp.arange(slots_BT.shape[0])[:, None]
    index = (rows, slots_BT) if layer is None else (layer, rows, slots_BT)
    return buf.at[index].set(new.astype(buf.dtype), mode="drop")


def move_slots(buf, src_BT, dst_BT, lead: int = 0):
    """buf [lead dims..., B, S, ...] with slots src copied to slots dst, row by row, in every
    leading index (e.g. every layer of a stacked cache); dst slots >= S are dropped."""
    rows = jnp.arange(src_BT.shape[0])[:, None]
    index = (slice(None),) * lead
    return buf.at[index + (rows, dst_BT)].set(buf[index + (rows, src_BT)], mode="drop")


def causal_mask(positions_BT, num_slots: int, limit: int | None = None):
    """[B, T, S] mask: a query at position p sees slots 0..p (and, with `limit`, only slots < limit)."""
    slots = jnp.arange(num_slots, dtype=positions_BT.dtype)
    mask = slots[None, None, :] <= positions_BT[:, :, None]
    if limit is not None and limit < num_slots:
        mask = mask & (slots < limit)[None, None, :]
    return mask


def prefix_mask(lengths_B, num_slots: int):
    """[B, 1, S] mask: slots below the row's length (its committed prefix)."""
    return (jnp.arange(num_slots)[None, :] < lengths_B[:, None])[:, None, :]


def prefix_span_mask(lengths_B, start: int, count: int, num_slots: int):
    """[B, 1, S] mask: the row's committed prefix (`prefix_mask`) and the slots start .. start + count - 1
    (a chain drafted into a scratch region after the committed slots)."""
    slots = jnp.arange(num_slots)
    span = (slots >= start) & (slots < start + count)
    return prefix_mask(lengths_B, num_slots) | span[None, None, :]


def tree_mask(lengths_B, tree_BNN, num_slots: int):
    """[B, N, S] mask of N tree nodes written at slots P .. P+N-1 after a committed prefix of P =
    lengths slots: node i sees the prefix and the slots of the nodes tree_BNN[i] marks."""
    B, N, _ = tree_BNN.shape
    slots = jnp.arange(num_slots, dtype=jnp.int32)
    rel = slots[None, :] - lengths_B[:, None]  # [B, S]
    in_tree = (rel >= 0) & (rel < N)
    cols = jnp.take_along_axis(tree_BNN, jnp.broadcast_to(jnp.clip(rel, 0, N - 1)[:, None, :], (B, N, num_slots)), 2)
    return prefix_mask(lengths_B, num_slots) | (in_tree[:, None, :] & cols)
