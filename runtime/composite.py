"""The composite implementation: a template primitive (fused_attention, fused_attention_bwd, conv) run
as the ordinary kernels of its decomposition, on any backend that renders the kernel IR.

It is the fallback where a device has no template of its own (OpenCL, CUDA, and the CPU for
dtypes its template does not take): the decomposition (ir/passes/attention.py) is partitioned
and lowered like any graph, each kernel compiled by the backend, and its intermediates (the
S x S scores among them: this path does materialise them) live in one arena per call."""
from __future__ import annotations

import numpy as np

from tilefuse.ir import primitives as P
from tilefuse.ir.kernel import lower_region
from tilefuse.ir.passes import partition
from tilefuse.ir.passes import attention, conv, gemm_epilogue

from .planner import Interval, plan_buffers

DECOMPOSITIONS = {P.fused_attention: attention.decomposed_graph, P.fused_attention_stats: attention.decomposed_graph,
                  P.fused_attention_bwd: attention.decomposed_graph, P.conv: conv.decomposed_graph,
                  P.fused_conv: gemm_epilogue.unfused_graph}


def _nbytes(aval) -> int:
    return max(aval.size * np.dtype(aval.dtype).itemsize, 1)


def applies(kernel, device) -> bool:
    eqns = kernel.meta.get("eqns", ())
    return len(eqns) == 1 and eqns[0].prim in DECOMPOSITIONS


def build(kernel, device, backend):
    """run(buffers) for the template kernel's buffers (its equation's inputs, then outputs)."""
    (eqn,) = kernel.meta["eqns"]
    g = DECOMPOSITIONS[eqn.prim](eqn)
    slot = {v.id: i for i, v in enumerate(g.invars)}
    for i, v in enumerate(g.outvars, start=len(g.invars)):
        slot.setdefault(v.id, i)
    return run_graph(g, slot, device, backend)


def run_graph(g, slot: dict, device, backend):
    """run(buffers) computing graph `g` as the device's kernels, each chosen by the dispatcher;
    `slot` maps the variables that live in the caller's buffers to their positions there."""
    from . import dispatch
    from .compiler import _gather
    base = max(slot.values()) + 1
    slot = dict(slot)
    temps: dict[int, int] = {}  # slot -> bytes
    steps = []
    for region in partition(g):
        for lk in lower_region(region):
            for v in lk.args:
                if v.id not in slot:
                    slot[v.id] = base + len(temps)
                    temps[slot[v.id]] = _nbytes(v.aval)
            _, run = dispatch.compile_kernel(lk.kernel, device, backend)
            steps.append((run, _gather(tuple(slot[v.id] for v in lk.args))))
    # every intermediate lives through the whole call: the arena is their sum (aligned)
    plan = plan_buffers([Interval(s, n, 0, 0) for s, n in temps.items()])
    views = [(s, plan.offsets[s], n) for s, n in temps.items()]
    alloc, free, view = backend.alloc, backend.free, backend.view

    def run(buffers):
        slots = list(buffers) + [None] * len(temps)
        arena = alloc(max(plan.arena_bytes, 1), device) if temps else None
        try:
            for s, off, n in views:
                slots[s] = view(arena, off, n)
            for fn, gather in steps:
                fn(gather(slots))
        finally:
            if arena is not None:
                free(arena, device)
    return run
