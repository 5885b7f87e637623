"""The OpenCL kernels' parameter space for the auto-tuner (runtime/tuner.py): the work-group size
of kernels rendered to run with any (tree-mode reductions need theirs; serial kernels run one
work-item), bounded by the device's maximum work-group."""
from __future__ import annotations

from tilefuse.runtime import tuner

from . import CompiledKernel, launch_dims

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _built(kernel, device) -> CompiledKernel:
    return device.backend.compile_kernel(kernel, device)  # built once, then from the backend's cache


def space(kernel, device) -> dict:
    ck = _built(kernel, device)
    r = ck.rendered
    if r.local or r.mode == "serial" or r.units <= 1:
        return {"local": (ck.local_size[0],)}
    return {"local": tuple(s for s in SIZES if s <= min(device.info.max_work_group, r.units))}


def default(kernel, device) -> dict:
    return {"local": _built(kernel, device).local_size[0]}


def check(params: dict, kernel, device) -> str | None:
    if params["local"] > device.info.max_work_group:
        return f"the device's work-groups hold at most {device.info.max_work_group} work-items"
    return None


def build(kernel, device, backend, params: dict) -> CompiledKernel:
    ck = _built(kernel, device)
    if (params["local"],) == tuple(ck.local_size):
        return ck
    global_size, local_size = launch_dims(ck.rendered, device.info, params["local"])
    return CompiledKernel(kernel, ck.rendered, ck._knl, ck._state, global_size, local_size)


tuner.register(tuner.Template("opencl_kernel", "kernel_ir", ("opencl",), space, default, build, check))
