"""GEMM problems the tile-kernel tests share (tests/ir/test_tile.py on the reference,
tests/backends/test_tile_kernels.py on every backend): name -> (function, arguments)."""
from __future__ import annotations

import numpy as np

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse import nn
from tilefuse.ir.kernel import lower_region
from tilefuse.ir.passes import partition, run_passes

R = np.random.default_rng(0)
F32 = np.float32


def u(*shape, dtype=F32):
    return R.uniform(-2, 2, shape).astype(dtype)


def gemm_kernel(f, args):
    """The lowered dot_general/fused_gemm kernel of f(*args), and its arguments in buffer order."""
    g = run_passes(tx.make_graph(f)(*args))
    pos = {v.id: i for i, v in enumerate(g.invars)}
    for r in partition(g):
        for lk in lower_region(r):
            if lk.kernel.meta.get("kind") in ("dot_general", "fused_gemm"):
                k = lk.kernel
                ins = [np.ascontiguousarray(args[pos[v.id]]).reshape(-1) for v in lk.args[:k.n_inputs]]
                return k, ins
    raise AssertionError("no GEMM kernel")


CASES = {
    "plain": (lambda x, w: x @ w, [u(13, 7), u(7, 19)]),
    "B transposed": (lambda x, w: x @ w.T, [u(13, 7), u(19, 7)]),
    "A transposed": (lambda x, w: x.T @ w, [u(7, 13), u(7, 19)]),
    # A's micro-panels copied as vectors (wm rows at a time) but for the last, partial one
    "A transposed, bfloat16": (lambda x, w: x.T @ w, [u(9, 29, dtype=tx.bfloat16), u(9, 19, dtype=tx.bfloat16)]),
    "batched einsum": (lambda q, k: tnp.einsum("bqd,bkd->bqk", q, k), [u(3, 5, 4), u(3, 6, 4)]),
    "epilogue": (lambda x, w, b, r: nn.gelu(x @ w + b) + r, [u(2, 9, 7), u(7, 21), u(21), u(2, 9, 21)]),
    "clamp epilogue": (lambda x, w: tnp.clip(x @ w * 40.0, -50.0, 50.0), [u(6, 5), u(5, 10)]),
    "bfloat16": (lambda x, w, b: nn.relu(x @ w + b),
                 [u(11, 8, dtype=tx.bfloat16), u(8, 10, dtype=tx.bfloat16), u(10, dtype=tx.bfloat16)]),
    "K = 1": (lambda x, w: x @ w, [u(5, 1), u(1, 9)]),
}


def conv_kernel(f, args):
    """The lowered conv (or fused_conv) kernel of f(*args) and its GemmSpec (the implicit GEMM),
    with its arguments in buffer order."""
    from tilefuse.ir.kernel.conv import conv_spec
    from tilefuse.ir.passes import PIPELINE
    # the builder as the conv is written: without conv_layouts, which would transpose an NHWC lhs
    g = run_passes(tx.make_graph(f)(*args), [p for p in PIPELINE if p[0] != "conv_layouts"])
    pos = {v.id: i for i, v in enumerate(g.invars)}
    for r in partition(g):
        for lk in lower_region(r):
            if lk.kernel.meta.get("kind") in ("conv", "fused_conv"):
                k = lk.kernel
                ins = [np.ascontiguousarray(args[pos[v.id]]).reshape(-1) for v in lk.args[:k.n_inputs]]
                return k, conv_spec(k), ins
    raise AssertionError("no conv kernel")


def _conv(**params):
    return lambda x, w: tx.lax.conv_general_dilated(x, w, **params)


# convolutions the implicit GEMM (ir/kernel/conv.py) reads in place: padding edges, rows that
# straddle the vectors, strides, dilations, groups, crops, other layouts, 1-D and 3-D
CONV_CASES = {
    "3x3 padded": (_conv(window_strides=(1, 1), padding=((1, 1), (1, 1))), [u(2, 3, 6, 7), u(4, 3, 3, 3)]),
    "strided, dilated, groups": (_conv(window_strides=(2, 1), padding=((1, 0), (2, 1)), rhs_dilation=(1, 2),
                                       feature_group_count=2), [u(2, 4, 7, 9), u(6, 2, 3, 2)]),
    "lhs dilated, batch groups, crop": (_conv(window_strides=(1, 1), padding=((1, -1), (2, 0)), lhs_dilation=(2, 1),
                                              batch_group_count=2), [u(4, 3, 5, 6), u(4, 3, 2, 3)]),
    "NHWC, HWIO": (_conv(window_strides=(1, 1), padding=((1, 1), (0, 2)), dimension_numbers=("NHWC", "HWIO", "NCHW")),
                   [u(2, 6, 5, 3), u(3, 3, 3, 4)]),
    "images in columns": (_conv(window_strides=(1, 1), padding=((1, 1), (1, 1)),
                                dimension_numbers=((1, 0, 2, 3),) * 3), [u(3, 2, 5, 5), u(3, 4, 3, 3)]),
    "1-D": (_conv(window_strides=(1,), padding=((2, 2),)), [u(2, 3, 11), u(5, 3, 3)]),
    "3-D": (_conv(window_strides=(1, 1, 2), padding=((0, 0), (1, 1), (1, 0))), [u(1, 2, 3, 4, 6), u(3, 2, 2, 2, 3)]),
    "bfloat16": (_conv(window_strides=(1, 1), padding=((1, 1), (1, 1))),
                 [u(1, 3, 5, 6, dtype=tx.bfloat16), u(4, 3, 3, 3, dtype=tx.bfloat16)]),
    # fused_conv: a bias per output feature (one value per GEMM row, per group) and a residual
    "epilogue, groups": (lambda x, w, b, r: nn.relu(_conv(window_strides=(1, 1), padding=((1, 1), (1, 1)),
                                                          feature_group_count=2)(x, w) + b[None, :, None, None]) + r,
                         [u(2, 4, 5, 6), u(6, 2, 3, 3), u(6), u(2, 6, 5, 6)]),
}
