"""Tile kernels → host machine code: the target machine, the optimisation pipeline (new pass
manager, O3; loop and SLP vectorisation for the builders' kernels, not the scheduler's, whose
vectors are explicit), object code through the compile caches (in memory by the tile kernel's
key text, on disk via runtime/compile_cache), loading, and the ctypes launcher that splits a
launch's grid points (tasks) over the thread pool (pool.py) sized to the cores.

An ordinary kernel is laid out by the shared scheduler (ir/kernel/schedule.py, from the
Target that runtime/hardware.target_of makes of the description) and printed by
backends/llvmir/tile.py: nothing here decides how a kernel computes, only how a launch splits.

Loading uses llvmlite's ORC LLJIT with JITLink rather than MCJIT: JITLink keeps each object's
code and constants in one allocation and makes GOT/PLT entries for libm calls, so the small code
model is safe. Under MCJIT only the large model is, and it reloads every constant through a
64-bit absolute address inside hot loops (tanh on AVX2: ~25% slower, measured)."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import threading

import llvmlite
import llvmlite.binding as llvm
import numpy as np

from tilefuse.backends.llvmir.tile import print_tile
from tilefuse.ir.errors import CompileError, DeviceError
from tilefuse.ir.kernel.ir import Kernel, walk
from tilefuse.ir.kernel import schedule as scheduler
from tilefuse.ir.kernel.schedule import Schedule, code_text, default_schedule, grid_points, run_sizes, schedule
from tilefuse.ir.kernel.tile import TileKernel, key_text
from tilefuse.runtime import compile_cache
from tilefuse.runtime.hardware import DeviceInfo, target_of

from . import parallel
from .buffer import Owner
from .pool import get_pool

BACKEND_VERSION = "llvm-1"
OPT_LEVEL = 3
# Threads or not: a kernel's time is estimated as points × reduce points × Σ op costs × NS_PER_OP
# (x*2+1: 0.19 ns a point on one znver3 thread, ~0.05 ns an op with 8 float lanes; the estimate
# is within 20% for the tanh/sigmoid/exp chain: 74 µs estimated, 84 µs measured at 32k points).
# A launch on the pool costs 2-4 µs (pool.py: workers spin between launches), and a split of
# x*2+1 pays off from 64k points (6 µs on one thread, 5 µs on two; benchmarks/bench_elementwise.py
# --threshold): a split above ~20 µs of estimated work, with a margin for a busy machine.
PARALLEL_MIN_NS = 20_000
NS_PER_OP = 0.05
OP_COST = {"exp": 12, "log": 12, "log1p": 14, "expm1": 14, "tanh": 14, "logistic": 10, "erf": 16,
           "sin": 14, "cos": 14, "pow": 40, "div": 4, "rem": 8, "sqrt": 4, "rsqrt": 5}
BUILDER_CHUNKS = 8  # per thread, of a builder's kernel (split)
CHUNK_ALIGN = 64  # chunk boundaries on multiples of 64 points: whole cache lines per thread
SCHEDULED = "; the shared scheduler's kernel\n"  # heads their LLVM IR (compile_ir reads it)


PRINTER_FILES = ("ops.py", "vecmath.py", "irutil.py", "tile.py")  # in backends/llvmir


def code_digest(*files: str) -> str:
    """A hash of code generators (files of this folder, of the shared LLVM IR printer
    backends/llvmir, or absolute paths; with the IR helpers every generator uses), so that changed
    code never reuses old objects from the disk cache."""
    h = hashlib.sha256(BACKEND_VERSION.encode())
    here = os.path.dirname(os.path.abspath(__file__))
    printer = os.path.join(os.path.dirname(here), "llvmir")
    for name in ("vecmath.py", "irutil.py", "compile.py") + files:
        folder = printer if name in PRINTER_FILES else here
        with open(os.path.join(folder, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


class Target:
    """The host target machine and the one LLJIT every kernel is linked into."""

    def __init__(self, info: DeviceInfo):
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        # the CPU and features of the description (the host's, or fewer: TILEFUSE_HDI), so that
        # an AVX2-only machine is simulated on an AVX-512 one; whatever the host has and the
        # description lacks is switched off explicitly
        self.cpu = info.cpu_name or llvm.get_host_cpu_name()
        keep = set(info.features)
        self.features = ",".join(("+" if on and name in keep else "-") + name
                                 for name, on in sorted(llvm.get_host_cpu_features().items()))
        target = llvm.Target.from_default_triple()
        self.tm = target.create_target_machine(cpu=self.cpu, features=self.features, opt=OPT_LEVEL,
                                               reloc="pic", codemodel="small")
        self.triple = target.triple
        self.data_layout = str(self.tm.target_data)
        self.vector_bits = 32 * info.simd_lanes_f32
        self.scalef = "+avx512f" in self.features.split(",")  # vscalef: exp's 2**n in one instruction
        self.jit = llvm.create_lljit_compiler(self.tm, use_jit_link=True)
        self.lock = threading.RLock()
        self.loaded: dict[str, tuple] = {}  # symbol → (address, library that keeps it alive)
        self.cache = compile_cache.CompileCache("llvm", compile_cache.default_dir())
        # (the scheduler's source too: a kernel's key is its index-space text, schedule.code_text)
        self.fingerprint = (BACKEND_VERSION, code_digest("ops.py", "tile.py", scheduler.__file__),
                            llvmlite.__version__, llvm.llvm_version_info, self.triple, self.cpu,
                            self.features, self.vector_bits, OPT_LEVEL)

    def optimize(self, mod: llvm.ModuleRef, vectorize: bool = True) -> None:
        pto = llvm.create_pipeline_tuning_options(speed_level=OPT_LEVEL)
        pto.loop_vectorization = vectorize
        pto.slp_vectorization = vectorize
        pb = llvm.create_pass_builder(self.tm, pto)
        pb.getModulePassManager().run(mod, pb)

    def compile_ir(self, text: str, fn_name: str, kernel_text: str) -> bytes:
        """LLVM IR text → optimised object code; any LLVM failure is a CompileError."""
        try:
            mod = llvm.parse_assembly(text)
            mod.triple, mod.data_layout = self.triple, self.data_layout
            mod.verify()
            # the scheduler's kernels hold their vectors already: LLVM's vectorisers would only
            # spend compile time on them (a third of a cold training step's)
            self.optimize(mod, vectorize=not text.startswith(SCHEDULED))
            return self.tm.emit_object(mod)
        except RuntimeError as e:
            raise CompileError(f"LLVM could not compile kernel {fn_name}: {e}", backend="llvm",
                               kernel=kernel_text, source=text) from None

    def module(self, key: str, fn_name: str, make_ir, what: str) -> int:
        """The address of `fn_name`: linked already, or its object code from the disk cache under
        `key`, or compiled from make_ir() (LLVM IR text) and stored there. For the templates."""
        hit = self.loaded.get(fn_name)
        if hit is not None:
            return hit[0]
        text = None

        def build() -> bytes:
            nonlocal text
            text = make_ir()
            return self.compile_ir(text, fn_name, what)
        with self.lock:
            return self.cache.get_or_build(key, build, lambda obj: self.load(obj, fn_name, text, what))

    def load(self, obj: bytes, fn_name: str, ir_text=None, kernel="", others=()) -> int:
        """Link object code into the JIT (once per symbol) and return the function's address;
        `others`: more functions of the same object, then looked up in `loaded`; `kernel`: what an
        error names (printed then only: a kernel's text costs more than its link from the cache)."""
        with self.lock:
            hit = self.loaded.get(fn_name)
            if hit is None:
                try:
                    builder = llvm.JITLibraryBuilder().add_object_img(obj).add_current_process()
                    for name in (fn_name, *others):
                        builder.export_symbol(name)
                    # a fresh library name per link: a failed link (a damaged cache entry) keeps its own
                    lib = builder.link(self.jit, f"{fn_name}.{next(_link_ids)}")
                    addrs = {name: lib[name] for name in (fn_name, *others)}
                except (RuntimeError, KeyError) as e:
                    raise CompileError(f"linking kernel {fn_name} failed: {e}", backend="llvm",
                                       kernel=str(kernel), source=ir_text or "") from None
                if not all(addrs.values()):
                    raise CompileError(f"the object code of kernel {fn_name} lacks a symbol of {list(addrs)}",
                                       backend="llvm", kernel=str(kernel), source=ir_text or "")
                for name, addr in addrs.items():
                    self.loaded[name] = (addr, lib)
                hit = self.loaded[fn_name]
            return hit[0]


_targets: dict = {}
_link_ids = itertools.count()


_targets_lock = threading.Lock()


def get_target(info: DeviceInfo) -> Target:
    t = _targets.get(info.fingerprint)
    if t is None:
        with _targets_lock:  # one per description, whichever thread asks first (its lock guards LLVM)
            t = _targets.get(info.fingerprint)
            if t is None:
                t = _targets[info.fingerprint] = Target(info)
    return t


# ---- launching ----------------------------------------------------------------------------------

KernelFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
_addressof = ctypes.addressof
_ndarray = np.ndarray


class CompiledKernel:
    """A tile kernel's machine code: `ck(buffers)` runs its `tasks` grid points to completion on
    numpy buffers given in the order of its buffers (any dtype, C-contiguous; read as flat arrays),
    over the pool's threads in chunks of tasks (`bounds`; None: on the calling thread). After the
    buffers' addresses the function reads the run-time `sizes` (tile.size).
    `tile`: the tile kernel, or a function that makes it (for llvm_ir)."""

    def __init__(self, kernel, fn_name: str, address: int, tasks: int, sizes: tuple, threads: int,
                 bounds: list | None, target: Target, tile):
        self.kernel, self.name, self.address, self._tile = kernel, fn_name, address, tile
        self._fn = KernelFn(address)
        self._target = target
        self._size, self._sizes = tasks, tuple(sizes)
        self._nbytes = [b.size * np.dtype(b.dtype).itemsize for b in kernel.buffers]
        self._views = [ctypes.c_char * max(n, 1) for n in self._nbytes]
        self._ptrs_t = ctypes.c_void_p * (len(self._nbytes) + max(1, len(self._sizes)))
        self._last = (None, None)  # (addresses, their argument array) of the last call
        self.threads = threads if bounds and self._size > 1 else 1
        self._launch = get_pool(threads).launcher(self._fn, bounds) if self.threads > 1 else None

    @property
    def llvm_ir(self) -> str:
        """The unoptimised LLVM IR (printed again on demand)."""
        made = not isinstance(self._tile, TileKernel)  # (made on demand: a scheduler's kernel)
        return llvm_text(self._tile() if made else self._tile, self.name, self._target, made)

    def _args(self, addrs):
        return self._ptrs_t(*addrs, *self._sizes)

    def __call__(self, buffers) -> None:
        if len(buffers) != len(self._nbytes):
            raise DeviceError(f"kernel {self.kernel.name} takes {len(self._nbytes)} buffers, "
                              f"got {len(buffers)}")
        # the fast path: a pool buffer's owner carries its address (buffer.py)
        addrs = []
        for b, need in zip(buffers, self._nbytes):
            o = b.base if type(b) is _ndarray else None
            if type(o) is not Owner or o.nbytes < need or o.buffer() is not b:
                addrs = self._addresses(buffers)
                break
            addrs.append(o.addr)
        if self._size == 0:
            return
        # a loop calls again on the same addresses (the pool hands back the block just freed):
        # the last call's argument array, never written to, serves again
        last = self._last
        if last[0] == addrs:
            ptrs = last[1]
        else:
            ptrs = self._args(addrs)
            self._last = (addrs, ptrs)
        if self._launch is None:
            self._fn(ptrs, 0, self._size)
        else:
            self._launch(ptrs)

    def _addresses(self, buffers) -> list:
        try:  # one C call per buffer checks writable, contiguous and large enough
            return [_addressof(t.from_buffer(b)) for t, b in zip(self._views, buffers)]
        except (TypeError, ValueError, BufferError):  # read-only, empty or bad: check one by one
            return [self._address(i, b) for i, b in enumerate(buffers)]

    def bind(self, buffers):
        """A launch of no arguments on these buffers: their addresses checked and resolved once."""
        if len(buffers) != len(self._nbytes) or self._size == 0:
            return functools.partial(self, buffers)  # (raises, or launches nothing)
        ptrs = self._args([self._address(i, b) for i, b in enumerate(buffers)])
        f = functools.partial(self._fn, ptrs, 0, self._size) if self._launch is None else \
            functools.partial(self._launch, ptrs)
        f.buffers = buffers  # alive while the launch is
        return f

    def _address(self, i, b) -> int:
        need = self._nbytes[i]
        if not isinstance(b, np.ndarray) or b.nbytes < need or not b.flags.c_contiguous:
            got = f"{b.nbytes} bytes{'' if b.flags.c_contiguous else ', not contiguous'}" \
                if isinstance(b, np.ndarray) else type(b).__name__
            raise DeviceError(f"kernel {self.kernel.name}: buffer {i} ({self.kernel.buffers[i].name}) "
                              f"needs {need} contiguous bytes, got {got}")
        return b.ctypes.data

    def call_addresses(self, addrs) -> None:
        """Run on raw buffer addresses (no checks): the lean path for callers that know them."""
        if self._size == 0:
            return
        ptrs = self._args(addrs)
        if self._launch is None:
            self._fn(ptrs, 0, self._size)
        else:
            self._launch(ptrs)

    def __repr__(self):
        k = self.kernel.name
        return f"<CompiledKernel {k} ({self.name}): {self._size} tasks, {self.threads} threads>"


def estimate_ns(kernel: Kernel) -> float:
    """A rough run time on one thread, from the op mix (see PARALLEL_MIN_NS); kept in meta."""
    est = kernel.meta.get("est_ns")
    if est is None:
        tw = kernel.meta.get("twin")  # (schedule.at_first_extent: the same op mix at another first extent)
        est = kernel.meta["est_ns"] = estimate_ns(tw) / tw.size * kernel.size if tw is not None and tw.size else \
            _estimate_ns(kernel)
    return est


def _estimate_ns(kernel: Kernel) -> float:
    """Ops inside a reduction run at every reduction point, the others (a GEMM's epilogue, a
    softmax's division) once a point: counting those per reduction point too sent 2 us kernels to
    the thread pool (estimated 22 us)."""
    nodes = set(walk([root for st in kernel.stores for root in (st.offset, st.value)]))
    inner = {n for r in nodes if r.op == "reduce" for s in r.src for n in s.toposort()}
    if kernel.row_stores:  # (stores that write whole rows run at every reduction point)
        inner = nodes

    def units(ns):
        return sum(OP_COST.get(n.op, 1) for n in ns if n.op not in ("const", "idx", "ridx"))
    reduce_points = max(1, int(np.prod(kernel.reduce_shape, dtype=np.int64)))
    per_point = len(kernel.stores) + units(nodes - inner) + units(inner) * reduce_points
    return kernel.size * per_point * NS_PER_OP


def _chunks(size: int, threads: int, est_ns: float, per_thread: int = 4, align: int = CHUNK_ALIGN) -> list:
    """Up to `per_thread` chunks of `size` tasks per thread (balance on a busy machine), each worth
    ≥ PARALLEL_MIN_NS / 4 but at least one per thread, aligned to `align` tasks."""
    n = max(1, min(threads * per_thread, max(threads, int(est_ns // (PARALLEL_MIN_NS / 4)))))
    step = -(-size // n)
    if step > align:
        step = -(-step // align) * align
    return [(s, min(s + step, size)) for s in range(0, size, step)]


def split(tasks: int, kernel: Kernel | None, cores: int) -> tuple[int, list | None]:
    """(threads, chunks of tasks) of a launch. A scheduled kernel goes to the pool when its
    estimated work pays for waking it (PARALLEL_MIN_NS), in chunks of whole cache lines
    (CHUNK_ALIGN points); a builder's kernel (GEMM, attention: big by construction) in up to
    BUILDER_CHUNKS contiguous chunks per thread, claimed as the threads come for them, so that a
    core another process slows takes fewer (one chunk per thread: GEMM launches 1.3-2x slower
    beside BLAS threads spinning after their call; alone, no difference measured)."""
    n = tasks
    if kernel is None:
        threads = max(1, min(cores, n))
        if threads == 1:
            return 1, None
        step = -(-n // min(n, threads * BUILDER_CHUNKS))
        return threads, [(s, min(s + step, n)) for s in range(0, n, step)]
    est = estimate_ns(kernel)
    if est < PARALLEL_MIN_NS or n < 2 or cores < 2:
        return 1, None
    per_task = max(1, kernel.size // n)
    return cores, _chunks(n, cores, est, 4, max(1, CHUNK_ALIGN // per_task))


# ---- the entry point ------------------------------------------------------------------------------

_memory: dict = {}  # cache key → address
_counts = {"memory_hits": 0}


def scheduled(kernel: Kernel, info: DeviceInfo, sched: Schedule | None = None) -> tuple[Schedule, str, str]:
    """(the shared scheduler's Schedule for `kernel` (or `sched`), the cache key of its code, its
    symbol): the key comes from schedule.code_text, so a kernel whose code any cache holds is never
    laid out; kept in the kernel's meta per device (a graph asks twice: its batch build, then each)."""
    memo = kernel.meta.setdefault("llvm_code", {})
    where = (info.fingerprint, sched)
    if where not in memo:
        t = target_of(info)
        s = sched or default_schedule(kernel, t)
        key = compile_cache.make_key("kernel", code_text(kernel, t, s), get_target(info).fingerprint)
        memo[where] = (s, key, "tf_" + key[:24])
    return memo[where]


def llvm_text(tk: TileKernel, fn_name: str, target: Target, by_scheduler: bool) -> str:
    """The LLVM IR of a tile kernel, headed SCHEDULED where the scheduler made it."""
    return (SCHEDULED if by_scheduler else "") + print_tile(tk, fn_name, vector_bits=target.vector_bits,
                                                         scalef=target.scalef)


def kernel_ir(kernel: Kernel, info: DeviceInfo, fn_name: str = "f") -> str:
    """The LLVM IR of a kernel under its default schedule (unoptimised): for tests and debugging."""
    tk = schedule(kernel, target_of(info), scheduled(kernel, info)[0])
    return llvm_text(tk, fn_name, get_target(info), True)


def compile_kernels(kernels: list[Kernel], info: DeviceInfo) -> None:
    """Build, in parallel worker processes, the object code of those of `kernels` (under their
    default schedules) that neither cache holds; compile_kernel then finds it."""
    def jobs():
        for k in kernels:
            if k.size:
                s, key, fn_name = scheduled(k, info)  # (workers: for this description)
                yield key, lambda: (schedule(k, target_of(info), s), fn_name, info, True)
    _build_missing(jobs(), get_target(info))


def compile_tiles(tks: list[TileKernel], info: DeviceInfo) -> None:
    """Build, in parallel worker processes, the object code of those builders' tile kernels
    (GEMM, FlashAttention) that neither cache holds; compile_tile then finds it."""
    def jobs():
        for tk in tks:
            key, fn_name = _tile_key(tk, info)
            yield key, lambda: (tk, fn_name, info, False)
    _build_missing(jobs(), get_target(info))


def _build_missing(jobs, target: Target) -> None:
    """Build in parallel the (cache key, job maker) jobs that no cache holds (each made once)."""
    todo = {}
    for key, make in jobs:
        if key not in _memory and key not in todo and not target.cache.has(key):
            todo[key] = make()
    parallel.build_objects(todo, lambda tk, fn_name, _info, by_scheduler: target.compile_ir(
        llvm_text(tk, fn_name, target, by_scheduler), fn_name, ""))  # (errors: the one-by-one build reports them)


def load_tile(tk, key: str, fn_name: str, info: DeviceInfo, source=None) -> int:
    """The address of a tile kernel's function: from memory, the worker processes' builds, the
    disk cache, or printed and compiled now (tk: the tile kernel, or a function that makes it;
    `source`: the index-space kernel the scheduler made it of, which an error names)."""
    target = get_target(info)
    hit = _memory.get(key)
    if hit is not None:
        _counts["memory_hits"] += 1
        return hit
    with target.lock:
        hit = _memory.get(key)
        if hit is None:
            ir_text = None

            def build() -> bytes:
                nonlocal ir_text
                obj = parallel.take(key)  # built with the rest of its graph
                if obj is None:
                    made = tk if isinstance(tk, TileKernel) else tk()
                    ir_text = llvm_text(made, fn_name, target, source is not None)
                    obj = target.compile_ir(ir_text, fn_name, str(source or tk))
                return obj
            hit = _memory[key] = target.cache.get_or_build(key, build, lambda obj: target.load(
                obj, fn_name, ir_text, source or tk))
    return hit


def compile_kernel(kernel: Kernel, info: DeviceInfo, sched: Schedule | None = None) -> CompiledKernel:
    """Compile (or fetch from the caches) one kernel for the host CPU: the shared scheduler's
    tile kernel under `sched` (default: the Target's), printed by llvmir/tile.py."""
    t = target_of(info)
    s, key, fn_name = scheduled(kernel, info, sched)

    def tile() -> TileKernel:
        return schedule(kernel, t, s)
    address = load_tile(tile, key, fn_name, info, kernel) if kernel.size else 0
    tasks = grid_points(kernel, t, s)
    threads, bounds = split(tasks, kernel, info.compute_units)
    return CompiledKernel(kernel, fn_name, address, tasks, run_sizes(kernel, t, s), threads, bounds,
                          get_target(info), tile)


def _tile_key(tk: TileKernel, info: DeviceInfo) -> tuple[str, str]:
    """A builder's tile kernel's cache key (its text) and symbol."""
    key = compile_cache.make_key("tile", key_text(tk), get_target(info).fingerprint)
    return key, "tf_tile_" + key[:24]


def compile_tile(tk: TileKernel, info: DeviceInfo) -> CompiledKernel:
    """A builder's tile kernel (GEMM, FlashAttention), compiled through the caches, on the pool."""
    key, fn_name = _tile_key(tk, info)
    n = tk.points()
    threads, bounds = split(n, None, info.compute_units)
    return CompiledKernel(tk, fn_name, load_tile(tk, key, fn_name, info), n, tk.meta.get("sizes", ()), threads,
                          bounds, get_target(info), tk)


def memory_cache_stats() -> dict:
    """Kernels compiled or loaded in this process, and lookups answered from memory."""
    return {"kernels": len(_memory), **_counts}


__all__ = ["compile_kernel", "compile_tile", "compile_tiles", "CompiledKernel", "Target", "get_target", "kernel_ir", "split"]
