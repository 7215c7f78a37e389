"""MLA attention over the latent cache in one kernel (`jaxspec.kernels.mla_attention`), Pallas interpret mode.

Checked against the model's own XLA attention (`layers.attention`, the absorbed form `MLAttention` uses)
on causal, tree and fully masked rows, and for a row's bits not depending on the other tokens of the
call (a verify row equals the decode step).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import eqns

from jaxspec import demo
from jaxspec.engine import Engine, _full_forward
from jaxspec.kernels import mla_attention as ma
from jaxspec.layers import attention, causal_mask, tree_mask
from jaxspec.model import choose_attention_impl
from jaxspec.spec import SpecConfig


def _inputs(rng, B, T, H, L, r, S, dtype=jnp.float32):
    q_lat = jnp.asarray(rng.normal(size=(B, T, H, L)), dtype)
    q_rope = jnp.asarray(rng.normal(size=(B, T, H, r)), dtype)
    cache = jnp.asarray(rng.normal(size=(B, S, L + r)), dtype)
    return q_lat, q_rope, cache


def _model_attention(q_lat, q_rope, cache, mask, scale):
    L = q_lat.shape[-1]
    return attention(q_lat, cache[..., :L], cache[..., :L], mask, scale, q_rope, cache[..., L:])


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


run = jax.jit(lambda ql, qr, c, m: ma.mla_attention(ql, qr, c, m, 0.125, interpret=True))


@pytest.mark.parametrize("B,T,H,L,r,S", [(2, 1, 4, 64, 16, 64), (2, 3, 4, 64, 16, 96), (1, 5, 8, 32, 16, 128)])
def test_matches_the_model_attention_on_causal_rows(B, T, H, L, r, S):
    rng = np.random.default_rng(B * 100 + T)
    ql, qr, c = _inputs(rng, B, T, H, L, r, S)
    start = rng.integers(0, S - T, size=B)
    mask = causal_mask(jnp.asarray(start[:, None] + np.arange(T), jnp.int32), S)
    got = run(ql, qr, c, mask)
    assert got.shape == (B, T, H, L) and got.dtype == jnp.float32
    assert _rel(got, _model_attention(ql, qr, c, mask, 0.125)) < 1e-5


def test_tree_mask_and_a_row_that_sees_nothing():
    rng = np.random.default_rng(7)
    B, N, H, L, r, S = 2, 4, 4, 64, 16, 64
    ql, qr, c = _inputs(rng, B, N, H, L, r, S)
    tree = np.tril(np.ones((N, N), bool))
    tree[3, 1] = False  # node 3 hangs off node 0's second child: not a chain
    mask = tree_mask(jnp.asarray([20, 33]), jnp.asarray(np.broadcast_to(tree, (B, N, N))), S)
    mask = mask.at[1, 2].set(False)  # a padding row: every slot masked
    got = run(ql, qr, c, mask)
    ref = _model_attention(ql, qr, c, mask, 0.125)
    assert np.all(np.isfinite(np.asarray(got)))
    assert _rel(got, ref) < 1e-5
    np.testing.assert_allclose(
        np.asarray(got[1, 2]), np.broadcast_to(np.asarray(c[1, :, :L]).mean(0), (H, L)), atol=1e-5
    )


def test_a_row_is_the_same_bits_alone_and_among_the_tokens_of_a_verify():
    rng = np.random.default_rng(3)
    B, T, H, L, r, S = 2, 4, 8, 64, 16, 96
    ql, qr, c = _inputs(rng, B, T, H, L, r, S)
    mask = causal_mask(jnp.asarray([[50, 51, 52, 53], [7, 8, 9, 10]], jnp.int32), S)
    many = np.asarray(run(ql, qr, c, mask))
    for t in range(T):
        alone = np.asarray(run(ql[:, t : t + 1], qr[:, t : t + 1], c, mask[:, t : t + 1]))
        np.testing.assert_array_equal(alone[:, 0], many[:, t], err_msg=f"token {t}")


@pytest.mark.parametrize("H,dtype,splits", [(4, jnp.float32, 32), (20, jnp.float32, 1), (8, jnp.bfloat16, 32)])
def test_a_tree_node_through_its_window_is_the_decode_step_of_its_path(H, dtype, splits):
    """A tree verify with `window_of_tree`: each node reads its ancestors and itself at the slots a decode step
    of the same tokens has them (P, P + 1, ..., its depth), so its row has that decode step's bits; the
    nodes it does not see are never read (their slots poisoned with NaN here: a masked slot that is read
    still meets its probability 0 in the value product, and 0 x NaN is NaN). H 20: two programs a token.
    The second sequence's window starts in the second block: the first is read as it lies (a split of
    its own, or with `splits` 1 the first step of the one split's walk)."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    B, L, r, S = 2, 32, 16, 192
    parents = [-1, 0, 0, 1, 2, 3, 1]  # two branches: 0-1-3-5, 0-2-4, and 6 under 1
    N = len(parents)
    tree = np.zeros((N, N), bool)
    for i in range(N):
        j = i
        while j >= 0:
            tree[i, j] = True
            j = parents[j]
    P = jnp.asarray([40, 126], jnp.int32)  # the second row's path 0-1-3-5 crosses the block boundary at 128
    ql, qr, c = _inputs(rng, B, N, H, L, r, S, dtype)
    trees = jnp.asarray(np.broadcast_to(tree, (B, N, N)))
    mask = tree_mask(P, trees, S)
    start, slots = ma.window_of_tree(P, trees)
    assert np.array_equal(np.asarray(start), np.asarray(P))
    assert np.asarray(slots)[1, 5].tolist() == [126, 127, 129, 131, -1, -1, -1]  # node 5's path, depth order
    path = [0, 1, 3, 5]
    # every node off the path 0-1-3-5 is poison: only that path's rows are checked
    poisoned = c
    for b in range(B):
        for i in set(range(N)) - set(path):
            poisoned = poisoned.at[b, int(P[b]) + i].set(jnp.nan)
    kw = dict(config={"max_splits": splits}, interpret=True)
    f = jax.jit(lambda ql, qr, c, m, w: ma.mla_attention(ql, qr, c, m, 0.125, window=w, **kw))
    verify = np.asarray(f(ql, qr, poisoned, mask, (start, slots)).astype(jnp.float32))
    plain = jax.jit(lambda ql, qr, c, m: ma.mla_attention(ql, qr, c, m, 0.125, **kw))
    ref = np.asarray(_model_attention(ql, qr, c, mask, 0.125).astype(jnp.float32))
    for d, i in enumerate(path):
        assert np.isfinite(verify[:, i]).all(), (i, H)
        # the decode step at depth d: the path's nodes written at P .. P + d, the slots past them unseen
        dec = poisoned
        for b in range(B):
            for k, a in enumerate(path[: d + 1]):
                dec = dec.at[b, int(P[b]) + k].set(c[b, int(P[b]) + a])
        dmask = causal_mask((P + d)[:, None], S)
        dec = jnp.where(jnp.isnan(dec), 0, dec)  # a decode step's unseen slots hold finite values
        step = np.asarray(plain(ql[:, i : i + 1], qr[:, i : i + 1], dec, dmask).astype(jnp.float32))[:, 0]
        np.testing.assert_array_equal(verify[:, i], step, err_msg=f"node {i}, H {H}, {dtype}")
        tol = 1e-5 if dtype == jnp.float32 else 2e-2
        assert _rel(verify[:, i], ref[:, i]) < tol
    without = np.asarray(plain(ql, qr, poisoned, mask).astype(jnp.float32))
    assert not np.isfinite(without[:, path[-1]]).all()  # the mask alone reads the poisoned siblings
    with pytest.raises(ValueError, match=r"expected window \(start \[B\], slots \[B, T, W\]\)"):
        ma.mla_attention(ql, qr, c, mask, 0.125, window=(start[:1], slots), interpret=True)


@pytest.mark.parametrize("splits", [32, 2])
def test_a_bound_skips_the_splits_past_it_with_the_same_bits(splits):
    """`bound`: the splits wholly past it are never read (their slots poisoned with NaN here), and every row
    keeps the bits of the call without it: one block a split (`splits` 32), and four blocks a split with the
    bound inside the live split (2). Also a tree verify through its window, and a bound at the cache's end."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    B, T, H, L, r, S, bs = 3, 2, 4, 32, 16, 512, 64
    ql, qr, c = _inputs(rng, B, T, H, L, r, S, jnp.bfloat16)
    last = np.array([37, 300, S - T])  # each sequence's first new token
    mask = causal_mask(jnp.asarray(last[:, None] + np.arange(T), jnp.int32), S)
    bound = jnp.asarray(last + T, jnp.int32)
    kw = dict(config={"max_splits": splits}, interpret=True)
    plain = jax.jit(lambda ql, qr, c, m: ma.mla_attention(ql, qr, c, m, 0.125, **kw))
    bounded = jax.jit(lambda ql, qr, c, m, bd, w=None: ma.mla_attention(ql, qr, c, m, 0.125, bound=bd, window=w, **kw))
    want = np.asarray(plain(ql, qr, c, mask).astype(jnp.float32))
    per_split = S // bs // ma.splits_for(S, bs, splits) * bs
    poisoned = c
    for b in range(B):  # from the first split that starts at or past the bound on
        dead = -(-int(bound[b]) // per_split) * per_split
        poisoned = poisoned.at[b, dead:].set(jnp.nan)
    got = np.asarray(bounded(ql, qr, poisoned, mask, bound).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)
    full = jnp.full((B,), S, jnp.int32)
    np.testing.assert_array_equal(np.asarray(bounded(ql, qr, c, mask, full).astype(jnp.float32)), want)
    # a tree verify: its window's bits with the bound as without it
    tree = jnp.asarray(np.broadcast_to(np.array([[1, 0], [1, 1]], bool), (B, T, T)))
    P = jnp.asarray(last, jnp.int32)
    tmask = tree_mask(P, tree, S)
    window = ma.window_of_tree(P, tree)
    windowed = jax.jit(lambda ql, qr, c, m, w: ma.mla_attention(ql, qr, c, m, 0.125, window=w, **kw))
    np.testing.assert_array_equal(
        np.asarray(bounded(ql, qr, poisoned, tmask, bound, window).astype(jnp.float32)),
        np.asarray(windowed(ql, qr, c, tmask, window).astype(jnp.float32)),
    )
    with pytest.raises(ValueError, match=r"expected bound \[B\] with B=3; found \(2,\)"):
        ma.mla_attention(ql, qr, c, mask, 0.125, bound=bound[:2], interpret=True)


def test_the_models_bound_is_one_past_the_last_slot_any_row_sees():
    """`model._attention_bound`: per sequence, one past the highest slot its mask (or its window) sets; the
    whole cache for a sequence that sees none (its rows keep the uniform average over every slot)."""
    from jaxspec.model import _attention_bound

    S = 64
    mask = causal_mask(jnp.asarray([[3, 4], [20, 21], [0, 0]], jnp.int32), S).astype(jnp.int32)
    mask = mask.at[2].set(0)
    assert _attention_bound(mask).tolist() == [5, 22, S]
    tree = jnp.asarray(np.broadcast_to(np.array([[1, 0], [1, 1]], bool), (3, 2, 2)))
    window = ma.window_of_tree(jnp.asarray([3, 20, 40], jnp.int32), tree)
    assert _attention_bound(mask, window).tolist() == [5, 22, 42]


def test_the_window_probe_catches_a_kernel_that_reads_the_siblings(monkeypatch):
    """`window_problem`: the model passes a tree verify's window only where this check passed (compiled: once
    per dtype on the device). A kernel that ignores the window reads the poisoned sibling and fails it."""
    assert ma.window_problem("float32", interpret=True) is None
    assert ma.window_problem("bfloat16", interpret=True) is None
    if jax.default_backend() != "gpu":
        assert "needs a GPU backend" in ma.window_problem()
    real = ma.mla_attention
    monkeypatch.setattr(ma, "mla_attention", lambda *a, window=None, **kw: real(*a, **kw))
    ma._window_available.cache_clear()
    try:
        assert "the float32 window probe's tree row differs from its decode step" in ma.window_problem(
            "float32", interpret=True
        )
    finally:
        ma._window_available.cache_clear()


def test_the_split_count_depends_on_the_slots_alone():
    assert ma.splits_for(4096, 64, 32) == 32 and ma.splits_for(1024, 64, 32) == 16
    assert ma.splits_for(96 * 64, 64, 32) == 32 and ma.splits_for(97 * 64, 64, 32) == 1  # 97 blocks: prime
    assert ma.splits_for(64, 64, 32) == 1 and ma.splits_for(12 * 16, 16, 8) == 6
    assert ma._block_s(96, 0) == 32 and ma._block_s(4096, None) == 64 and ma._block_s(40, 0) == 0


@pytest.mark.parametrize("max_splits", [1, 2, 3, 8])
def test_every_split_count_matches_the_model_attention(max_splits):
    """The per-split partials and their combine: 1 (one walk), uneven choices, one block per split;
    a tree row that sees only late slots, a row whose early splits are wholly masked."""
    rng = np.random.default_rng(11 + max_splits)
    B, T, H, L, r, S = 2, 3, 4, 64, 16, 128
    ql, qr, c = _inputs(rng, B, T, H, L, r, S)
    mask = causal_mask(jnp.asarray([[100, 101, 102], [5, 6, 7]], jnp.int32), S)
    mask = mask.at[0, 1, :90].set(False)  # sees 90..101 only
    cfg = {"block_s": 16, "max_splits": max_splits}
    got = jax.jit(lambda *a: ma.mla_attention(*a, 0.125, config=cfg, interpret=True))(ql, qr, c, mask)
    assert _rel(got, _model_attention(ql, qr, c, mask, 0.125)) < 1e-5
    with pytest.raises(ValueError, match=r"unknown keys \['splits'\]"):
        ma.mla_attention(ql, qr, c, mask, 0.125, config={"splits": 2}, interpret=True)


def test_no_copies_around_the_kernels():
    """Queries, output and an int32 mask go to and from the two kernels as views: no concatenate, pad,
    slice or cast kernels (rows past T x H are masked inside); a bool mask costs one cast."""
    rng = np.random.default_rng(9)
    ql, qr, c = _inputs(rng, 2, 3, 4, 64, 16, 64, jnp.bfloat16)  # 12 query rows: a partial block
    mask = causal_mask(jnp.asarray([[40, 41, 42], [3, 4, 5]], jnp.int32), 64)
    f = lambda ql, qr, c, m: ma.mla_attention(ql, qr, c, m, 0.125, interpret=True)  # noqa: E731
    ops = [e.primitive.name for e in jax.make_jaxpr(f)(ql, qr, c, mask.astype(jnp.int32)).jaxpr.eqns]
    assert sorted(set(ops)) == ["pallas_call", "reshape"] and ops.count("pallas_call") == 2, ops
    ops = [e.primitive.name for e in jax.make_jaxpr(f)(ql, qr, c, mask).jaxpr.eqns]
    assert ops.count("convert_element_type") == 1 and ops.count("pallas_call") == 2, ops
    np.testing.assert_array_equal(
        np.asarray(jax.jit(f)(ql, qr, c, mask.astype(jnp.int32))), np.asarray(jax.jit(f)(ql, qr, c, mask))
    )


def test_bfloat16_is_close_to_the_model_attention():
    rng = np.random.default_rng(5)
    ql, qr, c = _inputs(rng, 2, 2, 8, 64, 16, 128, jnp.bfloat16)
    mask = causal_mask(jnp.asarray([[90, 91], [3, 4]], jnp.int32), 128)
    got = run(ql, qr, c, mask)
    assert got.dtype == jnp.bfloat16
    assert _rel(got.astype(jnp.float32), _model_attention(ql, qr, c, mask, 0.125).astype(jnp.float32)) < 2e-2


def test_shapes_it_does_not_take_are_clear_errors():
    rng = np.random.default_rng(0)
    ql, qr, c = _inputs(rng, 1, 1, 4, 64, 16, 64)
    mask = jnp.ones((1, 1, 64), bool)
    assert ma.shapes_ok(512, 64, 4096) and not ma.shapes_ok(48, 16, 64) and not ma.shapes_ok(64, 16, 40)
    assert ma.shapes_ok(64, 16, 96) and not ma.shapes_ok(64, 16, 96, block_s=64)
    with pytest.raises(ValueError, match=r"expected q_lat \[B, T, H, L\].*\(1, 64, 80\).*\(1, 1, 32\)"):
        ma.mla_attention(ql, qr, c, jnp.ones((1, 1, 32), bool), 0.1, interpret=True)
    with pytest.raises(ValueError, match="block_s=48 dividing S=64"):
        ma.mla_attention(ql, qr, c, mask, 0.1, config={"block_s": 48}, interpret=True)


@pytest.fixture(scope="module")
def pair():
    path = demo.ensure_converted(progress=False, log=lambda m: None)  # the user cache's copy, shared
    return Engine.load(path, dtype="float32"), Engine.load(path, dtype="float32", attention_impl="interpret")


def test_the_demo_pair_through_the_kernel_gives_the_same_logits_and_lossless_speculation(pair):
    xla, kernel = pair
    assert (xla.attention_impl, kernel.attention_impl) == ("xla", "interpret")
    ids = np.random.default_rng().integers(0, xla.cfg.vocab_size, size=40).tolist()
    a, b = xla.target_logits(ids), kernel.target_logits(ids)
    assert np.abs(a - b).max() / np.abs(a).max() < 1e-5
    tokens = jnp.asarray([ids[:32]], jnp.int32)
    cache = kernel.init_cache(1, 32)
    closed = jax.make_jaxpr(lambda p, t, c: _full_forward(kernel.model, p, t, c))(kernel.params, tokens, cache)
    assert "mla_attention" in str(closed) and "mla_attention" not in str(
        jax.make_jaxpr(lambda p, t, c: _full_forward(xla.model, p, t, c))(xla.params, tokens, cache)
    )
    # every layer's kernel reads the whole stacked cache in place (no slice of the layer copied out)
    calls = [e for e in eqns(closed.jaxpr) if e.primitive.name == "pallas_call" and e.outvars[0].aval.ndim == 4]
    full = cache.latent_LBSC.shape
    assert len(calls) == 2 and all(tuple(e.invars[4].aval.shape) == full for e in calls), [
        e.invars[4].aval.shape for e in calls
    ]
    prompts = [
        kernel.tokenizer.encode('def read_lines(path):\n    """Return the lines."""\n'),
        kernel.tokenizer.encode("import os\n\n\ndef main(argv):\n"),
    ]
    plain = [r.tokens for r in kernel.generate(prompts, 24)]
    res = kernel.generate(prompts, 24, spec=SpecConfig(3, 1, 4))
    assert [r.tokens for r in res] == plain == [r.tokens for r in xla.generate(prompts, 24)]
    assert np.mean([r.stats["mean_accept_len"] for r in res]) >= 2.0  # the demo draft is good: equality is tested
    # a branching tree's verify reads each node's ancestors through the kernel's window
    res = kernel.generate(prompts, 24, spec=SpecConfig(3, 2, 6))
    assert [r.tokens for r in res] == plain
    assert np.mean([r.stats["mean_accept_len"] for r in res]) >= 2.0


def test_a_branching_verify_passes_the_window_to_every_layers_kernel(pair):
    """`Transformer(..., window=)`: the attention kernel of every layer gets the window's start and slots (its
    per-token form), and the logits stay XLA's attention's on the physical tree mask."""
    xla, kernel = pair
    parents = [-1, 0, 0, 1]
    tree = np.zeros((4, 4), bool)
    for i, p in enumerate(parents):
        tree[i] = tree[p] if p >= 0 else tree[i]
        tree[i, i] = True
    trees = jnp.asarray(tree[None])
    P = jnp.asarray([9], jnp.int32)
    depth = jnp.asarray([[0, 1, 1, 2]], jnp.int32)
    tokens = jnp.asarray([[5, 17, 23, 42]], jnp.int32)
    cache = kernel.init_cache(1, 32)
    prefix = jnp.asarray(np.random.default_rng(2).integers(0, kernel.cfg.vocab_size, size=(1, 9)), jnp.int32)

    def forward(engine, window):
        m = engine.model
        pos = jnp.arange(9, dtype=jnp.int32)[None]
        _, c, _ = m.apply({"params": engine.params}, prefix, pos, cache, pos, causal_mask(pos, 32))
        write = P[:, None] + jnp.arange(4, dtype=jnp.int32)
        args = (tokens, P[:, None] + depth, c, write, tree_mask(P, trees, 32))
        return m.apply({"params": engine.params}, *args, window=window)[0]

    window = ma.window_of_tree(P, trees)
    a, b = (jax.jit(lambda w, e=e: forward(e, w))(window) for e in (xla, kernel))  # compiled whole: fewer compiles
    assert np.abs(a - b).max() / np.abs(a).max() < 1e-5
    closed = jax.make_jaxpr(lambda w: forward(kernel, w))(window)
    calls = [e for e in eqns(closed.jaxpr) if e.primitive.name == "pallas_call" and e.params["name"] == "mla_attention"]
    # the prefix's forward (layer 0, then the stacked layers' scan body) with the mask and its bound, then
    # the verify's with the window's two arrays too
    assert [len(e.invars) for e in calls] == [6, 6, 8, 8]


def test_attention_impl_choice_and_errors(monkeypatch):
    expected = "kernel" if ma.available() is None else "xla"
    assert choose_attention_impl() == expected and choose_attention_impl("interpret") == "interpret"
    assert choose_attention_impl("xla") == "xla"
    # the default follows the compiled kernel's probe: where it passes (a GPU), the kernel
    monkeypatch.setattr(ma, "available", lambda *a: None)
    assert choose_attention_impl() == "kernel" and choose_attention_impl("xla") == "xla"
    monkeypatch.setattr(ma, "available", lambda *a: "the probe call returned wrong values")
    assert choose_attention_impl() == "xla"
    with pytest.raises(ValueError, match="attention_impl='kernel': the probe call returned wrong values"):
        choose_attention_impl("kernel")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"attention_impl: expected None or one of \('xla', 'kernel', 'interpret'\)"):
        choose_attention_impl("flash")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="attention_impl='kernel': the Pallas Triton kernel needs a GPU backend"):
            choose_attention_impl("kernel")


def test_probe_passes_when_first_asked_inside_a_trace(monkeypatch):
    """On a GPU the model first asks the attention kernel's probe while a decode step is being traced
    (`choose_attention_impl` in the layer); the probe must run its call at once, not stage it into that
    trace and fail on its tracers (which made every model fall back to XLA's attention on the H200).
    Faked here: the backend reads 'gpu' and the kernel runs interpreted; a kernel that returns wrong
    values still fails the probe."""
    real = ma.mla_attention
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(ma, "mla_attention", lambda *a, **kw: real(*a, **{**kw, "interpret": True}))
    answers = {}

    def step(x):
        answers["probe"] = ma.available()
        answers["choice"] = choose_attention_impl()
        answers["float32"] = choose_attention_impl(None, jnp.float32)
        return x + 1

    ma._available.cache_clear()
    try:
        jax.jit(step).lower(jnp.zeros(3))
        assert answers == {"probe": None, "choice": "kernel", "float32": "kernel"}, answers
        ma._available.cache_clear()
        monkeypatch.setattr(ma, "mla_attention", lambda *a, **kw: real(*a, **{**kw, "interpret": True}) * 1.5)
        assert "the bfloat16 probe call returned wrong values" in ma.available()
        assert choose_attention_impl() == "xla"
        ma._available.cache_clear()

        def rounded(ql, qr, c, *a, **kw):  # products of inputs rounded to bfloat16 (as TF32 would round them)
            r = lambda v: v.astype(jnp.bfloat16).astype(v.dtype)  # noqa: E731
            return real(r(ql), r(qr), r(c), *a, **{**kw, "interpret": True})

        monkeypatch.setattr(ma, "mla_attention", rounded)
        assert ma.available("bfloat16") is None  # within bfloat16's tolerance
        assert "the float32 probe call returned wrong values" in ma.available(jnp.float32)
        assert choose_attention_impl(None, jnp.float32) == "xla" and choose_attention_impl() == "kernel"
    finally:  # the real answer (no GPU here) for the rest of the session
        ma._available.cache_clear()
