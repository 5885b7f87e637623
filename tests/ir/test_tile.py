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
from gemm_cases import CASES, CONV_CASES, conv_kernel, gemm_kernel

R = np.random.default_rng(0)
F32 = np.float32
CPU = Target("cpu", lanes=8, vector_registers=16, cores=2)
GPU = Target("gpu", lanes=1, cores=4, shared_bytes=48 << 10, max_group=256, warp=32)


SCHEDULES = {
    "cpu default": lambda spec: default_schedule(spec, CPU),
    "gpu default": lambda spec: default_schedule(spec, GPU),
    "cpu ragged": lambda spec: GemmSchedule(False, 3, 2, 4, mc=6, nc=8),
    "cpu scalar": lambda spec: GemmSchedule(False, 2, 3, 1, mc=4, nc=3),
    "cpu packed A": lambda spec: GemmSchedule(False, 5, 1, 4, mc=10, nc=8, pack_a=True),
    "gpu ragged": lambda spec: GemmSchedule(True, 2, 2, 1, tm=4, tn=8, tk=3),
    "gpu one row": lambda spec: GemmSchedule(True, 1, 4, 1, tm=1, tn=16, tk=5),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", CASES)
def test_gemm_builder_matches_the_reference(case, schedule):
    f, args = CASES[case]
    k, ins = gemm_kernel(f, args)
    _check_on_the_reference(f, args, k, gemm_spec(k), ins, schedule)


def _check_on_the_reference(f, args, k, spec, ins, schedule):
    """The builder's kernel of spec under the named schedule, type-checked and run by run_tile,
    against the `ref` backend."""
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


def _groups_kernel(extent):
    """Work-group g of 4 work-items: each writes s[t] = 10 g + t, then after the barrier sums
    s[3 - t] over `extent` (a loop whose trips may depend on g) into out[4 g + t]."""
    g, t = var("g"), var("t")
    acc = "acc"
    body = (Range("g", 5, "grid", (Range("t", 4, "lane", (
        Alloc("s", np.dtype(F32), 4, "shared"),
        Alloc(acc, np.dtype(F32), 1, "register"),
        Store("s", t, _f32(binary("add", binary("mul", const(10, INDEX), g), t))),
        Store(acc, const(0, INDEX), const(0.0, F32)),
        Barrier(),
        Range("i", extent, "serial", (
            Store(acc, const(0, INDEX), binary("add", tload(acc, const(0, INDEX), F32),
                                               tload("s", binary("sub", const(3, INDEX), t), F32))),)),
        Store(0, binary("add", binary("mul", const(4, INDEX), g), t), tload(acc, const(0, INDEX), F32)),)),)),)
    return TileKernel("groups", (Buffer("out0", np.dtype(F32), 20),), 0, body)


def test_the_reference_runs_work_groups_side_by_side_as_one_at_a_time():
    """run_tile batches work-groups (one numpy op per node for many groups): each keeps its own
    shared memory, and a loop whose extent depends on the group runs each group's own trips;
    batches of one group give the same numbers. Work-items of one group must agree on a loop's
    extent (a barrier inside it would otherwise hang a GPU)."""
    g = var("g")
    k = _groups_kernel(binary("add", g, const(1, INDEX)))  # group g: g + 1 trips
    check_tile(k)
    want = np.array([(gi + 1) * (10 * gi + 3 - t) for gi in range(5) for t in range(4)], F32)
    for max_lanes in (1, 8, 4096):
        out = np.full(20, np.nan, F32)
        run_tile(k, [out], max_lanes=max_lanes)
        np.testing.assert_array_equal(out, want, err_msg=f"max_lanes={max_lanes}")
    with pytest.raises(AssertionError, match="extent differs between work-items"):
        run_tile(_groups_kernel(binary("add", var("t"), const(1, INDEX))), [np.zeros(20, F32)])


def test_loop_trips_count_every_entry_of_a_loop():
    """A driver that caps a loop's trips per work-item (llvmpipe: 65535) counts them over every
    time the enclosing loops enter it: the WebGPU backend refuses past the cap, never truncates."""
    from tilefuse.ir.kernel.tile import loop_trips
    inner = Range("b", 5, "serial", (Store("x", const(0, INDEX), const(1.0, np.float32)),))
    body = (Range("g", 100, "grid", (Range("a", 3, "serial", (inner,)), Range("c", 7, "serial", ()))),)
    assert loop_trips(body) == 15 and loop_trips((inner,)) == 5 and loop_trips(()) == 0
    # a run-time extent counts at the launch's sizes (a sum over a batch of 40,000 rows in blocks of
    # 128), one that varies with a loop variable as one trip
    from tilefuse.ir.kernel.tile import size
    blocks = binary("div", binary("add", size(1), const(127, INDEX)), const(128, INDEX))
    sized = (Range("rb", blocks, "serial", (Range("rv", 128, "serial", (inner,)),)),)
    assert loop_trips(sized, sizes=(7, 40000)) == 313 * 128 * 5 and loop_trips(sized) == 128 * 5
    assert loop_trips((Range("t", binary("sub", size(0), var("rb")), "serial", ()),), sizes=(9,)) == 1
    # a device's limits refuse the kernel with the reason (runtime/hardware.check_fits)
    import types

    from tilefuse.ir.errors import CompileError, OutOfMemoryError
    from tilefuse.runtime.hardware import DeviceInfo, check_fits
    tk = types.SimpleNamespace(name="k", body=body, buffers=[types.SimpleNamespace(size=1000, dtype=np.float32)],
                               meta={})
    check_fits(tk, DeviceInfo("webgpu", "gpu", extra={"max_buffer": 4000, "max_loop_trips": 15}))
    with pytest.raises(CompileError, match="runs a loop 15 times .* stops loops at 14"):
        check_fits(tk, DeviceInfo("webgpu", "gpu", extra={"max_loop_trips": 14}))
    with pytest.raises(OutOfMemoryError, match="4000 bytes .* at most 3999"):
        check_fits(tk, DeviceInfo("webgpu", "gpu", extra={"max_buffer": 3999}))


def test_the_kernel_ir_math_library_matches_numpy():
    """ir/kernel/mathlib.py (what WebGPU prints instead of WGSL's loose exp, log, pow...), run by
    the lockstep reference on a sweep over float32's range, specials included."""
    import math

    from tilefuse.ir.kernel.ir import load, unary
    from tilefuse.ir.kernel.mathlib import expand
    from tilefuse.ir.kernel.tile import var
    f32 = np.dtype(np.float32)
    x = np.concatenate([np.logspace(-40, 38, 400), -np.logspace(-40, 38, 400), np.linspace(-30, 30, 601),
                        [0.0, -0.0, np.inf, -np.inf, np.nan, 88.7, -103.9, 1e-7, 0.41, -0.29]]).astype(f32)
    ref = {"exp": np.exp, "log": np.log, "expm1": np.expm1, "log1p": np.log1p, "tanh": np.tanh,
           "logistic": lambda v: 1 / (1 + np.exp(-v)), "erf": np.vectorize(math.erf, otypes=[np.float64])}
    bound = {"exp": 2, "log": 2, "expm1": 3, "log1p": 3, "tanh": 4, "logistic": 4, "erf": 16}

    def run(value, n):
        k = TileKernel("m", (Buffer("x", f32, n), Buffer("y", f32, n), Buffer("out", f32, n)), 2,
                       (Range("g", n, "grid", (Store(2, var("g"), value),)),))
        out = np.zeros(n, f32)
        run_tile(expand(k), [x_, y_, out])
        return out
    for name, f in ref.items():
        x_, y_ = x, x
        got = run(unary(name, load(0, var("g"), f32)), x.size)
        with np.errstate(all="ignore"):
            want = f(x.astype(np.float64)).astype(f32)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=name)
        ok = np.isfinite(want) & np.isfinite(got)
        np.testing.assert_array_equal(got[~ok & ~np.isnan(want)], want[~ok & ~np.isnan(want)], err_msg=name)
        ulps = np.abs(got[ok].view(np.int32).astype(np.int64) - want[ok].view(np.int32).astype(np.int64))
        assert ulps.max() <= bound[name], f"{name}: {ulps.max()} ulp at {x[ok][np.argmax(ulps)]}"
    a, b = np.meshgrid(np.float32([-2.5, -1, -0.0, 0, 0.5, 1, 3, np.inf, -np.inf, np.nan]),
                       np.float32([-3, -0.5, 0, 0.5, 2, 3, 89, np.inf, -np.inf, np.nan]))
    x_, y_ = a.ravel(), b.ravel()
    from tilefuse.ir.kernel.ir import binary
    got = run(binary("pow", load(0, var("g"), f32), load(1, var("g"), f32)), x_.size)
    with np.errstate(all="ignore"):
        want = np.power(x_.astype(np.float64), y_.astype(np.float64)).astype(f32)
    np.testing.assert_allclose(got, want, rtol=3e-5, err_msg=str(list(zip(x_, y_, got, want))))


# ---- convolution: the same builder as an implicit GEMM (ir/kernel/conv.py) ------------------------

@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", CONV_CASES)
def test_implicit_gemm_matches_the_reference(case, schedule):
    f, args = CONV_CASES[case]
    k, spec, ins = conv_kernel(f, args)
    assert spec is not None, case
    _check_on_the_reference(f, args, k, spec, ins, schedule)


def test_the_filter_gradient_puts_its_images_in_the_columns():
    """The filter gradient's output (O, I, KH, KW) keeps each input feature's taps together: one
    GEMM per group whose columns are (feature, tap), not a GEMM of KH·KW columns per feature."""
    x, w = R.standard_normal((4, 8, 12, 12)).astype(F32), R.standard_normal((16, 8, 3, 3)).astype(F32)
    g = tx.grad(lambda x, w: (tx.nn.conv2d(x, w, padding=1) ** 2).sum(), argnums=1)
    from tilefuse.ir.kernel import lower_region
    from tilefuse.ir.kernel.conv import conv_spec
    from tilefuse.ir.passes import partition, run_passes
    specs = [conv_spec(lk.kernel) for r in partition(run_passes(tx.make_graph(g)(x, w)))
             for lk in lower_region(r) if lk.kernel.meta.get("kind") == "conv"]
    dw = [s for s in specs if s.conv.images_in_columns]
    assert len(dw) == 1 and dw[0].layout.n == 8 * 9 and dw[0].layout.m == 16 and dw[0].layout.k == 4 * 12 * 12, specs
