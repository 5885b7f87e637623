"""GEMM epilogue fusion: a dot_general (a conv) and the elementwise computation that follows it become
one fused_gemm (fused_conv), whose epilogue runs on the output tile while it is in registers or
cache. A convolution's vector extras lie along its output features (a bias per channel), a
dot_general's along its last axis.

The decision is structural: from each dot_general the pass collects the elementwise equations
whose operands are the product, values computed from it here, scalars (literals, uniform
constants, broadcasts of one), extras — arrays of the output's shape that are written out anyway
(inputs, constants, results of non-elementwise equations, graph outputs), or row vectors along
its last axis broadcast to it, of the product's dtype, that do not depend on the product (else the
fused equation would read its own result) — and elementwise values made from those, which the
epilogue recomputes (as fusion recomputes a value shared by kernels) rather than read. The largest such sub-DAG ending in one value of the
product's dtype whose intermediate values nobody else reads becomes the epilogue: a ScalarFn (the
same equations over 0-d values) that every implementation lowers as the kernel IR expression it
is. Nothing is recognised by evaluating it: clamps, `where`, comparisons and casts inside the
expression are as legal as a bias and a gelu. What does not fit (a value read elsewhere, a bias
along another axis, an extra of another dtype) stays outside, unfused. The fused equation takes
the place of the sub-DAG's last equation (its operands are all defined before it); the dead
producers are left for dce. The pass runs after fuse_attention, whose pattern starts with the
scores' dot_general and its scale and mask."""
from __future__ import annotations

import numpy as np

from .. import primitives as P
from ..core import Eqn, Graph, Literal, ShapedArray, Var
from .util import literal, new_eqn

MAX_EPILOGUE = 64  # elementwise equations an epilogue may take
FUSIBLE_DTYPES = ("float32", "float16", "bfloat16")


class _Graph:
    """Producers, readers and scalar values of one graph."""

    def __init__(self, g: Graph):
        self.g = g
        self.pos = {id(e): i for i, e in enumerate(g.eqns)}
        self.producer = {o.id: e for e in g.eqns for o in e.outputs}
        self.readers: dict[int, list[Eqn]] = {}
        for e in g.eqns:
            for a in e.inputs:
                if isinstance(a, Var):
                    self.readers.setdefault(a.id, []).append(e)
        self.outputs = {v.id for v in g.outvars if isinstance(v, Var)}
        self.consts = {v.id: np.asarray(c) for v, c in zip(g.constvars, g.consts)}
        self.fused: set[int] = set()  # results of the fused_gemms made so far: written out

    def scalar(self, a) -> Literal | None:
        """The one value an atom holds everywhere (a literal, a uniform constant or a broadcast
        of one), as a literal of the atom's dtype; else None."""
        if isinstance(a, Literal):
            return literal(a.val, a.aval.dtype)
        if a.id in self.consts:
            v = self.consts[a.id]
        else:
            p = self.producer.get(a.id)
            if p is None or p.prim is not P.broadcast_in_dim:
                return None
            inner = self.scalar(p.inputs[0])
            return None if inner is None else literal(inner.val, a.aval.dtype)
        flat = v.reshape(-1)
        if flat.size == 0:
            return None
        first = flat[0]
        same = flat == first
        if np.issubdtype(flat.dtype, np.inexact) or flat.dtype.kind == "V":
            same = same | (np.isnan(flat.astype(np.float64)) & np.isnan(np.float64(first)))
        return literal(first, a.aval.dtype) if bool(np.all(same)) else None


class _Epilogue:
    """The candidate epilogue of one product y: its equations and how each operand is read."""

    def __init__(self, G: _Graph, y: Var, axis: int):
        self.G, self.y, self.axis = G, y, axis  # axis: where a vector extra lies (a GEMM's columns, a conv's features)
        self.shape, self.dtype = y.aval.shape, np.dtype(y.aval.dtype)
        self._at = G.pos[id(G.producer[y.id])]
        self._not_from_y: set[int] = set()  # variables known not to be computed from y

    def from_product(self, a: Var) -> bool:
        """Whether `a` is computed from the product y (an operand that is would make the fused
        equation read its own result): a search back from a through the equations placed after
        y's (the graph's order is topological), so each product costs the values its epilogue
        asks about, not the whole graph below it (a training step: every GEMM's forward value
        reaches the loss, the backward pass and the update)."""
        if a.id == self.y.id or a.id in self._not_from_y:
            return False
        G, seen, work = self.G, {a.id}, [a]
        while work:
            p = G.producer.get(work.pop().id)
            if p is None or G.pos[id(p)] <= self._at:
                continue
            for x in p.inputs:
                if isinstance(x, Var) and x.id not in seen and x.id not in self._not_from_y:
                    if x.id == self.y.id:
                        return True
                    seen.add(x.id)
                    work.append(x)
        self._not_from_y |= seen
        return False

    def extra(self, a) -> Var | None:
        """The array an operand reads as an extra (itself, or the row it broadcasts), or None."""
        if not isinstance(a, Var) or a.id == self.y.id or a.aval.dtype != self.dtype or self.from_product(a):
            return None
        p = self.G.producer.get(a.id)
        if p is not None and p.prim is P.broadcast_in_dim:
            x = p.inputs[0]
            if isinstance(x, Var) and x.aval.shape == self.shape[self.axis:self.axis + 1] and \
                    p.params["broadcast_dimensions"] == (self.axis,) and x.aval.dtype == self.dtype:
                return x  # a vector along the output's columns or features (a bias)
            return self._unit_axes_vector(x, p.params["broadcast_dimensions"])
        if a.aval.shape != self.shape:
            return None
        if p is not None and p.prim.elementwise and a.id not in self.G.outputs and a.id not in self.G.fused:
            return None  # an elementwise value is not written out unless needed: recompute it (_side)
        return a

    def _unit_axes_vector(self, x, dims) -> Var | None:
        """The vector v when x = reshape(v) holds it along the output's vector axis between unit
        axes (a conv's bias as b[None, :, None, None]); else None (a broadcast along other axes:
        fusing it would write it out whole)."""
        want = self.shape[self.axis]
        if not isinstance(x, Var) or x.aval.dtype != self.dtype or \
                [n for n in x.aval.shape if n != 1] != [want] or dims[x.aval.shape.index(want)] != self.axis:
            return None
        r = self.G.producer.get(x.id)
        v = r.inputs[0] if r is not None and r.prim is P.reshape else None
        if not isinstance(v, Var) or v.aval.shape != (want,) or self.from_product(v):
            return None
        return v

    def _fusible(self, e: Eqn, gone: set) -> bool:
        return id(e) not in gone and e.prim.elementwise and not e.prim.effectful and \
            len(e.outputs) == 1 and e.outputs[0].aval.shape == self.shape

    def _side(self, a, gone: set, taken: set, pulled: list) -> bool:
        """Whether `a` is a scalar, an extra, or an elementwise value made from those, not from y
        (its equations, appended to `pulled`, are recomputed in the epilogue, as fusion recomputes
        a value shared by several kernels, and stay where they are for their other readers)."""
        if self.G.scalar(a) is not None or self.extra(a) is not None:
            return True
        p = self.G.producer.get(a.id)
        if p is None or not self._fusible(p, gone) or self.from_product(a) or len(pulled) >= MAX_EPILOGUE:
            return False
        if id(p) in taken or any(p is q for q in pulled):
            return True
        if all(self._side(x, gone, taken, pulled) for x in p.inputs):
            pulled.append(p)
            return True
        return False

    def closure(self, gone: set) -> tuple[list[Eqn], set]:
        """Elementwise equations over y, values computed from y here, scalars, extras and the
        values made from those; and the ids of the values computed from y."""
        G, inside, chain, taken, work = self.G, {self.y.id}, [], set(), [self.y]
        while work and len(chain) < MAX_EPILOGUE:
            v = work.pop()
            for e in G.readers.get(v.id, ()):
                if id(e) in taken or not self._fusible(e, gone):
                    continue
                pulled: list = []
                if all((isinstance(a, Var) and a.id in inside) or self._side(a, gone, taken, pulled)
                       for a in e.inputs):
                    for x in pulled + [e]:
                        chain.append(x)
                        taken.add(id(x))
                    inside.add(e.outputs[0].id)
                    work.append(e.outputs[0])
        return sorted(chain, key=lambda e: G.pos[id(e)]), inside

    def best(self, gone: set):
        """(equations, sink) of the largest epilogue: the sink's ancestors in the closure, whose
        values computed from y (y included) no one outside them reads; or None."""
        G = self.G
        if self.y.id in G.outputs:  # y must stay: an epilogue would replace it
            return None
        chain, inside = self.closure(gone)
        by_out = {e.outputs[0].id: e for e in chain}
        for e in reversed(chain):
            sink = e.outputs[0]
            if sink.aval.dtype != self.dtype or sink.id not in inside:
                continue
            sub, stack = {}, [sink]
            while stack:
                x = by_out.get(stack.pop().id)
                if x is not None and id(x) not in sub:
                    sub[id(x)] = x
                    stack.extend(a for a in x.inputs if isinstance(a, Var))
            inner = [self.y] + [s.outputs[0] for s in sub.values() if s is not e and s.outputs[0].id in inside]
            if any(v.id in G.outputs or any(id(r) not in sub for r in G.readers.get(v.id, ()))
                   for v in inner):
                continue  # y or a value computed from it is read elsewhere
            return [x for x in chain if id(x) in sub], sink
        return None

    def scalar_fn(self, eqns: list[Eqn]) -> tuple[P.ScalarFn, list[Var]]:
        """The epilogue over 0-d values, and the extras in the order it takes them."""
        y0 = Var(ShapedArray((), self.dtype))
        env, extras, ins, body = {self.y.id: y0}, [], [y0], []
        for e in eqns:
            atoms = []
            for a in e.inputs:
                if isinstance(a, Var) and a.id in env:
                    atoms.append(env[a.id])
                    continue
                lit = self.G.scalar(a)
                if lit is not None:
                    atoms.append(lit)
                    continue
                x = self.extra(a)
                if not any(x is z for z in extras):
                    extras.append(x)
                    ins.append(Var(ShapedArray((), self.dtype)))
                    env[x.id] = ins[-1]
                atoms.append(env[x.id])
            new, (o,) = new_eqn(e.prim, atoms, e.params)
            env[e.outputs[0].id] = o
            body.append(new)
        return P.ScalarFn(Graph((), tuple(ins), tuple(body), (env[eqns[-1].outputs[0].id],))), extras


def _vector_axis(eqn: Eqn) -> int:
    """The output axis a product's vector extras lie along: a GEMM's last (columns), a conv's features."""
    if eqn.prim is P.conv:
        return eqn.params["dimension_numbers"][2][1]
    return eqn.outputs[0].aval.ndim - 1


def _fuse_from(G: _Graph, prod: Eqn, gone: set):
    """The fused_gemm (or fused_conv) replacing a dot_general (conv) and its epilogue, and the
    equations it consumes (the product and those computed from it; none that an earlier rewrite
    took: `gone`). Equations the epilogue recomputes from other values stay for their other
    readers (dce drops the rest)."""
    ep = _Epilogue(G, prod.outputs[0], _vector_axis(prod))
    found = ep.best(gone)
    if found is None:
        return None
    eqns, sink = found
    fn, extras = ep.scalar_fn(eqns)
    if prod.prim is P.conv:
        prim, params = P.fused_conv, {**prod.params, "epilogue": fn}
    else:
        prim = P.fused_gemm
        params = {"dimension_numbers": prod.params["dimension_numbers"],
                  "preferred_element_type": prod.params.get("preferred_element_type"), "epilogue": fn}
    fused = Eqn(prim, tuple(prod.inputs[:2]) + tuple(extras), (sink,), params, prod.source)
    return fused, [prod] + [e for e in eqns if ep.from_product(e.outputs[0])]


def fuse_gemm_epilogues(graph: Graph) -> Graph:
    G = _Graph(graph)
    replaced: dict[int, Eqn] = {}  # id of an epilogue's last equation -> the fused equation
    gone: set[int] = set()
    for e in graph.eqns:
        if e.prim not in (P.dot_general, P.conv) or id(e) in gone or \
                np.dtype(e.outputs[0].aval.dtype).name not in FUSIBLE_DTYPES:
            continue
        r = _fuse_from(G, e, gone)
        if r is None:
            continue
        fused, taken = r
        gone.update(id(t) for t in taken)
        G.fused.add(fused.outputs[0].id)
        replaced[id(max(taken, key=lambda t: G.pos[id(t)]))] = fused
    if not replaced:
        return graph
    eqns = [replaced.get(id(e), e) for e in graph.eqns if id(e) not in gone or id(e) in replaced]
    return graph.replace(eqns=tuple(eqns))


# ---- the way back: a fused_gemm as dot_general and ordinary elementwise equations ---------------

def unfused_graph(eqn: Eqn) -> Graph:
    """A graph computing `eqn` (a fused_gemm or fused_conv) with dot_general (conv) and its
    epilogue's equations over the same input and output variables: for a device whose GEMM takes
    no epilogue, and to check the fused result against."""
    lhs, rhs, *extras = eqn.inputs
    out = eqn.outputs[0]
    shape = out.aval.shape
    eqns = []

    def emit(prim, *ins, **params):
        e, (o,) = new_eqn(prim, ins, params)
        eqns.append(e)
        return o
    fn: P.ScalarFn = eqn.params["epilogue"]
    if eqn.prim is P.fused_conv:
        y = emit(P.conv, lhs, rhs, **P.conv_params(eqn.params))
        axis = eqn.params["dimension_numbers"][2][1]
    else:
        y = emit(P.dot_general, lhs, rhs, dimension_numbers=eqn.params["dimension_numbers"],
                 preferred_element_type=eqn.params["preferred_element_type"])
        axis = out.aval.ndim - 1
    full = [x if x.aval.shape == shape else
            emit(P.broadcast_in_dim, x, shape=shape, broadcast_dimensions=(axis,)) for x in extras]
    env = {v.id: a for v, a in zip(fn.graph.invars, [y, *full])}
    for e in fn.graph.eqns:
        ins = [env[a.id] if isinstance(a, Var) else
               emit(P.broadcast_in_dim, a, shape=shape, broadcast_dimensions=()) for a in e.inputs]
        env[e.outputs[0].id] = emit(e.prim, *ins, **e.params)
    last = eqns[-1]
    eqns[-1] = last.replace(outputs=(out,))  # the fused equation's own output variable
    return Graph((), tuple(eqn.inputs), tuple(eqns), (out,))
