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
uint32 = np.dtype(np.uint32)
uint64 = np.dtype(np.uint64)
bool_ = np.dtype(np.bool_)
int8, int16 = np.dtype(np.int8), np.dtype(np.int16)
uint8, uint16 = np.dtype(np.uint8), np.dtype(np.uint16)
# 8- and 16-bit integers are stored narrow and computed in int32, wrapped back to their width
# after every operation that can leave it (as 16-bit floats are computed in float32)
NARROW_INTS = (int8, int16, uint8, uint16)

SUPPORTED = (bool_, int8, int16, int32, int64, uint8, uint16, uint32, uint64, float16, bfloat16, float32, float64)
FLOATS = (float16, bfloat16, float32, float64)
INTS = (int8, int16, int32, int64, uint8, uint16, uint32, uint64)
DEFAULT_FLOAT, DEFAULT_INT = float32, int32

_NAMES = {"float16": float16, "half": float16, "bfloat16": bfloat16, "float32": float32,
          "float": float32, "float64": float64, "double": float64, "int32": int32,
          "int64": int64, "int": int32, "uint32": uint32, "uint64": uint64, "bool": bool_, "int8": int8, "int16": int16,
          "uint8": uint8, "uint16": uint16}


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
    if d.kind == "c":
        raise DTypeError(f"tilefuse does not support the dtype {d}: it has no complex dtypes (keep real "
                         "and imaginary parts as two float arrays)")
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
    if ka == 1:  # ints on JAX's lattice: the wider of one signedness; signed with unsigned: the
        # smallest signed int holding both (uint8 + int8: int16, uint32 + int32: int64); no signed
        # int holds uint64, so uint64 with a signed int meets at JAX's f* (float64, as x64 JAX)
        sa, sb = a.kind == "i", b.kind == "i"
        if sa == sb:
            return a if a.itemsize >= b.itemsize else b
        s, u = (a, b) if sa else (b, a)
        return float64 if u == uint64 else np.dtype(f"int{8 * max(s.itemsize, 2 * u.itemsize)}")
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
    d = np.dtype(dtype)
    return ml_dtypes.finfo(d) if d == bfloat16 else np.finfo(d)


def compute_dtype(dtype) -> np.dtype:
    """The dtype arithmetic runs in: 16-bit floats are stored narrow and computed in float32,
    8- and 16-bit ints in int32."""
    d = np.dtype(dtype)
    return float32 if d in (float16, bfloat16) else int32 if d in NARROW_INTS else d


def sum_dtype(dtype) -> np.dtype:
    """The dtype sums and products of `dtype` accumulate in (JAX's): bool and narrow ints widen
    to int32 (uint8/uint16 to uint32)."""
    d = np.dtype(dtype)
    if d == bool_ or d in (int8, int16):
        return int32
    return uint32 if d in (uint8, uint16) else d
