"""The reference evaluator of the kernel IR: numpy, vectorised over the whole index space.

Every index node is an arange shaped to broadcast along its own axis of the space
(parallel axes first, then reduction axes), so an expression evaluates to an array that
broadcasts to the space; a reduce node folds the reduction axes (kept as size 1), so a reduce
inside another's body broadcasts over it. Stores are evaluated first and written after, all at
once; a row store over the whole space, the others over the parallel space. `InterpBackend` runs the compiler's pipeline on
it: a host backend whose buffers are numpy uint8 arrays and whose kernels run here."""
from __future__ import annotations

import math

import numpy as np

from .ir import Kernel, KExpr

_erf = np.frompyfunc(math.erf, 1, 1)


def _c_div(a, b):
    if a.dtype.kind in "iu":  # C semantics: round toward zero (b == 0 is undefined; gives 0)
        return ((a - np.fmod(a, b)) // np.where(b == 0, 1, b)).astype(a.dtype)
    return np.divide(a, b)


def _shift_right_logical(a, b):
    u = np.dtype(f"u{a.dtype.itemsize}")
    return np.right_shift(a.astype(u), b.astype(u)).astype(a.dtype)


def _logistic(x):
    return (1 / (1 + np.exp(-x))).astype(x.dtype)


UNARY = {
    "neg": np.negative, "exp": np.exp, "log": np.log, "log1p": np.log1p, "expm1": np.expm1,
    "tanh": np.tanh, "logistic": _logistic, "sqrt": np.sqrt,
    "rsqrt": lambda x: (1 / np.sqrt(x)).astype(x.dtype), "sin": np.sin, "cos": np.cos,
    "erf": lambda x: np.asarray(_erf(x), x.dtype), "abs": np.abs, "sign": np.sign,
    "floor": np.floor, "ceil": np.ceil, "round": np.round,
    "not": lambda x: np.logical_not(x) if x.dtype == np.bool_ else np.invert(x),
    "is_finite": np.isfinite,
}
BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": _c_div,
    "rem": np.fmod,  # C semantics for ints and floats: the sign of the dividend
    "pow": np.power, "max": np.maximum, "min": np.minimum, "and": np.bitwise_and,
    "or": np.bitwise_or, "xor": np.bitwise_xor, "shift_left": np.left_shift,
    "shift_right_logical": _shift_right_logical, "eq": np.equal, "ne": np.not_equal,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
}
REDUCE = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}
_ACCUMULATE = ("sum", "prod")  # numpy would widen small ints; the IR accumulates in the dtype


def _cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype == np.bool_:
        return x != 0
    if dtype.kind in "iu" and x.dtype.kind not in "iub":  # float -> int truncates (C)
        return np.trunc(x.astype(np.float64)).astype(dtype)
    return x.astype(dtype)


def _lowest(d: np.dtype):
    """The identity of max, as the renderers use it: False, the least int, -inf."""
    return False if d == np.bool_ else np.iinfo(d).min if d.kind in "iu" else -np.inf


def _highest(d: np.dtype):
    return True if d == np.bool_ else np.iinfo(d).max if d.kind in "iu" else np.inf


class _Eval:
    def __init__(self, kernel: Kernel, arrays):
        self.k, self.arrays = kernel, arrays
        self.np_ = len(kernel.shape)
        self.rank = self.np_ + len(kernel.reduce_shape)
        self.full = tuple(kernel.shape) + tuple(kernel.reduce_shape)
        self.memo: dict[KExpr, np.ndarray] = {}

    def axis(self, k: int, n: int) -> np.ndarray:
        sh = [1] * self.rank
        sh[k] = n
        return np.arange(n, dtype=np.int64).reshape(sh)

    def __call__(self, n: KExpr) -> np.ndarray:
        hit = self.memo.get(n)
        if hit is None:
            hit = self.memo[n] = np.asarray(self.eval(n))
        return hit

    def eval(self, n: KExpr):
        op = n.op
        if op == "const":
            return np.asarray(n.arg, n.dtype)
        if op == "idx":
            return self.axis(n.arg, self.k.shape[n.arg])
        if op == "ridx":
            return self.axis(self.np_ + n.arg, self.k.reduce_shape[n.arg])
        if op == "load":
            buf = self.arrays[n.arg]
            off = self(n.src[0])
            if off.size and (off.min() < 0 or off.max() >= buf.size):
                raise IndexError(f"kernel {self.k.name}: load from {self.k.buffers[n.arg].name} at "
                                 f"offsets {off.min()}..{off.max()} outside its {buf.size} elements")
            return buf[off]
        if op == "reduce":
            return self.reduce(n)
        xs = [self(s) for s in n.src]
        if op in UNARY:
            out = UNARY[op](xs[0])
        elif op in BINARY:
            out = BINARY[op](xs[0], xs[1])
        elif op == "select":
            out = np.where(xs[0], xs[1], xs[2])
        elif op == "cast":
            out = _cast(xs[0], n.dtype)
        elif op == "bitcast":
            out = np.ascontiguousarray(xs[0]).view(n.dtype)
        else:
            raise NotImplementedError(f"interp: kernel op {op}")
        return np.asarray(out).astype(n.dtype, copy=False)

    def reduce(self, n: KExpr):
        axes = tuple(range(self.np_, self.rank))
        if 0 in self.k.reduce_shape:  # an empty reduction reads nothing (a device's loop runs no trip)
            v = np.zeros(self.full, n.src[0].dtype)
        else:
            v = np.broadcast_to(self(n.src[0]), self.full)
        if n.arg in REDUCE:
            kw = {"dtype": n.dtype} if n.arg in _ACCUMULATE else {}
            if n.arg in ("max", "min") and v.size == 0:  # bool sum lowers to max: empty is False
                kw["initial"] = _lowest(n.dtype) if n.arg == "max" else _highest(n.dtype)
            return REDUCE[n.arg](v, axis=axes, keepdims=True, **kw)
        # argmax/argmin: the index expression at the first extreme (numpy's rule for ties, NaN)
        flat = v.reshape(tuple(self.k.shape) + (-1,))
        pos = (np.argmax if n.arg == "argmax" else np.argmin)(flat, axis=-1)[..., None]
        index = np.broadcast_to(self(n.src[1]), self.full).reshape(flat.shape)
        return np.take_along_axis(index, pos, axis=-1).reshape(
            tuple(self.k.shape) + (1,) * len(self.k.reduce_shape))


def run_kernel(kernel: Kernel, arrays) -> None:
    """Run `kernel` on flat typed arrays (in kernel.buffers order), writing its outputs in place."""
    assert len(arrays) == len(kernel.buffers), (kernel.name, len(arrays))
    if kernel.size == 0:
        return
    ev = _Eval(kernel, arrays)
    once = tuple(kernel.shape) + (1,) * len(kernel.reduce_shape)
    rows = set(map(id, kernel.row_stores))  # these run over the whole reduction space
    with np.errstate(all="ignore"):
        writes = [(st, *(np.broadcast_to(ev(e), ev.full if id(st) in rows else once).reshape(-1)
                         for e in (st.offset, st.value))) for st in kernel.stores]
    for st, off, val in writes:
        out = arrays[st.buffer]
        if off.size and (off.min() < 0 or off.max() >= out.size):
            raise IndexError(f"kernel {kernel.name}: store to {kernel.buffers[st.buffer].name} at "
                             f"offsets {off.min()}..{off.max()} outside its {out.size} elements")
        if st.mode == "add":
            np.add.at(out, off, val.astype(out.dtype))
        else:
            out[off] = val.astype(out.dtype)


def typed(buf: np.ndarray, dtype, size: int) -> np.ndarray:
    """The first `size` elements of a uint8 buffer, viewed as `dtype`."""
    dtype = np.dtype(dtype)
    return buf[:size * dtype.itemsize].view(dtype)


class InterpBackend:
    """A host backend that runs kernels through the interpreter: the compiler pipeline's test
    double (and a reference for other backends). Buffers are 1-D numpy uint8 arrays; fresh
    allocations are filled with 0xCD so a read of memory nobody wrote shows up in results."""
    kind = "interp"

    def __init__(self):
        self.live_bytes = self.peak_bytes = self.allocations = 0
        self.compiled: list[Kernel] = []

    def compile_kernel(self, kernel: Kernel, device):
        self.compiled.append(kernel)

        def run(buffers):
            run_kernel(kernel, [typed(b, kb.dtype, kb.size) for b, kb in zip(buffers, kernel.buffers)])
        return run

    def compile_kernels(self, kernels, device) -> None:
        pass  # each is interpreted when run

    def alloc(self, nbytes: int, device):
        self.allocations += 1
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return np.full(nbytes, 0xCD, np.uint8)

    def free(self, buf, device) -> None:
        self.live_bytes -= buf.size

    def put(self, host: np.ndarray, device):
        return np.frombuffer(np.ascontiguousarray(host).tobytes(), np.uint8).copy()

    def to_host(self, buf, aval, device) -> np.ndarray:
        return typed(buf, aval.dtype, aval.size).reshape(aval.shape)

    def view(self, buf, offset: int, nbytes: int):
        return buf[offset:offset + nbytes]

    def synchronize(self, device) -> None:
        pass
