"""The strided view of a fused attention equation, shared by every backend's FlashAttention.

`fused_attention` (and its backward) computes softmax(scale · q kᵀ + bias) v per batch index,
over operands in any layout its `dims` name: each operand has batch axes, a sequence axis and a
feature axis, at element strides the Spec records, so no operand is transposed or copied
beforehand. Backends address batch index t either through the batch axes' strides (OpenCL and
CUDA compute them in the kernel) or through a table of per-batch offsets (the CPU template bakes
`batch_offsets()` into its module)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from tilefuse.ir import dtypes, primitives as P

from .gemm import _add, _and, _ceil, _fp, _i, _lt, _min, _mul, _x
from .ir import KExpr, binary, cast, const, select, unary
from .lower import strides
from .tile import Alloc, Barrier, If, Range, Store, TileKernel, tload, var


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

    @property
    def nb(self) -> int:
        return int(np.prod(self.batch, dtype=np.int64))

    @property
    def offset(self) -> int:  # Sk - Sq: query i sees keys j <= i + offset when causal
        return self.sk - self.sq

    @cached_property
    def batch_offsets(self) -> tuple:
        """Per batch index t: the element offsets of (q, k, v, out, bias) at its first position."""
        idx = np.indices(self.batch).reshape(len(self.batch), self.nb)
        cols = [sum((i * s for i, s in zip(idx, st)), np.zeros(self.nb, np.int64)) for st in self.batch_strides]
        return tuple(tuple(int(x) for x in row) for row in np.stack(cols, axis=1))


def spec_of(eqn) -> Spec:
    q, k, v = (a.aval for a in eqn.inputs[:3])
    dims = eqn.params["dims"]
    bwd = eqn.prim is P.fused_attention_bwd
    has_bias = len(eqn.inputs) == (6 if bwd else 4)
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
                tuple(batch_strides), rows, bias_strides, (q.size, k.size))


# ---- FlashAttention written once, as tile kernels -----------------------------------------------

@dataclass(frozen=True)
class AttentionSchedule:
    """The GPU form: a work-group of `bq` work-items, one query row each, stages `bk` keys and
    values at a time through shared memory; the backward's dk/dv kernel turns it around (`bk`
    work-items, one key row each, staging `bq` queries at a time)."""
    bq: int
    bk: int

    def check(self, sp: Spec, target) -> str | None:
        lanes = max(self.bq, self.bk) if sp.bwd else self.bq
        if target.shared_bytes == 0 or lanes > target.max_group:
            return f"{self}: needs shared memory and {lanes} work-items per work-group"
        words = max(self.bk * (sp.d + sp.dv), self.bq * (sp.d + sp.dv + 3) if sp.bwd else 0)
        if 4 * words > target.shared_bytes:
            return f"{self}: {4 * words} bytes of staged rows exceed shared memory"
        if sp.bwd and sp.d < 3:
            return "the backward keeps 3 numbers per query row where dq goes: needs d >= 3"
        return None


def default_attention_schedule(sp: Spec, target) -> AttentionSchedule | None:
    """Query rows per work-group up to 64 (fewer for short sequences); key blocks as deep as
    shared memory holds, up to 64; None where even 8 keys do not fit."""
    bq = min(64, max(1, target.max_group), 1 << max(0, (sp.sq - 1).bit_length()))
    for bk in (64, 32, 16, 8):
        s = AttentionSchedule(bq, bk)
        if s.check(sp, target) is None:
            return s
    return None


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

    def visible(self, row, key) -> KExpr:
        ok = _and(_lt(key, self.sp.sk), _lt(row, self.sp.sq))
        if self.sp.causal:  # query i sees keys j <= i + (Sk - Sq)
            ok = _and(ok, binary("le", key, _add(row, self.sp.offset)))
        return ok

    def score(self, dot: KExpr, row, key) -> KExpr:
        """scale * q·k + bias, -inf where the key is not visible to the row."""
        sp = self.sp
        s = binary("mul", dot, const(sp.scale, self.f))
        if sp.has_bias:
            bs = sp.bias_strides
            off = _add(*(_mul(z, st) for z, st in zip(self.zs, sp.batch_strides[4])),
                       _mul(_min(row, sp.sq - 1), bs[0]), _mul(_min(key, sp.sk - 1), bs[1]))
            s = binary("add", s, self.ld(3, off))
        return select(self.visible(row, key), s, self.ninf)

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

    def stats_at(self, row, which: int) -> KExpr:
        """Where the backward keeps row's (m, 1/l, D) before dq is written: the dq part of the
        packed result, 3 numbers a row (flat batch index t: t*Sq*3 + row*3)."""
        sp = self.sp
        t = _add(*(_mul(z, int(np.prod(sp.batch[i + 1:], dtype=np.int64))) for i, z in enumerate(self.zs))) \
            if self.zs else _i(0)
        return _add(_mul(t, sp.sq * 3), _mul(row, 3), which)


def build_forward(sp: Spec, sched: AttentionSchedule, name: str, buffers: tuple, n_inputs: int) -> TileKernel:
    """softmax(scale · q kᵀ + bias) v for every batch index and query row, the scores never
    stored: each work-item keeps its row's running max m and sum l, and for each block of keys
    computes the block's scores, rescales its output row once by exp(m_old - m_new), then adds
    p v over the block (an online softmax). A query with no key to attend to gets zeros (l = 0),
    as the primitive defines."""
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
                       buffers[out].dtype)),)),)),
    )
    return TileKernel(name, tuple(buffers), n_inputs, a.grid(_ceil(sp.sq, a.bq), "r", a.bq, inner),
                      meta={"attention": (sp, sched)})


def build_backward(sp: Spec, sched: AttentionSchedule, name: str, buffers: tuple, n_inputs: int) -> list:
    """dq, dk, dv packed into one result (the primitive's layout), as three tile kernels run in
    order, every result element with one writer (no atomics):
      stats: per query row, m and 1/l (the forward's row statistics, recomputed) and
             D = do·o, kept where dq will go;
      dkdv:  a work-item per key row, the queries staged block by block with their stats:
             P = exp(s - m)/l, dv += P do, dS = P (do·v - D), dk += dS q scale;
      dq:    a work-item per query row, the statistics recomputed (its stats slots may hold
             another row's: they are not read), dq += dS k scale over the key blocks."""
    a = _Tiles(sp, sched, buffers, n_inputs)
    f, bq, bk = a.f, a.bq, a.bk
    o_buf, do_buf, res = n_inputs - 2, n_inputs - 1, n_inputs
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
    stats = TileKernel(name + "_stats", tuple(buffers), n_inputs, a.grid(_ceil(sp.sq, bq), "r", bq, (
        *row_head, *a.key_blocks(row, r, lambda j, p: ()),
        If(_lt(row, sp.sq), tuple(Store(res, a.stats_at(row, w), v)
                                  for w, v in enumerate((m, linv, a.reg("dd", 0))))),)))

    # dq: the row's statistics again, then a second sweep over the key blocks
    kb2, j = var("kb"), var("j")
    key = _add(_mul(kb2, bk), j)
    sj = a.reg("s", j)
    p = select(binary("eq", sj, a.ninf), a.zero, binary("mul", unary("exp", binary("sub", sj, m)), linv))
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
        *a.key_blocks(row, r, lambda j_, p_: ()), sweep,
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
