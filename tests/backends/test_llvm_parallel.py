"""Compiling a graph's kernels in parallel worker processes (backends/llvm/parallel.py)."""
from __future__ import annotations

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse.backends.llvm import parallel


def _fresh_program():
    """A function whose kernels no cache holds: its constant is new in every test run."""
    c = float(np.random.default_rng().integers(1, 10**6)) / 10**6

    def f(x):
        return tnp.exp(x * c).sum(0), tnp.tanh(x + c).max(1), tnp.sqrt(tnp.abs(x) + c).min(0), \
            (x - c) * 2.0, tnp.log1p(tnp.abs(x) * c).mean(1)
    want = lambda x: (np.exp(x * c).sum(0), np.tanh(x + c).max(1), np.sqrt(np.abs(x) + c).min(0),
                      (x - c) * 2.0, np.log1p(np.abs(x) * c).mean(1))
    return f, want


@pytest.mark.parametrize("worker_fails", [False, True])
def test_graph_kernels_build_in_workers(monkeypatch, worker_fails):
    cpu = tx.devices("cpu")[0]
    monkeypatch.setenv("TILEFUSE_COMPILE_WORKERS", "2")
    monkeypatch.setattr(parallel, "MIN_KERNELS", 2)
    taken = []
    take = parallel.take
    monkeypatch.setattr(parallel, "take", lambda key: taken.append(take(key)) or taken[-1])
    if worker_fails:  # a worker that dies only costs the parallelism
        monkeypatch.setattr(parallel._Worker, "build", lambda self, job: None)
    f, want = _fresh_program()
    x = np.random.default_rng(0).standard_normal((8, 33)).astype(np.float32) * 0.1
    got = tx.jit(f, device=cpu)(x)
    for g, w in zip(got, want(x)):
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=1e-5)
    built = [t for t in taken if t is not None]
    assert len(built) >= 2  # this process and (unless it failed) the worker built them
    assert not parallel._built  # every object built was used
