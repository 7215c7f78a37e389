"""Static configuration of the target model (Kimi-K2.5 / DeepSeek-V3 family).

`ModelConfig` is a frozen, hashable dataclass: it is a static argument of every
compiled function. It is read from a Hugging Face `config.json`, either a plain
`DeepseekV3ForCausalLM` config or Kimi-K2.5's multimodal wrapper (whose text
model lives under `text_config` and whose INT4 expert format is described by
`quantization_config`). Any setting the model does not implement is an error,
never a silent fallback.
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

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    def __post_init__(self):
        if self.num_experts and self.num_experts % self.n_group:
            raise ConfigError(f"n_routed_experts={self.num_experts} is not divisible by n_group={self.n_group}")
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
    # Newer transformers versions write `rope_parameters`; older configs (and Kimi's) `rope_scaling`.
    field = "rope_scaling" if text.get("rope_scaling") else "rope_parameters"
    rope = text.get(field) or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{source}: {field}={rope!r} is not supported (expected an object)")
    theta = text.get("rope_theta", rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind in (None, "default"):
        return out
    where = f"{source} {field}"
    if kind != "yarn":
        raise ConfigError(f"{where}: rope type {kind!r} is not supported (expected 'default' or 'yarn')")
    if rope.get("attention_factor") is not None:
        raise ConfigError(f"{where}: rope attention_factor is not supported (derived from mscale)")
    original = int(_require(rope, "original_max_position_embeddings", where))
    factor = rope.get("factor")
    if factor is None:
        factor = int(_require(text, "max_position_embeddings", source)) / original
    out.update(
        rope_factor=float(factor),
        rope_original_max_position=original,
        rope_beta_fast=float(rope.get("beta_fast") or 32),
        rope_beta_slow=float(rope.get("beta_slow") or 1),
        rope_mscale=float(rope.get("mscale") or 0),
        rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
        rope_truncate=bool(rope.get("truncate", True)),
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
    try:
        with open(file, "rb") as f:
            cfg = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{file}: expected a JSON object, found {type(cfg).__name__}")
    return from_hf_dict(cfg, source=file)


def to_dict(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    if d.get("expert_format") is not None:
        d["expert_format"] = Int4Format(**d["expert_format"])
    return ModelConfig(**d)


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
