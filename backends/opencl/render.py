"""Kernel IR → OpenCL C.

One work unit per point of the parallel space, walked by a grid-stride loop (so a launch may
cap its global size). Where it pays, one axis is *vectorised* to the device's preferred width W:

- mode "par": W consecutive points of the last parallel axis per work unit (floatW values,
  vloadW/vstoreW where the index map is contiguous, per-lane gathers where it is not), with a
  scalar loop for the ragged end of the axis;
- mode "red": consecutive steps of the last reduction axis at once (2W lanes of partial
  accumulators, combined at the end), for reductions over the contiguous axis (row sums,
  softmax, argmax);
- mode "scalar": everything scalar (small kernels, "add" stores; "serial" when they need one
  work-item);
- mode "tree" (GPUs): a work-group per point for long reductions over few points, partial
  results combined through local memory.

PoCL, like most OpenCL compilers, leaves calls such as exp/tanh scalar in per-work-item code,
so the explicit vector types are what make elementwise chains fast (measured: about 10x).

Semantics follow ir/primitives.py (numpy): integer div/rem truncate (x/0 = 0, x%0 = x),
float→int truncates, max/min propagate NaN, argmax/argmin take the first index and count NaN
as the extreme, round is half-to-even (rint), shifts past the width give 0, signed integers
wrap (computed unsigned: C leaves their overflow undefined). float16 lives in buffers as half
(vload_half/vstore_half), bfloat16 as ushort bits; both compute in float, so no kernel needs
cl_khr_fp16. bool is uchar 0/1, int64 long, float64 double (only with cl_khr_fp64).

Nothing assumes the machine the code was written on: the vector width is the device's preferred
one (4, 8, 16 all render), vector masks and comparisons use the element size of their operands
(a uchar comparison is a char vector), vloadN/vstoreN read element-aligned memory, and
vload_halfN/vstore_halfN, which PoCL's x86 library implements as aligned vector moves, appear
only where the offset is proven a multiple of N from a buffer start aligned to the device's
base address alignment. Float sums are blocked (ir/kernel/ir.py: SUM_BLOCK).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

from tilefuse.ir import dtypes
from tilefuse.ir.errors import CompileError
from tilefuse.ir.kernel.ir import SUM_BLOCK, SUM_FAN, KExpr, Kernel, Store, blocked_sums, idx, \
    known_multiple, pp_kernel, reads_ridx, reduce_levels, ridx, row_stashes, sum_levels, value_range
from tilefuse.ir.kernel.ir import cast as kcast, load as kload

F16, BF16, F32, F64 = dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64
BOOL, I32, I64, U32 = dtypes.bool_, dtypes.int32, dtypes.int64, dtypes.uint32

# the C type a value of each dtype is computed in, and the element type of its buffer
VALUE_T = {BOOL: "uchar", I32: "int", U32: "uint", I64: "long", F16: "float", BF16: "float",
           F32: "float", F64: "double"}
STORE_T = {**VALUE_T, F16: "half", BF16: "ushort"}
MASK_T = {1: "char", 2: "short", 4: "int", 8: "long"}  # select() masks by element size
LANE = "0123456789abcdef"

FLOAT_FN = {"exp": "exp", "log": "log", "log1p": "log1p", "expm1": "expm1", "tanh": "tanh",
            "sqrt": "sqrt", "rsqrt": "rsqrt", "sin": "sin", "cos": "cos", "erf": "erf",
            "floor": "floor", "ceil": "ceil", "round": "rint"}
ARITH = {"add": "+", "sub": "-", "mul": "*", "and": "&", "or": "|", "xor": "^"}
COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


@dataclass(frozen=True)
class Rendered:
    """OpenCL C for one kernel, with what the launcher needs."""
    name: str        # the __kernel function's name
    source: str
    units: int       # work units the grid-stride loop covers (0: nothing to launch)
    mode: str        # "par" | "red" | "scalar" | "serial" | "tree"
    width: int       # vector width of the vectorised axis (1 in scalar modes)
    local: int = 0   # the work-group size the kernel needs (tree mode), else 0: any


def cname(k: Kernel) -> str:
    """The C name: the kernel's name and a hash of its text, unique within a batched program."""
    digest = hashlib.sha1(pp_kernel(k).encode()).hexdigest()[:8]
    return f"tf_{re.sub(r'[^A-Za-z0-9_]', '_', k.name)}_{digest}"


def _is_float(d) -> bool:
    return np.dtype(d) in (F16, BF16, F32, F64)


def literal(value, dtype) -> str:
    """A C literal of `value` in the value type of `dtype`."""
    d = np.dtype(dtype)
    if d == BOOL:
        return "((uchar)1)" if value else "((uchar)0)"
    if _is_float(d):
        v = float(value)
        t = "double" if d == F64 else "float"
        if np.isnan(v):
            return f"(({t})NAN)"
        if np.isinf(v):
            return f"(({t})INFINITY)" if v > 0 else f"(-({t})INFINITY)"
        return f"({v.hex()}{'' if d == F64 else 'f'})"
    v = int(value)
    if d == U32:
        return f"((uint){v & 0xFFFFFFFF}u)"
    bits = 64 if d == I64 else 32
    t, suffix = ("long", "L") if bits == 64 else ("int", "")
    if v == -(1 << (bits - 1)):
        return f"(({t})(-{(1 << (bits - 1)) - 1}{suffix}-1{suffix}))"
    return f"(({t}){v}{suffix})"


def _lowest(d) -> str:
    d = np.dtype(d)
    if _is_float(d):
        return literal(-np.inf, d)
    return literal(0 if d in (BOOL, U32) else np.iinfo(d).min, d)


def _highest(d) -> str:
    d = np.dtype(d)
    if _is_float(d):
        return literal(np.inf, d)
    return literal(1 if d == BOOL else np.iinfo(d).max, d)


class _Body:
    """Emits the statements of one kernel body: the expression DAG in SSA order, with one axis
    leaf (`vary`) carrying W lanes. A node is rendered as a vector when it depends on that leaf
    (and `scalar` is off), else as a scalar; `memo` maps (node, is_scalar) to its variable."""

    def __init__(self, k: Kernel, out: list, vary: tuple | None, width: int, base: str, indent: str,
                 align: int = 0):
        self.k, self.out, self.vary, self.W, self.base, self.ind = k, out, vary, width, base, indent
        self.align = align  # bytes every buffer's start is aligned to (0: nothing is assumed)
        self.memo: dict = {}
        self.scalar = vary is None or width == 1
        self._varying: dict = {}
        self._n = 0

    # ---- helpers ----
    def line(self, s: str) -> None:
        self.out.append(self.ind + s)

    def tmp(self) -> str:
        self._n += 1
        return f"t{len(self.out)}_{self._n}"

    def varying(self, n: KExpr) -> bool:
        if self.vary is None:
            return False
        r = self._varying.get(n)
        if r is None:
            if n.op in ("idx", "ridx"):
                r = (n.op, n.arg) == self.vary
            elif n.op == "reduce" and self.vary[0] == "ridx":
                r = False  # a reduction over the vector axis yields one value per point
            else:
                r = any(self.varying(s) for s in n.src)
            self._varying[n] = r
        return r

    def ty(self, d, w: int) -> str:
        t = VALUE_T[np.dtype(d)]
        return t if w == 1 else f"{t}{w}"

    def bc(self, name: str, n: KExpr, w: int, scalar: bool) -> str:
        """`name` (the value of n) as width w: broadcast a scalar to a vector if needed."""
        if w == 1 or (not scalar and self.varying(n)):
            return name
        return f"(({self.ty(n.dtype, w)})({name}))"

    def mask(self, cond: str, d, w: int) -> str:
        """A select() mask for values of dtype d from a bool (uchar 0/1) value."""
        return f"(-convert_{MASK_T[_size(d)]}{w}({cond}))"

    def to_bool(self, m: str, w: int) -> str:
        """A comparison result (scalar 1/0, vector -1/0 of the operands' element size) as a bool
        value. The mask is converted first: `char8 & 1` is an error (an int operand outranks
        the vector's char elements)."""
        return f"((uchar)({m}))" if w == 1 else f"(convert_uchar{w}({m}) & (uchar{w})(1))"

    # ---- nodes ----
    def val(self, n: KExpr, scalar: bool = False) -> str:
        s = scalar or self.scalar or not self.varying(n)
        key = (n, s)
        got = self.memo.get(key)
        if got is not None:
            return got
        w = 1 if s else self.W
        expr = self.render(n, s, w)
        if n.op in ("const",) or (n.op in ("idx", "ridx") and w == 1):
            self.memo[key] = expr
            return expr
        name = f"v{len(self.out)}_{len(self.memo)}"
        self.line(f"{self.ty(n.dtype, w)} {name} = {expr};")
        self.memo[key] = name
        return name

    def render(self, n: KExpr, s: bool, w: int) -> str:
        op, d = n.op, np.dtype(n.dtype)
        if op == "const":
            return literal(n.arg, d)
        if op == "idx" or op == "ridx":
            v = f"i{n.arg}" if op == "idx" else f"r{n.arg}"
            if (op, n.arg) == self.vary:
                v = self.base
                if w > 1:
                    return f"({v} + (long{w})({', '.join(map(str, range(w)))}))"
            return v
        if op == "reduce":
            raise AssertionError("reduce rendered before its accumulator was set up")
        if op == "load":
            return self.load(n, s, w)
        args = [self.bc(self.val(x, s), x, w, s) for x in n.src]
        if op == "select":
            c, a, b = args
            return f"({c} ? {a} : {b})" if w == 1 else f"select({b}, {a}, {self.mask(c, d, w)})"
        if op == "cast":
            return self.cast(args[0], n.src[0].dtype, d, w)
        if op in WRAPPING and d in (I32, I64) and not self.cannot_overflow(n):
            return wrapping(op, args, d, w)
        if len(args) == 1:
            return self.unary(op, args[0], d, w)
        return self.binary(op, args[0], args[1], n.src[0].dtype, w)

    def cannot_overflow(self, n: KExpr) -> bool:
        """Index arithmetic: bounded by the index spaces (so it may stay signed and plain)."""
        return self.k is not None and value_range(n, self.k.shape, self.k.reduce_shape) is not None

    def unary(self, op: str, x: str, d, w: int) -> str:
        if op in ("sin", "cos") and w > 1:
            return self.lanewise_trig(op, x, d, w)
        if op in FLOAT_FN:
            return f"{FLOAT_FN[op]}({x})"
        one = literal(1, d)
        if op == "neg":
            return f"(-{x})"
        if op == "logistic":
            return f"({one} / ({one} + exp(-{x})))"
        if op == "abs":
            return f"fabs({x})" if _is_float(d) else f"as_{self.ty(d, w)}(abs({x}))"
        if op == "sign":
            zero = literal(0, d)
            if w == 1:
                return f"({x} > {zero} ? {one} : ({x} < {zero} ? -{one} : {x}))"
            vt = self.ty(d, w)
            return f"select(select({x}, ({vt})(-{one}), {x} < {zero}), ({vt})({one}), {x} > {zero})"
        if op == "not":
            return f"({x} ^ {one})" if d == BOOL else f"(~{x})"
        if op == "is_finite":
            return self.to_bool(f"isfinite({x})", w)
        raise CompileError(f"opencl: no rendering for the unary op {op!r}", backend="opencl")

    def lanewise_trig(self, op: str, x: str, d, w: int) -> str:
        """PoCL's vector sin/cos go wrong in every lane (sin 1e-7 = 0.0131) when one lane is large
        (|x| >= ~1e7), inf or NaN: such vectors take one scalar call per lane."""
        vt = self.ty(d, w)
        lanes = ", ".join(f"{op}(({x}).s{LANE[i]})" for i in range(w))
        return f"(any(!isless(fabs({x}), ({vt})({literal(65536.0, d)}))) ? ({vt})({lanes}) : {op}({x}))"

    def binary(self, op: str, a: str, b: str, d, w: int) -> str:
        d = np.dtype(d)
        if d == BOOL and op in ("add", "mul"):  # numpy: bool + is or, bool * is and
            op = "or" if op == "add" else "and"
        if op in ARITH:
            return f"({a} {ARITH[op]} {b})"
        if op in COMPARE:
            return self.to_bool(f"{a} {COMPARE[op]} {b}", w)
        if op in ("max", "min"):
            if not _is_float(d):
                return f"{op}({a}, {b})"
            cmp = ">" if op == "max" else "<"
            if w == 1:  # np.maximum: a NaN on either side wins (fmax would drop it)
                return f"(({a} {cmp} {b} || isnan({a})) ? {a} : {b})"
            return f"select({b}, {a}, ({a} {cmp} {b}) | isnan({a}))"
        if op == "pow":
            return f"pow({a}, {b})"
        if op in ("div", "rem"):
            if _is_float(d):
                return f"({a} / {b})" if op == "div" else f"fmod({a}, {b})"
            return self.int_divrem(op, a, b, d, w)
        if op in ("shift_left", "shift_right_logical"):
            vt = self.ty(d, w)
            ut = ("ulong" if d.itemsize == 8 else "uint") + ("" if w == 1 else str(w))
            sh = f"as_{vt}(as_{ut}({a}) {'<<' if op == 'shift_left' else '>>'} as_{ut}({b}))"
            zero, bits = literal(0, d), literal(d.itemsize * 8, d)
            bad = f"({b} >= {bits})" if d == U32 else f"(({b} < {zero}) | ({b} >= {bits}))"
            if w == 1:  # numpy: shifting by the width or more (or by < 0) gives 0
                return f"({bad} ? {zero} : {sh})"
            return f"select({sh}, ({vt})({zero}), {bad})"
        raise CompileError(f"opencl: no rendering for the binary op {op!r}", backend="opencl")

    def int_divrem(self, op: str, a: str, b: str, d, w: int) -> str:
        """C division with numpy's oracle at the edges: x/0 = 0, x%0 = x, MIN/-1 wraps."""
        zero, one = literal(0, d), literal(1, d)
        signed = d != U32
        ut = {I32: "uint", I64: "ulong", U32: "uint"}[d]
        if w == 1:
            if op == "div":
                neg = f"({self.ty(d, 1)})(({ut})0 - ({ut}){a})"
                mid = f"({b} == -{one}) ? {neg} : " if signed else ""
                return f"(({b} == {zero}) ? {zero} : {mid}({a} / {b}))"
            mid = f"({b} == -{one}) ? {zero} : " if signed else ""
            return f"(({b} == {zero}) ? {a} : {mid}({a} % {b}))"
        vt = self.ty(d, w)
        z, m1, ys, q = self.tmp(), self.tmp(), self.tmp(), self.tmp()
        mt = f"{MASK_T[d.itemsize]}{w}"
        self.line(f"{mt} {z} = ({b} == {zero});")
        self.line(f"{mt} {m1} = {'(' + b + ' == -' + one + ')' if signed else '(' + mt + ')(0)'};")
        self.line(f"{vt} {ys} = select({b}, ({vt})({one}), {z} | {m1});")
        if op == "div":
            self.line(f"{vt} {q} = select({a} / {ys}, as_{vt}(({ut}{w})(0) - as_{ut}{w}({a})), {m1});")
            return f"select({q}, ({vt})({zero}), {z})"
        self.line(f"{vt} {q} = select({a} % {ys}, ({vt})({zero}), {m1});")
        return f"select({q}, {a}, {z})"

    def cast(self, x: str, src, dst, w: int) -> str:
        src, dst = np.dtype(src), np.dtype(dst)
        vs, vd = VALUE_T[src], VALUE_T[dst]
        if dst == BOOL:
            return self.to_bool(f"{x} != {literal(0, src)}", w)
        conv = x if vs == vd else (f"(({vd}){x})" if w == 1 else f"convert_{vd}{w}({x})")
        if dst == F16:
            return self.round_half(conv if vs != "double" else x, w)
        if dst == BF16:
            return self.round_bf16(conv, w)
        return conv

    def round_half(self, x: str, w: int) -> str:
        t = self.tmp()
        if w == 1:
            self.line(f"ushort {t}; vstore_half_rte({x}, 0, (__private half*)&{t});")
            return f"vload_half(0, (__private half*)&{t})"
        # aligned to the vector's size: PoCL's vstore_halfN/vload_halfN assume it (see aligned)
        self.line(f"ushort {t}[{w}] __attribute__((aligned({2 * w}))); "
                  f"vstore_half{w}_rte({x}, 0, (__private half*){t});")
        return f"vload_half{w}(0, (__private half*){t})"

    def bf16_bits(self, x: str, w: int) -> str:
        """Round-to-nearest-even float → bfloat16, as the 32-bit pattern with the low half zero."""
        u, t = self.tmp(), ("uint" if w == 1 else f"uint{w}")
        self.line(f"{t} {u} = as_{t}({x});")
        rne = f"(({u} + 0x7FFFu + (({u} >> 16) & 1u)) & 0xFFFF0000u)"
        nan = f"(({u} | 0x400000u) & 0xFFFF0000u)"
        return f"(isnan({x}) ? {nan} : {rne})" if w == 1 else f"select({rne}, {nan}, isnan({x}))"

    def round_bf16(self, x: str, w: int) -> str:
        return f"as_float{'' if w == 1 else w}({self.bf16_bits(x, w)})"

    # ---- memory ----
    def lin(self, n: KExpr):
        """The constant coefficient of the vector leaf in an integer index expression, or None."""
        if not self.varying(n):
            return 0
        if n.op in ("idx", "ridx"):
            return 1
        if n.op == "cast" and not _is_float(n.dtype) and not _is_float(n.src[0].dtype):
            return self.lin(n.src[0])
        if n.op in ("add", "sub"):
            a, b = self.lin(n.src[0]), self.lin(n.src[1])
            return None if a is None or b is None else a + b if n.op == "add" else a - b
        if n.op == "mul":
            x, y = n.src
            if y.op == "const" and (c := self.lin(x)) is not None:
                return c * int(y.arg)
            if x.op == "const" and (c := self.lin(y)) is not None:
                return c * int(x.arg)
        return None

    def aligned(self, off: KExpr, w: int, itemsize: int) -> bool:
        """Whether a w-wide vector access at element offset `off` (contiguous along the vector
        axis) is proven to start at a multiple of its own size: the buffer's start is aligned
        so far (the device's base_align) and `off` is a multiple of w (the vector axis' base is).
        PoCL's vload_halfN/vstore_halfN assume that alignment (x86: an aligned 16-byte move
        where the spec asks for 2 bytes; the AVX2 build faulted), so they need it proven;
        vloadN/vstoreN of other types read unaligned memory correctly."""
        if self.vary is None or w * itemsize > self.align:
            return False
        leaf = (idx if self.vary[0] == "idx" else ridx)(self.vary[1])
        return known_multiple(off, {leaf: w}) % w == 0

    def scalar_load(self, buf: int, off: str) -> str:
        d = np.dtype(self.k.buffers[buf].dtype)
        if d == F16:
            return f"vload_half({off}, b{buf})"
        if d == BF16:
            return f"as_float((uint)b{buf}[{off}] << 16)"
        return f"b{buf}[{off}]"

    def load(self, n: KExpr, s: bool, w: int) -> str:
        buf, off = n.arg, n.src[0]
        d = np.dtype(self.k.buffers[buf].dtype)
        if w == 1:
            return self.scalar_load(buf, self.val(off, True))
        if self.lin(off) == 1:
            o0 = self.val(off, True)
            if d == F16 and not self.aligned(off, w, 2):  # one vload_half per lane
                lanes = ", ".join(f"vload_half({o0} + {j}, b{buf})" for j in range(w))
                return f"(({self.ty(n.dtype, w)})({lanes}))"
            if d == F16:
                return f"vload_half{w}(0, b{buf} + {o0})"
            if d == BF16:
                return f"as_float{w}(convert_uint{w}(vload{w}(0, b{buf} + {o0})) << 16)"
            return f"vload{w}(0, b{buf} + {o0})"
        o = self.bc(self.val(off, s), off, w, s)
        lanes = ", ".join(self.scalar_load(buf, f"{o}.s{LANE[j]}") for j in range(w))
        return f"(({self.ty(n.dtype, w)})({lanes}))"

    def store(self, st, atomic: bool, scalar: bool = False) -> None:
        buf = self.k.buffers[st.buffer]
        d = np.dtype(buf.dtype)
        value = st.value if np.dtype(st.value.dtype) == d else kcast(st.value, d)
        s = scalar or self.scalar or not (self.varying(value) or self.varying(st.offset))
        w = 1 if s else self.W
        v = self.bc(self.val(value, s), value, w, s)
        if st.mode == "add":
            assert w == 1, "add stores render scalar"
            self.add_store(st.buffer, self.val(st.offset, True), v, d, atomic)
        elif w == 1:
            self.scalar_store(st.buffer, self.val(st.offset, True), v, d)
        elif self.lin(st.offset) == 1:
            o0 = self.val(st.offset, True)
            if d == F16 and not self.aligned(st.offset, w, 2):
                for j in range(w):
                    self.line(f"vstore_half_rte({v}.s{LANE[j]}, {o0} + {j}, b{st.buffer});")
            elif d == F16:
                self.line(f"vstore_half{w}_rte({v}, 0, b{st.buffer} + {o0});")
            elif d == BF16:
                self.line(f"vstore{w}(convert_ushort{w}({self.bf16_bits(v, w)} >> 16), 0, "
                          f"b{st.buffer} + {o0});")
            else:
                self.line(f"vstore{w}({v}, 0, b{st.buffer} + {o0});")
        else:
            o = self.bc(self.val(st.offset, s), st.offset, w, s)
            for j in range(w):
                self.scalar_store(st.buffer, f"{o}.s{LANE[j]}", f"{v}.s{LANE[j]}", d)

    def scalar_store(self, buf: int, off: str, v: str, d) -> None:
        if d == F16:
            self.line(f"vstore_half_rte({v}, {off}, b{buf});")
        elif d == BF16:
            self.line(f"b{buf}[{off}] = (ushort)({self.bf16_bits(v, 1)} >> 16);")
        else:
            self.line(f"b{buf}[{off}] = {v};")

    def add_store(self, buf: int, off: str, v: str, d, atomic: bool) -> None:
        p = f"b{buf} + {off}"
        if not atomic:  # serial kernel: a plain read-modify-write
            if d == BOOL:
                self.line(f"b{buf}[{off}] |= {v};")
                return
            self.scalar_store(buf, off, f"({self.scalar_load(buf, off)} + {v})", d)
            return
        if d in (I32, U32):
            self.line(f"atomic_add((volatile __global {VALUE_T[d]}*)({p}), {v});")
        elif d == I64:
            self.line(f"atom_add((volatile __global long*)({p}), {v});")
        else:  # float: compare-and-swap on the bits
            ut, cas = ("uint", "atomic_cmpxchg") if d == F32 else ("ulong", "atom_cmpxchg")
            ft = VALUE_T[d]
            q, old, prev = self.tmp(), self.tmp(), self.tmp()
            self.line(f"{{ volatile __global {ut}* {q} = (volatile __global {ut}*)({p}); "
                      f"{ut} {old} = *{q}, {prev};")
            self.line(f"  do {{ {prev} = {old}; {old} = {cas}({q}, {prev}, "
                      f"as_{ut}(as_{ft}({prev}) + {v})); }} while ({old} != {prev}); }}")


WRAPPING = ("add", "sub", "mul", "neg")  # (shift_left shifts unsigned: see binary)


def wrapping(op: str, args: list, d, w: int) -> str:
    """Signed integer arithmetic that wraps (numpy's) instead of overflowing, which C leaves
    undefined and compilers exploit ((x + 1) > x folded to true): computed unsigned, and the
    bits read back as signed."""
    suffix = "" if w == 1 else str(w)
    vt, ut = VALUE_T[np.dtype(d)] + suffix, ("ulong" if np.dtype(d) == I64 else "uint") + suffix
    if op == "neg":
        return f"as_{vt}(({ut})(0) - as_{ut}({args[0]}))"
    return f"as_{vt}(as_{ut}({args[0]}) {ARITH[op]} as_{ut}({args[1]}))"


ATOMIC_DTYPES = (I32, U32, F32)
ATOMIC64_DTYPES = (I64, F64)


def pointwise_function(name: str, expr: KExpr, arg: KExpr) -> str:
    """An OpenCL C function `name(v)` of expr, an expression of constants, unary and binary ops
    and selects over the leaf `arg` (its parameter v): a GEMM template's epilogue."""
    lines: list = []
    body = _Body(None, lines, None, 1, "", "    ")
    body.memo[(arg, True)] = "v"
    result = body.val(expr, scalar=True)
    ctype = VALUE_T[np.dtype(arg.dtype)]
    return "\n".join([f"static inline {ctype} {name}({ctype} v) {{", *lines, f"    return {result};", "}"])


def _nodes(k: Kernel):
    seen = []
    for st in k.stores:
        for root in (st.offset, st.value):
            seen.extend(root.toposort())
    return list(dict.fromkeys(seen))


def _reduces(k: Kernel) -> list:
    return [n for n in _nodes(k) if n.op == "reduce"]


def _contiguous_loads(k: Kernel, vary: tuple) -> int:
    """How many loads read consecutive elements along the axis `vary` (in a reduction kernel,
    only those inside the reduction loop count: they run once per step)."""
    b, dep = _Body(k, [], vary, 2, "x", ""), {}
    return sum(1 for n in _nodes(k) if n.op == "load" and b.lin(n.src[0]) == 1 and
               (not k.has_reduce or reads_ridx(n, dep)))


def red_width(width: int) -> int:
    """Lanes of a vectorised reduction: twice the preferred width (at most 16, OpenCL's widest
    vector), so that two independent add chains hide the latency of one."""
    return min(16, 2 * width) if width > 1 else 1


def racy_float_adds(k: Kernel) -> bool:
    """Whether the kernel adds floats into shared elements (atomically, so in no fixed order)."""
    return any(s.mode == "add" and _is_float(k.buffers[s.buffer].dtype) for s in k.stores)


def choose_mode(k: Kernel, width: int, *, int64_atomics: bool, owners: int = 0) -> str:
    """How a kernel's points map to work-items (see render). Kernels with "add" stores: where an
    axis can own them (Kernel.owner_axis) and `owners` is set, "owner" (the axis split among
    that many work-items, each running the rest of the space in order); else atomics
    ("scalar"); else "owner" with a work-item per index; else one work-item ("serial")."""
    adds = [s for s in k.stores if s.mode == "add"]
    if adds:
        set_bufs = {s.buffer for s in k.stores if s.mode == "set"}
        if set_bufs & {s.buffer for s in adds}:
            return "serial"
        a = k.owner_axis
        if owners and a is not None:
            return "owner"
        atomic_ok = all(np.dtype(k.buffers[s.buffer].dtype) in ATOMIC_DTYPES or
                        (int64_atomics and np.dtype(k.buffers[s.buffer].dtype) in ATOMIC64_DTYPES)
                        for s in adds)
        return "scalar" if atomic_ok else "owner" if a is not None else "serial"
    if width <= 1 or not k.shape and not k.reduce_shape:
        return "scalar"
    par_ok = bool(k.shape) and k.shape[-1] >= width
    red_ok = bool(k.reduce_shape) and k.reduce_shape[-1] >= red_width(width)
    if k.has_reduce:
        par = _contiguous_loads(k, ("idx", len(k.shape) - 1)) if par_ok else -1
        red_axis = ("ridx", len(k.reduce_shape) - 1)
        b = _Body(k, [], red_axis, 2, "", "")
        red_ok = red_ok and all(b.varying(r.src[0]) for r in _reduces(k))  # W steps at once
        red = _contiguous_loads(k, red_axis) if red_ok else -1
        if red > par and red > 0:
            return "red"
        return "par" if par_ok and par >= 0 and (par > 0 or k.size >= width * 4) else "scalar"
    return "par" if par_ok else "scalar"


def _decompose(out: list, ind: str, var: str, axes: list, tmp: str = "q_") -> None:
    """Split the flat unit number `var` into per-axis indices; axes = [(name, extent)] outer first."""
    live = [(nm, n) for nm, n in axes if n != 1]
    for nm, n in axes:
        if n == 1:
            out.append(f"{ind}const long {nm} = 0;")
    if not live:
        return
    out.append(f"{ind}long {tmp} = {var};")
    for nm, n in reversed(live[1:]):
        out.append(f"{ind}const long {nm} = {tmp} % {n}L; {tmp} /= {n}L;")
    out.append(f"{ind}const long {live[0][0]} = {tmp};")


def _emit_body(k: Kernel, out: list, ind: str, vary, width: int, base: str, atomic: bool,
               align: int = 0) -> None:
    """Reductions (if any, one pass per dependency level) then the stores, for the point(s)
    whose indices are in scope; then the row stores in one more pass over the reduction space."""
    b = _Body(k, out, vary, width, base, ind, align)
    stash = row_stashes(k)  # values a reduction pass keeps in a row store's buffer for the row pass
    for i, level in enumerate(reduce_levels(st.value for st in k.stores)):
        _emit_reductions(b, level, [Store(st.buffer, st.offset, stash[id(st)][1]) for st in k.row_stores
                                    if stash.get(id(st), (None,))[0] == i], atomic)
    rows = k.row_stores
    for st in k.stores:
        if st not in rows:
            b.store(st, atomic)
    if rows:
        _emit_row_stores(b, rows, atomic, {i: node for i, (_, node) in stash.items()})


def _emit_row_stores(b: _Body, rows, atomic: bool, stash: dict) -> None:
    """Row stores loop over the reduction space (its last axis W steps at once in "red" mode,
    with a scalar tail), after what does not change along a row is computed once; a value in
    `stash` (id(store) -> node) is loaded back from the store's buffer, where a reduction
    pass left it."""
    k, dep = b.k, {}
    stack, seen = [e for st in rows for e in (st.offset, st.value)], set()
    while stack:  # hoist: every node reading no ridx (reduce nodes included; not their bodies)
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            if not reads_ridx(n, dep):
                b.val(n)
            else:
                stack.extend(n.src)
    vec = b.vary is not None and b.vary[0] == "ridx" and not b.scalar
    nr = len(k.reduce_shape)
    loops = nr - 1 if vec else nr
    for ax in range(loops):
        b.line(f"for (long r{ax} = 0; r{ax} < {k.reduce_shape[ax]}L; ++r{ax}) {{")
        b.ind += "  "
    saved = dict(b.memo)

    def body(head: str, scalar: bool) -> None:
        b.line(head)
        b.ind += "  "
        for st in rows:
            node = stash.get(id(st))
            if node is not None:
                s = scalar or b.scalar or not b.varying(node)
                b.memo[(node, s)] = b.val(kload(st.buffer, st.offset, node.dtype), s)
            b.store(st, atomic, scalar)
        b.ind = b.ind[:-2]
        b.line("}")
        b.memo = dict(saved)
    if vec:
        last, W, R = nr - 1, b.W, k.reduce_shape[-1]
        b.line(f"{{ long r{last} = 0;")
        body(f"for (; r{last} + {W} <= {R}L; r{last} += {W}) {{", False)
        body(f"for (; r{last} < {R}L; ++r{last}) {{", True)
        b.line("}")
    else:
        body("{", False)
    for ax in range(loops):
        b.ind = b.ind[:-2]
        b.line("}")


def _identity(op: str, d) -> str:
    return {"sum": literal(0, d), "prod": literal(1, d), "max": _lowest(d), "min": _highest(d),
            "argmax": _lowest(d), "argmin": _highest(d)}[op]


def _emit_reductions(b: _Body, reds: list, stash=(), atomic: bool = False) -> None:
    """One pass over the reduction space for `reds`, also storing `stash` (row_stashes)."""
    k = b.k
    dep: dict = {}
    vec_red = b.vary is not None and b.vary[0] == "ridx" and not b.scalar
    # hoist what the reduced expressions need that does not change inside the loops
    for r in reds:
        for n in r.toposort():
            if n is not r and not reads_ridx(n, dep):
                b.val(n)
    accs = {}
    for r in reds:
        src = r.src[0]
        d = np.dtype(src.dtype)
        w = b.W if (not b.scalar and b.varying(src)) else 1
        names = _init_acc(b, r, d, w, "a")
        tail = _init_acc(b, r, d, 1, "s") if vec_red else None
        accs[r] = (names, w, tail)
    steps = int(np.prod(k.reduce_shape, dtype=np.int64))
    blocked = []  # (accumulator, C type): the lanes' and the scalar tail's
    for r in blocked_sums(reds, steps):
        names, w, tail = accs[r]
        blocked += [(names[0], b.ty(r.dtype, w))] + ([(tail[0], b.ty(r.dtype, 1))] if tail else [])
    blocks = _SumBlocks(b, blocked, steps)
    nr = len(k.reduce_shape)
    last = nr - 1
    for ax in range(nr - 1 if vec_red else nr):
        b.line(f"for (long r{ax} = 0; r{ax} < {k.reduce_shape[ax]}L; ++r{ax}) {{")
        b.ind += "  "
    if vec_red:
        W, R = b.W, k.reduce_shape[last]
        b.line(f"{{ long r{last} = 0;  // (a row kernel walks its row once per level)")
        b.line(f"for (; r{last} + {W} <= {R}L; r{last} += {W}) {{")
        _loop_body(b, reds, accs, 0, stash=stash, atomic=atomic, blocks=blocks)
        b.line("}")
        b.line(f"for (; r{last} < {R}L; ++r{last}) {{")
        _loop_body(b, reds, accs, 2, stash=stash, atomic=atomic, blocks=blocks)
        b.line("} }")
    else:
        _loop_body(b, reds, accs, 0, indent=False, stash=stash, atomic=atomic, blocks=blocks)
    for ax in range(nr - 1 if vec_red else nr):
        b.ind = b.ind[:-2]
        b.line("}")
    blocks.finish()
    for r in reds:
        (names, w, tail) = accs[r]
        if vec_red:
            names = _horizontal(b, r, names, w, tail)
            w = 1
        res = names[1] if r.arg in ("argmax", "argmin") else names[0]
        b.memo[(r, w == 1)] = res
        b.memo[(r, True)] = res if w == 1 else f"{res}.s0"


def _init_acc(b: _Body, r: KExpr, d, w: int, tag: str) -> tuple:
    vt = b.ty(d, w)
    acc = f"{tag}{len(b.out)}"
    b.line(f"{vt} {acc} = {_identity(r.arg, d)};")
    if r.arg in ("argmax", "argmin"):
        b.line(f"{b.ty(np.int64, w)} {acc}i = -1;")
        return acc, acc + "i"
    return (acc,)


class _SumBlocks:
    """Blocked float sums (ir/kernel/ir.py, SUM_BLOCK and SUM_FAN): a step counter, and every
    SUM_BLOCK steps each accumulator's partial sum moves up into levels of SUM_FAN-way sums
    (variables <acc>_l1, _l2, ...), added together from the lowest at the end (`finish`)."""

    def __init__(self, b: _Body, accs: list, steps: int):
        self.b, self.accs = b, accs  # [(accumulator, its C type)]
        self.levels = sum_levels(steps) if accs else 0
        if self.levels:
            tag = f"k{len(b.out)}"
            self.counters = [f"{tag}_{j}" for j in range(self.levels)]
            b.line("uint " + ", ".join(f"{c} = 0" for c in self.counters) + ";  // blocked sums")
            for acc, ct in accs:
                b.line(f"{ct} " + ", ".join(f"{self._name(acc, j)} = ({ct})(0)"
                                            for j in range(1, self.levels + 1)) + ";")

    def _name(self, acc: str, j: int) -> str:
        return acc if j == 0 else f"{acc}_l{j}"

    def step(self) -> None:
        """After a step of the accumulators: the flush when a block is complete."""
        def flush(j):
            moves = " ".join(f"{self._name(a, j + 1)} += {self._name(a, j)}; {self._name(a, j)} = ({ct})(0);"
                             for a, ct in self.accs)
            more = (" " + flush(j + 1)) if j + 1 < self.levels else ""
            c, limit = self.counters[j], SUM_BLOCK if j == 0 else SUM_FAN
            return f"if (++{c} == {limit}u) {{ {c} = 0; {moves}{more} }}"
        if self.levels:
            self.b.line(flush(0))

    def finish(self) -> None:
        for a, _ in self.accs:
            for j in range(1, self.levels + 1):
                self.b.line(f"{a} = {a} + {self._name(a, j)};")


def _loop_body(b: _Body, reds, accs, which: int, indent: bool = True, stash=(), atomic=False,
               blocks: _SumBlocks | None = None) -> None:
    """One step of every reduction. which: 0 the (maybe vector) accumulators, 2 the scalar tail;
    then the stores of `stash` and the flush of blocked sums."""
    saved = dict(b.memo)
    if indent:
        b.ind += "  "
    for r in reds:
        names, w, tail = accs[r]
        if which == 2:
            names, w = tail, 1
        s = w == 1
        v = b.bc(b.val(r.src[0], s), r.src[0], w, s)
        ix = b.bc(b.val(r.src[1], s), r.src[1], w, s) if len(r.src) > 1 else None
        _update(b, r.arg, np.dtype(r.src[0].dtype), names, v, ix, w)
    for st in stash:
        b.store(st, atomic, which == 2)
    if blocks is not None:
        blocks.step()
    if indent:
        b.ind = b.ind[:-2]
    b.memo = saved


def _update(b: _Body, op: str, d, names, v: str, ix: str | None, w: int) -> None:
    acc = names[0]
    if op in ("sum", "prod") and d in (I32, I64):
        b.line(f"{acc} = {wrapping('add' if op == 'sum' else 'mul', [acc, v], d, w)};")
    elif op in ("sum", "prod"):
        sym = ("|" if op == "sum" else "&") if d == BOOL else ("+" if op == "sum" else "*")
        b.line(f"{acc} = {acc} {sym} {v};")
    elif op in ("max", "min"):
        b.line(f"{acc} = {b.binary(op, v, acc, d, w)};")
    else:
        _arg_update(b, op, d, names, v, ix, w)


def _better(b: _Body, op: str, d, v: str, best: str, w: int) -> str:
    """Mask: v beats the best so far (strictly; a NaN beats any number)."""
    cmp = ">" if op == "argmax" else "<"
    if not _is_float(d):
        return f"({v} {cmp} {best})"
    if w == 1:
        return f"({v} {cmp} {best} || (isnan({v}) && !isnan({best})))"
    return f"(({v} {cmp} {best}) | (isnan({v}) & ~isnan({best})))"


def _arg_update(b: _Body, op, d, names, v, ix, w) -> None:
    acc, ai = names
    better = _better(b, op, d, v, acc, w)
    if w == 1:
        b.line(f"if ({ai} < 0 || {better}) {{ {acc} = {v}; {ai} = {ix}; }}")
        return
    m = b.tmp()
    b.line(f"long{w} {m} = convert_long{w}({better}) | ({ai} < 0);")
    mv = f"convert_{MASK_T[_size(d)]}{w}({m})"
    b.line(f"{acc} = select({acc}, {v}, {mv}); {ai} = select({ai}, {ix}, {m});")


def _size(d) -> int:
    return 4 if np.dtype(d) in (F16, BF16) else np.dtype(d).itemsize


def _combine(b: _Body, op: str, d, acc: tuple, other: tuple) -> None:
    """acc ⊕= other for two scalar partial results of one reduction (lanes or work-items, each
    over a subset of the steps): argmax/argmin take the better, on a tie the smaller index."""
    if op not in ("argmax", "argmin"):
        _update(b, op, d, acc, other[0], None, 1)
        return
    (a, ai), (v, i) = acc, other
    better = _better(b, op, d, v, a, 1)
    same = f"({v} == {a} || (isnan({v}) && isnan({a})))" if _is_float(d) else f"({v} == {a})"
    b.line(f"if ({i} >= 0 && ({ai} < 0 || {better} || ({same} && {i} < {ai}))) {{ {a} = {v}; {ai} = {i}; }}")


def _horizontal(b: _Body, r: KExpr, names, w: int, tail) -> tuple:
    """Combine W lane accumulators and the scalar tail accumulator into one (scalar) result."""
    for j in range(w):
        _combine(b, r.arg, np.dtype(r.src[0].dtype), tail, tuple(f"{n}.s{LANE[j]}" for n in names))
    return tail


def _emit_tree(k: Kernel, out: list, ind: str, local: int) -> None:
    """One work-group per point: its work-items stride over the flattened reduction space, then
    combine their partial results through local memory in a tree; work-item 0 stores."""
    b = _Body(k, out, None, 1, "", ind)
    reds = _reduces(k)
    dep: dict = {}
    for r in reds:
        for n in r.toposort():
            if n is not r and not reads_ridx(n, dep):
                b.val(n)
    accs = {r: _init_acc(b, r, np.dtype(r.src[0].dtype), 1, "a") for r in reds}
    total = int(np.prod(k.reduce_shape, dtype=np.int64))
    steps = -(-total // local)  # per work-item
    blocks = _SumBlocks(b, [(accs[r][0], b.ty(r.dtype, 1)) for r in blocked_sums(reds, steps)], steps)
    b.line(f"for (long rf = lid; rf < {total}L; rf += {local}L) {{")
    b.ind += "  "
    _decompose(out, b.ind, "rf", [(f"r{a}", n) for a, n in enumerate(k.reduce_shape)], tmp="qr_")
    _loop_body(b, reds, {r: (names, 1, None) for r, names in accs.items()}, 0, indent=False, blocks=blocks)
    b.ind = b.ind[:-2]
    b.line("}")
    blocks.finish()
    for j, r in enumerate(reds):
        names = accs[r]
        b.line(f"sh{j}[lid] = {names[0]};" + (f" sh{j}i[lid] = {names[1]};" if len(names) > 1 else ""))
    b.line("barrier(CLK_LOCAL_MEM_FENCE);")
    b.line(f"for (int s = {local // 2}; s > 0; s >>= 1) {{")
    b.line("  if (lid < s) {")
    b.ind += "    "
    for j, r in enumerate(reds):
        names = accs[r]
        other = (f"sh{j}[lid + s]",) + ((f"sh{j}i[lid + s]",) if len(names) > 1 else ())
        _combine(b, r.arg, np.dtype(r.src[0].dtype), names, other)
        b.line(f"sh{j}[lid] = {names[0]};" + (f" sh{j}i[lid] = {names[1]};" if len(names) > 1 else ""))
    b.ind = b.ind[:-4]
    b.line("  }")
    b.line("  barrier(CLK_LOCAL_MEM_FENCE);")
    b.line("}")
    b.line("if (lid == 0) {")
    b.ind += "  "
    for r in reds:
        names = accs[r]
        b.memo[(r, True)] = names[1] if r.arg in ("argmax", "argmin") else names[0]
    for st in k.stores:
        b.store(st, True)
    b.ind = b.ind[:-2]
    b.line("}")
    b.line("barrier(CLK_LOCAL_MEM_FENCE);  // the next point reuses the local arrays")


def _local_arrays(k: Kernel, local: int) -> list:
    lines = []
    for j, r in enumerate(_reduces(k)):
        lines.append(f"  __local {VALUE_T[np.dtype(r.src[0].dtype)]} sh{j}[{local}];")
        if r.arg in ("argmax", "argmin"):
            lines.append(f"  __local long sh{j}i[{local}];")
    return lines


def render(k: Kernel, *, width: int = 1, fp64: bool = True, int64_atomics: bool = True,
           tree: int = 0, tree_below: int = 0, owners: int = 0, mode: str | None = None,
           base_align: int = 0) -> Rendered:
    """OpenCL C for a kernel. `width`: the device's preferred vector width for its dtypes;
    `tree`: the work-group size of tree reductions (0: none, as on CPU devices, where one
    work-group runs on one core), used for kernels of fewer than `tree_below` points reducing
    at least 8 steps per work-item; `owners`: the work-items that share an owner axis in place
    of atomic adds (0: atomics where they exist; choose_mode); `mode` overrides the choice;
    `base_align`: the bytes every buffer's start is aligned to (vector accesses that need
    alignment are used only where it is proven)."""
    used = {np.dtype(b.dtype) for b in k.buffers} | {np.dtype(n.dtype) for n in _nodes(k)}
    if F64 in used and not fp64:
        raise CompileError(f"opencl: kernel {k.name} needs float64, which this device lacks "
                           "(no cl_khr_fp64); use float32", backend="opencl", kernel=pp_kernel(k))
    name = cname(k)
    if mode is None:
        mode = choose_mode(k, width, int64_atomics=int64_atomics, owners=owners)
        steps = int(np.prod(k.reduce_shape, dtype=np.int64)) if k.has_reduce else 0
        rows = k.row_stores or len(reduce_levels(st.value for st in k.stores)) > 1
        if tree and mode != "serial" and not k.serial and not rows and k.size < tree_below and \
                steps >= 8 * tree:
            mode = "tree"
    assert mode in ("par", "red", "scalar", "serial", "tree", "owner"), mode
    if mode == "tree":
        assert tree and tree & (tree - 1) == 0 and k.has_reduce, "tree mode: a power-of-two work-group"
    W = width if mode == "par" else red_width(width) if mode == "red" else 1
    head = ["// generated by tilefuse from:"] + ["// " + ln for ln in pp_kernel(k).splitlines()]
    if F64 in used:
        head.append("#pragma OPENCL EXTENSION cl_khr_fp64 : enable")
    if any(s.mode == "add" and np.dtype(k.buffers[s.buffer].dtype) in ATOMIC64_DTYPES for s in k.stores):
        head.append("#pragma OPENCL EXTENSION cl_khr_int64_base_atomics : enable")
    params = ", ".join(f"__global {'const ' if i < k.n_inputs else ''}{STORE_T[np.dtype(b.dtype)]}* b{i}"
                       for i, b in enumerate(k.buffers))
    out = head + [f"__kernel void {name}({params}) {{"]
    shape = tuple(k.shape)
    atomic = mode not in ("serial", "owner")
    if mode == "owner":  # a block of the owner axis per work-item, the rest of the space in order
        a = k.owner_axis
        n_a = shape[a]
        block = -(-n_a // min(owners or n_a, n_a))
        units = -(-n_a // block)
        rest = [(f"i{j}", n) for j, n in enumerate(shape) if j != a]
        out.append(f"  for (long w = get_global_id(0); w < {units}L; w += get_global_size(0)) {{")
        out.append(f"    const long lo = w * {block}L, hi = min(lo + {block}L, {n_a}L);")
        out.append(f"    for (long u = 0; u < {k.size // n_a}L; ++u) {{")
        _decompose(out, "      ", "u", rest)
        out.append(f"      for (long i{a} = lo; i{a} < hi; ++i{a}) {{")  # contiguous when a is last
        _emit_body(k, out, "        ", None, 1, "", atomic, base_align)
        out.append("      }")
        out.append("    }")
        out.append("  }")
    elif mode == "par":
        n_last = shape[-1]
        chunks = -(-n_last // W)
        units = int(np.prod(shape[:-1], dtype=np.int64)) * chunks
        out.append(f"  for (long u = get_global_id(0); u < {units}L; u += get_global_size(0)) {{")
        last = len(shape) - 1
        _decompose(out, "    ", "u", [(f"i{a}", n) for a, n in enumerate(shape[:-1])] + [("c_", chunks)])
        out.append(f"    const long ib = c_ * {W}L;")
        vary = ("idx", last)
        if n_last % W:
            out.append(f"    if (ib + {W}L <= {n_last}L) {{")
            _emit_body(k, out, "      ", vary, W, "ib", atomic, base_align)
            out.append("    } else {")
            out.append(f"      for (long i{last} = ib; i{last} < {n_last}L; ++i{last}) {{")
            _emit_body(k, out, "        ", None, 1, "", atomic, base_align)
            out.append("      }")
            out.append("    }")
        else:
            _emit_body(k, out, "    ", vary, W, "ib", atomic, base_align)
        out.append("  }")
    elif mode == "tree":
        units = k.size
        out += _local_arrays(k, tree)
        out.append("  const int lid = get_local_id(0);")
        out.append(f"  for (long u = get_group_id(0); u < {units}L; u += get_num_groups(0)) {{")
        _decompose(out, "    ", "u", [(f"i{a}", n) for a, n in enumerate(shape)])
        _emit_tree(k, out, "    ", tree)
        out.append("  }")
    else:
        units = k.size
        if mode == "serial":
            out.append("  if (get_global_id(0) != 0) return;  // \"add\" stores: one work-item, in order")
            out.append(f"  for (long u = 0; u < {units}L; ++u) {{")
        else:
            out.append(f"  for (long u = get_global_id(0); u < {units}L; u += get_global_size(0)) {{")
        _decompose(out, "    ", "u", [(f"i{a}", n) for a, n in enumerate(shape)])
        vary = ("ridx", len(k.reduce_shape) - 1) if mode == "red" else None
        _emit_body(k, out, "    ", vary, W, f"r{len(k.reduce_shape) - 1}", atomic, base_align)
        out.append("  }")
    out.append("}")
    return Rendered(name, "\n".join(out) + "\n", units, mode, W, tree if mode == "tree" else 0)
