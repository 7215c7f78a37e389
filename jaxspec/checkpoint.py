"""The jaxspec checkpoint format: one orbax checkpoint per parameter leaf.

    DIR/
      jaxspec_config.json     target ModelConfig (+ draft config when a draft is present)
      params/<a.b.c>/         orbax checkpoint holding the leaf at path a/b/c (an INT4 weight
                              `quant.Int4Weight` at a/b/gate: the two leaves a.b.gate_packed and
                              a.b.gate_scale, in the checkpoint's rows layout)
      draft/params/<...>/     EAGLE-3 draft leaves (when converted with a draft)
      tiktoken.model, tokenizer_config.json, generation_config.json (copied)
      COMPLETE                written last; a directory without it is never loaded

A conversion writes into DIR.partial and renames it to DIR only once COMPLETE
is in it, so an earlier checkpoint at DIR survives a failed conversion.

One leaf per orbax item keeps conversion streaming (a leaf is written as soon as
its tensors are read) and lets loading place each leaf straight onto its
sharding, so neither side ever holds the whole model in host memory.

Leaves are stored in chunks of at most CHUNK_BYTES. Loading restores each leaf
onto its sharding: every process reads, for each distinct shard of its own
devices, only the chunks that shard overlaps, casts it to the requested dtype
and places it, a bounded number of shards at a time; no process assembles a
whole sharded leaf in host memory. (Checkpoints written before chunking hold a
sharded leaf as one chunk; such a leaf is read once in full and then placed.)
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import tempfile

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxspec.cli import UsageError

FORMAT_VERSION = 1
CONFIG_FILE = "jaxspec_config.json"
MARKER = "COMPLETE"
# Leaves are written in chunks of at most this many bytes, so that a device's share of a
# leaf is read by touching only the chunks it overlaps instead of decoding the whole leaf.
CHUNK_BYTES = 2 << 20
# Host bytes a leaf's restore may have in flight at once (raised to one shard's read when a
# single shard needs more).
RESTORE_BYTES = 16 << 20


class IncompleteCheckpoint(FileNotFoundError):
    """A checkpoint directory without its COMPLETE marker (an interrupted or missing conversion)."""


class BadCheckpoint(UsageError):
    """A checkpoint whose config or leaves do not match what this version of jaxspec reads."""


def leaf_name(path: tuple[str, ...]) -> str:
    """A leaf's directory name on disk: its path joined with "." (`params/attn.q_proj.kernel/`).

    Trees are flattened to such path tuples with `flatten`."""
    return ".".join(path)


def _path(keys) -> tuple[str, ...]:
    out: list[str] = []
    for k in keys:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey) and out:  # a field of an Int4Weight node
            out[-1] = f"{out[-1]}_{k.name}"
        else:
            raise TypeError(f"parameter trees hold dicts and Int4Weight nodes, found the key {k!r}")
    return tuple(out)


def flatten(tree) -> dict[tuple[str, ...], object]:
    """A parameter tree as {path: leaf}: dict keys in order, and an `Int4Weight` node at path
    (..., "gate") as its two leaves (..., "gate_packed") and (..., "gate_scale"), the names its
    arrays have in the HF checkpoint (`weight_packed`, `weight_scale`) and on disk."""
    return {_path(keys): leaf for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflatten(flat: dict[tuple[str, ...], object], like):
    """The tree of `like`'s structure (Int4Weight nodes included) holding the leaves of `flat`
    (keyed as `flatten` keys them)."""
    keyed, treedef = jax.tree_util.tree_flatten_with_path(like)
    paths = [_path(keys) for keys, _ in keyed]
    missing = [p for p in paths if p not in flat]
    if missing:
        raise KeyError(f"no leaf for {'/'.join(missing[0])} ({len(missing)} missing)")
    return jax.tree_util.tree_unflatten(treedef, [flat[p] for p in paths])


def release_freed_memory() -> None:
    """Hand memory that was freed back to the OS (glibc keeps freed heap pages otherwise,
    so a long conversion's RSS would grow with every leaf); a no-op without glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def chunking(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> ocp.SaveArgs:
    """How a leaf is chunked on disk.

    A stacked leaf whose leading slices (one expert of [E, out, in]) hold between a quarter
    of and 16 times `chunk_bytes` is stored one leading slice per chunk: any split of the leading axis
    then reads exactly its own slices, and every chunk is contiguous in memory. Any other
    leaf is cut into chunks of at most `chunk_bytes`, largest dimensions split first.
    """
    if len(shape) >= 2 and shape[0] > 1:
        slice_bytes = math.prod(shape[1:]) * itemsize
        if chunk_bytes // 4 <= slice_bytes <= 16 * chunk_bytes:
            try:
                return ocp.SaveArgs(shard_axes=(0,))
            except TypeError:  # an orbax without shard_axes: byte-size chunks below
                pass
    return ocp.SaveArgs(chunk_byte_size=chunk_bytes)


class LeafWriter:
    """Writes leaves one at a time under `root/params` (or a sub-tree such as `draft/params`).

    A leaf is written in the background while the caller builds the next one;
    `write` first waits for the previous leaf, so at most one is in flight. The
    caller must not modify an array after passing it to `write`.

    Leaves are stored in chunks of at most `chunk_bytes` (default CHUNK_BYTES, read when
    the writer is made), so a load reads each device's share without decoding the whole
    leaf. They are stored uncompressed: orbax's default zstd saves about a quarter of the
    disk on bf16 weights but makes writing ~1.5x slower and holds extra copies of the leaf
    in memory. Loading reads the codec from each leaf's metadata, so checkpoints written
    compressed still load.
    """

    def __init__(self, root: str, subdir: str = "params", chunk_bytes: int | None = None):
        self.dir = os.path.join(root, subdir)
        self.chunk_bytes = chunk_bytes or CHUNK_BYTES
        os.makedirs(self.dir, exist_ok=True)
        self._ckpt = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
        self.written: set[tuple[str, ...]] = set()

    def write(self, path: tuple[str, ...], array: np.ndarray) -> None:
        self._ckpt.wait_until_finished()
        release_freed_memory()
        item = {"value": np.asarray(array)}
        save_args = {"value": chunking(item["value"].shape, item["value"].dtype.itemsize, self.chunk_bytes)}
        self._ckpt.save(os.path.join(self.dir, leaf_name(path)), args=ocp.args.PyTreeSave(item, save_args=save_args))
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


def prepare_output(out: str, flag: str | None = None) -> str:
    """Check that `out` may be replaced and create an empty staging directory; returns its path.

    A previous checkpoint at `out` stays untouched (and loadable) until `publish`
    replaces it, so a failed or interrupted conversion never destroys it.
    """
    staging = staging_dir(out)
    for path in (out, staging):
        if os.path.exists(path) and not (os.path.isdir(path) and _is_ours(path)):
            raise FileExistsError(
                f"{f'{flag} ' if flag else ''}{path} exists and is not a jaxspec checkpoint; refusing to overwrite "
                "it (expected a new directory or an earlier jaxspec checkpoint to replace)"
            )
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


def read_config(path: str, flag: str | None = None) -> dict:
    """The checkpoint's jaxspec_config.json, checked: `path` is a directory holding a complete
    checkpoint (FileNotFoundError, IncompleteCheckpoint) of this format (BadCheckpoint). `flag`
    (e.g. '--model') is named in the messages as the option that gave `path`."""
    where = f"{flag} {path}" if flag else path
    rerun = "the conversion was interrupted or never ran; run `python -m checkpoints_convert` again"
    if not os.path.exists(path):
        raise IncompleteCheckpoint(
            f"{where}: expected a jaxspec checkpoint directory, found no such directory (no {MARKER} marker: {rerun})"
        )
    if not os.path.isdir(path):
        raise NotADirectoryError(
            f"{where}: expected a jaxspec checkpoint directory (made by `python -m checkpoints_convert`), found a file"
        )
    if not os.path.exists(os.path.join(path, MARKER)):
        raise IncompleteCheckpoint(f"{where} is not a complete jaxspec checkpoint (no {MARKER} marker): {rerun}")
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            payload = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadCheckpoint(f"{where}: {file} is not valid JSON ({e}); re-run the converter") from None
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        found = payload.get("format_version") if isinstance(payload, dict) else type(payload).__name__
        raise BadCheckpoint(
            f"{where}: {CONFIG_FILE} has format_version {found}, expected {FORMAT_VERSION}; re-run the converter"
        )
    return payload


def load_leaves(root: str, abstract: dict, shardings=None, subdir: str = "params", *, via_host: bool = False) -> dict:
    """Restore every leaf of `abstract` (tree of ShapeDtypeStruct), each placed on its sharding.

    With `shardings` (a tree of `jax.sharding.Sharding` matching `abstract`), each process
    reads only its own devices' shards of a leaf, casting each shard to the abstract dtype
    (see the module docstring); the mesh may span several processes. Without shardings a
    leaf is read whole and lands on the default device. `via_host=True` forces the whole-leaf
    path (read the full leaf into host memory, cast, then place it), kept for comparison.
    """
    flat = flatten(abstract)
    flat_sh = flatten(shardings) if shardings is not None else {}
    meta_reader = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    out = {}
    try:
        for path, spec in flat.items():
            leaf_dir = os.path.join(root, subdir, leaf_name(path))
            if not os.path.exists(leaf_dir):
                raise FileNotFoundError(f"{root}: checkpoint has no leaf {'/'.join(path)} (expected {leaf_dir})")
            stored = _stored_metadata(meta_reader, leaf_dir)
            if tuple(stored.shape) != tuple(spec.shape):
                raise BadCheckpoint(f"{leaf_dir}: shape {tuple(stored.shape)}, expected {tuple(spec.shape)}")
            sharding = flat_sh.get(path)
            if sharding is None or via_host or _whole_leaf_cheaper(stored, sharding):
                out[path] = _restore_via_host(leaf_dir, spec, sharding)
            else:
                out[path] = _restore_sharded(leaf_dir, spec, sharding, stored)
            release_freed_memory()  # the leaf's host buffers, so RSS does not ratchet up leaf by leaf
    finally:
        meta_reader.close()
    return unflatten(out, abstract)


def _stored_metadata(reader, leaf_dir: str):
    """The stored leaf's array metadata (shape, dtype, storage.chunk_shape)."""
    meta = reader.metadata(leaf_dir)
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
    tree = tree if tree is not None else getattr(meta, "item_metadata", meta)
    return tree["value"]


def _chunk_shape(stored) -> tuple[int, ...]:
    storage = getattr(stored, "storage", None)
    chunk = getattr(storage, "chunk_shape", None)
    return tuple(chunk) if chunk else tuple(stored.shape)


def _shard_read_bytes(stored, index: tuple[slice, ...], dtype=None) -> int:
    """Host bytes orbax reserves to read one shard: the whole chunks it overlaps, counted in the wider
    of the stored and the requested dtype (it reads through a cast)."""
    n = max(np.dtype(stored.dtype).itemsize, np.dtype(dtype or stored.dtype).itemsize)
    for dim, chunk, sl in zip(stored.shape, _chunk_shape(stored), index):
        start, stop, _ = sl.indices(dim)
        n *= -(-stop // chunk) * chunk - start // chunk * chunk
    return n


def _local_shard_indices(shape, sharding) -> list[tuple[slice, ...]]:
    """Distinct shard indices of this process's devices (replicas are read once)."""
    seen = {}
    for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        seen.setdefault(tuple(sl.indices(d) for sl, d in zip(index, shape)), index)
    return list(seen.values())


def _whole_leaf_cheaper(stored, sharding) -> bool:
    """True when every local shard would read (nearly) the whole leaf, as with a single-chunk leaf
    from before chunking: one full read then beats one full read per shard."""
    indices = _local_shard_indices(stored.shape, sharding)
    whole = math.prod(stored.shape) * np.dtype(stored.dtype).itemsize
    return len(indices) > 1 and max(_shard_read_bytes(stored, i) for i in indices) >= whole


def _restore_sharded(leaf_dir: str, spec, sharding, stored):
    reads = [_shard_read_bytes(stored, i, spec.dtype) for i in _local_shard_indices(stored.shape, sharding)]
    # orbax's limiter refuses a single read at or above its limit, hence the + 1.
    limit = max(RESTORE_BYTES, max(reads, default=0)) + 1
    args = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=tuple(spec.shape), dtype=spec.dtype)
    try:
        return _restore_with_limit(leaf_dir, args, limit / 1e9)
    except ValueError as e:
        if "Requested more bytes" not in str(e):
            raise
        # An orbax that counts a shard's read differently: restore without the in-flight bound.
        return _restore_with_limit(leaf_dir, args, None)


def _restore_with_limit(leaf_dir: str, args, concurrent_gb):
    ckpt = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(restore_concurrent_gb=concurrent_gb))
    try:
        return ckpt.restore(leaf_dir, args=ocp.args.PyTreeRestore(restore_args={"value": args}))["value"]
    finally:
        ckpt.close()


def _restore_via_host(leaf_dir: str, spec, sharding):
    ckpt = ocp.StandardCheckpointer()
    try:
        value = np.asarray(ckpt.restore(leaf_dir)["value"]).astype(spec.dtype, copy=False)
    finally:
        ckpt.close()
    return jax.device_put(value, sharding) if sharding is not None else jax.numpy.asarray(value)
