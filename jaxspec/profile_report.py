"""python -m jaxspec.profile_report DIR [--json] [--run NAME]

Where a generation's time goes, from a trace written by `python -m jaxspec.generate --profile DIR`:
device time per phase of the decoding loop (draft steps, verify, accept, commit, draft extend,
other; for plain decoding the decode step and other) and per op class (routed experts,
attention, dense matmuls, collectives, everything else), per cycle and in total.

How the trace is read (the rules, in order):

1. Events. `jax.profiler.trace` writes DIR/plugins/profile/RUN/HOST.xplane.pb; it is read with
   `jax.profiler.ProfileData` (jax's own reader; the .trace.json.gz next to it is capped at a
   million events and on the CPU the Python tracer's events fill it before the loop runs). An
   XLA op execution is an event carrying the stats `hlo_module`, `hlo_op` and `program_id`.
   Device planes (`/device:...`) are used when they hold such events (GPU, TPU); otherwise the
   host plane `/host:CPU`, where the CPU backend runs each op as a thunk on its thread pool.
   Devices are told apart by plane and `device_ordinal`; times are averaged over devices.
2. Scopes. These events name the HLO instruction only. Its scope path (the op metadata
   `op_name`, e.g. `jit(run_loop)/while/body/verify/Transformer/layer_0/.../dot_general`)
   comes from the optimized HLO text that XLA dumps at compile time: `generate --profile DIR`
   calls `dump_hlo(DIR)` before the backend starts, which points `--xla_dump_to` at
   DIR/hlo/PID for the decoding-loop programs; the trace's `program_id` is the dump's module
   number. A fusion without metadata takes the most common scope of its fused instructions.
3. The loop. The decoding loop is the `while` of a program's entry computation whose body
   holds the loop's phase scopes; its ops are every instruction reachable from that body and
   its condition (nested loops included). Container ops (`while`, `conditional`, and a `call`
   whose callee's ops have their own events) are not counted: their children are. Cycles per
   run are the execution count of the instructions directly in the loop body.
4. Phase. The first component of the scope path after the loop's `while/body` that is a phase
   scope of the loop (`draft`, `verify`, `accept`, `commit`, `draft_extend`; plain decoding
   `target_decode`); anything else in the loop (the condition, the loop's own carry updates,
   key splitting) is `other`.
5. Op class, first match wins: collectives by opcode (all-reduce, all-gather, reduce-scatter,
   all-to-all, collective-permute and their async forms, also inside a fusion); routed experts
   when the scope path has an `experts` component (the MoE's routed experts; the shared
   expert's FFN runs in the same scope and is counted here); attention when it has an
   `attention`, `attn` or `self_attn` component (projections included, target and draft);
   dense matmuls for any other dot/convolution or matmul custom call (MLPs, router, lm_head,
   draft fc); everything else.

Measured loop time: per device and loop run, from the start of the loop's first op to the end of
its last op, summed over runs. The phases sum the ops' own durations (device time); they differ
from the loop time by the gaps between ops (`idle`: dispatch, and on a busy CPU host the thread
waiting for a core) and by ops that ran at the same time (`overlap`: the CPU runs independent
thunks on several threads); both are printed. The op time within the loop's span, taken from the
timestamps alone (every op of the program that started inside it, no HLO or scopes involved), is
printed too: the phases must add up to it, which checks that every op of the loop got exactly
one phase.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import re
import sys

from jaxspec import cli
from jaxspec.cli import UsageError

SPEC_PHASES = ("draft", "verify", "accept", "commit", "draft_extend")
PLAIN_PHASES = ("target_decode",)
PHASE_LABELS = {
    "draft": "draft steps",
    "verify": "verify",
    "accept": "accept",
    "commit": "commit",
    "draft_extend": "draft extend",
    "target_decode": "decode step",
    "other": "other",
}
CLASSES = ("routed experts", "attention", "dense matmuls", "collectives", "everything else")
EXPERT_SCOPES = frozenset({"experts"})
ATTENTION_SCOPES = frozenset({"attention", "attn", "self_attn"})
COLLECTIVES = frozenset(
    {
        "all-reduce",
        "all-gather",
        "reduce-scatter",
        "all-to-all",
        "collective-permute",
        "collective-broadcast",
        "ragged-all-to-all",
        "all-reduce-start",
        "all-reduce-done",
        "all-gather-start",
        "all-gather-done",
        "collective-permute-start",
        "collective-permute-done",
    }
)
MATMULS = frozenset({"dot", "convolution", "ragged-dot"})
CONTAINERS = frozenset({"while", "conditional"})
# Programs whose optimized HLO `dump_hlo` asks XLA for: the speculative and the plain decoding loop.
LOOP_PROGRAMS = r"jit_run_loop"


class ReportError(UsageError):
    """A trace directory that cannot be reported on; the message names the path and what is missing."""


def dump_hlo(trace_dir: str) -> bool:
    """Ask XLA to dump the optimized HLO of the decoding-loop programs into TRACE_DIR/hlo/PID.

    Must run before the first computation starts the backend (XLA reads its flags once); returns
    False, changing nothing, when the backend is already up.
    """
    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # a jax without this probe: assume the backend is not up yet
        started = False
    if started:
        import logging

        logging.getLogger("jaxspec").warning(
            "the XLA backend is already running, so the loop's HLO is not dumped into %s/hlo: "
            "`python -m jaxspec.profile_report` will not be able to attribute this trace's ops",
            trace_dir,
        )
        return False
    path = os.path.abspath(os.path.join(trace_dir, "hlo", str(os.getpid())))
    flags = f"--xla_dump_to={path} --xla_dump_hlo_as_text --xla_dump_hlo_module_re={LOOP_PROGRAMS}"
    # On GPUs XLA runs a loop body as one CUDA graph (a command buffer), which the trace shows as a single
    # op; profiling turns them off so every kernel is an event of its own (the loop runs a little slower).
    flags += " --xla_gpu_enable_command_buffer="
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
    # A program loaded from a persistent compilation cache (JAX_COMPILATION_CACHE_DIR) is not compiled, so
    # XLA would dump nothing for it: this process compiles every program itself.
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    return True


# ---------------------------------------------------------------------------
# HLO text


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    op_name: str
    callees: tuple[str, ...]
    target: str = ""  # custom_call_target
    body: str = ""  # a while's body computation
    operands: tuple[str, ...] = ()


_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s([a-z][a-z0-9_\-]*)\(")
_CALLEE = re.compile(r"\b(?:calls|body|condition|to_apply|true_computation|false_computation)=%?([^\s,{}()]+)")
_CALLEES = re.compile(r"\b(?:called_computations|branch_computations)=\{([^}]*)\}")
_OP_NAME = re.compile(r'metadata=\{[^}]*?op_name="((?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_NAME = re.compile(r"%([^\s,(){}]+)")
_BODY = re.compile(r"\bbody=%?([^\s,{}()]+)")


def _operands(rest: str, start: int) -> tuple[str, ...]:
    """Names of the operands in the parenthesised list that opens at rest[start]."""
    depth, i = 0, start
    while i < len(rest):
        ch = rest[i]
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            break
        i += 1
    return tuple(_NAME.findall(rest[start + 1 : i]))


class HloText:
    """The computations and instructions of one optimized HLO module in XLA's text format."""

    def __init__(self, text: str, name: str = ""):
        self.name = name
        self.computations: dict[str, list[Instr]] = {}
        self.entry = None
        current = None
        for line in text.splitlines():
            if not line.strip() or line.startswith("HloModule") or line.strip().startswith("//"):
                continue
            if not line[0].isspace():
                if line.rstrip().endswith("{"):
                    m = _HEADER.match(line)
                    current = self.computations.setdefault(m.group(2), [])
                    if m.group(1):
                        self.entry = m.group(2)
                elif line.startswith("}"):
                    current = None
                continue
            m = _INSTR.match(line)
            if m is None or current is None:
                continue
            name, rest = m.groups()
            op = _OPCODE.search(" " + rest)
            callees = _CALLEE.findall(rest)
            for group in _CALLEES.findall(rest):
                callees += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
            meta = _OP_NAME.search(rest)
            target, body = _TARGET.search(rest), _BODY.search(rest)
            operands = _operands(rest, op.end() - 2) if op else ()  # the match ran on ' ' + rest
            current.append(
                Instr(
                    name,
                    op.group(1) if op else "",
                    meta.group(1) if meta else "",
                    tuple(callees),
                    target.group(1) if target else "",
                    body.group(1) if body else "",
                    operands,
                )
            )
        self.by_name = {i.name: i for instrs in self.computations.values() for i in instrs}
        self.home = {i.name: c for c, instrs in self.computations.items() for i in instrs}
        self._scopes: dict[str, list[str]] = {}
        self._users: dict[str, dict] = {}

    def reachable(self, roots) -> set[str]:
        """Computations reachable from `roots` through called computations (roots included)."""
        seen, todo = set(), list(roots)
        while todo:
            c = todo.pop()
            if c in seen or c not in self.computations:
                continue
            seen.add(c)
            todo += [callee for i in self.computations[c] for callee in i.callees]
        return seen

    def scopes(self, instr: Instr) -> list[str]:
        """The instruction's scope paths: its own op_name; for one without, those of the instructions it
        calls (a fusion's); for one without either (XLA drops metadata on some instructions it creates
        or moves), those of the nearest producers that have one, else of the nearest consumers."""
        if instr.name not in self._scopes:
            own = self._own_scopes(instr)
            self._scopes[instr.name] = own or self._neighbour_scopes(instr)
        return self._scopes[instr.name]

    def _own_scopes(self, instr: Instr) -> list[str]:
        if instr.op_name:
            return [instr.op_name]
        return [i.op_name for c in self.reachable(instr.callees) for i in self.computations[c] if i.op_name]

    def _neighbour_scopes(self, instr: Instr) -> list[str]:
        comp = self.home[instr.name]
        if comp not in self._users:
            users = collections.defaultdict(list)
            for i in self.computations[comp]:
                for o in i.operands:
                    users[o].append(i.name)
            self._users[comp] = users
        for step in (lambda n: self.by_name[n].operands, lambda n: self._users[comp].get(n, ())):
            seen, frontier = {instr.name}, [instr.name]
            while frontier:
                nxt = [m for n in frontier for m in step(n) if m in self.by_name and m not in seen]
                seen.update(nxt)
                found = [s for m in dict.fromkeys(nxt) for s in self._own_scopes(self.by_name[m])]
                if found:
                    return found
                frontier = list(dict.fromkeys(nxt))
        return []

    def contains(self, instr: Instr, pred) -> bool:
        if pred(instr):
            return True
        return any(pred(i) for c in self.reachable(instr.callees) for i in self.computations[c])


def _is_collective(i: Instr) -> bool:
    return i.opcode in COLLECTIVES or (
        i.opcode.startswith("async-") and any(c.split(".")[0].replace("_", "-") in COLLECTIVES for c in i.callees)
    )


def _is_matmul(i: Instr) -> bool:
    t = i.target.lower()
    return i.opcode in MATMULS or (i.opcode == "custom-call" and any(k in t for k in ("gemm", "matmul", "dot")))


@dataclasses.dataclass
class Loop:
    """A decoding loop: the entry `while`, its body, and what each of its instructions counts as."""

    module: str
    program_id: int
    kind: str  # 'speculative' or 'plain'
    body: str
    phases: tuple[str, ...]
    phase_of: dict[str, str]  # instruction -> phase
    class_of: dict[str, str]  # instruction -> op class
    direct: set[str]  # instructions directly in the body computation


def _phase(op_name: str, phases) -> str | None:
    parts = op_name.split("/")
    for k in range(len(parts) - 1):
        if parts[k] == "while" and parts[k + 1] == "body":
            return next((p for p in parts[k + 2 :] if p in phases), None)
    return None


def _majority(values, default):
    counts = collections.Counter(v for v in values if v is not None)
    return counts.most_common(1)[0][0] if counts else default


def _op_class(hlo: HloText, instr: Instr) -> str:
    if hlo.contains(instr, _is_collective):
        return "collectives"
    scopes = hlo.scopes(instr)

    def scope_class(s):
        parts = set(s.split("/"))
        if parts & EXPERT_SCOPES:
            return "routed experts"
        if parts & ATTENTION_SCOPES:
            return "attention"
        return None

    cls = _majority([scope_class(s) for s in scopes], None)
    if cls is not None:
        return cls
    return "dense matmuls" if hlo.contains(instr, _is_matmul) else "everything else"


def find_loop(hlo: HloText, program_id: int) -> Loop | None:
    """The decoding loop of a module, or None when it has none."""
    if hlo.entry is None:
        return None
    for w in hlo.computations[hlo.entry]:
        if w.opcode != "while" or not w.callees:
            continue
        inside = hlo.reachable(w.callees)
        names = [i for c in inside for i in hlo.computations[c]]
        found = {_phase(s, SPEC_PHASES + PLAIN_PHASES) for i in names for s in ([i.op_name] if i.op_name else [])}
        if found & set(SPEC_PHASES):
            kind, phases = "speculative", SPEC_PHASES
        elif found & set(PLAIN_PHASES):
            kind, phases = "plain", PLAIN_PHASES
        else:
            continue
        body = w.body
        phase_of, class_of = {}, {}
        for i in names:
            phase_of[i.name] = _majority([_phase(s, phases) for s in hlo.scopes(i)], "other")
            class_of[i.name] = _op_class(hlo, i)
        direct = {i.name for i in hlo.computations.get(body, [])}
        return Loop(hlo.name, program_id, kind, body, phases, phase_of, class_of, direct)
    return None


# ---------------------------------------------------------------------------
# Trace


@dataclasses.dataclass
class OpEvent:
    device: tuple[str, int]
    module: str
    program_id: int
    run_id: int
    op: str
    start_ns: float
    dur_ns: float


def find_trace(trace_dir: str, run: str | None = None) -> str:
    """The .xplane.pb of the newest (or the named) run under TRACE_DIR/plugins/profile."""
    root = os.path.join(trace_dir, "plugins", "profile")
    runs = sorted(d for d in glob.glob(os.path.join(root, "*")) if os.path.isdir(d))
    if run is not None:
        runs = [d for d in runs if os.path.basename(d) == run]
        if not runs:
            raise ReportError(f"--run {run}: no such run under {root}")
    if not runs:
        raise ReportError(
            f"{trace_dir}: no profiler run found (expected {root}/RUN/*.xplane.pb, as written by "
            "`python -m jaxspec.generate --profile DIR`)"
        )
    files = sorted(glob.glob(os.path.join(runs[-1], "*.xplane.pb")))
    if len(files) != 1:
        raise ReportError(f"{runs[-1]}: expected one .xplane.pb, found {len(files)}")
    return files[0]


def read_events(path: str) -> tuple[list[OpEvent], dict]:
    """XLA op events of the trace (device planes if they have any, else the host's) and the trace's metadata."""
    from jax.profiler import ProfileData

    try:
        data = ProfileData.from_file(path)
    except RuntimeError as e:  # what jax raises for bytes that are not an XSpace
        raise ReportError(
            f"{path}: expected an XLA profiler trace (XSpace protobuf), found unreadable data ({e})"
        ) from e
    meta = {}
    by_plane = collections.defaultdict(list)
    for plane in data.planes:
        if plane.name == "/host:metadata":
            meta.update(dict(plane.stats))
        for line in plane.lines:
            if line.name == "python":
                continue
            for e in line.events:
                stats = dict(e.stats)
                if "hlo_op" not in stats or "hlo_module" not in stats:
                    continue
                dev = (plane.name, int(stats.get("device_ordinal", 0)))
                by_plane[plane.name].append(
                    OpEvent(
                        dev,
                        str(stats["hlo_module"]),
                        int(stats.get("program_id", -1)),
                        int(stats.get("run_id", 0)),
                        str(stats["hlo_op"]),
                        float(e.start_ns),
                        float(e.duration_ns),
                    )
                )
    device_planes = [p for p in by_plane if p.startswith("/device:")]
    planes = device_planes or [p for p in by_plane if p.startswith("/host:")]
    return [e for p in planes for e in by_plane[p]], meta


def load_hlo(hlo_dir: str) -> dict[int, HloText]:
    """Optimized HLO modules dumped by XLA, keyed by module number (the trace's program_id)."""
    out = {}
    for path in glob.glob(os.path.join(hlo_dir, "module_*after_optimizations.txt")):
        base = os.path.basename(path)
        # CPU: module_N.NAME.after_optimizations.txt; GPU: module_N.NAME.sm_9.0_gpu_after_optimizations.txt
        m = re.match(r"module_(\d+)\.([^.]+)\.(?:.*_)?after_optimizations\.txt$", base)
        if m is None:
            continue
        with open(path) as f:
            out[int(m.group(1))] = HloText(f.read(), m.group(2))
    return out


# ---------------------------------------------------------------------------
# Analysis


def analyse(events: list[OpEvent], modules: dict[int, HloText]) -> dict:
    """Totals per phase and op class of the decoding loop, the loop time, and time outside the loop."""
    loops = {}
    for pid in sorted({e.program_id for e in events}):
        if pid in modules:
            loop = find_loop(modules[pid], pid)
            if loop is not None:
                loops[pid] = loop
    if not loops:
        traced = sorted({(e.program_id, e.module) for e in events})
        raise ReportError(
            "no decoding loop in the traced programs "
            + ", ".join(f"{m} (program {p})" for p, m in traced)
            + f"; expected a program matching {LOOP_PROGRAMS} whose HLO was dumped"
        )
    # The loop that ran longest is the one reported (a trace holds one generation).
    busy = collections.Counter()
    for e in events:
        if e.program_id in loops:
            busy[e.program_id] += e.dur_ns
    loop = loops[busy.most_common(1)[0][0]]
    hlo = modules[loop.program_id]
    devices = sorted({e.device for e in events})
    mine = [e for e in events if e.program_id == loop.program_id]
    with_events = {e.op for e in mine}
    counted, unmatched = [], collections.Counter()
    for e in mine:
        instr = hlo.by_name.get(e.op)
        if instr is None:
            unmatched[e.op] += 1
            continue
        if e.op not in loop.phase_of or _is_container(hlo, instr, with_events):
            continue
        counted.append(e)
    phases = loop.phases + ("other",)
    table = {p: dict.fromkeys(CLASSES, 0.0) for p in phases}
    for e in counted:
        table[loop.phase_of[e.op]][loop.class_of[e.op]] += e.dur_ns
    runs = collections.defaultdict(list)
    for e in counted:
        runs[(e.device, e.run_id)].append(e)
    by_run = collections.defaultdict(list)
    for e in mine:
        instr = hlo.by_name.get(e.op)
        if instr is None or not _is_container(hlo, instr, with_events):
            by_run[(e.device, e.run_id)].append(e)
    wall = union = span_ops = 0.0
    cycles = 0
    for (dev, run), evs in runs.items():
        t0, t1 = min(e.start_ns for e in evs), max(e.start_ns + e.dur_ns for e in evs)
        wall += t1 - t0
        union += _union(evs)
        # every op of the program that ran within the loop's span, found by time alone (no HLO, no scopes)
        span_ops += sum(e.dur_ns for e in by_run[(dev, run)] if t0 <= e.start_ns < t1)
        if dev == devices[0]:
            counts = collections.Counter(e.op for e in evs if e.op in loop.direct)
            cycles += collections.Counter(counts.values()).most_common(1)[0][0] if counts else 0
    n_dev = len({d for d, _ in runs}) or 1
    op_total = sum(sum(row.values()) for row in table.values())
    outside = collections.Counter()
    for e in events:
        if e.program_id != loop.program_id or e.op not in loop.phase_of:
            instr = modules.get(e.program_id).by_name.get(e.op) if e.program_id in modules else None
            if instr is None or not _is_container(modules[e.program_id], instr, with_events):
                outside[e.module] += e.dur_ns
    ms = 1e-6 / n_dev
    per = 1.0 / cycles if cycles else 0.0
    return {
        "loop": {
            "module": loop.module,
            "program_id": loop.program_id,
            "kind": loop.kind,
            "runs": len(runs) // n_dev,
            "cycles": cycles,
            "devices": n_dev,
            "device_plane": devices[0][0] if devices else None,
            "wall_ms": wall * ms,
            "op_ms": op_total * ms,
            "span_op_ms": span_ops * ms,
            "idle_ms": (wall - union) * ms,
            "overlap_ms": (op_total - union) * ms,
        },
        "phases": {
            p: {
                "label": PHASE_LABELS[p],
                "ms": sum(row.values()) * ms,
                "ms_per_cycle": sum(row.values()) * ms * per,
                "share": sum(row.values()) / op_total if op_total else 0.0,
                "classes_ms": {c: v * ms for c, v in row.items()},
                "classes_ms_per_cycle": {c: v * ms * per for c, v in row.items()},
            }
            for p, row in table.items()
        },
        "classes": {
            c: {
                "ms": sum(table[p][c] for p in phases) * ms,
                "ms_per_cycle": sum(table[p][c] for p in phases) * ms * per,
                "share": sum(table[p][c] for p in phases) / op_total if op_total else 0.0,
            }
            for c in CLASSES
        },
        "outside_loop_ms": {m: v * ms for m, v in sorted(outside.items())},
        "unmatched_ops": sum(unmatched.values()),
    }


def _is_container(hlo: HloText, instr: Instr, with_events: set[str]) -> bool:
    if instr.opcode in CONTAINERS:
        return True
    if instr.opcode == "call":
        return any(i.name in with_events for c in hlo.reachable(instr.callees) for i in hlo.computations[c])
    return False


def _union(evs: list[OpEvent]) -> float:
    """Length of the union of the events' time intervals."""
    total, end = 0.0, None
    start = None
    for s, e in sorted((e.start_ns, e.start_ns + e.dur_ns) for e in evs):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total + (end - start if end is not None else 0.0)


def report(trace_dir: str, run: str | None = None) -> dict:
    path = find_trace(trace_dir, run)
    events, meta = read_events(path)
    if not events:
        raise ReportError(f"{path}: no XLA op events (expected events with hlo_op/hlo_module stats)")
    pid = meta.get("process_id")
    hlo_dir = os.path.join(trace_dir, "hlo", str(pid))
    modules = load_hlo(hlo_dir)
    if not modules:
        raise ReportError(
            f"{hlo_dir}: no optimized HLO dump for this trace (process {pid}); expected "
            "module_*.after_optimizations.txt, written when the trace comes from "
            "`python -m jaxspec.generate --profile DIR` (it calls jaxspec.profile_report.dump_hlo)"
        )
    out = analyse(events, modules)
    out["trace"] = path
    out["process_id"] = pid
    return out


def format_table(r: dict) -> str:
    lp = r["loop"]
    unit = "cycle" if lp["kind"] == "speculative" else "step"
    lines = [
        f"trace {r['trace']}",
        (
            f"{lp['kind']} loop {lp['module']} on {lp['devices']} device(s) of {lp['device_plane']}: "
            f"{lp['runs']} run(s), {lp['cycles']} {unit}s"
        ),
        (
            f"loop time {lp['wall_ms']:.3f} ms (first to last op of each run); op time {lp['op_ms']:.3f} ms "
            f"= loop time - idle {lp['idle_ms']:.3f} ms + overlap {lp['overlap_ms']:.3f} ms; ops started "
            f"within the loop's span {lp['span_op_ms']:.3f} ms"
        ),
        f"device time per phase; the op-class columns are ms per {unit}",
        "",
    ]
    short = {
        "routed experts": "experts",
        "attention": "attention",
        "dense matmuls": "matmuls",
        "collectives": "collectives",
        "everything else": "other ops",
    }
    head = f"{'phase':<14}{'total ms':>10}{'ms/' + unit:>10}{'share':>8} |" + "".join(
        f"{short[c]:>12}" for c in CLASSES
    )
    rule = "-" * len(head)
    lines += [head, rule]
    for row in r["phases"].values():
        lines.append(
            f"{row['label']:<14}{row['ms']:>10.3f}{row['ms_per_cycle']:>10.3f}{row['share']:>8.1%} |"
            + "".join(f"{row['classes_ms_per_cycle'][c]:>12.3f}" for c in CLASSES)
        )
    tot = sum(row["ms"] for row in r["phases"].values())
    per = sum(row["ms_per_cycle"] for row in r["phases"].values())
    lines += [
        rule,
        f"{'total':<14}{tot:>10.3f}{per:>10.3f}{1:>8.1%} |"
        + "".join(f"{r['classes'][c]['ms_per_cycle']:>12.3f}" for c in CLASSES),
        f"{'class share':<42} |" + "".join(f"{r['classes'][c]['share']:>12.1%}" for c in CLASSES),
    ]
    if r["outside_loop_ms"]:
        lines += [
            "",
            "outside the loop (prefill, setup): "
            + ", ".join(f"{m} {v:.3f} ms" for m, v in r["outside_loop_ms"].items()),
        ]
    if r["unmatched_ops"]:
        lines.append(f"warning: {r['unmatched_ops']} op events of the loop program matched no HLO instruction")
    return "\n".join(lines)


@cli.entry_point
def main(argv=None) -> int:
    p = cli.ArgumentParser(prog="python -m jaxspec.profile_report", description=__doc__)
    p.add_argument("dir", metavar="DIR", help="directory given to `python -m jaxspec.generate --profile`")
    p.add_argument("--run", help="run name under DIR/plugins/profile (default: the newest)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if not os.path.isdir(args.dir):
        found = "a file" if os.path.exists(args.dir) else "no such path"
        raise ReportError(
            f"DIR {args.dir}: not a directory (expected the directory given to "
            f"`python -m jaxspec.generate --profile`, found {found})"
        )
    r = report(args.dir, args.run)
    print(json.dumps(r, indent=2) if args.json else format_table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
