"""EAGLE-3 draft model (SpecForge / SGLang ``LlamaForCausalLMEagle3`` layout).

The draft is a single Llama decoder layer ("midlayer") whose attention input
is twice the hidden width: ``concat(input_layernorm(embed(token)),
hidden_norm(h))``.  ``h`` is either the projection ``fc`` of three captured
target hidden states (first step) or the draft's own pre-norm output from the
previous step (later steps).  The draft owns no embedding table; it reuses the
target's, which is why the draft hidden size must equal the target's.

Math, mirrored from SpecForge's ``LlamaForCausalLMEagle3`` (training code):

    h0      = fc(concat(fc_norm_i(aux_i)))           # fc_norm only if config.fc_norm
    x       = concat(input_layernorm(e), hidden_norm(h))      # [.., 2*hidden]
    a       = h + o_proj(attn(rope(q_proj x), rope(k_proj x), v_proj x))
    h_out   = a + mlp(post_attention_layernorm(a))             # fed back as next h
    logits  = lm_head(norm(h_out))                   # no norm if norm_output=False

Alignment (SpecForge shifts ``input_ids`` left by one against the hidden
states): row ``t`` combines the target state at position ``t`` with the
embedding of token ``t+1`` and predicts token ``t+2``; RoPE uses position
``t``.  At tree depth ``k`` (k-th draft step after the target state at ``t``)
the position is ``t + k`` and the query attends to the committed prefix
``0..t`` plus its own ancestors (SpecForge's test-time-training attention).

Parameter tree of :class:`Eagle3Draft` (kernels are ``[in, out]``)::

    fc/kernel                                   [3*target_hidden, hidden]
    fc_norm_{0,1,2}/scale                       [target_hidden]  (fc_norm only)
    midlayer/input_layernorm/scale              [hidden]
    midlayer/hidden_norm/scale                  [hidden]
    midlayer/post_attention_layernorm/scale     [hidden]
    midlayer/self_attn/{q,k,v}_proj/kernel      [2*hidden, heads*head_dim | kv_heads*head_dim]
    midlayer/self_attn/o_proj/kernel            [heads*head_dim, hidden]
    midlayer/mlp/{gate,up}_proj/kernel          [hidden, intermediate]
    midlayer/mlp/down_proj/kernel               [intermediate, hidden]
    norm/scale                                  [hidden]
    lm_head/kernel                              [hidden, draft_vocab]

Activations are computed in the parameters' dtype (fp32 in tests, bf16 on
GPU); attention softmax and the returned logits are fp32.
"""

from __future__ import annotations

import math
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

# The draft's config and its config.json parsing live with the target's in jaxspec.config
# (one parser, one RoPE rule); `jaxspec.draft.DraftConfig` keeps working.
from jaxspec.config import ConfigError, DraftConfig, UnsupportedConfig  # noqa: F401 (re-exported)

# --------------------------------------------------------------------------
# Target/draft pairing
# --------------------------------------------------------------------------


def aux_layer_ids(draft_cfg: DraftConfig, num_target_layers: int) -> tuple[int, int, int]:
    """Target layers whose outputs feed the draft, low to high.

    Convention: id ``i`` means the output of target layer ``i`` (the residual
    stream entering layer ``i + 1``, before any final norm).  This is what
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` stores: SGLang adds 1 and
    captures the input of that layer.  Without ids in the config we use
    SGLang's default capture points (inputs of layers ``2, L//2, L-3``), which
    in this convention are ``(1, L//2 - 1, L - 4)``; SpecForge uses the same
    default.  Valid ids satisfy ``0 <= i <= L - 2`` (SGLang cannot capture the
    output of the last layer: there is no layer ``L`` whose input it is).
    """
    L = int(num_target_layers)
    if draft_cfg.aux_layer_ids is not None:
        ids = tuple(draft_cfg.aux_layer_ids)
        field = f"{draft_cfg.source}: eagle_config.eagle_aux_hidden_state_layer_ids"
    else:
        ids = (1, L // 2 - 1, L - 4)
        field = f"default aux layer ids for a {L}-layer target"
    for i in ids:
        if not 0 <= i <= L - 2:
            raise ConfigError(
                f"{field} = {list(ids)}: id {i} is outside [0, {L - 2}] "
                f"(target num_layers = {L}; id i captures the output of layer i, "
                f"which must feed a later layer)"
            )
    return ids  # type: ignore[return-value]


def validate_pair(target: Any, draft_cfg: DraftConfig, d2t=None, t2d=None) -> None:
    """Check that a draft fits a target.

    ``target`` needs ``hidden_size``, ``vocab_size`` and ``num_layers``
    (optionally ``source`` naming its config file).  ``d2t``/``t2d`` (the
    draft checkpoint's vocabulary maps) are checked when given.  Raises
    ConfigError (a ValueError) naming both sides, expected vs found.
    """
    tsrc = getattr(target, "source", "target config")
    dsrc = draft_cfg.source

    def mismatch(tfield, tval, dfield, dval, why):
        raise ConfigError(f"draft/target mismatch: {dsrc} {dfield} = {dval} but {tsrc} {tfield} = {tval} ({why})")

    if draft_cfg.hidden_size != target.hidden_size:
        mismatch(
            "hidden_size",
            target.hidden_size,
            "hidden_size",
            draft_cfg.hidden_size,
            "the draft embeds tokens with the target's embedding table",
        )
    if draft_cfg.target_hidden_size != target.hidden_size:
        mismatch(
            "hidden_size",
            target.hidden_size,
            "target_hidden_size",
            draft_cfg.target_hidden_size,
            "fc consumes target hidden states",
        )
    if draft_cfg.vocab_size != target.vocab_size:
        mismatch(
            "vocab_size",
            target.vocab_size,
            "vocab_size",
            draft_cfg.vocab_size,
            "draft ids map into the target vocabulary",
        )
    try:
        aux_layer_ids(draft_cfg, target.num_layers)
    except ConfigError as e:
        raise ConfigError(f"draft/target mismatch ({tsrc} num_layers = {target.num_layers}): {e}") from None

    if d2t is not None:
        d2t = np.asarray(d2t)
        if d2t.shape != (draft_cfg.draft_vocab_size,):
            raise ConfigError(
                f"{dsrc}: d2t has shape {d2t.shape}, expected ({draft_cfg.draft_vocab_size},) = (draft_vocab_size,)"
            )
        tgt = np.arange(d2t.shape[0], dtype=np.int64) + d2t.astype(np.int64)
        bad = np.flatnonzero((tgt < 0) | (tgt >= target.vocab_size))
        if bad.size:
            i = int(bad[0])
            raise ConfigError(
                f"{dsrc}: d2t maps draft id {i} to target id {int(tgt[i])}, outside "
                f"[0, {target.vocab_size}) = {tsrc} vocab_size ({bad.size} bad entries)"
            )
    if t2d is not None:
        t2d = np.asarray(t2d)
        if t2d.shape != (target.vocab_size,):
            raise ConfigError(f"{dsrc}: t2d has shape {t2d.shape}, expected ({target.vocab_size},) = {tsrc} vocab_size")
        if int(t2d.astype(bool).sum()) != draft_cfg.draft_vocab_size:
            raise ConfigError(
                f"{dsrc}: t2d marks {int(t2d.astype(bool).sum())} target ids, expected "
                f"draft_vocab_size = {draft_cfg.draft_vocab_size}"
            )


def draft_to_target_ids(d2t, draft_ids):
    """Map draft-vocabulary ids to target ids: ``draft_id + d2t[draft_id]``."""
    d2t = jnp.asarray(d2t)
    draft_ids = jnp.asarray(draft_ids)
    return draft_ids + d2t[draft_ids].astype(draft_ids.dtype)


# --------------------------------------------------------------------------
# Numerics
# --------------------------------------------------------------------------


def rope_inv_freq(cfg: DraftConfig) -> np.ndarray:
    """Per-pair inverse frequencies [head_dim/2] (fp32), incl. linear/llama3 scaling."""
    dim = cfg.head_dim
    inv = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    inv = inv.astype(np.float32)
    if cfg.rope_type == "linear":
        # Linear scaling divides positions by the factor; same as dividing frequencies.
        inv = inv / np.float32(cfg.rope_factor)
    elif cfg.rope_type == "llama3":
        factor, lo, hi = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        orig = cfg.rope_original_max_position
        wavelen = 2 * math.pi / inv
        if lo != hi:
            smooth = (orig / wavelen - lo) / (hi - lo)
        else:
            smooth = np.zeros_like(inv)
        scaled = np.where(wavelen > orig / lo, inv / factor, (1 - smooth) * inv / factor + smooth * inv)
        inv = np.where(wavelen < orig / hi, inv, scaled).astype(np.float32)
    return inv


def apply_rope(x, positions, inv_freq):
    """Llama rotate-half RoPE.  x [B,T,N,D], positions [B,T] -> [B,T,N,D]."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B,T,D/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, cast back, then scale."""

    eps: float
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (scale.astype(x.dtype) * y.astype(x.dtype)).astype(x.dtype)


class Linear(nn.Module):
    """Bias-free linear layer, kernel [in, out]; computes in the kernel's dtype."""

    features: int
    param_dtype: Any = jnp.float32
    out_dtype: Any | None = None  # e.g. fp32 logits from bf16 weights

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.normal(0.02), (x.shape[-1], self.features), self.param_dtype)
        x = x.astype(kernel.dtype)
        out_dtype = self.out_dtype or kernel.dtype
        return jnp.einsum("...i,io->...o", x, kernel, preferred_element_type=out_dtype).astype(out_dtype)


@flax.struct.dataclass
class DraftCache:
    """Draft KV cache: k, v [B, S, kv_heads, head_dim] (post-RoPE keys)."""

    k: jax.Array
    v: jax.Array


def init_draft_cache(cfg: DraftConfig, batch: int, max_len: int, dtype=jnp.float32) -> DraftCache:
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return DraftCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def _write_cache(buf, new, write_slots):
    """buf [B,S,...] <- new [B,T,...] at slots [B,T]; slots >= S are dropped (padding)."""
    rows = jnp.arange(buf.shape[0])[:, None]
    return buf.at[rows, write_slots].set(new.astype(buf.dtype), mode="drop")


class Attention(nn.Module):
    cfg: DraftConfig
    param_dtype: Any = jnp.float32

    def setup(self):
        c = self.cfg
        self.q_proj = Linear(c.num_heads * c.head_dim, self.param_dtype)
        self.k_proj = Linear(c.num_kv_heads * c.head_dim, self.param_dtype)
        self.v_proj = Linear(c.num_kv_heads * c.head_dim, self.param_dtype)
        self.o_proj = Linear(c.hidden_size, self.param_dtype)

    def __call__(self, x, positions, cache: DraftCache, write_slots, mask):
        """x [B,T,2H]; attends over the updated cache [B,S] under mask [B,T,S]."""
        c = self.cfg
        B, T, _ = x.shape
        inv_freq = rope_inv_freq(c)
        q = apply_rope(self.q_proj(x).reshape(B, T, c.num_heads, c.head_dim), positions, inv_freq)
        k = apply_rope(self.k_proj(x).reshape(B, T, c.num_kv_heads, c.head_dim), positions, inv_freq)
        v = self.v_proj(x).reshape(B, T, c.num_kv_heads, c.head_dim)
        cache = DraftCache(k=_write_cache(cache.k, k, write_slots), v=_write_cache(cache.v, v, write_slots))

        groups = c.num_heads // c.num_kv_heads  # GQA: query head n uses kv head n // groups
        qg = q.reshape(B, T, c.num_kv_heads, groups, c.head_dim)
        kc = cache.k.astype(q.dtype)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, kc, preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(c.head_dim)
        # Finite fill keeps fully-masked (padding) rows NaN-free.
        scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, cache.v.astype(q.dtype))
        return self.o_proj(out.reshape(B, T, c.num_heads * c.head_dim)), cache


class MLP(nn.Module):
    cfg: DraftConfig
    param_dtype: Any = jnp.float32

    def setup(self):
        c = self.cfg
        self.gate_proj = Linear(c.intermediate_size, self.param_dtype)
        self.up_proj = Linear(c.intermediate_size, self.param_dtype)
        self.down_proj = Linear(c.hidden_size, self.param_dtype)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Midlayer(nn.Module):
    cfg: DraftConfig
    param_dtype: Any = jnp.float32

    def setup(self):
        eps = self.cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(eps, self.param_dtype)
        self.hidden_norm = RMSNorm(eps, self.param_dtype)
        self.post_attention_layernorm = RMSNorm(eps, self.param_dtype)
        self.self_attn = Attention(self.cfg, self.param_dtype)
        self.mlp = MLP(self.cfg, self.param_dtype)

    def __call__(self, embeds, h, positions, cache, write_slots, mask):
        # Both streams are normalised separately, then concatenated [embed | hidden];
        # the residual is the un-normalised h.
        x = jnp.concatenate([self.input_layernorm(embeds), self.hidden_norm(h)], axis=-1)
        attn, cache = self.self_attn(x, positions, cache, write_slots, mask)
        a = h + attn
        return a + self.mlp(self.post_attention_layernorm(a)), cache


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft; see the module docstring for the parameter tree."""

    cfg: DraftConfig
    param_dtype: Any = jnp.float32

    def setup(self):
        c = self.cfg
        self.fc = Linear(c.hidden_size, self.param_dtype)
        if c.fc_norm:
            self.fc_norm = [RMSNorm(c.rms_norm_eps, self.param_dtype) for _ in range(3)]
        self.midlayer = Midlayer(c, self.param_dtype)
        self.norm = RMSNorm(c.rms_norm_eps, self.param_dtype)
        self.lm_head = Linear(c.draft_vocab_size, self.param_dtype, out_dtype=jnp.float32)

    def project_aux(self, aux):
        """aux [B,T,3*target_hidden] (low, mid, high) -> h [B,T,hidden]."""
        if self.cfg.fc_norm:
            chunks = jnp.split(aux, 3, axis=-1)
            aux = jnp.concatenate([n(x) for n, x in zip(self.fc_norm, chunks)], axis=-1)
        return self.fc(aux)

    def __call__(self, embeds, h, positions, cache, write_slots, mask):
        """One draft step; returns (logits fp32 [B,T,Vd], h_out [B,T,H], cache)."""
        dtype = self.param_dtype  # activations follow the weights' dtype
        h_out, cache = self.midlayer(embeds.astype(dtype), h.astype(dtype), positions, cache, write_slots, mask)
        logits = self.lm_head(self.norm(h_out) if self.cfg.norm_output else h_out)
        return logits, h_out, cache

    def init_all(self, aux, embeds, positions, cache, write_slots, mask):
        """Touches every submodule (for ``init``)."""
        logits, h_out, cache = self(embeds, self.project_aux(aux), positions, cache, write_slots, mask)
        self.norm(h_out)  # `norm` stays in the tree (and checkpoint) even when norm_output=False
        return logits, h_out, cache


# --------------------------------------------------------------------------
# Functional API
# --------------------------------------------------------------------------


def init_params(cfg: DraftConfig, rng, param_dtype=jnp.float32):
    """Random parameters with the documented tree (norm scales = 1)."""
    cache = init_draft_cache(cfg, 1, 1, param_dtype)
    ones = jnp.ones((1, 1), jnp.int32)
    variables = Eagle3Draft(cfg, param_dtype).init(
        rng,
        jnp.zeros((1, 1, 3 * cfg.target_hidden_size), param_dtype),
        jnp.zeros((1, 1, cfg.hidden_size), param_dtype),
        ones * 0,
        cache,
        ones * 0,
        jnp.ones((1, 1, 1), bool),
        method=Eagle3Draft.init_all,
    )
    return variables["params"]


# Logical axes of the draft's weights (jaxspec.sharding maps them: replicated by default; the
# 'sharded' placement splits heads, MLP and vocab like SGLang's tensor-parallel draft).
_PARAM_AXES = {
    ("self_attn", "q_proj"): (None, "draft_heads"),
    ("self_attn", "k_proj"): (None, "draft_kv_heads"),
    ("self_attn", "v_proj"): (None, "draft_kv_heads"),
    ("self_attn", "o_proj"): ("draft_heads", None),
    ("mlp", "gate_proj"): (None, "draft_mlp"),
    ("mlp", "up_proj"): (None, "draft_mlp"),
    ("mlp", "down_proj"): ("draft_mlp", None),
    ("lm_head",): (None, "draft_vocab"),
}


def param_axes(params) -> dict:
    """Tree of logical axis tuples matching ``params`` (one entry per array dim)."""
    from flax import traverse_util

    flat = traverse_util.flatten_dict(params)
    out = {}
    for path, leaf in flat.items():
        axes = next((a for key, a in _PARAM_AXES.items() if path[-1 - len(key) : -1] == key), None)
        out[path] = axes if axes is not None else (None,) * len(leaf.shape)
    return traverse_util.unflatten_dict(out)


def step_param_bytes(params, shards: dict | None = None) -> int:
    """Weight bytes one draft step reads on one device (everything but ``fc``, used once per extend).

    ``shards`` maps a logical axis to the number of pieces it is split into (none: replicated).
    """
    from flax import traverse_util

    shards = shards or {}
    axes = traverse_util.flatten_dict(param_axes(params))
    total = 0
    for path, leaf in traverse_util.flatten_dict(params).items():
        if path[0] == "fc" or path[0].startswith("fc_norm"):
            continue
        split = math.prod(shards.get(a, 1) for a in axes[path] if a is not None)
        total += math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize // split
    return total


def _param_dtype(params):
    return params["lm_head"]["kernel"].dtype


def project_aux(params, cfg: DraftConfig, aux):
    """fc (after fc_norm, if configured): aux [B,T,3*target_hidden] -> [B,T,hidden]."""
    if aux.shape[-1] != 3 * cfg.target_hidden_size:
        raise ValueError(f"aux last dim {aux.shape[-1]} != 3 * target_hidden_size ({3 * cfg.target_hidden_size})")
    model = Eagle3Draft(cfg, _param_dtype(params))
    return model.apply({"params": params}, aux.astype(_param_dtype(params)), method=Eagle3Draft.project_aux)


def draft_forward(params, cfg: DraftConfig, embeds, h, positions, cache: DraftCache, write_slots, mask):
    """One draft forward over T tokens.

    embeds [B,T,hidden]: target embeddings of the input tokens.
    h [B,T,hidden]: ``project_aux(aux)`` or a previous step's ``h_out``.
    positions [B,T] int32: RoPE positions (target-state position + depth).
    cache: DraftCache with S slots; this call's K/V are written at
      ``write_slots`` [B,T] (slots >= S are dropped, so padding can go to S).
    mask [B,T,S] bool: True where a query may attend (applied after the write,
      so a token may attend to itself).
    Returns (logits [B,T,draft_vocab] fp32, h_out [B,T,hidden], new_cache);
    ``h_out`` is the pre-norm residual stream, the next step's ``h``.
    """
    model = Eagle3Draft(cfg, _param_dtype(params))
    return model.apply({"params": params}, embeds, h, positions, cache, write_slots, mask)


def causal_mask(T: int, S: int | None = None):
    """[1,T,S] bool: query t may attend to slots 0..t."""
    S = T if S is None else S
    return (jnp.arange(S)[None, :] <= jnp.arange(T)[:, None])[None]


def draft_extend_logits(params, cfg: DraftConfig, embed_table, aux, ids):
    """Teacher-forced first-step draft logits for one sequence.

    embed_table [V, hidden] (the target's), aux [T, 3*target_hidden], ids [T].
    Returns [T-1, draft_vocab] fp32: row t uses the target state at position t
    and the embedding of ``ids[t+1]`` (so it predicts ``ids[t+2]``), with
    causal attention over rows 0..T-2.
    """
    if embed_table.shape[-1] != cfg.hidden_size:
        raise ValueError(
            f"embedding width {embed_table.shape[-1]} != draft hidden_size "
            f"{cfg.hidden_size} ({cfg.source}); the draft shares the target embedding"
        )
    T = ids.shape[0]
    n = T - 1
    h = project_aux(params, cfg, aux[None, :n])
    embeds = jnp.take(embed_table, ids[1:], axis=0)[None]
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    cache = init_draft_cache(cfg, 1, n, _param_dtype(params))
    logits, _, _ = draft_forward(params, cfg, embeds, h, pos, cache, pos, causal_mask(n))
    return logits[0]
