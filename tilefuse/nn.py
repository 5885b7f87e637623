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
from tilefuse.ir import primitives as P
from tilefuse.ir.errors import ShapeError, TilefuseError, with_user_line
from tilefuse.tracer.core import bind1

__all__ = ["normal", "uniform", "glorot_uniform", "xavier_uniform", "glorot_normal", "zeros",
           "ones", "init_linear", "init_embedding", "init_layer_norm", "init_rms_norm",
           "linear", "embedding", "layer_norm", "rms_norm", "relu", "gelu", "silu", "swish",
           "sigmoid", "tanh", "softmax", "log_softmax", "logsumexp", "one_hot", "dropout",
           "dot_product_attention", "causal_mask", "cross_entropy", "conv2d"]


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
    """max(x, 0); its derivative at 0 is 0, as in JAX and PyTorch (max's tie rule would give 1/2),
    and NaN stays NaN."""
    x = tnp.asarray(x)
    return tnp.where(x > 0, x, tnp.where(x == x, tnp.zeros((), x.dtype), x))


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


def _shift_max(x, axis):
    """The max along axis (kept, no gradient) to subtract before exp; 0 for rows that are all
    -inf (masked out), so they give zeros. A +inf or NaN max stays: the row is NaN, as in JAX."""
    m = tnp.stop_gradient(tnp.max(x, axis=axis, keepdims=True))
    return tnp.where(m == -np.inf, 0.0, m)


def softmax(x, axis=-1, where=None):
    """exp(x) / sum(exp(x)) along axis. Entries where `where` is False (or x is -inf) get weight
    0, and a row with no entry left gets all zeros, never NaN; a row holding +inf or NaN is all
    NaN (JAX's result)."""
    x = _masked(tnp.asarray(x), where)
    e = tnp.exp(x - _shift_max(x, axis))
    s = tnp.sum(e, axis=axis, keepdims=True)
    return e / tnp.where(s == 0.0, 1.0, s)


def log_softmax(x, axis=-1, where=None):
    """x - logsumexp(x) along axis, stable (max subtraction); -inf where softmax is 0, NaN on
    rows holding +inf or NaN (as JAX)."""
    x = _masked(tnp.asarray(x), where)
    shifted = x - _shift_max(x, axis)
    s = tnp.sum(tnp.exp(shifted), axis=axis, keepdims=True)
    return shifted - tnp.log(tnp.where(s == 0.0, 1.0, s))  # an empty row stays -inf, not NaN


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


# ---- convolution -------------------------------------------------------------------------------

def _conv_pair(v, name: str) -> tuple[int, int]:
    pair = (v, v) if isinstance(v, (int, np.integer)) else tuple(v)
    if len(pair) != 2 or not all(isinstance(p, (int, np.integer)) and p >= 1 for p in pair):
        raise TilefuseError(with_user_line(f"conv2d: {name} must be a positive int or a pair of "
                                           f"them, got {v!r}"))
    return int(pair[0]), int(pair[1])


def _conv_padding(padding, size, kernel, stride, dilation) -> tuple:
    """((top, bottom), (left, right)) from an int, a pair, a pair of pairs, 'SAME' or 'VALID'.
    'SAME' gives ceil(size / stride) outputs, the odd pixel of padding going after (as JAX)."""
    if isinstance(padding, str) and padding.upper() in ("SAME", "VALID"):
        if padding.upper() == "VALID":
            return (0, 0), (0, 0)
        pads = []
        for n, k, s, d in zip(size, kernel, stride, dilation):
            total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
            pads.append((total // 2, total - total // 2))
        return tuple(pads)
    if isinstance(padding, (int, np.integer)):
        pads = ((padding, padding),) * 2
    else:
        pads = tuple((p, p) if isinstance(p, (int, np.integer)) else tuple(p) for p in padding)
    if len(pads) != 2 or any(len(p) != 2 or not all(isinstance(q, (int, np.integer)) and q >= 0
                                                     for q in p) for p in pads):
        raise TilefuseError(with_user_line(
            f"conv2d: padding must be 'SAME', 'VALID', an int >= 0, a pair of them or a pair of "
            f"(before, after) pairs, got {padding!r}"))
    return tuple((int(lo), int(hi)) for lo, hi in pads)


def conv2d(x, w, stride=1, padding=0, dilation=1, groups: int = 1):
    """2-D convolution (cross-correlation, as in every framework) of x (N, C, H, W) with weights
    w (O, C / groups, KH, KW): (N, O, OH, OW). stride and dilation are ints or (h, w) pairs;
    padding is an int, an (h, w) pair, ((top, bottom), (left, right)), 'SAME' or 'VALID'.

    One conv primitive (lax.conv_general_dilated's), run as an implicit GEMM that reads the windows
    of x where they lie (ir/kernel/conv.py); its gradients are convolutions too."""
    dtype = tnp.result_type(x, w)
    x, w = tnp.astype(tnp.asarray(x), dtype), tnp.astype(tnp.asarray(w), dtype)
    shapes = f"x {tnp.shape(x)}, w {tnp.shape(w)}"
    if tnp.ndim(x) != 4 or tnp.ndim(w) != 4:
        raise ShapeError(with_user_line(f"conv2d: x must be (N, C, H, W) and w (O, C/groups, KH, KW), "
                                        f"got {shapes}"))
    n, c, h, wd = tnp.shape(x)
    o, cg, kh, kw = tnp.shape(w)
    if not isinstance(groups, (int, np.integer)) or groups < 1 or c % groups or o % groups:
        raise ShapeError(with_user_line(f"conv2d: groups={groups!r} must be a positive int dividing "
                                        f"the input channels {c} and the output channels {o} ({shapes})"))
    if cg * groups != c:
        raise ShapeError(with_user_line(f"conv2d: w has {cg} input channels, but x's {c} channels in "
                                        f"{groups} group(s) need {c // groups} ({shapes})"))
    (sh, sw), (dh, dw) = _conv_pair(stride, "stride"), _conv_pair(dilation, "dilation")
    pads = _conv_padding(padding, (h, wd), (kh, kw), (sh, sw), (dh, dw))
    hp, wp = h + sum(pads[0]), wd + sum(pads[1])
    eh, ew = (kh - 1) * dh + 1, (kw - 1) * dw + 1  # the dilated kernel's extent
    if eh > hp or ew > wp or kh * kw == 0:
        raise ShapeError(with_user_line(
            f"conv2d: the kernel ({kh}, {kw}) spans ({eh}, {ew}) with dilation ({dh}, {dw}), more "
            f"than the padded input ({hp}, {wp}) ({shapes}, padding {pads})"))
    return bind1(P.conv, x, w, window_strides=(sh, sw), padding=pads, lhs_dilation=(1, 1),
                 rhs_dilation=(dh, dw), dimension_numbers=((0, 1, 2, 3),) * 3, feature_group_count=int(groups),
                 batch_group_count=1)


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
    """softmax(q kᵀ * scale, masked) v, per head, as one fused_attention (FlashAttention on the
    CPU: the Tq x Tk scores are never stored).

    Layout (JAX's): q is (..., Tq, H, D), k is (..., Tk, H, D), v is (..., Tk, H, Dv); returns
    (..., Tq, H, Dv). mask: bool, broadcastable to (..., H, Tq, Tk), True = attend (a float mask
    is an additive bias instead, -inf masking out). causal: query i attends to keys
    j <= i + Tk - Tq. scale defaults to 1/sqrt(D). A query with no key left to attend to gets
    zeros, never NaN."""
    q, k, v = tnp.asarray(q), tnp.asarray(k), tnp.asarray(v)
    if tnp.ndim(q) < 3 or tnp.ndim(k) != tnp.ndim(q) or tnp.ndim(v) != tnp.ndim(q):
        raise ShapeError(with_user_line(
            f"dot_product_attention: q, k, v need equal ranks >= 3 (..., seq, heads, head_dim), got "
            f"{tnp.shape(q)}, {tnp.shape(k)}, {tnp.shape(v)}"))
    *batch, tq, h, d = tnp.shape(q)
    tk = tnp.shape(k)[-3]
    if tnp.shape(k)[:-3] != tuple(batch) or tnp.shape(k)[-2:] != (h, d) or \
            tnp.shape(v)[:-1] != tnp.shape(k)[:-1]:
        raise ShapeError(with_user_line(
            f"dot_product_attention: k and v must be (..., Tk, {h}, {d}) with q's batch {tuple(batch)}, "
            f"got k {tnp.shape(k)}, v {tnp.shape(v)} (q {tnp.shape(q)})"))
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    nb = math.prod(batch)
    qb, kb, vb = (tnp.reshape(a, (nb,) + tnp.shape(a)[-3:]) for a in (q, k, v))
    bias = () if mask is None else (_attention_bias(mask, tuple(batch), h, tq, tk, tnp.result_type(q)),)
    layout = (0, 2, 1, 3)  # (batch, heads) are the batch axes, then sequence, then features
    out = bind1(P.fused_attention, qb, kb, vb, *bias, scale=scale, causal=bool(causal),
                dims=(layout, layout, layout))
    return tnp.reshape(out, tuple(batch) + (tq, h, tnp.shape(v)[-1]))


def _attention_bias(mask, batch: tuple, h: int, tq: int, tk: int, dtype):
    """A mask broadcastable to (*batch, H, Tq, Tk) as fused_attention's additive bias of shape
    (prod(batch) or 1, H or 1, Tq or 1, Tk or 1)."""
    mask = tnp.asarray(mask)
    want = batch + (h, tq, tk)
    shape = tnp.shape(mask)
    if len(shape) > len(want) or any(m not in (1, w) for m, w in zip(shape[::-1], want[::-1])):
        raise ShapeError(with_user_line(
            f"dot_product_attention: the mask of shape {shape} does not broadcast to the scores' "
            f"shape {want} (..., heads, Tq, Tk)"))
    shape = (1,) * (len(want) - len(shape)) + shape
    mask = tnp.reshape(mask, shape)
    if any(n != 1 for n in shape[:len(batch)]):
        mask = tnp.broadcast_to(mask, batch + shape[len(batch):])
        lead = math.prod(batch)
    else:
        lead = 1
    mask = tnp.reshape(mask, (lead,) + shape[len(batch):])
    if tnp.result_type(mask) == tnp.bool_:
        mask = tnp.where(mask, 0.0, -np.inf)
    return tnp.astype(mask, dtype)
