"""The numpy_host implementation: vendor kernels that run through numpy on the host (sorting,
LAPACK's decompositions: ir/primitives.py HOST_PRIMITIVES), on every device.

A launch synchronises the device, reads the operands to the host, runs the primitive's numpy
implementation and writes each result into its output buffer through a device copy kernel (the
backend contract has put and to_host, not a write into a given buffer). The profiler times the
launch, copies included; dispatch.stats counts the host round trips."""

from __future__ import annotations

import numpy as np

from tilefuse.ir.core import Var
from tilefuse.ir.kernel.lower import copy_kernel
from tilefuse.ir.primitives import HOST_PRIMITIVES

HOST_KINDS = tuple(p.name for p in HOST_PRIMITIVES)


def applies(kernel, device) -> bool:
    eqns = kernel.meta.get("eqns", ())
    return len(eqns) == 1 and eqns[0].prim.name in HOST_KINDS


def build(kernel, device, backend):
    """run(buffers) for the kernel's buffers: its equation's operands, then its results."""
    from . import dispatch

    (eqn,) = kernel.meta["eqns"]
    in_avals = [v.aval for v in eqn.inputs]
    writes = []
    for o in eqn.outputs:
        if o.aval.size:
            lk = copy_kernel(Var(o.aval), Var(o.aval))
            writes.append((o.aval, dispatch.compile_kernel(lk.kernel, device, backend)[1]))
        else:
            writes.append((o.aval, None))
    n_in, prim, params = len(in_avals), eqn.prim, eqn.params

    def run(buffers):
        dispatch.stats["host_round_trips"] = dispatch.stats.get("host_round_trips", 0) + 1
        backend.synchronize(device)
        args = [backend.to_host(b, a, device) for b, a in zip(buffers[:n_in], in_avals)]
        results = prim.impl(*args, **params)
        for (aval, write), res, out in zip(writes, results, buffers[n_in:]):
            if write is not None:
                host = np.ascontiguousarray(np.asarray(res, aval.dtype).reshape(aval.shape))
                tmp = backend.put(host, device)
                write((tmp, out))

    return run
