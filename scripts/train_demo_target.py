"""Train the built-in demo target: the Kimi-K2.5 architecture at small size, on Python stdlib source.

    python scripts/build_demo_corpus.py --out data/                      # corpus + tokenizer
    python scripts/train_demo_target.py --data data/ --out run/ --steps 2000 [--resume]
    python scripts/train_demo_target.py --data data/ --out run/ --export jaxspec/demo/target --steps 0 --resume

Same model code as the real Kimi-K2.5 (MLA with q_lora and kv_lora, YaRN, a dense
first layer, sigmoid noaux_tc routed experts with a shared expert). Seeded and
resumable: the state (params, optimizer, step) is saved every --save-every steps
under OUT/state, and batch b is drawn from an RNG seeded by (seed, b), so a
resumed run sees the same data as an uninterrupted one. Held-out loss is
reported at the end and written to OUT/metrics.json. `--export DIR` writes the
trained model as a Kimi-K2.5-layout Hugging Face checkpoint with INT4 experts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tqdm import tqdm

from jaxspec import training
from jaxspec.config import ModelConfig
from jaxspec.model import Transformer, init_params

SIZES = {
    # every Kimi-K2.5 feature; "base" (~13M parameters) is meant for a GPU, "small" (~3M) trains on a CPU
    "base": dict(
        hidden_size=256,
        num_layers=4,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=768,
        moe_intermediate_size=256,
        num_experts=16,
    ),
    "small": dict(
        hidden_size=128,
        num_layers=3,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=384,
        moe_intermediate_size=128,
        num_experts=8,
    ),
}


def demo_config(vocab_size: int, size: str = "base") -> ModelConfig:
    """The demo target: MLA with q_lora/kv_lora, YaRN, a dense first layer, sigmoid routing, shared expert."""
    return ModelConfig(
        vocab_size=vocab_size,
        num_heads=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.0,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        rope_interleave=True,
        rope_factor=4.0,
        rope_original_max_position=1024,
        rope_beta_fast=32.0,
        rope_beta_slow=1.0,
        rope_mscale=1.0,
        rope_mscale_all_dim=1.0,
        max_position_embeddings=4096,
        expert_format=None,
        **SIZES[size],
    )


def windows(tokens: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    start = rng.integers(0, len(tokens) - length, size=batch)
    return np.stack([tokens[s : s + length] for s in start]).astype(np.int32)


def heldout_loss(model, params, tokens, length, n_batches=8, batch=16) -> float:
    rng = np.random.default_rng(1234)  # fixed windows: comparable across runs
    loss = jax.jit(lambda p, x: training.lm_loss(model, p, x))
    return float(np.mean([loss(params, jnp.asarray(windows(tokens, batch, length, rng))) for _ in range(n_batches)]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="output of scripts/build_demo_corpus.py")
    p.add_argument("--out", required=True)
    p.add_argument("--size", choices=sorted(SIZES), default="base")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--resume", action="store_true")
    p.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        help="fix the step count (at most --steps) so training takes about this long, compile included; "
        "the count is measured after 20 steps and recorded, so the schedule still anneals",
    )
    p.add_argument("--export", help="write the trained target as a Hugging Face checkpoint here")
    p.add_argument("--shard-mb", type=float, default=4.0, help="safetensors shard size of the export (MiB)")
    args = p.parse_args(argv)

    with open(os.path.join(args.data, "corpus.json")) as f:
        manifest = json.load(f)
    from jaxspec.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_dir(args.data)
    cfg = demo_config(tok.vocab_size, args.size).replace(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    train = np.load(os.path.join(args.data, "train.npy"))
    heldout = np.load(os.path.join(args.data, "heldout.npy"))
    model = Transformer(cfg)
    params = init_params(cfg, jax.random.key(args.seed))
    state = {
        "params": params,
        "opt": training.make_optimizer().init(params),
        "step": jnp.zeros((), jnp.int32),
        "total": jnp.asarray(args.steps, jnp.int32),
    }
    ckpt = ocp.StandardCheckpointer()
    state_dir = os.path.abspath(os.path.join(args.out, "state"))
    budget = None
    if args.resume and os.path.exists(state_dir):
        if args.time_budget:
            print(
                "error: --time-budget applies to a fresh run; a resumed run keeps the saved run's total steps",
                file=sys.stderr,
            )
            return 2
        state = ckpt.restore(state_dir, state)
        print(f"resumed at step {int(state['step'])} of {int(state['total'])}", file=sys.stderr)
    elif args.time_budget:
        budget = training.StepBudget(args.time_budget, args.steps)
    total = int(state["total"])
    loss_fn = training.LMLoss(model)

    t0, i = time.time(), int(state["step"])
    with tqdm(initial=i, total=total, desc="target") as bar:
        while i < total:
            batch = windows(train, args.batch, args.seq_len, np.random.default_rng([args.seed, i]))
            lr = training.lr_at(i, args.lr, total)
            state["params"], state["opt"], loss, _ = training.train_step(
                loss_fn, state["params"], state["opt"], lr, jnp.asarray(batch)
            )
            i += 1
            state["step"] = jnp.asarray(i, jnp.int32)
            bar.update(1)
            if i % 10 == 0:
                bar.set_postfix(loss=f"{float(loss):.3f}")
            if budget is not None and budget.update(i, loss) != total:
                total = budget.total
                state["total"] = jnp.asarray(total, jnp.int32)
                bar.total = total
                bar.refresh()
            if i % args.save_every == 0 or i == total:
                ckpt.save(state_dir, state, force=True)
                ckpt.wait_until_finished()
    params = state["params"]
    metrics = {
        "steps": int(state["step"]),
        "tokens_per_step": args.batch * args.seq_len,
        "heldout_loss": heldout_loss(model, params, heldout, args.seq_len),
        "train_seconds_this_run": round(time.time() - t0, 1),
        "device": jax.devices()[0].device_kind,
        "python_corpus": manifest.get("python_version"),
        "config": {"size": args.size, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(json.dumps(metrics, indent=2))
    if args.export:
        from checkpoints_convert.export import export_target

        export_target(
            cfg,
            jax.device_get(params),
            args.export,
            int4_experts=True,
            kimi_wrapper=True,
            tokenizer_dir=args.data,
            shard_bytes=int(args.shard_mb * 2**20),
        )
        print(f"exported to {args.export}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
