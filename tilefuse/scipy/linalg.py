"""tilefuse.scipy.linalg: jax.scipy.linalg's common functions (triangular and Cholesky solves,
the matrix exponential, ...) over tilefuse.numpy.linalg."""

from __future__ import annotations


import tilefuse.numpy as tnp
from tilefuse.ir.errors import ShapeError, with_user_line
from tilefuse.numpy import linalg as _la
from tilefuse.numpy.linalg import solve_triangular  # noqa: F401  (defined there, scipy's signature)

__all__ = [
    "solve_triangular",
    "cho_factor",
    "cho_solve",
    "cholesky",
    "solve",
    "inv",
    "det",
    "eigh",
    "qr",
    "svd",
    "expm",
    "block_diag",
    "lu_solve",
]


def cholesky(a, lower: bool = False, overwrite_a: bool = False, check_finite: bool = True):
    """scipy's default is the upper factor."""
    return _la.cholesky(a, upper=not lower)


def cho_factor(a, lower: bool = False, overwrite_a: bool = False, check_finite: bool = True):
    """(c, lower): the Cholesky factor (upper by default, as scipy) for cho_solve."""
    return cholesky(a, lower=lower), lower


def cho_solve(c_and_lower, b, overwrite_b: bool = False, check_finite: bool = True):
    """x with A x = b from A's Cholesky factor: two triangular solves."""
    c, lower = c_and_lower
    if lower:
        y = solve_triangular(c, b, lower=True)
        return solve_triangular(c, y, trans=1, lower=True)
    y = solve_triangular(c, b, trans=1, lower=False)
    return solve_triangular(c, y, lower=False)


def solve(
    a,
    b,
    lower: bool = False,
    overwrite_a: bool = False,
    overwrite_b: bool = False,
    check_finite=True,
    assume_a: str = "gen",
):
    return _la.solve(a, b)


def inv(a, overwrite_a: bool = False, check_finite: bool = True):
    return _la.inv(a)


def det(a, overwrite_a: bool = False, check_finite: bool = True):
    return _la.det(a)


def eigh(a, b=None, lower: bool = True, eigvals_only: bool = False, **kwargs):
    if b is not None:
        raise ShapeError(with_user_line("eigh: the generalized problem (b=) is not supported"))
    w, v = _la.eigh(a, UPLO="L" if lower else "U")
    return w if eigvals_only else (w, v)


def qr(
    a, overwrite_a: bool = False, lwork=None, mode: str = "full", pivoting: bool = False, check_finite=True
):
    return _la.qr(a, {"full": "complete", "economic": "reduced", "r": "r"}[mode])


def svd(
    a,
    full_matrices: bool = True,
    compute_uv: bool = True,
    overwrite_a: bool = False,
    check_finite=True,
    lapack_driver: str = "gesdd",
):
    return _la.svd(a, full_matrices, compute_uv)


def lu_solve(*args, **kwargs):
    raise NotImplementedError("lu_solve: tilefuse has no LU factorization; use tilefuse.scipy.linalg.solve")


# Higham's scaling-and-squaring with the degree-13 Padé approximant (Higham 2005): exact enough
# (to the dtype's precision) for any norm, every step a matmul, a solve or a select, so it runs
# and differentiates under jit (the squarings are a fixed number of selects).
_PADE13 = (
    64764752532480000.0,
    32382376266240000.0,
    7771770303897600.0,
    1187353796428800.0,
    129060195264000.0,
    10559470521600.0,
    670442572800.0,
    33522128640.0,
    1323241920.0,
    40840800.0,
    960960.0,
    16380.0,
    182.0,
    1.0,
)
_THETA13 = 5.371920351148152
_MAX_SQUARINGS = 24


def expm(A, *, upper_triangular: bool = False, max_squarings: int = _MAX_SQUARINGS):
    (A,) = tnp._promote(A, to_float=True)
    n = tnp.shape(A)[-1]
    if tnp.ndim(A) < 2 or tnp.shape(A)[-2] != n:
        raise ShapeError(with_user_line(f"expm: needs square matrices, got shape {tnp.shape(A)}"))
    norm = tnp.max(tnp.sum(tnp.abs(A), axis=-2), axis=-1)  # the 1-norm
    s = tnp.ceil(tnp.log2(tnp.maximum(norm / _THETA13, 1.0)))
    s = tnp.clip(s, 0.0, float(max_squarings))
    X = A * tnp.exp2(-s)[..., None, None]
    eye = tnp.broadcast_to(tnp.eye(n, dtype=tnp._aval(A).dtype), tnp.shape(A))
    b = _PADE13
    X2 = tnp.matmul(X, X)
    X4 = tnp.matmul(X2, X2)
    X6 = tnp.matmul(X4, X2)
    U = tnp.matmul(
        X,
        tnp.matmul(X6, b[13] * X6 + b[11] * X4 + b[9] * X2) + b[7] * X6 + b[5] * X4 + b[3] * X2 + b[1] * eye,
    )
    V = tnp.matmul(X6, b[12] * X6 + b[10] * X4 + b[8] * X2) + b[6] * X6 + b[4] * X4 + b[2] * X2 + b[0] * eye
    R = _la.solve(V - U, V + U)
    for k in range(int(max_squarings)):  # R^(2^s), one select per possible squaring
        R = tnp.where((s > k)[..., None, None], tnp.matmul(R, R), R)
    return R


def block_diag(*arrs):
    blocks = [tnp.atleast_2d(a) for a in arrs]
    if not blocks:
        return tnp.zeros((1, 0), tnp.float32)
    dt = tnp.result_type(*blocks)
    cols = sum(tnp.shape(b)[1] for b in blocks)
    out_rows, c0 = [], 0
    for blk in blocks:  # each block padded to the full width at its column offset
        c = tnp.shape(blk)[1]
        out_rows.append(tnp.pad(tnp.astype(blk, dt), ((0, 0), (c0, cols - c0 - c))))
        c0 += c
    return tnp.concatenate(out_rows, axis=0)
