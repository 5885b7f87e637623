"""The tile level of the kernel IR: a kernel as a scheduled loop nest over tiles.

Where a `Kernel` (ir.py) says what is computed over an index space, a `TileKernel` says how: which
loops run in parallel and where, what lives in registers, in a work-group's shared memory or in a
work-item's scratch space, where vectors are loaded and stored, where work-items wait for each
other. Builders (ir/kernel/gemm.py, ...) write algorithms once in this form, parametrised by a
schedule that the scheduler picks from the device's Target; renderers only print it.

Statements (a tree; `body` tuples nest):
  Range(var, extent, kind, body)  a loop over var = 0 .. extent-1. kind:
      "grid"    a launch dimension, outermost; its iterations run in parallel, in any order
                (work-groups on a GPU, tasks of the thread pool on a CPU)
      "lane"    a work-item of the work-group: the lanes Ranges directly under the grids make the
                work-group, whose work-items run together and share its "shared" Allocs
      "serial"  an ordinary loop;   "unroll"  a loop the renderer unrolls (var is a constant in
                each copy: register arrays indexed by it become registers)
  Alloc(name, dtype, size, scope) memory of the kernel: "register" (per work-item, small),
      "scratch" (per work-item, large: a CPU task's packed panel), "shared" (per work-group)
  Store(target, offset, value, mode)  target: a global buffer's number or an Alloc's name; a
      vector value stores its lanes at consecutive offsets (a vector offset: one per lane);
      mode "add" adds atomically (work-items may add to one element at once)
  Barrier()                       every work-item of the work-group arrives before any goes on
  If(cond, body)
Expressions are the kernel IR's KExpr nodes, plus:
  var(name)                       a Range's variable (int64)
  size(i)                         the i-th size given at run time (meta["sizes"][i]): code that
                                  reads sizes instead of constants serves every batch size
                                  (Target.runtime_batch); batch() = size(0), the index space's
                                  first extent in the scheduler's kernels
  load(target, offset)            target as in Store (an int: a global buffer; a str: an Alloc);
                                  a vector offset gathers
  vload(target, offset, lanes)    `lanes` consecutive elements as a vector
  broadcast(x, lanes)             a scalar in every lane;   iota(lanes)  0, 1, ..., lanes-1
  hsum / hmax / hmin (x)          across the lanes (hmax/hmin: a NaN wins, as max/min)
  mma(a, b, c, shape)             a warp's matrix-multiply-accumulate D = A B + C (float32), each
                                  matrix held in fragments across the warp's 32 work-items (the
                                  flattened lane index: warp w = work-items 32w .. 32w+31); the only
                                  shape, "m16n8k16" (float16/bfloat16 A, B), has PTX mma.sync's
                                  layout (MMA_LAYOUTS): a per work-item 8 lanes, b 4, c and D 4.
                                  Every work-item of the warp runs it (never under an If)
Elementwise ops take operands of one width, or a scalar with a vector (a broadcast).

`run_tile` is the reference: work-groups run their work-items in lockstep, statement by
statement, as vectors of numpy (so Barrier needs nothing, and shared memory behaves as on a GPU);
many work-groups run side by side as one batch of work-items, each with its own shared memory;
`check_tile` is the type checker; `pp_tile` the printer."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .interp import BINARY, UNARY, _cast
from .ir import INDEX, Buffer, KExpr

RANGE_KINDS = ("grid", "lane", "serial", "unroll")
SCOPES = ("register", "scratch", "shared")
TILE_OPS = ("var", "size", "vload", "broadcast", "iota", "hsum", "hmax", "hmin", "mma")
WARP = 32  # work-items of a warp (an mma's fragments spread over them)


def _m16n8k16(lane: int):
    """Per fragment element, the (row, column) it holds on work-item `lane` of the warp: A 16x16,
    B 16x8 (k, n), C/D 16x8 (the PTX ISA's figures for mma.m16n8k16 with 16-bit inputs)."""
    g, t = lane // 4, lane % 4
    a = [(g + 8 * ((i >> 1) & 1), 2 * t + (i & 1) + 8 * (i >> 2)) for i in range(8)]
    b = [(2 * t + (i & 1) + 8 * (i >> 1), g) for i in range(4)]
    c = [(g + 8 * (i >> 1), 2 * t + (i & 1)) for i in range(4)]
    return a, b, c


# shape -> ((M, N, K), fragment lanes of a, b, c, input dtypes, per work-item layouts)
MMA_LAYOUTS = {"m16n8k16": ((16, 8, 16), (8, 4, 4), ("float16", "bfloat16"),
                            [_m16n8k16(lane) for lane in range(WARP)])}


# ---- expressions -------------------------------------------------------------------------------

def var(name: str) -> KExpr:
    return KExpr("var", INDEX, (), name)


def size(i: int) -> KExpr:
    return KExpr("size", INDEX, (), int(i))


def batch() -> KExpr:
    return size(0)


def tload(target, offset: KExpr, dtype) -> KExpr:
    return KExpr("load", np.dtype(dtype), (offset,), target)


def vload(target, offset: KExpr, dtype, lanes: int) -> KExpr:
    return KExpr("vload", np.dtype(dtype), (offset,), (target, int(lanes)))


def iota(lanes: int) -> KExpr:
    """The vector 0, 1, ..., lanes-1 (int64): a vector axis's offsets."""
    return KExpr("iota", INDEX, (), int(lanes))


def broadcast(x: KExpr, lanes: int) -> KExpr:
    return x if lanes == 1 else KExpr("broadcast", x.dtype, (x,), int(lanes))


def hsum(x: KExpr) -> KExpr:
    return KExpr("hsum", x.dtype, (x,))


def hmax(x: KExpr) -> KExpr:
    return KExpr("hmax", x.dtype, (x,))


def hmin(x: KExpr) -> KExpr:
    return KExpr("hmin", x.dtype, (x,))


def mma(a: KExpr, b: KExpr, c: KExpr, shape: str = "m16n8k16") -> KExpr:
    """D = A B + C over a warp's fragments (see the module docstring)."""
    return KExpr("mma", np.dtype(np.float32), (a, b, c), shape)


def lanes_of(n: KExpr, memo: dict | None = None) -> int:
    """The vector width of a node's value (1: a scalar)."""
    memo = {} if memo is None else memo
    stack = [n]
    while stack:  # iterative: expressions can be deep
        x = stack[-1]
        if x in memo:
            stack.pop()
            continue
        if x.op == "vload":
            memo[x] = x.arg[1]
        elif x.op in ("broadcast", "iota"):
            memo[x] = x.arg
        elif x.op in ("hsum", "hmax", "hmin"):
            memo[x] = 1
        elif x.op == "mma":
            memo[x] = MMA_LAYOUTS[x.arg][1][2]
        else:
            pending = [s for s in x.src if s not in memo]
            if pending:
                stack.extend(pending)
                continue
            memo[x] = max((memo[s] for s in x.src), default=1)
        stack.pop()
    return memo[n]


# ---- statements ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Range:
    var: str
    extent: Any  # an int, or a KExpr of enclosing variables (serial ranges only)
    kind: str
    body: tuple


@dataclass(frozen=True)
class Alloc:
    name: str
    dtype: np.dtype
    size: int
    scope: str


@dataclass(frozen=True)
class Store:
    target: Any  # a global buffer's number, or an Alloc's name
    offset: KExpr
    value: KExpr
    mode: str = "set"  # "set" | "add" (atomic)


@dataclass(frozen=True)
class Barrier:
    pass


@dataclass(frozen=True)
class If:
    cond: KExpr
    body: tuple


@dataclass(frozen=True)
class TileKernel:
    """A scheduled kernel: global `buffers` (inputs first, as in Kernel) and a statement tree."""
    name: str
    buffers: tuple
    n_inputs: int
    body: tuple
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def grid(self) -> list[Range]:
        """The launch dimensions, outermost first."""
        out, body = [], self.body
        while len(body) == 1 and isinstance(body[0], Range) and body[0].kind == "grid":
            out.append(body[0])
            body = body[0].body
        return out

    def points(self) -> int:
        """Grid points: the work-groups (CPU tasks) a launch runs."""
        return math.prod(int(r.extent) for r in self.grid())

    def lanes(self) -> list[Range]:
        """The work-group's dimensions (the lane Ranges directly under the grid)."""
        out, body = [], (self.grid()[-1].body if self.grid() else self.body)
        while len(body) == 1 and isinstance(body[0], Range) and body[0].kind == "lane":
            out.append(body[0])
            body = body[0].body
        return out

    def inner(self) -> tuple:
        """The statements each work-item runs, under the grid and lane Ranges."""
        body = self.body
        while len(body) == 1 and isinstance(body[0], Range) and body[0].kind in ("grid", "lane"):
            body = body[0].body
        return body

    def allocs(self) -> list[Alloc]:
        return [s for s in walk(self.body) if isinstance(s, Alloc)]

    def __str__(self):
        return pp_tile(self)


def walk(body):
    """Every statement of a tree, parents before children."""
    for s in body:
        yield s
        if isinstance(s, (Range, If)):
            yield from walk(s.body)


def loop_trips(body, outer: int = 1, sizes: tuple = ()) -> int:
    """The most iterations one loop statement (a serial or unrolled Range) runs in one work-item,
    over all the times its enclosing loops enter it: an extent of run-time sizes (tile.size) at
    `sizes`, one that varies from trip to trip (a loop variable in it) counted as 1."""
    most = 0
    for s in body:
        if isinstance(s, Range) and s.kind in ("serial", "unroll"):
            n = outer * (s.extent if isinstance(s.extent, int) else _value(s.extent, sizes) or 1)
            most = max(most, n, loop_trips(s.body, n, sizes))
        elif isinstance(s, (Range, If)):
            most = max(most, loop_trips(s.body, outer, sizes))
    return most


_INT_OPS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
            "div": lambda a, b: a // b, "rem": lambda a, b: a % b, "min": min, "max": max}


def _value(e: KExpr, sizes: tuple) -> int | None:
    """An index expression of constants and run-time sizes, evaluated (None: it reads anything
    else). Sizes are not negative, so division rounds as the printers' does."""
    if e.op == "const":
        return int(e.arg)
    if e.op == "size":
        return int(sizes[e.arg]) if e.arg < len(sizes) else None
    if e.op in _INT_OPS and len(e.src) == 2:
        a, b = (_value(x, sizes) for x in e.src)
        return None if a is None or b is None or (e.op in ("div", "rem") and b == 0) else _INT_OPS[e.op](a, b)
    return None


def expressions(s) -> list[KExpr]:
    """The expressions a statement reads directly."""
    if isinstance(s, Store):
        return [s.offset, s.value]
    if isinstance(s, If):
        return [s.cond]
    if isinstance(s, Range) and isinstance(s.extent, KExpr):
        return [s.extent]
    return []


# ---- printing ------------------------------------------------------------------------------------

class PrintedValues:
    """A printer's values in scope, innermost block last (memo: a dict per open block, expression
    -> its printed name), forgotten when a store makes their loads stale."""
    memo: list[dict]

    def lookup(self, n: KExpr):
        for layer in reversed(self.memo):
            if n in layer:
                return layer[n]
        return None

    def forget(self, target) -> None:
        """After a store to `target`: loads of it, and what was computed from them, are stale."""
        for layer in self.memo:
            for n in [n for n in layer if target in self.reads(n)]:
                del layer[n]

    def reads(self, n) -> frozenset:
        """The targets whose loads n's value depends on (kept per node: a printer asks often)."""
        cache = self.__dict__.setdefault("_reads", {})
        for x in n.toposort(cache):
            own = {x.arg if x.op == "load" else x.arg[0]} if x.op in ("load", "vload") else set()
            cache[x] = frozenset(own.union(*(cache[s] for s in x.src)))
        return cache[n]


def pp_tile(k: TileKernel) -> str:
    lines = [f"tile kernel {k.name}(" + ", ".join(
        f"{'in' if i < k.n_inputs else 'out'} {b.name}:{np.dtype(b.dtype).name}[{b.size}]"
        for i, b in enumerate(k.buffers)) + ")"]
    names: dict = {}

    def ex(n: KExpr) -> str:
        for x in n.toposort(names):
            if x.op == "const":
                names[x] = repr(x.arg)
            elif x.op == "var":
                names[x] = x.arg
            else:
                args = ", ".join(names[s] for s in x.src)
                arg = "" if x.arg is None else f"[{x.arg}]"
                names[x] = f"{x.op}{arg}({args})"
                if len(names[x]) > 60:  # long subexpressions get a name of their own
                    tmp = f"%{len(names)}"
                    lines.append(f"{pad}{tmp} = {names[x]}")
                    names[x] = tmp
        return names[n]

    def emit(body, depth):
        nonlocal pad
        for s in body:
            pad = "  " * depth
            if isinstance(s, Range):
                ext = ex(s.extent) if isinstance(s.extent, KExpr) else s.extent
                lines.append(f"{pad}{s.kind} {s.var} < {ext}:")
                emit(s.body, depth + 1)
            elif isinstance(s, Alloc):
                lines.append(f"{pad}{s.scope} {s.name}:{np.dtype(s.dtype).name}[{s.size}]")
            elif isinstance(s, Store):
                off, val = ex(s.offset), ex(s.value)
                tgt = k.buffers[s.target].name if isinstance(s.target, int) else s.target
                lines.append(f"{pad}{tgt}[{off}] = {val}")
            elif isinstance(s, Barrier):
                lines.append(f"{pad}barrier")
            elif isinstance(s, If):
                lines.append(f"{pad}if {ex(s.cond)}:")
                emit(s.body, depth + 1)
    pad = ""
    emit(k.body, 1)
    return "\n".join(lines)


def key_text(k: TileKernel) -> str:
    """The text that decides a printer's code: the kernel without its name, its buffers' sizes
    and its first grid Range's extent, none of which the CPU printer reads (tasks arrive as
    [start, end)), so a new batch size reuses compiled code. Kept in k.meta: a build asks for it
    as its cache key, its symbol and its source's head."""
    got = k.meta.get("key_text")
    if got is None or got[0] is not k.body:  # (a kernel made with dataclasses.replace shares meta)
        got = k.meta["key_text"] = (k.body, _key_text(k))
    return got[1]


def at_grid_extent(k: TileKernel, extent: int, name: str, buffers: tuple, meta: dict) -> TileKernel:
    """k (one outermost grid Range) with that Range's extent, its name and its buffers another's,
    and `meta`: a builder's kernel at new sizes where its code reads them at run time. Its
    key_text is k's (it reads none of the three)."""
    (grid,) = k.body
    body = (Range(grid.var, extent, grid.kind, grid.body),)
    meta = dict(meta)
    if "key_text" in k.meta:
        meta["key_text"] = (body, k.meta["key_text"][1])
    return TileKernel(name, tuple(buffers), k.n_inputs, body, meta=meta)


def _key_text(k: TileKernel) -> str:
    lines = pp_tile(k).split("\n")
    lines[0] = "tile kernel (" + ", ".join(np.dtype(b.dtype).name for b in k.buffers) + f") inputs {k.n_inputs}"
    grid = k.grid()
    if grid:
        assert lines[1] == f"  grid {grid[0].var} < {grid[0].extent}:", lines[1]
        lines[1] = f"  grid {grid[0].var} < ?:"
    return "\n".join(lines)


# ---- checking ------------------------------------------------------------------------------------

def check_tile(k: TileKernel) -> None:
    """Structure and types: grids outermost, lanes right under them; every variable, Alloc and
    buffer defined where it is used; stores of a target's dtype; operands of one width; barriers
    only where every work-item of a group reaches them. Raises AssertionError."""
    for b in k.buffers:
        assert isinstance(b, Buffer), b
    allocs: dict = {}
    head = len(k.grid()) + len(k.lanes())

    def target_dtype(t):
        if isinstance(t, int):
            assert 0 <= t < len(k.buffers), f"buffer {t} out of range"
            return np.dtype(k.buffers[t].dtype)
        assert t in allocs, f"alloc {t!r} used before it is made"
        return np.dtype(allocs[t].dtype)

    group = int(np.prod([int(r.extent) for r in k.lanes()], dtype=np.int64))

    def check_expr(n: KExpr, scope: set, in_if: bool = False):
        memo: dict = {}
        for x in n.toposort():
            if x.op == "var":
                assert x.arg in scope, f"variable {x.arg!r} outside its range"
            elif x.op in ("load", "vload"):
                t = x.arg[0] if x.op == "vload" else x.arg
                assert target_dtype(t) == np.dtype(x.dtype), f"{x.op} of {t} as {x.dtype}"
                assert x.op == "load" or lanes_of(x.src[0], memo) == 1, "a vload's offset is a scalar"
            elif x.op in ("idx", "ridx", "reduce"):
                raise AssertionError(f"{x.op} belongs to the index-space kernel, not a tile kernel")
            elif x.op == "mma":
                assert x.arg in MMA_LAYOUTS, f"mma of unknown shape {x.arg!r}"
                _, widths, ins, _ = MMA_LAYOUTS[x.arg]
                got = tuple(lanes_of(s, memo) for s in x.src)
                assert got == widths, f"mma {x.arg}: fragments of {got} lanes, not {widths}"
                a, b, c = (np.dtype(s.dtype).name for s in x.src)
                assert a == b and a in ins and c == "float32", f"mma {x.arg} of {a} x {b} + {c}"
                assert not in_if, "an mma under an If: its warp may not run it whole"
                assert group % WARP == 0, f"an mma in work-groups of {group} work-items (whole warps: {WARP})"
            elif x.op not in ("const", "size", "broadcast", "iota", "hsum", "hmax", "hmin"):
                widths = {lanes_of(s, memo) for s in x.src} - {1}
                assert len(widths) <= 1, f"{x.op} of operands of widths {widths}"

    def visit(body, scope: set, depth: int, in_if: bool):
        for s in body:
            if isinstance(s, Range):
                assert s.kind in RANGE_KINDS, s.kind
                assert (s.kind in ("grid", "lane")) == (depth < head), \
                    f"{s.kind} range {s.var} at depth {depth}: grids and lanes lead the kernel"
                assert s.var not in scope, f"variable {s.var!r} bound twice"
                if isinstance(s.extent, KExpr):
                    assert s.kind == "serial", "only serial ranges have computed extents"
                    check_expr(s.extent, scope)
                visit(s.body, scope | {s.var}, depth + 1, in_if)
            elif isinstance(s, Alloc):
                assert s.scope in SCOPES and s.name not in allocs, s
                assert s.scope != "shared" or depth == head, "shared memory is made by the work-group"
                allocs[s.name] = s
            elif isinstance(s, Store):
                d = target_dtype(s.target)
                assert np.dtype(s.value.dtype) == d, f"store of {s.value.dtype} into {s.target} ({d})"
                assert s.mode in ("set", "add"), s.mode
                ow, vw = lanes_of(s.offset, {}), lanes_of(s.value, {})
                assert ow == 1 or ow == vw, f"a store of {vw} lanes at {ow} offsets"
                check_expr(s.offset, scope, in_if)
                check_expr(s.value, scope, in_if)
            elif isinstance(s, Barrier):
                assert not in_if, "a barrier under an If: some work-items may never reach it"
            elif isinstance(s, If):
                check_expr(s.cond, scope)
                visit(s.body, scope, depth + 1, True)
            else:
                raise AssertionError(f"not a statement: {s!r}")
    visit(k.body, set(), 0, False)


# ---- the reference -------------------------------------------------------------------------------

class _Group:
    """Work-groups in lockstep: every value is an array (L, W) over the L work-items of G
    work-groups side by side (work-item l belongs to group l // (L / G))."""

    def __init__(self, k: TileKernel, arrays, env: dict, n_lanes: int, n_groups: int = 1):
        self.k, self.arrays, self.env, self.L, self.G = k, arrays, env, n_lanes, n_groups
        self.mem: dict = {}  # alloc name -> (scope, array): (L, size) per work-item, (G, size) shared
        self.rows = np.arange(n_lanes)[:, None]
        self.group_rows = self.rows // (n_lanes // n_groups)

    def _mem(self, t):
        if isinstance(t, int):
            return "global", self.arrays[t]
        return self.mem[t]

    def _rows(self, scope: str):
        """The row of a work-item's own (register, scratch) or its group's (shared) memory."""
        return self.group_rows if scope == "shared" else self.rows

    def value(self, n: KExpr, memo: dict, mask: np.ndarray) -> np.ndarray:
        """n's value on every work-item; loads are checked on the active ones (`mask`) only."""
        for x in n.toposort():
            if x in memo:
                continue
            op = x.op
            if op == "const":
                v = np.full((1, 1), x.arg, x.dtype)
            elif op == "var":
                v = np.broadcast_to(np.asarray(self.env[x.arg], INDEX).reshape(-1, 1), (self.L, 1))
            elif op == "size":
                v = np.full((1, 1), self.k.meta["sizes"][x.arg], INDEX)
            elif op == "iota":
                v = np.broadcast_to(np.arange(x.arg, dtype=INDEX), (self.L, x.arg))
            elif op in ("load", "vload"):
                t, w = (x.arg, 1) if op == "load" else x.arg
                src = memo[x.src[0]]
                if op == "load" and src.shape[-1] > 1:  # a gather: one offset per lane
                    off = np.broadcast_to(src, (self.L, src.shape[-1]))
                else:
                    off = np.broadcast_to(src, (self.L, 1)) + np.arange(w)
                scope, arr = self._mem(t)
                size = arr.shape[-1]
                live = off[mask]
                if live.size and (live.min() < 0 or live.max() >= size):
                    raise IndexError(f"tile kernel {self.k.name}: {op} of {t} at {live.min()}..{live.max()} "
                                     f"outside its {size} elements")
                off = np.clip(off, 0, max(size - 1, 0))  # inactive work-items read anything
                v = arr[off] if scope == "global" else arr[self._rows(scope), off]
            elif op == "broadcast":
                v = np.broadcast_to(memo[x.src[0]], (self.L, x.arg))
            elif op in ("hsum", "hmax", "hmin"):
                f = {"hsum": np.sum, "hmax": np.max, "hmin": np.min}[op]  # (max/min: NaN wins)
                v = f(memo[x.src[0]], axis=1, keepdims=True)
            elif op == "mma":
                v = self.mma(x.arg, *(memo[s] for s in x.src), mask)
            else:
                xs = [memo[s] for s in x.src]
                if op in UNARY:
                    v = UNARY[op](xs[0])
                elif op in BINARY:
                    v = BINARY[op](xs[0], xs[1])
                elif op == "select":
                    v = np.where(xs[0], xs[1], xs[2])
                elif op == "cast":
                    v = _cast(xs[0], np.dtype(x.dtype))
                elif op == "bitcast":
                    v = np.ascontiguousarray(xs[0]).view(np.dtype(x.dtype))
                else:
                    raise NotImplementedError(f"run_tile: op {op}")
            memo[x] = np.asarray(v).astype(x.dtype, copy=False)
        return memo[n]

    def mma(self, shape: str, a, b, c, mask) -> np.ndarray:
        """D = A B + C per warp: its work-items' fragments gathered into matrices, D scattered back."""
        (m, n, kk), widths, _, layout = MMA_LAYOUTS[shape]
        warps = mask.reshape(-1, WARP) if self.L % WARP == 0 else None
        assert warps is not None and (warps.all(1) | ~warps.any(1)).all(), \
            f"mma: every work-item of a warp runs it ({self.L // self.G} work-items a group)"
        a, b, c = (np.broadcast_to(x, (self.L, w)).astype(np.float32) for x, w in zip((a, b, c), widths))
        at = [np.array([lay[f] for lay in layout]) for f in range(3)]  # (32, lanes, 2): row, column
        ra, rb, rc = ((x[..., 0], x[..., 1]) for x in at)
        d = np.empty((self.L, widths[2]), np.float32)
        for w in range(0, self.L, WARP):
            A, B, C = np.zeros((m, kk), np.float32), np.zeros((kk, n), np.float32), np.zeros((m, n), np.float32)
            A[ra], B[rb], C[rc] = a[w:w + WARP], b[w:w + WARP], c[w:w + WARP]
            d[w:w + WARP] = (A.astype(np.float64) @ B + C)[rc].astype(np.float32)
        return d

    def run(self, body, mask: np.ndarray) -> None:
        if not mask.any():
            return
        for s in body:
            if isinstance(s, Range):
                extent, ext = s.extent, None
                if isinstance(extent, KExpr):  # the same in a group's work-items, not across groups
                    ext = np.broadcast_to(self.value(extent, {}, mask), (self.L, 1))[:, 0]
                    by_group = np.where(mask, ext, -1).reshape(self.G, -1)
                    hi = by_group.max(axis=1)
                    assert ((by_group == hi[:, None]) | (by_group < 0)).all(), \
                        f"range {s.var}: its extent differs between work-items"
                    extent = int(hi.max(initial=0))
                for i in range(extent):
                    self.env[s.var] = i
                    self.run(s.body, mask if ext is None else mask & (ext > i))
                self.env.pop(s.var, None)
            elif isinstance(s, Alloc):
                shape = (self.G if s.scope == "shared" else self.L, s.size)
                # fresh memory holds garbage: a read before a write shows up in results
                fill = np.nan if np.dtype(s.dtype).kind == "f" else 0x5A
                self.mem[s.name] = (s.scope, np.full(shape, fill).astype(s.dtype))
            elif isinstance(s, Store):
                memo: dict = {}
                off = self.value(s.offset, memo, mask)
                val = self.value(s.value, memo, mask)
                w = max(val.shape[1], off.shape[1])
                offs = np.broadcast_to(off if off.shape[1] > 1 else off + np.arange(w), (self.L, w))
                vals = np.broadcast_to(val, (self.L, w))
                scope, arr = self._mem(s.target)
                size = arr.shape[-1]
                sel = offs[mask]
                if sel.size and (sel.min() < 0 or sel.max() >= size):
                    raise IndexError(f"tile kernel {self.k.name}: store to {s.target} at "
                                     f"{sel.min()}..{sel.max()} outside its {size} elements")
                if scope != "global":
                    arr[np.broadcast_to(self._rows(scope), offs.shape)[mask], sel] = vals[mask]
                elif s.mode == "add":
                    np.add.at(arr, sel.reshape(-1), vals[mask].reshape(-1).astype(arr.dtype))
                else:
                    arr[sel] = vals[mask]
            elif isinstance(s, If):
                c = np.broadcast_to(self.value(s.cond, {}, mask), (self.L, 1))[:, 0].astype(bool)
                self.run(s.body, mask & c)
            elif isinstance(s, Barrier):
                pass  # lockstep: every work-item has finished the statements before it


def run_tile(k: TileKernel, arrays, max_lanes: int = 4096, max_bytes: int = 1 << 25) -> None:
    """Run a tile kernel on flat typed arrays (in k.buffers order), writing outputs in place.
    Work-groups run in batches (one numpy op per node and batch, not per group) of up to
    `max_lanes` work-items whose Allocs take up to `max_bytes`; at least one group a batch."""
    grid, lanes = k.grid(), k.lanes()
    body = k.inner()
    local, points = (np.array(list(itertools.product(*(range(r.extent) for r in rs))), INDEX)
                     .reshape(math.prod(r.extent for r in rs), len(rs)) for rs in (lanes, grid))
    per_group = max(1, len(local))
    group_bytes = sum(a.size * np.dtype(a.dtype).itemsize * (1 if a.scope == "shared" else per_group)
                      for a in k.allocs())
    batch = max(1, min(max_lanes // per_group, max_bytes // max(group_bytes, 1)))
    with np.errstate(all="ignore"):
        for start in range(0, len(points), batch):
            pts = points[start:start + batch]
            env = {r.var: np.repeat(pts[:, d], per_group) for d, r in enumerate(grid)}
            env.update({r.var: np.tile(local[:, d], len(pts)) for d, r in enumerate(lanes)})
            group = _Group(k, arrays, env, len(pts) * per_group, len(pts))
            group.run(body, np.ones(group.L, bool))
