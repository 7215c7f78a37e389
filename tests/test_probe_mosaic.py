"""scripts/probe_mosaic_int4.py on the CPU: its float32 reference, its byte counts, and every variant lowered for CUDA.

The probe's kernels run only on a GPU; what a CPU can check is what the device's figures rest on: the reference
each variant's output is held against (run 34 read a correct kernel as wrong because the reference left out the
scales of one variant), the bytes its TB/s divide, and that every variant and tile form lowers.
"""

import argparse
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "probe_mosaic_int4.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("probe_mosaic_int4", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", ["bf16", "int4", "int4_noscale", "int4_ws", "int4_ws2"])
def test_reference_is_the_product_of_the_variants_own_weights(probe, variant):
    """The reference against numpy in float64, from the weights as stored: q and the [K/32, N] scales."""
    n, k, t = 64, 128, 3
    seed = int(np.random.default_rng().integers(2**31))
    w, s = probe.make_weights(jax.random.key(seed), variant, n, k)
    x = jax.random.normal(jax.random.key(seed + 1), (t, k), jnp.bfloat16)
    xs = np.asarray(x, np.float64)
    wf = np.asarray(w.astype(jnp.float32), np.float64)  # bf16 weights, or the int4 values q
    if variant in ("int4", "int4_ws", "int4_ws2"):
        assert variant in probe.SCALED
        sf = np.asarray(s.astype(jnp.float32), np.float64)  # [K/32, N]
        wf = wf * np.repeat(sf.T, 32, axis=1)  # W[n, k] = q[n, k] * s[k // 32, n]
    else:
        assert variant not in probe.SCALED
    want = xs @ wf.T
    got = np.asarray(probe.reference(variant, w, s, x), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_weight_bytes_count_the_scales_of_the_scaled_variants(probe):
    n, k = 256, 1024
    for variant in probe.VARIANTS:
        scales = n * (k // 32) * 2 if variant in probe.SCALED else 0
        words = n * k * 2 if variant == "bf16" else n * k // 2
        assert probe.weight_bytes(variant, n, k) == words + scales, variant


def test_every_variant_lowers_for_cuda(probe, capsys):
    """Each variant at one and at several warpgroups' rows (BN 64, 128), T = 1 and 9 (tokens padded to 16)."""
    args = argparse.Namespace(
        variants=list(probe.VARIANTS),
        tokens=[1, 9],
        block_n=[64, 128],
        block_k=[256],
        stages=[2],
        ksplit=[2],
        n=256,
        k=1024,
        verbose=False,
    )
    failures = probe.lower_only(args)
    out = capsys.readouterr().out
    assert failures == 0, out
    assert out.count("OK    ") == len(probe.VARIANTS) * 2 * 2, out
