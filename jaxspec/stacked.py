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
products with one sum over those mesh axes where GSPMD's einsum would put an all-reduce:
`sharding.ordered_psum`, each element added in device order whatever the number of rows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from jaxspec.kernels import stacked_matmul
from jaxspec.sharding import ordered_psum

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

    @property
    def whole(self) -> bool:
        """Whether each device holds the whole stack (no mesh, or a spec that splits no axis)."""
        return _spec(self) is None

    def get(self) -> jax.Array:
        """The layer's weight as an array (a dynamic-slice of the stack)."""
        return jax.lax.dynamic_index_in_dim(self.stack, self.index, axis=0, keepdims=False)


@struct.dataclass
class Rows:
    """Activations ``x`` of `shape` held as the zero-padded rows ``[padded_rows(M), K]`` that a Pallas
    kernel wrote (`kernels.rms_norm`, `kernels.absorb`): K the product of the last `width` dims of
    `shape` (one by default), M the product of the others.

    `einsums` hands them to `kernels.stacked_matmul` as its copy of the rows (no pad of its own) where
    the product contracts exactly those `width` dims; anything else reads `value`, the rows themselves."""

    padded: jax.Array
    shape: tuple[int, ...] = struct.field(pytree_node=False)
    width: int = struct.field(pytree_node=False, default=1)

    @property
    def dtype(self):
        return self.padded.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[: len(self.shape) - self.width], dtype=np.int64))

    @property
    def value(self) -> jax.Array:
        return self.padded[: self.rows].reshape(self.shape)

    def reshape(self, *shape) -> Rows:
        """The same rows seen with other leading dims (the last `width` dims kept)."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        w = self.width
        if shape[len(shape) - w :] != self.shape[len(self.shape) - w :] or np.prod(shape) != np.prod(self.shape):
            last = "the last dim" if w == 1 else f"the last {w} dims"
            raise ValueError(f"Rows.reshape: {self.shape} -> {shape} must keep the rows and {last}")
        return Rows(self.padded, shape, w)


@struct.dataclass
class Parts:
    """A product of `shape` [..., N] held as the dense kernel's float32 K-split partials ``[ksplit,
    padded_rows(M), N]`` (M the product of the leading dims), not yet added: `value` adds them in
    ascending order and casts to `dtype`, as `einsums` does for every other result, and a kernel that
    reads them (`kernels.latent_write`) does the same in its own launch (one XLA kernel fewer)."""

    parts: jax.Array
    shape: tuple[int, ...] = struct.field(pytree_node=False)
    dtype: Any = struct.field(pytree_node=False)

    @property
    def rows(self) -> int:
        # the partials' rows: `shape` flattened over the kernel's output columns (the last dim of
        # `parts`), which may span several trailing dims of `shape` (q_b's heads x head dim)
        return int(np.prod(self.shape, dtype=np.int64)) // self.parts.shape[-1]

    @property
    def value(self) -> jax.Array:
        return stacked_matmul.sum_parts(self.parts, self.rows).astype(self.dtype).reshape(self.shape)

    def reshape(self, *shape) -> Parts:
        """The same partials seen with other leading dims (the kernel's columns kept as whole trailing
        dims: the partials' rows are the leading dims flattened already)."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        if shape.count(-1) == 1:  # one dim inferred, as `jnp.reshape` does
            known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
            shape = tuple(int(np.prod(self.shape, dtype=np.int64)) // max(known, 1) if d == -1 else d for d in shape)
        cols, tail = self.parts.shape[-1], 1
        for d in reversed(shape):  # the kernel's columns must stay whole trailing dims
            if tail >= cols:
                break
            tail *= d
        if not shape or tail != cols or np.prod(shape) != np.prod(self.shape):
            raise ValueError(
                f"Parts.reshape: {self.shape} -> {shape} must keep the rows and the {cols} columns as trailing dims"
            )
        return Parts(self.parts, shape, self.dtype)


@struct.dataclass
class Sum:
    """``a + b`` of two products of one `shape` and dtype, not yet added: `a` an array, `b` an array or the
    dense kernel's `Parts`. `value` adds them as the code ``a + b`` of two arrays of that dtype states: in
    float32, rounded once (b's partials added and rounded first, as `Parts.value`). A MoE layer's output (the
    routed experts' and the shared expert's down products), left for the next layer's norm kernel to add
    (`kernels.rms_norm`)."""

    a: jax.Array
    b: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.a.shape)

    @property
    def dtype(self):
        return self.a.dtype

    @property
    def value(self) -> jax.Array:
        f32 = jnp.float32
        return (self.a.astype(f32) + value(self.b).astype(f32)).astype(self.dtype)

    def reshape(self, *shape) -> Sum:
        return Sum(self.a.reshape(*shape), self.b.reshape(*shape))


@struct.dataclass
class Deferred:
    """The float32 residual stream ``x`` with a layer's last add not yet made: its value is
    ``x + value(add)`` in float32 (`add` a `Sum`, or on a mesh the MoE output as its sum over the mesh left it, an
    array). The stacked layers pass it from one layer to the next, whose norm kernel makes the add
    (`kernels.rms_norm`), where an XLA launch of its own would (`model.DecoderLayer`)."""

    x: jax.Array
    add: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape)

    @property
    def dtype(self):
        return self.x.dtype

    @property
    def value(self) -> jax.Array:
        return self.x + value(self.add).astype(self.x.dtype)


def stack_and_index(w) -> tuple:
    """(stack, index) of a weight a kernel reads in place: a stacked layer's `LayerOf`, or an array and None."""
    return (w.stack, w.index) if isinstance(w, LayerOf) else (w, None)


def value(x):
    """An activation as an array: `Rows.value` / `Parts.value` / `Sum.value` / `Deferred.value`, else x itself."""
    return x.value if isinstance(x, (Rows, Parts, Sum, Deferred)) else x


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


def einsum(contract: str, x: jax.Array, w: LayerOf, out_dtype=None, raw: bool = False) -> jax.Array | Parts:
    """`jnp.einsum(contract, x, w.get())` in x's dtype (accumulating to `out_dtype` if given),
    read in place where `kernels.stacked_matmul` serves it (``raw``: see `einsums`)."""
    return einsums((contract,), x, (w,), out_dtype, (raw,))[0]


def _fallback(contract, x, w: LayerOf, out_dtype):
    x = value(x)
    y = jnp.einsum(contract, x, w.get().astype(x.dtype), preferred_element_type=out_dtype)
    return y if out_dtype is None else y.astype(out_dtype)


def _spec(w: LayerOf) -> tuple | None:
    if w.mesh is None or w.spec is None or all(s is None for s in w.spec):
        return None
    return tuple(w.spec) + (None,) * (1 + len(w.shape) - len(w.spec))


def einsums(contracts, x, ws, out_dtype=None, raw=None) -> tuple[jax.Array | Parts, ...]:
    """`einsum(contracts[i], x, ws[i])` for each weight: one `kernels.stacked_matmuls` call where the
    kernel serves them all alike (same contracted dims of x and their sharding, same layer index),
    else one `einsum` each. Weights that share their input (q_a and kv_a, a gated MLP's gate and
    up) so cost one launch instead of two; each result has the bits it would have alone.

    x: an array, or `Rows` (whose padded rows the kernel reads as they are, when it contracts exactly
    the dims their columns hold; bfloat16 `Rows` may meet float32 weights, widened exactly in the kernel).
    out_dtype: the accumulator and result dtype of every product, or one per weight (None: x's).
    raw: one flag per weight; a flagged result that the kernel makes from a weight with no mesh split at
    all comes back as `Parts`, its partials not yet added; elsewhere it is the array as always (a
    consumer takes either: `value`)."""
    contracts, ws = tuple(contracts), tuple(ws)
    outs = tuple(out_dtype) if isinstance(out_dtype, (tuple, list)) else (out_dtype,) * len(ws)
    if len(outs) != len(ws):
        raise ValueError(f"stacked.einsums: {len(outs)} output dtypes for {len(ws)} weights")
    nks = [_plain_matmul(c, x.ndim, len(w.shape)) for c, w in zip(contracts, ws)]
    nk = nks[0]
    K = 1
    for d in ws[0].shape[: nk or 0]:
        K *= d
    rows = int(np.prod(x.shape, dtype=np.int64)) // K if nk else 0
    specs = [_spec(w) for w in ws]
    same = all(
        n == nk and w.shape[: nk or 0] == ws[0].shape[: nk or 0] and w.index is ws[0].index and w.mesh is ws[0].mesh
        for n, w in zip(nks, ws)
    ) and all((s is None) == (specs[0] is None) for s in specs)
    if same and specs[0] is not None:
        same = all(s[1 : 1 + nk] == specs[0][1 : 1 + nk] for s in specs)
    # bfloat16 Rows meeting float32 weights (a float32 router) are widened, exactly, as the caller's own
    # `x.astype(float32)` would have
    widen = isinstance(x, Rows) and x.dtype == jnp.bfloat16 and all(w.dtype == jnp.float32 for w in ws)
    padded = isinstance(x, Rows) and nk == x.width
    if padded and x.width > 1 and specs[0] is not None:
        # the padded rows' columns flatten the contracted dims: on a mesh only the first may be split
        padded = all(e is None for e in specs[0][2 : 1 + nk])
    if isinstance(x, Rows) and not padded:
        x = x.value.astype(jnp.float32) if widen else x.value
        widen = False
    ok = nk is not None and (widen or all(x.dtype == w.dtype for w in ws)) and stacked_matmul.use_kernel(rows)
    wdt = ws[0].dtype
    if ok and ws[0].impl == "kernel" and wdt != jnp.bfloat16:  # bfloat16 was probed when 'kernel' was chosen
        ok = stacked_matmul.available(jnp.dtype(wdt).name) is None
    raw = tuple(raw) if raw is not None else (False,) * len(ws)
    if len(raw) != len(ws):
        raise ValueError(f"stacked.einsums: {len(raw)} raw flags for {len(ws)} weights")
    if not (ok and same):
        if widen:
            x = x.value.astype(jnp.float32)
        if len(ws) > 1:
            return tuple(einsums((c,), x, (w,), o, (r,))[0] for c, w, o, r in zip(contracts, ws, outs, raw))
        return (_fallback(contracts[0], x, ws[0], outs[0]),)
    interpret = ws[0].impl == "interpret"
    lead = x.shape[: x.ndim - nk]
    n_rows = x.rows if padded else None
    res_dtype = wdt if widen else x.dtype  # the products' dtype, as XLA's einsum would give
    # each result straight from the kernel's float32 sums in its own dtype (an `out_dtype` is the
    # accumulator's too, as in `_fallback`: never rounded to x's dtype on the way)
    finals = tuple(jnp.dtype(o or res_dtype) for o in outs)

    k_shape = ws[0].shape[:nk]
    s3_shapes = [(int(np.prod(k_shape, dtype=np.int64)), int(np.prod(w.shape[nk:], dtype=np.int64))) for w in ws]
    # raw partials: the kernel's own products, for weights whole on every device (`_spec` None)
    raw = (
        tuple(r and specs[0] is None and stacked_matmul.shapes_ok(*sh) for r, sh in zip(raw, s3_shapes))
        if all(stacked_matmul.shapes_ok(*sh) for sh in s3_shapes)
        else (False,) * len(ws)
    )

    def local(x_loc, stacks_loc, index, acc=None):
        k_dims = stacks_loc[0].shape[1 : 1 + nk]  # the contracted dims as this device holds them
        k_loc = int(np.prod(k_dims, dtype=np.int64))
        s3s = [st.reshape(st.shape[0], k_loc, -1) for st in stacks_loc]
        if not all(stacked_matmul.shapes_ok(k_loc, s3.shape[2]) for s3 in s3s):
            xv = x_loc[:n_rows].reshape(*lead, *k_dims) if padded else x_loc
            return tuple(
                jnp.einsum(
                    c,
                    xv.astype(st.dtype),
                    jax.lax.dynamic_index_in_dim(st, index, 0, False),
                    preferred_element_type=acc,
                )
                for c, st in zip(contracts, stacks_loc)
            )
        x2 = x_loc if padded else x_loc.reshape(-1, k_loc)
        ys = stacked_matmul.stacked_matmuls(
            x2,
            s3s,
            index,
            out_dtype=(acc,) * len(s3s) if acc else finals,
            interpret=interpret,
            rows=n_rows,
            raw=None if acc else raw,
        )
        return tuple(
            y if r and not acc else y.reshape(*lead, *st.shape[1 + nk :]) for y, st, r in zip(ys, stacks_loc, raw)
        )

    stacks = tuple(w.stack for w in ws)
    xa = x.padded if padded else x
    if specs[0] is None:
        ys = local(xa, stacks, ws[0].index)
    else:
        k_specs = specs[0][1 : 1 + nk]
        k_axes = _mesh_axes(k_specs)
        x_spec = P(*((None,) * (1 if padded else len(lead))), *(k_specs[:1] if padded else k_specs))
        y_specs = tuple(P(*((None,) * len(lead)), *s[1 + nk :]) for s in specs)

        def body(x_loc, stacks_loc, index):
            if not k_axes:
                return local(x_loc, stacks_loc, index)
            # weights split along their inputs: each device holds float32 partial products
            parts = local(x_loc, stacks_loc, index, jnp.float32)
            return tuple(ordered_psum(y, k_axes, d) for y, d in zip(parts, finals))

        ys = jax.shard_map(
            body,
            mesh=ws[0].mesh,
            in_specs=(x_spec, tuple(P(*s) for s in specs), P()),
            out_specs=y_specs,
            check_vma=False,
        )(xa, stacks, ws[0].index)
    return tuple(Parts(y, (*lead, *w.shape[nk:]), d) if r else y.astype(d) for y, d, r, w in zip(ys, finals, raw, ws))
