"""The CPU thread pool: persistent workers that take a launch's chunks in native code.

A launch is a kernel fn(ptrs, s, e) over chunks (s, e). The caller posts it in a small shared
descriptor and works on the chunks itself; the workers, spinning on the descriptor's generation
counter, claim the rest with a compare-and-swap. Everything from the post to the last chunk runs in
native code with the GIL released (a small LLVM module below), and a worker that
has just finished a launch spins for tx.config.pool_spin_us (300 µs) before it sleeps, so that the next kernel of a
program finds it awake: waking a sleeping thread through the GIL and a queue cost 20-45 µs per
launch on this project's 2-core VMs (benchmarks/bench_elementwise.py --threshold), more than a
parallel 1M-point kernel saves. The caller never waits for a worker, only for chunks a worker
has claimed: a worker that wakes late finds nothing left, and the launch is not held up.

The descriptor, in 64-bit words, each contended word on its own cache line:
    0 gen      the launch's generation; the caller publishes a launch by storing it (release)
    8 fn, 9 ptrs, 10 bounds (2n words: s0, e0, s1, e1, ...), 11 n
    16 next    (gen << 32) | the next unclaimed chunk: a claim is a CAS that also checks the gen,
               so a worker still holding an old launch's fields can never run a new one's chunk
    24 done    chunks finished in this launch"""
from __future__ import annotations

import ctypes
import os
import queue
import threading
import time

import numpy as np

from tilefuse.runtime import compile_cache
from tilefuse.runtime.config import config
from tilefuse.runtime.hardware import host_info

# A worker's busy wait for the next launch before it sleeps (like OpenMP's KMP_BLOCKTIME): 0 for
# a machine whose cores other work needs more than the launches' latency.
config.define("pool_spin_us", 300, env="TILEFUSE_POOL_SPIN_US")
YIELD_AFTER_US = 50  # the caller, waiting for a worker's last chunk, yields its core after this
GEN, FN, PTRS, BOUNDS, N, NEXT, DONE = 0, 8, 9, 10, 11, 16, 24
WORDS = 32

_IR = r"""
declare void @llvm.x86.sse2.pause()
declare i32 @sched_yield()

define internal void @claim_chunks(i64* %d, i64 %g) {
entry:
  %fnp = getelementptr i64, i64* %d, i64 8
  %fni = load i64, i64* %fnp
  %fn = inttoptr i64 %fni to void (i8*, i64, i64)*
  %pp = getelementptr i64, i64* %d, i64 9
  %pi = load i64, i64* %pp
  %ptrs = inttoptr i64 %pi to i8*
  %bp = getelementptr i64, i64* %d, i64 10
  %bi = load i64, i64* %bp
  %bounds = inttoptr i64 %bi to i64*
  %np = getelementptr i64, i64* %d, i64 11
  %n = load i64, i64* %np
  %nextp = getelementptr i64, i64* %d, i64 16
  %donep = getelementptr i64, i64* %d, i64 24
  %gl = and i64 %g, 4294967295
  br label %claim
claim:
  %cur = load atomic i64, i64* %nextp acquire, align 8
  br label %try
try:
  %c = phi i64 [ %cur, %claim ], [ %old, %cas ]
  %cg = lshr i64 %c, 32
  %idx = and i64 %c, 4294967295
  %same = icmp eq i64 %cg, %gl
  %left = icmp ult i64 %idx, %n
  %ok = and i1 %same, %left
  br i1 %ok, label %cas, label %out
cas:
  %c1 = add i64 %c, 1
  %r = cmpxchg i64* %nextp, i64 %c, i64 %c1 acq_rel acquire
  %old = extractvalue { i64, i1 } %r, 0
  %won = extractvalue { i64, i1 } %r, 1
  br i1 %won, label %run, label %try
run:
  %i2 = shl i64 %idx, 1
  %sp = getelementptr i64, i64* %bounds, i64 %i2
  %s = load i64, i64* %sp
  %ep = getelementptr i64, i64* %sp, i64 1
  %e = load i64, i64* %ep
  call void %fn(i8* %ptrs, i64 %s, i64 %e)
  %unused = atomicrmw add i64* %donep, i64 1 release
  br label %claim
out:
  ret void
}

define i64 @tf_pool_post(i64* %d, i64 %fn, i64 %ptrs, i64 %bounds, i64 %n) {
entry:
  %g0 = load i64, i64* %d
  %g = add i64 %g0, 1
  %fnp = getelementptr i64, i64* %d, i64 8
  store i64 %fn, i64* %fnp
  %pp = getelementptr i64, i64* %d, i64 9
  store i64 %ptrs, i64* %pp
  %bp = getelementptr i64, i64* %d, i64 10
  store i64 %bounds, i64* %bp
  %np = getelementptr i64, i64* %d, i64 11
  store i64 %n, i64* %np
  %donep = getelementptr i64, i64* %d, i64 24
  store atomic i64 0, i64* %donep monotonic, align 8
  %gl = and i64 %g, 4294967295
  %first = shl i64 %gl, 32
  %nextp = getelementptr i64, i64* %d, i64 16
  store atomic i64 %first, i64* %nextp release, align 8
  store atomic i64 %g, i64* %d release, align 8
  ret i64 %g
}

define void @tf_pool_join(i64* %d, i64 %g, i64 %n, i64 %spins) {
entry:
  %donep = getelementptr i64, i64* %d, i64 24
  call void @claim_chunks(i64* %d, i64 %g)
  br label %wait
wait:
  %k = phi i64 [ 0, %entry ], [ %k1, %relax ], [ %k1, %yield ]
  %done = load atomic i64, i64* %donep acquire, align 8
  %all = icmp uge i64 %done, %n
  %k1 = add i64 %k, 1
  br i1 %all, label %out, label %long
long:
  %patient = icmp ult i64 %k, %spins
  br i1 %patient, label %relax, label %yield
relax:
  PAUSE
  br label %wait
yield:
  %unused = call i32 @sched_yield()
  br label %wait
out:
  ret void
}

define i64 @tf_pool_wait(i64* %d, i64 %seen0, i64 %spins) {
entry:
  br label %loop
loop:
  %seen = phi i64 [ %seen0, %entry ], [ %seen, %relax ], [ %g, %job ]
  %i = phi i64 [ 0, %entry ], [ %i1, %relax ], [ 0, %job ]
  %g = load atomic i64, i64* %d acquire, align 8
  %new = icmp ne i64 %g, %seen
  br i1 %new, label %job, label %idle
job:
  call void @claim_chunks(i64* %d, i64 %g)
  br label %loop
idle:
  %i1 = add i64 %i, 1
  %more = icmp ult i64 %i1, %spins
  br i1 %more, label %relax, label %out
relax:
  PAUSE
  br label %loop
out:
  ret i64 %seen
}
"""

_POST_T = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_int64)
_JOIN_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
_WAIT_T = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
_native: dict = {}


def _functions():
    """(tf_pool_post, tf_pool_join, tf_pool_wait, spins per µs), compiled once per process."""
    if not _native:
        from .compile import code_digest, get_target
        target = get_target(host_info())
        pause = "call void @llvm.x86.sse2.pause()" if target.triple.startswith(("x86_64", "i686")) else ""
        text = _IR.replace("PAUSE", pause)
        key = compile_cache.make_key("pool", code_digest("pool.py"), target.fingerprint)
        post = target.cache.get_or_build(
            key, lambda: target.compile_ir(text, "tf_pool_post", "thread pool"),
            lambda obj: target.load(obj, "tf_pool_post", text, "thread pool", others=("tf_pool_join", "tf_pool_wait")))
        _native["post"], _native["join"], _native["wait"] = (
            _POST_T(post), _JOIN_T(target.loaded["tf_pool_join"][0]), _WAIT_T(target.loaded["tf_pool_wait"][0]))
        _native["spins_per_us"] = _calibrate(_native["wait"])
    return _native["post"], _native["join"], _native["wait"], _native["spins_per_us"]


def _calibrate(wait) -> float:
    """Idle spins per microsecond (a pause is ~10-150 cycles, by CPU)."""
    d = np.zeros(WORDS, np.int64)
    n = 20_000
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        wait(d.ctypes.data, 0, n)
        best = min(best, time.perf_counter() - t)
    return n / max(best * 1e6, 1e-3)


class ThreadPool:
    """n threads in all: the caller and n - 1 workers (started on the first launch)."""

    def __init__(self, n_threads: int):
        self.n = max(1, n_threads)
        self._lock = threading.Lock()
        self._pid = None

    def _start(self):
        self._post, self._join, self._wait, self._spins_per_us = _functions()
        self._patience = max(1, int(YIELD_AFTER_US * self._spins_per_us))
        self._desc = np.zeros(WORDS, np.int64)  # 256 bytes: the four contended words on their own lines
        self._addr = self._desc.ctypes.data
        self._queues = [queue.SimpleQueue() for _ in range(self.n - 1)]
        self._sleeping = [False] * (self.n - 1)
        self._pid = os.getpid()
        for i in range(self.n - 1):
            threading.Thread(target=self._worker, args=(i, self._desc, self._queues[i]), daemon=True,
                             name=f"tilefuse-cpu-{i}").start()

    def _worker(self, i, desc, q):
        seen, addr = 0, desc.ctypes.data
        while True:
            spins = max(1, int(config.pool_spin_us * self._spins_per_us))
            seen = self._wait(addr, seen, spins)  # GIL released: spins, runs chunks
            self._sleeping[i] = True  # no launch for pool_spin_us: sleep until _launch wakes this worker
            if int(desc[GEN]) == seen:  # (a launch posted since the spin ended is taken at once)
                q.get()
            self._sleeping[i] = False

    def launcher(self, fn, bounds):
        """A callable launch(ptrs): fn(ptrs, s, e) for every (s, e) in bounds, spread over the
        threads; ptrs a ctypes array (the addresses of fn and bounds are taken once, here)."""
        return _Launch(self, fn, bounds)

    def _launch(self, launch, ptrs):
        if self._pid != os.getpid():  # first use, or a forked child: it inherits no threads
            with self._lock:
                if self._pid != os.getpid():
                    self._start()
        if not self._lock.acquire(blocking=False):  # another thread launches on this pool: run alone
            for s, e in launch.bounds:
                launch.fn(ptrs, int(s), int(e))
            return
        try:
            # posted before the sleeping workers are woken: one that wakes finds the launch (a
            # worker decides to sleep under the GIL, after looking for a launch)
            g = self._post(self._addr, launch.fn_addr, _addressof(ptrs), launch.bounds_addr, launch.n)
            for i, sleeping in enumerate(self._sleeping):
                if sleeping:
                    self._sleeping[i] = False
                    self._queues[i].put(None)
            self._join(self._addr, g, launch.n, self._patience)
        finally:
            self._lock.release()


_addressof = ctypes.addressof


class _Launch:
    __slots__ = ("pool", "fn", "fn_addr", "bounds", "bounds_addr", "n")

    def __init__(self, pool: ThreadPool, fn, bounds):
        self.pool, self.fn = pool, fn
        self.fn_addr = ctypes.cast(fn, ctypes.c_void_p).value
        self.bounds = np.ascontiguousarray(np.asarray(bounds, np.int64).reshape(-1, 2))
        self.bounds_addr, self.n = self.bounds.ctypes.data, len(self.bounds)

    def __call__(self, ptrs) -> None:
        self.pool._launch(self, ptrs)


_pools: dict = {}


def get_pool(n: int) -> ThreadPool:
    p = _pools.get(n)
    if p is None:
        p = _pools[n] = ThreadPool(n)
    return p
