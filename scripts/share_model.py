"""One device's exact share of an N-way Kimi-K2.5 mesh, on one device (`bench_spec.py --share N`).

What one of N devices computes per decode step or verify, at full depth:

* attention heads, vocab (embedding rows and lm_head), the dense MLP and the shared
  expert split N ways (the sizes are divided here; `ModelConfig.share` slices the
  shared expert);
* routed experts N-way expert-parallel: the router draws top-8 of all 384 experts and
  the program holds 384 / N of them, those of the device that receives the most
  assignments in each call (the one that sets the pace on a real mesh; see
  `model.busiest_share`);
* the EAGLE-3 draft whole (replicated: every device runs it).

Weights are random; one MoE layer is drawn and broadcast to every stacked layer (the
bytes read per step are the same; L2 holds far less than one layer). What it does not
include is the collectives: `predict_mesh` adds them from the collective count of the
compiled N-way program (`scripts/collectives.py` on N fake CPU devices) times a cost
per all-reduce.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


KERNEL_MODULES = (
    "stacked_matmul",
    "absorb",
    "mla_attention",
    "int4_moe",
    "block_routing",
    "latent_write",
    "rms_norm",
    "routing",
)
"""The kernels whose tiles `--kernel-config` may set (each module's ``DEFAULT_CONFIG``)."""


def add_kernel_config_flag(parser) -> None:
    """``--kernel-config MODULE=JSON ...`` on a benchmark's parser (`apply_kernel_configs` applies it)."""
    parser.add_argument(
        "--kernel-config",
        nargs="*",
        default=[],
        metavar="MODULE=JSON",
        help=f"set keys of a kernel's DEFAULT_CONFIG for this run ({', '.join(KERNEL_MODULES)}), "
        "e.g. stacked_matmul='{\"bk\": 64}'",
    )


def apply_kernel_configs(pairs, check: bool | None = None) -> dict:
    """``--kernel-config MODULE=JSON ...``: updates ``jaxspec.kernels.MODULE.DEFAULT_CONFIG`` in this process, for
    timing sweeps on a device (`profile_layer.py`, `bench_spec.py`). A kernel's configuration is part of its
    numerics; each kernel's probe runs the new default on the device before the model uses it. A configuration
    its probe refuses would leave the kernel unused and the sweep timing another path, so with ``check`` (default:
    on a GPU backend) each module set is asked for its ``available()`` now, and a refusal stops the run; that starts
    the backend, so a script that sets XLA flags (`profile_layer.py`'s HLO dump) calls this after them. Returns
    {module: the keys set}; exits with a message naming the flag on a bad module, JSON or key, or a refusal."""
    import importlib

    applied = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in KERNEL_MODULES:
            raise SystemExit(
                f"error: --kernel-config: expected MODULE=JSON, MODULE one of {KERNEL_MODULES}; found {pair!r}"
            )
        try:
            over = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"error: --kernel-config {name}: expected a JSON object, found {text!r} ({exc})") from None
        if not isinstance(over, dict):
            raise SystemExit(f"error: --kernel-config {name}: expected a JSON object, found {text!r}")
        defaults = importlib.import_module(f"jaxspec.kernels.{name}").DEFAULT_CONFIG
        unknown = sorted(set(over) - set(defaults))
        if unknown:
            raise SystemExit(f"error: --kernel-config {name}: unknown keys {unknown}; known: {sorted(defaults)}")
        for key, value in over.items():  # JSON lists (int4_moe's gu_programs pairs) as the tuples the kernels hash
            defaults[key] = (
                tuple(tuple(v) if isinstance(v, list) else v for v in value) if isinstance(value, list) else value
            )
        applied.setdefault(name, {}).update(over)
    if check is None:
        import jax

        check = jax.default_backend() == "gpu"
    for name in applied if check else ():
        why = importlib.import_module(f"jaxspec.kernels.{name}").available()
        if why is not None:
            raise SystemExit(
                f"error: --kernel-config {name}: the kernel cannot run with {applied[name]} here, so the run "
                f"would time another path: {why}"
            )
    return applied


def share_config(preset_name: str, n: int, layers: int | None, overrides=()):
    """(the unsplit config, one device's share of it); overrides: "FIELD=VALUE" strings."""
    from jaxspec.config import preset

    full = preset(preset_name, max_position_embeddings=1 << 20)
    if layers:
        full = full.replace(num_layers=layers)
    kv = dict(o.split("=", 1) for o in overrides)
    full = full.replace(**{k: type(getattr(full, k))(v) for k, v in kv.items()})
    for name in ("num_heads", "vocab_size", "intermediate_size"):
        if getattr(full, name) % n:
            raise SystemExit(f"error: --share {n}: {name}={getattr(full, name)} is not divisible by {n}")
    return full, full.replace(
        num_heads=full.num_heads // n,
        vocab_size=full.vocab_size // n,
        intermediate_size=full.intermediate_size // n,
        share=n,
    )


def check_fits(need: int, cfg, device) -> None:
    """Exits with a message naming the share, the bytes and the limit when the share's parameters (``need``
    bytes) exceed what JAX may allocate on ``device`` (its ``bytes_limit``; devices without memory stats, the
    CPU, are not checked), rather than failing later on one of the stacked leaves."""
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit is None or need <= limit:
        return
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "unset: 0.75")
    raise SystemExit(
        f"error: --share {cfg.share} at {cfg.num_layers} layers: the parameters take {need / 1e9:.1f} GB, more than "
        f"the {limit / 1e9:.1f} GB JAX may allocate on {device.device_kind} (XLA_PYTHON_CLIENT_MEM_FRACTION "
        f"{fraction}); raise XLA_PYTHON_CLIENT_MEM_FRACTION (up to ~0.98) or pass --layers with fewer layers"
    )


def share_params(cfg, dtype, layout: str, key=None):
    """Full-depth parameters built from one drawn MoE layer, on the default device (INT4 experts
    in `layout`)."""
    from jaxspec import checkpoint, quant
    from jaxspec.model import STACK, abstract_params, init_params, to_kernel_layout

    key = jax.random.key(0) if key is None else key
    one = cfg.replace(num_layers=cfg.first_k_dense_replace + 1)
    small = init_params(one, key, dtype)
    if layout == quant.TILES:
        small = jax.jit(lambda p: to_kernel_layout(one, p), donate_argnums=0)(small)
    shapes, _ = abstract_params(cfg, dtype, layout)
    check_fits(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(shapes)), cfg, jax.devices()[0])
    out = {k: v for k, v in small.items() if k != STACK}
    src = checkpoint.flatten(small[STACK])
    stacked = {}
    for path, leaf in checkpoint.flatten(shapes[STACK]).items():
        stacked[path] = jax.jit(lambda a, s=leaf.shape: jnp.broadcast_to(a, s))(src[path])
        jax.block_until_ready(stacked[path])
    out[STACK] = checkpoint.unflatten(stacked, shapes[STACK])
    del small
    return out


def share_engine(args):
    """An Engine over the share (random weights) with a Kimi-EAGLE-3-sized replicated draft."""
    from jaxspec.engine import Engine
    from jaxspec.model import expert_layout

    full, cfg = share_config(args.preset, args.share, args.layers, args.set)
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    impl = args.expert_impl[0]
    params = share_params(cfg, dtype, expert_layout(cfg, impl))
    dense = getattr(args, "dense_impl", [None])[0]
    attn = getattr(args, "attention_impl", [None])[0]
    engine = Engine(
        cfg,
        params,
        None,
        "bfloat16" if dtype == jnp.bfloat16 else "float32",
        expert_impl=impl,
        dense_impl=dense,
        attention_impl=attn,
    )
    L = cfg.num_layers
    aux = (1, L // 2, L - 4) if L > 4 else (0, L // 2, L - 2)
    # The share's vocab is 1/N of the target's: draft tokens map into it (timing only).
    engine.draft = random_draft(args, cfg.hidden_size, full.vocab_size, cfg.vocab_size, aux, 50000.0, dtype)
    return full, engine


def random_draft(
    args, hidden: int, vocab: int, target_vocab: int, aux, rope_theta: float, dtype, source="random draft"
):
    """A random-weight EAGLE-3 draft of the `--draft-*` sizes over a `hidden`-wide target, its draft
    vocab mapped onto random ids below `target_vocab` (distinct where there are enough)."""
    from jaxspec import spec as S
    from jaxspec.draft import DraftConfig
    from jaxspec.draft import init_params as draft_init

    dv = args.draft_vocab
    dcfg = DraftConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "hidden_size": hidden,
            "num_attention_heads": args.draft_heads,
            "num_key_value_heads": args.draft_kv_heads,
            "head_dim": hidden // args.draft_heads,
            "intermediate_size": args.draft_intermediate,
            "vocab_size": vocab,
            "draft_vocab_size": dv,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 1 << 20,
            "rope_theta": rope_theta,
            "num_hidden_layers": 1,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux)},
        },
        source=source,
    )
    keep = np.sort(np.random.default_rng(0).choice(target_vocab, dv, replace=dv > target_vocab))
    d2t = jnp.asarray(keep - np.arange(dv), jnp.int32)
    return S.Draft(draft_init(dcfg, jax.random.key(1), dtype), d2t, dcfg, tuple(aux))


def expected_touched(tokens: int, cfg, samples: int = 400, seed: int = 0) -> float:
    """Mean experts the busiest device holds that a call of `tokens` tokens touches (uniform top-k routing)."""
    rng = np.random.default_rng(seed)
    E, k, local = cfg.num_experts, cfg.num_experts_per_tok, cfg.local_experts
    total = 0
    for _ in range(samples):
        ex = np.argsort(rng.random((tokens, E)), axis=1)[:, :k]
        dev = np.bincount((ex // local).ravel(), minlength=cfg.share).argmax()
        mine = ex[(ex // local) == dev]
        total += len(np.unique(mine))
    return total / samples


def step_bytes(engine, tokens_per_row: int, batch: int, context: int) -> dict:
    """Bytes one device must read for a target forward over batch x tokens_per_row tokens."""
    from jaxspec import checkpoint
    from jaxspec.model import routed_expert_path

    cfg = engine.cfg
    flat = checkpoint.flatten(engine.params).items()
    routed = sum(v.nbytes for p, v in flat if routed_expert_path(p))
    embed = engine.params["embed"]["embedding"]
    dense = sum(v.nbytes for p, v in flat if not routed_expert_path(p)) - embed.nbytes
    dense += batch * tokens_per_row * embed.shape[1] * embed.dtype.itemsize
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    per_expert = routed / (moe_layers * cfg.local_experts)
    touched = expected_touched(batch * tokens_per_row, cfg)
    cache = cfg.num_layers * batch * context * cfg.latent_dim * embed.dtype.itemsize
    experts = touched * moe_layers * per_expert
    return {
        "weights": dense,
        "experts": experts,
        "cache": cache,
        "touched_per_layer": touched,
        "total": dense + experts + cache,
    }


def start_collective_count(full_cfg, n: int, batch: int, spec: str):
    """Starts `scripts/collectives.py` on n fake CPU devices for the unsplit config (abstract weights)."""
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={n}",
        CUDA_VISIBLE_DEVICES="",
    )
    cmd = [
        sys.executable,
        os.path.join(HERE, "collectives.py"),
        "--kimi-layers",
        str(full_cfg.num_layers),
        "--num-devices",
        str(n),
        "--placement",
        "replicated",
        "--batch",
        str(batch),
        "--config",
        spec,
        "--json",
        out,
    ]
    log = open(out + ".log", "w")  # noqa: SIM115 - closed in finish_collective_count
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), out, log


def finish_collective_count(handle, timeout: float = 900) -> dict | None:
    proc, out, log = handle
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = None
    log.close()
    if rc != 0:
        with open(out + ".log") as f:
            print(f"collective count failed (rc {rc}):\n{f.read()[-3000:]}", file=sys.stderr)
        return None
    with open(out) as f:
        table = json.load(f)["replicated"]["table"]
    return {phase: sum(v["count"] for v in kinds.values()) for phase, kinds in table.items()}


def predict_mesh(row_plain: dict, row_spec: dict, batch: int, counts: dict | None, allreduce_us: float, accepts):
    """tok/s one device and predicted on the N-GPU mesh (collectives at allreduce_us each)."""
    step, cycle = row_plain["ms_per_step"], row_spec["ms_per_cycle"]
    out = {
        "break_even": cycle / step,
        "plain_tok_s": batch / step * 1e3,
        **{f"spec_tok_s@{a}": batch * a / cycle * 1e3 for a in accepts},
    }
    if counts is not None:
        step_n = step + counts["decode"] * allreduce_us * 1e-3
        cycle_n = cycle + counts["cycle"] * allreduce_us * 1e-3
        out.update(
            {
                "collectives_step": counts["decode"],
                "collectives_cycle": counts["cycle"],
                "mesh_plain_tok_s": batch / step_n * 1e3,
                **{f"mesh_spec_tok_s@{a}": batch * a / cycle_n * 1e3 for a in accepts},
                "mesh_break_even": cycle_n / step_n,
            }
        )
    return out
