"""Comparing a device's result with the reference: per-dtype tolerances, the largest error, and
the assertion the test suite uses (tests/conftest.py imports it from here)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing a backend with the numpy reference in this dtype."""
    d = np.dtype(dtype)
    if d == np.float64:
        return 1e-10, 1e-12
    if d.name == "bfloat16":
        return 2e-2, 2e-2
    if d == np.float16:
        return 5e-3, 5e-3
    if d == np.float32:
        return 2e-5, 1e-6
    return 0, 0


def tolerance_for(table: dict, dtype) -> tuple:
    """(rtol, atol) a record's per-dtype table gives `dtype` (keys: dtypes or scalar types, as
    np.float32 or ml_dtypes.bfloat16), (None, None) where it gives none."""
    want = np.dtype(dtype)
    return next((v for k, v in table.items() if np.dtype(k) == want), (None, None))


@dataclass
class Comparison:
    """One result against its reference, in `dtype`; rtol/atol None: tolerance(dtype)."""
    label: str
    actual: object
    expected: object
    dtype: object = None
    rtol: float | None = None
    atol: float | None = None


def _prepare(actual, expected, dtype, rtol, atol):
    actual, expected = np.asarray(actual), np.asarray(expected)
    d = np.dtype(dtype) if dtype is not None else actual.dtype
    r, a = tolerance(d)
    return actual, expected, d, r if rtol is None else rtol, a if atol is None else atol


def max_error(actual, expected) -> float:
    """The largest |actual - expected| (NaNs in the same places agree; a NaN, or an infinity,
    that the other side lacks is an infinite error)."""
    a, e = np.asarray(actual).astype(np.float64), np.asarray(expected).astype(np.float64)
    if a.shape != e.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    both_nan = np.isnan(a) & np.isnan(e)
    same_inf = np.isinf(a) & (a == e)
    diff = np.where(both_nan | same_inf, 0.0, np.abs(a - e))
    return float(np.nan_to_num(diff, nan=np.inf).max())


def agrees(c: Comparison) -> tuple[bool, float]:
    """(within tolerance, max error) of one comparison."""
    actual, expected, d, rtol, atol = _prepare(c.actual, c.expected, c.dtype, c.rtol, c.atol)
    err = max_error(actual, expected)
    if actual.shape != expected.shape:
        return False, err
    if d.kind in "biu":
        return bool(np.array_equal(actual, expected)), err
    ok = np.allclose(actual.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol,
                     equal_nan=True)
    return bool(ok), err


def assert_close(actual, expected, dtype=None, rtol=None, atol=None):
    """Raise AssertionError (numpy's message, naming the mismatches) unless actual ≈ expected."""
    actual, expected, d, rtol, atol = _prepare(actual, expected, dtype, rtol, atol)
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    if d.kind in "biu" or d == np.bool_:
        np.testing.assert_array_equal(actual, expected)
    else:
        np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64),
                                   rtol=rtol, atol=atol, equal_nan=True)
