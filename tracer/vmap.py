"""vmap: batching as a trace on the trace stack (Autodidax style).

A BatchTracer carries a value of the level below and `bdim`, the axis of that value that is the
batch (None: the same for every example). Each primitive has one batching rule in `batch_rules`:
rule(vals, dims, **params) -> (outs, out_dims), written with bind on primitives, so vmap composes
with jit (staging), with itself (nesting) and with autodiff."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import numpy as np

from tilefuse.ir import primitives as P
from tilefuse.ir.errors import TilefuseError, TransformError, for_user, with_user_line
from tilefuse.ir.primitives import Primitive
from tilefuse.ir.symbolic import distinct

from . import pytree
from .core import (Trace, Tracer, bind, bind1, bind_custom_jvp, bind_custom_vjp, full_lower, full_raise,
                   get_aval, is_array_like, new_main)

__all__ = ["vmap", "batch_rules", "BatchTrace", "BatchTracer"]


class BatchTracer(Tracer):
    """A value with a batch axis `bdim` (None: not batched) under one vmap."""
    __slots__ = ("_trace", "val", "bdim")

    def __init__(self, trace, val, bdim: int | None):
        self._trace, self.val, self.bdim = trace, val, bdim

    @property
    def aval(self):
        a = get_aval(self.val)
        if self.bdim is None:
            return a
        return a.update(shape=a.shape[:self.bdim] + a.shape[self.bdim + 1:])

    def full_lower(self):
        return full_lower(self.val) if self.bdim is None else self


class BatchTrace(Trace):
    """Interprets primitives on batched values with the rules of `batch_rules`."""

    def pure(self, val):
        return BatchTracer(self, val, None)

    lift = pure

    def process_primitive(self, prim, tracers, params):
        vals = [t.val for t in tracers]
        dims = [t.bdim for t in tracers]
        if all(d is None for d in dims):
            return [BatchTracer(self, o, None) for o in bind(prim, *vals, **params)]
        rule = batch_rules.get(prim)
        if rule is None:
            raise TransformError(with_user_line(
                f"vmap: no batching rule for primitive '{prim.name}'; add one to "
                "tilefuse.tracer.vmap.batch_rules"))
        outs, out_dims = rule(vals, dims, **params)
        return [BatchTracer(self, o, d) for o, d in zip(outs, out_dims, strict=True)]

    # A custom_vjp/custom_jvp function batched stays one: its function and its rule are vmapped
    # (every argument's batch axis at 0, unbatched ones broadcast), so a grad outside still uses
    # the user's rule, per example.
    def _batched_all(self, tracers):
        vals, dims = [t.val for t in tracers], [t.bdim for t in tracers]
        if all(d is None for d in dims):
            return vals, None
        n = _axis_size(vals, dims)
        return [bdim_at(v, d, n, 0) for v, d in zip(vals, dims)], n

    def process_custom_vjp(self, fun, fwd, bwd, tracers, out_tree_thunk):
        vals, n = self._batched_all(tracers)
        if n is None:
            return [BatchTracer(self, o, None) for o in bind_custom_vjp(fun, fwd, bwd, *vals)]
        outs = bind_custom_vjp(vmap(fun), vmap(fwd), lambda res, cts: vmap(bwd)(res, cts), *vals)
        return [BatchTracer(self, o, 0) for o in outs]

    def process_custom_jvp(self, fun, jvp, tracers):
        vals, n = self._batched_all(tracers)
        if n is None:
            return [BatchTracer(self, o, None) for o in bind_custom_jvp(fun, jvp, *vals)]
        outs = bind_custom_jvp(vmap(fun), lambda ps, ts: vmap(jvp)(ps, ts), *vals)
        return [BatchTracer(self, o, 0) for o in outs]


# ---- helpers, written with primitives ------------------------------------------------------

def _ndim(x) -> int:
    return get_aval(x).ndim


def _shape(x) -> tuple[int, ...]:
    return get_aval(x).shape


def _full_axes(axes, b: int) -> tuple[int, ...]:
    """Per-example axes as axes of the batched value whose batch axis is b."""
    return tuple(a + (a >= b) for a in axes)


def moveaxis(x, src: int, dst: int):
    if src == dst:
        return x
    perm = list(range(_ndim(x)))
    perm.insert(dst, perm.pop(src))
    return bind1(P.transpose, x, permutation=tuple(perm))


def bdim_at(x, bdim: int | None, size: int, dst: int):
    """x with its batch axis at dst; an unbatched x is broadcast to `size` examples."""
    if bdim is not None:
        return moveaxis(x, bdim, dst)
    shape = list(_shape(x))
    dims = tuple(i + (i >= dst) for i in range(len(shape)))
    shape.insert(dst, size)
    return bind1(P.broadcast_in_dim, x, shape=tuple(shape), broadcast_dimensions=dims)


def _axis_size(vals, dims) -> int:
    return next(_shape(v)[d] for v, d in zip(vals, dims) if d is not None)


def _full(value, dtype, shape):
    return bind1(P.broadcast_in_dim, np.asarray(value, dtype), shape=tuple(shape),
                 broadcast_dimensions=())


def _index_in_dim(x, i: int, axis: int):
    shape = _shape(x)
    start = tuple(i if a == axis else 0 for a in range(len(shape)))
    limit = tuple(i + 1 if a == axis else n for a, n in enumerate(shape))
    x = bind1(P.slice_, x, start_indices=start, limit_indices=limit, strides=(1,) * len(shape))
    return bind1(P.reshape, x, new_sizes=shape[:axis] + shape[axis + 1:])


def _flat_indices(idx, k: int):
    """Indices of shape (n, ...) into a per-example axis of size k, as indices into the axis of
    size n*k that stacks the examples: clamped per example first (gather clamps), then offset."""
    if k == 0:  # an empty axis gathers zeros whatever the index
        return idx
    shape, dt = _shape(idx), get_aval(idx).dtype
    idx = bind1(P.min_, bind1(P.max_, idx, _full(0, dt, shape)), _full(k - 1, dt, shape))
    offsets = bind1(P.mul, bind1(P.iota, dtype=dt, shape=shape, dimension=0), _full(k, dt, shape))
    return bind1(P.add, idx, offsets)


def _merge_axes(x, axis: int):
    """Merge axes axis and axis+1 of x into one."""
    s = _shape(x)
    return bind1(P.reshape, x, new_sizes=s[:axis] + (s[axis] * s[axis + 1],) + s[axis + 2:])


# ---- the rules --------------------------------------------------------------------------------

batch_rules: dict[Primitive, Callable] = {}


def _elementwise(prim, vals, dims, **params):
    # Keep a batch axis all batched operands share; otherwise move it to the front. Unbatched
    # operands are broadcast, since elementwise primitives need equal shapes.
    batched = {d for d in dims if d is not None}
    b = batched.pop() if len(batched) == 1 else 0
    n = _axis_size(vals, dims)
    vals = [bdim_at(v, d, n, b) for v, d in zip(vals, dims)]
    return bind(prim, *vals, **params), [b]


for _p in P.PRIMITIVES.values():
    if _p.elementwise and not _p.effectful:
        batch_rules[_p] = functools.partial(_elementwise, _p)


def _iota_rule(vals, dims, **params):  # no operands: it is never batched
    return bind(P.iota, **params), [None]


def _broadcast_in_dim_rule(vals, dims, *, shape, broadcast_dimensions):
    (x,), (b,) = vals, dims
    x = moveaxis(x, b, 0)
    out = bind1(P.broadcast_in_dim, x, shape=(_shape(x)[0], *shape),
                broadcast_dimensions=(0, *(d + 1 for d in broadcast_dimensions)))
    return [out], [0]


def _reshape_rule(vals, dims, *, new_sizes):
    (x,), (b,) = vals, dims
    x = moveaxis(x, b, 0)
    return [bind1(P.reshape, x, new_sizes=(_shape(x)[0], *new_sizes))], [0]


def _transpose_rule(vals, dims, *, permutation):
    (x,), (b,) = vals, dims
    perm = (b, *_full_axes(permutation, b))
    return [bind1(P.transpose, x, permutation=perm)], [0]


def _rev_rule(vals, dims, *, dimensions):
    (x,), (b,) = vals, dims
    return [bind1(P.rev, x, dimensions=_full_axes(dimensions, b))], [b]


def _slice_rule(vals, dims, *, start_indices, limit_indices, strides):
    (x,), (b,) = vals, dims
    n = _shape(x)[b]

    def ins(t, v):
        return (*t[:b], v, *t[b:])
    out = bind1(P.slice_, x, start_indices=ins(start_indices, 0), limit_indices=ins(limit_indices, n),
                strides=ins(strides, 1))
    return [out], [b]


def _concatenate_rule(vals, dims, *, dimension):
    n = _axis_size(vals, dims)
    vals = [bdim_at(v, d, n, 0) for v, d in zip(vals, dims)]
    return [bind1(P.concatenate, *vals, dimension=dimension + 1)], [0]


def _pad_rule(vals, dims, *, padding_config):
    (x, pv), (xb, pb) = vals, dims
    if pb is None:
        config = (*padding_config[:xb], (0, 0, 0), *padding_config[xb:])
        return [bind1(P.pad, x, pv, padding_config=config)], [xb]
    # A padding value per example: pad with any value, then select it where the mask says pad.
    n = _axis_size(vals, dims)
    x = bdim_at(x, xb, n, 0)
    config = ((0, 0, 0), *padding_config)
    dt = get_aval(x).dtype
    padded = bind1(P.pad, x, np.zeros((), dt), padding_config=config)
    mask = bind1(P.pad, _full(True, np.bool_, _shape(x)), np.asarray(False), padding_config=config)
    fill = bind1(P.broadcast_in_dim, bdim_at(pv, pb, n, 0), shape=_shape(padded),
                 broadcast_dimensions=(0,))
    return [bind1(P.select, mask, padded, fill)], [0]


def _reduce_rule(prim, vals, dims, *, axes):
    (x,), (b,) = vals, dims
    axes = _full_axes(axes, b)
    return bind(prim, x, axes=axes), [b - sum(a < b for a in axes)]


def _arg_rule(prim, vals, dims, *, axis, index_dtype):
    (x,), (b,) = vals, dims
    (axis,) = _full_axes((axis,), b)
    return bind(prim, x, axis=axis, index_dtype=index_dtype), [b - (axis < b)]


def _dot_general_rule(vals, dims, *, dimension_numbers, **params):
    # The batch axis joins the batch dimensions (both batched) or the free dimensions (one
    # batched): one dot_general either way, never a loop.
    (lhs, rhs), (lb_, rb_) = vals, dims
    (lc, rc), (lb, rb) = dimension_numbers
    if lb_ is not None and rb_ is not None:
        dn = ((_full_axes(lc, lb_), _full_axes(rc, rb_)),
              ((lb_, *_full_axes(lb, lb_)), (rb_, *_full_axes(rb, rb_))))
        out_dim = 0
    elif lb_ is not None:
        lc, lb = _full_axes(lc, lb_), _full_axes(lb, lb_)
        dn = ((lc, rc), (lb, rb))
        out_dim = len(lb) + sum(1 for i in range(lb_) if i not in lc and i not in lb)
    else:
        rc, rb = _full_axes(rc, rb_), _full_axes(rb, rb_)
        dn = ((lc, rc), (lb, rb))
        n_lhs_free = _ndim(lhs) - len(lc) - len(lb)
        out_dim = len(lb) + n_lhs_free + sum(1 for i in range(rb_) if i not in rc and i not in rb)
    out = bind1(P.dot_general, lhs, rhs, dimension_numbers=dn, **params)
    return [out], [out_dim]


def _gather_rule(vals, dims, *, axis):
    (op, idx), (ob, ib) = vals, dims
    if ib is None:
        a = axis + (ob <= axis)
        out_dim = ob if ob < a else ob + _ndim(idx) - 1
        return [bind1(P.gather, op, idx, axis=a)], [out_dim]
    if ob is None:
        return [bind1(P.gather, op, idx, axis=axis)], [axis + ib]
    # Both batched: stack the examples along the gathered axis and offset each one's indices.
    n = _axis_size(vals, dims)
    op = bdim_at(op, ob, n, axis)
    k = _shape(op)[axis + 1]
    flat_idx = _flat_indices(bdim_at(idx, ib, n, 0), k)
    return [bind1(P.gather, _merge_axes(op, axis), flat_idx, axis=axis)], [axis]


def _scatter_add_rule(vals, dims, *, axis):
    (op, idx, upd), (ob, ib, ub) = vals, dims
    n = _axis_size(vals, dims)
    if ib is None:
        op, upd = bdim_at(op, ob, n, 0), bdim_at(upd, ub, n, 0)
        return [bind1(P.scatter_add, op, idx, upd, axis=axis + 1)], [0]
    # Batched indices: stack the examples along the scattered axis, offset the indices.
    op = bdim_at(op, ob, n, axis)
    shape = _shape(op)
    flat_idx = _flat_indices(bdim_at(idx, ib, n, 0), shape[axis + 1])
    out = bind1(P.scatter_add, _merge_axes(op, axis), flat_idx, bdim_at(upd, ub, n, axis),
                axis=axis)
    return [bind1(P.reshape, out, new_sizes=shape)], [axis]


def _debug_print_rule(vals, dims, *, fmt, names):
    # Print once per example, as the Python loop that vmap stands for would.
    for i in range(_axis_size(vals, dims)):
        xs = [v if d is None else _index_in_dim(v, i, d) for v, d in zip(vals, dims)]
        bind(P.debug_print, *xs, fmt=fmt, names=names)
    return [], []


def _attention_rule(prim, vals, bdims, *, scale, causal, dims):
    """The mapped axis becomes one more batch axis (the first) of every operand; a bias that is
    not batched gets a size-1 axis there. fused_attention_bwd's out and dout are laid out like q;
    its packed result is repacked per example."""
    n = _axis_size(vals, bdims)
    has_bias = len(vals) in (4, 6)
    xs = []
    for i, (x, d) in enumerate(zip(vals, bdims)):
        if i == 3 and has_bias and d is None:
            xs.append(bind1(P.reshape, x, new_sizes=(1,) + _shape(x)))
        else:
            xs.append(bdim_at(x, d, n, 0))
    layouts = tuple((0,) + tuple(a + 1 for a in d) for d in dims)
    out = bind1(prim, *xs, scale=scale, causal=causal, dims=layouts)
    if prim is P.fused_attention_bwd:  # packed (dq, dk, dv) of the batch -> one packing per example
        parts, start = [], 0
        for x in xs[:3]:
            size = int(np.prod(_shape(x)))
            part = bind1(P.slice_, out, start_indices=(start,), limit_indices=(start + size,),
                         strides=(1,))
            parts.append(bind1(P.reshape, part, new_sizes=(n, size // n)))
            start += size
        out = bind1(P.concatenate, *parts, dimension=1)
    return [out], [0]


def _fold_into(x, bdim: int, axis: int, groups: int):
    """The examples of x (its batch axis bdim) merged into x's per-example axis `axis`, of size
    groups * rest, between its groups and the rest: (groups, examples, rest) as one axis."""
    x = moveaxis(x, bdim, 0)
    s = _shape(x)
    x = bind1(P.reshape, x, new_sizes=s[:axis + 1] + (groups, s[axis + 1] // groups) + s[axis + 2:])
    x = moveaxis(x, 0, axis + 1)
    s = _shape(x)
    return bind1(P.reshape, x, new_sizes=s[:axis] + (s[axis] * s[axis + 1] * s[axis + 2],) + s[axis + 3:])


def _unfold_from(y, axis: int, groups: int, n: int):
    """_fold_into's inverse on a result: axis `axis` (groups, n examples, rest) -> the examples at
    axis, the rest of that axis after them."""
    s = _shape(y)
    y = bind1(P.reshape, y, new_sizes=s[:axis] + (groups, n, s[axis] // (groups * n)) + s[axis + 1:])
    y = moveaxis(y, axis + 1, axis)
    return _merge_axes(y, axis + 1)


def _conv_rule(vals, dims, **params):
    """The examples join the lhs batch (inside its batch groups) or the output features (inside
    their groups), or, both operands batched, become feature groups (JAX's rule)."""
    (x, w), (bx, bw) = vals, dims
    ls, rs, os_ = params["dimension_numbers"]
    g, b = params["feature_group_count"], params["batch_group_count"]
    n = _axis_size(vals, dims)
    if bw is None:
        y = bind1(P.conv, _fold_into(x, bx, ls[0], b), w, **params)
        return [_unfold_from(y, os_[0], 1, n)], [os_[0]]
    if bx is None:
        y = bind1(P.conv, x, _fold_into(w, bw, rs[0], g * b), **params)
        return [_unfold_from(y, os_[1], g * b, n)], [os_[1]]
    if b == 1:
        y = bind1(P.conv, _fold_into(x, bx, ls[1], 1), _fold_into(w, bw, rs[0], 1),
                  **dict(params, feature_group_count=g * n))
        return [_unfold_from(y, os_[1], 1, n)], [os_[1]]
    ys = [bind1(P.conv, _index_in_dim(x, i, bx), _index_in_dim(w, i, bw), **params) for i in range(n)]
    return [bind1(P.concatenate, *[bind1(P.reshape, y, new_sizes=(1,) + _shape(y)) for y in ys],
                  dimension=0)], [0]


batch_rules.update({
    P.iota: _iota_rule,
    P.broadcast_in_dim: _broadcast_in_dim_rule,
    P.reshape: _reshape_rule,
    P.transpose: _transpose_rule,
    P.rev: _rev_rule,
    P.slice_: _slice_rule,
    P.concatenate: _concatenate_rule,
    P.pad: _pad_rule,
    P.dot_general: _dot_general_rule,
    P.conv: _conv_rule,
    P.gather: _gather_rule,
    P.scatter_add: _scatter_add_rule,
    P.debug_print: _debug_print_rule,
})
for _p in (P.reduce_sum, P.reduce_max, P.reduce_min, P.reduce_prod):
    batch_rules[_p] = functools.partial(_reduce_rule, _p)
for _p in (P.argmax, P.argmin):
    batch_rules[_p] = functools.partial(_arg_rule, _p)
for _p in (P.fused_attention, P.fused_attention_bwd):
    batch_rules[_p] = functools.partial(_attention_rule, _p)


# ---- the transformation --------------------------------------------------------------------

def _key_str(node_type, aux, i) -> str:
    if node_type is dict:
        return f"[{aux[i]!r}]"
    return f"[{i}]"


def _leaf_paths(td, path: str) -> list[str]:
    if td.node_type is None:
        return [path]
    return [p for i, c in enumerate(td.children)
            for p in _leaf_paths(c, path + _key_str(td.node_type, td.aux, i))]


def _broadcast_prefix(prefix, tree, name: str, what: str) -> list[tuple[Any, str]]:
    """(axis, path) for every leaf of `tree`, where `prefix` is an int/None or a container
    of the same structure as the top of `tree` (a tree prefix, as in JAX)."""
    pleaves, pdef = pytree.tree_flatten(prefix, is_leaf=lambda x: x is None)
    _, tdef = pytree.tree_flatten(tree)
    it = iter(pleaves)
    out: list[tuple[Any, str]] = []

    def rec(pd, td, path):
        if pd.node_type is None:
            ax = next(it)
            if ax is not None and (not isinstance(ax, (int, np.integer)) or isinstance(ax, bool)):
                raise TransformError(with_user_line(
                    f"vmap: {what} for {path} must be an int or None, got {ax!r}"))
            out.extend((ax, p) for p in _leaf_paths(td, path))
            return
        if (pd.node_type, pd.aux, len(pd.children)) != (td.node_type, td.aux, len(td.children)):
            raise TransformError(with_user_line(
                f"vmap: {what} must be a tree prefix of {name}: at {path} it is {pd} but the "
                f"value there has structure {td}"))
        for i, (pc, tc) in enumerate(zip(pd.children, td.children)):
            rec(pc, tc, path + _key_str(td.node_type, td.aux, i))

    rec(pdef, tdef, name)
    return out


def _arg_names(f, n: int) -> list[str]:
    try:
        params = [p for p in inspect.signature(f).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [f"argument {i} ({params[i].name!r})" if i < len(params) else f"argument {i}"
            for i in range(n)]


def _in_specs(f, in_axes, args, kwargs) -> list[tuple[Any, str]]:
    """One (axis, name) per leaf of (args, kwargs); keyword arguments are batched on axis 0."""
    if isinstance(in_axes, list):
        in_axes = tuple(in_axes)
    if isinstance(in_axes, dict) and len(args) == 1:
        in_axes = (in_axes,)
    if isinstance(in_axes, tuple):
        if len(in_axes) != len(args):
            raise TransformError(with_user_line(
                f"vmap: in_axes has {len(in_axes)} entries but {getattr(f, '__name__', 'f')} was "
                f"called with {len(args)} positional arguments"))
    elif in_axes is not None and (not isinstance(in_axes, (int, np.integer)) or isinstance(in_axes, bool)):
        raise TransformError(with_user_line(
            f"vmap: in_axes must be an int, None, or a tuple with one entry per positional "
            f"argument, got {in_axes!r}"))
    else:
        in_axes = (in_axes,) * len(args)
    specs = []
    for name, ax, a in zip(_arg_names(f, len(args)), in_axes, args):
        specs += _broadcast_prefix(ax, a, name, "in_axes")
    for k in sorted(kwargs):  # the order tree_flatten gives a dict's leaves
        specs += _broadcast_prefix(0, kwargs[k], f"keyword argument {k!r}", "in_axes")
    return specs


def _batch_inputs(trace, leaves, specs, axis_size):
    """Wrap batched leaves in tracers; check their axes and that all agree on the size."""
    axes, sizes = [], {}
    for x, (ax, name) in zip(leaves, specs):
        if ax is None:
            axes.append(None)
            continue
        if not is_array_like(x):
            raise TransformError(with_user_line(
                f"vmap: {name} is a {type(x).__name__}, not an array; give it in_axes None"))
        shape = get_aval(x).shape
        if not -len(shape) <= ax < len(shape):
            raise TransformError(with_user_line(
                f"vmap: in_axes {ax} for {name} of shape {shape} is out of range: it has "
                f"{len(shape)} axes" + (" (a scalar cannot be mapped; use in_axes None)"
                                        if not shape else "")))
        ax %= len(shape)
        axes.append(ax)
        sizes[name] = shape[ax]
    if axis_size is not None:
        sizes = {"axis_size": axis_size, **sizes}
    if not sizes:
        raise TransformError(with_user_line(
            "vmap: every in_axes is None, so the batch size is unknown; map at least one "
            "argument or pass axis_size="))
    if len(distinct(sizes.values())) > 1:  # (by ==: a traced size stays symbolic)
        listing = ", ".join(f"{name} has size {n}" for name, n in sizes.items())
        raise TransformError(with_user_line(
            f"vmap: the mapped axes have different sizes: {listing}"))
    n = next(iter(sizes.values()))
    tracers = [x if ax is None else BatchTracer(trace, x, ax) for x, ax in zip(leaves, axes)]
    return tracers, n


def _batch_output(trace, o, ax, n, name):
    if not is_array_like(o):
        raise TransformError(with_user_line(
            f"vmap: {name} is a {type(o).__name__}; vmapped functions must return arrays or "
            "pytrees of arrays"))
    t = full_raise(trace, o)
    nd = t.aval.ndim
    if ax is None:
        if t.bdim is not None:
            raise TransformError(with_user_line(
                f"vmap: out_axes is None for {name}, but it depends on a mapped input; give it "
                "an out axis"))
        return t.val
    if not -(nd + 1) <= ax <= nd:
        raise TransformError(with_user_line(
            f"vmap: out_axes {ax} for {name} of per-example shape {t.aval.shape} is out of range"))
    return bdim_at(t.val, t.bdim, n, ax % (nd + 1))


def vmap(f: Callable, in_axes=0, out_axes=0, *, axis_size: int | None = None) -> Callable:
    """Vectorise f over a batch axis of its arguments: vmap(f)(xs) == stack([f(x) for x in xs]).

    in_axes: an int, None (broadcast the argument) or a tuple with one entry per positional
    argument, each an int, None or a tree prefix of that argument (tuple/list/dict). Keyword
    arguments are mapped over axis 0. out_axes: likewise for the outputs; outputs that do not
    depend on a mapped input are broadcast. axis_size: the batch size when no input is mapped."""
    if not callable(f):
        raise TransformError(f"vmap: expected a function, got a {type(f).__name__}")

    @functools.wraps(f)
    def batched(*args, **kwargs):
        try:
            return _vmap_call(f, in_axes, out_axes, axis_size, args, kwargs)
        except Exception as e:  # (ours, or the user's code's: what the user sees)
            raise for_user(e)

    return batched


def _vmap_call(f, in_axes, out_axes, axis_size, args, kwargs):
    specs = _in_specs(f, in_axes, args, kwargs)
    leaves, in_tree = pytree.tree_flatten((args, kwargs))
    with new_main(BatchTrace, None) as main:
        trace = BatchTrace(main)
        tracers, n = _batch_inputs(trace, leaves, specs, axis_size)
        a, kw = pytree.tree_unflatten(in_tree, tracers)
        out = f(*a, **kw)
        out_leaves, out_tree = pytree.tree_flatten(out)
        out_specs = _broadcast_prefix(out_axes, out, "the output", "out_axes")
        outs = [_batch_output(trace, o, ax, n, name) for o, (ax, name) in zip(out_leaves, out_specs)]
    return pytree.tree_unflatten(out_tree, outs)


# ---- sorting and linear algebra (numpy_host primitives): operands carry leading batch axes ------

def _leading_batch_rule(prim, vals, dims, **params):
    """The mapped axis becomes the first batch axis of every operand (argsort's axis moves)."""
    n = _axis_size(vals, dims)
    vals = [bdim_at(v, d, n, 0) for v, d in zip(vals, dims)]
    if prim is P.argsort:
        params = dict(params, axis=params["axis"] + 1)
    return [bind1(prim, *vals, **params)], [0]


for _p in P.HOST_PRIMITIVES:
    batch_rules[_p] = functools.partial(_leading_batch_rule, _p)


# ---- control flow and dynamic slicing (tilefuse.lax) -------------------------------------------

def batch_graph(graph, batched_in: list[bool], size: int, force_out: list[bool]):
    """A closed graph vmapped: the inputs batched_in marks carry the batch at axis 0, and so do
    the outputs that depend on them and those force_out marks (broadcast). Returns (graph, its
    constants, which outputs are batched)."""
    from .staging import call_graph, trace_closed
    store: dict = {}

    def fun(*args):
        with new_main(BatchTrace, None) as main:
            trace = BatchTrace(main)
            ins = [BatchTracer(trace, a, 0) if b else a for a, b in zip(args, batched_in)]
            outs, batched = [], []
            for o, force in zip(call_graph(graph, *ins), force_out):
                t = full_raise(trace, o)
                if t.bdim is None and not force:
                    outs.append(t.val)
                    batched.append(False)
                else:
                    outs.append(bdim_at(t.val, t.bdim, size, 0))
                    batched.append(True)
        store["batched"] = batched
        return outs, None
    avals = [v.aval.update(shape=(size, *v.aval.shape)) if b else v.aval
             for v, b in zip(graph.invars, batched_in)]
    g, consts, _ = trace_closed(fun, avals)
    return g, list(consts), store["batched"]


def _carry_fixed_point(graph, before: list[bool], carry: list[bool], after: list[bool], size: int,
                       n_other_out: int):
    """batch_graph of a loop body whose carry follows `before` inputs: carries become batched
    until the body batches none that its input lacks."""
    while True:
        g, consts, out = batch_graph(graph, before + carry + after, size, carry + [False] * n_other_out)
        grown = [a or b for a, b in zip(carry, out[:len(carry)])]
        if grown == carry:
            return g, consts, out, carry
        carry = grown


def _at0(vals, dims, size, want=None):
    """Operands with their batch axis at 0 (those `want` marks broadcast when unbatched)."""
    want = want or [d is not None for d in dims]
    return [bdim_at(v, d, size, 0) if w else v for v, d, w in zip(vals, dims, want)]


def _scan_batch_rule(vals, dims, *, body, length, reverse, n_consts, n_carry):
    from tilefuse.ir import primitives as P
    n = _axis_size(vals, dims)
    nk, nc = n_consts, n_carry
    ny = len(body.outvars) - nc
    dk, dc, dx = dims[:nk], dims[nk:nk + nc], dims[nk + nc:]
    g, jc, out, bc = _carry_fixed_point(body, [d is not None for d in dk], [d is not None for d in dc],
                                        [d is not None for d in dx], n, ny)
    consts = _at0(vals[:nk], dk, n)
    init = _at0(vals[nk:nk + nc], dc, n, bc)
    xs = [bdim_at(v, d, n, 1) if d is not None else v for v, d in zip(vals[nk + nc:], dx)]  # axis 0 scans
    outs = bind(P.scan_p, *jc, *consts, *init, *xs, body=g, length=length, reverse=reverse,
                n_consts=len(jc) + nk, n_carry=nc)
    return outs, [0 if b else None for b in bc] + [1 if b else None for b in out[nc:]]


def _while_batch_rule(vals, dims, *, cond_graph, body_graph, cond_nconsts, body_nconsts):
    from tilefuse.ir import primitives as P
    from .staging import call_graph, trace_closed
    n = _axis_size(vals, dims)
    ncc, nb = cond_nconsts, body_nconsts
    dcc, dbc, dc = dims[:ncc], dims[ncc:ncc + nb], dims[ncc + nb:]
    bcc, bbc = [d is not None for d in dcc], [d is not None for d in dbc]
    _, _, _, bc = _carry_fixed_point(body_graph, bbc, [d is not None for d in dc], [], n, 0)
    _, _, pred_batched = batch_graph(cond_graph, bcc + bc, n, [False])
    if pred_batched[0]:  # lanes finish apart: every carry per lane, and a lane that is done stays
        bc = [True] * len(bc)
    cg, cjc, _ = batch_graph(cond_graph, bcc + bc, n, [False])
    bg, bjc, _, _ = _carry_fixed_point(body_graph, bbc, bc, [], n, 0)
    cc, bcs = _at0(vals[:ncc], dcc, n), _at0(vals[ncc:ncc + nb], dbc, n)
    init = _at0(vals[ncc + nb:], dc, n, bc)
    if not pred_batched[0]:
        outs = bind(P.while_p, *cjc, *cc, *bjc, *bcs, *init, cond_graph=cg, body_graph=bg,
                    cond_nconsts=len(cjc) + ncc, body_nconsts=len(bjc) + nb)
        return outs, [0 if b else None for b in bc]
    k = len(cc)
    avals = [get_aval(x) for x in (*cc, *bcs, *init)]

    def any_lane(*args):  # (cond consts, body consts, carry) -> some lane still runs
        p = call_graph(cg, *cjc, *args[:k], *args[k + nb:])[0]
        return [bind1(P.reduce_max, p, axes=(0,))], None

    def step(*args):  # every lane steps; a finished lane keeps its carry
        carry = args[k + nb:]
        p = call_graph(cg, *cjc, *args[:k], *carry)[0]
        new = call_graph(bg, *bjc, *args[k:k + nb], *carry)
        return [bind1(P.select, bind1(P.broadcast_in_dim, p, shape=_shape(c), broadcast_dimensions=(0,)), x, c)
                for x, c in zip(new, carry)], None
    cond2, c2, _ = trace_closed(any_lane, avals)
    body2, b2, _ = trace_closed(step, avals)
    outs = bind(P.while_p, *c2, *cc, *b2, *cc, *bcs, *init, cond_graph=_drop_body_consts(cond2, len(c2) + k, nb),
                body_graph=body2, cond_nconsts=len(c2) + k, body_nconsts=len(b2) + k + nb)
    return outs, [0] * len(init)


def _drop_body_consts(graph, start: int, count: int):
    """graph without inputs start..start+count (a cond that the body's constants were traced into
    but that does not read them)."""
    return graph.replace(invars=graph.invars[:start] + graph.invars[start + count:])


def _cond_batch_rule(vals, dims, *, branches):
    from tilefuse.ir import primitives as P
    from .staging import bind_cond, call_graph
    n = _axis_size(vals, dims)
    index, ops, di, dops = vals[0], vals[1:], dims[0], dims[1:]
    bops = [d is not None for d in dops]
    n_out = len(branches[0].outvars)
    ops = _at0(ops, dops, n)
    if di is None:  # one branch for all examples
        union = [False] * n_out
        for b in branches:
            union = [a or c for a, c in zip(union, batch_graph(b, bops, n, [False] * n_out)[2])]
        funs = []
        for b in branches:
            g, consts, _ = batch_graph(b, bops, n, union)
            funs.append(lambda *xs, g=g, consts=consts: call_graph(g, *consts, *xs))
        return bind_cond(index, funs, ops), [0 if u else None for u in union]
    # a predicate per example: every branch runs on every example and a select picks
    idx = moveaxis(index, di, 0)
    dt = get_aval(idx).dtype
    idx = bind1(P.min_, bind1(P.max_, idx, _full(0, dt, (n,))), _full(len(branches) - 1, dt, (n,)))
    results = []
    for b in branches:
        g, consts, _ = batch_graph(b, bops, n, [True] * n_out)
        results.append(call_graph(g, *consts, *ops))
    outs = results[0]
    for k in range(1, len(branches)):
        pick = bind1(P.eq, idx, _full(k, dt, (n,)))
        outs = [bind1(P.select, bind1(P.broadcast_in_dim, pick, shape=_shape(o), broadcast_dimensions=(0,)), r, o)
                for r, o in zip(results[k], outs)]
    return outs, [0] * n_out


def _clamped_start(start, n: int, k: int):
    dt = get_aval(start).dtype
    return bind1(P.min_, bind1(P.max_, start, np.asarray(0, dt)), np.asarray(n - k, dt))


def _window_indices(start, n: int, k: int):
    """The k indices of a window of an axis of size n starting at start (clamped to fit)."""
    s = _clamped_start(start, n, k)
    dt = get_aval(s).dtype
    return bind1(P.add, bind1(P.iota, dtype=dt, shape=(k,), dimension=0),
                 bind1(P.broadcast_in_dim, s, shape=(k,), broadcast_dimensions=()))


def dynamic_slice_by_gather(x, *starts, slice_sizes):
    """dynamic_slice written with gathers (one per axis): what vmap runs for per-example starts."""
    for axis, (s, k) in enumerate(zip(starts, slice_sizes)):
        x = bind1(P.gather, x, _window_indices(s, _shape(x)[axis], k), axis=axis)
    return x


def dynamic_update_slice_by_select(x, update, *starts):
    """dynamic_update_slice written with gathers and a select: what vmap runs for per-example
    starts. The update is gathered to x's shape (window position p reads update[p - start]) and
    selected inside the window."""
    shape, ushape = _shape(x), _shape(update)
    inside = None
    for axis, (s, n, k) in enumerate(zip(starts, shape, ushape)):
        s = _clamped_start(s, n, k)
        dt = get_aval(s).dtype
        pos = bind1(P.sub, bind1(P.iota, dtype=dt, shape=(n,), dimension=0),
                    bind1(P.broadcast_in_dim, s, shape=(n,), broadcast_dimensions=()))
        src = bind1(P.min_, bind1(P.max_, pos, _full(0, dt, (n,))), _full(max(k - 1, 0), dt, (n,)))
        update = bind1(P.gather, update, src, axis=axis)
        ok = bind1(P.and_, bind1(P.ge, pos, _full(0, dt, (n,))), bind1(P.lt, pos, _full(k, dt, (n,))))
        ok = bind1(P.broadcast_in_dim, ok, shape=shape, broadcast_dimensions=(axis,))
        inside = ok if inside is None else bind1(P.and_, inside, ok)
    return x if inside is None else bind1(P.select, inside, update, x)


def _dynamic_slice_batch_rule(vals, dims, *, slice_sizes):
    x, starts, dx = vals[0], vals[1:], dims[0]
    if all(d is None for d in dims[1:]):
        n = _shape(x)[dx]
        x = moveaxis(x, dx, 0)
        zero = np.zeros((), get_aval(starts[0]).dtype) if starts else np.int32(0)
        return [bind1(P.dynamic_slice, x, zero, *starts, slice_sizes=(n, *slice_sizes))], [0]
    return [vmap(lambda *a: dynamic_slice_by_gather(*a, slice_sizes=slice_sizes), in_axes=tuple(dims))(*vals)], [0]


def _dynamic_update_slice_batch_rule(vals, dims):
    (x, u), starts = vals[:2], vals[2:]
    if all(d is None for d in dims[2:]):
        n = _axis_size(vals, dims)
        x, u = bdim_at(x, dims[0], n, 0), bdim_at(u, dims[1], n, 0)
        zero = np.zeros((), get_aval(starts[0]).dtype) if starts else np.int32(0)
        return [bind1(P.dynamic_update_slice, x, u, zero, *starts)], [0]
    return [vmap(dynamic_update_slice_by_select, in_axes=tuple(dims))(*vals)], [0]


batch_rules.update({
    P.scan_p: _scan_batch_rule,
    P.while_p: _while_batch_rule,
    P.cond_p: _cond_batch_rule,
    P.dynamic_slice: _dynamic_slice_batch_rule,
    P.dynamic_update_slice: _dynamic_update_slice_batch_rule,
})
