"""tilefuse.nn against numpy implementations: activations, norms, the softmax family, cross
entropy, dropout, attention (masks never give NaN), initialisers; gradients when grad exists."""
from __future__ import annotations

import math

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.nn as nn
import tilefuse.numpy as tnp
import tilefuse.random as random
from tilefuse.ir.errors import ShapeError, TilefuseError
from conftest import assert_close


def _grad_available() -> bool:
    try:
        tx.grad(lambda x: (x * x).sum())(np.ones(3, np.float32))
        return True
    except NotImplementedError:
        return False


needs_grad = pytest.mark.skipif(not _grad_available(), reason="tx.grad is not implemented yet")


# ---- numpy references ---------------------------------------------------------------------------

def np_logsumexp(x, axis=-1):
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    with np.errstate(divide="ignore"):
        return (np.log(np.exp(x - m).sum(axis=axis, keepdims=True)) + m).squeeze(axis)


def np_softmax(x, axis=-1):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def np_attention(q, k, v, mask=None, causal=False, scale=None):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("...qhd,...khd->...hqk", q, k) * scale
    keep = np.ones(s.shape, bool)
    if mask is not None:
        keep &= np.broadcast_to(mask, s.shape)
    if causal:
        keep &= np.tril(np.ones(s.shape[-2:], bool))
    s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.where(keep, np.exp(s - m), 0)
    d = e.sum(-1, keepdims=True)
    w = e / np.where(d > 0, d, 1)
    return np.einsum("...hqk,...khd->...qhd", w, v)


# ---- activations and norms --------------------------------------------------------------------

def test_activations(rng):
    x = rng.normal(size=(5, 7)).astype(np.float32) * 3
    xd = x.astype(np.float64)
    erf = np.vectorize(math.erf)
    assert_close(nn.gelu(x, approximate=False), 0.5 * xd * (1 + erf(xd / math.sqrt(2))), np.float32)
    tanh_form = 0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    assert_close(nn.gelu(x), tanh_form, np.float32)
    assert np.abs(tanh_form - 0.5 * xd * (1 + erf(xd / math.sqrt(2)))).max() < 1e-3  # the forms agree
    assert_close(nn.silu(x), xd / (1 + np.exp(-xd)), np.float32)
    assert_close(nn.relu(x), np.maximum(xd, 0), np.float32)
    assert_close(nn.sigmoid(x), 1 / (1 + np.exp(-xd)), np.float32)


def test_layer_norm_and_rms_norm(rng):
    x = rng.normal(size=(3, 4, 16)).astype(np.float32) * 5 + 2
    scale = rng.normal(size=16).astype(np.float32)
    bias = rng.normal(size=16).astype(np.float32)
    xd = x.astype(np.float64)
    ref = (xd - xd.mean(-1, keepdims=True)) / np.sqrt(xd.var(-1, keepdims=True) + 1e-5)
    assert_close(nn.layer_norm({"scale": scale, "bias": bias}, x), ref * scale + bias, np.float32,
                 rtol=1e-4, atol=1e-5)
    assert_close(nn.layer_norm(None, x), ref, np.float32, rtol=1e-4, atol=1e-5)
    p = nn.init_layer_norm(16)
    assert_close(nn.layer_norm(p, x), ref, np.float32, rtol=1e-4, atol=1e-5)
    rms = xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-6)
    assert_close(nn.rms_norm({"scale": scale}, x), rms * scale, np.float32, rtol=1e-4, atol=1e-5)


def test_linear_and_embedding(rng):
    p = nn.init_linear(random.key(0), 6, 3)
    x = rng.normal(size=(2, 5, 6)).astype(np.float32)
    w, b = np.asarray(p["w"]), np.asarray(p["b"])
    assert w.shape == (6, 3) and (b == 0).all()
    assert_close(nn.linear(p, x), x.astype(np.float64) @ w + b, np.float32, rtol=1e-5, atol=1e-5)
    assert_close(nn.linear({"w": w}, x), x.astype(np.float64) @ w, np.float32, rtol=1e-5, atol=1e-5)
    table = rng.normal(size=(10, 4)).astype(np.float32)
    ids = np.array([[0, 9, 3], [3, 3, 1]], np.int32)
    assert_close(nn.embedding(table, ids), table[ids], np.float32)


def test_initialisers():
    k = random.key(0)
    w = np.asarray(nn.glorot_uniform()(k, (200, 300)))
    a = math.sqrt(6 / 500)
    assert np.abs(w).max() <= a and abs(w.var() - a * a / 3) < 0.05 * a * a / 3
    assert nn.xavier_uniform is nn.glorot_uniform
    g = np.asarray(nn.glorot_normal()(k, (200, 300)))
    assert abs(g.std() - math.sqrt(2 / 500)) < 0.02 * math.sqrt(2 / 500)
    n = np.asarray(nn.normal(0.02)(k, (100, 100)))
    assert abs(n.std() - 0.02) < 0.001 and abs(n.mean()) < 0.001
    assert (np.asarray(nn.zeros(k, (3, 2))) == 0).all() and (np.asarray(nn.ones(k, (2,))) == 1).all()
    e = np.asarray(nn.init_embedding(k, 50, 8))
    assert e.shape == (50, 8)
    with pytest.raises(ShapeError, match="rank >= 2"):
        nn.glorot_uniform()(k, (5,))


# ---- the softmax family -----------------------------------------------------------------------

def test_softmax_family(rng):
    x = rng.normal(size=(4, 9)).astype(np.float32) * 4
    assert_close(nn.softmax(x), np_softmax(x), np.float32, rtol=1e-5, atol=1e-7)
    assert_close(nn.softmax(x, axis=0), np_softmax(x, 0), np.float32, rtol=1e-5, atol=1e-7)
    assert_close(nn.log_softmax(x), np.log(np_softmax(x)), np.float32, rtol=1e-5, atol=1e-5)
    assert_close(nn.logsumexp(x), np_logsumexp(x), np.float32, rtol=1e-5, atol=1e-5)
    assert_close(nn.logsumexp(x, axis=0, keepdims=True), np_logsumexp(x, 0)[None], np.float32,
                 rtol=1e-5, atol=1e-5)
    big = np.array([[1000.0, 999.0, -1000.0]], np.float32)  # stable: no overflow
    assert_close(nn.softmax(big), np_softmax(big), np.float32, atol=1e-7)
    assert_close(nn.logsumexp(big), [1000 + math.log(1 + math.exp(-1))], np.float32)


def test_masked_softmax_has_no_nan():
    x = np.array([[0.0, -np.inf, 1.0], [-np.inf, -np.inf, -np.inf]], np.float32)
    s = np.asarray(nn.softmax(x))
    assert np.isfinite(s).all()
    np.testing.assert_allclose(s[0], [1 / (1 + math.e), 0, math.e / (1 + math.e)], rtol=1e-6)
    np.testing.assert_array_equal(s[1], 0)  # a fully masked row: zero weights
    ls = np.asarray(nn.log_softmax(x))
    assert not np.isnan(ls).any() and ls[0, 1] == -np.inf and (ls[1] == -np.inf).all()
    lse = np.asarray(nn.logsumexp(x))
    assert lse[1] == -np.inf and abs(lse[0] - np_logsumexp(x[0])) < 1e-6
    where = np.array([[True, True, False], [False, False, False]])
    sw = np.asarray(nn.softmax(np.ones((2, 3), np.float32), where=where))
    np.testing.assert_allclose(sw, [[0.5, 0.5, 0], [0, 0, 0]])


def test_cross_entropy(rng):
    logits = rng.normal(size=(6, 11)).astype(np.float32) * 3
    labels = rng.integers(0, 11, size=6).astype(np.int32)
    per = np_logsumexp(logits) - logits.astype(np.float64)[np.arange(6), labels]
    assert_close(nn.cross_entropy(logits, labels, reduction="none"), per, np.float32, rtol=1e-5, atol=1e-5)
    assert_close(nn.cross_entropy(logits, labels), per.mean(), np.float32, rtol=1e-5, atol=1e-5)
    assert_close(nn.cross_entropy(logits, labels, "sum"), per.sum(), np.float32, rtol=1e-5, atol=1e-5)
    masked = logits.copy()
    masked[:, 0] = -np.inf  # a class that can never occur: the loss stays finite
    labels[labels == 0] = 1
    got = np.asarray(nn.cross_entropy(masked, labels, reduction="none"))
    assert np.isfinite(got).all()
    assert_close(got, np_logsumexp(masked) - masked.astype(np.float64)[np.arange(6), labels], np.float32,
                 rtol=1e-5, atol=1e-5)
    x3 = rng.normal(size=(2, 3, 5)).astype(np.float32)
    y3 = rng.integers(0, 5, size=(2, 3)).astype(np.int32)
    ref = (np_logsumexp(x3) - np.take_along_axis(x3, y3[..., None], -1)[..., 0]).mean()
    assert_close(nn.cross_entropy(x3, y3), ref, np.float32, rtol=1e-5, atol=1e-5)
    with pytest.raises(ShapeError, match="labels"):
        nn.cross_entropy(x3, y3[0])
    with pytest.raises(TilefuseError, match="reduction"):
        nn.cross_entropy(x3, y3, reduction="avg")


def test_one_hot():
    np.testing.assert_array_equal(np.asarray(nn.one_hot(np.array([2, 0]), 3)), [[0, 0, 1], [1, 0, 0]])


# ---- dropout and attention -------------------------------------------------------------------

def test_dropout():
    x = tnp.ones((100, 100))
    k = random.key(0)
    assert nn.dropout(k, x, 0.5, deterministic=True) is x
    assert nn.dropout(k, x, 0.0) is x
    y = np.asarray(nn.dropout(k, x, 0.25))
    assert set(np.unique(y).tolist()) == {0.0, float(np.float32(1 / 0.75))}
    assert abs((y == 0).mean() - 0.25) < 0.02
    np.testing.assert_array_equal(y, np.asarray(nn.dropout(k, x, 0.25)))  # same key, same mask
    assert not np.array_equal(y, np.asarray(nn.dropout(random.key(1), x, 0.25)))
    with pytest.raises(TilefuseError, match="rate"):
        nn.dropout(k, x, 1.0)


@pytest.mark.parametrize("causal,use_mask,scale", [(False, False, None), (True, False, None),
                                                   (False, True, 0.5), (True, True, None)])
def test_attention_matches_numpy(rng, causal, use_mask, scale):
    b, t, h, d = 2, 5, 3, 4
    q, k, v = (rng.normal(size=(b, t, h, d)).astype(np.float32) for _ in range(3))
    mask = rng.random((b, 1, t, t)) > 0.3 if use_mask else None
    got = nn.dot_product_attention(q, k, v, mask=mask, causal=causal, scale=scale)
    want = np_attention(q, k, v, mask, causal, scale)
    assert_close(got, want, np.float32, rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(got)).all()


def test_attention_shapes_and_fully_masked_rows(rng):
    # no batch axis, Tq != Tk, and query rows that see no key at all
    q = rng.normal(size=(3, 2, 4)).astype(np.float32)
    k = rng.normal(size=(6, 2, 4)).astype(np.float32)
    v = rng.normal(size=(6, 2, 4)).astype(np.float32)
    mask = np.ones((2, 3, 6), bool)
    mask[:, 1] = False
    got = np.asarray(nn.dot_product_attention(q, k, v, mask=mask))
    assert got.shape == (3, 2, 4) and np.isfinite(got).all()
    np.testing.assert_array_equal(got[1], 0)
    assert_close(got, np_attention(q, k, v, mask), np.float32, rtol=1e-5, atol=1e-5)
    # causal with fewer queries than keys: the last query sees every key
    cm = np.asarray(nn.causal_mask(3, 6))
    np.testing.assert_array_equal(cm, np.arange(6)[None, :] <= np.arange(3)[:, None] + 3)
    with pytest.raises(ShapeError, match="dot_product_attention"):
        nn.dot_product_attention(q, k[:, :1], v)


def test_nn_under_jit_on_every_device(device, rng):
    q, k, v = (rng.normal(size=(2, 8, 2, 4)).astype(np.float32) for _ in range(3))
    logits = rng.normal(size=(2, 8, 7)).astype(np.float32)
    labels = rng.integers(0, 7, size=(2, 8)).astype(np.int32)

    @tx.jit
    def f(q, k, v, logits, labels):
        a = nn.dot_product_attention(q, k, v, causal=True)
        return a, nn.cross_entropy(logits, labels), nn.layer_norm(None, nn.gelu(a))

    a, ce, ln = f(q, k, v, logits, labels)
    assert_close(a, np_attention(q, k, v, causal=True), np.float32, rtol=1e-4, atol=1e-5)
    ref_ce = (np_logsumexp(logits) - np.take_along_axis(logits, labels[..., None], -1)[..., 0]).mean()
    assert_close(ce, ref_ce, np.float32, rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(ln)).all()


# ---- gradients --------------------------------------------------------------------------------

@needs_grad
def test_cross_entropy_gradient(rng):
    logits = rng.normal(size=(4, 6)).astype(np.float32)
    labels = np.array([0, 5, 2, 2], np.int32)
    g = np.asarray(tx.grad(lambda z: nn.cross_entropy(z, labels))(logits))
    want = (np_softmax(logits) - np.eye(6)[labels]) / 4
    assert_close(g, want, np.float32, rtol=1e-4, atol=1e-6)


@needs_grad
def test_masked_attention_gradient_has_no_nan(rng):
    q, k, v = (rng.normal(size=(1, 4, 1, 2)).astype(np.float32) for _ in range(3))
    mask = np.ones((1, 1, 4, 4), bool)
    mask[..., 2, :] = False  # a query with nothing to attend to

    def f(q, k, v):
        return nn.dot_product_attention(q, k, v, mask=mask, causal=True).sum()
    grads = tx.grad(f, argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    eps = 1e-3  # central differences in float64 for one entry of q
    q64 = q.astype(np.float64)
    qp, qm = q64.copy(), q64.copy()
    qp[0, 3, 0, 1] += eps
    qm[0, 3, 0, 1] -= eps
    fd = (np_attention(qp, k, v, mask, True).sum() - np_attention(qm, k, v, mask, True).sum()) / (2 * eps)
    assert abs(float(np.asarray(grads[0])[0, 3, 0, 1]) - fd) < 1e-3
