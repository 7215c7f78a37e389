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
from jaxspec.layers import Dense, RMSNorm, SwiGLU, attention, causal_mask, llama_inv_freq, rope, write_slots

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
    return llama_inv_freq(
        cfg.head_dim,
        cfg.rope_theta,
        cfg.rope_type,
        cfg.rope_factor,
        cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor,
        cfg.rope_original_max_position,
    )


def _linear(features_in: int, features_out: int, dtype) -> Dense:
    """A bias-free linear layer, kernel [in, out], N(0, 0.02) at init."""
    return Dense((features_in, features_out), None, dtype, 0.02)


@flax.struct.dataclass
class DraftCache:
    """Draft KV cache: k, v [B, S, kv_heads, head_dim] (post-RoPE keys)."""

    k: jax.Array
    v: jax.Array


def init_draft_cache(cfg: DraftConfig, batch: int, max_len: int, dtype=jnp.float32) -> DraftCache:
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return DraftCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


class Attention(nn.Module):
    cfg: DraftConfig
    param_dtype: Any = jnp.float32

    def setup(self):
        c, dt = self.cfg, self.param_dtype
        self.q_proj = _linear(2 * c.hidden_size, c.num_heads * c.head_dim, dt)
        self.k_proj = _linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, dt)
        self.v_proj = _linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, dt)
        self.o_proj = _linear(c.num_heads * c.head_dim, c.hidden_size, dt)

    def __call__(self, x, positions, cache: DraftCache, write_slots_BT, mask):
        """x [B,T,2H]; attends over the updated cache [B,S] under mask [B,T,S]."""
        c = self.cfg
        B, T, _ = x.shape
        inv_freq = rope_inv_freq(c)
        q = rope(self.q_proj(x).reshape(B, T, c.num_heads, c.head_dim), positions, inv_freq)
        k = rope(self.k_proj(x).reshape(B, T, c.num_kv_heads, c.head_dim), positions, inv_freq)
        v = self.v_proj(x).reshape(B, T, c.num_kv_heads, c.head_dim)
        cache = DraftCache(k=write_slots(cache.k, k, write_slots_BT), v=write_slots(cache.v, v, write_slots_BT))

        groups = c.num_heads // c.num_kv_heads  # GQA: query head n uses kv head n // groups
        qg = q.reshape(B, T, c.num_kv_heads, groups, c.head_dim)
        out = attention(qg, cache.k, cache.v, mask, 1.0 / math.sqrt(c.head_dim))
        return self.o_proj(out.reshape(B, T, c.num_heads * c.head_dim)), cache


class Midlayer(nn.Module):
    cfg: DraftConfig
    param_dtype: Any = jnp.float32

    def setup(self):
        c, dt = self.cfg, self.param_dtype
        self.input_layernorm = RMSNorm(c.rms_norm_eps, dtype=dt)
        self.hidden_norm = RMSNorm(c.rms_norm_eps, dtype=dt)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps, dtype=dt)
        self.self_attn = Attention(c, dt)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, dt, ("gate_proj", "up_proj", "down_proj"), scale=0.02)

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
        c, dt = self.cfg, self.param_dtype
        self.fc = _linear(3 * c.target_hidden_size, c.hidden_size, dt)
        if c.fc_norm:
            self.fc_norm = [RMSNorm(c.rms_norm_eps, dtype=dt) for _ in range(3)]
        self.midlayer = Midlayer(c, dt)
        self.norm = RMSNorm(c.rms_norm_eps, dtype=dt)
        self.lm_head = _linear(c.hidden_size, c.draft_vocab_size, dt)

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
        logits = self.lm_head(self.norm(h_out) if self.cfg.norm_output else h_out, out_dtype=jnp.float32)
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
    logits, _, _ = draft_forward(params, cfg, embeds, h, pos, cache, pos, causal_mask(pos, n))
    return logits[0]
