"""Kernel by kernel, the same program on two devices: the training step of
examples/train_transformer.py (the benchmark's model, bench_train.py) profiled on `cpu` and on
each other device (default: every device but cpu and ref, a table each), the launches matched
by name (the front end is device-independent, so both run the same kernels), median time per
kernel over the profiled steps, and the ratio other / cpu. The issue's target for PoCL (both run on the same cores):
every kernel within 2x.

    python benchmarks/bench_backends.py [--device opencl:0] [--steps 5] [--top 25]"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "examples")]
from common import table  # noqa: E402


def kernel_times(device: str, steps: int) -> dict[str, tuple[str, float]]:
    """name -> (what it computes, median seconds per launch) for `steps` profiled train steps."""
    import tempfile

    import bench_train as bt

    import tilefuse as tx
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "inputs.npz")
        bt.prepare(path, steps + 2, 0)
        params, xs, ys = bt.load(path)
    step = bt.tilefuse_step(params, steps + 2, device)
    for i in range(2):  # compile and warm up
        step(i, xs[i], ys[i])
    with tx.profile() as prof:
        for i in range(2, steps + 2):
            step(i, xs[i], ys[i])
    times: dict[str, list] = defaultdict(list)
    what: dict[str, str] = {}
    for r in prof.records:
        times[r.info.name].append(r.seconds)
        what[r.info.name] = r.info.eqn_text
    return {n: (what[n], statistics.median(t)) for n, t in times.items()}


def compare(cpu: dict, other: str, dev: dict, args) -> None:
    """One device's kernel times against cpu's: the slowest kernels, totals and ratios."""
    names = [n for n in dev if n in cpu]
    ratios = {n: dev[n][1] / cpu[n][1] for n in names if cpu[n][1] > 0}
    rows = [(n, dev[n][0][:40], f"{cpu[n][1] * 1e6:.0f}", f"{dev[n][1] * 1e6:.0f}", f"{ratios[n]:.2f}x")
            for n in sorted(names, key=lambda n: -dev[n][1])[:args.top]]
    print(table(["kernel", "computes", "cpu µs", f"{other} µs", "ratio"], rows,
                title=f"train step, kernel by kernel: median of {args.steps} steps"))
    total_cpu = sum(cpu[n][1] for n in names)
    total_dev = sum(dev[n][1] for n in names)
    within = sum(r <= 2.0 for r in ratios.values())
    print(f"\n{len(names)} kernels matched ({len(cpu)} on cpu, {len(dev)} on {other}); "
          f"{within} within 2x; kernel time per step: cpu {total_cpu * 1e3:.1f} ms, "
          f"{other} {total_dev * 1e3:.1f} ms ({total_dev / total_cpu:.2f}x)")
    worst = sorted(ratios.items(), key=lambda kv: -kv[1])[:8]
    print("slowest relative to cpu:", ", ".join(f"{n} {r:.1f}x" for n, r in worst))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="the device compared with cpu (default: all but cpu, ref)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25, help="rows shown (the slowest on the other device)")
    args = ap.parse_args()
    import tilefuse as tx
    others = [args.device] if args.device else [str(d) for d in tx.devices() if d.kind not in ("cpu", "ref")]
    if not others:
        print("no device besides cpu: nothing to compare (pass --device)")
        return 0
    cpu = kernel_times("cpu", args.steps)
    for other in others:
        compare(cpu, other, kernel_times(other, args.steps), args)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
