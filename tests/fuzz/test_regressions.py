"""Programs the fuzzer found wrong, shrunk by hypothesis and kept: each runs on every device and
through the compiler pipeline with the kernel interpreter, against the reference."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from fuzz_programs import BF16, BOOL, F16, F32, I32, assert_matches, ref_eval
from tilefuse.ir import primitives as P
from tilefuse.ir.core import Eqn, Graph, ShapedArray, Var
from tilefuse.ir.kernel import InterpBackend
from tilefuse.runtime.compiler import compile_graph

INTERP = SimpleNamespace(kind="interp", name="interp")


def build(inputs, steps, outs):
    """A graph from (name, dtype, shape) inputs and (out_name, prim_name, in_names, params) steps."""
    env, invars, eqns = {}, [], []
    for name, dtype, shape in inputs:
        env[name] = Var(ShapedArray(tuple(shape), np.dtype(dtype)))
        invars.append(env[name])
    for out, prim_name, ins, params in steps:
        prim = P.PRIMITIVES[prim_name]
        (aval,) = prim.abstract_eval(*[env[i].aval for i in ins], **params)
        env[out] = Var(aval)
        eqns.append(Eqn(prim, tuple(env[i] for i in ins), (env[out],), params))
    return Graph((), tuple(invars), tuple(eqns), tuple(env[o] for o in outs))


# name -> (inputs, steps, outputs, input values)
CASES = {
    # bool reduce_sum lowers to an or (max) reduction; over an empty axis the kernel interpreter
    # called numpy's max, which has no identity for size 0
    "bool_sum_over_empty_axis": (
        [("a", BOOL, (1,)), ("b", I32, (0,))],
        [("c", "gather", ["a", "b"], {"axis": 0}),
         ("d", "reduce_sum", ["c"], {"axes": (0,)})],
        ["d"],
        [np.array([True]), np.zeros(0, np.int32)]),
    # a fused 16-bit chain keeps exp's float32 value; converting it to float32 showed digits
    # float16 does not have (1.064884 for 1.064453): a conversion now reads the rounded value
    "f16_rounds_before_convert": (
        [("a", F16, ())],
        [("b", "exp", ["a"], {}),
         ("c", "convert_element_type", ["b"], {"new_dtype": F32, "weak_type": False})],
        ["b", "c"],
        [np.array(0.0626, np.float16)]),
    # the same for is_finite: exp(12) is finite in float32 but inf in float16
    "bf16_and_f16_overflow_is_seen_by_is_finite": (
        [("a", F16, (2,)), ("b", BF16, (2,))],
        [("c", "exp", ["a"], {}), ("d", "is_finite", ["c"], {}),
         ("e", "mul", ["b", "b"], {}),
         ("f", "convert_element_type", ["e"], {"new_dtype": F32, "weak_type": False})],
        ["d", "f"],
        [np.array([12.0, 1.0], np.float16), np.array([1.01, 3.3], BF16)]),
    # x.sum(0) ** 0 fused into one kernel: the power dropped the reduction from the expression
    # and lowering asserted (a crash, not an error) on a reduce kernel without a reduce
    "unused_reduction_in_a_fused_kernel": (
        [("a", I32, (1, 1))],
        [("b", "reduce_sum", ["a"], {"axes": (0,)}),
         ("c", "integer_pow", ["b"], {"y": 0})],
        ["c"],
        [np.array([[5]], np.int32)]),
    # a sum over an empty slice (a[3:3] of 3 elements, reshaped (0, 1)): the kernel interpreter
    # evaluated the load at offset 3 although the reduction reads nothing (devices were right)
    "sum_over_an_empty_slice_reads_nothing": (
        [("a", F32, (3,))],
        [("g", "slice", ["a"], {"start_indices": (3,), "limit_indices": (3,), "strides": (1,)}),
         ("h", "reshape", ["g"], {"new_sizes": (0, 1)}),
         ("i", "reduce_sum", ["h"], {"axes": (0,)})],
        ["i"],
        [np.array([1.0, 2.0, 3.0], np.float32)]),
}


def _run_interp(g, args):
    be = InterpBackend()
    run = compile_graph(g, INTERP, be)
    bufs = run([be.put(np.ascontiguousarray(a), INTERP) for a in args])
    return [be.to_host(b, v.aval, INTERP) for b, v in zip(bufs, g.outvars)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_regression_through_the_kernel_interpreter(name):
    ins, steps, outs, args = CASES[name]
    g = build(ins, steps, outs)
    for got, want in zip(_run_interp(g, args), ref_eval(g, args), strict=True):
        assert_matches(got, want, True, g, name)


def test_regressions_on_every_device(device):
    for name in sorted(CASES):  # one test per device: each case is a compile
        ins, steps, outs, args = CASES[name]
        g = build(ins, steps, outs)
        got = [np.asarray(o) for o in device.compile(g)(args)]
        for o, want in zip(got, ref_eval(g, args), strict=True):
            assert_matches(o, want, True, g, f"{name} on {device}")


# Programs whose 16-bit result depends on excess precision (README, Dtypes): fused, they keep
# float32 values between operations, so they match the oracle with float32 intermediates
# (fuzz_programs.ref_eval_wide), not the one that rounds after every equation; the fuzzer's check
# takes either. name -> (inputs, steps, outputs, input values)
EXCESS_PRECISION = {
    # exp(6)² overflows float16 (NaN after * 0) but not float32 (0)
    "f16_square_overflows_only_when_rounded": (
        [("a", F16, (2,))],
        [("c", "exp", ["a"], {}), ("e", "mul", ["a", "a"], {}), ("z", "sub", ["e", "e"], {}),
         ("g", "integer_pow", ["c"], {"y": 2}), ("j", "mul", ["z", "g"], {})],
        ["c", "j"],
        [np.array([6.0, 1.0], np.float16)]),
    # e - (a + e) with e = a exp(a) ~ 1240: float16's spacing there is 1, float32 keeps -a
    "f16_cancellation_keeps_float32_digits": (
        [("a", F16, (1, 1))],
        [("c", "exp", ["a"], {}), ("e", "mul", ["a", "c"], {}), ("g", "add", ["a", "e"], {}),
         ("h", "sub", ["e", "g"], {})],
        ["g", "h"],
        [np.array([[5.43]], np.float16)]),
}


@pytest.mark.parametrize("name", sorted(EXCESS_PRECISION))
def test_excess_precision_matches_the_wide_oracle(name):
    from fuzz_programs import check_outputs, ref_eval_wide
    ins, steps, outs, args = EXCESS_PRECISION[name]
    g = build(ins, steps, outs)
    narrow, wide = ref_eval(g, args), ref_eval_wide(g, args)
    assert not all(np.allclose(n.astype(np.float64), w.astype(np.float64), rtol=0.02, equal_nan=True)
                   for n, w in zip(narrow, wide)), "the two oracles agree: the case tests nothing"
    check_outputs(_run_interp(g, args), g, args, [False] * len(outs), f"{name} through the kernel interpreter")


def test_excess_precision_on_every_device(device):
    from fuzz_programs import check_outputs
    for name in sorted(EXCESS_PRECISION):
        ins, steps, outs, args = EXCESS_PRECISION[name]
        g = build(ins, steps, outs)
        got = [np.asarray(o) for o in device.compile(g)(args)]
        check_outputs(got, g, args, [False] * len(outs), f"{name} on {device}")
