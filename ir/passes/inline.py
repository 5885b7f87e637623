"""Inlining: every call (a tile_op, a custom_vjp or custom_jvp function) is replaced by its body,
so the passes and fusion see the body's primitives and compile them with their neighbours (an
elementwise-plus-reduction body becomes the same fused kernels as the code written inline). The
derivative rules a call carries matter only to transformations, which have run by now."""
from __future__ import annotations

from ..core import Graph, Literal, Var
from ..primitives import CALLS


def _emit(eqns, env: dict, out: list, fresh: bool) -> None:
    """Append `eqns` to `out`, reading inputs through `env` (var id -> atom) and inlining calls.
    A body's equations get fresh variables: one body may be inlined at several call sites."""
    def read(a):
        return a if isinstance(a, Literal) else env.get(a.id, a)
    for e in eqns:
        ins = tuple(read(a) for a in e.inputs)
        if e.prim in CALLS:
            body = e.params["graph"]
            inner = {v.id: a for v, a in zip(body.invars, ins, strict=True)}
            _emit(body.eqns, inner, out, fresh=True)
            for o, res in zip(e.outputs, body.outvars, strict=True):
                env[o.id] = res if isinstance(res, Literal) else inner[res.id]
        elif fresh:
            outs = tuple(Var(o.aval) for o in e.outputs)
            env.update((o.id, n) for o, n in zip(e.outputs, outs))
            out.append(e.replace(inputs=ins, outputs=outs))
        else:
            out.append(e.replace(inputs=ins) if ins != e.inputs else e)


def inline_calls(graph: Graph) -> Graph:
    if not any(e.prim in CALLS for e in graph.eqns):
        return graph
    env: dict = {}
    eqns: list = []
    _emit(graph.eqns, env, eqns, fresh=False)
    outvars = tuple(v if isinstance(v, Literal) else env.get(v.id, v) for v in graph.outvars)
    return graph.replace(eqns=tuple(eqns), outvars=outvars)
