"""The Laplace distribution."""

import math

import tilefuse.numpy as tnp

from ._common import standardize


def logpdf(x, loc=0.0, scale=1.0):
    z, scale = standardize(x, loc, scale)
    return -tnp.abs(z) - tnp.log(scale) - math.log(2.0)


def pdf(x, loc=0.0, scale=1.0):
    return tnp.exp(logpdf(x, loc, scale))


def cdf(x, loc=0.0, scale=1.0):
    z, _ = standardize(x, loc, scale)
    return tnp.where(z < 0, 0.5 * tnp.exp(z), 1.0 - 0.5 * tnp.exp(-z))
