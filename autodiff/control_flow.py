"""Differentiation of structured control flow: cond, while and scan (tilefuse.lax).

Forward mode (all three): the JVP of a body is a body over (primals, tangents). Which carries have
a tangent is found by a fixed point (a carry gains one when the body gives it one), so the loop's
carry type stays fixed.

Reverse mode (cond, scan; fori_loop with static bounds is a scan): the body's VJP is traced as one
joint graph (forward, then the pullback of given cotangents) and split by data dependence, as
JAX's partial evaluation does, into a forward body that also returns residuals (the forward values
the backward reads) and a backward body that reads them. A scan runs the forward scan with its
residuals stacked as extra outputs, then a reverse scan of the backward body over them, carrying
the carry's cotangent and the sums of the constants' cotangents. Values that depend on the
loop's constants alone are recomputed by the backward body instead of being stacked (the hoisting
pass then computes them once, outside the loop); a residual that is a slice of xs is read from xs.
A cond saves each branch's residuals in its own slots (zeros from the other branches).
A while_loop's trip count is dynamic: its reverse mode is a TransformError, as in JAX."""
from __future__ import annotations

from tilefuse.ir import dtypes
from tilefuse.ir import primitives as P
from tilefuse.ir.core import Graph, Literal, Var
from tilefuse.ir.errors import TransformError, with_user_line
from tilefuse.tracer.core import bind
from tilefuse.tracer.staging import bind_cond, call_graph, trace_closed

from . import ops
from .jvp import jvp_flat
from .rules import jvp_multi_rules, vjp_fwd_rules
from .vjp import vjp_flat


def _float(aval) -> bool:
    return dtypes.is_float(aval.dtype)


def _split(xs, *sizes):
    out, i = [], 0
    for n in sizes:
        out.append(list(xs[i:i + n]))
        i += n
    out.append(list(xs[i:]))
    return out


def _permute(g: Graph, ins, outs) -> Graph:
    return g.replace(invars=tuple(g.invars[i] for i in ins), outvars=tuple(g.outvars[i] for i in outs))


# ---- forward mode ----------------------------------------------------------------------------------

def jvp_graph(graph: Graph, nz_in: list[bool], force_out: list[bool]):
    """The JVP of a closed graph as a closed graph over (*primals, *tangents of the inputs nz_in
    marks) giving (*outputs, *tangents of the outputs that have one); force_out gives a float
    output a zero tangent where the body gives none. Returns (graph, its constants, nz_out)."""
    n = len(graph.invars)
    store: dict = {}

    def fun(*args):
        it = iter(args[n:])
        tangents = [next(it) if nz else None for nz in nz_in]
        outs, touts, _ = jvp_flat(lambda *xs: (call_graph(graph, *xs), None), list(args[:n]), tangents)
        ts, nz_out = [], []
        for o, t, force in zip(outs, touts, force_out):
            if t is None and force and ops.is_float(o):
                t = ops.zeros(ops.aval(o))
            nz_out.append(t is not None)
            if t is not None:
                ts.append(t)
        store["nz"] = nz_out
        return [*outs, *ts], None
    avals = [v.aval for v in graph.invars]
    g, consts, _ = trace_closed(fun, avals + [a for a, nz in zip(avals, nz_in) if nz])
    return g, list(consts), store["nz"]


def _fixed_point(graph: Graph, nz_before: list[bool], nz_carry: list[bool], nz_after: list[bool],
                 n_carry: int, n_other_out: int):
    """jvp_graph of a loop body whose carry follows `nz_before` inputs: carries gain tangents
    until the body gives none that its input lacks."""
    while True:
        g, consts, nz_out = jvp_graph(graph, nz_before + nz_carry + nz_after,
                                      nz_carry + [False] * n_other_out)
        grown = [a or b for a, b in zip(nz_carry, nz_out[:n_carry])]
        if grown == nz_carry:
            return g, consts, nz_out
        nz_carry = grown


def _scan_jvp(primals, tangents, *, body, length, reverse, n_consts, n_carry):
    nk, nc = n_consts, n_carry
    nx, ny = len(primals) - nk - nc, len(body.outvars) - nc
    nz = [t is not None for t in tangents]
    nzk, nzc, nzx = nz[:nk], nz[nk:nk + nc], nz[nk + nc:]
    g, jc, nz_out = _fixed_point(body, nzk, nzc, nzx, nc, ny)
    nzc, nzy = nz_out[:nc], nz_out[nc:]
    m, tk, tc, tx, ty = len(jc), sum(nzk), sum(nzc), sum(nzx), sum(nzy)
    # invars jc | consts carry xs | tk tc tx -> jc consts tk | carry tc | xs tx; outs carry ys tc ty
    b = m + nk + nc + nx
    r = range
    g = _permute(g, [*r(m + nk), *r(b, b + tk), *r(m + nk, m + nk + nc), *r(b + tk, b + tk + tc),
                     *r(m + nk + nc, b), *r(b + tk + tc, b + tk + tc + tx)],
                 [*r(nc), *r(nc + ny, nc + ny + tc), *r(nc, nc + ny), *r(nc + ny + tc, nc + ny + tc + ty)])
    consts, init, xs = _split(primals, nk, nc)
    tks, tcs, txs = _split(tangents, nk, nc)
    outs = bind(P.scan_p, *jc, *consts, *[t for t in tks if t is not None],
                *init, *[ops.instantiate(t, p) for t, p, f in zip(tcs, init, nzc) if f],
                *xs, *[t for t in txs if t is not None],
                body=g, length=length, reverse=reverse, n_consts=m + nk + tk, n_carry=nc + tc)
    carry, tcarry, ys, tys = _split(outs, nc, tc, ny)
    it_c, it_y = iter(tcarry), iter(tys)
    return carry + ys, [next(it_c) if f else None for f in nzc] + [next(it_y) if f else None for f in nzy]


def _while_jvp(primals, tangents, *, cond_graph, body_graph, cond_nconsts, body_nconsts):
    ncc, nb = cond_nconsts, body_nconsts
    cc, bc, init = _split(primals, ncc, nb)
    _, tbc, tinit = _split(tangents, ncc, nb)
    nzb, nzc = [t is not None for t in tbc], [t is not None for t in tinit]
    nc = len(init)
    g, jc, nz_out = _fixed_point(body_graph, nzb, nzc, [], nc, 0)
    nzc = nz_out
    m, tb, tc = len(jc), sum(nzb), sum(nzc)
    r = range
    g = _permute(g, [*r(m + nb), *r(m + nb + nc, m + nb + nc + tb), *r(m + nb, m + nb + nc),
                     *r(m + nb + nc + tb, m + nb + nc + tb + tc)], list(r(nc + tc)))
    tavals = [v.aval for v, f in zip(body_graph.invars[nb:], nzc) if f]
    cg = cond_graph.replace(invars=cond_graph.invars + tuple(Var(a) for a in tavals))
    outs = bind(P.while_p, *cc, *jc, *bc, *[t for t in tbc if t is not None], *init,
                *[ops.instantiate(t, p) for t, p, f in zip(tinit, init, nzc) if f],
                cond_graph=cg, body_graph=g, cond_nconsts=ncc, body_nconsts=m + nb + tb)
    carry, tcarry = outs[:nc], iter(outs[nc:])
    return carry, [next(tcarry) if f else None for f in nzc]


def _cond_jvp(primals, tangents, *, branches):
    index, operands = primals[0], list(primals[1:])
    nz_in = [t is not None for t in tangents[1:]]
    n_out = len(branches[0].outvars)
    union = [False] * n_out
    for b in branches:
        union = [a or c for a, c in zip(union, jvp_graph(b, nz_in, [False] * n_out)[2])]
    funs = []
    for b in branches:
        g, consts, _ = jvp_graph(b, nz_in, union)
        funs.append(lambda *xs, g=g, consts=consts: call_graph(g, *consts, *xs))
    tin = [t for t in tangents[1:] if t is not None]
    outs = bind_cond(index, funs, [*operands, *tin])
    it = iter(outs[n_out:])
    return outs[:n_out], [next(it) if f else None for f in union]


jvp_multi_rules.update({P.scan_p: _scan_jvp, P.while_p: _while_jvp, P.cond_p: _cond_jvp})


# ---- reverse mode ----------------------------------------------------------------------------------

def _needed(eqns, roots) -> list:
    """The equations (in order) that the atoms `roots` depend on."""
    want = {a.id for a in roots if isinstance(a, Var)}
    kept = []
    for e in reversed(eqns):
        if any(o.id in want for o in e.outputs):
            kept.append(e)
            want.update(a.id for a in e.inputs if isinstance(a, Var))
    return kept[::-1]


def vjp_split(graph: Graph, invariant: list[bool], ct_out: list[bool], ct_in: list[bool]):
    """Reverse mode of a closed graph in two graphs (partial evaluation of its joint VJP):
      fwd: (*consts, *inputs) -> (*outputs, *residuals)
      bwd: (*consts, *invariant inputs, *residuals, *cotangents of the ct_out outputs)
           -> cotangents of the ct_in inputs (zeros made real).
    `consts` are constants the joint trace captured. Values computed from the constants and the
    invariant inputs alone are recomputed by bwd rather than saved. Returns (fwd, bwd, consts,
    residuals): the residuals are variables of fwd (some may be its inputs)."""
    n = len(graph.invars)

    def joint(*args):
        it = iter(args[n:])
        cts = [next(it) if m else None for m in ct_out]
        outs, pullback, _ = vjp_flat(lambda *xs: (call_graph(graph, *xs), None), list(args[:n]))
        cin = pullback(cts)
        return [*outs, *(ops.materialize(ops.instantiate(c, x)) for c, x, m in zip(cin, args[:n], ct_in) if m)], None
    out_avals = [v.aval for v in graph.outvars]
    J, consts, _ = trace_closed(joint, [v.aval for v in graph.invars] +
                                [a for a, m in zip(out_avals, ct_out) if m])
    m = len(consts)
    ins, cts = J.invars[:m + n], J.invars[m + n:]
    n_out = len(graph.outvars)
    # each value: 'inv' (constants and invariant inputs only), 'prim' (the forward), 'ct'
    kind = {v.id: "inv" for v in J.invars[:m]}
    kind.update((v.id, "inv" if inv else "prim") for v, inv in zip(ins[m:], invariant))
    kind.update((v.id, "ct") for v in cts)
    for e in J.eqns:
        ks = {kind[a.id] for a in e.inputs if isinstance(a, Var)}
        k = "ct" if "ct" in ks else "prim" if "prim" in ks else "inv"
        kind.update((o.id, k) for o in e.outputs)

    def of(a):
        return "inv" if isinstance(a, Literal) else kind[a.id]
    ct_outvars = J.outvars[n_out:]
    bwd_eqns = [e for e in _needed(J.eqns, ct_outvars) if of(e.outputs[0]) != "prim"]
    read = {a.id for e in bwd_eqns for a in e.inputs if isinstance(a, Var)}
    read.update(a.id for a in ct_outvars if isinstance(a, Var))
    seen, residuals = set(), []
    for e in J.eqns:  # forward values the backward reads, in the order the forward makes them
        for o in e.outputs:
            if o.id in read and kind[o.id] == "prim" and o.id not in seen:
                seen.add(o.id)
                residuals.append(o)
    residuals = [v for v in ins[m:] if v.id in read and kind[v.id] == "prim"] + residuals
    fwd_out = (*J.outvars[:n_out], *residuals)
    fwd = Graph((), tuple(ins), tuple(e for e in _needed(J.eqns, fwd_out) if of(e.outputs[0]) != "ct"), fwd_out)
    inv_in = [v for v, inv in zip(ins[m:], invariant) if inv]
    bwd = Graph((), (*J.invars[:m], *inv_in, *residuals, *cts), tuple(bwd_eqns), tuple(ct_outvars))
    return fwd, bwd, list(consts), residuals


def _scan_vjp(primals, needs, *, body, length, reverse, n_consts, n_carry):
    nk, nc = n_consts, n_carry
    nx = len(primals) - nk - nc
    consts, init, xs = _split(primals, nk, nc)
    in_avals = [v.aval for v in body.invars]
    out_avals = [v.aval for v in body.outvars]
    ct_out = [_float(a) for a in out_avals]
    want_k = [nd and _float(a) for nd, a in zip(needs[:nk], in_avals[:nk])]
    want_c = [_float(a) for a in in_avals[nk:nk + nc]]
    want_x = [nd and _float(a) for nd, a in zip(needs[nk + nc:], in_avals[nk + nc:])]
    fwd, bwd, jc, residuals = vjp_split(body, [True] * nk + [False] * (nc + nx), ct_out,
                                        want_k + want_c + want_x)
    m = len(jc)
    x_pos = {v.id: i for i, v in enumerate(fwd.invars[m + nk + nc:])}  # residuals read from xs
    stacked = [v for v in residuals if v.id not in x_pos]
    fwd = fwd.replace(outvars=fwd.outvars[:len(out_avals)] + tuple(stacked))
    outs = bind(P.scan_p, *jc, *consts, *init, *xs, body=fwd, length=length, reverse=reverse,
                n_consts=m + nk, n_carry=nc)
    n_out = len(out_avals)
    primal_outs, res_stacked = outs[:n_out], outs[n_out:]
    fc = [i for i, f in enumerate(ct_out[:nc]) if f]  # carries with cotangents
    fy = [i for i, f in enumerate(ct_out[nc:]) if f]
    nkw = sum(want_k)
    used_x = sorted({x_pos[v.id] for v in residuals if v.id in x_pos})

    def bwd_step(*args):
        jc_, k_, ctc, acc, res_t, x_t, cty = _split(args, m, nk, len(fc), nkw, len(stacked), len(used_x))
        res_by_id = {v.id: r for v, r in zip(stacked, res_t)}
        res_by_id.update((fwd.invars[m + nk + nc + j].id, x) for j, x in zip(used_x, x_t))
        outs_ = call_graph(bwd, *jc_, *k_, *(res_by_id[v.id] for v in residuals), *ctc, *cty)
        ck, cc, cx = _split(outs_, nkw, sum(want_c))
        return [*cc, *(ops.add(a, c) for a, c in zip(acc, ck)), *cx], None

    k_avals = [a for a, w in zip(in_avals[:nk], want_k) if w]
    step_avals = ([ops.aval(c) for c in jc] + in_avals[:nk] + [out_avals[i] for i in fc] + k_avals +
                  [v.aval for v in stacked] + [in_avals[nk + nc + j] for j in used_x] +
                  [out_avals[nc + i] for i in fy])
    bg, bconsts, _ = trace_closed(bwd_step, step_avals)
    primal_y = primal_outs[nc:]

    def backward(cts):
        ctc = [ops.instantiate(cts[i], primal_outs[i]) for i in fc]
        cty = [ops.instantiate(cts[nc + i], primal_y[i]) for i in fy]
        acc0 = [ops.zeros(a) for a in k_avals]
        res = bind(P.scan_p, *bconsts, *jc, *consts, *ctc, *acc0, *res_stacked, *(xs[j] for j in used_x),
                   *cty, body=bg, length=length, reverse=not reverse,
                   n_consts=len(bconsts) + m + nk, n_carry=len(fc) + nkw)
        ct_c, ct_k, ct_x = _split(res, len(fc), nkw)
        it_k, it_c, it_x = iter(ct_k), iter(ct_c), iter(ct_x)
        out_k = [next(it_k) if w else None for w in want_k]
        out_c = [next(it_c) if w else None for w in want_c]
        out_x = [next(it_x) if w else None for w in want_x]
        return [c if nd else None for c, nd in zip(out_k + out_c + out_x, needs)]
    return primal_outs, backward


def _cond_vjp(primals, needs, *, branches):
    index, operands = primals[0], list(primals[1:])
    in_avals = [v.aval for v in branches[0].invars]
    out_avals = [v.aval for v in branches[0].outvars]
    n_out = len(out_avals)
    ct_out = [_float(a) for a in out_avals]
    ct_in = [nd and _float(a) for nd, a in zip(needs[1:], in_avals)]
    splits = [vjp_split(b, [False] * len(in_avals), ct_out, ct_in) for b in branches]
    slots = [[v.aval for v in res] for _, _, _, res in splits]

    def forward_branch(k):
        fwd, _, jc, _ = splits[k]

        def f(*xs):
            outs = call_graph(fwd, *jc, *xs)
            own = iter(outs[n_out:])
            res = [next(own) if j == k else ops.zeros(a) for j, s in enumerate(slots) for a in s]
            return [*outs[:n_out], *res]
        return f
    outs = bind_cond(index, [forward_branch(k) for k in range(len(branches))], operands)
    primal_outs, res_all = outs[:n_out], outs[n_out:]

    def backward_branch(k):
        _, bwd, jc, _ = splits[k]
        start = sum(len(s) for s in slots[:k])

        def f(*xs):
            res, cts = xs[:len(res_all)], xs[len(res_all):]
            return call_graph(bwd, *jc, *res[start:start + len(slots[k])], *cts)
        return f

    def backward(cts):
        cts = [ops.instantiate(c, o) for c, o, f in zip(cts, primal_outs, ct_out) if f]
        res = bind_cond(index, [backward_branch(k) for k in range(len(branches))], [*res_all, *cts])
        it = iter(res)
        return [None] + [next(it) if w else None for w in ct_in]
    return primal_outs, backward


def _while_vjp(primals, needs, **params):
    raise TransformError(with_user_line(
        "grad/vjp: reverse-mode differentiation does not work for a while_loop, whose trip count "
        "is dynamic (as in JAX). Use lax.scan, or lax.fori_loop with Python int bounds (a scan), "
        "or forward mode (jvp, jacfwd)."))


vjp_fwd_rules.update({P.scan_p: _scan_vjp, P.cond_p: _cond_vjp, P.while_p: _while_vjp})
