"""The CUDA backend end to end without a GPU: programs jitted for an emulated CUDA device
(ptxemu.emulated_device: the backend's pool, copies and launches, its PTX run by the interpreter)
against the ref backend. Control flow as loop kernels, training gradients, the shared GEMM (its
warp-MMA form for 16-bit operands) and FlashAttention (forward and backward) as the dispatcher
picks them. Small programs: the interpreter runs a launch's threads as numpy arrays, far from a GPU's
speed."""
from __future__ import annotations

import numpy as np
import pytest
from ptxemu import emulated_device
from test_cuda_ptx import PROGRAMS
from tilefuse.tracer.pytree import tree_leaves

import tilefuse as tx
from tilefuse import nn

R = np.random.default_rng(0)
F16 = np.float16


def u(*shape, dtype=np.float32):
    return R.uniform(-1, 1, shape).astype(dtype)


def _attention_grad(q, k, v):
    return tx.grad(lambda q, k, v: (nn.dot_product_attention(q, k, v, causal=True) ** 2).sum(),
                   argnums=(0, 1, 2))(q, k, v)


# name -> (function, arguments, the implementation the dispatcher must pick for some launch)
CASES = {
    "scan": (*PROGRAMS["scan_p"], None),
    "while_loop": (*PROGRAMS["while_p"], None),
    "cond": (*PROGRAMS["cond_p"], None),
    "layer norm": (*PROGRAMS["layernorm"], "kernel_ir"),
    "mlp value and grad": (*PROGRAMS["mlp forward+backward"], "kernel_ir"),
    "embedding gradient": (lambda t, i: tx.grad(lambda t: (t[i] ** 2).sum())(t),
                           (u(10, 4), np.array([1, 3, 3, 7], np.int32)), "kernel_ir"),
    "f16 GEMM on tensor cores": (lambda a, b: a @ b, (u(70, 64, dtype=F16), u(64, 60, dtype=F16)), "tile_gemm"),
    "f32 GEMM + bias + gelu": (lambda x, w, b: nn.gelu(x @ w + b), (u(70, 64), u(64, 60), u(60)), "tile_gemm"),
    "causal attention gradient": (_attention_grad, (u(1, 9, 2, 8), u(1, 9, 2, 8), u(1, 9, 2, 8)), "tile_attention"),
}


@pytest.fixture(scope="module")
def emu():
    return emulated_device("sm_80")


@pytest.mark.parametrize("name", CASES)
def test_programs_match_the_reference_on_an_emulated_cuda_device(emu, name):
    fn, args, impl = CASES[name]
    if impl is not None:
        prog = tx.jit(fn, device=emu).lower(*args).compile().program
        assert impl in {lc.impl for lc in prog.launches}, name
    got = tree_leaves(tx.jit(fn, device=emu)(*args))
    want = tree_leaves(tx.jit(fn, device="ref")(*args))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        w = np.asarray(w)
        tol = 2e-3 if w.dtype == F16 else 1e-5
        np.testing.assert_allclose(np.asarray(g, np.float64), w.astype(np.float64), rtol=tol, atol=tol, err_msg=name)


# float64 functions the GPU computes through float32 (backends/cuda/render.F64_VIA_F32: no libdevice)
VIA_F32 = {f"{f}-float64" for f in ("log1p", "expm1", "tanh", "sin", "cos", "erf")} | {"elementwise chain-float64"}


SHARDS = 12  # the table in twelve tests, so that the suite's workers share it


@pytest.mark.parametrize("shard", range(SHARDS))
def test_the_validation_table_passes_on_an_emulated_cuda_device(emu, shard):
    """`python -m tilefuse.validate`'s cases (every primitive, fusion, GEMM and attention form) on
    the emulated device, every SHARDS-th from `shard`; the float64 functions computed through
    float32 within 1e-7."""
    import tilefuse.validate as V
    failed = {}
    for case in V.cases()[shard::SHARDS]:
        if case.runs_on(emu):
            out = V.evaluate(case, emu)
            if not out.ok and "is unavailable" not in out.message:  # (a case that names its device)
                failed[case.id] = out
    assert {k for k, o in failed.items() if k not in VIA_F32 or o.max_error > 1e-7} == set(), \
        {k: o.message for k, o in failed.items()}
