"""Streaming access to (sharded) safetensors checkpoints.

Tensors are memory-mapped one at a time, so peak host memory is bounded by the
tensors a caller keeps alive, never by the checkpoint size. The format is read
directly (8-byte header length, JSON header, raw little-endian data) so every
dtype real checkpoints use (bf16, fp8, int32 packed INT4) maps onto numpy via
ml_dtypes without a deep-learning framework.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np

from jaxspec.cli import UsageError

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class CheckpointError(UsageError):
    """A checkpoint tensor or file that does not match what the model needs."""


@dataclasses.dataclass(frozen=True)
class TensorRef:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data
    nbytes: int

    def load(self) -> np.ndarray:
        """Memory-map the tensor (read lazily by the OS; copy before the file goes away)."""
        if self.dtype not in DTYPES:
            raise CheckpointError(f"{self.file}: tensor {self.name} has unsupported dtype {self.dtype}")
        dt = np.dtype(DTYPES[self.dtype])
        count = math.prod(self.shape)
        if count * dt.itemsize != self.nbytes:
            raise CheckpointError(
                f"{self.file}: tensor {self.name} has {self.nbytes} bytes, "
                f"expected {count * dt.itemsize} for {self.dtype}{list(self.shape)}"
            )
        arr = np.memmap(self.file, dtype=dt, mode="r", offset=self.offset, shape=(count,))
        return arr.reshape(self.shape)


def read_header(file: str) -> list[TensorRef]:
    """The tensors of one safetensors file, checked against the file's size.

    A truncated or malformed file is refused here, naming the file, so that a
    conversion fails before it writes anything rather than halfway through.
    """
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{file}: not a safetensors file (only {len(raw)} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise CheckpointError(f"{file}: not a safetensors file (header length {n})")
        blob = f.read(n)
    if len(blob) != n:
        raise CheckpointError(
            f"{file}: truncated safetensors file: the header needs {n} bytes, "
            f"the file has {size - 8} after the length field"
        )
    try:
        header = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: malformed safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: malformed safetensors header (not a JSON object)")
    base = 8 + n
    refs = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: malformed safetensors header entry for {name}: {meta!r}") from None
        if not 0 <= start <= end:
            raise CheckpointError(f"{file}: tensor {name} has invalid data_offsets {[start, end]}")
        if dtype in DTYPES and math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize != end - start:
            raise CheckpointError(
                f"{file}: tensor {name} has {end - start} bytes, "
                f"expected {math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize} "
                f"for {dtype}{list(shape)}"
            )
        refs.append(TensorRef(name, file, dtype, shape, base + start, end - start))
    data_end = max((r.offset + r.nbytes for r in refs), default=base)
    if data_end > size:
        raise CheckpointError(
            f"{file}: truncated safetensors file: its header describes {data_end} bytes, the file has {size}"
        )
    refs.sort(key=lambda r: r.offset)  # file order: sequential reads
    return refs


def read_json(file: str, error=None) -> dict:
    """A JSON object from `file`; a missing or malformed file is an error naming it."""
    error = error or CheckpointError
    if not os.path.exists(file):
        raise FileNotFoundError(f"missing {file}")
    try:
        with open(file, "rb") as f:
            value = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{file}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise error(f"{file}: expected a JSON object, found {type(value).__name__}")
    return value


def checkpoint_files(hf_dir: str) -> list[str]:
    """Shard files in index order (or the single model.safetensors)."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not weight_map or not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map")
        files = sorted(set(weight_map.values()))
        missing = [x for x in files if not os.path.exists(os.path.join(hf_dir, x))]
        if missing:
            raise CheckpointError(f"{index}: lists shard files that do not exist: {missing[:5]}")
        return [os.path.join(hf_dir, x) for x in files]
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise CheckpointError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")


def iter_tensors(hf_dir: str) -> Iterator[TensorRef]:
    for file in checkpoint_files(hf_dir):
        yield from read_header(file)


def write_safetensors(file: str, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write numpy arrays (any dtype in DTYPES, bf16/fp8 via ml_dtypes) as one safetensors file."""
    rev = {np.dtype(v): k for k, v in DTYPES.items()}
    header, offset = {}, 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in rev:
            raise CheckpointError(f"cannot write tensor {name} of dtype {arr.dtype}")
        header[name] = {
            "dtype": rev[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = file + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
    os.replace(tmp, file)
