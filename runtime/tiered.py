"""Tiered execution: a jitted graph's first calls run on the reference interpreter (numpy, no
compile) while its kernels compile on a background thread; the calls after the compile finishes
run the compiled program (`tx.config.tiered`, TILEFUSE_TIERED; "auto" by default on cpu and
OpenCL devices).

"auto": a graph runs its first call on the interpreter alone, then starts its compile, and its
calls keep interpreting until they took as long as the compile is estimated to take (at most
AUTO_MOST_S), after which they wait for it (ski rental: a short program ends before its compile
would have; a long one pays a bounded price for a fast first call). True interprets until the
compile ends. Operations outside jit tier the same way. A graph compiled whole before (a marker
beside the front-end cache, so also by an earlier process) tiers too: even from warm caches its
compile costs 3-6x an interpreted first call (bench_compile.py's programs: 16-600 ms against
3-115 ms), and computing the marker's key, the graph's text, costs ~20 ms for 1,000 equations;
the background build reads the marker and then skips the child process.

Measured cold, end to end (benchmarks/bench_compile.py, 2 cores, Intel Xeon, 2026-12-05): its
six programs in 0.20-0.85 s, each 0.19-0.69x the fastest of JAX's and PyTorch's time in the same
run (the op-by-op RNN under grad, the slowest: 0.85 s against PyTorch's 1.24 s and JAX's 5.33 s);
their first steps within 1-15 ms of the interpreter's own (`ref`); the char-GPT train step's first
call (benchmarks/bench_train.py) 0.44 s against JAX's 2.89 s, and a new batch size of it
compiled after 1.41 s against JAX's 2.37 s.
Results are the interpreter's until the switch: the same numbers within float rounding (numpy's
pairwise sums, its exp), not bit for bit. The compiled executable replaces the tiered one in
the caches that hold it (when_compiled), so later calls pay nothing for the tiering.

One background thread builds the graphs in the order they were first called (one thread per
graph made many builds and the interpreted calls fight over the cores); it hands a cold graph to
a child process first (runtime/compile_child.py: the compile's Python work then takes no GIL
from the interpreted calls; it runs at the lowest CPU priority, and the interpreted calls leave
it a core by running numpy's BLAS on one fewer: _leave_a_core) and builds it here from the
caches the child filled. Calls that come during that warm build (or while the thread checks
whether the caches hold the graph) wait for it instead of interpreting: the two fought over the
GIL (the char-GPT step at a new batch size: an interpreted call beside it took 0.6-1.1 s instead
of 0.12 s, and the build 0.5 s instead of 0.25; compiled after 0.54-0.75 s now, 1.1-1.4 s then,
its graph built before). A graph at a shape-generic trace's new sizes builds here too, from
the trace's front end (runtime/compiler.from_template), made by the first new size: the char-GPT
step at batch sizes 16, 24, 8, 12, 20 after 32 ran compiled 1.07-1.74 s after its first call
through a child, and 1.02-1.05 s (the first, which makes it) then 0.29-0.54 s from it. A caller
that needs a graph built now (Lowered.compile, wait) takes it from the queue and builds it. A
compile that fails is raised by the call that finds it finished, as a compile error would be.
At exit the build under way stops at its next phase or kernel and the queue is dropped: the
persistent cache writes whole entries only, so the next run finds each kernel built or absent."""
from __future__ import annotations

import atexit
import collections
import functools
import math
import os
import threading
import time
import weakref

import numpy as np

from tilefuse.ir import primitives as P
from tilefuse.ir.core import gc_paused

from . import compile_child
from .array import Array
from .config import config

# where compiling costs seconds and the interpreter runs the same numbers (OpenCL: PoCL builds the
# char-GPT step in 17.7 s with its cache cold, and the first call interprets in 1.8 s)
TIERED_KINDS = ("cpu", "opencl")
# "auto" interprets a graph's calls while they took less than its compile is expected to take
# (a model fitted to cold compiles on 2 cores: bench_compile.py's programs, 0.17-2.8 s, and
# eager operations, ~45 ms each: per graph, per equation, and per distinct operation and
# operand shapes, for which kernels are built),
# then waits for the compile: a short program ends before its compile would have, a long one
# pays at most about the compile's time again for its fast first calls (the ski-rental bound).
COMPILE_S_PER_GRAPH = 0.03
COMPILE_S_PER_EQUATION = 0.001
COMPILE_S_PER_SIGNATURE = 0.015
# a convolution is one equation but an implicit GEMM to build (0.12-0.2 s each, cold, 2 cores:
# more than the dozen small kernels of its im2col that the fit above was made with)
COMPILE_S_PER_CONV = 0.15
# and at most AUTO_MOST_S: a program still calling after that is a long one, which the
# interpreter only slows (its calls and the compile share the cores and the GIL: the char-GPT
# example's 300 steps took 10 s compiled at once, 16 s interpreting for the whole estimate)
AUTO_MOST_S = 1.0
CHILD_IDLE_S = 30.0  # the compile child ends after this long without a build (compile_child.release)
_exiting = threading.Event()
# TieredExecutables waiting for their build, weakly held: one that its jit cache dropped
# (evicted, clear_cache) is not built, and its graph and constants go at once
_queue: collections.deque = collections.deque()
_wake = threading.Condition()
_worker: list = []  # the compile thread, once started
_building = [False]  # whether the compile thread is building one now


def exiting() -> bool:
    return _exiting.is_set()


class Abandoned(BaseException):
    """Raised inside the background build at interpreter exit (see check): a BaseException, so
    that no handler of compile failures takes it for one (a cache entry discarded as damaged)."""


def check() -> None:
    """A point where the background build stops when the interpreter exits (the compiler calls it
    between kernels): LLVM running on a thread during Python's teardown crashed the process."""
    if _exiting.is_set() and _worker and threading.current_thread() is _worker[0]:
        raise Abandoned()


def _serve() -> None:
    while True:
        with _wake:
            busy = bool(_wake.wait_for(lambda: _queue or _exiting.is_set(), CHILD_IDLE_S))
            if _exiting.is_set():
                return
            exe = _queue.popleft()() if busy else None
            _building[0] = exe is not None
        if not busy:  # nothing to compile for a while: no idle child process kept
            compile_child.release()
        elif exe is not None:
            try:
                exe._build()
            finally:
                with _wake:
                    _building[0] = False
                    _wake.notify_all()
        del exe


@functools.lru_cache(maxsize=1)
def _blas_threads():
    """numpy's BLAS thread pools (threadpoolctl), found once (~4 ms), or None without it."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    return ThreadpoolController().select(user_api="blas")


class _LeaveACore:
    """Around an interpreted call while a compile is queued or under way: numpy's BLAS on one core
    fewer than the machine's, so the compile has one. Beside a compile on 2 cores, OpenBLAS's two
    threads kept waiting for each other: the char-GPT step's interpreted calls took 360-590 ms
    instead of 170-250, and a new batch size ran compiled after 1.7-2.4 s instead of 1.25-1.36 s
    (threadpoolctl sets the limit in ~8 us). Calls on several threads at once share one limit: the
    first in sets it, the last out restores the pools (nested limits would restore out of order)."""

    def __init__(self):
        self._lock, self._inside, self._limit = threading.Lock(), 0, None

    def __enter__(self):
        with self._lock:
            self._inside += 1
            if self._inside == 1 and (_queue or _building[0]):
                cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
                try:  # (a speed-up only: whatever a BLAS library does, the call runs unlimited)
                    pools = _blas_threads() if cores > 1 else None
                    self._limit = pools.limit(limits=cores - 1) if pools else None
                except Exception:  # noqa: BLE001
                    self._limit = None

    def __exit__(self, *exc):
        with self._lock:
            self._inside -= 1
            if self._inside == 0 and self._limit is not None:
                self._limit.restore_original_limits()
                self._limit = None


_leave_a_core = _LeaveACore()


def wait_idle(timeout: float | None = None) -> bool:
    """Wait until the compile thread has no build queued or under way (for tests and benchmarks
    that measure memory or time: a build left by earlier work allocates meanwhile); False if
    `timeout` seconds passed first."""
    with _wake:
        return _wake.wait_for(lambda: not _queue and not _building[0], timeout)


def _submit(exe) -> None:
    with _wake:
        if not _queue and not _building[0]:  # (taken at once: the next call waits for the check)
            exe._stage = "checking"
        _queue.append(weakref.ref(exe))
        if not _worker:
            _worker.append(threading.Thread(target=_serve, daemon=True, name="tilefuse-compile"))
            _worker[0].start()
        _wake.notify()


@atexit.register
def abandon() -> None:
    """At exit: the build under way stops at its next check and is waited for, the queue is
    dropped (idempotent; the LLVM workers' own exit handler calls it first, so no build is left
    waiting on a worker)."""
    with _wake:
        _exiting.set()
        _queue.clear()
        _wake.notify_all()
    compile_child.stop()
    if _worker:
        _worker[0].join(timeout=10)


def applies(device) -> bool:
    """Tiering on, on a device that takes it, and results not required bit for bit."""
    return bool(config.tiered) and not config.deterministic and device.kind in TIERED_KINDS


class Budget:
    """Seconds of interpreted calls allowed before they wait for the compile, and those spent."""

    def __init__(self, seconds: float):
        self.seconds, self.spent = seconds, 0.0

    def exhausted(self) -> bool:
        return self.spent >= self.seconds


# Operations outside jit share one budget: a program of many large operations interprets as a
# whole until it took AUTO_MOST_S (one budget per operation let the autograd-style RNN wait for 31
# compiles one after another: 1.9 s where interpreting took 0.7).
_eager_budget = Budget(AUTO_MOST_S)
# An operation outside jit on at most this many elements (operands and results together) is
# interpreted for good where tiering applies: its numpy call runs as fast as its kernel would
# (a (16, 64) operation: 13-20 us a call either way, nearly all of it dispatch), and a kernel
# costs ~45 ms to compile, which such a call never wins back. Larger ones compile: the kernel is
# multi-threaded and vectorised where numpy's loop is not.
EAGER_INTERPRET_ELEMENTS = 1 << 16
# A larger operation outside jit starts its compile at its second call: one called once (a
# parameter's or an optimiser state's initialisation) never repays a kernel, and its compile ran
# beside the program's next calls (the char-GPT step's first call, just after AdamW's init: 0.65-
# 0.72 s while two zeros_like compiled, 0.4 s without).
EAGER_CALLS_BEFORE_COMPILE = 2


def interprets(graph, device) -> bool:
    """Whether an operation outside jit (a one-equation graph) runs on the interpreter for good
    (only where the device's buffers are host memory: elsewhere each call would copy)."""
    if not applies(device) or not device.backend.host_memory(device):
        return False
    n = 0
    for v in (*graph.invars, *graph.outvars):
        n += math.prod(v.aval.shape)
    return n <= EAGER_INTERPRET_ELEMENTS


def compile(graph, device, eager: bool = False):
    """What a jitted graph's (or an operation's, `eager`) calls run: the compiled program where
    tiering does not apply; else a TieredExecutable."""
    build = lambda: device.compile(graph)  # noqa: E731
    if not applies(device):
        return build()
    device.check_graph(graph)  # (a dtype the device lacks: the compile's error, before interpreting)
    calls = EAGER_CALLS_BEFORE_COMPILE if eager else 1
    if config.tiered != "auto":
        return TieredExecutable(graph, device, build, None, calls)
    if eager:
        return TieredExecutable(graph, device, build, _eager_budget, calls)
    estimate = COMPILE_S_PER_GRAPH + COMPILE_S_PER_EQUATION * len(graph.eqns)
    if estimate < AUTO_MOST_S:  # (a large graph is past the bound already: its signatures, ~7 ms
        # for 1,500 equations, are not counted)
        signatures = {(e.prim, *(v.aval for v in e.inputs)) for e in graph.eqns}
        estimate += COMPILE_S_PER_SIGNATURE * len(signatures) + \
            COMPILE_S_PER_CONV * sum(s[0] is P.conv for s in signatures)
    return TieredExecutable(graph, device, build, Budget(min(estimate, AUTO_MOST_S)))


class TieredExecutable:
    """Called like an Executable: the compiled one once built, the interpreter's until then (or
    until the interpreted calls took `budget` seconds: the next ones wait for the compile). The
    compile starts after the call numbered `calls_before_compile`, which so runs alone."""

    def __init__(self, graph, device, build, budget: Budget | None = None, calls_before_compile: int = 1):
        from .device import get_device
        self.graph, self.device = graph, device
        self.in_avals = [v.aval for v in graph.invars]
        self.out_avals = [v.aval for v in graph.outvars]
        self.compiled, self._error, self._build_fn = None, None, build
        self._started, self._done = False, threading.Event()
        self._submitted, self._budget = False, budget or Budget(math.inf)
        # the compile thread's build: "checking" whether the persistent caches hold the graph (a
        # moment: calls wait for the answer), "child" while the child process builds it (calls
        # interpret), "warm" while this process builds it from the caches (calls wait for it)
        self._stage, self._checked = "", threading.Event()
        self._calls_before_compile = calls_before_compile
        self._when_compiled: list = []
        with gc_paused():  # (a full collection over a trained model's objects landed here at
            # random: the char-GPT step's interpreter took 104-167 ms to build instead of 8)
            self._ref = get_device("ref").compile(graph)

    def _build(self) -> None:
        """Build once: on the compile thread, or on a caller that cannot wait (wait)."""
        with _wake:
            if self._started:
                return
            self._started = True
        try:
            if _worker and threading.current_thread() is _worker[0]:
                from .compiler import built_before, from_template  # (compiler imports this module)
                self._stage = "checking"
                warm = from_template(self.graph) or built_before(self.graph, self.device)
                self._stage = "warm" if warm else "child"
                self._checked.set()
                if self._stage == "child":  # (then a warm build here, or a cold one if the child failed)
                    self._stage = "warm" if compile_child.prebuild(self.graph, self.device) else "cold"
            self.compiled = self._build_fn()
        except Abandoned:
            pass
        except BaseException as e:  # (raised by the next call)
            self._error = e
        finally:
            self._checked.set()
            self._done.set()
        if self.compiled is not None:
            for fn in self._when_compiled:
                fn(self.compiled)

    def when_compiled(self, fn) -> None:
        """Call fn(compiled executable) once it is built (at once if it is): a cache holding this
        one swaps it for the compiled one, whose calls then pay no check."""
        with _wake:
            if not self._done.is_set():
                self._when_compiled.append(fn)
                return
        if self.compiled is not None:
            fn(self.compiled)

    def wait(self):
        """The compiled executable: built here if still queued, else waited for."""
        with _wake:
            if not self._started:
                for r in [r for r in _queue if r() is self]:
                    _queue.remove(r)
        self._build()
        self._done.wait()
        return self._result()

    def _result(self):
        if self._error is not None:  # (every later call raises it, as a failed compile would)
            raise self._error.with_traceback(None)
        return self.compiled

    def __call__(self, leaves):
        if self._done.is_set():
            return self._result()(leaves)
        if self._submitted:  # (the first call always interprets)
            if self._stage == "checking":
                self._checked.wait(1.0)  # (bounded: a thread stopping at exit never answers)
            if self._budget.exhausted() or self._stage == "warm":
                return self.wait()(leaves)
        t = time.perf_counter()
        host = [np.asarray(x) if isinstance(x, Array) else x for x in leaves]
        with _leave_a_core, gc_paused():  # (its garbage is numpy's results, freed by their counts)
            outs = [self.device.put(np.asarray(o)) for o in self._ref(host)]
        self._budget.spent += time.perf_counter() - t
        with _wake:
            self._calls_before_compile -= 1
            submit = not self._submitted and self._calls_before_compile <= 0
            self._submitted |= submit
        if submit:
            _submit(self)
        return outs

    def __getattr__(self, name):  # sources, program, optimized_graph: the compiled one's
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.wait(), name)
