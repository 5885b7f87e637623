"""The reference backend: numpy interprets the primitive table. The oracle for every test."""
from __future__ import annotations

import numpy as np

from tilefuse.ir.core import eval_graph
from tilefuse.ir.errors import OutOfMemoryError
from tilefuse.ir.primitives import Interpreter
from tilefuse.runtime import profiler
from tilefuse.runtime.hardware import DeviceInfo, host_info

from .base import Backend, Program


class RefBackend(Backend):
    kind = "ref"

    def discover(self):
        info = host_info()
        return [DeviceInfo(**{**info.__dict__, "name": "numpy reference interpreter", "kind": "ref"})]

    def put(self, host, device):
        return np.array(host, copy=True) if host.flags.writeable else host

    def to_host(self, buf, aval, device):
        return buf

    def host_memory(self, device) -> bool:
        return True

    def adopt(self, host, device):
        return host  # a ref buffer is the typed numpy array itself

    def compile(self, graph, device):
        interpreter = Interpreter(graph)

        def run(buffers):
            prof = profiler.active
            with _numpy_memory(device):
                return interpreter(buffers) if prof is None else eval_graph(graph, buffers, prof.apply(device))
        return Program(graph, run)

    def apply_primitive(self, prim, params, buffers, device=None):
        prof = profiler.active
        try:  # (not _numpy_memory: every eager operation comes here, and a `with` costs more)
            if prof is not None:
                return prof.call(device, prim, params, lambda: prim.impl(*buffers, **params), buffers)
            return prim.impl(*buffers, **params)
        except MemoryError as e:
            _raise_out_of_memory(device, e)
            raise


class _numpy_memory:
    """numpy's MemoryError as the device's OutOfMemoryError, as the other backends raise it."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if kind is not None and issubclass(kind, MemoryError):
            _raise_out_of_memory(self.device, e)
        return False


def _raise_out_of_memory(device, e: MemoryError) -> None:
    """numpy's MemoryError as the device's OutOfMemoryError (one that already is passes on)."""
    if not isinstance(e, OutOfMemoryError):
        raise OutOfMemoryError(f"{device or 'ref'}: numpy cannot allocate ({e})") from None


def create():
    return RefBackend()
