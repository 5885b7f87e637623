"""The llvm backend on hand-built kernels, against numpy: index maps (broadcast, transpose,
strides), reductions (inner and outer axes, argmax), casts incl. float16/bfloat16, integer ops,
scatter-add, sizes 0/1/7/1023 and one big enough for threads; the vectorised math functions'
ulp bounds and special values; compile errors."""
from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np

import pytest

from tilefuse.backends.llvm import create
from tilefuse.backends.llvm.compile import get_target
from tilefuse.ir.errors import CompileError, DeviceError
from tilefuse.ir.kernel import ir as K
from tilefuse.runtime.hardware import host_info

F32, F64, I32, I64 = (np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))
U32, BOOL, F16, BF16 = np.dtype(np.uint32), np.dtype(np.bool_), np.dtype(np.float16), \
    np.dtype(ml_dtypes.bfloat16)
SIZES = [0, 1, 7, 1023]


@pytest.fixture(scope="module")
def be():
    return create()


def strides(shape):
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= n
    return out[::-1]


def kernel(inputs, out_dtypes, shape, values, reduce_shape=(), offsets=None, mode="set"):
    """A kernel over `shape` reading `inputs` [(dtype, size)] and writing one output per value
    (row-major over `shape` unless `offsets` say otherwise)."""
    bufs = [K.Buffer(f"in{i}", np.dtype(d), n) for i, (d, n) in enumerate(inputs)]
    size = int(np.prod(shape, dtype=np.int64))
    bufs += [K.Buffer(f"out{i}", np.dtype(d), size) for i, d in enumerate(out_dtypes)]
    offsets = offsets or [K.affine(strides(shape))] * len(values)
    stores = tuple(K.Store(len(inputs) + i, off, v, mode) for i, (off, v) in enumerate(zip(offsets, values)))
    return K.Kernel("test", tuple(bufs), len(inputs), tuple(shape), tuple(reduce_shape), stores)


def run(be, k, *arrays, outs=None):
    outs = outs if outs is not None else [np.zeros(b.size, b.dtype) for b in k.buffers[k.n_inputs:]]
    be.compile_kernel(k)([np.ascontiguousarray(a).reshape(-1) for a in arrays] + outs)
    return outs


def rand(shape, dtype=F32, seed=0):
    r = np.random.default_rng(seed).standard_normal(shape)
    return r.astype(dtype)


# ---- elementwise and index maps ---------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES + [(1 << 18) + 5])
def test_elementwise_chain(be, n):
    x = rand(n)
    v = K.load(0, K.affine([1]), F32)
    e = K.binary("add", K.binary("mul", K.unary("tanh", v * 1.7 + 0.3), K.unary("logistic", v)),
                 K.binary("mul", K.unary("exp", K.unary("neg", K.binary("mul", v, v))), K.const(0.5, F32)))
    k = kernel([(F32, n)], [F32], (n,), [e])
    (y,) = run(be, k, x)
    ref = np.tanh(x * 1.7 + 0.3) * (1 / (1 + np.exp(-x))) + np.exp(-x * x) * 0.5
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=2e-7)
    if n > 1 << 18:
        assert be.compile_kernel(k).threads == host_info().compute_units


@pytest.mark.parametrize("shape", [(0, 5), (1, 1), (7, 3), (33, 1023), (3, 1, 7, 5)])
def test_broadcast_transpose_strided(be, shape):
    """out = x[i..] + b[last axis] (broadcast) - t[transposed] + s[strided slice]."""
    n = int(np.prod(shape))
    x, b = rand(shape), rand(shape[-1], seed=1)
    t = rand(shape[::-1], seed=2)
    s_full = rand([2 * d + 1 for d in shape], seed=3)
    st = strides(shape)
    vx = K.load(0, K.affine(st), F32)
    vb = K.load(1, K.affine([0] * (len(shape) - 1) + [1]), F32)
    vt = K.load(2, K.affine(strides(shape[::-1])[::-1]), F32)
    sst = strides(s_full.shape)
    vs = K.load(3, K.affine([2 * v for v in sst], base=sum(sst)), F32)
    e = K.binary("add", K.binary("sub", vx + vb, vt), vs)
    k = kernel([(F32, n), (F32, b.size), (F32, t.size), (F32, s_full.size)], [F32], shape, [e])
    (y,) = run(be, k, x, b, t, s_full)
    ref = x + b - np.transpose(t) + s_full[tuple(slice(1, None, 2) for _ in shape)]
    np.testing.assert_allclose(y.reshape(shape), ref, rtol=1e-6)


def test_iota_and_nonaffine_index(be):
    """cast(idx) (iota) and an index map with rem (a reshape the lowering could not fold)."""
    shape = (6, 10)
    x = np.arange(60, dtype=np.float32)
    io = K.cast(K.idx(1), F32)
    off = K.binary("add", K.binary("mul", K.idx(0), K.const(10, I64)),
                   K.KExpr("rem", I64, (K.binary("add", K.idx(1), K.const(3, I64)), K.const(10, I64))))
    e = K.binary("add", io, K.load(0, off, F32))
    (y,) = run(be, kernel([(F32, 60)], [F32], shape, [e]), x)
    ref = np.arange(10, dtype=np.float32)[None, :] + np.roll(x.reshape(6, 10), -3, axis=1)
    np.testing.assert_array_equal(y.reshape(shape), ref)


# ---- reductions -----------------------------------------------------------------------------

NP_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("shape", [(1, 1), (7, 5), (33, 1023), (300, 260)])
def test_reduce_axis(be, op, axis, shape):
    x = rand(shape) * (0.1 if op == "prod" else 1) + (1 if op == "prod" else 0)
    x = x.astype(F32)
    st = strides(shape)
    keep = 1 - axis
    v = K.load(0, K.affine([st[keep]], reduce_strides=[st[axis]]), F32)
    k = kernel([(F32, x.size)], [F32], (shape[keep],), [K.reduce(op, v)], reduce_shape=(shape[axis],))
    (y,) = run(be, k, x)
    ref = NP_REDUCE[op](x.astype(np.float64), axis=axis)
    np.testing.assert_allclose(y, ref, rtol=1e-5 if op != "prod" else 1e-4, atol=1e-5)


def test_reduce_nan_propagates_and_empty(be):
    x = rand((4, 9))
    x[1, 3] = np.nan
    x[2, 0] = np.nan
    v = K.load(0, K.affine([9], reduce_strides=[1]), F32)
    k = kernel([(F32, 36)], [F32, F32, F32], (4,), [K.reduce(op, v) for op in ("max", "min", "sum")],
               reduce_shape=(9,))
    mx, mn, sm = run(be, k, x)
    np.testing.assert_array_equal(mx, np.max(x, axis=1))
    np.testing.assert_array_equal(mn, np.min(x, axis=1))
    np.testing.assert_allclose(sm, np.sum(x, axis=1), rtol=1e-6)
    empty = kernel([(F32, 1)], [F32, F32], (3,), [K.reduce("sum", K.load(0, K.ridx(0), F32)),
                                                   K.reduce("prod", K.load(0, K.ridx(0), F32))],
                   reduce_shape=(0,))
    s, p = run(be, empty, np.ones(1, F32))
    np.testing.assert_array_equal(s, 0)
    np.testing.assert_array_equal(p, 1)


@pytest.mark.parametrize("op", ["argmax", "argmin"])
@pytest.mark.parametrize("axis", [1, 0])
def test_argmax_ties_and_nan(be, op, axis):
    x = np.round(rand((40, 300)) * 2).astype(F32)  # many ties
    x[5, 7] = np.nan
    x[5, 9] = np.nan
    x[9, :] = -np.inf if op == "argmax" else np.inf
    st = strides(x.shape)
    keep = 1 - axis
    v = K.load(0, K.affine([st[keep]], reduce_strides=[st[axis]]), F32)
    e = K.cast(K.reduce(op, v, K.ridx(0)), I32)
    (y,) = run(be, kernel([(F32, x.size)], [I32], (x.shape[keep],), [e], reduce_shape=(x.shape[axis],)), x)
    np.testing.assert_array_equal(y, getattr(np, op)(x, axis=axis))


def test_int_reductions_and_multi_axis(be):
    x = np.random.default_rng(0).integers(-1000, 1000, (4, 6, 5)).astype(I32)
    v = K.load(0, K.affine([30], reduce_strides=[5, 1]), I32)  # reduce axes 1 and 2 (merged)
    vt = K.load(0, K.affine([1], reduce_strides=[30, 5]), I32)  # keep axis 2: strided
    k = kernel([(I32, x.size)], [I32, I32, I32], (4,),
               [K.reduce("sum", v), K.reduce("max", v), K.reduce("min", v)], reduce_shape=(6, 5))
    s, mx, mn = run(be, k, x)
    np.testing.assert_array_equal(s, x.sum(axis=(1, 2)))
    np.testing.assert_array_equal(mx, x.max(axis=(1, 2)))
    np.testing.assert_array_equal(mn, x.min(axis=(1, 2)))
    k2 = kernel([(I32, x.size)], [I32], (5,), [K.reduce("sum", vt)], reduce_shape=(4, 6))
    np.testing.assert_array_equal(run(be, k2, x)[0], x.sum(axis=(0, 1)))


def test_softmax_rows(be):
    """max, then sum of exp(x - max), then the normalised row: three kernels as a fusion would."""
    x = rand((37, 129)) * 5
    r, c = x.shape
    ld = K.load(0, K.affine([c], reduce_strides=[1]), F32)
    (m,) = run(be, kernel([(F32, x.size)], [F32], (r,), [K.reduce("max", ld)], reduce_shape=(c,)), x)
    e = K.unary("exp", K.binary("sub", ld, K.load(1, K.idx(0), F32)))
    (s,) = run(be, kernel([(F32, x.size), (F32, r)], [F32], (r,), [K.reduce("sum", e)], reduce_shape=(c,)),
               x, m)
    out = K.binary("div", K.unary("exp", K.binary("sub", K.load(0, K.affine([c, 1]), F32),
                                                  K.load(1, K.idx(0), F32))), K.load(2, K.idx(0), F32))
    (y,) = run(be, kernel([(F32, x.size), (F32, r), (F32, r)], [F32], (r, c), [out]), x, m, s)
    ref = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(y.reshape(r, c), ref / ref.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape", [(37, 129), (5, 3, 17), (3, 0)])
def test_softmax_one_row_kernel(be, shape):
    """The same as one row kernel: a max, a sum that reads it (a second reduction level), the
    log-sum-exp stored once per row and the normalised row by a row store."""
    x = rand(shape) * 5
    r, row = shape[0], shape[1:]
    n = int(np.prod(row))
    ld = K.load(0, K.affine([n], reduce_strides=strides(row)), F32)
    m = K.reduce("max", ld)
    e = K.unary("exp", K.binary("sub", ld, m))
    s = K.reduce("sum", e)
    bufs = (K.Buffer("x", F32, x.size), K.Buffer("lse", F32, r), K.Buffer("y", F32, x.size))
    k = K.Kernel("softmax", bufs, 1, (r,), row, (
        K.Store(1, K.idx(0), K.binary("add", K.unary("log", s), m)),
        K.Store(2, K.affine([n], reduce_strides=strides(row)), K.binary("div", e, s))))
    assert k.row_stores == (k.stores[1],)
    lse, y = run(be, k, x)
    x2 = x.reshape(r, n)
    ref = np.exp(x2 - x2.max(1, keepdims=True)) if n else x2
    np.testing.assert_allclose(y.reshape(r, n), ref / ref.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
    if n:
        np.testing.assert_allclose(lse, np.log(np.exp(x2).sum(1)), rtol=1e-5)


def test_row_pass_reuses_what_a_reduction_pass_computed():
    """row_stashes: softmax's exp(x - max), computed by the sum's pass, is kept in the output
    row for the row pass; not where the round trip would round (a bfloat16 output) or where
    two points of the row share an element of the output."""
    n = 16
    ld = K.load(0, K.affine([n], reduce_strides=[1]), F32)
    m = K.reduce("max", ld)
    e = K.unary("exp", K.binary("sub", ld, m))
    s = K.reduce("sum", e)

    def softmax(out_dtype, offset):
        bufs = (K.Buffer("x", F32, 4 * n), K.Buffer("y", out_dtype, 4 * n))
        return K.Kernel("softmax", bufs, 1, (4,), (n,), (K.Store(1, offset, K.binary("div", e, s)),))
    rows = K.affine([n], reduce_strides=[1])
    k = softmax(F32, rows)
    assert list(K.row_stashes(k).values()) == [(1, e)]
    assert K.row_stashes(softmax(BF16, rows)) == {}
    folded = K.binary("add", K.affine([n]), K.binary("rem", K.ridx(0), K.const(4, K.INDEX)))
    assert K.row_stashes(softmax(F32, folded)) == {}  # not affine: not known one-to-one
    ld2 = K.load(0, K.affine([n], reduce_strides=[4, 1]), F32)
    e2 = K.unary("exp", K.binary("sub", ld2, K.reduce("max", ld2)))
    value = K.binary("div", e2, K.reduce("sum", e2))
    for reduce_strides, kept in (([4, 1], [(1, e2)]), ([1, 1], [])):  # ridx0 + ridx1 repeats offsets
        k2 = K.Kernel("t", k.buffers, 1, (4,), (4, 4), (K.Store(1, K.affine([n], reduce_strides=reduce_strides),
                                                                value),))
        assert list(K.row_stashes(k2).values()) == kept


# ---- casts and integer semantics -----------------------------------------------------------------

@pytest.mark.parametrize("src,dst", [(F32, I32), (F32, U32), (F32, I64), (I32, F32), (I64, F64),
                                     (U32, F32), (F32, F16), (F16, F32), (F32, BF16), (BF16, F32),
                                     (F64, F32), (F32, BOOL), (BOOL, F32), (I32, BOOL), (BOOL, I32),
                                     (I64, I32), (I32, I64), (U32, I64), (BF16, F16), (F64, BF16)])
def test_casts(be, src, dst):
    vals = np.array([0.0, -0.0, 1.5, -1.5, 2.5, -2.7, 0.1, 100.25, 65504.0, 1e-3, 3.0, -7.0, 1.00390625,
                     1.0 + 2 ** -9, 1.0 + 3 * 2 ** -9])
    if src == BOOL:
        x = np.array([True, False, True])
    elif np.dtype(src).kind in "iu" or np.dtype(dst).kind in "iub" and src.kind == "f":
        x = (vals if np.dtype(src).kind == "f" else np.trunc(vals)).astype(src)
        if np.dtype(dst) == U32 or src == U32:
            x = np.abs(x).astype(src)
    else:
        x = vals.astype(src)
    k = kernel([(src, x.size)], [dst], (x.size,), [K.cast(K.load(0, K.idx(0), src), dst)])
    (y,) = run(be, k, x)
    if src.kind == "f" and dst.kind in "iu":
        ref = np.trunc(x.astype(np.float64)).astype(dst)
    elif dst == BF16 and src == F64:
        ref = x.astype(F32).astype(dst)  # via float32, as documented
    else:
        with np.errstate(over="ignore"):
            ref = x.astype(dst)
    np.testing.assert_array_equal(y.view(np.uint16) if dst == BF16 else y,
                                  ref.view(np.uint16) if dst == BF16 else ref)


def test_bf16_round_to_nearest_even(be):
    bits = np.arange(0, 1 << 16, 7, dtype=np.uint32) << 16 | np.arange(0, 1 << 16, 7, dtype=np.uint32)
    x = bits.view(np.float32)
    k = kernel([(F32, x.size)], [BF16], (x.size,), [K.cast(K.load(0, K.idx(0), F32), BF16)])
    (y,) = run(be, k, x)
    with np.errstate(invalid="ignore"):
        ref = x.astype(BF16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(y.view(np.uint16)[~nan], ref.view(np.uint16)[~nan])
    assert np.isnan(y.astype(np.float32)[nan]).all()


def test_f16_bf16_arithmetic_in_f32(be):
    x = rand(100).astype(F16)
    b = rand(100, seed=1).astype(BF16)
    prod = K.binary("mul", K.cast(K.load(0, K.idx(0), F16), F32), K.cast(K.load(1, K.idx(0), BF16), F32))
    e = K.cast(prod, F16)
    (y,) = run(be, kernel([(F16, 100), (BF16, 100)], [F16], (100,), [e]), x, b)
    np.testing.assert_array_equal(y, (x.astype(F32) * b.astype(F32)).astype(F16))


def _binop_kernel(op, dtype, n):
    return kernel([(dtype, n), (dtype, n)], [dtype if op not in ("lt", "eq", "ne", "ge") else BOOL], (n,),
                  [K.binary(op, K.load(0, K.idx(0), dtype), K.load(1, K.idx(0), dtype))])


@pytest.mark.parametrize("dtype", [I32, I64, U32])
def test_integer_ops(be, dtype):
    from tilefuse.ir import primitives as P
    info = np.iinfo(dtype)
    a = np.array([7, -7, 7, -7, 0, 5, info.min, info.min, info.max, 3, 1, -1, 12345], np.int64)
    b = np.array([2, 2, -2, -2, 3, 0, -1, 1, 7, 40, 31, 33, -5], np.int64)
    if dtype == U32:
        a, b = np.abs(a) % (1 << 32), np.abs(b)
    a, b = a.astype(dtype), b.astype(dtype)
    n = a.size
    for op, prim in [("div", P.div), ("rem", P.rem), ("add", P.add), ("sub", P.sub), ("mul", P.mul),
                     ("max", P.max_), ("min", P.min_), ("and", P.and_), ("xor", P.xor), ("lt", P.lt),
                     ("ne", P.ne), ("shift_left", P.shift_left),
                     ("shift_right_logical", P.shift_right_logical)]:
        with np.errstate(all="ignore"):
            ref = prim.impl(a, b)[0]
        (y,) = run(be, _binop_kernel(op, dtype, n), a, b)
        np.testing.assert_array_equal(y, ref, err_msg=f"{op} {dtype}")


def test_float_unary_semantics(be):
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.0, -0.0, np.nan, np.inf, -np.inf, 3.7, -3.2], F32)
    ops = ["round", "floor", "ceil", "sign", "abs", "neg", "sqrt", "rsqrt", "is_finite"]
    ref = {"round": np.round, "floor": np.floor, "ceil": np.ceil, "sign": np.sign, "abs": np.abs,
           "neg": np.negative, "sqrt": np.sqrt, "rsqrt": lambda v: 1 / np.sqrt(v), "is_finite": np.isfinite}
    for op in ops:
        e = K.unary(op, K.load(0, K.idx(0), F32), BOOL if op == "is_finite" else None)
        (y,) = run(be, kernel([(F32, x.size)], [BOOL if op == "is_finite" else F32], (x.size,), [e]), x)
        with np.errstate(all="ignore"):
            np.testing.assert_array_equal(y, ref[op](x), err_msg=op)


def test_select_compare_float(be):
    a = np.array([1.0, np.nan, 2.0, -0.0, 3.0], F32)
    b = np.array([1.0, 1.0, np.nan, 0.0, -3.0], F32)
    la, lb = K.load(0, K.idx(0), F32), K.load(1, K.idx(0), F32)
    vals = [K.binary(op, la, lb) for op in ("eq", "ne", "lt", "ge")] + \
        [K.select(K.binary("gt", la, lb), la, lb), K.binary("max", la, lb), K.binary("min", la, lb)]
    outs = run(be, kernel([(F32, 5), (F32, 5)], [BOOL] * 4 + [F32] * 3, (5,), vals), a, b)
    for y, ref in zip(outs, [a == b, a != b, a < b, a >= b, np.where(a > b, a, b), np.maximum(a, b),
                             np.minimum(a, b)]):
        np.testing.assert_array_equal(y, ref)


def test_scatter_add(be):
    """out[idx[i], j] += upd[i, j]: a serial kernel with an "add" store and a gathered offset."""
    idx = np.array([3, 0, 3, 1, 3, 0, 4], np.int32)
    upd = rand((7, 5))
    out = rand((6, 5), seed=4)
    off = K.binary("add", K.binary("mul", K.cast(K.load(0, K.idx(0), I32), I64), K.const(5, I64)), K.idx(1))
    bufs = (K.Buffer("idx", I32, 7), K.Buffer("upd", F32, 35), K.Buffer("out", F32, 30))
    k = K.Kernel("scatter", bufs, 2, (7, 5), (), (K.Store(2, off, K.load(1, K.affine([5, 1]), F32), "add"),))
    ck = be.compile_kernel(k)
    assert ck.threads == 1
    y = out.reshape(-1).copy()
    ck([idx, upd.reshape(-1), y])
    ref = out.copy()
    np.add.at(ref, idx, upd)
    np.testing.assert_allclose(y.reshape(6, 5), ref, rtol=1e-6)


def test_float64_libm_and_pow(be):
    x = np.array([0.3, -1.7, 2.5, 10.0, -0.0, np.inf, np.nan])
    for op in ("exp", "log1p", "tanh", "sin", "erf", "logistic"):
        (y,) = run(be, kernel([(F64, x.size)], [F64], (x.size,), [K.unary(op, K.load(0, K.idx(0), F64))]), x)
        with np.errstate(all="ignore"):
            ref = {"erf": np.vectorize(math.erf), "logistic": lambda v: 1 / (1 + np.exp(-v))}.get(
                op, getattr(np, op, None))(x)
        np.testing.assert_allclose(y, ref, rtol=1e-15, err_msg=op)


def test_pow_special_cases(be):
    vals = np.array([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 3.0, -3.0, 2.5, -8.0, np.inf, -np.inf,
                     np.nan, 1e-30, 1e30, 7.3], F32)
    a, b = (v.ravel() for v in np.meshgrid(vals, vals))
    (y,) = run(be, _binop_kernel("pow", F32, a.size), a, b)
    with np.errstate(all="ignore"):
        ref = np.power(a, b)
        same = (y == ref) | (np.isnan(y) & np.isnan(ref)) | (np.abs(y - ref) <= 2e-7 * np.abs(ref))
    assert same.all(), list(zip(a[~same], b[~same], y[~same], ref[~same]))
    assert (np.signbit(y) == np.signbit(ref))[~np.isnan(ref)].all()


# ---- accuracy of the vectorised float32 math --------------------------------------------------

ERF64 = np.vectorize(math.erf)
MATH = {  # op: (float64 reference, ranges tested, max ulp)
    "exp": (np.exp, [(-104, 88.7)], 2), "log": (np.log, [(0, 1e4)], 2),
    "log1p": (np.log1p, [(-1, 10)], 3), "expm1": (np.expm1, [(-30, 88.7)], 3),
    "tanh": (np.tanh, [(-10, 10)], 3), "logistic": (lambda v: 1 / (1 + np.exp(-v)), [(-80, 80)], 3),
    "erf": (ERF64, [(-5, 5)], 3), "sin": (np.sin, [(-10, 10), (-1e6, 1e6)], 2),
    "cos": (np.cos, [(-10, 10), (-1e6, 1e6)], 2)}


def _ulps(got, ref64):
    ref32 = ref64.astype(np.float32)
    spacing = np.maximum(np.spacing(np.abs(ref32)).astype(np.float64), 2.0 ** -149)
    return np.abs(got.astype(np.float64) - ref64) / spacing


def _unary(be, op, x):
    (y,) = run(be, kernel([(F32, x.size)], [F32], (x.size,), [K.unary(op, K.load(0, K.idx(0), F32))]), x)
    return y


@pytest.mark.parametrize("op", list(MATH))
def test_math_ulp(be, op):
    """≤ 2-3 ulp against float64 on uniform samples and on samples spread over all exponents
    (incl. denormal inputs and results); fast-math is off here: only `contract` on user
    arithmetic and `reassoc` on reductions, so NaN/inf/-0.0 follow numpy (next test)."""
    ref_fn, ranges, bound = MATH[op]
    rng = np.random.default_rng(1)
    for lo, hi in ranges:
        spread = rng.choice([-1, 1], 20000) * np.exp2(rng.uniform(-149, 127, 20000))
        for x in (rng.uniform(lo, hi, 50000), np.clip(spread, lo, hi)):
            x = x.astype(np.float32)
            y = _unary(be, op, x)
            with np.errstate(all="ignore"):
                ref = ref_fn(x.astype(np.float64))
            ok = np.abs(ref) < np.finfo(np.float32).max  # overflow to inf checked below
            u = _ulps(y[ok], ref[ok])
            assert u.max() <= bound, f"{op}: {u.max():.2f} ulp at x={x[ok][np.argmax(u)]!r}"
            assert np.isinf(y[~ok]).all()


@pytest.mark.parametrize("op", list(MATH))
def test_math_special_values(be, op):
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40], np.float32)
    y = _unary(be, op, x)
    with np.errstate(all="ignore"):
        ref = (ERF64 if op == "erf" else MATH[op][0])(x.astype(np.float64)).astype(np.float32)
    same = (np.isnan(y) & np.isnan(ref)) | ((y == ref) & (np.signbit(y) == np.signbit(ref)))
    assert same.all(), list(zip(x[~same], y[~same], ref[~same]))


def test_math_is_vectorised():
    """The float32 functions compile to SIMD code with no calls (what makes them fast)."""
    import llvmlite.binding as llvm

    from tilefuse.backends.llvm.compile import kernel_ir
    t = get_target(host_info())
    v = K.load(0, K.idx(0), F32)
    e = v
    for op in ("exp", "log", "tanh", "erf", "sin", "logistic", "log1p", "expm1"):
        e = K.binary("add", e, K.unary(op, v))
    mod = llvm.parse_assembly(kernel_ir(kernel([(F32, 4096)], [F32], (4096,), [e]), host_info()))
    mod.triple, mod.data_layout = t.triple, t.data_layout
    t.optimize(mod)
    text = str(mod)
    # the scheduler's vectors are the Target's lanes times its unroll (LLVM splits them into
    # registers): under a 4-lane description they read <16 x float>
    lanes = host_info().simd_lanes_f32
    widths = {int(n) for n in re.findall(r"<(\d+) x float>", text)}
    assert any(n % lanes == 0 for n in widths), (lanes, widths)
    assert "call float @" not in text.replace("@llvm.", "")


# ---- errors ---------------------------------------------------------------------------------------

def test_compile_error_carries_kernel_and_ir():
    t = get_target(host_info())
    with pytest.raises(CompileError) as e:
        t.compile_ir("define void @f() {\n  ret i32 0\n}\n", "f", "kernel f(...)")
    assert "kernel f(...)" in str(e.value) and "ret i32 0" in str(e.value)
    assert e.value.backend == "llvm"


def test_bad_kernel_is_compile_error(be):
    bad = K.KExpr("add", F32, (K.const(1.0, F32), K.const(1, I32)))  # mixed types
    with pytest.raises(CompileError) as e:
        be.compile_kernel(kernel([], [F32], (3,), [bad]))
    assert "kernel test" in str(e.value)


def test_buffer_checks(be):
    k = kernel([(F32, 10)], [F32], (10,), [K.unary("neg", K.load(0, K.idx(0), F32))])
    ck = be.compile_kernel(k)
    x = np.arange(10, dtype=np.float32)
    x.flags.writeable = False  # read-only inputs take the checked path
    y = np.zeros(10, np.float32)
    ck([x, y])
    np.testing.assert_array_equal(y, -x)
    with pytest.raises(DeviceError, match="needs 40 contiguous bytes"):
        ck([x, np.zeros(5, np.float32)])
    with pytest.raises(DeviceError, match="not contiguous"):
        ck([np.zeros(20, np.float32)[::2], y])
    with pytest.raises(DeviceError, match="takes 2 buffers"):
        ck([x])


def test_threads_survive_fork(be):
    """A forked child has none of the parent's worker threads; the pool starts new ones."""
    import os
    if host_info().compute_units < 2:
        pytest.skip("one core (the hardware description): no worker threads to lose")
    n = 1 << 18
    k = kernel([(F32, n)], [F32], (n,), [K.unary("exp", K.load(0, K.idx(0), F32))])
    ck = be.compile_kernel(k)
    x = rand(n)
    y = np.zeros(n, np.float32)
    ck([x, y])  # starts the workers here
    assert ck.threads > 1
    pid = os.fork()
    if pid == 0:  # the child: a deadlock would hang the test, a wrong result exits 1
        z = np.zeros(n, np.float32)
        ck([x, z])
        os._exit(0 if np.array_equal(z, y) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 5, 3), (33, 64, 130)])
def test_matmul_as_reduction(be, m, k, n):
    """out[i, j] = Σ_r a[i, r]·b[r, j] (the plain GEMM a lowering may emit): interchanged loops."""
    a, b = rand((m, k)), rand((k, n), seed=1)
    va = K.load(0, K.affine([k, 0], reduce_strides=[1]), F32)
    vb = K.load(1, K.affine([0, 1], reduce_strides=[n]), F32)
    kern = kernel([(F32, a.size), (F32, b.size)], [F32], (m, n), [K.reduce("sum", K.binary("mul", va, vb))],
                  reduce_shape=(k,))
    (y,) = run(be, kern, a, b)
    np.testing.assert_allclose(y.reshape(m, n), a @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_float_rem_and_pow(be, dtype):
    """rem is C's fmod (the dividend's sign); float64 pow and rem call libm."""
    a = np.array([5.5, -5.5, 5.5, -5.5, 0.0, 3.0, 2.0, 0.5], dtype)
    b = np.array([2.0, 2.0, -2.0, -2.0, 1.0, 0.0, 10.0, -3.0], dtype)
    with np.errstate(all="ignore"):
        for op, ref in (("rem", np.fmod(a, b)), ("pow", np.power(a, b))):
            (y,) = run(be, _binop_kernel(op, dtype, a.size), a, b)
            np.testing.assert_allclose(y, ref, rtol=1e-6, equal_nan=True, err_msg=op)
