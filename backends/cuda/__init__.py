"""The CUDA backend: tile kernels (the shared scheduler's and builders', ir/kernel/) → NVPTX LLVM IR
(tile.py, a form of the shared LLVM tile printer) → PTX via llvmlite's NVPTX target (render.py),
loaded and launched through the driver API over ctypes (driver.py).
Buffers come from the caching pool (runtime/memory.py) over cuMemAlloc; copies and launches go
on one stream per device.

Without a GPU, `offline_device(sm)` gives a device that compiles (PTX for the chosen compute
capability) but cannot run, so `tx.jit(f).lower(*args, device=offline_device()).sources()` and
`ptx_for(f, *args)` return every kernel's PTX."""
from __future__ import annotations

import hashlib
import re
import threading

import numpy as np
from tilefuse.ir.errors import DeviceError
from tilefuse.runtime import hardware
from tilefuse.runtime.hardware import DeviceInfo
from tilefuse.runtime.memory import PoolAllocator, PoolBuffer
from tilefuse.runtime.tiled import register_attention, register_gemm, register_kernels

from ..base import Backend
from ..llvmir.tile import print_tile
from . import driver
from .render import to_ptx
from .tile import PTXTilePrinter, launch_dims

# the PTX targets we emit; a newer GPU JIT-compiles the newest of them (PTX is forward-compatible)
SM_TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90")


def sm_target(cc: tuple[int, int]) -> str:
    """The newest PTX target we emit that the compute capability `cc` runs."""
    want = cc[0] * 10 + cc[1]
    ok = [t for t in SM_TARGETS if int(t[3:]) <= want]
    if not ok:
        raise DeviceError(f"compute capability {cc[0]}.{cc[1]} is older than {SM_TARGETS[0]}, "
                          "the oldest target this backend emits")
    # sm_86/sm_89 PTX runs only on their own minor family: prefer the exact or the base target
    exact = f"sm_{want}"
    return exact if exact in ok else max((t for t in ok if t.endswith("0")), key=lambda t: int(t[3:]))


# the warp MMA instructions of sm_80 and later (ir/kernel/target.MMA's fields): mma.sync m16n8k16
MMA = tuple(("m16n8k16", 16, 8, 16, t) for t in ("float16", "bfloat16"))

def device_info(name: str, cc: tuple[int, int], sm_count: int, *, max_threads_per_block=1024,
                shared_per_block=48 << 10, warp=32, l2_bytes=0, max_threads_per_sm=2048,
                total_mem=0, clock_khz=0, mem_clock_khz=0, bus_bits=0) -> DeviceInfo:
    """DeviceInfo from the driver's attribute values (narrowed by a simulated description,
    runtime/hardware.py, where set)."""
    fp32_per_sm = 64 if cc == (8, 0) else 128
    sm = sm_target(cc)
    return hardware.narrowed(DeviceInfo(
        kind="cuda", name=name, compute_units=sm_count, simd_lanes_f32=warp,
        l1_bytes=shared_per_block, l2_bytes=l2_bytes, local_mem_bytes=shared_per_block,
        max_work_group=max_threads_per_block, sub_group=warp, global_mem_bytes=total_mem,
        peak_gflops=sm_count * fp32_per_sm * 2 * clock_khz / 1e6,
        peak_gbps=2 * mem_clock_khz * 1e3 * bus_bits / 8 / 1e9,
        features=(f"sm_{cc[0]}{cc[1]}",), cpu_name=sm,
        extra={"max_threads_per_sm": max_threads_per_sm, "sm": sm, "cc": cc, "mma": MMA if cc >= (8, 0) else ()}),
        hardware.description("cuda"))


# typical devices for offline compilation (A100 and H100 SXM)
OFFLINE = {"sm_80": ("NVIDIA A100 (offline)", (8, 0), 108),
           "sm_90": ("NVIDIA H100 (offline)", (9, 0), 132)}


# ---- buffers ----------------------------------------------------------------------------------

class _Block:
    """One cuMemAlloc allocation (the pool tracks blocks by identity)."""
    __slots__ = ("__weakref__", "ptr")

    def __init__(self, ptr: int):
        self.ptr = ptr


class DeviceBuffer(PoolBuffer):
    """Device memory (runtime/memory.PoolBuffer) with its address: `mem` is the pool block (None
    for a view, which keeps its parent alive)."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int, nbytes: int, block=None, pool=None, parent=None):
        super().__init__(block, nbytes, pool, parent)
        self.ptr = ptr

    def __repr__(self):
        return f"DeviceBuffer(0x{self.ptr:x}, {self.nbytes})"


# ---- kernels ----------------------------------------------------------------------------------

def _fn_name(kernel) -> str:
    digest = hashlib.sha1(str(kernel).encode()).hexdigest()[:10]
    return re.sub(r"[^A-Za-z0-9_]", "_", f"{kernel.name}_{digest}")


class CudaKernel:
    """A kernel compiled to PTX, launched as `grid` blocks of `block` threads: calling it launches
    it on the device's stream (the module is loaded on the first call)."""

    def __init__(self, kernel, fn_name: str, llvm_ir: str, ptx: str, backend, device, grid: int, block: int):
        self.kernel, self.fn_name, self.llvm_ir, self.source = kernel, fn_name, llvm_ir, ptx
        self.backend, self.device, self.grid, self.block = backend, device, grid, block
        self._fn = None

    def __call__(self, buffers):
        if self.grid == 0:
            return
        ctx = self.backend.context(self.device)
        if self._fn is None:
            self._module, self._fn = ctx.load_module(self.source, self.fn_name)
        ctx.launch(self._fn, self.grid, self.block, [b.ptr for b in buffers])


class CUDABackend(Backend):
    """NVIDIA GPUs through the driver API."""
    kind = "cuda"

    def __init__(self):
        self._contexts: dict[int, driver.Context] = {}
        self._pools: dict[int, PoolAllocator] = {}
        self._infos: list[DeviceInfo] = []
        self._ptx: dict = {}  # (kernel text, sm) -> (name, LLVM IR, PTX)
        self._lock = threading.Lock()

    def discover(self) -> list[DeviceInfo]:
        n = driver.init()
        infos = []
        for i in range(n):
            d = driver.device(i)
            a = {k: driver.attribute(d, k) for k in driver.ATTR}
            infos.append(device_info(
                driver.device_name(d), (a["cc_major"], a["cc_minor"]), a["sm_count"],
                max_threads_per_block=a["max_threads_per_block"],
                shared_per_block=a["shared_memory_per_block"], warp=a["warp_size"],
                l2_bytes=a["l2_bytes"], max_threads_per_sm=a["max_threads_per_sm"],
                total_mem=driver.total_mem(d), clock_khz=a["clock_khz"],
                mem_clock_khz=a["memory_clock_khz"], bus_bits=a["bus_width_bits"]))
        self._infos = infos
        return infos

    def info_of(self, device) -> DeviceInfo:
        info = getattr(device, "info", None)
        return info if info is not None else self._infos[0]

    def context(self, device) -> driver.Context:
        i = getattr(device, "index", 0)
        ctx = self._contexts.get(i)
        if ctx is None:
            with self._lock:
                ctx = self._contexts.get(i)
                if ctx is None:
                    ctx = self._contexts[i] = driver.Context(driver.device(i))
        return ctx

    def pool_of(self, device) -> PoolAllocator:
        i = getattr(device, "index", 0)
        pool = self._pools.get(i)
        if pool is None:
            ctx = self.context(device)
            pool = self._pools[i] = PoolAllocator(lambda n: _Block(ctx.mem_alloc(n)),
                                                  lambda b: ctx.mem_free(b.ptr), name=f"cuda:{i}")
        return pool

    # -- kernels: ir/kernel/schedule.py lays every kernel out as a tile kernel (Backend.compile_kernel)
    tile_kernels = True

    def compile_tile(self, tk, device=None) -> CudaKernel:
        """A tile kernel (ir/kernel/tile.py) as PTX: a block per grid point, a thread per lane."""
        sm = self.info_of(device).extra.get("sm", "sm_80")
        key = (str(tk), sm)
        hit = self._ptx.get(key)
        if hit is None:
            name = _fn_name(tk)
            text = print_tile(tk, name, PTXTilePrinter, "cuda")
            hit = self._ptx[key] = (name, text, to_ptx(text, sm))
        return CudaKernel(tk, *hit, self, device, *launch_dims(tk))

    # -- memory ----------------------------------------------------------------------------
    def alloc(self, nbytes: int, device=None) -> DeviceBuffer:
        pool = self.pool_of(device)
        block = pool.alloc(nbytes)
        return DeviceBuffer(block.ptr, int(nbytes), block, pool)

    def view(self, buf: DeviceBuffer, offset: int, nbytes: int) -> DeviceBuffer:
        return DeviceBuffer(buf.ptr + offset, nbytes, parent=buf)

    def put(self, host, device=None) -> DeviceBuffer:
        host = np.ascontiguousarray(host)
        buf = self.alloc(host.nbytes, device)
        if host.nbytes:
            ctx = self.context(device)
            ctx.htod(buf.ptr, host.ctypes.data, host.nbytes)
            ctx.synchronize()  # the host array may go away when we return
        return buf

    def to_host(self, buf: DeviceBuffer, aval, device=None) -> np.ndarray:
        out = np.empty(aval.shape, aval.dtype)
        if out.nbytes:
            ctx = self.context(device)
            ctx.dtoh(out.ctypes.data, buf.ptr, out.nbytes)
            ctx.synchronize()
        out.flags.writeable = False
        return out

    def synchronize(self, device=None) -> None:
        self.context(device).synchronize()


class OfflineCUDABackend(CUDABackend):
    """Compiles to PTX for a chosen compute capability without a GPU or driver; running raises.
    Constants of a graph stay on the host (compile_graph places them at compile time)."""

    def __init__(self, sm: str = "sm_90"):
        super().__init__()
        if sm not in OFFLINE:
            raise DeviceError(f"offline CUDA targets: {', '.join(OFFLINE)}; got {sm!r}")
        name, cc, sms = OFFLINE[sm]
        self._infos = [device_info(name, cc, sms, l2_bytes=50 << 20, total_mem=80 << 30)]

    def discover(self):
        return list(self._infos)

    def context(self, device):
        raise DeviceError("an offline CUDA device compiles PTX but cannot run kernels "
                          "(no GPU/driver is used)")

    def put(self, host, device=None):
        return np.ascontiguousarray(host)


def offline_device(sm: str = "sm_90"):
    """A Device that compiles for `sm` (sm_80 or sm_90) without a GPU: use it as
    `tx.jit(f).lower(*args, device=offline_device()).sources()`."""
    from tilefuse.runtime.device import Device
    backend = OfflineCUDABackend(sm)
    return Device(backend, 0, backend._infos[0], True)


def ptx_for(fn, *args, sm: str = "sm_90") -> dict[str, str]:
    """Kernel name → PTX of every kernel `tx.jit(fn)(*args)` would launch, for `sm`."""
    import tilefuse as tx
    srcs = tx.jit(fn).lower(*args, device=offline_device(sm)).sources()
    # (a kernel's source is its kernel IR and "name.cuda" its PTX; a loop kernel's is its PTX)
    return {k.removesuffix(".cuda"): srcs[k] for k in srcs if ".entry" in srcs[k]}


def create() -> CUDABackend:
    return CUDABackend()


# the shared builders (ir/kernel/: GEMM, FlashAttention) and scheduler, searched by the tuner
register_gemm("cuda", priority=20)
register_attention("cuda", priority=10)
register_kernels("cuda")

__all__ = [
    "CUDABackend",
    "DeviceBuffer",
    "OfflineCUDABackend",
    "create",
    "device_info",
    "offline_device",
    "ptx_for",
    "sm_target",
]
