"""Constant folding: equations whose operands are all known are evaluated now.

Elementwise operations on uniform operands (literals and broadcasts of literals) fold to a
scalar and, for array shapes, a broadcast of it (an index map, not a materialised array);
other operations fold into a new constant only when every operand and result is small
(util.FOLD_LIMIT elements). Broadcasts and iotas stay: a kernel computes them for free."""
from __future__ import annotations

import numpy as np

from .. import primitives as P
from ..core import Graph, Literal, Var
from .util import Rewriter, foldable, literal

_NEVER = ("broadcast_in_dim", "iota")


def fold_uniform(e, scalars):
    """An elementwise equation on uniform operands (their scalars, 0-d arrays) folded: the
    literal of its 0-d result, or for an array result the broadcast of that literal (an equation
    with e's output)."""
    out = e.outputs[0]
    with np.errstate(all="ignore"):
        r = np.asarray(e.prim.impl(*scalars, **e.params)[0], out.aval.dtype)
    lit = literal(r, out.aval.dtype, out.aval.weak_type)
    if out.aval.shape == ():
        return lit
    return e.replace(prim=P.broadcast_in_dim, inputs=(lit,),
                     params=dict(shape=out.aval.shape, broadcast_dimensions=()))


def _fold_uniform(rw: Rewriter, e, scalars) -> None:
    folded = fold_uniform(e, scalars)
    if isinstance(folded, Literal):
        rw.alias(e.outputs[0], folded)
    else:
        rw.emit(folded)


def _fold_small(rw: Rewriter, e, values) -> None:
    with np.errstate(all="ignore"):
        results = e.prim.impl(*values, **e.params)
    for o, r in zip(e.outputs, results):
        r = np.asarray(r, o.aval.dtype).reshape(o.aval.shape)
        if o.aval.shape == ():
            rw.alias(o, literal(r, o.aval.dtype, o.aval.weak_type))
        else:
            rw.add_const(o, np.ascontiguousarray(r))


def fold_constants(graph: Graph) -> Graph:
    rw = Rewriter(graph)
    for e in graph.eqns:
        e = rw.rewrite_inputs(e)
        # control flow stays: evaluating a loop here would cost its whole trip count at compile time
        if e.prim.effectful or e.prim.name in _NEVER or not e.inputs or e.prim in P.CONTROL_FLOW:
            rw.emit(e)
            continue
        if e.prim.elementwise and len(e.outputs) == 1:
            scalars = [rw.uniform(a) for a in e.inputs]
            # fold only when it removes work: some operand is not already a plain literal
            if all(s is not None for s in scalars) and any(isinstance(a, Var) for a in e.inputs):
                _fold_uniform(rw, e, scalars)
                continue
        values = [rw.value(a) for a in e.inputs]
        if all(v is not None for v in values) and all(foldable(o.aval) for o in e.outputs):
            _fold_small(rw, e, values)
            continue
        rw.emit(e)
    return rw.finish()

