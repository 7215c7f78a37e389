"""Streaming access to (sharded) safetensors checkpoints, through the `safetensors` library.

`read_header` opens a file with `safetensors.safe_open`, which parses and validates its
header: valid JSON, known dtypes, every tensor's byte range matching its shape and dtype,
and the ranges tiling the data section in order, without gaps or overlaps, up to the last
byte of the file. A truncated or malformed file is refused there, naming the file, so a
conversion fails before it writes anything rather than halfway through.

Tensor data is then memory-mapped one tensor at a time (`TensorRef.load`) at the offsets
that validated header implies, instead of being read with `safe_open(...).get_tensor`:

* safetensors' numpy framework cannot return float8 tensors (0.8 raises AttributeError for
  F8_E4M3), which DeepSeek FP8 checkpoints hold, and returns bf16 only once ml_dtypes has
  registered the name with numpy (else TypeError); a memory map views the bytes as
  ml_dtypes' float8_e4m3fn / bfloat16 directly, without a deep-learning framework;
* a `safe_open` handle maps its whole file for as long as it is open, so the pages of a
  multi-GB shard touched by earlier tensors would stay mapped, while a tensor's own map
  goes away with the tensor: peak host memory stays bounded by the tensors a caller keeps
  alive, never by the shard or the checkpoint.

Writing goes through `safetensors.numpy.save_file` (one file at a time; the exporter builds
one shard in memory at a time).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator

import numpy as np
import safetensors.numpy
from safetensors import SafetensorError, safe_open

from jaxspec.cli import UsageError
from jaxspec.config import read_json
from jaxspec.dtypes import DTYPES

# safetensors dtype code -> its name in jaxspec.dtypes.DTYPES (the dtypes a tensor can be loaded as).
CODES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
_CODE_OF = {name: code for code, name in CODES.items()}
# Bits per element of every dtype code safetensors 0.8 accepts, loadable or not: a tensor the
# converter skips (a vision tower's, say) still takes its bytes in the file.
_BITS = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"), 8),
    **dict.fromkeys(("I16", "U16", "F16", "BF16"), 16),
    **dict.fromkeys(("I32", "U32", "F32"), 32),
    **dict.fromkeys(("I64", "U64", "F64", "C64"), 64),
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


class CheckpointError(UsageError):
    """A checkpoint tensor or file that does not match what the model needs."""


@dataclasses.dataclass(frozen=True)
class TensorRef:
    name: str
    file: str
    dtype: str  # safetensors dtype code: "BF16", "F32", "I32", ...
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data
    nbytes: int

    def load(self) -> np.ndarray:
        """Memory-map the tensor (read lazily by the OS; copy before the file goes away)."""
        if self.dtype not in CODES:
            raise CheckpointError(f"{self.file}: tensor {self.name} has unsupported dtype {self.dtype}")
        dt = np.dtype(DTYPES[CODES[self.dtype]])
        count = math.prod(self.shape)
        if count == 0:
            return np.zeros(self.shape, dt)  # an empty map is refused by mmap
        arr = np.memmap(self.file, dtype=dt, mode="r", offset=self.offset, shape=(count,))
        return arr.reshape(self.shape)


def _error(file: str, size: int, err: SafetensorError) -> CheckpointError:
    """The library's complaint about `file`, as a CheckpointError that names the file."""
    detail = str(err).removeprefix("Error while deserializing header: ")
    if "header too small" in detail:
        return CheckpointError(f"{file}: not a safetensors file (only {size} bytes)")
    if "header too large" in detail:
        return CheckpointError(f"{file}: not a safetensors file (its header length field is implausibly large)")
    if "invalid header length" in detail:
        return CheckpointError(
            f"{file}: truncated safetensors file: its header length field points past the file's {size} bytes"
        )
    if "not fully covered" in detail:
        return CheckpointError(
            f"{file}: truncated safetensors file (or bytes after its data): the tensor data its header "
            f"describes does not end where the file's {size} bytes do"
        )
    if "JSON" in detail or "invalid" in detail:
        return CheckpointError(f"{file}: malformed safetensors header ({detail})")
    return CheckpointError(f"{file}: unreadable safetensors file ({detail})")


def read_header(file: str) -> list[TensorRef]:
    """The tensors of one safetensors file in file order, validated by the safetensors library.

    A truncated or malformed file is refused here, naming the file, so that a
    conversion fails before it writes anything rather than halfway through.
    """
    size = os.path.getsize(file)
    try:
        with safe_open(file, framework="numpy") as f:
            specs = []
            for name in f.offset_keys():  # ordered by data offset
                sl = f.get_slice(name)
                specs.append((name, sl.get_dtype(), tuple(int(d) for d in sl.get_shape())))
    except SafetensorError as e:
        raise _error(file, size, e) from None
    sizes = []
    for name, dtype, shape in specs:
        if dtype not in _BITS:
            raise CheckpointError(f"{file}: tensor {name} has dtype {dtype}, whose size this reader does not know")
        sizes.append(-(-math.prod(shape) * _BITS[dtype] // 8))
    # The library checked that the tensors' byte ranges tile the data section back to back,
    # in this order, and that the section ends at the end of the file; so it starts here:
    offset = size - sum(sizes)
    refs = []
    for (name, dtype, shape), nbytes in zip(specs, sizes):
        refs.append(TensorRef(name, file, dtype, shape, offset, nbytes))
        offset += nbytes
    return refs


def checkpoint_files(hf_dir: str) -> list[str]:
    """Shard files in index order (or the single model.safetensors)."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index, CheckpointError).get("weight_map")
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


def write_safetensors(file: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write numpy arrays (any dtype in CODES, bf16/fp8 via ml_dtypes) as one safetensors file.

    The file appears under its name only once complete (written as `file.partial`, then renamed).
    """
    arrays = {}
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        if arr.dtype.name not in _CODE_OF:
            raise CheckpointError(f"cannot write tensor {name} of dtype {arr.dtype}")
        # save_file reads each array's buffer as is: it must be C-contiguous.
        arrays[name] = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
    tmp = file + ".partial"
    safetensors.numpy.save_file(arrays, tmp, metadata=metadata)
    os.replace(tmp, file)
