"""FlashAttention written once, as tile kernels, on the strided view of a fused attention equation.

`fused_attention` (and its backward) computes softmax(scale · q kᵀ + bias) v per batch index,
over operands in any layout its `dims` name: each operand has batch axes, a sequence axis and a
feature axis, at element strides the Spec records, so no operand is transposed or copied
beforehand. The builders (build_forward, build_backward) take one schedule (AttentionSchedule)
in two forms, chosen from the Target: the GPU form (a work-item per row, tiles staged through
shared memory) and the CPU form (a task per block of rows, tiles in scratch memory,
register-blocked products with vectors along the keys and features); `space` is the tuner's."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from tilefuse.ir import dtypes, primitives as P

from .gemm import _add, _and, _ceil, _fp, _i, _lt, _min, _mul, _x
from .ir import KExpr, binary, cast, const, select, unary
from .lower import strides
from .tile import (Alloc, Barrier, If, Range, Store, TileKernel, at_grid_extent, broadcast, hmax, hsum, iota, size,
                   tload, var, vload)


@dataclass(frozen=True)
class Spec:
    """Everything an attention kernel is specialised on."""
    bwd: bool
    batch: tuple     # the batch axes' sizes (row-major batch index t)
    sq: int
    sk: int
    d: int
    dv: int
    scale: float
    causal: bool
    has_bias: bool
    batch_strides: tuple  # per operand q, k, v, out, bias: element strides of the batch axes
    rows: tuple      # element strides between sequence positions of q, k, v, out
    bias_strides: tuple  # bias strides along Sq and Sk (0: broadcast)
    sizes: tuple     # elements of q and k: where dk and dv start in the backward's packed result
    stats: bool = False  # the forward writes its rows' (m, 1/l) (fused_attention_stats), the backward reads them

    @property
    def nb(self) -> int:
        return int(np.prod(self.batch, dtype=np.int64))

    @property
    def offset(self) -> int:  # Sk - Sq: query i sees keys j <= i + offset when causal
        return self.sk - self.sq


def spec_of(eqn) -> Spec:
    q, k, v = (a.aval for a in eqn.inputs[:3])
    dims = eqn.params["dims"]
    bwd = eqn.prim is P.fused_attention_bwd
    stats = eqn.prim is P.fused_attention_stats or (bwd and eqn.params.get("stats", False))
    has_bias = len(eqn.inputs) == (6 + stats if bwd else 4)
    out_shape = list(q.shape)
    out_shape[dims[0][-1]] = v.shape[dims[2][-1]]
    shapes = (q.shape, k.shape, v.shape, tuple(out_shape))
    layouts = (dims[0], dims[1], dims[2], dims[0])
    batch_strides = [tuple(strides(s)[a] for a in dd[:-2]) for s, dd in zip(shapes, layouts)]
    rows = tuple(strides(s)[dd[-2]] for s, dd in zip(shapes, layouts))
    bias_strides = (0, 0)
    if has_bias:
        b = eqn.inputs[3].aval
        st = [s if n != 1 else 0 for s, n in zip(strides(b.shape), b.shape)]  # 0: broadcast
        batch_strides.append(tuple(st[:-2]))
        bias_strides = (st[-2], st[-1])
    else:
        batch_strides.append((0,) * (len(dims[0]) - 2))
    return Spec(bwd, tuple(q.shape[a] for a in dims[0][:-2]), q.shape[dims[0][-2]],
                k.shape[dims[1][-2]], q.shape[dims[0][-1]], v.shape[dims[2][-1]],
                float(eqn.params["scale"]), bool(eqn.params["causal"]), has_bias,
                tuple(batch_strides), rows, bias_strides, (q.size, k.size), stats)


# ---- FlashAttention written once, as tile kernels -----------------------------------------------

@dataclass(frozen=True)
class AttentionSchedule:
    """Two forms of one algorithm, picked by the target (default_attention_schedule).
    GPU (vec 0): a work-group of `bq` work-items, one query row each, stages `bk` keys and values
    at a time through shared memory; the backward's dk/dv kernel turns it around (`bk`
    work-items, one key row each, staging `bq` queries at a time).
    CPU (vec > 0): a task (a work-group of one work-item) owns `bq` query rows; per block of `bk`
    keys it stages kᵀ and v in scratch memory, computes the scores in register blocks of `rows`
    rows x `chunk` vectors of `vec` lanes along the keys, the online softmax on them, then
    O += P v in register blocks of `rows` rows x `chunk` vectors along the features. The
    backward's dk/dv kernel turns it around (a task per block of `bk` keys, register blocks of
    keys x vectors along the queries)."""
    bq: int
    bk: int
    vec: int = 0
    rows: int = 1
    chunk: int = 1
    per_head: bool = False  # CPU: a task per batch index (backward: one kernel; forward: k and v staged once)

    @property
    def cpu(self) -> bool:
        return self.vec > 0

    def check(self, sp: Spec, target) -> str | None:
        if sp.bwd and sp.d < 3:
            return "the backward keeps 3 numbers per query row where dq goes: needs d >= 3"
        if self.cpu:
            return self._check_cpu(sp)
        if self.per_head:
            return f"{self}: the backward per batch index is a CPU form's"
        lanes = max(self.bq, self.bk) if sp.bwd else self.bq
        if target.shared_bytes == 0 or lanes > target.max_group:
            return f"{self}: needs shared memory and {lanes} work-items per work-group"
        words = max(self.bk * (sp.d + sp.dv), self.bq * (sp.d + sp.dv + 3) if sp.bwd else 0)
        if 4 * words > target.shared_bytes:
            return f"{self}: {4 * words} bytes of staged rows exceed shared memory"
        return None

    def _check_cpu(self, sp: Spec) -> str | None:
        if self.vec not in (1, 2, 4, 8, 16) or min(self.rows, self.chunk) < 1:
            return f"{self}: vec a power of two to 16, rows and chunk positive"
        if self.bq % self.vec or self.bk % self.vec or self.bq % self.rows or self.bk % self.rows:
            return f"{self}: bq and bk multiples of vec and of rows"
        words = sum(_cpu_scratch(sp, self).values())
        if 4 * words > SCRATCH_BYTES:
            return f"{self}: {4 * words} bytes of scratch exceed {SCRATCH_BYTES}"
        return None


SCRATCH_BYTES = 1 << 20  # a CPU task's tiles (on the stack of the cpu backend's threads)


def _fmax(a: KExpr, b: KExpr) -> KExpr:
    """max(a, b) as a compare and a select (one instruction on x86, where `max` keeps NaN and
    orders -0 < +0 at a few instructions); scores are never NaN but where the inputs are."""
    return select(binary("gt", a, b), a, b)


def _pad(n: int, m: int) -> int:
    return _ceil(n, m) * m


def _cpu_scratch(sp: Spec, s: AttentionSchedule) -> dict:
    """The CPU form's scratch tiles of its largest kernel: name -> elements."""
    dp, dvp, bq, bk = _pad(sp.d, s.vec), _pad(sp.dv, s.vec), s.bq, s.bk
    rows = {"qs": bq * dp, "kt": sp.d * bk, "s": bq * bk, "ml": 3 * bq}
    if not sp.bwd:
        if s.per_head:  # k transposed and v, whole
            return {**rows, "kt": sp.d * _kpitch(sp, s), "vs": _pad(sp.sk, bk) * dvp, "o": bq * dvp}
        return {**rows, "vs": bk * dvp, "o": bq * dvp}
    dq = {**rows, "dos": bq * dvp, "vt": sp.dv * bk, "kr": bk * dp, "dp": bq * bk, "dq": bq * dp}
    dkdv = {"kr": bk * dp, "vr": bk * dvp, "qt": sp.d * bq, "dot": sp.dv * bq, "qs": bq * dp, "dos": bq * dvp,
            "ml": 3 * bq, "pt": bk * bq, "dst": bk * bq, "dk": bk * dp, "dv": bk * dvp}
    if s.per_head:
        heads = {**dkdv, "st": 3 * _pad(sp.sq, bq), "kt": sp.d * bk, "s": bq * bk, "dqs": bq * dp}
        hoisted = {**heads, "qt": sp.d * _qpitch(sp, s), "dot": sp.dv * _qpitch(sp, s)}
        with_k = {**hoisted, "kt": sp.d * _kpitch(sp, s)}  # and k transposed whole, for the statistics
        return next(t for t in (with_k, hoisted, heads) if 4 * sum(t.values()) <= SCRATCH_BYTES or t is heads)
    return max(dq, dkdv, key=lambda t: sum(t.values()))


def _kpitch(sp: Spec, s: AttentionSchedule) -> int:
    """The row pitch of k transposed whole (per batch index, where the scratch holds it): as
    _qpitch's."""
    return _pad(sp.sk, s.bk) + s.vec


def _qpitch(sp: Spec, s: AttentionSchedule) -> int:
    """The row pitch of q and do transposed whole: every query, and a vector more so that the
    columns of a row, stored one after the other, are not 4 KiB apart (one cache set)."""
    return _pad(sp.sq, s.bq) + s.vec


def _hoisted(sp: Spec, s: AttentionSchedule) -> bool:
    """Whether the backward per batch index transposes q and do once, whole, rather than a query
    block for every key block (where the scratch holds them)."""
    return s.per_head and _cpu_scratch(sp, s)["qt"] > sp.d * s.bq


def _k_whole(sp: Spec, s: AttentionSchedule) -> bool:
    """Whether a task per batch index transposes k once, whole (the forward's, and the backward's
    statistics)."""
    return s.per_head and _cpu_scratch(sp, s)["kt"] > sp.d * s.bk


def default_attention_schedule(sp: Spec, target) -> AttentionSchedule | None:
    """GPU targets: query rows per work-group up to 64 (fewer for short sequences); key blocks
    as deep as shared memory holds, up to 64; None where even 8 keys do not fit. CPU targets
    (or none with shared memory): vectors of the target's lanes, blocks of 128 (forward) or 64
    (backward) queries by 64 keys (fewer for short sequences), register blocks of 4 rows x as many
    vectors as the registers hold; the backward per batch index where they fill the cores twice."""
    if _cpu_form(target):
        vec = _lanes(target)
        bq = max(vec, 4, min(64 if sp.bwd else 128, 1 << max(0, (sp.sq - 1).bit_length())))
        chunk = 1 << (max(1, (target.vector_registers - 1) // 5).bit_length() - 1)  # 4 x chunk accumulators
        for s in (AttentionSchedule(bq, max(vec, 64), vec, 4, chunk, sp.nb >= 2 * target.cores),
                  AttentionSchedule(bq, max(vec, 64), vec, 4, chunk), AttentionSchedule(vec, vec, vec, 4, chunk)):
            if s.check(sp, target) is None:
                return s
        return None
    bq = min(64, max(1, target.max_group), 1 << max(0, (sp.sq - 1).bit_length()))
    for bk in (64, 32, 16, 8):
        s = AttentionSchedule(bq, bk)
        if s.check(sp, target) is None:
            return s
    return None


def _cpu_form(target) -> bool:
    return target.kind == "cpu" or target.shared_bytes == 0


def _lanes(target) -> int:
    return target.lanes if target.lanes in (1, 2, 4, 8, 16) else 4


def space(sp: Spec, target) -> dict:
    """The tuner's search space (schedule fields -> candidate values): the target's form's fields."""
    if _cpu_form(target):
        return {"bq": (4, 8, 16, 32, 64, 128), "bk": (4, 8, 16, 32, 64, 128),
                "vec": tuple(sorted({4, 8, 16, _lanes(target)})), "rows": (1, 2, 4, 8), "chunk": (1, 2, 4),
                "per_head": (False, True)}
    return {"bq": (8, 16, 32, 64, 128), "bk": (8, 16, 32, 64)}


def params_of(sched: AttentionSchedule) -> dict:
    """A schedule as the tuner stores it: its form's fields."""
    if not sched.cpu:
        return {"bq": sched.bq, "bk": sched.bk}
    return {f: getattr(sched, f) for f in ("bq", "bk", "vec", "rows", "chunk", "per_head")}


def schedule_of(params: dict, target) -> AttentionSchedule:
    """The schedule stored parameters describe on this target (the form is the target's)."""
    if _cpu_form(target):
        return AttentionSchedule(**params)
    return AttentionSchedule(params["bq"], params["bk"])


class _Tiles:
    """What the forward and backward kernels share: addressing through the Spec's strides,
    staging rows through shared memory, the scores and their masks. Buffers: q, k, v, [bias],
    then out (forward) or o, do, packed (dq, dk, dv) (backward)."""

    def __init__(self, sp: Spec, sched: AttentionSchedule, buffers: tuple, n_inputs: int):
        self.sp, self.bq, self.bk, self.buffers, self.n_inputs = sp, sched.bq, sched.bk, buffers, n_inputs
        self.f = dtypes.compute_dtype(buffers[0].dtype)  # float32 for 16-bit inputs
        self.feat = "unroll" if max(sp.d, sp.dv) <= 128 else "serial"  # (unrolled: rows in registers)
        self.zs = [var(f"z{i}") for i in range(len(sp.batch))]
        self.zero, self.one, self.ninf = const(0, self.f), const(1, self.f), const(-np.inf, self.f)
        # the backward's inputs end with o, do (and the forward's statistics, where it reads them)
        self.o_buf, self.do_buf = n_inputs - 2 - sp.stats, n_inputs - 1 - sp.stats
        self.st_buf = (n_inputs - 1 if sp.bwd else n_inputs + 1) if sp.stats else None

    def at(self, op: int, row, col, row_stride: int) -> KExpr:
        """Operand op's (q, k, v, out, bias) element (row, col) at this batch index."""
        z = (_mul(z, s) for z, s in zip(self.zs, self.sp.batch_strides[op]))
        return _add(*z, _mul(row, row_stride), col)

    def ld(self, buf: int, off) -> KExpr:
        return _fp(tload(buf, off, self.buffers[buf].dtype))

    def reg(self, name: str, i) -> KExpr:
        return tload(name, _x(i), self.f)

    def grid(self, blocks: int, lanes: str, n_lanes: int, inner: tuple) -> tuple:
        body = (Range("blk", blocks, "grid", (Range(lanes, n_lanes, "lane", inner),)),)
        for z, n in reversed(list(zip(self.zs, self.sp.batch))):
            body = (Range(z.arg, n, "grid", body),)
        return body

    def stage(self, name: str, buf: int, width: int, first, count: int, limit: int, row_stride: int,
              me, lanes: int, op: int | None = None) -> Range:
        """The work-group copies rows first .. first+count of buf (width elements each) into the
        shared `name`, work-item `me` taking elements t*lanes + me; zeros past `limit` rows."""
        t = var("t")
        e = _add(_mul(t, lanes), me)
        rr = _add(first, binary("div", e, _i(width)))
        val = self.ld(buf, self.at(buf if op is None else op, _min(rr, limit - 1), binary("rem", e, _i(width)),
                                   row_stride))
        return Range("t", _ceil(count * width, lanes), "serial", (
            If(_lt(e, count * width), (Store(name, e, select(_lt(rr, limit), val, self.zero)),)),))

    def visible(self, row, key, causal: bool = True) -> KExpr | None:
        """Whether the row sees the key (None: always); the blocks' padding is tested only where
        the blocks do not tile the sequences, the diagonal only where `causal`."""
        sp = self.sp
        tests = ([_lt(key, sp.sk)] if sp.sk % self.bk else []) + ([_lt(row, sp.sq)] if sp.sq % self.bq else [])
        if sp.causal and causal:  # query i sees keys j <= i + (Sk - Sq)
            tests.append(binary("le", key, _add(row, sp.offset)))
        return functools.reduce(_and, tests) if tests else None

    def scaled(self, dot: KExpr, row, key) -> KExpr:
        """scale * q·k + bias."""
        sp = self.sp
        s = binary("mul", dot, const(sp.scale, self.f))
        if sp.has_bias:
            bs = sp.bias_strides
            off = _add(*(_mul(z, st) for z, st in zip(self.zs, sp.batch_strides[4])),
                       _mul(_min(row, sp.sq - 1), bs[0]), _mul(_min(key, sp.sk - 1), bs[1]))
            s = binary("add", s, self.ld(3, off))
        return s

    def score(self, dot: KExpr, row, key, causal: bool = True) -> KExpr:
        """scale * q·k + bias, -inf where the key is not visible to the row."""
        s = self.scaled(dot, row, key)
        ok = self.visible(row, key, causal)
        return s if ok is None else select(ok, s, self.ninf)

    def dot(self, into: str, at, a: str, a_at, b: str, b_at, n: int) -> tuple:
        """into[at] = sum_c a[a_at(c)] * b[b_at(c)]."""
        c = var("c")
        return (Store(into, _x(at), self.zero),
                Range("c", n, self.feat, (Store(into, _x(at), binary("add", self.reg(into, at), binary(
                    "mul", self.reg(a, a_at(c)), self.reg(b, b_at(c))))),)))

    def key_blocks(self, row, me, per_key, rescale=lambda corr: ()) -> tuple:
        """Over blocks of bk keys staged in shared ks/vs: the block's scores into s[j], their max,
        the running max m (ml[0]) and sum l (ml[1]) rescaled, then per_key(j, p) for its keys,
        p = exp(s - m_new) (0 where masked); `rescale(corr)`: statements rescaling with it."""
        sp, bk = self.sp, self.bk
        kb, j = var("kb"), var("j")
        key = _add(_mul(kb, bk), j)
        m, l_, mb, sj = self.reg("ml", 0), self.reg("ml", 1), self.reg("ml", 2), self.reg("s", j)
        mn = binary("max", m, mb)
        corr = select(binary("eq", m, mn), self.one, unary("exp", binary("sub", m, mn)))
        p = select(binary("eq", sj, self.ninf), self.zero, unary("exp", binary("sub", sj, mn)))
        return (Range("kb", _ceil(sp.sk, bk), "serial", (
            self.stage("ks", 1, sp.d, _mul(kb, bk), bk, sp.sk, sp.rows[1], me, self.bq),
            self.stage("vs", 2, sp.dv, _mul(kb, bk), bk, sp.sk, sp.rows[2], me, self.bq), Barrier(),
            Store("ml", _i(2), self.ninf),
            Range("j", bk, "serial", (
                *self.dot("s", j, "qv", lambda c_: c_, "ks", lambda c_: _add(_mul(j, sp.d), c_), sp.d),
                Store("s", j, self.score(sj, row, key)),
                Store("ml", _i(2), binary("max", mb, sj)),)),
            Store("ml", _i(1), binary("mul", l_, corr)), *rescale(corr),
            Store("ml", _i(0), mn),
            Range("j", bk, "serial", (Store("ml", _i(1), binary("add", l_, p)), *per_key(j, p))),
            Barrier())),)

    def row_allocs(self) -> tuple:
        sp = self.sp
        return (Alloc("ks", self.f, self.bk * sp.d, "shared"), Alloc("vs", self.f, self.bk * sp.dv, "shared"),
                Alloc("qv", self.f, sp.d, "register"), Alloc("ml", self.f, 3, "register"),
                Alloc("s", self.f, self.bk, "register"))

    def load_row(self, name: str, buf: int, op: int, row, n: int, row_stride: int) -> Range:
        c = var("c")
        rowc = _min(row, self.sp.sq - 1)
        return Range("c", n, self.feat, (Store(name, c, self.ld(buf, self.at(op, rowc, c, row_stride))),))

    def row_stat(self, row, which) -> KExpr:
        """Where fused_attention_stats keeps row's statistic `which` (0: m, 1: 1/l) at this batch
        index: (batch..., Sq, 2), the batch axes row-major."""
        sp = self.sp
        t = _add(0, *(_mul(z, int(np.prod(sp.batch[i + 1:], dtype=np.int64))) for i, z in enumerate(self.zs)))
        return _add(_mul(_add(_mul(t, sp.sq), row), 2), which)

    def read_stat(self, row, which) -> KExpr:
        """The forward's statistic of row (0 past the sequence)."""
        return select(_lt(row, self.sp.sq), self.ld(self.st_buf, self.row_stat(_min(row, self.sp.sq - 1), which)),
                      self.zero)

    def write_stats(self, row, m: KExpr, l_: KExpr) -> tuple:
        """The forward's statistics of row from its running max and sum (fused_attention_stats)."""
        dt = self.buffers[self.st_buf].dtype
        return (Store(self.st_buf, self.row_stat(row, 0), cast(select(binary("eq", m, self.ninf), self.zero, m), dt)),
                Store(self.st_buf, self.row_stat(row, 1), cast(select(binary("gt", l_, self.zero),
                                                                      binary("div", self.one, l_), self.zero), dt)))

    def stats_at(self, row, which) -> KExpr:
        """Where the backward keeps row's (m, 1/l, D) until dq is written: the row's own first 3
        elements of dq in the packed result (only the row's dq writer overwrites them)."""
        return self.at(0, row, which, self.sp.rows[0])


def build_forward(sp: Spec, sched: AttentionSchedule, name: str, buffers: tuple, n_inputs: int) -> TileKernel:
    """softmax(scale · q kᵀ + bias) v for every batch index and query row, the scores never
    stored: each work-item keeps its row's running max m and sum l, and for each block of keys
    computes the block's scores, rescales its output row once by exp(m_old - m_new), then adds
    p v over the block (an online softmax). A query with no key to attend to gets zeros (l = 0),
    as the primitive defines."""
    if sched.cpu:
        return _forward_cpu(sp, sched, name, buffers, n_inputs)
    a = _Tiles(sp, sched, buffers, n_inputs)
    r, c = var("r"), var("c")
    row = _add(_mul(var("blk"), a.bq), r)
    out, f = n_inputs, a.f
    l_ = a.reg("ml", 1)

    def per_key(j, p):
        return (Range("c", sp.dv, a.feat, (Store("o", c, binary("add", a.reg("o", c), binary(
            "mul", p, a.reg("vs", _add(_mul(j, sp.dv), c))))),)),)

    def rescale(corr):
        return (Range("c", sp.dv, a.feat, (Store("o", c, binary("mul", a.reg("o", c), corr)),)),)
    inner = (
        *a.row_allocs(), Alloc("o", f, sp.dv, "register"),
        a.load_row("qv", 0, 0, row, sp.d, sp.rows[0]),
        Range("c", sp.dv, a.feat, (Store("o", c, a.zero),)),
        Store("ml", _i(0), a.ninf), Store("ml", _i(1), a.zero),
        *a.key_blocks(row, r, per_key, rescale),
        If(_lt(row, sp.sq), (Range("c", sp.dv, a.feat, (
            Store(out, a.at(3, row, c, sp.rows[3]),
                  cast(binary("div", a.reg("o", c), select(binary("gt", l_, a.zero), l_, a.one)),
                       buffers[out].dtype)),)),
            *(a.write_stats(row, a.reg("ml", 0), l_) if sp.stats else ()))),
    )
    return TileKernel(name, tuple(buffers), n_inputs, a.grid(_ceil(sp.sq, a.bq), "r", a.bq, inner),
                      meta={"attention": (sp, sched)})


def build_backward(sp: Spec, sched: AttentionSchedule, name: str, buffers: tuple, n_inputs: int,
                   runtime_sizes: bool = False) -> list:
    """dq, dk, dv packed into one result (the primitive's layout), as three tile kernels run in
    order, every result element with one writer (no atomics):
      stats: per query row, m and 1/l (the forward's row statistics, recomputed) and
             D = do·o, kept where dq will go;
      dkdv:  a work-item per key row, the queries staged block by block with their stats:
             P = exp(s - m)/l, dv += P do, dS = P (do·v - D), dk += dS q scale;
      dq:    a work-item per query row, its statistics read, dq += dS k scale over the key
             blocks.
    (The CPU form: _backward_cpu; runtime_sizes: the target takes sizes at run time, and the CPU
    form reads where dk and dv start as tile.size 0 and 1, so one code serves every batch size.)"""
    if sched.cpu:
        return _backward_cpu(sp, sched, name, buffers, n_inputs, runtime_sizes)
    a = _Tiles(sp, sched, buffers, n_inputs)
    f, bq, bk = a.f, a.bq, a.bk
    o_buf, do_buf, res = a.o_buf, a.do_buf, n_inputs
    r, c, i = var("r"), var("c"), var("i")
    blk = var("blk")
    row = _add(_mul(blk, bq), r)
    m, l_ = a.reg("ml", 0), a.reg("ml", 1)
    linv = select(binary("gt", l_, a.zero), binary("div", a.one, l_), a.zero)
    q_res, k_res = sp.sizes

    def d_row(into: str):  # D = do·o for the row (do in the register dov)
        return (Store(into, _i(0), a.zero),
                Range("c", sp.dv, a.feat, (Store(into, _i(0), binary("add", a.reg(into, 0), binary(
                    "mul", a.reg("dov", c), a.ld(o_buf, a.at(3, _min(row, sp.sq - 1), c, sp.rows[3]))))),)))
    row_head = (
        *a.row_allocs(), Alloc("dov", f, sp.dv, "register"), Alloc("dd", f, 1, "register"),
        a.load_row("qv", 0, 0, row, sp.d, sp.rows[0]), a.load_row("dov", do_buf, 3, row, sp.dv, sp.rows[3]),
        Store("ml", _i(0), a.ninf), Store("ml", _i(1), a.zero), *d_row("dd"),
    )
    if sp.stats:  # the forward's statistics read, D computed
        stats_body = (Alloc("dov", f, sp.dv, "register"), Alloc("dd", f, 1, "register"),
                      a.load_row("dov", do_buf, 3, row, sp.dv, sp.rows[3]), *d_row("dd"),
                      If(_lt(row, sp.sq), tuple(Store(res, a.stats_at(row, w), v) for w, v in enumerate(
                          (a.read_stat(row, 0), a.read_stat(row, 1), a.reg("dd", 0))))))
    else:
        stats_body = (*row_head, *a.key_blocks(row, r, lambda j, p: ()),
                      If(_lt(row, sp.sq), tuple(Store(res, a.stats_at(row, w), v)
                                                for w, v in enumerate((m, linv, a.reg("dd", 0))))))
    stats = TileKernel(name + "_stats", tuple(buffers), n_inputs, a.grid(_ceil(sp.sq, bq), "r", bq, stats_body))

    # dq: the row's statistics read (its own dq elements: only this work-item writes them, after
    # the barriers), then a sweep over the key blocks
    kb2, j = var("kb"), var("j")
    key = _add(_mul(kb2, bk), j)
    sj = a.reg("s", j)
    p = select(binary("eq", sj, a.ninf), a.zero, binary("mul", unary("exp", binary("sub", sj, m)), l_))
    dp = a.reg("dp", 0)
    sweep = Range("kb", _ceil(sp.sk, bk), "serial", (
        a.stage("ks", 1, sp.d, _mul(kb2, bk), bk, sp.sk, sp.rows[1], r, bq),
        a.stage("vs", 2, sp.dv, _mul(kb2, bk), bk, sp.sk, sp.rows[2], r, bq), Barrier(),
        Range("j", bk, "serial", (
            *a.dot("s", j, "qv", lambda c_: c_, "ks", lambda c_: _add(_mul(j, sp.d), c_), sp.d),
            Store("s", j, a.score(sj, row, key)),
            *a.dot("dp", 0, "dov", lambda c_: c_, "vs", lambda c_: _add(_mul(j, sp.dv), c_), sp.dv),
            Range("c", sp.d, a.feat, (Store("dq", c, binary("add", a.reg("dq", c), binary(
                "mul", binary("mul", p, binary("sub", dp, a.reg("dd", 0))),
                a.reg("ks", _add(_mul(j, sp.d), c))))),)),)),
        Barrier()))
    dq = TileKernel(name + "_dq", tuple(buffers), n_inputs, a.grid(_ceil(sp.sq, bq), "r", bq, (
        *row_head, Alloc("dq", f, sp.d, "register"), Alloc("dp", f, 1, "register"),
        Range("c", sp.d, a.feat, (Store("dq", c, a.zero),)),
        *(Store("ml", _i(w_), tload(res, a.stats_at(_min(row, sp.sq - 1), w_), buffers[res].dtype)) for w_ in (0, 1)),
        sweep,
        If(_lt(row, sp.sq), (Range("c", sp.d, a.feat, (
            Store(res, a.at(0, row, c, sp.rows[0]),
                  cast(binary("mul", a.reg("dq", c), const(sp.scale, f)), buffers[res].dtype)),)),)),)))

    # dkdv: a work-item per key row; the queries staged with their statistics
    qb = var("qb")
    keyr = _add(_mul(blk, bk), r)
    qrow = _add(_mul(qb, bq), i)
    keyc = _min(keyr, sp.sk - 1)
    st = a.reg("qst", _add(_mul(i, 3), 0)), a.reg("qst", _add(_mul(i, 3), 1)), a.reg("qst", _add(_mul(i, 3), 2))
    ss = a.reg("s", 0)
    pk = select(binary("eq", ss, a.ninf), a.zero, binary("mul", unary("exp", binary("sub", ss, st[0])), st[1]))
    e = _add(_mul(var("t"), bk), r)
    stage_stats = Range("t", _ceil(bq * 3, bk), "serial", (If(_lt(e, bq * 3), (
        Store("qst", e, select(_lt(_add(_mul(qb, bq), binary("div", e, _i(3))), sp.sq), tload(
            res, a.stats_at(_min(_add(_mul(qb, bq), binary("div", e, _i(3))), sp.sq - 1),
                            binary("rem", e, _i(3))), buffers[res].dtype), a.zero)),)),))
    dkdv = TileKernel(name + "_dkdv", tuple(buffers), n_inputs, a.grid(_ceil(sp.sk, bk), "r", bk, (
        Alloc("qs", f, bq * sp.d, "shared"), Alloc("dos", f, bq * sp.dv, "shared"), Alloc("qst", f, bq * 3, "shared"),
        Alloc("kv", f, sp.d, "register"), Alloc("vv", f, sp.dv, "register"),
        Alloc("dk", f, sp.d, "register"), Alloc("dv", f, sp.dv, "register"),
        Alloc("s", f, 1, "register"), Alloc("dp", f, 1, "register"),
        Range("c", sp.d, a.feat, (Store("kv", c, a.ld(1, a.at(1, keyc, c, sp.rows[1]))),
                                  Store("dk", c, a.zero))),
        Range("c", sp.dv, a.feat, (Store("vv", c, a.ld(2, a.at(2, keyc, c, sp.rows[2]))),
                                   Store("dv", c, a.zero))),
        Range("qb", _ceil(sp.sq, bq), "serial", (
            a.stage("qs", 0, sp.d, _mul(qb, bq), bq, sp.sq, sp.rows[0], r, bk),
            a.stage("dos", do_buf, sp.dv, _mul(qb, bq), bq, sp.sq, sp.rows[3], r, bk, op=3),
            stage_stats, Barrier(),
            Range("i", bq, "serial", (
                *a.dot("s", 0, "qs", lambda c_: _add(_mul(i, sp.d), c_), "kv", lambda c_: c_, sp.d),
                Store("s", _i(0), a.score(ss, qrow, keyr)),
                *a.dot("dp", 0, "dos", lambda c_: _add(_mul(i, sp.dv), c_), "vv", lambda c_: c_, sp.dv),
                Range("c", sp.dv, a.feat, (Store("dv", c, binary("add", a.reg("dv", c), binary(
                    "mul", pk, a.reg("dos", _add(_mul(i, sp.dv), c))))),)),
                Range("c", sp.d, a.feat, (Store("dk", c, binary("add", a.reg("dk", c), binary(
                    "mul", binary("mul", pk, binary("sub", a.reg("dp", 0), st[2])),
                    a.reg("qs", _add(_mul(i, sp.d), c))))),)),)),
            Barrier())),
        If(_lt(keyr, sp.sk), (
            Range("c", sp.d, a.feat, (Store(res, _add(q_res, a.at(1, keyr, c, sp.rows[1])), cast(
                binary("mul", a.reg("dk", c), const(sp.scale, f)), buffers[res].dtype)),)),
            Range("c", sp.dv, a.feat, (Store(res, _add(q_res + k_res, a.at(2, keyr, c, sp.rows[2])),
                                             cast(a.reg("dv", c), buffers[res].dtype)),)),)),)))
    return [stats, dkdv, dq]


# ---- the CPU form ------------------------------------------------------------------------------

class _Cpu(_Tiles):
    """The CPU form's pieces: a task's tiles in scratch memory (features padded to whole vectors),
    register-blocked products with vectors along a tile's rows, the online softmax of a register
    block's rows."""

    def __init__(self, sp: Spec, sched: AttentionSchedule, buffers: tuple, n_inputs: int):
        super().__init__(sp, sched, buffers, n_inputs)
        self.w, self.R, self.C = sched.vec, sched.rows, sched.chunk
        self.dp, self.dvp = _pad(sp.d, self.w), _pad(sp.dv, self.w)

    def vld(self, name, off) -> KExpr:
        return vload(name, _x(off), self.f, self.w) if self.w > 1 else tload(name, _x(off), self.f)

    def lanes(self, first) -> KExpr:
        """first, first+1, ..., first+w-1: the indices along a vector."""
        return _add(first, iota(self.w)) if self.w > 1 else _x(first)

    def lane_lt(self, n, ge: bool = False) -> KExpr:
        """lane < n (ge: lane >= n) along a vector, n a scalar index: compared in 32 bits (the
        sequences' lengths are far below 2**31), one compare a vector."""
        lane = cast(iota(self.w), np.int32) if self.w > 1 else const(0, np.int32)
        return binary("ge" if ge else "lt", lane, broadcast(cast(n, np.int32), self.w))

    def score_keys(self, dot: KExpr, row, key0, causal: bool = True) -> KExpr:
        """score() of the vector of keys key0 + lane for one row. The keys it sees are those below
        one bound per row (row + offset + 1 where causal, sk where the key blocks overrun it, 0
        for a padding row), so the mask is one compare of the lanes with bound - key0."""
        sp = self.sp
        s = self.scaled(dot, row, self.lanes(key0))
        bound = _add(row, sp.offset + 1) if sp.causal and causal else None
        if sp.sk % self.bk:
            bound = _i(sp.sk) if bound is None else _min(bound, sp.sk)
        if sp.sq % self.bq:
            bound = select(_lt(row, sp.sq), _i(sp.sk) if bound is None else bound, _i(0))
        return s if bound is None else select(self.lane_lt(binary("sub", bound, key0)), s, self.ninf)

    def score_queries(self, dot: KExpr, q0, key) -> KExpr:
        """score() of the vector of queries q0 + lane for one key: the queries that see it are
        those from one bound per key (key - offset where causal; none for a padding key) up to sq,
        at most two compares a vector."""
        sp = self.sp
        s = self.scaled(dot, self.lanes(q0), key)
        lo = _add(key, -sp.offset) if sp.causal else None
        if sp.sk % self.bk:
            lo = select(_lt(key, sp.sk), _i(0) if lo is None else lo, _i(1 << 30))
        tests = ([self.lane_lt(binary("sub", lo, q0), ge=True)] if lo is not None else []) + \
            ([self.lane_lt(binary("sub", _i(sp.sq), q0))] if sp.sq % self.bq else [])
        return s if not tests else select(functools.reduce(_and, tests), s, self.ninf)

    def exp_from(self, x: KExpr, m: KExpr, always: bool = False) -> KExpr:
        """exp(x - m), exactly 0 where x is -inf (masked), without computing exp(-inf): its result
        underflows through denormals, a microcode assist per vector on x86 (4x the causal forward
        at S=64). Scores are -inf only where masked: unguarded where nothing is, unless `always`."""
        sp = self.sp
        if not (always or sp.causal or sp.has_bias or sp.sk % self.bk or sp.sq % self.bq):
            return unary("exp", binary("sub", x, m))
        off = binary("eq", x, self.ninf)
        return select(off, self.zero, unary("exp", select(off, self.zero, binary("sub", x, m))))

    def hop(self, op, x: KExpr) -> KExpr:
        return x if self.w == 1 else op(x)

    def allocs(self, **tiles) -> tuple:
        return (*(Alloc(n, self.f, size, "scratch") for n, size in tiles.items()),
                Alloc("acc", self.f, self.R * self.C * self.w, "register"), Alloc("mt", self.f, 2, "register"),
                Alloc("xs", self.f, self.bk, "register"))

    def mm(self, out: str, out_at, a: str, a_at, b: str, b_at, n: int, nv: int, first=None) -> Range:
        """out[out_at(r, v)] = first(r, v) (zeros if None) + Σ_{x<n} a[a_at(r, x)] · b[b_at(x, v)] for
        the register block's rows r < rows and vectors v < nv of b (a's elements broadcast), `chunk`
        vectors at a time in registers."""
        R, w = self.R, self.w
        C = max(c for c in range(1, min(self.C, nv) + 1) if nv % c == 0)
        r, v, x, vc = var("mr"), var("mv"), var("mx"), var("mc")
        vv = _add(_mul(vc, C), v)
        at = _mul(_add(_mul(r, C), v), w)
        acc = self.vld("acc", at)

        def each(st):
            return Range("mr", R, "unroll", (Range("mv", C, "unroll", (st,)),))
        return Range("mc", nv // C, "serial", (
            each(Store("acc", at, first(r, vv) if first else broadcast(self.zero, w))),
            Range("mx", n, "serial", (each(Store("acc", at, binary("add", acc, binary(
                "mul", broadcast(self.reg(a, a_at(r, x)), w), self.vld(b, b_at(x, vv)))))),)),
            each(Store(out, out_at(r, vv), acc)),))

    def copy_rows(self, name: str, buf: int, op: int, first, count: int, limit: int, width: int,
                  row_stride: int) -> Range:
        """name[i*padded + c] = operand row first+i, column c, for i < count (zeros past `limit`
        rows and `width` columns): whole vectors where the rows are."""
        w, padded = self.w, _pad(width, self.w)
        i, c = var("ci"), var("cc")
        rr = _add(first, i)
        rc = _min(rr, limit - 1)
        if width % w == 0:
            src = vload(buf, self.at(op, rc, _mul(c, w), row_stride), self.buffers[buf].dtype, w) if w > 1 else \
                tload(buf, self.at(op, rc, c, row_stride), self.buffers[buf].dtype)
            body = Store(name, _add(_mul(i, padded), _mul(c, w)), select(_lt(rr, limit), _fp(src), self.zero))
            return Range("ci", count, "serial", (Range("cc", width // w, "serial", (body,)),))
        val = self.ld(buf, self.at(op, rc, _min(c, width - 1), row_stride))
        return Range("ci", count, "serial", (Range("cc", padded, "serial", (
            Store(name, _add(_mul(i, padded), c), select(_and(_lt(rr, limit), _lt(c, width)), val, self.zero)),)),))

    def copy_cols(self, name: str, buf: int, op: int, first, count: int, limit: int, width: int,
                  row_stride: int, pitch: int | None = None) -> Range:
        """name[c*pitch + i] = operand row first+i, column c (transposed; zeros past `limit` rows;
        pitch: count unless given)."""
        i, c = var("ci"), var("cc")
        rr = _add(first, i)
        val = self.ld(buf, self.at(op, _min(rr, limit - 1), c, row_stride))
        return Range("cc", width, "serial", (Range("ci", count, "serial", (
            Store(name, _add(_mul(c, pitch or count), i), select(_lt(rr, limit), val, self.zero)),)),))

    def key_end(self, row0):
        """The key blocks the rows row0 .. row0+bq see: all, or up to the last row's diagonal."""
        sp, bk = self.sp, self.bk
        if not sp.causal:
            return _i(_ceil(sp.sk, bk))
        last = _min(_add(row0, self.bq - 1), sp.sq - 1)
        kend = binary("max", _min(_add(last, sp.offset + 1), sp.sk), _i(0))
        return binary("div", _add(kend, bk - 1), _i(bk))

    def scores_softmax(self, row0, ib, key0, write_p: bool) -> tuple:
        """The register block ib's rows of the key block's raw scores (in s) scaled, biased and
        masked, then the online softmax: running max ml[i], sum ml[bq+i], ml[2bq+i] = exp(m_old -
        m_new); write_p: s = P = exp(s - m_new) (0 where masked). Causal: the diagonal tested only
        in the blocks it crosses."""
        if not self.sp.causal:
            return self._scores_softmax(row0, ib, key0, write_p, True)
        below = binary("le", _add(key0, self.bk - 1), _add(row0, _mul(ib, self.R), self.sp.offset))
        return (If(below, self._scores_softmax(row0, ib, key0, write_p, False)),
                If(unary("not", below), self._scores_softmax(row0, ib, key0, write_p, True)))

    def _scores_softmax(self, row0, ib, key0, write_p: bool, causal: bool) -> tuple:
        w, bq, bk = self.w, self.bq, self.bk
        nv = bk // w
        out = []
        for r in range(self.R):
            i = _add(_mul(ib, self.R), r)
            row = _add(row0, i)
            at = [_add(_mul(i, bk), v * w) for v in range(nv)]
            out += [Store("xs", _i(v * w), self.score_keys(self.vld("s", at[v]), row, _add(key0, v * w), causal))
                    for v in range(nv)]  # (in registers: one pass over the row in memory)
            xs = [self.vld("xs", _i(v * w)) for v in range(nv)]
            mx = xs[0]
            for v in range(1, nv):
                mx = _fmax(mx, xs[v])
            m_old = self.reg("ml", i)
            mn = binary("max", m_old, self.hop(hmax, mx))
            out += [Store("mt", _i(0), mn), Store("mt", _i(1), select(binary("eq", self.reg("mt", 0), self.ninf),
                                                                     self.zero, self.reg("mt", 0)))]
            mn, ms = self.reg("mt", 0), self.reg("mt", 1)
            alpha = self.exp_from(m_old, ms, always=True)  # (m_old: -inf before the first block)
            ps = [self.exp_from(xs[v], broadcast(ms, w)) for v in range(nv)]
            if write_p:
                out += [Store("s", at[v], ps[v]) for v in range(nv)]
            total = ps[0]
            for p in ps[1:]:
                total = binary("add", total, p)
            l_at = _add(i, bq)
            out += [Store("ml", _add(i, 2 * bq), alpha),
                    Store("ml", l_at, binary("add", binary("mul", self.reg("ml", l_at), alpha),
                                             self.hop(hsum, total))),
                    Store("ml", i, mn)]
        return tuple(out)

    def store_rows(self, buf: int, op: int, tile: str, first, count: int, limit: int, width: int,
                   row_stride: int, base: int, factor) -> Range:
        """Operand-shaped rows of the result at `base`: tile row i (padded) times factor(i), for rows
        first+i < limit."""
        w, padded = self.w, _pad(width, self.w)
        i, c = var("ci"), var("cc")
        row = _add(first, i)
        dt = self.buffers[buf].dtype
        if width % w == 0:
            val = binary("mul", self.vld(tile, _add(_mul(i, padded), _mul(c, w))), broadcast(factor(i), w))
            st = Store(buf, _add(base, self.at(op, row, _mul(c, w), row_stride)), cast(val, dt))
            n = width // w
        else:
            val = binary("mul", self.reg(tile, _add(_mul(i, padded), c)), factor(i))
            st = Store(buf, _add(base, self.at(op, row, c, row_stride)), cast(val, dt))
            n = width
        return Range("ci", count, "serial", (If(_lt(row, limit), (Range("cc", n, "serial", (st,)),)),))

    def fill(self, name: str, n: int, value) -> Range:
        return Range("ci", n, "serial", (Store(name, var("ci"), value),))

    def grid1(self, blocks: int, inner: tuple) -> tuple:
        body = (Range("blk", blocks, "grid", inner),)
        for z, n in reversed(list(zip(self.zs, self.sp.batch))):
            body = (Range(z.arg, n, "grid", body),)
        return body

    def row_head(self, row0, with_o: bool) -> tuple:
        """The query block staged, its statistics reset; with_o: its output rows zeroed."""
        sp, bq = self.sp, self.bq
        return (self.copy_rows("qs", 0, 0, row0, bq, sp.sq, sp.d, sp.rows[0]),
                self.fill("ml", bq, self.ninf),
                Range("ci", bq, "serial", (Store("ml", _add(var("ci"), bq), self.zero),)),
                *((self.fill("o", bq * self.dvp, self.zero),) if with_o else ()))

    def key_block(self, row0, per_block: tuple, kt: bool = True) -> Range:
        """Over the key blocks the query block sees: kᵀ staged (kt), then per_block."""
        sp, kb = self.sp, var("kb")
        return Range("kb", self.key_end(row0), "serial", (
            *((self.copy_cols("kt", 1, 1, _mul(kb, self.bk), self.bk, sp.sk, sp.d, sp.rows[1]),) if kt else ()),
            *per_block))

    def scores(self, ib, out: str = "s", a: str = "qs", b: str = "kt", n: int | None = None, b_at=None) -> Range:
        """out = a bᵀ for the register block ib's rows of the query block (bk keys, b transposed;
        a: the queries' rows qs, or dO's dos with n = dv; b_at: where b's (feature, vector) is)."""
        R, bk, w = self.R, self.bk, self.w
        lda = self.dp if n is None else self.dvp
        return self.mm(out, lambda r, v: _add(_mul(_add(_mul(ib, R), r), bk), _mul(v, w)),
                       a, lambda r, x: _add(_mul(_add(_mul(ib, R), r), lda), x),
                       b, b_at or (lambda x, v: _add(_mul(x, bk), _mul(v, w))), self.sp.d if n is None else n,
                       bk // w)


def _forward_cpu(sp: Spec, sched: AttentionSchedule, name: str, buffers: tuple, n_inputs: int) -> TileKernel:
    a = _Cpu(sp, sched, buffers, n_inputs)
    bq, bk, R, w, dvp = a.bq, a.bk, a.R, a.w, a.dvp
    row0, kb, ib = _mul(var("blk"), bq), var("kb"), var("ib")
    l_ = lambda i: a.reg("ml", _add(i, bq))  # noqa: E731
    alpha = lambda r: a.reg("ml", _add(_mul(ib, R), r, 2 * bq))  # noqa: E731
    o_at = lambda r, v: _add(_mul(_add(_mul(ib, R), r), dvp), _mul(v, w))  # noqa: E731
    whole = sched.per_head  # a task per batch index: k transposed and v staged once, not per query block
    kp, key0 = _kpitch(sp, sched), _mul(kb, bk)
    kt_at = (lambda x, v: _add(_mul(x, kp), key0, _mul(v, w))) if whole else None  # noqa: E731
    v_at = (lambda x, v: _add(_mul(_add(key0, x), dvp), _mul(v, w))) if whole else \
        (lambda x, v: _add(_mul(x, dvp), _mul(v, w)))  # noqa: E731
    pv = a.mm("o", o_at, "s", lambda r, x: _add(_mul(_add(_mul(ib, R), r), bk), x), "vs", v_at, bk, dvp // w,
              first=lambda r, v: binary("mul", a.vld("o", o_at(r, v)), broadcast(alpha(r), w)))
    block = (
        *a.row_head(row0, True),
        a.key_block(row0, (
            *(() if whole else (a.copy_rows("vs", 2, 2, key0, bk, sp.sk, sp.dv, sp.rows[2]),)),
            Range("ib", bq // R, "serial", (
                a.scores(ib, b_at=kt_at), *a.scores_softmax(row0, ib, key0, True), pv)),), kt=not whole),
        a.store_rows(n_inputs, 3, "o", row0, bq, sp.sq, sp.dv, sp.rows[3], 0,
                     lambda i: select(binary("gt", l_(i), a.zero), binary("div", a.one, l_(i)), a.zero)),
        *((Range("ci", bq, "serial", (If(_lt(_add(row0, var("ci")), sp.sq), a.write_stats(
            _add(row0, var("ci")), a.reg("ml", var("ci")), l_(var("ci")))),)),) if sp.stats else ()),
    )
    allocs = a.allocs(**{k: n for k, n in _cpu_scratch(sp, sched).items()})
    if not whole:
        return TileKernel(name, tuple(buffers), n_inputs, a.grid1(_ceil(sp.sq, bq), (*allocs, *block)),
                          meta={"attention": (sp, sched)})
    skp = _pad(sp.sk, bk)
    body = (*allocs, a.copy_cols("kt", 1, 1, _i(0), skp, sp.sk, sp.d, sp.rows[1], kp),
            a.copy_rows("vs", 2, 2, _i(0), skp, sp.sk, sp.dv, sp.rows[2]),
            Range("blk", _ceil(sp.sq, bq), "serial", block))
    for z, n in reversed(list(zip(a.zs, sp.batch))):
        body = (Range(z.arg, n, "grid", body),)
    return TileKernel(name, tuple(buffers), n_inputs, body, meta={"attention": (sp, sched)})


def _backward_cpu(sp: Spec, sched: AttentionSchedule, name: str, buffers: tuple, n_inputs: int,
                  runtime_sizes: bool) -> list:
    """The backward's CPU form: the stats, dkdv and dq kernels; per_head: one kernel, a task per
    batch index computing its rows' statistics into scratch, then per key block dk and dv, and dq
    added into its rows of the result (the only writer: no atomics)."""
    a = _Cpu(sp, sched, buffers, n_inputs)
    bq, bk, R, w, dp, dvp = a.bq, a.bk, a.R, a.w, a.dp, a.dvp
    o_buf, do_buf, res = a.o_buf, a.do_buf, n_inputs
    q_res, k_res = sp.sizes
    dk_at, dv_at = (size(0), size(1)) if runtime_sizes else (q_res, q_res + k_res)
    sizes = {"sizes": (q_res, q_res + k_res)} if runtime_sizes else {}
    blk, kb, ib, i, c = var("blk"), var("kb"), var("ib"), var("ci"), var("cc")
    nqb = _ceil(sp.sq, bq)
    sqp = nqb * bq

    def stats_sweep(row0, store, guard: bool, kt_at=None) -> tuple:
        """Per query row of the block m (0 where no key is visible), 1/l and D = do·o, each
        written by store(which, row, value) (guard: rows inside the sequence only); m and 1/l
        the forward's where it passes them (sp.stats), else recomputed by a sweep over the keys."""
        m, l_ = a.reg("ml", i), a.reg("ml", _add(i, bq))
        row = _add(row0, i)
        o_at = lambda c_: a.at(3, _min(row, sp.sq - 1), c_, sp.rows[3])  # noqa: E731
        if sp.dv % w == 0 and w > 1:
            term = hsum(binary("mul", _fp(vload(o_buf, o_at(_mul(c, w)), buffers[o_buf].dtype, w)),
                               _fp(vload(do_buf, o_at(_mul(c, w)), buffers[do_buf].dtype, w))))
        else:
            term = binary("mul", a.ld(o_buf, o_at(c)), a.ld(do_buf, o_at(c)))
        if sp.stats:
            m_row, linv_row = a.read_stat(row, 0), a.read_stat(row, 1)
        else:
            m_row = select(binary("eq", m, a.ninf), a.zero, m)
            linv_row = select(binary("gt", l_, a.zero), binary("div", a.one, l_), a.zero)
        per_row = (Store("mt", _i(0), a.zero), Range("cc", sp.dv // w if sp.dv % w == 0 else sp.dv, "serial", (
            Store("mt", _i(0), binary("add", a.reg("mt", 0), term)),)),
            store(0, row, m_row), store(1, row, linv_row), store(2, row, a.reg("mt", 0)))
        rows = Range("ci", bq, "serial", (If(_lt(row, sp.sq), per_row),) if guard else per_row)
        if sp.stats:
            return (rows,)
        return (*a.row_head(row0, False),
                a.key_block(row0, (Range("ib", bq // R, "serial", (
                    a.scores(ib, b_at=kt_at), *a.scores_softmax(row0, ib, _mul(kb, bk), False))),),
                            kt=kt_at is None),
                rows)

    # dq: per query block, the statistics read; per key block dS = P (dP - D), dq += dS k
    row0 = _mul(blk, bq)
    row = _add(row0, i)

    def stat(i_, which):
        return a.reg("ml", _add(_mul(_i(which), bq), i_))
    ds_rows = []
    for r in range(R):
        il = _add(_mul(ib, R), r)
        rw = _add(row0, il)
        for v in range(bk // w):
            at = _add(_mul(il, bk), v * w)
            x = a.score_keys(a.vld("s", at), rw, _add(_mul(kb, bk), v * w))
            p = binary("mul", a.exp_from(x, broadcast(stat(il, 0), w)), broadcast(stat(il, 1), w))
            ds_rows.append(Store("s", at, binary("mul", p, binary("sub", a.vld("dp", at), broadcast(stat(il, 2), w)))))
    dq_at = lambda r, v: _add(_mul(_add(_mul(ib, R), r), dp), _mul(v, w))  # noqa: E731
    dq = TileKernel(name + "_dq", tuple(buffers), n_inputs, a.grid1(nqb, (
        *a.allocs(qs=bq * dp, kt=sp.d * bk, s=bq * bk, ml=3 * bq, dos=bq * dvp, vt=sp.dv * bk, kr=bk * dp,
                  dp=bq * bk, dq=bq * dp),
        a.copy_rows("qs", 0, 0, row0, bq, sp.sq, sp.d, sp.rows[0]),
        a.copy_rows("dos", do_buf, 3, row0, bq, sp.sq, sp.dv, sp.rows[3]),
        Range("ci", bq, "serial", tuple(
            Store("ml", _add(i, which * bq), a.ld(res, a.stats_at(_min(row, sp.sq - 1), which)))
            for which in range(3))),
        a.fill("dq", bq * dp, a.zero),
        a.key_block(row0, (
            a.copy_cols("vt", 2, 2, _mul(kb, bk), bk, sp.sk, sp.dv, sp.rows[2]),
            a.copy_rows("kr", 1, 1, _mul(kb, bk), bk, sp.sk, sp.d, sp.rows[1]),
            Range("ib", bq // R, "serial", (
                a.scores(ib), a.scores(ib, "dp", "dos", "vt", sp.dv), *ds_rows,
                a.mm("dq", dq_at, "s", lambda r, x: _add(_mul(_add(_mul(ib, R), r), bk), x),
                     "kr", lambda x, v: _add(_mul(x, dp), _mul(v, w)), bk, dp // w,
                     first=lambda r, v: a.vld("dq", dq_at(r, v))))),)),
        a.store_rows(res, 0, "dq", row0, bq, sp.sq, sp.d, sp.rows[0], 0, lambda i_: const(sp.scale, a.f)),)), meta=dict(sizes))

    # dkdv: per key block, over the query blocks that see it: Pᵀ and dSᵀ with vectors along the
    # queries, dv += Pᵀ do, dk += dSᵀ q (per_head: and dq += dS k)
    qb, jb = var("qb"), var("jb")

    hoist, qpitch = _hoisted(sp, sched), _qpitch(sp, sched)
    # q, do (and dq) rows used in place, not copied per block pair, where every block row is a
    # sequence row and the rows whole vectors of the compute dtype
    direct = sp.sq % bq == 0 and sp.d % w == 0 and sp.dv % w == 0 and \
        all(np.dtype(buffers[b].dtype) == a.f for b in (0, do_buf, res))

    def key_block_body(key0, stats_of, dq_update: tuple) -> tuple:
        if sp.causal:  # the first query block that sees key key0: query i sees key j when j <= i + offset
            first = binary("div", binary("max", _add(key0, -sp.offset), _i(0)), _i(bq))
            q0 = _mul(_add(first, qb), bq)
            n_qb = binary("max", binary("sub", _i(nqb), first), _i(0))
        else:
            q0, n_qb = _mul(qb, bq), _i(nqb)
        pt_rows = []
        for r in range(R):
            jl = _add(_mul(jb, R), r)
            for v in range(bq // w):
                at = _add(_mul(jl, bq), v * w)
                x = a.score_queries(a.vld("pt", at), _add(q0, v * w), _add(key0, jl))
                p = binary("mul", a.exp_from(x, a.vld("ml", v * w)), a.vld("ml", bq + v * w))
                pt_rows += [Store("pt", at, p),
                            Store("dst", at, binary("mul", a.vld("pt", at),
                                                    binary("sub", a.vld("dst", at), a.vld("ml", 2 * bq + v * w))))]
        kv_at = lambda width: lambda r, v: _add(_mul(_add(_mul(jb, R), r), width), _mul(v, w))  # noqa: E731
        kv_row = lambda width: lambda r, x: _add(_mul(_add(_mul(jb, R), r), width), x)  # noqa: E731
        t_at = lambda r, x: _add(_mul(_add(_mul(jb, R), r), bq), x)  # noqa: E731
        rows_at = lambda width: lambda x, v: _add(_mul(x, width), _mul(v, w))  # noqa: E731
        q_rows, do_rows = ((0, lambda x, v: a.at(0, _add(q0, x), _mul(v, w), sp.rows[0])),
                           (do_buf, lambda x, v: a.at(3, _add(q0, x), _mul(v, w), sp.rows[3]))) if direct else \
            (("qs", rows_at(dp)), ("dos", rows_at(dvp)))
        copies = () if direct else (a.copy_rows("qs", 0, 0, q0, bq, sp.sq, sp.d, sp.rows[0]),
                                    a.copy_rows("dos", do_buf, 3, q0, bq, sp.sq, sp.dv, sp.rows[3]))
        cols_at = lambda x, v: _add(_mul(x, bq), _mul(v, w))  # noqa: E731
        if hoist:  # qt and dot hold every query: this block's columns from q0
            cols_at = lambda x, v: _add(_mul(x, qpitch), q0, _mul(v, w))  # noqa: E731
        transposed = () if hoist else (a.copy_cols("qt", 0, 0, q0, bq, sp.sq, sp.d, sp.rows[0]),
                                       a.copy_cols("dot", do_buf, 3, q0, bq, sp.sq, sp.dv, sp.rows[3]))
        return (
            a.copy_rows("kr", 1, 1, key0, bk, sp.sk, sp.d, sp.rows[1]),
            a.copy_rows("vr", 2, 2, key0, bk, sp.sk, sp.dv, sp.rows[2]),
            a.fill("dk", bk * dp, a.zero), a.fill("dv", bk * dvp, a.zero),
            Range("qb", n_qb, "serial", (
                *transposed, *copies,
                Range("ci", bq, "serial", tuple(Store("ml", _add(i, which * bq), stats_of(which, _add(q0, i)))
                                                for which in range(3))),
                Range("jb", bk // R, "serial", (
                    a.mm("pt", kv_at(bq), "kr", kv_row(dp), "qt", cols_at, sp.d, bq // w),
                    a.mm("dst", kv_at(bq), "vr", kv_row(dvp), "dot", cols_at, sp.dv, bq // w),
                    *pt_rows,
                    a.mm("dv", kv_at(dvp), "pt", t_at, *do_rows, bq, dvp // w,
                         first=lambda r, v: a.vld("dv", kv_at(dvp)(r, v))),
                    a.mm("dk", kv_at(dp), "dst", t_at, *q_rows, bq, dp // w,
                         first=lambda r, v: a.vld("dk", kv_at(dp)(r, v))),)),
                *dq_update(q0))),
            a.store_rows(res, 1, "dk", key0, bk, sp.sk, sp.d, sp.rows[1], dk_at, lambda i_: const(sp.scale, a.f)),
            a.store_rows(res, 2, "dv", key0, bk, sp.sk, sp.dv, sp.rows[2], dv_at, lambda i_: a.one))
    tiles = dict(kr=bk * dp, vr=bk * dvp, qt=sp.d * bq, dot=sp.dv * bq, qs=bq * dp, dos=bq * dvp, ml=3 * bq,
                 pt=bk * bq, dst=bk * bq, dk=bk * dp, dv=bk * dvp)

    if sched.per_head:
        def dq_update(q0):  # the query block's dq rows (kept unscaled in the result) += dS k
            if direct:  # in place in the result
                dq_at_ = lambda r, v: a.at(0, _add(q0, _mul(ib, R), r), _mul(v, w), sp.rows[0])  # noqa: E731
                return (Range("ib", bq // R, "serial", (a.mm(
                    res, dq_at_, "dst", lambda r, x: _add(_mul(x, bq), _mul(ib, R), r),
                    "kr", lambda x, v: _add(_mul(x, dp), _mul(v, w)), bk, dp // w,
                    first=lambda r, v: a.vld(res, dq_at_(r, v))),)),)
            dq_at_ = lambda r, v: _add(_mul(_add(_mul(ib, R), r), dp), _mul(v, w))  # noqa: E731
            return (a.copy_rows("dqs", res, 0, q0, bq, sp.sq, sp.d, sp.rows[0]),
                    Range("ib", bq // R, "serial", (a.mm(
                        "dqs", dq_at_, "dst", lambda r, x: _add(_mul(x, bq), _mul(ib, R), r),
                        "kr", lambda x, v: _add(_mul(x, dp), _mul(v, w)), bk, dp // w,
                        first=lambda r, v: a.vld("dqs", dq_at_(r, v))),)),
                    a.store_rows(res, 0, "dqs", q0, bq, sp.sq, sp.d, sp.rows[0], 0, lambda i_: a.one))
        dq_all = lambda value: Range("ci", sp.sq, "serial", (Range("cc", sp.d, "serial", (  # noqa: E731
            Store(res, a.at(0, i, c, sp.rows[0]), value(tload(res, a.at(0, i, c, sp.rows[0]), a.f))),)),))
        if hoist:
            tiles.update(qt=sp.d * qpitch, dot=sp.dv * qpitch)
        k_whole, kp = _k_whole(sp, sched) and not sp.stats, _kpitch(sp, sched)  # (k whole: for the statistics)
        kt_at = (lambda x, v: _add(_mul(x, kp), _mul(kb, bk), _mul(v, w))) if k_whole else None  # noqa: E731
        inner = (
            *a.allocs(st=3 * sqp, **tiles, kt=sp.d * (kp if k_whole else bk), s=bq * bk, dqs=bq * dp),
            *((a.copy_cols("qt", 0, 0, _i(0), sqp, sp.sq, sp.d, sp.rows[0], qpitch),
               a.copy_cols("dot", do_buf, 3, _i(0), sqp, sp.sq, sp.dv, sp.rows[3], qpitch)) if hoist else ()),
            *((a.copy_cols("kt", 1, 1, _i(0), _pad(sp.sk, bk), sp.sk, sp.d, sp.rows[1], kp),) if k_whole else ()),
            Range("qb", nqb, "serial", stats_sweep(_mul(qb, bq), lambda which, r_, v: Store(
                "st", _add(r_, which * sqp), v), False, kt_at)),
            dq_all(lambda x: a.zero),
            Range("kb", _ceil(sp.sk, bk), "serial", key_block_body(
                _mul(kb, bk), lambda which, r_: a.reg("st", _add(_min(r_, sqp - 1), which * sqp)), dq_update)),
            dq_all(lambda x: binary("mul", x, const(sp.scale, a.f))))
        body = inner
        for z, n in reversed(list(zip(a.zs, sp.batch))):
            body = (Range(z.arg, n, "grid", body),)
        return [TileKernel(name + "_heads", tuple(buffers), n_inputs, body, meta=dict(sizes))]

    stats = TileKernel(name + "_stats", tuple(buffers), n_inputs, a.grid1(nqb, (
        *a.allocs(qs=bq * dp, kt=sp.d * bk, s=bq * bk, ml=3 * bq),
        *stats_sweep(row0, lambda which, r_, v: Store(res, a.stats_at(r_, which), v), True))), meta=dict(sizes))
    key0 = _mul(blk, bk)
    dkdv = TileKernel(name + "_dkdv", tuple(buffers), n_inputs, a.grid1(_ceil(sp.sk, bk), (
        *a.allocs(**tiles),
        *key_block_body(key0, lambda which, qr: select(_lt(qr, sp.sq), a.ld(
            res, a.stats_at(_min(qr, sp.sq - 1), which)), a.zero), lambda q0: ()))), meta=dict(sizes))
    return [stats, dkdv, dq]


def size_free_key(sp: Spec, sched: AttentionSchedule, buffers: tuple, n_inputs: int, runtime_sizes: bool):
    """What the CPU form's tile kernels (build_forward, build_backward) are made of but for the
    first batch axis's size, which only the outermost grid Range reads (one Range per batch axis):
    the spec without it (and without the operands' sizes, which the forward never reads and the
    backward reads at run time where `runtime_sizes`), the schedule, the buffers' dtypes. Two
    builds with the same key have the same kernels but for that Range's extent (at_sizes), so one
    key_text each. None for the GPU form or kernels without batch axes."""
    if not sched.cpu or not sp.batch:
        return None
    sizes = (0, 0) if not sp.bwd or runtime_sizes else sp.sizes
    return (replace(sp, batch=(0, *sp.batch[1:]), sizes=sizes), sched,
            tuple(np.dtype(b.dtype) for b in buffers), n_inputs, runtime_sizes)


def at_sizes(tks: list, name_was: str, sp: Spec, sched: AttentionSchedule, name: str, buffers: tuple) -> list:
    """The tile kernels building sp gives (named for kernel `name`), made of `tks`, built for a
    kernel named name_was with the same size_free_key: their first batch axis's grid Range at
    sp's, their run-time sizes sp's."""
    out = []
    for tk in tks:
        meta = {}
        if "attention" in tk.meta:
            meta["attention"] = (sp, sched)
        if "sizes" in tk.meta:
            meta["sizes"] = (sp.sizes[0], sp.sizes[0] + sp.sizes[1])
        out.append(at_grid_extent(tk, sp.batch[0], name + tk.name[len(name_was):], buffers, meta))
    return out
