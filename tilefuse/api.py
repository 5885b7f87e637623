"""Small public helpers: make_graph and debug_print."""
from __future__ import annotations

from typing import Callable

from tilefuse.ir import primitives as P
from tilefuse.runtime.array import Array
from tilefuse.tracer import jit as _jit
from tilefuse.tracer.core import bind
from tilefuse.tracer.jit import JitFunction

# jit's cache-hit path recognises device Arrays by their exact type (tracer cannot import runtime)
_jit.hooks.array_type = Array


def make_graph(fun: Callable, static_argnums=(), static_argnames=()):
    """make_graph(f)(*args) -> the Graph that jit would compile for these arguments."""
    jf = JitFunction(fun, static_argnums, static_argnames)
    jf._track_code = False  # a look at the graph is not a jit: explain_retrace ignores it

    def build(*args, **kwargs):
        return jf.lower(*args, **kwargs).graph
    build.__wrapped__ = fun
    return build


def debug_print(fmt: str, *args, **kwargs) -> None:
    """Print values when the code runs, inside jit too (at every call, not once at trace time):
    tx.debug_print("x = {} y = {y}", x, y=y). The format is str.format's, applied to numpy
    arrays. The equation is effectful, so no pass removes it."""
    from tilefuse.numpy import _operand
    values = [_operand(a) for a in args] + [_operand(v) for v in kwargs.values()]
    bind(P.debug_print, *values, fmt=fmt, names=tuple(kwargs))
