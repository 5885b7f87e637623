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


# ---- full disks, torn logs, crafted checkpoints, bad arguments (issue 19) ----------------------

def _no_temporaries(folder) -> bool:
    return not [n for n in os.listdir(folder) if ".tmp" in n]


def test_a_full_disk_while_saving_is_reported_and_the_run_resumes(tmp_path, on_ref, monkeypatch):
    import errno
    real, saves = np.savez, []

    def savez_until_the_disk_fills(f, **arrays):
        saves.append(1)
        if len(saves) == 2:  # the second checkpoint: half written, then the disk is full
            f.write(b"PK\x03\x04" + b"\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(f, **arrays)
    common = ("--steps", 6, "--ckpt-every", 2, "--log-every", 2, "--eval-every", 0, "--max-chars", 20000)
    monkeypatch.setattr(np, "savez", savez_until_the_disk_fills)
    with pytest.raises(TilefuseError, match=r"checkpoint\.npz: the disk is full \(it needs about [\d.]+ KiB, "
                                            r".* are free\); the previous file is intact"):
        run(*common, "--out", tmp_path / "a")
    assert _no_temporaries(tmp_path / "a")
    with np.load(tmp_path / "a" / T.CHECKPOINT, allow_pickle=False) as z:
        assert int(z["step"]) == 2
    monkeypatch.setattr(np, "savez", real)  # space freed: the run continues where it was saved
    resumed = run(*common, "--out", tmp_path / "a", "--resume")
    full = run(*common, "--out", tmp_path / "b")
    assert resumed["step"] == 6 and full["losses"][2:] == resumed["losses"]
    for a, b in zip(_leaves(full["params"]), _leaves(resumed["params"]), strict=True):
        np.testing.assert_array_equal(a, b)
    assert _records(tmp_path / "a" / T.METRICS) == _records(tmp_path / "b" / T.METRICS)


def test_a_checkpoint_that_cannot_fit_is_refused_before_writing(tmp_path, on_ref, monkeypatch):
    import shutil
    cfg = T.Config(vocab=20, d_model=8, layers=1, heads=2, seq=4)
    params, opt_state = _model_state(cfg)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(TilefuseError, match=r"the disk is full \(it needs about [\d.]+ KiB, 1000 bytes are free"):
        T.save_checkpoint(str(tmp_path / "ck.npz"), step=1, params=params, opt_state=opt_state,
                          key=random.key(0), data_pos=0, cfg=cfg)
    assert os.listdir(tmp_path) == []


def test_temporary_files_of_killed_writers_are_removed_at_the_next_start(tmp_path, on_ref):
    import subprocess
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name, pid in ((T.CHECKPOINT, dead.pid), (T.METRICS, dead.pid), (T.CHECKPOINT, live.pid)):
            (tmp_path / f"{name}.tmp{pid}").write_bytes(b"\0" * 4096)
        run("--steps", 1, "--eval-every", 0, "--max-chars", 20000, "--out", tmp_path)
        assert sorted(os.listdir(tmp_path)) == sorted([T.CHECKPOINT, T.METRICS, f"{T.CHECKPOINT}.tmp{live.pid}"])
    finally:
        live.kill()
        live.wait()


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path, on_ref):
    common = ("--steps", 4, "--ckpt-every", 2, "--log-every", 1, "--eval-every", 0, "--max-chars", 20000)
    run(*common, "--out", tmp_path / "a", "--stop-at", 2)
    with open(tmp_path / "a" / T.METRICS, "a") as f:
        f.write('{"step": 3, "loss": 2.9')  # killed in the middle of writing step 3's record
    run(*common, "--out", tmp_path / "a", "--resume")
    run(*common, "--out", tmp_path / "b")
    assert [r["step"] for r in _records(tmp_path / "a" / T.METRICS)] == [1, 2, 3, 4]
    assert _records(tmp_path / "a" / T.METRICS) == _records(tmp_path / "b" / T.METRICS)


def _damage_member(path, name):
    """Flip a byte inside one member's stored data (its CRC then fails)."""
    import zipfile
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(name + ".npy")
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 30 + len(info.filename) + len(info.extra) + info.file_size - 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


PARAM = "params/ln_f/scale"
CRAFTED = [  # (entry, new value or None to drop it, what the message names)
    ("step", np.asarray(-1), r"its 'step' entry is -1, not an integer >= 0"),
    ("step", np.asarray("seven"), r"its 'step' entry is <U5\[\], not an integer"),
    ("data_pos", np.asarray([1, 2]), r"its 'data_pos' entry is int64\[2\], not an integer"),
    ("data_pos", np.asarray(2.5), r"its 'data_pos' entry is float64\[\], not an integer"),
    ("step", None, r"it has no 'step' entry"),
    ("config", np.asarray("{not json"), r"its 'config' entry is not valid JSON"),
    ("config", np.asarray(3), r"its 'config' entry is int64\[\], not a JSON string"),
    ("rng_key", np.zeros(2, np.float32), r"its rng_key is not a uint32 pair"),
    (PARAM, np.full(8, np.nan, np.float32), rf"the entry '{PARAM}' holds NaN or infinity"),
    (PARAM, np.ones(9, np.float32), rf"the entry '{PARAM}' is float32\[9\], expected float32\[8\]"),
    (PARAM, "damaged", rf"its entry '{PARAM}' is damaged \(BadZipFile: Bad CRC-32"),
    ("step", "pickle", r"its entry 'step' holds Python objects \(a pickle\), which are never loaded"),
]


@pytest.mark.parametrize("entry,value,message", CRAFTED, ids=[f"{e}-{i}" for i, (e, _, _) in enumerate(CRAFTED)])
def test_a_damaged_or_crafted_checkpoint_entry_is_named(tmp_path, on_ref, entry, value, message):
    cfg = T.Config(vocab=20, d_model=8, layers=1, heads=2, seq=4)
    params, opt_state = _model_state(cfg)
    path = str(tmp_path / "ck.npz")
    T.save_checkpoint(path, step=3, params=params, opt_state=opt_state, key=random.key(0), data_pos=0, cfg=cfg)
    if isinstance(value, str) and value == "damaged":
        _damage_member(path, entry)
    else:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        if value is None:
            del arrays[entry]
        elif isinstance(value, str) and value == "pickle":
            arrays[entry] = np.array([{"a": 1}], dtype=object)
        else:
            arrays[entry] = value
        np.savez(path, **arrays)
    with pytest.raises(TilefuseError, match=r"checkpoint .*ck\.npz cannot be used: " + message):
        T.load_checkpoint(path, params, opt_state, cfg)


@pytest.mark.parametrize("argv,option", [
    (["--batch", "0"], "--batch"), (["--batch", "-3"], "--batch"), (["--batch", "x"], "--batch"),
    (["--seq", "0"], "--seq"), (["--layers", "0"], "--layers"), (["--heads", "0"], "--heads"),
    (["--heads", "-2"], "--heads"), (["--log-every", "0"], "--log-every"), (["--max-chars", "0"], "--max-chars"),
    (["--eval-batches", "0"], "--eval-batches"), (["--steps", "-1"], "--steps"), (["--d-model", "0"], "--d-model"),
    (["--d-model", "30", "--heads", "4"], "--d-model 30 must be a multiple of --heads 4"),
    (["--dropout", "1.0"], "--dropout"), (["--lr", "-1"], "--lr"), (["--resume"], "--resume needs --out"),
    (["--out", "FILE"], "is a file"),
])
def test_bad_arguments_are_usage_errors(tmp_path, capsys, argv, option):
    (tmp_path / "FILE").write_text("not a directory")
    argv = [str(tmp_path / "FILE") if a == "FILE" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        T.parse_args(argv)
    assert e.value.code == 2
    assert option in capsys.readouterr().err


def test_a_corpus_too_small_for_the_windows_is_an_error(on_ref):
    with pytest.raises(TilefuseError, match=r"--max-chars 50 gives .* too few for windows of --seq 64"):
        run("--steps", 1, "--max-chars", 50, "--seq", 64)
