"""The examples that need tilefuse.lax: the character LSTM (examples/train_rnn.py) trains with
lax.scan on every device, and the transformer's --scan-layers runs the same model as its loop
over layers (same loss and gradients from the same parameters)."""
from __future__ import annotations

import os
import sys

import numpy as np

import tilefuse as tx
import tilefuse.random as random
from tilefuse.ir import primitives as P

from conftest import assert_close

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import train_rnn as R  # noqa: E402
import train_transformer as T  # noqa: E402


def test_the_lstm_trains_with_scan(device):
    args = R.parse_args(["--steps", "25", "--batch", "8", "--seq", "16", "--embed", "16", "--hidden", "32",
                         "--lr", "2e-2", "--max-chars", "60000", "--eval-batches", "2", "--sample", "20",
                         "--quiet", "--device", device.name])
    r = R.train(args)
    losses = r["losses"]
    assert abs(losses[0] - np.log(r["config"].vocab)) < 0.3  # starts near uniform guessing
    assert np.mean(losses[-3:]) < losses[0] - 0.8, losses
    assert r["eval_loss"] < r["unigram_loss"] + 0.3
    assert len(r["sample"]) == len("The ") + 20


def test_the_lstm_graph_holds_one_cell_and_its_gradient_matches_the_unrolled_loop(device):
    cfg = R.Config(vocab=12, embed=4, hidden=8, seq=5)
    params = R.init_params(random.key(0), cfg)
    x = np.random.default_rng(0).integers(0, 12, (3, 5)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    g = tx.make_graph(lambda p: R.loss_fn(p, x, y, cfg))(params)
    assert g.count("scan") == 1 and g.count("tanh") == 0  # the cell lives in the scan's body

    def unrolled(p):
        emb = tx.numpy.transpose(tx.nn.embedding(p["embed"], x)[..., None], (1, 0, 2, 3))[..., 0]
        state, hs = R.zero_state(3, cfg), []
        for t in range(5):
            state, h = R.lstm_cell(p["wh"], state, emb[t] @ p["wx"] + p["b"])
            hs.append(h)
        logits = tx.numpy.transpose(tx.nn.linear(p["head"], tx.numpy.stack(hs)), (1, 0, 2))
        return tx.nn.cross_entropy(logits, y)
    got = tx.jit(tx.grad(lambda p: R.loss_fn(p, x, y, cfg)))(params)
    want = tx.jit(tx.grad(unrolled))(params)
    for a, b in zip(tx.tree_leaves(got), tx.tree_leaves(want)):
        assert_close(np.asarray(a), np.asarray(b), np.float32, rtol=1e-4, atol=1e-5)


def test_transformer_scan_layers_is_the_same_model(device):
    cfg = T.Config(vocab=16, d_model=16, layers=2, heads=2, seq=8)
    scfg = T.Config(vocab=16, d_model=16, layers=2, heads=2, seq=8, scan_layers=True)
    params, sparams = T.init_params(random.key(0), cfg), T.init_params(random.key(0), scfg)
    for k in range(2):  # the stacked parameters are the list's, layer by layer
        for a, b in zip(tx.tree_leaves(params["blocks"][k]), tx.tree_leaves(sparams["blocks"])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[k])
    x = np.random.default_rng(0).integers(0, 16, (2, 8)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    loss, grads = tx.jit(tx.value_and_grad(lambda p: T.loss_fn(p, x, y, cfg)))(params)
    sloss, sgrads = tx.jit(tx.value_and_grad(lambda p: T.loss_fn(p, x, y, scfg)))(sparams)
    assert abs(float(loss) - float(sloss)) < 1e-5
    for k in range(2):
        for a, b in zip(tx.tree_leaves(grads["blocks"][k]), tx.tree_leaves(sgrads["blocks"])):
            assert_close(np.asarray(a), np.asarray(b)[k], np.float32, rtol=1e-4, atol=1e-5)
    g = tx.make_graph(lambda p: T.loss_fn(p, x, y, scfg))(sparams)
    (scan,) = [e for e in g.eqns if e.prim is P.scan_p]
    assert scan.params["length"] == 2 and scan.params["body"].count("fused_attention") == 1
    mask = T.decay_mask(sparams)
    assert mask["blocks"]["qkv"]["w"] and not mask["blocks"]["qkv"]["b"] and not mask["blocks"]["ln1"]["scale"]
