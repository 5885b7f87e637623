"""Small array helpers over primitives for the differentiation rules.

autodiff sits below tilefuse.numpy, so the rules cannot use it: these helpers bind primitives
directly. Operands must already agree in shape and dtype (as the primitives require), except
where a helper says it broadcasts. Constants are numpy values: eagerly they run on the default
device, under jit they become literals or constants of the staged graph."""
from __future__ import annotations

import numpy as np

from tilefuse.ir import dtypes
from tilefuse.ir import primitives as P
from tilefuse.ir.core import ShapedArray
from tilefuse.tracer.core import bind1, get_aval


def aval(x) -> ShapedArray:
    return get_aval(x)


def full(shape, value, dtype):
    """An array of `shape` filled with `value`: always a bound value (Array or tracer)."""
    return bind1(P.broadcast_in_dim, np.asarray(value, dtype), shape=tuple(shape),
                 broadcast_dimensions=())


def zeros(a: ShapedArray):
    return full(a.shape, 0, a.dtype)


def like(x, value):
    """`value` in x's shape and dtype (a cheap numpy scalar when x is a scalar)."""
    a = aval(x)
    if a.shape == ():
        return np.asarray(value, a.dtype)
    return full(a.shape, value, a.dtype)


def instantiate(t, primal):
    """A tangent or cotangent, with a symbolic zero (None) made a real zero of primal's aval."""
    return zeros(aval(primal)) if t is None else t


def neg(x):
    return bind1(P.neg, x)


def add(x, y):
    return bind1(P.add, x, y)


def sub(x, y):
    return bind1(P.sub, x, y)


def mul(x, y):
    return bind1(P.mul, x, y)


def div(x, y):
    return bind1(P.div, x, y)


def add_any(x, y):
    """Sum of two (co)tangents where None is a symbolic zero."""
    if x is None:
        return y
    if y is None:
        return x
    return add(x, y)


def eq(x, y):
    return bind1(P.eq, x, y)


def select(pred, on_true, on_false):
    return bind1(P.select, pred, on_true, on_false)


def convert(x, dtype):
    if aval(x).dtype == np.dtype(dtype):
        return x
    return bind1(P.convert_element_type, x, new_dtype=np.dtype(dtype), weak_type=False)


def indicator(pred, like_x):
    """A 0/1 float array (x's dtype) from a bool array."""
    return convert(pred, aval(like_x).dtype)


def reduce_sum(x, axes):
    axes = tuple(sorted(axes))
    return bind1(P.reduce_sum, x, axes=axes) if axes else x


def broadcast(x, shape, dims, force=False):
    """broadcast_in_dim, skipped when it would be the identity (unless forced)."""
    if not force and aval(x).shape == tuple(shape) and tuple(dims) == tuple(range(len(shape))):
        return x
    return bind1(P.broadcast_in_dim, x, shape=tuple(shape), broadcast_dimensions=tuple(dims))


def expand_reduced(y, shape, axes):
    """Broadcast the result y of a reduction over `axes` back to the operand's `shape`."""
    return broadcast(y, shape, [i for i in range(len(shape)) if i not in axes])


def reshape(x, shape):
    shape = tuple(shape)
    return x if aval(x).shape == shape else bind1(P.reshape, x, new_sizes=shape)


def transpose(x, perm):
    perm = tuple(perm)
    return x if perm == tuple(range(len(perm))) else bind1(P.transpose, x, permutation=perm)


def slice_axis(x, dim, start, stop):
    """x[..., start:stop, ...] along one axis."""
    a = aval(x)
    lo, hi = [0] * a.ndim, list(a.shape)
    lo[dim], hi[dim] = start, stop
    if lo == [0] * a.ndim and hi == list(a.shape):
        return x
    return bind1(P.slice_, x, start_indices=tuple(lo), limit_indices=tuple(hi),
                 strides=(1,) * a.ndim)


def materialize(x):
    """A bound value for a host constant (numpy or Python scalar) that reached a result, so
    results are device Arrays (or tracers) like those of every other operation."""
    if isinstance(x, (np.ndarray, np.generic, bool, int, float)):
        a = aval(x)
        return broadcast(x, a.shape, range(a.ndim), force=True)
    return x


def stack(xs, shape, dtype):
    """Stack equal-shaped arrays along a new leading axis (zeros of (0, *shape) for none)."""
    if not xs:
        return full((0, *shape), 0, dtype)
    rows = [reshape(x, (1, *shape)) for x in xs]
    return rows[0] if len(rows) == 1 else bind1(P.concatenate, *rows, dimension=0)


def is_float(x) -> bool:
    return dtypes.is_float(aval(x).dtype)
