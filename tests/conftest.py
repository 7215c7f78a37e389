import os
import sys

# Tests import helpers that sit next to them (hf_models) and the project from the checkout.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))


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
