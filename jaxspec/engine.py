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
from jaxspec.config import ModelConfig, from_dict
from jaxspec.model import Transformer, abstract_params, init_cache
from jaxspec.sampling import SamplingParams
from jaxspec.sharding import make_mesh, param_shardings, replicated

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


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
                 draft=None):
        self.cfg = cfg
        self.params = params
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.mesh = mesh
        self.model = Transformer(cfg, DTYPES[dtype], mesh=mesh if mesh is not None and mesh.size > 1 else None)
        self.draft = draft

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str, dtype: str | None = None, num_devices: int | None = None) -> "Engine":
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
        draft = None
        if "draft" in payload:
            from jaxspec.draft_runtime import load_draft

            draft = load_draft(path, payload["draft"], DTYPES[dtype], mesh)
        return cls(cfg, params, tokenizer, dtype, mesh, draft)

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
            from jaxspec.spec_runtime import generate_spec

            return generate_spec(self, ids, max_new_tokens, sp, seed, spec, on_tokens)
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
                             jax.random.key(seed), stop, sp, max_new)
        chunk = 16 if on_tokens is not None else max_new
        while True:
            state = decode.decode_chunk(self.model, self.params, state, stop, jnp.int32(chunk), sp)
            if on_tokens is not None:
                on_tokens(_rows(np.asarray(state.out_BN), np.asarray(state.num_out_B)))
            if bool(jnp.all(state.done_B)):
                break
        out, num = np.asarray(state.out_BN), np.asarray(state.num_out_B)
        elapsed = time.perf_counter() - t0
        results = []
        for b, toks in enumerate(_rows(out, num)):
            stats = {"new_tokens": len(toks), "target_forwards": int(state.steps) + 1, "seconds": elapsed,
                     "tokens_per_second": float(num.sum()) / elapsed, "mode": "plain"}
            results.append(GenerationResult(toks, self.decode_text(toks), stats))
        return results

    def decode_text(self, toks: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        stop = set(self.stop_ids().tolist())
        return self.tokenizer.decode([t for t in toks if t not in stop])


def _rows(out: np.ndarray, num: np.ndarray) -> list[list[int]]:
    return [out[b, : num[b]].tolist() for b in range(out.shape[0])]


@functools.partial(jax.jit, static_argnames=("model",))
def _full_forward(model, params, tokens_1S, cache):
    positions = jnp.arange(tokens_1S.shape[1], dtype=jnp.int32)[None]
    logits, _, _ = decode.forward(model, params, tokens_1S, positions, cache)
    return logits
