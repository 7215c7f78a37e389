"""The converter refuses bad checkpoints with messages a user can act on.

One tiny random DeepseekV3 checkpoint is saved by transformers once per module;
each test copies it, breaks one thing (a tensor, a shard, config.json) and
checks that conversion fails with an error naming the culprit and what was
expected, and that the output never carries the COMPLETE marker. The FP8 and
INT4 tests also check the values that end up in the converted leaves.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import hf_models
import jax
import ml_dtypes
import numpy as np
import pytest

from checkpoints_convert import quant_np, target
from checkpoints_convert.convert import convert
from checkpoints_convert.safetensors_io import CheckpointError, read_header, write_safetensors
from jaxspec import checkpoint
from jaxspec.config import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Layer 0 dense, layer 1 MoE. hidden_size 64 and moe_intermediate_size 32 (hf_models.BASE) are multiples
# of the INT4 group size 32; a dense intermediate size of 200 gives FP8 partial 128x128 blocks.
MODEL = dict(num_hidden_layers=2, intermediate_size=200)
EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")

INT4_CONFIG = {
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
                "group_size": 32,
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|down)_proj.*",
        "re:.*mlp\\.gate$",
    ],
    "kv_cache_scheme": None,
}

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


class HFCheckpoint:
    """A writable copy of the tiny HF checkpoint (single model.safetensors + config.json)."""

    def __init__(self, path: str):
        self.path = path
        self.file = os.path.join(path, "model.safetensors")

    def tensors(self) -> dict[str, np.ndarray]:
        return {r.name: np.array(r.load()) for r in read_header(self.file)}

    def save(self, tensors: dict[str, np.ndarray]) -> None:
        write_safetensors(self.file, tensors)

    def edit(self, fn) -> None:
        """Apply `fn(tensors)` in place and write the result back."""
        tensors = self.tensors()
        fn(tensors)
        self.save(tensors)

    def config(self) -> dict:
        with open(os.path.join(self.path, "config.json")) as f:
            return json.load(f)

    def update_config(self, **fields) -> None:
        cfg = self.config()
        cfg.update(fields)
        with open(os.path.join(self.path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("pristine") / "hf")
    assert hf_models.BASE["hidden_size"] % 32 == 0 and hf_models.BASE["moe_intermediate_size"] % 32 == 0
    hf_models.build(path, seed=0, **MODEL)
    return path


@pytest.fixture
def hf(pristine, tmp_path) -> HFCheckpoint:
    path = str(tmp_path / "hf")
    shutil.copytree(pristine, path)
    return HFCheckpoint(path)


@pytest.fixture
def out(tmp_path) -> str:
    return str(tmp_path / "jaxspec")


def run_convert(hf_dir: str, out: str) -> dict:
    return convert(hf_dir, out, dtype="float32", progress=False)


def expect_error(hf: HFCheckpoint, out: str, exc_type, *fragments: str) -> str:
    """Convert, expect `exc_type` whose message contains every fragment; no COMPLETE marker may appear."""
    with pytest.raises(exc_type) as info:
        run_convert(hf.path, out)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from error message: {message}"
    assert not os.path.exists(os.path.join(out, checkpoint.MARKER))
    return message


def read_leaf(out: str, path: str, shape, dtype=np.float32) -> np.ndarray:
    """One converted leaf, through the project's loader."""
    keys = path.split("/")
    abstract: dict = {}
    node = abstract
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = jax.ShapeDtypeStruct(tuple(shape), dtype)
    tree = checkpoint.load_leaves(out, abstract)
    for k in keys:
        tree = tree[k]
    return np.asarray(tree)


def int4_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Replace every routed expert weight by compressed-tensors' weight_packed / weight_scale / weight_shape."""
    out = {}
    for name, value in tensors.items():
        if EXPERT.match(name):
            base = name[: -len("weight")]
            packed, scale = quant_np.quantize_int4_np(value.astype(ml_dtypes.bfloat16))
            out[base + "weight_packed"] = packed
            out[base + "weight_scale"] = scale
            out[base + "weight_shape"] = np.array(value.shape, np.int64)
        else:
            out[name] = value
    return out


def fp8_blocks(w: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A float8_e4m3fn weight shaped like `w` and distinct per-block float32 scales."""
    rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    scale_inv = np.random.default_rng(seed).uniform(0.25, 4.0, size=(rows, cols)).astype(np.float32)
    return (8 * w).astype(ml_dtypes.float8_e4m3fn), scale_inv


# ---------------------------------------------------------------------------
# Missing, misshapen, mistyped and unexpected tensors


def test_missing_tensor(hf, out):
    """A deleted attention projection is reported by its HF name and the leaf it feeds, before any write."""
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    hf.edit(lambda t: t.pop(name))
    expect_error(hf, out, CheckpointError, "missing 1 tensor", name, "layers_1/attn/kv_b_proj")
    assert not os.path.exists(out) and not os.path.exists(checkpoint.staging_dir(out))


def test_missing_tensor_in_kimi_wrapper(hf, out):
    """In a Kimi-K2.5 wrapper checkpoint the missing tensor is named with its `language_model.` prefix."""
    hf.edit(lambda t: t.pop("model.norm.weight"))
    hf_models.wrap_as_kimi(hf.path)
    expect_error(hf, out, CheckpointError, "missing 1 tensor", "language_model.model.norm.weight")


def test_missing_single_expert(hf, out):
    """One missing expert projection is reported with the expert index, the count and its HF name."""
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    hf.edit(lambda t: t.pop(name))
    expect_error(hf, out, CheckpointError, "layers_1/moe/up", "experts [3]", "1 of 8", name)


def test_duplicate_tensor(hf, out):
    """The same tensor in two shards is refused, naming it."""
    tensors = hf.tensors()
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    write_safetensors(os.path.join(hf.path, "model-00001-of-00002.safetensors"), tensors)
    write_safetensors(os.path.join(hf.path, "model-00002-of-00002.safetensors"), {name: tensors[name]})
    os.remove(hf.file)
    weight_map = {k: "model-00001-of-00002.safetensors" for k in tensors}
    weight_map[name] = "model-00002-of-00002.safetensors"
    with open(os.path.join(hf.path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    expect_error(hf, out, CheckpointError, name, "appears twice")


def _truncate_rows(name):
    def edit(t):
        t[name] = t[name][:-1].copy()

    return edit


def _transpose(name):
    def edit(t):
        t[name] = t[name].T.copy()

    return edit


@pytest.mark.parametrize(
    "name,edit,found,expected",
    [
        ("model.layers.1.self_attn.kv_b_proj.weight", _truncate_rows, "[79, 16]", "leaf shape [16, 4, 20]"),
        ("model.layers.1.input_layernorm.weight", _truncate_rows, "[63]", "[64]"),
        ("model.layers.0.mlp.down_proj.weight", _truncate_rows, "[63, 200]", "leaf shape [200, 64]"),
        ("model.layers.1.mlp.experts.2.gate_proj.weight", _transpose, "[64, 32]", "[32, 64]"),
    ],
    ids=["linear-truncated", "norm-truncated", "dense-mlp-truncated", "expert-transposed"],
)
def test_wrong_shape(hf, out, name, edit, found, expected):
    """A tensor of the wrong shape is named with the shape found and the shape expected."""
    hf.edit(edit(name))
    expect_error(hf, out, CheckpointError, name, f"shape {found}", "expected", expected)


@pytest.mark.parametrize(
    "name,found,expected",
    [
        ("model.layers.1.self_attn.kv_b_proj.weight", "[16, 80]", "[80, 16]"),
        ("model.layers.1.self_attn.o_proj.weight", "[48, 64]", "[64, 48]"),
        ("model.embed_tokens.weight", "[64, 97]", "[97, 64]"),
    ],
    ids=["linear", "linear-2-input-dims", "embedding"],
)
def test_transposed_tensor(hf, out, name, found, expected):
    """A transposed non-square weight is refused, naming the file and both shapes."""
    hf.edit(_transpose(name))
    expect_error(hf, out, CheckpointError, hf.file, name, f"shape {found}", f"expected {expected}")


def test_reshaped_tensor(hf, out):
    """A weight with the right element count but another [out, in] split is refused."""
    name = "model.layers.1.self_attn.o_proj.weight"  # [64, 48]
    hf.edit(lambda t: t.update({name: t[name].reshape(96, 32).copy()}))
    expect_error(hf, out, CheckpointError, name, "shape [96, 32]", "expected [64, 48]", "leaf shape [4, 12, 64]")


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.mlp.experts.2.gate_proj.weight",
    ],
    ids=["linear", "expert"],
)
def test_wrong_dtype(hf, out, name):
    """A weight stored as int32 is named with its dtype."""
    hf.edit(lambda t: t.update({name: t[name].astype(np.int32)}))
    expect_error(hf, out, CheckpointError, name, "dtype int32", "expected a float type")


def test_unexpected_tensor(hf, out):
    """A tensor that maps to no parameter is named with its shape and the file holding it."""
    hf.edit(lambda t: t.update({"model.layers.0.self_attn.foo.weight": np.zeros((3, 4), np.float32)}))
    expect_error(hf, out, CheckpointError, hf.file, "unexpected tensor model.layers.0.self_attn.foo.weight", "[3, 4]")


# ---------------------------------------------------------------------------
# config.json


def test_unknown_architecture(hf, out):
    """A non-DeepSeek config.json is refused, naming the file and the architecture."""
    hf.update_config(architectures=["LlamaForCausalLM"], model_type="llama")
    expect_error(hf, out, ConfigError, os.path.join(hf.path, "config.json"), "unknown architecture", "LlamaForCausalLM")
    assert not os.path.exists(out), "nothing may be written for a config that is refused"


@pytest.mark.parametrize(
    "fields,fragments",
    [
        ({"scoring_func": "softmax"}, ("scoring_func='softmax'", "'sigmoid'")),
        ({"hidden_act": "gelu"}, ("hidden_act='gelu'", "'silu'")),
        ({"topk_method": "greedy"}, ("topk_method='greedy'", "noaux_tc")),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, ("rope_scaling", "rope type 'linear'", "'yarn'")),
    ],
    ids=["scoring_func", "hidden_act", "topk_method", "rope_scaling"],
)
def test_unsupported_setting(hf, out, fields, fragments):
    """A setting the model does not implement is a ConfigError naming the field and the value."""
    hf.update_config(**fields)
    expect_error(hf, out, ConfigError, "config.json", "not supported", *fragments)


# ---------------------------------------------------------------------------
# Quantization: INT4 pack-quantized experts and DeepSeek FP8 block weights


def test_int4_experts_convert(hf, out):
    """Packed experts with a matching quantization_config convert to the stacked packed words and scales."""
    tensors = int4_experts(hf.tensors())
    hf.save(tensors)
    hf.update_config(quantization_config=INT4_CONFIG)
    run_convert(hf.path, out)
    packed = read_leaf(out, "layers_1/moe/down_packed", (8, 64, 4), np.int32)
    scale = read_leaf(out, "layers_1/moe/down_scale", (8, 64, 1))
    for e in range(8):
        base = f"model.layers.1.mlp.experts.{e}.down_proj."
        np.testing.assert_array_equal(packed[e], tensors[base + "weight_packed"])
        np.testing.assert_array_equal(scale[e], tensors[base + "weight_scale"].astype(np.float32))


def test_int4_config_with_plain_experts(hf, out):
    """quantization_config says INT4 but the experts are plain weights: the first one is named."""
    hf.update_config(quantization_config=INT4_CONFIG)
    expect_error(
        hf,
        out,
        CheckpointError,
        "model.layers.1.mlp.experts.0.down_proj.weight",
        "unquantized expert weight",
        "quantization_config",
        "weight_packed",
    )


def test_packed_experts_without_config(hf, out):
    """Packed experts without a quantization_config: the first packed tensor is named."""
    hf.save(int4_experts(hf.tensors()))
    expect_error(
        hf,
        out,
        CheckpointError,
        "model.layers.1.mlp.experts.0.down_proj.weight_packed",
        "INT4 pack-quantized",
        "no matching quantization_config",
    )


def test_weight_shape_disagrees_with_config(hf, out):
    """A weight_shape tensor that contradicts config.json is named with both shapes."""
    name = "model.layers.1.mlp.experts.5.down_proj.weight_shape"
    tensors = int4_experts(hf.tensors())
    tensors[name] = np.array([64, 48], np.int64)
    hf.save(tensors)
    hf.update_config(quantization_config=INT4_CONFIG)
    expect_error(hf, out, CheckpointError, name, "[64, 48]", "expected [64, 32]")


def test_fp8_block_weights_dequantized(hf, out):
    """FP8 dense-MLP weights convert to weight * scale_inv, one scale per 128x128 block."""
    tensors = hf.tensors()
    expected = {}
    for seed, proj in enumerate(("gate", "up", "down")):
        name = f"model.layers.0.mlp.{proj}_proj.weight"
        w8, scale_inv = fp8_blocks(tensors[name], seed)
        tensors[name], tensors[name + "_scale_inv"] = w8, scale_inv
        rows, cols = w8.shape
        per_element = np.repeat(np.repeat(scale_inv, 128, axis=0), 128, axis=1)[:rows, :cols]
        expected[proj] = w8.astype(np.float32) * per_element
        assert len(np.unique(per_element)) > 1, "the test needs more than one block per weight"
    hf.save(tensors)
    hf.update_config(quantization_config=FP8_CONFIG)
    run_convert(hf.path, out)
    for proj, want in expected.items():
        kernel = read_leaf(out, f"layers_0/mlp/{proj}/kernel", want.T.shape)
        np.testing.assert_array_equal(kernel, want.T, err_msg=proj)


def test_fp8_missing_scale_inv(hf, out):
    """An FP8 weight without its weight_scale_inv names both tensors."""
    name = "model.layers.0.mlp.up_proj.weight"
    tensors = hf.tensors()
    tensors[name] = fp8_blocks(tensors[name], 0)[0]
    hf.save(tensors)
    hf.update_config(quantization_config=FP8_CONFIG)
    expect_error(hf, out, CheckpointError, f"FP8 tensor {name}", f"no {name}_scale_inv")


def test_fp8_wrong_scale_inv_shape(hf, out):
    """A weight_scale_inv with the wrong block grid names both tensors and both shapes."""
    name = "model.layers.0.mlp.down_proj.weight"
    tensors = hf.tensors()
    w8, scale_inv = fp8_blocks(tensors[name], 0)
    tensors[name], tensors[name + "_scale_inv"] = w8, scale_inv[:, :1].copy()
    hf.save(tensors)
    hf.update_config(quantization_config=FP8_CONFIG)
    expect_error(
        hf, out, CheckpointError, f"{name}_scale_inv has scale grid (1, 1)", "expected (1, 2)", f"{name} (64, 200)"
    )


# ---------------------------------------------------------------------------
# Files: shard index, truncated shards


def test_index_names_missing_shard(hf, out):
    """An index that lists a shard file that is not there is refused before anything is written."""
    tensors = hf.tensors()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        write_safetensors(os.path.join(hf.path, file), {k: tensors[k] for k in keys})
    os.remove(hf.file)
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
        "weight_map": {k: file for file, keys in shards.items() for k in keys},
    }
    with open(os.path.join(hf.path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    os.remove(os.path.join(hf.path, "model-00002-of-00002.safetensors"))
    expect_error(
        hf, out, CheckpointError, "model.safetensors.index.json", "model-00002-of-00002.safetensors", "do not exist"
    )
    assert not os.path.exists(out)


@pytest.mark.parametrize(
    "keep,fragment",
    [
        pytest.param(4, "not a safetensors file", id="inside-length"),
        pytest.param(100, "truncated", id="inside-header"),
        pytest.param(-1000, "truncated", id="inside-data"),
    ],
)
def test_truncated_safetensors(hf, out, keep, fragment):
    """A truncated shard (cut in the length field, the header or the data) is named before anything is written."""
    size = os.path.getsize(hf.file)
    with open(hf.file, "r+b") as f:
        f.truncate(keep if keep > 0 else size + keep)
    expect_error(hf, out, CheckpointError, hf.file, fragment)
    assert not os.path.exists(out) and not os.path.exists(checkpoint.staging_dir(out))


def test_malformed_safetensors_header(hf, out):
    """A header that is not JSON is refused, naming the file."""
    with open(hf.file, "r+b") as f:
        f.seek(8)
        f.write(b"{not json")
    expect_error(hf, out, CheckpointError, hf.file, "malformed safetensors header")


@pytest.mark.parametrize("text", ['{"architectures": ["DeepseekV3ForCausalLM"],', "[1, 2]"], ids=["cut", "list"])
def test_malformed_config_json(hf, out, text):
    """A config.json that is not a JSON object is a ConfigError naming the file."""
    with open(os.path.join(hf.path, "config.json"), "w") as f:
        f.write(text)
    expect_error(hf, out, ConfigError, os.path.join(hf.path, "config.json"))
    assert not os.path.exists(out)


@pytest.mark.parametrize("shape", [(3, 5), (300, 513), (1, 700)])
def test_transpose_into(shape):
    """The tiled transpose equals src.T, edge tiles and casting included."""
    src = np.random.default_rng(0).standard_normal(shape).astype(ml_dtypes.bfloat16)
    dst = np.zeros(shape[::-1], np.float32)
    target.transpose_into(dst, src, tile=128)
    np.testing.assert_array_equal(dst, src.T.astype(np.float32))


def test_experts_interleaved_across_shards(hf, out, tmp_path):
    """Experts of one leaf spread over two shards in alternating order convert to the same leaves."""
    run_convert(hf.path, out)
    tensors = hf.tensors()
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[0::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        write_safetensors(os.path.join(hf.path, file), {k: tensors[k] for k in keys})
    os.remove(hf.file)
    with open(os.path.join(hf.path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {k: file for file, keys in shards.items() for k in keys}}, f)
    sharded = str(tmp_path / "sharded")
    run_convert(hf.path, sharded)
    for leaf, shape in (("layers_1/moe/down", (8, 32, 64)), ("layers_1/attn/o_proj/kernel", (4, 12, 64))):
        np.testing.assert_array_equal(read_leaf(sharded, leaf, shape), read_leaf(out, leaf, shape), err_msg=leaf)
    down = read_leaf(out, "layers_1/moe/down", (8, 32, 64))
    np.testing.assert_array_equal(down[5], tensors["model.layers.1.mlp.experts.5.down_proj.weight"].T)


# ---------------------------------------------------------------------------
# Output directory: completion marker, refusing to overwrite


class Interrupted(Exception):
    pass


def _interrupt_after(monkeypatch, leaves: int) -> None:
    """Make the converter crash once it has written `leaves` leaves."""
    real_emit = target.TargetConverter._emit
    emitted = []

    def emit_then_fail(self, path, value, spec):
        if len(emitted) == leaves:
            raise Interrupted("simulated crash")
        real_emit(self, path, value, spec)
        emitted.append(path)

    monkeypatch.setattr(target.TargetConverter, "_emit", emit_then_fail)


def _assert_refuses_to_load(path: str) -> None:
    from jaxspec.engine import Engine

    for load in (checkpoint.read_config, Engine.load):
        with pytest.raises(checkpoint.IncompleteCheckpoint) as info:
            load(path)
        message = str(info.value)
        assert path in message and checkpoint.MARKER in message and "interrupted" in message
        assert "python -m checkpoints_convert" in message and "again" in message


def test_interrupted_conversion_then_rerun(hf, out, monkeypatch):
    """An interrupted conversion leaves nothing that loads, neither at OUT nor in its staging
    directory; a re-run completes and removes the staging directory."""
    from jaxspec.engine import Engine

    staging = checkpoint.staging_dir(out)
    _interrupt_after(monkeypatch, 5)
    with pytest.raises(Interrupted):
        run_convert(hf.path, out)
    monkeypatch.undo()

    assert not os.path.exists(out), "nothing may appear at OUT before the conversion is complete"
    assert len(os.listdir(os.path.join(staging, "params"))) == 5, "the interrupted run should have written 5 leaves"
    assert not os.path.exists(os.path.join(staging, checkpoint.MARKER))
    _assert_refuses_to_load(out)
    _assert_refuses_to_load(staging)

    summary = run_convert(hf.path, out)
    assert os.path.exists(os.path.join(out, checkpoint.MARKER)) and not os.path.exists(staging)
    engine = Engine.load(out, dtype="float32")
    assert engine.cfg.num_layers == 2 and summary["leaves"] == len(os.listdir(os.path.join(out, "params")))


def test_failed_reconversion_keeps_previous_checkpoint(hf, out, monkeypatch):
    """Converting over a complete checkpoint replaces it only once the new one is complete."""
    run_convert(hf.path, out)
    before = read_leaf(out, "final_norm/scale", (64,))
    hf.edit(lambda t: t.update({"model.norm.weight": t["model.norm.weight"] + 1}))

    _interrupt_after(monkeypatch, 5)
    with pytest.raises(Interrupted):
        run_convert(hf.path, out)
    monkeypatch.undo()
    assert checkpoint.read_config(out)["dtype"] == "float32"
    np.testing.assert_array_equal(read_leaf(out, "final_norm/scale", (64,)), before)

    run_convert(hf.path, out)
    np.testing.assert_array_equal(read_leaf(out, "final_norm/scale", (64,)), before + 1)
    assert sorted(os.listdir(os.path.dirname(out))) == sorted(["hf", os.path.basename(out)])


def test_refuses_to_overwrite_foreign_directory(hf, out):
    """A non-empty directory that is not a jaxspec checkpoint is left untouched."""
    os.makedirs(out)
    keep = os.path.join(out, "notes.txt")
    with open(keep, "w") as f:
        f.write("precious")
    expect_error(hf, out, FileExistsError, out, "not a jaxspec checkpoint", "refusing to overwrite")
    assert os.listdir(out) == ["notes.txt"]
    with open(keep) as f:
        assert f.read() == "precious"


# ---------------------------------------------------------------------------
# Command line


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "checkpoints_convert", *args, "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_success(hf, out):
    """`python -m checkpoints_convert` exits 0 on a good checkpoint and writes a complete one."""
    proc = run_cli("--target", hf.path, "--out", out, "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out}:")
    assert checkpoint.read_config(out)["dtype"] == "float32"


def test_cli_error(hf, out):
    """`python -m checkpoints_convert` exits 2 with `error:` and the tensor name on a bad checkpoint."""
    name = "model.layers.1.self_attn.o_proj.weight"
    hf.edit(lambda t: t.update({name: t[name].astype(np.int32)}))
    proc = run_cli("--target", hf.path, "--out", out)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and name in proc.stderr and "int32" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dtype_auto_keeps_the_checkpoints_dtype(hf, out, tmp_path):
    """`--dtype auto` (the default) stores float weights in the checkpoint's own dtype: its config's
    torch_dtype, else the tensors'; an explicit dtype still wins."""
    cfg = hf.config()
    declared = cfg.get("torch_dtype", cfg.get("dtype"))
    assert declared == "float32", declared  # transformers wrote the float32 model's dtype
    convert(hf.path, out, progress=False)
    assert checkpoint.read_config(out)["dtype"] == "float32"
    import orbax.checkpoint as ocp

    stored = lambda: (
        ocp.StandardCheckpointer().restore(os.path.join(out, "params", "layers_0.attn.o_proj.kernel"))["value"].dtype
    )
    assert stored() == np.float32
    hf.update_config(torch_dtype="bfloat16", dtype="bfloat16")
    convert(hf.path, out, progress=False)
    assert checkpoint.read_config(out)["dtype"] == "bfloat16" and stored().name == "bfloat16"
    convert(hf.path, out, dtype="float32", progress=False)
    assert checkpoint.read_config(out)["dtype"] == "float32"
    # No dtype in the config: the tensors decide (float32 here).
    cfg = hf.config()
    cfg.pop("torch_dtype", None), cfg.pop("dtype", None)
    with open(os.path.join(hf.path, "config.json"), "w") as f:
        json.dump(cfg, f)
    convert(hf.path, out, progress=False)
    assert checkpoint.read_config(out)["dtype"] == "float32"
    with pytest.raises(ValueError, match="--dtype 'float16'"):
        convert(hf.path, str(tmp_path / "x"), dtype="float16", progress=False)
