"""FlashAttention on CUDA is the shared builder (ir/kernel/attention.py, its GPU form) printed by the
NVPTX tile printer (backends/cuda/tile.py). Without a GPU: the dispatcher picks it on an offline
device, forward and backward; its PTX assembles with ptxas for sm_80 and sm_90; and small problems
(causal, masked with -inf bias entries, the backward's three kernels) run in the PTX interpreter
(ptxemu.py) to the primitive's numpy numbers. With a GPU, forward and gradients against numpy."""
from __future__ import annotations

import os
import tempfile
import types

import ml_dtypes
import numpy as np
import pytest
from test_cuda_ptx import ARCHS, _ptxas, assert_assembles, need_ptxas  # one ptxas discovery
from tilefuse.backends.cuda import offline_device, ptx_for
from tilefuse.ir import primitives as P
from tilefuse.ir.core import ShapedArray
from tilefuse.ir.errors import DeviceError
from tilefuse.ir.kernel import lower_region
from tilefuse.ir.kernel.attention import (
    AttentionSchedule,
    build_backward,
    build_forward,
    default_attention_schedule,
    spec_of,
)
from tilefuse.ir.kernel.ir import Buffer
from tilefuse.ir.passes import partition, run_passes
from tilefuse.runtime import dispatch
from tilefuse.runtime.hardware import target_of

import tilefuse as tx
from tilefuse import nn


def _grad_fn(causal):
    def loss(q, k, v, *bias):
        return (nn.dot_product_attention(q, k, v, mask=bias[0] if bias else None, causal=causal) ** 2).sum()
    return tx.grad(loss, argnums=(0, 1, 2))


def _attention_kernels(f, *args):
    graph = run_passes(tx.make_graph(f)(*args))
    return [lk.kernel for region in partition(graph) for lk in lower_region(region)
            if lk.kernel.meta.get("kind") in dispatch.ATTENTION_KINDS]


def test_the_dispatcher_chooses_the_shared_builder_on_an_offline_cuda_device():
    """Attention in float32 and float64, forward and backward, takes the shared FlashAttention."""
    dev = offline_device("sm_90")
    for dtype, want in ((np.float32, "tile_attention"), (np.float64, "tile_attention")):
        q = np.ones((1, 8, 2, 16), dtype)
        kernels = _attention_kernels(_grad_fn(True), q, q, q)
        assert sorted(k.meta["kind"] for k in kernels) == ["fused_attention_bwd", "fused_attention_stats"]
        for kernel in kernels:
            assert dispatch.choose(kernel, dev).name == want, (dtype, kernel.meta["kind"])


@need_ptxas
@pytest.mark.parametrize("arch", ARCHS)
def test_a_bfloat16_forward_takes_the_shared_builder_and_assembles(arch):
    q = np.random.default_rng(0).standard_normal((2, 70, 3, 32)).astype(ml_dtypes.bfloat16)
    f = lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True)
    prog = tx.jit(f).lower(q, q, q, device=offline_device(arch)).compile().program
    assert [(lc.kind, lc.impl) for lc in prog.launches] == [("fused_attention", "tile_attention")]
    (ptx,) = ptx_for(f, q, q, q, sm=arch).values()
    with tempfile.TemporaryDirectory() as tmp:
        r = _ptxas(ptx, arch, os.path.join(tmp, "a.ptx"))
    assert r.returncode == 0, r.stderr[:400]


def _problem(causal, sq=7, sk=9, d=4, dv=5, seed=1):
    """q, k, v, a broadcast bias with a -inf entry (a masked key), the forward and backward
    equations' outputs from the primitives' numpy implementations."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((2, 3, s, f)).astype(np.float32) for s, f in ((sq, d), (sk, d), (sk, dv)))
    bias = rng.standard_normal((1, 3, 1, sk)).astype(np.float32)
    bias[0, 1, 0, 2] = -np.inf
    params = {"scale": 0.5, "causal": causal, "dims": ((0, 1, 2, 3),) * 3}
    (out,) = P.fused_attention.impl(q, k, v, bias, **params)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    (grads,) = P.fused_attention_bwd.impl(q, k, v, bias, out, dout, **params)
    return params, [q, k, v, bias], out, dout, grads


def _tiles(fwd, params, args, n_out, sched=None, device=None):
    """The forward's tile kernel or the backward's three, over flat float32 buffers."""
    avals = [ShapedArray(a.shape, a.dtype) for a in args]
    prim = P.fused_attention if fwd else P.fused_attention_bwd
    sp = spec_of(types.SimpleNamespace(prim=prim, params=params,
                                       inputs=[types.SimpleNamespace(aval=a) for a in avals]))
    if sched is None:
        sched = default_attention_schedule(sp, target_of(device.info))
    bufs = tuple(Buffer(f"b{i}", np.float32, a.size) for i, a in enumerate(args)) + (Buffer("res", np.float32, n_out),)
    return [build_forward(sp, sched, "attn", bufs, len(args))] if fwd else \
        build_backward(sp, sched, "attn_bwd", bufs, len(args))


@need_ptxas
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_and_backward_ptx_assemble_with_ptxas(arch):
    """The default schedules of a sizeable problem (D = 64, ragged sequences), causal or masked."""
    dev = offline_device(arch)
    texts = {}
    for causal in (False, True):
        params, args, out, dout, grads = _problem(causal, sq=100, sk=90, d=64, dv=64)
        for fwd, ins, want in ((True, args, out), (False, args + [out, dout], grads)):
            for n, tk in enumerate(_tiles(fwd, params, ins, want.size, device=dev)):
                ptx = dev.backend.compile_tile(tk, dev).source
                assert f".target {arch}" in ptx and "bar.sync" in ptx and ".shared" in ptx
                texts[f"causal={causal} fwd={fwd} #{n}"] = ptx
    assert_assembles(texts, arch)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_backward_compute_their_numbers_in_a_ptx_interpreter(causal):
    """A ragged schedule (blocks of 4 queries and 4 keys over 7 and 9), a masked key."""
    import ptxemu
    dev = offline_device("sm_80")
    params, args, out, dout, grads = _problem(causal)
    for fwd, ins, want in ((True, args, out), (False, args + [out, dout], grads)):
        bufs = [np.ascontiguousarray(a).reshape(-1) for a in ins] + [np.zeros(want.size, np.float32)]
        for tk in _tiles(fwd, params, ins, want.size, AttentionSchedule(4, 4)):
            run = dev.backend.compile_tile(tk, dev)
            ptxemu.run(run.source, bufs, run.grid, run.block)
        np.testing.assert_allclose(bufs[-1], want.reshape(-1), rtol=2e-5, atol=2e-5,
                                   err_msg="forward" if fwd else "backward")


def test_an_offline_device_compiles_but_does_not_run():
    dev = offline_device("sm_80")
    q = np.ones((1, 8, 2, 16), np.float32)
    f = tx.jit(lambda q: nn.dot_product_attention(q, q, q), device=dev)
    prog = f.lower(q).compile().program
    assert [lc.impl for lc in prog.launches if lc.kind == "fused_attention"] == ["tile_attention"]
    with pytest.raises(DeviceError, match="offline"):
        f(q)


# ---- on a GPU ---------------------------------------------------------------------------------

@pytest.mark.skipif(not any(d.kind == "cuda" for d in tx.devices()), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("causal", [False, True])
def test_on_the_gpu_forward_and_backward_match_numpy(causal):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 70, 3, 32)).astype(np.float32) for _ in range(3))
    f = lambda q, k, v: nn.dot_product_attention(q, k, v, causal=causal)
    np.testing.assert_allclose(np.asarray(tx.jit(f, device="cuda")(q, k, v)),
                               np.asarray(tx.jit(f, device="ref")(q, k, v)), rtol=1e-4, atol=1e-5)
    g = _grad_fn(causal)
    for got, want in zip(tx.jit(g, device="cuda")(q, k, v), tx.jit(g, device="ref")(q, k, v)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
