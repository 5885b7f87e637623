"""Passes over structured control flow (cond, while, scan; their bodies are optimised by every
pass, see manager.run_passes): outputs nobody reads leave their bodies, and loop-invariant
computation leaves its loop.

prune_control_flow: a cond's outputs and a scan's stacked ys that nobody reads are dropped from
every branch (or the body), so the work that made them goes too.

hoist_loop_invariants: the equations of a while or scan body that read only the loop's constants
(weights, say: W.T, a bias broadcast into a GEMM) run once before the loop, their results passed
in as new constants. Index maps (broadcasts, reshapes) stay unless a hoisted computation reads
them: inside the body they fuse into their consumers for free."""
from __future__ import annotations

from .. import primitives as P
from ..core import Eqn, Graph, Literal, Var
from .fusion import INDEX_MAPS


# ---- unread outputs --------------------------------------------------------------------------------

def _live_ids(graph: Graph) -> set[int]:
    live = {v.id for v in graph.outvars if isinstance(v, Var)}
    for e in graph.eqns:
        live.update(a.id for a in e.inputs if isinstance(a, Var))
    return live


def _prune(e: Eqn, live: set[int]) -> Eqn:
    if e.prim is P.cond_p:
        keep = [k for k, o in enumerate(e.outputs) if o.id in live]
        if len(keep) == len(e.outputs):
            return e
        branches = tuple(g.replace(outvars=tuple(g.outvars[k] for k in keep)) for g in e.params["branches"])
        return e.replace(outputs=tuple(e.outputs[k] for k in keep), params={**e.params, "branches": branches})
    if e.prim is P.scan_p:
        nc = e.params["n_carry"]
        keep = [k for k, o in enumerate(e.outputs) if k < nc or o.id in live]
        if len(keep) == len(e.outputs):
            return e
        body = e.params["body"]
        body = body.replace(outvars=tuple(body.outvars[k] for k in keep))
        return e.replace(outputs=tuple(e.outputs[k] for k in keep), params={**e.params, "body": body})
    return e


def prune_control_flow(graph: Graph) -> Graph:
    if not any(e.prim in (P.cond_p, P.scan_p) for e in graph.eqns):
        return graph
    live = _live_ids(graph)
    return graph.replace(eqns=tuple(_prune(e, live) for e in graph.eqns))


# ---- loop invariants -------------------------------------------------------------------------------

def _hoist(body: Graph, n_consts: int, const_atoms: list):
    """(equations to run before the loop, the body with the values they make as new constant
    inputs after its own, the operands for those), or None when nothing is invariant."""
    invariant = {v.id for v in body.invars[:n_consts]}
    candidates = []
    for e in body.eqns:
        vins = [a for a in e.inputs if isinstance(a, Var)]
        if (not e.prim.effectful and e.prim not in P.CONTROL_FLOW and vins
                and all(a.id in invariant for a in vins)):
            candidates.append(e)
            invariant.update(o.id for o in e.outputs)
    # an index map moves only for a moving computation that reads it
    hoisted, wanted = [], set()
    for e in reversed(candidates):
        if e.prim.name not in INDEX_MAPS or any(o.id in wanted for o in e.outputs):
            hoisted.append(e)
            wanted.update(a.id for a in e.inputs if isinstance(a, Var))
    if not hoisted:
        return None
    hoisted.reverse()
    gone = {id(e) for e in hoisted}
    kept = [e for e in body.eqns if id(e) not in gone]
    used = {a.id for e in kept for a in e.inputs if isinstance(a, Var)}
    used.update(v.id for v in body.outvars if isinstance(v, Var))
    new_inputs = [o for e in hoisted for o in e.outputs if o.id in used]
    outer = {v.id: a for v, a in zip(body.invars[:n_consts], const_atoms)}
    before = []
    for e in hoisted:  # the same equations outside, on the loop's operands, with fresh outputs
        outs = tuple(Var(o.aval) for o in e.outputs)
        outer.update((o.id, n) for o, n in zip(e.outputs, outs))
        before.append(e.replace(inputs=tuple(a if isinstance(a, Literal) else outer[a.id] for a in e.inputs),
                                outputs=outs))
    new_body = body.replace(invars=body.invars[:n_consts] + tuple(new_inputs) + body.invars[n_consts:],
                            eqns=tuple(kept))
    return before, new_body, [outer[v.id] for v in new_inputs]


def _hoist_eqn(e: Eqn) -> list[Eqn]:
    p = e.params
    if e.prim is P.scan_p:
        nk = p["n_consts"]
        r = _hoist(p["body"], nk, list(e.inputs[:nk]))
        if r is None:
            return [e]
        before, body, extra = r
        return before + [e.replace(inputs=(*e.inputs[:nk], *extra, *e.inputs[nk:]),
                                   params={**p, "body": body, "n_consts": nk + len(extra)})]
    if e.prim is P.while_p:
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cc, bc, init = e.inputs[:nc], e.inputs[nc:nc + nb], e.inputs[nc + nb:]
        rc = _hoist(p["cond_graph"], nc, list(cc))
        rb = _hoist(p["body_graph"], nb, list(bc))
        if rc is None and rb is None:
            return [e]
        before = []
        cond_graph, body_graph = p["cond_graph"], p["body_graph"]
        if rc is not None:
            b, cond_graph, extra = rc
            before += b
            cc = (*cc, *extra)
        if rb is not None:
            b, body_graph, extra = rb
            before += b
            bc = (*bc, *extra)
        return before + [e.replace(inputs=(*cc, *bc, *init),
                                   params={**p, "cond_graph": cond_graph, "body_graph": body_graph,
                                           "cond_nconsts": len(cc), "body_nconsts": len(bc)})]
    return [e]


def hoist_loop_invariants(graph: Graph) -> Graph:
    if not any(e.prim in (P.scan_p, P.while_p) for e in graph.eqns):
        return graph
    return graph.replace(eqns=tuple(x for e in graph.eqns for x in _hoist_eqn(e)))
