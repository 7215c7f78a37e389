"""One device's share of an N-way mesh (`ModelConfig.share`, used by `bench_spec.py --share N`).

The share's MoE layer must compute exactly what the busiest device of the real mesh
computes: routing over all experts, that device's experts, and its slice of the
shared expert. Checked against the unsplit layer with everything outside that
device's part zeroed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ConfigError, preset
from jaxspec.model import MoE, busiest_share


def _cfg(**kw):
    small = dict(
        vocab_size=64,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=16,
        num_experts_per_tok=4,
        num_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        expert_format=None,
    )
    return preset("kimi-k2.5").replace(**{**small, **kw})


def test_busiest_share_picks_the_device_with_most_assignments():
    rng = np.random.default_rng(0)
    for _ in range(20):
        T, k, local, share = int(rng.integers(1, 9)), 4, 4, 4
        ex = np.stack([rng.choice(local * share, k, replace=False) for _ in range(T)]).astype(np.int32)
        counts = np.bincount((ex // local).ravel(), minlength=share)
        dev = int(np.argmax(counts))  # ties: the lowest device, as jnp.argmax
        got = np.asarray(busiest_share(jnp.asarray(ex), local, share))
        np.testing.assert_array_equal(got, ex - dev * local)
        assert ((got >= 0) & (got < local)).sum() == counts.max()


@pytest.mark.parametrize("tokens", [1, 5])
def test_share_moe_equals_the_busiest_devices_part_of_the_full_layer(tokens):
    share = 4
    full_cfg, share_cfg = _cfg(), _cfg(share=share)
    local, F = full_cfg.num_experts // share, full_cfg.moe_intermediate_size
    x = jax.random.normal(jax.random.key(tokens), (1, tokens, full_cfg.hidden_size), jnp.float32)
    full = MoE(full_cfg).init(jax.random.key(1), x)["params"]
    full = jax.tree.map(lambda a: a.value if hasattr(a, "value") else a, full, is_leaf=lambda a: hasattr(a, "value"))

    # The busiest device for this x, from the full layer's own routing.
    from jaxspec.model import route

    logits = x.reshape(tokens, -1) @ full["router"]
    experts, _ = route(logits, full["router_bias"], full_cfg)
    dev = int(np.argmax(np.bincount(np.asarray(experts).ravel() // local, minlength=share)))

    # Share params: the device's experts and the first slice of the shared expert.
    part = slice(dev * local, (dev + 1) * local)
    shared_cols = slice(0, F // share)
    sh = full["shared"]
    share_params = {
        "router": full["router"],
        "router_bias": full["router_bias"],
        **{n: full[n][part] for n in ("gate", "up", "down")},
        "shared": {
            "gate": {"kernel": sh["gate"]["kernel"][:, shared_cols]},
            "up": {"kernel": sh["up"]["kernel"][:, shared_cols]},
            "down": {"kernel": sh["down"]["kernel"][shared_cols, :]},
        },
    }
    got = MoE(share_cfg).apply({"params": share_params}, x)

    # Full layer with everything else zeroed: other experts and the other shared columns give 0.
    keep = np.zeros(full_cfg.num_experts, bool)
    keep[part] = True
    zeroed = dict(full)
    for n in ("gate", "up", "down"):
        zeroed[n] = jnp.where(jnp.asarray(keep)[:, None, None], full[n], 0)
    cols = np.zeros(F, bool)
    cols[shared_cols] = True
    zeroed["shared"] = {
        "gate": {"kernel": jnp.where(jnp.asarray(cols)[None], sh["gate"]["kernel"], 0)},
        "up": {"kernel": jnp.where(jnp.asarray(cols)[None], sh["up"]["kernel"], 0)},
        "down": {"kernel": sh["down"]["kernel"]},
    }
    want = MoE(full_cfg).apply({"params": zeroed}, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(got).max()) > 0


def test_share_must_divide_the_experts():
    with pytest.raises(ConfigError, match="share=3"):
        _cfg(share=3)


def test_the_router_is_held_in_the_models_dtype():
    """The router weight is a parameter in the model's dtype (bfloat16 on the GPU, as HF transformers and
    SGLang hold Kimi's); its logits stay float32."""
    cfg = _cfg()
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jnp.zeros((1, 3, cfg.hidden_size), dtype)
        shapes = jax.eval_shape(lambda x, d=dtype: MoE(cfg, d).init(jax.random.key(0), x), x)
        router = shapes["params"]["router"]
        assert getattr(router, "value", router).dtype == dtype
        params = MoE(cfg, dtype).init(jax.random.key(0), x)
        assert MoE(cfg, dtype).apply(params, x).dtype == dtype


def _unbox(tree):
    return jax.tree.map(lambda a: a.value if hasattr(a, "value") else a, tree, is_leaf=lambda a: hasattr(a, "value"))


def _calls_outside_kernels(jaxpr):
    """The primitives of `jaxpr` and its nested jaxprs (jit, shard_map ...), not looking inside Pallas kernels."""
    for e in jaxpr.eqns:
        yield e.primitive.name
        if e.primitive.name == "pallas_call":
            continue
        for p in e.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                yield from _calls_outside_kernels(inner)


@pytest.mark.parametrize("tie", [False, True])
def test_share_moe_through_the_fused_kernel_keeps_the_busiest_devices_experts(tie):
    """A share's INT4 MoE layer with expert_impl 'interpret' (the busiest device chosen and the ids shifted
    inside the metadata kernel, no XLA work for it) gives bit for bit (float32) the explicit computation
    busiest_share + moe_int4 + the shared expert slice, and the 'gather' layer (busiest_share in XLA) to
    float32 rounding. `tie`: a router bias that sends every token to two experts of device 1 and two of
    device 3, so the two tie and device 1 (the lower) must be the one run."""
    from jaxspec import quant
    from jaxspec.config import Int4Format
    from jaxspec.kernels import int4_moe
    from jaxspec.layers import swiglu
    from jaxspec.model import route_tokens, router_logits

    share, tokens = 4, 5
    cfg = _cfg(share=share, hidden_size=256, moe_intermediate_size=256, expert_format=Int4Format(32))
    local, D = cfg.local_experts, cfg.hidden_size
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(1, tokens, D)), jnp.float32)
    rows = _unbox(MoE(cfg, jnp.float32, expert_impl="gather").init(jax.random.key(int(rng.integers(1 << 30))), x))
    rows = rows["params"]
    if tie:  # experts 4, 5 (device 1) and 12, 13 (device 3) for every token
        rows["router_bias"] = jnp.zeros((cfg.num_experts,), jnp.float32).at[jnp.asarray([4, 5, 12, 13])].set(10.0)
    tiles = {**rows, **int4_moe.relayout({n: rows[n] for n in int4_moe.PROJECTIONS})}
    kernel_layer = MoE(cfg, jnp.float32, expert_impl="interpret", expert_layout=quant.TILES)
    got = np.asarray(jax.jit(lambda p, x: kernel_layer.apply({"params": p}, x))(tiles, x))

    @jax.jit
    def explicit(p, x):
        x_TD = x.reshape(tokens, D)
        experts, weights, _ = route_tokens(router_logits(x_TD, p["router"]), p["router_bias"], cfg, "interpret")
        ids = busiest_share(experts, local, share)
        ops = {n: p[n] for n in int4_moe.PROJECTIONS}
        y = int4_moe.moe_int4(x_TD, ids, weights, ops, num_local=local, interpret=True)
        shared = {n: p["shared"][n]["kernel"] for n in ("gate", "up", "down")}
        return (y + swiglu(x_TD, shared)).reshape(x.shape), experts, ids

    want, experts, ids = map(np.asarray, explicit(tiles, x))
    if tie:  # device 1's experts 4, 5 are local 0, 1; device 3's, 12 and 13, fall outside
        assert (np.sort(experts, axis=1) == [4, 5, 12, 13]).all(), experts
        np.testing.assert_array_equal(ids, experts - local)
    assert np.array_equal(got, want), float(np.abs(got - want).max())
    portable = np.asarray(MoE(cfg, jnp.float32, expert_impl="gather").apply({"params": rows}, x))
    assert np.linalg.norm(got - portable) <= 1e-5 * np.linalg.norm(portable), float(np.abs(got - portable).max())

    def prims(layer, params):
        return set(_calls_outside_kernels(jax.make_jaxpr(lambda p, x: layer.apply({"params": p}, x))(params, x).jaxpr))

    assert "pallas_call" in prims(kernel_layer, tiles) and not {"scatter-add", "argmax"} & prims(kernel_layer, tiles)
    assert {"scatter-add", "argmax"} <= prims(MoE(cfg, jnp.float32, expert_impl="gather"), rows)  # busiest_share


def test_kernel_config_flag_sets_a_kernels_defaults_and_names_what_is_wrong(monkeypatch):
    """`--kernel-config MODULE=JSON` (`scripts/share_model.apply_kernel_configs`, used by profile_layer.py and
    bench_spec.py): the module's DEFAULT_CONFIG takes the keys (JSON lists as the tuples the kernels hash),
    and a bad module, JSON text or key stops the run with a message naming the flag."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import share_model

    from jaxspec.kernels import block_routing, int4_moe, latent_write, rms_norm, routing, stacked_matmul

    for mod in (stacked_matmul, int4_moe, block_routing, latent_write, rms_norm, routing):  # on copies, restored after
        monkeypatch.setattr(mod, "DEFAULT_CONFIG", dict(mod.DEFAULT_CONFIG))
    before = dict(stacked_matmul.DEFAULT_CONFIG)
    applied = share_model.apply_kernel_configs(
        ['stacked_matmul={"bk": 32, "stages": 3}', 'int4_moe={"gu_programs": [[4, 2], [64, 1]]}']
    )
    assert applied == {"stacked_matmul": {"bk": 32, "stages": 3}, "int4_moe": {"gu_programs": [[4, 2], [64, 1]]}}
    assert stacked_matmul.DEFAULT_CONFIG == {**before, "bk": 32, "stages": 3}
    assert int4_moe.DEFAULT_CONFIG["gu_programs"] == ((4, 2), (64, 1))
    assert stacked_matmul._config(None)["bk"] == 32  # what a call without its own config now uses
    # the fusions' A/B switches (read by the model when it traces)
    assert latent_write.DEFAULT_CONFIG["query"] and not rms_norm.DEFAULT_CONFIG["moe_add"]
    applied = share_model.apply_kernel_configs(['latent_write={"query": false}', 'rms_norm={"moe_add": true}'])
    assert applied == {"latent_write": {"query": False}, "rms_norm": {"moe_add": True}}
    assert not latent_write.DEFAULT_CONFIG["query"] and rms_norm.DEFAULT_CONFIG["moe_add"]
    assert share_model.apply_kernel_configs(['routing={"fused_max_tokens": 0}']) == {"routing": {"fused_max_tokens": 0}}
    assert routing.DEFAULT_CONFIG["fused_max_tokens"] == 0  # the routing and metadata launches kept apart
    assert share_model.apply_kernel_configs(['block_routing={"chunk": 256, "warps": 8}']) == {
        "block_routing": {"chunk": 256, "warps": 8}
    }
    assert block_routing.DEFAULT_CONFIG == {"chunk": 256, "warps": 8}  # the metadata program's shape
    for bad, message in (
        ('grouped_matmul={"warps": 2}', "expected MODULE=JSON, MODULE one of"),  # a kernel module without one
        ("stacked_matmul", "expected MODULE=JSON"),
        ("stacked_matmul={bk: 32}", "stacked_matmul: expected a JSON object"),
        ("absorb=[1, 2]", "absorb: expected a JSON object"),
        ('mla_attention={"block": 64}', "mla_attention: unknown keys ['block']; known: "),
    ):
        with pytest.raises(SystemExit, match=r"--kernel-config") as info:
            share_model.apply_kernel_configs([bad])
        assert message in str(info.value), (bad, str(info.value))
    # A configuration the kernel's probe refuses on the device stops the run (the sweep would time another path);
    # one it takes passes. On the CPU backend the check is off unless asked for.
    monkeypatch.setattr(int4_moe, "available", lambda: "the probe call failed: ValueError: config['gu_ksplit']")
    assert share_model.apply_kernel_configs(['int4_moe={"gu_ksplit": 4}']) == {"int4_moe": {"gu_ksplit": 4}}
    with pytest.raises(SystemExit, match=r"--kernel-config int4_moe: the kernel cannot run with") as info:
        share_model.apply_kernel_configs(['int4_moe={"gu_ksplit": 4}'], check=True)
    assert "would time another path: the probe call failed: ValueError" in str(info.value)
    monkeypatch.setattr(int4_moe, "available", lambda: None)
    assert share_model.apply_kernel_configs(['int4_moe={"gu_ksplit": 4}'], check=True) == {"int4_moe": {"gu_ksplit": 4}}


def test_profile_layer_sets_its_hlo_dump_before_the_kernel_configurations_start_the_backend(monkeypatch):
    """`profile_layer.py --kernel-config ...`: on a GPU, applying the configurations runs their probes, which start
    XLA's backend; the loop's HLO dump (what attributes the trace's ops to the layers) must be set before that, or
    every configured profile comes back unattributed. The order is dump, then configurations."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import profile_layer
    import share_model

    from jaxspec import profile_report

    order = []
    monkeypatch.setattr(profile_report, "dump_hlo", lambda d: order.append("dump") or True)

    def apply(pairs):
        order.append("configs")
        raise SystemExit("stop here")

    monkeypatch.setattr(share_model, "apply_kernel_configs", apply)
    with pytest.raises(SystemExit, match="stop here"):
        profile_layer.main(["--kernel-config", 'int4_moe={"gu_ksplit": 4}'])
    assert order == ["dump", "configs"]


def test_a_share_too_large_for_the_device_stops_before_allocating_with_the_bytes_and_the_limit(monkeypatch):
    """`scripts/share_model.check_fits`: the Kimi-K2.5 share of 8 at full depth (its parameters from the abstract
    shapes, as `share_params` counts them) is refused on a device whose allocation limit is below them (an 80 GB
    card at JAX's default fraction) with the share, the bytes, the limit and the remedy named; it passes on a
    larger limit and on devices without memory stats (the CPU)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import share_model

    from jaxspec import quant
    from jaxspec.model import abstract_params

    _, cfg = share_model.share_config("kimi-k2.5", 8, None)
    shapes, _ = abstract_params(cfg, jnp.bfloat16, quant.TILES)
    need = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(shapes))
    assert 60e9 < need < 90e9, need  # the routed experts' INT4 words and scales dominate

    class Device:
        device_kind = "NVIDIA H100 80GB HBM3"

        def __init__(self, limit):
            self.limit = limit

        def memory_stats(self):
            return None if self.limit is None else {"bytes_limit": self.limit, "bytes_in_use": 0}

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    with pytest.raises(SystemExit) as info:
        share_model.check_fits(need, cfg, Device(int(0.75 * 85e9)))
    message = str(info.value)
    for part in ("--share 8 at 61 layers", f"{need / 1e9:.1f} GB", "63.8 GB", "H100", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        assert part in message, (part, message)
    share_model.check_fits(need, cfg, Device(int(140e9)))  # an H200's limit: no exit
    share_model.check_fits(need, cfg, Device(None))
    share_model.check_fits(need, cfg, jax.devices()[0])  # the CPU: no stats, not checked
