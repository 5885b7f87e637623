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

from .lower import strides


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


# ---- FlashAttention written once, as a tile kernel -----------------------------------------------

@dataclass(frozen=True)
class AttentionSchedule:
    """The GPU form: a work-group of `bq` work-items, one query row each, stages `bk` keys and
    values at a time through shared memory."""
    bq: int
    bk: int

    def check(self, sp: Spec, target) -> str | None:
        if target.shared_bytes == 0 or self.bq > target.max_group:
            return f"{self}: needs shared memory and {self.bq} work-items per work-group"
        if 4 * self.bk * (sp.d + sp.dv) > target.shared_bytes:
            return f"{self}: {4 * self.bk * (sp.d + sp.dv)} bytes of keys and values exceed shared memory"
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


def build_forward(sp: Spec, sched: AttentionSchedule, name: str, buffers: tuple, n_inputs: int):
    """softmax(scale · q kᵀ + bias) v for every batch index and query row, the scores never
    stored: each work-item keeps its row's running max m and sum l, and for each block of keys
    computes the block's scores, rescales its output row once by exp(m_old - m_new), then adds
    p v over the block (an online softmax). Inputs of 16 bits are
    computed in float32. A query with no key to attend to gets zeros (l = 0), as the primitive's.
    Buffers: q, k, v, [bias], out."""
    from .gemm import _add, _and, _ceil, _fp, _i, _lt, _min, _mul
    from .ir import binary, cast, const, select, unary
    from .tile import Alloc, Barrier, If, Range, Store, TileKernel, tload, var
    f32 = dtypes.compute_dtype(buffers[0].dtype)  # (named for the usual case: float64 stays float64)
    bq, bk = sched.bq, sched.bk
    feat = "unroll" if max(sp.d, sp.dv) <= 128 else "serial"  # (unrolled: the row's q and out are registers)
    out = n_inputs
    zs = [var(f"z{i}") for i in range(len(sp.batch))]

    def at(op: int, row, col, row_stride: int):  # operand op's element (row, col) of this batch index
        return _add(*(_mul(z, s) for z, s in zip(zs, sp.batch_strides[op])), _mul(row, row_stride), col)

    def ld(buf: int, off):
        return _fp(tload(buf, off, buffers[buf].dtype))

    qb, r, kb, j, c, t = var("qb"), var("r"), var("kb"), var("j"), var("c"), var("t")
    row = _add(_mul(qb, bq), r)
    key = _add(_mul(kb, bk), j)
    zero, one, ninf = const(0, f32), const(1, f32), const(-np.inf, f32)

    def stage(name: str, buf: int, width: int, row_stride: int):
        """Work-item r copies elements t*bq + r of the bk x width block (zeros past the keys)."""
        e = _add(_mul(t, bq), r)
        kk = _add(_mul(kb, bk), binary("div", e, _i(width)))
        val = ld(buf, at(buf, _min(kk, sp.sk - 1), binary("rem", e, _i(width)), row_stride))
        return Range("t", _ceil(bk * width, bq), "serial", (
            If(_lt(e, bk * width), (Store(name, e, select(_lt(kk, sp.sk), val, zero)),)),))

    m, l_, mb = (tload("ml", _i(i), f32) for i in range(3))
    sj = tload("s", j, f32)
    score = binary("mul", sj, const(sp.scale, f32))
    if sp.has_bias:
        bs = sp.bias_strides
        boff = _add(*(_mul(z, st) for z, st in zip(zs, sp.batch_strides[4])),
                    _mul(_min(row, sp.sq - 1), bs[0]), _mul(_min(key, sp.sk - 1), bs[1]))
        score = binary("add", score, ld(3, boff))
    visible = _lt(key, sp.sk)
    if sp.causal:  # query i sees keys j <= i + (Sk - Sq)
        visible = _and(visible, binary("le", key, _add(row, sp.offset)))
    mn = binary("max", m, mb)  # the running max over the keys so far and this block's
    corr = select(binary("eq", m, mn), one, unary("exp", binary("sub", m, mn)))
    p = select(binary("eq", sj, ninf), zero, unary("exp", binary("sub", sj, mn)))
    block = (  # scores of the block's keys (-inf where masked), their max, then one rescale
        Store("ml", _i(2), ninf),
        Range("j", bk, "serial", (
            Store("s", j, zero),
            Range("c", sp.d, feat, (Store("s", j, binary("add", sj, binary(
                "mul", tload("qv", c, f32), tload("ks", _add(_mul(j, sp.d), c), f32)))),)),
            Store("s", j, select(visible, score, ninf)),
            Store("ml", _i(2), binary("max", mb, sj)),)),
        Store("ml", _i(1), binary("mul", l_, corr)),
        Range("c", sp.dv, feat, (Store("o", c, binary("mul", tload("o", c, f32), corr)),)),
        Store("ml", _i(0), mn),
        Range("j", bk, "serial", (
            Store("ml", _i(1), binary("add", l_, p)),
            Range("c", sp.dv, feat, (Store("o", c, binary("add", tload("o", c, f32), binary(
                "mul", p, tload("vs", _add(_mul(j, sp.dv), c), f32)))),)),)),
    )
    rowc = _min(row, sp.sq - 1)
    out_dtype = buffers[out].dtype
    inner = (
        Alloc("ks", f32, bk * sp.d, "shared"), Alloc("vs", f32, bk * sp.dv, "shared"),
        Alloc("qv", f32, sp.d, "register"), Alloc("o", f32, sp.dv, "register"),
        Alloc("ml", f32, 3, "register"), Alloc("s", f32, bk, "register"),
        Range("c", sp.d, feat, (Store("qv", c, ld(0, at(0, rowc, c, sp.rows[0]))),)),
        Range("c", sp.dv, feat, (Store("o", c, zero),)),
        Store("ml", _i(0), ninf), Store("ml", _i(1), zero),
        Range("kb", _ceil(sp.sk, bk), "serial", (
            stage("ks", 1, sp.d, sp.rows[1]), stage("vs", 2, sp.dv, sp.rows[2]), Barrier(),
            *block, Barrier())),
        If(_lt(row, sp.sq), (Range("c", sp.dv, feat, (
            Store(out, at(3, row, c, sp.rows[3]),
                  cast(binary("div", tload("o", c, f32), select(binary("gt", l_, zero), l_, one)), out_dtype)),)),)),
    )
    body = (Range("qb", _ceil(sp.sq, bq), "grid", (Range("r", bq, "lane", inner),)),)
    for z, n in reversed(list(zip(zs, sp.batch))):
        body = (Range(z.arg, n, "grid", body),)
    return TileKernel(name, tuple(buffers), n_inputs, body, meta={"attention": (sp, sched)})
