"""Walking a jaxpr for tests that count or inspect the operations a function traces to."""

from __future__ import annotations


def eqns(jaxpr):
    """Every equation of ``jaxpr``, then those of the jaxprs nested in its equations' parameters (jit, scan,
    cond, shard_map bodies ...), depth first."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                yield from eqns(inner)
