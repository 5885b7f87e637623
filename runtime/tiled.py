"""Kernels built by the shared tile-level builders (ir/kernel/: GEMM) for every backend that
prints tile kernels: the builder writes the algorithm under a schedule chosen from the device's
Target (or the tuning database), the backend only prints and launches it."""
from __future__ import annotations

from tilefuse.ir.kernel import gemm

from . import dispatch
from .hardware import target_of

MIN_FLOPS = 1 << 18  # smaller products: the generic kernel is as fast and needs no tile padding


def _target(device):
    return target_of(device.info)


def gemm_applies(kernel, device) -> bool:
    if not device.backend.tile_kernels:
        return False
    spec = gemm.gemm_spec(kernel)
    return spec is not None and spec.layout.flops >= MIN_FLOPS and \
        gemm.default_schedule(spec, _target(device)).check(spec, _target(device)) is None


def gemm_build(kernel, device, backend, params: dict | None = None):
    spec = gemm.gemm_spec(kernel)
    target = _target(device)
    sched = gemm.default_schedule(spec, target) if params is None else gemm.GemmSchedule(**params)
    why = sched.check(spec, target)
    if why is not None:
        raise ValueError(f"GEMM schedule {sched}: {why}")
    return backend.compile_tile(gemm.build(spec, sched, kernel.name, kernel.buffers, kernel.n_inputs), device)


for _kind in ("dot_general", "fused_gemm"):
    dispatch.register(dispatch.Implementation("tile_gemm", _kind, gemm_build, ("*",), gemm_applies, 30))
