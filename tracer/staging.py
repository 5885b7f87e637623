"""Staging: tracing a Python function into a Graph (what jit compiles)."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from tilefuse.ir.core import Eqn, Graph, Literal, ShapedArray, Var, aval_of_value
from tilefuse.ir.errors import user_line

from tilefuse.ir import primitives as P

from .core import Trace, Tracer, full_raise, new_dynamic, new_main


class StagingTracer(Tracer):
    __slots__ = ("_trace", "_aval")

    def __init__(self, trace, aval):
        self._trace, self._aval = trace, aval

    @property
    def aval(self):
        return self._aval


class GraphBuilder:
    """Collects equations while tracing; tracers map to graph variables."""

    def __init__(self):
        self.eqns: list[Eqn] = []
        self.vars: dict[int, Var] = {}  # id(tracer) -> Var
        self.tracers: list[Tracer] = []  # keeps tracers alive so ids stay unique
        self.consts: dict[int, tuple[Var, object]] = {}  # id(value) -> (var, value)
        self.const_tracers: dict[int, Tracer] = {}

    def new_tracer(self, trace, aval) -> StagingTracer:
        t = StagingTracer(trace, aval)
        self.tracers.append(t)
        self.vars[id(t)] = Var(aval)
        return t

    def const_tracer(self, trace, val) -> StagingTracer:
        key = id(val)
        if key in self.const_tracers:
            return self.const_tracers[key]
        aval = aval_of_value(val)
        t = self.new_tracer(trace, aval)
        self.consts[id(t)] = (self.vars[id(t)], val)
        self.const_tracers[key] = t
        self.tracers.append(val)  # keep the constant alive: its id is a key
        return t

    def atom(self, t: Tracer):
        """A graph input for a tracer: a Literal for a captured scalar, else its Var."""
        entry = self.consts.get(id(t))
        if entry is not None:
            var, val = entry
            # a captured concrete scalar is written into the equation; a tracer of an outer
            # transformation stays a constant input (its value is not ours to bake in)
            if var.aval.shape == () and not isinstance(val, Tracer):
                return Literal(np.asarray(val), var.aval)
        return self.vars[id(t)]

    def build(self, in_tracers: Sequence[Tracer], out_tracers: Sequence[Tracer]) -> Graph:
        invars = tuple(self.vars[id(t)] for t in in_tracers)
        outvars = tuple(self.atom(t) for t in out_tracers)
        used: set[int] = set()
        for e in self.eqns:
            used.update(a.id for a in e.inputs if isinstance(a, Var))
        used.update(v.id for v in outvars if isinstance(v, Var))
        in_ids = {v.id for v in invars}
        constvars, consts = [], []
        for var, val in self.consts.values():
            if (var.aval.shape != () or isinstance(val, Tracer)) and var.id in used and var.id not in in_ids:
                constvars.append(var)
                # graph constants are host arrays (backends upload them), or outer tracers
                consts.append(val if isinstance(val, (Tracer, np.ndarray)) else np.asarray(val))
        return Graph(tuple(constvars), invars, tuple(self.eqns), outvars, tuple(consts))


class StagingTrace(Trace):
    """Records primitives as equations instead of running them."""

    @property
    def builder(self) -> GraphBuilder:
        return self.main.global_data

    def pure(self, val):
        return self.builder.const_tracer(self, val)

    lift = pure  # values of lower traces are constants of this graph

    def process_primitive(self, prim, tracers, params):
        b = self.builder
        out_avals = prim.abstract_eval(*(t.aval for t in tracers), **params)
        outs = [b.new_tracer(self, a) for a in out_avals]
        b.eqns.append(Eqn(prim, tuple(b.atom(t) for t in tracers),
                          tuple(b.vars[id(o)] for o in outs), params, user_line()))
        return outs

    # a custom_vjp/custom_jvp function stays whole, with its rule, so a transformation outside
    # the staged graph (grad of a jitted function) finds the rule when it replays the graph
    def process_custom_vjp(self, fun, fwd, bwd, tracers, out_tree_thunk):
        return _stage_call(self, P.custom_vjp_call, fun, tracers, fwd=fwd, bwd=bwd)

    def process_custom_jvp(self, fun, jvp, tracers):
        return _stage_call(self, P.custom_jvp_call, fun, tracers, jvp=jvp)


def trace_to_graph(f: Callable, in_avals: Sequence[ShapedArray]) -> tuple[Graph, object]:
    """Trace f over flat inputs of the given avals; f returns a flat list of outputs.
    Returns the Graph and whatever f's `aux` was (f returns (outs, aux))."""
    builder = GraphBuilder()
    with new_main(StagingTrace, builder) as main:
        with new_dynamic(main):
            trace = StagingTrace(main)
            in_tracers = [builder.new_tracer(trace, a) for a in in_avals]
            outs, aux = f(*in_tracers)
            out_tracers = [trace.pure(o) if not isinstance(o, Tracer) or o._trace.main is not main
                           else o for o in outs]
            graph = builder.build(in_tracers, out_tracers)
    return graph, aux


def closed_graph(fun: Callable, avals) -> tuple[Graph, tuple]:
    """Trace fun (-> (output leaves, aux)) over avals into a graph whose captured constants are
    its leading inputs, and those constants: the body of a call primitive."""
    graph, _ = trace_to_graph(fun, list(avals))
    return graph.replace(constvars=(), invars=graph.constvars + graph.invars, consts=()), graph.consts


def _stage_call(trace: "StagingTrace", prim, fun: Callable, tracers, **rules) -> list:
    graph, consts = closed_graph(lambda *xs: (list(fun(*xs)), None), [t.aval for t in tracers])
    ins = [full_raise(trace, c) for c in consts] + list(tracers)
    return trace.process_primitive(prim, ins, dict(graph=graph, name=getattr(fun, "__name__", prim.name),
                                                   n_consts=len(consts), **rules))



def trace_closed(fun: Callable, avals) -> tuple[Graph, tuple, object]:
    """closed_graph, keeping fun's aux: (closed graph, its constants, aux). The bodies of
    control flow are traced so (tilefuse.lax), their output structure in aux."""
    graph, aux = trace_to_graph(fun, list(avals))
    return graph.replace(constvars=(), invars=graph.constvars + graph.invars, consts=()), graph.consts, aux


def call_graph(graph: Graph, *args) -> list:
    """Run a graph by binding its primitives on args: on tracers, every transformation sees them."""
    from tilefuse.ir.core import eval_graph
    from .core import bind
    return eval_graph(graph, list(args), lambda e, vs: bind(e.prim, *vs, **e.params))


def join_branch_consts(traced: Sequence[tuple[Graph, Sequence]]) -> tuple[list[Graph], list]:
    """Branches traced apart, each (closed graph, its constants), as branches of one cond: every
    branch takes every branch's constants (in branch order) ahead of the operands."""
    from .core import get_aval
    avals = [[get_aval(c) for c in cs] for _, cs in traced]
    graphs = []
    for k, (g, cs) in enumerate(traced):
        n = len(cs)
        before = tuple(Var(a) for a_list in avals[:k] for a in a_list)
        after = tuple(Var(a) for a_list in avals[k + 1:] for a in a_list)
        graphs.append(g.replace(invars=before + g.invars[:n] + after + g.invars[n:]))
    return graphs, [c for _, cs in traced for c in cs]


def bind_cond(index, funs: Sequence[Callable], operands: Sequence) -> list:
    """cond over flat functions (operand list -> output list), traced here; the outputs of one
    branch must match the others' (the caller checks, with its own words)."""
    from .core import bind, get_aval
    avals = [get_aval(x).strip_weak() for x in operands]
    traced = [trace_closed(lambda *xs, f=f: (list(f(*xs)), None), avals)[:2] for f in funs]
    graphs, consts = join_branch_consts(traced)
    return bind(P.cond_p, index, *consts, *operands, branches=tuple(graphs))
