"""GEMM epilogue fusion: dot_general followed by bias adds, scalings, an activation and residual
adds becomes one fused_gemm, whose epilogue runs on the output tile while it is in registers or
cache (ir/primitives.py defines the steps).

From each dot_general the pass walks its result forward, one step at a time:
- `y + v` where y has no other reader and v is an array of y's shape (a residual) or a
  broadcast of a row vector along y's last axis (a bias): an ("add", i) step;
- otherwise the largest chain of elementwise equations that reads only y and scalars and whose
  intermediate values nobody else reads, recognised by what it computes rather than how it is
  written: evaluated on probe points, it must equal relu, gelu (tanh or erf form), silu, tanh,
  sigmoid or an affine map y*a + c (a scale, a shift, a division by a constant) to float32 precision.
Steps keep the user's order, so a*(x@w + b) stays a*(xW + b). Anything else ends the chain: a
bias of another shape (not along the last axis), a value read elsewhere, a function that is none
of these. The fused equation takes the place of the chain's last equation (its operands are all
defined before it); the dead producers are left for dce. The pass runs after fuse_attention,
whose pattern starts with the scores' dot_general and its scale and mask."""
from __future__ import annotations

import math

import numpy as np

from .. import primitives as P
from ..core import Eqn, Graph, Literal, Var
from .util import literal, new_eqn

MAX_CHAIN = 24  # elementwise equations an activation may take
PROBE = np.concatenate([np.linspace(-8.0, 8.0, 161), [-30.0, -0.37, 1e-3, 0.61, 30.0]]).astype(np.float32)
_SQRT2 = math.sqrt(2.0)


FUSIBLE_DTYPES = ("float32", "float16", "bfloat16")


class _Graph:
    """Producers, readers and scalar values of one graph."""

    def __init__(self, g: Graph):
        self.g = g
        self.pos = {id(e): i for i, e in enumerate(g.eqns)}
        self.producer = {o.id: e for e in g.eqns for o in e.outputs}
        self.readers: dict[int, list[Eqn]] = {}
        for e in g.eqns:
            for a in e.inputs:
                if isinstance(a, Var):
                    self.readers.setdefault(a.id, []).append(e)
        self.outputs = {v.id for v in g.outvars if isinstance(v, Var)}
        self.consts = {v.id: np.asarray(c) for v, c in zip(g.constvars, g.consts)}

    def sole_reader(self, v: Var) -> Eqn | None:
        r = self.readers.get(v.id, [])
        return r[0] if len(r) == 1 and v.id not in self.outputs else None

    def scalar(self, a):
        """The one value an atom holds everywhere (a literal, a uniform constant or a broadcast
        of one) as a float32 0-d array, else None."""
        if isinstance(a, Literal):
            v = np.asarray(a.val)
        elif a.id in self.consts:
            v = self.consts[a.id]
        else:
            p = self.producer.get(a.id)
            return self.scalar(p.inputs[0]) if p is not None and p.prim is P.broadcast_in_dim else None
        flat = v.reshape(-1)
        if flat.size == 0 or not np.all(flat == flat[0]):
            return None
        return np.asarray(flat[0], np.float32)


def _add_step(G: _Graph, e: Eqn, y: Var):
    """(extra operand, eqns taken) when e is y + a residual or a row bias, else None."""
    if e.prim is not P.add or len(e.inputs) != 2 or sum(a is y for a in e.inputs) != 1:
        return None
    (other,) = [a for a in e.inputs if a is not y]
    if not isinstance(other, Var) or other.aval.dtype != y.aval.dtype or G.scalar(other) is not None:
        return None
    p = G.producer.get(other.id)
    if p is not None and p.prim is P.broadcast_in_dim:
        x = p.inputs[0]
        row = (y.aval.shape[-1],) if y.aval.ndim else None
        along_rows = p.params["broadcast_dimensions"] == (y.aval.ndim - 1,)
        if isinstance(x, Var) and x.aval.shape == row and along_rows:
            return x
        return None  # a broadcast along other axes: not a bias of the output's rows
    return other if other.aval.shape == y.aval.shape else None


def _closure(G: _Graph, y: Var) -> list[Eqn]:
    """Elementwise equations reading only y, values computed from y here, and scalars."""
    inside, chain, taken, work = {y.id}, [], set(), [y]
    while work and len(chain) < MAX_CHAIN:
        v = work.pop()
        for e in G.readers.get(v.id, ()):
            if id(e) in taken or not e.prim.elementwise or e.prim.effectful or len(e.outputs) != 1 or \
                    e.outputs[0].aval.shape != y.aval.shape:
                continue
            if all((isinstance(a, Var) and a.id in inside) or G.scalar(a) is not None for a in e.inputs):
                chain.append(e)
                taken.add(id(e))
                inside.add(e.outputs[0].id)
                work.append(e.outputs[0])
    return sorted(chain, key=lambda e: G.pos[id(e)])


def _ancestors(sink: Var, chain: list[Eqn], y: Var) -> list[Eqn] | None:
    """The equations of `chain` that sink depends on, if their values are read only among them."""
    by_out = {e.outputs[0].id: e for e in chain}
    keep, stack = {}, [sink]
    while stack:
        v = stack.pop()
        e = by_out.get(v.id)
        if e is None or id(e) in keep:
            continue
        keep[id(e)] = e
        stack.extend(a for a in e.inputs if isinstance(a, Var))
    return [e for e in chain if id(e) in keep]


def _evaluate(G: _Graph, sub: list[Eqn], y: Var, x: np.ndarray) -> np.ndarray:
    env = {y.id: x}
    for e in sub:
        args = [env[a.id] if isinstance(a, Var) and a.id in env else G.scalar(a) for a in e.inputs]
        with np.errstate(all="ignore"):
            env[e.outputs[0].id] = np.asarray(e.prim.impl(*args, **e.params)[0], np.float64)
    return env[sub[-1].outputs[0].id]


def _identify(G: _Graph, sub: list[Eqn], y: Var):
    """The epilogue step that the equations `sub` compute from y, or None."""
    x = PROBE.astype(np.float64)
    f = _evaluate(G, sub, y, PROBE)
    if not np.array_equal(np.isfinite(f), np.isfinite(x)):
        return None
    for name in P.GEMM_ACTIVATIONS:  # against the primitive's own reference of each step
        if np.allclose(f, P.gemm_epilogue(PROBE, (), ((name,),)), rtol=1e-5, atol=2e-6):
            return (name,)
    c, one = _evaluate(G, sub, y, np.array([0.0, 1.0], np.float32))
    a = one - c
    if np.allclose(f, a * x + c, rtol=1e-5, atol=1e-6 * max(1.0, abs(a), abs(c))):
        return ("affine", float(np.float32(a)), float(np.float32(c)))
    return None


def _activation_step(G: _Graph, y: Var, gone: set):
    """(step, eqns taken, result) for the largest elementwise chain from y that is a known
    function, else None."""
    if y.id in G.outputs:  # y must stay: an epilogue would replace it
        return None
    chain = [e for e in _closure(G, y) if id(e) not in gone]
    for e in reversed(chain):  # the largest candidate first
        sink = e.outputs[0]
        if sink.aval.dtype != y.aval.dtype:
            continue
        sub = _ancestors(sink, chain, y)
        taken = {id(s) for s in sub}
        inner = [y] + [s.outputs[0] for s in sub if s is not e]
        if any(v.id in G.outputs or any(id(r) not in taken for r in G.readers.get(v.id, ()))
               for v in inner):
            continue  # y or an intermediate value is read elsewhere
        step = _identify(G, sub, y)
        if step is not None:
            return step, sub, sink
    return None


def _fuse_from(G: _Graph, dot: Eqn, gone: set):
    """The fused_gemm replacing dot and its epilogue chain, and the equations it takes (none
    that an earlier rewrite took: `gone`)."""
    y = dot.outputs[0]
    extras, steps, taken = [], [], [dot]
    while True:
        reader = G.sole_reader(y)
        if reader is not None and id(reader) in gone:
            break
        extra = _add_step(G, reader, y) if reader is not None else None
        if extra is not None:
            if not any(extra is x for x in extras):
                extras.append(extra)
            steps.append(("add", next(i for i, x in enumerate(extras) if x is extra)))
            taken.append(reader)
            y = reader.outputs[0]
            continue
        act = _activation_step(G, y, gone)
        if act is None:
            break
        step, sub, y = act
        steps.append(step)
        taken.extend(sub)
    if not steps:
        return None
    params = {"dimension_numbers": dot.params["dimension_numbers"],
              "preferred_element_type": dot.params.get("preferred_element_type"), "epilogue": tuple(steps)}
    fused = Eqn(P.fused_gemm, tuple(dot.inputs[:2]) + tuple(extras), (y,), params, dot.source)
    return fused, taken


def fuse_gemm_epilogues(graph: Graph) -> Graph:
    G = _Graph(graph)
    replaced: dict[int, Eqn] = {}  # id of a chain's last equation -> the fused equation
    gone: set[int] = set()
    for e in graph.eqns:
        if e.prim is not P.dot_general or id(e) in gone or \
                np.dtype(e.outputs[0].aval.dtype).name not in FUSIBLE_DTYPES:
            continue
        r = _fuse_from(G, e, gone)
        if r is None:
            continue
        fused, taken = r
        gone.update(id(t) for t in taken)
        replaced[id(max(taken, key=lambda t: G.pos[id(t)]))] = fused
    if not replaced:
        return graph
    eqns = [replaced.get(id(e), e) for e in graph.eqns if id(e) not in gone or id(e) in replaced]
    return graph.replace(eqns=tuple(eqns))


# ---- the way back: a fused_gemm as dot_general and ordinary elementwise equations ---------------

def unfused_graph(eqn: Eqn) -> Graph:
    """A graph computing `eqn` (a fused_gemm) with dot_general and the primitives its epilogue
    stands for, over the same input and output variables: for a device whose GEMM takes no
    epilogue, and to check the fused result against."""
    lhs, rhs, *extras = eqn.inputs
    out = eqn.outputs[0]
    eqns = []

    def emit(prim, *ins, **params):
        e, (o,) = new_eqn(prim, ins, params)
        eqns.append(e)
        return o

    shape, ndim = out.aval.shape, out.aval.ndim

    def scalar(v):
        return emit(P.broadcast_in_dim, literal(v, out.aval.dtype), shape=shape, broadcast_dimensions=())
    y = emit(P.dot_general, lhs, rhs, dimension_numbers=eqn.params["dimension_numbers"],
             preferred_element_type=eqn.params["preferred_element_type"])
    for step in eqn.params["epilogue"]:
        op = step[0]
        if op == "add":
            x = extras[step[1]]
            if x.aval.shape != shape:  # a row along the last axis
                x = emit(P.broadcast_in_dim, x, shape=shape, broadcast_dimensions=(ndim - 1,))
            y = emit(P.add, y, x)
        elif op == "affine":
            y = emit(P.add, emit(P.mul, y, scalar(step[1])), scalar(step[2]))
        elif op == "relu":
            y = emit(P.max_, y, scalar(0.0))
        elif op in ("tanh", "sigmoid"):
            y = emit(P.tanh if op == "tanh" else P.logistic, y)
        elif op == "silu":
            y = emit(P.mul, y, emit(P.logistic, y))
        else:
            if op == "gelu_tanh":
                cube = emit(P.mul, emit(P.mul, y, y), y)
                inner = emit(P.add, y, emit(P.mul, scalar(0.044715), cube))
                t = emit(P.tanh, emit(P.mul, scalar(math.sqrt(2 / math.pi)), inner))
            else:
                t = emit(P.erf, emit(P.mul, y, scalar(1 / _SQRT2)))
            y = emit(P.mul, emit(P.mul, scalar(0.5), y), emit(P.add, scalar(1.0), t))
    last = eqns[-1]
    eqns[-1] = last.replace(outputs=(out,))  # the fused equation's own output variable
    return Graph((), tuple(eqn.inputs), tuple(eqns), (out,))
