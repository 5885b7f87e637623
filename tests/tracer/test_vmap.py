"""vmap against a Python loop for every primitive, in_axes/out_axes variants, nesting, jit
composition, the one-dot_general property of a batched matmul, and the errors."""
from __future__ import annotations

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse.ir import primitives as P
from tilefuse.ir.core import typecheck_graph
from tilefuse.tracer.core import bind, bind1
from tilefuse.tracer.vmap import batch_rules

from conftest import assert_close

N = 3  # batch size in every test
f32, i32 = np.dtype(np.float32), np.dtype(np.int32)


# ---- operand generators: (rng, shape) -> one example -----------------------------------------

def normal(rng, s):
    return rng.standard_normal(s).astype(f32)


def positive(rng, s):
    return rng.uniform(0.5, 2.0, s).astype(f32)


def small_ints_f(rng, s):  # floats with ties, so comparisons and argmax see equal values
    return rng.integers(-2, 3, s).astype(f32)


def special(rng, s):
    x = normal(rng, s)
    x.flat[0], x.flat[-1] = np.inf, np.nan
    return x


def boolean(rng, s):
    return rng.integers(0, 2, s).astype(bool)


def ints(rng, s):
    return rng.integers(-50, 50, s).astype(i32)


def nonzero_ints(rng, s):
    return (rng.integers(1, 9, s) * rng.choice([-1, 1], s)).astype(i32)


def shifts(rng, s):
    return rng.integers(0, 8, s).astype(i32)


def indices(k):  # some out of range: gather and scatter_add clamp
    return lambda rng, s: rng.integers(-2, k + 2, s).astype(i32)


class Case:
    """One primitive application: operand (generator, per-example shape) pairs and params; `fun`
    and `ref` override bind and the numpy per-example reference when the primitive needs it."""

    def __init__(self, prim, operands, fun=None, ref=None, id=None, **params):
        self.prim, self.operands, self.params = prim, operands, params
        self.fun = fun or (lambda *xs: bind1(prim, *xs, **params))
        self.ref = ref or (lambda *xs: prim.impl(*xs, **params)[0])
        self.id = id or prim.name


U = (2, 3)
CASES = [Case(p, [(normal, U)]) for p in (P.neg, P.exp, P.expm1, P.tanh, P.logistic, P.sin,
                                         P.cos, P.erf, P.abs_, P.sign, P.floor, P.ceil, P.round_,
                                         P.stop_gradient)]
CASES += [Case(p, [(positive, U)]) for p in (P.log, P.log1p, P.sqrt, P.rsqrt)]
CASES += [Case(P.is_finite, [(special, U)]), Case(P.not_, [(boolean, U)]),
          Case(P.not_, [(ints, U)], id="not_int")]
CASES += [Case(p, [(normal, U), (normal, U)]) for p in (P.add, P.sub, P.mul, P.max_, P.min_)]
CASES += [Case(p, [(small_ints_f, U), (small_ints_f, U)])
          for p in (P.eq, P.ne, P.lt, P.le, P.gt, P.ge)]
CASES += [Case(p, [(boolean, U), (boolean, U)]) for p in (P.and_, P.or_, P.xor)]
CASES += [
    Case(P.div, [(normal, U), (positive, U)]),
    Case(P.div, [(ints, U), (nonzero_ints, U)], id="div_int"),
    Case(P.rem, [(ints, U), (nonzero_ints, U)]),
    Case(P.pow_, [(positive, U), (normal, U)]),
    Case(P.shift_left, [(ints, U), (shifts, U)]),
    Case(P.shift_right_logical, [(ints, U), (shifts, U)]),
    Case(P.integer_pow, [(normal, U)], y=3),
    Case(P.integer_pow, [(positive, U)], y=-2, id="integer_pow_neg"),
    Case(P.select, [(boolean, U), (normal, U), (normal, U)]),
    Case(P.convert_element_type, [(normal, U)], new_dtype=i32, weak_type=False),
    Case(P.iota, [(normal, U)], id="iota",
         fun=lambda x: bind1(P.add, x, bind1(P.iota, dtype=f32, shape=U, dimension=1)),
         ref=lambda x: x + np.arange(3, dtype=f32)),
    Case(P.broadcast_in_dim, [(normal, (1, 3))], shape=(2, 4, 3), broadcast_dimensions=(1, 2)),
    Case(P.reshape, [(normal, (2, 3))], new_sizes=(3, 2)),
    Case(P.reshape, [(normal, (2, 3))], new_sizes=(6,), id="reshape_flat"),
    Case(P.transpose, [(normal, (2, 3, 4))], permutation=(2, 0, 1)),
    Case(P.rev, [(normal, (2, 3))], dimensions=(1,)),
    Case(P.slice_, [(normal, (4, 5))], start_indices=(1, 0), limit_indices=(4, 5), strides=(2, 2)),
    Case(P.concatenate, [(normal, (2, 3)), (normal, (1, 3))], dimension=0),
    Case(P.concatenate, [(normal, (2, 3)), (normal, (2, 1)), (normal, (2, 2))], dimension=1,
         id="concatenate_3"),
    Case(P.pad, [(normal, (2, 3)), (normal, ())], padding_config=((1, 0, 1), (0, 2, 0))),
    Case(P.reduce_sum, [(normal, (2, 3, 4))], axes=(0, 2)),
    Case(P.reduce_max, [(normal, (2, 3, 4))], axes=(1,)),
    Case(P.reduce_min, [(normal, (2, 3, 4))], axes=(2, 0)),
    Case(P.reduce_prod, [(normal, (2, 3))], axes=(1,)),
    Case(P.argmax, [(small_ints_f, (3, 4))], axis=1, index_dtype=i32),
    Case(P.argmin, [(small_ints_f, (3, 4))], axis=0, index_dtype=i32),
    Case(P.dot_general, [(normal, (2, 3)), (normal, (3, 4))],
         dimension_numbers=(((1,), (0,)), ((), ()))),
    Case(P.dot_general, [(normal, (2, 3, 4)), (normal, (2, 4, 5))], id="dot_general_batch",
         dimension_numbers=(((2,), (1,)), ((0,), (0,)))),
    Case(P.dot_general, [(normal, (3, 2)), (normal, (4, 3))], id="dot_general_lhs_first",
         dimension_numbers=(((0,), (1,)), ((), ()))),
    Case(P.dot_general, [(normal, (4, 2, 3)), (normal, (3, 5, 4))], id="dot_general_odd",
         dimension_numbers=(((2,), (0,)), ((0,), (2,)))),
    Case(P.gather, [(normal, (5, 3)), (indices(5), (2, 4))], axis=0),
    Case(P.gather, [(normal, (2, 5, 3)), (indices(5), (4,))], axis=1, id="gather_mid"),
    Case(P.scatter_add, [(normal, (5, 3)), (indices(5), (4,)), (normal, (4, 3))], axis=0),
    Case(P.scatter_add, [(normal, (2, 5)), (indices(5), (2, 3)), (normal, (2, 2, 3))], axis=1,
         id="scatter_add_mid"),
    Case(P.conv, [(normal, (2, 4, 5, 4)), (normal, (6, 2, 2, 3))], window_strides=(2, 1), padding=((1, 0), (1, 1)),
         lhs_dilation=(1, 1), rhs_dilation=(1, 1), dimension_numbers=((0, 1, 2, 3),) * 3, feature_group_count=2,
         batch_group_count=1),
    Case(P.conv, [(normal, (5, 4, 3)), (normal, (2, 3, 4))], id="conv_nwc_batch_groups", window_strides=(1,),
         padding=((1, -1),), lhs_dilation=(2,), rhs_dilation=(1,), dimension_numbers=((1, 2, 0), (2, 1, 0), (1, 2, 0)),
         feature_group_count=1, batch_group_count=2),
    Case(P.fused_attention, [(normal, (2, 3, 4)), (normal, (2, 5, 4)), (normal, (2, 5, 3))],
         scale=0.5, causal=True, dims=((0, 1, 2),) * 3),
    Case(P.fused_attention, [(normal, (3, 2, 4)), (normal, (5, 2, 4)), (normal, (5, 2, 3)),
                             (normal, (2, 3, 5))], id="fused_attention_bias_seq_first",
         scale=0.5, causal=False, dims=((1, 0, 2),) * 3),
    Case(P.fused_attention_bwd, [(normal, (2, 3, 4))] * 5, scale=0.5, causal=False,
         dims=((0, 1, 2),) * 3),
]


def spd(rng, s):  # symmetric positive definite matrices: every decomposition is defined
    a = rng.standard_normal(s).astype(np.float64)
    return a @ a.T + s[-1] * np.eye(s[-1])


def normal64(rng, s):
    return rng.standard_normal(s).astype(np.float64)


CASES += [
    Case(P.argsort, [(small_ints_f, (3, 4))], axis=1, descending=False),
    Case(P.argsort, [(small_ints_f, (4,)), (normal, (4,))], axis=0, descending=True, id="argsort_keys"),
    Case(P.cholesky, [(spd, (3, 3))]),
    Case(P.solve, [(spd, (3, 3)), (normal64, (3, 2))]),
    Case(P.triangular_solve, [(spd, (3, 3)), (normal64, (3, 2))], lower=True, transpose_a=True, unit_diagonal=False),
    Case(P.slogdet, [(normal64, (3, 3))]),
    Case(P.qr, [(normal64, (4, 3))], full_matrices=False),
    Case(P.eigh, [(spd, (3, 3))]),
    Case(P.svd, [(normal64, (3, 2))], full_matrices=False, compute_uv=True),
]
CASES += [
    Case(P.dynamic_slice, [(normal, (5, 3)), (lambda r, s: np.int32(r.integers(-2, 6)), ()),
                           (lambda r, s: np.int32(r.integers(0, 3)), ())], slice_sizes=(2, 2)),
    Case(P.dynamic_update_slice, [(normal, (5, 3)), (normal, (2, 3)),
                                  (lambda r, s: np.int32(r.integers(-2, 6)), ()), (lambda r, s: np.int32(0), ())]),
]
DEDICATED = {"cond": "tests/test_lax.py", "while": "tests/test_lax.py", "scan": "tests/test_lax.py",
             "debug_print": "test_debug_print_per_example", "tile_op": "tests/test_tile_op.py",
             "custom_vjp_call": "tests/autodiff/test_custom.py", "custom_jvp_call": "tests/autodiff/test_custom.py"}


def test_every_primitive_has_a_rule_and_a_case():
    names = {n for n, p in P.PRIMITIVES.items() if not p.compile_only}  # made after vmap ran
    covered = {c.prim.name for c in CASES} | set(DEDICATED)
    assert names - covered == set(), f"primitives without a vmap test case: {names - covered}"
    ruled = {p.name for p in batch_rules} | {"custom_vjp_call", "custom_jvp_call"}  # BatchTrace takes them
    assert names - ruled == set(), f"primitives without a batching rule: {names - ruled}"


def _patterns(ndims):
    """in_axes patterns for operands of these per-example ranks (deduplicated)."""
    k = len(ndims)
    pats = {
        "zero": [0] * k,
        "neg": [-1] * k,
        "one": [min(1, nd) for nd in ndims],
        "first": [0] + [None] * (k - 1),
        "last": [None] * (k - 1) + [-1],
        "alt": [min(1, nd) if i % 2 == 0 else None for i, nd in enumerate(ndims)],
    }
    seen, out = set(), []
    for name, axes in pats.items():
        if any(a is not None for a in axes) and tuple(axes) not in seen:
            seen.add(tuple(axes))
            out.append((name, tuple(axes)))
    return out


PARAMS = [pytest.param(c, axes, id=f"{c.id}-{name}")
          for c in CASES for name, axes in _patterns([len(s) for _, s in c.operands])]


def _inputs(case, axes, seed=0):
    """Batched inputs for these in_axes and the Python loop's answer."""
    rng = np.random.default_rng(seed)
    stacks = [np.stack([gen(rng, s) for _ in range(N)]) for gen, s in case.operands]
    inputs = [st[0] if a is None else np.moveaxis(st, 0, a) for st, a in zip(stacks, axes)]
    loop = np.stack([case.ref(*(st[0] if a is None else st[i] for st, a in zip(stacks, axes)))
                     for i in range(N)])
    return inputs, loop


@pytest.mark.parametrize("case, axes", PARAMS)
def test_vmap_matches_loop(device, case, axes):
    inputs, loop = _inputs(case, axes)
    out = tx.vmap(case.fun, in_axes=axes)(*inputs)
    assert_close(out, loop)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_jit_of_vmap_matches_loop(device, case):
    axes = _patterns([len(s) for _, s in case.operands])[-1][1]  # the last: mixed if it can be
    inputs, loop = _inputs(case, axes, seed=1)
    batched = tx.vmap(case.fun, in_axes=axes)
    assert_close(tx.jit(batched)(*inputs), loop)
    typecheck_graph(tx.make_graph(batched)(*inputs))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES
                                  if c.prim in (P.gather, P.scatter_add, P.dot_general, P.pad, P.conv)])
def test_nested_vmap_matches_double_loop(device, case):
    """vmap(vmap(f)) over two batch axes of every operand equals a double loop."""
    rng = np.random.default_rng(2)
    xs = [np.stack([np.stack([gen(rng, s) for _ in range(2)]) for _ in range(N)])
          for gen, s in case.operands]
    loop = np.stack([np.stack([case.ref(*(x[i, j] for x in xs)) for j in range(2)])
                     for i in range(N)])
    inner = tx.vmap(case.fun, in_axes=-1)  # the inner batch axis is last, the outer one first
    out = tx.vmap(inner, in_axes=0, out_axes=1)(*(np.moveaxis(x, 1, -1) for x in xs))
    assert_close(np.swapaxes(np.asarray(out), 0, 1), loop)


def test_debug_print_per_example(device, capsys):
    x = np.arange(6, dtype=f32).reshape(N, 2)
    y = np.float32(7)

    def f(a, b):
        bind(P.debug_print, a, b, fmt="a={} b={b}", names=("b",))
        return bind1(P.neg, a)

    out = tx.vmap(f, in_axes=(0, None))(x, y)
    printed = capsys.readouterr().out
    for i in range(N):
        P.debug_print.impl(x[i], y, fmt="a={} b={b}", names=("b",))
    assert printed == capsys.readouterr().out
    assert printed.count("a=") == N
    assert_close(out, -x)


# ---- the API: in_axes, out_axes, pytrees ---------------------------------------------------

def test_in_axes_pytree_prefix(device, rng):
    params = {"w": rng.standard_normal((3, 2)).astype(f32), "b": rng.standard_normal((N, 2)).astype(f32)}
    x = rng.standard_normal((3, N)).astype(f32)

    def f(p, x):
        return tnp.tanh(x @ p["w"] + p["b"])

    out = tx.vmap(f, in_axes=({"w": None, "b": 0}, 1))(params, x)
    loop = np.stack([np.tanh(x[:, i] @ params["w"] + params["b"][i]) for i in range(N)])
    assert_close(out, loop)
    out_list = tx.vmap(f, in_axes=[{"w": None, "b": 0}, -1])(params, x)
    assert_close(out_list, loop)


def test_in_axes_inside_containers_and_kwargs(device, rng):
    a = rng.standard_normal((N, 2)).astype(f32)
    b = rng.standard_normal((2,)).astype(f32)
    c = rng.standard_normal((N, 2)).astype(f32)

    def f(pair, scale):
        x, y = pair
        return x * y * scale

    out = tx.vmap(f, in_axes=((0, None),))((a, b), scale=c)  # keyword arguments map over axis 0
    assert_close(out, a * b * c)
    d = rng.standard_normal((N, 4)).astype(f32)
    kw = tx.vmap(lambda *, z, a: (z, a))(z=d, a=c)  # leaves in an order other than the call's
    assert_close(kw[0], d)
    assert_close(kw[1], c)


def test_out_axes(device, rng):
    x = rng.standard_normal((N, 2, 4)).astype(f32)

    def f(x):
        return {"y": tnp.exp(x), "s": tnp.sum(x), "c": tnp.ones(3)}

    out = tx.vmap(f, out_axes={"y": -1, "s": 0, "c": None})(x)
    assert_close(out["y"], np.moveaxis(np.exp(x), 0, -1))
    assert_close(out["s"], x.sum((1, 2)), rtol=1e-5)
    assert_close(out["c"], np.ones(3, f32))
    t = tx.vmap(lambda x: (x, x * 2), out_axes=(1, 2))(x)
    assert_close(t[0], np.moveaxis(x, 0, 1))
    assert_close(t[1], np.moveaxis(x * 2, 0, 2))


def test_unbatched_outputs_broadcast(device, rng):
    x = rng.standard_normal((N, 2)).astype(f32)
    w = rng.standard_normal((4,)).astype(f32)
    a, b = tx.vmap(lambda x, w: (w * 2, np.float32(5)), in_axes=(0, None), out_axes=(1, 0))(x, w)
    assert_close(a, np.broadcast_to((w * 2)[:, None], (4, N)))
    assert_close(b, np.full(N, 5, f32))


def test_axis_size_without_mapped_inputs(device):
    out = tx.vmap(lambda x: x + 1, in_axes=None, axis_size=2)(np.ones(3, f32))
    assert_close(out, np.full((2, 3), 2, f32))


def test_nested_vmap_outer_product_and_closure(device, rng):
    x = rng.standard_normal((N, 3)).astype(f32)
    y = rng.standard_normal((4, 3)).astype(f32)
    dist = tx.vmap(tx.vmap(lambda a, b: tnp.sum((a - b) ** 2), in_axes=(None, 0)), in_axes=(0, None))
    loop = np.array([[np.sum((x[i] - y[j]) ** 2) for j in range(4)] for i in range(N)])
    assert_close(dist(x, y), loop, rtol=1e-5)
    closure = tx.vmap(lambda a: tx.vmap(lambda b: a * b)(y))(x)  # inner closes over outer tracer
    assert_close(closure, x[:, None, :] * y[None, :, :])


def test_vmap_of_tnp_program(device, rng):
    """A small softmax-attention-like function written with tnp, vmapped over heads."""
    q = rng.standard_normal((N, 4, 8)).astype(f32)
    k = rng.standard_normal((N, 5, 8)).astype(f32)

    def attn(q, k):
        s = q @ k.T / np.sqrt(8).astype(f32)
        e = tnp.exp(s - tnp.max(s, axis=-1, keepdims=True))
        return e / tnp.sum(e, axis=-1, keepdims=True)

    def ref(q, k):
        s = q @ k.T / np.sqrt(8)
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    assert_close(tx.vmap(attn)(q, k), np.stack([ref(q[i], k[i]) for i in range(N)]), rtol=1e-5)


# ---- composition with jit, and the graph it stages ------------------------------------------

@pytest.mark.parametrize("in_axes, shapes", [
    ((0, None), ((N, 2, 3), (3, 4))),
    ((None, 0), ((2, 3), (N, 3, 4))),
    ((0, 0), ((N, 2, 3), (N, 3, 4))),
    ((1, -1), ((2, N, 3), (3, 4, N))),
    ((0, 0), ((N, 3), (N, 3, 4))),  # vector @ matrix
])
def test_vmap_of_matmul_is_one_dot_general(device, rng, in_axes, shapes):
    a, b = (rng.standard_normal(s).astype(f32) for s in shapes)
    f = tx.vmap(tnp.matmul, in_axes=in_axes)
    g = tx.make_graph(f)(a, b)
    assert g.count("dot_general") == 1, str(g)
    assert g.count() <= 2, str(g)  # the product and at most one transpose to out_axes 0
    am, bm = (np.moveaxis(v, ax, 0) if ax is not None else v for v, ax in zip((a, b), in_axes))
    loop = np.stack([(am[i] if in_axes[0] is not None else a) @ (bm[i] if in_axes[1] is not None else b)
                     for i in range(N)])
    assert_close(tx.jit(f)(a, b), loop, rtol=1e-5)


def test_nested_vmap_of_matmul_is_one_dot_general(device, rng):
    a = rng.standard_normal((N, 2, 4, 3)).astype(f32)
    b = rng.standard_normal((2, 3, 5)).astype(f32)
    f = tx.vmap(tx.vmap(tnp.matmul, in_axes=(0, 0)), in_axes=(0, None))
    g = tx.make_graph(f)(a, b)
    assert g.count("dot_general") == 1, str(g)
    assert_close(f(a, b), np.einsum("nbik,bkj->nbij", a, b), rtol=1e-5)


def test_jit_inside_vmap_replays(device, rng):
    x = rng.standard_normal((N, 4)).astype(f32)
    w = rng.standard_normal((4, 2)).astype(f32)
    layer = tx.jit(lambda x, w: tnp.tanh(x @ w))
    out = tx.vmap(layer, in_axes=(0, None))(x, w)
    assert_close(out, np.tanh(x @ w), rtol=1e-5)
    g = tx.make_graph(tx.vmap(layer, in_axes=(0, None)))(x, w)
    assert g.count("dot_general") == 1 and g.count("tanh") == 1, str(g)


def test_jit_of_vmap_stages_one_graph_and_caches(device, rng):
    x = rng.standard_normal((N, 4)).astype(f32)
    f = tx.jit(tx.vmap(lambda v: tnp.sum(v * v)))
    assert_close(f(x), (x * x).sum(1), rtol=1e-5)
    assert_close(f(x + 1), ((x + 1) ** 2).sum(1), rtol=1e-5)
    assert f.trace_count == 1


def test_vmap_of_grad(device, rng):
    x = rng.standard_normal((N, 3)).astype(np.float64)
    try:
        out = tx.vmap(tx.grad(lambda v: tnp.sum(tnp.sin(v) * v)))(x)
    except NotImplementedError:
        pytest.skip("autodiff has not landed yet")
    assert_close(out, np.cos(x) * x + np.sin(x))


# ---- errors ------------------------------------------------------------------------------------

def test_error_axis_out_of_range_names_argument(device):
    def f(x, y):
        return x + y
    with pytest.raises(tx.TransformError, match=r"in_axes 2 for argument 1 \('y'\) of shape \(3, 2\)"):
        tx.vmap(f, in_axes=(0, 2))(np.ones((3, 2), f32), np.ones((3, 2), f32))
    with pytest.raises(tx.TransformError, match=r"argument 0 .*shape \(\).*scalar"):
        tx.vmap(f)(np.float32(1), np.ones(3, f32))


def test_error_sizes_differ_names_arguments(device):
    def f(x, y):
        return x
    with pytest.raises(tx.TransformError,
                       match=r"argument 0 \(.x.\) has size 3, argument 1 \(.y.\) has size 4"):
        tx.vmap(f)(np.ones((3, 2), f32), np.ones((4, 2), f32))
    with pytest.raises(tx.TransformError, match=r"argument 0 \('p'\)\['b'\] has size 2"):
        tx.vmap(lambda p: p["a"])({"a": np.ones(3, f32), "b": np.ones(2, f32)})


def test_error_bad_in_axes(device):
    x = np.ones((3, 2), f32)
    with pytest.raises(tx.TransformError, match="in_axes has 1 entries but .* 2 positional"):
        tx.vmap(lambda a, b: a, in_axes=(0,))(x, x)
    with pytest.raises(tx.TransformError, match="tree prefix"):
        tx.vmap(lambda p: p, in_axes=({"a": 0},))({"b": x})
    with pytest.raises(tx.TransformError, match="every in_axes is None"):
        tx.vmap(lambda a: a, in_axes=None)(x)
    with pytest.raises(tx.TransformError, match="must be an int or None"):
        tx.vmap(lambda a: a, in_axes=(1.5,))(x)


def test_error_out_axes_none_for_batched_output(device):
    with pytest.raises(tx.TransformError, match="out_axes is None"):
        tx.vmap(lambda a: a * 2, out_axes=None)(np.ones((3, 2), f32))


def test_error_missing_rule_names_primitive(device, monkeypatch):
    monkeypatch.delitem(batch_rules, P.exp)
    with pytest.raises(tx.TransformError, match="vmap: no batching rule for primitive 'exp'"):
        tx.vmap(tnp.exp)(np.ones((3, 2), f32))


def test_error_python_control_flow_on_batched_value(device):
    def f(x):
        return x if x > 0 else -x
    with pytest.raises(tx.ConcretizationError):
        tx.vmap(f)(np.ones(3, f32))
