"""CPU device memory: aligned host blocks, and the owner that hands a block back to the pool when
the last numpy view of its buffer goes. The owner carries the block's address, so a kernel call
reads it from there instead of asking numpy for it on every call (compile.py)."""
from __future__ import annotations

import numpy as np

ALIGN = 64


def raw_alloc(nbytes: int):
    """An aligned block: (1-D uint8 view, its address, its array interfaces by size); numpy frees
    it with the last reference."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    addr = raw.ctypes.data
    off = (-addr) % ALIGN
    return raw[off:off + nbytes], addr + off, {}


class Owner:
    """Owns one pool block while any view of its buffer lives (every view's numpy base), and
    hands it back to the pool when the last goes or at an explicit release. `buffer` is a weak
    reference to the one array the backend's alloc made: that array, and only it, starts at
    `addr` and holds `nbytes` (numpy makes the buffer, not its owner, the base of a view today;
    the reference keeps a view at an offset off the fast path whatever numpy does)."""
    __slots__ = ("__array_interface__", "block", "pool", "addr", "nbytes", "buffer")

    def release(self):
        block, self.block = self.block, None
        if block is not None:
            self.pool.free(block)

    def __del__(self):  # (release() inlined: this runs once per jitted call's output)
        block = self.block
        if block is not None:
            self.block = None
            try:
                self.pool.free(block)
            except Exception:  # interpreter shutdown: the pool may be gone already
                pass


def interface(block, nbytes: int) -> dict:
    """The numpy array interface of a block's first nbytes, made once per block and size (a few
    sizes kept per block: requests of ever new sizes do not grow it)."""
    cache = block[2]
    if len(cache) >= 8:
        cache.clear()
    iface = cache[nbytes] = {"data": (block[1], False), "shape": (nbytes,), "typestr": "|u1",
                             "version": 3}
    return iface
