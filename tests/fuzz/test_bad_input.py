"""Bad input at the API: every row is a mistake a user makes, the tilefuse error it must raise
(never a raw numpy/backend exception, never a crash) and text the message must hold: the
argument's name, the value or the structures involved."""
from __future__ import annotations

import re

import numpy as np
import pytest
from tilefuse.ir.errors import ArgumentError

import tilefuse as tx
import tilefuse.numpy as tnp

X = np.ones(3, np.float32)


def add(x, y):
    return x + y


def _jit_twice_with_other_tree():
    f = tx.jit(lambda params: params["w"] * 2)
    f({"w": X})
    return tx.optim.apply_updates({"w": X, "b": X}, {"w": X})  # updates for another model


def _nan_from_log():
    tx.jit(lambda x: tnp.log(x) * 2)(np.array([-1.0, 1.0], np.float32))


def _nan_input():
    tx.jit(lambda x, y: x * y)(X, np.array([1.0, np.nan, 2.0], np.float32))


# (name, call, error class, regex the message must match)
TABLE = [
    ("string argument", lambda: tx.jit(add)("abc", X), ArgumentError, r"argument 'x' of add is a str"),
    ("object argument", lambda: tx.jit(add)(X, object()), ArgumentError, r"argument 'y' of add is a object"),
    ("object array", lambda: tx.jit(add)(np.array([1, "a"], dtype=object), X), ArgumentError,
     r"argument 'x' of add is an object array"),
    ("string array", lambda: tx.jit(add)(X, np.array(["a", "b", "c"])), tx.DTypeError, r"dtype <U1"),
    ("complex array", lambda: tx.jit(add)(np.ones(3, np.complex64), X), tx.DTypeError, r"complex64"),
    ("ragged list to asarray", lambda: tnp.asarray([[1, 2], [3]]), tx.TilefuseError, r"ragged nested list"),
    ("ragged list to an op", lambda: tnp.sin([[1.0, 2.0], [3.0]]), tx.TilefuseError, r"ragged nested list"),
    ("ragged list through jit", lambda: tx.jit(tnp.asarray)([[1.0, 2.0], [3.0]]), tx.ShapeError,
     r"same shape"),
    ("list of objects", lambda: tnp.asarray([object(), 1]), tx.TilefuseError, r"Python objects"),
    ("Python int over int32 to jit", lambda: tx.jit(add)(2**40, X), ArgumentError,
     r"argument 'x' of add is the Python int 1099511627776"),
    ("Python int over int32 to an op", lambda: tnp.add(np.ones(3, np.int32), 2**40), tx.DTypeError,
     r"Python int 1099511627776 does not fit int32"),
    ("Python int over int32 to asarray", lambda: tnp.asarray(-2**31 - 1), tx.DTypeError,
     r"Python int -2147483649 does not fit int32"),
    ("Python int over int32 in a list", lambda: tnp.asarray([1, 2**33]), tx.DTypeError,
     r"does not fit int32 \(max 8589934592"),
    ("unhashable static argument", lambda: tx.jit(lambda x, n: x * n, static_argnums=1)(X, [1]),
     ArgumentError, r"static argument 'n' must be hashable, got a list"),
    ("non-array output", lambda: tx.jit(lambda x: "done")(X), ArgumentError, r"returned a str"),
    ("shapes that do not broadcast", lambda: tx.jit(add)(X, np.ones(4, np.float32)), tx.ShapeError,
     r"\(3,\), \(4,\)"),
    ("pytrees that differ between calls", _jit_twice_with_other_tree, tx.TilefuseError,
     r"structures differ"),
    ("tree_map of different trees", lambda: tx.tree_map(add, {"a": X}, {"b": X}), tx.TilefuseError,
     r"PyTreeDef\(\{'a': \*\}\) vs PyTreeDef\(\{'b': \*\}\)"),
    ("vmap in_axes of another structure", lambda: tx.vmap(lambda t: t["a"], in_axes=({"b": 0},))({"a": X}),
     tx.TransformError, r"in_axes must be a tree prefix of argument 0 \('t'\)"),
    ("vmap axes of different sizes", lambda: tx.vmap(add)(np.ones((3, 2)), np.ones((4, 2))),
     tx.TransformError, r"argument 0 \('x'\) has size 3, argument 1 \('y'\) has size 4"),
    ("grad of an int argument", lambda: tx.grad(lambda x: (x * 2).sum())(np.ones(3, np.int32)),
     tx.TransformError, r"argument 'x' \(position 0\).*int32"),
    ("grad of a non-scalar", lambda: tx.grad(lambda x: x * 2)(X), tx.TransformError, r"must return a scalar"),
    ("NaN made under debug_nans", _nan_from_log, tx.NaNError, r"= log a\n  at .*test_bad_input.py"),
    ("NaN input under debug_nans", _nan_input, tx.NaNError, r"input leaf 1 of the call already held one"),
]


def test_every_bad_input_raises_a_tilefuse_error_that_names_it(monkeypatch):
    monkeypatch.setattr(tx.config, "default_device", "cpu")
    monkeypatch.setattr(tx.config, "debug_nans", True)
    failures = []
    for name, call, error, pattern in TABLE:
        try:
            call()
        except error as e:
            if not isinstance(e, tx.TilefuseError):
                failures.append(f"{name}: {type(e).__name__} is not a TilefuseError")
            elif not re.search(pattern, str(e), re.DOTALL):
                failures.append(f"{name}: the message does not match {pattern!r}:\n{e}")
        except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
            failures.append(f"{name}: raised {type(e).__name__}: {e}")
        else:
            failures.append(f"{name}: no error")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("value", [np.int64(2**40), np.array([2**40])])
def test_explicit_int64_is_accepted(value):
    assert int(np.asarray(tx.jit(lambda x: x + 1, device="ref")(value)).max()) == 2**40 + 1


# ---- absurd shapes: checked at trace time, never a crash or an empty array ----------------------

@pytest.mark.parametrize("shape", [(-1,), (2, -3), (1 << 63,), (1 << 32, 1 << 32), (0, 1 << 63)])
def test_absurd_shapes_are_shape_errors_at_trace_time(device, shape):
    f = tx.jit(lambda: tnp.zeros(shape), device=device)
    with pytest.raises(tx.ShapeError, match=r"an array of shape .* is (negative|past int64)|more than any "
                                            r"device can address"):
        f()
    with pytest.raises(tx.ShapeError, match=r"\n  at .*test_bad_input.py:\d+"):
        tx.jit(lambda x: tnp.broadcast_to(x, shape), device=device)(X[:1])


def test_a_size_beyond_the_device_is_out_of_memory(device):
    f = tx.jit(lambda: tnp.zeros((1 << 60,)) + 1.0, device=device)  # 4 EiB: fits int64, no device
    with pytest.raises(tx.OutOfMemoryError, match=r"cannot allocate"):
        f()
    np.testing.assert_array_equal(np.asarray(tx.jit(lambda: tnp.zeros((3,)) + 1.0, device=device)()), 1.0)
