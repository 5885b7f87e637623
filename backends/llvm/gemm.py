"""The CPU GEMM template: a packed, cache-blocked, register-blocked matrix product in the BLIS
manner, generated as LLVM IR with llvmlite.

    for each task (a batch, a range of rows, a range of columns; one per thread)
      for jc in columns, step NC:              B block KC x NC lives in L3
        for pc in K, step KC:                  pack B[pc:, jc:] into NR-column panels
          for ic in rows, step MC:             pack A[ic:, pc:] into MR-row panels (A block in L2),
                                               or read a float32 A in place (reads_a_in_place)
            for jr, ir in NR x MR micro-tiles: the micro-kernel: MR x NR accumulators in native
                                               vectors, one FMA per vector per k (B panel in L1)

Packing reads the operands through (batch, row, k) and (batch, k, column) strides, so a
transposed or batched operand is never copied beforehand, and converts float16/bfloat16 to
float32 (they accumulate in float32). The epilogue (a fused_gemm's bias, activation, scale and
residual) runs on each micro-tile as soon as its last K block is written, while the tile is in
L1: a small module of its own, called through a pointer, so a new epilogue compiles in ~0.1 s
instead of recompiling the ~1 s core (the tile's round trip through L1 costs a few cycles a row).

Only the micro-tile shape (MR, NR) and the dtypes are compiled into the core; the block sizes
MC, KC, NC are run-time arguments, so the auto-tuner can search them without recompiling.
Kernels of kind "dot_general" (a dot_general or fused_gemm equation) are described by
`GemmProblem`; `backends/llvm/blas.py` runs the same description through numpy's BLAS."""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from tilefuse.ir import dtypes
from tilefuse.ir.errors import CompileError
from tilefuse.ir.kernel import lower
from tilefuse.ir.kernel.matmul import matmul_layout
from tilefuse.runtime import compile_cache, dispatch, tuner
from tilefuse.runtime.hardware import DeviceInfo

from tilefuse.backends.llvmir import vecmath

from . import blas
from tilefuse.backends.llvmir.irutil import bf16_to_f32, counted_loop, f32_to_bf16, splat
from .compile import code_digest, KernelFn, get_pool, get_target
from tilefuse.backends.llvmir.render import emit_pointwise

F32, I1, I16, I32, I64 = ir.FloatType(), ir.IntType(1), ir.IntType(16), ir.IntType(32), ir.IntType(64)
HALF = ir.HalfType()
F32P = F32.as_pointer()
I8P = ir.IntType(8).as_pointer()
BF16 = np.dtype(dtypes.bfloat16)
FLOATS = (np.dtype(np.float32), np.dtype(np.float16), BF16)


@dataclass(frozen=True)
class GemmParams:
    """The template's parameters: the micro-tile (compiled in) and the cache blocks (run time)."""
    mr: int = 12     # rows of the micro-tile: A values broadcast per k
    nr: int = 32     # columns of the micro-tile: a multiple of the vector lanes
    lanes: int = 16  # float32 lanes of one native vector
    kc: int = 512    # depth of a packed block (the B micro-panel, KC x NR, streams from L1/L2)
    mc: int = 252    # rows of the packed A block (MC x KC) kept in L2; a multiple of mr
    nc: int = 4096   # columns of the packed B block (KC x NC) kept in L3; a multiple of nr
    threads: int = 1
    pack_a: bool | None = None  # False: a float32 A is read in place, not packed (a run-time
    # choice); None: as reads_a_in_place decides from the problem

    def __post_init__(self):
        assert self.nr % self.lanes == 0 and self.mc % self.mr == 0 and self.nc % self.nr == 0, self


def default_gemm_params(info: DeviceInfo) -> GemmParams:
    """Parameters from the hardware description: the register file sets the micro-tile (with 32
    vector registers 12 x 2 accumulators, 2 B vectors and a broadcast; with 16 registers 6 x 2),
    L1 sets KC, L2 sets MC and L3 (shared by the cores) sets NC."""
    lanes = max(4, info.simd_lanes_f32)
    mr = 12 if lanes >= 16 else 6
    nr = 2 * lanes
    # KC: the B micro-panel (KC x NR floats) twice the size of L1. Measured on znver4 (CPU time,
    # one core, against OpenBLAS): N = 1024: KC 128 (half of L1) 0.80, 256 0.90, 512 0.98;
    # N = 2048: 256 0.88, 512 1.00; (2048x512)@(512x128): 256 0.76, 512 0.98. A deep block
    # amortises the update of the C tile, and L2 streams the panel fast enough.
    kc = int(np.clip(2 * info.l1_bytes // (nr * 4) // 16 * 16, 64, 1024))
    mc = int(np.clip((info.l2_bytes // 2) // (kc * 4) // mr * mr, mr, 48 * mr))
    l3 = info.l3_bytes or 4 * info.l2_bytes
    nc = int(np.clip((l3 // (2 * max(1, info.compute_units))) // (kc * 4) // nr * nr, nr, 128 * nr))
    return GemmParams(mr=mr, nr=nr, lanes=lanes, kc=kc, mc=mc, nc=nc, threads=info.compute_units)


# ---- the problem a dot_general / fused_gemm kernel poses ----------------------------------------

@dataclass(frozen=True)
class GemmProblem:
    """C[b, i, j] = epilogue(sum_k A[b, i, k] B[b, k, j]) over buffers with these strides.
    roles: per kernel input buffer, what it is ("lhs", "rhs" or an extra's index; the same
    variable may be both operands, so a buffer can have several roles)."""
    batch: int
    m: int
    n: int
    k: int
    a_strides: tuple   # (batch, row, k) in elements of A's buffer
    b_strides: tuple   # (batch, k, column)
    in_dtype: np.dtype
    out_dtype: np.dtype
    epilogue: object   # the fused_gemm's ScalarFn of (product, *extras), or None
    extra_strides: tuple  # per extra: (batch, row) strides; columns are contiguous
    roles: tuple       # per kernel input buffer: a tuple of roles
    eqn: object = None

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    def shape_class(self) -> tuple:
        """Problems that run alike: sizes bucketed to powers of two, layouts and dtypes exact."""
        b2 = tuner.size_class
        return (b2(self.batch), b2(self.m), b2(self.n), b2(self.k), self.a_strides[2] == 1,
                self.b_strides[2] == 1, self.in_dtype.name, self.out_dtype.name)


def gemm_problem(kernel) -> GemmProblem | None:
    """The GEMM a dot_general or fused_gemm kernel computes, or None when its operands cannot be
    read through strides (then another implementation runs it). Kept in the kernel's meta: the
    dispatcher's candidates, the build and the tuner all ask."""
    if "gemm_problem" not in kernel.meta:
        kernel.meta["gemm_problem"] = _gemm_problem(kernel)
    return kernel.meta["gemm_problem"]


def _gemm_problem(kernel) -> GemmProblem | None:
    eqns = kernel.meta.get("eqns", ())
    operands = kernel.meta.get("operands")
    if len(eqns) != 1 or operands is None or eqns[0].prim.name not in ("dot_general", "fused_gemm"):
        return None
    e = eqns[0]
    if not all(hasattr(a, "id") for a in e.inputs):  # a literal operand
        return None
    lay = matmul_layout(e)
    out = e.outputs[0].aval
    if lay is None or lay.dtype not in FLOATS or np.dtype(out.dtype) not in FLOATS:
        return None
    extra_strides = []
    for x in e.inputs[2:]:
        if x.aval.shape == out.shape:
            extra_strides.append((lay.m * lay.n, lay.n))
        elif x.aval.shape == (lay.n,):
            extra_strides.append((0, 0))  # a row vector along the output's last axis
        else:  # a row of a last axis shorter than N: the template cannot index it
            return None
    roles = tuple(tuple(r for r, a in zip(["lhs", "rhs", *range(len(e.inputs) - 2)], e.inputs)
                        if a.id == v.id) for v in operands)
    return GemmProblem(lay.batch, lay.m, lay.n, lay.k, lay.a_strides, lay.b_strides, lay.dtype,
                       np.dtype(out.dtype), e.params.get("epilogue"),
                       tuple(extra_strides), roles, e)


# ---- code generation --------------------------------------------------------------------------

# The core's entry point: fn(void **ptrs, i64 s, i64 e) runs tasks [s, e). The epilogue is its
# own small module (compiled per epilogue in a fraction of the core's time), called per micro-tile
# through a pointer: epilogue(ptrs, batch, row, col, rows, cols).
PTR_A, PTR_B, PTR_C, PTR_DIMS, PTR_WORK, PTR_EPILOGUE, PTR_EXTRAS = range(7)
DIMS_EXTRAS = 20  # dims[20 + 2i], dims[21 + 2i]: extra i's batch and row strides
EPILOGUE_T = ir.FunctionType(ir.VoidType(), [I8P.as_pointer(), I64, I64, I64, I64, I64])


class _Gen:
    """Emits the core module: pack_a, pack_b, the micro-kernel and the entry point."""

    def __init__(self, p: GemmParams, in_dtype, out_dtype):
        self.p, self.in_dtype, self.out_dtype = p, np.dtype(in_dtype), np.dtype(out_dtype)
        self.nv = p.nr // p.lanes
        self.V = ir.VectorType(F32, p.lanes)
        self.mod = ir.Module(name="gemm")

    # -- small helpers ---------------------------------------------------------------------
    @staticmethod
    def _storage(dtype):
        return {"float32": F32, "float16": HALF, "bfloat16": I16}[np.dtype(dtype).name]

    def _to_f32(self, b, v, dtype):
        """A loaded value (scalar or vector) of `dtype` in float32."""
        name = np.dtype(dtype).name
        if name == "float32":
            return v
        if name == "float16":
            return b.fpext(v, ir.VectorType(F32, v.type.count) if isinstance(v.type, ir.VectorType) else F32)
        return bf16_to_f32(b, v)

    def _from_f32(self, b, v, dtype):
        name = np.dtype(dtype).name
        if name == "float32":
            return v
        if name == "float16":
            return b.fptrunc(v, ir.VectorType(HALF, v.type.count) if isinstance(v.type, ir.VectorType) else HALF)
        return f32_to_bf16(b, v)

    _c = staticmethod(splat)

    @staticmethod
    def _i(v):
        return ir.Constant(I64, int(v))

    @staticmethod
    def _splat(b, x, vt):
        """A vector of type vt with x in every lane."""
        one = b.insert_element(ir.Constant(vt, None), x, ir.Constant(I32, 0))
        zeros = ir.Constant(ir.VectorType(I32, vt.count), [0] * vt.count)
        return b.shuffle_vector(one, ir.Constant(vt, None), zeros)

    def _func(self, name, args):
        """An internal void function of `args` and a builder at its entry."""
        fn = ir.Function(self.mod, ir.FunctionType(ir.VoidType(), args), name=name)
        fn.linkage = "internal"
        for a in fn.args:
            if isinstance(a.type, ir.PointerType):
                a.add_attribute("noalias")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        return fn, b

    @staticmethod
    def _loop(b, lo, hi, step, body, name):
        """for (iv = lo; iv < hi; iv += step) body(iv)."""
        def step_body(i, _):
            body(i)  # carries nothing (whatever body returns)
        counted_loop(b, lo, hi, step_body, step=step, name=name)

    def _smin(self, b, x, y):
        return b.select(b.icmp_signed("<", x, y), x, y)

    def _tile_io(self, b, c, ldc, cols):
        """(at(r, v), load(ptr, v), store(value, ptr, v)) on row r, vector v of a C tile at c,
        masked to its first `cols` columns; values are float32 vectors."""
        p = self.p
        lane = ir.Constant(ir.VectorType(I64, p.lanes), list(range(p.lanes)))
        limit = self._splat(b, cols, lane.type)
        masks = [b.icmp_signed("<", b.add(lane, self._c(lane.type, v * p.lanes)), limit)
                 for v in range(self.nv)]
        CV = ir.VectorType(self._storage(self.out_dtype), p.lanes)

        def at(r, v):
            return b.bitcast(b.gep(c, [b.add(b.mul(r, ldc), self._i(v * p.lanes))]), CV.as_pointer())

        def load(ptr, v):
            x = b.call(self._masked_load(CV), [ptr, ir.Constant(I32, 2), masks[v], ir.Constant(CV, None)])
            return self._to_f32(b, x, self.out_dtype)

        def store(val, ptr, v):
            b.call(self._masked_store(CV), [self._from_f32(b, val, self.out_dtype), ptr,
                                            ir.Constant(I32, 2), masks[v]])
        return at, load, store

    # -- packing -------------------------------------------------------------------------------
    def _pack(self, name, width):
        """pack(src, s_outer, s_inner, n_outer, kc, dst): dst panels of `width` along the outer
        axis, k-major inside a panel, zero-padded: dst[p*kc*width + k*width + r] =
        src[(p*width + r)*s_outer + k*s_inner]. With s_outer == 1 a full panel's row of `width`
        values is one vector load (B in row-major, A transposed); with s_inner == 1 (A in
        row-major, B transposed) a full panel is transposed in registers, LANES rows by LANES k
        at a time; otherwise, and for k past the last whole block, element by element."""
        st = self._storage(self.in_dtype)
        fn, b = self._func(name, [st.as_pointer(), I64, I64, I64, I64, F32P])
        src, s_out, s_in, n_out, kc, dst = fn.args
        w = self._i(width)
        lanes = self.p.lanes

        def panel(p0):
            rows = self._smin(b, b.sub(n_out, p0), w)
            base = b.mul(p0, kc)  # panel p0/width starts at p0*kc in dst

            def vector_row(k):  # a full panel's row of `width` contiguous values: one load
                at = b.gep(src, [b.add(p0, b.mul(k, s_in))])
                v = b.load(b.bitcast(at, ir.VectorType(st, width).as_pointer()), align=2)
                out = b.gep(dst, [b.add(base, b.mul(k, w))])
                b.store(self._to_f32(b, v, self.in_dtype),
                        b.bitcast(out, ir.VectorType(F32, width).as_pointer()), align=4)

            def transposed_block(k0):  # k0..k0+lanes of every row: loads along k, stores along rows
                for g in range(0, width, lanes):
                    n = min(lanes, width - g)
                    vt = ir.VectorType(st, lanes)
                    vecs = [self._to_f32(b, b.load(b.bitcast(
                        b.gep(src, [b.add(b.mul(b.add(p0, self._i(g + r)), s_out), k0)]), vt.as_pointer()),
                        align=2), self.in_dtype) for r in range(n)]
                    vecs += [ir.Constant(self.V, None)] * (lanes - n)
                    for kk, v in enumerate(self._transpose(b, vecs)):
                        if n < lanes:
                            v = b.shuffle_vector(v, ir.Constant(self.V, None), ir.Constant(
                                ir.VectorType(I32, n), list(range(n))))
                        out = b.gep(dst, [b.add(base, b.add(b.mul(b.add(k0, self._i(kk)), w), self._i(g)))])
                        b.store(v, b.bitcast(out, v.type.as_pointer()), align=4)

            def strided(k_lo):  # row r along k from k_lo (contiguous when s_in == 1)
                def one_row(r):
                    row = b.gep(src, [b.mul(b.add(p0, r), s_out)])

                    def element(k):
                        v = self._to_f32(b, b.load(b.gep(row, [b.mul(k, s_in)])), self.in_dtype)
                        b.store(v, b.gep(dst, [b.add(base, b.add(b.mul(k, w), r))]))
                    self._loop(b, k_lo, kc, self._i(1), element, name + ".k")
                return one_row

            def zeros(r):  # the padding of a partial panel
                self._loop(b, self._i(0), kc, self._i(1), lambda k: b.store(
                    self._c(F32, 0.0), b.gep(dst, [b.add(base, b.add(b.mul(k, w), r))])), name + ".z")
            full = b.icmp_signed("==", rows, w)
            vector = b.and_(b.icmp_signed("==", s_out, self._i(1)), full)
            transpose = b.and_(b.icmp_signed("==", s_in, self._i(1)), full)
            with b.if_else(vector) as (vec, gen):
                with vec:
                    self._loop(b, self._i(0), kc, self._i(1), vector_row, name + ".kv")
                with gen:
                    k_whole = b.select(transpose, b.mul(b.sdiv(kc, self._i(lanes)), self._i(lanes)), self._i(0))
                    self._loop(b, self._i(0), k_whole, self._i(lanes), transposed_block, name + ".kt")
                    self._loop(b, self._i(0), rows, self._i(1), strided(k_whole), name + ".r")
                    self._loop(b, rows, w, self._i(1), zeros, name + ".pad")
        self._loop(b, self._i(0), n_out, w, panel, name + ".p")
        b.ret_void()
        return fn

    @staticmethod
    def _transpose(b, vecs):
        """The transpose of a square of vectors (len(vecs) == lanes, a power of two): log2(lanes)
        stages, each swapping the off-diagonal blocks of size h of every 2h x 2h block — two
        two-source shuffles per pair of vectors (one vpermt2ps each on AVX-512)."""
        n, h = len(vecs), 1
        while h < n:
            lo = ir.Constant(ir.VectorType(I32, n), [j if not j & h else n + j - h for j in range(n)])
            hi = ir.Constant(ir.VectorType(I32, n), [j + h if not j & h else n + j for j in range(n)])
            out = list(vecs)
            for i in (i for i in range(n) if not i & h):
                out[i] = b.shuffle_vector(vecs[i], vecs[i + h], lo)
                out[i + h] = b.shuffle_vector(vecs[i], vecs[i + h], hi)
            vecs, h = out, 2 * h
        return vecs

    def _masked_load(self, vt):
        name = f"llvm.masked.load.v{vt.count}{self._sfx(vt.element)}.p0"
        fn = self.mod.globals.get(name)
        if fn is None:
            mask = ir.VectorType(I1, vt.count)
            fn = ir.Function(self.mod, ir.FunctionType(vt, [vt.as_pointer(), I32, mask, vt]), name=name)
        return fn

    def _masked_store(self, vt):
        name = f"llvm.masked.store.v{vt.count}{self._sfx(vt.element)}.p0"
        fn = self.mod.globals.get(name)
        if fn is None:
            mask = ir.VectorType(I1, vt.count)
            ty = ir.FunctionType(ir.VoidType(), [vt, vt.as_pointer(), I32, mask])
            fn = ir.Function(self.mod, ty, name=name)
        return fn

    @staticmethod
    def _sfx(t):
        return {"float": "f32", "half": "f16", "i16": "i16"}[str(t)]

    # -- the micro-kernel -------------------------------------------------------------------------
    def _micro(self):
        """micro(kc, ap, a_rs, a_ks, bp, c, ldc, mr_eff, nr_eff, first): C tile (+)= A panel x Bp
        panel, A's value of row r at depth k at ap[r*a_rs + k*a_ks]: a packed panel (1, MR) or
        float32 A read in place (its row stride, 1). Rows past mr_eff read the last row (their
        results are not written), so an unpadded A is never read past its end."""
        p, V, nv = self.p, self.V, self.nv
        ct = self._storage(self.out_dtype)
        fn, b = self._func("micro", [I64, F32P, I64, I64, F32P, ct.as_pointer(), I64, I64, I64, I1])
        kc, ap, a_rs, a_ks, bp, c, ldc, mr_eff, nr_eff, first = fn.args
        zero = self._c(V, 0.0)
        emit = vecmath.Emit(b)
        rows = [b.gep(ap, [b.mul(self._smin(b, self._i(r), b.sub(mr_eff, self._i(1))), a_rs)])
                for r in range(p.mr)]

        def step(k, flat):  # one k: an outer product of A's column and B's row into the tile
            bk = b.gep(bp, [b.mul(k, self._i(p.nr))])
            bvec = [b.load(b.bitcast(b.gep(bk, [self._i(v * p.lanes)]), V.as_pointer()), align=64)
                    for v in range(nv)]
            ak = b.mul(k, a_ks)
            new = []
            for r in range(p.mr):
                a = self._splat(b, b.load(b.gep(rows[r], [ak]), align=4), V)
                new += [emit.fma(a, bvec[v], flat[r * nv + v]) for v in range(nv)]
            return new
        flat, _ = counted_loop(b, self._i(0), kc, step, name="k", carried=[zero] * (p.mr * nv))
        acc = [flat[r * nv:(r + 1) * nv] for r in range(p.mr)]

        # write the tile: C (+)= acc, masked at the edges
        at, load, store = self._tile_io(b, c, ldc, nr_eff)

        def write(accumulate: bool):
            for r in range(p.mr):
                def row(r=r):
                    for v in range(nv):
                        ptr = at(self._i(r), v)
                        store(b.fadd(acc[r][v], load(ptr, v)) if accumulate else acc[r][v], ptr, v)
                if r == 0:
                    row()
                else:
                    with b.if_then(b.icmp_signed("<", self._i(r), mr_eff)):
                        row()
        with b.if_else(first) as (set_, add_):
            with set_:
                write(False)
            with add_:
                write(True)
        b.ret_void()
        return fn

    # -- the entry point ------------------------------------------------------------------------------
    def build(self, fn_name: str) -> str:
        """The module's text (see PTR_* for the entry point's pointers)."""
        p = self.p
        st, ct = self._storage(self.in_dtype), self._storage(self.out_dtype)
        pack_a = self._pack("pack_a", p.mr)
        pack_b = self._pack("pack_b", p.nr)
        micro = self._micro()
        fn = ir.Function(self.mod, ir.FunctionType(ir.VoidType(), [I8P.as_pointer(), I64, I64]), name=fn_name)
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        ptrs, s, e = fn.args
        arg = lambda i, ty: b.bitcast(b.load(b.gep(ptrs, [self._i(i)])), ty)
        A, B, C = arg(PTR_A, st.as_pointer()), arg(PTR_B, st.as_pointer()), arg(PTR_C, ct.as_pointer())
        dims = arg(PTR_DIMS, I64.as_pointer())
        work = arg(PTR_WORK, F32P)
        epilogue = arg(PTR_EPILOGUE, EPILOGUE_T.as_pointer())
        has_epilogue = b.icmp_unsigned("!=", epilogue, ir.Constant(EPILOGUE_T.as_pointer(), None))
        d = lambda i: b.load(b.gep(dims, [self._i(i)]))
        M, N, K = d(0), d(1), d(2)
        sab, sam, sak, sbb, sbk, sbn = (d(i) for i in range(3, 9))
        mch, nch, n_m, n_n, per, slot_size, kc_blk, mc_blk, nc_blk, a_block, read_a = (d(i) for i in range(9, 20))
        slot = b.sdiv(s, per)
        ap = b.gep(work, [b.mul(slot, slot_size)])
        bp = b.gep(ap, [a_block])
        # float32 A is read in place where reads_a_in_place says so: packing costs a pass over A,
        # which a small N (few micro-panels per packed block) barely repays
        direct = b.icmp_signed("!=", read_a, self._i(0)) if st == F32 else None

        def task(u):
            bi = b.sdiv(u, b.mul(n_m, n_n))
            mi = b.srem(b.sdiv(u, n_n), n_m)
            ni = b.srem(u, n_n)
            m_lo, n_lo = b.mul(mi, mch), b.mul(ni, nch)
            m_hi, n_hi = self._smin(b, M, b.add(m_lo, mch)), self._smin(b, N, b.add(n_lo, nch))
            a_b, b_b = b.gep(A, [b.mul(bi, sab)]), b.gep(B, [b.mul(bi, sbb)])
            c_b = b.gep(C, [b.mul(bi, b.mul(M, N))])

            def jc_loop(jc):
                ncur = self._smin(b, nc_blk, b.sub(n_hi, jc))

                def pc_loop(pc):
                    kcur = self._smin(b, kc_blk, b.sub(K, pc))
                    b_at = b.gep(b_b, [b.add(b.mul(pc, sbk), b.mul(jc, sbn))])
                    b.call(pack_b, [b_at, sbn, sbk, ncur, kcur, bp])
                    first = b.icmp_signed("==", pc, self._i(0))
                    last = b.icmp_signed(">=", b.add(pc, kcur), K)

                    def ic_loop(ic):
                        mcur = self._smin(b, mc_blk, b.sub(m_hi, ic))
                        a_at = b.gep(a_b, [b.add(b.mul(ic, sam), b.mul(pc, sak))])
                        if direct is None:
                            b.call(pack_a, [a_at, sam, sak, mcur, kcur, ap])
                        else:
                            with b.if_then(b.not_(direct)):
                                b.call(pack_a, [a_at, sam, sak, mcur, kcur, ap])

                        def jr_loop(jr):
                            def ir_loop(i_r):
                                row, col = b.add(ic, i_r), b.add(jc, jr)
                                cptr = b.gep(c_b, [b.add(b.mul(row, N), col)])
                                rows = self._smin(b, self._i(p.mr), b.sub(mcur, i_r))
                                cols = self._smin(b, self._i(p.nr), b.sub(ncur, jr))
                                a_panel, b_panel = b.gep(ap, [b.mul(i_r, kcur)]), b.gep(bp, [b.mul(jr, kcur)])
                                a_rs, a_ks = self._i(1), self._i(p.mr)
                                if direct is not None:  # float32 rows read in place
                                    a_panel = b.select(direct, b.gep(a_at, [b.mul(i_r, sam)]), a_panel)
                                    a_rs, a_ks = b.select(direct, sam, a_rs), b.select(direct, sak, a_ks)
                                b.call(micro, [kcur, a_panel, a_rs, a_ks, b_panel, cptr, N, rows, cols,
                                               first])
                                with b.if_then(b.and_(last, has_epilogue)):
                                    b.call(epilogue, [ptrs, bi, row, col, rows, cols])
                            self._loop(b, self._i(0), mcur, self._i(p.mr), ir_loop, "ir")
                        self._loop(b, self._i(0), ncur, self._i(p.nr), jr_loop, "jr")
                    self._loop(b, m_lo, m_hi, mc_blk, ic_loop, "ic")
                self._loop(b, self._i(0), K, kc_blk, pc_loop, "pc")
            self._loop(b, n_lo, n_hi, nc_blk, jc_loop, "jc")
        self._loop(b, s, e, self._i(1), task, "task")
        b.ret_void()
        return str(self.mod)


def apply_epilogue(b, fn, values):
    """A fused_gemm's epilogue `fn` (a ScalarFn) on LLVM values of one width (scalars or vectors
    in float32): the product's, then each extra's."""
    expr, leaves = lower.epilogue_leaves(fn)
    return emit_pointwise(b, expr, dict(zip(leaves, values)))


class _EpilogueGen(_Gen):
    """Emits an epilogue module: epilogue(ptrs, batch, row, col, rows, cols) applies the steps to
    a rows x cols tile of C (rows <= MR, cols <= NR) in place."""

    def __init__(self, p: GemmParams, out_dtype, epilogue, n_extras: int):
        super().__init__(p, out_dtype, out_dtype)
        self.epilogue, self.n_extras = epilogue, n_extras

    def build(self, fn_name: str) -> str:
        p = self.p
        ct = self._storage(self.out_dtype)
        fn = ir.Function(self.mod, EPILOGUE_T, name=fn_name)
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        ptrs, bi, row, col, rows, cols = fn.args
        arg = lambda i: b.bitcast(b.load(b.gep(ptrs, [self._i(i)])), ct.as_pointer())
        dims = b.bitcast(b.load(b.gep(ptrs, [self._i(PTR_DIMS)])), I64.as_pointer())
        d = lambda i: b.load(b.gep(dims, [self._i(i)]))
        M, N = d(0), d(1)
        c = b.gep(arg(PTR_C), [b.add(b.mul(bi, b.mul(M, N)), b.add(b.mul(row, N), col))])
        extras = []  # per extra: the pointer to its element at the tile's origin, its row stride
        for i in range(self.n_extras):
            sb, sm = d(DIMS_EXTRAS + 2 * i), d(DIMS_EXTRAS + 2 * i + 1)
            origin = b.add(b.mul(bi, sb), b.add(b.mul(row, sm), col))
            extras.append((b.gep(arg(PTR_EXTRAS + i), [origin]), sm))
        at, load, store = self._tile_io(b, c, N, cols)

        def one_row(r):
            for v in range(self.nv):
                ptr = at(r, v)
                xs = []  # extra rows are read like C's, with their own stride
                for x, sm in extras:
                    xptr = b.bitcast(b.gep(x, [b.add(b.mul(r, sm), self._i(v * p.lanes))]), ptr.type)
                    xs.append(load(xptr, v))
                store(apply_epilogue(b, self.epilogue, [load(ptr, v), *xs]), ptr, v)
        self._loop(b, self._i(0), rows, self._i(1), one_row, "row")
        b.ret_void()
        return str(self.mod)


# ---- compiling and running ------------------------------------------------------------------------

_DIGEST = code_digest("gemm.py", "render.py", lower.__file__)  # epilogues: lower.py, render.py


def _load(info: DeviceInfo, spec: tuple, make_gen) -> int:
    """Compile (or fetch from the caches) the module make_gen() emits; its function's address."""
    target = get_target(info)
    key = compile_cache.make_key("gemm", _DIGEST, repr(spec), target.fingerprint)
    fn_name = "tf_gemm_" + key[:24]
    return target.module(key, fn_name, lambda: make_gen().build(fn_name), f"gemm template {spec}")


def _compile(info: DeviceInfo, p: GemmParams, prob: GemmProblem) -> tuple:
    """(the core as a ctypes function, the epilogue's address or 0)."""
    core = ("core", p.mr, p.nr, p.lanes, prob.in_dtype.name, prob.out_dtype.name)
    fn = KernelFn(_load(info, core, lambda: _Gen(p, prob.in_dtype, prob.out_dtype)))
    if not prob.epilogue:
        return fn, 0
    n_x = len(prob.extra_strides)
    spec = ("epilogue", p.nr, p.lanes, prob.out_dtype.name, prob.epilogue, n_x)
    return fn, _load(info, spec, lambda: _EpilogueGen(p, prob.out_dtype, prob.epilogue, n_x))


def a_readable_in_place(prob: GemmProblem) -> bool:
    """A float32 A with k or its rows contiguous: the micro-kernel can read it as it is."""
    return prob.in_dtype == np.float32 and 1 in prob.a_strides[1:]


def reads_a_in_place(prob: GemmProblem, p: GemmParams, info: DeviceInfo, ways: int = 8) -> bool:
    """Whether the micro-kernel reads A in place instead of packing it (float32 only; p.pack_a
    forces either way). By default, with k contiguous, unless the MR rows it reads at once map to
    too few L1 sets (a row stride of 4 KiB puts all of them in one set of an 8-way L1: 1024 x
    1024 runs 0.71x in place; at K = 128 in place is 1.15-1.3x, equal on large unaliased
    problems). With the rows contiguous (A transposed) only where packing would not pay: every
    thread would pack all of A (the threads split N), or a packed block serves at most four
    column panels (512x128x2048 1.09x in place, 64x1024x4096 1.18x; 1024^3 0.98x, 2048x2048x256
    0.95x). Measured on znver4, 2 threads."""
    if not a_readable_in_place(prob) or p.pack_a:
        return False
    if p.pack_a is False:
        return True
    if prob.a_strides[2] != 1:
        split = _split(prob, p)
        return split.n_n > 1 or min(split.nch, p.nc) <= 4 * p.nr
    sets = max(1, info.l1_bytes // (64 * ways))
    share = np.bincount([(r * prob.a_strides[1] * 4 // 64) % sets for r in range(p.mr)]).max()
    return bool(share <= ways - 2)  # two ways left for the B panel and C


PARALLEL_MIN_FLOPS = 2_000_000  # below this waking the second thread costs more than it saves


def _chunk(extent: int, threads: int, unit: int) -> int:
    """A thread's share of `extent`, rounded up to whole micro-tiles of `unit`."""
    share = -(-extent // threads)
    return -(-share // unit) * unit


@dataclass(frozen=True)
class Split:
    """The problem's tasks: batch x n_m row chunks of mch x n_n column chunks of nch."""
    threads: int
    mch: int
    nch: int
    n_m: int = 1
    n_n: int = 1


def _split(prob: GemmProblem, p: GemmParams) -> Split:
    """The batch over the threads when it divides evenly, else the longer of M and N (each
    thread packs all of the other operand's blocks)."""
    threads = p.threads if prob.flops >= PARALLEL_MIN_FLOPS else 1
    if threads > 1 and prob.batch % threads:
        split_n = prob.n >= threads * p.nr and (prob.n > prob.m or prob.m < threads * p.mr)
        if split_n:
            nch = _chunk(prob.n, threads, p.nr)
            return Split(threads, prob.m, nch, n_n=-(-prob.n // nch))
        if prob.m >= threads * p.mr:
            mch = _chunk(prob.m, threads, p.mr)
            return Split(threads, mch, prob.n, n_m=-(-prob.m // mch))
    return Split(threads, prob.m, prob.n)


class GemmKernel:
    """A compiled GEMM for one problem: `run(buffers)` in kernel.buffers order."""

    def __init__(self, prob: GemmProblem, params: GemmParams, info: DeviceInfo, backend):
        self.prob, self.params, self.backend = prob, params, backend
        self._fn, epilogue = _compile(info, params, prob)
        p = params
        kc = p.kc
        nc = p.nc
        if prob.out_dtype != np.float32:  # 16-bit C cannot hold partial sums: one K block
            kc = max(prob.k, 1)
            nc = max(p.nr, min(nc, p.nc * p.kc // kc // p.nr * p.nr))
        split = _split(prob, p)
        mch, nch, n_m, n_n = split.mch, split.nch, split.n_m, split.n_n
        tasks = prob.batch * n_m * n_n
        threads = min(split.threads, tasks)
        per = -(-tasks // threads)
        self.bounds = [(s, min(s + per, tasks)) for s in range(0, tasks, per)]
        # blocks of equal size (no thin last block), at most MC x NC
        mc = _chunk(mch, -(-mch // p.mc), p.mr)
        nc = _chunk(nch, -(-nch // nc), p.nr)
        kc = min(kc, max(prob.k, 1))
        a_block = -(-mc * kc // 16) * 16  # B's block starts 64-byte aligned (aligned loads)
        slot = a_block + kc * nc
        self.work_bytes = len(self.bounds) * slot * 4 + 64
        dims = [prob.m, prob.n, prob.k, *prob.a_strides, *prob.b_strides, mch, nch, n_m, n_n, per,
                slot, kc, mc, nc, a_block, int(reads_a_in_place(prob, p, info))]
        for sb, sm in prob.extra_strides:
            dims += [sb, sm]
        self._dims = np.array(dims, np.int64)
        self._launch = get_pool(threads).launcher(self._fn, self.bounds) if len(self.bounds) > 1 else None
        self._ptrs = [0] * (PTR_EXTRAS + len(prob.extra_strides))
        self._ptrs[PTR_DIMS], self._ptrs[PTR_EPILOGUE] = self._dims.ctypes.data, epilogue
        self._ptrs_t = ctypes.c_void_p * len(self._ptrs)
        # kernel input buffer -> its places in ptrs (the same variable may be several operands)
        place = {"lhs": PTR_A, "rhs": PTR_B}
        self._places = [[PTR_EXTRAS + r if isinstance(r, int) else place[r] for r in roles]
                        for roles in prob.roles]

    def __call__(self, buffers) -> None:
        self.bind(buffers)()

    def bind(self, buffers):
        """A launch of no arguments on these buffers (their addresses and this thread's workspace
        resolved once; call it on this thread)."""
        ptrs = list(self._ptrs)
        for places, buf in zip(self._places, buffers):
            for i in places:
                ptrs[i] = buf.ctypes.data
        ptrs[PTR_C] = buffers[-1].ctypes.data
        work = self.backend.scratch(self.work_bytes)
        ptrs[PTR_WORK] = work.ctypes.data  # (64-byte aligned)
        arr = self._ptrs_t(*ptrs)
        f = functools.partial(self._fn, arr, *self.bounds[0]) if self._launch is None else \
            functools.partial(self._launch, arr)
        f.buffers = (buffers, work)  # alive while the launch is
        return f

    def __repr__(self):
        pr = self.prob
        return f"<GemmKernel {pr.batch}x{pr.m}x{pr.n}x{pr.k} {self.params}>"


def build_gemm(kernel, device, backend, params: GemmParams | None = None) -> GemmKernel:
    """Compile a dot_general kind kernel with the template (explicit params for the tuner)."""
    info = backend.info_of(device)
    prob = gemm_problem(kernel)
    if prob is None:
        raise CompileError(f"kernel {kernel.name} is not a GEMM the template can read",
                           kernel=str(kernel))
    return GemmKernel(prob, params or default_gemm_params(info), info, backend)


# ---- the candidates and the choice between them --------------------------------------------------

SMALL_FLOPS = 2 * 32 ** 3  # below this the generic kernel (no packing, no threads) is as fast
# The vendor must win by this much in isolation: one measurement on a shared machine is noisy,
# and OpenBLAS's threads keep spinning after a call, taking the cores from the kernels that
# follow — a cost the isolated measurement cannot see. The example's train step
# (benchmarks/bench_train.py, 2 idle cores): template only 55 ms, vendor only 90 ms (attention
# and elementwise kernels twice as slow beside the spinning threads), auto with a margin of 1.3
# 80 ms (some shape classes went to BLAS).
VENDOR_MARGIN = 2.0
MODES = ("auto", "generated", "vendor", "generic", "tiled")  # generic: the kernel IR's loop nest (to compare)
_measured: dict = {}  # shape class -> "generated" | "vendor"


def _best_time(fn, buffers, rounds: int = 5) -> float:
    """The best seconds of fn on buffers after two warm calls (pages touched, pool woken): the
    best is what the code can do, where medians on a shared machine also measure the neighbours."""
    import time
    fn(buffers)
    fn(buffers)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn(buffers)
        best = min(best, time.perf_counter() - t)
    return best


# OpenBLAS's threads spin for 2^28 cycles (~0.1 s measured) after a call: the template timed in that
# window shares its cores with them and looks two to three times slower (the vendor then won by
# the margin for some shape classes in a third of cold runs, and its spinning threads slowed the
# whole train step 2x). So the vendor is timed only when the template falls short of
# GOOD_FRACTION of the device's peak (no BLAS can then beat it by the margin), after it, and the
# template is never timed within VENDOR_SPIN_S of a vendor call.
GOOD_FRACTION = 0.25
VENDOR_SPIN_S = 0.12
_last_vendor_call = [0.0]


def _measure(kernel, prob: GemmProblem, device) -> str:
    """The template, unless it falls short of GOOD_FRACTION of the peak and the vendor is faster
    by VENDOR_MARGIN, twice over (one noisy verdict for the vendor costs every later step its
    spinning threads); timed on scratch buffers of the kernel's sizes."""
    import time
    backend = device.backend
    bufs = [backend.alloc(max(b.size * np.dtype(b.dtype).itemsize, 1), device) for b in kernel.buffers]
    try:
        for b in bufs:
            b.fill(0)
        gen, ven = build_gemm(kernel, device, backend), None
        for _ in range(2):
            time.sleep(max(0.0, _last_vendor_call[0] + VENDOR_SPIN_S - time.perf_counter()))
            t_gen = _best_time(gen, bufs)
            if prob.flops >= GOOD_FRACTION * device.info.peak_gflops * 1e9 * t_gen:
                return "generated"
            ven = ven or blas.build_vendor(prob)
            t_ven = _best_time(ven, bufs)
            _last_vendor_call[0] = time.perf_counter()
            if t_ven * VENDOR_MARGIN >= t_gen:
                return "generated"
        return "vendor"
    finally:
        for b in bufs:
            backend.free(b, device)


def choice(kernel, device) -> str:
    """"generated", "vendor" or "generic" (the kernel IR) for a dot_general kind kernel on the CPU:
    forced by TILEFUSE_GEMM / tx.config.gemm, else (auto) the generic kernel for tiny or
    unreadable problems, the template for 16-bit floats (numpy has no 16-bit BLAS), and
    otherwise the faster of the two, measured once per shape class."""
    from tilefuse.runtime.config import config
    mode = config.gemm
    if mode not in MODES:
        raise ValueError(f"tilefuse.config.gemm is {mode!r}; choose one of {', '.join(MODES)} "
                         "(or set TILEFUSE_GEMM)")
    prob = gemm_problem(kernel)
    if prob is None or prob.k == 0 or prob.batch * prob.m * prob.n == 0:
        return "generic"
    if mode != "auto":
        return mode
    if prob.flops < SMALL_FLOPS:
        return "generic"
    if prob.in_dtype != np.float32 or prob.out_dtype != np.float32:
        return "generated"
    key = prob.shape_class() + (bool(prob.epilogue),)
    if key not in _measured:  # measured once per machine: the verdict is kept in the disk cache
        cache = get_target(device.info).cache
        disk_key = compile_cache.make_key("gemm-choice", _DIGEST, repr(key), VENDOR_MARGIN,
                                          get_target(device.info).fingerprint)
        verdict = cache.get_or_build(disk_key, lambda: _measure(kernel, prob, device).encode())
        _measured[key] = verdict.decode() if verdict in (b"generated", b"vendor") else "generated"
    return _measured[key]


def _build_vendor(kernel, device, backend):
    return blas.build_vendor(gemm_problem(kernel))


for _kind in ("dot_general", "fused_gemm"):
    dispatch.register(dispatch.Implementation(
        "generated_gemm", _kind, build_gemm, ("cpu",),
        lambda kernel, device: choice(kernel, device) == "generated", priority=20))
    dispatch.register(dispatch.Implementation(
        "vendor_gemm", _kind, _build_vendor, ("cpu",),
        lambda kernel, device: choice(kernel, device) == "vendor", priority=15))


from tilefuse.runtime import tiled as _tiled  # noqa: E402  (comparison phase)
for _kind in ("dot_general", "fused_gemm"):
    dispatch.register(dispatch.Implementation(
        "tile_gemm", _kind, _tiled.gemm_build, ("cpu",),
        lambda kernel, device: choice(kernel, device) == "tiled" and _tiled.gemm_applies(kernel, device), priority=25))
