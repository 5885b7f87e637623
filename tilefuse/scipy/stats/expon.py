"""The exponential distribution."""

import tilefuse.numpy as tnp

from ._common import standardize


def logpdf(x, loc=0.0, scale=1.0):
    z, scale = standardize(x, loc, scale)
    return tnp.where(z >= 0, -z - tnp.log(scale), tnp.full_like(z, -tnp.inf))


def pdf(x, loc=0.0, scale=1.0):
    return tnp.exp(logpdf(x, loc, scale))


def cdf(x, loc=0.0, scale=1.0):
    z, _ = standardize(x, loc, scale)
    return tnp.where(z >= 0, -tnp.expm1(-z), tnp.zeros_like(z))
