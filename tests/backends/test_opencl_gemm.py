"""The shared GEMM on OpenCL (ir/kernel/gemm.py, printed by backends/cstyle.py) and the batched-GEMM view of dot_general
it reads (ir/kernel/matmul.py): every layout against numpy, both tile variants."""
from __future__ import annotations

import numpy as np
import pytest

import tilefuse as tx
from tilefuse.runtime.tiled import MIN_FLOPS
import tilefuse.numpy as tnp
from tilefuse.ir.errors import DeviceError
from tilefuse.ir.kernel.matmul import matmul_layout

# (lhs shape, rhs shape, einsum): plain, transposed operands, batched, attention's layouts, edges
CASES = [((64, 64), (64, 64), "ij,jk->ik"), ((100, 37), (37, 129), "ij,jk->ik"),
         ((37, 100), (37, 129), "ji,jk->ik"), ((100, 37), (129, 37), "ij,kj->ik"),
         ((37, 100), (129, 37), "ji,kj->ik"), ((3, 50, 40), (3, 40, 70), "bij,bjk->bik"),
         ((2, 3, 65, 16), (2, 3, 70, 16), "bhqd,bhkd->bhqk"), ((67, 131), (131, 1), "ij,jk->ik"),
         ((1, 300), (300, 301), "ij,jk->ik")]


def _opencl():
    try:
        return next(d for d in tx.devices() if d.kind == "opencl")
    except (StopIteration, DeviceError):
        pytest.skip("no OpenCL device")


def _eqn(f, *args):
    g = tx.make_graph(f)(*args)
    return next(e for e in g.eqns if e.prim.name == "dot_general")


def test_matmul_layout_reads_operands_in_place():
    rng = np.random.default_rng(0)
    for sa, sb, spec in CASES + [((2, 65, 3, 16), (2, 70, 3, 16), "bqhd,bkhd->bhqk")]:
        a, b = rng.standard_normal(sa, np.float32), rng.standard_normal(sb, np.float32)
        lay = matmul_layout(_eqn(lambda a, b: tnp.einsum(spec, a, b), a, b))
        want = np.einsum(spec, a, b).reshape(-1)
        if spec == "bqhd,bkhd->bhqk":  # heads between the free axes: no strided-GEMM view
            assert lay is None
            continue
        fa, fb = a.reshape(-1), b.reshape(-1)
        got = np.zeros((lay.batch, lay.m, lay.n), np.float32)
        for z in range(lay.batch):
            A = np.lib.stride_tricks.as_strided(fa[z * lay.a_strides[0]:], (lay.m, lay.k),
                                                (lay.a_strides[1] * 4, lay.a_strides[2] * 4))
            B = np.lib.stride_tricks.as_strided(fb[z * lay.b_strides[0]:], (lay.k, lay.n),
                                                (lay.b_strides[1] * 4, lay.b_strides[2] * 4))
            got[z] = A @ B
        np.testing.assert_allclose(got.reshape(-1), want, rtol=1e-4, atol=1e-4)


def test_opencl_gemm_matches_numpy():
    """The shared GEMM (ir/kernel/gemm.py, printed as OpenCL C) over every layout CASES holds."""
    dev = _opencl()
    rng = np.random.default_rng(1)
    for sa, sb, spec in CASES:
        a, b = rng.standard_normal(sa, np.float32), rng.standard_normal(sb, np.float32)
        f = tx.jit(lambda a, b: tnp.einsum(spec, a, b), device=dev)
        launches = f.lower(a, b).compile().program.launches
        if matmul_layout(_eqn(lambda a, b: tnp.einsum(spec, a, b), a, b)).flops >= MIN_FLOPS:
            assert [l.impl for l in launches if l.kind == "dot_general"] == ["tile_gemm"], spec
        np.testing.assert_allclose(np.asarray(f(a, b)), np.einsum(spec, a, b), rtol=1e-4, atol=1e-4,
                                   err_msg=f"{spec} {sa} {sb}")


@pytest.mark.parametrize("form", ["plain", "B transposed", "both transposed"])
def test_fused_epilogue_runs_in_the_store(form):
    """gelu(x·w + b) + r with the operands read in place: one tile_gemm launch whose store
    applies the bias, the activation and the residual (ragged edges: 101 x 37 with K = 45 leave
    partial tiles and vectors)."""
    import math

    from tilefuse import nn
    dev = _opencl()
    rng = np.random.default_rng(2)
    m, n, k = 101, 37, 45
    b, r = rng.standard_normal(n, np.float32), rng.standard_normal((m, n), np.float32)
    x = rng.standard_normal((k, m) if form == "both transposed" else (m, k), np.float32)
    w = rng.standard_normal((k, n) if form == "plain" else (n, k), np.float32)
    lhs = (lambda x: x.T) if form == "both transposed" else (lambda x: x)
    rhs = (lambda w: w) if form == "plain" else (lambda w: w.T)
    f = tx.jit(lambda x, w, b, r: nn.gelu(tnp.matmul(lhs(x), rhs(w)) + b) + r, device=dev)
    launches = f.lower(x, w, b, r).compile().program.launches
    assert [l.impl for l in launches] == ["tile_gemm"] and launches[0].kind == "fused_gemm"
    y = lhs(x) @ rhs(w) + b
    want = 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3))) + r
    np.testing.assert_allclose(np.asarray(f(x, w, b, r)), want, rtol=1e-4, atol=1e-4)


def test_kernels_share_one_workspace(monkeypatch):
    """The packed GEMM's panels live in scratch memory: one workspace a device, grown to the
    largest kernel's need and shared by every kernel (its in-order queue runs one at a time),
    so GEMMs of several shapes, launched in turn and each at its own batch size, compute right."""
    dev = _opencl()
    if dev.backend.info_of(dev).extra.get("device_type") != "cpu":
        pytest.skip("the packed (scratch) form runs on CPU devices")
    st = dev.backend._state(dev)
    real, given = type(st).workspace, {}

    def workspace(self, nbytes):
        ws = real(self, nbytes)
        given[id(ws)] = ws
        assert ws.nbytes >= nbytes
        return ws
    monkeypatch.setattr(type(st), "workspace", workspace)
    rng = np.random.default_rng(2)
    f = tx.jit(lambda a, b: a @ b, device=dev)
    shapes = [((40, 64), (64, 48)), ((700, 300), (300, 200)), ((33, 64), (64, 48)), ((5, 300), (300, 200))]
    args = [(rng.standard_normal(sa, np.float32), rng.standard_normal(sb, np.float32)) for sa, sb in shapes]
    for _ in range(2):
        for a, b in args:
            np.testing.assert_allclose(np.asarray(f(a, b)), a @ b, rtol=1e-4, atol=1e-3)
    assert 1 <= len(given) <= 2, f"{len(given)} workspaces for {len(shapes)} GEMMs"
