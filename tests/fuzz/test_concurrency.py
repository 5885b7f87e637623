"""Concurrency: one jitted function called from 8 threads at once (same and different shapes)
gives the right answers and traces each signature once, while other threads trace other
functions (the trace stack is per thread); processes filling one compile cache directory at once
never read a half-written entry."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np

import tilefuse as tx
import tilefuse.numpy as tnp

N_THREADS = 8


def _loss(w, x):
    return tnp.sum(tnp.tanh(x @ w) ** 2)


def test_one_jitted_function_from_eight_threads(device):
    f = tx.jit(lambda w, x: (tnp.tanh(x @ w) * 2.0 + 1.0, tnp.sum(x, axis=0)))
    g = tx.jit(tx.grad(_loss))  # traced by other threads meanwhile: autodiff traces nest in jit's
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    xs = [rng.standard_normal((2 + i % 2, 4)).astype(np.float32) for i in range(N_THREADS)]
    barrier = threading.Barrier(N_THREADS)
    results, errors = [None] * N_THREADS, []

    def work(i):
        try:
            barrier.wait()
            outs = []
            for _ in range(3):
                a, b = f(w, xs[i])
                outs.append((np.asarray(a), np.asarray(b)))
                graph = tx.make_graph(lambda x: tnp.exp(x) * i)(xs[i])  # a trace of its own
                assert graph.count("exp") == 1
            outs.append(np.asarray(g(w, xs[i])))
            results[i] = outs
        except BaseException as e:  # noqa: BLE001 - reported below with the thread's number
            errors.append((i, e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    # two shapes, each traced at most once (the second reuses the first's trace where its guards
    # allow: tracer/shape_poly.py; whether they do depends on which came first)
    assert 1 <= f.trace_count <= 2 and 1 <= g.trace_count <= 2
    for i, outs in enumerate(results):
        want_a = np.tanh(xs[i] @ w) * 2 + 1
        for a, b in outs[:3]:
            np.testing.assert_allclose(a, want_a, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(b, xs[i].sum(0), rtol=1e-5, atol=1e-6)
        t = np.tanh(xs[i] @ w)
        np.testing.assert_allclose(outs[3], xs[i].T @ (2 * t * (1 - t * t)), rtol=1e-4, atol=1e-5)


# ---- two processes, one cache directory --------------------------------------------------------

HAMMER = r"""
import hashlib, json, sys
from tilefuse.runtime import compile_cache as cc
cache = cc.CompileCache("race", sys.argv[1])
seen = {"torn": 0, "hits": 0, "misses": 0}
for round_ in range(20):
    for k in range(8):
        key = cc.make_key("entry", k)
        # payloads of 256 KiB: a reader that saw a half-written file would get a short one
        payload = hashlib.sha256(str(k).encode()).digest() * 8192
        got = cache.load(key)
        if got is None:
            seen["misses"] += 1
            cache.store(key, payload)
        elif got != payload:
            seen["torn"] += 1
        else:
            seen["hits"] += 1
print(json.dumps({**seen, **cc.stats()}))
"""


def test_two_processes_filling_one_cache_never_read_a_torn_entry(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "error::RuntimeWarning"}  # a corrupt-entry warning fails
    procs = [subprocess.Popen([sys.executable, "-c", HAMMER, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for r in reports:
        assert r["torn"] == 0 and r["corrupt"] == 0, r
        assert r["hits"] + r["misses"] == 20 * 8
    left = os.listdir(tmp_path / "race")
    assert len(left) == 8 and all(n.endswith(".bin") for n in left), left  # no temporary files


def test_jit_in_two_processes_sharing_a_cache_dir(tmp_path):
    """End to end: two processes compile the same kernels into one directory at once; both are
    right and neither meets a damaged entry (a second run compiling nothing is in
    tests/backends/test_compile_cache.py)."""
    child = r"""
import json, numpy as np, tilefuse as tx, tilefuse.numpy as tnp
from tilefuse.runtime import compile_cache as cc
x = np.linspace(-2, 2, 64, dtype=np.float32).reshape(8, 8)
fs = [lambda x, k=k: tnp.tanh(x * (k + 1)) @ x + k for k in range(2)]
ok = all(np.allclose(np.asarray(tx.jit(f, device="cpu")(x)), np.tanh(x * (k + 1)) @ x + k,
                     rtol=1e-5, atol=1e-5) for k, f in enumerate(fs))
print(json.dumps({**cc.stats(), "ok": ok}))
"""
    env = {**os.environ, "TILEFUSE_CACHE_DIR": str(tmp_path)}

    def start():
        return subprocess.Popen([sys.executable, "-c", child], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    def report(p):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        return json.loads(out.strip().splitlines()[-1])
    reports = [report(p) for p in (start(), start())]
    assert all(r["ok"] and r["corrupt"] == 0 for r in reports), reports
    assert all(not n.startswith(".tmp") for n in os.listdir(tmp_path / "llvm"))



# ---- the device registry's first use, from eight threads at once --------------------------------

FIRST_USE = r"""
import json, sys, threading
import numpy as np
import tilefuse as tx
name, n = sys.argv[1], 8
barrier = threading.Barrier(n)
got = [None] * n
def work(i):
    barrier.wait()
    got[i] = tx.device_put(np.full(3, float(i), np.float32), name)  # the first use of the kind
    got[i] = tx.jit(lambda a: a * 2.0 - float(i))(got[i])  # and its first compiles
threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
total = got[0]
for a in got[1:]:
    total = total + a  # arrays made by different threads combine
y = tx.jit(lambda a, b: a * b)(got[2], got[5])
print(json.dumps({"devices": len({id(a.device) for a in got}), "same": got[0].device is tx.get_device(name),
                  "total": np.asarray(total).tolist(), "y": np.asarray(y).tolist()}))
"""


def test_first_use_of_a_device_from_eight_threads_makes_one_device(device):
    out = subprocess.run([sys.executable, "-c", FIRST_USE, device.name], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["devices"] == 1 and r["same"], r
    assert r["total"] == [28.0] * 3 and r["y"] == [10.0] * 3, r
