"""The graph IR and dtypes, with no device: avals, promotion, printing, DOT, evaluation and the
type checker."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tilefuse.ir import dtypes as D
from tilefuse.ir import primitives as P
from tilefuse.ir.core import (Eqn, Graph, Literal, ShapedArray, Var, aval_of_value, dtype_short, eval_graph,
                              typecheck_graph)
from tilefuse.ir.errors import DTypeError

F32, F16, BF16, F64 = D.float32, D.float16, D.bfloat16, D.float64
I32, I64, U32, U64, B = D.int32, D.int64, D.uint32, D.uint64, D.bool_


def test_shaped_array():
    a = ShapedArray((2, 3), F32)
    assert a.ndim == 2 and a.size == 6 and str(a) == "f32[2,3]" and not a.weak_type
    assert ShapedArray((), BF16).str_short() == "bf16[]" and ShapedArray((0,), B).size == 0
    assert a == ShapedArray((2, 3), F32) and hash(a) == hash(ShapedArray((2, 3), F32))
    assert a != ShapedArray((2, 3), F32, True) and a != ShapedArray((3, 2), F32)
    w = ShapedArray((), F32, True)
    assert w.strip_weak() == ShapedArray((), F32) and a.strip_weak() is a
    assert a.update(shape=(6,)) == ShapedArray((6,), F32) and a.update(dtype=I32).dtype == I32
    assert {a: 1}[ShapedArray((2, 3), F32)] == 1


def test_aval_of_value():
    assert aval_of_value(1.0) == ShapedArray((), F32, True)
    assert aval_of_value(3) == ShapedArray((), I32, True)
    assert aval_of_value(True) == ShapedArray((), B, True)
    assert aval_of_value(np.float64(1)) == ShapedArray((), F64)
    assert aval_of_value(np.ones((2, 1), np.int8)) == ShapedArray((2, 1), np.dtype(np.int8))  # kept narrow
    assert aval_of_value(np.ones(3, ml_dtypes.bfloat16)).dtype == BF16


def test_canonicalize():
    assert D.canonicalize(float) == F32 and D.canonicalize(int) == I32 and D.canonicalize(bool) == B
    assert D.canonicalize("bfloat16") == BF16 and D.canonicalize("half") == F16
    assert D.canonicalize(np.float64) == F64 and D.canonicalize("int64") == I64
    assert D.canonicalize(np.uint8) == np.uint8 and D.canonicalize("int16") == np.int16
    assert D.canonicalize(np.uint64) == U64 and D.canonicalize("uint64") == U64  # was refused (and before
    # that silently int64: 2**63 turned negative)
    with pytest.raises(DTypeError, match="complex64"):
        D.canonicalize(np.complex64)
    with pytest.raises(DTypeError):
        D.canonicalize("not a dtype")


@pytest.mark.parametrize("a,b,want", [
    (F32, F32, F32), (F32, F16, F32), (F16, BF16, F32), (BF16, BF16, BF16), (F32, F64, F64), (F16, F64, F64),
    (I32, I64, I64), (I32, U32, I64), (I32, F16, F16), (I64, F32, F32), (B, I32, I32), (B, F16, F16),
    (B, B, B), (U32, U32, U32),
    # uint64 on JAX's lattice: the wider unsigned, and no signed int holds it: with one it meets at
    # f* (float64), with a float it is that float
    (U64, U32, U64), (U64, np.dtype(np.uint8), U64), (U64, I64, F64), (U64, I32, F64), (U64, np.dtype(np.int8), F64),
    (U64, F32, F32), (U64, F16, F16), (U64, BF16, BF16), (B, U64, U64), (U64, U64, U64),
])
def test_promotion_lattice(a, b, want):
    assert D.result_type((a, False), (b, False)) == (want, False)
    assert D.result_type((b, False), (a, False)) == (want, False)


@pytest.mark.parametrize("strong,weak,want", [
    (F32, F32, F32), (F16, F32, F16), (BF16, F32, BF16), (I32, I32, I32), (I64, I32, I64),
    (I32, F32, F32), (I64, F32, F32), (B, I32, I32), (B, F32, F32), (B, B, B), (F16, I32, F16), (U32, I32, U32),
    (U64, I32, U64), (U64, F32, F32),
])
def test_weak_python_scalars(strong, weak, want):
    """x * 2.0 keeps x's float dtype; int32 + 1 stays int32; a float scalar lifts ints to float32."""
    assert D.result_type((strong, False), (weak, True)) == (want, False)


def test_all_weak_promotion():
    assert D.result_type((I32, True), (F32, True)) == (F32, True)
    assert D.result_type((I32, True), (I32, True)) == (I32, True)
    assert D.result_type((B, True)) == (B, True)


def test_dtype_helpers():
    assert D.is_float(BF16) and D.is_float(F64) and not D.is_float(I32)
    assert D.is_int(U32) and D.is_bool(B) and not D.is_int(B)
    assert D.compute_dtype(F16) == F32 and D.compute_dtype(BF16) == F32 and D.compute_dtype(F64) == F64
    assert D.finfo(BF16).bits == 16 and float(D.finfo(F32).eps) == float(np.finfo(np.float32).eps)
    assert D.python_scalar_dtype(2.5) == F32 and D.python_scalar_dtype(2) == I32
    assert dtype_short(BF16) == "bf16" and dtype_short(U32) == "u32"


def _graph():
    """f(x, y) = sum((x + y) * 2.0) with a constant table c: exp(c) too."""
    x, y, c = Var(ShapedArray((3,), F32)), Var(ShapedArray((3,), F32)), Var(ShapedArray((3,), F32))
    s, t, r, e = (Var(ShapedArray((3,), F32)), Var(ShapedArray((3,), F32)), Var(ShapedArray((), F32)),
                  Var(ShapedArray((3,), F32)))
    two = Var(ShapedArray((3,), F32))
    eqns = (Eqn(P.add, (x, y), (s,), {}, "model.py:3"),
            Eqn(P.broadcast_in_dim, (Literal(2.0, ShapedArray((), F32)),), (two,),
                {"shape": (3,), "broadcast_dimensions": ()}),
            Eqn(P.mul, (s, two), (t,), {}),
            Eqn(P.reduce_sum, (t,), (r,), {"axes": (0,)}),
            Eqn(P.exp, (c,), (e,), {}))
    return Graph((c,), (x, y), eqns, (r, e), (np.zeros(3, np.float32),))


def test_graph_text():
    g = _graph()
    assert str(g) == (
        "{ lambda a:f32[3]; b:f32[3] c:f32[3] .\n"
        "  let d:f32[3] = add b c\n"
        "      e:f32[3] = broadcast_in_dim[broadcast_dimensions=() shape=(3,)] 2.0:f32\n"
        "      f:f32[3] = mul d e\n"
        "      g:f32[] = reduce_sum[axes=(0,)] f\n"
        "      h:f32[3] = exp a\n"
        "  in (g, h) }")
    assert g.eqn_text(g.eqns[2]) == "f:f32[3] = mul d e"
    assert g.eqn_text(g.eqns[0]) == "d:f32[3] = add b c"
    assert g.count() == 5 and g.count("add") == 1 and g.count("dot_general") == 0
    assert g.in_avals == [ShapedArray((3,), F32)] * 2 and g.out_avals[0] == ShapedArray((), F32)


def test_variable_names_go_past_z():
    vs = [Var(ShapedArray((), F32)) for _ in range(30)]
    eqns = tuple(Eqn(P.neg, (a,), (b,), {}) for a, b in zip(vs, vs[1:]))
    text = str(Graph((), (vs[0],), eqns, (vs[-1],)))
    assert "aa:f32[]" in text and "ad:f32[] = neg ac" in text and text.endswith("in (ad) }")


def test_to_dot():
    dot = _graph().to_dot("f")
    assert dot.startswith('digraph "f" {') and dot.rstrip().endswith("}")
    assert 'label="add\\nf32[3]"' in dot and "shape=note" in dot  # constants are notes
    assert "in0 -> e0;" in dot and "in1 -> e0;" in dot and "e0 -> e2;" in dot and "e3 -> out0;" in dot
    assert "c0 -> e4;" in dot


def test_eval_graph():
    g = _graph()
    x, y = np.array([1, 2, 3], np.float32), np.array([1, 1, 1], np.float32)
    out = eval_graph(g, [x, y], lambda e, xs: e.prim.impl(*xs, **e.params))
    assert float(out[0]) == 2 * (6 + 3) and np.allclose(out[1], 1.0)
    out = eval_graph(g, [x, y], lambda e, xs: e.prim.impl(*xs, **e.params), consts=[np.ones(3, np.float32)])
    assert np.allclose(out[1], np.e)
    with pytest.raises(ValueError):
        eval_graph(g, [x], lambda e, xs: e.prim.impl(*xs, **e.params))


def test_the_interpreter_drops_values_after_their_last_use_and_agrees_with_eval_graph():
    import gc
    import weakref
    x, y = Var(ShapedArray((3,), F32)), Var(ShapedArray((3,), F32))
    a, b, dead, c = (Var(ShapedArray((3,), F32)) for _ in range(4))
    one = Literal(np.float32(1), ShapedArray((), F32))
    eqns = (Eqn(P.mul, (x, x), (a,), {}),  # an operand read twice
            Eqn(P.neg, (a,), (dead,), {}),  # a result nothing reads
            Eqn(P.add, (a, y), (b,), {}),  # a's last use
            Eqn(P.exp, (b,), (c,), {}))
    g = Graph((), (x, y), eqns, (c, x, c, one, b))  # an input, a repeat and a literal among the outputs
    args = [np.array([1, 2, 3], np.float32), np.array([0, -1, 0.5], np.float32)]
    interpreter = P.Interpreter(g)
    for _ in range(2):  # (prepared once, run twice)
        got = interpreter(args)
        want = eval_graph(g, args, lambda e, xs: e.prim.impl(*xs, **e.params))
        assert len(got) == 5 and all(np.array_equal(u, v) for u, v in zip(got, want))
        assert got[1] is args[0] and got[0] is got[2]
    seen = []  # what each equation's results were while the next ran: a and dead gone by b's exp
    probe = Eqn(P.exp, (b,), (c,), {})
    kept = []
    real = P.exp._impl

    def spy(v):
        gc.collect()
        seen.append([r() is None for r in kept])
        return real(v)
    old_mul, old_neg = P.mul._impl, P.neg._impl
    P.mul._impl = lambda u, w: kept.append(weakref.ref(r := old_mul(u, w))) or r
    P.neg._impl = lambda u: kept.append(weakref.ref(r := old_neg(u))) or r
    P.exp._impl = spy
    try:
        P.Interpreter(g.replace(eqns=eqns[:3] + (probe,)))(args)
    finally:
        P.mul._impl, P.neg._impl, P.exp._impl = old_mul, old_neg, real
    assert seen == [[True, True]]


def test_typecheck_accepts_good_graphs_and_catches_bad_ones():
    typecheck_graph(_graph())
    g = _graph()
    bad_out = g.replace(eqns=(g.eqns[0].replace(outputs=(Var(ShapedArray((4,), F32)),)),) + g.eqns[1:])
    with pytest.raises(AssertionError):
        typecheck_graph(bad_out)
    x, y = g.invars
    wrong = Eqn(P.add, (x, Var(ShapedArray((2,), F32))), (Var(ShapedArray((3,), F32)),), {})
    with pytest.raises(AssertionError):  # an input never defined, and shapes that disagree
        typecheck_graph(g.replace(eqns=(wrong,)))
    v = Var(ShapedArray((3,), F32))
    twice = (Eqn(P.neg, (x,), (v,), {}), Eqn(P.neg, (y,), (v,), {}))
    with pytest.raises(AssertionError, match="bound twice"):
        typecheck_graph(Graph((), (x, y), twice, (v,)))
    with pytest.raises(AssertionError, match="undefined"):
        typecheck_graph(Graph((), (x,), (), (Var(ShapedArray((), F32)),)))


def test_graphs_and_eqns_are_immutable_values():
    g = _graph()
    e = g.eqns[0]
    assert e.replace(source="x.py:1").source == "x.py:1" and e.source == "model.py:3"
    with pytest.raises(Exception):
        g.eqns = ()
    g2 = g.replace(outvars=(g.outvars[0],))
    assert len(g2.outvars) == 1 and len(g.outvars) == 2
    lit = Literal(3, ShapedArray((), I32))
    assert lit.val.dtype == np.int32 and "3:i32" in str(Graph((), (), (), (lit,)))
