"""Attention: the pattern pass that finds softmax(q kᵀ·scale + mask) v in a graph and rewrites it
into one fused_attention, and the decomposition that turns fused_attention (and its backward)
back into ordinary primitives, for devices without an attention template.

The forms found (`fuse_attention`): scores = dot_general(q, k) contracting one feature axis, with
every other axis but one sequence axis per operand a batch axis (so (B, H, S, D), (B, S, H, D),
(H, B, S, D) all match); the scale multiplied (or divided) before or after the matmul, on q, k or
the scores; an additive bias or mask (-inf entries) broadcastable to the scores; a causal mask
written as select(iota_q + c >= iota_k, s, -inf) (tnp.where, tnp.tril) or as an added -inf
triangle; the softmax over the key axis written out (max, exp, sum, divide: nn.softmax and
the plain numpy form); then dot_general(p, v) contracting the key axis, when nothing else reads
the weights p. Anything else, such as a softmax over another axis or a fill other than -inf, is
left alone.

Every decision is made from the graph's structure (primitives, operands, axes, broadcasts and
constant values), never by evaluating candidates. The weights p must have no other reader: under
grad, the backward autodiff writes reads them, so the rewrite is made before differentiation
instead (ir/passes/manager.prepare_for_ad, which grad under jit and the replay of a jitted
function under grad apply): fused_attention's own VJP rule then writes the fused backward."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .. import dtypes
from .. import primitives as P
from ..core import Graph, Literal, Var
from .simplify import simplify
from .util import Emit, Rewriter, literal, new_eqn


def _probs(em: Emit, qc, kc, bias, scale, causal, n, with_stats: bool = False):
    """The attention weights (batch..., Sq, Sk) of canonical q, k: the unfused softmax (with_stats:
    and the rows' statistics, as fused_attention_stats returns them)."""
    batch = tuple(range(n))
    s = em(P.dot_general, qc, kc, dimension_numbers=(((n + 1,), (n + 1,)), (batch, batch)))
    s = em(P.mul, s, em.full(scale, s))
    if bias is not None:
        s = em(P.add, s, em(P.broadcast_in_dim, bias, shape=s.aval.shape,
                            broadcast_dimensions=tuple(range(n + 2))))
    if causal:
        sq, sk = s.aval.shape[-2:]
        shape = s.aval.shape
        i = em(P.iota, dtype=np.dtype(np.int32), shape=shape, dimension=n)
        j = em(P.iota, dtype=np.dtype(np.int32), shape=shape, dimension=n + 1)
        keep = em(P.ge, em(P.add, i, em.full(sk - sq, i)), j)
        s = em(P.select, keep, s, em.full(-np.inf, s))
    m = em(P.reduce_max, s, axes=(n + 1,))
    m = em(P.select, em(P.is_finite, m), m, em.full(0.0, m))
    e = em(P.exp, em(P.sub, s, em.expand(m, s)))
    total = em(P.reduce_sum, e, axes=(n + 1,))
    seen = em(P.gt, total, em.full(0.0, total))
    total = em(P.select, seen, total, em.full(1.0, total))
    p = em(P.div, e, em.expand(total, e))
    if not with_stats:
        return p
    # the rows' (m, 1/l) as fused_attention_stats defines them, in the compute dtype
    linv = em(P.select, seen, em(P.div, em.full(1.0, total), total), em.full(0.0, total))
    f = dtypes.compute_dtype(m.aval.dtype)
    cols = [em(P.reshape, x if x.aval.dtype == f else em(P.convert_element_type, x, new_dtype=f),
               new_sizes=x.aval.shape + (1,)) for x in (m, linv)]
    return p, em(P.concatenate, *cols, dimension=n + 1)


def decompose(eqn) -> tuple[list, list]:
    """fused_attention(_stats) or fused_attention_bwd (dq, dk, dv packed flat) as ordinary
    primitives: (equations, outputs), over the equation's own input variables. (The backward
    recomputes the weights: a stats operand is not read.)"""
    em = Emit()
    q, k, v, *rest = eqn.inputs
    scale, causal, dims = eqn.params["scale"], eqn.params["causal"], eqn.params["dims"]
    n = len(dims[0]) - 2
    batch = tuple(range(n))
    qc, kc, vc = (em.permute(x, d) for x, d in zip((q, k, v), dims))
    bwd = eqn.prim is P.fused_attention_bwd
    if bwd:
        bias, out, dout, _ = P.attention_bwd_operands(rest, eqn.params.get("stats", False))
    else:
        bias = rest[0] if rest else None
    stats = eqn.prim is P.fused_attention_stats
    p = _probs(em, qc, kc, bias, scale, causal, n, stats)
    if not bwd:
        p, st = p if stats else (p, None)
        o = em(P.dot_general, p, vc, dimension_numbers=(((n + 1,), (n,)), (batch, batch)))
        return em.eqns, [em.permute(o, np.argsort(dims[0]))] + ([st] if stats else [])
    oc, doc = (em.permute(x, dims[0]) for x in (out, dout))
    dv = em(P.dot_general, p, doc, dimension_numbers=(((n,), (n,)), (batch, batch)))
    dp = em(P.dot_general, doc, vc, dimension_numbers=(((n + 1,), (n + 1,)), (batch, batch)))
    di = em(P.reduce_sum, em(P.mul, doc, oc), axes=(n + 1,))
    ds = em(P.mul, p, em(P.sub, dp, em.expand(di, dp)))
    dq = em(P.dot_general, ds, kc, dimension_numbers=(((n + 1,), (n,)), (batch, batch)))
    dk = em(P.dot_general, ds, qc, dimension_numbers=(((n,), (n,)), (batch, batch)))
    dq, dk = (em(P.mul, g, em.full(scale, g)) for g in (dq, dk))
    flat = [em(P.reshape, em.permute(g, np.argsort(d)), new_sizes=(g.aval.size,))
            for g, d in zip((dq, dk, dv), dims)]
    return em.eqns, [em(P.concatenate, *flat, dimension=0)]


def decomposed_graph(eqn) -> Graph:
    """A graph computing one attention equation with ordinary primitives (fresh input variables)."""
    ins = [Var(a.aval) for a in eqn.inputs]
    eqns, outs = decompose(eqn.replace(inputs=tuple(ins)))
    return Graph((), tuple(ins), tuple(eqns), tuple(outs))


# ---- the pattern pass ----------------------------------------------------------------------------

EVAL_LIMIT = 1 << 22  # elements: masks built from iota and constants are evaluated to recognise them


class _Matcher:
    """Questions about the (rewritten) graph: producers, concrete values of constant subgraphs."""

    def __init__(self, graph: Graph, rw: Rewriter):
        self.rw = rw
        self.consts = {v.id: np.asarray(c, v.aval.dtype) for v, c in zip(graph.constvars, graph.consts)}
        self.memo: dict = {}

    def producer(self, a, *names):
        p = self.rw.producer.get(getattr(a, "id", None))
        return p if p is not None and (not names or p.prim.name in names) else None

    def value(self, a):
        """The concrete value of an atom computed from literals and constants only, else None."""
        if isinstance(a, Literal):
            return a.val
        if a.id in self.consts:
            return self.consts[a.id]
        if a.id in self.memo:
            return self.memo[a.id]
        p = self.producer(a)
        out = None
        if p is not None and not p.prim.effectful and a.aval.size <= EVAL_LIMIT:
            ins = [self.value(x) for x in p.inputs]
            if all(x is not None for x in ins):
                out = p.prim.impl(*ins, **p.params)[p.outputs.index(a)]
        self.memo[a.id] = out
        return out

    def scalar(self, a):
        """The float a uniform atom holds everywhere (a literal or a broadcast of one), else None."""
        u = self.rw.uniform(a)
        return None if u is None else float(u)


def _rows_reduced(shape, x_shape) -> bool:
    """Whether `shape` is x's shape without its last axis (or with it as 1): a per-row value."""
    return tuple(shape) in (tuple(x_shape[:-1]), tuple(x_shape[:-1]) + (1,))


def _row_value(m: _Matcher, a, x_shape):
    """Follow a per-row value broadcast back along the last axis (broadcast_in_dim, reshape,
    stop_gradient) to its source; None if `a` is not one."""
    e = m.producer(a, "broadcast_in_dim")
    if e is None or tuple(a.aval.shape) != tuple(x_shape):
        return None
    src = e.inputs[0]
    if not _rows_reduced(src.aval.shape, x_shape) or \
            tuple(e.params["broadcast_dimensions"]) != tuple(range(src.aval.ndim)):
        return None
    while True:
        p = m.producer(src, "reshape", "stop_gradient")
        if p is None or not _rows_reduced(p.inputs[0].aval.shape, x_shape):
            return src
        src = p.inputs[0]


def _guarded(m: _Matcher, a, guard: str, fill: float):
    """select(guard(a), a, fill) -> a (softmax's guards: a finite max, a positive sum), seen
    through the reshapes that keep the row axis as 1."""
    e = m.producer(a, "select")
    if e is None:
        return a
    pred, on_true, on_false = e.inputs
    g = m.producer(_strip_reshapes(m, pred, None), guard)
    if g is None or _strip_reshapes(m, g.inputs[0], None) is not _strip_reshapes(m, on_true, None) \
            or m.scalar(on_false) != fill:
        return a
    if guard == "gt" and m.scalar(g.inputs[1]) != 0.0:
        return a
    return on_true


def _guarded_eq(m: _Matcher, a, value: float, fill: float):
    """select(a == value, fill, a) -> a: nn.softmax's guards that let NaN through (a max of -inf
    taken as 0, a total of 0 as 1), as JAX's softmax, which is NaN on a row holding +inf or NaN.
    Under the matmul with v such a row is NaN in either form, so the fused attention (whose
    guards swallow NaN in the probabilities) computes the same output."""
    e = m.producer(a, "select")
    if e is None:
        return a
    pred, on_true, on_false = e.inputs
    g = m.producer(_strip_reshapes(m, pred, None), "eq")
    if g is None or _strip_reshapes(m, g.inputs[0], None) is not _strip_reshapes(m, on_false, None) \
            or m.scalar(g.inputs[1]) != value or m.scalar(on_true) != fill:
        return a
    return on_false


def _reduced(m: _Matcher, a, prim: str, x_shape):
    """The operand of reduce_<prim>(x, axes=(last,)) behind a per-row value, else None."""
    if a is None:
        return None
    e = m.producer(a, prim)
    n = len(x_shape)
    if e is None or tuple(e.params["axes"]) != (n - 1,) or tuple(e.inputs[0].aval.shape) != tuple(x_shape):
        return None
    return e.inputs[0]


def _softmax_input(m: _Matcher, p):
    """x if p is softmax(x) over the last axis, written out (exp(x - max) / sum, guarded or not,
    or exp(x) / sum), else None."""
    e = m.producer(p, "div")
    if e is None:
        return None
    num, den = e.inputs
    shape = p.aval.shape
    total = _row_value(m, den, shape)
    if total is None:
        return None
    total = _guarded(m, _strip_reshapes(m, total, shape), "gt", 1.0)
    total = _guarded_eq(m, _strip_reshapes(m, total, shape), 0.0, 1.0)
    summed = _reduced(m, _strip_reshapes(m, total, shape), "reduce_sum", shape)
    if summed is not num:
        return None
    ex = m.producer(num, "exp")
    if ex is None:
        return None
    t = ex.inputs[0]
    sub = m.producer(t, "sub")
    if sub is None:
        return t
    x, mx = sub.inputs
    mx = _row_value(m, mx, shape)
    if mx is None:
        return None
    mx = _guarded(m, _strip_reshapes(m, mx, shape), "is_finite", 0.0)
    mx = _guarded_eq(m, _strip_reshapes(m, mx, shape), -np.inf, 0.0)
    return x if _reduced(m, _strip_reshapes(m, mx, shape), "reduce_max", shape) is x else None


def _strip_reshapes(m: _Matcher, a, shape):
    """a seen through stop_gradient and reshapes between per-row shapes of `shape` (any reshape
    that only adds or drops a trailing size-1 axis when shape is None)."""
    while True:
        p = m.producer(a, "reshape", "stop_gradient")
        if p is None:
            return a
        src = p.inputs[0].aval.shape
        ok = _rows_reduced(src, shape) if shape is not None else \
            src in (a.aval.shape[:-1], a.aval.shape + (1,)) or a.aval.shape in (src + (1,), src[:-1])
        if not ok:
            return a
        a = p.inputs[0]


def _small(m: _Matcher, a, shape):
    """(source, canonical shape) of a value broadcast to `shape` by broadcast_in_dim (size-1 axes
    where it was broadcast), or (a, shape) itself."""
    e = m.producer(a, "broadcast_in_dim")
    if e is None:
        return a, tuple(shape)
    src, dims = e.inputs[0], e.params["broadcast_dimensions"]
    small = [1] * len(shape)
    for i, d in enumerate(dims):
        small[d] = src.aval.shape[i]
    return src, tuple(small)


@dataclass
class _Scores:
    """What the chain between the scores' matmul and the softmax does: the product of the scalar
    factors, an additive bias (atom, canonical small shape, the factors outside it), a bool mask
    (atom, canonical small shape) and whether that mask is the causal triangle."""
    scale: float = 1.0
    bias: tuple | None = None
    mask: tuple | None = None
    causal: bool = False


def _is_causal(m: _Matcher, src, small, shape, additive=False) -> bool:
    """Whether a constant mask (bool, True = keep; or additive, 0 / -inf) is the causal triangle."""
    val = m.value(src)
    sq, sk = shape[-2:]
    if val is None or small[-2:] != (sq, sk):
        return False
    tri = np.tri(sq, sk, sk - sq, dtype=bool)
    want = np.where(tri, 0.0, -np.inf) if additive else tri
    return bool(np.all(val.reshape(small) == want))


def _scores(m: _Matcher, x, st: _Scores):
    """Walk from the softmax input back to the q·kᵀ dot_general: (dot_general, what the chain
    does), or None if a step is not a scalar factor, an additive bias or a -inf mask."""
    shape = x.aval.shape
    e = m.producer(x)
    if e is None:
        return None
    name = e.prim.name
    if name == "dot_general":
        if (st.mask is not None or st.causal) and st.scale < 0:
            return None  # a negative factor outside the mask would turn -inf into +inf
        return e, st
    if name in ("mul", "div"):
        for a, c in ((e.inputs[0], e.inputs[1]), (e.inputs[1], e.inputs[0]))[:2 if name == "mul" else 1]:
            f = m.scalar(c)
            if f is not None and f != 0:
                return _scores(m, a, replace(st, scale=st.scale * (f if name == "mul" else 1.0 / f)))
        return None
    if name == "add":
        if st.bias is not None:
            return None
        for a, b in ((e.inputs[0], e.inputs[1]), (e.inputs[1], e.inputs[0])):
            if m.scalar(b) is None:
                src, small = _small(m, b, shape)
                if not st.causal and _is_causal(m, src, small, shape, additive=True):
                    hit = _scores(m, a, replace(st, causal=True))
                else:
                    hit = _scores(m, a, replace(st, bias=(src, small, st.scale)))
                if hit is not None:
                    return hit
        return None
    if name == "select":
        pred, a, fill = e.inputs
        if m.scalar(fill) != -np.inf or st.mask is not None or st.causal:
            return None
        src, small = _small(m, pred, shape)
        if _is_causal(m, src, small, shape):
            return _scores(m, a, replace(st, causal=True))
        return _scores(m, a, replace(st, mask=(src, small)))
    return None


def _operand_scale(m: _Matcher, a):
    """q·c (or q/c) with c a scalar -> (q, c); else (a, 1)."""
    e = m.producer(a, "mul", "div")
    if e is not None:
        x, c = e.inputs
        s = m.scalar(c)
        if s is None and e.prim.name == "mul":
            x, c = c, x
            s = m.scalar(c)
        if s is not None and s != 0:
            return x, (s if e.prim.name == "mul" else 1.0 / s)
    return a, 1.0


def _operand(m: _Matcher, a, dims: tuple, scaled: bool = True):
    """An operand of the scores (scaled: by scalars too) or v, with its layout `dims`, seen
    through transposes (swapaxes(k, -1, -2) read in place): (array, its layout, the scale)."""
    c = 1.0
    while True:
        t = m.producer(a, "transpose")
        if t is not None:
            perm = t.params["permutation"]
            a, dims = t.inputs[0], tuple(perm[i] for i in dims)
            continue
        b, f = _operand_scale(m, a) if scaled else (a, 1.0)
        if b is a:
            return a, dims, c
        a, c = b, c * f


def _layouts(d1, d2, v):
    """(q_dims, k_dims, v_dims) when the two dot_generals are attention's, else None."""
    (lc, rc), (lb, rb) = d1.params["dimension_numbers"]
    q, k = d1.inputs
    if len(lc) != 1 or q.aval.ndim != len(lb) + 2 or k.aval.ndim != len(rb) + 2:
        return None
    n = len(lb)
    qs = next(i for i in range(q.aval.ndim) if i not in lc and i not in lb)
    ks = next(i for i in range(k.aval.ndim) if i not in rc and i not in rb)
    (pc, vc), (pb, vb) = d2.params["dimension_numbers"]
    if tuple(pc) != (n + 1,) or tuple(pb) != tuple(range(n)) or v.aval.ndim != n + 2:
        return None
    vd = next(i for i in range(v.aval.ndim) if i not in vc and i not in vb)
    return ((*lb, qs, lc[0]), (*rb, ks, rc[0]), (*vb, vc[0], vd))


@dataclass
class _Hit:
    """A matched attention: the equations replacing dot_general d2 (`out` reads like d2's
    result), the fused_attention among them (its result laid out like q) and the scores' d1."""
    eqns: list
    out: Var
    fused: object
    d1: object
    operand_scales: tuple  # the scores' operands are q·cq and k·ck


def _match(m: _Matcher, d2):
    """The attention read by dot_general d2 and its fused replacement (a _Hit), or None."""
    if d2.params.get("preferred_element_type") is not None:
        return None
    p, v = d2.inputs
    x = _softmax_input(m, p)
    if x is None or not dtypes.is_float(x.aval.dtype):
        return None
    hit = _scores(m, x, _Scores())
    if hit is None:
        return None
    d1, sc = hit
    if d1.params.get("preferred_element_type") is not None:
        return None
    dims = _layouts(d1, d2, v)
    if dims is None:
        return None
    q, qd, cq = _operand(m, d1.inputs[0], dims[0])
    k, kd, ck = _operand(m, d1.inputs[1], dims[1])
    v, vd, _ = _operand(m, v, dims[2], scaled=False)
    dims = (qd, kd, vd)
    if not q.aval.dtype == k.aval.dtype == v.aval.dtype == x.aval.dtype:
        return None
    em = Emit()
    bias = None
    if sc.bias is not None:
        src, small, outside = sc.bias
        if src.aval.dtype != x.aval.dtype:
            return None
        bias = em(P.reshape, src, new_sizes=small) if src.aval.shape != small else src
        # the factors outside the addition scale the bias too: x = f·(g·q·kᵀ + b) = fg·q·kᵀ + f·b
        f = outside
        if f != 1.0:
            bias = em(P.mul, bias, em.full(f, bias))
    if sc.mask is not None:
        src, small = sc.mask
        pred = em(P.reshape, src, new_sizes=small) if src.aval.shape != small else src
        zero = em(P.broadcast_in_dim, literal(0.0, x.aval.dtype), shape=small, broadcast_dimensions=())
        mask = em(P.select, pred, zero, em.full(-np.inf, zero))
        if bias is not None:
            full = tuple(max(a, b) for a, b in zip(bias.aval.shape, small))
            b1, b2 = (em(P.broadcast_in_dim, t, shape=full, broadcast_dimensions=tuple(range(len(full))))
                      if t.aval.shape != full else t for t in (bias, mask))
            bias = em(P.add, b1, b2)
        else:
            bias = mask
    fused = em(P.fused_attention, q, k, v, *(() if bias is None else (bias,)),
               scale=float(sc.scale * cq * ck), causal=sc.causal, dims=dims)
    fused_eqn = em.eqns[-1]
    # the result is laid out like q; the dot_general's is canonical (batch..., Sq, Dv)
    out = em.permute(fused, dims[0])
    return _Hit(em.eqns, out, fused_eqn, d1, (cq, ck))


# ---- the backward written by autodiff -------------------------------------------------------------

def fuse_attention(graph: Graph) -> Graph:
    """softmax(q kᵀ·scale + mask) v -> fused_attention (see the module docstring)."""
    if not any(e.prim is P.dot_general for e in graph.eqns):
        return graph
    rw = Rewriter(graph)
    m = _Matcher(graph, rw)
    uses: dict[int, int] = {}
    for a in [a for e in graph.eqns for a in e.inputs] + list(graph.outvars):
        if isinstance(a, Var):
            uses[a.id] = uses.get(a.id, 0) + 1
    changed = False
    for e in graph.eqns:
        e = rw.rewrite_inputs(e)
        # weights read elsewhere too (a gradient's residual) are computed anyway: leave them
        alone = e.prim is P.dot_general and isinstance(e.inputs[0], Var) and uses.get(e.inputs[0].id) == 1
        hit = _match(m, e) if alone else None
        if hit is None:
            rw.emit(e)
            continue
        for x in hit.eqns:
            rw.emit(x)
        rw.alias(e.outputs[0], hit.out)
        changed = True
    return simplify(rw.finish()) if changed else graph


# ---- the forward's statistics for its backward ----------------------------------------------------

def attention_stats(graph: Graph) -> Graph:
    """fused_attention whose result a fused_attention_bwd of the same operands and parameters
    reads (attention's gradient) -> fused_attention_stats, and that backward reads the forward's
    row statistics instead of recomputing them (one product q kᵀ fewer). A structural match:
    the backward's operands are the forward's, its `out` the forward's result."""
    fwd = {e.outputs[0].id: i for i, e in enumerate(graph.eqns) if e.prim is P.fused_attention}
    if not fwd:
        return graph
    eqns, stats = list(graph.eqns), {}
    for i, e in enumerate(graph.eqns):
        if e.prim is not P.fused_attention_bwd or e.params.get("stats", False):
            continue
        j = fwd.get(getattr(e.inputs[-2], "id", None))
        f = None if j is None else graph.eqns[j]
        if f is None or e.inputs[:len(f.inputs)] != f.inputs or len(e.inputs) != len(f.inputs) + 2 or \
                any(e.params[k] != f.params[k] for k in ("scale", "causal", "dims")):
            continue
        if j not in stats:
            fe, outs = new_eqn(P.fused_attention_stats, f.inputs, f.params, f.source)
            eqns[j] = fe.replace(outputs=(f.outputs[0], outs[1]))
            stats[j] = outs[1]
        eqns[i] = e.replace(inputs=e.inputs + (stats[j],), params={**e.params, "stats": True})
    return graph.replace(eqns=tuple(eqns)) if stats else graph
