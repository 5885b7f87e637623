"""The primitive table: every primitive declared once, with its shape/dtype rule and its numpy
reference implementation. Other layers key their rules (autodiff, batching, lowering) by these
objects."""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from . import dtypes
from .core import ShapedArray, eval_graph
from .errors import DTypeError, ShapeError, with_user_line

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
    return ShapeError(with_user_line(f"{prim}: {msg} (operand shapes {shapes})"))


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
    lambda x, y: (x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint64) >> y.astype(
        np.uint32 if x.dtype.itemsize == 4 else np.uint64)).view(x.dtype), ("int",))
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
    if int(np.prod(new_sizes, dtype=np.int64)) != x.size or any(s < 0 for s in new_sizes):
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
    """np.sum, pairwise for floats over any axes: numpy adds pairwise only along the contiguous
    last axis (a column sum of 2e6 tenths: 1.5% off), so the reduced axes are moved last."""
    axis = tuple(sorted(axis))  # (the shape rule checked them: 0 <= a < ndim, no repeats)
    if x.dtype.kind != "f" or axis == tuple(range(x.ndim - len(axis), x.ndim)):
        return np.sum(x, axis=axis)
    keep = [a for a in range(x.ndim) if a not in axis]
    n = int(np.prod([x.shape[a] for a in axis], dtype=np.int64))
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
    batch = [lhs.shape[a] for a in lb]
    lfree = [n for i, n in enumerate(lhs.shape) if i not in lc and i not in lb]
    rfree = [n for i, n in enumerate(rhs.shape) if i not in rc and i not in rb]
    return ShapedArray(tuple(batch + lfree + rfree), preferred_element_type or lhs.dtype,
                       _weak(lhs, rhs))


def _dot_impl(lhs, rhs, *, dimension_numbers, preferred_element_type=None):
    (lc, rc), (lb, rb) = dimension_numbers
    lfree = [i for i in range(lhs.ndim) if i not in lc and i not in lb]
    rfree = [i for i in range(rhs.ndim) if i not in rc and i not in rb]
    cd = dtypes.compute_dtype(lhs.dtype)
    l2 = np.transpose(lhs, (*lb, *lfree, *lc)).astype(cd, copy=False)
    r2 = np.transpose(rhs, (*rb, *rc, *rfree)).astype(cd, copy=False)
    nb = int(np.prod([lhs.shape[i] for i in lb], dtype=np.int64))
    m = int(np.prod([lhs.shape[i] for i in lfree], dtype=np.int64))
    k = int(np.prod([lhs.shape[i] for i in lc], dtype=np.int64))
    n = int(np.prod([rhs.shape[i] for i in rfree], dtype=np.int64))
    out = np.matmul(l2.reshape(nb, m, k), r2.reshape(nb, k, n))
    shape = [lhs.shape[i] for i in lb] + [lhs.shape[i] for i in lfree] + [rhs.shape[i] for i in rfree]
    return out.reshape(shape).astype(preferred_element_type or lhs.dtype)


dot_general = Primitive("dot_general", _dot_rule, _dot_impl)


# ---- fused GEMM (made by the pass ir/passes/gemm_epilogue.py) -----------------------------------
#
# fused_gemm(lhs, rhs, *extras; dimension_numbers, preferred_element_type, epilogue) is
# dot_general followed by `epilogue`, steps applied in order on the float32 result:
# ("add", i) adds extras[i] (the output's shape, or a row vector along its last axis),
# ("affine", a, c) computes y*a + c, and the activations ("relu",), ("gelu_tanh",), ("gelu_erf",),
# ("silu",), ("tanh",), ("sigmoid",).

GEMM_ACTIVATIONS = ("relu", "gelu_tanh", "gelu_erf", "silu", "tanh", "sigmoid")


def _fused_gemm_rule(lhs, rhs, *extras, dimension_numbers, preferred_element_type, epilogue):
    out = _dot_rule(lhs, rhs, dimension_numbers=dimension_numbers,
                    preferred_element_type=preferred_element_type)
    if dtypes.compute_dtype(out.dtype) != np.float32:
        raise dtype_error("fused_gemm", "needs float32, float16 or bfloat16 operands", lhs, rhs)
    for x in extras:
        if x.shape not in (out.shape, out.shape[-1:]) or x.dtype != out.dtype:
            raise shape_error("fused_gemm", f"an epilogue operand must be {out} or a row of it",
                              lhs, rhs, *extras)
    for step in epilogue:
        ok = (step[0] == "add" and len(step) == 2 and 0 <= step[1] < len(extras)) or \
             (step[0] == "affine" and len(step) == 3) or (step[0] in GEMM_ACTIVATIONS and len(step) == 1)
        if not ok:
            raise shape_error("fused_gemm", f"bad epilogue step {step}", lhs, rhs, *extras)
    return out


def gemm_epilogue(y, extras, epilogue):
    """numpy: the epilogue steps on a float32 GEMM result `y` (in place where it can)."""
    for step in epilogue:
        op = step[0]
        if op == "add":
            y = y + np.asarray(extras[step[1]], np.float32)
        elif op == "affine":
            y = y * np.float32(step[1]) + np.float32(step[2])
        elif op == "relu":
            y = np.maximum(y, np.float32(0))
        elif op == "silu":
            y = y / (1 + np.exp(-y))
        elif op == "tanh":
            y = np.tanh(y)
        elif op == "sigmoid":
            y = 1 / (1 + np.exp(-y))
        elif op == "gelu_tanh":
            y = 0.5 * y * (1 + np.tanh(np.float32(math.sqrt(2 / math.pi)) * (y + 0.044715 * (y * y * y))))
        elif op == "gelu_erf":
            y = 0.5 * y * (1 + np.asarray(_erf(y / np.float32(math.sqrt(2))), np.float32))
    return np.asarray(y, np.float32)


def _fused_gemm_impl(lhs, rhs, *extras, dimension_numbers, preferred_element_type, epilogue):
    out = np.dtype(preferred_element_type or lhs.dtype)
    cd = dtypes.compute_dtype(lhs.dtype)
    y = _dot_impl(lhs.astype(cd), rhs.astype(cd), dimension_numbers=dimension_numbers)
    return gemm_epilogue(y.astype(np.float32), extras, epilogue).astype(out)


fused_gemm = Primitive("fused_gemm", _fused_gemm_rule, _fused_gemm_impl, compile_only=True)


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
    return np.transpose(x, d).astype(np.float32 if x.dtype.itemsize < 4 else x.dtype)


def attention_probs(q, k, bias, scale, causal, dims):
    """numpy: the attention weights softmax(q kᵀ·scale + bias) in (batch..., Sq, Sk)."""
    s = _canonical(q, dims[0]) @ np.swapaxes(_canonical(k, dims[1]), -1, -2) * scale
    if bias is not None:
        s = s + bias
    sq, sk = s.shape[-2:]
    if causal:
        s = np.where(np.tri(sq, sk, sk - sq, dtype=bool), s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    total = np.sum(e, axis=-1, keepdims=True)
    return e / np.where(total > 0, total, 1)


def _to_layout(x, d, dtype):
    """Canonical (batch..., S, D) back to an operand's own layout."""
    return np.transpose(x, np.argsort(d)).astype(dtype)


def _fused_attention_impl(q, k, v, *bias, scale, causal, dims):
    p = attention_probs(q, k, bias[0] if bias else None, scale, causal, dims)
    return _to_layout(p @ _canonical(v, dims[2]), dims[0], q.dtype)


fused_attention = Primitive("fused_attention", _fused_attention_rule, _fused_attention_impl)


def _fused_attention_bwd_rule(q, k, v, *rest, scale, causal, dims):
    bias = rest[0] if len(rest) == 3 else None
    out, dout = rest[-2:]
    want = _attention_check("fused_attention_bwd", q, k, v, bias, dims)
    if out.shape != want.shape or dout.shape != want.shape:
        raise shape_error("fused_attention_bwd", f"out and dout must have shape {want.shape}",
                          out, dout)
    return ShapedArray((q.size + k.size + v.size,), q.dtype)


def _fused_attention_bwd_impl(q, k, v, *rest, scale, causal, dims):
    """dq, dk, dv of fused_attention (FlashAttention's formulas, in float32), packed flat into
    one array (one result keeps the primitive differentiable like any other)."""
    bias = rest[0] if len(rest) == 3 else None
    out, dout = (_canonical(x, dims[0]) for x in rest[-2:])
    p = attention_probs(q, k, bias, scale, causal, dims)
    qc, kc, vc = (_canonical(x, d) for x, d in zip((q, k, v), dims))
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(vc, -1, -2)
    ds = p * (dp - np.sum(dout * out, axis=-1, keepdims=True))
    dq = ds @ kc * scale
    dk = np.swapaxes(ds, -1, -2) @ qc * scale
    return np.concatenate([_to_layout(g, d, q.dtype).reshape(-1) for g, d in zip((dq, dk, dv), dims)])


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

def _tile_call_rule(*avals, graph, name, n_consts, bwd):
    want = [(a.shape, a.dtype) for a in graph.in_avals]
    got = [(a.shape, a.dtype) for a in avals]
    if got != want:
        raise ShapeError(with_user_line(f"tile_op {name}: operands {[str(a) for a in avals]} do not "
                                        f"match its body's inputs {[str(a) for a in graph.in_avals]}"))
    return graph.out_avals[0]


def _tile_call_impl(*xs, graph, name, n_consts, bwd):
    return eval_graph(graph, xs, lambda e, vals: e.prim.impl(*vals, **e.params))[0]


# One user-defined operator (tilefuse.tile_op) as a unit: `graph` is its closed body (one output;
# its first n_consts inputs are the body's captured constants), `bwd` a user VJP or None. The
# pass pipeline inlines it before fusion (ir/passes/inline.py).
tile_call = Primitive("tile_op", _tile_call_rule, _tile_call_impl)


# ---- effects --------------------------------------------------------------------------------

def _debug_print_impl(*xs, fmt, names):
    print(fmt.format(*xs, **{n: x for n, x in zip(names, xs[len(xs) - len(names):])}))
    return []


debug_print = Primitive("debug_print", lambda *xs, fmt, names: [], _debug_print_impl,
                        multiple_results=True, effectful=True)
