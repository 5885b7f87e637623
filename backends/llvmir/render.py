"""Kernel IR → LLVM IR: one function `void f(i8** buffers, i64 start, i64 end)` per Kernel that
runs the points [start, end) of the flattened parallel space.

The loop nest is built for LLVM's loop vectoriser: index maps are recognised as affine forms,
adjacent axes that every form walks contiguously are merged, and the innermost remaining axis
becomes a plain counted loop whose loads/stores are consecutive (or invariant) in its counter.
Reductions run in one fused loop nest per point (all `reduce` nodes accumulate together); when
the reduced axes are strided but the innermost parallel axis is contiguous (a column sum), the
loops are interchanged over a tile of that axis so the vectoriser still sees unit-stride loops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import llvmlite.ir as ir
import ml_dtypes
import numpy as np

from tilefuse.ir.kernel.ir import SUM_BLOCK, SUM_FAN, Kernel, KExpr, affine_forms, blocked_sums, \
    load, reads_ridx, reduce_levels, row_stashes, sum_levels

from . import vecmath
from .irutil import _like, bf16_to_f32, counted_loop, f32_to_bf16, splat
from .vecmath import F32, F64, I32, I64, Emit

I1, I8, I16 = ir.IntType(1), ir.IntType(8), ir.IntType(16)
HALF = ir.HalfType()
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
BOOL = np.dtype(np.bool_)
UINT32, UINT64 = np.dtype(np.uint32), np.dtype(np.uint64)
# register type and memory type of each dtype (bfloat16 is kept as its 16 bits)
TYPES = {np.dtype(np.bool_): (I1, I8), np.dtype(np.int32): (I32, I32), UINT32: (I32, I32),
         np.dtype(np.int64): (I64, I64), UINT64: (I64, I64), F16: (HALF, HALF), BF16: (I16, I16),
         np.dtype(np.float32): (F32, F32), np.dtype(np.float64): (F64, F64),
         # 8/16-bit ints: loaded and stored narrow, computed in int32 (ir/kernel/lower.py wraps them)
         np.dtype(np.int8): (I8, I8), np.dtype(np.uint8): (I8, I8), np.dtype(np.int16): (I16, I16),
         np.dtype(np.uint16): (I16, I16)}
CONTRACT = ("contract",)  # lets LLVM fuse a*b+c into an FMA: ≤ 0.5 ulp from numpy per pair
REASSOC = ("reassoc", "contract")  # reductions only: partial sums per SIMD lane (like pairwise)
REDUCE_TILE = 256  # parallel points per tile when loops are interchanged for a strided reduction
# Interleave the vectorised point loop 4 ways: LLVM picks 1 for long bodies, but the transcendental
# chains are latency-bound (tanh/sigmoid/exp chain on one znver3 core: 3.0 ns a point as LLVM
# chooses, 2.1 interleaved 4 ways, 2.2-2.5 with llvm.loop.vectorize.width 16 instead). The SIMD
# width itself comes from DeviceInfo through the "prefer-vector-width" function attribute.
INTERLEAVE = 4


def is_float(d) -> bool:
    return np.dtype(d) in (F16, BF16, np.dtype(np.float32), np.dtype(np.float64))


def is_16(d) -> bool:
    return np.dtype(d) in (F16, BF16)


def is_unsigned(d) -> bool:
    return np.dtype(d) == BOOL or np.dtype(d).kind == "u"


# ---- analysis: affine index forms and axis merging ------------------------------------------

@dataclass
class Groups:
    """Axes of one space merged into loop variables: groups[g] = (size, axes); an axis of size 1
    belongs to no group (its index is 0)."""
    groups: list
    axis_group: dict  # axis -> group number

    @property
    def sizes(self):
        return [s for s, _ in self.groups]


def merge_axes(shape, kind: str, forms) -> Groups:
    """Merge adjacent axes k, k+1 of `shape` when every form has c[k] == c[k+1]·shape[k+1]: then
    Σ c·idx over the merged axes is c[last]·(merged counter) for every form."""
    def coef(f, k):
        return f.get((kind, k), 0)
    groups = []  # built innermost first: [first_axis, ..., last_axis]
    for k in reversed(range(len(shape))):
        if shape[k] == 1:
            continue
        if groups:
            first = groups[-1][0]
            if shape[k] > 0 and shape[first] > 0 and all(
                    coef(f, k) == coef(f, first) * shape[first] for f in forms):
                groups[-1].insert(0, k)
                continue
        groups.append([k])
    groups.reverse()
    out = [(int(np.prod([shape[a] for a in axes], dtype=np.int64)), axes) for axes in groups]
    return Groups(out, {a: g for g, (_, axes) in enumerate(out) for a in axes})


def cache_text(kernel: Kernel) -> str:
    """What render() reads of a kernel, as text: equal text, equal code (tests/backends/
    test_shape_generic.py holds the renderer to it). Left out, because the code never reads them:
    the name, buffer sizes, the first parallel group's extent (points arrive as [start, end); the
    first counter is what remains of a point) and how axes make up a group (an index is printed as
    the form over the groups' counters that _affine emits). So a new batch size, or a kernel over
    (n, 128) beside one over (n, 384), reuses compiled code."""
    r = Renderer(kernel, "k")
    sizes = r.par.sizes
    lines = ["k(" + ", ".join(np.dtype(b.dtype).name for b in kernel.buffers) + f") inputs {kernel.n_inputs}",
             f"groups {len(sizes)} {sizes[1:]} reduce {tuple(kernel.reduce_shape)} {r.red.groups} "
             f"interchange {r.interchange}"]
    names: dict = {}
    ridx_memo: dict = {}

    def name(n: KExpr) -> str:
        if n in names:
            return names[n]
        f = r.forms.get(n)
        if f is not None and any(k != "c" for k in f):
            body = f"affine {f.get('c', 0)} {sorted(r.group_terms(f).items())} ridx {reads_ridx(n, ridx_memo)}"
        else:
            body = f"{n.op} {n.arg!r} " + " ".join(name(x) for x in n.src)
        names[n] = f"%{len(names)}"
        lines.append(f"{names[n]}:{np.dtype(n.dtype).name} = {body}")
        return names[n]
    for st in kernel.stores:
        lines.append(f"store{st.mode} {st.buffer} {name(st.offset)} {name(st.value)}")
    return "\n".join(lines)


# ---- the renderer -----------------------------------------------------------------------------

class Renderer:
    """Renders one Kernel into an llvmlite module holding one function."""

    def __init__(self, kernel: Kernel, fn_name: str, reduce_tile: int = REDUCE_TILE,
                 interleave: int = INTERLEAVE):
        self.k, self.fn_name, self.tile, self.interleave = kernel, fn_name, reduce_tile, interleave
        roots = [e for st in kernel.stores for e in (st.offset, st.value)]
        self.nodes = {n for r in roots for n in r.toposort()}
        self.levels = reduce_levels(roots)  # reductions in dependency order, one pass per level
        self.reduces = [n for level in self.levels for n in level]
        self.row_stores = set(map(id, kernel.row_stores))
        stash = row_stashes(kernel)  # values a reduction pass keeps for the row pass
        self.stash = {id(st): stash[id(st)][1] for st in kernel.row_stores if id(st) in stash}
        self.stash_at = [[st for st in kernel.row_stores if stash.get(id(st), (None,))[0] == i]
                         for i in range(len(self.levels))]
        self.forms = affine_forms(roots)
        used = self._used_forms(roots)
        self.par = merge_axes(kernel.shape, "idx", used)
        self.red = merge_axes(kernel.reduce_shape, "ridx", used)
        self.dep_ridx: dict = {}  # every node, those under reduce nodes too
        for n in self.nodes:
            reads_ridx(n, self.dep_ridx)
        self.interchange = self._want_interchange()

    def _used_forms(self, roots):
        """Forms that are rendered as such: an index-bearing affine node whose parent is not
        affine (or that is a root)."""
        def bears(f):
            return f is not None and any(k != "c" for k in f)
        maximal = set()
        for r in roots:
            if bears(self.forms[r]):
                maximal.add(r)
        for n in self.nodes:
            if self.forms[n] is None:
                maximal.update(s for s in n.src if bears(self.forms[s]))
        self.maximal = maximal
        return [self.forms[n] for n in maximal]

    def _want_interchange(self) -> bool:
        """Interchange the reduce loops with the innermost parallel axis when fewer of the loads
        inside reductions are strided along that axis than along the innermost reduce axis
        (a column sum; a matrix product's B operand), so the vectoriser gets unit strides."""
        if not self.reduces or not self.par.groups or not self.red.groups:
            return False
        if len(self.levels) > 1 or self.row_stores:
            return False  # a row kernel's passes run one after another: no tile to interchange
        if self.par.sizes[-1] < 8:
            return False
        p_last = self.par.groups[-1][1][-1]
        r_last = self.red.groups[-1][1][-1]
        forms = [self.forms.get(n.src[0]) for n in self.nodes if n.op == "load" and self.dep_ridx[n]]
        if not forms or any(f is None for f in forms):
            return False  # gathers: keep the plain order
        strides = [(f.get(("idx", p_last), 0), f.get(("ridx", r_last), 0)) for f in forms]
        strided_outer = sum(p not in (0, 1) for p, _ in strides)
        strided_inner = sum(r not in (0, 1) for _, r in strides)
        return strided_outer < strided_inner

    # -- entry ---------------------------------------------------------------------------------
    def render(self) -> ir.Module:
        mod = ir.Module(name=self.fn_name)
        fnty = ir.FunctionType(ir.VoidType(), [ir.PointerType(), I64, I64])
        fn = ir.Function(mod, fnty, name=self.fn_name)
        fn.attributes.add("nounwind")
        fn.attributes.add("norecurse")
        fn.args[0].add_attribute("noalias")
        self.fn = fn
        entry = fn.append_basic_block("entry")
        self.b = ir.IRBuilder(entry)
        self.em = Emit(self.b)
        self.allocas_at = entry
        b = self.b
        bufs, start, end = fn.args
        self.ptrs = [b.load(b.gep(bufs, [ir.Constant(I64, i)], inbounds=True, source_etype=ir.PointerType()),
                            typ=ir.PointerType(), name=f"buf{i}")
                     for i in range(len(self.k.buffers))]
        self.cache: dict = {}
        self.env: dict = {}
        body = self.b.append_basic_block("body")
        b.branch(body)
        b.position_at_end(body)
        self._parallel(start, end)
        b.ret_void()
        return mod

    # -- loops ---------------------------------------------------------------------------------
    def _loop(self, lo, hi, name, body, interleave=None):
        """for (i = lo; i < hi; ++i) body(i): a plain counted loop the vectoriser recognises."""
        def step_body(i, _):
            body(i)  # carries nothing (whatever body returns)
        _, latch = counted_loop(self.b, lo, hi, step_body, name=name, flags=("nsw", "nuw"))
        if interleave:
            self._loop_hint(latch, name, "llvm.loop.interleave.count", interleave)

    def _loop_hint(self, latch, name, key, value):
        """Attach loop metadata (a self-referential loop ID) to a loop's back edge."""
        mod = latch.module
        hint = mod.add_metadata([ir.MetaDataString(mod, key), ir.Constant(I32, value)])
        loop_id = mod.add_metadata([None, hint, ir.MetaDataString(mod, f"{self.fn_name}.{name}")])
        loop_id.operands = (loop_id, hint)
        latch.set_metadata("llvm.loop", loop_id)

    def _parallel(self, start, end):
        b, groups = self.b, self.par.groups
        c = lambda v: ir.Constant(I64, v)  # noqa: E731
        if not groups:  # one point (all axes of size 1)
            with b.if_then(b.icmp_signed("<", start, end)):
                self._point_scope()
            return
        if len(groups) == 1:  # one counter: the points themselves (no size in the code, see leading_free)
            if self.interchange:
                self._tiled(start, end)
            else:
                self._loop(start, end, "i", self._point_at, interleave=self.interleave)
            return
        n = groups[-1][0]
        row_lo = b.sdiv(start, c(n))
        row_hi = b.sdiv(b.add(end, c(n - 1)), c(n))

        def row(r):
            base = b.mul(r, c(n))
            lo = self._smax(b.sub(start, base), c(0))
            hi = self._smin(b.sub(end, base), c(n))
            rest = r
            for g in reversed(range(len(groups) - 1)):  # the outer counters from the row number
                size = groups[g][0]
                self.env[("idx", g)] = b.srem(rest, c(size)) if g else rest
                rest = b.sdiv(rest, c(size)) if g else rest
            if self.interchange:
                self._tiled(lo, hi)
            else:
                self._loop(lo, hi, "i", self._point_at, interleave=self.interleave)
        self._loop(row_lo, row_hi, "row", row)

    def _smax(self, a, bb):
        return self.b.select(self.b.icmp_signed(">", a, bb), a, bb)

    def _smin(self, a, bb):
        return self.b.select(self.b.icmp_signed("<", a, bb), a, bb)

    def _point_at(self, i):
        self.env[("idx", len(self.par.groups) - 1)] = i
        self._point_scope()

    def _point_scope(self):
        """One parallel point: the reduce loops (if any), the stores, then the row stores in one
        more pass over the reduction space."""
        saved = dict(self.cache)
        for level, stash in zip(self.levels, self.stash_at):
            self._reduce_point(level, stash)
        for st in self.k.stores:
            if id(st) not in self.row_stores:
                self._store(st)
        rows = [st for st in self.k.stores if id(st) in self.row_stores]
        if rows:
            self._hoist_invariants([e for st in rows for e in (st.offset, st.value)])
            outer = dict(self.cache)

            def inner():
                for st in rows:
                    node = self.stash.get(id(st))
                    if node is not None:  # kept by a reduction pass in the store's own buffer
                        self.cache[node] = self.value(load(st.buffer, st.offset, node.dtype))
                    self._store(st)
                self.cache = dict(outer)
            self._reduce_nest(inner)
        self.cache = saved

    # -- reductions ----------------------------------------------------------------------------
    def _alloca(self, ty, count=None):
        b = self.b
        with b.goto_block(self.allocas_at):
            b.position_at_start(self.allocas_at)
            return b.alloca(ty, size=None if count is None else ir.Constant(I64, count))

    def _reduce_point(self, reduces, stash=()):
        """Accumulators in stack slots (SROA makes them registers), one loop nest for all of
        `reduces` (one level: they read no reduce that is not computed yet); the row stores in
        `stash` get the value the row pass would compute again (row_stashes)."""
        b = self.b
        self._hoist_invariants([s for n in reduces for s in n.src])
        accs = [self._acc_init(n) for n in reduces]
        saved = dict(self.cache)

        def inner():
            for n, acc in zip(reduces, accs):
                self._acc_step(n, acc, None)
            for st in stash:
                self._store(st, self.stash[id(st)])
            self.cache = dict(saved)
        sums = _SumBlocks(self, [acc[0] for n, acc in zip(reduces, accs) if n in self._blocked(reduces)])
        self._reduce_nest(inner, sums)
        sums.finish()
        for n, acc in zip(reduces, accs):
            self.cache[n] = b.load(acc[1] if acc[1] is not None else acc[0])

    def _blocked(self, reduces) -> list:
        """The float sums that run in blocks (ir/kernel/ir.py: SUM_BLOCK)."""
        steps = int(np.prod(self.k.reduce_shape, dtype=np.int64))
        return blocked_sums(reduces, steps, self.steps_per_block)

    @property
    def steps_per_block(self) -> int:
        """Steps of the reduction loops per block of a blocked sum: where the innermost reduce
        loop reads memory contiguously (and is not interchanged), the vectoriser spreads a block
        over (lanes x interleave) partial sums, so it may be 16 times SUM_BLOCK; else SUM_BLOCK."""
        if self.interchange or not self.red.groups:
            return SUM_BLOCK
        r_last = self.red.groups[-1][1][-1]
        forms = [self.forms.get(n.src[0]) for n in self.nodes if n.op == "load" and self.dep_ridx[n]]
        if any(f is None or f.get(("ridx", r_last), 0) not in (0, 1) for f in forms):
            return SUM_BLOCK
        return VECTOR_SUM_BLOCK

    def _reduce_nest(self, inner, sums: "_SumBlocks | None" = None):
        """The loops over the reduction space around inner(). With `sums`, blocks of at most
        steps_per_block steps: the innermost loop split in blocks when it is longer, else the
        loop whose iterations are at most that long; sums.flush() after each block."""
        groups = self.red.groups
        if any(s == 0 for s in self.k.reduce_shape):
            return  # an empty reduction: the accumulators keep their identities
        sizes = [n for n, _ in groups]
        split, flush_after, block = False, None, self.steps_per_block
        if sums is not None and sums.accs:
            if sizes[-1] > block:
                split, per_block = True, block
            else:  # the outermost loop whose iteration (the loops inside it) fits a block
                flush_after = min(g for g in range(len(sizes))
                                  if int(np.prod(sizes[g + 1:], dtype=np.int64)) <= block)
                per_block = int(np.prod(sizes[flush_after + 1:], dtype=np.int64))
            sums.start(int(np.prod(sizes, dtype=np.int64)), per_block)
        c = lambda v: ir.Constant(I64, v)  # noqa: E731

        def level(g):
            if g == len(groups):
                inner()
                return

            def body(i):
                self.env[("ridx", g)] = i
                level(g + 1)
                if g == flush_after:
                    sums.flush()
            n = groups[g][0]
            if split and g == len(groups) - 1:
                def one_block(j):
                    lo = self.b.mul(j, c(block))
                    self._loop(lo, self._smin(self.b.add(lo, c(block)), c(n)), f"r{g}", body)
                    sums.flush()
                self._loop(c(0), c(-(-n // block)), f"rb{g}", one_block)
            else:
                self._loop(c(0), c(n), f"r{g}", body)
        level(0)

    def _hoist_invariants(self, roots):
        """Evaluate the parts of `roots` (what a loop over the reduction space computes) that do
        not depend on ridx before the loop."""
        seen = set()  # a DAG: without it shared subexpressions are walked exponentially often
        for root in roots:
            stack = [root]
            while stack:
                s = stack.pop()
                if s in self.cache or s in seen:
                    continue
                seen.add(s)
                if not self.dep_ridx[s]:
                    if s.op != "const":
                        self.value(s)
                else:
                    stack.extend(s.src)

    def _identity(self, op, dtype):
        rt = TYPES[np.dtype(dtype)][0]
        d = np.dtype(dtype)
        if op in ("sum",):
            v = 0
        elif op == "prod":
            v = 1
        elif op in ("max", "argmax"):
            v = -math.inf if is_float(d) else (0 if is_unsigned(d) else np.iinfo(d).min)
        else:
            v = math.inf if is_float(d) else (1 if d == BOOL else np.iinfo(d).max)
        if d == BF16:
            v = _bf16_bits(v)
        return ir.Constant(rt, v if is_float(d) or d == BF16 else int(v))

    def _acc_init(self, n, slots=None):
        b = self.b
        op, x = n.arg, n.src[0]
        vt = TYPES[x.dtype][0]
        val = self._alloca(vt, slots)
        idx = self._alloca(I64, slots) if op in ("argmax", "argmin") else None
        init_v = self._identity(op, x.dtype)
        init_i = self._first_index(n) if idx is not None else None
        if slots is None:
            b.store(init_v, val)
            if idx is not None:
                b.store(init_i, idx)
        return val, idx, init_v, init_i

    def _first_index(self, n):
        """The argmax index expression at ridx = 0 (the answer when nothing beats the identity)."""
        saved_env, saved_cache = dict(self.env), self.cache
        self.cache = {k: v for k, v in self.cache.items() if not self.dep_ridx.get(k, False)}
        for g in range(len(self.red.groups)):
            self.env[("ridx", g)] = ir.Constant(I64, 0)
        v = self.value(n.src[1])
        self.env, self.cache = saved_env, saved_cache
        return v

    def _acc_step(self, n, acc, slot):
        b = self.b
        op, x = n.arg, n.src[0]
        val_p, idx_p = acc[0], acc[1]
        if slot is not None:
            val_p = b.gep(val_p, [slot], inbounds=True, source_etype=val_p.allocated_type)
            idx_p = idx_p and b.gep(idx_p, [slot], inbounds=True, source_etype=I64)
        a = b.load(val_p)
        v = self.value(x)
        if op in ("argmax", "argmin"):
            better = self._better(op, x.dtype, v, a)
            b.store(b.select(better, v, a), val_p)
            b.store(b.select(better, self.value(n.src[1]), b.load(idx_p)), idx_p)
        else:
            b.store(self._combine_acc(op, x.dtype, a, v), val_p)

    def _combine_acc(self, op, dtype, a, v):
        b, d = self.b, np.dtype(dtype)
        if d == BOOL:
            return b.or_(a, v) if op in ("sum", "max") else b.and_(a, v)
        if is_16(d):
            w = self._combine_acc(op, np.float32, self._convert(a, d, np.float32),
                                  self._convert(v, d, np.float32))
            return self._convert(w, np.float32, d)
        if is_float(d):
            if op == "sum":
                return b.fadd(a, v, flags=REASSOC)
            if op == "prod":
                return b.fmul(a, v, flags=REASSOC)
            return self.em.intrinsic("maximum" if op == "max" else "minimum", a.type, [a, v])
        if op == "sum":
            return b.add(a, v)
        if op == "prod":
            return b.mul(a, v)
        name = ("u" if is_unsigned(d) else "s") + op
        return self.em.intrinsic(name, a.type, [a, v])

    def _better(self, op, dtype, v, a):
        """argmax: v > a, or v is the first NaN (numpy: NaN is the extreme; ties keep the first)."""
        b, d = self.b, np.dtype(dtype)
        if is_16(d):
            v, a = self._convert(v, d, np.float32), self._convert(a, d, np.float32)
            d = np.dtype(np.float32)
        cmp = ">" if op == "argmax" else "<"
        if is_float(d):
            nan_first = b.and_(self.em.isnan(v), b.fcmp_ordered("ord", a, a))
            return b.or_(b.fcmp_ordered(cmp, v, a), nan_first)
        return (b.icmp_unsigned if is_unsigned(d) else b.icmp_signed)(cmp, v, a)

    def _tiled(self, lo, hi):
        """Interchanged loops over a tile of the innermost parallel axis: init the tile's
        accumulators, run the reduce nest with the tile loop innermost, then store."""
        b, tile = self.b, self.tile
        c = lambda v: ir.Constant(I64, v)  # noqa: E731
        gi = len(self.par.groups) - 1
        accs = [self._acc_init(n, tile) for n in self.reduces]
        blocked = self._blocked(self.reduces)
        n_tiles = b.sdiv(b.add(b.sub(hi, lo), c(tile - 1)), c(tile))

        def per_tile(t):
            t0 = b.add(lo, b.mul(t, c(tile)))
            tn = self._smin(b.sub(hi, t0), c(tile))

            def init(j):
                self.env[("idx", gi)] = b.add(t0, j)
                for n, acc in zip(self.reduces, accs):
                    val, idx, init_v, _ = acc
                    b.store(init_v, b.gep(val, [j], inbounds=True, source_etype=val.allocated_type))
                    if idx is not None:
                        saved = self.cache
                        self.cache = {}
                        b.store(self._first_index(n), b.gep(idx, [j], inbounds=True, source_etype=I64))
                        self.cache = saved
            self._loop(c(0), tn, "ti", init)
            sums = _SumBlocks(self, [acc[0] for n, acc in zip(self.reduces, accs) if n in blocked],
                              slots=tile, count=tn)
            saved_cache = self.cache

            def step(j):
                self.env[("idx", gi)] = b.add(t0, j)
                self.cache = {}
                for n, acc in zip(self.reduces, accs):
                    self._acc_step(n, acc, j)
                self.cache = saved_cache
            self._reduce_nest(lambda: self._loop(c(0), tn, "tj", step), sums)
            sums.finish()

            def finish(j):
                self.env[("idx", gi)] = b.add(t0, j)
                self.cache = {}
                for n, acc in zip(self.reduces, accs):
                    val = acc[1] if acc[1] is not None else acc[0]
                    ety = I64 if acc[1] is not None else val.allocated_type
                    self.cache[n] = b.load(b.gep(val, [j], inbounds=True, source_etype=ety))
                for st in self.k.stores:
                    self._store(st)
                self.cache = saved_cache
            self._loop(c(0), tn, "tk", finish)
        self._loop(c(0), n_tiles, "tile", per_tile)

    # -- stores --------------------------------------------------------------------------------
    def _store(self, st, value=None):
        """st's value (or `value`, a node of the buffer's dtype) stored at st's offset."""
        b = self.b
        d = np.dtype(self.k.buffers[st.buffer].dtype)
        mt = TYPES[d][1]
        ptr = b.gep(self.ptrs[st.buffer], [self._index(self.value(st.offset), st.offset.dtype)],
                    inbounds=True, source_etype=mt)
        value = st.value if value is None else value
        v = self._convert(self.value(value), value.dtype, d)
        if st.mode == "add":
            old = self._from_mem(b.load(ptr, typ=mt), d)
            v = self._binary("add", d, old, v)
        b.store(self._to_mem(v, d), ptr)

    def _index(self, v, dtype):
        d = np.dtype(dtype)
        if d.itemsize == 8:  # int64, or uint64 (its bits: in range it is the same number)
            return v
        return (self.b.zext if is_unsigned(d) else self.b.sext)(v, I64)

    def _to_mem(self, v, d):
        return self.b.zext(v, I8) if d == BOOL else v

    def _from_mem(self, v, d):
        return self.b.icmp_unsigned("!=", v, ir.Constant(I8, 0)) if d == BOOL else v

    # -- expressions ---------------------------------------------------------------------------
    def value(self, n: KExpr):
        v = self.cache.get(n)
        if v is None:
            v = self._emit(n)
            self.cache[n] = v
        return v

    def _emit(self, n: KExpr):
        b = self.b
        f = self.forms.get(n)
        if f is not None and any(k != "c" for k in f):
            return self._affine(f)
        op = n.op
        if op == "const":
            return _constant(n.arg, n.dtype)
        if op in ("idx", "ridx"):
            return self._affine({(op, n.arg): 1})
        if op == "load":
            d = np.dtype(n.dtype)
            mt = TYPES[d][1]
            ptr = b.gep(self.ptrs[n.arg], [self._index(self.value(n.src[0]), n.src[0].dtype)],
                        inbounds=True, source_etype=mt)
            return self._from_mem(b.load(ptr, typ=mt), d)
        if op == "reduce":
            raise AssertionError(f"reduce node used outside its reduction: {n}")
        if op == "cast":
            return self._convert(self.value(n.src[0]), n.src[0].dtype, n.dtype)
        if op == "select":
            return b.select(*(self.value(s) for s in n.src))
        xs = [self.value(s) for s in n.src]
        d = np.dtype(n.src[0].dtype)
        if is_16(d):  # 16-bit floats compute in float32
            xs = [self._convert(x, d, np.float32) for x in xs]
            r = self._op(op, np.dtype(np.float32), xs)
            return r if n.dtype == BOOL else self._convert(r, np.float32, d)
        return self._op(op, d, xs)

    def group_terms(self, f) -> dict:
        """An affine form over the axes as {(kind, group): coefficient} over the loop groups."""
        terms = {}
        for key, coef in f.items():
            if key == "c" or coef == 0:
                continue
            kind, axis = key
            groups = self.par if kind == "idx" else self.red
            g = groups.axis_group.get(axis)
            if g is None:
                continue  # a size-1 axis: its index is 0
            last = groups.groups[g][1][-1]
            coefs = terms.setdefault((kind, g), f.get((kind, last), 0))
            assert coefs == f.get((kind, last), 0)
        return terms

    def _affine(self, f):
        """c + Σ coefficient·counter over the loop groups (merged axes share a counter)."""
        b = self.b
        acc = ir.Constant(I64, f.get("c", 0))
        for (kind, g), coef in self.group_terms(f).items():
            v = self.env[(kind, g)]
            acc = b.add(acc, v if coef == 1 else b.mul(v, ir.Constant(I64, coef)))
        return acc

    def _op(self, op, d, xs):
        if op in UNARY_OPS:
            return UNARY_OPS[op](self, d, xs[0])
        return self._binary(op, d, *xs)

    def _binary(self, op, d, x, y):
        d = np.dtype(d)
        if is_16(d):
            r = self._binary(op, np.float32, self._convert(x, d, np.float32),
                             self._convert(y, d, np.float32))
            return r if op in CMP else self._convert(r, np.float32, d)
        if op in CMP:
            if is_float(d):
                return self.b.fcmp_unordered("!=", x, y) if op == "ne" else \
                    self.b.fcmp_ordered(CMP[op], x, y)
            return (self.b.icmp_unsigned if is_unsigned(d) else self.b.icmp_signed)(CMP[op], x, y)
        kind = "f" if is_float(d) else "b" if d == BOOL else "u" if is_unsigned(d) else "i"
        return BINARY_OPS[op](self, kind, x, y)

    # -- conversions ---------------------------------------------------------------------------
    def _convert(self, v, src, dst):
        return convert(self.b, v, src, dst)


def convert(b: ir.IRBuilder, v, src, dst):
    """v (a scalar or a vector) from dtype src to dst, as numpy's astype."""
    src, dst = np.dtype(src), np.dtype(dst)
    if src == dst:
        return v
    f32 = np.dtype(np.float32)
    like = lambda t: _like(v, t)  # noqa: E731
    if is_16(src):  # widen to float32 first
        v = bf16_to_f32(b, v) if src == BF16 else b.fpext(v, like(F32))
        return convert(b, v, f32, dst)
    if is_16(dst):  # narrow from float32 (float64 and ints go through float32)
        if src != f32:
            v, src = convert(b, v, src, f32), f32
        if dst == F16:
            return b.fptrunc(v, like(HALF))
        return f32_to_bf16(b, v)
    rt = like(TYPES[dst][0])
    if dst == BOOL:
        zero = splat(v.type, 0)
        return b.fcmp_unordered("!=", v, zero) if is_float(src) else b.icmp_unsigned("!=", v, zero)
    if is_float(dst):
        if is_float(src):
            return b.fpext(v, rt) if TYPES[dst][0] == F64 else b.fptrunc(v, rt)
        return (b.uitofp if is_unsigned(src) or src == BOOL else b.sitofp)(v, rt)
    if is_float(src):  # float → int truncates (C); uint32 wraps like numpy via int64
        if dst == UINT32:
            return b.trunc(b.fptosi(v, like(I64)), rt)
        if dst == UINT64:  # 2**63 and up need fptoui; negatives wrap as numpy's (through int64)
            big = b.fcmp_ordered(">=", v, splat(v.type, 2.0 ** 63))
            return b.select(big, b.fptoui(v, rt), b.fptosi(v, rt))
        return b.fptosi(v, rt)
    w, rw = TYPES[src][0].width, TYPES[dst][0].width
    if w == rw:
        return v
    if w > rw:
        return b.trunc(v, rt)
    return (b.zext if is_unsigned(src) or src == BOOL else b.sext)(v, rt)


# steps of a vectorised reduction loop per block of a blocked float sum: the vectoriser spreads
# them over (vector lanes x interleave) partial sums, each then adding about SUM_BLOCK values
VECTOR_SUM_BLOCK = 16 * SUM_BLOCK


class _SumBlocks:
    """Blocked float sums (ir/kernel/ir.py: SUM_BLOCK, SUM_FAN) in a loop nest: after each block
    (`flush`) every accumulator's partial sum moves into the first of `levels` partial sums, each
    of which moves into the next after SUM_FAN of them; `finish` adds them up, lowest first.
    With `slots`, the accumulators are arrays of that many (a tile's points), `count` in use."""

    def __init__(self, r: "Renderer", accs: list, slots: int | None = None, count=None):
        self.r, self.accs, self.slots, self.count = r, accs, slots, count
        self.levels = 0

    def start(self, steps: int, per_block: int) -> None:
        """Before the loops: the levels' sums and the counters of what each level holds."""
        r = self.r
        self.levels = sum_levels(steps, per_block)
        if not self.levels:
            return
        zero = ir.Constant(I64, 0)
        self.sums = [[r._alloca(acc.allocated_type, self.slots) for _ in range(self.levels)]
                     for acc in self.accs]
        self.counters = [r._alloca(I64) for _ in range(self.levels - 1)]
        for ctr in self.counters:
            r.b.store(zero, ctr)

        def clear(at):
            for acc, lvs in zip(self.accs, self.sums):
                for lv in lvs:
                    r.b.store(ir.Constant(acc.allocated_type, 0), at(lv))
        self._each_slot(clear)

    def _each_slot(self, fn) -> None:
        """fn(at) once, or per slot of the arrays (at(p) the slot's address)."""
        r = self.r
        if self.slots is None:
            fn(lambda p: p)
            return

        def body(j):
            fn(lambda p: r.b.gep(p, [j], inbounds=True, source_etype=p.allocated_type))
        r._loop(ir.Constant(I64, 0), self.count, "tf", body)

    def _move(self, src: int) -> None:
        """Level src's sums (0: the accumulators) into level src + 1's, src's reset to 0."""
        b = self.r.b

        def move(at):
            for acc, lvs in zip(self.accs, self.sums):
                frm, to = at(acc if src == 0 else lvs[src - 1]), at(lvs[src])
                b.store(b.fadd(b.load(to), b.load(frm)), to)  # no reassoc: the order is the point
                b.store(ir.Constant(acc.allocated_type, 0), frm)
        self._each_slot(move)

    def flush(self) -> None:
        if not self.levels:
            return
        b, one = self.r.b, ir.Constant(I64, 1)
        self._move(0)

        def up(j):  # level j received one more: full (SUM_FAN) moves it up a level
            if j >= self.levels:
                return
            ctr = self.counters[j - 1]
            k = b.add(b.load(ctr), one)
            full = b.icmp_signed("==", k, ir.Constant(I64, SUM_FAN))
            b.store(b.select(full, ir.Constant(I64, 0), k), ctr)
            with b.if_then(full):
                self._move(j)
                up(j + 1)
        up(1)

    def finish(self) -> None:
        """After the loops: each accumulator = itself + its levels' sums, lowest level first."""
        if not self.levels:
            return
        b = self.r.b

        def total(at):
            for acc, lvs in zip(self.accs, self.sums):
                v = b.load(at(acc))
                for lv in lvs:
                    v = b.fadd(v, b.load(at(lv)))
                b.store(v, at(acc))
        self._each_slot(total)


CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def _constant(value, dtype):
    d = np.dtype(dtype)
    rt = TYPES[d][0]
    if d == BOOL:
        return ir.Constant(I1, int(bool(value)))
    if d == BF16:
        return ir.Constant(I16, _bf16_bits(value))
    if is_float(d):
        return ir.Constant(rt, float(value))
    return ir.Constant(rt, int(value) & ((1 << rt.width) - 1))


def _bf16_bits(value) -> int:
    return int(np.array(value, BF16).view(np.uint16))


# ---- operation tables --------------------------------------------------------------------------

def _int_div(r: Renderer, kind, x, y, rem=False):
    """C division (truncating) guarded like the numpy reference: x/0 = 0, x%0 = x, and
    INT_MIN/-1 wraps (LLVM would trap)."""
    b, c = r.b, (lambda v: splat(x.type, v))
    zero = b.icmp_signed("==", y, c(0))
    if kind == "u":
        safe = b.select(zero, c(1), y)
        q = b.urem(x, safe) if rem else b.udiv(x, safe)
        return b.select(zero, x if rem else c(0), q)
    m1 = b.icmp_signed("==", y, c(-1))
    safe = b.select(b.or_(zero, m1), c(1), y)
    q = b.srem(x, safe) if rem else b.sdiv(x, safe)
    q = b.select(m1, c(0) if rem else b.sub(c(0), x), q)
    return b.select(zero, x if rem else c(0), q)


def _shift(r: Renderer, kind, x, y, left):
    """Shifts by ≥ the width (or negative amounts) give 0, as numpy's."""
    b = r.b
    elem = x.type.element if isinstance(x.type, ir.VectorType) else x.type
    big = b.icmp_unsigned(">=", y, splat(x.type, elem.width))
    s = b.shl(x, y) if left else b.lshr(x, y)
    return b.select(big, splat(x.type, 0), s)


def _minmax(r: Renderer, kind, x, y, which):
    if kind == "f":  # NaN propagates, as np.maximum/np.minimum
        return r.em.intrinsic("maximum" if which == "max" else "minimum", x.type, [x, y])
    if kind == "b":
        return r.b.or_(x, y) if which == "max" else r.b.and_(x, y)
    return r.em.intrinsic(("u" if kind == "u" else "s") + which, x.type, [x, y])


BINARY_OPS = {
    "add": lambda r, k, x, y: r.b.fadd(x, y, flags=CONTRACT) if k == "f" else r.b.or_(x, y) if k == "b"
    else r.b.add(x, y),
    "sub": lambda r, k, x, y: r.b.fsub(x, y, flags=CONTRACT) if k == "f" else r.b.sub(x, y),
    "mul": lambda r, k, x, y: r.b.fmul(x, y, flags=CONTRACT) if k == "f" else r.b.and_(x, y) if k == "b"
    else r.b.mul(x, y),
    "div": lambda r, k, x, y: r.b.fdiv(x, y) if k == "f" else _int_div(r, k, x, y),
    "rem": lambda r, k, x, y: r.b.frem(x, y) if k == "f" else _int_div(r, k, x, y, rem=True),
    "pow": lambda r, k, x, y: vecmath.binary_pow(r.em, x, y),
    "max": lambda r, k, x, y: _minmax(r, k, x, y, "max"),
    "min": lambda r, k, x, y: _minmax(r, k, x, y, "min"),
    "and": lambda r, k, x, y: r.b.and_(x, y),
    "or": lambda r, k, x, y: r.b.or_(x, y),
    "xor": lambda r, k, x, y: r.b.xor(x, y),
    "shift_left": lambda r, k, x, y: _shift(r, k, x, y, True),
    "shift_right_logical": lambda r, k, x, y: _shift(r, k, x, y, False),
}


def _sign(r: Renderer, d, x):
    b = r.b
    c = (lambda v: splat(x.type, v))
    if is_float(d):  # ±0 and NaN give themselves
        return b.select(b.fcmp_ordered(">", x, c(0.0)), c(1.0),
                        b.select(b.fcmp_ordered("<", x, c(0.0)), c(-1.0), x))
    pos = b.zext(b.icmp_unsigned(">", x, c(0)) if is_unsigned(d) else b.icmp_signed(">", x, c(0)), x.type)
    if is_unsigned(d):
        return pos
    return b.sub(pos, b.zext(b.icmp_signed("<", x, c(0)), x.type))


def _abs(r: Renderer, d, x):
    if is_float(d):
        return r.em.fabs(x)
    if is_unsigned(d):
        return x
    neg = r.b.icmp_signed("<", x, splat(x.type, 0))
    return r.b.select(neg, r.b.sub(splat(x.type, 0), x), x)


UNARY_OPS = {
    "neg": lambda r, d, x: r.b.fneg(x) if is_float(d) else r.b.sub(splat(x.type, 0), x),
    "sqrt": lambda r, d, x: r.em.intrinsic("sqrt", x.type, [x]),
    "rsqrt": lambda r, d, x: r.b.fdiv(splat(x.type, 1.0), r.em.intrinsic("sqrt", x.type, [x])),
    "abs": _abs,
    "sign": _sign,
    "floor": lambda r, d, x: r.em.intrinsic("floor", x.type, [x]),
    "ceil": lambda r, d, x: r.em.intrinsic("ceil", x.type, [x]),
    "round": lambda r, d, x: r.em.intrinsic("roundeven", x.type, [x]),  # half to even, as numpy
    "not": lambda r, d, x: r.b.not_(x),
    "is_finite": lambda r, d, x: r.b.fcmp_ordered("<", r.em.fabs(x), splat(x.type, math.inf)),
    **{op: (lambda op: lambda r, d, x: vecmath.unary(r.em, op, x))(op) for op in vecmath.LIBM},
    "logistic": lambda r, d, x: vecmath.unary(r.em, "logistic", x),
}


class _Ops:
    """What the op tables need of a renderer: a builder and its math emitter."""

    def __init__(self, b: ir.IRBuilder):
        self.b, self.em = b, Emit(b)


def emit_pointwise(b: ir.IRBuilder, expr: KExpr, bound: dict):
    """The LLVM value of an elementwise expression (constants, unary and binary ops, comparisons,
    selects, casts) over the leaves `bound` maps to values, scalars or vectors of one width: a GEMM
    template's epilogue (ir/kernel/lower.epilogue_expr), rendered by the same op tables as the
    kernels. 16-bit values compute in float32, as in kernels."""
    r, values = _Ops(b), dict(bound)
    lanes = next(iter(bound.values()))

    def value(n: KExpr):
        v = values.get(n)
        if v is None:
            d = np.dtype(n.dtype)
            if n.op == "const":
                v = splat(_like(lanes, TYPES[d][0]), _constant(n.arg, d).constant)
            elif n.op == "select":
                v = b.select(*(value(s) for s in n.src))
            elif n.op == "cast":
                v = convert(b, value(n.src[0]), n.src[0].dtype, d)
            elif n.op in UNARY_OPS:
                v = UNARY_OPS[n.op](r, d, value(n.src[0]))
            else:
                sd = np.dtype(n.src[0].dtype)
                x, y = value(n.src[0]), value(n.src[1])
                if n.op in CMP:
                    if is_float(sd):
                        v = b.fcmp_unordered("!=", x, y) if n.op == "ne" else b.fcmp_ordered(CMP[n.op], x, y)
                    else:
                        v = (b.icmp_unsigned if is_unsigned(sd) or sd == BOOL else b.icmp_signed)(CMP[n.op], x, y)
                else:
                    kind = "f" if is_float(sd) else "b" if sd == BOOL else "u" if is_unsigned(sd) else "i"
                    v = BINARY_OPS[n.op](r, kind, x, y)
            values[n] = v
        return v
    return value(expr)


def render(kernel: Kernel, fn_name: str, vector_bits: int = 256, interleave: int = INTERLEAVE,
           reduce_tile: int = REDUCE_TILE) -> str:
    """The LLVM IR text of one kernel (function `fn_name`), tuned for `vector_bits` SIMD."""
    text = str(Renderer(kernel, fn_name, reduce_tile, interleave).render())
    # llvmlite has no string attributes: add the vector width to the definition line
    head = f'define void @"{fn_name}"'
    i = text.index(head)
    j = text.index("{", i)
    return text[:j] + f'"prefer-vector-width"="{vector_bits}" ' + text[j:]
