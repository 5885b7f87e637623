"""The logistic distribution."""

import tilefuse.numpy as tnp

from ._common import standardize


def logpdf(x, loc=0.0, scale=1.0):
    z, scale = standardize(x, loc, scale)
    return -z - 2.0 * tnp.logaddexp(0.0, -z) - tnp.log(scale)


def pdf(x, loc=0.0, scale=1.0):
    return tnp.exp(logpdf(x, loc, scale))


def cdf(x, loc=0.0, scale=1.0):
    z, _ = standardize(x, loc, scale)
    return tnp.sigmoid(z)
