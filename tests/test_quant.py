"""jaxspec.quant (in-jit) and checkpoints_convert.quant_np (numpy) against the references they must match.

INT4: compressed-tensors (the library that wrote Kimi-K2.5's expert weights)
quantizes and packs random weights through its public model path; our
unpack / pack / dequant / quantize must reproduce its tensors bit for bit.

FP8: transformers' fine-grained FP8 dequantization is the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from torch_numpy import torch_to_numpy

from checkpoints_convert import quant_np
from jaxspec import quant

ct_quant = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import (  # noqa: E402
    pack_to_int32,
    unpack_from_int32,
)
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp  # noqa: E402

# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _library_int4(w: torch.Tensor, scale_dtype: torch.dtype | None = None) -> dict:
    """Quantize, compress and decompress ``w`` [out, in] with compressed-tensors.

    Uses the library's own path: attach an INT4 group-32 symmetric scheme to a
    Linear, compute the group scales with its qparam code, compress the model
    to "pack-quantized", then decompress it again.
    """
    out_f, in_f = w.shape
    model = torch.nn.Sequential(torch.nn.Linear(in_f, out_f, bias=False, dtype=w.dtype))
    linear = model[0]
    with torch.no_grad():
        linear.weight.copy_(w)
    args = ct_quant.QuantizationArgs(
        num_bits=4,
        type="int",
        symmetric=True,
        strategy="group",
        group_size=32,
        scale_dtype=scale_dtype,
    )
    scheme = ct_quant.QuantizationScheme(targets=["Linear"], weights=args)
    config = ct_quant.QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized")
    ct_quant.apply_quantization_config(model, config)
    scale, _ = compute_dynamic_scales_and_zp(linear.weight.data, args, linear)
    linear.weight_scale.data.copy_(scale)

    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    packed = linear.weight_packed.detach().clone()
    scale = linear.weight_scale.detach().clone()
    shape = linear.weight_shape.detach().clone()
    compressor.decompress_model(model)
    return {
        "packed": packed.numpy(),
        "scale": torch_to_numpy(scale),
        "ints": unpack_from_int32(packed, 4, torch.Size(shape.tolist())).numpy(),
        "weight": torch_to_numpy(linear.weight.detach()),
    }


def _weights(rng: np.random.Generator, out_f: int, in_f: int) -> np.ndarray:
    """Random weights plus rows that hit the edge cases of the rounding rule."""
    w = rng.normal(scale=0.05, size=(out_f, in_f)).astype(np.float32)
    # Group absmax 7.5 -> scale 1: exact .5 ties (round half to even) and both
    # ends of the range (+absmax clips to 7, -absmax becomes -8).
    ties = np.tile(np.array([7.5, -7.5, 2.5, -2.5, 0.5, -0.5, 1.5, 3.5], np.float32), in_f // 8)
    w[0] = ties
    w[1, :32] = 0.0  # all-zero group -> epsilon scale
    w[2] = -np.abs(w[2])  # groups whose max is below zero
    return w


CASES = [
    # (weight dtype, library scale_dtype, shape)
    ("float32", None, (16, 128)),
    ("bfloat16", None, (24, 256)),  # Kimi-K2.5: bf16 weights -> bf16 scales
    ("float32", "bfloat16", (8, 64)),  # fp32 master weights exported with bf16 scales
]


def _case(weight_dtype: str, scale_dtype: str | None, shape: tuple[int, int], seed: int = 0):
    w32 = _weights(np.random.default_rng(seed), *shape)
    w_t = torch.from_numpy(w32).to(getattr(torch, weight_dtype))
    lib = _library_int4(w_t, None if scale_dtype is None else getattr(torch, scale_dtype))
    return torch_to_numpy(w_t), lib


def _bits(x: np.ndarray) -> np.ndarray:
    """Raw bits of a float array, for bitwise comparisons."""
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# ---------------------------------------------------------------------------
# INT4 vs compressed-tensors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("weight_dtype,scale_dtype,shape", CASES)
def test_int4_matches_library(weight_dtype, scale_dtype, shape):
    w, lib = _case(weight_dtype, scale_dtype, shape)
    out_f, in_f = shape
    assert lib["packed"].dtype == np.int32 and lib["packed"].shape == (out_f, in_f // 8)

    # unpack(library words) == library ints
    ours_ints = quant_np.unpack_int4_np(lib["packed"])
    assert ours_ints.dtype == np.int8
    np.testing.assert_array_equal(ours_ints, lib["ints"])

    # pack(library ints) == library words, bitwise
    np.testing.assert_array_equal(quant_np.pack_int4_np(lib["ints"]), lib["packed"])

    # dequant == library decompress, bitwise in the library's output dtype
    ours_w = quant_np.dequant_int4_np(lib["packed"], lib["scale"], dtype=lib["weight"].dtype)
    np.testing.assert_array_equal(_bits(ours_w), _bits(lib["weight"]))

    # quantize == library scale computation + compressor, bitwise
    packed, scale = quant_np.quantize_int4_np(
        w, scale_dtype=None if scale_dtype is None else getattr(ml_dtypes, scale_dtype)
    )
    np.testing.assert_array_equal(packed, lib["packed"])
    np.testing.assert_array_equal(scale.astype(np.float32), lib["scale"].astype(np.float32))

    # jax versions == numpy versions
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.unpack_int4)(lib["packed"])), ours_ints)
    out_dtype = jnp.dtype(lib["weight"].dtype)
    ours_w_jax = jax.jit(quant.dequant_int4, static_argnums=2)(
        jnp.asarray(lib["packed"]), jnp.asarray(lib["scale"]), out_dtype
    )
    np.testing.assert_array_equal(_bits(np.asarray(ours_w_jax)), _bits(ours_w))


def test_edge_rows_quantize_as_documented():
    w = _weights(np.random.default_rng(1), 4, 64)
    packed, scale = quant_np.quantize_int4_np(w)
    q = quant_np.unpack_int4_np(packed)
    assert scale[0, 0] == 1.0
    # 7.5 -> 7 (clip), -7.5 -> -8, 2.5 -> 2, -2.5 -> -2, .5 -> 0, 1.5 -> 2, 3.5 -> 4
    np.testing.assert_array_equal(q[0, :8], [7, -8, 2, -2, 0, 0, 2, 4])
    assert scale[1, 0] == np.finfo(np.float32).eps
    np.testing.assert_array_equal(q[1, :32], 0)


def test_nibble_order_known_answer():
    # Word j holds elements 8j..8j+7, element 8j+k in bits 4k..4k+3, offset 8.
    q = np.array([[-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7]], np.int8)
    packed = quant_np.pack_int4_np(q)
    assert packed.view(np.uint32).tolist() == [[0x76543210, 0xFEDCBA98]]
    np.testing.assert_array_equal(quant_np.unpack_int4_np(packed), q)
    np.testing.assert_array_equal(pack_to_int32(torch.from_numpy(q), 4).numpy(), packed)


@pytest.mark.parametrize("shape", [(5, 13), (3, 1), (2, 7, 9), (4, 6, 64)])
def test_pack_odd_widths_and_experts_match_library(shape):
    rng = np.random.default_rng(2)
    q = rng.integers(-8, 8, size=shape, dtype=np.int8)
    lib_packed = pack_to_int32(torch.from_numpy(q), 4).numpy()
    packed = quant_np.pack_int4_np(q)
    assert packed.shape == (*shape[:-1], -(-shape[-1] // 8))
    np.testing.assert_array_equal(packed, lib_packed)
    np.testing.assert_array_equal(quant_np.unpack_int4_np(packed, in_features=shape[-1]), q)
    lib_q = unpack_from_int32(torch.from_numpy(packed), 4, torch.Size(shape)).numpy()
    np.testing.assert_array_equal(lib_q, q)


def test_jax_experts_batch_matches_numpy():
    rng = np.random.default_rng(3)
    experts, out_f, in_f = 4, 16, 96
    q = rng.integers(-8, 8, size=(experts, out_f, in_f), dtype=np.int8)
    packed = quant_np.pack_int4_np(q)
    scale = rng.uniform(1e-3, 1e-1, size=(experts, out_f, in_f // 32)).astype(ml_dtypes.bfloat16)

    np.testing.assert_array_equal(np.asarray(jax.jit(quant.unpack_int4)(packed)), q)
    for dtype in (jnp.float32, jnp.bfloat16):
        ref = quant_np.dequant_int4_np(packed, scale, dtype=dtype)
        got = jax.jit(quant.dequant_int4, static_argnums=2)(packed, scale, dtype)
        assert got.dtype == dtype and got.shape == (experts, out_f, in_f)
        np.testing.assert_array_equal(_bits(np.asarray(got)), _bits(ref))

    # Native int4 view used for the GPU kernel: same integers.
    q4 = jax.jit(quant.packed_to_int4)(packed)
    assert q4.dtype == jnp.int4 and q4.shape == q.shape
    np.testing.assert_array_equal(np.asarray(q4.astype(jnp.int8)), q)


def test_int4_shape_errors():
    packed = np.zeros((4, 8), np.int32)  # 64 inputs -> 2 groups
    with pytest.raises(ValueError, match=r"expected shape \(4, 2\).*found \(4, 3\)"):
        quant_np.dequant_int4_np(packed, np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match=r"expected shape \(4, 2\).*found \(4, 3\)"):
        quant.dequant_int4(jnp.asarray(packed), jnp.ones((4, 3), jnp.float32))
    with pytest.raises(ValueError, match=r"expected shape \(4, 2\).*found \(5, 2\)"):
        quant_np.dequant_int4_np(packed, np.ones((5, 2), np.float32))
    with pytest.raises(ValueError, match=r"in_features=70 needs .*9 int32 words.*found 8"):
        quant_np.unpack_int4_np(packed, in_features=70)
    with pytest.raises(ValueError, match=r"expected dtype int32, found int64"):
        quant_np.unpack_int4_np(packed.astype(np.int64))
    with pytest.raises(ValueError, match=r"expected values in \[-8, 7\], found range \[-9, 3\]"):
        quant_np.pack_int4_np(np.array([[-9, 3]], np.int8))
    with pytest.raises(ValueError, match=r"multiple of group_size=32, found 40"):
        quant_np.quantize_int4_np(np.zeros((2, 40), np.float32))


# ---------------------------------------------------------------------------
# FP8 vs transformers
# ---------------------------------------------------------------------------


def _fp8_case(rng, shape, block=(128, 128)):
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    w_t = torch.from_numpy(rng.normal(scale=2.0, size=shape).astype(np.float32)).to(torch.float8_e4m3fn)
    s_t = torch.from_numpy(rng.uniform(1e-4, 1e-2, size=grid).astype(np.float32))
    return w_t, s_t


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (129, 1), (7, 130), (128, 128)])
def test_fp8_block_dequant_matches_transformers(shape):
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    w_t, s_t = _fp8_case(np.random.default_rng(4), shape)

    # transformers' blockwise dequant (handles partial edge blocks).
    ref = fp8._dequantize_fp8_weight(w_t, s_t, [128, 128], torch.float32).numpy()
    ours = quant_np.dequant_fp8_block_np(torch_to_numpy(w_t), s_t.numpy())
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_array_equal(_bits(ours), _bits(ref))

    if shape[0] % 128 == 0 and shape[1] % 128 == 0:
        # The checkpoint-loading converter only accepts whole blocks.
        ref2 = fp8.Fp8Dequantize(None)._dequantize_one(w_t, s_t, output_dtype=torch.float32)
        np.testing.assert_array_equal(_bits(ours), _bits(ref2.numpy()))

    # Raw uint8 bits are accepted as well.
    raw = w_t.view(torch.uint8).numpy()
    np.testing.assert_array_equal(quant_np.dequant_fp8_block_np(raw, s_t.numpy()), ours)


def test_fp8_shape_errors():
    w = np.zeros((130, 256), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"expected shape \(2, 2\).*found \(1, 2\)"):
        quant_np.dequant_fp8_block_np(w, np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match=r"expected dtype float8_e4m3fn.*found float32"):
        quant_np.dequant_fp8_block_np(w.astype(np.float32), np.ones((2, 2), np.float32))


def test_safetensors_bf16_fp8_roundtrip(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    rng = np.random.default_rng(5)
    tensors = {
        "w_fp8": torch.from_numpy(rng.normal(size=(4, 8)).astype(np.float32)).to(torch.float8_e4m3fn),
        "s_bf16": torch.from_numpy(rng.normal(size=(3,)).astype(np.float32)).to(torch.bfloat16),
        "packed": torch.from_numpy(rng.integers(-(2**31), 2**31 - 1, size=(2, 4), dtype=np.int32)),
    }
    path = tmp_path / "x.safetensors"
    safetensors_torch.save_file(tensors, str(path))
    with safe_open(str(path), framework="pt") as f:
        loaded = {k: torch_to_numpy(f.get_tensor(k)) for k in f.keys()}
    assert loaded["w_fp8"].dtype == ml_dtypes.float8_e4m3fn
    assert loaded["s_bf16"].dtype == ml_dtypes.bfloat16
    for k, t in tensors.items():
        expected = t.float().numpy() if t.is_floating_point() else t.numpy()
        np.testing.assert_array_equal(loaded[k].astype(expected.dtype), expected)
