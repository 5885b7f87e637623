"""The primitive table: every primitive declared once, with its shape/dtype rule and its numpy
reference implementation. Other layers key their rules (autodiff, batching, lowering) by these
objects."""
from __future__ import annotations

import math
import weakref
from typing import Callable

import numpy as np

from . import dtypes
from .core import Eqn, Graph, Literal, ShapedArray, Var, eval_graph, pp_graph
from .errors import DTypeError, OperandShapeError, ShapeError, with_user_line

PRIMITIVES: dict[str, "Primitive"] = {}


class Primitive:
    """A primitive operation: a name, a shape/dtype rule and a numpy reference implementation."""

    def __init__(self, name: str, rule: Callable, impl: Callable, *, multiple_results=False,
                 elementwise=False, effectful=False, compile_only=False):
        assert name not in PRIMITIVES, f"primitive {name} declared twice"
        self.name, self._rule, self._impl = name, rule, impl
        self.multiple_results, self.elementwise, self.effectful = multiple_results, elementwise, effectful
        # made only by compile passes, which run after autodiff and vmap: no rules for those
        self.compile_only = compile_only
        PRIMITIVES[name] = self

    def abstract_eval(self, *avals, **params) -> list[ShapedArray]:
        out = self._rule(*avals, **params)
        return list(out) if self.multiple_results else [out]

    def impl(self, *args, **params) -> list[np.ndarray]:
        with np.errstate(all="ignore"):  # log(-1) is NaN, as on every device: no warning
            return self.results(*args, **params)

    def results(self, *args, **params) -> list[np.ndarray]:
        """impl's results, numpy's floating-point warnings left as they are: for a caller that
        silences them once around many equations (Interpreter)."""
        out = self._impl(*args, **params)
        # numpy hands back scalars for 0-d results; buffers are always arrays
        return [np.asarray(o) for o in out] if self.multiple_results else [np.asarray(out)]

    def __repr__(self):
        return self.name

    def __reduce__(self):  # by name: one object per primitive
        return primitive, (self.name,)


def primitive(name: str) -> Primitive:
    return PRIMITIVES[name]


def shape_error(prim: str, msg: str, *avals) -> ShapeError:
    shapes = ", ".join(str(a.shape) for a in avals)
    return OperandShapeError(with_user_line(f"{prim}: {msg} (operand shapes {shapes})"))


def dtype_error(prim: str, msg: str, *avals) -> DTypeError:
    ds = ", ".join(str(a.dtype) for a in avals)
    return DTypeError(with_user_line(f"{prim}: {msg} (operand dtypes {ds})"))


def _weak(*avals) -> bool:
    return all(a.weak_type for a in avals)


def _in_compute_dtype(fn):
    """Run a numpy function in float32 for 16-bit floats, then cast back to the input dtype."""
    def impl(*xs, **params):
        d = xs[0].dtype
        cd = dtypes.compute_dtype(d)
        out = fn(*(np.asarray(x, cd) if x.dtype == d else x for x in xs), **params)
        return np.asarray(out, d)
    return impl


_KINDS = {"float": dtypes.is_float, "int": dtypes.is_int, "bool": dtypes.is_bool}


def _check_kinds(name, kinds, *avals):
    d = avals[0].dtype
    if not any(_KINDS[k](d) for k in kinds):
        raise dtype_error(name, f"needs {' or '.join(kinds)} operands", *avals)


# ---- elementwise -------------------------------------------------------------------------

def unop(name: str, np_fn: Callable, kinds=("float",), out_dtype=None) -> Primitive:
    def rule(x):
        _check_kinds(name, kinds, x)
        return ShapedArray(x.shape, out_dtype or x.dtype, x.weak_type and out_dtype is None)
    impl = (lambda x: np.asarray(np_fn(x), out_dtype)) if out_dtype else _in_compute_dtype(np_fn)
    return Primitive(name, rule, impl, elementwise=True)


def binop(name: str, np_fn: Callable, kinds=("float", "int"), out_dtype=None) -> Primitive:
    def rule(x, y):
        if x.shape != y.shape:
            raise shape_error(name, "operands must have equal shapes (broadcast first)", x, y)
        if x.dtype != y.dtype:
            raise dtype_error(name, "operands must have equal dtypes (convert first)", x, y)
        _check_kinds(name, kinds, x, y)
        return ShapedArray(x.shape, out_dtype or x.dtype, _weak(x, y) and out_dtype is None)
    impl = (lambda x, y: np.asarray(np_fn(x, y), out_dtype)) if out_dtype else _in_compute_dtype(np_fn)
    return Primitive(name, rule, impl, elementwise=True)


_erf = np.frompyfunc(math.erf, 1, 1)
NUM = ("float", "int")

neg = unop("neg", np.negative, NUM)
exp = unop("exp", np.exp)
log = unop("log", np.log)
log1p = unop("log1p", np.log1p)
expm1 = unop("expm1", np.expm1)
tanh = unop("tanh", np.tanh)
logistic = unop("logistic", lambda x: 1 / (1 + np.exp(-x)))  # no cancellation for x << 0
sqrt = unop("sqrt", np.sqrt)
rsqrt = unop("rsqrt", lambda x: 1 / np.sqrt(x))
sin = unop("sin", np.sin)
cos = unop("cos", np.cos)
erf = unop("erf", lambda x: np.asarray(_erf(x), x.dtype))
abs_ = unop("abs", np.abs, NUM)
sign = unop("sign", np.sign, NUM)
floor = unop("floor", np.floor)
ceil = unop("ceil", np.ceil)
round_ = unop("round", np.round)
is_finite = unop("is_finite", np.isfinite, ("float",), out_dtype=dtypes.bool_)
not_ = unop("not", lambda x: np.logical_not(x) if x.dtype == bool else np.invert(x), ("bool", "int"))


def _int_div(x, y):
    if np.issubdtype(x.dtype, np.integer):  # C semantics: round toward zero
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(y == 0, 0, x // np.where(y == 0, 1, y))
            fix = (q * y != x) & ((x < 0) != (y < 0)) & (y != 0)
            return (q + fix).astype(x.dtype)
    return np.divide(x, y)


def _int_rem(x, y):
    if np.issubdtype(x.dtype, np.integer):  # C semantics: the sign of the dividend
        return (x - _int_div(x, y) * y).astype(x.dtype)
    return np.fmod(x, y)


add = binop("add", np.add, ("float", "int", "bool"))
sub = binop("sub", np.subtract)
mul = binop("mul", np.multiply, ("float", "int", "bool"))
div = binop("div", _int_div)
rem = binop("rem", _int_rem)
pow_ = binop("pow", np.power, ("float",))
max_ = binop("max", np.maximum, ("float", "int", "bool"))
min_ = binop("min", np.minimum, ("float", "int", "bool"))
and_ = binop("and", np.bitwise_and, ("bool", "int"))
or_ = binop("or", np.bitwise_or, ("bool", "int"))
xor = binop("xor", np.bitwise_xor, ("bool", "int"))
shift_left = binop("shift_left", np.left_shift, ("int",))
shift_right_logical = binop(
    "shift_right_logical",
    lambda x, y: (x.view(f"u{x.dtype.itemsize}") >> y.astype(f"u{x.dtype.itemsize}")).view(x.dtype), ("int",))
ALL = ("float", "int", "bool")
eq = binop("eq", np.equal, ALL, dtypes.bool_)
ne = binop("ne", np.not_equal, ALL, dtypes.bool_)
lt = binop("lt", np.less, ALL, dtypes.bool_)
le = binop("le", np.less_equal, ALL, dtypes.bool_)
gt = binop("gt", np.greater, ALL, dtypes.bool_)
ge = binop("ge", np.greater_equal, ALL, dtypes.bool_)


def _integer_pow_rule(x, *, y):
    _check_kinds("integer_pow", NUM, x)
    return x


integer_pow = Primitive("integer_pow", _integer_pow_rule,
                        _in_compute_dtype(lambda x, y: np.power(x, y) if y >= 0 else 1 / np.power(x, -y)),
                        elementwise=True)


def _select_rule(pred, on_true, on_false):
    if not dtypes.is_bool(pred.dtype):
        raise dtype_error("select", "the predicate must be bool", pred)
    if not pred.shape == on_true.shape == on_false.shape:
        raise shape_error("select", "predicate and branches must have equal shapes",
                          pred, on_true, on_false)
    if on_true.dtype != on_false.dtype:
        raise dtype_error("select", "branches must have equal dtypes", on_true, on_false)
    return ShapedArray(on_true.shape, on_true.dtype, _weak(on_true, on_false))


select = Primitive("select", _select_rule, lambda p, t, f: np.where(p, t, f), elementwise=True)


def _convert_rule(x, *, new_dtype, weak_type=False):
    return ShapedArray(x.shape, new_dtype, weak_type)


def _convert_impl(x, *, new_dtype, weak_type=False):
    if dtypes.is_int(new_dtype) and dtypes.is_float(x.dtype):  # C semantics: truncate
        with np.errstate(invalid="ignore"):
            return np.trunc(x.astype(np.float64)).astype(new_dtype)
    return x.astype(new_dtype)


convert_element_type = Primitive("convert_element_type", _convert_rule, _convert_impl,
                                 elementwise=True)

stop_gradient = Primitive("stop_gradient", lambda x: x, lambda x: x, elementwise=True)


# ---- shape and layout -------------------------------------------------------------------

def _iota_rule(*, dtype, shape, dimension):
    if not 0 <= dimension < len(shape):
        raise ShapeError(f"iota: dimension {dimension} out of range for shape {shape}")
    return ShapedArray(tuple(shape), dtype)


def _iota_impl(*, dtype, shape, dimension):
    r = np.arange(shape[dimension], dtype=dtype)
    sh = [1] * len(shape)
    sh[dimension] = shape[dimension]
    return np.broadcast_to(r.reshape(sh), shape)


iota = Primitive("iota", _iota_rule, _iota_impl)

# A size used as a value (a mean's count) in a shape-generic trace: `value` is an ir.symbolic.Dim;
# tracer/shape_poly.py writes its value in as a literal when it instantiates the graph for a size,
# so no pass, backend, cache or transformation ever sees this primitive (it has no operands: vmap
# and autodiff never bind it), and it is not in the registry they are checked against.
# Weakly typed, as the Python int it stands for.
dim_value = Primitive("dim_value", lambda *, value, dtype: ShapedArray((), dtype, True),
                      lambda *, value, dtype: np.asarray(int(value), dtype))
del PRIMITIVES["dim_value"]


def _bcast_rule(x, *, shape, broadcast_dimensions):
    bd = broadcast_dimensions
    if len(bd) != x.ndim or any(not 0 <= d < len(shape) for d in bd) or list(bd) != sorted(set(bd)):
        raise shape_error("broadcast_in_dim", f"bad broadcast_dimensions {bd} to {shape}", x)
    for i, d in enumerate(bd):
        if x.shape[i] not in (1, shape[d]):
            raise shape_error("broadcast_in_dim", f"cannot broadcast to shape {tuple(shape)}", x)
    return ShapedArray(tuple(shape), x.dtype, x.weak_type)


def _bcast_impl(x, *, shape, broadcast_dimensions):
    sh = [1] * len(shape)
    for i, d in enumerate(broadcast_dimensions):
        sh[d] = x.shape[i]
    return np.broadcast_to(x.reshape(sh), shape)


broadcast_in_dim = Primitive("broadcast_in_dim", _bcast_rule, _bcast_impl)


def _reshape_rule(x, *, new_sizes):
    if math.prod(new_sizes) != x.size or any(s < 0 for s in new_sizes):
        raise shape_error("reshape", f"cannot reshape to {tuple(new_sizes)}", x)
    return ShapedArray(tuple(new_sizes), x.dtype, x.weak_type)


reshape = Primitive("reshape", _reshape_rule, lambda x, new_sizes: np.reshape(x, new_sizes))


def _transpose_rule(x, *, permutation):
    if sorted(permutation) != list(range(x.ndim)):
        raise shape_error("transpose", f"permutation {permutation} is not one of the axes", x)
    return ShapedArray(tuple(x.shape[p] for p in permutation), x.dtype, x.weak_type)


transpose = Primitive("transpose", _transpose_rule, lambda x, permutation: np.transpose(x, permutation))


def _rev_rule(x, *, dimensions):
    if any(not 0 <= d < x.ndim for d in dimensions):
        raise shape_error("rev", f"dimensions {dimensions} out of range", x)
    return x


rev = Primitive("rev", _rev_rule, lambda x, dimensions: np.flip(x, dimensions) if dimensions else x)


def _slice_rule(x, *, start_indices, limit_indices, strides):
    if not len(start_indices) == len(limit_indices) == len(strides) == x.ndim:
        raise shape_error("slice", "needs a start, limit and stride per axis", x)
    shape = []
    for s, l, st, n in zip(start_indices, limit_indices, strides, x.shape):
        if not (0 <= s <= l <= n and st >= 1):
            raise shape_error("slice", f"bad slice {s}:{l}:{st} of an axis of size {n}", x)
        shape.append(max(0, -(-(l - s) // st)))
    return ShapedArray(tuple(shape), x.dtype, x.weak_type)


slice_ = Primitive("slice", _slice_rule, lambda x, start_indices, limit_indices, strides: x[
    tuple(slice(s, l, st) for s, l, st in zip(start_indices, limit_indices, strides))])


def _concat_rule(*xs, dimension):
    x0 = xs[0]
    if not 0 <= dimension < x0.ndim:
        raise shape_error("concatenate", f"axis {dimension} out of range", *xs)
    for x in xs[1:]:
        if x.ndim != x0.ndim or any(a != b for i, (a, b) in enumerate(zip(x.shape, x0.shape))
                                    if i != dimension):
            raise shape_error("concatenate", f"shapes differ off the axis {dimension}", *xs)
        if x.dtype != x0.dtype:
            raise dtype_error("concatenate", "operands must have equal dtypes", *xs)
    shape = list(x0.shape)
    shape[dimension] = sum(x.shape[dimension] for x in xs)
    return ShapedArray(tuple(shape), x0.dtype, _weak(*xs))


concatenate = Primitive("concatenate", _concat_rule,
                        lambda *xs, dimension: np.concatenate(xs, axis=dimension))


def _pad_rule(x, pv, *, padding_config):
    if pv.shape != () or pv.dtype != x.dtype:
        raise shape_error("pad", "the padding value must be a scalar of the operand's dtype", x, pv)
    if len(padding_config) != x.ndim:
        raise shape_error("pad", "needs (low, high, interior) per axis", x)
    shape = []
    for (lo, hi, it), n in zip(padding_config, x.shape):
        if lo < 0 or hi < 0 or it < 0:
            raise shape_error("pad", f"negative padding {(lo, hi, it)}", x)
        shape.append(lo + hi + n + max(0, n - 1) * it)
    return ShapedArray(tuple(shape), x.dtype, x.weak_type)


def _pad_impl(x, pv, *, padding_config):
    shape = _pad_rule(ShapedArray(x.shape, x.dtype), ShapedArray((), x.dtype),
                      padding_config=padding_config).shape
    out = np.full(shape, pv, x.dtype)
    out[tuple(slice(lo, lo + max(0, (n - 1) * (it + 1) + 1), it + 1)
              for (lo, hi, it), n in zip(padding_config, x.shape))] = x
    return out


pad = Primitive("pad", _pad_rule, _pad_impl)


# ---- reductions ---------------------------------------------------------------------------

def _check_axes(name, x, axes):
    if len(set(axes)) != len(axes) or any(not 0 <= a < x.ndim for a in axes):
        raise shape_error(name, f"axes {tuple(axes)} out of range or repeated", x)


def reduction(name: str, np_fn: Callable, kinds=ALL) -> Primitive:
    def rule(x, *, axes):
        _check_axes(name, x, axes)
        _check_kinds(name, kinds, x)
        if name in ("reduce_max", "reduce_min") and any(x.shape[a] == 0 for a in axes):
            raise shape_error(name, "cannot reduce an empty axis (it has no identity)", x)
        return ShapedArray(tuple(n for i, n in enumerate(x.shape) if i not in axes), x.dtype,
                           x.weak_type)
    return Primitive(name, rule, _in_compute_dtype(lambda x, axes: np_fn(x, axis=tuple(axes))))


def _pairwise_sum(x, axis):
    """np.sum, accurate for floats over any axes: numpy adds pairwise only along the contiguous
    last axis (a column sum of 2e6 tenths: 1.5% off), so float32 sums over other axes accumulate
    in float64 (a bias gradient, (16, 64, 512) over its first two axes: 0.18 ms against 1.4 for
    moving the axes last, and closer to the exact sum) and float64 ones move the axes last."""
    axis = tuple(sorted(axis))  # (the shape rule checked them: 0 <= a < ndim, no repeats)
    if x.dtype.kind != "f" or axis == tuple(range(x.ndim - len(axis), x.ndim)):
        return np.sum(x, axis=axis)
    if x.dtype.itemsize < 8:
        return np.sum(x, axis=axis, dtype=np.float64).astype(x.dtype)
    keep = [a for a in range(x.ndim) if a not in axis]
    n = math.prod(x.shape[a] for a in axis)
    rows = np.ascontiguousarray(np.transpose(x, keep + list(axis)))
    return np.sum(rows.reshape([x.shape[a] for a in keep] + [n]), axis=-1)


reduce_sum = reduction("reduce_sum", _pairwise_sum)
reduce_max = reduction("reduce_max", np.max)
reduce_min = reduction("reduce_min", np.min)
reduce_prod = reduction("reduce_prod", np.prod, NUM)


def arg_reduction(name: str, np_fn: Callable) -> Primitive:
    def rule(x, *, axis, index_dtype):
        _check_axes(name, x, (axis,))
        if x.shape[axis] == 0:
            raise shape_error(name, "cannot take the arg of an empty axis", x)
        return ShapedArray(tuple(n for i, n in enumerate(x.shape) if i != axis), index_dtype)
    # ties: the first index (numpy's rule); NaN counts as the extreme, as in numpy
    return Primitive(name, rule, lambda x, axis, index_dtype: np_fn(x, axis=axis).astype(index_dtype))


argmax = arg_reduction("argmax", np.argmax)
argmin = arg_reduction("argmin", np.argmin)


# ---- contraction ------------------------------------------------------------------------

def dot_free_axes(lhs_ndim: int, rhs_ndim: int, dimension_numbers) -> tuple[tuple, tuple]:
    """A dot_general's free axes (neither contracting nor batch) of the lhs and of the rhs."""
    (lc, rc), (lb, rb) = dimension_numbers
    return (tuple(i for i in range(lhs_ndim) if i not in lc and i not in lb),
            tuple(i for i in range(rhs_ndim) if i not in rc and i not in rb))


def _dot_rule(lhs, rhs, *, dimension_numbers, preferred_element_type=None):
    (lc, rc), (lb, rb) = dimension_numbers
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise shape_error("dot_general", f"bad dimension numbers {dimension_numbers}", lhs, rhs)
    _check_axes("dot_general", lhs, (*lc, *lb))
    _check_axes("dot_general", rhs, (*rc, *rb))
    for a, b in zip(lc, rc):
        if lhs.shape[a] != rhs.shape[b]:
            raise shape_error("dot_general", f"contracting dimensions differ: lhs axis {a} has "
                              f"{lhs.shape[a]}, rhs axis {b} has {rhs.shape[b]}", lhs, rhs)
    for a, b in zip(lb, rb):
        if lhs.shape[a] != rhs.shape[b]:
            raise shape_error("dot_general", f"batch dimensions differ: lhs axis {a} has "
                              f"{lhs.shape[a]}, rhs axis {b} has {rhs.shape[b]}", lhs, rhs)
    if lhs.dtype != rhs.dtype:
        raise dtype_error("dot_general", "operands must have equal dtypes", lhs, rhs)
    lfree, rfree = dot_free_axes(lhs.ndim, rhs.ndim, dimension_numbers)
    shape = (*(lhs.shape[a] for a in lb), *(lhs.shape[a] for a in lfree), *(rhs.shape[a] for a in rfree))
    return ShapedArray(shape, preferred_element_type or lhs.dtype, _weak(lhs, rhs))


def _dot_impl(lhs, rhs, *, dimension_numbers, preferred_element_type=None):
    (lc, rc), (lb, rb) = dimension_numbers
    lfree, rfree = dot_free_axes(lhs.ndim, rhs.ndim, dimension_numbers)
    cd = dtypes.compute_dtype(lhs.dtype)
    l2 = np.transpose(lhs, (*lb, *lfree, *lc)).astype(cd, copy=False)
    r2 = np.transpose(rhs, (*rb, *rc, *rfree)).astype(cd, copy=False)
    nb = math.prod(lhs.shape[i] for i in lb)  # (math.prod: np.prod costs microseconds an eager matmul)
    m = math.prod(lhs.shape[i] for i in lfree)
    k = math.prod(lhs.shape[i] for i in lc)
    n = math.prod(rhs.shape[i] for i in rfree)
    out = np.matmul(l2.reshape(nb, m, k), r2.reshape(nb, k, n))
    shape = [lhs.shape[i] for i in lb] + [lhs.shape[i] for i in lfree] + [rhs.shape[i] for i in rfree]
    return out.reshape(shape).astype(preferred_element_type or lhs.dtype, copy=False)  # (a fresh product: no copy)


dot_general = Primitive("dot_general", _dot_rule, _dot_impl)


# ---- fused GEMM (made by the pass ir/passes/gemm_epilogue.py) -----------------------------------
#
# fused_gemm(lhs, rhs, *extras; dimension_numbers, preferred_element_type, epilogue) is
# epilogue(dot_general(lhs, rhs), *extras) elementwise: `epilogue` is a ScalarFn of the product
# and one value of each extra (an array of the output's shape, or a row vector along its last
# axis, of the product's dtype). Any elementwise computation is a legal epilogue: the pass takes
# what the graph computes, and every implementation lowers the same expression.


class ScalarFn:
    """An elementwise function as a graph over 0-d values: every equation elementwise, inputs and
    the one output 0-d. Compared and hashed by its text, so equal functions built apart are one
    cache key; `fn(*arrays)` evaluates it on arrays that broadcast (the numpy reference)."""
    __slots__ = ("graph", "text", "_hash")

    def __init__(self, graph):
        for v in (*graph.invars, *graph.outvars):
            assert v.aval.shape == (), f"ScalarFn over a non-scalar value {v}"
        assert len(graph.outvars) == 1 and not graph.constvars, graph
        for e in graph.eqns:
            assert e.prim.elementwise and not e.prim.effectful, f"ScalarFn with a {e.prim.name}"
        self.graph = graph
        self.text = " ".join(line.strip() for line in pp_graph(graph).splitlines())
        self._hash = hash(self.text)

    @property
    def in_dtypes(self) -> tuple:
        return tuple(np.dtype(v.aval.dtype) for v in self.graph.invars)

    @property
    def out_dtype(self) -> np.dtype:
        return np.dtype(self.graph.outvars[0].aval.dtype)

    def __call__(self, *xs) -> np.ndarray:
        return eval_graph(self.graph, xs, lambda e, vs: e.prim.impl(*vs, **e.params))[0]

    def __eq__(self, other):
        return isinstance(other, ScalarFn) and other.text == self.text

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return self.text

    # a plain form (names, indices, values) for JSON caches and pickling: no code, no objects
    def to_rows(self) -> tuple:
        g = self.graph
        num = {v.id: i for i, v in enumerate(g.invars)}
        rows = []
        for e in g.eqns:
            ins = tuple(num[a.id] if isinstance(a, Var) else (a.val.item(), a.aval.dtype.name) for a in e.inputs)
            num[e.outputs[0].id] = len(num)
            rows.append((e.prim.name, ins, tuple(sorted(e.params.items()))))
        return tuple(d.name for d in self.in_dtypes), tuple(rows), num[g.outvars[0].id]

    @staticmethod
    def from_rows(rows) -> "ScalarFn":
        in_dtypes, eqns, out = rows
        vs = [Var(ShapedArray((), dtypes.canonicalize(d))) for d in in_dtypes]
        invars, body = tuple(vs), []
        for name, ins, params in eqns:
            atoms = tuple(vs[i] if isinstance(i, int) else
                          Literal(i[0], ShapedArray((), dtypes.canonicalize(i[1]))) for i in ins)
            prim = PRIMITIVES[name]
            (aval,) = prim.abstract_eval(*(a.aval for a in atoms), **dict(params))
            o = Var(aval.strip_weak())
            body.append(Eqn(prim, atoms, (o,), dict(params)))
            vs.append(o)
        return ScalarFn(Graph((), invars, tuple(body), (vs[out],)))

    def __reduce__(self):
        return ScalarFn.from_rows, (self.to_rows(),)


def _epilogue_rule(name: str, out: ShapedArray, vector: tuple, what: str, epilogue, lhs, rhs, *extras):
    """The result of a product `out` (a GEMM's or a convolution's) through its epilogue: each extra
    has out's shape or is `vector` (a row of it, a bias per feature), of out's float dtype."""
    if dtypes.compute_dtype(out.dtype) != np.float32:
        raise dtype_error(name, "needs float32, float16 or bfloat16 operands", lhs, rhs)
    for x in extras:
        if x.shape not in (out.shape, vector) or x.dtype != out.dtype:
            raise shape_error(name, f"an epilogue operand must be {out} or {what}", lhs, rhs, *extras)
    if not isinstance(epilogue, ScalarFn) or epilogue.in_dtypes != (np.dtype(out.dtype),) * (1 + len(extras)):
        raise shape_error(name, f"the epilogue {epilogue!r} does not take the product and "
                          f"{len(extras)} extras of dtype {out.dtype}", lhs, rhs, *extras)
    return ShapedArray(out.shape, epilogue.out_dtype)


def _fused_gemm_rule(lhs, rhs, *extras, dimension_numbers, preferred_element_type, epilogue):
    out = _dot_rule(lhs, rhs, dimension_numbers=dimension_numbers,
                    preferred_element_type=preferred_element_type)
    return _epilogue_rule("fused_gemm", out, out.shape[-1:], "a row of it", epilogue, lhs, rhs, *extras)


def _fused_gemm_impl(lhs, rhs, *extras, dimension_numbers, preferred_element_type, epilogue):
    cd = dtypes.compute_dtype(lhs.dtype)
    y = _dot_impl(lhs.astype(cd), rhs.astype(cd), dimension_numbers=dimension_numbers,
                  preferred_element_type=epilogue.in_dtypes[0])  # the product as the graph had it
    return np.asarray(epilogue(y, *extras), epilogue.out_dtype)


fused_gemm = Primitive("fused_gemm", _fused_gemm_rule, _fused_gemm_impl, compile_only=True)


# ---- convolution ----------------------------------------------------------------------------------
#
# conv(lhs, rhs; window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
#      feature_group_count, batch_group_count): JAX's conv_general_dilated (a cross-correlation).
# dimension_numbers = (lhs_spec, rhs_spec, out_spec), axis tuples: lhs (batch, feature, spatial...),
# rhs (out feature, in feature, spatial...), out (batch, feature, spatial...), so every layout
# (NCHW, NHWC, OIHW, HWIO, ...) is read where it lies. padding: a (low, high) pair per spatial axis
# of the lhs after its dilation (negative crops). feature groups: lhs features in G groups, group g
# seen by output features g*O/G ..; batch groups (the filter gradient of a grouped convolution): the
# lhs batch in B groups, group b making output features b*O/B .. (one of G, B is 1). The GEMM it is
# runs as an implicit GEMM (ir/kernel/conv.py) that reads the windows where they lie.

def conv_dims(lhs_shape, rhs_shape, *, window_strides, padding, lhs_dilation, rhs_dilation,
              dimension_numbers, feature_group_count, batch_group_count) -> tuple:
    """(N, C, spatial in, O, I, kernel spatial, output spatial) of a conv, read through the specs."""
    ls, rs, _ = dimension_numbers
    n, c = lhs_shape[ls[0]], lhs_shape[ls[1]]
    o, i = rhs_shape[rs[0]], rhs_shape[rs[1]]
    sp_in = tuple(lhs_shape[a] for a in ls[2:])
    sp_k = tuple(rhs_shape[a] for a in rs[2:])
    out = []
    for x, k, s, (lo, hi), ld, rd in zip(sp_in, sp_k, window_strides, padding, lhs_dilation, rhs_dilation):
        span = (x - 1) * ld + 1 + lo + hi if x else lo + hi
        eff = (k - 1) * rd + 1
        out.append(max(0, (span - eff) // s + 1) if span >= eff else 0)
    return n, c, sp_in, o, i, sp_k, tuple(out)


def _conv_rule(lhs, rhs, *, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
               feature_group_count, batch_group_count):
    nd = lhs.ndim
    specs = dimension_numbers
    if rhs.ndim != nd or nd < 3 or len(specs) != 3 or \
            any(sorted(s) != list(range(nd)) for s in specs):
        raise shape_error("conv", f"dimension_numbers {specs} must order every axis of lhs and rhs "
                          "of one rank >= 3", lhs, rhs)
    ns = nd - 2
    if not (len(window_strides) == len(padding) == len(lhs_dilation) == len(rhs_dilation) == ns) or \
            min((*window_strides, *lhs_dilation, *rhs_dilation), default=1) < 1 or \
            any(len(p) != 2 for p in padding):
        raise shape_error("conv", f"needs {ns} positive strides and dilations and {ns} (low, high) "
                          f"padding pairs, got strides {window_strides}, padding {padding}, dilations "
                          f"{lhs_dilation}, {rhs_dilation}", lhs, rhs)
    g, b = feature_group_count, batch_group_count
    n, c, _, o, i, _, out = conv_dims(lhs.shape, rhs.shape, window_strides=window_strides, padding=padding,
                                      lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
                                      dimension_numbers=specs, feature_group_count=g,
                                      batch_group_count=b)
    if g < 1 or b < 1 or (g > 1 and b > 1):
        raise shape_error("conv", f"feature_group_count {g} and batch_group_count {b}: positive, "
                          "one of them 1", lhs, rhs)
    if c != i * g or o % g:
        raise shape_error("conv", f"lhs has {c} features: the rhs's {i} input features times "
                          f"feature_group_count {g}, dividing its {o} output features", lhs, rhs)
    if n % b or o % b:
        raise shape_error("conv", f"batch_group_count {b} must divide the lhs batch {n} and the "
                          f"{o} output features", lhs, rhs)
    if lhs.dtype != rhs.dtype or not dtypes.is_float(lhs.dtype):
        raise dtype_error("conv", "lhs and rhs must be floats of one dtype", lhs, rhs)
    shape = [0] * nd
    for a, size in zip(specs[2], (n // b, o, *out)):
        shape[a] = size
    return ShapedArray(tuple(shape), lhs.dtype, _weak(lhs, rhs))


def conv_patches(x, window_strides, padding, lhs_dilation, rhs_dilation, kernel, out):
    """numpy: x (N, C, spatial...) dilated and padded (negative padding crops), then for every
    kernel tap and output position the element it reads: (N, C, *kernel, *out), a strided view."""
    sp = x.shape[2:]
    dil = [(s - 1) * d + 1 if s else 0 for s, d in zip(sp, lhs_dilation)]
    full = np.zeros(x.shape[:2] + tuple(max(0, n + max(lo, 0) + max(hi, 0)) for n, (lo, hi) in zip(dil, padding)),
                    x.dtype)
    full[(slice(None),) * 2 + tuple(slice(max(lo, 0), max(lo, 0) + n, d) for n, (lo, _), d
                                    in zip(dil, padding, lhs_dilation))] = x
    full = full[(slice(None),) * 2 + tuple(slice(max(-lo, 0), None) for lo, _ in padding)]  # crops
    st = full.strides
    # a view: tap t, position p of axis a at t·rhs_dilation + p·stride (numpy's window view)
    return np.lib.stride_tricks.as_strided(
        full, x.shape[:2] + tuple(kernel) + tuple(out),
        st[:2] + tuple(st[2 + a] * d for a, d in enumerate(rhs_dilation)) +
        tuple(st[2 + a] * s for a, s in enumerate(window_strides)), writeable=False)


def _conv_impl(lhs, rhs, *, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
               feature_group_count, batch_group_count):
    ls, rs, os_ = dimension_numbers
    cd = dtypes.compute_dtype(lhs.dtype)
    x = np.transpose(lhs, ls).astype(cd)
    w = np.transpose(rhs, rs).astype(cd)
    g, b = feature_group_count, batch_group_count
    n, c = x.shape[:2]
    o, i = w.shape[:2]
    kernel = w.shape[2:]
    out_sp = conv_dims(x.shape, w.shape, window_strides=window_strides, padding=padding,
                       lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
                       dimension_numbers=(tuple(range(x.ndim)),) * 3, feature_group_count=g,
                       batch_group_count=b)[-1]
    nb, og, taps, positions = n // b, o // (g * b), math.prod(kernel), math.prod(out_sp)
    # im2col and one matmul per group (BLAS): patches (b, g, input feature x tap, image x position)
    pt = conv_patches(x, window_strides, padding, lhs_dilation, rhs_dilation, kernel, out_sp)
    ns = len(kernel)
    pt = pt.reshape((b, nb, g, i) + pt.shape[2:])  # (splitting axes of a view: still a view)
    order = (0, 2, 3) + tuple(range(4, 4 + ns)) + (1,) + tuple(range(4 + ns, 4 + 2 * ns))
    pt = np.ascontiguousarray(pt.transpose(order)).reshape(b, g, i * taps, nb * positions)  # one copy
    y = w.reshape(b, g, og, i * taps) @ pt
    y = y.reshape(b, g, og, nb, positions).transpose(3, 0, 1, 2, 4)  # output features (b, g, o) in order
    return np.transpose(y.reshape((nb, o) + out_sp), np.argsort(os_)).astype(lhs.dtype)


conv = Primitive("conv", _conv_rule, _conv_impl)


# fused_conv(lhs, rhs, *extras; <conv's parameters>, epilogue): epilogue(conv(lhs, rhs), *extras)
# elementwise, made by the epilogue pass (ir/passes/gemm_epilogue.py) as fused_gemm is; an extra
# has the output's shape or is a vector along its features (a bias), read per output feature.

def conv_params(params: dict) -> dict:
    return {k: v for k, v in params.items() if k != "epilogue"}


def _fused_conv_rule(lhs, rhs, *extras, epilogue, **params):
    out = _conv_rule(lhs, rhs, **params)
    feats = out.shape[params["dimension_numbers"][2][1]]
    return _epilogue_rule("fused_conv", out, (feats,), f"a vector of its {feats} features", epilogue, lhs, rhs,
                          *extras)


def per_feature(x, shape, feature_axis: int):
    """numpy: a vector of output features broadcast to the output's shape (an array of it: itself)."""
    if x.shape == tuple(shape):
        return x
    return np.broadcast_to(x.reshape([-1 if a == feature_axis else 1 for a in range(len(shape))]), shape)


def _fused_conv_impl(lhs, rhs, *extras, epilogue, **params):
    y = _conv_impl(lhs, rhs, **params)  # the convolution as the graph had it
    axis = params["dimension_numbers"][2][1]
    return np.asarray(epilogue(y, *(per_feature(x, y.shape, axis) for x in extras)), epilogue.out_dtype)


fused_conv = Primitive("fused_conv", _fused_conv_rule, _fused_conv_impl, compile_only=True)


# ---- fused attention (made by nn.dot_product_attention and the attention pattern pass) ----------
#
# fused_attention(q, k, v[, bias]; scale, causal, dims) = softmax(q kᵀ·scale + bias, causal) v.
# dims = (q_dims, k_dims, v_dims), each (batch axes..., sequence axis, feature axis) of that
# operand, so any layout reads in place ((B, H, S, D), (B, S, H, D), ...). The output is laid out
# like q with q's feature axis sized as v's. bias (additive, -inf masks out) has the canonical
# shape (batch..., Sq, Sk), size-1 axes broadcasting. causal: query i sees keys j <= i + Sk - Sq.
# A query with no key left to attend to gets zeros, never NaN (nn.softmax's rule).

def _attention_check(name, q, k, v, bias, dims):
    if len(dims) != 3 or any(len(d) != a.ndim or sorted(d) != list(range(a.ndim))
                             for d, a in zip(dims, (q, k, v))):
        raise shape_error(name, f"dims {dims} must list every axis of q, k and v", q, k, v)
    (qd, kd, vd) = dims
    qs, ks, vs = ([a.shape[i] for i in d] for a, d in zip((q, k, v), dims))
    if not (qs[:-2] == ks[:-2] == vs[:-2]) or qs[-1] != ks[-1] or ks[-2] != vs[-2]:
        raise shape_error(name, "q, k, v need equal batch axes, q and k equal feature sizes, "
                          "k and v equal sequence lengths", q, k, v)
    for a in (q, k, v):
        if not dtypes.is_float(a.dtype) or a.dtype != q.dtype:
            raise dtype_error(name, "q, k, v must be floats of one dtype", q, k, v)
    if bias is not None:
        want = tuple(qs[:-2]) + (qs[-2], ks[-2])
        if bias.ndim != len(want) or any(b not in (1, w) for b, w in zip(bias.shape, want)):
            raise ShapeError(with_user_line(
                f"{name}: the mask/bias of shape {bias.shape} does not broadcast to the scores' "
                f"shape {want} (batch..., Sq, Sk) (q {q.shape}, k {k.shape})"))
        if bias.dtype != q.dtype:
            raise dtype_error(name, "the bias must have q's dtype", q, bias)
    out = list(q.shape)
    out[qd[-1]] = vs[-1]
    return ShapedArray(tuple(out), q.dtype)


def _fused_attention_rule(q, k, v, *bias, scale, causal, dims):
    return _attention_check("fused_attention", q, k, v, bias[0] if bias else None, dims)


def _canonical(x, d):
    """An operand in the canonical layout (batch..., S, D), in the compute dtype: a view where
    it has that dtype (numpy's matmul reads transposed operands in place)."""
    return np.transpose(x, d).astype(np.float32 if x.dtype.itemsize < 4 else x.dtype, copy=False)


_causal_masks: dict = {}


def _causal_mask(sq: int, sk: int) -> np.ndarray:
    """Where a (sq, sk) score is masked out by causality (key j > query i + sk - sq), made once."""
    mask = _causal_masks.get((sq, sk))
    if mask is None:
        if len(_causal_masks) > 64:
            _causal_masks.clear()
        mask = _causal_masks[sq, sk] = ~np.tri(sq, sk, sk - sq, dtype=bool)
    return mask


def attention_scores(q, k, bias, scale, causal, dims):
    """numpy: the scores q kᵀ·scale + bias, -inf where masked, in (batch..., Sq, Sk): a fresh
    array, which its callers then change in place."""
    s = _canonical(q, dims[0]) @ np.swapaxes(_canonical(k, dims[1]), -1, -2)
    s *= scale
    if bias is not None:
        s += bias
    if causal:
        np.copyto(s, -np.inf, where=_causal_mask(*s.shape[-2:]))
    return s


def attention_probs(q, k, bias, scale, causal, dims):
    """numpy: the attention weights softmax(q kᵀ·scale + bias) in (batch..., Sq, Sk), in place
    on the scores (one array of that size, not five: the reference runs tiered first calls)."""
    s = attention_scores(q, k, bias, scale, causal, dims)
    m = np.max(s, axis=-1, keepdims=True)
    s -= np.where(np.isfinite(m), m, 0)
    e = np.exp(s, out=s)
    total = np.sum(e, axis=-1, keepdims=True)
    e /= np.where(total > 0, total, 1)
    return e


def _to_layout(x, d, dtype):
    """Canonical (batch..., S, D) back to an operand's own layout (a view where x has dtype)."""
    return np.transpose(x, np.argsort(d)).astype(dtype, copy=False)


def _fused_attention_impl(q, k, v, *bias, scale, causal, dims):
    p = attention_probs(q, k, bias[0] if bias else None, scale, causal, dims)
    return _to_layout(p @ _canonical(v, dims[2]), dims[0], q.dtype)


fused_attention = Primitive("fused_attention", _fused_attention_rule, _fused_attention_impl)


# fused_attention_stats: fused_attention that also returns its rows' softmax statistics, for the
# backward to read instead of recomputing them (one product of q kᵀ fewer). Made only by the
# pass that pairs a forward with its backward (ir/passes/attention.attention_stats). The stats
# are (batch..., Sq, 2) in the compute dtype, canonical batch order: per query row m, the max
# of its visible scores (0 where it sees no key), and 1/l, l = Σ exp(s - m) (0 where it sees none).

def attention_stats_aval(q, dims) -> ShapedArray:
    shape = tuple(q.shape[a] for a in dims[0][:-1]) + (2,)
    return ShapedArray(shape, dtypes.compute_dtype(q.dtype))


def _fused_attention_stats_rule(q, k, v, *bias, scale, causal, dims):
    out = _attention_check("fused_attention_stats", q, k, v, bias[0] if bias else None, dims)
    return out, attention_stats_aval(q, dims)


def attention_row_stats(s) -> tuple:
    """numpy: (m, 1/l) of scores s (batch..., Sq, Sk), -inf masking out, as the stats define."""
    m = np.max(s, axis=-1)
    m = np.where(np.isfinite(m), m, 0)
    total = np.sum(np.exp(s - m[..., None]), axis=-1)
    return m, np.where(total > 0, 1 / np.where(total > 0, total, 1), 0)


def _fused_attention_stats_impl(q, k, v, *bias, scale, causal, dims):
    s = attention_scores(q, k, bias[0] if bias else None, scale, causal, dims)
    stats = np.stack(attention_row_stats(s), axis=-1).astype(attention_stats_aval(q, dims).dtype)
    return _fused_attention_impl(q, k, v, *bias, scale=scale, causal=causal, dims=dims), stats


fused_attention_stats = Primitive("fused_attention_stats", _fused_attention_stats_rule,
                                  _fused_attention_stats_impl, multiple_results=True, compile_only=True)


def attention_bwd_operands(rest, stats: bool):
    """fused_attention_bwd's operands after q, k, v: ([bias], out, dout[, stats]) -> (bias, out,
    dout, stats), absent ones None."""
    if stats:
        *rest, st = rest
    else:
        st = None
    return (rest[0] if len(rest) == 3 else None), rest[-2], rest[-1], st


def _fused_attention_bwd_rule(q, k, v, *rest, scale, causal, dims, stats=False):
    bias, out, dout, st = attention_bwd_operands(rest, stats)
    want = _attention_check("fused_attention_bwd", q, k, v, bias, dims)
    if out.shape != want.shape or dout.shape != want.shape:
        raise shape_error("fused_attention_bwd", f"out and dout must have shape {want.shape}",
                          out, dout)
    want_st = attention_stats_aval(q, dims)
    if st is not None and (st.shape, st.dtype) != (want_st.shape, want_st.dtype):
        raise shape_error("fused_attention_bwd", "stats must be fused_attention_stats' second result", st)
    return ShapedArray((q.size + k.size + v.size,), q.dtype)


def _fused_attention_bwd_impl(q, k, v, *rest, scale, causal, dims, stats=False):
    """dq, dk, dv of fused_attention (FlashAttention's formulas, in float32), packed flat into
    one array (one result keeps the primitive differentiable like any other). stats: the last
    operand is the forward's row statistics (fused_attention_stats), which the reference ignores."""
    bias, out, dout, _ = attention_bwd_operands(rest, stats)
    out, dout = (_canonical(x, dims[0]) for x in (out, dout))
    p = attention_probs(q, k, bias, scale, causal, dims)
    qc, kc, vc = (_canonical(x, d) for x, d in zip((q, k, v), dims))
    dv = np.swapaxes(p, -1, -2) @ dout
    ds = dout @ np.swapaxes(vc, -1, -2)  # dp, then ds = p (dp - rowsum(dout out)) in place
    ds -= np.sum(dout * out, axis=-1, keepdims=True)
    ds *= p
    dq = ds @ kc
    dq *= scale
    dk = np.swapaxes(ds, -1, -2) @ qc
    dk *= scale
    flat = np.empty(q.size + k.size + v.size, q.dtype)  # each gradient written once, in its layout
    at = 0
    for g, d, x in zip((dq, dk, dv), dims, (q, k, v)):
        flat[at:at + x.size].reshape(x.shape)[...] = np.transpose(g, np.argsort(d))
        at += x.size
    return flat


fused_attention_bwd = Primitive("fused_attention_bwd", _fused_attention_bwd_rule,
                                _fused_attention_bwd_impl)


# ---- indexing -----------------------------------------------------------------------------

def _gather_rule(operand, indices, *, axis):
    if not dtypes.is_int(indices.dtype):
        raise dtype_error("gather", "indices must be integers", indices)
    _check_axes("gather", operand, (axis,))
    return ShapedArray(operand.shape[:axis] + indices.shape + operand.shape[axis + 1:],
                       operand.dtype, operand.weak_type)


def _gather_impl(operand, indices, *, axis):
    if operand.shape[axis] == 0:
        return np.zeros(operand.shape[:axis] + indices.shape + operand.shape[axis + 1:], operand.dtype)
    return np.take(operand, indices, axis=axis, mode="clip")  # out-of-range indices clamp


gather = Primitive("gather", _gather_rule, _gather_impl)


def _scatter_add_rule(operand, indices, updates, *, axis):
    want = _gather_rule(operand, indices, axis=axis)
    if updates.shape != want.shape or updates.dtype != operand.dtype:
        raise shape_error("scatter_add", f"updates must be {want}", operand, indices, updates)
    return operand


def _scatter_add_impl(operand, indices, updates, *, axis):
    out = np.array(operand, copy=True)
    if out.shape[axis] == 0:
        return out
    idx = np.clip(indices, 0, operand.shape[axis] - 1)
    moved = np.moveaxis(out, axis, 0)
    upd = np.moveaxis(updates.reshape(operand.shape[:axis] + (-1,) + operand.shape[axis + 1:]), axis, 0)
    np.add.at(moved, idx.reshape(-1), upd.astype(out.dtype))
    return out


scatter_add = Primitive("scatter_add", _scatter_add_rule, _scatter_add_impl)


# ---- calls ----------------------------------------------------------------------------------

def _call_rule(*avals, graph, name, n_consts, **rules):
    want = [(a.shape, a.dtype) for a in graph.in_avals]
    got = [(a.shape, a.dtype) for a in avals]
    if got != want:
        raise ShapeError(with_user_line(f"{name}: operands {[str(a) for a in avals]} do not "
                                        f"match its body's inputs {[str(a) for a in graph.in_avals]}"))
    return graph.out_avals


def _call_impl(*xs, graph, name, n_consts, **rules):
    return run_graph(graph, xs)


# A call is a function kept whole in the graph: `graph` is its closed body (its first n_consts
# inputs are the body's captured constants), with the user's derivative rules beside it. Traces
# that know the rule use it (tracer/core.bind hands custom_vjp/custom_jvp calls to the top
# trace again); the pass pipeline inlines every call before fusion (ir/passes/inline.py).
# - tile_op: one user-defined operator (tilefuse.tile_op), one output; `bwd` a user VJP or None.
tile_call = Primitive("tile_op", lambda *a, **p: _call_rule(*a, **p)[0],
                      lambda *x, **p: _call_impl(*x, **p)[0])
# - custom_vjp_call: a tx.custom_vjp function; fwd(*args) -> (outs, residuals), bwd(residuals,
#   cts) -> cts of args (flat lists).
custom_vjp_call = Primitive("custom_vjp_call", _call_rule, _call_impl, multiple_results=True)
# - custom_jvp_call: a tx.custom_jvp function; jvp(primals, tangents) -> (outs, tangents out).
custom_jvp_call = Primitive("custom_jvp_call", _call_rule, _call_impl, multiple_results=True)
CALLS = (tile_call, custom_vjp_call, custom_jvp_call)


# ---- effects --------------------------------------------------------------------------------

def _debug_print_impl(*xs, fmt, names):
    print(fmt.format(*xs, **{n: x for n, x in zip(names, xs[len(xs) - len(names):])}))
    return []


debug_print = Primitive("debug_print", lambda *xs, fmt, names: [], _debug_print_impl,
                        multiple_results=True, effectful=True)


# ---- sorting and linear algebra: vendor kernels run by numpy on the host ------------------------
#
# These run through numpy (its sort, its LAPACK) on every device: the dispatcher's "numpy_host"
# implementation (runtime/host.py) reads the operands to the host and writes the results back,
# one launch the profiler times with its copies. Operands carry any leading batch axes.
# A decomposition's several results are packed into one array, each flattened in order along
# the last axis (`packed_sizes` says how), so it differentiates like any one-result primitive
# (fused_attention_bwd does the same); tilefuse.numpy.linalg unpacks them. Where LAPACK fails
# (a matrix that is singular, not positive definite, or holds NaN) the results are NaN, as in
# JAX, never an exception from inside a kernel.

HOST_PRIMITIVES: list[Primitive] = []


def _host_primitive(name: str, rule: Callable, impl: Callable) -> Primitive:
    p = Primitive(name, rule, impl)
    HOST_PRIMITIVES.append(p)
    return p


def _argsort_rule(*keys, axis, descending=False):
    if not keys or any(k.shape != keys[0].shape for k in keys):
        raise shape_error("argsort", "needs one or more keys of one shape", *keys)
    _check_axes("argsort", keys[0], (axis,))
    for k in keys:
        _check_kinds("argsort", ALL, k)
    return ShapedArray(keys[0].shape, dtypes.int32)


def _argsort_impl(*keys, axis, descending=False):
    """Stable: keys[0] decides first, ties go to the next key, then to the original order; NaN
    sorts last (numpy's and JAX's order), first when descending (JAX's), where ties still keep
    their original order."""
    ks = [np.asarray(k, dtypes.compute_dtype(k.dtype)) for k in keys]
    if descending:
        ks = [_descending_rank(k, axis) for k in ks]
    return np.lexsort(ks[::-1], axis=axis).astype(np.int32) if ks[0].ndim else np.zeros((), np.int32)


def _descending_rank(k, axis):
    """-(how many values sort before each one): ordering by it ascending is the descending order,
    NaN first (JAX's), equal values keeping their original order."""
    k = np.moveaxis(k, axis, -1)
    s = np.sort(k, axis=-1)
    r = np.empty(k.shape, np.int64)
    for i in np.ndindex(*k.shape[:-1]):
        r[i] = np.searchsorted(s[i], k[i], side="left")
    return np.moveaxis(-r, -1, axis)


argsort = _host_primitive("argsort", _argsort_rule, _argsort_impl)


def _float_matrices(name, *avals, square=True):
    for a in avals:
        if not dtypes.is_float(a.dtype) or a.dtype != avals[0].dtype:
            raise dtype_error(name, "needs float operands of one dtype", *avals)
        if a.ndim < 2 or (square and a is avals[0] and a.shape[-1] != a.shape[-2]):
            raise shape_error(name, f"needs {'square ' if square else ''}matrices (..., m, n)", *avals)


def _lapack(fn):
    """numpy.linalg's `fn` over stacked matrices in their compute dtype (16-bit floats in float32),
    the results in the operands' dtype; a matrix LAPACK rejects gives NaN results."""
    def impl(*xs, **params):
        d = xs[0].dtype
        cd = dtypes.compute_dtype(d)
        xs = [np.asarray(x, cd) for x in xs]
        with np.errstate(all="ignore"):
            try:
                out = fn(*xs, **params)
            except np.linalg.LinAlgError:
                out = _lapack_each(fn, xs, params)
        return np.asarray(out, d)
    return impl


def _lapack_each(fn, xs, params):
    """fn matrix by matrix, NaN for the ones LAPACK rejects."""
    batch = xs[0].shape[:-2]
    probe = None
    outs = {}
    for i in np.ndindex(*batch):
        try:
            outs[i] = np.asarray(fn(*(x[i] for x in xs), **params))
            probe = outs[i]
        except np.linalg.LinAlgError:
            outs[i] = None
    if probe is None:  # every matrix failed: the result's shape from a well-posed stand-in
        probe = np.asarray(fn(*(np.broadcast_to(np.eye(x.shape[-2], x.shape[-1], dtype=x.dtype), x.shape[-2:])
                                for x in xs), **params))
    out = np.full(batch + probe.shape, np.nan, probe.dtype)
    for i, o in outs.items():
        if o is not None:
            out[i] = o
    return out


def _sym(a):
    return (a + np.swapaxes(a, -1, -2)) * 0.5


def _square_rule(name):
    def rule(a):
        _float_matrices(name, a)
        return a
    return rule


# cholesky(a): the lower factor L of (a + aᵀ)/2 = L Lᵀ (JAX symmetrizes its input so).
cholesky = _host_primitive("cholesky", _square_rule("cholesky"),
                           _lapack(lambda a: np.linalg.cholesky(_sym(a))))


def _solve_rule(a, b, **params):
    _float_matrices("solve", a, b)
    if b.ndim != a.ndim or b.shape[:-2] != a.shape[:-2] or b.shape[-2] != a.shape[-1]:
        raise shape_error("solve", "needs a (..., n, n) and b (..., n, k) with equal batch axes", a, b)
    return b


# solve(a, b) = a⁻¹ b, b a stack of (n, k) matrices.
solve = _host_primitive("solve", _solve_rule, _lapack(np.linalg.solve))


def _triangle(a, lower, unit_diagonal):
    t = np.tril(a) if lower else np.triu(a)
    if unit_diagonal:
        n = a.shape[-1]
        t = t * (1 - np.eye(n, dtype=a.dtype)) + np.eye(n, dtype=a.dtype)
    return t


def _triangular_solve_impl(a, b, *, lower, transpose_a, unit_diagonal):
    t = _triangle(a, lower, unit_diagonal)
    return np.linalg.solve(np.swapaxes(t, -1, -2) if transpose_a else t, b)


# triangular_solve(a, b) solves op(T) x = b, T the lower (or upper) triangle of a (its diagonal
# taken as ones with unit_diagonal), op(T) = Tᵀ with transpose_a; entries off the triangle are
# never read (JAX's lax.linalg.triangular_solve with left_side=True).
triangular_solve = _host_primitive("triangular_solve", lambda a, b, **p: _solve_rule(a, b),
                                   _lapack(_triangular_solve_impl))


def _slogdet_rule(a):
    _float_matrices("slogdet", a)
    return ShapedArray(a.shape[:-2] + (2,), a.dtype)


def _slogdet_impl(a):
    sign, logdet = np.linalg.slogdet(a)
    return np.stack([sign, logdet], axis=-1)


# slogdet(a) -> packed (sign, log|det|).
slogdet = _host_primitive("slogdet", _slogdet_rule, _lapack(_slogdet_impl))


def packed_sizes(prim_name: str, shape: tuple, **params) -> list[tuple]:
    """The shapes (without batch axes) of the results packed by a decomposition of a matrix of
    shape (..., m, n)."""
    m, n = shape[-2:]
    k = min(m, n)
    if prim_name == "qr":
        kq = m if params["full_matrices"] else k
        return [(m, kq), (kq, n)]
    if prim_name == "eigh":
        return [(n,), (n, n)]
    if prim_name == "svd":
        if not params["compute_uv"]:
            return [(k,)]
        ku, kv = (m, n) if params["full_matrices"] else (k, k)
        return [(m, ku), (k,), (kv, n)]
    if prim_name == "slogdet":
        return [(), ()]
    raise KeyError(prim_name)


def _packed_rule(name, square):
    def rule(a, **params):
        _float_matrices(name, a, square=square)
        total = sum(int(np.prod(s, dtype=np.int64)) for s in packed_sizes(name, a.shape, **params))
        return ShapedArray(a.shape[:-2] + (total,), a.dtype)
    return rule


def _pack(*parts, batch):
    return np.concatenate([np.asarray(p).reshape(batch + (-1,)) for p in parts], axis=-1)


# qr(a) -> packed (q, r); eigh(a) -> packed (w ascending, v: eigenvectors in columns) of
# (a + aᵀ)/2; svd(a) -> packed (u, s descending, vh), or s alone without compute_uv.
qr = _host_primitive("qr", _packed_rule("qr", False), _lapack(
    lambda a, full_matrices: _pack(*np.linalg.qr(a, "complete" if full_matrices else "reduced"),
                                   batch=a.shape[:-2])))
eigh = _host_primitive("eigh", _packed_rule("eigh", True), _lapack(
    lambda a: _pack(*np.linalg.eigh(_sym(a)), batch=a.shape[:-2])))
svd = _host_primitive("svd", _packed_rule("svd", False), _lapack(
    lambda a, full_matrices, compute_uv: _pack(*np.linalg.svd(a, full_matrices=full_matrices),
                                               batch=a.shape[:-2])
    if compute_uv else np.linalg.svd(a, compute_uv=False)))


# ---- structured control flow (tilefuse.lax) ----------------------------------------------------
#
# Primitives whose parameters hold sub-graphs, closed as call bodies are: a body's captured
# constants are its leading inputs, passed as operands, so every transformation sees them. The
# graph of each body is printed, type-checked and optimised with its equation (ir/core.py,
# ir/passes/manager.py); the runtime compiles each body once and loops over device buffers
# (runtime/control_flow.py); the rules of autodiff and vmap rewrite the bodies.
# - cond(index, *operands; branches): branches[clamp(index)](*operands), every branch taking all
#   operands (the constants of every branch, then the user's operands).
# - while(*cond_consts, *body_consts, *init; cond_graph, body_graph, cond_nconsts, body_nconsts):
#   carry = init; while cond_graph(*cond_consts, *carry): carry = body_graph(*body_consts, *carry).
# - scan(*consts, *init, *xs; body, length, reverse, n_consts, n_carry): for each step t (from the
#   last when reverse) carry, y_t = body(*consts, *carry, *(x[t] for x in xs)); the results are the
#   final carry and the ys stacked along a new leading axis of size length.

def _avals_text(avals) -> str:
    return "(" + ", ".join(a.str_short() for a in avals) + ")"


def _same_types(got, want) -> bool:
    return len(got) == len(want) and all((a.shape, np.dtype(a.dtype)) == (b.shape, np.dtype(b.dtype))
                                         for a, b in zip(got, want))


def _sub_error(prim: str, what: str, got, want) -> ShapeError:
    return ShapeError(with_user_line(f"{prim}: {what}: {_avals_text(got)} but {_avals_text(want)}"))


def _strong(avals) -> list[ShapedArray]:
    return [ShapedArray(a.shape, a.dtype) for a in avals]


def _cond_rule(index, *ops, branches):
    if index.shape != () or not dtypes.is_int(index.dtype):
        raise dtype_error("cond", "the branch index must be an integer scalar", index)
    if not branches:
        raise ShapeError(with_user_line("cond: needs at least one branch"))
    for k, b in enumerate(branches):
        if not _same_types(ops, b.in_avals):
            raise _sub_error("cond", f"operands do not match the inputs of branch {k}", ops, b.in_avals)
        if not _same_types(b.out_avals, branches[0].out_avals):
            raise _sub_error("cond", f"branch {k} and branch 0 give different outputs",
                             b.out_avals, branches[0].out_avals)
    return _strong(branches[0].out_avals)


def run_graph(graph: Graph, args) -> list:
    """A graph on numpy values, by the reference implementations (the bodies of control flow:
    prepared once per body, run every iteration)."""
    interpreter = _interpreters.get(graph)
    if interpreter is None:
        interpreter = _interpreters[graph] = Interpreter(graph)
    return interpreter(args)


class Interpreter:
    """A graph prepared once to run many times on numpy values by the primitives' reference
    implementations (the ref backend's programs, the bodies of control flow). Each value is
    dropped after its last use, so the memory it held serves the next results while it is still
    in cache (the char-GPT step at batch 16: 58 ms against 66 keeping every value to the end),
    and numpy's floating-point warnings are silenced once per run, not per equation."""
    __slots__ = ("_fixed", "_invars", "_steps", "_outvars")  # (no graph: _interpreters' values
    # must not hold their weak keys)

    def __init__(self, graph: Graph):
        # every value by a key: a variable's id, or a literal's (negative) place in _fixed
        self._fixed = {v.id: c for v, c in zip(graph.constvars, graph.consts)}

        def key(a) -> int:
            if not isinstance(a, Literal):
                return a.id
            k = -1 - len(self._fixed)
            self._fixed[k] = a.val
            return k
        self._invars = tuple(v.id for v in graph.invars)
        self._outvars = tuple(key(v) for v in graph.outvars)
        # from the last equation back: what each one reads for the last time (and its results
        # that nothing reads) is dropped after it
        read = set(self._outvars)
        steps = []
        for e in reversed(graph.eqns):
            ins = tuple(key(a) for a in e.inputs)
            drops = [k for k in (*ins, *(v.id for v in e.outputs)) if k >= 0 and k not in read]
            read.update(ins)
            steps.append((e.prim, e.params, ins, tuple(v.id for v in e.outputs), tuple(set(drops))))
        steps.reverse()
        self._steps = tuple(steps)

    def __call__(self, args) -> list:
        env = dict(self._fixed)
        for k, x in zip(self._invars, args, strict=True):
            env[k] = x
        with np.errstate(all="ignore"):  # (as Primitive.impl)
            for prim, params, ins, outs, drops in self._steps:
                for k, x in zip(outs, prim.results(*[env[k] for k in ins], **params), strict=True):
                    env[k] = x
                for k in drops:
                    del env[k]
        return [env[k] for k in self._outvars]


_interpreters: "weakref.WeakKeyDictionary[Graph, Interpreter]" = weakref.WeakKeyDictionary()


def _cond_impl(index, *ops, branches):
    return run_graph(branches[int(np.clip(index, 0, len(branches) - 1))], ops)


cond_p = Primitive("cond", _cond_rule, _cond_impl, multiple_results=True)


def _while_rule(*args, cond_graph, body_graph, cond_nconsts, body_nconsts):
    cc, bc, init = args[:cond_nconsts], args[cond_nconsts:cond_nconsts + body_nconsts], \
        args[cond_nconsts + body_nconsts:]
    if not _same_types([*cc, *init], cond_graph.in_avals):
        raise _sub_error("while_loop", "the carry does not match cond_fun's inputs", init,
                         cond_graph.in_avals[cond_nconsts:])
    out = cond_graph.out_avals
    if len(out) != 1 or out[0].shape != () or not dtypes.is_bool(out[0].dtype):
        raise ShapeError(with_user_line(f"while_loop: cond_fun must return a bool scalar, got "
                                        f"{_avals_text(out)}"))
    if not _same_types([*bc, *init], body_graph.in_avals):
        raise _sub_error("while_loop", "the carry does not match body_fun's inputs", init,
                         body_graph.in_avals[body_nconsts:])
    if not _same_types(body_graph.out_avals, init):
        raise _sub_error("while_loop", "body_fun's output does not match its input carry",
                         body_graph.out_avals, init)
    return _strong(init)


def _while_impl(*args, cond_graph, body_graph, cond_nconsts, body_nconsts):
    cc, bc = args[:cond_nconsts], args[cond_nconsts:cond_nconsts + body_nconsts]
    carry = list(args[cond_nconsts + body_nconsts:])
    while bool(run_graph(cond_graph, [*cc, *carry])[0]):
        carry = run_graph(body_graph, [*bc, *carry])
    return carry


while_p = Primitive("while", _while_rule, _while_impl, multiple_results=True)


def _scan_split(args, n_consts, n_carry):
    return args[:n_consts], args[n_consts:n_consts + n_carry], args[n_consts + n_carry:]


def _scan_rule(*args, body, length, reverse, n_consts, n_carry):
    consts, init, xs = _scan_split(args, n_consts, n_carry)
    for x in xs:
        if x.ndim == 0 or x.shape[0] != length:
            raise shape_error("scan", f"every xs must have a leading axis of the length {length}", *xs)
    slices = [ShapedArray(x.shape[1:], x.dtype) for x in xs]
    if not _same_types([*consts, *init, *slices], body.in_avals):
        raise _sub_error("scan", "the carry and the slices of xs do not match the body's inputs",
                         [*init, *slices], body.in_avals[n_consts:])
    outs = body.out_avals
    if not _same_types(outs[:n_carry], init):
        raise _sub_error("scan", "the body's carry output does not match its carry input",
                         outs[:n_carry], init)
    return _strong(init) + [ShapedArray((length, *y.shape), y.dtype) for y in outs[n_carry:]]


def _scan_impl(*args, body, length, reverse, n_consts, n_carry):
    consts, carry, xs = _scan_split(args, n_consts, n_carry)
    ys = [np.empty((length, *a.shape), a.dtype) for a in body.out_avals[n_carry:]]
    for t in (range(length - 1, -1, -1) if reverse else range(length)):
        outs = run_graph(body, [*consts, *carry, *(x[t] for x in xs)])
        carry = outs[:n_carry]
        for y, o in zip(ys, outs[n_carry:]):
            y[t] = o
    return [*carry, *ys]


scan_p = Primitive("scan", _scan_rule, _scan_impl, multiple_results=True)
CONTROL_FLOW = (cond_p, while_p, scan_p)


def subgraphs(params: dict) -> list[tuple[str, int | None, Graph]]:
    """(parameter, position in a tuple or None, graph) for every sub-graph among an equation's
    parameters."""
    out = []
    for k, v in params.items():
        if isinstance(v, Graph):
            out.append((k, None, v))
        elif isinstance(v, tuple) and v and all(isinstance(g, Graph) for g in v):
            out.extend((k, i, g) for i, g in enumerate(v))
    return out


def replace_subgraphs(params: dict, fn: Callable[[Graph], Graph]) -> dict:
    """params with fn applied to every sub-graph (the same dict when nothing changed)."""
    new = dict(params)
    changed = False
    for k, v in params.items():
        if isinstance(v, Graph):
            new[k] = fn(v)
            changed |= new[k] is not v
        elif isinstance(v, tuple) and v and all(isinstance(g, Graph) for g in v):
            new[k] = tuple(fn(g) for g in v)
            changed |= any(a is not b for a, b in zip(new[k], v))
    return new if changed else params


# ---- dynamic slicing ----------------------------------------------------------------------------
#
# dynamic_slice(operand, *starts; slice_sizes) and dynamic_update_slice(operand, update, *starts):
# one integer scalar start per axis, clamped (as in JAX) so the window lies inside the operand.

def _check_starts(name, operand, starts):
    if len(starts) != operand.ndim:
        raise shape_error(name, f"needs one start index per axis ({operand.ndim}), got {len(starts)}",
                          operand)
    for s in starts:
        if s.shape != () or not dtypes.is_int(s.dtype):
            raise dtype_error(name, "start indices must be integer scalars", *starts)


def clamped_starts(starts, shape, sizes) -> list[int]:
    return [int(np.clip(int(s), 0, n - k)) for s, n, k in zip(starts, shape, sizes)]


def _dynamic_slice_rule(operand, *starts, slice_sizes):
    _check_starts("dynamic_slice", operand, starts)
    if len(slice_sizes) != operand.ndim or any(not 0 <= k <= n for k, n in zip(slice_sizes, operand.shape)):
        raise shape_error("dynamic_slice", f"slice_sizes {tuple(slice_sizes)} must fit the operand",
                          operand)
    return ShapedArray(tuple(slice_sizes), operand.dtype, operand.weak_type)


def _dynamic_slice_impl(operand, *starts, slice_sizes):
    st = clamped_starts(starts, operand.shape, slice_sizes)
    return operand[tuple(slice(s, s + k) for s, k in zip(st, slice_sizes))]


dynamic_slice = Primitive("dynamic_slice", _dynamic_slice_rule, _dynamic_slice_impl)


def _dynamic_update_slice_rule(operand, update, *starts):
    _check_starts("dynamic_update_slice", operand, starts)
    if update.ndim != operand.ndim or any(k > n for k, n in zip(update.shape, operand.shape)):
        raise shape_error("dynamic_update_slice", "the update must have the operand's rank and fit "
                          "inside it", operand, update)
    if update.dtype != operand.dtype:
        raise dtype_error("dynamic_update_slice", "operand and update must have equal dtypes",
                          operand, update)
    return ShapedArray(operand.shape, operand.dtype, operand.weak_type and update.weak_type)


def _dynamic_update_slice_impl(operand, update, *starts):
    out = np.array(operand, copy=True)
    st = clamped_starts(starts, operand.shape, update.shape)
    out[tuple(slice(s, s + k) for s, k in zip(st, update.shape))] = update
    return out


dynamic_update_slice = Primitive("dynamic_update_slice", _dynamic_update_slice_rule,
                                 _dynamic_update_slice_impl)


def has_effect(eqn: Eqn) -> bool:
    """Whether an equation has an effect: an effectful primitive, or control flow whose bodies
    hold one (a debug_print in a loop): passes keep it, in program order, even when its outputs
    go unread."""
    if eqn.prim.effectful:
        return True
    return eqn.prim in CONTROL_FLOW and any(has_effect(e) for _, _, g in subgraphs(eqn.params) for e in g.eqns)
