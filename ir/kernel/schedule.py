"""The scheduler: an index-space Kernel (ir.py: what is computed at every point) laid out as a
TileKernel (tile.py: how), from the device's Target. One place decides, for every backend that
prints tile kernels, how points map to work-groups, work-items and vector lanes, and how
reductions become loops over accumulators; renderers print the result.

The layout (v1):
- CPU targets first merge adjacent axes that every index walks as one (merge_axes: a kernel over
  (n, 128) contiguous becomes one over (128 n,)), so vectors fill and ragged ends are few.
- Points: `units` per work-item; a work-group of `group` work-items (1 on a CPU target, where a
  work-group is one task of the pool or one PoCL work-item loop; with groups of one and vectors,
  a task is a row: its whole vectors in a loop, then its ragged end, no test per vector). With vector lanes W (CPU
  targets whose last parallel axis is long enough), a unit is W consecutive points of the last
  axis: loads whose offset walks that axis with stride 1 (`stride`) become vector loads, others
  gathers, invariant ones scalars; the ragged end of the axis runs lane by lane. W is the
  Target's lanes times its `unroll` (registers in flight: the LLVM printer takes vectors of any
  width) where the loads are contiguous, one register where they gather (the code grows with
  the lanes). Where the Target takes the batch at run time (`runtime_batch`), the first axis's
  extent is read as tile.batch(), never a constant: code serves every batch size; so are the
  constants that are this instance's sizes (`sized_constants`: a packed result's slice offsets, a
  mean's count).
- Reductions: per point, one pass over the reduction space per dependency level
  (ir.reduce_levels), accumulators in registers (argmax/argmin: value and index); a reduce node
  then reads its accumulator. Row stores (they read the reduction indices) run in a last pass.
- Long reductions on a GPU (`reduce_group`): a work-group per point; its work-items walk the
  reduction space strided, then combine their partials in shared memory (a tree of halvings,
  a barrier between steps) and all read the result; one work-item stores the point, all store the
  row. No work-item loops over a long space alone (slow, and a driver may cap a loop's trips).
- "add" stores: by an owner axis on CPU targets (a task per index, no atomics); else atomic adds;
  a kernel that also sets what it adds to, whose dtype has no atomic add on the target, or whose
  target has none (Target.atomics), runs on one work-item (`serial`).
- The parameters a tuner searches: `group` where work-groups hold many work-items, the Target's
  `unroll` on CPUs (runtime/tiled.register_kernels)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .ir import (
    INDEX,
    Kernel,
    KExpr,
    affine_forms,
    binary,
    cast,
    const,
    iadd,
    ic,
    imul,
    reduce_levels,
    row_stashes,
    select,
    unary,
    walk,
)
from .ir import Store as KStore
from .target import Target
from .tile import (
    Alloc,
    Barrier,
    If,
    Range,
    Store,
    TileKernel,
    batch,
    broadcast,
    hmax,
    hmin,
    hsum,
    iota,
    key_text,
    lanes_of,
    size,
    tload,
    var,
    vload,
)

ATOMIC = ("int32", "uint32", "float32", "int64", "uint64", "float64")


@dataclass(frozen=True)
class Schedule:
    """group: work-items per work-group; lanes: vector width along the last parallel axis (1: none);
    serial: the whole kernel on one work-item; reduce_lanes: the reduction loop walks its last axis
    `reduce_lanes` steps at a time (vector accumulators, folded at the end; a scalar loop for the
    rest), where more loads are contiguous along it than along the last parallel axis (a row's
    softmax, a layer norm); owner: "add" stores run in order, a work-item per
    index (or vector of indices) of the kernel's owner axis (Kernel.owner_axis), so no two add to
    one element: no atomics, the same sums every run."""
    group: int = 1
    lanes: int = 1
    serial: bool = False
    owner: bool = False
    reduce_lanes: int = 1  # vector width along the last reduction axis (sums, maxima, minima)
    reduce_group: int = 1  # GPU: a work-group of this many work-items (a power of two) per point,
    #                        reducing its space together (strided, then a tree in shared memory)


def default_schedule(k: Kernel, target: Target, deterministic: bool = False) -> Schedule:
    """The layout the target implies: vectors along a long last axis on CPUs (or along the last
    reduction axis where more loads walk it contiguously: a row's sum; none where every load
    gathers), work-groups of up to 256 on GPUs (64 on CPUs: fewer, larger work-groups cost less
    to start), adds by an owner axis where there is one and by atomics (or one work-item) where not."""
    tw = first_extent_twin(k, target)
    if tw is not None:  # (kept in the twin's meta: each instance at a new batch size asks again)
        memo = tw.meta.setdefault("default_schedule", {})
        got = memo.get((target, deterministic))
        if got is None:
            got = memo[target, deterministic] = default_schedule(tw, target, deterministic)
        return got
    return _own_schedule(k, target, deterministic)


def _own_schedule(k: Kernel, target: Target, deterministic: bool = False) -> Schedule:
    """default_schedule of k's own layout (its twin's aside)."""
    k = laid_out(k, target)
    group = min(64 if target.kind == "cpu" else 256, target.max_group)
    W = target.lanes if target.kind == "cpu" else 1
    last = ("idx", len(k.shape) - 1)
    # gathers (loads that walk the vector axis with a stride) are a load per lane: one register's
    # worth, not `unroll` of them (the code grows with the lanes)
    unroll = max(1, target.unroll) if not _walks(k, last)[1] else 1
    # a lone axis whose extent comes at run time takes full vectors, whatever this call's extent
    # (shorter runs are the ragged end): the code then serves every batch size
    lanes = W * unroll if target.runtime_batch and len(k.shape) == 1 and W > 1 else _width(k.shape, W, unroll)
    adds = [s for s in k.stores if s.mode == "add"]
    if not adds:
        G = _reduce_group(k, target)
        if G > 1:
            return Schedule(G, 1, reduce_group=G)
        if W > 1 and k.reduce_shape:
            rlast = ("ridx", len(k.reduce_shape) - 1)
            par, red = _walks(k, last)[0], _walks(k, rlast)[0]
            args = any(r.arg in ("argmax", "argmin") for lv in reduce_levels(_roots(k)) for r in lv)
            if k.reduce_shape[-1] >= W and (red > par or lanes == 1):  # (argmax/argmin fold lane by lane: one register)
                return Schedule(group, 1, reduce_lanes=_width(k.reduce_shape, W, 1 if args else target.unroll))
            if target.kind == "cpu" and not par and not red:  # every load a gather: one register
                return Schedule(group, 1, reduce_lanes=W if k.reduce_shape[-1] >= W else 1)
        return Schedule(group, lanes)
    racy = any(np.dtype(k.buffers[s.buffer].dtype).kind == "f" for s in adds)
    if k.owner_axis is not None and (target.kind == "cpu" or (deterministic and racy)):
        owner_last = k.owner_axis == len(k.shape) - 1
        return Schedule(group, lanes if owner_last else 1, owner=True)
    if {s.buffer for s in k.stores if s.mode == "set"} & {s.buffer for s in adds} or (deterministic and racy) or \
            not target.atomics or \
            any(np.dtype(k.buffers[s.buffer].dtype).name not in ATOMIC for s in adds):
        return Schedule(serial=True)
    return Schedule(group, 1)


def _width(shape, W: int, unroll: int) -> int:
    """Lanes along the last axis of `shape`: W x the most of `unroll` registers (a power of two)
    that its extent fills, W where it fills one, else 1 (no vectors)."""
    if not shape or W <= 1 or shape[-1] < W:
        return 1
    u = max(1, unroll)
    while u > 1 and shape[-1] < W * u:
        u //= 2
    return W * u


def laid_out(k: Kernel, target: Target) -> Kernel:
    """The kernel the scheduler lays out on `target`: on CPU targets with adjacent axes merged
    (merge_axes), kept in k.meta per target kind."""
    if target.kind != "cpu":
        return k
    got = k.meta.get("merged")
    if got is None:
        got = k.meta["merged"] = merge_axes(k)
    return got


def at_first_extent(k: Kernel, n0: int | None, buffers: tuple, meta: dict, r0: int | None = None) -> Kernel:
    """k with another first extent `n0` (and `buffers` of that instance's sizes; both extents at
    least 2): a shape-generic trace's kernel at a new batch size, made from the one lowered at an
    earlier size (runtime/compiler.py) where the two have the same stores and other extents.
    Its twin (meta "twin") is k: see first_extent_twin. merge_axes merges the same axes (its
    choices ask extents other than the first, and whether one is 1), so k's layout is reused.
    A kernel with no axes (a sum to one number) has no first extent (n0 None): the instance's is
    k itself over the instance's buffers. `r0`: another first reduction extent where it differs
    (both at least 2: a sum over the batch's rows, a weight gradient's GEMM over them); the
    reduction's other extents are the same (the caller's check), and its first group of merged
    axes holds axis 0 as the parallel one's does."""
    assert (n0 is None and not k.shape) or (n0 >= 2 and k.shape and k.shape[0] >= 2), (n0, k.shape)
    assert r0 is None or (r0 >= 2 and k.reduce_shape and k.reduce_shape[0] >= 2), (r0, k.reduce_shape)
    R = k.reduce_shape if r0 is None else (r0, *k.reduce_shape[1:])
    out = Kernel(k.name, buffers, k.n_inputs, (n0, *k.shape[1:]) if k.shape else (), R, k.stores, meta)
    out.meta["twin"] = k
    merged = k.meta.get("merged")
    if merged is not None:
        mR = merged.reduce_shape if r0 is None else (merged.reduce_shape[0] // k.reduce_shape[0] * r0,
                                                     *merged.reduce_shape[1:])
        out.meta["merged"] = out if merged is k else Kernel(
            merged.name, buffers, merged.n_inputs,
            (merged.shape[0] // k.shape[0] * n0, *merged.shape[1:]) if k.shape else merged.shape,
            mR, merged.stores)
    return out


def first_extent_twin(k: Kernel, target: Target) -> Kernel | None:
    """The kernel whose schedule and code k's are (at_first_extent's twin), where they are: on a
    CPU target that takes the first extent at run time, both are made of the laid-out kernel but
    its first extent (a lone axis's lanes do not ask it; code_text writes "?"), and of kernels
    without "add" stores (an owner axis asks it); where their first reduction extents differ,
    both are generic reductions (that extent read at run time) under the one schedule each has
    on its own. Elsewhere None: k is scheduled on its own."""
    tw = k.meta.get("twin")
    if tw is None or not (target.runtime_batch and target.kind == "cpu") or any(st.mode == "add" for st in k.stores):
        return None
    if k.reduce_shape != tw.reduce_shape:
        memo = k.meta.setdefault("shares_reduction", {})
        if target not in memo:
            s = default_schedule(tw, target)
            memo[target] = _own_schedule(k, target) == s and generic_reduction(tw, target, s) and \
                generic_reduction(k, target, s)
        if not memo[target]:
            return None
    return tw


COPIES_MIN = 1024  # elements of an output from which an offset of whole copies of it is read as a size
COUNT_MIN = 64  # a float constant equal to a run-time extent at least this large is read as that size


def sized_constants(k: Kernel, target: Target, s: "Schedule") -> Kernel:
    """The laid-out kernel k with the constants that are its instance's run-time sizes written as
    those sizes, where the Target takes sizes at run time, so their code serves every batch too:
    - an index offset (an operand of an add) of whole copies of the output, m x its size (a slice
      of a packed result: dk after dq, B·H·T·D elements on), as m x size(0) x the other extents;
    - a float equal to the first extent, the output's size, a generic reduction's extent or its
      steps, or to the reciprocal of one (a mean's n, its gradient's 1/n: put into the graph as
      numbers), as that size converted (and divided into one).
    Each instance's constants are matched exactly, so its code computes what the constants did,
    and code_text shows the sizes: two instances share code only where the same relation holds."""
    if not (target.runtime_batch and k.size):
        return k
    memo_key = ("sized_constants", s)
    got = k.meta.get(memo_key)
    if got is not None:
        return got
    inner = math.prod(k.shape[1:])
    extents, whole = _size_extents(k, target, s)
    counts = {}  # (dtype, value) -> the size expression that computes it
    for n, sz in extents:
        for d, value, reciprocal in _float_sizes(n):
            f = cast(sz, d)
            for c, e in ((value, f), (reciprocal, binary("div", const(1.0, d), f))):
                counts.setdefault((d, c), e)
                counts.setdefault((d, -c), unary("neg", e))

    def copies(x: KExpr) -> KExpr:
        if whole and x.op == "const" and x.dtype == INDEX and x.arg > 0 and x.arg % whole == 0:
            return imul(batch(), x.arg // whole * inner)
        return x
    roots = [e for st in k.stores for e in (st.offset, st.value)]
    memo: dict = {}
    for n in walk(roots):  # (nodes rebuilt only where an operand changed)
        if n.op == "const" and (n.dtype, float(n.arg)) in counts:
            memo[n] = counts[n.dtype, float(n.arg)]
            continue
        src = tuple(memo[x] for x in n.src)
        if n.op == "add":
            src = tuple(map(copies, src))
        memo[n] = n if all(a is b for a, b in zip(src, n.src)) else KExpr(n.op, n.dtype, src, n.arg)
    out = k
    if any(memo[e] is not e for e in roots):
        out = Kernel(k.name, k.buffers, k.n_inputs, k.shape, k.reduce_shape,
                     tuple(KStore(st.buffer, memo[st.offset], memo[st.value], st.mode) for st in k.stores))
        out.meta.update(merged=out)  # (laid out already)
    k.meta[memo_key] = out
    return out


def _size_extents(k: Kernel, target: Target, s: "Schedule") -> tuple[list, int]:
    """sized_constants' sizes of laid-out k: [(extent, its size expression)] (those whose floats
    it reads), and the output's size where an offset of whole copies of it is read (else 0)."""
    extents = [(k.shape[0], size(0)), (k.size, imul(size(0), math.prod(k.shape[1:])))] if k.shape else []
    if generic_reduction(k, target, s):  # (the reduction's first extent, and all of its steps)
        R = k.reduce_shape
        extents += [(R[0], size(1)), (math.prod(R), imul(size(1), math.prod(R[1:])))]
    extents = [(n, sz) for n, sz in extents if COUNT_MIN <= n < 2 ** 24]
    return extents, (k.size if k.shape and k.size >= COPIES_MIN else 0)


def _float_sizes(n: int):
    """(dtype, n, 1/n) in the float dtypes whose constants sized_constants reads as sizes."""
    for d in (np.dtype(np.float32), np.dtype(np.float64)):
        yield d, float(d.type(n)), float(d.type(1) / d.type(n))


def _unsized(k: Kernel, target: Target, s: "Schedule") -> bool:
    """Whether sized_constants reads none of k's constants as its sizes. For a kernel with a twin
    (at_first_extent: the same laid-out stores), asked of the twin's constants, kept in its meta,
    instead of walking k's expressions again at every batch size."""
    lk = laid_out(k, target)
    got = lk.meta.get(("sized_constants", s))
    tw = k.meta.get("twin")
    if got is not None or tw is None:
        return (got or sized_constants(lk, target, s)) is lk
    if not (target.runtime_batch and lk.size):
        return True
    floats, offsets = _constants(laid_out(tw, target))
    extents, whole = _size_extents(lk, target, s)
    for n, _ in extents:
        for d, *values in _float_sizes(n):
            if any((d, c) in floats or (d, -c) in floats for c in values):
                return False
    return not (whole and any(a > 0 and a % whole == 0 for a in offsets))


def _constants(k: Kernel) -> tuple[frozenset, frozenset]:
    """What sized_constants may read as sizes in k: its float constants ((dtype, value)) and the
    index constants added to an offset; kept in k.meta."""
    got = k.meta.get("constants")
    if got is None:
        nodes = walk([e for st in k.stores for e in (st.offset, st.value)])
        got = k.meta["constants"] = (
            frozenset((n.dtype, float(n.arg)) for n in nodes if n.op == "const" and n.dtype.kind == "f"),
            frozenset(x.arg for n in nodes if n.op == "add" for x in n.src if x.op == "const" and x.dtype == INDEX))
    return got


def merge_axes(k: Kernel) -> Kernel:
    """k over fewer axes: adjacent axes a, a+1 that every index form walks as one (the
    coefficient of a is that of a+1 times a+1's extent) become one axis, and axes of extent 1
    go; every index form is rebuilt over the new axes. A CPU then runs long contiguous axes
    whole: vectors fill, ragged ends are few, and kernels over (n, 128) and (n, 384) share code."""
    roots = [e for st in k.stores for e in (st.offset, st.value)]
    forms = affine_forms(roots)

    def bears(f):
        return f is not None and any(key != "c" for key in f)
    # forms printed as such: an index-bearing affine node under a node that is not affine (or a root)
    maximal = {r for r in roots if bears(forms[r])}
    for n in walk(roots):
        if forms[n] is None:
            maximal.update(x for x in n.src if bears(forms[x]))
    used = [forms[n] for n in maximal]
    par, red = _groups(k.shape, "idx", used), _groups(k.reduce_shape, "ridx", used)
    if [a for _, a in par] == [[a] for a in range(len(k.shape))] and \
            [a for _, a in red] == [[a] for a in range(len(k.reduce_shape))]:
        return k

    def rebuild(f):
        out = ic(f.get("c", 0))
        for kind, groups in (("idx", par), ("ridx", red)):
            for g, (_, axes) in enumerate(groups):
                out = iadd(out, imul(KExpr(kind, INDEX, (), g), f.get((kind, axes[-1]), 0)))
        return out
    memo: dict = {}
    for n in walk(roots):
        if n in maximal:
            memo[n] = rebuild(forms[n])
        elif not bears(forms[n]):  # (index-bearing nodes under a maximal one are never asked for)
            memo[n] = KExpr(n.op, n.dtype, tuple(memo[x] for x in n.src), n.arg) if n.src else n
    stores = tuple(KStore(st.buffer, memo[st.offset], memo[st.value], st.mode) for st in k.stores)
    return Kernel(k.name, k.buffers, k.n_inputs, tuple(n for n, _ in par), tuple(n for n, _ in red), stores)


def _groups(shape, kind: str, forms) -> list:
    """Axes of `shape` merged: [(extent, axes)], outermost first; axes of extent 1 belong to none
    (their index is 0), unless all are: then one group of them all."""
    groups: list = []  # innermost first
    for a in reversed(range(len(shape))):
        if shape[a] == 1:
            continue
        if groups:
            first = groups[-1][0]
            if shape[a] > 0 and shape[first] > 0 and all(
                    f.get((kind, a), 0) == f.get((kind, first), 0) * shape[first] for f in forms):
                groups[-1].insert(0, a)
                continue
        groups.append([a])
    if not groups and shape:
        groups = [list(range(len(shape)))]
    return [(math.prod(shape[a] for a in axes), axes) for axes in reversed(groups)]


GROUP_REDUCE_MIN = 512  # reduction sizes from which a GPU point takes a work-group


def _reduce_group(k: Kernel, target: Target) -> int:
    """The work-group size for cooperative reductions on a GPU target (1: none): a power of two,
    for kernels whose reductions are long sums, products, maxima or minima."""
    if target.kind != "gpu":
        return 1
    n = math.prod(k.reduce_shape) if k.reduce_shape else 0
    if _batch_reduction(k, target):  # its extent comes at run time: a form for any batch, chosen by
        # the points alone (work-groups where too few points would leave the device idle)
        n = GROUP_REDUCE_MIN if math.prod(k.shape) < 256 * target.cores else 0
    roots = [e for st in k.stores for e in (st.offset, st.value)]
    reds = [r for level in reduce_levels(roots) for r in level]
    if n < GROUP_REDUCE_MIN or not reds or any(r.arg not in GROUP_REDUCE for r in reds):
        return 1
    G = 1 << (min(256, target.max_group, n).bit_length() - 1)
    while G > 1 and G * 16 * len(reds) > target.shared_bytes:
        G //= 2
    return G


def _roots(k: Kernel) -> list:
    return [e for st in k.stores for e in (st.offset, st.value)]


def _walks(k: Kernel, key: tuple) -> tuple[int, int]:
    """(loads whose offset walks the axis `key` with stride 1, loads whose offset moves along it
    otherwise: gathers); kept in k.meta."""
    kept = k.meta.setdefault("walks", {})
    if key not in kept:
        axis, memo = KExpr(key[0], INDEX, (), key[1]), {}
        steps = [stride(n.src[0], axis, memo) for n in walk(_roots(k)) if n.op == "load"]
        kept[key] = (sum(1 for c in steps if c == 1), sum(1 for c in steps if c not in (0, 1)))
    return kept[key]


def stride(n: KExpr, axis: KExpr, memo: dict | None = None) -> int | None:
    """How far n moves when `axis` (an idx/ridx node) grows by one: 0 where n does not read it,
    None where not by a constant. Parts that do not read the axis may be anything (an embedding
    row's offset, loaded: the row's elements still lie side by side)."""
    memo = {} if memo is None else memo
    if n in memo:
        return memo[n]
    for x in n.toposort(memo):
        ss = [memo[y] for y in x.src]
        if x == axis:
            v = 1
        elif (x.op == "reduce" and axis.op == "ridx") or all(v == 0 for v in ss):  # (one value a point)
            v = 0
        elif None in ss or x.dtype != INDEX:
            v = None
        elif x.op in ("add", "sub"):
            v = ss[0] + ss[1] if x.op == "add" else ss[0] - ss[1]
        elif x.op == "neg":
            v = -ss[0]
        elif x.op == "mul" and any(y.op == "const" for y in x.src):
            c, other = (x.src[0], ss[1]) if x.src[0].op == "const" else (x.src[1], ss[0])
            v = int(c.arg) * other
        else:
            v = None
        memo[x] = v
    return memo[n]


def _k(x) -> KExpr:
    """An index count as an expression (a constant, or already one: a run-time count)."""
    return x if isinstance(x, KExpr) else ic(x)


def divmod_index(u: KExpr, shape) -> list:
    """Row-major indices of the flat number u (< the product of `shape`) over `shape`: the first
    is what remains, so its extent is not in the expressions (tile.batch)."""
    out, rest = [], u
    for a in reversed(range(len(shape))):
        n = shape[a]
        out.append(ic(0) if n == 1 else rest if a == 0 else binary("rem", rest, ic(n)))
        rest = binary("div", rest, ic(n)) if n != 1 else rest
    return out[::-1]


def substitute(roots, env: dict, vector: tuple | None = None) -> dict:
    """Rebuild the expressions `roots` with leaves replaced (env: old node -> new node); returns
    old -> new for every node. vector = (axis, base, lanes): the index node `axis` becomes the
    vector base + iota(lanes); a load whose offset walks it with stride 1 becomes a vector load at
    the offset for `base` (stride), one that walks it otherwise a gather, one that does not a scalar."""
    memo = dict(env)
    axis = base = None
    if vector is not None:
        axis, base, lanes = vector
        memo.pop(axis, None)  # the vector axis is the vector, whatever env says of it
        steps: dict = {}
    for n in (n for root in roots for n in root.toposort(memo)):  # (not below what env gives)
        if n == axis:
            memo[n] = binary("add", broadcast(base, lanes), iota(lanes))
        elif axis is not None and n.op == "load" and stride(n.src[0], axis, steps) == 1:
            off = substitute([n.src[0]], {**env, axis: base})[n.src[0]]
            memo[n] = vload(n.arg, off, n.dtype, lanes)
        elif n.op == "reduce":  # a reduction's value is given (env), or kept whole
            memo[n] = n
        else:
            memo[n] = KExpr(n.op, n.dtype, tuple(memo[s] for s in n.src), n.arg) if n.src else n
    return memo


VECTOR_REDUCE = ("sum", "max", "min", "argmax", "argmin")
GROUP_REDUCE = ("sum", "max", "min", "prod", "argmax", "argmin")
BLOCK = 1024  # elements a float sum adds up before it is flushed into its total (blocked summation)
LANE_BLOCK = 128  # the same for one work-item's share of a group reduction (a scalar: no lanes to split it)


def _fold_arg(op: str, vname: str, tail: str | None, d: np.dtype, W: int) -> tuple[list, KExpr]:
    """The lanes of a vector argmax/argmin (accumulators `vname`, `vname`i) folded into one, then
    the scalar tail's (`tail`, `tail`i: later indices), keeping the first index among equals and
    counting a NaN as the extreme. Returns (statements, the index)."""
    iname = vname + "i"
    bv, bi = vname + "f", vname + "fi"
    stmts = [Alloc(bv, d, 1, "register"), Alloc(bi, np.dtype(INDEX), 1, "register"),
             Store(bv, ic(0), tload(vname, ic(0), d)), Store(bi, ic(0), tload(iname, ic(0), INDEX))]
    cur_v, cur_i = tload(bv, ic(0), d), tload(bi, ic(0), INDEX)

    def better(v, i, earlier: bool):
        gt = binary("gt" if op == "argmax" else "lt", v, cur_v)
        if d.kind == "f":
            gt = binary("or", gt, binary("and", binary("ne", v, v), binary("eq", cur_v, cur_v)))
        if earlier:  # a lane's index may be smaller than the best's: ties go to it
            tie = binary("eq", v, cur_v)
            if d.kind == "f":
                tie = binary("or", tie, binary("and", binary("ne", v, v), binary("ne", cur_v, cur_v)))
            gt = binary("or", gt, binary("and", tie, binary("lt", i, cur_i)))
        return binary("and", binary("ge", i, ic(0)), gt)
    for lane in range(1, W):
        v, i = tload(vname, ic(lane), d), tload(iname, ic(lane), INDEX)
        stmts.append(If(better(v, i, True), (Store(bv, ic(0), v), Store(bi, ic(0), i))))
    if tail:
        v, i = tload(tail, ic(0), d), tload(tail + "i", ic(0), INDEX)
        stmts.append(If(better(v, i, False), (Store(bv, ic(0), v), Store(bi, ic(0), i))))
    return stmts, cur_i


def _halve(op: str, d: np.dtype, name: str, at: KExpr, other: KExpr) -> tuple:
    """One step of a shared-memory tree: the partial at `at` combined with the one at `other`
    (argmax/argmin: values in `name`, indices in `name`i; ties to the first index, a NaN is the
    extreme, an index < 0 is a lane that saw nothing)."""
    va, vb = tload(name, at, d), tload(name, other, d)
    if op not in ("argmax", "argmin"):
        return (Store(name, at, _combine(op, va, vb)),)
    ia, ib = tload(name + "i", at, INDEX), tload(name + "i", other, INDEX)
    gt, tie = binary("gt" if op == "argmax" else "lt", vb, va), binary("eq", vb, va)
    if d.kind == "f":
        gt = binary("or", gt, binary("and", binary("ne", vb, vb), binary("eq", va, va)))
        tie = binary("or", tie, binary("and", binary("ne", vb, vb), binary("ne", va, va)))
    take = binary("and", binary("ge", ib, ic(0)), binary("or", binary("lt", ia, ic(0)), binary(
        "or", gt, binary("and", tie, binary("lt", ib, ia)))))
    return (If(take, (Store(name, at, vb), Store(name + "i", at, ib))),)


def _identity(op: str, d: np.dtype):
    if op in ("sum",):
        return False if d == np.bool_ else 0
    if op == "prod":
        return True if d == np.bool_ else 1
    big = np.inf if d.kind == "f" else (True if d == np.bool_ else np.iinfo(d).max)
    small = -np.inf if d.kind == "f" else (False if d == np.bool_ else np.iinfo(d).min)
    return small if op in ("max", "argmax") else big


def _combine(op: str, acc: KExpr, v: KExpr) -> KExpr:
    if op in ("sum", "prod"):
        name = {"sum": "or", "prod": "and"}[op] if v.dtype == np.bool_ else ("add" if op == "sum" else "mul")
        return binary(name, acc, v)
    return binary(op, v, acc)  # max/min: NaN propagates from either side (numpy)


class _Builder:
    def __init__(self, k: Kernel, sched: Schedule, reduce_extent: KExpr | None = None):
        self.k, self.s = k, sched
        self.n_acc = 0
        self.reduce_extent = reduce_extent  # the lone reduction axis's run-time extent (generic_reduction)

    def reduction(self, reds: list, I_env: dict, vector, stash=()) -> tuple[list, dict]:
        """Statements computing `reds` (one level) at the point I_env, and reduce -> value; also
        the `stash` stores (row_stashes: a costly value the row pass reads back), made in its loop."""
        R = self.k.reduce_shape
        if self.s.reduce_group > 1:
            return self._group_reduction(reds, I_env, stash)
        W = self.s.reduce_lanes if R[-1] >= self.s.reduce_lanes else 1
        n = self.reduce_extent  # (generic: the first axis's extent; flushed whatever it is)
        if n is not None and W > 1:  # (a generic reduction in vectors: one axis, its extent at run time)
            return self._axis_reduction(reds, I_env, W, stash, n)
        if n is None and vector is None and all(r.arg in VECTOR_REDUCE for r in reds) and \
                (W > 1 or (R[-1] > 2 * BLOCK and any(r.arg == "sum" and r.dtype.kind == "f" for r in reds))):
            return self._axis_reduction(reds, I_env, W, stash)
        env = dict(I_env)
        env.update({KExpr("ridx", INDEX, (), a): var(f"r{a}") for a in range(len(R))})
        last = len(R) - 1
        n_last = n if last == 0 else None  # (the run-time extent is the last axis's: in blocks, whatever it is)
        split = n_last is not None or R[last] > BLOCK  # the last axis in blocks of BLOCK steps (else a flush after each of its runs)
        if split:
            rb, rv = var("rb"), var("rv")
            env[KExpr("ridx", INDEX, (), last)] = iadd(imul(rb, BLOCK), rv)
        decls, updates, results, accs = [], [], {}, {}
        for r in reds:
            body = substitute(list(r.src), env, vector)
            acc = accs[r] = self._declare(r, lanes_of(body[r.src[0]]))
            decls += acc["decl"]
            updates += self._update(r, acc, body[r.src[0]], body[r.src[1]] if len(r.src) > 1 else None)
            results[r] = acc["result"]
        updates += [self.store(st, env, vector) for st in stash]
        # float sums longer than 2 BLOCK flushed into a total after each block of at most BLOCK
        # steps (blocked summation, as _axis_reduction): a block is the last axis's split, or the
        # innermost axes that fit in one
        totals = {r: tuple(self._declare(r, accs[r]["w"]) for _ in range(3)) for r in reds
                  if r.arg == "sum" and r.dtype.kind == "f" and (n is not None or math.prod(R) > 2 * BLOCK)}
        decls += [d for x in totals.values() for acc in x for d in acc["decl"]]
        flush = tuple(st for r in totals for st in self._kahan(totals[r], accs[r]["cur"], accs[r], accs[r]["w"]))
        flush_at = last if split else min(a for a in range(len(R)) if math.prod(R[a + 1:]) <= BLOCK)
        loops = tuple(updates)
        for a in reversed(range(len(R))):
            if a == last and split:
                if n_last is None:  # (whole blocks, then the rest: counts, or run-time values)
                    blocks, rest, done = R[a] // BLOCK, R[a] % BLOCK, ic(R[a] // BLOCK * BLOCK)
                else:
                    blocks, rest = binary("div", n_last, ic(BLOCK)), binary("rem", n_last, ic(BLOCK))
                    done = imul(blocks, BLOCK)
                loops = (Range("rb", blocks, "serial", (Range("rv", BLOCK, "serial", loops),) + flush),)
                if n_last is not None or rest:
                    tail = {**env, KExpr("ridx", INDEX, (), last): iadd(done, var("rt"))}
                    steps = []
                    for r in reds:
                        b = substitute(list(r.src), tail, vector)
                        steps += self._update(r, accs[r], b[r.src[0]], b[r.src[1]] if len(r.src) > 1 else None)
                    steps += [self.store(st, tail, vector) for st in stash]
                    loops += (Range("rt", rest, "serial", tuple(steps)),)
                continue
            if a == flush_at and totals:
                loops += flush
            loops = (Range(f"r{a}", n if a == 0 and n is not None else R[a], "serial", loops),)
        for r, (t, c, _) in totals.items():
            results[r] = binary("add", t["cur"], binary("sub", accs[r]["cur"], c["cur"]))
        return decls + list(loops), results

    def _declare(self, r: KExpr, w: int) -> dict:
        """The accumulators of one reduce node, `w` lanes wide: their allocations and initial
        values (decl), the current value (cur) and what the reduce node reads at the end."""
        d = np.dtype(r.src[0].dtype)
        name = f"acc{self.n_acc}"
        self.n_acc += 1
        ld = (lambda n, t: tload(n, ic(0), t)) if w == 1 else (lambda n, t: vload(n, ic(0), t, w))
        acc = {"name": name, "w": w, "cur": ld(name, d),
               "decl": [Alloc(name, d, w, "register"), Store(name, ic(0), broadcast(const(_identity(r.arg, d), d), w))]}
        acc["result"] = acc["cur"]
        if r.arg in ("argmax", "argmin"):
            acc["decl"] += [Alloc(name + "i", np.dtype(INDEX), w, "register"), Store(name + "i", ic(0), broadcast(ic(-1), w)),
                            Alloc(name + "b", np.dtype(np.bool_), w, "register")]
            acc["idx"] = acc["result"] = ld(name + "i", INDEX)
            acc["took"] = ld(name + "b", np.bool_)
        return acc

    def _update(self, r: KExpr, acc: dict, v: KExpr, ix: KExpr | None) -> list:
        """One step of a reduce node: its accumulators take the value v (and index ix)."""
        w, name, cur = acc["w"], acc["name"], acc["cur"]
        v = broadcast(v, w) if lanes_of(v) < w else v  # (a value the vector's steps share)
        if r.arg not in ("argmax", "argmin"):
            return [Store(name, ic(0), _combine(r.arg, cur, v))]
        d = np.dtype(r.src[0].dtype)
        ix = broadcast(ix, w) if lanes_of(ix) < w else ix
        better = binary("gt" if r.arg == "argmax" else "lt", v, cur)
        if d.kind == "f":  # a NaN is the extreme (numpy); the first one stays
            better = binary("or", better, binary("and", binary("ne", v, v), binary("eq", cur, cur)))
        better = binary("or", binary("lt", acc["idx"], broadcast(ic(0), w)), better)
        # decided once, before either accumulator changes
        return [Store(name + "b", ic(0), better), Store(name, ic(0), select(acc["took"], v, cur)),
                Store(name + "i", ic(0), select(acc["took"], ix, acc["idx"]))]

    def _axis_reduction(self, reds: list, I_env: dict, W: int, stash=(), n: KExpr | None = None) -> tuple[list, dict]:
        """The last reduction axis walked W steps at a time (vector accumulators, W > 1) in blocks of
        about BLOCK elements, float sums flushed lane by lane into compensated totals after each
        block (blocked summation: the error grows with the block and the block count, not the
        row; no fold across the lanes until the end), the last R % W steps
        one at a time into scalar accumulators; then folded (hsum/hmax/hmin, argmax/argmin lane by
        lane with ties to the first index). n: the (one) axis's extent read at run time
        (generic_reduction): every part is then a run-time count, which may be zero."""
        R = self.k.reduce_shape
        last = len(R) - 1
        S = max(BLOCK // W, min(64, BLOCK))  # steps per block: at least 64 adds into each lane
        if n is None:
            steps, tail = R[last] // W, R[last] % W
            nb, rem = (steps // S, steps % S) if steps > S else (0, steps)
        else:
            steps, tail = binary("div", n, ic(W)), binary("rem", n, ic(W))
            nb, rem = binary("div", steps, ic(S)), binary("rem", steps, ic(S))
        env = dict(I_env)
        env.update({KExpr("ridx", INDEX, (), a): var(f"r{a}") for a in range(last)})
        axis = KExpr("ridx", INDEX, (), last)

        def at(base):
            return (env, (axis, base, W)) if W > 1 else ({**env, axis: base}, None)
        decls, folds, results = [], [], {}
        vaccs, saccs, totals = {}, {}, {}
        for r in reds:
            vaccs[r] = self._declare(r, W)
            decls += vaccs[r]["decl"]
            if tail:
                saccs[r] = self._declare(r, 1)
                decls += saccs[r]["decl"]
            if nb and r.arg == "sum" and r.dtype.kind == "f":  # per lane: total, error, next
                totals[r] = self._declare(r, W), self._declare(r, W), self._declare(r, W)
                decls += [d for x in totals[r] for d in x["decl"]]

        def steps_at(base) -> tuple:
            e, vec = at(base)
            out = []
            for r in reds:
                body = substitute(list(r.src), e, vec)
                out += self._update(r, vaccs[r], body[r.src[0]], body[r.src[1]] if len(r.src) > 1 else None)
            return tuple(out) + tuple(self.store(st, e, vec) for st in stash)

        def fold(r, acc):
            x = acc["cur"]
            return x if acc["w"] == 1 else (hsum if r.arg == "sum" else hmax if r.arg == "max" else hmin)(x)
        flush = tuple(st for r in totals for st in self._kahan(totals[r], vaccs[r]["cur"], vaccs[r], W))
        rb, rv, rr, rt = var("rb"), var("rv"), var("rr"), var("rt")
        body = ()
        if nb:
            body += (Range("rb", nb, "serial", (Range("rv", S, "serial", steps_at(imul(iadd(imul(rb, S), rv), W))),)
                           + flush),)
        if rem:
            body += (Range("rr", rem, "serial", steps_at(imul(iadd(imul(_k(nb), S), rr), W))),)
        if tail:
            e = {**env, axis: iadd(imul(_k(steps), W), rt)}
            sl = []
            for r in reds:
                b = substitute(list(r.src), e)
                sl += self._update(r, saccs[r], b[r.src[0]], b[r.src[1]] if len(r.src) > 1 else None)
            body += (Range("rt", tail, "serial", tuple(sl) + tuple(self.store(st, e, None) for st in stash)),)
        for a in reversed(range(last)):
            body = (Range(f"r{a}", R[a], "serial", body),)
        for r in reds:
            if r.arg in ("argmax", "argmin"):
                st, res = _fold_arg(r.arg, vaccs[r]["name"], saccs[r]["name"] if tail else None,
                                    np.dtype(r.src[0].dtype), W)
                folds += st
                results[r] = res
                continue
            if r in totals:  # each lane's compensated total, then across the lanes
                t, c = totals[r][0]["cur"], totals[r][1]["cur"]
                v = binary("add", t, binary("sub", vaccs[r]["cur"], c))
                v = v if W == 1 else hsum(v)
            else:
                v = fold(r, vaccs[r])
            results[r] = _combine(r.arg, v, saccs[r]["cur"]) if tail else v
        return decls + list(body) + folds, results

    def _totals(self, reds: list, blocked: bool) -> tuple[dict, list]:
        """For each float sum (when `blocked`): accumulators for the total, its error and the next."""
        totals = {r: tuple(self._declare(r, 1) for _ in range(3)) for r in reds
                  if blocked and r.arg == "sum" and r.dtype.kind == "f"}
        return totals, [d for x in totals.values() for acc in x for d in acc["decl"]]

    @staticmethod
    def _kahan(total: tuple, partial: KExpr, acc: dict, W: int) -> tuple:
        """total += the block's sum (partial), its rounding error carried to the next block; the
        block's accumulator restarts at 0."""
        t, c, nxt = total
        y = binary("sub", partial, c["cur"])
        return (Store(nxt["name"], ic(0), binary("add", t["cur"], y)),
                Store(c["name"], ic(0), binary("sub", binary("sub", nxt["cur"], t["cur"]), y)),
                Store(t["name"], ic(0), nxt["cur"]), Store(acc["name"], ic(0), broadcast(const(0, acc["cur"].dtype), W)))

    def _group_reduction(self, reds: list, I_env: dict, stash=()) -> tuple[list, dict]:
        """The work-group's G lanes reduce one point together: lane l takes the flat reduction
        indices l, l + G, ... (float sums in blocks of LANE_BLOCK steps flushed into a total), then the
        partials meet in shared memory, halving each step; every lane reads the result."""
        R, G, lane = self.k.reduce_shape, self.s.reduce_group, var("l")
        if self.reduce_extent is None:
            n = math.prod(R)
            T = -(-n // G)
            nb, rem = (T // LANE_BLOCK, T % LANE_BLOCK) if T > LANE_BLOCK else (0, T)
            done = ic(nb * LANE_BLOCK)
        else:  # (generic: the first axis's extent at run time; both loops, run-time counts)
            n = imul(self.reduce_extent, math.prod(R[1:]))
            T = binary("div", iadd(n, ic(G - 1)), ic(G))
            nb, rem = binary("div", T, ic(LANE_BLOCK)), binary("rem", T, ic(LANE_BLOCK))
            done = imul(nb, LANE_BLOCK)
        blocked = not isinstance(nb, int) or nb > 0  # (a run-time count may be anything)
        accs = {r: self._declare(r, 1) for r in reds}
        totals, decls = self._totals(reds, blocked)
        decls = [d for a in accs.values() for d in a["decl"]] + decls

        def steps_at(t: KExpr) -> tuple:
            f = iadd(imul(t, G), lane)
            env = {**I_env, **{KExpr("ridx", INDEX, (), a): i for a, i in enumerate(divmod_index(f, R))}}
            out = []
            for r in reds:
                body = substitute(list(r.src), env)
                out += self._update(r, accs[r], body[r.src[0]], body[r.src[1]] if len(r.src) > 1 else None)
            return (If(binary("lt", f, n if isinstance(n, KExpr) else ic(n)),
                       tuple(out) + tuple(self.store(st, env, None) for st in stash)),)
        rb, rv, rr = var("rb"), var("rv"), var("rr")
        body: list = []
        if blocked:
            flush = tuple(st for r in totals for st in self._kahan(totals[r], accs[r]["cur"], accs[r], 1))
            body.append(Range("rb", nb, "serial", (Range("rv", LANE_BLOCK, "serial",
                                                         steps_at(iadd(imul(rb, LANE_BLOCK), rv))),) + flush))
        if not isinstance(rem, int) or rem:
            body.append(Range("rr", rem, "serial", steps_at(iadd(done, rr))))
        tree, results, halve = [], {}, {}
        for r in reds:
            d, name = np.dtype(r.src[0].dtype), accs[r]["name"] + "s"
            v = accs[r]["cur"]
            if r in totals:
                v = binary("add", totals[r][0]["cur"], binary("sub", v, totals[r][1]["cur"]))
            tree += [Alloc(name, d, G, "shared"), Store(name, lane, v)]
            results[r] = tload(name, ic(0), d)
            if r.arg in ("argmax", "argmin"):
                tree += [Alloc(name + "i", np.dtype(INDEX), G, "shared"), Store(name + "i", lane, accs[r]["idx"])]
                results[r] = tload(name + "i", ic(0), INDEX)
            halve[r] = (d, name)
        tree.append(Barrier())
        step = G // 2
        while step:
            tree.append(If(binary("lt", lane, ic(step)), tuple(
                st for r in reds for st in _halve(r.arg, *halve[r], lane, iadd(lane, ic(step))))))
            tree.append(Barrier())
            step //= 2
        return decls + body + tree, results

    def point(self, I: list, vector) -> tuple:
        """The statements of one unit at parallel indices I."""
        k = self.k
        env = {KExpr("idx", INDEX, (), a): i for a, i in enumerate(I)}
        out: list = []
        rows = set(map(id, k.row_stores))
        roots = [e for st in k.stores for e in (st.offset, st.value)]
        stashes = row_stashes(k) if vector is None else {}
        row = [st for st in k.stores if id(st) in rows]
        for i, level in enumerate(reduce_levels(roots)):
            stash = [KStore(st.buffer, st.offset, stashes[id(st)][1]) for st in row
                     if stashes.get(id(st), (None,))[0] == i]
            stmts, results = self.reduction(level, env, vector, stash)
            out += stmts
            env.update(results)
        R = k.reduce_shape
        plain = [st for st in k.stores if id(st) not in rows]
        # a stashed value is read back from where the reduction pass stored it
        row = [st if id(st) not in stashes else KStore(st.buffer, st.offset, substitute(
            [st.value], {stashes[id(st)][1]: KExpr("load", stashes[id(st)][1].dtype, (st.offset,), st.buffer)}
        )[st.value], st.mode) for st in row]
        G = self.s.reduce_group
        if G > 1:  # lane 0 stores the point; the lanes store the row strided, as they reduced it
            if plain:
                out.append(If(binary("eq", var("l"), ic(0)), tuple(self.store(st, env, None) for st in plain)))
            if row:
                n, qt = math.prod(R), var("qt")
                f = iadd(imul(qt, G), var("l"))
                renv = {**env, **{KExpr("ridx", INDEX, (), a): i for a, i in enumerate(divmod_index(f, R))}}
                out.append(Range("qt", -(-n // G), "serial", (If(binary("lt", f, ic(n)), tuple(
                    self.store(st, renv, None) for st in row)),)))
            return tuple(out)
        for st in plain:
            out.append(self.store(st, env, vector))
        if row:
            renv = dict(env)
            rvars = [var(f"q{a}") for a in range(len(R))]
            renv.update({KExpr("ridx", INDEX, (), a): v for a, v in enumerate(rvars)})
            last, W = len(R) - 1, self.s.reduce_lanes
            if vector is None and W > 1 and R[last] >= W:  # the row walked W elements at a time
                axis, qv, qt = KExpr("ridx", INDEX, (), last), var("qv"), var("qt")
                nv, tail = R[last] // W, R[last] % W
                body = (Range("qv", nv, "serial", tuple(self.store(st, renv, (axis, imul(qv, W), W)) for st in row)),)
                if tail:
                    tenv = {**renv, axis: iadd(ic(nv * W), qt)}
                    body += (Range("qt", tail, "serial", tuple(self.store(st, tenv, None) for st in row)),)
                outer = last
            else:
                body = tuple(self.store(st, renv, vector) for st in row)
                outer = len(R)
            for a in reversed(range(outer)):
                body = (Range(f"q{a}", R[a], "serial", body),)
            out += list(body)
        return tuple(out)

    def store(self, st, env, vector) -> Store:
        d = np.dtype(self.k.buffers[st.buffer].dtype)
        if st.mode == "add" and (self.s.owner or self.s.serial):  # no other work-item adds here
            cur = KExpr("load", d, (st.offset,), st.buffer)
            return self.store(KStore(st.buffer, st.offset, binary(
                "or" if d == np.bool_ else "add", cast(cur, st.value.dtype), st.value)), env, vector)
        val = cast(substitute([st.value], env, vector)[st.value], d)
        if vector is None:
            return Store(st.buffer, substitute([st.offset], env)[st.offset], val, mode=st.mode)
        axis, base, lanes = vector
        if stride(st.offset, axis) == 1:  # consecutive lanes: one vector store
            off = substitute([st.offset], {**env, axis: base})[st.offset]
            return Store(st.buffer, off, broadcast(val, lanes) if lanes_of(val) == 1 else val, mode=st.mode)
        off = substitute([st.offset], env, vector)[st.offset]  # a scatter, lane by lane
        return Store(st.buffer, off, val, mode=st.mode)


def _units(k: Kernel, s: Schedule, sized: bool = False) -> tuple[int, int]:
    """(units of work, work-items a work-group) of a laid-out kernel under a plain or owner
    schedule: a unit is a point, or a vector of `lanes` along the last (owner) axis. Work-groups
    shrink to the units, unless `sized` (the first extent comes at run time: the code, which holds
    the group's size, serves every extent; a small one leaves work-items idle)."""
    shape = tuple(k.shape)
    if s.owner:
        units = -(-shape[k.owner_axis] // s.lanes)
    elif s.lanes > 1 and s.group == 1 and len(shape) > 1:  # a row (see schedule)
        units = math.prod(shape[:-1])
    elif s.lanes > 1:
        units = math.prod(shape[:-1]) * -(-shape[-1] // s.lanes)
    else:
        units = max(1, math.prod(shape))
    return units, max(1, s.group if sized else min(s.group, units))


def _units_at(k: Kernel, s: Schedule, n0: KExpr) -> KExpr:
    """_units' count as an index expression of the first axis's extent n0 (tile.batch where the
    Target takes it at run time: a work-group's guard then holds no batch size)."""
    shape, W = tuple(k.shape), s.lanes
    if n0.op == "const" or not shape:
        return ic(_units(k, s)[0])
    ceil_n0 = binary("div", iadd(n0, ic(W - 1)), ic(W)) if W > 1 else n0
    if s.owner:
        return ceil_n0 if k.owner_axis == 0 else ic(_units(k, s)[0])
    if W > 1:  # (a task a row, lanes with groups of one, has no guard)
        return ceil_n0 if len(shape) == 1 else imul(n0, math.prod(shape[1:-1]) * -(-shape[-1] // W))
    return imul(n0, math.prod(shape[1:]))


def grid_points(k: Kernel, target: Target, s: Schedule) -> int:
    """The extent of schedule(k, target, s)'s grid, without building it (the tasks a CPU splits)."""
    k = laid_out(k, target)
    if not k.size or s.serial:
        return 1 if k.size else 0
    if s.reduce_group > 1:
        return max(1, math.prod(k.shape))
    units, G = _units(k, s, target.runtime_batch)
    return -(-units // G)


# code_text's answers by everything a kernel's text is made of but its name and its buffers'
# names: the kernels of a model's repeated layers are one structure (an 8-layer char-GPT step:
# 416 kernels, 72 structures; 160-190 ms of texts each compile). Bounded: cleared when full.
_code_texts: dict = {}
CODE_TEXTS_MOST = 1024


def code_text(k: Kernel, target: Target, s: Schedule) -> str:
    """What schedule(k, target, s)'s code depends on, as text: the laid-out kernel without its name,
    its buffers' sizes and (Target.runtime_batch) its first extent, the schedule and the target.
    Equal text, equal tile kernel but for the grid's extent: a cache key that needs no tile kernel
    (tests/backends/test_shape_generic.py holds the scheduler to it)."""
    tw = first_extent_twin(k, target)
    if tw is not None and _unsized(tw, target, s) and _unsized(k, target, s):
        return code_text(tw, target, s)  # (the same text: the same laid-out kernel but its "?")
    key = (tuple((b.dtype, b.size) for b in k.buffers), k.n_inputs, tuple(k.shape), tuple(k.reduce_shape),
           k.stores, target, s)  # (expressions are interned: the stores hash and compare at their roots)
    text = _code_texts.get(key)
    if text is None:
        if len(_code_texts) >= CODE_TEXTS_MOST:
            _code_texts.clear()
        text = _code_texts[key] = _code_text(k, target, s)
    return text


def _code_text(k: Kernel, target: Target, s: Schedule) -> str:
    if generic_reduction(k, target, s):  # (a handful of kernels: the tile kernel's own text)
        return "generic reduction\n" + key_text(schedule(k, target, s))
    k = sized_constants(laid_out(k, target), target, s)
    generic = target.runtime_batch
    shape = ("?",) + tuple(k.shape[1:]) if generic and k.shape else tuple(k.shape)
    lines = [" ".join(np.dtype(b.dtype).name for b in k.buffers) + f" inputs {k.n_inputs} shape {shape} "
             f"reduce {tuple(k.reduce_shape)} {s} {target}"]
    names: dict = {}
    for st in k.stores:
        for root in (st.offset, st.value):
            for n in root.toposort(names):
                names[n] = len(names)
                lines.append(f"{n.op} {np.dtype(n.dtype).name} {n.arg!r} " + " ".join(str(names[x]) for x in n.src))
        lines.append(f"store {st.mode} {st.buffer} {names[st.offset]} {names[st.value]}")
    return "\n".join(lines)


GENERIC_REDUCE_MIN = 16  # steps from which a lone reduction axis's extent is read at run time


def generic_reduction(k: Kernel, target: Target, s: Schedule) -> bool:
    """Whether the kernel's reductions read their first axis's extent at run time (tile.size(1)),
    so a new batch size reuses the code of a sum over the batch's rows (a bias's or a layer norm's
    gradient): on targets that take sizes at run time, a first reduction axis (after merging) of
    at least GENERIC_REDUCE_MIN steps, reduced one step at a time by one task per point (or by a
    work-group per point, a GPU's cooperative reduction; or in vectors where it is the kernel's
    one axis and its one point: a loss's mean), with no row stores. Its code text is then the tile
    kernel's own (code_text)."""
    if s.serial or s.owner:
        return False
    if s.reduce_lanes > 1:  # in vectors: a whole kernel's one sum, max or min (a loss's mean); rows
        #                     over a model's width keep their constant extent (their loops unroll)
        lk = laid_out(k, target)
        if lk.shape or len(lk.reduce_shape) != 1 or not all(
                r.arg in ("sum", "max", "min") for lv in reduce_levels(_roots(lk)) for r in lv):
            return False
    return _batch_reduction(k, target)


def _batch_reduction(k: Kernel, target: Target) -> bool:
    """generic_reduction's conditions on the kernel and target (the schedule's aside): the
    scheduler lays such a reduction out for any extent (_reduce_group)."""
    if not (target.runtime_batch and k.reduce_shape) or k.row_stores:
        return False
    R = laid_out(k, target).reduce_shape
    return bool(R) and R[0] >= GENERIC_REDUCE_MIN


def run_sizes(k: Kernel, target: Target, s: Schedule) -> tuple:
    """The run-time sizes (tile.size) of schedule(k, target, s): the first axis's extent, and a
    generic reduction's extent."""
    lk = laid_out(k, target)
    first = lk.shape[0] if lk.shape else 1
    return (first, lk.reduce_shape[0]) if generic_reduction(k, target, s) else (first,)


def schedule(k: Kernel, target: Target, sched: Schedule | None = None) -> TileKernel:
    """The tile kernel of an index-space kernel on `target` (default_schedule unless given)."""
    s = sched or default_schedule(k, target)
    sizes = run_sizes(k, target, s)
    k = sized_constants(laid_out(k, target), target, s)
    meta = {"kernel": k, "schedule": s, "sizes": sizes}
    if not k.size:  # nothing to compute: a kernel of no work-groups
        return TileKernel(k.name, k.buffers, k.n_inputs, (Range("g", 0, "grid", ()),), meta=meta)
    b = _Builder(k, s, size(1) if len(sizes) > 1 else None)
    shape = tuple(k.shape)
    # the first axis's extent: read at run time where the printer takes it (tile.batch)
    n0 = batch() if target.runtime_batch and shape else ic(shape[0] if shape else 1)
    if s.serial:
        u = var("u")
        I = divmod_index(u, shape)
        body = (Range("g", 1, "grid", (Range("u", imul(n0, math.prod(shape[1:])), "serial", b.point(I, None)),)),)
        return TileKernel(k.name, k.buffers, k.n_inputs, body, meta=meta)
    if s.owner:
        return _owner(k, s, b, n0, meta)
    if s.reduce_group > 1:
        points = max(1, math.prod(shape))
        body = (Range("g", points, "grid", (Range("l", s.reduce_group, "lane", b.point(divmod_index(var("g"), shape), None)),)),)
        return TileKernel(k.name, k.buffers, k.n_inputs, body, meta=meta)
    W = s.lanes
    units, G = _units(k, s, target.runtime_batch)
    g, lane = var("g"), var("l")
    if W > 1 and G == 1 and len(shape) > 1:  # a task a row: its whole vectors, then its ragged end
        outer, axis, v, t = divmod_index(g, shape[:-1]), KExpr("idx", INDEX, (), len(shape) - 1), var("v"), var("t")
        full, ragged = divmod(shape[-1], W)
        body = (Range("v", full, "serial", b.point(outer + [imul(v, W)], (axis, imul(v, W), W))),)
        if ragged:
            body += (Range("t", ragged, "serial", b.point(outer + [iadd(ic(full * W), t)], None)),)
        return TileKernel(k.name, k.buffers, k.n_inputs, (Range("g", units, "grid", body),), meta=meta)
    if W > 1:
        last = shape[-1]
        per_row = -(-last // W)
    u = iadd(imul(g, G), lane) if G > 1 else g
    if W > 1:
        if len(shape) == 1:  # one axis: its extent comes at run time
            outer, base, last_n = [], imul(u, W), n0
        else:
            outer = divmod_index(binary("div", u, ic(per_row)), shape[:-1])
            base, last_n = imul(binary("rem", u, ic(per_row)), W), ic(last)
        axis = KExpr("idx", INDEX, (), len(shape) - 1)
        whole = binary("le", iadd(base, ic(W)), last_n)
        vec_body = b.point(outer + [base], (axis, base, W))
        l_ = var("t")
        # the ragged end point by point: a loop (unrolled, wide vectors would copy the body W times)
        tail = (Range("t", W, "unroll" if W <= 16 else "serial", (If(binary("lt", iadd(base, l_), last_n),
                                                                       b.point(outer + [iadd(base, l_)], None)),)),)
        inner = (If(whole, vec_body), If(unary("not", whole), tail))
    else:
        inner = b.point(divmod_index(u, shape), None)
    if G > 1:
        inner = (If(binary("lt", u, _units_at(k, s, n0)), inner),)
        body = (Range("g", -(-units // G), "grid", (Range("l", G, "lane", inner),)),)
    else:
        body = (Range("g", units, "grid", inner),)
    return TileKernel(k.name, k.buffers, k.n_inputs, body, meta=meta)


def _owner(k: Kernel, s: Schedule, b: _Builder, n0: KExpr, meta: dict) -> TileKernel:
    """A work-item per index (or vector of `lanes` indices) of the owner axis; the rest of the
    space in order inside it."""
    shape, a = tuple(k.shape), k.owner_axis
    n = shape[a]
    others = [i for i in range(len(shape)) if i != a]
    W = s.lanes
    units, G = _units(k, s, n0.op != "const")
    g, lane, u = var("g"), var("l"), var("u")
    unit = iadd(imul(g, G), lane) if G > 1 else g
    rest = divmod_index(u, [shape[i] for i in others])

    def index(at_a):
        I = [None] * len(shape)
        for i, r in zip(others, rest):
            I[i] = r
        I[a] = at_a
        return I
    count = max(1, math.prod(shape[i] for i in others))
    if others and others[0] == 0:  # the first axis's extent at run time (n0)
        count = imul(n0, math.prod(shape[i] for i in others[1:]))
    n_at = n0 if a == 0 else ic(n)
    if W > 1:
        base = imul(unit, W)
        axis = KExpr("idx", INDEX, (), a)
        whole = binary("le", iadd(base, ic(W)), n_at)
        t = var("t")
        tail = (Range("t", W, "unroll" if W <= 16 else "serial", (If(binary("lt", iadd(base, t), n_at),
                                                                       b.point(index(iadd(base, t)), None)),)),)
        inner = (Range("u", count, "serial", (If(whole, b.point(index(base), (axis, base, W))),
                                               If(unary("not", whole), tail))),)
    else:
        inner = (Range("u", count, "serial", b.point(index(unit), None)),)
    if G > 1:
        inner = (If(binary("lt", unit, _units_at(k, s, n0)), inner),)
        body = (Range("g", -(-units // G), "grid", (Range("l", G, "lane", inner),)),)
    else:
        body = (Range("g", units, "grid", inner),)
    return TileKernel(k.name, k.buffers, k.n_inputs, body, meta=meta)


__all__ = ["Schedule", "at_first_extent", "code_text", "default_schedule", "divmod_index", "first_extent_twin",
           "generic_reduction", "grid_points", "laid_out", "merge_axes", "run_sizes", "schedule", "stride", "substitute"]
