"""The ATen op table: each core ATen overload that AOTAutograd leaves in a graph, written with
tilefuse.numpy, tilefuse.nn and tilefuse's primitives.

A rule takes the node's arguments in ATen's schema order (tensors are tilefuse values, the rest
Python values) and returns a value or a tuple of them. The compiler checks each result's shape
against the shape PyTorch recorded for the node and casts it to PyTorch's dtype, so a rule only
has to get the values right. The neural-network ops are in aten_nn.py. An op missing from the
table is an UnsupportedOpError naming it, before anything runs."""
from __future__ import annotations

import math
import operator

import numpy as np
import torch

import tilefuse.numpy as tnp
from tilefuse import nn
from tilefuse import random as txr
from tilefuse.ir import primitives as P
from tilefuse.ir.errors import TilefuseError
from tilefuse.tracer.core import bind1

from .convert import numpy_dtype, torch_dtype

aten = torch.ops.aten
OPS: dict = {}        # OpOverload (or a Python operator) -> rule
BY_NAME: dict = {}    # rules for ops registered only when another module loads ("prims.fma.default")
RANDOM: set = set()   # the rules that draw random numbers: they take a `key=` keyword


def rule_for(target):
    """The rule for an FX node's target, or None."""
    found = OPS.get(target)
    if found is None and isinstance(target, torch._ops.OpOverload):
        found = BY_NAME.get(str(target))
    return found


class UnsupportedOpError(TilefuseError, NotImplementedError):
    """A graph holds an ATen op (or a form of one) the tilefuse backend has no rule for."""


def rule(*targets, random: bool = False):
    def register(fn):
        for t in targets:
            OPS[t] = fn
            if random:
                RANDOM.add(t)
        return fn
    return register


def unsupported(op: str, why: str):
    raise UnsupportedOpError(f"tilefuse.torch: {op} {why}")


# ---- dtypes: PyTorch's promotion, exactly -----------------------------------------------------

def _is_value(x) -> bool:
    return not isinstance(x, (bool, int, float))


def _dummy(x):
    """A tensor (or Python scalar) standing in for x in torch's promotion rules."""
    if not _is_value(x):
        return x
    return torch.empty((1,) * min(tnp.ndim(x), 1), dtype=torch_dtype(tnp.result_type(x)))


def torch_result_dtype(*xs) -> np.dtype:
    """The dtype PyTorch computes an elementwise op of xs in (0-d tensors and Python scalars
    count only by category, as in torch.result_type)."""
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
    _, out = elementwise_dtypes(*[_dummy(x) for x in xs],
                                type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
    return numpy_dtype(out)


def _cast(x, dtype):
    return tnp.astype(x, dtype) if _is_value(x) and tnp.result_type(x) != dtype else x


def _promoted(*xs):
    dt = torch_result_dtype(*xs)
    return [_cast(x, dt) for x in xs]


def _is_int(x) -> bool:
    return np.dtype(tnp.result_type(x)).kind in "iub"


def _float(x):
    return tnp.astype(x, np.float32) if _is_int(x) else x


# ---- elementwise ------------------------------------------------------------------------------

def _unary(fn, to_float=True):
    return lambda x: fn(_float(x) if to_float else x)


for _op, _fn, _to_float in [
        (aten.abs.default, tnp.abs, False), (aten.neg.default, tnp.negative, False),
        (aten.exp.default, tnp.exp, True), (aten.log.default, tnp.log, True),
        (aten.log1p.default, tnp.log1p, True), (aten.expm1.default, tnp.expm1, True),
        (aten.sqrt.default, tnp.sqrt, True), (aten.rsqrt.default, tnp.rsqrt, True),
        (aten.tanh.default, tnp.tanh, True), (aten.sigmoid.default, tnp.sigmoid, True),
        (aten.sin.default, tnp.sin, True), (aten.cos.default, tnp.cos, True),
        (aten.tan.default, tnp.tan, True), (aten.sinh.default, tnp.sinh, True),
        (aten.cosh.default, tnp.cosh, True), (aten.erf.default, tnp.erf, True),
        (aten.exp2.default, tnp.exp2, True), (aten.log2.default, tnp.log2, True),
        (aten.log10.default, tnp.log10, True), (aten.reciprocal.default, tnp.reciprocal, True),
        (aten.floor.default, tnp.floor, False), (aten.ceil.default, tnp.ceil, False),
        (aten.round.default, tnp.rint, False), (aten.sign.default, tnp.sign, False),
        (aten.isnan.default, tnp.isnan, False), (aten.isinf.default, tnp.isinf, False),
        (aten.logical_not.default, tnp.logical_not, False)]:
    OPS[_op] = _unary(_fn, _to_float)


@rule(aten.trunc.default)
def _trunc(x):
    return x if _is_int(x) else tnp.sign(x) * tnp.floor(tnp.abs(x))


@rule(aten.bitwise_not.default)
def _bitwise_not(x):
    return tnp.logical_not(x) if tnp.result_type(x) == np.bool_ else tnp.invert(x)


@rule(aten.relu.default)
def _relu(x):
    return tnp.maximum(x, 0)


@rule(aten.gelu.default)
def _gelu(x, approximate="none"):
    if approximate == "tanh":
        return nn.gelu(x, approximate=True)
    return x * (0.5 * (1.0 + tnp.erf(x * (1.0 / math.sqrt(2.0)))))


@rule(aten.hardtanh.default)
def _hardtanh(x, min_val=-1.0, max_val=1.0):
    return tnp.clip(x, min_val, max_val)


@rule(aten.elu.default)
def _elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    return tnp.where(x > 0, x * scale, tnp.expm1(x * input_scale) * (alpha * scale))


@rule(aten.leaky_relu.default)
def _leaky_relu(x, negative_slope=0.01):
    return tnp.where(x > 0, x, x * negative_slope)


def _binary(fn, to_float=False):
    def f(a, b):
        a, b = _promoted(a, b)
        if to_float:
            a, b = _float(a), _float(b)
        return fn(a, b)
    return f


for _ops, _fn, _to_float in [
        ((aten.mul.Tensor, aten.mul.Scalar), tnp.multiply, False),
        ((aten.div.Tensor, aten.div.Scalar), tnp.divide, True),
        ((aten.maximum.default,), tnp.maximum, False), ((aten.minimum.default,), tnp.minimum, False),
        ((aten.pow.Tensor_Tensor,), tnp.power, False),
        ((aten.fmod.Tensor, aten.fmod.Scalar), tnp.fmod, False),
        ((aten.remainder.Tensor, aten.remainder.Scalar), tnp.remainder, False),
        ((aten.bitwise_and.Tensor, aten.bitwise_and.Scalar), tnp.bitwise_and, False),
        ((aten.bitwise_or.Tensor, aten.bitwise_or.Scalar), tnp.bitwise_or, False),
        ((aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar), tnp.bitwise_xor, False)]:
    for _op in _ops:
        OPS[_op] = _binary(_fn, _to_float)


def _compare(fn):
    return lambda a, b: fn(*_promoted(a, b))


for _name, _fn in [("eq", tnp.equal), ("ne", tnp.not_equal), ("lt", tnp.less),
                   ("le", tnp.less_equal), ("gt", tnp.greater), ("ge", tnp.greater_equal)]:
    OPS[getattr(aten, _name).Tensor] = OPS[getattr(aten, _name).Scalar] = _compare(_fn)

for _name, _fn in [("logical_and", tnp.logical_and), ("logical_or", tnp.logical_or),
                   ("logical_xor", tnp.logical_xor)]:
    OPS[getattr(aten, _name).default] = lambda a, b, _fn=_fn: _fn(tnp.astype(a, bool), tnp.astype(b, bool))


@rule(aten.add.Tensor, aten.add.Scalar)
def _add(a, b, alpha=1):
    a, b = _promoted(a, b)
    return a + (b if alpha == 1 else b * alpha)


@rule(aten.sub.Tensor, aten.sub.Scalar)
def _sub(a, b, alpha=1):
    a, b = _promoted(a, b)
    return a - (b if alpha == 1 else b * alpha)


@rule(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(a, b, alpha=1):
    return _sub(b, a, alpha=alpha)


@rule(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(a, b, rounding_mode=None):
    a, b = _promoted(a, b)
    if rounding_mode is None:
        return tnp.divide(_float(a), _float(b))
    if rounding_mode == "floor":
        return tnp.floor_divide(a, b)
    q = tnp.divide(_float(a), _float(b))
    return tnp.astype(_trunc(q), tnp.result_type(a))


@rule(aten.pow.Tensor_Scalar)
def _pow_scalar(x, e):
    if isinstance(e, int) and not isinstance(e, bool) and 0 <= e <= 8:
        return tnp.integer_pow(x, e)
    return tnp.power(*_promoted(x, e))


@rule(aten.pow.Scalar)
def _pow_base(b, x):
    return tnp.power(*_promoted(b, x))


def _fma(a, b, c):
    a, b, c = _promoted(a, b, c)
    return a * b + c


BY_NAME["prims.fma.default"] = _fma  # Inductor's prim, in decompositions of addcmul (optimizers)


@rule(aten.where.self)
def _where(c, a, b):
    a, b = _promoted(a, b)
    return tnp.where(c, a, b)


@rule(aten.clamp.default, aten.clamp.Tensor)
def _clamp(x, min=None, max=None):
    if min is not None:
        x, m = _promoted(x, min)
        x = tnp.maximum(x, m)
    if max is not None:
        x, m = _promoted(x, max)
        x = tnp.minimum(x, m)
    return x


OPS[aten.clamp_min.default] = OPS[aten.clamp_min.Tensor] = lambda x, m: _clamp(x, min=m)
OPS[aten.clamp_max.default] = OPS[aten.clamp_max.Tensor] = lambda x, m: _clamp(x, max=m)


# ---- reductions -------------------------------------------------------------------------------

def _dims(x, dim):
    """ATen's dim argument as numpy's axis: None or an empty list means every axis."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return None
    return tuple(dim) if isinstance(dim, (list, tuple)) else dim


def _acc(x, dtype):
    if dtype is not None:
        return tnp.astype(x, numpy_dtype(dtype))
    return tnp.astype(x, np.int64) if _is_int(x) else x  # torch sums integers (bools too) in int64


@rule(aten.sum.dim_IntList)
def _sum(x, dim=None, keepdim=False, dtype=None):
    return tnp.sum(_acc(x, dtype), axis=_dims(x, dim), keepdims=keepdim)


@rule(aten.sum.default)
def _sum_all(x, dtype=None):
    return tnp.sum(_acc(x, dtype))


@rule(aten.mean.dim)
def _mean(x, dim=None, keepdim=False, dtype=None):
    x = tnp.astype(x, numpy_dtype(dtype)) if dtype is not None else x
    return tnp.mean(x, axis=_dims(x, dim), keepdims=keepdim)


@rule(aten.mean.default)
def _mean_all(x, dtype=None):
    return _mean(x, None, False, dtype)


@rule(aten.prod.default)
def _prod_all(x, dtype=None):
    return tnp.prod(_acc(x, dtype))


@rule(aten.prod.dim_int)
def _prod(x, dim, keepdim=False, dtype=None):
    return tnp.prod(_acc(x, dtype), axis=dim, keepdims=keepdim)


@rule(aten.amax.default)
def _amax(x, dim=(), keepdim=False):
    return tnp.max(x, axis=_dims(x, dim), keepdims=keepdim)


@rule(aten.amin.default)
def _amin(x, dim=(), keepdim=False):
    return tnp.min(x, axis=_dims(x, dim), keepdims=keepdim)


@rule(aten.max.default)
def _max_all(x):
    return tnp.max(x)


@rule(aten.min.default)
def _min_all(x):
    return tnp.min(x)


@rule(aten.max.dim)
def _max_dim(x, dim, keepdim=False):
    return tnp.max(x, axis=dim, keepdims=keepdim), tnp.argmax(x, axis=dim, keepdims=keepdim)


@rule(aten.min.dim)
def _min_dim(x, dim, keepdim=False):
    return tnp.min(x, axis=dim, keepdims=keepdim), tnp.argmin(x, axis=dim, keepdims=keepdim)


@rule(aten.argmax.default)
def _argmax(x, dim=None, keepdim=False):
    if dim is None:
        return tnp.argmax(tnp.reshape(x, (-1,)), keepdims=False) if not keepdim else \
            tnp.reshape(tnp.argmax(tnp.reshape(x, (-1,))), (1,) * tnp.ndim(x))
    return tnp.argmax(x, axis=dim, keepdims=keepdim)


@rule(aten.argmin.default)
def _argmin(x, dim=None, keepdim=False):
    if dim is None:
        return tnp.argmin(tnp.reshape(x, (-1,))) if not keepdim else \
            tnp.reshape(tnp.argmin(tnp.reshape(x, (-1,))), (1,) * tnp.ndim(x))
    return tnp.argmin(x, axis=dim, keepdims=keepdim)


@rule(aten.any.default, aten.any.dim, aten.any.dims)
def _any(x, dim=None, keepdim=False):
    return tnp.any(tnp.astype(x, bool), axis=_dims(x, dim), keepdims=keepdim)


@rule(aten.all.default, aten.all.dim, aten.all.dims)
def _all(x, dim=None, keepdim=False):
    return tnp.all(tnp.astype(x, bool), axis=_dims(x, dim), keepdims=keepdim)


@rule(aten.var.correction)
def _var(x, dim=None, *, correction=None, keepdim=False):
    ddof = 1 if correction is None else correction
    return tnp.var(x, axis=_dims(x, dim), ddof=ddof, keepdims=keepdim)


@rule(aten.var_mean.correction)
def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    return _var(x, dim, correction=correction, keepdim=keepdim), \
        tnp.mean(x, axis=_dims(x, dim), keepdims=keepdim)


@rule(aten.cumprod.default)
def _cumprod(x, dim, dtype=None):
    return tnp.cumprod(_acc(x, dtype), axis=dim)


@rule(aten.cumsum.default)
def _cumsum(x, dim, dtype=None):
    return tnp.cumsum(_acc(x, dtype), axis=dim)


# ---- shapes and views (values here: a view is a new value) -----------------------------------

def _axis(dim, ndim):
    return dim + ndim if dim < 0 else dim


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default)
def _view(x, shape):
    return tnp.reshape(x, tuple(shape))


@rule(aten.permute.default, aten.permute_copy.default)
def _permute(x, dims):
    return tnp.transpose(x, tuple(_axis(d, tnp.ndim(x)) for d in dims))


@rule(aten.expand.default, aten.expand_copy.default)
def _expand(x, size, implicit=False):
    shape = tnp.shape(x)
    lead = len(size) - len(shape)
    want = tuple(shape[i - lead] if s == -1 else s for i, s in enumerate(size))
    return tnp.broadcast_to(x, want)


@rule(aten.unsqueeze.default, aten.unsqueeze_copy.default)
def _unsqueeze(x, dim):
    return tnp.expand_dims(x, _axis(dim, tnp.ndim(x) + 1))


@rule(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze_copy.dims)
def _squeeze(x, dim=None):
    shape = tnp.shape(x)
    if dim is None:
        dims = range(len(shape))
    else:
        dims = [dim] if isinstance(dim, int) else dim
    drop = {_axis(d, len(shape)) for d in dims} if shape else set()
    return tnp.reshape(x, tuple(n for i, n in enumerate(shape) if not (i in drop and n == 1)))


@rule(aten.cat.default)
def _cat(tensors, dim=0):
    tensors = [t for t in tensors if not (tnp.ndim(t) == 1 and tnp.shape(t)[0] == 0)] or tensors[:1]
    dt = torch_result_dtype(*tensors) if len(tensors) > 1 else tnp.result_type(tensors[0])
    return tnp.concatenate([_cast(t, dt) for t in tensors], axis=dim)


def _split_at(x, sizes, dim):
    dim = _axis(dim, tnp.ndim(x))
    out, start = [], 0
    for s in sizes:
        out.append(_slice(x, dim, start, start + s))
        start += s
    return tuple(out)


@rule(aten.split_with_sizes.default, aten.split_with_sizes_copy.default)
def _split_with_sizes(x, split_sizes, dim=0):
    return _split_at(x, split_sizes, dim)


@rule(aten.split.Tensor)
def _split(x, split_size, dim=0):
    n = tnp.shape(x)[_axis(dim, tnp.ndim(x))]
    sizes = [min(split_size, n - s) for s in range(0, n, split_size)] or [0]
    return _split_at(x, sizes, dim)


@rule(aten.unbind.int)
def _unbind(x, dim=0):
    dim = _axis(dim, tnp.ndim(x))
    return tuple(_select(x, dim, i) for i in range(tnp.shape(x)[dim]))


@rule(aten.slice.Tensor, aten.slice_copy.Tensor)
def _slice(x, dim=0, start=None, end=None, step=1):
    dim = _axis(dim, tnp.ndim(x))
    n = tnp.shape(x)[dim]
    start, end, _ = slice(start, end, step).indices(n)
    idx = [slice(None)] * tnp.ndim(x)
    idx[dim] = slice(start, max(start, end), step)
    return x[tuple(idx)]


@rule(aten.select.int, aten.select_copy.int)
def _select(x, dim, index):
    dim = _axis(dim, tnp.ndim(x))
    idx = [slice(None)] * tnp.ndim(x)
    idx[dim] = index
    return x[tuple(idx)]


@rule(aten.narrow.default)
def _narrow(x, dim, start, length):
    return _slice(x, dim, start, start + length)


@rule(aten.flip.default)
def _flip(x, dims):
    return tnp.flip(x, axis=tuple(dims))


@rule(aten.roll.default)
def _roll(x, shifts, dims=()):
    if not dims:
        return tnp.reshape(tnp.roll(tnp.reshape(x, (-1,)), shifts[0]), tnp.shape(x))
    for s, d in zip(shifts, dims):
        x = tnp.roll(x, s, axis=d)
    return x


@rule(aten.repeat.default)
def _repeat(x, repeats):
    lead = len(repeats) - tnp.ndim(x)
    x = tnp.reshape(x, (1,) * lead + tnp.shape(x))
    return tnp.tile(x, tuple(repeats))


@rule(aten.constant_pad_nd.default)
def _constant_pad_nd(x, pad, value=0):
    nd = tnp.ndim(x)
    widths = [(0, 0)] * nd
    for i in range(len(pad) // 2):
        widths[nd - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    crop = [slice(-lo if lo < 0 else None, hi if hi < 0 else None) for lo, hi in widths]
    if any(lo < 0 or hi < 0 for lo, hi in widths):
        x = x[tuple(crop)]
    widths = [(max(lo, 0), max(hi, 0)) for lo, hi in widths]
    return tnp.pad(x, widths, constant_values=value) if any(lo or hi for lo, hi in widths) else x


@rule(aten.alias.default, aten.clone.default, aten.lift_fresh_copy.default, aten.detach.default,
      aten.alias_copy.default, aten.contiguous.default)
def _identity(x, **_):
    return x


@rule(aten._to_copy.default)
def _to_copy(x, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    return tnp.astype(x, numpy_dtype(dtype)) if dtype is not None else x


@rule(aten.copy.default)
def _copy(dst, src, non_blocking=False):
    return tnp.broadcast_to(tnp.astype(src, tnp.result_type(dst)), tnp.shape(dst))


@rule(aten.tril.default)
def _tril(x, diagonal=0):
    return tnp.tril(x, diagonal)


@rule(aten.triu.default)
def _triu(x, diagonal=0):
    return tnp.triu(x, diagonal)


# ---- indexing ---------------------------------------------------------------------------------

@rule(aten.index.Tensor)
def _index(x, indices):
    for i in indices:
        if i is not None and tnp.result_type(i) == np.bool_:
            unsupported("aten.index.Tensor", "with a boolean mask has a data-dependent shape; "
                        "use torch.where(mask, x, 0) to keep the shape")
    idx = tuple(slice(None) if i is None else i for i in indices)
    return x[idx]


def _index_update(x, idx, values, accumulate: bool):
    """x with values written (or, accumulating, added) at x[idx], idx any numpy-style index with
    index arrays: scatter-adds on the flat positions the index selects. Repeated positions of a
    write get the mean of their values (PyTorch leaves which one wins undefined)."""
    dt, shape, n = tnp.result_type(x), tnp.shape(x), tnp.size(x)
    pos = tnp.reshape(tnp.arange(n, dtype=np.int32), shape)[idx]
    upd = tnp.reshape(tnp.broadcast_to(_cast(values, dt), tnp.shape(pos)), (-1,))
    pos = tnp.reshape(pos, (-1,))
    flat = tnp.reshape(x, (-1,))
    acc = np.dtype(np.int32) if dt == np.bool_ else dt  # scatter-add adds numbers
    if accumulate:
        out = bind1(P.scatter_add, _cast(flat, acc), pos, _cast(upd, acc), axis=0)
        return tnp.reshape(out if acc == dt else tnp.astype(out, dt), shape)
    hits = bind1(P.scatter_add, tnp.zeros((n,), np.int32), pos, tnp.ones(tnp.shape(pos), np.int32), axis=0)
    total = bind1(P.scatter_add, tnp.zeros((n,), acc), pos, _cast(upd, acc), axis=0)
    if dt == np.bool_:
        new = total > 0
    else:
        count = tnp.astype(tnp.maximum(hits, 1), acc)
        new = tnp.floor_divide(total, count) if _is_int(total) else total / count
    return tnp.reshape(tnp.where(hits > 0, new, flat), shape)


def _grid_index(index, dim):
    """Full index arrays for scatter/gather along `dim`: `index` itself at dim, the position
    along every other axis elsewhere."""
    shape = tnp.shape(index)
    return tuple(index if k == dim else
                 tnp.broadcast_to(tnp.reshape(tnp.arange(n, dtype=np.int32),
                                              tuple(n if j == k else 1 for j in range(len(shape)))), shape)
                 for k, n in enumerate(shape))


@rule(aten.gather.default)
def _gather(x, dim, index, sparse_grad=False):
    dim = _axis(dim, tnp.ndim(x))
    if tnp.ndim(x) == 0:
        return x
    return x[_grid_index(index, dim)]


@rule(aten.scatter.value, aten.scatter.src)
def _scatter(x, dim, index, src):
    dim = _axis(dim, tnp.ndim(x))
    if _is_value(src) and tnp.shape(src) != tnp.shape(index):
        src = src[tuple(slice(0, n) for n in tnp.shape(index))]
    return _index_update(x, _grid_index(index, dim), src, False)


@rule(aten.scatter_add.default)
def _scatter_add(x, dim, index, src):
    dim = _axis(dim, tnp.ndim(x))
    if tnp.shape(src) != tnp.shape(index):
        src = src[tuple(slice(0, n) for n in tnp.shape(index))]
    return _index_update(x, _grid_index(index, dim), src, True)


@rule(aten.index_put.default)
def _index_put(x, indices, values, accumulate=False):
    idx = tuple(slice(None) if i is None else i for i in indices)
    return _index_update(x, idx, values, accumulate)


@rule(aten.index_select.default)
def _index_select(x, dim, index):
    return tnp.take(x, index, axis=dim)


@rule(aten.embedding.default)
def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return tnp.take(weight, indices, axis=0)


# ---- creation ---------------------------------------------------------------------------------

def _creation_dtype(dtype, value=None):
    if dtype is not None:
        return numpy_dtype(dtype)
    if isinstance(value, bool):
        return np.dtype(np.bool_)
    if isinstance(value, int):
        return np.dtype(np.int64)
    return np.dtype(np.float32)


@rule(aten.full.default)
def _full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return tnp.full(tuple(size), fill_value, dtype=_creation_dtype(dtype, fill_value))


@rule(aten.full_like.default)
def _full_like(x, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None,
               memory_format=None):
    return tnp.full(tnp.shape(x), fill_value,
                    dtype=numpy_dtype(dtype) if dtype is not None else tnp.result_type(x))


@rule(aten.zeros_like.default, aten.empty_like.default)
def _zeros_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _full_like(x, 0, dtype=dtype)


@rule(aten.ones_like.default)
def _ones_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _full_like(x, 1, dtype=dtype)


@rule(aten.zeros.default, aten.empty.memory_format)
def _zeros(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return tnp.zeros(tuple(size), dtype=_creation_dtype(dtype))  # empty: any value will do


@rule(aten.empty_strided.default)
def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _zeros(size, dtype=dtype)


@rule(aten.ones.default)
def _ones(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return tnp.ones(tuple(size), dtype=_creation_dtype(dtype))


@rule(aten.scalar_tensor.default)
def _scalar_tensor(value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return tnp.full((), value, dtype=numpy_dtype(dtype) if dtype is not None else np.float32)


@rule(aten.arange.start_step, aten.arange.start, aten.arange.default)
def _arange(start, end=None, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    if end is None:
        start, end = 0, start
    ints = all(isinstance(v, int) for v in (start, end, step))
    dt = numpy_dtype(dtype) if dtype is not None else np.dtype(np.int64 if ints else np.float32)
    return tnp.arange(start, end, step, dtype=dt)


# ---- random (a key per call: the compiler passes one drawn from torch's generator) -----------

@rule(aten.native_dropout.default, random=True)
def _native_dropout(x, p, train, *, key):
    if not train or p == 0:
        return x, tnp.ones(tnp.shape(x), dtype=bool)
    if p >= 1:
        return tnp.zeros_like(x), tnp.zeros(tnp.shape(x), dtype=bool)
    keep = txr.bernoulli(key, 1.0 - p, tnp.shape(x))
    return tnp.where(keep, x * (1.0 / (1.0 - p)), 0), keep


@rule(aten.rand_like.default, random=True)
def _rand_like(x, *, key, dtype=None, **_):
    return txr.uniform(key, tnp.shape(x), dtype=numpy_dtype(dtype) if dtype else tnp.result_type(x))


@rule(aten.randn_like.default, random=True)
def _randn_like(x, *, key, dtype=None, **_):
    return txr.normal(key, tnp.shape(x), dtype=numpy_dtype(dtype) if dtype else tnp.result_type(x))


@rule(aten.rand.default, random=True)
def _rand(size, *, key, dtype=None, **_):
    return txr.uniform(key, tuple(size), dtype=_creation_dtype(dtype))


@rule(aten.randn.default, random=True)
def _randn(size, *, key, dtype=None, **_):
    return txr.normal(key, tuple(size), dtype=_creation_dtype(dtype))


@rule(aten.bernoulli.p, random=True)
def _bernoulli(x, p=0.5, *, key, generator=None):
    return tnp.astype(txr.bernoulli(key, p, tnp.shape(x)), tnp.result_type(x))


# ---- linear algebra ---------------------------------------------------------------------------

@rule(aten.mm.default, aten.bmm.default, aten.matmul.default, aten.mv.default, aten.dot.default)
def _mm(a, b):
    return tnp.matmul(*_promoted(a, b))


@rule(aten.addmm.default, aten.baddbmm.default)
def _addmm(bias, a, b, *, beta=1, alpha=1):
    y = tnp.matmul(*_promoted(a, b))
    y = y if alpha == 1 else y * alpha
    if beta == 0:
        return y
    return y + (bias if beta == 1 else bias * beta)


# ---- symbolic sizes and bookkeeping ops -------------------------------------------------------

OPS[operator.getitem] = lambda x, i: x[i]
for _f in (operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod,
           operator.neg, operator.truediv, operator.pow):
    OPS[_f] = _f
OPS[aten.sym_size.int] = lambda x, d: tnp.shape(x)[d]
OPS[aten.sym_numel.default] = lambda x: tnp.size(x)
OPS[aten._assert_scalar.default] = lambda *a, **k: None
OPS[aten._assert_tensor_metadata.default] = lambda *a, **k: None

from . import aten_nn  # noqa: E402,F401  (the neural-network ops' rules register themselves)
