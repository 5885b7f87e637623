"""The backend interface: a backend is small — devices, memory, and graph → program."""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from tilefuse.ir.core import Graph, ShapedArray
from tilefuse.runtime.memory import PoolAllocator, PoolBuffer


def bind_launch(launch, buffers):
    """launch(buffers) as a callable of no arguments, for a loop that repeats it over the same
    buffers: a compiled kernel's own `bind(buffers)` resolves its arguments once (addresses, a
    bind group, an OpenCL kernel's arguments); any other launch is called as it is."""
    own = getattr(launch, "bind", None)
    return own(buffers) if own is not None else functools.partial(launch, buffers)


class Backend:
    """One kind of device. Subclasses fill in the memory methods and `compile`.

    A buffer is whatever the backend uses for device memory (a numpy array on host devices).
    `compile(graph, device)` returns a Program: `program(buffers) -> list of buffers`, with
    `.graph` (the optimised graph it runs) and `.sources()` (kernel name -> source text)."""
    kind = "base"

    def discover(self) -> list:
        """DeviceInfo for each device present; raise DeviceError naming why none is."""
        raise NotImplementedError

    def alloc(self, nbytes: int, device):
        """An uninitialised device buffer of `nbytes` (from the backend's pool)."""
        raise NotImplementedError

    def put(self, host: np.ndarray, device):
        raise NotImplementedError

    def to_host(self, buf, aval: ShapedArray, device) -> np.ndarray:
        raise NotImplementedError

    def host_memory(self, device) -> bool:
        """Whether the device's buffers are host memory, so that to_host returns a view of the
        buffer itself (no copy): DLPack exports such arrays without copying."""
        return False

    def adopt(self, host: np.ndarray, device):
        """A buffer that is `host`'s own memory (C-contiguous), used in place with no copy, or
        None where the device cannot compute on that memory (the caller then copies with put).
        The caller keeps `host` unchanged while the buffer is in use: Arrays are immutable."""
        return None

    def view(self, buf, offset: int, nbytes: int):
        """A sub-buffer of `buf` (an arena): `nbytes` from byte `offset`, aligned to 64. On host
        backends a buffer is a 1-D uint8 numpy array and a view is a slice of it."""
        raise NotImplementedError

    # A command-buffer device (WebGPU) binds a launch as partial(self.submit, work), `work` a
    # tuple it can submit together with another's: bound launches in a row join into one submit.
    submit = None

    def batch(self, launches: list) -> list:
        """Launches of no arguments (bind_launch) that a loop repeats in this order, as the device
        runs them best: those bound to this backend's `submit` in a row joined."""
        out = []
        for f in launches:
            if out and self._submits(out[-1]) and self._submits(f):
                out[-1] = functools.partial(self.submit, out[-1].args[0] + f.args[0])
            else:
                out.append(f)
        return out

    def _submits(self, f) -> bool:
        return self.submit is not None and isinstance(f, functools.partial) and f.func == self.submit

    # A backend that runs eager operations itself (ref: numpy) sets apply_primitive(prim, params,
    # buffers, device) -> output buffers; the others compile a one-operation graph.
    apply_primitive = None

    def compile(self, graph: Graph, device):
        """The shared pipeline (runtime/compiler.py): passes, fusion, lowering, this backend's
        kernels, a planned arena; a backend that runs graphs otherwise (`ref`) replaces it."""
        from tilefuse.runtime.compiler import compile_graph
        return compile_graph(graph, device, self)

    def free(self, buffer, device=None) -> None:
        """Give a buffer back now (the caller promises not to use it again): a PoolBuffer's block
        returns to its pool; other buffers are left to the garbage collector."""
        if isinstance(buffer, PoolBuffer):
            buffer.release()

    # Tile kernels (ir/kernel/tile.py): a backend that prints them sets `tile_kernels` and
    # returns from compile_tile a callable run(buffers), buffers in the kernel's order;
    # `tile_prints` says which of the IR's optional constructs its printer takes.
    tile_kernels = False
    tile_prints = frozenset({"vectors", "scratch", "shared"})

    def compile_tile(self, kernel, device):
        raise NotImplementedError(f"{self.kind}: no tile kernels")

    def info_of(self, device):
        """The device's hardware description (runtime/hardware.DeviceInfo)."""
        raise NotImplementedError

    def tile_of(self, kernel, device, sched=None):
        """An index-space kernel laid out by the shared scheduler (ir/kernel/schedule.py) for the
        device's target; `sched` overrides the scheduler's choice."""
        from tilefuse.ir.kernel.schedule import default_schedule, schedule
        from tilefuse.runtime.config import config
        from tilefuse.runtime.hardware import target_of
        target = target_of(self.info_of(device))
        return schedule(kernel, target, sched or default_schedule(kernel, target, config.deterministic))

    def compile_kernel(self, kernel, device=None, sched=None):
        """A tile-printing backend's kernel: scheduled (tile_of), then compile_tile."""
        return self.compile_tile(self.tile_of(kernel, device, sched), device)

    def compile_kernels(self, kernels, device) -> None:
        """Build many kernels at once where that is faster than one by one (one OpenCL program;
        LLVM object code in worker processes); compile_kernel then finds them built."""

    def compile_tiles(self, tiles, device) -> None:
        """Build many builders' tile kernels at once where that is faster than one by one (LLVM
        object code in worker processes); compile_tile then finds them built."""

    def synchronize(self, device) -> None:
        pass

    pool: PoolAllocator | None = None  # a backend with one caching pool sets it

    def pool_of(self, device) -> PoolAllocator | None:
        """The device's caching pool (None: the backend has none); a backend serving several
        devices with a pool each overrides this."""
        return self.pool

    def memory_stats(self, device=None) -> dict:
        pool = self.pool_of(device)
        return pool.stats() if pool is not None else {}

    def empty_cache(self, device=None) -> None:
        """Hand the pool's cached (free) blocks back to the device."""
        pool = self.pool_of(device)
        if pool is not None:
            pool.empty_cache()


class Program:
    """A compiled graph: call it with input buffers, get output buffers."""

    def __init__(self, graph: Graph, run, sources: dict | None = None, launches: Sequence = ()):
        self.graph, self._run, self._sources, self.launches = graph, run, sources or {}, launches

    def __call__(self, buffers):
        return self._run(buffers)

    def sources(self) -> dict[str, str]:
        return dict(self._sources)
