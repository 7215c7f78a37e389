"""`quant.Int4Weight`: one type for INT4 weights from the parameter tree to the checkpoint, the sharding
table and the converter's names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints_convert import quant_np
from checkpoints_convert import target as target_rules
from jaxspec import checkpoint, quant
from jaxspec.config import preset
from jaxspec.model import abstract_params, expert_axes, per_layer
from jaxspec.sharding import make_mesh, param_shardings

W = quant.Int4Weight


def test_dequant_equals_the_numpy_reference_and_the_shape_properties():
    rng = np.random.default_rng()
    dense = rng.normal(size=(3, 16, 64)).astype(np.float32)
    packed, scale = zip(*(quant_np.quantize_int4_np(d, 32) for d in dense))
    w = W(jnp.asarray(np.stack(packed)), jnp.asarray(np.stack(scale)), 32).check("w")
    assert (w.lead, w.out_features, w.in_features) == ((3,), 16, 64)
    assert w.nbytes == np.stack(packed).nbytes + np.stack(scale).nbytes
    ref = np.stack([quant_np.dequant_int4_np(p, s, group_size=32) for p, s in zip(packed, scale)])
    np.testing.assert_array_equal(np.asarray(w.dequant(jnp.float32)), ref)
    # A pytree: jit, tree.map and slicing keep the static group size and layout.
    half = jax.jit(lambda v: jax.tree.map(lambda a: a[1:], v))(w)
    assert isinstance(half, W) and half.group_size == 32 and half.layout == quant.ROWS and half.lead == (2,)


def test_check_names_the_weight_with_expected_and_found():
    packed = jnp.zeros((4, 16, 8), jnp.int32)  # in = 64
    with pytest.raises(ValueError, match=r"gate\.scale: expected shape \(4, 16, 2\) .* found \(4, 16, 3\)"):
        W(packed, jnp.zeros((4, 16, 3)), 32).check("gate")
    with pytest.raises(ValueError, match=r"up\.packed: expected int32 words .* found int8"):
        W(packed.astype(jnp.int8), jnp.zeros((4, 16, 2)), 32).check("up")
    with pytest.raises(ValueError, match=r"down: layout must be one of \('rows', 'tiles'\), found 'cols'"):
        W(packed, jnp.zeros((4, 16, 2)), 32, "cols").check("down")
    tiles = W(jnp.zeros((4, 1, 16, 32), jnp.int32), jnp.zeros((4, 1, 15, 4), jnp.int32), 32, quant.TILES)
    with pytest.raises(ValueError, match=r"gate\.scale: expected int32 \(4, 1, 16, 4\)"):
        tiles.check("gate")
    with pytest.raises(ValueError, match="dequant reads the 'rows' layout"):
        tiles.dequant()


def test_checkpoint_leaves_are_the_hf_names_and_round_trip():
    """On disk an Int4Weight `gate` is the leaves gate_packed / gate_scale (compressed-tensors'
    weight_packed / weight_scale), and every such leaf has a converter rule."""
    cfg = preset("kimi-k2.5", num_layers=3)
    shapes = per_layer(cfg, abstract_params(cfg, jnp.bfloat16)[0])
    flat = checkpoint.flatten(shapes)
    moe = {p[-1]: v for p, v in flat.items() if p[:2] == ("layers_1", "moe")}
    assert {"gate_packed", "gate_scale", "up_packed", "up_scale", "down_packed", "down_scale"} <= set(moe)
    assert moe["gate_packed"].shape == (384, 2048, 7168 // 8) and moe["gate_packed"].dtype == jnp.int32
    assert moe["down_scale"].shape == (384, 7168, 2048 // 32) and moe["down_scale"].dtype == jnp.bfloat16
    for path in flat:
        assert target_rules.leaf_rule("/".join(path)) is not None, path
    back = checkpoint.unflatten(flat, shapes)
    assert jax.tree.structure(back) == jax.tree.structure(shapes)
    assert isinstance(back["layers_1"]["moe"]["gate"], W)
    with pytest.raises(KeyError, match="no leaf for layers_1/moe/gate_scale"):
        checkpoint.unflatten({k: v for k, v in flat.items() if k != ("layers_1", "moe", "gate_scale")}, shapes)


def test_sharding_table_splits_packed_words_and_scales_with_their_experts():
    cfg = preset("kimi-k2.5", num_layers=3)
    _, specs = abstract_params(cfg, jnp.bfloat16)
    mesh = make_mesh(1)
    shardings = param_shardings(specs, mesh)
    gate = shardings["layers"]["moe"]["gate"]
    assert isinstance(gate, W)
    # [layer, expert, out, in/8] and [layer, expert, out, in/32]: the expert dim goes to the model axis.
    assert tuple(gate.packed.spec)[:2] == (None, "model") and tuple(gate.scale.spec)[:2] == (None, "model")
    axes = expert_axes(32, quant.TILES)["down"]
    assert axes.layout == quant.TILES and axes.packed == ("expert", "moe_mlp", "embed", None)
