"""A tiny target and EAGLE-3 draft trained on a synthetic Markov corpus (CPU, ~half a minute).

Tokens 8..V-1 follow a fixed successor map with probability `p_main`, otherwise an
alternative successor; tokens 0..7 never occur (so the draft vocabulary is smaller
than the target's and d2t is not the identity). The target learns the transition
table; the draft, trained with training-time test on the target's aux states,
learns to predict the target's choices, so acceptance is genuinely high.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import spec, training
from jaxspec.config import ModelConfig
from jaxspec.draft import DraftConfig
from jaxspec.draft import init_params as draft_init
from jaxspec.engine import Engine
from jaxspec.model import Transformer, init_params

AUX_IDS = (0, 1, 1)


@dataclasses.dataclass
class Corpus:
    vocab: int
    p_main: float
    seed: int = 0

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)
        live = rng.permutation(np.arange(8, self.vocab))
        self.live = live
        self.succ = np.zeros(self.vocab, np.int64)
        self.alt = np.zeros(self.vocab, np.int64)
        self.succ[live] = np.roll(live, -1)
        self.alt[live] = np.roll(live, -3)
        self.rng = rng

    def sample(self, batch: int, length: int) -> np.ndarray:
        x = np.zeros((batch, length), np.int32)
        x[:, 0] = self.rng.choice(self.live, batch)
        for t in range(1, length):
            main = self.rng.random(batch) < self.p_main
            x[:, t] = np.where(main, self.succ[x[:, t - 1]], self.alt[x[:, t - 1]])
        return x

    def batches(self, batch: int = 16, length: int = 32):
        while True:
            yield self.sample(batch, length)


def target_config(vocab: int, num_heads: int = 4) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=64,
        num_layers=3,
        num_heads=num_heads,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        eos_token_id=None,
    )


def draft_config(vocab: int, draft_vocab: int, num_heads: int = 4, num_kv_heads: int = 2) -> DraftConfig:
    return DraftConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "hidden_size": 64,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "intermediate_size": 128,
            "vocab_size": vocab,
            "draft_vocab_size": draft_vocab,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 1024,
            "rope_theta": 10000.0,
            "num_hidden_layers": 1,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_IDS)},
        },
        source="test draft",
    )


def train_pair(
    vocab: int = 64,
    p_main: float = 1.0,
    target_steps: int = 150,
    draft_steps: int = 150,
    seed: int = 0,
    heads: int = 4,
    draft_heads: int = 4,
    draft_kv_heads: int = 2,
):
    """Returns (engine with draft attached, corpus, target params, draft params, d2t, t2d)."""
    corpus = Corpus(vocab, p_main, seed)
    cfg = target_config(vocab, heads)
    model = Transformer(cfg)
    params, _ = training.train_target(
        model, init_params(cfg, jax.random.key(seed)), corpus.batches(), target_steps, lr=1e-2
    )
    counts = np.bincount(corpus.sample(64, 32).ravel(), minlength=vocab)
    draft_vocab = vocab - 8
    d2t, t2d = training.vocab_map(counts, draft_vocab)
    dcfg = draft_config(vocab, draft_vocab, draft_heads, draft_kv_heads)
    dparams = draft_init(dcfg, jax.random.key(seed + 1))
    if draft_steps:
        dparams, _, _ = training.train_draft(
            model, params, dcfg, dparams, AUX_IDS, t2d, corpus.batches(), draft_steps, ttt_steps=3, lr=1e-2
        )
    engine = Engine(cfg, params, None, "float32")
    engine.draft = spec.Draft(dparams, jnp.asarray(d2t, jnp.int32), dcfg, AUX_IDS)
    return engine, corpus, params, dparams, d2t, t2d


def on_mesh(engine: Engine, num_devices: int, draft_placement: str = "replicated") -> Engine:
    """The same target and draft placed on a mesh of the first `num_devices` devices."""
    from jaxspec.engine import mesh_for
    from jaxspec.model import abstract_params
    from jaxspec.sharding import param_shardings, rules_for

    rules = rules_for(draft_placement)
    mesh = mesh_for(engine.cfg, engine.draft.cfg, rules, num_devices)
    _, specs = abstract_params(engine.cfg)
    params = jax.device_put(engine.params, param_shardings(specs, mesh, rules))
    placed = Engine(engine.cfg, params, engine.tokenizer, engine.dtype, mesh, rules=rules)
    d = engine.draft
    placed.draft = placed.attach_draft(d.params, d.d2t, d.cfg, d.aux_ids, draft_placement)
    return placed
