"""tilefuse.lax: structured control flow against Python loops on every device, its derivatives
against finite differences, vmap against a loop over the batch, the graph IR's sub-graphs, the
runtime's loop (no retrace, no allocation per iteration, compile time independent of the trip
count), and the lax operations beside it. Shapes are small and bodies shared, so few kernels."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse import lax
from tilefuse.ir import primitives as P
from tilefuse.ir.core import typecheck_graph

from conftest import assert_close

R = np.random.default_rng(0)
W = (R.standard_normal((4, 4)) * 0.5).astype(np.float32)
C0 = R.standard_normal(4).astype(np.float32)
XS = R.standard_normal((6, 4)).astype(np.float32)


def rnn(w, c0, xs, reverse=False):
    def step(c, x):
        c = tnp.tanh(c @ w + x)
        return c, c * 2.0
    return lax.scan(step, c0, xs, reverse=reverse)


def rnn_numpy(w, c0, xs, reverse=False):
    c, ys = c0, [None] * len(xs)
    for t in (reversed(range(len(xs))) if reverse else range(len(xs))):
        c = np.tanh(c @ w + xs[t])
        ys[t] = c * 2.0
    return c, np.stack(ys)


def close(a, b, tol=1e-5):
    assert_close(np.asarray(a), np.asarray(b), np.float32, rtol=tol, atol=tol)


# ---- each primitive against a Python loop ---------------------------------------------------------

@pytest.mark.parametrize("reverse", [False, True])
def test_scan_matches_a_python_loop(device, reverse):
    f = tx.jit(rnn, static_argnums=3)
    c, ys = f(W, C0, XS, reverse)
    rc, rys = rnn_numpy(W, C0, XS, reverse)
    close(c, rc)
    close(ys, rys)
    c2, _ = f(W, C0 * 0.5, XS, reverse)  # new values, same signature: no retrace
    close(c2, rnn_numpy(W, C0 * 0.5, XS, reverse)[0])
    assert f.trace_count == 1


def test_scan_pytrees_ints_and_no_ys(device):
    def f(xs):
        def step(carry, x):
            total, n = carry["total"], carry["n"]
            return {"total": total + x["a"] * x["b"], "n": n + 1}, (total, None)
        return lax.scan(step, {"total": np.zeros(4, np.float32), "n": 0}, {"a": xs, "b": xs + 1.0})
    carry, (partial, none) = tx.jit(f)(XS)
    assert none is None and int(carry["n"]) == 6
    prods = XS * (XS + 1.0)
    close(carry["total"], prods.sum(0))
    close(partial, np.concatenate([np.zeros((1, 4)), np.cumsum(prods, 0)[:-1]]))
    # length without xs, and lax.map
    (_, n), _ = lax.scan(lambda c, _: ((c[0] * 2.0, c[1] + 1), None), (np.float32(1), 0), None, length=5)
    assert int(n) == 5
    close(tx.jit(lambda xs: lax.map(lambda x: tnp.sum(x * x), xs))(XS), (XS * XS).sum(1))


def test_while_loop_with_a_data_dependent_trip_count(device):
    def halvings(x):  # how often x halves before it drops to 1 or below, and where it ends
        return lax.while_loop(lambda c: c[1] > 1.0, lambda c: (c[0] + 1, c[1] * 0.5), (0, x))
    f = tx.jit(halvings)
    for x in (np.float32(0.5), np.float32(5.0), np.float32(1000.0)):
        n, y = f(x)
        k, z = 0, float(x)
        while z > 1.0:
            k, z = k + 1, z * 0.5
        assert int(n) == k and float(y) == z
    assert f.trace_count == 1


def test_fori_loop_static_bounds_are_a_scan_traced_ones_a_while(device):
    def body(i, x):
        return x * 0.5 + tnp.astype(i, np.float32)
    static = tx.jit(lambda x: lax.fori_loop(2, 7, body, x))
    traced = tx.jit(lambda x, lo, hi: lax.fori_loop(lo, hi, body, x))
    want = C0.copy()
    for i in range(2, 7):
        want = want * 0.5 + i
    close(static(C0), want)
    close(traced(C0, 2, 7), want)
    assert [e.prim for e in static.lower(C0).graph.eqns if e.prim in P.CONTROL_FLOW] == [P.scan_p]
    assert [e.prim for e in traced.lower(C0, 2, 7).graph.eqns if e.prim in P.CONTROL_FLOW] == [P.while_p]
    close(traced(C0, 5, 3), C0)  # an empty range runs no step


def test_cond_and_switch(device):
    f = tx.jit(lambda p, x: lax.cond(p, lambda x: x + 1.0, lambda x: x * 3.0, x))
    close(f(True, C0), C0 + 1)
    close(f(False, C0), C0 * 3)
    close(f(np.float32(0.0), C0), C0 * 3)  # a number: true where non-zero
    branches = [lambda x, y: x + y, lambda x, y: x * y, lambda x, y: x - y]
    g = tx.jit(lambda i, x, y: lax.switch(i, branches, x, y))
    for i, want in [(0, C0 + 2), (1, C0 * 2), (2, C0 - 2), (7, C0 - 2), (-3, C0 + 2)]:  # clamped
        close(g(np.int32(i), C0, np.float32(2)), want)
    assert g.trace_count == 1


def test_nested_loops_and_eager_calls(device):
    def f(w, xs):
        def step(c, x):  # a fori_loop inside a scan, a cond inside the fori_loop
            def inner(i, h):
                return lax.cond(i % 2 == 0, lambda h: tnp.tanh(h @ w + x), lambda h: h * 0.9, h)
            c = lax.fori_loop(0, 3, inner, c)
            return c, tnp.sum(c)
        return lax.scan(step, C0, xs)
    want_c, want_ys = C0, []
    for x in XS:
        for i in range(3):
            want_c = np.tanh(want_c @ W + x) if i % 2 == 0 else want_c * 0.9
        want_ys.append(want_c.sum())
    c, ys = tx.jit(f)(W, XS)
    close(c, want_c)
    close(ys, np.array(want_ys))
    c_eager, _ = f(W, XS)  # without jit: the primitives run as they are bound
    close(c_eager, want_c)


# ---- the graph IR ---------------------------------------------------------------------------------

def test_sub_graphs_print_type_check_and_dump(tmp_path):
    g = tx.make_graph(rnn)(W, C0, XS)
    typecheck_graph(g)
    text = str(g)
    assert "scan[length=6 n_carry=1 n_consts=1 reverse=False]" in text
    assert "body={ lambda" in text and "tanh" in text  # the body in full, not a summary
    (e,) = g.eqns
    assert g.eqn_text(e).startswith("d:f32[4] e:f32[6,4] = scan[")
    old = tx.config.dump_dir
    tx.config.dump_dir = str(tmp_path)
    try:
        tx.jit(rnn).lower(W, C0, XS, device="cpu").compile()
    finally:
        tx.config.dump_dir = old
    dumped = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs]
    assert any("scan_step" in p for p in dumped)  # the body's own passes, dumped
    assert any("body={ lambda" in open(p).read() for p in dumped if p.endswith(".txt"))


def test_passes_run_inside_bodies_and_hoist_invariants():
    def f(w, xs):
        def step(c, x):
            a = tnp.exp(w) * 2.0  # reads only the loop's constant: computed once, before the loop
            return tnp.tanh(c @ a + x + 0.0), c * 1.0
        return lax.scan(step, C0, xs)
    g = tx.jit(f).lower(W, XS, device="cpu").optimized_graph()
    (scan,) = [e for e in g.eqns if e.prim is P.scan_p]
    body = scan.params["body"]
    assert g.count("exp") == 1 and g.count("mul") == 1  # exp(w) * 2.0, once, before the loop
    assert [e.prim.name for e in body.eqns] == ["fused_gemm"]  # c @ a + x + 0 -> tanh, one GEMM
    assert body.outvars[1] is body.invars[-2]  # c * 1.0 is c


def test_control_flow_errors_name_both_sides_and_the_line():
    with pytest.raises(tx.ShapeError, match=r"input carry is .*f32\[4\].* returns .*f32\[3\]") as err:
        lax.scan(lambda c, x: (c[:3], x), C0, XS)
    assert "test_lax.py" in str(err.value)
    with pytest.raises(tx.ShapeError, match=r"true_fun returns .*f32\[4\].*false_fun.*i32\[4\]|false_fun returns"):
        lax.cond(True, lambda x: x, lambda x: tnp.astype(x, np.int32), C0)
    with pytest.raises(tx.ShapeError, match="body_fun"):
        lax.while_loop(lambda c: c < 3, lambda c: c + 1.5, np.int32(0))  # (a Python 0 would promote)
    with pytest.raises(TypeError, match="boolean scalar"):
        lax.while_loop(lambda c: c, lambda c: c + 1, C0)
    with pytest.raises(tx.ShapeError, match="leading axes"):
        lax.scan(lambda c, x: (c, x), C0, (XS, XS[:3]))
    with pytest.raises(ValueError, match="length"):
        lax.scan(lambda c, x: (c, x), C0, None)


# ---- autodiff ---------------------------------------------------------------------------------------

def _loss(w, c0, xs):
    c, ys = rnn(w, c0, xs)
    return tnp.sum(c * c) + tnp.sum(tnp.sin(ys))


def _loss_unrolled(w, c0, xs):
    c, ys = c0, []
    for x in xs:
        c = tnp.tanh(c @ w + x)
        ys.append(c * 2.0)
    return tnp.sum(c * c) + tnp.sum(tnp.sin(tnp.stack(ys)))


def test_scan_grad_matches_the_unrolled_loop_and_finite_differences(device):
    g = tx.jit(tx.grad(_loss, argnums=(0, 1, 2)))(W, C0, XS)
    want = tx.grad(_loss_unrolled, argnums=(0, 1, 2))(W, C0, XS)
    for a, b in zip(g, want):
        close(a, b, 1e-4)
    args = tuple(np.asarray(a, np.float64) for a in (W, C0, XS[:3]))
    tx.check_grads(tx.jit(_loss), args, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


def test_grads_of_cond_switch_fori_and_while_jvp(device):
    def f(x, y):
        a = lax.cond(tnp.sum(x) > 0, lambda x, y: tnp.sin(x) * y, lambda x, y: x * x, x, y)
        b = lax.switch(2, [lambda v: v, lambda v: v * 2.0, lambda v: tnp.exp(v)], a)
        c = lax.fori_loop(0, 3, lambda i, v: v * tnp.cos(v), b)
        return tnp.sum(c)
    x, y = np.asarray(C0, np.float64), np.asarray(XS[0], np.float64)
    tx.check_grads(tx.jit(f), (x, y), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)
    tx.check_grads(tx.jit(f), (-x, y), modes=("rev",), atol=1e-6, rtol=1e-6)  # the other branch

    def newton_sqrt(a):  # forward mode through a data-dependent while_loop
        return lax.while_loop(lambda c: tnp.abs(c[0] * c[0] - a) > 1e-9 * a, lambda c: (0.5 * (c[0] + a / c[0]),),
                              (a,))[0]
    a = np.float64(2.0)
    out, t = tx.jvp(tx.jit(newton_sqrt), (a,), (np.float64(1.0),))
    assert abs(float(out) - np.sqrt(2)) < 1e-9 and abs(float(t) - 0.5 / np.sqrt(2)) < 1e-6


def test_reverse_mode_of_a_dynamic_while_loop_is_a_transform_error():
    def f(x):
        return lax.while_loop(lambda c: c < 10.0, lambda c: c * 2.0, x)
    with pytest.raises(tx.TransformError, match="while_loop.*fori_loop"):
        tx.grad(f)(np.float32(1.0))


def test_scan_vjp_stacks_residuals_and_recomputes_invariants():
    g = tx.make_graph(tx.grad(lambda w, xs: tnp.sum(rnn(w, C0, xs)[1])))(W, XS)
    fwd, bwd = [e for e in g.eqns if e.prim is P.scan_p]
    assert not fwd.params["reverse"] and bwd.params["reverse"]
    n = len(fwd.outputs) - 2  # residuals beyond the carry and ys, stacked along the steps
    assert n >= 1 and all(o.aval.shape[0] == 6 for o in fwd.outputs[1:])
    assert not any(o.aval.shape == (6, 4, 4) for o in fwd.outputs)  # w is not stacked


# ---- vmap ---------------------------------------------------------------------------------------

def test_vmap_of_each_against_a_loop_over_the_batch(device):
    ws = np.stack([W, W * 0.5, -W])
    c, ys = tx.jit(tx.vmap(rnn, in_axes=(0, None, None)))(ws, C0, XS)
    for b in range(3):
        rc, rys = rnn_numpy(ws[b], C0, XS)
        close(c[b], rc)
        close(ys[b], rys)
    # batched predicate: cond becomes a select, while runs until every lane is done
    xs = np.array([0.5, 5.0, -2.0, 300.0], np.float32)
    cond_f = tx.vmap(lambda x: lax.cond(x > 1.0, lambda x: x * 10.0, lambda x: x - 1.0, x))
    close(cond_f(xs), np.where(xs > 1.0, xs * 10, xs - 1))
    loop = tx.jit(tx.vmap(lambda x: lax.while_loop(lambda c: c[1] > 1.0, lambda c: (c[0] + 1, c[1] * 0.5), (0, x))))
    n, y = loop(xs)
    for i, x in enumerate(xs):
        k, z = 0, float(x)
        while z > 1.0:
            k, z = k + 1, z * 0.5
        assert int(n[i]) == k and float(y[i]) == z
    sw = tx.vmap(lambda i, x: lax.switch(i, [lambda v: v + 1.0, lambda v: v * 3.0], x))
    close(sw(np.array([0, 1, 1, 5], np.int32), xs), np.array([1.5, 15.0, -6.0, 900.0]))


def test_a_loop_inside_grad_inside_jit_inside_vmap(device):
    ws = np.stack([W, W * 0.5])
    got = tx.vmap(tx.jit(tx.grad(_loss)), in_axes=(0, None, None))(ws, C0, XS)
    for b in range(2):
        close(got[b], tx.grad(_loss_unrolled)(ws[b], C0, XS), 1e-4)


# ---- the runtime --------------------------------------------------------------------------------------

def _cheap(c, x):
    return c * 0.999 + x, None


def test_scan_of_10000_steps_compiles_as_fast_as_one_of_10(device):
    lowered = {n: tx.jit(lambda c, xs: lax.scan(_cheap, c, xs)).lower(C0, np.ones((n, 4), np.float32))
               for n in (10, 10_000)}
    assert len(lowered[10].graph.eqns) == len(lowered[10_000].graph.eqns) == 1
    times, kernels = {}, {}
    for n in (10_000, 10):  # the long one first: it meets no kernel the short one compiled
        t0 = time.perf_counter()
        exe = lowered[n].compile()
        times[n] = time.perf_counter() - t0
        kernels[n] = sorted(exe.sources())
    assert kernels[10_000] == kernels[10]  # the same kernels (their shapes aside): the same work
    assert times[10_000] < 5 * times[10] + 2.0, times  # (unrolled, 10,000 steps take minutes)
    xs = np.full((10_000, 4), 1e-3, np.float32)
    c, _ = tx.jit(lambda c, xs: lax.scan(_cheap, c, xs))(C0, xs)
    want = C0.astype(np.float64) * 0.999 ** 10_000 + 1e-3 * (1 - 0.999 ** 10_000) / (1 - 0.999)
    close(c, want, 1e-3)


def test_a_scan_of_10000_steps_matches_a_python_loop(device):
    """The carry and every step's rows of two ys, 10,000 steps, against numpy step by step."""
    def step(c, x):
        c = tnp.tanh(c @ W + x)
        return c, (c * 2.0, tnp.sum(c))
    xs = (np.random.default_rng(1).standard_normal((10_000, 4)) * 0.5).astype(np.float32)
    c, (ys, sums) = tx.jit(lambda c, xs: lax.scan(step, c, xs))(C0, xs)
    rc, rys = rnn_numpy(W, C0, xs)
    close(c, rc, 1e-4)
    close(ys, rys, 1e-4)
    close(sums, rys.sum(1) / 2.0, 1e-4)


# h' = tanh([h, x] W1) W2 (batch 8, state 32, hidden 64): GEMMs big enough for the CPU's template (its workspace)
W1 = (R.standard_normal((64, 64)) * 0.1).astype(np.float32)
W2 = (R.standard_normal((64, 32)) * 0.1).astype(np.float32)
H0 = R.standard_normal((8, 32)).astype(np.float32)


def _cell(h, x):
    h = tnp.tanh(tnp.concatenate([h, x], axis=1) @ W1) @ W2
    return h, h[0]


def test_the_loop_allocates_nothing_per_iteration(device):
    """A call's allocations (outputs, the second set of carry buffers, the bodies' arenas, the
    kernels' workspaces) do not grow with the trip count: scans with elementwise and GEMM bodies,
    and a while_loop."""
    if device.kind == "ref":
        pytest.skip("the reference interpreter has no memory pool")
    for f, c in [(lambda c, xs: lax.scan(lambda c, x: (tnp.tanh(c + x), c), c, xs), C0[None]),
                 (lambda c, xs: lax.scan(_cell, c, xs), H0)]:
        f, calls = tx.jit(f), {}
        for n in (100, 1000):
            xs = (np.random.default_rng(n).standard_normal((n, *c.shape)) * 0.1).astype(np.float32)
            f(c, xs)  # compiles
            before = device.memory_stats()["alloc_calls"]
            out = f(c, xs)
            calls[n] = device.memory_stats()["alloc_calls"] - before
        assert calls[100] == calls[1000], calls
    f, calls = tx.jit(lambda c, n: lax.while_loop(lambda s: s[1] < n, lambda s: (tnp.tanh(s[0] + 0.1), s[1] + 1),
                                                   (c, 0))), {}
    for n in (10, 100):  # a trip count read from the device: one program for both
        f(C0, n)
        before = device.memory_stats()["alloc_calls"]
        f(C0, n)
        calls[n] = device.memory_stats()["alloc_calls"] - before
    assert calls[10] == calls[100] and f.trace_count == 1, calls
    h, rows = H0, []
    for x in xs:
        h = np.tanh(np.concatenate([h, x], 1) @ W1) @ W2
        rows.append(h[0])
    close(out[0], h, 1e-4)
    close(out[1], np.stack(rows), 1e-4)


# ---- the lax operations beside control flow --------------------------------------------------------------

def test_dynamic_slicing_against_numpy(device):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    f = tx.jit(lambda x, i, j: lax.dynamic_slice(x, (i, j), (2, 3)))
    for i, j in [(1, 1), (2, 3), (-1, 0), (0, -9)]:  # negatives count from the end, then clamp
        ii, jj = i + 3 if i < 0 else i, j + 4 if j < 0 else j
        ii, jj = min(max(ii, 0), 1), min(max(jj, 0), 1)
        close(f(x, np.int32(i), np.int32(j)), x[ii:ii + 2, jj:jj + 3])
    upd = tx.jit(lambda x, u, i: lax.dynamic_update_slice_in_dim(x, u, i, axis=1))
    for i in (0, 2, 3):
        want = x.copy()
        s = min(i, 2)
        want[:, s:s + 2] = -1.0
        close(upd(x, -np.ones((3, 2), np.float32), np.int32(i)), want)
    close(tx.jit(lambda x, i: lax.dynamic_index_in_dim(x, i, 1, keepdims=False))(x, np.int32(2)), x[:, 2])
    close(lax.dynamic_update_index_in_dim(x, np.zeros(4, np.float32), 1, 0), np.where(np.arange(3)[:, None] == 1, 0, x))
    xd = np.asarray(x, np.float64)
    tx.check_grads(tx.jit(lambda x: tnp.sum(tnp.sin(lax.dynamic_slice(x, (np.int32(1), np.int32(1)), (2, 2))))),
                   (xd,), modes=("fwd", "rev"))
    tx.check_grads(tx.jit(lambda x, u: tnp.sin(lax.dynamic_update_slice(x, u, (np.int32(1), np.int32(2))))),
                   (xd, xd[:2, :2] * 0.5), modes=("fwd", "rev"))
    starts = np.array([0, 2, 1], np.int32)
    got = tx.vmap(lambda i: lax.dynamic_slice_in_dim(x[0], i, 2))(starts)
    close(got, np.stack([x[0, s:s + 2] for s in starts]))
    got = tx.vmap(lambda r, i: lax.dynamic_update_slice(r, np.float32([9, 9]), (i,)))(x, starts)
    close(got, np.stack([np.concatenate([r[:s], [9, 9], r[s + 2:]]) for r, s in zip(x, starts)]))


def _np_reduce_window(x, init, op, dims, strides, pads):
    x = np.pad(x, pads, constant_values=init)
    out_shape = [(n - k) // s + 1 for n, k, s in zip(x.shape, dims, strides)]
    out = np.empty(out_shape, x.dtype)
    for idx in np.ndindex(*out_shape):
        win = x[tuple(slice(i * s, i * s + k) for i, s, k in zip(idx, strides, dims))]
        out[idx] = op.reduce(np.concatenate([[init], win.ravel()]))
    return out


def test_reduce_window_against_numpy(device):
    x = R.standard_normal((2, 5, 6)).astype(np.float32)
    mx = tx.jit(lambda x: lax.reduce_window(x, -np.inf, lax.max, (1, 2, 3), (1, 2, 2), "SAME"))
    close(mx(x), _np_reduce_window(x, -np.inf, np.maximum, (1, 2, 3), (1, 2, 2), [(0, 0), (0, 1), (0, 1)]))
    sm = tx.jit(lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 3, 2), (1, 1, 1), ((0, 0), (1, 1), (0, 0))))
    close(sm(x), _np_reduce_window(x, 0.0, np.add, (1, 3, 2), (1, 1, 1), [(0, 0), (1, 1), (0, 0)]), 1e-5)


def _np_conv_nchw(x, w, stride, pads, rd=(1, 1), groups=1):
    x = np.pad(x, ((0, 0), (0, 0), *pads))
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    eh, ew = (kh - 1) * rd[0] + 1, (kw - 1) * rd[1] + 1
    oh, ow = (h - eh) // stride[0] + 1, (wd - ew) // stride[1] + 1
    out = np.zeros((n, o, oh, ow))
    og = o // groups
    for i in range(oh):
        for j in range(ow):
            patch = x[:, :, i * stride[0]:i * stride[0] + eh:rd[0], j * stride[1]:j * stride[1] + ew:rd[1]]
            for g in range(groups):
                out[:, g * og:(g + 1) * og, i, j] = np.einsum(
                    "nchw,ochw->no", patch[:, g * cg:(g + 1) * cg], w[g * og:(g + 1) * og])
    return out


def test_conv_general_dilated_against_numpy(device):
    x = R.standard_normal((2, 5, 6, 4)).astype(np.float32)  # NHWC
    w = R.standard_normal((3, 2, 2, 6)).astype(np.float32)  # HWIO, 2 feature groups
    f = tx.jit(lambda x, w: lax.conv_general_dilated(
        x, w, (2, 1), "SAME", rhs_dilation=(1, 2), dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=2, precision=lax.Precision.HIGHEST))
    xn, wn = x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1)
    # SAME with stride (2, 1) over (5, 6), dilated kernel (3, 3): pads (1, 1) and (1, 1)
    want = _np_conv_nchw(xn, wn, (2, 1), [(1, 1), (1, 1)], (1, 2), groups=2).transpose(0, 2, 3, 1)
    close(f(x, w), want, 1e-4)
    # 1-d, default layout, a transposed convolution (lhs dilation), negative padding crops
    x1, w1 = R.standard_normal((2, 3, 7)).astype(np.float32), R.standard_normal((4, 3, 3)).astype(np.float32)
    y = lax.conv_general_dilated(x1, w1, (1,), ((2, -1),), lhs_dilation=(2,))
    xd = np.zeros((2, 3, 13), np.float32)
    xd[:, :, ::2] = x1
    xd = np.pad(xd, ((0, 0), (0, 0), (2, 0)))[:, :, :-1]
    close(y, _np_conv_nchw(xd[:, :, None], w1[:, :, None], (1, 1), [(0, 0), (0, 0)])[:, :, 0], 1e-4)


def test_a_loop_that_prints_is_kept_and_prints_each_step(device, capsys):
    def f(x):
        def step(c, _):
            tx.debug_print("c={}", c)
            return c + 1.0, None
        lax.scan(step, x, None, length=3)  # its result unread: the loop still runs for its prints
        return x * 2.0
    close(tx.jit(f)(np.float32(1.0)), 2.0)
    assert capsys.readouterr().out.split() == ["c=1.0", "c=2.0", "c=3.0"]


def test_python_scalar_carries_take_the_body_dtype_and_second_order(device):
    xs = np.linspace(-1, 1, 4)  # float64: a carry started as 0.3 becomes float64, as in JAX

    def f(w):
        c, ys = lax.scan(lambda c, x: (tnp.sin(c * w + x), c * c), 0.3, xs)
        return c + tnp.sum(ys)

    def unrolled(w):
        c, t = 0.3, 0.0
        for x in xs:
            c, t = tnp.sin(c * w + x), t + c * c
        return c + t
    w = np.float64(0.7)
    assert np.asarray(tx.jit(f)(w)).dtype == np.float64
    close(tx.jit(tx.grad(tx.grad(f)))(w), tx.grad(tx.grad(unrolled))(w), 1e-9)
    assert float(lax.fori_loop(0, 4, lambda i, x: x + i * 0.5, 0)) == 3.0  # an int start, float sums


# ---- a loop inside one kernel ---------------------------------------------------------------------

def _loop_launches(f, *args):
    """f(*args) (compiled first), and the launches its scans made in the call: (loop kernels,
    step-path launches)."""
    from tilefuse.runtime import control_flow
    f(*args)
    control_flow.LAUNCHES.clear()
    out = f(*args)
    return out, control_flow.LAUNCHES["scan_loop"], control_flow.LAUNCHES["scan_step"]


@pytest.mark.parametrize("reverse", [False, True])
def test_an_elementwise_scan_is_one_kernel_holding_the_loop(device, reverse):
    """h = tanh(h * a + x_t), ys = h * 2, over carries that are vectors of points (8 x 32) and
    not (3 x 5); on the CPU one launch a call."""
    for shape in [(8, 32), (3, 5)]:
        rng = np.random.default_rng(len(shape))
        a = (rng.standard_normal(shape[-1]) * 0.5).astype(np.float32)
        h0 = rng.standard_normal(shape).astype(np.float32)
        xs = rng.standard_normal((37, *shape)).astype(np.float32)

        def f(a, h0, xs):
            return lax.scan(lambda h, x: (tnp.tanh(h * a + x), tnp.tanh(h * a + x) * 2.0), h0, xs, reverse=reverse)
        (h, ys), loops, steps = _loop_launches(tx.jit(f), a, h0, xs)
        rh, rys = h0, [None] * len(xs)
        for t in (reversed(range(len(xs))) if reverse else range(len(xs))):
            rh = np.tanh(rh * a + xs[t])
            rys[t] = rh * 2.0
        close(h, rh)
        close(ys, np.stack(rys))
        if device.kind == "cpu":
            assert (loops, steps) == (1, 0)


def test_a_fori_loop_of_10000_elementwise_steps_is_one_kernel(device):
    """The counter (a one-element carry) is computed by every work-item beside its points."""
    x0 = np.random.default_rng(3).standard_normal(40).astype(np.float32)

    def f(x0):
        return lax.fori_loop(0, 10_000, lambda i, x: x * 0.999 + 0.001 * tnp.sin(x + i.astype(np.float32) * 1e-3), x0)
    out, loops, steps = _loop_launches(tx.jit(f), x0)
    x = x0.copy()
    for i in range(10_000):
        x = (x * np.float32(0.999) + np.float32(0.001) * np.sin(x + np.float32(i) * np.float32(1e-3))).astype(np.float32)
    close(out, x, 1e-4)
    if device.kind == "cpu":
        assert (loops, steps) == (1, 0)


def test_a_loop_kernel_with_carries_of_several_dtypes(device):
    """float32, int32 and bool carries beside each other, a y that is also a carry, an x of
    another dtype; the carries read each other's old values."""
    rng = np.random.default_rng(4)
    f0 = rng.standard_normal(16).astype(np.float32)
    n0 = np.arange(16, dtype=np.int32)
    b0 = np.arange(16) % 3 == 0
    xs = rng.integers(-3, 4, (25, 16)).astype(np.int32)

    def step(c, x):
        f, n, b = c
        f2 = tnp.where(b, f * 0.5, f + n.astype(np.float32) * 0.01)
        n2 = n + x
        b2 = n % 2 == 0
        return (f2, n2, b2), n2

    def ref(f, n, b):
        ys = []
        for x in xs:
            f, n, b = np.where(b, f * np.float32(0.5), f + n.astype(np.float32) * np.float32(0.01)), n + x, n % 2 == 0
            ys.append(n)
        return (f, n, b), np.stack(ys)
    ((f, n, b), ys), loops, steps = _loop_launches(tx.jit(lambda *c: lax.scan(step, c, xs)), f0, n0, b0)
    (rf, rn, rb), rys = ref(f0, n0, b0)
    close(f, rf)
    np.testing.assert_array_equal(np.asarray(n), rn)
    np.testing.assert_array_equal(np.asarray(b), rb)
    np.testing.assert_array_equal(np.asarray(ys), rys)
    if device.kind == "cpu":
        assert (loops, steps) == (1, 0)


def test_a_body_with_a_reduction_or_a_gemm_keeps_the_step_path(device):
    """A point that needs other points' carry (a sum over it, a product with a matrix) cannot
    run alone: each step launches the body's kernels, as before."""
    xs = (np.random.default_rng(5).standard_normal((9, 4)) * 0.5).astype(np.float32)
    bodies = [lambda c, x: (tnp.tanh(c + tnp.sum(c) * 0.1 + x), c),
              lambda c, x: (tnp.tanh(c @ W + x), c)]
    refs = [lambda c, x: np.tanh(c + c.sum() * 0.1 + x), lambda c, x: np.tanh(c @ W + x)]
    for body, ref in zip(bodies, refs):
        (c, _), loops, steps = _loop_launches(tx.jit(lambda c, xs: lax.scan(body, c, xs)), C0, xs)
        rc = C0
        for x in xs:
            rc = ref(rc, x)
        close(c, rc, 1e-5)
        if device.kind == "cpu":
            assert loops == 0 and steps >= len(xs)


def test_the_loop_kernel_type_checks_and_runs_on_the_tile_interpreter(monkeypatch):
    """The tile kernel the CPU compiles, checked (check_tile) and run by the reference
    interpreter (run_tile) against numpy: vectors of points, reverse, a fori counter."""
    from tilefuse.ir.kernel.loop import loop_kernel
    from tilefuse.ir.kernel.tile import check_tile, run_tile
    a = np.linspace(-1, 1, 32).astype(np.float32)
    h0 = np.random.default_rng(6).standard_normal((8, 32)).astype(np.float32)
    xs = np.random.default_rng(7).standard_normal((7, 8, 32)).astype(np.float32)

    def f(a, h, xs):
        def step(c, x):
            i, h = c
            h = tnp.tanh(h * a + x + i.astype(np.float32) * 0.1)
            return (i + 1, h), h * 2.0
        return lax.scan(step, (np.int32(0), h), xs, reverse=True)
    from tilefuse.runtime import control_flow
    built = []
    monkeypatch.setattr(control_flow, "loop_kernel", lambda *a, **k: built.append(loop_kernel(*a, **k)) or built[-1])
    tx.jit(f).lower(a, h0, xs, device="cpu").compile()
    (tk,) = built
    check_tile(tk)
    i_out, h_out, ys = np.zeros(1, np.int32), np.zeros(h0.size, np.float32), np.zeros(xs.size, np.float32)
    run_tile(tk, [a, np.zeros(1, np.int32), h0.ravel().copy(), xs.ravel(), i_out, h_out, ys])
    h, rys = h0, [None] * len(xs)
    for i, t in enumerate(reversed(range(len(xs)))):
        h = np.tanh(h * a + xs[t] + np.float32(i) * np.float32(0.1))
        rys[t] = h * 2.0
    assert i_out[0] == len(xs)
    close(h_out.reshape(h0.shape), h)
    close(ys.reshape(xs.shape), np.stack(rys))
