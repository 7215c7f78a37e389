"""Plain decode step of transformers' DeepseekV3ForCausalLM at Kimi-K2.5 width, few layers (the peer).

    python scripts/bench_hf_decode.py --layers 3 --batch 1 8          # CUDA torch + transformers

The reference for issue 12's "plain decode >= 4x HF" goal: the same geometry as
`scripts/bench_decode.py --layers N` (the preset's widths, first_k_dense_replace dense layers,
then MoE layers with all 384 routed experts), random bf16 weights, the routed experts through
transformers' `grouped_mm` experts implementation where the installed version has it. A prompt
of `--context` tokens is prefilled, then `--steps` single-token steps run on the KV cache
(`use_cache`, eager PyTorch, greedy next token); ms/step is the median of `--reps` timed runs,
each timed with CUDA events around all the steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def hf_config(layers: int, preset_name: str, experts_impl: str):
    from transformers import DeepseekV3Config

    from jaxspec.config import preset

    c = preset(preset_name)
    rope = {
        "rope_type": "yarn",
        "rope_theta": c.rope_theta,
        "factor": c.rope_factor,
        "original_max_position_embeddings": c.rope_original_max_position,
        "beta_fast": c.rope_beta_fast,
        "beta_slow": c.rope_beta_slow,
        "mscale": c.rope_mscale,
        "mscale_all_dim": c.rope_mscale_all_dim,
    }
    kw = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_heads,
        n_routed_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        n_shared_experts=c.num_shared_experts,
        n_group=c.n_group,
        topk_group=c.topk_group,
        first_k_dense_replace=c.first_k_dense_replace,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        routed_scaling_factor=c.routed_scaling_factor,
        norm_topk_prob=c.norm_topk_prob,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        rope_interleave=c.rope_interleave,
        tie_word_embeddings=False,
    )
    try:
        return DeepseekV3Config(rope_parameters=rope, experts_implementation=experts_impl, **kw)
    except TypeError:  # an older transformers: rope_scaling, no experts implementations
        rope = dict(rope)
        theta = rope.pop("rope_theta")
        return DeepseekV3Config(rope_scaling=rope, rope_theta=theta, **kw)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--preset", default="kimi-k2.5")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=64, help="prompt tokens prefilled before the timed steps")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--experts-impl", default="grouped_mm", help="transformers experts implementation")
    p.add_argument("--json")
    args = p.parse_args(argv)

    import torch
    import transformers
    from transformers import DeepseekV3ForCausalLM

    if not torch.cuda.is_available():
        print("bench_hf_decode: needs a CUDA torch", file=sys.stderr)
        return 2
    cfg = hf_config(args.layers, args.preset, args.experts_impl)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    used = getattr(model.config, "_experts_implementation", None)
    if used != args.experts_impl and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(args.experts_impl)
        used = model.config._experts_implementation
    gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}; "
        f"{args.layers} layers, {gib:.1f} GiB of bf16 weights, experts implementation {used}"
    )
    rows = []
    for B in args.batch:
        g = torch.Generator(device="cuda").manual_seed(B)
        prompt = torch.randint(0, cfg.vocab_size, (B, args.context), device="cuda", generator=g)
        times = []
        with torch.inference_mode():
            for rep in range(args.reps + 1):  # the first run warms up
                out = model(input_ids=prompt, use_cache=True)
                cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(args.steps):
                    out = model(input_ids=tok, past_key_values=cache, use_cache=True)
                    cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
                stop.record()
                torch.cuda.synchronize()
                if rep:
                    times.append(start.elapsed_time(stop) / args.steps)
        ms = statistics.median(times)
        rows.append({"batch": B, "ms_per_step": ms, "tok_s": B * 1000 / ms, "runs_ms": times})
        print(f"batch {B}: {ms:.3f} ms/step ({B * 1000 / ms:.1f} tok/s), runs {[round(t, 3) for t in times]}")
    print(f"{'batch':>5} {'HF ms/step':>10} {'tok/s':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['ms_per_step']:>10.3f} {r['tok_s']:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "experts_implementation": used, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
