"""Dead-code elimination: drop equations whose outputs nobody reads, and unused constants.
Effectful equations (debug_print, or a loop that holds one) are always kept."""
from __future__ import annotations

from ..core import Graph, Var
from ..primitives import has_effect


def dce(graph: Graph) -> Graph:
    live = {v.id for v in graph.outvars if isinstance(v, Var)}
    kept = []
    for e in reversed(graph.eqns):
        if has_effect(e) or any(o.id in live for o in e.outputs):
            kept.append(e)
            live.update(a.id for a in e.inputs if isinstance(a, Var))
    pairs = [(v, c) for v, c in zip(graph.constvars, graph.consts) if v.id in live]
    return graph.replace(eqns=tuple(reversed(kept)), constvars=tuple(v for v, _ in pairs),
                         consts=tuple(c for _, c in pairs))
