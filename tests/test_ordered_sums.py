"""`sharding.ordered_psum`: the target's sums over the mesh, each element added in device order in float32,
whatever the size of the sum. Run in a child process with 8 fake CPU devices (the device count is fixed when
JAX starts). On the CPU, XLA's own all-reduce adds in that order too, so the two must agree bit for bit; the
terms span many binades, so an order that differs shows (the test was seen to fail with the order reversed)."""

import json
import os
import subprocess
import sys

import cpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxspec import sharding
from jaxspec.collectives import count_collectives

def run(mesh, axes, x, gather_bytes, dtype=None):
    sharding.GATHER_BYTES = gather_bytes
    spec = P(axes)
    x = jax.device_put(x, NamedSharding(mesh, spec))
    out = {}
    for name, fn in (("ordered", lambda v: sharding.ordered_psum(v[0], axes, dtype)[None]),
                     ("psum", lambda v: jax.lax.psum(v[0], axes).astype(dtype or v.dtype)[None])):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
        counts = count_collectives(f.lower(x).compile().as_text())
        out[name] = (np.asarray(f(x).astype(jnp.float32)), {k: v["count"] for k, v in counts.items() if v["count"]},
                     "reduce_precision" in f.lower(x).as_text())
    got, want = out["ordered"][0], out["psum"][0]
    alone = jax.jit(jax.shard_map(lambda v: sharding.ordered_psum(v[0, :1], axes, dtype)[None], mesh=mesh,
                                  in_specs=spec, out_specs=spec, check_vma=False))(x)
    return {"differ": int((got != want).sum()), "reduce_precision": out["ordered"][2],
            "alone": bool(np.array_equal(np.asarray(alone.astype(jnp.float32))[:, 0], got[:, 0])),
            "agree": all(np.array_equal(got[0], got[i]) for i in range(got.shape[0])),
            "ordered": out["ordered"][1], "psum": out["psum"][1]}

rng = np.random.default_rng(int(sys.argv[2]))
terms = lambda *shape: rng.normal(size=shape) * np.exp(rng.normal(size=shape) * 3)  # many binades
one, two = jax.make_mesh((8,), ("model",)), jax.make_mesh((2, 4), ("data", "model"))
res = {}
for dt in ("float32", "bfloat16"):
    for form, nbytes in (("gather", 4 << 20), ("all_to_all", 0)):
        res[f"{dt}-{form}"] = run(one, "model", terms(8, 37, 301).astype(dt), nbytes)  # 11137 a device: padded
    res[f"{dt}-two_axes"] = run(two, ("data", "model"), terms(8, 5, 64).astype(dt), 4 << 20)
for form, nbytes in (("gather", 4 << 20), ("all_to_all", 0)):  # float32 terms, the sum rounded to bfloat16
    res[f"float32_to_bfloat16-{form}"] = run(one, "model", terms(8, 37, 301).astype("float32"), nbytes, "bfloat16")
sharding.ORDERED_SUMS = False
res["switch_off"] = run(one, "model", terms(8, 3, 16).astype("float32"), 4 << 20)
print(json.dumps(res))
"""


def test_ordered_sums_have_psums_bits_on_the_cpu_whatever_the_form_and_a_row_has_them_alone():
    """Float32 and bfloat16 terms, and float32 terms summed to bfloat16, over one mesh axis (the one-gather form
    and the all-to-all form, 37 x 301 elements a device: not a multiple of 8, so the all-to-all's padding is
    exercised) and over two axes: the bits of `psum` (which on the CPU adds in device order in float32 and rounds
    once), the same on every device, and a row summed alone has the bits it has among the other rows. The
    collectives are an all-gather (and an all-to-all) instead of the all-reduce; with `ORDERED_SUMS` off, the
    all-reduce."""
    env = cpu_env.fake_devices(8)
    seed = int.from_bytes(os.urandom(2), "little")  # fresh terms each run
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, ROOT, str(seed)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in res.items():
        assert r["differ"] == 0 and r["alone"] and r["agree"], (seed, name, r)
        # float32 sums rounded to a narrower dtype by an op XLA's excess precision keeps (a cast alone it may drop)
        assert r["reduce_precision"] == (name.startswith(("bfloat16", "float32_to")) and name != "switch_off"), (
            name,
            r,
        )
        assert r["psum"] == {"all-reduce": 1}, (name, r)
        if name == "switch_off":
            assert r["ordered"] == {"all-reduce": 1}, r
        elif name.endswith("all_to_all"):
            assert r["ordered"] == {"all-to-all": 1, "all-gather": 1}, (name, r)
        else:
            assert r["ordered"] == {"all-gather": 1}, (name, r)
