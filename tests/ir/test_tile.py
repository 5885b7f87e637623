"""The tile-level kernel IR (ir/kernel/tile.py) and the builders written in it: the GEMM of
ir/kernel/gemm.py, in both its forms and under ragged tiles, checked by the type checker and run
by the reference (work-groups in lockstep) against the `ref` backend; the checker's refusals."""
from __future__ import annotations

import numpy as np
import pytest

import tilefuse as tx
from tilefuse.ir.kernel.gemm import GemmSchedule, build, default_schedule, gemm_spec
from tilefuse.ir.kernel.ir import INDEX, Buffer, binary, const
from tilefuse.ir.kernel.target import Target
from tilefuse.ir.kernel.tile import (Alloc, Barrier, If, Range, Store, TileKernel, check_tile, pp_tile, run_tile,
                                     tload, var)
from gemm_cases import CASES, gemm_kernel

R = np.random.default_rng(0)
F32 = np.float32
CPU = Target("cpu", lanes=8, vector_registers=16, cores=2)
GPU = Target("gpu", lanes=1, cores=4, shared_bytes=48 << 10, max_group=256, warp=32)


SCHEDULES = {
    "cpu default": lambda spec: default_schedule(spec, CPU),
    "gpu default": lambda spec: default_schedule(spec, GPU),
    "cpu ragged": lambda spec: GemmSchedule(False, 3, 2, 4, mc=6, nc=8),
    "cpu scalar": lambda spec: GemmSchedule(False, 2, 3, 1, mc=4, nc=3),
    "gpu ragged": lambda spec: GemmSchedule(True, 2, 2, 1, tm=4, tn=8, tk=3),
    "gpu one row": lambda spec: GemmSchedule(True, 1, 4, 1, tm=1, tn=16, tk=5),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", CASES)
def test_gemm_builder_matches_the_reference(case, schedule):
    f, args = CASES[case]
    k, ins = gemm_kernel(f, args)
    spec = gemm_spec(k)
    sched = SCHEDULES[schedule](spec)
    assert sched.check(spec, GPU if sched.shared else CPU) is None
    tk = build(spec, sched, k.name, k.buffers, k.n_inputs)
    check_tile(tk)
    out = np.zeros(k.buffers[-1].size, k.buffers[-1].dtype)
    run_tile(tk, ins + [out])
    want = np.asarray(tx.jit(f, device="ref")(*args)).reshape(-1)
    tol = 2e-2 if args[0].dtype != F32 else 1e-5
    np.testing.assert_allclose(out.astype(F32), want.astype(F32), rtol=tol, atol=tol)


def test_schedules_respect_the_target():
    k, _ = gemm_kernel(CASES["plain"][0], CASES["plain"][1])
    spec = gemm_spec(k)
    assert GemmSchedule(True, 2, 2, tm=64, tn=64, tk=8).check(spec, CPU) == "the target has no shared memory"
    small = Target("gpu", cores=1, shared_bytes=1 << 10, max_group=64)
    assert "shared memory" in GemmSchedule(True, 4, 4, tm=32, tn=32, tk=8).check(spec, small)
    assert "work-group" in GemmSchedule(True, 1, 1, tm=32, tn=32, tk=1).check(spec, small)
    assert "registers" in GemmSchedule(False, 8, 4, 8, mc=8, nc=32).check(spec, CPU)
    for t in (CPU, GPU, Target("cpu", lanes=16, vector_registers=32, cores=64),
              Target("gpu", lanes=1, cores=1, shared_bytes=4 << 10, max_group=64)):
        assert default_schedule(spec, t).check(spec, t) is None, t


def test_the_printer_shows_the_loop_nest():
    f, args = CASES["plain"]
    k, _ = gemm_kernel(f, args)
    text = pp_tile(build(gemm_spec(k), default_schedule(gemm_spec(k), GPU), k.name, k.buffers, k.n_inputs))
    assert "grid z < 1:" in text and "lane ty <" in text and "shared at:float32" in text and "barrier" in text


def _kernel(body):
    return TileKernel("t", (Buffer("out0", np.dtype(F32), 4),), 0, body)


@pytest.mark.parametrize("body,why", [
    ((Range("g", 2, "grid", (If(binary("lt", var("g"), const(1, INDEX)), (Barrier(),)),)),), "barrier under an If"),
    ((Range("g", 2, "grid", (Range("s", 2, "serial", ()), Store(0, var("s"), const(1.0, F32)))),),
     "outside its range"),
    ((Range("g", 4, "grid", (Store(0, var("g"), tload("nope", var("g"), F32)),)),), "used before"),
    ((Range("g", 4, "grid", (Store(0, var("g"), const(1, np.int32)),)),), "store of int32"),
    ((Range("g", 4, "serial", (Range("h", 2, "grid", ()),)),), "grids and lanes lead"),
    ((Range("g", 4, "grid", (Range("s", 1, "serial", (Alloc("x", np.dtype(F32), 4, "shared"),)),)),),
     "shared memory is made by the work-group"),
])
def test_the_checker_refuses_malformed_kernels(body, why):
    with pytest.raises(AssertionError, match=why):
        check_tile(_kernel(body))


def test_lockstep_reference_sees_shared_memory_after_a_barrier():
    """Work-item t writes s[t], then after the barrier reads s[3 - t]: a reversal only lockstep
    execution (or a real work-group) gets right."""
    t = var("t")
    body = (Range("g", 1, "grid", (Range("t", 4, "lane", (
        Alloc("s", np.dtype(F32), 4, "shared"),
        Store("s", t, binary("mul", const(10.0, F32), binary("add", const(1.0, F32),
                                                            _f32(t)))),
        Barrier(),
        Store(0, t, tload("s", binary("sub", const(3, INDEX), t), F32)),)),)),)
    k = TileKernel("rev", (Buffer("out0", np.dtype(F32), 4),), 0, body)
    check_tile(k)
    out = np.zeros(4, F32)
    run_tile(k, [out])
    np.testing.assert_array_equal(out, [40, 30, 20, 10])


def _f32(x):
    from tilefuse.ir.kernel.ir import cast
    return cast(x, F32)


def test_loop_trips_count_every_entry_of_a_loop():
    """A driver that caps a loop's trips per work-item (llvmpipe: 65535) counts them over every
    time the enclosing loops enter it: the WebGPU backend refuses past the cap, never truncates."""
    from tilefuse.ir.kernel.tile import loop_trips
    inner = Range("b", 5, "serial", (Store("x", const(0, INDEX), const(1.0, np.float32)),))
    body = (Range("g", 100, "grid", (Range("a", 3, "serial", (inner,)), Range("c", 7, "serial", ()))),)
    assert loop_trips(body) == 15 and loop_trips((inner,)) == 5 and loop_trips(()) == 0
