"""Lowering to the kernel IR: every primitive of the table lowers, and the interpreter running
its kernels agrees with the primitive's numpy implementation (prim.impl) on random inputs,
including 16-bit floats, integer edge cases and sizes 0 and 1. `CASES` has a row per primitive;
`test_the_table_covers_every_primitive` fails when a primitive has none."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from conftest import assert_close
from tilefuse.ir import primitives as P
from tilefuse.ir.core import Graph, Literal, ShapedArray, Var
from tilefuse.ir.kernel import lower_region, run_kernel
from tilefuse.ir.kernel.lower import reshape_index
from tilefuse.ir.passes import partition
from tilefuse.ir.passes.util import new_eqn
from tilefuse.ir.primitives import HOST_PRIMITIVES, PRIMITIVES
from tilefuse.validate.primitives import epilogue_fn

import tilefuse.numpy as tnp
from tilefuse import nn

F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
I32, I64, BOOL = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.bool_)
rng = np.random.default_rng(0)


def f(*shape, lo=-2.0, hi=2.0, dtype=F32):
    return rng.uniform(lo, hi, shape).astype(dtype)


def i(*shape, lo=-5, hi=6, dtype=I32):
    return rng.integers(lo, hi, shape).astype(dtype)


def b(*shape):
    return rng.random(shape) < 0.5


def lit(v, dtype=F32):
    return Literal(np.asarray(v, dtype), ShapedArray((), np.dtype(dtype)))


def C(*inputs, **params):
    """A case: positional inputs (numpy arrays become graph inputs; Literals stay literals)."""
    return (inputs, params)


def run_lowered(g: Graph, args):
    """Partition, lower every region and run its kernels in the interpreter."""
    env = {v.id: np.ascontiguousarray(a) for v, a in zip(g.invars, args)}
    for region in partition(g):
        for lk in lower_region(region):
            arrays = []
            for v in lk.args:
                if v.id not in env:
                    env[v.id] = np.full(v.aval.shape, 77, v.aval.dtype)  # garbage: must be overwritten
                arrays.append(env[v.id].reshape(-1))
            run_kernel(lk.kernel, arrays)
    return [v.val if isinstance(v, Literal) else env[v.id] for v in g.outvars]


def one_eqn_graph(prim, inputs, params):
    invars = [Var(ShapedArray(x.shape, np.dtype(x.dtype))) for x in inputs if not isinstance(x, Literal)]
    it = iter(invars)
    atoms = [x if isinstance(x, Literal) else next(it) for x in inputs]
    e, outs = new_eqn(prim, atoms, params)
    return Graph((), tuple(invars), (e,), tuple(outs)), [x for x in inputs if not isinstance(x, Literal)]


_FLOAT_UNARY = ["neg", "exp", "expm1", "tanh", "logistic", "sin", "cos", "erf", "abs", "sign",
                "floor", "ceil", "round"]
_POSITIVE_UNARY = ["log", "log1p", "sqrt", "rsqrt"]
_ARITH = ["add", "sub", "mul", "div", "rem", "max", "min"]
_CMP = ["eq", "ne", "lt", "le", "gt", "ge"]
_INT_X = np.array([-7, 7, -7, 7, 5, 0, 3, 9], I32)  # (prim.impl gives -3 / 0 = 1: a bug there)
_INT_Y = np.array([2, -2, -2, 2, 0, 3, 0, 4], I32)
_TIES = np.array([[1, 3, 3, 0], [2, 2, 2, 2], [0, -1, 5, 5]], F32)

CASES: dict[str, list] = {}
for _n in _FLOAT_UNARY:
    CASES[_n] = [C(f(3, 5)), C(f(4, dtype=BF16)), C(f(1, 1, dtype=F16)), C(f(0, 3))]
for _n in _POSITIVE_UNARY:
    CASES[_n] = [C(f(3, 5, lo=0.1, hi=4.0)), C(f(7, lo=0.1, hi=4.0, dtype=BF16))]
for _n in ("neg", "abs", "sign"):
    CASES[_n].append(C(i(9)))
CASES["round"].append(C(np.array([0.5, 1.5, 2.5, -0.5, -1.5], F32)))  # half to even
CASES["is_finite"] = [C(np.array([1.0, np.inf, -np.inf, np.nan, 0.0], F32)),
                      C(np.array([1.0, np.inf, np.nan], F16))]
CASES["not"] = [C(b(3, 4)), C(i(6))]
for _n in _ARITH:
    CASES[_n] = [C(f(3, 4), f(3, 4, lo=0.5)), C(_INT_X, _INT_Y),
                 C(f(5, dtype=BF16), f(5, lo=0.5, dtype=BF16))]
for _n in ("add", "mul", "max", "min"):
    CASES[_n].append(C(b(2, 5), b(2, 5)))
CASES["pow"] = [C(f(3, 4, lo=0.1), f(3, 4)), C(f(3, dtype=F16, lo=0.5), f(3, dtype=F16))]
for _n in ("and", "or", "xor"):
    CASES[_n] = [C(b(4, 3), b(4, 3)), C(i(7, lo=-100, hi=100), i(7, lo=-100, hi=100))]
CASES["shift_left"] = [C(i(8, lo=-50, hi=50), i(8, lo=0, hi=31))]
CASES["shift_right_logical"] = [C(i(8, lo=-50, hi=50), i(8, lo=0, hi=31)),
                                C(i(4, lo=-9, hi=9, dtype=I64), i(4, lo=0, hi=63, dtype=I64))]
for _n in _CMP:
    CASES[_n] = [C(_TIES, _TIES.T.reshape(3, 4).copy()), C(_INT_X, _INT_Y), C(b(5), b(5))]
CASES["integer_pow"] = [C(f(3, 4), y=2), C(f(3, 4), y=3), C(f(3, 4, lo=0.5), y=-2), C(f(2), y=0),
                        C(i(5), y=3), C(f(4, dtype=BF16), y=2)]
CASES["select"] = [C(b(3, 4), f(3, 4), f(3, 4)), C(b(5), i(5), i(5))]
CASES["convert_element_type"] = [
    C(np.array([-2.7, -0.5, 0.0, 0.5, 2.7, 100.9], F32), new_dtype=I32),
    C(np.array([-1.5, 0.0, 0.25, 0.0], F32), new_dtype=BOOL),
    C(i(6), new_dtype=F32), C(b(6), new_dtype=F32), C(b(6), new_dtype=I32),
    C(f(9), new_dtype=BF16), C(f(9, dtype=BF16), new_dtype=F32), C(f(9), new_dtype=F16),
    C(f(9, dtype=F16), new_dtype=BF16), C(i(4), new_dtype=I64), C(f(3), new_dtype=F32),
]
CASES["stop_gradient"] = [C(f(3, 2))]
CASES["iota"] = [C(dtype=I32, shape=(3, 4), dimension=1), C(dtype=F32, shape=(2, 3, 2), dimension=0),
                 C(dtype=BF16, shape=(5,), dimension=0)]
CASES["broadcast_in_dim"] = [C(f(3, 1), shape=(2, 3, 4), broadcast_dimensions=(1, 2)),
                             C(f(), shape=(2, 2), broadcast_dimensions=()),
                             C(f(4), shape=(4, 3), broadcast_dimensions=(0,)),
                             C(lit(2.5), shape=(3,), broadcast_dimensions=())]
CASES["reshape"] = [C(f(2, 3, 4), new_sizes=(4, 6)), C(f(6), new_sizes=(1, 2, 1, 3)), C(f(1), new_sizes=())]
CASES["transpose"] = [C(f(2, 3, 4), permutation=(2, 0, 1)), C(i(3, 5), permutation=(1, 0))]
CASES["rev"] = [C(f(3, 4), dimensions=(0, 1)), C(f(3, 4), dimensions=(1,)), C(f(3), dimensions=())]
CASES["slice"] = [C(f(5, 6), start_indices=(1, 0), limit_indices=(5, 6), strides=(2, 3)),
                  C(f(7), start_indices=(3,), limit_indices=(3,), strides=(1,))]
CASES["concatenate"] = [C(f(2, 3), f(2, 0), f(2, 1), dimension=1), C(i(1, 2), i(3, 2), dimension=0)]
CASES["pad"] = [C(f(3, 4), lit(-1.0), padding_config=((1, 2, 0), (0, 1, 2))),
                C(f(2, 2), f(), padding_config=((0, 0, 1), (2, 0, 0))),
                C(f(0, 2), lit(5.0), padding_config=((1, 1, 0), (0, 0, 0)))]
for _n in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod"):
    CASES[_n] = [C(f(3, 4, 5), axes=(0, 2)), C(f(3, 4), axes=(1,)), C(i(4, 3), axes=(0,)),
                 C(f(6, 2, dtype=BF16), axes=(0,)), C(f(3, 2), axes=())]
CASES["reduce_sum"] += [C(b(3, 4), axes=(1,)), C(f(0, 4), axes=(0,)), C(f(4, 3), axes=(0, 1))]
CASES["reduce_min"] += [C(b(3, 4), axes=(0,))]
CASES["reduce_max"] += [C(b(3, 4), axes=(1,))]
for _n in ("argmax", "argmin"):
    CASES[_n] = [C(_TIES, axis=1, index_dtype=I32), C(_TIES, axis=0, index_dtype=I64),
                 C(np.array([[1.0, np.nan, 3.0]], F32), axis=1, index_dtype=I32),
                 C(f(4, 5, dtype=BF16), axis=1, index_dtype=I32)]
CASES["dot_general"] = [
    C(f(3, 4), f(4, 5), dimension_numbers=(((1,), (0,)), ((), ()))),
    C(f(2, 3, 4), f(2, 4, 5), dimension_numbers=(((2,), (1,)), ((0,), (0,)))),
    C(f(4, 3), f(5, 4), dimension_numbers=(((0,), (1,)), ((), ()))),
    C(f(2, 3, 4), f(4, 3, 2), dimension_numbers=(((1, 2), (1, 0)), ((), ()))),
    C(f(3), f(4), dimension_numbers=(((), ()), ((), ()))),
    C(f(3, 0), f(0, 2), dimension_numbers=(((1,), (0,)), ((), ()))),
    C(f(3, 8, dtype=BF16), f(8, 2, dtype=BF16), dimension_numbers=(((1,), (0,)), ((), ()))),
    C(f(3, 8, dtype=BF16), f(8, 2, dtype=BF16), dimension_numbers=(((1,), (0,)), ((), ())),
      preferred_element_type=F32),
    C(i(3, 4), i(4, 2), dimension_numbers=(((1,), (0,)), ((), ()))),
]
CASES["fused_gemm"] = [
    C(f(3, 4), f(4, 5), f(5), f(3, 5), dimension_numbers=(((1,), (0,)), ((), ())), preferred_element_type=None,
      epilogue=epilogue_fn(lambda y, b, r: 0.5 * nn.gelu(y + b) + 1.0 + r, 3)),
    C(f(2, 4, 3), f(2, 4, 5), dimension_numbers=(((1,), (1,)), ((0,), (0,))), preferred_element_type=None,
      epilogue=epilogue_fn(lambda y: nn.relu(nn.silu(nn.gelu(y, approximate=False))), 1)),
    C(f(3, 8, dtype=BF16), f(8, 2, dtype=BF16), f(2, dtype=BF16), dimension_numbers=(((1,), (0,)), ((), ())),
      preferred_element_type=None, epilogue=epilogue_fn(lambda y, b: nn.relu(y + b), 2, BF16)),
    C(f(5, 6, lo=-9, hi=9), f(6, 4), f(5, 4), dimension_numbers=(((1,), (0,)), ((), ())), preferred_element_type=None,
      epilogue=epilogue_fn(lambda y, r: tnp.where(tnp.clip(y, -1.5, 2.0) > r, tnp.floor(y).astype(tnp.int32)
                                                 .astype(tnp.float32), -y), 2)),
]
CASES["gather"] = [C(f(5, 3), np.array([[0, 4], [-1, 7]], I32), axis=0),
                   C(f(2, 6, 3), np.array([5, 0, 2], I64), axis=1),
                   C(f(4, 3), lit(2, I32), axis=0),
                   C(f(4, 3, dtype=BF16), np.array([3, 1], I32), axis=0)]
CASES["scatter_add"] = [C(f(5, 3), np.array([0, 2, 0, 9, -4], I32), f(5, 3), axis=0),
                        C(f(2, 4), np.array([[3, 3], [1, 0]], I32), f(2, 2, 2), axis=1),
                        C(i(4), np.array([1, 1, 1], I32), i(3), axis=0),
                        C(f(4, dtype=BF16), np.array([1, 1, 2], I32), f(3, dtype=BF16), axis=0)]
CASES["dynamic_slice"] = [C(f(5, 3), np.array(3, I32), lit(1, I32), slice_sizes=(2, 2)),
                          C(f(4, 6), np.array(-2, I32), np.array(9, I32), slice_sizes=(4, 3))]
CASES["dynamic_update_slice"] = [C(f(5, 3), f(2, 3), np.array(4, I32), lit(0, I32)),
                                 C(i(6), i(2), lit(-1, I32))]
# debug_print is no kernel: the pipeline runs it on the host (tests/backends/test_pipeline.py)
HOST_ONLY = {"debug_print"}
# tile_op calls are inlined before fusion, never lowered (tests/test_tile_op.py)
INLINED = {"tile_op", "custom_vjp_call", "custom_jvp_call"}
TEMPLATES = {"fused_attention", "fused_attention_stats", "fused_attention_bwd",  # taken whole by implementations:
             "conv", "fused_conv"}  # tests/test_attention.py, tests/test_conv.py
# numpy on the host behind the dispatcher (runtime/host.py): tests/test_linalg.py, tests/ir/test_primitives.py
TEMPLATES |= {p.name for p in HOST_PRIMITIVES}
CONTROL = {"cond", "while", "scan"}  # steps that run their bodies' programs (runtime/control_flow.py): tests/test_lax.py


def test_the_table_covers_every_primitive():
    missing = set(PRIMITIVES) - set(CASES) - HOST_ONLY - INLINED - TEMPLATES - CONTROL
    assert not missing, f"primitives without a lowering test: {sorted(missing)}"


ALL = [pytest.param(n, k, id=f"{n}-{k}") for n in sorted(CASES) for k in range(len(CASES[n]))]


@pytest.mark.parametrize("name,k", ALL)
def test_lowering_agrees_with_impl(name, k):
    prim = PRIMITIVES[name]
    inputs, params = CASES[name][k]
    g, args = one_eqn_graph(prim, inputs, params)
    want = prim.impl(*[x.val if isinstance(x, Literal) else x for x in inputs], **params)
    with np.errstate(all="ignore"):
        got = run_lowered(g, args)
    for w, o, v in zip(want, got, g.outvars, strict=True):
        w = np.asarray(w)
        assert o.shape == w.shape and o.dtype == v.aval.dtype
        assert_close(o, w.astype(v.aval.dtype), dtype=v.aval.dtype)


# ---- the fused path: index maps over values computed in the same kernel -----------------------

@pytest.mark.parametrize("shapes", [((2, 3, 4), (4, 6)), ((6, 4), (2, 3, 2, 2)), ((4, 1, 3), (3, 4)),
                                    ((1, 12), (12, 1)), ((2, 6), (3, 4)), ((5,), (1, 5, 1)),
                                    ((2, 3, 5), (30,)), ((3, 0), (0, 5))])
def test_reshape_of_a_computed_value(shapes):
    src, dst = shapes
    x = Var(ShapedArray(src, F32))
    e1, (y,) = new_eqn(P.exp, [x], {})
    e2, (z,) = new_eqn(P.reshape, [y], dict(new_sizes=dst))
    e3, (w,) = new_eqn(P.neg, [z], {})
    g = Graph((), (x,), (e1, e2, e3), (w,))
    regions = partition(g)
    assert len(regions) == 1 and regions[0].kind == "fused"
    a = f(*src)
    (got,) = run_lowered(g, [a])
    assert_close(got, -np.exp(a).reshape(dst))


def test_reshape_index_of_unit_axes_needs_no_division():
    from tilefuse.ir.kernel.ir import idx
    J = reshape_index((idx(0), idx(1)), (4, 6), (4, 1, 6))
    assert [j.op for j in J] == ["idx", "const", "idx"]


def test_fused_kernel_is_named_after_its_ops_and_keeps_its_equations():
    x = Var(ShapedArray((3, 4), F32))
    e1, (y,) = new_eqn(P.mul, [x, x], {})
    e2, (z,) = new_eqn(P.tanh, [y], {})
    e3, (s,) = new_eqn(P.reduce_sum, [z], dict(axes=(1,)))
    g = Graph((), (x,), (e1, e2, e3), (s,))
    (region,) = partition(g)
    (lk,) = lower_region(region)
    k = lk.kernel
    assert k.name == "fused_mul_tanh_sum"
    assert k.meta["eqns"] == (e1, e2, e3) and k.meta["kind"] == "reduce"
    assert k.shape == (3,) and k.reduce_shape == (4,) and k.n_inputs == 1
    assert lk.args == (x, s)
    text = str(k)
    assert "reduce.sum" in text and "tanh" in text and text.count("load") == 1  # x loaded once


def test_sixteen_bit_floats_compute_in_float32():
    x = Var(ShapedArray((4,), BF16))
    e1, (y,) = new_eqn(P.exp, [x], {})
    e2, (z,) = new_eqn(P.mul, [y, y], {})
    g = Graph((), (x,), (e1, e2), (z,))
    (lk,) = lower_region(partition(g)[0])
    ops = {n.op: n.dtype for st in lk.kernel.stores for n in st.value.toposort()}
    assert ops["exp"] == F32 and ops["mul"] == F32 and ops["load"] == BF16
    assert lk.kernel.stores[0].value.op == "cast" and lk.kernel.stores[0].value.dtype == BF16


def test_scatter_add_is_a_copy_then_an_add_kernel():
    g, _ = one_eqn_graph(P.scatter_add, [f(5, 3), np.array([1, 2], I32), f(2, 3)], dict(axis=0))
    kernels = [lk.kernel for lk in lower_region(partition(g)[0])]
    assert [k.meta["kind"] for k in kernels] == ["copy", "scatter_add"]
    assert not kernels[0].serial and kernels[1].serial
    assert kernels[1].owner_axis == 1  # out[idx[t], j]: row * 3 + j, j never meets another j


def test_owner_axis_only_where_the_adds_of_two_indices_never_meet():
    from tilefuse.ir.kernel import ir as K

    def kernel(offset, shape=(50, 8)):
        bufs = (K.Buffer("idx", I32, 50), K.Buffer("out", F32, 4096))
        return K.Kernel("k", bufs, 1, shape, (), (K.Store(1, offset, K.const(1.0, F32), "add"),))
    row = K.cast(K.load(0, K.idx(0), I32), I64)
    assert kernel(row * 8 + K.idx(1)).owner_axis == 1
    assert kernel(row * 16 + K.idx(1) * 2).owner_axis == 1                  # a stride of 2
    assert kernel(row * 16 + K.idx(1)).owner_axis == 1                      # rows further apart
    assert kernel(row * 8 + K.idx(1) + K.const(8, I64)).owner_axis == 1   # shifted by whole rows
    assert kernel(row * 4 + K.idx(1)).owner_axis is None                  # rows overlap
    assert kernel(row * 8 + K.idx(1) + K.const(1, I64)).owner_axis is None
    assert kernel(row + K.idx(1) * 64).owner_axis is None                 # column-major: rows meet
    assert kernel(row, (50,)).owner_axis is None                          # one element per index
    assert kernel(K.idx(0) * 8 + K.idx(1)).owner_axis == 1                # no two points meet at all
