"""Array: a buffer on a device with its aval; stays on its device until someone reads it."""
from __future__ import annotations

import operator
import re

import numpy as np

from tilefuse.ir.core import ShapedArray


class Array:
    """A tilefuse array: a device buffer, its aval and its device. Operators come from
    tilefuse.numpy; reading (np.asarray, print, .item()) copies to the host when needed."""
    __slots__ = ("_buf", "aval", "device", "committed", "__weakref__")
    __array_priority__ = 1000

    def __init__(self, buf, aval: ShapedArray, device, committed: bool = True):
        # committed: placed on its device on purpose (device_put, or computed from committed
        # Arrays); uncommitted Arrays (tnp.asarray, tnp.zeros, ...) follow the data they meet
        # (one statement each: a four-way tuple assignment builds and unpacks a tuple per Array)
        self._buf = buf
        self.aval = aval
        self.device = device
        self.committed = committed

    shape = property(lambda self: self.aval.shape)
    dtype = property(lambda self: self.aval.dtype)
    ndim = property(lambda self: self.aval.ndim)
    size = property(lambda self: self.aval.size)
    weak_type = property(lambda self: self.aval.weak_type)
    nbytes = property(lambda self: self.aval.size * self.aval.dtype.itemsize)

    def numpy(self) -> np.ndarray:
        return self.device.to_host(self._buf, self.aval)

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        if copy or dtype is not None and np.dtype(dtype) != a.dtype:
            a = a.astype(a.dtype if dtype is None else dtype)  # (a copy)
        return a

    # DLPack (the array-API exchange protocol): np.from_dlpack(x), torch.from_dlpack(x)
    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU: the exported memory is host memory (see __dlpack__)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """Export as a DLPack capsule of host memory. Zero-copy where the device's buffers are
        host memory (cpu, ref, OpenCL devices with host-unified memory such as PoCL) and the
        consumer accepts read-only memory (DLPack >= 1.0, as numpy 2 and PyTorch ask for): the
        consumer then shares the Array's buffer and must not write to it, as Arrays are
        immutable. Elsewhere (discrete GPUs), or for a legacy (pre-1.0) consumer, the data is
        copied to the host first; copy=False then raises BufferError, copy=True always copies."""
        if dl_device is not None and tuple(dl_device) != (1, 0):
            raise BufferError(f"tilefuse exports DLPack as host (kDLCPU) memory, not device {dl_device}")
        shared = self.device.backend.host_memory(self.device)
        if copy is False and not shared:
            raise BufferError(f"an Array on {self.device} is not in host memory: it cannot be exported "
                              f"without a copy (copy=False)")
        self.device.synchronize()
        host = self.numpy()
        if any(st < 0 for st in host.strides):  # consumers (PyTorch) reject negative strides
            host = np.ascontiguousarray(host)
        if copy or (max_version is None or tuple(max_version) < (1, 0)) and not host.flags.writeable:
            if copy is False:
                raise BufferError("a legacy (pre-1.0) DLPack consumer cannot take read-only memory "
                                  "without a copy (copy=False)")
            host = np.array(host, copy=True)  # a pre-1.0 consumer cannot be told it is read-only
        if host.dtype.kind == "V" or host.dtype.name == "bfloat16":
            raise BufferError(f"{host.dtype} cannot cross DLPack through numpy; convert with "
                              "astype(float32) first")
        return host.__dlpack__(max_version=max_version)

    def block_until_ready(self) -> "Array":
        self.device.synchronize()
        return self

    def item(self):
        return self.numpy().item()

    def tolist(self):
        return self.numpy().tolist()

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __iter__(self):
        if not self.shape:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def __bool__(self):
        return bool(self.numpy())

    def __float__(self):
        return float(self.numpy())

    def __int__(self):
        return int(self.numpy())

    def __index__(self):  # integers only, as numpy's: 2.0 is no index
        return operator.index(self.numpy())

    def __complex__(self):
        return complex(self.numpy())

    def __format__(self, spec):
        return format(self.numpy().item(), spec) if not self.shape else format(self.numpy(), spec)

    def __repr__(self):
        body = np.array_repr(self.numpy())
        # numpy writes extension dtypes as dtype(bfloat16); name them as it names its own
        body = re.sub(r"dtype=dtype\((\w+)\)", r"dtype=\1", body)
        return "Array" + body[len("array"):]

    def __str__(self):
        return str(self.numpy())

    def __reduce__(self):  # pickling and copy.deepcopy go through numpy
        return (np.asarray, (self.numpy(),))

    def copy(self) -> "Array":
        return self.device.put(self.numpy().copy())

    __hash__ = None
