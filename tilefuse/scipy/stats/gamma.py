"""The gamma distribution (shape a)."""

import tilefuse.numpy as tnp
from tilefuse.scipy import special

from ._common import promote, standardize


def logpdf(x, a, loc=0.0, scale=1.0):
    z, scale = standardize(x, loc, scale)
    z, a = promote(z, a)
    pos = z > 0
    zs = tnp.where(pos, z, tnp.ones_like(z))
    val = special.xlogy(a - 1.0, zs) - zs - special.gammaln(a) - tnp.log(scale)
    return tnp.where(pos, val, tnp.full_like(val, -tnp.inf))


def pdf(x, a, loc=0.0, scale=1.0):
    return tnp.exp(logpdf(x, a, loc, scale))


def cdf(x, a, loc=0.0, scale=1.0):
    z, _ = standardize(x, loc, scale)
    return special.gammainc(a, tnp.maximum(z, 0.0))


def sf(x, a, loc=0.0, scale=1.0):
    z, _ = standardize(x, loc, scale)
    return special.gammaincc(a, tnp.maximum(z, 0.0))
