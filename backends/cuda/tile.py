"""Tile kernels (ir/kernel/tile.py) as NVPTX kernels: the shared LLVM tile printer
(backends/llvmir/tile.py) with what differs on a GPU. The grid Ranges are the blocks
(blockIdx.x, flattened, the last Range fastest), the lane Ranges the threads of a block
(threadIdx.x, likewise), "shared" Allocs are addrspace(3) globals, Barrier is bar.sync 0, an
"add" Store an atomicrmw and mma an mma.sync (inline PTX); the signature is
`ptx_kernel void f(ptr buf0, ptr buf1, ...)`."""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from tilefuse.backends.llvmir.ops import TYPES, is_float
from tilefuse.backends.llvmir.tile import TilePrinter
from tilefuse.backends.llvmir.vecmath import F32, I32, I64
from tilefuse.ir.kernel.schedule import ATOMIC

from .render import TRIPLE, NVEmit, sreg


class PTXTilePrinter(TilePrinter):
    """One tile kernel as an NVPTX kernel function (see the module docstring)."""

    def __init__(self, k, fn_name: str):
        self.shared: set = set()  # the shared Allocs (aligned to 16 bytes)
        super().__init__(k, fn_name)
        self.mod.triple = TRIPLE
        self.ops.em = NVEmit(self.b)

    def refuse(self) -> None:
        pass  # a GPU has shared memory and barriers

    def function(self, fn_name: str) -> ir.Function:
        args = [TYPES[np.dtype(b.dtype)][1].as_pointer() for b in self.k.buffers]
        fn = ir.Function(self.mod, ir.FunctionType(ir.VoidType(), args), name=fn_name)
        fn.calling_convention = "ptx_kernel"
        fn.attributes.add("nounwind")
        # the block size, so that ptxas budgets registers for it (a launch never asks for too many)
        self.mod.add_named_metadata("nvvm.annotations", [fn, ir.MetaDataString(self.mod, "maxntidx"),
                                                         ir.Constant(I32, launch_dims(self.k)[1])])
        return fn

    def buffer(self, i: int, mt):
        return self.fn.args[i]

    def alloc(self, a, mt):
        if a.scope != "shared":
            return super().alloc(a, mt)
        self.shared.add(a.name)
        g = ir.GlobalVariable(self.mod, ir.ArrayType(mt, a.size), name=f"{a.name}_smem", addrspace=3)
        g.linkage, g.align = "internal", 16
        g.initializer = ir.Constant(g.value_type, ir.Undefined)
        # a generic pointer; LLVM infers the shared space back for the loads and stores
        return self.b.addrspacecast(g, mt.as_pointer())

    def points(self) -> None:
        b = self.b
        for ranges, reg in ((self.k.grid(), "ctaid.x"), (self.k.lanes(), "tid.x")):
            rest = sreg(b, reg)
            for n, r in enumerate(reversed(ranges)):  # the last Range varies fastest
                last = n == len(ranges) - 1
                self.env[r.var] = b.zext(rest if last else b.urem(rest, ir.Constant(I32, int(r.extent))), I64)
                rest = b.udiv(rest, ir.Constant(I32, int(r.extent)))
        self.block(self.k.inner())

    def barrier(self) -> None:
        fn = self.mod.globals.get("llvm.nvvm.barrier0") or \
            ir.Function(self.mod, ir.FunctionType(ir.VoidType(), []), name="llvm.nvvm.barrier0")
        self.b.call(fn, [])

    def expr(self, n):
        if n.op == "vload" and n.arg[0] in self.shared:  # aligned as far as its offset shows
            w, (p, sd) = n.arg[1], self.elem_ptr(n.arg[0], self._val(n.src[0]), n.arg[1])
            return self.b.load(p, align=min(16, sd.itemsize * math.gcd(w, _multiple(n.src[0]))))
        if n.op != "mma":
            return super().expr(n)
        assert n.arg == "m16n8k16", n.arg
        kind = {"float16": "f16", "bfloat16": "bf16"}[np.dtype(n.src[0].dtype).name]
        b = self.b
        a_, b_ = (b.bitcast(self._val(x), ir.VectorType(I32, self.lanes(x) // 2)) for x in n.src[:2])
        c_ = self._val(n.src[2])
        regs = [b.extract_element(v, ir.Constant(I32, i)) for v, k in ((a_, 4), (b_, 2), (c_, 4)) for i in range(k)]
        ty = ir.FunctionType(ir.LiteralStructType([F32] * 4), [I32] * 6 + [F32] * 4)
        asm = ir.InlineAsm(ty, f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
                           "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                           "=f,=f,=f,=f," + ",".join(["r"] * 6 + ["f"] * 4))
        d = b.call(asm, regs)
        out = ir.Constant(ir.VectorType(F32, 4), ir.Undefined)
        for i in range(4):
            out = b.insert_element(out, b.extract_value(d, i), ir.Constant(I32, i))
        return out

    def store_add(self, target, off, v, w: int) -> None:
        base, sd = self.pointer(target)
        assert sd.name in ATOMIC, f"an atomic add into {sd} (the GPU has {'/'.join(ATOMIC)})"
        for lane in range(w):
            x = v if w == 1 else self.b.extract_element(v, ir.Constant(I32, lane))
            o = off if w == 1 else self.b.add(off, ir.Constant(I64, lane))
            p = self.b.gep(base, [o], inbounds=True, source_etype=x.type)
            self.b.atomic_rmw("fadd" if is_float(sd) else "add", p, x, "monotonic")


def _multiple(n) -> int:
    """A number the index expression n is known to be a multiple of (a power of two, up to 16)."""
    if n.op == "const":
        v = abs(int(n.arg))
    elif n.op == "mul":
        v = _multiple(n.src[0]) * _multiple(n.src[1])
    elif n.op == "add":
        v = math.gcd(_multiple(n.src[0]), _multiple(n.src[1]))
    else:
        v = 1
    return math.gcd(v, 16)


def launch_dims(k) -> tuple[int, int]:
    """(blocks, threads per block) of a tile kernel's launch."""
    return k.points(), math.prod(int(r.extent) for r in k.lanes())


__all__ = ["PTXTilePrinter", "launch_dims"]
