"""The public API: grad/value_and_grad/vjp/jvp/jacfwd/jacrev/hessian over pytrees, stop_gradient,
custom_vjp, the documented tie rules, gather's scatter-add gradient, and the errors."""
from __future__ import annotations

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse.ir.errors import TilefuseError, TransformError

from conftest import assert_close


def _np(tree):
    return tx.tree_map(np.asarray, tree)


# ---- grad and value_and_grad ---------------------------------------------------------------

def test_grad_of_dict_params_has_the_same_structure(device, rng):
    params = {"w": rng.standard_normal((3, 2)).astype(np.float32),
              "b": rng.standard_normal(2).astype(np.float32)}
    x = rng.standard_normal((4, 3)).astype(np.float32)

    def loss(p, x):
        return tnp.sum((x @ p["w"] + p["b"]) ** 2)
    g = tx.grad(loss)(params, x)
    assert set(g) == {"w", "b"}
    y = x @ params["w"] + params["b"]
    assert_close(g["w"], x.T @ (2 * y), rtol=1e-5, atol=1e-5)
    assert_close(g["b"], (2 * y).sum(0), rtol=1e-5, atol=1e-5)
    assert isinstance(g["w"], tx.Array)


def test_argnums_tuple_and_negative(device):
    f = lambda x, y, z: tnp.sum(x * y * z)  # noqa: E731
    x, y, z = np.float32(2.0), np.float32(3.0), np.float32(5.0)
    gx, gz = tx.grad(f, argnums=(0, -1))(x, y, z)
    assert (float(gx), float(gz)) == (15.0, 6.0)
    (gy,) = tx.grad(f, argnums=(1,))(x, y, z)
    assert float(gy) == 10.0


def test_value_and_grad_and_has_aux(device):
    def f(x):
        y = tnp.sum(x ** 2)
        return y, {"norm": tnp.sqrt(y), "n": 3}
    x = np.array([1.0, 2.0, 2.0], np.float32)
    (val, aux), g = tx.value_and_grad(f, has_aux=True)(x)
    assert float(val) == 9.0 and float(aux["norm"]) == 3.0 and aux["n"] == 3
    assert_close(g, 2 * x)
    g2, aux2 = tx.grad(f, has_aux=True)(x)
    assert_close(g2, 2 * x)
    assert float(aux2["norm"]) == 3.0


def test_grad_of_python_scalar_and_kwargs(device):
    f = lambda x, scale=1.0: scale * x ** 3  # noqa: E731
    assert float(tx.grad(f)(2.0, scale=0.5)) == pytest.approx(6.0)


def test_grad_of_unused_argument_is_zero(device):
    g = tx.grad(lambda x, y: tnp.sum(x * 2.0), argnums=1)(np.ones(2, np.float32), np.ones(3, np.float32))
    assert isinstance(g, tx.Array)
    assert_close(g, np.zeros(3, np.float32))


def test_grad_of_constant_function(device):
    g = tx.grad(lambda x: 3.0)(np.ones(2, np.float32))
    assert_close(g, np.zeros(2, np.float32))


def test_fan_out_accumulates(device):
    f = lambda x: tnp.sum(x * x + tnp.sin(x) * x)  # noqa: E731
    x = np.array([0.3, -1.2], np.float64)
    assert_close(tx.grad(f)(x), 2 * x + np.cos(x) * x + np.sin(x))


# ---- vjp, jvp, Jacobians -------------------------------------------------------------------

def test_vjp_pytrees(device, rng):
    x = rng.standard_normal(3)
    y = rng.standard_normal(3)
    out, fn = tx.vjp(lambda a, b: {"s": a * b, "t": tnp.sum(a)}, x, y)
    assert_close(out["s"], x * y)
    ct = {"s": np.array([1.0, 2.0, 3.0]), "t": np.float64(0.5)}
    gx, gy = fn(ct)
    assert_close(gx, ct["s"] * y + 0.5)
    assert_close(gy, ct["s"] * x)


def test_vjp_has_aux_and_structure_error(device):
    out, fn, aux = tx.vjp(lambda a: (a * 2.0, "note"), np.ones(2), has_aux=True)
    assert aux == "note"
    (g,) = fn(np.array([1.0, 3.0]))
    assert_close(g, [2.0, 6.0])
    with pytest.raises(TransformError, match="structure"):
        fn((np.ones(2), np.ones(2)))
    with pytest.raises(TransformError, match="shape"):
        fn(np.ones(3))


def test_jvp(device):
    x = np.array([0.5, 1.0], np.float64)
    out, t = tx.jvp(lambda a: tnp.exp(a) * a, (x,), (np.array([1.0, 2.0]),))
    assert_close(out, np.exp(x) * x)
    assert_close(t, (np.exp(x) * x + np.exp(x)) * [1.0, 2.0])
    with pytest.raises(TransformError, match="tangent"):
        tx.jvp(tnp.sin, (x,), (np.ones(3),))


def test_jacobians_and_hessian(device, rng):
    A = rng.standard_normal((3, 2))
    x = rng.standard_normal(2)
    f = lambda x: tnp.tanh(A @ x)  # noqa: E731
    J = (1 - np.tanh(A @ x) ** 2)[:, None] * A
    assert_close(tx.jacrev(f)(x), J)
    assert_close(tx.jacfwd(f)(x), J)
    g = lambda x: tnp.sum(x ** 3) + x[0] * x[1]  # noqa: E731
    H = np.diag(6 * x) + np.array([[0, 1], [1, 0]])
    assert_close(tx.hessian(g)(x), H)


def test_jacobian_pytree_structure(device):
    def f(p):
        return {"a": p["x"] * 2.0, "b": tnp.sum(p["y"])}
    p = {"x": np.ones(2), "y": np.ones((2, 2))}
    for jac in (tx.jacrev, tx.jacfwd):
        J = jac(f)(p)
        assert np.asarray(J["a"]["x"]).shape == (2, 2)
        assert np.asarray(J["a"]["y"]).shape == (2, 2, 2)
        assert np.asarray(J["b"]["y"]).shape == (2, 2)
        assert_close(J["a"]["x"], 2 * np.eye(2))
        assert_close(J["a"]["y"], np.zeros((2, 2, 2)))
        assert_close(J["b"]["y"], np.ones((2, 2)))


# ---- stop_gradient, custom_vjp -----------------------------------------------------------------

def test_stop_gradient(device):
    x = np.array([1.0, 2.0])
    f = lambda x: tnp.sum(x * tx.stop_gradient(x))  # noqa: E731
    assert_close(tx.grad(f)(x), x)
    _, t = tx.jvp(lambda x: tx.stop_gradient({"a": x})["a"], (x,), (np.ones(2),))
    assert_close(t, np.zeros(2))


@tx.custom_vjp
def clip_gradient(x, lo, hi):
    return x


def _clip_fwd(x, lo, hi):
    return x, (lo, hi)


def _clip_bwd(res, ct):
    lo, hi = res
    return tnp.clip(ct, lo, hi), None, None


clip_gradient.defvjp(_clip_fwd, _clip_bwd)


def test_custom_vjp_is_used(device):
    x = np.array([1.0, 2.0, 3.0])
    f = lambda x: tnp.sum(clip_gradient(x, -0.5, 0.5) * np.array([0.1, 1.0, -2.0]))  # noqa: E731
    assert_close(tx.grad(f)(x), [0.1, 0.5, -0.5])
    assert_close(tx.jit(tx.grad(f))(x), [0.1, 0.5, -0.5])
    assert_close(clip_gradient(x, 0.0, 1.0), x)  # a plain call runs the function


@tx.custom_vjp
def softplus(x):
    return tnp.log1p(tnp.exp(x))


softplus.defvjp(lambda x: (softplus(x), x), lambda x, ct: (ct * tnp.exp(x) / (1 + tnp.exp(x)),))


def test_custom_vjp_second_order_and_check_grads(device):
    x = np.array([-1.0, 0.5, 2.0])
    s = 1 / (1 + np.exp(-x))
    assert_close(tx.grad(lambda x: tnp.sum(softplus(x)))(x), s)
    # grad of grad differentiates through the user's bwd
    gg = tx.grad(lambda x: tnp.sum(tx.grad(lambda y: tnp.sum(softplus(y)))(x)))(x)
    assert_close(gg, s * (1 - s))
    tx.check_grads(softplus, (x,), order=2)


def test_custom_vjp_pytree_arguments(device):
    @tx.custom_vjp
    def f(p):
        return p["a"] * p["b"]

    def fwd(p):
        return f(p), p

    def bwd(p, ct):
        return ({"a": ct * p["b"] * 10.0, "b": ct * p["a"]},)
    f.defvjp(fwd, bwd)
    g = tx.grad(lambda p: tnp.sum(f(p)))({"a": np.array([1.0]), "b": np.array([2.0])})
    assert_close(g["a"], [20.0])
    assert_close(g["b"], [1.0])


def test_custom_vjp_errors(device):
    @tx.custom_vjp
    def f(x):
        return x * 2.0
    with pytest.raises(TransformError, match="defvjp"):
        f(np.ones(2))
    f.defvjp(lambda x: (f(x), None), lambda r, ct: ct)  # not a tuple
    with pytest.raises(TransformError, match="one cotangent per argument"):
        tx.grad(lambda x: tnp.sum(f(x)))(np.ones(2))
    f.defvjp(lambda x: (f(x), None), lambda r, ct: (np.ones(3),))
    with pytest.raises(TransformError, match="shape"):
        tx.grad(lambda x: tnp.sum(f(x)))(np.ones(2))


def test_check_grads_catches_a_wrong_derivative(device):
    @tx.custom_vjp
    def f(x):
        return tnp.sin(x)
    f.defvjp(lambda x: (f(x), x), lambda x, ct: (ct * tnp.cos(x) * 1.01,))
    x = np.array([0.3, 1.0])
    tx.check_grads(f, (x,), order=1, modes=("fwd",))  # forward mode differentiates sin itself
    with pytest.raises(AssertionError, match="VJP"):
        tx.check_grads(f, (x,), order=1, modes=("rev",))


# ---- documented tie rules and gather ---------------------------------------------------------

def test_max_ties_split_equally(device):
    # tnp.maximum: each operand gets half at a tie; relu(x) = max(x, 0) has slope 1/2 at 0
    g = tx.grad(lambda x: tnp.sum(tnp.maximum(x, 0.0)))(np.array([-1.0, 0.0, 2.0]))
    assert_close(g, [0.0, 0.5, 1.0])
    assert float(tx.grad(lambda x: tnp.maximum(x, x))(1.5)) == 1.0
    # reduce_max: the cotangent is split equally among all positions holding the maximum
    g = tx.grad(lambda x: tnp.max(x))(np.array([1.0, 3.0, 3.0, 0.0]))
    assert_close(g, [0.0, 0.5, 0.5, 0.0])
    g = tx.grad(lambda x: tnp.sum(tnp.min(x, axis=1)))(np.array([[2.0, 2.0, 2.0], [1.0, 0.0, 5.0]]))
    assert_close(g, [[1 / 3, 1 / 3, 1 / 3], [0.0, 1.0, 0.0]])
    _, t = tx.jvp(tnp.max, (np.array([1.0, 3.0, 3.0]),), (np.array([5.0, 1.0, 2.0]),))
    assert float(t) == 1.5


def test_argmax_has_zero_gradient(device):
    x = np.array([1.0, 3.0, 2.0])
    f = lambda x: tnp.take(x, tnp.argmax(x)) * 2.0  # noqa: E731  the index itself carries none
    assert_close(tx.grad(f)(x), [0.0, 2.0, 0.0])


def test_embedding_gather_differentiates_to_scatter_add(device, rng):
    table = rng.standard_normal((5, 3)).astype(np.float32)
    ids = np.array([[0, 2], [2, 4]], np.int32)
    w = rng.standard_normal((2, 2, 3)).astype(np.float32)
    f = lambda t: tnp.sum(tnp.take(t, ids, axis=0) * w)  # noqa: E731
    expected = np.zeros_like(table)
    np.add.at(expected, ids.reshape(-1), w.reshape(-1, 3))
    assert_close(tx.grad(f)(table), expected, rtol=1e-6, atol=1e-6)
    graph = tx.make_graph(tx.grad(f))(table)
    assert graph.count("gather") == 1 and graph.count("scatter_add") == 1


# ---- errors ------------------------------------------------------------------------------------

def test_grad_of_non_scalar_suggests_vjp_or_jacrev(device):
    with pytest.raises(TransformError, match=r"scalar.*vjp.*jacrev"):
        tx.grad(lambda x: x * 2.0)(np.ones(3))
    with pytest.raises(TransformError, match="has_aux=True"):
        tx.grad(lambda x: (tnp.sum(x), x))(np.ones(3))


def test_integer_and_bool_inputs_are_named(device):
    def loss(weights, labels):
        return tnp.sum(weights * labels)
    with pytest.raises(TransformError, match=r"'labels'.*int32.*floating-point"):
        tx.grad(loss, argnums=1)(np.ones(2, np.float32), np.ones(2, np.int32))
    with pytest.raises(TransformError, match=r"'p'.*\['mask'\].*bool"):
        tx.grad(lambda p: tnp.sum(p["w"]))({"w": np.ones(2), "mask": np.ones(2, bool)})
    with pytest.raises(TransformError, match="int32"):
        tx.jacfwd(lambda n: n * 2)(np.int32(3))
    # integers are fine when not differentiated
    assert_close(tx.grad(loss)(np.ones(2, np.float32), np.array([2, 3], np.int32)), [2.0, 3.0])


def test_argnums_errors(device):
    f = lambda x, y: tnp.sum(x * y)  # noqa: E731
    with pytest.raises(TransformError, match=r"argnums=2 is out of range.*2 positional"):
        tx.grad(f, argnums=2)(np.ones(2), np.ones(2))
    with pytest.raises(TransformError, match="argnums"):
        tx.grad(f, argnums="x")(np.ones(2), np.ones(2))
    with pytest.raises(TransformError, match="repeats"):
        tx.grad(f, argnums=(0, 0))(np.ones(2), np.ones(2))


def test_has_aux_wrong_return(device):
    with pytest.raises(TransformError, match=r"has_aux=True.*pair"):
        tx.grad(lambda x: tnp.sum(x), has_aux=True)(np.ones(2))
    with pytest.raises(TransformError, match=r"has_aux=True.*tuple of 3"):
        tx.value_and_grad(lambda x: (tnp.sum(x), 1, 2), has_aux=True)(np.ones(2))


def test_non_float_output_and_non_array_argument(device):
    with pytest.raises(TransformError, match="int32"):
        tx.grad(lambda x: tnp.argmax(x))(np.ones(3))
    with pytest.raises(TransformError, match="str"):
        tx.grad(lambda x: 1.0)("hello")
    with pytest.raises(TilefuseError):
        tx.jacrev(lambda x: tnp.argmax(x))(np.ones(3))
