"""Cross-device collectives of each generation phase, counted from the compiled program.

    from jaxspec.collectives import phase_collectives
    table = phase_collectives(engine, batch=1, spec=SpecConfig(3, 1, 4))
    table["draft_tree"]["all-reduce"]    # {"count": 0, "bytes": 0}

Each phase (a plain decode step, a verify, one draft tree, the draft extend over
accepted tokens, the draft extend over a prompt, a whole speculative cycle) is
jitted on its own with the engine's parameters and state shardings, compiled for
the engine's mesh, and its optimised HLO is scanned for collective ops. Counts
are per execution: an op in a while loop's body counts once per iteration when
XLA knows the trip count (the `lax.scan` over the stacked decoder layers). Bytes
are the size of each op's result on one device; for an
asynchronous `-start`/`-done` pair the `-start` is counted, with the gathered or
permuted result as its size.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
PHASES = ("decode", "verify", "draft_tree", "draft_extend", "prompt_extend", "cycle")
DRAFT_PHASES = ("draft_tree", "draft_extend", "prompt_extend")

_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "s4": 0.5,
    "u4": 0.5,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
_OP = re.compile(
    r"=\s*(?P<shape>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(KINDS) + r")(?P<start>-start)?\("
)


def _shape_bytes(shape: str) -> int:
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * _BYTES.get(dtype, 4)
    return int(total)


_COMPUTATION = re.compile(r"^(ENTRY )?(%[\w.\-]+) .*\{$")
_WHILE = re.compile(r"\bwhile\(.*?body=(%[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


_COMMENT = re.compile(r"/\*.*?\*/")  # XLA numbers long tuples' elements: (f32[1], ..., /*index=5*/f32[1], ...)


def _direct(text: str) -> dict[str, dict[str, int]]:
    out = {k: {"count": 0, "bytes": 0} for k in KINDS}
    for m in _OP.finditer(_COMMENT.sub("", text)):
        shape = m.group("shape")
        if m.group("start") and m.group("op") in ("all-gather", "collective-permute") and shape.startswith("("):
            # (operand, result[, scratch...]): the result is what moves.
            arrays = _ARRAY.findall(shape)
            shape = "{}[{}]".format(*arrays[1]) if len(arrays) > 1 else shape
        out[m.group("op")]["count"] += 1
        out[m.group("op")]["bytes"] += _shape_bytes(shape)
    return out


def count_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """{kind: {"count", "bytes"}} of one execution of an HLO module (its text).

    A while loop's body counts as often as its known trip count (XLA annotates the
    loops of `lax.scan`, e.g. the stacked decoder layers); a loop without one counts
    once. Text that is not split into computations is scanned as a whole.
    """
    comps: dict[str, list[str]] = {}
    entry, name = None, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            name = m.group(2)
            comps[name] = []
            entry = name if m.group(1) else entry
        elif name is not None:
            comps[name].append(line)
    if entry is None:
        return _direct(hlo_text)

    def total(comp: str, seen: tuple[str, ...]) -> dict[str, dict[str, int]]:
        lines = comps.get(comp, [])
        out = _direct("\n".join(lines))
        for line in lines:
            w = _WHILE.search(line)
            if w and w.group(1) not in seen:
                trip = _TRIP.search(line)
                inner = total(w.group(1), seen + (comp,))
                n = int(trip.group(1)) if trip else 1
                for k in KINDS:
                    out[k]["count"] += n * inner[k]["count"]
                    out[k]["bytes"] += n * inner[k]["bytes"]
        return out

    return total(entry, ())


def total(counts: dict[str, dict[str, int]]) -> int:
    return sum(v["count"] for v in counts.values())


def _abstract(tree):
    """ShapeDtypeStructs carrying each leaf's sharding (concrete arrays) or as given (abstract)."""

    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


def _compiler_options(params) -> dict | None:
    """Only the optimised HLO of these programs is read, never their machine code: on the CPU they are
    compiled with LLVM at -O0 (XLA's HLO passes, the SPMD partitioner among them, run as at the default
    level; the six phases of a 4- or 8-device spec pair compile in 7.4 s instead of 9.0). Elsewhere the default."""
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    devices = sharding.device_set if sharding is not None else set(jax.devices()[:1])
    return {"xla_backend_optimization_level": 0} if {d.platform for d in devices} == {"cpu"} else None


def _hlo_of(fn, *args, options=None) -> str:
    return jax.jit(fn).lower(*args).compile(options).as_text()


def phase_programs(engine, batch: int = 1, spec=None, prompt_len: int = 16, max_new: int = 32) -> dict[str, str]:
    """Optimised HLO text of every phase for `engine` (a loaded `Engine` with a draft, or without one:
    then only 'decode'). Parameters may be concrete or abstract (ShapeDtypeStruct with sharding)."""
    from jaxspec import decode
    from jaxspec import spec as spec_loop
    from jaxspec.sampling import SamplingParams

    spec = spec or spec_loop.SpecConfig()
    model, sp = engine.model, SamplingParams()
    params = _abstract(engine.params)
    B = batch
    stop = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=engine.replicated_sharding())
    prompt = jax.ShapeDtypeStruct((B, prompt_len), jnp.int32, sharding=engine.replicated_sharding())
    lens = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=engine.replicated_sharding())
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=engine.replicated_sharding())
    out = {}
    _hlo = functools.partial(_hlo_of, options=_compiler_options(engine.params))

    plain = decode.Plain(model, sp, max_new)
    cache = engine.abstract_cache(B, plain.cache_length(prompt_len))
    dstate = jax.eval_shape(plain.start, params, prompt, lens, cache, key, stop)
    dstate = engine.place_state(dstate)
    out["decode"] = _hlo(plain.step, params, dstate, stop)
    if engine.draft is None:
        return out

    draft = _abstract(engine.draft)
    speculative = spec_loop.Speculative(model, sp, max_new, spec)
    S_target, S_draft = speculative.cache_lengths(prompt_len)
    tcache, dcache = engine.abstract_cache(B, S_target), engine.abstract_draft_cache(B, S_draft)
    state = jax.eval_shape(speculative.start, (params, draft), prompt, lens, (tcache, dcache), key, stop)
    state = engine.place_state(state)
    shape = spec.tree
    out["draft_tree"] = _hlo(
        lambda p, d, s: spec_loop.draft_tree(model, p, d, s, shape, S_target), params, draft, state
    )
    tree = jax.eval_shape(
        lambda p, d, s: spec_loop.draft_tree(model, p, d, s, shape, S_target)[0], params, draft, state
    )
    tree = engine.place_state(tree)
    out["verify"] = _hlo(
        lambda p, d, s, t: spec_loop.verify(model, p, d, s, t, spec.topk > 1), params, draft, state, tree
    )

    A = 3 * engine.cfg.hidden_size
    n = spec.num_steps + 1
    rep = engine.replicated_sharding()
    aux = jax.ShapeDtypeStruct((B, n, A), jnp.dtype(engine.dtype), sharding=rep)
    toks = jax.ShapeDtypeStruct((B, n), jnp.int32, sharding=rep)
    out["draft_extend"] = _hlo(
        lambda p, d, c, a, t, s, k: spec_loop.draft_extend(model, p, d, c, a, t, s, k, S_target),
        params,
        draft,
        state.draft_cache,
        aux,
        toks,
        lens,
        lens,
    )
    aux_p = jax.ShapeDtypeStruct((B, prompt_len, A), jnp.dtype(engine.dtype), sharding=rep)
    out["prompt_extend"] = _hlo(
        lambda p, d, c, a, t, k: spec_loop.extend_prompt(model, p, d, c, a, t, k, S_target),
        params,
        draft,
        state.draft_cache,
        aux_p,
        prompt,
        lens,
    )
    out["cycle"] = _hlo(lambda p, d, s, st: speculative.step((p, d), s, st), params, draft, state, stop)
    return out


def phase_collectives(engine, **kw) -> dict[str, dict[str, dict[str, int]]]:
    """{phase: {kind: {"count", "bytes"}}} for `engine`; keyword arguments as `phase_programs`."""
    return {phase: count_collectives(text) for phase, text in phase_programs(engine, **kw).items()}


def format_table(table: dict[str, dict[str, dict[str, int]]]) -> str:
    """A fixed-width table: one row per phase, count (bytes) per collective kind."""
    short = {
        "all-reduce": "all-reduce",
        "all-gather": "all-gather",
        "reduce-scatter": "reduce-scat",
        "all-to-all": "all-to-all",
        "collective-permute": "coll-permute",
    }
    head = f"{'phase':<14}" + "".join(f"{short[k]:>22}" for k in KINDS) + f"{'total':>7}"
    lines = [head]
    for phase, counts in table.items():
        cells = "".join(f"{counts[k]['count']:>6} ({_human(counts[k]['bytes']):>12})" for k in KINDS)
        lines.append(f"{phase:<14}{cells}{total(counts):>7}")
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
