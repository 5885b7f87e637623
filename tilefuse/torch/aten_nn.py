"""The ATen op table, neural-network part: convolution, normalisation, pooling, softmax and
attention (tilefuse::attention and the flash kernel's backward). Backward ops with no core
decomposition (convolution, average pooling) are tilefuse VJPs of the forward rules."""
from __future__ import annotations

import math

import numpy as np

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse import nn
from tilefuse.autodiff.rules import split_attention_grads
from tilefuse.ir import primitives as P
from tilefuse.tracer.core import bind1

from .aten import _cast, _index_update, aten, rule, unsupported


# ---- neural-network ops -----------------------------------------------------------------------

def _pair(v, n=2):
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return tuple(v * n if len(v) == 1 else v)


def _conv(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    if transposed:
        unsupported("aten.convolution", "with transposed=True (ConvTranspose) has no tilefuse rule yet")
    nd = tnp.ndim(x) - 2
    if nd not in (1, 2):
        unsupported("aten.convolution", f"over {nd} spatial dimensions has no tilefuse rule "
                    "(conv1d and conv2d do)")
    if nd == 1:  # conv1d as a conv2d over a height of one
        x, w = tnp.expand_dims(x, 2), tnp.expand_dims(w, 2)
        stride, padding, dilation = (1, stride[0]), (0, padding[0]), (1, dilation[0])
    pad = tuple((p, p) for p in _pair(padding))
    y = nn.conv2d(x, w, stride=_pair(stride), padding=pad, dilation=_pair(dilation), groups=groups)
    if bias is not None:
        y = y + tnp.reshape(bias, (1, -1, 1, 1))
    return y[:, :, 0] if nd == 1 else y


@rule(aten.convolution.default)
def _convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    return _conv(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)


@rule(aten.convolution_backward.default)
def _convolution_backward(grad, x, w, bias_sizes, stride, padding, dilation, transposed,
                          output_padding, groups, output_mask):
    _, pullback = tx.vjp(lambda x_, w_: _conv(x_, w_, None, stride, padding, dilation, transposed,
                                              output_padding, groups), x, w)
    gx, gw = pullback(tnp.astype(grad, tnp.result_type(x)))
    gb = tnp.sum(grad, axis=(0,) + tuple(range(2, tnp.ndim(grad)))) if output_mask[2] else None
    return (gx if output_mask[0] else None, gw if output_mask[1] else None, gb)


@rule(aten.native_layer_norm.default)
def _native_layer_norm(x, normalized_shape, weight, bias, eps):
    axes = tuple(range(tnp.ndim(x) - len(normalized_shape), tnp.ndim(x)))
    xf = tnp.astype(x, np.float32) if tnp.result_type(x) in (tnp.float16, tnp.bfloat16) else x
    mean = tnp.mean(xf, axis=axes, keepdims=True)
    c = xf - mean
    rstd = tnp.rsqrt(tnp.mean(c * c, axis=axes, keepdims=True) + eps)
    y = c * rstd
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y, mean, rstd


@rule(aten.native_group_norm.default)
def _native_group_norm(x, weight, bias, n, c, hxw, group, eps):
    shape = tnp.shape(x)
    g = tnp.reshape(x, (n, group, -1))
    mean = tnp.mean(g, axis=-1, keepdims=True)
    d = g - mean
    rstd = tnp.rsqrt(tnp.mean(d * d, axis=-1, keepdims=True) + eps)
    y = tnp.reshape(d * rstd, shape)
    bshape = (1, c) + (1,) * (len(shape) - 2)
    if weight is not None:
        y = y * tnp.reshape(weight, bshape)
    if bias is not None:
        y = y + tnp.reshape(bias, bshape)
    return y, tnp.reshape(mean, (n, group)), tnp.reshape(rstd, (n, group))


def _batch_stats(x):
    axes = (0,) + tuple(range(2, tnp.ndim(x)))
    mean = tnp.mean(x, axis=axes)
    c = x - _per_channel(mean, x)
    return mean, tnp.mean(c * c, axis=axes), axes


def _per_channel(v, x):
    return tnp.reshape(v, (1, -1) + (1,) * (tnp.ndim(x) - 2))


def _normalize(x, mean, rstd, weight, bias):
    y = (x - _per_channel(mean, x)) * _per_channel(rstd, x)
    if weight is not None:
        y = y * _per_channel(weight, x)
    if bias is not None:
        y = y + _per_channel(bias, x)
    return y


@rule(aten._native_batch_norm_legit_functional.default)
def _batch_norm_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        rstd = tnp.rsqrt(running_var + eps)
        empty = tnp.zeros((0,), tnp.result_type(x))
        return _normalize(x, running_mean, rstd, weight, bias), empty, empty, running_mean, running_var
    mean, var, axes = _batch_stats(x)
    rstd = tnp.rsqrt(var + eps)
    n = math.prod(tnp.shape(x)[a] for a in axes)
    new_mean = running_mean * (1 - momentum) + mean * momentum
    new_var = running_var * (1 - momentum) + var * (momentum * n / max(n - 1, 1))
    return _normalize(x, mean, rstd, weight, bias), mean, rstd, new_mean, new_var


@rule(aten._native_batch_norm_legit_no_training.default)
def _batch_norm_eval(x, weight, bias, running_mean, running_var, momentum, eps):
    empty = tnp.zeros((0,), tnp.result_type(x))
    return _normalize(x, running_mean, tnp.rsqrt(running_var + eps), weight, bias), empty, empty


@rule(aten._native_batch_norm_legit.no_stats)
def _batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    mean, var, _ = _batch_stats(x)
    rstd = tnp.rsqrt(var + eps)
    return _normalize(x, mean, rstd, weight, bias), mean, rstd


def _pool_geometry(h, k, s, p, d, ceil_mode):
    span = d * (k - 1) + 1
    if ceil_mode:
        out = -(-(h + 2 * p - span) // s) + 1
        if (out - 1) * s >= h + p:  # the last window must start inside the input or left padding
            out -= 1
    else:
        out = (h + 2 * p - span) // s + 1
    return out, (out - 1) * s + span - h - p  # output size, padding needed on the right


def _windows(x, kernel_size, stride, padding, dilation, ceil_mode, fill):
    """The pooling windows of (N, C, H, W) x: a list of (tap (i, j), (N, C, OH, OW) values) and
    the output size."""
    kh, kw = _pair(kernel_size)
    sh, sw = _pair(stride) if stride else (kh, kw)
    ph, pw = _pair(padding)
    dh, dw = _pair(dilation)
    h, w = tnp.shape(x)[-2:]
    oh, rh = _pool_geometry(h, kh, sh, ph, dh, ceil_mode)
    ow, rw = _pool_geometry(w, kw, sw, pw, dw, ceil_mode)
    widths = ((0, 0),) * (tnp.ndim(x) - 2) + ((ph, max(rh, 0)), (pw, max(rw, 0)))
    if any(lo or hi for lo, hi in widths):
        x = tnp.pad(x, widths, constant_values=fill)
    taps = [((i, j), x[..., i * dh:i * dh + (oh - 1) * sh + 1:sh, j * dw:j * dw + (ow - 1) * sw + 1:sw])
            for i in range(kh) for j in range(kw)]
    return taps, (oh, ow), (sh, sw), (ph, pw), (dh, dw)


def _max_pool(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    taps, (oh, ow), (sh, sw), (ph, pw), (dh, dw) = _windows(
        x, kernel_size, stride, padding, dilation, ceil_mode, -np.inf)
    stacked = tnp.stack([t for _, t in taps], axis=-1)
    out = tnp.max(stacked, axis=-1)
    tap = tnp.argmax(stacked, axis=-1)  # the first maximum in (row, column) order, as torch
    kw = _pair(kernel_size)[1]
    w = tnp.shape(x)[-1]
    rows = tnp.reshape(tnp.arange(oh, dtype=np.int32) * sh - ph, (oh, 1))
    cols = tnp.reshape(tnp.arange(ow, dtype=np.int32) * sw - pw, (1, ow))
    index = (rows + (tap // kw) * dh) * w + cols + (tap % kw) * dw
    return out, tnp.astype(index, np.int64)


@rule(aten.max_pool2d_with_indices.default)
def _max_pool2d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode)


@rule(aten.max_pool2d_with_indices_backward.default)
def _max_pool2d_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    shape = tnp.shape(x)
    planes = math.prod(shape[:-2])
    flat = tnp.zeros((planes, shape[-2] * shape[-1]), tnp.result_type(grad))
    rows = tnp.reshape(tnp.arange(planes, dtype=np.int32), (planes, 1))
    cols = tnp.astype(tnp.reshape(indices, (planes, -1)), np.int32)
    flat = _index_update(flat, (rows, cols), tnp.reshape(grad, (planes, -1)), True)
    return tnp.reshape(flat, shape)


def _avg_pool(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
              divisor_override=None):
    if ceil_mode and not count_include_pad:
        unsupported("aten.avg_pool2d", "with ceil_mode=True and count_include_pad=False has no rule")
    taps, *_ = _windows(x, kernel_size, stride, padding, 1, ceil_mode, 0.0)
    total = taps[0][1]
    for _, t in taps[1:]:
        total = total + t
    if divisor_override:
        return total / divisor_override
    if count_include_pad or not any(_pair(padding)):
        kh, kw = _pair(kernel_size)
        return total * (1.0 / (kh * kw))
    ones = tnp.ones((1,) * (tnp.ndim(x) - 2) + tnp.shape(x)[-2:], tnp.result_type(x))
    count_taps, *_ = _windows(ones, kernel_size, stride, padding, 1, ceil_mode, 0.0)
    count = count_taps[0][1]
    for _, t in count_taps[1:]:
        count = count + t
    return total / count


@rule(aten.avg_pool2d.default)
def _avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    return _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@rule(aten.avg_pool2d_backward.default)
def _avg_pool2d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                         divisor_override):
    _, pullback = tx.vjp(lambda x_: _avg_pool(x_, kernel_size, stride, padding, ceil_mode,
                                              count_include_pad, divisor_override), x)
    return pullback(grad)[0]


def _adaptive_avg(x, output_size):
    h, w = tnp.shape(x)[-2:]
    oh, ow = _pair(output_size)
    if h % oh or w % ow:
        unsupported("aten._adaptive_avg_pool2d", f"from {(h, w)} to {(oh, ow)} (sizes that do not "
                    "divide) has no rule")
    lead = tnp.shape(x)[:-2]
    y = tnp.reshape(x, lead + (oh, h // oh, ow, w // ow))
    return tnp.mean(y, axis=(-3, -1))


@rule(aten._adaptive_avg_pool2d.default)
def _adaptive_avg_pool2d(x, output_size):
    return _adaptive_avg(x, output_size)


@rule(aten._adaptive_avg_pool2d_backward.default)
def _adaptive_avg_pool2d_backward(grad, x):
    _, pullback = tx.vjp(lambda x_: _adaptive_avg(x_, tnp.shape(grad)[-2:]), x)
    return pullback(grad)[0]


def _half_to_float(x, half_to_float):
    return tnp.astype(x, np.float32) if half_to_float else x


@rule(aten._softmax.default)
def _softmax(x, dim, half_to_float=False):
    return nn.softmax(_half_to_float(x, half_to_float), axis=dim)


@rule(aten._log_softmax.default)
def _log_softmax(x, dim, half_to_float=False):
    return nn.log_softmax(_half_to_float(x, half_to_float), axis=dim)


# ---- attention: tilefuse::attention (see compiler.py) is one fused_attention --------------

def _attention_bias(mask, q, k, causal):
    """An additive bias for fused_attention from torch's SDPA mask (bool: True attends) and the
    top-left causal rule (query i sees keys j <= i) where Tq != Tk."""
    tq, tk = tnp.shape(q)[-2], tnp.shape(k)[-2]
    bias = None
    if mask is not None:
        bias = tnp.where(mask, 0.0, -np.inf) if tnp.result_type(mask) == np.bool_ else mask
    if causal and tq != tk:
        tri = tnp.where(tnp.asarray(np.tri(tq, tk, 0, dtype=bool)), 0.0, -np.inf)
        bias = tri if bias is None else bias + tri
    if bias is None:
        return ()
    lead = tnp.ndim(q) - 2
    bias = tnp.reshape(bias, (1,) * (lead + 2 - tnp.ndim(bias)) + tnp.shape(bias))
    return (tnp.astype(bias, tnp.result_type(q)),)


def _attention_params(q, k, mask, causal, scale):
    """fused_attention's bias operand and parameters for torch's SDPA arguments."""
    layout = tuple(range(tnp.ndim(q)))
    return _attention_bias(mask, q, k, causal), {
        "scale": 1.0 / math.sqrt(tnp.shape(q)[-1]) if scale is None else float(scale),
        "causal": bool(causal) and tnp.shape(q)[-2] == tnp.shape(k)[-2],
        "dims": (layout, layout, layout)}


def attention_rule(q, k, v, mask, causal, scale):
    bias, params = _attention_params(q, k, mask, causal, scale)
    return bind1(P.fused_attention, q, k, v, *bias, **params)


def attention_backward_rule(grad, q, k, v, out, mask, causal, scale):
    """dq, dk, dv from the forward's output (no second forward pass), as tilefuse's own VJP."""
    bias, params = _attention_params(q, k, mask, causal, scale)
    dt = tnp.result_type(q)
    packed = bind1(P.fused_attention_bwd, q, k, v, *bias, _cast(out, dt), _cast(grad, dt), **params)
    return tuple(split_attention_grads(packed, q, k, v))


@rule(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _flash_cpu_backward(grad, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                        scale=None):
    """The flash kernel's backward from q, k, v and the output (the core decomposition of its
    forward does not produce the logsumexp this op's arguments name: it is not read)."""
    if dropout_p:
        unsupported("aten._scaled_dot_product_flash_attention_for_cpu_backward", "with dropout")
    return attention_backward_rule(grad, q, k, v, out, attn_mask, is_causal, scale)
