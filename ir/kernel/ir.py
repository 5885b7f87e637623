"""The kernel IR: the loop-level, backend-neutral form that every backend renders.

A `Kernel` is an index space (`shape`, the parallel axes) and, optionally, a reduction space
(`reduce_shape`). For every point of the parallel space (in any order, on any thread), each
`Store` writes `value` to `buffers[buffer]` at element offset `offset`. Values are scalar
expression DAGs of `KExpr` nodes; `idx` nodes read the parallel indices, `ridx` nodes the
reduction indices, which only appear under a `reduce` node (reduce nodes do not nest). Index
maps (broadcast, transpose, slice, strides, reshape, gather) are integer expressions in the
offsets of `load` nodes: affine in the indices for the common cases, data-dependent for gather.

Store modes: "set" writes; "add" accumulates (scatter-add: backends must make concurrent adds
to one element race-free, e.g. by running the kernel serially or with atomics).

16-bit floats are stored narrow and computed in float32: loads of float16/bfloat16 are followed
by a `cast` to float32 and stores cast back, so expressions only see 32/64-bit types — except
for an explicit rounding (a graph convert to a 16-bit type), lowered as a cast to it and
straight back to float32.

Op semantics every renderer implements (ir/kernel/interp.py is the reference):
- `cast` float -> int truncates toward zero (C); int/bool -> float is exact where representable.
  Casts to bool are not emitted (the lowering writes `ne x, 0`).
- integer `div`/`rem` are C's (truncating; `rem` takes the dividend's sign, as float `rem` = fmod);
  division by zero is undefined (the lowering guards it where the primitive defines it).
  Integer `add`/`sub`/`mul`/`neg`/`shift_left` wrap around (two's complement, as numpy's): a
  renderer whose language leaves signed overflow undefined (C) computes them unsigned.
- long float `sum` reductions are blocked (ir/kernel/schedule.py: BLOCK): an accumulator (or a
  vector lane of one) adds a block of values, then its partial sum is flushed into a compensated
  total: the rounding error grows with the block and the number of blocks, not with n.
- `round` rounds half to even; `sign` is -1/0/1 (NaN for NaN); `logistic` is 1/(1+exp(-x)).
- bool values only meet `and`/`or`/`xor`/`not`, comparisons, `select` and casts (the lowering
  turns bool add/mul/max/min into or/and), and the reductions max (any) and min (all).
- `reduce` nodes are present iff `reduce_shape` is non-empty; all run over that one reduction
  space, once per parallel point. A reduce's body may use other reduce nodes (their values are
  constant over the reduction space: softmax's sum(exp(x - max))), never through them its own
  ridx; renderers evaluate reductions in dependency order (`reduce_levels`). Over an empty
  reduction space sum gives 0 and prod 1 (max/min/argmax never see one). argmax/argmin give
  the index of the first extreme; NaN counts as the extreme (numpy's rule). Nodes that read no
  `ridx` may appear both under a reduce node and outside it.
- A "row store" reads ridx outside every reduce node: it runs at every point of the reduction
  space, after the reductions (a fused softmax writes its whole row so). Other stores run once
  per parallel point.
"""
from __future__ import annotations

import struct
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..symbolic import index_int

UNARY = ("neg", "exp", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "sin", "cos",
         "erf", "abs", "sign", "floor", "ceil", "round", "not", "is_finite")
BINARY = ("add", "sub", "mul", "div", "rem", "pow", "max", "min", "and", "or", "xor",
          "shift_left", "shift_right_logical", "eq", "ne", "lt", "le", "gt", "ge")
REDUCE_OPS = ("sum", "max", "min", "prod", "argmax", "argmin")
LEAVES = ("const", "idx", "ridx")
OTHER = ("load", "select", "cast", "bitcast", "reduce")
ALL_OPS = UNARY + BINARY + LEAVES + OTHER


@dataclass(frozen=True, init=False, eq=False)
class KExpr:
    """One node of a scalar expression DAG. Immutable and compared structurally, so equal
    subexpressions are one node (CSE for free).

    op      one of ALL_OPS
    dtype   the scalar's numpy dtype
    src     operand nodes
    arg     const: the value; idx/ridx: the axis; load: the buffer number;
            reduce: the reduction op name (for argmax/argmin src = (value, index))"""
    op: str
    dtype: np.dtype
    src: tuple = ()
    arg: Any = None
    _hash: int = field(default=0, compare=False, repr=False)

    # Interned: an equal node is the same object, so equality is identity and comparing two DAGs
    # (a dict lookup, a memo) stops at their operands instead of walking them whole.
    def __new__(cls, op, dtype, src=(), arg=None):
        hit = _INTERNED.get(_key(op, dtype, src, arg))
        return hit if hit is not None else super().__new__(cls)

    def __init__(self, op, dtype, src=(), arg=None):
        if self._hash:  # the interned node, constructed again
            return
        key = _key(op, dtype, src, arg)
        for name, v in zip(("op", "dtype", "src", "arg", "_hash"), (op, key[1], key[2], arg, hash(key))):
            object.__setattr__(self, name, v)
        _INTERNED[key] = self

    def __hash__(self):
        return self._hash

    def __reduce__(self):  # the hash is recomputed: str hashes differ between processes
        return KExpr, (self.op, self.dtype, self.src, self.arg)

    # small builders so lowerings read like arithmetic
    def __add__(self, o):
        return binary("add", self, as_expr(o, self.dtype))

    def __mul__(self, o):
        return binary("mul", self, as_expr(o, self.dtype))

    def toposort(self, done=()) -> list["KExpr"]:
        """Every node once, operands first (iteratively: expressions can be deep), but those in
        `done` and what lies below them: the nodes a walk over several roots has already taken
        (a printer's names; a set closed under operands), which walking again for every root that
        shares them made printing a kernel quadratic in its size."""
        if self in done:
            return []
        seen, order, stack = {self}, [], [(self, iter(self.src))]
        while stack:
            n, rest = stack[-1]
            for s in rest:
                if s not in seen and s not in done:
                    seen.add(s)
                    stack.append((s, iter(s.src)))
                    break
            else:
                stack.pop()
                order.append(n)
        return order


def walk(roots) -> list[KExpr]:
    """Every node under `roots` once, operands first (the roots' shared parts walked once)."""
    seen: dict = {}
    for r in roots:
        for n in r.toposort(seen):
            seen[n] = None
    return list(seen)


def _key(op, dtype, src, arg) -> tuple:
    """A node's identity. A float constant is keyed by its bits: 0.0 == -0.0 in Python, and
    x / 0.0 is not x / -0.0."""
    if isinstance(arg, float):
        arg = (float, struct.pack("<d", arg))
    return op, np.dtype(dtype), tuple(src), arg


INDEX = np.dtype(np.int64)
_INTERNED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def const(value, dtype) -> KExpr:
    dtype = np.dtype(dtype)
    return KExpr("const", dtype, (), np.asarray(value, dtype).item())


def idx(axis: int) -> KExpr:
    return KExpr("idx", INDEX, (), axis)


def ridx(axis: int) -> KExpr:
    return KExpr("ridx", INDEX, (), axis)


def load(buffer: int, offset: KExpr, dtype) -> KExpr:
    return KExpr("load", np.dtype(dtype), (offset,), buffer)


def unary(op: str, x: KExpr, dtype=None) -> KExpr:
    assert op in UNARY, op
    return KExpr(op, np.dtype(dtype) if dtype is not None else x.dtype, (x,))


def binary(op: str, a: KExpr, b: KExpr) -> KExpr:
    assert op in BINARY, op
    assert a.dtype == b.dtype, (op, a.dtype, b.dtype)
    dtype = np.dtype(np.bool_) if op in ("eq", "ne", "lt", "le", "gt", "ge") else a.dtype
    return KExpr(op, dtype, (a, b))


def select(c: KExpr, a: KExpr, b: KExpr) -> KExpr:
    return KExpr("select", a.dtype, (c, a, b))


def cast(x: KExpr, dtype) -> KExpr:
    dtype = np.dtype(dtype)
    return x if x.dtype == dtype else KExpr("cast", dtype, (x,))


def bitcast(x: KExpr, dtype) -> KExpr:
    """x's bits read as `dtype` (of the same size)."""
    dtype = np.dtype(dtype)
    assert dtype.itemsize == np.dtype(x.dtype).itemsize, (x.dtype, dtype)
    return x if x.dtype == dtype else KExpr("bitcast", dtype, (x,))


def reduce(op: str, x: KExpr, index: KExpr | None = None) -> KExpr:
    assert op in REDUCE_OPS, op
    if op in ("argmax", "argmin"):
        return KExpr("reduce", INDEX, (x, index), op)
    return KExpr("reduce", x.dtype, (x,), op)


def as_expr(v, dtype) -> KExpr:
    return v if isinstance(v, KExpr) else const(v, dtype)


# ---- index arithmetic (int64), constants folded ---------------------------------------------

def ic(v: int) -> KExpr:
    """An index (int64) constant (of a symbolic size: its value, guarded; see symbolic.index_hints)."""
    return const(v if type(v) is int else index_int(v), INDEX)


def is_const(a: KExpr, v=None) -> bool:
    return a.op == "const" and (v is None or a.arg == v)


def iadd(a: KExpr, b: KExpr) -> KExpr:
    """Index arithmetic with constants folded (kernels stay small and readable)."""
    if is_const(a) and is_const(b):
        return ic(a.arg + b.arg)
    if is_const(a, 0):
        return b
    if is_const(b, 0):
        return a
    return binary("add", a, b)


def imul(a: KExpr, k: int) -> KExpr:
    if k == 0:
        return ic(0)
    if k == 1:
        return a
    return ic(a.arg * k) if is_const(a) else binary("mul", a, ic(k))


def idiv(a: KExpr, k: int) -> KExpr:
    if k == 1:
        return a
    return ic(a.arg // k) if is_const(a) else binary("div", a, ic(k))


def affine(strides, base: int = 0, reduce_strides=()) -> KExpr:
    """offset = base + Σ strides[k]·idx(k) + Σ reduce_strides[k]·ridx(k) (zero strides skipped)."""
    out = const(base, INDEX)
    for k, s in enumerate(strides):
        if s:
            out = binary("add", out, idx(k) if s == 1 else binary("mul", idx(k), const(s, INDEX)))
    for k, s in enumerate(reduce_strides):
        if s:
            out = binary("add", out, ridx(k) if s == 1 else binary("mul", ridx(k), const(s, INDEX)))
    return out


def reads_ridx(root: KExpr, memo: dict | None = None) -> bool:
    """Whether `root` reads a reduction index outside reduce nodes (a reduce's value is one per
    parallel point)."""
    memo = {} if memo is None else memo
    stack = [root]
    while stack:  # iterative post-order: expression DAGs can be deep
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        pending = [s for s in n.src if s not in memo] if n.op != "reduce" else []
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        memo[n] = n.op == "ridx" or (n.op != "reduce" and any(memo[s] for s in n.src))
    return memo[root]


def reduce_levels(roots) -> list[list[KExpr]]:
    """The distinct reduce nodes under `roots`, grouped by dependency: level 0 reads no other
    reduce; level k reads some of level k-1 (one pass over the reduction space per level)."""
    level: dict = {}
    for root in roots:
        for n in root.toposort():  # operands first, so a reduce's inner reduces have levels
            if n.op == "reduce" and n not in level:
                inner = [level[m] for m in n.toposort() if m.op == "reduce" and m is not n]
                level[n] = 1 + max(inner) if inner else 0
    out: list[list[KExpr]] = [[] for _ in range(1 + max(level.values(), default=-1))]
    for n, k in level.items():
        out[k].append(n)
    return out


# Ops whose result is worth keeping rather than computing again (the rest cost about a load).
COSTLY_OPS = frozenset({"exp", "log", "log1p", "expm1", "tanh", "logistic", "erf", "sin", "cos", "pow",
                        "div", "sqrt", "rsqrt"})


def row_stashes(kernel) -> dict:
    """id(row store) -> (level, node): a costly value that a row store computes again after the
    reduction pass `level` computed it at the same point of the row (softmax: exp(x - max) in
    the sum's pass and in the write's). The renderer may store the node's value into the row
    store's own buffer during that pass and load it back in the row pass: the buffer is written
    by that store alone, read by no load, holds the node's dtype (the round trip is exact), and
    its offset is one-to-one over the reduction space (each point keeps its own value). Kept in
    the kernel's meta: a renderer asks once per body it emits."""
    if "row_stashes" not in kernel.meta:
        kernel.meta["row_stashes"] = _row_stashes(kernel) if kernel.row_stores else {}
    return kernel.meta["row_stashes"]


def _row_stashes(kernel) -> dict:
    roots = [e for st in kernel.stores for e in (st.offset, st.value)]
    levels = reduce_levels(roots)
    memo: dict = {}
    for r in roots:
        reads_ridx(r, memo)
    loaded = {n.arg for r in roots for n in r.toposort() if n.op == "load"}
    writers: dict = {}
    for st in kernel.stores:
        writers[st.buffer] = writers.get(st.buffer, 0) + 1
    # the row-dependent nodes each pass computes: under its reduces' operands, down to other reduces
    passes = []
    for level in levels:
        seen: set = set()
        stack = [s for n in level for s in n.src]
        while stack:
            n = stack.pop()
            if n in seen or n.op == "reduce" or not memo.get(n, True):
                continue
            seen.add(n)
            stack.extend(n.src)
        passes.append(seen)
    forms = affine_forms(roots)
    out = {}
    for st in kernel.row_stores:
        buf = kernel.buffers[st.buffer]
        if st.mode != "set" or writers[st.buffer] != 1 or st.buffer in loaded \
                or not _one_to_one(forms.get(st.offset), kernel.reduce_shape):
            continue
        best = None
        for n in st.value.toposort():
            if n.dtype != buf.dtype or not memo.get(n) or n.op not in COSTLY_OPS:
                continue
            level = next((i for i, p in enumerate(passes) if n in p), None)
            if level is not None:
                cost = sum(m.op in COSTLY_OPS for m in n.toposort() if memo.get(m))
                if best is None or cost > best[0]:
                    best = (cost, level, n)
        if best is not None:
            out[id(st)] = best[1:]
    return out


def _one_to_one(form, reduce_shape) -> bool:
    """Whether an affine offset takes a distinct value at every point of the reduction space:
    its reduce axes' coefficients, smallest first, each at least the span of the ones before."""
    if form is None:
        return False
    axes = sorted((abs(form.get(("ridx", a), 0)), n) for a, n in enumerate(reduce_shape) if n > 1)
    span = 1
    for coeff, n in axes:
        if coeff < span:
            return False
        span = coeff * n
    return True


def affine_forms(roots) -> dict:
    """KExpr → {("idx"|"ridx", axis) | "c": coefficient} for every int64 node that is affine in
    the indices (const, idx, ridx, add, sub, mul by a constant, neg)."""
    forms: dict = {}
    for root in roots:
        for n in root.toposort(forms):
            f = None
            if n.dtype == INDEX:
                if n.op == "const":
                    f = {"c": int(n.arg)}
                elif n.op in ("idx", "ridx"):
                    f = {(n.op, n.arg): 1}
                elif n.op in ("add", "sub", "mul") or n.op == "neg":
                    fs = [forms.get(s) for s in n.src]
                    if all(x is not None for x in fs):
                        f = _combine(n.op, fs)
            forms[n] = f
    return forms


def _combine(op, fs):
    if op == "neg":
        return {k: -v for k, v in fs[0].items()}
    a, b = fs
    if op in ("add", "sub"):
        s = -1 if op == "sub" else 1
        out = dict(a)
        for k, v in b.items():
            out[k] = out.get(k, 0) + s * v
        return out
    if set(a) <= {"c"}:
        a, b = b, a
    if not set(b) <= {"c"}:
        return None  # a product of two indices is not affine
    k = b.get("c", 0)
    return {key: v * k for key, v in a.items()}


@dataclass(frozen=True)
class Buffer:
    """A kernel parameter: a flat buffer of `size` elements of `dtype`."""
    name: str
    dtype: np.dtype
    size: int


@dataclass(frozen=True)
class Store:
    buffer: int
    offset: KExpr
    value: KExpr
    mode: str = "set"  # "set" | "add"


@dataclass(frozen=True)
class Kernel:
    """A loop nest: parallel `shape` × optional `reduce_shape`, writing `stores`.
    buffers[:n_inputs] are read-only inputs; the rest are outputs."""
    name: str
    buffers: tuple
    n_inputs: int
    shape: tuple
    reduce_shape: tuple
    stores: tuple
    meta: dict = field(default_factory=dict, compare=False, hash=False)  # e.g. source equations

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def has_reduce(self) -> bool:
        return bool(self.reduce_shape)

    @property
    def row_stores(self) -> tuple:
        """The stores that run over the reduction space (they read ridx outside reduce nodes)."""
        rows = self.meta.get("row_stores")
        if rows is None:
            memo: dict = {}
            rows = self.meta["row_stores"] = tuple(
                st for st in self.stores if reads_ridx(st.offset, memo) or reads_ridx(st.value, memo))
        return rows

    @property
    def serial(self) -> bool:
        """Whether the kernel must run on one thread (it accumulates into shared elements)."""
        return any(s.mode == "add" for s in self.stores)

    @property
    def owner_axis(self) -> int | None:
        """A parallel axis along which the "add" stores never meet, or None: every add offset is
        c * idx(a) + g with g free of idx(a) and always a multiple of |c| * shape[a] (an
        embedding gradient's feature axis: row * d + column). Then one thread may own each index
        along a and run the rest of the space in order: no atomics, and a fixed order of adds."""
        if "owner_axis" not in self.meta:
            adds = [s for s in self.stores if s.mode == "add"]
            self.meta["owner_axis"] = None if not adds or self.has_reduce else next(
                (a for a in reversed(range(len(self.shape)))
                 if self.shape[a] > 1 and all(_owned(s.offset, a, self.shape[a]) for s in adds)), None)
        return self.meta["owner_axis"]

    def signature(self) -> str:
        """A stable text form, for cache keys."""
        return pp_kernel(self)

    def __str__(self):
        return pp_kernel(self)


def _terms(n: KExpr) -> list:
    return [t for s in n.src for t in _terms(s)] if n.op == "add" else [n]


def _multiple_of(n: KExpr, m: int) -> bool:
    """Whether the integer n is a multiple of m at every point (known from its form)."""
    if n.op == "const":
        return n.arg % m == 0
    if n.op == "mul":
        return any(_multiple_of(s, m) for s in n.src)
    if n.op in ("add", "sub"):
        return all(_multiple_of(s, m) for s in n.src)
    if n.op == "cast" and np.dtype(n.dtype).kind in "iu" and np.dtype(n.src[0].dtype).kind in "iu":
        return _multiple_of(n.src[0], m)
    return False


def _owned(offset: KExpr, axis: int, extent: int) -> bool:
    """Whether offset = c * idx(axis) + g, g free of idx(axis) and a multiple of |c| * extent."""
    a = idx(axis)
    scaled, rest = [], []
    for t in _terms(offset):
        (scaled if a in t.toposort() else rest).append(t)
    if len(scaled) != 1:
        return False
    t = scaled[0]
    if t == a:
        c = 1
    elif t.op == "mul" and a in t.src and t.src[1 - t.src.index(a)].op == "const":
        c = t.src[1 - t.src.index(a)].arg
    else:
        return False
    return c != 0 and all(_multiple_of(g, abs(c) * extent) for g in rest)


def pp_kernel(k: Kernel) -> str:
    """Readable text of a kernel: buffers, spaces, then the expression DAG in SSA order."""
    lines = [f"kernel {k.name}(" + ", ".join(
        f"{'in' if i < k.n_inputs else 'out'} {b.name}:{np.dtype(b.dtype).name}[{b.size}]"
        for i, b in enumerate(k.buffers)) + ")",
        f"  parallel {tuple(k.shape)}" + (f"  reduce {tuple(k.reduce_shape)}" if k.reduce_shape else "")]
    names: dict = {}
    for st in k.stores:
        for root in (st.offset, st.value):
            for n in root.toposort():
                if n in names:
                    continue
                names[n] = f"%{len(names)}"
                if n.op == "const":
                    body = f"const {n.arg!r}"
                elif n.op in ("idx", "ridx"):
                    body = f"{n.op} {n.arg}"
                elif n.op == "load":
                    body = f"load {k.buffers[n.arg].name}[{names[n.src[0]]}]"
                else:
                    body = n.op + (f".{n.arg}" if n.arg is not None else "") + " " + \
                        ", ".join(names[s] for s in n.src)
                lines.append(f"  {names[n]}:{np.dtype(n.dtype).name} = {body}")
        lines.append(f"  store{'+' if st.mode == 'add' else ''} {k.buffers[st.buffer].name}"
                     f"[{names[st.offset]}] = {names[st.value]}")
    return "\n".join(lines)
