"""Shape-generic tracing for jit: one trace of a function serves every size its guards allow.

jit traces a function's first call with every dimension of its array arguments symbolic (an
ir.symbolic.Dim per axis of size other than 0 and 1, whose value at the trace is the call's),
so the graph records sizes as expressions (reshape(b, t, 3, h, d), a mean's count) and the guards
record every question the trace asked of them. A later call whose arguments differ only in
those sizes binds the symbols to its own sizes; where that binding is consistent (a symbol takes
one value) and every guard answers as at the trace, the graph is instantiated for the new sizes
(`instantiate`: the expressions evaluated, no Python run) instead of traced again. Otherwise the
call traces as before. A trace that fails symbolically (an operation without a rule for Dims)
is traced again concretely, so errors are the concrete trace's.

The trace is the user's Python run once per set of guards instead of once per shape: Python
side effects in the function (a print) run when it traces, as under JAX, but a new batch size
that the guards allow does not trace."""
from __future__ import annotations

from tilefuse.ir import primitives as P
from tilefuse.ir.core import Graph, Literal, ShapedArray, Var
from tilefuse.ir.symbolic import Dim, ShapeEnv, Values, concrete, evaluate, is_symbolic


TEMPLATES_MOST = 8  # shape-generic traces kept per jitted function and argument structure


class Template:
    """A graph traced with symbolic sizes: its symbolic input avals, the env of its guards."""
    __slots__ = ("graph", "out_tree", "env", "in_avals")

    def __init__(self, graph: Graph, out_tree, env: ShapeEnv, in_avals: tuple):
        self.graph, self.out_tree, self.env, self.in_avals = graph, out_tree, env, in_avals

    def bind(self, avals) -> list | None:
        """The symbols' values (one per axis) for these argument avals, or None where they do not
        fit (another rank or dtype, a fixed size that differs) or a guard answers otherwise."""
        values = list(self.env.hints)
        for t, a in zip(self.in_avals, avals):
            if t.dtype != a.dtype or t.weak_type != a.weak_type or len(t.shape) != len(a.shape):
                return None
            for d, n in zip(t.shape, a.shape):
                if type(d) is Dim:
                    values[d.key[1]] = int(n)
                elif d != n:
                    return None
        return values if self.env.holds(values) else None


def symbolic_avals(avals) -> tuple[ShapeEnv, tuple]:
    """The avals with every size but 0 and 1 a symbol, one per axis: a batch of 128 beside a
    hidden size of 128 stays free of it (where the program compares two axes, a guard ties
    them). env is None when there is none."""
    env = ShapeEnv()
    out = []
    for a in avals:
        if any(d > 1 for d in a.shape):
            a = ShapedArray(tuple(d if d <= 1 else env.symbol(d) for d in a.shape), a.dtype, a.weak_type)
        out.append(a)
    return (env if env.hints else None), tuple(out)


def instantiate(graph: Graph, values) -> Graph:
    """The graph at these symbol values: every Dim in avals and parameters evaluated, each
    dim_value a literal. Variables whose avals are concrete are shared with the template."""
    if not isinstance(values, Values):
        values = Values(values)
    atoms: dict = {}

    def var(v: Var) -> Var:
        nv = atoms.get(v.id)
        if nv is None:
            nv = atoms[v.id] = Var(_aval(v.aval, values)) if is_symbolic(v.aval.shape) else v
        return nv

    def read(a):
        return a if isinstance(a, Literal) else atoms.get(a.id, a)

    constvars = tuple(var(v) for v in graph.constvars)
    invars = tuple(var(v) for v in graph.invars)
    eqns = []
    sizes: set = set()  # the sizes used as values: literals now
    for e in graph.eqns:
        if e.prim is P.dim_value:
            out = e.outputs[0]
            atoms[out.id] = Literal(evaluate(e.params["value"], values), out.aval)
            sizes.add(out.id)
            continue
        if e.prim is P.convert_element_type and isinstance(e.inputs[0], Var) and e.inputs[0].id in sizes:
            # what the concrete trace writes: a Python number converted at trace time, a literal
            out = e.outputs[0]
            atoms[out.id] = Literal(atoms[e.inputs[0].id].val.astype(out.aval.dtype), out.aval)
            continue
        params = {k: _param(v, values) for k, v in e.params.items()}
        eqns.append(e.replace(inputs=tuple(read(a) for a in e.inputs),
                              outputs=tuple(var(v) for v in e.outputs), params=params))
    return Graph(constvars, invars, tuple(eqns), tuple(read(v) for v in graph.outvars), graph.consts)


def _aval(a: ShapedArray, values) -> ShapedArray:
    return ShapedArray(tuple(evaluate(d, values) for d in a.shape), a.dtype, a.weak_type)


def _param(v, values):
    t = type(v)
    if t is Graph:
        return instantiate(v, values)
    if t is ShapedArray:
        return _aval(v, values) if is_symbolic(v.shape) else v
    if t is tuple and v and type(v[0]) is Graph:
        return tuple(instantiate(g, values) for g in v)
    return concrete(v, values)
