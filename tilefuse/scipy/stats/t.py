"""Student's t distribution."""

import math

import tilefuse.numpy as tnp
from tilefuse.scipy import special

from ._common import promote, standardize


def logpdf(x, df, loc=0.0, scale=1.0):
    z, scale = standardize(x, loc, scale)
    z, df = promote(z, df)
    return (
        special.gammaln((df + 1.0) * 0.5)
        - special.gammaln(df * 0.5)
        - 0.5 * tnp.log(df * math.pi)
        - (df + 1.0) * 0.5 * tnp.log1p(z * z / df)
        - tnp.log(scale)
    )


def pdf(x, df, loc=0.0, scale=1.0):
    return tnp.exp(logpdf(x, df, loc, scale))


def cdf(x, df, loc=0.0, scale=1.0):
    z, _ = standardize(x, loc, scale)
    z, df = promote(z, df)
    tail = 0.5 * special.betainc(df * 0.5, tnp.full_like(z, 0.5), df / (df + z * z))
    return tnp.where(z < 0, tail, 1.0 - tail)
