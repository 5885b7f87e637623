"""Algebraic simplification as a pattern table, and transpose folding into dot_general.

A rule takes an equation (operands already rewritten) and the Rewriter, and returns None (no
match), an atom (the equation's single output becomes that atom) or a new equation defining
the same outputs (which is simplified again, so chains collapse)."""
from __future__ import annotations

import math
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
    """op(reshape(y), c...) -> reshape(op(y, c...)) when the other operands are uniform (a
    literal, or a broadcast of one scalar: a shape-generic trace's size, dim_value, is one): the
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
            u = _scalar_broadcast_source(rw, a)
            if u is None:
                return None
            lit = u
        else:
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
def _is_pos_zero(rw: Rewriter, a) -> bool:
    return _is(rw, a, 0.0) if dtypes.is_float(a.aval.dtype) else _is(rw, a, 0)


def _pieces(rw: Rewriter, a):
    """a as +0 padding around whole pieces along one axis: (axis, [(start, piece), ...]) where a
    is pad(x) with a +0 fill, no interior padding and one padded axis, or a concatenate (seen
    inside such a pad too) whose parts become the pieces; else None."""
    p = _producer(rw, a, "pad")
    axis, lo, src = None, 0, a
    if p is not None:
        cfg = p.params["padding_config"]
        padded = [i for i, c in enumerate(cfg) if tuple(c) != (0, 0, 0)]
        if len(padded) != 1 or cfg[padded[0]][2] != 0 or min(cfg[padded[0]][:2]) < 0 or \
                not _is_pos_zero(rw, p.inputs[1]):
            return None
        axis, lo, src = padded[0], cfg[padded[0]][0], p.inputs[0]
    c = _producer(rw, src, "concatenate")
    if c is not None and axis in (None, c.params["dimension"]):
        axis, parts = c.params["dimension"], c.inputs
    elif p is not None:
        parts = (src,)
    else:
        return None
    out, start = [], lo
    for x in parts:
        out.append((start, x))
        start += x.aval.shape[axis]
    return axis, out


def add_of_disjoint_pads(e: Eqn, rw: Rewriter):
    """pad(a) + pad(b), +0-padded along one axis where a and b meet without overlapping -> one
    pad of concatenate(a + 0, b + 0) (the gradient of slicing qkv into q, k and v writes three
    pads and two full adds). Exact: inside a piece the sum is piece + 0.0 (+0 turns -0.0 into
    +0.0, so the +0 is kept; it fuses into the concatenate), outside every piece 0 + 0."""
    x, y = (_pieces(rw, a) for a in e.inputs)
    out = e.outputs[0].aval
    if x is None or y is None or x[0] != y[0] or \
            any(a.aval.shape != out.shape or a.aval.dtype != out.dtype for a in e.inputs):
        return None
    axis = x[0]
    pieces = sorted(x[1] + y[1], key=lambda s: s[0])
    if any(s0 + a.aval.shape[axis] != s1 for (s0, a), (s1, _) in zip(pieces, pieces[1:])):
        return None  # overlapping, or a gap between them
    zero = literal(0, out.dtype)
    eqns = []
    parts = []
    for _, a in pieces:
        added = _producer(rw, a, "add")
        if added is not None and _is_pos_zero(rw, added.inputs[1]):  # + 0 already (an earlier rewrite's)
            parts.append(a)
            continue
        eqns.append(new_eqn(P.broadcast_in_dim, (zero,), {"shape": a.aval.shape, "broadcast_dimensions": ()})[0])
        eqns.append(new_eqn(P.add, (a, eqns[-1].outputs[0]), {})[0])
        parts.append(eqns[-1].outputs[0])
    eqns.append(new_eqn(P.concatenate, parts, {"dimension": axis})[0])  # (two operands: two pieces at least)
    whole = eqns[-1].outputs[0]
    lo = pieces[0][0]
    hi = out.shape[axis] - lo - whole.aval.shape[axis]
    cfg = tuple((lo, hi, 0) if i == axis else (0, 0, 0) for i in range(len(out.shape)))
    last = new_eqn(P.pad, (whole, zero), {"padding_config": cfg})[0] if lo or hi else None
    if last is None:
        eqns[-1] = eqns[-1].replace(outputs=e.outputs)
    else:
        eqns.append(last.replace(outputs=e.outputs))
    return eqns


RULES: dict[str, list[Callable]] = {
    "mul": [right_identity(1), left_identity(1)],
    # x + -0.0 is x; x + 0.0 is not for x = -0.0
    "add": [right_identity(-0.0), left_identity(-0.0), add_of_disjoint_pads],
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


# ---- the layouts the GEMM reads in place ----------------------------------------------------------

def _dot_layout(e: Eqn, rw: Rewriter):
    """dot_general whose operand's axes do not collapse into one strided GEMM (einsum('ok,nkp->nop'):
    the rhs's free axes n and p lie on either side of k), a product past the generic kernel's
    size: that operand transposed into GEMM order (batch, free, contracting; the rhs's batch,
    contracting, free), its axes renumbered. Exact (data movement only) and the result's layout is
    unchanged (free axes keep their order): the shared GEMM then runs where the generic kernel ran
    (one pass over the operand against a GEMM's K passes; 7x faster at 8 x 576 x 1024)."""
    from ..kernel.matmul import MIN_FLOPS, dot_axes, matmul_layout
    lhs, rhs = e.inputs[:2]
    if not all(hasattr(v, "id") and dtypes.is_float(v.aval.dtype) for v in (lhs, rhs)) or \
            matmul_layout(e) is not None:
        return None
    (lc, _), (lb, _) = e.params["dimension_numbers"]
    batch_k = math.prod(lhs.aval.shape[a] for a in (*lb, *lc))
    if 2 * lhs.aval.size * rhs.aval.size < MIN_FLOPS * max(1, batch_k):  # (2 b m n k < MIN_FLOPS)
        return None
    eqns, ins = [], []
    for x, order in zip((lhs, rhs), dot_axes(e)):
        if order != tuple(range(len(order))):
            t, (x,) = new_eqn(P.transpose, (x,), {"permutation": tuple(order)}, e.source)
            eqns.append(t)
        ins.append(x)
    nb, nc = len(lb), len(lc)
    nlf = lhs.aval.ndim - nb - nc
    dn = ((tuple(range(nb + nlf, nb + nlf + nc)), tuple(range(nb, nb + nc))), (tuple(range(nb)),) * 2)
    return eqns + [e.replace(inputs=(*ins, *e.inputs[2:]), params={**e.params, "dimension_numbers": dn})]


def dot_layouts(graph: Graph) -> Graph:
    """Every large float dot_general reads operands the GEMM takes in place (_dot_layout)."""
    return rewrite_with({"dot_general": [_dot_layout], "transpose": RULES["transpose"]}, graph)
