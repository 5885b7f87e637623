"""Small public helpers: make_graph and debug_print."""
from __future__ import annotations

from typing import Callable

from tilefuse.ir import primitives as P
from tilefuse.tracer.core import bind
from tilefuse.tracer.jit import JitFunction


def make_graph(fun: Callable, static_argnums=(), static_argnames=()):
    """make_graph(f)(*args) -> the Graph that jit would compile for these arguments."""
    jf = JitFunction(fun, static_argnums, static_argnames)

    def build(*args, **kwargs):
        return jf.lower(*args, **kwargs).graph
    return build


def debug_print(fmt: str, *args, **kwargs) -> None:
    """Print values at run time, inside jit too: tx.debug_print("x = {} y = {y}", x, y=y)."""
    from tilefuse.numpy import _operand
    values = [_operand(a) for a in args] + [_operand(v) for v in kwargs.values()]
    bind(P.debug_print, *values, fmt=fmt, names=tuple(kwargs))
