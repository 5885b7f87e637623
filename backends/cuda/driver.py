"""The CUDA driver API through ctypes against libcuda (no CUDA toolkit needed at run time).

Every call goes through `check`, which maps a failing CUresult to a tilefuse error carrying the
driver's name for it (cuGetErrorName): DeviceError in general, OutOfMemoryError for
CUDA_ERROR_OUT_OF_MEMORY, CompileError when a module does not load."""
from __future__ import annotations

import ctypes
import ctypes.util

from tilefuse.ir.errors import CompileError, DeviceError, OutOfMemoryError

CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NO_DEVICE = 100
MODULE_ERRORS = (200, 209, 218, 300)  # invalid image, no binary for GPU, invalid PTX, invalid source

# CUdevice_attribute values (cuda.h)
ATTR = {"max_threads_per_block": 1, "shared_memory_per_block": 8, "warp_size": 10,
        "clock_khz": 13, "sm_count": 16, "memory_clock_khz": 36, "bus_width_bits": 37,
        "l2_bytes": 38, "max_threads_per_sm": 39, "cc_major": 75, "cc_minor": 76,
        "shared_memory_per_block_optin": 97}

_lib = None
_load_error = ""


def lib():
    """libcuda, loaded once; DeviceError naming why when it cannot be."""
    global _lib, _load_error
    if _lib is not None:
        return _lib
    if _load_error:
        raise DeviceError(_load_error)
    names = ["libcuda.so.1", "libcuda.so", ctypes.util.find_library("cuda") or "", "nvcuda.dll"]
    for n in filter(None, names):
        try:
            _lib = ctypes.CDLL(n)
            break
        except OSError:
            continue
    if _lib is None:
        _load_error = "no CUDA driver: libcuda.so.1 cannot be loaded (no NVIDIA driver installed)"
        raise DeviceError(_load_error)
    return _lib


def error_name(code: int) -> str:
    s = ctypes.c_char_p()
    try:
        if lib().cuGetErrorName(ctypes.c_int(code), ctypes.byref(s)) == 0 and s.value:
            return s.value.decode()
    except (DeviceError, AttributeError):
        pass
    return f"CUresult {code}"


def check(code: int, what: str) -> None:
    """Raise the tilefuse error for a failing driver call `what`."""
    if code == 0:
        return
    msg = f"{what} failed: {error_name(code)} ({code})"
    if code == CUDA_ERROR_OUT_OF_MEMORY:
        raise OutOfMemoryError(msg)
    if code in MODULE_ERRORS:
        raise CompileError(msg, backend="cuda")
    raise DeviceError(msg)


def call(name: str, *args) -> None:
    check(getattr(lib(), name)(*args), name)


def init() -> int:
    """cuInit and the device count (DeviceError when there is none)."""
    code = lib().cuInit(0)
    if code == CUDA_ERROR_NO_DEVICE:
        raise DeviceError(f"no CUDA device: cuInit returned {error_name(code)}")
    check(code, "cuInit")
    n = ctypes.c_int()
    call("cuDeviceGetCount", ctypes.byref(n))
    if n.value == 0:
        raise DeviceError("no CUDA device: cuDeviceGetCount returned 0")
    return n.value


def device(index: int) -> int:
    d = ctypes.c_int()
    call("cuDeviceGet", ctypes.byref(d), ctypes.c_int(index))
    return d.value


def attribute(dev: int, name: str) -> int:
    v = ctypes.c_int()
    call("cuDeviceGetAttribute", ctypes.byref(v), ctypes.c_int(ATTR[name]), ctypes.c_int(dev))
    return v.value


def device_name(dev: int) -> str:
    buf = ctypes.create_string_buffer(256)
    call("cuDeviceGetName", buf, ctypes.c_int(256), ctypes.c_int(dev))
    return buf.value.decode(errors="replace")


def total_mem(dev: int) -> int:
    v = ctypes.c_size_t()
    call("cuDeviceTotalMem_v2", ctypes.byref(v), ctypes.c_int(dev))
    return v.value


class Context:
    """The device's primary context made current, with one stream for copies and launches."""

    def __init__(self, dev: int):
        self.dev = dev
        self.ctx = ctypes.c_void_p()
        call("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), ctypes.c_int(dev))
        self.make_current()
        self.stream = ctypes.c_void_p()
        call("cuStreamCreate", ctypes.byref(self.stream), ctypes.c_uint(0))

    def make_current(self) -> None:
        call("cuCtxSetCurrent", self.ctx)

    # memory
    def mem_alloc(self, nbytes: int) -> int:
        p = ctypes.c_uint64()
        try:
            call("cuMemAlloc_v2", ctypes.byref(p), ctypes.c_size_t(max(int(nbytes), 1)))
        except OutOfMemoryError as e:
            raise MemoryError(str(e)) from None  # the pool frees its cache and retries
        return p.value

    def mem_free(self, ptr: int) -> None:
        call("cuMemFree_v2", ctypes.c_uint64(ptr))

    def htod(self, dst: int, host, nbytes: int) -> None:
        call("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(dst), ctypes.c_void_p(host),
             ctypes.c_size_t(nbytes), self.stream)

    def dtoh(self, host, src: int, nbytes: int) -> None:
        call("cuMemcpyDtoHAsync_v2", ctypes.c_void_p(host), ctypes.c_uint64(src),
             ctypes.c_size_t(nbytes), self.stream)

    def dtod(self, dst: int, src: int, nbytes: int) -> None:
        call("cuMemcpyDtoDAsync_v2", ctypes.c_uint64(dst), ctypes.c_uint64(src),
             ctypes.c_size_t(nbytes), self.stream)

    def synchronize(self) -> None:
        call("cuStreamSynchronize", self.stream)

    # modules and launches
    def load_module(self, ptx: str, fn_name: str):
        """cuModuleLoadData on PTX text (the driver JIT-compiles it) → (module, function)."""
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        data = ptx.encode() + b"\0"
        call("cuModuleLoadData", ctypes.byref(mod), ctypes.c_char_p(data))
        call("cuModuleGetFunction", ctypes.byref(fn), mod, fn_name.encode())
        return mod, fn

    def launch(self, fn, grid: int, block: int, ptrs) -> None:
        args = (ctypes.c_uint64 * len(ptrs))(*ptrs)
        argv = (ctypes.c_void_p * len(ptrs))(*[ctypes.addressof(args) + 8 * i for i in range(len(ptrs))])
        call("cuLaunchKernel", fn, ctypes.c_uint(grid), ctypes.c_uint(1), ctypes.c_uint(1),
             ctypes.c_uint(block), ctypes.c_uint(1), ctypes.c_uint(1), ctypes.c_uint(0),
             self.stream, argv, None)

    # events (for the profiler)
    def event(self):
        e = ctypes.c_void_p()
        call("cuEventCreate", ctypes.byref(e), ctypes.c_uint(0))
        return e

    def record(self, event) -> None:
        call("cuEventRecord", event, self.stream)

    def elapsed_ms(self, start, end) -> float:
        ms = ctypes.c_float()
        call("cuEventSynchronize", end)
        call("cuEventElapsedTime", ctypes.byref(ms), start, end)
        return ms.value
