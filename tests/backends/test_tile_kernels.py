"""Every backend that prints tile kernels runs the shared builders' kernels (ir/kernel/gemm.py)
in every form it can hold, ragged tiles included, and agrees with the `ref` backend: the printer
is tested once per backend for every construct (grid and lane ranges, unrolling, register,
scratch and shared memory, barriers, vectors, 16-bit loads and stores, epilogues)."""
from __future__ import annotations

import numpy as np
import pytest
from gemm_cases import CASES, gemm_kernel

import tilefuse as tx
from tilefuse.ir.kernel.gemm import GemmSchedule, build, default_schedule, gemm_spec
from tilefuse.ir.core import ShapedArray
from tilefuse.runtime.hardware import target_of

# the forms a device can hold: the packed CPU form anywhere, the shared-memory form where the
# device has shared memory (OpenCL CPU devices too)
SCHEDULES = {
    "default": None,
    "packed, ragged": GemmSchedule(False, 3, 2, 4, mc=6, nc=8),
    "packed, scalar": GemmSchedule(False, 2, 3, 1, mc=4, nc=3),
    "shared, ragged": GemmSchedule(True, 2, 2, 1, tm=4, tn=8, tk=3),
}
ROWS = ["plain", "B transposed", "batched einsum", "epilogue", "bfloat16"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gemm_tile_kernels_match_the_reference(device, schedule):
    if not device.backend.tile_kernels:
        pytest.skip(f"{device.kind} prints no tile kernels")
    sched = SCHEDULES[schedule]
    if sched is not None and sched.shared and not device.info.local_mem_bytes:
        pytest.skip(f"{device.name} has no shared memory")
    needs = {"shared"} if sched is not None and sched.shared else {"scratch", "vectors"} if sched else set()
    if needs - device.backend.tile_prints:
        pytest.skip(f"{device.kind}'s printer takes no {', '.join(sorted(needs - device.backend.tile_prints))}")
    for row in ROWS:
        f, args = CASES[row]
        k, ins = gemm_kernel(f, args)
        spec = gemm_spec(k)
        s = default_schedule(spec, target_of(device.info)) if sched is None else sched
        run = device.backend.compile_tile(build(spec, s, k.name, k.buffers, k.n_inputs), device)
        bufs = [device.backend.put(x, device) for x in ins]
        out = device.backend.put(np.zeros(k.buffers[-1].size, k.buffers[-1].dtype), device)
        run(bufs + [out])
        got = device.backend.to_host(out, ShapedArray((k.buffers[-1].size,), k.buffers[-1].dtype), device)
        want = np.asarray(tx.jit(f, device="ref")(*args)).reshape(-1)
        tol = 2e-2 if args[0].dtype != np.float32 else 1e-5
        np.testing.assert_allclose(np.asarray(got, np.float32), want.astype(np.float32), rtol=tol, atol=tol,
                                   err_msg=f"{row} under {s}")
