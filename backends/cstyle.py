"""Tile kernels (ir/kernel/tile.py) printed as C-like source: one printer for every C-like
language, a dialect a table of spellings (OpenCL C here; WGSL, CUDA C would be others). The
printer schedules nothing: the tile kernel says which loops are launch dimensions, which are
work-items, what is unrolled, where vectors are and what memory lives where.

Launch: grid Ranges are work-groups (innermost grid Range first, dimensions beyond the dialect's
last folded into it), lane Ranges the work-items of one. "scratch" Allocs are carved from one
workspace buffer, an extra last parameter holding `scratch_elems` elements per work-group.
Semantics are the kernel IR's (ir/kernel/interp.py): C division, numpy's NaN-propagating
max/min, float16 in buffers as half (vload_half: no cl_khr_fp16 needed), bfloat16 as ushort
bits, both computed in float."""
from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

import numpy as np

from tilefuse.ir import dtypes
from tilefuse.ir.errors import CompileError
from tilefuse.ir.kernel.ir import INDEX, KExpr
from tilefuse.ir.kernel.tile import (Alloc, Barrier, If, PrintedValues, Range, Store, TileKernel, expressions, key_text,
                                     lanes_of)

F16, BF16, F32, F64 = dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64
BOOL, I32, I64, U32, U64 = dtypes.bool_, dtypes.int32, dtypes.int64, dtypes.uint32, dtypes.uint64
VALUE_T = {BOOL: "uchar", I32: "int", U32: "uint", I64: "long", U64: "ulong", F16: "float", BF16: "float",
           F32: "float", F64: "double", dtypes.int8: "char", dtypes.uint8: "uchar", dtypes.int16: "short",
           dtypes.uint16: "ushort"}  # 8/16-bit ints are only loaded, stored and cast (computed as int)
STORE_T = {**VALUE_T, F16: "half", BF16: "ushort"}
MASK_T = {1: "char", 2: "short", 4: "int", 8: "long"}
FLOAT_FN = {"exp": "exp", "log": "log", "log1p": "log1p", "expm1": "expm1", "tanh": "tanh",
            "sqrt": "sqrt", "rsqrt": "rsqrt", "sin": "sin", "cos": "cos", "erf": "erf",
            "floor": "floor", "ceil": "ceil", "round": "rint"}
ARITH = {"add": "+", "sub": "-", "mul": "*", "and": "&", "or": "|", "xor": "^"}
COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


@dataclass(frozen=True)
class Dialect:
    """The spellings of one C-like language."""
    kernel: str = "__kernel void"
    global_ptr: str = "__global"
    shared_decl: str = "__local"
    group_id: str = "get_group_id({})"
    local_id: str = "get_local_id({})"
    barrier: str = "barrier(CLK_LOCAL_MEM_FENCE);"
    dims: int = 3
    let: str = "const {ty} {name} = {expr};"
    loop: str = "for (long {v} = 0; {v} < {n}; {v}++) {{"
    index: str = "{}L"  # an index literal


OPENCL = Dialect()


@dataclass(frozen=True)
class Printed:
    """A tile kernel's source and launch shape."""
    name: str
    source: str
    groups: tuple         # work-groups per dimension (dimension 0 first)
    local: tuple          # work-items per work-group per dimension
    scratch_elems: int    # workspace elements per work-group (0: no workspace parameter)
    scratch_dtype: np.dtype
    sizes: int = 0        # run-time sizes (tile.size), long parameters after the workspace

    @property
    def global_size(self) -> tuple:
        return tuple(g * l for g, l in zip(self.groups, self.local))


def literal(value, dtype) -> str:
    d = np.dtype(dtype)
    if d == BOOL:
        return "((uchar)1)" if value else "((uchar)0)"
    if dtypes.is_float(d):
        v = float(value)
        t = "double" if d == F64 else "float"
        if math.isnan(v):
            return f"(({t})NAN)"
        if math.isinf(v):
            return f"(({t})INFINITY)" if v > 0 else f"(-({t})INFINITY)"
        return f"({v.hex()}{'' if d == F64 else 'f'})"
    v, bits = int(value), d.itemsize * 8
    if d == U32:
        return f"((uint){v & 0xFFFFFFFF}u)"
    if d == U64:
        return f"((ulong){v & 0xFFFFFFFFFFFFFFFF}UL)"
    t, suffix = ("long", "L") if bits == 64 else ("int", "")
    if v == -(1 << (bits - 1)):
        return f"(({t})(-{(1 << (bits - 1)) - 1}{suffix}-1{suffix}))"
    return f"(({t}){v}{suffix})"


def cname(k: TileKernel) -> str:
    digest = hashlib.sha1(key_text(k).encode()).hexdigest()[:8]
    return f"tf_{re.sub(r'[^A-Za-z0-9_]', '_', k.name)}_{digest}"


def launch_shape(k: TileKernel, dims: int = 3) -> tuple[tuple, tuple, list]:
    """(work-groups per dimension, work-items per work-group per dimension, the grid Ranges of
    each dimension): dimension 0 is the innermost grid Range; Ranges past the last dimension fold
    into it, the outermost (the first, whose extent a run-time batch size sets) varying slowest."""
    grid, lanes = k.grid(), k.lanes()
    gdims = [[r] for r in reversed(grid[-dims:])]
    if len(grid) > dims:
        gdims[-1] = list(reversed(grid[:len(grid) - dims + 1]))
    groups = tuple(math.prod(int(r.extent) for r in rs) for rs in gdims) or (1,)
    local = tuple(int(r.extent) for r in reversed(lanes))
    n = max(len(groups), len(local))
    return groups + (1,) * (n - len(groups)), local + (1,) * (n - len(local)), gdims


def sizes_read(k: TileKernel) -> int:
    """How many run-time sizes the kernel reads (1 + the highest tile.size it uses; 0: none)."""
    return 1 + max((n.arg for st in _all_statements(k.body) for root in expressions(st)
                    for n in root.toposort() if n.op == "size"), default=-1)


class _Printer(PrintedValues):
    def __init__(self, k: TileKernel, d: Dialect):
        self.k, self.d = k, d
        self.lines: list[str] = []
        self.memo: list[dict] = [{}]  # one layer per block: a value computed inside stays inside
        self.consts: dict = {}        # unrolled variables -> their value in this copy
        self.width: dict = {}
        self.n = 0
        self.allocs = {a.name: a for a in k.allocs()}
        self.scratch_at: dict = {}
        total = 0
        for a in self.allocs.values():
            if a.scope == "scratch":
                self.scratch_at[a.name] = total
                total += a.size
        self.scratch = total
        self.whole = self._whole_registers()
        self.vectors = self._vector_registers()
        sd = {np.dtype(a.dtype) for a in self.allocs.values() if a.scope == "scratch"}
        if len(sd) > 1:
            raise CompileError(f"{k.name}: scratch memory of several dtypes {sd}", backend="cstyle")
        self.scratch_dtype = sd.pop() if sd else F32

    def _whole_registers(self) -> set:
        """Register Allocs only ever accessed whole (offset 0, all their elements at once): printed
        as one variable (a scalar or a vector), which compilers keep in registers more surely than
        an array (PoCL keeps private arrays of multi-item work-groups in memory)."""
        regs = {n: a for n, a in self.allocs.items() if a.scope == "register"}
        whole = {n for n, a in regs.items() if a.size in (1, 2, 3, 4, 8, 16)}  # (the vector types)
        for target, off, w in self._accesses():
            if target in whole and not (off.op == "const" and off.arg == 0 and w == regs[target].size):
                whole.discard(target)
        return whole

    def _vector_registers(self) -> dict:
        """Other register Allocs only accessed as vectors of one width w at offsets that are
        multiples of w: printed as arrays of vectors (PoCL keeps a float array read by vloadN in
        memory). name -> w."""
        found: dict = {n: 0 for n, a in self.allocs.items() if a.scope == "register" and n not in self.whole}
        for target, off, w in self._accesses():
            if target not in found:
                continue
            k = off.arg if off.op == "const" else off.src[1].arg \
                if off.op == "mul" and off.src[1].op == "const" else 1
            if w == 1 or k % w or found[target] not in (0, w):
                del found[target]
            else:
                found[target] = w
        return {n: w for n, w in found.items() if w}

    def _accesses(self):
        """(target, offset, width) of every load and store of the kernel."""
        seen: set = set()
        for st in _all_statements(self.k.body):
            if isinstance(st, Store):
                yield st.target, st.offset, lanes_of(st.value, self.width)
            for root in ([st.offset, st.value] if isinstance(st, Store) else [st.cond] if isinstance(st, If)
                         else [st.extent] if isinstance(st, Range) and isinstance(st.extent, KExpr) else []):
                for n in root.toposort(seen):
                    seen.add(n)
                    if n.op == "load":
                        yield n.arg, n.src[0], lanes_of(n.src[0], self.width)
                    elif n.op == "vload":
                        yield n.arg[0], n.src[0], n.arg[1]

    # -- helpers ------------------------------------------------------------------------------
    def lit(self, value, dtype) -> str:
        return literal(value, dtype)

    def line(self, s: str, depth: int) -> None:
        self.lines.append("    " * depth + s)

    def lanes(self, n: KExpr) -> int:
        return lanes_of(n, self.width)

    def ty(self, d, w: int = 1) -> str:
        t = VALUE_T[np.dtype(d)]
        return t if w == 1 else f"{t}{w}"

    # -- expressions --------------------------------------------------------------------------
    def val(self, n: KExpr, depth: int) -> str:
        if n.op == "var" and n.arg in self.consts:
            return self.lit(self.consts[n.arg], INDEX)
        got = self.lookup(n)
        if got is not None:
            return got
        expr = self.expr(n, depth)
        if n.op in ("const", "var"):
            self.memo[-1][n] = expr
            return expr
        self.n += 1
        name = f"v{self.n}"
        self.line(self.declare(name, self.ty(n.dtype, self.lanes(n)), expr), depth)
        self.memo[-1][n] = name
        return name

    # the statements' spellings (another C-like language overrides these)
    def declare(self, name: str, ty: str, expr: str) -> str:
        return self.d.let.format(ty=ty, name=name, expr=expr)

    def loop_head(self, v: str, extent: str) -> str:
        return self.d.loop.format(v=v, n=extent)

    def alloc_decl(self, a: Alloc) -> str | None:
        if a.name in self.whole:
            return f"{self.ty(a.dtype, a.size)} {a.name};"
        if a.name in self.vectors:
            w = self.vectors[a.name]
            return f"{self.ty(a.dtype, w)} {a.name}[{a.size // w}];"
        if a.scope == "register":
            return f"{self.ty(a.dtype)} {a.name}[{a.size}];"
        if a.scope == "shared":
            return f"{self.d.shared_decl} {STORE_T[np.dtype(a.dtype)]} {a.name}[{a.size}];"
        return None  # scratch: carved from the workspace

    def extent(self, n: int) -> str:
        return self.d.index.format(n)

    def ptr(self, target) -> tuple[str, np.dtype]:
        """The C pointer expression of a target and its element dtype."""
        if isinstance(target, int):
            return f"b{target}", np.dtype(self.k.buffers[target].dtype)
        a = self.allocs[target]
        if a.scope == "scratch":
            return f"(ws + {self.scratch_at[target]})", np.dtype(a.dtype)
        return target, np.dtype(a.dtype)

    def expr(self, n: KExpr, depth: int) -> str:
        op, d = n.op, np.dtype(n.dtype)
        w = self.lanes(n)
        if op == "const":
            return self.lit(n.arg, d)
        if op == "var":
            return n.arg
        if op == "size":  # a run-time size: a kernel parameter (sizes_read)
            return f"s{n.arg}"
        if op == "mma":  # a Target without MMA entries never gets one
            raise CompileError(f"cstyle: no warp matrix-multiply-accumulate (mma {n.arg})", backend="cstyle")
        if op == "iota":
            return f"((long{w})({', '.join(str(i) for i in range(w))}))"
        if op == "load" and self.lanes(n.src[0]) > 1:  # a gather: a load per lane
            ptr, sd = self.ptr(n.arg)
            off = self.val(n.src[0], depth)
            lanes = ", ".join(self.scalar_load(ptr, sd, f"{off}.s{i:x}") for i in range(w))
            return f"(({self.ty(d, w)})({lanes}))"
        if op in ("load", "vload") and (n.arg if op == "load" else n.arg[0]) in self.whole:
            return n.arg if op == "load" else n.arg[0]
        if op == "vload" and n.arg[0] in self.vectors:
            return f"{n.arg[0]}[({self.val(n.src[0], depth)}) / {n.arg[1]}]"
        if op in ("load", "vload"):
            target, lanes = (n.arg, 1) if op == "load" else n.arg
            ptr, sd = self.ptr(target)
            off = self.val(n.src[0], depth)
            if lanes == 1:
                if sd == F16:
                    return f"vload_half({off}, {ptr})"
                x = f"{ptr}[{off}]"
                return f"as_float((uint){x} << 16)" if sd == BF16 else x
            if sd == F16:  # lane by lane: PoCL's x86 vload_halfN is an aligned move (needs N*2 bytes)
                return f"((float{lanes})({', '.join(f'vload_half(({off}) + {i}, {ptr})' for i in range(lanes))}))"
            x = f"vload{lanes}(0, {ptr} + {off})"
            return f"as_float{lanes}(convert_uint{lanes}({x}) << 16)" if sd == BF16 else x
        if op == "broadcast":
            return f"(({self.ty(d, w)})({self.val(n.src[0], depth)}))"
        if op in ("hsum", "hmax", "hmin"):
            x, k = self.val(n.src[0], depth), self.lanes(n.src[0])
            while k > 1 and k & (k - 1) == 0:  # halves, each a named vector (NaN tests repeat operands)
                lo, hi, k = f"{x}.lo", f"{x}.hi", k // 2
                self.n += 1
                e = f"({lo} + {hi})" if op == "hsum" else self.binary(op[1:], lo, hi, d, k)
                self.line(self.declare(f"h{self.n}", self.ty(d, k), e), depth)
                x = f"h{self.n}"
            parts = [f"{x}.s{i:x}" for i in range(k)] if k > 1 else [x]
            while len(parts) > 1:  # a tree: log2(k) dependent steps, pairwise sums
                pairs = [parts[i:i + 2] for i in range(0, len(parts), 2)]
                parts = [p[0] if len(p) == 1 else
                         (f"({p[0]} + {p[1]})" if op == "hsum" else self.binary(op[1:], p[0], p[1], d, 1))
                         for p in pairs]
            return parts[0]
        srcs = n.src
        if op == "add" and w > 1 and d in (F32, F64) and any(s.op == "mul" for s in srcs):
            # a vector product accumulated: one fused multiply-add, as the LLVM printers contract it
            prod, acc = (srcs[0], srcs[1]) if srcs[0].op == "mul" else (srcs[1], srcs[0])
            op, srcs = "fma", (*prod.src, acc)
        args = []
        for s in srcs:
            a = self.val(s, depth)
            if w > 1 and self.lanes(s) == 1:  # a scalar operand of a vector op
                a = f"(({self.ty(s.dtype, w)})({a}))"
            args.append(a)
        if op == "select":
            c, a, b = args
            if w == 1:
                return f"({c} ? {a} : {b})"
            return f"select({b}, {a}, {self._mask(c, d, w)})"
        if op == "cast":
            return self.cast(args[0], np.dtype(n.src[0].dtype), d, w, depth)
        if op == "bitcast":
            return self.bitcast(args[0], d, w)
        if op == "fma":
            return f"fma({', '.join(args)})"
        if len(args) == 1:
            return self.unary(op, args[0], d, w)
        return self.binary(op, args[0], args[1], np.dtype(n.src[0].dtype), w)

    def bitcast(self, x: str, d, w: int) -> str:
        return f"as_{self.ty(d, w)}({x})"

    def scalar_load(self, ptr: str, sd, off: str) -> str:
        if sd == F16:
            return f"vload_half({off}, {ptr})"
        return f"as_float((uint){ptr}[{off}] << 16)" if sd == BF16 else f"{ptr}[{off}]"

    def _mask(self, c: str, d, w: int) -> str:
        """A bool vector (uchar 0/1) as the signed mask select() needs for element size of d."""
        mt = f"{MASK_T[np.dtype(d).itemsize]}{w}"
        return f"(-convert_{mt}({c}))"

    def _to_bool(self, cond: str, w: int) -> str:
        return f"(({cond}) ? (uchar)1 : (uchar)0)" if w == 1 else f"convert_uchar{w}(-({cond}))"

    def unary(self, op, x, d, w) -> str:
        one = literal(1, d)
        if op in ("sin", "cos") and w > 1:
            # PoCL's vector sin/cos reduce every lane as its largest (|x| >= ~1e9) needs, which
            # gives lanes under 2**-7 answers like 0.0078: those lanes take their Taylor series
            t, c = f"({x} * {x})", [literal(v, d) for v in ((-1 / 6, 1 / 120, -1 / 5040) if op == "sin"
                                                             else (-1 / 2, 1 / 24, -1 / 720))]
            series = f"({t} * ({c[0]} + {t} * ({c[1]} + {t} * {c[2]})))"
            series = f"({x} * ({one} + {series}))" if op == "sin" else f"({one} + {series})"  # (keeps -0.0)
            return f"select({FLOAT_FN[op]}({x}), {series}, fabs({x}) < {literal(2 ** -5, d)})"
        if op == "tanh":
            # past |x| = 9.01 (19.06 in double) tanh rounds to +-1; PoCL's gives 1 - 1 ulp there,
            # and gelu's derivative, (1 - tanh^2) x ..., turned that into errors of 1e-5
            big = literal(19.1 if d == F64 else 9.1, d)
            if w == 1:
                return f"(fabs({x}) > {big} ? sign({x}) : tanh({x}))"
            return f"select(tanh({x}), sign({x}), fabs({x}) > {big})"
        if op in FLOAT_FN:
            return f"{FLOAT_FN[op]}({x})"
        if op == "neg":
            if d in (I32, I64):
                ut = ("ulong" if d == I64 else "uint") + ("" if w == 1 else str(w))
                return f"as_{self.ty(d, w)}(({ut})(0) - as_{ut}({x}))"
            return f"(-{x})"
        if op == "logistic":
            return f"({one} / ({one} + exp(-{x})))"
        if op == "abs":
            return f"fabs({x})" if dtypes.is_float(d) else f"as_{self.ty(d, w)}(abs({x}))"
        if op == "sign":
            zero = literal(0, d)
            if w == 1:
                return f"({x} > {zero} ? {one} : ({x} < {zero} ? -{one} : {x}))"
            vt = self.ty(d, w)
            return f"select(select({x}, ({vt})(-{one}), {x} < {zero}), ({vt})({one}), {x} > {zero})"
        if op == "not":
            return f"({x} ^ {one})" if d == BOOL else f"(~{x})"
        if op == "is_finite":
            return self._to_bool(f"isfinite({x})", w)
        raise CompileError(f"cstyle: no spelling of the unary op {op!r}", backend="cstyle")

    def binary(self, op, a, b, d, w) -> str:
        if d == BOOL and op in ("add", "mul"):
            op = "or" if op == "add" else "and"
        if op in ("add", "sub", "mul") and d in (I32, I64):  # wrap as numpy does: C's signed overflow is UB
            ut = ("ulong" if d == I64 else "uint") + ("" if w == 1 else str(w))
            return f"as_{self.ty(d, w)}(as_{ut}({a}) {ARITH[op]} as_{ut}({b}))"
        if op in ARITH:
            return f"({a} {ARITH[op]} {b})"
        if op in COMPARE:
            return self._to_bool(f"{a} {COMPARE[op]} {b}", w)
        if op in ("max", "min"):
            if not dtypes.is_float(d):
                return f"{op}({a}, {b})"
            cmp = ">" if op == "max" else "<"
            if w == 1:  # np.maximum: a NaN on either side wins
                return f"(({a} {cmp} {b} || isnan({a})) ? {a} : {b})"
            return f"select({b}, {a}, ({a} {cmp} {b}) | isnan({a}))"
        if op == "pow":
            return f"pow({a}, {b})"
        if op in ("div", "rem"):
            if dtypes.is_float(d):
                return f"({a} / {b})" if op == "div" else f"fmod({a}, {b})"
            return self.int_divrem(op, a, b, d, w)
        if op in ("shift_left", "shift_right_logical"):
            ut = ("ulong" if d.itemsize == 8 else "uint") + ("" if w == 1 else str(w))
            vt = self.ty(d, w)
            sh = f"({a} << {b})" if op == "shift_left" else f"as_{vt}(as_{ut}({a}) >> as_{ut}({b}))"
            zero, bits = literal(0, d), literal(d.itemsize * 8, d)
            bad = f"({b} >= {bits})" if d.kind == "u" else f"(({b} < {zero}) | ({b} >= {bits}))"
            if w == 1:  # numpy: shifting by the width or more (or by < 0) gives 0
                return f"({bad} ? {zero} : {sh})"
            return f"select({sh}, ({vt})({zero}), {bad})"
        raise CompileError(f"cstyle: no spelling of the binary op {op!r}", backend="cstyle")

    def int_divrem(self, op, a, b, d, w) -> str:
        """C division with numpy's answers at the edges (never a trap): x/0 = 0, x%0 = x, and
        MIN/-1 wraps (the lowering guards zero where the primitive defines it; this guards any)."""
        zero, one, sym = literal(0, d), literal(1, d), "/" if op == "div" else "%"
        signed = d.kind != "u"
        ut = ("ulong" if d.itemsize == 8 else "uint") + ("" if w == 1 else str(w))
        if w == 1:
            neg = f"({self.ty(d)})(({ut})0 - ({ut}){a})"
            edge = (f"({b} == -{one}) ? {neg if op == 'div' else zero} : " if signed else "")
            return f"(({b} == {zero}) ? {a if op == 'rem' else zero} : {edge}({a} {sym} {b}))"
        vt = self.ty(d, w)
        z = f"({b} == ({vt})({zero}))"
        m1 = f"({b} == ({vt})(-{one}))" if signed else f"({b} != {b})"
        safe = f"select({b}, ({vt})({one}), {z} | {m1})"
        q = f"select({a} {sym} {safe}, " + (f"as_{vt}(({ut})(0) - as_{ut}({a}))" if op == "div" else f"({vt})({zero})") \
            + f", {m1})"
        return f"select({q}, {a if op == 'rem' else f'({vt})({zero})'}, {z})"

    def cast(self, x, src, dst, w, depth) -> str:
        vs, vd = VALUE_T[src], VALUE_T[dst]
        if dst == BOOL:
            return self._to_bool(f"{x} != {literal(0, src)}", w)
        conv = x if vs == vd else (f"(({vd}){x})" if w == 1 else f"convert_{vd}{w}({x})")
        if dst == U64 and dtypes.is_float(src):  # C leaves a negative float → ulong undefined:
            # below 2**63 go through long, so negatives wrap as numpy's do
            if w == 1:
                return f"(({x}) >= 0x1p63 ? {conv} : (ulong)(long)({x}))"
            big = f"({x} >= ({vs}{w})(0x1p63))"  # (a select's mask must be as wide as the lanes)
            mask = big if vs == "double" else f"convert_long{w}({big})"
            return f"select(as_ulong{w}(convert_long{w}({x})), {conv}, {mask})"
        if dst == F16:  # round to half and back: a float holding a half's value
            self.n += 1
            t = f"h{self.n}"
            # (half arrays need cl_khr_fp16: the bits go through a ushort array instead)
            if w == 1:
                self.line(f"ushort {t}[1]; vstore_half_rte({conv}, 0, (__private half*){t});", depth)
                return f"vload_half(0, (__private half*){t})"
            self.line(f"ushort {t}[{w}] __attribute__((aligned({2 * w}))); "
                      f"vstore_half{w}_rte({conv}, 0, (__private half*){t});", depth)
            return f"vload_half{w}(0, (__private half*){t})"
        if dst == BF16:
            t = "uint" if w == 1 else f"uint{w}"
            u = f"as_{t}({conv})"
            rne = f"(({u} + 0x7FFFu + (({u} >> 16) & 1u)) & 0xFFFF0000u)"  # (a NaN's payload could carry)
            return f"as_float{'' if w == 1 else w}(select({rne}, ({u} | 0x400000u) & 0xFFFF0000u, isnan({conv})))"
        return conv

    # -- statements ---------------------------------------------------------------------------
    def store(self, s: Store, depth: int) -> None:
        if s.target in self.whole:
            self.line(f"{s.target} = {self.val(s.value, depth)};", depth)
            self.forget(s.target)
            return
        if s.target in self.vectors:
            self.line(f"{s.target}[({self.val(s.offset, depth)}) / {self.vectors[s.target]}] = "
                      f"{self.val(s.value, depth)};", depth)
            self.forget(s.target)
            return
        ptr, sd = self.ptr(s.target)
        off = self.val(s.offset, depth)
        v = self.val(s.value, depth)
        w = self.lanes(s.value)
        if s.mode == "add" or self.lanes(s.offset) > 1:  # lane by lane: atomic adds, scatters
            for i in range(max(w, self.lanes(s.offset))):
                o = f"{off}.s{i:x}" if self.lanes(s.offset) > 1 else off
                x = f"{v}.s{i:x}" if w > 1 else v
                if s.mode == "add":
                    self.atomic_add(ptr, o, x, sd, depth)
                else:
                    self.scalar_store(ptr, sd, o, x, depth)
            self.forget(s.target)
            return
        if sd == F16 and w > 1:  # (lane by lane: see the load)
            for i in range(w):
                self.line(f"vstore_half_rte({v}.s{i:x}, ({off}) + {i}, {ptr});", depth)
        elif sd == F16:
            self.line(f"vstore_half_rte({v}, {off}, {ptr});", depth)
        elif sd == BF16:
            bits = self.cast(v, F32, BF16, w, depth)  # round, then keep the upper half
            hi = f"convert_ushort{'' if w == 1 else w}(as_uint{'' if w == 1 else w}({bits}) >> 16)" \
                if w > 1 else f"(ushort)(as_uint({bits}) >> 16)"
            self.line(f"{ptr}[{off}] = {hi};" if w == 1 else f"vstore{w}({hi}, 0, {ptr} + {off});", depth)
        elif w == 1:
            self.line(f"{ptr}[{off}] = {v};", depth)
        else:
            self.line(f"vstore{w}({v}, 0, {ptr} + {off});", depth)
        self.forget(s.target)

    def scalar_store(self, ptr: str, sd, off: str, v: str, depth: int) -> None:
        if sd == F16:
            self.line(f"vstore_half_rte({v}, {off}, {ptr});", depth)
        elif sd == BF16:
            self.line(f"{ptr}[{off}] = (ushort)(as_uint({self.cast(v, F32, BF16, 1, depth)}) >> 16);", depth)
        else:
            self.line(f"{ptr}[{off}] = {v};", depth)

    def atomic_add(self, ptr: str, off: str, v: str, sd, depth: int) -> None:
        """ptr[off] += v, atomically: integer atomics, floats by compare-and-swap of the bits."""
        p = f"{ptr} + {off}"
        if sd in (I32, U32):
            self.line(f"atomic_add((volatile __global {VALUE_T[sd]}*)({p}), {v});", depth)
        elif sd in (I64, U64):
            self.line(f"atom_add((volatile __global {VALUE_T[sd]}*)({p}), {v});", depth)
        elif sd in (F32, F64):
            ut, cas = ("uint", "atomic_cmpxchg") if sd == F32 else ("ulong", "atom_cmpxchg")
            self.n += 1
            q, old, prev = f"q{self.n}", f"o{self.n}", f"p{self.n}"
            self.line(f"{{ volatile __global {ut}* {q} = (volatile __global {ut}*)({p}); "
                      f"{ut} {old} = *{q}, {prev};", depth)
            self.line(f"  do {{ {prev} = {old}; {old} = {cas}({q}, {prev}, as_{ut}(as_{VALUE_T[sd]}({prev}) "
                      f"+ {v})); }} while ({old} != {prev}); }}", depth)
        else:
            raise CompileError(f"cstyle: no atomic add of {sd}", backend="cstyle")

    def block(self, body, depth: int) -> None:
        self.memo.append({})
        for s in body:
            if isinstance(s, Range):
                if s.kind == "unroll":
                    for i in range(int(s.extent)):
                        self.consts[s.var] = i
                        self.block(s.body, depth)
                    self.consts.pop(s.var, None)
                    continue
                ext = self.val(s.extent, depth) if isinstance(s.extent, KExpr) else self.extent(int(s.extent))
                self.line(self.loop_head(s.var, ext), depth)
                self.block(s.body, depth + 1)
                self.line("}", depth)
            elif isinstance(s, Alloc):
                decl = self.alloc_decl(s)
                if decl:
                    self.line(decl, depth)
            elif isinstance(s, Store):
                self.store(s, depth)
            elif isinstance(s, Barrier):
                self.line(self.d.barrier, depth)
                self.memo = [{} for _ in self.memo]  # other work-items wrote shared memory
            elif isinstance(s, If):
                self.line(f"if ({self.val(s.cond, depth)}) {{", depth)
                self.block(s.body, depth + 1)
                self.line("}", depth)
        self.memo.pop()

    def print(self) -> Printed:
        k, d = self.k, self.d
        name = cname(k)
        lanes = k.lanes()
        if len(lanes) > d.dims:
            raise CompileError(f"{k.name}: {len(lanes)} work-item dimensions, the device has {d.dims}",
                               backend="cstyle")
        groups, local, gdims = launch_shape(k, d.dims)
        params = [f"{d.global_ptr} {'const ' if i < k.n_inputs else ''}{STORE_T[np.dtype(b.dtype)]}* "
                  f"restrict b{i}" for i, b in enumerate(k.buffers)]
        if self.scratch:
            params.append(f"{d.global_ptr} {VALUE_T[self.scratch_dtype]}* restrict ws_all")
        n_sizes = sizes_read(k)
        params += [f"const long s{i}" for i in range(n_sizes)]
        # (the key text, not the kernel's: no buffer size or batch size in the source, so that a new
        # batch size finds the driver's build of the same code)
        head = ["// generated by tilefuse from:", *("// " + ln for ln in key_text(k).splitlines())]
        if any(np.dtype(b.dtype) == F64 for b in k.buffers) or \
                any(np.dtype(n.dtype) == F64 for st in _stores(k.body) for n in st.value.toposort()):
            head.append("#pragma OPENCL EXTENSION cl_khr_fp64 : enable")
        if any(s.mode == "add" and np.dtype(k.buffers[s.target].dtype) in (I64, F64) for s in _stores(k.body)):
            head.append("#pragma OPENCL EXTENSION cl_khr_int64_base_atomics : enable")
        self.lines = head + [f"{d.kernel} {name}({', '.join(params)}) {{"]
        for dim, rs in enumerate(gdims):
            gid = d.group_id.format(dim)
            for r in rs[:-1]:  # folded: the innermost of them varies fastest
                self.line(f"const long {r.var} = (long){gid} % {int(r.extent)}L;", 1)
                gid = f"((long){gid} / {int(r.extent)}L)"
            self.line(f"const long {rs[-1].var} = (long){gid};", 1)
        for dim, r in enumerate(reversed(lanes)):
            self.line(f"const long {r.var} = (long){d.local_id.format(dim)};", 1)
        if self.scratch:  # (the outermost dimension's groups are not in the product: a batch size sets them)
            flat = " + ".join(f"(long)get_group_id({i}) * {math.prod(groups[:i])}L" for i in range(len(gdims)))
            self.line(f"{d.global_ptr} {VALUE_T[self.scratch_dtype]}* ws = ws_all + ({flat}) * "
                      f"{self.scratch}L;", 1)
        self.block(k.inner(), 1)
        self.lines.append("}")
        return Printed(name, "\n".join(self.lines) + "\n", groups, local, self.scratch, self.scratch_dtype, n_sizes)


def _all_statements(body):
    for s in body:
        yield s
        if isinstance(s, (Range, If)):
            yield from _all_statements(s.body)


def _stores(body):
    for s in body:
        if isinstance(s, Store):
            yield s
        elif isinstance(s, (Range, If)):
            yield from _stores(s.body)


def print_tile(k: TileKernel, dialect: Dialect = OPENCL) -> Printed:
    """C-like source of a tile kernel for `dialect`, with its launch shape."""
    return _Printer(k, dialect).print()
