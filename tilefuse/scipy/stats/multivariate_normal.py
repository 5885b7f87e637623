"""The multivariate normal distribution (a full covariance matrix, through its Cholesky factor)."""

import math

import tilefuse.numpy as tnp
from tilefuse.numpy import linalg


def logpdf(x, mean, cov, allow_singular=None):
    x, mean, cov = tnp._promote(x, mean, cov, to_float=True)
    if tnp.ndim(cov) == 0 or tnp.ndim(cov) == 1:  # a scalar variance or a diagonal
        var = tnp.broadcast_to(cov, tnp.shape(mean)[-1:]) if tnp.ndim(mean) else cov
        d = x - mean
        n = tnp.shape(d)[-1] if tnp.ndim(d) else 1
        return (
            -0.5 * tnp.sum(d * d / var, axis=-1)
            - 0.5 * tnp.sum(tnp.log(var + tnp.zeros_like(d)), axis=-1)
            - 0.5 * n * math.log(2 * math.pi)
        )
    n = tnp.shape(cov)[-1]
    L = linalg.cholesky(cov)
    d = x - mean
    y = linalg.solve_triangular(
        L, tnp.swapaxes(d[..., None, :], -1, -2) if tnp.ndim(d) == 1 else d.T, lower=True
    )
    maha = tnp.sum(y * y, axis=0) if tnp.ndim(d) > 1 else tnp.sum(y * y)
    logdet = 2 * tnp.sum(tnp.log(tnp.diagonal(L, axis1=-2, axis2=-1)), axis=-1)
    return -0.5 * (maha + logdet + n * math.log(2 * math.pi))


def pdf(x, mean, cov):
    return tnp.exp(logpdf(x, mean, cov))
