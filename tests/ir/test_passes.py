"""The graph passes, each alone: it preserves semantics (the graph evaluated with the primitives'
numpy implementations gives the same results before and after) and does what it says (counts of
equations and constants). Then the pass manager: the pipeline's order, dumps and checks."""
from __future__ import annotations

import os

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse.ir import primitives as P
from tilefuse.ir.core import Eqn, Graph, Literal, ShapedArray, Var, eval_graph
from tilefuse.ir.passes import (PIPELINE, Dump, cse, dce, fold_constants, fold_transpose_into_dot,
                                run_passes, simplify)
from tilefuse.ir.passes.util import FOLD_LIMIT, new_eqn

F32 = np.dtype(np.float32)


def ref_eval(g: Graph, args):
    return eval_graph(g, args, lambda e, xs: e.prim.impl(*xs, **e.params))


def rand_args(g: Graph, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for v in g.invars:
        a = v.aval
        if np.dtype(a.dtype).kind in "iu":
            out.append(rng.integers(0, 3, a.shape).astype(a.dtype))
        else:
            out.append(rng.uniform(0.5, 2.0, a.shape).astype(a.dtype))
    return out


def assert_same(before: Graph, after: Graph, seed=0):
    args = rand_args(before, seed)
    for x, y in zip(ref_eval(before, args), ref_eval(after, args), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6, atol=1e-6)


class GB:
    """Builds a graph by hand, equation by equation: gb(prim, *inputs, **params) -> output var."""

    def __init__(self, *shapes, dtype=F32):
        self.invars = [Var(ShapedArray(tuple(s), np.dtype(dtype))) for s in shapes]
        self.eqns: list[Eqn] = []

    def __call__(self, prim, *inputs, **params):
        e, outs = new_eqn(prim, inputs, params)
        self.eqns.append(e)
        return outs[0] if len(outs) == 1 else outs

    def graph(self, *outs, constvars=(), consts=()):
        return Graph(tuple(constvars), tuple(self.invars), tuple(self.eqns), tuple(outs), tuple(consts))


def lit(v, dtype=F32):
    return Literal(np.asarray(v, dtype), ShapedArray((), np.dtype(dtype)))


def make(f, *shapes):
    return tx.make_graph(f)(*[np.ones(s, np.float32) for s in shapes])


# ---- dce --------------------------------------------------------------------------------------

def test_dce_drops_dead_code_and_keeps_effects():
    def f(x):
        unused = tnp.exp(x) * 3.0  # noqa: F841  (dead: two equations)
        tx.debug_print("x = {}", x)
        return tnp.sin(x)
    g = make(f, (4,))
    assert g.count("exp") == 1 and g.count("debug_print") == 1
    out = dce(g)
    assert out.count("exp") == 0 and out.count("mul") == 0
    assert out.count("debug_print") == 1 and out.count("sin") == 1
    assert_same(g, out)


def test_dce_drops_unused_constants():
    gb = GB((3,))
    c_used, c_dead = Var(ShapedArray((3,), F32)), Var(ShapedArray((3,), F32))
    y = gb(P.add, gb.invars[0], c_used)
    gb(P.mul, gb.invars[0], c_dead)
    g = gb.graph(y, constvars=(c_used, c_dead), consts=(np.ones(3, F32), np.full(3, 2, F32)))
    out = dce(g)
    assert len(out.eqns) == 1 and out.constvars == (c_used,) and len(out.consts) == 1
    assert_same(g, out)


# ---- cse --------------------------------------------------------------------------------------

def test_cse_merges_equal_equations():
    g = make(lambda x, y: tnp.exp(x) * tnp.exp(x) + tnp.exp(y) + tnp.transpose(x) @ tnp.transpose(x).T,
             (3, 3), (3, 3))
    assert g.count("exp") == 3 and g.count("transpose") >= 2
    out = cse(g)
    assert out.count("exp") == 2  # exp(x) once, exp(y) once
    assert out.count("transpose") == g.count("transpose") - 1
    assert_same(g, out)


def test_cse_keeps_different_params_and_literals_apart():
    gb = GB((4,))
    x = gb.invars[0]
    a, b, c = gb(P.add, x, gb(P.broadcast_in_dim, lit(1.0), shape=(4,), broadcast_dimensions=())), \
        gb(P.add, x, gb(P.broadcast_in_dim, lit(2.0), shape=(4,), broadcast_dimensions=())), \
        gb(P.add, x, gb(P.broadcast_in_dim, lit(1.0), shape=(4,), broadcast_dimensions=()))
    g = gb.graph(a, b, c)
    out = dce(cse(g))
    assert out.count("broadcast_in_dim") == 2 and out.count("add") == 2
    assert out.outvars[0] is out.outvars[2]
    assert_same(g, out)


def test_cse_never_merges_effects():
    def f(x):
        tx.debug_print("{}", x)
        tx.debug_print("{}", x)
        return x
    out = cse(make(f, (2,)))
    assert out.count("debug_print") == 2


# ---- constant folding ---------------------------------------------------------------------------

def test_fold_uniform_operands_to_one_broadcast():
    gb = GB((5,))
    two = gb(P.broadcast_in_dim, lit(2.0), shape=(5,), broadcast_dimensions=())
    three = gb(P.broadcast_in_dim, lit(3.0), shape=(5,), broadcast_dimensions=())
    six = gb(P.mul, two, three)
    e6 = gb(P.exp, six)
    y = gb(P.add, gb.invars[0], e6)
    g = gb.graph(y)
    out = dce(fold_constants(g))
    assert out.count("mul") == 0 and out.count("exp") == 0
    assert out.count("broadcast_in_dim") == 1 and out.count("add") == 1
    (b,) = [e for e in out.eqns if e.prim.name == "broadcast_in_dim"]
    assert b.inputs[0].val == np.float32(np.exp(np.float32(6.0)))
    assert_same(g, out)


def test_fold_small_constants_not_large_ones():
    small = np.arange(6, dtype=F32).reshape(2, 3)
    large = np.arange(FOLD_LIMIT + 1, dtype=F32)

    def f(x, z):
        return x + tnp.transpose(tnp.asarray(small) * 2.0).sum(), z + tnp.asarray(large) * 2.0
    g = tx.make_graph(f)(np.ones((), F32), np.ones(FOLD_LIMIT + 1, F32))
    n_before = len(g.eqns)
    out = dce(fold_constants(g))
    # transpose, mul and sum of the small constant fold away; the large product stays computed
    assert out.count("transpose") == 0 and out.count("reduce_sum") == 0
    assert out.count("mul") == 1 and len(out.eqns) < n_before
    assert all(np.asarray(c).size <= FOLD_LIMIT or np.asarray(c).size == large.size for c in out.consts)
    assert_same(g, out)


def test_fold_scalar_result_becomes_a_literal():
    gb = GB((3,))
    s = gb(P.add, lit(2.0), lit(5.0))
    y = gb(P.mul, gb.invars[0], gb(P.broadcast_in_dim, s, shape=(3,), broadcast_dimensions=()))
    g = gb.graph(y, s)
    out = dce(fold_constants(g))
    assert out.count("add") == 0 and isinstance(out.outvars[1], Literal) and out.outvars[1].val == 7.0
    assert_same(g, out)


# ---- algebraic simplification --------------------------------------------------------------------

def _bcast(gb, v, shape):
    return gb(P.broadcast_in_dim, lit(v), shape=shape, broadcast_dimensions=())


def _case_mul_one(gb, x):
    return gb(P.mul, x, _bcast(gb, 1.0, (2, 3)))


def _case_one_mul(gb, x):
    return gb(P.mul, _bcast(gb, 1.0, (2, 3)), x)


def _case_add_zero(gb, x):  # -0.0: x + 0.0 is 0.0 at x = -0.0, not x
    return gb(P.add, x, _bcast(gb, -0.0, (2, 3)))


def _case_zero_add(gb, x):
    return gb(P.add, _bcast(gb, -0.0, (2, 3)), x)


def _case_sub_zero(gb, x):
    return gb(P.sub, x, _bcast(gb, 0.0, (2, 3)))


def _case_div_one(gb, x):
    return gb(P.div, x, _bcast(gb, 1.0, (2, 3)))


def _case_double_transpose(gb, x):
    return gb(P.transpose, gb(P.transpose, x, permutation=(1, 0)), permutation=(1, 0))


def _case_identity_transpose(gb, x):
    return gb(P.transpose, x, permutation=(0, 1))


def _case_reshape_chain(gb, x):
    return gb(P.reshape, gb(P.reshape, gb(P.reshape, x, new_sizes=(6,)), new_sizes=(3, 2)), new_sizes=(2, 3))


def _case_reshape_same(gb, x):
    return gb(P.reshape, x, new_sizes=(2, 3))


def _case_convert_same(gb, x):
    return gb(P.convert_element_type, x, new_dtype=F32)


def _case_broadcast_of_broadcast(gb, x):
    y = gb(P.broadcast_in_dim, x, shape=(4, 2, 3), broadcast_dimensions=(1, 2))
    z = gb(P.broadcast_in_dim, y, shape=(5, 4, 2, 3), broadcast_dimensions=(1, 2, 3))
    return gb(P.reduce_sum, z, axes=(0, 1))


def _case_stop_gradient(gb, x):
    return gb(P.stop_gradient, x)


# name -> (builder, primitive whose count must drop to `left`, left)
SIMPLIFY_CASES = {
    "x*1": (_case_mul_one, "mul", 0), "1*x": (_case_one_mul, "mul", 0),
    "x+0": (_case_add_zero, "add", 0), "0+x": (_case_zero_add, "add", 0),
    "x-0": (_case_sub_zero, "sub", 0), "x/1": (_case_div_one, "div", 0),
    "transpose(transpose(x))": (_case_double_transpose, "transpose", 0),
    "transpose(x, identity)": (_case_identity_transpose, "transpose", 0),
    "reshape chain": (_case_reshape_chain, "reshape", 0),
    "reshape to the same shape": (_case_reshape_same, "reshape", 0),
    "convert to the same dtype": (_case_convert_same, "convert_element_type", 0),
    "broadcast of a broadcast": (_case_broadcast_of_broadcast, "broadcast_in_dim", 1),
    "stop_gradient": (_case_stop_gradient, "stop_gradient", 0),
}


@pytest.mark.parametrize("name", list(SIMPLIFY_CASES))
def test_simplify_rule(name):
    build, prim, left = SIMPLIFY_CASES[name]
    gb = GB((2, 3))
    y = build(gb, gb.invars[0])
    g = gb.graph(gb(P.tanh, y))
    assert g.count(prim) > left
    out = dce(simplify(g))
    assert out.count(prim) == left, str(out)
    assert_same(g, out)


def test_simplify_keeps_non_identities():
    gb = GB((2, 3))
    x = gb.invars[0]
    y = gb(P.mul, x, _bcast(gb, 2.0, (2, 3)))
    y = gb(P.add, y, _bcast(gb, 1.0, (2, 3)))  # x+1 is not x
    y = gb(P.add, y, _bcast(gb, 0.0, (2, 3)))  # nor x+0.0 (-0.0 + 0.0 is 0.0)
    y = gb(P.sub, y, _bcast(gb, -0.0, (2, 3)))  # nor x-(-0.0)
    y = gb(P.transpose, gb(P.transpose, y, permutation=(1, 0)), permutation=(1, 0))
    g = gb.graph(gb(P.transpose, y, permutation=(1, 0)))
    out = dce(simplify(g))
    assert out.count("mul") == 1 and out.count("add") == 2 and out.count("sub") == 1
    assert out.count("transpose") == 1
    assert_same(g, out)


def test_simplify_layout_of_a_broadcast_scalar():
    gb = GB((6,))
    b = _bcast(gb, 3.0, (2, 3))
    r = gb(P.reshape, gb(P.transpose, b, permutation=(1, 0)), new_sizes=(6,))
    g = gb.graph(gb(P.add, gb.invars[0], r))
    out = dce(simplify(g))
    assert out.count("transpose") == 0 and out.count("reshape") == 0
    assert out.count("broadcast_in_dim") == 1
    assert_same(g, out)


# ---- transpose folding into dot_general ------------------------------------------------------

def test_transpose_folds_into_dot():
    g = make(lambda a, b, c: (tnp.transpose(a) @ b, c @ tnp.transpose(b)), (4, 3), (4, 5), (2, 5))
    assert g.count("transpose") == 2 and g.count("dot_general") == 2
    out = dce(fold_transpose_into_dot(g))
    assert out.count("transpose") == 0 and out.count("dot_general") == 2
    dns = [e.params["dimension_numbers"] for e in out.eqns]
    assert dns[0] == (((0,), (0,)), ((), ())) and dns[1] == (((1,), (1,)), ((), ()))
    assert_same(g, out)


def test_transpose_folds_with_batch_dims():
    g = make(lambda a, b: tnp.matmul(tnp.transpose(a, (0, 2, 1)), b), (2, 4, 3), (2, 4, 5))
    out = dce(fold_transpose_into_dot(g))
    assert out.count("transpose") == 0
    assert_same(g, out)


def test_transpose_that_reorders_free_axes_stays():
    # the free axes of the operand would change order: the result's layout would differ
    gb = GB((3, 4, 5), (5, 2))
    t = gb(P.transpose, gb.invars[0], permutation=(1, 0, 2))
    y = gb(P.dot_general, t, gb.invars[1], dimension_numbers=(((2,), (0,)), ((), ())))
    g = gb.graph(y)
    out = dce(fold_transpose_into_dot(g))
    assert out.count("transpose") == 1
    assert_same(g, out)


def test_dot_layouts_transposes_an_operand_whose_axes_do_not_collapse():
    """einsum('ok,nkp->nop'): the rhs's free axes n and p lie on either side of k, so no strided
    GEMM reads it; dot_layouts transposes it to (k, n, p) and the GEMM takes the product (the
    result's layout unchanged). Products that already collapse, below the generic kernel's size,
    or of ints are left alone."""
    from tilefuse.ir.kernel.matmul import matmul_layout
    from tilefuse.ir.passes.simplify import dot_layouts
    big = make(lambda a, b: tnp.einsum("ok,nkp->nop", a, b), (64, 96), (4, 96, 48))
    out = dce(dot_layouts(big))
    (dot,) = [e for e in out.eqns if e.prim is P.dot_general]
    assert out.count("transpose") == 2 and matmul_layout(dot) is not None, out  # (and einsum's own)
    assert_same(big, out)
    batched = make(lambda a, b: tnp.einsum("bmk,kbn->bmn", a, b), (4, 40, 64), (64, 4, 50))
    out = dce(dot_layouts(batched))
    assert [matmul_layout(e) is not None for e in out.eqns if e.prim is P.dot_general] == [True], out
    assert_same(batched, out)
    for g in (make(lambda a, b: a @ b, (64, 96), (96, 48)),  # collapses already
              make(lambda a, b: tnp.einsum("ok,nkp->nop", a, b), (4, 6), (2, 6, 5))):  # small
        assert str(dot_layouts(g)) == str(g)
    ints = tx.make_graph(lambda a, b: tnp.einsum("ok,nkp->nop", a, b))(np.ones((64, 96), np.int32),
                                                                       np.ones((4, 96, 48), np.int32))
    assert str(dot_layouts(ints)) == str(ints)


def test_a_sum_of_disjoint_pads_becomes_one_concatenate():
    """pad(a) + pad(b) + pad(c) with +0 fills whose pieces meet along one axis (the gradient of
    slicing qkv): one concatenate of the pieces plus 0, no pad and no full add left; exact, -0.0
    included (x + 0.0 is +0.0 there, as before). Overlapping pieces, or a gap, are left alone."""
    gb = GB((2, 1, 3), (2, 1, 3), (2, 1, 3))
    a, b, c = gb.invars
    pa = gb(P.pad, a, lit(0.0), padding_config=((0, 0, 0), (2, 0, 0), (0, 0, 0)))
    pb = gb(P.pad, b, lit(0.0), padding_config=((0, 0, 0), (1, 1, 0), (0, 0, 0)))
    pc = gb(P.pad, c, lit(0.0), padding_config=((0, 0, 0), (0, 2, 0), (0, 0, 0)))
    g = gb.graph(gb(P.add, gb(P.add, pa, pb), pc))
    out = dce(simplify(g))
    assert out.count("pad") == 0 and out.count("concatenate") == 1, out
    assert all(e.outputs[0].aval.shape == (2, 1, 3) for e in out.eqns if e.prim is P.add), out
    args = [np.array([[[-0.0, 1.5, np.inf]], [[np.nan, -2.0, -0.0]]], np.float32)] * 3
    for want, got in zip(ref_eval(g, args), ref_eval(out, args), strict=True):
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
        np.testing.assert_array_equal(got, want)
    # pieces at 0 and 1 of 4 rows: their concatenation padded; overlapping pieces, or a gap
    # between them, are left alone
    gb = GB((2, 1, 3), (2, 1, 3))
    a, b = gb.invars
    pa = gb(P.pad, a, lit(0.0), padding_config=((0, 0, 0), (0, 3, 0), (0, 0, 0)))
    pb = gb(P.pad, b, lit(0.0), padding_config=((0, 0, 0), (1, 2, 0), (0, 0, 0)))
    overlap = gb(P.pad, b, lit(0.0), padding_config=((0, 0, 0), (0, 3, 0), (0, 0, 0)))
    gap = gb(P.pad, b, lit(0.0), padding_config=((0, 0, 0), (2, 1, 0), (0, 0, 0)))
    g = gb.graph(gb(P.add, pa, pb), gb(P.add, pa, overlap), gb(P.add, pa, gap))
    out = dce(simplify(g))
    assert out.count("concatenate") == 1 and out.count("pad") == 4 and out.count("add") == 4, out
    assert_same(g, out)

# ---- the pass manager ---------------------------------------------------------------------------

def test_pipeline_order_is_the_documented_one():
    assert [n for n, _ in PIPELINE] == ["inline_calls", "dce", "prune_control_flow", "cse", "fold_constants",
                                        "simplify", "fold_transpose_into_dot", "conv_layouts",
                                        "hoist_loop_invariants", "fuse_attention", "dot_layouts", "fuse_gemm_epilogues", "cse_after", "attention_stats", "dce_after",
                                        "prune_after"]


def _mlp_ish(x, w):
    return tnp.tanh(tnp.transpose(tnp.transpose(x)) @ w * 1.0 + 0.0).sum()


def test_pipeline_preserves_semantics_and_simplifies():
    g = make(_mlp_ish, (3, 4), (4, 2))
    out = run_passes(g, check=True)
    assert out.count("transpose") == 0 and out.count("mul") == 0 and len(out.eqns) < len(g.eqns)
    assert_same(g, out)


def test_dump_writes_text_and_dot_per_pass(tmp_path):
    g = make(_mlp_ish, (3, 4), (4, 2))
    dump = Dump(str(tmp_path), "mlp")
    run_passes(g, dump=dump)
    (d,) = os.listdir(tmp_path)
    files = sorted(os.listdir(tmp_path / d))
    stages = ["input"] + [n for n, _ in PIPELINE]
    assert files == sorted(f"{i:02d}_{s}.{ext}" for i, s in enumerate(stages) for ext in ("txt", "dot"))
    text = (tmp_path / d / "00_input.txt").read_text()
    assert "dot_general" in text and "transpose" in text
    assert (tmp_path / d / "02_dce.dot").read_text().startswith('digraph "dce"')


def test_check_names_the_pass_that_breaks_the_graph():
    def broken(graph):  # claims a wrong output type for the first equation
        e = graph.eqns[0]
        bad = Var(ShapedArray((7,), F32))
        return graph.replace(eqns=(e.replace(outputs=(bad,)),) + graph.eqns[1:])
    g = make(lambda x: tnp.exp(x) + 1.0, (3,))
    with pytest.raises(AssertionError, match="after pass broken"):
        run_passes(g, (("broken", broken),), check=True)
    run_passes(g, (("broken", broken),), check=False)  # unchecked, nobody notices


@pytest.mark.parametrize("scalar", ["literal", "variable"])
def test_elementwise_with_constants_moves_above_a_reshape(scalar):
    """mean(x, keepdims=True) is sum -> reshape -> div: the div moves before the reshape, where it
    can be the reduction's epilogue; so it does with a scalar that is no constant (a
    shape-generic trace's row length, or a scalar input), so that a symbolic trace's front end
    fuses a layer norm as the concrete trace's does (and shares its kernels' code)."""
    if scalar == "literal":
        g = make(lambda x: tnp.sqrt(tnp.mean(x, axis=1, keepdims=True) + 1.0) * x, (3, 4))
    else:
        g = make(lambda x, n: tnp.sqrt(tnp.sum(x, axis=1, keepdims=True) / n + 1.0) * x, (3, 4), ())
    out = dce(simplify(g))
    producer = {o.id: e for e in out.eqns for o in e.outputs}
    (div,) = [e for e in out.eqns if e.prim.name == "div"]
    (sqrt,) = [e for e in out.eqns if e.prim.name == "sqrt"]
    assert producer[div.inputs[0].id].prim.name == "reduce_sum"
    assert div.outputs[0].aval.shape == (3,) and sqrt.outputs[0].aval.shape == (3,)
    assert out.count("reshape") == 1
    assert_same(g, out)
