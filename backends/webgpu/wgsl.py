"""Tile kernels as WGSL: the shared C-like printer (backends/cstyle.py) with WGSL's spellings.

WGSL has no 64-bit types: indices are i32 (buffers hold fewer than 2**31 elements) and the
device refuses float64/int64 arrays. Its storage holds 32-bit words only: elements of 1 or 2
bytes (bool, int8, float16, bfloat16) are read out of their word and written with an atomicAnd
and an atomicOr on it, which leaves the word's other elements alone. Float atomic adds are
compare-and-swap loops. No NaN test is trusted to survive the compiler: NaN and Inf are read from
the bits. GPU targets only (a work-item per point: no vectors)."""
from __future__ import annotations

import numpy as np

from tilefuse.ir import dtypes
from tilefuse.ir.errors import CompileError
from tilefuse.ir.kernel.mathlib import expand
from tilefuse.ir.kernel.tile import Store, TileKernel, key_text

from ..cstyle import ARITH, BF16, BOOL, COMPARE, F16, F32, I32, I64, U32, Dialect, Printed, _Printer, _stores, cname

VALUE = {F32: "f32", F16: "f32", BF16: "f32", I32: "i32", I64: "i32", U32: "u32", BOOL: "bool",
         **{np.dtype(t): "i32" if t[0] == "i" else "u32" for t in ("int8", "int16", "uint8", "uint16")}}
FN = {"sqrt": "sqrt", "rsqrt": "inverseSqrt", "sin": "sin",
      "cos": "cos", "floor": "floor", "ceil": "ceil", "round": "round", "abs": "abs"}
MAX_GROUPS = 65535
HELPERS = """fn tf_isnan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }
fn tf_isfinite(x: f32) -> bool { return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u; }
fn tf_signed(x: f32, s: f32) -> f32 { return bitcast<f32>(bitcast<u32>(x) | (bitcast<u32>(s) & 0x80000000u)); }
fn tf_div(a: f32, b: f32) -> f32 {  // IEEE's a / 0 (llvmpipe's division by a constant zero is not)
    if ((bitcast<u32>(b) & 0x7fffffffu) != 0u) { return a / b; }
    let inf = 0x7f800000u | ((bitcast<u32>(a) ^ bitcast<u32>(b)) & 0x80000000u);
    return bitcast<f32>(select(inf, 0x7fc00000u, tf_isnan(a) || (bitcast<u32>(a) & 0x7fffffffu) == 0u));
}
fn tf_fmod_abs(x: f32, y: f32) -> f32 {  // x mod y for x >= 0 and a normal y > 0, exactly
    var r = x;
    for (var i = 0; i < 300 && r >= y; i++) {  // r - t is exact: t <= r < 2t
        let t = ldexp(y, frexp(r).exp - frexp(y).exp);
        r -= select(t, t * 0.5, t > r);
    }
    return r;
}
fn tf_fmod(a: f32, b: f32) -> f32 {  // as C's fmod (WGSL's % is a - b trunc(a / b), inexact)
    if (!tf_isfinite(a) || tf_isnan(b) || b == 0.0) { return bitcast<f32>(0x7fc00000u); }
    if (!tf_isfinite(b)) { return a; }
    let k = select(1.0, 16777216.0, abs(b) < 1.17549435e-38);  // a denormal b: mod b 2^24, then scaled
    let r = tf_fmod_abs(abs(a), abs(b) * k);
    return tf_signed(select(r, tf_fmod_abs(r * k, abs(b) * k) / k, k > 1.0), a);
}
"""


class WGSLPrinter(_Printer):
    def __init__(self, k: TileKernel, atomic: set):
        super().__init__(k, Dialect(barrier="workgroupBarrier();", let="let {name}: {ty} = {expr};", index="{}i",
                                    loop="for (var {v}: i32 = 0i; {v} < {n}; {v}++) {{"))
        self.atomic = atomic  # buffers declared array<atomic<...>>: sub-word stores, atomic adds
        if self.scratch:
            raise CompileError(f"webgpu: kernel {k.name} needs scratch memory (a CPU schedule)", backend="webgpu")

    def lit(self, value, dtype) -> str:
        d = np.dtype(dtype)
        if d == BOOL:
            return "true" if value else "false"
        if dtypes.is_float(d):  # its bits: exact, and NaN, inf and the ends of the range have no literal
            return f"bitcast<f32>({int(np.float32(value).view(np.uint32))}u)"
        if d == U32:
            return f"{int(value) & 0xFFFFFFFF}u"
        v = int(value)
        return "i32(-2147483648)" if v == -(1 << 31) else f"{v}i"

    def ty(self, d, w: int = 1) -> str:
        assert w == 1, "webgpu kernels are scalar"
        return VALUE[np.dtype(d)]

    def bitcast(self, x: str, d, w: int) -> str:
        return f"bitcast<{self.ty(d)}>({x})"

    def alloc_decl(self, a) -> str | None:
        if a.scope == "shared":
            return None  # a module-scope var<workgroup> (print)
        if a.name in self.whole:
            return f"var {a.name}: {self.ty(a.dtype)};"
        return f"var {a.name}: array<{self.ty(a.dtype)}, {a.size}>;"

    # -- memory ---------------------------------------------------------------------------------
    def word(self, target, off: str) -> tuple[str, str, int]:
        """(the 32-bit word holding element `off` of a buffer, the element's bit shift, its size)."""
        size = np.dtype(self.k.buffers[target].dtype).itemsize
        per = 4 // size
        return f"b{target}[u32({off}) / {per}u]", f"((u32({off}) % {per}u) * {8 * size}u)", size

    def load_at(self, target: int, sd, off: str) -> str:
        if sd.itemsize == 4 and target not in self.atomic:
            return f"b{target}[{off}]"
        if sd.itemsize == 4:
            return f"bitcast<f32>(atomicLoad(&b{target}[{off}]))" if sd == F32 else f"atomicLoad(&b{target}[{off}])"
        word, shift, size = self.word(target, off)
        word = f"atomicLoad(&{word})" if target in self.atomic else word
        raw = f"(({word} >> {shift}) & {hex((1 << 8 * size) - 1)}u)"
        if sd == BOOL:
            return f"({raw} != 0u)"
        if sd == F16:
            return f"unpack2x16float({raw}).x"
        if sd == BF16:
            return f"bitcast<f32>({raw} << 16u)"
        if sd.kind == "i":  # sign-extend
            bits = 8 * size
            return f"((i32({raw}) << {32 - bits}u) >> {32 - bits}u)"
        return f"u32({raw})"

    def expr(self, n, depth: int) -> str:
        op = n.op
        if op == "select":
            c, a, b = (self.val(x, depth) for x in n.src)
            return f"select({b}, {a}, {c})"
        if op == "load" and n.arg in self.whole:
            return n.arg
        if op == "load":
            off = self.val(n.src[0], depth)
            if isinstance(n.arg, int):
                return self.load_at(n.arg, np.dtype(self.k.buffers[n.arg].dtype), off)
            return f"{n.arg}[{off}]"
        return super().expr(n, depth)

    def store(self, s: Store, depth: int) -> None:
        off, v = self.val(s.offset, depth), self.val(s.value, depth)
        if s.target in self.whole:
            self.line(f"{s.target} = {v};", depth)
        elif not isinstance(s.target, int):
            self.line(f"{s.target}[{off}] = {v};", depth)
        else:
            sd = np.dtype(self.k.buffers[s.target].dtype)
            p = f"b{s.target}[{off}]"
            if s.mode == "add":
                if sd in (I32, U32):
                    self.line(f"atomicAdd(&{p}, {v});", depth)
                else:  # a float: compare-and-swap on the bits
                    self.line(f"loop {{ let o = atomicLoad(&{p}); if (atomicCompareExchangeWeak(&{p}, o, "
                              f"bitcast<u32>(bitcast<f32>(o) + {v})).exchanged) {{ break; }} }}", depth)
            elif sd.itemsize < 4:
                self.subword_store(s.target, sd, off, v, depth)
            elif s.target in self.atomic:
                self.line(f"atomicStore(&{p}, {f'bitcast<u32>({v})' if sd == F32 else v});", depth)  # (atomic<u32>)
            else:
                self.line(f"{p} = {v};", depth)
        self.forget(s.target)

    def bf16_bits(self, v: str) -> str:  # rounded to nearest even; a NaN stays one (its payload could carry)
        b = f"bitcast<u32>({v})"
        return f"select((({b} + 0x7fffu + (({b} >> 16u) & 1u)) >> 16u), (({b} >> 16u) | 0x40u), tf_isnan({v}))"

    def subword_store(self, target: int, sd, off: str, v: str, depth: int) -> None:
        w, sh, size = self.word(target, off)
        mask = (1 << 8 * size) - 1
        if sd == BOOL:
            bits = f"select(0u, 1u, {v})"
        elif sd == F16:
            bits = f"(pack2x16float(vec2<f32>({v}, 0.0)) & 0xffffu)"
        elif sd == BF16:
            bits = self.bf16_bits(v)
        else:
            bits = f"(u32({v}) & {hex(mask)}u)"
        self.line(f"atomicAnd(&{w}, ~({hex(mask)}u << {sh})); atomicOr(&{w}, {bits} << {sh});", depth)

    # -- ops ---------------------------------------------------------------------------------------
    def unary(self, op, x, d, w) -> str:
        f = dtypes.is_float(d)
        if op in FN and (f or op == "abs"):
            return f"{FN[op]}({x})"
        if op == "neg":
            return f"(-{x})"
        if op == "sign":
            return f"select(select(tf_signed(1.0, {x}), 0.0, {x} == 0.0), {x}, tf_isnan({x}))" if f else f"select(select(0i, -1i, {x} < 0i), 1i, {x} > 0i)"
        if op == "not":
            return f"(!{x})" if d == BOOL else f"(~{x})"
        if op == "is_finite":
            return f"tf_isfinite({x})"
        raise CompileError(f"webgpu: no spelling of the unary op {op!r}", backend="webgpu")

    def binary(self, op, a, b, d, w) -> str:
        if d == BOOL and op in ("add", "mul", "max", "min", "xor"):
            op = {"add": "or", "mul": "and", "max": "or", "min": "and", "xor": "ne"}[op]
        if d == BOOL and op in ("lt", "le", "gt", "ge"):  # (WGSL orders no bools)
            a, b = f"u32({a})", f"u32({b})"
        if op in ARITH:
            return f"({a} {ARITH[op]} {b})"
        if op in COMPARE and dtypes.is_float(d):  # NaN tests from the bits (see the docstring)
            nan = f"tf_isnan({a}) || tf_isnan({b})"
            return f"(({a} != {b}) || {nan})" if op == "ne" else f"(({a} {COMPARE[op]} {b}) && !({nan}))"
        if op in COMPARE:
            return f"({a} {COMPARE[op]} {b})"
        if op in ("max", "min"):
            if not dtypes.is_float(d):
                return f"{op}({a}, {b})"
            cmp = ">" if op == "max" else "<"
            return f"select({b}, {a}, ({a} {cmp} {b}) || tf_isnan({a}))"
        if op in ("div", "rem"):
            if dtypes.is_float(d):
                return f"tf_{'div' if op == 'div' else 'fmod'}({a}, {b})"
            zero, sym = self.lit(0, d), "/" if op == "div" else "%"
            return f"select(({a} {sym} select({b}, {self.lit(1, d)}, {b} == {zero})), {a if op == 'rem' else zero}, " \
                   f"{b} == {zero})"
        if op in ("shift_left", "shift_right_logical"):
            bits = d.itemsize * 8
            sh = f"({a} << u32({b}))" if op == "shift_left" else f"{self.ty(d)}(u32({a}) >> u32({b}))"
            return f"select({sh}, {self.lit(0, d)}, u32({b}) >= {bits}u)"
        raise CompileError(f"webgpu: no spelling of the binary op {op!r}", backend="webgpu")

    def cast(self, x, src, dst, w, depth) -> str:
        if dst == BOOL:
            return f"({x} != {self.lit(0, src)})"
        if src == BOOL:
            return f"select({self.lit(0, dst)}, {self.lit(1, dst)}, {x})"
        if dst == F16:
            return f"unpack2x16float(pack2x16float(vec2<f32>(f32({x}), 0.0))).x"
        if dst == BF16:
            return f"bitcast<f32>({self.bf16_bits(f'f32({x})')} << 16u)"
        if dst.kind in "iu" and dst.itemsize < 4:  # 8/16-bit integers wrap as they are cast
            sh = 32 - 8 * dst.itemsize
            return f"(u32({x}) & {hex((1 << 8 * dst.itemsize) - 1)}u)" if dst.kind == "u" else f"((i32({x}) << {sh}u) >> {sh}u)"
        return x if VALUE[src] == VALUE[dst] else f"{VALUE[dst]}({x})"

    def print(self) -> Printed:
        k = self.k
        grid, lanes = k.grid(), k.lanes()
        if len(lanes) > 3:
            raise CompileError(f"{k.name}: {len(lanes)} work-item dimensions", backend="webgpu")
        n = k.points()
        groups = (min(n, MAX_GROUPS), -(-n // MAX_GROUPS)) if n else (0, 1)
        local = tuple(int(r.extent) for r in reversed(lanes)) or (1,)
        head = ["// generated by tilefuse from:", *("// " + ln for ln in key_text(k).splitlines()), HELPERS]
        for i, b in enumerate(k.buffers):
            d = np.dtype(b.dtype)
            if d in (I64, np.dtype(np.float64), np.dtype(np.uint64)):
                raise CompileError(f"webgpu: kernel {k.name} holds {d} (WGSL has no 64-bit types)", backend="webgpu")
            elem = "u32" if d.itemsize < 4 or d == U32 or (i in self.atomic and d == F32) else VALUE[d]
            if i in self.atomic:
                elem = f"atomic<{'i32' if d == I32 else 'u32'}>"
            mode = "read" if i < k.n_inputs and i not in self.atomic else "read_write"
            head.append(f"@group(0) @binding({i}) var<storage, {mode}> b{i}: array<{elem}>;")
        # a last buffer holds the work-groups and the run-time sizes (the code, headed by key_text, none)
        n_sizes, sizes = len(k.meta.get("sizes", ())), f"b{len(k.buffers)}"
        head.append(f"@group(0) @binding({len(k.buffers)}) var<storage, read> {sizes}: array<i32>;")
        for a in k.allocs():
            if a.scope == "shared":
                head.append(f"var<workgroup> {a.name}: array<{self.ty(a.dtype)}, {a.size}>;")
        self.lines = head + [f"@compute @workgroup_size({', '.join(map(str, local))})",
                             "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {",
                             f"    let gid = i32(wid.x + wid.y * {MAX_GROUPS}u);",
                             f"    if (gid >= {sizes}[0]) {{ return; }}",
                             *(f"    let s{i}: i32 = {sizes}[{i + 1}];" for i in range(n_sizes))]
        rest = "gid"
        for i, r in enumerate(reversed(grid)):  # the last grid Range varies fastest, the first is the rest
            self.line(f"let {r.var}: i32 = {rest}{f' % {int(r.extent)}i' * (i < len(grid) - 1)};", 1)
            rest = f"({rest} / {int(r.extent)}i)"
        for dim, r in enumerate(reversed(lanes)):
            self.line(f"let {r.var}: i32 = i32(lid.{'xyz'[dim]});", 1)
        self.block(k.inner(), 1)
        self.lines.append("}")
        return Printed(cname(k), "\n".join(self.lines) + "\n", groups, local, 0, F32, n_sizes)


def atomic_buffers(k: TileKernel) -> set:
    """Buffers the kernel writes with atomics: adds, and elements narrower than a word."""
    return {s.target for s in _stores(k.body) if isinstance(s.target, int) and
            (s.mode == "add" or np.dtype(k.buffers[s.target].dtype).itemsize < 4)}


def print_wgsl(k: TileKernel) -> Printed:
    k = expand(k)  # WGSL's exp, log, pow... are loose: the kernel IR's (ir/kernel/mathlib.py) instead
    return WGSLPrinter(k, atomic_buffers(k)).print()
