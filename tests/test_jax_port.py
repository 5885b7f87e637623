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
                "uint16", "uint32", "uint64", "bool_", "bool", "half", "single", "double", "float_", "int_", "uint"]


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


# ---- transform helpers: tree_util, flatten_util, elementwise_grad ---------------------------------

def test_ravel_pytree_round_trip(device):
    from tilefuse.flatten_util import ravel_pytree
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": (np.float32(2.5), np.ones(2, np.int32))}
    flat, unravel = ravel_pytree(tree)
    assert flat.shape == (9,) and flat.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(flat), [2.5, 1, 1, 0, 1, 2, 3, 4, 5])  # dict keys sorted
    back = unravel(flat * 2)
    assert back["b"][1].dtype == np.int32 and back["w"].shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(back["w"]), tree["w"] * 2)
    f64 = tx.jit(lambda t: ravel_pytree(t)[0])({"a": np.ones(2), "b": np.zeros(1, np.float32)})
    assert f64.dtype == np.float64
    # a flat-vector optimizer step under grad, as samplers and L-BFGS ports do
    loss = lambda v: tnp.sum(unravel(v)["w"] ** 2)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(tx.grad(loss)(flat))[3:], 2 * tree["w"].ravel())


def test_tree_util_under_jax_names(device):
    from tilefuse import tree_util as tu
    tree = {"a": [1.0, 2.0], "b": (3.0,)}
    assert tu.tree_leaves(tree) == [1.0, 2.0, 3.0]
    assert tu.tree_reduce(lambda x, y: x + y, tree) == 6.0 and tu.tree_reduce(max, tree, 10.0) == 10.0
    assert tu.tree_all(tree) and not tu.tree_all({"x": 0.0}) and tu.tree_any([0.0, 1.0])
    leaves, td = tu.tree_flatten(tree)
    assert tu.tree_unflatten(td, [4.0, 5.0, 6.0]) == {"a": [4.0, 5.0], "b": (6.0,)}
    assert not tu.treedef_is_leaf(td) and tu.treedef_is_leaf(tu.tree_structure(1.0))
    assert len(tu.treedef_children(td)) == 2 and tu.all_leaves([1.0, 2.0])
    outer, inner = tu.tree_structure([0, 0]), tu.tree_structure((0, 0, 0))
    assert tu.tree_transpose(outer, inner, [(1, 2, 3), (4, 5, 6)]) == ([1, 4], [2, 5], [3, 6])

    @tu.register_pytree_node_class
    class Pair:
        def __init__(self, x, y):
            self.x, self.y = x, y

        def tree_flatten(self):
            return (self.x, self.y), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)
    out = tx.jit(lambda p: Pair(p.y, p.x * 2))(Pair(np.float32(1), np.float32(3)))
    assert float(out.x) == 3.0 and float(out.y) == 2.0
    scale = tu.Partial(lambda k, x: k * x, np.float32(3.0))
    applied = tx.jit(lambda f, x: f(x))(scale, np.float32(2.0))
    assert float(applied) == 6.0 and tu.tree_leaves(scale) == [np.float32(3.0)]
    assert tx.tree_util is tu and tx.flatten_util.ravel_pytree is not None


def test_elementwise_grad_as_autograd(device):
    x = np.linspace(-3, 3, 7)
    d1 = tx.elementwise_grad(tnp.tanh)
    np.testing.assert_allclose(np.asarray(d1(x)), 1 - np.tanh(x) ** 2, rtol=1e-12)
    d2 = tx.elementwise_grad(d1)  # autograd's tanh example: derivatives of any order
    np.testing.assert_allclose(np.asarray(tx.jit(d2)(x)), -2 * np.tanh(x) * (1 - np.tanh(x) ** 2), rtol=1e-10)
    g = tx.elementwise_grad(lambda a, b: (a * b, a), argnums=(0, 1))(x, 2 * x)
    np.testing.assert_allclose(np.asarray(g[0]), 2 * x + 1) and np.testing.assert_allclose(np.asarray(g[1]), x)


# ---- example_libraries: optimizers and stax -----------------------------------------------------

def _quadratic_grads(params):
    return {"w": 2 * (params["w"] - 1.0), "b": 4 * params["b"]}


@pytest.mark.parametrize("name,make,reference", [
    ("sgd", lambda o: o.sgd(0.1), lambda p, g, s, i: (p - 0.1 * g, s)),
    ("momentum", lambda o: o.momentum(0.1, 0.9), lambda p, g, s, i: (p - 0.1 * (0.9 * s + g), 0.9 * s + g)),
    ("rmsprop", lambda o: o.rmsprop(0.05, gamma=0.8),
     lambda p, g, s, i: (p - 0.05 * g / np.sqrt(0.8 * s + 0.2 * g * g + 1e-8), 0.8 * s + 0.2 * g * g)),
])
def test_optimizer_triples_match_their_formulas(device, name, make, reference):
    from tilefuse.example_libraries import optimizers
    opt_init, opt_update, get_params = make(optimizers)
    p0 = {"w": np.array([0.5, -2.0]), "b": np.array(3.0)}
    state = opt_init(p0)
    ref = {k: (v.copy(), np.zeros_like(v)) for k, v in p0.items()}
    step = tx.jit(opt_update)
    for i in range(4):
        g = _quadratic_grads(get_params(state))
        state = step(i, g, state)
        ref = {k: reference(ref[k][0], 2 * (ref[k][0] - 1.0) if k == "w" else 4 * ref[k][0], ref[k][1], i)
               for k in ref}
    got = get_params(state)
    for k in p0:
        np.testing.assert_allclose(np.asarray(got[k]), ref[k][0], rtol=1e-12)
        assert np.asarray(got[k]).dtype == np.float64


def test_adam_triple_and_schedules(device):
    from tilefuse.example_libraries import optimizers
    sched = optimizers.exponential_decay(0.1, 2, 0.5)
    opt_init, opt_update, get_params = optimizers.adam(sched)
    p = np.array([1.0, -1.0])
    state = opt_init(p)
    m = v = np.zeros(2)
    for i in range(3):
        g = 2 * p
        state = opt_update(i, g, state)
        m, v = 0.1 * g + 0.9 * m, 0.001 * g * g + 0.999 * v
        p = p - 0.1 * 0.5 ** (i / 2) * (m / (1 - 0.9 ** (i + 1))) / (np.sqrt(v / (1 - 0.999 ** (i + 1))) + 1e-8)
        np.testing.assert_allclose(np.asarray(get_params(state)), p, rtol=1e-12)
    for o in (optimizers.adagrad(0.1), optimizers.adamax(0.1), optimizers.nesterov(0.1, 0.9),
              optimizers.rmsprop_momentum(0.1), optimizers.sm3(0.1)):
        s = o.init_fn(np.ones((2, 2)))
        s = o.update_fn(0, np.full((2, 2), 0.5), s)
        assert (np.asarray(o.params_fn(s)) < 1).all()  # a descent step on a positive gradient
    assert float(optimizers.piecewise_constant([2, 4], [1.0, 0.5, 0.1])(3)) == 0.5
    assert float(optimizers.polynomial_decay(1.0, 4, 0.0)(2)) == 0.5
    np.testing.assert_allclose(float(optimizers.l2_norm({"a": np.ones(4)})), 2.0)
    clipped = optimizers.clip_grads({"a": np.ones(4)}, 1.0)
    np.testing.assert_allclose(np.asarray(clipped["a"]), np.full(4, 0.5))
    packed = optimizers.pack_optimizer_state(optimizers.unpack_optimizer_state(s))
    np.testing.assert_array_equal(np.asarray(o.params_fn(packed)), np.asarray(o.params_fn(s)))


def test_stax_mlp_trains(device):
    from tilefuse import random
    from tilefuse.example_libraries import optimizers, stax
    init_fun, apply_fun = stax.serial(stax.Dense(16), stax.Relu, stax.Dense(3), stax.LogSoftmax)
    out_shape, params = init_fun(random.key(0), (-1, 4))
    assert out_shape == (-1, 3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    y = np.eye(3, dtype=np.float32)[(x[:, 0] > 0).astype(int) + (x[:, 1] > 1)]
    loss = lambda p: -tnp.mean(tnp.sum(apply_fun(p, x) * y, axis=1))  # noqa: E731
    opt_init, opt_update, get_params = optimizers.adam(0.01)
    state = opt_init(params)
    step = tx.jit(lambda i, s: opt_update(i, tx.grad(loss)(get_params(s)), s))
    first = float(loss(params))
    for i in range(30):
        state = step(i, state)
    assert float(loss(get_params(state))) < 0.7 * first
    probs = np.exp(np.asarray(apply_fun(get_params(state), x)))
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)


def test_stax_layers_shapes_and_values(device):
    from tilefuse import random
    from tilefuse.example_libraries import stax
    x = np.random.default_rng(1).normal(size=(2, 6, 6, 3)).astype(np.float32)
    init, apply = stax.serial(stax.Conv(4, (3, 3), padding="SAME"), stax.BatchNorm(), stax.Elu, stax.MaxPool((2, 2)),
                              stax.Flatten, stax.Dropout(0.5, mode="test"), stax.FanOut(2),
                              stax.parallel(stax.Dense(3), stax.Identity), stax.FanInConcat())
    shape, params = init(random.key(1), x.shape)
    out = tx.jit(apply)(params, x)
    assert shape == (2, 39) and out.shape == (2, 39)
    w, b = params[0]
    conv = stax.Conv(4, (3, 3), padding="SAME")[1]((w, b), x)
    ref = np.zeros((2, 6, 6, 4), np.float32)
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    for i in range(6):
        for j in range(6):
            ref[:, i, j] = np.einsum("nhwc,hwco->no", xp[:, i:i + 3, j:j + 3], np.asarray(w))
    np.testing.assert_allclose(np.asarray(conv), ref + np.asarray(b).reshape(1, 1, 1, 4), rtol=1e-4, atol=1e-5)
    for layer, fn in ((stax.Selu, lambda v: 1.0507009873554805 * np.where(v > 0, v, 1.6732632423543772 * np.expm1(v))),
                      (stax.LeakyRelu(0.1), lambda v: np.where(v >= 0, v, 0.1 * v)), (stax.Sigmoid, lambda v: 1 / (1 + np.exp(-v))),
                      (stax.Softplus, lambda v: np.logaddexp(v, 0)), (stax.Softmax, lambda v: np.exp(v) / np.exp(v).sum(-1, keepdims=True)),
                      (stax.Identity, lambda v: v), (stax.Exp, np.exp), (stax.Gelu, None)):
        got = np.asarray(layer[1]((), x[0, 0]))
        if fn is not None:
            np.testing.assert_allclose(got, fn(x[0, 0].astype(np.float64)), rtol=1e-5, atol=1e-6)
    pooled = np.asarray(stax.AvgPool((2, 2))[1]((), x))
    np.testing.assert_allclose(pooled, x.reshape(2, 3, 2, 3, 2, 3).mean(axis=(2, 4)), rtol=1e-5)
    cat = stax.FanInConcat(-1)
    assert cat[0](None, [(2, 3), (2, 4)])[0] == (2, 7)
    drop = stax.Dropout(0.5)[1]((), np.ones((100,), np.float32), rng=random.key(2))
    assert set(np.unique(np.asarray(drop)).tolist()) <= {0.0, 2.0}
    dense_ish = stax.shape_dependent(lambda shape: stax.Dense(shape[-1]))
    assert dense_ish[0](random.key(0), (5, 3))[0] == (5, 3)


# ---- integer dtypes keep their width through jit (issue 23.4) -----------------------------------

NARROW = [np.int8, np.uint8, np.int16, np.uint16, np.uint32, np.int64, np.uint64]


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: np.dtype(d).name)
def test_integer_dtypes_keep_their_width(dtype, device):
    info = np.iinfo(dtype)
    rng = np.random.default_rng(int(np.dtype(dtype).itemsize) * 7 + (np.dtype(dtype).kind == "u"))
    x = rng.integers(max(info.min, -10**6), min(info.max, 10**6), size=12, endpoint=True).astype(dtype)
    y = rng.integers(1, min(info.max, 100), size=12).astype(dtype)
    x[:2] = [info.max, info.min]  # wrapping at both ends

    def f(a, b):
        return (a + b, a - b, a * b, a * 3, -a, a // b, a % b, a > b, tnp.maximum(a, b), tnp.where(a > b, a, b),
                a & b, a | b, a ^ b, ~a, a << 1, a >> 1, tnp.abs(a), tnp.max(a), tnp.min(a), tnp.sort(a),
                a.astype(np.float32) * 0.5, (a.astype(np.float64) * 0.75).astype(dtype), tnp.cumsum(a), tnp.sum(a),
                a[::2], tnp.concatenate([a, b]), tnp.take(a, np.array([3, 0])))

    with np.errstate(all="ignore"):
        want = f(x, y)
        acc = tnp.sum(x).dtype  # sums and cumsums widen (JAX's rule), numpy's go to 64 bits
        want = [*want[:-5], np.cumsum(x, dtype=acc), np.sum(x, dtype=acc), *want[-3:]]
    got = tx.jit(f)(x, y)
    for k, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g)
        assert g.dtype == np.asarray(w).dtype, (k, g.dtype, np.asarray(w).dtype)
        np.testing.assert_array_equal(g, w, err_msg=f"result {k}")


def test_uint8_wraps_as_numpy_and_jax(device):
    x = np.array([200, 100], np.uint8)
    y = tx.jit(lambda a: a * 2)(x)
    assert y.dtype == np.uint8 and np.asarray(y).tolist() == [144, 200]
    assert tx.jit(lambda a: (a * 2) > 150)(x).tolist() == [False, True]  # decided on the wrapped value
    assert (tnp.asarray(x) + 100).dtype == np.uint8  # a Python int is weak
    assert tnp.sum(x).dtype == np.uint32 and int(tnp.sum(x)) == 300  # sums widen, as JAX's
    assert tnp.zeros(3, tnp.int8).dtype == np.int8 and tnp.int16(7).dtype == np.int16


def test_integer_promotion_follows_jax(device):
    cases = [(np.uint8, np.int8, np.int16), (np.uint8, np.int16, np.int16), (np.uint16, np.int8, np.int32),
             (np.uint32, np.int32, np.int64), (np.int8, np.int32, np.int32), (np.uint8, np.uint16, np.uint16),
             (np.uint16, np.float16, np.float16), (np.int64, np.uint8, np.int64), (np.uint64, np.uint8, np.uint64),
             (np.uint64, np.int64, np.float64), (np.uint64, np.int32, np.float64)]
    for a, b, want in cases:
        got = tnp.add(np.ones(2, a), np.ones(2, b)).dtype
        assert got == want, (a, b, got, want)
        assert tnp.promote_types(a, b) == want


def test_unsupported_dtypes_are_clear_errors(device):
    for d in (np.complex64, np.complex128):
        with pytest.raises(tx.DTypeError, match="complex"):
            tnp.asarray(np.ones(2, d))
    with pytest.raises(tx.DTypeError, match="complex"):
        tnp.complex64(1.0)
    with pytest.raises(tx.DTypeError, match="does not fit int32"):  # no int32 holds it: not a silent wrap
        tnp.int32(2**40)


def test_attention_rows_with_inf_or_nan_are_nan_fused_or_not(device):
    """nn.softmax is NaN on rows holding +inf or NaN (JAX's); written-out attention is still
    rewritten to the fused kernel, whose output rows agree (NaN) with the unfused ones."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=(1, 2, 4, 8)).astype(np.float32) for _ in range(3))
    bias = np.zeros((4, 4), np.float32)
    bias[1, 2] = np.inf
    bias[2, 0] = np.nan
    bias[3] = -np.inf  # a row with no key left: zeros

    def attn(q, k, v):
        return nn.softmax(q @ tnp.swapaxes(k, -1, -2) / 8.0 ** 0.5 + bias, axis=-1) @ v
    got = np.asarray(tx.jit(attn)(q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(8.0)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    np.testing.assert_allclose(got[..., 0, :], want[..., 0, :], rtol=1e-4, atol=1e-5)
    assert np.isnan(got[..., 1:3, :]).all() and (got[..., 3, :] == 0).all()
    from tilefuse.ir.passes import run_passes
    optimised = run_passes(tx.make_graph(attn)(q, k, v))
    assert [e.prim.name for e in optimised.eqns].count("fused_attention") == 1, optimised
