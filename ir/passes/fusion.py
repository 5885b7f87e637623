"""Fusion: partition an optimised graph into regions, each of which lowers to one kernel (or,
for a few primitives, a short fixed sequence of kernels).

A fused region groups elementwise primitives, index maps (broadcast_in_dim, reshape, transpose,
slice, rev, iota) and at most one reduction, which is trailing: after it come only elementwise
operations of the reduction's output shape (an epilogue such as sum/n). All outputs of a region
share one shape, the kernel's index space. Every other primitive is a region of its own (a
concatenate or pad with the index maps only it reads, which its kernels read through); an
effectful one (debug_print) is a host step.

Before grouping, cheap producers are copied where that keeps values out of memory: index maps
go to each consumer, and every fusible consumer of a shared elementwise value gets its own copy
of its producers when they read one full-size array (softmax: max, sum(exp(x - max)),
exp(x - max) / sum; the residuals a backward pass reads, recomputed from the forward's input).
Regions then grow greedily, producer into consumer, from the last equation back. A merge is
refused when it would create a cycle between regions (some other region on a path between the
two): the region graph stays a DAG, checked with networkx. It is refused too when the region's
longest chain of operations would pass MAX_CHAIN (or of equations, index maps included,
MAX_DEPTH): the lowering builds a kernel's expressions recursively, and a chain of thousands of
operations (a Python loop of x = x * a + b) exceeded Python's recursion limit; such a chain
becomes a kernel per MAX_CHAIN operations.

Then row merges: regions that reduce the trailing axes of one array shape (a row space), with
what reads their results along the rows, become one *row kernel* (softmax, layer norm, RMSNorm
and their gradients): it walks each row once per reduction level and once more for the values
it writes, while the row is in cache, instead of one kernel (and one trip through memory) each."""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

from ..core import Eqn, Graph, Var
from ..kernel import lower
from ..primitives import has_effect
from ..symbolic import distinct, index_hints, is_symbolic

INDEX_MAPS = frozenset({"broadcast_in_dim", "reshape", "transpose", "slice", "rev", "iota",
                        "dynamic_slice"})  # (its start indices: scalars the kernel loads)
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})
# primitives whose kernels read their operands through index maps fused into their region
# (conv2d's im2col: strided windows concatenated, and their transposes padded back)
READS_THROUGH_MAPS = frozenset({"concatenate", "pad"})


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


def _copy_index_maps(eqns: list[Eqn]) -> list[Eqn]:
    """Give each consumer of an index map (a broadcast, reshape, transpose, slice, rev or iota)
    its own copy when all its consumers can fuse it: recomputing one is index arithmetic, so it
    joins every consumer instead of being written to memory and read back. Chains of index maps
    are copied whole."""
    for _ in range(8):  # one more link of a chain per sweep; chains are short
        users: dict[int, list[Eqn]] = {}
        for e in eqns:
            for a in e.inputs:
                if isinstance(a, Var):
                    users.setdefault(a.id, []).append(e)
        # only when every consumer can fuse it: a GEMM's operand is written to memory anyway
        shared = {e.outputs[0].id: e for e in eqns if e.prim.name in INDEX_MAPS and
                  len(users.get(e.outputs[0].id, ())) > 1 and all(map(is_fusible, users[e.outputs[0].id]))}
        if not shared:
            break
        out = []
        for e in eqns:
            copies: dict[int, Var] = {}
            for a in e.inputs:
                src = shared.get(getattr(a, "id", None))
                if src is not None and a.id not in copies:
                    copies[a.id] = Var(a.aval)
                    out.append(src.replace(outputs=(copies[a.id],)))
            # the original stays (for a graph output; the partitioner drops it if unused)
            out.append(e.replace(inputs=tuple(copies.get(getattr(a, "id", None), a) for a in e.inputs))
                       if copies else e)
        eqns = out
    return eqns


# row merges need rows to share among threads, unless the whole space is small
MAX_CHAIN = 128  # operations one after another in one region (see the module docstring)
# equations one after another, index maps included: lowering recurses through those too (a
# Python loop of 3,000 flips or x[None][0] hit the recursion limit with index maps uncounted)
MAX_DEPTH = 256
# arrays one kernel reads and writes: devices bind a bounded number of buffers per kernel
# (WebGPU: 8 by default, 30 and more where the adapter allows; we ask for its most)
MAX_BUFFERS = 24
ROW_MIN_ROWS = 16
ROW_MAX_ALONE = 1 << 16
_CLONE_LIMIT = 16  # equations a reduction may copy from a shared producer


def _cone(v: Var, producer: dict, stored) -> list[Eqn] | None:
    """The elementwise/index-map equations that compute `v`, up to values `stored` in memory
    anyway, non-fusible producers, reductions and the operands of broadcasts (recomputing those
    per element would multiply their cost); None if more than _CLONE_LIMIT."""
    cone: dict[int, Eqn] = {}
    stack = [v]
    while stack:
        a = stack.pop()
        p = producer.get(a.id)
        if p is None or id(p) in cone or not is_fusible(p) or p.prim.name in REDUCTIONS or \
                (a is not v and stored(a)):
            continue
        cone[id(p)] = p
        if len(cone) > _CLONE_LIMIT:
            return None
        if p.prim.name != "broadcast_in_dim":
            stack.extend(x for x in p.inputs if isinstance(x, Var))
    return list(cone.values())


def _clone_shared_producers(eqns: list[Eqn], graph_out: set[int]) -> list[Eqn]:
    """A value that elementwise producers compute and several fusible consumers read is
    recomputed by each consumer (the producers copied) instead of being written to memory and
    read back: a reduction's operand (softmax's exp(x - max), layernorm's x - mean) and a
    backward pass's residuals (gelu's x * x, tanh(...) and 1 + tanh(...), which the forward
    kernel would write for the backward one to read, both recompute from the one input x).

    Only when the copy reads at most one array as large as the value: then recomputing costs
    fewer bytes (one read per consumer) than writing the value once and reading it twice."""
    producer = {o.id: e for e in eqns for o in e.outputs}
    consumers: dict[int, list[Eqn]] = {}
    for e in eqns:
        for a in e.inputs:
            if isinstance(a, Var):
                consumers.setdefault(a.id, []).append(e)

    @functools.cache
    def stored_id(vid: int) -> bool:
        return vid in graph_out or not all(map(is_fusible, consumers.get(vid, ())))

    def stored(a: Var) -> bool:  # a graph output, or read by a kernel that cannot fuse it
        return stored_id(a.id)

    def computed(v) -> bool:  # by an elementwise producer (index maps are copied on their own)
        p = producer.get(getattr(v, "id", None))
        return p is not None and is_elementwise(p)
    order = {id(e): i for i, e in enumerate(eqns)}
    out = []
    for e in eqns:
        if e.prim.name in REDUCTIONS:
            operands = [e.inputs[0]]
        elif is_elementwise(e):
            operands = [a for a in dict.fromkeys(e.inputs) if computed(a) and len(consumers[a.id]) > 1]
        else:
            operands = []
        copy: dict[int, Var] = {}
        for v in operands:
            cone = _cone(v, producer, stored) if isinstance(v, Var) and not stored(v) else None
            if not cone:
                continue
            cone.sort(key=lambda c: order[id(c)])
            ids = {o.id for c in cone for o in c.outputs}
            shared = any(id(u) != id(e) for o in ids for u in consumers.get(o, ()) if u.outputs and
                         u.outputs[0].id not in ids)
            reads = {a.id: a for c in cone for a in c.inputs if isinstance(a, Var) and a.id not in ids}
            if shared and sum(a.aval.size >= v.aval.size for a in reads.values()) <= 1:
                for c in cone:
                    if c.outputs[0].id in copy:  # shared with another operand's cone: copied already
                        continue
                    outs = tuple(Var(o.aval) for o in c.outputs)
                    copy.update((o.id, n) for o, n in zip(c.outputs, outs))
                    out.append(c.replace(inputs=tuple(copy.get(getattr(a, "id", None), a) for a in c.inputs),
                                         outputs=outs))
        if copy:
            e = e.replace(inputs=tuple(copy.get(getattr(a, "id", None), a) for a in e.inputs))
        out.append(e)
    return out


def _non_unit(shape) -> tuple:
    return tuple(n for n in shape if n != 1)


class _Dag:
    """The region graph while groups merge: successor and predecessor dicts (insertion-ordered,
    as networkx's, whose per-access views cost more than the searches that use them).
    `as_networkx()` hands the result to networkx for the final checks and order."""

    def __init__(self, n: int):
        self.succ: dict[int, dict] = {i: {} for i in range(n)}
        self.pred: dict[int, dict] = {i: {} for i in range(n)}

    def add_edge(self, u: int, v: int) -> None:
        self.succ[u][v] = None
        self.pred[v][u] = None

    def remove_node(self, n: int) -> None:
        for s in self.succ.pop(n):
            del self.pred[s][n]
        for q in self.pred.pop(n):
            del self.succ[q][n]

    @property
    def edges(self):
        return [(u, v) for u, vs in self.succ.items() for v in vs]

    def has_edge(self, u: int, v: int) -> bool:
        return v in self.succ.get(u, ())

    def as_networkx(self) -> "nx.DiGraph":
        import networkx as nx  # (here, not at the top: its import is half of `import tilefuse`'s)
        g = nx.DiGraph()
        g.add_nodes_from(self.succ)
        g.add_edges_from(self.edges)
        return g


class _Partitioner:
    def __init__(self, graph: Graph, eqns: list[Eqn], capped: frozenset[int] = frozenset()):
        self.eqns = eqns
        self.capped = capped  # equations whose regions must keep within MAX_BUFFERS (see partition)
        self.symbolic = any(is_symbolic(v.aval.shape) for v in graph.invars)  # (a template's graph)
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
        # per group: its longest chain, as (operations, equations): index maps count for no
        # operation, but for depth (MAX_CHAIN and MAX_DEPTH bound them)
        self.height = {i: self._weight(e) for i, e in enumerate(eqns)}
        self.rows: dict[int, list] = {}  # groups merged row-wise (run_rows): their kernels ([] at symbolic sizes)
        self.members: dict[int, list[int]] = {i: [i] for i in range(len(eqns))}
        self.dag = _Dag(len(eqns))
        for i, e in enumerate(eqns):
            for a in e.inputs:
                j = self.producer.get(getattr(a, "id", None))
                if j is not None:
                    self.dag.add_edge(j, i)
        effects = [i for i, e in enumerate(eqns) if has_effect(e)]
        for u, v in itertools.pairwise(effects):  # effects stay in program order
            self.dag.add_edge(u, v)
        # a topological position per group, kept valid across merges (Pearce-Kelly style): a
        # cycle search then only visits the groups placed between the two it would merge
        self.pos = {i: i for i in range(len(eqns))}
        self.reaches: dict[int, set[int]] = {}  # group -> groups known to reach it (creates_cycle)
        # equations nobody needs any more (originals of copied producers) are dropped
        live, self.dead = set(self.graph_out), set()
        for i in reversed(range(len(eqns))):
            e = eqns[i]
            if has_effect(e) or any(o.id in live for o in e.outputs):
                live.update(a.id for a in e.inputs if isinstance(a, Var))
            else:
                self.dead.add(i)
        for i in self.dead:  # gone before any merge: no region takes one, no value is kept for one
            self.members.pop(i)
            self.dag.remove_node(i)
        for users in self.consumers.values():
            users -= self.dead
        # What a merge asks of a union is answered from these summaries of the two groups, in time
        # proportional to their boundaries, not their sizes (a region of thousands of equations
        # made every merge walk it: quadratic). Per group: the values it writes (`outs`) and reads
        # (`reads`), its equations of no fused kind (`own`), its reductions, how many of its
        # equations are no index map and how many are capped; per equation, its longest chain of
        # operations to the end of its group (`below`), so a group's height is exact.
        self.outs: dict[int, dict] = {}
        self.reads: dict[int, dict] = {}
        self.own: dict[int, list] = {}
        self.reds: dict[int, list] = {}
        self.n_nonmap: dict[int, int] = {}
        self.n_capped: dict[int, int] = {}
        self.below: dict[int, tuple] = {}
        for i in self.members:
            e = eqns[i]
            self.outs[i] = {o.id: o for o in e.outputs
                            if o.id in self.graph_out or self.consumers.get(o.id)}
            self.reads[i] = {a.id: a for a in e.inputs if isinstance(a, Var)}
            self.own[i] = [] if is_fusible(e) else [i]
            self.reds[i] = [i] if e.prim.name in REDUCTIONS else []
            self.n_nonmap[i] = e.prim.name not in INDEX_MAPS
            self.n_capped[i] = i in capped
            self.below[i] = self.height[i]

    # ---- questions about groups ----
    def outputs(self, members: set[int]) -> list[Var]:
        """The values equations of `members` define that are read outside them or are graph outputs
        (walks the members: for a region once built; merges use union_outputs)."""
        outs = []
        for i in members:
            for o in self.eqns[i].outputs:
                if o.id in self.graph_out or any(c not in members for c in self.consumers.get(o.id, ())):
                    outs.append(o)
        return outs

    def union_outputs(self, p: int, c: int) -> dict:
        """outputs() of the union of groups p and c, from their own outputs: a value one of them
        writes stays written unless the other is its only reader."""
        group, out = self.group, {}
        for g in (p, c):
            for vid, v in self.outs[g].items():
                if vid in self.graph_out or any(group[j] != p and group[j] != c for j in self.consumers[vid]):
                    out[vid] = v
        return out

    def union_reads(self, p: int, c: int) -> dict:
        """The values the union of groups p and c reads from outside it."""
        group, producer = self.group, self.producer
        out = {}
        for g in (p, c):
            for vid, v in self.reads[g].items():
                j = producer.get(vid)
                if j is None or (group[j] != p and group[j] != c):
                    out[vid] = v
        return out

    def _walk(self, p: int, c: int, forward: bool):
        """Groups placed between p and c that p reaches (forward) or that reach c (backward), not
        through the edge p -> c: a generator that yields once per group it visits and returns
        the set (so that merge can walk both ways in step and stop at an empty one)."""
        lo, hi, pos = self.pos[p], self.pos[c], self.pos
        start, goal = (p, c) if forward else (c, p)
        step = (self.dag.succ if forward else self.dag.pred).__getitem__
        seen: set[int] = set()
        stack = [n for n in step(start) if n != goal]
        while stack:
            n = stack.pop()
            if n == goal or n in seen or not lo < pos[n] < hi:
                continue
            seen.add(n)
            stack.extend(step(n))
            yield
        return seen

    def creates_cycle(self, p: int, c: int) -> bool:
        """Whether merging producer group p into its consumer c closes a cycle: some other group
        lies on a path from p to c. Positions are topological, so such a group sits between.

        Two searches go in step, forward from p and backward from c, and the first to finish
        answers (the cost is the smaller of the two). Every group on a path the forward one finds
        (p too) is remembered as reaching c: merges only add paths, so that stays true, and the
        next producer of c that reaches one of them is answered at once (a gradient's forward
        values each feed its backward pass: without this, each searched the forward pass behind
        it again)."""
        searches = [self._reaches_forward(p, c), self._reaches_backward(p, c)]
        while True:
            for s in searches:
                try:
                    next(s)
                except StopIteration as stop:
                    return stop.value

    def _reaches_forward(self, p: int, c: int):
        lo, hi = self.pos[p], self.pos[c]
        known = self.reaches.setdefault(c, set())
        succ, pos = self.dag.succ, self.pos
        parent = {n: p for n in succ[p] if n != c}
        stack = list(parent)
        seen: set[int] = set()
        while stack:
            n = stack.pop()
            if n in seen or not lo < pos[n] < hi:
                continue
            seen.add(n)
            if n in known or c in succ[n]:
                while n != p:  # the path back to p
                    known.add(n)
                    n = parent[n]
                known.add(p)
                return True
            for m in succ[n]:
                if m not in seen:
                    parent[m] = n
                    stack.append(m)
            yield
        return False

    def _reaches_backward(self, p: int, c: int):
        lo, hi = self.pos[p], self.pos[c]
        pred, pos = self.dag.pred, self.pos
        stack = [n for n in pred[c] if n != p]
        seen: set[int] = set()
        while stack:
            n = stack.pop()
            if n in seen or not lo < pos[n] < hi:
                continue
            seen.add(n)
            if p in pred[n]:
                return True
            stack.extend(pred[n])
            yield
        return False

    def buffers(self, members: set[int]) -> int:
        """The arrays a region of these equations reads and writes."""
        made = {o.id for i in members for o in self.eqns[i].outputs}
        reads = {a.id for i in members for a in self.eqns[i].inputs if isinstance(a, Var) and a.id not in made}
        return len(reads) + len(self.outputs(members))

    def group_buffers(self, g: int) -> int:
        """buffers() of group g, from its summary."""
        return len(self.reads[g]) + len(self.outs[g])

    def valid(self, p: int, c: int) -> bool:
        """Whether the union of groups p and c lowers to one kernel: one index space (all outputs
        share a shape) and at most one reduction, followed only by elementwise operations of its
        output shape, reading and writing at most MAX_BUFFERS arrays. Or it is a concatenate or
        pad with index maps that only it reads."""
        outs = self.union_outputs(p, c)
        if self.n_capped[p] + self.n_capped[c] and len(self.union_reads(p, c)) + len(outs) > MAX_BUFFERS:
            return False
        own = self.own[p] + self.own[c]
        if own:
            if len(own) > 1:
                return False
            e = self.eqns[own[0]]
            return (e.prim.name in READS_THROUGH_MAPS and self.n_nonmap[p] + self.n_nonmap[c] == 1 and
                    outs.keys() == {o.id for o in e.outputs})
        reductions = self.reds[p] + self.reds[c]
        if len(reductions) > 1:
            return False
        shapes = distinct(o.aval.shape for o in outs.values())  # (not a set: symbolic sizes)
        if len(shapes) != 1:
            return False
        if reductions:
            out = self.eqns[reductions[0]].outputs[0]
            if shapes[0] != out.aval.shape:
                return False
            group, frontier, seen = self.group, [out], set()
            while frontier:  # everything downstream of the reduction inside the union
                v = frontier.pop()
                for j in self.consumers.get(v.id, ()):
                    if (group[j] == p or group[j] == c) and j not in seen:
                        seen.add(j)
                        e = self.eqns[j]
                        if not is_elementwise(e) or e.outputs[0].aval.shape != out.aval.shape:
                            return False
                        frontier.extend(e.outputs)
        return True

    def chain(self, p: int, c: int) -> tuple | None:
        """The longest chain in the union of producer group p and its consumer group c, as
        (operations, equations), None past MAX_CHAIN or MAX_DEPTH. Nothing of c reaches p (groups
        form a DAG), so only p's equations get longer chains below them in the union: each one's
        weight plus the longest below its readers there (`_below`, in time proportional to p)."""
        ops, depth = self.height[c]
        for o, d in self._below(p, c).values():
            ops, depth = max(ops, o), max(depth, d)
        return (ops, depth) if ops <= MAX_CHAIN and depth <= MAX_DEPTH else None

    def _below(self, p: int, c: int) -> dict[int, tuple]:
        """The longest chain from each equation of p to the end of the union of p and c."""
        group, below, new = self.group, self.below, {}
        for i in sorted(self.members[p], reverse=True):  # equations are in data-flow order
            ops = depth = 0
            for o in self.eqns[i].outputs:
                for j in self.consumers.get(o.id, ()):
                    g = group[j]
                    if g == p or g == c:
                        o_j, d_j = new[j] if g == p else below[j]
                        ops, depth = max(ops, o_j), max(depth, d_j)
            w = self._weight(self.eqns[i])
            new[i] = (w[0] + ops, w[1] + depth)
        return new

    @staticmethod
    def _weight(e: Eqn) -> tuple:
        return (0 if e.prim.name in INDEX_MAPS else 1, 1)

    def can_merge(self, p: int, c: int) -> tuple | None:
        """The union's longest chain when p and c can merge, else None."""
        if not self.valid(p, c):
            return None
        h = self.chain(p, c)
        return None if h is None or self.creates_cycle(p, c) else h

    def merge(self, p: int, c: int, height: tuple) -> None:
        self.below.update(self._below(p, c))
        self.outs[c], self.reads[c] = self.union_outputs(p, c), self.union_reads(p, c)
        self.own[c] += self.own.pop(p)
        self.reds[c] += self.reds.pop(p)
        self.n_nonmap[c] += self.n_nonmap.pop(p)
        self.n_capped[c] += self.n_capped.pop(p)
        del self.outs[p], self.reads[p]
        if p in self.reaches:
            self.reaches.setdefault(c, set()).update(self.reaches.pop(p))
        self.height[c] = height
        del self.height[p]
        for i in self.members[p]:
            self.group[i] = c
        self.members[c] += self.members.pop(p)
        self._place(p, c)
        del self.pos[p]
        for q in list(self.dag.pred[p]):
            if q != c:
                self.dag.add_edge(q, c)
        for s in list(self.dag.succ[p]):
            if s != c:
                self.dag.add_edge(c, s)
        self.dag.remove_node(p)

    def _place(self, p: int, c: int) -> None:
        """Keep positions topological when p joins c: what reaches c goes before the merged
        group, what p reaches after it, each in its old order, in the positions they held
        together. The two walks go in step: when one side is empty (a gradient's forward value
        joining its backward use: p reaches the rest of the forward pass, nothing between reaches
        c), the merged group takes p's place or keeps c's, and the other side is never walked."""
        walks = {True: self._walk(p, c, True), False: self._walk(p, c, False)}
        found: dict[bool, set] = {}
        while len(found) < 2:
            for side, walk in list(walks.items()):
                try:
                    next(walk)
                except StopIteration as stop:
                    found[side] = stop.value
                    del walks[side]
                    if not stop.value:  # nothing to move on this side
                        if not side:  # nothing between reaches c: c may go where p was
                            self.pos[c] = self.pos[p]
                        return
        after, before = found[True], found[False]
        pool = sorted([self.pos[p], self.pos[c]] + [self.pos[n] for n in before | after])
        low = sorted(before, key=self.pos.get)
        high = [c] + sorted(after, key=self.pos.get)
        # each group only moves away from what it connects to: those before down, after up
        for n, k in zip(low + high, pool[:len(low)] + pool[len(pool) - len(high):]):
            self.pos[n] = k

    def run(self) -> None:
        # consumers first (as XLA does): a producer joins the region of its last consumer, and a
        # value read by one consumer only is never written to memory
        for i in reversed(range(len(self.eqns))):
            e = self.eqns[i]
            if not (is_fusible(e) or e.prim.name in READS_THROUGH_MAPS) or i in self.dead:
                continue
            for a in e.inputs:
                j = self.producer.get(getattr(a, "id", None))
                if j is None or not is_fusible(self.eqns[j]):
                    continue
                p, c = self.group[j], self.group[i]
                height = self.can_merge(p, c) if p != c else None
                if height is not None:
                    self.merge(p, c, height)

    def run_rows(self) -> None:
        """Row merges (after run): fused regions that reduce the trailing axes of one row space,
        with what reads their results along the row, become one kernel that walks each row a
        few times while it is in cache (softmax: max, sum of exp, normalise; layer norm: mean,
        variance, normalise) instead of one kernel per reduction. Whether a union lowers so is
        asked of the lowering itself (a reduction read at a point of the row cannot)."""
        tried: set = set()
        merged = True
        while merged:
            merged = False
            for p, c in sorted(self.dag.edges, key=lambda pc: -self.pos[pc[1]]):
                if (p, c) in tried or not self.dag.has_edge(p, c):  # (p merged away meanwhile)
                    continue
                tried.add((p, c))
                height = self.chain(p, c)
                if height is None or len(self.union_reads(p, c)) + len(self.union_outputs(p, c)) > MAX_BUFFERS:
                    continue
                members = set(self.members[p]) | set(self.members[c])
                if self._row_shaped(members) and not self.creates_cycle(p, c) and \
                        (lowered := self._rows_lower(members)) is not None:
                    self.merge(p, c, height)
                    self.rows[c] = lowered
                    tried = {pc for pc in tried if c not in pc}  # c grew: ask again
                    merged = True

    def _row_shaped(self, members: set[int]) -> bool:
        """The cheap necessary conditions: fusible equations, all reductions over the trailing
        axes of one row space, enough rows for the threads (or a small space), and every value
        shaped like a row or like the rows (unit axes aside)."""
        eqns = [self.eqns[i] for i in members]
        if not all(map(is_fusible, eqns)):
            return False
        spaces = lower.reduction_spaces(eqns)
        if len(spaces) != 1:
            return False
        ((shape, axes),) = spaces
        rows = tuple(n for k, n in enumerate(shape) if k not in axes)
        if axes != tuple(range(len(shape) - len(axes), len(shape))) or \
                math.prod(rows) < ROW_MIN_ROWS and math.prod(shape) > ROW_MAX_ALONE:
            return False  # strided rows, or too few rows to share among threads
        live = (_non_unit(shape), _non_unit(rows))  # (compared, not hashed: symbolic sizes)
        return all(any(_non_unit(o.aval.shape) == s for s in live) for e in eqns for o in e.outputs)

    def _rows_lower(self, members: set[int]) -> list | None:
        """The union's row kernel, if it lowers to one (asked of the lowering itself); none (an
        empty list) for a template's symbolic sizes, whose trial lowering takes its index
        constants at the trace's sizes (symbolic.index_hints: a row length is then not
        specialised) and is thrown away: each instance lowers its own."""
        region = self.region(members, {"rows": True})
        try:
            if not self.symbolic:
                return lower.lower_region(region)
            with index_hints():
                lower.lower_region(region)
            return []
        except lower.NotRows:
            return None

    def region(self, members: set[int], meta: dict | None = None) -> Region:
        idx = sorted(members)
        eqns = tuple(self.eqns[i] for i in idx)
        defined = {o.id for e in eqns for o in e.outputs}
        inputs: dict[int, Var] = {}
        for e in eqns:
            for a in e.inputs:
                if isinstance(a, Var) and a.id not in defined:
                    inputs.setdefault(a.id, a)
        out_ids = {o.id for o in self.outputs(set(idx))}
        outputs = tuple(o for e in eqns for o in e.outputs if o.id in out_ids)
        own = [e for e in eqns if not is_fusible(e)]
        if not own:
            kind = "fused"
        else:
            (e,) = own  # the region's primitive, last: index maps it reads come before
            kind = "host" if e.prim.effectful else e.prim.name
        return Region(eqns, tuple(inputs.values()), outputs, kind, meta or {})

    def regions(self) -> list[Region]:
        import networkx as nx
        dag = self.dag.as_networkx()
        assert nx.is_directed_acyclic_graph(dag), "fusion created a cycle between regions"
        assert all(self.pos[u] < self.pos[v] for u, v in dag.edges), "positions not topological"
        # a row region keeps the kernel its last merge lowered (its members since)
        return [self.region(set(self.members[g]), ({"rows": True, "lowered": self.rows[g]} if self.rows[g]
                                                    else {"rows": True}) if g in self.rows else None)
                for g in nx.lexicographical_topological_sort(dag, key=lambda g: min(self.members[g]))]


def partition(graph: Graph, fuse: bool = True) -> list[Region]:
    """The graph's equations grouped into regions, in an order that respects their data flow
    (and keeps effects in program order). With fuse=False each equation is its own region."""
    eqns = list(graph.eqns)
    if fuse:
        graph_out = {v.id for v in graph.outvars if isinstance(v, Var)}
        eqns = _copy_index_maps(_clone_shared_producers(eqns, graph_out))
    p = _Partitioner(graph, eqns)
    if fuse:
        p.run()
        p.run_rows()
        # A region past MAX_BUFFERS is partitioned again with the bound on its equations. The
        # bound is not asked of every merge: consumers-first merging passes through unions that
        # read many values a later merge takes in (a sum of 256 products reads each product until
        # the products join), and those must not stop the union that reads one array.
        while (over := {i for g, m in p.members.items() if p.group_buffers(g) > MAX_BUFFERS for i in m}) - p.capped:
            p = _Partitioner(graph, eqns, p.capped | over)
            p.run()
            p.run_rows()
    return p.regions()
