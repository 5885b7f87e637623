"""What the profiler costs: a jitted `x + 1` on 8 floats (µs per call, median of rounds) with
profiling off and on, on every device, and the train step of examples/train_transformer.py off
and on; plus the cost of the check the launch loop makes when profiling is off (one global load).

    python benchmarks/bench_profiler.py [--no-train]

Off must be indistinguishable from the dispatch benchmark (benchmarks/bench_dispatch.py): the
check is a few nanoseconds against microseconds of dispatch."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import timeit

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "examples")]
from common import table, time_median  # noqa: E402

CALLS, ROUNDS = 5_000, 7


def per_call_us(fn, arg, profiled: bool) -> float:
    import tilefuse as tx
    fn(arg)
    rounds = []
    for _ in range(ROUNDS):
        prof = tx.profile() if profiled else None
        if prof is not None:
            prof.__enter__()
        t = time.perf_counter()
        for _ in range(CALLS):
            fn(arg)
        rounds.append((time.perf_counter() - t) / CALLS * 1e6)
        if prof is not None:
            prof.__exit__(None, None, None)
    return statistics.median(rounds)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-train", action="store_true", help="skip the train step")
    a = p.parse_args(argv)
    import tilefuse as tx
    from tilefuse.runtime import profiler

    rows = []
    x = np.ones(8, np.float32)
    for dev in tx.devices():
        f = tx.jit(lambda v: v + 1)
        xd = tx.device_put(x, dev)
        off, on = per_call_us(f, xd, False), per_call_us(f, xd, True)
        rows.append((f"jit x + 1 ({dev})", f"{off:.2f} us", f"{on:.2f} us", f"{on / off:.2f}x"))
    check_ns = min(timeit.repeat("profiler.active is None", globals={"profiler": profiler},
                                 number=1_000_000, repeat=5)) * 1e3
    if not a.no_train:
        import train_transformer as tt
        step, args = tt.tuning_workload()
        step(*args)

        def one():
            out = step(*args)
            float(out[-1])
        off = time_median(one, warmup=1, repeat=7).median

        def profiled():
            with tx.profile():
                one()
        on = time_median(profiled, warmup=1, repeat=7).median
        rows.append((f"train step ({tx.default_device()})", f"{off * 1e3:.1f} ms", f"{on * 1e3:.1f} ms",
                     f"{on / off:.2f}x"))
    print(table(["call", "profiling off", "profiling on", "on / off"], rows,
                title=f"profiler overhead, medians of {ROUNDS} rounds"))
    print(f"\nthe check made per program call when profiling is off: {check_ns:.1f} ns")


if __name__ == "__main__":
    main()
