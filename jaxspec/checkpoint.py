"""The jaxspec checkpoint format: one orbax checkpoint per parameter leaf.

    DIR/
      jaxspec_config.json     target ModelConfig (+ draft config when a draft is present)
      params/<a.b.c>/         orbax checkpoint holding the leaf at path a/b/c
      draft/params/<...>/     EAGLE-3 draft leaves (when converted with a draft)
      tiktoken.model, tokenizer_config.json, generation_config.json (copied)
      COMPLETE                written last; a directory without it is never loaded

A conversion writes into DIR.partial and renames it to DIR only once COMPLETE
is in it, so an earlier checkpoint at DIR survives a failed conversion.

One leaf per orbax item keeps conversion streaming (a leaf is written as soon as
its tensors are read) and lets loading place each leaf straight onto its
sharding, so neither side ever holds the whole model in host memory.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import tempfile

import jax
import numpy as np
import orbax.checkpoint as ocp

FORMAT_VERSION = 1
CONFIG_FILE = "jaxspec_config.json"
MARKER = "COMPLETE"


class IncompleteCheckpoint(FileNotFoundError):
    pass


def leaf_name(path: tuple[str, ...]) -> str:
    return ".".join(path)


def flatten(tree: dict, prefix=()) -> dict[tuple[str, ...], object]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def unflatten(flat: dict[tuple[str, ...], object]) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return tree


def release_freed_memory() -> None:
    """Hand memory that was freed back to the OS (glibc keeps freed heap pages otherwise,
    so a long conversion's RSS would grow with every leaf); a no-op without glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class LeafWriter:
    """Writes leaves one at a time under `root/params` (or a sub-tree such as `draft/params`).

    A leaf is written in the background while the caller builds the next one;
    `write` first waits for the previous leaf, so at most one is in flight. The
    caller must not modify an array after passing it to `write`.

    Leaves are stored uncompressed: orbax's default zstd saves about a quarter of
    the disk on bf16 weights but makes writing ~1.5x slower and holds extra
    copies of the leaf in memory. Loading reads the codec from each leaf's
    metadata, so checkpoints written compressed still load.
    """

    def __init__(self, root: str, subdir: str = "params"):
        self.dir = os.path.join(root, subdir)
        os.makedirs(self.dir, exist_ok=True)
        self._ckpt = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
        self.written: set[tuple[str, ...]] = set()

    def write(self, path: tuple[str, ...], array: np.ndarray) -> None:
        self._ckpt.wait_until_finished()
        release_freed_memory()
        item = {"value": np.asarray(array)}
        self._ckpt.save(os.path.join(self.dir, leaf_name(path)), args=ocp.args.PyTreeSave(item))
        self.written.add(path)

    def close(self):
        """Wait for the last leaf (raising its error, if any) and release the writer."""
        try:
            self._ckpt.wait_until_finished()
        finally:
            self._ckpt.close()
        release_freed_memory()


def staging_dir(out: str) -> str:
    """Where a conversion into `out` writes until it is complete."""
    return os.path.normpath(out) + ".partial"


def _is_ours(path: str) -> bool:
    entries = os.listdir(path)
    return not entries or MARKER in entries or CONFIG_FILE in entries or "params" in entries


def prepare_output(out: str) -> str:
    """Check that `out` may be replaced and create an empty staging directory; returns its path.

    A previous checkpoint at `out` stays untouched (and loadable) until `publish`
    replaces it, so a failed or interrupted conversion never destroys it.
    """
    staging = staging_dir(out)
    for path in (out, staging):
        if os.path.exists(path) and not (os.path.isdir(path) and _is_ours(path)):
            raise FileExistsError(f"{path} exists and is not a jaxspec checkpoint; refusing to overwrite it")
    if os.path.exists(staging):
        shutil.rmtree(staging)  # left by an interrupted conversion
    os.makedirs(staging)
    return staging


def publish(staging: str, out: str) -> None:
    """Move the complete checkpoint in `staging` to `out`, replacing what was there."""
    if not os.path.exists(os.path.join(staging, MARKER)):
        raise IncompleteCheckpoint(f"{staging} has no {MARKER} marker; not publishing it")
    old = None
    if os.path.exists(out):
        # A directory cannot be renamed over a non-empty one: move the old checkpoint aside first
        # (into a fresh empty directory, which rename may replace) and delete it afterwards.
        out = os.path.normpath(out)
        old = tempfile.mkdtemp(prefix=os.path.basename(out) + ".old.", dir=os.path.dirname(out) or ".")
        os.rename(out, old)
    os.rename(staging, out)
    if old is not None:
        shutil.rmtree(old)


def write_config(out: str, payload: dict) -> None:
    payload = dict(payload, format_version=FORMAT_VERSION)
    with open(os.path.join(out, CONFIG_FILE), "w") as f:
        json.dump(payload, f, indent=2)


def mark_complete(out: str, summary: dict) -> None:
    """The last write of a conversion: its presence means every leaf is on disk."""
    tmp = os.path.join(out, MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, os.path.join(out, MARKER))


def read_config(path: str) -> dict:
    if not os.path.exists(os.path.join(path, MARKER)):
        raise IncompleteCheckpoint(
            f"{path} is not a complete jaxspec checkpoint (no {MARKER} marker): the conversion was interrupted "
            "or never ran; run `python -m checkpoints_convert` again")
    with open(os.path.join(path, CONFIG_FILE)) as f:
        payload = json.load(f)
    if payload.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}/{CONFIG_FILE}: format_version {payload.get('format_version')}, "
                         f"expected {FORMAT_VERSION}; re-run the converter")
    return payload


def load_leaves(root: str, abstract: dict, shardings=None, subdir: str = "params") -> dict:
    """Restore every leaf of `abstract` (tree of ShapeDtypeStruct), each placed on its sharding.

    Leaves are cast to the abstract dtype on the host one at a time.
    """
    flat = flatten(abstract)
    flat_sh = flatten(shardings) if shardings is not None else {}
    ckpt = ocp.StandardCheckpointer()
    out = {}
    for path, spec in flat.items():
        leaf_dir = os.path.join(root, subdir, leaf_name(path))
        if not os.path.exists(leaf_dir):
            raise FileNotFoundError(f"{root}: checkpoint has no leaf {'/'.join(path)} (expected {leaf_dir})")
        value = ckpt.restore(leaf_dir)["value"]
        if tuple(value.shape) != tuple(spec.shape):
            raise ValueError(f"{leaf_dir}: shape {tuple(value.shape)}, expected {tuple(spec.shape)}")
        value = np.asarray(value).astype(spec.dtype, copy=False)
        sharding = flat_sh.get(path)
        out[path] = jax.device_put(value, sharding) if sharding is not None else jax.numpy.asarray(value)
    ckpt.close()
    return unflatten(out)
