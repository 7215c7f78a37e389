"""Numpy versions of the quantized formats, for the offline converter and exporter.

The formats (compressed-tensors pack-quantized INT4, DeepSeek-V3 FP8 blocks) are
described in :mod:`jaxspec.quant`, which holds the in-``jit`` unpacking the model
runs and the shape checks shared with this module. Here: unpack / pack /
dequantize / quantize INT4 with numpy and ml_dtypes (the exporter writes INT4,
the converter and tests read it), and dequantize FP8 block weights (the
converter turns them into bf16/fp32 leaves).
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from jaxspec import quant

# ---------------------------------------------------------------------------
# INT4
# ---------------------------------------------------------------------------

_SHIFTS_NP = np.arange(quant.NIBBLES_PER_WORD, dtype=np.uint32) * 4


def unpack_int4_np(packed: np.ndarray, in_features: int | None = None) -> np.ndarray:
    """Unpack pack-quantized INT4 words into signed values.

    Args:
      packed: int32 ``[..., out, ceil(in / 8)]``.
      in_features: unpacked input width (``weight_shape[-1]``). Defaults to
        ``8 * packed.shape[-1]``; pass it when ``in`` is not a multiple of 8.

    Returns:
      int8 ``[..., out, in]`` with values in ``[-8, 7]``.
    """
    packed = np.asarray(packed)
    if packed.dtype not in (np.int32, np.uint32):
        raise ValueError(f"packed: expected dtype int32, found {packed.dtype}")
    n_in = quant.resolve_in_features(packed.shape, in_features)
    words = packed.view(np.uint32)
    nibbles = (words[..., None] >> _SHIFTS_NP) & np.uint32(0xF)  # [..., out, W, 8]
    q = nibbles.astype(np.int8) - np.int8(quant.INT4_OFFSET)
    return q.reshape(*packed.shape[:-1], -1)[..., :n_in]


def pack_int4_np(q: np.ndarray) -> np.ndarray:
    """Pack signed INT4 values into pack-quantized int32 words.

    Inverse of :func:`unpack_int4_np`; bit-identical to compressed-tensors'
    ``pack_to_int32(q, num_bits=4)``, including its zero padding of the last
    word when ``in`` is not a multiple of 8.

    Args:
      q: integer ``[..., out, in]`` with values in ``[-8, 7]``.

    Returns:
      int32 ``[..., out, ceil(in / 8)]``.
    """
    q = np.asarray(q)
    if not np.issubdtype(q.dtype, np.integer):
        raise ValueError(f"q: expected an integer dtype, found {q.dtype}")
    if q.ndim < 2:
        raise ValueError(f"q: expected shape [..., out, in] (at least 2 dims), found {q.shape}")
    if q.size and (q.min() < quant.INT4_MIN or q.max() > quant.INT4_MAX):
        raise ValueError(
            f"q: expected values in [{quant.INT4_MIN}, {quant.INT4_MAX}], found range [{q.min()}, {q.max()}]"
        )
    n_in = q.shape[-1]
    nibbles = (q.astype(np.int32) + quant.INT4_OFFSET).astype(np.uint32)
    pad = quant.packed_words(n_in) * quant.NIBBLES_PER_WORD - n_in
    if pad:
        # Raw nibble 0 (not the offset 8), as compressed-tensors pads.
        nibbles = np.pad(nibbles, [(0, 0)] * (q.ndim - 1) + [(0, pad)])
    nibbles = nibbles.reshape(*q.shape[:-1], -1, quant.NIBBLES_PER_WORD)
    words = np.bitwise_or.reduce(nibbles << _SHIFTS_NP, axis=-1)
    return words.astype(np.uint32).view(np.int32)


def dequant_int4_np(
    packed: np.ndarray,
    scale: np.ndarray,
    *,
    in_features: int | None = None,
    group_size: int = quant.INT4_GROUP_SIZE,
    dtype: Any = np.float32,
) -> np.ndarray:
    """Dequantize pack-quantized INT4 weights.

    The product ``q * scale`` is formed in float32, where it is exact for
    bf16/fp16 scales, and then cast once to ``dtype``; this matches
    compressed-tensors' ``decompress`` bit for bit.

    Args:
      packed: int32 ``[..., out, ceil(in / 8)]``.
      scale: float ``[..., out, ceil(in / group_size)]`` (bf16 in Kimi-K2.5).
      in_features: unpacked input width; defaults to ``8 * packed.shape[-1]``.
      group_size: inputs per scale.
      dtype: output dtype (numpy or ml_dtypes).

    Returns:
      ``[..., out, in]`` array of ``dtype``.
    """
    packed = np.asarray(packed)
    scale = np.asarray(scale)
    n_in = quant.resolve_in_features(packed.shape, in_features)
    quant.check_scale_shape(packed.shape, scale.shape, n_in, group_size)
    q = unpack_int4_np(packed, n_in).astype(np.float32)
    s = np.repeat(scale.astype(np.float32), group_size, axis=-1)[..., :n_in]
    return (q * s).astype(dtype)


def quantize_int4_np(
    w: np.ndarray,
    group_size: int = quant.INT4_GROUP_SIZE,
    scale_dtype: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric group-wise INT4 quantization into the pack-quantized format.

    Follows compressed-tensors' symmetric INT recipe so that our exports match
    what its compressor writes:

    * ``scale = max|w| / 7.5`` per group (the INT4 range ``[-8, 7]`` is 15
      wide, halved), rounded to ``scale_dtype``; an all-zero group gets the
      machine epsilon of ``scale_dtype`` to avoid dividing by zero.
    * ``q = round_half_even(clip(w / scale, -8, 7))``. Note ``+max|w|`` maps to
      7.5 and clips to 7, while ``-max|w|`` maps to -8.
    * The division is done in float32, except for bf16 weights, where (like the
      library operating on bf16 tensors) the quotient is rounded to bf16 first.

    Args:
      w: float ``[..., out, in]``; ``in`` must be a multiple of ``group_size``.
      group_size: inputs per scale.
      scale_dtype: dtype of the returned scales. Defaults to ``w``'s dtype for
        float32 / bf16 / fp16 weights (what the library does), else float16.
        Kimi-K2.5 checkpoints use ``ml_dtypes.bfloat16``.

    Returns:
      ``(packed, scale)``: int32 ``[..., out, in / 8]`` and
      ``scale_dtype`` ``[..., out, in / group_size]``.
    """
    w = np.asarray(w)
    if w.ndim < 2:
        raise ValueError(f"w: expected shape [..., out, in] (at least 2 dims), found {w.shape}")
    n_in = w.shape[-1]
    if n_in % group_size:
        raise ValueError(f"w: input width must be a multiple of group_size={group_size}, found {n_in}")
    if scale_dtype is None:
        supported = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
        scale_dtype = w.dtype if w.dtype in supported else np.float16
    scale_dtype = np.dtype(scale_dtype)

    groups = w.astype(np.float32).reshape(*w.shape[:-1], n_in // group_size, group_size)
    absmax = np.max(np.abs(groups), axis=-1)
    half_range = np.float32((quant.INT4_MAX - quant.INT4_MIN) / 2)  # 7.5
    scale_f32 = absmax / half_range
    if w.dtype == np.dtype(ml_dtypes.bfloat16):
        # The library computes the scale in the weight's dtype.
        scale_f32 = scale_f32.astype(ml_dtypes.bfloat16).astype(np.float32)
    finfo = ml_dtypes.finfo(scale_dtype)
    scale = np.clip(scale_f32, float(finfo.min), float(finfo.max)).astype(scale_dtype)
    scale = np.where(scale == 0, np.asarray(finfo.eps, dtype=scale_dtype), scale)

    quotient = groups / scale.astype(np.float32)[..., None]
    if w.dtype == np.dtype(ml_dtypes.bfloat16):
        quotient = quotient.astype(ml_dtypes.bfloat16).astype(np.float32)
    q = np.rint(np.clip(quotient, quant.INT4_MIN, quant.INT4_MAX)).astype(np.int8)
    return pack_int4_np(q.reshape(w.shape)), scale


# ---------------------------------------------------------------------------
# FP8 block quantization (DeepSeek-V3)
# ---------------------------------------------------------------------------


def dequant_fp8_block_np(
    w: np.ndarray,
    scale_inv: np.ndarray,
    block: tuple[int, int] = quant.FP8_BLOCK,
) -> np.ndarray:
    """Dequantize a DeepSeek-V3 FP8 block-quantized weight.

    ``out[o, i] = float32(w[o, i]) * scale_inv[o // block[0], i // block[1]]``,
    with partial blocks at the bottom/right edge when the shape is not a
    multiple of ``block``.

    Args:
      w: ``ml_dtypes.float8_e4m3fn`` ``[..., out, in]`` (uint8 holding the raw
        e4m3fn bits is also accepted).
      scale_inv: float32 ``[..., ceil(out / block[0]), ceil(in / block[1])]``.
      block: ``(rows, cols)`` per scale.

    Returns:
      float32 ``[..., out, in]``.
    """
    w = np.asarray(w)
    scale_inv = np.asarray(scale_inv)
    if w.dtype == np.uint8:
        w = w.view(ml_dtypes.float8_e4m3fn)
    if w.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
        raise ValueError(f"w: expected dtype float8_e4m3fn (or raw uint8), found {w.dtype}")
    if w.ndim < 2:
        raise ValueError(f"w: expected shape [..., out, in] (at least 2 dims), found {w.shape}")
    rows, cols = w.shape[-2:]
    br, bc = block
    grid = (math.ceil(rows / br), math.ceil(cols / bc))
    expected = (*w.shape[:-2], *grid)
    if scale_inv.shape != expected:
        raise ValueError(
            f"scale_inv: expected shape {expected} for w {w.shape} with block {block}, found {scale_inv.shape}"
        )
    # Pad to whole blocks so the scale broadcasts over a [R, br, C, bc] view.
    pad = [(0, 0)] * (w.ndim - 2) + [(0, grid[0] * br - rows), (0, grid[1] * bc - cols)]
    wf = np.pad(w.astype(np.float32), pad)
    wf = wf.reshape(*w.shape[:-2], grid[0], br, grid[1], bc)
    wf *= scale_inv.astype(np.float32)[..., :, None, :, None]
    wf = wf.reshape(*w.shape[:-2], grid[0] * br, grid[1] * bc)
    return np.ascontiguousarray(wf[..., :rows, :cols])
