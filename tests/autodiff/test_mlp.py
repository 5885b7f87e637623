"""A two-layer MLP with a softmax cross-entropy loss against hand-derived numpy gradients,
eager and under jit, on every device."""
from __future__ import annotations

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp

from conftest import assert_close

N, D, H, C = 6, 4, 5, 3


def init(dtype):
    r = np.random.default_rng(7)
    params = {"W1": r.standard_normal((D, H)) * 0.5, "b1": r.standard_normal(H) * 0.1,
              "W2": r.standard_normal((H, C)) * 0.5, "b2": r.standard_normal(C) * 0.1}
    x = r.standard_normal((N, D))
    labels = np.array([0, 2, 1, 2, 0, 1], np.int32)
    return {k: v.astype(dtype) for k, v in params.items()}, x.astype(dtype), labels


def loss(params, x, labels):
    h = tnp.tanh(x @ params["W1"] + params["b1"])
    logits = h @ params["W2"] + params["b2"]
    m = tnp.max(logits, axis=1, keepdims=True)  # its gradient cancels: logp does not depend on m
    logp = logits - m - tnp.log(tnp.sum(tnp.exp(logits - m), axis=1, keepdims=True))
    picked = tnp.take_along_axis(logp, labels[:, None], axis=1)  # a gather
    return -tnp.mean(picked)


def numpy_loss_and_grads(params, x, labels):
    """By hand: softmax cross-entropy, then backpropagation through two dense layers."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = np.asarray(x, np.float64)
    h = np.tanh(x @ p["W1"] + p["b1"])
    logits = h @ p["W2"] + p["b2"]
    z = logits - logits.max(1, keepdims=True)
    softmax = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    onehot = np.eye(C)[labels]
    value = -np.mean(np.sum(onehot * (z - np.log(np.exp(z).sum(1, keepdims=True))), 1))
    dlogits = (softmax - onehot) / N
    dh = dlogits @ p["W2"].T
    dz1 = dh * (1 - h * h)
    return value, {"W1": x.T @ dz1, "b1": dz1.sum(0), "W2": h.T @ dlogits, "b2": dlogits.sum(0)}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mlp_gradients_match_hand_derivation(device, dtype):
    params, x, labels = init(dtype)
    value, grads = tx.value_and_grad(loss)(params, x, labels)
    e_value, e_grads = numpy_loss_and_grads(params, x, labels)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-12)
    assert float(value) == pytest.approx(e_value, rel=tol["rtol"])
    assert set(grads) == set(params)
    for k in params:
        assert np.asarray(grads[k]).dtype == dtype
        assert_close(grads[k], e_grads[k], **tol)


def test_mlp_jitted_training_step(device):
    params, x, labels = init(np.float32)

    @tx.jit
    def step(params, x, labels):
        value, grads = tx.value_and_grad(loss)(params, x, labels)
        return value, tx.tree_map(lambda p, g: p - 0.5 * g, params, grads)

    values = []
    for _ in range(3):
        value, new = step(params, x, labels)
        e_value, e_grads = numpy_loss_and_grads(params, x, labels)
        assert float(value) == pytest.approx(e_value, rel=1e-5)
        for k in params:
            assert_close(new[k], np.asarray(params[k]) - 0.5 * e_grads[k], rtol=1e-5, atol=1e-6)
        values.append(float(value))
        params = new
    assert values[2] < values[0]  # it learns
    assert step.trace_count == 1
