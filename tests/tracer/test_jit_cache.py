"""The bounded jit cache: least recently used entries evicted past config.jit_cache_size, an
evicted signature compiled again with the same results, clearing that frees device memory,
memory flat over many signatures, eviction beside a concurrent call. On every device."""
from __future__ import annotations

import gc
import threading
import tracemalloc
import weakref

import numpy as np
import pytest

import tilefuse as tx
from tilefuse.runtime import device as device_mod
from tilefuse.runtime import tiered


@pytest.fixture
def bound(monkeypatch):
    """Sets the jit cache's bound. What earlier tests left is frozen out of the garbage collector
    meanwhile: the gc.collect() calls in a loop then scan only what the test makes (in a worker
    that ran a thousand tests, each full collection took about 0.4 s)."""
    def set_bound(n):
        monkeypatch.setattr(tx.config, "jit_cache_size", n)
    gc.freeze()
    try:
        yield set_bound
    finally:
        gc.unfreeze()


def _compiled(f):
    """Wait for f's compiled programs (under TILEFUSE_TIERED=1 calls interpret while they build),
    and for any build earlier tests left queued (it would allocate while memory is measured):
    these tests measure what compiled programs hold."""
    for e in list(f._cache.values()):
        getattr(e.executable, "wait", lambda: None)()
    assert tiered.wait_idle(120)


def _ones(n):
    return np.arange(n, dtype=np.float32)


def test_least_recently_used_is_evicted_and_recompiles_right(device, bound, monkeypatch):
    monkeypatch.setattr(tx.config, "shape_generic", False)  # trace_count counts the compiles
    bound(3)
    f = tx.jit(lambda a: a * 2 + 1)
    for n in (1, 2, 3):
        f(_ones(n))
    f(_ones(1))  # 1 is now the most recently used: 2 is the oldest
    f(_ones(4))
    assert f.cache_size() == 3 and f.trace_count == 4
    for n in (1, 3, 4):  # kept: no trace
        np.testing.assert_allclose(np.asarray(f(_ones(n))), _ones(n) * 2 + 1)
    assert f.trace_count == 4
    np.testing.assert_allclose(np.asarray(f(_ones(2))), _ones(2) * 2 + 1)  # evicted: again
    assert f.trace_count == 5 and f.cache_size() == 3


def test_device_arrays_in_use_the_same_bound(device, bound, monkeypatch):
    monkeypatch.setattr(tx.config, "shape_generic", False)  # trace_count counts the compiles
    bound(2)
    f = tx.jit(lambda a: a - 1)
    xs = [tx.device_put(_ones(n), device) for n in (1, 2, 3, 1)]
    outs = [np.asarray(f(x)) for x in xs]
    for x, o in zip(xs, outs):
        np.testing.assert_allclose(o, np.asarray(x) - 1)
    assert f.cache_size() == 2 and f.trace_count == 4  # 1 was evicted by 3, then traced again


def test_clear_cache_frees_the_pool(device):
    const = np.linspace(0, 1, 1 << 16, dtype=np.float32)  # 256 KiB on the device, per entry
    f = tx.jit(lambda a: a + const)
    x = np.ones(1 << 16, np.float32)
    np.testing.assert_allclose(np.asarray(f(x)), x + const)
    _compiled(f)
    held = device.memory_stats()
    if not held:
        pytest.skip(f"{device} has no pool")
    f.clear_cache()
    gc.collect()
    after = device.memory_stats()
    assert after["bytes_in_use"] <= held["bytes_in_use"] - const.nbytes
    tx.clear_caches()
    assert device.memory_stats()["bytes_reserved"] <= after["bytes_reserved"] - const.nbytes
    np.testing.assert_allclose(np.asarray(f(x)), x + const)  # traced and compiled again


def test_memory_is_flat_over_many_signatures(device, bound):
    """300 signatures (a static argument: the kernels are the same, so what grows is the jit's
    own: entries, executables, graphs, device constants) with room for 8."""
    bound(8)
    const = np.ones(1 << 14, np.float32)  # 64 KiB on the device per entry
    f = tx.jit(lambda a, k: a * const, static_argnums=1)
    x = np.ones(1 << 14, np.float32)

    def run(ks):
        for k in ks:
            f(x, k)
            _compiled(f)
        gc.collect()
        snapshot = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None
        return snapshot, device.memory_stats().get("bytes_in_use", 0)

    run(range(20))
    tracemalloc.start()
    try:
        py0, pool0 = run(range(20, 100))
        py1, pool1 = run(range(100, 300))
        py2, _ = run(range(300, 500))
    finally:
        tracemalloc.stop()
    assert f.cache_size() == 8
    # two windows of 200 signatures: what each keeps grows in both, while a process-wide table
    # that other tests filled may double its storage once in either (a WeakKeyDictionary's
    # 288 KiB, a full run's registry of graphs, measured once in a window of 200)
    grown = min((b.compare_to(a, "lineno") for a, b in ((py0, py1), (py1, py2))),
                key=lambda g: sum(s.size_diff for s in g))
    kept = sum(s.size_diff for s in grown)
    assert kept < 200_000, f"{kept / 200:.0f} bytes kept per signature, most at:\n" + "\n".join(
        str(s) for s in grown[:8])
    assert pool1 <= pool0


def test_new_shapes_keep_the_pool_bounded(device, bound):
    bound(4)
    f = tx.jit(lambda a: a + np.float32(1) + np.arange(4096, dtype=np.float32).sum())
    sizes = []
    for n in range(1, 25):
        np.testing.assert_allclose(np.asarray(f(_ones(n))), _ones(n) + 1 + 4095 * 4096 / 2, rtol=1e-6)
        gc.collect()
        sizes.append(device.memory_stats().get("bytes_in_use", 0))
    assert f.cache_size() == 4 and max(sizes[8:]) <= max(sizes[:8])


def test_eager_operations_are_bounded(device, bound):
    bound(4)
    for n in range(1, 12):
        tx.numpy.sin(tx.device_put(_ones(n), device))
    assert len(device_mod._eager_cache) <= 4


def test_eviction_beside_a_concurrent_call(device, bound):
    """One thread calls a cached signature while another evicts and clears: every call answers."""
    bound(1)
    f = tx.jit(lambda a: a * 3)
    x = _ones(5)
    f(x)
    done, errors, answers = threading.Event(), [], []

    def caller():
        try:
            while not done.is_set():
                answers.append(np.asarray(f(x)))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=caller)
    t.start()
    try:
        for i in range(6):
            f(_ones(6 + i % 2))  # evicts x's entry (room for one)
            if i % 3 == 2:
                f.clear_cache()
    finally:
        done.set()
        t.join()
    assert not errors, errors
    assert answers and all(np.array_equal(a, x * 3) for a in answers)


def test_outputs_are_freed_without_the_garbage_collector(device):
    """A call's outputs (and their device blocks) go when the caller drops them: nothing on the
    call path keeps them in a reference cycle."""
    f = tx.jit(lambda a, b: (a + 1, {"b": b * 2}))
    x = _ones(4)
    f(x, x)
    gc.disable()
    try:
        out = f(x, b=x)  # (keyword: the general path too)
        first, second = weakref.ref(out[0]), weakref.ref(out[1]["b"])
        del out
        assert first() is None and second() is None
    finally:
        gc.enable()
