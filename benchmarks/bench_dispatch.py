"""Dispatch overhead: a jitted `x + 1` on 8 float32s, microseconds per call over 10,000 calls,
against numpy, and JAX / PyTorch (eager and compiled) when installed. The cache-hit path
(flatten, key, lookup, launch) is what is measured. And one operation outside jit, `x * x` on
Arrays (eager: what grad without jit and notebook cells run, op by op), against PyTorch eager
and JAX's op-by-op dispatch."""
from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import table  # noqa: E402

CALLS, ROUNDS = 10_000, 7


def per_call_us(fn, arg) -> float:
    fn(arg)
    fn(arg)
    rounds = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for _ in range(CALLS):
            fn(arg)
        rounds.append((time.perf_counter() - t) / CALLS * 1e6)
    return statistics.median(rounds)


def main():
    rows = []
    x = np.ones(8, np.float32)
    rows.append(("numpy", per_call_us(lambda a: a + 1, x)))
    import tilefuse as tx
    for dev in tx.devices():
        f = tx.jit(lambda a: a + 1)
        xd = tx.device_put(x, dev)
        rows.append((f"tilefuse jit ({dev}, Array in)", per_call_us(f, xd)))
        if dev.kind in ("cpu", "ref"):
            with_dev = tx.jit(lambda a: a + 1, device=dev)
            rows.append((f"tilefuse jit ({dev}, numpy in)", per_call_us(with_dev, x)))
        rows.append((f"tilefuse eager x * x ({dev})", per_call_us(lambda a: a * a, xd)))
    try:
        import torch
        xt = torch.ones(8)
        rows.append(("PyTorch eager", per_call_us(lambda a: a + 1, xt)))
        rows.append(("PyTorch eager x * x", per_call_us(lambda a: a * a, xt)))
        try:
            ct = torch.compile(lambda a: a + 1)
            rows.append(("torch.compile", per_call_us(ct, xt)))
        except Exception as e:  # no compiler toolchain: report, do not fail
            print(f"torch.compile unavailable: {e}")
    except ImportError:
        print("PyTorch not installed: skipped (pip install torch)")
    try:
        import jax
        import jax.numpy as jnp
        jf = jax.jit(lambda a: a + 1)
        xj = jnp.ones(8)
        rows.append(("jax.jit", per_call_us(lambda a: jf(a).block_until_ready(), xj)))
        rows.append(("JAX eager x * x", per_call_us(lambda a: (a * a).block_until_ready(), xj)))
    except ImportError:
        print("JAX not installed: skipped (pip install jax)")
    base = rows[0][1]
    print(table(["call", "us / call", "x numpy"], [(n, f"{t:.2f}", f"{t / base:.1f}") for n, t in rows],
                title=f"dispatch of a jitted x + 1 on 8 floats, median of {ROUNDS} x {CALLS} calls"))


if __name__ == "__main__":
    main()
