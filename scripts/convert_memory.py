"""Measure the converter's peak host memory on a multi-GB synthetic checkpoint.

Builds a DeepseekV3-shaped Hugging Face checkpoint of about --size-gb on disk
(random bf16 tensors, or INT4 pack-quantized routed experts with --int4),
written shard by shard so this process never holds more than one shard, then
runs `python -m checkpoints_convert --quiet` in a child process and reports
the checkpoint size, the conversion time and the child's peak resident memory,
next to the largest stacked leaf (the unit the converter is meant to buffer).

    python scripts/convert_memory.py                    # ~3 GB, bf16 experts
    python scripts/convert_memory.py --size-gb 6 --int4
    python scripts/convert_memory.py --workdir /mnt/scratch --keep

The converter is expected to hold a few stacked leaves at a time; a peak above
3x the largest leaf plus ~1 GB of Python/JAX baseline is flagged.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import ml_dtypes
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from checkpoints_convert.safetensors_io import write_safetensors  # noqa: E402 (after the path setup)

GB = 1e9

# Everything but the routed-expert count and the layer count is fixed; those two set the size.
SHAPE = {
    "vocab_size": 32768,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "moe_intermediate_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
MAX_EXPERTS = 256

INT4_CONFIG = {
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
            },
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|down)_proj.*",
        "re:.*mlp\\.gate$",
    ],
}


# ---------------------------------------------------------------------------
# Synthetic checkpoint


def hf_config(num_experts: int, num_layers: int, int4: bool) -> dict:
    cfg = dict(
        SHAPE,
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        hidden_act="silu",
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_routed_experts=num_experts,
        num_hidden_layers=num_layers,
        rope_theta=10000.0,
        torch_dtype="bfloat16",
    )
    if int4:
        cfg["quantization_config"] = INT4_CONFIG
    return cfg


def tensor_specs(cfg: dict, int4: bool):
    """(name, shape, kind) for every tensor, layer by layer, names sorted within a layer as HF saves them."""
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    H, F, Fm = cfg["num_attention_heads"], cfg["intermediate_size"], cfg["moe_intermediate_size"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    yield "model.embed_tokens.weight", (V, D), "bf16"
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = [
            (p + "input_layernorm.weight", (D,), "norm"),
            (p + "post_attention_layernorm.weight", (D,), "norm"),
            (p + "self_attn.q_a_proj.weight", (cfg["q_lora_rank"], D), "bf16"),
            (p + "self_attn.q_a_layernorm.weight", (cfg["q_lora_rank"],), "norm"),
            (p + "self_attn.q_b_proj.weight", (H * qk, cfg["q_lora_rank"]), "bf16"),
            (p + "self_attn.kv_a_proj_with_mqa.weight", (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], D), "bf16"),
            (p + "self_attn.kv_a_layernorm.weight", (cfg["kv_lora_rank"],), "norm"),
            (
                p + "self_attn.kv_b_proj.weight",
                (H * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]),
                "bf16",
            ),
            (p + "self_attn.o_proj.weight", (D, H * cfg["v_head_dim"]), "bf16"),
        ]
        if i < cfg["first_k_dense_replace"]:
            layer += [
                (p + f"mlp.{proj}_proj.weight", shape, "bf16")
                for proj, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F)))
            ]
        else:
            E = cfg["n_routed_experts"]
            layer += [(p + "mlp.gate.weight", (E, D), "bf16"), (p + "mlp.gate.e_score_correction_bias", (E,), "f32")]
            Fs = Fm * cfg["n_shared_experts"]
            layer += [
                (p + f"mlp.shared_experts.{proj}_proj.weight", shape, "bf16")
                for proj, shape in (("gate", (Fs, D)), ("up", (Fs, D)), ("down", (D, Fs)))
            ]
            for e in range(E):
                for proj, (o, n) in (("gate", (Fm, D)), ("up", (Fm, D)), ("down", (D, Fm))):
                    base = p + f"mlp.experts.{e}.{proj}_proj."
                    if int4:
                        layer += [
                            (base + "weight_packed", (o, n // 8), "packed"),
                            (base + "weight_scale", (o, n // 32), "scale"),
                            (base + "weight_shape", (2,), ("shape", (o, n))),
                        ]
                    else:
                        layer.append((base + "weight", (o, n), "bf16"))
        yield from sorted(layer)
    yield "model.norm.weight", (D,), "norm"
    yield "lm_head.weight", (V, D), "bf16"


def spec_nbytes(shape, kind) -> int:
    itemsize = {"bf16": 2, "norm": 2, "scale": 2, "f32": 4, "packed": 4}.get(kind, 8)
    return math.prod(shape) * itemsize


def plan(size_gb: float, int4: bool) -> tuple[int, int]:
    """(routed experts, layers) giving about size_gb: at least 2 MoE layers, at most MAX_EXPERTS experts."""

    def total(E, L):
        return sum(spec_nbytes(s, k) for _, s, k in tensor_specs(hf_config(E, L, int4), int4))

    moe_layers = 2
    while True:
        L = 1 + moe_layers
        fixed = total(8, L)
        per_expert = (total(16, L) - fixed) / 8
        E = max(8, round((8 + (size_gb * GB - fixed) / per_expert) / 8) * 8)
        if E <= MAX_EXPERTS:
            return E, L
        moe_layers += 1


class RandomPool:
    """Random values, drawn once, sliced at random offsets: fast enough to write GBs."""

    def __init__(self, seed: int = 0, size: int = 1 << 25):
        self.rng = np.random.default_rng(seed)
        normal = self.rng.standard_normal(size, dtype=np.float32)
        self.bf16 = (0.02 * normal).astype(ml_dtypes.bfloat16)
        self.words = self.rng.integers(-(2**31), 2**31, size=size, dtype=np.int64).astype(np.int32)

    def take(self, pool: np.ndarray, shape) -> np.ndarray:
        n = math.prod(shape)
        out = np.empty(n, pool.dtype)
        filled, pos = 0, int(self.rng.integers(0, len(pool)))
        while filled < n:
            k = min(n - filled, len(pool) - pos)
            out[filled : filled + k] = pool[pos : pos + k]
            filled, pos = filled + k, 0
        return out.reshape(shape)

    def tensor(self, shape, kind) -> np.ndarray:
        if kind == "bf16":
            return self.take(self.bf16, shape)
        if kind == "norm":
            return (1.0 + self.take(self.bf16, shape).astype(np.float32)).astype(ml_dtypes.bfloat16)
        if kind == "f32":
            return self.take(self.bf16, shape).astype(np.float32)
        if kind == "packed":
            return self.take(self.words, shape)
        if kind == "scale":
            return (np.abs(self.take(self.bf16, shape).astype(np.float32)) / 7.5 + 1e-4).astype(ml_dtypes.bfloat16)
        return np.array(kind[1], np.int64)  # weight_shape


def write_checkpoint(hf_dir: str, size_gb: float, int4: bool, shard_gb: float) -> dict:
    E, L = plan(size_gb, int4)
    cfg = hf_config(E, L, int4)
    os.makedirs(hf_dir, exist_ok=True)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    pool = RandomPool()
    specs = list(tensor_specs(cfg, int4))
    groups, current, current_bytes = [], [], 0
    for spec in specs:
        nbytes = spec_nbytes(spec[1], spec[2])
        if current and current_bytes + nbytes > shard_gb * GB:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(spec)
        current_bytes += nbytes
    groups.append(current)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: pool.tensor(shape, kind) for name, shape, kind in group}
        write_safetensors(os.path.join(hf_dir, file), tensors)
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({name: file for name in tensors})
        del tensors
        print(f"\r  wrote shard {i + 1}/{len(groups)}", end="", flush=True)
    print()
    with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return {"experts": E, "layers": L, "shards": len(groups), "bytes": total, "tensors": len(specs)}


def largest_leaf(hf_dir: str, dtype: str):
    """(path, shape, dtype, bytes) of the largest converted leaf, from the model's abstract parameters."""
    from jaxspec.checkpoint import flatten
    from jaxspec.config import load_hf_config
    from jaxspec.dtypes import DTYPES
    from jaxspec.model import abstract_params, per_layer

    cfg = load_hf_config(hf_dir)
    shapes, _ = abstract_params(cfg, DTYPES[dtype])
    # the converted leaves: one per layer, an Int4Weight as its two arrays
    path, spec = max(flatten(per_layer(cfg, shapes)).items(), key=lambda kv: kv[1].size * kv[1].dtype.itemsize)
    return "/".join(path), tuple(spec.shape), str(spec.dtype), spec.size * spec.dtype.itemsize


# ---------------------------------------------------------------------------
# Measuring a child process

# What the converter holds before it reads a tensor: interpreter, JAX, orbax, the abstract parameter tree.
BASELINE = (
    "import sys, checkpoints_convert.convert; from jaxspec.config import load_hf_config; "
    "from jaxspec.model import abstract_params; abstract_params(load_hf_config(sys.argv[1]))"
)


_STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in _STATUS_FIELDS:
                    out[key] = int(rest.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return out


def run_measured(cmd: list[str], poll_s: float = 0.02, env: dict | None = None) -> dict:
    """Run `cmd`: wall time, exit code, peak RSS (the child's VmHWM) and peaks of anonymous / file-backed RSS.

    /proc/<pid>/status is polled: VmHWM is the kernel's own high-water mark, so only the last poll
    interval before exit can escape it. getrusage()'s ru_maxrss is not used: on Linux a child inherits
    the parent's peak RSS across fork + exec, so it would report this (large) generator process.
    """
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peaks = {k: 0 for k in _STATUS_FIELDS}
    captured: dict[str, str] = {}
    readers = [
        threading.Thread(target=lambda s=s, k=k: captured.__setitem__(k, s.read()), daemon=True)
        for s, k in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))
    ]
    for t in readers:
        t.start()
    while proc.poll() is None:
        for k, v in _status(proc.pid).items():
            peaks[k] = max(peaks[k], v)
        time.sleep(poll_s)
    for t in readers:
        t.join()
    return {
        "seconds": time.monotonic() - start,
        "returncode": proc.returncode,
        "max_rss": peaks["VmHWM"],
        "anon_peak": peaks["RssAnon"],
        "file_peak": peaks["RssFile"],
        **captured,
    }


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


# ---------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=3.0, help="approximate checkpoint size (default 3)")
    p.add_argument("--int4", action="store_true", help="INT4 pack-quantized routed experts + quantization_config")
    p.add_argument("--workdir", help="where to build the checkpoints (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the HF and converted checkpoints")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="converter --dtype")
    p.add_argument("--shard-gb", type=float, default=0.5, help="maximum shard size (default 0.5)")
    args = p.parse_args(argv)

    root = tempfile.mkdtemp(prefix="convert_memory_", dir=args.workdir)
    hf_dir, out_dir = os.path.join(root, "hf"), os.path.join(root, "jaxspec")
    try:
        print(f"building a ~{args.size_gb:g} GB checkpoint in {hf_dir}")
        t0 = time.monotonic()
        info = write_checkpoint(hf_dir, args.size_gb, args.int4, args.shard_gb)
        gen_s = time.monotonic() - t0
        leaf_path, leaf_shape, leaf_dtype, leaf_bytes = largest_leaf(hf_dir, args.dtype)

        baseline = run_measured([sys.executable, "-c", BASELINE, hf_dir])
        print("converting ...")
        conv = run_measured(
            [
                sys.executable,
                "-m",
                "checkpoints_convert",
                "--target",
                hf_dir,
                "--out",
                out_dir,
                "--dtype",
                args.dtype,
                "--quiet",
            ]
        )
        if conv["returncode"] != 0:
            print(conv["stderr"], file=sys.stderr)
            print(f"conversion failed with exit code {conv['returncode']}", file=sys.stderr)
            return 1
        out_bytes = dir_bytes(out_dir)

        budget = 3 * leaf_bytes + 1 * GB
        experts = "INT4 packed" if args.int4 else "bf16"
        rows = [
            (
                "checkpoint",
                (
                    f"{info['bytes'] / GB:.2f} GB, {info['shards']} shards, {info['tensors']} tensors "
                    f"({info['layers']} layers, {info['experts']} {experts} experts)"
                ),
            ),
            ("largest leaf", f"{leaf_bytes / GB:.2f} GB  {leaf_path} {list(leaf_shape)} {leaf_dtype}"),
            ("generate time", f"{gen_s:.1f} s"),
            (
                "convert time",
                (
                    f"{conv['seconds']:.1f} s ({info['bytes'] / GB / conv['seconds']:.2f} GB/s), "
                    f"output {out_bytes / GB:.2f} GB"
                ),
            ),
            ("peak RSS", f"{conv['max_rss'] / GB:.2f} GB = {conv['max_rss'] / leaf_bytes:.1f}x largest leaf"),
            ("  anon (polled)", f"{conv['anon_peak'] / GB:.2f} GB"),
            (
                "  file (polled)",
                (
                    f"{conv['file_peak'] / GB:.2f} GB (shared libraries + memory-mapped shard pages; "
                    f"baseline {baseline['file_peak'] / GB:.2f} GB)"
                ),
            ),
            ("baseline RSS", f"{baseline['max_rss'] / GB:.2f} GB (imports + abstract parameters, no tensors)"),
            ("budget", f"{budget / GB:.2f} GB (3x largest leaf + 1 GB)"),
        ]
        width = max(len(k) for k, _ in rows)
        print()
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
        if conv["max_rss"] > budget:
            print(f"\nWARNING: peak RSS {conv['max_rss'] / GB:.2f} GB exceeds the budget of {budget / GB:.2f} GB")
        return 0
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
