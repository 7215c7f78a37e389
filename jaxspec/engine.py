"""Engine: a loaded target (and optional EAGLE-3 draft) on a device mesh, plus generation.

    engine = Engine.load("ckpt/")                      # params placed on all devices
    engine.target_logits([1, 2, 3])                    # np.ndarray [3, vocab]
    results = engine.generate(["def f(x):"], max_new_tokens=64)
    results[0].tokens, results[0].text, results[0].stats

    session = engine.prepare(["def f(x):"], 64, spec=SpecConfig())  # caches placed, prompts prefilled
    while not session.done:
        session.run(4)                                 # up to 4 more loop iterations, one compiled call
    session.tokens(), session.state                    # per-row tokens; the loop state (a pytree)

The engine is the only layer that touches files and the host clock; the model,
the decode loop and the speculative loop below it are pure functions.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxspec import checkpoint, decode, distributed, loop, quant, sharding
from jaxspec import spec as spec_loop
from jaxspec.cli import UsageError
from jaxspec.config import ModelConfig, from_dict
from jaxspec.draft import (
    DraftCache,
    DraftConfig,
    aux_layer_ids,
    draft_extend_logits,
    init_draft_cache,
    param_axes,
    step_param_bytes,
    validate_pair,
)
from jaxspec.draft import init_params as draft_init_params
from jaxspec.dtypes import DTYPES
from jaxspec.dtypes import parse as parse_dtype
from jaxspec.model import (
    STACK,
    LatentCache,
    Transformer,
    abstract_params,
    choose_attention_impl,
    choose_dense_impl,
    expert_layout,
    holds_rows_int4,
    init_cache,
    stack_layers,
    stacked_range,
    to_kernel_layout,
)
from jaxspec.sampling import SamplingParams
from jaxspec.sharding import DRAFT_CACHE_BSHK, LATENT_CACHE_LBSC, make_mesh, param_shardings, replicated
from jaxspec.spec import SpecConfig

log = logging.getLogger("jaxspec")
if not log.handlers:  # one plain line on stderr, whatever the application's logging setup
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    log.addHandler(_handler)
    log.propagate = False

# Loop iterations per chunk when streaming (`generate(on_tokens=...)`): decode steps or speculative cycles.
STREAM_STEPS = {"plain": 16, "speculative": 4}
# Prompts longer than this are prefilled in chunks of this many tokens (attention scores,
# logits and expert assignments held at once scale with the chunk, not the prompt).
DEFAULT_PREFILL_CHUNK = 512


class ContextLengthError(UsageError):
    """A prompt plus its generation that needs more positions than the model has."""


class DeviceMemoryError(UsageError):
    """A model whose parameters would not fit in the memory JAX may allocate on each device."""


def default_dtype() -> str:
    """bf16 on accelerators; fp32 on CPU, where bf16 matmuls are slow and parity tests need fp32."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]
    text: str | None
    stats: dict


class Engine:
    def __init__(
        self,
        cfg: ModelConfig,
        params,
        tokenizer=None,
        dtype: str = "float32",
        mesh=None,
        draft=None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        rules: sharding.Rules = sharding.RULES,
        expert_impl: str | None = None,
        dense_impl: str | None = None,
        attention_impl: str | None = None,
    ):
        """params: the model's tree (stacked layers) or the checkpoint's (one subtree per layer).
        expert_impl: None chooses per MoE call (`model.choose_expert_impl`: the fused INT4 kernel
        where it runs); one of `model.EXPERT_IMPLS` forces that path everywhere ('kernel', the
        portable 'gather', grouped 'xla' / 'tokamax', 'interpret' for CPU tests). INT4 experts
        in the checkpoint layout are re-laid out for the kernel here when it is used
        (`Engine.load` does it layer by layer while loading). dense_impl: how the stacked layers'
        dense kernels are read (`model.choose_dense_impl`; None: in place by the Pallas kernel on a
        GPU, sliced elsewhere; 'kernel', 'interpret' or 'slice' forces one). attention_impl: how attention
        reads the latent cache (`model.ATTENTION_IMPLS`; None: the Pallas kernel where it runs, a GPU,
        else XLA's einsums and softmax; 'xla', 'kernel' or 'interpret' forces one)."""
        self.cfg = cfg
        params = stack_layers(cfg, params)  # a tree in the checkpoint's one-leaf-per-layer layout works too
        self.expert_impl = expert_impl
        self.expert_layout = expert_layout(cfg, expert_impl)
        if self.expert_layout == quant.TILES and any(
            isinstance(v, dict) and "moe" in v and holds_rows_int4(v["moe"]) for v in params.values()
        ):
            params = jax.jit(functools.partial(to_kernel_layout, cfg))(params)
        self.params = params
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.mesh = mesh
        self.rules = rules
        self.model = Transformer(
            cfg,
            parse_dtype(dtype),
            mesh=mesh if mesh is not None and mesh.size > 1 else None,
            rules=rules,
            expert_impl=expert_impl,
            expert_layout=self.expert_layout,
            dense_impl=dense_impl,
            attention_impl=attention_impl,
        )
        self.dense_impl = choose_dense_impl(dense_impl)
        self.attention_impl = choose_attention_impl(attention_impl, self.model.dtype)
        self.draft = draft
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0 = whole prompt at once), found {prefill_chunk}")
        self.prefill_chunk = prefill_chunk

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        path: str,
        dtype: str | None = None,
        num_devices: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        draft_placement: str = "replicated",
        rules: sharding.Rules | None = None,
        expert_impl: str | None = None,
        dense_impl: str | None = None,
        attention_impl: str | None = None,
    ) -> Engine:
        """Load a converted checkpoint onto a (data=1, model=N) mesh.

        num_devices: None uses the largest device count that divides every dimension the
        sharding table splits (heads, experts, vocab, MLP widths; the draft's too when it is
        sharded) and says so when that is fewer than all devices; an explicit count that
        does not divide one of them is an error naming it. draft_placement: 'replicated'
        (every device runs the whole draft, no collectives) or 'sharded' (the draft's heads,
        MLP and vocab split over the mesh like the target's, as SGLang runs it). rules: the
        logical-to-mesh table (default `sharding.RULES`); another table is another sharding.
        """
        payload = checkpoint.read_config(path)
        cfg = from_dict(payload["target"])
        dtype = dtype or default_dtype()
        parse_dtype(dtype)  # a clear error before anything is read
        rules = sharding.rules_for(draft_placement, sharding.RULES if rules is None else rules)
        dcfg = DraftConfig.from_dict(payload["draft"]) if "draft" in payload else None
        mesh = mesh_for(cfg, dcfg, rules, num_devices)
        check_fits(path, cfg, dcfg, DTYPES[dtype], mesh, rules, expert_layout(cfg, expert_impl), draft_placement)
        params = load_target_params(path, cfg, DTYPES[dtype], mesh, rules, expert_layout(cfg, expert_impl))
        tokenizer = None
        if os.path.exists(os.path.join(path, "tiktoken.model")):
            from jaxspec.tokenizer import KimiTokenizer

            tokenizer = KimiTokenizer.from_dir(path)
        engine = cls(
            cfg,
            params,
            tokenizer,
            dtype,
            mesh,
            None,
            prefill_chunk,
            rules,
            expert_impl,
            dense_impl,
            attention_impl,
        )
        if dcfg is not None:
            engine.draft = load_draft(path, payload["draft"], engine, draft_placement)
        engine.path = path  # where `spec="auto"` finds DIR/spec_config.json (jaxspec.tune)
        return engine

    @classmethod
    def abstract(
        cls,
        cfg: ModelConfig,
        draft_cfg: DraftConfig | None = None,
        dtype: str = "bfloat16",
        num_devices: int | None = None,
        draft_placement: str = "replicated",
    ) -> Engine:
        """An engine over abstract parameters (ShapeDtypeStructs with their shardings): for
        compiling and inspecting programs at sizes that are never allocated."""
        rules = sharding.rules_for(draft_placement)
        mesh = mesh_for(cfg, draft_cfg, rules, num_devices)
        shapes, specs = abstract_params(cfg, DTYPES[dtype], expert_layout(cfg))
        params = _with_shardings(shapes, param_shardings(specs, mesh, rules))
        engine = cls(cfg, params, None, dtype, mesh, None, DEFAULT_PREFILL_CHUNK, rules)
        if draft_cfg is not None:
            dshapes = jax.eval_shape(lambda: draft_init_params(draft_cfg, jax.random.key(0), DTYPES[dtype]))
            d2t = jax.ShapeDtypeStruct((draft_cfg.draft_vocab_size,), jnp.int32)
            engine.draft = engine.attach_draft(
                dshapes, d2t, draft_cfg, tuple(aux_layer_ids(draft_cfg, cfg.num_layers)), draft_placement
            )
        return engine

    def attach_draft(self, params, d2t, draft_cfg: DraftConfig, aux_ids, placement: str = "replicated"):
        """A `spec.Draft` for this engine's mesh: weights placed for `placement` (arrays are moved,
        ShapeDtypeStructs get the shardings), with a replicated copy of the target's token
        embeddings when the draft is replicated over several devices."""
        rules = sharding.rules_for(placement, self.rules)
        mesh = self.mesh
        if mesh is None or mesh.size == 1:
            return spec_loop.Draft(params, d2t, draft_cfg, tuple(aux_ids), None, placement, None)
        spec = lambda axes: sharding.named(mesh, axes, rules)
        shardings = jax.tree.map(spec, param_axes(params), is_leaf=lambda x: isinstance(x, tuple))
        params, d2t = _place(params, shardings), _place(d2t, replicated(mesh))
        embed = None
        if placement == "replicated":
            # Kimi-K2.5: 163840 x 7168 bf16 = 2.35 GB more per device, the price of a draft without collectives.
            embed = _place(self.params["embed"]["embedding"], replicated(mesh))
        return spec_loop.Draft(params, d2t, draft_cfg, tuple(aux_ids), embed, placement, mesh)

    def draft_bytes_per_device(self, placement: str | None = None) -> int:
        """Draft weight bytes one device reads per draft step under `placement` (default: the draft's own)."""
        placement = placement or self.draft.placement
        n = self.mesh.shape[sharding.MODEL] if self.mesh is not None else 1
        rules = sharding.rules_for(placement, self.rules)
        split = {name: n for name, axis in rules if axis == sharding.MODEL and name.startswith("draft_")}
        return step_param_bytes(self.draft.params, split)

    # ------------------------------------------------------------------ scoring
    def target_logits(self, ids: Sequence[int]) -> np.ndarray:
        """Full forward over `ids` (no cache reuse): logits [len(ids), vocab] as float32."""
        ids = np.asarray(ids, np.int32)
        T = len(ids)
        S = round_up(T, 16)
        tokens = np.zeros((1, S), np.int32)
        tokens[0, :T] = ids
        logits = _full_forward(self.model, self.params, jnp.asarray(tokens), self.init_cache(1, S))
        return distributed.to_host(logits[0, :T])  # vocab-sharded: gathered when the mesh spans processes

    def init_cache(self, batch: int, max_len: int) -> LatentCache:
        """An empty target cache of `max_len` slots per row, placed on the mesh."""
        return self._placed(init_cache(self.cfg, batch, max_len, DTYPES[self.dtype]))

    def init_draft_cache(self, batch: int, max_len: int) -> DraftCache:
        """An empty draft cache of `max_len` slots per row, placed on the mesh."""
        return self._placed(init_draft_cache(self.draft.cfg, batch, max_len, DTYPES[self.dtype]))

    def _placed(self, tree):
        if self.mesh is None:
            return tree
        return jax.tree.map(jax.device_put, tree, self.state_shardings(tree))

    # ------------------------------------------------------------------ placement
    def replicated_sharding(self):
        return replicated(self.mesh) if self.mesh is not None else None

    def abstract_cache(self, batch: int, max_len: int):
        shapes = jax.eval_shape(lambda: init_cache(self.cfg, batch, max_len, DTYPES[self.dtype]))
        return self.place_state(shapes)

    def abstract_draft_cache(self, batch: int, max_len: int):
        shapes = jax.eval_shape(lambda: init_draft_cache(self.draft.cfg, batch, max_len, DTYPES[self.dtype]))
        return self.place_state(shapes)

    def state_shardings(self, tree):
        """Shardings of a loop-state tree: caches as the table places them, everything else replicated."""
        rules = self.rules if self.draft is None else sharding.rules_for(self.draft.placement, self.rules)

        def place(node):
            if isinstance(node, LatentCache):
                return jax.tree.map(lambda _: sharding.named(self.mesh, LATENT_CACHE_LBSC, rules), node)
            if isinstance(node, DraftCache):
                return jax.tree.map(lambda _: sharding.named(self.mesh, DRAFT_CACHE_BSHK, rules), node)
            return replicated(self.mesh)

        return jax.tree.map(place, tree, is_leaf=lambda x: isinstance(x, (LatentCache, DraftCache)))

    def place_state(self, tree):
        """Abstract loop state (ShapeDtypeStructs) with the shardings the engine gives it."""
        if self.mesh is None:
            return tree
        return _with_shardings(tree, self.state_shardings(tree))

    # ------------------------------------------------------------------ generation
    def encode_prompts(self, prompts) -> list[list[int]]:
        out = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("this checkpoint has no tokenizer; pass token id lists")
                out.append(self.tokenizer.encode(p))
            else:
                out.append([int(t) for t in p])
            if not out[-1]:
                raise ValueError("empty prompt")
        return out

    def stop_ids(self) -> np.ndarray:
        ids = set(self.tokenizer.stop_ids()) if self.tokenizer is not None else set()
        if self.cfg.eos_token_id is not None:
            ids.add(int(self.cfg.eos_token_id))
        return np.array(sorted(ids) or [-1], np.int32)

    def generate(
        self,
        prompts,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        spec=None,
        on_tokens=None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (str or token ids) in one batch.

        With `spec=None` decoding is plain: one compiled while_loop. `spec="auto"` takes the setting
        `python -m jaxspec.tune` picked for this batch size (DIR/spec_config.json; without it 3/1/4) and
        says which and why in every result's `stats["spec_choice"]`. `on_tokens(list of
        per-row token lists)` is called between chunks of the loop for streaming; without
        it the whole generation runs in a single loop call.
        """
        t0 = time.perf_counter()
        session = self.prepare(prompts, max_new_tokens, temperature, top_p, top_k, seed, spec)
        steps = STREAM_STEPS[session.mode] if on_tokens is not None else max_new_tokens
        clock = _ChunkClock(t0)
        while True:
            session.run(steps)
            if on_tokens is not None:
                on_tokens(session.tokens())
            clock.chunk_done(session.state.num_out_B)
            if session.done:
                break
        return session.results(time.perf_counter() - t0, clock.stats())

    def prepare(
        self,
        prompts,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        spec=None,
        stop_ids=None,
    ) -> Session:
        """A `Session` for one batch of prompts (str or token ids): caches allocated and placed, the
        prompts prefilled and the first token of every row emitted; `Session.run` goes on from there.

        Arguments as `generate`'s; `stop_ids` (token ids) replaces the checkpoint's stop tokens
        (`stop_ids()`), e.g. `[-1]` for rows that never stop (benchmarks).
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, found {max_new_tokens}")
        sp = SamplingParams(temperature, top_k, top_p)
        ids = self.encode_prompts(prompts)
        spec_choice = None
        if isinstance(spec, str):  # "auto": the tuned setting for this batch size (jaxspec.tune), said in stats
            from jaxspec import tune

            spec, spec_choice = tune.resolve(self, spec, len(ids))
        if spec is not None and self.draft is None:
            raise ValueError("spec=SpecConfig(...) needs a checkpoint converted with --draft")
        prompt, lens, S = self.pad_prompts(ids, max_new_tokens)
        B = len(ids)
        if spec is None:
            method = decode.Plain(self.model, sp, max_new_tokens, self.prefill_chunk)
            weights, caches = self.params, self.init_cache(B, S)
        else:
            method = spec_loop.Speculative(self.model, sp, max_new_tokens, spec, self.prefill_chunk)
            S_target, S_draft = method.cache_lengths(int(lens.max()))
            if S_target > self.cfg.max_position_embeddings:
                raise ContextLengthError(
                    f"prompt + generation needs {S_target} positions; the model supports "
                    f"{self.cfg.max_position_embeddings}"
                )
            weights = (self.params, self.draft)
            caches = (self.init_cache(B, S_target), self.init_draft_cache(B, S_draft))
        stop = jnp.asarray(self.stop_ids() if stop_ids is None else np.asarray(stop_ids, np.int32))
        state = loop.start(method, weights, prompt, lens, caches, jax.random.key(seed), stop)
        return Session(self, method, weights, state, stop, spec_choice)

    def pad_prompts(self, ids: list[list[int]], max_new: int):
        """(prompts [B, P] zero-padded to a multiple of 16, lengths [B], the target cache's slot count for
        `max_new` new tokens): a ContextLengthError where they exceed the model's positions."""
        B = len(ids)
        lens = np.array([len(x) for x in ids], np.int32)
        P = round_up(int(lens.max()), 16)
        prompt = np.zeros((B, P), np.int32)
        for b, x in enumerate(ids):
            prompt[b, : len(x)] = x
        # as `decode.Plain.cache_length`, short of the shared slack at the context limit
        S = loop.cache_slots(int(lens.max()) + max_new, 1, self.cfg.max_position_embeddings)
        if S > self.cfg.max_position_embeddings:
            raise ContextLengthError(
                f"prompt + generation needs {S} positions; the model supports {self.cfg.max_position_embeddings}"
            )
        return jnp.asarray(prompt), jnp.asarray(lens), S

    def draft_logits(self, ids: Sequence[int]) -> np.ndarray:
        """The draft's extend pass over `ids`: [len(ids) - 1, draft_vocab] float32.

        Row t: draft logits from the target's aux states at position t and the
        embedding of ids[t + 1] (a prediction of ids[t + 2]), in one causal forward.
        """
        if self.draft is None:
            raise ValueError("this checkpoint has no draft (convert with --draft)")
        ids = np.asarray(ids, np.int32)
        if len(ids) < 2:
            raise ValueError("draft_logits needs at least 2 tokens")
        return distributed.to_host(_draft_logits(self.model, self.params, self.draft, jnp.asarray(ids)))

    def decode_text(self, toks: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        stop = set(self.stop_ids().tolist())
        return self.tokenizer.decode([t for t in toks if t not in stop])


class Session:
    """One batch being generated: its decoding method, the weights it runs on and the loop state.

    Made by `Engine.prepare`, which prefills the prompts and emits each row's first token;
    `run(n)` then advances the loop by up to n iterations (decode steps, or speculative
    cycles) in one compiled call, on the device, and `done` says whether every row has
    stopped. `state` is the loop carry (`decode.DecodeState` or `spec.SpecState`); `run`
    donates it, so read it after a call rather than keeping an earlier one.
    """

    def __init__(self, engine: Engine, method, weights, state, stop_ids, spec_choice: str | None = None):
        self.engine, self.method, self.weights, self.state = engine, method, weights, state
        self.stop_ids = stop_ids
        self.spec_choice = spec_choice  # why `spec="auto"` chose its setting, if it did

    @property
    def mode(self) -> str:
        """'plain' or 'speculative'."""
        return self.method.name

    @property
    def done(self) -> bool:
        """Every row has stopped (a stop token or its token budget)."""
        return bool(jnp.all(self.state.done_B))

    def run(self, max_steps) -> Session:
        """Up to `max_steps` more loop iterations (fewer once every row is done); returns the session."""
        steps = max_steps if isinstance(max_steps, jax.Array) else jnp.int32(max_steps)
        self.state = loop.run_loop(self.method, self.weights, self.state, self.stop_ids, steps)
        return self

    def tokens(self) -> list[list[int]]:
        """Each row's tokens so far."""
        return _rows(np.asarray(self.state.out_BN), np.asarray(self.state.num_out_B))

    def results(self, seconds: float, timing: dict | None = None) -> list[GenerationResult]:
        """One `GenerationResult` per row; `seconds` (and `timing`, extra stats) from the caller's clock."""
        num = np.asarray(self.state.num_out_B)
        rows = self.tokens()
        per_row = _spec_stats(self.state, self.method.spec) if self.mode == "speculative" else None
        results = []
        for b, toks in enumerate(rows):
            stats = {"new_tokens": len(toks)}
            if per_row is None:
                stats["target_forwards"] = int(self.state.steps) + 1
            else:
                stats.update(per_row[b])
            stats.update(seconds=seconds, tokens_per_second=float(num.sum()) / seconds, **(timing or {}))
            stats["mode"] = self.mode
            if per_row is not None:
                stats["spec"] = dataclasses.asdict(self.method.spec)
            if self.spec_choice is not None:
                stats["spec_choice"] = self.spec_choice
            results.append(GenerationResult(toks, self.engine.decode_text(toks), stats))
        return results


def _spec_stats(state: spec_loop.SpecState, spec: SpecConfig) -> list[dict]:
    """Per-row acceptance statistics of a speculative loop state."""
    log, row_cycles = np.asarray(state.accept_log_BC), np.asarray(state.row_cycles_B)
    out = []
    for b in range(log.shape[0]):
        per_cycle = log[b, : row_cycles[b]].tolist()
        hist = np.bincount(per_cycle, minlength=spec.num_steps + 2)[1:].tolist() if per_cycle else []
        out.append(
            {
                "cycles": int(row_cycles[b]),
                "accept_lengths": per_cycle,
                "mean_accept_len": float(np.mean(per_cycle)) if per_cycle else 0.0,
                "accept_histogram": hist,
                "target_forwards": int(row_cycles[b]) + 1,
            }
        )
    return out


class _ChunkClock:
    """Times the chunks of a generation loop, to report a rate without first-call compilation.

    The first chunk's time includes compiling the prefill and the loop (once per
    shape); the rate over the later chunks is what decoding costs once compiled.
    """

    def __init__(self, t0: float):
        self.t0 = t0
        self.first: tuple[float, int] | None = None
        self.last: tuple[float, int] | None = None

    def chunk_done(self, num_out_B) -> None:
        mark = (time.perf_counter(), int(np.asarray(num_out_B).sum()))
        if self.first is None:
            self.first = mark
        self.last = mark

    def stats(self) -> dict:
        """first_chunk_seconds (prefill + first chunk, compilation included) and, when the loop ran
        more than one chunk, compiled_tokens_per_second over the chunks after the first."""
        out = {"first_chunk_seconds": self.first[0] - self.t0}
        if self.last[0] > self.first[0] and self.last[1] > self.first[1]:
            out["compiled_tokens_per_second"] = (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])
        return out


def device_memory_limit(mesh) -> tuple[int, str] | None:
    """(the bytes JAX may allocate, the device kind) on one of this process's devices of ``mesh``, or None where
    the device reports no limit (the CPU)."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()] or jax.local_devices()
    try:
        stats = local[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None
    limit = stats.get("bytes_limit")
    return None if limit is None else (int(limit), local[0].device_kind)


def per_device_bytes(tree) -> int:
    """The bytes one device holds of a tree of ShapeDtypeStructs: each leaf's shard under its sharding (all of
    it without one). Every leaf's sharding splits it evenly (the mesh's sizes divide the split dimensions,
    `mesh_for`), so every device holds the same."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sh = getattr(leaf, "sharding", None)
        shape = sh.shard_shape(leaf.shape) if sh is not None else leaf.shape
        total += int(np.prod(shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize
    return total


def param_bytes_per_device(
    cfg: ModelConfig, dcfg: DraftConfig | None, dtype, mesh, rules: sharding.Rules, layout: str, placement: str
) -> tuple[int, int]:
    """(target, draft) parameter bytes on each device of ``mesh`` as `Engine.load` places them: the target's
    leaves on their shardings (`load_target_params`), the draft's on ``placement``'s, plus with a replicated
    draft on several devices the copy of the target's embedding each device keeps (`Engine.attach_draft`)."""
    shapes, specs = abstract_params(cfg, dtype, layout)
    target = per_device_bytes(_with_shardings(shapes, param_shardings(specs, mesh, rules)))
    if dcfg is None:
        return target, 0
    dshapes = jax.eval_shape(lambda: draft_init_params(dcfg, jax.random.key(0), dtype))
    draft = dcfg.draft_vocab_size * 4  # d2t, int32, replicated
    if mesh.size > 1:
        drules = sharding.rules_for(placement, rules)
        spec = lambda axes: sharding.named(mesh, axes, drules)  # noqa: E731
        dshapes = _with_shardings(
            dshapes, jax.tree.map(spec, param_axes(dshapes), is_leaf=lambda x: isinstance(x, tuple))
        )
        if placement == "replicated":
            draft += cfg.vocab_size * cfg.hidden_size * jnp.dtype(dtype).itemsize
    return target, draft + per_device_bytes(dshapes)


def check_fits(path: str, cfg, dcfg, dtype, mesh, rules, layout: str, placement: str) -> None:
    """Raises `DeviceMemoryError`, naming the checkpoint, the bytes a device needs and its limit, when the
    parameters alone would not fit in what JAX may allocate on each device, before anything is read (else a
    load fails part way with XLA's out-of-memory error on one leaf). The cache and the programs' buffers come
    on top; devices without memory statistics (the CPU) are not checked."""
    found = device_memory_limit(mesh)
    if found is None:
        return
    limit, kind = found
    target, draft = param_bytes_per_device(cfg, dcfg, dtype, mesh, rules, layout, placement)
    need = target + draft
    if need <= limit:
        return
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "unset, so 0.75")
    hints = ["more devices (--num-devices, or more hosts)", "a larger XLA_PYTHON_CLIENT_MEM_FRACTION (up to ~0.95)"]
    if dcfg is not None and placement == "replicated" and mesh.size > 1:
        hints.append("--draft-placement sharded")
    raise DeviceMemoryError(
        f"{path}: the parameters need {need / 1e9:.2f} GB on each of {mesh.size} device(s) (target {target / 1e9:.2f} "
        f"GB, draft {draft / 1e9:.2f} GB), more than the {limit / 1e9:.2f} GB JAX may allocate on a {kind} "
        f"(XLA_PYTHON_CLIENT_MEM_FRACTION {fraction}): expected at most {limit} bytes a device, found {need}; "
        f"use {', or '.join(hints)}"
    )


def load_draft(path: str, draft_payload: dict, engine: Engine, placement: str = "replicated") -> spec_loop.Draft:
    """Draft leaves from DIR/draft/params, placed for `placement` on the engine's mesh."""
    dcfg = DraftConfig.from_dict(draft_payload)
    dtype = DTYPES[engine.dtype]
    shapes = jax.eval_shape(lambda: draft_init_params(dcfg, jax.random.key(0), dtype))
    d2t_shape = jax.ShapeDtypeStruct((dcfg.draft_vocab_size,), jnp.int32)
    flat = checkpoint.load_leaves(path, {**shapes, "d2t": d2t_shape}, subdir="draft/params")
    d2t = flat.pop("d2t")
    validate_pair(engine.cfg, dcfg, np.asarray(d2t))
    return engine.attach_draft(flat, d2t, dcfg, aux_layer_ids(dcfg, engine.cfg.num_layers), placement)


def load_target_params(
    path: str, cfg: ModelConfig, dtype, mesh, rules: sharding.Rules, layout: str = quant.ROWS
) -> dict:
    """The target's parameters from DIR/params, each leaf placed on its sharding.

    The checkpoint holds one leaf per layer; the stacked layers are built on the
    devices one layer at a time (that layer's leaves read, its INT4 experts re-laid
    out for the kernel when `layout` is `quant.TILES`, then written in place into the
    stacked arrays), so neither host nor device ever holds a second copy of a stacked leaf.
    """
    ck_shapes, ck_specs = abstract_params(cfg, dtype)
    shapes, specs = abstract_params(cfg, dtype, layout)
    shardings, ck_shardings = param_shardings(specs, mesh, rules), param_shardings(ck_specs, mesh, rules)
    params = checkpoint.load_leaves(
        path, {k: v for k, v in ck_shapes.items() if k != STACK}, {k: v for k, v in ck_shardings.items() if k != STACK}
    )
    if STACK not in shapes:
        return params

    def one_layer(tree_shapes, tree_shardings):
        """A stacked subtree's per-layer shapes and shardings (the leading axis dropped)."""

        def sh(s, n):
            spec = tuple(s.spec) + (None,) * (n - len(s.spec))
            return NamedSharding(s.mesh, PartitionSpec(*spec[1:]))

        return (
            jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), tree_shapes),
            jax.tree.map(lambda s, x: sh(s, len(x.shape)), tree_shardings, tree_shapes),
        )

    ck_layer, ck_layer_sh = one_layer(ck_shapes[STACK], ck_shardings[STACK])
    _, layer_sh = one_layer(shapes[STACK], shardings[STACK])
    relayout = jax.jit(lambda layer: to_kernel_layout(cfg, {"x": layer})["x"], out_shardings=layer_sh)
    out_sh = checkpoint.flatten(shardings[STACK])
    bufs = {
        leaf: jax.jit(functools.partial(jnp.zeros, s.shape, s.dtype), out_shardings=out_sh[leaf])()
        for leaf, s in checkpoint.flatten(shapes[STACK]).items()
    }
    for j, i in enumerate(stacked_range(cfg)):
        name = f"layers_{i}"
        layer = checkpoint.load_leaves(path, {name: ck_layer}, {name: ck_layer_sh})[name]
        if layout == quant.TILES:
            layer = relayout(layer)
        for leaf, value in checkpoint.flatten(layer).items():
            bufs[leaf] = _set_layer(bufs[leaf], value, jnp.int32(j))
        del layer
    params[STACK] = checkpoint.unflatten(bufs, shapes[STACK])
    return params


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(buf, layer, j):
    return jax.lax.dynamic_update_index_in_dim(buf, layer.astype(buf.dtype), j, axis=0)


def mesh_for(cfg: ModelConfig, draft_cfg: DraftConfig | None, rules: sharding.Rules, num_devices: int | None):
    """The (data=1, model=N) mesh for a model: see `Engine.load` for how N is chosen."""
    dims = sharding.split_dims(cfg, draft_cfg)
    available = len(jax.devices())
    if num_devices is None:
        n = sharding.largest_divisor(dims, available, rules)
        if n < available:
            log.warning(
                "using %d of %d devices: the model's split dimensions (%s) do not all divide %d",
                n,
                available,
                _split_summary(dims, rules),
                available,
            )
    else:
        if num_devices < 1:
            raise sharding.MeshError(f"num_devices must be >= 1, found {num_devices}")
        sharding.check_divides(dims, num_devices, rules)
        n = num_devices
    return make_mesh(n)


def _split_summary(dims, rules) -> str:
    return ", ".join(
        f"{name} {'/'.join(map(str, sizes))}"
        for name, sizes in dims.items()
        if sizes and sharding.mesh_axis(name, rules) == sharding.MODEL
    )


def _with_shardings(shapes, shardings):
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def _place(tree, shardings):
    """device_put for arrays; ShapeDtypeStructs get the sharding attached instead."""

    def one(x, sh):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
        return jax.device_put(x, sh)

    if not isinstance(shardings, (dict, list, tuple)):
        return jax.tree.map(lambda x: one(x, shardings), tree)
    return jax.tree.map(one, tree, shardings)


def _rows(out: np.ndarray, num: np.ndarray) -> list[list[int]]:
    return [out[b, : num[b]].tolist() for b in range(out.shape[0])]


@functools.partial(jax.jit, static_argnames=("model",))
def _draft_logits(model, params, draft, ids_T):
    T = ids_T.shape[0]
    cache = init_cache(model.cfg, 1, T, params["embed"]["embedding"].dtype)
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    _, _, aux = decode.forward(model, params, ids_T[None], positions, cache, draft.aux_ids)
    embed = params["embed"]["embedding"]
    return draft_extend_logits(draft.params, draft.cfg, embed, aux[0], ids_T)


@functools.partial(jax.jit, static_argnames=("model",))
def _full_forward(model, params, tokens_1S, cache):
    positions = jnp.arange(tokens_1S.shape[1], dtype=jnp.int32)[None]
    logits, _, _ = decode.forward(model, params, tokens_1S, positions, cache)
    return logits
