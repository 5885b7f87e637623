"""What the graph passes share: a rewriter that rebuilds a graph while substituting variables,
and questions about constant values (is this atom a known array? a uniform scalar?)."""
from __future__ import annotations

import numpy as np

from .. import dtypes
from .. import primitives as P
from ..core import Eqn, Graph, Literal, ShapedArray, Var
from ..symbolic import Dim

# Constants up to this many elements are folded into new constants; larger ones stay computed.
FOLD_LIMIT = 1024


def foldable(aval) -> bool:
    """Whether a value of this aval is small enough to fold. A symbolic size (a template's, run
    through the passes once for every size) never is: the answer then holds at every size."""
    n = aval.size
    return type(n) is not Dim and n <= FOLD_LIMIT


def is_literal(a) -> bool:
    return isinstance(a, Literal)


def literal(value, dtype, weak_type: bool = False) -> Literal:
    return Literal(np.asarray(value, dtype), ShapedArray((), np.dtype(dtype), weak_type))


def new_eqn(prim, inputs, params, source: str = "") -> tuple[Eqn, list[Var]]:
    """An equation with fresh output variables typed by the primitive's shape rule."""
    outs = [Var(a) for a in prim.abstract_eval(*[x.aval for x in inputs], **params)]
    return Eqn(prim, tuple(inputs), tuple(outs), dict(params), source), outs


class Rewriter:
    """Rebuilds a graph equation by equation. Inputs are read through the substitution, so a
    rule sees its operands already rewritten; `producer` maps a variable to its (new) equation."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.subst: dict[int, object] = {}
        self.eqns: list[Eqn] = []
        self.producer: dict[int, Eqn] = {}
        self.consts: dict[int, np.ndarray] = {}  # var id -> value of (small) constvars
        self.new_constvars: list[Var] = []
        self.new_consts: list = []
        for v, c in zip(graph.constvars, graph.consts):
            if foldable(v.aval):
                self.consts[v.id] = np.asarray(c, v.aval.dtype)

    def read(self, a):
        return a if isinstance(a, Literal) else self.subst.get(a.id, a)

    def rewrite_inputs(self, e: Eqn) -> Eqn:
        ins = tuple(self.read(a) for a in e.inputs)
        return e if ins == e.inputs else e.replace(inputs=ins)

    def emit(self, e: Eqn) -> None:
        self.eqns.append(e)
        for o in e.outputs:
            self.producer[o.id] = e

    def alias(self, var: Var, atom) -> None:
        """Every later use of `var` reads `atom` instead (same shape and dtype)."""
        assert (var.aval.shape, var.aval.dtype) == (atom.aval.shape, atom.aval.dtype), (var, atom)
        self.subst[var.id] = atom

    def add_const(self, var: Var, value: np.ndarray) -> None:
        """Bind `var` to a new constant (it is then defined by no equation)."""
        self.new_constvars.append(var)
        self.new_consts.append(value)
        self.consts[var.id] = value

    def value(self, a):
        """The concrete value of an atom if it is a literal, a small constant or a small
        broadcast of one, else None."""
        if isinstance(a, Literal):
            return a.val
        v = self.consts.get(a.id)
        if v is None and foldable(a.aval):
            p = self.producer.get(a.id)
            if p is not None and p.prim.name == "broadcast_in_dim":
                x = self.value(p.inputs[0])
                if x is not None:
                    v = p.prim.impl(x, **p.params)[0]
        return v

    def uniform(self, a):
        """The scalar an atom holds everywhere (a literal, a broadcast of one, or a small constant
        whose elements are all equal), as a 0-d array; else None."""
        v = self.value(a)
        if v is not None:
            if v.size == 0:
                return None
            flat = v.reshape(-1)
            first = flat[0]
            same = flat == first
            if dtypes.is_float(v.dtype):  # -0.0 is not 0.0 (x + 0.0 is no identity: -0.0 + 0.0 = 0.0)
                same = (same & (np.signbit(flat) == np.signbit(first))) | (np.isnan(flat) & np.isnan(first))
            return np.asarray(first) if bool(np.all(same)) else None
        p = self.producer.get(a.id)
        if p is not None and p.prim.name == "broadcast_in_dim":
            return self.uniform(p.inputs[0])
        return None

    def finish(self) -> Graph:
        g = self.graph
        outvars = tuple(self.read(v) for v in g.outvars)
        return g.replace(constvars=g.constvars + tuple(self.new_constvars),
                         consts=tuple(g.consts) + tuple(self.new_consts),
                         eqns=tuple(self.eqns), outvars=outvars)


class Emit:
    """Appends equations; `em(prim, *inputs, **params)` returns the output variable(s)."""

    def __init__(self):
        self.eqns: list = []

    def __call__(self, prim, *inputs, **params):
        e, outs = new_eqn(prim, inputs, params)
        self.eqns.append(e)
        return outs if prim.multiple_results else outs[0]

    def full(self, value, like):
        return self(P.broadcast_in_dim, literal(value, like.aval.dtype), shape=like.aval.shape,
                    broadcast_dimensions=())

    def expand(self, x, like):
        """x (batch..., Sq) broadcast along the last axis of `like` (batch..., Sq, Sk)."""
        return self(P.broadcast_in_dim, x, shape=like.aval.shape,
                    broadcast_dimensions=tuple(range(x.aval.ndim)))

    def permute(self, x, perm):
        perm = tuple(int(p) for p in perm)
        return x if perm == tuple(range(len(perm))) else self(P.transpose, x, permutation=perm)
