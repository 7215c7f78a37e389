import os
import sys

# Tests import helpers that sit next to them (hf_models) and the project from the checkout.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
