"""GEMM written once, as a tile kernel: C[z, i, j] = epilogue(sum_k A[z, i, k] B[z, k, j], extras)
for operands at any strides (transposed and batched operands are read in place), 16-bit inputs
accumulated in float32, and any fused_gemm epilogue (a ScalarFn, lowered by lower.epilogue_expr).

One parameter space (GemmSchedule), two forms of one algorithm, picked by the target:
- "shared" (GPUs): a work-group computes a tm x tn tile of C; its work-items stage tk-deep panels of
  A and B through shared memory (zeros past the edges), then each accumulates a wm x wn block in
  registers at rows ty + i*LY and columns tx + j*LX, so neighbouring work-items touch
  neighbouring addresses.
- "packed" (CPUs): a task computes an mc x nc block of C; it packs its K x nc panel of B into
  scratch memory once (any layout and dtype in, float32 vectors out, zeros past N), then runs a
  register micro-kernel of wm rows x wn vectors of `vec` lanes over it, A's elements broadcast
  from where they lie.
`default_schedule` derives the parameters from the Target; the tuner searches `space`."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from .. import dtypes
from .ir import INDEX, Buffer, KExpr, binary, cast, const, select, unary
from .lower import epilogue_expr, iadd, imul
from .matmul import MatmulLayout, matmul_layout
from .target import Target
from .tile import (MMA_LAYOUTS, WARP, Alloc, Barrier, If, Range, Store, TileKernel, at_grid_extent, broadcast, mma,
                   size, tload, var, vload)

F32 = np.dtype(np.float32)
_POWERS = (16, 8, 4, 2, 1)
PAD = 8  # elements between the MMA form's k-contiguous panel rows (16 bytes: rows start in other banks)
A_PAD = 16  # elements past each row of a packed micro-panel of A (a 64-byte line: its rows fall in
#             different L1 sets, where rows kc floats apart, 2-8 KiB, would share one: _rows_in_l1)


@dataclass(frozen=True)
class GemmSpec:
    """The problem: the strided view, dtypes, the epilogue, and the kernel buffers' roles."""
    layout: MatmulLayout
    out_dtype: np.dtype
    epilogue: object       # a ScalarFn of (product, *extras), or None
    a: int                 # buffer numbers in the kernel
    b: int
    extras: tuple          # per extra: (buffer number, whether it has C's shape (else a row along n;
    #                        a conv's: a vector along its output features, the GEMM's rows))
    c: int
    conv: object = None    # a conv.ConvView: B is its patch matrix, read through the lhs (implicit GEMM)

    @property
    def acc_dtype(self) -> np.dtype:
        return dtypes.compute_dtype(self.layout.dtype)


def gemm_spec(kernel) -> GemmSpec | None:
    """The GEMM a dot_general or fused_gemm kernel poses, or None when its operands cannot be
    read through strides (a literal operand, axes that do not collapse)."""
    eqns, operands = kernel.meta.get("eqns", ()), kernel.meta.get("operands")
    if len(eqns) != 1 or operands is None or eqns[0].prim.name not in ("dot_general", "fused_gemm"):
        return None
    e = eqns[0]
    if not all(hasattr(a, "id") for a in e.inputs):
        return None
    lay = matmul_layout(e)
    out = e.outputs[0].aval
    if lay is None or not dtypes.is_float(lay.dtype) or not dtypes.is_float(out.dtype):
        return None
    pos = {v.id: i for i, v in enumerate(operands)}
    extras = []
    for x in e.inputs[2:]:
        if x.aval.shape not in (out.shape, (lay.n,)):
            return None
        extras.append((pos[x.id], x.aval.shape == out.shape))
    return GemmSpec(lay, np.dtype(out.dtype), e.params.get("epilogue"), pos[e.inputs[0].id],
                    pos[e.inputs[1].id], tuple(extras), kernel.n_inputs)


@dataclass(frozen=True)
class GemmSchedule:
    """shared: the GPU form (tm, tn, tk, wm, wn; vec 1); else the CPU form (mc, nc, wm, wn, vec,
    and kc: K in blocks of at most kc, 0 for one block; pack_a: A's micro-panels packed too)."""
    shared: bool
    wm: int
    wn: int
    vec: int = 1
    tm: int = 0
    tn: int = 0
    tk: int = 0
    mc: int = 0
    nc: int = 0
    mma: str = ""  # shared form: a warp's MMA instruction (ir/kernel/tile.MMA_LAYOUTS) multiplies,
    #               wm x wn of its tiles per warp (a work-item's register tile otherwise)
    kc: int = 0
    pack_a: bool = False

    def check(self, spec: GemmSpec, target: Target) -> str | None:
        """Why this schedule cannot run on the target, or None."""
        if min(self.wm, self.wn, self.vec) < 1:
            return f"{self}: register tiles of at least one element"
        if self.mma:
            return self._check_mma(spec, target)
        if self.shared:
            if target.shared_bytes == 0:
                return "the target has no shared memory"
            if self.vec != 1 or self.tm % self.wm or self.tn % self.wn or self.tk < 1:
                return f"{self}: tm, tn multiples of wm, wn; vec 1"
            group = (self.tm // self.wm) * (self.tn // self.wn)
            if group > target.max_group:
                return f"{group} work-items exceed the work-group limit {target.max_group}"
            if (self.tm + self.tn) * self.tk * 4 > target.shared_bytes:
                return f"panels of {(self.tm + self.tn) * self.tk * 4} bytes exceed shared memory"
            return None
        if self.vec not in (1, 2, 4, 8, 16) or self.mc % self.wm or self.nc % (self.wn * self.vec):
            return f"{self}: vec a power of two to 16; mc, nc multiples of the register tile"
        if self.wm * self.wn > max(4, target.vector_registers - 4):
            return f"a {self.wm} x {self.wn} register tile exceeds {target.vector_registers} registers"
        kc, blocks = _k_blocks(spec.layout.k, self.kc)
        if blocks > 1 and spec.out_dtype != F32:
            return f"K in {blocks} blocks: the partial sums need a float32 C, not {spec.out_dtype}"
        kc_alloc = _k_depth(spec, self.kc, target.runtime_batch)
        scratch = 4 * (kc_alloc * self.nc + self.wm * (kc_alloc + A_PAD) * self.pack_a)
        if scratch > SCRATCH_BYTES:
            return f"packed panels of {scratch} bytes exceed the {SCRATCH_BYTES} bytes of a task's scratch"
        return None

    def _check_mma(self, spec: GemmSpec, target: Target) -> str | None:
        if _mma_for(spec, target) != self.mma or not self.shared:
            return f"{self}: the target has no {self.mma} MMA for {spec.layout.dtype} (or not in the shared form)"
        (fm, fn, fk), _, _, _ = MMA_LAYOUTS[self.mma]
        if self.tm % (fm * self.wm) or self.tn % (fn * self.wn) or self.tk % fk:
            return f"{self}: tm, tn, tk multiples of the warp tile {fm * self.wm} x {fn * self.wn} and of k {fk}"
        group = self.tm // (fm * self.wm) * (self.tn // (fn * self.wn)) * WARP
        if group > target.max_group:
            return f"{group} work-items exceed the work-group limit {target.max_group}"
        panels = (self.tm + self.tn) * (self.tk + PAD) * spec.layout.dtype.itemsize
        if panels > target.shared_bytes:
            return f"panels of {panels} bytes exceed shared memory"
        return None


def _mma_for(spec: GemmSpec, target: Target) -> str:
    """The target's MMA instruction for the spec's operands ("": none), in the shared form only."""
    if not _shared_form(target) or target.warp != WARP:
        return ""
    return next((m.name for m in target.mma if m.name in MMA_LAYOUTS and m.in_dtype == spec.layout.dtype.name
                 and m.acc_dtype == spec.acc_dtype.name), "")


SCRATCH_BYTES = 4 << 20  # a CPU task's packed panels live on its thread's stack (8 MiB by default)


def _k_blocks(k: int, kc: int) -> tuple[int, int]:
    """(block depth, blocks): K in blocks of at most kc (0: one block), equal but for the last."""
    blocks = _ceil(k, kc) if 0 < kc < k else 1
    return _ceil(max(k, 1), blocks), blocks


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _sized(spec: GemmSpec, runtime: bool) -> bool:
    """Whether the packed form reads M (and K in blocks) as run-time sizes: where the target takes
    sizes at run time and the product is one matrix, whose rows are where a batch's rows go
    (x @ W over batch x sequence rows); N, the strides and a batched product's M stay constants."""
    return runtime and spec.layout.batch == 1 and spec.conv is None


def _k_sized(spec: GemmSpec, kc: int, runtime: bool) -> bool:
    """Whether K is a run-time size too, in blocks of at most kc whose partial sums a float32 C
    holds: where K is more than one block, or where A is read transposed (xᵀ·dy, a weight's
    gradient, whose K is the batch's rows: a small batch reuses the code too; as fast as a
    constant K, measured at 128 x 320 x 384). A forward product's K of one block (the model's
    width) stays a constant: its loop count seen, 2048 x 128 x 384 ran 3-4% faster."""
    lay = spec.layout
    return (_sized(spec, runtime) and 0 < kc and spec.out_dtype == F32
            and (kc < lay.k or lay.a_strides[2] != 1))


def _k_depth(spec: GemmSpec, kc: int, runtime: bool) -> int:
    """The packed panels' depth under a schedule's kc: kc where K is a run-time size, else K's block."""
    return kc if _k_sized(spec, kc, runtime) else _k_blocks(spec.layout.k, kc)[0]


RUNTIME_SIZES = ("m", "k", "row_blocks", "mc_tiles", "k_blocks", "k_depth")


def launch_sizes(spec: GemmSpec, sched: GemmSchedule) -> dict:
    """The packed form's sizes for one launch (RUNTIME_SIZES: tile.size(i) is the i-th)."""
    lay = spec.layout
    kd, blocks = _k_blocks(lay.k, sched.kc)
    return {"m": lay.m, "k": lay.k, "row_blocks": _ceil(lay.m, sched.mc), "mc_tiles": sched.mc // sched.wm,
            "k_blocks": blocks, "k_depth": kd}


def default_schedule(spec: GemmSpec, target: Target) -> GemmSchedule:
    """The parameters the target's description implies (the tuner may find better ones)."""
    lay = spec.layout
    mma = _mma_for(spec, target)
    if mma:  # four or eight warps, each wm x wn MMA tiles
        tile = next(t for t in (128, 64, 32) if lay.m * lay.n >= t * t * target.cores or t == 32)
        wm, wn = {128: (4, 4), 64: (2, 4), 32: (1, 2)}[tile]
        return GemmSchedule(True, wm, wn, 1, tm=tile, tn=tile, tk=32, mma=mma)
    if _shared_form(target):
        tile = 64 if lay.m * lay.n >= 64 * 64 * target.cores else 32
        wm = wn = 4 if tile == 64 else 2
        while (tile // wm) * (tile // wn) > target.max_group:
            wm, wn = wm * 2, wn * 2
        return GemmSchedule(True, wm, wn, 1, tm=tile, tn=tile, tk=8)
    vec = max(1, target.lanes)
    # register tile: wm rows x wn vectors, leaving registers for B's row and A's broadcast
    wn = 2 if lay.n > vec else 1
    wm = max(1, min(12, (target.vector_registers - wn - 2) // wn, lay.m))
    nr = wn * vec
    # K in blocks whose micro-panel of B (kc x nr) is about twice L1 (it streams from L2; a deep
    # block amortises the round trip of C's partial sums); one block for a 16-bit C
    kc_most = max(64, 2 * target.l1_bytes // (4 * nr) // 16 * 16) if spec.out_dtype == F32 else 0
    kc, _ = _k_blocks(lay.k, kc_most)
    generic = _sized(spec, target.runtime_batch)
    # where sizes come at run time, kc bounds the blocks whatever K is (the code keeps to K's blocks)
    kc_field = kc_most if generic and kc_most else (kc if kc < lay.k else 0)
    # A packed where its elements cost more to read in place: 16 bits (converted once), k strided, or
    # a driver's compiler, which may not keep the wm clamped row addresses in integer registers
    # across the k loop (PoCL's LLVM 15 moved them into vector registers and spilled the register
    # tile); a packed micro-panel is one pointer at constant offsets, whatever the compiler
    pack_a = lay.dtype != F32 or lay.a_strides[2] != 1 or target.driver_compiled
    if not pack_a:  # A's rows in place: no more of them in one L1 set than it has ways, else packed
        fit = _rows_in_l1(wm, lay.a_strides[1] * lay.dtype.itemsize, target)
        wm, pack_a = (fit, False) if fit >= 4 else (wm, True)
    # the packed panel of B (kc x nc floats) stays in L2 beside the micro-kernel's traffic
    nc_most = max(nr, (target.l2_bytes // 2) // (4 * _k_depth(spec, kc_field, target.runtime_batch)) // nr * nr)
    mc, nc = _task_blocks(spec, wm, nr, nc_most, pack_a, target.cores, generic)
    return GemmSchedule(False, wm, wn, vec, mc=mc, nc=nc, kc=kc_field, pack_a=pack_a)


def _rows_in_l1(wm: int, row_bytes: int, target: Target, line: int = 64) -> int:
    """The most of wm rows of A, read in place row_bytes apart, that the micro-kernel can stream
    together: rows whose lines fall in one L1 set beyond its ways evict one another at every k
    step (a square 1024 or 2048, 4 or 8 KiB apart: 12 rows on Zen 4's 8-way 32 KiB L1 ran at
    0.77-0.79x numpy's BLAS, 8 rows at 0.99-1.1x; a 12-way L1 keeps 12)."""
    sets = max(1, target.l1_bytes // (line * target.l1_ways))
    while wm > 1 and max(Counter(r * row_bytes // line % sets for r in range(wm)).values()) > target.l1_ways:
        wm -= 1
    return wm


def _task_blocks(spec: GemmSpec, wm: int, nr: int, nc_most: int, pack_a: bool, cores: int, generic_m: bool):
    """(mc, nc): the task blocks whose longest thread finishes first. The thread pool runs the
    tasks (batch, column block, row block: the last fastest) in contiguous chunks that the cores
    claim as they come (backends/llvm: up to 8 a core), weighed here as one chunk per core;
    a task costs its micro-tiles' multiply-adds and its reads of A and B (each task packs its own
    panel of B and reads its rows of A: more tasks balance better but read more), in multiply-adds.
    generic_m: M is a run-time size (_sized), so nc, which the code keeps, depends on N alone (the
    fewest column blocks) and mc, a run-time size too, balances the rows."""
    lay = spec.layout
    per_elem_b = 4 if lay.b_strides[2] == 1 else 16  # whole vectors, or element by element
    per_elem_a = 16 if pack_a and lay.a_strides[2] != 1 else 4  # element by element, or along k
    best = None
    fewest = _ceil(lay.n, nc_most)
    for bn in range(fewest, fewest + 1 if generic_m else min(_ceil(lay.n, nr), fewest + 8) + 1):
        nc = _ceil(_ceil(lay.n, bn), nr) * nr
        for bm in range(1, min(_ceil(lay.m, wm), 4 * cores) + 1):
            mc = _ceil(_ceil(lay.m, bm), wm) * wm
            tn, tm = _ceil(lay.n, nc), _ceil(lay.m, mc)
            one = [(_ceil(min(mc, lay.m - i * mc), wm) * wm * _ceil(min(nc, lay.n - j * nc), nr) * nr
                    + nc * per_elem_b + mc * per_elem_a) * lay.k
                   for j in range(tn) for i in range(tm)]
            costs = one * lay.batch
            if len(costs) > 4096:
                continue
            threads = min(cores, len(costs))
            per = _ceil(len(costs), threads)
            span = max(sum(costs[s:s + per]) for s in range(0, len(costs), per))
            if best is None or (span, len(costs)) < best[0]:
                best = (span, len(costs)), (mc, nc)
    if best is None:  # a batch too large to weigh: one task per matrix
        return _ceil(lay.m, wm) * wm, min(nc_most, _ceil(lay.n, nr) * nr)
    return best[1]


def _shared_form(target: Target) -> bool:
    return target.kind == "gpu" and target.shared_bytes > 0


SHARED_FIELDS = ("tm", "tn", "tk", "wm", "wn")
PACKED_FIELDS = ("wm", "wn", "vec", "mc", "nc", "kc", "pack_a")


def space(spec: GemmSpec, target: Target) -> dict:
    """The tuner's search space (schedule fields -> candidate values): the target's form's fields."""
    mma = _mma_for(spec, target)
    if mma:
        return {"tm": (32, 64, 128), "tn": (32, 64, 128), "tk": (16, 32, 64), "wm": (1, 2, 4), "wn": (1, 2, 4, 8),
                "mma": (mma,)}
    if _shared_form(target):
        return {"tm": (32, 64, 128), "tn": (32, 64, 128), "tk": (8, 16, 32), "wm": (2, 4, 8), "wn": (2, 4, 8)}
    return {"wm": (2, 4, 6, 8, 12), "wn": (1, 2, 3, 4), "vec": (4, 8, 16), "mc": (24, 48, 96, 192),
            "nc": (32, 64, 128, 256, 512), "kc": (0, 128, 256, 512, 768), "pack_a": (False, True)}


def params_of(sched: GemmSchedule) -> dict:
    """A schedule as the tuner stores it: its form's fields."""
    fields = (SHARED_FIELDS + (("mma",) if sched.mma else ())) if sched.shared else PACKED_FIELDS
    return {f: getattr(sched, f) for f in fields}


def schedule_of(params: dict, target: Target) -> GemmSchedule:
    """The schedule stored parameters describe on this target (the form is the target's)."""
    return GemmSchedule(_shared_form(target), **params)


# ---- building ---------------------------------------------------------------------------------

def _i(v: int) -> KExpr:
    return const(int(v), INDEX)


def _x(v) -> KExpr:
    return v if isinstance(v, KExpr) else _i(v)


def _add(*xs) -> KExpr:
    """A sum of index expressions and ints, constants folded (kernels stay small and readable)."""
    out = None
    for x in xs:
        out = _x(x) if out is None else iadd(out, _x(x))
    return out


def _mul(a, k) -> KExpr:
    a = _x(a)
    if isinstance(k, KExpr):
        return _i(0) if a.op == "const" and a.arg == 0 else binary("mul", a, k)
    return imul(a, k)


def _min(a: KExpr, b) -> KExpr:
    return binary("min", a, b if isinstance(b, KExpr) else _i(b))


def _lt(a: KExpr, b) -> KExpr:
    return binary("lt", a, b if isinstance(b, KExpr) else _i(b))


def _and(a: KExpr, b: KExpr) -> KExpr:
    return binary("and", a, b)


def _fp(x: KExpr) -> KExpr:
    """An operand's element in the accumulation dtype."""
    return cast(x, dtypes.compute_dtype(x.dtype))


def _sub(a, b):
    return a - b if not isinstance(a, KExpr) and not isinstance(b, KExpr) else binary("sub", _x(a), _x(b))


def _times(a, b):
    """a * b for ints or index expressions (run-time sizes)."""
    if not isinstance(a, KExpr) and not isinstance(b, KExpr):
        return a * b
    if isinstance(a, KExpr) and isinstance(b, KExpr):
        return binary("mul", a, b)
    return _mul(a, b) if isinstance(a, KExpr) else _mul(b, a)


class _Gemm:
    def __init__(self, spec: GemmSpec, sched: GemmSchedule, kernel_buffers: tuple, runtime: bool = False):
        self.s, self.p, self.bufs = spec, sched, kernel_buffers
        self.lay = spec.layout
        self.acc = spec.acc_dtype
        # M at run time in the packed form and the shared one without MMA (the MMA form's printer,
        # PTX, takes no sizes)
        self.runtime = not sched.mma and _sized(spec, runtime)
        self.m = size(0) if self.runtime else self.lay.m  # M: a run-time size, or a constant
        # the shared form's K, a run-time size with M (the weight gradient's K is the batch's rows)
        self.k = size(1) if self.runtime and sched.shared else self.lay.k
        self.mn = _times(self.m, self.lay.n)  # a matrix's elements (a batched C's stride)

    def a_at(self, z, row, k) -> KExpr:
        if self.s.conv is not None:
            return tload(self.s.a, self.s.conv.a_offset(z, row, k), self.lay.dtype)
        sab, sam, sak = self.lay.a_strides
        return tload(self.s.a, _add(_mul(z, sab), _mul(row, sam), _mul(k, sak)), self.lay.dtype)

    def b_at(self, z, k, col) -> KExpr:
        if self.s.conv is not None:
            return self.s.conv.b_value(self.s.b, z, k, col)
        sbb, sbk, sbn = self.lay.b_strides
        return tload(self.s.b, _add(_mul(z, sbb), _mul(k, sbk), _mul(col, sbn)), self.lay.dtype)

    def finish(self, acc: KExpr, z, row, col, lanes: int) -> KExpr:
        """The value stored at C[z, row, col .. col+lanes): the epilogue of the product."""
        if self.s.epilogue is None:
            return cast(acc, self.s.out_dtype)
        lay, xs, conv = self.lay, [], self.s.conv
        for buf, full in self.s.extras:
            dt = np.dtype(self.bufs[buf].dtype)
            if conv is not None and not full:  # a conv's vector extra: one value per output feature
                xs.append(broadcast(_fp(tload(buf, conv.feature(z, row), dt)), lanes))
                continue
            off = self.c_offset(z, row, col) if full else col
            xs.append(_fp(vload(buf, off, dt, lanes) if lanes > 1 else tload(buf, off, dt)))
        return cast(epilogue_expr(self.s.epilogue, [acc, *xs]), self.s.out_dtype)

    def c_offset(self, z, row, col) -> KExpr:
        if self.s.conv is not None:
            return self.s.conv.c_offset(z, row, col)
        return _add(_mul(z, self.mn), _mul(row, self.lay.n), col)

    # -- the CPU form -----------------------------------------------------------------------
    def packed(self) -> tuple:
        """The CPU form. Where the target takes sizes at run time and the product is one matrix
        (self.runtime), M, the row blocks and (_k_sized) K's blocks are tile.size values
        (launch_sizes) and the grid is one Range of tasks: a new batch size, which changes M (or
        the weight gradient's K), reuses the code."""
        lay, p = self.lay, self.p
        wm, wn, vec = p.wm, p.wn, p.vec
        nr = wn * vec
        rt, M = self.runtime, self.m
        sizes = self.sizes = launch_sizes(self.s, p)
        d = {n: size(i) for i, n in enumerate(RUNTIME_SIZES)} if rt else sizes
        k_sized = _k_sized(self.s, p.kc, rt)
        kc_alloc = _k_depth(self.s, p.kc, rt)
        K, blocks, kd = (d["k"], d["k_blocks"], d["k_depth"]) if k_sized else (lay.k, sizes["k_blocks"], kc_alloc)
        multi = k_sized or blocks > 1  # the code of K in blocks
        mc, nc = _times(d["mc_tiles"], wm), p.nc
        col_blocks = _ceil(lay.n, nc)
        pc, jr, k, jj = var("pc"), var("jr"), var("k"), var("jj")
        if rt:  # one matrix: tasks (column block, row block: the last fastest) from one grid index
            task = var("task")
            ic = binary("rem", task, d["row_blocks"])
            jc = binary("div", task, d["row_blocks"]) if col_blocks > 1 else _i(0)
            z = _i(0)
        else:
            z, jc, ic = var("z"), var("jc"), var("ic")
        k0 = _mul(pc, kd) if multi else _i(0)
        kcur = _min(_sub(K, _mul(pc, kd)), kd) if multi else lay.k
        col = _add(_mul(jc, nc), _mul(jr, nr), jj)
        panel_at = lambda col_in_strip: _add(_mul(_add(_mul(jr, kd), k), nr), col_in_strip)  # noqa: E731
        packed_b = select(_lt(col, lay.n), _fp(self.b_at(z, _add(k0, k), _min(col, lay.n - 1))),
                          const(0, self.acc))
        edge = Range("jj", nr, "serial", (Store("bp", panel_at(jj), packed_b),))
        strip_inside = _lt(_add(_mul(jc, nc), _mul(jr, nr), nr - 1), lay.n)
        if self.s.conv is not None and vec > 1:  # the patches, a vector of columns at a time (zeros past N)
            j = var("j")
            c = _add(_mul(jc, nc), _mul(jr, nr), _mul(j, vec))
            row_of = self.s.conv.b_pack(self.s.b, z, _add(k0, k), c, vec,
                                        lambda v: Store("bp", panel_at(_mul(j, vec)), _fp(v)))
            inside, strip_inside = Range("j", wn, "unroll", row_of), None
        elif self.lay.b_strides[2] == 1 and vec > 1:  # B's rows are contiguous: copy whole vectors
            j = var("j")
            c = _add(_mul(jc, nc), _mul(jr, nr), _mul(j, vec))
            sbb, sbk, _ = self.lay.b_strides
            row = vload(self.s.b, _add(_mul(z, sbb), _mul(_add(k0, k), sbk), c), self.lay.dtype, vec)
            inside = Range("j", wn, "unroll", (Store("bp", panel_at(_mul(j, vec)), _fp(row)),))
        elif self.lay.b_strides[1] == 1:  # B's columns are contiguous (B transposed): along k
            inside = None
            along_k = Range("jj", nr, "serial", (Range("k", kcur, "serial", (
                Store("bp", panel_at(jj), _fp(self.b_at(z, _add(k0, k), col))),)),))
        else:
            inside = Range("jj", nr, "serial", (Store("bp", panel_at(jj), _fp(self.b_at(z, _add(k0, k), col))),))
        if strip_inside is None:
            pack = (Range("jr", nc // nr, "serial", (Range("k", kcur, "serial", (inside,)),)),)
        elif inside is None:
            pack = (Range("jr", nc // nr, "serial", (
                If(strip_inside, (along_k,)),
                If(unary("not", strip_inside), (Range("k", kcur, "serial", (edge,)),)),)),)
        else:
            pack = (Range("jr", nc // nr, "serial", (
                Range("k", kcur, "serial", (
                    If(strip_inside, (inside,)), If(unary("not", strip_inside), (edge,)),)),)),)

        ir, i, j, t = var("ir"), var("i"), var("j"), var("t")
        row0 = _add(_mul(ic, mc), _mul(ir, wm))
        col0 = _add(_mul(jc, nc), _mul(jr, nr))
        a_in_place = _fp(self.a_at(z, _min(_add(row0, i), _sub(M, 1)), _add(k0, k)))
        pack_a = ()
        if p.pack_a:  # A's micro-panel in float32 (16-bit inputs converted once), copied along
            # A's contiguous axis: row by row (wm streams along k, as A itself), or k-major
            if lay.a_strides[2] == 1:
                ap_at = _add(_mul(i, kc_alloc + A_PAD), k)
                pack_a = (Range("i", wm, "unroll", (Range("k", kcur, "serial", (Store("ap", ap_at, a_in_place),)),)),)
            else:
                ap_at = _add(_mul(k, wm), i)
                pack_a = (Range("k", kcur, "serial", (Range("i", wm, "unroll", (Store("ap", ap_at, a_in_place),)),)),)
                if lay.a_strides[1] == 1 and self.s.conv is None:  # A's rows contiguous (A transposed):
                    # a micro-panel's k-th column is wm adjacent elements, copied as vectors (of
                    # powers of two: every printer's widths) where the panel lies inside M
                    sab, _, sak = lay.a_strides
                    at_k = _add(_mul(z, sab), row0, _mul(_add(k0, k), sak))
                    copy, o = [], 0
                    for w in (q for q in _POWERS if wm & q):  # (at offset o, w elements: wm's binary digits)
                        at = _add(at_k, o)
                        v = vload(self.s.a, at, lay.dtype, w) if w > 1 else tload(self.s.a, at, lay.dtype)
                        copy.append(Store("ap", _add(_mul(k, wm), o), _fp(v)))
                        o += w
                    whole_rows = _lt(_add(row0, wm - 1), M)
                    pack_a = (If(whole_rows, (Range("k", kcur, "serial", tuple(copy)),)), If(unary("not", whole_rows), pack_a))
            a_elem = tload("ap", ap_at, self.acc)
        else:
            a_elem = a_in_place
        zero = broadcast(const(0, self.acc), vec)
        acc_at = lambda i_, j_: _mul(_add(_mul(i_, wn), j_), vec)  # noqa: E731
        b_vec = vload("bp", _add(_mul(_add(_mul(jr, kd), k), nr), _mul(j, vec)), self.acc, vec)
        fma = binary("add", vload("acc", acc_at(i, j), self.acc, vec),
                     binary("mul", broadcast(a_elem, vec), b_vec))
        micro = (
            Range("t", wm * wn, "unroll", (Store("acc", _mul(t, vec), zero),)),
            Range("k", kcur, "serial", (
                Range("i", wm, "unroll", (Range("j", wn, "unroll", (Store("acc", acc_at(i, j), fma),)),)),)),
        )
        # a register tile inside C stores whole vectors (its epilogue printed once per vector);
        # one across C's edge goes to scratch and out element by element, in loops (a lane loop
        # over the registers would index them at run time: they would stay in memory)
        store_c = lambda *a: self._store_c(multi, blocks, pc, *a)  # noqa: E731
        inside_c = _and(_lt(_add(row0, wm - 1), M), _lt(_add(col0, nr - 1), lay.n))
        whole = Range("i", wm, "unroll", (Range("j", wn, "unroll", store_c(
            vload("acc", acc_at(i, j), self.acc, vec), z, _add(row0, i), _add(col0, _mul(j, vec)), vec)),))
        spill = Range("t", wm * wn, "unroll", (Store("edge", _mul(t, vec), vload("acc", _mul(t, vec), self.acc, vec)),))
        row, c, lane = _add(row0, i), _add(col0, _mul(j, vec)), var("l")
        at, in_row = acc_at(i, j), _lt(_add(c, vec - 1), lay.n)
        by_vector = Range("j", wn, "serial", (
            If(in_row, store_c(vload("edge", at, self.acc, vec), z, row, c, vec)),
            If(unary("not", in_row), (Range("l", vec, "unroll", (If(_lt(_add(c, lane), lay.n), store_c(
                tload("edge", _add(at, lane), self.acc), z, row, _add(c, lane), 1)),)),)),))
        elementwise = Range("i", wm, "serial", (If(_lt(row, M), (by_vector,)),))
        store = (If(inside_c, (whole,)), If(unary("not", inside_c), (spill, elementwise)))
        block = pack + (
            Range("ir", d["mc_tiles"], "serial", (If(_lt(row0, M), pack_a + (
                Range("jr", nc // nr, "serial", (
                    If(_lt(col0, lay.n), micro + store),)),)),)),)
        body = (
            Alloc("bp", self.acc, kc_alloc * nc, "scratch"),
            *((Alloc("ap", self.acc, wm * (kc_alloc + A_PAD), "scratch"),) if p.pack_a else ()),
            Alloc("acc", self.acc, wm * wn * vec, "register"),
            Alloc("edge", self.acc, wm * wn * vec, "scratch"),
            *((Range("pc", blocks, "serial", block),) if multi else block),
        )
        if rt:
            return (Range("task", col_blocks * sizes["row_blocks"], "grid", body),)
        return (Range("z", lay.batch, "grid", (
            Range("jc", col_blocks, "grid", (
                Range("ic", sizes["row_blocks"], "grid", body),)),)),)

    def _store_c(self, multi: bool, blocks, pc, acc: KExpr, z, row, col, lanes: int) -> tuple:
        """The statements that store a K block's sums at C[z, row, col .. col+lanes): the
        epilogue of the product after the last block; before it, the partial sums, which the
        next block adds to (C is float32 then: check)."""
        off = self.c_offset(z, row, col)
        if not multi:
            return (Store(self.s.c, off, self.finish(acc, z, row, col, lanes)),)
        prev = vload(self.s.c, off, self.acc, lanes) if lanes > 1 else tload(self.s.c, off, self.acc)
        total = select(_lt(_i(0), pc), binary("add", acc, prev), acc)
        last = _lt(pc, _sub(blocks, 1))
        return (If(last, (Store(self.s.c, off, total),)),
                If(unary("not", last), (Store(self.s.c, off, self.finish(total, z, row, col, lanes)),)))

    # -- the GPU form -----------------------------------------------------------------------
    def stage(self, name, rows, a_side, e, nl, k0, z, bm, bn, pitch=0) -> Range:
        """Work-item tid copies elements e = r*nl + tid of the tk x rows panel (at [k*rows + row],
        or with a pitch at [row*pitch + k] in the operands' dtype), walking the operand's
        contiguous axis with consecutive work-items; zeros past the edges."""
        lay, tk = self.lay, self.p.tk
        unit_k = lay.a_strides[2] == 1 if a_side else lay.b_strides[1] == 1
        if unit_k:  # consecutive work-items read consecutive k
            q, kq = binary("div", e, _i(tk)), binary("rem", e, _i(tk))
        else:
            kq, q = binary("div", e, _i(rows)), binary("rem", e, _i(rows))
        g = _add(_mul(bm if a_side else bn, rows), q)
        gk = _add(_mul(k0, tk), kq)
        limit = self.m if a_side else lay.n
        inside = _and(_lt(g, limit), _lt(gk, self.k))
        gc, kc = _min(g, _sub(limit, 1)), _min(gk, _sub(self.k, 1))
        val = self.a_at(z, gc, kc) if a_side else self.b_at(z, kc, gc)
        val = cast(val, lay.dtype) if pitch else _fp(val)  # (a conv's patches come in the compute dtype)
        at = _add(_mul(q, pitch), kq) if pitch else _add(_mul(kq, rows), q)
        return Range("r", _ceil(tk * rows, nl), "serial", (
            If(_lt(e, tk * rows), (Store(name, at, select(inside, val, const(0, val.dtype))),)),))

    def shared_mma(self) -> tuple:
        """The shared form with a warp MMA: warps of WARP work-items, each multiplying wm x wn
        fm x fn tiles of the block's tm x tn tile, fragments gathered from the staged 16-bit
        panels (k-contiguous rows, PAD elements apart against bank conflicts; a fragment's pairs
        are adjacent) by the instruction's lane layout (m16n8k16: ir/kernel/tile.py)."""
        lay, p = self.lay, self.p
        (fm, fn, fk), _, _, _ = MMA_LAYOUTS[p.mma]
        tm, tn, tk, wm, wn, dt = p.tm, p.tn, p.tk, p.wm, p.wn, lay.dtype
        wy, wx = tm // (fm * wm), tn // (fn * wn)
        nl = wy * wx * WARP
        z, bm, bn, vy, vx, ln = var("z"), var("bm"), var("bn"), var("wy"), var("wx"), var("ln")
        k0, ks, r, t = var("k0"), var("ks"), var("r"), var("t")
        e = _add(_mul(r, nl), _mul(_add(_mul(vy, wx), vx), WARP), ln)
        grp, quad = binary("div", ln, _i(4)), binary("rem", ln, _i(4))  # a lane's group of 4, its place in it
        row0, col0 = _mul(vy, fm * wm), _mul(vx, fn * wn)  # the warp's tile in the block's
        kbase = _mul(ks, fk)
        # the lane's fragment elements (m16n8k16): A (row, k), B (k, col), C (row, col)
        a_el = [(_add(grp, 8 * ((q >> 1) & 1)), _add(_mul(quad, 2), (q & 1) + 8 * (q >> 2))) for q in range(8)]
        b_el = [(_add(_mul(quad, 2), (q & 1) + 8 * (q >> 1)), grp) for q in range(4)]
        c_el = [(_add(grp, 8 * (q >> 1)), _add(_mul(quad, 2), q & 1)) for q in range(4)]
        pitch = tk + PAD
        # a fragment's elements 2p and 2p+1 are neighbours along k: one 2-lane load each
        loads = [Store("af", _i(i * 8 + q), vload("at", _add(_mul(_add(row0, i * fm, rr), pitch), kbase, kk), dt, 2))
                 for i in range(wm) for q, (rr, kk) in enumerate(a_el) if q % 2 == 0]
        loads += [Store("bf", _i(j * 4 + q), vload("bt", _add(_mul(_add(col0, j * fn, cc), pitch), kbase, kk), dt, 2))
                  for j in range(wn) for q, (kk, cc) in enumerate(b_el) if q % 2 == 0]
        acc = lambda i, j: _i((i * wn + j) * 4)  # noqa: E731
        products = [Store("acc", acc(i, j), mma(vload("af", _i(i * 8), dt, 8), vload("bf", _i(j * 4), dt, 4),
                                                vload("acc", acc(i, j), self.acc, 4), p.mma))
                    for i in range(wm) for j in range(wn)]
        stores = []
        for i in range(wm):
            for j in range(wn):
                for q, (rr, cc) in enumerate(c_el):
                    row = _add(_mul(bm, tm), row0, i * fm, rr)
                    col = _add(_mul(bn, tn), col0, j * fn, cc)
                    stores.append(If(_and(_lt(row, lay.m), _lt(col, lay.n)), (Store(
                        self.s.c, self.c_offset(z, row, col),
                        self.finish(tload("acc", _add(acc(i, j), q), self.acc), z, row, col, 1)),)))
        inner = (
            Alloc("at", dt, pitch * tm, "shared"),
            Alloc("bt", dt, pitch * tn, "shared"),
            Alloc("af", dt, wm * 8, "register"),
            Alloc("bf", dt, wn * 4, "register"),
            Alloc("acc", self.acc, wm * wn * 4, "register"),
            Range("t", wm * wn * 4, "unroll", (Store("acc", t, const(0, self.acc)),)),
            Range("k0", _ceil(lay.k, tk), "serial", (
                self.stage("at", tm, True, e, nl, k0, z, bm, bn, pitch),
                self.stage("bt", tn, False, e, nl, k0, z, bm, bn, pitch), Barrier(),
                Range("ks", tk // fk, "serial", tuple(loads + products)),
                Barrier())),
            *stores,
        )
        return (Range("z", lay.batch, "grid", (
            Range("bm", _ceil(lay.m, tm), "grid", (
                Range("bn", _ceil(lay.n, tn), "grid", (
                    Range("wy", wy, "lane", (Range("wx", wx, "lane", (Range("ln", WARP, "lane", inner),)),)),)),)),)),)

    def shared(self) -> tuple:
        lay, p = self.lay, self.p
        tm, tn, tk, wm, wn = p.tm, p.tn, p.tk, p.wm, p.wn
        ly, lx = tm // wm, tn // wn
        nl = ly * lx
        z, bm, bn, ty, tx = var("z"), var("bm"), var("bn"), var("ty"), var("tx")
        k0, r, kk, i, j, t = var("k0"), var("r"), var("kk"), var("i"), var("j"), var("t")
        tid = _add(_mul(ty, lx), tx)
        e = _add(_mul(r, nl), tid)
        acc_at = _add(_mul(i, wn), j)
        a = tload("at", _add(_mul(kk, tm), ty, _mul(i, ly)), self.acc)
        b = tload("bt", _add(_mul(kk, tn), tx, _mul(j, lx)), self.acc)
        row = _add(_mul(bm, tm), ty, _mul(i, ly))
        col = _add(_mul(bn, tn), tx, _mul(j, lx))
        inner = (
            Alloc("at", self.acc, tk * tm, "shared"),
            Alloc("bt", self.acc, tk * tn, "shared"),
            Alloc("acc", self.acc, wm * wn, "register"),
            Range("t", wm * wn, "unroll", (Store("acc", t, const(0, self.acc)),)),
            Range("k0", _ceil(lay.k, tk) if not self.runtime else binary("div", _add(self.k, tk - 1), _i(tk)), "serial", (
                self.stage("at", tm, True, e, nl, k0, z, bm, bn), self.stage("bt", tn, False, e, nl, k0, z, bm, bn),
                Barrier(),
                Range("kk", tk, "serial", (
                    Range("i", wm, "unroll", (Range("j", wn, "unroll", (
                        Store("acc", acc_at, binary("add", tload("acc", acc_at, self.acc),
                                                    binary("mul", a, b))),)),)),)),
                Barrier())),
            Range("i", wm, "unroll", (Range("j", wn, "unroll", (
                If(_and(_lt(row, self.m), _lt(col, lay.n)), (
                    Store(self.s.c, self.c_offset(z, row, col),
                          self.finish(tload("acc", acc_at, self.acc), z, row, col, 1)),)),)),)),
        )
        # the row blocks outermost: the first grid's extent, which a run-time M sets (tile.key_text)
        return (Range("bm", _ceil(lay.m, tm), "grid", (
            Range("z", lay.batch, "grid", (
                Range("bn", _ceil(lay.n, tn), "grid", (
                    Range("ty", ly, "lane", (Range("tx", lx, "lane", inner),)),)),)),)),)


def build(spec: GemmSpec, sched: GemmSchedule, name: str, buffers: tuple, n_inputs: int,
          runtime_sizes: bool = False) -> TileKernel:
    """The tile kernel of `spec` under `sched` over the kernel's `buffers`; runtime_sizes: the
    target takes sizes at run time (Target.runtime_batch), which the packed and shared forms then
    read (one matrix's M and K, the packed form's in blocks)."""
    g = _Gemm(spec, sched, buffers, runtime_sizes)
    body = (g.shared_mma() if sched.mma else g.shared()) if sched.shared else g.packed()
    meta = {"gemm": (spec, sched), "flops": spec.layout.flops}
    if g.runtime:
        meta["sizes"] = tuple(g.sizes[n] for n in RUNTIME_SIZES) if not sched.shared else (spec.layout.m, spec.layout.k)
    return TileKernel(name, tuple(buffers), n_inputs, body, meta=meta)


def size_free_key(spec: GemmSpec, sched: GemmSchedule, buffers: tuple, n_inputs: int, runtime_sizes: bool):
    """What build's tile kernel is made of, but for the sizes it reads at run time, where it reads
    them (the packed form of one matrix on a target that takes sizes at run time): the spec
    without M (and K where _k_sized), the schedule without mc (launch_sizes: mc_tiles), the
    buffers' dtypes. Two builds with the same key have the same body but for the first grid
    Range's extent (at_sizes), so one key_text. None where sizes are constants in the code."""
    if sched.shared or sched.mma or not _sized(spec, runtime_sizes):
        return None
    k_sized = _k_sized(spec, sched.kc, runtime_sizes)
    lay = replace(spec.layout, m=0, k=0 if k_sized else spec.layout.k)
    return (replace(spec, layout=lay), replace(sched, mc=0), k_sized,
            tuple(np.dtype(b.dtype) for b in buffers), n_inputs)


def at_sizes(tk: TileKernel, spec: GemmSpec, sched: GemmSchedule, name: str, buffers: tuple) -> TileKernel:
    """build(spec, sched, name, buffers, ...) made of tk, built with the same size_free_key: its
    task grid's extent and launch_sizes of these sizes."""
    sizes = launch_sizes(spec, sched)
    return at_grid_extent(tk, _ceil(spec.layout.n, sched.nc) * sizes["row_blocks"], name, buffers, {
        "gemm": (spec, sched), "flops": spec.layout.flops, "sizes": tuple(sizes[n] for n in RUNTIME_SIZES)})


__all__ = ["Buffer", "GemmSchedule", "GemmSpec", "at_sizes", "build", "default_schedule", "gemm_spec", "params_of",
           "schedule_of", "size_free_key", "space"]
