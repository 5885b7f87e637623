"""Shape-generic tracing (tracer/shape_poly.py, ir/symbolic.py): a jitted function traced once
serves new sizes its guards allow, with the graph a trace at those sizes would give, and never
where a guard says otherwise."""
from __future__ import annotations

import itertools
import os
import sys

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse.ir.core import ShapedArray
from tilefuse.ir.symbolic import Dim, ShapeEnv, evaluate, slice_indices
from tilefuse.tracer import pytree


# ---- the symbolic size ---------------------------------------------------------------------

def test_arithmetic_builds_expressions_and_questions_are_guarded():
    env = ShapeEnv()
    b = env.symbol(6)
    n = (b * 4 + 2) // 2 - b % 4
    assert type(n) is Dim and n.hint == 11 and not env.guards
    assert evaluate(n, [10]) == (10 * 4 + 2) // 2 - 10 % 4
    assert n > 5 and not (b == 1) and b != 0
    assert env.holds([7]) and env.holds([100])
    assert not env.holds([1])  # b == 1 answers otherwise there
    assert not env.holds([0])  # b != 0, and n > 5
    assert isinstance(b, int) and not env.specialised  # (Python code takes the int's branch)


def test_a_divisor_is_guarded_nonzero():
    env = ShapeEnv()
    b, t = env.symbol(4), env.symbol(6)
    q = t // b
    assert evaluate(q, [2, 7]) == 3 and env.holds([2, 7])
    assert not env.holds([0, 7])  # never a ZeroDivisionError: the guard says no


def test_empty_and_unit_batches_are_computed_right(device):
    jf = tx.jit(lambda x: (x * 2).sum(0) + tnp.mean(x), device=device)
    for b in (4, 0, 1, 3):
        x = np.arange(b * 3, dtype=np.float32).reshape(b, 3)
        want = (x * 2).sum(0) + (x.mean() if b else np.nan)
        np.testing.assert_allclose(np.asarray(jf(x)), want, rtol=1e-6)


def test_the_exact_value_specialises():
    for ask in (int, float, lambda d: range(d), lambda d: np.zeros(d), hash, str, lambda d: d / 2,
                lambda d: {6: "a"}.get(d), lambda d: d & 1, lambda d: d.bit_length()):
        env = ShapeEnv()
        ask(env.symbol(6))
        assert env.specialised == {0} and env.holds([6]) and not env.holds([7]), ask


def test_identities_ask_nothing():
    env = ShapeEnv()
    b = env.symbol(5)
    assert b + 0 is b and 0 + b is b and b * 1 is b and 1 * b is b and b // 1 is b
    assert b * 0 == 0 and b % 1 == 0
    assert not env.guards


@pytest.mark.parametrize("step", [None, 1, 2, 3, -1, -2])
def test_slice_indices_agree_with_python_wherever_the_guards_hold(step):
    # the guards' soundness: wherever they hold, the expressions give Python's answer
    ends = [None, 0, 1, 2, 5, -1, -2, -5, 100, -100]
    for start, stop, hint in itertools.product(ends, ends, (0, 1, 3, 7)):
        env = ShapeEnv()
        n = env.symbol(hint)
        s = slice(start, stop, step)
        got = slice_indices(s, n)
        assert tuple(evaluate(v, [hint]) for v in got) == s.indices(hint)
        for other in range(0, 12):
            if env.holds([other]):
                assert tuple(evaluate(v, [other]) for v in got) == s.indices(other), (s, hint, other)


def test_a_size_kept_after_its_trace_is_the_int_it_was():
    kept = []
    f = tx.jit(lambda x: kept.append(x.shape[0]) or x * 2)
    f(np.ones(5, np.float32))
    assert kept[0] + 1 == 6 and int(kept[0]) == 5 and kept[0] * 2 == 10


# ---- jit ----------------------------------------------------------------------------------

def test_new_batch_sizes_reuse_the_trace(device):
    def f(x, w):
        b, t = x.shape[:2]
        h = tnp.reshape(x, (b * t, -1)) @ w
        return tnp.reshape(h, (b, t, -1)).mean(), tnp.tanh(h[: b * t // 2]).sum(0)

    jf = tx.jit(f, device=device)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 3)).astype(np.float32)
    for b in (4, 1, 7, 2, 9):
        x = rng.standard_normal((b, 5, 2, 3)).astype(np.float32)
        got = jf(x, w)
        h = x.reshape(b * 5, -1) @ w
        np.testing.assert_allclose(np.asarray(got[0]), h.mean(), rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got[1]), np.tanh(h[: b * 5 // 2]).sum(0), rtol=2e-5, atol=1e-5)
    # no broadcast asked whether b is 1: even b = 1 is the same program
    assert jf.trace_count == 1 and jf.cache_size() == 5


def test_a_guard_that_differs_traces_again(device):
    def f(x):
        return x * 2 if x.shape[0] > 4 else x - 1

    jf = tx.jit(f, device=device)
    for n, want in ((6, 2 * np.ones(6)), (8, 2 * np.ones(8)), (3, np.zeros(3)), (2, np.zeros(2)),
                    (5, 2 * np.ones(5))):
        np.testing.assert_array_equal(np.asarray(jf(np.ones(n, np.float32))), want)
    assert jf.trace_count == 2  # one trace each side of the guard


def test_a_size_used_as_a_number_specialises(device):
    jf = tx.jit(lambda x: x / float(x.shape[0]), device=device)
    for n in (3, 5, 3):
        np.testing.assert_allclose(np.asarray(jf(np.ones(n, np.float32))), np.ones(n) / n)
    assert jf.trace_count == 2


def test_side_effects_run_per_trace(device, monkeypatch):
    monkeypatch.setattr(tx.config, "check", False)  # (which traces again to compare)
    calls = []
    jf = tx.jit(lambda x: calls.append(x.shape) or x + 1, device=device)
    for n in (3, 4, 5):
        jf(np.ones(n, np.float32))
    assert len(calls) == 1
    tx.config.shape_generic = False
    try:
        jf2 = tx.jit(lambda x: calls.append(x.shape) or x + 1, device=device)
        for n in (3, 4):
            jf2(np.ones(n, np.float32))
    finally:
        tx.config.shape_generic = True
    assert len(calls) == 3


def test_a_failing_symbolic_trace_falls_back_to_the_concrete_one(device):
    def f(x):
        assert type(x.shape[0]) is int  # a program may insist on a real int
        return x + 1

    jf = tx.jit(f, device=device)
    for n in (3, 4):
        np.testing.assert_array_equal(np.asarray(jf(np.zeros(n, np.float32))), np.ones(n))
    assert jf.trace_count == 2


def test_grad_of_a_mean_over_the_batch(device):
    def loss(w, x):
        return tnp.mean((x @ w) ** 2)

    g = tx.jit(tx.grad(loss), device=device)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3,)).astype(np.float32)
    for b in (5, 8, 2):
        x = rng.standard_normal((b, 3)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(g(w, x)), 2 * x.T @ (x @ w) / b, rtol=1e-5, atol=1e-6)
    assert g.trace_count == 1


def test_explain_retrace_names_the_reused_trace(caplog):
    tx.config.explain_retrace = True
    try:
        jf = tx.jit(lambda x: x + 1, device="ref")
        jf(np.ones(2, np.float32))
        with caplog.at_level("WARNING", logger="tilefuse.jit"):
            jf(np.ones(3, np.float32))
    finally:
        tx.config.explain_retrace = False
    (msg,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "compiled again" in msg and "trace reused" in msg and "new shape (2,) -> (3,)" in msg


# ---- the instantiated graph is the concrete trace's, equation for equation ------------------

def _graph(jf, args, generic):
    leaves, in_tree = pytree.tree_flatten((args, {}))
    avals = tuple(jf._avals(leaves, in_tree))
    return jf._graph((), avals, in_tree, None, generic=generic)[0]


def test_the_char_gpt_step_instantiates_to_its_concrete_trace():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import train_transformer as tt
    cfg = tt.Config(vocab=40, d_model=32, layers=2, heads=2, seq=16)
    optimizer = tt.make_optimizer(1e-3, 10)
    params = tt.init_params(tx.random.key(0), cfg)
    opt = optimizer.init(params)
    key = tx.random.key(1)
    generic = tt.make_train_step(cfg, optimizer)
    rng = np.random.default_rng(0)
    tokens = lambda b: rng.integers(0, cfg.vocab, (b, cfg.seq)).astype(np.int32)  # noqa: E731
    base = _graph(generic, (params, opt, key, tokens(8), tokens(8)), True)
    for b in (3, 5, 12):
        args = (params, opt, key, tokens(b), tokens(b))
        got = _graph(generic, args, True)
        want = _graph(tt.make_train_step(cfg, optimizer), args, False)
        assert str(got) == str(want)
        # the equations no batch size reaches (the optimizer's update) are the first instance's
        shared = {id(e) for e in base.eqns}
        assert sum(id(e) in shared for e in got.eqns) > len(got.eqns) // 4
    assert generic.trace_count == 1


def test_a_size_inside_a_nested_body_follows_the_call(device):
    # the cond's branches sit in a scan body with no symbolic operand (its carry is (3,), its
    # rows (1,)); the batch reaches them only as a parameter: each instance re-instantiates them
    def f(x):
        b = x.shape[0]

        def body(c, r):
            c = tx.lax.cond(c.sum() > -1.0, lambda z: z + tnp.ones((b,)).sum(), lambda z: z - 1.0, c)
            return c, r.sum()
        return tx.lax.scan(body, tnp.zeros(3), x)[0]

    jf = tx.jit(f, device=device)
    for n in (4, 6, 9):
        np.testing.assert_allclose(np.asarray(jf(np.ones((n, 1), np.float32))), np.full(3, n * n))
    assert jf.trace_count == 1


# ---- the compiler's front end, once per template (tracer/shape_poly.FrontEnd) -----------------

def _mlp_step():
    """A training step with a mean over the batch, a row normalisation, an index by the batch's
    iota and a softmax cross-entropy: sizes as values, row regions and a GEMM per layer."""
    def loss(p, x, y):
        h = tnp.tanh(x @ p["w1"] + p["b1"])
        h = (h - h.mean(-1, keepdims=True)) / tnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
        logp = tx.nn.log_softmax(h @ p["w2"])
        return -tnp.mean(logp[tnp.arange(x.shape[0]), y])

    def step(p, x, y):
        value, grads = tx.value_and_grad(loss)(p, x, y)
        return tx.tree_map(lambda a, g: a - 0.1 * g, p, grads), value
    rng = np.random.default_rng(3)
    params = {"w1": rng.standard_normal((6, 16)).astype(np.float32) * 0.5,
              "b1": rng.standard_normal(16).astype(np.float32) * 0.1,
              "w2": rng.standard_normal((16, 5)).astype(np.float32) * 0.5}
    batch = lambda b: (rng.standard_normal((b, 6)).astype(np.float32),  # noqa: E731
                       rng.integers(0, 5, b).astype(np.int32))
    return step, params, batch


def test_new_sizes_compile_from_the_templates_front_end(device, monkeypatch):
    from tilefuse.runtime import compiler, frontend_cache, tiered
    assert tiered.wait_idle(120)  # (a build earlier tests left would partition meanwhile)
    monkeypatch.setattr(frontend_cache, "load", lambda *a, **k: None)  # (whatever earlier runs stored)
    monkeypatch.setattr(frontend_cache, "load_template", lambda *a, **k: None)
    monkeypatch.setattr(tx.config, "tiered", False)  # (every compile here, in this process: counted)
    partitions, symbolic = [], []
    part, sym = compiler.partition, compiler._symbolic_front
    monkeypatch.setattr(compiler, "partition", lambda *a, **k: partitions.append(1) or part(*a, **k))
    monkeypatch.setattr(compiler, "_symbolic_front", lambda g: symbolic.append(1) or sym(g))
    step, params, batch = _mlp_step()
    generic, concrete = tx.jit(step), tx.jit(step)
    for b in (8, 3, 5, 12, 2):
        x, y = batch(b)
        got = generic(params, x, y)
        monkeypatch.setattr(tx.config, "shape_generic", False)
        want = concrete(params, x, y)
        monkeypatch.setattr(tx.config, "shape_generic", True)
        for g, w in zip(tx.tree_util.tree_leaves(got), tx.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert generic.trace_count == 1
    if device.kind != "ref":  # (the reference interprets: no front end)
        # the trace's own size and each concrete trace partition the graph; the template's front
        # end ran once, at the first new size, and the three sizes after it partitioned nothing
        assert len(symbolic) == 1 and len(partitions) == 1 + 1 + 5


def test_tiered_builds_a_third_size_from_the_templates_front_end(monkeypatch):
    # tiered: the trace's own size builds in a child process (when there is a disk cache); the
    # next makes the template's front end and builds from it here, with no child, as the third
    from tilefuse.runtime import compile_child, compiler, tiered
    monkeypatch.setattr(tx.config, "tiered", True)
    assert tiered.wait_idle(120)
    children, symbolic = [], []
    prebuild, sym = compile_child.prebuild, compiler._symbolic_front
    monkeypatch.setattr(compile_child, "prebuild", lambda *a: children.append(1) or prebuild(*a))
    monkeypatch.setattr(compiler, "_symbolic_front", lambda g: symbolic.append(1) or sym(g))
    step, params, batch = _mlp_step()
    generic = tx.jit(step, device="cpu")
    children_after = []
    for b in (8, 3, 5, 11):
        x, y = batch(b)
        got = generic(params, x, y)
        want = tx.jit(step, device="ref")(params, x, y)
        for g, w in zip(tx.tree_util.tree_leaves(got), tx.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
        assert tiered.wait_idle(120)
        children_after.append(len(children))
    # the template's front end ran once at most here: the child makes it beside a cold build of
    # the trace's own size, and a store from an earlier run serves too (a new trace loads it)
    assert len(symbolic) <= 1 and children_after[0] == children_after[3]  # (none for 3, 5, 11)
    (template,) = [t for ts in generic._templates.values() for t in ts]
    assert template.front and generic.trace_count == 1


def test_a_templates_front_end_is_kept_on_disk(device, monkeypatch, tmp_path):
    """The first new size of a trace makes its template's front end and stores it; a new trace of
    the same function (a new process, a new jit) loads it instead of running the passes on the
    template. Under TILEFUSE_CHECK a loaded one is compared with the passes' own: the optimised
    graph, the regions, every size as its expression, and the guards. Results as the reference's."""
    from tilefuse.runtime import compile_cache, compiler, frontend_cache, tiered
    assert tiered.wait_idle(120)
    monkeypatch.setattr(tx.config, "tiered", False)
    cache = compile_cache.CompileCache("frontend", str(tmp_path))
    monkeypatch.setattr(frontend_cache, "_cache", lambda: cache)
    symbolic, sym = [], compiler._symbolic_front
    monkeypatch.setattr(compiler, "_symbolic_front", lambda g: symbolic.append(1) or sym(g))
    step, params, batch = _mlp_step()
    made = []
    for check in (False, False, True):  # made and stored; loaded; loaded and compared
        monkeypatch.setattr(tx.config, "check", check)
        generic = tx.jit(step, device=device)
        for b in (8, 3, 5):
            x, y = batch(b)
            got = generic(params, x, y)
            want = tx.jit(step, device="ref")(params, x, y)
            for g, w in zip(tx.tree_util.tree_leaves(got), tx.tree_util.tree_leaves(want)):
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
        assert generic.trace_count == 1
        made.append(len(symbolic))
    if device.kind != "ref":  # (the reference interprets: no front end)
        assert made == [1, 1, 2], made  # (the check's comparison runs the passes once)


def test_a_damaged_template_front_end_is_rebuilt(monkeypatch, tmp_path):
    """A stored template front end that does not decode (a size expression past the template's
    symbols, an unknown guard) is a miss, named in a CacheWarning and removed: the passes run and
    the results are right."""
    import json
    from tilefuse.runtime import compile_cache, compiler, frontend_cache, tiered
    assert tiered.wait_idle(120)
    monkeypatch.setattr(tx.config, "tiered", False)
    monkeypatch.setattr(tx.config, "check", False)
    cache = compile_cache.CompileCache("frontend", str(tmp_path))
    monkeypatch.setattr(frontend_cache, "_cache", lambda: cache)
    stored = {}
    store = frontend_cache.store_template
    monkeypatch.setattr(frontend_cache, "store_template", lambda k, *a: stored.setdefault("key", k) and store(k, *a))
    symbolic, sym = [], compiler._symbolic_front
    monkeypatch.setattr(compiler, "_symbolic_front", lambda g: symbolic.append(1) or sym(g))
    step, params, batch = _mlp_step()
    first = tx.jit(step, device="cpu")
    first(params, *batch(8))
    first(params, *batch(3))  # (the template's front end made, stored)
    k = stored["key"]
    entry = json.loads(cache.load(k))
    for damage in ("symbol", "guard"):
        bad = json.loads(json.dumps(entry))
        if damage == "symbol":  # a size over a symbol the template does not have
            bad["vars"] = [[[{"dim": ["s", 999]}], *a[1:]] if a[0] and isinstance(a[0][0], dict) else a
                           for a in bad["vars"]]
        else:
            bad["guards"][0][0] = "!="
        cache.store(k, json.dumps(bad).encode())
        generic = tx.jit(step, device="cpu")
        generic(params, *batch(8))
        x, y = batch(5)
        with pytest.warns(compile_cache.CacheWarning, match="cannot be used"):
            got = generic(params, x, y)
        want = tx.jit(step, device="ref")(params, x, y)
        for g, w in zip(tx.tree_util.tree_leaves(got), tx.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
    assert len(symbolic) == 1 + 2  # (made first, then again after each damaged entry)


def test_a_size_expression_from_a_file_is_checked():
    from tilefuse.ir.symbolic import dim_of_key, key_json
    env = ShapeEnv()
    b, t = env.symbol(8), env.symbol(5)
    d = dim_of_key(env, key_json((b * t + 3).key))
    assert type(d) is Dim and d.key == (b * t + 3).key and d.hint == 43
    assert dim_of_key(env, 7) == 7
    for bad in (["s", 2], ["s", -1], ["pow", ["s", 0], 2], ["neg"], ["+", ["s", 0]], "s", [], ["s", 0.5]):
        with pytest.raises(ValueError):
            dim_of_key(env, bad)


def test_a_size_dependent_decision_keeps_the_front_end_from_other_sizes(monkeypatch):
    # a front end that needs a size's exact value (here: a pass that asks int() of a dim) makes
    # the template's front end valid at the trace's size only: other sizes compile the long way
    from tilefuse.ir.passes import manager
    from tilefuse.runtime import compiler, frontend_cache
    monkeypatch.setattr(frontend_cache, "load", lambda *a, **k: None)
    monkeypatch.setattr(tx.config, "tiered", False)
    run_passes, asked = manager.run_passes, []

    def specialising(graph, **kw):
        for v in graph.invars:
            asked.extend(int(d) for d in v.aval.shape)
        return run_passes(graph, **kw)
    monkeypatch.setattr(compiler, "run_passes", specialising)
    jf = tx.jit(lambda x: (x * 2.0).sum(0) / x.shape[0], device="cpu")
    for b in (4, 6, 9):
        x = np.arange(b * 3, dtype=np.float32).reshape(b, 3)
        np.testing.assert_allclose(np.asarray(jf(x)), (x * 2.0).sum(0) / b, rtol=1e-6)
    (template,) = [t for ts in jf._templates.values() for t in ts]
    at = lambda *values: template.front.at(list(values), tx.config.cache_key())  # noqa: E731
    assert template.front and at(4, 3) and not at(6, 3) and not at(9, 3)


def test_a_new_row_length_compiles_from_the_templates_front_end(device, monkeypatch):
    # fusion asks whether a layer norm's or a softmax's union lowers as one row kernel by lowering
    # it; at a template's symbolic sizes that trial takes its index constants at the trace's sizes
    # (symbolic.index_hints) and is thrown away, so a new row length reuses the front end
    from tilefuse.runtime import compiler, frontend_cache, tiered
    assert tiered.wait_idle(120)
    monkeypatch.setattr(frontend_cache, "load", lambda *a, **k: None)
    monkeypatch.setattr(frontend_cache, "load_template", lambda *a, **k: None)
    monkeypatch.setattr(tx.config, "tiered", False)
    partitions, symbolic = [], []
    part, sym = compiler.partition, compiler._symbolic_front
    monkeypatch.setattr(compiler, "partition", lambda *a, **k: partitions.append(1) or part(*a, **k))
    monkeypatch.setattr(compiler, "_symbolic_front", lambda g: symbolic.append(1) or sym(g))

    def f(x, g):
        h = (x - x.mean(-1, keepdims=True)) / tnp.sqrt(x.var(-1, keepdims=True) + 1e-5) * g
        return tx.nn.softmax(h * 3.0, axis=-1), h.sum()
    generic, concrete = tx.jit(f, device=device), tx.jit(f, device=device)
    rng = np.random.default_rng(5)
    sizes = ((6, 40), (4, 24), (5, 33), (3, 64), (7, 17))
    for rows, n in sizes:
        x = (rng.standard_normal((rows, n)) * 10.0 ** rng.uniform(-3, 3, (rows, 1))).astype(np.float32)
        g = rng.uniform(0.5, 2.0, n).astype(np.float32)
        got = generic(x, g)
        monkeypatch.setattr(tx.config, "shape_generic", False)
        want = concrete(x, g)
        monkeypatch.setattr(tx.config, "shape_generic", True)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
        h = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g
        e = np.exp(3.0 * h - (3.0 * h).max(-1, keepdims=True))
        np.testing.assert_allclose(np.asarray(got[0]), e / e.sum(-1, keepdims=True), rtol=2e-5, atol=1e-6)
    assert generic.trace_count == 1
    if device.kind != "ref":
        (template,) = [t for ts in generic._templates.values() for t in ts]
        assert any(r.meta.get("rows") and "lowered" not in r.meta for r in template.front.regions)
        assert len(symbolic) == 1 and len(partitions) == 1 + 1 + len(sizes)


def test_index_hints_take_a_size_unguarded_for_a_trial_only():
    from tilefuse.ir.kernel.ir import ic
    from tilefuse.ir.symbolic import index_hints
    env = ShapeEnv()
    n = env.symbol(12)
    with index_hints():
        assert ic(n * 3).arg == 36
    assert not env.guards and env.holds([5])
    assert ic(n).arg == 12 and env.specialised == {0} and not env.holds([5])  # (outside: the value, guarded)


def test_symbolic_avals_one_symbol_per_axis():
    # a batch of 128 beside a hidden size of 128 (an MLP) must not tie the two together
    from tilefuse.tracer.shape_poly import symbolic_avals
    f32 = np.dtype(np.float32)
    env, avals = symbolic_avals([ShapedArray((8, 3), f32), ShapedArray((8, 1, 0), f32), ShapedArray((), f32)])
    assert env.hints == [8, 3, 8] and avals[0].shape[0] is not avals[1].shape[0]
    assert avals[1].shape[1:] == (1, 0) and avals[2].shape == ()


def test_a_batch_equal_to_a_hidden_size_stays_free(device):
    def loss(p, x):
        return tnp.mean(tnp.maximum(x @ p["w"] + p["b"], 0.0) ** 2)

    step = tx.jit(tx.value_and_grad(loss), device=device)
    rng = np.random.default_rng(2)
    p = {"w": rng.standard_normal((8, 8)).astype(np.float32), "b": np.zeros(8, np.float32)}
    for b in (8, 4, 3):
        x = rng.standard_normal((b, 8)).astype(np.float32)
        value, g = step(p, x)
        h = np.maximum(x @ p["w"], 0)
        np.testing.assert_allclose(np.asarray(value), (h ** 2).mean(), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(g["b"]), 2 * h.sum(0) / (b * 8), rtol=1e-4, atol=1e-6)
    assert step.trace_count == 1


GENERIC = {  # programs whose sizes stay symbolic: one trace serves every size below
    "zeros": lambda x: x + tnp.zeros(x.shape),
    "ones": lambda x: x.T @ tnp.ones((x.shape[0], 3)),
    "arange": lambda x: x + tnp.arange(x.shape[1]) + tnp.arange(1, x.shape[0] + 1)[:, None],
    "tril": lambda x: x[:, :, None] * tnp.tril(tnp.ones((x.shape[1], x.shape[1]))),
    "eye": lambda x: x @ tnp.eye(x.shape[1]),
    "one_hot": lambda x: tx.nn.one_hot(tnp.argmax(x, 1), x.shape[1]),
    "concatenate": lambda x: tnp.concatenate([x, 2 * x], 0),
    "stack": lambda x: tnp.stack([x, x + 1], 1),
    "pad": lambda x: tnp.pad(x, ((1, 2), (0, 1))),
    "flip": lambda x: x[::-1, 1:],
    "einsum": lambda x: tnp.einsum("ij,kj->ik", x, x),
    "var": lambda x: tnp.var(x, 0) + tnp.std(x, 1).sum(),
    "cumsum": lambda x: tnp.cumsum(x, 0),
    "take": lambda x: tnp.take(x, tnp.array([0, 1]), axis=0),
    "reshape": lambda x: tnp.reshape(x, (-1,))[: x.size // 2],
    "scan": lambda x: tx.lax.scan(lambda c, r: (c + r, c * r), tnp.zeros(x.shape[1]), x)[1],
    "scan_length": lambda x: tx.lax.scan(lambda c, _: (c * 2, c), x[0], None, length=x.shape[0])[1],
    "grad_of_scan": lambda x: tx.grad(lambda y: tx.lax.scan(
        lambda c, r: (c * tnp.tanh(r), None), tnp.ones(y.shape[1]), y)[0].sum())(x),
    "vmap": lambda x: tx.vmap(lambda r: r / r.sum())(x),
    "map": lambda x: tx.lax.map(lambda r: r * 2, x),
    "fori_loop": lambda x: tx.lax.fori_loop(0, 3, lambda i, c: c + x, x),
    "cond": lambda x: tx.lax.cond(x.sum() > 0, lambda y: y * 2, lambda y: y - 1, x),
    "attention": lambda x: tx.nn.dot_product_attention(  # (the head size stays 4: its scale is a float)
        x[None, :, None, :4], x[None, :, None, :4], x[None, :, None, :4], causal=True),
}


@pytest.mark.parametrize("name", sorted(GENERIC))
def test_common_programs_reuse_their_trace(name):
    f = GENERIC[name]
    jf = tx.jit(f, device="ref")
    for b in (4, 6, 9):
        x = np.random.default_rng(b).standard_normal((b, b + 1)).astype(np.float32)
        tx.config.shape_generic = False
        try:
            want = np.asarray(tx.jit(f, device="ref")(x))
        finally:
            tx.config.shape_generic = True
        np.testing.assert_allclose(np.asarray(jf(x)), want, rtol=1e-6, atol=1e-6)
    assert jf.trace_count == 1
