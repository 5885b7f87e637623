"""Tile kernels on the host CPU: printed by backends/llvmir/tile.py, compiled through the caches,
run over the thread pool."""
from __future__ import annotations

import ctypes

import numpy as np

from tilefuse.backends.llvmir.tile import key_text, print_tile, tasks
from tilefuse.ir.errors import CompileError
from tilefuse.ir.kernel.tile import TileKernel
from tilefuse.runtime import compile_cache

from .compile import KernelFn, code_digest, get_target
from .pool import get_pool


class TileRun:
    """A tile kernel's machine code: run(buffers) runs its grid points, split over the pool's
    threads in contiguous chunks of tasks."""

    def __init__(self, k: TileKernel, fn_name: str, address: int, threads: int):
        self.kernel, self.name, self.address = k, fn_name, address
        self._fn = KernelFn(address)
        self._nbytes = [b.size * np.dtype(b.dtype).itemsize for b in k.buffers]
        self._ptrs_t = ctypes.c_void_p * len(self._nbytes)
        n = tasks(k)
        self.threads = max(1, min(threads, n))
        per = -(-n // self.threads)
        self._bounds = [(s, min(s + per, n)) for s in range(0, n, per)]
        self._n = n
        self._launch = get_pool(self.threads).launcher(self._fn, self._bounds) if self.threads > 1 else None

    @property
    def llvm_ir(self) -> str:
        return print_tile(self.kernel, self.name)

    def __call__(self, buffers) -> None:
        addrs = []
        for i, (buf, need) in enumerate(zip(buffers, self._nbytes)):
            if not isinstance(buf, np.ndarray) or buf.nbytes < need:
                raise CompileError(f"tile kernel {self.kernel.name}: buffer {i} needs {need} bytes",
                                   backend="llvm")
            addrs.append(buf.ctypes.data)
        ptrs = self._ptrs_t(*addrs)
        if self._launch is None:
            self._fn(ptrs, 0, self._n)
        else:
            self._launch(ptrs)

    def __repr__(self):
        return f"<llvm tile kernel {self.kernel.name} ({self.name}), {self._n} tasks on {self.threads} thread(s)>"


def compile_tile(k: TileKernel, info) -> TileRun:
    """Print, compile (through the caches) and load a tile kernel for the host CPU."""
    target = get_target(info)
    text = key_text(k)  # equal code, one cache entry
    key = compile_cache.make_key("tile", code_digest("tile.py", "render.py", __file__), text, target.fingerprint)
    fn_name = "tf_tile_" + key[:24]
    address = target.module(key, fn_name, lambda: print_tile(k, fn_name), f"tile kernel {k.name}")
    return TileRun(k, fn_name, address, info.compute_units)
