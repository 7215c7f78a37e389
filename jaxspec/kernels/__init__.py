"""Pallas kernels (Triton lowering on the GPU; Pallas interpret mode on the CPU in tests)."""

from __future__ import annotations

import jax
import numpy as np


def run_compiled(fn, *args):
    """``fn(*args)`` compiled and run at once, as numpy arrays, also while a jit is being traced.

    The kernels' availability probes run their first call wherever the model first asks (often inside
    the trace of a decode step); a plain ``jax.jit(fn)(...)`` there would be staged into that trace and
    return tracers. A compiled executable runs now."""
    args = [np.asarray(a) for a in args]
    compiled = jax.jit(fn).lower(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)).compile()
    return jax.tree.map(np.asarray, compiled(*args))
