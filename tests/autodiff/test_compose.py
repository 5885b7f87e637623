"""Composition: jit(grad), grad(jit), grad(grad), jacobians under jit, eager value-dependent
control flow, and the vmap compositions (jit(vmap(grad)), vmap(jacrev)); also both ways of
building Jacobians (one vmapped call, or a loop of calls)."""
from __future__ import annotations

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse.autodiff import api
from tilefuse.ir.core import Graph, typecheck_graph
from tilefuse.ir.errors import ConcretizationError, TracerLeakError

from conftest import assert_close

R = np.random.default_rng(1)
W = R.standard_normal((3, 4)).astype(np.float32)
X = R.standard_normal((2, 3)).astype(np.float32)


def f(w, x):
    return tnp.sum(tnp.tanh(x @ w))


def grad_f_numpy(w, x):
    t = np.tanh(x @ w)
    return x.T @ (1 - t * t), (1 - t * t) @ w.T


def _vmap_or_skip():
    try:
        tx.vmap(lambda x: x)(np.zeros((1,), np.float32))
    except NotImplementedError:
        pytest.skip("vmap is not implemented yet (tracer/vmap.py raises NotImplementedError)")


# ---- jit(grad(f)): one graph, forward once ------------------------------------------------------

def test_jit_of_grad_is_one_graph_with_the_forward_once(device):
    fwd = tx.make_graph(f)(W, X)
    graph = tx.make_graph(tx.grad(f))(W, X)
    assert isinstance(graph, Graph)
    typecheck_graph(graph)
    names = [e.prim.name for e in graph.eqns]
    # the forward pass comes first, exactly once; the backward follows in the same graph
    assert names[:len(fwd.eqns)] == [e.prim.name for e in fwd.eqns] == [
        "dot_general", "tanh", "reduce_sum"]
    assert graph.count("tanh") == 1
    assert graph.count("dot_general") == 2  # forward x @ w, backward for w only (argnums=0)
    # backward: ct broadcast, 1 - t*t (broadcast, mul, sub), mul by ct, dot, transpose
    assert len(graph.eqns) == 3 + 7
    both = tx.make_graph(tx.grad(f, argnums=(0, 1)))(W, X)
    assert both.count("tanh") == 1 and both.count("dot_general") == 3 and len(both.eqns) == 11


def test_jit_of_grad_values(device):
    gw, gx = tx.jit(tx.grad(f, argnums=(0, 1)))(W, X)
    ew, ex = grad_f_numpy(W, X)
    assert_close(gw, ew, rtol=1e-5, atol=1e-5)
    assert_close(gx, ex, rtol=1e-5, atol=1e-5)


def test_grad_of_jit(device):
    jf = tx.jit(f)
    g1 = tx.grad(jf)(W, X)
    g2 = tx.grad(jf)(W * 2, X)
    assert jf.trace_count == 1  # replayed under grad, traced once per signature
    assert_close(g1, grad_f_numpy(W, X)[0], rtol=1e-5, atol=1e-5)
    assert_close(g2, grad_f_numpy(W * 2, X)[0], rtol=1e-5, atol=1e-5)
    assert_close(tx.jit(tx.grad(jf))(W, X), g1, rtol=1e-6, atol=1e-6)


def test_grad_of_grad(device):
    h = lambda x: tnp.sin(x) * x  # noqa: E731
    x = np.float64(0.7)
    d2 = tx.grad(tx.grad(h))(x)
    d3 = tx.grad(tx.grad(tx.grad(h)))(x)
    assert float(d2) == pytest.approx(2 * np.cos(x) - x * np.sin(x), rel=1e-12)
    assert float(d3) == pytest.approx(-3 * np.sin(x) - x * np.cos(x), rel=1e-12)
    assert float(tx.jit(tx.grad(tx.grad(h)))(x)) == pytest.approx(float(d2), rel=1e-12)


def test_grad_inside_grad_closing_over_the_outer_variable(device):
    # d/dx [ d/dy (x * y^2) at y=3 ] = d/dx [6x] = 6: the inner gradient depends on x
    g = tx.grad(lambda x: tx.grad(lambda y: x * y * y)(3.0))(2.0)
    assert float(g) == pytest.approx(6.0)


def test_jacobians_and_hessian_under_jit(device):
    x = np.array([0.3, -0.4, 0.8])
    g = lambda x: tnp.sum(tnp.exp(x) * x[::-1])  # noqa: E731
    H = tx.jit(tx.hessian(g))(x)
    assert_close(H, tx.hessian(g)(x), rtol=1e-12, atol=1e-12)
    ex = np.exp(x)
    expected = np.diag(ex * x[::-1]) + (np.diag(ex) @ np.eye(3)[::-1] + (np.diag(ex) @ np.eye(3)[::-1]).T)
    assert_close(H, expected, rtol=1e-12, atol=1e-12)


# ---- eager grad carries values; jit(grad) does not -------------------------------------------------

def loss_with_branch(x):
    y = tnp.sum(x * x)
    if y > 1.0:  # a Python branch on a value
        return y * 2.0
    return y


def test_value_dependent_control_flow_under_grad(device):
    small, large = np.array([0.1, 0.2], np.float32), np.array([1.0, 2.0], np.float32)
    assert_close(tx.grad(loss_with_branch)(small), 2 * small)
    assert_close(tx.grad(loss_with_branch)(large), 4 * large)
    # float() and .item() work under eager grad too
    tx.grad(lambda x: tnp.sum(x) * float(tnp.sum(x)) + 0 * tnp.sum(x).item())(small)


def test_value_dependent_control_flow_under_jit_of_grad_raises(device):
    with pytest.raises(ConcretizationError, match="concrete value"):
        tx.jit(tx.grad(loss_with_branch))(np.ones(2, np.float32))


def test_leaked_tracer_is_reported(device):
    kept = []
    tx.grad(lambda x: kept.append(x * 2.0) or tnp.sum(x))(np.ones(2))
    with pytest.raises(TracerLeakError):
        kept[0] + 1.0


# ---- Jacobians: the vmapped call and the loop agree -------------------------------------------

@pytest.fixture(params=["vmap", "loop"])
def jac_path(request, monkeypatch):
    if request.param == "vmap":
        _vmap_or_skip()
    else:
        monkeypatch.setattr(api, "_vmap", lambda: None)
    return request.param


def test_jacobian_paths(device, jac_path):
    A = R.standard_normal((3, 2))
    x = np.array([0.2, -0.6])
    fn = lambda p: {"y": tnp.tanh(A @ p["x"]), "s": tnp.sum(p["x"] ** 2)}  # noqa: E731
    J = (1 - np.tanh(A @ x) ** 2)[:, None] * A
    for jac in (tx.jacrev, tx.jacfwd):
        out = jac(fn)({"x": x})
        assert_close(out["y"]["x"], J, rtol=1e-12, atol=1e-12)
        assert_close(out["s"]["x"], 2 * x, rtol=1e-12, atol=1e-12)
    assert_close(tx.hessian(lambda x: tnp.sum(x ** 3))(x), np.diag(6 * x), rtol=1e-12, atol=1e-12)
    (jx, aux) = tx.jacfwd(lambda x: (x * 2.0, tnp.sum(x)), has_aux=True)(x)
    assert_close(jx, 2 * np.eye(2))
    assert float(aux) == pytest.approx(x.sum())


# ---- with vmap -----------------------------------------------------------------------------------

def test_jit_of_vmap_of_grad_per_example_gradients(device):
    _vmap_or_skip()
    xs = R.standard_normal((5, 2, 3)).astype(np.float32)
    per_example = tx.jit(tx.vmap(tx.grad(f), in_axes=(None, 0)))(W, xs)
    expected = np.stack([grad_f_numpy(W, x)[0] for x in xs])
    assert_close(per_example, expected, rtol=1e-5, atol=1e-5)
    graph = tx.make_graph(tx.vmap(tx.grad(f), in_axes=(None, 0)))(W, xs)
    # batched, not a Python loop: as many matmuls as one example's gradient needs
    assert graph.count("dot_general") == 2 and graph.count("tanh") == 1


def test_vmap_of_jacrev(device):
    _vmap_or_skip()
    A = R.standard_normal((3, 2))
    xs = R.standard_normal((4, 2))
    fn = lambda x: tnp.tanh(A @ x)  # noqa: E731
    got = tx.vmap(tx.jacrev(fn))(xs)
    expected = np.stack([(1 - np.tanh(A @ x) ** 2)[:, None] * A for x in xs])
    assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_grad_of_vmap(device):
    _vmap_or_skip()
    xs = R.standard_normal((4, 2, 3)).astype(np.float32)
    total = lambda w: tnp.sum(tx.vmap(lambda x: f(w, x))(xs))  # noqa: E731
    expected = sum(grad_f_numpy(W, x)[0] for x in xs)
    assert_close(tx.grad(total)(W), expected, rtol=1e-5, atol=1e-5)
