"""Tracers and traces: the interpreter stack that every transformation (jit staging, jvp, vjp,
vmap) plugs into, in the manner of JAX's core (see Autodidax)."""
from __future__ import annotations

import contextlib
import operator
import threading
from typing import Any, Callable, NamedTuple

import numpy as np

from tilefuse.ir import dtypes
from tilefuse.ir import primitives as P
from tilefuse.ir.core import ShapedArray, aval_of_value, eval_graph
from tilefuse.ir.errors import ConcretizationError, TracerLeakError, with_user_line
from tilefuse.ir.primitives import Primitive


class MainTrace(NamedTuple):
    level: int
    trace_type: type
    global_data: Any


class _TraceState(threading.local):
    """The interpreter stack, one per thread: threads tracing at once (a jitted function called
    from several threads) must not see each other's traces."""

    def __init__(self):
        self.stack: list[MainTrace] = [MainTrace(0, EvalTrace, None)]
        self.dynamic: MainTrace | None = None


@contextlib.contextmanager
def new_main(trace_type: type, global_data=None):
    stack = _state.stack
    main = MainTrace(len(stack), trace_type, global_data)
    stack.append(main)
    try:
        yield main
    finally:
        stack.pop()


def staging() -> bool:
    """Whether a jit is tracing on this thread (then every bind is staged into its graph)."""
    return _state.dynamic is not None


@contextlib.contextmanager
def new_dynamic(main: MainTrace):
    """Make `main` catch every primitive bound, even on constants (jit's omnistaging)."""
    prev, _state.dynamic = _state.dynamic, main
    try:
        yield
    finally:
        _state.dynamic = prev


class Trace:
    """An interpreter of primitives for one transformation level."""

    def __init__(self, main: MainTrace):
        self.main = main

    def pure(self, val):  # a value of a lower level as a tracer of this level
        raise NotImplementedError

    lift = pure

    def process_primitive(self, prim: Primitive, tracers: list, params: dict) -> list:
        raise NotImplementedError

    def process_custom_vjp(self, fun: Callable, fwd: Callable, bwd: Callable, tracers: list,
                           out_tree_thunk) -> list:
        """Default: a custom-VJP function means just its primal function to other transforms."""
        return fun(*tracers)

    def process_custom_jvp(self, fun: Callable, jvp: Callable, tracers: list) -> list:
        """Default: a custom-JVP function means just its primal function to other transforms."""
        return fun(*tracers)


class Tracer:
    """A value flowing through a transformation; numpy-style operators are installed by
    tilefuse.numpy so the definitions live in one place."""
    __array_priority__ = 1000
    _trace: Trace

    @property
    def aval(self) -> ShapedArray:
        raise NotImplementedError

    shape = property(lambda self: self.aval.shape)
    dtype = property(lambda self: self.aval.dtype)
    ndim = property(lambda self: self.aval.ndim)
    size = property(lambda self: self.aval.size)
    weak_type = property(lambda self: self.aval.weak_type)

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __iter__(self):
        if not self.shape:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def full_lower(self):
        return self

    def concrete_value(self):
        """The Python/numpy value behind this tracer, when the transformation knows it."""
        raise ConcretizationError(with_user_line(
            f"a concrete value was needed from a traced array {self.aval.describe()} inside a "
            f"transformation ({self._trace.main.trace_type.__name__}): Python control flow "
            "(if/while/bool()/float()/int()) cannot depend on a traced value. Use tnp.where(...) "
            "for a data-dependent choice, or mark the argument static (static_argnums=/"
            "static_argnames=)."))

    def __bool__(self):
        return bool(self.concrete_value())

    def __float__(self):
        return float(self.concrete_value())

    def __int__(self):
        return int(self.concrete_value())

    def __index__(self):  # integers only, as numpy's: 2.0 is no index
        return operator.index(self.concrete_value())

    def __complex__(self):
        return complex(self.concrete_value())

    def __array__(self, dtype=None, copy=None):
        v = np.asarray(self.concrete_value())
        return v if dtype is None else v.astype(dtype)

    def item(self):
        return np.asarray(self.concrete_value()).item()

    def tolist(self):
        return np.asarray(self.concrete_value()).tolist()

    def __repr__(self):
        return f"Traced<{self.aval}>with<{type(self._trace).__name__}>"


# ---- eager evaluation: the bottom of the stack --------------------------------------------

_eager_apply: Callable | None = None


def set_eager_apply(fn: Callable) -> None:
    """The runtime installs how primitives run on concrete values (Arrays on a device)."""
    global _eager_apply
    _eager_apply = fn


class EvalTrace(Trace):
    """The bottom interpreter: runs primitives on concrete values."""
    pure = lift = staticmethod(lambda x: x)

    def process_primitive(self, prim, values, params):
        return _eval_primitive(prim, values, params)


def _eval_primitive(prim, values, params) -> list:
    if _eager_apply is None:
        return prim.impl(*(np.asarray(v) for v in values), **params)
    return _eager_apply(prim, values, params)


_state = _TraceState()  # after EvalTrace: each thread's stack starts with it




# ---- binding -------------------------------------------------------------------------------

def find_top_trace(xs) -> Trace:
    top = _state.stack[0]
    for x in xs:  # (a loop, not max() over a generator: once per traced operation)
        if isinstance(x, Tracer) and x._trace.main.level > top.level:
            top = x._trace.main
    dynamic = _state.dynamic
    if dynamic is not None and dynamic.level > top.level:
        top = dynamic
    return top.trace_type(top)


def _check_alive(x: Tracer):
    m = x._trace.main
    stack = _state.stack
    if m.level >= len(stack) or stack[m.level] is not m:
        raise TracerLeakError(with_user_line(
            f"a traced array {x.aval} escaped the transformation that created it "
            f"({m.trace_type.__name__}) and was used after it finished. Return it from the "
            "transformed function instead of storing it (e.g. in a global or a closure)."))


def full_raise(trace: Trace, val) -> Tracer:
    if not isinstance(val, Tracer):
        return trace.pure(val)
    _check_alive(val)
    level = trace.main.level
    if val._trace.main is trace.main:
        return val
    if val._trace.main.level < level:
        return trace.lift(val)
    raise TracerLeakError(with_user_line(
        f"a traced array {val.aval} from an inner transformation reached an outer one: "
        "return it from the transformed function instead of letting it escape"))


def full_lower(val):
    return val.full_lower() if isinstance(val, Tracer) else val


def is_eager(values) -> bool:
    """Whether no transformation sees these values: operations on them run at once (eager)."""
    if _state.dynamic is not None:
        return False
    for x in values:
        if isinstance(x, Tracer):
            return False
    return True


def bind(prim: Primitive, *args, **params) -> list:
    if prim not in _CUSTOM and is_eager(args):  # the bottom interpreter's fast path: no stack walk
        return _eval_primitive(prim, list(args), params)
    trace = find_top_trace(args)
    tracers = [full_raise(trace, a) for a in args]
    if prim in _CUSTOM:  # a staged custom_vjp/custom_jvp function: its rule is the trace's again
        outs = _CUSTOM[prim](trace, tracers, params)
    else:
        outs = trace.process_primitive(prim, tracers, params)
    return [full_lower(o) for o in outs]


def _body(params, consts) -> Callable:
    """A call's body run on tracers: the function a custom_vjp/custom_jvp call stands for."""
    graph = params["graph"]
    return lambda *xs: eval_graph(graph, [*consts, *xs], lambda e, vs: bind(e.prim, *vs, **e.params))


def _rebind_vjp(trace, tracers, params):
    n = params["n_consts"]
    return trace.process_custom_vjp(_body(params, tracers[:n]), params["fwd"], params["bwd"], tracers[n:],
                                    None)


def _rebind_jvp(trace, tracers, params):
    n = params["n_consts"]
    return trace.process_custom_jvp(_body(params, tracers[:n]), params["jvp"], tracers[n:])


_CUSTOM = {P.custom_vjp_call: _rebind_vjp, P.custom_jvp_call: _rebind_jvp}


def bind1(prim: Primitive, *args, **params):
    return bind(prim, *args, **params)[0]


def bind_custom_vjp(fun: Callable, fwd: Callable, bwd: Callable, *args, out_tree_thunk=None) -> list:
    """Call a function with a user-defined VJP on flat arguments: the top trace decides what it
    means (reverse mode uses fwd/bwd; every other trace runs `fun`). fun(*args) -> outs,
    fwd(*args) -> (outs, residuals), bwd(residuals, cts_out) -> cts_in; all flat lists."""
    trace = find_top_trace(args)
    tracers = [full_raise(trace, a) for a in args]
    outs = trace.process_custom_vjp(fun, fwd, bwd, tracers, out_tree_thunk)
    return [full_lower(o) for o in outs]


def bind_custom_jvp(fun: Callable, jvp: Callable, *args) -> list:
    """Call a function with a user-defined JVP on flat arguments: the top trace decides what it
    means (forward mode uses jvp, reverse mode transposes it; other traces run `fun`).
    fun(*args) -> outs, jvp(primals, tangents) -> (outs, tangents out); all flat lists."""
    trace = find_top_trace(args)
    tracers = [full_raise(trace, a) for a in args]
    outs = trace.process_custom_jvp(fun, jvp, tracers)
    return [full_lower(o) for o in outs]


def get_aval(x) -> ShapedArray:
    if isinstance(x, Tracer):
        return x.aval
    return aval_of_value(x)


def is_array_like(x) -> bool:
    return isinstance(x, (Tracer, np.ndarray, np.generic, bool, int, float)) or hasattr(x, "aval")


def concrete_or_none(x):
    """The concrete value of x if it has one here (numpy, scalar, Array or a concrete tracer)."""
    if isinstance(x, Tracer):
        try:
            return x.concrete_value()
        except ConcretizationError:
            return None
    return x


def scalar_dtype(x):
    return dtypes.python_scalar_dtype(x)
