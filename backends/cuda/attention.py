"""FlashAttention on CUDA: fused_attention and fused_attention_bwd as NVPTX LLVM IR generated with
llvmlite (float32, CUDA cores), K/V blocks staged through shared memory; the S x S scores are
never stored.

Every kernel gives each thread of a block one row it owns (a query, or in dK/dV a key): the
block's own rows are staged once into shared memory (rows padded by one float, so the threads
reading down a column hit different banks), and the block then sweeps over tiles of the other
sequence, each staged cooperatively (coalesced) between two `llvm.nvvm.barrier0`. A tile's
scores sit in registers: a loop over the features reads the thread's own value once and
multiplies it into them, the tile's value being the same address for every thread (a
shared-memory broadcast); the accumulators (O, dQ, dK, dV: one register per feature, the head
sizes are constants) take the weights back through the thread's padded row of a shared tile.
Scores are kept in base 2 (u = (q·k·scale + bias)·log2 e, `ex2.approx`/`lg2.approx`).

Forward: one block per (batch index, `threads` queries); online softmax with a running max m and sum l
per row, the output accumulator rescaled by 2^(m_old - m_new) in registers. Causal masking stops
a block at its last visible key.

Backward, two kernels and no atomics (every result element has one writer, so it is
deterministic; the price is the scores computed once more than with atomic dQ):
  dq:   one block per (batch index, `threads` queries). A first sweep recomputes each row's
        log-sum-exp, and D_i = dO_i·O_i; both go to a workspace for the second kernel. A second
        sweep recomputes P = 2^(u - lse), dP = dO vᵀ, dS = P (dP - D) scale, and dQ += dS k.
  dkdv: one block per (batch index, `threads` keys), over the tiles of queries that see them:
        dV += Pᵀ dO, dK += dSᵀ q.

Block sizes (`AttentionParams`: threads = rows per block, tile = rows of the other sequence per
step) come from the device's shared memory per block and thread limit; the tuner may search them.
The kernels take what the OpenCL template takes (its Spec describes the equation: causal or
not, a bias/mask broadcasting over any axes, any layout whose feature axis is the last, Sq != Sk)
in float32 with heads up to 128 wide; anything else runs as the composite
(runtime/composite.py). `host=True` renders the same algorithm for the CPU (threads as
arguments, the barrier a callback) so that tests check it without a GPU."""
from __future__ import annotations

import ctypes
import hashlib
import math
from dataclasses import asdict, dataclass, replace

import numpy as np
from llvmlite import ir
from tilefuse.backends.llvmir.irutil import counted_loop
from tilefuse.runtime.tiled import attention_tuning_key as tuning_key
from tilefuse.ir.kernel.attention import Spec, spec_of
from tilefuse.ir import primitives as P
from tilefuse.ir.errors import CompileError
from tilefuse.runtime import tuner

from . import driver
from .render import TRIPLE, _sreg, to_ptx

F32_NP = np.dtype(np.float32)
MAX_HEAD_DIM = 128  # accumulators live in registers: wider heads would spill heavily
STATIC_SHARED = 48 << 10  # static shared memory per block (more needs the opt-in attribute)
LOG2E = math.log2(math.e)
F32, I32, I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
PTR = ir.PointerType()


def _f(x):
    return ir.Constant(F32, float(x))


def _i(n, t=I64):
    return ir.Constant(t, int(n))


# ---- block sizes and launch configuration ------------------------------------------------------

@dataclass(frozen=True)
class AttentionParams:
    """threads: rows a block owns (one per thread, a whole number of warps); tile: rows of the
    other sequence staged in shared memory per step (its scores sit in registers)."""
    threads: int = 64
    tile: int = 32

    def shared_floats(self, sp: Spec) -> int:
        """Shared memory of the template's largest kernel, in floats."""
        return max(sum(_shared(sp, self, which).values()) for which, _, _ in launches(sp, self))

    def check(self, info, sp: Spec) -> str | None:
        """Why these parameters cannot run on the device, or None."""
        warp = int(info.sub_group or 32)
        if self.threads < warp or self.threads % warp or self.tile < 1:
            return f"{self}: threads must be a positive multiple of the warp ({warp})"
        if self.threads > info.max_work_group:
            return f"{self}: blocks hold at most {info.max_work_group} threads"
        limit = min(int(info.local_mem_bytes), STATIC_SHARED)
        if 4 * self.shared_floats(sp) > limit:
            return f"{self}: {4 * self.shared_floats(sp)} bytes of shared memory exceed {limit}"
        return None


def fit(info, sp: Spec, p: AttentionParams) -> AttentionParams | None:
    """p with the tile, then the block, halved until the shared memory fits (None if never)."""
    warp = int(info.sub_group or 32)
    while p.check(info, sp) is not None:
        if p.tile > 8:
            p = replace(p, tile=p.tile // 2)
        elif p.threads > warp:
            p = replace(p, threads=p.threads // 2)
        else:
            return None
    return p


def default_params(info, sp: Spec) -> AttentionParams | None:
    """Two warps per block and tiles of 32, fitted to the shared memory. Where the grid would
    not give every SM a block, blocks of one warp: twice as many reach more SMs (and a smaller
    block leaves room for a longer tile)."""
    p, warp = fit(info, sp, AttentionParams()), int(info.sub_group or 32)
    if p is not None and p.threads > warp and max(g for _, g, _ in launches(sp, p)) < info.compute_units:
        p = fit(info, sp, AttentionParams(threads=warp))
    return p


def launches(sp: Spec, p: AttentionParams) -> list[tuple[str, int, int]]:
    """(kernel suffix, grid, block) of every launch, in order: 1-D grids of (batch index, block
    of rows) pairs."""
    nq, nk = -(-sp.sq // p.threads), -(-sp.sk // p.threads)
    if not sp.bwd:
        return [("", sp.nb * nq, p.threads)]
    return [("_dq", sp.nb * nq, p.threads), ("_dkdv", sp.nb * nk, p.threads)]


def applies(kernel, device) -> bool:
    """float32 operands whose feature axis is the last, heads up to 128 wide, blocks that fit."""
    eqns = kernel.meta.get("eqns", ())
    if len(eqns) != 1 or eqns[0].prim not in (P.fused_attention, P.fused_attention_bwd):
        return False
    e = eqns[0]
    ops = e.inputs[:3]
    if not (all(a.aval.dtype == F32_NP and a.aval.size > 0 for a in e.inputs)
            and all(d[-1] == a.aval.ndim - 1 for d, a in zip(e.params["dims"], ops))
            and max(a.aval.shape[-1] for a in ops) <= MAX_HEAD_DIM):
        return False
    return default_params(device.info, spec_of(e)) is not None


# ---- IR generation ---------------------------------------------------------------------------

class _Kernel:
    """Builds one kernel function: its arguments, shared tiles, barrier and index helpers."""

    def __init__(self, mod: ir.Module, name: str, sp: Spec, p: AttentionParams, host: bool,
                 shared: dict):
        self.sp, self.p, self.host = sp, p, host
        self.mod = mod
        nbuf = 3 + sp.has_bias + (4 if sp.bwd else 1)
        # host: the block, the thread, the shared memory and the barrier (a callback)
        extra = [I64, I64, PTR, ir.FunctionType(ir.VoidType(), []).as_pointer()] if host else []
        fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [PTR] * nbuf + extra), name=name)
        fn.attributes.add("nounwind")
        if not host:
            fn.calling_convention = "ptx_kernel"
        self.fn = fn
        self.b = b = ir.IRBuilder(fn.append_basic_block("entry"))
        args = list(fn.args)
        self.q, self.k, self.v = args[:3]
        self.bias = args[3] if sp.has_bias else None
        rest = args[3 + sp.has_bias:nbuf]
        if sp.bwd:
            self.o, self.dout, self.packed, self.ws = rest
        else:
            (self.out,) = rest
        if host:
            self.bid, self.tid = args[nbuf], b.trunc(args[nbuf + 1], I32)
            self._barrier_fn, base, off = args[nbuf + 3], args[nbuf + 2], 0
            self.sh = {}
            for n, size in shared.items():
                self.sh[n] = b.gep(base, [_i(off)], inbounds=True, source_etype=F32)
                off += size
        else:
            self.bid, self.tid = b.zext(_sreg(b, "ctaid.x"), I64), _sreg(b, "tid.x")
            self.sh = {n: self._shared_tile(n, size) for n, size in shared.items()}
        self.tid64 = b.zext(self.tid, I64)

    def _shared_tile(self, n: str, size: int):
        g = ir.GlobalVariable(self.mod, ir.ArrayType(F32, size), f"{self.fn.name}_{n}", addrspace=3)
        g.linkage = "internal"
        g.initializer = ir.Constant(ir.ArrayType(F32, size), ir.Undefined)
        g.align = 16
        return self.b.gep(g, [_i(0, I32), _i(0, I32)], inbounds=True)  # float addrspace(3)*

    # -- memory --
    def at(self, base, i):
        if base.type.is_opaque:
            return self.b.gep(base, [i], inbounds=True, source_etype=F32)
        return self.b.gep(base, [i], inbounds=True)

    def ld(self, base, i):
        return self.b.load(self.at(base, i), typ=F32)

    def st(self, x, base, i):
        self.b.store(x, self.at(base, i))

    def barrier(self):
        if self.host:
            self.b.call(self._barrier_fn, [])
            return
        name = "llvm.nvvm.barrier0"
        f = self.mod.globals.get(name) or ir.Function(self.mod, ir.FunctionType(ir.VoidType(), []), name)
        self.b.call(f, [])

    def _intrinsic(self, dev: str, host: str, x):
        name = host if self.host else dev
        f = self.mod.globals.get(name) or ir.Function(self.mod, ir.FunctionType(F32, [F32]), name)
        return self.b.call(f, [x])

    def exp2(self, x):
        return self._intrinsic("llvm.nvvm.ex2.approx.f32", "llvm.exp2.f32", x)

    def log2(self, x):
        return self._intrinsic("llvm.nvvm.lg2.approx.f", "llvm.log2.f32", x)

    def fmax(self, a, c):
        return self.b.select(self.b.fcmp_ordered(">", a, c), a, c)

    def imin(self, a, c):
        return self.b.select(self.b.icmp_signed("<", a, c), a, c)

    def imax(self, a, c):
        return self.b.select(self.b.icmp_signed(">", a, c), a, c)

    def fma(self, a, x, y):
        name = "llvm.fma.f32"
        f = self.mod.globals.get(name) or ir.Function(self.mod, ir.FunctionType(F32, [F32] * 3), name)
        return self.b.call(f, [a, x, y])

    def loop(self, lo, hi, body, carried=(), step=1):
        return counted_loop(self.b, lo, hi, body, step=step, carried=carried)[0]

    def base(self, t, which: int):
        """Element offset of batch index t in operand `which` (q, k, v, out, bias)."""
        b, sp = self.b, self.sp
        total, inner = _i(0), 1
        for n, s in reversed(list(zip(sp.batch, sp.batch_strides[which]))):
            if s and n > 1:
                total = b.add(total, b.mul(b.urem(b.udiv(t, _i(inner)), _i(n)), _i(s)))
            inner *= n
        return total

    # -- cooperative staging --
    def stage(self, dst, ld, src, base, row_stride, col_stride, rows, cols, valid_rows, valid_cols,
              fill=0.0, by_column=False):
        """dst[r*ld + c] = src[base + r*row_stride + c*col_stride] for r < valid_rows and
        c < valid_cols (i64 values or ints), else `fill`; the block's threads share the
        elements, consecutive threads along c (or along r with by_column) so reads coalesce."""
        b, T = self.b, self.p.threads
        valid_rows, valid_cols = (_i(x) if isinstance(x, int) else x for x in (valid_rows, valid_cols))

        def elem(x, _):
            x32 = b.trunc(x, I32)
            if by_column:
                r, c = b.urem(x32, _i(rows, I32)), b.udiv(x32, _i(rows, I32))
            else:
                r, c = b.udiv(x32, _i(cols, I32)), b.urem(x32, _i(cols, I32))
            r, c = b.zext(r, I64), b.zext(c, I64)
            ok = b.and_(b.icmp_signed("<", r, valid_rows), b.icmp_signed("<", c, valid_cols))
            with b.if_else(ok) as (then, other):
                with then:
                    at = b.add(base, b.add(b.mul(r, _i(row_stride)), b.mul(c, _i(col_stride))))
                    self.st(self.ld(src, at), dst, b.add(b.mul(r, _i(ld)), c))
                with other:
                    self.st(_f(fill), dst, b.add(b.mul(r, _i(ld)), c))
        self.loop(self.tid64, _i(rows * cols), elem, step=T)

    def dots(self, own, own_ld, n, tile, tile_ld, count):
        """[Σ_c own[tid*own_ld + c] · tile[j*tile_ld + c] for j < count], a loop over c: the
        thread's own value read once per c, the tile's values the same for every thread (a
        shared-memory broadcast)."""
        b = self.b
        row = b.mul(self.tid64, _i(own_ld))

        def feature(c, acc):
            x = self.ld(own, b.add(row, c))
            return [self.fma(x, self.ld(tile, b.add(c, _i(j * tile_ld))), a) for j, a in enumerate(acc)]
        return self.loop(_i(0), _i(n), feature, [_f(0)] * count)

    def axpy(self, acc, weights, scratch, tile, tile_ld):
        """acc[c] + Σ_j weights[j] · tile[j*tile_ld + c], a loop over j: the weights go through
        the thread's row of `scratch` (registers cannot be indexed by the loop)."""
        b, ld = self.b, self.p.tile + 1
        row = b.mul(self.tid64, _i(ld))
        for j, w in enumerate(weights):
            self.st(w, scratch, b.add(row, _i(j)))

        def key(j, acc):
            w = self.ld(scratch, b.add(row, j))
            at = b.mul(j, _i(tile_ld))
            return [self.fma(w, self.ld(tile, b.add(at, _i(c))), a) for c, a in enumerate(acc)]
        return self.loop(_i(0), _i(len(weights)), key, list(acc))

    def logits(self, s, bias_tile, limit_of, first):
        """u_j = (s_j·scale + bias)·log2 e, -inf where index first + j is past limit_of(j)."""
        b, sp, B = self.b, self.sp, self.p.tile
        out = []
        brow = self.b.mul(self.tid64, _i(B + 1))
        for j, x in enumerate(s):
            x = b.fmul(x, _f(sp.scale))
            if bias_tile is not None:
                x = b.fadd(x, self.ld(bias_tile, b.add(brow, _i(j))))
            x = b.fmul(x, _f(LOG2E))
            out.append(b.select(limit_of(b.add(first, _i(j))), x, _f(-math.inf)))
        return out


def _row_limit(g: _Kernel, i):
    """One past the last key query i sees."""
    sp = g.sp
    if not sp.causal:
        return _i(sp.sk)
    return g.imin(_i(sp.sk), g.b.add(i, _i(sp.offset + 1)))


def _query_block(g: _Kernel):
    """(t, i0, i, rows valid, key end) of a query-row kernel."""
    b, sp, T = g.b, g.sp, g.p.threads
    nqb = -(-sp.sq // T)
    t, i0 = b.udiv(g.bid, _i(nqb)), b.mul(b.urem(g.bid, _i(nqb)), _i(T))
    nq = g.imin(_i(T), b.sub(_i(sp.sq), i0))
    kend = g.imax(_row_limit(g, b.add(i0, b.sub(nq, _i(1)))), _i(0))
    return t, i0, b.add(i0, g.tid64), nq, kend


def _stage_keys(g: _Kernel, t, i0, nq, j0, names):
    """Stage key tile j0: K (rows of D), V (rows of Dv), and the bias rows of the block's
    queries (padded)."""
    sp, B, T = g.sp, g.p.tile, g.p.threads
    nk = g.imin(_i(B), g.b.sub(_i(sp.sk), j0))
    for n in names:
        src, which, width, rs = {"K": (g.k, 1, sp.d, sp.rows[1]), "V": (g.v, 2, sp.dv, sp.rows[2])}[n]
        g.stage(g.sh[n], width, src, g.b.add(g.base(t, which), g.b.mul(j0, _i(rs))), rs, 1,
                B, width, nk, width)
    if sp.has_bias:
        at = g.b.add(g.base(t, 4), g.b.add(g.b.mul(i0, _i(sp.bias_strides[0])),
                                          g.b.mul(j0, _i(sp.bias_strides[1]))))
        g.stage(g.sh["B"], B + 1, g.bias, at, sp.bias_strides[0], sp.bias_strides[1], T, B, nq, nk)


def _online_softmax(g: _Kernel, u, m, l):
    """New (m, l, alpha, p) after the tile's logits u."""
    b = g.b
    mx = u[0]
    for x in u[1:]:
        mx = g.fmax(mx, x)
    m_new = g.fmax(m, mx)
    ms = b.select(b.fcmp_ordered("==", m_new, _f(-math.inf)), _f(0), m_new)
    alpha = g.exp2(b.fsub(m, ms))
    p = [g.exp2(b.fsub(x, ms)) for x in u]
    total = p[0]
    for x in p[1:]:
        total = b.fadd(total, x)
    return m_new, b.fadd(b.fmul(l, alpha), total), alpha, p


def _forward(g: _Kernel):
    b, sp, B = g.b, g.sp, g.p.tile
    t, i0, i, nq, kend = _query_block(g)
    row_ok = b.icmp_signed("<", i, _i(sp.sq))
    limit = _row_limit(g, i)
    g.stage(g.sh["Q"], sp.d + 1, g.q, b.add(g.base(t, 0), b.mul(i0, _i(sp.rows[0]))), sp.rows[0], 1,
            g.p.threads, sp.d, nq, sp.d)

    def tile(j0, carried):
        m, l, o = carried[0], carried[1], carried[2:]
        g.barrier()
        _stage_keys(g, t, i0, nq, j0, ("K", "V"))
        g.barrier()
        s = g.dots(g.sh["Q"], sp.d + 1, sp.d, g.sh["K"], sp.d, B)
        u = g.logits(s, g.sh.get("B"), lambda j: b.icmp_signed("<", j, limit), j0)
        m, l, alpha, p = _online_softmax(g, u, m, l)
        o = g.axpy([b.fmul(x, alpha) for x in o], p, g.sh["P"], g.sh["V"], sp.dv)
        return [m, l, *o]
    _, l, *o = g.loop(_i(0), kend, tile, [_f(-math.inf), _f(0)] + [_f(0)] * sp.dv, step=B)
    pos = b.fcmp_ordered(">", l, _f(0))
    inv = b.select(pos, b.fdiv(_f(1), b.select(pos, l, _f(1))), _f(0))
    with b.if_then(row_ok):
        row = b.add(g.base(t, 3), b.mul(i, _i(sp.rows[3])))
        for c, x in enumerate(o):
            g.st(b.fmul(x, inv), g.out, b.add(row, _i(c)))
    b.ret_void()


def _dq(g: _Kernel):
    b, sp, B, T = g.b, g.sp, g.p.tile, g.p.threads
    t, i0, i, nq, kend = _query_block(g)
    row_ok = b.icmp_signed("<", i, _i(sp.sq))
    limit = _row_limit(g, i)
    visible = lambda j: b.icmp_signed("<", j, limit)
    qb, ob = g.base(t, 0), g.base(t, 3)
    g.stage(g.sh["Q"], sp.d + 1, g.q, b.add(qb, b.mul(i0, _i(sp.rows[0]))), sp.rows[0], 1, T, sp.d, nq, sp.d)
    g.stage(g.sh["dO"], sp.dv + 1, g.dout, b.add(ob, b.mul(i0, _i(sp.rows[3]))), sp.rows[3], 1, T, sp.dv,
            nq, sp.dv)
    g.barrier()

    def stats(j0, carried):  # sweep 1: each row's max and sum
        g.barrier()
        _stage_keys(g, t, i0, nq, j0, ("K",))
        g.barrier()
        u = g.logits(g.dots(g.sh["Q"], sp.d + 1, sp.d, g.sh["K"], sp.d, B), g.sh.get("B"), visible, j0)
        m, l, _, _ = _online_softmax(g, u, *carried)
        return [m, l]
    m, l = g.loop(_i(0), kend, stats, [_f(-math.inf), _f(0)], step=B)
    pos = b.fcmp_ordered(">", l, _f(0))
    lse = b.select(pos, b.fadd(m, g.log2(b.select(pos, l, _f(1)))), _f(math.inf))  # +inf: P = 0
    # D_i = dO_i · O_i (rows past the end read the last row: never stored)
    i_in = g.imin(i, _i(sp.sq - 1))
    orow, drow = b.add(ob, b.mul(i_in, _i(sp.rows[3]))), b.mul(g.tid64, _i(sp.dv + 1))
    di = _f(0)
    for c in range(sp.dv):
        di = g.fma(g.ld(g.sh["dO"], b.add(drow, _i(c))), g.ld(g.o, b.add(orow, _i(c))), di)
    with b.if_then(row_ok):
        at = b.add(b.mul(t, _i(sp.sq)), i)
        g.st(lse, g.ws, at)
        g.st(di, g.ws, b.add(at, _i(sp.nb * sp.sq)))

    def grads(j0, dq):  # sweep 2: dS and dQ
        g.barrier()
        _stage_keys(g, t, i0, nq, j0, ("K", "V"))
        g.barrier()
        u = g.logits(g.dots(g.sh["Q"], sp.d + 1, sp.d, g.sh["K"], sp.d, B), g.sh.get("B"), visible, j0)
        dp = g.dots(g.sh["dO"], sp.dv + 1, sp.dv, g.sh["V"], sp.dv, B)
        ds = [b.fmul(b.fmul(g.exp2(b.fsub(x, lse)), b.fsub(y, di)), _f(sp.scale)) for x, y in zip(u, dp)]
        return g.axpy(dq, ds, g.sh["P"], g.sh["K"], sp.d)
    dq = g.loop(_i(0), kend, grads, [_f(0)] * sp.d, step=B)
    with b.if_then(row_ok):
        row = b.add(qb, b.mul(i, _i(sp.rows[0])))
        for c, x in enumerate(dq):
            g.st(x, g.packed, b.add(row, _i(c)))
    b.ret_void()


def _dkdv(g: _Kernel):
    b, sp, B, T = g.b, g.sp, g.p.tile, g.p.threads
    nkb = -(-sp.sk // T)
    t, j0 = b.udiv(g.bid, _i(nkb)), b.mul(b.urem(g.bid, _i(nkb)), _i(T))
    j = b.add(j0, g.tid64)
    nk = g.imin(_i(T), b.sub(_i(sp.sk), j0))
    qb, kb, vb, ob = (g.base(t, w) for w in range(4))
    g.stage(g.sh["K"], sp.d + 1, g.k, b.add(kb, b.mul(j0, _i(sp.rows[1]))), sp.rows[1], 1, T, sp.d, nk, sp.d)
    g.stage(g.sh["V"], sp.dv + 1, g.v, b.add(vb, b.mul(j0, _i(sp.rows[2]))), sp.rows[2], 1, T, sp.dv,
            nk, sp.dv)
    g.barrier()
    if sp.causal:  # query i sees key j when j <= i + offset: the first tile that sees key j0
        visible = lambda i: b.icmp_signed("<=", j, b.add(i, _i(sp.offset)))
        first = b.mul(b.udiv(g.imax(b.sub(j0, _i(sp.offset)), _i(0)), _i(B)), _i(B))
    else:
        visible = lambda i: ir.Constant(ir.IntType(1), 1)
        first = _i(0)
    lse_at, d_at = b.mul(t, _i(sp.sq)), b.add(b.mul(t, _i(sp.sq)), _i(sp.nb * sp.sq))

    def tile(i0, carried):
        dk, dv = carried[:sp.d], carried[sp.d:]
        nq = g.imin(_i(B), b.sub(_i(sp.sq), i0))
        g.barrier()
        g.stage(g.sh["Qt"], sp.d, g.q, b.add(qb, b.mul(i0, _i(sp.rows[0]))), sp.rows[0], 1, B, sp.d, nq, sp.d)
        g.stage(g.sh["dOt"], sp.dv, g.dout, b.add(ob, b.mul(i0, _i(sp.rows[3]))), sp.rows[3], 1, B, sp.dv,
                nq, sp.dv)
        g.stage(g.sh["L"], 1, g.ws, b.add(lse_at, i0), 1, 0, B, 1, nq, 1, fill=math.inf)
        g.stage(g.sh["D"], 1, g.ws, b.add(d_at, i0), 1, 0, B, 1, nq, 1)
        if sp.has_bias:  # transposed: a row per key, consecutive threads along the keys
            at = b.add(g.base(t, 4), b.add(b.mul(i0, _i(sp.bias_strides[0])),
                                          b.mul(j0, _i(sp.bias_strides[1]))))
            g.stage(g.sh["B"], B + 1, g.bias, at, sp.bias_strides[1], sp.bias_strides[0], T, B, nk, nq,
                    by_column=True)
        g.barrier()
        u = g.logits(g.dots(g.sh["K"], sp.d + 1, sp.d, g.sh["Qt"], sp.d, B), g.sh.get("B"), visible, i0)
        dp = g.dots(g.sh["V"], sp.dv + 1, sp.dv, g.sh["dOt"], sp.dv, B)
        p = [g.exp2(b.fsub(x, g.ld(g.sh["L"], _i(ii)))) for ii, x in enumerate(u)]
        ds = [b.fmul(b.fmul(x, b.fsub(y, g.ld(g.sh["D"], _i(ii)))), _f(sp.scale))
              for ii, (x, y) in enumerate(zip(p, dp))]
        return g.axpy(dk, ds, g.sh["S"], g.sh["Qt"], sp.d) + g.axpy(dv, p, g.sh["P"], g.sh["dOt"], sp.dv)
    acc = g.loop(first, _i(sp.sq), tile, [_f(0)] * (sp.d + sp.dv), step=B)
    with b.if_then(b.icmp_signed("<", j, _i(sp.sk))):
        for off, base, rs, vals in ((sp.sizes[0], kb, sp.rows[1], acc[:sp.d]),
                                    (sp.sizes[0] + sp.sizes[1], vb, sp.rows[2], acc[sp.d:])):
            row = b.add(_i(off), b.add(base, b.mul(j, _i(rs))))
            for c, x in enumerate(vals):
                g.st(x, g.packed, b.add(row, _i(c)))
    b.ret_void()


def _shared(sp: Spec, p: AttentionParams, which: str) -> dict:
    """The shared tiles of one kernel (which: a suffix of `launches`): name -> floats. The
    thread-owned rows (Q, dO; K, V in dkdv; P, S; the bias) are padded by one float."""
    t, b = p.threads, p.tile
    rows = {"P": t * (b + 1), **({"B": t * (b + 1)} if sp.has_bias else {})}
    if which == "":
        return {"Q": t * (sp.d + 1), "K": b * sp.d, "V": b * sp.dv, **rows}
    if which == "_dq":
        return {"Q": t * (sp.d + 1), "dO": t * (sp.dv + 1), "K": b * sp.d, "V": b * sp.dv, **rows}
    return {"K": t * (sp.d + 1), "V": t * (sp.dv + 1), "Qt": b * sp.d, "dOt": b * sp.dv, "L": b,
            "D": b, "S": t * (b + 1), **rows}


BODIES = {"": _forward, "_dq": _dq, "_dkdv": _dkdv}


def render(sp: Spec, p: AttentionParams, name: str, host: bool = False) -> str:
    """The LLVM IR of the template's kernels (functions name + suffix of `launches`): NVPTX, or
    with host=True the same algorithm for the CPU."""
    mod = ir.Module(name=name)
    if not host:
        mod.triple = TRIPLE
    for suffix, _, _ in launches(sp, p):
        BODIES[suffix](_Kernel(mod, name + suffix, sp, p, host, _shared(sp, p, suffix)))
    return str(mod)


# ---- building and launching ------------------------------------------------------------------

_ptx: dict = {}  # (name, sm) -> PTX


class _Launch:
    """run(buffers): the template's kernels launched in order on the device's stream, the
    backward's workspace (lse and D per row) from the pool. `source` is the PTX."""

    def __init__(self, backend, device, source: str, names, grids, block: int, ws_bytes: int):
        self.backend, self.device, self.source = backend, device, source
        self._names, self._grids, self._block, self._ws_bytes = names, grids, block, ws_bytes
        self._fns = None

    def _functions(self, ctx):
        module, first = ctx.load_module(self.source, self._names[0])
        fns = [first]
        for n in self._names[1:]:
            fn = ctypes.c_void_p()
            driver.call("cuModuleGetFunction", ctypes.byref(fn), module, n.encode())
            fns.append(fn)
        self._module = module
        return fns

    def __call__(self, buffers):
        ctx = self.backend.context(self.device)
        if self._fns is None:
            self._fns = self._functions(ctx)
        ws = self.backend.alloc(self._ws_bytes, self.device) if self._ws_bytes else None
        ptrs = [b.ptr for b in buffers] + ([ws.ptr] if ws is not None else [])
        try:
            for fn, grid in zip(self._fns, self._grids):
                if grid:
                    ctx.launch(fn, grid, self._block, ptrs)
        finally:
            if ws is not None:  # later users of the block run after these on the same stream
                self.backend.free(ws, self.device)


def build(kernel, device, backend, params: AttentionParams | None = None):
    """run(buffers): the FlashAttention kernels of the template kernel's equation."""
    (eqn,) = kernel.meta["eqns"]
    sp = spec_of(eqn)
    info = backend.info_of(device)
    p = params or default_params(info, sp)
    why = p.check(info, sp) if p is not None else "no block size fits the shared memory"
    if why:
        raise CompileError(f"CUDA attention cannot build {kernel.name}: {why}", kernel=str(kernel))
    sm = info.extra.get("sm", "sm_80")
    name = "tf_attn_" + hashlib.sha1(repr((sp, p)).encode()).hexdigest()[:16]
    ptx = _ptx.get((name, sm))
    if ptx is None:
        ptx = _ptx[(name, sm)] = to_ptx(render(sp, p, name), sm)
    plan = launches(sp, p)
    return _Launch(backend, device, ptx, [name + s for s, _, _ in plan], [g for _, g, _ in plan],
                   p.threads, 4 * 2 * sp.nb * sp.sq if sp.bwd else 0)


# ---- the tuner's view --------------------------------------------------------------------------
# Every configuration is a compile; AttentionParams.check prunes what the device cannot hold.

def _space(kernel, device) -> dict:
    return {"threads": (32, 64, 128), "tile": (8, 16, 32, 64)}


def _default(kernel, device) -> dict:
    return asdict(default_params(device.info, spec_of(kernel.meta["eqns"][0])))


def _check(params: dict, kernel, device) -> str | None:
    return AttentionParams(**params).check(device.info, spec_of(kernel.meta["eqns"][0]))


def _build(kernel, device, backend, params: dict):
    return build(kernel, device, backend, AttentionParams(**params))


tuner.register(tuner.Template("cuda_attention", "flash_attention", ("cuda",), _space, _default, _build,
                              _check, lambda kernel: tuning_key(kernel, "cuda"), applies))
