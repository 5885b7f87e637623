"""Data-parallel training over MPI (tilefuse.distributed): the char-GPT step of
examples/train_transformer.py (global batch 32, AdamW) on 1 and 2 ranks.

    python benchmarks/bench_distributed.py                  # 1 and 2 ranks, 10 measured steps
    python benchmarks/bench_distributed.py --steps 20 --bucket-mb 0.1

One table: per configuration the median step time, the share of it spent in the forward and
backward segments (which include packing buckets and starting their reductions), the exposed
communication (from the end of the backward until every gradient is reduced and unpacked) and
the optimizer, and the gradient bytes each rank hands to MPI per step. The exposed time
includes waiting for the slower rank; "after slowest rank" is the part after the last rank
finished its backward (the ranks of one node share time.perf_counter's clock): the
communication proper. Overlap on starts each bucket's all-reduce as soon as the backward has
produced it; off starts them all after the backward. The model is small (~430k parameters, 1.7
MB of gradients), so buckets default to 0.25 MB here to give the backward several to overlap.
On a 2-core machine both ranks share the cores: the speedup is bounded; the shares and the
bytes are the point.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "examples")]

from common import RESULT_TAG, fmt_seconds, table  # noqa: E402

CONFIGS = {  # name -> data_parallel options
    "overlap": {"overlap": True},
    "no overlap": {"overlap": False},
    "overlap + int8": {"overlap": True, "compress": "int8"},
    "no overlap + int8": {"overlap": False, "compress": "int8"},
}


def worker(args) -> None:
    """Under mpirun: every configuration in turn; rank 0 prints one JSON line of results."""
    import tilefuse.random as random
    from tilefuse import distributed
    import data
    import train_transformer as T

    world = distributed.init()
    cfg = T.Config(vocab=96, d_model=args.d_model)
    optimizer = T.make_optimizer(3e-3, 1000)
    corpus = data.Corpus(max_chars=200_000)
    sampler = data.WindowSampler(corpus.train, args.batch, cfg.seq, 0)
    batches = [sampler.next() for _ in range(4)]
    configs = CONFIGS if world.size > 1 else {"1 rank": {}}
    results = {} if world.size > 1 else {"1 process, plain jit": plain_jit(T, cfg, optimizer, batches, args)}
    for name, options in configs.items():
        dp = distributed.data_parallel(lambda p, x, y: T.loss_fn(p, x, y, cfg), optimizer,
                                       bucket_mb=args.bucket_mb, **options)
        params, state = dp.init(T.init_params(random.key(0), cfg))
        times, after_slowest = [], []
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                dp.reset_stats()
            world.barrier()
            t0 = time.perf_counter()
            params, state, loss = dp.step(params, state, *batches[i % len(batches)])
            times.append(time.perf_counter() - t0)
            ends = world.allgather(np.array([dp.timeline["backward_end"]]), "timeline")
            after_slowest.append(max(0.0, dp.timeline["reduced"] - float(ends.max())))
        dp.check_identical(params)
        s, total = dp.stats, sum(times[args.warmup:])
        results[name] = {"ranks": world.size, "step_s": statistics.median(times[args.warmup:]),
                         "compute": s["compute_s"] / total, "exposed_comm": s["exposed_comm_s"] / total,
                         "exposed_comm_s": s["exposed_comm_s"] / s["steps"],
                         "after_slowest_s": statistics.mean(after_slowest[args.warmup:]),
                         "optimizer": s["optimizer_s"] / total,
                         "bytes_per_step": s["bytes_sent"] / s["steps"],
                         "buckets": s["buckets"], "loss": loss}
    if world.rank == 0:
        print(RESULT_TAG + json.dumps(results), flush=True)


def plain_jit(T, cfg, optimizer, batches, args) -> dict:
    """The example's own jitted step in one process: what the segmented step is measured against."""
    import tilefuse.random as random
    step = T.make_train_step(cfg, optimizer)
    params, state, key = T.init_params(random.key(0), cfg), None, random.key(1)
    state = optimizer.init(params)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        params, state, key, loss = step(params, state, key, *batches[i % len(batches)])
        loss = float(loss)
        times.append(time.perf_counter() - t0)
    return {"ranks": 1, "step_s": statistics.median(times[args.warmup:]), "loss": loss}


def run(ranks: int, args) -> dict:
    """The worker on `ranks` ranks; one rank runs as a plain process (MPI's singleton), so it
    may use every core, as the 2 ranks together do."""
    import subprocess
    from tilefuse import distributed
    argv = [os.path.abspath(__file__), "--worker", "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--bucket-mb", str(args.bucket_mb), "--batch", str(args.batch), "--d-model", str(args.d_model)]
    cmd = distributed.mpirun_command(ranks, *argv) if ranks > 1 else [sys.executable, *argv]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    sys.exit(f"{ranks} ranks failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="measured steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=0.25)
    p.add_argument("--batch", type=int, default=32, help="global batch")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        sys.exit("bench_distributed needs mpi4py and an MPI: pip install 'tilefuse[dist]'")
    results = {**run(1, args), **run(2, args)}
    pct = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    base = results["1 rank"]["step_s"]
    rows = [[name, r["ranks"], fmt_seconds(r["step_s"]), f"{base / r['step_s']:.2f}x"] +
            ([pct(r["compute"]), pct(r["exposed_comm"]), fmt_seconds(r["exposed_comm_s"]),
              fmt_seconds(r["after_slowest_s"]), pct(r["optimizer"]), f"{r['bytes_per_step'] / 1e6:.3f} MB",
              r["buckets"]] if "buckets" in r else ["-"] * 7) +
            [f"{r['loss']:.3f}"] for name, r in results.items()]
    print(table(["configuration", "ranks", "step", "speedup", "fwd+bwd", "exposed comm", "exposed/step",
                 "after slowest rank", "optimizer", "grad bytes sent/step", "buckets", "last loss"], rows,
                f"char-GPT d_model {args.d_model}, global batch {args.batch}, buckets {args.bucket_mb} MB, "
                f"median of {args.steps} steps"))


if __name__ == "__main__":
    main()
