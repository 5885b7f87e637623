"""What NVPTX LLVM IR needs beyond the shared printers (backends/llvmir), and LLVM IR → PTX through
llvmlite's NVPTX target. float64 libm calls: no libdevice here, so exp/log/pow use the float64
polynomials of vecmath and the others round through the float32 polynomials (see F64_VIA_F32)."""
from __future__ import annotations

import math
import threading

import llvmlite.binding as llvm
from llvmlite import ir
from tilefuse.backends.llvmir import vecmath
from tilefuse.backends.llvmir.vecmath import F32, F64, I32, Emit
from tilefuse.ir.errors import CompileError

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


def sreg(b: ir.IRBuilder, name: str):
    """A PTX special register (tid.x, ntid.x, ctaid.x, nctaid.x) as an i32."""
    full = f"llvm.nvvm.read.ptx.sreg.{name}"
    fn = b.module.globals.get(full) or ir.Function(b.module, ir.FunctionType(I32, []), name=full)
    return b.call(fn, [])


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


__all__ = ["TRIPLE", "NVEmit", "sreg", "to_ptx"]
