"""Sorting, searching, sets, counting and order statistics.

argsort is a primitive (stable, numpy's NaN-last order; numpy's sort on the host as the vendor
kernel on every device); sort gathers through it, so it differentiates like an indexing. The
rest composes: searchsorted compares every value with every sorted entry (one fused reduction),
unique and the set operations sort and mark the first of each run. Functions whose result size
depends on the values (unique, nonzero-like selections, bincount without a length) need concrete
values, or a static `size` (with `fill_value`) under jit, as in JAX."""

from __future__ import annotations

import builtins
from typing import NamedTuple

import numpy as np

import tilefuse.numpy as tnp
from tilefuse.ir import dtypes as _dt
from tilefuse.ir import primitives as P
from tilefuse.ir.errors import ConcretizationError, DTypeError, ShapeError, TilefuseError, with_user_line
from tilefuse.tracer.core import Tracer, bind1, concrete_or_none

__all__ = [
    "sort",
    "argsort",
    "lexsort",
    "partition",
    "argpartition",
    "searchsorted",
    "digitize",
    "unique",
    "unique_all",
    "unique_counts",
    "unique_inverse",
    "unique_values",
    "intersect1d",
    "union1d",
    "setdiff1d",
    "setxor1d",
    "isin",
    "bincount",
    "histogram",
    "histogram_bin_edges",
    "histogram2d",
    "histogramdd",
    "median",
    "quantile",
    "percentile",
    "nanmedian",
    "nanquantile",
    "nanpercentile",
    "sort_complex",
]


def _axis_last(x, axis):
    """x with `axis` moved last (flattened for None), and the axis it had."""
    x = tnp._operand(x)
    if axis is None:
        return tnp.ravel(x), None
    axis = tnp._norm_axis(axis, tnp.ndim(x))
    return tnp.moveaxis(x, axis, -1), axis


def argsort(
    a, axis: int | None = -1, kind=None, order=None, *, stable: bool = True, descending: bool = False
):
    """Indices that sort a along axis (int32); stable, NaN last (first when descending)."""
    if order is not None:
        raise TilefuseError(with_user_line("argsort: order= (structured arrays) is not supported"))
    a = tnp._operand(a)
    if axis is None:
        a, axis = tnp.ravel(a), 0
    if tnp.ndim(a) == 0:
        return tnp.zeros((), tnp.int32)
    axis = tnp._norm_axis(axis, tnp.ndim(a))
    return bind1(P.argsort, a, axis=axis, descending=builtins.bool(descending))


def sort(a, axis: int | None = -1, kind=None, order=None, *, stable: bool = True, descending: bool = False):
    a = tnp._operand(a)
    if axis is None:
        a, axis = tnp.ravel(a), 0
    if tnp.ndim(a) == 0:
        return a
    idx = argsort(a, axis, stable=stable, descending=descending)
    return tnp.take_along_axis(a, idx, axis)


def lexsort(keys, axis: int = -1):
    """Indices sorting by the last key first, then the one before it, ... (numpy's order)."""
    keys = [tnp._operand(k) for k in keys]
    if not keys:
        raise TilefuseError(with_user_line("lexsort needs at least one key"))
    keys = tnp._broadcast_all(*keys, op="lexsort")
    if tnp.ndim(keys[0]) == 0:
        return tnp.zeros((), tnp.int32)
    axis = tnp._norm_axis(axis, tnp.ndim(keys[0]))
    keys = [tnp.astype(k, tnp.int32) if _dt.is_bool(tnp._aval(k).dtype) else k for k in keys]
    return bind1(P.argsort, *keys[::-1], axis=axis, descending=False)


def partition(a, kth: int, axis: int = -1):
    """An arrangement with the kth smallest value at kth, no larger values before it and no
    smaller ones after (here: the sorted order, which is one such arrangement)."""
    return sort(a, axis)


def argpartition(a, kth: int, axis: int = -1):
    return argsort(a, axis)


def sort_complex(a):
    raise DTypeError(
        with_user_line(
            "sort_complex returns complex numbers: tilefuse has no complex dtype "
            "(use tnp.sort for real arrays)"
        )
    )


def _nan_last_less(a, v, strict: bool):
    """a < v (strict) or a <= v in numpy's sort order, where NaN is larger than every number."""
    if not _dt.is_float(tnp._aval(a).dtype):
        return tnp.less(a, v) if strict else tnp.less_equal(a, v)
    an, vn = tnp.isnan(a), tnp.isnan(v)
    if strict:
        return tnp.where(an, tnp.zeros_like(an), tnp.less(a, v) | vn)
    return tnp.where(vn, tnp.ones_like(an), ~an & tnp.less_equal(a, v))


def searchsorted(a, v, side: str = "left", sorter=None, *, method=None):
    """Insertion points of v into the sorted 1-d a (int32): how many entries sort before each v
    ('left') or not after it ('right'); numpy's order, NaN last."""
    if side not in ("left", "right"):
        raise TilefuseError(with_user_line(f"searchsorted: side must be 'left' or 'right', got {side!r}"))
    a = tnp._operand(a)
    if tnp.ndim(a) != 1:
        raise ShapeError(with_user_line(f"searchsorted: a must be 1-d, got shape {tnp.shape(a)}"))
    if sorter is not None:
        a = tnp.take(a, sorter)
    a, v = tnp._promote(a, v)
    vshape = tnp.shape(v)
    flat = tnp.ravel(v)
    before = _nan_last_less(a[None, :], flat[:, None], strict=side == "left")
    return tnp.reshape(tnp.sum(before, axis=1, dtype=tnp.int32), vshape)


def digitize(x, bins, right: bool = False):
    """The bin of each x: numpy.digitize for monotonically increasing or decreasing bins."""
    bins = tnp._operand(bins)
    if tnp.ndim(bins) != 1:
        raise ShapeError(with_user_line(f"digitize: bins must be 1-d, got shape {tnp.shape(bins)}"))
    vals = concrete_or_none(bins)
    side = "left" if right else "right"
    if (
        vals is not None
        and not isinstance(vals, Tracer)
        and np.asarray(vals).size > 1
        and np.asarray(vals)[0] > np.asarray(vals)[-1]
    ):
        n = tnp.shape(bins)[0]
        return n - searchsorted(tnp.flip(bins), x, side="right" if right else "left")
    return searchsorted(bins, x, side=side)


def isin(element, test_elements, assume_unique: bool = False, invert: bool = False):
    """Whether each element occurs in test_elements (every pair compared: one fused reduction)."""
    element, test = tnp._promote(element, test_elements)
    shape = tnp.shape(element)
    hit = tnp.any(tnp.ravel(element)[:, None] == tnp.ravel(test)[None, :], axis=1)
    hit = tnp.reshape(hit, shape)
    return ~hit if invert else hit


# ---- unique and the set operations --------------------------------------------------------------


def _static_size(name, x, count, size):
    """The number of results: size when given, else the concrete count (outside jit)."""
    if size is not None:
        return int(size)
    c = concrete_or_none(count)
    if c is None or isinstance(c, Tracer):
        raise ConcretizationError(
            with_user_line(
                f"{name}: the number of results depends on the values, which jit cannot know; pass a static "
                f"size= (and fill_value=) as in JAX, or call it outside jit"
            )
        )
    return int(np.asarray(c))


class _Runs(NamedTuple):
    values: object  # sorted values
    order: object  # the sorting permutation
    first: object  # bool: the first of a run of equal values
    n: int


def _runs(x, equal_nan: bool = True):
    x = tnp.ravel(tnp._operand(x))
    n = tnp.shape(x)[0]
    order = argsort(x)
    s = tnp.take(x, order)
    if n == 0:
        return _Runs(s, order, tnp.zeros((0,), tnp.bool_), 0)
    differs = s[1:] != s[:-1]
    if equal_nan and _dt.is_float(tnp._aval(s).dtype):
        differs = differs & ~(tnp.isnan(s[1:]) & tnp.isnan(s[:-1]))
    first = tnp.concatenate([tnp.ones((1,), tnp.bool_), differs])
    return _Runs(s, order, first, n)


def _scatter_first(runs: _Runs, values, size: int, fill):
    """values at each run's first position, packed to the front of an array of `size`."""
    slot = tnp.cumsum(tnp.astype(runs.first, tnp.int32)) - 1
    keep = runs.first & (slot < size)
    target = tnp.where(keep, slot, size)  # one spill slot past the end, dropped
    out = tnp.full((size + 1,), fill, dtype=tnp._aval(values).dtype)
    return out.at[target].set(values)[:size]


class UniqueAllResult(NamedTuple):
    values: object
    indices: object
    inverse_indices: object
    counts: object


class UniqueCountsResult(NamedTuple):
    values: object
    counts: object


class UniqueInverseResult(NamedTuple):
    values: object
    inverse_indices: object


def unique(
    ar,
    return_index: bool = False,
    return_inverse: bool = False,
    return_counts: bool = False,
    axis=None,
    *,
    equal_nan: bool = True,
    size=None,
    fill_value=None,
    sorted: bool = True,
):  # noqa: A002
    """The sorted distinct values (numpy.unique), with the first indices, the inverse and the
    counts on request. Under jit pass size= (results padded with fill_value, default the
    smallest value; counts padded with 0)."""
    if axis is not None:
        return _unique_axis(ar, axis, return_index, return_inverse, return_counts, size)
    ar = tnp._operand(ar)
    shape = tnp.shape(ar)
    runs = _runs(ar, equal_nan)
    count = tnp.sum(tnp.astype(runs.first, tnp.int32)) if runs.n else 0
    k = _static_size("unique", ar, count, size)
    if fill_value is None:
        fill_value = tnp.min(runs.values) if runs.n else 0
    values = (
        _scatter_first(runs, runs.values, k, fill_value) if runs.n else tnp.zeros((k,), tnp._aval(ar).dtype)
    )
    out = [values]
    if return_index:
        out.append(_scatter_first(runs, runs.order, k, 0) if runs.n else tnp.zeros((k,), tnp.int32))
    if return_inverse:
        slot = tnp.cumsum(tnp.astype(runs.first, tnp.int32)) - 1
        inv = tnp.zeros((runs.n,), tnp.int32).at[runs.order].set(slot)
        out.append(tnp.reshape(inv, shape) if len(shape) != 1 else inv)
    if return_counts:
        if runs.n:
            slot = tnp.cumsum(tnp.astype(runs.first, tnp.int32)) - 1
            counts = tnp.zeros((k + 1,), tnp.int32).at[tnp.where(slot < k, slot, k)].add(1)[:k]
        else:
            counts = tnp.zeros((k,), tnp.int32)
        out.append(counts)
    return out[0] if len(out) == 1 else tuple(out)


def _unique_axis(ar, axis, return_index, return_inverse, return_counts, size):
    """unique slices along axis: sort the slices lexicographically, keep the first of each run."""
    ar = tnp._operand(ar)
    axis = tnp._norm_axis(axis, tnp.ndim(ar))
    moved = tnp.moveaxis(ar, axis, 0)
    n = tnp.shape(moved)[0]
    rows = tnp.reshape(moved, (n, -1))
    m = tnp.shape(rows)[1]
    order = (
        bind1(P.argsort, *[rows[:, j] for j in range(m)], axis=0, descending=False)
        if m
        else tnp.arange(n, dtype=tnp.int32)
    )
    s = tnp.take(rows, order, axis=0)
    first = (
        tnp.concatenate([tnp.ones((builtins.min(n, 1),), tnp.bool_), tnp.any(s[1:] != s[:-1], axis=1)])
        if n
        else tnp.zeros((0,), tnp.bool_)
    )
    k = _static_size("unique", ar, tnp.sum(tnp.astype(first, tnp.int32)), size)
    slot = tnp.cumsum(tnp.astype(first, tnp.int32)) - 1
    target = tnp.where(first & (slot < k), slot, k)
    picked = tnp.zeros((k + 1,), tnp.int32).at[target].set(tnp.arange(n, dtype=tnp.int32))[:k]
    values = tnp.moveaxis(tnp.reshape(tnp.take(s, picked, axis=0), (k,) + tnp.shape(moved)[1:]), 0, axis)
    out = [values]
    if return_index:
        out.append(tnp.take(order, picked))
    if return_inverse:
        out.append(tnp.zeros((n,), tnp.int32).at[order].set(slot))
    if return_counts:
        out.append(tnp.zeros((k + 1,), tnp.int32).at[tnp.where(slot < k, slot, k)].add(1)[:k])
    return out[0] if len(out) == 1 else tuple(out)


def unique_values(x, *, size=None, fill_value=None):
    return unique(x, size=size, fill_value=fill_value)


def unique_counts(x, *, size=None, fill_value=None):
    return UniqueCountsResult(*unique(x, return_counts=True, size=size, fill_value=fill_value))


def unique_inverse(x, *, size=None, fill_value=None):
    values, inv = unique(x, return_inverse=True, size=size, fill_value=fill_value)
    return UniqueInverseResult(values, tnp.reshape(inv, tnp.shape(x)))


def unique_all(x, *, size=None, fill_value=None):
    values, idx, inv, counts = unique(
        x, return_index=True, return_inverse=True, return_counts=True, size=size, fill_value=fill_value
    )
    return UniqueAllResult(values, idx, tnp.reshape(inv, tnp.shape(x)), counts)


def _keep_sorted(name, x, mask, size, fill_value):
    """The entries of sorted 1-d x where mask holds, to the front (padded to size)."""
    count = tnp.sum(tnp.astype(mask, tnp.int32))
    k = _static_size(name, x, count, size)
    slot = tnp.cumsum(tnp.astype(mask, tnp.int32)) - 1
    target = tnp.where(mask & (slot < k), slot, k)
    fill = fill_value if fill_value is not None else (tnp.min(x) if tnp.shape(x)[0] else 0)
    return tnp.full((k + 1,), fill, dtype=tnp._aval(x).dtype).at[target].set(x)[:k]


def union1d(ar1, ar2, *, size=None, fill_value=None):
    ar1, ar2 = tnp._promote(ar1, ar2)
    return unique(tnp.concatenate([tnp.ravel(ar1), tnp.ravel(ar2)]), size=size, fill_value=fill_value)


def intersect1d(
    ar1, ar2, assume_unique: bool = False, return_indices: bool = False, *, size=None, fill_value=None
):
    if return_indices:
        raise TilefuseError(with_user_line("intersect1d: return_indices is not supported"))
    ar1, ar2 = tnp._promote(ar1, ar2)
    u1 = unique(ar1, size=tnp.size(ar1), fill_value=None) if tnp.size(ar1) else tnp.ravel(ar1)
    runs = _runs(ar1)
    valid = _valid_unique_mask(runs)
    mask = valid & isin(u1, ar2)
    return _keep_sorted("intersect1d", u1, mask, size, fill_value)


def _valid_unique_mask(runs: _Runs):
    """For unique(x, size=len(x)): which slots hold a value (the rest are padding)."""
    count = tnp.sum(tnp.astype(runs.first, tnp.int32)) if runs.n else 0
    return tnp.arange(runs.n, dtype=tnp.int32) < count


def setdiff1d(ar1, ar2, assume_unique: bool = False, *, size=None, fill_value=None):
    ar1, ar2 = tnp._promote(ar1, ar2)
    if not tnp.size(ar1):
        return tnp.ravel(ar1)
    u1 = unique(ar1, size=tnp.size(ar1))
    mask = _valid_unique_mask(_runs(ar1)) & ~isin(u1, ar2)
    return _keep_sorted("setdiff1d", u1, mask, size, fill_value)


def setxor1d(ar1, ar2, assume_unique: bool = False, *, size=None, fill_value=None):
    ar1, ar2 = tnp._promote(ar1, ar2)
    both = tnp.concatenate([tnp.ravel(ar1), tnp.ravel(ar2)])
    if not tnp.size(both):
        return both
    u = unique(both, size=tnp.size(both))
    valid = _valid_unique_mask(_runs(both))
    mask = valid & (isin(u, ar1) != isin(u, ar2))
    return _keep_sorted("setxor1d", u, mask, size, fill_value)


# ---- counting --------------------------------------------------------------------------------


def bincount(x, weights=None, minlength: int = 0, *, length=None):
    """Occurrences of each non-negative integer (or the sum of their weights): int32 counts,
    of static `length` under jit (max(x) + 1 on concrete values); out-of-range values dropped."""
    x = tnp._operand(x)
    if not _dt.is_int(tnp._aval(x).dtype):
        raise DTypeError(with_user_line(f"bincount: needs integers, got {tnp._aval(x).dtype}"))
    if tnp.ndim(x) != 1:
        raise ShapeError(with_user_line(f"bincount: needs a 1-d array, got shape {tnp.shape(x)}"))
    if length is None:
        top = tnp.max(x) + 1 if tnp.shape(x)[0] else 0
        length = builtins.max(_static_size("bincount", x, top, None), int(minlength))
    length = int(length)
    ok = (x >= 0) & (x < length)
    idx = tnp.where(ok, x, length)
    if weights is None:
        vals = tnp.astype(ok, tnp.int32)
    else:
        (w,) = tnp._promote(weights)
        vals = tnp.where(ok, w, tnp.zeros_like(w))
    out = tnp.zeros((length + 1,), tnp._aval(vals).dtype)
    return out.at[idx].add(vals)[:length]


def _edges(a, bins, range_):
    if isinstance(bins, (int, np.integer)):
        if range_ is None:
            lo, hi = tnp.min(a), tnp.max(a)
        else:
            lo, hi = (tnp.asarray(float(v), tnp._aval(a).dtype) for v in range_)
        same = lo == hi
        lo, hi = tnp.where(same, lo - 0.5, lo), tnp.where(same, hi + 0.5, hi)
        steps = tnp.arange(int(bins) + 1, dtype=tnp._aval(a).dtype) / float(bins)
        edges = lo + (hi - lo) * steps
        return tnp.where(steps == 1, hi, edges)  # lo + (hi - lo) can round away from hi
    (edges,) = tnp._promote(bins, to_float=True)
    return edges


def histogram_bin_edges(a, bins=10, range=None, weights=None):  # noqa: A002
    (a,) = tnp._promote(tnp.ravel(tnp._operand(a)), to_float=True)
    return _edges(a, bins, range)


def _bin_index(x, edges):
    """The bin of each x (the last edge closes the last bin), -1 outside."""
    nb = tnp.shape(edges)[0] - 1
    i = searchsorted(edges, x, side="right") - 1
    i = tnp.where(x == edges[-1], nb - 1, i)
    return tnp.where((i >= 0) & (i < nb), i, -1)


def histogram(a, bins=10, range=None, weights=None, density=None):  # noqa: A002
    """(counts, edges): counts int32 (float with weights or density), static int bins or edges."""
    (a,) = tnp._promote(tnp.ravel(tnp._operand(a)), to_float=True)
    edges = _edges(a, bins, range)
    nb = tnp.shape(edges)[0] - 1
    idx = _bin_index(a, edges)
    w = None if weights is None else tnp.ravel(tnp._operand(weights))
    counts = bincount(tnp.where(idx < 0, nb, idx), w, length=nb)
    if density:
        counts = tnp.astype(counts, tnp._aval(a).dtype)
        counts = counts / tnp.sum(counts) / tnp.diff(edges)
    return counts, edges


def histogramdd(sample, bins=10, range=None, weights=None, density=None):  # noqa: A002
    (sample,) = tnp._promote(sample, to_float=True)
    if tnp.ndim(sample) != 2:
        raise ShapeError(with_user_line(f"histogramdd: sample must be (N, D), got shape {tnp.shape(sample)}"))
    d = tnp.shape(sample)[1]
    bins = [bins] * d if isinstance(bins, (int, np.integer)) else list(bins)
    ranges = [None] * d if range is None else list(range)
    edges = [_edges(sample[:, k], b, r) for k, (b, r) in enumerate(zip(bins, ranges))]
    sizes = [tnp.shape(e)[0] - 1 for e in edges]
    flat, ok = tnp.zeros((tnp.shape(sample)[0],), tnp.int32), tnp.ones((tnp.shape(sample)[0],), tnp.bool_)
    for k, e in enumerate(edges):
        i = _bin_index(sample[:, k], e)
        ok = ok & (i >= 0)
        flat = flat * sizes[k] + tnp.where(i >= 0, i, 0)
    total = int(np.prod(sizes, dtype=np.int64))
    w = None if weights is None else tnp.ravel(tnp._operand(weights))
    counts = tnp.reshape(bincount(tnp.where(ok, flat, total), w, length=total), sizes)
    if density:
        counts = tnp.astype(counts, tnp._aval(sample).dtype)
        counts = counts / tnp.sum(counts)
        for k, e in enumerate(edges):
            shape = [1] * d
            shape[k] = -1
            counts = counts / tnp.reshape(tnp.diff(e), shape)
    return counts, edges


def histogram2d(x, y, bins=10, range=None, weights=None, density=None):  # noqa: A002
    counts, edges = histogramdd(
        tnp.stack([tnp.ravel(x), tnp.ravel(y)], axis=1), bins, range, weights, density
    )
    return counts, edges[0], edges[1]


# ---- order statistics ------------------------------------------------------------------------


def _quantile(a, q, axis, method, keepdims, ignore_nan: bool, name: str):
    if method not in ("linear", "lower", "higher", "nearest", "midpoint"):
        raise TilefuseError(
            with_user_line(
                f"{name}: method {method!r} is not supported (linear, lower, higher, nearest, midpoint are)"
            )
        )
    (a,) = tnp._promote(a, to_float=True)
    nd = tnp.ndim(a)
    axes = tnp._norm_axes(axis, nd)
    # the reduced axes, merged last
    keep = [i for i in range(nd) if i not in axes]
    x = tnp.transpose(a, keep + list(axes))
    rest = tuple(tnp.shape(a)[i] for i in keep)
    x = tnp.reshape(x, rest + (-1,))
    n = tnp.shape(x)[-1]
    q = (
        tnp.asarray(q, tnp._aval(a).dtype)
        if not isinstance(q, (Tracer, tnp.Array))
        else tnp.astype(q, tnp._aval(a).dtype)
    )
    qshape = tnp.shape(q)
    s = sort(x, axis=-1)
    nan = tnp.isnan(s)
    if ignore_nan:
        count = tnp.sum(~nan, axis=-1, keepdims=True)  # NaNs sort last: the first `count` are numbers
    else:
        count = tnp.full(rest + (1,), n, tnp.int32)
    # positions, (rest..., |q|) against the sorted values
    qf = tnp.ravel(q)
    pos = qf[None, :] * tnp.astype(tnp.maximum(count - 1, 0), tnp._aval(a).dtype)
    pos = tnp.reshape(pos, rest + (tnp.shape(qf)[0],))
    lo = tnp.floor(pos)
    hi = tnp.ceil(pos)
    frac = pos - lo
    last = tnp.astype(tnp.maximum(count - 1, 0), tnp.int32)
    ilo = tnp.minimum(tnp.astype(lo, tnp.int32), last)
    ihi = tnp.minimum(tnp.astype(hi, tnp.int32), last)
    vlo = tnp.take_along_axis(s, ilo, axis=-1) if n else tnp.full(tnp.shape(ilo), np.nan, tnp._aval(a).dtype)
    vhi = tnp.take_along_axis(s, ihi, axis=-1) if n else vlo
    if method == "linear":
        out = vlo + (vhi - vlo) * frac
        out = tnp.where(vhi == vlo, vlo, out)  # equal neighbours (infinities too) stay exact
    elif method == "lower":
        out = vlo
    elif method == "higher":
        out = vhi
    elif method == "midpoint":
        out = (vlo + vhi) * 0.5
    else:  # nearest: numpy rounds the position half to even
        near = tnp.minimum(tnp.astype(tnp.round(pos), tnp.int32), last)
        out = tnp.take_along_axis(s, near, axis=-1) if n else vlo
    bad = (count == 0) if ignore_nan else tnp.any(nan, axis=-1, keepdims=True)
    out = tnp.where(bad, tnp.full_like(out, np.nan), out)
    out = tnp.moveaxis(out, -1, 0)  # q's axes lead, as numpy's
    out = tnp.reshape(out, qshape + rest)
    if keepdims:
        full = [1 if i in axes else tnp.shape(a)[i] for i in range(nd)]
        out = tnp.reshape(out, qshape + tuple(full))
    return out


def quantile(
    a,
    q,
    axis=None,
    out=None,
    overwrite_input: bool = False,
    method: str = "linear",
    keepdims: bool = False,
    *,
    interpolation=None,
):
    return _quantile(a, q, axis, interpolation or method, keepdims, False, "quantile")


def nanquantile(
    a,
    q,
    axis=None,
    out=None,
    overwrite_input: bool = False,
    method: str = "linear",
    keepdims: bool = False,
    *,
    interpolation=None,
):
    return _quantile(a, q, axis, interpolation or method, keepdims, True, "nanquantile")


def _pct(q):
    return (
        tnp._operand(q) / 100.0 if isinstance(q, (Tracer, tnp.Array)) else np.asarray(q, np.float64) / 100.0
    )


def percentile(
    a,
    q,
    axis=None,
    out=None,
    overwrite_input: bool = False,
    method: str = "linear",
    keepdims: bool = False,
    *,
    interpolation=None,
):
    return quantile(a, _pct(q), axis, method=method, keepdims=keepdims, interpolation=interpolation)


def nanpercentile(
    a,
    q,
    axis=None,
    out=None,
    overwrite_input: bool = False,
    method: str = "linear",
    keepdims: bool = False,
    *,
    interpolation=None,
):
    return nanquantile(a, _pct(q), axis, method=method, keepdims=keepdims, interpolation=interpolation)


def median(a, axis=None, out=None, overwrite_input: bool = False, keepdims: bool = False):
    return quantile(a, 0.5, axis, keepdims=keepdims)


def nanmedian(a, axis=None, out=None, overwrite_input: bool = False, keepdims: bool = False):
    return nanquantile(a, 0.5, axis, keepdims=keepdims)
