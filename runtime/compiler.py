"""compile_graph: a Graph -> a Program of kernel launches with a static buffer plan, for any
backend that renders the kernel IR (the CPU's LLVM, OpenCL, CUDA).

The flow: the pass pipeline (ir.passes.PIPELINE), fusion into regions, lowering of each region
to kernels, one compile per kernel through the dispatcher, then buffers: graph inputs are read
in place, constants are placed on the device once, graph outputs get their own allocations
(they outlive the call) and every intermediate gets an offset in one arena (runtime.planner)
that each call allocates from the backend's pool and frees when it returns."""
from __future__ import annotations

import operator
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from tilefuse.backends.base import Program, bind_launch
from tilefuse.ir import symbolic
from tilefuse.ir.core import Graph, Literal, Var, gc_paused, typecheck_graph
from tilefuse.ir.kernel import copy_kernel, lower_region
from tilefuse.ir.kernel.ir import Buffer, Kernel
from tilefuse.ir.kernel.lower import LoweredKernel
from tilefuse.ir.kernel.schedule import at_first_extent
from tilefuse.ir.passes import Dump, partition, run_passes
from tilefuse.ir.passes.inline import inline_calls
from tilefuse.ir.primitives import CONTROL_FLOW

from . import dispatch, frontend_cache, host_blas, profiler, tiered, tuner
from .config import config
from .memory import Spares
from .planner import Interval, plan_buffers


CONTROL_KINDS = frozenset(p.name for p in CONTROL_FLOW)  # regions run by runtime/control_flow.py


@dataclass(frozen=True)
class Launch:
    """One step of a program: a kernel (or a host step) and the equations it computes."""
    name: str
    kind: str
    eqns: tuple
    kernel: Kernel | None = None
    impl: str = ""  # the implementation the dispatcher chose


class _Sources(Mapping):
    """Kernel name -> source text, rendered only when read (a backend's text, such as LLVM IR,
    is costly to produce and rarely wanted)."""

    def __init__(self, entries: dict):
        self._entries = entries

    def __getitem__(self, name: str) -> str:
        x = self._entries[name]
        if isinstance(x, Kernel):
            return str(x)
        text = getattr(x, "source", None)
        return text if isinstance(text, str) else x.llvm_ir

    def __iter__(self):
        return iter(self._entries)

    def __len__(self):
        return len(self._entries)


def _has_text(compiled) -> bool:
    """Whether a compiled kernel offers its source (without evaluating a property: rendering
    LLVM IR again costs milliseconds)."""
    return any(hasattr(type(compiled), n) or n in getattr(compiled, "__dict__", {})
               for n in ("source", "llvm_ir"))


def _nbytes(aval) -> int:
    return aval.size * np.dtype(aval.dtype).itemsize


def _trace_pass(name: str, graph: Graph) -> None:
    print(f"--- tilefuse: after {name} ---\n{graph}", file=sys.stderr)


class _Builder:
    """Assigns buffer slots to variables and collects launches."""

    def __init__(self, graph: Graph, device, backend):
        self.graph, self.device, self.backend = graph, device, backend
        self.slot: dict[int, int] = {}
        self.kinds: list[str] = []  # per slot: input | const | temp | output
        self.avals: list = []
        self.steps: list[tuple] = []  # (run, arg slots, region index)
        self.launches: list[Launch] = []
        self.sources: dict[str, object] = {}  # name -> Kernel, or a compiled kernel with text
        self._names: dict[str, int] = {}

    def new_slot(self, kind: str, aval, var: Var | None = None) -> int:
        s = len(self.kinds)
        self.kinds.append(kind)
        self.avals.append(aval)
        if var is not None:
            self.slot[var.id] = s
        return s

    def unique(self, name: str) -> str:
        n = self._names.get(name, 0)
        self._names[name] = n + 1
        return name if n == 0 else f"{name}_{n}"

    def add_kernel(self, lk, step: int) -> None:
        tiered.check()  # (a background build stops here at exit)
        k = lk.kernel
        impl, run = dispatch.compile_kernel(k, self.device, self.backend)
        name = self.unique(k.name)
        self.sources[name] = k
        if _has_text(run):  # the backend's own text, rendered when read
            self.sources[f"{name}.{self.backend.kind}"] = run
        if config.debug >= 1:
            print(f"--- tilefuse: kernel {name} ({impl.name}) ---\n{k}", file=sys.stderr)
        self.steps.append((run, tuple(self.slot[v.id] for v in lk.args), step))
        self.launches.append(Launch(name, k.meta.get("kind", ""), k.meta.get("eqns", ()), k, impl.name))

    def add_host(self, region, step: int) -> None:
        """An effectful equation (debug_print) runs on the host: a logged, counted fallback."""
        (e,) = region.eqns
        dispatch.record_fallback(e.prim.name, "an effectful primitive runs as a host callback")
        backend, device = self.backend, self.device
        args = [("lit", a.val) if isinstance(a, Literal) else ("buf", a.aval) for a in e.inputs]

        def run(buffers):
            backend.synchronize(device)
            it = iter(buffers)
            values = [x if tag == "lit" else backend.to_host(next(it), x, device) for tag, x in args]
            e.prim.impl(*values, **e.params)
        slots = tuple(self.slot[a.id] for a in e.inputs if isinstance(a, Var))
        self.steps.append((run, slots, step))
        self.launches.append(Launch(self.unique(e.prim.name), "host", region.eqns))


    def add_control(self, region, step: int) -> None:
        """A control-flow equation: a step that runs the compiled programs of its bodies over
        device buffers (runtime/control_flow.py). Outputs nobody reads still get buffers (the
        loop writes them), as temporaries of this step."""
        from .control_flow import build_control
        (e,) = region.eqns
        for o in e.outputs:
            if o.id not in self.slot:
                self.new_slot("temp", o.aval, o)
        run, sources = build_control(e, self.device, self.backend)
        name = self.unique(e.prim.name)
        self.sources.update((f"{name}.{k}", text) for k, text in sources.items())  # the bodies' kernels
        slots = tuple(self.slot[a.id] for a in e.inputs if isinstance(a, Var)) + \
            tuple(self.slot[o.id] for o in e.outputs)
        self.steps.append((run, slots, step))
        self.launches.append(Launch(name, "control", region.eqns))


def compile_graph(graph: Graph, device, backend, *, fuse: bool | None = None) -> Program:
    """Optimise, fuse, lower and compile `graph` for `device`; see the module docstring."""
    with gc_paused():  # (what it builds lives as long as the program)
        return _compile_graph(graph, device, backend, fuse)


def _compile_graph(graph: Graph, device, backend, fuse: bool | None) -> Program:
    fuse = config.fusion if fuse is None else fuse
    dump = Dump(config.dump_dir, graph.meta.get("name", "graph"))
    front, key, hit = _front(graph, fuse, dump)
    try:
        program = _compile_front(*front, device, backend, dump)
    except Exception as e:  # noqa: BLE001 - from the persistent cache, an entry damaged past its
        if not hit:  # checksum: the long way
            raise
        frontend_cache.discard(key, e)
        front, key, _ = _front(graph, fuse, dump, cached=False)
        program = _compile_front(*front, device, backend, dump)
    frontend_cache.mark_built(key, device)
    return program


def built_before(graph: Graph, device) -> bool:
    """Whether `graph` compiled whole for `device` before (in this process or an earlier one
    on the same persistent cache): its compile is then mostly cache hits."""
    return frontend_cache.was_built(frontend_cache.key(inline_calls(graph), config.fusion), device)


def _compile_front(g: Graph, regions, lowered, device, backend, dump) -> Program:
    """The back half of compile_graph: kernels built, buffers planned, from the front end."""
    b = _Builder(g, device, backend)
    for v in g.invars:
        b.new_slot("input", v.aval, v)
    const_bufs = []
    for v, c in zip(g.constvars, g.consts):
        b.new_slot("const", v.aval, v)
        const_bufs.append(backend.put(np.ascontiguousarray(np.asarray(c, v.aval.dtype)), device))

    # graph outputs: one allocation per position; a region writes its output straight into it
    out_slots, copies = [], []
    for v in g.outvars:
        if isinstance(v, Var) and v.id not in b.slot:
            out_slots.append(b.new_slot("output", v.aval, v))
        else:  # an input, a constant, a literal or a repeated output: copied at the end
            s = b.new_slot("output", v.aval)
            out_slots.append(s)
            copies.append((v, s))

    work = []  # (step, region or None, lowered kernels), in launch order
    for step, region in enumerate(regions):
        for o in region.outputs:
            if o.id not in b.slot:
                b.new_slot("temp", o.aval, o)
        work.append((step, region, lowered[step]))
    for v, s in copies:
        dst = Var(v.aval)
        b.slot[dst.id] = s
        work.append((len(regions), None, [copy_kernel(v, dst)]))
    _precompile([lk.kernel for _, _, lks in work for lk in lks], device, backend)
    for step, region, lks in work:
        if region is not None and region.kind == "host":
            b.add_host(region, step)
        if region is not None and region.kind in CONTROL_KINDS:
            b.add_control(region, step)
        for lk in lks:
            b.add_kernel(lk, step)
    if dump.dir:
        dump.text("kernels", "\n\n".join(f"{l.name}:\n{l.kernel}" if l.kernel else l.name
                                         for l in b.launches))
    return _program(g, b, const_bufs, out_slots)


def _front(graph: Graph, fuse: bool, dump: Dump | None = None, cached: bool = True):
    """The front end: ((optimised graph, regions, lowered kernels per region), the persistent
    cache's key (None where it does not apply), whether they came from it). Calls (tile_op,
    custom_vjp/jvp) keep rules only transformations use: inlined first, the graph's text decides
    its compile."""
    # an instance of a shape-generic trace at new sizes: its template's front end, instantiated
    # (made by the first such instance, unless the persistent cache has that one's)
    template = symbolic.front_end(graph) if fuse and cached and not (dump and dump.dir) else None
    if template is not None and template.ready(config.cache_key()) and (front := _instantiated(template)):
        return front, None, False
    graph = inline_calls(graph)
    key = frontend_cache.key(graph, fuse)
    front = frontend_cache.load(key, graph) if cached else None  # (never while dumping: key is None)
    if front is not None:
        return front, key, True
    if template is not None and template.untried() and (front := _instantiated(template)):
        return front, None, False
    g = run_passes(graph, dump=dump, check=config.check, trace=_trace_pass if config.debug >= 2 else None)
    tiered.check()  # (between the front end's phases too: a process exits without waiting for them)
    regions = partition(g, fuse=fuse)
    if dump is not None and dump.dir:
        dump.text("regions", "\n".join(map(str, regions)))
    lowered = []
    for r in regions:
        tiered.check()
        lowered.append([] if r.kind == "host" else lower_region(r))
    frontend_cache.store(key, g, regions, lowered)
    return (g, regions, lowered), key, False


def _instantiated(template) -> tuple | None:
    """(graph, regions, lowered kernels) from a template's front end (symbolic.front_end's), or
    None."""
    made = template(_symbolic_front, config.cache_key(), _KeptFronts)
    if made is None:
        return None
    g, regions = made
    front = template.front_end()
    values = symbolic.Values(template.values)
    try:
        if config.check:  # (TILEFUSE_CHECK: the instance's avals are its rules' at its sizes)
            typecheck_graph(g)
        lowered = [[] if r.kind == "host" else _lower_instance(r, front, values) for r in regions]
    except Exception:  # noqa: BLE001 - (not expected where the guards hold: the long way then)
        if config.check:
            raise
        return None
    return g, regions, lowered


def _lower_instance(r, front, values) -> list:
    """The kernels of an instance's region r: made from its template region's (at_first_extent)
    where that region's _Lowering holds at these sizes, else lowered. The first instance to lower
    a template region makes its _Lowering."""
    i = r.meta.get("template_region")
    if front is None or i is None:
        return lower_region(r)
    env, fe = front
    made = fe.lowerings.get(i)
    if made is None:
        lowered = lower_region(r)
        fe.lowerings[i] = _Lowering.make(env, fe, i, values, r, lowered) or False
        return lowered
    got = made and made.at(r, values)
    if not got:
        return lower_region(r)
    if config.check:  # (TILEFUSE_CHECK: each kernel is the one lowering the region gives)
        view = lambda lks: [(lk.kernel.shape, lk.kernel.reduce_shape, lk.kernel.buffers, lk.kernel.stores,  # noqa: E731
                             [a.id for a in lk.args]) for lk in lks]
        assert view(got) == view(lower_region(r)), f"region {i}: made kernels differ from lowering"
    return got


_LOWERING_META = frozenset({"kind", "eqns", "operands", "sources"})  # what lowering puts in a kernel's meta


class _Lowering:
    """A template region lowered once with its symbolic sizes, under its own guards, beside its
    lowering at the instance that made it (the twins): where the two have the same stores (no
    size in an index constant or a value: lowering would have asked its value, a guard that
    fails elsewhere), a later instance whose sizes the guards admit, with the same extents but
    the first and the first of its reduction, has the twin's kernels at its own first extents
    and buffer sizes, over its own variables (schedule.at_first_extent; on a CPU that takes
    sizes at run time they share the twin's schedule and code, a reduction over the batch where
    both read its extent at run time); a kernel of no axes (a sum of a parameter's squares, a
    weight decay's) is its twin over the instance's buffers. Kernels are told apart by their
    positions in the region (inputs then outputs, equations), which instances share."""
    __slots__ = ("guards", "n_eqns", "n_frame", "kernels")

    def __init__(self, guards: dict, n_eqns: int, n_frame: int, kernels: list):
        self.guards, self.n_eqns, self.n_frame, self.kernels = guards, n_eqns, n_frame, kernels

    @staticmethod
    def make(env, fe, i: int, values, r, lowered) -> "_Lowering | None":
        """From template region i of front end fe, with the sizes it reads as values that are the
        same at this instance's `values` as at the trace folded as the instance folds them (a
        layer norm's count: FrontEnd.region_with_fixed_sizes), held there by guards."""
        with env.recording() as guards:
            try:
                made = fe.region_with_fixed_sizes(i, values)
                if made is None:
                    return None
                t, fixed = made
                symbolic_kernels = lower_region(t)
            except Exception:  # noqa: BLE001 - (the instance's own lowering stands)
                return None
        guards.update(fixed)
        frame = (*r.inputs, *r.outputs)
        if len(symbolic_kernels) != len(lowered) or len(t.eqns) != len(r.eqns) or \
                len(t.inputs) + len(t.outputs) != len(frame):
            return None
        at_t = {v.id: n for n, v in enumerate((*t.inputs, *t.outputs))}
        at_r = {v.id: n for n, v in enumerate(frame)}
        eqn_at = {id(e): n for n, e in enumerate(t.eqns)}
        kernels = []
        for sk, lk in zip(symbolic_kernels, lowered):
            k, twin = sk.kernel, lk.kernel
            args = tuple(at_t.get(v.id) for v in sk.args)
            operands = tuple(at_t.get(v.id) for v in k.meta.get("operands", ()))
            eqns = tuple(eqn_at.get(id(e)) for e in k.meta.get("eqns", ()))
            if k.stores != twin.stores or k.n_inputs != twin.n_inputs or set(twin.meta) - _LOWERING_META or \
                    [b.dtype for b in k.buffers] != [b.dtype for b in twin.buffers] or \
                    (twin.shape[0] < 2 if twin.shape else k.shape != ()) or None in args + operands + eqns or \
                    args != tuple(at_r.get(v.id) for v in lk.args):
                return None
            kernels.append((twin, k.shape, k.reduce_shape, tuple(b.size for b in k.buffers), args,
                            operands if "operands" in twin.meta else None, eqns, twin.meta["kind"],
                            twin.meta.get("sources", ())))
        return _Lowering(dict(guards), len(t.eqns), len(frame), kernels)

    def at(self, r, values) -> list | None:
        """r's kernels, where r is this region's instance at `values` and the guards admit it."""
        frame = (*r.inputs, *r.outputs)
        if len(r.eqns) != self.n_eqns or len(frame) != self.n_frame or not symbolic.guards_hold(self.guards, values):
            return None
        out = []
        for twin, shape, reduce_shape, sizes, args, operands, eqns, kind, sources in self.kernels:
            n0 = symbolic.evaluate(shape[0], values) if shape else None
            r0 = symbolic.evaluate(reduce_shape[0], values) if reduce_shape else None
            if (shape and n0 < 2) or (len(shape), len(reduce_shape)) != (len(twin.shape), len(twin.reduce_shape)) or \
                    any(symbolic.evaluate(d, values) != n for d, n in zip(shape[1:], twin.shape[1:])) or \
                    any(symbolic.evaluate(d, values) != n for d, n in zip(reduce_shape[1:], twin.reduce_shape[1:])):
                return None
            if r0 == (twin.reduce_shape[0] if reduce_shape else None):
                r0 = None  # (the same reduction)
            elif r0 < 2 or twin.reduce_shape[0] < 2:  # (a reduction axis of 1 merges away)
                return None
            buffers = tuple(Buffer(b.name, b.dtype, symbolic.evaluate(n, values)) for b, n in zip(twin.buffers, sizes))
            meta = {"kind": kind, "eqns": tuple(r.eqns[j] for j in eqns), "sources": sources}
            if operands is not None:
                meta["operands"] = tuple(frame[j] for j in operands)
            out.append(LoweredKernel(at_first_extent(twin, n0, buffers, meta, r0), tuple(frame[j] for j in args)))
        return out


def from_template(graph: Graph) -> bool:
    """Whether `graph`, an instance of a shape-generic trace, compiles from its template's front
    end (made already, or to be made now): tiered builds it in this process, with no child (its
    compile is then a symbolic front end at most, instantiation, lowering and cache hits)."""
    f = symbolic.front_end(graph)
    return f is not None and config.fusion and (f.ready(config.cache_key()) or f.untried())


def _symbolic_front(graph: Graph) -> tuple:
    """The front end's graph passes and partition, on a shape-generic trace's own graph (sizes
    symbolic: tracer/shape_poly.FrontEnd), for every instance its guards admit."""
    g = run_passes(inline_calls(graph))
    return g, partition(g, fuse=True)


class _KeptFronts:
    """Templates' front ends in the persistent cache (frontend_cache.store_template), for
    tracer/shape_poly: made by the child process beside a cold compile (compile_child.
    prebuild), or by the first instance that made one here."""

    @staticmethod
    def _key(graph: Graph, hints) -> str | None:
        return frontend_cache.template_key(frontend_cache.encode_template(graph, hints))  # (its text kept per graph)

    @staticmethod
    def load(graph: Graph, hints, env) -> tuple | None:
        parts = frontend_cache.load_template(_KeptFronts._key(graph, hints), env)
        if parts is not None and config.check:  # (TILEFUSE_CHECK: the one the passes make here)
            (g, regions), guards = symbolic.recorded(env, _symbolic_front, graph)
            text = lambda g, regions, guards: (frontend_cache.front_text(g, regions), sorted(map(repr, guards)))  # noqa: E731
            assert text(*parts) == text(g, regions, guards), "a stored template front end differs from the passes'"
        return parts

    @staticmethod
    def store(graph: Graph, hints, g: Graph, regions, guards: dict) -> None:
        frontend_cache.store_template(_KeptFronts._key(graph, hints), hints, g, regions, guards)


def precompile(graphs, device) -> None:
    """Build the kernels of several graphs at once, for callers that know what they will
    compile (the validation table's shapes of one operation): one OpenCL program for all of them
    (PoCL spends some 30-40 ms of fixed cost on every program it builds), the CPU's object code in
    parallel. Compiling each graph later finds its kernels built."""
    kernels = [lk.kernel for graph in graphs for lks in _front(graph, config.fusion)[0][2] for lk in lks]
    _precompile(kernels, device, device.backend)


def _precompile(kernels: list[Kernel], device, backend) -> None:
    """Build, all at once, the kernels the dispatcher will give to the backend's own renderer
    and the builders' tile kernels (GEMM, FlashAttention) it will compile under their defaults:
    a backend that can build many faster than one by one (one OpenCL program for a graph; LLVM
    object code in parallel processes) in compile_kernels and compile_tiles. add_kernel then
    finds them built."""
    host_blas.prebuild(kernels, device)  # (the GEMMs that choosing times, built together)
    mine, tiles = [], []
    for k in kernels:
        tiered.check()  # (choosing may build and time a GEMM)
        impl = dispatch.choose(k, device)
        if impl.build is dispatch.kernel_ir:
            mine.append(k)
        elif impl.tiles is not None and tuner.uses_defaults(impl, k, device):
            tiles.extend(impl.tiles(k, device))
    if tiles:
        backend.compile_tiles(tiles, device)
    if len(mine) > 1:
        backend.compile_kernels(mine, device)


def _gather(args: tuple):
    """slots -> the buffers of one launch, as a tuple (itemgetter: no Python frame per call)."""
    if len(args) == 1:
        a = args[0]
        return lambda slots: (slots[a],)
    return operator.itemgetter(*args) if args else (lambda slots: ())


def _program(g: Graph, b: _Builder, const_bufs: list, out_slots: list[int]) -> Program:
    backend, device = b.backend, b.device
    # live ranges of intermediates, in region steps
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for _, args, step in b.steps:
        for s in args:
            if b.kinds[s] == "temp":
                first.setdefault(s, step)
                last[s] = step
    temps = [Interval(s, _nbytes(b.avals[s]), first[s], last[s]) for s in first]
    plan = plan_buffers(temps)
    views = [(s, plan.offsets[s], _nbytes(b.avals[s])) for s in first]
    n_in = len(g.invars)
    template = [None] * len(b.kinds)  # constants sit in their slots already
    for s, buf in zip([s for s, k in enumerate(b.kinds) if k == "const"], const_bufs):
        template[s] = buf
    outs_spec = [(s, max(_nbytes(b.avals[s]), 1)) for s in out_slots]
    steps = [(fn, _gather(args)) for fn, args, _ in b.steps]
    launches = b.launches  # launches[i] describes steps[i] (for the profiler)
    arena_bytes = max(plan.arena_bytes, 1)
    alloc, free, view = backend.alloc, backend.free, backend.view

    tail = template[n_in:]  # the inputs took the first slots (_compile_front)

    # the hot path of every call: keep it lean
    if not views and len(outs_spec) == 1:  # no temporaries, one output: most calls of small programs
        ((out_slot, out_bytes),) = outs_spec
        spares = Spares(free, device) if out_bytes <= Spares.LIMIT else None
        take = spares.take if spares is not None else (lambda: None)
        keep = spares.bufs.append if spares is not None else (lambda buf: None)

        def run_one(buffers):
            slots = [*buffers, *tail]
            buf = take()
            if buf is None:
                buf = alloc(out_bytes, device)
            slots[out_slot] = buf
            try:
                prof = profiler.active
                for fn, gather in steps if prof is None else prof.steps(steps, launches, device):
                    fn(gather(slots))
            except BaseException:
                free(buf, device)
                raise
            keep(buf)
            return [buf]

    def run(buffers):
        slots = [*buffers, *tail]
        outs = []
        arena = alloc(arena_bytes, device) if views else None
        try:
            for s, off, nbytes in views:
                slots[s] = view(arena, off, nbytes)
            for s, nbytes in outs_spec:
                slots[s] = buf = alloc(nbytes, device)
                outs.append(buf)
            prof = profiler.active  # profiling off: this load is all it costs
            for fn, gather in steps if prof is None else prof.steps(steps, launches, device):
                fn(gather(slots))
        except BaseException:
            for o in outs:
                free(o, device)
            raise
        finally:
            if arena is not None:
                free(arena, device)
        return outs

    def runner(arena):
        """The program as a loop body calls it: run(buffers, outs) writes into the output buffers
        it is given, its temporaries in `arena` (arena_bytes, made once per loop): nothing is
        allocated per call. Outputs must not alias inputs."""
        base = template.copy()
        for s, off, nbytes in views:
            base[s] = view(arena, off, nbytes)
        out_at = [s for s, _ in outs_spec]

        def run_into(buffers, outs):
            slots = base
            slots[:n_in] = buffers
            for s, buf in zip(out_at, outs):
                slots[s] = buf
            for fn, gather in steps:
                fn(gather(slots))

        def bind(buffers, outs) -> list:
            """run_into(buffers, outs) as launches of no arguments, each kernel bound once."""
            slots = base.copy()
            slots[:n_in] = buffers
            for s, buf in zip(out_at, outs):
                slots[s] = buf
            return [bind_launch(fn, gather(slots)) for fn, gather in steps]
        run_into.bind = bind
        return run_into

    prog = Program(g, run_one if not views and len(outs_spec) == 1 else run, _Sources(b.sources),
                   tuple(b.launches))
    prog.runner = runner
    prog.arena_bytes = arena_bytes if views else 0
    prog.plan = plan
    prog.const_buffers = const_bufs
    return prog
