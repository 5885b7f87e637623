"""The persistent compile cache: entries round-trip, corrupt/truncated/stale entries are rebuilt,
and a second process compiles nothing."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from tilefuse.runtime import compile_cache as cc


@pytest.fixture
def cache(tmp_path):
    return cc.CompileCache("test", str(tmp_path))


def test_roundtrip_and_permissions(cache, tmp_path):
    key = cc.make_key("kernel text", ("params", 1))
    assert key != cc.make_key("kernel text", ("params", 2))
    cache.store(key, b"object code")
    assert cache.load(key) == b"object code"
    assert stat.S_IMODE(os.stat(cache.dir).st_mode) == 0o700
    assert os.listdir(cache.dir) == [key + ".bin"]  # no temporary files left


def _built(cache, key, payload=b"fresh"):
    calls = []

    def build():
        calls.append(1)
        return payload
    return cache.get_or_build(key, build), len(calls)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "other_key", "magic"])
def test_damaged_entry_is_rebuilt(cache, damage):
    key, other = cc.make_key("a"), cc.make_key("b")
    cache.store(key, b"original payload")
    path = cache.path(key)
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[-3] ^= 0xFF
    elif damage == "truncate":
        data = data[:-4]
    elif damage == "empty":
        data = b""
    elif damage == "other_key":  # a stale entry written for another key
        cache.store(other, b"original payload")
        data = open(cache.path(other), "rb").read()
    else:
        data[:8] = b"NOTCACHE"
    open(path, "wb").write(bytes(data))
    before = cc.stats()
    payload, builds = _built(cache, key)
    after = cc.stats()
    assert payload == b"fresh" and builds == 1
    assert after["corrupt"] == before["corrupt"] + 1 and after["compiles"] == before["compiles"] + 1
    assert cache.load(key) == b"fresh"  # rewritten


def test_disabled(monkeypatch):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", "off")
    assert cc.default_dir() is None
    c = cc.CompileCache("x", None)
    assert _built(c, cc.make_key("k")) == (b"fresh", 1)


CHILD = r"""
import json, sys
import numpy as np
from tilefuse.backends.llvm import create
from tilefuse.ir.kernel import ir as K
from tilefuse.runtime import compile_cache
f32 = np.dtype(np.float32)
x = K.load(0, K.idx(0), f32)
ks = [K.Kernel("k%d" % i, (K.Buffer("x", f32, 100), K.Buffer("y", f32, 100)), 1, (100,), (),
               (K.Store(1, K.idx(0), K.unary(op, x) + float(i)),)) for i, op in enumerate(["exp", "tanh"])]
be = create()
xs = np.linspace(-1, 1, 100).astype(np.float32)
ok = True
for i, (k, f) in enumerate(zip(ks, [np.exp, np.tanh])):
    y = np.empty(100, np.float32)
    be.compile_kernel(k)([xs, y])
    ok &= bool(np.allclose(y, f(xs) + i, rtol=1e-6))
print(json.dumps({**compile_cache.stats(), "ok": ok}))
"""


def _child(tmp_path, code=CHILD):
    """Run `code` in a new process on the cache in tmp_path; its last line of output, as JSON."""
    env = {**os.environ, "TILEFUSE_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_compiles_nothing_and_corrupt_entry_recompiles(tmp_path):
    first = _child(tmp_path)
    assert first["ok"] and first["compiles"] == 2 and first["disk_writes"] == 2
    second = _child(tmp_path)
    assert second["ok"] and second["compiles"] == 0 and second["disk_hits"] == 2
    d = os.path.join(str(tmp_path), "llvm")
    victim = os.path.join(d, sorted(os.listdir(d))[0])
    with open(victim, "r+b") as f:  # damage the object code inside a valid-looking header
        f.seek(200)
        f.write(b"\x00" * 64)
    third = _child(tmp_path)
    assert third["ok"] and third["compiles"] == 1 and third["corrupt"] == 1 and third["disk_hits"] == 1


def test_prune_keeps_recent(cache, monkeypatch):
    keys = [cc.make_key(i) for i in range(10)]
    for i, k in enumerate(keys):
        cache.store(k, b"x")
        os.utime(cache.path(k), (1000 + i, 1000 + i))
    assert cache.load(keys[0]) == b"x"  # used now: the most recent
    assert cache.prune(5) == 6  # down to 80% of 5
    left = sorted(os.listdir(cache.dir))
    assert len(left) == 4 and keys[0] + ".bin" in left and keys[9] + ".bin" in left


# ---- the front-end cache: a traced graph -> optimised graph, regions, lowered kernels -------

FRONT_CHILD = r"""
import json
import numpy as np
import tilefuse as tx, tilefuse.numpy as tnp
from tilefuse.runtime import compiler
runs = []
passes = compiler.run_passes
compiler.run_passes = lambda *a, **k: runs.append(1) or passes(*a, **k)
w = np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6)  # a constant of the graph
def f(x):
    e = tnp.exp(x @ w - 1.0)
    return e / e.sum(-1, keepdims=True), tnp.argmax(x, axis=1)
x = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
y, i = tx.jit(f, device="cpu")(x)
e = np.exp(x @ w - 1.0)
ok = np.allclose(np.asarray(y), e / e.sum(-1, keepdims=True), rtol=1e-5) and (np.asarray(i) == x.argmax(1)).all()
print(json.dumps({"passes": len(runs), "ok": bool(ok)}))
"""


def test_second_process_skips_the_front_end(tmp_path):
    """The passes, fusion and lowering run once; a second process reads what they made."""
    assert _child(tmp_path, FRONT_CHILD) == {"passes": 1, "ok": True}
    assert _child(tmp_path, FRONT_CHILD) == {"passes": 0, "ok": True}


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_tampered_front_end_entry_runs_no_code(tmp_path, monkeypatch):
    """An entry holding anything but the IR's own classes is a miss, never executed."""
    import pickle

    import numpy as np

    import tilefuse as tx
    from tilefuse.runtime import frontend_cache
    cache = cc.CompileCache("frontend", str(tmp_path))
    monkeypatch.setattr(frontend_cache, "_cache", lambda: cache)
    monkeypatch.chdir(tmp_path)
    f = tx.jit(lambda x: x * 2.0 + 1.0, device="cpu")
    x = np.arange(5, dtype=np.float32)
    key = frontend_cache.key(f.lower(x).graph, True)
    assert key is not None and key != frontend_cache.key(tx.jit(lambda x: x * 3.0 + 1.0).lower(x).graph, True)
    cache.store(key, pickle.dumps(_Evil()))
    np.testing.assert_allclose(np.asarray(f(x)), x * 2 + 1)
    assert not os.path.exists(tmp_path / "PWNED")
