"""Read and write EAGLE-3 draft checkpoints in SpecForge / SGLang layout.

A draft directory holds ``config.json`` plus ``model.safetensors`` (or shards
listed in ``model.safetensors.index.json``) with these tensors (torch
``nn.Linear`` weights are ``[out, in]``)::

    fc.weight                                        [hidden, 3*target_hidden]
    fc_norm.{0,1,2}.weight                           [target_hidden]   (config fc_norm)
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight  [hidden]
    midlayer.self_attn.q_proj.weight                 [heads*head_dim, 2*hidden]
    midlayer.self_attn.{k,v}_proj.weight             [kv_heads*head_dim, 2*hidden]
    midlayer.self_attn.o_proj.weight                 [hidden, heads*head_dim]
    midlayer.mlp.{gate,up}_proj.weight               [intermediate, hidden]
    midlayer.mlp.down_proj.weight                    [hidden, intermediate]
    norm.weight                                      [hidden]
    lm_head.weight                                   [draft_vocab, hidden]
    d2t  int64                                       [draft_vocab]  target = draft + d2t[draft]
    t2d  bool                                        [vocab]

Tensors are read one at a time through ``safetensors_io`` (the ``safetensors``
library; no torch needed, bf16 via ml_dtypes). ``expected_tensors`` is the one
name table: reading (``read_draft``) and writing (``params_to_tensors``, the
exporter) both use it.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from checkpoints_convert.safetensors_io import CheckpointError, TensorRef, iter_tensors, write_safetensors
from jaxspec.config import DraftConfig, read_json

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Some drafts ship a copy of the target embedding; the draft always uses the
# target's table, so this tensor is ignored.
IGNORED_TENSORS = ("embed_tokens.weight",)


# --------------------------------------------------------------------------
# Tensor layout
# --------------------------------------------------------------------------


def _linear(path, out_dim, in_dim):
    return {"path": path, "shape": (out_dim, in_dim), "transpose": True, "kind": "float"}


def _norm(path, dim):
    return {"path": path, "shape": (dim,), "transpose": False, "kind": "float"}


def expected_tensors(cfg: DraftConfig) -> dict:
    """Checkpoint tensor name -> {path in the param tree, shape, transpose, kind}."""
    H, Ht = cfg.hidden_size, cfg.target_hidden_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    I = cfg.intermediate_size
    spec = {"fc.weight": _linear(("fc", "kernel"), H, 3 * Ht)}
    if cfg.fc_norm:
        for i in range(3):
            spec[f"fc_norm.{i}.weight"] = _norm((f"fc_norm_{i}", "scale"), Ht)
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        spec[f"midlayer.{norm}.weight"] = _norm(("midlayer", norm, "scale"), H)
    attn = ("midlayer", "self_attn")
    spec["midlayer.self_attn.q_proj.weight"] = _linear(attn + ("q_proj", "kernel"), q_dim, 2 * H)
    spec["midlayer.self_attn.k_proj.weight"] = _linear(attn + ("k_proj", "kernel"), kv_dim, 2 * H)
    spec["midlayer.self_attn.v_proj.weight"] = _linear(attn + ("v_proj", "kernel"), kv_dim, 2 * H)
    spec["midlayer.self_attn.o_proj.weight"] = _linear(attn + ("o_proj", "kernel"), H, q_dim)
    mlp = ("midlayer", "mlp")
    spec["midlayer.mlp.gate_proj.weight"] = _linear(mlp + ("gate_proj", "kernel"), I, H)
    spec["midlayer.mlp.up_proj.weight"] = _linear(mlp + ("up_proj", "kernel"), I, H)
    spec["midlayer.mlp.down_proj.weight"] = _linear(mlp + ("down_proj", "kernel"), H, I)
    spec["norm.weight"] = _norm(("norm", "scale"), H)
    spec["lm_head.weight"] = _linear(("lm_head", "kernel"), cfg.draft_vocab_size, H)
    spec["d2t"] = {"path": None, "shape": (cfg.draft_vocab_size,), "transpose": False, "kind": "int"}
    spec["t2d"] = {"path": None, "shape": (cfg.vocab_size,), "transpose": False, "kind": "bool"}
    return spec


# --------------------------------------------------------------------------
# Checkpoint files
# --------------------------------------------------------------------------


def _locate_tensors(hf_dir: str) -> dict[str, TensorRef]:
    """Tensor name -> TensorRef over the (possibly sharded) safetensors files."""
    if not any(os.path.exists(os.path.join(hf_dir, f)) for f in (WEIGHTS_FILE, INDEX_FILE)):
        bins = sorted(glob.glob(os.path.join(hf_dir, "*.bin")))
        if bins:
            raise CheckpointError(
                f"{bins[0]}: PyTorch pickle checkpoints are not read here; convert it once with "
                'torch, e.g. python -c "import torch, safetensors.torch as st; '
                f"st.save_file(torch.load('{bins[0]}', map_location='cpu'), "
                f"'{os.path.join(hf_dir, WEIGHTS_FILE)}')\""
            )
    where = {}
    for ref in iter_tensors(hf_dir):
        if ref.name in where:
            raise CheckpointError(
                f"{hf_dir}: tensor '{ref.name}' appears in both {where[ref.name].file} and {ref.file}"
            )
        where[ref.name] = ref
    return where


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def _set_path(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get_path(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def _check_kind(name, where, kind, dtype_name):
    ok = {
        "float": dtype_name in ("F64", "F32", "F16", "BF16"),
        "int": dtype_name in ("I64", "I32"),
        "bool": dtype_name == "BOOL",
    }[kind]
    if not ok:
        raise CheckpointError(f"{where}: tensor '{name}' has dtype {dtype_name}, expected a {kind} tensor")


def read_draft(hf_dir: str, dtype=None):
    """Load a SpecForge-layout draft.

    Returns ``(DraftConfig, params, d2t, t2d)``: ``params`` is a nested dict of
    numpy arrays matching ``Eagle3Draft``'s tree (kernels ``[in, out]``), in
    ``dtype`` if given, else as stored; ``d2t`` np.int64 [draft_vocab];
    ``t2d`` np.bool_ [vocab].
    """
    cfg_path = os.path.join(hf_dir, CONFIG_FILE)
    cfg = DraftConfig.from_hf(read_json(cfg_path), source=cfg_path)

    where = _locate_tensors(hf_dir)
    spec = expected_tensors(cfg)
    unexpected = sorted(set(where) - set(spec) - set(IGNORED_TENSORS))
    if unexpected:
        raise CheckpointError(f"{hf_dir}: unexpected tensors {unexpected} for {cfg_path} (fc_norm={cfg.fc_norm})")

    params, d2t, t2d = {}, None, None
    for name, s in spec.items():
        if name not in where:
            raise CheckpointError(f"{hf_dir}: missing tensor '{name}' (expected shape {s['shape']} from {cfg_path})")
        ref = where[name]
        if ref.shape != s["shape"]:
            raise CheckpointError(
                f"{ref.file}: tensor '{name}' has shape {ref.shape}, expected {s['shape']} from {cfg_path}"
            )
        _check_kind(name, ref.file, s["kind"], ref.dtype)
        arr = np.array(ref.load())  # copy out of the memory map
        if name == "d2t":
            d2t = arr.astype(np.int64)
        elif name == "t2d":
            t2d = arr.astype(np.bool_)
        else:
            if s["transpose"]:
                arr = np.ascontiguousarray(arr.T)
            _set_path(params, s["path"], arr if dtype is None else arr.astype(dtype))
    return cfg, params, d2t, t2d


def params_to_tensors(cfg: DraftConfig, params, d2t, t2d, dtype=None) -> dict:
    """Inverse of ``read_draft``: param tree -> checkpoint tensors ([out, in] linears)."""
    tensors = {}
    for name, s in expected_tensors(cfg).items():
        if name == "d2t":
            tensors[name] = np.asarray(d2t, dtype=np.int64)
        elif name == "t2d":
            tensors[name] = np.asarray(t2d, dtype=np.bool_)
        else:
            arr = np.asarray(_get_path(params, s["path"]))
            if dtype is not None:
                arr = arr.astype(dtype)
            tensors[name] = np.ascontiguousarray(arr.T) if s["transpose"] else arr
    return tensors


def write_specforge_checkpoint(out_dir: str, cfg_dict: dict, tensors: dict) -> None:
    """Write ``config.json`` + ``model.safetensors`` in SpecForge layout.

    ``tensors`` maps checkpoint names to numpy arrays (see module docstring;
    ``params_to_tensors`` builds it from a param tree).  The set of names and
    their shapes are checked against ``cfg_dict`` before anything is written.
    """
    cfg_path = os.path.join(out_dir, CONFIG_FILE)
    cfg = DraftConfig.from_hf(cfg_dict, source=cfg_path)
    spec = expected_tensors(cfg)
    missing = sorted(set(spec) - set(tensors))
    extra = sorted(set(tensors) - set(spec) - set(IGNORED_TENSORS))
    if missing or extra:
        raise ValueError(f"{out_dir}: tensors do not match {CONFIG_FILE}: missing {missing}, unexpected {extra}")
    arrays = {}
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        if name in spec and arr.shape != spec[name]["shape"]:
            raise ValueError(f"{out_dir}: tensor '{name}' has shape {arr.shape}, expected {spec[name]['shape']}")
        arrays[name] = arr
    os.makedirs(out_dir, exist_ok=True)
    with open(cfg_path, "w") as f:
        json.dump(cfg_dict, f, indent=2)
    # "format": "pt" lets transformers' from_pretrained accept the file.
    write_safetensors(os.path.join(out_dir, WEIGHTS_FILE), dict(sorted(arrays.items())), metadata={"format": "pt"})
