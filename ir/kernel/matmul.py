"""The strided batched-GEMM view of a dot_general, shared by every backend's GEMM template.

A dot_general over row-major operands is `C[b, m, n] = sum_k A[b, m, k] * B[b, k, n]` when each
group of axes (batch, free, contracting) of each operand collapses into one strided axis: the
axes of a group, in the group's order, must be laid out like one row-major block. That covers
`x @ w`, batched matmuls, every transposed form and the (B, H, S, D) einsums of attention,
without copying an operand; a dot_general that does not collapse keeps the generic kernel."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..primitives import dot_free_axes
from .lower import strides


# products below this many FLOPs run as the generic kernel: as fast, and no tile padding
MIN_FLOPS = 1 << 18


@dataclass(frozen=True)
class MatmulLayout:
    """Extents and element strides of C[b, m, n] = sum_k A[b, m, k] B[b, k, n]; C is dense
    (strides M*N, N, 1). `a`/`b` are the operands' positions among the equation's inputs."""
    batch: int
    m: int
    n: int
    k: int
    a_strides: tuple  # (batch, m, k)
    b_strides: tuple  # (batch, k, n)
    dtype: np.dtype

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k


def _collapse(shape, strides, axes) -> tuple[int, int] | None:
    """(extent, stride) of `axes` taken as one axis, or None when they are not one block."""
    axes = [a for a in axes if shape[a] != 1]  # a size-1 axis has no stride to respect
    extent = math.prod(shape[a] for a in axes)  # (a symbolic size stays an expression)
    for a, b in zip(axes, axes[1:]):
        if strides[a] != strides[b] * shape[b]:
            return None
    return extent, (strides[axes[-1]] if axes else 0)


def dot_axes(eqn) -> tuple[tuple, tuple]:
    """A dot_general's operands' axes in GEMM order: (batch, free, contracting) of the lhs,
    (batch, contracting, free) of the rhs."""
    lhs, rhs = (v.aval for v in eqn.inputs[:2])
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lfree, rfree = dot_free_axes(lhs.ndim, rhs.ndim, eqn.params["dimension_numbers"])
    return (*lb, *lfree, *lc), (*rb, *rc, *rfree)


def matmul_layout(eqn) -> MatmulLayout | None:
    """The batched-GEMM view of a dot_general equation, or None where there is none."""
    lhs, rhs = (v.aval for v in eqn.inputs[:2])  # fused_gemm's epilogue operands follow
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lfree, rfree = dot_free_axes(lhs.ndim, rhs.ndim, eqn.params["dimension_numbers"])
    ls, rs = strides(lhs.shape), strides(rhs.shape)
    groups = [_collapse(lhs.shape, ls, g) for g in (lb, lfree, lc)]
    groups += [_collapse(rhs.shape, rs, g) for g in (rb, rc, rfree)]
    if any(g is None for g in groups):
        return None
    (nb, sab), (m, sam), (k, sak), (_, sbb), (_, sbk), (n, sbn) = groups
    return MatmulLayout(nb, m, n, k, (sab, sam, sak), (sbb, sbk, sbn), np.dtype(lhs.dtype))
