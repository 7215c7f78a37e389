"""Convert a Hugging Face target (and optionally an EAGLE-3 draft) into a jaxspec checkpoint."""

from __future__ import annotations

import os
import shutil
import time

from flax.traverse_util import flatten_dict
from tqdm import tqdm

from checkpoints_convert.draft import read_draft
from checkpoints_convert.safetensors_io import CODES, checkpoint_files, read_header
from checkpoints_convert.target import TargetConverter
from jaxspec import checkpoint
from jaxspec.cli import UsageError
from jaxspec.config import WRAPPER_ARCHITECTURES, ConfigError, from_hf_dict, read_json, to_dict
from jaxspec.draft import validate_pair
from jaxspec.dtypes import COMPUTE_DTYPES, DTYPES
from jaxspec.model import abstract_params, per_layer

TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")
DTYPE_CHOICES = ("auto", *COMPUTE_DTYPES)
# Checkpoint dtype -> stored dtype for --dtype auto: kept where jaxspec computes in it; float16 widens
# to float32, which holds every float16 value exactly.
_AUTO = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float32"}


def resolve_dtype(dtype: str, hf_cfg: dict, refs) -> str:
    """`dtype`, or for 'auto' the checkpoint's own: config `torch_dtype` (or `dtype`, of `text_config`
    first), else the first floating tensor's dtype; FP8 weights are dequantised to bfloat16."""
    if dtype != "auto":
        if dtype not in COMPUTE_DTYPES:
            raise UsageError(f"--dtype {dtype!r}: expected one of {list(DTYPE_CHOICES)}")
        return dtype
    for section in (hf_cfg.get("text_config") or {}, hf_cfg):
        for key in ("torch_dtype", "dtype"):
            if section.get(key) in _AUTO:
                return _AUTO[section[key]]
    for ref in refs:
        if CODES.get(ref.dtype) in _AUTO:
            return _AUTO[CODES[ref.dtype]]
        if ref.dtype.startswith("F8"):
            return "bfloat16"
    raise UsageError(
        "--dtype auto: the checkpoint names no torch_dtype and has no float tensor; pass "
        "--dtype bfloat16 or --dtype float32"
    )


def convert(
    target_dir: str, out: str, draft_dir: str | None = None, dtype: str = "auto", progress: bool = True
) -> dict:
    """Stream `target_dir` (and `draft_dir`) into `out`; returns the summary written to COMPLETE.

    Everything that can be checked without reading tensor data (config, shard
    files, every tensor's name, shape and dtype) is checked before anything is
    written. The checkpoint is built in `out`.partial and renamed to `out` once
    complete, so a failed run leaves an earlier checkpoint at `out` as it was.

    dtype: 'auto' (floating weights keep the checkpoint's dtype, see `resolve_dtype`),
    'bfloat16' or 'float32'.
    """
    if dtype not in DTYPE_CHOICES:
        raise UsageError(f"--dtype {dtype!r}: expected one of {list(DTYPE_CHOICES)}")
    start = time.time()
    hf_cfg_path = os.path.join(target_dir, "config.json")
    hf_cfg = read_json(hf_cfg_path, ConfigError)
    cfg = from_hf_dict(hf_cfg, source=hf_cfg_path)
    wrapper = (hf_cfg.get("architectures") or [None])[0] in WRAPPER_ARCHITECTURES or "text_config" in hf_cfg
    refs = [r for f in checkpoint_files(target_dir) for r in read_header(f)]
    dtype = resolve_dtype(dtype, hf_cfg, refs)
    payload = {"target": to_dict(cfg), "dtype": dtype}

    draft = None
    if draft_dir is not None:
        draft = read_draft(draft_dir)
        validate_pair(cfg, draft[0], draft[2], draft[3])
        payload["draft"] = draft[0].to_dict()

    shapes = per_layer(cfg, abstract_params(cfg, DTYPES[dtype])[0])  # the checkpoint holds one leaf per layer
    conv = TargetConverter(cfg, shapes, wrapper)
    items = conv.plan(refs)
    total = sum(it.ref.nbytes + (it.scale.nbytes if it.scale else 0) for it in items)

    staging = checkpoint.prepare_output(out, flag="--out")
    writer = checkpoint.LeafWriter(staging)
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="target", disable=not progress) as bar:
            conv.run(items, writer.write, bar.update)
        conv.finish()
    finally:
        writer.close()

    if draft is not None:
        dcfg, dparams, d2t, t2d = draft
        dwriter = checkpoint.LeafWriter(staging, "draft/params")
        leaves = flatten_dict(dparams)
        leaves[("d2t",)] = d2t
        leaves[("t2d",)] = t2d
        try:
            for path, value in tqdm(leaves.items(), desc="draft", disable=not progress):
                if value.dtype.kind == "f":
                    value = value.astype(DTYPES[dtype])
                dwriter.write(path, value)
        finally:
            dwriter.close()

    for name in TOKENIZER_FILES:
        src = os.path.join(target_dir, name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(staging, name))
    checkpoint.write_config(staging, payload)
    summary = {
        "target": os.path.abspath(target_dir),
        "draft": draft_dir and os.path.abspath(draft_dir),
        "dtype": dtype,
        "leaves": len(writer.written),
        "bytes_read": total,
        "seconds": round(time.time() - start, 1),
    }
    checkpoint.mark_complete(staging, summary)
    checkpoint.publish(staging, out)
    return summary
