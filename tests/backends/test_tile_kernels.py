"""Every backend that prints tile kernels runs the shared builders' kernels (ir/kernel/gemm.py)
in every form it can hold, ragged tiles included, and agrees with the `ref` backend: the printer
is tested once per backend for every construct (grid and lane ranges, unrolling, register,
scratch and shared memory, barriers, vectors, 16-bit loads and stores, epilogues)."""
from __future__ import annotations

import numpy as np
import pytest
from gemm_cases import CASES, CONV_CASES, conv_kernel, gemm_kernel

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
    "packed A, ragged": GemmSchedule(False, 5, 1, 4, mc=10, nc=8, pack_a=True),
    "shared, ragged": GemmSchedule(True, 2, 2, 1, tm=4, tn=8, tk=3),
}
ROWS = ["plain", "B transposed", "A transposed", "A transposed, bfloat16", "batched einsum", "epilogue", "bfloat16"]


def _schedule_held(device, schedule: str):
    """The schedule (None: the device's default) when the device can hold its form, else skip."""
    if not device.backend.tile_kernels:
        pytest.skip(f"{device.kind} prints no tile kernels")
    sched = SCHEDULES[schedule]
    if sched is not None and sched.shared and not device.info.local_mem_bytes:
        pytest.skip(f"{device.name} has no shared memory")
    needs = {"shared"} if sched is not None and sched.shared else {"scratch", "vectors"} if sched else set()
    if needs - device.backend.tile_prints:
        pytest.skip(f"{device.kind}'s printer takes no {', '.join(sorted(needs - device.backend.tile_prints))}")
    return sched


def _check_built(device, sched, row, f, args, k, spec, ins):
    """The builder's kernel of spec under sched (None: the default) on the device, against `ref`."""
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


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gemm_tile_kernels_match_the_reference(device, schedule):
    sched = _schedule_held(device, schedule)
    for row in ROWS:
        f, args = CASES[row]
        k, ins = gemm_kernel(f, args)
        _check_built(device, sched, row, f, args, k, gemm_spec(k), ins)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_implicit_gemm_tile_kernels_match_the_reference(device, schedule):
    """Convolutions through the same builder (ir/kernel/conv.py): the patches gathered, vector
    loads along rows, masks at the edges and holes, in every form the device holds."""
    sched = _schedule_held(device, schedule)
    for row, (f, args) in CONV_CASES.items():
        k, spec, ins = conv_kernel(f, args)
        _check_built(device, sched, row, f, args, k, spec, ins)


# ---- cooperative reductions: a work-group per point (GPU targets' long reductions) -------------

def _one_kernel(f, *args):
    from tilefuse.ir.kernel import lower_region
    from tilefuse.ir.passes import partition, run_passes
    (lk,) = [lk for r in partition(run_passes(tx.make_graph(f)(*args))) for lk in lower_region(r)]
    return lk.kernel


_rng = np.random.default_rng(3)
GROUP_CASES = {  # a long sum (blocked: more than BLOCK steps per lane), rows with a stash, max, prod
    "sum of 100k": (lambda x: x.sum(), np.full(100_000, 0.1, np.float32)),
    "softmax rows": (lambda x: tx.nn.softmax(x, axis=-1), _rng.standard_normal((3, 700)).astype(np.float32) * 4),
    "layer norm rows": (lambda x: (x - x.mean(-1, keepdims=True)) / (x.var(-1, keepdims=True) + 1e-5) ** 0.5,
                        _rng.standard_normal((2, 1000)).astype(np.float32) + 3),
    "max over axes 0, 2": (lambda x: x.max(axis=(0, 2)), _rng.standard_normal((30, 3, 40)).astype(np.float32)),
    "ragged prod": (lambda x: x.prod(axis=1), 1 + _rng.standard_normal((2, 777)).astype(np.float32) * 1e-3),
    "argmax with ties and NaN": (lambda x: x.argmax(axis=1), np.where(np.arange(1200) % 97 == 5, np.float32(9),
                                 _rng.standard_normal((3, 1200))).astype(np.float32) *
                                 np.float32([[1], [1], [np.nan]])),
    "argmin": (lambda x: x.argmin(axis=0), _rng.standard_normal((900, 2)).astype(np.float32)),
}


@pytest.mark.parametrize("case", GROUP_CASES)
@pytest.mark.parametrize("group", [1, 8, 64])
def test_group_reductions_match_the_reference(device, case, group):
    from tilefuse.ir.kernel.schedule import Schedule, schedule
    if not device.backend.tile_kernels or "shared" not in device.backend.tile_prints or not device.info.local_mem_bytes:
        pytest.skip(f"{device.name} runs no work-group of shared memory from the tile printer")
    f, x = GROUP_CASES[case]
    k = _one_kernel(f, x)
    if group > device.info.max_work_group:
        pytest.skip(f"{device.name} holds work-groups of at most {device.info.max_work_group}")
    tk = schedule(k, target_of(device.info), Schedule(group, 1, reduce_group=group) if group > 1 else None)
    run = device.backend.compile_tile(tk, device)
    out = k.buffers[-1]
    bufs = [device.backend.put(x.reshape(-1), device), device.backend.put(np.zeros(out.size, out.dtype), device)]
    run(bufs)
    got = device.backend.to_host(bufs[1], ShapedArray((out.size,), out.dtype), device)
    want = np.asarray(f(x.astype(np.float64)) if case != "softmax rows" else
                      np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
    # atol: float32 rounding of outputs near 0 whose inputs are near 1 (4-wide vectors: 1.2e-6)
    np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-5, atol=2e-6, err_msg=f"{case}, groups of {group}")


# ---- FlashAttention's tile kernels (ir/kernel/attention.py) on every printer, in both forms ---------

def _run_attention_kernels(device, sched, params, q, k, v, bias, stats: bool, check: bool = False):
    """The builders' forward, then backward kernels under `sched`, run on `device` against the
    primitives' references: the output, the rows' statistics where `stats` (the forward as
    fused_attention_stats, its statistics, as the device wrote them, read by the backward), and
    dq, dk, dv packed. check: the schedule must fit the device's target."""
    import types

    from tilefuse.ir import primitives as P
    from tilefuse.ir.kernel.attention import build_backward, build_forward, spec_of
    from tilefuse.ir.kernel.ir import Buffer
    rng = np.random.default_rng(3)
    ops = [q, k, v] + ([] if bias is None else [bias])
    fprim = P.fused_attention_stats if stats else P.fused_attention
    wants = fprim.impl(*ops, **params)
    out = wants[0]
    dout = rng.standard_normal(out.shape).astype(np.float32)
    (grads,) = P.fused_attention_bwd.impl(*ops, out, dout, **params)

    def run(prim, prim_params, args, wants):
        avals = [ShapedArray(a.shape, a.dtype) for a in args]
        sp = spec_of(types.SimpleNamespace(prim=prim, params=prim_params,
                                           inputs=[types.SimpleNamespace(aval=a) for a in avals]))
        assert not check or sched.check(sp, target_of(device.info)) is None
        bufs = tuple(Buffer(f"b{i}", a.dtype, a.size) for i, a in enumerate(args)) + \
            tuple(Buffer(f"res{i}", w.dtype, w.size) for i, w in enumerate(wants))
        tks = build_backward(sp, sched, "attn_bwd", bufs, len(args)) if sp.bwd else \
            [build_forward(sp, sched, "attn", bufs, len(args))]
        dev_bufs = [device.backend.put(np.ascontiguousarray(a).reshape(-1), device) for a in args]
        res = [device.backend.put(np.full(w.size, np.nan, w.dtype), device) for w in wants]
        for tk in tks:
            device.backend.compile_tile(tk, device)(dev_bufs + res)
        gots = [device.backend.to_host(r, ShapedArray((w.size,), w.dtype), device).reshape(w.shape)
                for r, w in zip(res, wants)]
        for what, got, want in zip(("backward",) if sp.bwd else ("output", "statistics"), gots, wants):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"{what}, stats={stats}")
        return gots
    fwd = run(fprim, params, ops, wants)
    if stats:
        run(P.fused_attention_bwd, {**params, "stats": True}, [*ops, out, dout, fwd[1]], [grads])
    else:
        run(P.fused_attention_bwd, params, [*ops, out, dout], [grads])


@pytest.mark.parametrize("stats", [False, True], ids=["recomputed", "stats"])
@pytest.mark.parametrize("form", ["gpu", "cpu"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_tile_kernels_match_the_primitive(device, causal, form, stats):
    """The forward and the three backward kernels printed and run by each backend in each form it
    can hold (the GPU form on OpenCL CPU devices too: PoCL has local memory), ragged schedules, a
    broadcast bias with -inf entries (gathered along the keys by the CPU form); the backward's row
    statistics recomputed, or the forward's read (fused_attention_stats)."""
    from tilefuse.ir.kernel.attention import AttentionSchedule
    needs = {"shared"} if form == "gpu" else {"scratch", "vectors"}
    if not device.backend.tile_kernels or needs - device.backend.tile_prints:
        pytest.skip(f"{device.kind} prints no tile kernels with {', '.join(sorted(needs))}")
    if form == "gpu" and not device.info.local_mem_bytes:
        pytest.skip(f"{device.name} has no shared memory")
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, s, f)).astype(np.float32) for s, f in ((7, 4), (9, 4), (9, 5)))
    bias = rng.standard_normal((1, 3, 1, 9)).astype(np.float32)
    bias[0, 1, 0, 2] = -np.inf
    params = dict(scale=0.5, causal=causal, dims=((0, 1, 2, 3),) * 3)
    sched = AttentionSchedule(4, 4) if form == "gpu" else AttentionSchedule(4, 8, 4, 2, 2)
    _run_attention_kernels(device, sched, params, q, k, v, bias, stats)


@pytest.mark.parametrize("stats", [False, True], ids=["recomputed", "stats"])
@pytest.mark.parametrize("lengths", [(37, 70, 20), (70, 37, 20), (48, 70, 32)],
                         ids=["Sq<Sk", "Sq>Sk", "whole query blocks"])
@pytest.mark.parametrize("per_head", [False, True])
def test_attention_cpu_form_masks_are_exact(device, lengths, per_head, stats):
    """The CPU form's masks as printed (one 32-bit compare of the lanes with a bound per row, or per
    key in the backward's transposed scores): causal with Sq != Sk (rows that see no key when
    Sq > Sk), sequences that are not multiples of the blocks, full 16-lane vectors and a key block
    cut by the diagonal in the middle of a vector; masked scores never reach exp (exactly 0); whole
    query blocks and features (the backward's q, do and dq rows used in place); the backward's
    statistics recomputed or the forward's."""
    from tilefuse.ir.kernel.attention import AttentionSchedule
    if not device.backend.tile_kernels or {"scratch", "vectors"} - device.backend.tile_prints:
        pytest.skip(f"{device.kind} prints no tile kernels with scratch and vectors")
    sq, sk, d = lengths
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, s, 3, f)).astype(np.float32) for s, f in ((sq, d), (sk, d), (sk, 16)))
    params = dict(scale=0.3, causal=True, dims=((0, 2, 1, 3),) * 3)
    _run_attention_kernels(device, AttentionSchedule(16, 32, 16, 4, 2, per_head), params, q, k, v, None, stats,
                           check=True)
