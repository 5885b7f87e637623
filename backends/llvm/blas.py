"""The vendor GEMM on the CPU: numpy's BLAS (np.matmul) on strided views of the kernel's
buffers, the way XLA calls a vendor library. float16/bfloat16 operands are widened to float32
first (numpy has no 16-bit BLAS); a fused_gemm's epilogue runs after it in numpy."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided


def _typed(buf, dtype, size):
    return buf[:size * dtype.itemsize].view(dtype)


class VendorGemm:
    """np.matmul for one GemmProblem; `run(buffers)` in kernel.buffers order."""

    def __init__(self, prob):
        self.prob = prob
        e = prob.eqn
        self._inputs = [(np.dtype(v.aval.dtype), v.aval.size) for v in e.inputs]
        self._pos = [next(i for i, roles in enumerate(prob.roles) if r in roles)
                     for r in ["lhs", "rhs", *range(len(e.inputs) - 2)]]
        self._out_shape = e.outputs[0].aval.shape

    def _strided(self, buf, dtype, size, shape, strides):
        x = _typed(buf, dtype, size)
        return as_strided(x, shape, tuple(s * dtype.itemsize for s in strides), writeable=False)

    def __call__(self, buffers) -> None:
        p = self.prob
        (ad, asz), (bd, bsz) = self._inputs[:2]
        a = self._strided(buffers[self._pos[0]], ad, asz, (p.batch, p.m, p.k), p.a_strides)
        b = self._strided(buffers[self._pos[1]], bd, bsz, (p.batch, p.k, p.n), p.b_strides)
        if ad != np.float32:
            a, b = a.astype(np.float32), b.astype(np.float32)
        c = _typed(buffers[-1], p.out_dtype, p.batch * p.m * p.n).reshape(p.batch, p.m, p.n)
        if not p.epilogue and p.out_dtype == np.float32:
            np.matmul(a, b, out=c)
            return
        y = np.matmul(a, b).reshape(self._out_shape)
        extras = [_typed(buffers[i], d, n).reshape(-1 if n == p.n else self._out_shape)
                  for i, (d, n) in zip(self._pos[2:], self._inputs[2:])]
        if p.epilogue is not None:  # the ScalarFn on the product as the graph had it
            y = p.epilogue(y.astype(p.epilogue.in_dtypes[0], copy=False), *extras)
        c[...] = y.reshape(c.shape)


def build_vendor(prob) -> VendorGemm:
    return VendorGemm(prob)
