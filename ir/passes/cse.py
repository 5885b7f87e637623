"""Common-subexpression elimination: an equation equal to an earlier one (same primitive,
operands and parameters) reuses the earlier one's outputs."""
from __future__ import annotations

import numpy as np

from ..core import Graph, Literal
from ..primitives import has_effect
from ..symbolic import by_value
from .util import Rewriter


def _atom_key(a):
    if isinstance(a, Literal):
        return ("lit", a.val.dtype.str, a.val.tobytes(), a.aval.weak_type)
    return ("var", a.id)


def _params_key(params: dict):
    items = []
    for k, v in sorted(params.items()):
        if isinstance(v, np.ndarray):
            v = (v.dtype.str, v.shape, v.tobytes())
        items.append((k, by_value(v)))  # (a template's sizes hashed without a guard: symbolic/_ByValue)
    key = tuple(items)
    try:
        hash(key)
    except TypeError:  # an unhashable parameter: treat the equation as unique
        return None
    return key


def cse(graph: Graph) -> Graph:
    rw = Rewriter(graph)
    seen: dict = {}
    for e in graph.eqns:
        e = rw.rewrite_inputs(e)
        pk = None if has_effect(e) else _params_key(e.params)
        key = None if pk is None else (e.prim.name, tuple(map(_atom_key, e.inputs)), pk)
        if key is not None and key in seen:
            for o, prev in zip(e.outputs, seen[key].outputs):
                rw.alias(o, prev)
            continue
        if key is not None:
            seen[key] = e
        rw.emit(e)
    return rw.finish()
