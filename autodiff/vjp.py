"""Reverse mode: a tape-based VJP trace on the trace stack.

A VJPTracer carries a primal (a value of a lower level: a concrete Array, or a tracer of an outer
trace such as jit's staging or an outer grad) and a node of this trace's tape. Each primitive
runs (or is staged) at the lower level on the primals and, when an operand is differentiable,
appends (rule, operand nodes, output nodes) to the tape. The backward pass walks the tape in
reverse; its rules bind primitives on the lower-level values again, so an outer grad records
the backward pass on its own tape (grad of grad) and an outer jit stages forward and backward
into one graph."""
from __future__ import annotations

from typing import Callable, NamedTuple

from tilefuse.ir.errors import TransformError, with_user_line
from tilefuse.ir.core import eval_graph
from tilefuse.ir.passes.manager import prepare_for_ad
from tilefuse.tracer.core import Trace, Tracer, bind, full_lower, get_aval, new_main, staging
from tilefuse.tracer.pytree import tree_flatten, tree_map, tree_unflatten
from tilefuse.tracer.staging import closed_graph

from . import ops
from .rules import ZERO_DERIVATIVE, vjp_fwd_rules, vjp_rules


class _Entry(NamedTuple):
    backward: Callable  # list of output cotangents (None = zero) -> operand cotangents
    in_nodes: tuple
    out_nodes: tuple


class Tape:
    """The record of one reverse-mode trace: differentiable operations in program order."""

    def __init__(self):
        self.entries: list[_Entry] = []
        self._count = 0

    def new_node(self) -> int:
        self._count += 1
        return self._count


class VJPTracer(Tracer):
    """A value under reverse mode: its primal and its tape node (None: a constant here)."""

    def __init__(self, trace, primal, node):
        self._trace, self.primal, self.node = trace, primal, node

    @property
    def aval(self):
        return get_aval(self.primal)

    def full_lower(self):
        return full_lower(self.primal) if self.node is None else self

    def concrete_value(self):
        # eager grad knows every value: Python control flow on it works, as in autograd
        p = self.primal
        return p.concrete_value() if isinstance(p, Tracer) else p


def _float_outputs(tape, outs):
    return tuple(tape.new_node() if ops.is_float(o) else None for o in outs)


class VJPTrace(Trace):
    """Runs primitives on the primals and records the differentiable ones on the tape."""

    @property
    def tape(self) -> Tape:
        return self.main.global_data

    def pure(self, val):
        return VJPTracer(self, val, None)

    lift = pure

    def process_primitive(self, prim, tracers, params):
        primals = [t.primal for t in tracers]
        needs = tuple(t.node is not None for t in tracers)
        if prim in vjp_fwd_rules and any(needs):  # control flow: its forward saves residuals
            outs, backward = vjp_fwd_rules[prim](primals, needs, **params)
            out_nodes = _float_outputs(self.tape, outs)
            self.tape.entries.append(_Entry(backward, tuple(t.node for t in tracers), out_nodes))
            return [VJPTracer(self, o, n) for o, n in zip(outs, out_nodes)]
        outs = bind(prim, *primals, **params)
        out_nodes = (None,) * len(outs)
        if any(needs) and prim not in ZERO_DERIVATIVE:
            out_nodes = _float_outputs(self.tape, outs)
        if any(n is not None for n in out_nodes):
            rule = vjp_rules.get(prim)
            if rule is None:
                raise TransformError(with_user_line(
                    f"grad/vjp: the primitive {prim.name} has no reverse-mode (VJP) rule"))
            out = outs[0]  # every differentiable primitive has one output

            def backward(cts):
                return rule(ops.instantiate(cts[0], out), *primals, out=out, needs=needs, **params)
            self.tape.entries.append(_Entry(backward, tuple(t.node for t in tracers), out_nodes))
        return [VJPTracer(self, o, n) for o, n in zip(outs, out_nodes)]

    def process_custom_vjp(self, fun, fwd, bwd, tracers, out_tree_thunk):
        primals = [t.primal for t in tracers]
        if all(t.node is None for t in tracers):
            return fun(*primals)
        outs, residuals = fwd(*primals)
        out_nodes = _float_outputs(self.tape, outs)

        def backward(cts):
            return bwd(residuals, [ops.instantiate(c, o) for c, o in zip(cts, outs)])
        self.tape.entries.append(_Entry(backward, tuple(t.node for t in tracers), out_nodes))
        return [VJPTracer(self, o, n) for o, n in zip(outs, out_nodes)]


    def process_custom_jvp(self, fun, jvp, tracers):
        """Reverse mode of a user JVP: its tangent map is linear, so its transpose is its VJP,
        taken (by this module) on the map at zero tangents when the backward pass runs."""
        primals = [t.primal for t in tracers]
        if all(t.node is None for t in tracers):
            return fun(*primals)
        outs = fun(*primals)
        out_nodes = _float_outputs(self.tape, outs)

        def backward(cts):
            def tangent_map(*ts):
                return list(jvp(primals, list(ts))[1]), None
            zeros = [ops.zeros(ops.aval(p)) for p in primals]
            _, pullback, _ = vjp_flat(tangent_map, zeros)
            return pullback([ops.instantiate(c, o) for c, o in zip(cts, outs)])
        self.tape.entries.append(_Entry(backward, tuple(t.node for t in tracers), out_nodes))
        return [VJPTracer(self, o, n) for o, n in zip(outs, out_nodes)]


def backpropagate(tape: Tape, seeds: dict, in_nodes) -> list:
    """Cotangents of `in_nodes` given cotangents of some nodes (None = symbolic zero)."""
    cts = dict(seeds)
    for entry in reversed(tape.entries):
        outs = [cts.pop(n, None) if n is not None else None for n in entry.out_nodes]
        if all(c is None for c in outs):
            continue  # not on a path to a seeded output
        for n, c in zip(entry.in_nodes, entry.backward(outs)):
            if n is not None and c is not None:
                cts[n] = ops.add_any(cts.get(n), c)  # fan-out: contributions add up
    return [cts.get(n) for n in in_nodes]


def _staged_first(fun: Callable, primals: list) -> Callable:
    """Under jit: fun traced into a graph and rewritten by prepare_for_ad (fused attention, whose
    VJP is the fused backward), then replayed; the same (outputs, aux) as fun. Eager grad runs
    fun itself, so Python control flow on values keeps working there."""
    store: dict = {}

    def flat(*xs):
        outs, aux = fun(*xs)
        aux_leaves, store["aux_tree"] = tree_flatten(aux)
        store["arrays"] = [i for i, a in enumerate(aux_leaves) if isinstance(a, Tracer)]
        store["aux"] = aux_leaves
        store["n_out"] = len(outs)
        return list(outs) + [aux_leaves[i] for i in store["arrays"]], None
    graph, consts = closed_graph(flat, [get_aval(p) for p in primals])
    graph = prepare_for_ad(graph)

    def replay(*xs):
        vals = eval_graph(graph, [*consts, *xs], lambda e, vs: bind(e.prim, *vs, **e.params))
        n = store["n_out"]
        aux = list(store["aux"])
        for i, v in zip(store["arrays"], vals[n:]):
            aux[i] = v
        return vals[:n], tree_unflatten(store["aux_tree"], aux)
    return replay


def vjp_flat(fun: Callable, primals: list, prepare: bool = False):
    """Trace fun(*tracers) -> (output leaves, aux) in reverse mode. Returns (output primals,
    pullback, aux): pullback(output cotangents) -> input cotangents, None for symbolic zeros.
    The pullback may be called many times; it runs outside this trace (on lower levels).
    prepare (the user-facing transforms; never rules, whose decompositions the rewrites would
    fuse back): under jit, differentiate fun's graph after prepare_for_ad."""
    if prepare and staging():
        fun = _staged_first(fun, primals)
    with new_main(VJPTrace, Tape()) as main:
        trace = VJPTrace(main)
        tape = main.global_data
        ins = [VJPTracer(trace, p, tape.new_node()) for p in primals]
        outs, aux = fun(*ins)

        def ours(x):
            return isinstance(x, VJPTracer) and x._trace.main is main
        out_primals = [o.primal if ours(o) else o for o in outs]
        out_nodes = [o.node if ours(o) else None for o in outs]
        aux = tree_map(lambda x: x.primal if ours(x) else x, aux)  # aux carries no gradient
    in_nodes = [t.node for t in ins]

    def pullback(cts) -> list:
        seeds: dict = {}
        for n, c in zip(out_nodes, cts, strict=True):
            if n is not None and c is not None:
                seeds[n] = ops.add_any(seeds.get(n), c)
        return backpropagate(tape, seeds, in_nodes)
    return out_primals, pullback, aux
