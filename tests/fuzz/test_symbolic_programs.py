"""Fuzzing shape-generic tracing (tracer/shape_poly.py): random Python programs that compute
with their arguments' sizes — reshapes to computed sizes, slices at computed bounds, means and
sums over the batch, branches on a size, sizes used as numbers — are jitted once and called at
several sizes. Every call's graph, instantiated from the first trace where the guards allow or
traced again where they do not, must be equation for equation the graph a trace at those sizes
gives (TILEFUSE_CHECK's comparison), and its results the concrete trace's, bit for bit (the same
graph on the same device)."""
from __future__ import annotations

import numpy as np
from fuzz_programs import fuzz_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tilefuse as tx
import tilefuse.numpy as tnp


def _flat_halves(x):  # (b, n) -> (b * n // 2, 2) where n is even, else unchanged
    b, n = x.shape
    return tnp.reshape(x, (b * n // 2, 2)) if n % 2 == 0 else x


# each step maps a 2-d array to a 2-d array, asking what it likes of the sizes
STEPS = {
    "scale_by_batch": lambda x: x * (1.0 / x.shape[0]),  # a float from a size: specialises
    "mean_rows": lambda x: x - tnp.mean(x, axis=0, keepdims=True),
    "mean_all": lambda x: x + tnp.mean(x),
    "sum_cols": lambda x: x / (1.0 + tnp.abs(x).sum(1, keepdims=True)),
    "head": lambda x: x[: max(1, x.shape[0] // 2)],
    "tail": lambda x: x[x.shape[0] // 3:] if x.shape[0] >= 3 else x,
    "drop_last_col": lambda x: x[:, :-1] if x.shape[1] > 1 else x,
    "reverse": lambda x: x[::-1],
    "every_other": lambda x: x[::2],
    "transpose": lambda x: x.T,
    "flat_halves": _flat_halves,
    "reshape_back": lambda x: tnp.reshape(tnp.reshape(x, (-1,)), (x.shape[0], -1)),
    "branch_on_size": lambda x: x * 2.0 if x.shape[0] > 5 else x - 1.0,
    "branch_on_parity": lambda x: tnp.tanh(x) if x.shape[1] % 2 else tnp.sin(x),
    "concat_self": lambda x: tnp.concatenate([x, x[:1]], 0),
    "pad_rows": lambda x: tnp.pad(x, ((1, 0), (0, 2))),
    "arange_add": lambda x: x + tnp.arange(x.shape[1], dtype=tnp.float32),
    "row_index": lambda x: x + tnp.arange(x.shape[0], dtype=tnp.float32)[:, None] / 7.0,
    "cumsum": lambda x: tnp.cumsum(x, 0),
    "outer": lambda x: x @ x.T[:, : min(3, x.shape[0])],
    "int_size": lambda x: x + float(int(x.shape[1])),  # the exact value: specialises
    "size_literal": lambda x: x * x.size,  # a size as a traced number
    "zeros_like_shape": lambda x: x + tnp.zeros(x.shape) + tnp.ones((1, x.shape[1])),
    "mask_lower": lambda x: x[: min(x.shape), : min(x.shape)] * tnp.tril(tnp.ones((min(x.shape),) * 2)),
    "scan_rows": lambda x: tx.lax.scan(lambda c, r: (c * 0.5 + r, c), tnp.zeros(x.shape[1]), x)[1],
    "vmap_rows": lambda x: tx.vmap(lambda r: r - r.max())(x),
    "grad_mean": lambda x: tx.grad(lambda y: tnp.mean(tnp.sin(y) ** 2))(x),
    "split_rows": lambda x: tnp.split(x, 2)[1] if x.shape[0] % 2 == 0 else x,
    "stack_cols": lambda x: tnp.reshape(tnp.stack([x, -x], 2), (x.shape[0], -1)),
    "var_rows": lambda x: x + tnp.var(x, axis=0),
    "take_first": lambda x: tnp.take(x, tnp.array([0, x.shape[0] - 1]), axis=0),
}


@fuzz_settings(40)
@given(steps=st.lists(st.sampled_from(sorted(STEPS)), min_size=1, max_size=5),
       sizes=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 6)), min_size=2, max_size=4))
def test_symbolic_programs_equal_their_concrete_traces(steps, sizes):
    def f(x):
        for s in steps:
            x = STEPS[s](x)
        return x

    generic = tx.jit(f, device="ref")
    old = tx.config.check
    tx.config.check = True  # each instantiation compared with a trace at its sizes
    try:
        for b, n in sizes:
            x = np.random.default_rng(b * 10 + n).uniform(-3, 3, (b, n)).astype(np.float32)
            got = np.asarray(generic(x))
            tx.config.shape_generic = False
            try:
                want = np.asarray(tx.jit(f, device="ref")(x))
            finally:
                tx.config.shape_generic = True
            np.testing.assert_array_equal(got, want, err_msg=f"{steps} at {(b, n)}")
    finally:
        tx.config.check = old
    assert generic.trace_count <= len(set(sizes))


@settings(fuzz_settings(8), suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                   HealthCheck.data_too_large])
@given(steps=st.lists(st.sampled_from(sorted(STEPS)), min_size=1, max_size=4),
       batches=st.lists(st.integers(2, 40), min_size=3, max_size=4, unique=True), n=st.integers(2, 6))
def test_symbolic_programs_compile_as_their_concrete_traces(device, steps, batches, n):
    """The same programs compiled on every device at three or four batch sizes: from the third
    on, a new size's kernels are made from the template's lowering where it holds (sums over the
    batch at their new extent, sizes fixed across sizes folded), each compared under
    TILEFUSE_CHECK with the instance's own lowering; results those of a concrete trace's
    program on the same device (within float32 rounding: the two may fuse differently)."""
    def f(x):
        for s in steps:
            x = STEPS[s](x)
        return x

    generic = tx.jit(f, device=device.name)
    old = tx.config.check, tx.config.tiered
    tx.config.check, tx.config.tiered = True, False
    try:
        for b in batches:
            x = (np.random.default_rng(b).standard_normal((b, n)) * 10.0 ** np.random.default_rng(b + 1).uniform(
                -2, 2, (b, n))).astype(np.float32)
            got = np.asarray(generic(x))
            tx.config.shape_generic = False
            try:
                want = np.asarray(tx.jit(f, device=device.name)(x))
            finally:
                tx.config.shape_generic = True
            scale = max(1.0, float(np.nanmax(np.abs(want)))) if want.size else 1.0
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=f"{steps} at {(b, n)} on {device}")
    finally:
        tx.config.check, tx.config.tiered = old
