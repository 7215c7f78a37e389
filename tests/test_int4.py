"""INT4 routed experts end to end: compressed-tensors packs, we convert, load and run.

Every expert projection of a tiny DeepseekV3 checkpoint is quantized and packed by
the compressed-tensors library's own compressor (bf16 group scales, as Kimi-K2.5
ships). The converted experts stay INT4 on device; dequantised they must equal the
library's decompressed weights exactly, and the logits must match transformers
running the decompressed model.
"""

import json
import os
import re

import hf_models
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from test_quant import _library_int4

from checkpoints_convert.convert import convert
from checkpoints_convert.safetensors_io import read_header, write_safetensors
from jaxspec import quant
from jaxspec.engine import Engine
from jaxspec.model import per_layer

EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
QCONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "observer": "minmax",
            },
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
}


@pytest.fixture(scope="module")
def int4_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    plain, packed_dir, ref_dir, out = (str(root / n) for n in ("plain", "packed", "ref", "ck"))
    hf_models.build(plain, seed=11, n_group=2, topk_group=1)
    file = os.path.join(plain, "model.safetensors")
    packed, decompressed, library = {}, {}, {}
    for ref in read_header(file):
        w = np.array(ref.load())
        m = EXPERT.match(ref.name)
        if not m:
            packed[ref.name] = decompressed[ref.name] = w
            continue
        lib = _library_int4(torch.from_numpy(w), scale_dtype=torch.bfloat16)
        base = ref.name[: -len(".weight")]
        packed[base + ".weight_packed"] = lib["packed"]
        packed[base + ".weight_scale"] = lib["scale"]
        packed[base + ".weight_shape"] = np.array(w.shape, np.int32)
        decompressed[ref.name] = lib["weight"].astype(np.float32)
        library[(int(m[1]), int(m[2]), m[3])] = lib["weight"].astype(np.float32)
    with open(os.path.join(plain, "config.json")) as f:
        cfg = json.load(f)
    for d, tensors, extra in ((packed_dir, packed, {"quantization_config": QCONFIG}), (ref_dir, decompressed, {})):
        os.makedirs(d)
        write_safetensors(os.path.join(d, "model.safetensors"), tensors, {"format": "pt"})
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(dict(cfg, **extra), f)
    hf_models.wrap_as_kimi(packed_dir)  # Kimi layout: quantization_config at the top level
    from transformers import DeepseekV3ForCausalLM

    reference = DeepseekV3ForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    convert(packed_dir, out, dtype="float32", progress=False)
    return Engine.load(out, dtype="float32"), reference, library


def test_experts_stay_int4_and_dequantise_to_library_values(int4_pair):
    engine, _, library = int4_pair
    assert engine.cfg.expert_format is not None
    layers = per_layer(engine.cfg, engine.params)  # the stacked MoE layers, one by one
    for layer in range(engine.cfg.first_k_dense_replace, engine.cfg.num_layers):
        moe = layers[f"layers_{layer}"]["moe"]
        for proj in ("gate", "up", "down"):
            assert quant.is_int4(moe[proj]) and moe[proj].layout == quant.ROWS
            assert moe[proj].packed.dtype == jnp.int32  # INT4 words on device, not bf16
            assert moe[proj].group_size == engine.cfg.expert_format.group_size  # the config's group size
            ours = np.asarray(moe[proj].dequant(jnp.float32))
            for e in range(engine.cfg.num_experts):
                np.testing.assert_array_equal(
                    ours[e], library[(layer, e, proj)], err_msg=f"layer {layer} expert {e} {proj}"
                )


def test_int4_logits_match_decompressed_transformers(int4_pair):
    engine, reference, _ = int4_pair
    ids = np.random.default_rng(2).integers(0, engine.cfg.vocab_size, size=19).tolist()
    ours = engine.target_logits(ids)
    ref = hf_models.hf_logits(reference, ids)
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-4
    with torch.no_grad():
        ref_gen = reference.generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(ids) :].tolist()
    eos = engine.cfg.eos_token_id
    expect = ref_gen[: ref_gen.index(eos) + 1] if eos in ref_gen else ref_gen
    assert engine.generate([ids], 8)[0].tokens == expect


def test_long_prefill_runs_grouped_int4_experts_and_matches_transformers(int4_pair, monkeypatch):
    """A prefill with many (token, expert) assignments dequantizes each layer's experts once and
    runs grouped matmuls (instead of one INT4 read per assignment); greedy output is unchanged."""
    from jaxspec import model as model_mod

    engine, reference, _ = int4_pair
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, engine.cfg.vocab_size, size=n).tolist() for n in (24, 17)]
    assert model_mod.int4_grouped_wins(engine.cfg, 2 * 24, 1, 4)
    assert not model_mod.int4_grouped_wins(engine.cfg, 2, 1, 4)  # decode steps keep the gather path
    choose = lambda t: model_mod.choose_expert_impl(engine.cfg, engine.expert_layout, t, 1, jnp.float32)
    assert (choose(2 * 24), choose(2)) == ("xla", "gather")
    calls = []
    grouped = model_mod._expert_ffn_grouped
    monkeypatch.setattr(model_mod, "_expert_ffn_grouped", lambda *a: calls.append(a[-1]) or grouped(*a))
    ours = [r.tokens for r in engine.generate(prompts, 6)]
    assert calls and set(calls) == {"xla"}  # traced for the MoE layers of the prefill
    for ids, got in zip(prompts, ours):
        with torch.no_grad():
            ref = reference.generate(
                torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(ids) :].tolist()
        eos = engine.cfg.eos_token_id
        assert got == (ref[: ref.index(eos) + 1] if eos in ref else ref)
