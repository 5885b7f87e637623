"""Forward mode: a JVP trace whose tracers carry (primal, tangent); tangent None is a symbolic
zero. Primitives run on the primals at the lower level and the JVP rules bind primitives on
the tangents, so forward mode composes with jit, grad and itself like reverse mode does."""
from __future__ import annotations

from typing import Callable

from tilefuse.ir.errors import TransformError, with_user_line
from tilefuse.tracer.core import Trace, Tracer, bind, full_lower, get_aval, new_main
from tilefuse.tracer.pytree import tree_map

from . import ops
from .rules import ZERO_DERIVATIVE, jvp_multi_rules, jvp_rules


class JVPTracer(Tracer):
    """A value under forward mode: its primal and its tangent (None: zero)."""

    def __init__(self, trace, primal, tangent):
        self._trace, self.primal, self.tangent = trace, primal, tangent

    @property
    def aval(self):
        return get_aval(self.primal)

    def full_lower(self):
        return full_lower(self.primal) if self.tangent is None else self

    def concrete_value(self):
        p = self.primal
        return p.concrete_value() if isinstance(p, Tracer) else p


class JVPTrace(Trace):
    """Runs primitives on the primals and pushes tangents through the JVP rules."""

    def pure(self, val):
        return JVPTracer(self, val, None)

    lift = pure

    def process_primitive(self, prim, tracers, params):
        primals = [t.primal for t in tracers]
        tangents = [t.tangent for t in tracers]
        if prim in jvp_multi_rules and any(t is not None for t in tangents):  # control flow
            outs, touts = jvp_multi_rules[prim](primals, tangents, **params)
            return [JVPTracer(self, o, t) for o, t in zip(outs, touts, strict=True)]
        outs = bind(prim, *primals, **params)
        if (all(t is None for t in tangents) or prim in ZERO_DERIVATIVE
                or not any(ops.is_float(o) for o in outs)):
            return [JVPTracer(self, o, None) for o in outs]
        rule = jvp_rules.get(prim)
        if rule is None:
            raise TransformError(with_user_line(
                f"jvp: the primitive {prim.name} has no forward-mode (JVP) rule"))
        return [JVPTracer(self, outs[0], rule(tangents, *primals, out=outs[0], **params))]


    def process_custom_jvp(self, fun, jvp, tracers):
        primals = [t.primal for t in tracers]
        if all(t.tangent is None for t in tracers):
            return [JVPTracer(self, o, None) for o in fun(*primals)]
        tangents = [ops.instantiate(t.tangent, p) for t, p in zip(tracers, primals)]
        outs, tangents_out = jvp(primals, tangents)
        return [JVPTracer(self, o, t) for o, t in zip(outs, tangents_out, strict=True)]


def jvp_flat(fun: Callable, primals: list, tangents: list):
    """Trace fun(*tracers) -> (output leaves, aux) in forward mode. Returns (output primals,
    output tangents with None for symbolic zeros, aux)."""
    with new_main(JVPTrace) as main:
        trace = JVPTrace(main)
        ins = [JVPTracer(trace, p, t) for p, t in zip(primals, tangents, strict=True)]
        outs, aux = fun(*ins)

        def ours(x):
            return isinstance(x, JVPTracer) and x._trace.main is main
        out_primals = [o.primal if ours(o) else o for o in outs]
        out_tangents = [o.tangent if ours(o) else None for o in outs]
        aux = tree_map(lambda x: x.primal if ours(x) else x, aux)
    return out_primals, out_tangents, aux
