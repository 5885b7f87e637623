"""Tensors in and out of tilefuse devices: dtypes, DLPack, and the tensors that stay on a device.

A torch tensor becomes an Array through DLPack (zero-copy where the device computes on host
memory in place: cpu, ref), and an Array becomes a tensor the same way where the device's memory
is host memory (cpu, ref, PoCL). On other devices (a discrete GPU) the activations a forward
graph saves for its backward graph are DeviceTensors: tensors that hold the Array and copy it to
the host only if PyTorch itself computes with one, so they never leave the device; the outputs
the user sees are host tensors (dynamo would not compile a function that takes a DeviceTensor).
Every tensor made from an Array, and every tensor copied to a device, is remembered (weakly) with
its version counter, so a tensor that comes back unchanged (a parameter the optimizer has not
touched since, a frozen weight, a buffer) is not copied again."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

import tilefuse as tx
from tilefuse.ir.errors import DTypeError

# torch dtype -> numpy dtype tilefuse stores
TO_NUMPY = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
            torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
            torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
            torch.bool: np.dtype(np.bool_)}
TO_TORCH = {v: k for k, v in TO_NUMPY.items()}
# narrow integers are computed as int32 (as tilefuse stores them); graph outputs are cast back
WIDENED = {torch.int8: np.dtype(np.int32), torch.uint8: np.dtype(np.int32),
           torch.int16: np.dtype(np.int32)}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    try:
        return TO_NUMPY[dtype] if dtype in TO_NUMPY else WIDENED[dtype]
    except KeyError:
        raise DTypeError(f"tilefuse.torch: the dtype {dtype} has no tilefuse equivalent; supported: "
                         + ", ".join(str(d) for d in (*TO_NUMPY, *WIDENED))) from None


def torch_dtype(dtype) -> torch.dtype:
    return TO_TORCH[np.dtype(dtype)]


# tensor -> (version counter, data pointer, Array) of a tensor known to equal that Array
_resident = WeakIdKeyDictionary()


def _remember(t: torch.Tensor, a, bumps: int = 0) -> None:
    """Note that t holds a's values, as of t's version counter plus `bumps` (writes whose
    increment is still to come)."""
    try:
        _resident[t] = (t._version + bumps, t.data_ptr() if not isinstance(t, DeviceTensor) else 0, a)
    except RuntimeError:  # inference tensors have no version counter: nothing to remember
        pass


# data pointer -> (the tensor written, its version once written, Array): tensors that took a
# DeviceTensor's values by copy_. AOTAutograd writes an optimizer's new parameters into a
# detached alias of each parameter (p.detach().copy_(new)); the alias shares the parameter's
# memory and version counter, so the parameter is recognised by its data pointer, and holding
# the alias keeps that memory from being reused while the entry waits.
_written: dict = {}


def _claim_written(t: torch.Tensor, device):
    try:
        entry = _written.get(t.data_ptr())
        if entry is None:
            return None
        alias, version, a = entry
        if (t._version == version == alias._version and a.device is device and alias.dtype == t.dtype
                and alias.shape == t.shape and alias.stride() == t.stride()):
            del _written[t.data_ptr()]
            _remember(t, a)
            return a
    except RuntimeError:
        pass
    return None


def _known(t: torch.Tensor, device):
    hit = _resident.get(t)
    if hit is None:
        return _claim_written(t, device)
    version, ptr, a = hit
    try:
        same = t._version == version and (isinstance(t, DeviceTensor) or t.data_ptr() == ptr)
    except RuntimeError:
        return None
    if same and a.device is device and a.shape == tuple(t.shape) and torch_dtype(a.dtype) == t.dtype:
        return a
    return _claim_written(t, device)


def to_array(t: torch.Tensor, device):
    """The Array for a tensor on `device`: the one it came from or was copied to last, when the
    tensor has not been written since; else from DLPack (shared memory where the device can
    compute on it in place, a copy elsewhere)."""
    if isinstance(t, DeviceTensor):
        return t._store.array(device)
    a = _known(t, device)
    if a is not None:
        return a
    if t.device.type != "cpu":
        raise tx.DeviceError(f"tilefuse.torch: a {t.device} tensor cannot go to {device}; the "
                             "backend takes CPU tensors (move the model with .cpu())")
    numpy_dtype(t.dtype)  # a clear error for unsupported dtypes
    a = tx.from_dlpack(host_array(t), device=device)  # shares t's memory where the device can
    _remember(t, a)
    return a


def to_tensor(a, host_memory: bool, stay: bool = False) -> torch.Tensor:
    """A tensor for an Array: its memory itself where the device's memory is host memory; else a
    DeviceTensor that stays on the device until PyTorch computes with it when `stay` (an
    activation saved for the backward pass), or a host copy."""
    if host_memory:
        if a.dtype == ml_dtypes.bfloat16:
            t = torch.from_dlpack(a.numpy().view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_dlpack(a)
    elif stay:
        return DeviceTensor(_Store(a))
    else:
        t = host_tensor(a)
    _remember(t, a)
    return t


def host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a numpy array (bfloat16 as ml_dtypes' bfloat16)."""
    d = t.detach().contiguous()
    if d.dtype == torch.bfloat16:
        return d.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return d.numpy()


def host_tensor(a) -> torch.Tensor:
    """A plain CPU tensor holding a copy of an Array's values."""
    host = np.array(a.numpy(), copy=True)
    if host.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(host)


def _copies_whole(dst, src) -> bool:
    return (isinstance(src, DeviceTensor) and not isinstance(dst, DeviceTensor)
            and dst.device.type == "cpu" and dst.dtype == src.dtype and dst.shape == src.shape
            and dst.is_contiguous())


class _Store:
    """The values of a DeviceTensor (and of its detached aliases): an Array on the device and,
    once PyTorch has read them, a host copy. Whoever writes the host copy (an in-place op, a
    write through a view of it) bumps its version counter, which makes it the newer of the two."""
    __slots__ = ("_array", "_escaped", "_host", "_host_version")

    def __init__(self, array):
        self._array, self._host, self._host_version = array, None, 0
        self._escaped = False  # a view of the host copy went out: writes through it go unseen

    def host(self) -> torch.Tensor:
        if self._host is None:
            self._host = host_tensor(self._array)
            self._host_version = self._host._version
        return self._host

    def written(self) -> None:
        self._host_version = -1  # an op wrote the host copy where no version counter saw it

    def array(self, device):
        """The Array on `device`, uploaded again when the host copy has been written."""
        if self._host is not None and (self._escaped or self._host._version != self._host_version):
            self._array = tx.device_put(self._host.numpy(), self._array.device)
            self._host_version = self._host._version
        a = self._array
        return a if a.device is device else tx.device_put(self.host().numpy(), device)


class DeviceTensor(torch.Tensor):
    """A tensor whose values live in a tilefuse Array on a device that is not host memory.

    The compiled graphs take its Array as it is; anything else PyTorch does with it (printing,
    .item(), an eager op, an optimizer's update) works on a host copy made once, so it behaves
    as a CPU tensor with the same values (writes included: a written host copy goes back to
    the device when a compiled graph next takes the tensor)."""

    @staticmethod
    def __new__(cls, store: _Store):
        a = store._array
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(a.shape), dtype=torch_dtype(a.dtype),
                                                device="cpu")
        t._store = store
        return t

    @property
    def tilefuse_device(self):
        return self._store._array.device

    def __repr__(self, *, tensor_contents=None):
        return f"DeviceTensor({self._store.host()!r}, device={self.tilefuse_device})"

    def tolist(self):
        return self._store.host().tolist()

    def numpy(self, *, force=False):
        return self._store.host().numpy()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return DeviceTensor(args[0]._store)  # the same values: no copy
        if func is torch.ops.aten.copy_.default and _copies_whole(*args[:2]):
            # a plain tensor takes a DeviceTensor's values (AOTAutograd writing an optimizer's
            # new parameters back): it now equals that Array, so it need not go up again
            dst, src = args[0], args[1]
            dst.copy_(src._store.host())
            if not torch.is_inference_mode_enabled() and not dst.is_inference():
                # autograd counts this write when the op returns: the version to expect is one up
                a = src._store.array(src.tilefuse_device)
                _remember(dst, a, bumps=1)
                if len(_written) > 100_000:
                    _written.clear()
                _written[dst.data_ptr()] = (dst, dst._version + 1, a)
            return dst
        hosts = {}

        def host(x):
            if isinstance(x, DeviceTensor):
                h = x._store.host()
                hosts[id(h)] = x
                return h
            return x
        kwargs = kwargs or {}
        out = func(*tree_map(host, args), **tree_map(host, kwargs))
        # an op that writes one of its arguments writes its host copy (ops under
        # __torch_dispatch__ do not bump version counters): that copy is now the truth
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                x = args[i] if i < len(args) else kwargs.get(a.name)
                for t in (x if isinstance(x, (list, tuple)) else (x,)):
                    if isinstance(t, DeviceTensor):
                        t._store.written()
        stores = {h.untyped_storage().data_ptr(): t._store for t in hosts.values()
                  for h in (t._store._host,)}

        def back(o):
            if not isinstance(o, torch.Tensor):
                return o
            if id(o) in hosts:  # an in-place op returns the tensor it wrote: the DeviceTensor
                return hosts[id(o)]
            store = stores.get(o.untyped_storage().data_ptr()) if o.device.type == "cpu" else None
            if store is not None:  # a view of a host copy: the copy stays the truth from now on
                store._escaped = True
            return o
        return tree_map(back, out)
