"""The CPU backend: every kernel is a tile kernel — the shared scheduler's layout of an ordinary
kernel (ir/kernel/schedule.py), or a builder's (GEMM, FlashAttention) — printed as LLVM IR by
backends/llvmir/tile.py, optimised for the host CPU, linked with ORC LLJIT/JITLink and called via
ctypes on a thread pool (compile.py); buffers come from the caching pool (runtime/memory.py)."""
from __future__ import annotations

import threading
import weakref

import numpy as np
from tilefuse.runtime import host_blas
from tilefuse.runtime.hardware import host_info
from tilefuse.runtime.memory import PoolAllocator
from tilefuse.runtime.tiled import register_attention, register_kernels

from ..base import Backend
from .buffer import Owner, interface, raw_alloc
from .compile import CompiledKernel, compile_kernel, compile_kernels, compile_tile, compile_tiles, memory_cache_stats


class LLVMBackend(Backend):
    """Host CPU through llvmlite."""
    kind = "cpu"

    def __init__(self):
        self.pool = PoolAllocator(raw_alloc, lambda block: None, name="cpu")
        self._scratch = threading.local()

    def scratch(self, nbytes: int) -> np.ndarray:
        """A kernel's workspace for one call on this thread (GEMM packing, attention): one block
        per thread, grown to the largest request and kept, so a loop of such kernels allocates
        nothing per call. Outside the pool: a call holds it only while it runs."""
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._scratch.buf = raw_alloc(nbytes)[0]
        return buf

    def discover(self):
        import llvmlite.binding as llvm
        llvm.check_jit_execution()  # OSError where executable memory is forbidden
        return [host_info()]

    def info_of(self, device=None):
        return getattr(device, "info", None) or host_info()

    # -- kernels ---------------------------------------------------------------------------
    def compile_kernel(self, kernel, device=None, params=None) -> CompiledKernel:
        """One kernel through the shared scheduler, under the Schedule `params` (default: the
        Target's), printed as a tile kernel (llvmir/tile.py)."""
        return compile_kernel(kernel, self.info_of(device), params)

    def compile_kernels(self, kernels, device=None) -> None:
        """A graph's kernels, built in parallel processes where no cache holds them."""
        compile_kernels(kernels, self.info_of(device))

    tile_kernels = True

    def compile_tiles(self, tiles, device=None) -> None:
        compile_tiles(tiles, self.info_of(device))

    def compile_tile(self, kernel, device=None):
        """A tile kernel printed as LLVM IR (llvmir/tile.py), compiled through the caches, on the pool."""
        return compile_tile(kernel, self.info_of(device))

    # -- memory ----------------------------------------------------------------------------
    def alloc(self, nbytes: int, device=None) -> np.ndarray:
        """A 64-byte aligned 1-D uint8 buffer of nbytes from the pool; it returns to the pool at
        free() or when the last view of it is gone."""
        block = self.pool.alloc(nbytes)
        o = Owner()  # (buffer.py; made here, not in a helper: every jitted call's outputs come here)
        o.block, o.pool, o.addr, o.nbytes = block, self.pool, block[1], nbytes
        o.__array_interface__ = block[2].get(nbytes) or interface(block, nbytes)
        buf = np.asarray(o)
        o.buffer = weakref.ref(buf)
        return buf

    def free(self, buffer, device=None) -> None:
        """Give a buffer back to the pool now (the caller promises no view of it is used again).
        Buffers that did not come from alloc are left alone."""
        owner = buffer.base if isinstance(buffer, np.ndarray) else None
        if isinstance(owner, Owner):
            owner.release()

    def view(self, buf, offset: int, nbytes: int) -> np.ndarray:
        """A sub-buffer of an arena: a slice (it keeps the arena's block alive)."""
        return buf[offset:offset + nbytes]

    def put(self, host, device=None) -> np.ndarray:
        host = np.asarray(host)
        buf = self.alloc(host.nbytes, device)
        np.copyto(np.ndarray(host.shape, host.dtype, buf), host, casting="no")
        return buf

    def to_host(self, buf, aval, device=None) -> np.ndarray:
        """A zero-copy, read-only typed view of the buffer."""
        out = np.ndarray(aval.shape, aval.dtype, buf)  # (one call: every eager operation reads its operands so)
        out.setflags(write=False)
        return out

    def host_memory(self, device=None) -> bool:
        return True

    def adopt(self, host, device=None):
        """host's memory as a buffer when it is C-contiguous, writable and aligned to its element
        (the kernels' loads and stores assume no more: llvmir/tile.py); else None. A buffer not
        from the pool takes the kernels' slower address path (compile.py) and is never pooled."""
        if not host.flags.c_contiguous or not host.flags.writeable or host.ctypes.data % host.dtype.itemsize:
            return None
        return host.reshape(-1).view(np.uint8)

    def compile_stats(self) -> dict:
        from tilefuse.runtime import compile_cache
        return {**compile_cache.stats(), **memory_cache_stats()}


# GEMM: the shared builder's packed form, or numpy's BLAS where host_blas.choice says so
host_blas.register("cpu", priority=20)


def create() -> LLVMBackend:
    return LLVMBackend()


__all__ = ["LLVMBackend", "CompiledKernel", "create"]


register_attention("cpu", priority=10)  # FlashAttention: the shared tile builders' CPU form
register_kernels("cpu")  # every other kernel through the shared scheduler; the tuner searches its unroll
