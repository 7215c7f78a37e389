"""jaxspec.kernels.int4_moe in Pallas interpret mode (CPU) against the portable INT4 expert path.

Every test draws fresh random inputs (seeded from os.urandom; the seed is in each
failure message) so that a wrong index or an unwritten output cannot hide behind
one lucky draw.
"""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import eqns

from jaxspec import quant
from jaxspec.kernels import block_routing
from jaxspec.kernels import int4_moe as im
from jaxspec.kernels.grouped_matmul import gathered_expert_ffn

E, D, F, K = 8, 512, 256, 4  # local experts, hidden, moe intermediate, experts per token
NONLOCAL = (-3, -1, E, E + 5)  # ids of other devices' experts


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _layer(rng: np.random.Generator, d: int = D, f: int = F):
    """Random INT4 expert params in the checkpoint layout (all 2^32 word patterns possible)."""
    raw = {}
    for name, (n_out, n_in) in {"gate": (f, d), "up": (f, d), "down": (d, f)}.items():
        packed = jnp.asarray(rng.integers(-(2**31), 2**31, (E, n_out, n_in // 8)), jnp.int32)
        scale = rng.uniform(0.5, 1.5, (E, n_out, n_in // 32)) * rng.choice([-1.0, 1.0], (E, n_out, n_in // 32))
        raw[name] = quant.Int4Weight(packed, jnp.asarray(scale / np.sqrt(n_in), jnp.bfloat16))
    return raw


def _routing(rng, T, choices=None, nonlocal_frac=0.0):
    """Distinct experts per token drawn from `choices` (default all local), some made non-local."""
    choices = np.arange(E) if choices is None else np.asarray(choices)
    ex = np.stack([rng.choice(choices, K, replace=False) for _ in range(T)]).astype(np.int32)
    if nonlocal_frac:
        off = rng.random(ex.shape) < nonlocal_frac
        ex[off] = rng.choice(NONLOCAL, int(off.sum()))
    wt = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
    return jnp.asarray(ex), jnp.asarray(wt)


@functools.partial(jax.jit, static_argnames=("config",))
def _kernel(x, ex, wt, ops, config=None):
    return im.moe_int4(
        x, ex, wt, ops, num_local=E, interpret=True, poison_rows=True, config=None if config is None else dict(config)
    )


@jax.jit
def _portable(x, ex, wt, raw):
    return gathered_expert_ffn(x, ex, wt, raw, E)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_relayout_is_lossless_and_puts_a_column_pair_of_four_groups_in_each_word():
    seed = _seed()
    rng = np.random.default_rng(seed)
    raw = _layer(rng)
    ops = jax.jit(im.relayout)(raw)
    back = jax.jit(im.restore)(ops)
    for name, w in raw.items():
        assert back[name].layout == quant.ROWS and ops[name].layout == quant.TILES
        for v, b in ((w.packed, back[name].packed), (w.scale, back[name].scale)):
            assert np.array_equal(
                np.asarray(b).view(np.uint16 if v.dtype == jnp.bfloat16 else np.uint32),
                np.asarray(v).view(np.uint16 if v.dtype == jnp.bfloat16 else np.uint32),
            ), (name, seed)
    # K block b, plane (scale group) p = 4h + q, column c = 2m + e of the group (input 256b + 32p + c): word
    # 2m + h, nibble q + 4e. Scale pair word q holds groups 8b+q, 8b+q+4.
    packed = np.asarray(raw["gate"].packed).view(np.uint32)
    nib = (packed[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF  # [E, F, D/8, 8]
    nib = nib.reshape(E, F, D // 256, 8, 16, 2)  # [.., block, plane, m, e]: input 256b + 32p + 2m + e
    w = np.asarray(ops["gate"].packed).view(np.uint32).reshape(E, D // 256, F, 16, 2)  # [.., m, h]
    for p in range(8):
        h, q = divmod(p, 4)
        for e in range(2):
            got = (w[..., h] >> np.uint32(4 * (q + 4 * e))) & 0xF  # [E, KB, F, 16]
            want = nib[:, :, :, p, :, e].transpose(0, 2, 1, 3)
            assert np.array_equal(got, want), (p, e, seed)
    s = np.asarray(ops["gate"].scale).view(np.uint32)  # [E, KB, F, 4]
    sbits = np.asarray(raw["gate"].scale).view(np.uint16).reshape(E, F, D // 256, 8).transpose(0, 2, 1, 3)
    assert np.array_equal(s & 0xFFFF, sbits[..., :4]), seed
    assert np.array_equal(s >> 16, sbits[..., 4:]), seed


CASES = {
    # name: (T, expert choices, fraction of non-local ids)
    "one_token": (1, None, 0.0),
    "mixed_nonlocal": (5, None, 0.3),
    "unused_experts": (9, [1, 2, 5, 6], 0.0),  # experts 0, 3, 4, 7 get nothing
    "all_on_one_expert": (21, None, 0.0),  # expert 3 in every token: 21 rows -> 2 blocks
    "only_nonlocal": (3, None, 1.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_portable_path_float32(case):
    seed = _seed()
    rng = np.random.default_rng(seed)
    T, choices, nonlocal_frac = CASES[case]
    raw = _layer(rng)
    ops = im.relayout(raw)
    ex, wt = _routing(rng, T, choices, nonlocal_frac)
    if case == "all_on_one_expert":
        others = np.stack([rng.choice([e for e in range(E) if e != 3], K - 1, replace=False) for _ in range(T)])
        ex = jnp.asarray(np.concatenate([np.full((T, 1), 3), others], axis=1), jnp.int32)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    y = np.asarray(_kernel(x, ex, wt, ops))
    ref = np.asarray(_portable(x, ex, wt, raw))
    assert y.shape == (T, D) and y.dtype == np.float32, seed
    assert np.isfinite(y).all(), f"unwritten (NaN-poisoned) rows reached the output; seed {seed}"
    if case == "only_nonlocal":
        assert np.array_equal(y, np.zeros_like(y)), seed
    else:
        assert _rel(y, ref) < 2e-6, (case, _rel(y, ref), seed)


def test_wider_tiles_and_bf16_activations_match_portable_path():
    seed = _seed()
    rng = np.random.default_rng(seed)
    raw = _layer(rng)
    ops = im.relayout(raw)
    ex, wt = _routing(rng, 6, None, 0.2)
    x = jnp.asarray(rng.normal(size=(6, D)), jnp.float32)
    ref = np.asarray(_portable(x, ex, wt, raw))
    # 64-row gate/up tiles on 4 warps and 128-row down tiles (sweep configurations)
    wide = np.asarray(_kernel(x, ex, wt, ops, config=(("gu_block_n", 64), ("gu_warps", 4), ("dn_block_n", 128))))
    assert _rel(wide, ref) < 2e-6, (_rel(wide, ref), seed)
    xb = x.astype(jnp.bfloat16)
    yb = _kernel(xb, ex, wt, ops)
    assert yb.dtype == jnp.bfloat16, seed
    refb = np.asarray(_portable(xb, ex, wt, raw).astype(jnp.float32))
    assert _rel(np.asarray(yb.astype(jnp.float32)), refb) < 2e-2, (_rel(np.asarray(yb, np.float32), refb), seed)


def test_k_split_matches_portable_path_and_stays_batch_invariant():
    """gu_ksplit=2: two programs per gate/up tile, partials added in a fixed order; gu_ksplit=1: one chain.
    Same accuracy at T = 9 (9 slots, more than the 8 tiles) and T = 1 (fewer), and a token's bits alone equal
    its bits in a batch (the split is a constant, not a function of T)."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    raw = _layer(rng)
    ops = im.relayout(raw)
    ex, wt = _routing(rng, 9, None, 0.2)
    x = jnp.asarray(rng.normal(size=(9, D)), jnp.float32)
    ref = np.asarray(_portable(x, ex, wt, raw))
    for cfg in ((("gu_ksplit", 2),), (("gu_ksplit", 1),)):
        y = np.asarray(_kernel(x, ex, wt, ops, config=cfg))
        assert np.isfinite(y).all(), (cfg, seed)
        assert _rel(y, ref) < 2e-6, (cfg, _rel(y, ref), seed)
        alone = np.asarray(_kernel(x[3:4], ex[3:4], wt[3:4], ops, config=cfg))
        assert _rel(alone, ref[3:4]) < 2e-6, (cfg, _rel(alone, ref[3:4]), seed)
        assert np.array_equal(y[3], alone[0]), (cfg, float(np.abs(y[3] - alone[0]).max()), seed)
    with pytest.raises(ValueError, match="gu_ksplit"):
        _kernel(x, ex, wt, ops, config=(("gu_ksplit", 3),))


class _Sym(str):
    """A sum written out, to compare the order of additions."""

    def __add__(self, other):
        return _Sym(f"({self}+{other})")


def test_every_program_count_split_programs_accepts_sums_the_same_tree():
    """For 1..40 leaves and every program count `split_programs` accepts, the tree of the programs' subtree sums
    (consecutive runs of leaves) is the tree of all leaves, addition for addition; every count it refuses
    would give another tree. Malformed rules are refused up front, all of them, not only the one T picks."""
    for leaves in range(1, 41):
        whole = im.tree_sum([_Sym(f"l{i}") for i in range(leaves)])
        for programs in range(1, leaves + 1):
            if leaves % programs:
                continue
            per = leaves // programs
            subtrees = [im.tree_sum([_Sym(f"l{p * per + i}") for i in range(per)]) for p in range(programs)]
            same = im.tree_sum(subtrees) == whole
            try:
                got = im.split_programs(1, leaves, ((1, programs),), "x")
            except ValueError:
                assert not same, (leaves, programs)
            else:
                assert got == programs and same, (leaves, programs)
    assert im.split_programs(100, 4, ((1, 4), (8, 2)), "x") == 4  # past every rule: one program per leaf
    with pytest.raises(ValueError, match=r"config\['gu_programs'\] asks for 3 programs"):
        im.split_programs(1, 4, ((1, 1), (512, 3)), "gu_programs")  # checked although T = 1 picks the first
    with pytest.raises(ValueError, match=r"expected \[\[t_max, programs\]"):
        im.split_programs(1, 4, (1, 4), "gu_programs")


def _wide_layer():
    """(seed, checkpoint layer, its kernel tiles, experts, weights, x) at D = 1024 (4 gate/up K blocks),
    9 tokens: the K-tree tests' fresh random case."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    d4 = 1024
    raw = _layer(rng, d=d4)
    ex, wt = _routing(rng, 9, None, 0.2)
    return seed, raw, im.relayout(raw), ex, wt, jnp.asarray(rng.normal(size=(9, d4)), jnp.float32)


def test_gate_up_k_tree_gives_the_same_bits_for_any_program_count():
    """gu_ksplit=4 at D = 1024 (4 K blocks): the gate/up K sums as the tree ((l0 + l1) + (l2 + l3)), on one
    program per tile (the SiLU-multiply in the kernel), or split over 2 or 4 programs (the combine kernel
    completes the tree): the same bits for every count, so the count may follow T (a token alone on 4
    programs equals its row among 9 on one); counts that do not split the tree evenly are refused."""
    seed, raw, ops, ex, wt, x = _wide_layer()
    ref = np.asarray(_portable(x, ex, wt, raw))
    tree = (("gu_ksplit", 4),)
    for xs in (x.astype(jnp.bfloat16), x):
        ys = {}
        for programs in (1, 2, 4):
            cfg = tree + (("gu_programs", ((64, programs),)),)
            ys[programs] = np.asarray(_kernel(xs, ex, wt, ops, config=cfg).astype(jnp.float32))
            assert np.isfinite(ys[programs]).all(), (programs, seed)
        assert np.array_equal(ys[1], ys[2]) and np.array_equal(ys[1], ys[4]), (xs.dtype, seed)
    assert _rel(ys[1], ref) < 2e-6, (_rel(ys[1], ref), seed)
    follows_t = tree + (("gu_programs", ((1, 4), (1 << 30, 1))),)
    alone = np.asarray(_kernel(x[5:6], ex[5:6], wt[5:6], ops, config=follows_t))
    assert np.array_equal(alone[0], ys[1][5]), (float(np.abs(alone[0] - ys[1][5]).max()), seed)
    with pytest.raises(ValueError, match="gu_programs"):
        _kernel(x, ex, wt, ops, config=tree + (("gu_programs", ((64, 3),)),))
    assert [im.split_programs(n, 6, (), "x") for n in (1, 100)] == [6, 6]  # one program per leaf by default
    with pytest.raises(ValueError, match="power-of-two share"):
        im.split_programs(1, 6, ((8, 2),), "gu_programs")  # 3 leaves a program: not a subtree of the tree


def test_the_flat_leaf_loop_sums_a_programs_leaves_in_the_trees_order_with_the_same_bits():
    """gu_leaf_loop="flat": a program's several K leaves in one loop over its blocks in order, a leaf's end pushing
    its sum into a binary counter of held sums. The counter's order is `tree_sum`'s for every leaf count (checked
    symbolically up to 64), and at D = 2048 (8 K blocks) the outputs have the bits of one program per leaf and of
    the interleaved loop: 2 leaves of 4 blocks in one program, 4 leaves of 2 in one program (merges inside the
    loop) and in two; and at D = 1792 (7 K blocks) 7 leaves in one program, whose three subtrees left at the end
    fold from the right."""

    class Sym(str):
        def __add__(self, other):
            return Sym(f"({self}+{other})")

    for n in range(1, 65):
        leaves = [Sym(f"l{i}") for i in range(n)]
        pushes, final = im._counter_pushes(n)
        held = {}
        for leaf, (slot, merged) in zip(leaves, pushes):
            for m in reversed(merged):
                leaf = held[m] + leaf
            held[slot] = leaf
        total = held[final[-1]]
        for sl in reversed(final[:-1]):
            total = held[sl] + total
        assert total == im.tree_sum(leaves), n
    seed = _seed()
    rng = np.random.default_rng(seed)
    ex, wt = _routing(rng, 9, None, 0.2)
    for d, cases in ((2048, ((2, 1, True), (4, 1, True), (4, 2, False))), (1792, ((7, 1, False),))):
        raw = _layer(rng, d=d)
        ops = im.relayout(raw)
        x = jnp.asarray(rng.normal(size=(9, d)), jnp.float32)
        ref = np.asarray(_portable(x, ex, wt, raw))
        for leaves, programs, bf16 in cases:
            for xs in (x, x.astype(jnp.bfloat16)) if bf16 else (x,):
                tree = (("gu_ksplit", leaves),)
                want = np.asarray(_kernel(xs, ex, wt, ops, config=tree).astype(jnp.float32))  # one program a leaf
                assert _rel(want, ref) < (2e-6 if xs.dtype == jnp.float32 else 2e-2), (leaves, seed)
                for loop in ("flat", "interleave"):
                    cfg = tree + (("gu_programs", ((64, programs),)), ("gu_leaf_loop", loop))
                    got = np.asarray(_kernel(xs, ex, wt, ops, config=cfg).astype(jnp.float32))
                    assert np.array_equal(got, want), (d, leaves, programs, loop, xs.dtype, seed)
    with pytest.raises(ValueError, match="gu_leaf_loop"):
        _kernel(x, ex, wt, ops, config=(("gu_leaf_loop", "nested"),))


def _lowered_stages(T: int, config: dict) -> dict[str, int]:
    """The pipeline stages each kernel of a bf16 call of T tokens is compiled with, read from the call lowered
    for CUDA (on the CPU: lowering needs no GPU)."""
    ops = jax.eval_shape(lambda: im.relayout(_layer(np.random.default_rng(0))))
    args = (
        jax.ShapeDtypeStruct((T, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((T, K), jnp.int32),
        jax.ShapeDtypeStruct((T, K), jnp.float32),
        ops,
    )
    call = jax.jit(lambda x, ex, wt, ops: im.moe_int4(x, ex, wt, ops, num_local=E, config=config))
    text = call.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    found = re.findall(r'name = "(int4_moe_\w+)", num_stages = (\d+)', text)
    return {name: int(n) for name, n in found}


def test_gate_up_stages_follow_t_by_their_rules():
    """gu_stage_rules: the gate/up kernel's pipeline stages by T (the first [t_max, stages] with T <= t_max, else
    gu_stages) reach the compiled kernel; the down kernel keeps dn_stages; bad rules are refused by name."""
    rules = {"gu_stage_rules": ((1, 6), (8, 5)), "dn_stages": 4}
    assert _lowered_stages(1, rules) == {"int4_moe_gate_up": 6, "int4_moe_down": 4}
    assert _lowered_stages(8, rules)["int4_moe_gate_up"] == 5
    assert _lowered_stages(9, rules)["int4_moe_gate_up"] == im.DEFAULT_CONFIG["gu_stages"]
    assert _lowered_stages(1, {})["int4_moe_gate_up"] == im.DEFAULT_CONFIG["gu_stages"]
    cfg = im._config({"gu_stage_rules": [[4, 2]], "gu_stages": 7})
    assert [im.gu_stages(t, cfg) for t in (1, 4, 5)] == [2, 2, 7]
    for bad in (((1,),), "six", ((1, 0),)):
        with pytest.raises(ValueError, match="gu_stage_rules"):
            im.gu_stages(1, im._config({"gu_stage_rules": bad}))
    with pytest.raises(ValueError, match="gu_stages"):
        im.gu_stages(1, im._config({"gu_stages": 0}))


def test_default_k_split_follows_the_layer_width_alone():
    """Left open by the configuration, the gate/up K split is 2 where the K blocks divide evenly (Kimi's 28,
    this module's 2) and 1 otherwise: a function of D, the same at every T, and the same bits as the split
    forced through the configuration."""
    assert [im.default_ksplit(n) for n in (28, 2, 1, 5, 7)] == [2, 2, 1, 1, 1]
    seed = _seed()
    rng = np.random.default_rng(seed)
    raw = _layer(rng)
    ops = im.relayout(raw)
    ex, wt = _routing(rng, 9, None, 0.2)
    x = jnp.asarray(rng.normal(size=(9, D)), jnp.float32)

    def kernels(x, ex, wt, ops):  # the tree completed by the combine kernel: its launch shows the split
        f = lambda *a: im.moe_int4(*a, num_local=E, interpret=True, config={"gu_last_finishes": False})  # noqa: E731
        return {e.params.get("name") for e in eqns(jax.make_jaxpr(f)(x, ex, wt, ops).jaxpr)}

    for t in (1, 9):
        assert "int4_moe_silu_combine" in kernels(x[:t], ex[:t], wt[:t], ops), t
    y = np.asarray(_kernel(x, ex, wt, ops))
    assert np.array_equal(y, np.asarray(_kernel(x, ex, wt, ops, config=(("gu_ksplit", 2),)))), seed
    one = np.asarray(_kernel(x[4:5], ex[4:5], wt[4:5], ops))
    assert np.array_equal(one, np.asarray(_kernel(x[4:5], ex[4:5], wt[4:5], ops, config=(("gu_ksplit", 2),)))), seed
    assert np.array_equal(one[0], y[4]), seed
    odd = {}  # D = 768: three K blocks, no even split
    for name, (n_out, n_in) in {"gate": (F, 768), "up": (F, 768), "down": (768, F)}.items():
        packed = jnp.asarray(rng.integers(-(2**31), 2**31, (E, n_out, n_in // 8)), jnp.int32)
        odd[name] = quant.Int4Weight(packed, jnp.asarray(rng.uniform(0.01, 0.02, (E, n_out, n_in // 32)), jnp.bfloat16))
    x3 = jnp.asarray(rng.normal(size=(9, 768)), jnp.float32)
    assert "int4_moe_silu_combine" not in kernels(x3, ex, wt, im.relayout(odd)), seed
    y3 = np.asarray(_kernel(x3, ex, wt, im.relayout(odd)))
    assert np.isfinite(y3).all() and _rel(y3, np.asarray(_portable(x3, ex, wt, odd))) < 2e-6, seed


def test_batch_invariance_bit_exact_float32():
    """A token's output is the same bits alone (T=1) and in batches sharing its experts."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    raw = _layer(rng)
    ops = im.relayout(raw)
    x0 = rng.normal(size=(D,)).astype(np.float32)
    e0 = rng.choice(E, K, replace=False).astype(np.int32)
    w0 = rng.uniform(0.1, 1.0, K).astype(np.float32)
    alone = np.asarray(_kernel(jnp.asarray(x0[None]), jnp.asarray(e0[None]), jnp.asarray(w0[None]), ops))[0]
    for T in (3, 17, 38):  # 38 tokens on 8 experts x top-4: experts get 2-3 blocks of 16 rows
        ex, wt = _routing(rng, T)
        ex, wt = np.array(ex), np.array(wt)
        x = rng.normal(size=(T, D)).astype(np.float32)
        pos = int(rng.integers(T))
        x[pos], ex[pos], wt[pos] = x0, e0, w0
        y = np.asarray(_kernel(jnp.asarray(x), jnp.asarray(ex), jnp.asarray(wt), ops))
        assert np.array_equal(y[pos], alone), (T, pos, float(np.abs(y[pos] - alone).max()), seed)
        if T == 38:  # auto: 2 blocks per program here; also 4 (weights unpacked once for 4 blocks)
            assert im.auto_group(T, K, E) == 2, seed
            y4 = np.asarray(_kernel(jnp.asarray(x), jnp.asarray(ex), jnp.asarray(wt), ops, config=(("m_group", 4),)))
            assert np.array_equal(y4, y), (float(np.abs(y4 - y).max()), seed)
    # the same without the K split this module's width takes by default (the demo target's path: one K block)
    one = (("gu_ksplit", 1),)
    alone1 = np.asarray(_kernel(jnp.asarray(x0[None]), jnp.asarray(e0[None]), jnp.asarray(w0[None]), ops, config=one))
    assert _rel(alone1[None], alone[None]) < 2e-6, seed
    y1 = np.asarray(_kernel(jnp.asarray(x), jnp.asarray(ex), jnp.asarray(wt), ops, config=one))
    assert np.array_equal(y1[pos], alone1[0]), (float(np.abs(y1[pos] - alone1[0]).max()), seed)
    y14 = np.asarray(_kernel(jnp.asarray(x), jnp.asarray(ex), jnp.asarray(wt), ops, config=one + (("m_group", 4),)))
    assert np.array_equal(y14, y1), (float(np.abs(y14 - y1).max()), seed)


def test_route_blocks_covers_each_local_assignment_once():
    seed = _seed()
    rng = np.random.default_rng(seed)
    for T, group in ((1, 1), (4, 2), (33, 1), (33, 4)):
        ex, wt = _routing(rng, T, None, 0.25)
        m = jax.tree.map(np.asarray, im.route_blocks(ex, wt, E, group))
        S = im.num_block_slots(T, K, E, group)
        assert S % group == 0, seed
        for b in range(0, S, group):  # a program's blocks belong to one expert, live ones first
            assert len({int(e) for e in m["expert"][b : b + group]}) == 1, (T, group, b, seed)
            assert all(m["rows"][b + g] == 0 or m["rows"][b + g - 1] == 16 for g in range(1, group)), seed
        assert m["rows"].shape == (S + 1,) and m["rows"][S] == 0 and im.num_slots(m) == S, seed  # + a spare
        flat = np.asarray(ex).reshape(-1)
        local = np.flatnonzero((flat >= 0) & (flat < E))
        live = np.concatenate([m["assign"][b * 16 : b * 16 + m["rows"][b]] for b in range(S)])
        assert sorted(live.tolist()) == local.tolist(), (T, seed)
        for b in range(S):
            ids = m["assign"][b * 16 : b * 16 + m["rows"][b]]
            assert (flat[ids] == m["expert"][b]).all(), (T, b, seed)
            assert (m["token"][b * 16 : b * 16 + m["rows"][b]] == ids // K).all(), (T, b, seed)
            pad = slice(b * 16 + m["rows"][b], (b + 1) * 16)
            assert (m["assign"][pad] == T * K).all() and (m["token"][pad] == 0).all(), (T, b, seed)
            assert (m["weight"][pad] == 0).all(), (T, b, seed)
            filled = slice(b * 16, b * 16 + m["rows"][b])
            np.testing.assert_array_equal(m["weight"][filled], np.asarray(wt).reshape(-1)[m["assign"][filled]])
        # the kernels read the three as rows of one int32 array (the weight as its float32 bits)
        np.testing.assert_array_equal(m["packed"][:2], np.stack([m["token"], m["assign"]]))
        np.testing.assert_array_equal(m["packed"][2].view(np.float32), m["weight"])
        used = {int(e) for e in flat[local]}
        assert {int(m["expert"][b]) for b in range(S) if m["rows"][b]} == used, (T, seed)


@pytest.mark.parametrize("num_local", [8, 48])
def test_metadata_kernel_equals_the_xla_metadata(num_local):
    """The one-program metadata kernel (interpret mode) builds exactly XLA's route_blocks: slots, experts,
    and every block row's token, assignment and weight bits, padding rows included; past S*16 only spare
    rows. Calls of every size up to its limit, other devices' ids, several blocks per program."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    cases = [(1, 8, 1, 0.0), (3, 8, 1, 0.9), (8, 8, 1, 0.3), (33, 4, 4, 0.25), (9, 4, 2, 0.0), (128, 8, 1, 0.1)]
    for T, k, group, nonlocal_frac in cases:
        ids = rng.integers(0, num_local, size=(T, k))
        far = rng.random((T, k)) < nonlocal_frac
        ids = np.where(far, rng.choice([-5, -1, num_local, num_local + 7], size=(T, k)), ids)
        if T == 8:
            ids[:, 0] = 3  # one expert in every token: its blocks fill
        ex, wt = jnp.asarray(ids, jnp.int32), jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
        want = jax.tree.map(np.asarray, jax.jit(lambda a, b, g=group: im.route_blocks(a, b, num_local, g))(ex, wt))
        got = jax.tree.map(
            np.asarray, jax.jit(lambda a, b, g=group: im.route_blocks(a, b, num_local, g, "interpret"))(ex, wt)
        )
        S = im.num_block_slots(T, k, num_local, group)
        assert im.num_slots(got) == S and got["packed"].shape[1] > S * 16, (T, seed)
        for name in ("rows", "expert", "token", "assign", "weight", "valid"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name}, T={T}, seed {seed}")
        np.testing.assert_array_equal(got["packed"][:, : S * 16], want["packed"], err_msg=f"T={T}, seed {seed}")
    assert im.metadata_impl(1024, E, interpret=True) == "interpret"
    assert im.metadata_impl(1025, E, interpret=True) == "xla" and im.metadata_impl(0, E, interpret=True) == "xla"
    if jax.default_backend() != "gpu":  # the compiled kernel's probe says why not
        assert im.metadata_impl(8, E) == "xla" and "GPU backend" in (im.metadata_problem(E) or "")


def test_the_compiled_metadata_program_serves_calls_up_to_the_configured_assignments(monkeypatch):
    """`metadata_impl`'s speed choice: a compiled call builds its metadata with the program up to
    ``meta_max_assignments`` (the probe passing), with XLA above it and past the program's own limit; interpret
    mode keeps the program up to that limit; a limit out of range is refused, naming the key."""
    E = 48
    monkeypatch.setattr(im, "metadata_problem", lambda num_local=48: None)  # as on a GPU whose probe passed
    assert im.metadata_impl(256, E, config={"meta_max_assignments": 256}) == "kernel"
    assert im.metadata_impl(264, E, config={"meta_max_assignments": 256}) == "xla"
    assert im.metadata_impl(1024, E, interpret=True, config={"meta_max_assignments": 256}) == "interpret"
    assert im.metadata_impl(8, E, config={"meta_max_assignments": 0}) == "xla"
    limit = im.DEFAULT_CONFIG["meta_max_assignments"]
    assert im.metadata_impl(limit, E) == "kernel" and im.metadata_impl(limit + 8, E) == "xla"
    assert im.metadata_impl(block_routing.MAX_ASSIGNMENTS + 1, E, config={"meta_max_assignments": 1024}) == "xla"
    for bad in (2048, -1, 256.0):
        with pytest.raises(ValueError, match=r"meta_max_assignments.*expected an int in 0\.\.1024"):
            im.metadata_impl(8, E, config={"meta_max_assignments": bad})
    monkeypatch.setattr(im, "metadata_problem", lambda num_local=48: "no GPU backend here")
    assert im.metadata_impl(8, E) == "xla"


def test_the_probes_metadata_comparison_takes_the_wider_packed_and_int_valid_and_catches_every_field():
    """`same_metadata`, which the metadata and fused-routing probes decide by: the kernel's packed is wider than
    XLA's and its valid int32 where XLA's is bool; a change in any field, the packed columns XLA has, or a valid
    flag is caught."""
    rng = np.random.default_rng()
    T, k, E = 5, 4, 12
    ex = np.stack([rng.choice(E + 4, k, replace=False) for _ in range(T)]).astype(np.int32) - 2
    ex[0, 0] = E + 2  # another device's expert, past the ids drawn: at least one assignment is not valid
    wt = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    ref = jax.tree.map(np.asarray, jax.jit(lambda a, b: im.route_blocks(a, b, E, 1, "xla"))(ex, wt))
    want = tuple(ref[f] for f in ("rows", "expert", "packed", "valid"))
    assert want[3].dtype == bool and 0 < want[3].sum() < T * k
    wide = np.concatenate([want[2], rng.integers(0, 9, (want[2].shape[0], 16), dtype=want[2].dtype)], axis=1)
    got = (want[0].copy(), want[1].copy(), wide, want[3].astype(np.int32))
    assert im.same_metadata(want, got)
    for i, (row, col) in enumerate(((0, None), (0, None), (1, 3), (int(np.argmin(want[3])), None))):
        bad = [a.copy() for a in got]
        if col is None:
            bad[i][row] += 1
        else:
            bad[i][row, col] += 1
        assert not im.same_metadata(want, tuple(bad)), i


SHARE = 4  # devices of a mesh share's global ids (E experts each)


def _share_ids(rng, T, k, kind):
    """Global expert ids [T, k] over SHARE devices of E experts each; `kind` sets which device is busiest:
    'random': ids from -SHARE*E - 3 to SHARE*E + 5 (some counted for no device, negatives from the last
    device back, as busiest_share's scatter-add counts them); 'tie': half on device 1, half on device 3
    (the lower must win); 'one_device': all on device 2; 'wrapped': most in [-E, 0), which count for device
    3, the rest on device 0; 'nowhere': no id on any device (device 0 is chosen)."""
    n = (T, k)
    if kind == "random":
        return rng.integers(-SHARE * E - 3, SHARE * E + 6, size=n)
    if kind == "tie":
        return np.concatenate([rng.integers(E, 2 * E, (T, k // 2)), rng.integers(3 * E, 4 * E, (T, k - k // 2))], 1)
    if kind == "one_device":
        return rng.integers(2 * E, 3 * E, size=n)
    if kind == "wrapped":
        return np.concatenate([rng.integers(-E, 0, (T, k // 2 + 1)), rng.integers(0, E, (T, k - k // 2 - 1))], 1)
    assert kind == "nowhere"
    return rng.choice([-SHARE * E - 9, -SHARE * E - 1, SHARE * E, SHARE * E + 7], size=n)


def _busiest_device(ids, local, share):
    """The busiest device by plain counting (numpy): an id in [-share*local, share*local) counts for device
    (id // local) mod share, others for none; the lowest device on ties."""
    dev = np.floor_divide(ids, local).ravel()
    dev = dev[(dev >= -share) & (dev < share)] % share
    return int(np.argmax(np.bincount(dev, minlength=share)))


def test_metadata_kernel_on_global_ids_equals_busiest_share_then_xla():
    """With share > 1 the metadata kernel (interpret mode) picks the busiest device itself (the lowest on
    ties, ids counted as busiest_share counts them, negatives and ids past every device included), shifts
    the ids and builds exactly the metadata of busiest_share followed by XLA's route_blocks: slots, experts,
    packed rows up to S*16 and valid. XLA's route_blocks with share does the same."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    busiest = {"tie": 1, "one_device": 2, "wrapped": 3, "nowhere": 0}
    cases = [
        (1, 8, 1, "random"),
        (1, 4, 2, "tie"),
        (5, 4, 2, "random"),
        (5, 8, 1, "one_device"),
        (5, 8, 2, "wrapped"),
        (40, 8, 1, "tie"),
        (40, 8, 2, "random"),
        (40, 4, 1, "nowhere"),
        (128, 8, 1, "random"),
        (128, 8, 2, "tie"),
        (128, 4, 2, "one_device"),
    ]
    for T, k, group, kind in cases:
        ids = _share_ids(rng, T, k, kind)
        dev = _busiest_device(ids, E, SHARE)
        assert dev == busiest.get(kind, dev), (kind, dev, seed)
        ex, wt = jnp.asarray(ids, jnp.int32), jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
        shifted = im.busiest_share(ex, E, SHARE)
        np.testing.assert_array_equal(shifted, ids - dev * E, err_msg=f"{kind}, seed {seed}")
        want = jax.tree.map(np.asarray, jax.jit(lambda a, b, g=group: im.route_blocks(a, b, E, g))(shifted, wt))
        run = jax.jit(lambda a, b, impl, g=group: im.route_blocks(a, b, E, g, impl, share=SHARE), static_argnums=2)
        got = jax.tree.map(np.asarray, run(ex, wt, "interpret"))
        xla = jax.tree.map(np.asarray, run(ex, wt, "xla"))
        S = im.num_block_slots(T, k, E, group)
        assert im.num_slots(got) == S and got["packed"].shape[1] > S * 16, (T, seed)
        for name in ("rows", "expert", "token", "assign", "weight", "weight_A", "valid"):
            msg = f"{name}, T={T}, {kind}, group {group}, seed {seed}"
            np.testing.assert_array_equal(got[name], want[name], err_msg=msg)
            np.testing.assert_array_equal(xla[name], want[name], err_msg=msg)
        np.testing.assert_array_equal(got["packed"][:, : S * 16], want["packed"], err_msg=f"T={T}, {kind}, {seed}")
        np.testing.assert_array_equal(xla["packed"], want["packed"], err_msg=f"T={T}, {kind}, {seed}")
        on_device = (ids >= dev * E) & (ids < (dev + 1) * E)
        np.testing.assert_array_equal(got["valid"], on_device.ravel(), err_msg=f"T={T}, {kind}, seed {seed}")
        assert got["rows"].sum() == on_device.sum(), (T, kind, seed)


@pytest.mark.parametrize("chunk", [16, 256])
def test_the_metadata_program_builds_the_same_metadata_at_any_chunk(monkeypatch, chunk):
    """`block_routing.DEFAULT_CONFIG['chunk']` (a speed choice, swept by `bench_metadata.py --program`) only sets
    how many assignments a pass step takes: calls of one step and of many, the last with lanes past the call,
    local, other devices' and a mesh share's global ids, build exactly XLA's metadata at chunks of 16 and 256.
    A chunk or warp count the program cannot take is refused, naming the key."""
    monkeypatch.setattr(block_routing, "DEFAULT_CONFIG", {**block_routing.DEFAULT_CONFIG, "chunk": chunk})
    # the program takes the chunk: a pass over 1,024 assignments is 64 steps at 16, 4 at 256; 8 assignments 1 step
    assert block_routing.statics(1024, k=8, num_local=E, slots=8, block=16, group=1)["C"] == chunk
    assert block_routing.statics(8, k=8, num_local=E, slots=8, block=16, group=1)["C"] == 8
    seed = _seed()
    rng = np.random.default_rng(seed)
    for T, k, group, share in ((1, 8, 1, 1), (5, 8, 2, 1), (33, 8, 1, 1), (40, 8, 2, SHARE), (128, 8, 1, SHARE)):
        if share == 1:
            ids = rng.integers(-3, E + 5, size=(T, k))  # some ids not local
        else:
            ids = _share_ids(rng, T, k, "random")
        ex, wt = jnp.asarray(ids, jnp.int32), jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
        run = jax.jit(lambda a, b, impl, g=group, s=share: im.route_blocks(a, b, E, g, impl, share=s), static_argnums=2)
        got = jax.tree.map(np.asarray, run(ex, wt, "interpret"))
        want = jax.tree.map(np.asarray, run(ex, wt, "xla"))
        S = im.num_block_slots(T, k, E, group)
        for name in ("rows", "expert", "token", "assign", "weight", "valid"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name}, T={T}, chunk {chunk}, seed {seed}")
        np.testing.assert_array_equal(got["packed"][:, : S * 16], want["packed"], err_msg=f"T={T}, chunk {chunk}")
    for key, bad, message in (
        ("chunk", 100, r"\['chunk'\]: expected a power of two from 16 to 1024, found 100"),
        ("chunk", 2048, r"\['chunk'\]: expected a power of two from 16 to 1024, found 2048"),
        ("chunk", 8, r"\['chunk'\]: expected a power of two from 16 to 1024, found 8"),
        ("warps", 3, r"\['warps'\]: expected 1, 2, 4, 8 or 16, found 3"),
    ):
        monkeypatch.setattr(block_routing, "DEFAULT_CONFIG", {**block_routing.DEFAULT_CONFIG, key: bad})
        with pytest.raises(ValueError, match=message):
            block_routing.block_metadata(
                jnp.zeros((8,), jnp.int32),
                jnp.zeros((8,), jnp.int32),
                k=8,
                num_local=E,
                slots=8,
                block=16,
                group=1,
                interpret=False,
            )
        monkeypatch.setattr(
            block_routing, "DEFAULT_CONFIG", {**block_routing.DEFAULT_CONFIG, "chunk": chunk, "warps": 4}
        )


def test_metadata_kernel_returns_valid_as_xla_computes_it():
    """valid, the kernel's fourth output (int32 [A]), is 1 exactly where XLA's route_blocks finds the
    assignment local (share 1: ids below 0 and past num_local are not): calls whose last chunk has lanes
    past the call (A = 9, 40) and of several chunks (A = 1024)."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    for T, k in ((1, 8), (3, 3), (5, 8), (128, 8)):
        ids = rng.integers(-E, 2 * E, size=(T, k))  # a third below 0, a third past the local experts
        ex, wt = jnp.asarray(ids, jnp.int32), jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
        wbits = jax.lax.bitcast_convert_type(wt.reshape(-1), jnp.int32)
        S = im.num_block_slots(T, k, E)
        out = block_routing.block_metadata(
            ex.reshape(-1), wbits, k=k, num_local=E, slots=S, block=im.BLOCK_M, group=1, interpret=True
        )
        assert len(out) == 4 and out[3].dtype == jnp.int32 and out[3].shape == (T * k,), seed
        want = np.asarray(im.route_blocks(ex, wt, E)["valid"])
        np.testing.assert_array_equal(np.asarray(out[3]), want.astype(np.int32), err_msg=f"T={T}, seed {seed}")
        np.testing.assert_array_equal(want, ((ids >= 0) & (ids < E)).ravel(), err_msg=f"T={T}, seed {seed}")
        assert np.asarray(im.route_blocks(ex, wt, E, impl="interpret")["valid"]).dtype == bool, seed


@pytest.mark.parametrize("width", [128, 1024])
def test_metadata_kernel_zeroes_every_counter(monkeypatch, width):
    """The fifth output, the counters a later kernel counts in, is all zeros at every length: one store step or
    several, lengths below a step and past a multiple of it, for each step width (`ZERO_ROWS`). Interpret
    mode leaves an unwritten int32 as INT_MIN, so a counter the program skipped fails here."""
    monkeypatch.setattr(block_routing, "ZERO_ROWS", width)
    ids, wbits = jnp.arange(16, dtype=jnp.int32) % E, jnp.zeros((16,), jnp.int32)
    for n in (1, 5, width - 1, width + 1, 3 * width + 7):
        out = block_routing.block_metadata(
            ids,
            wbits,
            k=8,
            num_local=E,
            slots=im.num_block_slots(2, 8, E),
            block=im.BLOCK_M,
            group=1,
            interpret=True,
            counters=n,
        )
        assert len(out) == 5 and out[4].shape == (n,), (width, n)
        np.testing.assert_array_equal(np.asarray(out[4]), np.zeros(n, np.int32), err_msg=f"width {width}, n {n}")


def test_route_blocks_on_a_share_leaves_no_xla_work_to_the_kernel_path():
    """On a mesh share the kernel path traces to the metadata program and free views only: no device
    counts (scatter-add), argmax, shift or compare in XLA. The XLA path has them (so the check can fail)."""
    ex, wt = jnp.zeros((4, K), jnp.int32), jnp.full((4, K), 0.5, jnp.float32)

    def prims(impl):
        jaxpr = jax.make_jaxpr(lambda a, b: im.route_blocks(a, b, E, 1, impl, share=SHARE))(ex, wt).jaxpr
        return {e.primitive.name for e in jaxpr.eqns}  # this level only: not the kernel's own body

    xla_work = {"scatter-add", "argmax", "sub", "lt", "ge", "and"}
    assert "pallas_call" in prims("interpret") and not prims("interpret") & xla_work, prims("interpret")
    assert {"scatter-add", "argmax", "sub"} <= prims("xla"), prims("xla")
    with pytest.raises(ValueError, match="share must be an int >= 1"):
        im.route_blocks(ex, wt, E, share=0)


def test_moe_int4_on_global_ids_equals_it_on_the_busiest_devices_ids():
    """moe_int4(share=SHARE) on a mesh share's global ids gives, bit for bit (float32), moe_int4 on the ids
    busiest_share made local: ties (the lower device's experts), negatives and ids of no device included."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    ops = im.relayout(_layer(rng))
    share_call = jax.jit(
        lambda x, e, w: im.moe_int4(x, e, w, ops, num_local=E, interpret=True, poison_rows=True, share=SHARE)
    )
    for T, kind in ((5, "tie"), (9, "random")):
        ids = _share_ids(rng, T, K, kind)
        ex, wt = jnp.asarray(ids, jnp.int32), jnp.asarray(rng.uniform(0.1, 1.0, (T, K)), jnp.float32)
        x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
        got = np.asarray(share_call(x, ex, wt))
        want = np.asarray(_kernel(x, im.busiest_share(ex, E, SHARE), wt, ops))
        assert np.isfinite(got).all() and np.abs(want).max() > 0, (kind, seed)
        assert np.array_equal(got, want), (kind, float(np.abs(got - want).max()), seed)


def test_moe_int4_builds_its_metadata_with_the_kernel_up_to_its_limit():
    ex, wt = jnp.zeros((4, K), jnp.int32), jnp.full((4, K), 0.5, jnp.float32)
    x, ops = jnp.zeros((4, D), jnp.float32), im.relayout(_layer(np.random.default_rng(0)))
    names = {
        e.params.get("name")
        for e in eqns(jax.make_jaxpr(lambda *a: im.moe_int4(*a, num_local=E, interpret=True))(x, ex, wt, ops).jaxpr)
    }
    assert "int4_moe_blocks" in names and "int4_moe_gate_up" in names, names


def test_stacked_layers_expert_layer_equals_the_layer_alone():
    """Two layers' experts seen as one [2E, ...] array with expert_layer = 1 (traced, as in a scan over layers)
    give the second layer's result bit for bit, non-local ids included, with the metadata built by the kernel
    or by XLA (past the kernel's assignments); a stack not a multiple of num_local is refused."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    raws = [_layer(rng), _layer(rng)]
    ops = [im.relayout(r) for r in raws]
    both = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), ops[0], ops[1])
    ex, wt = _routing(rng, 7, None, 0.3)
    x = jnp.asarray(rng.normal(size=(7, D)), jnp.float32)
    alone = np.asarray(_kernel(x, ex, wt, ops[1]))
    run = jax.jit(
        lambda x, lyr: im.moe_int4(x, ex, wt, both, num_local=E, interpret=True, expert_layer=lyr, poison_rows=True)
    )
    stacked = np.asarray(run(x, jnp.int32(1)))
    assert np.array_equal(stacked, alone), (float(np.abs(stacked - alone).max()), seed)
    assert _rel(stacked, np.asarray(_portable(x, ex, wt, raws[1]))) < 2e-6, seed
    first = np.asarray(run(x, jnp.int32(0)))
    assert np.array_equal(first, np.asarray(_kernel(x, ex, wt, ops[0]))), seed
    for impl in ("xla", "interpret"):  # the layer's offset in the expert ids, the rest the layer's own
        one = im.route_blocks(ex, wt, E, 1, impl)
        moved = im.route_blocks(ex, wt, E, 1, impl, 1, jnp.int32(1))
        assert np.array_equal(np.asarray(moved["expert"]), np.asarray(one["expert"]) + E), impl
        for name in ("rows", "packed", "valid"):
            assert np.array_equal(np.asarray(moved[name]), np.asarray(one[name])), (impl, name)
    with pytest.raises(ValueError, match="multiple of num_local"):
        im.moe_int4(x, ex, wt, both, num_local=E - 1, interpret=True, expert_layer=0)


def test_rejects_bad_operands():
    rng = np.random.default_rng(_seed())
    ops = im.relayout(_layer(rng))
    x = jnp.zeros((2, D), jnp.float32)
    ex, wt = _routing(rng, 2)
    with pytest.raises(ValueError, match="num_local"):
        im.moe_int4(x, ex, wt, ops, num_local=E + 1, interpret=True)
    with pytest.raises(ValueError, match="asm"):
        im.moe_int4(x, ex, wt, ops, num_local=E, interpret=True, config={"unpack": "asm"})
    bad = dict(ops, gate=ops["gate"].replace(packed=ops["gate"].packed[:, :1]))
    with pytest.raises(ValueError, match=r"gate.*expected int32"):
        im.moe_int4(x, ex, wt, bad, num_local=E, interpret=True)
    with pytest.raises(ValueError, match=r"experts\['gate'\]: expected an Int4Weight in the tiles layout"):
        im.moe_int4(x, ex, wt, _layer(rng), num_local=E, interpret=True)
    with pytest.raises(ValueError, match=r"config: unknown keys \['scale'\]"):  # a removed option
        im.moe_int4(x, ex, wt, ops, num_local=E, interpret=True, config={"scale": "post"})
    assert im.available() is not None  # the CPU backend cannot run the compiled kernel
    # The availability probe itself (what decides the kernel on a GPU) runs clean in interpret mode.
    assert im._probe(interpret=True) is None


def test_the_probe_fails_a_kernel_that_runs_but_computes_wrongly_or_depends_on_the_batch(monkeypatch):
    """The availability probe compares its call with a float32 reference and token 0 alone with token 0 in
    the batch: two planes swapped (a layout bug that runs and returns finite values) and a combine whose
    output moves with T by a relative 1e-6 (within any accuracy bound, not batch-invariant) each fail it."""
    assert im._probe.__wrapped__(interpret=True) is None
    planes = im._planes

    def swapped(*args):
        ps = planes(*args)
        ps[3], ps[4] = ps[4], ps[3]
        return ps

    with monkeypatch.context() as m:
        m.setattr(im, "_planes", swapped)
        why = im._probe.__wrapped__(interpret=True)
    assert why is not None and "relative error" in why, why
    combine = im.combine
    with monkeypatch.context() as m:
        m.setattr(im, "combine", lambda y, valid, T, k, out: combine(y, valid, T, k, out) * (1.0 + 1e-6 * T))
        why = im._probe.__wrapped__(interpret=True)
    assert why is not None and "alone" in why, why


@pytest.mark.parametrize(
    "kernel, leaves, rules",
    [("gu", 4, ((1, 4), (1 << 20, 2))), ("gu", 7, ((1, 7), (1 << 20, 1))), ("dn", 2, ((1, 2),))],
)
def test_the_probe_takes_a_configured_k_tree_wider_than_its_default(monkeypatch, kernel, leaves, rules):
    """A timing sweep's `--kernel-config int4_moe='{"gu_ksplit": 4, ...}'` sets the default the probe runs: its
    call is as wide as the configured leaves need (D = 256 x gate/up leaves, F = 256 x down leaves), so the
    configuration is probed (both program counts of the rules: token 0 alone and the batch of 3), not refused
    for D or F, and the kernel is used."""
    cfg = dict(im.DEFAULT_CONFIG, **{f"{kernel}_ksplit": leaves, f"{kernel}_programs": rules})
    monkeypatch.setattr(im, "DEFAULT_CONFIG", dict(cfg, gu_leaf_loop="flat"))
    assert im._probe.__wrapped__(interpret=True) is None
    raw = im._probe_inputs(True)[4](im._probe_inputs(True)[3])
    assert raw["gate" if kernel == "gu" else "down"].packed.shape[2] * 8 == im.K_BLOCK * leaves


def test_five_k_block_layer_matches_portable_path_and_stays_batch_invariant():
    """A layer whose gate/up walk 5 K blocks (D = 1280) and down 2 (F = 512), scales of both signs: the K loop
    carries its accumulators over several steps, with and without a K split of 5 and with two blocks a program;
    float32 within 2e-6 of the portable path, a token's bits alone = in the batch."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    wide = {}
    for name, (n_out, n_in) in {"gate": (512, 1280), "up": (512, 1280), "down": (1280, 512)}.items():
        packed = jnp.asarray(rng.integers(-(2**31), 2**31, (E, n_out, n_in // 8)), jnp.int32)
        scale = rng.uniform(0.5, 1.5, (E, n_out, n_in // 32)) * rng.choice([-1.0, 1.0], (E, n_out, n_in // 32))
        wide[name] = quant.Int4Weight(packed, jnp.asarray(scale / np.sqrt(n_in), jnp.bfloat16))
    ops = im.relayout(wide)
    ex, wt = _routing(rng, 9, None, 0.2)
    x = jnp.asarray(rng.normal(size=(9, 1280)), jnp.float32)
    ref = np.asarray(_portable(x, ex, wt, wide))
    for cfg in ((), (("gu_ksplit", 5),), (("m_group", 2),)):
        y = np.asarray(_kernel(x, ex, wt, ops, config=cfg))
        assert np.isfinite(y).all(), (cfg, seed)
        assert _rel(y, ref) < 2e-6, (cfg, _rel(y, ref), seed)
        alone = np.asarray(_kernel(x[3:4], ex[3:4], wt[3:4], ops, config=cfg))[0]
        assert np.array_equal(y[3], alone), (cfg, float(np.abs(y[3] - alone).max()), seed)


def test_the_tree_completion_reads_only_live_rows_of_the_partials():
    """The gate/up programs store a K tree's float32 partials for a block's live rows only, so the rows past a
    block's count hold whatever the buffer held. The completion (`_silu_combine_kernel`, `_complete_tree`) must
    read them as 0: with NaN in every padding row of the partials, a live block's h rows are silu(g) * u of the
    tree sums of its live rows, and its padding rows are 0, as they were when the padding x rows made zero
    partials."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    programs, bn, f, counts = 4, 32, 64, np.asarray([1, 16, 5, 0], np.int32)
    S = len(counts)
    g, u = (rng.normal(size=(programs, S * 16, f)).astype(np.float32) for _ in range(2))
    pad = (np.arange(16)[None, :] >= counts[:, None]).reshape(-1)
    g[:, pad], u[:, pad] = np.nan, np.nan
    h = im.pl.pallas_call(
        functools.partial(im._silu_combine_kernel, bn=bn, programs=programs, dtype=jnp.float32),
        out_shape=jax.ShapeDtypeStruct((S * 16, f), jnp.float32),
        grid=im._grid(S, f // bn),
        interpret=True,
    )(jnp.asarray(counts), jnp.asarray(g), jnp.asarray(u))
    h = np.asarray(h).reshape(S, 16, f)
    gs, us = (im.tree_sum([jnp.asarray(a[p]) for p in range(programs)]) for a in (g, u))
    want = np.asarray(im._silu_mul(gs, us, jnp.float32)).reshape(S, 16, f)
    for b, n in enumerate(counts[:-1]):  # the last slot has no rows: its programs do nothing
        assert np.array_equal(h[b, :n], want[b, :n]), (b, seed)
        assert not h[b, n:].any() and np.isfinite(h[b]).all(), (b, seed)


def test_the_last_program_of_a_tile_completes_the_gate_up_tree_with_the_same_bits():
    """gu_last_finishes: with the gate/up K tree on 2 or 4 programs, the last program of each tile to store its
    partials (an atomic count, zeroed by the metadata program) completes the tree and applies the
    SiLU-multiply: the same bits as the combine kernel, with no combine launch; counters from the metadata
    program (up to its assignments) or from XLA's zeros (past them) alike, and two blocks per program."""
    seed, raw, ops, ex, wt, x = _wide_layer()
    for xs in (x, x.astype(jnp.bfloat16)):
        for extra in ((), (("m_group", 2),)):
            for programs in (2, 4):
                tree = (("gu_ksplit", 4), ("gu_programs", ((64, programs),))) + extra
                want = np.asarray(_kernel(xs, ex, wt, ops, config=tree + (("gu_last_finishes", False),)))
                want = want.astype(np.float32)
                got = np.asarray(_kernel(xs, ex, wt, ops, config=tree + (("gu_last_finishes", True),)))
                assert np.isfinite(got).all() and np.array_equal(got.astype(np.float32), want), (programs, seed)

    def names(cfg, x=x):
        jaxpr = jax.make_jaxpr(lambda x: im.moe_int4(x, ex, wt, ops, num_local=E, interpret=True, config=cfg))(x)
        return [e.params["name"] for e in eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]

    tree = {"gu_ksplit": 4, "gu_programs": ((64, 2),)}
    assert "int4_moe_silu_combine" in names({**tree, "gu_last_finishes": False})
    assert "int4_moe_silu_combine" not in names({**tree, "gu_last_finishes": True})
    # past the metadata kernel's assignments the counters are XLA's zeros: the same bits too
    big_ex, big_wt = _routing(np.random.default_rng(seed), 300, None, 0.2)
    big_x = jnp.asarray(np.random.default_rng(seed + 1).normal(size=(300, 1024)), jnp.float32)
    cfg = (("gu_ksplit", 4), ("gu_programs", ((512, 2),)))
    want = np.asarray(_kernel(big_x, big_ex, big_wt, ops, config=cfg + (("gu_last_finishes", False),)))
    got = np.asarray(_kernel(big_x, big_ex, big_wt, ops, config=cfg + (("gu_last_finishes", True),)))
    assert np.array_equal(got, want), seed


def test_the_down_kernel_reads_only_a_blocks_live_rows_of_h():
    """dn_live_rows: the down kernel loads a block's live rows of h (masked) instead of all 16. With h's
    padding rows poisoned (NaN), every stored row has the same bits as the all-rows load of the same h,
    which equals the all-rows load of h with zero padding rows: a padding row reaches only output columns
    that are never stored, and the mask keeps every live row (float32 and bfloat16, two blocks a program)."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    raw = _layer(rng)
    ops = im._operands(im.relayout(raw))
    ex, wt = _routing(rng, 11, np.arange(5), 0.2)  # 5 experts: several blocks hold padding rows
    for dtype in (jnp.float32, jnp.bfloat16):
        for group in (1, 2):
            meta = im.route_blocks(ex, wt, E, group)
            S = im.num_slots(meta)
            live = np.arange(S * im.BLOCK_M) % im.BLOCK_M < np.repeat(np.asarray(meta["rows"][:S]), im.BLOCK_M)
            h = rng.normal(size=(S * im.BLOCK_M, F)).astype(np.float32)
            poisoned = jnp.asarray(np.where(live[:, None], h, np.nan), dtype)
            zeroed = jnp.asarray(np.where(live[:, None], h, 0.0), dtype)
            a = meta["valid"].shape[0]
            valid = np.asarray(meta["valid"])

            def down(h, live_rows, meta=meta, group=group, a=a, dtype=dtype, valid=valid):
                cfg = im._config({"dn_live_rows": live_rows})
                common = im._common(dtype, "jnp")
                y = im.down_rows(h, meta, ops, cfg["dn_block_n"], cfg, common, True, a, group)
                return np.asarray(y)[:a][valid]

            got = down(poisoned, True)
            assert np.isfinite(got).all(), (dtype, group, seed)
            assert np.array_equal(got, down(poisoned, False)), (dtype, group, seed)
            assert np.array_equal(got, down(zeroed, False)), (dtype, group, seed)


def test_the_down_k_tree_gives_the_same_bits_on_any_program_count_and_leaf_loop():
    """dn_ksplit=4 at F = 1024 (4 down K blocks): the down K sums as the tree ((l0 + l1) + (l2 + l3)), on one
    program per output tile (flat or interleaved leaves), 2 or 4 programs whose last to count completes the tree:
    the same bits for every count, in float32 and bf16, with the gate/up tree on 2 programs counting in the same
    array (the down counters after the gate/up ones, all zeroed by the metadata program). A token alone on 4
    programs equals its row among 9 on one; float32 within 2e-6 of the portable path; the metadata plan counts
    the down tiles only where the tree has several programs. With the shared down's dense product in the launch
    (part 0's programs only) the routed rows keep their bits and the product is `stacked_matmul`'s."""
    from jaxspec.kernels import stacked_matmul as sm

    seed = _seed()
    rng = np.random.default_rng(seed)
    d, f, T = 512, 1024, 9
    raw = _layer(rng, d=d, f=f)
    ops = im.relayout(raw)
    ex, wt = _routing(rng, T, None, 0.2)
    x = jnp.asarray(rng.normal(size=(T, d)), jnp.float32)
    ref = np.asarray(_portable(x, ex, wt, raw))
    tree = (("dn_ksplit", 4),)
    for xs in (x.astype(jnp.bfloat16), x):  # float32 last: `first` below is its
        ys = {}
        for programs, loop, gu in (
            (1, "flat", 1),
            (1, "interleave", 1),
            (2, "flat", 2),
            (2, "interleave", 1),
            (4, "flat", 2),
        ):
            cfg = tree + (("dn_programs", ((64, programs),)), ("dn_leaf_loop", loop), ("gu_programs", ((64, gu),)))
            ys[programs, loop, gu] = np.asarray(_kernel(xs, ex, wt, ops, config=cfg).astype(jnp.float32))
            assert np.isfinite(ys[programs, loop, gu]).all(), (programs, loop, seed)
        first = ys[1, "flat", 1]
        for key, y in ys.items():
            assert np.array_equal(y, first), (key, xs.dtype, seed)
    one = np.asarray(_kernel(x, ex, wt, ops, config=tree).astype(jnp.float32))  # one program a leaf
    assert np.array_equal(one, first) and _rel(first, ref) < 2e-6, (_rel(first, ref), seed)
    follows_t = tree + (("dn_programs", ((1, 4), (1 << 30, 1))),)
    alone = np.asarray(_kernel(x[5:6], ex[5:6], wt[5:6], ops, config=follows_t))
    assert np.array_equal(alone[0], first[5]), (float(np.abs(alone[0] - first[5]).max()), seed)
    with pytest.raises(ValueError, match="dn_ksplit"):
        _kernel(x, ex, wt, ops, config=(("dn_ksplit", 3),))
    with pytest.raises(ValueError, match="dn_programs"):
        _kernel(x, ex, wt, ops, config=tree + (("dn_programs", ((64, 3),)),))
    with pytest.raises(ValueError, match="dn_leaf_loop"):
        _kernel(x, ex, wt, ops, config=(("dn_leaf_loop", "nested"),))
    base = dict(im.DEFAULT_CONFIG, gu_programs=((64, 1),))
    tiles = d // base["dn_block_n"]
    slots = im.num_block_slots(T, K, E)
    assert im.num_counters(dict(base, dn_ksplit=4, dn_programs=((64, 1),)), T, K, E, 1, d, f) == 0
    assert im.num_counters(base, T, K, E, 1, d, f) == 0  # the default: one leaf
    assert im.num_counters(dict(base, dn_ksplit=4, dn_programs=((64, 2),)), T, K, E, 1, d, f) == slots * tiles
    # the metadata program zeroes exactly the counters the kernels count in (else they would take zeros of XLA's)
    both = dict(base, gu_programs=((64, 2),), dn_ksplit=4, dn_programs=((64, 2),))
    plan = im.metadata_plan(T, K, E, d, f, config=both)
    n_gu, n_dn = im.counter_counts(im._config(both), T, plan.slots // plan.group, d, f)
    assert n_gu > 0 and n_dn == slots * tiles and plan.counters == n_gu + n_dn, (plan, n_gu, n_dn)
    # the shared down's product in the same launch: its programs run once (part 0), the routed rows keep their bits
    L, fs = 2, 128
    rows = np.zeros((sm.padded_rows(T), fs), np.float32)
    rows[:T] = rng.normal(size=(T, fs))
    rows, stack = jnp.asarray(rows), jnp.asarray(rng.normal(size=(L, fs, d)) / np.sqrt(fs), jnp.float32)
    lyr = jnp.asarray(1, jnp.int32)
    want = sm.stacked_matmuls(rows, (stack,), lyr, interpret=True, rows=T, raw=(True,))[0]
    cfg = dict(tree + (("dn_programs", ((64, 2),)),))
    run = functools.partial(im.moe_int4, num_local=E, interpret=True, poison_rows=True, config=cfg)
    y, parts = jax.jit(lambda x, ex, wt, ops, *dense: run(x, ex, wt, ops, dense=dense))(
        x, ex, wt, ops, rows, stack, lyr
    )
    assert np.array_equal(np.asarray(parts), np.asarray(want)), (float(np.abs(parts - want).max()), seed)
    assert np.array_equal(np.asarray(y), first), seed


def test_live_first_launch_order_gives_the_same_bits():
    """``live_first``: the K-tree part on grid axis 1 and the block slots on the slowest axis, so that every part's
    live programs launch before the dead slots'. Only the launch order moves: the same bits as the default order
    for the gate/up tree on 4 programs (flat leaves, the last program finishing) with the down tree on 2, and on 2
    programs with the combine kernel, at T = 1 and 9, with the shared down's dense product in the launch (its programs
    on part 0 only); float32 within 2e-6 of the portable path; a token alone equals its row in the batch."""
    from jaxspec.kernels import stacked_matmul as sm

    seed = _seed()
    rng = np.random.default_rng(seed)
    d, f = 1024, 1024
    raw = _layer(rng, d=d, f=f)
    ops = im.relayout(raw)
    L, fs = 2, 128
    stack = jnp.asarray(rng.normal(size=(L, fs, d)) / np.sqrt(fs), jnp.float32)
    lyr = jnp.asarray(1, jnp.int32)
    forms = (  # the gate/up tree on 4 programs (the last finishing) with the down tree on 2; on 2 with the combine
        (("gu_ksplit", 4), ("gu_programs", ((64, 4),)), ("gu_leaf_loop", "flat"), ("dn_ksplit", 4))
        + (("dn_programs", ((64, 2),)),),
        (("gu_programs", ((64, 2),)), ("gu_last_finishes", False)),
    )
    for T in (1, 9):
        ex, wt = _routing(rng, T, None, 0.2)
        x = jnp.asarray(rng.normal(size=(T, d)), jnp.float32)
        rows = np.zeros((sm.padded_rows(T), fs), np.float32)
        rows[:T] = rng.normal(size=(T, fs))
        rows = jnp.asarray(rows)
        ref = np.asarray(_portable(x, ex, wt, raw))
        for form in forms:
            got = {}
            for live_first in (False, True):
                cfg = dict(form + (("live_first", live_first),))
                run = functools.partial(im.moe_int4, num_local=E, interpret=True, poison_rows=True, config=cfg)
                y, parts = jax.jit(lambda x, ex, wt, ops, *dense, run=run: run(x, ex, wt, ops, dense=dense))(
                    x, ex, wt, ops, rows, stack, lyr
                )
                got[live_first] = np.asarray(y), np.asarray(parts)
                assert np.isfinite(got[live_first][0]).all(), (form, T, seed)
            assert np.array_equal(got[True][0], got[False][0]), (form, T, seed)
            assert np.array_equal(got[True][1], got[False][1]), (form, T, seed)
            assert _rel(got[True][0], ref) < 2e-6, (form, T, _rel(got[True][0], ref), seed)
            if T > 1:
                alone = np.asarray(_kernel(x[4:5], ex[4:5], wt[4:5], ops, config=form + (("live_first", True),)))
                assert np.array_equal(alone[0], got[True][0][4]), (form, seed)
    with pytest.raises(ValueError, match="live_first"):
        _kernel(x, ex, wt, ops, config=(("live_first", "yes"),))


def test_the_down_launch_runs_a_dense_product_beside_its_own_programs():
    """``dense=(x, stack, layer)``: the down launch's spare block slots run `stacked_matmul`'s programs for
    ``x @ stack[layer]`` (a MoE layer's shared down projection). Their partials have the bits of
    `stacked_matmul`'s own call (raw), and the routed output keeps its bits: at T = 1 (one row block, no K
    split, more dense programs than a slot row of down tiles) and T = 21 (two row blocks, a K split of 2, two
    routed blocks a program).
    The dense output buffer is never pre-filled, so a program left unrun would show as a mismatch."""
    from jaxspec.kernels import stacked_matmul as sm

    seed = _seed()
    rng = np.random.default_rng(seed)
    ops = im.relayout(_layer(rng))
    L = 3
    for T, fs, n, layer, want_split, group in ((1, 64, 3 * D // 2, 2, 1, 1), (21, 128, D, 0, 2, 2)):
        ex, wt = _routing(rng, T, nonlocal_frac=0.2)
        x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
        mp = sm.padded_rows(T)
        rows = np.zeros((mp, fs), np.float32)
        rows[:T] = rng.normal(size=(T, fs))
        rows = jnp.asarray(rows)
        stack = jnp.asarray(rng.normal(size=(L, fs, n)) / np.sqrt(fs), jnp.float32)
        lyr = jnp.asarray(layer, jnp.int32)
        want = sm.stacked_matmuls(rows, (stack,), lyr, interpret=True, rows=T, raw=(True,))[0]
        plan = im._dense_plan((rows, stack, lyr), 1, D // im.DEFAULT_CONFIG["dn_block_n"])
        assert plan["ksplit"] == want_split and plan["programs"] > plan["tiles"], (plan, seed)
        cfg = (("m_group", group),)  # 2: two blocks a program, the routed slots are S / 2
        run = functools.partial(im.moe_int4, num_local=E, interpret=True, poison_rows=True, config=dict(cfg))
        y, parts = jax.jit(lambda x, ex, wt, ops, *dense, run=run: run(x, ex, wt, ops, dense=dense))(
            x, ex, wt, ops, rows, stack, lyr
        )
        assert parts.shape == want.shape == (want_split, mp, n), (parts.shape, want.shape, seed)
        assert np.array_equal(np.asarray(parts), np.asarray(want)), (T, float(np.abs(parts - want).max()), seed)
        assert np.array_equal(np.asarray(y), np.asarray(_kernel(x, ex, wt, ops, config=cfg))), (T, seed)
        ref = np.asarray(rows[:T], np.float64) @ np.asarray(stack[layer], np.float64)
        assert np.allclose(np.asarray(parts, np.float64).sum(0)[:T], ref, rtol=1e-4, atol=1e-4), seed


def test_the_dense_probe_passes_the_kernel_and_fails_a_product_that_is_wrong_or_follows_the_batch(monkeypatch):
    """`dense_available`'s probe (interpret mode here): the down launch with a dense product beside it passes;
    a dense product that skips its last K step (finite, wrong) or whose rows move with the row count by a
    relative 1e-7 a row (not batch-invariant) each fail it, naming what went wrong."""
    assert im._dense_probe.__wrapped__(interpret=True) is None
    plan = im._dense_plan

    def short(dense, slots, tiles):
        p = plan(dense, slots, tiles)
        assert p["steps"] > 1
        return {**p, "steps": p["steps"] - 1}

    with monkeypatch.context() as m:
        m.setattr(im, "_dense_plan", short)
        why = im._dense_probe.__wrapped__(interpret=True)
    assert why is not None and "differ from stacked_matmul" in why, why

    down_rows = im.down_rows

    def drifting(*args, dense=None, **kw):
        out = down_rows(*args, dense=dense, **kw)
        if dense is None:
            return out
        live = jnp.any(dense[0] != 0, axis=1).sum().astype(jnp.float32)  # the live rows: 3 in the batch, 1 alone
        return out[0], out[1] * (1.0 + 1e-7 * live)  # within the probe's float32 bound of stacked_matmul

    with monkeypatch.context() as m:
        m.setattr(im, "down_rows", drifting)
        why = im._dense_probe.__wrapped__(interpret=True)
    assert why is not None and "alone" in why, why


def test_moe_int4_takes_metadata_built_elsewhere_only_for_its_own_plan():
    """`moe_int4(meta=...)` (the metadata the routing launch builds, `kernel_metadata(..., plan)`): the output of a
    call given the metadata of its own plan is the bits of the call that builds its own; metadata of another
    plan (another share, or none recorded) is refused, naming both plans."""
    from jaxspec.kernels import block_routing

    seed = _seed()
    rng = np.random.default_rng(seed)
    ops = im.relayout(_layer(rng))
    T = 3
    ex = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
    wt = jnp.asarray(rng.uniform(0.1, 1.0, (T, K)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    plan = im.metadata_plan(T, K, E, D, F)

    def meta_of(plan):
        wbits = jax.lax.bitcast_convert_type(wt.reshape(-1), jnp.int32)
        outs = block_routing.block_metadata(
            ex.reshape(-1), wbits, k=K, num_local=E, slots=plan.slots, block=plan.block, group=plan.group,
            interpret=True, share=plan.share, counters=plan.counters,
        )  # fmt: skip
        return im.kernel_metadata(outs, wt, plan)

    got = np.asarray(im.moe_int4(x, ex, wt, ops, num_local=E, interpret=True, meta=meta_of(plan)))
    np.testing.assert_array_equal(got, np.asarray(_kernel(x, ex, wt, ops)), err_msg=f"seed {seed}")
    other = plan._replace(share=2)
    with pytest.raises(ValueError, match="meta was built for Plan.*share=2.*this call's plan is Plan"):
        im.moe_int4(x, ex, wt, ops, num_local=E, interpret=True, meta=meta_of(other))
    unrecorded = {n: v for n, v in meta_of(plan).items() if n != "plan"}
    with pytest.raises(ValueError, match="meta was built for None"):
        im.moe_int4(x, ex, wt, ops, num_local=E, interpret=True, meta=unrecorded)
