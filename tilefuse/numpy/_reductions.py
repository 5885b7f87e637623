"""Reductions that skip NaN, cumulative and difference operations, statistics (cov, corrcoef),
convolution and interpolation: compositions of tilefuse.numpy's core."""

from __future__ import annotations

import builtins

import numpy as np

import tilefuse.numpy as tnp
from tilefuse.ir import dtypes as _dt
from tilefuse.ir.errors import ShapeError, TilefuseError, with_user_line

__all__ = [
    "nansum",
    "nanprod",
    "nanmax",
    "nanmin",
    "nanmean",
    "nanvar",
    "nanstd",
    "nanargmax",
    "nanargmin",
    "nancumsum",
    "nancumprod",
    "cumulative_sum",
    "cumulative_prod",
    "diff",
    "ediff1d",
    "gradient",
    "trapezoid",
    "cov",
    "corrcoef",
    "convolve",
    "correlate",
    "interp",
]


def _is_float(x) -> bool:
    return _dt.is_float(tnp._aval(x).dtype)


def _zero_nan(x, fill=0):
    x = tnp._operand(x)
    return tnp.where(tnp.isnan(x), tnp.full_like(x, fill), x) if _is_float(x) else x


def nansum(a, axis=None, dtype=None, keepdims: bool = False):
    return tnp.sum(_zero_nan(a), axis, dtype=dtype, keepdims=keepdims)


def nanprod(a, axis=None, dtype=None, keepdims: bool = False):
    return tnp.prod(_zero_nan(a, 1), axis, dtype=dtype, keepdims=keepdims)


def _nan_extreme(reduce, fill, a, axis, keepdims):
    a = tnp._operand(a)
    if not _is_float(a):
        return reduce(a, axis, keepdims=keepdims)
    nan = tnp.isnan(a)
    out = reduce(tnp.where(nan, tnp.full_like(a, fill), a), axis, keepdims=keepdims)
    return tnp.where(tnp.all(nan, axis, keepdims=keepdims), tnp.full_like(out, np.nan), out)


def nanmax(a, axis=None, keepdims: bool = False):
    """max ignoring NaN; NaN where a slice is all NaN."""
    return _nan_extreme(tnp.max, -np.inf, a, axis, keepdims)


def nanmin(a, axis=None, keepdims: bool = False):
    return _nan_extreme(tnp.min, np.inf, a, axis, keepdims)


def _count(a, axis, keepdims):
    return tnp.sum(~tnp.isnan(a), axis, keepdims=keepdims)


def nanmean(a, axis=None, dtype=None, keepdims: bool = False):
    (a,) = tnp._promote(a, to_float=True)
    if dtype is not None:
        a = tnp.astype(a, dtype)
    n = tnp.astype(_count(a, axis, keepdims), tnp._aval(a).dtype)
    return nansum(a, axis, keepdims=keepdims) / n


def nanvar(a, axis=None, dtype=None, ddof: int = 0, keepdims: bool = False):
    (a,) = tnp._promote(a, to_float=True)
    if dtype is not None:
        a = tnp.astype(a, dtype)
    m = nanmean(a, axis, keepdims=True)
    c = _zero_nan(a - m)
    n = tnp.astype(_count(a, axis, keepdims), tnp._aval(a).dtype) - ddof
    return tnp.sum(c * c, axis, keepdims=keepdims) / tnp.where(n > 0, n, tnp.full_like(n, np.nan))


def nanstd(a, axis=None, dtype=None, ddof: int = 0, keepdims: bool = False):
    return tnp.sqrt(nanvar(a, axis, dtype, ddof, keepdims))


def _nan_arg(arg, fill, a, axis, keepdims):
    a = tnp._operand(a)
    if not _is_float(a):
        return arg(a, axis, keepdims=keepdims)
    return arg(tnp.where(tnp.isnan(a), tnp.full_like(a, fill), a), axis, keepdims=keepdims)


def nanargmax(a, axis=None, keepdims: bool = False):
    """argmax ignoring NaN (an all-NaN slice gives 0; numpy raises there)."""
    return _nan_arg(tnp.argmax, -np.inf, a, axis, keepdims)


def nanargmin(a, axis=None, keepdims: bool = False):
    return _nan_arg(tnp.argmin, np.inf, a, axis, keepdims)


def nancumsum(a, axis=None, dtype=None):
    return tnp.cumsum(_zero_nan(a), axis, dtype)


def nancumprod(a, axis=None, dtype=None):
    return tnp.cumprod(_zero_nan(a, 1), axis, dtype)


def _cumulative(f, identity, x, axis, dtype, include_initial):
    x = tnp._operand(x)
    if axis is None:
        if tnp.ndim(x) > 1:
            raise ShapeError(with_user_line("cumulative_sum/prod: axis is required for arrays of rank > 1"))
        axis = 0
    y = f(x, axis, dtype) if tnp.ndim(x) else f(tnp.reshape(x, (1,)), 0, dtype)
    if include_initial:
        axis = tnp._norm_axis(axis, tnp.ndim(y))
        shape = list(tnp.shape(y))
        shape[axis] = 1
        y = tnp.concatenate([tnp.full(tuple(shape), identity, tnp._aval(y).dtype), y], axis=axis)
    return y


def cumulative_sum(x, /, *, axis=None, dtype=None, include_initial: bool = False):
    return _cumulative(tnp.cumsum, 0, x, axis, dtype, include_initial)


def cumulative_prod(x, /, *, axis=None, dtype=None, include_initial: bool = False):
    return _cumulative(tnp.cumprod, 1, x, axis, dtype, include_initial)


def diff(a, n: int = 1, axis: int = -1, prepend=None, append=None):
    a = tnp._operand(a)
    axis = tnp._norm_axis(axis, tnp.ndim(a))
    parts = []
    for extra in (prepend, append):
        if extra is None:
            parts.append(None)
            continue
        e = tnp._operand(extra)
        if tnp.ndim(e) == 0:
            shape = list(tnp.shape(a))
            shape[axis] = 1
            e = tnp.broadcast_to(e, tuple(shape))
        parts.append(e)
    if parts[0] is not None or parts[1] is not None:
        a = tnp.concatenate([p for p in (parts[0], a, parts[1]) if p is not None], axis=axis)
    bool_ = _dt.is_bool(tnp._aval(a).dtype)
    for _ in range(int(n)):
        m = tnp.shape(a)[axis]
        hi, lo = (
            tnp._slice_axis(a, axis, 1, builtins.max(m, 1)),
            tnp._slice_axis(a, axis, 0, builtins.max(m - 1, 0)),
        )
        a = tnp.not_equal(hi, lo) if bool_ else hi - lo
    return a


def ediff1d(ary, to_end=None, to_begin=None):
    flat = tnp.ravel(tnp._operand(ary))
    d = diff(flat)
    parts = [tnp.ravel(tnp.astype(to_begin, tnp._aval(d).dtype))] if to_begin is not None else []
    parts.append(d)
    if to_end is not None:
        parts.append(tnp.ravel(tnp.astype(to_end, tnp._aval(d).dtype)))
    return tnp.concatenate(parts) if len(parts) > 1 else d


def gradient(f, *varargs, axis=None, edge_order: int = 1):
    """Second-order central differences inside, first-order one-sided at the edges (numpy's
    edge_order=1), uniform spacing per axis (scalars in varargs) or coordinate arrays."""
    (f,) = tnp._promote(f, to_float=True)
    nd = tnp.ndim(f)
    axes = list(range(nd)) if axis is None else list(tnp._norm_axes(axis, nd))
    if edge_order != 1:
        raise TilefuseError(with_user_line("gradient: only edge_order=1 is supported"))
    spacing = list(varargs) if len(varargs) != 1 else list(varargs) * len(axes)
    if not spacing:
        spacing = [1.0] * len(axes)
    outs = []
    for ax, h in zip(axes, spacing):
        n = tnp.shape(f)[ax]
        if n < 2:
            raise ShapeError(with_user_line("gradient: each axis needs at least 2 points"))
        s = lambda lo, hi: tnp._slice_axis(f, ax, lo, hi)  # noqa: E731
        if np.ndim(h) == 0 or tnp.ndim(h) == 0:
            h = float(h)
            first = (s(1, 2) - s(0, 1)) / h
            last = (s(n - 1, n) - s(n - 2, n - 1)) / h
            mid = (s(2, n) - s(0, n - 2)) / (2 * h)
        else:
            x = tnp.asarray(h, tnp._aval(f).dtype) if not isinstance(h, (tnp.Tracer, tnp.Array)) else h
            shape = [1] * nd
            shape[ax] = -1
            dx = tnp.reshape(tnp.diff(x), shape)
            d1, d2 = tnp._slice_axis(dx, ax, 0, n - 2), tnp._slice_axis(dx, ax, 1, n - 1)
            first = (s(1, 2) - s(0, 1)) / tnp._slice_axis(dx, ax, 0, 1)
            last = (s(n - 1, n) - s(n - 2, n - 1)) / tnp._slice_axis(dx, ax, n - 2, n - 1)
            mid = (
                -(d2 / (d1 * (d1 + d2))) * s(0, n - 2)
                + ((d2 - d1) / (d1 * d2)) * s(1, n - 1)
                + (d1 / (d2 * (d1 + d2))) * s(2, n)
            )
        outs.append(
            tnp.concatenate([first, mid, last], axis=ax) if n > 2 else tnp.concatenate([first, last], axis=ax)
        )
    return outs[0] if len(outs) == 1 else outs


def trapezoid(y, x=None, dx: float = 1.0, axis: int = -1):
    (y,) = tnp._promote(y, to_float=True)
    axis = tnp._norm_axis(axis, tnp.ndim(y))
    n = tnp.shape(y)[axis]
    avg = (
        tnp._slice_axis(y, axis, 1, builtins.max(n, 1)) + tnp._slice_axis(y, axis, 0, builtins.max(n - 1, 0))
    ) * 0.5
    if x is None:
        return tnp.sum(avg, axis) * dx
    x = tnp._operand(x)
    d = tnp.diff(x, axis=axis if tnp.ndim(x) == tnp.ndim(y) else -1)
    if tnp.ndim(d) == 1 and tnp.ndim(y) > 1:
        shape = [1] * tnp.ndim(y)
        shape[axis] = -1
        d = tnp.reshape(d, shape)
    return tnp.sum(avg * d, axis)


def cov(m, y=None, rowvar: bool = True, bias: bool = False, ddof=None, fweights=None, aweights=None):
    """The covariance matrix of the variables (rows, or columns with rowvar=False)."""
    (m,) = tnp._promote(m, to_float=True)
    if tnp.ndim(m) > 2:
        raise ShapeError(with_user_line(f"cov: m must have rank <= 2, got shape {tnp.shape(m)}"))
    x = tnp.atleast_2d(m)
    if not rowvar and tnp.shape(x)[0] != 1:
        x = x.T
    if y is not None:
        (y,) = tnp._promote(y, to_float=True)
        y = tnp.atleast_2d(y)
        if not rowvar and tnp.shape(y)[0] != 1:
            y = y.T
        x, y = tnp._promote(x, y)
        x = tnp.concatenate([x, y], axis=0)
    if ddof is None:
        ddof = 0 if bias else 1
    n = tnp.shape(x)[1]
    w = None
    if fweights is not None:
        w = tnp.astype(fweights, tnp._aval(x).dtype)
    if aweights is not None:
        a = tnp.astype(aweights, tnp._aval(x).dtype)
        w = a if w is None else w * a
    if w is None:
        avg = tnp.mean(x, axis=1, keepdims=True)
        fact = float(n - ddof)
        xc = x - avg
        c = tnp.matmul(xc, xc.T) / fact
    else:
        w_sum = tnp.sum(w)
        avg = tnp.sum(x * w, axis=1, keepdims=True) / w_sum
        if ddof == 0:
            fact = w_sum
        elif aweights is None:
            fact = w_sum - ddof
        else:
            fact = w_sum - ddof * tnp.sum(w * tnp.astype(aweights, tnp._aval(x).dtype)) / w_sum
        xc = x - avg
        c = tnp.matmul(xc * w, xc.T) / fact
    return tnp.squeeze(c) if tnp.shape(c) == (1, 1) else c


def corrcoef(x, y=None, rowvar: bool = True):
    c = cov(x, y, rowvar)
    if tnp.ndim(c) == 0:
        return c / c
    d = tnp.diagonal(c)
    std = tnp.sqrt(d)
    c = c / std[:, None] / std[None, :]
    return tnp.clip(c, -1, 1)


def _convolve_full(a, v):
    """sum_i a[i] v[k - i] for every k: each output a row of v's entries (gathered in reverse)
    against a, one GEMM-shaped contraction."""
    n, m = tnp.shape(a)[0], tnp.shape(v)[0]
    k = np.arange(n + m - 1)[:, None]
    i = np.arange(n)[None, :]
    j = k - i
    valid = (j >= 0) & (j < m)
    rows = tnp.take(v, np.where(valid, j, 0).astype(np.int32))
    rows = tnp.where(valid, rows, tnp.zeros_like(rows))
    return tnp.matmul(rows, a)


def convolve(a, v, mode: str = "full", *, precision=None, preferred_element_type=None):
    """numpy.convolve of two 1-d arrays ('full', 'same', 'valid')."""
    a, v = tnp._promote(a, v)
    if tnp.ndim(a) != 1 or tnp.ndim(v) != 1:
        raise ShapeError(with_user_line(f"convolve: needs 1-d arrays, got {tnp.shape(a)} and {tnp.shape(v)}"))
    n, m = tnp.shape(a)[0], tnp.shape(v)[0]
    if n == 0 or m == 0:
        raise ShapeError(with_user_line("convolve: inputs cannot be empty"))
    if _dt.is_bool(tnp._aval(a).dtype):
        a, v = tnp.astype(a, tnp.int32), tnp.astype(v, tnp.int32)
    full = _convolve_full(a, v)
    if mode == "full":
        return full
    big, small = builtins.max(n, m), builtins.min(n, m)
    if mode == "same":
        start = (small - 1) // 2
        return full[start : start + big]
    if mode == "valid":
        return full[small - 1 : big]
    raise TilefuseError(with_user_line(f"convolve: mode must be 'full', 'same' or 'valid', got {mode!r}"))


def correlate(a, v, mode: str = "valid", *, precision=None, preferred_element_type=None):
    """numpy.correlate of two real 1-d arrays: convolve with v reversed."""
    a, v = tnp._promote(a, v)
    if tnp.ndim(a) != 1 or tnp.ndim(v) != 1:
        raise ShapeError(
            with_user_line(f"correlate: needs 1-d arrays, got {tnp.shape(a)} and {tnp.shape(v)}")
        )
    if tnp.shape(a)[0] < tnp.shape(v)[0]:  # numpy swaps the operands and reverses the result
        return tnp.flip(convolve(v, tnp.flip(a), mode))
    return convolve(a, tnp.flip(v), mode)


def interp(x, xp, fp, left=None, right=None, period=None):
    """Piecewise-linear interpolation of (xp, fp) at x, xp increasing (numpy.interp)."""
    (x,) = tnp._promote(x, to_float=True)
    xp, fp = tnp._promote(xp, fp, to_float=True)
    x, xp = tnp._promote(x, xp)
    fp = tnp.astype(fp, tnp._aval(x).dtype)
    if tnp.ndim(xp) != 1 or tnp.shape(xp) != tnp.shape(fp):
        raise ShapeError(
            with_user_line(
                f"interp: xp and fp must be 1-d of one length, got {tnp.shape(xp)} and {tnp.shape(fp)}"
            )
        )
    if period is not None:
        period = abs(float(period))
        x = tnp.remainder(x, period)
        xp = tnp.remainder(xp, period)
        order = tnp.argsort(xp)
        xp, fp = tnp.take(xp, order), tnp.take(fp, order)
        xp = tnp.concatenate([xp[-1:] - period, xp, xp[:1] + period])
        fp = tnp.concatenate([fp[-1:], fp, fp[:1]])
    n = tnp.shape(xp)[0]
    i = tnp.clip(tnp.searchsorted(xp, x, side="right"), 1, n - 1)
    x0, x1 = tnp.take(xp, i - 1), tnp.take(xp, i)
    y0, y1 = tnp.take(fp, i - 1), tnp.take(fp, i)
    dx = x1 - x0
    t = (x - x0) / tnp.where(dx == 0, tnp.ones_like(dx), dx)
    y = tnp.where(dx == 0, y1, y0 + t * (y1 - y0))
    if period is None:
        lo = fp[0] if left is None else left
        hi = fp[-1] if right is None else right
        y = tnp.where(x < xp[0], lo, y)
        y = tnp.where(x > xp[-1], hi, y)
        y = tnp.where(x == xp[-1], fp[-1], y)
    return y
