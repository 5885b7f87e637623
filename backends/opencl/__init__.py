"""The OpenCL backend: kernels laid out by the shared scheduler (ir/kernel/schedule.py) and the
tile builders, printed as OpenCL C (backends/cstyle.py), built and launched with pyopencl on an
in-order, profiling queue. Devices appear as opencl:0, opencl:1, ... (one per
OpenCL device of every platform). On CPU devices (PoCL) buffers are allocated in host-visible
memory and read back by mapping, so reading a result copies nothing."""
from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

from tilefuse.ir.errors import CompileError, DeviceError, OutOfMemoryError
from tilefuse.runtime.config import config
from tilefuse.runtime import hardware
from tilefuse.runtime.hardware import DeviceInfo, host_info
from tilefuse.ir.kernel.tile import key_text
from tilefuse.runtime.memory import PoolAllocator, PoolBuffer
from tilefuse.runtime.tiled import register_attention, register_gemm, register_kernels

from ..base import Backend

from ..cstyle import F64, launch_shape, print_tile
from .build import ProgramCache, translate

INSTALL_HINT = ("install an OpenCL driver (ICD): on Debian/Ubuntu `apt-get install pocl-opencl-icd "
                "ocl-icd-libopencl1` for the CPU, or your GPU vendor's OpenCL runtime")


def _import_cl():
    # pyopencl's own disk caches (generated invokers; binaries for ICDs that cache nothing) hold
    # pickles, and tilefuse unpickles nothing from disk: off, unless the user set the variable
    os.environ.setdefault("PYOPENCL_NO_CACHE", "1")
    _pin_pocl_workers()
    try:
        import pyopencl as cl
    except ImportError as e:  # the wheel bundles the ICD loader; a failure means no pyopencl
        raise DeviceError(f"OpenCL is unavailable: pyopencl is not installed ({e}); install it with "
                          "`pip install pyopencl` (or `pip install tilefuse[opencl]`)") from None
    return cl


def _pin_pocl_workers() -> None:
    """PoCL's CPU driver runs work-groups on one worker thread per CPU. Unpinned, the workers
    that a short kernel wakes after the process idled are placed beside one another, and stay
    so through a loop of calls: a GEMM's two work-groups then share one of two cores (87 against
    180 GFLOP/s on the transformer's QKV projection, after a 0.4 s pause; 2x slower than `cpu`
    on most rows of bench_gemm). POCL_AFFINITY=1 pins worker i to CPU i. PoCL pins by index,
    not within the process's CPU mask: set only where the process may run on every CPU (under
    taskset it could pin to a CPU it may not use), before the driver starts, and never over the
    user's own setting (POCL_AFFINITY=0 turns it off)."""
    if "POCL_AFFINITY" in os.environ or not hasattr(os, "sched_getaffinity"):
        return
    if set(range(os.cpu_count() or 0)) <= os.sched_getaffinity(0):
        os.environ["POCL_AFFINITY"] = "1"


class _State:
    """One OpenCL device: its context, in-order profiling queue, buffer pool and built kernels."""

    def __init__(self, cl, cl_device, info: DeviceInfo):
        self.cl, self.dev, self.info = cl, cl_device, info
        self.ctx = cl.Context([cl_device])
        self.queue = cl.CommandQueue(self.ctx, cl_device,
                                     properties=cl.command_queue_properties.PROFILING_ENABLE)
        self.host_memory = info.extra["host_unified_memory"]
        mf = cl.mem_flags
        self.flags = mf.READ_WRITE | (mf.ALLOC_HOST_PTR if self.host_memory else 0)
        self.last_event = None
        # one per device: wrappers of the same cl.Kernel (the tuner's too) share its arguments
        self.launch_lock = threading.Lock()
        self.kernels: dict = {}
        self._workspace: PoolBuffer | None = None
        self._workspace_lock = threading.Lock()
        self.unaligned_views = 0
        self.pool = PoolAllocator(self._raw_alloc, lambda mem: mem.release(), name=info.name)

    def workspace(self, nbytes: int) -> PoolBuffer:
        """Scratch memory of at least nbytes, shared by every kernel of the device: its in-order
        queue runs one kernel at a time (a launch bound to a smaller one keeps that alive)."""
        with self._workspace_lock:
            if self._workspace is None or self._workspace.nbytes < nbytes:
                n = max(nbytes, 2 * self._workspace.nbytes if self._workspace else 0)
                self._workspace = PoolBuffer(self.pool.alloc(n), n, self.pool)
            return self._workspace

    def _raw_alloc(self, nbytes: int):
        try:
            return self.cl.Buffer(self.ctx, self.flags, size=max(4, nbytes))
        except self.cl.Error as e:
            err = translate(e, "allocate a buffer", self.info.name, nbytes)
            if isinstance(err, OutOfMemoryError):  # the pool drops its cache and retries
                raise MemoryError(str(err)) from None
            raise err from None


def typed(knl, printed, n_buffers: int):
    """The kernel with its parameters' types declared (buffers, the workspace, the run-time sizes as
    longs), so that pyopencl packs the sizes from ints in its generated setter: an undeclared numpy
    scalar goes the slow way, about 8 µs each (a launch's four sizes were 30-45 µs on PoCL, more
    than a small GEMM's wait for its work-groups)."""
    knl.set_scalar_arg_dtypes([None] * (n_buffers + bool(printed.scratch_elems)) + [np.int64] * printed.sizes)
    return knl


class TileLaunch:
    """A built tile kernel launched over one tile kernel's grid: `run(buffers)` enqueues it with
    its workspace (the device's scratch memory, _State.workspace) and run-time sizes, and returns the
    event. The code (printed, cl_kernel) may have been built for another batch size: its source
    holds none (cstyle.key_text), the grid and the sizes are this tile kernel's."""

    def __init__(self, tk, printed, cl_kernel, state: _State):
        self.kernel, self.name, self.source = tk, printed.name, printed.source
        groups, self.local_size, _ = launch_shape(tk)
        self.groups = groups
        self.global_size = tuple(g * n for g, n in zip(groups, self.local_size))
        sizes = tuple(tk.meta.get("sizes", ()))
        assert len(sizes) >= printed.sizes, f"{tk.name} reads {printed.sizes} run-time sizes, knows {sizes}"
        self._sizes = [int(v) for v in sizes[:printed.sizes]]  # packed as the declared longs (typed)
        self._p, self._knl, self._state = printed, cl_kernel, state
        self._ws = None
        self.last_event = None

    def __call__(self, buffers):
        st = self._state
        if not all(self.global_size):
            return None  # an empty index space: nothing to launch
        try:
            with st.launch_lock:
                self._knl.set_args(*self._args(buffers))
                ev = st.cl.enqueue_nd_range_kernel(st.queue, self._knl, self.global_size, self.local_size)
        except st.cl.Error as e:
            raise translate(e, f"launch kernel {self.name}", st.info.name) from None
        self.last_event = st.last_event = ev
        return ev

    def bind(self, buffers):
        """A launch of no arguments on these buffers: a clone of the kernel holds them, set once."""
        st = self._state
        if not all(self.global_size):
            return lambda: None
        knl = typed(self._knl.clone(), self._p, len(self.kernel.buffers))
        knl.set_args(*self._args(buffers))
        enqueue, queue, sizes = st.cl.enqueue_nd_range_kernel, st.queue, (self.global_size, self.local_size)

        def launch():
            try:
                st.last_event = enqueue(queue, knl, *sizes)
            except st.cl.Error as e:
                raise translate(e, f"launch kernel {self.name}", st.info.name) from None
        return launch

    def _args(self, buffers) -> list:
        st, p = self._state, self._p
        args = [getattr(b, "mem", b) for b in buffers]
        if p.scratch_elems:
            if self._ws is None:
                self._ws = st.workspace(int(np.prod(self.groups)) * p.scratch_elems * np.dtype(p.scratch_dtype).itemsize)
            args.append(self._ws.mem)
        return args + self._sizes

    def times(self) -> tuple[int, int]:
        """(start, end) of the last launch in device nanoseconds (waits for it)."""
        return event_times(self.last_event)

    def __repr__(self):
        return f"<opencl tile kernel {self.name} global={self.global_size} local={self.local_size}>"


def event_times(ev) -> tuple[int, int]:
    if ev is None:
        return (0, 0)
    ev.wait()
    return ev.profile.start, ev.profile.end


class _HostView:
    """Keeps a mapped device buffer alive for as long as the numpy view of it lives."""

    def __init__(self, arr: np.ndarray, buf):
        self.__array_interface__ = arr.__array_interface__
        self._keep = (arr, buf)


class OpenCLBackend(Backend):
    """Every OpenCL device of every platform (pyopencl); see the module docstring."""
    kind = "opencl"

    def __init__(self):
        self._cl = None
        self._found: list = []   # (cl device, DeviceInfo), in device-index order
        self._states: dict = {}  # device index -> _State, created on first use
        self.programs = ProgramCache()

    # ---- devices ----
    def discover(self) -> list[DeviceInfo]:
        cl = self._cl = _import_cl()
        try:
            platforms = cl.get_platforms()
        except cl.Error as e:
            raise DeviceError(f"no OpenCL platform found ({e}); {INSTALL_HINT}") from None
        found = []
        for p in platforms:
            try:
                devs = p.get_devices()
            except cl.Error:  # a platform with no devices of any type
                continue
            found.extend((d, device_info(cl, p, d)) for d in devs)
        if not found:
            raise DeviceError(f"no OpenCL device found (an ICD loader but no platform with devices); "
                              f"{INSTALL_HINT}")
        self._found = found
        return [info for _, info in found]

    def _state(self, device) -> _State:
        i = device if isinstance(device, int) else getattr(device, "index", 0)
        st = self._states.get(i)
        if st is None:
            if not self._found:
                self.discover()
            cl_device, info = self._found[i]
            st = self._states[i] = _State(self._cl, cl_device, info)
        return st

    # ---- kernels ----
    def compile_kernels(self, kernels, device) -> list:
        """Several kernels (a graph's) with one program build; a failing batch is built again
        kernel by kernel, so that the CompileError names the kernel at fault."""
        tks = [self.tile_of(k, device) for k in kernels]
        self._build_tiles([tk for tk in tks if self._key(tk) not in self._state(device).kernels], device)
        return [self.compile_tile(tk, device) for tk in tks]

    def info_of(self, device) -> DeviceInfo:
        return self._state(device).info

    tile_kernels = True

    # the code's key: the tile kernel's text less its name, buffer sizes and first grid extent,
    # none of which the printed source holds (a new batch size reuses the build)
    _key = staticmethod(key_text)

    def _build_tiles(self, tks, device) -> None:
        """One program for several tile kernels (a batch that fails is left to compile_tile)."""
        st = self._state(device)
        todo = list({self._key(tk): tk for tk in tks}.values())
        if len(todo) < 2:
            return
        t0 = time.perf_counter()
        try:
            ps = [self._print(tk, st) for tk in todo]
            knls = self.programs.kernels(st.ctx, st.dev, "\n".join(p.source for p in ps), [p.name for p in ps])
        except CompileError:
            return
        for tk, p, knl in zip(todo, ps, knls):
            st.kernels[self._key(tk)] = p, typed(knl, p, len(tk.buffers))
        if config.debug:
            print(f"[tilefuse opencl] {len(todo)} kernels built in {time.perf_counter() - t0:.3f} s", file=sys.stderr)

    def _print(self, tk, st: _State):
        if not st.info.extra["fp64"] and (any(np.dtype(b.dtype) == F64 for b in tk.buffers) or
                                          any(np.dtype(a.dtype) == F64 for a in tk.allocs())):
            raise CompileError(f"opencl: kernel {tk.name} needs float64, which {st.info.name} lacks "
                               "(no cl_khr_fp64); use float32", backend="opencl", kernel=str(tk))
        return print_tile(tk)

    def compile_tile(self, tk, device) -> "TileLaunch":
        """A tile kernel printed as OpenCL C (backends/cstyle.py), built (cached), ready to launch."""
        st = self._state(device)
        key = self._key(tk)
        hit = st.kernels.get(key)
        if hit is None:
            t0 = time.perf_counter()
            p = self._print(tk, st)
            knl = self.programs.kernel(st.ctx, st.dev, p.source, p.name, str(tk))
            hit = st.kernels[key] = p, typed(knl, p, len(tk.buffers))
            if config.debug:
                print(f"[tilefuse opencl] tile kernel {p.name} built in {time.perf_counter() - t0:.3f} s\n"
                      f"{p.source}", file=sys.stderr)
        return TileLaunch(tk, *hit, st)

    # ---- memory ----
    def alloc(self, nbytes: int, device) -> PoolBuffer:
        """nbytes of device memory from the device's caching pool (runtime/memory.py)."""
        pool = self._state(device).pool
        return PoolBuffer(pool.alloc(nbytes), int(nbytes), pool)

    def view(self, buffer: PoolBuffer, offset_bytes: int, nbytes: int) -> PoolBuffer:
        """nbytes of `buffer` from offset_bytes, as an OpenCL sub-buffer. Sub-buffers must start
        at a multiple of the device's base-address alignment (DeviceInfo.extra["buffer_align"],
        128 bytes on PoCL); a view elsewhere gets a block of its own from the pool instead
        (correct for arena temporaries, which is what views are for; counted in memory_stats)."""
        st = next(s for s in self._states.values() if s.pool is buffer.pool or
                  s.ctx == buffer.mem.context)
        if offset_bytes % st.info.extra["buffer_align"] or nbytes == 0:
            if nbytes:
                st.unaligned_views += 1
            return PoolBuffer(st.pool.alloc(nbytes), int(nbytes), st.pool)
        try:
            sub = buffer.mem.get_sub_region(offset_bytes, nbytes)
        except self._cl.Error as e:
            raise translate(e, f"make a view of {nbytes} bytes at offset {offset_bytes}",
                            st.info.name) from None
        return PoolBuffer(sub, int(nbytes), parent=buffer)

    def put(self, host: np.ndarray, device):
        st = self._state(device)
        host = np.ascontiguousarray(host)
        buf = self.alloc(host.nbytes, device)
        if host.nbytes:
            try:  # blocking: the caller may reuse its array right away
                self._cl.enqueue_copy(st.queue, buf.mem, host.view(np.uint8).reshape(-1), is_blocking=True)
            except self._cl.Error as e:
                raise translate(e, "copy to the device", st.info.name, host.nbytes) from None
        return buf

    def to_host(self, buf, aval, device) -> np.ndarray:
        st = self._state(device)
        dtype, shape = np.dtype(aval.dtype), tuple(aval.shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return np.zeros(shape, dtype)
        cl = self._cl
        try:
            if st.host_memory:  # zero-copy: map the host-visible buffer (waits for its writers)
                raw, _ = cl.enqueue_map_buffer(st.queue, buf.mem, cl.map_flags.READ, 0, (nbytes,), np.uint8,
                                               is_blocking=True)
                out = np.asarray(_HostView(raw, buf)).view(dtype).reshape(shape)
                out.flags.writeable = False  # the memory is the device buffer's: Arrays are immutable
                return out
            out = np.empty(nbytes, np.uint8)
            cl.enqueue_copy(st.queue, out, buf.mem, is_blocking=True)
        except cl.Error as e:
            raise translate(e, "read a buffer back", st.info.name, nbytes) from None
        return out.view(dtype).reshape(shape)

    def host_memory(self, device) -> bool:
        return self._state(device).host_memory  # to_host maps the buffer: a view, no copy

    def synchronize(self, device) -> None:
        st = self._state(device)
        try:
            st.queue.finish()
        except self._cl.Error as e:
            raise translate(e, "finish its queue", st.info.name) from None

    def pool_of(self, device) -> PoolAllocator:
        return self._state(device).pool

    def memory_stats(self, device) -> dict:
        return {**super().memory_stats(device), "unaligned_views": self._state(device).unaligned_views}

    def last_event(self, device):
        """The event of the last kernel launched on a device (for the profiler)."""
        return self._state(device).last_event


TYPE_SIZES = {"char": 1, "short": 2, "int": 4, "long": 8, "float": 4, "double": 8, "half": 2}


def device_info(cl, platform, d) -> DeviceInfo:
    """The hardware description, read from the device itself, narrowed by a simulated one
    (runtime/hardware.py: TILEFUSE_HDI) where set."""
    desc = hardware.description("opencl")
    ext = tuple(sorted(d.extensions.split()))
    if desc.get("fp16") is False:
        ext = tuple(e for e in ext if e != "cl_khr_fp16")
    # a simulated description may present a CPU device as a GPU (the GPU layouts, run here)
    is_cpu = bool(d.type & cl.device_type.CPU) and desc.get("device_type", "cpu") != "gpu"
    widths = {t: getattr(d, f"preferred_vector_width_{t}", 1) or 1 for t in TYPE_SIZES}
    for t, size in TYPE_SIZES.items():  # a simulated device: narrower vectors only
        if "vector_bits" in desc:
            widths[t] = min(widths[t], max(1, int(desc["vector_bits"]) // (8 * size)))
        if t in desc.get("vector_widths", {}):
            widths[t] = max(1, min(widths[t], int(desc["vector_widths"][t])))
    lanes = max(1, widths["float"])
    align = max(1, d.mem_base_addr_align // 8)  # bytes; every buffer and sub-buffer starts there
    ghz = (d.max_clock_frequency or 1000) / 1000
    sub_group = 1
    if "cl_nv_device_attribute_query" in ext:
        sub_group = d.get_info(0x4003)  # CL_DEVICE_WARP_SIZE_NV
    peak = d.max_compute_units * ghz * 2 * (lanes if is_cpu else 64)  # a rough FMA estimate
    extra = {"platform": platform.name, "vendor": d.vendor.strip(), "version": d.version,
             "driver_version": d.driver_version, "device_type": "cpu" if is_cpu else "gpu", "runtime_sizes": True,
             "fp64": "cl_khr_fp64" in ext,
             "fp16": "cl_khr_fp16" in ext,
             "int64_atomics": "cl_khr_int64_base_atomics" in ext,
             "preferred_width": widths, "buffer_align": align,
             # the alignment a kernel may assume of its buffers' starts (a simulated device: less)
             "base_align": min(align, int(desc.get("buffer_align", align))),
             "max_alloc_bytes": d.max_mem_alloc_size,
             "host_unified_memory": bool(d.host_unified_memory) or is_cpu}
    info = DeviceInfo(kind="opencl", name=f"{d.name.strip()} ({platform.name.strip()})",
                      compute_units=d.max_compute_units, simd_lanes_f32=lanes,
                      l2_bytes=d.global_mem_cache_size or 1 << 20, local_mem_bytes=d.local_mem_size,
                      max_work_group=d.max_work_group_size, sub_group=sub_group,
                      global_mem_bytes=d.global_mem_size, peak_gflops=float(peak),
                      peak_gbps=host_info().peak_gbps if is_cpu else 0.0, features=ext,
                      cpu_name=host_info().cpu_name if is_cpu else "", extra=extra)
    return hardware.narrowed(info, desc)


def create() -> OpenCLBackend:
    return OpenCLBackend()


# GEMM: the shared tile builder (ir/kernel/gemm.py), ahead of gemm_then_epilogue
register_gemm("opencl", priority=20)
# FlashAttention: the shared tile builders (ir/kernel/attention.py), the CPU form on CPU devices
register_attention("opencl", priority=10)
register_kernels("opencl")  # every kernel through the shared scheduler; the tuner searches its work-groups
