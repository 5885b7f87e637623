"""Lowering: a region of the graph (ir.passes.fusion.Region) -> kernel IR Kernels.

The heart is `_Builder.value(var, index)`: the scalar expression of a variable at an index
tuple (int64 KExprs). An equation inside the region is lowered by its rule in `VALUE_RULES`:
elementwise ops apply to their operands at the same index, index maps (broadcast, transpose,
slice, rev, reshape) rewrite the index, reductions and dot_general read their operand under a
reduce node, gather reads through a data-dependent offset. A variable from outside the region
is a load from a kernel input buffer at its row-major offset. Most regions are then one kernel
storing each output at the index space's own offset; scatter_add, concatenate and pad lower to a
short sequence of kernels (`REGION_RULES`).

16-bit floats: loads cast to float32, arithmetic stays in float32, stores cast back; an explicit
convert to a 16-bit type rounds (a cast there and back)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import dtypes
from .. import primitives as P
from ..core import Literal, Var
from ..errors import CompileError
from ..symbolic import distinct
from .ir import (INDEX, Buffer, Kernel, KExpr, Store, binary, cast, const, iadd, ic, idiv, idx, imul, is_const,
                 load, reads_ridx, reduce, ridx, select, unary)


@dataclass(frozen=True)
class LoweredKernel:
    """A kernel and the graph variables bound to its buffers, in kernel.buffers order."""
    kernel: Kernel
    args: tuple


# ---- index arithmetic that folds constants (kernels stay small and readable) -----------------

def imod(a: KExpr, k: int) -> KExpr:
    if k == 1:
        return ic(0)
    return ic(a.arg % k) if is_const(a) else binary("rem", a, ic(k))


def strides(shape) -> list[int]:
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= n
    return out[::-1]


def offset(index, shape) -> KExpr:
    """The row-major element offset of `index` in an array of `shape`."""
    off = ic(0)
    for i, s, n in zip(index, strides(shape), shape):
        if n != 1:
            off = iadd(off, imul(i, s))
    return off


def reshape_index(index, out_shape, in_shape) -> tuple:
    """The operand index for `index` into reshape(operand, out_shape). Axes are matched in
    blocks of equal size, so adding or removing unit axes and merging or splitting axes only
    costs div/mod inside the block that changes."""
    if 0 in out_shape or 0 in in_shape:
        return tuple(ic(0) for _ in in_shape)
    outs = [k for k, n in enumerate(out_shape) if n != 1]
    ins = [k for k, n in enumerate(in_shape) if n != 1]
    J = [ic(0)] * len(in_shape)
    a = b = 0
    while a < len(outs):
        ob, ib = [outs[a]], [ins[b]]
        po, pi = out_shape[outs[a]], in_shape[ins[b]]
        a, b = a + 1, b + 1
        while po != pi:
            if po < pi:
                ob.append(outs[a])
                po *= out_shape[outs[a]]
                a += 1
            else:
                ib.append(ins[b])
                pi *= in_shape[ins[b]]
                b += 1
        if len(ob) == 1 and len(ib) == 1:
            J[ib[0]] = index[ob[0]]
            continue
        flat = offset([index[k] for k in ob], [out_shape[k] for k in ob])
        inner = 1
        for k in reversed(ib):
            J[k] = imod(idiv(flat, inner), in_shape[k]) if k != ib[0] else idiv(flat, inner)
            inner *= in_shape[k]
    return tuple(J)


# ---- values ---------------------------------------------------------------------------------

def compute(dtype) -> np.dtype:
    return dtypes.compute_dtype(dtype)


def to_storage(v: KExpr, dtype) -> KExpr:
    return cast(v, dtype)


def round_to(v: KExpr, dtype) -> KExpr:
    """v (float32) rounded to a 16-bit float and widened again; other dtypes are exact."""
    dtype = np.dtype(dtype)
    if compute(dtype) == dtype or (v.op == "cast" and v.src[0].dtype == dtype):
        return v  # exact, or a 16-bit value (a load) widened already
    return cast(cast(v, dtype), compute(dtype))


class NotRows(Exception):
    """A region is not a row region (fusion's row merge asks by trying)."""


class _Builder:
    """Collects a kernel's input buffers while expressions are built."""

    def __init__(self, eqns=()):
        self.defs = {o.id: e for e in eqns for o in e.outputs}
        self.inputs: list[Var] = []
        self.slot: dict[int, int] = {}
        self.reduce_shape: tuple | None = None
        self.memo: dict = {}
        self.rows = False  # lowering a row region: several reductions over one row space

    def set_reduce(self, shape) -> None:
        if self.reduce_shape is not None:  # a row kernel: every reduction over the one row space
            if not self.rows or self.reduce_shape != tuple(shape):
                raise NotRows(f"a second reduction over {tuple(shape)}")
        self.reduce_shape = tuple(shape)

    def load(self, v: Var, index) -> KExpr:
        return self.load_flat(v, offset(index, v.aval.shape))

    def load_flat(self, v: Var, flat: KExpr) -> KExpr:
        """Element `flat` of an input (its buffer is contiguous, row-major)."""
        if v.id not in self.slot:
            self.slot[v.id] = len(self.inputs)
            self.inputs.append(v)
        return cast(load(self.slot[v.id], flat, v.aval.dtype), compute(v.aval.dtype))

    def is_input(self, a) -> bool:
        return isinstance(a, Var) and a.id not in self.defs

    def value(self, a, index) -> KExpr:
        """The expression of atom `a` at `index` (in its compute dtype)."""
        if isinstance(a, Literal):
            return const(a.val.astype(compute(a.aval.dtype)).item(), compute(a.aval.dtype))
        key = (a.id, tuple(index))
        hit = self.memo.get(key)
        if hit is None:
            e = self.defs.get(a.id)
            if e is None:
                hit = self.load(a, index)
            else:
                rule = VALUE_RULES.get(e.prim.name)
                if rule is None:
                    raise CompileError(f"no kernel lowering for the primitive {e.prim.name}")
                hit = _wrap_narrow_int(self, e, rule(self, e, tuple(index)), tuple(index))
            self.memo[key] = hit
        return hit

    def rounded(self, a, index) -> KExpr:
        """The value of `a` rounded to its dtype. Fused 16-bit arithmetic keeps float32 between
        operations (XLA's excess precision: cheaper and closer to exact); an op whose result
        jumps with its operand (a comparison, floor, a conversion, is_finite) reads it rounded,
        so it decides as the stored value, and the op run alone, would."""
        return round_to(self.value(a, index), a.aval.dtype)

    def kernel(self, name, outputs, shape, stores, kind, eqns, out_bufs=None) -> LoweredKernel:
        """Assemble: inputs first, then `outputs` (their Buffer numbers follow the inputs)."""
        out_vars = list(outputs)
        bufs = [Buffer(f"in{i}", np.dtype(v.aval.dtype), v.aval.size) for i, v in enumerate(self.inputs)]
        bufs += [Buffer(f"out{i}", np.dtype(v.aval.dtype), v.aval.size) for i, v in enumerate(out_vars)]
        k = Kernel(name, tuple(bufs), len(self.inputs), tuple(shape), self.reduce_shape or (),
                   tuple(stores), meta=dict(kind=kind, eqns=tuple(eqns), operands=tuple(self.inputs),
                                            sources=tuple(e.source for e in eqns if e.source)))
        return LoweredKernel(k, tuple(self.inputs) + tuple(out_vars))


def _idx_space(shape) -> tuple:
    return tuple(idx(k) for k in range(len(shape)))


# ---- value rules: one per primitive ----------------------------------------------------------

VALUE_RULES: dict[str, Callable] = {}


def _rule(*names):
    def register(fn):
        for n in names:
            VALUE_RULES[n] = fn
        return fn
    return register


_UNARY = ("neg", "exp", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "sin", "cos",
          "erf", "abs", "sign", "floor", "ceil", "round", "not")


@_rule(*_UNARY)
def _unary(b, e, I):
    read = b.rounded if e.prim.name in _STEP_UNARY else b.value
    v = unary(e.prim.name, read(e.inputs[0], I))
    if e.prim.name == "sign" and dtypes.is_float(v.dtype):  # numpy's sign(-0.0) is +0.0
        v = binary("add", v, const(0, v.dtype))
    return v


@_rule("is_finite")
def _is_finite(b, e, I):
    return unary("is_finite", b.rounded(e.inputs[0], I), np.bool_)


_STEP_UNARY = ("sign", "floor", "ceil", "round")
_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
# bool arithmetic is logic: add is or, mul is and, max is or, min is and
_BOOL_OPS = {"add": "or", "mul": "and", "max": "or", "min": "and"}
_BINARY = ("add", "sub", "mul", "pow", "max", "min", "and", "or", "xor", "shift_left",
           "shift_right_logical", "eq", "ne", "lt", "le", "gt", "ge")


@_rule(*_BINARY)
def _binary(b, e, I):
    read = b.rounded if e.prim.name in _COMPARISONS else b.value
    x, y = (read(a, I) for a in e.inputs)
    op = _BOOL_OPS.get(e.prim.name, e.prim.name) if x.dtype == np.bool_ else e.prim.name
    return binary(op, x, y)


@_rule("div", "rem")
def _div_rem(b, e, I):
    x, y = (b.rounded(a, I) if e.prim.name == "rem" else b.value(a, I) for a in e.inputs)
    if not dtypes.is_int(x.dtype):
        return binary(e.prim.name, x, y)
    # the primitive defines x/0 = 0 and x%0 = x; the IR leaves division by zero undefined
    zero = const(0, x.dtype)
    is_zero = binary("eq", y, zero)
    q = binary(e.prim.name, x, select(is_zero, const(1, x.dtype), y))
    return select(is_zero, zero if e.prim.name == "div" else x, q)


@_rule("integer_pow")
def _integer_pow(b, e, I):
    x = b.value(e.inputs[0], I)
    n = abs(e.params["y"])
    acc, base = const(1, x.dtype), x
    while n:  # square and multiply
        if n & 1:
            acc = base if is_const(acc, 1) else binary("mul", acc, base)
        n >>= 1
        if n:
            base = binary("mul", base, base)
    return binary("div", const(1, x.dtype), acc) if e.params["y"] < 0 else acc


@_rule("select")
def _select(b, e, I):
    p, t, f = (b.value(a, I) for a in e.inputs)
    return select(p, t, f)


@_rule("convert_element_type")
def _convert(b, e, I):
    x = b.rounded(e.inputs[0], I)
    to = np.dtype(e.params["new_dtype"])
    if to == np.bool_:
        return binary("ne", x, const(0, x.dtype))
    if compute(to) != to:  # to a 16-bit float: round
        return round_to(cast(x, compute(to)), to)
    return cast(x, to)


@_rule("stop_gradient")
def _identity(b, e, I):
    return b.value(e.inputs[0], I)


@_rule("broadcast_in_dim")
def _broadcast(b, e, I):
    x = e.inputs[0]
    J = tuple(ic(0) if x.aval.shape[i] == 1 else I[d]
              for i, d in enumerate(e.params["broadcast_dimensions"]))
    return b.value(x, J)


@_rule("transpose")
def _transpose(b, e, I):
    perm = e.params["permutation"]
    J = [None] * len(perm)
    for k, p in enumerate(perm):
        J[p] = I[k]
    return b.value(e.inputs[0], tuple(J))


@_rule("slice")
def _slice(b, e, I):
    J = tuple(iadd(ic(s), imul(i, st)) for i, s, st in
              zip(I, e.params["start_indices"], e.params["strides"]))
    return b.value(e.inputs[0], J)


@_rule("rev")
def _rev(b, e, I):
    x = e.inputs[0]
    J = tuple(binary("sub", ic(x.aval.shape[k] - 1), i) if k in e.params["dimensions"] else i
              for k, i in enumerate(I))
    return b.value(x, J)


@_rule("reshape")
def _reshape(b, e, I):
    x, shape = e.inputs[0], e.outputs[0].aval.shape
    if b.is_input(x):  # a contiguous buffer: the flat offset is the same in both shapes
        return b.load_flat(x, offset(I, shape))
    return b.value(x, reshape_index(I, shape, x.aval.shape))


@_rule("iota")
def _iota(b, e, I):
    d = np.dtype(e.params["dtype"])
    return round_to(cast(I[e.params["dimension"]], compute(d)), d)


_REDUCE_OPS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod"}
_BOOL_REDUCE = {"sum": "max", "prod": "min"}  # any / all


def _reduce_index(I, ndim, axes):
    """Operand index: kept axes from the parallel index, reduced axes (sorted) from ridx."""
    order = sorted(axes)
    it = iter(I)
    return tuple(ridx(order.index(k)) if k in axes else next(it) for k in range(ndim))


@_rule(*_REDUCE_OPS)
def _reduction(b, e, I):
    x, axes = e.inputs[0], tuple(e.params["axes"])
    if not axes:  # reducing no axis is the identity
        return b.value(x, I)
    if b.rows and any(map(reads_ridx, I)):
        raise NotRows(f"{e.prim.name} read at a point of the row")
    b.set_reduce(tuple(x.aval.shape[a] for a in sorted(axes)))
    v = b.value(x, _reduce_index(I, x.aval.ndim, axes))
    op = _REDUCE_OPS[e.prim.name]
    return reduce(_BOOL_REDUCE.get(op, op) if v.dtype == np.bool_ else op, v)


@_rule("argmax", "argmin")
def _arg_reduction(b, e, I):
    x, axis = e.inputs[0], e.params["axis"]
    b.set_reduce((x.aval.shape[axis],))
    v = b.rounded(x, _reduce_index(I, x.aval.ndim, (axis,)))  # ties as among stored values
    return cast(reduce(e.prim.name, v, ridx(0)), e.params["index_dtype"])


@_rule("dot_general")
def _dot_general(b, e, I):
    lhs, rhs = e.inputs[:2]  # (fused_gemm's epilogue operands follow)
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    lfree, rfree = P.dot_free_axes(lhs.aval.ndim, rhs.aval.ndim, e.params["dimension_numbers"])
    if lc:
        b.set_reduce(tuple(lhs.aval.shape[a] for a in lc))
    nb, nl = len(lb), len(lfree)

    def operand_index(ndim, contract, batch, free, start):
        return tuple(I[batch.index(k)] if k in batch else ridx(contract.index(k)) if k in contract
                     else I[start + free.index(k)] for k in range(ndim))
    x = b.value(lhs, operand_index(lhs.aval.ndim, lc, lb, lfree, nb))
    y = b.value(rhs, operand_index(rhs.aval.ndim, rc, rb, rfree, nb + nl))
    logic = x.dtype == np.bool_
    acc = binary("and" if logic else "mul", x, y)
    if lc:  # (an outer product contracts nothing)
        acc = reduce("max" if logic else "sum", acc)
    return cast(acc, compute(e.outputs[0].aval.dtype))


def epilogue_value(dtype=np.float32, slot: int = 0) -> KExpr:
    """A leaf that a GEMM template binds to a value of its own (a register, a vector, a variable),
    never read from a buffer: the product (slot 0) or an element of extra `slot - 1`."""
    return KExpr("load", np.dtype(dtype), (const(0, INDEX),), -1 - slot)


def epilogue_expr(fn, values) -> KExpr:
    """A fused_gemm's epilogue (a ScalarFn) applied to `values`, the product and its extras as
    expressions in their compute dtype: the one lowering of an epilogue, which the kernel IR and
    the shared GEMM builder (ir/kernel/gemm.py) use."""
    b = _Builder(fn.graph.eqns)
    for v, x in zip(fn.graph.invars, values, strict=True):
        b.memo[(v.id, ())] = x
    return b.value(fn.graph.outvars[0], ())


def epilogue_leaves(fn) -> tuple[KExpr, list]:
    """(the epilogue over leaves, the leaves: the product's, then each extra's)."""
    leaves = [epilogue_value(compute(d), i) for i, d in enumerate(fn.in_dtypes)]
    return epilogue_expr(fn, leaves), leaves


@_rule("fused_gemm")
def _fused_gemm(b, e, I):
    extras = [b.value(x, I if x.aval.ndim == len(I) else I[-1:]) for x in e.inputs[2:]]
    return epilogue_expr(e.params["epilogue"], [_dot_general(b, e, I), *extras])


def _clamped_index(b, indices, I, n: int) -> KExpr:
    """A gather/scatter index read at I, clamped into [0, n) as the primitive defines."""
    i = cast(b.value(indices, I), INDEX)
    return binary("min", binary("max", i, ic(0)), ic(n - 1))


@_rule("gather")
def _gather(b, e, I):
    operand, indices = e.inputs
    axis, ni = e.params["axis"], indices.aval.ndim
    n = operand.aval.shape[axis]
    if n == 0:
        return const(0, compute(operand.aval.dtype))
    i = _clamped_index(b, indices, I[axis:axis + ni], n)
    return b.value(operand, I[:axis] + (i,) + I[axis + ni:])


def _dynamic_starts(b, starts, shape, sizes) -> list[KExpr]:
    """dynamic_slice's and dynamic_update_slice's start indices (scalars), clamped so the window
    of `sizes` lies inside `shape`, as the primitives define."""
    out = []
    for s, n, k in zip(starts, shape, sizes):
        if isinstance(s, Literal):
            out.append(ic(min(max(int(s.val), 0), n - k)))
        else:
            i = cast(b.value(s, ()), INDEX)
            out.append(binary("min", binary("max", i, ic(0)), ic(n - k)))
    return out


@_rule("dynamic_slice")
def _dynamic_slice(b, e, I):
    x = e.inputs[0]
    st = _dynamic_starts(b, e.inputs[1:], x.aval.shape, e.params["slice_sizes"])
    return b.value(x, tuple(iadd(i, s) for i, s in zip(I, st)))


def _lower_dynamic_update_slice(region) -> list[LoweredKernel]:
    """Copy the operand, then write the update's window over it (the second kernel alone is what
    a loop runs to write one step's row into a stacked result in place)."""
    (e,) = region.eqns
    operand, update = e.inputs[:2]
    out = e.outputs[0]
    kernels = [_copy(operand, out, region.eqns, "dynamic_update_slice_copy", "copy")]
    if update.aval.size == 0:
        return kernels
    b = _Builder()
    U = _idx_space(update.aval.shape)
    st = _dynamic_starts(b, e.inputs[2:], operand.aval.shape, update.aval.shape)
    target = offset(tuple(iadd(i, s) for i, s in zip(U, st)), operand.aval.shape)
    v = to_storage(b.value(update, U), out.aval.dtype)  # (its input first: outputs follow inputs)
    stores = [Store(len(b.inputs), target, v)]
    kernels.append(b.kernel("dynamic_update_slice", [out], update.aval.shape, stores, "concatenate",
                            region.eqns))
    return kernels


# ---- regions -> kernels ------------------------------------------------------------------------

_SHORT = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod",
          "broadcast_in_dim": "broadcast", "convert_element_type": "convert"}
_MAX_NAME_OPS = 8


_UNNAMED = ("broadcast_in_dim", "reshape")  # mere layout: left out of fused kernels' names


def kernel_name(eqns) -> str:
    """`fused_mul_add_tanh_sum`: the region's distinct operations in order."""
    if len(eqns) == 1:
        return eqns[0].prim.name
    names = []
    for e in eqns:
        n = _SHORT.get(e.prim.name, e.prim.name)
        if n not in names and (e.prim.name not in _UNNAMED or all(x.prim.name in _UNNAMED for x in eqns)):
            names.append(n)
    more = "_etc" if len(names) > _MAX_NAME_OPS else ""
    return "fused_" + "_".join(names[:_MAX_NAME_OPS]) + more


def _lower_generic(region, kind=None) -> list[LoweredKernel]:
    """One kernel: every output evaluated over the outputs' common index space."""
    b = _Builder(region.eqns)
    shape = region.outputs[0].aval.shape
    assert all(o.aval.shape == shape for o in region.outputs), region
    I = _idx_space(shape)
    values = [b.value(o, I) for o in region.outputs]
    n_in = len(b.inputs)
    stores = [Store(n_in + k, offset(I, shape), to_storage(v, o.aval.dtype))
              for k, (v, o) in enumerate(zip(values, region.outputs))]
    reductions = {n for v in values for n in v.toposort() if n.op == "reduce"}
    if b.reduce_shape and not reductions:  # the reduced value went unused: x.sum(0) ** 0
        b.reduce_shape = None
    if kind is None:
        kind = "reduce" if b.reduce_shape else "elementwise"
    assert len(reductions) == (1 if b.reduce_shape else 0), (region, len(reductions))
    return [b.kernel(kernel_name(region.eqns), region.outputs, shape, stores, kind, region.eqns)]


def reduction_spaces(eqns) -> list:
    """The different (operand shape, reduced axes) of the reductions among eqns (compared, not
    hashed: symbolic sizes)."""
    return distinct((e.inputs[0].aval.shape, tuple(sorted(e.params["axes"])))
                    for e in eqns if e.prim.name in _REDUCE_OPS and e.params["axes"])


def row_space(region) -> tuple | None:
    """(row shape, reduced axes) when all of a region's reductions reduce the same axes of
    operands of one shape; None when it has no reduction or they differ."""
    spaces = reduction_spaces(region.eqns)
    return spaces[0] if len(spaces) == 1 else None


def _row_index(shape, space_shape, index):
    """The index into an array of `shape` whose non-unit axes are those of `space_shape`, in
    order, from `index` over that space (unit axes read 0); None if the axes differ."""
    live = [k for k, n in enumerate(space_shape) if n != 1]
    if [n for n in shape if n != 1] != [space_shape[k] for k in live]:
        return None
    it = iter(index[k] for k in live)
    return tuple(ic(0) if n == 1 else next(it) for n in shape)


def _lower_rows(region) -> list[LoweredKernel]:
    """A row region (fusion's row merge: softmax, layer norm): one kernel whose parallel space is
    the rows (the kept axes) and reduction space the row (the reduced axes). Reductions run in
    dependency order, one pass over the row per level; outputs shaped like the rows are stored
    once per row, outputs shaped like the operand by row stores (one more pass). Raises NotRows
    where that form does not hold (a reduction read at a point of the row)."""
    shape, axes = row_space(region)
    kept = tuple(n for k, n in enumerate(shape) if k not in axes)
    b = _Builder(region.eqns)
    b.rows = True
    I = _idx_space(kept)
    full = _reduce_index(I, len(shape), axes)
    stores = []
    for k, o in enumerate(region.outputs):
        J = _row_index(o.aval.shape, kept, I)
        if J is None:
            J = _row_index(o.aval.shape, shape, full)
        if J is None:
            raise NotRows(f"an output of shape {o.aval.shape} in a row space {shape} over {axes}")
        stores.append((k, o, J, b.value(o, J)))
    n_in = len(b.inputs)
    stores = [Store(n_in + k, offset(J, o.aval.shape), to_storage(v, o.aval.dtype)) for k, o, J, v in stores]
    b.reduce_shape = tuple(shape[a] for a in axes)
    return [b.kernel(kernel_name(region.eqns), region.outputs, kept, stores, "reduce", region.eqns)]


def _copy(src, dst, eqns, name: str, kind: str) -> LoweredKernel:
    """dst = src (a Var or a scalar Literal broadcast over dst's shape), read through `eqns`."""
    b = _Builder(eqns)
    shape = dst.aval.shape
    assert src.aval.shape in (shape, ()), (src.aval, dst.aval)
    I = _idx_space(shape)
    v = b.value(src, I if src.aval.shape == shape else ())
    stores = [Store(len(b.inputs), offset(I, shape), to_storage(v, dst.aval.dtype))]
    return b.kernel(name, [dst], shape, stores, kind, eqns)


def copy_kernel(src, dst) -> LoweredKernel:
    """A kernel writing `dst` from `src` (a variable of the same shape, or a literal): for graph
    outputs that are inputs, constants or literals."""
    return _copy(src, dst, (), "copy", "copy")


def _lower_scatter_add(region) -> list[LoweredKernel]:
    (e,) = region.eqns
    operand, indices, updates = e.inputs
    out = e.outputs[0]
    axis, ni = e.params["axis"], indices.aval.ndim
    n = operand.aval.shape[axis]
    kernels = [_copy(operand, out, region.eqns, "scatter_add_copy", "copy")]
    if n == 0 or updates.aval.size == 0:
        return kernels
    b = _Builder()
    U = _idx_space(updates.aval.shape)
    i = _clamped_index(b, indices, U[axis:axis + ni], n)
    target = offset(U[:axis] + (i,) + U[axis + ni:], operand.aval.shape)
    v = to_storage(b.value(updates, U), out.aval.dtype)
    stores = [Store(len(b.inputs), target, v, mode="add")]
    kernels.append(b.kernel("scatter_add", [out], updates.aval.shape, stores, "scatter_add", region.eqns))
    return kernels


def _lower_concatenate(region) -> list[LoweredKernel]:
    """One index-map kernel per operand, each writing its slab of the output (reading through
    the region's index maps)."""
    e = region.eqns[-1]
    out, d = e.outputs[0], e.params["dimension"]
    kernels, start = [], 0
    for x in e.inputs:
        shape = x.aval.shape
        if x.aval.size:
            b = _Builder(region.eqns[:-1])
            I = _idx_space(shape)
            J = I[:d] + (iadd(I[d], ic(start)),) + I[d + 1:]
            v = to_storage(b.value(x, I), out.aval.dtype)
            stores = [Store(len(b.inputs), offset(J, out.aval.shape), v)]
            kernels.append(b.kernel("concatenate", [out], shape, stores, "concatenate", region.eqns))
        start += shape[d]
    return kernels


def _lower_pad(region) -> list[LoweredKernel]:
    """Fill the output with the padding value, then write the operand at its strided place
    (reading through the region's index maps)."""
    e = region.eqns[-1]
    x, pv = e.inputs
    out = e.outputs[0]
    kernels = [_copy(pv, out, region.eqns, "pad_fill", "pad")] if out.aval.size else []
    if x.aval.size:
        b = _Builder(region.eqns[:-1])
        I = _idx_space(x.aval.shape)
        J = tuple(iadd(ic(lo), imul(i, it + 1)) for i, (lo, _, it) in zip(I, e.params["padding_config"]))
        v = to_storage(b.value(x, I), out.aval.dtype)
        stores = [Store(len(b.inputs), offset(J, out.aval.shape), v)]
        kernels.append(b.kernel("pad", [out], x.aval.shape, stores, "pad", region.eqns))
    return kernels


def _lower_template(region) -> list[LoweredKernel]:
    """A primitive that implementations take whole (fused_attention): one kernel without a body,
    its buffers the equation's operands and results; the dispatcher's chosen implementation
    reads the equation from meta (a device template, or the composite of ordinary kernels)."""
    (e,) = region.eqns
    assert all(isinstance(a, Var) for a in e.inputs), e
    args = tuple(e.inputs) + tuple(e.outputs)
    bufs = tuple(Buffer(f"{'in' if i < len(e.inputs) else 'out'}{i}", np.dtype(v.aval.dtype),
                        v.aval.size) for i, v in enumerate(args))
    k = Kernel(e.prim.name, bufs, len(e.inputs), e.outputs[0].aval.shape, (), (),
               meta=dict(kind=e.prim.name, eqns=(e,), sources=(e.source,) if e.source else ()))
    return [LoweredKernel(k, args)]


REGION_RULES: dict[str, Callable] = {
    "fused_attention": _lower_template,
    "fused_attention_stats": _lower_template,
    "fused_attention_bwd": _lower_template,
    "conv": _lower_template,
    "fused_conv": _lower_template,
    "scatter_add": _lower_scatter_add,
    "concatenate": _lower_concatenate,
    "pad": _lower_pad,
    "dot_general": lambda r: _lower_generic(r, "dot_general"),
    "fused_gemm": lambda r: _lower_generic(r, "fused_gemm"),
    "gather": lambda r: _lower_generic(r, "gather"),
    "dynamic_slice": lambda r: _lower_generic(r, "gather"),
    "dynamic_update_slice": _lower_dynamic_update_slice,
    # control flow lowers to no kernel here: the runtime compiles its bodies (runtime/control_flow.py)
    "cond": lambda r: [],
    "while": lambda r: [],
    "scan": lambda r: [],
    "argmax": lambda r: _lower_generic(r, "arg_reduce"),
    "argmin": lambda r: _lower_generic(r, "arg_reduce"),
}


def lower_region(region) -> list[LoweredKernel]:
    """The kernels that compute a region's outputs, in launch order."""
    if region.kind == "fused":
        if region.meta.get("rows"):  # lowered already when fusion merged it (or lowered here)
            return region.meta.get("lowered") or _lower_rows(region)
        return _lower_generic(region)
    rule = REGION_RULES.get(region.kind)
    if rule is None:
        raise CompileError(f"no kernel lowering for the primitive {region.kind}")
    return rule(region)


# ---- vendor kernels on the host: sorting and LAPACK (ir/primitives.py HOST_PRIMITIVES) --------
# Taken whole like a template; the dispatcher's numpy_host implementation (runtime/host.py) runs it.

def _register_host_primitives():
    from ..primitives import HOST_PRIMITIVES
    for p in HOST_PRIMITIVES:
        REGION_RULES[p.name] = _lower_template


_register_host_primitives()


# ---- 8- and 16-bit integers: computed in int32, wrapped to their width after each operation --------
# (dtypes.NARROW_INTS). Operations that can leave the width wrap at once, so a fused chain gives
# what numpy gives op by op: uint8 200 * 2 is 144, and 144 > 100 as numpy decides it.

_NARROW_WRAPS = frozenset({"add", "sub", "mul", "neg", "abs", "integer_pow", "shift_left", "div", "rem",
                           "not", "reduce_sum", "reduce_prod"})


def _wrap_narrow_int(b, e, v: KExpr, index) -> KExpr:
    if not e.outputs or len(e.outputs) != 1:
        return v
    d = np.dtype(e.outputs[0].aval.dtype)
    if d not in dtypes.NARROW_INTS:
        return v
    if e.prim.name == "shift_right_logical" and d.kind == "i":  # shift the narrow bits, not the sign-extended
        x, s = (b.value(a, index) for a in e.inputs)
        mask = const((1 << (8 * d.itemsize)) - 1, x.dtype)
        v = binary("shift_right_logical", binary("and", x, mask), s)
        return round_to(v, d)
    return round_to(v, d) if e.prim.name in _NARROW_WRAPS else v
