"""check_grads: derivatives against central finite differences, in float64 (JAX's check_grads).

Forward mode compares jvp(f)(x; v) with (f(x + eps v) - f(x - eps v)) / 2 eps for a random v;
reverse mode compares <u, J v> from finite differences with <vjp(u), v> for random u and v.
Order 2 applies the same checks to the jvp and vjp functions themselves (all four mixes)."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from tilefuse.ir import dtypes
from tilefuse.tracer.core import get_aval, is_array_like
from tilefuse.tracer.pytree import tree_leaves, tree_map

from .api import jvp, vjp


def _to_f64(x):
    if is_array_like(x) and dtypes.is_float(get_aval(x).dtype):
        return np.asarray(x, np.float64)
    return x


def _host(x) -> np.ndarray:
    return np.asarray(x, np.float64)


def _random_like(tree, rng):
    return tree_map(lambda x: rng.standard_normal(get_aval(x).shape).astype(get_aval(x).dtype), tree)


def _inner(xs, ys) -> float:
    return float(sum(np.sum(_host(x) * _host(y)) for x, y in zip(tree_leaves(xs), tree_leaves(ys))))


def _numerical_jvp(f, args, tangents, eps):
    def shifted(sign):
        return f(*tree_map(lambda x, t: _host(x) + sign * eps * t, args, tangents))
    plus, minus = shifted(1.0), shifted(-1.0)
    return tree_map(lambda a, b: (_host(a) - _host(b)) / (2 * eps), plus, minus)


def check_grads(f: Callable, args: Sequence, order: int = 1, modes=("fwd", "rev"),
                eps: float = 1e-4, atol: float = 1e-5, rtol: float = 1e-5, seed: int = 0) -> None:
    """Check f's derivatives at args (a tuple of arguments, pytrees of float arrays) against
    finite differences in float64, up to `order` (1 or 2), in forward ("fwd") and reverse
    ("rev") mode. Raises AssertionError naming the mode and order that disagrees."""
    if order not in (1, 2):
        raise ValueError(f"check_grads: order must be 1 or 2, got {order}")
    if not set(modes) <= {"fwd", "rev"} or not modes:
        raise ValueError(f"check_grads: modes must be a subset of ('fwd', 'rev'), got {modes}")
    rng = np.random.default_rng(seed)
    args = tree_map(_to_f64, tuple(args))

    def close(actual, expected, msg):
        for a, e in zip(tree_leaves(actual), tree_leaves(expected), strict=True):
            np.testing.assert_allclose(_host(a), _host(e), rtol=rtol, atol=atol, err_msg=msg)

    def check_jvp(fn, xs, msg):
        v = _random_like(xs, rng)
        out, t = jvp(fn, xs, v)
        close(out, fn(*xs), f"{msg}: primal output")
        close(t, _numerical_jvp(fn, xs, v, eps), f"{msg}: tangent vs finite differences")

    def check_vjp(fn, xs, msg):
        v = _random_like(xs, rng)
        out, vjp_fn = vjp(fn, *xs)
        u = _random_like(out, rng)
        expected = _inner(u, _numerical_jvp(fn, xs, v, eps))
        close(_inner(vjp_fn(u), v), expected, f"{msg}: <vjp(u), v> vs <u, finite-difference J v>")

    def rec(fn, xs, order, name):
        if "fwd" in modes:
            msg = f"JVP of {name}" if name else "JVP"
            check_jvp(fn, xs, msg)
            if order > 1:
                rec(lambda p, t: jvp(fn, p, t), (xs, xs), order - 1, msg)
        if "rev" in modes:
            msg = f"VJP of {name}" if name else "VJP"
            check_vjp(fn, xs, msg)
            if order > 1:
                def fn_vjp(*ys):
                    out, vjp_fn = vjp(fn, *ys)
                    return vjp_fn(out)
                rec(fn_vjp, xs, order - 1, msg)
    rec(f, args, order, "")
