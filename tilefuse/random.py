"""tilefuse.random: functional, counter-based random numbers, as in JAX.

A key is a uint32 array of shape (2,). Every draw is Threefry-2x32 (20 rounds, Random123) of a
counter under the key, computed with uint32 primitives only, so the numbers are the same on
every backend, eagerly and under jit. Counters follow JAX's "partitionable" scheme: element i
of a draw of shape S hashes the counter (0, i) (i the row-major flat index), so a draw's values
do not depend on how it is split across devices. Keys are never mutated: `split` or `fold_in`
them to get new ones, and use each key for one draw only.
"""
from __future__ import annotations

import math

import numpy as np

import tilefuse.numpy as tnp
from tilefuse.ir import dtypes as _dt
from tilefuse.ir import primitives as P
from tilefuse.ir.errors import ShapeError, TilefuseError, with_user_line
from tilefuse.tracer.core import bind1

__all__ = ["key", "PRNGKey", "split", "fold_in", "bits", "uniform", "normal", "bernoulli",
           "categorical", "gumbel", "randint", "permutation", "threefry_2x32"]

_U32 = tnp.uint32
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


# ---- Threefry-2x32 ----------------------------------------------------------------------------

def _shift(prim, x, r: int):
    # tnp has no left_shift/right_shift yet: bind the primitives with a same-shaped constant
    return bind1(prim, x, np.full(tnp.shape(x), r, np.uint32))


def _rotl(x, r: int):
    return bind1(P.or_, _shift(P.shift_left, x, r), _shift(P.shift_right_logical, x, 32 - r))


def threefry_2x32(k0, k1, x0, x1, rounds: int = 20):
    """Threefry-2x32 of the counter words (x0, x1) under the key words (k0, k1), elementwise on
    uint32 arrays (the key words are scalars or broadcast); returns the two output words."""
    x0, x1 = tnp.broadcast_to(x0, tnp.shape(x1)), tnp.broadcast_to(x1, tnp.shape(x0))
    ks = (k0, k1, k0 ^ k1 ^ np.uint32(_PARITY))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(rounds // 4):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


# ---- keys ---------------------------------------------------------------------------------------

def _check_key(key, fn: str):
    key = tnp.asarray(key) if isinstance(key, (list, tuple, np.ndarray)) else key
    if tnp.shape(key) != (2,) or np.dtype(key.dtype) != _U32:
        raise TilefuseError(with_user_line(
            f"random.{fn}: expected a key (uint32 array of shape (2,)), got {key.dtype}"
            f"{list(tnp.shape(key))}; make one with tilefuse.random.key(seed), and split a batch of keys "
            "with key[i] or vmap"))
    return key


def key(seed) -> "tnp.ndarray":
    """A key from an integer seed (a Python int, or a traced int32 scalar)."""
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
        seed = int(seed)
        hi = 0 if -2**31 <= seed < 2**31 else (seed >> 32) & 0xFFFFFFFF
        return tnp.asarray(np.array([hi, seed & 0xFFFFFFFF], np.uint32))
    if tnp.shape(seed) != () or not _dt.is_int(np.dtype(seed.dtype)):
        raise TilefuseError(with_user_line(f"random.key: the seed must be an integer scalar, got "
                                           f"{getattr(seed, 'dtype', type(seed).__name__)}"
                                           f"{list(tnp.shape(seed))}"))
    lo = tnp.astype(seed, _U32)
    return tnp.stack([tnp.zeros((), _U32), lo])


PRNGKey = key


def _flat_counter(shape):
    n = math.prod(shape)
    if n >= 2**32:
        raise ShapeError(with_user_line(f"random: a draw of {n} values (shape {tuple(shape)}) needs "
                                        "more than 2**32 counters; split the key and draw in parts"))
    return tnp.arange(n, dtype=_U32)


def _words(key, shape):
    """Two independent uint32 words per element of `shape`."""
    shape = tuple(int(s) for s in shape)
    c = _flat_counter(shape)
    w0, w1 = threefry_2x32(key[0], key[1], tnp.zeros_like(c), c)
    return tnp.reshape(w0, shape), tnp.reshape(w1, shape)


def split(key, num: int = 2):
    """`num` new keys from one, as an array of shape (num, 2)."""
    key = _check_key(key, "split")
    w0, w1 = _words(key, (int(num),))
    return tnp.stack([w0, w1], axis=1)


def fold_in(key, data):
    """A new key from a key and an integer (a step number, a layer index, a device rank)."""
    key = _check_key(key, "fold_in")
    d = tnp.astype(data if not isinstance(data, int) else np.array(data & 0xFFFFFFFF, np.uint32), _U32)
    w0, w1 = threefry_2x32(key[0], key[1], tnp.zeros((1,), _U32), tnp.reshape(d, (1,)))
    return tnp.concatenate([w0, w1])


def bits(key, shape=()):
    """Uniform random uint32 bits of the given shape."""
    key = _check_key(key, "bits")
    w0, w1 = _words(key, _shape(shape))
    return w0 ^ w1


def _shape(shape):
    return (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)


def _float_dtype(dtype, fn):
    d = _dt.canonicalize(dtype)
    if not _dt.is_float(d):
        raise TilefuseError(with_user_line(f"random.{fn}: dtype must be a float dtype, got {d}"))
    return d


def _unit(w, dtype, open_low=False):
    """Floats in [0, 1) from uint32 words, with as many random bits as dtype's mantissa holds
    (so the value is exact in dtype and never rounds up to 1); open_low gives (0, 1)."""
    m = min(_dt.finfo(dtype).nmant, 23)  # float64: 23 bits from one word are plenty here
    n = tnp.astype(_shift(P.shift_right_logical, w, 32 - m), tnp.float32)
    if open_low:
        n = n + 0.5
    return tnp.astype(n * float(2.0 ** -m), dtype)


# ---- distributions ---------------------------------------------------------------------------

def uniform(key, shape=(), dtype=tnp.float32, minval=0.0, maxval=1.0):
    """Uniform floats in [minval, maxval)."""
    key = _check_key(key, "uniform")
    dtype = _float_dtype(dtype, "uniform")
    w0, w1 = _words(key, _shape(shape))
    u = _unit(w0 ^ w1, dtype)
    if isinstance(minval, (int, float)) and isinstance(maxval, (int, float)) and (minval, maxval) == (0, 1):
        return u
    minval, maxval = tnp.astype(minval, dtype), tnp.astype(maxval, dtype)
    # as in JAX: clamp below only (rounding may, rarely, give maxval itself)
    return tnp.maximum(minval, u * (maxval - minval) + minval)


def normal(key, shape=(), dtype=tnp.float32):
    """Standard normal floats (Box-Muller on the two words of each element's counter)."""
    key = _check_key(key, "normal")
    dtype = _float_dtype(dtype, "normal")
    w0, w1 = _words(key, _shape(shape))
    u1 = _unit(w0, tnp.float32, open_low=True)  # in (0, 1): log is finite
    u2 = _unit(w1, tnp.float32)
    z = tnp.sqrt(-2.0 * tnp.log(u1)) * tnp.cos(float(2 * np.pi) * u2)
    return tnp.astype(z, dtype)


def bernoulli(key, p=0.5, shape=None):
    """Booleans that are True with probability p (p broadcasts against shape)."""
    key = _check_key(key, "bernoulli")
    shape = tnp.shape(p) if shape is None else _shape(shape)
    return tnp.less(uniform(key, shape), p)


def gumbel(key, shape=(), dtype=tnp.float32):
    """Standard Gumbel floats: -log(-log(u)) for u in (0, 1)."""
    key = _check_key(key, "gumbel")
    dtype = _float_dtype(dtype, "gumbel")
    w0, w1 = _words(key, _shape(shape))
    u = _unit(w0 ^ w1, tnp.float32, open_low=True)
    return tnp.astype(-tnp.log(-tnp.log(u)), dtype)


def categorical(key, logits, axis: int = -1, shape=None):
    """Indices drawn from the softmax of `logits` along `axis` (the Gumbel-max trick). `shape`,
    if given, is the output shape; it must end with the logits' batch shape."""
    key = _check_key(key, "categorical")
    logits = tnp.asarray(logits)
    axis = axis % tnp.ndim(logits)
    batch = tnp.shape(logits)[:axis] + tnp.shape(logits)[axis + 1:]
    if shape is None:
        shape = batch
    shape = _shape(shape)
    if shape[len(shape) - len(batch):] != batch:
        raise ShapeError(with_user_line(f"random.categorical: shape {shape} must end with the "
                                        f"logits' batch shape {batch}"))
    n = tnp.shape(logits)[axis]
    lead = shape[:len(shape) - len(batch)]
    g = gumbel(key, lead + batch[:axis] + (n,) + batch[axis:], logits.dtype)
    return tnp.argmax(g + logits, axis=len(lead) + axis)


def randint(key, shape, minval, maxval, dtype=tnp.int32):
    """Integers uniform in [minval, maxval) (the span must be below 2**31; the modulo bias is
    below span / 2**31)."""
    key = _check_key(key, "randint")
    r = _shift(P.shift_right_logical, bits(key, shape), 1)  # 31 bits: fits int32 on every backend
    r = tnp.astype(r, tnp.int32)
    lo = tnp.astype(minval, tnp.int32)
    span = tnp.maximum(tnp.astype(maxval, tnp.int32) - lo, 1)
    return tnp.astype(lo + r % span, dtype)


def permutation(key, x, axis: int = 0):
    """A random permutation of range(x) if x is an int, else x shuffled along `axis`.

    Without a sort primitive the ranks of random keys are counted by comparing all pairs:
    O(n**2) work and memory, fine up to a few thousand elements."""
    key = _check_key(key, "permutation")
    n = int(x) if isinstance(x, (int, np.integer)) else tnp.shape(x)[axis]
    if n > 8192:
        raise TilefuseError(with_user_line(
            f"random.permutation: n={n} is too large for the all-pairs ranking (O(n^2) memory); "
            "permute on the host with numpy, or draw batches with random.randint"))
    r = tnp.astype(_shift(P.shift_right_logical, bits(key, (n,)), 1), tnp.int32)
    i = tnp.arange(n, dtype=tnp.int32)
    # rank_i = #{j : r_j < r_i, or r_j == r_i and j < i}: distinct ranks, uniformly permuted
    before = tnp.logical_or(tnp.less(r[None, :], r[:, None]),
                            tnp.logical_and(tnp.equal(r[None, :], r[:, None]),
                                            tnp.less(i[None, :], i[:, None])))
    perm = tnp.sum(tnp.astype(before, tnp.int32), axis=1)
    if isinstance(x, (int, np.integer)):
        return perm
    return tnp.take(x, perm, axis=axis)
