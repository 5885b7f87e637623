"""LLVM IR building blocks shared by the renderer and the GEMM and attention templates."""
from __future__ import annotations

from llvmlite import ir

I64 = ir.IntType(64)


def counted_loop(b: ir.IRBuilder, lo, hi, body, *, step=1, name: str = "i", carried=(), flags=()):
    """for (i = lo; i < hi; i += step) carried = body(i, carried), in the form LLVM's loop passes
    recognise (a header phi and one latch). Returns (the carried values after the loop, the latch
    branch, for loop metadata). `step` is an int or an i64 value; `flags` go on the increment."""
    pre = b.block
    head = b.append_basic_block(name + ".head")
    inner = b.append_basic_block(name + ".body")
    done = b.append_basic_block(name + ".done")
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(I64, name=name)
    i.add_incoming(lo, pre)
    phis = []
    for c in carried:
        p = b.phi(c.type)
        p.add_incoming(c, pre)
        phis.append(p)
    b.cbranch(b.icmp_signed("<", i, hi), inner, done)
    b.position_at_end(inner)
    new = body(i, phis) or ()
    end = b.block
    i.add_incoming(b.add(i, ir.Constant(I64, step) if isinstance(step, int) else step, flags=flags), end)
    for p, v in zip(phis, new):
        p.add_incoming(v, end)
    latch = b.branch(head)
    b.position_at_end(done)
    return phis, latch


def no_unroll(latch) -> None:
    """Loop metadata on a loop's latch branch: LLVM leaves the loop rolled. For loops whose trip
    count is a run-time size: unrolling them makes remainder loops that cost compile time (up to
    half again of a GEMM's) and no measured speed. The node refers to itself (LLVM's loop ID) and
    is the loop's own."""
    m = latch.function.module
    node = m.add_metadata([ir.MetaDataString(m, f"tilefuse.loop.{len(m.metadata)}")])
    node.operands = (node, m.add_metadata([ir.MetaDataString(m, "llvm.loop.unroll.disable")]))
    latch.set_metadata("llvm.loop", node)


def splat(ty, value):
    """A constant of type `ty`, the same value in every lane when `ty` is a vector."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [ir.Constant(ty.element, value)] * ty.count)
    return ir.Constant(ty, value)


def _like(v, elem):
    """`elem`, or a vector of it with as many lanes as `v`'s type."""
    return ir.VectorType(elem, v.type.count) if isinstance(v.type, ir.VectorType) else elem


def bf16_to_f32(b: ir.IRBuilder, v):
    """bfloat16 bits (i16, scalar or vector) to float32: the bits are float32's upper half."""
    i32 = _like(v, ir.IntType(32))
    return b.bitcast(b.shl(b.zext(v, i32), splat(i32, 16)), _like(v, ir.FloatType()))


def f32_to_bf16(b: ir.IRBuilder, v):
    """float32 (scalar or vector) to bfloat16 bits: round to nearest even; NaN stays a quiet NaN."""
    i32 = _like(v, ir.IntType(32))
    bits = b.bitcast(v, i32)
    lsb = b.and_(b.lshr(bits, splat(i32, 16)), splat(i32, 1))
    rounded = b.lshr(b.add(bits, b.add(lsb, splat(i32, 0x7FFF))), splat(i32, 16))
    nan = b.or_(b.lshr(bits, splat(i32, 16)), splat(i32, 0x40))
    return b.trunc(b.select(b.fcmp_unordered("uno", v, v), nan, rounded), _like(v, ir.IntType(16)))
