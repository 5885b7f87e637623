"""The profiler on every device: one record per launch, a Chrome trace that parses and holds one
event per launch, summary shares that add to 100%, FLOP and byte estimates, and nothing
recorded once the block is left."""
from __future__ import annotations

import json

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse.ir.kernel import ir as K
from tilefuse.runtime import profiler

M, KD, N = 24, 40, 16


def _model(a, b):
    return tnp.sum(tnp.tanh(a @ b) * 2.0 + 1.0, axis=1)


def _launch_names(f, device, *args) -> list[str]:
    """The launches one call makes: the compiled program's, or the graph's equations on ref."""
    exe = f.lower(*args).compile()
    if device.kind == "ref":
        return [e.prim.name for e in exe.graph.eqns]
    return [launch.name for launch in exe.program.launches]


def test_one_record_and_one_trace_event_per_launch(device, tmp_path):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((M, KD)).astype(np.float32), rng.standard_normal((KD, N)).astype(np.float32)
    f = tx.jit(_model)
    f(a, b)  # compiled outside the profile
    names = _launch_names(f, device, a, b)
    with tx.profile() as prof:
        for _ in range(2):
            out = f(a, b)
    np.testing.assert_allclose(np.asarray(out), np.sum(np.tanh(a @ b) * 2 + 1, axis=1), rtol=1e-4, atol=1e-4)
    assert [r.info.name for r in prof.records] == names * 2
    assert all(r.end_ns >= r.start_ns and r.info.device is device for r in prof.records)
    if getattr(device.backend, "timestamps", False):  # WebGPU: each launch's device start and end
        stamps = [raw[3] for raw in prof._raw]
        assert all(s is not None and 0 <= s.profile.start <= s.profile.end for s in stamps)

    path = prof.export_chrome_trace(str(tmp_path / "trace.json"))
    with open(path) as fh:
        trace = json.load(fh)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(prof.records) == 2 * len(names)
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {processes[e["pid"]] for e in events} == {device.name}
    assert all(e["dur"] >= 0 and isinstance(e["ts"], float) for e in events)

    f(a, b)  # outside the block: not recorded
    assert len(prof.records) == 2 * len(names) and profiler.active is None


def test_summary_shares_add_to_100_and_the_matmul_flops_are_counted(device):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((M, KD)).astype(np.float32), rng.standard_normal((KD, N)).astype(np.float32)
    f = tx.jit(_model)
    f(a, b)
    with tx.profile() as prof:
        f(a, b)
        tx.device_put(a, device) * 3.0  # an eager launch counts too
    rows = prof.rows()
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert [r["seconds"] for r in rows] == sorted((r["seconds"] for r in rows), reverse=True)
    assert sum(r["calls"] for r in rows) == len(prof.records)
    text = prof.summary()
    lines = text.splitlines()
    assert lines[0].split()[:5] == ["kernel", "device", "calls", "total", "ms"]
    share_col = lines[0].index("share %")
    shares = [float(ln[share_col:].split()[0]) for ln in lines[2:2 + len(rows)]]
    assert sum(shares) == pytest.approx(100.0, abs=0.05 * len(rows) + 0.01)
    # the matmul: 2·M·N·K FLOPs (and its epilogue's), as a kernel, a GEMM template or an equation
    dots = [r for r in prof.records if {"dot_general", "fused_gemm"} & {e.prim.name for e in r.info.eqns}]
    assert dots and dots[0].info.flops >= 2 * M * N * KD
    assert all(r.info.bytes > 0 for r in prof.records)


def test_kernel_cost_counts_reduction_ops_per_reduction_point():
    f32 = np.dtype(np.float32)
    # out[i, j] = Σ_k a[i, k] b[k, j] + 1: 2K ops per point under the reduction, 1 after it
    a = K.load(0, K.affine((KD, 0), 0, (1,)), f32)
    b = K.load(1, K.affine((0, 1), 0, (N,)), f32)
    value = K.binary("add", K.reduce("sum", K.binary("mul", a, b)), K.const(1.0, f32))
    k = K.Kernel("mm", (K.Buffer("a", f32, M * KD), K.Buffer("b", f32, KD * N), K.Buffer("c", f32, M * N)),
                 2, (M, N), (KD,), (K.Store(2, K.affine((N, 1)), value),))
    flops, nbytes = profiler.kernel_cost(k)
    assert flops == M * N * (2 * KD + 1)
    assert nbytes == 4 * (M * KD + KD * N + M * N)  # each buffer once: the compulsory traffic


def test_roofline_plot(tmp_path):
    pytest.importorskip("matplotlib")
    x = np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32)
    f = tx.jit(lambda a: tnp.tanh(a @ a), device="cpu" if tx.devices("cpu") else "ref")
    f(x)
    with tx.profile() as prof:
        f(x)
    fig = prof.plot_roofline(str(tmp_path / "roofline.png"))
    assert (tmp_path / "roofline.png").stat().st_size > 0 and fig.axes[0].get_xscale() == "log"
