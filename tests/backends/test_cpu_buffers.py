"""The CPU kernel call's fast path: a pool buffer's owner carries its address (backends/llvm/
buffer.py). A view at an offset, a buffer too small or a plain numpy array takes the checked
path; the result is right either way, and blocks still return to the pool when Arrays die."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import tilefuse as tx
from tilefuse.backends.llvm import create
from tilefuse.ir.errors import DeviceError
from tilefuse.ir.kernel import ir as K

F32 = np.dtype(np.float32)


@pytest.fixture(scope="module")
def be():
    return create()


def add_one(be, n=8):
    bufs = (K.Buffer("x", F32, n), K.Buffer("y", F32, n))
    v = K.binary("add", K.load(0, K.affine([1]), F32), K.const(1.0, F32))
    k = K.Kernel("add_one", bufs, 1, (n,), (), (K.Store(1, K.affine([1]), v, "set"),))
    return be.compile_kernel(k)


def test_pool_buffers_views_and_plain_arrays(be):
    ck = add_one(be)
    x, y = be.alloc(64), be.alloc(32)
    x.view(F32)[:] = np.arange(16)
    for src, want in [(x[:32], np.arange(8)), (x[32:], np.arange(8, 16)), (x, np.arange(8)),
                      (x[32:].copy(), np.arange(8, 16))]:
        ck([src, y])  # views at offsets 0 and 32, the block itself, a plain copy
        np.testing.assert_array_equal(y.view(F32), want + 1)
    y2 = be.alloc(32)
    ck([x, y2])
    ck([x, y])  # back to earlier addresses
    np.testing.assert_array_equal(y.view(F32), np.arange(8) + 1)
    np.testing.assert_array_equal(y2.view(F32), np.arange(8) + 1)


def test_pool_buffer_too_small_is_refused(be):
    ck = add_one(be)
    with pytest.raises(DeviceError, match="needs 32 contiguous bytes"):
        ck([be.alloc(16), be.alloc(32)])


def test_jitted_outputs_return_to_the_pool():
    dev = tx.devices("cpu")[0]
    f = tx.jit(lambda a: a + 1)
    x = tx.device_put(np.ones(8, np.float32), dev)
    f(x)
    gc.collect()
    before = dev.memory_stats()["bytes_in_use"]
    ys = [f(x) for _ in range(3)]
    assert dev.memory_stats()["bytes_in_use"] == before + 3 * 32
    np.testing.assert_array_equal(np.asarray(ys[0]), 2)
    del ys
    assert dev.memory_stats()["bytes_in_use"] == before
