"""Engine: a loaded target (and optional EAGLE-3 draft) on a device mesh, plus generation.

    engine = Engine.load("ckpt/")                      # params placed on all devices
    engine.target_logits([1, 2, 3])                    # np.ndarray [3, vocab]
    results = engine.generate(["def f(x):"], max_new_tokens=64)
    results[0].tokens, results[0].text, results[0].stats

The engine is the only layer that touches files and the host clock; the model,
the decode loop and the speculative loop below it are pure functions.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import checkpoint, decode
from jaxspec import spec as spec_loop
from jaxspec.draft import (DraftConfig, aux_layer_ids, draft_extend_logits, init_draft_cache, validate_pair)
from jaxspec.draft import init_params as draft_init_params
from jaxspec.spec import SpecConfig
from jaxspec.config import ModelConfig, from_dict
from jaxspec.model import Transformer, abstract_params, init_cache
from jaxspec.sampling import SamplingParams
from jaxspec.sharding import make_mesh, param_shardings, replicated

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
# Prompts longer than this are prefilled in chunks of this many tokens (attention scores,
# logits and expert assignments held at once scale with the chunk, not the prompt).
DEFAULT_PREFILL_CHUNK = 512


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
    def __init__(self, cfg: ModelConfig, params, tokenizer=None, dtype: str = "float32", mesh=None,
                 draft=None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        self.cfg = cfg
        self.params = params
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.mesh = mesh
        self.model = Transformer(cfg, DTYPES[dtype], mesh=mesh if mesh is not None and mesh.size > 1 else None)
        self.draft = draft
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0 = whole prompt at once), found {prefill_chunk}")
        self.prefill_chunk = prefill_chunk

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str, dtype: str | None = None, num_devices: int | None = None,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> "Engine":
        """Load a converted checkpoint onto a (data=1, model=N) mesh over `num_devices` devices."""
        payload = checkpoint.read_config(path)
        cfg = from_dict(payload["target"])
        dtype = dtype or default_dtype()
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}")
        mesh = make_mesh(num_devices)
        shapes, specs = abstract_params(cfg, DTYPES[dtype])
        params = checkpoint.load_leaves(path, shapes, param_shardings(specs, mesh))
        tokenizer = None
        if os.path.exists(os.path.join(path, "tiktoken.model")):
            from jaxspec.tokenizer import KimiTokenizer

            tokenizer = KimiTokenizer.from_dir(path)
        draft = load_draft(path, payload["draft"], cfg, DTYPES[dtype], mesh) if "draft" in payload else None
        return cls(cfg, params, tokenizer, dtype, mesh, draft, prefill_chunk)

    # ------------------------------------------------------------------ scoring
    def target_logits(self, ids: Sequence[int]) -> np.ndarray:
        """Full forward over `ids` (no cache reuse): logits [len(ids), vocab] as float32."""
        ids = np.asarray(ids, np.int32)
        T = len(ids)
        S = round_up(T, 16)
        tokens = np.zeros((1, S), np.int32)
        tokens[0, :T] = ids
        logits = _full_forward(self.model, self.params, jnp.asarray(tokens), self._cache(1, S))
        return np.asarray(logits[0, :T])

    def _cache(self, batch: int, max_len: int):
        cache = init_cache(self.cfg, batch, max_len, DTYPES[self.dtype])
        if self.mesh is not None:
            cache = jax.device_put(cache, replicated(self.mesh))
        return cache

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

    def generate(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, spec=None, on_tokens=None) -> list[GenerationResult]:
        """Generate for every prompt (str or token ids) in one batch.

        With `spec=None` decoding is plain: one compiled while_loop. `on_tokens(list of
        per-row token lists)` is called between chunks of the loop for streaming; without
        it the whole generation runs in a single loop call.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, found {max_new_tokens}")
        sp = SamplingParams(temperature, top_k, top_p)
        ids = self.encode_prompts(prompts)
        if spec is not None:
            if self.draft is None:
                raise ValueError("spec=SpecConfig(...) needs a checkpoint converted with --draft")
            return self._generate_spec(ids, max_new_tokens, sp, seed, spec, on_tokens)
        return self._generate_plain(ids, max_new_tokens, sp, seed, on_tokens)

    def pad_prompts(self, ids: list[list[int]], extra: int):
        B = len(ids)
        lens = np.array([len(x) for x in ids], np.int32)
        P = round_up(int(lens.max()), 16)
        prompt = np.zeros((B, P), np.int32)
        for b, x in enumerate(ids):
            prompt[b, : len(x)] = x
        S = round_up(int(lens.max()) + extra, 64)
        if S > self.cfg.max_position_embeddings:
            raise ValueError(f"prompt + generation needs {S} positions; the model supports "
                             f"{self.cfg.max_position_embeddings}")
        return jnp.asarray(prompt), jnp.asarray(lens), S

    def _generate_plain(self, ids, max_new, sp, seed, on_tokens):
        prompt, lens, S = self.pad_prompts(ids, max_new + 1)
        stop = jnp.asarray(self.stop_ids())
        t0 = time.perf_counter()
        state = decode.start(self.model, self.params, prompt, lens, self._cache(len(ids), S),
                             jax.random.key(seed), stop, sp, max_new, self.prefill_chunk)
        chunk = 16 if on_tokens is not None else max_new
        clock = _ChunkClock(t0)
        while True:
            state = decode.decode_chunk(self.model, self.params, state, stop, jnp.int32(chunk), sp)
            if on_tokens is not None:
                on_tokens(_rows(np.asarray(state.out_BN), np.asarray(state.num_out_B)))
            clock.chunk_done(state.num_out_B)
            if bool(jnp.all(state.done_B)):
                break
        out, num = np.asarray(state.out_BN), np.asarray(state.num_out_B)
        elapsed = time.perf_counter() - t0
        results = []
        for b, toks in enumerate(_rows(out, num)):
            stats = {"new_tokens": len(toks), "target_forwards": int(state.steps) + 1, "seconds": elapsed,
                     "tokens_per_second": float(num.sum()) / elapsed, **clock.stats(), "mode": "plain"}
            results.append(GenerationResult(toks, self.decode_text(toks), stats))
        return results

    def _generate_spec(self, ids, max_new, sp, seed, spec: SpecConfig, on_tokens):
        prompt, lens, _ = self.pad_prompts(ids, max_new + 1)
        S_target, S_draft = spec_loop.cache_lengths(int(lens.max()), max_new, spec)
        if S_target > self.cfg.max_position_embeddings:
            raise ValueError(f"prompt + generation needs {S_target} positions; the model supports "
                             f"{self.cfg.max_position_embeddings}")
        stop = jnp.asarray(self.stop_ids())
        draft_cache = init_draft_cache(self.draft.cfg, len(ids), S_draft, DTYPES[self.dtype])
        if self.mesh is not None:
            draft_cache = jax.device_put(draft_cache, replicated(self.mesh))
        t0 = time.perf_counter()
        state = spec_loop.start(self.model, self.params, self.draft, prompt, lens, self._cache(len(ids), S_target),
                                draft_cache, jax.random.key(seed), stop, sp, max_new, spec, self.prefill_chunk)
        chunk = 4 if on_tokens is not None else max_new
        clock = _ChunkClock(t0)
        while True:
            state = spec_loop.run_chunk(self.model, self.params, self.draft, state, stop, jnp.int32(chunk), sp,
                                        max_new, spec)
            if on_tokens is not None:
                on_tokens(_rows(np.asarray(state.out_BM), np.asarray(state.num_out_B)))
            clock.chunk_done(state.num_out_B)
            if bool(jnp.all(state.done_B)):
                break
        elapsed = time.perf_counter() - t0
        out, num = np.asarray(state.out_BM), np.asarray(state.num_out_B)
        log, row_cycles = np.asarray(state.accept_log_BC), np.asarray(state.row_cycles_B)
        results = []
        for b, toks in enumerate(_rows(out, num)):
            per_cycle = log[b, : row_cycles[b]].tolist()
            hist = np.bincount(per_cycle, minlength=spec.num_steps + 2)[1:].tolist() if per_cycle else []
            stats = {"new_tokens": len(toks), "cycles": int(row_cycles[b]), "accept_lengths": per_cycle,
                     "mean_accept_len": float(np.mean(per_cycle)) if per_cycle else 0.0,
                     "accept_histogram": hist, "target_forwards": int(row_cycles[b]) + 1, "seconds": elapsed,
                     "tokens_per_second": float(num.sum()) / elapsed, **clock.stats(), "mode": "speculative",
                     "spec": dataclasses.asdict(spec)}
            results.append(GenerationResult(toks, self.decode_text(toks), stats))
        return results

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
        return np.asarray(_draft_logits(self.model, self.params, self.draft, jnp.asarray(ids)))

    def decode_text(self, toks: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        stop = set(self.stop_ids().tolist())
        return self.tokenizer.decode([t for t in toks if t not in stop])


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


def load_draft(path: str, draft_payload: dict, cfg: ModelConfig, dtype, mesh) -> spec_loop.Draft:
    """Draft leaves from DIR/draft/params, replicated on every device (no collectives)."""
    dcfg = DraftConfig.from_dict(draft_payload)
    shapes = jax.eval_shape(lambda: draft_init_params(dcfg, jax.random.key(0), dtype))
    abstract = {"params": shapes, "d2t": jax.ShapeDtypeStruct((dcfg.draft_vocab_size,), jnp.int32)}
    flat = checkpoint.load_leaves(path, {**shapes, "d2t": abstract["d2t"]},
                                  jax.tree.map(lambda _: replicated(mesh), {**shapes, "d2t": abstract["d2t"]}),
                                  subdir="draft/params")
    d2t = flat.pop("d2t")
    validate_pair(cfg, dcfg, np.asarray(d2t))
    return spec_loop.Draft(flat, d2t, dcfg, tuple(aux_layer_ids(dcfg, cfg.num_layers)))


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
