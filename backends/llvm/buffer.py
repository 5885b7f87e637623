"""CPU device memory: aligned host blocks, and the owner that hands a block back to the pool when
the last numpy view of its buffer goes. The owner carries the block's address, so a kernel call
reads it from there instead of asking numpy for it on every call (compile.py)."""
from __future__ import annotations

import weakref

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
    reference to the one array `new_buffer` made: that array, and only it, starts at `addr` and
    holds `nbytes`."""
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


def new_buffer(pool, nbytes: int) -> np.ndarray:
    """A 1-D uint8 array of nbytes over a block from `pool`, owned by a new Owner."""
    block = pool.alloc(nbytes)
    o = Owner()
    o.block = block
    o.pool, o.addr, o.nbytes = pool, block[1], nbytes
    iface = block[2].get(nbytes)  # made once per block and size: numpy only reads it
    if iface is None:
        iface = block[2][nbytes] = {"data": (block[1], False), "shape": (nbytes,), "typestr": "|u1",
                                    "version": 3}
    o.__array_interface__ = iface
    buf = np.asarray(o)
    o.buffer = weakref.ref(buf)
    return buf

