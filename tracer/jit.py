"""jit: trace once per signature (once for all the sizes a shape-generic trace's guards allow:
shape_poly.py), cache, and run the compiled graph on a device."""
from __future__ import annotations

import functools
import inspect
import itertools
import logging
import threading
import weakref
from typing import Any, Callable

import numpy as np

from tilefuse.ir import dtypes
from tilefuse.ir.core import Graph, ShapedArray, eval_graph, gc_paused
from tilefuse.ir.errors import (ArgumentError, StaticArgumentError, TilefuseError, for_user,
                                 user_line)
from tilefuse.ir.passes.manager import prepare_for_ad
from tilefuse.ir.symbolic import is_symbolic

from . import pytree, shape_poly
from .core import Tracer, bind, get_aval
from .staging import trace_to_graph

log = logging.getLogger("tilefuse.jit")


class RuntimeHooks:
    """What jit needs from the runtime; installed by the `tilefuse` package (layers point down)."""
    resolve_device: Callable = None  # (device_arg, leaves) -> Device
    compile: Callable = None  # (graph, device) -> executable(list of leaves) -> list of Arrays
    config: Any = None  # tilefuse.config
    array_type: type = None  # runtime.Array: the fast path recognises it by exact type


hooks = RuntimeHooks()

# Code objects of every function jitted so far: a fresh jit(f) of code seen before is the
# commonest cause of retracing (jit inside a loop, a new lambda per call), so explain_retrace
# names it. Bounded, since code objects cannot be weakly referenced.
_seen_code: dict = {}
_SEEN_CODE_MAX = 4096


def _python_scalar_aval(x) -> ShapedArray | None:
    if isinstance(x, int) and not isinstance(x, bool) and not -2**31 <= x < 2**31:
        return None
    return ShapedArray((), dtypes.python_scalar_dtype(x), True)


def _leaf_aval(x, where: str) -> ShapedArray:
    if isinstance(x, Tracer) or hasattr(x, "aval"):
        return x.aval
    if isinstance(x, (bool, int, float)) and not isinstance(x, np.generic):
        aval = _python_scalar_aval(x)
        if aval is None:
            raise ArgumentError(f"{where} is the Python int {x}, which does not fit int32: "
                                "pass np.int64(...) or an int64 array")
        return aval
    if isinstance(x, (np.ndarray, np.generic)):
        if x.dtype == object:
            raise ArgumentError(f"{where} is an object array; tilefuse needs numeric arrays")
        return ShapedArray(x.shape, dtypes.canonicalize(x.dtype))
    raise ArgumentError(f"{where} is a {type(x).__name__}, not an array: pass arrays (or pytrees "
                        "of arrays), or mark it static with static_argnums=/static_argnames=")


class Lowered:
    """A traced function: its graph, and the device it compiles for."""

    def __init__(self, graph: Graph, out_tree, device, in_tree):
        self.graph, self.out_tree, self.device, self.in_tree = graph, out_tree, device, in_tree

    def __str__(self):
        return str(self.graph)

    def as_text(self) -> str:
        return str(self.graph)

    def compile(self):
        return hooks.compile(self.graph, self.device)

    def optimized_graph(self):
        """The graph after the device's pass pipeline (what its kernels are built from)."""
        return self.compile().optimized_graph

    def sources(self) -> dict[str, str]:
        """Every generated kernel's source text for the device (LLVM IR, OpenCL C, PTX)."""
        return self.compile().sources()


class _Entry:
    """A cache entry: the compiled executable and how to rebuild the output pytree; for eviction,
    its keys (in _cache, _graphs and the fast keys that lead to it) and when it was last used."""
    __slots__ = ("executable", "out_tree", "single", "key", "gkey", "fast_keys", "used")

    def __init__(self, executable, out_tree, key, gkey):
        self.executable, self.out_tree, self.key, self.gkey = executable, out_tree, key, gkey
        self.single = out_tree is pytree.LEAF
        self.fast_keys: list = []
        self.used = next(_clock)


# A hit stamps its entry from this clock (cheaper per call than reordering a dict); the entry
# with the oldest stamp is evicted when a function's cache passes config.jit_cache_size.
_clock = itertools.count()
_live: weakref.WeakSet = weakref.WeakSet()  # every JitFunction, for clear_all


def _cache_limit() -> int:
    """Entries one jitted function keeps: config.jit_cache_size, or no bound when it is 0."""
    limit = getattr(hooks.config, "jit_cache_size", 0)
    return limit if limit and limit > 0 else 1 << 62


def clear_all() -> None:
    """Every jitted function's compiled entries and traced graphs dropped (tx.clear_caches)."""
    for fn in list(_live):
        fn.clear_cache()


class JitFunction:
    """A jitted function: a cache of compiled graphs keyed by the call's signature
    (treedef, avals, static arguments, device, configuration)."""

    def __init__(self, fun: Callable, static_argnums=(), static_argnames=(), device=None):
        if not callable(fun):
            raise ArgumentError(f"jit needs a function, got a {type(fun).__name__}: {fun!r:.60}")
        functools.update_wrapper(self, fun)
        self.fun = fun
        self._name = getattr(fun, "__name__", type(fun).__name__)  # partials and callables have none
        try:
            self._signature = inspect.signature(fun)
        except (TypeError, ValueError):
            self._signature = None
        params = list(self._signature.parameters.values()) if self._signature else []
        self._param_names = [p.name for p in params
                             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        n = len(self._param_names)
        nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums or ())
        names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames or ())
        _check_static(self._name, params if self._signature else None, nums, names)
        self.static_argnums = {i + n if i < 0 and n else i for i in nums}
        self.static_argnames = set(names)
        for i in list(self.static_argnums):  # a static position is static by name too
            if i < n:
                self.static_argnames.add(self._param_names[i])
        for name in list(self.static_argnames):
            if name in self._param_names:
                self.static_argnums.add(self._param_names.index(name))
        self.device = device
        self._method_self = False  # set when used as a method: `self` is static unless a pytree
        self._general_only = bool(self.static_argnums)  # static arguments skip the fast path
        self._cache: dict = {}  # full key -> _Entry
        self._fast: dict = {}  # fast key (plain positional arrays) -> _Entry
        self._graphs: dict = {}
        self._templates: dict = {}  # (in_tree, static) -> [shape_poly.Template], newest first
        self._trace_keys: list = []  # keys traced so far, for explain_retrace
        self.trace_count = 0
        self._track_code = True
        # threads that miss the cache at once: one traces and compiles, the others wait and hit
        self._lock = threading.RLock()
        _live.add(self)

    def __repr__(self):
        return f"<jit {getattr(self.fun, '__qualname__', self.fun)}>"

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        self._method_self = self._general_only = True
        return _BoundJit(self, obj)

    # ---- the call path ----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        # The cache-hit path for plain positional arrays: a key made inline (no call per
        # argument), one dict lookup, the launch. Every argument a numpy array, an Array or a
        # Python scalar; anything else goes down the general path.
        # An error leaves with our frames cut from its traceback (errors.for_user; this one boundary stays).
        try:
            if kwargs or self._general_only:
                return self._call(args, kwargs, None)
            sig = []
            array_type = hooks.array_type
            for a in args:
                t = type(a)
                if t is array_type:  # an uncommitted Array follows the others: a different key
                    sig.append((a.aval, a.device, a.committed))
                elif t is np.ndarray:
                    sig.append((a.shape, a.dtype))
                elif t is float or t is bool or (t is int and -2**31 <= a < 2**31):
                    sig.append(t)
                else:
                    return self._call(args, kwargs, None)
            key = (*sig, hooks.config.cache_key())
            entry = self._fast.get(key)
            if entry is None:
                return self._call(args, kwargs, key)
            entry.used = next(_clock)
            outs = entry.executable(args)
            return outs[0] if entry.single else pytree.tree_unflatten(entry.out_tree, outs)
        except Exception as e:  # (ours, or the user's code's: what the user sees)
            raise for_user(e)

    def _run(self, entry, leaves):
        outs = entry.executable(leaves)
        return outs[0] if entry.single else pytree.tree_unflatten(entry.out_tree, outs)

    def _call(self, args, kwargs, fast_key):
        dyn_args, dyn_kwargs, static = self._split(args, kwargs)
        leaves, in_tree = pytree.tree_flatten((dyn_args, dyn_kwargs))
        if any(isinstance(x, Tracer) for x in leaves):
            # Under another transformation (grad, vmap, an outer jit): replay our graph on its
            # tracers so that transformation sees every primitive.
            avals = tuple(x.aval.strip_weak() if isinstance(x, Tracer) else get_aval(x) for x in leaves)
            if any(is_symbolic(a.shape) for a in avals):  # inside a shape-generic trace: inlined,
                return self.fun(*args, **kwargs)  # since a cache key would need the sizes' values
            graph, out_tree = self._graph(static, avals, in_tree,
                                          (in_tree, avals, static, None, hooks.config.cache_key()))
            if graph is None:
                return self.fun(*args, **kwargs)
            graph = prepare_for_ad(graph)  # a grad outside differentiates fused attention whole
            outs = eval_graph(graph, leaves, lambda e, xs: bind(e.prim, *xs, **e.params))
            return pytree.tree_unflatten(out_tree, outs)
        avals = self._avals(leaves, in_tree)
        device = hooks.resolve_device(self.device, leaves)
        key = (in_tree, avals, static, device, hooks.config.cache_key())
        entry = self._cache.get(key)
        if entry is None:
            with self._lock:
                entry = self._cache.get(key) or self._compile(key, static, avals, in_tree, device)
            if entry is None:  # it closes over tracers: no staging possible
                return self.fun(*args, **kwargs)
        entry.used = next(_clock)
        if fast_key is not None:
            with self._lock:  # (not for an entry another thread evicted meanwhile)
                if self._cache.get(key) is entry and fast_key not in self._fast:
                    self._fast[fast_key] = entry
                    entry.fast_keys.append(fast_key)
        return self._run(entry, leaves)

    def _split(self, args, kwargs):
        """Separate static arguments (part of the key, passed to fun as they are) from traced ones."""
        static = []
        if self.static_argnums or self._method_self:
            dyn_args = []
            for i, a in enumerate(args):
                if i in self.static_argnums or (i == 0 and self._method_self and not pytree.is_node(a)):
                    static.append((i, _hashable(a, self._argname(i))))
                else:
                    dyn_args.append(a)
            dyn_args = tuple(dyn_args)
        else:
            dyn_args = args
        dyn_kwargs = kwargs
        if kwargs and self.static_argnames:
            dyn_kwargs = {}
            for k, v in kwargs.items():
                if k in self.static_argnames:
                    static.append((k, _hashable(v, repr(k))))
                else:
                    dyn_kwargs[k] = v
        return dyn_args, dyn_kwargs, tuple(static)

    def _argname(self, i):
        return repr(self._param_names[i]) if i < len(self._param_names) else f"#{i}"

    def _rebuild_call(self, static, dyn_leaves, in_tree):
        dyn_args, dyn_kwargs = pytree.tree_unflatten(in_tree, dyn_leaves)
        s = dict(static)
        args, it = [], iter(dyn_args)
        n = len(dyn_args) + sum(1 for k in s if isinstance(k, int))
        for i in range(n):
            args.append(s[i][0] if i in s else next(it))
        kwargs = dict(dyn_kwargs)
        kwargs.update({k: v[0] for k, v in s.items() if isinstance(k, str)})
        return args, kwargs

    def _avals(self, leaves, in_tree):
        try:
            return tuple(_leaf_aval(x, "") for x in leaves)
        except TilefuseError:
            pass
        names = self._leaf_names(in_tree)  # name the offending argument
        return tuple(_leaf_aval(x, f"argument {names[i]} of {self._name}") for i, x in enumerate(leaves))

    def _leaf_names(self, in_tree, static=()):
        """A readable name for every leaf: the parameter's name (and the leaf's path within it)."""
        static_pos = {k for k, _ in static if isinstance(k, int)} | self.static_argnums
        dyn_positions = [i for i in range(len(self._param_names) + 256) if i not in static_pos]
        args_def, kw_def = in_tree.children
        names = []
        for j, c in enumerate(args_def.children):
            base = self._argname(dyn_positions[j])
            names += [base if c.node_type is None else f"{base}{p}" for p in pytree.leaf_paths(c)]
        for key, c in zip(kw_def.aux or (), kw_def.children):
            names += [repr(key) if c.node_type is None else f"{key!r}{p}" for p in pytree.leaf_paths(c)]
        return names

    def _graph(self, static, avals, in_tree, trace_key, generic=False):
        """The graph for these avals: traced before, instantiated from a shape-generic trace
        (`generic`, where the caller compiles it) or traced now."""
        gkey = (in_tree, avals, static)
        hit = self._graphs.get(gkey)
        if hit is None:
            with self._lock, gc_paused():
                hit = self._graphs.get(gkey) or (generic and self._instantiate(gkey, trace_key)) or \
                    self._trace(gkey, static, avals, in_tree, trace_key, generic)
        return hit

    def _remember(self, gkey, result):
        if len(self._graphs) >= _cache_limit():  # (graphs traced under grad or vmap have no entry)
            del self._graphs[next(iter(self._graphs))]
        self._graphs[gkey] = result
        return result

    def _instantiate(self, gkey, trace_key):
        """The graph for gkey's avals from a shape-generic trace whose guards hold for them."""
        in_tree, avals, static = gkey
        for template in self._templates.get((in_tree, static), ()):
            values = template.bind(avals)
            if values is not None:
                if hooks.config.explain_retrace and self._trace_keys:
                    reasons = explain_retrace(self._trace_keys[-1], trace_key,
                                              self._leaf_names(in_tree, static), self._argname)
                    where = user_line()
                    log.warning("tilefuse: %s compiled again%s, its trace reused for the new sizes, "
                                "because: %s", getattr(self.fun, "__qualname__", self._name),
                                f" at {where}" if where else "", "; ".join(reasons))
                if len(self._trace_keys) < 64:
                    self._trace_keys.append(trace_key)
                graph = template.instance(values)
                if hooks.config.check:  # (TILEFUSE_CHECK) the trace it stands for, compared
                    self._check_instance(graph, gkey)
                return self._remember(gkey, (graph, template.out_tree))
        return None

    def _check_instance(self, graph, gkey) -> None:
        in_tree, avals, static = gkey
        want, _ = trace_to_graph(self._flat_fun(static, in_tree), list(avals))
        if str(graph) != str(want):
            raise TilefuseError(f"{self._name}: the graph instantiated for sizes "
                                f"{[a.shape for a in avals]} differs from its trace: a tilefuse bug "
                                "(tx.config.shape_generic = False avoids it)")

    def _flat_fun(self, static, in_tree):
        """fun over flat argument leaves -> (output leaves, output tree): what a trace runs."""
        def flat_fun(*tracers):
            args, kwargs = self._rebuild_call(static, tracers, in_tree)
            if self._signature is not None:  # a wrong call is the caller's mistake, named so
                try:
                    self._signature.bind(*args, **kwargs)
                except TypeError as e:
                    raise ArgumentError(f"{self._name}() cannot take these arguments: {e}") from None
            out = self.fun(*args, **kwargs)
            out_leaves, out_tree = pytree.tree_flatten(out)
            for i, o in enumerate(out_leaves):
                if not (isinstance(o, Tracer) or hasattr(o, "aval") or
                        isinstance(o, (np.ndarray, np.generic, bool, int, float))):
                    raise ArgumentError(f"{self._name} returned a {type(o).__name__} (output leaf "
                                        f"{i}); jitted functions must return arrays or pytrees of arrays")
            return out_leaves, out_tree
        return flat_fun

    def _trace(self, gkey, static, avals, in_tree, trace_key, generic=False):
        code = getattr(self.fun, "__code__", None)
        seen_before = self.trace_count == 0 and code is not None and code in _seen_code
        if hooks.config is not None and hooks.config.explain_retrace:
            self._explain(trace_key, in_tree, static, seen_before)
        if self._track_code and code is not None and len(_seen_code) < _SEEN_CODE_MAX:
            _seen_code[code] = True
        self.trace_count += 1
        if len(self._trace_keys) < 64:
            self._trace_keys.append(trace_key)
        flat_fun = self._flat_fun(static, in_tree)

        if generic and hooks.config.shape_generic:
            result = self._trace_generic(flat_fun, gkey)
            if result is not None:
                return self._remember(gkey, result)
        graph, out_tree = trace_to_graph(flat_fun, list(avals))
        result = (None, None) if any(isinstance(c, Tracer) for c in graph.consts) else (graph, out_tree)
        return self._remember(gkey, result)

    def _trace_generic(self, flat_fun, gkey):
        """Trace with symbolic sizes; keep the template where some size stayed symbolic, and
        return the graph at this call's sizes. None where the symbolic trace fails or closes
        over tracers: the caller traces concretely (and raises the concrete trace's error)."""
        in_tree, avals, static = gkey
        env, sym_avals = shape_poly.symbolic_avals(avals)
        if env is None:
            return None
        try:
            graph, out_tree = trace_to_graph(flat_fun, list(sym_avals))
        except Exception as e:  # noqa: BLE001 - traced again concretely: its error is the one raised
            log.debug("tilefuse: %s: the shape-generic trace failed (%s: %s); tracing concretely",
                      self._name, type(e).__name__, e)
            return None
        finally:
            env.freeze()
        if any(isinstance(c, Tracer) for c in graph.consts):
            return None
        if env.all_specialised():
            return shape_poly.instantiate(graph, env.hints).graph, out_tree
        template = shape_poly.Template(graph, out_tree, env, sym_avals)
        templates = self._templates.setdefault((in_tree, static), [])
        templates.insert(0, template)
        del templates[shape_poly.TEMPLATES_MOST:]
        return template.instance(env.hints), out_tree

    def _compile(self, key, static, avals, in_tree, device):
        graph, out_tree = self._graph(static, avals, in_tree, key, generic=True)
        if graph is None:
            return None
        executable = hooks.compile(graph, device, tiered=True)
        entry = _Entry(executable, out_tree, key, (in_tree, avals, static))
        if hasattr(executable, "when_compiled"):  # tiered: the interpreter's until the compile ends
            executable.when_compiled(lambda compiled: setattr(entry, "executable", compiled))
        self._cache[key] = entry
        limit = _cache_limit()
        while len(self._cache) > limit:
            self._evict(min(self._cache.values(), key=lambda e: e.used))
        return entry

    def _evict(self, entry: _Entry) -> None:
        """Drop one entry (under the lock), with the fast keys that lead to it and its graph
        unless another entry (another device or configuration) shares it. A call running it
        meanwhile holds it and finishes; its kernels and buffers go when the last holder does."""
        del self._cache[entry.key]
        for k in entry.fast_keys:
            if self._fast.get(k) is entry:
                del self._fast[k]
        if not any(e.gkey == entry.gkey for e in self._cache.values()):
            self._graphs.pop(entry.gkey, None)
            if not any(g[0] == entry.gkey[0] and g[2] == entry.gkey[2] for g in self._graphs):
                self._templates.pop((entry.gkey[0], entry.gkey[2]), None)

    def _explain(self, key, in_tree, static, seen_before):
        """Log why this call traces (explain_retrace), as JAX's explain_cache_misses does."""
        name = getattr(self.fun, "__qualname__", self._name)
        where = user_line()
        at = f" at {where}" if where else ""
        if self._trace_keys:
            reasons = explain_retrace(self._trace_keys[-1], key, self._leaf_names(in_tree, static),
                                      self._argname)
            log.warning("tilefuse: %s traced again%s because: %s", name, at, "; ".join(reasons))
        elif seen_before:
            code = self.fun.__code__
            log.warning("tilefuse: %s traced%s because it is a new function object: code from %s:%d was "
                        "jitted before as another function (jit(f) called anew, or a lambda/closure "
                        "made afresh each time, starts an empty cache). Create the jitted function once "
                        "and reuse it.", name, at, code.co_filename, code.co_firstlineno)
        else:
            log.info("tilefuse: %s traced for the first time%s", name, at)

    # ---- inspection -----------------------------------------------------------------------
    def lower(self, *args, device=None, **kwargs) -> Lowered:
        """Trace for these arguments without running: `.graph` and str() show the graph."""
        try:
            return self._lower(args, kwargs, device)
        except Exception as e:  # (ours, or the user's code's: what the user sees)
            raise for_user(e)

    def _lower(self, args, kwargs, device) -> Lowered:
        dyn_args, dyn_kwargs, static = self._split(args, kwargs)
        leaves, in_tree = pytree.tree_flatten((dyn_args, dyn_kwargs))
        avals = tuple(x.aval.strip_weak() if isinstance(x, Tracer) else a
                      for x, a in zip(leaves, self._avals(leaves, in_tree)))
        dev = hooks.resolve_device(device if device is not None else self.device,
                                   [x for x in leaves if not isinstance(x, Tracer)])
        key = (in_tree, avals, static, dev, hooks.config.cache_key())
        graph, out_tree = self._graph(static, avals, in_tree, key)
        if graph is None:
            raise TilefuseError(f"{self._name} closes over traced values and cannot be lowered alone")
        return Lowered(graph, out_tree, dev, in_tree)

    def cache_size(self) -> int:
        return len(self._cache)

    def clear_cache(self) -> None:
        """Drop every compiled entry and traced graph: their kernels and device buffers (constants)
        go once nothing else holds them; the next call traces again."""
        with self._lock:
            self._cache.clear()
            self._fast.clear()
            self._graphs.clear()
            self._templates.clear()


class _BoundJit:
    """A jitted method bound to its instance: calls pass the instance first. The instance is a
    static argument (hashed, by identity unless its class defines __hash__) unless it is a pytree
    node (a registered dataclass, say), whose array leaves are then traced arguments. Arrays
    held by a static instance are baked into the graph as constants when it is traced."""
    __slots__ = ("_jit", "_obj")

    def __init__(self, jf: JitFunction, obj):
        self._jit, self._obj = jf, obj

    def __call__(self, *args, **kwargs):
        return self._jit(self._obj, *args, **kwargs)

    def lower(self, *args, **kwargs) -> Lowered:
        return self._jit.lower(self._obj, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._jit, name)


def _check_static(name: str, params, nums: tuple, names: tuple) -> None:
    """static_argnums must be ints naming positional parameters, static_argnames parameters
    that can be passed by keyword (unless the function takes *args / **kwargs), as in JAX."""
    for i in nums:
        if not isinstance(i, int) or isinstance(i, bool):
            raise ArgumentError(f"jit of {name}: static_argnums must be ints, got {i!r}")
    for k in names:
        if not isinstance(k, str):
            raise ArgumentError(f"jit of {name}: static_argnames must be strings, got {k!r}")
    if params is None:  # no signature to check against (some builtins)
        return
    kinds = [p.kind for p in params]
    positional = sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                     for k in kinds)
    if inspect.Parameter.VAR_POSITIONAL not in kinds:
        bad = [i for i in nums if not -positional <= i < positional]
        if bad:
            raise StaticArgumentError(f"jit of {name}: static_argnums={nums} but {name} takes "
                                      f"{positional} positional argument(s); {bad} name none")
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        by_keyword = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                           inspect.Parameter.KEYWORD_ONLY)}
        bad = [k for k in names if k not in by_keyword]
        if bad:
            raise StaticArgumentError(f"jit of {name}: static_argnames {bad} name no parameter "
                                      f"{name} takes by keyword (it takes {sorted(by_keyword)})")


def _hashable(v, name):
    try:
        hash(v)
    except TypeError as e:
        raise ArgumentError(f"static argument {name} must be hashable, got a {type(v).__name__}; "
                            "pass a tuple instead of a list, or make it a traced argument") from e
    return (v,)


def explain_retrace(old, new, names=None, static_name=None) -> list[str]:
    """Why a call traced again: the differences between its key and an earlier one."""
    (ot, oa, os_, od, oc), (nt, na, ns, nd, nc) = old, new
    reasons = []
    if ot != nt:
        reasons.append(f"the argument structure changed: {ot} -> {nt}")
    elif oa != na:
        for i, (a, b) in enumerate(zip(oa, na)):
            who = f"argument {names[i]}" if names and i < len(names) else f"input {i}"
            if a.shape != b.shape:
                reasons.append(f"{who}: new shape {a.shape} -> {b.shape}")
            elif a.dtype != b.dtype:
                reasons.append(f"{who}: new dtype {a.dtype} -> {b.dtype}")
            elif a.weak_type != b.weak_type:
                reasons.append(f"{who}: a Python scalar became an array (or back)")
    if os_ != ns:
        old_s, new_s = dict(os_), dict(ns)
        for k in sorted(set(old_s) | set(new_s), key=str):
            if old_s.get(k) != new_s.get(k):
                who = repr(k) if isinstance(k, str) else static_name(k) if static_name else f"#{k}"
                reasons.append(f"static argument {who}: new value {_short(old_s.get(k))} -> "
                               f"{_short(new_s.get(k))}")
    if od != nd:
        reasons.append(f"the device changed: {od} -> {nd}")
    if oc != nc:
        reasons.append(f"the configuration changed: {oc} -> {nc}")
    return reasons or ["an equal key was evicted (cache cleared)"]


def _short(v) -> str:
    if v is None:
        return "(absent)"
    s = repr(v[0])
    return s if len(s) <= 60 else s[:57] + "..."


def jit(fun: Callable | None = None, *, static_argnums=(), static_argnames=(), device=None,
        donate_argnums=()):
    """Compile `fun` for a device, tracing once per signature (use as a function or decorator).
    donate_argnums is accepted for JAX compatibility and ignored."""
    if fun is None:
        return lambda f: jit(f, static_argnums=static_argnums, static_argnames=static_argnames,
                             device=device)
    return JitFunction(fun, static_argnums, static_argnames, device)
