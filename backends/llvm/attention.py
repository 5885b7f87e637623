"""FlashAttention on the CPU: fused_attention and fused_attention_bwd as LLVM IR generated with
llvmlite, explicitly vectorised (16 float32 lanes: one AVX-512 register).

Forward (one task per (batch, block of bq queries), spread over the cores by the thread pool;
ctypes releases the GIL): the queries' tile is copied once; for each block of bk keys, kᵀ and
v are packed into small tiles, the scores S = q kᵀ of the block come from a register-blocked
micro-kernel (r rows x bk/16 vectors of accumulators, FMA over the head dimension), the online
softmax updates each row's running max m and sum l and rescales the output accumulator by
exp(m_old - m_new), and O += P v is a second micro-kernel (r rows x up to `chunk` vectors along v's
features). The S x S scores are never stored: a task holds one bq x bk block. Causal masking
stops each query block at its last visible key block.

Backward (one task per batch index, i.e. per head, so dK and dV need no atomics): a first pass
recomputes each row's log-sum-exp and D_i = dO_i·O_i; then for each key block, every query block
that sees it recomputes P = exp(S - lse), and dV += Pᵀ dO, dP = dO vᵀ, dS = P (dP - D) scale,
dQ += dS k (accumulated in a float32 workspace of Sq x D per head), dK += dSᵀ q.

The blocks (AttentionParams: bq, bk, r, chunk) are compiled in; the auto-tuner searches them
(backends/llvm/tuning.py). Kernels are specialised per shape, layout and blocks (constants in the
code) and cached like every other kernel (in memory and on disk). Operands may have any layout
whose feature axis is the last (contiguous): per-batch base offsets (Spec.batch_offsets, ir/kernel/
attention.py) are a constant table, rows a constant stride."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llvmlite.ir as ir
import numpy as np

from tilefuse.ir import primitives as P
from tilefuse.ir.kernel.attention import Spec, spec_of
from tilefuse.ir.errors import CompileError
from tilefuse.runtime import compile_cache, tuner

from tilefuse.backends.llvmir import vecmath
from tilefuse.backends.llvmir.irutil import counted_loop
from .compile import code_digest, KernelFn, get_pool, get_target
from tilefuse.backends.llvmir.vecmath import F32, I32, I64, Emit

LANES = 16  # float32 lanes of one AVX-512 register
MAX_HEAD_DIM = 256  # the tiles live on the stack: ~0.6 MiB at this width with the default blocks
STACK_BYTES = 1 << 20  # the most the tiles may take (threads get 2 MiB of stack or more)
VEC = ir.VectorType(F32, LANES)
IVEC = ir.VectorType(I32, LANES)
MVEC = ir.VectorType(ir.IntType(1), LANES)
PTR = ir.PointerType()
F32_NP = np.dtype(np.float32)


def _pad(n: int) -> int:
    return -(-n // LANES) * LANES


def shape_class(sp: Spec) -> tuple:
    """Kernels that run alike (the tuning database's granularity): batch and sequence lengths
    bucketed to powers of two, the features padded to whole vectors."""
    return (*map(tuner.size_class, (sp.nb, sp.sq, sp.sk)), _pad(sp.d), _pad(sp.dv))


def kernel_spec(kernel) -> Spec:
    """The Spec of a template kernel, kept in its meta (the build and the tuner both ask)."""
    if "attention_spec" not in kernel.meta:
        (eqn,) = kernel.meta["eqns"]
        kernel.meta["attention_spec"] = spec_of(eqn)
    return kernel.meta["attention_spec"]


@dataclass(frozen=True)
class AttentionParams:
    """The blocking, compiled into the kernel (part of its cache key); the auto-tuner searches it
    (backends/llvm/tuning.py)."""
    bq: int = 128   # queries per block (a forward task)
    bk: int = 64    # keys per block: a multiple of LANES
    r: int = 4      # rows per register block (queries; keys in the backward's transposed products)
    chunk: int = 4  # vectors along the features per register block

    def invalid(self, sp: Spec) -> str | None:
        """Why these blocks cannot build the kernel sp, or None: register blocks must tile the
        blocks exactly (the micro-kernels run whole register blocks inside the tiles), and the
        tiles must fit the stack."""
        if min(self.bq, self.bk, self.r, self.chunk) < 1:
            return "every block size must be positive"
        if self.bk % LANES:
            return f"bk={self.bk} is not a multiple of {LANES} lanes"
        if self.bq % self.r or self.bk % self.r:
            return f"r={self.r} does not divide bq={self.bq} and bk={self.bk}"
        need = 4 * sum(tiles(sp, self).values())
        if need > STACK_BYTES:
            return f"the tiles take {need >> 10} KiB of stack, over {STACK_BYTES >> 10} KiB"
        return None


def tiles(sp: Spec, p: AttentionParams) -> dict:
    """The stack tiles a kernel allocates: name -> float32 elements."""
    dp, dvp = _pad(sp.d), _pad(sp.dv)
    bq, bk = p.bq, p.bk
    both = {"q": bq * dp, "kT": sp.d * bk, "s": bq * bk, "m": bq, "l": bq, "alpha": bq}
    if not sp.bwd:
        return {**both, "v": bk * dvp, "o": bq * dvp}
    return {**both, "dO": bq * dvp, "vT": sp.dv * bk, "k": bk * dp, "dP": bq * bk, "dK": bk * dp,
            "dV": bk * dvp}


def applies(kernel, device) -> bool:
    """float32 operands whose feature axis is the last one (contiguous), heads up to 256 wide."""
    eqns = kernel.meta.get("eqns", ())
    if len(eqns) != 1 or eqns[0].prim not in (P.fused_attention, P.fused_attention_bwd):
        return False
    e = eqns[0]
    dims = e.params["dims"]
    ops = e.inputs[:3]
    return (all(a.aval.dtype == F32_NP for a in e.inputs) and
            all(d[-1] == a.aval.ndim - 1 for d, a in zip(dims, ops)) and
            all(a.aval.size > 0 for a in e.inputs) and
            max(a.aval.shape[-1] for a in ops) <= MAX_HEAD_DIM)


# ---- IR generation ---------------------------------------------------------------------------

def _i64(n):
    return ir.Constant(I64, int(n))


def _i32(n):
    return ir.Constant(I32, int(n))


def _f32(x):
    return ir.Constant(F32, float(x))


class _Gen:
    """Builds one kernel function; small helpers keep the algorithm readable."""

    def __init__(self, spec: Spec, params: AttentionParams, fn_name: str):
        self.s, self.p = spec, params
        self.mod = ir.Module(name=fn_name)
        fn = ir.Function(self.mod, ir.FunctionType(ir.VoidType(), [PTR, I64, I64]), name=fn_name)
        fn.attributes.add("nounwind")
        self.fn = fn
        self.entry = fn.append_basic_block("entry")
        self.b = ir.IRBuilder(self.entry)
        self.em = Emit(self.b)
        bufs = fn.args[0]
        # q, k, v, [bias], out; the backward: dout, packed (dq, dk, dv), then its workspace
        n = 3 + spec.has_bias + (4 if spec.bwd else 1)
        self.ptr = [self.b.load(self.b.gep(bufs, [_i64(i)], inbounds=True, source_etype=PTR), typ=PTR)
                    for i in range(n)]
        table = ir.GlobalVariable(self.mod, ir.ArrayType(I64, 5 * spec.nb), name="base")
        table.global_constant = True
        table.linkage = "internal"
        table.initializer = ir.Constant(ir.ArrayType(I64, 5 * spec.nb),
                                        [_i64(x) for row in spec.batch_offsets for x in row])
        self.table = table
        self.lane = ir.Constant(IVEC, list(range(LANES)))

    # -- scalars and vectors --
    def alloca(self, n: int):
        with self.b.goto_block(self.entry):
            self.b.position_at_start(self.entry)
            return self.b.alloca(F32, size=_i64(n))

    def at(self, ptr, i):
        return self.b.gep(ptr, [i], inbounds=True, source_etype=F32)

    def ld(self, ptr, i):
        return self.b.load(self.at(ptr, i), typ=F32)

    def st(self, v, ptr, i):
        self.b.store(v, self.at(ptr, i))

    def at_vec(self, ptr, i):
        # stack tiles come as typed pointers (float*): cast for vector access (a no-op in LLVM)
        p = self.at(ptr, i)
        return p if p.type.is_opaque else self.b.bitcast(p, ir.PointerType(VEC))

    def vld(self, ptr, i):
        return self.b.load(self.at_vec(ptr, i), typ=VEC, align=4)

    def vst(self, v, ptr, i):
        self.b.store(v, self.at_vec(ptr, i), align=4)

    def masked_vld(self, ptr, i, mask):
        name = "llvm.masked.load.v16f32.p0"
        fn = self.mod.globals.get(name) or ir.Function(
            self.mod, ir.FunctionType(VEC, [PTR, I32, MVEC, VEC]), name=name)
        return self.b.call(fn, [self.at(ptr, i), _i32(4), mask, ir.Constant(VEC, [0.0] * LANES)])

    def splat(self, x):
        v = self.b.insert_element(ir.Constant(VEC, ir.Undefined), x, _i32(0))
        return self.b.shuffle_vector(v, ir.Constant(VEC, ir.Undefined), ir.Constant(IVEC, [0] * LANES))

    def vconst(self, x):
        return ir.Constant(VEC, [float(x)] * LANES)

    def horizontal(self, v, op):
        """op over the 16 lanes in 4 shuffle steps (a tree, not a serial chain)."""
        for w in (8, 4, 2, 1):
            sh = self.b.shuffle_vector(v, ir.Constant(VEC, ir.Undefined),
                                       ir.Constant(IVEC, [(i + w) % LANES for i in range(LANES)]))
            v = op(v, sh)
        return self.b.extract_element(v, _i32(0))

    def vmax(self, a, c):
        return self.b.select(self.b.fcmp_ordered(">", a, c), a, c)

    def imin(self, a, c):
        return self.b.select(self.b.icmp_signed("<", a, c), a, c)

    def imax(self, a, c):
        return self.b.select(self.b.icmp_signed(">", a, c), a, c)

    def base(self, t, which: int):
        p = self.b.gep(self.table, [_i64(0), self.b.add(self.b.mul(t, _i64(5)), _i64(which))],
                       inbounds=True, source_etype=self.table.value_type)
        return self.b.load(p, typ=I64)

    # -- control flow --
    def loop(self, lo, hi, body, carried=(), step=1):
        """for i in range(lo, hi, step): carried = body(i, carried); returns the final values."""
        return counted_loop(self.b, lo, hi, body, step=step, carried=carried)[0]

    # -- tiles --
    def load_tile(self, dst, ld, rows, cols, src, base, row_stride, valid_rows, valid_cols,
                  transpose=False):
        """dst[r, c] (dst[c, r] when transposed) = src[base + r*row_stride + c] inside the valid
        rows/columns, else 0. A full tile is a plain copy (vectors when not transposed); a tile
        at an edge clamps its reads into the valid region, so they stay in bounds."""
        if valid_cols != cols:
            return self._load_edge_tile(dst, ld, rows, cols, src, base, row_stride, valid_rows,
                                        valid_cols, transpose)
        b = self.b
        with b.if_else(b.icmp_signed("==", valid_rows, _i64(rows))) as (full, edge):
            with full:
                self._copy_tile(dst, ld, rows, cols, src, base, row_stride, transpose)
            with edge:
                self._load_edge_tile(dst, ld, rows, cols, src, base, row_stride, valid_rows,
                                     valid_cols, transpose)

    def _copy_tile(self, dst, ld, rows, cols, src, base, row_stride, transpose):
        b = self.b
        vectors = not transpose and cols % LANES == 0

        def row(r, _):
            rbase = b.add(base, b.mul(r, _i64(row_stride)))

            def col(c, _):
                if vectors:
                    self.vst(self.vld(src, b.add(rbase, c)), dst, b.add(b.mul(r, _i64(ld)), c))
                else:
                    at = b.add(b.mul(c, _i64(ld)), r) if transpose else b.add(b.mul(r, _i64(ld)), c)
                    self.st(self.ld(src, b.add(rbase, c)), dst, at)
            self.loop(_i64(0), _i64(cols), col, step=LANES if vectors else 1)
        self.loop(_i64(0), _i64(rows), row)

    def _load_edge_tile(self, dst, ld, rows, cols, src, base, row_stride, valid_rows, valid_cols,
                        transpose):
        b = self.b
        last_row = self.imax(b.sub(valid_rows, _i64(1)), _i64(0))

        def row(r, _):
            rr = self.imin(r, last_row)
            ok_r = b.icmp_signed("<", r, valid_rows)
            rbase = b.add(base, b.mul(rr, _i64(row_stride)))

            def col(c, _):
                cc = self.imin(c, _i64(valid_cols - 1))
                ok = b.and_(ok_r, b.icmp_signed("<", c, _i64(valid_cols)))
                x = b.select(ok, self.ld(src, b.add(rbase, cc)), _f32(0))
                at = b.add(b.mul(c, _i64(ld)), r) if transpose else b.add(b.mul(r, _i64(ld)), c)
                self.st(x, dst, at)
            self.loop(_i64(0), _i64(cols), col)
        self.loop(_i64(0), _i64(rows), row)

    def store_tile(self, src, ld, dst, base, row_stride, rows, cols, scale_of=None):
        """dst[base + r*row_stride + c] = src[r*ld + c] (times scale_of(r)) for r < rows, c < cols."""
        b = self.b

        def row(r, _):
            f = scale_of(r) if scale_of else None
            rbase = b.add(base, b.mul(r, _i64(row_stride)))

            def col(c, _):
                x = self.ld(src, b.add(b.mul(r, _i64(ld)), c))
                self.st(b.fmul(x, f) if f is not None else x, dst, b.add(rbase, c))
            self.loop(_i64(0), _i64(cols), col)
        self.loop(_i64(0), rows, row)

    def zero(self, ptr, n: int):
        self.loop(_i64(0), _i64(n // LANES), lambda i, _: self.vst(
            self.vconst(0), ptr, self.b.mul(i, _i64(LANES))))

    # -- micro-kernels --
    def mm_abt(self, out, a, lda, bt, n_red, rows):
        """out[r, 0:bk] = Σ_d a[r, d] bt[d, 0:bk] for the register blocks covering `rows` rows."""
        b = self.b
        nv = self.p.bk // LANES
        groups = b.sdiv(b.add(rows, _i64(self.p.r - 1)), _i64(self.p.r))

        def group(g, _):
            r0 = b.mul(g, _i64(self.p.r))
            arow = [b.mul(b.add(r0, _i64(r)), _i64(lda)) for r in range(self.p.r)]

            def red(d, acc):
                brow = b.mul(d, _i64(self.p.bk))
                bv = [self.vld(bt, b.add(brow, _i64(c * LANES))) for c in range(nv)]
                out_acc = []
                for r in range(self.p.r):
                    x = self.splat(self.ld(a, b.add(arow[r], d)))
                    out_acc += [self.em.fma(x, bv[c], acc[r * nv + c]) for c in range(nv)]
                return out_acc
            acc = self.loop(_i64(0), _i64(n_red), red, [self.vconst(0)] * (self.p.r * nv))
            for r in range(self.p.r):
                orow = b.mul(b.add(r0, _i64(r)), _i64(self.p.bk))
                for c in range(nv):
                    self.vst(acc[r * nv + c], out, b.add(orow, _i64(c * LANES)))
        self.loop(_i64(0), groups, group)

    def mm_acc(self, out, ldo, p, x, ldx, width, nk, rows, alpha=None):
        """out[r, :width] = alpha[r]·out[r] + Σ_{j<nk} p[r, j] x[j, :width] (width padded to 16s)."""
        b = self.b
        groups = b.sdiv(b.add(rows, _i64(self.p.r - 1)), _i64(self.p.r))

        def group(g, _):
            r0 = b.mul(g, _i64(self.p.r))
            orow = [b.mul(b.add(r0, _i64(r)), _i64(ldo)) for r in range(self.p.r)]
            prow = [b.mul(b.add(r0, _i64(r)), _i64(self.p.bk)) for r in range(self.p.r)]
            for c0 in range(0, width // LANES, self.p.chunk):
                nv = min(self.p.chunk, width // LANES - c0)
                acc = []
                for r in range(self.p.r):
                    f = self.splat(self.ld(alpha, b.add(r0, _i64(r)))) if alpha is not None else None
                    for c in range(nv):
                        v = self.vld(out, b.add(orow[r], _i64((c0 + c) * LANES)))
                        acc.append(b.fmul(v, f) if f is not None else v)

                def key(j, acc):
                    xrow = b.mul(j, _i64(ldx))
                    xv = [self.vld(x, b.add(xrow, _i64((c0 + c) * LANES))) for c in range(nv)]
                    new = []
                    for r in range(self.p.r):
                        s = self.splat(self.ld(p, b.add(prow[r], j)))
                        new += [self.em.fma(s, xv[c], acc[r * nv + c]) for c in range(nv)]
                    return new
                acc = self.loop(_i64(0), nk, key, acc)
                for r in range(self.p.r):
                    for c in range(nv):
                        self.vst(acc[r * nv + c], out, b.add(orow[r], _i64((c0 + c) * LANES)))
        self.loop(_i64(0), groups, group)

    def mm_atb(self, acc_ptr, p, x, width, nk, rows):
        """acc[j, :width] += Σ_{r<rows} p[r, j] x[r, :width] for j < nk (rounded up to r: register
        blocks of r keys)."""
        b = self.b
        groups = b.sdiv(b.add(nk, _i64(self.p.r - 1)), _i64(self.p.r))

        def group(g, _):
            j0 = b.mul(g, _i64(self.p.r))
            arow = [b.mul(b.add(j0, _i64(j)), _i64(width)) for j in range(self.p.r)]
            for c0 in range(0, width // LANES, self.p.chunk):
                nv = min(self.p.chunk, width // LANES - c0)
                acc = [self.vld(acc_ptr, b.add(arow[j], _i64((c0 + c) * LANES)))
                       for j in range(self.p.r) for c in range(nv)]

                def row(r, acc):
                    xrow = b.mul(r, _i64(width))
                    xv = [self.vld(x, b.add(xrow, _i64((c0 + c) * LANES))) for c in range(nv)]
                    prow = b.add(b.mul(r, _i64(self.p.bk)), j0)
                    new = []
                    for j in range(self.p.r):
                        s = self.splat(self.ld(p, b.add(prow, _i64(j))))
                        new += [self.em.fma(s, xv[c], acc[j * nv + c]) for c in range(nv)]
                    return new
                acc = self.loop(_i64(0), rows, row, acc)
                for j in range(self.p.r):
                    for c in range(nv):
                        self.vst(acc[j * nv + c], acc_ptr, b.add(arow[j], _i64((c0 + c) * LANES)))
        self.loop(_i64(0), groups, group)

    # -- the scores of one row of a block --
    def scores(self, s_tile, r, i, j0, nk, t):
        """Row r (query i) of the block's raw scores: scaled, biased and masked (-inf), as bk/16
        vectors."""
        b, sp = self.b, self.s
        limit = _i64(sp.sk)
        if sp.causal:
            limit = self.imin(limit, b.add(i, _i64(sp.offset + 1)))
        lim = b.trunc(b.sub(limit, j0), I32)
        key_ok = b.trunc(nk, I32)
        bias_row = None
        if sp.has_bias:
            bias_row = b.add(b.add(self.base(t, 4), b.mul(i, _i64(sp.bias_strides[0]))),
                             b.mul(j0, _i64(sp.bias_strides[1])))
        out = []
        for c in range(self.p.bk // LANES):
            lanes = b.add(self.lane, ir.Constant(IVEC, [c * LANES] * LANES))
            v = b.fmul(self.vld(s_tile, b.add(b.mul(r, _i64(self.p.bk)), _i64(c * LANES))),
                       self.vconst(sp.scale))
            if bias_row is not None:
                if sp.bias_strides[1]:
                    mask = b.icmp_signed("<", lanes, self.splat_i(key_ok))
                    v = b.fadd(v, self.masked_vld(self.ptr[3], b.add(bias_row, _i64(c * LANES)), mask))
                else:
                    v = b.fadd(v, self.splat(self.ld(self.ptr[3], bias_row)))
            keep = b.icmp_signed("<", lanes, self.splat_i(lim))
            out.append(b.select(keep, v, self.vconst(-np.inf)))
        return out

    def splat_i(self, x):
        v = self.b.insert_element(ir.Constant(IVEC, ir.Undefined), x, _i32(0))
        return self.b.shuffle_vector(v, ir.Constant(IVEC, ir.Undefined), ir.Constant(IVEC, [0] * LANES))

    def key_end(self, i_last):
        """One past the last key any query up to i_last sees."""
        sp = self.s
        if not sp.causal:
            return _i64(sp.sk)
        return self.imax(self.imin(_i64(sp.sk), self.b.add(i_last, _i64(sp.offset + 1))), _i64(0))

    # -- forward --
    def reset_stats(self, m, l):
        def row(r, _):
            self.st(_f32(-np.inf), m, r)
            self.st(_f32(0), l, r)
        self.loop(_i64(0), _i64(self.p.bq), row)

    def online_softmax_block(self, s_tile, m, l, alpha, i0, j0, nk, rows, t):
        """Scores -> P in place; running max m and sum l per row; alpha = exp(m_old - m_new)."""
        b, em = self.b, self.em

        def row(r, _):
            i = b.add(i0, r)
            vs = self.scores(s_tile, r, i, j0, nk, t)
            mx = vs[0]
            for v in vs[1:]:
                mx = self.vmax(mx, v)
            m_old = self.ld(m, r)
            m_new = self.vmax(m_old, self.horizontal(mx, self.vmax))
            m_safe = b.select(b.fcmp_ordered("==", m_new, _f32(-np.inf)), _f32(0), m_new)
            a = vecmath.exp(em, b.fsub(m_old, m_safe))
            ms = self.splat(m_safe)
            total = None
            for c, v in enumerate(vs):
                p = vecmath.exp(em, b.fsub(v, ms))
                self.vst(p, s_tile, b.add(b.mul(r, _i64(self.p.bk)), _i64(c * LANES)))
                total = p if total is None else b.fadd(total, p)
            rowsum = self.horizontal(total, b.fadd)
            self.st(m_new, m, r)
            self.st(b.fadd(b.fmul(self.ld(l, r), a), rowsum), l, r)
            self.st(a, alpha, r)
        self.loop(_i64(0), rows, row)

    def forward(self):
        b, sp = self.b, self.s
        bq, bk = self.p.bq, self.p.bk
        dp, dvp = _pad(sp.d), _pad(sp.dv)
        nqb = -(-sp.sq // bq)
        tile = {name: self.alloca(n) for name, n in tiles(sp, self.p).items()}
        qt, kt, vp, s_tile, o = (tile[n] for n in ("q", "kT", "v", "s", "o"))
        m, l, alpha = tile["m"], tile["l"], tile["alpha"]
        q, k, v = self.ptr[:3]
        out = self.ptr[3 + sp.has_bias]
        start, end = self.fn.args[1:]
        body = self.b.append_basic_block("tasks")
        self.b.branch(body)
        self.b.position_at_end(body)

        def task(t_, _):
            t = b.sdiv(t_, _i64(nqb))
            i0 = b.mul(b.srem(t_, _i64(nqb)), _i64(bq))
            rows = self.imin(_i64(bq), b.sub(_i64(sp.sq), i0))
            self.load_tile(qt, dp, bq, dp, q, b.add(self.base(t, 0), b.mul(i0, _i64(sp.rows[0]))),
                           sp.rows[0], rows, sp.d)
            self.zero(o, bq * dvp)
            self.reset_stats(m, l)
            kend = self.key_end(b.add(i0, b.sub(rows, _i64(1))))

            def block(j0, _):
                nk = self.imin(_i64(bk), b.sub(kend, j0))
                self.load_tile(kt, bk, bk, sp.d, k, b.add(self.base(t, 1), b.mul(j0, _i64(sp.rows[1]))),
                               sp.rows[1], nk, sp.d, transpose=True)
                self.load_tile(vp, dvp, bk, dvp, v, b.add(self.base(t, 2), b.mul(j0, _i64(sp.rows[2]))),
                               sp.rows[2], nk, sp.dv)
                self.mm_abt(s_tile, qt, dp, kt, sp.d, rows)
                self.online_softmax_block(s_tile, m, l, alpha, i0, j0, nk, rows, t)
                self.mm_acc(o, dvp, s_tile, vp, dvp, dvp, nk, rows, alpha)
            self.loop(_i64(0), kend, block, step=bk)

            def inv(r):
                tot = self.ld(l, r)
                pos = b.fcmp_ordered(">", tot, _f32(0))
                return b.select(pos, b.fdiv(_f32(1), b.select(pos, tot, _f32(1))), _f32(0))
            self.store_tile(o, dvp, out, b.add(self.base(t, 3), b.mul(i0, _i64(sp.rows[3]))),
                            sp.rows[3], rows, sp.dv, scale_of=inv)
        self.loop(start, end, task)
        b.ret_void()

    # -- backward --
    def backward(self):
        b, sp, em = self.b, self.s, self.em
        bq, bk = self.p.bq, self.p.bk
        dp, dvp = _pad(sp.d), _pad(sp.dv)
        sq_pad = -(-sp.sq // bq) * bq
        ws_per_task = sq_pad * dp + 2 * sq_pad
        tile = {name: self.alloca(n) for name, n in tiles(sp, self.p).items()}
        qt, dot, kt, vt, kp = (tile[n] for n in ("q", "dO", "kT", "vT", "k"))
        s_tile, dpt, dk_acc, dv_acc = (tile[n] for n in ("s", "dP", "dK", "dV"))
        m, l, alpha = tile["m"], tile["l"], tile["alpha"]
        nb = 3 + sp.has_bias
        q, k, v = self.ptr[:3]
        out, dout, dq, ws = self.ptr[nb:nb + 4]
        dk = b.gep(dq, [_i64(sp.sizes[0])], inbounds=True, source_etype=F32)
        dv = b.gep(dq, [_i64(sp.sizes[0] + sp.sizes[1])], inbounds=True, source_etype=F32)
        start, end = self.fn.args[1:]
        body = self.b.append_basic_block("tasks")
        self.b.branch(body)
        self.b.position_at_end(body)

        def task(t, _):
            w = b.gep(ws, [b.mul(t, _i64(ws_per_task))], inbounds=True, source_etype=F32)
            dq_acc = w
            lse = b.gep(w, [_i64(sq_pad * dp)], inbounds=True, source_etype=F32)
            di = b.gep(w, [_i64(sq_pad * dp + sq_pad)], inbounds=True, source_etype=F32)
            self.zero(dq_acc, sq_pad * dp)
            qbase, kbase, vbase, obase = (self.base(t, i) for i in range(4))

            # pass 1: log-sum-exp of every row, and D_i = dO_i · O_i
            def stats(i0, _):
                rows = self.imin(_i64(bq), b.sub(_i64(sp.sq), i0))
                self.load_tile(qt, dp, bq, dp, q, b.add(qbase, b.mul(i0, _i64(sp.rows[0]))),
                               sp.rows[0], rows, sp.d)
                self.reset_stats(m, l)
                kend = self.key_end(b.add(i0, b.sub(rows, _i64(1))))

                def block(j0, _):
                    nk = self.imin(_i64(bk), b.sub(kend, j0))
                    self.load_tile(kt, bk, bk, sp.d, k, b.add(kbase, b.mul(j0, _i64(sp.rows[1]))),
                                   sp.rows[1], nk, sp.d, transpose=True)
                    self.mm_abt(s_tile, qt, dp, kt, sp.d, rows)
                    self.online_softmax_block(s_tile, m, l, alpha, i0, j0, nk, rows, t)
                self.loop(_i64(0), kend, block, step=bk)

                def row(r, _):
                    i = b.add(i0, r)
                    tot = self.ld(l, r)
                    mm = self.ld(m, r)
                    pos = b.fcmp_ordered(">", tot, _f32(0))
                    safe = b.select(pos, tot, _f32(1))
                    value = b.fadd(mm, vecmath.log(em, safe))
                    self.st(b.select(pos, value, _f32(np.inf)), lse, i)
                    ob = b.add(obase, b.mul(i, _i64(sp.rows[3])))

                    def col(c, acc):
                        at = b.add(ob, c)
                        return [b.fadd(acc[0], b.fmul(self.ld(out, at), self.ld(dout, at)))]
                    (acc,) = self.loop(_i64(0), _i64(sp.dv), col, [_f32(0)])
                    self.st(acc, di, i)
                self.loop(_i64(0), rows, row)
            self.loop(_i64(0), _i64(sp.sq), stats, step=bq)

            # pass 2: per key block, every query block that sees it
            def kblock(j0, _):
                nk = self.imin(_i64(bk), b.sub(_i64(sp.sk), j0))
                kb = b.add(kbase, b.mul(j0, _i64(sp.rows[1])))
                vb = b.add(vbase, b.mul(j0, _i64(sp.rows[2])))
                self.load_tile(kt, bk, bk, sp.d, k, kb, sp.rows[1], nk, sp.d, transpose=True)
                self.load_tile(vt, bk, bk, sp.dv, v, vb, sp.rows[2], nk, sp.dv, transpose=True)
                self.load_tile(kp, dp, bk, dp, k, kb, sp.rows[1], nk, sp.d)
                self.zero(dk_acc, bk * dp)
                self.zero(dv_acc, bk * dvp)
                first = _i64(0)
                if sp.causal:  # the first query that sees key j0: i >= j0 - offset
                    lo = self.imax(b.sub(j0, _i64(sp.offset)), _i64(0))
                    first = b.mul(b.sdiv(lo, _i64(bq)), _i64(bq))

                def qblock(i0, _):
                    rows = self.imin(_i64(bq), b.sub(_i64(sp.sq), i0))
                    self.load_tile(qt, dp, bq, dp, q, b.add(qbase, b.mul(i0, _i64(sp.rows[0]))),
                                   sp.rows[0], rows, sp.d)
                    self.load_tile(dot, dvp, bq, dvp, dout, b.add(obase, b.mul(i0, _i64(sp.rows[3]))),
                                   sp.rows[3], rows, sp.dv)
                    self.mm_abt(s_tile, qt, dp, kt, sp.d, rows)
                    self.mm_abt(dpt, dot, dvp, vt, sp.dv, rows)

                    def probs(r, _):
                        i = b.add(i0, r)
                        vs = self.scores(s_tile, r, i, j0, nk, t)
                        lv = self.splat(self.ld(lse, i))
                        dv_ = self.splat(self.ld(di, i))
                        for c, x in enumerate(vs):
                            at = b.add(b.mul(r, _i64(bk)), _i64(c * LANES))
                            pr = vecmath.exp(em, b.fsub(x, lv))
                            self.vst(pr, s_tile, at)
                            ds = b.fmul(b.fmul(pr, b.fsub(self.vld(dpt, at), dv_)), self.vconst(sp.scale))
                            self.vst(ds, dpt, at)
                    self.loop(_i64(0), rows, probs)
                    self.mm_atb(dv_acc, s_tile, dot, dvp, nk, rows)
                    self.mm_acc(b.gep(dq_acc, [b.mul(i0, _i64(dp))], inbounds=True, source_etype=F32),
                                dp, dpt, kp, dp, dp, nk, rows)
                    self.mm_atb(dk_acc, dpt, qt, dp, nk, rows)
                self.loop(first, _i64(sp.sq), qblock, step=bq)
                self.store_tile(dk_acc, dp, dk, kb, sp.rows[1], nk, sp.d)
                self.store_tile(dv_acc, dvp, dv, vb, sp.rows[2], nk, sp.dv)
            self.loop(_i64(0), _i64(sp.sk), kblock, step=bk)
            self.store_tile(dq_acc, dp, dq, qbase, sp.rows[0], _i64(sp.sq), sp.d)
        self.loop(start, end, task)
        b.ret_void()

    def render(self, vector_bits: int) -> str:
        (self.backward if self.s.bwd else self.forward)()
        text = str(self.mod)
        head = f'define void @"{self.fn.name}"'
        i = text.index(head)
        j = text.index("{", i)
        return text[:j] + f'"prefer-vector-width"="{vector_bits}" ' + text[j:]


def workspace_bytes(sp: Spec, p: AttentionParams) -> int:
    """The backward's float32 workspace: per head, dQ's accumulator, lse and D (linear in S)."""
    if not sp.bwd:
        return 0
    sq_pad = -(-sp.sq // p.bq) * p.bq
    return 4 * sp.nb * (sq_pad * _pad(sp.d) + 2 * sq_pad)


_DIGEST = code_digest("attention.py")


def build(kernel, device, backend, params: AttentionParams | None = None):
    """run(buffers): the FlashAttention kernel of the template kernel's equation, blocked by
    `params` (default: AttentionParams(); the auto-tuner passes others)."""
    sp = kernel_spec(kernel)
    p = params or AttentionParams()
    why = p.invalid(sp)
    if why:
        raise CompileError(f"attention parameters {p} cannot build {kernel.name}: {why}",
                           kernel=str(kernel))
    info = backend.info_of(device)
    target = get_target(info)
    key = compile_cache.make_key(repr(sp), repr(p), target.fingerprint + ("attention", _DIGEST))
    fn_name = "tf_attn_" + key[:24]
    address = target.module(key, fn_name, lambda: _Gen(sp, p, fn_name).render(target.vector_bits),
                            str(kernel))
    fn = KernelFn(address)
    tasks = sp.nb if sp.bwd else sp.nb * -(-sp.sq // p.bq)
    threads = max(1, info.compute_units)
    launch = get_pool(threads).launcher(fn, [(t, t + 1) for t in range(tasks)]) \
        if threads > 1 and tasks > 1 else None
    ws_bytes = workspace_bytes(sp, p)
    ptrs_t = ctypes.c_void_p * (len(kernel.buffers) + sp.bwd)

    def run(buffers):
        addrs = [buf.ctypes.data for buf in buffers] + ([backend.scratch(ws_bytes).ctypes.data] if ws_bytes else [])
        ptrs = ptrs_t(*addrs)
        if launch is None:
            fn(ptrs, 0, tasks)
        else:
            launch(ptrs)
    return run
