"""Hugging Face DeepSeek-V3 / Kimi-K2.5 target -> jaxspec parameter leaves.

The name mapping is data (`RULES`): an HF tensor-name template, the jaxspec
leaf path it feeds, how it is transformed and, for linear layers, how many
leading leaf dims form the input axis. Both names are templates over the same
fields ({layer}, {expert}, {proj}), so a rule maps HF -> leaf for conversion and
leaf -> HF (`leaf_rule`) to name a missing tensor and to name the tensors the
exporter (`checkpoints_convert.export`) writes. Every leaf's expected shape and dtype comes
from the model's own abstract parameter tree, so the converter and the model
cannot disagree silently.

Transforms:
  copy    same values and shape as the HF tensor (norms, embedding, router bias,
          INT4 weight_packed [out, in/8] int32 and weight_scale [out, in/group])
  linear  HF nn.Linear weight [out, in] -> kernel [in dims..., out dims...]
          (transpose, then split each axis into the leaf's dims)
  shape   INT4 weight_shape [out, in]: checked against config.json, not stored

A template with {expert} is one expert's tensor; it is written into row
`expert` of a leaf stacked over experts.

Conversion has two steps. `plan` looks at the safetensors headers only and
refuses unexpected, misshapen, mistyped, duplicate or missing tensors before
anything is written; `run` then streams the tensors into finished leaves.
"""

from __future__ import annotations

import dataclasses
import math
import re
import string
from collections.abc import Callable

import numpy as np

from checkpoints_convert.quant_np import dequant_fp8_block_np
from checkpoints_convert.safetensors_io import CODES, CheckpointError, TensorRef
from jaxspec import checkpoint, quant
from jaxspec.config import ModelConfig
from jaxspec.quant import Int4Weight


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: str  # HF tensor name template
    leaf: str  # jaxspec leaf path template
    kind: str  # copy | linear | shape
    in_dims: int = 1  # linear: number of leading leaf dims that make up HF's input axis

    @property
    def stacked(self) -> bool:
        return "{expert}" in self.hf

    @property
    def int4(self) -> bool:
        return self.hf.endswith(("weight_packed", "weight_scale", "weight_shape"))


LAYER = "model.layers.{layer}."
EXPERT = LAYER + "mlp.experts.{expert}.{proj}_proj."

RULES: list[Rule] = [
    Rule("model.embed_tokens.weight", "embed/embedding", "copy"),
    Rule("model.norm.weight", "final_norm/scale", "copy"),
    Rule("lm_head.weight", "lm_head/kernel", "linear"),
    Rule(LAYER + "input_layernorm.weight", "layers_{layer}/attn_norm/scale", "copy"),
    Rule(LAYER + "post_attention_layernorm.weight", "layers_{layer}/mlp_norm/scale", "copy"),
    Rule(LAYER + "self_attn.q_proj.weight", "layers_{layer}/attn/q_proj/kernel", "linear"),  # [D, H, K]
    Rule(LAYER + "self_attn.q_a_proj.weight", "layers_{layer}/attn/q_a_proj/kernel", "linear"),
    Rule(LAYER + "self_attn.q_a_layernorm.weight", "layers_{layer}/attn/q_a_norm/scale", "copy"),
    Rule(LAYER + "self_attn.q_b_proj.weight", "layers_{layer}/attn/q_b_proj/kernel", "linear"),  # [q_lora, H, K]
    Rule(LAYER + "self_attn.kv_a_proj_with_mqa.weight", "layers_{layer}/attn/kv_a_proj/kernel", "linear"),
    Rule(LAYER + "self_attn.kv_a_layernorm.weight", "layers_{layer}/attn/kv_a_norm/scale", "copy"),
    Rule(LAYER + "self_attn.kv_b_proj.weight", "layers_{layer}/attn/kv_b_proj", "linear"),  # [kv_lora, H, n+v]
    Rule(LAYER + "self_attn.o_proj.weight", "layers_{layer}/attn/o_proj/kernel", "linear", in_dims=2),  # [H, v, D]
    Rule(LAYER + "mlp.{proj}_proj.weight", "layers_{layer}/mlp/{proj}/kernel", "linear"),
    Rule(LAYER + "mlp.gate.weight", "layers_{layer}/moe/router", "linear"),
    Rule(LAYER + "mlp.gate.e_score_correction_bias", "layers_{layer}/moe/router_bias", "copy"),
    Rule(LAYER + "mlp.shared_experts.{proj}_proj.weight", "layers_{layer}/moe/shared/{proj}/kernel", "linear"),
    Rule(EXPERT + "weight", "layers_{layer}/moe/{proj}", "linear"),
    # An Int4Weight parameter `{proj}` is stored as its leaves `{proj}_packed`, `{proj}_scale`
    # (`jaxspec.checkpoint.flatten`), compressed-tensors' weight_packed / weight_scale.
    *(Rule(EXPERT + f"weight_{f}", f"layers_{{layer}}/moe/{{proj}}_{f}", "copy") for f in Int4Weight.LEAVES),
    Rule(EXPERT + "weight_shape", "layers_{layer}/moe/{proj}_packed", "shape"),
]

_FIELDS = {"layer": r"\d+", "expert": r"\d+", "proj": "gate|up|down"}


def _regex(template: str) -> re.Pattern:
    """A template such as `model.layers.{layer}.mlp.{proj}_proj.weight` as an anchored regex."""
    parts = []
    for literal, field, _, _ in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if field is not None:
            parts.append(f"(?P<{field}>{_FIELDS[field]})")
    return re.compile("".join(parts) + "$")


_HF_REGEX = [(_regex(rule.hf), rule) for rule in RULES]
_LEAF_REGEX = [(_regex(rule.leaf), rule) for rule in RULES if rule.kind != "shape"]

# Tensors a checkpoint may carry that inference does not use.
_SKIP = re.compile(r".*rotary_emb\.inv_freq$")
# Kimi-K2.5 wraps the text model; the vision tower and projector are skipped.
WRAPPER_PREFIX = "language_model."
FP8_SCALE_SUFFIX = "_scale_inv"  # DeepSeek FP8: `X.weight` comes with `X.weight_scale_inv`


def match_rule(name: str) -> tuple[Rule, dict[str, str]] | None:
    for regex, rule in _HF_REGEX:
        m = regex.match(name)
        if m:
            return rule, m.groupdict()
    return None


def leaf_rule(leaf: str) -> tuple[Rule, dict[str, str]] | None:
    """The rule that fills leaf path "a/b/c" (not the `shape` check) and its template fields, or None."""
    for regex, rule in _LEAF_REGEX:
        m = regex.match(leaf)
        if m:
            return rule, m.groupdict()
    return None


def match(name: str) -> tuple[str, str, dict[str, str]] | None:
    """(leaf path "a/b/c", kind, template fields) for an HF tensor name, or None."""
    hit = match_rule(name)
    if hit is None:
        return None
    rule, groups = hit
    return rule.leaf.format(**groups), rule.kind, groups


def hf_shape(rule: Rule, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape (one expert's, for stacked leaves) that fills `leaf_shape`."""
    shape = tuple(leaf_shape[1:] if rule.stacked else leaf_shape)
    if rule.kind == "linear":
        return math.prod(shape[rule.in_dims :]), math.prod(shape[: rule.in_dims])
    return shape


def _dtype_name(dtype: str) -> str:
    """A safetensors dtype code as numpy names it ("BF16" -> "bfloat16"), or the code itself."""
    return CODES.get(dtype, dtype)


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("F", "BF"))


def transpose_into(dst: np.ndarray, src: np.ndarray, tile: int = 256) -> None:
    """dst[...] = src.T (casting), tile by tile: a plain strided transpose of a large
    matrix misses the cache on every element and runs several times slower."""
    rows, cols = src.shape
    for r in range(0, rows, tile):
        for c in range(0, cols, tile):
            dst[c : c + tile, r : r + tile] = src[r : r + tile, c : c + tile].T


@dataclasses.dataclass
class Item:
    """One HF tensor to convert (with its FP8 scale when it has one)."""

    ref: TensorRef
    name: str  # HF name without the wrapper prefix
    rule: Rule
    path: tuple[str, ...]
    expert: int | None
    scale: TensorRef | None = None


class TargetConverter:
    """Checks the HF tensors against the model (`plan`), then streams them into leaves (`run`).

    A stacked expert leaf is allocated once in its output dtype and each expert
    is written straight into its row, so one leaf plus one expert tensor is
    all the converter holds; `plan` orders the tensors so that the experts of
    one leaf arrive one after another.
    """

    def __init__(self, cfg: ModelConfig, shapes: dict, wrapper: bool):
        self.cfg = cfg
        self.expected = checkpoint.flatten(shapes)
        self.wrapper = wrapper
        self.emit: Callable[[tuple[str, ...], np.ndarray], None] | None = None
        self.done: set[tuple[str, ...]] = set()

    # -- names -----------------------------------------------------------
    def hf_name(self, ref: TensorRef) -> str | None:
        """`ref`'s name as RULES spell it, or None for a tensor the model does not use."""
        name = ref.name
        if self.wrapper:
            if not name.startswith(WRAPPER_PREFIX):
                return None  # vision tower, projector
            name = name[len(WRAPPER_PREFIX) :]
        if _SKIP.match(name):
            return None
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= self.cfg.num_layers:
            return None  # multi-token-prediction layers beyond the decoder
        return name

    def source_name(self, path: tuple[str, ...], expert: int | str | None = None) -> str:
        """The HF tensor name that feeds leaf `path` (expert `expert` of a stacked leaf)."""
        leaf = "/".join(path)
        hit = leaf_rule(leaf)
        if hit is None:
            return leaf
        rule, fields = hit
        name = rule.hf.format(**fields, expert="*" if expert is None else expert)
        return (WRAPPER_PREFIX if self.wrapper else "") + name

    # -- step 1: headers only ----------------------------------------------
    def plan(self, refs: list[TensorRef]) -> list[Item]:
        """Check every tensor against the model from the headers; the tensors to read, in reading order."""
        items, scales = [], {}
        # INT4 weight_shape tensors last, so that an error names a weight before its shape record
        # (safetensors writers order a file by dtype width: int64 shapes may come first).
        for ref in sorted(refs, key=lambda r: r.name.endswith(".weight_shape")):
            name = self.hf_name(ref)
            if name is None:
                continue
            if name.endswith(".weight" + FP8_SCALE_SUFFIX):
                scales[name[: -len(FP8_SCALE_SUFFIX)]] = ref
            else:
                items.append(self._check(ref, name))
        for item in items:
            if item.ref.dtype.startswith("F8"):
                item.scale = self._fp8_scale(item, scales.pop(item.name, None))
        if scales:
            name, ref = next(iter(scales.items()))
            raise CheckpointError(
                f"{ref.file}: {ref.name} has no FP8 weight {ref.name[: -len(FP8_SCALE_SUFFIX)]} to scale"
            )
        self._check_complete(items)
        # Group by leaf (experts in index order); groups keep the order of their first tensor.
        first: dict[tuple[str, ...], int] = {}
        for i, item in enumerate(items):
            first.setdefault(item.path, i)
        return sorted(items, key=lambda it: (first[it.path], it.expert or 0))

    def _check(self, ref: TensorRef, name: str) -> Item:
        hit = match_rule(name)
        if hit is None:
            raise CheckpointError(
                f"{ref.file}: unexpected tensor {ref.name} (shape {list(ref.shape)}); "
                "it maps to no parameter of this model config"
            )
        rule, groups = hit
        path = tuple(rule.leaf.format(**groups).split("/"))
        if path not in self.expected:
            raise CheckpointError(self._unexpected(ref, rule, path))
        spec = self.expected[path]
        expert = int(groups["expert"]) if rule.stacked else None
        if rule.kind == "shape":
            if ref.shape != (2,) or not ref.dtype.startswith(("I", "U")):
                raise CheckpointError(
                    f"{ref.file}: {ref.name} has {_dtype_name(ref.dtype)} shape {list(ref.shape)}, "
                    "expected an integer [out, in] pair"
                )
        else:
            self._check_dtype(ref, spec)
            want = hf_shape(rule, spec.shape)
            if ref.shape != want:
                where = f"leaf shape {list(spec.shape)} at {'/'.join(path)}"
                if rule.stacked:
                    where = "one expert of " + where
                if rule.kind == "linear":
                    where = "[out, in] for " + where
                raise CheckpointError(
                    f"{ref.file}: tensor {ref.name} has shape {list(ref.shape)}; expected {list(want)} ({where})"
                )
        if expert is not None and not 0 <= expert < spec.shape[0]:
            raise CheckpointError(f"{ref.file}: tensor {ref.name}: expert {expert} out of range [0, {spec.shape[0]})")
        return Item(ref, name, rule, path, expert)

    @staticmethod
    def _check_dtype(ref: TensorRef, spec) -> None:
        got = _dtype_name(ref.dtype)
        if np.dtype(spec.dtype).kind in "iu":
            if got != np.dtype(spec.dtype).name:
                raise CheckpointError(f"{ref.file}: {ref.name} has dtype {got}, expected {np.dtype(spec.dtype).name}")
        elif not _is_float(ref.dtype) or ref.dtype not in CODES:
            raise CheckpointError(f"{ref.file}: tensor {ref.name} has dtype {got}, expected a float type")

    def _unexpected(self, ref: TensorRef, rule: Rule, path) -> str:
        if rule.int4:
            return (
                f"{ref.file}: tensor {ref.name} is INT4 pack-quantized but config.json has no matching "
                "quantization_config (compressed-tensors pack-quantized); they must agree"
            )
        if rule.stacked and self.cfg.expert_format is not None:
            return (
                f"{ref.file}: tensor {ref.name} is an unquantized expert weight but quantization_config "
                "says routed experts are INT4 pack-quantized (expected weight_packed/weight_scale)"
            )
        return f"{ref.file}: tensor {ref.name} maps to {'/'.join(path)}, which this model config does not have"

    @staticmethod
    def _fp8_scale(item: Item, scale: TensorRef | None) -> TensorRef:
        w = item.ref
        if scale is None:
            raise CheckpointError(f"{w.file}: FP8 tensor {w.name} has no {w.name}{FP8_SCALE_SUFFIX}")
        if w.dtype != "F8_E4M3":
            raise CheckpointError(f"{w.file}: FP8 tensor {w.name} has dtype {w.dtype}, expected F8_E4M3")
        if not _is_float(scale.dtype) or scale.dtype.startswith("F8"):
            raise CheckpointError(
                f"{scale.file}: {scale.name} has dtype {_dtype_name(scale.dtype)}, expected a float type"
            )
        rows, cols = quant.FP8_BLOCK
        grid = (-(-w.shape[0] // rows), -(-w.shape[1] // cols))
        if scale.shape != grid:
            raise CheckpointError(
                f"{scale.file}: {scale.name} has scale grid {scale.shape}, expected {grid}: "
                f"one scale per {rows}x{cols} block of {w.name} {w.shape}"
            )
        return scale

    def _check_complete(self, items: list[Item]) -> None:
        present: dict[tuple[str, ...], set] = {}
        for item in items:
            if item.rule.kind == "shape":
                continue
            seen = present.setdefault(item.path, set())
            if item.expert in seen:
                raise CheckpointError(f"{item.ref.file}: tensor {item.ref.name} appears twice in the checkpoint")
            seen.add(item.expert)
        for path, seen in present.items():
            n = self.expected[path].shape[0]
            if None not in seen and len(seen) < n:
                missing = sorted(set(range(n)) - seen)
                names = ", ".join(self.source_name(path, e) for e in missing[:3])
                raise CheckpointError(
                    f"missing expert tensors for {'/'.join(path)}: experts {missing[:8]} "
                    f"({len(missing)} of {n}): {names}{', ...' if len(missing) > 3 else ''}"
                )
        missing = [p for p in self.expected if p not in present]
        if missing:
            names = ", ".join(f"{self.source_name(p)} (for {'/'.join(p)})" for p in missing[:5])
            raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s) the model needs: {names}")

    # -- step 2: tensor data ---------------------------------------------------
    def run(
        self,
        items: list[Item],
        emit: Callable[[tuple[str, ...], np.ndarray], None],
        progress: Callable[[int], None] = lambda nbytes: None,
    ) -> None:
        """Read `items` (from `plan`) and pass each finished leaf to `emit(path, array)`."""
        self.emit = emit
        stack_path, stack, arrived = None, None, None
        for item in items:
            spec = self.expected[item.path]
            if item.rule.kind == "shape":
                self._check_weight_shape(item)
            elif item.expert is None:
                out = np.empty(spec.shape, spec.dtype)
                self._fill(out, item)
                self._emit(item.path, out, spec)
                del out
            else:
                if item.path != stack_path:
                    self._require_all(stack_path, arrived)
                    stack = arrived = None  # let the previous leaf go before allocating the next
                    stack_path, stack = item.path, np.empty(spec.shape, spec.dtype)
                    arrived = np.zeros(spec.shape[0], bool)
                if arrived[item.expert]:
                    raise CheckpointError(f"{item.ref.file}: tensor {item.ref.name} appears twice in the checkpoint")
                self._fill(stack[item.expert], item)
                arrived[item.expert] = True
                if arrived.all():
                    self._emit(item.path, stack, spec)
                    stack_path, stack, arrived = None, None, None
            progress(item.ref.nbytes + (item.scale.nbytes if item.scale else 0))
        self._require_all(stack_path, arrived)

    def _require_all(self, path, arrived) -> None:
        if path is not None and not arrived.all():
            missing = np.flatnonzero(~arrived).tolist()
            raise CheckpointError(
                f"missing expert tensors for {'/'.join(path)}: experts {missing[:8]} ({len(missing)} of {len(arrived)})"
            )

    def _fill(self, dst: np.ndarray, item: Item) -> None:
        """Write `item`'s values into `dst` (its leaf, or its expert's row), cast to dst's dtype."""
        src = np.asarray(item.ref.load())  # a plain view: slicing a memmap object costs per tile
        if item.scale is not None:
            src = dequant_fp8_block_np(src, np.asarray(item.scale.load(), np.float32))
        if item.rule.kind == "linear":
            out_features, in_features = src.shape
            transpose_into(dst.reshape(in_features, out_features), src)
        else:
            dst[...] = src.reshape(dst.shape)

    def _check_weight_shape(self, item: Item) -> None:
        proj = item.path[-1].split("_")[0]
        D, F = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        want = [D, F] if proj == "down" else [F, D]
        got = [int(x) for x in item.ref.load()]
        if got != want:
            raise CheckpointError(f"{item.ref.file}: {item.ref.name} = {got}, expected {want} ([out, in])")

    def _emit(self, path, value, spec) -> None:
        if path in self.done:
            raise CheckpointError(f"tensor for {'/'.join(path)} appears twice in the checkpoint")
        self.emit(path, value)
        self.done.add(path)

    def finish(self) -> None:
        missing = [p for p in self.expected if p not in self.done]
        if missing:
            raise CheckpointError(
                f"conversion wrote {len(self.done)} of {len(self.expected)} leaves; missing "
                f"{', '.join('/'.join(p) for p in missing[:5])}"
            )
