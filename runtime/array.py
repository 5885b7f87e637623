"""Array: a buffer on a device with its aval; stays on its device until someone reads it."""
from __future__ import annotations

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
        self._buf, self.aval, self.device, self.committed = buf, aval, device, committed

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
        if dtype is not None:
            a = a.astype(dtype)
        return a

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

    def __index__(self):
        return int(self.numpy())

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
