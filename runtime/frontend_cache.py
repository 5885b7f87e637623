"""The persistent cache of compile front ends: a traced graph -> its optimised graph, its fusion
regions and their lowered kernels — what the passes, fusion and lowering make of it, device-
independent and more than half of a warm first call of the training step (the kernels' object
code is cached per kernel by the backends).

Keyed by the graph's text, its constants' bytes, the configuration that decides compiles and a
digest of the compiler's own source (ir/), so edited code never reads an old entry. Entries are
JSON, never pickle (nothing read from disk is unpickled): variables, equations and expression
nodes become indices into tables, parameters tagged values (tuples, dtypes, arrays as bytes).
Anything that does not encode (a parameter of another kind) is simply not cached. An entry holds
its own key, and its graph's inputs and outputs must be those of the graph being compiled: an
entry that does not decode, belongs to another key (a swapped payload under a recomputed header)
or does not fit, or a front end that then fails to compile (`discard`), is a miss like a corrupt
entry: removed with a CacheWarning, and the compile goes the long way and replaces it."""
from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import os
import warnings
import weakref

import numpy as np

from tilefuse.ir import dtypes
from tilefuse.ir import primitives as P
from tilefuse.ir import symbolic
from tilefuse.ir.core import Eqn, Graph, Literal, ShapedArray, Var
from tilefuse.ir.kernel.ir import Buffer, Kernel, KExpr, Store
from tilefuse.ir.kernel.lower import LoweredKernel
from tilefuse.ir.passes.fusion import Region

from . import compile_cache
from .config import config

log = logging.getLogger("tilefuse")
FORMAT = 2  # 2: the entry holds its key
_KERNEL_META = ("kind", "eqns", "operands", "sources")  # the rest of meta is caches


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """A hash of the compiler's front-end source (every .py under ir/)."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ir")
    h = hashlib.sha256(str(FORMAT).encode())
    for root, dirs, files in sorted(os.walk(here)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(root, name), "rb") as f:
                    h.update(name.encode() + f.read())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _cache():
    return compile_cache.CompileCache("frontend", compile_cache.default_dir())


def key(graph: Graph, fuse: bool) -> str | None:
    """The entry's key, or None when the cache does not apply (no disk cache; dumping and
    debugging, which want the passes to run; a graph its text does not decide)."""
    if config.dump_dir or config.debug or _cache().dir is None:
        return None
    text = _text(graph)
    if text is None:
        return None
    consts = [(np.asarray(c).dtype.str, np.shape(c), hashlib.sha256(np.ascontiguousarray(c).tobytes()).hexdigest())
              for c in graph.consts]
    return compile_cache.make_key("frontend", _code_digest(), text, consts, fuse, config.cache_key())


_texts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> its _text (graphs are frozen)


def _text(graph: Graph) -> str | None:
    """The graph's text with what printing leaves out (weak types, the user's lines that errors
    and the profiler name); None when a parameter is a graph, a function or hidden (printing
    abbreviates those). Kept per graph: a tiered build asks whether the graph was built before,
    then compiles it (~20 ms a time for 1,500 equations)."""
    try:
        return _texts[graph]
    except KeyError:
        text = _texts[graph] = _graph_text(graph)
        return text


def _graph_text(graph: Graph) -> str | None:
    weak = []
    for e in graph.eqns:
        for k, v in e.params.items():
            if k.startswith("_") or isinstance(v, Graph) or (callable(v) and not isinstance(v, type)):
                return None
        weak.append("".join("w" if a.aval.weak_type else "." for a in (*e.inputs, *e.outputs)))
    weak.append("".join("w" if v.aval.weak_type else "." for v in (*graph.invars, *graph.outvars)))
    return "\n".join([str(graph), " ".join(weak), *(e.source for e in graph.eqns)])


def load(k: str | None, graph: Graph):
    """(optimised graph, regions, lowered kernels per region) for `graph`, or None on a miss."""
    def decode(d):
        front = _Decoder(d).front()
        g = front[0]
        if [v.aval.strip_weak() for v in g.invars] != [v.aval.strip_weak() for v in graph.invars] or \
                [v.aval.strip_weak() for v in g.outvars] != [v.aval.strip_weak() for v in graph.outvars]:
            raise ValueError("its inputs or outputs are not the graph's")
        return front
    return _read(k, decode)


def _read(k: str | None, decode):
    """decode(the entry under k, its key checked), or None on a miss: an entry that does not
    decode (damaged past its checksum, in any way) is removed, with a warning."""
    if k is None:
        return None
    payload = _cache().load(k)
    if payload is None:
        return None
    try:
        d = json.loads(payload)
        if d.get("key") != k:
            raise ValueError("it is the entry of another graph")
        return decode(d)
    except Exception as e:  # noqa: BLE001 - damaged past its checksum, in any way: a miss
        discard(k, e)
        return None


def discard(k: str, e: Exception) -> None:
    """Drop an entry that did not decode or whose front end failed: it is compiled anew."""
    compile_cache._count("corrupt")
    warnings.warn(f"tilefuse: the front-end cache entry {_cache().path(k)} cannot be used "
                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); it is ignored and "
                  "rebuilt", compile_cache.CacheWarning, stacklevel=3)
    _cache().remove(k)


def _built_key(k: str | None, device) -> str | None:
    """None where the device has no description to key it by (a test's stand-in)."""
    fingerprint = getattr(getattr(device, "info", None), "fingerprint", None)
    if k is None or fingerprint is None:
        return None
    return compile_cache.make_key("built", k, getattr(device, "name", ""), fingerprint)


def mark_built(k: str | None, device) -> None:
    """Record that the graph under key k compiled whole for `device` (its kernels are in the
    caches): tiered execution's background build then needs no child process (runtime/tiered.py)."""
    bk = _built_key(k, device)
    if bk is not None and _cache().load(bk) is None:  # (a warm compile reads it, writes nothing)
        _cache().store(bk, b"{\"built\": true}")  # (JSON, as every entry of this cache)


def was_built(k: str | None, device) -> bool:
    bk = _built_key(k, device)
    return bk is not None and _cache().has(bk)


def store(k: str | None, graph: Graph, regions, lowered) -> None:
    if k is None:
        return
    try:
        payload = json.dumps({**_Encoder().front(graph, regions, lowered), "key": k}, separators=(",", ":"))
    except _Unencodable as e:
        log.info("tilefuse: front end not cached (%s)", e)
        return
    _cache().store(k, payload.encode())


def encode_graph(graph: Graph) -> str | None:
    """A graph as JSON (for a compile in another process: runtime/compile_child.py), or None
    where a parameter has no encoding (a subgraph, a function)."""
    try:
        return json.dumps(_Encoder().front(graph, [], []), separators=(",", ":"))
    except _Unencodable:
        return None


def decode_graph(text: str) -> Graph:
    return _Decoder(json.loads(text)).front()[0]


# ---- a shape-generic trace's front end ------------------------------------------------------------
# The front end of a template (tracer/shape_poly.FrontEnd: its graph traced with symbolic sizes,
# optimised and partitioned once for every instance its guards admit), kept as the concrete ones
# are, with its guards; keyed by the template's own text (its sizes as expressions, the symbols'
# values at its trace, which its guards' answers are of). The child process makes it beside a cold
# compile (runtime/compile_child.py), so the first call at a new batch size, in this process or a
# later one, loads it instead of running the passes on the template (~250 ms for the char-GPT step).

_template_texts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> encode_template's


def encode_template(graph: Graph, hints) -> str | None:
    """A template's graph and its symbols' values at the trace as JSON (the child's request and
    the entry's key), or None where something does not encode; kept per graph."""
    try:
        return _template_texts[graph]
    except KeyError:
        pass
    try:
        text = json.dumps({**_Encoder().front(graph, [], []), "hints": [int(h) for h in hints]},
                          separators=(",", ":"))
    except (_Unencodable, TypeError, ValueError) as e:
        log.info("tilefuse: template not encoded (%s)", e)
        text = None
    _template_texts[graph] = text
    return text


def decode_template(text: str) -> tuple:
    """(graph, ShapeEnv of its symbols, frozen as after a trace) from encode_template's text."""
    d = json.loads(text)
    env = symbolic.ShapeEnv()
    env.hints = [int(h) for h in d["hints"]]
    graph = _Decoder(d, env).front()[0]  # (before freeze: a frozen env's avals would be its ints)
    env.freeze()
    return graph, env


def template_key(text: str | None) -> str | None:
    """The entry's key for encode_template's text, or None where the cache does not apply."""
    if text is None or config.dump_dir or config.debug or _cache().dir is None:
        return None
    return compile_cache.make_key("template-front", _code_digest(), text, config.cache_key())


def store_template(k: str | None, hints, g: Graph, regions, guards: dict) -> None:
    """A template's front end (optimised graph, regions, the guards it recorded) under key k, its
    symbols' values at the trace `hints`."""
    if k is None or _cache().has(k):
        return
    try:
        rows = [[op, _value(lhs), _value(rhs), bool(answer)] for op, lhs, rhs, answer in guards.values()]
        payload = json.dumps({**_template_front(g, regions), "guards": rows, "key": k,
                              "hints": [int(h) for h in hints]}, separators=(",", ":"))
    except (_Unencodable, TypeError, ValueError) as e:
        log.info("tilefuse: template front end not cached (%s)", e)
        return
    _cache().store(k, payload.encode())


def has_template(k: str | None) -> bool:
    return k is not None and _cache().has(k)


def front_text(g: Graph, regions) -> str:
    """A template's front end as store_template writes it, its guards aside (TILEFUSE_CHECK
    compares a stored one with the passes')."""
    return json.dumps(_template_front(g, regions), separators=(",", ":"))


def _template_front(g: Graph, regions) -> dict:
    return _Encoder().front(g, regions, [[] for _ in regions])  # (lowered per instance, not kept)


def load_template(k: str | None, env) -> tuple | None:
    """(optimised graph, regions, guards) under key k, its sizes over env's symbols, or None on a
    miss (an entry that does not decode: removed, as ever)."""
    def decode(d):
        if d.get("hints") != list(env.hints):
            raise ValueError("it is the entry of a template traced at other sizes")
        with env.recording():  # (the trace's env is frozen: its avals would be its ints)
            g, regions, _ = _Decoder(d, env).front()
            guards = {}
            for op, lhs, rhs, answer in d["guards"]:
                if op not in ("==", "<", "<="):
                    raise ValueError(f"a guard {op!r}")
                key, entry = symbolic.guard_entry(op, _unvalue(lhs, env), _unvalue(rhs, env), bool(answer))
                guards[key] = entry
        return g, regions, guards
    return _read(k, decode)


# ---- encoding ---------------------------------------------------------------------------------

class _Unencodable(Exception):
    pass


def _value(v):
    """A parameter or constant as JSON: scalars as they are, the rest tagged (a symbolic size as
    its expression: a shape-generic trace's template)."""
    if type(v) is symbolic.Dim:
        return {"dim": symbolic.key_json(v.key)}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tuple):
        return {"t": [_value(x) for x in v]}
    if isinstance(v, list):
        return {"l": [_value(x) for x in v]}
    if isinstance(v, dict):
        return {"d": [[_value(a), _value(b)] for a, b in v.items()]}
    if isinstance(v, np.dtype):
        return {"dt": v.name}
    if isinstance(v, P.ScalarFn):  # a fused_gemm's epilogue: its rows of names, numbers, values
        return {"sf": _value(v.to_rows())}
    if isinstance(v, (np.ndarray, np.generic)):
        a = np.ascontiguousarray(v)
        return {"a": [a.dtype.name, list(a.shape), base64.b64encode(a.tobytes()).decode()],
                "s": isinstance(v, np.generic)}
    raise _Unencodable(f"a value of type {type(v).__name__}")


def _unvalue(v, env=None):
    """_value's inverse; a size expression over env's symbols (none: not a template's entry)."""
    if not isinstance(v, dict):
        return v
    if "t" in v:
        return tuple(_unvalue(x, env) for x in v["t"])
    if "l" in v:
        return [_unvalue(x, env) for x in v["l"]]
    if "d" in v:
        return {_unvalue(a, env): _unvalue(b, env) for a, b in v["d"]}
    if "dim" in v:
        if env is None:
            raise ValueError("a symbolic size in a concrete graph's entry")
        return symbolic.dim_of_key(env, v["dim"])
    if "dt" in v:
        return dtypes.canonicalize(v["dt"])
    if "sf" in v:
        return P.ScalarFn.from_rows(_unvalue(v["sf"]))
    name, shape, data = v["a"]
    a = np.frombuffer(base64.b64decode(data), dtypes.canonicalize(name)).reshape(shape).copy()
    return a[()] if v["s"] else a


def _aval(a: ShapedArray) -> list:
    return [[_value(d) for d in a.shape], a.dtype.name, a.weak_type]


def _unaval(x, env=None) -> ShapedArray:
    return ShapedArray(tuple(_unvalue(d, env) for d in x[0]), dtypes.canonicalize(x[1]), x[2])


class _Encoder:
    """Tables of variables, equations and expression nodes, filled as they are met."""

    def __init__(self):
        self.vars: dict[int, int] = {}
        self.var_avals: list = []
        self.eqns: dict[int, int] = {}
        self.eqn_rows: list = []
        self.nodes: dict[int, int] = {}  # id(node) -> number (the kernels keep the nodes alive)
        self.node_rows: list = []

    def var(self, v: Var) -> int:
        i = self.vars.get(v.id)
        if i is None:
            i = self.vars[v.id] = len(self.var_avals)
            self.var_avals.append(_aval(v.aval))
        return i

    def atom(self, a):
        if isinstance(a, Literal):
            return {"lit": _value(a.val), "aval": _aval(a.aval)}
        return self.var(a)

    def eqn(self, e: Eqn) -> int:
        i = self.eqns.get(id(e))
        if i is None:
            row = [e.prim.name, [self.atom(a) for a in e.inputs], [self.var(o) for o in e.outputs],
                   _value(e.params), e.source]
            i = self.eqns[id(e)] = len(self.eqn_rows)
            self.eqn_rows.append(row)
        return i

    def node(self, root: KExpr) -> int:
        """root's number; its operands numbered first. By object, not by value: comparing equal
        expressions built apart walks them whole, and a hashed DAG (Threefry) is exponential so."""
        stack = [root]
        while stack:
            n = stack[-1]
            if id(n) in self.nodes:
                stack.pop()
                continue
            pending = [s for s in n.src if id(s) not in self.nodes]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            self.nodes[id(n)] = len(self.node_rows)
            self.node_rows.append([n.op, n.dtype.name, [self.nodes[id(s)] for s in n.src], _value(n.arg)])
        return self.nodes[id(root)]

    def kernel(self, k: Kernel) -> dict:
        meta = {}
        for name in _KERNEL_META:
            if name in k.meta:
                v = k.meta[name]
                meta[name] = [self.eqn(e) for e in v] if name == "eqns" else \
                    [self.var(x) for x in v] if name == "operands" else _value(v)
        return {"name": k.name, "buffers": [[b.name, b.dtype.name, b.size] for b in k.buffers],
                "n_inputs": k.n_inputs, "shape": list(k.shape), "reduce_shape": list(k.reduce_shape),
                "stores": [[s.buffer, self.node(s.offset), self.node(s.value), s.mode] for s in k.stores],
                "meta": meta}

    def lowered(self, lk: LoweredKernel) -> dict:
        return {"kernel": self.kernel(lk.kernel), "args": [self.var(v) for v in lk.args]}

    def front(self, g: Graph, regions, lowered) -> dict:
        graph = {"constvars": [self.var(v) for v in g.constvars], "invars": [self.var(v) for v in g.invars],
                 "eqns": [self.eqn(e) for e in g.eqns], "outvars": [self.atom(v) for v in g.outvars],
                 "consts": [_value(np.asarray(c)) for c in g.consts], "meta": _value(g.meta)}
        regs = [{"eqns": [self.eqn(e) for e in r.eqns], "inputs": [self.var(v) for v in r.inputs],
                 "outputs": [self.var(v) for v in r.outputs], "kind": r.kind, "rows": bool(r.meta.get("rows"))}
                for r in regions]
        kernels = [[self.lowered(lk) for lk in lks] for lks in lowered]
        return {"format": FORMAT, "vars": self.var_avals, "eqns": self.eqn_rows, "nodes": self.node_rows,
                "graph": graph, "regions": regs, "lowered": kernels}


class _Decoder:
    def __init__(self, d: dict, env=None):
        if d.get("format") != FORMAT:
            raise ValueError(f"format {d.get('format')}")
        self.d, self.env = d, env  # (env: a template's ShapeEnv, for its symbolic sizes)
        self.vars = [Var(_unaval(a, env)) for a in d["vars"]]  # new variables, new ids
        self.eqns: list = []
        for name, ins, outs, params, source in d["eqns"]:
            # (a size used as a value is in templates only: not in the registry)
            prim = P.dim_value if name == "dim_value" and env is not None else P.PRIMITIVES[name]
            self.eqns.append(Eqn(prim, tuple(self.atom(a) for a in ins),
                                 tuple(self.vars[i] for i in outs), _unvalue(params, env), source))
        self.nodes: list = []
        for op, dt, src, arg in d["nodes"]:
            self.nodes.append(KExpr(op, dtypes.canonicalize(dt), tuple(self.nodes[i] for i in src),
                                    _unvalue(arg)))

    def atom(self, a):
        if isinstance(a, dict):
            aval = _unaval(a["aval"], self.env)
            return Literal(_unvalue(a["lit"], self.env), aval)
        return self.vars[a]

    def kernel(self, k: dict) -> Kernel:
        meta = {}
        for name, v in k["meta"].items():
            meta[name] = tuple(self.eqns[i] for i in v) if name == "eqns" else \
                tuple(self.vars[i] for i in v) if name == "operands" else _unvalue(v)
        return Kernel(k["name"], tuple(Buffer(n, dtypes.canonicalize(dt), size) for n, dt, size in k["buffers"]),
                      k["n_inputs"], tuple(k["shape"]), tuple(k["reduce_shape"]),
                      tuple(Store(b, self.nodes[o], self.nodes[v], mode) for b, o, v, mode in k["stores"]),
                      meta=meta)

    def front(self):
        d, V, E = self.d, self.vars, self.eqns
        g = d["graph"]
        graph = Graph(tuple(V[i] for i in g["constvars"]), tuple(V[i] for i in g["invars"]),
                      tuple(E[i] for i in g["eqns"]), tuple(self.atom(a) for a in g["outvars"]),
                      tuple(_unvalue(c) for c in g["consts"]), _unvalue(g["meta"], self.env))
        lowered = [[LoweredKernel(self.kernel(lk["kernel"]), tuple(V[i] for i in lk["args"])) for lk in lks]
                   for lks in d["lowered"]]
        regions = [Region(tuple(E[i] for i in r["eqns"]), tuple(V[i] for i in r["inputs"]),
                          tuple(V[i] for i in r["outputs"]), r["kind"],
                          {"rows": True, "lowered": lks} if r["rows"] else {})
                   for r, lks in zip(d["regions"], lowered)]
        return graph, regions, lowered
