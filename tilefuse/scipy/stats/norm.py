"""The normal distribution."""

import math

import tilefuse.numpy as tnp
from tilefuse.scipy import special

from ._common import standardize


def logpdf(x, loc=0.0, scale=1.0):
    z, scale = standardize(x, loc, scale)
    return -0.5 * z * z - tnp.log(scale) - 0.5 * math.log(2 * math.pi)


def pdf(x, loc=0.0, scale=1.0):
    return tnp.exp(logpdf(x, loc, scale))


def cdf(x, loc=0.0, scale=1.0):
    z, _ = standardize(x, loc, scale)
    return special.ndtr(z)


def logcdf(x, loc=0.0, scale=1.0):
    z, _ = standardize(x, loc, scale)
    return special.log_ndtr(z)


def sf(x, loc=0.0, scale=1.0):
    z, _ = standardize(x, loc, scale)
    return special.ndtr(-z)


def logsf(x, loc=0.0, scale=1.0):
    z, _ = standardize(x, loc, scale)
    return special.log_ndtr(-z)


def ppf(q, loc=0.0, scale=1.0):
    return special.ndtri(q) * scale + loc


def isf(q, loc=0.0, scale=1.0):
    return -special.ndtri(q) * scale + loc
