"""Layers as (init_fun, apply_fun) pairs, as jax.example_libraries.stax:

    init_fun, apply_fun = stax.serial(stax.Dense(512), stax.Relu, stax.Dense(10), stax.LogSoftmax)
    out_shape, params = init_fun(rng, (-1, 784))
    logits = apply_fun(params, inputs)

init_fun(rng, input_shape) -> (output_shape, params); apply_fun(params, inputs, **kwargs).
Keys are tilefuse.random keys. Convolutions take NHWC inputs and HWIO kernels (stax's
defaults) and run as tilefuse.nn.conv2d."""

from __future__ import annotations

import math

import tilefuse.numpy as tnp
from tilefuse import nn, random

__all__ = [
    "Dense",
    "Conv",
    "Relu",
    "Tanh",
    "Sigmoid",
    "Elu",
    "LeakyRelu",
    "Selu",
    "Gelu",
    "Softplus",
    "LogSoftmax",
    "Softmax",
    "Exp",
    "Log",
    "Identity",
    "Flatten",
    "Dropout",
    "BatchNorm",
    "AvgPool",
    "MaxPool",
    "SumPool",
    "serial",
    "parallel",
    "FanOut",
    "FanInSum",
    "FanInConcat",
    "elementwise",
    "shape_dependent",
    "glorot_normal",
    "normal",
]


def glorot_normal(in_axis=-2, out_axis=-1, scale=1.0):
    def init(key, shape, dtype=tnp.float32):
        fan_in, fan_out = shape[in_axis], shape[out_axis]
        rest = math.prod(
            s for i, s in enumerate(shape) if i not in (in_axis % len(shape), out_axis % len(shape))
        )
        std = scale * math.sqrt(2.0 / ((fan_in + fan_out) * rest))
        return random.normal(key, shape, dtype) * std

    return init


def normal(stddev=1e-2):
    return lambda key, shape, dtype=tnp.float32: random.normal(key, shape, dtype) * stddev


def Dense(out_dim, W_init=None, b_init=None):
    W_init = W_init or glorot_normal()
    b_init = b_init or normal(1e-6)

    def init_fun(rng, input_shape):
        k1, k2 = random.split(rng)
        return tuple(input_shape[:-1]) + (out_dim,), (
            W_init(k1, (input_shape[-1], out_dim)),
            b_init(k2, (out_dim,)),
        )

    def apply_fun(params, inputs, **kwargs):
        W, b = params
        return tnp.matmul(inputs, W) + b

    return init_fun, apply_fun


def Conv(out_chan, filter_shape, strides=None, padding="VALID", W_init=None, b_init=None):
    """2-D convolution of NHWC inputs with HWIO kernels."""
    W_init = W_init or glorot_normal(2, 3)
    b_init = b_init or normal(1e-6)
    strides = tuple(strides or (1,) * len(filter_shape))

    def init_fun(rng, input_shape):
        k1, k2 = random.split(rng)
        kh, kw = filter_shape
        W = W_init(k1, (kh, kw, input_shape[3], out_chan))
        b = b_init(k2, (1, 1, 1, out_chan))
        n, h, w, _ = input_shape
        if padding == "SAME":
            oh, ow = -(-h // strides[0]), -(-w // strides[1])
        else:
            oh, ow = (h - kh) // strides[0] + 1, (w - kw) // strides[1] + 1
        return (n, oh, ow, out_chan), (W, b)

    def apply_fun(params, inputs, **kwargs):
        W, b = params
        x = tnp.transpose(inputs, (0, 3, 1, 2))
        y = nn.conv2d(x, tnp.transpose(W, (3, 2, 0, 1)), stride=strides, padding=padding)
        return tnp.transpose(y, (0, 2, 3, 1)) + b

    return init_fun, apply_fun


def elementwise(fun, **fun_kwargs):
    init_fun = lambda rng, input_shape: (input_shape, ())  # noqa: E731
    apply_fun = lambda params, inputs, **kwargs: fun(inputs, **fun_kwargs)  # noqa: E731
    return init_fun, apply_fun


def _elu(x, alpha=1.0):
    return tnp.where(x > 0, x, alpha * tnp.expm1(tnp.where(x > 0, 0.0, x)))


def _selu(x):
    return 1.0507009873554805 * _elu(x, 1.6732632423543772)


def _leaky_relu(x, negative_slope=0.01):
    return tnp.where(x >= 0, x, negative_slope * x)


Relu = elementwise(nn.relu)
Tanh = elementwise(tnp.tanh)
Sigmoid = elementwise(tnp.sigmoid)
Elu = elementwise(_elu)
Selu = elementwise(_selu)
Gelu = elementwise(nn.gelu)
Softplus = elementwise(lambda x: tnp.logaddexp(x, 0.0))
Exp = elementwise(tnp.exp)
Log = elementwise(tnp.log)
LogSoftmax = elementwise(nn.log_softmax, axis=-1)
Softmax = elementwise(nn.softmax, axis=-1)


def LeakyRelu(negative_slope=0.01):
    return elementwise(_leaky_relu, negative_slope=negative_slope)


def _identity_layer():
    return (lambda rng, input_shape: (input_shape, ())), (lambda params, inputs, **kwargs: inputs)


Identity = _identity_layer()


def _flatten_layer():
    def init_fun(rng, input_shape):
        return (input_shape[0], math.prod(input_shape[1:])), ()

    def apply_fun(params, inputs, **kwargs):
        return tnp.reshape(inputs, (tnp.shape(inputs)[0], -1))

    return init_fun, apply_fun


Flatten = _flatten_layer()


def Dropout(rate, mode="train"):
    """Keeps each input with probability `rate` (stax's convention), scaled by 1/rate; pass
    rng= to apply_fun in training mode."""

    def init_fun(rng, input_shape):
        return input_shape, ()

    def apply_fun(params, inputs, **kwargs):
        rng = kwargs.get("rng")
        if mode != "train":
            return inputs
        if rng is None:
            raise ValueError("Dropout in train mode needs apply_fun(..., rng=key)")
        keep = random.bernoulli(rng, rate, tnp.shape(inputs))
        return tnp.where(keep, inputs / rate, 0.0)

    return init_fun, apply_fun


def BatchNorm(axis=(0, 1, 2), epsilon=1e-5, center=True, scale=True):
    """Normalises over `axis` with the batch's statistics, then a learned scale and shift."""

    def init_fun(rng, input_shape):
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        shape = tuple(d for i, d in enumerate(input_shape) if i not in axes)
        return input_shape, (tnp.zeros(shape) if center else (), tnp.ones(shape) if scale else ())

    def apply_fun(params, x, **kwargs):
        beta, gamma = params
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        mean = tnp.mean(x, axis=axes, keepdims=True)
        var = tnp.var(x, axis=axes, keepdims=True)
        z = (x - mean) / tnp.sqrt(var + epsilon)
        keep = tuple(slice(None) if i not in axes else None for i in range(tnp.ndim(x)))
        if scale:
            z = z * gamma[keep]
        if center:
            z = z + beta[keep]
        return z

    return init_fun, apply_fun


def _pool(reducer, name, average=False):
    def layer(window_shape, strides=None, padding="VALID"):
        strides = tuple(strides or window_shape)
        if tuple(strides) != tuple(window_shape) or padding != "VALID":
            raise NotImplementedError(f"{name}: only non-overlapping VALID windows (strides = window_shape)")
        wh, ww = window_shape

        def init_fun(rng, input_shape):
            n, h, w, c = input_shape
            return (n, h // wh, w // ww, c), ()

        def apply_fun(params, inputs, **kwargs):
            n, h, w, c = tnp.shape(inputs)
            x = inputs[:, : h // wh * wh, : w // ww * ww]
            x = tnp.reshape(x, (n, h // wh, wh, w // ww, ww, c))
            out = reducer(x, axis=(2, 4))
            return out / (wh * ww) if average else out

        return init_fun, apply_fun

    layer.__name__ = name
    return layer


MaxPool = _pool(tnp.max, "MaxPool")
SumPool = _pool(tnp.sum, "SumPool")
AvgPool = _pool(tnp.sum, "AvgPool", average=True)


def serial(*layers):
    """Layers in sequence."""
    init_funs, apply_funs = zip(*layers) if layers else ((), ())

    def init_fun(rng, input_shape):
        params = []
        for init in init_funs:
            rng, layer_rng = random.split(rng)
            input_shape, param = init(layer_rng, input_shape)
            params.append(param)
        return input_shape, params

    def apply_fun(params, inputs, **kwargs):
        rng = kwargs.pop("rng", None)
        rngs = random.split(rng, len(apply_funs)) if rng is not None else (None,) * len(apply_funs)
        for fun, param, r in zip(apply_funs, params, rngs):
            inputs = fun(param, inputs, rng=r, **kwargs)
        return inputs

    return init_fun, apply_fun


def parallel(*layers):
    """Layers side by side over a tuple of inputs."""
    init_funs, apply_funs = zip(*layers) if layers else ((), ())

    def init_fun(rng, input_shape):
        rngs = random.split(rng, len(init_funs))
        return (
            zip(*[init(r, shape) for init, r, shape in zip(init_funs, rngs, input_shape)])
            if init_funs
            else ((), ())
        )

    def init_fun_lists(rng, input_shape):
        shapes, params = init_fun(rng, input_shape)
        return list(shapes), list(params)

    def apply_fun(params, inputs, **kwargs):
        rng = kwargs.pop("rng", None)
        rngs = random.split(rng, len(apply_funs)) if rng is not None else (None,) * len(apply_funs)
        return [f(p, x, rng=r, **kwargs) for f, p, x, r in zip(apply_funs, params, inputs, rngs)]

    return init_fun_lists, apply_fun


def FanOut(num):
    init_fun = lambda rng, input_shape: ([input_shape] * num, ())  # noqa: E731
    apply_fun = lambda params, inputs, **kwargs: [inputs] * num  # noqa: E731
    return init_fun, apply_fun


def _fan_in_sum():
    init_fun = lambda rng, input_shape: (input_shape[0], ())  # noqa: E731
    apply_fun = lambda params, inputs, **kwargs: sum(inputs[1:], inputs[0])  # noqa: E731
    return init_fun, apply_fun


FanInSum = _fan_in_sum()


def FanInConcat(axis=-1):
    def init_fun(rng, input_shape):
        ax = axis % len(input_shape[0])
        concat = sum(shape[ax] for shape in input_shape)
        return tuple(input_shape[0][:ax]) + (concat,) + tuple(input_shape[0][ax + 1 :]), ()

    def apply_fun(params, inputs, **kwargs):
        return tnp.concatenate(inputs, axis)

    return init_fun, apply_fun


def shape_dependent(make_layer):
    """A layer built from the input shape at init time."""

    def init_fun(rng, input_shape):
        return make_layer(input_shape)[0](rng, input_shape)

    def apply_fun(params, inputs, **kwargs):
        return make_layer(tnp.shape(inputs))[1](params, inputs, **kwargs)

    return init_fun, apply_fun
