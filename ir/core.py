"""The graph IR: abstract values, variables, equations and graphs (a jaxpr-like SSA form)."""
from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from . import dtypes
from .symbolic import Dim
from .errors import ArgumentError, ConcretizationError, ShapeError, with_user_line

MAX_BYTES = (1 << 63) - 1  # an array's bytes must count in int64 (numpy's and every device's sizes)


@dataclass(frozen=True)
class ShapedArray:
    """An abstract array: shape and dtype; weak_type marks values born of Python scalars."""
    shape: tuple[int, ...]
    dtype: np.dtype
    weak_type: bool = False

    def __post_init__(self):
        """Shapes are checked where they are made, at trace time: a negative dimension or a size
        past int64 would otherwise reach a device as a 0-byte or negative allocation."""
        n = 1
        for d in self.shape:
            if type(d) is Dim:  # symbolic (a shape-generic trace): checked when instantiated
                if d.env.frozen:  # its trace is over: the int it was (a leaked tracer's shape)
                    object.__setattr__(self, "shape", tuple(getattr(d, "hint", d) for d in self.shape))
                    return self.__post_init__()
                continue
            if not isinstance(d, (int, np.integer)):
                raise _not_a_dimension(d)
            if not 0 <= d <= MAX_BYTES:
                raise ShapeError(with_user_line(f"an array of shape {_dims(self.shape)}: dimension {d} is "
                                                + ("negative" if d < 0 else "past int64")))
            n *= int(d)  # a Python int: numpy's int64 would wrap
        if n > 1 << 56 and n * np.dtype(self.dtype).itemsize > MAX_BYTES:  # the dtype only when near
            raise ShapeError(with_user_line(
                f"an array of shape {_dims(self.shape)} and dtype {np.dtype(self.dtype).name} would hold "
                f"{n * np.dtype(self.dtype).itemsize:,} bytes, more than any device can address (2**63)"))

    def __hash__(self):  # cached: avals are hashed on every jit call (cache keys)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.shape, self.dtype, self.weak_type))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = math.prod(self.shape)  # (numpy's prod costs 5 µs a call; passes ask often)
        return n if type(n) is int or type(n) is Dim else int(n)

    def __reduce__(self):  # without the cached hash (str hashes differ between processes)
        return ShapedArray, (self.shape, self.dtype, self.weak_type)

    def strip_weak(self) -> "ShapedArray":
        return ShapedArray(self.shape, self.dtype) if self.weak_type else self

    def update(self, shape=None, dtype=None, weak_type=None) -> "ShapedArray":
        return ShapedArray(self.shape if shape is None else tuple(shape),
                           self.dtype if dtype is None else dtype,
                           self.weak_type if weak_type is None else weak_type)

    def str_short(self) -> str:
        return f"{dtype_short(self.dtype)}[{','.join(map(str, self.shape))}]"

    def describe(self) -> str:
        """str_short for a message: a symbolic size as its value at the trace, asking nothing
        (str() of a size is guarded, since a program may compare strings: a message is not)."""
        return f"{dtype_short(self.dtype)}[{','.join(map(repr, self.shape))}]"

    __str__ = str_short


def dimension(d) -> int:
    """A dimension of a shape as an int: an integer, or what converts exactly (a concrete 0-d
    array; a traced value raises ConcretizationError); 2.5 or "a" is an ArgumentError (a
    TypeError, as numpy's and JAX's)."""
    if type(d) is Dim:  # a traced size stays symbolic while its trace runs (ir/symbolic.py)
        return d.hint if d.env.frozen else d
    if isinstance(d, (int, np.integer)):
        return int(d)
    try:
        return operator.index(d)
    except ConcretizationError:  # (a TypeError too)
        raise
    except TypeError:
        raise _not_a_dimension(d) from None


def _not_a_dimension(d) -> ArgumentError:
    return ArgumentError(with_user_line(f"a dimension of a shape is {d!r}, a {type(d).__name__}: "
                                        "dimensions are integers"))


def _dims(shape) -> tuple:
    return tuple(int(d) for d in shape)


_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64",
          "int32": "i32", "int64": "i64", "uint32": "u32", "uint64": "u64", "bool": "bool"}


@functools.lru_cache(maxsize=None)  # printing a graph asks once per variable
def dtype_short(d) -> str:
    return _SHORT.get(np.dtype(d).name, np.dtype(d).name)


def aval_of_value(x) -> ShapedArray:
    """The aval of a concrete value: numpy array, numpy/Python scalar, or anything with .aval."""
    if hasattr(x, "aval"):
        return x.aval
    if isinstance(x, (bool, int, float)) and not isinstance(x, np.generic):
        return ShapedArray((), dtypes.python_scalar_dtype(x), True)
    arr = np.asarray(x)
    return ShapedArray(arr.shape, dtypes.canonicalize(arr.dtype))


_var_ids = itertools.count()


@contextlib.contextmanager
def gc_paused():
    """The garbage collector held off while graphs are built: tracing, instantiating a
    shape-generic trace and compiling allocate tens of thousands of objects that live as long as
    the graph or its program, and the collector's passes over them find nothing to free (a
    shape-generic trace of an unrolled RNN: 230 ms with them, 125 without; the char-GPT step at a
    new batch size, medians of two runs: 0.78 and 0.99 s with them, 0.58 and 0.81 without).
    Process-wide: another thread's cyclic garbage waits for the end of it (what refcounts free is
    freed as ever)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Var:
    """An SSA variable of a graph; identity is the variable (names are assigned when printed)."""
    __slots__ = ("aval", "id")

    def __init__(self, aval: ShapedArray):
        self.aval = aval
        self.id = next(_var_ids)

    def __repr__(self):
        return f"Var({self.id}:{self.aval})"


class Literal:
    """A scalar constant written into an equation."""
    __slots__ = ("val", "aval")

    def __init__(self, val, aval: ShapedArray):
        self.val = np.asarray(val, aval.dtype)
        self.aval = aval

    def __repr__(self):
        return f"Literal({self.val})"


Atom = "Var | Literal"


@dataclass(frozen=True, eq=False)
class Eqn:
    """One primitive application: outputs = prim(*inputs, **params)."""
    prim: Any
    inputs: tuple
    outputs: tuple
    params: dict
    source: str = ""  # the user's file:line that produced it

    def replace(self, **kw) -> "Eqn":
        d = dict(prim=self.prim, inputs=self.inputs, outputs=self.outputs, params=self.params,
                 source=self.source)
        d.update(kw)
        return Eqn(**d)


@dataclass(frozen=True, eq=False)
class Graph:
    """A pure function as a list of equations over typed SSA variables.

    `constvars` are bound to `consts` (concrete arrays captured while tracing); `invars` are
    the function's flattened inputs; `outvars` may be Vars or Literals."""
    constvars: tuple
    invars: tuple
    eqns: tuple
    outvars: tuple
    consts: tuple = ()
    meta: dict = field(default_factory=dict)

    @property
    def in_avals(self):
        return [v.aval for v in self.invars]

    @property
    def out_avals(self):
        return [v.aval for v in self.outvars]

    def replace(self, **kw) -> "Graph":
        d = dict(constvars=self.constvars, invars=self.invars, eqns=self.eqns,
                 outvars=self.outvars, consts=self.consts, meta=self.meta)
        d.update(kw)
        return Graph(**d)

    def __str__(self):
        return pp_graph(self)

    def to_dot(self, name: str = "graph") -> str:
        return graph_to_dot(self, name)

    def eqn_text(self, eqn: "Eqn") -> str:
        """One equation as it reads in str(graph), with the same variable names."""
        i = next(k for k, e in enumerate(self.eqns) if e is eqn)
        line = _pp_parts(self, _Namer(), 0)[1][i].splitlines()[0].strip()  # its sub-graphs left out
        return line[4:] if line.startswith("let ") else line

    def count(self, prim_name: str | None = None) -> int:
        """Number of equations (of one primitive, if named)."""
        return sum(1 for e in self.eqns if prim_name is None or e.prim.name == prim_name)


# ---- printing ----------------------------------------------------------------------------

class _Namer:
    def __init__(self):
        self.names: dict[int, str] = {}

    def __call__(self, v) -> str:
        if isinstance(v, Literal):
            return _fmt_literal(v)
        if v.id not in self.names:
            n = len(self.names)
            s = ""
            while True:
                s = chr(ord("a") + n % 26) + s
                n = n // 26 - 1
                if n < 0:
                    break
            self.names[v.id] = s
        return self.names[v.id]

    def decl(self, v: Var) -> str:
        return f"{self(v)}:{v.aval.str_short()}"


def _fmt_literal(lit: Literal) -> str:
    v = lit.val.item()
    return f"{v!r}:{dtype_short(lit.aval.dtype)}"


def _is_subgraph(v) -> bool:
    return isinstance(v, Graph) or (isinstance(v, tuple) and bool(v) and all(isinstance(g, Graph) for g in v))


def _fmt_param(v) -> str:
    if isinstance(v, Graph):
        return "{graph " + str(len(v.eqns)) + " eqns}"
    if isinstance(v, np.dtype):
        return dtype_short(v)
    if callable(v) and hasattr(v, "__name__"):
        return v.__name__
    return repr(v)


def _pp_parts(g: Graph, name: "_Namer", indent: int) -> tuple[str, list[str], str]:
    """(header line, one text per equation, closing line). An equation's sub-graphs (the bodies
    of control flow) follow its line in full, indented, one `param=` each."""
    pad = " " * indent
    consts = " ".join(name.decl(v) for v in g.constvars)
    ins = " ".join(name.decl(v) for v in g.invars)
    head = f"{pad}{{ lambda {consts + '; ' if consts else ''}{ins} ."
    eqns = []
    for i, e in enumerate(g.eqns):
        outs = " ".join(name.decl(v) for v in e.outputs)
        items = [(k, v) for k, v in sorted(e.params.items()) if not k.startswith("_")]
        params = " ".join(f"{k}={_fmt_param(v)}" for k, v in items if not _is_subgraph(v))
        args = " ".join(name(a) for a in e.inputs)
        head_word = "let " if i == 0 else "    "
        text = [f"{pad}  {head_word}{outs} = {e.prim.name}{'[' + params + ']' if params else ''} {args}"]
        for k, v in items:
            if _is_subgraph(v):
                for j, sub in enumerate((v,) if isinstance(v, Graph) else v):
                    label = k if isinstance(v, Graph) else f"{k}[{j}]"
                    body = pp_graph(sub, indent + 8, name)
                    text.append(f"{pad}      {label}=" + body.lstrip())
        eqns.append("\n".join(text))
    tail = f"{pad}  in ({', '.join(name(v) for v in g.outvars)}) }}"
    return head, eqns, tail


def pp_graph(g: Graph, indent: int = 0, namer: "_Namer | None" = None) -> str:
    head, eqns, tail = _pp_parts(g, namer or _Namer(), indent)
    return "\n".join([head, *eqns, tail])


def graph_to_dot(g: Graph, name: str = "graph") -> str:
    """Graphviz DOT text of the dataflow: inputs as ellipses, equations as boxes."""
    out = [f'digraph "{name}" {{', "  rankdir=TB; node [fontname=monospace];"]
    namer = _Namer()
    producer: dict[int, str] = {}
    for i, v in enumerate(g.constvars):
        out.append(f'  c{i} [label="const {namer.decl(v)}", shape=note];')
        producer[v.id] = f"c{i}"
    for i, v in enumerate(g.invars):
        out.append(f'  in{i} [label="{namer.decl(v)}", shape=ellipse];')
        producer[v.id] = f"in{i}"
    for i, e in enumerate(g.eqns):
        label = e.prim.name + "\\n" + " ".join(v.aval.str_short() for v in e.outputs)
        out.append(f'  e{i} [label="{label}", shape=box];')
        for a in e.inputs:
            if isinstance(a, Var) and a.id in producer:
                out.append(f"  {producer[a.id]} -> e{i};")
        for v in e.outputs:
            producer[v.id] = f"e{i}"
    for i, v in enumerate(g.outvars):
        out.append(f'  out{i} [label="out {i}", shape=ellipse];')
        if isinstance(v, Var) and v.id in producer:
            out.append(f"  {producer[v.id]} -> out{i};")
    out.append("}")
    return "\n".join(out)


# ---- evaluation and checking ---------------------------------------------------------------

def eval_graph(g: Graph, args: Sequence, apply: Callable, consts: Sequence | None = None) -> list:
    """Interpret a graph: `apply(eqn, input_values) -> output values` runs each equation."""
    env: dict[int, Any] = {}
    for v, x in zip(g.constvars, g.consts if consts is None else consts):
        env[v.id] = x
    for v, x in zip(g.invars, args, strict=True):
        env[v.id] = x

    def read(a):
        return a.val if isinstance(a, Literal) else env[a.id]

    for e in g.eqns:
        outs = apply(e, [read(a) for a in e.inputs])
        for v, x in zip(e.outputs, outs, strict=True):
            env[v.id] = x
    return [read(v) for v in g.outvars]


def typecheck_graph(g: Graph) -> None:
    """Check that every variable is defined once before use and every equation's avals agree
    with its primitive's shape rule. Raises AssertionError on an internal inconsistency."""
    defined: set[int] = set()
    for v in (*g.constvars, *g.invars):
        assert v.id not in defined, f"variable {v} bound twice"
        defined.add(v.id)
    for e in g.eqns:
        for a in e.inputs:
            assert isinstance(a, Literal) or a.id in defined, f"{a} used before definition in {e.prim}"
        for k, v in e.params.items():  # the bodies of control flow, each on its own
            for sub in ((v,) if isinstance(v, Graph) else v if _is_subgraph(v) else ()):
                try:
                    typecheck_graph(sub)
                except AssertionError as err:
                    raise AssertionError(f"in {e.prim.name}'s {k}: {err}") from err
        try:
            expected = e.prim.abstract_eval(*[a.aval for a in e.inputs], **e.params)
        except ShapeError as err:
            raise AssertionError(f"equation {e.prim.name} does not type-check: {err}") from err
        for v, want in zip(e.outputs, expected, strict=True):
            assert (v.aval.shape, v.aval.dtype) == (want.shape, want.dtype), \
                f"{e.prim.name}: output {v.aval} but the rule gives {want}"
            assert v.id not in defined, f"variable {v} bound twice"
            defined.add(v.id)
    for v in g.outvars:
        assert isinstance(v, Literal) or v.id in defined, f"output {v} undefined"
