"""Layout, construction and indexing helpers of numpy's namespace, composed from the core:
flips and rotations, stacking and splitting, insert/delete/append, index grids and index
conversion, selections (select, choose, piecewise, put), products (kron, cross, vander),
polynomials, windows, function application (vectorize, apply_along_axis through vmap) and the
host-side helpers (printing, files, buffers)."""

from __future__ import annotations

import builtins
import functools
import math
from typing import Callable

import numpy as np

import tilefuse.numpy as tnp
from tilefuse.ir import dtypes as _dt
from tilefuse.ir.errors import ConcretizationError, ShapeError, TilefuseError, with_user_line
from tilefuse.tracer.core import Tracer, concrete_or_none

__all__ = [
    "fliplr",
    "flipud",
    "rot90",
    "column_stack",
    "dstack",
    "block",
    "append",
    "insert",
    "delete",
    "hsplit",
    "vsplit",
    "dsplit",
    "unstack",
    "rollaxis",
    "resize",
    "trim_zeros",
    "diagflat",
    "diag_indices",
    "diag_indices_from",
    "tril_indices_from",
    "triu_indices_from",
    "fill_diagonal",
    "indices",
    "ix_",
    "mgrid",
    "ogrid",
    "r_",
    "c_",
    "s_",
    "index_exp",
    "ravel_multi_index",
    "unravel_index",
    "mask_indices",
    "select",
    "choose",
    "compress",
    "extract",
    "place",
    "put",
    "put_along_axis",
    "piecewise",
    "apply_along_axis",
    "apply_over_axes",
    "vectorize",
    "fromfunction",
    "copy",
    "concat",
    "matrix_transpose",
    "matvec",
    "vecmat",
    "vecdot",
    "kron",
    "cross",
    "einsum_path",
    "vander",
    "polyval",
    "polyadd",
    "polysub",
    "polymul",
    "polyder",
    "polyint",
    "polyfit",
    "polydiv",
    "poly",
    "bartlett",
    "blackman",
    "hamming",
    "hanning",
    "kaiser",
    "array_equiv",
    "array_repr",
    "array_str",
    "get_printoptions",
    "set_printoptions",
    "printoptions",
    "iterable",
    "frombuffer",
    "fromfile",
    "fromiter",
    "fromstring",
    "load",
    "save",
    "savez",
    "from_dlpack",
    "flatnonzero",
    "isdtype",
    "generic",
    "character",
    "logspace",
    "geomspace",
    "packbits",
    "unpackbits",
    "flexible",
    "unsignedinteger",
    "complexfloating",
    "object_",
    "ComplexWarning",
]

# numpy's abstract scalar types, for issubdtype and isinstance checks
generic, character, flexible = np.generic, np.character, np.flexible
unsignedinteger, complexfloating, object_ = np.unsignedinteger, np.complexfloating, np.object_
ComplexWarning = np.exceptions.ComplexWarning


def _arr(x):
    return tnp._operand(x) if isinstance(x, (Tracer, tnp.Array)) else tnp.asarray(x)


def _static(x, what: str):
    """The concrete numpy value of x, or a ConcretizationError naming `what`."""
    v = concrete_or_none(tnp._operand(x)) if isinstance(x, (Tracer, tnp.Array)) else np.asarray(x)
    if v is None or isinstance(v, Tracer):
        raise ConcretizationError(
            with_user_line(
                f"{what} needs concrete values (its result's shape depends on them), not a traced array"
            )
        )
    return np.asarray(v)


# ---- flips, rotations, stacking, splitting --------------------------------------------------------


def fliplr(m):
    if tnp.ndim(m) < 2:
        raise ShapeError(with_user_line("fliplr: needs an array of rank >= 2"))
    return tnp.flip(m, 1)


def flipud(m):
    if tnp.ndim(m) < 1:
        raise ShapeError(with_user_line("flipud: needs an array of rank >= 1"))
    return tnp.flip(m, 0)


def rot90(m, k: int = 1, axes=(0, 1)):
    m = _arr(m)
    a0, a1 = (tnp._norm_axis(a, tnp.ndim(m)) for a in axes)
    if a0 == a1:
        raise ShapeError(with_user_line("rot90: the axes must differ"))
    k = int(k) % 4
    if k == 0:
        return m
    if k == 2:
        return tnp.flip(tnp.flip(m, a0), a1)
    if k == 1:
        return tnp.swapaxes(tnp.flip(m, a1), a0, a1)
    return tnp.flip(tnp.swapaxes(m, a0, a1), a1)


def column_stack(tup):
    cols = []
    for a in tup:
        a = _arr(a)
        cols.append(tnp.reshape(a, (-1, 1)) if tnp.ndim(a) < 2 else a)
    return tnp.concatenate(cols, axis=1)


def dstack(tup):
    return tnp.concatenate([tnp.atleast_3d(a) for a in tup], axis=2)


def block(arrays):
    """Assemble nested lists of blocks (the innermost lists join along the last axis)."""

    def depth(x):
        return 1 + depth(x[0]) if isinstance(x, list) and x else (1 if isinstance(x, list) else 0)

    d = depth(arrays)
    leaves = []

    def collect(x):
        if isinstance(x, list):
            for y in x:
                collect(y)
        else:
            leaves.append(_arr(x))

    collect(arrays)
    nd = builtins.max([d] + [tnp.ndim(a) for a in leaves])

    def build(x, level):
        if not isinstance(x, list):
            a = _arr(x)
            return tnp.reshape(a, (1,) * (nd - tnp.ndim(a)) + tnp.shape(a))
        return tnp.concatenate([build(y, level + 1) for y in x], axis=nd - d + level)

    return build(arrays, 0) if isinstance(arrays, list) else _arr(arrays)


def append(arr, values, axis=None):
    arr, values = tnp._promote(arr, values)
    if axis is None:
        return tnp.concatenate([tnp.ravel(arr), tnp.ravel(values)])
    return tnp.concatenate([arr, values], axis=axis)


def _positions(obj, n):
    """Static indices for insert/delete from an int, a slice or a sequence."""
    if isinstance(obj, slice):
        return np.arange(n)[obj]
    return _static(obj, "insert/delete's positions").astype(np.int64)


def delete(arr, obj, axis=None, *, assume_unique_indices: bool = False):
    arr = _arr(arr)
    if axis is None:
        arr, axis = tnp.ravel(arr), 0
    axis = tnp._norm_axis(axis, tnp.ndim(arr))
    n = tnp.shape(arr)[axis]
    pos = _positions(obj, n)
    if pos.size and (pos.max() >= n or pos.min() < -n):
        raise IndexError(with_user_line(f"delete: index out of bounds for an axis of size {n}"))
    keep = np.setdiff1d(np.arange(n), np.where(pos < 0, pos + n, pos))
    return tnp.take(arr, keep.astype(np.int32), axis=axis)


def insert(arr, obj, values, axis=None):
    arr = _arr(arr)
    if axis is None:
        arr, axis = tnp.ravel(arr), 0
    axis = tnp._norm_axis(axis, tnp.ndim(arr))
    n = tnp.shape(arr)[axis]
    scalar = isinstance(obj, (int, np.integer))
    pos = np.atleast_1d(_positions(obj, n + 1))
    pos = np.where(pos < 0, pos + n, pos)
    (values,) = tnp._promote(values)
    values = tnp.astype(values, tnp._aval(arr).dtype)
    shape = list(tnp.shape(arr))
    nd = len(shape)
    if scalar:  # numpy: values (at least arr's rank, first axis moved to `axis`) go in before obj
        v = (
            tnp.reshape(values, (1,) * (nd - tnp.ndim(values)) + tnp.shape(values))
            if tnp.ndim(values) < nd
            else values
        )
        v = tnp.moveaxis(v, 0, axis)
        shape[axis] = tnp.shape(v)[axis]
        p = int(pos[0])
        return tnp.concatenate(
            [
                tnp._slice_axis(arr, axis, 0, p),
                tnp.broadcast_to(v, tuple(shape)),
                tnp._slice_axis(arr, axis, p, n),
            ],
            axis,
        )
    shape[axis] = len(pos)
    vals = tnp.broadcast_to(values, tuple(shape))
    # numpy's order: stable by position, each value placed before the original entry at pos
    order = np.argsort(pos, kind="stable")
    total = n + len(pos)
    new_pos = np.sort(pos) + np.arange(len(pos))
    is_new = np.zeros(total, bool)
    is_new[new_pos] = True
    src_old = np.cumsum(~is_new) - 1
    src_new = np.empty(len(pos), np.int64)
    src_new[np.arange(len(pos))] = order
    both = tnp.concatenate([arr, vals], axis=axis)
    gather = np.where(is_new, n + src_new[np.cumsum(is_new) - 1], src_old)
    return tnp.take(both, gather.astype(np.int32), axis=axis)


def _split_n(name, ary, sections, axis, min_rank):
    if tnp.ndim(ary) < min_rank:
        raise ShapeError(with_user_line(f"{name}: needs an array of rank >= {min_rank}"))
    return tnp.split(ary, sections, axis)


def hsplit(ary, indices_or_sections):
    return _split_n("hsplit", ary, indices_or_sections, 1 if tnp.ndim(ary) > 1 else 0, 1)


def vsplit(ary, indices_or_sections):
    return _split_n("vsplit", ary, indices_or_sections, 0, 2)


def dsplit(ary, indices_or_sections):
    return _split_n("dsplit", ary, indices_or_sections, 2, 3)


def unstack(x, /, *, axis: int = 0):
    x = _arr(x)
    axis = tnp._norm_axis(axis, tnp.ndim(x))
    return (
        tuple(tnp.squeeze(p, axis) for p in tnp.split(x, tnp.shape(x)[axis], axis))
        if tnp.shape(x)[axis]
        else ()
    )


def rollaxis(a, axis: int, start: int = 0):
    a = _arr(a)
    nd = tnp.ndim(a)
    axis = tnp._norm_axis(axis, nd)
    start = start + nd if start < 0 else start
    if axis < start:
        start -= 1
    return tnp.moveaxis(a, axis, start)


def resize(a, new_shape):
    """a's entries repeated (in order) to fill new_shape (numpy.resize)."""
    a = tnp.ravel(_arr(a))
    shape = tnp._shape_tuple(new_shape)
    total = int(np.prod(shape, dtype=np.int64))
    n = tnp.shape(a)[0]
    if n == 0:
        return tnp.zeros(shape, tnp._aval(a).dtype)
    reps = -(-total // n)
    return tnp.reshape(tnp.tile(a, reps)[:total], shape)


def trim_zeros(filt, trim: str = "fb"):
    """filt without its leading ('f') and/or trailing ('b') zeros (needs concrete values)."""
    v = _static(filt, "trim_zeros")
    t = trim.lower()
    nz = np.flatnonzero(v)
    if not nz.size:
        return _arr(filt)[:0] if ("f" in t or "b" in t) else _arr(filt)
    lo = int(nz[0]) if "f" in t else 0
    hi = int(nz[-1]) + 1 if "b" in t else v.size
    return _arr(filt)[lo:hi]


def diagflat(v, k: int = 0):
    return tnp.diag(tnp.ravel(_arr(v)), k)


def diag_indices(n: int, ndim: int = 2):
    i = tnp.arange(n, dtype=tnp.int32)
    return (i,) * ndim


def diag_indices_from(arr):
    shape = tnp.shape(arr)
    if len(shape) < 2 or len(set(shape)) != 1:
        raise ShapeError(
            with_user_line(f"diag_indices_from: needs an array with all axes equal, got {shape}")
        )
    return diag_indices(shape[0], len(shape))


def tril_indices_from(arr, k: int = 0):
    n, m = tnp.shape(arr)[-2:]
    return tnp.tril_indices(n, k, m)


def triu_indices_from(arr, k: int = 0):
    n, m = tnp.shape(arr)[-2:]
    return tnp.triu_indices(n, k, m)


def fill_diagonal(a, val, wrap: bool = False, *, inplace: bool = False):
    """A copy of a with its main diagonal set to val (JAX's: inplace must be False)."""
    if inplace:
        raise TilefuseError(
            with_user_line(
                "fill_diagonal: tilefuse arrays are immutable; pass inplace=False and use the returned array"
            )
        )
    a = _arr(a)
    shape = tnp.shape(a)
    if len(shape) < 2:
        raise ShapeError(with_user_line("fill_diagonal: needs an array of rank >= 2"))
    if len(shape) > 2 and len(set(shape)) != 1:
        raise ShapeError(with_user_line(f"fill_diagonal: all axes must be equal for rank > 2, got {shape}"))
    n = int(np.prod(shape, dtype=np.int64))
    step = 1 + int(np.sum(np.cumprod(shape[:0:-1])))
    end = n if wrap or len(shape) > 2 else builtins.min(n, shape[1] * shape[1])
    pos = np.arange(0, end, step)
    if len(shape) == 2 and not wrap:
        pos = pos[pos < shape[1] * builtins.min(shape)]
    vals = tnp.ravel(tnp._operand(val))
    vals = (
        tnp.take(
            tnp.astype(vals, tnp._aval(a).dtype), np.arange(len(pos)) % builtins.max(tnp.shape(vals)[0], 1)
        )
        if tnp.ndim(val)
        else tnp.astype(val, tnp._aval(a).dtype)
    )
    flat = tnp.ravel(a).at[pos.astype(np.int32)].set(vals)
    return tnp.reshape(flat, shape)


# ---- index grids and conversions -------------------------------------------------------------------


def indices(dimensions, dtype=None, sparse: bool = False):
    dims = tuple(int(d) for d in dimensions)
    dtype = dtype or tnp.int32
    out = []
    for k, n in enumerate(dims):
        shape = [1] * len(dims)
        shape[k] = n
        g = tnp.reshape(tnp.arange(n, dtype=dtype), shape)
        out.append(g if sparse else tnp.broadcast_to(g, dims))
    return tuple(out) if sparse else (tnp.stack(out) if out else tnp.zeros((0,), dtype))


def ix_(*args):
    out = []
    for k, a in enumerate(args):
        a = _arr(a)
        if tnp.ndim(a) != 1:
            raise ShapeError(with_user_line("ix_: each argument must be 1-d"))
        if _dt.is_bool(tnp._aval(a).dtype):
            a = tnp.asarray(np.flatnonzero(_static(a, "ix_ of a boolean mask")).astype(np.int32))
        shape = [1] * len(args)
        shape[k] = tnp.shape(a)[0]
        out.append(tnp.reshape(a, shape))
    return tuple(out)


class _Grid:
    """mgrid / ogrid: numpy's index tricks, static ranges only."""

    def __init__(self, sparse: bool):
        self.sparse = sparse

    def __getitem__(self, key):
        keys = key if isinstance(key, tuple) else (key,)
        axes = []
        for s in keys:
            if not isinstance(s, slice):
                raise TilefuseError(with_user_line("mgrid/ogrid take slices"))
            start = 0 if s.start is None else s.start
            step = 1 if s.step is None else s.step
            if isinstance(step, complex):
                axes.append(tnp.linspace(start, s.stop, int(abs(step))))
            else:
                axes.append(tnp.arange(start, s.stop, step))
        if len(axes) == 1 and not isinstance(key, tuple):
            return axes[0]
        grids = tnp.meshgrid(*axes, indexing="ij")
        if self.sparse:
            return [
                tnp.reshape(a, [-1 if i == k else 1 for i in range(len(axes))]) for k, a in enumerate(axes)
            ]
        dt = tnp.result_type(*grids)
        return tnp.stack([tnp.astype(g, dt) for g in grids])


mgrid, ogrid = _Grid(False), _Grid(True)


class _Concatenator:
    """r_ and c_: numpy's index-expression concatenation (arrays, scalars and static slices)."""

    def __init__(self, columns: bool):
        self.columns = columns

    def __getitem__(self, key):
        keys = key if isinstance(key, tuple) else (key,)
        parts = []
        for k in keys:
            if isinstance(k, slice):
                step = 1 if k.step is None else k.step
                start = 0 if k.start is None else k.start
                part = (
                    tnp.linspace(start, k.stop, int(abs(step)))
                    if isinstance(step, complex)
                    else tnp.arange(start, k.stop, step)
                )
            elif isinstance(k, str):
                raise TilefuseError(with_user_line("r_/c_: string directives are not supported"))
            else:
                part = tnp.atleast_1d(_arr(k))
            parts.append(part)
        if self.columns:
            return (
                column_stack(parts)
                if builtins.all(tnp.ndim(p) == 1 for p in parts)
                else tnp.concatenate(parts, axis=-1)
            )
        return tnp.concatenate(parts, axis=0)


r_, c_ = _Concatenator(False), _Concatenator(True)
s_, index_exp = np.s_, np.index_exp


def ravel_multi_index(multi_index, dims, mode: str = "raise", order: str = "C"):
    """Flat indices (int32) from a tuple of index arrays; mode 'clip' or 'wrap' for traced ones
    ('raise' checks concrete indices)."""
    dims = tuple(int(d) for d in dims)
    if len(multi_index) != len(dims):
        raise ShapeError(with_user_line("ravel_multi_index: one index array per dimension"))
    idx = [tnp.astype(_arr(i), tnp.int32) for i in multi_index]
    if mode == "raise":
        for i, n in zip(multi_index, dims):
            v = concrete_or_none(_arr(i))
            if (
                v is not None
                and not isinstance(v, Tracer)
                and (np.any(np.asarray(v) < 0) or np.any(np.asarray(v) >= n))
            ):
                raise ValueError(
                    with_user_line(f"ravel_multi_index: invalid entry for a dimension of size {n}")
                )
    elif mode == "clip":
        idx = [tnp.clip(i, 0, n - 1) for i, n in zip(idx, dims)]
    elif mode == "wrap":
        idx = [tnp.remainder(i, n) for i, n in zip(idx, dims)]
    strides = np.cumprod((1,) + dims[::-1])[::-1][1:] if order == "C" else np.cumprod((1,) + dims)[:-1]
    out = None
    for i, s in zip(idx, strides):
        term = i * int(s)
        out = term if out is None else out + term
    return out


def unravel_index(indices, shape):
    shape = tuple(int(d) for d in shape)
    i = tnp.astype(_arr(indices), tnp.int32)
    total = int(np.prod(shape, dtype=np.int64))
    i = tnp.where(i < 0, i + total, i)
    out = []
    for n in shape[::-1]:
        out.append(tnp.remainder(i, n))
        i = tnp.floor_divide(i, n)
    return tuple(out[::-1])


def mask_indices(n: int, mask_func: Callable, k: int = 0):
    m = np.asarray(mask_func(np.ones((n, n), np.int32), k))
    return tuple(tnp.asarray(i.astype(np.int32)) for i in np.nonzero(m))


def flatnonzero(a, *, size=None, fill_value=None):
    v = _static(a, "flatnonzero (or pass a static size=)") if size is None else None
    if v is not None:
        return tnp.asarray(np.flatnonzero(v).astype(np.int32))
    a = tnp.ravel(_arr(a))
    mask = a != 0
    n = tnp.shape(a)[0]
    slot = tnp.cumsum(tnp.astype(mask, tnp.int32)) - 1
    target = tnp.where(mask & (slot < size), slot, size)
    fill = 0 if fill_value is None else fill_value
    return tnp.full((size + 1,), fill, tnp.int32).at[target].set(tnp.arange(n, dtype=tnp.int32))[:size]


# ---- selection ---------------------------------------------------------------------------------


def select(condlist, choicelist, default=0):
    if len(condlist) != len(choicelist):
        raise ShapeError(with_user_line("select: condlist and choicelist need equal lengths"))
    if not condlist:
        raise TilefuseError(with_user_line("select: needs at least one condition"))
    out = default
    for c, v in zip(condlist[::-1], choicelist[::-1]):  # the first true condition wins
        out = tnp.where(c, v, out)
    return tnp._operand(out)


def choose(a, choices, out=None, mode: str = "raise"):
    a = tnp.astype(_arr(a), tnp.int32)
    choices = (
        list(choices)
        if not isinstance(choices, (Tracer, tnp.Array))
        else [choices[i] for i in range(tnp.shape(choices)[0])]
    )
    n = len(choices)
    if mode == "raise":
        v = concrete_or_none(a)
        if (
            v is not None
            and not isinstance(v, Tracer)
            and (np.any(np.asarray(v) < 0) or np.any(np.asarray(v) >= n))
        ):
            raise ValueError(with_user_line("choose: invalid entry in the choice array"))
    elif mode == "wrap":
        a = tnp.remainder(a, n)
    else:
        a = tnp.clip(a, 0, n - 1)
    out = choices[0]
    for k in range(1, n):
        out = tnp.where(a == k, choices[k], out)
    return tnp.broadcast_to(out, tnp.broadcast_shapes(tnp.shape(a), *[tnp.shape(c) for c in choices]))


def compress(condition, a, axis=None, *, size=None, fill_value=0):
    cond = _static(condition, "compress").astype(bool).ravel()
    a = _arr(a)
    if axis is None:
        a, axis = tnp.ravel(a), 0
    keep = np.flatnonzero(cond[: tnp.shape(a)[axis]])
    return tnp.take(a, keep.astype(np.int32), axis=axis)


def extract(condition, arr, *, size=None, fill_value=0):
    cond = _static(condition, "extract").astype(bool).ravel()
    return tnp.take(tnp.ravel(_arr(arr)), np.flatnonzero(cond).astype(np.int32))


def place(arr, mask, vals, *, inplace: bool = False):
    if inplace:
        raise TilefuseError(with_user_line("place: tilefuse arrays are immutable; pass inplace=False"))
    arr = _arr(arr)
    m = _static(mask, "place").astype(bool).ravel()
    pos = np.flatnonzero(m)
    vals = tnp.ravel(tnp.astype(vals, tnp._aval(arr).dtype))
    k = tnp.shape(vals)[0]
    picked = (
        tnp.take(vals, (np.arange(len(pos)) % builtins.max(k, 1)).astype(np.int32)) if len(pos) else vals[:0]
    )
    return tnp.reshape(tnp.ravel(arr).at[pos.astype(np.int32)].set(picked), tnp.shape(arr))


def put(a, ind, v, mode=None, *, inplace: bool = False):
    if inplace:
        raise TilefuseError(with_user_line("put: tilefuse arrays are immutable; pass inplace=False"))
    a = _arr(a)
    flat = tnp.ravel(a)
    n = tnp.shape(flat)[0]
    ind = tnp.ravel(tnp.astype(_arr(ind), tnp.int32))
    if mode == "wrap":
        ind = tnp.remainder(ind, n)
    elif mode == "clip":
        ind = tnp.clip(ind, 0, n - 1)
    v = tnp.ravel(tnp.astype(v, tnp._aval(a).dtype))
    k = tnp.shape(ind)[0]
    v = tnp.take(v, (np.arange(k) % builtins.max(tnp.shape(v)[0], 1)).astype(np.int32)) if k else v[:0]
    return tnp.reshape(flat.at[ind].set(v), tnp.shape(a))


def put_along_axis(arr, indices, values, axis, inplace: bool = False, *, mode=None):
    if inplace:
        raise TilefuseError(
            with_user_line("put_along_axis: tilefuse arrays are immutable; pass inplace=False")
        )
    arr, indices = _arr(arr), tnp.astype(_arr(indices), tnp.int32)
    if axis is None:
        arr, axis = tnp.ravel(arr), 0
    axis = tnp._norm_axis(axis, tnp.ndim(arr))
    shape = tnp.shape(arr)
    n = shape[axis]
    idx = tnp.where(indices < 0, indices + n, indices)
    ishape = tnp.broadcast_shapes(tnp.shape(idx), tuple(1 if k == axis else s for k, s in enumerate(shape)))
    idx = tnp.broadcast_to(idx, tuple(ishape))
    grids = [
        tnp.broadcast_to(
            tnp.reshape(tnp.arange(s, dtype=tnp.int32), [-1 if j == k else 1 for j in range(len(shape))]),
            ishape,
        )
        if k != axis
        else idx
        for k, s in enumerate(shape)
    ]
    flat = ravel_multi_index(grids, shape, mode="clip")
    vals = tnp.broadcast_to(tnp.astype(values, tnp._aval(arr).dtype), ishape)
    return tnp.reshape(tnp.ravel(arr).at[tnp.ravel(flat)].set(tnp.ravel(vals)), shape)


def piecewise(x, condlist, funclist, *args, **kw):
    x = _arr(x)
    if isinstance(condlist, (Tracer, tnp.Array, np.ndarray)) and tnp.ndim(condlist) == tnp.ndim(x):
        condlist = [condlist]
    condlist = list(condlist)
    n = len(condlist)
    if len(funclist) == n + 1:  # the last function is the otherwise case
        other = (
            ~tnp.any(tnp.stack([tnp.astype(c, tnp.bool_) for c in condlist]), axis=0)
            if n
            else tnp.ones(tnp.shape(x), tnp.bool_)
        )
        condlist = condlist + [other]
    elif len(funclist) != n:
        raise ShapeError(with_user_line("piecewise: funclist needs one function per condition (or one more)"))
    out = tnp.zeros_like(x)
    for c, f in zip(condlist, funclist):
        v = f(x, *args, **kw) if callable(f) else tnp.full_like(x, f)
        out = tnp.where(c, tnp.astype(v, tnp._aval(x).dtype), out)
    return out


def _vmap():
    from tilefuse.tracer.vmap import vmap

    return vmap


def apply_along_axis(func1d, axis: int, arr, *args, **kwargs):
    """func1d applied to every 1-d slice along axis, by vmap over the other axes."""
    arr = _arr(arr)
    nd = tnp.ndim(arr)
    axis = tnp._norm_axis(axis, nd)
    f = lambda v: tnp._operand(func1d(v, *args, **kwargs))  # noqa: E731
    moved = tnp.moveaxis(arr, axis, -1)
    for _ in range(nd - 1):
        f = _vmap()(f)
    out = f(moved)
    extra = tnp.ndim(out) - (nd - 1)
    # the function's own axes take the place of the consumed axis (numpy's layout)
    return (
        tnp.moveaxis(out, list(range(nd - 1, nd - 1 + extra)), list(range(axis, axis + extra)))
        if extra
        else out
    )


def apply_over_axes(func, a, axes):
    a = _arr(a)
    for ax in [axes] if isinstance(axes, (int, np.integer)) else axes:
        res = func(a, ax)
        if tnp.ndim(res) == tnp.ndim(a) - 1:
            res = tnp.expand_dims(res, ax)
        a = res
    return a


class vectorize:
    """numpy.vectorize through vmap: pyfunc written for scalars (or for the core shapes of a
    `signature` such as '(n),(n)->()') maps over the leading broadcast axes."""

    def __init__(self, pyfunc, otypes=None, doc=None, excluded=None, cache=False, signature=None):
        self.pyfunc, self.excluded, self.signature = pyfunc, set(excluded or ()), signature
        functools.update_wrapper(self, pyfunc)

    def _core_ranks(self, n):
        if self.signature is None:
            return [0] * n
        ins = self.signature.split("->")[0]
        groups = [g.strip("() ") for g in ins.split("),")]
        return [0 if not g else len([d for d in g.split(",") if d.strip()]) for g in groups]

    def __call__(self, *args, **kwargs):
        idx = [i for i in range(len(args)) if i not in self.excluded]
        arrays = [_arr(args[i]) for i in idx]
        ranks = self._core_ranks(len(arrays))
        loops = [tnp.shape(a)[: tnp.ndim(a) - r] for a, r in zip(arrays, ranks)]
        batch = tnp.broadcast_shapes(*loops) if loops else ()
        arrays = [tnp.broadcast_to(a, batch + tnp.shape(a)[tnp.ndim(a) - r :]) for a, r in zip(arrays, ranks)]

        def call(*xs):
            full = list(args)
            for i, x in zip(idx, xs):
                full[i] = x
            return self.pyfunc(*full, **kwargs)

        f = call
        for _ in batch:
            f = _vmap()(f)
        return f(*arrays)


def fromfunction(function, shape, *, dtype=None, **kwargs):
    grids = indices(shape, dtype=dtype or tnp.float32)
    return function(*[grids[k] for k in range(len(tuple(shape)))], **kwargs)


def copy(a, order=None):
    a = tnp._operand(a) if isinstance(a, (Tracer, tnp.Array)) else tnp.asarray(a)
    return a + tnp.zeros((), tnp._aval(a).dtype) if isinstance(a, Tracer) else tnp.asarray(np.array(a))


def concat(arrays, /, *, axis: int | None = 0):
    return tnp.concatenate(arrays, axis=axis)


def matrix_transpose(x, /):
    return tnp.linalg.matrix_transpose(x)


def matvec(x1, x2, /):
    return tnp.matmul(x1, x2[..., None])[..., 0]


def vecmat(x1, x2, /):
    return tnp.matmul(x1[..., None, :], x2)[..., 0, :]


def vecdot(x1, x2, /, *, axis: int = -1):
    return tnp.linalg.vecdot(x1, x2, axis=axis)


def kron(a, b):
    a, b = tnp._promote(a, b)
    nd = builtins.max(tnp.ndim(a), tnp.ndim(b))
    a = tnp.reshape(a, (1,) * (nd - tnp.ndim(a)) + tnp.shape(a))
    b = tnp.reshape(b, (1,) * (nd - tnp.ndim(b)) + tnp.shape(b))
    sa, sb = tnp.shape(a), tnp.shape(b)
    ea = tnp.reshape(a, tuple(x for s in sa for x in (s, 1)))
    eb = tnp.reshape(b, tuple(x for s in sb for x in (1, s)))
    return tnp.reshape(ea * eb, tuple(x * y for x, y in zip(sa, sb)))


def cross(a, b, axisa: int = -1, axisb: int = -1, axisc: int = -1, axis=None):
    """The cross product of 3-vectors (or 2-vectors: the z component) along the given axes."""
    a, b = tnp._promote(a, b)
    if axis is not None:
        axisa = axisb = axisc = axis
    a, b = tnp.moveaxis(a, axisa, -1), tnp.moveaxis(b, axisb, -1)
    na, nb = tnp.shape(a)[-1], tnp.shape(b)[-1]
    if na not in (2, 3) or nb not in (2, 3):
        raise ShapeError(with_user_line(f"cross: vectors must have 2 or 3 components, got {na} and {nb}"))
    a0, a1 = a[..., 0], a[..., 1]
    b0, b1 = b[..., 0], b[..., 1]
    a2 = a[..., 2] if na == 3 else None
    b2 = b[..., 2] if nb == 3 else None
    if a2 is None and b2 is None:
        return a0 * b1 - a1 * b0
    zero = tnp.zeros_like(a0 * b0)
    a2 = zero if a2 is None else a2
    b2 = zero if b2 is None else b2
    c = tnp.stack([a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0], axis=-1)
    return tnp.moveaxis(c, -1, axisc)


def einsum_path(subscripts, *operands, optimize="greedy"):
    """numpy's contraction path for these operand shapes (tilefuse contracts left to right)."""
    dummies = [np.empty(tnp.shape(o), np.float32) for o in operands]
    return np.einsum_path(subscripts, *dummies, optimize=optimize)


def vander(x, N=None, increasing: bool = False):
    x = _arr(x)
    if tnp.ndim(x) != 1:
        raise ShapeError(with_user_line("vander: x must be 1-d"))
    n = tnp.shape(x)[0] if N is None else int(N)
    powers = np.arange(n) if increasing else np.arange(n)[::-1]
    cols = [tnp.ones_like(x) if p == 0 else tnp.integer_pow(x, int(p)) for p in powers]
    return tnp.stack(cols, axis=1) if cols else tnp.zeros((tnp.shape(x)[0], 0), tnp._aval(x).dtype)


# ---- polynomials (coefficients highest power first, as numpy's poly1d functions) ----------------


def polyval(p, x, *, unroll: int = 16):
    p, x = tnp._promote(p, x)
    out = tnp.zeros_like(x)
    for k in range(tnp.shape(p)[0]):  # Horner
        out = out * x + p[k]
    return out


def _poly_pad(a, n):
    return (
        tnp.concatenate([tnp.zeros((n - tnp.shape(a)[0],), tnp._aval(a).dtype), a])
        if n > tnp.shape(a)[0]
        else a
    )


def polyadd(a1, a2):
    a1, a2 = tnp._promote(tnp.atleast_1d(a1), tnp.atleast_1d(a2))
    n = builtins.max(tnp.shape(a1)[0], tnp.shape(a2)[0])
    return _poly_pad(a1, n) + _poly_pad(a2, n)


def polysub(a1, a2):
    a1, a2 = tnp._promote(tnp.atleast_1d(a1), tnp.atleast_1d(a2))
    n = builtins.max(tnp.shape(a1)[0], tnp.shape(a2)[0])
    return _poly_pad(a1, n) - _poly_pad(a2, n)


def polymul(a1, a2, *, trim_leading_zeros: bool = False):
    a1, a2 = tnp._promote(tnp.atleast_1d(a1), tnp.atleast_1d(a2))
    return tnp.convolve(a1, a2)


def polyder(p, m: int = 1):
    (p,) = tnp._promote(tnp.atleast_1d(p))
    for _ in range(int(m)):
        n = tnp.shape(p)[0] - 1
        if n <= 0:
            return tnp.zeros((0,), tnp._aval(p).dtype) if n < 0 else tnp.zeros((1,), tnp._aval(p).dtype)[:0]
        p = p[:n] * np.arange(n, 0, -1).astype(np.dtype(tnp._aval(p).dtype))
    return p


def polyint(p, m: int = 1, k=None):
    (p,) = tnp._promote(tnp.atleast_1d(p), to_float=True)
    ks = [0.0] * int(m) if k is None else list(np.atleast_1d(k))
    if len(ks) == 1 and m > 1:
        ks = ks * int(m)
    for i in range(int(m)):
        n = tnp.shape(p)[0]
        p = tnp.concatenate(
            [
                p / np.arange(n, 0, -1).astype(np.dtype(tnp._aval(p).dtype)),
                tnp.full((1,), ks[i], tnp._aval(p).dtype),
            ]
        )
    return p


def polyfit(x, y, deg: int, rcond=None, full: bool = False, w=None, cov: bool = False):
    """Least-squares polynomial coefficients (highest power first), through lstsq."""
    x, y = tnp._promote(x, y, to_float=True)
    a = vander(x, int(deg) + 1)
    if w is not None:
        w = tnp._operand(w)
        a = a * w[:, None]
        y = y * (w if tnp.ndim(y) == 1 else w[:, None])
    scale = tnp.sqrt(tnp.sum(a * a, axis=0))
    coef, resid, rank, s = tnp.linalg.lstsq(a / scale, y, rcond)
    coef = (coef.T / scale).T
    if full:
        return coef, resid, rank, s, rcond
    if cov:
        raise TilefuseError(with_user_line("polyfit: cov=True is not supported"))
    return coef


def polydiv(u, v, *, trim_leading_zeros: bool = False):
    """(quotient, remainder) of polynomial division (v's leading coefficient must be non-zero);
    the remainder keeps u's length, leading zeros included (JAX's static shape; numpy trims)."""
    u, v = tnp._promote(tnp.atleast_1d(u), tnp.atleast_1d(v), to_float=True)
    m, n = tnp.shape(u)[0] - 1, tnp.shape(v)[0] - 1
    scale = 1.0 / v[0]
    q = tnp.zeros((builtins.max(m - n + 1, 1),), tnp._aval(u).dtype)
    r = u
    for k in range(0, m - n + 1):
        d = scale * r[k]
        q = q.at[k].set(d)
        r = r.at[k : k + n + 1].add(-d * v)
    if trim_leading_zeros:
        lead = _static(r, "polydiv(trim_leading_zeros=True)")
        nz = np.flatnonzero(lead)
        r = r[int(nz[0]) if nz.size else len(lead) - 1 :]
    return q, r


def poly(seq_of_zeros):
    """Coefficients of the monic polynomial with these (real) roots; of a square matrix's
    characteristic polynomial from its eigenvalues when it is symmetric."""
    (z,) = tnp._promote(seq_of_zeros, to_float=True)
    if tnp.ndim(z) == 2:
        z = tnp.linalg.eigvalsh(z)
    z = tnp.ravel(z)
    a = tnp.ones((1,), tnp._aval(z).dtype)
    for k in range(tnp.shape(z)[0]):
        a = tnp.convolve(a, tnp.stack([tnp.ones((), tnp._aval(z).dtype), -z[k]]))
    return a


# ---- windows -----------------------------------------------------------------------------------


def _window(M, f):
    M = int(M)
    if M < 1:
        return tnp.zeros((0,), tnp.float32)
    if M == 1:
        return tnp.ones((1,), tnp.float32)
    n = tnp.arange(M, dtype=tnp.float32)
    return f(n, M)


def bartlett(M):
    return _window(M, lambda n, M: 1 - tnp.abs(2 * n / (M - 1) - 1))


def blackman(M):
    return _window(
        M,
        lambda n, M: (
            0.42 - 0.5 * tnp.cos(2 * math.pi * n / (M - 1)) + 0.08 * tnp.cos(4 * math.pi * n / (M - 1))
        ),
    )


def hamming(M):
    return _window(M, lambda n, M: 0.54 - 0.46 * tnp.cos(2 * math.pi * n / (M - 1)))


def hanning(M):
    return _window(M, lambda n, M: 0.5 - 0.5 * tnp.cos(2 * math.pi * n / (M - 1)))


def kaiser(M, beta):
    def f(n, M):
        alpha = (M - 1) / 2.0
        r = (n - alpha) / alpha
        return tnp.i0(beta * tnp.sqrt(tnp.maximum(1 - r * r, 0.0))) / tnp.i0(
            tnp.asarray(float(beta), tnp.float32)
        )

    return _window(M, f)


# ---- comparisons, printing, files and buffers (host helpers) ----------------------------------------


def array_equiv(a1, a2) -> bool:
    a1, a2 = _static(a1, "array_equiv"), _static(a2, "array_equiv")
    return builtins.bool(np.array_equiv(a1, a2))


def array_repr(arr, max_line_width=None, precision=None, suppress_small=None):
    return np.array_repr(np.asarray(_static(arr, "array_repr")), max_line_width, precision, suppress_small)


def array_str(a, max_line_width=None, precision=None, suppress_small=None):
    return np.array_str(np.asarray(_static(a, "array_str")), max_line_width, precision, suppress_small)


get_printoptions, set_printoptions, printoptions, iterable = (
    np.get_printoptions,
    np.set_printoptions,
    np.printoptions,
    np.iterable,
)


def frombuffer(buffer, dtype=float, count: int = -1, offset: int = 0):
    return tnp.asarray(np.frombuffer(buffer, dtype=tnp._dt.canonicalize(dtype), count=count, offset=offset))


def fromfile(*args, **kwargs):
    raise TilefuseError(with_user_line("fromfile: read the file with numpy (np.fromfile) and pass the array"))


def fromiter(iterable, dtype, count: int = -1, *, like=None):
    return tnp.asarray(np.fromiter(iterable, tnp._dt.canonicalize(dtype), count))


def fromstring(string, dtype=float, count: int = -1, *, sep: str):
    return tnp.asarray(np.fromstring(string, tnp._dt.canonicalize(dtype), count, sep=sep))


def load(file, *args, **kwargs):
    """numpy.load without pickles (allow_pickle is forced off: no code from disk)."""
    kwargs["allow_pickle"] = False
    out = np.load(file, *args, **kwargs)
    return tnp.asarray(out) if isinstance(out, np.ndarray) else out


def save(file, arr, allow_pickle: bool = False):
    np.save(file, np.asarray(_static(arr, "save")), allow_pickle=False)


def savez(file, *args, **kwds):
    np.savez(
        file,
        *[np.asarray(_static(a, "savez")) for a in args],
        **{k: np.asarray(_static(v, "savez")) for k, v in kwds.items()},
    )


def from_dlpack(x, /, *, device=None, copy=None):
    return tnp.asarray(np.from_dlpack(x))


_KINDS = {
    "bool": lambda d: d == np.bool_,
    "signed integer": lambda d: d.kind == "i",
    "unsigned integer": lambda d: d.kind == "u",
    "integral": lambda d: d.kind in "iu",
    "real floating": lambda d: _dt.is_float(d),
    "complex floating": lambda d: d.kind == "c",
    "numeric": lambda d: d.kind in "iuc" or _dt.is_float(d),
}


def isdtype(dtype, kind) -> bool:
    """numpy 2's isdtype: a dtype against a kind name, a dtype, or a tuple of them."""
    d = np.dtype(dtype)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for k in kinds:
        if isinstance(k, str):
            if k not in _KINDS:
                raise TilefuseError(with_user_line(f"isdtype: unknown kind {k!r}"))
            if _KINDS[k](d):
                return True
        elif np.dtype(k) == d:
            return True
    return False


# ---- more creation and bit packing -----------------------------------------------------------------


def logspace(start, stop, num: int = 50, endpoint: bool = True, base=10.0, dtype=None, axis: int = 0):
    y = tnp.linspace(start, stop, num, endpoint=endpoint, dtype=tnp.float32 if dtype is None else None)
    out = tnp.power(tnp.asarray(base, tnp._aval(y).dtype), y)
    return tnp.astype(out, dtype) if dtype is not None else out


def geomspace(start, stop, num: int = 50, endpoint: bool = True, dtype=None, axis: int = 0):
    """Numbers spaced evenly on a log scale from start to stop (the endpoints exact; negative
    ranges by symmetry, as numpy)."""
    if start == 0 or stop == 0:
        raise ValueError("geomspace: start and stop must be non-zero")
    sign = -1.0 if (start < 0 and stop < 0) else 1.0
    if start * stop < 0:
        raise ValueError("geomspace: start and stop must have the same sign (no complex results)")
    lo, hi = math.log10(abs(start)), math.log10(abs(stop))
    out = sign * logspace(lo, hi, num, endpoint=endpoint)
    n = int(num)
    if n:
        idx = tnp.arange(n)
        out = tnp.where(idx == 0, float(start), out)
        if endpoint and n > 1:
            out = tnp.where(idx == n - 1, float(stop), out)
    return tnp.astype(out, dtype) if dtype is not None else out


def packbits(a, axis=None, bitorder: str = "big"):
    """Booleans (non-zero values) packed 8 to a uint8 along axis (flattened for None), the last
    byte padded with zero bits."""
    a = _arr(a)
    if axis is None:
        a, axis = tnp.ravel(a), 0
    axis = tnp._norm_axis(axis, tnp.ndim(a))
    bits = tnp.astype(a != 0, tnp.int32)
    n = tnp.shape(bits)[axis]
    pad = (-n) % 8
    if pad:
        cfg = [(0, 0)] * tnp.ndim(bits)
        cfg[axis] = (0, pad)
        bits = tnp.pad(bits, cfg)
    bits = tnp.moveaxis(bits, axis, -1)
    bits = tnp.reshape(bits, tnp.shape(bits)[:-1] + (-1, 8))
    weights = np.array(
        [128, 64, 32, 16, 8, 4, 2, 1] if bitorder == "big" else [1, 2, 4, 8, 16, 32, 64, 128], np.int32
    )
    packed = tnp.sum(bits * weights, axis=-1)
    return tnp.astype(tnp.moveaxis(packed, -1, axis), tnp.uint8)


def unpackbits(a, axis=None, count=None, bitorder: str = "big"):
    a = _arr(a)
    if np.dtype(tnp._aval(a).dtype) != np.uint8:
        raise TilefuseError(with_user_line(f"unpackbits: needs a uint8 array, got {tnp._aval(a).dtype}"))
    if axis is None:
        a, axis = tnp.ravel(a), 0
    axis = tnp._norm_axis(axis, tnp.ndim(a))
    shifts = np.array([7, 6, 5, 4, 3, 2, 1, 0] if bitorder == "big" else list(range(8)), np.int32)
    x = tnp.astype(tnp.moveaxis(a, axis, -1), tnp.int32)
    bits = tnp.bitwise_and(tnp.right_shift(x[..., None], shifts), 1)
    bits = tnp.reshape(bits, tnp.shape(x)[:-1] + (-1,))
    if count is not None:
        bits = bits[..., : int(count)] if count >= 0 else bits[..., : tnp.shape(bits)[-1] + int(count)]
    return tnp.astype(tnp.moveaxis(bits, -1, axis), tnp.uint8)
