"""Bad input at the API: every row is a mistake a user makes, the tilefuse error it must raise
(never a raw numpy/backend exception, never a crash; where JAX raises a builtin exception, the
tilefuse error is one too: a wrong argument count is a TypeError, static_argnums out of range a
ValueError) and text the message must hold: the argument's name, the value or the structures
involved, and the user's line (here, this file's)."""
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


def _self_referential_list():
    leaves = [X]
    leaves.append(leaves)
    tx.jit(lambda t: t[0] * 2.0)(leaves)


def _tree_3000_deep():
    t = X
    for _ in range(3000):
        t = {"a": t}
    tx.jit(lambda t: 1.0)(t)


Static = (tx.StaticArgumentError, ValueError)  # as JAX: a ValueError
WrongCall = (ArgumentError, TypeError)  # as JAX (and Python): a TypeError


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
    # calls that do not fit the function, static arguments that name no parameter
    ("too few arguments", lambda: tx.jit(add)(X), WrongCall, r"add\(\) cannot take .*missing .*'y'"),
    ("too many arguments", lambda: tx.jit(add)(X, X, X), WrongCall, r"add\(\) cannot take .*too many"),
    ("unknown keyword", lambda: tx.jit(add)(X, X, z=X), WrongCall, r"unexpected keyword argument 'z'"),
    ("an argument twice", lambda: tx.jit(add)(X, X, x=X), WrongCall, r"multiple values for argument 'x'"),
    ("jit of a non-function", lambda: tx.jit(3), WrongCall, r"jit needs a function, got a int: 3"),
    ("static_argnums past the end", lambda: tx.jit(add, static_argnums=2), Static,
     r"static_argnums=\(2,\) but add takes 2 positional argument"),
    ("static_argnums before the start", lambda: tx.jit(add, static_argnums=(0, -3)), Static,
     r"static_argnums=\(0, -3\) .* \[-3\] name none"),
    ("static_argnums not an int", lambda: tx.jit(add, static_argnums="y"), WrongCall,
     r"static_argnums must be ints, got 'y'"),
    ("unknown static_argnames", lambda: tx.jit(add, static_argnames=("y", "n")), Static,
     r"static_argnames \['n'\] name no parameter add takes by keyword \(it takes \['x', 'y'\]\)"),
    ("a missing static argument", lambda: tx.jit(lambda x, n: x * n, static_argnums=1)(X), WrongCall,
     r"cannot take these arguments: missing a required argument: 'n'"),
    # shapes no device holds
    ("a negative dimension", lambda: tx.jit(lambda: tnp.zeros((-1,)))(), tx.ShapeError,
     r"shape \(-1,\): dimension -1 is negative"),
    ("a negative dimension, eagerly", lambda: tnp.ones((4, -2)), tx.ShapeError, r"dimension -2 is negative"),
    ("a dimension past int64", lambda: tx.jit(lambda: tnp.zeros((1 << 63,)))(), tx.ShapeError,
     r"dimension 9223372036854775808 is past int64"),
    ("a size past 2**63 bytes", lambda: tx.jit(lambda: tnp.zeros((1 << 32, 1 << 32)), device="opencl:0")()
     if tx.devices("opencl") else tnp.zeros((1 << 32, 1 << 32)), tx.ShapeError,
     r"float32 would hold 73,786,976,294,838,206,464 bytes"),
    ("a float dimension", lambda: tx.jit(lambda: tnp.zeros((2.5,)))(), WrongCall,
     r"a dimension of a shape is 2.5, a float"),
    ("a str dimension", lambda: tnp.zeros(("3",)), WrongCall, r"a dimension of a shape is '3', a str"),
    ("a negative broadcast", lambda: tx.jit(lambda x: tnp.broadcast_to(x, (-2, 3)))(X), tx.ShapeError,
     r"dimension -2 is negative"),
    ("more than the device holds", lambda: tx.jit(lambda: tnp.ones((1 << 60,)) + 1.0)(), tx.OutOfMemoryError,
     r"cannot allocate"),
    # containers Python cannot walk
    ("a list that contains itself", _self_referential_list, tx.TilefuseError,
     r"nests containers more than 200 deep \(here a list\): does a list or dict contain itself"),
    ("a tree 3000 deep", _tree_3000_deep, tx.TilefuseError, r"more than 200 deep \(here a dict\)"),
]


def test_every_bad_input_raises_a_tilefuse_error_that_names_it(device, monkeypatch):
    monkeypatch.setattr(tx.config, "debug_nans", True)
    failures = []
    for name, call, error, pattern in TABLE:
        errors = error if isinstance(error, tuple) else (error,)
        try:
            call()
        except errors[0] as e:
            if not isinstance(e, (tx.TilefuseError, *errors)):
                failures.append(f"{name}: {type(e).__name__} is not a TilefuseError and {errors}")
            elif not re.search(pattern, str(e), re.DOTALL):
                failures.append(f"{name}: the message does not match {pattern!r}:\n{e}")
            elif not re.search(r"\n  at .*test_bad_input\.py:\d+", str(e)):
                failures.append(f"{name}: the message does not name the user's line:\n{e}")
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
