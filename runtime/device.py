"""The device registry, device objects, executables and eager dispatch."""
from __future__ import annotations

import gc
import importlib
import os
import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np

from tilefuse.ir import dtypes
from tilefuse.ir.core import Eqn, Graph, ShapedArray, Var, aval_of_value, eval_graph
from tilefuse.ir.errors import DeviceError, NaNError, UnsupportedDTypeError, without_user_line
from tilefuse.ir.primitives import subgraphs

from . import tiered
from .array import Array
from .config import config
from .hardware import DeviceInfo

# kind -> module that provides `create() -> Backend`, imported lazily, on first use: every
# package in tilefuse/backends that defines create() is a device kind named after it (the llvm
# package is the cpu; llvmir, a printer two backends share, is none), found without importing
# it, so a new backend is a new package and nothing else.
def _backend_modules() -> dict:
    import pkgutil

    import tilefuse.backends as pkg
    found = {"cpu": "tilefuse.backends.llvm"}
    for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if m.ispkg and m.name != "llvm" and _defines_create(os.path.join(m.module_finder.path, m.name)):
            found[m.name] = f"tilefuse.backends.{m.name}"
    found["ref"] = "tilefuse.backends.ref"
    return found


def _defines_create(package: str) -> bool:
    try:
        with open(os.path.join(package, "__init__.py"), encoding="utf-8") as f:
            return "\ndef create(" in f.read()
    except OSError:
        return False


BACKEND_MODULES = _backend_modules()
SINGLE = ("cpu", "ref")  # kinds of one device, named without an index
DEFAULT_ORDER = ("cpu", "ref")


class Device:
    """One device of one backend: `cpu`, `ref`, `opencl:0`, `cuda:0`."""

    def __init__(self, backend, index: int, info: DeviceInfo, multi: bool):
        self.backend, self.index, self.info = backend, index, info
        self.kind = backend.kind
        self.name = f"{self.kind}:{index}" if multi else self.kind
        self._compiled: dict = {}

    def __repr__(self):
        return self.name

    def __str__(self):
        return self.name

    def __reduce__(self):
        return (get_device, (self.name,))

    def supports(self, dtype) -> bool:
        """Whether arrays of `dtype` live and compute here (WGSL has no 64-bit types, some OpenCL
        devices no float64): the hardware description's "unsupported" dtype names."""
        return np.dtype(dtype).name not in self.info.extra.get("unsupported", ())

    def check_dtypes(self, avals, where: str = "", source: str = "") -> None:
        """A DTypeError naming the dtype, the device and the user's line for the first aval of a
        dtype this device lacks."""
        for a in avals:
            if not self.supports(a.dtype):
                at = f"\n  at {source}" if source else ""
                raise UnsupportedDTypeError(f"{np.dtype(a.dtype).name} is not supported on {self.name} "
                                 f"({self.info.name}){where}: use float32/int32 there, or another device{at}")

    # memory
    def put(self, host, committed: bool = True) -> Array:
        host = np.asarray(host)
        aval = ShapedArray(host.shape, dtypes.canonicalize(host.dtype))
        self.check_dtypes([aval], " (an array put there)")
        if host.dtype != aval.dtype:
            host = host.astype(aval.dtype)
        return Array(self.backend.put(host, self), aval, self, committed)

    def to_host(self, buf, aval) -> np.ndarray:
        return self.backend.to_host(buf, aval, self)

    def synchronize(self) -> None:
        self.backend.synchronize(self)

    def memory_stats(self) -> dict:
        return self.backend.memory_stats(self)

    def empty_cache(self) -> None:
        """Hand the pool's cached (free) blocks back to the device."""
        self.backend.empty_cache(self)

    def buffer_of(self, x, aval: ShapedArray):
        """The device buffer for one argument leaf (moving it here if it is elsewhere)."""
        if isinstance(x, Array):
            if x.device is self:
                return x._buf
            x = x.numpy()
        host = np.asarray(x, dtype=aval.dtype)
        return self.backend.put(host, self)

    # compilation
    def compile(self, graph: Graph) -> "Executable":
        self.check_graph(graph)
        return Executable(graph, self, self.backend.compile(graph, self))

    def check_graph(self, graph: Graph) -> None:
        """An UnsupportedDTypeError for a graph that holds a dtype this device lacks."""
        if self.info.extra.get("unsupported"):
            self.check_dtypes([v.aval for v in (*graph.constvars, *graph.invars)], " (an argument)")
            for e in graph.eqns:
                self.check_dtypes([v.aval for v in e.outputs], f" (the result of {e.prim.name})", e.source)


class Executable:
    """A graph compiled for a device: call it with argument leaves, get Arrays back."""

    def __init__(self, graph: Graph, device: Device, program):
        self.graph, self.device, self.program = graph, device, program
        self.in_avals = [v.aval for v in graph.invars]
        self.out_avals = [v.aval for v in graph.outvars]
        self._single = self.out_avals[0] if len(self.out_avals) == 1 else None
        self._run = getattr(program, "_run", program)  # a Program's __call__ is its _run: one frame less

    def __call__(self, leaves: Sequence) -> list[Array]:
        # every jitted call's hit path: an Array already here is its buffer, without a call
        # (loops, not comprehensions: a comprehension is a function call of its own)
        dev = self.device
        bufs = []
        for x, a in zip(leaves, self.in_avals):
            bufs.append(x._buf if type(x) is Array and x.device is dev else dev.buffer_of(x, a))
        outs = self._run(bufs)
        if self._single is not None:
            result = [Array(outs[0], self._single, dev)]
        else:
            result = []
            for b, a in zip(outs, self.out_avals):
                result.append(Array(b, a, dev))
        if config.debug_nans:
            check_nans(self.graph, [np.asarray(x) for x in leaves], result)
        return result

    def sources(self) -> dict[str, str]:
        return self.program.sources()

    @property
    def optimized_graph(self) -> Graph:
        return self.program.graph


def check_nans(graph: Graph, args, outputs) -> None:
    """If an output holds a NaN, re-run the graph equation by equation on numpy and name the
    first equation (and the user's line) that produced one."""
    def has_nan(x):
        a = np.asarray(x)
        return dtypes.is_float(a.dtype) and bool(np.isnan(a.astype(np.float32)).any())

    if not any(has_nan(o) for o in outputs):
        return
    nan_inputs = [i for i, a in enumerate(args) if has_nan(a)]

    def apply(e: Eqn, xs):
        outs = e.prim.impl(*xs, **e.params)
        if any(has_nan(o) for o in outs) and not any(has_nan(x) for x in xs):
            where = f"at {e.source}" if e.source else "(no source line recorded)"
            raise NaNError(f"debug_nans: the first equation to produce a NaN (from inputs without "
                           f"one) is\n    {graph.eqn_text(e)}\n  {where}")
        return outs

    with np.errstate(all="ignore"):
        eval_graph(graph, [np.asarray(a) for a in args], apply)
    raise NaNError("debug_nans: an output holds a NaN" +
                   (f" (input leaf {', '.join(map(str, nan_inputs))} of the call already held one)"
                    if nan_inputs else ""))


# ---- the registry ----------------------------------------------------------------------------

_backends: dict[str, object] = {}
_devices: dict[str, list[Device]] = {}
_by_name: dict[str, Device] = {}  # get_device's answers ("cpu", "opencl:0"): devices never go
_unavailable: dict[str, str] = {}
# the first use of a kind, from several threads at once, makes one backend and one Device per
# device (arrays of two Device objects for one device could not be combined); re-entrant: a
# backend that starts may ask for devices
_registry_lock = threading.RLock()


def _load(kind: str) -> list[Device]:
    devs = _devices.get(kind)
    if devs is not None:
        return devs
    with _registry_lock:
        if kind in _devices:
            return _devices[kind]
        return _create(kind)


def _create(kind: str) -> list[Device]:
    try:
        module = importlib.import_module(BACKEND_MODULES[kind])
        backend = module.create()
        infos = backend.discover()
    except (ImportError, AttributeError, DeviceError, OSError) as e:
        _unavailable[kind] = f"{type(e).__name__}: {without_user_line(e)}"
        _devices[kind] = []
        return []
    _backends[kind] = backend
    _devices[kind] = [Device(backend, i, info, kind not in SINGLE)
                      for i, info in enumerate(infos)]
    return _devices[kind]


def devices(kind: str | None = None, all: bool = False):
    """The available devices (of one kind, if named). With all=True, also returns a dict of the
    kinds that are unavailable and why."""
    kinds = [kind] if kind else list(BACKEND_MODULES)
    out = [d for k in kinds if k in BACKEND_MODULES for d in _load(k)]
    if all:
        return out, {k: _unavailable[k] for k in kinds if k in _unavailable}
    return out


def get_device(name) -> Device:
    if isinstance(name, Device):
        return name
    dev = _by_name.get(name) if isinstance(name, str) else None
    if dev is not None:  # (every operation outside jit asks for the default device by name)
        return dev
    name = str(name)
    kind, _, idx = name.partition(":")
    if kind not in BACKEND_MODULES:
        raise DeviceError(f"unknown device {name!r}; known kinds: {', '.join(BACKEND_MODULES)}")
    devs = _load(kind)
    if not devs:
        raise DeviceError(f"device {name!r} is unavailable: {_unavailable.get(kind, 'none found')}")
    i = int(idx) if idx else 0
    if i >= len(devs):
        raise DeviceError(f"device {name!r} does not exist; {kind} has {len(devs)} device(s)")
    _by_name[name] = devs[i]
    return devs[i]


def default_device() -> Device:
    if config.default_device:
        return get_device(config.default_device)
    for kind in DEFAULT_ORDER:
        devs = _load(kind)
        if devs:
            return devs[0]
    raise DeviceError("no device available")


def resolve_device(device, leaves) -> Device:
    """The device a call runs on: the one asked for, else where its Arrays live, else the default."""
    if device is not None:
        return get_device(device)
    found = None
    for x in leaves:  # committed Arrays decide; uncommitted ones follow them
        if isinstance(x, Array) and x.committed:
            if found is None:
                found = x.device
            elif x.device is not found:
                raise DeviceError(f"arguments live on different devices ({found} and {x.device}); "
                                  "move them with tx.device_put first")
    return found if found is not None else default_device()


def device_put(x, device=None):
    """Place an array (or a pytree of arrays) on a device."""
    from tilefuse.tracer import pytree
    dev = get_device(device) if device is not None else default_device()

    def put(leaf):
        if isinstance(leaf, Array) and leaf.device is dev:
            return leaf
        return dev.put(np.asarray(leaf))
    return pytree.tree_map(put, x)


def device_get(x):
    """The arrays of a pytree copied to the host, as numpy arrays (jax.device_get): each Array
    read back once, anything else as it is."""
    from tilefuse.tracer import pytree
    return pytree.tree_map(lambda leaf: np.asarray(leaf) if isinstance(leaf, Array) else leaf, x)


def clear_caches() -> None:
    """The eager operations' executables and the builders' tile kernels kept for new sizes
    dropped, then every device's cached pool blocks handed back (after a collection: a dropped
    program's constants return to the pool when collected)."""
    from . import tiled
    with _eager_lock:
        _eager_cache.clear()
    tiled.forget_size_free()
    gc.collect()
    for devs in list(_devices.values()):
        for d in devs:
            d.empty_cache()


# ---- eager execution: one primitive at a time, compiled once per signature ----------------

# key -> Executable, the least recently used dropped past config.jit_cache_size
_eager_cache: OrderedDict = OrderedDict()
_eager_lock = threading.Lock()


def apply_primitive(prim, values, params) -> list:
    outs = _apply_primitive(prim, values, params)
    if not any(isinstance(v, Array) and v.committed for v in values):
        for o in outs:
            o.committed = False
    return outs


def _apply_primitive(prim, values, params) -> list:
    dev = resolve_device(None, values)
    avals = tuple(aval_of_value(v) for v in values)
    # (hashed once, by the lookup: a TypeError there is an unhashable parameter; a body traced
    # anew each call, as with subgraphs, would never hit again)
    key = None if subgraphs(params) else (prim, tuple(sorted(params.items())), avals, dev)
    try:
        exe = _eager_cache.get(key) if key is not None else None
    except TypeError:
        key = exe = None
    if exe is None:
        exe = _eager_entry(prim, avals, params, dev, key)
    elif type(exe) is not Interpreted:  # (interpreted entries cost nothing to rebuild: no LRU order)
        try:
            _eager_cache.move_to_end(key)
        except KeyError:  # evicted meanwhile by another thread: this call still runs it
            pass
    if type(exe) is not Interpreted:
        return exe(values)
    backend_apply = dev.backend.apply_primitive
    if backend_apply is not None:  # the device's own numpy (ref)
        bufs = [dev.buffer_of(v, a) for v, a in zip(values, avals)]
        return _results(backend_apply(prim, params, bufs, dev), exe.out_avals, dev)
    # numpy on host views of the operands
    host = [v.numpy() if type(v) is Array else np.asarray(v, a.dtype) for v, a in zip(values, avals)]
    return _results(_ref_backend().apply_primitive(prim, params, host, dev), exe.out_avals, dev, _host_result)


def _eager_entry(prim, avals, params, dev, key):
    """What an operation outside jit runs (cached under `key` where it has one): an Interpreted
    entry (its results' avals, from the shape rule, which names a mistake first), or the
    device's executable of the one-equation graph (tiered where that applies)."""
    out_avals = prim.abstract_eval(*avals, **params)
    if dev.backend.apply_primitive is not None:
        exe = Interpreted(out_avals)
    else:
        graph = one_equation_graph(prim, avals, params, out_avals)
        exe = Interpreted(out_avals) if tiered.interprets(graph, dev) else tiered.compile(graph, dev, eager=True)
        if key is not None and hasattr(exe, "when_compiled"):
            exe.when_compiled(lambda compiled: _swap_eager(key, exe, compiled))
    if key is not None:
        with _eager_lock:
            _eager_cache[key] = exe
            while 0 < config.jit_cache_size < len(_eager_cache):
                _eager_cache.popitem(last=False)
    return exe


def _results(outs, avals, dev, put=None) -> list:
    """An operation's numpy results as Arrays of their avals' dtypes on dev: the buffers
    themselves (the backend's own numpy results), or copied into dev's buffers by `put`."""
    outs = [np.asarray(o, a.dtype) for o, a in zip(outs, avals)]  # (no copy where the dtype is right)
    return [Array(o if put is None else put(o, dev), a, dev) for o, a in zip(outs, avals)]


def _host_result(out: np.ndarray, dev):
    """An interpreted operation's numpy result as a buffer of a host-memory device: its own memory
    where numpy made it for this result, else (a view of an operand, whose pool block may be freed:
    reshape, slice, transpose) numpy's copy of it, which costs a few us less than a pool block."""
    if not out.flags.owndata:
        out = np.array(out, order="C")
    buf = dev.backend.adopt(out, dev)
    return buf if buf is not None else dev.backend.put(out, dev)


class Interpreted:
    """An eager cache entry: the operation runs on numpy (the ref device's own, or
    tiered.interprets), its results' avals known from the first call's shape rule."""
    __slots__ = ("out_avals",)

    def __init__(self, out_avals):
        self.out_avals = out_avals


def _ref_backend():
    return get_device("ref").backend


def _swap_eager(key, tiered_exe, compiled) -> None:
    with _eager_lock:
        if _eager_cache.get(key) is tiered_exe:
            _eager_cache[key] = compiled


def one_equation_graph(prim, avals, params, out_avals=None) -> Graph:
    invars = tuple(Var(a) for a in avals)
    outs = tuple(Var(a) for a in (out_avals or prim.abstract_eval(*avals, **params)))
    return Graph((), invars, (Eqn(prim, invars, outs, params),), outs)


