"""Loading restores each leaf straight onto its sharding, shard by shard, and gives exactly what the
plain path gives (read the whole leaf, cast, place it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import cpu_env
import jax
import ml_dtypes
import numpy as np
import pytest

from jaxspec import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 8 fake devices. Two conversions of one model: in bfloat16 and 4 KiB chunks (every sharded leaf is read
# shard by shard) and in float32 and the default chunks (this model's leaves are then one chunk each, as in
# checkpoints from before chunking, and a sharded leaf is read whole once). Each is loaded in float32 and in
# bfloat16 (a cast per shard, up or down) by the default path and by the whole-leaf path. The restore budget
# is cut to one byte, so orbax's limit is exactly the largest shard read the loader reserves for.
SCRIPT = r"""
import collections, json, sys
sys.path.insert(0, sys.argv[2]); sys.path.insert(0, sys.argv[2] + "/tests")
import jax
import numpy as np
import hf_models
from checkpoints_convert.convert import convert
from jaxspec import checkpoint

from jaxspec.engine import Engine

root = sys.argv[1]
hf_models.build(root + "/hf", seed=5, vocab_size=104, num_attention_heads=8, num_key_value_heads=8,
                n_routed_experts=16, num_experts_per_tok=4, n_group=2, topk_group=1)
checkpoint.CHUNK_BYTES = 4096
convert(root + "/hf", root + "/chunked", dtype="bfloat16", progress=False)
checkpoint.CHUNK_BYTES = 2 << 20
convert(root + "/hf", root + "/whole", dtype="float32", progress=False)

checkpoint.RESTORE_BYTES = 1
plain_load = checkpoint.load_leaves
calls = collections.Counter()
requested, abstract_dtypes = {}, {}
split_shard_by_shard = set()  # leaves split over the mesh that were read shard by shard
for name in ("_restore_sharded", "_restore_via_host"):
    def counted(leaf_dir, spec, sharding, *a, _f=getattr(checkpoint, name), _n=name, **k):
        calls[_n] += 1
        if _n == "_restore_sharded" and any(x is not None for x in sharding.spec):
            split_shard_by_shard.add(leaf_dir.rsplit("/", 1)[-1])
        return _f(leaf_dir, spec, sharding, *a, **k)
    setattr(checkpoint, name, counted)

def load(path, dtype, via_host):
    def spy(root, abstract, shardings=None, subdir="params", **kw):
        if subdir == "params":
            requested.update(checkpoint.flatten(shardings))
            abstract_dtypes.update({k: v.dtype for k, v in checkpoint.flatten(abstract).items()})
        return plain_load(root, abstract, shardings, subdir, via_host=via_host, **kw)
    checkpoint.load_leaves = spy
    calls.clear()
    split_shard_by_shard.clear()
    engine = Engine.load(path, dtype=dtype, num_devices=8)
    return engine, checkpoint.flatten(engine.params), dict(calls, split_shard_by_shard=sorted(split_shard_by_shard))

from jaxspec.model import STACK, stacked_range

def per_layer_key(engine, k):  # the checkpoint leaf a loaded leaf was read from (stacked: its first layer's)
    return (f"layers_{stacked_range(engine.cfg).start}",) + k[1:] if k[0] == STACK else k

def placed_as_requested(engine, k, arr):
    want = requested[per_layer_key(engine, k)]
    if k[0] != STACK:
        return arr.sharding == want
    pad = lambda spec, n: tuple(spec) + (None,) * (n - len(spec))
    return arr.sharding.mesh == want.mesh and pad(arr.sharding.spec, arr.ndim) == (None,) + pad(want.spec, arr.ndim - 1)

res = {"devices": len(jax.devices())}
for ck in ("chunked", "whole"):
    for dtype in ("float32", "bfloat16"):
        engine, got, calls_got = load(root + "/" + ck, dtype, False)
        _, want, _ = load(root + "/" + ck, dtype, True)
        res[f"{ck}/{dtype}"] = {
            "calls": calls_got,
            "differ": ["/".join(k) for k in want if not np.array_equal(np.asarray(got[k]), np.asarray(want[k]))],
            "dtype_wrong": ["/".join(k) for k in want
                            if not got[k].dtype == want[k].dtype == abstract_dtypes[per_layer_key(engine, k)]],
            "bf16": sum(got[k].dtype == np.dtype("bfloat16") for k in got),
            "not_requested": ["/".join(k) for k in got if not placed_as_requested(engine, k, got[k])],
            "sharded": sum(any(a is not None for a in requested[k].spec) for k in requested),
            "expert_spec": str(got[(STACK, "moe", "gate")].sharding.spec),
            "expert_shards": len({str(s.index) for s in got[(STACK, "moe", "gate")].addressable_shards}),
        }
print(json.dumps(res))
"""


def test_restore_onto_eight_devices_equals_the_whole_leaf_path(tmp_path):
    env = cpu_env.fake_devices(8)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), ROOT],
        env=env,
        capture_output=True,
        check=False,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["devices"] == 8
    for key in ("chunked/float32", "chunked/bfloat16", "whole/float32", "whole/bfloat16"):
        r = res[key]
        assert r["differ"] == [], f"{key}: leaves differ from the whole-leaf path: {r['differ']}"
        assert r["dtype_wrong"] == [], key
        assert r["not_requested"] == [], f"{key}: leaves without the requested sharding: {r['not_requested']}"
        assert "model" in r["expert_spec"] and r["expert_shards"] == 8
    for ck in ("chunked", "whole"):  # stored bfloat16 and float32 respectively: casts up and down happened
        assert res[f"{ck}/bfloat16"]["bf16"] > 20 and res[f"{ck}/float32"]["bf16"] == 0
    # Chunked: the split leaves whose chunks follow their split are read shard by shard: the experts,
    # embedding and lm_head among them (a heads axis of 8 that the chunks do not cut falls back to one
    # whole read).
    for key in ("chunked/float32", "chunked/bfloat16"):
        per_shard = res[key]["calls"]["split_shard_by_shard"]
        for leaf in ("layers_1.moe.gate", "layers_2.moe.down", "embed.embedding", "lm_head.kernel"):
            assert leaf in per_shard, (key, per_shard)
    # One chunk per leaf: every split leaf is read whole once instead of once per shard.
    for key in ("whole/float32", "whole/bfloat16"):
        assert res[key]["calls"]["split_shard_by_shard"] == []
        assert res[key]["calls"]["_restore_via_host"] == res[key]["sharded"]


def write_leaves(root, leaves: dict, chunk_bytes=None):
    writer = checkpoint.LeafWriter(str(root), chunk_bytes=chunk_bytes)
    for path, value in leaves.items():
        writer.write(path, value)
    writer.close()


def test_missing_leaf_and_wrong_shape_name_the_leaf(tmp_path):
    write_leaves(tmp_path, {("a", "w"): np.zeros((4, 6), np.float32)})
    with pytest.raises(FileNotFoundError) as info:
        checkpoint.load_leaves(str(tmp_path), {"a": {"b": jax.ShapeDtypeStruct((4, 6), np.float32)}})
    assert "a/b" in str(info.value) and os.path.join(str(tmp_path), "params", "a.b") in str(info.value)
    with pytest.raises(ValueError) as info:
        checkpoint.load_leaves(str(tmp_path), {"a": {"w": jax.ShapeDtypeStruct((4, 5), np.float32)}})
    message = str(info.value)
    assert "a.w" in message and "(4, 6)" in message and "expected (4, 5)" in message


def test_cast_to_the_requested_dtype(tmp_path):
    value = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    write_leaves(tmp_path, {("w",): value}, chunk_bytes=128)
    for via_host in (False, True):
        out = checkpoint.load_leaves(
            str(tmp_path),
            {"w": jax.ShapeDtypeStruct((16, 8), jax.numpy.bfloat16)},
            {"w": jax.sharding.SingleDeviceSharding(jax.devices()[0])},
            via_host=via_host,
        )
        assert out["w"].dtype == jax.numpy.bfloat16
        np.testing.assert_array_equal(np.asarray(out["w"]), value.astype(ml_dtypes.bfloat16))


def test_stacked_leaves_are_chunked_one_leading_slice_at_a_time(tmp_path):
    """[experts, out, in] leaves: one expert per chunk, so any split of the experts reads exactly its own."""
    leaves = {
        ("experts",): np.arange(6 * 32 * 8, dtype=np.int32).reshape(6, 32, 8),
        ("dense",): np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
        ("norm",): np.ones((64,), np.float32),
    }
    write_leaves(tmp_path, leaves, chunk_bytes=1024)
    reader = checkpoint.ocp.Checkpointer(checkpoint.ocp.PyTreeCheckpointHandler())
    chunks = {
        name: checkpoint._chunk_shape(checkpoint._stored_metadata(reader, str(tmp_path / "params" / name)))
        for name in ("experts", "dense", "norm")
    }
    reader.close()
    assert chunks["experts"] == (1, 32, 8)
    assert chunks["dense"][0] < 64 and np.prod(chunks["dense"]) * 4 <= 1024  # rows of 128 B: byte-size chunks
    assert chunks["norm"] == (64,)
    back = checkpoint.load_leaves(
        str(tmp_path), {k[0]: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in leaves.items()}
    )
    for k, v in leaves.items():
        np.testing.assert_array_equal(np.asarray(back[k[0]]), v)
