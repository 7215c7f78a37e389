"""checkpoints_convert.safetensors_io against the safetensors library itself.

Files written by the library read back through `read_header` / `TensorRef.load` with
the library's own values (its numpy framework, and its torch framework for float8, which
numpy cannot return); files written by `write_safetensors` read back in the library.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from safetensors import safe_open
from torch_numpy import torch_to_numpy

from checkpoints_convert.safetensors_io import CODES, CheckpointError, read_header, write_safetensors
from jaxspec.dtypes import DTYPES


def _random(dtype, shape, rng) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=np.int64 if dtype.kind == "i" else np.uint64).astype(dtype)
    return rng.normal(size=shape).astype(np.float32).astype(dtype)


@pytest.fixture
def tensors():
    rng = np.random.default_rng(0)
    out = {f"t_{name}": _random(DTYPES[name], (3, 5), rng) for name in CODES.values()}
    out["empty"] = np.zeros((0, 4), np.float32)
    out["scalar"] = np.array(2.5, np.float32)
    out["u16_not_loadable"] = np.arange(7, dtype=np.uint16)  # takes its bytes, but jaxspec never loads U16
    return out


def test_library_file_reads_back(tmp_path, tensors):
    path = str(tmp_path / "lib.safetensors")
    safetensors.numpy.save_file(tensors, path)
    refs = {r.name: r for r in read_header(path)}
    assert sorted(refs) == sorted(tensors)
    assert [r.offset for r in read_header(path)] == sorted(r.offset for r in refs.values())  # file order
    with safe_open(path, framework="numpy") as f:
        for name, ref in refs.items():
            assert ref.shape == tuple(f.get_slice(name).get_shape()) and ref.dtype == f.get_slice(name).get_dtype()
            if name == "u16_not_loadable":
                with pytest.raises(
                    CheckpointError, match=r"lib.safetensors: tensor u16_not_loadable has unsupported dtype U16"
                ):
                    ref.load()
                continue
            ours = ref.load()
            assert ours.dtype == tensors[name].dtype and ours.shape == tensors[name].shape, name
            if ref.dtype.startswith("F8"):  # safetensors' numpy framework cannot return float8
                continue
            np.testing.assert_array_equal(ours, f.get_tensor(name), err_msg=name)
    for name, t in safetensors.torch.load_file(path).items():  # float8 through the library's torch reader
        if name.startswith("t_float8"):
            np.testing.assert_array_equal(refs[name].load().view(np.uint8), torch_to_numpy(t).view(np.uint8))


def test_written_file_reads_back_in_the_library(tmp_path, tensors):
    tensors = {k: v for k, v in tensors.items() if k != "u16_not_loadable"}
    tensors["strided"] = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]  # not C-contiguous
    path = str(tmp_path / "ours.safetensors")
    write_safetensors(path, tensors, metadata={"format": "pt"})
    with safe_open(path, framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        for name, want in tensors.items():
            if want.dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
                continue
            np.testing.assert_array_equal(f.get_tensor(name), want, err_msg=name)
    back = safetensors.torch.load_file(path)
    for name in ("t_float8_e4m3fn", "t_float8_e5m2", "t_bfloat16"):
        np.testing.assert_array_equal(torch_to_numpy(back[name]).astype(np.float32), tensors[name].astype(np.float32))
    assert back["t_float8_e4m3fn"].dtype == torch.float8_e4m3fn
    assert {r.name: r.load().shape for r in read_header(path)}["scalar"] == ()


def test_write_refuses_unknown_dtype(tmp_path):
    with pytest.raises(CheckpointError, match="cannot write tensor c of dtype complex64"):
        write_safetensors(str(tmp_path / "x.safetensors"), {"c": np.zeros(2, np.complex64)})
    assert not list(tmp_path.iterdir())
