"""The CUDA FlashAttention template (backends/cuda/attention.py) without a GPU: its forward and
backward PTX for several configurations assembled by ptxas for sm_80 and sm_90; the same
algorithm rendered for the host (threads as Python threads, the barrier a callback) against the
float64 numpy reference; the dispatcher's choice on an offline device; block sizes and launches
against DeviceInfo values. With a GPU (tests/gpu/run_on_device.sh), the kernels themselves
against numpy."""
from __future__ import annotations

import ctypes
import math
import os
import tempfile
import threading
from types import SimpleNamespace

import llvmlite.binding as llvm
import numpy as np
import pytest
from test_cuda_ptx import ARCHS, _ptxas, need_ptxas  # one ptxas discovery
from tilefuse.backends.cuda import attention as A
from tilefuse.backends.cuda import device_info, offline_device, ptx_for
from tilefuse.ir import primitives as P
from tilefuse.ir.core import ShapedArray
from tilefuse.ir.errors import DeviceError
from tilefuse.ir.kernel import lower_region
from tilefuse.ir.passes import partition, run_passes
from tilefuse.runtime import dispatch, tuner
from tilefuse.tracer.core import bind1

import tilefuse as tx
from tilefuse import nn

BSHD, BHSD = (0, 2, 1, 3), (0, 1, 2, 3)


def _case(rng, layout, b, h, sq, sk, d, dv, causal, bias_shape=None, masked=False):
    """Operands in `layout`, the bias random, or -inf where a random mask is False with one
    query masked entirely."""
    shape = (lambda s, n: (b, s, h, n)) if layout == BSHD else (lambda s, n: (b, h, s, n))
    q, k, v = (rng.standard_normal(shape(s, n)).astype(np.float32)
               for s, n in ((sq, d), (sk, d), (sk, dv)))
    bias = ()
    if bias_shape is not None:
        x = rng.standard_normal(bias_shape).astype(np.float32)
        if masked:
            x = np.where(rng.random(bias_shape) > 0.4, 0.0, -np.inf).astype(np.float32)
            x[..., 3, :] = -np.inf
        bias = (x,)
    return (q, k, v, *bias), dict(scale=1 / math.sqrt(d), causal=causal, dims=(layout,) * 3)


CASES = {
    "causal, bias broadcast over queries, Sq < Sk, D=20, Dv=12": dict(
        layout=BSHD, b=2, h=1, sq=37, sk=45, d=20, dv=12, causal=True, bias_shape=(1, 1, 1, 45)),
    "mask with a fully masked query, S=21": dict(
        layout=BSHD, b=1, h=2, sq=21, sk=21, d=8, dv=8, causal=False, bias_shape=(1, 2, 21, 21),
        masked=True),
    "(B, H, S, D), Sq > Sk, causal": dict(layout=BHSD, b=1, h=2, sq=40, sk=29, d=16, dv=16, causal=True),
}


def _eqn(prim, args, params):
    return SimpleNamespace(prim=prim, inputs=[SimpleNamespace(aval=ShapedArray(x.shape, x.dtype)) for x in args],
                           params=params)


# ---- the algorithm on the host ------------------------------------------------------------------

def _emulate(sp, p, buffers):
    """Run the template's kernels rendered for the host: each block's threads as Python threads
    (ctypes releases the GIL), the barrier a threading.Barrier."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    mod = llvm.parse_assembly(A.render(sp, p, "emu", host=True))
    mod.verify()
    engine = llvm.create_mcjit_compiler(mod, llvm.Target.from_default_triple().create_target_machine())
    engine.finalize_object()
    shared = np.zeros(p.shared_floats(sp), np.float32)
    ptrs = [b.ctypes.data for b in buffers]
    for suffix, grid, block in A.launches(sp, p):
        proto = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * len(ptrs), ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_void_p, ctypes.c_void_p)
        fn = proto(engine.get_function_address("emu" + suffix))
        for blk in range(grid):
            bar = threading.Barrier(block)
            wait = ctypes.CFUNCTYPE(None)(lambda bar=bar: (bar.wait(), None)[1])
            threads = [threading.Thread(target=fn, args=(*ptrs, blk, t, shared.ctypes.data,
                                                         ctypes.cast(wait, ctypes.c_void_p)))
                       for t in range(block)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()


def test_the_algorithm_matches_numpy_on_the_host():
    """Forward and backward of every case, with blocks small enough that every kernel loops
    over several tiles and ends on a partial one (tiles shorter and longer than the blocks)."""
    rng = np.random.default_rng(0)
    for name, c in CASES.items():
        args, params = _case(rng, **c)
        x64 = [x.astype(np.float64) for x in args]
        (want,) = P.fused_attention.impl(*x64, **params)
        g = rng.standard_normal(want.shape).astype(np.float32)
        (dwant,) = P.fused_attention_bwd.impl(*x64, want, g.astype(np.float64), **params)
        bw_args = (*args, np.ascontiguousarray(want, np.float32), g)
        sp = A.spec_of(_eqn(P.fused_attention_bwd, bw_args, params))
        for p in (A.AttentionParams(threads=16, tile=8), A.AttentionParams(threads=8, tile=16)):
            out = np.zeros(want.shape, np.float32)
            _emulate(A.spec_of(_eqn(P.fused_attention, args, params)), p, [*args, out])
            np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5, err_msg=f"{name} {p}")
            packed = np.zeros(dwant.shape, np.float32)
            ws = np.zeros(2 * sp.nb * sp.sq, np.float32)
            _emulate(sp, p, [*bw_args, packed, ws])
            np.testing.assert_allclose(packed, dwant, rtol=1e-4, atol=1e-4, err_msg=f"{name} {p}")


# ---- PTX ------------------------------------------------------------------------------------------

PTX_CASES = {  # (shape (B, S, H, D), Sk, causal, bias shape): D 32 and 64, S not a multiple of the blocks
    "causal D=64 S=100": ((1, 100, 2, 64), 100, True, None),
    "bias D=32 Sq=70 Sk=90": ((2, 70, 2, 32), 90, False, (2, 2, 70, 90)),
    "causal, key bias D=64 S=33": ((1, 33, 1, 64), 33, True, (1, 1, 1, 33)),
}


def _grad_fn(causal):
    def loss(q, k, v, *bias):
        return (nn.dot_product_attention(q, k, v, mask=bias[0] if bias else None, causal=causal) ** 2).sum()
    return tx.grad(loss, argnums=(0, 1, 2))


@need_ptxas
def test_forward_and_backward_ptx_assemble_for_sm80_and_sm90():
    rng = np.random.default_rng(1)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (shape, sk, causal, bias_shape) in PTX_CASES.items():
            q = rng.standard_normal(shape).astype(np.float32)
            k = rng.standard_normal((shape[0], sk, *shape[2:])).astype(np.float32)
            bias = () if bias_shape is None else (rng.standard_normal(bias_shape).astype(np.float32),)
            for arch in ARCHS:
                srcs = ptx_for(_grad_fn(causal), q, k, k, *bias, sm=arch)
                attn = {n: t for n, t in srcs.items() if "tf_attn_" in t}
                assert sorted(attn) == ["fused_attention", "fused_attention_bwd"], \
                    (name, sorted(srcs))
                for n, text in attn.items():
                    assert f".target {arch}" in text and "bar.sync" in text and ".shared" in text, (name, n)
                    assert text.count(".entry") == (2 if "bwd" in n else 1), (name, n)
                    r = _ptxas(text, arch, os.path.join(tmp, "a.ptx"))
                    if r.returncode:
                        failures.append(f"{name} {arch} {n}: {r.stderr.strip()[:400]}")
    assert not failures, "\n".join(failures)


# ---- the dispatcher ---------------------------------------------------------------------------------

def _template_kernels(f, *args):
    graph = run_passes(tx.make_graph(f)(*args))
    return [lk.kernel for region in partition(graph) for lk in lower_region(region)
            if lk.kernel.meta.get("kind") in dispatch.TEMPLATE_KINDS]


def test_dispatcher_chooses_the_template_on_an_offline_cuda_device():
    """float32 attention gets the CUDA template, forward and backward; float64 and heads wider
    than 128, which it does not take, the composite."""
    dev = offline_device("sm_90")
    cases = ((np.float32, 16, "flash_attention"), (np.float64, 16, "composite"),
             (np.float32, 160, "composite"))
    for dtype, d, want in cases:
        q = np.ones((1, 8, 2, d), dtype)
        kernels = _template_kernels(_grad_fn(True), q, q, q)
        assert sorted(k.meta["kind"] for k in kernels) == ["fused_attention", "fused_attention_bwd"]
        for kernel in kernels:
            impl = dispatch.choose(kernel, dev)
            assert impl.name == want, (dtype, d, impl)
            assert impl.device_kinds == (("cuda",) if want == "flash_attention" else ("*",)), impl


def test_the_tuner_sees_the_template_and_its_constraints():
    dev = offline_device("sm_90")
    q = np.ones((1, 40, 2, 16), np.float32)
    (fwd, bwd) = sorted(_template_kernels(_grad_fn(True), q, q, q), key=lambda k: k.meta["kind"])
    t = tuner.template_for("flash_attention", fwd, dev)
    assert t is not None and t.name == "cuda_attention"
    assert t.default(fwd, dev) == {"threads": 32, "tile": 32}  # 2 blocks: one warp each
    assert t.key(fwd) == ("cuda-attention-fwd-causal", "2x64x64/16x16")
    assert t.key(bwd)[0] == "cuda-attention-bwd-causal"
    assert t.check({"threads": 48, "tile": 8}, fwd, dev) is not None
    assert t.check({"threads": 128, "tile": 64}, bwd, dev) is not None  # over 48 KiB
    run = t.build(bwd, dev, dev.backend, {"threads": 64, "tile": 16})
    assert run.source.count(".entry") == 2 and ".target sm_90" in run.source


def test_an_offline_device_compiles_but_does_not_run():
    dev = offline_device("sm_80")
    q = np.ones((1, 8, 2, 16), np.float32)
    f = tx.jit(lambda q: nn.dot_product_attention(q, q, q), device=dev)
    srcs = f.lower(q).sources()
    assert any("tf_attn_" in t and ".target sm_80" in t for n, t in srcs.items() if n.endswith(".cuda"))
    with pytest.raises(DeviceError, match="offline"):
        f(q)


# ---- block sizes and launches against DeviceInfo values ----------------------------------------------

# an H200: 132 SMs, 1024 threads per block, 48 KiB of static shared memory per block (of 228 per SM)
H200 = device_info("NVIDIA H200", (9, 0), 132, max_threads_per_block=1024, shared_per_block=48 << 10)


def _spec(bwd, sq, sk, d, dv, nb=32, causal=False, bias=False):
    return A.Spec(bwd, (nb,), sq, sk, d, dv, 0.125, causal, bias, ((sq * d,), (sk * d,), (sk * dv,),
                  (sq * dv,), (0,)), (d, d, dv, dv), (0, 1 if bias else 0), (nb * sq * d, nb * sk * d))


def test_block_sizes_fit_the_shared_memory_per_block():
    fwd64, bwd64, bwd128 = _spec(False, 1024, 1024, 64, 64), _spec(True, 1024, 1024, 64, 64), \
        _spec(True, 1024, 1024, 128, 128, bias=True)
    assert A.default_params(H200, fwd64) == A.AttentionParams(64, 32)  # 4 x (Q 64x65 + K, V 32x64 + P 64x33)
    assert A.AttentionParams(64, 32).shared_floats(fwd64) == 64 * 65 + 2 * 32 * 64 + 64 * 33
    # dK/dV: K, V (64x65 each) and P, dS (64 x (tile + 1) each) owned by the threads; tile 16
    # would take 4 x (8320 + 2 x 16x64 + 2 x 16 + 2 x 64x17) = 50304 bytes, over 48 KiB
    assert A.default_params(H200, bwd64) == A.AttentionParams(64, 8)
    assert 4 * A.AttentionParams(64, 16).shared_floats(bwd64) == 50304
    p = A.default_params(H200, bwd128)
    assert p is not None and 4 * p.shared_floats(bwd128) <= 48 << 10 and p.threads % 32 == 0
    tiny = device_info("tiny", (8, 0), 1, shared_per_block=4 << 10)
    assert A.default_params(tiny, bwd128) is None  # nothing fits: the composite runs instead
    assert "threads" in A.AttentionParams(48, 8).check(H200, fwd64)  # not whole warps
    assert "at most 1024" in A.AttentionParams(2048, 8).check(H200, fwd64)


def test_launches_cover_every_row_of_every_head():
    sp = _spec(False, 1000, 1000, 64, 64, nb=32)
    assert A.launches(sp, A.AttentionParams(64, 32)) == [("", 32 * 16, 64)]  # ceil(1000 / 64) = 16
    bw = _spec(True, 100, 300, 64, 64, nb=4)
    assert A.launches(bw, A.AttentionParams(64, 16)) == [("_dq", 4 * 2, 64), ("_dkdv", 4 * 5, 64)]


def test_small_problems_get_blocks_of_one_warp_to_reach_every_sm():
    small = _spec(False, 100, 100, 64, 64, nb=16)  # 16 x ceil(100 / 64) = 32 blocks of 64 < 132 SMs
    assert A.default_params(H200, small) == A.AttentionParams(32, 32)
    assert A.launches(small, A.default_params(H200, small)) == [("", 16 * 4, 32)]
    biased = _spec(False, 150, 150, 64, 64, nb=3, bias=True)
    assert A.default_params(H200, biased) == A.AttentionParams(32, 32)  # 64 threads would need tile 16
    assert A.fit(H200, biased, A.AttentionParams(64, 32)) == A.AttentionParams(64, 16)
    large = _spec(False, 1024, 1024, 64, 64, nb=16)  # 256 blocks of 64
    assert A.default_params(H200, large) == A.AttentionParams(64, 32)
    a100 = device_info("A100", (8, 0), 108)
    assert A.default_params(a100, _spec(True, 512, 512, 64, 64, nb=12)).threads == 32  # 96 blocks < 108 SMs


# ---- on a GPU ----------------------------------------------------------------------------------------

def _gpu():
    try:
        return next(d for d in tx.devices() if d.kind == "cuda")
    except (StopIteration, DeviceError):
        pytest.skip("no CUDA GPU (these run on the GPU machine: tests/gpu/run_on_device.sh)")


def _weighted_loss(g, params):
    def loss(*args):
        out = bind1(P.fused_attention, *args, **params)
        return (out * g).sum(), out
    return loss


def test_on_the_gpu_forward_and_backward_match_numpy():
    dev = _gpu()
    rng = np.random.default_rng(2)
    cases = {**CASES, "(B, S, H, D) D=64 S=300 causal": dict(layout=BSHD, b=2, h=4, sq=300, sk=300, d=64,
                                                             dv=64, causal=True)}
    for name, c in cases.items():
        args, params = _case(rng, **c)
        (want,) = P.fused_attention.impl(*(x.astype(np.float64) for x in args), **params)
        g = rng.standard_normal(want.shape).astype(np.float32)

        f = tx.jit(tx.value_and_grad(_weighted_loss(g, params), argnums=(0, 1, 2), has_aux=True),
                   device=dev)
        (_, out), grads = f(*args)
        impls = {lc.kind: lc.impl for lc in f.lower(*args).compile().program.launches}
        assert impls["fused_attention"] == impls["fused_attention_bwd"] == "flash_attention", impls
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4, err_msg=name)
        x64 = [x.astype(np.float64) for x in args]
        (packed,) = P.fused_attention_bwd.impl(*x64, want, g.astype(np.float64), **params)
        q, k = args[:2]
        for n, got, w, x in zip("qkv", grads, np.split(packed, [q.size, q.size + k.size]), args):
            np.testing.assert_allclose(np.asarray(got), w.reshape(x.shape), rtol=1e-3, atol=1e-4,
                                       err_msg=f"{name}: d{n}")
