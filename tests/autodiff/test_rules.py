"""Every differentiable primitive against finite differences, orders 1 and 2, in float64.

One row per primitive (several where its parameters change the rule): the function binds the
primitive itself, so the row tests exactly that rule, in both modes and all second-order mixes
(jvp of jvp, vjp of jvp, jvp of vjp, vjp of vjp)."""
from __future__ import annotations

import numpy as np
import pytest

import tilefuse as tx
from tilefuse.autodiff.rules import ZERO_DERIVATIVE, jvp_multi_rules, jvp_rules, vjp_fwd_rules, vjp_rules
from tilefuse.ir import dtypes
from tilefuse.ir import primitives as P
from tilefuse.tracer.core import bind1

R = np.random.default_rng(42)


def u(*shape, lo=-1.0, hi=1.0):
    return R.uniform(lo, hi, shape)


def away(*shape, lo=0.3, hi=1.2):
    """Values bounded away from zero, with random signs."""
    return u(*shape, lo=lo, hi=hi) * R.choice([-1.0, 1.0], shape)


def unary(prim, **params):
    return lambda x: bind1(prim, x, **params)


def binary(prim):
    return lambda x, y: bind1(prim, x, y)


def attention(causal, bwd=False):
    prim = P.fused_attention_bwd if bwd else P.fused_attention
    return lambda *xs: bind1(prim, *xs, scale=0.7, causal=causal, dims=((0, 1, 2),) * 3)


def dot(contract, batch=((), ())):
    return lambda a, b: bind1(P.dot_general, a, b, dimension_numbers=(contract, batch))


def conv(**params):
    nd = len(params.get("padding", ((0, 0), (0, 0))))
    full = dict(window_strides=(1,) * nd, padding=((0, 0),) * nd, lhs_dilation=(1,) * nd, rhs_dilation=(1,) * nd,
                dimension_numbers=(tuple(range(nd + 2)),) * 3, feature_group_count=1, batch_group_count=1)
    full.update(params)
    return lambda x, w: bind1(P.conv, x, w, **full)


IDX = np.array([0, 2, 2, 3], np.int32)
IDX2 = np.array([[1, 0], [1, 1]], np.int32)
PRED = np.array([[True, False, True], [False, False, True]])

CASES = [
    ("neg", P.neg, unary(P.neg), (u(2, 3),)),
    ("exp", P.exp, unary(P.exp), (u(2, 3),)),
    ("log", P.log, unary(P.log), (u(2, 3, lo=0.5, hi=2.0),)),
    ("log1p", P.log1p, unary(P.log1p), (u(2, 3, lo=-0.5, hi=1.0),)),
    ("expm1", P.expm1, unary(P.expm1), (u(2, 3),)),
    ("tanh", P.tanh, unary(P.tanh), (u(2, 3),)),
    ("logistic", P.logistic, unary(P.logistic), (u(2, 3, lo=-3, hi=3),)),
    ("sqrt", P.sqrt, unary(P.sqrt), (u(2, 3, lo=0.5, hi=2.0),)),
    ("rsqrt", P.rsqrt, unary(P.rsqrt), (u(2, 3, lo=0.5, hi=2.0),)),
    ("sin", P.sin, unary(P.sin), (u(2, 3, lo=-3, hi=3),)),
    ("cos", P.cos, unary(P.cos), (u(2, 3, lo=-3, hi=3),)),
    ("erf", P.erf, unary(P.erf), (u(2, 3, lo=-2, hi=2),)),
    ("abs", P.abs_, unary(P.abs_), (away(2, 3),)),
    ("integer_pow3", P.integer_pow, unary(P.integer_pow, y=3), (u(2, 3),)),
    ("integer_pow2", P.integer_pow, unary(P.integer_pow, y=2), (u(2, 3),)),
    ("integer_pow-2", P.integer_pow, unary(P.integer_pow, y=-2), (away(2, 3),)),
    ("add", P.add, binary(P.add), (u(2, 3), u(2, 3))),
    ("sub", P.sub, binary(P.sub), (u(2, 3), u(2, 3))),
    ("mul", P.mul, binary(P.mul), (u(2, 3), u(2, 3))),
    ("div", P.div, binary(P.div), (u(2, 3), away(2, 3))),
    # x/y kept away from integers so trunc(x/y) is locally constant
    ("rem", P.rem, binary(P.rem), (np.array([2.3, -2.3, 5.4, 0.4]), np.array([1.1, 1.2, -2.5, 0.9]))),
    ("pow", P.pow_, binary(P.pow_), (u(2, 3, lo=0.5, hi=2.0), u(2, 3, lo=-2, hi=2))),
    ("max", P.max_, binary(P.max_), (np.array([0.1, -0.5, 0.9, 0.3]), np.array([0.4, -0.9, 0.2, -0.3]))),
    ("min", P.min_, binary(P.min_), (np.array([0.1, -0.5, 0.9, 0.3]), np.array([0.4, -0.9, 0.2, -0.3]))),
    ("select", P.select, lambda t, f: bind1(P.select, PRED, t, f), (u(2, 3), u(2, 3))),
    ("broadcast_in_dim", P.broadcast_in_dim,
     unary(P.broadcast_in_dim, shape=(2, 3), broadcast_dimensions=(1,)),
     (u(3),)),
    ("broadcast_in_dim_unit", P.broadcast_in_dim, unary(P.broadcast_in_dim, shape=(3, 2, 4),
                                    broadcast_dimensions=(0, 2)), (u(3, 1),)),
    ("reshape", P.reshape, unary(P.reshape, new_sizes=(3, 2)), (u(2, 3),)),
    ("transpose", P.transpose, unary(P.transpose, permutation=(2, 0, 1)), (u(2, 3, 4),)),
    ("rev", P.rev, unary(P.rev, dimensions=(0, 2)), (u(2, 3, 2),)),
    ("slice", P.slice_, unary(P.slice_, start_indices=(1, 0), limit_indices=(5, 6), strides=(2, 3)),
     (u(5, 6),)),
    ("concatenate", P.concatenate, lambda a, b, c: bind1(P.concatenate, a, b, c, dimension=1),
     (u(2, 1), u(2, 3), u(2, 2))),
    ("pad", P.pad, lambda x, pv: bind1(P.pad, x, pv, padding_config=((1, 2, 1), (0, 1, 0))),
     (u(3, 2), np.float64(0.5))),
    ("reduce_sum", P.reduce_sum, unary(P.reduce_sum, axes=(0, 2)), (u(2, 3, 2),)),
    ("reduce_max", P.reduce_max, unary(P.reduce_max, axes=(1,)), (u(2, 4),)),
    ("reduce_min", P.reduce_min, unary(P.reduce_min, axes=(0, 1)), (u(2, 4),)),
    ("reduce_prod", P.reduce_prod, unary(P.reduce_prod, axes=(1,)), (u(2, 3, lo=0.5, hi=1.5),)),
    ("reduce_prod_zero", P.reduce_prod, unary(P.reduce_prod, axes=(0, 1)),
     (np.array([[1.0, 0.5, 0.0], [1.2, 0.7, 1.5]]),)),
    ("dot_matmul", P.dot_general, dot(((1,), (0,))), (u(2, 3), u(3, 4))),
    ("dot_batched", P.dot_general, dot(((2,), (1,)), ((0,), (0,))), (u(2, 3, 4), u(2, 4, 2))),
    ("dot_two_contractions", P.dot_general, dot(((0, 2), (2, 0))), (u(3, 2, 4), u(4, 5, 3))),
    ("dot_inner_batch", P.dot_general, dot(((2,), (0,)), ((1,), (1,))), (u(3, 2, 4), u(4, 2))),
    ("gather", P.gather, lambda x: bind1(P.gather, x, IDX, axis=0), (u(4, 3),)),
    ("gather_axis1", P.gather, lambda x: bind1(P.gather, x, IDX2, axis=1), (u(3, 2),)),
    ("scatter_add", P.scatter_add, lambda x, upd: bind1(P.scatter_add, x, IDX, upd, axis=0),
     (u(5, 2), u(4, 2))),
    ("dynamic_slice", P.dynamic_slice,
     lambda x: bind1(P.dynamic_slice, x, np.int32(1), np.int32(5), slice_sizes=(2, 2)), (u(4, 3),)),
    ("dynamic_update_slice", P.dynamic_update_slice,
     lambda x, upd: bind1(P.dynamic_update_slice, x, upd, np.int32(3), np.int32(1)), (u(4, 3), u(2, 2))),
    ("fused_attention", P.fused_attention, attention(causal=False), (u(1, 3, 2), u(1, 4, 2), u(1, 4, 3))),
    ("fused_attention_causal_bias", P.fused_attention, attention(causal=True),
     (u(1, 3, 2), u(1, 4, 2), u(1, 4, 3), u(1, 3, 4))),
    ("fused_attention_bwd", P.fused_attention_bwd, attention(causal=True, bwd=True),
     (u(1, 3, 2), u(1, 3, 2), u(1, 3, 2), u(1, 3, 2), u(1, 3, 2))),
    # convolutions: the cotangents are convolutions (lhs dilation, batch groups: JAX's rules)
    ("conv_strided_grouped", P.conv, conv(window_strides=(2, 1), padding=((1, 0), (2, 1)), rhs_dilation=(1, 2),
                                          feature_group_count=2), (u(2, 4, 5, 6), u(4, 2, 2, 2))),
    ("conv_lhs_dilated_batch_groups", P.conv, conv(padding=((1, -1), (0, 1)), lhs_dilation=(2, 1),
                                                   batch_group_count=2), (u(4, 2, 3, 4), u(4, 2, 2, 2))),
    ("conv_nhwc_1d", P.conv, conv(window_strides=(2,), padding=((1, 1),), dimension_numbers=((0, 2, 1), (2, 1, 0),
                                                                                             (0, 2, 1))),
     (u(2, 7, 3), u(3, 3, 2))),
    # the LAPACK primitives (their rules are JAX's; tests/test_linalg.py tests the public functions)
    ("solve", P.solve, binary(P.solve), (u(3, 3) + 3 * np.eye(3), u(3, 2))),
    ("triangular_solve", P.triangular_solve, lambda a, b: bind1(P.triangular_solve, a, b, lower=True,
                                                                transpose_a=True, unit_diagonal=False),
     (u(3, 3) + 3 * np.eye(3), u(3, 2))),
    ("triangular_solve_unit", P.triangular_solve, lambda a, b: bind1(P.triangular_solve, a, b, lower=False,
                                                                     transpose_a=False, unit_diagonal=True),
     (u(3, 3), u(3, 2))),
    ("cholesky", P.cholesky, unary(P.cholesky), (u(2, 3, 3) + 3 * np.eye(3),)),
    ("slogdet", P.slogdet, unary(P.slogdet), (u(3, 3) + 2 * np.eye(3),)),
    ("qr", P.qr, unary(P.qr, full_matrices=False), (u(4, 3),)),
    ("eigh", P.eigh, unary(P.eigh), (np.array([[2.0, 0.3, -0.4], [0.3, 1.0, 0.2], [-0.4, 0.2, -1.5]]),)),
    ("svd", P.svd, unary(P.svd, full_matrices=False, compute_uv=True), (u(3, 2),)),
    ("svd_values", P.svd, unary(P.svd, full_matrices=False, compute_uv=False), (u(2, 3),)),
]


@pytest.mark.parametrize("name,prim,fn,args", CASES, ids=[c[0] for c in CASES])
def test_rule_against_finite_differences(device, name, prim, fn, args):
    tx.check_grads(fn, args, order=1, modes=("fwd", "rev"))


@pytest.fixture
def on_ref():
    old = tx.config.default_device
    tx.config.default_device = "ref"
    yield
    tx.config.default_device = old


@pytest.mark.parametrize("name,prim,fn,args", CASES, ids=[c[0] for c in CASES])
def test_rule_second_order(on_ref, name, prim, fn, args):
    # The rules do not depend on the device, and order 2 binds a few hundred distinct eager
    # operations per row (a kernel compile each on the compiling backends): run it on ref.
    tx.check_grads(fn, args, order=2, modes=("fwd", "rev"))


# Primitives without a derivative to test: integer/bool outputs, or effects.
NOT_DIFFERENTIABLE = {"iota", "is_finite", "argmax", "argmin", "eq", "ne", "lt", "le", "gt", "ge",
                      "and", "or", "xor", "not", "shift_left", "shift_right_logical", "debug_print", "argsort"}


def test_every_differentiable_primitive_has_rules_and_a_row():
    rows = {c[1] for c in CASES} | {P.convert_element_type}  # convert: tested exactly below
    rows |= {P.tile_call}  # its rules differentiate its body: tests/test_tile_op.py
    # compile_only ones appear after autodiff ran; the traces take custom_vjp/jvp calls whole
    # (tests/autodiff/test_custom.py)
    todo = [p for p in P.PRIMITIVES.values()
            if p.name not in NOT_DIFFERENTIABLE and p not in ZERO_DERIVATIVE and not p.compile_only
            and p not in (P.custom_vjp_call, P.custom_jvp_call)]
    rows |= set(P.CONTROL_FLOW)  # against Python loops and finite differences: tests/test_lax.py
    # control flow's rules see all outputs (and reverse mode its forward too): their own tables
    vjp_all, jvp_all = {**vjp_rules, **vjp_fwd_rules}, {**jvp_rules, **jvp_multi_rules}
    missing_rules = [p.name for p in todo if p not in vjp_all or p not in jvp_all]
    missing_rows = [p.name for p in todo if p not in rows]
    assert not missing_rules, f"primitives without differentiation rules: {missing_rules}"
    assert not missing_rows, f"primitives without a finite-difference row: {missing_rows}"


@pytest.mark.parametrize("src,dst", [(np.float32, np.float64), (np.float64, np.float32)])
def test_convert_element_type_derivative(device, src, dst):
    # a finite difference through float32 rounding is too coarse: check the exact values
    x = np.array([0.5, -1.5, 2.0], src)
    f = lambda x: bind1(P.convert_element_type, x, new_dtype=np.dtype(dst)) * 3.0  # noqa: E731
    g = tx.grad(lambda x: tx.numpy.sum(f(x)))(x)
    assert np.asarray(g).dtype == src
    np.testing.assert_array_equal(np.asarray(g), np.full(3, 3.0, src))
    _, t = tx.jvp(f, (x,), (np.ones(3, src),))
    assert np.asarray(t).dtype == dst
    np.testing.assert_array_equal(np.asarray(t), np.full(3, 3.0, dst))


@pytest.mark.parametrize("prim", [P.sign, P.floor, P.ceil, P.round_, P.stop_gradient],
                         ids=lambda p: p.name)
def test_zero_derivative_primitives(device, prim):
    x = np.array([0.3, -1.7, 2.5])
    f = lambda x: tx.numpy.sum(bind1(prim, x) * x)  # noqa: E731  d/dx = prim(x)
    np.testing.assert_allclose(np.asarray(tx.grad(f)(x)), prim.impl(x)[0])
    _, t = tx.jvp(lambda x: bind1(prim, x), (x,), (np.ones(3),))
    np.testing.assert_array_equal(np.asarray(t), np.zeros(3))


def test_integer_outputs_carry_no_gradient(device):
    x = np.array([0.3, 2.0, -1.0])
    f = lambda x: tx.numpy.sum(x * bind1(P.convert_element_type, bind1(  # noqa: E731
        P.argmax, x, axis=0, index_dtype=dtypes.int32), new_dtype=np.dtype(np.float64)))
    np.testing.assert_array_equal(np.asarray(tx.grad(f)(x)), [1.0, 1.0, 1.0])
