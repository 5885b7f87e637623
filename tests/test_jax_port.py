"""What JAX and autograd programs rely on when only their imports change (issues 18, 19, 23):
errors of the builtin classes JAX raises, dtype names as scalar constructors, nn.softmax and
nn.relu at their edges as JAX computes them, optimizers in the parameters' precision."""
from __future__ import annotations

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse import nn, optim


# ---- errors ------------------------------------------------------------------------------------

def test_ragged_list_names_the_function_and_argument(device):
    ragged = [[1.0, 2.0], [3.0]]
    for call, where in [(lambda: tnp.sum(ragged), "sum: argument 'x'"),
                        (lambda: tnp.add(1.0, ragged), "add: argument 'y'"),
                        (lambda: tnp.asarray(ragged), "asarray: argument 'x'"),
                        (lambda: tx.jit(lambda a: tnp.mean(tnp.asarray(ragged)) + a)(1.0), "asarray: argument 'x'")]:
        with pytest.raises(tx.TilefuseError, match=f"{where} is a ragged nested list.*lengths \\[2, 1\\]"):
            call()


def test_take_with_float_indices_is_a_dtype_error(device):
    x = np.arange(4.0, dtype=np.float32)
    for idx in (np.array([1.0, 2.0]), 1.5, tnp.asarray([0.0])):
        with pytest.raises(tx.DTypeError, match="take: indices must be integers"):
            tnp.take(x, idx)
    with pytest.raises(tx.DTypeError):
        tx.jit(lambda x, i: tnp.take(x, i))(x, np.array([1.0], np.float32))
    assert isinstance(tx.DTypeError("x"), TypeError)


def test_shape_errors_are_type_errors_where_jax_raises_type_error(device):
    a, b = tnp.ones((3,)), tnp.ones((4,))
    for call in (lambda: a @ b, lambda: tnp.reshape(a, (4,)), lambda: tnp.concatenate([tnp.ones((2, 3)),
                                                                                         tnp.ones((2, 4))]),
                 lambda: tx.jit(lambda x, y: tnp.dot(x, y))(np.ones((2, 3)), np.ones((2, 3)))):
        with pytest.raises(TypeError):
            call()
        with pytest.raises(tx.ShapeError):
            call()
    with pytest.raises(ValueError):  # broadcasting stays a ValueError, as in JAX
        tnp.add(a, b)


def test_concretization_error_is_a_type_error(device):
    def f(x):
        if x > 0:
            return x
        return -x
    with pytest.raises(TypeError):
        tx.jit(f)(1.0)
    with pytest.raises(tx.ConcretizationError):
        tx.jit(f)(1.0)


# ---- dtype names -----------------------------------------------------------------------------

SCALAR_TYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                "uint16", "uint32", "uint64", "bool_", "bool", "half", "single", "double", "float_", "int_",
                "uint"]


@pytest.mark.parametrize("name", SCALAR_TYPES)
def test_dtype_names_are_scalar_constructors(name, device):
    t = getattr(tnp, name)
    want = np.dtype(t)
    assert t == want and want == t and hash(t) == hash(want) and tnp.dtype(t) == want
    assert np.zeros(2, t).dtype == want and np.ones(2).astype(t).dtype == want
    x = t(3)
    assert isinstance(x, tx.Array) and x.shape == () and x.dtype == tnp.zeros((), t).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(3).astype(x.dtype))
    y = tx.jit(lambda v: t(v))(np.float32(2.0))
    assert y.dtype == x.dtype and np.asarray(y) == np.asarray(2.0).astype(x.dtype)
    assert t([1, 0]).shape == (2,)


def test_scalar_constructors_as_in_jax(device):
    assert tnp.float32(3).dtype == np.float32 and float(tnp.float32(3)) == 3.0
    assert int(tnp.int32(3.7)) == 3 and tnp.bool_(1).dtype == np.bool_
    assert tnp.issubdtype(tnp.float32, tnp.floating) and not tnp.issubdtype(tnp.int32, tnp.floating)
    assert tnp.arange(3, dtype=tnp.int32).dtype == tnp.int32
    assert tx.jit(lambda x: x.astype(tnp.float16))(np.ones(2, np.float32)).dtype == np.float16


def test_zeros_takes_a_0d_integer_array_as_its_shape(device):
    n = tnp.asarray(3)
    assert tnp.zeros(n).shape == (3,) and tnp.ones((n, 2)).shape == (3, 2)
    assert tnp.full(np.int64(2), 1.0).shape == (2,)
    with pytest.raises(tx.TilefuseError, match="integer"):
        tnp.zeros(tnp.asarray(2.0))
    with pytest.raises(tx.ConcretizationError, match="static"):
        tx.jit(lambda m: tnp.zeros(m))(3)


# ---- nn at its edges -------------------------------------------------------------------------

def test_softmax_of_inf_and_nan_rows_is_nan_as_in_jax(device):
    x = np.array([[np.inf, 1.0], [np.nan, 1.0], [-np.inf, -np.inf], [1.0, 2.0], [-np.inf, 0.0]], np.float32)
    e = np.exp(np.array([1.0, 2.0]) - 2.0)
    want = np.array([[np.nan, np.nan], [np.nan, np.nan], [0, 0], e / e.sum(), [0, 1]], np.float32)
    for f in (nn.softmax, tx.jit(nn.softmax)):
        np.testing.assert_allclose(np.asarray(f(x)), want, rtol=1e-6)
    ls = np.asarray(tx.jit(nn.log_softmax)(x))
    assert np.isnan(ls[:2]).all() and np.isneginf(ls[2]).all() and ls[4, 1] == 0


def test_relu_gradient_at_zero_is_zero(device):
    for f in (tx.grad(nn.relu), tx.jit(tx.grad(nn.relu))):
        assert float(f(0.0)) == 0.0 and float(f(2.0)) == 1.0 and float(f(-1.0)) == 0.0
    g = tx.grad(lambda x: tnp.sum(nn.relu(x)))(np.array([-1.0, 0.0, 3.0], np.float32))
    np.testing.assert_array_equal(np.asarray(g), [0.0, 0.0, 1.0])
    y = np.asarray(nn.relu(np.array([np.nan, -2.0, 0.0, 5.0], np.float32)))
    assert np.isnan(y[0]) and y[1:].tolist() == [0.0, 0.0, 5.0] and not np.signbit(y[1])


# ---- optimizers in the parameters' dtype -----------------------------------------------------

def _adam_reference(p, grads, lr, b1=0.9, b2=0.999, eps=1e-8):
    m = v = np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return p


def test_adam_keeps_float64_precision(device, rng):
    p0 = rng.normal(size=(5,))
    grads = [rng.normal(size=(5,)) for _ in range(4)]
    opt = optim.adam(1e-2)
    params, state = {"w": p0}, opt.init({"w": p0})
    step = tx.jit(lambda params, state, g: _apply(opt, params, state, g))
    for g in grads:
        params, state = step(params, state, {"w": g})
    got = np.asarray(params["w"])
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, _adam_reference(p0, grads, 1e-2), rtol=1e-13, atol=1e-15)


def _apply(opt, params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optim.apply_updates(params, updates), state
