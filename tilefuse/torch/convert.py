"""Tensors in and out of tilefuse devices: dtypes, DLPack, and the tensors that stay on a device.

A torch tensor becomes an Array through DLPack (zero-copy where the device computes on host
memory in place: cpu, ref), and an Array becomes a tensor the same way where the device's memory
is host memory (cpu, ref, PoCL). On other devices (a discrete GPU) an output is a DeviceTensor: a
tensor that holds the Array and copies it to the host only when PyTorch itself computes with it,
so activations saved for the backward pass and values passed from one compiled graph to the next
never leave the device. Every tensor made from an Array, and every tensor copied to a device, is
remembered (weakly) with its version counter, so a tensor that comes back unchanged (a parameter
the optimizer has not touched since, a saved activation) is not copied again."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

import tilefuse as tx
from tilefuse.ir.errors import DTypeError

# torch dtype -> numpy dtype tilefuse stores; narrow integers are not supported by tilefuse
TO_NUMPY = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
            torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
            torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
            torch.bool: np.dtype(np.bool_)}
TO_TORCH = {v: k for k, v in TO_NUMPY.items()}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    try:
        return TO_NUMPY[dtype]
    except KeyError:
        raise DTypeError(f"tilefuse.torch: the dtype {dtype} has no tilefuse equivalent; supported: "
                         + ", ".join(str(d) for d in TO_NUMPY)) from None


def torch_dtype(dtype) -> torch.dtype:
    return TO_TORCH[np.dtype(dtype)]


# tensor -> (version counter, data pointer, Array) of a tensor known to equal that Array
_resident = WeakIdKeyDictionary()


def _remember(t: torch.Tensor, a) -> None:
    try:
        _resident[t] = (t._version, t.data_ptr() if not isinstance(t, DeviceTensor) else 0, a)
    except RuntimeError:  # inference tensors have no version counter: nothing to remember
        pass


def _known(t: torch.Tensor, device):
    hit = _resident.get(t)
    if hit is None:
        return None
    version, ptr, a = hit
    try:
        same = t._version == version and (isinstance(t, DeviceTensor) or t.data_ptr() == ptr)
    except RuntimeError:
        return None
    if same and a.device is device and a.shape == tuple(t.shape) and torch_dtype(a.dtype) == t.dtype:
        return a
    return None


def to_array(t: torch.Tensor, device):
    """The Array for a tensor on `device`: the one it came from or was copied to last, when the
    tensor has not been written since; else from DLPack (shared memory where the device can
    compute on it in place, a copy elsewhere)."""
    if isinstance(t, DeviceTensor) and t._tx.device is device:
        return t._tx
    a = _known(t, device)
    if a is not None:
        return a
    if isinstance(t, DeviceTensor):
        a = tx.device_put(t._tx.numpy(), device)
    else:
        if t.device.type != "cpu":
            raise tx.DeviceError(f"tilefuse.torch: a {t.device} tensor cannot go to {device}; the "
                                 "backend takes CPU tensors (move the model with .cpu())")
        numpy_dtype(t.dtype)  # a clear error for unsupported dtypes
        d = t.detach()
        if not d.is_contiguous():
            d = d.contiguous()
        if d.dtype == torch.bfloat16:  # numpy's DLPack knows no bfloat16: cross as int16 bits
            host = np.from_dlpack(d.view(torch.int16)).view(ml_dtypes.bfloat16)
            a = tx.from_dlpack(host, device=device)
        else:
            a = tx.from_dlpack(d, device=device)
    _remember(t, a)
    return a


def to_tensor(a, host_memory: bool) -> torch.Tensor:
    """A tensor for an Array: its memory itself where the device's memory is host memory, else a
    DeviceTensor that stays on the device until PyTorch computes with it."""
    if host_memory:
        if a.dtype == ml_dtypes.bfloat16:
            t = torch.from_dlpack(a.numpy().view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_dlpack(a)
    else:
        t = DeviceTensor(a)
    _remember(t, a)
    return t


def host_tensor(a) -> torch.Tensor:
    """A plain CPU tensor holding a copy of an Array's values."""
    host = np.array(a.numpy(), copy=True)
    if host.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(host)


class DeviceTensor(torch.Tensor):
    """A tensor whose values live in a tilefuse Array on a device that is not host memory.

    The compiled graphs take its Array as it is; anything else PyTorch does with it (printing,
    .item(), an eager op, an optimizer's update) copies it to the host first, so it behaves as a
    CPU tensor with the same values."""

    @staticmethod
    def __new__(cls, array):
        dtype = torch_dtype(array.dtype)
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(array.shape), dtype=dtype, device="cpu")
        t._tx = array
        return t

    def __repr__(self, *, tensor_contents=None):
        return f"DeviceTensor({host_tensor(self._tx)!r}, device={self._tx.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return DeviceTensor(args[0]._tx)  # the same values: no copy

        def host(x):
            return host_tensor(x._tx) if isinstance(x, DeviceTensor) else x
        return func(*tree_map(host, args), **tree_map(host, kwargs or {}))
