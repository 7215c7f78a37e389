"""Collectives per generation phase, counted from the compiled program on an N-device mesh.

    # the built-in demo pair (or --model DIR) on 8 fake CPU devices:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python scripts/collectives.py
    # Kimi-K2.5 geometry, random (abstract) weights, 3 layers, compile only:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python scripts/collectives.py --kimi-layers 3 --num-devices 8

For each phase (plain decode step, verify, one draft tree, draft extend over the
accepted tokens, draft extend over a prompt, a whole speculative cycle) and each
draft placement it prints the count of all-reduce, all-gather, reduce-scatter,
all-to-all and collective-permute ops and the bytes they move per device, plus
the per-step draft bytes each device reads under each placement. Nothing is
executed: the Kimi geometry is never allocated (parameters are ShapeDtypeStructs
with their shardings).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxspec import collectives  # noqa: E402
from jaxspec.spec import SpecConfig  # noqa: E402


def kimi_engine(layers: int, num_devices: int | None, placement: str, dtype: str = "bfloat16"):
    """An Engine over abstract Kimi-K2.5 parameters (INT4 experts) and a Kimi-EAGLE-3-sized draft."""
    from jaxspec.config import preset
    from jaxspec.draft import DraftConfig
    from jaxspec.engine import Engine

    cfg = preset("kimi-k2.5", num_layers=layers, max_position_embeddings=1 << 20)
    dcfg = DraftConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "hidden_size": 7168,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 18432,
            "vocab_size": cfg.vocab_size,
            "draft_vocab_size": 32000,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 1 << 20,
            "rope_theta": 50000.0,
            "num_hidden_layers": 1,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers - 2]},
        },
        source="Kimi-sized draft",
    )
    return Engine.abstract(cfg, dcfg, dtype=dtype, num_devices=num_devices, draft_placement=placement)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="converted checkpoint with a draft (default: the built-in demo pair)")
    p.add_argument("--kimi-layers", type=int, help="instead: Kimi-K2.5 geometry with this many layers, abstract")
    p.add_argument("--num-devices", type=int, help="mesh size (default: the engine's choice)")
    p.add_argument("--placement", nargs="+", default=["replicated", "sharded"], choices=["replicated", "sharded"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--config", default="3,1,4", help="steps,topk,draft_tokens")
    p.add_argument("--json", help="write the tables here")
    args = p.parse_args(argv)
    spec = SpecConfig(*map(int, args.config.split(",")))
    results = {}
    for placement in args.placement:
        if args.kimi_layers:
            engine = kimi_engine(args.kimi_layers, args.num_devices, placement)
        else:
            from jaxspec import demo
            from jaxspec.engine import Engine

            path = args.model or demo.ensure_converted(log=lambda m: print(m, file=sys.stderr))
            engine = Engine.load(path, num_devices=args.num_devices, draft_placement=placement)
        table = collectives.phase_collectives(engine, batch=args.batch, spec=spec)
        n = engine.mesh.shape["model"] if engine.mesh is not None else 1
        layers = engine.cfg.num_layers
        draft_bytes = engine.draft_bytes_per_device()
        print(
            f"\n{placement} draft, {n} devices, {layers} target layers, batch {args.batch}, spec {args.config}; "
            f"draft weights read per draft step per device: {draft_bytes / 1e6:.1f} MB"
        )
        print(collectives.format_table(table))
        results[placement] = {"devices": n, "layers": layers, "draft_bytes_per_device": draft_bytes, "table": table}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
