"""Tiered execution: a jitted graph's first calls run on the reference interpreter (numpy, no
compile) while its kernels compile on a background thread; the calls after the compile finishes
run the compiled program (`tx.config.tiered`, TILEFUSE_TIERED).

Measured cold, end to end (benchmarks/bench_compile.py): the interpreter's first step takes
2-120 ms where the CPU backend's compile takes 0.2-5 s, so a program called a few times, or a
training loop's first steps, no longer waits for LLVM. Results are the interpreter's until the
switch: the same numbers within float rounding (numpy's pairwise sums, its exp), not bit for bit.

A compile that fails is raised by the call that finds it finished, as a compile error would be.
At exit an unfinished compile is abandoned: the persistent cache writes whole entries only, so
the next run finds each kernel built or absent."""
from __future__ import annotations

import atexit
import threading

import numpy as np

from tilefuse.ir.errors import TilefuseError

from .array import Array
from .config import config

TIERED_KINDS = ("cpu",)  # where compiling costs seconds and the interpreter runs the same numbers
_exiting = threading.Event()
_compiling: set = set()  # the background builds' threads


def exiting() -> bool:
    return _exiting.is_set()


class Abandoned(Exception):
    """Raised inside a background build at interpreter exit (see check)."""


def check() -> None:
    """A point where a background build stops when the interpreter exits (the compiler calls it
    between kernels): LLVM running on a thread during Python's teardown crashed the process."""
    if _exiting.is_set() and threading.current_thread() in _compiling:
        raise Abandoned()


@atexit.register
def abandon() -> None:
    """At exit: background builds stop at their next check and are waited for (idempotent; the
    LLVM workers' own exit handler calls it first, so no build is left waiting on a worker)."""
    _exiting.set()
    for t in list(_compiling):
        t.join(timeout=10)


def applies(device) -> bool:
    """Tiering on, on a device that takes it, and results not required bit for bit."""
    return bool(config.tiered) and not config.deterministic and device.kind in TIERED_KINDS


class TieredExecutable:
    """Called like an Executable: the compiled one once built, the interpreter's until then."""

    def __init__(self, graph, device, build):
        from .device import get_device
        self.graph, self.device = graph, device
        self.in_avals = [v.aval for v in graph.invars]
        self.out_avals = [v.aval for v in graph.outvars]
        self.compiled, self._error = None, None
        self._ref = get_device("ref").compile(graph)
        self._thread = threading.Thread(target=self._build, args=(build,), daemon=True,
                                        name=f"tilefuse-compile-{device.name}")
        _compiling.add(self._thread)
        self._thread.start()

    def _build(self, build) -> None:
        try:
            self.compiled = build()
        except Abandoned:
            pass
        except BaseException as e:  # (raised by the next call)
            self._error = e
        finally:
            _compiling.discard(threading.current_thread())

    def wait(self):
        """The compiled executable, waiting for its build (Lowered.compile, tests)."""
        self._thread.join()
        return self._done()

    def _done(self):
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, TilefuseError):
                raise e.with_traceback(None)
            raise e
        return self.compiled

    def __call__(self, leaves):
        if self.compiled is not None or not self._thread.is_alive():
            return self._done()(leaves)
        host = [np.asarray(x) if isinstance(x, Array) else x for x in leaves]
        return [self.device.put(np.asarray(o)) for o in self._ref(host)]

    def __getattr__(self, name):  # sources, program, optimized_graph: the compiled one's
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.wait(), name)
