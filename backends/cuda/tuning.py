"""The CUDA kernels' parameter space for the auto-tuner (runtime/tuner.py): the threads per block
of the grid-stride kernels the kernel IR renders to (one PTX runs with any block; the grid
follows from it, capped at one wave of resident blocks), whole warps up to the device's limit."""
from __future__ import annotations

from tilefuse.runtime import tuner

from . import CudaKernel

SIZES = (32, 64, 128, 256, 512, 1024)


def _warp(device) -> int:
    return max(int(device.info.sub_group or 32), 1)


def space(kernel, device) -> dict:
    ck = device.backend.compile_kernel(kernel, device)
    need = -(-max(ck.points, 1) // _warp(device)) * _warp(device)  # more threads than points idle
    sizes = tuple(s for s in SIZES if s % _warp(device) == 0 and s <= device.info.max_work_group
                  and s <= max(need, _warp(device)))
    return {"block": tuple(dict.fromkeys((*sizes, ck.block)))}


def default(kernel, device) -> dict:
    return {"block": device.backend.compile_kernel(kernel, device).block}


def check(params: dict, kernel, device) -> str | None:
    block, warp = params["block"], _warp(device)
    if block % warp or block <= 0:
        return f"a block is a whole number of warps ({warp} threads); got {block}"
    if block > device.info.max_work_group:
        return f"the device's blocks hold at most {device.info.max_work_group} threads"
    return None


def build(kernel, device, backend, params: dict) -> CudaKernel:
    return backend.compile_kernel(kernel, device, params["block"])


tuner.register(tuner.Template("cuda_kernel", "kernel_ir", ("cuda",), space, default, build, check))
