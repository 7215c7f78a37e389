"""Logical axis names and the one table that maps them onto the device mesh.

Dimension glossary (also used as shape suffixes in variable names):
  B batch      T tokens of this call   S cache slots       D hidden (embed)
  V vocab      H attention heads       K head dim          C latent (kv_lora + rope)
  Q q_lora     L kv_lora               E routed experts    F expert/MLP intermediate
  G groups of a grouped matmul         N draft-tree nodes

Parameters carry logical axis names (`vocab`, `embed`, `heads`, ...). The mesh
has two axes: `data` (batch) and `model` (tensor/expert parallel). Changing the
sharding of the target is a one-line change to `RULES`. The EAGLE-3 draft is
replicated on every device (no rule mentions it), so a draft step needs no
collectives.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA, MODEL = "data", "model"

RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", DATA),
    ("vocab", MODEL),       # embedding and lm_head split over vocab
    ("heads", MODEL),       # attention split over heads
    ("mlp", MODEL),         # dense MLP / shared expert split within
    ("expert", MODEL),      # routed experts split across devices
    ("embed", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("head_dim", None),
    ("moe_mlp", None),
    ("norm", None),
    ("packed", None),
    ("groups", None),
)


def make_mesh(num_devices: int | None = None, data: int = 1) -> Mesh:
    """A (data, model) mesh over the first `num_devices` devices (all by default)."""
    devices = jax.devices()
    n = num_devices or len(devices)
    if n > len(devices):
        raise ValueError(f"mesh needs {n} devices, found {len(devices)} ({jax.default_backend()})")
    if n % data:
        raise ValueError(f"data axis {data} does not divide {n} devices")
    return Mesh(np.array(devices[:n]).reshape(data, n // data), (DATA, MODEL))


def logical_spec(axes: tuple[str | None, ...]) -> P:
    return nn.logical_to_mesh_axes(axes, RULES)


def param_shardings(logical_specs, mesh: Mesh):
    """Tree of logical PartitionSpecs -> tree of NamedShardings on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, RULES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
