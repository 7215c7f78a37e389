"""The suite's persistent XLA compilation cache (set up by tests/conftest.py).

Most of the suite's time is XLA compiling. JAX's persistent compilation cache lets a program compiled once be
loaded by the two pytest-xdist workers, the child processes the tests start (they inherit the environment) and
later runs. An entry is found by a hash of the program's HLO, its compile options, the XLA flags and the JAX
version, so it is only ever loaded for the program it was compiled from. JAX's default threshold applies: only
programs that took at least a second to compile are written.

A ``JAX_COMPILATION_CACHE_DIR`` set by the caller is used as it is; otherwise the cache lives in
``$XDG_CACHE_HOME/jaxspec/xla-tests`` (``~/.cache`` by default). ``JAXSPEC_TEST_COMPILE_CACHE=0`` turns it off.
"""

import os
import sys

ENV = "JAX_COMPILATION_CACHE_DIR"
SWITCH = "JAXSPEC_TEST_COMPILE_CACHE"
LIMIT = 2 * 2**30  # bytes; past this, the oldest entries are deleted at the start of a run


def default_dir() -> str:
    from jaxspec import demo  # the project's cache root (demo imports no JAX)

    return os.path.join(demo.cache_root(), "xla-tests")


def configure() -> str | None:
    """Points this process (and the children it starts) at the cache; returns its directory, or None when off.
    Runs before JAX is imported, which reads the variable then."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    path = os.environ.get(ENV) or default_dir()
    os.environ[ENV] = path
    if "jax" in sys.modules:  # imported earlier (by a plugin): it has read its environment already
        sys.modules["jax"].config.update("jax_compilation_cache_dir", path)
    return path


def prune(path: str, limit: int = LIMIT) -> int:
    """If the files in `path` hold more than `limit` bytes, deletes the least recently written ones until at most
    half of `limit` is left. Returns the number of files deleted."""
    try:
        files = [e for e in os.scandir(path) if e.is_file()]
    except FileNotFoundError:
        return 0
    stats = sorted((st.st_mtime_ns, st.st_size, e.path) for e in files for st in [e.stat()])
    total = sum(size for _, size, _ in stats)
    if total <= limit:
        return 0
    removed = 0
    for _, size, file in stats:
        if total <= limit // 2:
            break
        try:
            os.remove(file)
        except FileNotFoundError:  # another run pruned it first
            pass
        total -= size
        removed += 1
    return removed
