"""Property-based fuzzing: random programs from the primitive table (fuzz_programs.py) are
optimised, fused, lowered and run on every device, and through the kernel-IR interpreter, and
agree with the `ref` interpretation of the unoptimised graph; every pass alone preserves
semantics; random smooth programs pass check_grads.

The budget: TILEFUSE_FUZZ_EXAMPLES scales every test's example count (1 in CI, `make fuzz`
runs a large one). A failure prints the shrunk program; tests/fuzz/test_regressions.py keeps
the ones found so far."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from fuzz_programs import assert_matches, budget, check_outputs, differentiable_programs, fuzz_settings, programs, ref_eval
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tilefuse.ir.core import eval_graph, typecheck_graph
from tilefuse.ir.kernel import InterpBackend
from tilefuse.ir.passes import PIPELINE
from tilefuse.runtime.compiler import compile_graph
from tilefuse.tracer.core import bind

import tilefuse as tx

INTERP = SimpleNamespace(kind="interp", name="interp")


def check_program(prog, outs, what: str) -> None:
    check_outputs(outs, prog.graph, prog.args, prog.exact, f"{what}\n{prog}")


def _as_function(graph):
    """The graph as a Python function of its inputs, binding each primitive (so transforms see it)."""
    def f(*xs):
        outs = eval_graph(graph, xs, lambda e, vals: bind(e.prim, *vals, **e.params))
        return tuple(outs)
    return f


@settings(fuzz_settings(25), suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                    HealthCheck.too_slow, HealthCheck.data_too_large])
@given(prog=programs())
def test_random_programs_match_the_reference_on_every_device(device, prog):
    f = tx.jit(_as_function(prog.graph), device=device.name)  # traced again, then compiled
    outs = [np.asarray(o) for o in f(*prog.args)]
    assert f.trace_count == 1
    check_program(prog, outs, f"on {device}")


@fuzz_settings(150)
@given(prog=programs())
def test_random_programs_through_the_compiler_pipeline_and_kernel_interpreter(prog):
    be = InterpBackend()  # fresh buffers are 0xCD: a read of unwritten memory shows up
    run = compile_graph(prog.graph, INTERP, be)
    bufs = run([be.put(np.ascontiguousarray(a), INTERP) for a in prog.args])
    outs = [be.to_host(b, v.aval, INTERP) for b, v in zip(bufs, prog.graph.outvars)]
    check_program(prog, outs, "pipeline + kernel interpreter")


@fuzz_settings(150)
@given(prog=programs())
def test_every_pass_alone_preserves_semantics(prog):
    for name, fn in PIPELINE:
        g = fn(prog.graph)
        typecheck_graph(g)
        check_program(prog, ref_eval(g, prog.args), f"pass {name} alone gives\n{g}\nfrom")


@fuzz_settings(20)
@given(prog=differentiable_programs())
def test_random_smooth_programs_pass_check_grads(prog):
    old = tx.config.default_device
    tx.config.default_device = "ref"  # eager float64 on the oracle: finite differences need it
    try:
        tx.check_grads(_as_function(prog.graph), prog.args, order=1, modes=("fwd", "rev"),
                       rtol=1e-4, atol=1e-4)
    finally:
        tx.config.default_device = old


def _variant(x: np.ndarray, rng) -> np.ndarray:
    """Another input like x: same shape and dtype, values shuffled and some negated."""
    flat = rng.permutation(x.reshape(-1))
    if x.dtype != np.bool_ and x.dtype.kind != "u":
        flat = np.where(rng.random(flat.shape) < 0.3, -flat, flat).astype(x.dtype)
    return flat.reshape(x.shape)


@fuzz_settings(60)
@given(prog=programs(), batch=st.sampled_from((1, 2, 3)), seed=st.integers(0, 2**16),
       axis_choice=st.integers(0, 2**8))
def test_vmap_of_random_programs_equals_a_loop(prog, batch, seed, axis_choice):
    """vmap(f)(xs) == stack([f(x) for x in xs]) on the oracle, with some inputs unbatched
    (in_axes None) and the batch axis of the others first or last."""
    rng = np.random.default_rng(seed)
    in_axes, batched_args, per_example = [], [], [[] for _ in range(batch)]
    for i, x in enumerate(prog.args):
        choice = (axis_choice >> (2 * i)) & 3
        if choice == 0:  # broadcast: the same value for every example
            in_axes.append(None)
            batched_args.append(x)
            for ex in per_example:
                ex.append(x)
            continue
        xs = [x] + [_variant(x, rng) for _ in range(batch - 1)]
        axis = 0 if choice < 3 else x.ndim  # sometimes the batch axis is the last
        in_axes.append(axis)
        batched_args.append(np.stack(xs, axis=axis))
        for ex, xi in zip(per_example, xs):
            ex.append(xi)
    old = tx.config.default_device
    tx.config.default_device = "ref"
    try:
        got = tx.vmap(_as_function(prog.graph), in_axes=tuple(in_axes), axis_size=batch)(*batched_args)
    finally:
        tx.config.default_device = old
    want = [ref_eval(prog.graph, ex) for ex in per_example]
    for k, (g, ex) in enumerate(zip(got, prog.exact, strict=True)):
        expected = np.stack([w[k] for w in want])
        assert_matches(np.asarray(g), expected, ex, prog.graph, f"vmap, output {k}, in_axes {in_axes}\n{prog}")


def test_the_budget_scales_with_the_environment(monkeypatch):
    monkeypatch.setenv("TILEFUSE_FUZZ_EXAMPLES", "10")
    assert budget(25) == 250
    monkeypatch.setenv("TILEFUSE_FUZZ_EXAMPLES", "0.01")
    assert budget(25) == 1
