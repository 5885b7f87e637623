"""Tile kernels (ir/kernel/tile.py) printed as LLVM IR for the host CPU (backends/llvm runs them).

The function is the backend's usual `void f(i8** buffers, i64 start, i64 end)`: it runs the grid
points [start, end) (the grid Ranges flattened, the first outermost), so the thread pool splits a
launch as it splits any kernel. Allocs are allocas in the entry block, made once per call:
registers (unrolled code reads them at constant offsets, which SROA turns into SSA vectors) and
scratch (a task's packed panel, on the stack). A CPU schedule has no work-items and no shared
memory; lanes would run as serial loops, so a kernel with a barrier is refused. Expressions go
through the op tables of ops.py, over scalars or vectors of any width (LLVM splits them into
registers); gathers and scatters go lane by lane. After the buffers' pointers, `buffers` holds
the run-time sizes (tile.size: the first axis's extent, GEMM's M and K, ...), which kernels read
instead of constants so that one code serves every batch size.
The printer decides nothing: the vectors, loops and blocks are the scheduler's."""
from __future__ import annotations


import llvmlite.ir as ir
import numpy as np

from tilefuse.ir.errors import CompileError
from tilefuse.ir.kernel.ir import INDEX, KExpr
from tilefuse.ir.kernel.tile import Barrier, If, PrintedValues, Range, Store, TileKernel, lanes_of, pp_tile

from .irutil import _like, counted_loop, no_unroll, splat
from .ops import BF16, BINARY_OPS, BOOL, CMP, F16, I8, TYPES, UNARY_OPS, Ops, _constant, convert, is_float, is_unsigned
from .vecmath import I64

I8P = ir.IntType(8).as_pointer()
FN_T = ir.FunctionType(ir.VoidType(), [I8P.as_pointer(), I64, I64])


def _i(v: int):
    return ir.Constant(I64, v)


class _Printer(PrintedValues):
    def __init__(self, k: TileKernel, fn_name: str):
        self.k = k
        self.refuse()
        self.mod = ir.Module(name=fn_name)
        self.fn = self.function(fn_name)
        self.b = ir.IRBuilder(self.fn.append_basic_block("entry"))
        self.ops = Ops(self.b)
        self._sizes: dict = {}  # i -> the run-time size i, read once
        self.width: dict = {}
        self.memo: list[dict] = [{}]
        self.env: dict = {}  # variable name -> i64 value (unrolled: a constant)
        self.ptrs: dict = {}  # target -> (pointer to elements, storage dtype)

    # -- what a GPU subclass (backends/cuda/tile.py) replaces ----------------------------------
    def refuse(self) -> None:
        k = self.k
        if any(isinstance(s, Barrier) for s in _walk(k.body)) or \
                any(a.scope == "shared" for a in k.allocs()):
            raise CompileError(f"{k.name}: the CPU runs work-groups of one work-item (no barriers, no "
                               "shared memory); schedule it for a CPU target", backend="llvm", kernel=str(k))

    def function(self, fn_name: str) -> ir.Function:
        return ir.Function(self.mod, FN_T, name=fn_name)

    def barrier(self) -> None:
        raise AssertionError("refused: a CPU kernel has no barriers")

    def store_add(self, target, off, v, w: int) -> None:
        raise AssertionError("the CPU tile printer has no atomic adds")

    # -- types --------------------------------------------------------------------------------
    def lanes(self, n: KExpr) -> int:
        return lanes_of(n, self.width)

    def vt(self, d, w: int):
        t = TYPES[np.dtype(d)][0]
        return t if w == 1 else ir.VectorType(t, w)

    # -- memory -------------------------------------------------------------------------------
    def pointer(self, target):
        return self.ptrs[target]

    def elem_ptr(self, target, off, w: int):
        base, sd = self.pointer(target)
        p = self.b.gep(base, [off], inbounds=True)
        if w == 1:
            return p, sd
        return self.b.bitcast(p, ir.VectorType(TYPES[sd][1], w).as_pointer()), sd

    def load(self, target, off, d, w: int):
        """Values in their dtype's register type (as render.TYPES: bfloat16 as its bits, half,
        i1); a cast node widens 16-bit floats where the expression says so."""
        p, sd = self.elem_ptr(target, off, w)
        raw = self.b.load(p, align=sd.itemsize)
        return self.b.icmp_unsigned("!=", raw, splat(raw.type, 0)) if sd == BOOL else raw

    def store(self, target, off, v, w: int) -> None:
        p, sd = self.elem_ptr(target, off, w)
        if sd == BOOL:
            v = self.b.zext(v, _like(v, I8))
        self.b.store(v, p, align=sd.itemsize)

    # -- expressions ----------------------------------------------------------------------------
    def val(self, n: KExpr, w: int | None = None):
        """n's value; a scalar is splatted when a vector of width w is wanted."""
        v = self._val(n)
        if w is not None and w > 1 and not isinstance(v.type, ir.VectorType):
            v = self.splat(v, w)
        return v

    def splat(self, x, w: int):
        vt = ir.VectorType(x.type, w)
        v = self.b.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
        return self.b.shuffle_vector(v, ir.Constant(vt, ir.Undefined),
                                     ir.Constant(ir.VectorType(ir.IntType(32), w), [0] * w))

    def _val(self, n: KExpr):
        if n.op == "var":
            return self.env[n.arg]
        got = self.lookup(n)
        if got is not None:
            return got
        v = self.expr(n)
        self.memo[-1][n] = v
        return v

    def expr(self, n: KExpr):
        op, d, b = n.op, np.dtype(n.dtype), self.b
        w = self.lanes(n)
        if op == "const":
            return _constant(n.arg, d)
        if op == "mma":  # (a GPU printer prints it; a Target without MMA entries never gets one)
            raise AssertionError("the CPU has no warp matrix-multiply-accumulate (mma)")
        if op == "iota":
            return ir.Constant(ir.VectorType(I64, w), list(range(w)))
        if op == "size":
            return self.size(n.arg)
        if op == "load" and w > 1:  # a gather: a load per lane
            offs, v = self._val(n.src[0]), ir.Constant(self.vt(d, w), ir.Undefined)
            for i in range(w):
                lane = ir.Constant(ir.IntType(32), i)
                v = b.insert_element(v, self.load(n.arg, b.extract_element(offs, lane), d, 1), lane)
            return v
        if op in ("load", "vload"):
            target, lanes = (n.arg, 1) if op == "load" else n.arg
            return self.load(target, self._val(n.src[0]), d, lanes)
        if op == "broadcast":
            return self.splat(self._val(n.src[0]), w)
        if op in ("hsum", "hmax", "hmin"):
            x = self._val(n.src[0])
            bop = {"hsum": "add", "hmax": "max", "hmin": "min"}[op]
            w = x.type.count
            while w > 1 and w % 2 == 0:  # a tree of halves: the upper half onto the lower
                idx = lambda lo: ir.Constant(ir.VectorType(ir.IntType(32), w // 2), list(range(lo, lo + w // 2)))  # noqa: E731
                x = self.arith(bop, d, [b.shuffle_vector(x, x, idx(0)), b.shuffle_vector(x, x, idx(w // 2))])
                w //= 2
            if w == 1:
                return b.extract_element(x, ir.Constant(ir.IntType(32), 0))
            parts = [b.extract_element(x, ir.Constant(ir.IntType(32), i)) for i in range(w)]
            while len(parts) > 1:  # a tree: pairwise sums
                parts = [self.arith(bop, d, parts[i:i + 2]) if i + 1 < len(parts) else parts[i]
                         for i in range(0, len(parts), 2)]
            return parts[0]
        xs = [self.val(s, w) for s in n.src]
        if op == "select":
            return b.select(*xs)
        if op == "cast":
            return convert(b, xs[0], n.src[0].dtype, d)
        sd = np.dtype(n.src[0].dtype)
        if sd in (F16, BF16):  # 16-bit values compute in float32, as in kernels
            f32 = np.dtype(np.float32)
            r = self.arith(op, f32, [convert(b, x, sd, f32) for x in xs])
            return r if d == BOOL else convert(b, r, f32, d)
        return self.arith(op, sd, xs)

    def arith(self, op: str, sd, xs):
        """An elementwise op on operands of dtype sd (scalars or vectors of one width)."""
        b = self.b
        if op in UNARY_OPS:
            return UNARY_OPS[op](self.ops, sd, xs[0])
        x, y = xs
        if op in CMP:
            if is_float(sd):
                return b.fcmp_unordered("!=", x, y) if op == "ne" else b.fcmp_ordered(CMP[op], x, y)
            return (b.icmp_unsigned if is_unsigned(sd) else b.icmp_signed)(CMP[op], x, y)
        kind = "f" if is_float(sd) else "b" if sd == BOOL else "u" if is_unsigned(sd) else "i"
        return BINARY_OPS[op](self.ops, kind, x, y)

    # -- statements -----------------------------------------------------------------------------
    def block(self, body) -> None:
        self.memo.append({})
        for s in body:
            if isinstance(s, Range):
                if s.kind == "unroll":
                    for i in range(int(s.extent)):
                        self.env[s.var] = _i(i)
                        self.block(s.body)
                    continue
                hi = self._val(s.extent) if isinstance(s.extent, KExpr) else _i(int(s.extent))

                def body_fn(i, _, s=s):
                    self.env[s.var] = i
                    self.block(s.body)
                _, latch = counted_loop(self.b, _i(0), hi, body_fn, name=s.var)
                if not isinstance(hi, ir.Constant):  # a run-time trip count (tile.size)
                    no_unroll(latch)
            elif isinstance(s, Store):
                w = self.lanes(s.value)
                if self.lanes(s.offset) > 1:  # a scatter: a store per lane (of one value, or a vector's)
                    w = self.lanes(s.offset)
                    offs, v = self._val(s.offset), self.val(s.value, w)
                    for i in range(w):
                        lane = ir.Constant(ir.IntType(32), i)
                        at, x = self.b.extract_element(offs, lane), self.b.extract_element(v, lane)
                        (self.store_add if s.mode == "add" else self.store)(s.target, at, x, 1)
                elif s.mode == "add":
                    self.store_add(s.target, self._val(s.offset), self.val(s.value, w), w)
                else:
                    self.store(s.target, self._val(s.offset), self.val(s.value, w), w)
                self.forget(s.target)
            elif isinstance(s, If):
                with self.b.if_then(self._val(s.cond)):
                    self.block(s.body)
            elif isinstance(s, Barrier):
                self.barrier()
            # Allocs are made in the entry block (print)
        self.memo.pop()

    def print(self) -> str:
        for i, buf in enumerate(self.k.buffers):
            self.ptrs[i] = (self.buffer(i, TYPES[np.dtype(buf.dtype)][1]), np.dtype(buf.dtype))
        for a in self.k.allocs():
            self.ptrs[a.name] = (self.alloc(a, TYPES[np.dtype(a.dtype)][1]), np.dtype(a.dtype))
        self.points()
        self.b.ret_void()
        return str(self.mod)

    def size(self, i: int):
        """Run-time size i (tile.size): slot i after the buffers' pointers, read once."""
        if i not in self._sizes:
            with self.b.goto_entry_block():
                self.b.position_at_start(self.fn.entry_basic_block)
                raw = self.b.load(self.b.gep(self.fn.args[0], [_i(len(self.k.buffers) + i)]))
                self._sizes[i] = self.b.ptrtoint(raw, I64)
        return self._sizes[i]

    def buffer(self, i: int, mt):
        """A pointer to global buffer i's elements (of memory type mt)."""
        raw = self.b.load(self.b.gep(self.fn.args[0], [_i(i)]))
        return self.b.bitcast(raw, mt.as_pointer())

    def alloc(self, a, mt):
        arr = self.b.alloca(ir.ArrayType(mt, a.size), name=a.name)
        arr.align = 64
        return self.b.bitcast(arr, mt.as_pointer())

    def points(self) -> None:
        """Run the grid points [start, end), each work-group's lanes one after another."""
        k, b = self.k, self.b
        grid, lanes = k.grid(), k.lanes()
        start, end = self.fn.args[1], self.fn.args[2]

        def task(t, _):
            rest = t
            for r in reversed(grid[1:]):  # the last grid Range varies fastest
                self.env[r.var] = b.srem(rest, _i(int(r.extent)))
                rest = b.sdiv(rest, _i(int(r.extent)))
            if grid:  # what remains: the first grid Range's extent is not in the code (key_text)
                self.env[grid[0].var] = rest
            inner = k.inner()
            for r in reversed(lanes):  # work-groups of one: lanes run one after another
                inner = (Range(r.var, r.extent, "serial", inner),)
            self.block(inner)
        counted_loop(b, start, end, task, name="task")


def _walk(body):
    for s in body:
        yield s
        if isinstance(s, (Range, If)):
            yield from _walk(s.body)


def print_tile(k: TileKernel, fn_name: str, printer=None, backend: str = "llvm", vector_bits: int = 0,
               scalef: bool = False) -> str:
    """LLVM IR of a tile kernel: fn_name(i8** buffers, i64 start, i64 end) over grid points (or
    the form a subclass of TilePrinter prints). vector_bits: the registers' width, given to LLVM
    (without it a CPU that prefers 256-bit vectors splits every 512-bit one in two); scalef: the
    target scales by powers of two in one instruction (vecmath.Emit)."""
    try:
        p = (printer or _Printer)(k, fn_name)
        p.ops.em.scalef = scalef
        text = p.print()
    except (KeyError, AssertionError, TypeError, ValueError) as e:
        raise CompileError(f"the {backend} backend cannot print tile kernel {k.name}: {type(e).__name__}: {e}",
                           backend=backend, kernel=pp_tile(k)) from e
    if not vector_bits:
        return text
    # llvmlite has no string attributes: on the definition line
    i = text.index(f'define void @"{fn_name}"')
    j = text.index("{", i)
    return text[:j] + f'"prefer-vector-width"="{vector_bits}" "min-legal-vector-width"="{vector_bits}" ' + text[j:]


TilePrinter = _Printer


__all__ = ["INDEX", "TilePrinter", "print_tile"]
