"""Compile time linear in the program (issue 24): the fusion partitioner answers what a merge
asks from per-group summaries, its cycle searches stop early, and the buffer planner is
vectorised. These tests check that the summaries are what walking the members gives, that the
planner places exactly as the plain greedy loop does, and that the partitioner's work grows
linearly with a gradient's length (counted, not timed)."""
from __future__ import annotations

import random

import numpy as np
import pytest
from test_fusion import _random_graph
from tilefuse.ir.core import Var
from tilefuse.ir.passes import fusion, run_passes
from tilefuse.runtime.planner import ALIGN, Interval, align_up, plan_buffers

import tilefuse as tx
import tilefuse.numpy as tnp


def _tanh_chain_grad_graph(n: int):
    def f(x):
        for _ in range(n):
            x = tnp.tanh(x * 0.999 + 0.001)
        return tnp.sum(x)
    return run_passes(tx.make_graph(tx.grad(f))(np.linspace(0, 1, 16, dtype=np.float32)))


def _longest_chain(p: fusion._Partitioner, members) -> int:
    depth = {}
    for i in sorted(members):
        e = p.eqns[i]
        depth[i] = p._weight(e)[0] + max((depth.get(p.producer.get(a.id), 0) for a in e.inputs
                                       if isinstance(a, Var)), default=0)
    return max(depth.values())


@pytest.mark.parametrize("which", ["random", "gradient"])
def test_group_summaries_match_their_members(which):
    graphs = [_random_graph(np.random.default_rng(s), n_eqns=40) for s in range(12)] if which == "random" \
        else [_tanh_chain_grad_graph(60)]
    for g in graphs:
        p = fusion._Partitioner(g, list(g.eqns))
        p.run()
        p.run_rows()
        for gid, members in p.members.items():
            ms = set(members)
            assert set(p.outs[gid]) == {o.id for o in p.outputs(ms)}
            assert p.group_buffers(gid) == p.buffers(ms)
            assert p.height[gid][0] == _longest_chain(p, ms) == max(p.below[i][0] for i in ms)
            assert len(p.reds[gid]) == sum(p.eqns[i].prim.name in fusion.REDUCTIONS for i in ms)
        assert all(p.pos[u] < p.pos[v] for u, v in p.dag.edges)


def _plain_greedy(buffers, align=ALIGN):
    """The planner as first written: for each buffer, a loop over every one placed before."""
    placed, offsets = [], {}
    for b in sorted(buffers, key=lambda b: (-b.nbytes, b.start, b.end)):
        busy = sorted((off, off + o.nbytes) for off, o in placed if o.nbytes and b.overlaps_in_time(o))
        off = 0
        for lo, hi in busy:
            if off + b.nbytes <= lo:
                break
            off = max(off, align_up(hi, align))
        placed.append((off, b))
        offsets[b.key] = off
    arena = max((off + b.nbytes for off, b in placed), default=0)
    return offsets, align_up(arena, align)


def test_planner_places_as_the_plain_greedy_loop():
    rng = random.Random(0)
    for _ in range(300):
        steps = rng.randint(1, 20)
        bufs = []
        for i in range(rng.randint(0, 30)):
            s = rng.randint(0, steps)
            bufs.append(Interval(i, rng.choice([0, 4, 64, 100, 4096, rng.randint(1, 5000)]), s,
                                 rng.randint(s, steps)))
        plan = plan_buffers(bufs)
        assert (plan.offsets, plan.arena_bytes) == _plain_greedy(bufs)
        assert plan.total_bytes == sum(b.nbytes for b in bufs)


class _CountingDict(dict):
    visits = 0

    def __getitem__(self, k):
        _CountingDict.visits += 1
        return dict.__getitem__(self, k)


def test_partition_work_grows_linearly_with_a_gradient(monkeypatch):
    """A gradient's forward values each feed its backward pass: cycle searches and position
    updates that walked the forward pass behind each of them made fusion quadratic (5,000 tanh
    steps: 150 s). Count the region graph's adjacency lookups for 100 and 800 steps."""
    class CountingDag(fusion._Dag):
        def __init__(self, n):
            super().__init__(n)
            self.succ, self.pred = _CountingDict(self.succ), _CountingDict(self.pred)
    monkeypatch.setattr(fusion, "_Dag", CountingDag)
    work = []
    for n in (100, 800):
        g = _tanh_chain_grad_graph(n)
        _CountingDict.visits = 0
        fusion.partition(g)
        work.append(_CountingDict.visits / len(g.eqns))
    assert work[1] < 1.5 * work[0], work  # per equation: flat (it grew 2.5x when quadratic)


def test_a_long_chain_of_index_maps_is_cut_and_computes_right(device):
    """Index maps count for no operation in MAX_CHAIN, but lowering recurses through them: a
    Python loop of 1,000 x[None][0]-style steps hit the recursion limit. Regions now also keep
    within MAX_DEPTH equations one after another."""
    def f(x):
        for i in range(400):
            x = tnp.broadcast_to(x[None], (2, *x.shape))[i % 2] * 1.0
        return x
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    regions = fusion.partition(run_passes(tx.make_graph(f)(x)))
    assert len(regions) > 1
    for r in regions:
        depth = {}
        for e in r.eqns:
            d = 1 + max((depth.get(a.id, 0) for a in e.inputs if isinstance(a, Var)), default=0)
            depth.update((o.id, d) for o in e.outputs)
        assert max(depth.values()) <= fusion.MAX_DEPTH
    np.testing.assert_array_equal(np.asarray(tx.jit(f, device=device)(x)), x)


def test_printing_a_kernel_walks_each_shared_node_once(monkeypatch):
    """Stores that share a long subexpression (index arithmetic, a GEMM's addresses): the walks
    that print a tile kernel's key and order its nodes take each node once in all (they took the
    shared part again for every store: quadratic), operands first, and skip what is done."""
    from tilefuse.ir.kernel.ir import INDEX, Buffer, KExpr, binary, const, walk
    from tilefuse.ir.kernel.tile import Range, Store, TileKernel, pp_tile, var
    chain = [var("g")]
    for i in range(2000):
        chain.append(binary("add", chain[-1], const(i + 1, INDEX)))
    roots = [binary("mul", chain[-1], const(k, INDEX)) for k in range(2, 60)]
    order = walk(roots)
    assert len(order) == len(set(order)) == len(set(n for r in roots for n in r.toposort()))
    at = {n: i for i, n in enumerate(order)}
    assert all(at[s] < at[n] for n in order for s in n.src)
    assert roots[1].toposort(set(roots[0].toposort())) == [roots[1]]  # (const(3) is in the chain)

    visited = [0]
    toposort = KExpr.toposort

    def counting(self, done=()):
        out = toposort(self, done)
        visited[0] += len(out)
        return out
    monkeypatch.setattr(KExpr, "toposort", counting)
    body = (Range("g", 4, "grid", tuple(Store(0, binary("rem", r, const(4, INDEX)), const(1.0, np.float32))
                                         for r in roots)),)
    text = pp_tile(TileKernel("t", (Buffer("out0", np.dtype(np.float32), 4),), 0, body))
    assert text.count("out0[") == len(roots)
    assert visited[0] <= 2 * len(order)
