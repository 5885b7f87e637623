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
    "batched einsum": (lambda q, k: tnp.einsum("bqd,bkd->bqk", q, k), [u(3, 5, 4), u(3, 6, 4)]),
    "epilogue": (lambda x, w, b, r: nn.gelu(x @ w + b) + r, [u(2, 9, 7), u(7, 21), u(21), u(2, 9, 21)]),
    "clamp epilogue": (lambda x, w: tnp.clip(x @ w * 40.0, -50.0, 50.0), [u(6, 5), u(5, 10)]),
    "bfloat16": (lambda x, w, b: nn.relu(x @ w + b),
                 [u(11, 8, dtype=tx.bfloat16), u(8, 10, dtype=tx.bfloat16), u(10, dtype=tx.bfloat16)]),
    "K = 1": (lambda x, w: x @ w, [u(5, 1), u(1, 9)]),
}
