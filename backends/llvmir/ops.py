"""The kernel IR's elementwise operations as LLVM IR (llvmlite), for the tile printers
(tile.py; backends/cuda/tile.py): register and memory types of each dtype, numpy's conversions,
constants, and the unary and binary op tables, over scalars or vectors alike. 16-bit floats
compute in float32 (the printer converts around each op, as ir/kernel/lower.py says)."""
from __future__ import annotations

import math

import llvmlite.ir as ir
import ml_dtypes
import numpy as np

from . import vecmath
from .irutil import _like, bf16_to_f32, f32_to_bf16, splat
from .vecmath import F32, F64, I32, I64, Emit

I1, I8, I16 = ir.IntType(1), ir.IntType(8), ir.IntType(16)
HALF = ir.HalfType()
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
BOOL = np.dtype(np.bool_)
UINT32, UINT64 = np.dtype(np.uint32), np.dtype(np.uint64)
# register type and memory type of each dtype (bfloat16 is kept as its 16 bits)
TYPES = {np.dtype(np.bool_): (I1, I8), np.dtype(np.int32): (I32, I32), UINT32: (I32, I32),
         np.dtype(np.int64): (I64, I64), UINT64: (I64, I64), F16: (HALF, HALF), BF16: (I16, I16),
         np.dtype(np.float32): (F32, F32), np.dtype(np.float64): (F64, F64),
         # 8/16-bit ints: loaded and stored narrow, computed in int32 (ir/kernel/lower.py wraps them)
         np.dtype(np.int8): (I8, I8), np.dtype(np.uint8): (I8, I8), np.dtype(np.int16): (I16, I16),
         np.dtype(np.uint16): (I16, I16)}
CONTRACT = ("contract",)  # lets LLVM fuse a*b+c into an FMA: ≤ 0.5 ulp from numpy per pair


def is_float(d) -> bool:
    return np.dtype(d) in (F16, BF16, np.dtype(np.float32), np.dtype(np.float64))


def is_16(d) -> bool:
    return np.dtype(d) in (F16, BF16)


def is_unsigned(d) -> bool:
    return np.dtype(d) == BOOL or np.dtype(d).kind == "u"


def convert(b: ir.IRBuilder, v, src, dst):
    """v (a scalar or a vector) from dtype src to dst, as numpy's astype."""
    src, dst = np.dtype(src), np.dtype(dst)
    if src == dst:
        return v
    f32 = np.dtype(np.float32)
    like = lambda t: _like(v, t)  # noqa: E731
    if is_16(src):  # widen to float32 first
        v = bf16_to_f32(b, v) if src == BF16 else b.fpext(v, like(F32))
        return convert(b, v, f32, dst)
    if is_16(dst):  # narrow from float32 (float64 and ints go through float32)
        if src != f32:
            v, src = convert(b, v, src, f32), f32
        if dst == F16:
            return b.fptrunc(v, like(HALF))
        return f32_to_bf16(b, v)
    rt = like(TYPES[dst][0])
    if dst == BOOL:
        zero = splat(v.type, 0)
        return b.fcmp_unordered("!=", v, zero) if is_float(src) else b.icmp_unsigned("!=", v, zero)
    if is_float(dst):
        if is_float(src):
            return b.fpext(v, rt) if TYPES[dst][0] == F64 else b.fptrunc(v, rt)
        return (b.uitofp if is_unsigned(src) or src == BOOL else b.sitofp)(v, rt)
    if is_float(src):  # float → int truncates (C); uint32 wraps like numpy via int64
        if dst == UINT32:
            return b.trunc(b.fptosi(v, like(I64)), rt)
        if dst == UINT64:  # 2**63 and up need fptoui; negatives wrap as numpy's (through int64)
            big = b.fcmp_ordered(">=", v, splat(v.type, 2.0 ** 63))
            return b.select(big, b.fptoui(v, rt), b.fptosi(v, rt))
        return b.fptosi(v, rt)
    w, rw = TYPES[src][0].width, TYPES[dst][0].width
    if w == rw:
        return v
    if w > rw:
        return b.trunc(v, rt)
    return (b.zext if is_unsigned(src) or src == BOOL else b.sext)(v, rt)


CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def _constant(value, dtype):
    d = np.dtype(dtype)
    rt = TYPES[d][0]
    if d == BOOL:
        return ir.Constant(I1, int(bool(value)))
    if d == BF16:
        return ir.Constant(I16, _bf16_bits(value))
    if is_float(d):
        return ir.Constant(rt, float(value))
    return ir.Constant(rt, int(value) & ((1 << rt.width) - 1))


def _bf16_bits(value) -> int:
    return int(np.array(value, BF16).view(np.uint16))


# ---- operation tables --------------------------------------------------------------------------

def _int_div(r: "Ops", kind, x, y, rem=False):
    """C division (truncating) guarded like the numpy reference: x/0 = 0, x%0 = x, and
    INT_MIN/-1 wraps (LLVM would trap)."""
    b, c = r.b, (lambda v: splat(x.type, v))
    zero = b.icmp_signed("==", y, c(0))
    if kind == "u":
        safe = b.select(zero, c(1), y)
        q = b.urem(x, safe) if rem else b.udiv(x, safe)
        return b.select(zero, x if rem else c(0), q)
    m1 = b.icmp_signed("==", y, c(-1))
    safe = b.select(b.or_(zero, m1), c(1), y)
    q = b.srem(x, safe) if rem else b.sdiv(x, safe)
    q = b.select(m1, c(0) if rem else b.sub(c(0), x), q)
    return b.select(zero, x if rem else c(0), q)


def _shift(r: "Ops", kind, x, y, left):
    """Shifts by ≥ the width (or negative amounts) give 0, as numpy's."""
    b = r.b
    elem = x.type.element if isinstance(x.type, ir.VectorType) else x.type
    big = b.icmp_unsigned(">=", y, splat(x.type, elem.width))
    s = b.shl(x, y) if left else b.lshr(x, y)
    return b.select(big, splat(x.type, 0), s)


def _minmax(r: "Ops", kind, x, y, which):
    if kind == "f":  # NaN propagates, as np.maximum/np.minimum
        return r.em.intrinsic("maximum" if which == "max" else "minimum", x.type, [x, y])
    if kind == "b":
        return r.b.or_(x, y) if which == "max" else r.b.and_(x, y)
    return r.em.intrinsic(("u" if kind == "u" else "s") + which, x.type, [x, y])


BINARY_OPS = {
    "add": lambda r, k, x, y: r.b.fadd(x, y, flags=CONTRACT) if k == "f" else r.b.or_(x, y) if k == "b"
    else r.b.add(x, y),
    "sub": lambda r, k, x, y: r.b.fsub(x, y, flags=CONTRACT) if k == "f" else r.b.sub(x, y),
    "mul": lambda r, k, x, y: r.b.fmul(x, y, flags=CONTRACT) if k == "f" else r.b.and_(x, y) if k == "b"
    else r.b.mul(x, y),
    "div": lambda r, k, x, y: r.b.fdiv(x, y) if k == "f" else _int_div(r, k, x, y),
    "rem": lambda r, k, x, y: r.b.frem(x, y) if k == "f" else _int_div(r, k, x, y, rem=True),
    "pow": lambda r, k, x, y: vecmath.binary_pow(r.em, x, y),
    "max": lambda r, k, x, y: _minmax(r, k, x, y, "max"),
    "min": lambda r, k, x, y: _minmax(r, k, x, y, "min"),
    "and": lambda r, k, x, y: r.b.and_(x, y),
    "or": lambda r, k, x, y: r.b.or_(x, y),
    "xor": lambda r, k, x, y: r.b.xor(x, y),
    "shift_left": lambda r, k, x, y: _shift(r, k, x, y, True),
    "shift_right_logical": lambda r, k, x, y: _shift(r, k, x, y, False),
}


def _sign(r: "Ops", d, x):
    b = r.b
    c = (lambda v: splat(x.type, v))
    if is_float(d):  # ±0 and NaN give themselves
        return b.select(b.fcmp_ordered(">", x, c(0.0)), c(1.0),
                        b.select(b.fcmp_ordered("<", x, c(0.0)), c(-1.0), x))
    pos = b.zext(b.icmp_unsigned(">", x, c(0)) if is_unsigned(d) else b.icmp_signed(">", x, c(0)), x.type)
    if is_unsigned(d):
        return pos
    return b.sub(pos, b.zext(b.icmp_signed("<", x, c(0)), x.type))


def _abs(r: "Ops", d, x):
    if is_float(d):
        return r.em.fabs(x)
    if is_unsigned(d):
        return x
    neg = r.b.icmp_signed("<", x, splat(x.type, 0))
    return r.b.select(neg, r.b.sub(splat(x.type, 0), x), x)


UNARY_OPS = {
    "neg": lambda r, d, x: r.b.fneg(x) if is_float(d) else r.b.sub(splat(x.type, 0), x),
    "sqrt": lambda r, d, x: r.em.intrinsic("sqrt", x.type, [x]),
    "rsqrt": lambda r, d, x: r.b.fdiv(splat(x.type, 1.0), r.em.intrinsic("sqrt", x.type, [x])),
    "abs": _abs,
    "sign": _sign,
    "floor": lambda r, d, x: r.em.intrinsic("floor", x.type, [x]),
    "ceil": lambda r, d, x: r.em.intrinsic("ceil", x.type, [x]),
    "round": lambda r, d, x: r.em.intrinsic("roundeven", x.type, [x]),  # half to even, as numpy
    "not": lambda r, d, x: r.b.not_(x),
    "is_finite": lambda r, d, x: r.b.fcmp_ordered("<", r.em.fabs(x), splat(x.type, math.inf)),
    **{op: (lambda op: lambda r, d, x: vecmath.unary(r.em, op, x))(op) for op in vecmath.LIBM},
    "logistic": lambda r, d, x: vecmath.unary(r.em, "logistic", x),
}


class Ops:
    """What the op tables need of a renderer: a builder and its math emitter."""

    def __init__(self, b: ir.IRBuilder):
        self.b, self.em = b, Emit(b)
