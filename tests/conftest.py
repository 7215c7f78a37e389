import gc
import os
import sys

import pytest

# Tests import helpers that sit next to them (hf_models) and the project from the checkout.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import compile_cache  # noqa: E402  (a helper next to this file)

# One persistent XLA compilation cache for the workers, the child processes and later runs (tests/compile_cache.py).
COMPILE_CACHE_DIR = compile_cache.configure()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Frees each module's compiled programs when it ends. Every XLA CPU executable holds memory
    mappings of its own; kept for the whole suite they reached the kernel's limit (vm.max_map_count,
    65530 by default: 8,880 after the INT4 kernel's module alone) and a later compile crashed."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()


def _mesh_modules(session, fixture=None):
    """The test_mesh module(s) among the selected tests (with `fixture`: of tests that use it)."""
    return [
        m
        for m in {
            getattr(item, "module", None)
            for item in session.items
            if fixture is None or fixture in getattr(item, "fixturenames", ())
        }
        if m is not None and m.__name__.endswith("test_mesh") and hasattr(m, "start_early")
    ]


def pytest_collection_finish(session):
    """Starts test_mesh's child processes (minutes of compilation on fake devices) once the tests are known,
    so that they run beside the other tests rather than after them. Not in pytest-xdist's workers: each
    collects every test, and the other workers already run beside (test_mesh starts them when it runs)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if not session.config.option.collectonly:
        for module in _mesh_modules(session, "children"):
            module.start_early()


def pytest_sessionfinish(session):
    for module in _mesh_modules(session):
        module.stop_early()


def pytest_configure(config):
    """At the start of a run (in the controller, not in pytest-xdist's workers): the compilation cache kept
    under its limit."""
    if COMPILE_CACHE_DIR and not os.environ.get("PYTEST_XDIST_WORKER"):
        compile_cache.prune(COMPILE_CACHE_DIR)
