"""Convolution as an implicit GEMM: the shared GEMM builder (gemm.py) over a conv equation, its
patch matrix read through index arithmetic from the lhs where it lies (never stored).

Per group γ (feature or batch group) the convolution is C = A B: A the filter's rows of the
group (output features, by input feature x kernel tap), B the patches (input feature x tap, by
output position), C the output's rows. Two views of the batch of images:
- per image: z = (image, γ), columns the output positions (the forward and input-gradient
  convolutions, whose outputs are laid out image by image);
- images in the columns: z = γ, columns (image, position) where the output keeps each image's
  positions next to the previous image's (the filter gradient, whose "images" are the input
  features and whose positions are the kernel taps: a few columns per image).
Every operand is read through its axis strides, so any layout the conv's dimension numbers name
is read in place; the output's positions (and images, in the second view) must be contiguous
(else the decomposition runs). A patch element is the lhs at the position
`out·stride + tap·rhs_dilation - low padding` of the dilated lhs, zero on a hole of the dilation or
outside; the CPU form packs B a vector of columns at a time: one vector load where the columns lie
in one row of the output and inside the lhs with unit steps, a masked gather elsewhere."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..primitives import conv_dims, conv_params
from .ir import INDEX, KExpr, binary, cast, const, select, unary
from .lower import iadd, idiv, imod, imul, strides as row_major
from .matmul import MatmulLayout
from .tile import If, broadcast, iota, tload, vload


def _i(v: int) -> KExpr:
    return const(int(v), INDEX)


def _and(a, b):
    return b if a is None else a if b is None else binary("and", a, b)


@dataclass(frozen=True)
class ConvView:
    """A conv equation as the GEMM C[z, m, col] = Σ_k A[z, m, k] B[z, k, col] (module docstring)."""
    groups: int            # Γ: feature groups x batch groups (one of them is 1)
    batch_groups: bool     # the groups split the lhs batch (else its features)
    images: int            # lhs batch per group
    in_feats: int          # I: input features per group (the filter's)
    out_feats: int         # output features per group: the GEMM's M
    in_sp: tuple           # the lhs's spatial extents
    k_sp: tuple            # the kernel's
    out_sp: tuple          # the output's
    window_strides: tuple
    low: tuple             # low padding per spatial axis (of the dilated lhs; negative crops)
    lhs_dilation: tuple
    rhs_dilation: tuple
    x_strides: tuple       # element strides of the lhs: (batch, feature, spatial...)
    w_strides: tuple       # the rhs: (out feature, in feature, spatial...)
    y_strides: tuple       # the output: (batch, feature, spatial...)
    images_in_columns: bool
    dtype: np.dtype

    # -- the GEMM's extents -----------------------------------------------------------------
    @property
    def taps(self) -> int:
        return math.prod(self.k_sp)

    @property
    def positions(self) -> int:
        return math.prod(self.out_sp)

    @property
    def batch(self) -> int:
        return self.groups if self.images_in_columns else self.images * self.groups

    @property
    def columns(self) -> int:
        return self.positions * (self.images if self.images_in_columns else 1)

    @property
    def k(self) -> int:
        return self.in_feats * self.taps

    @property
    def a_contiguous(self) -> bool:
        """The filter's (in feature, taps...) axes are one row-major block of unit stride: A's
        rows are read along k in place."""
        ext = (self.in_feats,) + tuple(self.k_sp)
        want = row_major(ext)
        return all(s == w for s, w, n in zip(self.w_strides[1:], want, ext) if n != 1)

    def layout(self) -> MatmulLayout:
        return MatmulLayout(self.batch, self.out_feats, self.columns, self.k,
                            (0, self.w_strides[0], 1 if self.a_contiguous else 0), (0, 0, 0), self.dtype)

    @property
    def row_stride(self) -> int:
        return self.y_strides[1]

    # -- index decompositions -----------------------------------------------------------------
    def _split_z(self, z):
        """(image or None, group) of batch index z."""
        if self.images_in_columns:
            return None, z
        if self.groups == 1:
            return z, _i(0)
        return idiv(z, self.groups), imod(z, self.groups)

    def _split_col(self, col, image):
        """(image, output position per spatial axis) of column col."""
        if self.images_in_columns:
            image, col = idiv(col, self.positions), imod(col, self.positions)
        pos, inner = [], self.positions
        for n in self.out_sp:
            inner //= n
            pos.append(imod(idiv(col, inner), n))
        return image, pos

    def _split_k(self, k):
        """(input feature, tap per spatial axis) of reduction index k."""
        f = idiv(k, self.taps)
        taps, inner = [], self.taps
        for n in self.k_sp:
            inner //= n
            taps.append(imod(idiv(k, inner), n))
        return f, taps

    def _lhs_base(self, image, group, feat):
        """The lhs offset of (image, feature) in group `group`, spatial axes at 0."""
        sn, sc = self.x_strides[:2]
        if self.batch_groups:
            return iadd(imul(iadd(imul(group, self.images), image), sn), imul(feat, sc))
        return iadd(imul(image, sn), imul(iadd(imul(group, self.in_feats), feat), sc))

    def _axis(self, a: int, out, tap):
        """(offset, valid) of spatial axis a for output position `out` and kernel tap `tap`."""
        s, d, ld, lo = self.window_strides[a], self.rhs_dilation[a], self.lhs_dilation[a], self.low[a]
        size = self.in_sp[a]
        pos = iadd(iadd(imul(out, s), imul(tap, d)), _i(-lo))
        valid = binary("ge", pos, _i(0))
        valid = binary("and", valid, binary("lt", pos, _i((size - 1) * ld + 1 if size else 0)))
        if ld > 1:
            valid = binary("and", valid, binary("eq", imod(pos, ld), _i(0)))
        at = binary("min", binary("max", idiv(pos, ld), _i(0)), _i(max(size - 1, 0)))
        return imul(at, self.x_strides[2 + a]), valid

    # -- A: the filter -------------------------------------------------------------------------
    def a_offset(self, z, row, k) -> KExpr:
        _, group = self._split_z(z)
        frow = iadd(imul(group, self.out_feats), row)
        if self.a_contiguous:
            return iadd(imul(frow, self.w_strides[0]), k)
        f, taps = self._split_k(k)
        off = iadd(imul(frow, self.w_strides[0]), imul(f, self.w_strides[1]))
        for t, s in zip(taps, self.w_strides[2:]):
            off = iadd(off, imul(t, s))
        return off

    # -- B: the patches ------------------------------------------------------------------------
    @property
    def acc(self) -> np.dtype:
        return dtypes.compute_dtype(self.dtype)

    def _lhs(self, buf: int, off) -> KExpr:
        """The lhs element at `off` in the compute dtype (16-bit floats widened as loaded)."""
        return cast(tload(buf, off, self.dtype), self.acc)

    def b_value(self, buf: int, z, k, col) -> KExpr:
        """B[z, k, col] in the compute dtype: the lhs element there, zero on a hole or outside
        (col inside the matrix)."""
        image, group = self._split_z(z)
        image, pos = self._split_col(col, image)
        f, taps = self._split_k(k)
        off, valid = self._lhs_base(image, group, f), None
        for a, (o, t) in enumerate(zip(pos, taps)):
            at, ok = self._axis(a, o, t)
            off, valid = iadd(off, at), _and(valid, ok)
        x = self._lhs(buf, off)
        return x if valid is None else select(valid, x, const(0, self.acc))

    def b_pack(self, buf: int, z, k, col, lanes: int, store) -> tuple:
        """Statements that call store(v) with B[z, k, col .. col+lanes) as one vector in the
        compute dtype (zeros past the last column). Where the lanes lie in one row of the output (its
        last spatial axis, one image), the other axes' offsets are scalars; a vector load where
        the row's window is inside the lhs with unit steps, else a gather of the valid lanes."""
        image, group = self._split_z(z)
        f, taps = self._split_k(k)
        last = len(self.out_sp) - 1
        width = self.out_sp[last]
        img0, pos0 = self._split_col(col, image)
        base, valid = self._lhs_base(img0, group, f), None
        for a in range(last):
            at, ok = self._axis(a, pos0[a], taps[a])
            base, valid = iadd(base, at), _and(valid, ok)
        # lanes of one row: positions pos0[last] + lane along the last axis
        lane_pos = binary("add", broadcast(pos0[last], lanes), iota(lanes))
        at, ok = self._axis(last, lane_pos, broadcast(taps[last], lanes))
        ok = _and(ok, None if valid is None else broadcast(valid, lanes))
        zero = broadcast(const(0, self.acc), lanes)
        row_gather = select(ok, self._lhs(buf, binary("add", broadcast(base, lanes), at)), zero)
        one_row = binary("le", iadd(pos0[last], _i(lanes)), _i(width))
        one_row = _and(one_row, binary("le", iadd(col, _i(lanes)), _i(self.columns)))
        if self.window_strides[last] == 1 and self.lhs_dilation[last] == 1 and self.x_strides[2 + last] == 1:
            first = iadd(iadd(pos0[last], imul(taps[last], self.rhs_dilation[last])), _i(-self.low[last]))
            inside = _and(binary("ge", first, _i(0)), binary("le", iadd(first, _i(lanes)), _i(self.in_sp[last])))
            inside = _and(inside, valid)
            whole = cast(vload(buf, iadd(base, first), self.dtype, lanes), self.acc)
            in_row = (If(inside, (store(whole),)), If(_not(inside), (store(row_gather),)))
        else:
            in_row = (store(row_gather),)
        # lanes across rows (or past the last column): every lane decomposed on its own
        cols = binary("add", broadcast(col, lanes), iota(lanes))
        spread = select(binary("lt", cols, broadcast(_i(self.columns), lanes)),
                        self.b_value(buf, broadcast(z, lanes) if isinstance(z, KExpr) else z,
                                     broadcast(k, lanes), binary("min", cols, broadcast(_i(self.columns - 1), lanes))),
                        zero)
        return (If(one_row, in_row), If(_not(one_row), (store(spread),)))

    # -- C: the output --------------------------------------------------------------------------
    def feature(self, z, row) -> KExpr:
        """The output feature of GEMM row `row` in batch z (a vector extra's index)."""
        return iadd(imul(self._split_z(z)[1], self.out_feats), row)

    def c_offset(self, z, row, col) -> KExpr:
        image, group = self._split_z(z)
        base = imul(iadd(imul(group, self.out_feats), row), self.y_strides[1])
        if image is not None:
            base = iadd(base, imul(image, self.y_strides[0]))
        return iadd(base, col)


def _not(c: KExpr) -> KExpr:
    return unary("not", c)


def _contiguous(strides, extents) -> bool:
    """Axes of these extents and strides form one row-major block of unit stride."""
    return all(s == w for s, w, n in zip(strides, row_major(extents), extents) if n != 1)


def view_of(eqn) -> ConvView | None:
    """The implicit GEMM of a conv equation, or None where its output's positions are not
    contiguous (the decomposition runs) or it is empty."""
    p = conv_params(eqn.params)
    x, w = (a.aval for a in eqn.inputs[:2])
    y = eqn.outputs[0].aval
    ls, rs, os_ = p["dimension_numbers"]
    n, c, in_sp, o, i, k_sp, out_sp = conv_dims(x.shape, w.shape, **p)
    if 0 in (x.size, w.size, y.size) or not dtypes.is_float(x.dtype):
        return None
    xs, ws, ys = (row_major(a.shape) for a in (x, w, y))
    y_strides = tuple(ys[a] for a in os_)
    if not _contiguous(y_strides[2:], out_sp):
        return None
    g, b = p["feature_group_count"], p["batch_group_count"]
    nb = n // b
    in_columns = y_strides[0] == math.prod(out_sp) and nb > 1
    return ConvView(
        g * b, b > 1, nb, i, o // (g * b), tuple(in_sp), tuple(k_sp), tuple(out_sp), tuple(p["window_strides"]),
        tuple(lo for lo, _ in p["padding"]), tuple(p["lhs_dilation"]), tuple(p["rhs_dilation"]),
        tuple(xs[a] for a in ls), tuple(ws[a] for a in rs), y_strides, in_columns, np.dtype(x.dtype))


def conv_spec(kernel):
    """The GemmSpec of a conv or fused_conv kernel (buffers: lhs, rhs, the epilogue's extras, the
    output), or None (view_of)."""
    from .gemm import GemmSpec
    eqns = kernel.meta.get("eqns", ())
    if len(eqns) != 1 or eqns[0].prim.name not in ("conv", "fused_conv"):
        return None
    e = eqns[0]
    v = view_of(e)
    if v is None:
        return None
    out = e.outputs[0].aval
    extras = tuple((i, x.aval.shape == out.shape) for i, x in enumerate(e.inputs[2:], start=2))
    return GemmSpec(v.layout(), np.dtype(out.dtype), e.params.get("epilogue"), 1, 0, extras, len(e.inputs), conv=v)
