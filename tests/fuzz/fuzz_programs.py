"""Random programs from the primitive table, as hypothesis strategies, and how to check them.

A program is a Graph built equation by equation from ir.primitives (not through tilefuse.numpy,
so every primitive and parameter the table allows can appear), with numpy inputs. Shapes are
small, with size-0 and size-1 axes and numpy-style broadcasting (broadcast_in_dim); dtypes are
float32/float16/bfloat16/int32/bool with conversions between them.

Each variable carries an `exact` flag: true when every correct backend must produce it bit for
bit (inputs, layout ops, integer and boolean arithmetic, max/min/select/neg/abs of exact values).
Float arithmetic and transcendental functions are compared with a tolerance; a discontinuous op
(floor, comparisons, float->int conversion, argmax, rem, ...) only takes exact operands, so a
last-ulp difference upstream cannot flip its result and make a false alarm."""
from __future__ import annotations

import os

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from tilefuse.ir import dtypes
from tilefuse.ir import primitives as P
from tilefuse.ir.core import Eqn, Graph, Literal, ShapedArray, Var, eval_graph
from tilefuse.ir.errors import DTypeError, ShapeError

F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
I32, BOOL = np.dtype(np.int32), np.dtype(np.bool_)
DTYPES = (F32, F16, BF16, I32, BOOL)


def budget(default: int) -> int:
    """Examples per fuzz test: TILEFUSE_FUZZ_EXAMPLES scales every test's default (1 = CI's)."""
    scale = float(os.environ.get("TILEFUSE_FUZZ_EXAMPLES", "1"))
    return max(1, int(default * scale))


def fuzz_settings(default_examples: int):
    return settings(max_examples=budget(default_examples), deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def ref_eval(g: Graph, args) -> list[np.ndarray]:
    """The oracle: the graph interpreted equation by equation with the numpy implementations."""
    return [np.asarray(x) for x in eval_graph(g, args, lambda e, xs: e.prim.impl(*xs, **e.params))]


def _widen(x):
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype in (F16, BF16) else x


def ref_eval_wide(g: Graph, args) -> list[np.ndarray] | None:
    """The oracle with excess precision (README, Dtypes): 16-bit float values computed and kept in
    float32 between equations, rounded to their dtypes only as the graph's outputs: what a 16-bit
    chain fused into one kernel computes (x * x * 1e-3 stays finite where float16 overflows; a
    difference of large values keeps float32's digits). None where no value is 16-bit, or where
    an equation cannot take float32 for float16 (a bitcast)."""
    if not any(np.dtype(v.aval.dtype) in (F16, BF16) for e in g.eqns for v in (*e.inputs, *e.outputs)):
        return None
    try:
        outs = eval_graph(g, [_widen(a) for a in args], lambda e, xs: e.prim.impl(*map(_widen, xs), **e.params))
        return [np.asarray(o).astype(v.aval.dtype) for o, v in zip(outs, g.outvars, strict=True)]
    except Exception:  # noqa: BLE001 (an equation that insists on its 16-bit operands: no second oracle)
        return None


def _agrees(got, want, exact: bool, g: Graph) -> bool:
    try:
        assert_matches(got, want, exact, g, "")
    except AssertionError:
        return False
    return True


def check_outputs(outs, g: Graph, args, exact: list, what: str) -> None:
    """Each output matches the oracle (ref_eval), or, in a program with 16-bit floats, the oracle
    with excess precision (ref_eval_wide): the backends keep a fused chain's float32 values. A
    failure reports the first oracle's mismatch."""
    want, wide = ref_eval(g, args), None
    for i, (o, w, ex) in enumerate(zip(outs, want, exact, strict=True)):
        try:
            assert_matches(o, w, ex, g, f"{what}, output {i}")
        except AssertionError:
            if wide is None:
                wide = ref_eval_wide(g, args) or []
            if i >= len(wide) or not _agrees(o, wide[i], ex, g):
                raise


class Program:
    """A random graph, its inputs, and which outputs must match bit for bit."""

    def __init__(self, graph: Graph, args: list, exact: list[bool]):
        self.graph, self.args, self.exact = graph, args, exact

    def __repr__(self):
        ins = ", ".join(f"{a.dtype}{list(a.shape)}" for a in self.args)
        return f"Program(inputs: {ins}; exact outputs {self.exact})\n{self.graph}"


# ---- the builder ---------------------------------------------------------------------------

FLOAT_SMOOTH = ("exp", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "sin", "cos",
                "erf")
# these turn an operand's rounding error into a much larger one (exp(32 +- 0.125) is off by 13%,
# sin(1000 +- 4) by anything): fused 16-bit chains skip intermediate roundings the reference
# makes (README, Dtypes), so they take only exact or small operands
AMPLIFYING = ("exp", "expm1", "sin", "cos")
SINGULAR = ("log", "log1p", "sqrt", "rsqrt")  # at 0 (or -1): a 16-bit rounding flips NaN/finite
BOUNDED_RESULT = ("tanh", "logistic", "erf", "sin", "cos")  # |result| <= 1
FLOAT_EXACT = ("neg", "abs")
FLOAT_STEP = ("floor", "ceil", "round", "sign", "is_finite")  # discontinuous: exact operand only
INT_UNARY = ("neg", "abs", "sign", "not")
FLOAT_BIN = ("add", "sub", "mul")
FLOAT_BIN_EXACT = ("max", "min")
FLOAT_BIN_STEP = ("rem", "pow", "eq", "ne", "lt", "le", "gt", "ge")  # exact operands only
FLOAT_BIN_ROUNDED = ("add", "sub", "mul", "div", "pow")  # results not bit for bit everywhere
INT_BIN = ("add", "sub", "mul", "div", "rem", "max", "min", "and", "or", "xor",
           "eq", "ne", "lt", "le", "gt", "ge")
BOOL_BIN = ("add", "mul", "max", "min", "and", "or", "xor", "eq", "ne", "lt", "ge")
PRIM = P.PRIMITIVES
# Input scales and constants span magnitudes (issue 18: a rewrite that held on [-30, 30] only was
# silently wrong at 640). float16 stays small: its reference overflows at 65504 where a fused
# chain, computing in float32, does not (README, Dtypes), so large values would be false alarms.
MAGNITUDES = {F32: (1e-3, 0.5, 1.0, 3.0, 1e2, 1e4), BF16: (1e-3, 0.5, 1.0, 3.0, 1e2, 1e4),
              F16: (1e-3, 0.5, 1.0, 3.0)}
CONSTANTS = {F32: (0.0, -0.0, 1.0, -1.0, 1e-3, -2.5e-3, 0.5, 3.0, -7.25, 100.0, -640.0, 1e4, -3e4),
             F16: (0.0, -0.0, 1.0, -1.0, 1e-3, 0.5, 3.0, -7.25),
             I32: (0, 1, -1, 3, -100, 1000), BOOL: (False, True)}
CONSTANTS[BF16] = CONSTANTS[F32]


class Builder:
    """Grows one graph: inputs, equations and the exactness of every variable."""

    def __init__(self, draw, rng: np.random.Generator, smooth_only: bool = False):
        self.draw, self.rng, self.smooth_only = draw, rng, smooth_only
        self.invars: list[Var] = []
        self.args: list[np.ndarray] = []
        self.eqns: list[Eqn] = []
        self.vars: list[Var] = []
        self.exact: dict[int, bool] = {}
        self.bounded: dict[int, bool] = {}  # |x| stays small: exp may take it (differentiable mode)

    # values
    def input(self, shape, dtype, lo=None, hi=None) -> Var:
        shape, rng = tuple(shape), self.rng
        if dtypes.is_float(dtype):
            # smooth programs stay small: finite differences of sin(exp(9)) are noise
            scale = self.draw(st.sampled_from((0.5, 1.0) if self.smooth_only else MAGNITUDES[np.dtype(dtype)]))
            x = (rng.standard_normal(shape) * scale).astype(dtype)
        elif dtype == BOOL:
            x = rng.random(shape) < 0.5
        else:
            x = rng.integers(-6 if lo is None else lo, 7 if hi is None else hi, shape).astype(dtype)
        v = Var(ShapedArray(shape, np.dtype(dtype)))
        self.invars.append(v)
        self.args.append(x)
        self._add(v, exact=True, bounded=True)
        return v

    def _add(self, v: Var, exact: bool, bounded: bool = False) -> Var:
        self.vars.append(v)
        self.exact[v.id] = exact
        self.bounded[v.id] = bounded
        return v

    def emit(self, prim_name: str, inputs, exact: bool, bounded: bool = False, **params) -> Var | None:
        """Append prim(*inputs, **params); None when the shape/dtype rule rejects it."""
        prim = PRIM[prim_name]
        try:
            out_avals = prim.abstract_eval(*[a.aval for a in inputs], **params)
        except (ShapeError, DTypeError):
            return None
        outs = tuple(Var(a) for a in out_avals)
        self.eqns.append(Eqn(prim, tuple(inputs), outs, params))
        return self._add(outs[0], exact, bounded)

    def pick(self, pred=lambda v: True) -> Var | None:
        cands = [v for v in self.vars if pred(v)]
        return self.draw(st.sampled_from(cands)) if cands else None

    def is_exact(self, v) -> bool:
        return isinstance(v, Literal) or self.exact[v.id]

    # helpers
    def convert(self, v: Var, dtype) -> Var | None:
        if v.aval.dtype == dtype:
            return v
        step = dtypes.is_float(v.aval.dtype) and not dtypes.is_float(dtype)
        if step and not self.is_exact(v):
            return None  # float -> int/bool of a rounded value: a last ulp could change it
        # one IEEE rounding is the same everywhere; int -> 16-bit float may round twice (via f32)
        exact = self.is_exact(v) and not (dtypes.is_int(v.aval.dtype) and dtype in (F16, BF16))
        return self.emit("convert_element_type", [v], exact, new_dtype=np.dtype(dtype), weak_type=False)

    def broadcast(self, v: Var, shape) -> Var | None:
        shape = tuple(shape)
        if v.aval.shape == shape:
            return v
        nd = len(shape)
        bd = tuple(range(nd - v.aval.ndim, nd))
        return self.emit("broadcast_in_dim", [v], self.is_exact(v), self.bounded[v.id],
                         shape=shape, broadcast_dimensions=bd)

    def graph(self, outvars) -> Graph:
        return Graph((), tuple(self.invars), tuple(self.eqns), tuple(outvars))


# ---- ops: each adds at most one value to the builder --------------------------------------

def op_unary(b: Builder):
    x = b.pick()
    d = x.aval.dtype
    if dtypes.is_float(d):
        names = FLOAT_SMOOTH + FLOAT_EXACT + (FLOAT_STEP if b.is_exact(x) else ())
        name = b.draw(st.sampled_from(names))
        if not b.is_exact(x) and ((name in AMPLIFYING and not b.bounded[x.id])
                                  or (name in SINGULAR and d in (F16, BF16))):
            name = "tanh"
        exact = b.is_exact(x) and name not in FLOAT_SMOOTH
        b.emit(name, [x], exact, bounded=name in BOUNDED_RESULT)
    else:
        name = b.draw(st.sampled_from(INT_UNARY if d == I32 else ("not",)))
        b.emit(name, [x], True)


def op_binary(b: Builder):
    x, y = b.pick(), b.pick()
    d = x.aval.dtype
    y = b.convert(y, d)
    if y is None:
        return
    try:
        shape = np.broadcast_shapes(x.aval.shape, y.aval.shape)
    except ValueError:
        return
    ex = b.is_exact(x) and b.is_exact(y)
    if dtypes.is_float(d):
        names = (FLOAT_BIN + FLOAT_BIN_EXACT + (FLOAT_BIN_STEP if ex else ())
                 + (("div",) if b.is_exact(y) else ()))
    else:
        names = INT_BIN if d == I32 else BOOL_BIN
    name = b.draw(st.sampled_from(names))
    exact = ex and not (dtypes.is_float(d) and name in FLOAT_BIN_ROUNDED)
    x, y = b.broadcast(x, shape), b.broadcast(y, shape)
    if x is not None and y is not None:
        b.emit(name, [x, y], exact)


def op_constant(b: Builder):
    """x op c for a constant c over wide magnitudes, written as numpy code writes it: a literal
    broadcast to x's shape (what the epilogue and simplification passes read as a scalar)."""
    x = b.pick()
    d = x.aval.dtype
    c = Literal(np.asarray(b.draw(st.sampled_from(CONSTANTS[np.dtype(d)])), d), ShapedArray((), d))
    full = b.emit("broadcast_in_dim", [c], True, abs(float(c.val)) <= 3, shape=x.aval.shape,
                  broadcast_dimensions=())
    if dtypes.is_float(d):
        names = FLOAT_BIN + FLOAT_BIN_EXACT + ("div",) + (FLOAT_BIN_STEP if b.is_exact(x) else ())
    else:
        names = INT_BIN if d == I32 else BOOL_BIN
    name = b.draw(st.sampled_from(names))
    args = [x, full] if b.draw(st.booleans()) or name == "div" else [full, x]
    exact = b.is_exact(x) and not (dtypes.is_float(d) and name in FLOAT_BIN_ROUNDED)
    b.emit(name, args, exact)


def op_integer_pow(b: Builder):
    x = b.pick(lambda v: v.aval.dtype != BOOL)
    if x is not None:
        y = b.draw(st.sampled_from((-2, -1, 0, 1, 2, 3) if dtypes.is_float(x.aval.dtype) else (0, 1, 2, 3)))
        if y < 0 and not b.is_exact(x):
            return
        b.emit("integer_pow", [x], b.is_exact(x) and not dtypes.is_float(x.aval.dtype), y=y)


def op_select(b: Builder):
    p = b.pick(lambda v: v.aval.dtype == BOOL)
    x, y = b.pick(), b.pick()
    if p is None:
        return
    y = b.convert(y, x.aval.dtype)
    if y is None:
        return
    try:
        shape = np.broadcast_shapes(p.aval.shape, x.aval.shape, y.aval.shape)
    except ValueError:
        return
    p, x, y = b.broadcast(p, shape), b.broadcast(x, shape), b.broadcast(y, shape)
    if None not in (p, x, y):
        b.emit("select", [p, x, y], b.is_exact(x) and b.is_exact(y))


def op_convert(b: Builder):
    x = b.pick()
    d = b.draw(st.sampled_from(DTYPES))
    b.convert(x, d)


def op_reduce(b: Builder):
    x = b.pick(lambda v: v.aval.ndim > 0)
    if x is None:
        return
    d, nd = x.aval.dtype, x.aval.ndim
    axes = tuple(sorted(b.draw(st.sets(st.integers(0, nd - 1), min_size=1, max_size=nd))))
    names = ["reduce_sum", "reduce_max", "reduce_min"] + (["reduce_prod"] if d != BOOL else [])
    if b.is_exact(x) and d != BOOL:
        names += ["argmax", "argmin"]
    name = b.draw(st.sampled_from(names))
    if name in ("argmax", "argmin"):
        b.emit(name, [x], True, axis=axes[0], index_dtype=I32)
        return
    exact = b.is_exact(x) and (not dtypes.is_float(d) or name in ("reduce_max", "reduce_min"))
    b.emit(name, [x], exact, axes=axes)


def _factor_shapes(size: int, shape) -> list[tuple]:
    out = [(size,), tuple(shape) + (1,), (1,) + tuple(shape), tuple(n for n in shape if n != 1)]
    for i, n in enumerate(shape):
        for k in (2, 3):
            if n and n % k == 0 and n != k:
                out.append(tuple(shape[:i]) + (k, n // k) + tuple(shape[i + 1:]))
    if len(shape) >= 2:
        out.append(tuple(shape[:-2]) + (shape[-2] * shape[-1],))
    return out


def op_layout(b: Builder):
    x = b.pick()
    sh, nd = x.aval.shape, x.aval.ndim
    ex, bd = b.is_exact(x), b.bounded[x.id]
    kind = b.draw(st.sampled_from(("reshape", "transpose", "slice", "rev", "pad", "concatenate",
                                   "broadcast")))
    if kind == "reshape":
        b.emit("reshape", [x], ex, bd, new_sizes=b.draw(st.sampled_from(_factor_shapes(x.aval.size, sh))))
    elif kind == "transpose":
        b.emit("transpose", [x], ex, bd, permutation=tuple(b.draw(st.permutations(range(nd)))))
    elif kind == "slice":
        starts, limits, strides = [], [], []
        for n in sh:
            s = b.draw(st.integers(0, n))
            starts.append(s)
            limits.append(b.draw(st.integers(s, n)))
            strides.append(b.draw(st.sampled_from((1, 1, 2, 3))))
        b.emit("slice", [x], ex, bd, start_indices=tuple(starts), limit_indices=tuple(limits),
               strides=tuple(strides))
    elif kind == "rev" and nd:
        dims = tuple(sorted(b.draw(st.sets(st.integers(0, nd - 1), max_size=nd))))
        b.emit("rev", [x], ex, bd, dimensions=dims)
    elif kind == "pad" and not b.smooth_only:
        cfg = tuple((b.draw(st.integers(0, 2)), b.draw(st.integers(0, 2)), b.draw(st.integers(0, 1)))
                    for _ in sh)
        value = np.asarray(b.draw(st.sampled_from((0, 1, -2))), x.aval.dtype)
        pv = Literal(value, ShapedArray((), x.aval.dtype))
        b.emit("pad", [x, pv], ex, bd, padding_config=cfg)
    elif kind == "concatenate" and nd:
        y = b.pick(lambda v: v.aval.dtype == x.aval.dtype and v.aval.ndim == nd)
        ax = b.draw(st.integers(0, nd - 1))
        b.emit("concatenate", [x, y], ex and b.is_exact(y), bd and b.bounded[y.id], dimension=ax)
    elif kind == "broadcast":
        b.emit("broadcast_in_dim", [x], ex, bd, shape=(b.draw(st.integers(1, 3)),) + sh,
               broadcast_dimensions=tuple(range(1, nd + 1)))


def op_dot(b: Builder):
    x = b.pick(lambda v: 1 <= v.aval.ndim <= 3 and v.aval.dtype != BOOL)
    if x is None:
        return
    sh, nd = x.aval.shape, x.aval.ndim
    c = b.draw(st.integers(0, nd - 1))
    batch = [a for a in range(nd) if a != c]
    bt = b.draw(st.sampled_from([None] + batch)) if batch else None
    n = b.draw(st.sampled_from((1, 2, 3, 5)))
    yshape = ([sh[bt]] if bt is not None else []) + [sh[c], n]
    y = b.input(yshape, x.aval.dtype, lo=-3, hi=4)
    lb, rb = ((bt,), (0,)) if bt is not None else ((), ())
    rc = 1 if bt is not None else 0
    exact = not dtypes.is_float(x.aval.dtype) and b.is_exact(x)
    b.emit("dot_general", [x, y], exact, dimension_numbers=(((c,), (rc,)), (lb, rb)))


def op_gather(b: Builder):
    x = b.pick(lambda v: v.aval.ndim >= 1)
    if x is None:
        return
    axis = b.draw(st.integers(0, x.aval.ndim - 1))
    n = x.aval.shape[axis]
    idx = b.input((b.draw(st.integers(0, 4)),), I32, lo=-1, hi=n + 2)  # out of range: clamped
    b.emit("gather", [x, idx], b.is_exact(x), b.bounded[x.id], axis=axis)


OPS = (op_unary, op_unary, op_binary, op_binary, op_binary, op_constant, op_constant, op_integer_pow,
       op_select, op_convert, op_reduce, op_reduce, op_layout, op_layout, op_layout, op_dot, op_dot,
       op_gather)


# ---- strategies ----------------------------------------------------------------------------

@st.composite
def shapes(draw, max_rank=3):
    rank = draw(st.integers(0, max_rank))
    zero = draw(st.integers(0, 7)) == 0  # a size-0 axis in one program of eight
    dims = [draw(st.sampled_from((1, 2, 3, 4, 5))) for _ in range(rank)]
    if zero and rank:
        dims[draw(st.integers(0, rank - 1))] = 0
    return tuple(dims)


def _broadcastable_to(draw, shape):
    """A shape that broadcasts to `shape`: leading axes dropped, some axes set to 1."""
    keep = draw(st.integers(0, len(shape)))
    sub = list(shape[len(shape) - keep:])
    for i in range(len(sub)):
        if draw(st.integers(0, 3)) == 0:
            sub[i] = 1
    return tuple(sub)


@st.composite
def programs(draw, dtypes_=DTYPES, max_ops=10):
    """A random program over one to three inputs of broadcast-compatible shapes."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    b = Builder(draw, rng)
    base = draw(shapes())
    dtype = draw(st.sampled_from(dtypes_))
    for i in range(draw(st.integers(1, 3))):
        d = dtype if i == 0 or draw(st.booleans()) else draw(st.sampled_from(dtypes_))
        b.input(base if i == 0 else _broadcastable_to(draw, base), d)
    for _ in range(draw(st.integers(2, max_ops))):
        draw(st.sampled_from(OPS))(b)
    made = [v for v in b.vars if v not in b.invars]
    outs = made[-2:] if made else b.vars[:1]
    extra = draw(st.sampled_from([None] + b.vars))
    if extra is not None:
        outs = outs + [extra]  # sometimes an input or an earlier value: copies, repeated outputs
    return Program(b.graph(outs), b.args, [b.is_exact(v) for v in outs])


# ---- differentiable programs (float64 for check_grads) -----------------------------------

SMOOTH_UNARY = ("tanh", "sin", "cos", "logistic", "neg", "exp")


@st.composite
def differentiable_programs(draw, max_ops=6):
    """A smooth float32 program (no literals, no conversions, so it runs in float64 too)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    b = Builder(draw, rng, smooth_only=True)
    base = draw(shapes(max_rank=2).filter(lambda s: 0 not in s))
    for i in range(draw(st.integers(1, 2))):
        b.input(base if i == 0 else _broadcastable_to(draw, base), F32)
    for _ in range(draw(st.integers(2, max_ops))):
        kind = draw(st.sampled_from(("unary", "binary", "sum", "layout", "dot", "pow")))
        x = b.pick()
        if kind == "unary":
            name = draw(st.sampled_from(SMOOTH_UNARY))
            if name == "exp" and not b.bounded[x.id]:
                name = "tanh"
            b.emit(name, [x], False, bounded=name != "neg" or b.bounded[x.id])
        elif kind == "binary":
            y = b.pick()
            try:
                shape = np.broadcast_shapes(x.aval.shape, y.aval.shape)
            except ValueError:
                continue
            x, y = b.broadcast(x, shape), b.broadcast(y, shape)
            name = draw(st.sampled_from(("add", "sub", "mul")))
            b.emit(name, [x, y], False, bounded=name != "mul" and b.bounded[x.id] and b.bounded[y.id])
        elif kind == "sum" and x.aval.ndim:
            axes = tuple(sorted(draw(st.sets(st.integers(0, x.aval.ndim - 1), min_size=1))))
            b.emit("reduce_sum", [x], False, axes=axes)
        elif kind == "layout":
            op_layout(b)
        elif kind == "dot":
            op_dot(b)
        elif kind == "pow":
            b.emit("integer_pow", [x], False, y=draw(st.sampled_from((2, 3))))
    made = [v for v in b.vars if v not in b.invars and v.aval.size > 0]
    outs = made[-2:] if made else b.vars[:1]
    return Program(b.graph(outs), [a.astype(np.float64) for a in b.args], [False] * len(outs))


# ---- comparison ----------------------------------------------------------------------------

PER_OP_TOL = {F16: 4e-3, BF16: 3e-2, F32: 2e-5}


def tolerance(graph: Graph) -> float:
    """Relative error allowed after the graph's equations, in its least precise float dtype (a
    float32 output converted from a fused float16 chain carries float16's error)."""
    floats = [v.aval.dtype for e in graph.eqns for v in (*e.inputs, *e.outputs)
              if dtypes.is_float(v.aval.dtype)] + [v.aval.dtype for v in graph.invars]
    per_op = max((PER_OP_TOL.get(np.dtype(d), 2e-5) for d in floats), default=2e-5)
    return per_op * (1 + len(graph.eqns))


def assert_matches(got, want, exact: bool, graph: Graph, what: str) -> None:
    """got (a backend's output) against want (the reference's): same shape and dtype; bit for
    bit where exact (NaN equals NaN, -0.0 equals 0.0), else within a tolerance scaled by the
    output's magnitude (the error of a sum or a difference is relative to its operands)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
    if exact or not dtypes.is_float(want.dtype):
        np.testing.assert_array_equal(got.astype(np.float64) if dtypes.is_float(got.dtype) else got,
                                      want.astype(np.float64) if dtypes.is_float(want.dtype) else want,
                                      err_msg=what)
        return
    g, w = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(w)
    scale = max(1.0, float(np.abs(w[finite]).max())) if finite.any() else 1.0
    tol = tolerance(graph)
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale, equal_nan=True, err_msg=what)
