"""The strided view of a fused attention equation, shared by every backend's FlashAttention.

`fused_attention` (and its backward) computes softmax(scale · q kᵀ + bias) v per batch index,
over operands in any layout its `dims` name: each operand has batch axes, a sequence axis and a
feature axis, at element strides the Spec records, so no operand is transposed or copied
beforehand. Backends address batch index t either through the batch axes' strides (OpenCL and
CUDA compute them in the kernel) or through a table of per-batch offsets (the CPU template bakes
`batch_offsets()` into its module)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from tilefuse.ir import primitives as P

from .lower import strides


@dataclass(frozen=True)
class Spec:
    """Everything an attention kernel is specialised on."""
    bwd: bool
    batch: tuple     # the batch axes' sizes (row-major batch index t)
    sq: int
    sk: int
    d: int
    dv: int
    scale: float
    causal: bool
    has_bias: bool
    batch_strides: tuple  # per operand q, k, v, out, bias: element strides of the batch axes
    rows: tuple      # element strides between sequence positions of q, k, v, out
    bias_strides: tuple  # bias strides along Sq and Sk (0: broadcast)
    sizes: tuple     # elements of q and k: where dk and dv start in the backward's packed result

    @property
    def nb(self) -> int:
        return int(np.prod(self.batch, dtype=np.int64))

    @property
    def offset(self) -> int:  # Sk - Sq: query i sees keys j <= i + offset when causal
        return self.sk - self.sq

    @cached_property
    def batch_offsets(self) -> tuple:
        """Per batch index t: the element offsets of (q, k, v, out, bias) at its first position."""
        idx = np.indices(self.batch).reshape(len(self.batch), self.nb)
        cols = [sum((i * s for i, s in zip(idx, st)), np.zeros(self.nb, np.int64)) for st in self.batch_strides]
        return tuple(tuple(int(x) for x in row) for row in np.stack(cols, axis=1))


def spec_of(eqn) -> Spec:
    q, k, v = (a.aval for a in eqn.inputs[:3])
    dims = eqn.params["dims"]
    bwd = eqn.prim is P.fused_attention_bwd
    has_bias = len(eqn.inputs) == (6 if bwd else 4)
    out_shape = list(q.shape)
    out_shape[dims[0][-1]] = v.shape[dims[2][-1]]
    shapes = (q.shape, k.shape, v.shape, tuple(out_shape))
    layouts = (dims[0], dims[1], dims[2], dims[0])
    batch_strides = [tuple(strides(s)[a] for a in dd[:-2]) for s, dd in zip(shapes, layouts)]
    rows = tuple(strides(s)[dd[-2]] for s, dd in zip(shapes, layouts))
    bias_strides = (0, 0)
    if has_bias:
        b = eqn.inputs[3].aval
        st = [s if n != 1 else 0 for s, n in zip(strides(b.shape), b.shape)]  # 0: broadcast
        batch_strides.append(tuple(st[:-2]))
        bias_strides = (st[-2], st[-1])
    else:
        batch_strides.append((0,) * (len(dims[0]) - 2))
    return Spec(bwd, tuple(q.shape[a] for a in dims[0][:-2]), q.shape[dims[0][-2]],
                k.shape[dims[1][-2]], q.shape[dims[0][-1]], v.shape[dims[2][-1]],
                float(eqn.params["scale"]), bool(eqn.params["causal"]), has_bias,
                tuple(batch_strides), rows, bias_strides, (q.size, k.size))
