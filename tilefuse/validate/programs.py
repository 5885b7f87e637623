"""Whole programs for cross-backend validation: the fusion patterns (elementwise chains,
reductions with their prologue and epilogue, gathers and scatters, data movement, backward
passes), the GEMM forms (transposed, batched, with bias / activation / residual epilogues,
16-bit) and the attention forms (plain, causal, masked, unequal lengths, the gradient). Each runs
jitted on the device under test and on `ref`, the numpy interpreter, and the outputs are compared
with per-dtype tolerances."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable

import ml_dtypes
import numpy as np

import tilefuse as tx
import tilefuse.nn as nn
import tilefuse.numpy as tnp

from .compare import Comparison, tolerance_for

F32, F16, BF16, F64 = (np.dtype(d) for d in (np.float32, np.float16, ml_dtypes.bfloat16, np.float64))


@dataclass
class Program:
    """A function, how to make its arguments in a dtype, and tolerances overriding the defaults."""
    name: str
    group: str  # fusion | gemm | attention
    fn: Callable
    args: Callable  # (rng, dtype) -> list of numpy arrays
    dtypes: tuple = (F32,)
    tol: dict = field(default_factory=dict)  # dtype -> (rtol, atol)

    def __str__(self):
        return self.name


def _r(rng, dtype, *shape, lo=-2.0, hi=2.0):
    return rng.uniform(lo, hi, shape).astype(dtype)


# written out as users write them (the fusion tests use them too)
def softmax(x):
    e = tnp.exp(x - tnp.max(x, axis=-1, keepdims=True))
    return e / tnp.sum(e, axis=-1, keepdims=True)


def layernorm(x, g, b):
    mu = tnp.mean(x, axis=-1, keepdims=True)
    var = tnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) / tnp.sqrt(var + 1e-5) * g + b


def _chain(x):
    return tnp.tanh(x * 1.7 + 0.3) * nn.sigmoid(x) + tnp.exp(-x * x) * 0.5


def shapes_and_indexing(x, y):
    z = tnp.concatenate([x, tnp.flip(y, axis=0), x[:, ::2]], axis=1)
    return tnp.pad(z, ((1, 0), (2, 1))), tnp.reshape(tnp.transpose(z), (-1,))[3:11], tnp.argmax(z, axis=1)


def int_and_bool(a, b):
    q = a // tnp.where(b == 0, 1, b)
    return q, (a % 3 == 0) | (b > 1), tnp.sum(a * b, axis=0), tnp.arange(5) * a[0, 0]


def _mlp_loss(w1, b1, w2, x):
    h = nn.gelu(x @ w1 + b1)
    return tnp.mean((h @ w2) ** 2)


def _embedding_grad(table, ids, w):
    return tx.grad(lambda t: tnp.sum(tnp.take(t, ids, axis=0) * w))(table)


def _ids(rng, n, *shape):
    return rng.integers(0, n, shape).astype(np.int32)


def _attn(causal=False, mask=False):
    def f(q, k, v):
        m = None
        if mask:
            tq, tk = tnp.shape(q)[-3], tnp.shape(k)[-3]
            m = (tnp.arange(tk)[None, :] % 3 != 1) | (tnp.arange(tq)[:, None] == 0)
        return nn.dot_product_attention(q, k, v, mask=m, causal=causal)
    return f


def _qkv(b, tq, tk, h, d):
    return lambda r, dt: [_r(r, dt, b, tq, h, d), _r(r, dt, b, tk, h, d), _r(r, dt, b, tk, h, d)]


def _attn_by_hand(q, k, v):
    s = tnp.einsum("bqd,bkd->bqk", q, k) * 0.35
    return tnp.einsum("bqk,bkd->bqd", softmax(s), v)


def _attn_grad(q, k, v):
    return tx.grad(lambda q, k, v: tnp.sum(nn.dot_product_attention(q, k, v, causal=True) ** 2),
                   argnums=(0, 1, 2))(q, k, v)


LOOSE16 = {F16: (1e-2, 1e-2), BF16: (3e-2, 5e-2)}

PROGRAMS = [
    # fusion patterns
    Program("elementwise chain", "fusion", _chain, lambda r, d: [_r(r, d, 33, 65)], (F32, F16, BF16, F64),
            LOOSE16),
    Program("softmax", "fusion", softmax, lambda r, d: [_r(r, d, 7, 129)], (F32, BF16), LOOSE16),
    Program("layernorm", "fusion", layernorm, lambda r, d: [_r(r, d, 5, 96), _r(r, d, 96), _r(r, d, 96)],
            (F32, BF16), LOOSE16),
    Program("bias + relu", "fusion", lambda x, b: nn.relu(x + b),
            lambda r, d: [_r(r, d, 6, 40), _r(r, d, 40)]),
    Program("column mean removed", "fusion", lambda x: x - tnp.mean(x, axis=0),
            lambda r, d: [_r(r, d, 300, 24)]),
    Program("row norm", "fusion", lambda x: tnp.sqrt(tnp.sum(x * x, axis=-1)) / 3.0,
            lambda r, d: [_r(r, d, 9, 1000)], (F32, F64)),
    Program("argmax of an expression", "fusion", lambda x: tnp.argmax(x * x - 1.0, axis=1),
            lambda r, d: [_r(r, d, 6, 50)]),
    Program("embedding", "fusion", lambda t, i: tnp.take(t, i, axis=0) * 2.0 + 1.0,
            lambda r, d: [_r(r, d, 20, 8), _ids(r, 20, 4, 7)]),
    Program("embedding gradient", "fusion", _embedding_grad,
            lambda r, d: [_r(r, d, 20, 8), _ids(r, 20, 4, 7), _r(r, d, 4, 7, 8)]),
    Program("slices, concatenation, padding", "fusion", shapes_and_indexing,
            lambda r, d: [_r(r, d, 3, 4), _r(r, d, 3, 2)]),
    Program("ints and bools", "fusion", int_and_bool,
            lambda r, d: [r.integers(-9, 9, (3, 5)).astype(np.int32),
                          r.integers(-2, 3, (3, 5)).astype(np.int32)]),
    Program("cross entropy and its gradient", "fusion",
            lambda z, y: tx.value_and_grad(lambda z: nn.cross_entropy(z, y))(z),
            lambda r, d: [_r(r, d, 8, 31), _ids(r, 31, 8)]),
    # accurate sums (blocked; in order they were 0.1% off at these lengths) and wrapping integers
    Program("long sums", "fusion", lambda x: (tnp.sum(x), tnp.sum(x.reshape(-1, 4), axis=0), tnp.mean(x)),
            lambda r, d: [r.uniform(0.0, 1.0, 1 << 20).astype(d)], (F32,), {F32: (1e-6, 0.0)}),
    Program("integer overflow wraps", "fusion",
            lambda a: ((a + 1) > a, a * 3 + 7, -a, tnp.sum(a, axis=0)),
            lambda r, d: [np.array([[2**31 - 1, -2**31, 5], [2**31 - 1, 2**30, -1]], np.int32)], (np.int32,)),
    Program("MLP gradient", "fusion", tx.grad(_mlp_loss, argnums=(0, 1, 2)),
            lambda r, d: [_r(r, d, 16, 32) * 0.2, _r(r, d, 32), _r(r, d, 32, 4) * 0.2, _r(r, d, 10, 16)]),
    # GEMM forms
    Program("matmul 37x61x45", "gemm", tnp.matmul, lambda r, d: [_r(r, d, 37, 61), _r(r, d, 61, 45)],
            (F32, F16, BF16), LOOSE16),
    Program("matmul, A transposed", "gemm", lambda a, b: a.T @ b,
            lambda r, d: [_r(r, d, 61, 37), _r(r, d, 61, 45)]),
    Program("matmul, B transposed", "gemm", lambda a, b: a @ b.T,
            lambda r, d: [_r(r, d, 37, 61), _r(r, d, 45, 61)]),
    Program("batched matmul", "gemm", tnp.matmul, lambda r, d: [_r(r, d, 3, 17, 20), _r(r, d, 3, 20, 9)],
            (F32, BF16), LOOSE16),
    Program("matmul + bias + relu", "gemm", lambda x, w, b: nn.relu(x @ w + b),
            lambda r, d: [_r(r, d, 33, 48), _r(r, d, 48, 40), _r(r, d, 40)]),
    Program("matmul + bias + gelu", "gemm", lambda x, w, b: nn.gelu(x @ w + b),
            lambda r, d: [_r(r, d, 2, 9, 48), _r(r, d, 48, 40), _r(r, d, 40)], (F32, BF16), LOOSE16),
    Program("matmul + residual", "gemm", lambda x, w, res: x @ w + res,
            lambda r, d: [_r(r, d, 20, 64), _r(r, d, 64, 30), _r(r, d, 20, 30)]),
    Program("matrix-vector", "gemm", tnp.matmul, lambda r, d: [_r(r, d, 50, 70), _r(r, d, 70)]),
    Program("matmul 1x1 and K=1", "gemm", lambda a, b, c, e: (a @ b, c @ e),
            lambda r, d: [_r(r, d, 1, 1), _r(r, d, 1, 1), _r(r, d, 9, 1), _r(r, d, 1, 7)]),
    # attention forms
    Program("attention", "attention", _attn(), _qkv(2, 9, 9, 2, 8), (F32, BF16), LOOSE16),
    Program("causal attention", "attention", _attn(causal=True), _qkv(2, 33, 33, 2, 16)),
    Program("masked attention", "attention", _attn(mask=True), _qkv(1, 7, 12, 3, 8)),
    Program("causal attention, fewer queries", "attention", _attn(causal=True), _qkv(2, 5, 9, 1, 8)),
    Program("attention by hand (einsum, softmax)", "attention", _attn_by_hand,
            lambda r, d: [_r(r, d, 2, 10, 8), _r(r, d, 2, 12, 8), _r(r, d, 2, 12, 8)]),
    Program("attention gradient", "attention", _attn_grad, _qkv(1, 16, 16, 2, 8)),
]
# float32 sums of K products in another order than numpy's differ by about K·eps·max|a·b|
for _p in PROGRAMS:
    if _p.group != "fusion":
        _p.tol = {F32: (2e-5, 3e-5), **_p.tol}
PROGRAMS_BY_NAME = {p.name: p for p in PROGRAMS}
assert len(PROGRAMS_BY_NAME) == len(PROGRAMS), "program names must be unique"


def comparisons(prog: Program, dtype, device):
    """The program's outputs on `device` against the same program on `ref`."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(zlib.crc32(prog.name.encode()))
    args = prog.args(rng, dtype)
    want = tx.tree_leaves(tx.jit(prog.fn, device="ref")(*args))
    got = tx.tree_leaves(tx.jit(prog.fn, device=device)(*args))
    assert len(got) == len(want), f"{prog}: {len(got)} outputs, the reference has {len(want)}"
    rtol, atol = tolerance_for(prog.tol, dtype)
    for i, (g, w) in enumerate(zip(got, want)):
        assert isinstance(g, tx.Array) and g.device is tx.get_device(device), f"{prog}: output {i} device"
        w = np.asarray(w)
        yield Comparison(f"{prog} output {i}", g, w, w.dtype, rtol, atol)
