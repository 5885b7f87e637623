"""tilefuse.scipy.special and tilefuse.scipy.stats against scipy (the `test` extra installs it),
on every device, under jit, with gradients against finite differences."""
from __future__ import annotations

import numpy as np
import pytest

import tilefuse as tx
from tilefuse.scipy import special, stats

ss = pytest.importorskip("scipy.special")
st = pytest.importorskip("scipy.stats")

F32, F64 = np.float32, np.float64
TOL = {F32: (2e-5, 2e-6), F64: (1e-11, 1e-13)}


def _grid(lo, hi, n=23, dtype=F64):
    return np.linspace(lo, hi, n).astype(dtype)


# (name, ours, scipy's, inputs as f(dtype) -> tuple)
SPECIAL = [
    ("gammaln", special.gammaln, ss.gammaln, lambda d: (_grid(-4.7, 35, dtype=d),)),
    ("digamma", special.digamma, ss.digamma, lambda d: (_grid(-3.3, 30, dtype=d),)),
    ("polygamma1", lambda x: special.polygamma(1, x), lambda x: ss.polygamma(1, x), lambda d: (_grid(0.1, 30, dtype=d),)),
    ("polygamma3", lambda x: special.polygamma(3, x), lambda x: ss.polygamma(3, x), lambda d: (_grid(0.3, 30, dtype=d),)),
    ("gamma", special.gamma, ss.gamma, lambda d: (_grid(-3.3, 20, dtype=d),)),
    ("gammasgn", special.gammasgn, ss.gammasgn, lambda d: (_grid(-3.3, 3, dtype=d),)),
    ("loggamma", special.loggamma, lambda x: np.real(ss.loggamma(x)), lambda d: (_grid(0.2, 30, dtype=d),)),
    ("erf", special.erf, ss.erf, lambda d: (_grid(-4, 4, dtype=d),)),
    ("erfc", special.erfc, ss.erfc, lambda d: (_grid(-4, 25, dtype=d),)),
    ("erfinv", special.erfinv, ss.erfinv, lambda d: (np.concatenate([_grid(-0.9999, 0.9999, dtype=d),
                                                                    np.array([-1, 1, 1.5], d)]),)),
    ("expit_logit", lambda x: special.logit(special.expit(x)), lambda x: x, lambda d: (_grid(-5, 5, dtype=d),)),
    ("logit", special.logit, ss.logit, lambda d: (_grid(0.01, 0.99, dtype=d),)),
    ("ndtr", special.ndtr, ss.ndtr, lambda d: (_grid(-9, 9, dtype=d),)),
    ("ndtri", special.ndtri, ss.ndtri, lambda d: (_grid(0.001, 0.999, dtype=d),)),
    ("log_ndtr", special.log_ndtr, ss.log_ndtr, lambda d: (_grid(-40 if d == F64 else -12, 9, dtype=d),)),
    ("xlogy", special.xlogy, ss.xlogy, lambda d: (np.array([0, 0, 1.5, 2, -1], d), np.array([0, 3, 2, 0.5, 4], d))),
    ("xlog1py", special.xlog1py, ss.xlog1py, lambda d: (np.array([0, 1.5, 2], d), np.array([-1, 2, 0.5], d))),
    ("entr", special.entr, ss.entr, lambda d: (np.array([0, 0.5, 2, -1], d),)),
    ("rel_entr_kl_div", lambda x, y: special.rel_entr(x, y) + special.kl_div(x, y),
     lambda x, y: ss.rel_entr(x, y) + ss.kl_div(x, y), lambda d: (np.array([0, 0.5, 2], d), np.array([1, 0.3, 2], d))),
    ("betaln_beta", lambda a, b: (special.betaln(a, b), special.beta(a, b)), lambda a, b: (ss.betaln(a, b), ss.beta(a, b)),
     lambda d: (_grid(0.2, 9, 7, d), _grid(0.5, 4, 7, d))),
    ("multigammaln", lambda a: special.multigammaln(a, 3), lambda a: ss.multigammaln(a, 3), lambda d: (_grid(1.2, 9, 7, d),)),
    ("gammainc", special.gammainc, ss.gammainc, lambda d: (_grid(0.3, 20, dtype=d), _grid(0, 30, dtype=d)[::-1])),
    ("gammaincc", special.gammaincc, ss.gammaincc, lambda d: (_grid(0.3, 20, dtype=d), _grid(0, 30, dtype=d))),
    ("betainc", special.betainc, ss.betainc, lambda d: (_grid(0.3, 9, dtype=d), _grid(0.5, 5, dtype=d)[::-1],
                                                        _grid(0, 1, dtype=d))),
    ("factorial_comb_poch", lambda n, k: (special.factorial(n), special.comb(n, k), special.poch(n, k)),
     lambda n, k: (ss.factorial(n), ss.comb(n, k), ss.poch(n, k)), lambda d: (np.array([0, 3, 5, 7.5], d),
                                                                              np.array([0, 2, 5, 2.5], d))),
    ("i0_i0e", lambda x: (special.i0(x), special.i0e(x)), lambda x: (ss.i0(x), ss.i0e(x)), lambda d: (_grid(-20, 20, dtype=d),)),
    ("boxcox", lambda x, l: (special.boxcox(x, l), special.boxcox1p(x, l)), lambda x, l: (ss.boxcox(x, l), ss.boxcox1p(x, l)),
     lambda d: (_grid(0.5, 4, 5, d), np.array([0, 0.5, -1, 2, 0.1], d))),
    ("logsumexp", lambda a, b: (special.logsumexp(a), special.logsumexp(a, axis=0, b=b), *special.logsumexp(
        a, axis=1, b=b - 0.5, return_sign=True)), lambda a, b: (ss.logsumexp(a), ss.logsumexp(a, axis=0, b=b),
                                                                *ss.logsumexp(a, axis=1, b=b - 0.5, return_sign=True)),
     lambda d: (_grid(-3, 40, 12, d).reshape(3, 4), _grid(0.1, 1, 12, d).reshape(3, 4))),
    ("softmax", lambda x: (special.softmax(x), special.softmax(x, axis=1), special.log_softmax(x, axis=0)),
     lambda x: (ss.softmax(x), ss.softmax(x, axis=1), ss.log_softmax(x, axis=0)), lambda d: (_grid(-3, 3, 6, d).reshape(2, 3),)),
]


def _compare(got, want, dtype):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    rtol, atol = TOL[dtype]
    for g, w in zip(got, want):
        g = np.asarray(g)
        assert g.dtype == dtype, (g.dtype, dtype)
        w = np.asarray(w, F64)
        g = g.astype(F64)
        both_nan = np.isnan(g) & np.isnan(w)
        same_inf = np.isinf(w) & (g == w)
        ok = both_nan | same_inf | (np.abs(g - w) <= rtol * np.abs(w) + atol * (1 + np.abs(w)))
        assert ok.all(), f"mismatch at {np.flatnonzero(~ok)[:5]}: got {g[~ok][:5]}, want {w[~ok][:5]}"


@pytest.mark.parametrize("name,ours,theirs,inputs", SPECIAL, ids=[s[0] for s in SPECIAL])
def test_special_against_scipy(name, ours, theirs, inputs, device):
    for dtype in (F32, F64):
        xs = inputs(dtype)
        want = theirs(*[x.astype(F64) for x in xs])
        _compare(tx.jit(ours)(*xs), want, dtype)
        if device.kind == "ref":
            _compare(ours(*xs), want, dtype)


GRAD_SPECIAL = [
    ("gammaln", special.gammaln, lambda x: ss.digamma(x), _grid(-2.6, 12, 9)),
    ("digamma", special.digamma, lambda x: ss.polygamma(1, x), _grid(0.4, 12, 9)),
    ("erfinv", special.erfinv, lambda y: np.sqrt(np.pi) / 2 * np.exp(ss.erfinv(y) ** 2), _grid(-0.95, 0.95, 9)),
    ("erfc", special.erfc, lambda x: -2 / np.sqrt(np.pi) * np.exp(-x * x), _grid(-3, 6, 9)),
    ("log_ndtr", special.log_ndtr, lambda x: np.exp(st.norm.logpdf(x) - ss.log_ndtr(x)), _grid(-35, 5, 9)),
]


@pytest.mark.parametrize("name,fn,deriv,x", GRAD_SPECIAL, ids=[g[0] for g in GRAD_SPECIAL])
def test_special_derivatives_are_the_functions(name, fn, deriv, x, device):
    """The composed functions differentiate to the known derivatives (not just consistently)."""
    g = tx.vmap(tx.grad(fn))(x)
    np.testing.assert_allclose(np.asarray(g), deriv(x), rtol=1e-9, atol=1e-12)
    tx.check_grads(fn, (x,), order=1, modes=("fwd", "rev"))


def _x(d):
    return _grid(-2.5, 3.5, 7, d)


STATS = [
    ("norm", lambda x: (stats.norm.logpdf(x, 0.5, 2.0), stats.norm.pdf(x), stats.norm.cdf(x, 1.0, 0.5),
                        stats.norm.logcdf(x), stats.norm.sf(x), stats.norm.logsf(x, 0.2)),
     lambda x: (st.norm.logpdf(x, 0.5, 2.0), st.norm.pdf(x), st.norm.cdf(x, 1.0, 0.5), st.norm.logcdf(x),
                st.norm.sf(x), st.norm.logsf(x, 0.2))),
    ("norm_ppf", lambda x: (stats.norm.ppf(x / 4 + 0.5, 1.0, 2.0), stats.norm.isf(x / 4 + 0.5)),
     lambda x: (st.norm.ppf(x / 4 + 0.5, 1.0, 2.0), st.norm.isf(x / 4 + 0.5))),
    ("t", lambda x: (stats.t.logpdf(x, 3.5), stats.t.pdf(x, 5.0, 0.5, 2.0), stats.t.cdf(x, 2.5)),
     lambda x: (st.t.logpdf(x, 3.5), st.t.pdf(x, 5.0, 0.5, 2.0), st.t.cdf(x, 2.5))),
    ("gamma", lambda x: (stats.gamma.logpdf(x, 2.5), stats.gamma.pdf(x, 1.5, 0.1, 2.0), stats.gamma.cdf(x, 2.5),
                         stats.gamma.sf(x, 0.7)),
     lambda x: (st.gamma.logpdf(x, 2.5), st.gamma.pdf(x, 1.5, 0.1, 2.0), st.gamma.cdf(x, 2.5), st.gamma.sf(x, 0.7))),
    ("beta", lambda x: (stats.beta.logpdf(x / 4 + 0.5, 2.0, 3.0), stats.beta.pdf(x / 4 + 0.5, 0.5, 0.7),
                        stats.beta.cdf(x / 4 + 0.5, 2.0, 3.0), stats.beta.sf(x / 4 + 0.5, 1.5, 2.5)),
     lambda x: (st.beta.logpdf(x / 4 + 0.5, 2.0, 3.0), st.beta.pdf(x / 4 + 0.5, 0.5, 0.7), st.beta.cdf(x / 4 + 0.5, 2.0, 3.0),
                st.beta.sf(x / 4 + 0.5, 1.5, 2.5))),
    ("bernoulli", lambda x: (stats.bernoulli.logpmf((x // 1) % 2, 0.3), stats.bernoulli.pmf((x // 1) % 2, 0.6),
                             stats.bernoulli.cdf(x, 0.3), stats.bernoulli.ppf(x / 8 + 0.5, 0.3)),
     lambda x: (st.bernoulli.logpmf((x // 1) % 2, 0.3), st.bernoulli.pmf((x // 1) % 2, 0.6), st.bernoulli.cdf(x, 0.3),
                st.bernoulli.ppf(x / 8 + 0.5, 0.3))),
    ("poisson", lambda x: (stats.poisson.logpmf(np.floor(np.abs(x)) if isinstance(x, np.ndarray) else x, 2.5),
                           stats.poisson.cdf(x + 3.0, 1.5)),
     lambda x: (st.poisson.logpmf(np.floor(np.abs(x)), 2.5), st.poisson.cdf(x + 3.0, 1.5))),
    ("simple", lambda x: (stats.uniform.logpdf(x, -1.0, 3.0), stats.uniform.cdf(x, -1.0, 3.0), stats.expon.logpdf(x, 0.2),
                          stats.expon.cdf(x), stats.laplace.logpdf(x, 0.3, 2.0), stats.laplace.cdf(x),
                          stats.logistic.logpdf(x), stats.logistic.cdf(x, 0.5), stats.cauchy.logpdf(x, 0.1, 2.0),
                          stats.cauchy.cdf(x)),
     lambda x: (st.uniform.logpdf(x, -1.0, 3.0), st.uniform.cdf(x, -1.0, 3.0), st.expon.logpdf(x, 0.2), st.expon.cdf(x),
                st.laplace.logpdf(x, 0.3, 2.0), st.laplace.cdf(x), st.logistic.logpdf(x), st.logistic.cdf(x, 0.5),
                st.cauchy.logpdf(x, 0.1, 2.0), st.cauchy.cdf(x))),
]


@pytest.mark.parametrize("name,ours,theirs", STATS, ids=[s[0] for s in STATS])
def test_stats_against_scipy(name, ours, theirs, device):
    for dtype in (F32, F64):
        x = _x(dtype)
        if name == "poisson":
            x = np.floor(np.abs(x)).astype(dtype)
        want = theirs(x.astype(F64))
        _compare(tx.jit(ours)(x), tuple(np.asarray(w, F64) for w in want), dtype)


def test_multivariate_normal(device):
    rng = np.random.default_rng(3)
    a = rng.normal(size=(3, 3))
    cov = a @ a.T + np.eye(3)
    mean = rng.normal(size=3)
    x = rng.normal(size=(5, 3))
    want = st.multivariate_normal.logpdf(x, mean, cov)
    np.testing.assert_allclose(np.asarray(tx.jit(stats.multivariate_normal.logpdf)(x, mean, cov)), want, rtol=1e-10)
    np.testing.assert_allclose(np.asarray(stats.multivariate_normal.pdf(x[0], mean, cov)),
                               st.multivariate_normal.pdf(x[0], mean, cov), rtol=1e-10)
    np.testing.assert_allclose(np.asarray(stats.multivariate_normal.logpdf(x, mean, np.diag(cov))),
                               st.multivariate_normal.logpdf(x, mean, np.diag(np.diag(cov))), rtol=1e-10)
    tx.check_grads(lambda m, c: stats.multivariate_normal.logpdf(x, m, c @ c.T + np.eye(3)), (mean, a),
                   order=1, modes=("rev",))


def test_stats_gradients(device):
    x = _x(F64)
    tx.check_grads(lambda loc, s: stats.norm.logpdf(x, loc, s) + stats.norm.logcdf(x, loc, s),
                   (np.float64(0.3), np.float64(1.7)), order=1, modes=("fwd", "rev"))
    tx.check_grads(lambda df: stats.t.logpdf(x, df), (np.float64(3.5),), order=1, modes=("rev",))
    tx.check_grads(lambda a: stats.gamma.logpdf(np.abs(x) + 0.1, a) + stats.beta.logpdf(x / 8 + 0.5, a, 2.0),
                   (np.float64(2.5),), order=1, modes=("rev",))


def test_coverage_of_required_names():
    required_special = {"logsumexp", "erf", "erfc", "erfinv", "gammaln", "digamma", "expit", "logit", "xlogy", "softmax"}
    assert required_special <= set(special.__all__)
    for dist in ("norm", "multivariate_normal", "bernoulli", "beta", "gamma", "t"):
        assert hasattr(stats, dist)


@pytest.mark.parametrize("name, fn, args", [
    ("gammainc", special.gammainc, (np.float64(2.5), np.float64(1.5))),
    ("betainc", special.betainc, (np.float64(2.0), np.float64(3.0), np.float64(0.4))),
    ("erfc", special.erfc, (np.float64(3.0),)),
])
def test_series_and_continued_fractions_are_loops_and_differentiate(name, fn, args, device):
    """Their terms run as lax loops (the graph holds scans whose bodies are one term, however
    many terms there are; unrolled, 20-80 terms were kernels PoCL took tens of seconds to compile),
    and reverse mode through that loop agrees with finite differences in the last argument."""
    graph = tx.make_graph(fn)(*args)
    loops = [e for e in graph.eqns if e.prim.name == "scan"]
    assert loops and all(len(e.params["body"].eqns) < 40 for e in loops), (name, len(graph.eqns))
    tx.check_grads(lambda x: fn(*args[:-1], x), (args[-1],), order=1, modes=("rev",))
