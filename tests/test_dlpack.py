"""DLPack exchange on every device: Array.__dlpack__ (np.from_dlpack, torch.from_dlpack) and
tx.from_dlpack (numpy arrays, torch tensors, Arrays), with memory shared exactly where promised:
exports from host-memory devices (cpu, ref, PoCL), imports onto cpu (contiguous data, each element
aligned) and ref; a copy everywhere else."""
from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp

from conftest import assert_close


def _aligned(shape, dtype=np.float32, align=64):
    """A C-contiguous numpy array whose data starts on an `align`-byte boundary."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dtype).reshape(shape)


def _shares_host_memory(device) -> bool:
    return device.backend.host_memory(device)


def _adopts(device) -> bool:
    return device.kind in ("cpu", "ref")  # the devices that compute on host memory in place


def test_export_to_numpy(device, rng):
    x = rng.standard_normal((3, 5)).astype(np.float32)
    a = tx.jit(lambda v: tnp.tanh(v) * 2.0)(x)
    host = np.from_dlpack(a)
    assert_close(host, np.tanh(x) * 2.0)
    assert a.__dlpack_device__() == (1, 0)
    # on host-memory devices the export is the Array's own buffer, not a copy
    assert np.shares_memory(host, a.numpy()) == _shares_host_memory(device)
    copied = np.from_dlpack(a, copy=True)
    assert not np.shares_memory(copied, a.numpy()) and np.array_equal(copied, host)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.bool_, np.float16])
def test_export_dtypes(device, dtype):
    x = (np.arange(12).reshape(3, 4) % 3).astype(dtype)
    a = tx.device_put(x, device)
    got = np.from_dlpack(a)
    assert got.dtype == x.dtype and np.array_equal(got, x)


def test_export_refuses_copy_false_off_host_and_bfloat16(device):
    a = tx.device_put(np.ones((2, 2), np.float32), device)
    if _shares_host_memory(device):
        assert np.shares_memory(np.from_dlpack(a, copy=False), a.numpy())
    else:
        with pytest.raises(BufferError, match="without a copy"):
            np.from_dlpack(a, copy=False)
    b = tx.device_put(np.ones(3, np.float32), device).astype(tx.bfloat16)
    with pytest.raises(BufferError, match="bfloat16"):
        np.from_dlpack(b)


def test_legacy_consumer_never_gets_read_only_memory_as_writable(device):
    """A pre-1.0 DLPack consumer cannot be told memory is read-only: it gets a copy of such
    memory, and copy=False is refused rather than handing it out as writable."""
    a = tx.jit(lambda v: v + 1.0)(np.zeros(4, np.float32))
    assert type(a.__dlpack__()).__name__ == "PyCapsule"  # max_version=None: the legacy capsule
    if _shares_host_memory(device) and a.numpy().flags.writeable:
        a.__dlpack__(copy=False)
    else:
        with pytest.raises(BufferError, match="legacy|without a copy"):
            a.__dlpack__(copy=False)


def test_negative_strides_export_as_a_contiguous_copy(device):
    a = tx.jit(lambda v: tnp.flip(v, axis=1))(np.arange(6, dtype=np.float32).reshape(2, 3))
    host = np.from_dlpack(a)
    assert all(s >= 0 for s in host.strides)
    assert np.array_equal(host, np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::-1])


def test_import_from_numpy_shares_memory_where_promised(device):
    x = _aligned((4, 6))
    x[...] = np.arange(24, dtype=np.float32).reshape(4, 6)
    a = tx.from_dlpack(x, device=device)
    assert a.device is device and a.shape == (4, 6) and a.dtype == np.float32
    assert_close(tx.jit(lambda v: v * 2.0 + 1.0)(a), x * 2.0 + 1.0)
    x[0, 0] = 100.0  # the producer writes: an Array that shares the memory sees it
    assert (float(a.numpy()[0, 0]) == 100.0) == _adopts(device)
    if not _adopts(device):
        with pytest.raises(BufferError, match="without a copy"):
            tx.from_dlpack(x, device=device, copy=False)


def test_import_copies_strided_unaligned_and_narrow_data(device):
    base = _aligned((4, 8))
    base[...] = np.arange(32, dtype=np.float32).reshape(4, 8)
    # (source, whether the device may share it): strided data is always copied; data 4 bytes
    # past a 64-byte boundary is shared by the devices that adopt host memory (their kernels need
    # each element aligned, no more); data 2 bytes off its float32 alignment only by ref (numpy)
    raw = _aligned((40,), np.uint8)
    off_element = raw[2:34].view(np.float32)
    off_element[...] = np.arange(8, dtype=np.float32)
    for src, shared in ((base[:, ::2], False), (base.reshape(-1)[1:9], _adopts(device)),
                        (off_element, device.kind == "ref")):
        a = tx.from_dlpack(src, device=device)
        assert np.array_equal(a.numpy(), src)
        src[0] = -1.0
        assert (float(a.numpy().reshape(-1)[0]) == -1.0) == shared
        if not shared:
            with pytest.raises(BufferError, match="without a copy"):
                tx.from_dlpack(src, device=device, copy=False)
    small = np.arange(5, dtype=np.int8)
    a = tx.from_dlpack(small, device=device)
    assert a.dtype == np.int8 and np.array_equal(a.numpy(), small)  # (narrow ints keep their dtype, as in JAX)


def test_kernels_compute_on_imported_memory_aligned_to_its_element_only(device, rng):
    """Memory shared 4 bytes past a 64-byte boundary (the pool's blocks are on one): GEMM,
    reductions and vectorised elementwise kernels read and write it at any offset."""
    a_host = _aligned((33 * 47 + 1,))[1:].reshape(33, 47)
    b_host = _aligned((47 * 29 + 1,))[1:].reshape(47, 29)
    a_host[...] = rng.standard_normal((33, 47)) * 10
    b_host[...] = rng.standard_normal((47, 29))
    a, b = tx.from_dlpack(a_host, device=device), tx.from_dlpack(b_host, device=device)
    if _adopts(device):
        assert np.shares_memory(a.numpy(), a_host)
    got = tx.jit(lambda x, y: [tnp.tanh(x @ y) * 3.0 + 1.0, tnp.sum(x * x, axis=1), tnp.exp(x / 10.0)])(a, b)
    want = [np.tanh(a_host @ b_host) * 3.0 + 1.0, np.sum(a_host * a_host, axis=1), np.exp(a_host / 10.0)]
    for g, w in zip(got, want):
        assert_close(g, w, rtol=2e-5, atol=1e-4)


def test_import_of_numpy_bfloat16(device):
    """numpy arrays are host memory already: taken as they are, bfloat16 included."""
    x = _aligned((2, 8), np.float32)
    x[...] = 1.5
    b = x.astype(tx.bfloat16)
    a = tx.from_dlpack(b, device=device)
    assert a.dtype == tx.bfloat16 and np.array_equal(a.numpy().astype(np.float32), x)


def test_import_of_an_array_and_copy_true(device):
    a = tx.device_put(np.arange(4, dtype=np.float32), device)
    assert tx.from_dlpack(a, device=device) is a
    b = tx.from_dlpack(a, device=device, copy=True)
    assert b is not a and np.array_equal(b.numpy(), a.numpy())
    with pytest.raises(TypeError, match="__dlpack__"):
        tx.from_dlpack([1, 2, 3], device=device)


def test_cpu_kernels_stay_inside_an_adopted_buffer(device):
    """Data that ends exactly where a protected page starts: the CPU's kernels read it in place
    (no copy), so a read past its end would crash here. Every device must compute right."""
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 2 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(base + page), ctypes.c_size_t(page), 0) == 0  # PROT_NONE
    try:
        n = 37 * 16  # floats, 64-byte multiple, ending at the page's end
        buf = np.frombuffer(region, dtype=np.float32, count=page // 4)[page // 4 - n:]
        buf[...] = np.linspace(-1, 1, n, dtype=np.float32)
        x = buf.reshape(37, 16)
        a = tx.from_dlpack(x, device=device)
        if device.kind == "cpu":
            assert np.shares_memory(a.numpy(), x)
        f = tx.jit(lambda v: (tnp.exp(v) * 2.0, tnp.sum(v * v, axis=1), v @ tnp.transpose(v)))
        e, s, g = f(a)
        assert_close(e, np.exp(x) * 2.0)
        assert_close(s, np.sum(x * x, axis=1))
        assert_close(g, x @ x.T)
        del a, e, s, g
    finally:
        libc.mprotect(ctypes.c_void_p(base + page), ctypes.c_size_t(page), 3)  # read, write


def test_torch_exchange_shares_memory(device):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (the `torch` extra)")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    a = tx.from_dlpack(t, device=device)  # PyTorch's CPU allocator aligns to 64 bytes
    t[0, 0] = 7.0
    assert (float(a.numpy()[0, 0]) == 7.0) == _adopts(device)
    out = tx.jit(lambda v: v * 3.0)(a)
    back = torch.from_dlpack(out)
    assert torch.equal(back, t * 3.0 if _adopts(device) else torch.from_numpy(a.numpy() * 3.0))
    assert (back.data_ptr() == out.numpy().ctypes.data) == _shares_host_memory(device)
    ints = tx.from_dlpack(torch.tensor([1, 2, 3]), device=device)
    assert ints.dtype == np.int64 and ints.numpy().tolist() == [1, 2, 3]
    with pytest.raises(BufferError):  # a tensor that needs its gradient must be detached first
        tx.from_dlpack(torch.ones(2, requires_grad=True), device=device)
