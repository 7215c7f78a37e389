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


def gpu_problem(triton) -> str | None:
    """Why a compiled Pallas Triton kernel cannot run on this process's default backend, or None.
    ``triton``: the kernel module's ``jax.experimental.pallas.triton`` (None where it did not import)."""
    if triton is None:
        return "jax.experimental.pallas.triton is not importable"
    try:
        backend = jax.default_backend()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"no jax backend: {exc}"
    if backend != "gpu":
        return f"the Pallas Triton kernel needs a GPU backend, found {backend!r}"
    return None


def with_gradient(forward, backward, nondiff: int = 0):
    """``forward(*args)`` (a kernel call) made differentiable by ``backward(args, cotangent)``, which returns
    the cotangents of the first ``len(args) - nondiff`` args; the last ``nondiff`` (integer operands: a
    layer index, slots, positions) get none."""
    fn = jax.custom_vjp(forward)

    def bwd(args, g):
        return (*backward(args, g), *(None,) * nondiff)

    fn.defvjp(lambda *args: (fn(*args), args), bwd)
    return fn


def with_reference_gradient(forward, reference, nondiff: int = 0):
    """:func:`with_gradient` where the gradient is that of ``reference(*args)``, the kernel written in XLA ops
    (the same function of the differentiable args, up to rounding)."""

    def backward(args, g):
        k = len(args) - nondiff
        _, vjp = jax.vjp(lambda *d: reference(*d, *args[k:]), *args[:k])
        return vjp(g)

    return with_gradient(forward, backward, nondiff)
