"""Dtypes and type promotion: numpy's kinds on JAX's lattice, with weak Python scalars."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .errors import DTypeError

float16 = np.dtype(np.float16)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)
int32 = np.dtype(np.int32)
int64 = np.dtype(np.int64)
uint32 = np.dtype(np.uint32)  # internal: the PRNG's counters
bool_ = np.dtype(np.bool_)

SUPPORTED = (bool_, int32, int64, uint32, float16, bfloat16, float32, float64)
FLOATS = (float16, bfloat16, float32, float64)
INTS = (int32, int64, uint32)
DEFAULT_FLOAT, DEFAULT_INT = float32, int32

_NAMES = {"float16": float16, "half": float16, "bfloat16": bfloat16, "float32": float32,
          "float": float32, "float64": float64, "double": float64, "int32": int32,
          "int64": int64, "int": int32, "uint32": uint32, "bool": bool_}


def canonicalize(dtype) -> np.dtype:
    """Turn anything dtype-like (np types, strings, Python types) into a supported np.dtype."""
    if dtype is float:
        return DEFAULT_FLOAT
    if dtype is int:
        return DEFAULT_INT
    if dtype is bool:
        return bool_
    if isinstance(dtype, str) and dtype in _NAMES:
        return _NAMES[dtype]
    try:
        d = np.dtype(dtype)
    except TypeError as e:
        raise DTypeError(f"tilefuse does not understand the dtype {dtype!r}") from e
    if d in SUPPORTED:
        return d
    narrow = {np.dtype(np.int8): int32, np.dtype(np.int16): int32, np.dtype(np.uint8): int32,
              np.dtype(np.uint16): int32, np.dtype(np.uint64): int64}
    if d in narrow:
        return narrow[d]
    raise DTypeError(f"tilefuse does not support the dtype {d}; supported: "
                     + ", ".join(str(s) for s in SUPPORTED))


def is_float(dtype) -> bool:
    return np.dtype(dtype) in FLOATS


def is_int(dtype) -> bool:
    return np.dtype(dtype) in INTS


def is_bool(dtype) -> bool:
    return np.dtype(dtype) == bool_


def kind_rank(dtype) -> int:
    return 0 if is_bool(dtype) else 1 if is_int(dtype) else 2


def _join(a: np.dtype, b: np.dtype) -> np.dtype:
    if a == b:
        return a
    ka, kb = kind_rank(a), kind_rank(b)
    if ka != kb:
        return a if ka > kb else b
    if ka == 1:  # ints: the wider; uint32 with a signed int needs int64
        return int64 if int64 in (a, b) or uint32 in (a, b) else int32
    # floats: f16 and bf16 meet at f32; anything meets f64 at f64
    return float64 if float64 in (a, b) else float32


def result_type(*operands: tuple[np.dtype, bool]) -> tuple[np.dtype, bool]:
    """Promote (dtype, weak) pairs; returns (dtype, weak). Weak types come from Python scalars."""
    strong = [d for d, w in operands if not w]
    weak = [d for d, w in operands if w]
    if not strong:
        rank = max(kind_rank(d) for d in weak)
        return (bool_, DEFAULT_INT, DEFAULT_FLOAT)[rank], True
    out = strong[0]
    for d in strong[1:]:
        out = _join(out, d)
    if weak:
        wrank = max(kind_rank(d) for d in weak)
        if wrank > kind_rank(out):
            out = (bool_, DEFAULT_INT, DEFAULT_FLOAT)[wrank]
    return out, False


def python_scalar_dtype(x) -> np.dtype:
    if isinstance(x, bool):
        return bool_
    if isinstance(x, int):
        if not -2**31 <= x < 2**31:  # numpy would raise OverflowError, or wrap it silently
            raise DTypeError(f"the Python int {x} does not fit int32 (Python ints become int32): "
                             "pass np.int64(...) or an int64 array")
        return DEFAULT_INT
    if isinstance(x, float):
        return DEFAULT_FLOAT
    raise DTypeError(f"not a Python scalar: {x!r}")


def finfo(dtype):
    return ml_dtypes.finfo(dtype) if np.dtype(dtype) == bfloat16 else np.finfo(dtype)


def compute_dtype(dtype) -> np.dtype:
    """The dtype arithmetic runs in: 16-bit floats are stored narrow and computed in float32."""
    d = np.dtype(dtype)
    return float32 if d in (float16, bfloat16) else d
