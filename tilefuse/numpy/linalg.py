"""tilefuse.numpy.linalg: numpy.linalg (and jax.numpy.linalg) over tilefuse primitives.

The decompositions (cholesky, qr, eigh, svd) and solve, slogdet and the triangular solve are
primitives run by numpy's LAPACK on the host on every device (ir/primitives.py), with JAX's
derivative rules; everything else composes them with matmuls. Matrices are the last two axes;
leading axes are a batch. Integer inputs compute in float32. As in JAX, a matrix LAPACK rejects
(singular for solve/inv, not positive definite for cholesky) gives NaN or inf, not an exception.
Not here: eig and eigvals (complex results: tilefuse has no complex dtype)."""

from __future__ import annotations

import builtins
from typing import NamedTuple

import numpy as np

import tilefuse.numpy as tnp
from tilefuse.ir import dtypes as _dt
from tilefuse.ir import primitives as P
from tilefuse.ir.errors import ShapeError, TilefuseError, with_user_line
from tilefuse.tracer.core import bind1

__all__ = [
    "cholesky",
    "cond",
    "cross",
    "det",
    "diagonal",
    "eigh",
    "eigvalsh",
    "inv",
    "lstsq",
    "matmul",
    "matrix_norm",
    "matrix_power",
    "matrix_rank",
    "matrix_transpose",
    "multi_dot",
    "norm",
    "outer",
    "pinv",
    "qr",
    "slogdet",
    "solve",
    "svd",
    "svdvals",
    "tensordot",
    "tensorinv",
    "tensorsolve",
    "trace",
    "vecdot",
    "vector_norm",
    "solve_triangular",
]


class EighResult(NamedTuple):
    eigenvalues: object
    eigenvectors: object


class QRResult(NamedTuple):
    Q: object
    R: object


class SVDResult(NamedTuple):
    U: object
    S: object
    Vh: object


class SlogdetResult(NamedTuple):
    sign: object
    logabsdet: object


def _matrix(a, name, square=False):
    """a as a float array of rank >= 2 (ints compute in float32)."""
    (a,) = tnp._promote(a, to_float=True)
    shape = tnp.shape(a)
    if len(shape) < 2:
        raise ShapeError(with_user_line(f"linalg.{name}: needs a matrix (..., m, n), got shape {shape}"))
    if square and shape[-1] != shape[-2]:
        raise ShapeError(with_user_line(f"linalg.{name}: needs square matrices, got shape {shape}"))
    return a


def _unpack(packed, shapes):
    batch = tnp.shape(packed)[:-1]
    out, start = [], 0
    for s in shapes:
        n = int(np.prod(s, dtype=np.int64))
        out.append(tnp.reshape(packed[..., start : start + n], batch + tuple(s)))
        start += n
    return out


def _from_triangle(a, lower: bool):
    """The symmetric matrix numpy reads from one triangle of a."""
    t = tnp.tril(a) if lower else tnp.triu(a)
    strict = tnp.tril(a, -1) if lower else tnp.triu(a, 1)
    return t + tnp.swapaxes(strict, -1, -2)


def matrix_transpose(x):
    if tnp.ndim(x) < 2:
        raise ShapeError(with_user_line(f"matrix_transpose: needs rank >= 2, got shape {tnp.shape(x)}"))
    return tnp.swapaxes(x, -1, -2)


def _eye_like(a):
    n = tnp.shape(a)[-1]
    return tnp.broadcast_to(tnp.eye(n, dtype=a.dtype), tnp.shape(a)[:-2] + (n, n))


# ---- decompositions ---------------------------------------------------------------------------


def cholesky(a, *, upper: bool = False, symmetrize_input: bool = True):
    """The lower factor L with L Lᵀ = a (of (a + aᵀ)/2, as JAX, or of a's lower triangle with
    symmetrize_input=False, as numpy); NaN where a is not positive definite."""
    a = _matrix(a, "cholesky", square=True)
    if not symmetrize_input:
        a = _from_triangle(a, lower=True)
    lo = bind1(P.cholesky, a)
    return matrix_transpose(lo) if upper else lo


def eigh(a, UPLO: str | None = None, symmetrize_input: bool = True):
    """Eigenvalues (ascending) and eigenvectors (in columns) of a symmetric matrix."""
    a = _matrix(a, "eigh", square=True)
    if not symmetrize_input or UPLO is not None:
        a = _from_triangle(a, lower=(UPLO or "L") == "L")
    packed = bind1(P.eigh, a)
    w, v = _unpack(packed, P.packed_sizes("eigh", tnp.shape(a)))
    return EighResult(w, v)


def eigvalsh(a, UPLO: str = "L", symmetrize_input: bool = True):
    return eigh(a, UPLO, symmetrize_input).eigenvalues


def qr(a, mode: str = "reduced"):
    """mode 'reduced' (Q m×k, R k×n), 'complete' (Q m×m, R m×n) or 'r' (R alone)."""
    if mode not in ("reduced", "complete", "r"):
        raise TilefuseError(
            with_user_line(f"linalg.qr: mode must be 'reduced', 'complete' or 'r', got {mode!r}")
        )
    a = _matrix(a, "qr")
    full = mode == "complete"
    q, r = _unpack(bind1(P.qr, a, full_matrices=full), P.packed_sizes("qr", tnp.shape(a), full_matrices=full))
    return r if mode == "r" else QRResult(q, r)


def svd(a, full_matrices: bool = True, compute_uv: bool = True, hermitian: bool = False):
    """U, S (descending), Vh with a = U diag(S) Vh; S alone without compute_uv."""
    a = _matrix(a, "svd")
    if not compute_uv:
        return bind1(P.svd, a, full_matrices=False, compute_uv=False)
    params = dict(full_matrices=builtins.bool(full_matrices), compute_uv=True)
    u, s, vh = _unpack(bind1(P.svd, a, **params), P.packed_sizes("svd", tnp.shape(a), **params))
    return SVDResult(u, s, vh)


def svdvals(x):
    return svd(x, compute_uv=False)


# ---- solving --------------------------------------------------------------------------------


def solve(a, b):
    """x with a x = b: b a vector (n,) or stacked matrices (..., n, k) (numpy 2's rule)."""
    a = _matrix(a, "solve", square=True)
    a, b = tnp._promote(a, b, to_float=True)
    n = tnp.shape(a)[-1]
    vector = tnp.ndim(b) == 1
    if vector:
        b = b[:, None]
    if tnp.ndim(b) < 2 or tnp.shape(b)[-2] != n:
        raise ShapeError(
            with_user_line(
                f"linalg.solve: a of shape {tnp.shape(a)} and b of shape "
                f"{tnp.shape(b) if not vector else (n,)} do not fit (b needs {n} rows)"
            )
        )
    batch = tnp.broadcast_shapes(tnp.shape(a)[:-2], tnp.shape(b)[:-2], _op="linalg.solve")
    a = tnp.broadcast_to(a, batch + (n, n))
    b = tnp.broadcast_to(b, batch + tnp.shape(b)[-2:])
    x = bind1(P.solve, a, b)
    return x[..., 0] if vector else x


def solve_triangular(a, b, trans=0, lower: bool = False, unit_diagonal: bool = False):
    """x with op(T) x = b, T the lower or upper triangle of a, op = transpose for trans=1/'T'
    (jax.scipy.linalg.solve_triangular); b a vector or (..., n, k)."""
    a = _matrix(a, "solve_triangular", square=True)
    a, b = tnp._promote(a, b, to_float=True)
    vector = tnp.ndim(b) == tnp.ndim(a) - 1
    if vector:
        b = b[..., None]
    batch = tnp.broadcast_shapes(tnp.shape(a)[:-2], tnp.shape(b)[:-2], _op="solve_triangular")
    n = tnp.shape(a)[-1]
    a = tnp.broadcast_to(a, batch + (n, n))
    b = tnp.broadcast_to(b, batch + tnp.shape(b)[-2:])
    x = bind1(
        P.triangular_solve,
        a,
        b,
        lower=builtins.bool(lower),
        transpose_a=trans in (1, "T", "C"),
        unit_diagonal=builtins.bool(unit_diagonal),
    )
    return x[..., 0] if vector else x


def inv(a):
    a = _matrix(a, "inv", square=True)
    return bind1(P.solve, a, _eye_like(a))


def slogdet(a):
    a = _matrix(a, "slogdet", square=True)
    sign, logdet = _unpack(bind1(P.slogdet, a), P.packed_sizes("slogdet", tnp.shape(a)))
    return SlogdetResult(sign, logdet)


def det(a):
    sign, logdet = slogdet(a)
    return sign * tnp.exp(logdet)


def _default_rtol(a):
    m, n = tnp.shape(a)[-2:]
    return float(_dt.finfo(a.dtype).eps) * builtins.max(m, n)


def pinv(a, rtol=None, hermitian: bool = False, *, rcond=None):
    """Moore-Penrose pseudo-inverse from the SVD; singular values below rtol * max(s) are dropped."""
    a = _matrix(a, "pinv")
    rtol = rcond if rcond is not None else rtol
    if rtol is None:
        rtol = 10 * _default_rtol(a)
    u, s, vh = svd(a, full_matrices=False)
    cutoff = rtol * tnp.max(s, axis=-1, keepdims=True) if tnp.shape(s)[-1] else 0.0
    keep = s > cutoff
    s_inv = tnp.where(keep, 1.0 / tnp.where(keep, s, 1.0), 0.0)
    return tnp.matmul(matrix_transpose(vh) * s_inv[..., None, :], matrix_transpose(u))


def lstsq(a, b, rcond=None, *, numpy_resid: bool = False):
    """(x, residuals, rank, s) minimising |a x - b|, as jax.numpy.linalg.lstsq: residuals is the
    squared norm of each column of b - a x (numpy's only when rank = n < m; numpy_resid=True
    gives numpy's, an empty array otherwise)."""
    a = _matrix(a, "lstsq")
    a, b = tnp._promote(a, b, to_float=True)
    if tnp.ndim(a) != 2:
        raise ShapeError(with_user_line(f"linalg.lstsq: needs a 2-d a, got shape {tnp.shape(a)}"))
    m, n = tnp.shape(a)
    vector = tnp.ndim(b) == 1
    if tnp.shape(b)[0] != m:
        raise ShapeError(
            with_user_line(f"linalg.lstsq: a {tnp.shape(a)} and b {tnp.shape(b)} differ in rows")
        )
    if rcond is None:
        rcond = _default_rtol(a)
    s = svdvals(a)
    x = tnp.matmul(pinv(a, rtol=rcond), b)
    cutoff = rcond * tnp.max(s) if builtins.min(m, n) else 0.0
    rank = tnp.sum(s > cutoff, dtype=tnp.int32)
    r = b - tnp.matmul(a, x)
    resid = tnp.sum(r * r, axis=0)
    if vector:
        resid = tnp.reshape(resid, (1,))
    if numpy_resid:
        rk = tnp._concrete(rank, "lstsq(numpy_resid=True)")
        if not (int(rk) == n and m > n):
            resid = tnp.zeros((0,), a.dtype)
    return x, resid, rank, s


def matrix_power(a, n: int):
    a = _matrix(a, "matrix_power", square=True)
    n = int(n)
    if n == 0:
        return _eye_like(a)
    if n < 0:
        a, n = inv(a), -n
    result, base = None, a
    while n:  # square and multiply
        if n & 1:
            result = base if result is None else tnp.matmul(result, base)
        n >>= 1
        if n:
            base = tnp.matmul(base, base)
    return result


def matrix_rank(M, rtol=None, *, tol=None):
    M = tnp.asarray(M)
    if tnp.ndim(M) < 2:
        return tnp.astype(tnp.any(M != 0), tnp.int32)
    M = _matrix(M, "matrix_rank")
    s = svdvals(M)
    if tol is None:
        rtol = _default_rtol(M) if rtol is None else rtol
        tol = rtol * tnp.max(s, axis=-1, keepdims=True)
    else:
        tol = tnp.expand_dims(tnp.asarray(tol), -1) if tnp.ndim(tol) else tol
    return tnp.sum(s > tol, axis=-1, dtype=tnp.int32)


# ---- norms ----------------------------------------------------------------------------------


def vector_norm(x, /, *, axis=None, keepdims: bool = False, ord=2):
    (x,) = tnp._promote(x, to_float=True)
    if axis is None:
        y = tnp.ravel(x)
        out = vector_norm(y, axis=0, ord=ord)
        return tnp.reshape(out, (1,) * tnp.ndim(x)) if keepdims else out
    a = tnp.abs(x)
    if ord in (None, 2):
        return tnp.sqrt(tnp.sum(x * x, axis, keepdims=keepdims))
    if ord == 1:
        return tnp.sum(a, axis, keepdims=keepdims)
    if ord == np.inf:
        return tnp.max(a, axis, keepdims=keepdims)
    if ord == -np.inf:
        return tnp.min(a, axis, keepdims=keepdims)
    if ord == 0:
        return tnp.astype(tnp.count_nonzero(x, axis, keepdims), x.dtype)
    ord = float(ord)
    return tnp.power(tnp.sum(tnp.power(a, ord), axis, keepdims=keepdims), 1.0 / ord)


def _matrix_norm(x, ord, axes, keepdims):
    r, c = axes
    (x,) = tnp._promote(x, to_float=True)
    if ord in ("fro", None):
        out = tnp.sqrt(tnp.sum(x * x, axis=axes, keepdims=keepdims))
        return out
    if ord in (1, -1, np.inf, -np.inf):
        sum_axis, red_axis = (r, c) if ord in (1, -1) else (c, r)
        sums = tnp.sum(tnp.abs(x), axis=sum_axis, keepdims=True)
        red = tnp.max if ord in (1, np.inf) else tnp.min
        out = red(sums, axis=red_axis, keepdims=True)
    elif ord in (2, -2, "nuc"):
        y = tnp.moveaxis(x, (r, c), (-2, -1))
        s = svdvals(y)
        out = tnp.sum(s, axis=-1) if ord == "nuc" else (tnp.max if ord == 2 else tnp.min)(s, axis=-1)
        if keepdims:
            out = tnp.expand_dims(out, sorted((r, c)))
        return out
    else:
        raise TilefuseError(with_user_line(f"norm: invalid ord {ord!r} for a matrix"))
    return out if keepdims else tnp.squeeze(out, axis=axes)


def matrix_norm(x, /, *, keepdims: bool = False, ord="fro"):
    return _matrix_norm(x, ord, (tnp.ndim(x) - 2, tnp.ndim(x) - 1), keepdims)


def norm(x, ord=None, axis=None, keepdims: bool = False):
    """numpy.linalg.norm: vector norms (ord None/2, 1, inf, -inf, 0, any p) over one axis,
    matrix norms ('fro', 'nuc', 1, -1, 2, -2, inf, -inf) over two."""
    x = tnp.asarray(x) if not isinstance(x, (tnp.Tracer, tnp.Array)) else x
    nd = tnp.ndim(x)
    if axis is None:
        if ord is None:
            return vector_norm(x, axis=None, keepdims=keepdims)
        if nd == 1:
            axis = 0
        elif nd == 2:
            axis = (0, 1)
        else:
            raise ShapeError(with_user_line(f"norm: ord={ord!r} needs axis for an array of rank {nd}"))
    if isinstance(axis, (int, np.integer)) or len(axis) == 1:
        ax = tnp._norm_axis(axis if isinstance(axis, (int, np.integer)) else axis[0], nd)
        if isinstance(ord, str):
            raise TilefuseError(with_user_line(f"norm: invalid ord {ord!r} for a vector"))
        return vector_norm(x, axis=ax, keepdims=keepdims, ord=ord)
    if len(axis) != 2:
        raise ShapeError(with_user_line(f"norm: axis must be an int or a pair, got {axis}"))
    axes = tnp._norm_axes(axis, nd)
    return _matrix_norm(x, ord, axes, keepdims)


def cond(x, p=None):
    x = _matrix(x, "cond")
    if p in (None, 2, -2):
        s = svdvals(x)
        hi, lo = tnp.max(s, axis=-1), tnp.min(s, axis=-1)
        return lo / hi if p == -2 else hi / lo
    return norm(x, p, axis=(-2, -1)) * norm(inv(x), p, axis=(-2, -1))


# ---- products and the rest of the namespace ---------------------------------------------------


def matmul(x1, x2, /):
    return tnp.matmul(x1, x2)


def tensordot(x1, x2, /, *, axes=2):
    return tnp.tensordot(x1, x2, axes)


def outer(x1, x2, /):
    if tnp.ndim(x1) != 1 or tnp.ndim(x2) != 1:
        raise ShapeError(with_user_line("linalg.outer: needs two vectors"))
    return tnp.outer(x1, x2)


def vecdot(x1, x2, /, *, axis: int = -1):
    x1, x2 = tnp._broadcast_all(*tnp._promote(x1, x2))
    return tnp.sum(x1 * x2, axis=axis)


def cross(x1, x2, /, *, axis: int = -1):
    if tnp.shape(x1)[axis] != 3 or tnp.shape(x2)[axis] != 3:
        raise ShapeError(with_user_line("linalg.cross: needs 3-vectors along the axis"))
    return tnp.cross(x1, x2, axis=axis)


def trace(x, /, *, offset: int = 0, dtype=None):
    return tnp.trace(x, offset, -2, -1, dtype=dtype)


def diagonal(x, /, *, offset: int = 0):
    return tnp.diagonal(x, offset, -2, -1)


def multi_dot(arrays):
    """A chain of matmuls (left to right); a 1-d first (last) array is a row (column) vector."""
    arrays = list(arrays)
    if len(arrays) < 2:
        raise TilefuseError(with_user_line("multi_dot needs at least two arrays"))
    out = arrays[0]
    for b in arrays[1:]:
        out = tnp.matmul(out, b)
    return out


def tensorinv(a, ind: int = 2):
    a = tnp.asarray(a) if not isinstance(a, (tnp.Tracer, tnp.Array)) else a
    shape = tnp.shape(a)
    first, rest = shape[:ind], shape[ind:]
    n = int(np.prod(first, dtype=np.int64))
    if n != int(np.prod(rest, dtype=np.int64)):
        raise ShapeError(
            with_user_line(
                f"tensorinv: the first {ind} axes {first} and the rest {rest} must hold equally many elements"
            )
        )
    return tnp.reshape(inv(tnp.reshape(a, (n, n))), rest + first)


def tensorsolve(a, b, axes=None):
    a = tnp.asarray(a) if not isinstance(a, (tnp.Tracer, tnp.Array)) else a
    nd = tnp.ndim(a)
    if axes is not None:
        order = [i for i in range(nd) if i not in [k % nd for k in axes]] + [k % nd for k in axes]
        a = tnp.transpose(a, order)
    xshape = tnp.shape(a)[tnp.ndim(b) :]
    n = int(np.prod(xshape, dtype=np.int64))
    x = solve(tnp.reshape(a, (-1, n)), tnp.ravel(b))
    return tnp.reshape(x, xshape)
