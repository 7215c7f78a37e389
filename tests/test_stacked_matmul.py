"""Dense kernels of the stacked layers read in place (`jaxspec.kernels.stacked_matmul`, `jaxspec.stacked`).

The kernel runs here in Pallas interpret mode (float32) and is checked against numpy's float64
matmul, for a row's bits not depending on the rows beside it (a verify row equals the decode
step), and inside the model against the scan's sliced weights (`dense_impl="slice"`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import eqns

from jaxspec import decode, demo, stacked
from jaxspec.engine import Engine, _full_forward
from jaxspec.kernels import stacked_matmul as sm
from jaxspec.model import choose_dense_impl, stacked_range
from jaxspec.spec import SpecConfig


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.mark.parametrize(
    "m,k,n,config",
    [
        (1, 256, 128, None),  # one decode row
        (17, 512, 96, None),  # two row blocks, N tile 32 (96 has no 64 tile)
        (40, 384, 64, {"ksplit": 3, "bk": 64}),  # K split in 3 parts of 2 steps
        (5, 128, 48, {"bn": 16, "bk": 32, "ksplit": 2}),
    ],
)
def test_kernel_matches_numpy_for_every_layer(m, k, n, config):
    rng = np.random.default_rng(m * 1000 + n)
    w = rng.normal(size=(3, k, n))
    x = rng.normal(size=(m, k))
    run = jax.jit(lambda x, w, i: sm.stacked_matmul(x, w, i, config=config, interpret=True))
    for layer in range(3):
        got = run(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), layer)
        assert got.shape == (m, n) and got.dtype == jnp.float32
        assert _rel(got, x @ w[layer]) < 1e-5, layer


def test_kernel_under_scan_reads_the_scanned_layer():
    """The layer index traced by a scan over the stack (as the model's layers run)."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(4, 128, 128)) / 12, jnp.float32)
    x = jnp.asarray(rng.normal(size=(3, 128)), jnp.float32)

    def step(h, i):
        return jnp.tanh(sm.stacked_matmul(h, w, i, interpret=True)), None

    got = jax.jit(lambda x: jax.lax.scan(step, x, jnp.arange(4))[0])(x)
    ref = np.asarray(x, np.float64)
    for i in range(4):
        ref = np.tanh(ref @ np.asarray(w[i], np.float64))
    assert _rel(got, ref) < 1e-5


def test_a_row_is_the_same_bits_alone_and_among_others():
    """A verify of many rows and a decode step of one row give the same product bits for that row."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=(2, 512, 256)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(37, 512)), jnp.float32)
    run = jax.jit(lambda x: sm.stacked_matmul(x, w, 1, interpret=True))
    many = np.asarray(run(x))
    for r in (0, 15, 16, 36):
        np.testing.assert_array_equal(np.asarray(run(x[r : r + 1]))[0], many[r], err_msg=f"row {r}")


def test_the_kernel_always_reads_a_padded_copy_of_the_rows():
    """Rows a multiple of 16 passed straight to the kernel gave wrong cache latents in a batch-64 decode on
    the H200 (docs/PERFORMANCE.md); the kernel's operand is therefore always a padded copy, one row block
    more where the rows fill whole blocks, and the padding never reaches the result."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(2, 128, 64)), jnp.float32)
    for m, rows_in in ((64, 80), (48, 64), (63, 64), (1, 16)):
        x = jnp.asarray(rng.normal(size=(m, 128)), jnp.float32)
        jaxpr = jax.make_jaxpr(lambda x: sm.stacked_matmul(x, w, 1, interpret=True))(x)
        calls = [e for e in eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
        assert len(calls) == 1 and calls[0].invars[1].aval.shape == (rows_in, 128), (m, calls[0].invars[1].aval)
        got = jax.jit(lambda x: sm.stacked_matmul(x, w, 1, interpret=True))(x)
        assert got.shape == (m, 64) and _rel(got, np.asarray(x, np.float64) @ np.asarray(w[1], np.float64)) < 1e-5


def test_several_weights_of_one_input_in_one_call():
    """q_a and kv_a (or gate and up) share their input: one kernel call serves both, each product right
    for every layer, a row's bits the same alone and among others, and the gradients those of the
    separate products."""
    rng = np.random.default_rng(4)
    ws = tuple(jnp.asarray(rng.normal(size=(3, 256, n)) / 16, jnp.float32) for n in (128, 80, 48))
    x = jnp.asarray(rng.normal(size=(21, 256)), jnp.float32)
    run = jax.jit(lambda x, ws, i: sm.stacked_matmuls(x, ws, i, interpret=True))
    jaxpr = jax.make_jaxpr(lambda x: sm.stacked_matmuls(x, ws, 1, interpret=True))(x)
    assert sum(e.primitive.name == "pallas_call" for e in eqns(jaxpr.jaxpr)) == 1
    for layer in range(3):
        got = run(x, ws, layer)
        assert [g.shape for g in got] == [(21, 128), (21, 80), (21, 48)]
        for g, w in zip(got, ws):
            assert _rel(g, np.asarray(x, np.float64) @ np.asarray(w[layer], np.float64)) < 1e-5, layer
    many = [np.asarray(g) for g in run(x, ws, 2)]
    for r in (0, 16, 20):
        alone = run(x[r : r + 1], ws, 2)
        for a, m in zip(alone, many):
            np.testing.assert_array_equal(np.asarray(a)[0], m[r], err_msg=f"row {r}")

    def loss_fused(x, ws):
        return sum(jnp.sum(jnp.sin(y)) for y in sm.stacked_matmuls(x, ws, 1, interpret=True))

    def loss_xla(x, ws):
        return sum(jnp.sum(jnp.sin(x @ w[1])) for w in ws)

    gf, gx = jax.grad(loss_fused, (0, 1))(x, ws), jax.grad(loss_xla, (0, 1))(x, ws)
    assert _rel(gf[0], np.asarray(gx[0], np.float64)) < 1e-5
    for a, b in zip(gf[1], gx[1]):
        assert _rel(a, np.asarray(b, np.float64)) < 1e-5
    with pytest.raises(ValueError, match="different layer counts"):
        sm.stacked_matmuls(x, (ws[0], ws[1][:2]), 0, interpret=True)
    with pytest.raises(ValueError, match=r"N=\[128, 40\].*no tile of at least 16"):
        sm.stacked_matmuls(x, (ws[0], jnp.ones((3, 256, 40))), 0, interpret=True)


def test_auto_k_split_and_bad_input_errors():
    assert sm.ksplit_for(7168, 8192, 64, 64) == 1  # 128 column tiles already fill the device
    assert sm.ksplit_for(7168, 1536, 64, 64) == 8  # 24 tiles: K split until >= MIN_PROGRAMS programs
    assert 24 * sm.ksplit_for(7168, 1536, 64, 64) >= sm.MIN_PROGRAMS
    x, w = jnp.ones((2, 64)), jnp.ones((3, 64, 32))
    with pytest.raises(ValueError, match=r"expected x \[M, K\] and w \[L, K, N\].*\(2, 64\).*\(3, 32, 32\)"):
        sm.stacked_matmul(x, jnp.ones((3, 32, 32)), 0, interpret=True)
    with pytest.raises(ValueError, match="share a dtype.*float32.*bfloat16"):
        sm.stacked_matmul(x, w.astype(jnp.bfloat16), 0, interpret=True)
    with pytest.raises(ValueError, match="ksplit=3 must divide the 1 K steps"):
        sm.stacked_matmul(x, w, 0, config={"ksplit": 3, "bk": 64}, interpret=True)
    with pytest.raises(ValueError, match="ksplit=3 must divide the 2 K steps of K=64, bk=32"):  # float32: F32_BK
        sm.stacked_matmul(x, w, 0, config={"ksplit": 3}, interpret=True)
    with pytest.raises(ValueError, match=r"unknown keys \['block'\]"):
        sm.stacked_matmul(x, w, 0, config={"block": 8}, interpret=True)


def test_layer_of_einsum_serves_plain_matmuls_and_falls_back_otherwise():
    rng = np.random.default_rng(2)
    stack = jnp.asarray(rng.normal(size=(3, 4, 16, 32)), jnp.float32)  # [L, heads, head_dim, out]: o_proj's shape
    w = stacked.LayerOf(stack, jnp.int32(2), "interpret")
    assert w.shape == (4, 16, 32) and w.dtype == jnp.float32
    x = jnp.asarray(rng.normal(size=(2, 3, 4, 16)), jnp.float32)
    ref = np.einsum("bthv,hvd->btd", np.asarray(x, np.float64), np.asarray(stack[2], np.float64))
    assert _rel(stacked.einsum("bthv,hvd->btd", x, w), ref) < 1e-5
    assert _uses_kernel(lambda x, w: stacked.einsum("bthv,hvd->btd", x, w), x, w)
    # the model's contractions are plain matmuls (summed dims trailing in x, leading in w) ...
    assert stacked._plain_matmul("bthv,hvd->btd", 4, 3) == 2
    assert stacked._plain_matmul("btq,qhk->bthk", 3, 3) == 1
    assert stacked._plain_matmul("btd,dc->btc", 3, 2) == 1
    # ... a batched (per-head) one is not, and takes the sliced weight through XLA's einsum
    assert stacked._plain_matmul("bthn,lhn->bthl", 4, 3) is None
    q = jnp.asarray(rng.normal(size=(2, 3, 4, 32)), jnp.float32)
    got = stacked.einsum("bthn,hvn->bthv", q, w)
    assert _rel(got, np.einsum("bthn,hvn->bthv", q, stack[2])) < 1e-6
    assert not _uses_kernel(lambda q, w: stacked.einsum("bthn,hvn->bthv", q, w), q, w)
    # more rows than the kernel serves: the slice and XLA (same numbers)
    big = jnp.asarray(rng.normal(size=(sm.MAX_ROWS + 1, 4, 16)), jnp.float32)
    ref = np.einsum("thv,hvd->td", np.asarray(big, np.float64), np.asarray(stack[2], np.float64))
    assert _rel(stacked.einsum("thv,hvd->td", big, w), ref) < 1e-5
    assert not _uses_kernel(lambda x, w: stacked.einsum("thv,hvd->td", x, w), big, w)
    assert _uses_kernel(lambda x, w: stacked.einsum("thv,hvd->td", x, w), big[: sm.MAX_ROWS], w)


def test_layer_of_einsums_reads_weights_of_one_input_in_one_call():
    rng = np.random.default_rng(4)
    sa = jnp.asarray(rng.normal(size=(3, 64, 48)), jnp.float32)
    sb = jnp.asarray(rng.normal(size=(3, 64, 32)), jnp.float32)
    sc = jnp.asarray(rng.normal(size=(3, 5, 64, 16)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, 5, 64)), jnp.float32)
    of = lambda s, i: stacked.LayerOf(s, i, "interpret")  # noqa: E731

    def pair(x, sa, sb, i):  # as in a stacked layer: the weights share the scan's index
        return stacked.einsums(("btd,dq->btq", "btd,dc->btc"), x, (of(sa, i), of(sb, i)))

    def alone(x, s, i, contract):
        return stacked.einsum(contract, x, of(s, i))

    one = jnp.int32(1)
    ya, yb = jax.jit(pair)(x, sa, sb, one)
    # one kernel call serves both (its K split follows the pair's total columns, so the bits may differ
    # from one call each; a row's bits still do not depend on the other rows: test_several_weights_...)
    assert _rel(ya, jax.jit(alone, static_argnums=3)(x, sa, one, "btd,dq->btq")) < 1e-6
    assert _rel(ya, np.einsum("btd,dq->btq", x, sa[1])) < 1e-5
    assert _rel(yb, np.einsum("btd,dc->btc", x, sb[1])) < 1e-5
    assert _kernel_calls(jax.make_jaxpr(pair)(x, sa, sb, one)) == 1

    # weights that differ in what they contract, or in their layer index, go one call each, same numbers
    def mixed(x, sa, sc, sb, i, j):
        return stacked.einsums(("btd,dq->btq", "btd,tdn->bn", "btd,dc->btc"), x, (of(sa, i), of(sc, i), of(sb, j)))

    ya2, yc, yo = mixed(x, sa, sc, sb, one, jnp.int32(2))
    np.testing.assert_array_equal(
        np.asarray(ya2), np.asarray(jax.jit(alone, static_argnums=3)(x, sa, one, "btd,dq->btq"))
    )
    assert _rel(yc, np.einsum("btd,tdn->bn", x, sc[1])) < 1e-5
    assert _rel(yo, np.einsum("btd,dc->btc", x, sb[2])) < 1e-5
    assert _kernel_calls(jax.make_jaxpr(mixed)(x, sa, sc, sb, one, jnp.int32(2))) == 3


def _kernel_calls(jaxpr, name="stacked_matmul", scan: bool | None = None) -> int:
    """Launches of the Pallas kernel `name`: all (scan None), inside the stacked layers' scan (True) or
    outside it (False)."""
    count = lambda es: sum(e.primitive.name == "pallas_call" and e.params.get("name") == name for e in es)  # noqa: E731
    every, outside = count(eqns(jaxpr.jaxpr)), count(eqns(jaxpr.jaxpr, ("scan",)))
    return every if scan is None else every - outside if scan else outside


def _uses_kernel(f, *args) -> bool:
    return "stacked_matmul" in str(jax.make_jaxpr(f)(*args))


def test_dense_impl_choice_and_errors():
    if jax.default_backend() != "gpu":
        assert choose_dense_impl() == "slice"
        with pytest.raises(ValueError, match="dense_impl='kernel': the Pallas Triton kernel needs a GPU backend"):
            choose_dense_impl("kernel")
    assert choose_dense_impl("interpret") == "interpret" and choose_dense_impl("slice") == "slice"
    with pytest.raises(ValueError, match=r"dense_impl: expected None \(choose\) or one of .*found 'fast'"):
        choose_dense_impl("fast")


@pytest.fixture(scope="module")
def demo_path():
    return demo.ensure_converted(progress=False, log=lambda m: None)  # the user cache's copy, shared


@pytest.fixture(scope="module")
def pair(demo_path):
    return Engine.load(demo_path, dtype="float32", dense_impl="slice"), Engine.load(
        demo_path, dtype="float32", dense_impl="interpret"
    )


@pytest.fixture(scope="module")
def kernels_engine(demo_path):
    """``kernels_engine(dtype)``: the demo target with the dense and the expert kernels in interpret mode, loaded
    once per dtype for the module's forward-pass tests. No test changes an engine; the switches they set
    (`monkeypatch` on the kernels' ``DEFAULT_CONFIG``) are read when a forward pass is traced, not at load."""
    engines = {}

    def get(dtype: str) -> Engine:
        if dtype not in engines:
            engines[dtype] = Engine.load(demo_path, dtype=dtype, dense_impl="interpret", expert_impl="interpret")
        return engines[dtype]

    return get


def _forward(model, params, cache, tokens, positions, capture=()):
    """`decode.forward` traced once: (its jaxpr, a function that runs it compiled and returns its outputs).
    The tokens and positions are the program's arguments rather than constants in it, so a program compiled for
    one draw of random tokens is the same program for the next: the persistent compilation cache
    (tests/compile_cache.py) serves it to later runs and to another test that compiles the same forward."""
    fn = lambda p, c, t, q: decode.forward(model, p, t, q, c, capture)  # noqa: E731
    args = (params, cache, tokens, positions)
    traced = jax.jit(fn).trace(*args)
    return traced.jaxpr, lambda: traced.lower().compile()(*args)


def test_the_layers_scan_slices_nothing_and_its_index_reaches_the_kernels_as_carried(kernels_engine, pair):
    """With the dense and the expert kernels, every stacked leaf is read in place (the router's bias by the
    routing kernel too), so the layers' scan slices nothing, and its carried index counts from the stack's
    first layer: no subtraction of it in the loop body (on the GPU each was a launch of its own every
    layer). The cache layers and the captured states still land where the sliced model puts them."""
    engine = kernels_engine("float32")
    tokens = jnp.asarray([np.random.default_rng().integers(0, engine.cfg.vocab_size, 16)], jnp.int32)
    cache = engine.init_cache(1, 16)
    jaxpr = jax.make_jaxpr(lambda p, c: _full_forward(engine.model, p, tokens, c))(engine.params, cache)
    scans = [e for e in eqns(jaxpr.jaxpr, ("pallas_call",)) if e.primitive.name == "scan"]
    layers = [e for e in scans if e.params["length"] == len(stacked_range(engine.cfg))]
    assert len(layers) == 1, [e.params["length"] for e in scans]
    (scan,) = layers
    assert len(scan.invars) == scan.params["num_consts"] + scan.params["num_carry"], "the scan slices a leaf"
    body = eqns(scan.params["jaxpr"].jaxpr, ("pallas_call", "scan", "while"))
    index_math = [e.primitive.name for e in body if e.primitive.name == "sub" and e.outvars[0].aval.shape == ()]
    assert not index_math, index_math
    # the same logits, cache layers and captured states as the sliced model's (the offsets are right)
    L = engine.cfg.num_layers
    capture = (0, L // 2, L - 1)  # the unrolled layer's, a stacked one's, the last one's
    positions = jnp.arange(16, dtype=jnp.int32)[None]
    outs = [_forward(e.model, e.params, cache, tokens, positions, capture)[1]() for e in (pair[0], engine)]
    (la, ca, aa), (lb, cb, ab) = outs
    for name, x, y in (("logits", la, lb), ("cache", ca.latent_LBSC, cb.latent_LBSC), ("captured", aa, ab)):
        x, y = np.asarray(x), np.asarray(y)
        assert np.abs(x - y).max() <= 1e-5 * np.abs(x).max(), name
    assert all(np.abs(np.asarray(cb.latent_LBSC[i])).max() > 0 for i in range(L)), "a layer's cache was not written"


def _kernels_of(e) -> set:
    """The Pallas kernels equation `e` launches (itself, or inside the jaxprs it holds)."""
    return {x.params.get("name") for x in [e, *eqns_in(e)] if x.primitive.name == "pallas_call"}


def eqns_in(e):
    for p in e.params.values():
        inner = getattr(p, "jaxpr", p)
        if hasattr(inner, "eqns"):
            yield from eqns(inner)


@pytest.mark.parametrize(
    ("moe_add", "dn_dense", "fused"),
    [(True, False, True), (False, False, True), (True, True, True), (False, True, True), (False, True, False)],
)
def test_in_a_stacked_layer_the_dense_kernels_partials_reach_only_the_kernels_that_add_them(
    kernels_engine, moe_add, dn_dense, fused, monkeypatch
):
    """Where a dense kernel's product feeds another kernel, it goes there as its float32 K-split partials and
    that kernel adds them (no XLA launch of its own): q_a's and kv_a's to the cache write (which runs q_a's
    norm too), q_b's to the absorb kernel (which also rotates the query's rope part), o_proj's to the MLP
    norm, the router's and the shared expert's gate and up to the routing kernel (which writes silu(gate) * up
    as the down projection's rows). The shared down's product, added to the routed experts' output, leaves
    the layer as partials with that output (`stacked.Deferred`), for the next layer's attention norm to add
    (the final norm after the last layer); with that switched off (`rms_norm.DEFAULT_CONFIG['moe_add']`) it
    is summed within its own call and added by XLA. The logits stay the sliced model's (the scan test above,
    on this engine). With the shared down in the routed experts' down launch (`int4_moe.DEFAULT_CONFIG['dn_dense']`,
    the default) there is no dense launch of it: that launch's partials of it take the same two ways. The
    routing kernel reads its partials alone (`route_topk`) or where its launch also builds the experts'
    metadata (`route_topk_blocks`, up to `routing.DEFAULT_CONFIG['fused_max_tokens']` tokens, set to 8 here for
    these 4 tokens; the last case sets the limit to 0)."""
    from jaxspec.kernels import int4_moe, rms_norm, routing

    monkeypatch.setitem(rms_norm.DEFAULT_CONFIG, "moe_add", moe_add)
    monkeypatch.setitem(int4_moe.DEFAULT_CONFIG, "dn_dense", dn_dense)
    monkeypatch.setitem(routing.DEFAULT_CONFIG, "fused_max_tokens", 8 if fused else 0)
    engine = kernels_engine("float32")
    tokens = jnp.asarray([np.random.default_rng().integers(0, engine.cfg.vocab_size, 4)], jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    # traced afresh (`_full_forward`'s jit would keep the trace of an equal model made with the other setting)
    jaxpr = jax.make_jaxpr(lambda p, c: decode.forward(engine.model, p, tokens, positions, c))(
        engine.params, engine.init_cache(1, 16)
    )
    (scan,) = [
        e
        for e in eqns(jaxpr.jaxpr, ("pallas_call",))
        if e.primitive.name == "scan" and e.params["length"] == len(stacked_range(engine.cfg))
    ]
    inner = scan.params["jaxpr"].jaxpr
    body = inner.eqns
    n_consts, n_carry = scan.params["num_consts"], scan.params["num_carry"]
    carry_in, carry_out = inner.invars[n_consts : n_consts + n_carry], inner.outvars[:n_carry]
    dense = [e for e in body if "stacked_matmul" in _kernels_of(e)]
    # q_a with kv_a, q_b, o, router with gate and up, and the shared down unless the routed down launch makes it
    assert len(dense) == (4 if dn_dense else 5), [str(e.outvars) for e in dense]
    (routed_down,) = [e for e in body if "int4_moe_down" in _kernels_of(e)]
    readers, summed, carried = set(), [], set()
    for e in dense + ([routed_down] if dn_dense else []):
        outs = [v for v in e.outvars if v.aval.ndim == 3]  # the partials [ksplit, padded rows, N]
        if e is routed_down:  # its routed rows and the shared down's partials
            assert len(outs) == 1 and len(e.outvars) == 2, [str(v.aval) for v in e.outvars]
            if not moe_add:
                summed.append(e)
                continue
        elif len(outs) != len(e.outvars):
            summed.append(e)
            continue
        for v in outs:
            users = [u for u in body if v in u.invars]
            if v in carry_out:  # carried to the next layer: its readers are there
                nxt = carry_in[carry_out.index(v)]
                users += [u for u in body if nxt in u.invars]
                carried |= set().union(*(_kernels_of(u) for u in body if nxt in u.invars))
            assert users and all(_kernels_of(u) - {"stacked_matmul"} for u in users), [u.primitive for u in users]
            readers |= set().union(*(_kernels_of(u) for u in users))
    route_name = "route_topk_blocks" if fused else "route_topk"
    assert readers == {"rms_norm_rows", "write_latents", "absorb_keys", route_name}, readers
    if moe_add:
        assert not summed  # every product's partials reach a kernel that adds them
        assert carried == {"rms_norm_rows"}, carried  # the shared down's: the next layer's attention norm
    else:
        # the shared down projection's: its own call, or the routed down launch's partials
        assert len(summed) == 1 and summed[0] is (routed_down if dn_dense else dense[-1]), summed
        assert not carried
    # the query's rope part comes out of the absorb kernel: no rotation of it in XLA
    assert not any(e.primitive.name in ("sin", "cos") for e in body)


def test_model_reads_dense_weights_in_place_with_the_same_logits(pair):
    sliced, inplace = pair
    assert (sliced.dense_impl, inplace.dense_impl) == ("slice", "interpret")
    # the parameter tree is the same: the in-place weights are the stacked leaves themselves
    assert jax.tree.structure(sliced.params) == jax.tree.structure(inplace.params)
    ids = np.random.default_rng().integers(0, sliced.cfg.vocab_size, size=40).tolist()
    a, b = sliced.target_logits(ids), inplace.target_logits(ids)
    tokens = jnp.asarray([ids[:16]], jnp.int32)
    for engine, used in ((sliced, False), (inplace, True)):  # the kernel is what reads them
        jaxpr = jax.make_jaxpr(lambda p, c, e=engine: _full_forward(e.model, p, tokens, c))(
            engine.params, engine.init_cache(1, 16)
        )
        assert ("stacked_matmul" in str(jaxpr)) == used
        if used:  # a stacked layer: q_a with kv_a, q_b, o, the router with the shared gate and up, the shared down
            assert _kernel_calls(jaxpr, scan=True) == 5
            # and its norms (attention, MLP) are one `kernels.rms_norm` launch each; q_a's runs in the cache
            # write's launch (`kernels.latent_write` with a query, below)
            assert _kernel_calls(jaxpr, "rms_norm_rows", scan=True) == 2
            # the absorbed kv_b products read kv_b in place, one launch each (`kernels.absorb`)
            assert _kernel_calls(jaxpr, "absorb_keys", scan=True) == 1
            assert _kernel_calls(jaxpr, "absorb_values", scan=True) == 1
            # kv_a's norm, the key's rotation, the cache write and q_a's norm are one launch (`kernels.latent_write`)
            assert _kernel_calls(jaxpr, "write_latents", scan=True) == 1
            # the demo's one unrolled dense layer through the same kernels (q_a with kv_a, q_b, o, the MLP's
            # gate with up, its down; two norms and q_a's in the cache write; the absorbed products), then the
            # final norm and lm_head: no weight's product outside the scan is XLA's, whose rounding may follow
            # the row count
            assert stacked_range(engine.cfg).start == 1
            assert _kernel_calls(jaxpr, scan=False) == 5 + 1
            assert _kernel_calls(jaxpr, "rms_norm_rows", scan=False) == 2 + 1
            assert _kernel_calls(jaxpr, "absorb_keys", scan=False) == 1
            assert _kernel_calls(jaxpr, "absorb_values", scan=False) == 1
            assert _kernel_calls(jaxpr, "write_latents", scan=False) == 1
    assert np.abs(a - b).max() / np.abs(a).max() < 1e-5


def test_q_a_norm_in_the_cache_writes_launch_has_the_bits_of_its_own_launch(pair, monkeypatch):
    """q_a's norm runs in the cache write's launch (`kernels.latent_write` with a query; the switch
    `latent_write.DEFAULT_CONFIG['query']`, on by default): the logits, the cache and the captured states have
    the bits they have with the norm as a `kernels.rms_norm` launch of its own, one launch a layer fewer."""
    from jaxspec.kernels import latent_write

    _, inplace = pair
    tokens = jnp.asarray([np.random.default_rng().integers(0, inplace.cfg.vocab_size, 12)], jnp.int32)
    positions = jnp.arange(12, dtype=jnp.int32)[None]
    capture = inplace.cfg.num_layers // 2, inplace.cfg.num_layers - 1
    runs = {}
    for on in (True, False):
        monkeypatch.setitem(latent_write.DEFAULT_CONFIG, "query", on)
        jaxpr, run = _forward(inplace.model, inplace.params, inplace.init_cache(1, 16), tokens, positions, capture)
        norms = _kernel_calls(jaxpr, "rms_norm_rows", scan=True), _kernel_calls(jaxpr, "rms_norm_rows", scan=False)
        assert norms == ((2, 2 + 1) if on else (3, 3 + 1)), norms
        assert _kernel_calls(jaxpr, "write_latents", scan=True) == 1
        runs[on] = jax.tree.leaves(run())
    assert len(runs[True]) == len(runs[False]) >= 3
    for a, b in zip(runs[True], runs[False]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_moe_add_left_to_the_next_norm_has_the_bits_of_xlas_add(kernels_engine, dtype, monkeypatch):
    """The stacked layers leave a MoE layer's closing add (routed output + the shared down's partials, added to
    the residual stream) to the next layer's attention norm launch, the last layer's to the final norm
    (`stacked.Deferred`; switch `rms_norm.DEFAULT_CONFIG['moe_add']`): the logits, the cache and the captured
    states of the unrolled layer, the stack's first, a middle and its last layer have the bits they have with
    XLA's add, and no add of that size runs between the layers' kernels."""
    from jaxspec.kernels import rms_norm

    engine = kernels_engine(dtype)
    L = engine.cfg.num_layers
    assert stacked_range(engine.cfg).start == 1 and L >= 4
    tokens = jnp.asarray([np.random.default_rng().integers(0, engine.cfg.vocab_size, 12)], jnp.int32)
    positions = jnp.arange(12, dtype=jnp.int32)[None]

    def check(scan, on):
        carry = scan.params["jaxpr"].jaxpr.outvars[: scan.params["num_carry"]]
        # the residual stream leaves each layer with its add made (off) or with the add's terms beside it (on)
        hidden = [v for v in carry if v.aval.ndim == 3 and v.aval.shape[-1] == engine.cfg.hidden_size]
        assert len(hidden) == (3 if on else 1), [str(v.aval) for v in carry]

    _same_bits_on_and_off(engine, tokens, positions, rms_norm.DEFAULT_CONFIG, "moe_add", check, monkeypatch)


def _same_bits_on_and_off(engine, tokens, positions, config, key, check, monkeypatch):
    """The forward pass with ``config[key]`` on and off, capturing the unrolled layer's, the stack's first, a
    middle and the last layer's states: ``check(the layers' scan, on)`` on each trace, then the logits, the cache
    and the captured states the same bits both ways, every captured layer's block written."""
    L = engine.cfg.num_layers
    capture = (0, 1, L // 2, L - 1)
    B = tokens.shape[0]
    runs = {}
    for on in (True, False):
        monkeypatch.setitem(config, key, on)
        jaxpr, run = _forward(engine.model, engine.params, engine.init_cache(B, 16), tokens, positions, capture)
        (scan,) = [
            e for e in eqns(jaxpr.jaxpr, ("pallas_call",)) if e.primitive.name == "scan" and e.params["length"] == L - 1
        ]
        check(scan, on)
        runs[on] = jax.tree.leaves(run())
    assert len(runs[True]) == len(runs[False]) == 3  # logits, cache, captured states
    for a, b in zip(runs[True], runs[False]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    aux = np.abs(np.asarray(runs[True][2], np.float32)).reshape(-1, len(capture), engine.cfg.hidden_size)
    assert np.all(aux.max(axis=(0, 2)) > 0)  # every captured layer's block written


@pytest.mark.parametrize(("dtype", "T", "moe_add"), [("float32", 12, False), ("bfloat16", 5, True)])
def test_captured_states_written_by_the_next_norms_launch_have_the_bits_of_xlas_update(
    kernels_engine, dtype, T, moe_add, monkeypatch
):
    """With `rms_norm.DEFAULT_CONFIG['capture']` on, a stacked layer's output goes into the captured hidden states
    from the next layer's attention norm launch (`kernels.rms_norm`'s ``capture``), the last layer's after the
    scan (or by the final norm's side with the MoE add deferred): no `dynamic_update_slice` runs in the layers'
    loop, and the logits, the cache and the captured states of the unrolled layer, the stack's first, a middle
    and its last layer have the bits of XLA's update in every layer; with XLA's closing add (a prompt of 12
    tokens) and with the add left to the next norm (a verify's 5 tokens)."""
    from jaxspec.kernels import rms_norm

    engine = kernels_engine(dtype)
    L = engine.cfg.num_layers
    assert stacked_range(engine.cfg).start == 1 and L >= 4
    rng = np.random.default_rng()
    tokens = jnp.asarray(rng.integers(0, engine.cfg.vocab_size, (2, T)), jnp.int32)
    positions = jnp.arange(T, dtype=jnp.int32)[None].repeat(2, 0) + (0 if T > 5 else 3)
    monkeypatch.setitem(rms_norm.DEFAULT_CONFIG, "moe_add", moe_add)

    def check(scan, on):
        body = list(eqns(scan.params["jaxpr"].jaxpr, ("pallas_call",)))
        updates = [e for e in body if e.primitive.name == "dynamic_update_slice"]
        assert len(updates) == (0 if on else 1), [str(e.outvars[0].aval) for e in updates]
        # nor a lookup of the layer's row in the capture table: the norm's kernel reads the table itself
        table = [v for e in body if e.primitive.name in ("dynamic_slice", "gather") for v in e.invars]
        table = [v for v in table if getattr(v, "aval", None) is not None and v.aval.shape == (L - 1,)]
        assert (len(table) == 0) == on, [str(v.aval) for v in table]

    _same_bits_on_and_off(engine, tokens, positions, rms_norm.DEFAULT_CONFIG, "capture", check, monkeypatch)


@pytest.mark.parametrize(("dtype", "T", "moe_add"), [("float32", 12, False), ("bfloat16", 1, True)])
def test_the_shared_down_in_the_routed_down_launch_has_the_bits_of_its_own_launch(
    kernels_engine, dtype, T, moe_add, monkeypatch
):
    """With `int4_moe.DEFAULT_CONFIG['dn_dense']` on, a stacked MoE layer's shared down projection runs as
    programs of the routed experts' down launch (`model._shared_down_in_launch`), not as a dense kernel launch of
    its own: the scan body then has four `stacked_matmul` calls, not five, and the logits, the cache and the
    captured states have the bits of the separate launch: a prompt of 12 tokens with the MoE add made by XLA,
    and a decode step of one token with the add left to the next norm (`stacked.Deferred`)."""
    from jaxspec.kernels import int4_moe, rms_norm

    engine = kernels_engine(dtype)
    L = engine.cfg.num_layers
    capture = (0, 1, L // 2, L - 1)
    tokens = jnp.asarray([np.random.default_rng().integers(0, engine.cfg.vocab_size, T)], jnp.int32)
    positions = jnp.arange(T, dtype=jnp.int32)[None] + (0 if T > 1 else 7)
    monkeypatch.setitem(rms_norm.DEFAULT_CONFIG, "moe_add", moe_add)
    runs = {}
    for on in (True, False):
        monkeypatch.setitem(int4_moe.DEFAULT_CONFIG, "dn_dense", on)
        jaxpr, run = _forward(engine.model, engine.params, engine.init_cache(1, 16), tokens, positions, capture)
        assert _kernel_calls(jaxpr, scan=True) == (4 if on else 5), on
        assert _kernel_calls(jaxpr, "int4_moe_down", scan=True) == 1
        runs[on] = jax.tree.leaves(run())
    assert len(runs[True]) == len(runs[False]) == 3  # logits, cache, captured states
    for a, b in zip(runs[True], runs[False]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_speculative_greedy_with_dense_weights_in_place_equals_plain(pair):
    sliced, inplace = pair
    prompts = [
        inplace.tokenizer.encode('def read_lines(path):\n    """Return the lines."""\n'),
        inplace.tokenizer.encode("import os\n\n\ndef main(argv):\n"),
    ]
    plain = [r.tokens for r in sliced.generate(prompts, 24)]
    assert [r.tokens for r in inplace.generate(prompts, 24)] == plain
    res = inplace.generate(prompts, 24, spec=SpecConfig(3, 1, 4))
    assert [r.tokens for r in res] == plain
    assert np.mean([r.stats["mean_accept_len"] for r in res]) >= 2.0  # the demo draft is good: equality is tested


def test_kernel_gradients_match_the_sliced_matmul():
    """The backward pass (XLA on the layer's slice): gradients of x and of the whole stack, under a scan."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(3, 64, 64)) / 8, jnp.float32)
    x = jnp.asarray(rng.normal(size=(5, 64)), jnp.float32)

    def loss(x, w, mm):
        return jax.lax.scan(lambda c, i: (jnp.tanh(mm(c, w, i)), None), x, jnp.arange(3))[0].sum()

    got = jax.grad(loss, (0, 1))(x, w, lambda c, w, i: sm.stacked_matmul(c, w, i, interpret=True))
    ref = jax.grad(loss, (0, 1))(x, w, lambda c, w, i: c @ w[i])
    for g, r in zip(got, ref):
        assert float(jnp.abs(g - r).max() / jnp.abs(r).max()) < 1e-5


def test_training_the_target_through_the_kernel_gives_the_sliced_gradients(pair):
    """`training.lm_loss` (the target's own trainer) differentiates through the in-place reads."""
    from jaxspec import training

    sliced, inplace = pair
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, sliced.cfg.vocab_size, size=(2, 16)), jnp.int32)
    # compiled whole: op by op, the two backward passes were ~750 small compiles (50 s on the CPU)
    ga = jax.jit(jax.grad(lambda p: training.lm_loss(sliced.model, p, tokens), allow_int=True))(sliced.params)
    gb = jax.jit(jax.grad(lambda p: training.lm_loss(inplace.model, p, tokens), allow_int=True))(inplace.params)
    real = lambda g: [x for x in jax.tree.leaves(g) if jnp.issubdtype(x.dtype, jnp.inexact)]  # noqa: E731
    leaves_a, leaves_b = real(ga), real(gb)
    assert len(leaves_a) == len(leaves_b)
    scale = max(float(jnp.abs(g).max()) for g in leaves_a)
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(leaves_a, leaves_b)) < 1e-5 * scale


def test_router_logits_read_in_place_are_float32_and_row_invariant():
    """A stacked layer's router [D, E] is read in place in float32 (`model.INPLACE_LEAVES`): its logits
    match numpy's float64 product, and a token's row has the same bits alone as in a verify's batch."""
    from jaxspec.model import INPLACE_LEAVES, _split_inplace, router_logits

    rng = np.random.default_rng()
    stack = jnp.asarray(rng.normal(size=(3, 256, 96)) / 16, jnp.float32)
    x = jnp.asarray(rng.normal(size=(40, 256)), jnp.bfloat16)  # the hidden state, bfloat16 on the GPU
    want = np.asarray(x, np.float64) @ np.asarray(stack[2], np.float64)
    of = lambda i: stacked.LayerOf(stack, jnp.int32(i), "interpret")  # noqa: E731
    f = jax.jit(lambda x, i: router_logits(x, of(i)))
    got = np.asarray(f(x, 2))
    assert got.dtype == np.float32 and _rel(got, want) < 1e-6
    assert "stacked_matmul" in str(jax.make_jaxpr(f)(x, 2))
    for rows in ((0,), (4,), (39,), tuple(range(17, 23))):  # three row blocks of 16 in the whole call
        part = np.asarray(f(x[np.asarray(rows)], 2))
        np.testing.assert_array_equal(part, got[np.asarray(rows)])
    assert _rel(router_logits(x, stack[2]), want) < 1e-6  # the sliced (unstacked) form
    # the scan hands the router and its bias (the routing kernel reads the bias's row) to the kernels whole,
    # and leaves what no kernel reads in place (here an unknown leaf) to the scan's slices
    params = {
        "moe": {
            "router": stack,
            "router_bias": stack[:, 0],
            "other": stack[:, 1],
            "shared": {"gate": {"kernel": stack}},
        },
        "n": {},
    }
    whole, rest = _split_inplace(params)
    assert set(whole) == {("moe", "router"), ("moe", "router_bias"), ("moe", "shared", "gate", "kernel")}
    assert INPLACE_LEAVES[0] in whole
    assert set(rest["moe"]) == {"other", "shared"}


def test_float32_probe_runs_when_first_asked_inside_a_trace_and_fails_on_rounded_products(monkeypatch):
    """The router's float32 products are probed where the model first asks, often inside a decode step's
    trace (compiled and run at once); a kernel that rounded float32 inputs (TF32 or bfloat16) fails it.
    Faked here: the backend reads 'gpu' and the kernel runs interpreted."""
    real = sm.stacked_matmul
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(sm, "stacked_matmul", lambda *a, **kw: real(*a, **{**kw, "interpret": True}))
    answers = {}

    def step(x):
        answers["float32"] = sm.available("float32")
        answers["bfloat16"] = sm.available("bfloat16")
        return x + 1

    sm._available.cache_clear()
    try:
        jax.jit(step).lower(jnp.zeros(3))
        assert answers == {"float32": None, "bfloat16": None}, answers
        sm._available.cache_clear()

        def rounded(x, w, i, **kw):  # products of inputs rounded to bfloat16, accumulated in float32
            return real(x.astype(jnp.bfloat16).astype(x.dtype), w, i, **{**kw, "interpret": True})

        monkeypatch.setattr(sm, "stacked_matmul", rounded)
        assert "float32 probe call returned wrong values (128.0 for 128.03125)" in sm.available("float32")
        assert sm.available("bfloat16") is None
    finally:  # the real answers (no GPU here) for the rest of the session
        sm._available.cache_clear()


def test_float32_products_fall_back_to_the_slice_where_their_probe_fails(monkeypatch):
    """Where the compiled kernel serves bfloat16 but its float32 probe fails, a float32 `LayerOf`
    product (the router) runs XLA's einsum on the layer's slice, with the same values."""
    monkeypatch.setattr(sm, "available", lambda dtype="bfloat16": "no float32" if dtype == "float32" else None)
    rng = np.random.default_rng()
    stack = jnp.asarray(rng.normal(size=(2, 64, 32)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
    f = lambda x, s: stacked.einsum("td,de->te", x, stacked.LayerOf(s, jnp.int32(1), "kernel"), jnp.float32)  # noqa: E731
    assert _kernel_calls(jax.make_jaxpr(f)(x, stack)) == 0
    assert _rel(f(x, stack), np.asarray(x, np.float64) @ np.asarray(stack[1], np.float64)) < 1e-6


def test_a_bfloat16_router_with_the_shared_gate_and_up_in_one_call_gives_float32_logits():
    """A bfloat16 model's router (bfloat16, as HF transformers and SGLang hold Kimi's) meets the norm's
    bfloat16 rows in the same kernel call as the shared expert's gate and up: the logits are float32 sums
    of the exact products (never rounded to bfloat16 on the way), each product has the bits of its own
    call, and a row's bits do not depend on the rows beside it."""
    rng = np.random.default_rng()
    k = 512
    router, gate, up = (jnp.asarray(rng.normal(size=(2, k, n)) / 16, jnp.bfloat16) for n in (96, 64, 64))
    x = jnp.asarray(rng.normal(size=(20, k)), jnp.bfloat16)
    want = np.asarray(x, np.float64) @ np.asarray(router[1], np.float64)
    index = jnp.int32(1)  # one layer index for the three, as the stacked layers' scan gives them
    layers = [stacked.LayerOf(w, index, "interpret") for w in (router, gate, up)]
    contracts = ("td,de->te", "td,df->tf", "td,df->tf")

    def rows(m):
        return stacked.Rows(jnp.pad(x[:m], ((0, sm.padded_rows(m) - m), (0, 0))), (m, k))

    run = jax.jit(lambda r: stacked.einsums(contracts, r, layers, (jnp.float32, None, None)))
    full = run(rows(20))
    assert [g.dtype for g in full] == [jnp.float32, jnp.bfloat16, jnp.bfloat16]
    assert sum(e.primitive.name == "pallas_call" for e in eqns(jax.make_jaxpr(run)(rows(20)).jaxpr)) == 1
    assert _rel(full[0], want) < 1e-6  # a bfloat16 rounding of the logits would be ~4e-3
    for w, got in zip((router, gate, up), full):  # each as its own call
        alone = sm.stacked_matmul(x, w, 1, interpret=True, out_dtype=got.dtype)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(alone, np.float32))
    for m in (1, 3):
        for got, want_rows in zip(run(rows(m)), full):
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want_rows[:m], np.float32))
    # the model's router: a float32 result from the bfloat16 weight, the same bits as above
    from jaxspec.model import router_logits

    np.testing.assert_array_equal(np.asarray(router_logits(rows(20), layers[0])), np.asarray(full[0]))
    assert _rel(router_logits(x, router[1]), want) < 1e-6  # sliced: XLA's product of the widened values
    with pytest.raises(ValueError, match="2 output dtypes for 3 weights"):
        stacked.einsums(contracts, rows(3), layers, (jnp.float32, None))
