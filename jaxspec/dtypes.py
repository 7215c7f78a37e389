"""The one table of dtype names: what `--dtype` flags, configs and checkpoint formats call a dtype.

Names are numpy's (`np.dtype(DTYPES[name]).name == name`); values are the jax.numpy scalar
types, which numpy accepts too (`np.dtype(jnp.bfloat16)` is ml_dtypes' bfloat16), so the
same table serves the model (jnp) and the converter and exporter (numpy).
"""

from __future__ import annotations

import jax.numpy as jnp

DTYPES = {
    "float64": jnp.float64,
    "float32": jnp.float32,
    "float16": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
    "int64": jnp.int64,
    "int32": jnp.int32,
    "int16": jnp.int16,
    "int8": jnp.int8,
    "uint8": jnp.uint8,
    "bool": jnp.bool_,
}

COMPUTE_DTYPES = ("bfloat16", "float32")
"""What the model runs and stores unquantized weights in (the engine's and the converter's `dtype`)."""

EXPORT_DTYPES = ("bfloat16", "float32", "float16")
"""What the exporter writes floating weights as."""


def parse(name: str, allowed: tuple[str, ...] = COMPUTE_DTYPES, what: str = "dtype"):
    """`DTYPES[name]`; a name outside `allowed` is a ValueError naming it and the choices."""
    if name not in allowed:
        raise ValueError(f"{what} {name!r}: expected one of {sorted(allowed)}")
    return DTYPES[name]
