"""The Kimi-K2.5 / DeepSeek-V3 decoder in flax (linen), with a latent MLA cache.

One code path serves prefill, single-token decode and tree verification: every
call writes the new tokens' latents into the cache at `write_slots` and attends
over the whole cache through an explicit boolean mask. Attention is always the
absorbed MLA form, so the cache holds only `kv_lora_rank + qk_rope_head_dim`
values per token per layer, never expanded keys or values.

The norms, projections, rotary embedding, attention core and cache writes are
`jaxspec.layers`' (shared with the draft); their parameters carry the logical axis
names `jaxspec.sharding` maps. Shapes use the letters of the glossary in
`jaxspec.sharding`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxspec import quant, stacked
from jaxspec.config import ModelConfig, yarn_mscale
from jaxspec.kernels import (
    absorb,
    grouped_matmul,
    int4_moe,
    latent_write,
    mla_attention,
    rms_norm,
    routing,
    stacked_matmul,
)
from jaxspec.layers import (
    Dense,
    Kernel,
    RMSNorm,
    SwiGLU,
    attention,
    base_inv_freq,
    matmuls,
    param,
    rope,
    swiglu,
    write_slots,
    yarn_inv_freq,
)
from jaxspec.sharding import (
    HIDDEN_BTD,
    LATENT_CACHE_LBSC,
    RULES,
    TOKENS_TD,
    Rules,
    constrain,
    logical_spec,
    mesh_axis,
    ordered_psum,
    shards,
)

# ---------------------------------------------------------------------------
# Cache


@struct.dataclass
class LatentCache:
    """Latent cache of every layer in one array [L, B, S, C], slot = token position.

    One array (not one per layer) so the stacked decoder layers can update their
    slice in place from inside `lax.scan`.
    """

    latent_LBSC: jax.Array

    @property
    def max_len(self) -> int:
        return self.latent_LBSC.shape[2]

    @property
    def latent(self) -> tuple[jax.Array, ...]:
        """Per-layer views [B, S, C] (for inspection; the model works on `latent_LBSC`)."""
        return tuple(self.latent_LBSC[i] for i in range(self.latent_LBSC.shape[0]))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> LatentCache:
    return LatentCache(jnp.zeros((cfg.num_layers, batch, max_len, cfg.latent_dim), dtype))


# ---------------------------------------------------------------------------
# Layers (jaxspec.layers), with the target's logical axis names


def _norm(dim: int, eps: float, dtype, name: str | None = None, mesh: Mesh | None = None) -> RMSNorm:
    return RMSNorm(eps, dim, dtype, ("norm",), mesh, name=name)


def norm_rows_ok(impl: str | None, shape, mesh: Mesh | None = None, rules: Rules = RULES, dtype=jnp.bfloat16) -> bool:
    """Whether a norm over x of ``shape`` [..., D] runs as `kernels.rms_norm`'s padded rows (one launch
    for the residual add, the norm and the dense kernel's pad): with the dense kernel (``impl``
    'kernel' / 'interpret'), rows it serves, x whole on every device of a mesh, and (compiled) a
    kernel whose probe passed for the norm's output ``dtype``."""
    if impl not in ("kernel", "interpret"):
        return False
    if not rms_norm.shapes_ok(int(np.prod(shape[:-1])), shape[-1]):
        return False
    if mesh is not None and _split_axes(mesh, rules, ("batch", "embed", "q_lora")):
        return False
    return impl == "interpret" or rms_norm.available(dtype) is None


def capture_in_norm_ok(
    impl: str | None, shape, mesh: Mesh | None = None, rules: Rules = RULES, dtype=jnp.bfloat16
) -> bool:
    """Whether the stacked layers write a layer's output into the captured hidden states from the next layer's
    attention norm launch (`kernels.rms_norm`'s ``capture``; `StackedLayers._capture_in_norm`): the norm runs as
    the kernel's rows for x of ``shape`` (`norm_rows_ok`), the switch `rms_norm.DEFAULT_CONFIG["capture"]` is on
    and (compiled) the probe of that store passed for ``dtype`` (the model's, the buffer's too)."""
    if not rms_norm.DEFAULT_CONFIG["capture"] or not norm_rows_ok(impl, shape, mesh, rules, dtype):
        return False
    return impl == "interpret" or rms_norm.capture_available(dtype) is None


# ---------------------------------------------------------------------------
# Rotary embedding (plain or YaRN), HF DeepseekV3 conventions


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [r/2] in float32, with YaRN's ramp between interpolation and extrapolation."""
    if not cfg.yarn:
        return base_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta)
    return yarn_inv_freq(
        cfg.qk_rope_head_dim,
        cfg.rope_theta,
        cfg.rope_factor,
        cfg.rope_original_max_position,
        cfg.rope_beta_fast,
        cfg.rope_beta_slow,
        cfg.rope_truncate,
    )


def rope_attention_factor(cfg: ModelConfig) -> float:
    """YaRN scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    if not cfg.yarn:
        return 1.0
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(cfg.rope_factor, cfg.rope_mscale) / yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return yarn_mscale(cfg.rope_factor)


def apply_rope(x, positions_BT, cfg: ModelConfig):
    """Rotate the last dim of x [B, T, ..., r]; output in de-interleaved (half, half) layout.

    With rope_interleave the checkpoint stores pairs (x0, x1), (x2, x3)...; HF rotates
    them and returns evens then odds. Queries and keys use the same layout, so dot
    products are unchanged and the cached rope key stays in that layout.
    """
    return rope(x, positions_BT, rope_inv_freq(cfg), rope_attention_factor(cfg), cfg.rope_interleave)


# ---------------------------------------------------------------------------
# Attention


ATTENTION_IMPLS = ("xla", "kernel", "interpret")
"""How `MLAttention` attends over the latent cache (`Transformer.attention_impl`):

* ``xla``: the score einsums, a masked softmax and the output einsum (the default off a GPU);
* ``kernel``: `kernels.mla_attention`, all of it in one Pallas kernel reading the layer's cache in place
  (the default on a GPU with the Triton lowering where its probe passes);
* ``interpret``: the same kernel in Pallas interpret mode (any backend: tests).
"""


def choose_attention_impl(attention_impl: str | None = None, dtype=jnp.bfloat16) -> str:
    """The attention path: `attention_impl` if given ('kernel' where it cannot run is an error saying
    why), else 'kernel' where the compiled kernel runs and passes its probe for the model's `dtype` (a
    GPU with the Triton lowering: 2.6-3.6% faster plain steps on the H200 share at full depth,
    docs/PERFORMANCE.md; float32 only where its products are exact float32), else 'xla'."""
    if attention_impl not in (None, *ATTENTION_IMPLS):
        raise ValueError(f"attention_impl: expected None or one of {ATTENTION_IMPLS}, found {attention_impl!r}")
    if attention_impl == "kernel":
        problem = mla_attention.available()
        if problem is not None:
            raise ValueError(f"attention_impl='kernel': {problem}")
    if attention_impl is not None:
        return attention_impl
    return "kernel" if mla_attention.available(dtype) is None else "xla"


class MLAttention(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    mesh: Mesh | None = None
    rules: Rules = RULES
    attention_impl: str | None = None
    norm_rows: str | None = None  # 'kernel' / 'interpret': q_a's norm as `kernels.rms_norm` rows (`norm_rows`)
    cache_offset: int = 0  # the cache layer of `layer` 0 (`DecoderLayer.cache_offset`)

    @nn.compact
    def __call__(self, x_BTD, positions_BT, cache_LBSC, layer, write_slots_BT, mask_BTS):
        """Writes this call's latents into layer `layer` + `cache_offset` of the cache, then attends over
        that layer.

        `layer` is a Python int (unrolled layers) or a traced index (the stacked layers'
        scan): the write is an in-place scatter into the cache array either way. The kernels add the
        offset themselves (an add of a traced index would be a launch of its own).
        x_BTD may be `stacked.Rows` (the attention norm's padded rows). Returns (out [B,T,D], cache [L,B,S,C]);
        with `norm_rows`, out may be o_proj's `stacked.Parts` (for the MLP norm's kernel to add)."""
        cfg, dt = self.cfg, self.dtype
        D, H, n, r, v, L = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        )
        w_kv_a = Kernel((D, L + r), ("embed", "kv_lora"), dt, name="kv_a_proj")()
        fused_write = latent_write_ok(self.norm_rows, dt, L, r)
        if cfg.q_lora_rank:
            # q_a and kv_a share their input: one kernel call where the stacked layers read them in place
            w_q_a = Kernel((D, cfg.q_lora_rank), ("embed", "q_lora"), dt, name="q_a_proj")()
            q_shape = (*x_BTD.shape[:-1], cfg.q_lora_rank)
            rows = self.norm_rows if norm_rows_ok(self.norm_rows, q_shape, self.mesh, self.rules, dt) else None
            # q and kv may come back as the dense kernel's partials, for the kernels of q's norm and of the
            # cache write to add (no XLA launch of their own)
            q, kv = matmuls(x_BTD, (w_q_a, w_kv_a), ("btd,dq->btq", "btd,dc->btc"), raw=(rows is not None, fused_write))
            # HF uses its default eps here; as padded rows (`norm_rows`), q_b reads them as they are
            q_a_norm = _norm(cfg.q_lora_rank, 1e-6, dt, name="q_a_norm", mesh=self.mesh)
            # with the cache write's kernel, q's norm runs in its launch (`query_norm_ok`)
            query = fused_write and rows is not None and query_norm_ok(self.norm_rows, dt, cfg.q_lora_rank)
            q_rows = (q, q_a_norm()) if query else None
            if not query:
                q = q_a_norm(q, rows)
        else:
            q_BTHK = Dense((D, H, n + r), ("embed", "heads", "head_dim"), dt, name="q_proj")(
                stacked.value(x_BTD), "btd,dhk->bthk"
            )
            (kv,) = matmuls(x_BTD, (w_kv_a,), ("btd,dc->btc",), raw=(fused_write,))
            q_rows = None

        kv_a_norm = _norm(L, 1e-6, dt, name="kv_a_norm")
        if fused_write:
            # kv's K parts added, its norm, the key's rotation and the store into the cache as one launch
            # (with q's norm beside them where `q_rows`)
            cache_LBSC = _write_latents(
                cache_LBSC,
                kv,
                write_slots_BT,
                positions_BT,
                kv_a_norm(),
                layer,
                cfg,
                self.mesh,
                self.rules,
                self.norm_rows,
                self.cache_offset,
                q_rows,
            )
            if q_rows is not None:
                cache_LBSC, q = cache_LBSC[0], stacked.Rows(cache_LBSC[1], q.shape)
        else:
            kv = stacked.value(kv)
            c_kv = kv_a_norm(kv[..., :L])
            k_rope = apply_rope(kv[..., L:], positions_BT, cfg)
            new_BTC = jnp.concatenate([c_kv, k_rope], axis=-1)
            cache_LBSC = write_slots(cache_LBSC, new_BTC, write_slots_BT, layer + self.cache_offset)

        if cfg.q_lora_rank:
            # q may come back as the dense kernel's partials, for the absorb kernel to add (`_absorb_ok`)
            q_BTHK = Dense((cfg.q_lora_rank, H, n + r), ("q_lora", "heads", "head_dim"), dt, name="q_b_proj")(
                q, "btq,qhk->bthk", raw=True
            )
        kv_b = param(self, "kv_b_proj", (L, H, n + v), ("kv_lora", "heads", "head_dim"), dt)
        # Absorb the key up-projection into the query: scores live in latent space. A stacked layer's
        # kv_b is read in place by `kernels.absorb` where it serves the call (`_absorb_ok`).
        # That kernel also adds q_b's partials and rotates the query's rope part (one launch for the three).
        absorbed = _absorb_ok(kv_b, q_BTHK, n, v, self.rules)
        if absorbed:
            rope = (positions_BT, rope_inv_freq(cfg), rope_attention_factor(cfg), cfg.rope_interleave)
            q_lat_BTHL, q_rope = _absorb(absorb.absorb_keys, q_BTHK, kv_b, n, self.rules, rope=rope)
        else:
            q_BTHK = stacked.value(q_BTHK)
            q_nope, q_rope = q_BTHK[..., :n], apply_rope(q_BTHK[..., n:], positions_BT, cfg)
            kv_b = kv_b.get() if isinstance(kv_b, stacked.LayerOf) else kv_b
            w_uk, w_uv = kv_b[..., :n], kv_b[..., n:]
            q_lat_BTHL = jnp.einsum("bthn,lhn->bthl", q_nope, w_uk.astype(q_nope.dtype))
        impl = choose_attention_impl(self.attention_impl, self.dtype)
        window = bound = None
        # the kernel's form of the mask, (mask, bound[, start, slots]), made by `Transformer` where
        # `attention_kernel_ok`; a plain mask is XLA's
        kernel = isinstance(mask_BTS, tuple) and attention_kernel_ok(impl, cfg, cache_LBSC, x_BTD.dtype)
        if isinstance(mask_BTS, tuple):
            mask_BTS, bound, window = mask_BTS[0], mask_BTS[1], (mask_BTS[2:] or None)
        if kernel:
            if window is not None and mla_attention.window_problem(dt, impl == "interpret") is not None:
                window = None  # the nodes read their slots as they lie (exact up to the pairing of the sums)
            # the kernel reads this layer of the cache in place (XLA's einsums get a copy of it)
            out_lat = _kernel_attention(
                q_lat_BTHL,
                q_rope,
                cache_LBSC,
                layer,
                mask_BTS,
                cfg.softmax_scale,
                self.mesh,
                self.rules,
                impl,
                window,
                bound,
                self.cache_offset,
            )
        else:
            latent_BSC = jax.lax.dynamic_index_in_dim(cache_LBSC, layer + self.cache_offset, axis=0, keepdims=False)
            cache = latent_BSC.astype(x_BTD.dtype)
            latent, rope_key = cache[..., :L], cache[..., L:]
            mask_BTS = mask_BTS if mask_BTS.dtype == jnp.bool_ else mask_BTS != 0
            out_lat = attention(q_lat_BTHL, latent, latent, mask_BTS, cfg.softmax_scale, q_rope, rope_key)
        if absorbed:
            # as o_proj's padded rows where its kernel reads them (the batch whole on every device)
            pad = out_lat.dtype == dt and not _split_axes(self.mesh, self.rules, ("batch",))
            out_BTHV = _absorb(absorb.absorb_values, out_lat, kv_b, n, self.rules, padded=pad)
            if pad:
                out_BTHV = stacked.Rows(out_BTHV, (*out_lat.shape[:-2], H, v), width=2)
        else:
            out_BTHV = jnp.einsum("bthl,lhv->bthv", out_lat, w_uv.astype(out_lat.dtype))
        # with the norms' rows, the product may come back as the dense kernel's partials: the MLP norm's
        # kernel adds them with the residual (`DecoderLayer`)
        out = Dense((H, v, D), ("heads", "head_dim", "embed"), dt, name="o_proj")(
            out_BTHV, "bthv,hvd->btd", raw=self.norm_rows is not None
        )
        return out, cache_LBSC


def attention_kernel_ok(impl: str, cfg: ModelConfig, cache_LBSC, dtype) -> bool:
    """Whether `MLAttention` attends through `kernels.mla_attention` (``impl`` from `choose_attention_impl`):
    a cache of the compute dtype whose latent, rope key and slot count the kernel takes."""
    S = cache_LBSC.shape[2]
    return (
        impl != "xla"
        and cache_LBSC.dtype == dtype
        and mla_attention.shapes_ok(cfg.kv_lora_rank, cfg.qk_rope_head_dim, S)
    )


def _kernel_attention(
    q_lat, q_rope, cache_LBSC, layer, mask_BTS, scale, mesh, rules, impl, window=None, bound=None, offset=0
):
    """`kernels.mla_attention` on layer `layer` + `offset` (static) of the whole cache, read in place; on a
    mesh inside a `shard_map` over the batch and head splits (each device attends with its heads over its rows' cache),
    so the collectives stay those of the XLA form. `window`: the kernel's virtual slots, or None; `bound`
    [B]: the slots past which no row looks, or None."""
    interpret = impl == "interpret"

    def run(ql, qr, c, lyr, m, win, bd):
        return mla_attention.mla_attention(
            ql, qr, c, m, scale, layer=lyr, interpret=interpret, window=win, bound=bd, layer_offset=offset
        )

    layer = jnp.asarray(layer, jnp.int32)
    window = None if window is None else tuple(window)
    if mesh is None:
        return run(q_lat, q_rope, cache_LBSC, layer, mask_BTS, window, bound)
    q_spec = logical_spec(("batch", None, "heads", None), rules)
    row_spec = logical_spec(("batch", None, None), rules)
    cache_spec = logical_spec(LATENT_CACHE_LBSC, rules)
    batch_spec = logical_spec(("batch",), rules)
    win_spec = None if window is None else (batch_spec, row_spec)
    return jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(q_spec, q_spec, cache_spec, P(), row_spec, win_spec, None if bound is None else batch_spec),
        out_specs=q_spec,
        check_vma=False,
    )(q_lat, q_rope, cache_LBSC, layer, mask_BTS, window, bound)


def latent_write_ok(impl: str | None, dtype, latent: int, rope_dim: int) -> bool:
    """Whether the cache write runs as `kernels.latent_write` (kv_a's norm, the key's rotation and the
    store in one launch): with the dense kernels (``impl`` 'kernel' / 'interpret', the norms' rows
    setting), a latent and rope key it takes, and (compiled) a kernel whose probe passed for ``dtype``."""
    if impl not in ("kernel", "interpret") or not latent_write.shapes_ok(latent, rope_dim):
        return False
    return impl == "interpret" or latent_write.available(dtype) is None


def query_norm_ok(impl: str | None, dtype, width: int) -> bool:
    """Whether q_a's norm (rows of ``width``) runs in the cache write's launch (`kernels.latent_write` with
    ``query``): where both kernels serve the layer and the norm's rows take the write's warps
    (`latent_write.query_fits`), the switch `latent_write.DEFAULT_CONFIG` on, and (compiled) the probe of the
    two in one launch passed for ``dtype`` (else they stay two launches, of the same bits)."""
    if impl not in ("kernel", "interpret") or not latent_write.DEFAULT_CONFIG["query"]:
        return False
    if not latent_write.query_fits(width):
        return False
    return impl == "interpret" or latent_write.query_available(dtype) is None


def _write_latents(
    cache_LBSC, kv_BTC, slots_BT, positions_BT, scale, layer, cfg: ModelConfig, mesh, rules, impl, offset=0, query=None
):
    """`kernels.latent_write.write_latents` into layer `layer` + `offset` (static) of the whole cache, in
    place: kv an array or the dense kernel's `stacked.Parts`, the norm's scale read in place from its stack
    where it is a stacked layer's (`LayerOf`). On a mesh inside a `shard_map`, each device writing its copy of the
    rows' cache: the kernel runs with the norms' rows (`norm_rows_ok`), so the batch is whole on every
    device and so are kv's partials. ``query``: (q, its norm's scale) for q_a's norm in the same launch;
    then returns (cache, the norm's padded rows)."""
    stack, index = stacked.stack_and_index(scale)
    parts = isinstance(kv_BTC, stacked.Parts)
    q_in = q_stack = q_index = None
    if query is not None:
        q, (q_stack, q_index) = query[0], stacked.stack_and_index(query[1])
        q_parts = isinstance(q, stacked.Parts)
        q_in = q.parts if q_parts else q
        q_index = None if q_index is None else jnp.asarray(q_index, jnp.int32)

    def run(c, kv, sl, pos, st, lyr, idx, qv, q_st, q_idx):
        if parts:
            kv = stacked.Parts(kv, kv_BTC.shape, kv_BTC.dtype)
        extra = {}
        if query is not None:
            qv = stacked.Parts(qv, q.shape, q.dtype) if q_parts else qv
            extra = dict(query=qv, query_scale=q_st, query_eps=1e-6, query_scale_layer=q_idx)
        return latent_write.write_latents(
            c,
            kv,
            sl,
            pos,
            st,
            1e-6,
            inv_freq=rope_inv_freq(cfg),
            attention_factor=rope_attention_factor(cfg),
            layer=lyr,
            scale_layer=idx,
            interleaved=cfg.rope_interleave,
            interpret=impl == "interpret",
            layer_offset=offset,
            **extra,
        )

    layer = jnp.asarray(layer, jnp.int32)
    index = None if index is None else jnp.asarray(index, jnp.int32)
    kv_in = kv_BTC.parts if parts else kv_BTC
    args = (cache_LBSC, kv_in, slots_BT, positions_BT, stack, layer, index, q_in, q_stack, q_index)
    if mesh is None:
        return run(*args)
    if _split_axes(mesh, rules, ("batch",)):
        raise ValueError("_write_latents: the cache write's kernel runs where the batch is whole on every device")
    cache_spec = logical_spec(LATENT_CACHE_LBSC, rules)
    specs = [cache_spec] + [None if a is None else P() for a in args[1:]]
    return jax.shard_map(
        run,
        mesh=mesh,
        in_specs=tuple(specs),
        out_specs=cache_spec if query is None else (cache_spec, P()),
        check_vma=False,
    )(*args)


def _attention_bound(mask_BTS, window=None):
    """[B] int32: one past the highest slot any row of the sequence sees (the mask's, and a window's virtual
    slots); the whole cache for a sequence that sees none (`kernels.mla_attention`'s `bound`)."""
    S = mask_BTS.shape[-1]
    seen_BS = jnp.any(mask_BTS != 0, axis=1)
    last_B = jnp.max(jnp.where(seen_BS, jnp.arange(1, S + 1, dtype=jnp.int32), 0), axis=-1)
    if window is not None:
        start_B, slots_BTW = window
        last_B = jnp.maximum(last_B, start_B + slots_BTW.shape[-1])
    return jnp.where(last_B > 0, last_B, S).astype(jnp.int32)


def _absorb_ok(kv_b, q_BTHK, nope: int, v: int, rules: Rules) -> bool:
    """Whether `kernels.absorb` serves the absorbed kv_b products of this call: a stacked layer's kv_b
    read in place (`INPLACE_LEAVES`), rows the dense kernel serves (decode and verify), q of kv_b's dtype,
    on a mesh only the heads split, and (compiled) kernels whose probe passed for the dtype."""
    if not isinstance(kv_b, stacked.LayerOf) or q_BTHK.dtype != kv_b.dtype:
        return False
    L = kv_b.shape[0]
    if not absorb.shapes_ok(L, nope, v) or not stacked_matmul.use_kernel(int(np.prod(q_BTHK.shape[:-2]))):
        return False
    spec = stacked._spec(kv_b)
    if spec is not None and any(e is not None for e in (spec[0], spec[1], spec[3])):
        return False
    return kv_b.impl == "interpret" or absorb.available(kv_b.dtype) is None


def _absorb(fn, x, kv_b: stacked.LayerOf, nope: int, rules: Rules, rope=None, **kw):
    """``fn`` (`absorb.absorb_keys` / `absorb_values`) of x [B, T, H, .] with layer `kv_b.index` of the stack,
    read in place; on a mesh inside a `shard_map` over the batch and head splits (each device its heads).
    x may be q_b's `stacked.Parts` (added in the kernel; summed first where kv_b is split on a mesh);
    ``rope`` (`absorb_keys` only): (positions [B, T], inv_freq, attention_factor, interleaved), for the
    kernel to return the rotated rope part of q too."""
    interpret = kv_b.impl == "interpret"
    statics = None if rope is None else tuple(rope[1:])
    spec = stacked._spec(kv_b)
    if spec is not None:
        x = stacked.value(x)
    parts = isinstance(x, stacked.Parts)

    def run(x, stack, index, pos):
        if parts:
            x = stacked.Parts(x, shape, dtype)
        if statics is not None:
            kw["rope"] = (pos, *statics)
        return fn(x, stack, nope, layer=index, interpret=interpret, **kw)

    shape, dtype = tuple(x.shape), x.dtype
    pos = None if rope is None else rope[0]
    x_in = x.parts if parts else x
    if spec is None:
        return run(x_in, kv_b.stack, kv_b.index, pos)
    x_spec = logical_spec(("batch", None, "heads", None), rules)
    out_spec = P(None, spec[2]) if kw.get("padded") else x_spec
    pos_spec = None if rope is None else logical_spec(("batch", None), rules)
    if rope is not None:
        out_spec = (x_spec, x_spec)
    return jax.shard_map(
        run, mesh=kv_b.mesh, in_specs=(x_spec, P(*spec), P(), pos_spec), out_specs=out_spec, check_vma=False
    )(x_in, kv_b.stack, kv_b.index, pos)


# ---------------------------------------------------------------------------
# Feed-forward


def route(logits_TE, bias_E, cfg: ModelConfig):
    """DeepSeek-V3 noaux_tc routing, exactly as HF: returns (experts [T,k] int32, weights [T,k] f32).

    Sigmoid scores; the correction bias is added for selection only; a group's score
    is the sum of its top-2 biased scores; only topk_group groups stay eligible.
    """
    scores = jax.nn.sigmoid(logits_TE.astype(jnp.float32))
    choice = scores + bias_E.astype(jnp.float32)
    T, E = choice.shape
    if cfg.n_group > 1:
        grouped = choice.reshape(T, cfg.n_group, E // cfg.n_group)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, n_group]
        _, keep = jax.lax.top_k(group_score, cfg.topk_group)
        group_ok = jnp.zeros((T, cfg.n_group), bool).at[jnp.arange(T)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(group_ok, E // cfg.n_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * cfg.routed_scaling_factor


def router_logits(x_TD, router) -> jax.Array:
    """float32 router logits ``x @ router`` [T, E]: the products of the router's values (held in the
    model's dtype, as HF transformers and SGLang hold it: bfloat16 on the GPU) summed in float32.

    A stacked layer's router (a `stacked.LayerOf`) is read in place by `kernels.stacked_matmul`
    (`INPLACE_LEAVES`), which gives each row the same bits at any T up to `stacked_matmul.MAX_ROWS`
    (above it, as for every dense weight, XLA's product on the slice): a token is routed alike in a
    one-token decode step and in a verify. A bfloat16 router meets the bfloat16 hidden state on the
    tensor cores (exact products, float32 sums: 5.5 MB a layer at Kimi width, half of a float32 copy);
    a float32 router (float32 models) is a float32 product, bfloat16 rows widened in the kernel,
    exactly. Sliced (an unrolled layer), the product is XLA's on the widened values."""
    if isinstance(router, stacked.LayerOf):
        rows = isinstance(x_TD, stacked.Rows) and x_TD.dtype in (jnp.bfloat16, jnp.float32)
        x = x_TD if rows else stacked.value(x_TD).astype(router.dtype)
        return stacked.einsum("td,de->te", x, router, jnp.float32)
    return jnp.einsum("td,de->te", stacked.value(x_TD).astype(jnp.float32), router.astype(jnp.float32))


def route_tokens(
    logits_TE,
    bias_E,
    cfg: ModelConfig,
    impl: str,
    mesh: Mesh | None = None,
    rules: Rules = RULES,
    gate_up=None,
    blocks=None,
    expert_layer=None,
):
    """(experts [T, k], weights [T, k], h): `route`, through the routing kernel (`jaxspec.kernels.routing`,
    one launch) alongside the fused expert kernel: `impl` 'interpret' runs it in Pallas interpret mode,
    'kernel' compiled where its probe passes on this device. Every call of a model routes the same way
    whatever its token count (the experts' layout fixes `impl`), so a token's experts do not depend on T.
    On a mesh the kernel runs on each device's rows (a shard_map over the tokens' split: no collective).

    The logits may be the dense kernel's `stacked.Parts` (added in the routing kernel, else first);
    ``gate_up``: the shared expert's gate and up products (arrays or Parts) made beside them. Off a mesh
    the routing kernel then also returns h = silu(gate) * up as the down projection's padded rows
    [padded_rows(T), F] (`kernels.routing`: a fixed rounding, the same for every call); else h is None
    and the caller makes the product itself.

    ``blocks`` (a `block_routing.Plan`, off a mesh): the routing kernel's launch also builds the INT4 expert
    kernels' routing metadata (`routing.route_topk(blocks=...)`, for experts of stacked layer
    ``expert_layer``), returned as a fourth entry: `int4_moe.kernel_metadata`'s dict, or None where that
    launch does not run here (`routing.blocks_problem`; the expert kernel then builds its own)."""
    opts = dict(
        k=cfg.num_experts_per_tok,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        norm=cfg.norm_topk_prob,
        scale=cfg.routed_scaling_factor,
    )
    tail = () if blocks is None else (None,)
    if not (impl == "interpret" or (impl == "kernel" and routing.available(logits_TE.shape[1], **opts) is None)):
        bias = bias_E.get() if isinstance(bias_E, stacked.LayerOf) else bias_E
        return (*route(stacked.value(logits_TE), bias, cfg), None, *tail)
    # a stacked layer's bias is read in place: the kernel takes the stack and the layer
    stack, layer = (bias_E.stack, bias_E.index) if isinstance(bias_E, stacked.LayerOf) else (bias_E[None], 0)
    fn = functools.partial(routing.route_topk, **opts, interpret=impl == "interpret")
    layer = jnp.asarray(layer, jnp.int32)
    if blocks is not None and mesh is not None:
        raise ValueError("route_tokens: blocks= builds one device's metadata: off a mesh only")
    if blocks is not None and impl == "kernel":
        E, shape = logits_TE.shape[1], (blocks.num_local, blocks.share)
        blocks = blocks if routing.blocks_problem(E, **opts, num_local=shape[0], share=shape[1]) is None else None
    if mesh is None:
        gu = tuple(gate_up) if gate_up else None
        if blocks is None:
            return (*fn(logits_TE, stack, layer=layer, gate_up=gu), None)[:3] + tail
        *head, outs = fn(logits_TE, stack, layer=layer, gate_up=gu, blocks=blocks, expert_layer=expert_layer)
        head = (*head, None)[:3]
        return (*head, int4_moe.kernel_metadata(outs, head[1], blocks))
    run = lambda lg, b, i: fn(lg, b, layer=i)  # noqa: E731
    row = logical_spec(("batch", None), rules)
    experts, weights = jax.shard_map(run, mesh=mesh, in_specs=(row, P(), P()), out_specs=(row, row), check_vma=False)(
        stacked.value(logits_TE), stack, layer
    )
    return experts, weights, None


# Global expert ids -> the busiest device's local ids (`ModelConfig.share`). It lives beside the
# kernel whose metadata program does the same (the fused INT4 path runs it there, not here).
busiest_share = int4_moe.busiest_share


# Largest dequantized copy of one layer's local INT4 experts that a grouped call may hold
# at once (it exists during that layer's call only).
INT4_DEQUANT_LIMIT = 8 << 30

EXPERT_IMPLS = ("kernel", "interpret", "gather", "xla", "tokamax")
"""Routed-expert implementations (`choose_expert_impl`); any of them can be forced with the one
`expert_impl` setting of `Transformer` / `Engine` / the CLIs' --expert-impl:

* ``kernel``: the fused INT4 Pallas kernel (`jaxspec.kernels.int4_moe`), experts in its tiles layout;
* ``interpret``: the same kernel and layout in Pallas interpret mode (any backend: tests);
* ``gather``: one fused gather-matvec per (token, expert) assignment, straight from the
  checkpoint's layout (INT4 or not): reads only the experts the tokens use;
* ``xla`` / ``tokamax``: tokens sorted by expert, grouped matmuls (INT4 experts dequantized per call).
"""


def expert_kernel_problem(cfg: ModelConfig, need_gpu: bool = True) -> str | None:
    """Why the fused INT4 expert kernel cannot run this model here, or None if it can
    (need_gpu=False: whether the model fits the kernel at all, for interpret mode)."""
    if cfg.expert_format is None:
        return "the routed experts are not INT4"
    if cfg.expert_format.group_size != int4_moe.GROUP:
        return f"the kernel takes INT4 groups of {int4_moe.GROUP}, found {cfg.expert_format.group_size}"
    for name, dim in (("hidden_size", cfg.hidden_size), ("moe_intermediate_size", cfg.moe_intermediate_size)):
        if dim % int4_moe.K_BLOCK:
            return f"the kernel needs {name} to be a multiple of {int4_moe.K_BLOCK}, found {dim}"
    return int4_moe.available() if need_gpu else None


def check_expert_impl(expert_impl: str | None) -> None:
    if expert_impl not in (None, *EXPERT_IMPLS):
        raise ValueError(f"expert_impl: expected None (choose) or one of {EXPERT_IMPLS}, found {expert_impl!r}")


def expert_layout(cfg: ModelConfig, expert_impl: str | None = None) -> str:
    """How the routed experts are held on the devices: `quant.TILES` (the fused kernel's layout,
    re-laid out at load) or `quant.ROWS` (the checkpoint's).

    expert_impl None: tiles where the kernel can run (a GPU with Pallas' Triton lowering, group-32
    INT4, hidden and expert widths that are multiples of 256); 'kernel': tiles, or an error saying
    why not; 'interpret': tiles on any backend; the others: rows."""
    check_expert_impl(expert_impl)
    if expert_impl in ("kernel", "interpret"):
        problem = expert_kernel_problem(cfg, need_gpu=expert_impl == "kernel")
        if problem is not None:
            raise ValueError(f"expert_impl={expert_impl!r}: {problem}")
        return quant.TILES
    if expert_impl is None and expert_kernel_problem(cfg) is None:
        return quant.TILES
    return quant.ROWS


def int4_grouped_wins(
    cfg: ModelConfig, tokens: int, num_shards: int, dtype_bytes: int, limit: int = INT4_DEQUANT_LIMIT
) -> bool:
    """Whether a call of `tokens` tokens should run rows-layout INT4 experts as grouped matmuls.

    The gather path reads one expert's INT4 words and scales per (token, expert)
    assignment: with thousands of assignments (a prefill chunk, a training batch) that is
    every local expert many times over. The grouped path reads each local expert once, writes
    it dequantized and reads that back; it wins once the assignments outweigh those bytes,
    and is used only while the dequantized layer stays within `limit` bytes per device.
    """
    fmt = cfg.expert_format
    if fmt is None:
        return False
    local = -(-cfg.local_experts // num_shards)
    weights = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    int4_bytes = weights / 2 + weights // fmt.group_size * dtype_bytes
    dequantized = local * weights * dtype_bytes
    if dequantized > limit:
        return False
    gather_bytes = tokens * cfg.num_experts_per_tok * int4_bytes
    grouped_bytes = local * int4_bytes + 2 * dequantized
    return gather_bytes > grouped_bytes


def choose_expert_impl(
    cfg: ModelConfig, layout: str, tokens: int, num_shards: int, dtype, expert_impl: str | None = None
) -> str:
    """The routed-expert implementation of one MoE call (one of `EXPERT_IMPLS`): the one place
    it is decided, from the config, the experts' layout, the static token count of the call
    (`tokens`, all rows), the devices the experts are split over and the backend.

    expert_impl forces a choice (it must suit the layout). Otherwise: tiles -> the kernel;
    rows INT4 -> grouped 'xla' when `int4_grouped_wins`, else 'gather'; unquantized -> 'gather'
    while the call's assignments fit the local experts (T*k <= local), else grouped matmuls on
    tokamax where it runs and takes the shapes, else 'xla'.
    """
    check_expert_impl(expert_impl)
    if layout == quant.TILES:
        if expert_impl not in (None, "kernel", "interpret"):
            raise ValueError(
                f"expert_impl={expert_impl!r}: the experts are held in the kernel's tiles layout "
                "(load with this expert_impl instead)"
            )
        return expert_impl or "kernel"
    if expert_impl in ("kernel", "interpret"):
        raise ValueError(
            f"expert_impl={expert_impl!r} needs the experts in the kernel's tiles layout "
            "(Engine(..., expert_impl=...) re-lays them out)"
        )
    if expert_impl is not None:
        return expert_impl
    dtype_bytes = jnp.dtype(dtype).itemsize
    if cfg.expert_format is not None:
        return "xla" if int4_grouped_wins(cfg, tokens, num_shards, dtype_bytes) else "gather"
    local = -(-cfg.local_experts // num_shards)
    if tokens * cfg.num_experts_per_tok <= local:
        return "gather"
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    tokamax_ok = grouped_matmul.tokamax_unavailable_reason() is None and not (
        grouped_matmul.tokamax_dense_problem(dtype, D, F) or grouped_matmul.tokamax_dense_problem(dtype, F, D)
    )
    return "tokamax" if tokamax_ok else "xla"


def expert_ffn(
    x_TD, experts_TK, weights_TK, w, num_local: int, impl: str, layer=None, *, share: int = 1, dense=None, meta=None
):
    """Routed-expert FFN over the experts held locally; reads only the experts the tokens use.

    experts_TK holds local expert ids; ids outside [0, num_local) belong to another device and
    contribute nothing. `w`: {gate, up, down}, each an `Int4Weight` or a float array [E, in, out].
    `impl` (from `choose_expert_impl`): 'kernel' / 'interpret' run `int4_moe.moe_int4` on
    tiles-layout experts; 'gather' one fused gather-matvec per projection and assignment (large
    calls in chunks of about num_local assignments); 'xla' / 'tokamax' grouped matmuls. With
    `layer` (traced), `w` holds every stacked layer's tiles [L, E, ...] and this is layer `layer`.
    `share` > 1: experts_TK hold global ids of `share` devices of num_local experts each (one
    device's share of a mesh, `ModelConfig.share`) and the busiest device's are run
    (`busiest_share`): by the fused kernel's metadata program, for the other impls in XLA first.
    `dense`: with the fused kernel only, a dense product for its down launch to run as well (`int4_moe.moe_int4`;
    `_shared_down_in_launch`); then (y, the product's partials).
    """
    T, k = experts_TK.shape
    if dense is not None and impl not in ("kernel", "interpret"):
        raise ValueError(f"expert_ffn: a dense product rides only the fused kernel's launch, not impl {impl!r}")
    if share > 1 and impl not in ("kernel", "interpret"):
        experts_TK, share = busiest_share(experts_TK, num_local, share), 1
    if impl not in ("kernel", "interpret"):
        x_TD = stacked.value(x_TD)
    elif isinstance(x_TD, stacked.Rows):  # the kernel gathers rows 0 .. T-1 of the padded ones
        x_TD = x_TD.padded
    if impl in ("kernel", "interpret"):  # the fused kernel reads each used expert once
        if layer is not None:
            # All stacked layers' experts [L, E, ...] seen as L*E experts (a free reshape); the kernels
            # read this layer's in place (no per-layer slice copy) from index layer * E on, while the
            # routing metadata is built over this layer's E experts (its cost and the block count
            # follow E, not L*E).
            held = w["gate"].packed.shape
            if held[1] != num_local:
                raise ValueError(f"expert_ffn: stacked experts {held[:2]} do not hold num_local={num_local} per layer")
            w = jax.tree.map(lambda v: v.reshape((-1,) + v.shape[2:]), w)
        return int4_moe.moe_int4(
            x_TD,
            experts_TK,
            weights_TK,
            w,
            num_local=num_local,
            interpret=impl == "interpret",
            expert_layer=layer,
            share=share,
            dense=dense,
            meta=meta,
        )
    if meta is not None:
        raise ValueError(f"expert_ffn: routing metadata is the fused kernel's, not impl {impl!r}'s")
    if impl == "gather":
        chunk = max(1, num_local // k)
        if T <= chunk:
            return grouped_matmul.gathered_expert_ffn(x_TD, experts_TK, weights_TK, w, num_local)
        pad = -T % chunk
        padded = lambda a: jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)).reshape((-1, chunk) + a.shape[1:])
        # Padding rows route to expert -1: they read nothing useful and contribute zero.
        ex = jnp.pad(experts_TK, ((0, pad), (0, 0)), constant_values=-1).reshape(-1, chunk, k)
        out = jax.lax.map(
            lambda c: grouped_matmul.gathered_expert_ffn(c[0], c[1], c[2], w, num_local),
            (padded(x_TD), ex, padded(weights_TK)),
        )
        return out.reshape(-1, x_TD.shape[1])[:T]
    if impl in ("xla", "tokamax"):
        return _expert_ffn_grouped(x_TD, experts_TK, weights_TK, w, num_local, impl)
    raise ValueError(f"expert_ffn: impl must be one of {EXPERT_IMPLS}, found {impl!r}")


def _expert_ffn_grouped(x_TD, experts_TK, weights_TK, w, num_local: int, impl: str):
    """Dedupe the used experts into U = min(num_local, T*k) groups, sort tokens, grouped matmul."""
    T, k = experts_TK.shape
    flat = experts_TK.reshape(-1)
    valid = (flat >= 0) & (flat < num_local)
    flat = jnp.where(valid, flat, num_local)  # sentinel sorts last and joins no group
    U = min(num_local, T * k)
    if U < num_local:
        used = jnp.unique(flat, size=U, fill_value=num_local)  # sorted, sentinel-padded
        group = jnp.searchsorted(used, flat)
        group = jnp.where(valid, group, U)
        take = lambda a: jnp.take(a, jnp.minimum(used, num_local - 1), axis=0)
        w = jax.tree.map(take, w)
    else:
        group = flat
    order = jnp.argsort(group, stable=True)
    group_sizes = jnp.bincount(group, length=U + 1)[:U].astype(jnp.int32)
    token = order // k
    xs = x_TD[token]

    def project(h, name):
        if quant.is_int4(w[name]):
            return grouped_matmul.ragged_dot_int4(h, w[name], group_sizes, impl=impl).astype(h.dtype)
        return grouped_matmul.ragged_dot(h, w[name].astype(h.dtype), group_sizes, impl=impl)

    y = project(jax.nn.silu(project(xs, "gate")) * project(xs, "up"), "down")
    scale = jnp.where(valid, weights_TK.reshape(-1), 0.0)[order]
    y = (y.astype(jnp.float32) * scale[:, None]).astype(x_TD.dtype)
    return jnp.zeros_like(x_TD).at[token].add(y)


def expert_axes(group_size: int | None, layout: str = quant.ROWS) -> dict:
    """Logical axes of the routed-expert weights, {gate, up, down}: a tuple per float weight
    (group_size None), an `Int4Weight` of tuples per INT4 weight (packed words and scales name the
    dim they pack).

    layout tiles (`jaxspec.kernels.int4_moe.relayout`): words [E, K/256, N, 32] and scale pairs
    [E, K/256, N, 4] per projection.
    """
    if group_size is None:
        return {
            "gate": ("expert", "embed", "moe_mlp"),
            "up": ("expert", "embed", "moe_mlp"),
            "down": ("expert", "moe_mlp", "embed"),
        }
    W = quant.Int4Weight
    if layout == quant.TILES:
        gate_up = W(("expert", "embed", "moe_mlp", None), ("expert", "embed", "moe_mlp", None), group_size, layout)
        down = W(("expert", "moe_mlp", "embed", None), ("expert", "moe_mlp", "embed", None), group_size, layout)
    else:  # checkpoint layout: per expert [out, in/8] packed words and [out, in/g] scales
        gate_up = W(("expert", "moe_mlp", "embed"), ("expert", "moe_mlp", "embed"), group_size)
        down = W(("expert", "embed", "moe_mlp"), ("expert", "embed", "moe_mlp"), group_size)
    return {"gate": gate_up, "up": gate_up, "down": down}


def _group_size(cfg: ModelConfig) -> int | None:
    return None if cfg.expert_format is None else cfg.expert_format.group_size


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and not isinstance(x, quant.Int4Weight)


def int4_param(mod: nn.Module, name: str, axes: quant.Int4Weight, shapes: quant.Int4Weight, dtype, in_features: int):
    """An `Int4Weight` parameter of `mod`: random words, normal scales (std 0.02/sqrt(in)) in `dtype`
    (the tiles layout's scales are int32 bits: random too, meant to be overwritten by a load)."""

    def init(key):
        kp, ks = jax.random.split(key)
        packed = jax.random.bits(kp, shapes.packed, jnp.uint32).astype(jnp.int32)
        if axes.layout == quant.TILES:
            scale = jax.random.bits(ks, shapes.scale, jnp.uint32).astype(jnp.int32)
        else:
            scale = (float(0.02 / np.sqrt(in_features)) * jax.random.normal(ks, shapes.scale, jnp.float32)).astype(
                dtype
            )
        box = nn.LogicallyPartitioned
        return quant.Int4Weight(box(packed, axes.packed), box(scale, axes.scale), axes.group_size, axes.layout)

    return mod.param(name, init)


SHARED_AXES = {"gate": ("embed", "mlp"), "up": ("embed", "mlp"), "down": ("mlp", "embed")}
MLP_AXES = (SHARED_AXES["gate"], SHARED_AXES["up"], SHARED_AXES["down"])  # a SwiGLU's kernels, in order


class MoE(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    mesh: Mesh | None = None
    expert_impl: str | None = None  # forced implementation (`EXPERT_IMPLS`), None: `choose_expert_impl`
    rules: Rules = RULES
    expert_layout: str = quant.ROWS  # how the routed experts are held (`expert_layout`)
    defer: bool = False  # the output may be a `stacked.Sum` not yet added (`_experts`)

    def expert_params(self):
        cfg, E, D, F = self.cfg, self.cfg.local_experts, self.cfg.hidden_size, self.cfg.moe_intermediate_size
        axes = expert_axes(_group_size(cfg), self.expert_layout)
        io = {"gate": (D, F), "up": (D, F), "down": (F, D)}  # (in, out)
        if cfg.expert_format is None:
            return {n: param(self, n, (E, *io[n]), axes[n], self.dtype) for n in io}
        w = {}
        for name, (inn, out) in io.items():
            if self.expert_layout == quant.TILES:
                kb = int4_moe.K_BLOCK
                shapes = quant.Int4Weight((E, inn // kb, out, 32), (E, inn // kb, out, 4), 32, quant.TILES)
            else:
                g = cfg.expert_format.group_size
                shapes = quant.Int4Weight((E, out, inn // 8), (E, out, inn // g), g)
            w[name] = int4_param(self, name, axes[name], shapes, self.dtype, inn)
        return w

    @nn.compact
    def __call__(self, x_BTD, stacked_experts=None):
        """stacked_experts: (tiles of every stacked layer [L, E, ...], this layer's index among
        them), passed in by `StackedLayers` instead of this layer's own expert params."""
        cfg = self.cfg
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        # the router in the model's dtype (bfloat16 on the GPU, as HF transformers and SGLang hold it; a
        # float32 checkpoint tensor is rounded once on load), its logits float32 (`router_logits`)
        router = param(self, "router", (D, cfg.num_experts), ("embed", None), self.dtype)
        if self.has_variable(stacked.STACKED, "router_bias"):  # a stacked layer's, read in place (`INPLACE_LEAVES`)
            bias = self.get_variable(stacked.STACKED, "router_bias")
        else:
            bias = self.param(
                "router_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                (cfg.num_experts,),
                jnp.float32,
            )
        impl = choose_expert_impl(
            cfg, self.expert_layout, B * T, shards(self.mesh, "expert", self.rules), self.dtype, self.expert_impl
        )
        shared = None
        if cfg.num_shared_experts:
            F = cfg.moe_intermediate_size * cfg.num_shared_experts // cfg.share
            shared = SwiGLU(D, F, self.dtype, axes=MLP_AXES, name="shared")()  # its kernels, for `_experts`
        gate_up = None
        with jax.named_scope("router"):
            if _router_with_shared(x_TD, router, shared, self.mesh, self.rules):
                # one launch for the three products of the norm's rows: the router's (float32 sums) and
                # the shared expert's gate and up (`stacked.einsums`: each has the bits of its own call)
                # They come back as the dense kernel's partials where it can leave them so: the routing
                # kernel adds them and writes the shared expert's silu(gate) * up as the down
                # projection's padded rows (`route_tokens`), where no XLA launch adds them first.
                logits, *gate_up = stacked.einsums(
                    ("td,de->te", "td,df->tf", "td,df->tf"),
                    x_TD,
                    (router, shared["gate"], shared["up"]),
                    (jnp.float32, None, None),
                    raw=(True, True, True),
                )
            else:
                logits = router_logits(x_TD, router)
            # the experts' routing metadata built in the routing kernel's launch where it can be (`_fused_blocks`)
            w, layer = stacked_experts if stacked_experts is not None else (self.expert_params(), None)
            blocks = _fused_blocks(cfg, impl, self.mesh, B * T, D, w, layer)
            experts, weights, shared_h, *meta = route_tokens(
                logits, bias, cfg, impl, self.mesh, self.rules, gate_up, blocks=blocks, expert_layer=layer
            )
            if shared_h is not None:
                gate_up = None
            elif gate_up:
                gate_up = [stacked.value(g) for g in gate_up]
            # One device's share of a mesh: the busiest device's experts. The fused kernel's metadata
            # program picks the device and shifts the ids itself (no XLA kernels); the others shift here.
            in_kernel = impl in ("kernel", "interpret")
            if cfg.share > 1 and not in_kernel:
                experts = busiest_share(experts, cfg.local_experts, cfg.share)
        with jax.named_scope("experts"):
            y = _experts(
                x_TD,
                experts,
                weights,
                w,
                shared,
                self.mesh,
                self.rules,
                impl,
                self.expert_layout,
                layer,
                gate_up,
                share=cfg.share if in_kernel else 1,
                shared_h=shared_h,
                defer=self.defer,
                meta=meta[0] if meta else None,
            )
        return y.reshape(B, T, D)


def _fused_blocks(cfg: ModelConfig, impl: str, mesh: Mesh | None, tokens: int, d: int, w, layer):
    """The `block_routing.Plan` of the INT4 expert kernels' metadata where the routing kernel's launch builds it
    (`routing.route_topk(blocks=...)`: one launch a MoE layer fewer), else None: the fused expert kernel off a
    mesh, 1 to `routing.DEFAULT_CONFIG['fused_max_tokens']` tokens, and its metadata made by the metadata program
    (`int4_moe.metadata_impl`; on the device `route_tokens` also asks `routing.blocks_problem`). The plan is
    the one `int4_moe.moe_int4` checks its ``meta`` against, so both see one shape."""
    if (
        impl not in ("kernel", "interpret")
        or mesh is not None
        or not 1 <= tokens <= routing.DEFAULT_CONFIG["fused_max_tokens"]
    ):
        return None
    gate = w["gate"]
    num_local = gate.packed.shape[0 if layer is None else 1]
    k = cfg.num_experts_per_tok
    if int4_moe.metadata_impl(tokens * k, num_local, impl == "interpret") == "xla":
        return None
    f = gate.packed.shape[-2]  # the tiles layout's [.., E, K blocks, F, 32]
    return int4_moe.metadata_plan(tokens, k, num_local, d, f, share=cfg.share)


def _shared_in_experts_psum(mesh: Mesh | None, rules: Rules) -> bool:
    """Whether the shared expert's partial sum joins the routed experts' all-reduce (`_experts`): both split
    over the mesh, along the same axes."""
    routed_axes = _split_axes(mesh, rules, ("expert", "moe_mlp"))
    return bool(routed_axes) and _split_axes(mesh, rules, ("mlp",)) == routed_axes


def moe_output_all_reduced(cfg: ModelConfig, mesh: Mesh | None, rules: Rules) -> bool:
    """Whether a MoE layer's output is its experts' sum over the mesh as it is (`_experts` on a mesh: the routed
    experts split, the shared expert absent or in the same sum), with no XLA op after it: then the residual add
    may be a launch of its own (after a collective), which the next layer's norm kernel can make instead
    (`DecoderLayer.defer_add`, `stacked.Deferred` with an array)."""
    routed = bool(_split_axes(mesh, rules, ("expert", "moe_mlp")))
    return routed and (not cfg.num_shared_experts or _shared_in_experts_psum(mesh, rules))


def _router_with_shared(x_TD, router, shared, mesh: Mesh | None, rules: Rules) -> bool:
    """Whether the router's and the shared expert's gate and up products run as one dense kernel call:
    the norm's padded rows (`stacked.Rows`), all three read in place and of one dtype (a float32 router
    beside bfloat16 weights measured slower in one call: its K split follows the bfloat16 steps), the
    shared expert whole on each device (split over the mesh, it runs inside the experts' `shard_map`)."""
    return (
        shared is not None
        and isinstance(x_TD, stacked.Rows)
        and not _split_axes(mesh, rules, ("mlp",))
        and all(isinstance(v, stacked.LayerOf) for v in (router, shared["gate"], shared["up"]))
        and router.dtype == shared["gate"].dtype == shared["up"].dtype == x_TD.dtype
    )


def _split_axes(mesh: Mesh | None, rules: Rules, names) -> tuple[str, ...]:
    """Mesh axes (of size > 1) that the logical `names` map to."""
    axes = {mesh_axis(n, rules) for n in names} - {None}
    return tuple(sorted(a for a in axes if mesh is not None and mesh.shape[a] > 1))


def _experts(
    x_TD,
    experts_TK,
    weights_TK,
    w,
    shared,
    mesh: Mesh | None,
    rules: Rules,
    impl: str,
    layout: str,
    layer=None,
    shared_gate_up=None,
    share: int = 1,
    shared_h=None,
    defer: bool = False,
    meta=None,
):
    """Routed experts (+ the shared expert), split over the mesh as `rules` say.

    The routed weights are split across devices (`expert`) and/or within experts
    (`moe_mlp`); each device runs its local experts (or slices) on all tokens and
    the partial sums meet in one sum over the mesh (`ordered_psum`). When the shared expert is split over
    the same mesh axes (`mlp`), its partial sum joins that same sum.
    `shared_gate_up`: the shared expert's gate and up products where the router's kernel call
    made them (`_router_with_shared`); `shared_h`: instead, silu(gate) * up itself as the padded rows
    [padded_rows(T), F] that the routing kernel wrote (`route_tokens`). `share` > 1: experts_TK hold
    global ids of one device's share of a mesh (`ModelConfig.share`), moved to the busiest device's by
    `expert_ffn` (split over a mesh here, by `busiest_share` before the split, so each device's offset
    applies as before). ``defer``: with ``shared_h``, return the routed output and the shared down's product
    as a `stacked.Sum` (the latter as the dense kernel's partials where it leaves them), not yet added, for
    the next norm's kernel to add (`DecoderLayer`).
    """
    routed_axes = _split_axes(mesh, rules, ("expert", "moe_mlp"))
    fuse_shared = shared is not None and _shared_in_experts_psum(mesh, rules)
    lead = 0 if layer is None else 1  # stacked operands: [L, E, ...]
    num_experts = jax.tree.leaves(w["gate"])[0].shape[lead]
    T = experts_TK.shape[0]
    # (on a mesh `route_tokens` leaves the shared expert's rows to the caller: no `shared_h` there)
    in_launch = not routed_axes and not fuse_shared and _shared_down_in_launch(shared, shared_h, impl, T)
    if not routed_axes:
        dense = (shared_h, shared["down"].stack, shared["down"].index) if in_launch else None
        y = expert_ffn(x_TD, experts_TK, weights_TK, w, num_experts, impl, layer, share=share, dense=dense, meta=meta)
    else:
        if meta is not None:
            raise ValueError("_experts: metadata built by the routing launch is one device's: not with split experts")
        if share > 1:
            experts_TK = busiest_share(experts_TK, num_experts, share)
        expert_axis = mesh_axis("expert", rules) if _split_axes(mesh, rules, ("expert",)) else None
        tok = logical_spec(TOKENS_TD, rules)
        # padded `stacked.Rows` go in as they are where every device holds all the tokens
        rows_shape = x_TD.shape if isinstance(x_TD, stacked.Rows) and not _split_axes(mesh, rules, TOKENS_TD) else None
        x_in = x_TD.padded if rows_shape else stacked.value(x_TD)

        def body(x, ex, wt, wl, sh, lay):
            if rows_shape:
                x = stacked.Rows(x, rows_shape)
            local = jax.tree.leaves(wl["gate"])[0].shape[lead]
            offset = jax.lax.axis_index(expert_axis) * local if expert_axis is not None else 0
            y = expert_ffn(x, ex - offset, wt, wl, local, impl, lay)
            if sh is not None:
                sh = {n: _local(v) for n, v in sh.items()}
                y = (y.astype(jnp.float32) + swiglu(x, sh).astype(jnp.float32)).astype(x.dtype)
            return ordered_psum(y, routed_axes)

        axes = expert_axes(w["gate"].group_size if quant.is_int4(w["gate"]) else None, layout)
        w_specs = jax.tree.map(lambda a: logical_spec(("layers",) * lead + a, rules), axes, is_leaf=_is_axes)
        sh = shared if fuse_shared else None
        sh_specs = None if sh is None else {n: _shared_spec(sh[n], SHARED_AXES[n], rules) for n in sh}
        row = logical_spec(("batch", None), rules)
        y = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P() if rows_shape else tok, row, row, w_specs, sh_specs, P()),
            out_specs=tok,
            check_vma=False,
        )(x_in, experts_TK, weights_TK, w, sh, layer)
    if in_launch:  # the shared down's partials, made by the routed down kernel's launch
        y, parts = y
        down = stacked.Parts(parts, (T, shared["down"].shape[1]), shared_h.dtype)
        down = down if defer else down.value
        y = stacked.Sum(y, down) if defer and down.dtype == y.dtype else y + stacked.value(down)
    elif shared is not None and not fuse_shared and shared_h is not None:
        F = shared["down"].shape[0]
        down = stacked.einsum("tf,fd->td", stacked.Rows(shared_h, (T, F)), shared["down"], raw=defer)
        y = stacked.Sum(y, down) if defer and down.dtype == y.dtype else y + stacked.value(down)
    elif shared is not None and not fuse_shared:
        y = y + swiglu(x_TD, shared, shared_gate_up)  # never fused when split: `_router_with_shared`
    return y


def _shared_down_in_launch(shared, shared_h, impl: str, tokens: int) -> bool:
    """Whether the shared expert's down projection runs in the routed experts' down launch (`int4_moe.moe_int4`'s
    ``dense``) rather than a `stacked_matmul` launch of its own: the switch `int4_moe.DEFAULT_CONFIG["dn_dense"]`
    on, the fused kernel in use inside the stacked layers, the routing kernel's padded rows of ``silu(gate) * up``
    at hand (`route_tokens`), and the down weight a stacked one read in place, whole on the device and of their
    dtype, at a row count and shapes the dense kernel itself would take (it then runs with that kernel's tiles);
    compiled, bfloat16 weights and the device's probe of that launch passed (`int4_moe.dense_available`)."""
    down = None if shared is None else shared["down"]
    return (
        bool(int4_moe.DEFAULT_CONFIG["dn_dense"])
        and impl in ("kernel", "interpret")
        and shared_h is not None
        and isinstance(down, stacked.LayerOf)  # only the stacked layers hand their weights as `LayerOf`
        and down.impl == impl
        and down.whole
        and down.dtype == shared_h.dtype
        and (impl == "interpret" or down.dtype == jnp.bfloat16)  # compiled, the probe's dtype only
        and stacked_matmul.use_kernel(tokens)
        and stacked_matmul.shapes_ok(*down.shape)
        and (impl == "interpret" or int4_moe.dense_available() is None)
    )


def _shared_spec(w, axes, rules: Rules):
    """shard_map in_spec of a shared-expert kernel: an array, or a stacked layer's `LayerOf`."""
    if isinstance(w, stacked.LayerOf):
        return dataclasses.replace(w, stack=logical_spec(("layers",) + tuple(axes), rules), index=P())
    return logical_spec(axes, rules)


def _local(w):
    """A kernel inside a shard_map: a `LayerOf` there holds this device's shard (no mesh)."""
    return dataclasses.replace(w, mesh=None, spec=None) if isinstance(w, stacked.LayerOf) else w


# ---------------------------------------------------------------------------
# Decoder


class DecoderLayer(nn.Module):
    """One decoder layer over a carry (x [B,T,D], cache [L,B,S,C], layer index, captured states).

    The carry form serves the unrolled dense layers (a Python int index) and the
    stacked layers under `nn.scan` (a traced index) alike. The carry's index i counts from
    `cache_offset`: layer i's cache is layer `cache_offset + i` of the cache (the stacked layers'
    index counts from the stack's first layer, so that it indexes their stacks as it is: a
    subtraction of a traced index would be a launch of its own every layer).
    `capture_slot[i]` is the row of `captured` [K+1, B, T, D] that the layer's output goes to
    (row K: not captured), the table counting from `cache_offset` too. A layer entered with a
    `stacked.Deferred` x, or with ``capture_in_norm``, writes the previous layer's output instead, at its
    top (the table then counts one layer back: `StackedLayers`); with ``capture_in_norm`` its attention
    norm's launch writes it (`kernels.rms_norm`'s ``capture``), not an XLA `dynamic_update_slice`.
    """

    cfg: ModelConfig
    layer: int
    dtype: jnp.dtype = jnp.float32
    mesh: Mesh | None = None
    expert_impl: str | None = None
    rules: Rules = RULES
    expert_layout: str = quant.ROWS
    attention_impl: str | None = None
    dense_impl: str | None = None  # the stacked layers' `choose_dense_impl` (None: unrolled, weights sliced)
    cache_offset: int = 0
    defer_add: bool = False  # the closing add may be left to the next layer's norm (`stacked.Deferred`)
    capture_in_norm: bool = False  # the previous layer's output captured by the attention norm's launch

    @nn.compact
    def __call__(self, carry, positions, write_slots, mask, capture_slot, stacked_experts=None):
        cfg, dt = self.cfg, self.dtype
        x, cache, i, captured = carry  # x: the float32 residual stream (or `stacked.Deferred`)
        # With the dense kernel, each norm is one `kernels.rms_norm` launch (the residual add, the norm
        # and the pad the dense kernels would make of their input: `stacked.Rows`)
        rows = self.dense_impl if norm_rows_ok(self.dense_impl, x.shape, self.mesh, self.rules, dt) else None
        norm = functools.partial(_norm, cfg.hidden_size, cfg.rms_norm_eps, dt, mesh=self.mesh)
        if (isinstance(x, stacked.Deferred) or self.capture_in_norm) and not rows:
            raise ValueError("DecoderLayer: a deferred add or a capture reaches a layer whose norm is not the kernel's")
        # the previous layer's output captured in this norm's launch (`capture_slot` counts one layer back; the
        # kernel reads the table at the layer's index, which is its scale's in-place index, i)
        cap = (captured, capture_slot) if self.capture_in_norm and captured is not None else None
        if isinstance(x, stacked.Deferred):
            # the previous layer's closing add, made by this norm's launch: x is then that layer's output,
            # captured here (`capture_slot` counts one layer back: `StackedLayers`)
            out = norm(name="attn_norm")(x.x, rows, x.add, capture=cap)
            (h_in, x), captured = out if cap else (out, captured)
            x = constrain(x, self.mesh, HIDDEN_BTD, self.rules)
            if captured is not None and not cap:
                captured = jax.lax.dynamic_update_index_in_dim(
                    captured, x.astype(captured.dtype), capture_slot[i], axis=0
                )
        elif cap:
            h_in, captured = norm(name="attn_norm")(x, rows, capture=cap)
        else:
            h_in = norm(name="attn_norm")(x, rows) if rows else norm(name="attn_norm")(x.astype(dt))
        with jax.named_scope("attention"):
            h, cache = MLAttention(
                cfg, dt, self.mesh, self.rules, self.attention_impl, rows, self.cache_offset, name="attn"
            )(h_in, positions, cache, i, write_slots, mask)
        if rows:
            hn, x = norm(name="mlp_norm")(x, rows, h)  # h may be o_proj's partials (`stacked.Parts`)
        else:
            x = x + stacked.value(h).astype(x.dtype)
            hn = norm(name="mlp_norm")(x.astype(dt))
        defer = self.defer_add and rows is not None
        if cfg.is_moe_layer(self.layer):
            with jax.named_scope("moe"):
                h = MoE(cfg, dt, self.mesh, self.expert_impl, self.rules, self.expert_layout, defer, name="moe")(
                    hn, stacked_experts
                )
        else:
            with jax.named_scope("mlp"):
                h = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dt, axes=MLP_AXES, name="mlp")(hn)  # Rows too
        cache = constrain(cache, self.mesh, LATENT_CACHE_LBSC, self.rules)
        if defer and (
            isinstance(h, stacked.Sum)
            or (cfg.is_moe_layer(self.layer) and moe_output_all_reduced(cfg, self.mesh, self.rules))
        ):
            # the routed and shared products (or on a mesh their all-reduce) and the add to x left to the next
            # norm's launch
            return (stacked.Deferred(x, h), cache, i + 1, captured), None
        x = constrain(x + stacked.value(h).astype(x.dtype), self.mesh, HIDDEN_BTD, self.rules)
        if captured is not None and not self.capture_in_norm:  # else the next layer's norm captures x
            captured = jax.lax.dynamic_update_index_in_dim(captured, x.astype(captured.dtype), capture_slot[i], axis=0)
        return (x, cache, i + 1, captured), None


class StackedLayers(nn.Module):
    """The identical layers of `stacked_range(cfg)` as one `lax.scan` over stacked parameters.

    Each parameter leaf gets a leading layer axis (logical name 'layers'): they are made
    by vmapping one layer's init over per-layer keys, and applied by scanning that
    layer's `apply` over them, so the loop body is one layer, compiled once.

    What the scan slices is copied out of the stack on the GPU before a matmul reads it, so
    the weights that dominate a decode step's bytes are not sliced: the routed experts in the
    kernel's tiles layout go to the kernel whole (with the layer's index), and with
    `dense_impl` 'kernel' / 'interpret' so do the attention's and the shared expert's dense
    kernels (`INPLACE`), as `jaxspec.stacked.LayerOf` leaves of the 'stacked' collection.
    """

    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    mesh: Mesh | None = None
    expert_impl: str | None = None
    rules: Rules = RULES
    expert_layout: str = quant.ROWS
    dense_impl: str | None = None
    attention_impl: str | None = None

    @nn.compact
    def __call__(self, carry, args):
        stacked_ids = stacked_range(self.cfg)
        start = stacked_ids.start
        impl = choose_dense_impl(self.dense_impl)
        layer = _unbound_layer(self, start, impl, cache_offset=start)  # applied to each layer's slice
        # the carry's index counts from the stack's first layer (`DecoderLayer`), as does the capture table
        positions, write_slots, mask, capture_slot = args
        args = (positions, write_slots, mask, capture_slot[start:])

        def init_all(rng):
            boxed = jax.vmap(lambda k: layer.init(k, carry, *args)["params"])(jax.random.split(rng, len(stacked_ids)))
            return jax.tree.map(
                lambda b: nn.Partitioned(b.value, ("layers",) + tuple(b.names), b.mesh),
                boxed,
                is_leaf=lambda b: isinstance(b, nn.Partitioned),
            )

        shapes = jax.eval_shape(lambda: layer.init(jax.random.key(0), carry, *args)["params"])
        params = {name: self.param(name, lambda rng, n=name: init_all(rng)[n]) for name in shapes}
        if self.is_initializing():
            return jax.lax.scan(lambda c, p: layer.apply({"params": p}, c, *args), carry, params)[0]
        extra = lambda c: ()  # noqa: E731
        if self.expert_layout == quant.TILES and "moe" in params:
            # The kernel reads the experts of every layer in place (a slice per scan step would be a
            # copy of the layer's experts for the kernel call): they stay out of the scanned slices.
            ops = {n: v for n, v in params["moe"].items() if n in int4_moe.PROJECTIONS}
            params = {**params, "moe": {n: v for n, v in params["moe"].items() if n not in ops}}
            extra = lambda c: ((ops, c[2]),)  # noqa: E731
        whole = {}
        if impl != "slice":
            whole, params = _split_inplace(params)
        specs = {path: _stacked_spec(self, _leaf(shapes, path)) for path in whole}

        def step(c, p, layer=layer, args=args):
            variables = {"params": p}
            if whole:
                index = c[2]
                variables[stacked.STACKED] = _nest(
                    {path: stacked.LayerOf(a, index, impl, self.mesh, specs[path]) for path, a in whole.items()}
                )
            return layer.apply(variables, c, *args, *extra(c))

        last_slot = args[3][-1]  # the last layer's row of the captured states, before any shift
        if moe_add_ok(impl, self.dtype):
            carry, args, layer = self._deferred(carry, args, params, step, impl, layer)
        carry, args, layer, tail = self._capture_in_norm(carry, args, impl, layer)
        # every leaf may be read in place: then the scan slices nothing and needs its length
        carry, _ = jax.lax.scan(functools.partial(step, layer=layer, args=args), carry, params, length=len(stacked_ids))
        if tail:  # the last layer's output: no next norm captures it
            x, cache, i, captured = carry
            captured = jax.lax.dynamic_update_index_in_dim(captured, x.astype(captured.dtype), last_slot, axis=0)
            carry = (x, cache, i, captured)
        return carry

    def _capture_in_norm(self, carry, args, impl: str, layer):
        """(carry, args, layer, tail) for layers whose attention norm's launch captures the previous layer's
        output (`capture_in_norm_ok`), else as given with tail False. The capture table then counts one layer
        back (as `_deferred` makes it; made here where the adds are not deferred, with the stack's first
        entry row K: the layer before the stack captured its own output), and ``tail``: the last layer's
        output is captured after the scan here (True), or, with the adds deferred, by `Transformer` (False)."""
        x, cache, i, captured = carry
        if captured is None or not capture_in_norm_ok(impl, x.shape, self.mesh, self.rules, self.dtype):
            return carry, args, layer, False
        layer = layer.clone(capture_in_norm=True)
        if isinstance(x, stacked.Deferred):  # `_deferred` has moved the table on
            return carry, args, layer, False
        return carry, _capture_one_layer_back(args, captured), layer, True

    def _deferred(self, carry, args, params, step, impl: str, layer):
        """(carry, args, layer) for layers that leave their closing add to the next layer's norm launch, where they
        do (`DecoderLayer.defer_add`: the MoE output's two products and the residual add are then one XLA
        launch fewer a layer); else as given. Each layer is then entered with a `stacked.Deferred` x, the
        first with terms of -0.0 (x + -0.0 is x, bit for bit), and captures the layer before it: the capture
        table moves one layer on (the stack's first layer's entry is row K, written by no one: the layer before
        the stack captured its own output). The last layer's add is left to `Transformer` (the final norm)."""
        start = stacked_range(self.cfg).start
        deferring = _unbound_layer(self, start, impl, cache_offset=start, defer_add=True)
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
        out = jax.eval_shape(functools.partial(step, layer=deferring, args=args), carry, one)[0][0]
        if not isinstance(out, stacked.Deferred):
            return carry, args, layer
        x, cache, i, captured = carry
        # -0.0, not 0.0: x + (-0.0) is x for every x, a -0.0 of the stream included (x + 0.0 would make it +0.0)
        zero = jax.tree.map(lambda a: jnp.full(a.shape, -0.0, a.dtype), out.add)
        args = args if captured is None else _capture_one_layer_back(args, captured)
        return (stacked.Deferred(x, zero), cache, i, captured), args, deferring


def _capture_one_layer_back(args, captured):
    """The layers' args with the capture table counting one layer back: entry i names the row of layer i - 1's
    output (captured at the top of layer i), the first entry row K, the spare one."""
    positions, write_slots, mask, capture_slot = args
    k = jnp.full((1,), captured.shape[0] - 1, capture_slot.dtype)
    return positions, write_slots, mask, jnp.concatenate([k, capture_slot[:-1]])


def moe_add_ok(impl: str, dtype) -> bool:
    """Whether the stacked layers may leave a MoE layer's closing add to the next norm's launch
    (`StackedLayers._deferred`): with the dense kernels (``impl`` 'kernel' / 'interpret'), the switch
    `rms_norm.DEFAULT_CONFIG` on, and (compiled) the probe of the norm's two-term residual passed for ``dtype``."""
    if impl not in ("kernel", "interpret") or not rms_norm.DEFAULT_CONFIG["moe_add"]:
        return False
    return impl == "interpret" or rms_norm.sum_available(dtype) is None


def _unbound_layer(m, index: int, dense_impl: str, cache_offset: int = 0, defer_add: bool = False) -> DecoderLayer:
    """Layer `index` with module `m`'s settings (`StackedLayers` or `Transformer`), unbound: applied to
    parameters given at the call (a stacked layer's slice, or an unrolled layer as a stack of one)."""
    return DecoderLayer(
        m.cfg,
        index,
        m.dtype,
        m.mesh,
        m.expert_impl,
        m.rules,
        m.expert_layout,
        m.attention_impl,
        dense_impl,
        cache_offset,
        defer_add,
        parent=None,
    )


def _stacked_spec(m, box):
    """The PartitionSpec of a stacked leaf (layer axis first, unsplit), from its unstacked box's names on
    module `m`'s mesh; None without a mesh."""
    return None if m.mesh is None else logical_spec(("layers",) + tuple(box.names), m.rules)


INPLACE = (("attn",), ("moe", "shared"), ("mlp",))
"""Subtrees of a stacked layer whose dense `kernel` leaves `dense_impl` 'kernel' reads in place:
every attention projection (the absorbed `kv_b_proj`, used per head, is a leaf of `INPLACE_LEAVES`),
the shared expert, and a dense model's MLP. Of the norms, those that run as `kernels.rms_norm` rows read their scales in
place too (`INPLACE_LEAVES`), as does kv_a's, which the cache write's kernel applies."""

INPLACE_LEAVES = (
    ("moe", "router"),
    ("moe", "router_bias"),
    ("attn", "kv_b_proj"),
    ("attn_norm", "scale"),
    ("mlp_norm", "scale"),
    ("attn", "q_a_norm", "scale"),
    ("attn", "kv_a_norm", "scale"),
)
"""Other stacked leaves read in place: the router weight [D, E] (5.5 MB a layer at Kimi width in
bfloat16, a weight every device reads whole every layer; sliced, it was copied out first), its
selection bias [E] (`kernels.routing` reads the layer's row; its slice was the scan's last, a launch a
layer), the absorbed `kv_b_proj` [L, H, nope + v] (`kernels.absorb`; sliced, its per-head products were three XLA
launches a layer), and the scales of the norms that run as `kernels.rms_norm` rows or inside
`kernels.latent_write` (a slice of each was a kernel of its own)."""


def _split_inplace(params: dict):
    """({path: stacked kernel leaf} read in place, the rest of the tree) of the stacked params."""
    whole = {}

    def walk(tree, keys):
        out = {}
        for k, v in tree.items():
            path = keys + (k,)
            if isinstance(v, dict):
                out[k] = walk(v, path)
            elif (k == "kernel" and any(path[: len(pre)] == pre for pre in INPLACE)) or path in INPLACE_LEAVES:
                whole[path] = v
            else:
                out[k] = v
        return out

    rest = walk(params, ())
    return whole, rest


def _nest(flat: dict) -> dict:
    out: dict = {}
    for keys, v in flat.items():
        d = out
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = v
    return out


def _leaf(tree, keys):
    for k in keys:
        tree = tree[k]
    return tree


def choose_dense_impl(dense_impl: str | None = None) -> str:
    """How the stacked layers' dense kernels are read (one of `stacked.DENSE_IMPLS`): in place
    by the Pallas kernel where it runs (a GPU with the Triton lowering), else sliced by the scan;
    `dense_impl` forces one ('kernel' where it cannot run is an error saying why)."""
    if dense_impl not in (None, *stacked.DENSE_IMPLS):
        raise ValueError(f"dense_impl: expected None (choose) or one of {stacked.DENSE_IMPLS}, found {dense_impl!r}")
    if dense_impl == "kernel":
        problem = stacked_matmul.available()
        if problem is not None:
            raise ValueError(f"dense_impl='kernel': {problem}")
    if dense_impl is not None:
        return dense_impl
    return "kernel" if stacked_matmul.available() is None else "slice"


def stacked_range(cfg: ModelConfig) -> range:
    """Layers that run stacked under `lax.scan` (identical structure): every MoE layer, or every
    layer of a dense model. The first_k_dense layers before them stay unrolled."""
    first = cfg.first_k_dense_replace if cfg.num_experts else 0
    return range(min(first, cfg.num_layers), cfg.num_layers)


STACK = "layers"  # parameter subtree of the stacked layers, each leaf [num_stacked, ...]


class Transformer(nn.Module):
    """Kimi-K2.5 text decoder.

    __call__(tokens [B,T], positions [B,T], cache, write_slots [B,T], mask [B,T,S], capture=())
      -> (logits [B,T,V] f32, new cache, captured hidden [B,T,len(capture)*D] or None)

    `capture` lists layer ids i; the captured value is the output of layer i (the
    residual stream entering layer i+1), the convention EAGLE-3 drafts are trained on.

    Layers before `stacked_range(cfg)` are separate modules `layers_i`; the rest share
    one stacked parameter tree `layers` (leading axis: layer) and run under
    `nn.scan`, so compile time does not grow with depth. Checkpoints keep one leaf
    per layer (`per_layer` / `stack_layers` convert).
    """

    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    mesh: Mesh | None = None
    expert_impl: str | None = None  # forces the routed-expert implementation (`EXPERT_IMPLS`); None chooses
    rules: Rules = RULES  # logical axis -> mesh axis (jaxspec.sharding)
    expert_layout: str = quant.ROWS  # how the routed experts are held (`expert_layout`, `to_kernel_layout`)
    dense_impl: str | None = None  # how stacked layers read dense weights (`stacked.DENSE_IMPLS`); None chooses
    attention_impl: str | None = None  # how attention reads the latent cache (`ATTENTION_IMPLS`); None: chosen

    def setup(self):
        cfg = self.cfg
        self.embed = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=self.dtype,
            param_dtype=self.dtype,
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed")),
        )
        stacked = stacked_range(cfg)
        self.layers = [
            DecoderLayer(
                cfg,
                i,
                self.dtype,
                self.mesh,
                self.expert_impl,
                self.rules,
                self.expert_layout,
                self.attention_impl,
                name=f"layers_{i}",
            )
            for i in range(stacked.start)
        ]
        if len(stacked):
            self.stack = StackedLayers(
                cfg,
                self.dtype,
                self.mesh,
                self.expert_impl,
                self.rules,
                self.expert_layout,
                self.dense_impl,
                self.attention_impl,
                name=STACK,
            )
        self.final_norm = _norm(cfg.hidden_size, cfg.rms_norm_eps, self.dtype, mesh=self.mesh)
        if not cfg.tie_word_embeddings:
            self.lm_head = Dense((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), self.dtype)

    def __call__(
        self,
        tokens_BT,
        positions_BT,
        cache: LatentCache,
        write_slots_BT,
        mask_BTS,
        capture: Sequence[int] = (),
        window=None,
    ):
        """(logits [B,T,V] float32, cache, captured aux states). `window` (start [B], slots [B, T, W]): the
        attention kernel's virtual slots (`kernels.mla_attention.mla_attention`; a tree verify's, so that a
        node meets its ancestors where a decode step has them); XLA's attention reads the mask alone."""
        cfg = self.cfg
        # The residual stream between layers stays float32 (each layer reads it rounded to the
        # compute dtype, as a bfloat16 model's layers would): a stacked loop carries exactly the
        # rounding the program states, so the sums of 61 layers are kept in float32.
        x = self._constrain(self.embed(tokens_BT).astype(jnp.float32), HIDDEN_BTD)
        slot = np.full(cfg.num_layers, len(capture), np.int32)
        for j, i in enumerate(capture):
            slot[i] = j
        captured = None
        if capture:
            captured = jnp.zeros((len(capture) + 1,) + x.shape, self.dtype)
        carry = (x, cache.latent_LBSC, 0, captured)
        if attention_kernel_ok(
            choose_attention_impl(self.attention_impl, self.dtype), cfg, cache.latent_LBSC, self.dtype
        ):
            # the attention kernel's form, made once for all layers: the mask as int32, the slots past which
            # no row looks (its walk stops there: a cache sized for the whole generation is read only as far
            # as it is filled) and the window's virtual slots
            mask_BTS = mask_BTS.astype(jnp.int32)
            mask_BTS = (mask_BTS, _attention_bound(mask_BTS, window), *(window or ()))
        args = (positions_BT, write_slots_BT, mask_BTS, jnp.asarray(slot))
        impl = self._inplace_impl()
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                carry, _ = self._unrolled_inplace(i, carry, args, impl) if impl else layer(carry, *args)
        stack_ids = stacked_range(cfg)
        if len(stack_ids):
            with jax.named_scope(f"layers_{stack_ids.start}_{stack_ids.stop - 1}"):
                x, lat, _, captured = carry
                carry = self.stack((x, lat, jnp.int32(0), captured), args)  # its index counts from its first layer
        x, lat, _, captured = carry
        deferred = isinstance(x, stacked.Deferred)  # the last layer's closing add (`StackedLayers._deferred`)
        if impl and not self.cfg.tie_word_embeddings and norm_rows_ok(impl, x.shape, self.mesh, self.rules, self.dtype):
            # the final norm's padded rows straight into lm_head's in-place product (`logits`)
            h, x = self.final_norm(x.x, impl, x.add) if deferred else (self.final_norm(x, impl), x)
        else:
            x = stacked.value(x)
            h = self.final_norm(x.astype(self.dtype))
        if deferred and capture and slot[cfg.num_layers - 1] < len(capture):
            captured = captured.at[slot[cfg.num_layers - 1]].set(x.astype(captured.dtype))
        aux = jnp.concatenate([captured[j] for j in range(len(capture))], axis=-1) if capture else None
        return self.logits(h), LatentCache(lat), aux

    def _constrain(self, x, axes):
        return constrain(x, self.mesh, axes, self.rules)

    def _inplace_impl(self) -> str | None:
        """The stacked layers' in-place `dense_impl` ('kernel' / 'interpret') for the unrolled layers,
        the final norm and lm_head too; None where weights are sliced (or while initializing)."""
        if self.is_initializing():
            return None
        impl = choose_dense_impl(self.dense_impl)
        return None if impl == "slice" else impl

    def _unrolled_inplace(self, i: int, carry, args, impl: str):
        """Unrolled layer i as the stacked layers run, its dense weights, kv_b and norm scales read by the
        same kernels (`INPLACE`, `INPLACE_LEAVES`) as a stack of one layer (a free reshape). Its products
        then keep a row's bits whatever the number of rows, as the stacked layers' do: with XLA's matmuls,
        whose algorithm follows the row count, a verify row could part from the decode step at layer 0
        (docs/PERFORMANCE.md)."""
        layer = _unbound_layer(self, i, impl)
        whole, rest = _split_inplace(self.variables["params"][f"layers_{i}"])
        shapes = jax.eval_shape(lambda: layer.init(jax.random.key(0), carry, *args)["params"])
        zero = jnp.int32(0)
        inplace = {
            path: stacked.LayerOf(a[None], zero, impl, self.mesh, _stacked_spec(self, _leaf(shapes, path)))
            for path, a in whole.items()
        }
        return layer.apply({"params": rest, stacked.STACKED: _nest(inplace)}, carry, *args)

    def logits(self, h_BTD):
        # float32 out of the matmul's accumulator: bfloat16 logits (a step of 1/16 at magnitude 8-16)
        # tie often at the top of a large vocabulary, and a tie resolves by rounding, not by the model.
        impl = self._inplace_impl()
        if impl and not self.cfg.tie_word_embeddings:
            # lm_head by `kernels.stacked_matmul` as a stack of one: a logit's bits do not follow the rows
            w = self.variables["params"]["lm_head"]["kernel"]
            spec = None if self.mesh is None else logical_spec(("layers", "embed", "vocab"), self.rules)
            lw = stacked.LayerOf(w[None], jnp.int32(0), impl, self.mesh, spec)
            return stacked.einsum("btd,dv->btv", h_BTD, lw, jnp.float32)
        h_BTD = stacked.value(h_BTD)
        if self.cfg.tie_word_embeddings:
            table = self.embed.embedding.astype(h_BTD.dtype)
            return jnp.einsum("btd,vd->btv", h_BTD, table, preferred_element_type=jnp.float32)
        return self.lm_head(h_BTD, "btd,dv->btv", out_dtype=jnp.float32)

    def embed_tokens(self, tokens):
        return self.embed(tokens)


def per_layer(cfg: ModelConfig, tree: dict) -> dict:
    """The checkpoint layout of a parameter tree: the stacked `layers` subtree split into
    `layers_i` subtrees (arrays are indexed, ShapeDtypeStructs lose their leading dim).
    A tree already per layer is returned as it is."""
    if STACK not in tree:
        return tree
    out = {k: v for k, v in tree.items() if k != STACK}
    for j, i in enumerate(stacked_range(cfg)):
        out[f"layers_{i}"] = jax.tree.map(
            lambda x, j=j: jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x[j],
            tree[STACK],
        )
    return out


def stack_layers(cfg: ModelConfig, tree: dict) -> dict:
    """Inverse of `per_layer` for arrays (numpy stays numpy)."""
    stacked = stacked_range(cfg)
    if not len(stacked) or STACK in tree:
        return tree
    out = {k: v for k, v in tree.items() if k not in {f"layers_{i}" for i in stacked}}
    layers = [tree[f"layers_{i}"] for i in stacked]
    stack = lambda *xs: np.stack(xs) if all(isinstance(x, np.ndarray) for x in xs) else jnp.stack(xs)
    out[STACK] = jax.tree.map(stack, *layers)
    return out


def to_kernel_layout(cfg: ModelConfig, params: dict) -> dict:
    """Parameters with every MoE layer's INT4 experts re-laid out for the fused kernel (lossless,
    same bytes; the stacked layers converted with a vmap over their leading axis)."""

    def convert(moe, stacked: bool):
        experts = {n: moe[n] for n in int4_moe.PROJECTIONS}
        tiles = jax.vmap(int4_moe.relayout)(experts) if stacked else int4_moe.relayout(experts)
        return {**moe, **tiles}

    out = dict(params)
    for key, sub in params.items():
        if isinstance(sub, dict) and "moe" in sub and holds_rows_int4(sub["moe"]):
            out[key] = {**sub, "moe": convert(sub["moe"], key == STACK)}
    return out


def routed_expert_path(path: tuple[str, ...]) -> bool:
    """Whether a `checkpoint.flatten` path is a routed-expert leaf (float, or either array of an
    `Int4Weight`, in either layout)."""
    names = {
        f"{p}{suffix}" for p in int4_moe.PROJECTIONS for suffix in ("", *(f"_{f}" for f in quant.Int4Weight.LEAVES))
    }
    return len(path) >= 2 and path[-2] == "moe" and path[-1] in names


def holds_rows_int4(moe: dict) -> bool:
    """Whether an MoE parameter subtree holds INT4 experts in the checkpoint's rows layout."""
    w = moe.get("gate")
    return quant.is_int4(w) and w.layout == quant.ROWS


def abstract_params(cfg: ModelConfig, dtype=jnp.float32, layout: str = quant.ROWS):
    """(shapes, logical specs) of the parameter tree, without allocating anything.

    layout: how INT4 experts are held; `quant.TILES` is the fused kernel's layout (on-device
    only; checkpoints hold the rows layout). The trees are a function of the three arguments alone,
    traced once per process for each (an abstract init of the whole model: 0.4-1.3 s on the CPU for
    the demo target, and loading an engine asks two or three times); each call returns its own copy."""
    shapes, specs = _abstract_params(cfg, jnp.dtype(dtype), layout)
    return copy.deepcopy(shapes), copy.deepcopy(specs)


@functools.lru_cache(maxsize=32)
def _abstract_params(cfg: ModelConfig, dtype: jnp.dtype, layout: str):
    impl = "interpret" if layout == quant.TILES else "gather"  # shapes only: nothing runs
    model = Transformer(cfg, dtype, expert_impl=impl, expert_layout=layout)
    B, T, S = 1, 1, 1
    boxed = jax.eval_shape(
        lambda: model.init(
            jax.random.key(0),
            jnp.zeros((B, T), jnp.int32),
            jnp.zeros((B, T), jnp.int32),
            init_cache(cfg, B, S, dtype),
            jnp.zeros((B, T), jnp.int32),
            jnp.ones((B, T, S), bool),
        )
    )
    specs = nn.get_partition_spec(boxed)["params"]
    shapes = nn.meta.unbox(boxed)["params"]
    return shapes, specs


def init_params(cfg: ModelConfig, key, dtype=jnp.float32, shardings=None):
    """Random parameters in the checkpoint's layout (benchmarks and tests), optionally created
    directly sharded."""
    model = Transformer(cfg, dtype, expert_impl="gather")

    def make(k):
        B, T, S = 1, 1, 1
        v = model.init(
            k,
            jnp.zeros((B, T), jnp.int32),
            jnp.zeros((B, T), jnp.int32),
            init_cache(cfg, B, S, dtype),
            jnp.zeros((B, T), jnp.int32),
            jnp.ones((B, T, S), bool),
        )
        return nn.meta.unbox(v)["params"]

    return jax.jit(make, out_shardings=shardings)(key)
