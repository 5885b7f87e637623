"""The primitive table: every primitive as op records × shapes × dtypes (0-d, size 1 and size 0
shapes included) with an independent numpy reference. Each record runs eagerly (one primitive on
device Arrays) and under jit, and checks the shape rule against what came out.

tests/ir/test_primitives.py runs this table on every device (its `device` fixture) and
`python -m tilefuse.validate` runs it from the command line: one table, one check."""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Callable

import ml_dtypes
import numpy as np

import tilefuse as tx
from tilefuse.ir import primitives as P
from tilefuse.api import make_graph
from tilefuse.ir.core import ShapedArray
from tilefuse.runtime.compiler import precompile
from tilefuse.tracer.core import bind

from .compare import Comparison, tolerance_for

F32, F64, F16, BF16 = np.float32, np.float64, np.float16, ml_dtypes.bfloat16
I32, I64, BOOL = np.int32, np.int64, np.bool_
FLOATS = (F32, F16, BF16, F64)
INTS = (I32, I64)

UNARY_SHAPES = [(), (1,), (0,), (7,), (2, 3, 4), (3, 0)]
BINARY_SHAPES = [(), (1,), (0,), (5,), (2, 3)]


def _rand(rng, shape, dtype, lo=-3.0, hi=3.0):
    d = np.dtype(dtype)
    if d == np.bool_:
        return rng.random(shape) < 0.5
    if d.kind in "iu":
        return rng.integers(int(lo), int(hi) + 1, size=shape).astype(d)
    return rng.uniform(lo, hi, size=shape).astype(d)


def _positive(rng, shape, dtype):
    return _rand(rng, shape, dtype, 0.1, 4.0)


def _nonzero_ints(rng, shape, dtype):
    x = _rand(rng, shape, dtype, -9, 9)
    return np.where(x == 0, 3, x).astype(dtype)


@dataclass
class Op:
    """A row of the table: how to make inputs, the params, and the numpy reference."""
    name: str
    prim: P.Primitive
    args: Callable  # (rng, shape, dtype) -> list of numpy inputs
    ref: Callable  # (*inputs) -> expected output (numpy)
    dtypes: tuple = FLOATS
    shapes: list = field(default_factory=lambda: UNARY_SHAPES)
    params: dict = field(default_factory=dict)
    tol: dict = field(default_factory=dict)  # dtype -> (rtol, atol) overriding the default

    def __str__(self):
        return self.name


def _in_f32(fn):
    """numpy reference computed in float32 (float64 stays float64), cast to the input dtype."""
    def ref(*xs):
        d = xs[0].dtype
        cd = np.float64 if d == np.float64 else np.float32 if d.kind == "f" or d == BF16 else d
        return np.asarray(fn(*(x.astype(cd) for x in xs)), d)
    return ref


def unary(name, prim, fn, make=_rand, dtypes=FLOATS, **kw):
    return Op(name, prim, lambda r, s, d: [make(r, s, d)], _in_f32(fn), dtypes, **kw)


def binary(name, prim, fn, make=_rand, dtypes=FLOATS + INTS, out_dtype=None, **kw):
    def args(r, s, d):
        return [make(r, s, d), make(r, s, d)]
    ref = (lambda x, y: np.asarray(fn(x, y), out_dtype)) if out_dtype else _in_f32(fn)
    return Op(name, prim, args, ref, dtypes, shapes=BINARY_SHAPES, **kw)


_erf = np.vectorize(math.erf, otypes=[np.float64])
_ALL = FLOATS + INTS + (BOOL,)


def _c_div(x, y):
    if x.dtype.kind == "i":  # round toward zero, as C does
        return (np.sign(x) * np.sign(y) * (np.abs(x) // np.abs(y))).astype(x.dtype)
    return x / y


def _c_rem(x, y):
    if x.dtype.kind == "i":
        return (x - _c_div(x, y) * y).astype(x.dtype)
    return np.fmod(x, y)


def _shift_args(r, s, d):
    return [_rand(r, s, d, -50, 50), r.integers(0, 31, size=s).astype(d)]


def _srl(x, s):
    u = np.uint32 if x.dtype.itemsize == 4 else np.uint64
    return (x.view(u) >> s.astype(u)).view(x.dtype)


def _ipow(y):
    return Op(f"integer_pow{y}", P.integer_pow,
              lambda r, s, d: [_rand(r, s, d, 0.5, 2.0) if y < 0 and d not in INTS else _rand(r, s, d, -3, 3)],
              _in_f32(lambda x: np.power(x, y) if y >= 0 else 1 / np.power(x, -y)),
              FLOATS + (INTS if y >= 0 else ()), params=dict(y=y))


def _select_args(r, s, d):
    return [r.random(s) < 0.5, _rand(r, s, d), _rand(r, s, d)]


def _convert(to):
    def ref(x):
        if np.dtype(to).kind == "i" and x.dtype.kind == "f":
            return np.trunc(x.astype(np.float64)).astype(to)
        return x.astype(to)
    return Op(f"convert_to_{np.dtype(to).name}", P.convert_element_type, lambda r, s, d: [_rand(r, s, d)],
              ref, (F32, F16, BF16, I32, BOOL), params=dict(new_dtype=np.dtype(to)))


def _bcast(shape, out, dims):
    return Op(f"broadcast_in_dim{shape}->{out}", P.broadcast_in_dim, lambda r, s, d: [_rand(r, shape, d)],
              lambda x: np.broadcast_to(x.reshape([shape[dims.index(i)] if i in dims else 1
                                                    for i in range(len(out))]), out),
              _ALL, shapes=[None], params=dict(shape=out, broadcast_dimensions=dims))


def _fixed(name, prim, shape, ref, dtypes=(F32, I32, BF16), **params):
    shapes = shape if isinstance(shape, list) else [shape]
    return Op(name, prim, lambda r, s, d: [_rand(r, s, d)], ref, dtypes, shapes=shapes, params=params)


def _slice(shape, start, limit, strides):
    return _fixed(f"slice{shape}[{start}:{limit}:{strides}]", P.slice_, shape,
                  lambda x: x[tuple(slice(a, b, c) for a, b, c in zip(start, limit, strides))],
                  start_indices=start, limit_indices=limit, strides=strides)


def _concat(shapes, dim):
    return Op(f"concatenate{shapes}@{dim}", P.concatenate,
              lambda r, s, d: [_rand(r, sh, d) for sh in shapes],
              lambda *xs: np.concatenate(xs, axis=dim), (F32, I32, BOOL, F16), shapes=[None],
              params=dict(dimension=dim))


def _pad_ref(x, pv, padding_config):
    # interior padding by explicit index arithmetic, then edges
    out_shape = [lo + hi + n + max(0, n - 1) * it for (lo, hi, it), n in zip(padding_config, x.shape)]
    out = np.full(out_shape, pv, x.dtype)
    for idx in np.ndindex(*x.shape):
        out[tuple(lo + i * (it + 1) for i, (lo, hi, it) in zip(idx, padding_config))] = x[idx]
    return out


def _pad(shape, cfg):
    return Op(f"pad{shape}{cfg}", P.pad, lambda r, s, d: [_rand(r, shape, d), np.asarray(7, d)],
              lambda x, pv: _pad_ref(x, pv, cfg), (F32, I32, BF16), shapes=[None],
              params=dict(padding_config=cfg))


def _reduce(name, prim, fn, shape, axes, dtypes=(F32, I32, F16, F64), make=_rand):
    return Op(f"{name}{shape}{axes}", prim, lambda r, s, d: [make(r, shape, d)],
              _in_f32(lambda x: fn(x, axis=axes)), dtypes, shapes=[None], params=dict(axes=axes),
              tol={F16: (1e-2, 1e-2)})


def _argred(name, prim, fn, shape, axis, ties=False):
    def make(r, s, d):
        return _rand(r, shape, d, -2, 2) if ties else _rand(r, shape, d)
    return Op(f"{name}{shape}@{axis}{'-ties' if ties else ''}", prim, lambda r, s, d: [make(r, s, d)],
              lambda x: fn(x, axis=axis).astype(np.int32), (F32, I32, BF16), shapes=[None],
              params=dict(axis=axis, index_dtype=np.dtype(np.int32)))


def _dot_ref(lhs, rhs, dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    letters = iter("abcdefghijklmnop")
    la = [next(letters) for _ in range(lhs.ndim)]
    ra = [next(letters) for _ in range(rhs.ndim)]
    for a, b in zip(lc, rc):
        ra[b] = la[a]
    for a, b in zip(lb, rb):
        ra[b] = la[a]
    out = [la[a] for a in lb] + [c for i, c in enumerate(la) if i not in lc and i not in lb] + \
        [c for i, c in enumerate(ra) if i not in rc and i not in rb]
    cd = np.float64 if lhs.dtype == np.float64 else np.float32 if lhs.dtype.kind == "f" or lhs.dtype == BF16 \
        else lhs.dtype
    res = np.einsum(f"{''.join(la)},{''.join(ra)}->{''.join(out)}", lhs.astype(cd), rhs.astype(cd))
    return res.astype(lhs.dtype)


def _dot(ls, rs, dn):
    return Op(f"dot_general{ls}x{rs}{dn}", P.dot_general, lambda r, s, d: [_rand(r, ls, d), _rand(r, rs, d)],
              lambda x, y: _dot_ref(x, y, dn), (F32, F16, BF16, I32, F64), shapes=[None],
              params=dict(dimension_numbers=dn), tol={F16: (1e-2, 2e-2), BF16: (3e-2, 1e-1)})


def _fused_gemm(dtype):
    """x @ w + b, gelu (tanh form), + a residual: the epilogue written out in numpy."""
    def ref(x, w, b, r):
        f = lambda a: a.astype(np.float32)  # noqa: E731
        y = (f(x) @ f(w)).astype(x.dtype).astype(np.float32) + f(b)
        y = 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * (y * y * y)))) + f(r)
        return y.astype(x.dtype)
    return Op(f"fused_gemm(3,4)x(4,5)+b,gelu,+r-{np.dtype(dtype).name}", P.fused_gemm,
              lambda r, s, d: [_rand(r, (3, 4), d), _rand(r, (4, 5), d), _rand(r, (5,), d), _rand(r, (3, 5), d)],
              ref, (dtype,), shapes=[None],
              params=dict(dimension_numbers=(((1,), (0,)), ((), ())), preferred_element_type=None,
                          epilogue=epilogue_fn(lambda y, b, r: tx.nn.gelu(y + b) + r, 3, dtype)),
              tol={BF16: (3e-2, 1e-1)})


def epilogue_fn(f, n_inputs: int, dtype=F32) -> P.ScalarFn:
    """A fused_gemm epilogue: f (of the product and the extras, written with tilefuse.numpy) traced
    over 0-d values of `dtype`."""
    return P.ScalarFn(make_graph(f)(*[np.zeros((), dtype)] * n_inputs))


def _conv_ref(x, w, *, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
              feature_group_count, batch_group_count):
    """By the definition: per output position and kernel tap, the input position in the dilated,
    padded lhs (skipped where it falls on a hole or outside), per group."""
    ls, rs, os_ = dimension_numbers
    d = x.dtype
    cd = np.float64 if d == F64 else np.float32
    x, w = np.transpose(x, ls).astype(cd), np.transpose(w, rs).astype(cd)
    g, b = feature_group_count, batch_group_count
    n, o, i = x.shape[0], w.shape[0], w.shape[1]
    out = []
    for size, k, s, (lo, hi), ld, rd in zip(x.shape[2:], w.shape[2:], window_strides, padding, lhs_dilation,
                                            rhs_dilation):
        span = (size - 1) * ld + 1 + lo + hi if size else lo + hi
        out.append(max(0, (span - (k - 1) * rd - 1) // s + 1))
    y = np.zeros((n // b, o) + tuple(out), cd)
    og, nb = o // (g * b), n // b
    for tap in np.ndindex(*w.shape[2:]):
        idx, ok = [], np.ones(tuple(out), bool)
        for a, (t, s, (lo, _), ld, rd, size) in enumerate(zip(tap, window_strides, padding, lhs_dilation,
                                                              rhs_dilation, x.shape[2:])):
            pos = np.arange(out[a]) * s + t * rd - lo  # in the dilated lhs
            shape = [1] * len(out)
            shape[a] = out[a]
            ok = ok & ((pos >= 0) & (pos % ld == 0) & (pos // ld < size)).reshape(shape)
            idx.append(np.clip(pos // ld, 0, max(size - 1, 0)).reshape(shape))
        for grp in range(g * b):
            rows = slice(grp * og, (grp + 1) * og)
            xs = x[grp * nb:(grp + 1) * nb] if b > 1 else x[:, grp * i:(grp + 1) * i]
            win = xs[(slice(None), slice(None)) + tuple(idx)] * ok
            y[:, rows] += np.einsum("nc...,oc->no...", win, w[(rows, slice(None)) + tap])
    return np.transpose(y, np.argsort(os_)).astype(d)


def _conv(name, xs, ws, **params):
    nd = len(xs) - 2
    full = dict(window_strides=(1,) * nd, padding=((0, 0),) * nd, lhs_dilation=(1,) * nd,
                rhs_dilation=(1,) * nd, dimension_numbers=(tuple(range(len(xs))),) * 3,
                feature_group_count=1, batch_group_count=1)
    full.update(params)
    return Op(f"conv-{name}", P.conv, lambda r, s, d: [_rand(r, xs, d), _rand(r, ws, d)],
              lambda x, w: _conv_ref(x, w, **full), FLOATS, shapes=[None], params=full,
              tol={F32: (1e-5, 3e-5), F16: (1e-2, 5e-2), BF16: (3e-2, 2e-1)})


def _fused_conv(name, xs, ws, dtype, **params):
    """A convolution with its epilogue: max(y + b, 0) + r, b a bias per output feature and r a
    residual of the output's shape, the epilogue written out in numpy after the definition."""
    conv = _conv(name, xs, ws, **params)
    full = conv.params
    os_ = full["dimension_numbers"][2]
    y_shape = _conv_ref(np.zeros(xs, F32), np.zeros(ws, F32), **full).shape
    feats = y_shape[os_[1]]

    def ref(x, w, b, r):
        f = lambda a: a.astype(np.float32)  # noqa: E731
        y = _conv_ref(x, w, **full).astype(np.float32)
        return (np.maximum(y + P.per_feature(f(b), y.shape, os_[1]), 0) + f(r)).astype(x.dtype)
    return Op(f"fused_conv-{name}", P.fused_conv,
              lambda r, s, d: [_rand(r, xs, d), _rand(r, ws, d), _rand(r, (feats,), d), _rand(r, y_shape, d)],
              ref, (dtype,), shapes=[None],
              params=dict(full, epilogue=epilogue_fn(lambda y, b, r: tx.numpy.maximum(y + b, 0) + r, 3, dtype)),
              tol=conv.tol)


def _gather(shape, ishape, axis):
    def args(r, s, d):
        n = shape[axis]
        return [_rand(r, shape, d), r.integers(0, max(n, 1), size=ishape).astype(np.int32)]
    return Op(f"gather{shape}[{ishape}]@{axis}", P.gather, args,
              lambda x, i: np.take(x, i, axis=axis) if x.shape[axis] else
              np.zeros(x.shape[:axis] + i.shape + x.shape[axis + 1:], x.dtype),
              (F32, I32, BF16, BOOL), shapes=[None], params=dict(axis=axis))


def _scatter_ref(x, idx, upd, axis):
    out = x.copy()
    for pos in np.ndindex(*idx.shape):
        for rest in np.ndindex(*(x.shape[:axis] + x.shape[axis + 1:])):
            o = rest[:axis] + (idx[pos],) + rest[axis:]
            u = rest[:axis] + pos + rest[axis:]
            out[o] = out[o] + upd[u]
    return out


def _scatter(shape, ishape, axis):
    def args(r, s, d):
        n = shape[axis]
        idx = r.integers(0, max(n, 1), size=ishape).astype(np.int32)
        return [_rand(r, shape, d), idx, _rand(r, shape[:axis] + ishape + shape[axis + 1:], d)]
    return Op(f"scatter_add{shape}[{ishape}]@{axis}", P.scatter_add, args,
              lambda x, i, u: _scatter_ref(x, i, u, axis), (F32, I32, F64), shapes=[None],
              params=dict(axis=axis))


def _clip_starts(starts, shape, sizes):
    return [min(max(int(st), 0), n - k) for st, n, k in zip(starts, shape, sizes)]


def _dynamic_slice(shape, starts, sizes):
    """Start indices as int32 scalars, some out of range (they clamp so the window fits)."""
    def ref(x, *st):
        st = _clip_starts(st, shape, sizes)
        return x[tuple(slice(a, a + k) for a, k in zip(st, sizes))]
    return Op(f"dynamic_slice{shape}@{starts}:{sizes}", P.dynamic_slice,
              lambda r, s, d: [_rand(r, shape, d), *(np.asarray(st, I32) for st in starts)], ref,
              (F32, I32, BF16, BOOL), shapes=[None], params=dict(slice_sizes=sizes))


def _dynamic_update_slice(shape, ushape, starts):
    def ref(x, u, *st):
        out = x.copy()
        st = _clip_starts(st, shape, ushape)
        out[tuple(slice(a, a + k) for a, k in zip(st, ushape))] = u
        return out
    return Op(f"dynamic_update_slice{shape}<-{ushape}@{starts}", P.dynamic_update_slice,
              lambda r, s, d: [_rand(r, shape, d), _rand(r, ushape, d), *(np.asarray(st, I32) for st in starts)],
              ref, (F32, I32, F16), shapes=[None])


OPS = [
    unary("neg", P.neg, np.negative, dtypes=FLOATS + INTS),
    unary("exp", P.exp, np.exp),
    unary("log", P.log, np.log, make=_positive),
    unary("log1p", P.log1p, np.log1p, make=_positive),
    unary("expm1", P.expm1, np.expm1),
    unary("tanh", P.tanh, np.tanh),
    unary("logistic", P.logistic, lambda x: 1 / (1 + np.exp(-x))),
    unary("sqrt", P.sqrt, np.sqrt, make=_positive),
    unary("rsqrt", P.rsqrt, lambda x: 1 / np.sqrt(x), make=_positive),
    unary("sin", P.sin, np.sin),
    unary("cos", P.cos, np.cos),
    unary("erf", P.erf, _erf),
    unary("abs", P.abs_, np.abs, dtypes=FLOATS + INTS),
    unary("sign", P.sign, np.sign, dtypes=FLOATS + INTS),
    unary("floor", P.floor, np.floor),
    unary("ceil", P.ceil, np.ceil),
    unary("round", P.round_, np.round, make=lambda r, s, d: (r.integers(-8, 8, size=s) / 2).astype(d)),
    Op("is_finite", P.is_finite,
       lambda r, s, d: [np.where(r.random(s) < 0.3, np.inf, np.where(r.random(s) < 0.3, np.nan,
                                                                     _rand(r, s, np.float32))).astype(d)],
       np.isfinite, FLOATS),
    Op("not", P.not_, lambda r, s, d: [_rand(r, s, d)], lambda x: ~x, (BOOL, I32, I64)),
    binary("add", P.add, np.add, dtypes=_ALL[:-1]),
    Op("add_bool", P.add, lambda r, s, d: [_rand(r, s, d), _rand(r, s, d)], np.logical_or, (BOOL,),
       shapes=BINARY_SHAPES),
    binary("sub", P.sub, np.subtract),
    binary("mul", P.mul, np.multiply),
    binary("div", P.div, _c_div, make=lambda r, s, d: _nonzero_ints(r, s, d) if d in INTS else
           _positive(r, s, d)),
    binary("rem", P.rem, _c_rem, make=lambda r, s, d: _nonzero_ints(r, s, d) if d in INTS else
           _rand(r, s, d, 0.5, 5.0)),
    binary("pow", P.pow_, np.power, make=_positive, dtypes=FLOATS),
    binary("max", P.max_, np.maximum, dtypes=_ALL),
    binary("min", P.min_, np.minimum, dtypes=_ALL),
    binary("and", P.and_, np.bitwise_and, dtypes=(BOOL, I32, I64)),
    binary("or", P.or_, np.bitwise_or, dtypes=(BOOL, I32, I64)),
    binary("xor", P.xor, np.bitwise_xor, dtypes=(BOOL, I32, I64)),
    Op("shift_left", P.shift_left, _shift_args, lambda x, s: np.left_shift(x, s), INTS, shapes=BINARY_SHAPES),
    Op("shift_right_logical", P.shift_right_logical, _shift_args, _srl, INTS, shapes=BINARY_SHAPES),
    *[binary(n, p, f, dtypes=_ALL, out_dtype=np.bool_,
             make=lambda r, s, d: _rand(r, s, d, -2, 2))  # small ranges make ties
      for n, p, f in [("eq", P.eq, np.equal), ("ne", P.ne, np.not_equal), ("lt", P.lt, np.less),
                      ("le", P.le, np.less_equal), ("gt", P.gt, np.greater),
                      ("ge", P.ge, np.greater_equal)]],
    *[_ipow(y) for y in (0, 1, 2, 3, -1, -2)],
    Op("select", P.select, _select_args, np.where, _ALL, shapes=BINARY_SHAPES),
    *[_convert(t) for t in (F32, F16, BF16, I32, I64, BOOL, F64)],
    Op("stop_gradient", P.stop_gradient, lambda r, s, d: [_rand(r, s, d)], lambda x: x, (F32, I32)),
    *[Op(f"iota{shape}@{dim}:{np.dtype(d).name}", P.iota, lambda r, s, d: [],
         lambda shape=shape, dim=dim, d=d: np.broadcast_to(
             np.arange(shape[dim]).reshape([-1 if i == dim else 1 for i in range(len(shape))]),
             shape).astype(d), (d,), shapes=[None], params=dict(dtype=np.dtype(d), shape=shape, dimension=dim))
      for shape, dim in [((5,), 0), ((2, 3), 1), ((3, 0), 0), ((1,), 0)] for d in (I32, F32)],
    _bcast((), (2, 3), ()),
    _bcast((3,), (2, 3), (1,)),
    _bcast((2,), (2, 3), (0,)),
    _bcast((1, 3), (4, 2, 3), (1, 2)),
    _bcast((2, 1), (2, 0), (0, 1)),
    _bcast((0,), (3, 0), (1,)),
    *[_fixed(f"reshape{s}->{n}", P.reshape, s, lambda x, n=n: x.reshape(n), new_sizes=n)
      for s, n in [((2, 3), (3, 2)), ((), (1, 1)), ((1,), ()), ((0, 3), (3, 0, 2)), ((2, 3, 4), (24,))]],
    *[_fixed(f"transpose{s}{p}", P.transpose, s, lambda x, p=p: np.transpose(x, p), permutation=p)
      for s, p in [((2, 3), (1, 0)), ((2, 3, 4), (2, 0, 1)), ((), ()), ((0, 3), (1, 0))]],
    *[_fixed(f"rev{s}{dims}", P.rev, s, lambda x, dims=dims: np.flip(x, dims) if dims else x, dimensions=dims)
      for s, dims in [((5,), (0,)), ((2, 3), (1,)), ((2, 3), (0, 1)), ((), ()), ((0,), (0,))]],
    _slice((7,), (1,), (6,), (2,)),
    _slice((7,), (0,), (7,), (3,)),
    _slice((4, 5), (1, 0), (3, 5), (1, 2)),
    _slice((4, 5), (2, 2), (2, 4), (1, 1)),
    _slice((1,), (0,), (1,), (1,)),
    _slice((0, 3), (0, 1), (0, 3), (1, 1)),
    _slice((), (), (), ()),
    _concat([(2, 3), (1, 3), (4, 3)], 0),
    _concat([(2, 3), (2, 1)], 1),
    _concat([(0, 3), (2, 3)], 0),
    _concat([(1,)], 0),
    _pad((3,), ((1, 2, 0),)),
    _pad((3, 2), ((0, 0, 1), (2, 1, 2))),
    _pad((0,), ((1, 1, 0),)),
    _pad((), ()),
    *[_reduce("reduce_sum", P.reduce_sum, np.sum, s, a) for s, a in
      [((2, 3), (1,)), ((2, 3), (0, 1)), ((2, 3, 4), (0, 2)), ((), ()), ((0, 3), (0,)), ((3,), ())]],
    _reduce("reduce_sum", P.reduce_sum, np.sum, (3, 4), (0,), dtypes=(BOOL,)),
    *[_reduce(n, p, f, s, a, dtypes=(F32, I32, F16, BF16, BOOL)) for n, p, f in
      [("reduce_max", P.reduce_max, np.max), ("reduce_min", P.reduce_min, np.min)]
      for s, a in [((2, 3), (1,)), ((2, 3, 4), (0, 2)), ((1,), (0,)), ((0, 3), (1,))]],
    *[_reduce("reduce_prod", P.reduce_prod, np.prod, s, a, make=lambda r, s, d: _rand(r, s, d, 1, 2))
      for s, a in [((2, 3), (1,)), ((2, 3), (0, 1)), ((0,), (0,))]],
    *[_argred(n, p, f, s, a, ties) for n, p, f in [("argmax", P.argmax, np.argmax), ("argmin", P.argmin, np.argmin)]
      for s, a, ties in [((5,), 0, False), ((3, 4), 1, False), ((3, 4), 0, True), ((4, 1), 1, False),
                         ((0, 3), 1, False)]],
    _dot((3, 4), (4, 5), (((1,), (0,)), ((), ()))),
    _dot((4,), (4,), (((0,), (0,)), ((), ()))),
    _dot((4, 3), (4, 5), (((0,), (0,)), ((), ()))),
    _dot((2, 3, 4), (2, 4, 5), (((2,), (1,)), ((0,), (0,)))),
    _dot((3, 2, 4), (2, 5, 4), (((2,), (2,)), ((1,), (0,)))),
    _dot((3, 0), (0, 2), (((1,), (0,)), ((), ()))),
    _dot((1, 1), (1, 1), (((1,), (0,)), ((), ()))),
    _dot((3,), (2,), (((), ()), ((), ()))),
    _dot((2, 3, 4), (3, 4, 5), (((1, 2), (0, 1)), ((), ()))),
    _fused_gemm(F32),
    _fused_gemm(BF16),
    _conv("nchw-s2-g2-dil", (2, 4, 9, 8), (6, 2, 3, 2), window_strides=(2, 1), padding=((1, 0), (2, 1)),
          rhs_dilation=(1, 2), feature_group_count=2),
    _conv("nhwc-hwio-same", (2, 7, 6, 3), (3, 3, 3, 5), padding=((1, 1), (1, 1)),
          dimension_numbers=((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))),
    _conv("1d-lhs-dilated-crop", (2, 3, 9), (4, 3, 3), padding=((2, -1),), lhs_dilation=(2,)),
    _conv("batch-groups", (4, 3, 6, 5), (6, 3, 2, 2), window_strides=(1, 2), batch_group_count=2),
    _conv("empty-out", (1, 2, 2, 2), (3, 2, 3, 3)),
    _fused_conv("nchw-s2-g2", (2, 4, 9, 8), (6, 2, 3, 3), F32, window_strides=(2, 1), padding=((1, 1), (0, 2)),
                feature_group_count=2),
    _fused_conv("nhwc-hwio", (2, 7, 6, 3), (3, 3, 3, 5), BF16, padding=((1, 1), (1, 1)),
                dimension_numbers=((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))),
    _gather((5, 3), (4,), 0),
    _gather((5, 3), (2, 2), 1),
    _gather((5,), (), 0),
    _gather((5, 3), (0,), 0),
    _gather((0, 3), (2,), 0),
    _scatter((5, 3), (4,), 0),
    _scatter((2, 4), (3, 2), 1),
    _scatter((5,), (0,), 0),
    _dynamic_slice((5, 3), (1, 2), (3, 1)),
    _dynamic_slice((5, 3), (4, -1), (2, 3)),
    _dynamic_slice((4,), (2,), (0,)),
    _dynamic_update_slice((5, 3), (2, 3), (1, 0)),
    _dynamic_update_slice((5, 3), (2, 2), (9, -3)),
]


# ---- sorting and LAPACK (numpy_host primitives): numpy's own routines are the reference ----------

def _spd(r, shape, d):
    a = r.normal(size=shape)
    return (a @ np.swapaxes(a, -1, -2) + shape[-1] * np.eye(shape[-1])).astype(d)


def _packed(*parts):
    batch = parts[0].shape[:-2] if parts[0].ndim >= 2 else ()
    return np.concatenate([np.asarray(p).reshape(batch + (-1,)) for p in parts], axis=-1)


def _host(name, prim, args, ref, dtypes=(F32, F64), **params):
    return Op(name, prim, args, ref, dtypes, shapes=[None], params=params, tol={F32: (2e-5, 2e-5)})


def _tri(a, lower, unit):
    t = np.tril(a) if lower else np.triu(a)
    return t - np.diag(np.diag(t)) + np.eye(len(a)) if unit else t


OPS += [
    Op("argsort(3,5)@1", P.argsort, lambda r, s, d: [_rand(r, (3, 5), d, -2, 2)],
       lambda x: np.argsort(x, axis=1, kind="stable").astype(np.int32), (F32, I32, F16), shapes=[None],
       params=dict(axis=1, descending=False)),
    Op("argsort(4,)-two-keys", P.argsort, lambda r, s, d: [_rand(r, (6,), d, 0, 1), _rand(r, (6,), d, -2, 2)],
       lambda a, b: np.lexsort((b, a)).astype(np.int32), (I32,), shapes=[None], params=dict(axis=0, descending=False)),
    _host("cholesky(2,3,3)", P.cholesky, lambda r, s, d: [_spd(r, (2, 3, 3), d)], np.linalg.cholesky),
    _host("solve(3,3)(3,2)", P.solve, lambda r, s, d: [_spd(r, (3, 3), d), _rand(r, (3, 2), d)], np.linalg.solve),
    _host("triangular_solve-lower", P.triangular_solve, lambda r, s, d: [_spd(r, (3, 3), d), _rand(r, (3, 2), d)],
          lambda a, b: np.linalg.solve(np.tril(a), b), lower=True, transpose_a=False, unit_diagonal=False),
    _host("triangular_solve-upper-T-unit", P.triangular_solve, lambda r, s, d: [_rand(r, (3, 3), d), _rand(r, (3, 2), d)],
          lambda a, b: np.linalg.solve(_tri(a, False, True).T, b), lower=False, transpose_a=True, unit_diagonal=True),
    _host("slogdet(2,3,3)", P.slogdet, lambda r, s, d: [_rand(r, (2, 3, 3), d)],
          lambda a: np.stack(np.linalg.slogdet(a), axis=-1)),
    _host("qr(4,3)", P.qr, lambda r, s, d: [_rand(r, (4, 3), d)], lambda a: _packed(*np.linalg.qr(a)),
          full_matrices=False),
    _host("qr(2,3)-complete", P.qr, lambda r, s, d: [_rand(r, (2, 3), d)],
          lambda a: _packed(*np.linalg.qr(a, "complete")), full_matrices=True),
    _host("eigh(3,3)", P.eigh, lambda r, s, d: [_spd(r, (3, 3), d)],
          lambda a: np.concatenate([np.linalg.eigh(a)[0], np.linalg.eigh(a)[1].ravel()])),
    _host("svd(4,3)", P.svd, lambda r, s, d: [_rand(r, (4, 3), d)],
          lambda a: _packed(*np.linalg.svd(a, full_matrices=False)), full_matrices=False, compute_uv=True),
    _host("svd(2,4)-values", P.svd, lambda r, s, d: [_rand(r, (2, 4), d)],
          lambda a: np.linalg.svd(a, compute_uv=False), full_matrices=False, compute_uv=False),
]
OPS_BY_NAME = {str(op): op for op in OPS}
assert len(OPS_BY_NAME) == len(OPS), "op record names must be unique"
NO_VALUE_RECORD = {"debug_print", "tile_op"}  # an effect (tests/test_debug.py); a call (tests/test_tile_op.py)
NO_VALUE_RECORD |= {"custom_vjp_call", "custom_jvp_call"}  # calls: tests/autodiff/test_custom.py
# made by nn.dot_product_attention and the attention pattern pass: tests/test_attention.py
NO_VALUE_RECORD |= {"fused_attention", "fused_attention_stats", "fused_attention_bwd"}
NO_VALUE_RECORD |= {"cond", "while", "scan"}  # control flow, its bodies graphs: tests/test_lax.py


def comparisons(op: Op, dtype, device):
    """The record's results on `device` (eager and jitted, every shape) against its reference;
    a shape rule that disagrees with the reference raises AssertionError."""
    rng = np.random.default_rng(zlib.crc32(str(op).encode()))
    inputs = [op.args(rng, shape, dtype) for shape in op.shapes]
    params = dict(op.params)

    def run(*a):
        return bind(op.prim, *a, **params)[0]
    try:  # every shape's kernels in one build (eager calls compile the same graphs)
        precompile([tx.jit(run, device=device).lower(*xs).graph for xs in inputs], device)
    except Exception:  # noqa: BLE001 - the comparisons below meet the same error and report it
        pass
    for shape, xs in zip(op.shapes, inputs):
        params = dict(op.params)
        want = op.ref(*xs)
        avals = [ShapedArray(x.shape, np.dtype(x.dtype)) for x in xs]
        (out_aval,) = op.prim.abstract_eval(*avals, **params)
        assert out_aval.shape == np.shape(want), f"{op} {shape}: rule gives {out_aval}"
        out_dtype = out_aval.dtype
        rtol, atol = tolerance_for(op.tol, dtype)
        want = np.asarray(want, out_dtype)

        eager = bind(op.prim, *[tx.device_put(x, device) for x in xs], **params)[0]
        assert isinstance(eager, tx.Array) and eager.device is device, (op, shape, "eager result device")
        assert eager.shape == out_aval.shape and eager.dtype == out_dtype, (op, shape, eager.aval)
        yield Comparison(f"{op} {shape} eager", eager, want, out_dtype, rtol, atol)

        jitted = tx.jit(run, device=device)(*xs)
        assert jitted.shape == out_aval.shape and jitted.dtype == out_dtype, (op, shape, jitted.aval)
        yield Comparison(f"{op} {shape} jit", jitted, want, out_dtype, rtol, atol)
