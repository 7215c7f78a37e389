"""Walking a jaxpr for tests that count or inspect the operations a function traces to."""

from __future__ import annotations


def eqns(jaxpr, skip: tuple[str, ...] = ()):
    """Every equation of ``jaxpr``, then those of the jaxprs nested in its equations' parameters (jit, scan,
    cond, shard_map bodies ...), depth first; not those nested in a primitive named in ``skip`` (say
    ``("scan",)``: the equations outside every scan)."""
    for e in jaxpr.eqns:
        yield e
        if e.primitive.name in skip:
            continue
        for p in e.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                yield from eqns(inner, skip)
