"""The Poisson distribution."""

import tilefuse.numpy as tnp
from tilefuse.scipy import special

from ._common import promote


def logpmf(k, mu, loc=0):
    k, mu = promote(k - loc, mu)
    ok = (k >= 0) & (k == tnp.floor(k))
    val = special.xlogy(k, mu) - mu - special.gammaln(tnp.where(ok, k, tnp.zeros_like(k)) + 1.0)
    return tnp.where(ok, val, tnp.full_like(val, -tnp.inf))


def pmf(k, mu, loc=0):
    return tnp.exp(logpmf(k, mu, loc))


def cdf(k, mu, loc=0):
    k, mu = promote(k - loc, mu)
    kf = tnp.floor(k)
    return tnp.where(k < 0, tnp.zeros_like(k), special.gammaincc(kf + 1.0, mu))
