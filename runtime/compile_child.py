"""Cold compiles in a child process, for tiered execution's background builds (runtime/tiered.py).

A background build on a thread shares the GIL with the calls it is meant to keep fast: the front
end and the tile printer are Python, and the interpreted calls ran 2-4x slower beside them. So
the background thread hands a cold graph to one child process, which compiles it for the same
device and configuration and so fills the persistent caches (front end, object code, the GEMM
choices, the built marker); the thread then compiles it in this process from those caches.

The child is a plain subprocess started as the LLVM compile workers are (isolated mode, this
process's import path: isolated_command), on first need, ended when no build came for
CHILD_IDLE_S (release), and killed at exit (a compile it had under way is abandoned whole, as the
caches write whole entries only). Requests and replies are JSON lines of length-prefixed bytes; the graph goes as the
front-end cache encodes it. Where something does not apply (no disk cache, a graph with a
subgraph or a function as a parameter, a child that cannot start or dies), `prebuild` returns
False and the build happens in this process as before."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from tilefuse.ir import symbolic
from tilefuse.ir.core import gc_paused

from . import compile_cache, frontend_cache
from .config import config

# The child runs at the lowest CPU priority: its compile is speculative, while the calls it would
# speed up interpret meanwhile and are what the user waits for. Beside a compile at normal
# priority on 2 cores, numpy's BLAS threads lost their turns and the char-GPT step's interpreted
# calls took 470-500 ms, against 170 ms alone.
_BOOT = ("import os, sys; sys.path[:] = sys.argv[1:]; os.nice(19); "
         "from tilefuse.runtime.compile_child import _serve; _serve()")
_child: list = []  # the child process, once started
_lock = threading.Lock()  # one request at a time (one background thread asks)
_stopped = [False]


def _settings() -> dict:
    """The configuration a compile reads, as JSON (the child's defaults come from the same
    environment; these are what the user set in code). The default device too: it decides no
    compile in the child (asked for a device by name), but it is one of the settings that key
    the caches (config.cache_key), so without it the child stored every front end under another
    key than this process looks for, and the build here after the child's ran the passes again."""
    out = {}
    for k, v in vars(config).items():
        if k.startswith("_") or k in ("tiered", "jit_cache_size"):
            continue
        if v is None or isinstance(v, (bool, int, float, str)) or (k == "hdi" and isinstance(v, dict)):
            out[k] = v
    return out


def isolated_command(boot: str) -> list[str]:
    """A Python subprocess running `boot` (which sets sys.path from its arguments) in isolated
    mode (-I: no current directory or script folder on sys.path, no PYTHON* variables, no user
    site-packages) with exactly this process's import path, '' (the current directory, wherever
    it is when the child starts) left out and relative entries made absolute: it imports the
    tilefuse this process runs and never a `tilefuse/` (or `json`, ...) in the user's folder."""
    return [sys.executable, "-I", "-c", boot, *(os.path.abspath(p) for p in sys.path if p)]


def _start():
    return subprocess.Popen(isolated_command(_BOOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)


def _send(f, obj) -> None:
    data = json.dumps(obj).encode()
    f.write(len(data).to_bytes(8, "little") + data)
    f.flush()


def _receive(f):
    head = f.read(8)
    if len(head) < 8:
        raise EOFError("closed")
    n = int.from_bytes(head, "little")
    data = f.read(n)
    if len(data) != n:
        raise EOFError("closed")
    return json.loads(data)


def prebuild(graph, device) -> bool:
    """Compile `graph` for `device` in the child (this thread waits without the GIL): True when
    the persistent caches now hold it, False where the child does not apply or failed. Where
    `graph` is a shape-generic trace's instance at its own sizes, the child makes its template's
    front end too, beside that compile (its object code builds in worker processes meanwhile):
    the first call at a new batch size then loads it (frontend_cache.load_template) instead of
    running the passes on the template here (~250 ms for the char-GPT step, its calls waiting)."""
    if compile_cache.default_dir() is None or config.dump_dir or config.debug or _stopped[0]:
        return False
    from tilefuse.ir.passes.inline import inline_calls
    text = frontend_cache.encode_graph(inline_calls(graph))
    if text is None:
        return False
    request = {"graph": text, "device": device.name, "config": _settings()}
    front = symbolic.base_front_end(graph)
    made = front.graph() if front is not None and config.fusion else None
    if made is not None:
        template, env = made
        with gc_paused():  # (~30 ms for the char-GPT step's 1,500 equations; 100 ms where the
            # collector ran over what the encoding makes)
            ttext = frontend_cache.encode_template(template, env.hints)
        key = frontend_cache.template_key(ttext)
        if key is not None and not frontend_cache.has_template(key):
            # (the key goes along: the child's own settings may differ in one that keys compiles
            # but not a front end, such as the default device)
            request.update(template=ttext, key=key)
    return _ask(request)


def _ask(request: dict) -> bool:
    """Send one request to the child (started if need be) and wait for its answer."""
    with _lock:
        if _stopped[0]:
            return False
        try:
            if not _child or _child[0].poll() is not None:
                _child[:] = [_start()]
            proc = _child[0]
            _send(proc.stdin, request)
            reply = _receive(proc.stdout)
        except (OSError, EOFError, ValueError):
            if _child:
                _child[0].kill()
            return False
    return bool(reply.get("ok"))


def release() -> None:
    """End the child (it exits at the end of its input) after the background queue stayed empty
    for a while: a notebook that compiled once keeps no idle process and its memory. The next
    cold graph starts a new one."""
    with _lock:
        if _child and _child[0].poll() is None:
            proc = _child.pop()
            try:
                proc.stdin.close()
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()


def stop() -> None:
    """At exit (tiered.abandon calls it first): kill the child, so that a thread waiting on it
    returns at once; what it was compiling is left unwritten."""
    _stopped[0] = True
    for proc in _child:
        proc.kill()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass


def _serve() -> None:
    """The child: requests on stdin, {"ok": bool, "error": str} on stdout, until end of input."""
    import tilefuse as tx
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            req = _receive(inp)
        except EOFError:
            return
        try:
            tx.config.update(**{k: v for k, v in req["config"].items() if hasattr(tx.config, k)}, tiered=False)
            maker = threading.Thread(target=_make_template, args=(req["template"], req["key"]), daemon=True) \
                if "template" in req else None
            if maker is not None:
                maker.start()
            tx.get_device(req["device"]).compile(frontend_cache.decode_graph(req["graph"]))
            if maker is not None:
                maker.join()
            reply = {"ok": True}
        except Exception as e:  # noqa: BLE001 - the parent compiles it itself and reports errors
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        _send(out, reply)


def _make_template(text: str, key: str) -> None:
    """The child, on a thread beside a compile: a template's front end, made and stored under
    `key` (as compiler._KeptFronts.store would); where it fails, the parent makes it when needed."""
    from tilefuse.runtime.compiler import _symbolic_front  # (the compiler imports tiered, which imports this)
    try:
        if frontend_cache.has_template(key):  # (asked twice: two traces of one function at once)
            return
        graph, env = frontend_cache.decode_template(text)
        (g, regions), guards = symbolic.recorded(env, _symbolic_front, graph)
        frontend_cache.store_template(key, env.hints, g, regions, guards)
    except Exception:  # noqa: BLE001 - (a speculative front end: nothing waits for it)
        pass
