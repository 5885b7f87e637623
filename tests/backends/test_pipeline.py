"""The backend-neutral compiler pipeline (runtime/compiler.py): passes, fusion, lowering, the
dispatcher and the static buffer planner, run end to end on the interpreter backend double
(ir.kernel.InterpBackend) and checked against the graph evaluated with the primitives' numpy
implementations. Every backend that renders the kernel IR plugs into this same pipeline."""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse as tx
import tilefuse.numpy as tnp
from conftest import assert_close
from tilefuse.ir import primitives as P
from tilefuse.ir.core import eval_graph
from tilefuse.ir.errors import CompileError
from tilefuse.ir.kernel import InterpBackend, lower_region
from tilefuse.ir.passes import Region
from tilefuse.runtime import dispatch
from tilefuse.runtime.compiler import compile_graph
from tilefuse.runtime.config import config
from tilefuse.runtime.planner import ALIGN, Interval, plan_buffers
from tilefuse.tracer.core import bind1
from tilefuse.validate.programs import int_and_bool, layernorm, shapes_and_indexing, softmax

F32, BF16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)
DEV = SimpleNamespace(kind="interp", name="interp")


def ref_eval(g, args):
    return eval_graph(g, args, lambda e, xs: e.prim.impl(*xs, **e.params))


def compile_and_run(f, *args, backend=None):
    g = tx.make_graph(f)(*args)
    be = backend or InterpBackend()
    prog = compile_graph(g, DEV, be)
    outs = prog([be.put(np.asarray(a), DEV) for a in args])
    got = [be.to_host(o, v.aval, DEV) for o, v in zip(outs, g.outvars)]
    for o, w, v in zip(got, ref_eval(g, [np.asarray(a) for a in args]), g.outvars, strict=True):
        assert_close(o, np.asarray(w), dtype=v.aval.dtype)
    return prog, got


rng = np.random.default_rng(0)


def r(*shape, dtype=F32):
    return rng.standard_normal(shape).astype(dtype)


def embedding_and_grad(table, ids, dy):
    y = tnp.take(table, ids, axis=0)
    dtable = bind1(P.scatter_add, tnp.zeros_like(table), ids, dy, axis=0)
    return tnp.sum(y * dy), dtable


def bf16_mlp(x, w):
    h = tnp.tanh(x @ w)
    return h, tnp.sum(h * h, axis=1)


def attention_ish(q, k, v):
    s = tnp.einsum("bqd,bkd->bqk", q, k) * 0.5
    return tnp.einsum("bqk,bkd->bqd", softmax(s), v)


PROGRAMS = {
    "softmax": (softmax, lambda: [r(4, 7)]),
    "layernorm": (layernorm, lambda: [r(3, 8), r(8), r(8)]),
    "embedding and its gradient": (embedding_and_grad,
                                   lambda: [r(6, 4), np.array([1, 5, 1, 0], np.int32), r(4, 4)]),
    "shapes and indexing": (shapes_and_indexing, lambda: [r(3, 4), r(3, 2)]),
    "ints and bools": (int_and_bool, lambda: [rng.integers(-9, 9, (3, 5)).astype(np.int32),
                                              rng.integers(-2, 3, (3, 5)).astype(np.int32)]),
    "bfloat16 layer": (bf16_mlp, lambda: [r(4, 8, dtype=BF16), r(8, 3, dtype=BF16)]),
    "attention": (attention_ish, lambda: [r(2, 3, 4), r(2, 5, 4), r(2, 5, 4)]),
    "sizes 0 and 1": (lambda x, y: (tnp.exp(x) + 1.0, tnp.sum(x, axis=0), y * 2.0, tnp.sum(y)),
                      lambda: [r(0, 3), r(1)]),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_program_agrees_with_the_reference(name):
    f, make_args = PROGRAMS[name]
    prog, _ = compile_and_run(f, *make_args())
    assert prog.launches and all(l.kernel is not None for l in prog.launches)


def test_outputs_that_are_inputs_literals_constants_or_repeated():
    c = np.arange(6, dtype=F32).reshape(2, 3) * 1000  # large enough to stay a constant

    def f(x):
        y = x * 2.0
        return x, y, y, 3.0, tnp.asarray(c)
    prog, (x_out, y1, y2, three, c_out) = compile_and_run(f, np.ones((2, 3), F32))
    assert three == 3.0 and np.array_equal(c_out, c)
    assert sum(l.kind == "copy" for l in prog.launches) == 4  # x, the second y, 3.0, c


def test_outputs_are_fresh_allocations_and_the_arena_is_freed_per_call():
    be = InterpBackend()
    g = tx.make_graph(lambda x: tnp.sum(tnp.exp(x) @ tnp.tanh(x), axis=0))(np.ones((4, 4), F32))
    prog = compile_graph(g, DEV, be)
    x = be.put(np.ones((4, 4), F32), DEV)
    before = be.live_bytes
    o1 = prog([x])
    o2 = prog([x])
    assert o1[0] is not o2[0] and np.shares_memory(o1[0], o2[0]) is False
    # per call: one arena (freed) and one allocation per output (kept)
    assert be.live_bytes - before == 2 * 4 * 4
    assert be.allocations == 2 * 2


def test_concurrent_calls_do_not_share_intermediates():
    be = InterpBackend()
    g = tx.make_graph(layernorm)(r(3, 8), r(8), r(8))
    prog = compile_graph(g, DEV, be)
    inputs = [[r(3, 8), r(8), r(8)] for _ in range(6)]
    results = [None] * len(inputs)

    def work(k):
        outs = prog([be.put(a, DEV) for a in inputs[k]])
        results[k] = be.to_host(outs[0], g.outvars[0].aval, DEV).copy()
    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, args in enumerate(inputs):
        assert_close(results[k], np.asarray(ref_eval(g, args)[0]), rtol=1e-5, atol=1e-5)


def test_debug_print_is_a_counted_host_step(capsys):
    def f(x):
        y = x * 2.0
        tx.debug_print("y = {}", y)
        return y + 1.0
    before = dispatch.stats["host_fallbacks"]
    prog, _ = compile_and_run(f, np.arange(3, dtype=F32))
    assert dispatch.stats["host_fallbacks"] == before + 1
    assert [l.kind for l in prog.launches].count("host") == 1
    assert "y = [0. 2. 4.]" in capsys.readouterr().out


def test_sources_name_every_kernel_launch():
    prog, _ = compile_and_run(softmax, r(2, 5))
    src = prog.sources()
    assert set(src) == {l.name for l in prog.launches}
    assert len(set(src)) == len(prog.launches)  # names are unique within a program
    assert all(text.startswith(f"kernel {l.kernel.name}(") for l, text in zip(prog.launches, src.values()))
    assert all(l.eqns for l in prog.launches)  # for the profiler: the equations each launch computes


def test_unknown_region_is_a_compile_error():
    with pytest.raises(CompileError, match="no kernel lowering for the primitive mystery"):
        lower_region(Region((), (), (), "mystery"))


# ---- the dispatcher ------------------------------------------------------------------------------

def test_every_kernel_kind_has_the_generic_candidate():
    for kind in dispatch.KERNEL_KINDS:
        names = [i.name for i in dispatch.candidates(kind, "cpu")]
        assert names[-1] == "kernel_ir"


def test_dispatcher_picks_the_best_applicable_candidate():
    used = []

    def build(kernel, device, backend):
        run = backend.compile_kernel(kernel, device)

        def wrapped(buffers):
            used.append(kernel.name)
            run(buffers)
        return wrapped
    special = dispatch.Implementation("special_reduce", "reduce", build, device_kinds=("interp",),
                                      applies=lambda k, d: k.size <= 4, priority=10)
    elsewhere = dispatch.Implementation("other_device", "reduce", build, device_kinds=("cuda",), priority=20)
    dispatch.register(special)
    dispatch.register(elsewhere)
    try:
        prog, _ = compile_and_run(lambda x: (tnp.sum(x, axis=1), tnp.sum(x, axis=0)), r(3, 7))
    finally:
        dispatch.unregister(special)
        dispatch.unregister(elsewhere)
    impls = {l.name: l.impl for l in prog.launches}
    assert sorted(impls.values()) == ["kernel_ir", "special_reduce"]  # only the 3-row sum is small
    assert used == [l.kernel.name for l in prog.launches if l.impl == "special_reduce"]


# ---- configuration: dumps, checks, fusion off -----------------------------------------------------

def test_dump_dir_gets_every_stage(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "dump_dir", str(tmp_path))
    monkeypatch.setattr(config, "check", True)
    compile_and_run(softmax, r(2, 3))
    (d,) = os.listdir(tmp_path)
    files = os.listdir(tmp_path / d)
    assert any(f.endswith("_simplify.dot") for f in files) and any(f.endswith("_regions.txt") for f in files)
    kernels = next(f for f in files if f.endswith("_kernels.txt"))
    assert "reduce.max" in (tmp_path / d / kernels).read_text()


def test_fusion_can_be_switched_off(monkeypatch):
    on, _ = compile_and_run(layernorm, r(3, 8), r(8), r(8))
    monkeypatch.setattr(config, "fusion", False)
    off, _ = compile_and_run(layernorm, r(3, 8), r(8), r(8))
    assert len(off.launches) > 2 * len(on.launches)


# ---- the static buffer planner ----------------------------------------------------------------------

def test_planner_reuses_memory_in_a_chain():
    # a chain: each buffer dies when the next is written, so two slots suffice
    bufs = [Interval(k, 1000, k, k + 1) for k in range(10)]
    plan = plan_buffers(bufs)
    assert plan.total_bytes == 10_000 and plan.arena_bytes <= 2 * 1024


def test_program_arena_is_smaller_than_its_intermediates():
    def f(x):
        for _ in range(6):  # the product read twice is no GEMM epilogue: every step writes twice
            y = x @ x
            x = tnp.sin(y - y.mean(axis=0))
        return x
    prog, _ = compile_and_run(f, r(8, 8) * 0.3)
    assert prog.plan.total_bytes >= 10 * 8 * 8 * 4
    assert prog.plan.arena_bytes < prog.plan.total_bytes / 3


intervals = st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 30), st.integers(0, 10)),
                     min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(intervals)
def test_planner_never_overlaps_live_buffers(spec):
    bufs = [Interval(k, n, s, s + d) for k, (n, s, d) in enumerate(spec)]
    plan = plan_buffers(bufs)
    for a in bufs:
        off = plan.offsets[a.key]
        assert off % ALIGN == 0 and off + a.nbytes <= plan.arena_bytes
    for i, a in enumerate(bufs):
        for b in bufs[i + 1:]:
            if a.overlaps_in_time(b) and a.nbytes and b.nbytes:
                oa, ob = plan.offsets[a.key], plan.offsets[b.key]
                assert oa + a.nbytes <= ob or ob + b.nbytes <= oa, (a, b, oa, ob)
    # never worse than the bytes live at the busiest step (rounded up per buffer) times the count
    assert plan.arena_bytes <= sum(-(-b.nbytes // ALIGN) * ALIGN for b in bufs)
