"""Fusion: partition an optimised graph into regions, each of which lowers to one kernel (or,
for a few primitives, a short fixed sequence of kernels).

A fused region groups elementwise primitives, index maps (broadcast_in_dim, reshape, transpose,
slice, rev, iota) and at most one reduction, which is trailing: after it come only elementwise
operations of the reduction's output shape (an epilogue such as sum/n). All outputs of a region
share one shape, the kernel's index space. Every other primitive is a region of its own; an
effectful one (debug_print) is a host step.

Regions grow greedily, producer into consumer, from the last equation back. A merge is refused
when it would create a cycle between regions (some other region on a path between the two):
the region graph stays a DAG, checked with networkx."""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from ..core import Eqn, Graph, Literal, Var

INDEX_MAPS = frozenset({"broadcast_in_dim", "reshape", "transpose", "slice", "rev", "iota"})
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})
# cheap producers that are recomputed in each consumer rather than shared through memory
_SOURCES = frozenset({"iota", "broadcast_in_dim"})


def is_elementwise(e: Eqn) -> bool:
    return e.prim.elementwise and not e.prim.effectful


def is_fusible(e: Eqn) -> bool:
    return is_elementwise(e) or e.prim.name in INDEX_MAPS or e.prim.name in REDUCTIONS


@dataclass(frozen=True, eq=False)
class Region:
    """A group of equations that lowers together. `inputs` are the variables it reads from
    outside, `outputs` those it defines that are read outside or are graph outputs.
    kind: "fused" (a fusion region), "host" (an effectful host step) or the primitive's name."""
    eqns: tuple
    inputs: tuple
    outputs: tuple
    kind: str
    meta: dict = field(default_factory=dict)

    @property
    def reduction(self) -> Eqn | None:
        return next((e for e in self.eqns if e.prim.name in REDUCTIONS), None)

    def __str__(self):
        ops = " ".join(e.prim.name for e in self.eqns)
        return f"region {self.kind} [{ops}] in={[str(v.aval) for v in self.inputs]} " \
               f"out={[str(v.aval) for v in self.outputs]}"


def _split_sources(eqns: list[Eqn]) -> list[Eqn]:
    """Give each consumer of a literal broadcast or an iota its own copy, so the producer fuses
    into every consumer instead of being written to memory once and read back."""
    uses: dict[int, int] = {}
    for e in eqns:
        for a in e.inputs:
            if isinstance(a, Var):
                uses[a.id] = uses.get(a.id, 0) + 1
    sources = {e.outputs[0].id: e for e in eqns
               if e.prim.name in _SOURCES and all(isinstance(a, Literal) for a in e.inputs)
               and uses.get(e.outputs[0].id, 0) > 1}
    out = []
    for e in eqns:
        if e.outputs and e.outputs[0].id in sources:
            out.append(e)  # the original stays for a graph output; else the partitioner drops it
            continue
        copies: dict[int, Var] = {}
        for a in e.inputs:
            src = sources.get(getattr(a, "id", None))
            if src is not None and a.id not in copies:
                copies[a.id] = Var(a.aval)
                out.append(src.replace(outputs=(copies[a.id],)))
        inputs = tuple(copies.get(getattr(a, "id", None), a) for a in e.inputs)
        out.append(e.replace(inputs=inputs) if copies else e)
    return out


class _Partitioner:
    def __init__(self, graph: Graph, eqns: list[Eqn]):
        self.eqns = eqns
        self.graph_out = {v.id for v in graph.outvars if isinstance(v, Var)}
        self.producer: dict[int, int] = {}
        self.consumers: dict[int, set[int]] = {}
        for i, e in enumerate(eqns):
            for o in e.outputs:
                self.producer[o.id] = i
            for a in e.inputs:
                if isinstance(a, Var):
                    self.consumers.setdefault(a.id, set()).add(i)
        self.group = list(range(len(eqns)))
        self.members: dict[int, list[int]] = {i: [i] for i in range(len(eqns))}
        self.dag = nx.DiGraph()
        self.dag.add_nodes_from(range(len(eqns)))
        for i, e in enumerate(eqns):
            for a in e.inputs:
                j = self.producer.get(getattr(a, "id", None))
                if j is not None:
                    self.dag.add_edge(j, i)
        effects = [i for i, e in enumerate(eqns) if e.prim.effectful]
        self.dag.add_edges_from(zip(effects, effects[1:]))  # effects stay in program order
        # drop the unused originals of split sources (they have no consumer and are no output)
        self.dead = {i for i, e in enumerate(eqns) if not e.prim.effectful and all(
            o.id not in self.graph_out and not self.consumers.get(o.id) for o in e.outputs)}

    # ---- questions about groups ----
    def outputs(self, members: set[int]) -> list[Var]:
        outs = []
        for i in members:
            for o in self.eqns[i].outputs:
                if o.id in self.graph_out or any(c not in members for c in self.consumers.get(o.id, ())):
                    outs.append(o)
        return outs

    def _reaches(self, src: int, dst: int) -> bool:
        """Whether a path of two or more edges leads from group src to group dst."""
        starts = [s for s in self.dag.successors(src) if s != dst]
        seen = set(starts)
        while starts:
            n = starts.pop()
            if n == dst:
                return True
            for s in self.dag.successors(n):
                if s not in seen:
                    seen.add(s)
                    starts.append(s)
        return False

    def creates_cycle(self, a: int, b: int) -> bool:
        """Whether merging groups a and b closes a cycle: some other group lies on a path
        between them (in either direction)."""
        return self._reaches(a, b) or self._reaches(b, a)

    def valid(self, members: set[int]) -> bool:
        """A region lowers to one kernel: one index space (all outputs share a shape) and at
        most one reduction, followed only by elementwise operations of its output shape."""
        reductions = [i for i in members if self.eqns[i].prim.name in REDUCTIONS]
        if len(reductions) > 1:
            return False
        shapes = {o.aval.shape for o in self.outputs(members)}
        if len(shapes) != 1:
            return False
        if reductions:
            out = self.eqns[reductions[0]].outputs[0]
            if shapes != {out.aval.shape}:
                return False
            frontier, seen = [out], set()
            while frontier:  # everything downstream of the reduction inside the region
                v = frontier.pop()
                for c in self.consumers.get(v.id, ()):
                    if c in members and c not in seen:
                        seen.add(c)
                        e = self.eqns[c]
                        if not is_elementwise(e) or e.outputs[0].aval.shape != out.aval.shape:
                            return False
                        frontier.extend(e.outputs)
        return True

    def can_merge(self, p: int, c: int) -> bool:
        return self.valid(set(self.members[p]) | set(self.members[c])) and not self.creates_cycle(p, c)

    def merge(self, p: int, c: int) -> None:
        for i in self.members[p]:
            self.group[i] = c
        self.members[c] += self.members.pop(p)
        for q in list(self.dag.predecessors(p)):
            if q != c:
                self.dag.add_edge(q, c)
        for s in list(self.dag.successors(p)):
            if s != c:
                self.dag.add_edge(c, s)
        self.dag.remove_node(p)

    def run(self) -> None:
        # consumers first (as XLA does): a producer joins the region of its last consumer, and a
        # value read by one consumer only is never written to memory
        for i in reversed(range(len(self.eqns))):
            e = self.eqns[i]
            if not is_fusible(e) or i in self.dead:
                continue
            for a in e.inputs:
                j = self.producer.get(getattr(a, "id", None))
                if j is None or not is_fusible(self.eqns[j]):
                    continue
                p, c = self.group[j], self.group[i]
                if p != c and self.can_merge(p, c):
                    self.merge(p, c)

    def regions(self) -> list[Region]:
        for g in list(self.members):
            if all(i in self.dead for i in self.members[g]):
                self.members.pop(g)
                self.dag.remove_node(g)
        assert nx.is_directed_acyclic_graph(self.dag), "fusion created a cycle between regions"
        out = []
        for g in nx.lexicographical_topological_sort(self.dag, key=lambda g: min(self.members[g])):
            idx = sorted(self.members[g])
            eqns = tuple(self.eqns[i] for i in idx)
            defined = {o.id for e in eqns for o in e.outputs}
            inputs: dict[int, Var] = {}
            for e in eqns:
                for a in e.inputs:
                    if isinstance(a, Var) and a.id not in defined:
                        inputs.setdefault(a.id, a)
            out_ids = {o.id for o in self.outputs(set(idx))}
            outputs = tuple(o for e in eqns for o in e.outputs if o.id in out_ids)
            if all(is_fusible(e) for e in eqns):
                kind = "fused"
            else:
                assert len(eqns) == 1
                kind = "host" if eqns[0].prim.effectful else eqns[0].prim.name
            out.append(Region(eqns, tuple(inputs.values()), outputs, kind))
        return out


def partition(graph: Graph, fuse: bool = True) -> list[Region]:
    """The graph's equations grouped into regions, in an order that respects their data flow
    (and keeps effects in program order). With fuse=False each equation is its own region."""
    eqns = _split_sources(list(graph.eqns)) if fuse else list(graph.eqns)
    p = _Partitioner(graph, eqns)
    if fuse:
        p.run()
    return p.regions()
