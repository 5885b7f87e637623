"""Control flow on a device: a cond, while or scan equation becomes one step of its graph's
program that runs the compiled programs of its bodies over device buffers.

Each body is compiled once (compile_graph, so passes and fusion run inside it) when the enclosing
graph compiles; the loop itself runs on the host over device buffers, without tracing or compiling
again and without allocating per iteration: the carry lives in two sets of buffers used in turn
(the step's own output buffers and one set of temporaries made per call), each body's temporaries
in one arena made per call. Each call binds a loop's launches to those buffers once, one list
per place the carry can be read from, so an iteration only launches (backends.base.bind_launch).
A while_loop reads its predicate back from the device each iteration
and a cond its branch index. A scan runs a step program made from its body, which reads row i of
each xs in place (dynamic_slice) and advances i on the device; one more kernel per ys writes the
step's row into the stacked result (the window kernel of dynamic_update_slice).

A scan whose step is one elementwise kernel over the carry (besides one-element parts such as a
fori_loop's counter) runs instead as one tile kernel that holds the loop (ir/kernel/loop.py):
each work-item keeps its point of the carry in registers through every step; one launch a call.
LAUNCHES counts, per call, the launches each form makes (for tests and benchmarks)."""
from __future__ import annotations

import logging
from collections import Counter

import numpy as np

from tilefuse.backends.base import Backend, bind_launch
from tilefuse.ir.errors import CompileError, OutOfMemoryError
from tilefuse.ir import primitives as P
from tilefuse.ir.core import Eqn, Graph, Literal, ShapedArray, Var
from tilefuse.ir.kernel import lower_region
from tilefuse.ir.kernel.ir import Buffer
from tilefuse.ir.kernel.loop import Part, loop_kernel
from tilefuse.ir.passes.fusion import Region

from . import dispatch

log = logging.getLogger("tilefuse")
loop_kernels = True  # False: every scan steps through its launch list (to measure the difference)
LAUNCHES: Counter = Counter()  # "scan_loop": loop kernels launched; "scan_step": step-path launches
I32 = ShapedArray((), np.dtype(np.int32))
BOOL = ShapedArray((), np.dtype(np.bool_))


def _nbytes(aval) -> int:
    return max(aval.size * np.dtype(aval.dtype).itemsize, 1)


class _Body:
    """A body graph compiled for the device; `bind(arena)` gives run(inputs, outputs)."""

    def __init__(self, graph: Graph, device, backend, name: str):
        from .compiler import compile_graph
        self.prog = compile_graph(graph.replace(meta={**graph.meta, "name": name}), device, backend)
        self.arena_bytes = self.prog.arena_bytes


class _Step:
    """What every control-flow step shares: the device, literal operands uploaded once, and the
    buffers it allocates per call (returned to the pool when the call ends)."""

    def __init__(self, eqn: Eqn, device, backend):
        self.device, self.backend = device, backend
        self.n_vars = sum(isinstance(a, Var) for a in eqn.inputs)
        # per operand: its position among the step's buffers, or a buffer made now for a literal
        self.operands = []
        k = 0
        for a in eqn.inputs:
            if isinstance(a, Literal):
                host = np.ascontiguousarray(np.asarray(a.val, a.aval.dtype).reshape(()))
                self.operands.append(("lit", backend.put(host, device)))
            else:
                self.operands.append(("buf", k))
                k += 1
        self.sources: dict = {}  # kernel name -> Kernel or compiled kernel, as compile_graph keeps them

    def split(self, buffers):
        """(the equation's operand buffers, its output buffers)."""
        ins = [buffers[x] if tag == "buf" else x for tag, x in self.operands]
        return ins, list(buffers[self.n_vars:])

    def body(self, graph: Graph, name: str) -> _Body:
        b = _Body(graph, self.device, self.backend, name)
        for k, text in getattr(b.prog._sources, "_entries", b.prog._sources).items():
            self.sources[f"{name}.{k}"] = text
        return b

    def alloc(self, avals, owned: list) -> list:
        bufs = [self.backend.alloc(_nbytes(a), self.device) for a in avals]
        owned.extend(bufs)
        return bufs

    def bind(self, body: _Body, owned: list):
        arena = self.backend.alloc(body.arena_bytes, self.device) if body.arena_bytes else None
        if arena is not None:
            owned.append(arena)
        return body.prog.runner(arena)

    def free(self, owned: list) -> None:
        for b in owned:
            self.backend.free(b, self.device)

    def read(self, buf, aval):
        self.backend.synchronize(self.device)
        return np.asarray(self.backend.to_host(buf, aval, self.device)).item()


def _identity(avals) -> Graph:
    """outputs = inputs: its program copies a carry from one set of buffers to another."""
    vs = tuple(Var(a) for a in avals)
    return Graph((), vs, (), vs)


def _launches(body_run, ins: list, outs: list) -> list:
    """A body's program over fixed buffers, as launches of no arguments (prepared once per loop:
    each kernel's arguments resolved once, Program.runner's bind)."""
    return body_run.bind(ins, outs)


def _run(launches: list) -> None:
    for f in launches:
        f()


# ---- cond ------------------------------------------------------------------------------------------

def _build_cond(eqn: Eqn, device, backend):
    st = _Step(eqn, device, backend)
    branches = [st.body(g, f"cond_branch{k}") for k, g in enumerate(eqn.params["branches"])]
    n = len(branches)
    index_aval = eqn.inputs[0].aval

    def run(buffers):
        ins, outs = st.split(buffers)
        k = int(np.clip(st.read(ins[0], index_aval), 0, n - 1))
        owned: list = []
        try:
            st.bind(branches[k], owned)(ins[1:], outs)
        finally:
            st.free(owned)
    return run, st.sources


# ---- while -----------------------------------------------------------------------------------------

def _build_while(eqn: Eqn, device, backend):
    st = _Step(eqn, device, backend)
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    carry_avals = [v.aval for v in eqn.outputs]
    cond = st.body(p["cond_graph"], "while_cond")
    body = st.body(p["body_graph"], "while_body")
    copy = st.body(_identity(carry_avals), "while_copy")

    def run(buffers):
        ins, X = st.split(buffers)
        cc, bc = ins[:nc], ins[nc:nc + nb]
        owned: list = []
        try:
            Y = st.alloc(carry_avals, owned)
            (pred,) = st.alloc([BOOL], owned)
            cond_run, body_run = st.bind(cond, owned), st.bind(body, owned)
            # the carry's three homes: the operands, then X and Y in turn (never the buffers read)
            homes, after = [ins[nc + nb:], X, Y], [1, 2, 1]
            tests = [backend.batch(_launches(cond_run, cc + h, [pred])) for h in homes]
            steps = [backend.batch(_launches(body_run, bc + h, homes[n])) for h, n in zip(homes, after)]
            k = 0
            while True:
                _run(tests[k])
                if not st.read(pred, BOOL):
                    break
                _run(steps[k])
                k = after[k]
            if k != 1:
                st.bind(copy, owned)(homes[k], X)
        finally:
            st.free(owned)
    return run, st.sources


# ---- scan ------------------------------------------------------------------------------------------

def scan_step_graph(eqn: Eqn) -> tuple[Graph, list[Var], Var]:
    """A scan's body as one step over whole arrays: (i, *consts, *carry, *xs) -> (i ± 1, *carry',
    *rows), where each x's row i is read in place by dynamic_slice and each row is y_i with a
    leading axis of 1. Also the row variables and i (for the kernels that store the rows)."""
    p = eqn.params
    body: Graph = p["body"]
    nk, nc = p["n_consts"], p["n_carry"]
    xs_avals = [a.aval for a in eqn.inputs[nk + nc:]]
    i = Var(I32)
    consts = [Var(v.aval) for v in body.invars[:nk]]
    carry = [Var(v.aval) for v in body.invars[nk:nk + nc]]
    xs = [Var(a) for a in xs_avals]
    eqns, env = [], {}
    zero = Literal(np.int32(0), I32)
    for x, slot in zip(xs, body.invars[nk + nc:]):
        rest = x.aval.shape[1:]
        row = Var(ShapedArray((1, *rest), x.aval.dtype))
        eqns.append(Eqn(P.dynamic_slice, (x, i, *[zero] * len(rest)), (row,), dict(slice_sizes=(1, *rest))))
        xi = Var(slot.aval)
        eqns.append(Eqn(P.reshape, (row,), (xi,), dict(new_sizes=rest)))
        env[slot.id] = xi
    for v, new in zip(body.invars[:nk + nc], consts + carry):
        env[v.id] = new

    def read(a):
        return a if isinstance(a, Literal) else env.get(a.id, a)
    for e in body.eqns:  # the body's own variables, read through env
        eqns.append(e.replace(inputs=tuple(read(a) for a in e.inputs)))
    step = -1 if p["reverse"] else 1
    i_next = Var(I32)
    eqns.append(Eqn(P.add, (i, Literal(np.int32(step), I32)), (i_next,), {}))
    rows = []
    for y in body.outvars[nc:]:
        y = read(y)
        r = Var(ShapedArray((1, *y.aval.shape), y.aval.dtype))
        if isinstance(y, Literal):
            eqns.append(Eqn(P.broadcast_in_dim, (y,), (r,), dict(shape=r.aval.shape, broadcast_dimensions=())))
        else:
            eqns.append(Eqn(P.reshape, (y,), (r,), dict(new_sizes=r.aval.shape)))
        rows.append(r)
    outvars = (i_next, *[read(a) for a in body.outvars[:nc]], *rows)
    g = Graph(body.constvars, (i, *consts, *carry, *xs), tuple(eqns), outvars, body.consts)
    return g, rows, i


def _row_writer(st: _Step, row: Var, i: Var, ys_aval, name: str):
    """launch(row buffer, i buffer, ys buffer) -> a launch of no arguments that writes row i of
    ys, in place (a kernel that writes only that window), or None for an empty row."""
    ys = Var(ys_aval)
    out = Var(ys_aval)
    zero = Literal(np.int32(0), I32)
    e = Eqn(P.dynamic_update_slice, (ys, row, i, *[zero] * (ys_aval.ndim - 1)), (out,), {})
    lowered = lower_region(Region((e,), (ys, row, i), (out,), "dynamic_update_slice"))[1:]
    if not lowered:  # an empty row: nothing to write
        return None
    (lk,) = lowered
    _, kernel = dispatch.compile_kernel(lk.kernel, st.device, st.backend)
    st.sources[name] = lk.kernel
    from .compiler import _has_text
    if _has_text(kernel):  # the backend's own text, rendered when read
        st.sources[f"{name}.{st.backend.kind}"] = kernel
    where = {row.id: 0, i.id: 1, out.id: 2}
    order = [where[v.id] for v in lk.args]

    def launch(row_buf, i_buf, ys_buf):
        bufs = (row_buf, i_buf, ys_buf)
        return bind_launch(kernel, tuple(bufs[k] for k in order))
    return launch


def _loop_form(st: _Step, eqn: Eqn):
    """run(buffers) of a scan as one tile kernel holding the loop (ir/kernel/loop.py), or None
    where the step is not one elementwise kernel of that shape or the device cannot run it."""
    from .compiler import CONTROL_KINDS, _front, _has_text
    from .config import config
    from .hardware import check_fits, target_of
    backend, device, p = st.backend, st.device, eqn.params
    nk, nc, length = p["n_consts"], p["n_carry"], p["length"]
    if not loop_kernels or type(backend).compile_tile is Backend.compile_tile or length < 1:
        return None
    if any(v.aval.size == 0 for v in (*eqn.inputs, *eqn.outputs) if isinstance(v, Var)):
        return None
    (g, regions, lowered), _, _ = _front(p["body"], config.fusion)
    if any(r.kind == "host" or r.kind in CONTROL_KINDS for r in regions):
        return None
    lks = [lk for lks in lowered for lk in lks]
    if not lks or any(dispatch.choose(lk.kernel, device).build is not dispatch.kernel_ir for lk in lks):
        return None
    role = {}
    for n, v in enumerate(g.invars):
        role[v.id] = ("const", n) if n < nk else ("carry", n - nk) if n < nk + nc else ("x", n - nk - nc)
    for m, v in enumerate(g.constvars):
        role[v.id] = ("const", nk + m)
    outs: dict = {}
    for n, v in enumerate(g.outvars):
        if not isinstance(v, Var) or v.id in role:
            return None  # a literal or an operand passed through: the step path copies it
        outs.setdefault(v.id, []).append(("carry", n) if n < nc else ("y", n - nc))
    read_later = {a.id for lk in lks for a in lk.args[:lk.kernel.n_inputs]}
    parts = []
    for lk in lks:
        k = lk.kernel
        ins = tuple(role.get(a.id, ("temp", a.id)) for a in lk.args[:k.n_inputs])
        o = tuple(tuple(outs.get(a.id, [])) + ((("temp", a.id),) if a.id in read_later else ())
                  for a in lk.args[k.n_inputs:])
        parts.append(Part(k, ins, o))

    def buf(name, aval):
        return Buffer(name, np.dtype(aval.dtype), int(aval.size))
    ops = [a.aval for a in eqn.inputs]
    consts = [buf(f"k{n}", a) for n, a in enumerate(ops[:nk])] + \
        [buf(f"k{nk + m}", v.aval) for m, v in enumerate(g.constvars)]
    carries = [buf(f"c{n}", a) for n, a in enumerate(ops[nk:nk + nc])]
    xs = [buf(f"x{n}", a) for n, a in enumerate(ops[nk + nc:])]
    ys = [buf(f"y{n}", v.aval) for n, v in enumerate(eqn.outputs[nc:])]
    info = device.info
    group = 1 if target_of(info).kind == "cpu" else max(1, min(64, info.max_work_group))
    lanes = max(1, info.simd_lanes_f32) if target_of(info).kind == "cpu" else 1
    tk = loop_kernel("scan_loop", parts, consts, carries, xs, ys, length, p["reverse"], group, lanes)
    if tk is None:
        return None
    try:
        check_fits(tk, info)
    except (CompileError, OutOfMemoryError) as e:  # (webgpu: past its loop trip cap)
        log.info("tilefuse: a scan runs step by step on %s: %s", device, e)
        return None
    kernel = backend.compile_tile(tk, device)
    if _has_text(kernel):  # the backend's own text, rendered when read
        st.sources["scan_loop"] = kernel
    uploaded = [backend.put(np.ascontiguousarray(np.asarray(c, v.aval.dtype)), device)
                for v, c in zip(g.constvars, g.consts)]

    def run(buffers):
        ins, outs_ = st.split(buffers)
        bind_launch(kernel, (*ins[:nk], *uploaded, *ins[nk:], *outs_))()
        LAUNCHES["scan_loop"] += 1
    return run


def _build_scan(eqn: Eqn, device, backend):
    st = _Step(eqn, device, backend)
    loop = _loop_form(st, eqn)
    if loop is not None:
        return loop, st.sources
    p = eqn.params
    nk, nc, length, reverse = p["n_consts"], p["n_carry"], p["length"], p["reverse"]
    carry_avals = [v.aval for v in eqn.outputs[:nc]]
    graph, rows, i = scan_step_graph(eqn)
    step = st.body(graph, "scan_step")
    copy = st.body(_identity(carry_avals), "scan_copy")
    writers = [_row_writer(st, r, i, o.aval, f"scan_row_write{k}") for k, (r, o) in
               enumerate(zip(rows, eqn.outputs[nc:]))]
    i0 = backend.put(np.asarray(length - 1 if reverse else 0, np.int32).reshape(()), device)

    def run(buffers):
        ins, outs = st.split(buffers)
        consts, init, xs = ins[:nk], ins[nk:nk + nc], ins[nk + nc:]
        X, ys = outs[:nc], outs[nc:]
        owned: list = []
        try:
            if length == 0:
                if nc:
                    st.bind(copy, owned)(init, X)
                return
            Y = st.alloc(carry_avals, owned)
            ia, ib = st.alloc([I32, I32], owned)
            row_bufs = st.alloc([r.aval for r in rows], owned)
            step_run = st.bind(step, owned)

            def launches(cur, cur_i, nxt, nxt_i):  # one step from (cur, cur_i) into (nxt, nxt_i)
                return backend.batch(
                    _launches(step_run, [cur_i, *consts, *cur, *xs], [nxt_i, *nxt, *row_bufs]) +
                    [w(rb, cur_i, yb) for w, rb, yb in zip(writers, row_bufs, ys) if w is not None])
            # the carry alternates between Y and the outputs X, and the last step writes X
            into_x, into_y = launches(Y, ib, X, ia), launches(X, ia, Y, ib)
            _run(launches(init, i0, X, ia) if length % 2 else launches(init, i0, Y, ib))
            by_parity = (into_x, into_y) if length % 2 else (into_y, into_x)  # step k: by_parity[k % 2]
            for k in range(1, length):
                for f in by_parity[k & 1]:
                    f()
            LAUNCHES["scan_step"] += len(into_x) * length
        finally:
            st.free(owned)
    return run, st.sources


BUILDERS = {P.cond_p: _build_cond, P.while_p: _build_while, P.scan_p: _build_scan}


def build_control(eqn: Eqn, device, backend):
    """(run(buffers), its kernels by name) for a control-flow equation; buffers are those of its
    variable operands, then its outputs."""
    return BUILDERS[eqn.prim](eqn, device, backend)
