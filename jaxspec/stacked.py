"""One layer's dense weight inside the stacked layers' scan, read in place.

The identical decoder layers run as one `lax.scan` over parameters stacked on a leading layer
axis (`model.StackedLayers`). A weight the scan slices out of its stack is a dynamic-slice,
and on the GPU a matmul operand that is a dynamic-slice is first copied out whole: at decode
sizes, where the matmuls only stream their weights, the copy (a read and a write of the
layer's weight) makes them about three times slower than with one array per layer
(`scripts/bench_stacked_dense.py`, docs/PERFORMANCE.md).

So the scan passes the dense kernels of the attention and of the shared expert whole, as a
`LayerOf(stack, index)`, and `einsum` multiplies by layer `index` of the stack with
`kernels.stacked_matmul`, which streams only that layer's tiles. Anything the kernel does not
serve (more rows than `stacked_matmul.MAX_ROWS`, an einsum that is not a plain matmul,
mismatched dtypes) slices the layer out with `get()` and runs XLA's einsum, as before.

On a mesh the kernel runs inside a `shard_map` over the stack's own sharding (the `spec`):
each device multiplies its shard, and a weight split along its inputs adds the partial
products with one psum over those mesh axes, as GSPMD's einsum would.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from jaxspec.kernels import stacked_matmul

STACKED = "stacked"  # the flax variable collection that holds `LayerOf` leaves during the scan
DENSE_IMPLS = ("kernel", "interpret", "slice")
"""How the stacked layers' dense matmuls read their weights (`Transformer.dense_impl`):

* ``kernel``: in place, `kernels.stacked_matmul` (a GPU with Pallas' Triton lowering);
* ``interpret``: the same in Pallas interpret mode (any backend: tests);
* ``slice``: XLA's einsum on the scan's slice (the layer's weight copied out first on the GPU).
"""


@struct.dataclass
class LayerOf:
    """Layer `index` of a stacked weight `stack` [L, *shape], not sliced out.

    `impl` ('kernel' or 'interpret'), `mesh` and `spec` (the stack's PartitionSpec on it, the
    layer axis unsplit) are static."""

    stack: jax.Array
    index: jax.Array
    impl: str = struct.field(pytree_node=False, default="kernel")
    mesh: Any = struct.field(pytree_node=False, default=None)
    spec: Any = struct.field(pytree_node=False, default=None)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self):
        return self.stack.dtype

    def get(self) -> jax.Array:
        """The layer's weight as an array (a dynamic-slice of the stack)."""
        return jax.lax.dynamic_index_in_dim(self.stack, self.index, axis=0, keepdims=False)


def _plain_matmul(contract: str, x_ndim: int, w_ndim: int) -> int | None:
    """How many trailing dims of x (= leading dims of w) `contract` sums over, when it is a plain
    matmul `x[..., k...] w[k..., n...] -> y[..., n...]`; else None."""
    try:
        ins, out = contract.replace(" ", "").split("->")
        xs, ws = ins.split(",")
    except ValueError:
        return None
    if "." in contract or len(xs) != x_ndim or len(ws) != w_ndim:
        return None
    summed = [c for c in ws if c in xs and c not in out]
    n = len(summed)
    if n == 0 or ws[:n] != "".join(summed) or xs[-n:] != ws[:n] or out != xs[:-n] + ws[n:]:
        return None
    return n


def _mesh_axes(entries) -> tuple[str, ...]:
    names = []
    for e in entries:
        if e is None:
            continue
        names.extend(e if isinstance(e, tuple) else (e,))
    return tuple(names)


def einsum(contract: str, x: jax.Array, w: LayerOf, out_dtype=None) -> jax.Array:
    """`jnp.einsum(contract, x, w.get())` in x's dtype (accumulating to `out_dtype` if given),
    read in place where `kernels.stacked_matmul` serves it."""
    nk = _plain_matmul(contract, x.ndim, len(w.shape))
    K = 1
    for d in w.shape[: nk or 0]:
        K *= d
    rows = x.size // K if nk else 0
    if nk is None or x.dtype != w.dtype or not stacked_matmul.use_kernel(rows):
        y = jnp.einsum(contract, x, w.get().astype(x.dtype), preferred_element_type=out_dtype)
        return y if out_dtype is None else y.astype(out_dtype)
    interpret = w.impl == "interpret"
    lead = x.shape[: x.ndim - nk]

    def local(x_loc, stack_loc, index, acc=None):
        k_loc = 1
        for d in x_loc.shape[x_loc.ndim - nk :]:
            k_loc *= d
        n_shape = stack_loc.shape[1 + nk :]
        s3 = stack_loc.reshape(stack_loc.shape[0], k_loc, -1)
        if not stacked_matmul.shapes_ok(k_loc, s3.shape[2]):
            y = jnp.einsum(
                contract, x_loc, jax.lax.dynamic_index_in_dim(stack_loc, index, 0, False), preferred_element_type=acc
            )
        else:
            y2 = stacked_matmul.stacked_matmul(x_loc.reshape(-1, k_loc), s3, index, out_dtype=acc, interpret=interpret)
            y = y2.reshape(*x_loc.shape[: x_loc.ndim - nk], *n_shape)
        return y

    if w.mesh is None or w.spec is None or all(s is None for s in w.spec):
        y = local(x, w.stack, w.index)
    else:
        spec = tuple(w.spec) + (None,) * (1 + len(w.shape) - len(w.spec))
        k_specs, n_specs = spec[1 : 1 + nk], spec[1 + nk :]
        k_axes = _mesh_axes(k_specs)
        x_spec = P(*((None,) * len(lead)), *k_specs)
        y_spec = P(*((None,) * len(lead)), *n_specs)

        def body(x_loc, stack_loc, index):
            if not k_axes:
                return local(x_loc, stack_loc, index)
            # a weight split along its inputs: each device holds a float32 partial product
            return jax.lax.psum(local(x_loc, stack_loc, index, jnp.float32), k_axes).astype(x_loc.dtype)

        y = jax.shard_map(body, mesh=w.mesh, in_specs=(x_spec, P(*spec), P()), out_specs=y_spec, check_vma=False)(
            x, w.stack, w.index
        )
    return y if out_dtype is None else y.astype(out_dtype)
