"""Exported checkpoints are real Hugging Face checkpoints that convert back to the same model.

A random tiny target (YaRN RoPE, grouped routing, non-trivial norms and router
bias) is exported (a) as a plain fp32 DeepseekV3ForCausalLM that transformers
loads with our logits, and (b) in Kimi-K2.5's layout with INT4 experts, sharded,
which our converter reads back to the quantized experts and bf16-rounded rest.
(c) A random draft exported in SpecForge layout reads back identically, loads in
SpecForge's own model class, and pairs with the target. (d) An interrupted export never looks complete.
"""

from __future__ import annotations

import json
import os

import hf_models
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import spec_pair
import torch

from checkpoints_convert import export, quant_np
from checkpoints_convert.convert import convert
from checkpoints_convert.draft import read_draft
from checkpoints_convert.export import export_draft, export_target
from checkpoints_convert.safetensors_io import read_header
from checkpoints_convert.tokenizer_files import write_tiktoken_file, write_tokenizer_config
from jaxspec import checkpoint, spec, training
from jaxspec.config import Int4Format, from_hf_dict
from jaxspec.draft import init_params as draft_init
from jaxspec.engine import Engine
from jaxspec.model import abstract_params, per_layer, stack_layers

EXPERT_LEAF = ("gate", "up", "down")


def random_tree(shapes, seed: int):
    """Random numpy leaves for a tree of ShapeDtypeStructs (no init compile): norms near 1,
    a small router bias, weights ~ N(0, 1/fan_in). Give it the per-layer tree (`per_layer`):
    a stacked leaf's first dim is the layer, not the fan-in."""
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        name = "/".join(p.key for p in path)
        if name.endswith("norm/scale"):
            return (1 + 0.2 * rng.standard_normal(s.shape)).astype(np.float32)
        if name.endswith("router_bias"):
            return (0.1 * rng.standard_normal(s.shape)).astype(np.float32)
        stacked = name.endswith(("moe/gate", "moe/up", "moe/down"))  # [E, in, out]
        fan_in = s.shape[1] if stacked else s.shape[0] if len(s.shape) >= 2 else 1
        return (rng.standard_normal(s.shape) / np.sqrt(fan_in)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, shapes)


def random_target(vocab: int, seed: int):
    """A tiny target with YaRN RoPE and grouped routing, every leaf non-trivial."""
    cfg = spec_pair.target_config(vocab).replace(
        n_group=2,
        topk_group=1,
        rope_theta=5000.0,
        rope_factor=8.0,
        rope_original_max_position=128,
        rope_mscale=1.0,
        rope_mscale_all_dim=0.7,
        bos_token_id=vocab - 2,
        eos_token_id=vocab - 1,
    )
    return cfg, random_tree(per_layer(cfg, abstract_params(cfg)[0]), seed)  # one tree per layer, as exported


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """fp32 plain DeepseekV3 export of a random target: (cfg, params, export dir)."""
    cfg, params = random_target(64, seed=0)
    out = str(tmp_path_factory.mktemp("export") / "plain")
    export_target(cfg, params, out, int4_experts=False, kimi_wrapper=False, dtype="float32")
    return cfg, params, out


def test_plain_fp32_export_loads_in_transformers(plain):
    from transformers import DeepseekV3ForCausalLM

    cfg, params, out = plain
    with open(os.path.join(out, "config.json")) as f:
        assert from_hf_dict(json.load(f)) == cfg  # every field, YaRN included, survives config.json
    model, info = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=23).tolist()
    ref = hf_models.hf_logits(model.eval(), ids)
    ours = Engine(cfg, params).target_logits(ids)
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-4
    with open(os.path.join(out, "generation_config.json")) as f:
        assert json.load(f) == {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}


def tiny_tokenizer(directory, num_base: int) -> None:
    """A tokenizer with `num_base` single-byte tokens; ids num_base.. are [BOS], [EOS]."""
    os.makedirs(directory, exist_ok=True)
    write_tiktoken_file(os.path.join(directory, "tiktoken.model"), {bytes([97 + i]): i for i in range(num_base)})
    write_tokenizer_config(
        os.path.join(directory, "tokenizer_config.json"), {num_base: "[BOS]", num_base + 1: "[EOS]"}, "[BOS]", "[EOS]"
    )


def test_int4_kimi_export_is_sharded_and_converts_back(tmp_path):
    cfg, params = random_target(320, seed=3)  # 64 base tokens + 256 specials
    tok, hf, ck = (str(tmp_path / n) for n in ("tok", "hf", "ck"))
    tiny_tokenizer(tok, 64)
    summary = export_target(cfg, params, hf, shard_bytes=48 * 1024, tokenizer_dir=tok)

    with open(os.path.join(hf, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and files == summary["files"]
    assert all(f == f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k, f in enumerate(files))
    refs = {r.name: r for f in files for r in read_header(os.path.join(hf, f))}
    assert {n: os.path.basename(r.file) for n, r in refs.items()} == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(r.nbytes for r in refs.values())
    assert all(n.startswith("language_model.") for n in refs)
    expert = "language_model.model.layers.1.mlp.experts.5.down_proj."
    assert (refs[expert + "weight_packed"].dtype, refs[expert + "weight_packed"].shape) == ("I32", (64, 4))
    assert (refs[expert + "weight_scale"].dtype, refs[expert + "weight_scale"].shape) == ("BF16", (64, 1))
    assert np.array_equal(refs[expert + "weight_shape"].load(), [64, 32])
    assert refs["language_model.model.layers.2.mlp.gate.weight"].dtype == "F32"
    assert refs["language_model.model.layers.2.mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert refs["language_model.model.layers.0.self_attn.o_proj.weight"].dtype == "BF16"

    with open(os.path.join(hf, "config.json")) as f:
        hf_cfg = json.load(f)
    assert hf_cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert hf_cfg["quantization_config"]["format"] == "pack-quantized"
    assert from_hf_dict(hf_cfg) == cfg.replace(expert_format=Int4Format(32))

    convert(hf, ck, dtype="float32", progress=False)
    engine = Engine.load(ck, dtype="float32")
    assert engine.cfg == cfg.replace(expert_format=Int4Format(32))
    assert engine.tokenizer is not None and engine.tokenizer.eos_id == 65
    loaded, original = (
        checkpoint.flatten(per_layer(cfg, engine.params)),
        checkpoint.flatten(per_layer(cfg, params)),
    )  # layer by layer
    for path, value in original.items():
        got = np.asarray(loaded[path[:-1] + (path[-1] + "_packed",)] if path[-1] in EXPERT_LEAF else loaded[path])
        if path[-1] in EXPERT_LEAF:  # routed experts: exactly our INT4 quantization of the originals
            w_out_in = np.swapaxes(np.asarray(value), 1, 2)
            packed, scale = quant_np.quantize_int4_np(w_out_in, 32, scale_dtype=ml_dtypes.bfloat16)
            np.testing.assert_array_equal(got, packed, err_msg="/".join(path))
            np.testing.assert_array_equal(
                np.asarray(loaded[path[:-1] + (path[-1] + "_scale",)]), scale.astype(np.float32)
            )
        elif path[-1].startswith("router"):
            np.testing.assert_array_equal(got, np.asarray(value), err_msg="/".join(path))
        else:
            want = np.asarray(value).astype(ml_dtypes.bfloat16).astype(np.float32)
            np.testing.assert_array_equal(got, want, err_msg="/".join(path))

    # Exporting the converted (INT4) model again reproduces every tensor bit for bit.
    again = str(tmp_path / "again")
    export_target(engine.cfg, engine.params, again, shard_bytes=48 * 1024, tokenizer_dir=ck)
    redone = {r.name: r for f in summary["files"] for r in read_header(os.path.join(again, f))}
    assert sorted(redone) == sorted(refs)
    for name, ref in refs.items():
        assert redone[name].dtype == ref.dtype and np.array_equal(redone[name].load(), ref.load()), name
    assert open(os.path.join(again, "tiktoken.model")).read() == open(os.path.join(tok, "tiktoken.model")).read()


def random_draft(seed: int):
    dcfg = spec_pair.draft_config(64, 56)
    rng = np.random.default_rng(seed)
    dparams = random_tree(jax.eval_shape(lambda: draft_init(dcfg, jax.random.key(0))), seed)
    d2t, t2d = training.vocab_map(rng.integers(0, 100, 64), 56)
    return dcfg, dparams, d2t, t2d


def test_draft_export_reads_back_and_pairs(plain, tmp_path):
    cfg, params, target_dir = plain
    dcfg, dparams, d2t, t2d = random_draft(seed=4)
    out, pair = str(tmp_path / "draft"), str(tmp_path / "pair")
    export_draft(dcfg, dparams, d2t, t2d, str(tmp_path / "bf16"))  # the default dtype
    dtypes = {r.name: r.dtype for r in read_header(str(tmp_path / "bf16" / "model.safetensors"))}
    assert (dtypes["fc.weight"], dtypes["d2t"], dtypes["t2d"]) == ("BF16", "I64", "BOOL")

    export_draft(dcfg, dparams, d2t, t2d, out, dtype="float32")
    rcfg, rparams, rd2t, rt2d = read_draft(out)
    assert rcfg.to_dict() | {"source": None} == dcfg.to_dict() | {"source": None}
    jax.tree.map(np.testing.assert_array_equal, rparams, jax.tree.map(np.asarray, dparams))
    np.testing.assert_array_equal(rd2t, d2t)
    np.testing.assert_array_equal(rt2d, t2d)

    convert(target_dir, pair, draft_dir=out, dtype="float32", progress=False)
    engine = Engine.load(pair, dtype="float32")
    assert engine.cfg == cfg and engine.draft.aux_ids == spec_pair.AUX_IDS

    # Reference: the original params through the same path (aux states, then draft_extend_logits),
    # placed like the loaded arrays and with the loaded (equal) configs, so one compilation serves both.
    def like(tree, ref):
        return jax.tree.map(lambda x, r: jax.device_put(np.asarray(x, r.dtype), r.sharding), tree, ref)

    original = Engine(engine.cfg, like(stack_layers(cfg, params), engine.params), None, "float32")
    original.draft = spec.Draft(
        like(dparams, engine.draft.params), like(d2t, engine.draft.d2t), engine.draft.cfg, engine.draft.aux_ids
    )
    ids = np.random.default_rng(5).integers(0, 64, size=17).tolist()
    np.testing.assert_allclose(engine.draft_logits(ids), original.draft_logits(ids), rtol=1e-5, atol=1e-5)


def test_draft_export_loads_in_specforge(tmp_path):
    eagle = pytest.importorskip("specforge.modeling.draft.llama3_eagle")
    dcfg, dparams, d2t, t2d = random_draft(seed=8)
    export_draft(dcfg, dparams, d2t, t2d, str(tmp_path), dtype="float32")
    model, info = eagle.LlamaForCausalLMEagle3.from_pretrained(
        str(tmp_path), dtype=torch.float32, output_loading_info=True
    )
    # Only the embedding is absent: EAGLE-3 drafts take it from the target.
    assert info["missing_keys"] == {"embed_tokens.weight"} and not info["unexpected_keys"]
    np.testing.assert_array_equal(model.fc.weight.detach().numpy(), dparams["fc"]["kernel"].T)
    np.testing.assert_array_equal(
        model.midlayer.self_attn.o_proj.weight.detach().numpy(), dparams["midlayer"]["self_attn"]["o_proj"]["kernel"].T
    )
    np.testing.assert_array_equal(model.d2t.numpy(), d2t)
    np.testing.assert_array_equal(model.t2d.numpy(), t2d)


def test_interrupted_export_leaves_only_a_partial_directory(plain, tmp_path, monkeypatch):
    cfg, params, _ = plain
    out = str(tmp_path / "hf")
    calls = []

    def failing_write(file, tensors, metadata=None):
        calls.append(file)
        if len(calls) == 2:
            raise OSError("disk full")
        real_write(file, tensors, metadata)

    real_write = export.write_safetensors
    monkeypatch.setattr(export, "write_safetensors", failing_write)
    with pytest.raises(OSError, match="disk full"):
        export_target(cfg, params, out, shard_bytes=16 * 1024)
    assert not os.path.exists(out)
    assert not os.path.exists(os.path.join(out + ".partial", "config.json"))  # never looks loadable
    with pytest.raises(FileNotFoundError, match="config.json"):
        convert(out + ".partial", str(tmp_path / "ck"), progress=False)

    monkeypatch.setattr(export, "write_safetensors", real_write)
    export_target(cfg, params, out, shard_bytes=16 * 1024)  # a rerun replaces the stale partial
    assert not os.path.exists(out + ".partial")
    assert os.path.exists(os.path.join(out, "config.json"))


def test_export_into_existing_directory_replaces_only_export_files(tmp_path):
    dcfg, dparams, d2t, t2d = random_draft(seed=6)
    out = tmp_path / "draft"
    (out / "train_state").mkdir(parents=True)
    (out / "train_state" / "state.npz").write_bytes(b"keep me")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
    (out / "config.json").write_text("{}")
    (tmp_path / "draft.partial").mkdir()
    (tmp_path / "draft.partial" / "junk").write_text("left by a killed export")

    export_draft(dcfg, dparams, d2t, t2d, str(out), dtype="float32")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "train_state"]
    assert (out / "train_state" / "state.npz").read_bytes() == b"keep me"
    assert not (tmp_path / "draft.partial").exists()
    assert read_draft(str(out))[0].draft_vocab_size == 56


def test_bad_inputs_are_named(plain, tmp_path):
    cfg, params, _ = plain
    with pytest.raises(ValueError, match="dtype 'fp8'"):
        export_target(cfg, params, str(tmp_path / "a"), dtype="fp8")
    wrong = dict(params, final_norm={"scale": jnp.ones(3)})
    with pytest.raises(ValueError, match=r"final_norm/scale has shape \(3,\), expected \(64,\)"):
        export_target(cfg, wrong, str(tmp_path / "b"))
    with pytest.raises(FileNotFoundError, match="tiktoken.model"):
        export_target(cfg, params, str(tmp_path / "c"), tokenizer_dir=str(tmp_path))
    dcfg, dparams, d2t, t2d = random_draft(seed=7)
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        export_draft(dcfg, dparams, d2t, np.roll(t2d, 1), str(tmp_path / "d"))
