"""Dispatch overhead: a jitted `x + 1` on 8 float32s, microseconds per call over 10,000 calls,
against numpy, and JAX / PyTorch (eager and compiled) when installed. The cache-hit path
(flatten, key, lookup, launch) is what is measured. And one operation outside jit, `x * x` on
Arrays (eager: what grad without jit and notebook cells run, op by op), against PyTorch eager
and JAX's op-by-op dispatch."""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import table, time_alternating  # noqa: E402

CALLS, ROUNDS = 10_000, 7


def calls(fn, arg):
    """A contender: CALLS calls of fn(arg) (one sample of time_alternating)."""
    def run():
        for _ in range(CALLS):
            fn(arg)
    return run


def main():
    fns = {}
    x = np.ones(8, np.float32)
    fns["numpy"] = calls(lambda a: a + 1, x)
    import tilefuse as tx
    for dev in tx.devices():
        f = tx.jit(lambda a: a + 1)
        xd = tx.device_put(x, dev)
        fns[f"tilefuse jit ({dev}, Array in)"] = calls(f, xd)
        if dev.kind in ("cpu", "ref"):
            with_dev = tx.jit(lambda a: a + 1, device=dev)
            fns[f"tilefuse jit ({dev}, numpy in)"] = calls(with_dev, x)
        fns[f"tilefuse eager x * x ({dev})"] = calls(lambda a: a * a, xd)
    try:
        import torch
        xt = torch.ones(8)
        fns["PyTorch eager"] = calls(lambda a: a + 1, xt)
        fns["PyTorch eager x * x"] = calls(lambda a: a * a, xt)
        try:
            ct = torch.compile(lambda a: a + 1)
            fns["torch.compile"] = calls(ct, xt)
        except Exception as e:  # no compiler toolchain: report, do not fail
            print(f"torch.compile unavailable: {e}")
    except ImportError:
        print("PyTorch not installed: skipped (pip install torch)")
    try:
        import jax
        import jax.numpy as jnp
        jf = jax.jit(lambda a: a + 1)
        xj = jnp.ones(8)
        fns["jax.jit"] = calls(lambda a: jf(a).block_until_ready(), xj)
        fns["JAX eager x * x"] = calls(lambda a: (a * a).block_until_ready(), xj)
    except ImportError:
        print("JAX not installed: skipped (pip install jax)")
    timings = time_alternating(fns, warmup=1, repeat=ROUNDS, block=1, settle=0.2)
    rows = [(name, t.median / CALLS * 1e6) for name, t in timings.items()]
    base = rows[0][1]
    print(table(["call", "us / call", "x numpy"], [(n, f"{t:.2f}", f"{t / base:.1f}") for n, t in rows],
                title=f"dispatch of a jitted x + 1 on 8 floats, median of {ROUNDS} rounds of {CALLS} calls, "
                "the contenders in alternation"))


if __name__ == "__main__":
    main()
