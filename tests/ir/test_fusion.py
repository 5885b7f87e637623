"""Fusion: regions are convex (no cycle between regions, ever), lower to one kernel each, and a
2-layer MLP's forward and backward compile to far fewer kernels than primitives. Results are
checked against the graph evaluated with the primitives' numpy implementations."""
from __future__ import annotations

from types import SimpleNamespace

import networkx as nx
import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from conftest import assert_close
from tilefuse.ir import primitives as P
from tilefuse.ir.core import Graph, ShapedArray, Var, eval_graph
from tilefuse.ir.kernel import InterpBackend
from tilefuse.ir.passes import dce, partition, run_passes
from tilefuse.ir.kernel.ir import reduce_levels
from tilefuse.ir.kernel.lower import lower_region, row_space
from tilefuse.ir.passes.fusion import REDUCTIONS, _Partitioner
from tilefuse.ir.passes.util import new_eqn
from tilefuse.runtime.compiler import compile_graph

F32 = np.dtype(np.float32)
DEV = SimpleNamespace(kind="interp", name="interp")


def ref_eval(g, args):
    return eval_graph(g, args, lambda e, xs: e.prim.impl(*xs, **e.params))


def run_compiled(g, args, fuse=True):
    be = InterpBackend()
    prog = compile_graph(g, DEV, be, fuse=fuse)
    outs = prog([be.put(np.asarray(a), DEV) for a in args])
    return prog, [be.to_host(o, v.aval, DEV) for o, v in zip(outs, g.outvars)]


def check_regions(g: Graph, regions):
    """Each value defined by one region at most (index maps and a reduction's producers may be
    copied under new names); every graph output computed; every region reads graph inputs or
    what earlier regions computed; each fused region one index space with at most one
    reduction; and the regions' data flow acyclic."""
    defined_by = {}
    for k, r in enumerate(regions):
        for e in r.eqns:
            for o in e.outputs:
                assert o.id not in defined_by
                defined_by[o.id] = k
    given = {v.id for v in (*g.invars, *g.constvars)}
    assert all(v.id in defined_by or v.id in given for v in g.outvars if isinstance(v, Var))
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(regions)))
    for k, r in enumerate(regions):
        for v in r.inputs:
            assert v.id in given or defined_by.get(v.id, k) < k, "a region reads a value computed later"
            if v.id in defined_by:
                dag.add_edge(defined_by[v.id], k)
        if r.kind == "fused" and r.meta.get("rows"):  # several reductions over one row space
            shape, axes = row_space(r)
            rows = tuple(n for k, n in enumerate(shape) if k not in axes)
            assert {tuple(n for n in o.aval.shape if n != 1) for o in r.outputs} <= \
                {tuple(n for n in rows if n != 1), tuple(n for n in shape if n != 1)}
        elif r.kind == "fused":
            assert len({o.aval.shape for o in r.outputs}) == 1
            assert sum(e.prim.name in REDUCTIONS for e in r.eqns) <= 1
    assert nx.is_directed_acyclic_graph(dag)


# ---- the 2-layer MLP ----------------------------------------------------------------------------

def mlp_forward(W1, b1, W2, b2, x, y):
    h = tnp.tanh(x @ W1 + b1)
    out = h @ W2 + b2
    return tnp.mean((out - y) ** 2)


def mlp_forward_backward(W1, b1, W2, b2, x, y):
    """The loss and its gradients, written by hand."""
    h = tnp.tanh(x @ W1 + b1)
    out = h @ W2 + b2
    d = out - y
    loss = tnp.mean(d * d)
    dout = d * (2.0 / d.size)
    dW2 = h.T @ dout
    db2 = tnp.sum(dout, axis=0)
    dh = dout @ W2.T
    dz1 = dh * (1.0 - h * h)
    dW1 = x.T @ dz1
    db1 = tnp.sum(dz1, axis=0)
    return loss, dW1, db1, dW2, db2


def mlp_args(B=8, D=6, H=5, O=3):
    r = np.random.default_rng(0)
    return [r.standard_normal(s).astype(F32) for s in [(D, H), (H,), (H, O), (O,), (B, D), (B, O)]]


def test_mlp_gradients_are_right(monkeypatch):
    """The hand-written backward matches finite differences, so the graphs below mean something."""
    monkeypatch.setattr(tx.config, "default_device", "ref")  # eager float64 on the numpy oracle
    args = mlp_args()
    wide = [a.astype(np.float64) for a in args]
    _, dW1, db1, dW2, db2 = (np.asarray(v) for v in mlp_forward_backward(*wide))
    eps = 1e-6
    for k, grad in ((0, dW1), (1, db1), (2, dW2), (3, db2)):
        a = [x.astype(np.float64) for x in args]
        flat = a[k].reshape(-1)
        j = flat.size // 2
        flat[j] += eps
        up = float(mlp_forward(*a))
        flat[j] -= 2 * eps
        down = float(mlp_forward(*a))
        assert abs((up - down) / (2 * eps) - grad.reshape(-1)[j]) < 1e-5


@pytest.mark.parametrize("fn,n_prims,n_kernels", [
    (mlp_forward, 11, 3),            # GEMM+bias+tanh, GEMM+bias, residual+square+mean
    # 5 GEMMs (2 with epilogues), 4 fused elementwise/reductions: the loss's mean and the
    # gradient it seeds read the one (small) array in one row kernel
    (mlp_forward_backward, 25, 9),
])
def test_mlp_compiles_to_far_fewer_kernels_than_primitives(fn, n_prims, n_kernels):
    args = mlp_args()
    g = tx.make_graph(fn)(*args)
    assert len(g.eqns) == n_prims
    prog, outs = run_compiled(g, args)
    assert len(prog.launches) == n_kernels
    # a GEMM with its epilogue (bias, activation) is one fused_gemm kernel
    assert sum(1 for l in prog.launches if l.kind in ("dot_general", "fused_gemm")) == g.count("dot_general")
    assert len(prog.launches) * 2 < len(g.eqns)
    for o, w in zip(outs, ref_eval(g, args)):
        assert_close(o, w, rtol=1e-5, atol=1e-6)
    optimised = run_passes(g)
    check_regions(optimised, partition(optimised))


def test_without_fusion_every_equation_is_a_kernel():
    args = mlp_args()
    g = tx.make_graph(mlp_forward_backward)(*args)
    prog, outs = run_compiled(g, args, fuse=False)
    assert len(prog.launches) >= len(run_passes(g).eqns)
    for o, w in zip(outs, ref_eval(g, args)):
        assert_close(o, w, rtol=1e-5, atol=1e-6)


# ---- convexity -----------------------------------------------------------------------------------

def test_diamond_through_a_gemm_is_not_fused_into_a_cycle():
    """exp -> dot -> add and exp -> add: exp and add are both elementwise, but one region holding
    both would feed the dot and read from it."""
    x, w = Var(ShapedArray((4, 4), F32)), Var(ShapedArray((4, 4), F32))
    e1, (a,) = new_eqn(P.exp, [x], {})
    e2, (d,) = new_eqn(P.dot_general, [a, w], dict(dimension_numbers=(((1,), (0,)), ((), ()))))
    e3, (s,) = new_eqn(P.add, [a, d], {})
    g = Graph((), (x, w), (e1, e2, e3), (s,))
    regions = partition(g)
    check_regions(g, regions)
    assert [r.kind for r in regions] == ["fused", "dot_general", "fused"]
    args = [np.random.default_rng(1).standard_normal((4, 4)).astype(F32) for _ in range(2)]
    _, (out,) = run_compiled(g, args)
    assert_close(out, ref_eval(g, args)[0], rtol=1e-5)


def test_diamond_through_a_reduction_is_not_fused_into_a_cycle():
    """exp(x + y) feeds both the column sum and the division by it: one region holding exp and
    the division would feed the sum and read from it. (Two full-size inputs: not worth copying;
    columns are strided rows: no row kernel.)"""
    f = lambda x, y: tnp.exp(x + y) / tnp.sum(tnp.exp(x + y), axis=0, keepdims=True)  # noqa: E731
    g = run_passes(tx.make_graph(f)(np.ones((3, 5), F32), np.ones((3, 5), F32)))
    regions = partition(g)
    check_regions(g, regions)
    region_of = {o.id: k for k, r in enumerate(regions) for e in r.eqns for o in e.outputs}
    (exp,) = [e for e in g.eqns if e.prim.name == "exp"]
    (div,) = [e for e in g.eqns if e.prim.name == "div"]
    (red,) = [e for e in g.eqns if e.prim.name == "reduce_sum"]
    assert region_of[red.outputs[0].id] not in (region_of[exp.outputs[0].id], region_of[div.outputs[0].id])
    assert len(regions) == 3
    args = [np.random.default_rng(2).standard_normal((3, 5)).astype(F32) for _ in range(2)]
    _, (out,) = run_compiled(g, args)
    assert_close(out, ref_eval(g, args)[0], rtol=1e-5)


def test_softmax_is_one_row_kernel_that_recomputes_exp():
    """max, then sum(exp(x - max)), then exp(x - max) / sum: one kernel walking each row three
    times (two reduction levels, then the row store); exp is recomputed, not stored, and the only
    array written is the result."""
    g = run_passes(tx.make_graph(lambda x: softmax_rows(x))(np.ones((4, 6), F32)))
    regions = partition(g)
    check_regions(g, regions)
    (region,) = regions
    assert region.meta.get("rows") and sum(e.prim.name == "exp" for e in region.eqns) == 2
    (lowered,) = lower_region(region)
    k = lowered.kernel
    assert k.shape == (4,) and k.reduce_shape == (6,) and len(k.stores) == len(k.row_stores) == 1
    assert [[n.arg for n in level] for level in reduce_levels([k.stores[0].value])] == [["max"], ["sum"]]
    x = np.random.default_rng(3).standard_normal((4, 6)).astype(F32)
    _, (out,) = run_compiled(g, [x])
    assert_close(out, ref_eval(g, [x])[0], rtol=1e-5)


def softmax_rows(x):
    e = tnp.exp(x - tnp.max(x, axis=1, keepdims=True))
    return e / tnp.sum(e, axis=1, keepdims=True)


def test_backward_residuals_are_recomputed_not_written():
    """gelu between two matmuls, differentiated: the backward pass (after a matmul of its own)
    needs x*x, tanh(...) and 1 + tanh(...) of the forward's x; it recomputes them from x (read
    anyway), so the forward's kernel writes its result only, and the gradients are right."""
    from tilefuse import nn
    rng = np.random.default_rng(4)
    a, b, c = (rng.standard_normal(s).astype(F32) for s in ((8, 16), (16, 32), (32, 4)))

    def loss(a, b, c):
        return ((nn.gelu(tnp.matmul(a, b)) @ c) ** 2).sum()
    g = run_passes(tx.make_graph(tx.grad(loss, argnums=(0, 1, 2)))(a, b, c))
    regions = partition(g)
    check_regions(g, regions)
    (forward,) = [r for r in regions if r.kind == "fused" and any(e.prim.name == "tanh" for e in r.eqns)
                  and not any(e.prim.name == "sub" for e in r.eqns)]  # the derivative's 1 - t*t
    assert len(forward.outputs) == 1, forward
    want = ref_eval(g, [a, b, c])
    _, got = run_compiled(g, [a, b, c])
    for x, y in zip(got, want):
        assert_close(x, y, rtol=1e-4, atol=1e-5 * float(np.abs(y).max()))


def test_layernorm_is_one_row_kernel():
    def layernorm(x):
        mu = tnp.mean(x, axis=-1, keepdims=True)
        var = tnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
        return (x - mu) / tnp.sqrt(var + 1e-5)
    g = run_passes(tx.make_graph(layernorm)(np.ones((4, 8), F32)))
    regions = partition(g)
    check_regions(g, regions)
    (region,) = regions  # mean; variance (with the mean's division); normalise: one row kernel
    assert region.meta.get("rows")
    x = np.random.default_rng(4).standard_normal((4, 8)).astype(F32)
    _, (out,) = run_compiled(g, [x])
    assert_close(out, ref_eval(g, [x])[0], rtol=1e-5, atol=1e-5)


def test_reduction_takes_its_producers_and_an_epilogue():
    f = lambda x: tnp.sum(tnp.tanh(x * 2.0), axis=1) / 7.0 + 1.0  # noqa: E731
    g = run_passes(tx.make_graph(f)(np.ones((3, 7), F32)))
    (region,) = partition(g)
    names = [e.prim.name for e in region.eqns if e.prim.name != "broadcast_in_dim"]
    assert names == ["mul", "tanh", "reduce_sum", "div", "add"]


def test_a_broadcast_literal_fuses_into_each_consumer():
    """A constant used by two kernels is recomputed in both, never written to memory."""
    def f(x, w):
        c = tnp.full((4, 4), 3.0)
        return (x * c) @ w, tnp.sum(c * w, axis=0)
    args = [np.ones((4, 4), F32), np.arange(16, dtype=F32).reshape(4, 4)]
    g = run_passes(tx.make_graph(f)(*args))
    regions = partition(g)
    alone = [r for r in regions if [e.prim.name for e in r.eqns] == ["broadcast_in_dim"]]
    assert not alone
    _, outs = run_compiled(tx.make_graph(f)(*args), args)
    for o, w in zip(outs, ref_eval(g, args)):
        assert_close(o, w)


def _random_graph(rng, n_eqns=24):
    """A random DAG over shapes (4,3), (3,), (4,) and (3,3): elementwise ops, broadcasts,
    reductions, transposes and GEMMs, so that many fusion opportunities meet many diamonds."""
    shapes = {"A": (4, 3), "B": (3,), "C": (4,), "D": (3, 3)}
    pool = {k: [Var(ShapedArray(s, F32))] for k, s in shapes.items()}
    invars = [vs[0] for vs in pool.values()]
    eqns = []

    def pick(k):
        return pool[k][rng.integers(len(pool[k]))]

    def emit(prim, ins, **params):
        e, (o,) = new_eqn(prim, ins, params)
        eqns.append(e)
        pool[next(k for k, s in shapes.items() if s == o.aval.shape)].append(o)
    for _ in range(n_eqns):
        op = rng.integers(8)
        k = list(shapes)[rng.integers(4)]
        if op == 0:
            emit([P.tanh, P.neg, P.sin][rng.integers(3)], [pick(k)])
        elif op in (1, 2):
            emit([P.add, P.mul, P.sub][rng.integers(3)], [pick(k), pick(k)])
        elif op == 3:
            emit(P.reduce_sum, [pick("A")], axes=(int(rng.integers(2)),))
        elif op == 4:
            if rng.integers(2):
                emit(P.broadcast_in_dim, [pick("B")], shape=(4, 3), broadcast_dimensions=(1,))
            else:
                emit(P.broadcast_in_dim, [pick("C")], shape=(4, 3), broadcast_dimensions=(0,))
        elif op == 5:
            emit(P.dot_general, [pick("A"), pick("D")], dimension_numbers=(((1,), (0,)), ((), ())))
        elif op == 6:
            emit(P.transpose, [pick("D")], permutation=(1, 0))
        else:
            emit(P.add, [pick("A"), pick("A")])
    outs = [eqns[-1].outputs[0]] + [e.outputs[0] for e in eqns[:-1] if rng.random() < 0.2]
    return dce(Graph((), tuple(invars), tuple(eqns), tuple(outs)))


@pytest.mark.parametrize("seed", range(30))
def test_random_graphs_fuse_without_cycles_and_compute_the_same(seed):
    rng = np.random.default_rng(seed)
    g = _random_graph(rng)
    regions = partition(g)
    check_regions(g, regions)
    assert len(regions) <= len(g.eqns)
    args = [rng.uniform(-1, 1, v.aval.shape).astype(F32) for v in g.invars]
    _, outs = run_compiled(g, args)
    for o, w in zip(outs, ref_eval(g, args)):
        assert_close(o, w, rtol=1e-5, atol=1e-5)


def test_random_graphs_fuse_a_lot():
    graphs = [_random_graph(np.random.default_rng(seed)) for seed in range(30)]
    n_eqns = sum(len(g.eqns) for g in graphs)
    n_regions = sum(len(partition(g)) for g in graphs)
    assert n_regions < 0.6 * n_eqns, (n_regions, n_eqns)


def test_region_inputs_and_outputs():
    x = Var(ShapedArray((3,), F32))
    e1, (a,) = new_eqn(P.exp, [x], {})
    e2, (b,) = new_eqn(P.mul, [a, a], {})
    e3, (s,) = new_eqn(P.reduce_sum, [b], dict(axes=(0,)))
    g = Graph((), (x,), (e1, e2, e3), (s, a))
    # a is a graph output of shape (3,), s of shape (): one fused kernel cannot hold both...
    regions = partition(g)
    assert [r.outputs for r in regions] == [(a, s)] and regions[0].inputs == (x,)
    # ...one row kernel can (a row store and a store per row); without row merges, two kernels
    p = _Partitioner(g, list(g.eqns))
    p.run()
    regions = p.regions()
    assert len(regions) == 2
    assert regions[0].outputs == (a,) and regions[0].inputs == (x,)
    assert regions[1].inputs == (a,) and regions[1].outputs == (s,)


# ---- long chains --------------------------------------------------------------------------------

def _chain(x, n):
    for _ in range(n):
        x = x * 1.001 + 0.001
    return x


def _tree_sum(x, n):
    terms = [x * float(i + 1) for i in range(n)]
    while len(terms) > 1:  # pairwise: n products, n - 1 adds, about log2(n) deep
        terms = [a + b for a, b in zip(terms[::2], terms[1::2])] + terms[len(terms) // 2 * 2:]
    return terms[0]


def _longest_chain(region) -> int:
    from tilefuse.ir.passes.fusion import INDEX_MAPS
    depth = {}
    for e in region.eqns:
        d = (e.prim.name not in INDEX_MAPS) + max((depth.get(a.id, 0) for a in e.inputs if isinstance(a, Var)),
                                                   default=0)
        for o in e.outputs:
            depth[o.id] = d
    return max(depth.values())


def test_a_long_chain_is_cut_into_kernels_of_max_chain_operations():
    """A 3000-operation chain (a Python loop) exceeded the recursion limit when lowered as one
    kernel; now it is a kernel per MAX_CHAIN operations. A wide region of shallow chains (a
    pairwise sum of 256 products: 511 operations, 9 deep) stays one kernel."""
    from tilefuse.ir.passes.fusion import MAX_CHAIN
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    regions = partition(run_passes(tx.make_graph(lambda x: _chain(x, 1500))(x)))
    assert len(regions) == -(-3000 // MAX_CHAIN)
    assert all(_longest_chain(r) <= MAX_CHAIN for r in regions)
    wide = partition(run_passes(tx.make_graph(lambda x: _tree_sum(x, 256))(x)))
    assert len(wide) == 1 and _longest_chain(wide[0]) == 9


def test_a_long_chain_computes_right(device):
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    want = x.astype(np.float64)
    for _ in range(250):
        want = want * 1.001 + 0.001
    got = tx.jit(lambda x: _chain(x, 250), device=device)(x)  # 500 operations: 4 kernels
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4)


def test_a_region_reads_and_writes_at_most_max_buffers_arrays(device):
    """Devices bind a bounded number of buffers per kernel (WebGPU: 8 to a few dozen), so a sum
    of 40 arguments is cut into kernels of at most MAX_BUFFERS arrays, and still sums right."""
    from tilefuse.ir.passes.fusion import MAX_BUFFERS

    def many(*xs):
        return sum(x * float(i + 1) for i, x in enumerate(xs))

    xs = [np.full(8, float(i), np.float32) for i in range(40)]
    regions = partition(run_passes(tx.make_graph(many)(*xs)))
    assert len(regions) > 1
    assert all(len(r.inputs) + len(r.outputs) <= MAX_BUFFERS for r in regions)
    want = sum(x.astype(np.float64) * (i + 1) for i, x in enumerate(xs))
    np.testing.assert_allclose(np.asarray(tx.jit(many, device=device)(*xs)), want, rtol=1e-6)
