"""A scan of 1,000 steps of a small MLP cell, h' = tanh(tanh([h, x] W1 + b1) W2 + b2) (batch 8,
state 32, hidden 64): tilefuse's lax.scan on each device, the same loop unrolled in Python under
tilefuse's jit, and JAX's lax.scan where installed, each in its own subprocess.

    python benchmarks/bench_scan.py                         # cpu, opencl:0 and JAX, 1,000 steps
    python benchmarks/bench_scan.py --steps 200 --only scan:cpu,unrolled:cpu,jax
    python benchmarks/bench_scan.py --only ewscan:cpu,ewstep:cpu,jax_ew --steps 10000

ewscan:DEVICE is an elementwise cell, h' = tanh(h * a + x) (8 x 32), which runs as one kernel
holding the loop (runtime/control_flow.py); ewstep:DEVICE the same with that form turned off (a
launch per step); jax_ew JAX's lax.scan of it.

One table: the first call (tracing, compiling and running once; tilefuse with an empty compile
cache), a call of all the steps (median after warm-up), the time per step, the size of the traced
graph and the memory pool's allocations in one call. The unrolled version's graph and compile grow
with the steps; the scan's graph, compile and allocations do not."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import emit, fmt_seconds, run_worker, side_by_side, time_median  # noqa: E402

B, D, H = 8, 32, 64


def inputs(steps: int):
    rng = np.random.default_rng(0)
    params = ((rng.standard_normal((2 * D, H)) * 0.1).astype(np.float32), np.zeros(H, np.float32),
              (rng.standard_normal((H, D)) * 0.1).astype(np.float32), np.zeros(D, np.float32))
    return params, np.zeros((B, D), np.float32), rng.standard_normal((steps, B, D)).astype(np.float32)


def reference(params, h, xs) -> np.ndarray:
    if len(params) == 1:  # the elementwise cell
        for x in xs:
            h = np.tanh(h * params[0] + x)
        return h
    w1, b1, w2, b2 = params
    for x in xs:
        h = np.tanh(np.tanh(np.concatenate([h, x], 1) @ w1 + b1) @ w2 + b2)
    return h


# ---- workers ------------------------------------------------------------------------------------

def tilefuse_fn(kind: str):
    import tilefuse.numpy as tnp
    from tilefuse import lax

    def cell(p, h, x):
        w1, b1, w2, b2 = p
        return tnp.tanh(tnp.tanh(tnp.concatenate([h, x], axis=1) @ w1 + b1) @ w2 + b2)

    def scanned(p, h, xs):
        return lax.scan(lambda h, x: (cell(p, h, x), None), h, xs)[0]

    def elementwise(p, h, xs):
        return lax.scan(lambda h, x: (tnp.tanh(h * p[0] + x), None), h, xs)[0]
    if kind.startswith("ew"):
        return elementwise

    def unrolled(p, h, xs):
        for t in range(xs.shape[0]):
            h = cell(p, h, xs[t])
        return h
    return scanned if kind == "scan" else unrolled


def jax_fn(elementwise: bool = False):
    import jax
    import jax.numpy as jnp

    if elementwise:
        @jax.jit
        def ew(p, h, xs):
            return jax.lax.scan(lambda h, x: (jnp.tanh(h * p[0] + x), None), h, xs)[0]
        return ew, lambda out: np.asarray(out.block_until_ready())

    def cell(p, h, x):
        w1, b1, w2, b2 = p
        return jnp.tanh(jnp.tanh(jnp.concatenate([h, x], axis=1) @ w1 + b1) @ w2 + b2)

    @jax.jit
    def scanned(p, h, xs):
        return jax.lax.scan(lambda h, x: (cell(p, h, x), None), h, xs)[0]
    return scanned, lambda out: np.asarray(out.block_until_ready())


def worker(name: str, steps: int, repeat: int) -> None:
    params, h0, xs = inputs(steps)
    if name.startswith("ew") or name == "jax_ew":
        params = ((np.random.default_rng(1).standard_normal(D) * 0.5).astype(np.float32),)
    if name in ("jax", "jax_ew"):
        fn, read = jax_fn(name == "jax_ew")
        graph_size = None
    else:
        import tilefuse as tx
        kind, device = name.split(":", 1)
        tx.config.default_device = device
        if kind == "ewstep":
            from tilefuse.runtime import control_flow
            control_flow.loop_kernels = False
        fn = tx.jit(tilefuse_fn(kind))
        graph_size = len(fn.lower(params, h0, xs).graph.eqns)

        def read(out):
            return np.asarray(out)
    t0 = time.perf_counter()
    out = read(fn(params, h0, xs))
    first = time.perf_counter() - t0
    err = float(np.abs(out - reference(params, h0, xs)).max())
    t = time_median(lambda: read(fn(params, h0, xs)), warmup=1, repeat=repeat, max_seconds=30)
    allocs = None  # the pool's allocations in one call: as many for 10 steps as for 10,000
    if not name.startswith("jax") and tx.get_device(device).kind != "ref":
        stats = tx.get_device(device).memory_stats
        before = stats()["alloc_calls"]
        read(fn(params, h0, xs))
        allocs = stats()["alloc_calls"] - before
    emit({"first call": first, "call": t.median, "per step": t.median / steps, "graph eqns": graph_size,
          "allocs/call": allocs, "max error": err})


# ---- driver -------------------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--only", default="scan:cpu,unrolled:cpu,scan:opencl:0,jax",
                   help="comma-separated: scan:DEVICE, unrolled:DEVICE, jax, ewscan:DEVICE, ewstep:DEVICE, jax_ew")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.steps, args.repeat)
    results = {}
    names = [n.strip() for n in args.only.replace("opencl:0", "opencl#0").split(",") if n.strip()]
    for name in (n.replace("opencl#0", "opencl:0") for n in names):
        with tempfile.TemporaryDirectory() as cache:  # a cold compile cache: first calls compile
            res = run_worker([os.path.abspath(__file__), "--worker", name, "--steps", str(args.steps),
                              "--repeat", str(args.repeat)], env={"TILEFUSE_CACHE_DIR": cache}, timeout=1800)
        results[name] = res
        if "error" in res:
            print(f"{name}: {res['error']}", file=sys.stderr)
    fmt = {m: fmt_seconds for m in ("first call", "call", "per step")}
    print(side_by_side({k: v for k, v in results.items() if "error" not in v},
                       ["first call", "call", "per step", "graph eqns", "allocs/call", "max error"],
                       baseline=next((k for k in results if k.startswith("scan:")), None), formats=fmt,
                       title=f"scan of {args.steps} steps of an MLP cell (batch {B}, state {D}, hidden {H}); "
                             f"ew*: an elementwise cell tanh(h * a + x)"))


if __name__ == "__main__":
    main()
