"""Logical axis names and the one table that maps them onto the device mesh.

Dimension glossary (also used as shape suffixes in variable names):
  B batch      T tokens of this call   S cache slots       D hidden (embed)
  V vocab      H attention heads       K head dim          C latent (kv_lora + rope)
  Q q_lora     L kv_lora               E routed experts    F expert/MLP intermediate
  G groups of a grouped matmul         N draft-tree nodes

Every placement decision goes through `RULES`: parameters carry logical axis
names (`vocab`, `heads`, `expert`, ...), and so do the target and draft caches,
the activations constrained at layer boundaries and the `shard_map` specs of the
routed-expert layer. A packed INT4 dimension (8 values per int32 word) or a
dimension of group scales carries the name of the dimension it packs, so it
splits with it. Names not in the table are replicated.

The mesh has two axes: `data` (batch) and `model` (tensor / expert parallel).
A different sharding is a change to the table: for instance experts split
within rather than across devices is `("expert", None), ("moe_mlp", MODEL)`.

The EAGLE-3 draft is replicated by default: its names map to nothing, and its
computations run under a `shard_map` over replicated inputs, so a draft step
has no collectives. `rules_for("sharded")` splits the draft's heads, MLP and
vocab over `model` as the target is split (what SGLang does).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.cli import UsageError

DATA, MODEL = "data", "model"

Rules = tuple[tuple[str, str | None], ...]

RULES: Rules = (
    ("batch", DATA),  # activations and caches
    ("vocab", MODEL),  # target embedding and lm_head split over vocab
    ("heads", MODEL),  # target attention split over heads
    ("mlp", MODEL),  # dense MLP and shared expert split within
    ("expert", MODEL),  # routed experts split across devices
    ("moe_mlp", None),  # ... not within an expert
    ("draft_heads", None),  # the draft: replicated (see rules_for)
    ("draft_kv_heads", None),
    ("draft_mlp", None),
    ("draft_vocab", None),
)

DRAFT_PLACEMENTS = ("replicated", "sharded")
_DRAFT_SHARDED = {"draft_heads": MODEL, "draft_kv_heads": MODEL, "draft_mlp": MODEL, "draft_vocab": MODEL}

# Logical axes of activations and caches (parameters declare theirs where they are made).
HIDDEN_BTD = ("batch", None, "embed")
LATENT_CACHE_LBSC = ("layers", "batch", None, None)
DRAFT_CACHE_BSHK = ("batch", None, "draft_kv_heads", None)
TOKENS_TD = ("batch", "embed")


def rules_for(draft_placement: str = "replicated", base: Rules = RULES) -> Rules:
    """`base` with the draft's names mapped for `draft_placement` ('replicated' or 'sharded')."""
    if draft_placement not in DRAFT_PLACEMENTS:
        raise ValueError(f"draft_placement: expected one of {DRAFT_PLACEMENTS}, found {draft_placement!r}")
    if draft_placement == "replicated":
        return base
    return tuple((name, _DRAFT_SHARDED.get(name, axis)) for name, axis in base)


def mesh_axis(name: str, rules: Rules = RULES) -> str | None:
    """The mesh axis a logical name maps to (None: replicated)."""
    return dict(rules).get(name)


def logical_spec(axes: tuple[str | None, ...], rules: Rules = RULES) -> P:
    return nn.logical_to_mesh_axes(axes, rules)


def named(mesh: Mesh, axes: tuple[str | None, ...], rules: Rules = RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(axes, rules))


def param_shardings(logical_specs, mesh: Mesh, rules: Rules = RULES):
    """Tree of logical PartitionSpecs -> tree of NamedShardings on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def constrain(x, mesh: Mesh | None, axes: tuple[str | None, ...], rules: Rules = RULES):
    """`with_sharding_constraint` to the table's sharding of `axes` (a no-op without a mesh)."""
    if mesh is None or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, named(mesh, axes, rules))


ORDERED_SUMS = True
"""Whether the target's sums over the mesh (`ordered_psum`) add each element in device order, or are `psum`s
whose order the collective library picks (False: an A/B switch for timings on a real mesh)."""
GATHER_BYTES = 4 << 20  # `ordered_psum`: at most this many bytes of terms gathered on a device, one all-gather


def ordered_psum(x, axes, dtype=None):
    """The sum of ``x`` over the mesh ``axes`` (inside a `shard_map`), each element's terms added in float32 in
    device order (device 0's first) and rounded once to ``dtype`` (default x's).

    A token's row then has the same bits whatever the number of rows summed with it. A `psum` leaves the order
    to the collective library, which may choose it by the message's size (NCCL picks its channels, and with them
    the tree an element is reduced along, by the size), so that a row could differ between a decode step (one
    token a sequence) and a verify (several): speculative decoding would no longer be lossless on a mesh. On the
    CPU, `psum` adds in device order in float32 too, so the two have the same bits there (tested).

    Up to `GATHER_BYTES` of terms a device: one all-gather of every device's terms, summed on each device. Above
    (one mesh axis): an all-to-all hands each device one slice of every device's terms, it sums them, and an
    all-gather collects the sums (the bytes of a ring all-reduce in two collectives). The order, and so the
    bits, are the same either way: the sum is rounded to ``dtype`` with `jax.lax.reduce_precision` as well as a
    cast in both forms, since XLA's default allows excess precision and may drop a cast's rounding where the
    value meets a float32 op in one fusion (the gathered form's), not where it crosses a collective (the other's).
    More than one mesh axis: always the one all-gather (n x the terms' bytes on each device)."""
    axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
    dtype = jnp.dtype(dtype or x.dtype)
    if not axes:
        return x.astype(dtype)
    if not ORDERED_SUMS:
        return jax.lax.psum(x, axes).astype(dtype)
    n = math.prod(jax.lax.axis_size(a) for a in axes)

    def in_order(terms):  # [n, ...] -> the float32 sum of terms[0], terms[1], ... in that order
        acc = terms[0].astype(jnp.float32)
        for i in range(1, n):
            acc = acc + terms[i].astype(jnp.float32)
        return acc

    def rounded(acc):  # rounded to dtype by an op XLA keeps: a convert pair f32 -> bf16 -> f32 it may drop
        if dtype != jnp.float32 and jnp.issubdtype(dtype, jnp.floating):
            info = jnp.finfo(dtype)
            acc = jax.lax.reduce_precision(acc, exponent_bits=info.nexp, mantissa_bits=info.nmant)
        return acc.astype(dtype)

    if len(axes) > 1 or n * x.size * x.dtype.itemsize <= GATHER_BYTES:
        return rounded(in_order(jax.lax.all_gather(x, axes, axis=0)))
    flat = x.reshape(-1)
    pad = -flat.size % n
    chunks = jnp.pad(flat, (0, pad)).reshape(n, -1)  # chunk j: the slice device j sums
    mine = rounded(in_order(jax.lax.all_to_all(chunks, axes[0], 0, 0, tiled=True)))
    return jax.lax.all_gather(mine, axes[0], axis=0, tiled=True)[: x.size].reshape(x.shape)


def shards(mesh: Mesh | None, name: str, rules: Rules = RULES) -> int:
    """How many pieces the table cuts a logical dimension into on `mesh`."""
    axis = mesh_axis(name, rules)
    return 1 if mesh is None or axis is None else int(mesh.shape[axis])


# ---------------------------------------------------------------------------
# Mesh size


def split_dims(cfg, draft_cfg=None) -> dict[str, list[int]]:
    """Sizes of every dimension carrying each logical name that the table may split.

    `cfg` is the target's ModelConfig, `draft_cfg` the draft's DraftConfig (or None).
    """
    dims = {
        "heads": [cfg.num_heads],
        "vocab": [cfg.vocab_size],
        "mlp": [cfg.intermediate_size]
        + ([cfg.moe_intermediate_size * cfg.num_shared_experts] if cfg.num_shared_experts else []),
        "expert": [cfg.local_experts] if cfg.num_experts else [],
        "moe_mlp": [cfg.moe_intermediate_size] if cfg.num_experts else [],
    }
    if cfg.expert_format is not None and cfg.num_experts:
        # Packed words (8 values) and group scales split with the dimension they pack.
        dims["moe_mlp"] += [cfg.moe_intermediate_size // 8, cfg.moe_intermediate_size // cfg.expert_format.group_size]
    if draft_cfg is not None:
        dims.update(
            {
                "draft_heads": [draft_cfg.num_heads],
                "draft_kv_heads": [draft_cfg.num_kv_heads],
                "draft_mlp": [draft_cfg.intermediate_size],
                "draft_vocab": [draft_cfg.draft_vocab_size],
            }
        )
    return dims


def _model_split(dims: dict[str, list[int]], rules: Rules) -> dict[str, list[int]]:
    return {name: sizes for name, sizes in dims.items() if mesh_axis(name, rules) == MODEL and sizes}


def largest_divisor(dims: dict[str, list[int]], available: int, rules: Rules = RULES) -> int:
    """The largest device count <= `available` that divides every dimension split over `model`."""
    sizes = [s for v in _model_split(dims, rules).values() for s in v]
    g = math.gcd(*sizes) if sizes else available
    return max(n for n in range(1, available + 1) if g % n == 0)


class MeshError(UsageError):
    """A device count or mesh that cannot hold the model as the table splits it."""


def check_divides(dims: dict[str, list[int]], n: int, rules: Rules = RULES) -> None:
    """Raise MeshError naming the first dimension split over `model` that `n` devices do not divide."""
    for name, sizes in _model_split(dims, rules).items():
        for size in sizes:
            if size % n:
                best = largest_divisor(dims, n, rules)
                raise MeshError(
                    f"cannot split the model over {n} devices (--num-devices / num_devices): its "
                    f"'{name}' dimension has size {size}, which {n} does not divide "
                    f"(largest usable count up to {n}: {best})"
                )


def make_mesh(num_devices: int | None = None, data: int = 1, devices: Iterable | None = None) -> Mesh:
    """A (data, model) mesh over the first `num_devices` devices (all by default)."""
    devices = list(devices) if devices is not None else jax.devices()
    n = num_devices or len(devices)
    if n > len(devices):
        raise MeshError(f"mesh needs {n} devices, found {len(devices)} ({jax.default_backend()})")
    if n % data:
        raise MeshError(f"data axis {data} does not divide {n} devices")
    return Mesh(np.array(devices[:n]).reshape(data, n // data), (DATA, MODEL))
