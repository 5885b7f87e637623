"""Optimizers as (init, update, get_params) triples over pytrees, as jax.example_libraries.optimizers:

    opt_init, opt_update, get_params = optimizers.adam(1e-3)
    state = opt_init(params)
    state = opt_update(step, grads, state)
    params = get_params(state)

Step sizes are numbers or schedules step -> size. Each state keeps its parameters' dtypes
(float64 parameters compute in float64)."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import tilefuse.numpy as tnp
from tilefuse.tracer.pytree import register_pytree_node, tree_flatten, tree_map, tree_unflatten

__all__ = [
    "Optimizer",
    "OptimizerState",
    "optimizer",
    "sgd",
    "momentum",
    "nesterov",
    "adagrad",
    "rmsprop",
    "rmsprop_momentum",
    "adam",
    "adamax",
    "sm3",
    "constant",
    "exponential_decay",
    "inverse_time_decay",
    "polynomial_decay",
    "piecewise_constant",
    "make_schedule",
    "clip_grads",
    "l2_norm",
    "unpack_optimizer_state",
    "pack_optimizer_state",
]


class Optimizer(NamedTuple):
    init_fn: Callable
    update_fn: Callable
    params_fn: Callable


class OptimizerState(NamedTuple):
    """Per-leaf states (flattened) and the parameters' tree structure; a pytree."""

    packed_state: Any
    tree_def: Any
    subtree_defs: Any


register_pytree_node(
    OptimizerState,
    lambda s: ((s.packed_state,), (s.tree_def, s.subtree_defs)),
    lambda aux, children: OptimizerState(children[0], *aux),
)


def optimizer(opt_maker: Callable):
    """Lift a maker of (init, update, get_params) for one array into one over pytrees."""

    @functools.wraps(opt_maker)
    def tree_opt_maker(*args, **kwargs):
        init, update, get_params = opt_maker(*args, **kwargs)

        @functools.wraps(init)
        def tree_init(x0_tree):
            x0_flat, tree = tree_flatten(x0_tree)
            states = [init(x0) for x0 in x0_flat]
            flat_states, subtrees = zip(*[tree_flatten(s) for s in states]) if states else ((), ())
            return OptimizerState(list(flat_states), tree, tuple(subtrees))

        @functools.wraps(update)
        def tree_update(i, grad_tree, opt_state):
            states_flat, tree, subtrees = opt_state
            grad_flat, tree2 = tree_flatten(grad_tree)
            if tree2 != tree:
                raise TypeError(
                    f"optimizer update: the gradients' structure {tree2} differs from the parameters' {tree}"
                )
            states = [tree_unflatten(s, f) for s, f in zip(subtrees, states_flat)]
            new = [update(i, g, s) for g, s in zip(grad_flat, states)]
            flat_new, subtrees_new = zip(*[tree_flatten(s) for s in new]) if new else ((), ())
            return OptimizerState(list(flat_new), tree, tuple(subtrees_new))

        @functools.wraps(get_params)
        def tree_get_params(opt_state):
            states_flat, tree, subtrees = opt_state
            states = [tree_unflatten(s, f) for s, f in zip(subtrees, states_flat)]
            return tree_unflatten(tree, [get_params(s) for s in states])

        return Optimizer(tree_init, tree_update, tree_get_params)

    return tree_opt_maker


def _arr(x):
    return tnp.asarray(x) if not isinstance(x, (tnp.Tracer, tnp.Array)) else x


def _zeros(x):
    return tnp.zeros_like(x)


@optimizer
def sgd(step_size):
    step_size = make_schedule(step_size)
    return (lambda x0: _arr(x0), lambda i, g, x: x - step_size(i) * g, lambda x: x)


@optimizer
def momentum(step_size, mass: float):
    step_size = make_schedule(step_size)

    def init(x0):
        x0 = _arr(x0)
        return x0, _zeros(x0)

    def update(i, g, state):
        x, velocity = state
        velocity = mass * velocity + g
        return x - step_size(i) * velocity, velocity

    return init, update, lambda state: state[0]


@optimizer
def nesterov(step_size, mass: float):
    step_size = make_schedule(step_size)

    def init(x0):
        x0 = _arr(x0)
        return x0, _zeros(x0)

    def update(i, g, state):
        x, velocity = state
        velocity = mass * velocity + g
        return x - step_size(i) * (mass * velocity + g), velocity

    return init, update, lambda state: state[0]


@optimizer
def adagrad(step_size, momentum: float = 0.9):
    step_size = make_schedule(step_size)

    def init(x0):
        x0 = _arr(x0)
        return x0, _zeros(x0), _zeros(x0)

    def update(i, g, state):
        x, g_sq, m = state
        g_sq = g_sq + tnp.square(g)
        g_sq_inv_sqrt = tnp.where(g_sq > 0, 1.0 / tnp.sqrt(g_sq), 0.0)
        m = (1.0 - momentum) * (g * g_sq_inv_sqrt) + momentum * m
        return x - step_size(i) * m, g_sq, m

    return init, update, lambda state: state[0]


@optimizer
def rmsprop(step_size, gamma: float = 0.9, eps: float = 1e-8):
    step_size = make_schedule(step_size)

    def init(x0):
        x0 = _arr(x0)
        return x0, _zeros(x0)

    def update(i, g, state):
        x, avg_sq_grad = state
        avg_sq_grad = avg_sq_grad * gamma + tnp.square(g) * (1.0 - gamma)
        return x - step_size(i) * g / tnp.sqrt(avg_sq_grad + eps), avg_sq_grad

    return init, update, lambda state: state[0]


@optimizer
def rmsprop_momentum(step_size, gamma: float = 0.9, eps: float = 1e-8, momentum: float = 0.9):
    step_size = make_schedule(step_size)

    def init(x0):
        x0 = _arr(x0)
        return x0, _zeros(x0), _zeros(x0)

    def update(i, g, state):
        x, avg_sq_grad, mom = state
        avg_sq_grad = avg_sq_grad * gamma + tnp.square(g) * (1.0 - gamma)
        mom = momentum * mom + step_size(i) * g / tnp.sqrt(avg_sq_grad + eps)
        return x - mom, avg_sq_grad, mom

    return init, update, lambda state: state[0]


def _t(i, x):
    """The step count as a float of x's precision (float64 parameters: float64)."""
    return tnp.astype(i, tnp.float64 if tnp.result_type(x) == tnp.float64 else tnp.float32)


@optimizer
def adam(step_size, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8):
    step_size = make_schedule(step_size)

    def init(x0):
        x0 = _arr(x0)
        return x0, _zeros(x0), _zeros(x0)

    def update(i, g, state):
        x, m, v = state
        m = (1 - b1) * g + b1 * m
        v = (1 - b2) * tnp.square(g) + b2 * v
        t = _t(i, x) + 1
        mhat = m / (1 - tnp.power(b1, t))
        vhat = v / (1 - tnp.power(b2, t))
        return tnp.astype(x - step_size(i) * mhat / (tnp.sqrt(vhat) + eps), tnp.result_type(x)), m, v

    return init, update, lambda state: state[0]


@optimizer
def adamax(step_size, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8):
    step_size = make_schedule(step_size)

    def init(x0):
        x0 = _arr(x0)
        return x0, _zeros(x0), _zeros(x0)

    def update(i, g, state):
        x, m, u = state
        m = (1 - b1) * g + b1 * m
        u = tnp.maximum(b2 * u, tnp.abs(g))
        t = _t(i, x) + 1
        return (
            tnp.astype(x - (step_size(i) / (1 - tnp.power(b1, t))) * m / (u + eps), tnp.result_type(x)),
            m,
            u,
        )

    return init, update, lambda state: state[0]


@optimizer
def sm3(step_size, momentum: float = 0.9):
    """SM3 for vectors and matrices (one accumulator per row and per column)."""
    step_size = make_schedule(step_size)

    def init(x0):
        x0 = _arr(x0)
        vs = [tnp.zeros((n,), tnp.result_type(x0)) for n in tnp.shape(x0)]
        return x0, _zeros(x0), vs

    def update(i, g, state):
        x, m, vs = state
        nd = tnp.ndim(x)
        shaped = [tnp.reshape(v, [-1 if k == j else 1 for k in range(nd)]) for j, v in enumerate(vs)]
        acc = shaped[0] if shaped else tnp.zeros((), tnp.result_type(x))
        for s in shaped[1:]:
            acc = tnp.minimum(acc, s)
        acc = acc + tnp.square(g)
        vs = [tnp.max(acc, axis=tuple(k for k in range(nd) if k != j)) for j in range(nd)]
        update_ = g / tnp.sqrt(tnp.where(acc > 0, acc, 1.0)) * (acc > 0)
        m = (1 - momentum) * update_ + momentum * m
        return x - step_size(i) * m, m, vs

    return init, update, lambda state: state[0]


# ---- schedules -------------------------------------------------------------------------------


def constant(step_size) -> Callable:
    return lambda i: step_size


def exponential_decay(step_size, decay_steps, decay_rate) -> Callable:
    return lambda i: step_size * decay_rate ** (i / decay_steps)


def inverse_time_decay(step_size, decay_steps, decay_rate, staircase: bool = False) -> Callable:
    if staircase:
        return lambda i: step_size / (1 + decay_rate * tnp.floor(i / decay_steps))
    return lambda i: step_size / (1 + decay_rate * i / decay_steps)


def polynomial_decay(step_size, decay_steps, final_step_size, power: float = 1.0) -> Callable:
    def schedule(i):
        i = tnp.minimum(i, decay_steps)
        return (step_size - final_step_size) * (1 - i / decay_steps) ** power + final_step_size

    return schedule


def piecewise_constant(boundaries, values) -> Callable:
    boundaries, values = list(boundaries), list(values)
    if len(values) != len(boundaries) + 1:
        raise ValueError("piecewise_constant: needs one more value than boundaries")

    def schedule(i):
        out = values[-1]
        for b, v in zip(boundaries[::-1], values[-2::-1]):
            out = tnp.where(i < b, v, out)
        return out

    return schedule


def make_schedule(scalar_or_schedule) -> Callable:
    return scalar_or_schedule if callable(scalar_or_schedule) else constant(scalar_or_schedule)


# ---- utilities -------------------------------------------------------------------------------


def l2_norm(tree):
    from tilefuse.tracer.pytree import tree_leaves

    leaves = tree_leaves(tree)
    return tnp.sqrt(sum(tnp.vdot(x, x) for x in leaves)) if leaves else tnp.zeros(())


def clip_grads(grad_tree, max_norm):
    norm = l2_norm(grad_tree)
    factor = tnp.where(norm < max_norm, 1.0, max_norm / norm)
    return tree_map(lambda g: g * factor, grad_tree)


def unpack_optimizer_state(opt_state: OptimizerState):
    """The state as a pytree of per-leaf tuples (for checkpoints)."""
    states_flat, tree, subtrees = opt_state
    return tree_unflatten(tree, [tree_unflatten(s, f) for s, f in zip(subtrees, states_flat)])


def pack_optimizer_state(marked_pytree) -> OptimizerState:
    from tilefuse.tracer.pytree import tree_flatten as flatten

    leaves, tree = flatten(
        marked_pytree, is_leaf=lambda x: isinstance(x, tuple) and not hasattr(x, "_fields")
    )
    flat_states, subtrees = zip(*[flatten(s) for s in leaves]) if leaves else ((), ())
    return OptimizerState(list(flat_states), tree, tuple(subtrees))
