"""Seeing what happens: explain_retrace logs why a call traced again, debug_print prints at run
time inside jit, debug_nans names the first equation (and the user's line) that made a NaN."""
from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse.ir import primitives as P
from tilefuse.ir.passes import run_passes


@pytest.fixture
def explain(caplog):
    old = tx.config.explain_retrace
    tx.config.explain_retrace = True
    caplog.set_level(logging.INFO, logger="tilefuse.jit")
    try:
        yield caplog
    finally:
        tx.config.explain_retrace = old


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_explain_retrace_new_shape_dtype_static(explain, monkeypatch):
    monkeypatch.setattr(tx.config, "shape_generic", False)  # every new signature traces
    def step(x, scale, mode):
        return x * scale if mode == "mul" else x + scale

    f = tx.jit(step, static_argnames="mode")
    x = np.ones(3, np.float32)
    f(x, 2.0, mode="mul")
    assert not _warnings(explain)  # the first trace is not a retrace
    assert any("first time" in r.getMessage() for r in explain.records)
    f(x, 3.0, mode="mul")
    assert not _warnings(explain)  # a cache hit logs nothing
    f(np.ones(4, np.float32), 2.0, mode="mul")
    (msg,) = _warnings(explain)
    assert "step traced again" in msg and "argument 'x': new shape (3,) -> (4,)" in msg
    assert __file__ in msg  # the call site
    explain.clear()
    f(np.ones(4, np.int32), 2.0, mode="mul")
    (msg,) = _warnings(explain)
    assert "argument 'x': new dtype float32 -> int32" in msg
    explain.clear()
    f(np.ones(4, np.int32), 2.0, mode="add")
    (msg,) = _warnings(explain)
    assert "static argument 'mode': new value 'mul' -> 'add'" in msg
    explain.clear()
    f(np.ones(4, np.int32), np.ones(1, np.float32), mode="add")
    (msg,) = _warnings(explain)
    assert "argument 'scale'" in msg and "new shape () -> (1,)" in msg
    assert f.trace_count == 5


def test_explain_retrace_positional_static_and_structure(explain):
    f = tx.jit(lambda x, n: x * n, static_argnums=1)
    f(np.ones(2, np.float32), 2)
    f(np.ones(2, np.float32), 3)
    (msg,) = _warnings(explain)
    assert "static argument 'n': new value 2 -> 3" in msg
    explain.clear()
    g = tx.jit(lambda t: t[0])
    g((np.ones(2, np.float32),))
    g([np.ones(2, np.float32)])
    (msg,) = _warnings(explain)
    assert "argument structure changed" in msg


def test_explain_retrace_new_function_object(explain):
    def body(x):
        return x + 1

    x = np.ones(2, np.float32)
    for _ in range(2):
        tx.jit(body)(x)  # a fresh jit of the same function each time: an empty cache each time
    (msg,) = _warnings(explain)
    assert "new function object" in msg and "body" in msg
    assert f"{__file__}:{inspect.getsourcelines(body)[1]}" in msg
    explain.clear()
    for k in range(2):
        tx.jit(lambda v: v * 2)(x)  # a lambda made afresh each time: same code object
    (msg,) = _warnings(explain)
    assert "new function object" in msg and "<lambda>" in msg


def test_explain_retrace_off_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger="tilefuse.jit")
    assert not tx.config.explain_retrace
    f = tx.jit(lambda x: x)
    f(np.ones(1))
    f(np.ones(2))
    assert not caplog.records


def test_explain_retrace_environment_variable():
    code = ("import logging, numpy as np, tilefuse as tx\n"
            "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
            "assert tx.config.explain_retrace\n"
            "f = tx.jit(lambda x: x + 1)\n"
            "f(np.ones(2, np.float32)); f(np.ones(3, np.float32))\n")
    env = dict(os.environ, TILEFUSE_EXPLAIN_RETRACE="1", TILEFUSE_DEVICE="ref", TILEFUSE_SHAPE_GENERIC="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "traced again" in out.stderr and "new shape (2,) -> (3,)" in out.stderr


def test_debug_print_runs_at_every_call(device, capsys):
    def f(x):
        y = x * 2
        tx.debug_print("y = {} sum = {s}", y, s=y.sum())
        return y + 1

    jf = tx.jit(f)
    capsys.readouterr()
    out = jf(np.array([1.0, 2.0], np.float32))
    np.testing.assert_array_equal(out, [3, 5])
    jf(np.array([3.0, 4.0], np.float32))
    assert jf.trace_count == 1
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["y = [2. 4.] sum = 6.0", "y = [6. 8.] sum = 14.0"]


def test_debug_print_eager_and_of_unused_values(device, capsys):
    tx.debug_print("eager {}", tnp.arange(3))
    assert capsys.readouterr().out == "eager [0 1 2]\n"

    @tx.jit
    def g(x):
        tx.debug_print("dead {}", x * 3)  # nothing else reads x * 3
        return x

    g(np.float32(2.0))
    assert capsys.readouterr().out == "dead 6.0\n"


def test_debug_print_survives_the_pass_pipeline():
    def f(x):
        tx.debug_print("v={}", tnp.exp(x))
        return x + 0.0

    graph = tx.make_graph(f)(np.ones(2, np.float32))
    assert graph.count("debug_print") == 1
    assert P.debug_print.effectful
    optimised = run_passes(graph)
    assert optimised.count("debug_print") == 1 and optimised.count("exp") == 1


@pytest.fixture
def nans():
    old = tx.config.debug_nans
    tx.config.debug_nans = True
    try:
        yield
    finally:
        tx.config.debug_nans = old


def test_debug_nans_names_the_equation_and_line(device, nans):
    def f(x):
        y = x * 2.0
        z = tnp.log(y - 4.0)  # the NaN is made here
        return tnp.exp(z) + 1.0

    with pytest.raises(tx.NaNError) as e:
        tx.jit(f)(np.array([1.0, 3.0], np.float32))
    msg = str(e.value)
    assert "log" in msg and "f32[2]" in msg
    line = inspect.getsourcelines(f)[1] + 2
    assert f"{__file__}:{line}" in msg and "the NaN is made here" in msg
    # no NaN, no error; the check does not retrace
    g = tx.jit(f)
    np.testing.assert_allclose(g(np.array([3.0, 4.0], np.float32)), [3.0, 5.0], rtol=1e-6)
    with pytest.raises(tx.NaNError):
        g(np.array([0.0, 4.0], np.float32))
    assert g.trace_count == 1


def test_debug_nans_with_a_nan_input(device, nans):
    with pytest.raises(tx.NaNError, match="input"):
        tx.jit(lambda x: x * 2)(np.array([np.nan], np.float32))


def test_debug_nans_off_returns_the_nan(device):
    assert not tx.config.debug_nans
    out = tx.jit(lambda x: tnp.sqrt(x))(np.array([-1.0], np.float32))
    assert np.isnan(np.asarray(out)).all()


def test_debug_nans_environment_variable():
    code = ("import numpy as np, tilefuse as tx, tilefuse.numpy as tnp\n"
            "assert tx.config.debug_nans\n"
            "try:\n"
            "    tx.jit(lambda x: tnp.log(x))(np.array([-1.0], np.float32))\n"
            "except tx.NaNError as e:\n"
            "    print('caught', e)\n")
    env = dict(os.environ, TILEFUSE_DEBUG_NANS="1", TILEFUSE_DEVICE="ref")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "caught" in out.stdout and "log" in out.stdout


def test_explain_retrace_under_grad(explain):
    f = tx.jit(lambda x: (x * x).sum())
    f(np.ones(3, np.float32))
    g = tx.grad(f)(np.ones(4, np.float32))  # traced anew, inside grad: explained, no crash
    np.testing.assert_allclose(np.asarray(g), [2, 2, 2, 2])
    assert any("new shape (3,) -> (4,)" in m for m in _warnings(explain))
