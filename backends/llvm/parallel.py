"""Object code for many kernels at once, built in worker processes.

llvmlite serialises every call into LLVM behind one lock, so threads cannot compile kernels in
parallel; processes can. When a graph needs several kernels that no cache holds, they are
rendered and compiled by this process and by worker processes (started once, on first need, one
per other core), and the resulting object code waits in `_built` until compile_kernel takes it
(then it goes to the disk cache like any other object). Workers are plain subprocesses, so a
user's script is never re-imported the way multiprocessing's spawn does, and they start in
isolated mode with this process's import path (worker_command), so a `tilefuse/` folder where
the user works is never imported.

A worker that fails or dies only loses the parallelism: whatever it did not build is compiled
in-process by compile_kernel, which reports errors as usual (with the kernel at fault).
TILEFUSE_COMPILE_WORKERS=0 turns this off."""
from __future__ import annotations

import atexit
import dataclasses
import os
import pickle
import queue
import subprocess
import sys
import threading

from tilefuse.ir.kernel.tile import walk
from tilefuse.runtime import tiered
from tilefuse.runtime.compile_child import isolated_command

MIN_KERNELS = 4  # below this, starting workers costs more than it saves
_built: dict[str, bytes] = {}  # cache key -> object code, taken once by compile_kernel
_workers: list = []
_lock = threading.Lock()


def take(key: str) -> bytes | None:
    return _built.pop(key, None)


def _worker_count() -> int:
    env = os.environ.get("TILEFUSE_COMPILE_WORKERS")
    if env is not None:
        return max(0, int(env))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# The worker's start: isolated, with exactly the parent's import path (compile_child.isolated_command)
_BOOT = ("import sys; sys.path[:] = sys.argv[1:]; "
         "from tilefuse.backends.llvm.parallel import _serve; _serve()")


def worker_command() -> list[str]:
    return isolated_command(_BOOT)


class _Worker:
    def __init__(self):
        self.proc = subprocess.Popen(worker_command(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def build(self, job: tuple) -> bytes | None:
        """Object code for (tile kernel, symbol, DeviceInfo, made by the scheduler), or None if the
        worker could not."""
        data = pickle.dumps(job)
        try:
            self.proc.stdin.write(len(data).to_bytes(8, "little") + data)
            self.proc.stdin.flush()
            head = _read(self.proc.stdout, 9)
            payload = _read(self.proc.stdout, int.from_bytes(head[1:], "little"))
        except (OSError, EOFError, ValueError):
            self.proc.kill()
            return None
        return payload if head[0] == 0 else None


@atexit.register
def _stop_workers() -> None:
    """Close the workers' pipes (they exit on end of input) and reap them."""
    tiered.abandon()  # (background builds first: none may be waiting on a worker)
    for w in _workers:
        try:
            w.proc.stdin.close()
            w.proc.wait(timeout=2)
            w.proc.stdout.close()
        except (OSError, subprocess.TimeoutExpired):
            w.proc.kill()


def _read(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError("worker closed its pipe")
    return data


def _pool(n: int) -> list:
    with _lock:
        _workers[:] = [w for w in _workers if w.alive()]
        while len(_workers) < n:
            try:
                _workers.append(_Worker())
            except OSError:  # no fork/exec here: compile in-process
                break
        return list(_workers[:n])


def build_objects(todo: dict, local) -> None:
    """Compile {cache key: (tile kernel, symbol, DeviceInfo, made by the scheduler)} into `_built`:
    this process (through `local(*job) -> object code`) and one worker per other core at once."""
    n = min(_worker_count(), len(todo)) - 1
    if len(todo) < MIN_KERNELS or n < 1:
        return
    jobs: queue.Queue = queue.Queue()
    # the biggest first: everyone finishes at about the same time
    for key, job in sorted(todo.items(), key=lambda kv: -sum(1 for _ in walk(kv[1][0].body))):
        jobs.put((key, job))

    def drain(build):
        while not tiered.exiting():
            try:
                key, job = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                obj = build(job)
            except Exception:  # compile_kernel compiles it again and reports the error
                obj = None
            if obj is None:
                return
            _built[key] = obj

    def remote(worker):
        return lambda job: worker.build((dataclasses.replace(job[0], meta={}),) + job[1:])

    threads = [threading.Thread(target=drain, args=(remote(w),), daemon=True) for w in _pool(n)]
    for t in threads:
        t.start()
    drain(lambda job: local(*job))
    for t in threads:
        t.join()


def _serve() -> None:
    """The worker: requests (tile kernel, symbol, DeviceInfo, made by the scheduler) on stdin,
    object code on stdout (for the parent's description of the CPU, which may be narrower than
    this host)."""
    from tilefuse.backends.llvm.compile import get_target, llvm_text
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = inp.read(8)
        if len(head) < 8:
            return
        tk, fn_name, info, by_scheduler = pickle.loads(_read(inp, int.from_bytes(head, "little")))
        try:
            target = get_target(info)
            status, payload = 0, target.compile_ir(llvm_text(tk, fn_name, target, by_scheduler), fn_name, "")
        except Exception as e:  # reported by compile_kernel, which compiles it again in-process
            status, payload = 1, str(e).encode()
        out.write(bytes([status]) + len(payload).to_bytes(8, "little") + payload)
        out.flush()

