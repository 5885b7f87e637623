"""fused_gemm on a device whose GEMM template takes no epilogue (OpenCL, CUDA): the product
through the dispatcher (the device's tiled GEMM where one applies) into a temporary, then the
epilogue as one fused elementwise kernel. The generic kernel IR would run the whole fused_gemm
as one loop nest: slower than the tiled GEMM the rewrite replaced."""
from __future__ import annotations

import numpy as np
from tilefuse.ir.kernel import lower_region
from tilefuse.ir.kernel.matmul import matmul_layout
from tilefuse.ir.passes import partition
from tilefuse.ir.passes.gemm_epilogue import unfused_graph

from . import dispatch
from .planner import Interval, plan_buffers

MIN_FLOPS = 1 << 18  # smaller products: the one generic kernel is as fast as two launches


def applies(kernel, device) -> bool:
    eqns = kernel.meta.get("eqns", ())
    if len(eqns) != 1 or eqns[0].prim.name != "fused_gemm" or "operands" not in kernel.meta:
        return False
    lay = matmul_layout(eqns[0])
    return lay is not None and lay.flops >= MIN_FLOPS


def build(kernel, device, backend):
    """run(buffers) over the fused kernel's buffers (its operands, then its output)."""
    (eqn,) = kernel.meta["eqns"]
    operands = kernel.meta["operands"]
    slot = {v.id: i for i, v in enumerate(operands)}
    slot[eqn.outputs[0].id] = len(operands)
    temps: dict[int, int] = {}  # slot -> bytes
    steps = []
    for region in partition(unfused_graph(eqn)):
        for lk in lower_region(region):
            for v in lk.args:
                if v.id not in slot:
                    slot[v.id] = len(operands) + 1 + len(temps)
                    temps[slot[v.id]] = max(v.aval.size * np.dtype(v.aval.dtype).itemsize, 1)
            _, run = dispatch.compile_kernel(lk.kernel, device, backend)
            steps.append((run, [slot[v.id] for v in lk.args]))
    plan = plan_buffers([Interval(s, n, 0, 0) for s, n in temps.items()])
    alloc, free, view = backend.alloc, backend.free, backend.view

    def run(buffers):
        slots = list(buffers) + [None] * len(temps)
        arena = alloc(max(plan.arena_bytes, 1), device) if temps else None
        try:
            for s, n in temps.items():
                slots[s] = view(arena, plan.offsets[s], n)
            for fn, args in steps:
                fn([slots[a] for a in args])
        finally:
            if arena is not None:
                free(arena, device)
    return run
