"""The training example end to end, at tiny sizes: the loss falls on every device, a resumed
run continues bit for bit, and a bad checkpoint is reported, never loaded."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.random as random
from tilefuse.ir.errors import TilefuseError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import train_transformer as T  # noqa: E402


def _grad_available() -> bool:
    try:
        tx.grad(lambda x: (x * x).sum())(np.ones(3, np.float32))
        return True
    except NotImplementedError:
        return False


needs_grad = pytest.mark.skipif(not _grad_available(), reason="tx.grad is not implemented yet "
                                "(autodiff): training needs it")

TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "8",
        "--lr", "1e-2", "--max-chars", "60000", "--eval-batches", "2", "--sample", "0", "--quiet"]


def run(*extra, device=None):
    argv = TINY + [str(a) for a in extra] + (["--device", device] if device else [])
    return T.train(T.parse_args(argv))


def _leaves(tree):
    return [np.asarray(x) for x in tx.tree_leaves(tree)]


@needs_grad
def test_twenty_steps_lower_the_loss(device, tmp_path):
    r = run("--steps", 20, "--eval-every", 20, "--log-every", 5, "--out", tmp_path, device=device.name)
    losses = r["losses"]
    assert len(losses) == 20 and np.isfinite(losses).all()
    assert abs(losses[0] - np.log(r["config"].vocab)) < 0.2  # starts near uniform guessing
    assert np.mean(losses[-3:]) < losses[0] - 0.5, losses
    assert r["eval_loss"] < losses[0] - 0.4
    records = [json.loads(ln) for ln in open(tmp_path / "metrics.jsonl")]
    assert [rec["step"] for rec in records] == [5, 10, 15, 20]
    assert all(rec["tokens_per_s"] > 0 for rec in records) and "eval_loss" in records[-1]
    assert tx.tree_leaves(r["params"])[0].device.name == device.name


@needs_grad
def test_resumed_run_equals_uninterrupted_run(device, tmp_path, monkeypatch):
    # bit for bit on every device: scatter-add's atomic float adds (OpenCL) in a fixed order
    monkeypatch.setattr(tx.config, "deterministic", True)
    common = ("--steps", 8, "--eval-every", 4, "--log-every", 2, "--dropout", 0.1, "--device", device.name)
    full = run(*common, "--out", tmp_path / "a")
    part = run(*common, "--out", tmp_path / "b", "--stop-at", 3)
    assert part["step"] == 3 and "eval_loss" not in part
    resumed = run(*common, "--out", tmp_path / "b", "--resume")
    assert resumed["step"] == 8
    for a, b in zip(_leaves(full["params"]), _leaves(resumed["params"])):
        np.testing.assert_array_equal(a, b)  # bit for bit
    for a, b in zip(_leaves(full["opt_state"]), _leaves(resumed["opt_state"])):
        np.testing.assert_array_equal(a, b)
    assert full["losses"][3:] == resumed["losses"]
    ra, rb = (_records(tmp_path / d / "metrics.jsonl") for d in "ab")
    assert ra == rb and [r["step"] for r in ra] == [2, 4, 6, 8]


@pytest.fixture
def on_ref():
    """Checkpoint files do not depend on the device: test them on the quick numpy one."""
    old = tx.config.default_device
    tx.config.default_device = "ref"
    yield
    tx.config.default_device = old


def _records(path):
    """metrics.jsonl without the timings (which differ from run to run)."""
    return [{k: v for k, v in json.loads(ln).items() if k != "tokens_per_s"} for ln in open(path)]


def _model_state(cfg):
    params = T.init_params(random.key(0), cfg)
    opt = T.make_optimizer(1e-3, 10)
    return params, opt.init(params)


def test_checkpoint_roundtrip_is_exact_and_atomic(tmp_path, on_ref):
    cfg = T.Config(vocab=20, d_model=8, layers=1, heads=2, seq=4)
    params, opt_state = _model_state(cfg)
    path = str(tmp_path / "ck.npz")
    key = random.key(5)
    T.save_checkpoint(path, step=7, params=params, opt_state=opt_state, key=key, data_pos=56, cfg=cfg)
    assert os.listdir(tmp_path) == ["ck.npz"]  # the temporary file was renamed
    with np.load(path, allow_pickle=False) as z:
        assert "params/blocks/0/qkv/w" in z.files and int(z["step"]) == 7
    zeros = tx.tree_map(lambda x: x * 0, params)
    s = T.load_checkpoint(path, zeros, tx.tree_map(lambda x: x * 0, opt_state), cfg)
    assert s["step"] == 7 and s["data_pos"] == 56
    np.testing.assert_array_equal(np.asarray(s["key"]), np.asarray(key))
    for a, b in zip(_leaves(params), _leaves(s["params"])):
        np.testing.assert_array_equal(a, b)
    assert tx.tree_structure(s["opt_state"]) == tx.tree_structure(opt_state)


def test_corrupt_checkpoint_is_reported_not_loaded(tmp_path, on_ref):
    cfg = T.Config(vocab=20, d_model=8, layers=1, heads=2, seq=4)
    params, opt_state = _model_state(cfg)
    path = str(tmp_path / "ck.npz")
    T.save_checkpoint(path, step=3, params=params, opt_state=opt_state, key=random.key(0), data_pos=0,
                      cfg=cfg)
    good = open(path, "rb").read()
    for bad in (b"not a checkpoint", good[:len(good) // 2]):
        with open(path, "wb") as f:
            f.write(bad)
        with pytest.raises(TilefuseError, match=r"checkpoint .*ck\.npz cannot be used: it is corrupt"):
            T.load_checkpoint(path, params, opt_state, cfg)
    with open(path, "wb") as f:
        f.write(good)
    other = T.Config(vocab=20, d_model=16, layers=1, heads=2, seq=4)
    p2, o2 = _model_state(other)
    with pytest.raises(TilefuseError, match="written for the model"):
        T.load_checkpoint(path, p2, o2, other)


def test_resume_from_a_corrupt_checkpoint_fails_clearly(tmp_path, on_ref):
    (tmp_path / T.CHECKPOINT).write_bytes(b"PK\x03\x04 garbage")
    with pytest.raises(TilefuseError, match=r"checkpoint\.npz cannot be used"):
        run("--steps", 2, "--out", tmp_path, "--resume")


def test_model_shapes_and_sampling(on_ref):
    n = sum(x.size for x in tx.tree_leaves(T.init_params(random.key(0), T.Config())))
    assert n == 429_664  # the benchmark model: about 430k parameters
    cfg = T.Config(vocab=30, d_model=16, layers=2, heads=4, seq=8, tied=True)
    params = T.init_params(random.key(1), cfg)
    assert "head" not in params
    x = np.arange(16, dtype=np.int32).reshape(2, 8) % 30
    logits = np.asarray(T.forward(params, x, cfg))
    assert logits.shape == (2, 8, 30) and np.isfinite(logits).all()
    # causal: changing a later token leaves earlier positions' logits unchanged
    x2 = x.copy()
    x2[:, 5] = 0
    np.testing.assert_allclose(np.asarray(T.forward(params, x2, cfg))[:, :5], logits[:, :5], rtol=1e-6)
    loss = float(T.loss_fn(params, x, x, cfg))
    assert abs(loss - np.log(30)) < 0.3  # near uniform at initialisation
    vocab = T.data.CharVocab("abcdefghijklmnopqrstuvwxyz .,\n", size=30)
    text = T.generate(params, cfg, vocab, random.key(2), prompt="ab", length=12)
    assert len(text) == 14 and text.startswith("ab") and set(text) <= set(vocab.chars)
    assert text == T.generate(params, cfg, vocab, random.key(2), prompt="ab", length=12)
