"""jaxspec: EAGLE-3 speculative decoding for Kimi-K2.5 in JAX.

    from jaxspec import Engine, SpecConfig
    engine = Engine.load("ckpt")
    engine.generate(["def f(x):"], max_new_tokens=64, spec=SpecConfig(3, 1, 4))

The names below load on first use, so `import jaxspec` stays cheap and the
submodules keep importing each other without a cycle through this package.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "jaxspec.engine",
    "GenerationResult": "jaxspec.engine",
    "Session": "jaxspec.engine",
    "SpecConfig": "jaxspec.spec",
    "SamplingParams": "jaxspec.sampling",
    "ModelConfig": "jaxspec.config",
    "DraftConfig": "jaxspec.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxspec' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
