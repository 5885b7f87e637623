"""Shape-generic tracing for jit: one trace of a function serves every size its guards allow.

jit traces a function's first call with every dimension of its array arguments symbolic (an
ir.symbolic.Dim per axis of size other than 0 and 1, whose value at the trace is the call's),
so the graph records sizes as expressions (reshape(b, t, 3, h, d), a mean's count) and the guards
record every question the trace asked of them. A later call whose arguments differ only in
those sizes binds the symbols to its own sizes; where that binding is consistent (a symbol takes
one value) and every guard answers as at the trace, the graph is instantiated for the new sizes
(`instantiate`: the expressions evaluated, no Python run) instead of traced again. Otherwise the
call traces as before. A trace that fails symbolically (an operation without a rule for Dims)
is traced again concretely, so errors are the concrete trace's.

The trace is the user's Python run once per set of guards instead of once per shape: Python
side effects in the function (a print) run when it traces, as under JAX, but a new batch size
that the guards allow does not trace."""
from __future__ import annotations

import itertools
import threading
import weakref

import numpy as np

from tilefuse.ir import primitives as P
from tilefuse.ir.core import Graph, Literal, ShapedArray, Var
from tilefuse.ir.passes.fold import fold_uniform
from tilefuse.ir.passes.fusion import Region
from tilefuse.ir.symbolic import (Dim, ShapeEnv, Values, concrete, evaluate, guards_hold, guard_entry, is_symbolic,
                                  recorded, set_base_front_end, set_front_end)


TEMPLATES_MOST = 8  # shape-generic traces kept per jitted function and argument structure


class Template:
    """A graph traced with symbolic sizes: its symbolic input avals, the env of its guards, and
    its instance at the trace's own sizes (base), which the instances at other sizes share from."""
    __slots__ = ("graph", "out_tree", "env", "in_avals", "base", "front", "__weakref__")

    def __init__(self, graph: Graph, out_tree, env: ShapeEnv, in_avals: tuple):
        self.graph, self.out_tree, self.env, self.in_avals = graph, out_tree, env, in_avals
        self.base: Instance | None = None
        self.front: FrontEnd | None | bool = None  # (False: its front end did not run symbolically)

    def instance(self, values) -> Graph:
        """The graph at these symbol values (bind's). One at other sizes than the trace's gets
        its compile's front end from the template's (set_front_end): see FrontEnd."""
        if self.base is None:
            self.base = instantiate(self.graph, self.env.hints)
            # (the trace's own sizes compile concretely; a tiered build has the template's front
            # end made beside it, for the instances to come: runtime/compile_child.py)
            set_base_front_end(self.base.graph, _InstanceFront(self, self.env.hints))
        graph = instantiate(self.graph, values, self.base).graph
        if graph is not self.base.graph:
            set_front_end(graph, _InstanceFront(self, values))
        return graph

    def bind(self, avals) -> list | None:
        """The symbols' values (one per axis) for these argument avals, or None where they do not
        fit (another rank or dtype, a fixed size that differs) or a guard answers otherwise."""
        values = list(self.env.hints)
        for t, a in zip(self.in_avals, avals):
            if t.dtype != a.dtype or t.weak_type != a.weak_type or len(t.shape) != len(a.shape):
                return None
            for d, n in zip(t.shape, a.shape):
                if type(d) is Dim:
                    values[d.key[1]] = int(n)
                elif d != n:
                    return None
        return values if self.env.holds(values) else None


class _InstanceFront:
    """What the compiler asks of an instance at other sizes than its template's trace: called
    with the front end (`run`: graph -> (optimised graph, regions)) and the settings it depends
    on (compared: another setting's compile goes the long way), that front end's result for
    the instance, from one run on the template's own graph (made at its first instance at other
    sizes), or None where that run failed or its guards answer otherwise at the instance's
    sizes."""
    __slots__ = ("template", "values")

    def __init__(self, template: Template, values):
        self.template, self.values = weakref.ref(template), tuple(values)

    def untried(self) -> bool:
        """Whether the template's front end is still to be made (by this instance's compile)."""
        t = self.template()
        return t is not None and t.front is None

    def __call__(self, run, settings, kept=None) -> tuple | None:
        """`kept`: where front ends persist (load(graph, hints, env) -> (optimised graph, regions,
        guards) or None; store(graph, hints, those three)): the template's is loaded from there, or
        made and stored."""
        t = self.template()
        if t is None:
            return None
        with _front_lock:
            if t.front is None:
                parts = kept.load(t.graph, t.env.hints, t.env) if kept is not None else None
                t.front = (parts and FrontEnd.of(t, *parts, settings)) or False
                if not t.front:
                    parts = FrontEnd.run(t, run)
                    t.front = (parts and FrontEnd.of(t, *parts, settings)) or False
                    if t.front and kept is not None:
                        kept.store(t.graph, t.env.hints, *parts)
        return t.front.at(self.values, settings) if t.front else None

    def graph(self):
        """The template's graph and its symbols' values at the trace, or None (gone, or its front
        end made already)."""
        t = self.template()
        return (t.graph, t.env) if t is not None and t.front is None else None

    def ready(self, settings) -> bool:
        """Whether the template's front end was made and serves these sizes."""
        t = self.template()
        return t is not None and bool(t.front) and t.front.serves(self.values, settings)

    def front_end(self) -> tuple | None:
        """(the template's ShapeEnv, its FrontEnd), once made: for the compiler's lowering of an
        instance's regions (FrontEnd.lowerings)."""
        t = self.template()
        return (t.env, t.front) if t is not None and t.front else None


def symbolic_avals(avals) -> tuple[ShapeEnv, tuple]:
    """The avals with every size but 0 and 1 a symbol, one per axis: a batch of 128 beside a
    hidden size of 128 stays free of it (where the program compares two axes, a guard ties
    them). env is None when there is none."""
    env = ShapeEnv()
    out = []
    for a in avals:
        if any(d > 1 for d in a.shape):
            a = ShapedArray(tuple(d if d <= 1 else env.symbol(d) for d in a.shape), a.dtype, a.weak_type)
        out.append(a)
    return (env if env.hints else None), tuple(out)


class Instance:
    """A template's graph at some symbol values, with what became of the template's variables
    (atoms: id -> its new Var, or a size's Literal) and equations (eqns: one per template
    equation, None for a size), so that a later instance can share them. (Only a template's
    base serves as one: an instance made from a base records what it made itself.)"""
    __slots__ = ("graph", "values", "atoms", "eqns")

    def __init__(self, graph: Graph, values: list, atoms: dict, eqns: list):
        self.graph, self.values, self.atoms, self.eqns = graph, values, atoms, eqns


def instantiate(graph: Graph, values, base: Instance | None = None) -> Instance:
    """The graph at these symbol values: every Dim in avals and parameters evaluated, each
    dim_value a literal. Equations with nothing symbolic (no symbolic operand, result or
    parameter) and variables whose avals are concrete are shared with the template; given `base`
    (an instance of the same template), so are base's equations and variables that no symbol
    whose value differs from base's reaches: a new batch size rebuilds the equations on the
    batch and shares an optimizer's update (_plan finds what reaches what, once per template)."""
    plan = _plan(graph)
    changed = None
    if base is not None:
        changed = frozenset(i for i, (a, b) in enumerate(zip(values, base.values)) if a != b)
        if not changed:
            return base
    values = Values(values)
    atoms: dict = {}
    fallback = base.atoms if base is not None else {}  # (what an unreached variable is in base)
    var_syms = plan.var_syms

    def var(v: Var) -> Var:
        nv = atoms.get(v.id)
        if nv is None:
            syms = var_syms.get(v.id)
            if syms is None:
                return v
            if changed is not None and not (syms & changed):
                return fallback.get(v.id, v)
            nv = atoms[v.id] = Var(_aval(v.aval, values))
        return nv

    def read(a):
        if isinstance(a, Literal):
            return a
        nv = atoms.get(a.id)
        return nv if nv is not None else fallback.get(a.id, a)

    constvars = tuple(var(v) for v in graph.constvars)
    invars = tuple(var(v) for v in graph.invars)
    eqns, made = [], []
    for i, (e, step) in enumerate(zip(graph.eqns, plan.steps)):
        if step is _SHARED:
            made.append(e)
        elif step is _SIZE:
            out = e.outputs[0]
            atoms[out.id] = Literal(evaluate(e.params["value"], values), out.aval)
            made.append(None)
            continue
        elif step is _SIZE_CONVERTED:  # what the concrete trace writes: a Python number converted
            out = e.outputs[0]  # at trace time, a literal
            atoms[out.id] = Literal(atoms[e.inputs[0].id].val.astype(out.aval.dtype), out.aval)
            made.append(None)
            continue
        elif changed is not None and plan.eqn_syms[i] is not _EVERY and not (plan.eqn_syms[i] & changed):
            made.append(base.eqns[i])
        else:
            params = e.params
            if step:
                params = dict(params)
                for k in step:
                    params[k] = _param(params[k], values)
            made.append(e.replace(inputs=tuple(read(a) for a in e.inputs),
                                  outputs=tuple(var(v) for v in e.outputs), params=params))
        eqns.append(made[-1])
    out = Graph(constvars, invars, tuple(eqns), tuple(read(v) for v in graph.outvars), graph.consts)
    return Instance(out, list(values), atoms, made)


# ---- the compiler's front end, once per template -------------------------------------------
#
# The passes and fusion's partition ask of sizes only what a Dim answers with a guard (equal,
# less, its value: ir/symbolic.py), so they run on a template's graph as they do on a concrete
# one, and their result stands for every size where the guards they recorded answer the same
# (the char-GPT step: every batch size but 1, and 64, where a broadcast is an identity). A new
# size then instantiates the optimised graph and its regions instead of running them again;
# lowering, kernels and the buffer plan are the instance's own, made by the compiler as before.

_front_lock = threading.Lock()


class FrontEnd:
    """A template's optimised graph and regions with symbolic sizes, as one graph whose
    equations are the regions' in order (`flat`: partition copies some equations, so regions are
    not the optimised graph's equations), `bounds` each region's slice of them, and the guards
    the front end recorded."""
    __slots__ = ("flat", "regions", "bounds", "guards", "hints", "settings", "base", "lowerings", "_served",
                 "_fixed_sizes")

    def __init__(self, flat: Graph, regions: list, bounds: list, guards: dict, hints: list, settings):
        self.flat, self.regions, self.bounds, self.guards = flat, regions, bounds, guards
        self.hints, self.settings = hints, settings
        self.base: Instance | None = None
        self.lowerings: dict = {}  # region number -> what the compiler keeps of its lowering (compiler._Lowering)
        self._served: dict = {}  # symbol values -> whether the guards hold there (asked per size
        # by tiered's choice and by the compile: hundreds of guards)
        self._fixed_sizes: tuple | None = None  # (values, region_with_fixed_sizes' parts at them)

    def serves(self, values, settings) -> bool:
        """Whether this front end stands for the instance at these values, under these settings."""
        if settings != self.settings:
            return False
        key = tuple(values)
        ok = self._served.get(key)
        if ok is None:
            if len(self._served) > 256:
                self._served.clear()
            ok = self._served[key] = guards_hold(self.guards, values)
        return ok

    @staticmethod
    def run(template: Template, run) -> tuple | None:
        """(optimised graph, regions, guards): `run` on the template's graph, with the guards
        it asks recorded; None where it fails (an error is the concrete compile's to raise)."""
        try:
            (g, regions), guards = recorded(template.env, run, template.graph)
        except Exception:  # noqa: BLE001 - (an error is the concrete compile's to raise)
            return None
        return g, regions, guards

    @staticmethod
    def of(template: Template, g: Graph, regions: list, guards: dict, settings) -> "FrontEnd | None":
        """The front end of these parts (FrontEnd.run's, or a stored one), or None where it cannot
        stand for the instances."""
        eqns, bounds = [], []
        for r in regions:
            bounds.append((len(eqns), len(eqns) + len(r.eqns)))
            eqns.extend(r.eqns)
        # a size where instantiate would not see it (an object it does not look into, a literal
        # or constant made of one) would stay the trace's: such a front end is never reused
        if any(_hides_dims(v) for e in eqns for v in e.params.values() if not (_symbols(v) or _holds_graph(v))) \
                or any(isinstance(a, Literal) and np.asarray(a.val).dtype == object
                       for a in (*(a for e in eqns for a in e.inputs), *g.outvars)) \
                or any(np.asarray(c).dtype == object for c in g.consts):
            return None
        flat = Graph(g.constvars, g.invars, tuple(eqns), g.outvars, g.consts, dict(g.meta))
        return FrontEnd(flat, regions, bounds, dict(guards), list(template.env.hints), settings)

    def at(self, values, settings) -> tuple | None:
        """(optimised graph, regions) at these symbol values, or None where a guard answers
        otherwise there (or the settings differ from the run's)."""
        if not self.serves(values, settings):
            return None
        if self.base is None:
            self.base = instantiate(self.flat, self.hints)
        inst = instantiate(self.flat, values, self.base)
        atoms, fallback = inst.atoms, self.base.atoms
        folded = _SizeFolder()

        def read(a):
            n = atoms.get(a.id)
            return folded.read(n if n is not None else fallback.get(a.id, a))
        regions = []
        for i, (r, (lo, hi)) in enumerate(zip(self.regions, self.bounds)):
            eqns = tuple(f for e in inst.eqns[lo:hi] if e is not None and (f := folded.eqn(e)) is not None)
            if not eqns:  # (sizes, and arithmetic on them only: literals now)
                continue
            regions.append(_refolded(r, eqns, read, template_region=i))
        g = inst.graph.replace(eqns=tuple(e for r in regions for e in r.eqns),
                               outvars=tuple(map(read, inst.graph.outvars)))
        return g, regions

    def region_with_fixed_sizes(self, i: int, values) -> tuple | None:
        """Template region i with each size it reads as a value (dim_value) that is the same at
        `values` as at the trace folded to a literal, as `at` folds every size (a layer norm's
        count, a parameter's width: the same at every batch size), and the guards that hold the
        sizes folded up to it to their values; a size that differs (a mean's count over the
        batch) stays symbolic. None where nothing of the region is left. For the compiler's
        lowering twins (runtime/compiler._Lowering), whose symbolic kernels then hold the
        constants an instance's do. (The graph is folded once per instance that asks.)"""
        made = self._fixed_sizes
        if made is None or made[0] != tuple(values):
            made = self._fixed_sizes = (tuple(values), *self._fold_fixed_sizes(values))
        _, regions, guards, counts = made
        return None if regions[i] is None else (regions[i], dict(itertools.islice(guards.items(), counts[i])))

    def _fold_fixed_sizes(self, values) -> tuple[list, dict, list]:
        """region_with_fixed_sizes' regions, its guards, and how many of them each region's are
        (those of the sizes folded before its end)."""
        folded, guards, regions, counts = _SizeFolder(), {}, [], []
        for r, (lo, hi) in zip(self.regions, self.bounds):
            eqns = []
            for e in self.flat.eqns[lo:hi]:
                if e.prim is P.dim_value:
                    d, out = e.params["value"], e.outputs[0]
                    n = evaluate(d, values)
                    if n == evaluate(d, self.hints):
                        folded.literals[out.id] = Literal(n, out.aval)
                        key, entry = guard_entry("==", d, n, True)
                        guards[key] = entry
                        continue
                if (f := folded.eqn(e)) is not None:
                    eqns.append(f)
            counts.append(len(guards))
            if not eqns:
                regions.append(None)
                continue
            if len(eqns) == hi - lo and all(f is e for f, e in zip(eqns, self.flat.eqns[lo:hi])):
                regions.append(r)  # (nothing folded: the region as fusion made it)
                continue
            regions.append(_refolded(r, tuple(eqns), folded.read))
        return regions, guards, counts


def _refolded(r: Region, eqns: tuple, read, **meta) -> Region:
    """Template region r over `eqns` (its own, instantiated or with sizes folded), its inputs and
    outputs through `read` (those that became literals dropped), without the lowering fusion kept
    (made at the template's sizes, or with sizes it read as buffers)."""
    ins = tuple(x for x in map(read, r.inputs) if isinstance(x, Var))
    outs = tuple(x for x in map(read, r.outputs) if isinstance(x, Var))
    return Region(eqns, ins, outs, r.kind, {**{k: v for k, v in r.meta.items() if k != "lowered"}, **meta})


class _SizeFolder:
    """What the passes fold in a concrete graph and could not in the template's, where sizes
    were values (a mean's 1/n, a count broadcast): elementwise equations whose operands are
    literals or broadcasts of literals at these sizes, folded as fold_constants does (to a
    literal, or a broadcast of one), so that kernels hold the constants a concrete compile's do
    (schedule.sized_constants reads a 1/n that is a kernel's size at run time)."""
    __slots__ = ("literals", "uniform")

    def __init__(self):
        self.literals: dict = {}  # var id -> the Literal it became
        self.uniform: dict = {}  # var id -> the scalar (0-d) a broadcast of a literal holds

    def read(self, a):
        return self.literals.get(a.id, a) if isinstance(a, Var) else a

    def eqn(self, e):
        """e with folded values read as literals, itself folded where it can be; None where
        its result became a literal."""
        ins = tuple(self.read(a) for a in e.inputs)
        if ins != e.inputs:
            e = e.replace(inputs=ins)
        if len(e.outputs) != 1:
            return e
        out = e.outputs[0]
        if e.prim is P.broadcast_in_dim:
            x = ins[0]
            scalar = x.val if isinstance(x, Literal) and x.aval.shape == () else self.uniform.get(getattr(x, "id", None))
            if scalar is not None:
                self.uniform[out.id] = scalar
                if not isinstance(x, Literal):  # a broadcast of a broadcast: of the scalar
                    e = e.replace(inputs=(Literal(scalar, ShapedArray((), x.aval.dtype, x.aval.weak_type)),),
                                  params=dict(shape=out.aval.shape, broadcast_dimensions=()))
            return e
        if e.prim.elementwise:
            scalars = [a.val if isinstance(a, Literal) else self.uniform.get(a.id) for a in ins]
            if all(x is not None for x in scalars):
                folded = fold_uniform(e, scalars)
                if isinstance(folded, Literal):
                    self.literals[out.id] = folded
                    return None
                self.uniform[out.id] = folded.inputs[0].val
                return folded
        return e


def _hides_dims(x, depth: int = 0) -> bool:
    """Whether an object of a type instantiate does not look into holds a Dim."""
    if type(x) is Dim:
        return True
    if depth > 4 or isinstance(x, (int, float, str, bytes, bool, np.ndarray, np.dtype, np.generic)) or x is None:
        return False
    if isinstance(x, (tuple, list, set, frozenset)):
        return any(_hides_dims(v, depth + 1) for v in x)
    if isinstance(x, dict):
        return any(_hides_dims(v, depth + 1) for v in x.values())
    if isinstance(x, Graph):
        return any(_hides_dims(v.aval.shape, depth + 1) for e in x.eqns for v in (*e.inputs, *e.outputs))
    fields = getattr(x, "__dict__", None) or {k: getattr(x, k, None) for k in getattr(x, "__slots__", ())}
    return any(_hides_dims(v, depth + 1) for v in fields.values())


# _plan's steps: an equation shared as it is, a size (dim_value) or a size converted at trace
# time, both literals in the instance; any other step is the tuple of parameter names to evaluate
_SHARED, _SIZE, _SIZE_CONVERTED = object(), object(), object()
_EVERY = None  # (eqn_syms: every symbol)


class _Plan:
    """What instantiate does with each of a template's equations (steps), and which symbols
    reach each symbolic variable (var_syms: its aval's, a size's value's) and each equation
    (eqn_syms: its operands', results' and parameters'; _EVERY where it holds a graph, whose
    body is instantiated whatever changed)."""
    __slots__ = ("steps", "var_syms", "eqn_syms", "__weakref__")

    def __init__(self, graph: Graph):
        var_syms: dict = {v.id: _symbols(v.aval.shape) for v in (*graph.constvars, *graph.invars)
                          if is_symbolic(v.aval.shape)}
        sizes: set = set()  # what becomes a literal: a size, or a size converted
        converted: set = set()
        steps, eqn_syms = [], []
        for e in graph.eqns:
            out = e.outputs
            syms = frozenset()
            if e.prim is P.dim_value:
                step = _SIZE
                sizes.add(out[0].id)
                var_syms[out[0].id] = _symbols(e.params["value"])
            elif e.prim is P.convert_element_type and isinstance(e.inputs[0], Var) and \
                    e.inputs[0].id in sizes and e.inputs[0].id not in converted:
                step = _SIZE_CONVERTED
                converted.add(out[0].id)
                sizes.add(out[0].id)
                var_syms[out[0].id] = var_syms[e.inputs[0].id]
            else:
                keys, graphs = [], False
                for k, v in e.params.items():
                    if _holds_graph(v):
                        keys.append(k)
                        graphs = True
                    elif (found := _symbols(v)):
                        keys.append(k)
                        syms |= found
                for v in out:
                    if is_symbolic(v.aval.shape):
                        syms |= var_syms.setdefault(v.id, _symbols(v.aval.shape))
                for a in e.inputs:
                    if isinstance(a, Var) and a.id in var_syms:
                        syms |= var_syms[a.id]
                step = tuple(keys) if graphs or syms or any(isinstance(a, Var) and a.id in sizes for a in e.inputs) \
                    else _SHARED
                if graphs:
                    syms = _EVERY
            steps.append(step)
            eqn_syms.append(syms)
        self.steps, self.var_syms, self.eqn_syms = steps, var_syms, eqn_syms


_plans: "weakref.WeakKeyDictionary[Graph, _Plan]" = weakref.WeakKeyDictionary()
_plans_lock = threading.Lock()


def _plan(graph: Graph) -> _Plan:
    plan = _plans.get(graph)
    if plan is None:
        plan = _Plan(graph)
        with _plans_lock:
            _plans[graph] = plan
    return plan


def _symbols(x) -> frozenset:
    """The symbols (their numbers) in a Dim, or in the Dims a shape or parameter holds."""
    t = type(x)
    if t is Dim:
        out, stack = set(), [x.key]
        while stack:
            k = stack.pop()
            if isinstance(k, tuple):
                if k[0] == "s":
                    out.add(k[1])
                else:
                    stack.extend(k[1:])
        return frozenset(out)
    if t is tuple or t is list:
        return frozenset().union(*(_symbols(v) for v in x))
    if t is dict:
        return frozenset().union(*(_symbols(v) for v in x.values()))
    if t is slice:
        return _symbols(x.start) | _symbols(x.stop) | _symbols(x.step)
    if t is ShapedArray:
        return _symbols(x.shape)
    return frozenset()


def _holds_graph(x) -> bool:
    return type(x) is Graph or (type(x) in (tuple, list) and any(_holds_graph(v) for v in x))


def _aval(a: ShapedArray, values) -> ShapedArray:
    return ShapedArray(tuple(evaluate(d, values) for d in a.shape), a.dtype, a.weak_type)


def _param(v, values):
    t = type(v)
    if t is Graph:
        return instantiate(v, values).graph
    if t is ShapedArray:
        return _aval(v, values) if is_symbolic(v.shape) else v
    if t is tuple and v and type(v[0]) is Graph:
        return tuple(instantiate(g, values).graph for g in v)
    return concrete(v, values)
