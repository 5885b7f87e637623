"""tilefuse.numpy: numpy's API over tilefuse primitives (import as `tnp`).

Every function accepts numpy arrays, tilefuse Arrays, Python scalars and tracers, follows numpy's
broadcasting and axis conventions, and promotes dtypes on JAX's lattice with weak Python scalars
(`x * 2.0` keeps x's float dtype; ints become float32, not float64, under true division)."""
from __future__ import annotations

import builtins
import math
import sys

import numpy as np

from tilefuse.ir import dtypes as _dt
from tilefuse.ir import primitives as P
from tilefuse.ir.core import dimension
from tilefuse.ir.symbolic import Dim, distinct, slice_indices
from tilefuse.ir.errors import (ConcretizationError, DTypeError, OperandShapeError, ShapeError, TilefuseError,
                                is_internal, with_user_line)
from tilefuse.runtime.array import Array
from tilefuse.runtime.device import default_device
from tilefuse.tracer.core import Tracer, bind1, concrete_or_none, get_aval, is_eager



class _ScalarType:
    """tnp.float32 and the other dtype names: usable wherever a dtype is (np.dtype(tnp.float32),
    x.astype(tnp.int8), x.dtype == tnp.float32) and callable as a constructor, as jnp.float32(3)
    is: an array of that dtype (0-d for a scalar), converted from numbers, arrays or tracers."""

    def __init__(self, name: str, dtype):
        self.__name__ = self.__qualname__ = name
        self.dtype = np.dtype(dtype)

    def __call__(self, x=0):
        return astype(x, self.dtype) if isinstance(x, (Tracer, Array)) else asarray(x, self.dtype)

    def __eq__(self, other):
        try:
            return self.dtype == np.dtype(other)
        except TypeError:
            return NotImplemented

    def __hash__(self):
        return hash(self.dtype)

    def __repr__(self):
        return f"tilefuse.numpy.{self.__name__}"


float16, bfloat16, float32, float64 = (_ScalarType(n, getattr(_dt, n))
                                       for n in ("float16", "bfloat16", "float32", "float64"))
int8, int16, int32, int64 = (_ScalarType(n, getattr(np, n)) for n in ("int8", "int16", "int32", "int64"))
uint8, uint16, uint32, uint64 = (_ScalarType(n, getattr(np, n)) for n in ("uint8", "uint16", "uint32", "uint64"))
bool_ = _ScalarType("bool_", np.bool_)
# numpy's aliases (numpy's meaning: float_ and double are float64, int_ is int64)
bool = _ScalarType("bool", np.bool_)  # jnp.bool (shadows the builtin here: use builtins.bool)
half, single, double, float_ = (_ScalarType(n, d) for n, d in (("half", np.float16), ("single", np.float32),
                                                               ("double", np.float64), ("float_", np.float64)))
int_, uint = _ScalarType("int_", np.int64), _ScalarType("uint", np.uint64)
# complex names exist so ported code reads; using them is a DTypeError (not computed)
complex64, complex128 = _ScalarType("complex64", np.complex64), _ScalarType("complex128", np.complex128)
complex_, csingle, cdouble = (_ScalarType(n, d) for n, d in (("complex_", np.complex128), ("csingle", np.complex64),
                                                              ("cdouble", np.complex128)))
pi, e, inf, nan, newaxis = np.pi, np.e, np.inf, np.nan, None
ndarray = Array


# ---- conversion and promotion ---------------------------------------------------------------

def _is_python_scalar(x) -> bool:
    return isinstance(x, (builtins.bool, int, float)) and not isinstance(x, np.generic)


def _operand(x):
    """Anything array-like as an operand for bind: tracers and Arrays pass, lists become numpy."""
    if type(x) is Dim:  # a traced size used as a value: an int32 scalar computed from the size
        return x.hint if x.env.frozen else bind1(P.dim_value, value=x, dtype=_dt.int32)
    if isinstance(x, (Tracer, Array, np.ndarray)) or _is_python_scalar(x):
        return x
    if isinstance(x, np.generic):
        return np.asarray(x)
    if isinstance(x, (list, tuple)):
        return asarray(x)
    if hasattr(x, "__array__"):
        return np.asarray(x)
    raise TilefuseError(with_user_line(f"expected an array, got a {type(x).__name__}: {x!r:.60}"))


def _aval(x):
    return get_aval(x)


def _is_dtype_like(x) -> builtins.bool:
    return isinstance(x, (np.dtype, type, str, _ScalarType))


def result_type(*xs):
    """The dtype numpy-style promotion gives these operands (weak Python scalars respected);
    dtypes count as strong operands of their type."""
    return _dt.result_type(*((_dt.canonicalize(x), False) if _is_dtype_like(x) else
                             (_dt.DEFAULT_INT, True) if _is_big_int(x) else
                             (_aval(x).dtype, _aval(x).weak_type) for x in xs))[0]


def _is_big_int(x) -> builtins.bool:
    """A Python int past int32: weak, it takes the other operand's dtype if that holds it (JAX's
    rule: uint64 & 0xFFFFFFFFFFFF stays uint64), and an explicit dtype (tnp.uint64(2**64 - 1))."""
    return isinstance(x, int) and not isinstance(x, (builtins.bool, np.generic)) and not -2**31 <= x < 2**31


def _big_int(x: int, dtype):
    if _dt.is_float(dtype):
        return np.asarray(float(x), dtype)
    info = np.iinfo(dtype) if _dt.is_int(dtype) else None
    if info is None or not info.min <= x <= info.max:
        raise DTypeError(with_user_line(f"the Python int {x} does not fit {dtype}: pass an array of a dtype "
                                        "that holds it (np.int64(...), np.uint64(...))"))
    return np.asarray(x, dtype)


def _convert(x, dtype):
    x = _operand(x)
    dtype = _dt.canonicalize(dtype)
    if _is_big_int(x):
        return _big_int(x, dtype)
    a = _aval(x)
    if a.dtype == dtype:
        return x
    if _is_python_scalar(x) or isinstance(x, np.ndarray):
        with np.errstate(all="ignore"):
            return np.asarray(x).astype(dtype)
    return bind1(P.convert_element_type, x, new_dtype=dtype, weak_type=False)


def astype(x, dtype):
    return _convert(x, dtype)


def _promote(*xs, to_float=False):
    xs = [_operand(x) for x in xs]
    dtype = result_type(*xs)
    if to_float and not _dt.is_float(dtype):
        dtype = _dt.DEFAULT_FLOAT
    return [_convert(x, dtype) for x in xs]


def _same_shape(a: tuple, b: tuple) -> bool:
    """a == b, the ranks first: a batch size is then never compared with another axis's size
    (a guard the traced sizes would not need: ir/symbolic.py)."""
    return len(a) == len(b) and a == b


def broadcast_shapes(*shapes, _op: str | None = None) -> tuple[int, ...]:
    nd = builtins.max((len(s) for s in shapes), default=0)
    out = []
    for i in range(nd):
        at = [s[i - nd + len(s)] for s in shapes if i - nd + len(s) >= 0]
        dims = distinct(n for n in at if n != 1)  # (by ==: a symbolic size must not be hashed)
        if len(dims) > 1:
            raise ShapeError(with_user_line(
                f"{_op + ': ' if _op else ''}operands of shapes "
                f"{', '.join(str(tuple(s)) for s in shapes)} cannot be broadcast together"))
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def broadcast_to(x, shape):
    x = _operand(x)
    shape = tuple(dimension(s) for s in ((shape,) if isinstance(shape, (int, Dim)) else shape))
    a = _aval(x)
    if _same_shape(a.shape, shape):
        return x
    lead = len(shape) - a.ndim
    if lead < 0 or builtins.any(n not in (1, m) for n, m in zip(a.shape, shape[lead:])):
        raise ShapeError(with_user_line(f"cannot broadcast an array of shape {a.shape} to {shape}"))
    return bind1(P.broadcast_in_dim, x, shape=shape,
                 broadcast_dimensions=tuple(range(len(shape) - a.ndim, len(shape))))


def _broadcast_all(*xs, op: str | None = None):
    shape = broadcast_shapes(*(_aval(x).shape for x in xs), _op=op)
    if is_eager(xs):  # a constant (x * 2.0) as numpy's broadcast view: no operation of its own
        return [np.broadcast_to(x, shape) if isinstance(x, np.ndarray) else broadcast_to(x, shape) for x in xs]
    return [broadcast_to(x, shape) for x in xs]


def _wrap_result(x):
    """Keep eager results as device Arrays (never bare numpy) so methods work on them."""
    if isinstance(x, (Tracer, Array)):
        return x
    if _is_python_scalar(x):
        x = np.asarray(x, _dt.python_scalar_dtype(x))
    return default_device().put(np.asarray(x), committed=False)


def _as_is(x, to_float: bool):
    """x's aval when x is an Array or a tracer that promotion would leave as it is (a float, or
    any dtype where no float is asked for), else None: the operators' fast path, which skips the
    general promotion and broadcasting (an eager operation's Python overhead is most of its time)."""
    if type(x) is Array or isinstance(x, Tracer):
        a = x.aval
        if not to_float or _dt.is_float(a.dtype):
            return a
    return None


def _unary(prim, to_float=True, kinds=None):
    def f(x):
        if _as_is(x, to_float) is None:
            (x,) = _promote(x, to_float=to_float)
        return bind1(prim, x)
    return _named(f, prim.name)


def _binary(prim, to_float=False, name=None):
    def f(x, y):
        a, b = _as_is(x, to_float), _as_is(y, to_float)
        # (equal shapes and dtypes: nothing to do)
        if a is None or b is None or not _same_shape(a.shape, b.shape) or a.dtype != b.dtype:
            x, y = _broadcast_all(*_promote(x, y, to_float=to_float), op=f.__name__)
        return bind1(prim, x, y)
    return _named(f, name or prim.name)


def _named(f, name: str):
    """A generated function named `name`, in its code too (errors name the function from it)."""
    f.__name__ = f.__qualname__ = name
    f.__code__ = f.__code__.replace(co_name=name)
    return f


# ---- elementwise ----------------------------------------------------------------------------

exp = _unary(P.exp)
log = _unary(P.log)
log1p = _unary(P.log1p)
expm1 = _unary(P.expm1)
tanh = _unary(P.tanh)
sqrt = _unary(P.sqrt)
sin = _unary(P.sin)
cos = _unary(P.cos)
erf = _unary(P.erf)
floor = _unary(P.floor)
ceil = _unary(P.ceil)
rint = _unary(P.round_)


def round(x, decimals=0):
    """Round half to even (numpy's rule), to `decimals` places."""
    if decimals == 0:
        return rint(x)
    (x,) = _promote(x, to_float=True)
    scale = 10.0 ** decimals
    return rint(x * scale) / scale


around = round
negative = _unary(P.neg, to_float=False)
abs = absolute = _unary(P.abs_, to_float=False)
sign = _unary(P.sign, to_float=False)
isfinite = _unary(P.is_finite)
add = _binary(P.add)
subtract = _binary(P.sub, name="subtract")
multiply = _binary(P.mul, name="multiply")
true_divide = divide = _binary(P.div, to_float=True, name="divide")
maximum = _binary(P.max_, name="maximum")
minimum = _binary(P.min_, name="minimum")
equal = _binary(P.eq, name="equal")
not_equal = _binary(P.ne, name="not_equal")
less = _binary(P.lt, name="less")
less_equal = _binary(P.le, name="less_equal")
greater = _binary(P.gt, name="greater")
greater_equal = _binary(P.ge, name="greater_equal")
bitwise_and = _binary(P.and_, name="bitwise_and")
bitwise_or = _binary(P.or_, name="bitwise_or")
bitwise_xor = _binary(P.xor, name="bitwise_xor")


def positive(x):
    return _operand(x)


def square(x):
    return integer_pow(x, 2)


def integer_pow(x, n: int):
    (x,) = _promote(x)
    return bind1(P.integer_pow, x, y=int(n))


def reciprocal(x):
    return divide(1.0, x)


def rsqrt(x):
    return bind1(P.rsqrt, *_promote(x, to_float=True))


def sigmoid(x):
    return bind1(P.logistic, *_promote(x, to_float=True))


def power(x, y):
    if _is_python_scalar(y) and not isinstance(y, builtins.bool) and math.isfinite(y) and float(y) == int(y) \
            and builtins.abs(y) <= 64:
        if not (_dt.is_int(_aval(x).dtype) and y < 0):
            return integer_pow(x, int(y))
    x, y = _promote(x, y)
    if not _dt.is_float(_aval(x).dtype):  # integer ** integer array: compute in float, cast back
        d = _aval(x).dtype
        return astype(power(astype(x, _dt.float64 if d.itemsize == 8 else _dt.float32), astype(y, _dt.float32)), d)
    x, y = _broadcast_all(x, y, op="power")
    return bind1(P.pow_, x, y)


def floor_divide(x, y):
    x, y = _broadcast_all(*_promote(x, y), op="floor_divide")
    if _dt.is_float(_aval(x).dtype):
        return floor(bind1(P.div, x, y))
    q = bind1(P.div, x, y)  # truncated; step down where the signs differ and it was inexact
    r = bind1(P.rem, x, y)
    zero = zeros_like(r)
    fix = logical_and(not_equal(r, zero), not_equal(less(r, zero), less(y, zero)))
    return where(fix, q - 1, q)


def remainder(x, y):
    x, y = _broadcast_all(*_promote(x, y), op="remainder")
    r = bind1(P.rem, x, y)
    zero = zeros_like(r)
    fix = logical_and(not_equal(r, zero), not_equal(less(r, zero), less(y, zero)))
    return where(fix, r + y, r)


mod = remainder


def fmod(x, y):
    x, y = _broadcast_all(*_promote(x, y), op="fmod")
    return bind1(P.rem, x, y)


def logical_not(x):
    return bind1(P.not_, astype(x, _dt.bool_))


def logical_and(x, y):
    return bitwise_and(astype(x, _dt.bool_), astype(y, _dt.bool_))


def logical_or(x, y):
    return bitwise_or(astype(x, _dt.bool_), astype(y, _dt.bool_))


def logical_xor(x, y):
    return bitwise_xor(astype(x, _dt.bool_), astype(y, _dt.bool_))


def invert(x):
    return bind1(P.not_, _operand(x))


bitwise_not = invert


def isnan(x):
    x = _operand(x)
    if not _dt.is_float(_aval(x).dtype):
        return zeros_like(x, dtype=_dt.bool_)
    return not_equal(x, x)


def isinf(x):
    x = _operand(x)
    if not _dt.is_float(_aval(x).dtype):
        return zeros_like(x, dtype=_dt.bool_)
    return equal(abs(x), inf)


def tan(x):
    (x,) = _promote(x, to_float=True)
    return divide(sin(x), cos(x))


def sinh(x):
    (x,) = _promote(x, to_float=True)
    return (expm1(x) - expm1(negative(x))) * 0.5  # expm1 keeps small |x| accurate


def cosh(x):
    (x,) = _promote(x, to_float=True)
    return (exp(x) + exp(negative(x))) * 0.5


def log2(x):
    return log(x) * (1 / math.log(2))


def log10(x):
    return log(x) * (1 / math.log(10))


def exp2(x):
    (x,) = _promote(x, to_float=True)
    return exp(x * math.log(2))


def cbrt(x):
    (x,) = _promote(x, to_float=True)
    return sign(x) * power(abs(x), 1 / 3)


def hypot(x, y):
    x, y = _promote(x, y, to_float=True)
    return sqrt(x * x + y * y)


def logaddexp(x, y):
    """log(exp(x) + exp(y)) without overflow."""
    x, y = _promote(x, y, to_float=True)
    m = maximum(x, y)
    # where both are -inf (or equal infinities) the shift would be inf - inf
    safe_m = where(isfinite(m), m, zeros((), _aval(m).dtype))
    return safe_m + log1p(exp(-abs(x - y))) + (m - safe_m)


def nan_to_num(x, copy=True, nan=0.0, posinf=None, neginf=None):
    x = _operand(x)
    d = _aval(x).dtype
    if not _dt.is_float(d):
        return x
    fi = _dt.finfo(d)
    x = where(isnan(x), nan, x)
    x = where(equal(x, inf), float(fi.max) if posinf is None else posinf, x)
    return where(equal(x, -inf), float(fi.min) if neginf is None else neginf, x)


def isclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    a, b = _promote(a, b, to_float=True)
    close = less_equal(abs(a - b), atol + rtol * abs(b))
    close = logical_or(close, equal(a, b))  # equal infinities
    if equal_nan:
        close = logical_or(close, logical_and(isnan(a), isnan(b)))
    return close


def where(cond, x=None, y=None):
    if x is None and y is None:
        return nonzero(cond)
    cond = astype(cond, _dt.bool_)
    x, y = _promote(x, y)
    cond, x, y = _broadcast_all(cond, x, y, op="where")
    return bind1(P.select, cond, x, y)


def clip(x, a_min=None, a_max=None):
    if a_min is not None:
        x = maximum(x, a_min)
    if a_max is not None:
        x = minimum(x, a_max)
    return _operand(x)


def stop_gradient(x):
    return bind1(P.stop_gradient, _operand(x))


# ---- shapes -------------------------------------------------------------------------------

def shape(x):
    return _aval(_operand(x)).shape


def ndim(x):
    return _aval(_operand(x)).ndim


def size(x):
    return _aval(_operand(x)).size


def _norm_axis(axis: int, nd: int, name="axis") -> int:
    if not isinstance(axis, (int, np.integer)):
        raise TilefuseError(with_user_line(f"{name} must be an int, got {axis!r}"))
    if not -nd <= axis < builtins.max(nd, 1) or (nd == 0 and axis not in (0, -1)):
        raise ShapeError(with_user_line(f"{name} {axis} is out of range for an array of rank {nd}"))
    return int(axis) % builtins.max(nd, 1)


def _norm_axes(axis, nd) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(nd))
    if isinstance(axis, (int, np.integer)):
        axis = (axis,)
    out = tuple(_norm_axis(a, nd) for a in axis)
    if len(set(out)) != len(out):
        raise ShapeError(with_user_line(f"repeated axis in {axis}"))
    return out


def reshape(x, *newshape, order="C"):
    x = _operand(x)
    if order != "C":
        raise TilefuseError("reshape: only order='C' is supported")
    if len(newshape) == 1 and not isinstance(newshape[0], (int, np.integer, Dim)):
        newshape = tuple(newshape[0])
    newshape = [dimension(s) for s in newshape]
    a = _aval(x)
    if newshape.count(-1) > 1:
        raise ShapeError(with_user_line(f"reshape: more than one -1 in {tuple(newshape)}"))
    if -1 in newshape:
        known = math.prod(s for s in newshape if s != -1)
        if known == 0 or a.size % known:
            raise OperandShapeError(with_user_line(f"cannot reshape an array of shape {a.shape} into "
                                            f"{tuple(newshape)}"))
        newshape[newshape.index(-1)] = a.size // known
    newshape = tuple(newshape)
    if newshape == a.shape:
        return x
    if math.prod(newshape) != a.size:
        raise OperandShapeError(with_user_line(f"cannot reshape an array of shape {a.shape} (size {a.size}) "
                                        f"into {newshape}"))
    return bind1(P.reshape, x, new_sizes=newshape)


def ravel(x):
    return reshape(x, -1)


def transpose(x, axes=None):
    x = _operand(x)
    nd = _aval(x).ndim
    if axes is None:
        axes = tuple(reversed(range(nd)))
    axes = tuple(_norm_axis(a, nd) for a in axes)
    if sorted(axes) != list(range(nd)):
        raise ShapeError(with_user_line(f"transpose: axes {axes} are not a permutation of {nd} axes"))
    if axes == tuple(range(nd)):
        return x
    return bind1(P.transpose, x, permutation=axes)


permute_dims = transpose


def swapaxes(x, a, b):
    nd = ndim(x)
    perm = list(range(nd))
    a, b = _norm_axis(a, nd), _norm_axis(b, nd)
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(x, perm)


def moveaxis(x, source, destination):
    nd = ndim(x)
    src = _norm_axes(source, nd)
    dst = _norm_axes(destination, nd)
    if len(src) != len(dst):
        raise ShapeError(with_user_line("moveaxis: source and destination differ in length"))
    order = [i for i in range(nd) if i not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return transpose(x, order)


def expand_dims(x, axis):
    x = _operand(x)
    a = _aval(x)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    nd = a.ndim + len(axes)
    axes = sorted(_norm_axis(ax, nd) for ax in axes)
    shape = list(a.shape)
    for ax in axes:
        shape.insert(ax, 1)
    return reshape(x, shape)


def squeeze(x, axis=None):
    x = _operand(x)
    a = _aval(x)
    if axis is None:
        axes = [i for i, n in enumerate(a.shape) if n == 1]
    else:
        axes = _norm_axes(axis, a.ndim)
        for ax in axes:
            if a.shape[ax] != 1:
                raise ShapeError(with_user_line(f"squeeze: axis {ax} of shape {a.shape} is not 1"))
    return reshape(x, [n for i, n in enumerate(a.shape) if i not in axes])


def atleast_1d(x):
    return reshape(x, (1,)) if ndim(x) == 0 else _operand(x)


def atleast_2d(x):
    x = atleast_1d(x)
    return expand_dims(x, 0) if ndim(x) == 1 else x


def concatenate(arrays, axis=0):
    arrays = list(arrays)
    if not arrays:
        raise TilefuseError(with_user_line("concatenate needs at least one array"))
    if axis is None:
        arrays, axis = [ravel(a) for a in arrays], 0
    arrays = _promote(*arrays)
    nd = _aval(arrays[0]).ndim
    if nd == 0:
        raise ShapeError(with_user_line("zero-dimensional arrays cannot be concatenated"))
    axis = _norm_axis(axis, nd)
    if len(arrays) == 1:
        return arrays[0]
    return bind1(P.concatenate, *arrays, dimension=axis)


def stack(arrays, axis=0):
    arrays = [_operand(a) for a in arrays]
    if not arrays:
        raise TilefuseError(with_user_line("stack needs at least one array"))
    shapes = [_aval(a).shape for a in arrays]
    if builtins.any(not _same_shape(s, shapes[0]) for s in shapes[1:]):
        raise ShapeError(with_user_line(f"stack: all arrays need the same shape, got {shapes}"))
    axis = _norm_axis(axis, ndim(arrays[0]) + 1)
    return concatenate([expand_dims(a, axis) for a in arrays], axis)


def hstack(arrays):
    arrays = [atleast_1d(a) for a in arrays]
    return concatenate(arrays, 0 if ndim(arrays[0]) == 1 else 1)


def vstack(arrays):
    return concatenate([atleast_2d(a) for a in arrays], 0)


def atleast_3d(x):
    x = _operand(x)
    nd = ndim(x)
    if nd == 0:
        return reshape(x, (1, 1, 1))
    if nd == 1:
        return reshape(x, (1, shape(x)[0], 1))
    return expand_dims(x, -1) if nd == 2 else x


def broadcast_arrays(*xs):
    return _broadcast_all(*(_operand(x) for x in xs))


def roll(x, shift, axis=None):
    x = _operand(x)
    if axis is None:
        return reshape(roll(ravel(x), shift, 0), shape(x))
    shifts = (shift,) if isinstance(shift, (int, np.integer)) else tuple(shift)
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    if len(shifts) == 1:
        shifts = shifts * len(axes)
    for sh, ax in zip(shifts, axes):
        ax = _norm_axis(ax, ndim(x))
        n = shape(x)[ax]
        k = int(sh) % n if n else 0
        if k:
            x = concatenate([_slice_axis(x, ax, n - k, n), _slice_axis(x, ax, 0, n - k)], ax)
    return x


def diagonal(x, offset=0, axis1=0, axis2=1):
    """The diagonal of two axes, moved to the end (numpy's layout)."""
    x = _operand(x)
    nd = ndim(x)
    a1, a2 = _norm_axis(axis1, nd), _norm_axis(axis2, nd)
    if a1 == a2:
        raise ShapeError(with_user_line("diagonal: axis1 and axis2 must differ"))
    x = moveaxis(x, (a1, a2), (-2, -1))
    n, m = shape(x)[-2:]
    lo = builtins.max(0, -offset)
    rows = np.arange(lo, builtins.max(lo, builtins.min(n, m - offset)))
    flat = reshape(x, shape(x)[:-2] + (n * m,))
    return take(flat, (rows * m + rows + offset).astype(np.int32), axis=-1)


def trace(x, offset=0, axis1=0, axis2=1, dtype=None):
    return sum(diagonal(x, offset, axis1, axis2), axis=-1, dtype=dtype)


def diag(v, k=0):
    v = _operand(v)
    if ndim(v) == 2:
        return diagonal(v, k)
    if ndim(v) != 1:
        raise ShapeError(with_user_line(f"diag: needs a 1-d or 2-d array, got shape {shape(v)}"))
    n = shape(v)[0] + builtins.abs(k)
    r = bind1(P.iota, dtype=_dt.int32, shape=(n, n), dimension=0)
    c = bind1(P.iota, dtype=_dt.int32, shape=(n, n), dimension=1)
    vals = bind1(P.gather, v, r if k >= 0 else c, axis=0)  # out-of-range rows clamp; masked below
    return where(equal(c - r, k), vals, zeros((), _aval(v).dtype))


def _slice_axis(x, axis, start, stop, step=1):
    a = _aval(x)
    starts = [0] * a.ndim
    limits = list(a.shape)
    strides = [1] * a.ndim
    starts[axis], limits[axis], strides[axis] = start, stop, step
    if starts == [0] * a.ndim and limits == list(a.shape) and step == 1:
        return x
    return bind1(P.slice_, x, start_indices=tuple(starts), limit_indices=tuple(limits),
                 strides=tuple(strides))


def split(x, indices_or_sections, axis=0):
    x = _operand(x)
    a = _aval(x)
    axis = _norm_axis(axis, a.ndim)
    n = a.shape[axis]
    if isinstance(indices_or_sections, (int, np.integer)):
        k = int(indices_or_sections)
        if k <= 0 or n % k:
            raise ShapeError(with_user_line(f"split: an axis of size {n} does not divide into {k} "
                                            "equal parts"))
        bounds = [i * (n // k) for i in range(k + 1)]
    else:
        bounds = [0] + [builtins.min(builtins.max(int(i), 0), n) for i in indices_or_sections] + [n]
    return [_slice_axis(x, axis, lo, builtins.max(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]


def array_split(x, sections, axis=0):
    n = shape(x)[_norm_axis(axis, ndim(x))]
    q, r = builtins.divmod(n, sections)
    idx = np.cumsum([q + 1] * r + [q] * (sections - r))[:-1]
    return split(x, list(idx), axis)


def flip(x, axis=None):
    x = _operand(x)
    axes = _norm_axes(axis, ndim(x))
    return bind1(P.rev, x, dimensions=tuple(axes)) if axes else x


def pad(x, pad_width, mode="constant", constant_values=0):
    if mode != "constant":
        raise TilefuseError(f"pad: only mode='constant' is supported, not {mode!r}")
    x = _operand(x)
    nd = ndim(x)
    pw = np.broadcast_to(np.asarray(pad_width, dtype=np.int64).reshape(-1, 2) if np.ndim(pad_width)
                         else np.asarray([[pad_width, pad_width]]), (nd, 2))
    cfg = tuple((int(lo), int(hi), 0) for lo, hi in pw)
    pv = _convert(constant_values, _aval(x).dtype)
    return bind1(P.pad, x, pv, padding_config=cfg)


def tile(x, reps):
    x = _operand(x)
    reps = (reps,) if isinstance(reps, int) else tuple(reps)
    a = _aval(x)
    nd = builtins.max(a.ndim, len(reps))
    reps = (1,) * (nd - len(reps)) + reps
    shp = (1,) * (nd - a.ndim) + a.shape
    x = reshape(x, shp)
    inter = [v for s, r in zip(shp, reps) for v in (r, s)]
    dims = tuple(2 * i + 1 for i in range(nd))
    y = bind1(P.broadcast_in_dim, reshape(x, shp), shape=tuple(inter), broadcast_dimensions=dims)
    return reshape(y, [s * r for s, r in zip(shp, reps)])


def repeat(x, repeats: int, axis=None):
    x = _operand(x)
    if axis is None:
        x, axis = ravel(x), 0
    a = _aval(x)
    axis = _norm_axis(axis, a.ndim)
    shp = a.shape[:axis + 1] + (int(repeats),) + a.shape[axis + 1:]
    y = bind1(P.broadcast_in_dim, x, shape=shp,
              broadcast_dimensions=tuple(i if i <= axis else i + 1 for i in range(a.ndim)))
    return reshape(y, a.shape[:axis] + (a.shape[axis] * int(repeats),) + a.shape[axis + 1:])


# ---- reductions ---------------------------------------------------------------------------

def _reduce(prim, x, axis, keepdims, dtype=None, identity_ok=True):
    x = _operand(x)
    if dtype is not None:
        x = astype(x, dtype)
    a = _aval(x)
    axes = _norm_axes(axis, a.ndim)
    out = bind1(prim, x, axes=axes) if axes else x
    if keepdims:
        out = reshape(out, [1 if i in axes else n for i, n in enumerate(a.shape)])
    return out


def sum(x, axis=None, dtype=None, keepdims=False):
    x = _operand(x)
    d = _aval(x).dtype
    if dtype is None and _dt.sum_dtype(d) != d:  # bool and 8/16-bit ints accumulate wider (JAX's)
        dtype = _dt.sum_dtype(d)
    return _reduce(P.reduce_sum, x, axis, keepdims, dtype)


def prod(x, axis=None, dtype=None, keepdims=False):
    x = _operand(x)
    if dtype is None and _dt.sum_dtype(_aval(x).dtype) != _aval(x).dtype:
        dtype = _dt.sum_dtype(_aval(x).dtype)
    return _reduce(P.reduce_prod, x, axis, keepdims, dtype)


def max(x, axis=None, keepdims=False):
    return _reduce(P.reduce_max, x, axis, keepdims)


def min(x, axis=None, keepdims=False):
    return _reduce(P.reduce_min, x, axis, keepdims)


amax, amin = max, min


def _bool_reduce(prim, empty_value, x, axis, keepdims):
    x = astype(x, _dt.bool_)
    a = _aval(x)
    axes = _norm_axes(axis, a.ndim)
    if builtins.any(a.shape[i] == 0 for i in axes):  # min/max have no identity: the answer is known
        out_shape = [1 if i in axes else n for i, n in enumerate(a.shape)] if keepdims else \
            [n for i, n in enumerate(a.shape) if i not in axes]
        return _wrap_result(broadcast_to(np.asarray(empty_value), tuple(out_shape)))
    return _reduce(prim, x, axis, keepdims)


def all(x, axis=None, keepdims=False):
    return _bool_reduce(P.reduce_min, True, x, axis, keepdims)


def any(x, axis=None, keepdims=False):
    return _bool_reduce(P.reduce_max, False, x, axis, keepdims)


def _count(x, axis):
    a = _aval(x)
    return math.prod(a.shape[i] for i in _norm_axes(axis, a.ndim))


def _float_size(n):
    """A count as the float that divides by it; a symbolic count (a traced size) stays one."""
    return n if type(n) is Dim else float(n)


def mean(x, axis=None, dtype=None, keepdims=False):
    """As jnp.mean: 16-bit floats are summed and divided in float32 and the mean rounded once, so
    a sum beyond their range (float16 [60000, 60000]) still gives the mean, on every device."""
    x = _operand(x)
    d = _aval(x).dtype
    out = np.dtype(dtype or (d if _dt.is_float(d) else _dt.float32))
    x = astype(x, _dt.compute_dtype(out))
    n = _count(x, axis)
    s = sum(x, axis, keepdims=keepdims)
    return astype(divide(s, _float_size(n)) if n else divide(s, nan), out)


def var(x, axis=None, dtype=None, ddof=0, keepdims=False):
    """As jnp.var: in float32 for 16-bit floats (see mean), rounded once."""
    x = _operand(x)
    d = _aval(x).dtype
    out = np.dtype(dtype or (d if _dt.is_float(d) else _dt.float32))
    x = astype(x, _dt.compute_dtype(out))
    m = mean(x, axis, keepdims=True)
    c = x - m
    n = _count(x, axis) - ddof
    return astype(divide(sum(c * c, axis, keepdims=keepdims), _float_size(n) if n > 0 else nan), out)


def std(x, axis=None, dtype=None, ddof=0, keepdims=False):
    return sqrt(var(x, axis, dtype, ddof, keepdims))


def ptp(x, axis=None, keepdims=False):
    return subtract(max(x, axis, keepdims), min(x, axis, keepdims))


def count_nonzero(x, axis=None, keepdims=False):
    return sum(not_equal(x, 0), axis, keepdims=keepdims)


def average(x, axis=None, weights=None, keepdims=False):
    if weights is None:
        return mean(x, axis, keepdims=keepdims)
    x, w = _promote(x, weights, to_float=True)
    if ndim(w) == 1 and ndim(x) > 1 and axis is not None:  # weights along one axis
        ax = _norm_axis(axis, ndim(x))
        w = reshape(w, [-1 if i == ax else 1 for i in range(ndim(x))])
    x, w = _broadcast_all(x, w)
    return divide(sum(x * w, axis, keepdims=keepdims), sum(w, axis, keepdims=keepdims))


def _arg_reduce(prim, x, axis, keepdims):
    x = _operand(x)
    if axis is None:
        x, axis = ravel(x), 0
    a = _aval(x)
    axis = _norm_axis(axis, a.ndim)
    out = bind1(prim, x, axis=axis, index_dtype=_dt.int32)
    if keepdims:
        out = expand_dims(out, axis)
    return out


def argmax(x, axis=None, keepdims=False):
    """Index of the maximum; ties go to the first occurrence (numpy's rule)."""
    return _arg_reduce(P.argmax, x, axis, keepdims)


def argmin(x, axis=None, keepdims=False):
    return _arg_reduce(P.argmin, x, axis, keepdims)


def _scan_operand(x, axis, dtype):
    x = _operand(x)
    if axis is None:
        x, axis = ravel(x), 0
    if dtype is not None:
        x = astype(x, dtype)
    elif _dt.sum_dtype(_aval(x).dtype) != _aval(x).dtype:
        x = astype(x, _dt.sum_dtype(_aval(x).dtype))
    return x, _norm_axis(axis, ndim(x))


def _shift(x, axis, k, fill):
    """x moved k places toward higher indices along axis, the vacated front filled with `fill`."""
    n = shape(x)[axis]
    k = builtins.min(k, n)
    cfg = tuple((k, 0, 0) if i == axis else (0, 0, 0) for i in range(ndim(x)))
    padded = bind1(P.pad, x, _convert(fill, _aval(x).dtype), padding_config=cfg)
    return _slice_axis(padded, axis, 0, n)


def _scan(x, axis, op, identity):
    """The inclusive scan of `op` along axis by a log-step (Hillis-Steele) scan: log2(n) shifted
    combines, each a pad and one fused elementwise kernel; sums add in a tree, as pairwise."""
    n, k = shape(x)[axis], 1
    while k < n:
        x = op(x, _shift(x, axis, k, identity))
        k *= 2
    return x


def cumsum(x, axis=None, dtype=None):
    """Cumulative sum: a product with a triangular matrix for short axes (one GEMM), a log-step
    scan for longer ones (O(n log n), no n x n matrix)."""
    x, axis = _scan_operand(x, axis, dtype)
    n = shape(x)[axis]
    if n > 32:
        return _scan(x, axis, add, 0)
    tri = astype(tril(ones((n, n), dtype=_dt.bool_)), _aval(x).dtype)  # tri[i, j] = j <= i
    y = tensordot(moveaxis(x, axis, -1), tri, axes=([-1], [1]))
    return moveaxis(y, -1, axis)


def cumprod(x, axis=None, dtype=None):
    """Cumulative product by a log-step scan (log2(n) shifted multiplies)."""
    x, axis = _scan_operand(x, axis, dtype)
    return _scan(x, axis, multiply, 1)


def cummax(x, axis=None):
    """The running maximum along axis (jax.lax.cummax; NaN propagates, as maximum's)."""
    x, axis = _scan_operand(x, axis, _aval(_operand(x)).dtype)
    d = _aval(x).dtype
    low = -np.inf if _dt.is_float(d) else np.iinfo(d).min
    return _scan(x, axis, maximum, np.asarray(low, d))


def cummin(x, axis=None):
    x, axis = _scan_operand(x, axis, _aval(_operand(x)).dtype)
    d = _aval(x).dtype
    high = np.inf if _dt.is_float(d) else np.iinfo(d).max
    return _scan(x, axis, minimum, np.asarray(high, d))


# ---- contraction -------------------------------------------------------------------------

def _dot_general(a, b, contract, batch=((), ())):
    a, b = _promote(a, b)
    return bind1(P.dot_general, a, b, dimension_numbers=(tuple(map(tuple, contract)),
                                                         tuple(map(tuple, batch))))


def matmul(a, b):
    a, b = _operand(a), _operand(b)
    sa, sb = _aval(a).shape, _aval(b).shape
    if len(sa) == 0 or len(sb) == 0:
        raise ShapeError(with_user_line("matmul: operands must not be scalars (use *)"))
    k_b = sb[-2 if len(sb) > 1 else 0]
    if sa[-1] != k_b:
        raise OperandShapeError(with_user_line(f"matmul: contracting dimensions differ: {sa} @ {sb} ({sa[-1]} vs {k_b})"))
    if len(sb) <= 2:  # a weight matrix (or vector): contract without broadcasting it
        return _dot_general(a, b, ((len(sa) - 1,), (0,)))
    if len(sa) == 1:
        return _dot_general(a, b, ((0,), (len(sb) - 2,)))
    batch = broadcast_shapes(sa[:-2], sb[:-2])
    a = broadcast_to(a, batch + sa[-2:])
    b = broadcast_to(b, batch + sb[-2:])
    nb = len(batch)
    return _dot_general(a, b, ((nb + 1,), (nb,)), (tuple(range(nb)), tuple(range(nb))))


def dot(a, b):
    a, b = _operand(a), _operand(b)
    na, nb = ndim(a), ndim(b)
    if na == 0 or nb == 0:
        return multiply(a, b)
    if na <= 2 and nb <= 2:
        return matmul(a, b)
    return _dot_general(a, b, ((na - 1,), (builtins.max(nb - 2, 0),)))


def vdot(a, b):
    return dot(ravel(a), ravel(b))


inner = lambda a, b: tensordot(a, b, axes=([-1], [-1]))  # noqa: E731


def outer(a, b):
    return multiply(reshape(a, (-1, 1)), reshape(b, (1, -1)))


def tensordot(a, b, axes=2):
    a, b = _operand(a), _operand(b)
    na, nb = ndim(a), ndim(b)
    if isinstance(axes, int):
        ca, cb = list(range(na - axes, na)), list(range(axes))
    else:
        ca, cb = ([axes[0]] if isinstance(axes[0], int) else list(axes[0]),
                  [axes[1]] if isinstance(axes[1], int) else list(axes[1]))
    return _dot_general(a, b, ([_norm_axis(i, na) for i in ca], [_norm_axis(i, nb) for i in cb]))


def einsum(subscripts: str, *operands, optimize=None, precision=None):
    """Einstein summation (explicit or implicit output, '...', repeated indices for diagonals),
    lowered to dot_general, reductions and transposes, contracting left to right."""
    operands = [_operand(o) for o in operands]
    ins, arrow, out = subscripts.replace(" ", "").partition("->")
    terms = ins.split(",")
    if len(terms) != len(operands):
        raise TilefuseError(with_user_line(f"einsum: {len(terms)} terms for {len(operands)} operands"))
    terms, out = _einsum_expand_ellipsis(terms, out if arrow else None, operands)
    sizes: dict[str, int] = {}
    for t, o in zip(terms, operands):
        if len(t) != ndim(o):
            raise ShapeError(with_user_line(f"einsum: term {t!r} has {len(t)} axes but its operand "
                                            f"has shape {shape(o)}"))
        for c, n in zip(t, shape(o)):
            if sizes.setdefault(c, n) != n and 1 not in (n, sizes[c]):
                raise ShapeError(with_user_line(f"einsum: axis {c!r} has sizes {sizes[c]} and {n}"))
            sizes[c] = builtins.max(sizes[c], n) if 0 not in (n, sizes[c]) else 0
    if set(out) - set(sizes) or len(set(out)) != len(out):
        raise TilefuseError(with_user_line(f"einsum: bad output subscripts {out!r}"))
    # size-1 axes broadcast against the other operands' sizes
    operands = [broadcast_to(o, tuple(sizes[c] for c in t)) for o, t in zip(operands, terms)]
    x, xt = _einsum_single(operands[0], terms[0], out, terms[1:])
    for k in range(1, len(operands)):
        rest = terms[k + 1:]
        o, t = _einsum_single(operands[k], terms[k], out + xt, rest)
        x, xt = _einsum_single(x, xt, out + t, rest)
        keep = set(out) | set("".join(rest))
        batch = [c for c in xt if c in t and c in keep]
        contract = [c for c in xt if c in t and c not in keep]
        x = _dot_general(x, o, ([xt.index(c) for c in contract], [t.index(c) for c in contract]),
                         ([xt.index(c) for c in batch], [t.index(c) for c in batch]))
        xt = "".join(batch) + "".join(c for c in xt if c not in batch and c not in contract) + \
            "".join(c for c in t if c not in batch and c not in contract)
    x, xt = _einsum_single(x, xt, out, [])
    return transpose(x, [xt.index(c) for c in out])


def _einsum_expand_ellipsis(terms, out, operands):
    """Name the axes '...' stands for with unused letters; derive the implicit output."""
    used = {c for t in terms for c in t if c.isalpha()} | set(out or "")
    free = [c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in used]
    n_ell = builtins.max([ndim(o) - (len(t) - 3) for t, o in zip(terms, operands) if "..." in t], default=0)
    if n_ell < 0:
        raise ShapeError(with_user_line("einsum: an operand has fewer axes than its subscripts name"))
    ell = "".join(free[:n_ell])
    new_terms = []
    for t, o in zip(terms, operands):
        if "..." in t:
            k = ndim(o) - (len(t) - 3)
            t = t.replace("...", ell[n_ell - k:] if k > 0 else "")
        new_terms.append(t)
    if out is None:
        flat = "".join(terms).replace(".", "")
        out = ell + "".join(sorted(c for c in set(flat) if flat.count(c) == 1))
    else:
        out = out.replace("...", ell)
    return new_terms, out


def _einsum_single(x, t, out, others):
    """Take diagonals of repeated indices, then sum away axes that appear nowhere else."""
    while len(set(t)) != len(t):
        c = next(c for c in t if t.count(c) > 1)
        i = t.index(c)
        j = t.index(c, i + 1)
        x = diagonal(x, 0, i, j)
        t = "".join(ch for k, ch in enumerate(t) if k not in (i, j)) + c
    needed = set(out) | set("".join(others))
    drop = [i for i, c in enumerate(t) if c not in needed]
    if drop:
        x = sum(x, axis=tuple(drop))
        t = "".join(c for i, c in enumerate(t) if i not in drop)
    return x, t


# ---- creation -----------------------------------------------------------------------------

def _shape_tuple(s):
    """A static shape from an int, a sequence of them, or a 0-d integer array (tnp.zeros(n) with
    n = tnp.asarray(3)); a traced size raises ConcretizationError (ir.core.dimension)."""
    if isinstance(s, (int, np.integer)) or getattr(s, "ndim", None) == 0:
        return (dimension(s),)
    return tuple(dimension(n) for n in s)


def full(shape, fill_value, dtype=None):
    shape = _shape_tuple(shape)
    fv = _operand(fill_value)
    dtype = _dt.canonicalize(dtype) if dtype is not None else _aval(fv).dtype
    fv = _convert(fv, dtype)
    if _is_python_scalar(fv):  # an explicit dtype is a strong one
        fv = np.asarray(fv, dtype)
    return _wrap_result(broadcast_to(fv, shape))


def zeros(shape, dtype=_dt.float32):
    return full(shape, 0, dtype)


def ones(shape, dtype=_dt.float32):
    return full(shape, 1, dtype)


def empty(shape, dtype=_dt.float32):
    return zeros(shape, dtype)


def _like(x, dtype, shape):
    a = _aval(_operand(x))
    return (a.dtype if dtype is None else dtype), (a.shape if shape is None else shape)


def zeros_like(x, dtype=None, shape=None):
    d, s = _like(x, dtype, shape)
    return zeros(s, d)


def ones_like(x, dtype=None, shape=None):
    d, s = _like(x, dtype, shape)
    return ones(s, d)


def full_like(x, fill_value, dtype=None, shape=None):
    d, s = _like(x, dtype, shape)
    return full(s, fill_value, d)


empty_like = zeros_like


def _iota(dtype, n):
    return bind1(P.iota, dtype=_dt.canonicalize(dtype), shape=(dimension(n),), dimension=0)


def arange(start, stop=None, step=None, dtype=None):
    for v in (start, stop, step):
        if isinstance(v, (Tracer,)):
            raise TilefuseError(with_user_line("arange needs concrete start/stop/step (static "
                                               "Python numbers): its size must be known"))
    if stop is None:
        start, stop = 0, start
    step = 1 if step is None else step
    if builtins.all(isinstance(v, int) for v in (start, stop, step)) and step:  # a size may be a Dim:
        n = builtins.max(0, -((start - stop) // step))  # ceil((stop - start) / step) in integers
    else:
        n = builtins.max(0, math.ceil((stop - start) / step))
    if dtype is None:
        dtype = _dt.float32 if builtins.any(isinstance(v, float) for v in (start, stop, step)) else _dt.int32
    dtype = _dt.canonicalize(dtype)
    x = _iota(dtype if _dt.is_int(dtype) else _dt.float32, n)
    if step != 1:
        x = x * step
    if start != 0:
        x = x + start
    return _wrap_result(astype(x, dtype))


def linspace(start, stop, num=50, endpoint=True, dtype=None):
    num = int(num)
    div = (num - 1) if endpoint else num
    step = (stop - start) / div if div > 0 else 0.0
    x = _iota(_dt.float32, num) * float(step) + float(start)
    if endpoint and num > 1:
        x = where(equal(_iota(_dt.int32, num), num - 1), float(stop), x)
    return _wrap_result(astype(x, dtype or _dt.float32))


def eye(N, M=None, k=0, dtype=_dt.float32):
    M = N if M is None else M
    r = bind1(P.iota, dtype=_dt.int32, shape=(N, M), dimension=0)
    c = bind1(P.iota, dtype=_dt.int32, shape=(N, M), dimension=1)
    return _wrap_result(astype(equal(r + k, c), dtype))


identity = eye


def _tri_mask(n, m, k):
    r = bind1(P.iota, dtype=_dt.int32, shape=(n, m), dimension=0)
    c = bind1(P.iota, dtype=_dt.int32, shape=(n, m), dimension=1)
    return greater_equal(r + k, c)  # j <= i + k


def tri(N, M=None, k=0, dtype=_dt.float32):
    return _wrap_result(astype(_tri_mask(N, N if M is None else M, k), dtype))


def tril(x, k=0):
    x = _operand(x)
    n, m = shape(x)[-2:]
    return where(_tri_mask(n, m, k), x, zeros((), _aval(x).dtype))


def triu(x, k=0):
    x = _operand(x)
    n, m = shape(x)[-2:]
    return where(_tri_mask(n, m, k - 1), zeros((), _aval(x).dtype), x)


def asarray(x, dtype=None):
    """An Array (on the default device) or tracer for x; Python data gets float32/int32 defaults."""
    if isinstance(x, (Tracer, Array)):
        return x if dtype is None else astype(x, dtype)
    if isinstance(x, (list, tuple)):
        if builtins.any(isinstance(v, (Tracer, Array)) or isinstance(v, (list, tuple)) and
                        _has_traced(v) for v in x):
            return stack([asarray(v, dtype) for v in x])
        try:
            arr = np.asarray(x)
            if arr.dtype.kind in "fO" and dtype is not None and _dt.is_int(_dt.canonicalize(dtype)):
                try:  # ints numpy could only hold as floats or objects ([2**64 - 1, 0]): exact, as the dtype
                    arr = np.asarray(x, _dt.canonicalize(dtype))
                except (OverflowError, TypeError):
                    pass
        except ValueError:
            raise TilefuseError(with_user_line(
                f"{_api_argument(x)}a ragged nested list (rows of different lengths, "
                f"{_row_lengths(x)}) cannot be an array: pad the rows to one length")) from None
        if arr.dtype == object:
            raise TilefuseError(with_user_line("cannot make an array of Python objects"))
        if dtype is None:
            dtype = {"f": _dt.float32, "i": _dt.int32, "u": _dt.int32, "b": _dt.bool_}.get(arr.dtype.kind, arr.dtype)
            if arr.dtype.kind in "iu" and arr.size and not (-2**31 <= arr.min() and arr.max() < 2**31):
                raise DTypeError(with_user_line(
                    f"a Python int in the list does not fit int32 (max {arr.max()}, min {arr.min()}): "
                    "pass an int64 array, or dtype=tnp.int64"))
    elif _is_big_int(x) and dtype is not None:
        arr = _big_int(x, _dt.canonicalize(dtype))
    elif _is_python_scalar(x):
        arr = np.asarray(x, _dt.python_scalar_dtype(x))
    else:
        arr = np.asarray(x)
        if arr.dtype == object:
            raise TilefuseError(with_user_line("cannot make an array of Python objects"))
    dtype = _dt.canonicalize(arr.dtype if dtype is None else dtype)
    return default_device().put(arr.astype(dtype, copy=False), committed=False)


def _api_argument(obj) -> str:
    """'sum: argument 'x' is ' for the tilefuse function the user called and its parameter that
    holds obj (found on the stack), or '' when there is none."""
    frame, api = sys._getframe(1), None
    while frame is not None and is_internal(frame.f_code.co_filename):
        api, frame = frame, frame.f_back
    if api is None:
        return ""
    code = api.f_code
    for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
        v = api.f_locals.get(name)
        if v is obj or isinstance(v, (list, tuple)) and builtins.any(u is obj for u in v):
            return f"{code.co_name}: argument {name!r} is "
    return f"{code.co_name}: "


def _row_lengths(x) -> str:
    lens = [len(v) if isinstance(v, (list, tuple)) else "scalar" for v in x]
    return f"lengths {lens[:8]}{' ...' if len(lens) > 8 else ''}"


def argwhere(x):
    return stack(nonzero(x), axis=-1) if ndim(x) else asarray(np.argwhere(np.asarray(x)).astype(np.int32))


def meshgrid(*xs, indexing="xy"):
    xs = [ravel(x) for x in xs]
    n = len(xs)
    shp = [size(x) for x in xs]
    if indexing == "xy" and n >= 2:
        shp[0], shp[1] = shp[1], shp[0]
    out = []
    for i, x in enumerate(xs):
        ax = (1 - i if i < 2 else i) if indexing == "xy" and n >= 2 else i
        out.append(broadcast_to(reshape(x, [-1 if k == ax else 1 for k in range(n)]), tuple(shp)))
    return out


def _concrete(x, what):
    val = concrete_or_none(_operand(x))
    if val is None:
        raise ConcretizationError(with_user_line(f"{what} needs concrete values, not a traced array: "
                                                 "it returns a Python bool"))
    return np.asarray(val)


def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False) -> bool:
    """A Python bool, so only on concrete arrays (use tnp.isclose(...).all() inside jit)."""
    a, b = _concrete(a, "allclose"), _concrete(b, "allclose")
    return builtins.bool(np.allclose(a.astype(np.float64), b.astype(np.float64), rtol, atol, equal_nan))


def array_equal(a, b) -> bool:
    a, b = _concrete(a, "array_equal"), _concrete(b, "array_equal")
    return a.shape == b.shape and builtins.bool((a == b).all())


def triu_indices(n, k=0, m=None):
    return tuple(asarray(i.astype(np.int32)) for i in np.triu_indices(n, k, m))


def tril_indices(n, k=0, m=None):
    return tuple(asarray(i.astype(np.int32)) for i in np.tril_indices(n, k, m))


# dtype helpers: numpy's, aware of bfloat16 (which numpy does not count as floating)
dtype, iinfo, finfo = np.dtype, np.iinfo, _dt.finfo
floating, integer, inexact, number, signedinteger, bool8 = (np.floating, np.integer, np.inexact, np.number,
                                                            np.signedinteger, np.bool_)


def issubdtype(arg1, arg2) -> bool:
    if _dt.canonicalize(arg1) == _dt.bfloat16 and arg2 in (np.floating, np.inexact, np.number, np.generic):
        return True
    return builtins.bool(np.issubdtype(arg1, arg2))


def isscalar(x) -> bool:
    return _is_python_scalar(x) or isinstance(x, np.generic)


def promote_types(a, b) -> np.dtype:
    return _dt.result_type((_dt.canonicalize(a), False), (_dt.canonicalize(b), False))[0]


def can_cast(from_, to) -> bool:
    """Whether the cast loses nothing: promotion of the two gives `to`."""
    f = from_ if _is_dtype_like(from_) \
        else _aval(_operand(from_)).dtype
    return promote_types(f, to) == _dt.canonicalize(to)


def _has_traced(v):
    return builtins.any(isinstance(u, (Tracer, Array)) or isinstance(u, (list, tuple)) and _has_traced(u)
                        for u in v)


def array(x, dtype=None, copy=True):
    return asarray(x, dtype)


# ---- indexing ------------------------------------------------------------------------------

def _is_int_index(i):
    return isinstance(i, (int, np.integer)) and not isinstance(i, (builtins.bool, np.bool_))


def _as_index_array(i):
    """An advanced index: a concrete numpy int array, a traced int array, or None."""
    if isinstance(i, (list, tuple)):
        i = np.asarray(i)
        if i.size == 0:
            i = i.astype(np.int32)
    if isinstance(i, (np.ndarray, Array, Tracer)):
        return i
    return None


def _index_rank(i) -> int:
    """How many axes of the operand an index entry consumes."""
    if i is None or i is Ellipsis:
        return 0
    arr = _as_index_array(i) if not isinstance(i, (Tracer, Array)) else i
    return _aval(arr).ndim if arr is not None and _aval(arr).dtype == _dt.bool_ else 1


def _check_mask(mask_shape, x_shape, idx, pos):
    """A boolean mask must match the shape of the axes it indexes (numpy's rule)."""
    if builtins.any(i is Ellipsis for i in idx[:pos]):
        start = len(x_shape) - builtins.sum(_index_rank(i) for i in idx[pos:])
    else:
        start = builtins.sum(_index_rank(i) for i in idx[:pos])
    axes = x_shape[start:start + len(mask_shape)]
    if start < 0 or tuple(axes) != tuple(mask_shape):
        raise IndexError(with_user_line(f"boolean index of shape {tuple(mask_shape)} does not match the "
                                        f"indexed axes {tuple(axes)} of an array of shape {tuple(x_shape)}"))


def _getitem(x, idx):
    x = _operand(x)
    if not isinstance(idx, tuple):
        idx = (idx,)
    # concrete boolean masks become integer index arrays; traced ones cannot (data-dependent shape)
    expanded = []
    for pos, i in enumerate(idx):
        arr = _as_index_array(i) if not isinstance(i, (Tracer, Array)) else i
        if arr is not None and _aval(arr).dtype == _dt.bool_:
            val = concrete_or_none(arr)
            if val is None:
                raise ConcretizationError(with_user_line(
                    f"boolean mask indexing with a traced mask {_aval(arr)} has a data-dependent "
                    "shape, which jit cannot stage; use tnp.where(mask, x, 0) (or x.at[mask].set(v)) "
                    "to keep the shape, or pass the mask as a concrete (static) value"))
            val = np.asarray(val)
            if val.ndim == 0:
                raise TilefuseError(with_user_line("indexing with a 0-d boolean mask is not supported"))
            _check_mask(val.shape, _aval(x).shape, idx, pos)
            expanded.extend(val.nonzero())
        elif isinstance(i, (builtins.bool, np.bool_)):
            raise TilefuseError(with_user_line("indexing with a Python bool is not supported"))
        else:
            expanded.append(i)
    idx = expanded
    n_ell = builtins.sum(1 for i in idx if i is Ellipsis)
    if n_ell > 1:
        raise TilefuseError(with_user_line("an index can only have a single ellipsis ('...')"))
    n_real = builtins.sum(1 for i in idx if i is not None and i is not Ellipsis)
    a = _aval(x)
    if n_real > a.ndim:
        raise ShapeError(with_user_line(f"too many indices ({n_real}) for an array of shape {a.shape}"))
    if n_ell:
        k = idx.index(Ellipsis)
        idx = idx[:k] + [slice(None)] * (a.ndim - n_real) + idx[k + 1:]
    else:
        idx = idx + [slice(None)] * (a.ndim - n_real)
    # None: insert a unit axis in the operand and index it with a full slice
    if builtins.any(i is None for i in idx):
        shp, j = [], 0
        for i in idx:
            if i is None:
                shp.append(1)
            else:
                shp.append(a.shape[j])
                j += 1
        x = reshape(x, shp)
        idx = [slice(None) if i is None else i for i in idx]
        a = _aval(x)
    advanced = [k for k, i in enumerate(idx) if _as_index_array(i) is not None]
    if advanced:  # ints among advanced indices act as advanced (numpy's rule)
        idx = [np.asarray(i, np.int32) if _is_int_index(i) else i for i in idx]
        advanced = [k for k, i in enumerate(idx) if _as_index_array(i) is not None]
    # basic part: one slice (with rev for negative steps), then drop int-indexed axes
    starts, limits, strides, rev_axes, drop = [], [], [], [], []
    for k, (i, n) in enumerate(zip(idx, a.shape)):
        if _is_int_index(i):
            j = int(i) + n if i < 0 else int(i)
            if not 0 <= j < n:
                raise IndexError(with_user_line(f"index {int(i)} is out of bounds for axis {k} "
                                                f"with size {n}"))
            starts.append(j), limits.append(j + 1), strides.append(1)
            drop.append(k)
        elif isinstance(i, slice):
            s, l, st = slice_indices(i, n)
            if st < 0:  # reverse the axis, then slice forward
                rev_axes.append(k)
                s, l, st = n - 1 - s, n - 1 - l, -st
            l = builtins.max(l, s)
            starts.append(s), limits.append(l), strides.append(st)
        elif k in advanced:
            starts.append(0), limits.append(n), strides.append(1)
        else:
            raise TilefuseError(with_user_line(f"unsupported index {i!r} of type {type(i).__name__}"))
    if rev_axes:
        x = bind1(P.rev, x, dimensions=tuple(rev_axes))
    if (starts, limits, strides) != ([0] * a.ndim, list(a.shape), [1] * a.ndim):
        x = bind1(P.slice_, x, start_indices=tuple(starts), limit_indices=tuple(limits),
                  strides=tuple(strides))
    if drop:
        x = reshape(x, [n for k, n in enumerate(_aval(x).shape) if k not in drop])
        remap = {k: k - builtins.sum(1 for d in drop if d < k) for k in range(a.ndim) if k not in drop}
        advanced = [remap[k] for k in advanced]
        idx = [i for k, i in enumerate(idx) if k not in drop]
    if not advanced:
        return x
    return _advanced_index(x, advanced, [idx[k] for k in advanced])


def _advanced_index(x, axes, indexes):
    a = _aval(x)
    arrays = []
    for ax, i in zip(axes, indexes):
        i = _as_index_array(i)
        n = a.shape[ax]
        if not _dt.is_int(_aval(i).dtype):
            raise TilefuseError(with_user_line(f"index arrays must be integers, got {_aval(i).dtype}"))
        val = concrete_or_none(i) if not isinstance(i, Array) else None
        if isinstance(val, np.ndarray):
            if val.size and (val.max() >= n or val.min() < -n):
                raise IndexError(with_user_line(f"index {int(val.max() if val.max() >= n else val.min())}"
                                                f" is out of bounds for axis {ax} with size {n}"))
            i = np.where(val < 0, val + n, val).astype(np.int32)
        else:
            i = astype(i, _dt.int32)
            i = where(less(i, 0), i + n, i)
        arrays.append(i)
    bshape = broadcast_shapes(*(_aval(i).shape for i in arrays))
    # bring the advanced axes to the front, merge them into one, gather along it
    rest = [k for k in range(a.ndim) if k not in axes]
    xt = transpose(x, list(axes) + rest)
    sizes = [a.shape[k] for k in axes]
    xt = reshape(xt, (math.prod(sizes),) + tuple(a.shape[k] for k in rest))  # (a symbolic size stays one)
    flat = None
    stride = 1
    for i, n in zip(reversed(arrays), reversed(sizes)):
        term = broadcast_to(i, bshape) if stride == 1 else broadcast_to(i, bshape) * stride
        flat = term if flat is None else flat + term
        stride *= n
    if isinstance(flat, np.ndarray):
        flat = flat.astype(np.int32)
    out = bind1(P.gather, xt, flat, axis=0)
    contiguous = list(axes) == list(range(axes[0], axes[0] + len(axes)))
    if contiguous and axes[0] > 0:  # numpy keeps adjacent advanced axes in place
        nb = len(bshape)
        order = list(range(nb, nb + axes[0])) + list(range(nb)) + list(range(nb + axes[0], ndim(out)))
        out = transpose(out, order)
    return out


def take(x, indices, axis=None, mode=None):
    """numpy.take. Concrete indices out of range raise IndexError (numpy's rule) unless
    mode='clip'; traced ones cannot be checked and clamp to the edge (JAX's 'clip' mode)."""
    x = _operand(x)
    if axis is None:
        x, axis = ravel(x), 0
    axis = _norm_axis(axis, ndim(x))
    n = shape(x)[axis]
    i = _as_index_array(indices)
    if i is None:
        i = np.asarray(indices)
    if not (_dt.is_int(_aval(i).dtype) or np.dtype(_aval(i).dtype).kind in "iu"):
        raise DTypeError(with_user_line(f"take: indices must be integers, got {_aval(i).dtype} "
                                        "(convert them with .astype(int32))"))
    if isinstance(i, np.ndarray) and mode != "clip" and i.size and (i.max() >= n or i.min() < -n):
        bad = int(i.max() if i.max() >= n else i.min())
        raise IndexError(with_user_line(f"take: index {bad} is out of bounds for axis {axis} with size {n}"))
    i = astype(i, _dt.int32) if not isinstance(i, np.ndarray) else i.astype(np.int32)
    if mode != "clip":
        i = where(less(i, 0), i + n, i) if not isinstance(i, np.ndarray) else np.where(i < 0, i + n, i)
    return bind1(P.gather, x, i, axis=axis)


def take_along_axis(arr, indices, axis):
    arr, indices = _operand(arr), _operand(indices)
    if axis is None:
        arr, axis = ravel(arr), 0
    a = _aval(arr)
    axis = _norm_axis(axis, a.ndim)
    ia = _aval(indices)
    if ia.ndim != a.ndim:
        raise ShapeError(with_user_line(f"take_along_axis: indices {ia.shape} and array {a.shape} "
                                        "need the same rank"))
    oshape = broadcast_shapes(tuple(n if k != axis else 1 for k, n in enumerate(a.shape)),
                              tuple(n if k != axis else 1 for k, n in enumerate(ia.shape)))
    oshape = tuple(ia.shape[k] if k == axis else n for k, n in enumerate(oshape))
    arr = broadcast_to(arr, tuple(a.shape[k] if k == axis else n for k, n in enumerate(oshape)))
    a = _aval(arr)
    idx = broadcast_to(astype(indices, _dt.int32), oshape)
    idx = where(less(idx, 0), idx + a.shape[axis], idx)
    strides = np.cumprod((1,) + a.shape[::-1])[::-1][1:]
    flat = idx * int(strides[axis]) if strides[axis] != 1 else idx
    for k in range(a.ndim):
        if k != axis and oshape[k] > 1:
            io = bind1(P.iota, dtype=_dt.int32, shape=oshape, dimension=k)
            flat = flat + (io * int(strides[k]) if strides[k] != 1 else io)
    return bind1(P.gather, ravel(arr), flat, axis=0)


def nonzero(x):
    val = concrete_or_none(_operand(x))
    if val is None or isinstance(val, Tracer):
        raise ConcretizationError(with_user_line(
            "nonzero (and where(cond) with one argument) of a traced array has a data-dependent shape"))
    return tuple(asarray(i.astype(np.int32)) for i in np.asarray(val).nonzero())


def _setitem(x, idx, value):
    raise TypeError("tilefuse arrays are immutable: use x.at[idx].set(value) or tnp.where")


class _IndexUpdateHelper:
    """x.at[idx].set(v) / .add(v) / .get(): functional updates, as in JAX."""
    __slots__ = ("x",)

    def __init__(self, x):
        self.x = x

    def __getitem__(self, idx):
        return _IndexUpdateRef(self.x, idx)


class _IndexUpdateRef:
    """x.at[idx]: `set` follows numpy's x[idx] = v (the last of repeated indices wins, when the
    index is concrete; with traced indices repeated positions get the mean of their values);
    `add` accumulates repeated indices (np.add.at)."""
    __slots__ = ("x", "idx")

    def __init__(self, x, idx):
        self.x, self.idx = x, idx

    def get(self):
        return _getitem(self.x, self.idx)

    def _static_positions(self):
        """Flat positions the index selects, as numpy, when the index holds no tracer."""
        idx = self.idx if isinstance(self.idx, tuple) else (self.idx,)
        if builtins.any(isinstance(i, Tracer) for i in idx):
            return None
        idx = tuple(np.asarray(i) if isinstance(i, Array) else i for i in idx)
        try:
            return np.arange(size(self.x), dtype=np.int32).reshape(shape(self.x))[idx]
        except IndexError as err:
            raise IndexError(with_user_line(f"{err} (indexing an array of shape {shape(self.x)})")) from None

    def _updates(self, x, value, out_shape):
        return ravel(broadcast_to(astype(value, _aval(x).dtype), out_shape))

    def add(self, value):
        x = _operand(self.x)
        pos = self._static_positions()
        if pos is None:
            pos = ravel(_getitem(reshape(arange(size(x), dtype=_dt.int32), shape(x)), self.idx))
        upd = self._updates(x, value, shape(pos))
        flat = bind1(P.scatter_add, ravel(x), ravel(pos), upd, axis=0)
        return reshape(flat, shape(x))

    def set(self, value):
        x = _operand(self.x)
        dt = _aval(x).dtype
        pos = self._static_positions()
        if pos is None:
            return self._set_traced(x, value)
        upd = self._updates(x, value, pos.shape)
        flat = pos.reshape(-1)
        if np.unique(flat).size != flat.size:  # keep only the last write to each position
            last = np.full(size(x), -1, np.int64)
            last[flat] = np.arange(flat.size)
            keep = last[last >= 0].astype(np.int32)
            upd, flat = take(upd, keep), flat[keep]
        if flat.size == 0:
            return x
        hit = np.zeros(size(x), bool)
        hit[flat] = True
        new = bind1(P.scatter_add, zeros(size(x), dt), flat, upd, axis=0)
        return reshape(where(hit, new, ravel(x)), shape(x))

    def _set_traced(self, x, value):
        dt = _aval(x).dtype
        pos = ravel(_getitem(reshape(arange(size(x), dtype=_dt.int32), shape(x)), self.idx))
        upd = self._updates(x, value, shape(pos))
        hit = bind1(P.scatter_add, zeros(size(x), _dt.int32), pos, ones(size(pos), _dt.int32), axis=0)
        new = bind1(P.scatter_add, zeros(size(x), dt), pos, upd, axis=0)
        if not _dt.is_bool(dt):  # repeated positions summed their values: take the mean
            many = greater(hit, 1)
            n = astype(where(many, hit, 1), dt)
            new = where(many, floor_divide(new, n) if _dt.is_int(dt) else new / n, new)
        return reshape(where(greater(hit, 0), new, ravel(x)), shape(x))

    def multiply(self, value):
        return self.set(self.get() * value)

    mul = multiply

    def min(self, value):
        return self.set(minimum(self.get(), value))

    def max(self, value):
        return self.set(maximum(self.get(), value))

    def divide(self, value):
        return self.set(self.get() / value)

    def power(self, value):
        return self.set(self.get() ** value)

    def apply(self, func):
        """func applied to the selected entries (JAX's .at[].apply)."""
        return self.set(func(self.get()))


# ---- operators on tracers and Arrays (the one place they are defined) ---------------------

def _swap(f):
    return lambda x, y: f(y, x)


def _astype_method(x, dtype, copy=True):
    return astype(x, dtype)


def _method(fn):
    """An array method that numpy's functions may call with out=None (np.sum(x) calls x.sum)."""
    def method(x, *args, out=None, **kwargs):
        if out is not None:
            raise TypeError(f"{fn.__name__}: tilefuse arrays are immutable; out= is not supported")
        return fn(x, *args, **kwargs)
    method.__name__ = fn.__name__
    return method


_METHODS = {
    "__add__": add, "__radd__": _swap(add), "__sub__": subtract, "__rsub__": _swap(subtract),
    "__mul__": multiply, "__rmul__": _swap(multiply), "__truediv__": divide,
    "__rtruediv__": _swap(divide), "__floordiv__": floor_divide, "__rfloordiv__": _swap(floor_divide),
    "__mod__": remainder, "__rmod__": _swap(remainder), "__pow__": power, "__rpow__": _swap(power),
    "__matmul__": matmul, "__rmatmul__": _swap(matmul), "__neg__": negative, "__pos__": positive,
    "__abs__": abs, "__invert__": invert, "__and__": bitwise_and, "__rand__": _swap(bitwise_and),
    "__or__": bitwise_or, "__ror__": _swap(bitwise_or), "__xor__": bitwise_xor,
    "__rxor__": _swap(bitwise_xor), "__lt__": less, "__le__": less_equal, "__gt__": greater,
    "__ge__": greater_equal, "__eq__": equal, "__ne__": not_equal, "__getitem__": _getitem,
    "__setitem__": _setitem,
    "reshape": reshape, "transpose": lambda x, *axes: transpose(
        x, axes[0] if len(axes) == 1 and not isinstance(axes[0], int) else (axes or None)),
    "astype": _astype_method, "squeeze": squeeze, "ravel": ravel, "flatten": ravel, "swapaxes": swapaxes,
    "dot": dot, "repeat": repeat, "diagonal": diagonal, "nonzero": nonzero,
    **{f.__name__: _method(f) for f in (sum, mean, max, min, prod, argmax, argmin, var, std, all, any, clip,
                                        cumsum, cumprod, take, ptp, trace)},
    "round": _method(round),
}
_PROPERTIES = {"T": lambda x: transpose(x), "mT": lambda x: swapaxes(x, -1, -2),
               "at": lambda x: _IndexUpdateHelper(x)}


def _install(cls):
    for name, fn in _METHODS.items():
        setattr(cls, name, fn)
    for name, fn in _PROPERTIES.items():
        setattr(cls, name, property(fn))
    cls.__hash__ = None if cls is Array else object.__hash__


_install(Tracer)
_install(Array)


# ---- the rest of numpy's namespace, by concern, and the submodules --------------------------
from tilefuse.numpy import linalg  # noqa: E402,F401
from tilefuse.numpy._math import *  # noqa: E402,F401,F403
from tilefuse.numpy._sorting import *  # noqa: E402,F401,F403
from tilefuse.numpy._reductions import *  # noqa: E402,F401,F403
from tilefuse.numpy._shapes import *  # noqa: E402,F401,F403

# array operators and methods of the functions defined above in the submodules
for _name, _fn in {"__lshift__": left_shift, "__rlshift__": _swap(left_shift), "__rshift__": right_shift,  # noqa: F405
                   "__rrshift__": _swap(right_shift), "argsort": _method(argsort), "sort": _method(sort),  # noqa: F405
                   "searchsorted": searchsorted, "conj": conj, "conjugate": conj}.items():  # noqa: F405
    setattr(Tracer, _name, _fn)
    setattr(Array, _name, _fn)
for _name, _fn in {"real": real, "imag": imag}.items():  # noqa: F405
    setattr(Tracer, _name, property(_fn))
    setattr(Array, _name, property(_fn))
