"""The caching pool allocator, shared by every backend: it takes the device's raw alloc/free and
keeps freed blocks by size class for reuse, so a steady training step allocates nothing.

Size classes: powers of two up to 1 MiB, then four steps per octave (1, 1.25, 1.5, 1.75 × 2**k),
so a block wastes at most a quarter. `TILEFUSE_POOL_LIMIT` (bytes; "64M", "1.5G" work) caps the
bytes held from the device: beyond it the pool first drops its cached blocks, then raises
OutOfMemoryError and stays as it was."""
from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any, Callable

from tilefuse.ir.errors import OutOfMemoryError

SMALL_LIMIT = 1 << 20
MIN_BLOCK = 64
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text) -> int:
    """'64M' → 67108864; accepts K/M/G/T with optional 'B'/'iB' (all powers of 1024)."""
    if isinstance(text, (int, float)):
        return int(text)
    s = str(text).strip().upper().replace("IB", "").rstrip("B") if str(text).strip() else ""
    num = s.rstrip("KMGT")
    unit = s[len(num):]
    try:
        return int(float(num) * _UNITS[unit])
    except (ValueError, KeyError):
        raise ValueError(f"cannot read {text!r} as a number of bytes (e.g. 1048576, 64M, 2G)") from None


# glibc's malloc hands the free memory at the top of its heap back to the system once more than
# its trim threshold is free there, and maps requests past its mmap threshold afresh (both
# thresholds move with the program: a few MiB at most until it frees a block of 32 MiB): a
# program that makes and drops arrays of a few MiB at every step (the interpreter's numpy results,
# a new batch size's arena) then faults in every 4 KiB page it touches again, at every step. The
# char-GPT step interpreted at batch 16: ~12,000 page faults and 70-74 ms a step; with the
# thresholds below, none and 48-50 ms, and the same peak resident memory.
HOST_MMAP_THRESHOLD = 32 << 20  # requests below come from the heap (glibc's own ceiling for it)
HOST_TRIM_THRESHOLD = 256 << 20  # free heap kept for reuse: at most this much held beyond use
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # (glibc's malloc.h)


def keep_host_memory() -> bool:
    """Set glibc's malloc to keep freed memory for reuse (the thresholds above), unless
    TILEFUSE_KEEP_HOST_MEMORY=0; whether it set them (not on another C library or system).
    Process-wide: every library's allocations keep memory so."""
    if os.environ.get("TILEFUSE_KEEP_HOST_MEMORY", "1").strip().lower() in ("0", "false", "no", "off") or \
            not sys.platform.startswith("linux"):
        return False
    import ctypes
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt if hasattr(libc, "gnu_get_libc_version") else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:  # (musl and others: no such thresholds)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, HOST_TRIM_THRESHOLD))


def env_limit() -> int | None:
    v = os.environ.get("TILEFUSE_POOL_LIMIT", "").strip()
    return parse_bytes(v) if v else None


def size_class(nbytes: int) -> int:
    """The block size that serves a request of nbytes."""
    n = int(nbytes)
    if n <= MIN_BLOCK:
        return MIN_BLOCK
    if n <= SMALL_LIMIT:
        return 1 << (n - 1).bit_length()
    step = (1 << (n.bit_length() - 1)) >> 2
    return -(-n // step) * step


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class PoolAllocator:
    """Blocks from `raw_alloc(nbytes)` handed out and taken back by size class.

    raw_alloc(n) returns a block (anything) of at least n bytes, or raises MemoryError;
    raw_free(block) gives it back to the device. Blocks are tracked by id(block)."""

    def __init__(self, raw_alloc: Callable[[int], Any], raw_free: Callable[[Any], None], *,
                 limit: int | None = None, name: str = "device"):
        self._raw_alloc, self._raw_free, self.name = raw_alloc, raw_free, name
        self.limit = env_limit() if limit is None else limit
        self._free: dict[int, list] = {}  # size class → cached blocks
        self._live: dict[int, tuple] = {}  # id(block) → (block, class, nbytes)
        # re-entrant: a buffer's owner may be collected (and free its block) while this thread is
        # inside alloc, e.g. when the raw allocation triggers the garbage collector
        self._lock = threading.RLock()
        self._s = dict(bytes_in_use=0, peak_bytes_in_use=0, bytes_reserved=0, peak_bytes_reserved=0,
                       allocations=0, pool_hits=0, frees=0, system_frees=0, alloc_calls=0)

    def alloc(self, nbytes: int):
        cls = size_class(nbytes)
        s, lock = self._s, self._lock
        lock.acquire()  # (not `with`: it costs twice as much, on every jitted call's outputs)
        try:
            s["alloc_calls"] += 1
            cached = self._free.get(cls)
            if not cached:
                cls, cached = self._larger(cls)
            if cached:
                block = cached.pop()
                s["pool_hits"] += 1
            else:
                block = self._system_alloc(cls, nbytes)
            self._live[id(block)] = (block, cls, nbytes)
            in_use = s["bytes_in_use"] = s["bytes_in_use"] + nbytes
            if in_use > s["peak_bytes_in_use"]:
                s["peak_bytes_in_use"] = in_use
            return block
        finally:
            lock.release()

    def _larger(self, cls: int) -> tuple[int, list | None]:
        """(class, its cached blocks) for the smallest cached block of a class up to twice cls,
        or (cls, None). A new batch size's buffers then take the blocks the old size's calls gave
        back (its arena: the last batch of an epoch, smaller than the others), instead of memory
        never touched, whose first touch costs more than the call: on this project's VMs, 2-3 ms a
        MiB (the char-GPT step's first compiled call at batch 16 after batch 32 took 58 ms, the
        next 24: its 21 MiB arena was new memory)."""
        fits = [c for c, blocks in self._free.items() if blocks and cls < c <= 2 * cls]
        return (min(fits), self._free[min(fits)]) if fits else (cls, None)

    def _system_alloc(self, cls: int, nbytes: int):
        s = self._s
        if self.limit is not None and s["bytes_reserved"] + cls > self.limit:
            self._release_cached()
            if s["bytes_reserved"] + cls > self.limit:
                raise OutOfMemoryError(
                    f"{self.name}: cannot allocate {_fmt(nbytes)} (block {_fmt(cls)}): "
                    f"{_fmt(s['bytes_in_use'])} in use, pool limit {_fmt(self.limit)} "
                    f"(TILEFUSE_POOL_LIMIT)")
        try:
            block = self._raw_alloc(cls)
        except MemoryError:
            self._release_cached()
            try:
                block = self._raw_alloc(cls)
            except MemoryError as e:
                raise OutOfMemoryError(f"{self.name}: the device cannot allocate {_fmt(nbytes)} "
                                       f"({_fmt(s['bytes_in_use'])} in use){': ' * bool(str(e))}{e}") from None
        s["allocations"] += 1
        s["bytes_reserved"] += cls
        s["peak_bytes_reserved"] = max(s["peak_bytes_reserved"], s["bytes_reserved"])
        return block

    def free(self, block) -> None:
        """Return a block to the pool (it stays reserved, ready for the next request)."""
        lock = self._lock
        lock.acquire()
        try:
            entry = self._live.pop(id(block), None)
            if entry is None:
                raise ValueError(f"{self.name}: free of a block the pool did not hand out "
                                 "(or freed twice)")
            _, cls, nbytes = entry
            cached = self._free.get(cls)
            if cached is None:
                cached = self._free[cls] = []
            cached.append(block)
            s = self._s
            s["bytes_in_use"] -= nbytes
            s["frees"] += 1
        finally:
            lock.release()

    def _release_cached(self) -> None:
        reclaim_spares()  # (a program's spare outputs the caller dropped are free blocks too)
        cached, self._free = self._free, {}
        for cls, blocks in cached.items():
            for b in blocks:
                self._raw_free(b)
                self._s["bytes_reserved"] -= cls
                self._s["system_frees"] += 1

    def empty_cache(self) -> None:
        """Give every cached (free) block back to the device."""
        with self._lock:
            self._release_cached()

    def reset_peak(self) -> None:
        """Track peaks afresh from what is in use now (to measure one computation's own peak)."""
        with self._lock:
            self._s["peak_bytes_in_use"] = self._s["bytes_in_use"]

    def stats(self) -> dict:
        reclaim_spares()
        with self._lock:
            out = dict(self._s)
            out["bytes_cached"] = sum(c * len(b) for c, b in self._free.items())
            out["live_blocks"] = len(self._live)
            out["limit"] = self.limit
            return out


class Spares:
    """A program's small output buffers, kept for its next calls: a call takes one back only when
    nothing but this list refers to it any more (the caller dropped its Array; the reference
    count says so, as numpy's elision of temporaries decides), which spares that call the pool's
    allocation and the wrapping of a new buffer. A numpy view holds its buffer (numpy never makes
    a non-array owner the base of a view), a view of a device buffer its parent, so a buffer that
    anything can still read is never written. Spares the caller dropped go back to the pool when
    its figures are read or memory runs short (reclaim_spares)."""
    LIMIT = 64 << 10  # bytes: larger outputs go back to the pool at once, as before
    __slots__ = ("bufs", "free", "device", "__weakref__")

    def __init__(self, free: Callable, device):
        self.bufs, self.free, self.device = [], free, device
        _spares.add(self)

    def take(self):
        """A dropped buffer to write again, or None (list.pop: one thread gets each)."""
        bufs = self.bufs
        if bufs:
            try:
                buf = bufs.pop()
            except IndexError:  # another thread took the last one
                return None
            if sys.getrefcount(buf) == 2:  # this frame's reference and the argument's
                return buf
        return None

    def reclaim(self) -> None:
        keep = []
        while True:
            try:
                buf = self.bufs.pop()
            except IndexError:
                break
            if sys.getrefcount(buf) == 2:
                self.free(buf, self.device)
            else:
                keep.append(buf)
            del buf
        self.bufs.extend(keep)


_spares: weakref.WeakSet = weakref.WeakSet()


def reclaim_spares() -> None:
    """Every program's spare outputs that their callers dropped, back to their pools."""
    for s in list(_spares):
        s.reclaim()


class PoolBuffer:
    """Device memory, the one buffer owner of every backend: `mem` is a PoolAllocator block (handed
    back at release() or when the last reference goes), or, for a view (`parent` set), a backend's
    handle into its parent's block, which the view keeps alive."""
    __slots__ = ("mem", "nbytes", "pool", "parent")

    def __init__(self, mem, nbytes: int, pool=None, parent=None):
        self.mem, self.nbytes, self.pool, self.parent = mem, nbytes, pool, parent

    def release(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.free(self.mem)

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: the pool may be gone already
            pass

    def __repr__(self):
        return f"<{type(self).__module__.split('.')[-1]} buffer {self.nbytes} B{' view' if self.parent else ''}>"
