"""tx.tile_op: shape checks, equality with the undecorated body on every device, gradients by
finite differences, kernel counts, the empty-body library forms, and composition with jit, grad
and vmap."""
from __future__ import annotations

import math

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse import nn
from tilefuse.ir import primitives as P

T = tx.Tensor


def rms_norm(x: T["M", "N"], w: T["N"], eps: float = 1e-6) -> T["M", "N"]:
    return x * tnp.rsqrt(tnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def swiglu(x: T["M", "D"], w1: T["D", "F"], w3: T["D", "F"], w2: T["F", "D"]) -> T["M", "D"]:
    return (nn.silu(x @ w1) * (x @ w3)) @ w2


def alibi_attention(q: T["B", "H", "S", "D"], k: T["B", "H", "S", "D"],
                    v: T["B", "H", "S", "D"]) -> T["B", "H", "S", "D"]:
    _, h, s, d = q.shape
    slopes = 2.0 ** (-8.0 * np.arange(1, h + 1) / h)
    dist = np.arange(s)[None, :] - np.arange(s)[:, None]  # key j - query i
    bias = np.where(dist > 0, -np.inf, slopes[:, None, None] * dist).astype(np.float32)
    scores = q @ tnp.swapaxes(k, -1, -2) * (1.0 / math.sqrt(d)) + bias
    return nn.softmax(scores, axis=-1) @ v


def sq_dist(x: T["M", "N"], y: T["M", "N"], w: T["N"]) -> T["M"]:
    d = (x - y) * w
    return tnp.sum(d * d, axis=-1)


def _data(rng, *shapes):
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


class _ref:
    """Run on the reference interpreter for the duration."""

    def __enter__(self):
        self.old, tx.config.default_device = tx.config.default_device, "ref"

    def __exit__(self, *exc):
        tx.config.default_device = self.old


# ---- shape checks (no device work) ----------------------------------------------------------

def test_shape_errors_name_the_dimension_sizes_and_arguments():
    op = tx.tile_op(rms_norm)
    x, w = np.zeros((4, 8), np.float32), np.zeros(6, np.float32)
    with pytest.raises(tx.ShapeError, match=r"dimension 'N' is 8 in argument 'x' \(shape \(4, 8\)\) "
                                            r"but 6 in argument 'w' \(shape \(6,\)\)"):
        op(x, w)
    with pytest.raises(tx.ShapeError, match=r"argument 'x' has shape \(8,\) but is annotated "
                                            r"Tensor\['M', 'N'\]"):
        op(np.zeros(8, np.float32), w)

    @tx.tile_op
    def fixed(x: T["M", 4, tx.float32]) -> T["M", 4]:
        return x * 2.0
    with pytest.raises(tx.ShapeError, match="fixes that dimension to 4"):
        fixed(np.zeros((3, 5), np.float32))
    with pytest.raises(tx.DTypeError, match="has dtype int32"):
        fixed(np.zeros((3, 4), np.int32))

    @tx.tile_op
    def add_rows(x: T[..., "N"], y: T[..., "N"]) -> T[..., "N"]:
        return x + y
    with pytest.raises(tx.ShapeError, match=r"the batch dimensions \.\.\. is \(2, 3\)"):
        add_rows(np.zeros((2, 3, 4), np.float32), np.zeros((3, 3, 4), np.float32))

    @tx.tile_op
    def wrong_result(x: T["M", "N"]) -> T["N", "M"]:
        return x * 2.0
    with pytest.raises(tx.ShapeError, match=r"dimension 'N' is 3 .* but 2 in argument '<result>'"):
        tx.make_graph(wrong_result)(np.zeros((2, 3), np.float32))
    with pytest.raises(tx.TilefuseError, match="'w' is a str"):
        op(x, "w")


def test_one_primitive_traced_once_per_shape_signature():
    op = tx.tile_op(rms_norm)
    x, w = np.ones((4, 8), np.float32), np.ones(8, np.float32)
    g = tx.make_graph(lambda x, w: op(x, w) + 1.0)(x, w)
    assert g.count("tile_op") == 1 and g.count("reduce_sum") == 0  # the body is one unit
    (call,) = [e for e in g.eqns if e.prim is P.tile_call]
    assert call.params["graph"].count("reduce_sum") == 1
    tx.make_graph(lambda x, w: op(op(x, w), w))(x, w)
    tx.make_graph(lambda x, w: op(x, w, eps=1e-6))(x, w)
    assert op.trace_count == 1
    tx.make_graph(op)(np.ones((2, 8), np.float32), w)
    tx.make_graph(lambda x, w: op(x, w, eps=1e-3))(x, w)
    assert op.trace_count == 3


def test_tunable_parameters():
    @tx.tile_op(tunable={"block": [2, 4, 8]})
    def blocked_sum(x: T["M", "N"], block: int = 0) -> T["M"]:
        m, n = x.shape
        return tnp.sum(tnp.sum(tnp.reshape(x, (m, n // block, block)), axis=-1), axis=-1)
    assert blocked_sum.tunable == {"block": (2, 4, 8)} and blocked_sum.config == {"block": 2}
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    graph = tx.make_graph(blocked_sum)(x).eqns[0].params["graph"]
    assert any(e.prim.name == "reshape" and e.params["new_sizes"] == (2, 4, 2) for e in graph.eqns)
    blocked_sum.configure(block=8)
    graph = tx.make_graph(blocked_sum)(x).eqns[0].params["graph"]
    assert any(e.prim.name == "reshape" and e.params["new_sizes"] == (2, 1, 8) for e in graph.eqns)
    with pytest.raises(tx.TilefuseError, match="block=3 is not among"):
        blocked_sum.configure(block=3)


# ---- the library forms ------------------------------------------------------------------------

def test_empty_bodies_bind_the_library_implementation():
    @tx.tile_op
    def mm(a: T["M", "K"], b: T["K", "N"]) -> T["M", "N"]:
        ...

    @tx.tile_op
    def bmm(a: T["B", "M", "K"], b: T["B", "K", "N"]) -> T["B", "M", "N"]:
        pass

    @tx.tile_op
    def attention(q: T["B", "H", "S", "D"], k: T["B", "H", "T", "D"], v: T["B", "H", "T", "D"],
                  causal: bool = False) -> T["B", "H", "S", "D"]:
        """The library's attention."""

    @tx.tile_op
    def row_softmax(x: T[..., "N"]) -> T[..., "N"]:
        ...

    @tx.tile_op
    def layer_norm(x: T["M", "N"], scale: T["N"], bias: T["N"]) -> T["M", "N"]:
        ...

    def bhsd(f):  # nn's attention layout is (B, S, H, D)
        return lambda q, k, v: tnp.swapaxes(f(*(tnp.swapaxes(a, 1, 2) for a in (q, k, v))), 1, 2)
    rng = np.random.default_rng(0)
    a, b, s, q = _data(rng, (3, 4), (4, 5), (2, 3, 4), (1, 2, 3, 4))
    ln = _data(rng, (4,), (4,))
    cases = [(mm, (a, b), tnp.matmul), (bmm, (s, np.swapaxes(s, 1, 2)), tnp.matmul),
             (attention, (q, q, q), bhsd(lambda *x: nn.dot_product_attention(*x, causal=True))),
             (row_softmax, (s,), nn.softmax),
             (layer_norm, (a, *ln), lambda x, sc, bi: nn.layer_norm({"scale": sc, "bias": bi}, x))]
    for op, args, library in cases:
        kw = {"causal": True} if op is attention else {}
        body = tx.make_graph(lambda *xs: op(*xs, **kw))(*args).eqns[0].params["graph"]
        assert str(body) == str(tx.make_graph(library)(*args)), op.name
        with _ref():
            np.testing.assert_allclose(np.asarray(op(*args, **kw)), np.asarray(library(*args)),
                                       rtol=1e-6, atol=1e-6, err_msg=op.name)

    with pytest.raises(tx.TilefuseError, match=r"none of the recognised forms:\n  matmul: \(M, K\)"):
        @tx.tile_op
        def gelu(x: T["M", "N"]) -> T["M", "N"]:
            ...


# ---- every device -----------------------------------------------------------------------------

def test_equals_the_undecorated_body(device, rng):
    cases = [(rms_norm, _data(rng, (4, 16), (16,))),
             (swiglu, _data(rng, (4, 8), (8, 16), (8, 16), (16, 8))),
             (alibi_attention, _data(rng, (1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 5, 4)))]
    for fun, args in cases:
        op = tx.tile_op(fun)
        expected = np.asarray(tx.jit(fun, device="ref")(*args))
        got = np.asarray(tx.jit(lambda *xs: op(*xs) * 2.0)(*args))
        np.testing.assert_allclose(got, 2.0 * expected, rtol=2e-5, atol=2e-5, err_msg=fun.__name__)
    np.testing.assert_allclose(np.asarray(op(*args)), expected, rtol=2e-5, atol=2e-5)  # eagerly


def test_elementwise_plus_reduction_body_is_one_kernel(device, rng):
    if device.kind == "ref":
        pytest.skip("the reference interpreter launches no kernels")
    op = tx.tile_op(sq_dist)
    x, y, w = _data(rng, (4, 16), (4, 16), (16,))
    exe = tx.jit(op).lower(x, y, w).compile()
    assert len(exe.program.launches) == 1
    np.testing.assert_allclose(np.asarray(exe([x, y, w])[0]), np.sum(((x - y) * w) ** 2, -1), rtol=1e-5)
    # RMSNorm (a row reduction read along its row) is one row kernel, as the code inline
    x, w = _data(rng, (4, 16), (16,))
    for f in (rms_norm, tx.tile_op(rms_norm)):
        exe = tx.jit(f).lower(x, w).compile()
        assert [ln.kind for ln in exe.program.launches] == ["reduce"], f
        np.testing.assert_allclose(np.asarray(exe([x, w])[0]), np.asarray(tx.jit(rms_norm, device="ref")(x, w)),
                                   rtol=1e-5, atol=1e-6)


# ---- differentiation and batching (reference interpreter: no compiles) ------------------------

def test_gradients_by_finite_differences(rng):
    op = tx.tile_op(rms_norm)
    with _ref():
        tx.check_grads(op, _data(rng, (3, 5), (5,)), order=2, atol=1e-4, rtol=1e-4)
        tx.check_grads(tx.tile_op(alibi_attention), _data(rng, (1, 2, 3, 2), (1, 2, 3, 2), (1, 2, 3, 2)),
                       modes=("rev",), atol=1e-4, rtol=1e-4)


def test_defvjp_overrides_the_body_derivative(rng):
    @tx.tile_op
    def clip(x: T["N"], lo: float = -1.0) -> T["N"]:
        return tnp.maximum(x, lo)

    @clip.defvjp
    def clip_vjp(x, out, g, lo):  # straight-through: the gradient passes everywhere
        return g * 1.0

    x = np.array([-3.0, 0.5, 2.0], np.float32)
    with _ref():
        np.testing.assert_allclose(np.asarray(tx.grad(lambda x: clip(x).sum())(x)), [1, 1, 1])
        np.testing.assert_allclose(np.asarray(tx.grad(lambda x: clip(x, lo=0.0).sum())(x)), [1, 1, 1])
        xb = np.stack([x, -x])
        per_row = tx.vmap(tx.grad(lambda x: clip(x).sum()))(xb)
        np.testing.assert_allclose(np.asarray(per_row), np.ones((2, 3)))
        batched = tx.grad(lambda x: tx.vmap(clip)(x).sum())(xb)  # vmap inside grad: batched VJP
        np.testing.assert_allclose(np.asarray(batched), np.ones((2, 3)))


def test_composes_with_jit_grad_and_vmap(rng):
    op = tx.tile_op(rms_norm)
    xb, w = _data(rng, (3, 4, 6), (6,))

    def loss(x, w):
        return tnp.sum(op(x, w) ** 2)

    def plain_loss(x, w):
        return tnp.sum(rms_norm(x, w) ** 2)
    with _ref():
        got = tx.vmap(tx.jit(tx.grad(loss, argnums=(0, 1))), in_axes=(0, None))(xb, w)
        want = tx.vmap(tx.grad(plain_loss, argnums=(0, 1)), in_axes=(0, None))(xb, w)
        for g, e in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)
        g_outer = tx.grad(lambda x: tnp.sum(tx.vmap(op, in_axes=(0, None))(x, w) ** 2))(xb)
        np.testing.assert_allclose(np.asarray(g_outer), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
        batched = tx.make_graph(tx.vmap(op, in_axes=(0, None)))(xb, w)
        assert batched.count("tile_op") == 1  # vmap batches the body into a new tile_op

        def scaled_norm(x, s):  # the body closes over a traced value: it gets its gradient
            @tx.tile_op
            def scale(y: T["N"]) -> T["N"]:
                return y * s
            return tnp.sum(scale(x) ** 2)
        x = np.arange(4, dtype=np.float32)
        gx, gs = tx.grad(scaled_norm, argnums=(0, 1))(x, np.float32(2.0))
        np.testing.assert_allclose(np.asarray(gx), 8 * x)
        np.testing.assert_allclose(float(gs), 4 * np.sum(x * x))
        np.testing.assert_allclose(np.asarray(tx.grad(lambda x: tnp.sum(tx.jit(op)(x, w)))(xb[0])),
                                   np.asarray(tx.grad(lambda x: tnp.sum(rms_norm(x, w)))(xb[0])), rtol=1e-5, atol=1e-6)
