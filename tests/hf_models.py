"""Tiny random Hugging Face DeepseekV3 models used as references (CPU torch, fp32)."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    rope_interleave=True,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

# Configurations the model must match transformers on.
VARIANTS = {
    "groups": dict(n_group=4, topk_group=2, n_routed_experts=8, num_experts_per_tok=2),
    "dense0_noq": dict(first_k_dense_replace=0, q_lora_rank=None, norm_topk_prob=False),
    "dense2": dict(first_k_dense_replace=2, rope_interleave=False),
    "yarn": dict(
        rope_scaling={
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.7,
        },
        rope_theta=5000.0,
    ),
    "tied": dict(tie_word_embeddings=True),
}


def make_config(**overrides):
    from transformers import DeepseekV3Config

    kw = dict(BASE)
    kw.update(overrides)
    rope = kw.pop("rope_scaling", None)
    theta = kw.pop("rope_theta", 10000.0)
    params = {"rope_type": "default", "rope_theta": theta}
    if rope:
        params = dict(rope, rope_theta=theta)
    return DeepseekV3Config(rope_parameters=params, **kw)


def randomize(model, seed: int = 0):
    """Give every parameter (norms and router bias included) non-trivial random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if p.ndim > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(fan_in))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


def build(out_dir: str, seed: int = 0, **overrides):
    """Save a random DeepseekV3ForCausalLM to out_dir; returns the torch model (eval, fp32)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = make_config(**overrides)
    model = randomize(DeepseekV3ForCausalLM(cfg).float().eval(), seed)
    model.save_pretrained(out_dir)
    return model


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_hidden_states(model, ids) -> list[np.ndarray]:
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return [h[0].float().numpy() for h in out.hidden_states]


def wrap_as_kimi(hf_dir: str) -> None:
    """Rewrite a saved DeepseekV3 checkpoint in Kimi-K2.5's multimodal layout, in place.

    config.json becomes a wrapper with text_config; tensors get the `language_model.`
    prefix and two vision tensors are added, which the converter must skip.
    """
    from checkpoints_convert.safetensors_io import read_header, write_safetensors

    with open(os.path.join(hf_dir, "config.json")) as f:
        text = json.load(f)
    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {"hidden_size": 8},
    }
    if "quantization_config" in text:
        wrapper["quantization_config"] = text.pop("quantization_config")
    file = os.path.join(hf_dir, "model.safetensors")
    tensors = {"language_model." + r.name: np.array(r.load()) for r in read_header(file)}
    tensors["vision_tower.patch_embed.weight"] = np.ones((4, 4), np.float32)
    tensors["mm_projector.proj.0.weight"] = np.ones((8, 4), np.float32)
    write_safetensors(file, tensors)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(wrapper, f)
