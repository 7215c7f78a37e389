"""The target's and the draft's config.json parsing read RoPE by one rule: the one transformers applies.

transformers' own config classes (DeepseekV3Config for the target, LlamaConfig for the
SpecForge draft) are the reference: for a config holding `rope_scaling`, `rope_parameters`,
both, or neither, jaxspec must pick the same dict, RoPE type, factor and rope_theta.
"""

from __future__ import annotations

import json
import warnings

import hf_models
import pytest
import transformers

from jaxspec.config import ConfigError, DraftConfig, from_hf_dict, rope_settings

THETA = 7000.0  # top-level rope_theta
YARN = {  # target RoPE in `rope_scaling` (legacy `type` key, as Kimi-K2.5 and DeepSeek-V3 write it)
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
LLAMA3 = {  # draft RoPE in `rope_scaling`, as SpecForge configs write it
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# What transformers 5 writes: `rope_parameters`, with its own rope_theta.
TARGET_PARAMETERS = {"rope_type": "default", "rope_theta": 5000.0}
DRAFT_PARAMETERS = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}

CASES = {
    "both": lambda scaling, params: {"rope_scaling": scaling, "rope_parameters": params},
    "scaling-only": lambda scaling, params: {"rope_scaling": scaling},
    "parameters-only": lambda scaling, params: {"rope_parameters": params},
    "scaling-with-theta": lambda scaling, params: {"rope_scaling": dict(scaling, rope_theta=3000.0)},
    "null-scaling": lambda scaling, params: {"rope_scaling": None, "rope_parameters": params},
    "neither": lambda scaling, params: {},
}


def _target_dict(rope: dict) -> dict:
    cfg = dict(hf_models.BASE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    return dict(cfg, rope_theta=THETA, **rope)


def _draft_dict(rope: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "vocab_size": 300,
        "draft_vocab_size": 120,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": THETA,
        **rope,
    }


def _reference(config_cls, cfg: dict) -> dict:
    """transformers' resolved RoPE dict for the config (deep-copied: it edits the dicts it is given)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config_cls(**json.loads(json.dumps(cfg))).rope_parameters


@pytest.mark.parametrize("case", CASES)
def test_target_rope_matches_transformers(case):
    cfg = _target_dict(CASES[case](YARN, TARGET_PARAMETERS))
    ref = _reference(transformers.DeepseekV3Config, cfg)
    ours = from_hf_dict(cfg)
    assert ours.rope_theta == ref["rope_theta"]
    assert ours.yarn == (ref["rope_type"] == "yarn")
    if ours.yarn:
        assert ours.rope_factor == ref["factor"]
        assert ours.rope_original_max_position == ref["original_max_position_embeddings"]


@pytest.mark.parametrize("case", CASES)
def test_draft_rope_matches_transformers(case):
    cfg = _draft_dict(CASES[case](LLAMA3, DRAFT_PARAMETERS))
    ref = _reference(transformers.LlamaConfig, cfg)
    ours = DraftConfig.from_hf(cfg)
    assert (ours.rope_type, ours.rope_theta) == (ref["rope_type"], ref["rope_theta"])
    if ours.rope_type != "default":
        assert ours.rope_factor == ref["factor"]
    if ours.rope_type == "llama3":
        assert ours.rope_original_max_position == ref["original_max_position_embeddings"]


@pytest.mark.parametrize("case", CASES)
def test_target_and_draft_pick_the_same_rope_dict(case):
    """The same two dicts in a target and a draft config: both parsers take them from the same key."""
    target, draft = (
        _target_dict(CASES[case](YARN, TARGET_PARAMETERS)),
        _draft_dict(CASES[case](LLAMA3, DRAFT_PARAMETERS)),
    )
    t, d = rope_settings(target, "target"), rope_settings(draft, "draft")
    assert t.field == d.field
    assert from_hf_dict(target).rope_theta == t.theta and DraftConfig.from_hf(draft).rope_theta == d.theta
    if case == "both":  # rope_scaling wins, and rope_parameters' own rope_theta goes with it
        assert t.field == "rope_scaling" and (t.theta, d.theta) == (THETA, THETA)
        assert from_hf_dict(target).yarn and DraftConfig.from_hf(draft).rope_type == "llama3"


def test_rope_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"c.json: field 'rope_scaling' must be an object or null, found 'yarn'"):
        rope_settings({"rope_scaling": "yarn"}, "c.json")
    with pytest.raises(ConfigError, match=r"c.json: field 'rope_theta' must be a positive number, found -1"):
        rope_settings({"rope_theta": -1}, "c.json")
    with pytest.raises(ConfigError, match=r"c.json: field 'rope_parameters.rope_type' is missing"):
        rope_settings({"rope_parameters": {"factor": 2.0}}, "c.json")
    with pytest.raises(ConfigError, match=r"rope_scaling: rope type 'llama3' is not supported"):
        from_hf_dict(_target_dict({"rope_scaling": LLAMA3}))
    with pytest.raises(NotImplementedError, match=r"field 'rope_scaling.rope_type' = 'yarn' is not supported"):
        DraftConfig.from_hf(_draft_dict({"rope_scaling": YARN}))
