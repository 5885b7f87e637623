"""Passes over structured control flow (cond, while, scan; their bodies are optimised by every
pass, see manager.run_passes): outputs nobody reads leave their bodies, and loop-invariant
computation leaves its loop.

prune_control_flow: a cond's outputs and a scan's stacked ys that nobody reads are dropped from
every branch (or the body), so the work that made them goes too; so are the constants (a cond's
operands) that no body reads.

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


def _reads(g: Graph) -> set[int]:
    return _live_ids(g)


def _drop_unread(g: Graph, start: int, count: int, also=()) -> list[int]:
    """Positions among g's inputs start..start+count that g (and the graphs `also`, with the same
    inputs) never read."""
    read = _reads(g).union(*(_reads(a) for a in also))
    gone = [k for k in range(start, start + count) if g.invars[k].id not in read]
    for a in also:
        gone = [k for k in gone if a.invars[k].id not in read]
    return gone


def _without(g: Graph, gone) -> Graph:
    return g.replace(invars=tuple(v for k, v in enumerate(g.invars) if k not in gone))


def _prune_inputs(e: Eqn) -> Eqn:
    """Constants (operands, for cond) that no body reads leave the equation."""
    p = e.params
    if e.prim is P.scan_p:
        gone = set(_drop_unread(p["body"], 0, p["n_consts"]))
        if not gone:
            return e
        return e.replace(inputs=tuple(a for k, a in enumerate(e.inputs) if k not in gone),
                         params={**p, "body": _without(p["body"], gone), "n_consts": p["n_consts"] - len(gone)})
    if e.prim is P.while_p:
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        gc = set(_drop_unread(p["cond_graph"], 0, nc))
        gb = set(_drop_unread(p["body_graph"], 0, nb))
        if not gc and not gb:
            return e
        keep = [k for k in range(len(e.inputs)) if k not in gc and k - nc not in gb]
        return e.replace(inputs=tuple(e.inputs[k] for k in keep),
                         params={**p, "cond_graph": _without(p["cond_graph"], gc), "cond_nconsts": nc - len(gc),
                                 "body_graph": _without(p["body_graph"], gb), "body_nconsts": nb - len(gb)})
    if e.prim is P.cond_p:
        bs = p["branches"]
        gone = set(_drop_unread(bs[0], 0, len(bs[0].invars), bs[1:]))
        if not gone:
            return e
        return e.replace(inputs=(e.inputs[0], *(a for k, a in enumerate(e.inputs[1:]) if k not in gone)),
                         params={**p, "branches": tuple(_without(b, gone) for b in bs)})
    return e


def prune_control_flow(graph: Graph) -> Graph:
    if not any(e.prim in P.CONTROL_FLOW for e in graph.eqns):
        return graph
    live = _live_ids(graph)
    return graph.replace(eqns=tuple(_prune_inputs(_prune(e, live)) for e in graph.eqns))


# ---- loop invariants -------------------------------------------------------------------------------

def _hoist(body: Graph, n_consts: int, const_atoms: list):
    """(equations to run before the loop, the body with the values they make as new constant
    inputs after its own, the operands for those), or None when nothing is invariant."""
    invariant = {v.id for v in body.invars[:n_consts]}
    candidates = []
    for e in body.eqns:
        vins = [a for a in e.inputs if isinstance(a, Var)]
        if not e.prim.effectful and e.prim not in P.CONTROL_FLOW and all(a.id in invariant for a in vins):
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
