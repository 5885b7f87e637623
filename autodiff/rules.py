"""Differentiation rules: one VJP and one JVP rule per differentiable primitive of the table.

VJP rule:  rule(ct, *primals, out, needs, **params) -> one cotangent per operand.
JVP rule:  rule(tangents, *primals, out, **params) -> the output's tangent.
`out` is the primitive's primal output, `needs[i]` says whether operand i wants a cotangent
(a rule returns None for the others, so no dead work is staged), and None anywhere is a
symbolic zero. Rules bind primitives on the values they are given, which may be tracers of an
outer transformation (jit's staging, an outer grad), so every rule is itself differentiable and
stageable: grad(grad(f)) and jit(grad(f)) need nothing else.

Not here, on purpose: primitives whose outputs are integers or bools (comparisons, is_finite,
argmax/argmin, bitwise ops, iota) carry no derivative, and the traces never ask for one;
argmax's index is piecewise constant, its gradient is zero. ZERO_DERIVATIVE lists the float
primitives whose derivative is zero wherever it exists."""
from __future__ import annotations

import itertools
import math

import numpy as np

from tilefuse.ir import dtypes
from tilefuse.ir import primitives as P
from tilefuse.tracer.core import bind, bind1

from .ops import (add_any, aval, broadcast, convert, div, eq, expand_reduced, indicator,
                  instantiate, like, mul, neg, reduce_sum, reshape, select, slice_axis, sub,
                  transpose, zeros)

vjp_rules: dict = {}
jvp_rules: dict = {}
# Primitives with several outputs whose reverse mode changes the forward pass too (control flow:
# its forward saves residuals); autodiff/control_flow.py fills these.
# vjp_fwd_rules[prim](primals, needs, **params) -> (outputs, backward): backward(cts, one per
# output, None for zero) -> one cotangent per operand (None for zero).
vjp_fwd_rules: dict = {}
# jvp_multi_rules[prim](primals, tangents, **params) -> (outputs, tangents out), None for zero.
jvp_multi_rules: dict = {}

# Piecewise constant (or a gradient barrier): the derivative is a symbolic zero.
ZERO_DERIVATIVE = frozenset({P.sign, P.floor, P.ceil, P.round_, P.stop_gradient})


# ---- elementwise -------------------------------------------------------------------------

def _unary(prim, scale):
    """An elementwise unary primitive; scale(g, x, out) is g times the derivative at x. The
    Jacobian is diagonal, so the same product serves the VJP and the JVP."""
    vjp_rules[prim] = lambda ct, x, *, out, needs, **p: (scale(ct, x, out, **p),)
    jvp_rules[prim] = lambda ts, x, *, out, **p: scale(ts[0], x, out, **p)


_unary(P.neg, lambda g, x, out: neg(g))
_unary(P.exp, lambda g, x, out: mul(g, out))
_unary(P.log, lambda g, x, out: div(g, x))
_unary(P.log1p, lambda g, x, out: div(g, bind1(P.add, like(x, 1), x)))
_unary(P.expm1, lambda g, x, out: mul(g, bind1(P.add, out, like(out, 1))))
_unary(P.tanh, lambda g, x, out: mul(g, sub(like(out, 1), mul(out, out))))
_unary(P.logistic, lambda g, x, out: mul(g, mul(out, sub(like(out, 1), out))))
_unary(P.sqrt, lambda g, x, out: div(g, mul(like(out, 2), out)))
_unary(P.rsqrt, lambda g, x, out: mul(g, mul(like(out, -0.5), div(out, x))))
_unary(P.sin, lambda g, x, out: mul(g, bind1(P.cos, x)))
_unary(P.cos, lambda g, x, out: neg(mul(g, bind1(P.sin, x))))
_unary(P.erf, lambda g, x, out: mul(g, mul(like(x, 2 / math.sqrt(math.pi)),
                                           bind1(P.exp, neg(mul(x, x))))))
# |x|: sign(x), so 0 at the kink (a subgradient; PyTorch's choice).
_unary(P.abs_, lambda g, x, out: mul(g, bind1(P.sign, x)))


def _integer_pow_scale(g, x, out, *, y):
    if y == 0:
        return None
    if y == 1:
        return g
    base = x if y == 2 else bind1(P.integer_pow, x, y=y - 1)
    return mul(g, mul(like(x, y), base))


_unary(P.integer_pow, _integer_pow_scale)


def _binary(prim, dx, dy):
    """An elementwise binary primitive; dx(g, x, y, out) is g times the partial derivative in
    x (diagonal again, so it is the VJP and the JVP); None for a zero partial."""
    def vjp(ct, x, y, *, out, needs):
        return (dx(ct, x, y, out) if needs[0] else None,
                dy(ct, x, y, out) if needs[1] else None)

    def jvp(ts, x, y, *, out):
        tx, ty = ts
        return add_any(None if tx is None else dx(tx, x, y, out),
                       None if ty is None else dy(ty, x, y, out))
    vjp_rules[prim], jvp_rules[prim] = vjp, jvp


def _chooser_weights(x, y, out):
    """max/min ties: when x == y each operand gets half the gradient (JAX's rule), so the
    derivative of max(x, x) is 1 and that of relu(x) = max(x, 0) at 0 is 1/2."""
    ex, ey = indicator(eq(x, out), x), indicator(eq(y, out), y)
    half = like(x, 0.5)
    return mul(ex, sub(like(x, 1), mul(half, ey))), mul(ey, sub(like(x, 1), mul(half, ex)))


def _pow_dx(g, x, y, out):
    # y * x**(y-1), taken as 0 where y == 0 so that 0**0 has derivative 0 rather than nan
    d = mul(y, bind1(P.pow_, x, sub(y, like(y, 1))))
    return mul(g, select(eq(y, like(y, 0)), like(x, 0), d))


def _pow_dy(g, x, y, out):
    # x**y * log(x), with log(1) where x == 0: the limit of x**y log(x) for y > 0
    safe = select(eq(x, like(x, 0)), like(x, 1), x)
    return mul(g, mul(out, bind1(P.log, safe)))


def _rem_dy(g, x, y, out):
    # fmod(x, y) = x - trunc(x / y) * y; trunc is piecewise constant
    q = div(x, y)
    return neg(mul(g, mul(bind1(P.sign, q), bind1(P.floor, bind1(P.abs_, q)))))


_binary(P.add, lambda g, x, y, out: g, lambda g, x, y, out: g)
_binary(P.sub, lambda g, x, y, out: g, lambda g, x, y, out: neg(g))
_binary(P.mul, lambda g, x, y, out: mul(g, y), lambda g, x, y, out: mul(x, g))
_binary(P.div, lambda g, x, y, out: div(g, y), lambda g, x, y, out: neg(mul(g, div(out, y))))
_binary(P.rem, lambda g, x, y, out: g, _rem_dy)
_binary(P.pow_, _pow_dx, _pow_dy)
_binary(P.max_, lambda g, x, y, out: mul(g, _chooser_weights(x, y, out)[0]),
        lambda g, x, y, out: mul(g, _chooser_weights(x, y, out)[1]))
_binary(P.min_, lambda g, x, y, out: mul(g, _chooser_weights(x, y, out)[0]),
        lambda g, x, y, out: mul(g, _chooser_weights(x, y, out)[1]))


def _select_vjp(ct, pred, on_true, on_false, *, out, needs):
    z = like(ct, 0)
    return (None, select(pred, ct, z) if needs[1] else None,
            select(pred, z, ct) if needs[2] else None)


def _select_jvp(ts, pred, on_true, on_false, *, out):
    return select(pred, instantiate(ts[1], on_true), instantiate(ts[2], on_false))


vjp_rules[P.select], jvp_rules[P.select] = _select_vjp, _select_jvp


def _convert_vjp(ct, x, *, out, needs, new_dtype, weak_type=False):
    return (convert(ct, aval(x).dtype) if dtypes.is_float(aval(x).dtype) else None,)


def _convert_jvp(ts, x, *, out, new_dtype, weak_type=False):
    return convert(ts[0], new_dtype) if dtypes.is_float(new_dtype) else None


vjp_rules[P.convert_element_type] = _convert_vjp
jvp_rules[P.convert_element_type] = _convert_jvp


# ---- shape and layout: linear, so the JVP applies the primitive to the tangents -------------

def _linear(prim, transpose_rule):
    """A primitive linear in all its operands: JVP = the primitive on the tangents."""
    vjp_rules[prim] = transpose_rule

    def jvp(ts, *xs, out, **params):
        return bind1(prim, *(instantiate(t, x) for t, x in zip(ts, xs)), **params)
    jvp_rules[prim] = jvp


def _bcast_vjp(ct, x, *, out, needs, shape, broadcast_dimensions):
    xs, bd = aval(x).shape, broadcast_dimensions
    summed = [d for d in range(len(shape)) if d not in bd]
    summed += [d for i, d in enumerate(bd) if xs[i] == 1 and shape[d] != 1]
    return (reshape(reduce_sum(ct, summed), xs),)


def _slice_vjp(ct, x, *, out, needs, start_indices, limit_indices, strides):
    xs, cs = aval(x).shape, aval(ct).shape
    if 0 in cs:
        return (None,)
    cfg = tuple((s, n - s - (k - 1) * st - 1, st - 1)
                for s, n, k, st in zip(start_indices, xs, cs, strides))
    return (bind1(P.pad, ct, np.zeros((), aval(ct).dtype), padding_config=cfg),)


def _concat_vjp(ct, *xs, out, needs, dimension):
    cts, start = [], 0
    for x, need in zip(xs, needs):
        n = aval(x).shape[dimension]
        cts.append(slice_axis(ct, dimension, start, start + n) if need else None)
        start += n
    return tuple(cts)


def _pad_vjp(ct, x, pv, *, out, needs, padding_config):
    xs = aval(x).shape
    ct_x = None
    if 0 not in xs:
        a = aval(ct)
        lo = tuple(p[0] for p in padding_config)
        st = tuple(p[2] + 1 for p in padding_config)
        hi = tuple(l + (n - 1) * s + 1 for l, n, s in zip(lo, xs, st))
        ct_x = bind1(P.slice_, ct, start_indices=lo, limit_indices=hi, strides=st) if a.ndim else ct
    ct_pv = None
    if needs[1]:  # the padding value fills every position the operand does not
        everything = range(aval(ct).ndim)
        ct_pv = reduce_sum(ct, everything)
        if ct_x is not None:
            ct_pv = sub(ct_pv, reduce_sum(ct_x, everything))
    return ct_x if needs[0] else None, ct_pv


_linear(P.broadcast_in_dim, _bcast_vjp)
_linear(P.reshape, lambda ct, x, *, out, needs, new_sizes: (reshape(ct, aval(x).shape),))
_linear(P.transpose, lambda ct, x, *, out, needs, permutation: (
    transpose(ct, tuple(int(i) for i in np.argsort(permutation))),))
_linear(P.rev, lambda ct, x, *, out, needs, dimensions: (bind1(P.rev, ct, dimensions=dimensions),))
_linear(P.slice_, _slice_vjp)
_linear(P.concatenate, _concat_vjp)
_linear(P.pad, _pad_vjp)
_linear(P.reduce_sum, lambda ct, x, *, out, needs, axes: (
    expand_reduced(ct, aval(x).shape, axes),))


# ---- reductions --------------------------------------------------------------------------

def _extreme_locations(x, out, axes):
    """(loc, count): 1 where x holds its reduction's extreme value, and how many do."""
    shape = aval(x).shape
    loc = indicator(eq(x, expand_reduced(out, shape, axes)), x)
    return loc, reduce_sum(loc, axes)


def _chooser_vjp(ct, x, *, out, needs, axes):
    """reduce_max/reduce_min. Ties: the gradient is split equally among all the positions that
    hold the extreme value (JAX's rule), so it sums to the incoming cotangent."""
    shape = aval(x).shape
    loc, count = _extreme_locations(x, out, axes)
    return (mul(loc, expand_reduced(div(ct, count), shape, axes)),)


def _chooser_jvp(ts, x, *, out, axes):
    loc, count = _extreme_locations(x, out, axes)
    return div(reduce_sum(mul(ts[0], loc), axes), count)


for _p in (P.reduce_max, P.reduce_min):
    vjp_rules[_p], jvp_rules[_p] = _chooser_vjp, _chooser_jvp


def _prod_partials(x, axes):
    """d prod / d x_i = the product of the other elements, computed as such (an n x n product
    with ones on the diagonal per reduced group), so it is exact with zeros in x and its own
    derivatives are too. O(n^2) per group: fine for the axes prod is used on."""
    shape, nd = aval(x).shape, aval(x).ndim
    keep = [i for i in range(nd) if i not in axes]
    perm = keep + sorted(axes)
    kshape = [shape[i] for i in keep]
    n = int(np.prod([shape[a] for a in axes], dtype=np.int64))
    k = len(kshape)
    flat = reshape(transpose(x, perm), kshape + [n])
    rows = broadcast(flat, kshape + [n, n], list(range(k)) + [k + 1])  # rows[..., i, j] = x[..., j]
    diag = eq(bind1(P.iota, dtype=dtypes.int32, shape=(n, n), dimension=0),
              bind1(P.iota, dtype=dtypes.int32, shape=(n, n), dimension=1))
    rows = select(broadcast(diag, kshape + [n, n], (k, k + 1)), like(rows, 1), rows)
    others = bind1(P.reduce_prod, rows, axes=(k + 1,))
    back = reshape(others, [shape[i] for i in perm])
    return transpose(back, [int(i) for i in np.argsort(perm)])


vjp_rules[P.reduce_prod] = lambda ct, x, *, out, needs, axes: (
    mul(expand_reduced(ct, aval(x).shape, axes), _prod_partials(x, axes)),)
jvp_rules[P.reduce_prod] = lambda ts, x, *, out, axes: reduce_sum(
    mul(ts[0], _prod_partials(x, axes)), axes)


# ---- contraction ---------------------------------------------------------------------------

def _ranges_like(*xs):
    start = 0
    for x in xs:
        yield tuple(range(start, start + len(x)))
        start += len(x)


def _remaining(n, *removed):
    gone = set(itertools.chain(*removed))
    return [i for i in range(n) if i not in gone]


def _dot_transpose_lhs(g, x, y, dimension_numbers, swap_ans=False):
    """The cotangent of dot_general's lhs: g contracted with y over y's free axes, then the
    axes put back in x's order (JAX's rule)."""
    (xc, yc), (xb, yb) = dimension_numbers
    x_kept = _remaining(aval(x).ndim, xc, xb)
    y_kept = _remaining(aval(y).ndim, yc, yb)
    if swap_ans:
        ans_batch, ans_y, _ = _ranges_like(xb, y_kept, x_kept)
    else:
        ans_batch, _, ans_y = _ranges_like(xb, x_kept, y_kept)
    dims = ((ans_y, tuple(y_kept)), (ans_batch, tuple(yb)))
    xc_by_y = [xc[int(i)] for i in np.argsort(yc)]
    r = bind1(P.dot_general, g, y, dimension_numbers=dims)
    return transpose(r, [int(i) for i in np.argsort(list(xb) + x_kept + xc_by_y)])


def _dot_vjp(ct, x, y, *, out, needs, dimension_numbers, preferred_element_type=None):
    ct = convert(ct, aval(x).dtype)  # a wider preferred output type: back to the operands'
    (xc, yc), (xb, yb) = dimension_numbers
    return (_dot_transpose_lhs(ct, x, y, dimension_numbers) if needs[0] else None,
            _dot_transpose_lhs(ct, y, x, ((yc, xc), (yb, xb)), swap_ans=True) if needs[1] else None)


def _dot_jvp(ts, x, y, *, out, **params):
    tx, ty = ts
    return add_any(None if tx is None else bind1(P.dot_general, tx, y, **params),
                   None if ty is None else bind1(P.dot_general, x, ty, **params))


vjp_rules[P.dot_general], jvp_rules[P.dot_general] = _dot_vjp, _dot_jvp


# ---- convolution: its transposes are convolutions (JAX's rules, in its axis-spec form) -----------

def _dilated(shape, dilation):
    return [0 if s == 0 else 1 + d * (s - 1) for s, d in zip(shape, dilation)]


def _swap_spec(spec):
    """batch <-> feature (out feature <-> in feature for a filter)."""
    return (spec[1], spec[0]) + tuple(spec[2:])


def _split_axis(x, axis, size):
    """Axis `axis` of x as (size, rest), the new axes at axis and axis + 1."""
    shape = list(aval(x).shape)
    shape[axis:axis + 1] = [size, shape[axis] // size]
    return reshape(x, shape)


def _merge_axis(x, src, dst):
    """Axis src merged into axis dst (dst counted once src is removed), src the major part."""
    perm = [i for i in range(aval(x).ndim) if i != src]
    perm.insert(dst, src)
    shape = [n for i, n in enumerate(aval(x).shape) if i != src]
    shape[dst] *= aval(x).shape[src]
    return reshape(transpose(x, perm), shape)


def _conv_lhs_cotangent(ct, x, w, *, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                        feature_group_count, batch_group_count):
    ls, rs, os_ = dimension_numbers
    groups = max(feature_group_count, batch_group_count)
    if groups > 1:  # the groups move from the filter's output features to its input features
        w = _merge_axis(_split_axis(w, rs[0], groups), rs[0], rs[1])
    k = _dilated([aval(w).shape[a] for a in rs[2:]], rhs_dilation)
    xd = _dilated([aval(x).shape[a] for a in ls[2:]], lhs_dilation)
    yd = _dilated([aval(ct).shape[a] for a in os_[2:]], window_strides)
    before = [kk - lo - 1 for kk, (lo, _) in zip(k, padding)]
    pads = tuple((b, xx + kk - 1 - yy - b) for b, xx, kk, yy in zip(before, xd, k, yd))
    flipped = bind1(P.rev, w, dimensions=tuple(rs[2:]))
    dx = bind1(P.conv, ct, flipped, window_strides=tuple(lhs_dilation), padding=pads,
               lhs_dilation=tuple(window_strides), rhs_dilation=tuple(rhs_dilation),
               dimension_numbers=(os_, _swap_spec(rs), ls), feature_group_count=groups, batch_group_count=1)
    if batch_group_count > 1:
        dx = _merge_axis(_split_axis(dx, ls[1], batch_group_count), ls[1], ls[0])
    return dx


def _conv_rhs_cotangent(ct, x, w, *, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                        feature_group_count, batch_group_count):
    ls, rs, os_ = dimension_numbers
    if aval(ct).size == 0:
        return zeros(aval(w))
    k = _dilated([aval(w).shape[a] for a in rs[2:]], rhs_dilation)
    xd = _dilated([aval(x).shape[a] for a in ls[2:]], lhs_dilation)
    yd = _dilated([aval(ct).shape[a] for a in os_[2:]], window_strides)
    pads = tuple((lo, yy - xx + kk - lo - 1) for (lo, _), xx, kk, yy in zip(padding, xd, k, yd))
    return bind1(P.conv, x, ct, window_strides=tuple(rhs_dilation), padding=pads,
                 lhs_dilation=tuple(lhs_dilation), rhs_dilation=tuple(window_strides),
                 dimension_numbers=(_swap_spec(ls), _swap_spec(os_), _swap_spec(rs)),
                 feature_group_count=batch_group_count, batch_group_count=feature_group_count)


def _conv_vjp(ct, x, w, *, out, needs, **params):
    return (_conv_lhs_cotangent(ct, x, w, **params) if needs[0] else None,
            _conv_rhs_cotangent(ct, x, w, **params) if needs[1] else None)


def _conv_jvp(ts, x, w, *, out, **params):
    tx, tw = ts
    return add_any(None if tx is None else bind1(P.conv, tx, w, **params),
                   None if tw is None else bind1(P.conv, x, tw, **params))


vjp_rules[P.conv], jvp_rules[P.conv] = _conv_vjp, _conv_jvp


# ---- indexing: gather and scatter-add are each other's transpose ------------------------------

def _gather_vjp(ct, operand, indices, *, out, needs, axis):
    """Embedding lookup: rows gathered k times receive the sum of their k cotangents."""
    return bind1(P.scatter_add, zeros(aval(operand)), indices, ct, axis=axis), None


def _scatter_add_vjp(ct, operand, indices, updates, *, out, needs, axis):
    return (ct if needs[0] else None, None,
            bind1(P.gather, ct, indices, axis=axis) if needs[2] else None)


vjp_rules[P.gather] = _gather_vjp
jvp_rules[P.gather] = lambda ts, operand, indices, *, out, axis: bind1(
    P.gather, ts[0], indices, axis=axis)
vjp_rules[P.scatter_add] = _scatter_add_vjp
jvp_rules[P.scatter_add] = lambda ts, operand, indices, updates, *, out, axis: bind1(
    P.scatter_add, instantiate(ts[0], operand), indices, instantiate(ts[2], updates), axis=axis)


# ---- fused attention ----------------------------------------------------------------------------
# The VJP of fused_attention is the fused backward (dq, dk, dv packed into one array). The
# other rules differentiate the decomposition into ordinary primitives (ir/passes/attention.py):
# forward mode and higher orders are rare enough to run unfused.

def _decomposed(prim, params, primals):
    """prim(*primals, **params) as a function written with ordinary primitives."""
    from tilefuse.ir.core import Eqn, Var, eval_graph
    from tilefuse.ir.passes.attention import decomposed_graph
    ins = tuple(Var(aval(x).strip_weak()) for x in primals)
    outs = tuple(Var(a) for a in prim.abstract_eval(*[v.aval for v in ins], **params))
    g = decomposed_graph(Eqn(prim, ins, outs, dict(params)))
    return lambda *xs: eval_graph(g, xs, lambda e, vals: bind(e.prim, *vals, **e.params))[0]


def _jvp_by_decomposition(prim):
    def rule(ts, *primals, out, **params):
        from .api import jvp
        ts = tuple(instantiate(t, x) for t, x in zip(ts, primals))
        return jvp(_decomposed(prim, params, primals), tuple(primals), ts)[1]
    return rule


def _vjp_by_decomposition(prim):
    def rule(ct, *primals, out, needs, **params):
        from .vjp import vjp_flat  # (not api.vjp: its rewrites would fuse the decomposition back)
        f = _decomposed(prim, params, primals)
        _, pullback, _ = vjp_flat(lambda *xs: ([f(*xs)], None), list(primals))
        return tuple(c if n else None for c, n in zip(pullback([ct]), needs))
    return rule


def split_attention_grads(packed, q, k, v):
    """fused_attention_bwd's packed result -> (dq, dk, dv)."""
    out, start = [], 0
    for x in (q, k, v):
        n = aval(x).size
        part = bind1(P.slice_, packed, start_indices=(start,), limit_indices=(start + n,), strides=(1,))
        out.append(reshape(part, aval(x).shape))
        start += n
    return out


def _attention_vjp(ct, q, k, v, *bias, out, needs, scale, causal, dims):
    if bias and needs[3]:  # the fused backward gives no bias gradient: differentiate unfused
        return _vjp_by_decomposition(P.fused_attention)(
            ct, q, k, v, *bias, out=out, needs=needs, scale=scale, causal=causal, dims=dims)
    packed = bind1(P.fused_attention_bwd, q, k, v, *bias, out, ct, scale=scale, causal=causal,
                   dims=dims)
    grads = split_attention_grads(packed, q, k, v)
    return tuple(g if n else None for g, n in zip(grads, needs)) + (None,) * len(bias)


vjp_rules[P.fused_attention] = _attention_vjp
jvp_rules[P.fused_attention] = _jvp_by_decomposition(P.fused_attention)
vjp_rules[P.fused_attention_bwd] = _vjp_by_decomposition(P.fused_attention_bwd)
jvp_rules[P.fused_attention_bwd] = _jvp_by_decomposition(P.fused_attention_bwd)


# ---- sorting and linear algebra (the numpy_host primitives) ------------------------------------
# argsort has an integer result: no rule. The decompositions' JVPs are JAX's; solve and
# triangular_solve have their VJPs written out, the others get theirs by transposing the JVP
# (it is linear in the tangents: the VJP of that linear map is its transpose).

def _mT(x):
    nd = aval(x).ndim
    return transpose(x, tuple(range(nd - 2)) + (nd - 1, nd - 2))


def _mm(x, y):
    """x @ y over the last two axes, equal leading (batch) axes."""
    nb = aval(x).ndim - 2
    batch = tuple(range(nb))
    return bind1(P.dot_general, x, y, dimension_numbers=(((nb + 1,), (nb,)), (batch, batch)))


def _tri_mask(x, lower: bool, strict: bool = False):
    """The lower (upper) triangle of x's last two axes, diagonal included unless strict."""
    shape = aval(x).shape
    nd = len(shape)
    r = bind1(P.iota, dtype=dtypes.int32, shape=shape, dimension=nd - 2)
    c = bind1(P.iota, dtype=dtypes.int32, shape=shape, dimension=nd - 1)
    keep = bind1(P.gt if strict else P.ge, r, c) if lower else bind1(P.lt if strict else P.le, r, c)
    return select(keep, x, like(x, 0))


def _eye_like(x):
    shape = aval(x).shape
    nd = len(shape)
    r = bind1(P.iota, dtype=dtypes.int32, shape=shape, dimension=nd - 2)
    c = bind1(P.iota, dtype=dtypes.int32, shape=shape, dimension=nd - 1)
    return indicator(eq(r, c), x)


def _diag_part(x):
    """The diagonal of x's last two (square) axes: (..., n)."""
    return reduce_sum(mul(x, _eye_like(x)), (aval(x).ndim - 1,))


def _sym_part(t):
    return mul(add_any(t, _mT(t)), like(t, 0.5))


def _solve_jvp(ts, a, b, *, out):
    ta, tb = ts
    rhs = add_any(tb, None if ta is None else neg(_mm(ta, out)))
    return None if rhs is None else bind1(P.solve, a, rhs)


def _solve_vjp(ct, a, b, *, out, needs):
    gb = bind1(P.solve, _mT(a), ct)
    return (neg(_mm(gb, _mT(out))) if needs[0] else None), (gb if needs[1] else None)


vjp_rules[P.solve], jvp_rules[P.solve] = _solve_vjp, _solve_jvp


def _tri_operand_mask(t, lower, unit_diagonal):
    return _tri_mask(t, lower, strict=unit_diagonal)


def _triangular_solve_jvp(ts, a, b, *, out, lower, transpose_a, unit_diagonal):
    ta, tb = ts
    dt = None
    if ta is not None:
        m = _tri_operand_mask(ta, lower, unit_diagonal)
        dt = neg(_mm(_mT(m) if transpose_a else m, out))
    rhs = add_any(tb, dt)
    return None if rhs is None else bind1(P.triangular_solve, a, rhs, lower=lower, transpose_a=transpose_a,
                                          unit_diagonal=unit_diagonal)


def _triangular_solve_vjp(ct, a, b, *, out, needs, lower, transpose_a, unit_diagonal):
    gb = bind1(P.triangular_solve, a, ct, lower=lower, transpose_a=not transpose_a,
               unit_diagonal=unit_diagonal)
    ga = None
    if needs[0]:
        outer = _mm(out, _mT(gb)) if transpose_a else _mm(gb, _mT(out))
        ga = neg(_tri_operand_mask(outer, lower, unit_diagonal))
    return ga, (gb if needs[1] else None)


vjp_rules[P.triangular_solve], jvp_rules[P.triangular_solve] = _triangular_solve_vjp, _triangular_solve_jvp


def _pack(parts, batch):
    """Tangents of a packed decomposition: each part flattened after the batch axes, in order."""
    flat = [reshape(p, tuple(batch) + (int(np.prod(aval(p).shape[len(batch):], dtype=np.int64)),))
            for p in parts]
    return bind1(P.concatenate, *flat, dimension=len(batch)) if len(flat) > 1 else flat[0]


def _unpack(packed, shapes):
    batch = aval(packed).shape[:-1]
    out, start = [], 0
    for s in shapes:
        n = int(np.prod(s, dtype=np.int64))
        out.append(reshape(slice_axis(packed, len(batch), start, start + n), tuple(batch) + tuple(s)))
        start += n
    return out


def _cholesky_jvp(ts, a, *, out):
    # dL = L Φ(L⁻¹ dA L⁻ᵀ), Φ: the lower triangle with the diagonal halved (dA symmetrized, as a is)
    da = _sym_part(ts[0])
    y = bind1(P.triangular_solve, out, da, lower=True, transpose_a=False, unit_diagonal=False)
    z = bind1(P.triangular_solve, out, _mT(y), lower=True, transpose_a=False, unit_diagonal=False)
    phi = sub(_tri_mask(z, True), mul(_tri_mask(_tri_mask(z, True), False), like(z, 0.5)))
    return _mm(out, phi)


def _slogdet_jvp(ts, a, *, out):
    dlog = _diag_part(bind1(P.solve, a, ts[0]))
    d = reduce_sum(dlog, (aval(dlog).ndim - 1,))
    d = reshape(d, aval(d).shape + (1,))
    return bind1(P.concatenate, like(d, 0), d, dimension=aval(d).ndim - 1)


def _qr_jvp(ts, a, *, out, full_matrices):
    m, n = aval(a).shape[-2:]
    if m < n or (full_matrices and m != n):
        from tilefuse.ir.errors import TransformError
        raise TransformError("the derivative of qr needs a tall or square matrix (m >= n) and, when "
                             f"m > n, full_matrices=False; got a ({m}, {n}) matrix")
    q, r = _unpack(out, P.packed_sizes("qr", aval(a).shape, full_matrices=full_matrices))
    # dA R⁻¹ (a right-side solve), as JAX's qr_jvp_rule
    dx_rinv = _mT(bind1(P.triangular_solve, r, _mT(ts[0]), lower=False, transpose_a=True,
                        unit_diagonal=False))
    qt_dx_rinv = _mm(_mT(q), dx_rinv)
    low = _tri_mask(qt_dx_rinv, True, strict=True)
    do = sub(low, _mT(low))
    dq = add_any(_mm(q, sub(do, qt_dx_rinv)), dx_rinv)
    dr = _mm(sub(qt_dx_rinv, do), r)
    return _pack([dq, dr], aval(a).shape[:-2])


def _eigh_jvp(ts, a, *, out):
    w, v = _unpack(out, P.packed_sizes("eigh", aval(a).shape))
    nd = aval(w).ndim
    shape = aval(v).shape
    wi = broadcast(w, shape, tuple(range(nd - 1)) + (nd - 1,))  # [..., i, j] = w_i
    wj = broadcast(w, shape, tuple(range(nd - 1)) + (nd,))  # [..., i, j] = w_j
    eye = _eye_like(v)
    f = sub(div(like(v, 1), add_any(eye, sub(wj, wi))), eye)  # 1 / (w_j - w_i) off the diagonal
    vt_da_v = _mm(_mm(_mT(v), _sym_part(ts[0])), v)
    dv = _mm(v, mul(f, vt_da_v))
    dw = _diag_part(vt_da_v)
    return _pack([dw, dv], aval(a).shape[:-2])


def _svd_jvp(ts, a, *, out, full_matrices, compute_uv):
    shape = aval(a).shape
    m, n = shape[-2:]
    if compute_uv and full_matrices and m != n:
        from tilefuse.ir.errors import TransformError
        raise TransformError("the derivative of svd with full_matrices=True needs a square matrix; "
                             f"got ({m}, {n}): use full_matrices=False")
    packed = out if compute_uv and not full_matrices else \
        bind1(P.svd, a, full_matrices=False, compute_uv=True)
    u, s, vt = _unpack(packed, P.packed_sizes("svd", shape, full_matrices=False, compute_uv=True))
    da = ts[0]
    v = _mT(vt)
    ds_mat = _mm(_mm(_mT(u), da), v)
    ds = _diag_part(ds_mat)
    if not compute_uv:
        return ds
    nd = aval(s).ndim
    k = aval(s).shape[-1]
    kshape = aval(s).shape[:-1] + (k, k)
    s_row = broadcast(s, kshape, tuple(range(nd - 1)) + (nd,))  # [..., i, j] = s_j
    s_col = broadcast(s, kshape, tuple(range(nd - 1)) + (nd - 1,))  # [..., i, j] = s_i
    eye = _eye_like(ds_mat)
    s_diffs = mul(add_any(s_row, s_col), sub(s_row, s_col))
    f = sub(div(like(s_diffs, 1), add_any(s_diffs, eye)), eye)
    dss = mul(s_row, ds_mat)  # dS diag(s)
    sds = mul(s_col, ds_mat)  # diag(s) dS
    zero = indicator(eq(s, like(s, 0)), s)
    s_inv = sub(div(like(s, 1), add_any(s, zero)), zero)
    s_inv_mat = mul(broadcast(s_inv, kshape, tuple(range(nd - 1)) + (nd,)), eye)
    dudv_diag = mul(mul(sub(ds_mat, _mT(ds_mat)), like(ds_mat, 0.5)), s_inv_mat)
    du = _mm(u, add_any(mul(f, add_any(dss, _mT(dss))), dudv_diag))
    dv = _mm(v, mul(f, add_any(sds, _mT(sds))))
    if m > n:
        dav = _mm(da, v)
        du = add_any(du, div(sub(dav, _mm(u, _mm(_mT(u), dav))), broadcast(s, aval(dav).shape,
                                                                       tuple(range(nd - 1)) + (nd,))))
    if n > m:
        dahu = _mm(_mT(da), u)
        dv = add_any(dv, div(sub(dahu, _mm(v, _mm(vt, dahu))), broadcast(s, aval(dahu).shape,
                                                                    tuple(range(nd - 1)) + (nd,))))
    return _pack([du, ds, _mT(dv)], shape[:-2])


def _vjp_by_transposing_jvp(prim):
    """The VJP of a primitive whose JVP is written: the JVP is linear in the tangents, and the
    VJP of a linear map at any point is its transpose."""
    def rule(ct, *primals, out, needs, **params):
        from .vjp import vjp_flat

        def linear(*tangents):
            ts = [t if need else None for t, need in zip(tangents, needs)]
            return [jvp_rules[prim](ts, *primals, out=out, **params)], None
        _, pullback, _ = vjp_flat(linear, [zeros(aval(x)) for x in primals])
        return tuple(c if need else None for c, need in zip(pullback([ct]), needs))
    return rule


for _p, _jvp in ((P.cholesky, _cholesky_jvp), (P.slogdet, _slogdet_jvp), (P.qr, _qr_jvp),
                 (P.eigh, _eigh_jvp), (P.svd, _svd_jvp)):
    jvp_rules[_p] = _jvp
    vjp_rules[_p] = _vjp_by_transposing_jvp(_p)


# ---- dynamic slicing (tilefuse.lax) ------------------------------------------------------------

def _dynamic_slice_vjp(ct, x, *starts, out, needs, slice_sizes):
    cx = bind1(P.dynamic_update_slice, zeros(aval(x)), ct, *starts) if needs[0] else None
    return (cx,) + (None,) * len(starts)


def _dynamic_slice_jvp(ts, x, *starts, out, slice_sizes):
    return None if ts[0] is None else bind1(P.dynamic_slice, ts[0], *starts, slice_sizes=slice_sizes)


def _dynamic_update_slice_vjp(ct, x, update, *starts, out, needs):
    cx = bind1(P.dynamic_update_slice, ct, zeros(aval(update)), *starts) if needs[0] else None
    cu = bind1(P.dynamic_slice, ct, *starts, slice_sizes=aval(update).shape) if needs[1] else None
    return (cx, cu) + (None,) * len(starts)


def _dynamic_update_slice_jvp(ts, x, update, *starts, out):
    if ts[0] is None and ts[1] is None:
        return None
    return bind1(P.dynamic_update_slice, instantiate(ts[0], x), instantiate(ts[1], update), *starts)


vjp_rules[P.dynamic_slice] = _dynamic_slice_vjp
jvp_rules[P.dynamic_slice] = _dynamic_slice_jvp
vjp_rules[P.dynamic_update_slice] = _dynamic_update_slice_vjp
jvp_rules[P.dynamic_update_slice] = _dynamic_update_slice_jvp
