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


def elementwise_grad(fun: Callable, argnums=0, has_aux: bool = False):
    """autograd's elementwise_grad: the gradient of the sum of fun's outputs, i.e. its VJP with
    a cotangent of ones. For an elementwise fun, each output's derivative in its own input
    (grad(tanh) over an array): grad needs a scalar output, this does not."""
    from tilefuse.autodiff import grad
    from tilefuse.numpy import sum as _sum
    from tilefuse.tracer.pytree import tree_leaves

    def total(*args, **kwargs):
        out = fun(*args, **kwargs)
        out, aux = out if has_aux else (out, None)
        s = sum((_sum(x) for x in tree_leaves(out)), 0.0)
        return (s, aux) if has_aux else s
    g = grad(total, argnums=argnums, has_aux=has_aux)
    g.__name__ = f"elementwise_grad({getattr(fun, '__name__', 'fun')})"
    return g
