"""Algebraic simplification as a pattern table, and transpose folding into dot_general.

A rule takes an equation (operands already rewritten) and the Rewriter, and returns None (no
match), an atom (the equation's single output becomes that atom) or a new equation defining
the same outputs (which is simplified again, so chains collapse)."""
from __future__ import annotations

from typing import Callable

import numpy as np

from .. import dtypes, primitives as P
from ..core import Eqn, Graph
from .util import Rewriter, literal, new_eqn


def _is(rw: Rewriter, a, value) -> bool:
    """Whether atom a holds `value` everywhere; a float zero's sign counts."""
    u = rw.uniform(a)
    if u is None or not bool(u == value):
        return False
    return not dtypes.is_float(u.dtype) or bool(np.signbit(u) == np.signbit(value))


def right_identity(value) -> Callable:
    """op(x, c) -> x when c is `value` everywhere (x*1, x+0, x-0, x/1)."""
    def rule(e: Eqn, rw: Rewriter):
        return e.inputs[0] if _is(rw, e.inputs[1], value) else None
    rule.__name__ = f"right_identity_{value}"
    return rule


def left_identity(value) -> Callable:
    """op(c, x) -> x when c is `value` everywhere (1*x, 0+x)."""
    def rule(e: Eqn, rw: Rewriter):
        return e.inputs[1] if _is(rw, e.inputs[0], value) else None
    rule.__name__ = f"left_identity_{value}"
    return rule


def identity(e: Eqn, rw: Rewriter):
    """stop_gradient(x) -> x: after differentiation it means nothing."""
    return e.inputs[0]


def _producer(rw: Rewriter, a, name: str):
    p = rw.producer.get(getattr(a, "id", None))
    return p if p is not None and p.prim.name == name else None


def transpose_identity(e: Eqn, rw: Rewriter):
    return e.inputs[0] if tuple(e.params["permutation"]) == tuple(range(len(e.params["permutation"]))) \
        else None


def transpose_of_transpose(e: Eqn, rw: Rewriter):
    inner = _producer(rw, e.inputs[0], "transpose")
    if inner is None:
        return None
    p1, p2 = inner.params["permutation"], e.params["permutation"]
    return e.replace(inputs=inner.inputs, params=dict(permutation=tuple(p1[k] for k in p2)))


def reshape_same_shape(e: Eqn, rw: Rewriter):
    x = e.inputs[0]
    return x if tuple(x.aval.shape) == tuple(e.params["new_sizes"]) else None


def reshape_of_reshape(e: Eqn, rw: Rewriter):
    inner = _producer(rw, e.inputs[0], "reshape")
    return None if inner is None else e.replace(inputs=inner.inputs)


def _scalar_broadcast_source(rw: Rewriter, a):
    """The scalar operand when `a` is a broadcast of a scalar, else None."""
    b = _producer(rw, a, "broadcast_in_dim")
    return b.inputs[0] if b is not None and b.inputs[0].aval.shape == () else None


def layout_of_scalar_broadcast(e: Eqn, rw: Rewriter):
    """reshape/transpose of a broadcast scalar -> a broadcast of that scalar to the new shape."""
    s = _scalar_broadcast_source(rw, e.inputs[0])
    if s is None:
        return None
    return e.replace(prim=P.broadcast_in_dim, inputs=(s,),
                     params=dict(shape=e.outputs[0].aval.shape, broadcast_dimensions=()))


def convert_same_dtype(e: Eqn, rw: Rewriter):
    x = e.inputs[0]
    return x if x.aval.dtype == e.params["new_dtype"] else None


def broadcast_identity(e: Eqn, rw: Rewriter):
    x = e.inputs[0]
    same = tuple(x.aval.shape) == tuple(e.params["shape"]) and \
        tuple(e.params["broadcast_dimensions"]) == tuple(range(x.aval.ndim))
    return x if same else None


def broadcast_of_broadcast(e: Eqn, rw: Rewriter):
    inner = _producer(rw, e.inputs[0], "broadcast_in_dim")
    if inner is None:
        return None
    d1, d2 = inner.params["broadcast_dimensions"], e.params["broadcast_dimensions"]
    return e.replace(inputs=inner.inputs,
                     params=dict(shape=e.params["shape"], broadcast_dimensions=tuple(d2[d] for d in d1)))


def sink_reshape(e: Eqn, rw: Rewriter):
    """op(reshape(y), c...) -> reshape(op(y, c...)) when the other operands are uniform: the
    operation then runs in y's shape, where it can join y's kernel (mean(x, keepdims=True) is
    sum -> reshape -> div; the div becomes the reduction's epilogue)."""
    if len(e.outputs) != 1:
        return None
    shaped = [a for a in e.inputs if _producer(rw, a, "reshape") is not None]
    if len({a.id for a in shaped}) != 1:
        return None
    y = _producer(rw, shaped[0], "reshape").inputs[0]
    inputs = []
    for a in e.inputs:
        if a is shaped[0]:
            inputs.append(y)
            continue
        u = rw.uniform(a)
        if u is None:
            return None
        lit = literal(u, a.aval.dtype, a.aval.weak_type)
        if y.aval.shape == ():
            inputs.append(lit)
        else:
            b, (bv,) = new_eqn(P.broadcast_in_dim, [lit], dict(shape=y.aval.shape, broadcast_dimensions=()))
            inputs.append(bv)
            rw.emit(b)
    inner, (z,) = new_eqn(e.prim, inputs, e.params, e.source)
    return [inner, e.replace(prim=P.reshape, inputs=(z,), params=dict(new_sizes=e.outputs[0].aval.shape))]


# The table: primitive name -> rules tried in order.
RULES: dict[str, list[Callable]] = {
    "mul": [right_identity(1), left_identity(1)],
    "add": [right_identity(-0.0), left_identity(-0.0)],  # x + -0.0 is x; x + 0.0 is not for x = -0.0
    "sub": [right_identity(0.0)],
    "div": [right_identity(1)],
    "transpose": [transpose_identity, transpose_of_transpose, layout_of_scalar_broadcast],
    "reshape": [reshape_same_shape, reshape_of_reshape, layout_of_scalar_broadcast],
    "convert_element_type": [convert_same_dtype],
    "broadcast_in_dim": [broadcast_identity, broadcast_of_broadcast],
    "stop_gradient": [identity],
}
for _name, _prim in P.PRIMITIVES.items():
    if _prim.elementwise and not _prim.effectful and _name != "stop_gradient":
        RULES.setdefault(_name, []).append(sink_reshape)


def _apply(rules: dict, e: Eqn, rw: Rewriter) -> None:
    """Rewrite one equation until no rule matches, then emit it (or alias its output)."""
    while True:
        for rule in rules.get(e.prim.name, ()):
            r = rule(e, rw)
            if r is not None:
                break
        else:
            rw.emit(e)
            return
        if isinstance(r, list):  # new equations, the last defining e's outputs
            for extra in r[:-1]:
                _apply(rules, extra, rw)
            r = r[-1]
        if isinstance(r, Eqn):
            e = r
            continue
        rw.alias(e.outputs[0], r)
        return


def rewrite_with(rules: dict[str, list[Callable]], graph: Graph) -> Graph:
    """Apply a pattern table in one forward sweep, re-simplifying each rewritten equation."""
    rw = Rewriter(graph)
    for e in graph.eqns:
        _apply(rules, rw.rewrite_inputs(e), rw)
    return rw.finish()


def simplify(graph: Graph) -> Graph:
    return rewrite_with(RULES, graph)


# ---- transpose folding into dot_general ------------------------------------------------------

def _absorb_transpose(e: Eqn, rw: Rewriter, side: int):
    """dot_general(transpose(a), b) -> dot_general(a, b) with the dimension numbers mapped
    through the permutation, when the operand's free axes keep their order (so the result's
    layout is unchanged)."""
    t = _producer(rw, e.inputs[side], "transpose")
    if t is None:
        return None
    perm = t.params["permutation"]
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    contract, batch = (lc, lb) if side == 0 else (rc, rb)
    free = [i for i in range(len(perm)) if i not in contract and i not in batch]
    mapped_free = [perm[i] for i in free]
    if mapped_free != sorted(mapped_free):
        return None
    contract, batch = tuple(perm[i] for i in contract), tuple(perm[i] for i in batch)
    dn = ((contract, rc), (batch, rb)) if side == 0 else ((lc, contract), (lb, batch))
    inputs = list(e.inputs)
    inputs[side] = t.inputs[0]
    return e.replace(inputs=tuple(inputs), params={**e.params, "dimension_numbers": dn})


TRANSPOSE_RULES = {"dot_general": [lambda e, rw: _absorb_transpose(e, rw, 0),
                                   lambda e, rw: _absorb_transpose(e, rw, 1)]}


def fold_transpose_into_dot(graph: Graph) -> Graph:
    return rewrite_with(TRANSPOSE_RULES, graph)
