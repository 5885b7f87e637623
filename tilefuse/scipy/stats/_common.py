"""Shared pieces of the distributions: standardising by loc and scale, promoting arguments."""

from __future__ import annotations

import numpy as np

import tilefuse.numpy as tnp


def promote(*xs):
    return tnp._broadcast_all(*tnp._promote(*xs, to_float=True))


def standardize(x, loc, scale):
    x, loc, scale = promote(x, loc, scale)
    return (x - loc) / scale, scale


def nan_where(cond, x):
    return tnp.where(cond, tnp.full_like(x, np.nan), x)
