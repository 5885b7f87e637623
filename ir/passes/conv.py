"""conv as ordinary primitives: the explicit im2col (a pad, one strided slice per kernel tap,
concatenated into the patch matrix) and one batched dot_general with the filter.

The composite implementation (runtime/composite.py) runs it where the implicit GEMM
(ir/kernel/conv.py) does not apply; the concatenate's kernels read the windows through their
index maps, so the patch matrix is written once. It also documents the GEMM that a convolution
is: per batch group b and feature group g, filter (O/(B·G), I·T) times patches (I·T, N/B · P),
T the kernel taps and P the output positions."""
from __future__ import annotations

import numpy as np

from .. import primitives as P
from ..core import Graph, Var
from .util import Emit, literal, new_eqn


def decompose(eqn) -> tuple[list, list]:
    """(equations, outputs) computing one conv equation over its own input variables."""
    em = Emit()
    lhs, rhs = eqn.inputs
    p = eqn.params
    ls, rs, os_ = p["dimension_numbers"]
    x, w = em.permute(lhs, ls), em.permute(rhs, rs)  # (N, C, spatial...), (O, I, kernel...)
    g, b = p["feature_group_count"], p["batch_group_count"]
    n, c, _, o, i, kernel, out = P.conv_dims(
        x.aval.shape, w.aval.shape, **{**p, "dimension_numbers": (tuple(range(x.aval.ndim)),) * 3})
    taps = int(np.prod(kernel, dtype=np.int64))
    positions = int(np.prod(out, dtype=np.int64))
    og, nb = o // (g * b), n // b
    zero = literal(0, x.aval.dtype)
    cfg = ((0, 0, 0),) * 2 + tuple((max(lo, 0), max(hi, 0), d - 1) for (lo, hi), d in zip(p["padding"], p["lhs_dilation"]))
    if any(c != (0, 0, 0) for c in cfg):
        x = em(P.pad, x, zero, padding_config=cfg)
    if any(lo < 0 or hi < 0 for lo, hi in p["padding"]):  # negative padding crops
        shape = x.aval.shape
        x = em(P.slice_, x, start_indices=(0, 0) + tuple(max(-lo, 0) for lo, _ in p["padding"]),
               limit_indices=shape[:2] + tuple(s - max(-hi, 0) for s, (_, hi) in zip(shape[2:], p["padding"])),
               strides=(1,) * x.aval.ndim)
    windows = []
    for tap in np.ndindex(*kernel):
        start = tuple(t * d for t, d in zip(tap, p["rhs_dilation"]))
        win = em(P.slice_, x, start_indices=(0, 0) + start,
                 limit_indices=(n, c) + tuple(s + (m - 1) * st + 1 if m else s for s, m, st
                                              in zip(start, out, p["window_strides"])),
                 strides=(1, 1) + tuple(p["window_strides"]))
        # (N, C, out...) -> (b, g, i, 1, N/b, P): rows (feature, tap), columns (image, position)
        win = em(P.reshape, win, new_sizes=(b, nb, g, i, positions))
        win = em.permute(win, (0, 2, 3, 1, 4))
        windows.append(em(P.reshape, win, new_sizes=(b, g, i, 1, nb, positions)))
    patches = windows[0] if taps == 1 else em(P.concatenate, *windows, dimension=3)
    wm = em(P.reshape, w, new_sizes=(b, g, og, i, taps))
    y = em(P.dot_general, wm, patches, dimension_numbers=(((3, 4), (2, 3)), ((0, 1), (0, 1))))
    y = em.permute(y, (3, 0, 1, 2, 4))  # (N/b, b, g, O/(b g), P): features (b, g, o) in order
    y = em(P.reshape, y, new_sizes=(nb, o) + tuple(out))
    return em.eqns, [em.permute(y, np.argsort(os_))]


def decomposed_graph(eqn) -> Graph:
    """A graph computing one conv equation with ordinary primitives (fresh input variables)."""
    ins = [Var(a.aval) for a in eqn.inputs]
    eqns, outs = decompose(eqn.replace(inputs=tuple(ins)))
    return Graph((), tuple(ins), tuple(eqns), tuple(outs))


# ---- the layouts the implicit GEMM reads fast ------------------------------------------------------

def _conv_layouts(e, rw):
    """conv(x, w) whose lhs's last spatial axis is not its innermost (NHWC), or whose output's
    positions are not its trailing axes in order (an NHWC result): the lhs transposed to
    (batch, feature, spatial...) and the output computed so and transposed back. Exact (data
    movement only): the implicit GEMM then loads whole vectors along the lhs's rows and stores
    whole vectors of positions, where it would gather and scatter; a transpose costs one pass over
    an operand, the convolution K passes."""
    ls, rs, os_ = e.params["dimension_numbers"]
    nd = len(ls)
    canon = tuple(range(nd))
    x_ok, y_ok = ls[-1] == nd - 1, tuple(os_[2:]) == canon[2:]
    if x_ok and y_ok:
        return None
    x, w = e.inputs
    eqns = []
    if not x_ok:
        t, (x,) = new_eqn(P.transpose, (x,), {"permutation": tuple(ls)}, e.source)
        eqns.append(t)
        ls = canon
    params = dict(e.params, dimension_numbers=(tuple(ls), tuple(rs), os_ if y_ok else canon))
    c, (y,) = new_eqn(P.conv, (x, w), params, e.source)
    if y_ok:
        return eqns + [c.replace(outputs=e.outputs)]
    back, _ = new_eqn(P.transpose, (y,), {"permutation": tuple(int(a) for a in np.argsort(os_))}, e.source)
    return eqns + [c, back.replace(outputs=e.outputs)]


def conv_layouts(graph: Graph) -> Graph:
    """Every conv reads an lhs whose rows are contiguous and writes contiguous positions
    (_conv_layouts); transposes that meet another transpose merge."""
    from .simplify import RULES, rewrite_with
    return rewrite_with({"conv": [_conv_layouts], "transpose": RULES["transpose"]}, graph)
