"""Faults: the pool limit reached in the middle of a call, a compiler failure in one kernel, a
training run killed while it writes a checkpoint, a damaged cache entry. Each gives a clear
error (or a warning) and leaves nothing broken behind: the next call succeeds."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import uuid

import numpy as np
import pytest
from tilefuse.runtime import compile_cache as cc
from tilefuse.runtime.memory import size_class

import tilefuse as tx
import tilefuse.numpy as tnp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pool_of(device):
    """The device's PoolAllocator (the cpu backend has one, OpenCL one per device), or None."""
    return device.backend.pool_of(device)


def test_pool_limit_mid_call_raises_and_the_next_call_succeeds(device):
    pool = _pool_of(device)
    if pool is None:
        pytest.skip(f"{device} has no memory pool")
    n = 1 << 16  # 256 KiB per output
    x = tx.device_put(np.linspace(-1, 1, n, dtype=np.float32), device)
    f = tx.jit(lambda x: (x * 2.0, x + 1.0, tnp.tanh(x)))
    f(x)  # compiled, and its blocks are cached in the pool
    pool.empty_cache()
    before = pool.stats()
    old_limit = pool.limit
    # room for one output block and a half: the second allocation of the call fails
    pool.limit = before["bytes_reserved"] + size_class(4 * n) * 3 // 2
    try:
        with pytest.raises(tx.OutOfMemoryError, match=r"pool limit .*TILEFUSE_POOL_LIMIT"):
            f(x)
        after = pool.stats()
        assert after["alloc_calls"] >= before["alloc_calls"] + 2  # it failed part way through
        assert after["bytes_in_use"] == before["bytes_in_use"]  # what it had was given back
    finally:
        pool.limit = old_limit
    a, b, c = (np.asarray(o) for o in f(x))
    xs = np.asarray(x)
    np.testing.assert_allclose(a, xs * 2)
    np.testing.assert_allclose(b, xs + 1)
    np.testing.assert_allclose(c, np.tanh(xs), rtol=1e-6, atol=1e-6)


def test_pool_limit_from_the_environment():
    child = ("import numpy as np, tilefuse as tx\n"
             "try:\n"
             "    tx.jit(lambda x: x * 2, device='cpu')(np.ones(1 << 20, np.float32))\n"
             "except tx.OutOfMemoryError as e:\n"
             "    print('OOM', e)\n")
    env = {**os.environ, "TILEFUSE_POOL_LIMIT": "1M"}
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "OOM cpu: cannot allocate 4.0 MiB" in out.stdout and "pool limit 1.0 MiB" in out.stdout


def test_a_compiler_failure_names_the_kernel_and_leaves_the_cache_clean(monkeypatch, tmp_path):
    if "cpu" not in [d.name for d in tx.devices()]:
        pytest.skip("the cpu device is unavailable")
    from tilefuse.backends.llvm import compile as lc
    monkeypatch.setenv("TILEFUSE_COMPILE_WORKERS", "0")  # compile here, where the fault is
    target = lc.get_target(tx.get_device("cpu").info)
    monkeypatch.setattr(target, "cache", cc.CompileCache("llvm", str(tmp_path)))
    real = lc.Target.compile_ir

    def broken(self, text, fn_name, kernel_text):  # LLVM rejects the tanh kernel's IR
        if " tanh " in kernel_text:
            text += "\nthis is not LLVM IR\n"
        return real(self, text, fn_name, kernel_text)
    monkeypatch.setattr(lc.Target, "compile_ir", broken)

    salt = float(uuid.uuid4().int % 1000) + 0.5  # kernels no cache has seen
    f = tx.jit(lambda x: (x * salt, tnp.tanh(x + salt).sum()), device="cpu")
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    with pytest.raises(tx.CompileError, match=r"LLVM could not compile kernel") as err:
        f(x)
    assert " tanh " in err.value.kernel and "tanh" in str(err.value)
    assert f.cache_size() == 0
    entries = os.listdir(os.path.join(tmp_path, "llvm"))
    assert not [e for e in entries if e.startswith(".tmp")]
    cache = target.cache
    for e in entries:  # what was stored is whole, and none of it is the failed kernel
        assert cache.load(e[:-4]) is not None

    monkeypatch.setattr(lc.Target, "compile_ir", real)  # the fault is gone: the call succeeds
    a, s = f(x)
    np.testing.assert_allclose(np.asarray(a), x * salt, rtol=1e-6)
    np.testing.assert_allclose(float(s), np.tanh(x + salt).sum(), rtol=1e-5)
    assert len(os.listdir(os.path.join(tmp_path, "llvm"))) > len(entries)


def test_a_damaged_cache_entry_is_ignored_with_a_warning(tmp_path):
    cache = cc.CompileCache("warn", str(tmp_path))
    key = cc.make_key("kernel")
    cache.store(key, b"object code" * 10)
    with open(cache.path(key), "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"\x00" * 5)
    with pytest.warns(cc.CacheWarning, match=r"corrupt .* ignored and rebuilt"):
        assert cache.get_or_build(key, lambda: b"rebuilt") == b"rebuilt"
    assert cache.load(key) == b"rebuilt"


# ---- a training run killed while it saves ------------------------------------------------------

TRAIN = ["--d-model", "16", "--layers", "1", "--heads", "2", "--seq", "8", "--batch", "4",
         "--max-chars", "20000", "--eval-batches", "1", "--eval-every", "0", "--sample", "0",
         "--quiet", "--device", "ref", "--ckpt-every", "2", "--steps", "6", "--lr", "1e-2"]

# the child trains; its second checkpoint write stops half way, says so, and waits to be killed
KILLED_CHILD = r"""
import io, sys, time
import numpy as np
sys.path.insert(0, "examples")
import train_transformer as T
real, saves = np.savez, []
def savez_then_hang(f, **arrays):
    saves.append(1)
    if len(saves) < 2:
        return real(f, **arrays)
    buf = io.BytesIO()
    real(buf, **arrays)
    f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
    f.flush()
    print("HALF-WRITTEN", flush=True)
    time.sleep(600)
np.savez = savez_then_hang
T.main(sys.argv[1:])
"""


def _train(args):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_transformer as T
    return T.train(T.parse_args(args))


def test_a_run_killed_mid_save_resumes_from_its_last_checkpoint(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, *TRAIN, "--out", out], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == "HALF-WRITTEN", (line, p.stderr.read() if p.poll() is not None else "")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    ckpt = os.path.join(out, "checkpoint.npz")
    with np.load(ckpt, allow_pickle=False) as z:  # the step-2 checkpoint, whole
        assert int(z["step"]) == 2
    orphan = f"{ckpt}.tmp{p.pid}"
    assert os.path.exists(orphan)  # the half-written temporary file of the killed process
    monkeypatch.chdir(ROOT)
    resumed = _train([*TRAIN, "--out", out, "--resume"])
    assert not os.path.exists(orphan)  # removed at the next start
    full = _train([*TRAIN, "--out", str(tmp_path / "full")])
    assert resumed["step"] == full["step"] == 6
    for a, b in zip(tx.tree_leaves(resumed["params"]), tx.tree_leaves(full["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert full["losses"][2:] == resumed["losses"]


# ---- tuning database rows that do not fit, a tuned build that fails, a locked database ----------

def _template_and_kernel(device, f, *args):
    """The template of f's first templated kernel on the device, the kernel and its DB key."""
    from tilefuse.runtime import tuner
    with tx.profile() as prof:
        tx.jit(f, device=device)(*args)
    for r in prof.records:
        info = r.info
        t = tuner.template_for(info.impl, info.kernel, info.device) if info.kernel is not None else None
        if t is not None:
            return t, info.kernel, (t.name, *t.key(info.kernel), tuner.device_key(info.device))
    pytest.skip(f"{device} has no tunable kernels")


def _store_row(key, params):
    from tilefuse.runtime import tuner
    row = dict(zip(("template", "signature", "shape_class", "device"), key))
    assert tuner.database().put({**row, "params": params, "seconds": 1.0, "default_seconds": 2.0,
                                 "trials": 1})


def _bad_rows(default: dict) -> list:
    """Rows of the template's parameter names with values no configuration has."""
    name = next(iter(default))
    rows = [{**default, name: 0}, {**default, name: -4}, {**default, name: 10**9},
            {**default, name: str(default[name])}, {**default, name: None}, {**default, name: 2.5},
            {k: v for k, v in default.items() if k != name}, {**default, "unknown": 1}, [1, 2]]
    if any(isinstance(v, bool) for v in default.values()):
        rows.append({k: (1 if isinstance(v, bool) else v) for k, v in default.items()})
    return rows


@pytest.mark.parametrize("kind", ["kernel", "gemm"])
def test_tuning_rows_that_do_not_fit_the_space_are_ignored(device, tmp_path, monkeypatch, kind):
    """Each stored value is checked against the template's space before use (a GEMM's kc=0 ran
    forever; others raised ZeroDivisionError, AssertionError, TypeError): ignored with a warning,
    the defaults run, the result is right."""
    from tilefuse.runtime import tuner
    monkeypatch.setattr(tx.config, "tuning_db", str(tmp_path / "tuning.sqlite"))
    monkeypatch.setattr(tx.config, "gemm", "generated")
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in ((96, 64), (64, 160)))
    f, args, want = ((lambda x: tnp.tanh(x) * 3.0 - 1.0, (a,), np.tanh(a) * 3 - 1) if kind == "kernel"
                     else (lambda x, y: x @ y, (a, b), a @ b))
    t, kernel, key = _template_and_kernel(device, f, *args)
    if kind == "gemm" and "gemm" not in t.name:
        pytest.skip(f"{device} has no GEMM template here")
    default = t.default(kernel, device)
    rows = _bad_rows(default)
    for params in rows:
        _store_row(key, params)
        tuner.applied.clear()
        with pytest.warns(tuner.TuningDBWarning, match=r"do not fit"):
            got = tx.jit(f, device=device)(*args)  # a fresh jit: the dispatcher builds again
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
        assert key not in tuner.applied, params


def test_a_tuned_build_that_fails_falls_back_to_the_defaults(device, tmp_path, monkeypatch):
    import dataclasses

    from tilefuse.runtime import tuner
    monkeypatch.setattr(tx.config, "tuning_db", str(tmp_path / "tuning.sqlite"))
    x = np.linspace(-2, 2, 300, dtype=np.float32)

    def f(v):
        return tnp.exp(-v * v) + 0.5
    t, kernel, key = _template_and_kernel(device, f, x)
    _store_row(key, t.default(kernel, device))

    def broken(kernel, device, backend, params):
        return 1 // 0
    monkeypatch.setattr(tuner, "_templates", [dataclasses.replace(x, build=broken) if x is t else x
                                              for x in tuner._templates])
    with pytest.warns(tuner.TuningDBWarning, match=r"did not build with the tuned parameters .*"
                                                   r"ZeroDivisionError.* defaults are used"):
        got = tx.jit(f, device=device)(x)
    np.testing.assert_allclose(np.asarray(got), np.exp(-x * x) + 0.5, rtol=1e-5, atol=1e-6)


HOLD_LOCK = r"""
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN " + sys.argv[2])
con.execute("INSERT OR REPLACE INTO tuned (template, signature, shape_class, device, params) "
            "VALUES ('t', 'uncommitted', 'c', 'd', '{}')")
print("LOCKED", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("lock", ["EXCLUSIVE", "IMMEDIATE"])
def test_a_locked_tuning_database_does_not_stall(device, tmp_path, monkeypatch, lock):
    """Another process holding the database (a write in progress) costs a read at most
    READ_TIMEOUT_S, never SQLite's 30 s: the compile goes on with the defaults; a writer that
    has not committed does not even slow a read (reads take no write lock)."""
    import time

    from tilefuse.runtime import tuner
    path = str(tmp_path / "tuning.sqlite")
    monkeypatch.setattr(tx.config, "tuning_db", path)
    _store_row(("t", "committed", "c", "d"), {"x": 1})
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, path, lock], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        db = tuner.TuningDB(path)
        t0 = time.perf_counter()
        if lock == "EXCLUSIVE":
            with pytest.warns(tuner.TuningDBWarning, match=r"locked by another process"):
                assert db.rows() == {}
        else:
            assert db.rows() == {("t", "committed", "c", "d"): {"x": 1}}
        x = np.arange(6, dtype=np.float32)
        got = tx.jit(lambda v: v * 2.0 + 7.0, device=device)(x)
        elapsed = time.perf_counter() - t0
        np.testing.assert_array_equal(np.asarray(got), x * 2 + 7)
        assert elapsed < 10, elapsed  # (a compile included; SQLite's default wait alone was 30 s)
    finally:
        holder.kill()
        holder.wait(timeout=60)


# ---- cache entries with a valid header over a damaged payload -----------------------------------

CACHED_RUN = r"""
import json, sys, warnings
import numpy as np
import tilefuse as tx, tilefuse.numpy as tnp
from tilefuse.runtime import compile_cache as cc
x = np.linspace(-1, 1, 96, dtype=np.float32).reshape(8, 12)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    a, b, c = tx.jit(lambda x: (tnp.tanh(x) * 1.5, tnp.exp(x).sum(0), (x * x).max(1)), device=sys.argv[1])(x)
    d = tx.jit(lambda x: x[:, :4] * 2.0 - 1.0, device=sys.argv[1])(x)  # a second graph
ok = (np.allclose(np.asarray(a), np.tanh(x) * 1.5, atol=1e-6) and np.allclose(np.asarray(b), np.exp(x).sum(0), rtol=1e-5)
      and np.allclose(np.asarray(c), (x * x).max(1)) and np.allclose(np.asarray(d), x[:, :4] * 2 - 1))
print(json.dumps({"ok": bool(ok), **cc.stats(), "warned": [str(m.message)[:200] for m in w]}))
"""


def _run_cached(device, cache_dir):
    env = {**os.environ, "TILEFUSE_CACHE_DIR": str(cache_dir), "TILEFUSE_COMPILE_WORKERS": "0"}
    out = subprocess.run([sys.executable, "-c", CACHED_RUN, device.name], env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rewrite_entries(folder, damage) -> int:
    """Give every entry a damaged payload under a header recomputed to match it."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".bin"))
    payloads = []
    for n in names:
        with open(os.path.join(folder, n), "rb") as f:
            payloads.append(cc._check(f.read(), n[:-4]))
    for i, n in enumerate(names):
        p = damage(payloads, i)
        header = cc._HEADER.pack(cc.MAGIC, bytes.fromhex(n[:-4]), len(p), hashlib.sha256(p).digest())
        with open(os.path.join(folder, n), "wb") as f:
            f.write(header + p)
    return len(names)


DAMAGE = {"garbage": lambda ps, i: b"\x7fELF" + bytes(range(256)) * 4,
          "truncated": lambda ps, i: ps[i][: len(ps[i]) // 2],
          "swapped": lambda ps, i: ps[(i + 1) % len(ps)]}  # another entry's payload


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_an_entry_that_does_not_load_is_rebuilt_and_replaced(device, tmp_path, damage):
    if device.kind == "ref":
        pytest.skip("ref caches nothing")
    first = _run_cached(device, tmp_path)
    assert first["ok"] and first["disk_writes"] > 0, first
    damaged = sum(_rewrite_entries(tmp_path / ns, DAMAGE[damage]) for ns in ("llvm", "frontend")
                  if os.path.isdir(tmp_path / ns))
    assert damaged >= 2
    second = _run_cached(device, tmp_path)  # every entry is a miss: rebuilt, replaced
    assert second["ok"] and second["corrupt"] >= 2 and second["disk_writes"] >= 2, second
    third = _run_cached(device, tmp_path)  # and the replacements load
    assert third["ok"] and third["corrupt"] == 0 and third["disk_writes"] == 0, third
    assert third["disk_hits"] == first["disk_writes"], (first, third)
