"""Compile time of the generation programs against model depth.

    python scripts/compile_time.py                          # small width, 4 / 16 / 61 layers, CPU
    python scripts/compile_time.py --preset kimi-k2.5 --layers 61 --programs spec

For each depth it builds a target of that many layers with random weights (the
built-in demo target's width unless --preset) and an EAGLE-3 draft of matching
width, then times `lower(...).compile()` of four programs: `jaxspec.loop.start` and
`jaxspec.loop.run_loop` of plain decoding (`decode.Plain`: the prefill, the decode loop)
and of speculative decoding (`spec.Speculative`: the prefill with the draft extend,
the loop of cycles). Nothing is executed; times are wall seconds of one compilation
each (no persistent cache).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxspec import decode, loop  # noqa: E402
from jaxspec import spec as S  # noqa: E402
from jaxspec.config import ModelConfig, preset  # noqa: E402
from jaxspec.draft import DraftConfig, init_draft_cache  # noqa: E402
from jaxspec.draft import init_params as draft_init  # noqa: E402
from jaxspec.model import Transformer, init_cache, init_params  # noqa: E402
from jaxspec.sampling import SamplingParams  # noqa: E402

SMALL = dict(
    vocab_size=4352,
    hidden_size=256,
    num_heads=4,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    intermediate_size=768,
    moe_intermediate_size=256,
    num_experts=16,
    num_experts_per_tok=2,
    num_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.0,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    max_position_embeddings=4096,
)


def build(layers: int, preset_name: str | None, dtype):
    if preset_name:
        cfg = preset(preset_name, num_layers=layers, max_position_embeddings=1 << 20)
    else:
        cfg = ModelConfig(num_layers=layers, **SMALL)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), dtype))
    D = cfg.hidden_size
    dcfg = DraftConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "hidden_size": D,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": D // 4,
            "intermediate_size": 2 * D,
            "vocab_size": cfg.vocab_size,
            "draft_vocab_size": min(cfg.vocab_size, 32000),
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 1 << 20,
            "rope_theta": 10000.0,
            "num_hidden_layers": 1,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers - 2]},
        },
        source="draft",
    )
    dparams = jax.eval_shape(lambda: draft_init(dcfg, jax.random.key(1), dtype))
    d2t = jax.ShapeDtypeStruct((dcfg.draft_vocab_size,), jnp.int32)
    draft = S.Draft(dparams, d2t, dcfg, (0, layers // 2, layers - 2))
    return cfg, Transformer(cfg, dtype), params, draft, dcfg


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(layers: int, programs: list[str], preset_name: str | None, batch: int, prompt: int, max_new: int):
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    cfg, model, params, draft, dcfg = build(layers, preset_name, dtype)
    sp, key = SamplingParams(), jax.eval_shape(lambda: jax.random.key(0))
    prompt_BP = jax.ShapeDtypeStruct((batch, prompt), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    stop = jax.ShapeDtypeStruct((1,), jnp.int32)
    steps = jax.ShapeDtypeStruct((), jnp.int32)
    out = {"layers": layers}
    if "plain" in programs:
        plain = decode.Plain(model, sp, max_new)
        cache = jax.eval_shape(lambda: init_cache(cfg, batch, plain.cache_length(prompt), dtype))
        out["plain_prefill_s"] = timed(
            lambda: loop.start.lower(plain, params, prompt_BP, lens, cache, key, stop).compile()
        )
        state = jax.eval_shape(plain.start, params, prompt_BP, lens, cache, key, stop)
        out["plain_loop_s"] = timed(lambda: loop.run_loop.lower(plain, params, state, stop, steps).compile())
    if "spec" in programs:
        speculative = S.Speculative(model, sp, max_new, S.SpecConfig(3, 1, 4))
        S_t, S_d = speculative.cache_lengths(prompt)
        tcache = jax.eval_shape(lambda: init_cache(cfg, batch, S_t, dtype))
        dcache = jax.eval_shape(lambda: init_draft_cache(dcfg, batch, S_d, dtype))
        weights, caches = (params, draft), (tcache, dcache)
        out["spec_prefill_s"] = timed(
            lambda: loop.start.lower(speculative, weights, prompt_BP, lens, caches, key, stop).compile()
        )
        state = jax.eval_shape(speculative.start, weights, prompt_BP, lens, caches, key, stop)
        out["spec_loop_s"] = timed(lambda: loop.run_loop.lower(speculative, weights, state, stop, steps).compile())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[4, 16, 61])
    p.add_argument("--programs", nargs="+", default=["plain", "spec"], choices=["plain", "spec"])
    p.add_argument("--preset", help="a config preset (e.g. kimi-k2.5) instead of the small demo width")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    for n in args.layers:
        rows.append(measure(n, args.programs, args.preset, args.batch, args.prompt, args.max_new))
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    keys = [k for k in rows[0] if k != "layers"]
    print(f"\n{'layers':>6} " + " ".join(f"{k:>15}" for k in keys))
    for r in rows:
        print(f"{r['layers']:>6} " + " ".join(f"{r[k]:>15.2f}" for k in keys))
    if len(rows) > 1:
        print("deepest / shallowest: " + " ".join(f"{k} {rows[-1][k] / rows[0][k]:.2f}x" for k in keys))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
