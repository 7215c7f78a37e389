import os
import sys
import tempfile

# Under pytest-xdist each worker keeps its own cache directory (the converted demo pair, tuned
# spec_config.json files), so that tests running side by side never write into one another's.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["XDG_CACHE_HOME"] = os.path.join(
        tempfile.gettempdir(), f"jaxspec-test-cache-{os.environ['PYTEST_XDIST_WORKER']}"
    )

# Tests import helpers that sit next to them (hf_models) and the project from the checkout.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
