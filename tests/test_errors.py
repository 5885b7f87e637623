"""Errors that help: the right class, the op, the shapes or dtypes, the argument's name and the
user's own file:line in every message; our internal frames hidden from the traceback."""
from __future__ import annotations

import inspect
import traceback

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse.ir import errors as E
from tilefuse.ir.errors import ArgumentError


def _line_of(fn, marker: str) -> int:
    """The line number of the source line of fn containing `marker`."""
    lines, start = inspect.getsourcelines(fn)
    for i, text in enumerate(lines):
        if marker in text:
            return start + i
    raise AssertionError(marker)


def _names_user_line(err, fn, marker):
    msg = str(err)
    assert f"{__file__}:{_line_of(fn, marker)}" in msg, msg
    assert marker in msg  # the source text of the line is quoted


def _no_internal_frames(excinfo):
    """Only the API boundary that re-raised (one frame) may remain of ours."""
    frames = [f.filename for f in traceback.extract_tb(excinfo.tb)]
    assert sum(E.is_internal(f) for f in frames) <= 1, frames


def test_error_hierarchy():
    for cls in (E.ShapeError, E.DTypeError, E.ConcretizationError, E.TracerLeakError, E.CompileError,
                E.DeviceError, E.OutOfMemoryError, E.TransformError, E.NaNError, ArgumentError):
        assert issubclass(cls, tx.TilefuseError)
    assert issubclass(tx.ShapeError, ValueError) and issubclass(tx.DTypeError, TypeError)
    assert issubclass(ArgumentError, TypeError) and issubclass(tx.OutOfMemoryError, MemoryError)
    assert issubclass(tx.NaNError, FloatingPointError)
    err = tx.CompileError("failed", backend="llvm", kernel="k0", source="define void @k0()")
    assert "k0" in str(err) and "define void" in str(err) and err.backend == "llvm"


def test_the_users_own_errors_inside_transformations_hide_internal_frames():
    """A builtin exception the traced function raises (a missing argument, a bad key) comes out of
    jit, grad and vmap as it is, with only the user's frames (and one boundary's) in its traceback,
    as JAX filters its own; an exception raised inside tilefuse (a bug) keeps every frame."""
    def layer(params, x):
        return x * params["scale"]

    def loss(params, x):
        return (layer(x) ** 2).sum()  # the user's mistake: params not passed

    x = np.ones(3, np.float32)
    for transformed in (tx.jit(tx.grad(loss)), tx.grad(loss), tx.vmap(loss, in_axes=(None, 0))):
        with pytest.raises(TypeError, match="missing 1 required positional argument") as e:
            transformed({"scale": np.float32(2.0)}, x)
        _no_internal_frames(e)
        assert traceback.extract_tb(e.tb)[-1].line.endswith("# the user's mistake: params not passed")
    with pytest.raises(KeyError) as e:
        tx.jit(lambda p, x: x * p["shift"])({"scale": np.float32(2.0)}, x)
    _no_internal_frames(e)

    from tilefuse.ir import primitives as P
    try:  # a bug: our code calls a function of ours with arguments it does not take
        P.mul.abstract_eval = E.user_frame
        with pytest.raises(TypeError, match="positional argument") as e:
            tx.jit(lambda x: x * 3.0)(x)
    finally:
        del P.mul.abstract_eval
    assert sum(E.is_internal(f.filename) for f in traceback.extract_tb(e.tb)) > 2, "a bug's frames were cut"


def test_shape_error_at_trace_time_names_op_shapes_and_line():
    def f(x, y):
        return x + y  # the bad add

    with pytest.raises(tx.ShapeError) as e:
        tx.jit(f)(np.ones((2, 3), np.float32), np.ones(4, np.float32))
    assert "add" in str(e.value) and "(2, 3)" in str(e.value) and "(4,)" in str(e.value)
    _names_user_line(e.value, f, "the bad add")
    _no_internal_frames(e)


def test_shape_errors_of_other_ops():
    def mm(a, b):
        return a @ b  # matmul here

    with pytest.raises(tx.ShapeError) as e:
        tx.jit(mm)(np.ones((2, 3), np.float32), np.ones((4, 5), np.float32))
    assert "matmul" in str(e.value) and "(2, 3)" in str(e.value) and "(4, 5)" in str(e.value)
    _names_user_line(e.value, mm, "matmul here")

    def rs(a):
        return a.reshape(4, 4)  # reshape here

    with pytest.raises(tx.ShapeError) as e:
        tx.jit(rs)(np.ones(6, np.float32))
    assert "(6,)" in str(e.value) and "(4, 4)" in str(e.value)
    _names_user_line(e.value, rs, "reshape here")

    with pytest.raises(tx.ShapeError, match=r"concatenate.*\(2, 3\), \(2, 4\)"):
        tnp.concatenate([np.ones((2, 3)), np.ones((2, 4))])
    with pytest.raises(tx.ShapeError, match="axis 2 is out of range for an array of rank 2"):
        tnp.sum(np.ones((2, 3)), axis=2)
    with pytest.raises(tx.ShapeError, match=r"where.*\(2,\), \(3,\)"):
        tnp.where(np.ones(2, bool), np.ones(3), 0.0)


def test_eager_shape_error_names_the_line(device):
    def f():
        a, b = tnp.ones(3), tnp.ones(4)
        return a * b  # eager multiply

    with pytest.raises(tx.ShapeError, match=r"multiply.*\(3,\), \(4,\)") as e:
        f()
    _names_user_line(e.value, f, "eager multiply")


def test_dtype_error_names_op_and_dtypes():
    with pytest.raises(tx.DTypeError, match=r"and.*float32"):
        tnp.bitwise_and(np.ones(2, np.float32), np.ones(2, np.float32))
    with pytest.raises(tx.DTypeError, match="does not support the dtype complex128"):
        tnp.asarray(np.ones(2, np.complex128))
    with pytest.raises(tx.DTypeError):
        tx.jit(lambda x: x)(np.array(["a"]))


@pytest.mark.parametrize("how", ["if", "bool", "float", "int", "while", "index"])
def test_concretization_error(how):
    def f(x):
        if how == "if":
            if x.sum() > 0:  # the python if-if
                return x
            return -x
        if how == "bool":
            return bool(x[0])  # the python if-bool
        if how == "float":
            return float(x[0])  # the python if-float
        if how == "int":
            return int(x[0])  # the python if-int
        if how == "while":
            while x[0] < 10:  # the python if-while
                x = x * 2
            return x
        return [1, 2, 3][x[0].astype(np.int32)]  # the python if-index

    with pytest.raises(tx.ConcretizationError) as e:
        tx.jit(f)(np.ones(3, np.float32))
    msg = str(e.value)
    assert "tnp.where" in msg and "static_argnums" in msg
    assert "f32[]" in msg or "bool[]" in msg or "i32[]" in msg
    _names_user_line(e.value, f, f"the python if-{how}")
    _no_internal_frames(e)


def test_static_argnums_is_the_fix_for_python_flow():
    f = tx.jit(lambda x, flag: x if flag else -x, static_argnums=1)
    np.testing.assert_array_equal(f(np.ones(2, np.float32), True), [1, 1])
    np.testing.assert_array_equal(f(np.ones(2, np.float32), False), [-1, -1])


def test_non_array_argument_names_the_argument():
    def model(x, activation):
        return x

    with pytest.raises(ArgumentError, match="argument 'activation' of model is a str") as e:
        tx.jit(model)(np.ones(2), "relu")
    assert "static_argnums" in str(e.value)
    with pytest.raises(ArgumentError, match=r"argument 'params'\['w'\] of g is a builtin_function_or_method"):
        def g(x, params):
            return x
        tx.jit(g)(np.ones(2), {"b": np.ones(1), "w": len})
    with pytest.raises(ArgumentError, match="'opts' of h is a object"):
        def h(x, opts=None):
            return x
        tx.jit(h)(np.ones(2), opts=object())
    with pytest.raises(ArgumentError, match="does not fit int32"):
        tx.jit(lambda x, n: x)(np.ones(2), 2**40)
    assert isinstance(ArgumentError("x"), TypeError)


def test_tracer_leak_is_a_clear_error():
    stash = {}

    def f(x):
        stash["t"] = x * 2
        return x

    tx.jit(f)(np.ones(3, np.float32))
    with pytest.raises(tx.TracerLeakError) as e:
        tnp.exp(stash["t"])  # use after the trace ended
    assert "f32[3]" in str(e.value) and "escaped" in str(e.value)
    _names_user_line(e.value, test_tracer_leak_is_a_clear_error, "use after the trace ended")


def test_device_errors():
    with pytest.raises(tx.DeviceError, match="unknown device 'tpu'"):
        tx.get_device("tpu")
    with pytest.raises(tx.DeviceError, match="does not exist"):
        tx.get_device("ref:7")


def test_index_and_update_errors_name_the_shape():
    x = tnp.zeros((2, 3))
    with pytest.raises(IndexError, match="axis 1 with size 3"):
        x[0, 3]
    with pytest.raises(IndexError, match=r"shape \(2, 3\)"):
        x.at[5].set(1.0)
    with pytest.raises(IndexError, match="index 3 is out of bounds for axis 1 with size 3"):
        tnp.take(x, np.array([0, 3]), axis=1)
    np.testing.assert_array_equal(tnp.take(np.arange(3), np.array([5, -9]), mode="clip"), [2, 0])
    with pytest.raises(tx.ShapeError, match=r"cannot broadcast an array of shape \(4,\) to \(3,\)"):
        x.at[0].set(np.ones(4, np.float32))


def test_errors_inside_jit_hide_internal_frames():
    def f(x):
        return tnp.reshape(x, (5,))

    with pytest.raises(tx.ShapeError) as e:
        tx.jit(f)(np.ones(4))
    _no_internal_frames(e)
    files = [fr.filename for fr in traceback.extract_tb(e.tb)]
    assert __file__ in files
