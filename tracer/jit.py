"""jit: trace once per signature, cache, and run the compiled graph on a device."""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Sequence

import numpy as np

from tilefuse.ir import dtypes
from tilefuse.ir.core import Graph, ShapedArray, eval_graph
from tilefuse.ir.errors import TilefuseError, filter_traceback

from . import pytree
from .core import Tracer, bind, get_aval
from .staging import trace_to_graph

log = logging.getLogger("tilefuse.jit")


class RuntimeHooks:
    """What jit needs from the runtime; installed by the `tilefuse` package (layers point down)."""
    resolve_device: Callable = None  # (device_arg, leaves) -> Device
    compile: Callable = None  # (graph, device) -> executable(list of leaves) -> list of Arrays
    config: Any = None  # tilefuse.config


hooks = RuntimeHooks()


def _normalize_argnums(argnums, n=None) -> tuple[int, ...]:
    if argnums is None:
        return ()
    if isinstance(argnums, int):
        argnums = (argnums,)
    return tuple(argnums)


def _leaf_aval(x, where: str) -> ShapedArray:
    if isinstance(x, Tracer) or hasattr(x, "aval"):
        return x.aval
    if isinstance(x, (bool, int, float)) and not isinstance(x, np.generic):
        if isinstance(x, int) and not isinstance(x, bool) and not -2**31 <= x < 2**31:
            raise TilefuseError(f"{where} is the Python int {x}, which does not fit int32: "
                                "pass np.int64(...) or an int64 array")
        return ShapedArray((), dtypes.python_scalar_dtype(x), True)
    if isinstance(x, (np.ndarray, np.generic)):
        if x.dtype == object:
            raise TilefuseError(f"{where} is an object array; tilefuse needs numeric arrays")
        return ShapedArray(x.shape, dtypes.canonicalize(x.dtype))
    raise TilefuseError(f"{where} is a {type(x).__name__}, not an array: pass arrays (or pytrees "
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
        return self.compile().graph

    def sources(self) -> dict[str, str]:
        """Every generated kernel's source text for the device (LLVM IR, OpenCL C, PTX)."""
        return self.compile().sources()


class _Entry:
    __slots__ = ("executable", "out_tree", "graph")

    def __init__(self, executable, out_tree, graph):
        self.executable, self.out_tree, self.graph = executable, out_tree, graph


class JitFunction:
    """A jitted function: a cache of compiled graphs keyed by the call's signature."""

    def __init__(self, fun: Callable, static_argnums=(), static_argnames=(), device=None):
        functools.update_wrapper(self, fun)
        self.fun = fun
        try:
            self._sig = inspect.signature(fun)
            params = list(self._sig.parameters.values())
        except (TypeError, ValueError):
            self._sig, params = None, []
        self._param_names = [p.name for p in params
                             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.static_argnums = set(_normalize_argnums(static_argnums))
        self.static_argnames = set((static_argnames,) if isinstance(static_argnames, str)
                                   else static_argnames or ())
        for n in list(self.static_argnums):  # a static position is static by name too
            if n < len(self._param_names):
                self.static_argnames.add(self._param_names[n])
        for name in list(self.static_argnames):
            if name in self._param_names:
                self.static_argnums.add(self._param_names.index(name))
        self.device = device
        self._cache: dict = {}
        self._graphs: dict = {}
        self.trace_count = 0
        self._last_keys: list = []

    def __get__(self, obj, objtype=None):  # jit on a method: bind `self` as a static argument
        if obj is None:
            return self
        bound = self.__dict__.setdefault("_bound", {})
        key = id(type(obj))
        if key not in bound:
            bound[key] = JitFunction(self.fun, static_argnums={0} | {i + 1 for i in self.static_argnums
                                                                   if i > 0} | self.static_argnums,
                                     static_argnames=self.static_argnames, device=self.device)
        return functools.partial(bound[key], obj)

    # ---- the call path ------------------------------------------------------------------
    def _split(self, args, kwargs):
        dyn_args, static = [], []
        for i, a in enumerate(args):
            if i in self.static_argnums:
                static.append((i, _hashable(a, self._argname(i))))
            else:
                dyn_args.append(a)
        dyn_kwargs = {}
        for k, v in kwargs.items():
            if k in self.static_argnames:
                static.append((k, _hashable(v, k)))
            else:
                dyn_kwargs[k] = v
        return tuple(dyn_args), dyn_kwargs, tuple(static)

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
        # name the offending argument
        names = self._leaf_names(in_tree)
        return tuple(_leaf_aval(x, f"argument {names[i]} of {self.__name__}") for i, x in enumerate(leaves))

    def _leaf_names(self, in_tree):
        dyn_positions = [i for i in range(len(self._param_names) + 64) if i not in self.static_argnums]
        args_def, kw_def = in_tree.children
        names = []
        for j, c in enumerate(args_def.children):
            i = dyn_positions[j]
            base = self._argname(i)
            names += [base if c.n_leaves == 1 else f"{base} (leaf {k})" for k in range(c.n_leaves)]
        for key, c in zip(kw_def.aux or (), kw_def.children):
            names += [repr(key)] * c.n_leaves
        return names

    def __call__(self, *args, **kwargs):
        dyn_args, dyn_kwargs, static = self._split(args, kwargs)
        leaves, in_tree = pytree.tree_flatten((dyn_args, dyn_kwargs))
        if any(isinstance(x, Tracer) for x in leaves):
            # Under another transformation (grad, vmap, an outer jit): replay our graph on its
            # tracers so that transformation sees every primitive.
            avals = tuple(x.aval.strip_weak() if isinstance(x, Tracer) else get_aval(x) for x in leaves)
            graph, out_tree = self._graph(static, avals, in_tree)
            if graph is None:
                return self.fun(*args, **kwargs)
            outs = eval_graph(graph, leaves, lambda e, xs: bind(e.prim, *xs, **e.params))
            return pytree.tree_unflatten(out_tree, outs)
        avals = self._avals(leaves, in_tree)
        device = hooks.resolve_device(self.device, leaves)
        key = (in_tree, avals, static, device, hooks.config.cache_key())
        entry = self._cache.get(key)
        if entry is None:
            entry = self._compile(key, static, avals, in_tree, device)
            if entry is None:  # it closes over tracers: no staging possible
                return self.fun(*args, **kwargs)
        try:
            outs = entry.executable(leaves)
        except TilefuseError as e:
            raise e.with_traceback(filter_traceback(e.__traceback__)) from None
        return pytree.tree_unflatten(entry.out_tree, outs)

    def _graph(self, static, avals, in_tree):
        gkey = (in_tree, avals, static)
        hit = self._graphs.get(gkey)
        if hit is not None:
            return hit
        self.trace_count += 1

        def flat_fun(*tracers):
            args, kwargs = self._rebuild_call(static, tracers, in_tree)
            out = self.fun(*args, **kwargs)
            out_leaves, out_tree = pytree.tree_flatten(out)
            for i, o in enumerate(out_leaves):
                if not (isinstance(o, Tracer) or hasattr(o, "aval") or
                        isinstance(o, (np.ndarray, np.generic, bool, int, float))):
                    raise TilefuseError(f"{self.__name__} returned a {type(o).__name__} (output leaf "
                                        f"{i}); jitted functions must return arrays or pytrees of arrays")
            return out_leaves, out_tree

        try:
            graph, out_tree = trace_to_graph(flat_fun, [a for a in avals])
        except TilefuseError as e:
            raise e.with_traceback(filter_traceback(e.__traceback__)) from None
        if any(isinstance(c, Tracer) for c in graph.consts):
            result = (None, None)
        else:
            result = (graph, out_tree)
        self._graphs[gkey] = result
        return result

    def _compile(self, key, static, avals, in_tree, device):
        if hooks.config.explain_retrace and self._last_keys:
            log.warning("%s", explain_retrace(self.__name__, self._last_keys[-1], key))
        graph, out_tree = self._graph(static, avals, in_tree)
        if graph is None:
            return None
        try:
            executable = hooks.compile(graph, device)
        except TilefuseError as e:
            raise e.with_traceback(filter_traceback(e.__traceback__)) from None
        entry = _Entry(executable, out_tree, graph)
        self._cache[key] = entry
        self._last_keys.append(key)
        return entry

    # ---- inspection -----------------------------------------------------------------------
    def lower(self, *args, device=None, **kwargs) -> Lowered:
        dyn_args, dyn_kwargs, static = self._split(args, kwargs)
        leaves, in_tree = pytree.tree_flatten((dyn_args, dyn_kwargs))
        avals = tuple(x.aval.strip_weak() if isinstance(x, Tracer) else a
                      for x, a in zip(leaves, self._avals(leaves, in_tree)))
        graph, out_tree = self._graph(static, avals, in_tree)
        if graph is None:
            raise TilefuseError(f"{self.__name__} closes over traced values and cannot be lowered alone")
        dev = hooks.resolve_device(device if device is not None else self.device, leaves)
        return Lowered(graph, out_tree, dev, in_tree)

    def cache_size(self) -> int:
        return len(self._cache)

    def clear_cache(self) -> None:
        self._cache.clear()
        self._graphs.clear()


def _hashable(v, name):
    try:
        hash(v)
    except TypeError as e:
        raise TilefuseError(f"static argument {name} must be hashable, got a {type(v).__name__}; "
                            "pass a tuple instead of a list, or make it a traced argument") from e
    return (v,)


def explain_retrace(name, old, new) -> str:
    """Why a jitted function traced again: compare the new cache key with the previous one."""
    (ot, oa, os_, od, oc), (nt, na, ns, nd, nc) = old, new
    reasons = []
    if ot != nt:
        reasons.append(f"the argument structure changed: {ot} -> {nt}")
    elif oa != na:
        for i, (a, b) in enumerate(zip(oa, na)):
            if a.shape != b.shape:
                reasons.append(f"input {i}: new shape {a.shape} -> {b.shape}")
            elif a.dtype != b.dtype:
                reasons.append(f"input {i}: new dtype {a.dtype} -> {b.dtype}")
            elif a.weak_type != b.weak_type:
                reasons.append(f"input {i}: a Python scalar became an array (or back)")
    if os_ != ns:
        reasons.append(f"a static argument changed: {os_} -> {ns}")
    if od != nd:
        reasons.append(f"the device changed: {od} -> {nd}")
    if oc != nc:
        reasons.append("the configuration changed")
    return f"tilefuse: {name} traced again: " + ("; ".join(reasons) or "first call")


def jit(fun: Callable | None = None, *, static_argnums=(), static_argnames=(), device=None):
    """Compile `fun` for a device, tracing once per signature (use as a function or decorator)."""
    if fun is None:
        return lambda f: jit(f, static_argnums=static_argnums, static_argnames=static_argnames,
                             device=device)
    return JitFunction(fun, static_argnums, static_argnames, device)


