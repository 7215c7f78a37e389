"""Measure peak host memory while loading a multi-GB INT4 checkpoint onto 8 fake CPU devices.

Builds a synthetic DeepseekV3-shaped Hugging Face checkpoint with INT4 routed experts
(`convert_memory.py`'s builder), converts it once, then loads it with
`Engine.load(DIR, num_devices=8)` in child processes (`XLA_FLAGS=--xla_force_host_
platform_device_count=8 JAX_PLATFORMS=cpu`), once per loading path:

    sharded   each leaf restored straight onto its sharding, shard by shard (the default)
    via-host  each leaf read whole into host memory, cast, then placed (the old path)

With fake CPU devices the device buffers live in host memory too, so the loaded
parameters themselves show up in RSS. What tells the paths apart is each leaf's
transient: the child resets the kernel's peak-RSS mark (VmHWM, via /proc/self/clear_refs)
before reading a leaf and reports that leaf's peak RSS minus RSS once it is placed (freed
heap handed back to the OS first). A path that assembles a leaf in host memory before
placing it needs at least that leaf on top; the sharded path should stay well below it.

Each path is measured twice: with glibc's default malloc, whose heap keeps freed
blocks of a few MB for reuse (so RSS also counts memory that is free but not yet
returned), and with `MALLOC_MMAP_THRESHOLD_=1048576`, which serves every block of
1 MiB or more from its own mapping and unmaps it on free, so RSS follows the live
host buffers.

    python scripts/load_memory.py                       # ~3 GB checkpoint, bfloat16 load
    python scripts/load_memory.py --size-gb 4 --dtype float32 --keep --workdir /mnt/scratch
    python scripts/load_memory.py --checkpoint DIR      # an existing converted checkpoint

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from convert_memory import GB, dir_bytes, run_measured, write_checkpoint  # noqa: E402 (after the path setup)

PATHS = ("sharded", "via-host")
MALLOC = {"default": {}, "mmap>=1MiB": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}}

# The child loads the checkpoint, measuring every leaf: the kernel's peak RSS mark (VmHWM) is reset just
# before the leaf is read, so `peak - after` is the host memory the leaf needed beyond what it leaves behind.
CHILD = r"""
import ctypes, gc, json, os, sys, time
import jax
import numpy as np
from jaxspec import checkpoint
from jaxspec.engine import Engine

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

def settle():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)

leaves = []

def measured(restore):
    def run(leaf_dir, spec, sharding, *args, **kwargs):
        settle()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = status("VmRSS")
        out = jax.block_until_ready(restore(leaf_dir, spec, sharding, *args, **kwargs))
        peak = status("VmHWM")
        settle()
        leaves.append({"leaf": os.path.basename(leaf_dir), "bytes": int(spec.size * np.dtype(spec.dtype).itemsize),
                       "path": restore.__name__, "before": before, "peak": peak, "after": status("VmRSS")})
        return out
    return run

path, dtype, mode, num_devices = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
checkpoint._restore_sharded = measured(checkpoint._restore_sharded)
checkpoint._restore_via_host = measured(checkpoint._restore_via_host)
if mode == "via-host":
    plain = checkpoint.load_leaves
    checkpoint.load_leaves = lambda *a, **k: plain(*a, **k, via_host=True)
jax.devices()
settle()
before = status("VmRSS")
t0 = time.perf_counter()
engine = Engine.load(path, dtype=dtype, num_devices=num_devices)
params = jax.block_until_ready(jax.tree.leaves(engine.params))
seconds = time.perf_counter() - t0
settle()
worst = max(leaves, key=lambda r: r["peak"] - r["after"])
largest = max(leaves, key=lambda r: r["bytes"])
print(json.dumps({"before": before, "after": status("VmRSS"), "seconds": seconds,
                  "device_bytes": sum(s.data.nbytes for x in params for s in x.addressable_shards),
                  "leaves": len(leaves), "paths": sorted({r["path"] for r in leaves}),
                  "worst": worst, "largest": largest}))
"""


def largest_leaf(ckpt: str, dtype: str):
    """(name, shape, dtype, bytes) of the checkpoint's largest leaf as loaded with `dtype`."""
    from jaxspec.checkpoint import flatten, read_config
    from jaxspec.config import from_dict
    from jaxspec.dtypes import DTYPES
    from jaxspec.model import abstract_params, per_layer

    cfg = from_dict(read_config(ckpt)["target"])
    shapes, _ = abstract_params(cfg, DTYPES[dtype])
    # the checkpoint's leaves: one per layer, an Int4Weight as its two arrays
    path, spec = max(flatten(per_layer(cfg, shapes)).items(), key=lambda kv: kv[1].size * kv[1].dtype.itemsize)
    return "/".join(path), tuple(spec.shape), str(spec.dtype), spec.size * spec.dtype.itemsize


def measure(ckpt: str, dtype: str, mode: str, num_devices: int, malloc: str) -> dict:
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **MALLOC[malloc],
    )
    run = run_measured([sys.executable, "-c", CHILD, ckpt, dtype, mode, str(num_devices)], env=env)
    if run["returncode"] != 0:
        raise RuntimeError(f"loading ({mode}) failed with exit code {run['returncode']}:\n{run['stderr'][-3000:]}")
    res = json.loads(run["stdout"].strip().splitlines()[-1])
    res["transient"] = res["worst"]["peak"] - res["worst"]["after"]
    res["largest_transient"] = res["largest"]["peak"] - res["largest"]["after"]
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=3.0, help="approximate checkpoint size (default 3)")
    p.add_argument("--checkpoint", help="measure this converted checkpoint instead of building one")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="dtype to load (the checkpoint is converted in bfloat16; float32 casts every float leaf)",
    )
    p.add_argument("--num-devices", type=int, default=8, help="fake CPU devices (default 8)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"loading paths to measure (default {','.join(PATHS)})")
    p.add_argument("--workdir", help="where to build the checkpoints (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the HF and converted checkpoints")
    args = p.parse_args(argv)
    paths = [m for m in args.paths.split(",") if m]
    for m in paths:
        if m not in PATHS:
            p.error(f"--paths: unknown path {m!r}, expected some of {', '.join(PATHS)}")

    root = None
    info = {}
    try:
        if args.checkpoint:
            ckpt = args.checkpoint
        else:
            root = tempfile.mkdtemp(prefix="load_memory_", dir=args.workdir)
            hf_dir, ckpt = os.path.join(root, "hf"), os.path.join(root, "jaxspec")
            print(f"building a ~{args.size_gb:g} GB INT4 checkpoint in {hf_dir}")
            info = write_checkpoint(hf_dir, args.size_gb, True, 0.5)
            print("converting ...")
            t0 = time.monotonic()
            conv = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "checkpoints_convert",
                    "--target",
                    hf_dir,
                    "--out",
                    ckpt,
                    "--dtype",
                    "bfloat16",
                    "--quiet",
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
                check=False,
            )
            if conv.returncode != 0:
                print(conv.stderr, file=sys.stderr)
                print(f"conversion failed with exit code {conv.returncode}", file=sys.stderr)
                return 1
            info["convert_seconds"] = time.monotonic() - t0
            if not args.keep:
                shutil.rmtree(hf_dir)
        leaf_name, leaf_shape, leaf_dtype, leaf_bytes = largest_leaf(ckpt, args.dtype)
        disk = dir_bytes(os.path.join(ckpt, "params"))
        results = {}
        for malloc in MALLOC:
            for mode in paths:
                print(f"loading onto {args.num_devices} fake devices ({mode}, malloc {malloc}) ...")
                results[f"{mode}, {malloc}"] = measure(ckpt, args.dtype, mode, args.num_devices, malloc)

        rows = [
            (
                "checkpoint",
                f"{disk / GB:.2f} GB of leaves on disk"
                + (
                    f" ({info['layers']} layers, {info['experts']} INT4 experts; converted in "
                    f"{info['convert_seconds']:.1f} s)"
                    if info
                    else ""
                ),
            ),
            ("largest leaf", f"{leaf_bytes / GB:.3f} GB  {leaf_name} {list(leaf_shape)} {leaf_dtype}"),
            ("load", f"dtype {args.dtype}, {args.num_devices} fake CPU devices"),
        ]
        width = max(len(k) for k, _ in rows)
        print()
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
        print()
        header = (
            "path, malloc",
            "load s",
            "RSS after load",
            "largest leaf: peak - after",
            "worst leaf: peak - after",
            "worst / largest leaf",
        )
        table = [header]
        for mode, r in results.items():
            table.append(
                (
                    mode,
                    f"{r['seconds']:.1f}",
                    f"{r['after'] / GB:.2f} GB",
                    f"{r['largest_transient'] / GB:.3f} GB ({r['largest_transient'] / leaf_bytes:.2f}x)",
                    f"{r['transient'] / GB:.3f} GB ({r['worst']['leaf']})",
                    f"{r['transient'] / leaf_bytes:.2f}x",
                )
            )
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        for row in table:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        some = next(iter(results.values()), None)
        if some is not None:
            print(
                f"\nloaded bytes on all devices (replicas included): {some['device_bytes'] / GB:.2f} GB. "
                "peak - after: the peak RSS while reading a leaf (VmHWM reset before it) minus RSS once it is "
                "placed, i.e. host memory the leaf needed beyond its device buffers"
            )
        print(
            json.dumps(
                {
                    "checkpoint_bytes": disk,
                    "largest_leaf": {"name": leaf_name, "shape": leaf_shape, "dtype": leaf_dtype, "bytes": leaf_bytes},
                    "dtype": args.dtype,
                    "num_devices": args.num_devices,
                    "build": info,
                    "paths": results,
                }
            )
        )
        return 0
    finally:
        if root is not None:
            if args.keep:
                print(f"kept {root}")
            else:
                shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
