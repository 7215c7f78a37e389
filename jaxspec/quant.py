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
    ``w[o, i] * weight_scale_inv[o // 128, i // 128]``. Only the converter meets
    these (it dequantizes them); the model never sees FP8.

This module holds what runs at inference: jax.numpy unpacking and
dequantization meant to run inside ``jit``, written with shifts and masks on
int32 so XLA can fuse the unpack into the consumer (e.g. the matmul that reads
the dequantized weight) instead of materializing an int8 copy. The numpy
versions for the offline converter and exporter (pack, quantize, dequantize,
FP8 block dequantization) live in :mod:`checkpoints_convert.quant_np` and share
the format constants and shape checks below.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

INT4_GROUP_SIZE = 32
"""Inputs sharing one scale in Kimi-K2.5's INT4 expert weights."""

FP8_BLOCK = (128, 128)
"""``(rows, cols)`` covered by one ``weight_scale_inv`` entry in DeepSeek-V3 FP8."""

NIBBLES_PER_WORD = 8
INT4_OFFSET = 8  # stored nibble = q + 8
INT4_MIN, INT4_MAX = -8, 7
# XOR with 0x8 per nibble turns the offset-8 encoding into two's complement
# int4 (q + 8 and q differ exactly in the top bit of the nibble, mod 16).
_OFFSET_TO_TWOS_COMPLEMENT = np.int32(np.uint32(0x88888888).view(np.int32))


# ---------------------------------------------------------------------------
# Shape checks shared with the numpy versions (checkpoints_convert.quant_np)
# ---------------------------------------------------------------------------


def packed_words(in_features: int) -> int:
    """int32 words per row that hold `in_features` nibbles."""
    return -(-in_features // NIBBLES_PER_WORD)


def resolve_in_features(packed_shape: tuple[int, ...], in_features: int | None) -> int:
    """Number of unpacked inputs; checks it fits the packed width."""
    if len(packed_shape) < 2:
        raise ValueError(f"packed: expected shape [..., out, in/8] (at least 2 dims), found {packed_shape}")
    words = packed_shape[-1]
    if in_features is None:
        return words * NIBBLES_PER_WORD
    if packed_words(in_features) != words:
        raise ValueError(
            f"packed: in_features={in_features} needs ceil({in_features}/8)="
            f"{packed_words(in_features)} int32 words per row, found {words}"
        )
    return in_features


def check_scale_shape(
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
# The INT4 weight type
# ---------------------------------------------------------------------------

ROWS = "rows"
"""Checkpoint layout (compressed-tensors pack-quantized): ``packed`` int32 ``[..., out, in/8]``,
``scale`` ``[..., out, in/group_size]`` in the model's float dtype."""

TILES = "tiles"
"""The fused kernel's layout (:func:`jaxspec.kernels.int4_moe.relayout`, lossless, same bytes):
``packed`` int32 ``[..., in/256, out, 32]``, ``scale`` int32 ``[..., in/256, out, 4]`` (pairs of
bf16 scales)."""

LAYOUTS = (ROWS, TILES)


@struct.dataclass
class Int4Weight:
    """INT4 weights of one projection ``[out, in]`` or of a stack of them (leading dims: experts,
    layers): a pytree whose two leaves are the arrays, with the group size and the layout static.

    Everything that holds INT4 weights passes this type: the model's parameter tree (flax
    parameters of the MoE layer), the checkpoint loader and converter (a node at path ``p`` is
    stored as the two leaves ``p_packed`` and ``p_scale``: the on-disk names of
    compressed-tensors' ``weight_packed`` / ``weight_scale``), the sharding table (its leaves
    carry the logical axes of the dimension each packs), the kernels (which read
    ``group_size`` from it) and the exporter. Leaves may be arrays, ShapeDtypeStructs,
    partition specs or shardings: any tree of the same structure.
    """

    packed: Any
    scale: Any
    group_size: int = struct.field(pytree_node=False, default=INT4_GROUP_SIZE)
    layout: str = struct.field(pytree_node=False, default=ROWS)

    LEAVES = ("packed", "scale")  # field names; also the on-disk suffixes (`gate_packed`, `gate_scale`)

    @property
    def lead(self) -> tuple[int, ...]:
        """The stack dims in front of one projection (experts, layers)."""
        return tuple(self.packed.shape[:-2] if self.layout == ROWS else self.packed.shape[:-3])

    @property
    def out_features(self) -> int:
        return int(self.packed.shape[-2])

    @property
    def in_features(self) -> int:
        if self.layout == ROWS:
            words = int(self.packed.shape[-1])
            return words if self.packed.dtype == jnp.int4 else words * NIBBLES_PER_WORD
        return int(self.packed.shape[-3]) * 256

    @property
    def nbytes(self) -> int:
        """Bytes the two arrays hold (the same in both layouts)."""
        size = lambda a: int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
        return size(self.packed) + size(self.scale)

    def check(self, name: str = "weight") -> Int4Weight:
        """Raise a ValueError naming `name` unless the two arrays agree with each other; returns self."""
        if self.layout not in LAYOUTS:
            raise ValueError(f"{name}: layout must be one of {LAYOUTS}, found {self.layout!r}")
        if self.packed.dtype != jnp.int32 and not (self.layout == ROWS and self.packed.dtype == jnp.int4):
            raise ValueError(
                f"{name}.packed: expected int32 words (or int4 values, rows layout), found {self.packed.dtype}"
            )
        if self.layout == ROWS and self.packed.dtype == jnp.int4:
            expected = (*self.packed.shape[:-1], -(-self.in_features // self.group_size))
            if tuple(self.scale.shape) != expected:
                raise ValueError(f"{name}.scale: expected shape {expected}, found {tuple(self.scale.shape)}")
            return self
        if self.layout == ROWS:
            try:
                check_scale_shape(tuple(self.packed.shape), tuple(self.scale.shape), self.in_features, self.group_size)
            except ValueError as e:
                raise ValueError(f"{name}.{e}") from None
            return self
        *lead, kb, n, words = self.packed.shape
        if words != 32 or self.group_size != 32:
            raise ValueError(
                f"{name}: the tiles layout holds groups of 32 in [..., in/256, out, 32] words, found group_size="
                f"{self.group_size} and packed {tuple(self.packed.shape)}"
            )
        expected = (*lead, kb, n, 4)
        if tuple(self.scale.shape) != expected or self.scale.dtype != jnp.int32:
            raise ValueError(
                f"{name}.scale: expected int32 {expected} (bf16 pairs for packed {tuple(self.packed.shape)}), "
                f"found {self.scale.dtype} {tuple(self.scale.shape)}"
            )
        return self

    def dequant(self, dtype: Any = jnp.bfloat16) -> jax.Array:
        """The float weights ``[..., out, in]`` (rows layout; inside jit)."""
        if self.layout != ROWS:
            raise ValueError(f"dequant reads the {ROWS!r} layout, found {self.layout!r} (int4_moe.restore it)")
        return dequant_int4(self.packed, self.scale, dtype, group_size=self.group_size)

    @classmethod
    def abstract(
        cls, lead: tuple[int, ...], out_features: int, in_features: int, scale_dtype, group_size: int = INT4_GROUP_SIZE
    ) -> Int4Weight:
        """ShapeDtypeStructs of a rows-layout weight stack (`lead` + ``[out, in]``)."""
        return cls(
            jax.ShapeDtypeStruct((*lead, out_features, packed_words(in_features)), jnp.int32),
            jax.ShapeDtypeStruct((*lead, out_features, -(-in_features // group_size)), scale_dtype),
            group_size,
        )


def is_int4(x) -> bool:
    return isinstance(x, Int4Weight)


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
    shifts = jnp.arange(NIBBLES_PER_WORD, dtype=jnp.uint32) * 4
    nibbles = (words[..., None] >> shifts) & jnp.uint32(0xF)  # [..., out, in/8, 8]
    q = nibbles.astype(jnp.int8) - jnp.int8(INT4_OFFSET)
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * NIBBLES_PER_WORD)


def dequant_int4(
    packed: jax.Array,
    scale: jax.Array,
    dtype: Any = jnp.bfloat16,
    *,
    group_size: int = INT4_GROUP_SIZE,
) -> jax.Array:
    """Dequantize INT4 weights inside jit (same numbers as :func:`checkpoints_convert.quant_np.dequant_int4_np`).

    Args:
      packed: int32 ``[..., out, in / 8]``.
      scale: float ``[..., out, in / group_size]``.
      dtype: output dtype.
      group_size: inputs per scale; ``in`` must be a multiple of it.

    Returns:
      ``[..., out, in]`` array of ``dtype``.
    """
    n_in = resolve_in_features(tuple(packed.shape), None)
    check_scale_shape(tuple(packed.shape), tuple(scale.shape), n_in, group_size)
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
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * NIBBLES_PER_WORD)
