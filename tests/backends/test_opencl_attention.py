"""FlashAttention on OpenCL through the dispatcher: the shared tile builders (ir/kernel/attention.py,
runtime/tiled.py) for fused_attention and its backward against the float64 numpy reference (causal
or not, additive and -inf biases, Sq != Sk, head sizes and sequences that are not a multiple of the
vectors or blocks, two layouts), with the device's schedule and with small blocks and narrow
vectors forced; both backward schemes of the CPU form (three kernels, and one per batch index), the
profiler's view of the backward, and the dispatcher's choice. Skips where no OpenCL platform is
present."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from tilefuse.ir import primitives as P
from tilefuse.ir.core import ShapedArray
from tilefuse.ir.errors import DeviceError
from tilefuse.ir.kernel import lower_region
from tilefuse.ir.passes import partition, run_passes
from tilefuse.runtime import dispatch
from tilefuse.tracer.core import bind1

import tilefuse as tx
from tilefuse import nn

BSHD, BHSD = (0, 2, 1, 3), (0, 1, 2, 3)


def _opencl():
    try:
        return next(d for d in tx.devices() if d.kind == "opencl")
    except (StopIteration, DeviceError):
        pytest.skip("no OpenCL device")


def _case(rng, layout, sizes, causal, bias_shape=None, masked=False):
    """Operands in `layout` (BSHD or BHSD) of sizes (B, H, Sq, Sk, D, Dv), and the bias
    (canonical (B, H, Sq, Sk), size-1 axes broadcast): random, or -inf where a random mask is
    False with one query masked entirely."""
    b, h, sq, sk, d, dv = sizes
    shape = (lambda s, n: (b, s, h, n)) if layout == BSHD else (lambda s, n: (b, h, s, n))
    q = rng.standard_normal(shape(sq, d)).astype(np.float32)
    k = rng.standard_normal(shape(sk, d)).astype(np.float32)
    v = rng.standard_normal(shape(sk, dv)).astype(np.float32)
    bias = None
    if bias_shape is not None:
        bias = rng.standard_normal(bias_shape).astype(np.float32)
        if masked:
            bias = np.where(rng.random(bias_shape) > 0.4, 0.0, -np.inf).astype(np.float32)
            bias[..., 3, :] = -np.inf
    params = {"scale": 1 / math.sqrt(d), "causal": causal, "dims": (layout,) * 3}
    return q, k, v, bias, params


# name -> (layout, (B, H, Sq, Sk, D, Dv), causal, bias shape, -inf mask)
CASES = {
    "causal, S=70 (not a multiple of the blocks), D=8": (BSHD, (1, 2, 70, 70, 8, 8), True, None, False),
    "mask with a fully masked query": (BSHD, (1, 2, 70, 70, 8, 8), False, (1, 2, 70, 70), True),
    "bias broadcast over queries, causal, Sq < Sk, D=20, Dv=12": (
        BSHD, (2, 2, 37, 90, 20, 12), True, (1, 2, 1, 90), False),
    "(B, H, S, D), Sq > Sk, several blocks both ways": (BHSD, (1, 2, 150, 130, 64, 64), False, None, False),
}


def _check(case, device, g_rng):
    """jit(value_and_grad) on the device against the float64 reference of the primitive."""
    q, k, v, bias, params = case
    bias = () if bias is None else (bias,)
    out_shape = P.fused_attention.abstract_eval(*(ShapedArray(x.shape, x.dtype) for x in (q, k, v, *bias)),
                                                **params)[0].shape
    g = g_rng.standard_normal(out_shape).astype(np.float32)

    def loss(q, k, v, *bias):
        out = bind1(P.fused_attention, q, k, v, *bias, **params)
        return (out * g).sum(), out
    f = tx.jit(tx.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), device=device)
    (_, out), grads = f(q, k, v, *bias)
    impls = {l.kind: l.impl for l in f.lower(q, k, v, *bias).compile().program.launches}
    assert impls["fused_attention_stats"] == impls["fused_attention_bwd"] == "tile_attention", impls
    x64 = [x.astype(np.float64) for x in (q, k, v, *bias)]
    (want,) = P.fused_attention.impl(*x64, **params)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5)
    (packed,) = P.fused_attention_bwd.impl(*x64, want, g.astype(np.float64), **params)
    parts = np.split(packed, [q.size, q.size + k.size])
    for name, got, w, x in zip("qkv", grads, parts, (q, k, v)):
        np.testing.assert_allclose(np.asarray(got), w.reshape(x.shape), rtol=1e-4, atol=1e-5,
                                   err_msg=f"d{name}")


def test_forward_and_backward_match_numpy(monkeypatch):
    """The device's schedule, the CPU form's backward scheme alternating between the cases."""
    dev = _opencl()
    from tilefuse.ir.kernel import attention
    device_schedule = attention.default_attention_schedule
    rng = np.random.default_rng(0)
    for i, (name, c) in enumerate(CASES.items()):
        def schedule(sp, target, per_head=bool(i % 2)):
            s = device_schedule(sp, target)
            return replace(s, per_head=per_head) if s.cpu and sp.bwd else s
        monkeypatch.setattr(attention, "default_attention_schedule", schedule)
        case = _case(rng, *c)
        try:
            _check(case, dev, rng)
        except AssertionError as e:
            raise AssertionError(f"{name} (per_head={bool(i % 2)}): {e}") from None


def test_small_blocks_match_numpy(monkeypatch):
    """Small blocks (every kernel loops over several, ragged at the ends) and narrow vectors in
    the device's form: 2-row register blocks of 4-lane vectors on CPU devices."""
    dev = _opencl()
    from tilefuse.ir.kernel import attention
    from tilefuse.runtime.hardware import target_of
    t = target_of(dev.info)
    cpu = t.kind == "cpu" or not t.shared_bytes
    small = attention.AttentionSchedule(16, 8, 4, 2, 2) if cpu else attention.AttentionSchedule(16, 8)
    monkeypatch.setattr(attention, "default_attention_schedule", lambda sp, target: small)
    rng = np.random.default_rng(1)
    for name in ("mask with a fully masked query", "bias broadcast over queries, causal, Sq < Sk, D=20, Dv=12"):
        case = _case(rng, *CASES[name])
        try:
            _check(case, dev, rng)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def _template_kernels(f, *args):
    graph = run_passes(tx.make_graph(f)(*args))
    return [lk.kernel for region in partition(graph) for lk in lower_region(region)
            if lk.kernel.meta.get("kind") in dispatch.ATTENTION_KINDS]


def test_dispatcher_chooses_the_tile_builders():
    """Attention (forward and backward) gets the shared tile builders on OpenCL."""
    dev = _opencl()
    q, k, v = (np.ones((1, 8, 2, 4), np.float32) for _ in range(3))
    kernels = _template_kernels(
        tx.grad(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True).sum(), argnums=(0, 1, 2)), q, k, v)
    assert sorted(k.meta["kind"] for k in kernels) == ["fused_attention_bwd", "fused_attention_stats"]
    for kernel in kernels:
        impl = dispatch.choose(kernel, dev)
        assert (impl.name, impl.device_kinds) == ("tile_attention", ("opencl",)), impl


def test_profiler_times_the_backward_as_one_launch():
    """The backward's kernels (three, or one per batch index) are one launch for the profiler,
    timed to the last one's end."""
    dev = _opencl()
    from tilefuse.runtime.profiler import profile
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 40, 3, 16)).astype(np.float32) for _ in range(3))
    f = tx.jit(tx.grad(lambda q, k, v: nn.dot_product_attention(q, k, v).sum(), argnums=(0, 1, 2)),
               device=dev)
    f(q, k, v)
    with profile() as prof:
        np.asarray(f(q, k, v)[0])
    records = {r.info.kind: r for r in prof.records if r.info.impl == "tile_attention"}
    assert set(records) == {"fused_attention_stats", "fused_attention_bwd"}, prof.records
    assert all(r.seconds > 0 for r in records.values())
