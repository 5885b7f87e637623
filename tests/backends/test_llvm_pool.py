"""The CPU thread pool (backends/llvm/pool.py): every chunk of a launch runs exactly once, chunks
run on two threads at once, launches from several Python threads and from a forked child are
right, and a worker that has gone to sleep is woken by the next launch."""
from __future__ import annotations

import ctypes
import multiprocessing
import sys
import threading
import time

import numpy as np
import pytest

from tilefuse.backends.llvm.compile import BUILDER_CHUNKS, KernelFn, get_target, split
from tilefuse.backends.llvm.pool import ThreadPool
from tilefuse.runtime.hardware import host_info

# count(ptrs, s, e): out[i] += 1 for i in [s, e), out = ptrs[0]
# meet(ptrs, s, e): chunk 1 raises flags[8]; chunk 0 waits (bounded) for it and records in flags[0]
# whether it came, i.e. whether another thread ran chunk 1 while chunk 0 ran
IR = r"""
define void @tf_test_count(i8** %p, i64 %s, i64 %e) {
entry:
  %o8 = load i8*, i8** %p
  %out = bitcast i8* %o8 to i64*
  %any = icmp slt i64 %s, %e
  br i1 %any, label %loop, label %done
loop:
  %i = phi i64 [ %s, %entry ], [ %i1, %loop ]
  %at = getelementptr i64, i64* %out, i64 %i
  %v = load i64, i64* %at
  %v1 = add i64 %v, 1
  store i64 %v1, i64* %at
  %i1 = add i64 %i, 1
  %more = icmp slt i64 %i1, %e
  br i1 %more, label %loop, label %done
done:
  ret void
}

define void @tf_test_meet(i8** %p, i64 %s, i64 %e) {
entry:
  %f8 = load i8*, i8** %p
  %flags = bitcast i8* %f8 to i64*
  %flag = getelementptr i64, i64* %flags, i64 8
  %first = icmp eq i64 %s, 0
  br i1 %first, label %wait, label %raise
raise:
  store atomic i64 1, i64* %flag release, align 8
  ret void
wait:
  %n = phi i64 [ 0, %entry ], [ %n1, %again ]
  %v = load atomic i64, i64* %flag acquire, align 8
  %seen = icmp eq i64 %v, 1
  br i1 %seen, label %met, label %again
again:
  %n1 = add i64 %n, 1
  %give_up = icmp ugt i64 %n1, 2000000000
  br i1 %give_up, label %out, label %wait
met:
  store i64 1, i64* %flags
  br label %out
out:
  ret void
}
"""


@pytest.fixture(scope="module")
def kernels():
    target = get_target(host_info())
    obj = target.compile_ir(IR, "tf_test_count", "pool test")
    count = target.load(obj, "tf_test_count", IR, "pool test", others=("tf_test_meet",))
    return KernelFn(count), KernelFn(target.loaded["tf_test_meet"][0])


def _count(pool, fn, size, bounds) -> np.ndarray:
    out = np.zeros(size, np.int64)
    ptrs = (ctypes.c_void_p * 1)(out.ctypes.data)
    pool.launcher(fn, bounds)(ptrs)
    return out


def test_every_chunk_runs_once(kernels):
    count, _ = kernels
    pool = ThreadPool(3)
    rng = np.random.default_rng(0)
    for _ in range(200):
        size = int(rng.integers(1, 5000))
        cuts = np.unique(np.concatenate([[0, size], rng.integers(0, size, int(rng.integers(0, 12)))]))
        bounds = list(zip(cuts[:-1], cuts[1:]))
        np.testing.assert_array_equal(_count(pool, count, size, bounds), np.ones(size, np.int64))


def test_a_builders_launch_is_split_in_ordered_chunks_covering_every_task_once():
    for tasks in (1, 2, 3, 7, 16, 17, 100, 1000):
        for cores in (1, 2, 3, 64):
            threads, bounds = split(tasks, None, cores)
            assert threads == min(cores, tasks)
            if threads == 1:
                assert bounds is None
                continue
            assert [s for s, _ in bounds] == [0] + [e for _, e in bounds[:-1]] and bounds[-1][1] == tasks
            assert all(s < e for s, e in bounds)
            # more chunks than threads where there are tasks for them: a slowed core takes fewer
            assert min(tasks, 2 * threads) <= len(bounds) <= threads * BUILDER_CHUNKS


def test_chunks_run_on_two_threads_at_once(kernels):
    _, meet = kernels
    pool = ThreadPool(2)
    met = []
    for _ in range(5):
        flags = np.zeros(16, np.int64)
        pool.launcher(meet, [(0, 1), (1, 2)])((ctypes.c_void_p * 1)(flags.ctypes.data))
        met.append(flags[0])
    assert any(met)  # a late worker leaves both chunks to the caller at worst; not five times


def test_launches_from_several_python_threads(kernels):
    count, _ = kernels
    pool = ThreadPool(2)
    errors = []

    def launches(seed):
        rng = np.random.default_rng(seed)
        for _ in range(100):
            size = int(rng.integers(64, 2000))
            half = size // 2
            if not np.array_equal(_count(pool, count, size, [(0, half), (half, size)]), np.ones(size)):
                errors.append(seed)
    threads = [threading.Thread(target=launches, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_a_sleeping_worker_is_woken_by_the_next_launch(kernels, monkeypatch):
    from tilefuse.runtime.config import config
    _, meet = kernels
    pool = ThreadPool(2)
    flags = np.zeros(16, np.int64)
    launch = pool.launcher(meet, [(0, 1), (1, 2)])
    launch((ctypes.c_void_p * 1)(flags.ctypes.data))  # starts the worker
    monkeypatch.setattr(config, "pool_spin_us", 0)  # it sleeps at once after each launch from now on
    met = []
    for _ in range(5):
        time.sleep(0.01)
        flags[:] = 0
        launch((ctypes.c_void_p * 1)(flags.ctypes.data))
        met.append(flags[0])
    assert any(met), (pool._sleeping, pool._desc[::8].tolist(), pool._spins_per_us,
                      [(t.name, t.is_alive()) for t in threading.enumerate()])


def _child(conn):
    from tilefuse.backends.llvm.pool import get_pool
    target = get_target(host_info())
    obj = target.compile_ir(IR, "tf_test_count", "pool test")
    count = KernelFn(target.load(obj, "tf_test_count", IR, "pool test", others=("tf_test_meet",)))
    conn.send(_count(get_pool(2), count, 1000, [(0, 500), (500, 1000)]).tolist())


@pytest.mark.skipif(sys.platform != "linux", reason="fork is the start method tested here")
def test_a_forked_child_starts_its_own_workers(kernels):
    from tilefuse.backends.llvm.pool import get_pool
    count, _ = kernels
    _count(get_pool(2), count, 10, [(0, 5), (5, 10)])  # the parent's pool has started
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(child,))
    p.start()
    assert parent.poll(60), "the child did not answer"
    assert parent.recv() == [1] * 1000
    p.join(10)
