"""The implementation registry and the dispatcher.

For each kernel kind (elementwise, reduce, dot_general, ...) and device kind the registry holds
candidate implementations; the dispatcher picks the applicable one of highest priority and
compiles the kernel with it. Today every kind has one generic candidate, "kernel_ir" (the
backend renders the kernel IR); GEMM templates and vendor libraries register beside it. A
template's tuned parameters come from the tuning database (runtime/tuner.py).

Host fallbacks (work done in Python on the host rather than by a compiled kernel) are logged
and counted here: `stats["host_fallbacks"]`."""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Callable

from tilefuse.ir.errors import CompileError

from . import tuner

log = logging.getLogger("tilefuse.dispatch")

KERNEL_KINDS = ("elementwise", "reduce", "dot_general", "fused_gemm", "gather", "scatter_add",
                "concatenate", "pad", "arg_reduce", "copy")
ATTENTION_KINDS = ("fused_attention", "fused_attention_stats", "fused_attention_bwd")
TEMPLATE_KINDS = ATTENTION_KINDS + ("conv", "fused_conv")  # whole primitives, see composite.py


@dataclass(frozen=True)
class Implementation:
    """One way to run kernels of one kind: `build(kernel, device, backend) -> run(buffers)`."""
    name: str
    kind: str
    build: Callable
    device_kinds: tuple = ("*",)  # "*": any device
    applies: Callable = lambda kernel, device: True
    priority: int = 0
    # (kernel, device) -> the builders' tile kernels `build` compiles under its defaults, which a
    # graph's compile builds together beforehand (Backend.compile_tiles); None: not a builder's
    tiles: Callable | None = None


_registry: dict[str, list[Implementation]] = {}
stats = {"host_fallbacks": 0, "compiled": 0}


def register(impl: Implementation) -> Implementation:
    _registry.setdefault(impl.kind, []).append(impl)
    _registry[impl.kind].sort(key=lambda i: -i.priority)
    return impl


def unregister(impl: Implementation) -> None:
    _registry[impl.kind].remove(impl)


def candidates(kind: str, device_kind: str) -> list[Implementation]:
    """The implementations of `kind` for a device kind, best first."""
    return [i for i in _registry.get(kind, ()) if "*" in i.device_kinds or device_kind in i.device_kinds]


def choose(kernel, device) -> Implementation:
    """The first candidate that applies; kept in the kernel's meta per device (compile_graph asks
    before its batch build and again when it builds each kernel)."""
    chosen = kernel.meta.setdefault("chosen", {})
    where = getattr(device, "name", device)
    if where in chosen:
        return chosen[where]
    kind = kernel.meta.get("kind", "elementwise")
    for impl in candidates(kind, getattr(device, "kind", "*")):
        if impl.applies(kernel, device):
            chosen[where] = impl
            return impl
    raise CompileError(f"no implementation of {kind} kernels for the device {device}",
                       kernel=str(kernel))


def compile_kernel(kernel, device, backend) -> tuple[Implementation, Callable]:
    """The chosen implementation and the kernel built with it: with the tuning database's
    parameters for this kernel, shape and device where it holds some (runtime/tuner.py)."""
    impl = choose(kernel, device)
    stats["compiled"] += 1
    return impl, tuner.build(impl, kernel, device, backend)


def record_fallback(what: str, why: str) -> None:
    stats["host_fallbacks"] += 1
    log.info("tilefuse: %s runs on the host (%s)", what, why)


def kernel_ir(kernel, device, backend):
    """The generic implementation: the backend renders the kernel IR."""
    return backend.compile_kernel(kernel, device)


for _kind in KERNEL_KINDS:
    register(Implementation("kernel_ir", _kind, kernel_ir))


def _lazy(module: str, name: str) -> Callable:
    """module.name, imported at its first call (backends load only when a device needs them)."""
    def call(*args):
        return getattr(importlib.import_module(module), name)(*args)
    call.__qualname__ = f"{module}.{name}"
    return call


def _template(name: str, kinds, module: str, device_kind: str, priority: int) -> None:
    """Register module.build for `kinds` on one device kind, where module.applies says so."""
    for kind in kinds:
        register(Implementation(name, kind, _lazy(module, "build"), (device_kind,),
                                _lazy(module, "applies"), priority))


# Attention and convolution: the shared tile builders (FlashAttention, the implicit GEMM) register
# for the backends that print tile kernels (runtime/tiled.py); everywhere the ordinary kernels of
# their decompositions (runtime/composite.py) remain a candidate.
for _kind in TEMPLATE_KINDS:
    register(Implementation("composite", _kind, _lazy("tilefuse.runtime.composite", "build")))

# Where no template reads a fused_gemm's operands on OpenCL and CUDA: the GEMM, then the epilogue
# kernel (runtime/gemm_split.py). Backends that print tile kernels take the shared builder
# (runtime/tiled.py); the CPU beside numpy's BLAS (runtime/host_blas.py).
for _dk in ("opencl", "cuda"):
    _template("gemm_then_epilogue", ("fused_gemm",), "tilefuse.runtime.gemm_split", _dk, 10)

# Sorting and LAPACK's decompositions: numpy on the host, on every device (runtime/host.py).
from tilefuse.ir.primitives import HOST_PRIMITIVES  # noqa: E402

for _p in HOST_PRIMITIVES:
    register(Implementation("numpy_host", _p.name, _lazy("tilefuse.runtime.host", "build")))
