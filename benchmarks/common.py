"""Shared helpers for the benchmarks: median timing after warm-up, peak memory, running one
framework per subprocess (so its peak RSS is its own), and a side-by-side table with ratios.

    from common import time_median, side_by_side
    t = time_median(lambda: f(x), warmup=2, repeat=10)      # Timing: .median (s), .samples
    print(side_by_side({"tilefuse": {"step ms": 12.0}, "numpy": {"step ms": 30.0}},
                       ["step ms"], baseline="tilefuse"))

The machines are shared and noisy: quote medians, compare within one run, read the paired
ratios (paired_ratios: per round of alternated calls, then the median)."""
from __future__ import annotations

import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

RESULT_TAG = "@@bench-result "  # marks the worker's JSON line among whatever else it prints

# The benchmarks time compiled programs: tiered execution (runtime/tiered.py, on by default)
# would run their first calls on the interpreter, so it is off here unless TILEFUSE_TIERED is
# set. bench_compile.py and bench_train.py time first calls as a user meets them: they hand
# USER_TIERED (the setting the user's own programs would get) to their workers.
USER_TIERED = os.environ.get("TILEFUSE_TIERED", "auto")
os.environ.setdefault("TILEFUSE_TIERED", "0")


@dataclass(frozen=True)
class Timing:
    """Wall-clock samples of one measured call, in seconds."""
    samples: tuple

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    def __str__(self):
        return f"{fmt_seconds(self.median)} (median of {len(self.samples)}, min {fmt_seconds(self.min)})"


def time_median(fn: Callable[[], object], *, warmup: int = 2, repeat: int = 10,
                max_seconds: float | None = None) -> Timing:
    """Call fn `warmup` times unmeasured, then up to `repeat` times measured (fewer, but at least
    one, once max_seconds of measuring have passed). fn must wait for its own result
    (block_until_ready, .item(), a device synchronise): an asynchronous call times nothing."""
    for _ in range(warmup):
        fn()
    samples, start = [], time.perf_counter()
    for _ in range(max(repeat, 1)):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
    return Timing(tuple(samples))


def time_alternating(fns: dict, *, warmup: int = 2, repeat: int = 10, block: int = 3, settle: float = 0.2,
                     warm_s: float = 0.0, sample_s: float = 0.0, max_seconds: float | None = None,
                     clock: Callable[[], float] = time.perf_counter) -> dict:
    """time_median for several contenders in alternation: each round gives every one `block`
    samples in a row, so a slow spell of a noisy machine falls on all of them. Before each
    contender's block the machine rests `settle` seconds: the threads a library leaves spinning
    after its calls (OpenBLAS's for about 0.1 s; OpenMP's) would otherwise halve the next one's
    speed on two cores. After the rest, `warm_s` seconds of calls go unmeasured, as in a loop of
    calls: the first calls after a rest ran up to 1.6x slower on these VMs (idle cores wake
    slowly). A sample is one call, or the mean of as many calls as take `sample_s` seconds (calls
    too short to time one by one). {name: Timing}."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in fns}
    start = time.perf_counter()
    for _ in range(max(1, -(-repeat // block))):
        for name, fn in fns.items():
            if len(fns) > 1:
                time.sleep(settle)
            calls, until = 0, time.perf_counter() + warm_s
            while warm_s > 0 and (calls < 2 or time.perf_counter() < until):
                fn()
                calls += 1
            for _ in range(block):
                calls, t0, until = 0, clock(), time.perf_counter() + sample_s
                while calls < 1 or time.perf_counter() < until:
                    fn()
                    calls += 1
                samples[name].append((clock() - t0) / calls)
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
    return {name: Timing(tuple(s)) for name, s in samples.items()}


def paired_ratios(timings: dict, baseline: str) -> dict:
    """{name: the median over rounds of baseline's sample / name's sample in the same round}: a
    speed-up (2.0 = twice as fast as the baseline). time_alternating's samples line up by round,
    and consecutive calls share the machine's speed, which on these VMs swings by up to 1.5x from
    one second to the next: this ratio moved by ±2% between runs where the ratio of medians
    moved by ±30%. Quote it for comparisons; the medians for absolute figures."""
    base = timings[baseline].samples
    return {name: statistics.median(b / a for a, b in zip(t.samples, base) if a > 0)
            for name, t in timings.items()}


def peak_rss_mib() -> float:
    """This process's peak resident set size so far, in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


# ---- one framework per subprocess ------------------------------------------------------------

def emit(result: dict) -> None:
    """In a worker: hand `result` (JSON-able) back to run_worker, with the peak RSS added (and
    the time, from which run_worker tells how long the process took to exit after it)."""
    result = {**result, "peak_rss_mib": peak_rss_mib(), "emitted_at": time.time()}
    print(RESULT_TAG + json.dumps(result), flush=True)


def run_worker(argv: Sequence[str], *, env: dict | None = None, timeout: float | None = None,
               echo: bool = False) -> dict:
    """Run `python argv...` and return the dict its emit() printed, with exit_s: the seconds
    from that emit to the process's end (work left to threads at exit); on failure
    {"error": the reason and the last lines it printed}."""
    full_env = {**os.environ, **(env or {})}
    try:
        p = subprocess.run([sys.executable, *argv], env=full_env, capture_output=True, text=True,
                           timeout=timeout)
        ended = time.time()
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if echo and p.stderr:
        sys.stderr.write(p.stderr)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
            return {**result, "exit_s": max(0.0, ended - result.pop("emitted_at"))}
    tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-6:])
    return {"error": f"exit {p.returncode}: {tail}"}


# ---- tables ------------------------------------------------------------------------------------

def fmt_seconds(s: float) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_value(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> str:
    """A Markdown table (readable as text too), columns padded to their widest cell."""
    cells = [[str(h) for h in headers]] + [[fmt_value(c) if not isinstance(c, str) else c for c in r]
                                           for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    out = [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells[1:]]
    return (f"{title}\n\n" if title else "") + "\n".join(out)


def ratio(value, base) -> str:
    """value / base as '2.50x', or '' when either is missing or base is 0."""
    if not isinstance(value, (int, float)) or not isinstance(base, (int, float)) or not base:
        return ""
    return f"{value / base:.2f}x"


def side_by_side(results: dict[str, dict], metrics: Sequence[str], baseline: str | None = None,
                 formats: dict[str, Callable] | None = None, title: str | None = None) -> str:
    """One row per entry of `results` (name -> {metric: number or str}), one column per metric;
    numeric cells also show value / baseline's value (so 2.00x = twice the baseline's time or
    memory). Missing metrics print '-'; `formats` maps a metric to a formatter of its value."""
    formats = formats or {}
    base = results.get(baseline, {}) if baseline else {}
    rows = []
    for name, res in results.items():
        row = [name]
        for m in metrics:
            v = res.get(m)
            text = formats[m](v) if m in formats and isinstance(v, (int, float)) else fmt_value(v)
            r = ratio(v, base.get(m)) if name != baseline else ""
            row.append(f"{text} ({r})" if r else text)
        rows.append(row)
    note = f"ratios: value / {baseline}'s" if baseline else None
    text = table(["", *metrics], rows, title)
    return f"{text}\n\n{note}" if note else text
