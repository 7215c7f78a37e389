"""Hugging Face DeepSeek-V3 / Kimi-K2.5 target -> jaxspec parameter leaves.

The name mapping is data (`RULES`): a regex over the HF tensor name, the jaxspec
leaf path it feeds, and how it is transformed. Every leaf's expected shape and
dtype comes from the model's own abstract parameter tree, so the converter and
the model cannot disagree silently.

Transforms:
  copy    same values, reshaped to the leaf shape (norms, embedding, router bias)
  linear  HF nn.Linear weight [out, in] -> kernel [in, ...out split] (transpose + reshape)
  router  like linear but kept in float32 (routing runs in fp32)
  expert  one expert's linear weight, stacked into leaf[expert]
  packed  one expert's INT4 weight_packed [out, in/8] int32, stacked as is
  scale   one expert's INT4 weight_scale [out, in/group], stacked as is
"""

from __future__ import annotations

import re
from typing import Callable

import ml_dtypes
import numpy as np

from checkpoints_convert.safetensors_io import CheckpointError, TensorRef
from jaxspec import quant
from jaxspec.config import ModelConfig

L = r"model\.layers\.(?P<layer>\d+)\."
E = r"mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\."

RULES: list[tuple[str, str, str]] = [
    (r"model\.embed_tokens\.weight", "embed/embedding", "copy"),
    (r"model\.norm\.weight", "final_norm/scale", "copy"),
    (r"lm_head\.weight", "lm_head/kernel", "linear"),
    (L + r"input_layernorm\.weight", "layers_{layer}/attn_norm/scale", "copy"),
    (L + r"post_attention_layernorm\.weight", "layers_{layer}/mlp_norm/scale", "copy"),
    (L + r"self_attn\.q_proj\.weight", "layers_{layer}/attn/q_proj/kernel", "linear"),
    (L + r"self_attn\.q_a_proj\.weight", "layers_{layer}/attn/q_a_proj/kernel", "linear"),
    (L + r"self_attn\.q_a_layernorm\.weight", "layers_{layer}/attn/q_a_norm/scale", "copy"),
    (L + r"self_attn\.q_b_proj\.weight", "layers_{layer}/attn/q_b_proj/kernel", "linear"),
    (L + r"self_attn\.kv_a_proj_with_mqa\.weight", "layers_{layer}/attn/kv_a_proj/kernel", "linear"),
    (L + r"self_attn\.kv_a_layernorm\.weight", "layers_{layer}/attn/kv_a_norm/scale", "copy"),
    (L + r"self_attn\.kv_b_proj\.weight", "layers_{layer}/attn/kv_b_proj", "linear"),
    (L + r"self_attn\.o_proj\.weight", "layers_{layer}/attn/o_proj/kernel", "linear"),
    (L + r"mlp\.(?P<proj>gate|up|down)_proj\.weight", "layers_{layer}/mlp/{proj}/kernel", "linear"),
    (L + r"mlp\.gate\.weight", "layers_{layer}/moe/router", "router"),
    (L + r"mlp\.gate\.e_score_correction_bias", "layers_{layer}/moe/router_bias", "router"),
    (L + r"mlp\.shared_experts\.(?P<proj>gate|up|down)_proj\.weight", "layers_{layer}/moe/shared/{proj}/kernel",
     "linear"),
    (L + E + r"weight", "layers_{layer}/moe/{proj}", "expert"),
    (L + E + r"weight_packed", "layers_{layer}/moe/{proj}_packed", "packed"),
    (L + E + r"weight_scale", "layers_{layer}/moe/{proj}_scale", "scale"),
    (L + E + r"weight_shape", "layers_{layer}/moe/{proj}_packed", "shape"),
]
_COMPILED = [(re.compile(p + "$"), leaf, kind) for p, leaf, kind in RULES]

# Tensors a checkpoint may carry that inference does not use.
_SKIP = re.compile(r"(.*rotary_emb\.inv_freq$)")
# Kimi-K2.5 wraps the text model; the vision tower and projector are skipped.
WRAPPER_PREFIX = "language_model."


def match(name: str):
    for regex, leaf, kind in _COMPILED:
        m = regex.match(name)
        if m:
            groups = m.groupdict()
            return leaf.format(**groups), kind, groups
    return None


def _float(array: np.ndarray, name: str, file: str) -> np.ndarray:
    if array.dtype.kind not in "f" and array.dtype != ml_dtypes.bfloat16:
        raise CheckpointError(f"{file}: tensor {name} has dtype {array.dtype}, expected a float type")
    return np.asarray(array, dtype=np.float32)


class TargetConverter:
    """Consumes HF tensors one by one and emits finished jaxspec leaves.

    Expert tensors are buffered per (layer, projection) until all experts arrived,
    then stacked and emitted, so at most a few stacked tensors are alive at once.
    """

    def __init__(self, cfg: ModelConfig, shapes: dict, emit: Callable[[tuple[str, ...], np.ndarray], None],
                 wrapper: bool):
        from jaxspec.checkpoint import flatten

        self.cfg = cfg
        self.expected = flatten(shapes)
        self.emit = emit
        self.wrapper = wrapper
        self.done: set[tuple[str, ...]] = set()
        self.pending: dict[tuple[str, ...], dict[int, np.ndarray]] = {}
        self.fp8_pending: dict[str, TensorRef] = {}
        self.fp8_scales: dict[str, TensorRef] = {}
        self.shape_checked: set[str] = set()

    # -- name handling -------------------------------------------------
    def hf_name(self, ref: TensorRef) -> str | None:
        name = ref.name
        if self.wrapper:
            if not name.startswith(WRAPPER_PREFIX):
                return None  # vision tower, projector
            name = name[len(WRAPPER_PREFIX):]
        if _SKIP.match(name):
            return None
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= self.cfg.num_layers:
            return None  # multi-token-prediction layers beyond the decoder
        return name

    def feed(self, ref: TensorRef) -> None:
        name = self.hf_name(ref)
        if name is None:
            return
        if name.endswith(".weight_scale_inv"):
            self._fp8_scale(name, ref)
            return
        if ref.dtype.startswith("F8"):
            self.fp8_pending[name[: -len(".weight")]] = ref
            self._maybe_fp8(name[: -len(".weight")])
            return
        self._consume(name, ref, ref.load())

    def _fp8_scale(self, name: str, ref: TensorRef):
        base = name[: -len(".weight_scale_inv")]
        self.fp8_scales[base] = ref
        self._maybe_fp8(base)

    def _maybe_fp8(self, base: str):
        if base in self.fp8_pending and base in self.fp8_scales:
            w_ref, s_ref = self.fp8_pending.pop(base), self.fp8_scales.pop(base)
            w = quant.dequant_fp8_block_np(w_ref.load(), np.asarray(s_ref.load(), np.float32))
            self._consume(base + ".weight", w_ref, w)

    # -- conversion ------------------------------------------------------
    def _consume(self, name: str, ref: TensorRef, array: np.ndarray) -> None:
        hit = match(name)
        if hit is None:
            raise CheckpointError(f"{ref.file}: unexpected tensor {ref.name} (shape {list(ref.shape)}); "
                                  "it maps to no parameter of this model config")
        leaf_str, kind, groups = hit
        path = tuple(leaf_str.split("/"))
        if path not in self.expected:
            raise CheckpointError(self._unexpected(ref, path, kind))
        spec = self.expected[path]
        if kind == "shape":
            self._check_weight_shape(ref, array, groups)
            return
        if kind in ("expert", "packed", "scale"):
            self._add_expert(ref, path, spec, kind, int(groups["expert"]), array)
            return
        value = _float(array, ref.name, ref.file)
        if kind in ("linear", "router") and value.ndim == 2:
            value = value.T
        if value.size != int(np.prod(spec.shape)):
            raise CheckpointError(f"{ref.file}: tensor {ref.name} has shape {list(ref.shape)}; "
                                  f"expected {self._hf_shape(kind, spec.shape)} for {'/'.join(path)}")
        self._emit(path, value.reshape(spec.shape), spec)

    def _unexpected(self, ref, path, kind) -> str:
        if kind in ("packed", "scale", "shape"):
            return (f"{ref.file}: tensor {ref.name} is INT4 pack-quantized but config.json has no matching "
                    "quantization_config (compressed-tensors pack-quantized); they must agree")
        if kind == "expert" and self.cfg.expert_format is not None:
            return (f"{ref.file}: tensor {ref.name} is an unquantized expert weight but quantization_config "
                    "says routed experts are INT4 pack-quantized (expected weight_packed/weight_scale)")
        return f"{ref.file}: tensor {ref.name} maps to {'/'.join(path)}, which this model config does not have"

    @staticmethod
    def _hf_shape(kind, shape):
        if kind in ("linear", "router") and len(shape) >= 2:
            # kernels are [in, out...] or [in..., out]; HF stores [out, in]
            return "[out, in] matching leaf shape " + str(list(shape))
        return list(shape)

    def _check_weight_shape(self, ref, array, groups):
        proj = groups["proj"]
        D, F = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        want = [D, F] if proj == "down" else [F, D]
        got = [int(x) for x in np.asarray(array).reshape(-1)]
        if got != want:
            raise CheckpointError(f"{ref.file}: {ref.name} = {got}, expected {want} ([out, in])")

    def _add_expert(self, ref, path, spec, kind, expert, array):
        per_expert = tuple(spec.shape[1:])
        if kind == "expert":
            value = _float(array, ref.name, ref.file).T
        elif kind == "packed":
            if array.dtype != np.int32:
                raise CheckpointError(f"{ref.file}: {ref.name} has dtype {array.dtype}, expected int32")
            value = np.array(array)
        else:
            value = _float(array, ref.name, ref.file)
        if tuple(value.shape) != per_expert:
            want = per_expert[::-1] if kind == "expert" else per_expert
            raise CheckpointError(f"{ref.file}: tensor {ref.name} has shape {list(ref.shape)}, expected {list(want)}")
        if not 0 <= expert < spec.shape[0]:
            raise CheckpointError(f"{ref.file}: tensor {ref.name}: expert {expert} out of range [0, {spec.shape[0]})")
        bucket = self.pending.setdefault(path, {})
        bucket[expert] = value
        if len(bucket) == spec.shape[0]:
            stacked = np.stack([bucket[i] for i in range(spec.shape[0])])
            del self.pending[path]
            self._emit(path, stacked, spec)

    def _emit(self, path, value, spec):
        if path in self.done:
            raise CheckpointError(f"tensor for {'/'.join(path)} appears twice in the checkpoint")
        if np.dtype(spec.dtype) == np.int32:
            out = value.astype(np.int32)
        else:
            out = value.astype(spec.dtype)
        self.emit(path, out)
        self.done.add(path)

    def finish(self) -> None:
        if self.fp8_pending:
            name = next(iter(self.fp8_pending))
            raise CheckpointError(f"FP8 tensor {name}.weight has no {name}.weight_scale_inv")
        for path, bucket in self.pending.items():
            n = self.expected[path].shape[0]
            missing = sorted(set(range(n)) - set(bucket))
            raise CheckpointError(f"missing expert tensors for {'/'.join(path)}: experts {missing[:8]} "
                                  f"({len(missing)} of {n})")
        missing = [p for p in self.expected if p not in self.done]
        if missing:
            names = ", ".join("/".join(p) for p in missing[:5])
            raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s) the model needs: {names}")
