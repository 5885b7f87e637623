"""The uniform distribution on [loc, loc + scale]."""

import tilefuse.numpy as tnp

from ._common import standardize


def logpdf(x, loc=0.0, scale=1.0):
    z, scale = standardize(x, loc, scale)
    inside = (z >= 0) & (z <= 1)
    return tnp.where(inside, -tnp.log(scale), tnp.full_like(z, -tnp.inf))


def pdf(x, loc=0.0, scale=1.0):
    return tnp.exp(logpdf(x, loc, scale))


def cdf(x, loc=0.0, scale=1.0):
    z, _ = standardize(x, loc, scale)
    return tnp.clip(z, 0.0, 1.0)
