"""The packages' module import graph: no cycles, and a clean runtime / converter boundary.

Each module of `jaxspec` and `checkpoints_convert` is parsed with `ast` (nothing is
imported). Module-level imports are those that run when the module is imported: statements
at the top level, in top-level `if`/`try` blocks and in class bodies, but not in function
bodies nor under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jaxspec", "checkpoints_convert")
# Runtime modules that may not import these at module level (torch: tests only; the
# converter: offline tools, reached from the runtime only by function-local imports).
FORBIDDEN_AT_RUNTIME = ("checkpoints_convert", "torch")


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of PACKAGES."""
    out = {}
    for pkg in PACKAGES:
        for root, dirs, files in os.walk(os.path.join(REPO, pkg)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    parts = os.path.relpath(os.path.join(root, f), REPO)[: -len(".py")].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    out[".".join(parts)] = os.path.join(root, f)
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(body, local: bool, found: list) -> None:
    """(local, node) for every import statement under `body`; `local`: inside a function."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append((local, node))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _imports(node.body, True, found)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            continue
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                _imports(getattr(node, field, None) or [], local, found)


def _targets(module: str, node) -> set[str]:
    """Absolute names of what `node` imports: `from a import b` is `a.b` when that is a module, else `a`."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        package = module.split(".") if MODULES.get(module, "").endswith("__init__.py") else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    out = set()
    for alias in node.names:
        out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return out


def _internal(name: str) -> str | None:
    """The package module that importing `name` runs last (its longest prefix among MODULES)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    return None


def _graph():
    """(module-level edges, function-local edges with line numbers) between package modules."""
    top, local = {m: set() for m in MODULES}, {m: [] for m in MODULES}
    external = {m: set() for m in MODULES}
    for module, file in MODULES.items():
        with open(file, encoding="utf-8") as f:
            source = f.read()
        found = []
        _imports(ast.parse(source, file).body, False, found)
        for is_local, node in found:
            for name in _targets(module, node):
                target = _internal(name)
                if target is None:
                    if not is_local:
                        external[module].add(name.split(".")[0])
                elif target != module:
                    (
                        local[module].append((target, node.lineno, source.splitlines()))
                        if is_local
                        else top[module].add(target)
                    )
    return top, local, external


TOP, LOCAL, EXTERNAL = _graph()


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_graph_sees_the_packages():
    assert {"jaxspec.model", "jaxspec.config", "checkpoints_convert.convert"} <= set(MODULES)
    assert "jaxspec.config" in TOP["jaxspec.model"]  # the parse finds real edges
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = _cycle(TOP)
    assert cycle is None, f"module-level import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] == "jaxspec"))
def test_runtime_does_not_import_converter_or_torch(module):
    bad = sorted(t for t in TOP[module] if t.split(".")[0] in FORBIDDEN_AT_RUNTIME)
    bad += sorted(e for e in EXTERNAL[module] if e in FORBIDDEN_AT_RUNTIME)
    assert not bad, f"{MODULES[module]} imports {bad} at module level"


def test_local_imports_that_avoid_a_cycle_say_so():
    """A function-local import that would close a cycle at module level carries a comment saying why,
    on its line or in the comment lines right above it; so does one that crosses from the runtime
    into the converter."""

    def reaches(a, b):
        seen, todo = set(), [a]
        while todo:
            node = todo.pop()
            if node == b:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(TOP[node])
        return False

    missing = []
    for module, edges in LOCAL.items():
        for target, line, lines in edges:
            crosses = module.startswith("jaxspec") and target.startswith("checkpoints_convert")
            if not (crosses or (target not in TOP[module] and reaches(target, module))):
                continue
            above, k = [], line - 2
            while k >= 0 and (lines[k].strip().startswith(("#", "from ", "import "))):
                above.append(lines[k])
                k -= 1
            if "#" not in lines[line - 1] and not any(s.strip().startswith("#") for s in above):
                missing.append(f"{MODULES[module]}:{line} imports {target}")
    assert not missing, "function-local imports without a comment giving the reason: " + "; ".join(missing)
