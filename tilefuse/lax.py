"""tilefuse.lax: structured control flow (cond, switch, while_loop, fori_loop, scan, map) and the
lax operations users reach for beside it, with JAX's signatures and semantics.

A loop body or branch is traced once into a graph that the control-flow equation carries (printed,
type-checked and optimised with it); jit compiles each body once and the loop runs over device
buffers, so the graph's size and the compile time do not grow with the trip count. grad, jvp and
vmap transform them by rules (autodiff/control_flow.py, tracer/vmap.py). Carries and operands are
pytrees; a carry or branch whose types disagree is a ShapeError naming both sides and your line."""
from __future__ import annotations

import builtins
import enum
from typing import Any, Callable, Sequence

import numpy as np

from tilefuse import numpy as tnp
from tilefuse.autodiff import stop_gradient
from tilefuse.autodiff.api import _user_frames
from tilefuse.ir import dtypes
from tilefuse.ir import primitives as P
from tilefuse.ir.core import ShapedArray, dimension
from tilefuse.ir.symbolic import distinct
from tilefuse.ir.errors import ShapeError, TilefuseError, with_user_line
from tilefuse.tracer.core import Tracer, bind, bind1, get_aval, is_array_like
from tilefuse.tracer.pytree import tree_flatten, tree_unflatten
from tilefuse.tracer.staging import join_branch_consts, trace_closed

__all__ = ["Precision", "cond", "conv_general_dilated", "dynamic_index_in_dim", "dynamic_slice",
           "dynamic_slice_in_dim", "dynamic_update_index_in_dim", "dynamic_update_slice",
           "dynamic_update_slice_in_dim", "fori_loop", "map", "reduce_window", "scan", "select",
           "stop_gradient", "switch", "while_loop"]


# ---- tracing bodies -------------------------------------------------------------------------------

def _leaves(tree, what: str) -> tuple[list, Any, list[ShapedArray]]:
    """The array leaves of a pytree, its structure and the leaves' avals (without weak types; a
    Python scalar in a carry then takes the body's dtype: _promote_weak)."""
    leaves, td = tree_flatten(tree)
    out = []
    for i, x in enumerate(leaves):
        if not is_array_like(x):
            if isinstance(x, (list, tuple)) or hasattr(x, "__array__"):
                x = tnp.asarray(x)
            else:
                raise TilefuseError(with_user_line(
                    f"{what}: leaf {i} is a {type(x).__name__}, not an array"))
        out.append(x)
    return out, td, [get_aval(x).strip_weak() for x in out]


def _promote_weak(leaves, avals, out_avals):
    """As JAX does: a carry leaf given as a Python scalar (weak-typed) takes the dtype the body
    gives it (0.0 as the start of a float64 sum is a float64). (leaves, avals, changed)."""
    changed = False
    leaves, avals = list(leaves), list(avals)
    for i, (x, a, o) in enumerate(zip(leaves, avals, out_avals)):
        if get_aval(x).weak_type and a.shape == o.shape and a.dtype != o.dtype:
            d = dtypes.result_type((a.dtype, True), (o.dtype, False))[0]
            if d != a.dtype:
                leaves[i], avals[i], changed = tnp.astype(x, d), a.update(dtype=d), True
    return leaves, avals, changed


def _types(td, avals) -> str:
    return f"{td} with leaves ({', '.join(a.str_short() for a in avals)})" if avals else str(td)


def _trace(fun: Callable, in_tree, avals, what: str):
    """fun(*in_tree) traced over avals: (closed graph, constants, output structure). Outputs that
    are Python or numpy values become arrays of the graph."""
    def flat(*xs):
        out = fun(*tree_unflatten(in_tree, xs))
        leaves, td = tree_flatten(out)
        for i, o in enumerate(leaves):
            if not is_array_like(o):
                raise TilefuseError(with_user_line(
                    f"{what} returned a {type(o).__name__} (output leaf {i}); it must return arrays "
                    "or pytrees of arrays"))
        return [np.asarray(o, dtypes.python_scalar_dtype(o)) if isinstance(o, (bool, int, float)) else o
                for o in leaves], td
    graph, consts, out_tree = trace_closed(flat, avals)
    return graph, list(consts), out_tree


def _check_callable(where: str, **funs):
    for name, f in funs.items():
        if not callable(f):
            raise TypeError(f"{where}: {name} must be callable, got a {type(f).__name__}")


# ---- cond and switch ------------------------------------------------------------------------------

def _scalar_index(where: str, x, *, integer: bool):
    a = get_aval(x)
    if a.shape != ():
        raise ShapeError(with_user_line(f"{where}: the {'index' if integer else 'predicate'} must "
                                        f"be a scalar, got shape {a.shape}"))
    if integer and not dtypes.is_int(a.dtype):
        raise TypeError(f"{where}: the index must be an integer scalar, got {a.dtype}")
    if not integer and not (dtypes.is_bool(a.dtype) or dtypes.is_int(a.dtype) or dtypes.is_float(a.dtype)):
        raise TypeError(f"{where}: the predicate must be a bool or a number, got {a.dtype}")
    return a


def _branches(where: str, index, funs: Sequence[Callable], names: Sequence[str], operands):
    leaves, in_tree, avals = _leaves(tuple(operands), f"{where} operands")
    traced = [_trace(f, in_tree, avals, f"{where}: {n}") for f, n in zip(funs, names)]
    g0, _, t0 = traced[0]
    for (g, _, t), n in zip(traced[1:], names[1:]):
        if t != t0 or not P._same_types(g.out_avals, g0.out_avals):
            raise ShapeError(with_user_line(
                f"{where}: every branch must return the same structure and types, but {names[0]} "
                f"returns {_types(t0, g0.out_avals)} and {n} returns {_types(t, g.out_avals)}"))
    graphs, consts = join_branch_consts([(g, cs) for g, cs, _ in traced])
    outs = bind(P.cond_p, index, *consts, *leaves, branches=tuple(graphs))
    return tree_unflatten(t0, outs)


@_user_frames
def cond(pred, true_fun: Callable, false_fun: Callable, *operands):
    """true_fun(*operands) if pred else false_fun(*operands), with both branches traced (their
    outputs must agree in structure, shapes and dtypes) and only the chosen one run. Under vmap
    with a batched predicate both run and a select picks per example, as in JAX."""
    _check_callable("cond", true_fun=true_fun, false_fun=false_fun)
    a = _scalar_index("cond", pred, integer=False)
    if dtypes.is_bool(a.dtype):
        index = tnp.astype(pred, np.int32)
    else:  # a number: true where non-zero
        index = tnp.astype(tnp.not_equal(pred, 0), np.int32)
    return _branches("cond", index, (false_fun, true_fun), ("false_fun", "true_fun"), operands)


@_user_frames
def switch(index, branches: Sequence[Callable], *operands):
    """branches[clamp(index, 0, len(branches) - 1)](*operands) (JAX's lax.switch)."""
    branches = tuple(branches)
    if not branches:
        raise ValueError("switch: needs at least one branch")
    _check_callable("switch", **{f"branches[{i}]": b for i, b in enumerate(branches)})
    _scalar_index("switch", index, integer=True)
    index = tnp.astype(index, np.int32)
    if len(branches) == 1:
        return branches[0](*operands)
    index = tnp.clip(index, 0, len(branches) - 1)
    return _branches("switch", index, branches, [f"branches[{i}]" for i in range(len(branches))],
                     operands)


# ---- loops ------------------------------------------------------------------------------------------

def _check_carry(where: str, fun_name: str, in_tree, in_avals, out_tree, out_avals):
    if out_tree != in_tree or not P._same_types(out_avals, in_avals):
        raise ShapeError(with_user_line(
            f"{where}: {fun_name} must return a carry of the input carry's structure and types: the "
            f"input carry is {_types(in_tree, in_avals)} but {fun_name} returns "
            f"{_types(out_tree, out_avals)}"))


@_user_frames
def while_loop(cond_fun: Callable, body_fun: Callable, init_val):
    """val = init_val; while cond_fun(val): val = body_fun(val); return val. The trip count may
    depend on the data; reverse-mode differentiation needs a static one (use fori_loop or scan)."""
    _check_callable("while_loop", cond_fun=cond_fun, body_fun=body_fun)
    leaves, tree, avals = _leaves(init_val, "while_loop init_val")
    cg, cconsts, ctree = _trace(lambda *c: cond_fun(tree_unflatten(tree, c)),
                                tree_flatten(tuple(avals))[1], avals, "while_loop: cond_fun")
    out = cg.out_avals
    if len(out) != 1 or out[0].shape != () or not dtypes.is_bool(out[0].dtype):
        raise TypeError(with_user_line(
            f"while_loop: cond_fun must return a boolean scalar, got {_types(ctree, out)}"))
    for _ in range(2):  # again when a Python scalar in the carry took the body's dtype
        bg, bconsts, btree = _trace(lambda *c: body_fun(tree_unflatten(tree, c)),
                                    tree_flatten(tuple(avals))[1], avals, "while_loop: body_fun")
        leaves, avals, changed = _promote_weak(leaves, avals, bg.out_avals)
        if not changed:
            break
        cg, cconsts, _ = _trace(lambda *c: cond_fun(tree_unflatten(tree, c)),
                                tree_flatten(tuple(avals))[1], avals, "while_loop: cond_fun")
    _check_carry("while_loop", "body_fun", tree, avals, btree, bg.out_avals)
    outs = bind(P.while_p, *cconsts, *bconsts, *leaves, cond_graph=cg, body_graph=bg,
                cond_nconsts=len(cconsts), body_nconsts=len(bconsts))
    return tree_unflatten(tree, outs)


def _static_int(x):
    """x as a Python int when it is known now (a Python or numpy integer, or a concrete array)."""
    if isinstance(x, Tracer):
        return None
    if isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, (int, np.integer)):
        return int(x)
    if hasattr(x, "aval") and x.aval.shape == () and dtypes.is_int(x.aval.dtype):
        return int(np.asarray(x))
    return None


@_user_frames
def fori_loop(lower, upper, body_fun: Callable, init_val):
    """val = init_val; for i in range(lower, upper): val = body_fun(i, val); return val.

    With bounds known at trace time (Python ints) this is a scan of upper - lower steps, so
    reverse-mode differentiation works; with traced bounds it is a while_loop (as in JAX)."""
    _check_callable("fori_loop", body_fun=body_fun)
    lo, hi = _static_int(lower), _static_int(upper)
    for name, b in (("lower", lower), ("upper", upper)):
        a = get_aval(b) if is_array_like(b) else None
        if a is None or a.shape != () or not dtypes.is_int(a.dtype):
            raise TypeError(f"fori_loop: {name} must be an integer scalar, got {b!r:.60}")
    dt = tnp.result_type(lower, upper)
    if lo is not None and hi is not None:
        def step(carry, _):
            i, val = carry
            return (i + np.asarray(1, dt), body_fun(i, val)), None
        (_, val), _ = scan(step, (np.asarray(lo, dt), init_val), None, length=builtins.max(hi - lo, 0))
        return val

    def cond_fun(c):
        return c[0] < c[1]

    def body(c):
        i, hi_, val = c
        return i + np.asarray(1, dt), hi_, body_fun(i, val)
    return while_loop(cond_fun, body, (tnp.astype(lower, dt), tnp.astype(upper, dt), init_val))[2]


@_user_frames
def scan(f: Callable, init, xs=None, length: int | None = None, reverse: bool = False,
         unroll: int | bool = 1):
    """carry = init; for x in xs: carry, y = f(carry, x); return carry, stack(ys) (JAX's lax.scan).

    xs is a pytree of arrays sharing a leading axis (None with `length` to scan over nothing);
    reverse runs from the last element (ys keep xs's order). `unroll` is accepted for JAX
    compatibility; the body runs as one compiled step either way."""
    _check_callable("scan", f=f)
    del unroll
    init_leaves, ctree, cavals = _leaves(init, "scan init")
    x_leaves, xtree, xavals = _leaves(xs, "scan xs")
    lengths = [a.shape[0] for a in xavals if a.ndim]
    if any(a.ndim == 0 for a in xavals):
        raise ShapeError(with_user_line(f"scan: every leaf of xs needs a leading axis to scan over, got "
                                        f"{_types(xtree, xavals)}"))
    if length is not None:
        length = dimension(length)
        lengths.append(length)
    lengths = distinct(lengths)  # (a traced size stays symbolic)
    if len(lengths) > 1:
        raise ShapeError(with_user_line(f"scan: the leading axes of xs (and length) must agree, got "
                                        f"{sorted(lengths)} from {_types(xtree, xavals)}"
                                        + (f" and length={length}" if length is not None else "")))
    if not lengths:
        raise ValueError("scan: got no xs to scan over and no `length`; pass length=")
    n = lengths.pop()
    slices = [ShapedArray(a.shape[1:], a.dtype) for a in xavals]
    in_tree = tree_flatten((tuple(cavals), tuple(slices)))[1]
    store: dict = {}

    def body(carry, x):
        out = f(tree_unflatten(ctree, carry), tree_unflatten(xtree, x))
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TilefuseError(with_user_line(
                f"scan: f must return a pair (carry, y), got a {type(out).__name__}"))
        c_leaves, store["ctree"] = tree_flatten(out[0])
        y_leaves, store["ytree"] = tree_flatten(out[1])
        store["n_carry"] = len(c_leaves)
        return [*c_leaves, *y_leaves]

    for _ in range(2):  # again when a Python scalar in the carry took the body's dtype
        in_tree = tree_flatten((tuple(cavals), tuple(slices)))[1]
        g, consts, _ = _trace(lambda c, x: body(c, x), in_tree, [*cavals, *slices], "scan: f")
        init_leaves, cavals, changed = _promote_weak(init_leaves, cavals, g.out_avals[:store["n_carry"]])
        if not changed:
            break
    k = store["n_carry"]
    _check_carry("scan", "f", ctree, cavals, store["ctree"], g.out_avals[:k])
    outs = bind(P.scan_p, *consts, *init_leaves, *x_leaves, body=g, length=n, reverse=bool(reverse),
                n_consts=len(consts), n_carry=len(init_leaves))
    return tree_unflatten(ctree, outs[:k]), tree_unflatten(store["ytree"], outs[k:])


@_user_frames
def map(f: Callable, xs):
    """stack([f(x) for x in xs]) along the leading axis, as one scan (JAX's lax.map)."""
    _check_callable("map", f=f)
    return scan(lambda c, x: (c, f(x)), (), xs)[1]


# ---- the lax operations users reach for beside control flow ----------------------------------------

class Precision(enum.Enum):
    """JAX's precision of a contraction, accepted wherever JAX takes `precision=`. tilefuse computes
    float32 contractions in float32 and 16-bit ones in float32 with one rounding at the end on every
    device, which is HIGHEST; DEFAULT and HIGH give the same results (no TF32 or bf16 passes)."""
    DEFAULT = 0
    HIGH = 1
    HIGHEST = 2


def _starts(where: str, operand, start_indices, sizes, allow_negative_indices=True) -> list:
    """One int32 scalar start per axis; negative starts count from the end (JAX's default)."""
    nd = get_aval(operand).ndim
    if is_array_like(start_indices) and not isinstance(start_indices, (int, np.integer)):
        a = get_aval(start_indices)
        if a.ndim != 1:
            raise ShapeError(with_user_line(f"{where}: start_indices must be a sequence of scalars or a "
                                            f"1-d array, got shape {a.shape}"))
        start_indices = [start_indices[i] for i in range(a.shape[0])]
    starts = list(start_indices)
    if len(starts) != nd:
        raise ShapeError(with_user_line(f"{where}: needs one start index per axis of the operand of shape "
                                        f"{get_aval(operand).shape}, got {len(starts)}"))
    out = []
    for s, n in zip(starts, get_aval(operand).shape):
        a = get_aval(s)
        if a.shape != () or not dtypes.is_int(a.dtype):
            raise TypeError(f"{where}: start indices must be integer scalars, got {a.str_short()}")
        if isinstance(s, (int, np.integer)):
            out.append(np.int32(s + n if s < 0 and allow_negative_indices else s))
        else:
            s = tnp.astype(s, np.int32)
            out.append(tnp.where(s < 0, s + n, s) if allow_negative_indices else s)
    return out


@_user_frames
def dynamic_slice(operand, start_indices, slice_sizes, *, allow_negative_indices=True):
    """operand[s0:s0+k0, s1:s1+k1, ...] with traced starts and static sizes; starts are clamped so
    the slice fits (JAX's lax.dynamic_slice)."""
    operand = tnp.asarray(operand)
    sizes = tuple(int(k) for k in slice_sizes)
    starts = _starts("dynamic_slice", operand, start_indices, sizes, allow_negative_indices)
    return bind1(P.dynamic_slice, operand, *starts, slice_sizes=sizes)


@_user_frames
def dynamic_update_slice(operand, update, start_indices, *, allow_negative_indices=True):
    """operand with update written at the traced starts (clamped so it fits)."""
    operand = tnp.asarray(operand)
    update = tnp.astype(tnp.asarray(update), get_aval(operand).dtype)
    starts = _starts("dynamic_update_slice", operand, start_indices, get_aval(update).shape,
                     allow_negative_indices)
    return bind1(P.dynamic_update_slice, operand, update, *starts)


def _axis(where: str, operand, axis: int) -> int:
    nd = get_aval(operand).ndim
    if not -nd <= axis < nd:
        raise ShapeError(with_user_line(f"{where}: axis {axis} is out of range for {nd} axes"))
    return axis % nd


@_user_frames
def dynamic_slice_in_dim(operand, start_index, slice_size: int, axis: int = 0, *,
                         allow_negative_indices=True):
    operand = tnp.asarray(operand)
    axis = _axis("dynamic_slice_in_dim", operand, axis)
    shape = get_aval(operand).shape
    starts = [np.int32(0)] * len(shape)
    starts[axis] = start_index
    sizes = list(shape)
    sizes[axis] = slice_size
    return dynamic_slice(operand, starts, sizes, allow_negative_indices=allow_negative_indices)


@_user_frames
def dynamic_index_in_dim(operand, index, axis: int = 0, keepdims: bool = True, *,
                         allow_negative_indices=True):
    """operand[..., index, ...] along axis, with a traced index (keepdims keeps the axis, size 1)."""
    operand = tnp.asarray(operand)
    axis = _axis("dynamic_index_in_dim", operand, axis)
    out = dynamic_slice_in_dim(operand, index, 1, axis, allow_negative_indices=allow_negative_indices)
    return out if keepdims else tnp.squeeze(out, axis)


@_user_frames
def dynamic_update_slice_in_dim(operand, update, start_index, axis: int, *, allow_negative_indices=True):
    operand = tnp.asarray(operand)
    axis = _axis("dynamic_update_slice_in_dim", operand, axis)
    starts = [np.int32(0)] * get_aval(operand).ndim
    starts[axis] = start_index
    return dynamic_update_slice(operand, update, starts, allow_negative_indices=allow_negative_indices)


@_user_frames
def dynamic_update_index_in_dim(operand, update, index, axis: int, *, allow_negative_indices=True):
    operand = tnp.asarray(operand)
    axis = _axis("dynamic_update_index_in_dim", operand, axis)
    update = tnp.asarray(update)
    if get_aval(update).ndim == get_aval(operand).ndim - 1:
        update = tnp.expand_dims(update, axis)
    return dynamic_update_slice_in_dim(operand, update, index, axis,
                                       allow_negative_indices=allow_negative_indices)


@_user_frames
def select(pred, on_true, on_false):
    """on_true where pred else on_false, elementwise; pred is bool, a scalar or of the cases' shape,
    and the cases agree in shape and dtype (JAX's lax.select: no broadcasting, no promotion)."""
    pred, on_true, on_false = (tnp.asarray(x) for x in (pred, on_true, on_false))
    p, t, f = (get_aval(x) for x in (pred, on_true, on_false))
    if not dtypes.is_bool(p.dtype):
        raise TypeError(f"select: pred must be bool, got {p.dtype}")
    if t.shape != f.shape or t.dtype != f.dtype:
        raise ShapeError(with_user_line(f"select: on_true {t.str_short()} and on_false {f.str_short()} "
                                        "must have the same shape and dtype"))
    if p.shape not in ((), t.shape):
        raise ShapeError(with_user_line(f"select: pred of shape {p.shape} must be a scalar or of the "
                                        f"cases' shape {t.shape}"))
    return bind1(P.select, tnp.broadcast_to(pred, t.shape), on_true, on_false)


def _pairs(where: str, padding, n: int):
    if len(padding) != n or any(len(p) != 2 for p in padding):
        raise ShapeError(with_user_line(f"{where}: padding must be 'SAME', 'VALID' or {n} (low, high) "
                                        f"pairs, got {padding!r}"))
    return [(int(lo), int(hi)) for lo, hi in padding]


def padtype_to_pads(in_shape, window_shape, strides, padding: str):
    """(low, high) per axis for 'SAME', 'SAME_LOWER' or 'VALID' (XLA's rule: output ceil(in/stride))."""
    if padding.upper() == "VALID":
        return [(0, 0)] * len(in_shape)
    if padding.upper() not in ("SAME", "SAME_LOWER"):
        raise ValueError(f"padding must be 'SAME', 'SAME_LOWER', 'VALID' or pairs, got {padding!r}")
    pads = []
    for n, k, s in zip(in_shape, window_shape, strides):
        out = -(-n // s)
        total = builtins.max((out - 1) * s + k - n, 0)
        lo = total // 2 if padding.upper() == "SAME" else total - total // 2
        pads.append((lo, total - lo))
    return pads


def _pad(x, value, config):
    """lax.pad: (low, high, interior) per axis; negative low/high crop."""
    x = tnp.asarray(x)
    a = get_aval(x)
    grow = [(builtins.max(lo, 0), builtins.max(hi, 0), it) for lo, hi, it in config]
    if any(g != (0, 0, 0) for g in grow):
        x = bind1(P.pad, x, tnp.astype(value, a.dtype), padding_config=tuple(grow))
    if any(lo < 0 or hi < 0 for lo, hi, _ in config):
        shape = get_aval(x).shape
        x = x[tuple(slice(-builtins.min(lo, 0), n + builtins.min(hi, 0)) for (lo, hi, _), n in zip(config, shape))]
    return x


@_user_frames
def reduce_window(operand, init_value, computation: Callable, window_dimensions, window_strides,
                  padding, base_dilation=None, window_dilation=None):
    """Reduce each window of operand with the binary `computation` (lax.add, lax.max, ...),
    starting from init_value, which also fills the padding (JAX's lax.reduce_window). Written with
    pad, one strided slice per window element and the computation, so grad, jvp and vmap apply."""
    x = tnp.asarray(operand)
    shape = get_aval(x).shape
    nd = len(shape)
    wd, ws = tuple(window_dimensions), tuple(window_strides)
    bd = tuple(base_dilation or (1,) * nd)
    wdl = tuple(window_dilation or (1,) * nd)
    if not len(wd) == len(ws) == len(bd) == len(wdl) == nd:
        raise ShapeError(with_user_line(f"reduce_window: window_dimensions, window_strides and dilations "
                                        f"need one entry per axis of the operand of shape {shape}"))
    dilated = [(n - 1) * b + 1 if n else 0 for n, b in zip(shape, bd)]
    eff = [(k - 1) * d + 1 for k, d in zip(wd, wdl)]
    pads = padtype_to_pads(dilated, eff, ws, padding) if isinstance(padding, str) else \
        _pairs("reduce_window", padding, nd)
    x = _pad(x, init_value, [(lo, hi, b - 1) for (lo, hi), b in zip(pads, bd)])
    padded = get_aval(x).shape
    out = [(p - e) // s + 1 if p >= e else 0 for p, e, s in zip(padded, eff, ws)]
    acc = tnp.full(out, tnp.astype(init_value, get_aval(x).dtype), get_aval(x).dtype)
    for tap in np.ndindex(*wd):
        start = [t * d for t, d in zip(tap, wdl)]
        window = x[tuple(slice(s0, s0 + (o - 1) * s + 1, s) for s0, o, s in zip(start, out, ws))]
        acc = computation(acc, window)
    return acc


def _conv_specs(dimension_numbers, nd: int):
    """(lhs, rhs, out) as axis tuples (batch/out-feature, feature/in-feature, spatial...)."""
    if dimension_numbers is None:
        spec = tuple(range(nd))
        return spec, spec, spec
    lhs, rhs, out = dimension_numbers
    if isinstance(lhs, str):
        if not (len(lhs) == len(rhs) == len(out) == nd):
            raise ShapeError(with_user_line(f"conv_general_dilated: dimension_numbers {dimension_numbers!r} "
                                            f"must name all {nd} axes of each operand"))
        spatial = [c for c in rhs if c not in "OI"]  # the rhs spec orders the spatial axes
        return ((lhs.index("N"), lhs.index("C"), *(lhs.index(c) for c in spatial)),
                (rhs.index("O"), rhs.index("I"), *(rhs.index(c) for c in spatial)),
                (out.index("N"), out.index("C"), *(out.index(c) for c in spatial)))
    return tuple(lhs), tuple(rhs), tuple(out)


@_user_frames
def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count: int = 1, batch_group_count: int = 1,
                         precision=None, preferred_element_type=None):
    """JAX's general convolution over any number of spatial axes: any layout (dimension_numbers as
    strings like ('NHWC', 'HWIO', 'NHWC') or axis tuples), read where it lies; strides, padding
    ('SAME', 'VALID' or pairs, negative ones crop), lhs dilation (a transposed convolution), rhs
    dilation, feature and batch groups. One conv primitive, run as an implicit GEMM.
    precision is accepted (Precision)."""
    del precision
    dtype = tnp.result_type(lhs, rhs)
    lhs, rhs = tnp.astype(tnp.asarray(lhs), dtype), tnp.astype(tnp.asarray(rhs), dtype)
    nd = get_aval(lhs).ndim
    if get_aval(rhs).ndim != nd or nd < 3:
        raise ShapeError(with_user_line(
            f"conv_general_dilated: lhs and rhs need one rank of at least 3 (batch, feature, spatial...), "
            f"got lhs {get_aval(lhs).shape} and rhs {get_aval(rhs).shape}"))
    ls, rs, os_ = _conv_specs(dimension_numbers, nd)
    n_sp = nd - 2
    strides = tuple(int(s) for s in window_strides)
    ld = tuple(int(d) for d in (lhs_dilation or (1,) * n_sp))
    rd = tuple(int(d) for d in (rhs_dilation or (1,) * n_sp))
    if not len(strides) == len(ld) == len(rd) == n_sp:
        raise ShapeError(with_user_line(f"conv_general_dilated: window_strides and dilations need {n_sp} "
                                        "entries (one per spatial axis)"))
    in_sp = [get_aval(lhs).shape[a] for a in ls[2:]]
    k_sp = [get_aval(rhs).shape[a] for a in rs[2:]]
    dilated = [(n - 1) * d + 1 if n else 0 for n, d in zip(in_sp, ld)]
    eff = [(k - 1) * d + 1 for k, d in zip(k_sp, rd)]
    pads = padtype_to_pads(dilated, eff, strides, padding) if isinstance(padding, str) else \
        _pairs("conv_general_dilated", padding, n_sp)
    y = bind1(P.conv, lhs, rhs, window_strides=strides, padding=tuple((int(lo), int(hi)) for lo, hi in pads),
              lhs_dilation=ld, rhs_dilation=rd, dimension_numbers=(tuple(ls), tuple(rs), tuple(os_)),
              feature_group_count=int(feature_group_count), batch_group_count=int(batch_group_count))
    return y if preferred_element_type is None else tnp.astype(y, preferred_element_type)


# elementwise names that JAX code passes to reduce_window and friends
add, sub, mul, div = tnp.add, tnp.subtract, tnp.multiply, tnp.divide
max, min = tnp.maximum, tnp.minimum  # noqa: A001 (lax's names)
neg, exp, log, tanh, logistic = tnp.negative, tnp.exp, tnp.log, tnp.tanh, tnp.sigmoid
sin, cos, sqrt, rsqrt, abs, sign = tnp.sin, tnp.cos, tnp.sqrt, tnp.rsqrt, tnp.abs, tnp.sign  # noqa: A001
pow = tnp.power  # noqa: A001
