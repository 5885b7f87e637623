"""The caching pool allocator (runtime/memory.py) and the CPU backend's buffers."""
from __future__ import annotations

import gc
import os
import sys

import ml_dtypes
import numpy as np
import pytest

from tilefuse.backends.llvm import create
from tilefuse.ir.core import ShapedArray
from tilefuse.ir.errors import OutOfMemoryError
from tilefuse.runtime.memory import PoolAllocator, parse_bytes, size_class


class Device:
    """A fake device: counts raw allocations and frees."""

    def __init__(self):
        self.live, self.allocs = {}, 0

    def alloc(self, n):
        self.allocs += 1
        block = bytearray(n)
        self.live[id(block)] = n
        return block

    def free(self, block):
        del self.live[id(block)]


def pool(limit=None):
    d = Device()
    return PoolAllocator(d.alloc, d.free, limit=limit), d


def test_parse_bytes():
    assert parse_bytes("64M") == 64 << 20
    assert parse_bytes("1.5G") == 3 << 29
    assert parse_bytes("512KiB") == 512 << 10
    assert parse_bytes("4096") == 4096
    assert parse_bytes(" 2 mb ") == 2 << 20
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_size_classes():
    assert size_class(0) == size_class(1) == 64
    assert size_class(65) == 128
    assert size_class(1 << 20) == 1 << 20
    assert size_class((1 << 20) + 1) == (1 << 20) + (1 << 18)  # 1.25 MiB
    assert size_class(3 << 20) == 3 << 20  # 1.5 × 2 MiB
    for n in (100, 5000, 123456, 10 ** 7, 3 * 10 ** 8):
        c = size_class(n)
        assert n <= c <= max(2 * n, 64) and (n <= 1 << 20 or c <= 1.25 * n)


def test_reuse_and_stats():
    p, d = pool()
    a = p.alloc(1000)
    b = p.alloc(3000)
    p.free(a)
    c = p.alloc(900)  # same class as a: reused
    assert c is a
    s = p.stats()
    assert s["allocations"] == 2 and s["pool_hits"] == 1 and d.allocs == 2
    assert s["bytes_in_use"] == 3900 and s["peak_bytes_in_use"] == 4000
    assert s["bytes_reserved"] == 1024 + 4096
    p.free(b)
    p.free(c)
    assert p.stats()["bytes_in_use"] == 0 and p.stats()["bytes_cached"] == 1024 + 4096
    p.empty_cache()
    assert d.live == {} and p.stats()["bytes_reserved"] == 0
    with pytest.raises(ValueError):
        p.free(b)  # freed twice


def test_a_request_takes_a_cached_block_up_to_twice_its_size():
    """A new size's buffers take freed blocks of a larger class, at most twice theirs, before new
    memory; such a block goes back to its own class."""
    p, d = pool()
    big, small = p.alloc(40 << 20), p.alloc(5 << 20)
    p.free(big)
    p.free(small)
    a = p.alloc(21 << 20)  # its class is 22 MiB: the 40 MiB block serves, no new memory
    assert a is big and d.allocs == 2 and p.stats()["bytes_in_use"] == 21 << 20
    b = p.alloc(2 << 20)  # the 5 MiB block is more than twice 2 MiB: new memory
    assert b is not small and d.allocs == 3
    p.free(a)
    assert p.alloc(40 << 20) is big and d.allocs == 3  # back in its own class
    assert p.stats()["bytes_reserved"] == size_class(40 << 20) + size_class(5 << 20) + size_class(2 << 20)


def test_limit_oom_leaves_pool_consistent():
    p, d = pool(limit=1 << 20)
    a = p.alloc(600 << 10)  # 1 MiB class? no: 1 MiB power of two for 600 KiB
    with pytest.raises(OutOfMemoryError, match="pool limit"):
        p.alloc(600 << 10)
    s = p.stats()
    assert s["bytes_in_use"] == 600 << 10 and s["live_blocks"] == 1 and len(d.live) == 1
    p.free(a)
    b = p.alloc(100 << 10)  # under the limit: cached 1 MiB block is dropped to make room
    assert p.stats()["bytes_reserved"] <= 1 << 20
    p.free(b)
    assert p.alloc(900 << 10) is not None


def test_device_memory_error_becomes_oom():
    def raw(n):
        raise MemoryError
    p = PoolAllocator(raw, lambda b: None)
    with pytest.raises(OutOfMemoryError):
        p.alloc(10)
    assert p.stats()["live_blocks"] == 0


def test_env_limit(monkeypatch):
    monkeypatch.setenv("TILEFUSE_POOL_LIMIT", "64K")
    p, _ = pool()
    assert p.limit == 64 << 10
    with pytest.raises(OutOfMemoryError):
        p.alloc(100 << 10)


# ---- the CPU backend's buffers ------------------------------------------------------------------

def test_cpu_buffers_aligned_reused_and_returned():
    be = create()
    a = be.alloc(1000)
    assert a.dtype == np.uint8 and a.shape == (1000,) and a.ctypes.data % 64 == 0
    addr = a.ctypes.data
    view = a[:400].view(np.float32)
    del a
    gc.collect()
    assert be.memory_stats()["bytes_in_use"] == 1000  # a view keeps the block
    del view
    assert be.memory_stats()["bytes_in_use"] == 0
    b = be.alloc(900)
    assert b.ctypes.data == addr and be.memory_stats()["pool_hits"] == 1
    be.free(b)
    assert be.memory_stats()["bytes_in_use"] == 0
    del b  # no double return
    assert be.memory_stats()["frees"] == 2


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_, ml_dtypes.bfloat16, np.float16])
def test_put_to_host_roundtrip(dtype):
    be = create()
    x = (np.arange(24).reshape(4, 6) % 5).astype(dtype)[:, ::2]  # non-contiguous source
    buf = be.put(x)
    y = be.to_host(buf, ShapedArray(x.shape, np.dtype(dtype)))
    np.testing.assert_array_equal(y, x)
    assert not y.flags.writeable and np.shares_memory(y, buf)


def test_second_identical_step_allocates_nothing():
    be = create()
    for _ in range(3):
        bufs = [be.alloc(n) for n in (4096, 10 ** 6, 77)]
        del bufs
    s = be.memory_stats()
    assert s["allocations"] == 3 and s["pool_hits"] == 6


def test_cpu_pool_limit(monkeypatch):
    monkeypatch.setenv("TILEFUSE_POOL_LIMIT", "1M")
    be = create()
    a = be.alloc(600 << 10)
    with pytest.raises(OutOfMemoryError):
        be.alloc(600 << 10)
    del a
    assert be.alloc(900 << 10).nbytes == 900 << 10


# ---- a program's spare outputs (runtime/memory.py Spares) ---------------------------------------

def test_a_dropped_output_is_written_again_and_a_held_one_never(device):
    """A small output the caller dropped serves the next call; one still held, through its Array,
    a numpy view or a memoryview, keeps its values while the program runs again."""
    import tilefuse as tx
    f = tx.jit(lambda a, b: a * b + 1)
    x = tx.device_put(np.arange(16, dtype=np.float32), device)
    k = [tx.device_put(np.float32(i), device) for i in range(8)]
    f(x, k[1])
    calls = device.memory_stats().get("alloc_calls")
    y = f(x, k[2])
    del y
    z = f(x, k[3])
    if calls is not None:  # (a device with a pool)
        assert device.memory_stats()["alloc_calls"] == calls + 1  # the second call wrote the first's buffer
    np.testing.assert_array_equal(np.asarray(z), np.arange(16) * 3 + 1)

    held = f(x, k[4])
    again = f(x, k[5])  # z and held are alive: neither is written
    np.testing.assert_array_equal(np.asarray(z), np.arange(16) * 3 + 1)
    np.testing.assert_array_equal(np.asarray(held), np.arange(16) * 4 + 1)
    np.testing.assert_array_equal(np.asarray(again), np.arange(16) * 5 + 1)

    if device.kind == "cpu":  # views of the buffer itself
        view, mem = np.asarray(held)[3:], memoryview(np.asarray(again))
        del held, again
        f(x, k[6]), f(x, k[7])
        np.testing.assert_array_equal(view, np.arange(3, 16) * 4 + 1)
        np.testing.assert_array_equal(np.frombuffer(mem, np.float32), np.arange(16) * 5 + 1)


def test_dropped_spares_are_back_in_the_pool_when_figures_are_read():
    import tilefuse as tx
    dev = tx.devices("cpu")[0]
    f = tx.jit(lambda a: a - 1)
    x = tx.device_put(np.ones(64, np.float32), dev)
    f(x)
    gc.collect()
    before = dev.memory_stats()["bytes_in_use"]
    ys = [f(x) for _ in range(4)]  # each held: four buffers, all kept as spares too
    assert dev.memory_stats()["bytes_in_use"] == before + 4 * 256
    del ys
    assert dev.memory_stats()["bytes_in_use"] == before
    big = tx.jit(lambda a: a + 1)(np.ones(1 << 15, np.float32))  # past Spares.LIMIT: not kept
    del big
    assert dev.memory_stats()["bytes_in_use"] == before


_FAULTS = """
import resource, numpy as np, tilefuse
def step():
    xs = [np.ones(1 << 20, np.float64) for _ in range(6)]  # 8 MiB each, made and dropped per step
    return sum(float(x[-1]) for x in xs)
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_freed_host_memory_is_kept_for_reuse():
    """keep_host_memory (set at import): arrays of several MiB made and dropped at every step reuse
    the heap's pages instead of faulting in fresh ones each time; TILEFUSE_KEEP_HOST_MEMORY=0
    leaves glibc's malloc as it is."""
    import ctypes
    import subprocess
    if not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"):
        pytest.skip("glibc's malloc only")
    faults = {}
    for keep in ("1", "0"):
        env = {**os.environ, "TILEFUSE_KEEP_HOST_MEMORY": keep}
        out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        faults[keep] = int(out.stdout.split()[-1])
    pages = 20 * 6 * (8 << 20) // 4096  # (every page of every array, each step)
    assert faults["1"] < pages // 20 < faults["0"], faults
