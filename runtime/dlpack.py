"""from_dlpack: an Array from any object that speaks DLPack (numpy, PyTorch, JAX, CuPy...).

The export side is Array.__dlpack__ (runtime/array.py)."""
from __future__ import annotations

import numpy as np

from tilefuse.ir import dtypes
from tilefuse.ir.core import ShapedArray

from .array import Array


def _host_view(x, copy):
    """x's data as a numpy array: its own memory where it lives on the host, else a host copy
    the producer makes (a GPU tensor), which copy=False forbids."""
    try:
        return np.from_dlpack(x, copy=copy)
    except (BufferError, RuntimeError, ValueError, TypeError) as first:
        if copy is False:
            raise BufferError(f"from_dlpack: {type(x).__name__} is not in host memory and copy=False "
                              f"forbids copying it ({first})") from None
        try:  # ask the producer for a host copy (DLPack >= 1.0 producers support dl_device)
            return np.from_dlpack(x, device="cpu", copy=True)
        except (BufferError, RuntimeError, ValueError, TypeError, NotImplementedError):
            raise BufferError(f"from_dlpack: cannot read {type(x).__name__} as host memory: {first}") \
                from None


def from_dlpack(x, device=None, copy: bool | None = None) -> Array:
    """An Array from any object with __dlpack__ (numpy arrays, torch tensors, tilefuse Arrays).

    Zero-copy where the target device computes on host memory in place: `cpu` (when the data is
    C-contiguous and 64-byte aligned, as PyTorch's CPU allocator aligns it) and `ref`. The Array
    then shares the producer's memory, so the producer must not write to it while the Array is
    in use (Arrays are immutable). Everywhere else the data is copied to the device: an OpenCL
    or CUDA device, a strided or unaligned source, a dtype tilefuse stores wider (int8, uint8
    and int16 become int32), or copy=True. copy=False raises BufferError where a copy is needed.
    `device` defaults to the default device; the Array is committed to a device named here."""
    from .device import default_device, get_device
    dev = get_device(device) if device is not None else default_device()
    if isinstance(x, Array) and x.device is dev and not copy:
        return x
    if isinstance(x, np.ndarray):  # host memory already (bfloat16 too, which DLPack-by-numpy lacks)
        host = x
    elif hasattr(x, "__dlpack__"):
        host = _host_view(x, copy)
    else:
        raise TypeError(f"from_dlpack: {type(x).__name__} has no __dlpack__ method")
    want = dtypes.canonicalize(host.dtype)
    buf = None
    if not copy and want == host.dtype and host.flags.c_contiguous:
        buf = dev.backend.adopt(host, dev)
    if buf is None:
        if copy is False:
            why = ("its dtype " + str(host.dtype) + " is stored as " + str(want) if want != host.dtype
                   else "it is not C-contiguous" if not host.flags.c_contiguous
                   else f"{dev} cannot compute on this memory in place")
            raise BufferError(f"from_dlpack: cannot share memory with {dev} without a copy: {why}")
        return dev.put(host, committed=device is not None)
    return Array(buf, ShapedArray(host.shape, want), dev, device is not None)
