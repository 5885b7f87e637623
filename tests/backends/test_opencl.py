"""The OpenCL backend on hand-built kernels, against numpy (the primitive table's oracle).

Skips, with the reason, where no OpenCL platform is present. Several checks share one kernel
(one store per op) because every kernel is a program build (0.5 s or more cold on PoCL)."""
from __future__ import annotations

import dataclasses
import re
import sys

import ml_dtypes
import numpy as np
import pytest

from tilefuse.ir.core import ShapedArray
from tilefuse.ir.errors import CompileError, DeviceError
from tilefuse.ir.kernel import ir as K
from tilefuse.ir.primitives import PRIMITIVES
from tilefuse.ir.kernel.ir import Buffer, Kernel, Store

from conftest import assert_close

F32, F16, F64 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)
BF16, I32, I64, U32, BOOL = np.dtype(ml_dtypes.bfloat16), np.dtype(np.int32), np.dtype(np.int64), \
    np.dtype(np.uint32), np.dtype(np.bool_)


@pytest.fixture(scope="module")
def be():
    """An OpenCL backend of the module's own. At the end: every program it built on PoCL was
    built with the declarations of its builtins alone (backends/opencl/prelude.py), not opencl-c.h."""
    from tilefuse.backends.opencl import create
    backend = create()
    try:
        backend.discover()
    except DeviceError as e:
        pytest.skip(f"no OpenCL device: {e}")
    yield backend
    assert not backend.programs.header_builds, \
        f"PoCL built {backend.programs.header_builds} only with opencl-c.h: prelude.py lacks a builtin"


DEV = 0


def run(be, k: Kernel, *inputs, init=None):
    """Run kernel k on inputs (flat numpy arrays); outputs start zeroed (or from `init`)."""
    bufs = [be.put(np.ascontiguousarray(x).reshape(-1), DEV) for x in inputs]
    outs = []
    for j, b in enumerate(k.buffers[k.n_inputs:]):
        start = init[j] if init is not None else np.zeros(b.size, b.dtype)
        outs.append(be.put(np.asarray(start, b.dtype).reshape(-1), DEV))
    ck = be.compile_kernel(k, DEV)
    ck(bufs + outs)
    return [be.to_host(o, ShapedArray((b.size,), np.dtype(b.dtype)), DEV)
            for o, b in zip(outs, k.buffers[k.n_inputs:])]


def strides(shape):
    return [int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]


def ld(buf, dtype, offset):
    """A load, widened to float32 for 16-bit floats as the lowering does."""
    x = K.load(buf, offset, dtype)
    return K.cast(x, F32) if np.dtype(dtype) in (F16, BF16) else x


def elementwise(name, in_dtypes, shape, values, out_dtypes):
    """A kernel over `shape` reading contiguous inputs and writing one output per value;
    `values(loads)` gives the output expressions."""
    n = int(np.prod(shape, dtype=np.int64))
    off = K.affine(strides(shape))
    loads = [ld(i, d, off) for i, d in enumerate(in_dtypes)]
    vals = values(*loads)
    bufs = [Buffer(f"x{i}", np.dtype(d), n) for i, d in enumerate(in_dtypes)]
    bufs += [Buffer(f"y{j}", np.dtype(d), n) for j, d in enumerate(out_dtypes)]
    stores = tuple(Store(len(in_dtypes) + j, off, K.cast(v, d))
                   for j, (v, d) in enumerate(zip(vals, out_dtypes)))
    return Kernel(name, tuple(bufs), len(in_dtypes), tuple(shape), (), stores)


def check(what, actual, expected):
    try:
        assert_close(actual, expected)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


def oracle(prim, *xs, **params):
    return PRIMITIVES[prim].impl(*xs, **params)[0]


# ---- elementwise ---------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 7, 1023])
def test_chain_sizes(be, n, rng):
    x = rng.standard_normal(n).astype(F32)
    k = elementwise(f"chain{n}", [F32], (n,), lambda x: [
        K.unary("tanh", x * 1.7 + 0.3) * K.unary("logistic", x) +
        K.unary("exp", K.unary("neg", x) * x) * 0.5], [F32])
    (y,) = run(be, k, x)
    expect = np.tanh(x * 1.7 + 0.3) * oracle("logistic", x) + np.exp(-x * x) * 0.5
    assert_close(y, expect)


FLOAT_UNARY = ["neg", "exp", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "sin", "cos",
               "erf", "abs", "sign", "floor", "ceil", "round"]


def test_float_unary_table(be, rng):
    x = (rng.standard_normal(1023) * 3).astype(F32)
    x[:8] = [0.5, 1.5, 2.5, -0.5, -2.5, 0.0, np.nan, np.inf]  # round half to even, NaN, inf
    pos = np.abs(x) + 0.1
    k = elementwise("funary", [F32, F32], (1023,),
                    lambda x, p: [K.unary(op, p if op in ("log", "sqrt", "rsqrt", "log1p") else x)
                                  for op in FLOAT_UNARY] + [K.unary("is_finite", x, BOOL)],
                    [F32] * len(FLOAT_UNARY) + [BOOL])
    outs = run(be, k, x, pos)
    with np.errstate(all="ignore"):
        for op, y in zip(FLOAT_UNARY, outs):
            arg = pos if op in ("log", "sqrt", "rsqrt", "log1p") else x
            check(op, y, oracle(op, arg))
    np.testing.assert_array_equal(outs[-1], np.isfinite(x))


def test_float_binary_nan_semantics(be, rng):
    a = rng.standard_normal(1023).astype(F32)
    b = rng.standard_normal(1023).astype(F32)
    a[:4] = [np.nan, 1.0, np.nan, -np.inf]
    b[:4] = [1.0, np.nan, np.nan, 2.0]
    b[10:20] = np.abs(b[10:20]) + 0.5
    ops = ["add", "sub", "mul", "div", "rem", "max", "min", "lt", "le", "eq", "ne", "gt", "ge"]
    k = elementwise("fbinary", [F32, F32], (1023,),
                    lambda x, y: [K.binary(op, x, y) for op in ops] +
                    [K.binary("pow", K.unary("abs", x), y),
                     K.select(K.binary("gt", x, y), x, y)],
                    [F32] * 7 + [BOOL] * 6 + [F32, F32])
    outs = run(be, k, a, b)
    with np.errstate(all="ignore"):
        for op, y in zip(ops, outs):
            check(op, y, oracle(op, a, b))
        assert_close(outs[-2], np.power(np.abs(a), b))
    assert_close(outs[-1], np.where(a > b, a, b))
    assert np.isnan(outs[5][:3]).all() and np.isnan(outs[6][:3]).all()  # max/min keep NaN


def test_broadcast_transpose_strided(be, rng):
    m, n = 5, 37
    a = rng.standard_normal((m, n)).astype(F32)
    row = rng.standard_normal(n).astype(F32)
    col = rng.standard_normal(m).astype(F32)
    at = rng.standard_normal((n, m)).astype(F32)   # read transposed
    big = rng.standard_normal((2 * m + 1, 3 * n)).astype(F32)  # read big[2i+1, 3j]
    val = (K.load(0, K.affine([n, 1]), F32) + K.load(1, K.affine([0, 1]), F32)) * \
        K.load(2, K.affine([1, 0]), F32) + K.load(3, K.affine([1, m]), F32) + \
        K.load(4, K.affine([2 * 3 * n, 3], base=3 * n), F32)
    k = Kernel("maps", (Buffer("a", F32, m * n), Buffer("row", F32, n), Buffer("col", F32, m),
                        Buffer("at", F32, n * m), Buffer("big", F32, big.size), Buffer("y", F32, m * n)),
               5, (m, n), (), (Store(5, K.affine([n, 1]), val),))
    (y,) = run(be, k, a, row, col, at, big)
    assert_close(y.reshape(m, n), (a + row) * col[:, None] + at.T + big[1::2, ::3])


def test_transposed_output_and_gather(be, rng):
    m, n = 9, 20
    x = rng.standard_normal((m, n)).astype(F32)
    idx = rng.integers(-3, m + 3, size=n).astype(I32)
    # out[j, i] = x[clip(idx[j]), i]... written transposed: y[i, j] (a scatter of lanes)
    gi = K.cast(K.load(1, K.idx(1), I32), I64)
    gi = K.binary("max", K.binary("min", gi, K.const(m - 1, I64)), K.const(0, I64))
    val = K.load(0, gi * n + K.idx(0), F32)
    k = Kernel("gatherT", (Buffer("x", F32, m * n), Buffer("idx", I32, n), Buffer("y", F32, n * m)),
               2, (m, n), (), (Store(2, K.affine([1, m]), val),))
    (y,) = run(be, k, x, idx)
    expect = np.take(x, idx, axis=0, mode="clip")[:, :m]  # [j, i] = x[clip(idx[j]), i]
    assert_close(y.reshape(n, m), expect)


# ---- reductions ----------------------------------------------------------------------------

def reduce_kernel(name, shape, axes, op, dtype=F32, out_dtype=None):
    """out[kept] = op over `axes` of x (contiguous, shape `shape`)."""
    keep = [a for a in range(len(shape)) if a not in axes]
    st = strides(shape)
    off = K.affine([st[a] for a in keep], reduce_strides=[st[a] for a in axes])
    x = ld(0, dtype, off)
    if op in ("argmax", "argmin"):
        r = K.reduce(op, x, K.ridx(0))
        val = K.cast(r, out_dtype or I32)
    else:
        val = K.reduce(op, x)
        val = K.cast(val, dtype)
    oshape = [shape[a] for a in keep]
    n_out = int(np.prod(oshape, dtype=np.int64))
    odt = out_dtype or (I32 if op in ("argmax", "argmin") else dtype)
    return Kernel(name, (Buffer("x", dtype, int(np.prod(shape))), Buffer("y", odt, n_out)), 1,
                  tuple(oshape), tuple(shape[a] for a in axes),
                  (Store(1, K.affine(strides(oshape)), val),))


@pytest.mark.parametrize("shape,axes", [((7, 1023), (1,)), ((1023, 7), (0,)), ((100, 37), (0,)),
                                        ((3, 4, 50), (0, 2)), ((1,), (0,)), ((5, 0), (1,))])
def test_sum_axes(be, rng, shape, axes):
    x = rng.standard_normal(shape).astype(F32)
    k = reduce_kernel(f"sum{len(shape)}_{'_'.join(map(str, shape))}", shape, axes, "sum")
    (y,) = run(be, k, x)
    assert_close(y, x.sum(axis=axes).reshape(-1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("op", ["max", "min", "prod"])
def test_max_min_prod_with_nan(be, rng, op):
    x = rng.uniform(0.5, 1.5, (6, 40)).astype(F32)
    x[2, 17] = np.nan
    x[4, 0] = np.nan
    k = reduce_kernel(f"r{op}", (6, 40), (1,), op)
    (y,) = run(be, k, x)
    assert_close(y, oracle(f"reduce_{op}", x, axes=(1,)), rtol=1e-5)
    assert np.isnan(y[2]) and np.isnan(y[4])


@pytest.mark.parametrize("op", ["argmax", "argmin"])
@pytest.mark.parametrize("shape", [(5, 1023), (9, 3)])
def test_argmax_ties_and_nan(be, rng, op, shape):
    x = rng.integers(-3, 4, shape).astype(F32)  # many ties: the first index must win
    x[1, shape[1] // 2] = np.nan
    x[1, shape[1] - 1] = np.nan
    k = reduce_kernel(f"{op}_{shape[1]}", shape, (1,), op)
    (y,) = run(be, k, x)
    np.testing.assert_array_equal(y, oracle(op, x, axis=1, index_dtype=I32))


def test_argmax_outer_axis_int(be, rng):
    x = rng.integers(-5, 5, (50, 24)).astype(I32)
    k = reduce_kernel("argmax_outer", (50, 24), (0,), "argmax", I32)
    (y,) = run(be, k, x)
    np.testing.assert_array_equal(y, np.argmax(x, axis=0))


@pytest.mark.parametrize("op", ["sum", "max", "argmax", "argmin"])
def test_gpu_layout_of_reductions(be, rng, op, monkeypatch):
    """The GPU layout (work-groups of many work-items, a point each), forced on any device: it
    must agree with numpy, including ties (first index) and NaN."""
    shape = (3, 2100)
    x = rng.integers(-4, 5, shape).astype(F32)
    x[1, 1500] = np.nan
    x[1, 700] = np.nan
    k = reduce_kernel(f"gpu_{op}", shape, (1,), op)
    st = be._state(DEV)
    monkeypatch.setitem(st.info.extra, "device_type", "gpu")
    ck = be.compile_kernel(k, DEV)
    sched = ck.kernel.meta["schedule"]
    assert sched.group > 1 and sched.lanes == 1, sched
    monkeypatch.setattr(be, "compile_kernel", lambda kernel, device, sched=None: ck)
    (y,) = run(be, k, x)
    if op in ("argmax", "argmin"):
        np.testing.assert_array_equal(y, oracle(op, x, axis=1, index_dtype=I32))
    else:
        assert_close(y, oracle(f"reduce_{op}", x, axes=(1,)), rtol=1e-6)


def test_softmax_rows_two_reductions(be, rng):
    """A row max and a row sum of exp in one kernel (two reduce nodes, one loop nest)."""
    r, n = 6, 300
    x = rng.standard_normal((r, n)).astype(F32) * 4
    xv = K.load(0, K.affine([n], reduce_strides=[1]), F32)
    mx = K.reduce("max", xv)
    s = K.reduce("sum", K.unary("exp", xv))
    k = Kernel("rowstats", (Buffer("x", F32, r * n), Buffer("m", F32, r), Buffer("s", F32, r)), 1,
               (r,), (n,), (Store(1, K.idx(0), mx),
                            Store(2, K.idx(0), K.binary("sub", K.unary("log", s), mx))))
    m, ls = run(be, k, x)
    assert_close(m, x.max(1))
    assert_close(ls, np.log(np.exp(x).sum(1)) - x.max(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(6, 300), (5, 3, 17)])
def test_softmax_one_row_kernel(be, rng, shape):
    """Softmax as one row kernel: a max, a sum that reads it (two reduction levels, each a pass
    over the row, vectorised with a scalar tail), the log-sum-exp per row and the normalised row
    by a row store (a third pass)."""
    x = rng.standard_normal(shape).astype(F32) * 4
    r, row = shape[0], shape[1:]
    n = int(np.prod(row))
    xv = K.load(0, K.affine([n], reduce_strides=strides(row)), F32)
    m = K.reduce("max", xv)
    e = K.unary("exp", K.binary("sub", xv, m))
    s = K.reduce("sum", e)
    k = Kernel("softmax", (Buffer("x", F32, x.size), Buffer("lse", F32, r), Buffer("y", F32, x.size)),
               1, (r,), row, (Store(1, K.idx(0), K.binary("add", K.unary("log", s), m)),
                              Store(2, K.affine([n], reduce_strides=strides(row)), K.binary("div", e, s))))
    lse, y = run(be, k, x)
    x2 = x.reshape(r, n)
    ref = np.exp(x2 - x2.max(1, keepdims=True))
    assert_close(y.reshape(r, n), ref / ref.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
    assert_close(lse, np.log(np.exp(x2).sum(1)), rtol=1e-5, atol=1e-6)


# ---- dtypes and casts ----------------------------------------------------------------------

def test_half_and_bfloat16(be, rng):
    n = 1023
    xh = (rng.standard_normal(n) * 10).astype(F16)
    xb = (rng.standard_normal(n) * 10).astype(BF16)
    xf = (rng.standard_normal(n) * 100).astype(F32)
    k = elementwise("narrow", [F16, BF16, F32], (n,), lambda h, b, f: [
        h * 1.5 + 0.25, b * b, f, f, K.cast(K.cast(f, F16), F32) * 3.0, K.cast(K.cast(f, BF16), F32)],
        [F16, BF16, F16, BF16, F32, F32])
    y = run(be, k, xh, xb, xf)
    f32 = lambda a: a.astype(F32)  # noqa: E731
    np.testing.assert_array_equal(f32(y[0]), f32((f32(xh) * np.float32(1.5) + np.float32(0.25)).astype(F16)))
    np.testing.assert_array_equal(f32(y[1]), f32((f32(xb) * f32(xb)).astype(BF16)))
    np.testing.assert_array_equal(f32(y[2]), f32(xf.astype(F16)))  # round to nearest even
    np.testing.assert_array_equal(f32(y[3]), f32(xf.astype(BF16)))
    np.testing.assert_array_equal(y[4], f32(xf.astype(F16)) * np.float32(3))
    np.testing.assert_array_equal(y[5], f32(xf.astype(BF16)))


def test_casts(be, rng):
    edge = [-2.7, -0.5, 0.0, 0.5, 2.7, 3.5, -3.5, 1e9]
    x = np.concatenate([edge, rng.standard_normal(100) * 50]).astype(F32)
    k = elementwise("casts", [F32], (x.size,), lambda x: [
        K.cast(x, I32), K.cast(x, I64), K.cast(x, BOOL), K.cast(K.cast(x, I32), F32),
        K.cast(K.cast(x, BOOL), F32), K.cast(K.cast(x, I64), U32)], [I32, I64, BOOL, F32, F32, U32])
    y = run(be, k, x)
    conv = lambda a, d: oracle("convert_element_type", a, new_dtype=d)  # noqa: E731
    np.testing.assert_array_equal(y[0], conv(x, I32))   # truncation toward zero
    np.testing.assert_array_equal(y[1], conv(x, I64))
    np.testing.assert_array_equal(y[2], x != 0)
    np.testing.assert_array_equal(y[3], conv(x, I32).astype(F32))
    np.testing.assert_array_equal(y[4], (x != 0).astype(F32))
    np.testing.assert_array_equal(y[5], conv(x, I64).astype(U32))


def test_float64(be, rng):
    if not be._state(DEV).info.extra["fp64"]:
        with pytest.raises(CompileError, match="float64"):
            be.compile_kernel(elementwise("f64", [F64], (8,), lambda x: [x * 2.0], [F64]), DEV)
        return
    x = rng.standard_normal(513)
    k = elementwise("f64", [F64, F32], (513,), lambda x, f: [K.unary("exp", x) * 1.0000000001, K.cast(f, F64),
                                                             K.cast(x, F16)], [F64, F64, F16])
    xf = rng.standard_normal(513).astype(F32)
    y = run(be, k, x, xf)
    assert_close(y[0], np.exp(x) * 1.0000000001)
    np.testing.assert_array_equal(y[1], xf.astype(F64))
    np.testing.assert_array_equal(y[2], x.astype(F16))


@pytest.mark.parametrize("dtype", [I32, I64])
def test_int_ops(be, rng, dtype):
    n = 1023
    a = rng.integers(-1000, 1000, n).astype(dtype)
    b = rng.integers(-20, 20, n).astype(dtype)
    b[:3] = [0, -1, 7]
    a[:3] = [5, np.iinfo(dtype).min, -9]
    sh = rng.integers(0, 40 if dtype == I32 else 70, n).astype(dtype)
    ops = ["add", "sub", "mul", "div", "rem", "max", "min", "and", "or", "xor"]
    k = elementwise(f"int_{dtype}", [dtype, dtype, dtype], (n,), lambda x, y, s: [
        K.binary(op, x, y) for op in ops] + [
        K.binary("shift_left", x, s), K.binary("shift_right_logical", x, s),
        K.unary("abs", x), K.unary("sign", y), K.unary("neg", x), K.unary("not", x),
        K.binary("lt", x, y), K.binary("eq", y, K.const(0, dtype))],
        [dtype] * (len(ops) + 6) + [BOOL, BOOL])
    outs = run(be, k, a, b, sh)
    with np.errstate(all="ignore"):
        for op, y in zip(ops, outs):
            np.testing.assert_array_equal(y, oracle(op, a, b), err_msg=op)
        np.testing.assert_array_equal(outs[10], oracle("shift_left", a, sh))
        np.testing.assert_array_equal(outs[11], oracle("shift_right_logical", a, sh))
        for op, arg, y in zip(["abs", "sign", "neg", "not"], [a, b, a, a], outs[12:16]):
            np.testing.assert_array_equal(y, oracle(op, arg), err_msg=op)
    np.testing.assert_array_equal(outs[16], a < b)
    np.testing.assert_array_equal(outs[17], b == 0)


def test_bool_and_uint(be, rng):
    n = 77
    p = rng.integers(0, 2, n).astype(BOOL)
    q = rng.integers(0, 2, n).astype(BOOL)
    u = rng.integers(0, 2**32, n, dtype=np.uint64).astype(U32)
    v = rng.integers(1, 1000, n).astype(U32)
    k = elementwise("bools", [BOOL, BOOL, U32, U32], (n,), lambda p, q, u, v: [
        K.binary("add", p, q), K.binary("mul", p, q), K.binary("xor", p, q), K.unary("not", p),
        K.select(p, u, v), K.binary("div", u, v), K.binary("rem", u, v), K.binary("gt", u, v)],
        [BOOL] * 4 + [U32] * 3 + [BOOL])
    y = run(be, k, p, q, u, v)
    np.testing.assert_array_equal(y[0], p | q)
    np.testing.assert_array_equal(y[1], p & q)
    np.testing.assert_array_equal(y[2], p ^ q)
    np.testing.assert_array_equal(y[3], ~p)
    np.testing.assert_array_equal(y[4], np.where(p, u, v))
    np.testing.assert_array_equal(y[5], u // v)
    np.testing.assert_array_equal(y[6], u % v)
    np.testing.assert_array_equal(y[7], u > v)


# ---- "add" stores ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, I32, I64, F16, F64])
def test_scatter_add(be, rng, dtype):
    if dtype == F64 and not be._state(DEV).info.extra["fp64"]:
        pytest.skip("the device has no float64")
    rows, n, m = 10, 300, 4
    idx = rng.integers(0, rows, n).astype(I32)  # many duplicates: concurrent adds must not race
    upd = rng.integers(-4, 5, (n, m)).astype(dtype)
    base = rng.integers(-4, 5, (rows, m)).astype(dtype)
    tgt = K.cast(K.load(0, K.idx(0), I32), I64) * m + K.idx(1)
    val = ld(1, dtype, K.affine([m, 1]))
    k = Kernel(f"scatter_{dtype}",
               (Buffer("idx", I32, n), Buffer("upd", dtype, n * m), Buffer("out", dtype, rows * m)),
               2, (n, m), (), (Store(2, tgt, K.cast(val, dtype), "add"),))
    (y,) = run(be, k, idx, upd, init=[base.reshape(-1)])
    expect = oracle("scatter_add", base, idx, upd, axis=0)
    np.testing.assert_array_equal(y.reshape(rows, m).astype(F64), expect.astype(F64))
    sched = be.compile_kernel(k, DEV).kernel.meta["schedule"]
    # the columns own their adds on CPU devices (atomics there are contended CAS loops); where
    # an atomic add lacks (float16) one work-item adds them all
    cpu = be._state(DEV).info.extra["device_type"] == "cpu"
    assert (sched.owner, sched.serial) == ((True, False) if cpu else (False, dtype == F16)), sched


def _embedding_grad(rows, n, m):
    """out[idx[t], j] += upd[t, j]: an embedding's gradient, owned along j (Kernel.owner_axis)."""
    tgt = K.cast(K.load(0, K.idx(0), I32), I64) * m + K.idx(1)
    return Kernel("embedding_grad", (Buffer("idx", I32, n), Buffer("upd", F32, n * m), Buffer("out", F32, rows * m)),
                  2, (n, m), (), (Store(2, tgt, ld(1, F32, K.affine([m, 1])), "add"),))


def test_scatter_add_owned_by_a_column_per_work_item(be, rng, monkeypatch):
    """On CPU devices an owner axis replaces the compare-and-swap float adds (and, with
    tx.config.deterministic, on any device): every element's adds run in order, as np.add.at's
    do, so the sums are bitwise numpy's."""
    from tilefuse.runtime.config import config
    rows, n, m = 7, 500, 67  # blocks of columns per work-item, the last one short
    idx = rng.integers(0, rows, n).astype(I32)
    upd = rng.standard_normal((n, m)).astype(F32)
    k = _embedding_grad(rows, n, m)
    assert k.owner_axis == 1
    want = np.zeros((rows, m), F32)
    np.add.at(want, idx, upd)
    cpu = be._state(DEV).info.extra["device_type"] == "cpu"
    assert be.compile_kernel(k, DEV).kernel.meta["schedule"].owner == cpu
    (y,) = run(be, k, idx, upd)
    if cpu:
        np.testing.assert_array_equal(y.reshape(rows, m), want)
    else:
        np.testing.assert_allclose(y.reshape(rows, m), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(config, "deterministic", True)
    k = dataclasses.replace(k, name="embedding_grad_in_order")
    assert be.compile_kernel(k, DEV).kernel.meta["schedule"].owner
    (y,) = run(be, k, idx, upd)
    np.testing.assert_array_equal(y.reshape(rows, m), want)


# ---- errors, memory, profiling -------------------------------------------------------------

def test_build_failure_raises_compile_error_with_log(be, monkeypatch):
    from tilefuse.backends import opencl
    real = opencl.print_tile

    def broken(k, *a):
        r = real(k, *a)
        return dataclasses.replace(r, source=r.source.replace("{", "{ this_is_not_c;", 1))
    monkeypatch.setattr(opencl, "print_tile", broken)
    k = elementwise("broken", [F32], (8,), lambda x: [x + 1.0], [F32])
    with pytest.raises(CompileError) as info:
        be.compile_kernel(k, DEV)
    msg = str(info.value)
    assert "this_is_not_c" in info.value.source and "build log" in msg
    assert "undeclared identifier" in msg or "error" in msg.lower()


def test_missing_icd_message(monkeypatch):
    import pyopencl as cl

    from tilefuse.backends.opencl import create

    def no_platform():
        raise cl.LogicError("clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")
    monkeypatch.setattr(cl, "get_platforms", no_platform)
    with pytest.raises(DeviceError, match="pocl-opencl-icd"):
        create().discover()
    monkeypatch.setattr(cl, "get_platforms", lambda: [])
    with pytest.raises(DeviceError, match="install an OpenCL driver"):
        create().discover()
    monkeypatch.setitem(sys.modules, "pyopencl", None)  # pyopencl not installed
    with pytest.raises(DeviceError, match="pip install pyopencl"):
        create().discover()


def test_device_info_from_the_device(be):
    info = be._state(DEV).info
    assert info.kind == "opencl" and info.compute_units >= 1 and info.max_work_group >= 1
    assert info.global_mem_bytes > 0 and info.local_mem_bytes > 0
    assert info.extra["preferred_width"]["float"] >= 1 and info.extra["buffer_align"] >= 1


def test_zero_copy_read_views_and_memory_stats(be, rng):
    st = be._state(DEV)
    before = be.memory_stats(DEV)
    x = rng.standard_normal((3, 5)).astype(F32)
    buf = be.put(x, DEV)
    assert be.memory_stats(DEV)["bytes_in_use"] == before["bytes_in_use"] + x.nbytes
    a = be.to_host(buf, ShapedArray((3, 5), F32), DEV)
    np.testing.assert_array_equal(a, x)
    assert not a.flags.writeable
    if st.host_memory:  # a mapped view: two reads see the same memory, nothing copied
        b = be.to_host(buf, ShapedArray((3, 5), F32), DEV)
        assert a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    del a
    be.free(buf, DEV)
    after = be.memory_stats(DEV)
    assert after["bytes_in_use"] == before["bytes_in_use"] and after["frees"] == before["frees"] + 1


def test_views_and_profiling_events(be, rng):
    align = be._state(DEV).info.extra["buffer_align"]
    arena = be.alloc(4 * align, DEV)
    x = rng.standard_normal(16).astype(F32)
    src = be.view(arena, 0, x.nbytes)
    dst = be.view(arena, 2 * align, x.nbytes)
    st = be._state(DEV)
    import pyopencl as cl
    cl.enqueue_copy(st.queue, src.mem, x, is_blocking=True)
    k = elementwise("twice", [F32], (16,), lambda x: [x * 2.0], [F32])
    ck = be.compile_kernel(k, DEV)
    ev = ck([src, dst])
    whole = be.to_host(arena, ShapedArray((align,), F32), DEV)
    np.testing.assert_array_equal(whole[2 * align // 4:2 * align // 4 + 16], x * 2)
    start, end = ck.times()
    assert 0 < start <= end and be.last_event(DEV) is ev
    # a view the device cannot make (misaligned) is a block of its own: still correct, counted
    n = be.memory_stats(DEV)["unaligned_views"]
    odd = be.view(arena, 4, x.nbytes)
    ck([src, odd])
    np.testing.assert_array_equal(be.to_host(odd, ShapedArray((16,), F32), DEV), x * 2)
    assert be.memory_stats(DEV)["unaligned_views"] == n + 1


def test_out_of_memory(be):
    from tilefuse.ir.errors import OutOfMemoryError
    with pytest.raises(OutOfMemoryError):
        be.alloc(1 << 62, DEV)


# ---- through jit, once the pipeline exists ---------------------------------------------------

def test_jit_on_opencl(be, rng):
    pytest.importorskip("tilefuse.runtime.compiler", reason="runtime/compiler.py not there yet")
    import tilefuse as tx
    import tilefuse.numpy as tnp

    dev = tx.get_device("opencl")
    x = rng.standard_normal((8, 33)).astype(F32)
    f = tx.jit(lambda x: tnp.tanh(x * 1.7 + 0.3) * tnp.exp(-x * x) + tnp.sum(x, axis=1, keepdims=True),
               device="opencl")
    assert_close(np.asarray(f(x)), np.tanh(x * 1.7 + 0.3) * np.exp(-x * x) + x.sum(1, keepdims=True),
                 rtol=1e-5, atol=1e-5)
    g = tx.jit(lambda x: tnp.argmax(x, axis=1), device="opencl")
    np.testing.assert_array_equal(np.asarray(g(x)), np.argmax(x, axis=1))

    def softmax(x):
        e = tnp.exp(x - tnp.max(x, axis=-1, keepdims=True))
        return e / tnp.sum(e, axis=-1, keepdims=True)
    xd = tx.device_put(x, dev)
    y = tx.jit(softmax)(xd)  # runs where its argument lives
    assert y.device is dev
    e = np.exp(x - x.max(-1, keepdims=True))
    assert_close(np.asarray(y), e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)

    table = rng.standard_normal((10, 4)).astype(F32)
    ids = np.array([[1, 9, 1], [0, 3, 3]], np.int32)
    emb = tx.jit(lambda t, i: tx.nn.embedding(t, i) * 2.0, device="opencl")
    assert_close(np.asarray(emb(table, ids)), table[ids] * 2)
    grad = tx.jit(tx.grad(lambda t: tnp.sum(tx.nn.embedding(t, ids) ** 2)), device="opencl")
    expect = np.zeros_like(table)
    np.add.at(expect, ids.reshape(-1), 2 * table[ids.reshape(-1)])
    assert_close(np.asarray(grad(table)), expect, rtol=1e-5, atol=1e-6)

    h = tx.jit(lambda a: (a.astype(tnp.float16) * 3).astype(tnp.float32), device="opencl")
    assert_close(np.asarray(h(x)), (x.astype(F16) * np.float16(3)).astype(F32), dtype=F16)


def test_launch_failures_become_tilefuse_errors(be, monkeypatch):
    import pyopencl as cl

    from tilefuse.ir.errors import OutOfMemoryError

    def failing(code):
        class Failure(cl.RuntimeError):
            pass
        Failure.code = property(lambda self: code)

        def enqueue(*a, **kw):
            raise Failure("clEnqueueNDRangeKernel failed")
        return enqueue
    k = elementwise("launchfail", [F32], (8,), lambda x: [x + 1.0], [F32])
    ck = be.compile_kernel(k, DEV)
    bufs = [be.alloc(32, DEV), be.alloc(32, DEV)]
    monkeypatch.setattr(cl, "enqueue_nd_range_kernel", failing(cl.status_code.OUT_OF_RESOURCES))
    with pytest.raises(DeviceError, match="OUT_OF_RESOURCES"):
        ck(bufs)
    monkeypatch.setattr(cl, "enqueue_nd_range_kernel", failing(cl.status_code.MEM_OBJECT_ALLOCATION_FAILURE))
    with pytest.raises(OutOfMemoryError, match="MEM_OBJECT_ALLOCATION_FAILURE"):
        ck(bufs)


def test_compile_kernels_builds_a_batch_once(be, rng, monkeypatch):
    from tilefuse.backends import opencl
    ks = [elementwise("same_name", [F32], (50,), lambda x, c=c: [x * float(c)], [F32]) for c in (3, 5)]
    ks.append(reduce_kernel("batched_sum", (4, 50), (1,), "sum"))
    builds = be.programs.builds
    cks = be.compile_kernels(ks + ks[:1], DEV)
    assert be.programs.builds == builds + 1 and cks[0]._knl is cks[3]._knl
    x = rng.standard_normal(200).astype(F32)
    for k, c in zip(ks[:2], (3, 5)):
        assert_close(run(be, k, x[:50])[0], x[:50] * c)
    assert_close(run(be, ks[2], x)[0], x.reshape(4, 50).sum(1), rtol=1e-5, atol=1e-5)

    real = opencl.print_tile

    def broken(k, *a):
        r = real(k, *a)
        return dataclasses.replace(r, source=r.source.replace("{", "{ oops;", 1)) if k.name == "bad" else r
    monkeypatch.setattr(opencl, "print_tile", broken)
    good = elementwise("good_one", [F32], (9,), lambda x: [x * 4.0], [F32])
    bad = elementwise("bad", [F32], (9,), lambda x: [x * 6.0], [F32])
    with pytest.raises(CompileError) as info:
        be.compile_kernels([good, bad], DEV)
    assert "tf_bad_" in str(info.value) and "oops" in info.value.source
    assert "good_one" not in info.value.source  # built again alone, to name the culprit



def test_a_program_built_again_loads_from_its_binary(be, tmp_path, monkeypatch):
    """For a driver that does not cache builds itself: the first build of a program leaves a
    marker, the second (another process: a new ProgramCache) keeps its binary, the third builds
    from that binary without the compiler and computes the same; a binary the driver refuses is
    removed and the program built from source. PoCL (which caches itself, and compiles every
    kernel again to give a binary) is asked for none and nothing is stored."""
    import pyopencl as cl
    from tilefuse.backends.opencl import build
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))
    st = be._state(DEV)
    source = "__kernel void f(__global float *a) { size_t i = get_global_id(0); a[i] = a[i] * 3.0f + 1.0f; }"
    sources, binaries = [], []
    real, real_binary = build.ProgramCache._from_source, build._binary

    def counted(*args):
        sources.append(1)
        return real(*args)
    monkeypatch.setattr(build.ProgramCache, "_from_source", counted)
    monkeypatch.setattr(build, "_binary", lambda *a: binaries.append(1) or real_binary(*a))

    def run_f():
        knl = build.ProgramCache().kernel(st.ctx, st.dev, source, "f")
        x = np.arange(16, dtype=F32)
        buf = cl.Buffer(st.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=x)
        knl(st.queue, (16,), None, buf)
        out = np.empty_like(x)
        cl.enqueue_copy(st.queue, out, buf)
        np.testing.assert_array_equal(out, x * 3 + 1)
        where = tmp_path / "opencl"
        return sorted(p.name for p in where.iterdir() if p.name.endswith(".bin")) if where.exists() else []

    if build._is_pocl(st.dev):
        assert run_f() == [] and run_f() == [] and len(sources) == 2 and not binaries
        monkeypatch.setattr(build, "_is_pocl", lambda dev: False)  # as a driver without a cache
        sources.clear()
    assert len(run_f()) == 1 and len(sources) == 1  # the marker only
    entries = run_f()
    assert len(entries) == 2 and len(sources) == 2 and binaries  # and the binary
    assert len(run_f()) == 2 and len(sources) == 2  # from the binary: no compiler
    disk = build.ProgramCache()
    disk._disk = build.compile_cache.CompileCache("opencl", str(tmp_path))
    key = build.compile_cache.make_key("opencl-program", source, build.OPTIONS, build._device_id(st.dev))
    disk._disk.store(key, b"\x7fELF" + bytes(range(256)) * 4)  # checksummed, but not a binary
    assert len(run_f()) == 2 and len(sources) == 3  # refused: built from source (a marker exists)
    assert len(run_f()) == 2 and len(sources) == 3  # its binary kept again

# ---- defined integer overflow; long sums (other vector widths: tests/backends/test_hardware.py) ----

@pytest.mark.parametrize("dtype", [I32, I64])
def test_signed_overflow_wraps(be, dtype):
    """numpy wraps; OpenCL C leaves signed overflow undefined and PoCL folded (x + 1) > x to
    true at INT32_MAX: the renderer computes in unsigned (vector lanes and scalar tail)."""
    info = np.iinfo(dtype)
    x = np.array([info.max, info.min, info.max // 2 + 1, -1, 0, 7] * 3, dtype)
    one = K.const(1, dtype)
    k = elementwise(f"wraps_{dtype}", [dtype], (x.size,), lambda a: [
        K.binary("gt", K.binary("add", a, one), a), K.binary("add", a, one),
        K.binary("sub", K.unary("neg", a), one), K.binary("mul", a, K.const(2, dtype)),
        K.binary("shift_left", a, one)], [BOOL, dtype, dtype, dtype, dtype])
    y = run(be, k, x)
    for got, want in zip(y, [x + dtype.type(1) > x, x + dtype.type(1), -x - dtype.type(1), x * dtype.type(2),
                             x << dtype.type(1)]):
        np.testing.assert_array_equal(got, want)
    s = np.array([[info.max, 1, 2, info.max] * 5] * 2, dtype)  # the sum wraps too
    (total,) = run(be, reduce_kernel(f"wrapping_sum_{dtype}", s.shape, (1,), "sum", dtype), s)
    np.testing.assert_array_equal(total, s.sum(axis=1, dtype=dtype))


@pytest.mark.parametrize("shape,axes", [((2, 300_000), (1,)), ((300_000, 2), (0,))])
def test_long_sums_are_blocked(be, shape, axes):
    """A float sum adds a block of values per accumulator, then flushes it into a total: 3e5
    tenths come within 1e-5 of the exact sum (added in order: 3e-4 off)."""
    x = np.full(shape, 0.1, F32)
    k = reduce_kernel(f"long_sum{axes[0]}", shape, axes, "sum")
    (y,) = run(be, k, x)
    exact = float(np.float32(0.1)) * shape[axes[0]]
    assert np.abs(y.astype(np.float64) / exact - 1).max() < 1e-5


def _signatures(text: str) -> set:
    """`ret name(param types)` of every function declaration in C text: attributes, parameter
    names and spacing dropped."""
    text = re.sub(r"__attribute__\(\(.*?\)\)|\b__(ovld|cnfn|purefn|conv|CL_\w+)\b", " ", text)
    out = set()
    for ret, name, params in re.findall(r"\b(\w+)\s+(\w+)\s*\(([^()]*)\)\s*;", text):
        types = []
        for p in params.split(","):
            toks = re.findall(r"\w+|\*", p)
            if len(toks) > 1 and re.fullmatch(r"[a-z_]\w*", toks[-1]) and toks[-1] not in _C_TYPES:
                toks = toks[:-1]  # a parameter's name
            types.append(" ".join(toks))
        out.add(f"{ret} {name}({', '.join(types)})")
    return out


_C_TYPES = {t + w for t in ("char", "uchar", "short", "ushort", "int", "uint", "long", "ulong", "float", "double",
                            "half") for w in ("", "2", "3", "4", "8", "16")} | {"size_t", "cl_mem_fence_flags", "void"}


def test_pocl_builds_with_declarations_clang_spells_the_same_way():
    """PoCL builds a program with the declarations of the builtins it calls in place of Clang's
    opencl-c.h (backends/opencl/prelude.py): every one of them is declared in that header with
    the same return and parameter types (a wrong return type would link and compute garbage),
    for every builtin the printer may call."""
    import glob

    from tilefuse.backends.opencl.prelude import FLOAT_BINARY, FLOAT_UNARY, WORK_ITEM, with_declarations
    headers = sorted(glob.glob("/usr/share/pocl/include/opencl-c.h") +
                     glob.glob("/usr/lib/llvm-*/lib/clang/*/include/opencl-c.h"))
    if not headers:
        pytest.skip("no opencl-c.h here (PoCL's or Clang's) to compare the declarations with")
    with open(headers[0]) as fh:
        clang = _signatures(fh.read())
    conversions = [f"convert_{t}{w}{s}" for t in ("int", "uchar", "long", "ulong", "float", "double", "char")
                   for w in ("", "4", "16") for s in ("", "_rte", "_sat", "_sat_rtz")]
    calls = sorted(FLOAT_UNARY | FLOAT_BINARY | WORK_ITEM) + conversions + [
        "fma", "min", "max", "abs", "isnan", "isfinite", "select", "barrier", "atomic_add", "atomic_cmpxchg",
        "atom_add", "atom_cmpxchg", "vload4", "vload16", "vstore8", "vstore16", "vload_half", "vload_half4",
        "vstore_half_rte", "vstore_half16_rte"]
    source = "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n" + " ".join(f"{c}(x);" for c in calls)
    ours = _signatures(with_declarations(source).replace(source, ""))
    assert len(ours) > 1000
    missing = sorted(ours - clang)
    assert not missing, f"{len(missing)} declarations not in {headers[0]}: {missing[:10]}"


@pytest.mark.parametrize("mask, user, pinned", [("all", None, "1"), ("one", None, None), ("all", "0", "0")])
def test_pocl_workers_pinned_only_where_the_process_may_use_every_cpu(monkeypatch, mask, user, pinned):
    """PoCL pins worker i to CPU i (not within the process's mask): set only where the mask holds
    every CPU, never over the user's own POCL_AFFINITY."""
    from tilefuse.backends import opencl
    if not hasattr(opencl.os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    n = 4
    monkeypatch.setattr(opencl.os, "cpu_count", lambda: n)
    monkeypatch.setattr(opencl.os, "sched_getaffinity", lambda pid: set(range(n)) if mask == "all" else {2})
    monkeypatch.delenv("POCL_AFFINITY", raising=False)
    if user is not None:
        monkeypatch.setenv("POCL_AFFINITY", user)
    opencl._pin_pocl_workers()
    assert opencl.os.environ.get("POCL_AFFINITY") == pinned


def test_pocl_runs_in_a_process_restricted_to_one_cpu():
    """Under a one-CPU mask (taskset) the driver is left unpinned and computes correctly."""
    import os
    import subprocess
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to restrict the process to one")
    cpu = max(os.sched_getaffinity(0))
    code = (f"import os; os.sched_setaffinity(0, {{{cpu}}})\n"
            "import numpy as np, tilefuse as tx\n"
            "if not tx.devices('opencl'): print('no device'); raise SystemExit\n"
            "a = np.arange(12, dtype=np.float32).reshape(3, 4)\n"
            "print(np.asarray(tx.jit(lambda x: x @ x.T + 1, device='opencl:0')(a)).sum(), "
            "os.environ.get('POCL_AFFINITY'))")
    env = {k: v for k, v in os.environ.items() if k != "POCL_AFFINITY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "no device":
        pytest.skip("no OpenCL device")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert out.stdout.split() == [str(np.float32((a @ a.T + 1).sum())), "None"]
