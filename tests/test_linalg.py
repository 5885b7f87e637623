"""tilefuse.numpy.linalg and tilefuse.scipy.linalg against numpy on every device, their
gradients against finite differences (JAX's rules), and the decomposition primitives under vmap
and jit. The decompositions run through numpy's LAPACK on the host on every device, so values
agree with numpy's to rounding; gradient checks use float64."""
from __future__ import annotations

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from conftest import assert_close
from tilefuse.numpy import linalg
from tilefuse.numpy.linalg import solve  # importable as a module, as jax.numpy.linalg

R = np.random.default_rng(7)


def _mat(n, m=None, spd=False, dtype=np.float64, batch=()):
    a = R.normal(size=batch + (n, m or n))
    if spd:
        a = a @ np.swapaxes(a, -1, -2) + n * np.eye(n)
    return a.astype(dtype)


def _close(got, want, tol=1e-5):
    got = np.asarray(got)
    assert got.shape == np.shape(want), (got.shape, np.shape(want))
    np.testing.assert_allclose(got.astype(np.float64), np.asarray(want, np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_solvers_against_numpy(device, dtype):
    tol = 2e-4 if dtype == np.float32 else 1e-10
    a, b, bv = _mat(3, dtype=dtype), _mat(3, 2, dtype=dtype), R.normal(size=3).astype(dtype)
    ab = _mat(3, dtype=dtype, batch=(2,))
    tall, a4, a6, b23 = _mat(4, 3, dtype=dtype), _mat(4, dtype=dtype), _mat(6, dtype=dtype), _mat(2, 3, dtype=dtype)
    cases = [
        (lambda m: m.linalg.solve(a, b), ()), (lambda m: m.linalg.solve(a, bv), ()),
        (lambda m: m.linalg.solve(ab, b), ()), (lambda m: m.linalg.inv(a), ()), (lambda m: m.linalg.inv(ab), ()),
        (lambda m: m.linalg.det(a), ()), (lambda m: m.linalg.det(ab), ()),
        (lambda m: tuple(m.linalg.slogdet(a)), ()), (lambda m: m.linalg.pinv(tall), ()),
        (lambda m: m.linalg.matrix_power(a, 3), ()), (lambda m: m.linalg.matrix_power(a, -2), ()),
        (lambda m: m.linalg.matrix_power(a, 0), ()), (lambda m: m.linalg.matrix_rank(tall), ()),
        (lambda m: m.linalg.matrix_rank(np.ones((3, 3), dtype)), ()), (lambda m: m.linalg.cond(a), ()),
        (lambda m: m.linalg.cond(a, 1), ()), (lambda m: m.linalg.multi_dot([a, b, b.T]), ()),
        (lambda m: m.linalg.tensorinv(a4.reshape(4, 2, 2), ind=1), ()),
        (lambda m: m.linalg.tensorsolve(a6.reshape(2, 3, 6), b23), ()),
        (lambda m: m.linalg.eigvalsh(a + a.T), ()), (lambda m: m.linalg.svd(a, compute_uv=False), ()),
        (lambda m: m.linalg.cholesky(a @ a.T + 3 * np.eye(3, dtype=dtype)), ()),
        (lambda m: m.linalg.trace(ab), ()), (lambda m: m.linalg.diagonal(ab, offset=1), ()),
        (lambda m: m.linalg.outer(bv, bv), ()), (lambda m: m.linalg.cross(b.T, b.T[::-1]), ()),
        (lambda m: m.linalg.vecdot(a, a), ()), (lambda m: m.linalg.matmul(a, b), ()),
        (lambda m: m.linalg.tensordot(a, b, axes=1), ()), (lambda m: m.linalg.matrix_transpose(ab), ()),
    ]
    # one jitted function computes every case (few compiles); eagerly on ref only
    want = [f(np) for f, _ in cases]
    runs = [tx.jit(lambda: [f(tnp) for f, _ in cases])()]
    if device.kind == "ref":
        runs.append([f(tnp) for f, _ in cases])
    for got_all in runs:
        for got, w in zip(got_all, want):
            for g, w1 in zip(got if isinstance(got, tuple) else (got,), w if isinstance(w, tuple) else (w,)):
                _close(g, w1, tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_norms_every_ord(device, dtype):
    x = _mat(3, 4, dtype=dtype)
    tol = 1e-5 if dtype == np.float32 else 1e-12

    def all_norms(m, x):
        v = x[0]
        out = [m.linalg.norm(v, o) for o in (None, 2, 1, -1, np.inf, -np.inf, 0, 3, 0.5)]
        out += [m.linalg.norm(x, o, axis=1, keepdims=True) for o in (None, 2, 1, np.inf, 0, 3)]
        out += [m.linalg.norm(x, o) for o in (None, "fro", "nuc", 1, -1, 2, -2, np.inf, -np.inf)]
        out += [m.linalg.norm(x, o, axis=(1, 0), keepdims=True) for o in ("fro", "nuc", 1, 2, -np.inf)]
        out += [m.linalg.norm(x[None], axis=(1, 2)), m.linalg.vector_norm(x, ord=1),
                m.linalg.matrix_norm(x, ord="nuc")]
        return out
    want = all_norms(np, x)
    runs = [tx.jit(lambda a: all_norms(tnp, a))(x)] + ([all_norms(tnp, x)] if device.kind == "ref" else [])
    for got in runs:
        for g, w in zip(got, want):
            _close(g, w, tol)


def test_decompositions_against_numpy(device):
    a = _mat(4, 3)
    s = _mat(3, spd=True)
    for f in (tnp.linalg.qr, tx.jit(tnp.linalg.qr)):
        q, r = f(a)
        wq, wr = np.linalg.qr(a)
        _close(q, wq, 1e-12), _close(r, wr, 1e-12)
    q, r = tnp.linalg.qr(a, mode="complete")
    _close(q, np.linalg.qr(a, mode="complete")[0], 1e-12)
    _close(tnp.linalg.qr(a, mode="r"), np.linalg.qr(a, mode="r"), 1e-12)
    for f in (tnp.linalg.eigh, tx.jit(tnp.linalg.eigh)):
        w, v = f(s)
        ww, wv = np.linalg.eigh(s)
        _close(w, ww, 1e-12), _close(v, wv, 1e-12)
    u, sv, vh = tnp.linalg.svd(a)
    wu, wsv, wvh = np.linalg.svd(a)
    _close(u, wu, 1e-12), _close(sv, wsv, 1e-12), _close(vh, wvh, 1e-12)
    u, sv, vh = tx.jit(lambda m: tnp.linalg.svd(m, full_matrices=False))(a)
    _close(u * sv @ vh, a, 1e-12)
    _close(tnp.linalg.cholesky(s, upper=True), np.linalg.cholesky(s, upper=True), 1e-12)
    # numpy reads one triangle; symmetrize_input=False does the same
    t = np.tril(s) + np.triu(R.normal(size=(3, 3)), 1)
    _close(tnp.linalg.cholesky(t, symmetrize_input=False), np.linalg.cholesky(t), 1e-12)
    _close(tnp.linalg.eigh(t, UPLO="L")[0], np.linalg.eigh(t, UPLO="L")[0], 1e-12)
    x, resid, rank, svals = tnp.linalg.lstsq(a, a[:, 0] + 1.0)
    wx, wres, wrank, wsv = np.linalg.lstsq(a, a[:, 0] + 1.0)
    _close(x, wx, 1e-10), _close(resid, wres, 1e-10), _close(svals, wsv, 1e-12)
    assert int(rank) == wrank
    x2 = tx.jit(lambda m, y: tnp.linalg.lstsq(m, y)[0])(a, a[:, :2])
    _close(x2, np.linalg.lstsq(a, a[:, :2])[0], 1e-10)


def test_lapack_failures_give_nan_not_exceptions(device):
    assert np.isnan(np.asarray(tnp.linalg.cholesky(-np.eye(2)))).all()
    assert not np.isfinite(np.asarray(tnp.linalg.solve(np.zeros((2, 2)), np.ones(2)))).all()
    ok_and_bad = np.stack([np.eye(2) * 2, -np.eye(2)])
    got = np.asarray(tx.jit(tnp.linalg.cholesky)(ok_and_bad))
    np.testing.assert_allclose(got[0], np.eye(2) * np.sqrt(2)) and np.isnan(got[1]).all()
    assert float(tnp.linalg.det(np.zeros((3, 3)))) == 0.0


def test_scipy_linalg(device):
    from tilefuse.scipy import linalg as sl
    a = _mat(3, spd=True)
    b = _mat(3, 2)
    lower = np.tril(_mat(3)) + 3 * np.eye(3)
    _close(sl.solve_triangular(lower, b, lower=True), np.linalg.solve(lower, b), 1e-10)
    _close(sl.solve_triangular(lower.T, b[:, 0], trans="T", lower=False), np.linalg.solve(lower, b[:, 0]), 1e-10)
    _close(sl.solve_triangular(lower, b, lower=True, unit_diagonal=True),
           np.linalg.solve(np.tril(lower, -1) + np.eye(3), b), 1e-10)
    c, low = sl.cho_factor(a, lower=True)
    _close(sl.cho_solve((c, low), b), np.linalg.solve(a, b), 1e-10)
    c, low = sl.cho_factor(a)
    assert low is False
    c = tx.jit(lambda m: sl.cho_factor(m)[0])(a)
    _close(tx.jit(lambda c, y: sl.cho_solve((c, False), y))(c, b), np.linalg.solve(a, b), 1e-10)
    small = _mat(3) * 0.3
    _close(sl.expm(small), _expm_reference(small), 1e-12)
    _close(tx.jit(sl.expm)(small * 10), _expm_reference(small * 10), 1e-9)
    _close(sl.cholesky(a), np.linalg.cholesky(a).T, 1e-12)
    _close(sl.cholesky(a, lower=True), np.linalg.cholesky(a), 1e-12)
    _close(sl.solve(a, b), np.linalg.solve(a, b), 1e-10)
    _close(sl.inv(a), np.linalg.inv(a), 1e-10)
    _close(sl.det(a), np.linalg.det(a), 1e-10)
    _close(sl.eigh(a)[0], np.linalg.eigh(a)[0], 1e-12)
    _close(sl.block_diag(a[:2, :2], b), _block_diag_reference(a[:2, :2], b), 0)


def _expm_reference(a):
    """exp(a) by its Taylor series in float64 (a scaled to norm < 0.5, then squared back)."""
    k = max(0, int(np.ceil(np.log2(max(np.abs(a).sum(axis=1).max(), 1e-300) / 0.5))))
    x = a / 2.0 ** k
    out, term = np.eye(len(a)), np.eye(len(a))
    for i in range(1, 30):
        term = term @ x / i
        out = out + term
    for _ in range(k):
        out = out @ out
    return out


def _block_diag_reference(*blocks):
    n = sum(b.shape[0] for b in blocks)
    m = sum(b.shape[1] for b in blocks)
    out = np.zeros((n, m))
    i = j = 0
    for b in blocks:
        out[i:i + b.shape[0], j:j + b.shape[1]] = b
        i, j = i + b.shape[0], j + b.shape[1]
    return out


# ---- gradients: JAX's rules against finite differences (float64) ------------------------------------

def _sym(a):
    return (a + a.T) * 0.5


GRADS = [
    ("solve", lambda a, b: linalg.solve(a, b), (_mat(3) + 3 * np.eye(3), _mat(3, 2))),
    ("inv_det", lambda a: linalg.inv(a) * linalg.det(a), (_mat(3) + 3 * np.eye(3),)),
    ("slogdet", lambda a: linalg.slogdet(a)[1], (_mat(3),)),
    ("cholesky", lambda a: linalg.cholesky(a @ a.T + 3 * np.eye(3)), (_mat(3),)),
    ("eigh", lambda a: linalg.eigh(_sym(a))[0] + tnp.abs(linalg.eigh(_sym(a))[1][0]), (_mat(3),)),
    ("qr", lambda a: tnp.abs(linalg.qr(a)[0]) + tnp.sum(tnp.abs(linalg.qr(a)[1])), (_mat(4, 3),)),
    ("svd", lambda a: linalg.svd(a, full_matrices=False)[1] + tnp.abs(linalg.svd(a, full_matrices=False)[0][0]),
     (_mat(4, 3),)),
    ("svd_wide", lambda a: tnp.abs(linalg.svd(a, full_matrices=False)[2]), (_mat(2, 4),)),
    ("pinv_lstsq", lambda a, b: linalg.pinv(a) + linalg.lstsq(a, b)[0].sum(), (_mat(4, 3), _mat(4, 2))),
    ("norms", lambda a: linalg.norm(a, 2) + linalg.norm(a, "nuc") + linalg.norm(a, -2) + linalg.norm(a) +
     linalg.norm(a, 1) + linalg.norm(a[0], 3), (_mat(3, 4),)),
    ("matrix_power", lambda a: linalg.matrix_power(a, 3) + linalg.matrix_power(a + 3 * np.eye(3), -1), (_mat(3),)),
    ("solve_triangular", lambda a, b: _scipy_linalg().solve_triangular(a, b, lower=True) +
     _scipy_linalg().solve_triangular(a, b, trans=1, unit_diagonal=True), (np.tril(_mat(3)) + 3 * np.eye(3), _mat(3, 2))),
    ("cho_solve", lambda a, b: _scipy_linalg().cho_solve(_scipy_linalg().cho_factor(a @ a.T + 3 * np.eye(3)), b),
     (_mat(3), _mat(3, 2))),
    ("expm", lambda a: _scipy_linalg().expm(a), (_mat(3) * 0.5,)),
]


def _scipy_linalg():
    from tilefuse.scipy import linalg as sl
    return sl


@pytest.mark.parametrize("name,fn,args", GRADS, ids=[g[0] for g in GRADS])
def test_gradients(name, fn, args, device):
    tx.check_grads(fn, args, order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


def test_second_order_and_vmap(device):
    a = _mat(3, spd=True, batch=(2,))
    tx.check_grads(lambda m: linalg.cholesky(m[0]) + linalg.slogdet(m[1])[1], (a,), order=2, modes=("rev",))
    for f in (lambda m: linalg.eigh(m)[0], lambda m: linalg.inv(m), lambda m: linalg.svd(m, compute_uv=False),
              lambda m: linalg.qr(m)[1], lambda m: linalg.cholesky(m)):
        _close(tx.vmap(f)(a), np.stack([np.asarray(f(x)) for x in a]), 1e-10)
        moved = np.moveaxis(a, 0, 2)  # the batch last
        _close(tx.vmap(f, in_axes=2)(moved), np.stack([np.asarray(f(moved[:, :, i])) for i in range(2)]), 1e-10)


def test_qr_and_svd_derivatives_that_jax_does_not_define_raise(device):
    with pytest.raises(tx.TransformError, match="tall or square"):
        tx.grad(lambda a: tnp.sum(linalg.qr(a)[1]))(_mat(2, 3))
    with pytest.raises(tx.TransformError, match="full_matrices"):
        tx.grad(lambda a: tnp.sum(linalg.svd(a)[0]))(_mat(3, 2))


def test_float32_and_ints_compute_in_float32(device):
    a = np.array([[2, 1], [1, 3]], np.int32)
    x = tnp.linalg.solve(a, np.array([1, 2], np.int32))
    assert x.dtype == np.float32
    assert_close(x, np.linalg.solve(a, [1, 2]).astype(np.float32))
    assert tnp.linalg.inv(a.astype(np.float16)).dtype == np.float16
    assert solve is tnp.linalg.solve


def test_host_kernels_are_profiled_and_counted(device):
    from tilefuse.runtime import dispatch
    a = _mat(8, spd=True).astype(np.float32)
    f = tx.jit(lambda m: tnp.linalg.eigh(m)[0] * 2.0)
    f(a)
    before = dispatch.stats.get("host_round_trips", 0)
    with tx.profile() as prof:
        w = f(a)
    _close(w, 2 * np.linalg.eigh(a)[0], 1e-4)
    if device.kind != "ref":  # ref interprets the graph: no kernels, no launches
        assert dispatch.stats["host_round_trips"] == before + 1
        assert "eigh" in prof.summary()
