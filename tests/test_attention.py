"""Fused attention: the primitive against numpy and finite differences, FlashAttention on every
device (forward and backward, causal or not, sequences that are not a multiple of the block),
the pattern pass (each written form is rewritten, wrong forms are left alone, every rewrite
computes what the unfused graph did), vmap, bad masks, and memory linear in S on the CPU."""
from __future__ import annotations

import math

import types

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse import nn
from tilefuse.autodiff.check import check_grads
from tilefuse.ir import primitives as P
from tilefuse.ir.core import ShapedArray, eval_graph
from tilefuse.ir.errors import ShapeError
from tilefuse.ir.passes import run_passes
from tilefuse.ir.passes.manager import PIPELINE

BSHD = (0, 2, 1, 3)  # nn.dot_product_attention's layout: (batch, seq, heads, features)


def attention64(q, k, v, mask=None, causal=False, scale=None):
    """numpy float64 reference in nn's layout: (B, S, H, D)."""
    q, k, v = (np.asarray(x, np.float64).transpose(BSHD) for x in (q, k, v))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ np.swapaxes(k, -1, -2) * scale
    sq, sk = s.shape[-2:]
    keep = np.ones(s.shape, bool)
    if mask is not None:
        keep &= mask
    if causal:
        keep &= np.tri(sq, sk, sk - sq, dtype=bool)
    s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    total = e.sum(-1, keepdims=True)
    return (e / np.where(total > 0, total, 1) @ v).transpose(BSHD)


def _inputs(rng, b, s, h, d, dtype=np.float32):
    return [rng.standard_normal((b, s, h, d)).astype(dtype) for _ in range(3)]


def test_forward_and_backward_on_every_device(device, rng):
    """FlashAttention (cpu) or the composite kernels (elsewhere) against numpy; S = 70 is not
    a multiple of the blocks (128 queries, 64 keys); a mask leaves some queries with no key."""
    cases = [dict(causal=True, mask=None),
             dict(causal=False, mask=rng.random((2, 70, 70)) > 0.4)]
    for case in cases:
        case["mask"] is not None and case["mask"][:, 3].fill(False)  # fully masked rows
        q, k, v = _inputs(rng, 1, 70, 2, 8)
        g = rng.standard_normal(q.shape).astype(np.float32)

        def loss(q, k, v):
            out = nn.dot_product_attention(q, k, v, mask=case["mask"], causal=case["causal"])
            return (out * g).sum(), out
        (_, out), grads = tx.jit(tx.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        want = attention64(q, k, v, case["mask"], case["causal"])
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5)
        dims = (BSHD,) * 3
        bias = () if case["mask"] is None else (np.where(case["mask"], 0, -np.inf)[None],)
        q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
        (packed,) = P.fused_attention_bwd.impl(q64, k64, v64, *bias, want, g.astype(np.float64),
                                               scale=1 / math.sqrt(8), causal=case["causal"], dims=dims)
        want_grads = np.split(packed, [q.size, 2 * q.size])
        want_grads = [w.reshape(q.shape) for w in want_grads]
        for got, w in zip(grads, want_grads):
            np.testing.assert_allclose(np.asarray(got), w, rtol=1e-4, atol=1e-5)


def test_reference_gradients_match_finite_differences(rng):
    """The primitive's VJP (fused_attention_bwd) in float64, by central differences (on ref)."""
    q, k, v = _inputs(rng, 1, 5, 2, 3, np.float64)
    mask = rng.random((2, 5, 5)) > 0.3
    old, tx.config.default_device = tx.config.default_device, "ref"
    try:
        for causal, m in ((False, None), (True, mask)):
            check_grads(lambda q, k, v: nn.dot_product_attention(q, k, v, mask=m, causal=causal),
                        (q, k, v), order=1, modes=("rev",))
    finally:
        tx.config.default_device = old


def test_mask_of_the_wrong_shape_is_named(rng):
    q, k, v = _inputs(rng, 2, 5, 3, 4)
    with pytest.raises(ShapeError, match=r"mask of shape \(4, 5\)"):
        nn.dot_product_attention(q, k, v, mask=np.ones((4, 5), bool))
    f32 = np.dtype(np.float32)
    with pytest.raises(ShapeError, match=r"bias of shape \(7, 5, 5\)"):
        P.fused_attention.abstract_eval(*(ShapedArray((2, 5, 4), f32) for _ in range(3)),
                                        ShapedArray((7, 5, 5), f32), scale=1.0, causal=False,
                                        dims=((0, 1, 2),) * 3)


def test_vmap_adds_a_batch_axis(rng):
    q, k, v = (rng.standard_normal((3, 1, 6, 2, 4)).astype(np.float32) for _ in range(3))
    got = tx.vmap(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True))(q, k, v)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(got)[i], attention64(q[i], k[i], v[i], causal=True),
                                   rtol=1e-4, atol=1e-5)


# ---- the pattern pass ----------------------------------------------------------------------------

S, D = 5, 4
C = 1 / math.sqrt(D)
CAUSAL = np.tril(np.ones((S, S), bool))


def _softmax(x):  # the plain numpy form: no guards
    e = tnp.exp(x - tnp.max(x, axis=-1, keepdims=True))
    return e / tnp.sum(e, axis=-1, keepdims=True)


def _t(x):
    return tnp.swapaxes(x, -1, -2)


# name -> (function, layout of q/k/v given (B, H, S, D) arrays, causal expected)
FORMS = {
    "scale after the matmul": (lambda q, k, v: nn.softmax(q @ _t(k) * C) @ v, "bhsd", False),
    "scale on q": (lambda q, k, v: nn.softmax((q * C) @ _t(k)) @ v, "bhsd", False),
    "divide by sqrt(d), numpy softmax": (
        lambda q, k, v: _softmax(q @ _t(k) / math.sqrt(D)) @ v, "bhsd", False),
    "einsum (B, S, H, D), tnp.where causal": (
        lambda q, k, v: tnp.einsum("bhqk,bkhd->bqhd", nn.softmax(tnp.where(
            tnp.tril(tnp.ones((S, S), tnp.bool_)), tnp.einsum("bqhd,bkhd->bhqk", q, k) * C, -np.inf)), v),
        "bshd", True),
    "add a -inf triangle": (
        lambda q, k, v: _softmax(q @ _t(k) * C + tnp.triu(tnp.full((S, S), -np.inf), 1)) @ v, "bhsd", True),
    "heads first (H, B, S, D), mask constant": (
        lambda q, k, v: nn.softmax(tnp.where(CAUSAL, q @ _t(k) * C, -np.inf)) @ v, "hbsd", True),
    "bias inside the scale": (lambda q, k, v: nn.softmax((q @ _t(k) + BIAS) * C) @ v, "bhsd", False),
    "bool mask constant": (lambda q, k, v: nn.softmax(tnp.where(MASK, q @ _t(k) * C, -np.inf)) @ v,
                           "bhsd", False),
}
NOT_ATTENTION = {
    "softmax over the query axis": lambda q, k, v: nn.softmax(q @ _t(k) * C, axis=-2) @ v,
    "masked with 0, not -inf": lambda q, k, v: nn.softmax(tnp.where(CAUSAL, q @ _t(k) * C, 0.0)) @ v,
    "weights transposed": lambda q, k, v: _t(nn.softmax(q @ _t(k) * C)) @ v,
    "a negative factor outside the mask": lambda q, k, v: nn.softmax(
        tnp.where(CAUSAL, q @ _t(k), -np.inf) * -1.0) @ v,
    "weights read again": lambda q, k, v: (nn.softmax(q @ _t(k) * C) @ v, nn.softmax(q @ _t(k) * C)),
}
_rng = np.random.default_rng(1)
BIAS = _rng.standard_normal((S, S)).astype(np.float32)
MASK = _rng.random((2, 1, S, S)) > 0.3


def _layout(arrays, layout):
    perm = {"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3), "hbsd": (1, 0, 2, 3)}[layout]
    return [np.ascontiguousarray(a.transpose(perm)) for a in arrays]


def _evaluate(graph, args):
    return eval_graph(graph, args, lambda e, xs: e.prim.impl(*xs, **e.params))


def _unfused(graph):
    return run_passes(graph, [p for p in PIPELINE if p[0] != "fuse_attention"])


def test_each_written_form_is_rewritten_and_computes_the_same(rng):
    base = [rng.standard_normal((2, 3, S, D)).astype(np.float32) for _ in range(3)]
    for name, (f, layout, causal) in FORMS.items():
        args = _layout(base, layout)
        traced = tx.make_graph(f)(*args)
        g = run_passes(traced)
        fused = [e for e in g.eqns if e.prim is P.fused_attention]
        assert len(fused) == 1 and g.count("dot_general") == 0, f"{name}:\n{g}"
        assert fused[0].params["causal"] == causal, name
        (want,) = _evaluate(_unfused(traced), args)
        (got,) = _evaluate(g, args)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_mask_argument_becomes_the_bias(rng):
    """A bool mask that is a function argument (not a constant): an additive bias operand."""
    q, k, v = (rng.standard_normal((2, 3, S, D)).astype(np.float32) for _ in range(3))
    mask = rng.random((3, 1, S)) > 0.3  # per head and key: broadcast over the queries

    def f(q, k, v, mask):
        return nn.softmax(tnp.where(mask, q @ _t(k) * C, -np.inf)) @ v
    traced = tx.make_graph(f)(q, k, v, mask)
    g = run_passes(traced)
    (e,) = [e for e in g.eqns if e.prim is P.fused_attention]
    assert len(e.inputs) == 4 and e.inputs[3].aval.shape == (1, 3, 1, S)
    (want,) = _evaluate(_unfused(traced), [q, k, v, mask])
    (got,) = _evaluate(g, [q, k, v, mask])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_wrong_forms_are_left_alone(rng):
    args = [rng.standard_normal((2, 3, S, D)).astype(np.float32) for _ in range(3)]
    for name, f in NOT_ATTENTION.items():
        g = run_passes(tx.make_graph(f)(*args))
        assert g.count("fused_attention") == 0, f"{name}:\n{g}"


def test_dot_product_attention_is_one_fused_op():
    q, k, v = (np.ones((2, 8, 2, 4), np.float32) for _ in range(3))
    g = run_passes(tx.make_graph(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True))(q, k, v))
    assert g.count("fused_attention") == 1 and g.count("dot_general") == 0


def test_written_out_attention_under_grad_becomes_the_fused_backward(device, rng):
    """jit(grad) of attention written out: the forward becomes fused_attention and the backward
    autodiff wrote (dV = Pᵀ·dO, dS = P·(dP - rowsum(dP·P)), dS·k, dSᵀ·q) fused_attention_bwd,
    which reads the forward's row statistics (fused_attention_stats); no S x S matmul is left,
    and the gradients are the unfused graph's. The form
    examples/train_transformer.py would write (tnp.where causal mask, scale after the matmul,
    (B, H, S, D)) under value_and_grad, and the plain numpy softmax with the scale divided."""
    s = 9
    tri = tnp.tril(tnp.ones((s, s), tnp.bool_))
    forms = {
        "causal, tnp.where": lambda q, k, v: nn.softmax(tnp.where(tri, q @ _t(k) * C, -np.inf)) @ v,
        "numpy softmax": lambda q, k, v: _softmax(q @ _t(k) / math.sqrt(D)) @ v,
    }
    q, k, v = (rng.standard_normal((2, 2, s, D)).astype(np.float32) for _ in range(3))
    g = rng.standard_normal((2, 2, s, D)).astype(np.float32)
    for name, f in forms.items():
        loss = tx.value_and_grad(lambda q, k, v, f=f: (tnp.tanh(f(q, k, v)) * g).sum(), argnums=(0, 1, 2))
        traced = tx.make_graph(loss)(q, k, v)
        graph = run_passes(traced)  # devices without the attention kernels decompose it later
        squares = [e for e in graph.eqns if e.prim.name in ("dot_general", "fused_gemm")
                   and e.outputs[0].aval.shape[-2:] == (s, s)]
        assert graph.count("fused_attention_stats") == 1 and graph.count("fused_attention_bwd") == 1 \
            and not squares, f"{name}:\n{graph}"
        (fwd,) = [e for e in graph.eqns if e.prim is P.fused_attention_stats]
        (bwd,) = [e for e in graph.eqns if e.prim is P.fused_attention_bwd]
        assert bwd.params["stats"] and bwd.inputs[-1] is fwd.outputs[1], f"{name}:\n{graph}"
        value, grads = tx.jit(loss)(q, k, v)
        want = _evaluate(_unfused(traced), [q, k, v])
        for got, w in zip([value, *grads], want):
            np.testing.assert_allclose(np.asarray(got), w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_backward_when_others_read_the_weights_or_a_bias_gradient_is_wanted(rng):
    """The weights read elsewhere too (recomputed there: the attention fuses before autodiff, so
    its backward is fused_attention's rule), a gradient of a bias argument wanted (the rule
    decomposes): the graph computes the unfused gradients."""
    q, k, v = (rng.standard_normal((2, 3, S, D)).astype(np.float32) for _ in range(3))
    bias = rng.standard_normal((S, S)).astype(np.float32)

    def att(q, k, v, b):
        return nn.softmax(q @ _t(k) * C + b) @ v
    cases = {
        "weights in the loss": tx.grad(lambda q, k, v, b: (att(q, k, v, b) ** 2).sum()
                                       + nn.softmax(q @ _t(k) * C + b).max(), argnums=(0, 1, 2)),
        "bias gradient": tx.grad(lambda q, k, v, b: (att(q, k, v, b) ** 2).sum(), argnums=(0, 1, 2, 3)),
    }
    for name, f in cases.items():
        traced = tx.make_graph(f)(q, k, v, bias)
        g = run_passes(traced)
        assert g.count("fused_attention") + g.count("fused_attention_stats") == 1, f"{name}:\n{g}"
        for got, want in zip(_evaluate(g, [q, k, v, bias]), _evaluate(_unfused(traced), [q, k, v, bias])):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_backward_fused_per_layer_and_with_a_mask_argument(rng):
    """Two layers sharing k and v (one fused backward each), and a bool mask argument (the
    bias operand of both fused ops), under grad: the gradients are the unfused graph's."""
    q, k, v = (rng.standard_normal((2, 3, S, D)).astype(np.float32) for _ in range(3))
    mask = rng.random((3, 1, S)) > 0.3

    def att(q, k, v, m):
        return nn.softmax(tnp.where(m, q @ _t(k) * C, -np.inf)) @ v
    cases = {
        "two layers": (2, tx.grad(lambda q, k, v, m: (att(att(q, k, v, CAUSAL), k, v, CAUSAL) ** 2).sum(),
                                  argnums=(0, 1, 2))),
        "mask argument": (1, tx.grad(lambda q, k, v, m: (att(q, k, v, m) ** 2).sum(), argnums=(0, 1, 2))),
    }
    for name, (count, f) in cases.items():
        traced = tx.make_graph(f)(q, k, v, mask)
        g = run_passes(traced)
        assert g.count("fused_attention_bwd") == count and g.count("dot_general") == 0, f"{name}:\n{g}"
        for got, want in zip(_evaluate(g, [q, k, v, mask]), _evaluate(_unfused(traced), [q, k, v, mask])):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)



def test_a_transposed_operand_is_read_in_place(rng):
    """q @ swapaxes(k): fused_attention reads k itself (its feature axis last, the layout the tile
    builders take), not a transposed copy, under jit and under grad (the rewrite before autodiff,
    where fold_transpose_into_dot has not run); the values are the unfused graph's."""
    q, k, v = (rng.standard_normal((2, 2, S, D)).astype(np.float32) for _ in range(3))

    def f(q, k, v):
        return nn.softmax(q @ _t(k) * C) @ tnp.swapaxes(_t(v), -1, -2)
    for name, fn in (("jit", f), ("grad", tx.grad(lambda q, k, v: (f(q, k, v) ** 2).sum(), argnums=(0, 1, 2)))):
        traced = tx.make_graph(fn)(q, k, v)
        g = run_passes(traced)
        fused = [e for e in g.eqns if e.prim.name.startswith("fused_attention")]
        assert fused and g.count("transpose") == 0, f"{name}:\n{g}"
        assert all(e.inputs[:3] == tuple(g.invars) and e.params["dims"] == ((0, 1, 2, 3),) * 3
                   for e in fused), f"{name}:\n{g}"
        for got, want in zip(_evaluate(g, [q, k, v]), _evaluate(_unfused(traced), [q, k, v])):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)

def test_the_backward_reads_the_statistics_of_its_own_forward_only(rng):
    """attention_stats pairs a fused_attention_bwd with the forward whose result it reads as `out`,
    on the same operands and parameters (a structural match): the forward becomes
    fused_attention_stats and the backward reads its statistics; a backward whose `out` comes from
    a forward of another scale is left alone. The statistics are the reference's (m, 1/l), and
    the graph computes what it did."""
    from tilefuse.ir.passes.attention import attention_stats
    from tilefuse.tracer.core import bind1
    q, k, v = (rng.standard_normal((2, 5, 3, 4)).astype(np.float32) for _ in range(3))
    params = dict(causal=True, dims=((0, 2, 1, 3),) * 3)

    def f(q, k, v):
        out = bind1(P.fused_attention, q, k, v, scale=0.5, **params)
        other = bind1(P.fused_attention, q, k, v, scale=0.25, **params)
        paired = bind1(P.fused_attention_bwd, q, k, v, out, other, scale=0.5, **params)
        unpaired = bind1(P.fused_attention_bwd, q, k, v, other, out, scale=0.5, **params)
        return paired, unpaired
    g = tx.make_graph(f)(q, k, v)
    h = attention_stats(g)
    assert h.count("fused_attention_stats") == 1 and h.count("fused_attention") == 1, h
    (fwd,) = [e for e in h.eqns if e.prim is P.fused_attention_stats]
    assert fwd.params["scale"] == 0.5
    bwds = [e for e in h.eqns if e.prim is P.fused_attention_bwd]
    assert [e.params.get("stats", False) for e in bwds] == [True, False]
    assert bwds[0].inputs[-1] is fwd.outputs[1]
    for got, want in zip(_evaluate(h, [q, k, v]), _evaluate(g, [q, k, v])):
        np.testing.assert_array_equal(got, want)
    _, stats = fwd.prim.impl(q, k, v, **fwd.params)
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k) * 0.5
    s = np.where(np.tri(5, 5, dtype=bool), s, -np.inf)
    m = s.max(-1)
    np.testing.assert_allclose(stats[..., 0], m, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats[..., 1], 1 / np.exp(s - m[..., None]).sum(-1), rtol=1e-5)

# ---- memory ----------------------------------------------------------------------------------------

def test_cpu_memory_is_linear_in_the_sequence():
    """Forward and backward at S = 2048: the pool's peak above the inputs stays below one S x S
    float32 matrix per head (the unfused graph would hold several)."""
    if "cpu" not in [d.kind for d in tx.devices()]:
        pytest.skip("no cpu device")
    s, h, d = 2048, 2, 64
    rng = np.random.default_rng(0)
    q, k, v = (tx.device_put(rng.standard_normal((1, s, h, d)).astype(np.float32), "cpu") for _ in range(3))
    f = tx.jit(tx.grad(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True).sum(),
                       argnums=(0, 1, 2)), device="cpu")
    np.asarray(f(q, k, v)[0])  # compile
    dev = tx.get_device("cpu")
    pool = dev.backend.pool
    pool.reset_peak()
    before = pool.stats()["bytes_in_use"]
    grads = f(q, k, v)
    np.asarray(grads[0])
    extra = pool.stats()["peak_bytes_in_use"] - before
    assert extra < s * s * 4, f"{extra / 2**20:.1f} MiB at S={s}"


def test_written_out_attention_differentiated_through_jit_is_fused(device, rng):
    """grad(jit(f)): the jitted graph is replayed under grad after the attention rewrite, so
    fused_attention's rule writes the backward (no random check decides it); values match the
    eager, unfused gradients."""
    s = 7
    q, k, v = (rng.standard_normal((2, 2, s, D)).astype(np.float32) for _ in range(3))
    att = tx.jit(lambda q, k, v: nn.softmax(q @ _t(k) * C) @ v)
    loss = lambda q, k, v: (tnp.sin(att(q, k, v)) ** 2).sum()  # noqa: E731
    grad = tx.grad(loss, argnums=(0, 1, 2))
    g = run_passes(tx.make_graph(grad)(q, k, v))
    assert g.count("fused_attention_stats") == 1 and g.count("fused_attention_bwd") == 1, g
    with _on_ref():  # eager: every primitive on its own, no rewrite
        want = [np.asarray(x) for x in tx.grad(lambda q, k, v: (tnp.sin(nn.softmax(q @ _t(k) * C) @ v) ** 2)
                                               .sum(), argnums=(0, 1, 2))(q, k, v)]
    for got, w in zip(tx.jit(grad)(q, k, v), want):
        np.testing.assert_allclose(np.asarray(got), w, rtol=1e-4, atol=1e-5)
    for got, w in zip(grad(q, k, v), want):
        np.testing.assert_allclose(np.asarray(got), w, rtol=1e-4, atol=1e-5)


class _on_ref:
    """Eager operations on the numpy oracle for the duration."""

    def __enter__(self):
        self.old, tx.config.default_device = tx.config.default_device, "ref"

    def __exit__(self, *exc):
        tx.config.default_device = self.old


# (q layout as dims, Sq, Sk, D, Dv, causal, bias shape or None, dtype)
TILE_CASES = [
    ("bhsd", 5, 7, 4, 4, False, None, np.float32),
    ("bshd causal Sq<Sk", 6, 9, 8, 3, True, None, np.float32),
    ("bias per key, masked rows", 4, 6, 4, 5, False, (2, 3, 1, 6), np.float32),
    ("causal Sq>Sk, full bias", 9, 4, 3, 3, True, (2, 3, 9, 4), np.float32),
    ("float16", 5, 70, 4, 4, False, None, np.float16),
]



def _tile_schedules():
    from tilefuse.ir.kernel.attention import AttentionSchedule
    # the GPU form (a work-item per row, shared memory); the CPU form (a task per row block, vectors
    # along keys and features: ragged vectors, one-lane vectors, register blocks of several rows)
    # (per_head: a task per batch index, k and v staged once in the forward, q and do in the backward)
    return [AttentionSchedule(4, 8), AttentionSchedule(8, 64), AttentionSchedule(4, 8, 4, 2, 2),
            AttentionSchedule(8, 16, 8, 4, 1), AttentionSchedule(4, 4, 1, 1, 1),
            AttentionSchedule(4, 8, 4, 2, 2, True)]


TILE_SCHEDULES = _tile_schedules()


@pytest.mark.parametrize("case", TILE_CASES, ids=[c[0] for c in TILE_CASES])
def test_the_tile_attention_builder_matches_the_primitive(rng, case):
    """FlashAttention written once in the tile IR (ir/kernel/attention.py: build_forward and
    build_backward, in both forms), run by the tile IR's reference interpreter against the
    primitive's numpy implementation: layouts,
    causal with Sq != Sk, a -inf bias that masks whole rows (zeros, never NaN), 16-bit inputs,
    key blocks past the sequence's end."""
    from tilefuse.ir.core import ShapedArray
    from tilefuse.ir.kernel.attention import AttentionSchedule, build_forward, spec_of
    from tilefuse.ir.kernel.ir import Buffer
    from tilefuse.ir.kernel.tile import check_tile, run_tile
    name, sq, sk, d, dv, causal, bias_shape, dtype = case
    heads_first = name.startswith("bhsd") or bias_shape is not None
    shape = (lambda s, f: (2, 3, s, f)) if heads_first else (lambda s, f: (2, s, 3, f))
    dims = ((0, 1, 2, 3),) * 3 if heads_first else ((0, 2, 1, 3),) * 3
    q, k, v = (rng.standard_normal(shape(s, f)).astype(dtype) for s, f in ((sq, d), (sk, d), (sk, dv)))
    args = [q, k, v]
    if bias_shape is not None:
        bias = rng.standard_normal(bias_shape).astype(dtype)
        if bias_shape[-2] > 2:
            bias[..., :2, :] = -np.inf  # queries with no key to attend to
        bias[0, :, :, 1] = -np.inf
        args.append(bias)
    params = dict(scale=0.37, causal=causal, dims=dims)
    (want,) = P.fused_attention.impl(*args, **params)
    avals = [ShapedArray(a.shape, a.dtype) for a in args]
    (out_aval,) = P.fused_attention.abstract_eval(*avals, **params)
    eqn = types.SimpleNamespace(prim=P.fused_attention, params=params,
                                inputs=[types.SimpleNamespace(aval=a) for a in avals])
    sp = spec_of(eqn)
    bufs = tuple(Buffer(f"b{i}", a.dtype, a.size) for i, a in enumerate(avals + [out_aval]))
    for sched in TILE_SCHEDULES:
        tk = build_forward(sp, sched, "attn", bufs, len(args))
        check_tile(tk)
        got = np.full(out_aval.size, np.nan, dtype)
        run_tile(tk, [a.reshape(-1) for a in args] + [got])
        tol = 2e-3 if dtype == np.float16 else 2e-6
        np.testing.assert_allclose(got.reshape(out_aval.shape).astype(np.float32), want.astype(np.float32),
                                   rtol=tol, atol=tol, err_msg=f"{name} {sched}")
    if dtype != np.float32:
        return
    # the backward: stats, dkdv and dq kernels in order over one packed result
    from tilefuse.ir.kernel.attention import build_backward
    dout = rng.standard_normal(want.shape).astype(dtype)
    bargs = args + [want, dout]
    (bwant,) = P.fused_attention_bwd.impl(*bargs, **params)
    bavals = [ShapedArray(a.shape, a.dtype) for a in bargs]
    (res_aval,) = P.fused_attention_bwd.abstract_eval(*bavals, **params)
    bsp = spec_of(types.SimpleNamespace(prim=P.fused_attention_bwd, params=params,
                                        inputs=[types.SimpleNamespace(aval=a) for a in bavals]))
    bbufs = tuple(Buffer(f"b{i}", a.dtype, a.size) for i, a in enumerate(bavals + [res_aval]))
    for sched in TILE_SCHEDULES + [AttentionSchedule(8, 4)]:
        got = np.full(res_aval.size, np.nan, dtype)
        for tk in build_backward(bsp, sched, "attn_bwd", bbufs, len(bargs)):
            check_tile(tk)
            run_tile(tk, [a.reshape(-1) for a in bargs] + [got])
        np.testing.assert_allclose(got, bwant, rtol=2e-5, atol=2e-5, err_msg=f"{name} backward {sched}")
