"""jit: tracing once per signature (trace_count), static arguments, methods, lower(), nesting,
leaked tracers, and the values it computes on every device."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from conftest import assert_close


def test_second_call_does_not_retrace(device):
    f = tx.jit(lambda x, y: tnp.tanh(x @ y) + 1.0)
    x = np.ones((3, 4), np.float32)
    y = np.full((4, 2), 0.1, np.float32)
    want = np.tanh(x @ y) + 1
    assert_close(f(x, y), want)
    assert f.trace_count == 1
    assert_close(f(x, y), want)
    assert_close(f(x * 2, y), np.tanh(2 * x @ y) + 1)  # new values, same signature
    assert_close(f(tx.device_put(x, device), y), want)  # an Array of the same aval: same graph
    assert f.trace_count == 1


def test_new_shape_or_dtype_retraces(monkeypatch):
    monkeypatch.setattr(tx.config, "shape_generic", False)  # (tests/tracer/test_symbolic_sizes.py)
    f = tx.jit(lambda x: x * 2)
    f(np.ones(3, np.float32))
    f(np.ones(4, np.float32))
    assert f.trace_count == 2
    f(np.ones(4, np.int32))
    assert f.trace_count == 3
    f(np.ones((4, 1), np.float32))
    assert f.trace_count == 4
    f(np.ones(3, np.float32))
    f(np.ones(4, np.int32))
    assert f.trace_count == 4  # all seen before
    assert f.cache_size() == 4


def test_python_scalars_are_weak_and_share_a_trace():
    f = tx.jit(lambda x, s: x * s)
    x = np.ones(3, np.float32)
    assert f(x, 2.0).dtype == np.float32
    np.testing.assert_array_equal(f(x, 3.0), [3, 3, 3])
    assert f.trace_count == 1
    assert f(x, 2).dtype == np.float32  # an int scalar: a new (weak int) signature
    assert f.trace_count == 2
    np.testing.assert_array_equal(f(np.arange(3, dtype=np.int32), 2), [0, 2, 4])
    assert f(np.arange(3, dtype=np.int32), 2).dtype == np.int32
    assert f(x, np.float32(2)).dtype == np.float32  # a numpy scalar is a strong 0-d array


def test_operations_outside_jit_give_what_jit_gives(device):
    """Eager operators take a fast path where operands need no promotion or broadcasting, and
    broadcast numpy constants as views: the values, dtypes and weak types are jit's, for
    Arrays, weak Python scalars (arguments too), numpy constants, broadcasting and int-to-float
    promotion."""
    f32 = tx.device_put(np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4), device)
    weak = 1.5  # a Python scalar: weak (jit traces it as a weak 0-d argument)
    i32 = tx.device_put(np.arange(12, dtype=np.int32).reshape(3, 4), device)
    col = tx.device_put(np.arange(3, dtype=np.float32).reshape(3, 1), device)
    cases = {
        "same shapes": lambda a, w, i, c: a * a - a,
        "unary": lambda a, w, i, c: tnp.tanh(a) + tnp.exp(-a),
        "python scalars": lambda a, w, i, c: (a * 2.0, 3 - a, i * 2, i / 2),
        "numpy scalar constant": lambda a, w, i, c: a * np.float32(2) + np.arange(4, dtype=np.float32),
        "broadcast": lambda a, w, i, c: (a + c, c * a),
        "promotion": lambda a, w, i, c: (a + i, tnp.sqrt(i), i + i),
        "weak operands": lambda a, w, i, c: (w + a, i * w, tnp.maximum(a, w)),
        "float16 with a scalar": lambda a, w, i, c: a.astype(np.float16) * 2.0,
    }
    every = tx.jit(lambda *args: {name: fn(*args) for name, fn in cases.items()})(f32, weak, i32, col)  # one compile
    for name, fn in cases.items():
        eager = tx.tree_util.tree_leaves(fn(f32, weak, i32, col))
        jitted = tx.tree_util.tree_leaves(every[name])
        assert len(eager) == len(jitted), name
        for e, j in zip(eager, jitted):
            assert (e.shape, e.dtype, e.weak_type) == (j.shape, j.dtype, j.weak_type), (name, e, j)
            np.testing.assert_allclose(np.asarray(e, np.float64), np.asarray(j, np.float64), rtol=1e-6, err_msg=name)


def test_pytree_arguments_and_outputs():
    @tx.jit
    def f(params, xs, opt=None):
        h = xs["x"] @ params["w"] + params["b"]
        return {"h": h, "pair": (h.sum(), [h.max()]), "none": None}

    p = {"w": np.ones((3, 2), np.float32), "b": np.zeros(2, np.float32)}
    out = f(p, {"x": np.ones((4, 3), np.float32)})
    assert set(out) == {"h", "pair", "none"} and out["none"] is None
    np.testing.assert_array_equal(out["h"], np.full((4, 2), 3))
    assert float(out["pair"][0]) == 24.0 and float(out["pair"][1][0]) == 3.0
    f(p, {"x": np.ones((4, 3), np.float32)})
    assert f.trace_count == 1
    f(p, {"x": np.ones((4, 3), np.float32)}, opt=None)  # kwargs: another tree structure
    assert f.trace_count == 2


def test_static_argnums_and_argnames():
    calls = []

    def f(x, n, mode="add"):
        calls.append((n, mode))
        return x + n if mode == "add" else x * n

    g = tx.jit(f, static_argnums=1, static_argnames="mode")
    x = np.ones(2, np.float32)
    np.testing.assert_array_equal(g(x, 3), [4, 4])
    np.testing.assert_array_equal(g(x, 3), [4, 4])
    assert g.trace_count == 1
    np.testing.assert_array_equal(g(x, 4), [5, 5])
    assert g.trace_count == 2
    np.testing.assert_array_equal(g(x, 4, mode="mul"), [4, 4])
    np.testing.assert_array_equal(g(x, 4, mode="mul"), [4, 4])
    assert g.trace_count == 3
    np.testing.assert_array_equal(g(x, n=4, mode="mul"), [4, 4])  # n by name: static too
    assert len(calls) == g.trace_count
    h = tx.jit(f, static_argnames=("n",))  # a position named by name
    np.testing.assert_array_equal(h(x, 2), [3, 3])
    assert h.static_argnums == {1}
    k = tx.jit(f, static_argnums=-2)  # negative positions count from the end of the parameters
    np.testing.assert_array_equal(k(x, 1), [2, 2])


def test_static_value_controls_python_flow():
    @functools.partial(tx.jit, static_argnums=(1,))
    def f(x, depth):
        for _ in range(depth):
            x = tnp.tanh(x)
        return x

    x = np.array([0.5, -1.0], np.float32)
    assert_close(f(x, 3), np.tanh(np.tanh(np.tanh(x))))
    assert tx.jit(lambda x: x).lower(x).graph.count() == 0
    assert f.lower(x, 3).graph.count("tanh") == 3


def test_unhashable_static_argument_is_an_error():
    g = tx.jit(lambda x, shape: x.reshape(shape), static_argnums=1)
    with pytest.raises(tx.TilefuseError, match="'shape' must be hashable.*list"):
        g(np.ones(4), [2, 2])
    np.testing.assert_array_equal(g(np.ones(4), (2, 2)), np.ones((2, 2)))


def test_decorator_forms():
    @tx.jit
    def a(x):
        return x + 1

    @tx.jit(static_argnums=1)
    def b(x, k):
        return x * k

    assert a.__name__ == "a" and a.__doc__ is None
    np.testing.assert_array_equal(a(np.zeros(2, np.float32)), [1, 1])
    np.testing.assert_array_equal(b(np.ones(2, np.float32), 3), [3, 3])
    np.testing.assert_array_equal(tx.jit(a)(np.zeros(1, np.float32)), [1])  # jit of jit


def _classes():
    """Fresh classes per test (a class-level jit keeps its trace count across tests)."""
    class Scaler:
        def __init__(self, k):
            self.k = k

        @tx.jit
        def __call__(self, x):
            return x * self.k

        @functools.partial(tx.jit, static_argnums=2)
        def power(self, x, n):
            return x ** n

    @tx.register_dataclass
    @dataclass
    class Linear:
        w: np.ndarray
        b: np.ndarray

        @tx.jit
        def apply(self, x):
            return x @ self.w + self.b

    return Scaler, Linear


def test_jit_on_methods(device):
    Scaler, Linear = _classes()
    x = np.array([1.0, 2.0], np.float32)
    s2, s3 = Scaler(2.0), Scaler(3.0)
    np.testing.assert_array_equal(s2(x), [2, 4])
    np.testing.assert_array_equal(s3(x), [3, 6])  # another instance: its own trace (static self)
    np.testing.assert_array_equal(s2(x), [2, 4])
    assert Scaler.__call__.trace_count == 2
    np.testing.assert_array_equal(s2.power(x, 3), [1, 8])
    np.testing.assert_array_equal(s2.power(x, 2), [1, 4])
    assert s2.power.trace_count == 2
    assert "integer_pow[y=3]" in str(s2.power.lower(x, 3))
    # a pytree instance is a traced argument: new weights, no retrace
    m = Linear(np.ones((2, 3), np.float32), np.zeros(3, np.float32))
    np.testing.assert_array_equal(m.apply(x), [3, 3, 3])
    m2 = Linear(np.full((2, 3), 2, np.float32), np.ones(3, np.float32))
    np.testing.assert_array_equal(m2.apply(x), [7, 7, 7])
    assert Linear.apply.trace_count == 1


def test_lower_and_make_graph_text():
    def f(x, y):
        return tnp.exp(x * 2.0) + y.sum()

    x = np.ones((2, 3), np.float32)
    y = np.ones(4, np.int32)
    lowered = tx.jit(f).lower(x, y)
    text = str(lowered)
    assert text == lowered.as_text() == str(lowered.graph)
    assert text.splitlines()[0] == "{ lambda a:f32[2,3] b:i32[4] ."
    for piece in ("mul a", "2.0:f32", "exp", "reduce_sum[axes=(0,)] b", "convert_element_type", "add"):
        assert piece in text, (piece, text)
    assert text.rstrip().endswith("}") and " in (" in text.splitlines()[-1]
    g = tx.make_graph(f)(x, y)
    assert isinstance(g, tx.ir.Graph) and str(g) == text
    assert [str(a) for a in g.in_avals] == ["f32[2,3]", "i32[4]"]
    assert [str(a) for a in g.out_avals] == ["f32[2,3]"]
    assert g.count("exp") == 1
    assert "digraph" in g.to_dot() and "exp" in g.to_dot()
    # lowering does not run, and it shares jit's trace cache
    jf = tx.jit(f)
    jf.lower(x, y)
    jf(x, y)
    assert jf.trace_count == 1
    sg = tx.make_graph(lambda x, n: x * n, static_argnums=1)(x, 3)
    assert "3.0:f32" in str(sg) or "3:i32" in str(sg)


def test_constants_captured_from_the_closure(device):
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    f = tx.jit(lambda x: x @ w + 1.5)
    x = np.ones((1, 2), np.float32)
    assert_close(f(x), x @ w + 1.5)
    g = tx.make_graph(lambda x: x @ w + 1.5)(x)
    assert len(g.consts) == 1 and g.consts[0].shape == (2, 3)  # arrays are constvars
    assert "1.5:f32" in str(g)  # scalars are literals
    dev_w = tx.device_put(w, device)
    assert_close(tx.jit(lambda x: x @ dev_w)(x), x @ w)


def test_nested_jit_inlines(device):
    inner = tx.jit(lambda x: tnp.sin(x) * 2)
    outer = tx.jit(lambda x: inner(x) + inner(x * 2))
    x = np.linspace(0, 1, 5).astype(np.float32)
    assert_close(outer(x), np.sin(x) * 2 + np.sin(2 * x) * 2)
    g = tx.make_graph(lambda x: inner(x) + 1)(x)
    assert g.count("sin") == 1  # the inner graph is replayed into the outer one
    assert inner.trace_count == 1


def test_outputs_live_on_the_device(device):
    f = tx.jit(lambda x: (x + 1, x.sum()))
    a, s = f(np.ones(3, np.float32))
    assert isinstance(a, tx.Array) and a.device is device and s.shape == ()
    assert f(tx.device_put(np.ones(3, np.float32), device))[0].device is device
    explicit = tx.jit(lambda x: x * 2, device=device)
    assert explicit(np.ones(2, np.float32)).device is device


def test_zero_argument_and_constant_outputs(device):
    f = tx.jit(lambda: tnp.arange(4) * 2)
    np.testing.assert_array_equal(f(), [0, 2, 4, 6])
    g = tx.jit(lambda x: (x, 3.0, np.ones(2, np.float32)))
    x, three, ones = g(np.zeros(1, np.float32))
    assert float(three) == 3.0 and np.asarray(ones).tolist() == [1, 1]


def test_non_array_output_is_rejected():
    with pytest.raises(tx.TilefuseError, match="returned a str"):
        tx.jit(lambda x: "hello")(np.ones(2))


def test_leaked_tracer_raises():
    leaked = []

    @tx.jit
    def f(x):
        leaked.append(x)
        return x + 1

    f(np.ones(2, np.float32))
    with pytest.raises(tx.TracerLeakError, match=r"f32\[2\].*escaped") as e:
        leaked[0] + 1
    assert __file__ in str(e.value)
    g = tx.jit(lambda y: y * leaked[0])  # used inside another trace: still a leak, not a wrong answer
    with pytest.raises(tx.TracerLeakError):
        g(np.ones(2, np.float32))


def test_clear_cache_retraces():
    f = tx.jit(lambda x: x + 1)
    f(np.ones(2, np.float32))
    f.clear_cache()
    f(np.ones(2, np.float32))
    assert f.trace_count == 2


def test_config_change_recompiles_but_does_not_retrace():
    f = tx.jit(lambda x: x + 1)
    x = np.ones(2, np.float32)
    f(x)
    old = tx.config.fusion
    try:
        tx.config.fusion = not old
        f(x)
    finally:
        tx.config.fusion = old
    assert f.cache_size() == 2 and f.trace_count == 1


def test_jit_is_fast_on_a_cache_hit():
    """The hit path does no flattening, no tracing: far below a millisecond on any machine."""
    import time
    f = tx.jit(lambda x: x + 1)
    x = np.ones(8, np.float32)
    f(x)
    t = time.perf_counter()
    for _ in range(200):
        f(x)
    per_call = (time.perf_counter() - t) / 200
    assert per_call < 2e-3, per_call
    assert f.trace_count == 1


def test_jit_of_partials_and_callable_objects():
    def f(a, x):
        return a * x

    g = tx.jit(functools.partial(f, 2.0))
    np.testing.assert_array_equal(g(np.ones(2, np.float32)), [2, 2])

    class AddOne:
        def __call__(self, x):
            return x + 1

    h = tx.jit(AddOne())
    np.testing.assert_array_equal(h(np.ones(2, np.float32)), [2, 2])
    with pytest.raises(tx.TilefuseError, match="argument 'x' of AddOne is a str"):
        h("nope")


def test_lowered_compiles_for_its_device(device):
    x = np.arange(4, dtype=np.float32)
    lowered = tx.jit(lambda v: tnp.exp(v) * 2.0).lower(x)
    assert lowered.device is device
    exe = lowered.compile()
    assert_close(exe([x])[0], np.exp(x) * 2)
    assert lowered.optimized_graph().count("exp") == 1
    assert isinstance(lowered.sources(), dict)
    assert tx.jit(lambda v: v).lower(x, device="ref").device.name == "ref"


def test_committed_and_uncommitted_arrays_do_not_share_a_fast_key(device):
    f = tx.jit(lambda x: x + 1)
    placed = tx.device_put(np.ones(2, np.float32), "ref")  # committed to ref
    assert f(placed).device.name == "ref"
    loose = tnp.ones(2)  # uncommitted: runs on the default device (the one under test)
    if loose.device.name == "ref":
        loose_on_ref = loose
    else:
        loose_on_ref = tx.device_put(np.ones(2, np.float32), "ref")
        loose_on_ref.committed = False
    assert f(loose_on_ref).device is device
    assert f(placed).device.name == "ref"
