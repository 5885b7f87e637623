"""The WebGPU backend (wgpu: Metal, Vulkan, DX12): kernels laid out by the shared scheduler and the
tile builders for a GPU target, printed as WGSL (wgsl.py); this file is the device: adapter
discovery and its limits as the hardware description, buffers from a caching pool, pipelines
(cached by source), dispatch. `pip install wgpu`; on Linux without a GPU, Mesa's lavapipe
(`apt-get install mesa-vulkan-drivers libvulkan1`) is a Vulkan device on the CPU.

WebGPU binds a buffer once per dispatch: a view of an arena would share its buffer with the
arena's other views, so every view is a block of its own from the pool."""
from __future__ import annotations

import functools
import os
import threading
import types

import numpy as np

from tilefuse.ir.errors import CompileError, DeviceError
from tilefuse.runtime.hardware import DeviceInfo, check_fits
from tilefuse.runtime import profiler
from tilefuse.runtime.memory import PoolAllocator, PoolBuffer
from tilefuse.runtime.tiled import register_attention, register_gemm, register_kernels

from ..base import Backend
from .wgsl import print_wgsl

INSTALL_HINT = ("install wgpu (`pip install wgpu`, or tilefuse[webgpu]) and a WebGPU driver: Metal (macOS), "
                "DX12 or Vulkan (Windows), Vulkan (Linux; no GPU: `apt-get install mesa-vulkan-drivers libvulkan1`)")
UNSUPPORTED = ("float64", "int64", "uint64")


def _ceil4(n: int) -> int:
    return max(4, -(-int(n) // 4) * 4)


class Launch:
    """A built pipeline: run(buffers) binds them and dispatches its work-groups."""

    def __init__(self, be, tk, printed, pipeline, layout):
        self.kernel, self.name, self.source = tk, printed.name, printed.source
        self.groups, self._be, self.pipeline, self._layout = printed.groups, be, pipeline, layout
        self._sizes = be.put(np.array([tk.points(), *tk.meta.get("sizes", ())], np.int32))  # (the code holds none)

    def __call__(self, buffers):
        stamps = Stamps(self._be) if profiler.active is not None and self._be.timestamps else None
        self._be.submit(self.bind(buffers).args[0], stamps)
        return stamps

    def bind(self, buffers):
        """A launch of no arguments on these buffers, their bind group made once (batch joins them)."""
        entries = [{"binding": i, "resource": {"buffer": b.mem, "offset": 0, "size": _ceil4(b.nbytes)}}
                   for i, b in enumerate([*buffers, self._sizes])]
        work = ((self, self._be.device.create_bind_group(layout=self._layout, entries=entries)),)
        return functools.partial(self._be.submit, work)  # (zero work-groups dispatch nothing)


class Stamps:
    """A launch's start and end on the device in ns (timestamp queries), read as an OpenCL event's."""

    def __init__(self, be):
        wgpu, self._queue = be._wgpu, be.device.queue
        self.queries = be.device.create_query_set(type=wgpu.QueryType.timestamp, count=2)
        self.buffer = be.device.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
        self.writes = {"query_set": self.queries, "beginning_of_pass_write_index": 0, "end_of_pass_write_index": 1}

    @property
    def profile(self):
        start, end = (int(t) for t in np.frombuffer(self._queue.read_buffer(self.buffer), np.uint64))
        return types.SimpleNamespace(queued=start, start=start, end=end)


class WebGPUBackend(Backend):
    kind = "webgpu"
    tile_kernels = True
    tile_prints = frozenset({"shared"})  # (scalar WGSL: a GPU schedule needs neither vectors nor scratch)

    def __init__(self):
        self.device, self.info, self.pool, self._sync = None, None, None, None
        self._pipelines, self._lock = {}, threading.Lock()

    def submit(self, work, stamps=None) -> None:
        """(Launch, bind group) pairs as one pass and one submit (each sees the writes before it)."""
        enc = self.device.create_command_encoder()
        cp = enc.begin_compute_pass(timestamp_writes=stamps and stamps.writes)
        for launch, group in work:
            cp.set_pipeline(launch.pipeline)
            cp.set_bind_group(0, group)
            cp.dispatch_workgroups(*launch.groups)
        cp.end()
        if stamps:
            enc.resolve_query_set(stamps.queries, 0, 2, stamps.buffer, 0)
        self.device.queue.submit([enc.finish()])

    def discover(self) -> list[DeviceInfo]:
        try:
            import wgpu
        except ImportError as e:
            raise DeviceError(f"WebGPU is unavailable: wgpu is not installed ({e}); {INSTALL_HINT}") from None
        try:
            adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
            lim = adapter.limits
            self.timestamps = "timestamp-query" in adapter.features  # (the profiler's device times)
            self.device = adapter.request_device_sync(required_limits=dict(lim),  # all the adapter has
                                                      required_features=["timestamp-query"] * self.timestamps)
        except Exception as e:  # no adapter, no driver
            raise DeviceError(f"no WebGPU adapter ({type(e).__name__}: {e}); {INSTALL_HINT}") from None
        self._wgpu, info = wgpu, adapter.info
        self.info = DeviceInfo(
            kind="webgpu", name=f"{info.get('device', 'webgpu')} ({info.get('backend_type', '')})",
            compute_units=(os.cpu_count() or 1) if info.get("adapter_type") == "CPU" else 1, simd_lanes_f32=1,
            local_mem_bytes=lim["max-compute-workgroup-storage-size"],
            max_work_group=min(lim["max-compute-invocations-per-workgroup"], lim["max-compute-workgroup-size-x"]),
            features=tuple(sorted(adapter.features)),
            extra={"device_type": "gpu", "runtime_sizes": True, "fp64": False, "unsupported": UNSUPPORTED, "fp16": "shader-f16" in adapter.features,
                   "max_buffer": lim["max-storage-buffer-binding-size"], "adapter_type": info.get("adapter_type"),
                   # Mesa's llvmpipe ends any loop after 65535 trips per invocation (gallivm's limit)
                   "max_loop_trips": 65535 if "llvmpipe" in info.get("device", "") else None})
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self.pool = PoolAllocator(lambda n: self._raw_alloc(n, usage), lambda b: b.destroy(), name="webgpu")
        self._sync = self.alloc(4)
        return [self.info]

    def _raw_alloc(self, nbytes: int, usage):
        if nbytes > self.info.extra["max_buffer"]:
            raise MemoryError(f"webgpu: {nbytes} bytes exceed one buffer's limit ({self.info.extra['max_buffer']})")
        return self.device.create_buffer(size=_ceil4(nbytes), usage=usage)

    # ---- kernels ----
    def info_of(self, device=None) -> DeviceInfo:
        return self.info

    def compile_tile(self, tk, device=None) -> Launch:
        check_fits(tk, self.info)
        p = print_wgsl(tk)
        with self._lock:
            hit = self._pipelines.get(p.source)
            if hit is None:
                hit = self._pipelines[p.source] = self._pipeline(tk, p)
        return Launch(self, tk, p, *hit)

    def _pipeline(self, tk, p):
        wgpu = self._wgpu
        try:
            module = self.device.create_shader_module(code=p.source)
            ro = wgpu.BufferBindingType.read_only_storage
            entries = [{"binding": i, "visibility": wgpu.ShaderStage.COMPUTE,
                        "buffer": {"type": ro if f"var<storage, read> b{i}:" in p.source else wgpu.BufferBindingType.storage}}
                       for i in range(len(tk.buffers) + 1)]  # (+1: the sizes)
            layout = self.device.create_bind_group_layout(entries=entries)
            pipe = self.device.create_compute_pipeline(
                layout=self.device.create_pipeline_layout(bind_group_layouts=[layout]),
                compute={"module": module, "entry_point": "main"})
        except Exception as e:
            raise CompileError(f"webgpu: building kernel {p.name} failed: {e}", backend="webgpu",
                               kernel=str(tk), source=p.source) from None
        return pipe, layout

    # ---- memory ----
    def alloc(self, nbytes: int, device=None) -> PoolBuffer:
        return PoolBuffer(self.pool.alloc(nbytes), int(nbytes), self.pool)

    def view(self, buffer, offset: int, nbytes: int) -> PoolBuffer:
        return self.alloc(nbytes)  # (see the module docstring)

    def put(self, host: np.ndarray, device=None) -> PoolBuffer:
        host = np.ascontiguousarray(host)
        buf = self.alloc(host.nbytes)
        if host.nbytes:  # (whole words)
            self.device.queue.write_buffer(buf.mem, 0, np.pad(host.reshape(-1).view(np.uint8), (0, -host.nbytes % 4)))
        return buf

    def to_host(self, buf: PoolBuffer, aval, device=None) -> np.ndarray:
        dtype = np.dtype(aval.dtype)
        n = int(np.prod(aval.shape, dtype=np.int64)) * dtype.itemsize
        raw = self.device.queue.read_buffer(buf.mem, 0, _ceil4(n)) if n else b""
        return np.frombuffer(raw, np.uint8)[:n].view(dtype).reshape(aval.shape)

    def synchronize(self, device=None) -> None:
        self.device.queue.read_buffer(self._sync.mem, 0, 4)  # (it waits for the work submitted before)


def create() -> WebGPUBackend:
    return WebGPUBackend()


register_gemm("webgpu", priority=20)
register_attention("webgpu", priority=10)
register_kernels("webgpu")
