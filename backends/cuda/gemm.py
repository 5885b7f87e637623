"""The CUDA GEMM template: dot_general and fused_gemm as one kernel tiled through shared memory,
generated as NVPTX LLVM IR with llvmlite (PTX through render.to_ptx).

One thread block computes a BM x BN tile of C[b] (the 1-D grid walks batch, tile rows, tile
columns, columns fastest). Per step of BK along k the block's threads copy the A and B tiles
into shared memory (addrspace 3), zero past the edges, so any M, N and K runs without bounds
checks in the inner product; the operands are read through the dot_general's strides
(ir/kernel/matmul.py), so batched and transposed operands are never copied beforehand. The
copies walk each operand's unit-stride axis, in 16-byte vectors where the sizes and strides keep
them whole and aligned (buffers are 64-byte aligned: pool blocks and the planner's views), and
the next step's loads are issued before this step's products (their latency hides behind them).

- float16/bfloat16 operands: tensor cores. The block's warps form a warps_m x warps_n grid; a
  warp owns a (BM/warps_m) x (BN/warps_n) tile of 16 x 8 fragments, each accumulated in float32
  by `mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}` (inline PTX). Both tiles are kept k-major
  in shared memory (A as [m][k], B as [n][k], rows padded by 8 elements against bank conflicts),
  so `ldmatrix` (inline PTX) loads the fragments: four 8x8 matrices per instruction.
- float32 operands: a register-blocked SIMT micro-tile. The threads form an LY x LX grid
  (LY = 4 warps_m, LX = 8 warps_n); a thread owns rows ty + i LY and columns tx + j LX of the
  tile (neighbours read neighbouring addresses: coalesced stores, conflict-free shared loads) and
  accumulates them with one FMA per element per k.

The fused epilogue (bias, residual, affine, activations: ir/primitives.py fused_gemm) runs on
the float32 accumulators before the one store of C. The tile shape is a `CudaGemmParams`, chosen
from DeviceInfo by default (`default_params`) and open to the tuner (the "cuda_gemm" template)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from tilefuse.backends.llvm.gemm import GemmProblem, apply_epilogue, gemm_problem
from tilefuse.backends.llvmir.irutil import bf16_to_f32, counted_loop, f32_to_bf16
from tilefuse.ir.errors import CompileError
from tilefuse.runtime import tuner

from .render import TRIPLE, _sreg, to_ptx

F32, I16, I32, I64 = ir.FloatType(), ir.IntType(16), ir.IntType(32), ir.IntType(64)
HALF = ir.HalfType()
SHARED = 3  # the NVPTX address space of shared memory
WARP = 32
MMA_K = 16  # the depth of one m16n8k16 product
SIMT_PAD = 4  # float32 elements added to each shared row of the float32 tiles (keeps rows 16-byte aligned)
PAD16 = 8  # 16-bit elements added to each shared row of the tensor-core tiles (bank conflicts)
MAX_ACCUMULATORS = 128  # float32 accumulators per thread: more spills registers
MIN_FLOPS = 1 << 18  # smaller products: the generic kernel is as fast
MAX_GRID = (1 << 31) - 1


@dataclass(frozen=True)
class CudaGemmParams:
    """The tile of C per thread block (bm x bn, stepping bk along k) and its warps (a warps_m x
    warps_n grid; see the module docstring for how each variant lays its threads out)."""
    bm: int = 128
    bn: int = 128
    bk: int = 32
    warps_m: int = 2
    warps_n: int = 4

    @property
    def threads(self) -> int:
        return WARP * self.warps_m * self.warps_n

    def shared_bytes(self, tensor_cores: bool) -> int:
        if tensor_cores:
            return 2 * (self.bm + self.bn) * (self.bk + PAD16)
        return 4 * self.bk * (self.bm + self.bn + 2 * SIMT_PAD)

    @property
    def accumulators(self) -> int:
        """float32 accumulators per thread."""
        return self.bm * self.bn // self.threads

    def check(self, info, tensor_cores: bool) -> str | None:
        """None when the configuration runs on the device `info` describes, else why not."""
        if tensor_cores:
            if self.bm % (16 * self.warps_m) or self.bn % (8 * self.warps_n) or self.bk % MMA_K:
                return (f"a warp's tile must be whole 16x8 fragments and bk a multiple of {MMA_K}: "
                        f"{self}")
        elif self.bm % (4 * self.warps_m) or self.bn % (8 * self.warps_n):
            return f"the thread grid ({4 * self.warps_m} x {8 * self.warps_n}) must divide the tile: {self}"
        if (self.bm * self.bk) % self.threads or (self.bn * self.bk) % self.threads:
            return f"the tiles' copies must split evenly over {self.threads} threads: {self}"
        if self.threads > info.max_work_group:
            return f"{self.threads} threads exceed the device's {info.max_work_group} per block"
        if self.shared_bytes(tensor_cores) > info.local_mem_bytes:
            return (f"{self.shared_bytes(tensor_cores)} bytes of shared memory exceed the device's "
                    f"{info.local_mem_bytes} per block")
        if self.accumulators > MAX_ACCUMULATORS:
            return f"{self.accumulators} accumulators per thread exceed {MAX_ACCUMULATORS}"
        return None


# candidate tiles, largest first: 8 warps of 64 x 32 (tensor cores) or 8 x 8 (float32)
TENSOR_CORE_TILES = (CudaGemmParams(128, 128, 32, 2, 4), CudaGemmParams(64, 128, 32, 2, 4),
                     CudaGemmParams(64, 64, 32, 2, 2))
SIMT_TILES = (CudaGemmParams(128, 128, 16, 4, 2), CudaGemmParams(64, 64, 16, 2, 2))


def uses_tensor_cores(prob: GemmProblem) -> bool:
    return prob.in_dtype != np.float32


def tile_count(prob: GemmProblem, p: CudaGemmParams) -> int:
    """Thread blocks of the launch: one per tile of C in every batch."""
    return prob.batch * -(-prob.m // p.bm) * -(-prob.n // p.bn)


def default_params(info, prob: GemmProblem) -> CudaGemmParams:
    """The largest candidate tile that still gives every SM a block (small products take small
    tiles to spread over the SMs), among those the device can run."""
    tc = uses_tensor_cores(prob)
    ok = [p for p in (TENSOR_CORE_TILES if tc else SIMT_TILES) if p.check(info, tc) is None]
    if not ok:
        raise CompileError(f"no CUDA GEMM tile fits the device {info.name}")
    for p in ok:
        if tile_count(prob, p) >= info.compute_units:
            return p
    return ok[-1]


# ---- code generation --------------------------------------------------------------------------

def _c32(v):
    return ir.Constant(I32, int(v))


def _c64(v):
    return ir.Constant(I64, int(v))


_STORAGE = {"float32": F32, "float16": HALF, "bfloat16": I16}
_MMA_TYPE = {"float16": "f16", "bfloat16": "bf16"}


def _to_f32(b, v, dtype):
    name = np.dtype(dtype).name
    return v if name == "float32" else b.fpext(v, F32) if name == "float16" else bf16_to_f32(b, v)


def _from_f32(b, v, dtype):
    name = np.dtype(dtype).name
    return v if name == "float32" else b.fptrunc(v, HALF) if name == "float16" else f32_to_bf16(b, v)


class _Gen:
    """Emits the kernel of one problem: fn(ptr buf0, ..., ptr bufN), the kernel's buffers in
    order (its inputs, then C)."""

    def __init__(self, prob: GemmProblem, p: CudaGemmParams, fn_name: str):
        self.prob, self.p, self.fn_name = prob, p, fn_name
        self.tc = uses_tensor_cores(prob)

    def build(self) -> str:
        prob = self.prob
        mod = self.mod = ir.Module(name=self.fn_name)
        mod.triple = TRIPLE
        n_bufs = len(prob.roles) + 1
        fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [ir.PointerType()] * n_bufs),
                         name=self.fn_name)
        fn.calling_convention = "ptx_kernel"
        fn.attributes.add("nounwind")
        # the block size, so that ptxas budgets registers for it (not for 1024 threads)
        mod.add_named_metadata("nvvm.annotations").add(
            mod.add_metadata([fn, ir.MetaDataString(mod, "maxntidx"), _c32(self.p.threads)]))
        b = self.b = ir.IRBuilder(fn.append_basic_block("entry"))
        args = list(fn.args)
        place = {}
        for i, roles in enumerate(prob.roles):
            for r in roles:
                place[r] = args[i]
        self.a_ptr, self.b_ptr, self.c_ptr = place["lhs"], place["rhs"], args[-1]
        self.extras = [place[i] for i in range(len(prob.extra_strides))]
        self.tid = _sreg(b, "tid.x")
        self._tile_origin(_sreg(b, "ctaid.x"))
        if self.tc:
            self._tensor_core_body()
        else:
            self._simt_body()
        b.ret_void()
        return str(mod)

    # -- helpers -------------------------------------------------------------------------------
    def _tile_origin(self, bid):
        """z (batch), m0, n0 (the tile's first row and column) as i64, from the block index."""
        b, p, prob = self.b, self.p, self.prob
        tiles_n, tiles_m = -(-prob.n // p.bn), -(-prob.m // p.bm)
        bid = b.zext(bid, I64)
        self.z = b.udiv(bid, _c64(tiles_m * tiles_n))
        rest = b.urem(bid, _c64(tiles_m * tiles_n))
        self.m0 = b.mul(b.udiv(rest, _c64(tiles_n)), _c64(p.bm))
        self.n0 = b.mul(b.urem(rest, _c64(tiles_n)), _c64(p.bn))

    def _shared(self, name: str, ty, count: int):
        g = ir.GlobalVariable(self.mod, ir.ArrayType(ty, count), name=name, addrspace=SHARED)
        g.type = ir.PointerType(addrspace=SHARED)  # an opaque pointer, like the kernel's arguments
        g.linkage = "internal"
        g.align = 16
        g.initializer = ir.Constant(g.value_type, ir.Undefined)
        return g

    def _barrier(self):
        name = "llvm.nvvm.barrier0"
        fn = self.mod.globals.get(name) or ir.Function(self.mod, ir.FunctionType(ir.VoidType(), []), name=name)
        self.b.call(fn, [])

    def _accumulators(self, count: int):
        """float32 accumulators (allocas in the entry block, promoted to registers), zeroed."""
        b = self.b  # still in the entry block
        accs = [b.alloca(F32) for _ in range(count)]
        for a in accs:
            b.store(ir.Constant(F32, 0.0), a)
        return accs

    def _copier(self, operand: str, smem, k_major_shared: bool, at) -> _TileCopy:
        """The copies of operand "a" (rows m) or "b" (rows n) into its shared tile."""
        prob, b = self.prob, self.b
        st = _STORAGE[prob.in_dtype.name]
        if operand == "a":
            (sz, s_outer, s_k), extent, origin, rows = prob.a_strides, prob.m, self.m0, self.p.bm
            base = self.a_ptr
        else:
            (sz, s_k, s_outer), extent, origin, rows = prob.b_strides, prob.n, self.n0, self.p.bn
            base = self.b_ptr
        src = b.gep(base, [b.mul(self.z, _c64(sz))], inbounds=True, source_etype=st)
        return _TileCopy(self, src, extent, origin, s_outer, s_k, rows, sz, st, smem, k_major_shared, at)

    def _k_loop(self, copies, products):
        """for k0 in range(0, K, bk): the tiles at k0 into shared memory, barrier, products(),
        barrier (the next copy overwrites the tiles). The loads of the next tiles are issued
        before the products and stored after them, so their latency hides behind the math; past
        K they read zeros, so the last step needs no test."""
        b, bk = self.b, self.p.bk
        fetch = lambda k0: [v for c in copies for v in c.fetch(k0)]
        counts = [len(c.slots) for c in copies]

        def step(k0, regs):
            regs = list(regs)
            for c, n in zip(copies, counts):
                c.put(regs[:n])
                regs = regs[n:]
            self._barrier()
            nxt = fetch(b.add(k0, _c64(bk)))
            products()
            self._barrier()
            return nxt
        counted_loop(b, _c64(0), _c64(self.prob.k), step, step=bk, name="k0", carried=fetch(_c64(0)))

    def _store(self, acc, row, col):
        """C[z, m0 + row, n0 + col] = epilogue(acc) where inside C (row, col: i32 in the tile)."""
        b, prob = self.b, self.prob
        r, c = b.add(self.m0, b.zext(row, I64)), b.add(self.n0, b.zext(col, I64))
        inside = b.and_(b.icmp_unsigned("<", r, _c64(prob.m)), b.icmp_unsigned("<", c, _c64(prob.n)))
        with b.if_then(inside):
            v = b.load(acc, typ=F32)
            out = prob.out_dtype
            st = _STORAGE[out.name]
            if prob.epilogue is not None:
                xs = []
                for (sb, sm), ptr in zip(prob.extra_strides, self.extras):
                    off = b.add(b.add(b.mul(self.z, _c64(sb)), b.mul(r, _c64(sm))), c)
                    xs.append(_to_f32(b, b.load(b.gep(ptr, [off], inbounds=True, source_etype=st), typ=st), out))
                v = apply_epilogue(b, prob.epilogue, [v, *xs])
            off = b.add(b.mul(self.z, _c64(prob.m * prob.n)), b.add(b.mul(r, _c64(prob.n)), c))
            b.store(_from_f32(b, v, out), b.gep(self.c_ptr, [off], inbounds=True, source_etype=st))

    # -- float16/bfloat16: tensor cores ------------------------------------------------------
    def _mma(self):
        """The inline PTX of one m16n8k16 product: (a0..a3, b0, b1, c0..c3) -> {d0..d3}."""
        t = _MMA_TYPE[self.prob.in_dtype.name]
        ty = ir.FunctionType(ir.LiteralStructType([F32] * 4), [I32] * 6 + [F32] * 4)
        return ir.InlineAsm(
            ty, f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 "
                "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")

    def _ldmatrix(self, count: int):
        """ldmatrix of `count` 8x8 16-bit matrices from shared memory: (address) -> count regs.
        It reads memory the barrier orders: a side effect, so LLVM keeps it in place."""
        regs = ",".join(f"${i}" for i in range(count))
        ty = ir.FunctionType(ir.LiteralStructType([I32] * count), [I32])
        return ir.InlineAsm(ty, f"ldmatrix.sync.aligned.m8n8.x{count}.shared.b16 {{{regs}}}, [${count}];",
                            ",".join(["=r"] * count + ["r", "~{memory}"]), side_effect=True)

    def _tensor_core_body(self):
        b, p = self.b, self.p
        ld = p.bk + PAD16  # shared row length (16-bit elements); rows start 16-byte aligned
        a_s = self._shared("a_tile", I16, p.bm * ld)
        b_s = self._shared("b_tile", I16, p.bn * ld)
        wtm, wtn = p.bm // p.warps_m, p.bn // p.warps_n
        mi_n, ni_n = wtm // 16, wtn // 8
        warp, lane = b.udiv(self.tid, _c32(WARP)), b.urem(self.tid, _c32(WARP))
        g, t2 = b.lshr(lane, _c32(2)), b.mul(b.and_(lane, _c32(3)), _c32(2))  # group, 2 x thread in group
        wm0 = b.mul(b.udiv(warp, _c32(p.warps_n)), _c32(wtm))
        wn0 = b.mul(b.urem(warp, _c32(p.warps_n)), _c32(wtn))
        acc = self._accumulators(mi_n * ni_n * 4)
        row_major = lambda o, kk: b.add(b.mul(o, _c32(ld)), kk)
        copies = [self._copier("a", a_s, True, row_major), self._copier("b", b_s, True, row_major)]
        mma, x4, x2 = self._mma(), self._ldmatrix(4), self._ldmatrix(2)

        def address(smem, row, kk):  # the 32-bit shared address of [row][kk]
            return b.ptrtoint(b.gep(smem, [row_major(row, kk)], inbounds=True, source_etype=I16), I32)

        def regs(asm, addr, n):
            r = b.call(asm, [addr])
            return [b.extract_value(r, i) for i in range(n)]
        # ldmatrix: lanes 8i..8i+7 give the rows of matrix i. A (x4): the matrices (rows 0-7, k 0-7),
        # (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) are the fragment registers
        # a0..a3 of m16n8k16 (PTX ISA); B, kept [n][k] (x4: two n fragments of 8): (n 0-7, k 0-7),
        # (n 0-7, k 8-15), then n 8-15. Lane l's row and k offset:
        a_row = b.add(wm0, b.urem(lane, _c32(16)))
        a_k = b.mul(b.udiv(lane, _c32(16)), _c32(8))
        b_row = b.add(wn0, b.add(b.urem(lane, _c32(8)), b.mul(b.udiv(lane, _c32(16)), _c32(8))))
        b_k = b.mul(b.and_(b.udiv(lane, _c32(8)), _c32(1)), _c32(8))

        def products():
            for kk in range(0, p.bk, MMA_K):
                a_frag = [regs(x4, address(a_s, b.add(a_row, _c32(mi * 16)), b.add(a_k, _c32(kk))), 4)
                          for mi in range(mi_n)]
                b_frag = []
                for ni in range(0, ni_n, 2):
                    n = b.add(b_row, _c32(ni * 8))
                    if ni + 1 < ni_n:
                        r = regs(x4, address(b_s, n, b.add(b_k, _c32(kk))), 4)
                        b_frag += [r[:2], r[2:]]
                    else:  # an odd last fragment: lanes 0-15 give its rows (x2 reads only those)
                        b_frag.append(regs(x2, address(b_s, n, b.add(b_k, _c32(kk))), 2))
                for mi in range(mi_n):
                    for ni in range(ni_n):
                        cs = acc[(mi * ni_n + ni) * 4:][:4]
                        d = b.call(mma, a_frag[mi] + b_frag[ni] + [b.load(x, typ=F32) for x in cs])
                        for i, x in enumerate(cs):
                            b.store(b.extract_value(d, i), x)
        self._k_loop(copies, products)
        # the accumulators (PTX ISA, m16n8k16): c0, c1 at (g, t2), (g, t2 + 1); c2, c3 at row g + 8
        for mi in range(mi_n):
            for ni in range(ni_n):
                for i in range(4):
                    row = b.add(b.add(wm0, g), _c32(mi * 16 + 8 * (i >> 1)))
                    col = b.add(b.add(wn0, t2), _c32(ni * 8 + (i & 1)))
                    self._store(acc[(mi * ni_n + ni) * 4 + i], row, col)

    # -- float32: register-blocked SIMT --------------------------------------------------------
    def _simt_body(self):
        b, p = self.b, self.p
        lx, ly = 8 * p.warps_n, 4 * p.warps_m
        tm, tn = p.bm // ly, p.bn // lx
        lda, ldb = p.bm + SIMT_PAD, p.bn + SIMT_PAD  # [k][m] and [k][n]
        a_s = self._shared("a_tile", F32, p.bk * lda)
        b_s = self._shared("b_tile", F32, p.bk * ldb)
        tx, ty = b.urem(self.tid, _c32(lx)), b.udiv(self.tid, _c32(lx))
        acc = self._accumulators(tm * tn)
        copies = [self._copier("a", a_s, False, lambda o, kk: b.add(b.mul(kk, _c32(lda)), o)),
                  self._copier("b", b_s, False, lambda o, kk: b.add(b.mul(kk, _c32(ldb)), o))]

        def load(smem, i):
            return b.load(b.gep(smem, [i], inbounds=True, source_etype=F32), typ=F32)

        def products():
            for kk in range(p.bk):
                ra = [load(a_s, b.add(ty, _c32(kk * lda + i * ly))) for i in range(tm)]
                rb = [load(b_s, b.add(tx, _c32(kk * ldb + j * lx))) for j in range(tn)]
                for i in range(tm):
                    for j in range(tn):
                        x = acc[i * tn + j]
                        b.store(b.fma(ra[i], rb[j], b.load(x, typ=F32)), x)
        self._k_loop(copies, products)
        for i in range(tm):
            for j in range(tn):
                self._store(acc[i * tn + j], b.add(ty, _c32(i * ly)), b.add(tx, _c32(j * lx)))


class _TileCopy:
    """A thread's share of copying one operand's rows x bk tile (rows along its free axis from
    `origin`, k from k0) into shared memory at at(row, kk), zero outside the operand. Threads walk
    the operand's unit-stride axis fastest (coalesced reads), in 16-byte vectors where that axis
    and every other stride keep them whole and aligned (then a vector is all inside or all out)."""

    def __init__(self, gen: _Gen, src, extent: int, origin, s_outer: int, s_k: int, rows: int,
                 s_batch: int, storage, smem, k_major_shared: bool, at):
        b, p, K = gen.b, gen.p, gen.prob.k
        self.gen, self.src, self.extent, self.origin = gen, src, extent, origin
        self.s_outer, self.s_k, self.storage, self.smem, self.at = s_outer, s_k, storage, smem, at
        self.k_fast = s_k == 1 and s_outer != 1
        fast, fast_extent, slow_stride = (p.bk, K, s_outer) if self.k_fast else (rows, extent, s_k)
        vec = 16 // gen.prob.in_dtype.itemsize
        unit = s_k == 1 if self.k_fast else s_outer == 1
        if not (unit and fast % vec == 0 and fast_extent % vec == 0 and slow_stride % vec == 0
                and s_batch % vec == 0 and (rows * p.bk // vec) % p.threads == 0):
            vec = 1
        self.vec = vec
        # offsets within the batch in 32 bits where they fit: half the registers of 64-bit ones
        last = (extent - 1) * s_outer + (K - 1) * s_k
        self.index_type = I32 if last < (1 << 31) - 1 else I64
        self.align = vec * gen.prob.in_dtype.itemsize  # bytes: a vector sits at a multiple of its size
        # the vector is stored whole when shared memory runs along the same axis
        self.whole = vec > 1 and self.k_fast == k_major_shared
        self.slots = []  # (row, kk) of each of the thread's vectors, as i32
        per_row = fast // vec
        for j in range(rows * p.bk // vec // p.threads):
            i = b.add(gen.tid, _c32(j * p.threads))
            lo, hi = b.mul(b.urem(i, _c32(per_row)), _c32(vec)), b.udiv(i, _c32(per_row))
            self.slots.append((hi, lo) if self.k_fast else (lo, hi))

    def fetch(self, k0) -> list:
        """The thread's vectors of the tile at k0 (global loads; zeros outside the operand)."""
        b, K, st, vec = self.gen.b, self.gen.prob.k, self.storage, self.vec
        ty = st if vec == 1 else ir.VectorType(st, vec)
        zero = ir.Constant(ty, None)  # zeroinitializer: +0.0 of every float type
        out = []
        it = self.index_type
        c = lambda v: ir.Constant(it, int(v))
        origin = self.origin if it is I64 else b.trunc(self.origin, it)
        k0 = k0 if it is I64 else b.trunc(k0, it)
        for oo, kk in self.slots:
            o, k = b.add(origin, b.zext(oo, it)), b.add(k0, b.zext(kk, it))
            inside = b.and_(b.icmp_unsigned("<", o, c(self.extent)), b.icmp_unsigned("<", k, c(K)))
            off = b.select(inside, b.add(b.mul(o, c(self.s_outer)), b.mul(k, c(self.s_k))), c(0))
            v = b.load(b.gep(self.src, [off], inbounds=True, source_etype=st), typ=ty, align=self.align)
            out.append(b.select(inside, v, zero))
        return out

    def put(self, values) -> None:
        """Store fetched vectors into the shared tile."""
        b, st = self.gen.b, self.storage
        for (oo, kk), v in zip(self.slots, values):
            if self.vec == 1 or self.whole:
                b.store(v, b.gep(self.smem, [self.at(oo, kk)], inbounds=True, source_etype=st),
                        align=self.align)
                continue
            for e in range(self.vec):  # the vector crosses the shared rows: element by element
                row, k = (oo, b.add(kk, _c32(e))) if self.k_fast else (b.add(oo, _c32(e)), kk)
                b.store(b.extract_element(v, _c32(e)),
                        b.gep(self.smem, [self.at(row, k)], inbounds=True, source_etype=st))


# ---- building and running ---------------------------------------------------------------------

def kernel_source(prob: GemmProblem, p: CudaGemmParams, fn_name: str, sm: str) -> tuple[str, str]:
    """(LLVM IR, PTX) of the template for one problem and tile configuration."""
    text = _Gen(prob, p, fn_name).build()
    return text, to_ptx(text, sm)


def applies(kernel, device) -> bool:
    """A dot_general or fused_gemm whose operands read through strides (float32, float16 or
    bfloat16, C dense), large enough to gain from tiles; the grid must fit one launch."""
    prob = gemm_problem(kernel)
    if prob is None or prob.k == 0 or prob.flops < MIN_FLOPS:
        return False
    info = device.info
    try:
        p = default_params(info, prob)
    except CompileError:
        return False
    return tile_count(prob, p) <= MAX_GRID


def build(kernel, device, backend, params: CudaGemmParams | None = None):
    """The kernel compiled with the template (explicit params for the tuner): a CudaKernel whose
    launch is one block per tile."""
    from . import CudaKernel, _fn_name
    prob = gemm_problem(kernel)
    if prob is None:
        raise CompileError(f"kernel {kernel.name} is not a GEMM the CUDA template can read",
                           kernel=str(kernel))
    info = backend.info_of(device)
    p = params or default_params(info, prob)
    why = p.check(info, uses_tensor_cores(prob))
    if why:
        raise CompileError(f"CUDA GEMM tile: {why}", kernel=str(kernel))
    sm = info.extra.get("sm", "sm_80")
    key = ("gemm", str(kernel), sm, p)
    hit = backend._ptx.get(key)
    if hit is None:
        name = _fn_name(kernel) + "_gemm"
        hit = backend._ptx[key] = (name, *kernel_source(prob, p, name, sm))
    run = CudaKernel(kernel, *hit, backend, device)
    run.grid, run.block = tile_count(prob, p), p.threads
    return run


# ---- the tuner's view --------------------------------------------------------------------------
# Every configuration is a compile; CudaGemmParams.check prunes what the device cannot run.

def _space(kernel, device) -> dict:
    return {"bm": (32, 64, 128, 256), "bn": (32, 64, 128, 256), "bk": (8, 16, 32, 64),
            "warps_m": (1, 2, 4), "warps_n": (1, 2, 4)}


def _default(kernel, device) -> dict:
    return dataclasses.asdict(default_params(device.info, gemm_problem(kernel)))


def _check(params: dict, kernel, device) -> str | None:
    return CudaGemmParams(**params).check(device.info, uses_tensor_cores(gemm_problem(kernel)))


def _build(kernel, device, backend, params: dict):
    return build(kernel, device, backend, CudaGemmParams(**params))


tuner.register(tuner.Template("cuda_gemm", "cuda_gemm", ("cuda",), _space, _default, _build, _check,
                              applies=applies))


__all__ = ["CudaGemmParams", "applies", "build", "default_params", "kernel_source", "tile_count"]
