"""tilefuse.optim: optimizers as pure gradient transformations, in optax's style.

An optimizer is a pair of pure functions: `init(params) -> state` and
`update(grads, state, params=None) -> (updates, new_state)`; `apply_updates(params, updates)`
adds the updates. States are pytrees of arrays (NamedTuples), so a whole training step,
optimizer included, can be jitted, and a state can be flattened into a checkpoint.

    opt = optim.chain(optim.clip_by_global_norm(1.0),
                      optim.adamw(optim.warmup_cosine(0, 3e-3, 100, 1000), weight_decay=0.1))
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = optim.apply_updates(params, updates)
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import tilefuse.numpy as tnp
from tilefuse.ir.errors import TilefuseError, with_user_line
from tilefuse.tracer.pytree import tree_leaves, tree_map

__all__ = ["GradientTransformation", "chain", "identity", "scale", "scale_by_learning_rate",
           "scale_by_schedule", "trace", "scale_by_adam", "add_decayed_weights",
           "clip_by_global_norm", "global_norm", "sgd", "adam", "adamw", "apply_updates",
           "constant_schedule", "linear_schedule", "cosine_decay_schedule",
           "warmup_cosine_decay_schedule", "warmup_cosine"]


class GradientTransformation(NamedTuple):
    """init(params) -> state; update(updates, state, params=None) -> (updates, state)."""
    init: Callable
    update: Callable


class EmptyState(NamedTuple):
    pass


class CountState(NamedTuple):
    count: Any  # int32 scalar: updates applied so far


class TraceState(NamedTuple):
    trace: Any


class AdamState(NamedTuple):
    count: Any
    mu: Any
    nu: Any


def _compute_dtype(x):
    return tnp.float64 if tnp.result_type(x) == tnp.float64 else tnp.float32


def _count0():
    return tnp.zeros((), tnp.int32)


def _zeros_like_tree(params):
    return tree_map(lambda p: tnp.zeros(tnp.shape(p), p.dtype if hasattr(p, "dtype") else tnp.float32),
                    params)


# ---- schedules: step count (int, possibly traced) -> value ------------------------------------

def constant_schedule(value: float) -> Callable:
    return lambda count: tnp.full((), value, tnp.float32)


def linear_schedule(init_value: float, end_value: float, transition_steps: int) -> Callable:
    """From init_value to end_value linearly over transition_steps, then constant."""
    def schedule(count):
        frac = tnp.clip(tnp.astype(count, tnp.float32) / float(max(transition_steps, 1)), 0.0, 1.0)
        return init_value + (end_value - init_value) * frac
    return schedule


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0) -> Callable:
    """init_value * ((1 - alpha) * (1 + cos(pi * t)) / 2 + alpha), t = count / decay_steps <= 1."""
    def schedule(count):
        t = tnp.clip(tnp.astype(count, tnp.float32) / float(max(decay_steps, 1)), 0.0, 1.0)
        return init_value * ((1.0 - alpha) * 0.5 * (1.0 + tnp.cos(math.pi * t)) + alpha)
    return schedule


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                 decay_steps: int, end_value: float = 0.0) -> Callable:
    """Linear warmup from init_value to peak_value over warmup_steps, then cosine decay to
    end_value at decay_steps (which counts the warmup, as in optax), then constant."""
    span = float(max(decay_steps - warmup_steps, 1))

    def schedule(count):
        c = tnp.astype(count, tnp.float32)
        warm = init_value + (peak_value - init_value) * (c / float(max(warmup_steps, 1)))
        t = tnp.clip((c - float(warmup_steps)) / span, 0.0, 1.0)
        cos = end_value + (peak_value - end_value) * 0.5 * (1.0 + tnp.cos(math.pi * t))
        return tnp.where(c < float(warmup_steps), warm, cos)
    return schedule


warmup_cosine = warmup_cosine_decay_schedule


# ---- building blocks -------------------------------------------------------------------------

def identity() -> GradientTransformation:
    return GradientTransformation(lambda params: EmptyState(), lambda u, s, params=None: (u, s))


def scale(step_size: float) -> GradientTransformation:
    """Multiply the updates by a constant."""
    def update(updates, state, params=None):
        return tree_map(lambda u: u * step_size, updates), state
    return GradientTransformation(lambda params: EmptyState(), update)


def scale_by_schedule(schedule: Callable) -> GradientTransformation:
    """Multiply the updates by schedule(count), count being the number of updates so far."""
    def update(updates, state, params=None):
        s = schedule(state.count)
        return (tree_map(lambda u: u * tnp.astype(s, u.dtype), updates),
                CountState(state.count + 1))
    return GradientTransformation(lambda params: CountState(_count0()), update)


def scale_by_learning_rate(learning_rate) -> GradientTransformation:
    """Multiply by -learning_rate (a number or a schedule): descend."""
    if callable(learning_rate):
        return scale_by_schedule(lambda count: -learning_rate(count))
    return scale(-float(learning_rate))


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum: t = g + decay * t; the update is t, or g + decay * t with Nesterov."""
    def update(updates, state, params=None):
        new = tree_map(lambda g, t: g + decay * t, updates, state.trace)
        out = tree_map(lambda g, t: g + decay * t, updates, new) if nesterov else new
        return out, TraceState(new)
    return GradientTransformation(lambda params: TraceState(_zeros_like_tree(params)), update)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  eps_root: float = 0.0) -> GradientTransformation:
    """Adam's direction: bias-corrected first moment over the root of the second moment."""
    def init(params):
        return AdamState(_count0(), _zeros_like_tree(params), _zeros_like_tree(params))

    def update(updates, state, params=None):
        mu = tree_map(lambda g, m: b1 * m + (1.0 - b1) * g, updates, state.mu)
        nu = tree_map(lambda g, v: b2 * v + (1.0 - b2) * (g * g), updates, state.nu)
        count = state.count + 1
        corrections: dict = {}  # compute dtype -> (c1, c2), made once for all leaves of that dtype

        def direction(m, v):
            # the bias corrections in the parameter's precision (float64 stays float64; 16-bit
            # floats use float32): 1 - 0.999**t loses 4 digits in float32 at small t
            dt = _compute_dtype(m)
            if dt not in corrections:
                t = tnp.astype(count, dt)
                corrections[dt] = 1.0 - tnp.power(b1, t), 1.0 - tnp.power(b2, t)
            c1, c2 = corrections[dt]
            return tnp.astype((m / c1) / (tnp.sqrt(v / c2 + eps_root) + eps), m.dtype)
        return tree_map(direction, mu, nu), AdamState(count, mu, nu)
    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float, mask=None) -> GradientTransformation:
    """Add weight_decay * param to each update (decoupled weight decay when applied after the
    direction, as in AdamW). mask: a pytree of bools like params, or a function params -> it;
    False leaves are not decayed (biases, norms)."""
    def update(updates, state, params=None):
        if params is None:
            raise TilefuseError(with_user_line("add_decayed_weights (weight decay) needs the params: "
                                               "call update(grads, state, params)"))
        m = mask(params) if callable(mask) else mask
        if m is None:
            return tree_map(lambda u, p: u + weight_decay * p, updates, params), state
        return tree_map(lambda u, p, k: u + weight_decay * p if k else u, updates, params, m), state
    return GradientTransformation(lambda params: EmptyState(), update)


def global_norm(tree):
    """sqrt of the sum of squares of every leaf (float32)."""
    leaves = tree_leaves(tree)
    if not leaves:
        return tnp.zeros((), tnp.float32)
    total = None
    for x in leaves:
        s = tnp.sum(tnp.astype(x, tnp.float32) ** 2)
        total = s if total is None else total + s
    return tnp.sqrt(total)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates by max_norm / global_norm when the global norm exceeds max_norm."""
    def update(updates, state, params=None):
        g = global_norm(updates)
        factor = tnp.where(g < max_norm, 1.0, max_norm / tnp.where(g < max_norm, 1.0, g))
        return tree_map(lambda u: u * tnp.astype(factor, u.dtype), updates), state
    return GradientTransformation(lambda params: EmptyState(), update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transformations in order; the state is the tuple of their states."""
    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        if len(state) != len(transforms):
            raise TilefuseError(with_user_line(f"chain: the state has {len(state)} parts for "
                                               f"{len(transforms)} transformations; was it made by "
                                               "this optimizer's init?"))
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)
    return GradientTransformation(init, update)


# ---- optimizers --------------------------------------------------------------------------------

def sgd(learning_rate, momentum: float | None = None, nesterov: bool = False) -> GradientTransformation:
    """Stochastic gradient descent, with (Nesterov) momentum when momentum is given."""
    parts = [trace(momentum, nesterov)] if momentum else []
    return chain(*parts, scale_by_learning_rate(learning_rate))


def adam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0) -> GradientTransformation:
    return chain(scale_by_adam(b1, b2, eps, eps_root), scale_by_learning_rate(learning_rate))


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, weight_decay: float = 1e-4, mask=None) -> GradientTransformation:
    """Adam with decoupled weight decay: p -= lr * (adam_direction + weight_decay * p)."""
    return chain(scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


def apply_updates(params, updates):
    """params + updates, leaf by leaf, keeping each parameter's dtype."""
    return tree_map(lambda p, u: tnp.astype(p + u, p.dtype) if hasattr(p, "dtype") else p + u,
                    params, updates)
