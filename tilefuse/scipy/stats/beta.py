"""The beta distribution."""

import tilefuse.numpy as tnp
from tilefuse.scipy import special

from ._common import promote, standardize


def logpdf(x, a, b, loc=0.0, scale=1.0):
    z, scale = standardize(x, loc, scale)
    z, a, b = promote(z, a, b)
    inside = (z > 0) & (z < 1)
    zs = tnp.where(inside, z, tnp.full_like(z, 0.5))
    val = special.xlogy(a - 1.0, zs) + special.xlog1py(b - 1.0, -zs) - special.betaln(a, b) - tnp.log(scale)
    return tnp.where(inside, val, tnp.full_like(val, -tnp.inf))


def pdf(x, a, b, loc=0.0, scale=1.0):
    return tnp.exp(logpdf(x, a, b, loc, scale))


def cdf(x, a, b, loc=0.0, scale=1.0):
    z, _ = standardize(x, loc, scale)
    return special.betainc(a, b, tnp.clip(z, 0.0, 1.0))


def sf(x, a, b, loc=0.0, scale=1.0):
    return 1.0 - cdf(x, a, b, loc, scale)
