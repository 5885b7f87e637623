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
