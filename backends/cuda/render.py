"""Kernel IR → LLVM IR for NVPTX, and LLVM IR → PTX through llvmlite's NVPTX target.

The shared LLVM IR renderer (backends/llvmir/render.py) does the expression rendering, the per-point fused
reduce loop and the conversions; this subclass changes only what differs on a GPU:
- the signature: `ptx_kernel void f(ptr buf0, ptr buf1, ...)` (one pointer per buffer);
- the parallel loop: point p = blockIdx.x·blockDim.x + threadIdx.x, stepping by
  gridDim.x·blockDim.x (a grid-stride loop, so any grid size covers the space), with the point
  split into the merged-axis counters by div/rem (32-bit when the space fits);
- "add" stores: `atomicrmw fadd`/`add` (scatter-add points may collide);
- float64 libm calls: no libdevice here, so exp/log/pow use the float64 polynomials of vecmath and
  the others round through the float32 polynomials (see F64_VIA_F32)."""
from __future__ import annotations

import math
import threading

import llvmlite.binding as llvm
import llvmlite.ir as ir
import numpy as np

from tilefuse.backends.llvmir import vecmath
from tilefuse.backends.llvmir.render import TYPES, Renderer, is_float
from tilefuse.backends.llvmir.vecmath import F32, F64, I32, I64, Emit
from tilefuse.ir.errors import CompileError
from tilefuse.ir.kernel.ir import SUM_BLOCK, Kernel
from tilefuse.ir.kernel.schedule import ATOMIC

TRIPLE = "nvptx64-nvidia-cuda"
# float64 functions computed through float32 (≈1e-7 relative, not float64 accuracy)
F64_VIA_F32 = ("log1p", "expm1", "tanh", "erf", "sin", "cos")


class NVEmit(Emit):
    """Emit with the libm hook answered in-line: a GPU module cannot call the host's libm."""

    def libm(self, name: str, *args):
        b = self.b
        if name == "exp":
            return vecmath._exp2_f64(self, b.fmul(args[0], self.c(F64, vecmath.LOG2E)))
        if name == "log":
            return _log_f64(self, args[0])
        if name == "pow":
            return _pow_f64(self, *args)
        if name in F64_VIA_F32:
            return b.fpext(vecmath.FLOAT32[name](self, b.fptrunc(args[0], F32)), F64)
        raise CompileError(f"no NVPTX implementation of the float64 function {name}")


def _log_f64(em: Emit, x):
    """log of a float64 with the special values of C: log(0) = -inf, log(<0) = NaN, log(inf) = inf."""
    b = em.b
    pos = em.gt(x, em.c(F64, 0.0))
    fin = em.lt(x, em.c(F64, math.inf))
    safe = em.sel(b.and_(pos, fin), x, em.c(F64, 1.0))
    r = b.fmul(vecmath._log2_f64(em, safe), em.c(F64, math.log(2.0)))
    r = em.sel(fin, r, em.c(F64, math.inf))
    r = em.sel(em.eq(x, em.c(F64, 0.0)), em.c(F64, -math.inf), r)
    return em.sel(b.or_(em.isnan(x), em.lt(x, em.c(F64, 0.0))), em.c(F64, math.nan), r)


def _pow_f64(em: Emit, x, y):
    """pow for float64 through exp2(y·log2|x|) with C's sign/special rules for the common cases."""
    b = em.b
    ax = em.fabs(x)
    l2 = b.fmul(_log_f64(em, ax), em.c(F64, vecmath.LOG2E))
    prod = b.fmul(y, l2)
    prod = em.sel(em.isnan(prod), em.c(F64, 0.0), prod)
    r = vecmath._exp2_f64(em, prod)
    is_int = em.eq(em.floor(y), y)
    half = b.fmul(y, em.c(F64, 0.5))
    odd = b.and_(is_int, b.fcmp_ordered("!=", em.floor(half), half))
    neg = em.lt(x, em.c(F64, 0.0))
    r = em.sel(b.and_(odd, neg), b.fneg(r), r)
    r = em.sel(b.and_(neg, b.not_(is_int)), em.c(F64, math.nan), r)
    r = em.sel(b.or_(em.isnan(x), em.isnan(y)), em.c(F64, math.nan), r)
    one = em.c(F64, 1.0)
    r = em.sel(em.eq(x, one), one, r)
    return em.sel(em.eq(y, em.c(F64, 0.0)), one, r)


def _sreg(b: ir.IRBuilder, name: str):
    """A PTX special register (tid.x, ntid.x, ctaid.x, nctaid.x) as an i32."""
    full = f"llvm.nvvm.read.ptx.sreg.{name}"
    fn = b.module.globals.get(full) or ir.Function(b.module, ir.FunctionType(I32, []), name=full)
    return b.call(fn, [])


class PTXRenderer(Renderer):
    """One Kernel as an NVPTX kernel function (see the module docstring)."""

    steps_per_block = SUM_BLOCK  # a thread's sum is one accumulator (no SIMD lanes to spread it)

    def __init__(self, kernel: Kernel, fn_name: str):
        super().__init__(kernel, fn_name)
        self.interchange = False  # the tiled CPU interchange is for SIMD loops, not threads

    def render(self) -> ir.Module:
        mod = ir.Module(name=self.fn_name)
        mod.triple = TRIPLE
        nbuf = len(self.k.buffers)
        fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [ir.PointerType()] * nbuf),
                         name=self.fn_name)
        fn.calling_convention = "ptx_kernel"
        fn.attributes.add("nounwind")
        self.fn = fn
        entry = fn.append_basic_block("entry")
        self.b = ir.IRBuilder(entry)
        self.em = NVEmit(self.b)
        self.allocas_at = entry
        self.ptrs = list(fn.args)
        self.cache, self.env = {}, {}
        body = self.b.append_basic_block("body")
        self.b.branch(body)
        self.b.position_at_end(body)
        self._grid_stride()
        self.b.ret_void()
        return mod

    def _grid_stride(self):
        """for (p = global thread id; p < points; p += total threads) point(p)."""
        b = self.b
        total = int(np.prod(self.k.shape, dtype=np.int64))
        if total == 0:
            return
        # 32-bit index arithmetic when the space (plus one stride of overshoot) fits
        it = I32 if total < (1 << 30) else I64
        c = lambda v: ir.Constant(it, v)  # noqa: E731
        ext = (lambda v: v) if it == I64 else (lambda v: b.zext(v, I64))
        widen = (lambda v: b.zext(v, I64)) if it == I64 else (lambda v: v)
        tid, ntid = widen(_sreg(b, "tid.x")), widen(_sreg(b, "ntid.x"))
        ctaid, nctaid = widen(_sreg(b, "ctaid.x")), widen(_sreg(b, "nctaid.x"))
        start = b.add(b.mul(ctaid, ntid, flags=("nuw",)), tid, flags=("nuw",))
        stride = b.mul(nctaid, ntid, flags=("nuw",))
        pre = b.block
        head = b.append_basic_block("p.head")
        loop = b.append_basic_block("p.body")
        done = b.append_basic_block("p.done")
        b.branch(head)
        b.position_at_end(head)
        p = b.phi(it, name="p")
        p.add_incoming(start, pre)
        b.cbranch(b.icmp_unsigned("<", p, c(total)), loop, done)
        b.position_at_end(loop)
        rest = p
        groups = self.par.groups
        for g in reversed(range(len(groups))):  # the counters of the merged axes, innermost last
            size = groups[g][0]
            self.env[("idx", g)] = ext(b.urem(rest, c(size)) if g else rest)
            if g:
                rest = b.udiv(rest, c(size))
        self._point_scope()
        nxt = b.add(p, stride, flags=("nuw",))
        p.add_incoming(nxt, b.block)
        b.branch(head)
        b.position_at_end(done)

    def _store(self, st, value=None):
        if st.mode != "add":
            return super()._store(st, value)
        b = self.b
        d = np.dtype(self.k.buffers[st.buffer].dtype)
        if d.name not in ATOMIC:
            raise CompileError(f"scatter-add into {d} has no atomic on the GPU yet "
                               f"({'/'.join(ATOMIC)} do)", kernel=str(self.k))
        mt = TYPES[d][1]
        ptr = b.gep(self.ptrs[st.buffer], [self._index(self.value(st.offset), st.offset.dtype)],
                    inbounds=True, source_etype=mt)
        v = self._convert(self.value(st.value), st.value.dtype, d)
        b.atomic_rmw("fadd" if is_float(d) else "add", ptr, v, "monotonic")


# ---- LLVM IR → PTX --------------------------------------------------------------------------

_lock = threading.Lock()
_machines: dict = {}


def _machine(sm: str):
    with _lock:
        tm = _machines.get(sm)
        if tm is None:
            llvm.initialize_all_targets()
            llvm.initialize_all_asmprinters()
            target = llvm.Target.from_triple(TRIPLE)
            tm = _machines[sm] = target.create_target_machine(cpu=sm, features="+ptx80", opt=3)
        return tm


def render_llvm(kernel: Kernel, fn_name: str) -> str:
    """The NVPTX LLVM IR text of one kernel."""
    return str(PTXRenderer(kernel, fn_name).render())


def to_ptx(llvm_ir: str, sm: str = "sm_90") -> str:
    """Optimise NVPTX LLVM IR (O3) and emit PTX for the compute capability `sm`."""
    tm = _machine(sm)
    with _lock:
        try:
            mod = llvm.parse_assembly(llvm_ir)
            mod.triple = TRIPLE
            mod.data_layout = str(tm.target_data)
            mod.verify()
        except RuntimeError as e:
            raise CompileError(f"invalid NVPTX LLVM IR: {e}", backend="cuda", source=llvm_ir) from None
        pto = llvm.create_pipeline_tuning_options(speed_level=3)
        pb = llvm.create_pass_builder(tm, pto)
        pb.getModulePassManager().run(mod, pb)
        return tm.emit_assembly(mod)


def kernel_ptx(kernel: Kernel, fn_name: str, sm: str = "sm_90") -> tuple[str, str]:
    """(LLVM IR, PTX) of one kernel."""
    text = render_llvm(kernel, fn_name)
    return text, to_ptx(text, sm)


__all__ = ["PTXRenderer", "render_llvm", "to_ptx", "kernel_ptx"]
