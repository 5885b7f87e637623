"""The Cauchy distribution."""

import math

import tilefuse.numpy as tnp

from ._common import standardize


def logpdf(x, loc=0.0, scale=1.0):
    z, scale = standardize(x, loc, scale)
    return -math.log(math.pi) - tnp.log(scale) - tnp.log1p(z * z)


def pdf(x, loc=0.0, scale=1.0):
    return tnp.exp(logpdf(x, loc, scale))


def cdf(x, loc=0.0, scale=1.0):
    z, _ = standardize(x, loc, scale)
    return 0.5 + tnp.arctan(z) / math.pi
