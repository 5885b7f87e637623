"""Tiered execution (runtime/tiered.py, tx.config.tiered): first calls on the reference
interpreter while the kernels compile in the background, then the compiled program; the same
numbers either way, compile errors raised, and a process that exits mid-compile exits cleanly."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse import nn
from tilefuse.ir.errors import CompileError
from tilefuse.runtime import tiered


@pytest.fixture
def tiering():
    old = tx.config.tiered
    tx.config.tiered = True
    yield
    tx.config.tiered = old


def _model(w, x):
    return [nn.softmax(x @ w), tnp.sum(tnp.tanh(x @ w) ** 2, axis=0)]


def test_first_calls_interpret_then_the_compiled_program_runs(tiering, rng, device):
    if device.kind not in tiered.TIERED_KINDS:
        pytest.skip(f"no tiering on {device.kind} (compiles quickly, or the interpreter's copies cost more)")
    w, x = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((32, 16)).astype(np.float32)
    want = tx.jit(_model, device="ref")(w, x)
    f = tx.jit(_model, device=device.name)
    first = f(w, x)  # the interpreter's (or the compiled one's, had the build been that quick)
    (entry,) = f._cache.values()
    exe = entry.executable
    assert isinstance(exe, tiered.TieredExecutable)
    compiled = exe.wait()
    assert compiled is not None and exe.compiled is compiled
    later = f(w, x)
    for a, b, c in zip(first, later, want):
        assert a.device is device and b.device is device
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(b), np.asarray(c), rtol=1e-5, atol=1e-6)
    assert exe.sources() == compiled.sources()  # attributes are the compiled one's


def test_off_where_results_must_repeat_bit_for_bit(tiering, rng):
    tx.config.deterministic = True
    try:
        f = tx.jit(lambda a: a * 2.0, device="cpu")
        f(np.ones(3, np.float32))
        assert not isinstance(next(iter(f._cache.values())).executable, tiered.TieredExecutable)
    finally:
        tx.config.deterministic = False
    g = tx.jit(lambda a: a * 2.0, device="ref")  # and never for the interpreter itself
    g(np.ones(3, np.float32))
    assert not isinstance(next(iter(g._cache.values())).executable, tiered.TieredExecutable)


def test_a_compile_error_is_raised_by_the_next_call(tiering, monkeypatch):
    dev = tx.get_device("cpu")

    def fail(graph):
        time.sleep(0.5)  # (a build that fails at once is raised by the first call itself)
        raise CompileError("cpu: this build fails (test)")
    monkeypatch.setattr(dev, "compile", fail)  # (this device only: the interpreter still compiles)
    f = tx.jit(lambda a: a + 1.0, device="cpu")
    np.testing.assert_array_equal(np.asarray(f(np.ones(2, np.float32))), [2.0, 2.0])  # interpreted
    next(iter(f._cache.values())).executable._done.wait()
    for _ in range(2):  # and every call after it
        with pytest.raises(CompileError, match="this build fails"):
            f(np.ones(2, np.float32))


@pytest.mark.parametrize("linger", [0.0, 0.3])
def test_exiting_mid_compile_exits_cleanly(tmp_path, linger):
    """LLVM left running on a thread during Python's teardown crashed the process (SIGSEGV);
    the build stops at its next kernel and is waited for."""
    script = textwrap.dedent(f"""
        import time, numpy as np, tilefuse as tx
        from tilefuse import nn
        tx.config.tiered = True
        x = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
        f = tx.jit(lambda x: [nn.softmax(x @ x.T * (i + 1.0)).sum() for i in range(6)], device="cpu")
        print(float(f(x)[0]))
        time.sleep({linger})
    """)
    env = dict(os.environ, TILEFUSE_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout.split()[-1]) == pytest.approx(64.0)


def _new_to_the_cache(rng):
    """A model whose graph no cache holds yet (fresh weights), an input, and its result."""
    w = np.random.default_rng().standard_normal((8, 4)).astype(np.float32)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    return (lambda x: tnp.tanh(x @ w) * 3.0), x, np.tanh(x @ w) * 3.0


def test_auto_tiers_a_graph_built_before_and_builds_it_without_the_child(rng, monkeypatch):
    """"auto" (the default): a graph's first call interprets, even when the graph compiled whole
    before (here, or in an earlier process on the same persistent cache): a compile from warm
    caches costs several interpreted calls. Its background build then skips the child process."""
    from tilefuse.runtime import compile_child
    monkeypatch.setattr(tx.config, "tiered", "auto")
    asked = []
    prebuild = compile_child.prebuild
    monkeypatch.setattr(compile_child, "prebuild", lambda g, d: asked.append(g) or prebuild(g, d))
    model, x, want = _new_to_the_cache(rng)
    for built_before in (False, True):  # the second: the same graph, a new jit
        f = tx.jit(model, device="cpu")
        np.testing.assert_allclose(np.asarray(f(x)), want, rtol=1e-5, atol=1e-6)
        (entry,) = f._cache.values()
        exe = entry.executable
        assert isinstance(exe, tiered.TieredExecutable)
        assert exe._done.wait(120) and exe.compiled is not None  # built on the compile thread
        assert entry.executable is exe.compiled  # (which then replaced it in the cache)
        assert len(asked) == 1, asked  # the first build only
        np.testing.assert_allclose(np.asarray(f(x)), want, rtol=1e-5, atol=1e-6)


def test_the_interpreter_is_built_and_run_with_the_collector_held_off(rng, monkeypatch):
    """A first call's interpreter is built and run with the garbage collector held off (a full
    collection over a trained model's objects landed in the build at random: the char-GPT step's
    took 104-167 ms instead of 8), and the collector is on again after it."""
    import gc
    from tilefuse.ir import primitives as P
    monkeypatch.setattr(tx.config, "tiered", "auto")
    seen = []
    init, call = P.Interpreter.__init__, P.Interpreter.__call__
    monkeypatch.setattr(P.Interpreter, "__init__", lambda self, g: seen.append(gc.isenabled()) or init(self, g))
    monkeypatch.setattr(P.Interpreter, "__call__", lambda self, args: seen.append(gc.isenabled()) or call(self, args))
    model, x, want = _new_to_the_cache(rng)
    assert gc.isenabled()
    np.testing.assert_allclose(np.asarray(tx.jit(model, device="cpu")(x)), want, rtol=1e-5, atol=1e-6)
    assert len(seen) >= 2 and not any(seen) and gc.isenabled()
    assert tiered.wait_idle(120)


def test_calls_wait_for_a_warm_build_instead_of_interpreting_beside_it(rng, monkeypatch):
    """A graph the persistent caches hold (built before): its first call interprets, and a call
    that comes while its build here runs (from the caches, made slow) waits for it rather than
    interpret beside it: the two fought over the GIL (the char-GPT step's interpreted calls took
    5-9x as long beside it, and the build twice as long)."""
    from tilefuse.runtime import device as device_mod
    monkeypatch.setattr(tx.config, "tiered", "auto")
    model, x, want = _new_to_the_cache(rng)
    first = tx.jit(model, device="cpu")
    first(x)
    (entry,) = first._cache.values()
    assert entry.executable._done.wait(120)  # built whole: the caches hold it now
    assert tiered.wait_idle(120)  # (the compile thread takes the next build at once: see _submit)
    compile = device_mod.Device.compile

    def slow(self, graph):
        if self.kind == "cpu":
            time.sleep(0.5)
        return compile(self, graph)
    monkeypatch.setattr(device_mod.Device, "compile", slow)
    f = tx.jit(model, device="cpu")
    np.testing.assert_allclose(np.asarray(f(x)), want, rtol=1e-5, atol=1e-6)
    (entry,) = f._cache.values()
    exe, interpreted = entry.executable, []
    assert isinstance(exe, tiered.TieredExecutable) and not exe._done.is_set()
    ref = exe._ref
    exe._ref = lambda xs: interpreted.append(1) or ref(xs)
    np.testing.assert_allclose(np.asarray(f(x)), want, rtol=1e-5, atol=1e-6)
    assert exe._done.is_set() and exe.compiled is not None and not interpreted


def test_auto_waits_for_the_compile_once_the_interpreter_took_its_estimate(rng, monkeypatch):
    """The ski-rental bound: calls interpret until they took as long as the compile's estimate,
    then wait for the compiled program (which runs them from there on)."""
    monkeypatch.setattr(tiered, "COMPILE_S_PER_GRAPH", 0.0)
    monkeypatch.setattr(tiered, "COMPILE_S_PER_EQUATION", 0.0)
    monkeypatch.setattr(tiered, "COMPILE_S_PER_SIGNATURE", 0.0)
    monkeypatch.setattr(tiered, "AUTO_MOST_S", 0.0)
    monkeypatch.setattr(tx.config, "tiered", "auto")
    c = np.float32(np.random.default_rng().uniform(1, 2))  # a graph new to the cache
    f = tx.jit(lambda x: tnp.exp(x) + x * c, device="cpu")
    x = rng.standard_normal(33).astype(np.float32) * 40  # wide magnitudes: exp overflows too
    want = np.exp(x) + x * c
    np.testing.assert_allclose(np.asarray(f(x)), want, rtol=1e-5)  # interpreted (the first call)
    (entry,) = f._cache.values()
    exe = entry.executable
    assert isinstance(exe, tiered.TieredExecutable) and exe._budget.seconds == 0.0
    np.testing.assert_allclose(np.asarray(f(x)), want, rtol=1e-5)  # waited: compiled
    assert exe._done.is_set() and exe.compiled is not None


def test_eager_operations_interpret_when_small_and_tier_when_large(rng, monkeypatch):
    """An operation outside jit (grad's forward and backward, op by op) on small operands runs on
    the interpreter for good, no kernel built; a larger one on the interpreter while its kernel
    compiles. The same numbers either way; breaking either choice fails the kind check."""
    from tilefuse.runtime import device as device_mod
    old, old_device = tx.config.tiered, tx.config.default_device
    tx.config.tiered, tx.config.default_device = True, "cpu"
    x = rng.standard_normal((6, 7)).astype(np.float32) * 30
    g = tx.grad(lambda a: tnp.sum(tnp.sin(a) * a * 1.25))
    try:
        for limit, kind in ((tiered.EAGER_INTERPRET_ELEMENTS, device_mod.Interpreted), (0, tiered.TieredExecutable)):
            monkeypatch.setattr(tiered, "EAGER_INTERPRET_ELEMENTS", limit)
            tx.clear_caches()
            got = np.asarray(g(tx.device_put(x)))
            np.testing.assert_allclose(got, (np.cos(x) * x + np.sin(x)) * 1.25, rtol=1e-5, atol=1e-5)
            kinds = {type(e) for e in list(device_mod._eager_cache.values())}
            assert kind in kinds, (limit, kinds)
            if kind is device_mod.Interpreted:
                assert kinds == {device_mod.Interpreted}, kinds
    finally:
        tx.config.tiered, tx.config.default_device = old, old_device


def test_interpreted_operations_keep_their_results_apart_from_their_operands(rng):
    """A small operation outside jit runs on numpy and keeps numpy's result as its buffer (no
    copy); a result that is a view of an operand (reshape, slice, transpose) is copied, so no two
    Arrays share memory."""
    old, old_device = tx.config.tiered, tx.config.default_device
    tx.config.tiered, tx.config.default_device = True, "cpu"
    try:
        host = rng.standard_normal((4, 6)).astype(np.float32) * 1e4
        x = tx.device_put(host)
        outs = {"x * 2": (x * 2.0, host * 2.0), "reshape": (tnp.reshape(x, (6, 4)), host.reshape(6, 4)),
                "slice": (x[1:3], host[1:3]), "transpose": (x.T, host.T), "sum": (tnp.sum(x, axis=0), host.sum(0))}
        for name, (y, want) in outs.items():
            assert y.device is x.device, name
            assert not np.shares_memory(y.numpy(), x.numpy()), name
            np.testing.assert_allclose(y.numpy(), want, rtol=1e-6, err_msg=name)
        del x
        junk = [tx.device_put(np.full_like(host, 7.0)) for _ in range(4)]  # (x's block reused)
        for name, (y, want) in outs.items():
            np.testing.assert_allclose(y.numpy(), want, rtol=1e-6, err_msg=name)
        del junk
    finally:
        tx.config.tiered, tx.config.default_device = old, old_device


def test_interpreted_calls_leave_a_core_to_a_compile_under_way(monkeypatch):
    """While a build is queued or under way, an interpreted call runs numpy's BLAS on one core
    fewer than the machine's (threadpoolctl), and on all of them otherwise."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

    def blas_threads():
        return {p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"}
    before = blas_threads()
    if cores < 2 or not before or max(before) < 2:
        pytest.skip(f"{cores} core(s), BLAS threads {before}: nothing to leave")
    assert tiered.wait_idle(120)  # (builds earlier tests left)
    with tiered._leave_a_core:
        assert blas_threads() == before  # no compile under way
    monkeypatch.setattr(tiered, "_building", [True])
    with tiered._leave_a_core:
        assert blas_threads() == {min(t, cores - 1) for t in before}
        with tiered._leave_a_core:  # (another thread's call meanwhile: one limit, kept)
            assert blas_threads() == {min(t, cores - 1) for t in before}
        assert blas_threads() == {min(t, cores - 1) for t in before}
    assert blas_threads() == before


def test_an_operation_outside_jit_compiles_from_its_second_call(rng, monkeypatch):
    """A large operation outside jit interprets; its kernel is compiled only once it is called
    again (one called once, an initialisation, would never repay it), and then runs compiled."""
    from tilefuse.runtime import device as device_mod
    monkeypatch.setattr(tiered, "EAGER_INTERPRET_ELEMENTS", 0)
    old, old_device = tx.config.tiered, tx.config.default_device
    tx.config.tiered, tx.config.default_device = True, "cpu"
    x = tx.device_put(rng.standard_normal((5, 9)).astype(np.float32) * 50)
    try:
        tx.clear_caches()
        ys = [np.asarray(tnp.sin(x))]
        (exe,) = device_mod._eager_cache.values()
        assert isinstance(exe, tiered.TieredExecutable) and not exe._submitted
        ys.append(np.asarray(tnp.sin(x)))
        assert exe._submitted
        exe.wait()
        ys.append(np.asarray(tnp.sin(x)))
        assert next(iter(device_mod._eager_cache.values())) is exe.compiled
        for y in ys:
            np.testing.assert_allclose(y, np.sin(np.asarray(x)), rtol=1e-5, atol=1e-6)
    finally:
        tx.config.tiered, tx.config.default_device = old, old_device


CHILD_SCRIPT = textwrap.dedent("""
    import json, os, numpy as np, tilefuse as tx, tilefuse.numpy as tnp
    from tilefuse.runtime import compile_child, compiler, tiered
    w = np.linspace(-3, 3, 32, dtype=np.float32).reshape(8, 4)
    def f(x):
        return tnp.tanh(x @ w) * 3.0 + tnp.exp(x[:, :4])
    x = np.linspace(-20, 20, 40, dtype=np.float32).reshape(5, 8)
    graph = tx.make_graph(f)(x)
    ok = compile_child.prebuild(getattr(graph, "graph", graph), tx.get_device("cpu"))
    nice = os.getpriority(os.PRIO_PROCESS, compile_child._child[0].pid)
    runs = []
    passes = compiler.run_passes
    compiler.run_passes = lambda *a, **k: runs.append(1) or passes(*a, **k)
    g = tx.jit(f, device="cpu")
    g(x)  # (interpreted)
    (entry,) = g._cache.values()
    entry.executable.wait()
    y = np.asarray(g(x))
    want = np.tanh(x @ w) * 3.0 + np.exp(x[:, :4])
    print(json.dumps({"ok": ok, "passes": len(runs), "close": bool(np.allclose(y, want, rtol=1e-5)),
                      "built": compiler.built_before(getattr(graph, "graph", graph), tx.get_device("cpu")),
                      "nice": nice}))
""")


def test_the_child_process_compiles_into_the_caches(tmp_path):
    """A background build compiles in a child process (no GIL shared with the interpreted calls):
    afterwards this process finds the front end, the kernels and the built marker in the caches,
    so its build of the same graph runs no pass. The child runs at the lowest CPU priority (the
    interpreted calls beside it are what the user waits for)."""
    env = dict(os.environ, TILEFUSE_CACHE_DIR=str(tmp_path), TILEFUSE_TIERED="auto")
    r = subprocess.run([sys.executable, "-c", CHILD_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.splitlines()[-1]) == {"ok": True, "passes": 0, "close": True, "built": True, "nice": 19}


TEMPLATE_SCRIPT = textwrap.dedent("""
    import json, numpy as np, tilefuse as tx, tilefuse.numpy as tnp
    from tilefuse.runtime import compiler, tiered
    tx.config.default_device = "cpu"  # (a setting that keys the caches: the child's must be the same)
    rng = np.random.default_rng(0)
    w1, w2 = rng.standard_normal((6, 16)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32)
    def loss(w1, w2, x):
        h = tnp.tanh(x @ w1)
        h = (h - h.mean(-1, keepdims=True)) / tnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
        return tnp.mean((h @ w2) ** 2)
    step = tx.jit(tx.grad(loss, argnums=(0, 1)))
    runs, symbolic = [], []
    passes, sym = compiler.run_passes, compiler._symbolic_front
    compiler.run_passes = lambda *a, **k: runs.append(len(a[0].eqns)) or passes(*a, **k)
    compiler._symbolic_front = lambda g: symbolic.append(1) or sym(g)
    close = True
    for b in (8, 3, 5):
        x = rng.standard_normal((b, 6)).astype(np.float32)
        step(w1, w2, x)  # (the first call at a size interprets)
        assert tiered.wait_idle(120)
        got = step(w1, w2, x)
        want = tx.jit(tx.grad(loss, argnums=(0, 1)), device="ref")(w1, w2, x)
        close &= all(np.allclose(np.asarray(g), np.asarray(v), rtol=1e-4, atol=1e-5) for g, v in zip(got, want))
    print(json.dumps({"passes here": sum(n > 1 for n in runs), "template front ends made here": len(symbolic),
                      "close": bool(close), "traces": step.trace_count}))
""")


def test_the_child_makes_the_templates_front_end_beside_a_cold_build(tmp_path):
    """A shape-generic trace's first build goes to the child, which then makes its template's
    front end too: this process runs no pass on the step's graph, neither for its own size nor for
    the new batch sizes after it (which load the template's front end). With a default device set:
    it keys the caches, and the child once stored every front end under another key than the one
    this process then looked for."""
    env = dict(os.environ, TILEFUSE_CACHE_DIR=str(tmp_path), TILEFUSE_TIERED="auto")
    env.pop("TILEFUSE_CHECK", None)  # (whose comparison of a loaded front end runs the passes here)
    r = subprocess.run([sys.executable, "-c", TEMPLATE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.splitlines()[-1]) == {"passes here": 0, "template front ends made here": 0,
                                                     "close": True, "traces": 1}


IDLE_SCRIPT = textwrap.dedent("""
    import json, time, numpy as np, tilefuse as tx, tilefuse.numpy as tnp
    from tilefuse.runtime import compile_child, tiered
    tiered.CHILD_IDLE_S = 0.5
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    f = tx.jit(lambda x: tnp.tanh(x) * 2.0 + 1.0, device="cpu")
    f(x)  # interpreted; its build goes to the child
    (entry,) = f._cache.values()
    entry.executable._done.wait(120)  # (built by the background thread, through the child)
    started = [p for p in compile_child._child]
    until = time.monotonic() + 60  # (0.5 s idle, then its exit: longer on a loaded machine)
    while time.monotonic() < until and (compile_child._child or any(p.poll() is None for p in started)):
        time.sleep(0.1)
    print(json.dumps({"started": len(started), "left": len(compile_child._child),
                      "exited": all(p.poll() is not None for p in started),
                      "close": bool(np.allclose(f(x), np.tanh(x) * 2 + 1, rtol=1e-6, atol=1e-6))}))
""")


def test_the_child_process_ends_when_idle(tmp_path):
    """A notebook that compiled once keeps no idle compile process: the child ends once no build
    came for CHILD_IDLE_S, and the next cold graph would start another."""
    env = dict(os.environ, TILEFUSE_CACHE_DIR=str(tmp_path), TILEFUSE_TIERED="auto")
    r = subprocess.run([sys.executable, "-c", IDLE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.splitlines()[-1]) == {"started": 1, "left": 0, "exited": True, "close": True}
