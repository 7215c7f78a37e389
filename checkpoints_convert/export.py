"""Write jaxspec parameters as Hugging Face checkpoints: the inverse of the converter.

Target (`export_target`): a DeepSeek-V3 / Kimi-K2.5 checkpoint that
`python -m checkpoints_convert` reads back to the same leaves, either

  * Kimi-K2.5 layout (``kimi_wrapper=True``): a ``KimiK25ForConditionalGeneration``
    wrapper config whose ``text_config`` is the DeepSeek-V3 text model, tensors
    under ``language_model.``, routed experts as compressed-tensors
    pack-quantized INT4 (group 32, symmetric, bf16 scales). Text only: no vision
    tower or projector is written, nor Kimi's remote-code files; or
  * plain ``DeepseekV3ForCausalLM`` (``kimi_wrapper=False``), which transformers
    loads natively (with ``int4_experts=False``, without compressed-tensors).

Tensors are written in shards of about ``shard_bytes`` (one ``model.safetensors``
when everything fits, else ``model-0000k-of-0000n.safetensors`` plus
``model.safetensors.index.json``), each shard materialised only while it is
written, so host memory holds one shard beyond the parameters themselves.

Draft (`export_draft`): an EAGLE-3 draft in SpecForge / SGLang layout
(``LlamaForCausalLMEagle3`` config, ``model.safetensors`` with d2t / t2d).

Both write into ``OUT.partial`` and publish it only when every file is on disk,
so an interrupted export never looks complete (see `_publish`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable

import jax
import ml_dtypes
import numpy as np
from tqdm import tqdm

from checkpoints_convert import target as target_rules
from checkpoints_convert.draft import params_to_tensors, write_specforge_checkpoint
from checkpoints_convert.quant_np import dequant_int4_np, quantize_int4_np
from checkpoints_convert.safetensors_io import write_safetensors
from jaxspec import checkpoint, quant
from jaxspec.config import DRAFT_ARCHITECTURE, Int4Format, ModelConfig
from jaxspec.dtypes import EXPORT_DTYPES
from jaxspec.dtypes import parse as parse_dtype
from jaxspec.model import abstract_params, per_layer
from jaxspec.tokenizer import KimiTokenizer

TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")
OPTIONAL_TOKENIZER_FILES = ("chat_template.jinja",)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
WRAPPER_PREFIX = target_rules.WRAPPER_PREFIX

# Only routed experts are INT4: every other Linear (attention, shared experts, dense MLPs,
# lm_head) is ignored, as in Kimi-K2.5's config; the router and the wrapped lm_head
# (`language_model.lm_head`) are listed explicitly for matchers that need full names.
KIMI_QUANT_IGNORE = [
    "lm_head",
    "re:.*lm_head$",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    "re:.*mlp\\.gate$",
    "re:vision_tower.*",
    "re:mm_projector.*",
]


def int4_quantization_config(group_size: int = quant.INT4_GROUP_SIZE) -> dict:
    """compressed-tensors ``pack-quantized`` config: INT4 symmetric group-wise weights, no activations."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": group_size,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "block_structure": None,
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": list(KIMI_QUANT_IGNORE),
        "kv_cache_scheme": None,
    }


def _dtype(name: str) -> np.dtype:
    return np.dtype(parse_dtype(name, EXPORT_DTYPES))


# ---------------------------------------------------------------------------
# config.json


def _rope_config(cfg: ModelConfig) -> dict:
    """rope_theta and (for YaRN) rope_scaling, in the keys DeepSeek-V3 / Kimi configs use."""
    out = {"rope_theta": cfg.rope_theta, "rope_scaling": None}
    if cfg.yarn:
        out["rope_scaling"] = {
            "type": "yarn",
            "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position,
            "beta_fast": cfg.rope_beta_fast,
            "beta_slow": cfg.rope_beta_slow,
            "mscale": cfg.rope_mscale,
            "mscale_all_dim": cfg.rope_mscale_all_dim,
        }
        if not cfg.rope_truncate:
            out["rope_scaling"]["truncate"] = False
    return out


def text_config(cfg: ModelConfig, dtype: str = "bfloat16", model_type: str = "deepseek_v3") -> dict:
    """The DeepSeek-V3 text-model config of `cfg` (every field `jaxspec.config.from_hf_dict` reads)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_nextn_predict_layers": 0,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.num_shared_experts,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": 1,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_interleave": cfg.rope_interleave,
        **_rope_config(cfg),
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }


def hf_config(cfg: ModelConfig, *, kimi_wrapper: bool, dtype: str = "bfloat16") -> dict:
    """config.json for `cfg`; INT4 experts (cfg.expert_format) add Kimi's quantization_config."""
    qcfg = int4_quantization_config(cfg.expert_format.group_size) if cfg.expert_format else None
    if not kimi_wrapper:
        text = text_config(cfg, dtype)
        if qcfg:
            text["quantization_config"] = qcfg
        return text
    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text_config(cfg, dtype, model_type="kimi_k2"),
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": dtype,
    }
    if qcfg:
        wrapper["quantization_config"] = qcfg  # top level, where Kimi-K2.5 keeps it
    return wrapper


def generation_config(cfg: ModelConfig) -> dict:
    return {k: v for k, v in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id)) if v is not None}


# ---------------------------------------------------------------------------
# Leaf -> HF tensor names: checkpoints_convert.target.RULES read backwards


def _how(rule: target_rules.Rule, path: tuple[str, ...]) -> tuple:
    """How leaf `path` becomes the HF tensor of its (unstacked) converter rule.

    ("copy",) as is; ("linear", k) a kernel whose first k axes are the input, stored as
    nn.Linear [out, in]; ("router", ...) the same but kept in float32 (routing runs in
    float32; Kimi ships these in float32 too).
    """
    how = ("linear", rule.in_dims) if rule.kind == "linear" else ("copy",)
    return ("router", *how[1:]) if path[-1].startswith("router") else how


@dataclasses.dataclass
class _Group:
    """Tensors produced together (one expert projection's packed words, scales and shape).

    A group is never split across shards; `make` materialises it only when its shard is written.
    """

    specs: list[tuple[str, tuple[int, ...], np.dtype]]
    make: Callable[[], dict[str, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(shape)) * dt.itemsize for _, shape, dt in self.specs)


def _check_rule(name: str, leaf: tuple[str, ...]) -> None:
    """Every exported name must map back onto its leaf through the converter's own rules."""
    hit = target_rules.match(name)
    if hit is None or hit[0] != "/".join(leaf):
        found = "no rule" if hit is None else hit[0]
        raise RuntimeError(
            f"exporter and checkpoints_convert.target.RULES disagree: {name} should map to "
            f"{'/'.join(leaf)}, the converter maps it to {found}"
        )


def _hf_value(value: np.ndarray, how: tuple, dtype: np.dtype) -> np.ndarray:
    if how[0] == "router":
        dtype = np.dtype(np.float32)  # routing runs in float32; Kimi ships these in float32 too
    if len(how) == 2:  # kernel [in..., out...] -> nn.Linear [out, in]
        value = value.reshape(int(np.prod(value.shape[: how[1]])), -1).T
    return np.ascontiguousarray(np.asarray(value).astype(dtype))


def _dense_group(name: str, value, how: tuple, dtype: np.dtype) -> _Group:
    shape = tuple(value.shape)
    if len(how) == 2:
        k = how[1]
        shape = (int(np.prod(shape[k:])), int(np.prod(shape[:k])))
    out_dtype = np.dtype(np.float32) if how[0] == "router" else dtype
    return _Group([(name, shape, out_dtype)], lambda: {name: _hf_value(np.asarray(value), how, dtype)})


class _ExpertSource:
    """One layer's routed experts for one projection: float [E, in, out] or an `Int4Weight` [E, out, in]."""

    def __init__(self, moe: dict, proj: str, shape_out_in: tuple[int, int]):
        self.weight = moe[proj]
        self.int4 = quant.is_int4(self.weight)
        if self.int4:
            self.weight.check(proj)
            if self.weight.layout != quant.ROWS:
                raise ValueError(
                    f"{proj}: the exporter reads the checkpoint's rows layout, found {self.weight.layout!r}"
                )
        self.proj = proj
        self.out_dim, self.in_dim = shape_out_in

    def float_weight(self, e: int) -> np.ndarray:
        """Expert e as nn.Linear [out, in] in the leaf's float dtype (dequantised if stored INT4)."""
        if not self.int4:
            return np.asarray(self.weight[e]).T
        return dequant_int4_np(
            np.asarray(self.weight.packed[e]),
            np.asarray(self.weight.scale[e]),
            in_features=self.in_dim,
            group_size=self.weight.group_size,
        )

    def int4_weight(self, e: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(packed int32 [out, in/8], scale bf16 [out, in/group]); INT4 leaves of that group size pass
        through unchanged."""
        if self.int4 and self.weight.group_size == group_size:
            packed = np.asarray(self.weight.packed[e]).astype(np.int32)
            return packed, np.asarray(self.weight.scale[e]).astype(ml_dtypes.bfloat16)
        return quantize_int4_np(self.float_weight(e), group_size, scale_dtype=ml_dtypes.bfloat16)


def _expert_groups(
    prefix: str, layer: int, src: _ExpertSource, out_fmt: Int4Format | None, dtype: np.dtype, num_experts: int
) -> list[_Group]:
    groups = []
    out_dim, in_dim = src.out_dim, src.in_dim
    for e in range(num_experts):
        base = prefix + target_rules.EXPERT.format(layer=layer, expert=e, proj=src.proj)
        hf = base[len(prefix) :]
        if out_fmt is None:
            _check_rule(hf + "weight", (f"layers_{layer}", "moe", src.proj))
            groups.append(
                _Group(
                    [(base + "weight", (out_dim, in_dim), dtype)],
                    lambda e=e, n=base + "weight": {n: src.float_weight(e).astype(dtype)},
                )
            )
            continue
        g = out_fmt.group_size
        for field in quant.Int4Weight.LEAVES:  # the leaves `checkpoint.flatten` names an Int4Weight's arrays
            _check_rule(hf + "weight_" + field, (f"layers_{layer}", "moe", f"{src.proj}_{field}"))

        def make(e=e, base=base, g=g):
            packed, scale = src.int4_weight(e, g)
            return {
                base + "weight_packed": packed,
                base + "weight_scale": scale,
                base + "weight_shape": np.array([out_dim, in_dim], np.int32),
            }

        groups.append(
            _Group(
                [
                    (base + "weight_packed", (out_dim, in_dim // 8), np.dtype(np.int32)),
                    (base + "weight_scale", (out_dim, in_dim // g), np.dtype(ml_dtypes.bfloat16)),
                    (base + "weight_shape", (2,), np.dtype(np.int32)),
                ],
                make,
            )
        )
    return groups


def _check_params(cfg: ModelConfig, params) -> dict:
    """Flattened params, checked leaf by leaf against the model's own tree for `cfg`."""
    want = checkpoint.flatten(per_layer(cfg, abstract_params(cfg)[0]))
    have = checkpoint.flatten(per_layer(cfg, params))
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        name = lambda ps: ", ".join("/".join(p) for p in ps[:4])
        raise ValueError(
            f"params do not match the config: missing leaves [{name(missing)}], "
            f"unexpected leaves [{name(extra)}] ({len(missing)} missing, {len(extra)} unexpected)"
        )
    for path, spec in want.items():
        if tuple(have[path].shape) != tuple(spec.shape):
            raise ValueError(
                f"params leaf {'/'.join(path)} has shape {tuple(have[path].shape)}, "
                f"expected {tuple(spec.shape)} for this config"
            )
    return have


def _target_groups(cfg: ModelConfig, params, out_fmt: Int4Format | None, dtype: np.dtype, prefix: str) -> list[_Group]:
    """Every HF tensor of the export, in checkpoint order (embedding, layers, final norm, lm_head)."""
    params = per_layer(cfg, params)  # the model's stacked layers, one HF layer each
    flat = _check_params(cfg, params)
    D, F = cfg.hidden_size, cfg.moe_intermediate_size

    dense, top = {}, []  # leaf path -> (HF name, how); (RULES index, path) of the leaves outside the layers
    for path in flat:
        hit = target_rules.leaf_rule("/".join(path))
        if hit is None:
            raise ValueError(f"params leaf {'/'.join(path)} has no Hugging Face name in the exporter")
        rule, fields = hit
        if rule.stacked:
            continue  # a routed expert projection: written expert by expert below
        dense[path] = (rule.hf.format(**fields), _how(rule, path))
        if "layer" not in fields:
            top.append((target_rules.RULES.index(rule), path))

    def group(path: tuple[str, ...]) -> _Group:
        hf, how = dense[path]
        _check_rule(hf, path)
        return _dense_group(prefix + hf, flat[path], how, dtype)

    top = [path for _, path in sorted(top)]  # in RULES order: embedding, final norm, lm_head
    groups = [group(top[0])]
    for layer in range(cfg.num_layers):
        groups += [group(p) for p in flat if p[0] == f"layers_{layer}" and p in dense]
        if cfg.is_moe_layer(layer):
            moe = params[f"layers_{layer}"]["moe"]
            for proj, out_in in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
                src = _ExpertSource(moe, proj, out_in)
                groups += _expert_groups(prefix, layer, src, out_fmt, dtype, cfg.num_experts)
    groups += [group(p) for p in top[1:]]  # final norm, lm_head (none with tied embeddings)
    return groups


# ---------------------------------------------------------------------------
# Files


def _shards(groups: list[_Group], shard_bytes: int) -> list[list[_Group]]:
    """Consecutive groups packed greedily into shards of at most shard_bytes (a bigger group stands alone)."""
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, found {shard_bytes}")
    shards, size = [[]], 0
    for g in groups:
        if shards[-1] and size + g.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += g.nbytes
    return shards


def _write_shards(directory: str, shards: list[list[_Group]], progress: bool) -> dict:
    """Write the shard files (and the index when there are several); returns the index dict."""
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    weight_map, total = {}, 0
    with tqdm(
        total=sum(g.nbytes for s in shards for g in s), unit="B", unit_scale=True, desc="export", disable=not progress
    ) as bar:
        for file, shard in zip(names, shards):
            tensors = {}
            for g in shard:
                made = g.make()
                for name, shape, dt in g.specs:
                    arr = made[name]
                    if tuple(arr.shape) != shape or arr.dtype != dt:  # the plan sized the shards
                        raise RuntimeError(f"{name}: produced {arr.dtype}{list(arr.shape)}, planned {dt}{list(shape)}")
                    tensors[name] = arr
                    weight_map[name] = file
                    total += arr.nbytes
                bar.update(g.nbytes)
            write_safetensors(os.path.join(directory, file), tensors, metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if n > 1:
        _write_json(os.path.join(directory, INDEX_FILE), index)
    return index


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _check_tokenizer(tokenizer_dir: str, cfg: ModelConfig) -> None:
    """Before anything is written: the tokenizer files exist and fit the model's vocabulary."""
    for name in TOKENIZER_FILES:
        if not os.path.isfile(os.path.join(tokenizer_dir, name)):
            raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir}: expected {name}, found no such file")
    vocab = KimiTokenizer.from_dir(tokenizer_dir).vocab_size
    if vocab > cfg.vocab_size:
        raise ValueError(
            f"tokenizer_dir {tokenizer_dir}: tokenizer has {vocab} ids, more than the model's "
            f"vocab_size {cfg.vocab_size}"
        )


def _copy_tokenizer(tokenizer_dir: str, directory: str) -> None:
    for name in TOKENIZER_FILES + OPTIONAL_TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(directory, name))


# Files an export owns; only these are replaced when publishing into an existing directory.
_EXPORT_FILE = re.compile(
    r"(config\.json|generation_config\.json|model\.safetensors(\.index\.json)?|"
    r"model-\d+-of-\d+\.safetensors|tiktoken\.model|tokenizer_config\.json|"
    r"chat_template\.jinja)$"
)


def _staging_dir(out_dir: str) -> str:
    """A fresh `out_dir.partial` (a stale one from an interrupted export is removed)."""
    partial = os.path.normpath(out_dir) + ".partial"
    if os.path.isdir(partial):
        shutil.rmtree(partial)
    elif os.path.exists(partial):
        os.remove(partial)
    os.makedirs(partial)
    return partial


def _publish(partial: str, out_dir: str) -> None:
    """Move a finished export from `partial` to `out_dir`.

    A new `out_dir` is one atomic rename. An existing one (e.g. a training run's
    directory holding train_state/) keeps its other contents: the previous
    export's files are deleted config.json first and the new ones moved in
    config.json last, so at no moment does a mix of old and new files look complete.
    """
    if not os.path.exists(out_dir):
        os.replace(partial, out_dir)
        return
    if not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    old = sorted(f for f in os.listdir(out_dir) if _EXPORT_FILE.match(f))
    for name in sorted(old, key=lambda f: f != "config.json"):
        os.remove(os.path.join(out_dir, name))
    new = sorted(os.listdir(partial), key=lambda f: f == "config.json")
    for name in new:
        os.replace(os.path.join(partial, name), os.path.join(out_dir, name))
    os.rmdir(partial)


# ---------------------------------------------------------------------------
# Public API


def export_target(
    cfg: ModelConfig,
    params,
    out_dir: str,
    *,
    int4_experts: bool = True,
    kimi_wrapper: bool = True,
    shard_bytes: int = 2**30,
    tokenizer_dir: str | None = None,
    dtype: str = "bfloat16",
    progress: bool = False,
) -> dict:
    """Write target `params` (the tree of `jaxspec.model`, for `cfg`) as a Hugging Face checkpoint.

    Routed experts are written INT4 pack-quantized (bf16 scales, group 32, or the
    group size of `cfg.expert_format` when the params are already INT4) if
    `int4_experts`, else as float `dtype` (dequantised if the params are INT4).
    Other weights are cast to `dtype`; the router weight [E, D] and
    e_score_correction_bias [E] stay float32. `tokenizer_dir` (holding
    tiktoken.model and tokenizer_config.json, e.g. a converted jaxspec
    checkpoint) is copied alongside. Returns {"config", "files", "total_size"}.
    """
    np_dtype = _dtype(dtype)
    out_fmt = None
    if int4_experts and cfg.num_experts:
        out_fmt = cfg.expert_format or Int4Format(group_size=quant.INT4_GROUP_SIZE)
    export_cfg = cfg.replace(expert_format=out_fmt)  # validates INT4 divisibility of the widths
    groups = _target_groups(cfg, params, out_fmt, np_dtype, WRAPPER_PREFIX if kimi_wrapper else "")
    if tokenizer_dir is not None:
        _check_tokenizer(tokenizer_dir, cfg)
    partial = _staging_dir(out_dir)
    index = _write_shards(partial, _shards(groups, shard_bytes), progress)
    config = hf_config(export_cfg, kimi_wrapper=kimi_wrapper, dtype=dtype)
    _write_json(os.path.join(partial, "generation_config.json"), generation_config(cfg))
    if tokenizer_dir is not None:
        _copy_tokenizer(tokenizer_dir, partial)
    _write_json(os.path.join(partial, "config.json"), config)
    _publish(partial, out_dir)
    return {
        "config": config,
        "files": sorted(set(index["weight_map"].values())),
        "total_size": index["metadata"]["total_size"],
    }


def draft_hf_config(dcfg, dtype: str = "bfloat16") -> dict:
    """SpecForge / SGLang ``LlamaForCausalLMEagle3`` config.json for a DraftConfig."""
    rope = None
    if dcfg.rope_type != "default":
        rope = {"rope_type": dcfg.rope_type, "factor": dcfg.rope_factor}
        if dcfg.rope_type == "llama3":
            rope.update(
                low_freq_factor=dcfg.rope_low_freq_factor,
                high_freq_factor=dcfg.rope_high_freq_factor,
                original_max_position_embeddings=dcfg.rope_original_max_position,
            )
    eagle = {"use_aux_hidden_state": True}
    if dcfg.aux_layer_ids is not None:
        eagle["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in dcfg.aux_layer_ids]
    out = {
        "architectures": [DRAFT_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": dcfg.hidden_size,
        "num_attention_heads": dcfg.num_heads,
        "num_key_value_heads": dcfg.num_kv_heads,
        "head_dim": dcfg.head_dim,
        "intermediate_size": dcfg.intermediate_size,
        "hidden_act": "silu",
        "num_hidden_layers": 1,
        "rms_norm_eps": dcfg.rms_norm_eps,
        "vocab_size": dcfg.vocab_size,
        "draft_vocab_size": dcfg.draft_vocab_size,
        "target_hidden_size": dcfg.target_hidden_size,
        "max_position_embeddings": dcfg.max_position_embeddings,
        "rope_theta": dcfg.rope_theta,
        "rope_scaling": rope,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "eagle_config": eagle,
    }
    # Non-default variants only: plain SpecForge configs stay free of keys its readers do not know.
    if dcfg.fc_norm:
        out["fc_norm"] = True
    if not dcfg.norm_output:
        out["norm_output"] = False
    return out


def export_draft(dcfg, dparams, d2t, t2d, out_dir: str, dtype: str = "bfloat16") -> dict:
    """Write an EAGLE-3 draft in SpecForge layout (config.json + model.safetensors).

    dparams: the `jaxspec.draft` tree (kernels [in, out]); d2t int [draft_vocab]
    (target id = draft id + d2t); t2d bool [vocab]. Float weights are cast to
    `dtype`; d2t is written int64 and t2d bool, as SpecForge does. Returns the config dict.
    """
    np_dtype = _dtype(dtype)
    d2t, t2d = np.asarray(d2t), np.asarray(t2d)
    if d2t.shape != (dcfg.draft_vocab_size,) or t2d.shape != (dcfg.vocab_size,):
        raise ValueError(
            f"d2t/t2d have shapes {d2t.shape}/{t2d.shape}, expected ({dcfg.draft_vocab_size},) "
            f"(draft_vocab_size) and ({dcfg.vocab_size},) (vocab_size)"
        )
    mapped = np.sort(np.arange(len(d2t)) + d2t)
    if not np.array_equal(np.flatnonzero(t2d), mapped):
        raise ValueError("d2t and t2d disagree: t2d must mark exactly the target ids draft_id + d2t[draft_id]")
    config = draft_hf_config(dcfg, dtype)
    tensors = params_to_tensors(dcfg, jax.tree.map(np.asarray, dparams), d2t, t2d, dtype=np_dtype)
    partial = _staging_dir(out_dir)
    write_specforge_checkpoint(partial, config, tensors)
    _publish(partial, out_dir)
    return config
