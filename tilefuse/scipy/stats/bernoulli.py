"""The Bernoulli distribution."""

import tilefuse.numpy as tnp
from tilefuse.scipy import special

from ._common import promote


def logpmf(k, p, loc=0):
    k, p = promote(k - loc, p)
    ok = (k == 0) | (k == 1)
    val = special.xlogy(k, p) + special.xlog1py(1.0 - k, -p)
    return tnp.where(ok, val, tnp.full_like(val, -tnp.inf))


def pmf(k, p, loc=0):
    return tnp.exp(logpmf(k, p, loc))


def cdf(k, p):
    k, p = promote(k, p)
    return tnp.where(k < 0, tnp.zeros_like(k), tnp.where(k >= 1, tnp.ones_like(k), 1.0 - p))


def ppf(q, p):
    q, p = promote(q, p)
    return tnp.where(q <= 1.0 - p, tnp.zeros_like(q), tnp.ones_like(q))
