"""tilefuse.numpy against numpy: every function, with broadcasting and edge shapes (0-d, size 1,
size 0), non-contiguous and negative-stride numpy inputs, eagerly and under jit, on every device.

The table `FNS` lists each function once; `test_every_tnp_function_is_tested` fails when a public
function of tilefuse.numpy has no row here (or in the explicit list of functions tested below)."""
from __future__ import annotations

import math
import re
import warnings
import zlib
from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from conftest import assert_close

F32, F64, F16, BF16 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
I32, I64, BOOL = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.bool_)
U64 = np.dtype(np.uint64)  # _rand's small negatives wrap to near 2**64: unsigned compares and divides
LOW = (F16, BF16)


def _rand(rng, shape, dtype, lo=-3.0, hi=3.0):
    d = np.dtype(dtype)
    if d == BOOL:
        return rng.random(shape) < 0.5
    if d.kind in "iu":
        return rng.integers(int(lo), int(hi) + 1, size=shape).astype(d)
    return rng.uniform(lo, hi, size=shape).astype(d)


def _pos(rng, shape, dtype):
    return _rand(rng, shape, dtype, 0.25, 4.0) if np.dtype(dtype).kind == "f" or dtype == BF16 else \
        _rand(rng, shape, dtype, 1, 5)


def _nonzero(rng, shape, dtype):
    x = _rand(rng, shape, dtype, -5, 5)
    return np.where(np.abs(x.astype(np.float64)) < 0.5, 2, x).astype(dtype)


def _special(rng, shape, dtype):
    x = _rand(rng, shape, F32)
    x = np.where(rng.random(shape) < 0.25, np.inf, x)
    x = np.where(rng.random(shape) < 0.25, -np.inf, x)
    x = np.where(rng.random(shape) < 0.25, np.nan, x)
    with np.errstate(invalid="ignore"):
        return x.astype(dtype)


def _small_ints(rng, shape, dtype):
    return _rand(rng, shape, dtype, -2, 2)  # many ties


@dataclass
class Fn:
    """A row: `fn(m, *xs)` with m numpy or tilefuse.numpy, the argument shapes to try, dtypes."""
    name: str
    fn: Callable
    shapes: list
    dtypes: tuple = (F32,)
    make: Callable | tuple = _rand  # one maker, or one per argument
    tol: tuple = (None, None)
    ref: Callable | None = None  # numpy reference when numpy has no such function
    methods: bool = False  # uses array methods/operators: eager numpy inputs would run numpy itself
    keep_low: bool = True  # a float32 numpy result means the 16-bit input dtype (False: explicit casts)

    def __str__(self):
        return self.name


U = [((),), ((1,),), ((0,),), ((3, 4),), ((2, 0, 3),)]  # unary shapes
B = [((), ()), ((3,), ()), ((), (3,)), ((2, 3), (3,)), ((2, 1), (1, 3)), ((1,), (0,)), ((0, 3), (1, 3)),
     ((2, 1, 4), (3, 1))]  # binary shapes, broadcasting
R = [((),), ((0,),), ((5,),), ((2, 3, 4),), ((2, 0, 3),)]  # reduction operands
FL = (F32, F64, F16, BF16)
NUM = (F32, I32)


def un(name, dtypes=(F32, F64, F16, BF16), make=_rand, **kw):
    return Fn(name, lambda m, x: getattr(m, name)(x), U, dtypes, make, **kw)


def bi(name, dtypes=(F32, I32), make=_rand, **kw):
    return Fn(name, lambda m, x, y: getattr(m, name)(x, y), B, dtypes, make, **kw)


_erf = np.vectorize(math.erf, otypes=[np.float64])

FNS = [
    # ---- elementwise, unary
    un("exp", FL + (I32,)), un("log", FL, _pos), un("log1p", FL, _pos), un("expm1"), un("tanh", FL + (I32,)),
    un("sqrt", FL + (I32,), _pos), un("sin"), un("cos"), un("floor"), un("ceil"),
    un("round", make=lambda r, s, d: (r.integers(-8, 8, size=s) / 2).astype(d)),
    Fn("round_decimals", lambda m, x: (m.round(x, 1), m.around(x, 2), m.round(x, -1)), U, (F32, F64),
       tol=(1e-6, 1e-6)),
    un("rint", make=lambda r, s, d: (r.integers(-8, 8, size=s) / 2).astype(d)),
    un("negative", FL + (I32, I64)), un("abs", FL + (I32,)), un("absolute", (F32, I32)),
    un("sign", FL + (I32,)), un("positive", (F32, I32)), un("square", FL + (I32,)),
    un("isfinite", FL, _special), un("isinf", (F32, F16, I32), _special), un("isnan", (F32, BF16, I32), _special),
    un("reciprocal", (F32, F64), _nonzero), un("logical_not", (BOOL, F32, I32)),
    un("invert", (BOOL, I32)), un("bitwise_not", (BOOL, I32)),
    Fn("erf", lambda m, x: m.erf(x), U, FL, ref=lambda x: _erf(x)),
    Fn("rsqrt", lambda m, x: m.rsqrt(x), U, FL, _pos, ref=lambda x: 1 / np.sqrt(x)),
    Fn("sigmoid", lambda m, x: m.sigmoid(x), U, FL, ref=lambda x: 1 / (1 + np.exp(-x))),
    Fn("integer_pow", lambda m, x: m.integer_pow(x, 3), U, FL + (I32,), ref=lambda x: x ** 3),
    Fn("stop_gradient", lambda m, x: m.stop_gradient(x), U, NUM, ref=lambda x: x),
    un("tan", (F32, F64), lambda r, s, d: _rand(r, s, d, -1.2, 1.2)), un("sinh", (F32, F64)), un("cosh", (F32, F64)),
    un("log2", (F32, F64), _pos), un("log10", (F32, F64), _pos), un("exp2", (F32, F64)),
    un("cbrt", (F32, F64)),
    Fn("nan_to_num", lambda m, x: m.nan_to_num(x), U, (F32, F64), _special),
    Fn("nan_to_num_args", lambda m, x: m.nan_to_num(x, nan=1.5, posinf=9.0, neginf=-9.0), U, (F32,), _special),
    # ---- elementwise, binary, broadcasting
    bi("add", (F32, I32, F64, BF16, BOOL)), bi("subtract", (F32, I32, F16)), bi("multiply", (F32, I32, BOOL, BF16)),
    bi("divide", (F32, I32, F64), _nonzero), bi("true_divide", (F32,), _nonzero),
    bi("floor_divide", (F32, I32, U64), _nonzero), bi("remainder", (F32, I32, U64), _nonzero),
    bi("mod", (F32, I32), _nonzero), bi("fmod", (F32, I32), _nonzero),
    bi("power", (F32, F64), _pos), Fn("power_int", lambda m, x, y: m.power(x, y), B, (I32,),
                                      (_rand, lambda r, s, d: _rand(r, s, d, 0, 3))),
    bi("maximum", (F32, I32, BOOL, BF16, U64)), bi("minimum", (F32, I32, BOOL, U64)),
    *[bi(n, (F32, I32, BOOL, U64), _small_ints) for n in
      ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")],
    *[bi(n, (BOOL, F32, I32), _small_ints) for n in ("logical_and", "logical_or", "logical_xor")],
    *[bi(n, (BOOL, I32, I64)) for n in ("bitwise_and", "bitwise_or", "bitwise_xor")],
    bi("logaddexp", (F32, F64)), bi("hypot", (F32,)),
    Fn("isclose", lambda m, x, y: m.isclose(x, y, atol=0.5), B, (F32,)),
    Fn("where", lambda m, c, x, y: m.where(c, x, y), [((), (), ()), ((3,), (), (3,)), ((2, 1), (1, 3), ()),
                                                      ((0,), (1,), ()), ((2, 3), (2, 3), (2, 3))],
       (F32, I32, BOOL), (lambda r, s, d: r.random(s) < 0.5, _rand, _rand)),
    Fn("clip", lambda m, x, lo, hi: m.clip(x, lo, hi), [((3, 4), (), ()), ((3, 4), (4,), (3, 1)), ((0,), (), ()),
                                                        ((), (), ())], (F32, I32),
       (_rand, lambda r, s, d: _rand(r, s, d, -2, -1), lambda r, s, d: _rand(r, s, d, 1, 2))),
    Fn("clip_one_sided", lambda m, x: (m.clip(x, None, 1), m.clip(x, -1, None)), U, (F32, I32)),
    # ---- reductions
    *[Fn(f"{n}_axis{a}{'_keep' if k else ''}", lambda m, x, n=n, a=a, k=k: getattr(m, n)(x, axis=a, keepdims=k),
         [((2, 3, 4),), ((1, 3, 1),), ((2, 0, 3),)] if a is not None else R, dt, make, tol=(2e-5, 1e-5))
      for n, dt, make in [("sum", (F32, I32, BOOL, F16, BF16, F64), _rand), ("prod", (F32, I32), _small_ints),
                          ("mean", (F32, I32, BF16), _rand), ("all", (BOOL, F32), _small_ints),
                          ("any", (BOOL, I32), _small_ints)]
      for a, k in [(None, False), (0, False), (-1, True), ((0, 2), False), ((0, 2), True)]],
    *[Fn(f"{n}_axis{a}{'_keep' if k else ''}", lambda m, x, n=n, a=a, k=k: getattr(m, n)(x, axis=a, keepdims=k),
         [((2, 3, 4),), ((1, 3, 1),)] if a is not None else [((),), ((5,),), ((2, 3, 4),)], dt, _small_ints)
      for n, dt in [("max", (F32, I32, BOOL, BF16)), ("min", (F32, I32)), ("amax", (F32,)), ("amin", (F32,))]
      for a, k in [(None, False), (0, False), (-1, True), ((0, 2), False)]],
    *[Fn(f"{n}_axis{a}{'_keep' if k else ''}", lambda m, x, n=n, a=a, k=k: getattr(m, n)(x, axis=a, keepdims=k),
         [((2, 3, 4),), ((1, 3, 1),)] if a is not None else [((),), ((5,),), ((2, 3, 4),)], (F32, I32, BF16),
         _small_ints)
      for n in ("argmax", "argmin") for a, k in [(None, False), (0, False), (-1, True), (1, False)]],
    *[Fn(f"{n}_axis{a}_ddof{dd}", lambda m, x, n=n, a=a, dd=dd: getattr(m, n)(x, axis=a, ddof=dd),
         [((2, 3, 4),), ((3, 2, 1),)] if a is not None else [((5,),), ((2, 3, 4),)], (F32, I32), tol=(1e-4, 1e-5))
      for n in ("var", "std") for a, dd in [(None, 0), (1, 0), ((0, 2), 1), (-1, 0)]],
    Fn("var_keepdims", lambda m, x: m.var(x, axis=1, keepdims=True), [((2, 3, 4),)], tol=(1e-4, 1e-5)),
    Fn("cumsum", lambda m, x: (m.cumsum(x), m.cumsum(x, axis=0) if x.ndim else m.cumsum(x),
                               m.cumsum(x, axis=-1) if x.ndim else m.cumsum(x)),
       [((),), ((1,),), ((0,),), ((5,),), ((3, 4),)], (F32, I32)),
    Fn("cumprod", lambda m, x: (m.cumprod(x), m.cumprod(x, axis=-1) if x.ndim else m.cumprod(x)),
       [((1,),), ((0,),), ((5,),), ((3, 4),)], (F32, I32), _small_ints),
    Fn("count_nonzero", lambda m, x: (m.count_nonzero(x), m.count_nonzero(x, axis=0) if x.ndim else m.count_nonzero(x)),
       R, (F32, I32, BOOL), _small_ints),
    Fn("average", lambda m, x: m.average(x, axis=-1) if x.ndim else m.average(x), R[:3] + R[3:4], (F32,)),
    Fn("norm", lambda m, x: (m.linalg.norm(x), m.linalg.norm(x, axis=-1) if x.ndim else m.linalg.norm(x)),
       [((),), ((5,),), ((3, 4),)], (F32,), tol=(1e-5, 1e-5)),
    Fn("ptp", lambda m, x: m.ptp(x, axis=-1), [((3, 4),), ((1, 2),)], (F32, I32)),
    # ---- contraction
    Fn("matmul", lambda m, a, b: m.matmul(a, b),
       [((3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)),
        ((1, 3, 4), (2, 4, 5)), ((2, 1, 3, 4), (3, 4, 2)), ((2, 3, 4), (4,)), ((4,), (2, 4, 3)), ((0, 4), (4, 3)),
        ((3, 0), (0, 2)), ((1, 1), (1, 1))], (F32, I32, F64, BF16), tol=(2e-5, 1e-5)),
    Fn("dot", lambda m, a, b: m.dot(a, b), [((3, 4), (4, 5)), ((4,), (4,)), ((), (3,)), ((2, 3, 4), (4,)),
                                            ((2, 3, 4), (5, 4, 2)), ((3,), (3, 2))], (F32, I32)),
    Fn("vdot", lambda m, a, b: m.vdot(a, b), [((3, 4), (4, 3)), ((5,), (5,))]),
    Fn("inner", lambda m, a, b: m.inner(a, b), [((3, 4), (2, 4)), ((4,), (4,)), ((2, 3, 4), (4,))]),
    Fn("outer", lambda m, a, b: m.outer(a, b), [((3,), (4,)), ((2, 2), (3,)), ((0,), (2,)), ((), (2,))]),
    Fn("tensordot", lambda m, a, b: (m.tensordot(a, b, axes=1), m.tensordot(a, b, axes=0)),
       [((3, 4), (4, 5)), ((2, 3, 4), (4, 2))]),
    Fn("tensordot_axes", lambda m, a, b: (m.tensordot(a, b, axes=([1, 2], [0, 1])),
                                          m.tensordot(a, b, axes=([-1], [1]))), [((2, 3, 4), (3, 4, 5))]),
    *[Fn(f"einsum_{s}", lambda m, *xs, s=s: m.einsum(s, *xs), [shapes], (F32, I32), tol=(1e-5, 1e-5))
      for s, shapes in [("ij,jk->ik", ((3, 4), (4, 5))), ("ij,jk", ((3, 4), (4, 5))), ("bij,bjk->bik", ((2, 3, 4), (2, 4, 5))),
                        ("bhqd,bhkd->bhqk", ((2, 2, 3, 4), (2, 2, 5, 4))), ("ij->ji", ((3, 4),)), ("ij->", ((3, 4),)),
                        ("i,i->", ((5,), (5,))), ("i,j->ij", ((3,), (4,))), ("ij,ij->i", ((3, 4), (3, 4))),
                        ("ij,jk,kl->il", ((2, 3), (3, 4), (4, 5))), ("bqd,d->bq", ((2, 3, 4), (4,))),
                        ("ij", ((3, 4),)), ("ji", ((3, 4),)), ("...ij,...jk->...ik", ((2, 3, 4), (2, 4, 5))),
                        ("ii->i", ((3, 3),)), ("ii", ((3, 3),)), ("ij,j->i", ((0, 3), (3,))),
                        ("bij,bij->b", ((2, 3, 4), (2, 3, 4)))]],
    # ---- shapes and layout
    Fn("reshape", lambda m, x: (m.reshape(x, (4, 3)), m.reshape(x, -1), m.reshape(x, (2, -1)), x.reshape(6, 2),
                                x.reshape((3, 2, 2))), [((3, 4),), ((12,),), ((2, 2, 3),)], (F32, I32, BOOL)),
    Fn("reshape_edge", lambda m, x: (m.reshape(x, ()), m.reshape(x, (1, 1)), m.reshape(x, -1)), [((),), ((1,),)]),
    Fn("reshape_zero", lambda m, x: (m.reshape(x, (3, 0)), m.reshape(x, (0, 5))), [((0, 3),)]),
    Fn("ravel", lambda m, x: (m.ravel(x), x.ravel(), x.flatten()), U, (F32, I32)),
    Fn("transpose", lambda m, x: (m.transpose(x), x.T, m.transpose(x, tuple(range(x.ndim))[::-1]),
                                  m.permute_dims(x, tuple(range(x.ndim))[::-1])), U + [((2, 3, 4, 5),)],
       (F32, I32, BOOL)),
    Fn("transpose_axes", lambda m, x: (m.transpose(x, (1, 2, 0)), m.transpose(x, (-1, 0, 1)), x.transpose(2, 0, 1),
                                       x.transpose((0, 2, 1))), [((2, 3, 4),), ((1, 0, 2),)]),
    Fn("swapaxes", lambda m, x: (m.swapaxes(x, 0, 2), m.swapaxes(x, -1, 1), x.swapaxes(0, 1)), [((2, 3, 4),)]),
    Fn("moveaxis", lambda m, x: (m.moveaxis(x, 0, -1), m.moveaxis(x, -1, 0), m.moveaxis(x, (0, 1), (2, 0))),
       [((2, 3, 4),), ((1, 0, 2),)]),
    Fn("expand_dims", lambda m, x: (m.expand_dims(x, 0), m.expand_dims(x, -1), m.expand_dims(x, (0, -1)),
                                    m.expand_dims(x, (0, 2)) if x.ndim else x), [((),), ((3,),), ((2, 3),)]),
    Fn("squeeze", lambda m, x: (m.squeeze(x), m.squeeze(x, 0), m.squeeze(x, (0, -1)), x.squeeze()),
       [((1, 3, 1),), ((1, 1, 1),), ((1, 0, 1),)]),
    Fn("atleast", lambda m, x: (m.atleast_1d(x), m.atleast_2d(x), m.atleast_3d(x)), U[:4]),
    Fn("broadcast_to", lambda m, x: (m.broadcast_to(x, (2, 3, 4)),), [((),), ((4,),), ((3, 1),), ((2, 3, 4),)]),
    Fn("broadcast_to_zero", lambda m, x: (m.broadcast_to(x, (0, 3)),), [((),), ((3,),), ((1, 3),)]),
    Fn("broadcast_arrays", lambda m, x, y: tuple(m.broadcast_arrays(x, y)), B),
    Fn("concatenate", lambda m, a, b: (m.concatenate([a, b]), m.concatenate((a, b), axis=-1),
                                       m.concatenate([a, b], axis=None)),
       [((2, 3), (2, 3)), ((1, 1), (1, 1)), ((0, 2), (0, 2)), ((3,), (3,))], (F32, I32, BOOL)),
    Fn("concatenate_mixed", lambda m, a, b: (m.concatenate([a, b], axis=1),), [((2, 0), (2, 3)), ((2, 1), (2, 4))]),
    Fn("stack", lambda m, a, b: (m.stack([a, b]), m.stack((a, b), axis=-1), m.stack([a, b], axis=1) if a.ndim else
                                 m.stack([a, b])), [((), ()), ((3,), (3,)), ((2, 3), (2, 3)), ((0,), (0,))],
       (F32, I32)),
    Fn("hstack_vstack", lambda m, a, b: (m.hstack([a, b]), m.vstack([a, b])), [((3,), (3,)), ((2, 3), (2, 3)),
                                                                               ((), ())]),
    Fn("split", lambda m, x: tuple(m.split(x, 3)) + tuple(m.split(x, [1, 4], axis=-1)) + tuple(m.split(x, [2, 2])),
       [((6, 6),), ((3, 5),)]),
    Fn("array_split", lambda m, x: tuple(m.array_split(x, 4, axis=1)), [((2, 7),), ((2, 3),)]),
    Fn("flip", lambda m, x: (m.flip(x), m.flip(x, 0), m.flip(x, (0, -1))), [((3, 4),), ((1, 0),), ((2, 3, 2),)]),
    Fn("flip_0d", lambda m, x: (m.flip(x),), [((),)]),
    Fn("roll", lambda m, x: (m.roll(x, 1), m.roll(x, -2, axis=0), m.roll(x, (1, 2), axis=(0, 1)),
                             m.roll(x, 7, axis=-1)), [((3, 4),), ((1, 5),)]),
    Fn("pad", lambda m, x: (m.pad(x, 1), m.pad(x, ((0, 1), (2, 0))), m.pad(x, (1, 2), constant_values=5)),
       [((2, 3),), ((0, 2),), ((1, 1),)], (F32, I32)),
    Fn("tile", lambda m, x: (m.tile(x, 2), m.tile(x, (2, 1)), m.tile(x, (1, 2, 3))), [((),), ((3,),), ((2, 3),)]),
    Fn("repeat", lambda m, x: (m.repeat(x, 2), m.repeat(x, 3, axis=0), x.repeat(2, axis=-1)),
       [((3,),), ((2, 3),), ((0, 2),)]),
    Fn("take", lambda m, x: (m.take(x, np.array([0, 2, -1])), m.take(x, np.array([[1, 0], [0, 1]]), axis=0),
                             m.take(x, np.array([1, -2]), axis=-1), x.take(np.array(0))), [((3, 4),), ((2, 2, 2),)],
       (F32, I32, BOOL)),
    Fn("take_traced_indices", lambda m, x, i: (m.take(x, i, axis=1), m.take(x, i)), [((2, 3), (4,)), ((3, 3), (2, 2))],
       (F32,), (_rand, lambda r, s, d: r.integers(-3, 3, size=s).astype(np.int32))),
    Fn("take_along_axis", lambda m, x, i: (m.take_along_axis(x, i, axis=1), m.take_along_axis(x, i, axis=-1)),
       [((3, 4), (3, 2)), ((3, 4), (1, 5)), ((2, 3, 4), (2, 3, 1))], (F32, I32),
       (_rand, lambda r, s, d: r.integers(-3, 3, size=s).astype(np.int32))),
    Fn("take_along_axis0", lambda m, x, i: (m.take_along_axis(x, i, axis=0),), [((3, 4), (2, 4)), ((3, 4), (2, 1))],
       (F32,), (_rand, lambda r, s, d: r.integers(0, 3, size=s).astype(np.int32))),
    Fn("tril_triu", lambda m, x: (m.tril(x), m.triu(x), m.tril(x, 1), m.triu(x, -1), m.tril(x, -5)),
       [((4, 4),), ((3, 5),), ((2, 3, 3),), ((0, 0),), ((1, 1),)], (F32, I32, BOOL)),
    Fn("diag", lambda m, x: (m.diag(x), m.diag(x, 1), m.diag(x, -1)), [((3,),), ((3, 3),), ((2, 4),), ((1,),)]),
    Fn("diagonal_trace", lambda m, x: (m.diagonal(x), m.trace(x), m.diagonal(x, 1), m.trace(x, -1)),
       [((3, 3),), ((2, 4),), ((4, 2),)], (F32, I32)),
    Fn("astype", lambda m, x: (x.astype(np.float32), x.astype(np.int32), x.astype(np.bool_), m.astype(x, np.float16),
                               m.astype(x, "bfloat16")), U, (F32, I32, BOOL, F16),
       lambda r, s, d: _rand(r, s, d, -5.9, 5.9), keep_low=False),
    Fn("methods", lambda m, x: (x.sum(), x.mean(axis=0), x.max(axis=1), x.min(), x.argmax(), x.argmax(axis=1),
                                x.prod(axis=0), x.var(), x.std(axis=0), x.all(), x.any(axis=0), x.cumsum(axis=1),
                                x.clip(-1, 1), x.T.dot(x), x @ x.T, x.mT),
       [((3, 4),), ((1, 1),)], (F32,), _small_ints, methods=True),
    Fn("numpy_functions_on_arrays", lambda m, x: (np.sum(x), np.sum(x, axis=0), np.mean(x), np.max(x, axis=1),
                                                   np.transpose(x), np.reshape(x, (-1,)), np.argmax(x), np.clip(x, 0, 1),
                                                   np.cumsum(x, axis=0), np.round(x), np.squeeze(x[None]),
                                                   np.prod(x, axis=1), np.any(x > 0), np.std(x)),
       [((3, 4),)], (F32,), _small_ints, methods=True, tol=(1e-5, 1e-6)),
    Fn("operators", lambda m, x, y: (x + y, x - y, x * y, x / y, x // y, x % y, -x, +x, abs(x), x ** 2, x < y, x <= y,
                                     x > y, x >= y, x == y, x != y, 2 - x, 3.0 / y, 2 ** x,
                                     1 + x, 2 * x, 7 // y, 7 % y, x ** y),
       [((3, 4), (3, 4)), ((2, 1), (3,)), ((), ())], (F32,), (_pos, _nonzero), methods=True),
    Fn("int_operators", lambda m, x, y: (x + y, x - y, x * y, x // y, x % y, x & y, x | y, x ^ y, ~x, -x, x + 1,
                                         x * 3, 10 - x, x ** 2),
       [((3, 4), (3, 4)), ((2, 1), (3,)), ((), ())], (I32, I64, U64), (_rand, _nonzero), methods=True),
    Fn("bool_operators", lambda m, x, y: (x & y, x | y, x ^ y, ~x, x == y, x != y), [((3,), (3,)), ((), (2,))],
       (BOOL,), methods=True),
]
FNS_BY_NAME = {str(f): f for f in FNS}
assert len(FNS_BY_NAME) == len(FNS)

# functions exercised by the focused tests further down, not by the table
TESTED_ELSEWHERE = {"arange", "linspace", "zeros", "ones", "full", "empty", "eye", "identity", "tri", "zeros_like",
                    "ones_like", "full_like", "empty_like", "asarray", "array", "result_type", "shape", "ndim",
                    "size", "broadcast_shapes", "nonzero", "argwhere", "allclose", "meshgrid", "finfo", "iinfo",
                    "dtype", "triu_indices", "tril_indices", "array_equal", "isscalar", "issubdtype",
                    "promote_types", "can_cast"}


def test_every_tnp_function_is_tested():
    with open(__file__) as fh:
        text = fh.read()
    with open(__file__.replace("test_numpy.py", "test_numpy_api.py")) as fh:  # the JAX-porting table
        api = fh.read()
    covered = set(TESTED_ELSEWHERE) | {f.name.split("_axis")[0] for f in FNS} | set(re.findall(r"\bm\.(\w+)\(", text))
    covered |= set(re.findall(r"\bm\.(\w+)\b", api)) | set(re.findall(r'"(\w+)"', api))
    public = {n for n, v in vars(tnp).items() if callable(v) and not n.startswith("_")
              and getattr(v, "__module__", None) == tnp.__name__ and not isinstance(v, type)
              and not isinstance(v, tnp._ScalarType)}  # the dtype names: tests/test_jax_port.py
    missing = sorted(public - covered)
    assert not missing, f"tilefuse.numpy functions without a test: {missing}"


# ---- running one row ------------------------------------------------------------------------

def _expected_dtype(want: np.ndarray, inputs, keep_low=True) -> np.dtype:
    """numpy's result dtype under tilefuse's policy: no 64-bit result unless an input was 64-bit,
    and 16-bit float inputs give 16-bit results."""
    d = np.asarray(want).dtype
    ins = {np.asarray(x).dtype for x in inputs}
    if d == F64 and F64 not in ins:
        d = F32
    if d == I64 and I64 not in ins:
        d = I32
    if d == F32 and ins and ins <= set(LOW) and keep_low:
        d = next(iter(ins))
    return d


def _as_list(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _reference(row: Fn, xs):
    """numpy on the same values; 16-bit floats computed in float32 then rounded."""
    up = [x.astype(F32) if x.dtype in LOW else x for x in xs]
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's "mean of empty slice"
        return _as_list(row.ref(*up) if row.ref is not None else row.fn(np, *up))


def _strided(x):
    """The same values as x in a non-contiguous view: every other element of a bigger array."""
    if x.ndim == 0:
        return x
    big = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
    big[..., ::2] = x
    v = big[..., ::2]
    assert not v.flags.c_contiguous or x.shape[-1] <= 1 or x.size == 0
    return v


def _reversed(x):
    """The same values as x in a negative-stride view."""
    if x.ndim == 0:
        return x
    return np.ascontiguousarray(x[::-1])[::-1]


def _compare(got, want, inputs, row, what):
    got, want = _as_list(got), want
    assert len(got) == len(want), f"{row} ({what}): {len(got)} outputs, numpy gives {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        w = np.asarray(w)
        assert isinstance(g, (tx.Array, np.ndarray, np.generic, int, float, bool)), type(g)
        d = _expected_dtype(w, inputs, row.keep_low)
        g_arr = np.asarray(g)
        assert g_arr.shape == w.shape, f"{row} ({what}) output {k}: shape {g_arr.shape}, numpy {w.shape}"
        assert g_arr.dtype == d, f"{row} ({what}) output {k}: dtype {g_arr.dtype}, want {d}"
        assert_close(g_arr, w.astype(d), d, *(row.tol if d not in LOW else (None, None)))


def _make_inputs(row, shapes, dtype, rng):
    makers = row.make if isinstance(row.make, tuple) else (row.make,) * len(shapes)
    return [np.asarray(mk(rng, s, dtype)) for mk, s in zip(makers, shapes)]


def _cases():
    for row in FNS:
        for d in row.dtypes:
            yield pytest.param(row, d, id=f"{row}-{d.name}")


@pytest.mark.parametrize("row,dtype", list(_cases()))
def test_function(row, dtype, device):
    rng = np.random.default_rng(zlib.crc32(f"{row}{dtype}".encode()))
    jitted = tx.jit(lambda *a: row.fn(tnp, *a))
    for shapes in row.shapes:
        xs = _make_inputs(row, shapes, dtype, rng)
        want = _reference(row, xs)
        if not row.methods:
            _compare(row.fn(tnp, *xs), want, xs, row, f"eager on numpy {shapes}")
        on_dev = [tx.device_put(x, device) for x in xs]
        got = row.fn(tnp, *on_dev)
        for g in _as_list(got):
            assert not isinstance(g, tx.Array) or g.device is device
        _compare(got, want, xs, row, f"eager on {device} {shapes}")
        _compare(jitted(*xs), want, xs, row, f"jit {shapes}")
        for view in (_strided, _reversed):
            vs = [view(x) for x in xs]
            if not row.methods:
                _compare(row.fn(tnp, *vs), want, xs, row, f"eager, {view.__name__} {shapes}")
            _compare(jitted(*vs), want, xs, row, f"jit, {view.__name__} {shapes}")


# ---- Python scalars and mixed operands ---------------------------------------------------

@pytest.mark.parametrize("op", ["add", "subtract", "multiply", "divide", "maximum", "minimum", "power",
                                "less", "equal", "floor_divide", "remainder"])
def test_python_scalars_keep_array_dtype(op, device):
    x = np.array([0.5, 1.5, 2.0], np.float32)
    f = getattr(tnp, op)
    for s in (2, 2.0, True) if op != "power" else (2, 2.0):
        for args in ((x, s), (s, x)):
            got = f(*args)
            want = getattr(np, op)(*args)
            d = np.bool_ if want.dtype == np.bool_ else np.float32
            assert got.dtype == d, (op, args, got.dtype)
            assert_close(got, want.astype(d))
            assert tx.jit(lambda a: f(a, s) if args[0] is x else f(s, a))(x).dtype == d


def test_dtype_promotion(device):
    f32 = np.ones(3, np.float32)
    i32 = np.ones(3, np.int32)
    assert (tnp.asarray(f32) * 2.0).dtype == np.float32
    assert (tnp.asarray(i32) + 1).dtype == np.int32
    assert (tnp.asarray(i32) * 2.5).dtype == np.float32
    assert (tnp.asarray(i32) / 2).dtype == np.float32
    assert tnp.add(i32, f32).dtype == np.float32
    assert tnp.add(np.ones(3, np.int64), i32).dtype == np.int64
    assert tnp.add(np.ones(3, np.float64), f32).dtype == np.float64
    assert tnp.add(np.ones(3, np.float16), f32).dtype == np.float32
    assert tnp.add(np.ones(3, np.float16), np.ones(3, BF16)).dtype == np.float32
    assert tnp.add(np.ones(3, BF16), 1.0).dtype == BF16
    assert tnp.multiply(np.ones(3, np.float16), 3).dtype == np.float16
    assert tnp.add(np.ones(3, bool), True).dtype == np.bool_
    assert tnp.add(np.ones(3, bool), 1).dtype == np.int32
    assert tnp.add(np.ones(3, np.float64), 1).dtype == np.float64
    assert tnp.add(np.ones(3, np.int64), 1.0).dtype == np.float32
    assert tnp.result_type(f32, 1.0) == np.float32
    assert tnp.result_type(i32, np.ones(1, np.float16)) == np.float16
    assert tnp.add(1, 2).dtype == np.int32 and tnp.add(1.0, 2).dtype == np.float32
    # numpy float64 inputs stay float64; Python lists become float32 / int32
    assert tnp.asarray(np.ones(2)).dtype == np.float64
    assert tnp.asarray([1.0, 2.0]).dtype == np.float32 and tnp.asarray([1, 2]).dtype == np.int32
    assert tnp.asarray([True]).dtype == np.bool_ and tnp.asarray(3).dtype == np.int32
    assert tnp.asarray([1, 2], dtype=np.float16).dtype == np.float16
    y = tx.jit(lambda x: x * 2.0 + 1)(f32)
    assert y.dtype == np.float32
    assert tx.jit(lambda x: x + 1)(i32).dtype == np.int32
    b = tx.jit(lambda x: x * 2.0)(np.ones(3, BF16))
    assert b.dtype == BF16 and np.asarray(b).tolist() == [2.0] * 3
    h = tx.jit(lambda x: tnp.exp(x) + 1)(np.zeros(3, np.float16))
    assert h.dtype == np.float16 and np.asarray(h).tolist() == [2.0] * 3


def test_low_precision_arithmetic_rounds_like_numpy(device, rng):
    for d in (F16, BF16):
        x = rng.uniform(-4, 4, (33,)).astype(d)
        y = rng.uniform(0.5, 4, (33,)).astype(d)
        for op in (np.add, np.multiply, np.divide):
            got = getattr(tnp, op.__name__)(x, y)
            want = op(x.astype(np.float32), y.astype(np.float32)).astype(d)
            assert got.dtype == d
            np.testing.assert_array_equal(np.asarray(got).astype(np.float32), want.astype(np.float32))


# ---- creation ---------------------------------------------------------------------------

def test_creation(device):
    cases = [
        (lambda m: m.zeros((2, 3)), None), (lambda m: m.zeros(4, m.int32), None),
        (lambda m: m.ones((0, 3)), None), (lambda m: m.ones(()), None),
        (lambda m: m.full((2, 2), 7), None), (lambda m: m.full((2,), 1.5), np.float32),
        (lambda m: m.full((2,), 3, dtype=m.float16), None), (lambda m: m.empty((2, 0)).shape, None),
        (lambda m: m.arange(5), None), (lambda m: m.arange(2, 9, 3), None), (lambda m: m.arange(0), None),
        (lambda m: m.arange(1.0, 2.0, 0.25), np.float32), (lambda m: m.arange(5, 1, -1), None),
        (lambda m: m.arange(3, dtype=m.float32), None), (lambda m: m.arange(-3, 3), None),
        (lambda m: m.linspace(0, 1, 5), np.float32), (lambda m: m.linspace(-2, 2, 4, endpoint=False), np.float32),
        (lambda m: m.linspace(0, 1, 1), np.float32), (lambda m: m.linspace(0, 1, 0), np.float32),
        (lambda m: m.linspace(1, 3, 3, dtype=m.int32), None),
        (lambda m: m.eye(3), None), (lambda m: m.eye(2, 4, k=1), None), (lambda m: m.eye(3, k=-1, dtype=m.int32), None),
        (lambda m: m.identity(2), None), (lambda m: m.tri(3, 4, -1), None), (lambda m: m.tri(3, dtype=m.int32), None),
    ]
    for fn, d in cases:
        want = np.asarray(fn(np))
        got = fn(tnp)
        if isinstance(got, tuple):
            assert got == want.tolist() or got == tuple(want)
            continue
        assert isinstance(got, tx.Array) and got.device is device
        assert got.dtype == (d or _expected_dtype(want, [])), (fn, got.dtype)
        assert_close(got, want.astype(got.dtype), rtol=1e-6, atol=1e-6)
        jitted = tx.jit(lambda: fn(tnp))()
        assert jitted.dtype == got.dtype
        assert_close(jitted, want.astype(got.dtype), rtol=1e-6, atol=1e-6)


def test_like_functions(device, rng):
    for x in (rng.normal(size=(2, 3)).astype(np.float32), np.arange(4, dtype=np.int32), np.ones((), bool),
              np.zeros((0, 2), np.float16)):
        for name in ("zeros_like", "ones_like", "empty_like"):
            got = getattr(tnp, name)(x)
            assert got.shape == x.shape and got.dtype == x.dtype
            if name != "empty_like":
                np.testing.assert_array_equal(got, getattr(np, name)(x))
        got = tnp.full_like(x, 1)
        assert got.dtype == x.dtype
        np.testing.assert_array_equal(got, np.full_like(x, 1))
        assert tnp.zeros_like(x, dtype=np.float32).dtype == np.float32
        assert tnp.ones_like(x, shape=(3,)).shape == (3,)
        traced = tx.jit(lambda a: (tnp.zeros_like(a), tnp.ones_like(a), tnp.full_like(a, 2)))(x)
        for t, w in zip(traced, (np.zeros_like(x), np.ones_like(x), np.full_like(x, 2))):
            assert t.dtype == x.dtype
            np.testing.assert_array_equal(t, w)


def test_asarray_and_shape_queries(device):
    x = tnp.asarray([[1, 2], [3, 4]])
    assert isinstance(x, tx.Array) and x.device is device and x.dtype == np.int32
    assert tnp.shape(x) == (2, 2) and tnp.ndim(x) == 2 and tnp.size(x) == 4
    assert tnp.shape(np.ones((3, 1))) == (3, 1) and tnp.ndim(2.0) == 0 and tnp.size([1, 2, 3]) == 3
    assert tnp.array([1.5]).dtype == np.float32 and tnp.asarray(x) is x
    assert tnp.asarray(x, dtype=np.float32).dtype == np.float32
    assert tnp.broadcast_shapes((2, 1), (3,), ()) == (2, 3)
    assert tnp.broadcast_shapes() == ()
    y = tx.jit(lambda a: tnp.asarray([a[0], a[1] * 2, 5.0]))(np.array([1.0, 2.0], np.float32))
    np.testing.assert_array_equal(y, [1.0, 4.0, 5.0])
    z = tx.jit(lambda a: tnp.stack([tnp.asarray([a, a]), tnp.asarray([1.0, 2.0])]))(np.float32(3))
    np.testing.assert_array_equal(z, [[3, 3], [1, 2]])
    with pytest.raises(tx.TilefuseError, match="ragged"):
        tnp.asarray([[1, 2], [3]])
    with pytest.raises(tx.DTypeError):
        tnp.asarray(np.array(["a"]))


def test_misc_helpers(device):
    np.testing.assert_array_equal(tnp.nonzero(np.array([0, 3, 0, 1]))[0], [1, 3])
    assert tnp.nonzero(np.array([0, 3, 0, 1]))[0].dtype == np.int32
    np.testing.assert_array_equal(tnp.where(np.array([[0, 1], [1, 0]]))[1], [1, 0])
    np.testing.assert_array_equal(tnp.argwhere(np.array([[0, 1], [1, 0]])), [[0, 1], [1, 0]])
    assert tnp.allclose(np.ones(3), np.ones(3) + 1e-9) is True
    assert tnp.allclose(np.ones(3, np.float32), np.zeros(3, np.float32)) is False
    assert tnp.array_equal(np.arange(3), tnp.arange(3)) is True
    assert tnp.array_equal(np.arange(3), np.arange(4)) is False
    a, b = tnp.meshgrid(tnp.arange(3), np.arange(2.0))
    wa, wb = np.meshgrid(np.arange(3), np.arange(2.0))
    np.testing.assert_array_equal(a, wa)
    np.testing.assert_array_equal(b, wb)
    a, b = tnp.meshgrid(np.arange(3), np.arange(2), indexing="ij")
    np.testing.assert_array_equal(a, np.meshgrid(np.arange(3), np.arange(2), indexing="ij")[0])
    h = np.array([np.nan, np.inf, -np.inf, 1.5], np.float16)
    np.testing.assert_array_equal(tnp.nan_to_num(h), np.nan_to_num(h))
    assert tnp.nan_to_num(h).dtype == np.float16
    assert tnp.finfo(tnp.float32).max == np.finfo(np.float32).max
    assert float(tnp.finfo(tnp.bfloat16).eps) == float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps)
    assert tnp.iinfo(tnp.int32).min == -2**31
    assert tnp.dtype("float32") == np.float32
    r, c = tnp.triu_indices(3, 1)
    np.testing.assert_array_equal(r, np.triu_indices(3, 1)[0])
    np.testing.assert_array_equal(c, np.triu_indices(3, 1)[1])
    np.testing.assert_array_equal(tnp.tril_indices(3)[0], np.tril_indices(3)[0])
    assert tnp.isscalar(1.0) and not tnp.isscalar(tnp.ones(3))
    assert tnp.issubdtype(tnp.bfloat16, tnp.floating) and tnp.issubdtype(tnp.int32, tnp.integer)
    assert not tnp.issubdtype(tnp.int32, tnp.floating)
    assert tnp.promote_types(tnp.int32, tnp.float16) == np.float16
    assert tnp.can_cast(tnp.int32, tnp.float32) and not tnp.can_cast(tnp.float32, tnp.int32)


def test_where_and_clip_with_scalars(device):
    x = np.array([-2.0, 0.5, 3.0], np.float32)
    assert_close(tnp.where(x > 0, x, 0.0), np.where(x > 0, x, 0.0).astype(np.float32))
    assert tnp.where(x > 0, 1, 0).dtype == np.int32
    assert tnp.where(x > 0, x, 0).dtype == np.float32
    assert_close(tnp.clip(x, 0, 1), np.clip(x, 0, 1))
    assert tnp.clip(x, 0, 1).dtype == np.float32
    assert_close(tx.jit(lambda a: tnp.clip(a, -1.0, 1.0))(x), np.clip(x, -1, 1))


def test_einsum_errors():
    with pytest.raises(tx.ShapeError, match=r"\(3, 4\)"):
        tnp.einsum("ijk,jk->i", np.ones((3, 4)), np.ones((4, 5)))
    with pytest.raises(tx.ShapeError, match="'j'"):
        tnp.einsum("ij,jk->ik", np.ones((3, 4)), np.ones((5, 6)))
    with pytest.raises(tx.TilefuseError, match="2 terms"):
        tnp.einsum("ij,jk->ik", np.ones((3, 4)))


# ---- indexing ---------------------------------------------------------------------------

_M = np.array([True, False, True, True])
INDEXES = [
    1, -1, (1, 2), (1, 2, 3), (-4, -5, -6), (Ellipsis, 1), (slice(None), None), None, (Ellipsis, None),
    slice(1, 3), slice(None, None, 2), slice(None, None, -1), slice(3, 0, -2), (slice(None), slice(None, None, -2), 1),
    slice(-3, None), slice(10, None), (slice(None), slice(1, 1)), (slice(-100, 100),), np.int32(2), np.int64(-1),
    np.array([0, 2]), [0, 2, 1], [-1, 0], (slice(None), [0, -1]), ([0, 1], [1, 2]), ([0, 1], slice(None), [1, 2]),
    (slice(None), [0, 1], [1, 2]), np.array([[0, 1], [2, 3]]), (1, [0, 2]), ([0, 2], 1), (1, slice(None), [0, 2]),
    (Ellipsis, [0, 2]), (Ellipsis, slice(1, 3), None), (None, Ellipsis, None), [], np.array([], np.int32),
    (np.array([[0], [2]]), np.array([1, 3])), _M, (slice(None), np.array([True, False, True, True, False])),
    np.ones((4, 5), bool), (_M, slice(None), 0), (Ellipsis, np.array([1, 0, 1, 0, 1, 1], bool)),
    (0, np.array([True, False, True, True, False])), (slice(1, None), np.array([1, 1]), slice(None, None, 2)),
]


def _idx_id(i):
    return repr(i).replace(" ", "").replace("\n", "")[:40]


@pytest.mark.parametrize("idx", INDEXES, ids=[_idx_id(i) for i in INDEXES])
def test_getitem(idx, device):
    x = np.arange(4 * 5 * 6, dtype=np.float32).reshape(4, 5, 6)
    want = x[idx]
    got = tx.device_put(x, device)[idx]
    assert isinstance(got, tx.Array) and got.device is device
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(tx.jit(lambda a: a[idx])(x), want)
    np.testing.assert_array_equal(tx.jit(lambda a: a[idx])(_reversed(x)), want)
    np.testing.assert_array_equal(tx.jit(lambda a: a[idx])(_strided(x)), want)


def test_getitem_edge_shapes(device):
    s = np.float32(3.5) * np.ones((), np.float32)
    for idx in ((), None, Ellipsis, (None, None)):
        np.testing.assert_array_equal(tx.jit(lambda a: a[idx])(s), s[idx])
        assert tx.device_put(s, device)[idx].shape == s[idx].shape
    z = np.zeros((0, 3), np.float32)
    for idx in ((slice(None), 1), (Ellipsis, slice(0, 2)), (slice(None), [0, 2]), np.array([], np.int32)):
        np.testing.assert_array_equal(tx.jit(lambda a: a[idx])(z), z[idx])
    one = np.ones((1,), np.int32)
    for idx in (0, -1, slice(None), [0, 0, 0], None):
        np.testing.assert_array_equal(tx.device_put(one, device)[idx], one[idx])


def test_traced_index_arrays(device, rng):
    x = rng.normal(size=(5, 4)).astype(np.float32)
    for i in (np.array([0, 4, -1, 2]), np.array([[1, -2], [3, 0]]), np.array(3), np.array(-1)):
        i32 = i.astype(np.int32)
        np.testing.assert_array_equal(tx.jit(lambda a, k: a[k])(x, i32), x[i])
        np.testing.assert_array_equal(tx.jit(lambda a, k: a[:, k % 4])(x, i32), x[:, i % 4])
        np.testing.assert_array_equal(tx.jit(lambda a, k: a[k, k % 4])(x, i32), x[i, i % 4])
    f = tx.jit(lambda a, k: a[k])
    assert f(x, np.int32(2)).shape == (4,)
    np.testing.assert_array_equal(f(x, np.int32(-2)), x[-2])


def test_traced_boolean_mask_is_a_clear_error():
    x = np.arange(6, dtype=np.float32)
    with pytest.raises(tx.ConcretizationError, match=r"tnp\.where") as e:
        tx.jit(lambda a: a[a > 2])(x)
    assert "bool[6]" in str(e.value) and __file__ in str(e.value)
    with pytest.raises(tx.ConcretizationError):
        tx.jit(lambda a: tnp.nonzero(a))(x)
    # a concrete mask is fine inside jit
    np.testing.assert_array_equal(tx.jit(lambda a: a[x > 2])(x), x[x > 2])


def test_index_errors():
    x = tnp.zeros((3, 4))
    with pytest.raises(IndexError, match="out of bounds"):
        x[3]
    with pytest.raises(IndexError, match="out of bounds"):
        x[:, -5]
    with pytest.raises(IndexError, match="out of bounds"):
        x[np.array([0, 3])]
    with pytest.raises(tx.ShapeError, match="too many indices"):
        x[0, 0, 0]
    with pytest.raises(tx.TilefuseError, match="ellipsis"):
        x[..., ...]
    with pytest.raises(IndexError, match="boolean index"):
        x[np.array([True, False])]
    with pytest.raises(TypeError, match="immutable"):
        x[0] = 1.0
    with pytest.raises(tx.TilefuseError, match="integers"):
        x[np.array([0.5])]


AT_CASES = [
    (1, 5.0), (-1, np.arange(4, dtype=np.float32)), ((slice(None), 1), -1.0), ((slice(1, 3), slice(None, None, 2)), 7.0),
    ([0, 2], 9.0), ((Ellipsis, [0, 0, 3]), np.array([1.0, 2.0, 3.0], np.float32)), (np.array([True, False, True]), 0.5),
    ((slice(None, None, -1), 0), np.array([1.0, 2.0, 3.0], np.float32)), ([], 1.0), ((None, 0), 3.0),
    (([0, 1], [1, 2]), np.array([10.0, 20.0], np.float32)),
]


@pytest.mark.parametrize("idx,val", AT_CASES, ids=[_idx_id(c[0]) for c in AT_CASES])
def test_at_set_add(idx, val, device):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    want_set = x.copy()
    want_set[idx] = val
    want_add = x.copy()
    np.add.at(want_add, idx, val)
    want_mul = x.copy()
    want_mul[idx] = x[idx] * 2  # repeated indices: each position once
    xd = tx.device_put(x, device)
    for got, want in ((xd.at[idx].set(val), want_set), (xd.at[idx].add(val), want_add),
                      (xd.at[idx].multiply(2.0), want_mul), (xd.at[idx].get(), x[idx])):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)
    f = tx.jit(lambda a, v: (a.at[idx].set(v), a.at[idx].add(v)))
    s, a = f(x, np.asarray(val, np.float32))
    np.testing.assert_array_equal(s, want_set)
    np.testing.assert_array_equal(a, want_add)
    np.testing.assert_array_equal(xd, x)  # functional: the original is untouched


def test_at_with_traced_indices(device):
    x = np.arange(6, dtype=np.float32)
    i = np.array([4, 1, -1], np.int32)
    want = x.copy()
    want[i] = [7.0, 8.0, 9.0]
    np.testing.assert_array_equal(tx.jit(lambda a, k: a.at[k].set(np.array([7.0, 8.0, 9.0], np.float32)))(x, i),
                                  want)
    want = x.copy()
    np.add.at(want, i, 1.0)
    np.testing.assert_array_equal(tx.jit(lambda a, k: a.at[k].add(1.0))(x, i), want)
    # repeated traced positions: set stores the same value once (not their sum)
    np.testing.assert_array_equal(tx.jit(lambda a, k: a.at[k].set(5.0))(x, np.array([2, 2], np.int32)),
                                  [0, 1, 5, 3, 4, 5])
    # last write wins for a concrete index, as in numpy
    np.testing.assert_array_equal(tnp.asarray(x).at[[1, 1]].set(np.array([3.0, 4.0], np.float32)),
                                  [0, 4, 2, 3, 4, 5])
    ints = np.arange(5, dtype=np.int32)
    got = tx.jit(lambda a: a.at[1:3].add(2).at[0].set(-1))(ints)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, [-1, 3, 4, 3, 4])
    b = np.zeros(3, bool)
    np.testing.assert_array_equal(tnp.asarray(b).at[1].set(True), [False, True, False])
    np.testing.assert_array_equal(tnp.asarray(ints).at[::2].max(3), [3, 1, 3, 3, 4])
    np.testing.assert_array_equal(tnp.asarray(ints).at[1:].min(2), [0, 1, 2, 2, 2])


# ---- Array: the eager value -------------------------------------------------------------

def test_array_basics(device):
    import copy
    import pickle
    a = tx.device_put(np.arange(6, dtype=np.float32).reshape(2, 3), device)
    assert repr(a) == "Array([[0., 1., 2.],\n       [3., 4., 5.]], dtype=float32)"
    assert str(a) == str(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert a.shape == (2, 3) and a.ndim == 2 and a.size == 6 and a.dtype == np.float32 and a.nbytes == 24
    assert a.device is device and a.block_until_ready() is a
    assert len(a) == 2 and [r.shape for r in a] == [(3,), (3,)]
    assert a.tolist() == [[0, 1, 2], [3, 4, 5]] and a[1, 2].item() == 5.0
    assert float(a[0, 1]) == 1.0 and int(a[1, 0]) == 3 and bool(a[0, 1]) and f"{a[0, 2]:.1f}" == "2.0"
    np.testing.assert_array_equal(np.asarray(a), np.arange(6).reshape(2, 3))
    assert np.asarray(a, dtype=np.int32).dtype == np.int32
    b = pickle.loads(pickle.dumps(a))
    np.testing.assert_array_equal(b, a)
    np.testing.assert_array_equal(copy.deepcopy(a), a)
    np.testing.assert_array_equal(a.copy(), a)
    with pytest.raises(TypeError):
        hash(a)
    with pytest.raises(TypeError):
        len(tx.device_put(np.float32(1), device))
    # numpy on the left defers to the Array's operators (array priority)
    r = np.ones(3, np.float32) + tx.device_put(np.arange(3, dtype=np.float32), device)
    assert isinstance(r, tx.Array) and r.device is device
    np.testing.assert_array_equal(r, [1, 2, 3])
    assert isinstance(2.0 * a, tx.Array) and (a == a).dtype == np.bool_
    z = tx.device_put(np.zeros((0, 2), np.int32), device)
    assert repr(z) == "Array([], shape=(0, 2), dtype=int32)"
    assert repr(tx.device_put(np.ones((), ml_dtypes.bfloat16), device)) == "Array(1, dtype=bfloat16)"


def test_device_put_pytrees_and_moves(device):
    tree = {"w": np.ones((2, 2), np.float32), "b": [np.zeros(2, np.int32), None]}
    put = tx.device_put(tree, device)
    assert put["w"].device is device and put["b"][0].dtype == np.int32 and put["b"][1] is None
    again = tx.device_put(put["w"], device)
    assert again is put["w"]  # already there: no copy
    ref = tx.device_put(put["w"], "ref")
    assert ref.device.name == "ref"
    np.testing.assert_array_equal(ref, np.ones((2, 2)))
    got = tx.device_get({"w": put["w"] * 3, "n": 7, "none": None})  # (jax.device_get)
    assert type(got["w"]) is np.ndarray and got["n"] == 7 and got["none"] is None
    np.testing.assert_array_equal(got["w"], np.full((2, 2), 3.0, np.float32))
