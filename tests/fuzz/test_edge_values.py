"""Edge values (NaN, ±inf, -0.0, denormals, huge and tiny magnitudes) through every elementwise
primitive and reduction, on every device, against numpy.

Special results must match exactly: NaN where numpy gives NaN, the same infinities, the sign of
zero, denormal results kept (no flush to zero). Finite results of the approximated functions
(the CPU's vector math in backends/llvmir/vecmath.py, OpenCL's built-ins) are bounded in ulps
against the float64 result rounded to float32: ULP_BOUND documents the bound per function; every
other op is exact. One graph per test holds every op, so each device compiles once."""
from __future__ import annotations

import math

import numpy as np
import pytest
from tilefuse.ir import primitives as P
from tilefuse.ir.core import Eqn, Graph, ShapedArray, Var

F32 = np.dtype(np.float32)
TINY = np.finfo(np.float32).tiny  # the least normal
DENORM = np.float32(1e-45)  # the least denormal
BIG = np.finfo(np.float32).max
EDGE = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, DENORM, -DENORM, 3e-39, -3e-39, TINY, -TINY,
                 1e-30, -1e-30, 1e-7, -1e-7, 0.5, -0.5, 1.0, -1.0, 1.5, -2.5, math.pi, 10.0, -10.0,
                 30.0, 88.5, 89.0, -87.0, -104.0, 1e4, -1e4, 1e7, 3e38, -3e38, BIG, -BIG],
                F32)

# the float64 function each float32 op approximates, and its bound in ulps (vecmath's are ≤ 4,
# tests/backends/test_llvm_kernels.py; OpenCL 1.2 allows 3-4 for these and 16 for erf)
MATH = {
    "exp": np.exp, "log": np.log, "log1p": np.log1p, "expm1": np.expm1, "tanh": np.tanh,
    "logistic": lambda x: 1 / (1 + np.exp(-x)), "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x), "sin": np.sin, "cos": np.cos,
    "erf": np.vectorize(math.erf, otypes=[np.float64]),
}
ULP_BOUND = {"exp": 4, "log": 4, "log1p": 4, "expm1": 4, "tanh": 5, "logistic": 5, "sqrt": 0,
             "rsqrt": 2, "sin": 4, "cos": 4, "erf": 16}
# vecmath reduces sin/cos arguments in float64 with pi/2 to 107 bits: within 2 ulp up to |x| ~1e9;
# beyond, the reduction loses the quadrant (sin(3e38) gives 1.0, not 0.875) but stays in [-1, 1]
TRIG_RANGE = 1e9
# WGSL (WebGPU) has no float64 and its drivers may reassociate float arithmetic, so pow is
# exp(y log x) in float32: relative error about 2**-24 |y log x| (77 ulp at 2.5**89); and it
# leaves the sign of a zero sum open (a driver folds 0 + x to x, so -0.0 sums stay -0.0)
POW_ULP = {"webgpu": 128}
SUM_ZERO_SIGN = {"webgpu": False}
EXACT_UNARY = ("neg", "abs", "sign", "floor", "ceil", "round", "is_finite")
BINARY = ("add", "sub", "mul", "div", "rem", "pow", "max", "min", "eq", "ne", "lt", "le", "gt", "ge")
REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin")


def _graph(avals, build):
    invars = tuple(Var(a) for a in avals)
    eqns, outs = [], []

    def emit(name, ins, **params):
        prim = P.PRIMITIVES[name]
        (aval,) = prim.abstract_eval(*[v.aval for v in ins], **params)
        out = Var(aval)
        eqns.append(Eqn(prim, tuple(ins), (out,), params))
        outs.append(out)
    build(emit, *invars)
    return Graph((), invars, tuple(eqns), tuple(outs))


def _ordered(x: np.ndarray) -> np.ndarray:
    """float32 bits as integers in the order of the floats (ulp distance = difference)."""
    i = x.astype(F32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def ulps(got, want) -> np.ndarray:
    return np.abs(_ordered(got) - _ordered(want))


def check_special(got, want, what, zero_sign=True):
    """NaN, infinities and the sign of zero exactly as numpy; finite values compared elsewhere.
    max/min of -0.0 and 0.0 may give either zero (IEEE leaves it open): zero_sign=False."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN")
    inf = np.isinf(want)
    np.testing.assert_array_equal(got[inf], want[inf], err_msg=f"{what}: infinities")
    zero = (want == 0) & zero_sign
    np.testing.assert_array_equal(np.signbit(got[zero]), np.signbit(want[zero]),
                                  err_msg=f"{what}: the sign of zero")


def test_unary_ops_on_edge_values(device):
    x = EDGE
    names = list(MATH) + list(EXACT_UNARY)
    g = _graph([ShapedArray(x.shape, F32)], lambda emit, a: [emit(n, [a]) for n in names])
    outs = [np.asarray(o) for o in device.compile(g)([x])]
    worst = {}
    for name, got in zip(names, outs, strict=True):
        want = P.PRIMITIVES[name].impl(x)[0]
        what = f"{name} on {device}"
        if name in EXACT_UNARY:
            np.testing.assert_array_equal(got, want, err_msg=what)
            if name != "is_finite":
                check_special(got, want, what)
            continue
        with np.errstate(all="ignore"):
            want64 = MATH[name](x.astype(np.float64)).astype(F32)
        check_special(got, want64, what)
        finite = np.isfinite(want64) & np.isfinite(got)
        if name in ("sin", "cos"):  # past TRIG_RANGE only the range is promised
            assert (np.abs(got[finite]) <= 1).all(), f"{what}: outside [-1, 1]"
            finite &= np.abs(x) <= TRIG_RANGE
        u = ulps(got[finite], want64[finite])
        worst[name] = int(u.max()) if u.size else 0
        assert worst[name] <= ULP_BOUND[name], \
            f"{what}: {worst[name]} ulp at x={x[finite][np.argmax(u)]!r} (bound {ULP_BOUND[name]})"


def test_binary_ops_on_every_pair_of_edge_values(device):
    a, b = np.meshgrid(EDGE, EDGE, indexing="ij")
    a, b = a.reshape(-1), b.reshape(-1)
    g = _graph([ShapedArray(a.shape, F32)] * 2, lambda emit, x, y: [emit(n, [x, y]) for n in BINARY])
    outs = [np.asarray(o) for o in device.compile(g)([a, b])]
    for name, got in zip(BINARY, outs, strict=True):
        want = P.PRIMITIVES[name].impl(a, b)[0]
        what = f"{name} on {device}"
        if name != "pow":
            bad = ~((got == want) | (np.isnan(got) & np.isnan(want)) if got.dtype == F32 else got == want)
            assert not bad.any(), f"{what}: differs at {list(zip(a[bad], b[bad], got[bad], want[bad]))[:6]}"
            if got.dtype == F32:
                check_special(got, want, what, zero_sign=name not in ("max", "min"))
            continue
        with np.errstate(all="ignore"):
            want64 = np.power(a.astype(np.float64), b.astype(np.float64)).astype(F32)
        check_special(got, want64, what)
        fin = np.isfinite(want64) & np.isfinite(got)
        u = ulps(got[fin], want64[fin])
        bound = POW_ULP.get(device.kind, 4)
        assert u.max() <= bound, f"{what}: {u.max()} ulp at {(a[fin][np.argmax(u)], b[fin][np.argmax(u)])}"


def test_reductions_over_edge_values(device):
    """Rows: NaN and inf mixes, -0.0 sums, denormal sums, overflow to inf; every reduction."""
    rows = np.array([
        [np.nan, 1.0, 2.0, -1.0], [1.0, np.nan, -np.inf, 5.0], [np.inf, -np.inf, 1.0, 0.0],
        [np.inf, 1.0, 2.0, 3.0], [-0.0, -0.0, -0.0, -0.0], [DENORM, DENORM, 3e-39, -DENORM],
        [BIG, BIG, -1.0, 1.0], [-BIG, -BIG, 1e38, 0.0], [1e-30, 1e-30, 1e-30, 1e-30],
        [-0.0, 0.0, -0.0, 0.0], [2.0, 2.0, -np.inf, -np.inf], [np.nan, np.nan, np.nan, np.nan],
    ], F32)
    def params(n):
        return {"axis": 1, "index_dtype": np.dtype(np.int32)} if n.startswith("arg") else {"axes": (1,)}
    g = _graph([ShapedArray(rows.shape, F32)],
               lambda emit, x: [emit(n, [x], **params(n)) for n in REDUCTIONS])
    outs = [np.asarray(o) for o in device.compile(g)([rows])]
    for name, got in zip(REDUCTIONS, outs, strict=True):
        want = P.PRIMITIVES[name].impl(rows, **params(name))[0]
        what = f"{name} on {device}"
        np.testing.assert_array_equal(got, want, err_msg=what)
        if got.dtype == F32:
            check_special(got, want, what, zero_sign=name not in ("reduce_max", "reduce_min") and
                          (name != "reduce_sum" or SUM_ZERO_SIGN.get(device.kind, True)))


I32 = np.dtype(np.int32)
INT_EDGE = {
    "int32": np.array([-2**31, -2**31 + 1, -7, -1, 0, 1, 7, 31, 32, 33, 2**31 - 1], I32),
    # uint64: shift amounts around the width, the 32-bit boundary, and both sides of 2**63 (the
    # values a signed path would take for negative)
    "uint64": np.array([0, 1, 7, 31, 32, 33, 63, 64, 65, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**63 + 5,
                        2**64 - 2, 2**64 - 1], np.uint64),
}
INT_BINARY = ("add", "sub", "mul", "div", "rem", "max", "min", "and", "or", "xor", "shift_left",
              "shift_right_logical", "eq", "lt", "ge")


@pytest.mark.parametrize("dtype", list(INT_EDGE))
def test_int_edges_wrap_as_numpy_does(device, dtype):
    """Overflow wraps, INT_MIN / -1 is INT_MIN, x / 0 is 0, shifts by the width or more give 0
    (our definitions of what C leaves undefined), on every pair of edge values; unary ops and
    reductions that overflow wrap too. uint64 compares, divides, shifts and reduces unsigned.
    (WebGPU has no 64-bit ints: the device refuses uint64, reported as a skip.)"""
    edge = INT_EDGE[dtype]
    d = edge.dtype
    a, b = (v.reshape(-1) for v in np.meshgrid(edge, edge, indexing="ij"))
    g = _graph([ShapedArray(a.shape, d)] * 2, lambda emit, x, y: [emit(n, [x, y]) for n in INT_BINARY])
    for name, got in zip(INT_BINARY, device.compile(g)([a, b]), strict=True):
        want = P.PRIMITIVES[name].impl(a, b)[0]
        bad = np.asarray(got) != want
        seen = list(zip(a[bad], b[bad], np.asarray(got)[bad], want[bad]))[:5]
        assert not bad.any(), f"{name} on {device}: (a, b, got, numpy) {seen}"
    m = edge.reshape(1, -1)
    ops = [("neg", {}), ("abs", {}), ("sign", {}), ("not", {}), ("reduce_sum", {"axes": (1,)}),
           ("reduce_prod", {"axes": (1,)}), ("reduce_max", {"axes": (1,)}), ("reduce_min", {"axes": (1,)}),
           ("argmax", {"axis": 1, "index_dtype": I32}), ("argmin", {"axis": 1, "index_dtype": I32})]
    g = _graph([ShapedArray(m.shape, d)], lambda emit, x: [emit(n, [x], **p) for n, p in ops])
    for (name, p), got in zip(ops, device.compile(g)([m]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), P.PRIMITIVES[name].impl(m, **p)[0],
                                      err_msg=f"{name} on {device}")


def test_16_bit_floats_keep_specials_and_denormals(device):
    """float16 and bfloat16 edge values (their own denormals, overflow past 65504 for float16)
    through conversions, exact ops and exp/log: the same NaN, infinities, signed zeros and values
    as numpy, which computes them in float32 and rounds once."""
    import ml_dtypes
    f16 = np.array([*EDGE[:11], 6e-8, -6e-8, 6.1e-5, 65504, 70000, -70000, 1.5, 11.0, 12.0], np.float32)
    with np.errstate(over="ignore"):  # 70000 is inf in float16: on purpose
        xs = [f16.astype(np.float16), f16.astype(ml_dtypes.bfloat16)]
    names = ("neg", "abs", "floor", "round", "exp", "log", "sqrt")

    def build(emit, a, b):
        for v in (a, b):
            for n in names:
                emit(n, [v])
            emit("convert_element_type", [v], new_dtype=F32, weak_type=False)
        emit("convert_element_type", [a], new_dtype=np.dtype(ml_dtypes.bfloat16), weak_type=False)
        emit("add", [a, a])  # 65504 + 65504 overflows float16
    g = _graph([ShapedArray(x.shape, x.dtype) for x in xs], build)
    got = [np.asarray(o) for o in device.compile(g)(xs)]
    want = [np.asarray(w) for w in ref_graph(g, xs)]
    for i, (o, w) in enumerate(zip(got, want, strict=True)):
        what = f"{g.eqns[i].prim.name} of {g.eqns[i].inputs[0].aval} on {device}"
        o64, w64 = o.astype(np.float64), w.astype(np.float64)
        check_special(o64, w64, what)
        fin = np.isfinite(w64)
        # exp/log are one ulp of the 16-bit type away at most (their float32 value, rounded once)
        np.testing.assert_allclose(o64[fin], w64[fin], rtol=2 ** -7 if "bfloat" in what else 2 ** -10,
                                   atol=0, err_msg=what)


def ref_graph(g, args):
    from tilefuse.ir.core import eval_graph
    return eval_graph(g, args, lambda e, xs: e.prim.impl(*xs, **e.params))
