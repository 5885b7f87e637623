"""The auto-tuner and the tuning database.

A template registers its parameter space generically (`register(Template(...))`): which
dispatcher implementation it refines, its choices per parameter for a kernel and device, its
constraints, its defaults, and how to build a kernel with given parameters. `tune_kernel` searches
that space with optuna's TPE sampler (the default configuration is the first trial; invalid
configurations are pruned by the template's constraints, failed builds and wrong results by the
tuner, so nothing crashes), timing every candidate on the device (warm-up, then the median of
samples long enough to read the clock), and stores the winner in the SQLite tuning database,
keyed by template, kernel signature, shape class and device fingerprint. `tune(fn, *args)` does
this for every kernel of a jitted function, the slowest first.

The dispatcher (runtime/dispatch.py) asks `build` for every kernel it compiles: with tuned
parameters in the database for that key, the template builds with them; otherwise the
implementation builds with its defaults. The database is `tx.config.tuning_db`
(TILEFUSE_TUNING_DB; default `tuning.sqlite` in the compile cache folder; "off" disables it).
A database that cannot be read is reported once (TuningDBWarning) and ignored."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import numbers
import os
import sqlite3
import statistics
import sys
import threading
import time
import urllib.parse
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tilefuse.ir.core import ShapedArray
from tilefuse.ir.errors import TilefuseError
from tilefuse.ir.kernel.ir import pp_kernel

from . import compile_cache
from .config import config

log = logging.getLogger("tilefuse.tuner")
config.define("tuning_db", None, env="TILEFUSE_TUNING_DB", compiles=True)


def size_class(n: int) -> int:
    """The least power of two >= n: how templates bucket sizes into the database's shape classes."""
    return 1 << max(0, int(n - 1).bit_length())


MIN_GAIN = 0.03  # a configuration replaces the default only when measurably faster: noise is not a win


class TuningDBWarning(UserWarning):
    """The tuning database could not be read or written; tuned parameters are not used."""


# ---- templates ----------------------------------------------------------------------------------

def kernel_key(kernel) -> tuple[str, str]:
    """(signature, shape class) of a kernel: its canonical text's hash, and its index spaces."""
    bufs = tuple(dataclasses.replace(b, name=f"b{i}") for i, b in enumerate(kernel.buffers))
    text = pp_kernel(dataclasses.replace(kernel, name="k", buffers=bufs))
    shape = "x".join(map(str, kernel.shape)) + ("/" + "x".join(map(str, kernel.reduce_shape))
                                                 if kernel.reduce_shape else "")
    return hashlib.sha1(text.encode()).hexdigest()[:20], shape


@dataclass(frozen=True)
class Template:
    """A tunable way to build kernels: it refines the dispatcher's implementation `impl` on
    `device_kinds`. space(kernel, device) -> {parameter: choices}; default(kernel, device) -> the
    parameters the implementation uses untuned; check(params, kernel, device) -> None, or why the
    configuration is invalid; build(kernel, device, backend, params) -> run(buffers)."""
    name: str
    impl: str
    device_kinds: tuple
    space: Callable
    default: Callable
    build: Callable
    check: Callable = lambda params, kernel, device: None
    key: Callable = kernel_key
    applies: Callable = lambda kernel, device: True


_templates: list[Template] = []


def register(t: Template) -> Template:
    """Add a template (replacing one of the same name)."""
    _templates[:] = [x for x in _templates if x.name != t.name] + [t]
    return t


def templates() -> list[Template]:
    return list(_templates)


def template_for(impl_name: str, kernel, device) -> Template | None:
    for t in _templates:
        if t.impl == impl_name and getattr(device, "kind", "") in t.device_kinds \
                and t.applies(kernel, device):
            return t
    return None


# ---- the database -------------------------------------------------------------------------------

SCHEMA = """CREATE TABLE IF NOT EXISTS tuned (
    template TEXT, signature TEXT, shape_class TEXT, device TEXT, params TEXT,
    seconds REAL, default_seconds REAL, trials INTEGER, kernel TEXT, device_name TEXT, created REAL,
    PRIMARY KEY (template, signature, shape_class, device))"""


def db_path() -> str | None:
    """The tuning database's path, or None when tuning data is off."""
    p = config.tuning_db
    if p is not None:
        return None if p.strip().lower() in ("", "0", "off", "none") else p
    d = compile_cache.default_dir()
    return os.path.join(compile_cache.trusted_dir(d), "tuning.sqlite") if d else None


def device_key(device) -> str:
    info = getattr(device, "info", None)
    fp = info.fingerprint if info is not None else str(device)
    return hashlib.sha1(fp.encode()).hexdigest()[:16]


READ_TIMEOUT_S = 0.2  # a database another process holds locked: go on with the defaults
WRITE_TIMEOUT_S = 5.0  # a result being stored waits a little longer for a writer to finish


class TuningDB:
    """Tuned parameters on disk. Reads load the whole table once and again only when the file
    changes, through a read-only connection that waits READ_TIMEOUT_S at most for a writer;
    every write is one transaction, so several processes can share the file. The file and its
    folder must be the user's and writable by nobody else (runtime/compile_cache.untrusted)."""

    def __init__(self, path: str):
        self.path = path
        self._stamp = None
        self._rows: dict = {}
        self._lock = threading.Lock()
        self._warned: set = set()

    def _warn(self, what: str, e: Exception,
              advice: str = "delete it or point TILEFUSE_TUNING_DB elsewhere") -> None:
        msg = f"tilefuse: the tuning database {self.path} {what} ({type(e).__name__}: {e}); it is " \
              f"ignored and default parameters are used ({advice})"
        if msg not in self._warned:
            self._warned.add(msg)
            warnings.warn(msg, TuningDBWarning, stacklevel=3)

    def _untrusted(self, st: os.stat_result | None) -> bool:
        """Whether the file (its stat, None if absent) or its folder is someone else's."""
        folder = os.path.dirname(os.path.abspath(self.path))
        try:
            where, why = folder, compile_cache.untrusted(os.stat(folder))
        except OSError:
            return False  # no folder yet: a write makes it, ours
        if why is None and st is not None:
            where, why = self.path, compile_cache.untrusted(st)
        if why is not None:
            compile_cache.warn_untrusted(where, why, "tuning database" if where == self.path else
                                         "tuning database's folder", "the default parameters are used")
        return why is not None

    def rows(self) -> dict:
        """{(template, signature, shape class, device): params}, current with the file."""
        try:
            st = os.stat(self.path)
        except OSError:
            return {}
        stamp = (st.st_mtime_ns, st.st_size, st.st_uid, st.st_mode)
        with self._lock:
            if stamp != self._stamp:
                self._rows = {} if self._untrusted(st) else self._load()
                self._stamp = stamp
            return self._rows

    def _load(self) -> dict:
        try:
            with _connect(self.path, read_only=True) as con:
                got = con.execute("SELECT template, signature, shape_class, device, params FROM tuned")
                rows = {}
                for t, s, c, d, p in got.fetchall():
                    rows[(t, s, c, d)] = json.loads(p)
                return rows
        except sqlite3.OperationalError as e:
            if "locked" in str(e) or "busy" in str(e):  # tried again when the file changes
                self._warn(f"is locked by another process (waited {READ_TIMEOUT_S} s)", e,
                           "it is read again when it changes")
                return self._rows
            self._warn("cannot be read", e)
            return {}
        except (sqlite3.Error, ValueError, TypeError) as e:
            self._warn("cannot be read", e)
            return {}

    def get(self, template: str, signature: str, shape_class: str, device: str) -> dict | None:
        return self.rows().get((template, signature, shape_class, device))

    def put(self, row: dict) -> bool:
        """Insert or replace one result; False (with a warning) when the file cannot be written."""
        try:
            st = os.stat(self.path)
        except OSError:
            st = None
        if self._untrusted(st):
            return False
        try:
            with _connect(self.path) as con:
                con.execute(SCHEMA)
                con.execute("INSERT OR REPLACE INTO tuned VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                            (row["template"], row["signature"], row["shape_class"], row["device"],
                             json.dumps(row["params"], sort_keys=True), row["seconds"],
                             row["default_seconds"], row["trials"], row.get("kernel", ""),
                             row.get("device_name", ""), time.time()))
        except sqlite3.Error as e:
            self._warn("cannot be written", e)
            return False
        return True

    def entries(self) -> list[dict]:
        """Every stored result (for reports)."""
        try:
            with _connect(self.path, read_only=True) as con:
                con.row_factory = sqlite3.Row
                return [dict(r) for r in con.execute("SELECT * FROM tuned ORDER BY created")]
        except sqlite3.Error as e:
            self._warn("cannot be read", e)
            return []


class _connect:
    """A short-lived connection that commits on success and always closes; a read-only one
    (no folder made, no write lock, a short wait) for reads."""

    def __init__(self, path: str, read_only: bool = False):
        self.path, self.read_only = path, read_only

    def __enter__(self):
        if self.read_only:
            uri = "file:" + urllib.parse.quote(os.path.abspath(self.path)) + "?mode=ro"
            self.con = sqlite3.connect(uri, uri=True, timeout=READ_TIMEOUT_S)
        else:
            d = os.path.dirname(self.path)
            if d:
                os.makedirs(d, mode=0o700, exist_ok=True)
            self.con = sqlite3.connect(self.path, timeout=WRITE_TIMEOUT_S)
        return self.con

    def __exit__(self, exc_type, *rest):
        try:
            if exc_type is None and not self.read_only:
                self.con.commit()
        finally:
            self.con.close()


_dbs: dict[str, TuningDB] = {}


def database(path: str | None = None) -> TuningDB | None:
    path = path or db_path()
    if path is None:
        return None
    db = _dbs.get(path)
    if db is None:
        db = _dbs[path] = TuningDB(path)
    return db


# ---- the dispatcher's side --------------------------------------------------------------------------

applied: dict = {}  # (template, signature, shape class, device) -> params used by a compile here


def invalid_params(params, space: dict, default: dict) -> str | None:
    """Why stored parameters do not fit a template's space, or None: the same names, and each
    value of the kind of its choices and within their range (a value between today's choices
    may be stored; one outside them, such as a GEMM's kc=0, can loop forever)."""
    if not isinstance(params, dict) or set(params) != set(space):
        return f"the template's parameters are {sorted(space)}"
    for name, choices in space.items():
        v = params[name]
        options = (*choices, default[name]) if name in default else tuple(choices)
        if all(isinstance(c, bool) or not isinstance(c, numbers.Real) for c in options):
            ok = any(type(v) is type(c) and v == c for c in options)  # True is no 1 here
        else:
            kind = numbers.Integral if all(isinstance(c, numbers.Integral) for c in options) else numbers.Real
            ok = isinstance(v, kind) and not isinstance(v, bool) and math.isfinite(v) \
                and min(options) <= v <= max(options)
        if not ok:
            return f"{name}={v!r} is outside the choices {tuple(dict.fromkeys(options))}"
    return None


_warned: set = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, TuningDBWarning, stacklevel=4)


def tuned_params(t: Template, kernel, device) -> tuple[tuple, dict | None]:
    """(the database key, the stored parameters if valid for the template now) of a kernel."""
    db = database()
    if db is None or not db.rows():
        return (), None
    key = (t.name, *t.key(kernel), device_key(device))
    params = db.get(*key)
    if params is None:
        return key, None
    try:
        why = invalid_params(params, t.space(kernel, device), t.default(kernel, device)) \
            or t.check(params, kernel, device)
    except Exception as e:  # noqa: BLE001 - a check that cannot read the values (a str for an int)
        why = f"{type(e).__name__}: {e}"
    if why:
        _warn_once(f"tilefuse: the tuning database {db.path} holds parameters {params} for {key[0]} "
                   f"(signature {key[1]}, shape {key[2]}) that do not fit: {why}; they are ignored and "
                   "the defaults used")
        return key, None
    return key, params


def uses_defaults(impl, kernel, device) -> bool:
    """Whether build() builds the kernel with the implementation's defaults (no tuned parameters)."""
    t = template_for(impl.name, kernel, device)
    return t is None or tuned_params(t, kernel, device)[1] is None


def build(impl, kernel, device, backend):
    """Build a kernel with implementation `impl`: with tuned parameters when the database holds
    them for its template (and they build), else the implementation's defaults."""
    t = template_for(impl.name, kernel, device)
    key, params = tuned_params(t, kernel, device) if t is not None else ((), None)
    if params is not None:
        try:
            run = t.build(kernel, device, backend, params)
        except Exception as e:  # noqa: BLE001 - whatever stored values did, the defaults still build
            _warn_once(f"tilefuse: {kernel.name} did not build with the tuned parameters {params} from "
                       f"{database().path} ({type(e).__name__}: {e}); the defaults are used")
        else:
            applied[key] = params
            if config.debug:
                print(f"--- tilefuse: {kernel.name} built with tuned parameters {params}", file=sys.stderr)
            return run
    return impl.build(kernel, device, backend)


# ---- measuring ----------------------------------------------------------------------------------

def random_buffers(kernel, device, rng=None) -> list:
    """Device buffers for a kernel: inputs uniform in [0.5, 1.5) (valid for log, sqrt, pow,
    division), integer inputs zero (always valid indices), outputs zero."""
    rng = rng or np.random.default_rng(0)
    out = []
    for i, b in enumerate(kernel.buffers):
        d = np.dtype(b.dtype)
        if i < kernel.n_inputs and (d.kind == "f" or d.name == "bfloat16"):
            host = rng.uniform(0.5, 1.5, b.size).astype(d)
        else:
            host = np.zeros(b.size, d)
        out.append(device.backend.put(host, device))
    return out


def measure(run, buffers, device, *, warmup: int = 2, repeat: int = 7, sample_s: float = 2e-3) -> float:
    """Median seconds per call of run(buffers) on the device: after warm-up, `repeat` samples of
    enough calls each to last about sample_s."""
    sync = device.synchronize
    for _ in range(warmup):
        run(buffers)
        sync()
    t0 = time.perf_counter()
    run(buffers)
    sync()
    one = time.perf_counter() - t0
    inner = max(1, min(10_000, int(sample_s / max(one, 1e-7))))
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            run(buffers)
        sync()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def _outputs(run, kernel, inputs, device) -> list:
    """The outputs of one run from zeroed output buffers, on the host."""
    outs = kernel.buffers[kernel.n_inputs:]
    bufs = list(inputs[:kernel.n_inputs]) + [device.backend.put(np.zeros(b.size, np.dtype(b.dtype)), device)
                                             for b in outs]
    run(bufs)
    device.synchronize()
    return [np.array(device.backend.to_host(buf, ShapedArray((b.size,), np.dtype(b.dtype)), device))
            for buf, b in zip(bufs[kernel.n_inputs:], kernel.buffers[kernel.n_inputs:])]


def _agrees(got: list, want: list) -> bool:
    for g, w in zip(got, want):
        if g.dtype.kind in "fc" or g.dtype.name == "bfloat16":
            if not np.allclose(g.astype(np.float64), w.astype(np.float64), rtol=2e-3, atol=1e-3,
                               equal_nan=True):
                return False
        elif not np.array_equal(g, w):
            return False
    return True


# ---- searching ----------------------------------------------------------------------------------

@dataclass
class TuneResult:
    """One kernel's tuning: the default and the best configuration, and their times."""
    kernel: str
    template: str
    signature: str
    shape_class: str
    default: dict
    default_seconds: float
    best: dict
    best_seconds: float
    trials: int = 0
    pruned: int = 0
    failed: int = 0
    stored: bool = False
    ir: object = field(default=None, repr=False)  # the kernel

    @property
    def speedup(self) -> float:
        return self.default_seconds / self.best_seconds if self.best_seconds else 1.0


def _freeze(params: dict) -> tuple:
    return tuple(sorted(params.items()))


def tune_kernel(kernel, device=None, *, trials: int = 30, template: Template | None = None,
                store: bool = True, seed: int = 0, repeat: int = 7, bar=None) -> TuneResult | None:
    """Search the template's space for the fastest configuration of one kernel on a device and
    store it; None when no template applies or its space has a single point."""
    import optuna
    from .device import default_device, get_device
    from . import dispatch

    dev = get_device(device) if device is not None else default_device()
    backend, info = dev.backend, dev.info
    t = template or template_for(dispatch.choose(kernel, dev).name, kernel, dev)
    if t is None:
        return None
    default = t.default(kernel, dev)
    space = {k: tuple(dict.fromkeys((*v, default[k]))) for k, v in t.space(kernel, dev).items()}
    if math.prod(len(v) for v in space.values()) <= 1:
        return None
    sig, shape = t.key(kernel)
    inputs = random_buffers(kernel, dev)
    want = _outputs(t.build(kernel, dev, backend, default), kernel, inputs, dev)
    seen: dict = {}
    counts = {"pruned": 0, "failed": 0}

    def objective(trial):
        params = {k: trial.suggest_categorical(k, list(v)) for k, v in space.items()}
        key = _freeze(params)
        if key in seen:
            return seen[key]
        why = t.check(params, kernel, dev)
        if why:
            counts["pruned"] += 1
            raise optuna.TrialPruned(why)
        try:
            run = t.build(kernel, dev, backend, params)
            if not _agrees(_outputs(run, kernel, inputs, dev), want):
                counts["failed"] += 1
                log.warning("tilefuse: %s with %s gives wrong results; pruned", kernel.name, params)
                raise optuna.TrialPruned("wrong results")
            seen[key] = s = measure(run, inputs, dev, repeat=repeat)
        except TilefuseError as e:
            counts["failed"] += 1
            raise optuna.TrialPruned(f"build or run failed: {e}") from None
        return s

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, min(10, trials // 3)))
    study = optuna.create_study(direction="minimize", sampler=sampler)
    study.enqueue_trial(default)
    callbacks = [lambda study, trial: bar.update(1)] if bar is not None else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.optimize(objective, n_trials=trials, callbacks=callbacks, catch=())
    default_key = _freeze(default)
    best_key = min(seen, key=seen.get) if seen else default_key
    best = {k: dict(best_key)[k] for k in space}
    d_s = seen.get(default_key) or measure(t.build(kernel, dev, backend, default), inputs, dev, repeat=repeat)
    b_s = seen.get(best_key, d_s)
    if best_key != default_key:  # confirm against the default, interleaved (the machine is noisy)
        runs = {k: t.build(kernel, dev, backend, dict(k)) for k in (default_key, best_key)}
        rounds = {k: [] for k in runs}
        for _ in range(3):
            for k, run in runs.items():
                rounds[k].append(measure(run, inputs, dev, repeat=repeat))
        d_s, b_s = (statistics.median(rounds[k]) for k in (default_key, best_key))
        if b_s > d_s * (1 - MIN_GAIN):
            best, b_s = default, d_s
    result = TuneResult(kernel.name, t.name, sig, shape, default, d_s, best, b_s, len(study.trials),
                        counts["pruned"], counts["failed"], ir=kernel)
    db = database()
    if store and db is not None:
        result.stored = db.put({"template": t.name, "signature": sig, "shape_class": shape,
                                "device": device_key(dev), "params": best, "seconds": b_s,
                                "default_seconds": d_s, "trials": result.trials, "kernel": kernel.name,
                                "device_name": info.name})
    return result


@dataclass
class TuneReport:
    """What `tune` did: a result per tuned kernel, and the kernels it skipped with the reason."""
    device: str
    results: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # (kernel, why)
    default_seconds: float | None = None  # the whole function without the tuned parameters
    tuned_seconds: float | None = None  # and with them

    def table(self) -> str:
        head = ("kernel", "template", "default us", "tuned us", "speedup", "best parameters")
        rows = [(r.kernel, r.template, f"{r.default_seconds * 1e6:.1f}", f"{r.best_seconds * 1e6:.1f}",
                 f"{r.speedup:.2f}x", " ".join(f"{k}={v}" for k, v in r.best.items()))
                for r in sorted(self.results, key=lambda r: -r.default_seconds)]
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        out = [f"tuned {len(self.results)} kernels on {self.device} ({len(self.skipped)} skipped)",
               line(head), line(["-" * w for w in widths]), *map(line, rows)]
        if self.default_seconds and self.tuned_seconds:
            d, t = self.default_seconds, self.tuned_seconds
            out.append(f"the whole function: {d * 1e3:.2f} ms with defaults, {t * 1e3:.2f} ms tuned "
                       f"({d / t:.2f}x)")
        return "\n".join(out)

    def __str__(self):
        return self.table()


def tune(fn, *args, trials: int = 20, device=None, min_share: float = 0.0, store: bool = True,
         progress: bool = True, repeat: int = 7, verify: bool = True, **kwargs) -> TuneReport:
    """Tune every kernel of `fn(*args, **kwargs)` (jitted if it is not already) on `device`
    (default: where jit would run it), the slowest first: `trials` configurations each, skipping
    kernels under `min_share` of the profiled time. Results go to the tuning database; with
    `verify`, the whole function is then timed compiled without and with them, in alternation
    (report.default_seconds, report.tuned_seconds). A jitted `fn` then builds with the tuned
    parameters at its next call."""
    from tilefuse.tracer.jit import JitFunction, jit
    from .device import get_device

    jf = fn if isinstance(fn, JitFunction) else jit(fn)
    old = config.default_device
    if device is not None:
        config.default_device = str(get_device(device))
    try:
        report = _tune_kernels_of(jf, args, kwargs, trials, min_share, store, progress, repeat)
        changed = any(r.best != r.default for r in report.results)
        if verify and store and changed and database() is not None:
            report.default_seconds, report.tuned_seconds = _with_and_without(jf, args, kwargs)
    finally:
        config.default_device = old
    if isinstance(fn, JitFunction):
        fn.clear_cache()
    return report


def _tune_kernels_of(jf, args, kwargs, trials, min_share, store, progress, repeat) -> TuneReport:
    from .profiler import profile
    jf(*args, **kwargs)  # compile and warm up
    with profile() as prof:
        for _ in range(2):
            jf(*args, **kwargs)
    total = prof.total_seconds() or 1.0
    per: dict = {}  # distinct kernels, by template key, with their profiled time
    report = TuneReport(str(config.default_device or "default"))
    for r in prof.records:
        info = r.info
        report.device = str(info.device)
        t = template_for(info.impl, info.kernel, info.device) if info.kernel is not None else None
        if t is None:
            continue
        entry = per.setdefault((t.name, *t.key(info.kernel)), [t, info, 0.0])
        entry[2] += r.seconds
    todo = []
    for t, info, s in sorted(per.values(), key=lambda e: -e[2]):
        if s / total < min_share:
            report.skipped.append((info.name, f"{100 * s / total:.2f}% of the time"))
        else:
            todo.append((t, info))
    bar = progress_bar(len(todo) * trials, progress)
    try:
        for t, info in todo:
            if bar is not None:
                bar.set_description(info.name[:30])
            try:
                res = tune_kernel(info.kernel, info.device, trials=trials, template=t, store=store,
                                  repeat=repeat, bar=bar)
            except TilefuseError as e:  # a kernel the template cannot take: report it, go on
                report.skipped.append((info.name, f"failed: {e}"))
                continue
            if res is None:
                report.skipped.append((info.name, "nothing to tune"))
            else:
                report.results.append(res)
    finally:
        if bar is not None:
            bar.close()
    return report


def _with_and_without(jf, args, kwargs, rounds: int = 16) -> tuple[float, float]:
    """Median seconds of a call compiled without, then with, the tuning database, alternating
    (the database path is part of jit's cache key, so both stay compiled). Many rounds: the
    tuned kernels often save a few percent of a step, within one call's noise on a shared machine;
    and in both orders, as the call after another one runs a little slower (measured on the
    example's step: 0.97x in one order only, 1.01x in both)."""
    from .device import default_device
    tuned = config.tuning_db
    modes = ("off", tuned)
    times: dict = {m: [] for m in modes}
    sync = default_device().synchronize

    def call():
        jf(*args, **kwargs)
        sync()
    try:
        for m in modes * 2:  # compiled, buffers allocated, pool warm
            config.tuning_db = m
            call()
        for r in range(rounds):
            for m in modes if r % 2 else modes[::-1]:  # each first as often: the second runs slower
                config.tuning_db = m
                t0 = time.perf_counter()
                call()
                times[m].append(time.perf_counter() - t0)
    finally:
        config.tuning_db = tuned
    return statistics.median(times["off"]), statistics.median(times[tuned])


def progress_bar(total: int, enabled: bool = True):
    """A tqdm bar of `total` trials (None without tqdm or when disabled)."""
    if not enabled or total <= 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="trial", dynamic_ncols=True)
