import gc
import os
import shutil
import sys
import tempfile

import pytest

# Tests import helpers that sit next to them (hf_models) and the project from the checkout.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))


def pytest_configure(config):
    """One persistent compilation cache for the session, new and empty, shared by this process and every
    child process the tests start (they inherit the environment). A program compiled already, by an
    earlier module (whose compiled programs _release_compiled_programs released) or by another process,
    is loaded from it instead of compiled again: a third of the compilations of test_spec, test_demo,
    test_engine, test_spec_sampling, test_stacked_matmul and test_train_draft run together. Set before
    anything imports jax (JAX reads these variables when it starts); removed at the end of the session.
    `--profile` runs keep compiling (jaxspec.profile_report.dump_hlo turns the cache off: XLA dumps the
    HLO of the programs it compiles)."""
    cache = tempfile.mkdtemp(prefix="jaxspec_xla_cache_")
    config._jaxspec_xla_cache = cache
    settings = {
        "JAX_COMPILATION_CACHE_DIR": cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # every program, however quick to compile
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",  # however small
    }
    os.environ.update(settings)
    if "jax" in sys.modules:  # imported early after all (by a plugin): set the same options directly
        import jax

        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


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
    so that they run beside the other tests rather than after them."""
    if not session.config.option.collectonly:
        for module in _mesh_modules(session, "children"):
            module.start_early()


def pytest_sessionfinish(session):
    for module in _mesh_modules(session):
        module.stop_early()


def pytest_unconfigure(config):
    cache = getattr(config, "_jaxspec_xla_cache", None)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
