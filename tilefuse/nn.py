"""tilefuse.nn: neural-network building blocks as pure functions over parameter pytrees.

Parameters are plain dicts of arrays (`{"w": ..., "b": ...}`), made by the `init_*` helpers
from a random key; layers are functions `layer(params, x)`. Everything is written with
tilefuse.numpy, so it runs on every backend and under jit, grad and vmap. Masked softmaxes
never produce NaN: a fully masked row gets zero weights.
"""
from __future__ import annotations

import math

import numpy as np

import tilefuse.numpy as tnp
from tilefuse import random
from tilefuse.ir.errors import ShapeError, TilefuseError, with_user_line

__all__ = ["normal", "uniform", "glorot_uniform", "xavier_uniform", "glorot_normal", "zeros",
           "ones", "init_linear", "init_embedding", "init_layer_norm", "init_rms_norm",
           "linear", "embedding", "layer_norm", "rms_norm", "relu", "gelu", "silu", "swish",
           "sigmoid", "tanh", "softmax", "log_softmax", "logsumexp", "one_hot", "dropout",
           "dot_product_attention", "causal_mask", "cross_entropy"]


# ---- initialisers: factories of init(key, shape, dtype), as jax.nn.initializers ------------

def normal(stddev: float = 1e-2):
    """Initialiser drawing from N(0, stddev**2)."""
    def init(key, shape, dtype=tnp.float32):
        return random.normal(key, shape, dtype) * stddev
    return init


def uniform(scale: float = 1e-2):
    """Initialiser drawing from U[-scale, scale)."""
    def init(key, shape, dtype=tnp.float32):
        return random.uniform(key, shape, dtype, -scale, scale)
    return init


def _fans(shape):
    if len(shape) < 2:
        raise ShapeError(with_user_line(f"glorot/xavier initialisers need a rank >= 2 shape, got "
                                        f"{tuple(shape)}"))
    receptive = math.prod(shape[:-2])
    return shape[-2] * receptive, shape[-1] * receptive


def glorot_uniform(gain: float = 1.0):
    """Initialiser U[-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)) (shape (..., in, out))."""
    def init(key, shape, dtype=tnp.float32):
        fan_in, fan_out = _fans(shape)
        a = gain * math.sqrt(6.0 / (fan_in + fan_out))
        return random.uniform(key, shape, dtype, -a, a)
    return init


def glorot_normal(gain: float = 1.0):
    """Initialiser N(0, s**2) with s = gain * sqrt(2 / (fan_in + fan_out))."""
    def init(key, shape, dtype=tnp.float32):
        fan_in, fan_out = _fans(shape)
        return random.normal(key, shape, dtype) * (gain * math.sqrt(2.0 / (fan_in + fan_out)))
    return init


xavier_uniform = glorot_uniform


def zeros(key, shape, dtype=tnp.float32):
    """Initialiser of zeros (the key is ignored)."""
    return tnp.zeros(shape, dtype)


def ones(key, shape, dtype=tnp.float32):
    """Initialiser of ones (the key is ignored)."""
    return tnp.ones(shape, dtype)


def init_linear(key, d_in: int, d_out: int, bias: bool = True, w_init=None, dtype=tnp.float32):
    """Parameters of `linear`: {"w": (d_in, d_out)} plus {"b": (d_out,)} when bias."""
    w_init = w_init or glorot_uniform()
    p = {"w": w_init(key, (d_in, d_out), dtype)}
    if bias:
        p["b"] = tnp.zeros((d_out,), dtype)
    return p


def init_embedding(key, vocab: int, dim: int, stddev: float = 0.02, dtype=tnp.float32):
    """An embedding table (vocab, dim) drawn from N(0, stddev**2)."""
    return normal(stddev)(key, (vocab, dim), dtype)


def init_layer_norm(dim: int, dtype=tnp.float32):
    return {"scale": tnp.ones((dim,), dtype), "bias": tnp.zeros((dim,), dtype)}


def init_rms_norm(dim: int, dtype=tnp.float32):
    return {"scale": tnp.ones((dim,), dtype)}


# ---- layers -----------------------------------------------------------------------------------

def linear(params, x):
    """x @ w + b over the last axis of x."""
    y = tnp.matmul(x, params["w"])
    return y + params["b"] if params.get("b") is not None else y


def embedding(table, ids):
    """Rows of `table` (vocab, dim) for integer ids of any shape: (*ids.shape, dim)."""
    return tnp.take(table, ids, axis=0)


def layer_norm(params, x, eps: float = 1e-5):
    """Normalise the last axis to zero mean and unit variance, then scale and shift. params may
    be None (no affine part) or hold "scale" and/or "bias"."""
    mean = tnp.mean(x, axis=-1, keepdims=True)
    c = x - mean
    var = tnp.mean(c * c, axis=-1, keepdims=True)
    y = c * tnp.rsqrt(var + eps)
    params = params or {}
    if params.get("scale") is not None:
        y = y * params["scale"]
    if params.get("bias") is not None:
        y = y + params["bias"]
    return y


def rms_norm(params, x, eps: float = 1e-6):
    """x / rms(x) over the last axis, times params["scale"] (params may be None)."""
    y = x * tnp.rsqrt(tnp.mean(x * x, axis=-1, keepdims=True) + eps)
    if params and params.get("scale") is not None:
        y = y * params["scale"]
    return y


# ---- activations -------------------------------------------------------------------------------

def relu(x):
    return tnp.maximum(x, 0.0)


def gelu(x, approximate: bool = True):
    """GELU: the tanh approximation by default (as JAX), the exact erf form with approximate=False."""
    if approximate:
        return 0.5 * x * (1.0 + tnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))))
    return 0.5 * x * (1.0 + tnp.erf(x * (1.0 / math.sqrt(2.0))))


def sigmoid(x):
    return tnp.sigmoid(x)


def tanh(x):
    return tnp.tanh(x)


def silu(x):
    return x * tnp.sigmoid(x)


swish = silu


# ---- softmax family ---------------------------------------------------------------------------

def _safe_max(x, axis):
    """The max along axis (kept), with no gradient (it cancels) and 0 for rows without any
    finite entry, so subtracting it never makes inf - inf."""
    m = tnp.max(x, axis=axis, keepdims=True)
    m = tnp.stop_gradient(m)
    return tnp.where(tnp.isfinite(m), m, 0.0)


def _masked(x, where):
    return x if where is None else tnp.where(where, x, -np.inf)


def logsumexp(x, axis=-1, keepdims: bool = False, where=None):
    """log(sum(exp(x))) along axis, stable; -inf for empty (all -inf or masked-out) rows."""
    x = _masked(tnp.asarray(x), where)
    m = _safe_max(x, axis)
    out = tnp.log(tnp.sum(tnp.exp(x - m), axis=axis, keepdims=True)) + m
    return out if keepdims else tnp.squeeze(out, axis=axis)


def softmax(x, axis=-1, where=None):
    """exp(x) / sum(exp(x)) along axis. Entries where `where` is False (or x is -inf) get weight
    0, and a row with no entry left gets all zeros, never NaN."""
    x = _masked(tnp.asarray(x), where)
    e = tnp.exp(x - _safe_max(x, axis))
    s = tnp.sum(e, axis=axis, keepdims=True)
    return e / tnp.where(s > 0.0, s, 1.0)


def log_softmax(x, axis=-1, where=None):
    """x - logsumexp(x) along axis, stable (max subtraction); -inf where softmax is 0."""
    x = _masked(tnp.asarray(x), where)
    shifted = x - _safe_max(x, axis)
    s = tnp.sum(tnp.exp(shifted), axis=axis, keepdims=True)
    return shifted - tnp.log(tnp.where(s > 0.0, s, 1.0))  # an empty row stays -inf, not NaN


def one_hot(labels, num_classes: int, dtype=tnp.float32):
    """one_hot(labels)[..., c] = (labels[...] == c)."""
    classes = tnp.arange(num_classes, dtype=tnp.int32)
    return tnp.astype(tnp.equal(tnp.expand_dims(tnp.asarray(labels), -1), classes), dtype)


def cross_entropy(logits, labels, reduction: str = "mean"):
    """Softmax cross entropy of logits (..., C) against integer labels (...): the per-example
    losses ("none"), their "sum", or their "mean" (the default)."""
    logits = tnp.asarray(logits)
    if tnp.shape(labels) != tnp.shape(logits)[:-1]:
        raise ShapeError(with_user_line(f"cross_entropy: labels {tnp.shape(labels)} must have the "
                                        f"logits' shape {tnp.shape(logits)} without the class axis"))
    hit = tnp.equal(tnp.expand_dims(tnp.asarray(labels), -1),
                    tnp.arange(tnp.shape(logits)[-1], dtype=tnp.int32))
    # select, not multiply by a one-hot: 0 * -inf would be NaN for masked-out classes
    picked = tnp.sum(tnp.where(hit, logits, 0.0), axis=-1)
    losses = logsumexp(logits, axis=-1) - picked
    if reduction == "none":
        return losses
    if reduction == "sum":
        return tnp.sum(losses)
    if reduction == "mean":
        return tnp.mean(losses)
    raise TilefuseError(with_user_line(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', "
                                       f"got {reduction!r}"))


# ---- regularisation and attention --------------------------------------------------------------

def dropout(key, x, rate: float, deterministic: bool = False):
    """Zero each element with probability `rate` and scale the rest by 1 / (1 - rate);
    the identity when deterministic (evaluation) or rate == 0."""
    if deterministic or rate == 0.0:
        return x
    if not 0.0 <= rate < 1.0:
        raise TilefuseError(with_user_line(f"dropout: rate must be in [0, 1), got {rate}"))
    keep = random.bernoulli(key, 1.0 - rate, tnp.shape(x))
    return tnp.where(keep, x / (1.0 - rate), 0.0)


def causal_mask(q_len: int, k_len: int | None = None):
    """Bool (q_len, k_len): query i may see keys j <= i + (k_len - q_len) (the last query
    sees every key, as when decoding with a cache)."""
    k_len = q_len if k_len is None else k_len
    return tnp.astype(tnp.tri(q_len, k_len, k=k_len - q_len), tnp.bool_)


def dot_product_attention(q, k, v, mask=None, causal: bool = False, scale: float | None = None):
    """softmax(q kᵀ * scale, masked) v, per head.

    q: (..., Tq, H, D); k and v: (..., Tk, H, D) (JAX's layout: sequence, heads, head dim);
    returns (..., Tq, H, D). mask: bool, broadcastable to (..., H, Tq, Tk), True = attend.
    causal: query i attends to keys j <= i. scale defaults to 1/sqrt(D). A query with no key
    left to attend to gets zeros, never NaN."""
    q, k, v = tnp.asarray(q), tnp.asarray(k), tnp.asarray(v)
    if tnp.ndim(q) < 3 or tnp.ndim(k) != tnp.ndim(q) or tnp.ndim(v) != tnp.ndim(q):
        raise ShapeError(with_user_line(
            f"dot_product_attention: q, k, v need equal ranks >= 3 (..., seq, heads, head_dim), got "
            f"{tnp.shape(q)}, {tnp.shape(k)}, {tnp.shape(v)}"))
    *batch, tq, h, d = tnp.shape(q)
    tk = tnp.shape(k)[-3]
    if tnp.shape(k)[:-3] != tuple(batch) or tnp.shape(k)[-2:] != (h, d) or tnp.shape(v) != tnp.shape(k):
        raise ShapeError(with_user_line(
            f"dot_product_attention: k and v must be (..., Tk, {h}, {d}) with q's batch {tuple(batch)}, "
            f"got k {tnp.shape(k)}, v {tnp.shape(v)} (q {tnp.shape(q)})"))
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    nb = math.prod(batch)
    qb, kb, vb = (tnp.reshape(a, (nb,) + tnp.shape(a)[-3:]) for a in (q, k, v))
    s = tnp.einsum("bqhd,bkhd->bhqk", qb, kb) * scale
    s = tnp.reshape(s, tuple(batch) + (h, tq, tk))
    keep = None
    if mask is not None:
        keep = tnp.astype(mask, tnp.bool_)
    if causal:
        c = causal_mask(tq, tk)
        keep = c if keep is None else tnp.logical_and(keep, c)
    w = softmax(s, axis=-1, where=keep)
    w = tnp.reshape(tnp.broadcast_to(w, tuple(batch) + (h, tq, tk)), (nb, h, tq, tk))
    out = tnp.einsum("bhqk,bkhd->bqhd", w, vb)
    return tnp.reshape(out, tuple(batch) + (tq, h, d))
