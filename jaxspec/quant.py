"""Quantized weight formats used by the Kimi-K2.5 / DeepSeek-V3 checkpoints.

Two formats appear in the checkpoints:

INT4 "pack-quantized" (compressed-tensors; Kimi-K2.5 routed experts)
    Each projection ``[out, in]`` is stored as

    * ``weight_packed`` int32 ``[out, ceil(in / 8)]``: eight 4-bit values per
      word, packed along the input dim, least-significant nibble first
      (element ``8 * j + k`` sits in bits ``4k .. 4k + 3`` of word ``j``).
      Nibbles carry an offset of 8: ``nibble = q + 8`` for ``q`` in ``[-8, 7]``.
    * ``weight_scale`` (bf16 in Kimi) ``[out, in / 32]``: one scale per group of
      32 consecutive inputs; symmetric, so there is no zero point.
    * ``weight_shape`` int ``[2]``: the unpacked ``(out, in)``.

    Dequantized value: ``w[o, i] = (nibble[o, i] - 8) * scale[o, i // 32]``.

    When ``in`` is not a multiple of 8 the last word is padded with raw nibble
    0 (i.e. *before* the offset is applied, so padding reads back as -8 and
    must be cut off using ``weight_shape``).

FP8 block quantization (DeepSeek-V3 style, dense / attention weights)
    ``weight`` float8_e4m3fn ``[out, in]`` with ``weight_scale_inv`` float32
    ``[ceil(out / 128), ceil(in / 128)]``; the value is
    ``w[o, i] * weight_scale_inv[o // 128, i // 128]``.

The ``*_np`` functions are for the offline converter (numpy / ml_dtypes); the
functions without the suffix are jax.numpy versions meant to run inside
``jit`` on the model side. They are written with shifts and masks on int32
so XLA can fuse the unpack into the consumer (e.g. the matmul that reads the
dequantized weight) instead of materializing an int8 copy.

Reading checkpoints: ``safetensors``' numpy framework cannot return bf16 or
float8 tensors (safetensors 0.8: ``BF16`` raises ``TypeError``, ``F8_E4M3``
raises ``AttributeError``). Open the file with ``framework="pt"`` and convert
each tensor with :func:`torch_to_numpy`, which reinterprets the bits as
``ml_dtypes.bfloat16`` / ``ml_dtypes.float8_e4m3fn`` without rounding.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

INT4_GROUP_SIZE = 32
"""Inputs sharing one scale in Kimi-K2.5's INT4 expert weights."""

FP8_BLOCK = (128, 128)
"""``(rows, cols)`` covered by one ``weight_scale_inv`` entry in DeepSeek-V3 FP8."""

_NIBBLES_PER_WORD = 8
_INT4_OFFSET = 8  # stored nibble = q + 8
_INT4_MIN, _INT4_MAX = -8, 7
# XOR with 0x8 per nibble turns the offset-8 encoding into two's complement
# int4 (q + 8 and q differ exactly in the top bit of the nibble, mod 16).
_OFFSET_TO_TWOS_COMPLEMENT = np.int32(np.uint32(0x88888888).view(np.int32))


# ---------------------------------------------------------------------------
# Shape checks shared by the numpy and jax versions
# ---------------------------------------------------------------------------


def _packed_words(in_features: int) -> int:
    return -(-in_features // _NIBBLES_PER_WORD)


def _resolve_in_features(packed_shape: tuple[int, ...], in_features: int | None) -> int:
    """Number of unpacked inputs; checks it fits the packed width."""
    if len(packed_shape) < 2:
        raise ValueError(f"packed: expected shape [..., out, in/8] (at least 2 dims), found {packed_shape}")
    words = packed_shape[-1]
    if in_features is None:
        return words * _NIBBLES_PER_WORD
    if _packed_words(in_features) != words:
        raise ValueError(
            f"packed: in_features={in_features} needs ceil({in_features}/8)="
            f"{_packed_words(in_features)} int32 words per row, found {words}"
        )
    return in_features


def _check_scale_shape(
    packed_shape: tuple[int, ...],
    scale_shape: tuple[int, ...],
    in_features: int,
    group_size: int,
) -> None:
    expected = (*packed_shape[:-1], -(-in_features // group_size))
    if tuple(scale_shape) != expected:
        raise ValueError(
            f"scale: expected shape {expected} (packed {tuple(packed_shape)} holds "
            f"{in_features} inputs per row = {packed_shape[-1]} words x 8, "
            f"one scale per {group_size}), found {tuple(scale_shape)}"
        )


# ---------------------------------------------------------------------------
# INT4, numpy (converter side)
# ---------------------------------------------------------------------------

_SHIFTS_NP = np.arange(_NIBBLES_PER_WORD, dtype=np.uint32) * 4


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
    n_in = _resolve_in_features(packed.shape, in_features)
    words = packed.view(np.uint32)
    nibbles = (words[..., None] >> _SHIFTS_NP) & np.uint32(0xF)  # [..., out, W, 8]
    q = nibbles.astype(np.int8) - np.int8(_INT4_OFFSET)
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
    if q.size and (q.min() < _INT4_MIN or q.max() > _INT4_MAX):
        raise ValueError(f"q: expected values in [{_INT4_MIN}, {_INT4_MAX}], found range [{q.min()}, {q.max()}]")
    n_in = q.shape[-1]
    nibbles = (q.astype(np.int32) + _INT4_OFFSET).astype(np.uint32)
    pad = _packed_words(n_in) * _NIBBLES_PER_WORD - n_in
    if pad:
        # Raw nibble 0 (not the offset 8), as compressed-tensors pads.
        nibbles = np.pad(nibbles, [(0, 0)] * (q.ndim - 1) + [(0, pad)])
    nibbles = nibbles.reshape(*q.shape[:-1], -1, _NIBBLES_PER_WORD)
    words = np.bitwise_or.reduce(nibbles << _SHIFTS_NP, axis=-1)
    return words.astype(np.uint32).view(np.int32)


def dequant_int4_np(
    packed: np.ndarray,
    scale: np.ndarray,
    *,
    in_features: int | None = None,
    group_size: int = INT4_GROUP_SIZE,
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
    n_in = _resolve_in_features(packed.shape, in_features)
    _check_scale_shape(packed.shape, scale.shape, n_in, group_size)
    q = unpack_int4_np(packed, n_in).astype(np.float32)
    s = np.repeat(scale.astype(np.float32), group_size, axis=-1)[..., :n_in]
    return (q * s).astype(dtype)


def quantize_int4_np(
    w: np.ndarray,
    group_size: int = INT4_GROUP_SIZE,
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
    half_range = np.float32((_INT4_MAX - _INT4_MIN) / 2)  # 7.5
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
    q = np.rint(np.clip(quotient, _INT4_MIN, _INT4_MAX)).astype(np.int8)
    return pack_int4_np(q.reshape(w.shape)), scale


# ---------------------------------------------------------------------------
# INT4, jax (model side)
# ---------------------------------------------------------------------------


def unpack_int4(packed: jax.Array) -> jax.Array:
    """Unpack INT4 words inside jit.

    Args:
      packed: int32 ``[..., out, in / 8]`` (any leading dims, e.g. experts).

    Returns:
      int8 ``[..., out, in]`` in ``[-8, 7]``.
    """
    if packed.ndim < 2 or packed.dtype != jnp.int32:
        raise ValueError(f"packed: expected int32 [..., out, in/8], found {packed.dtype} {tuple(packed.shape)}")
    # Shift as uint32 (logical shift) so the word's sign bit never leaks into
    # a nibble; the bitcast is free.
    words = jax.lax.bitcast_convert_type(packed, jnp.uint32)
    shifts = jnp.arange(_NIBBLES_PER_WORD, dtype=jnp.uint32) * 4
    nibbles = (words[..., None] >> shifts) & jnp.uint32(0xF)  # [..., out, in/8, 8]
    q = nibbles.astype(jnp.int8) - jnp.int8(_INT4_OFFSET)
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * _NIBBLES_PER_WORD)


def dequant_int4(
    packed: jax.Array,
    scale: jax.Array,
    dtype: Any = jnp.bfloat16,
    *,
    group_size: int = INT4_GROUP_SIZE,
) -> jax.Array:
    """Dequantize INT4 weights inside jit (same numbers as :func:`dequant_int4_np`).

    Args:
      packed: int32 ``[..., out, in / 8]``.
      scale: float ``[..., out, in / group_size]``.
      dtype: output dtype.
      group_size: inputs per scale; ``in`` must be a multiple of it.

    Returns:
      ``[..., out, in]`` array of ``dtype``.
    """
    n_in = _resolve_in_features(tuple(packed.shape), None)
    _check_scale_shape(tuple(packed.shape), tuple(scale.shape), n_in, group_size)
    if n_in % group_size:
        raise ValueError(f"packed: input width {n_in} must be a multiple of group_size={group_size}")
    q = unpack_int4(packed).astype(jnp.float32)
    q = q.reshape(*packed.shape[:-1], n_in // group_size, group_size)
    w = q * scale.astype(jnp.float32)[..., None]
    return w.reshape(*packed.shape[:-1], n_in).astype(dtype)


def packed_to_int4(packed: jax.Array) -> jax.Array:
    """Reinterpret pack-quantized words as a native ``jnp.int4`` array.

    XLA's int4 storage is two's complement, least-significant nibble first, so
    the conversion is one XOR per word plus a bitcast; no element moves. Use it
    once at load time for consumers that take int4 directly (the tokamax
    grouped matmul); the result occupies the same bytes as ``packed``.

    Args:
      packed: int32 ``[..., out, in / 8]``.

    Returns:
      int4 ``[..., out, in]``.
    """
    if packed.ndim < 2 or packed.dtype != jnp.int32:
        raise ValueError(f"packed: expected int32 [..., out, in/8], found {packed.dtype} {tuple(packed.shape)}")
    twos = packed ^ jnp.int32(_OFFSET_TO_TWOS_COMPLEMENT)
    q = jax.lax.bitcast_convert_type(twos, jnp.int4)  # [..., out, in/8, 8]
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * _NIBBLES_PER_WORD)


# ---------------------------------------------------------------------------
# FP8 block quantization (DeepSeek-V3)
# ---------------------------------------------------------------------------


def dequant_fp8_block_np(
    w: np.ndarray,
    scale_inv: np.ndarray,
    block: tuple[int, int] = FP8_BLOCK,
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


def torch_to_numpy(t: Any) -> np.ndarray:
    """Convert a CPU torch tensor to numpy, keeping bf16 / float8 bits exact.

    ``Tensor.numpy()`` refuses bf16 and float8; this views them as same-width
    integers and reinterprets the bits as the matching ml_dtypes type.
    """
    import torch  # local: only the converter needs torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    if t.dtype == torch.float8_e5m2:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e5m2)
    return t.numpy()
