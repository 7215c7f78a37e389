"""Static configuration of the target model (Kimi-K2.5 / DeepSeek-V3 family) and of its
EAGLE-3 draft, and the one Hugging Face `config.json` parser for both.

`ModelConfig` and `DraftConfig` are frozen, hashable dataclasses: static arguments
of every compiled function. The target's is read from a plain `DeepseekV3ForCausalLM`
config or Kimi-K2.5's multimodal wrapper (whose text model lives under `text_config`
and whose INT4 expert format is described by `quantization_config`); the draft's from
a SpecForge / SGLang `LlamaForCausalLMEagle3` config. Both read RoPE through
`rope_settings`, one precedence rule for `rope_scaling` / `rope_parameters`. Any
setting the models do not implement is an error, never a silent fallback.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from jaxspec.cli import UsageError

TEXT_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
WRAPPER_ARCHITECTURES = ("KimiK25ForConditionalGeneration",)


class ConfigError(UsageError):
    """A config.json setting that jaxspec cannot honour."""


class UnsupportedConfig(ConfigError, NotImplementedError):
    """A config.json setting that jaxspec does not implement (yet)."""


# ---------------------------------------------------------------------------
# Shared by the target and the draft: reading config files, RoPE precedence


def read_json(file: str, error: type[Exception] = ConfigError) -> dict:
    """A JSON object from `file`; a missing or malformed file is an error naming it."""
    if not os.path.exists(file):
        raise FileNotFoundError(f"missing {file}")
    try:
        with open(file, "rb") as f:
            value = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{file}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise error(f"{file}: expected a JSON object, found {type(value).__name__}")
    return value


@dataclasses.dataclass(frozen=True)
class RopeSettings:
    """A config's RoPE settings, before the model-specific checks of their type."""

    field: str  # "rope_scaling" or "rope_parameters": the key they came from, for messages
    rope_type: str
    params: dict  # the chosen dict ({} when neither key is set)
    theta: float


def rope_settings(cfg: dict, source: str) -> RopeSettings:
    """The RoPE settings of an HF config (or its `text_config`), by the rule transformers applies.

    transformers 5 (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`) reads
    `rope_scaling or rope_parameters`: a non-empty `rope_scaling` (older configs, Kimi-K2.5's,
    SpecForge's) wins and `rope_parameters` (what transformers 5 writes) is then ignored
    entirely. Inside the chosen dict its own `rope_theta` wins over a top-level `rope_theta`,
    which defaults to 10000; the type is `rope_type`, else the legacy `type`, else "default"
    (here only for a dict that holds nothing else, so that no setting is silently dropped).
    """
    scaling = cfg.get("rope_scaling")
    field = "rope_scaling" if scaling else "rope_parameters"
    params = scaling if scaling else cfg.get("rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: field '{field}' must be an object or null, found {params!r}")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{source}: field 'rope_theta' must be a positive number, found {theta!r}")
    kind = params.get("rope_type", params.get("type"))
    if kind is None:
        if set(params) - {"rope_theta"}:
            raise ConfigError(f"{source}: field '{field}.rope_type' is missing")
        kind = "default"
    return RopeSettings(field, kind, dict(params), float(theta))


# ---------------------------------------------------------------------------
# The target


@dataclasses.dataclass(frozen=True)
class Int4Format:
    """compressed-tensors pack-quantized INT4 for routed experts."""

    group_size: int = 32
    symmetric: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    rope_interleave: bool = True
    # YaRN; rope_factor == 1 means plain RoPE.
    rope_factor: float = 1.0
    rope_original_max_position: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    rope_truncate: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    expert_format: Int4Format | None = None  # None: routed experts are bf16/fp32
    # Benchmarks only (`scripts/bench_spec.py --share N`; never read from a checkpoint): the config
    # is one device's share of an N-way mesh. The router still spans all `num_experts` experts; the
    # program holds `num_experts // share` of them (the device that receives the most assignments
    # in each call, which sets the pace on a real mesh) and a 1/share slice of the shared expert.
    # Heads, vocab and the dense MLP are given already divided.
    share: int = 1

    # ----- derived -----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: compressed KV plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and self.num_experts > 0

    @property
    def yarn(self) -> bool:
        return self.rope_factor > 1.0

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 as HF does."""
        scale = self.qk_head_dim**-0.5
        if self.yarn and self.rope_mscale_all_dim:
            m = yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def local_experts(self) -> int:
        """Routed experts this program holds: all of them, or one device's share."""
        return self.num_experts // self.share

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    def __post_init__(self):
        if self.num_experts and self.num_experts % self.n_group:
            raise ConfigError(f"n_routed_experts={self.num_experts} is not divisible by n_group={self.n_group}")
        if self.share < 1 or (self.num_experts % self.share) or (self.moe_intermediate_size % self.share):
            raise ConfigError(
                f"share={self.share} must be >= 1 and divide n_routed_experts={self.num_experts} and "
                f"moe_intermediate_size={self.moe_intermediate_size}"
            )
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.num_experts and self.num_experts // self.n_group < 2:
            raise ConfigError("each expert group needs at least 2 experts (group score = sum of top-2)")
        if self.expert_format is not None:
            g = self.expert_format.group_size
            for name, dim in (("hidden_size", self.hidden_size), ("moe_intermediate_size", self.moe_intermediate_size)):
                if dim % g or dim % 8:
                    raise ConfigError(f"{name}={dim} must be a multiple of the INT4 group size {g} and of 8")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


# ---------------------------------------------------------------------------
# Reading Hugging Face configs


def _require(cfg: dict, key: str, source: str):
    if key not in cfg:
        raise ConfigError(f"{source}: missing required field '{key}'")
    return cfg[key]


def _check_equal(cfg: dict, key: str, allowed, source: str, default=None):
    value = cfg.get(key, default)
    if value is None:
        return
    if isinstance(allowed, tuple):
        ok = value in allowed
    else:
        ok = value == allowed
    if not ok:
        raise ConfigError(f"{source}: {key}={value!r} is not supported (expected {allowed!r})")


def _rope_fields(text: dict, source: str) -> dict[str, Any]:
    rope = rope_settings(text, source)
    out: dict[str, Any] = {"rope_theta": rope.theta}
    if rope.rope_type == "default":
        return out
    where = f"{source} {rope.field}"
    if rope.rope_type != "yarn":
        raise ConfigError(f"{where}: rope type {rope.rope_type!r} is not supported (expected 'default' or 'yarn')")
    params = rope.params
    if params.get("attention_factor") is not None:
        raise ConfigError(f"{where}: rope attention_factor is not supported (derived from mscale)")
    original = int(_require(params, "original_max_position_embeddings", where))
    factor = params.get("factor")
    if factor is None:
        factor = int(_require(text, "max_position_embeddings", source)) / original
    out.update(
        rope_factor=float(factor),
        rope_original_max_position=original,
        rope_beta_fast=float(params.get("beta_fast") or 32),
        rope_beta_slow=float(params.get("beta_slow") or 1),
        rope_mscale=float(params.get("mscale") or 0),
        rope_mscale_all_dim=float(params.get("mscale_all_dim") or 0),
        rope_truncate=bool(params.get("truncate", True)),
    )
    return out


def _int4_format(qcfg: dict | None, source: str) -> Int4Format | None:
    """Validate a compressed-tensors quantization_config; only routed experts may be INT4."""
    if not qcfg:
        return None
    method = qcfg.get("quant_method")
    if method == "fp8":
        # DeepSeek-style FP8 block weights are dequantised to bf16 by the converter.
        block = qcfg.get("weight_block_size", [128, 128])
        if list(block) != [128, 128]:
            raise ConfigError(f"{source}: fp8 weight_block_size={block} is not supported (expected [128, 128])")
        return None
    if method != "compressed-tensors":
        raise ConfigError(
            f"{source}: quant_method={method!r} is not supported "
            "(expected 'compressed-tensors' pack-quantized INT4 or DeepSeek 'fp8')"
        )
    fmt = qcfg.get("format")
    if fmt != "pack-quantized":
        raise ConfigError(f"{source}: quantization format={fmt!r} is not supported (expected 'pack-quantized')")
    groups = qcfg.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"{source}: expected exactly one quantization config group, found {len(groups)}")
    (group,) = groups.values()
    w = group.get("weights") or {}
    expected = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    for key, want in expected.items():
        if w.get(key) != want:
            raise ConfigError(f"{source}: quantization weights.{key}={w.get(key)!r}, expected {want!r}")
    if group.get("input_activations"):
        raise ConfigError(f"{source}: activation quantization is not supported")
    return Int4Format(group_size=int(_require(w, "group_size", source + " quantization weights")))


def from_hf_dict(cfg: dict, source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a parsed HF config.json (plain or Kimi-K2.5 wrapper)."""
    arch = (cfg.get("architectures") or [None])[0]
    qcfg = cfg.get("quantization_config")
    if arch in WRAPPER_ARCHITECTURES or "text_config" in cfg:
        text = dict(_require(cfg, "text_config", source))
        qcfg = qcfg or text.get("quantization_config")
        src = f"{source} text_config"
    elif arch in TEXT_ARCHITECTURES or cfg.get("model_type") in ("deepseek_v3", "kimi_k2"):
        text, src = cfg, source
    else:
        raise ConfigError(
            f"{source}: unknown architecture {arch!r} (expected one of {TEXT_ARCHITECTURES + WRAPPER_ARCHITECTURES})"
        )

    _check_equal(text, "hidden_act", "silu", src)
    _check_equal(text, "topk_method", ("noaux_tc",), src)
    _check_equal(text, "scoring_func", "sigmoid", src)
    _check_equal(text, "attention_bias", False, src)
    _check_equal(text, "mlp_bias", False, src)
    heads = int(_require(text, "num_attention_heads", src))
    kv_heads = text.get("num_key_value_heads", heads)
    if kv_heads != heads:
        raise ConfigError(f"{src}: num_key_value_heads={kv_heads} must equal num_attention_heads={heads} for MLA")
    freq = text.get("moe_layer_freq", 1)
    if freq != 1:
        raise ConfigError(f"{src}: moe_layer_freq={freq} is not supported (expected 1)")

    n_experts = int(text.get("n_routed_experts") or 0)
    eos = text.get("eos_token_id", cfg.get("eos_token_id"))
    if isinstance(eos, list):
        eos = eos[0]
    return ModelConfig(
        vocab_size=int(_require(text, "vocab_size", src)),
        hidden_size=int(_require(text, "hidden_size", src)),
        num_layers=int(_require(text, "num_hidden_layers", src)),
        num_heads=heads,
        q_lora_rank=text.get("q_lora_rank"),
        kv_lora_rank=int(_require(text, "kv_lora_rank", src)),
        qk_nope_head_dim=int(_require(text, "qk_nope_head_dim", src)),
        qk_rope_head_dim=int(_require(text, "qk_rope_head_dim", src)),
        v_head_dim=int(_require(text, "v_head_dim", src)),
        intermediate_size=int(_require(text, "intermediate_size", src)),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
        num_experts=n_experts,
        num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
        num_shared_experts=int(text.get("n_shared_experts") or 0),
        first_k_dense_replace=int(text.get("first_k_dense_replace", 0)),
        n_group=int(text.get("n_group") or 1),
        topk_group=int(text.get("topk_group") or 1),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_interleave=bool(text.get("rope_interleave", True)),
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        bos_token_id=text.get("bos_token_id", cfg.get("bos_token_id")),
        eos_token_id=eos,
        expert_format=_int4_format(qcfg, source),
        **_rope_fields(text, src),
    )


def load_hf_config(path: str) -> ModelConfig:
    """Read `path/config.json` (or `path` itself if it is a file)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"no config.json at {file}")
    return from_hf_dict(read_json(file), source=file)


def to_dict(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    if d.get("expert_format") is not None:
        d["expert_format"] = Int4Format(**d["expert_format"])
    return ModelConfig(**d)


# ---------------------------------------------------------------------------
# The EAGLE-3 draft (SpecForge / SGLang layout; the model is jaxspec.draft)

DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"

# RoPE variants whose frequencies the draft reproduces exactly; anything else
# (dynamic NTK, yarn, mrope, ...) is rejected rather than approximated.
DRAFT_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Static shape/numerics of an EAGLE-3 draft (hashable: usable as a jit static arg)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int  # target vocabulary (length of t2d)
    draft_vocab_size: int  # rows of lm_head / length of d2t
    target_hidden_size: int  # width of each captured target hidden state
    rope_theta: float = 10000.0
    rope_type: str = "default"  # one of DRAFT_ROPE_TYPES
    rope_factor: float = 1.0
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_original_max_position: int | None = None
    max_position_embeddings: int = 2048
    fc_norm: bool = False  # RMSNorm each aux chunk before fc
    norm_output: bool = True  # apply `norm` before lm_head
    aux_layer_ids: tuple[int, int, int] | None = None  # eagle_config ids, if given
    source: str = "config.json"

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> DraftConfig:
        """Parse a SpecForge/SGLang draft ``config.json`` dict.

        Raises ValueError naming the field and ``source`` for missing or
        unsupported settings (UnsupportedConfig, also a NotImplementedError, for unsupported RoPE types).
        """
        return _parse_draft_config(cfg, source)

    def to_dict(self) -> dict:
        """JSON-ready fields (for storing next to converted weights)."""
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = None if self.aux_layer_ids is None else list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DraftConfig:
        """Inverse of ``to_dict``; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"DraftConfig.from_dict: unknown fields {unknown}")
        d = dict(d)
        if d.get("aux_layer_ids") is not None:
            d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
        return cls(**d)


def _field_error(source: str, field: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: field '{field}' {msg}")


def _draft_require(cfg: dict, source: str, field: str, kind=int):
    if field not in cfg or cfg[field] is None:
        raise _field_error(source, field, "is required for an EAGLE-3 draft but is missing")
    value = cfg[field]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise _field_error(source, field, f"must be a positive integer, found {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise _field_error(source, field, f"must be a positive number, found {value!r}")
    return kind(value)


def _optional_int(cfg: dict, source: str, field: str, default: int) -> int:
    if cfg.get(field) is None:
        return default
    return _draft_require(cfg, source, field, int)


def _reject_truthy(cfg: dict, source: str, field: str, why: str) -> None:
    if cfg.get(field):
        raise _field_error(source, field, f"= {cfg[field]!r} is not supported: {why}")


def _parse_draft_config(cfg: dict, source: str) -> DraftConfig:
    archs = cfg.get("architectures")
    if not archs or DRAFT_ARCHITECTURE not in archs:
        raise _field_error(source, "architectures", f"must contain '{DRAFT_ARCHITECTURE}', found {archs!r}")

    hidden = _draft_require(cfg, source, "hidden_size")
    heads = _draft_require(cfg, source, "num_attention_heads")
    kv_heads = _optional_int(cfg, source, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise _field_error(source, "num_key_value_heads", f"= {kv_heads} must divide num_attention_heads = {heads}")
    if cfg.get("head_dim") is None and hidden % heads:
        raise _field_error(
            source, "head_dim", f"is missing and hidden_size {hidden} is not divisible by num_attention_heads {heads}"
        )
    head_dim = _optional_int(cfg, source, "head_dim", hidden // heads)
    if head_dim % 2:
        raise _field_error(source, "head_dim", f"must be even for RoPE, found {head_dim}")

    draft_vocab = cfg.get("draft_vocab_size")
    if draft_vocab is None:
        # SGLang would fall back to the target lm_head; SpecForge drafts always set it.
        raise _field_error(
            source,
            "draft_vocab_size",
            "is missing; drafts without a reduced vocabulary (lm_head taken from the target) are not supported",
        )
    draft_vocab = _draft_require(cfg, source, "draft_vocab_size")
    vocab = _draft_require(cfg, source, "vocab_size")
    if draft_vocab > vocab:
        raise _field_error(source, "draft_vocab_size", f"= {draft_vocab} exceeds vocab_size = {vocab}")

    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _field_error(source, "hidden_act", f"must be 'silu', found {act!r}")
    n_layers = cfg.get("num_hidden_layers", 1)
    if n_layers != 1:
        raise _field_error(
            source, "num_hidden_layers", f"must be 1 (one midlayer, as SpecForge trains), found {n_layers!r}"
        )
    _reject_truthy(cfg, source, "tie_word_embeddings", "lm_head must be a separate draft-vocab matrix")
    _reject_truthy(cfg, source, "bias", "fc has no bias in SpecForge drafts")
    _reject_truthy(cfg, source, "attention_bias", "draft projections are bias-free")
    _reject_truthy(cfg, source, "mlp_bias", "draft projections are bias-free")

    eagle = cfg.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise _field_error(source, "eagle_config", f"must be an object, found {eagle!r}")
    if eagle.get("use_aux_hidden_state", True) is False:
        raise _field_error(
            source,
            "eagle_config.use_aux_hidden_state",
            "= false is not supported: the draft needs three aux hidden states",
        )
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        if (
            not isinstance(ids, (list, tuple))
            or len(ids) != 3
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)
        ):
            raise _field_error(
                source,
                "eagle_config.eagle_aux_hidden_state_layer_ids",
                f"must be three non-negative integers, found {ids!r}",
            )
        ids = tuple(int(i) for i in ids)

    return DraftConfig(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_draft_require(cfg, source, "intermediate_size"),
        rms_norm_eps=_draft_require(cfg, source, "rms_norm_eps", float),
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=_optional_int(cfg, source, "target_hidden_size", hidden),
        max_position_embeddings=_optional_int(cfg, source, "max_position_embeddings", 2048),
        fc_norm=bool(cfg.get("fc_norm", False)),
        norm_output=bool(cfg.get("norm_output", True)),
        aux_layer_ids=ids,
        source=source,
        **_draft_rope(cfg, source),
    )


def _draft_rope(cfg: dict, source: str) -> dict:
    """The draft's RoPE fields (`rope_settings` decides where they come from)."""
    rope = rope_settings(cfg, source)
    out = {"rope_theta": rope.theta, "rope_type": rope.rope_type}
    if rope.rope_type not in DRAFT_ROPE_TYPES:
        raise UnsupportedConfig(
            f"{source}: field '{rope.field}.rope_type' = {rope.rope_type!r} is not supported "
            f"(supported: {', '.join(DRAFT_ROPE_TYPES)})"
        )
    if rope.rope_type == "default":
        return out

    def need(key):
        value = rope.params.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise _field_error(
                source,
                f"{rope.field}.{key}",
                f"must be a positive number for rope_type {rope.rope_type!r}, found {value!r}",
            )
        return value

    out["rope_factor"] = float(need("factor"))
    if rope.rope_type == "llama3":
        out["rope_low_freq_factor"] = float(need("low_freq_factor"))
        out["rope_high_freq_factor"] = float(need("high_freq_factor"))
        out["rope_original_max_position"] = int(need("original_max_position_embeddings"))
    return out


# ---------------------------------------------------------------------------
# Presets

KIMI_K25 = ModelConfig(
    vocab_size=163840,
    hidden_size=7168,
    num_layers=61,
    num_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_experts=384,
    num_experts_per_tok=8,
    num_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.827,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    rope_interleave=True,
    rope_factor=64.0,
    rope_original_max_position=4096,
    rope_beta_fast=32.0,
    rope_beta_slow=1.0,
    rope_mscale=1.0,
    rope_mscale_all_dim=1.0,
    max_position_embeddings=262144,
    bos_token_id=163584,
    eos_token_id=163585,
    expert_format=Int4Format(group_size=32),
)

PRESETS = {"kimi-k2.5": KIMI_K25}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r} (expected one of {sorted(PRESETS)})")
    return PRESETS[name].replace(**overrides)
