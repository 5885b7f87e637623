"""GEMM on the CPU: tilefuse's generated GEMM (the shared builder's packed form, ir/kernel/gemm.py)
and its vendor candidate (numpy's BLAS through the implementation registry) against numpy, and PyTorch / JAX
where importable, in one run; GFLOP/s of the median time and ratios to numpy. The contenders
are timed in interleaved rounds, so that a noisy machine's load falls on all of them alike.

    python benchmarks/bench_gemm.py [--sizes 256,512,1024,2048] [--repeat 10] [--no-transformer]
    taskset -c 0 python benchmarks/bench_gemm.py --clock cpu     # one core each, CPU time

Rows: float32 squares, the transformer example's GEMMs (examples/train_transformer.py: batch 32,
seq 64, d_model 128, so M = 2048: the fused QKV projection, the attention output, the MLP, the
head, and a weight gradient xᵀ·dy read transposed in place), one with a fused bias + GELU
epilogue (numpy computes the same expression unfused), a batched q·kᵀ (128 products of 64 x 64 x 32,
B read transposed), a weight applied to a batch of matrices (einsum 'ok,nkp->nop'), and bfloat16
inputs at N = 1024. The target: the generated kernel at N = 1024
reaches >= 80% of numpy's BLAS in the same run."""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import paired_ratios, table, time_alternating

TRANSFORMER = [  # (name, M, N, K, A transposed)
    ("qkv (2048x128)@(128x384)", 2048, 384, 128, False),
    ("attn out (2048x128)@(128x128)", 2048, 128, 128, False),
    ("mlp in (2048x128)@(128x512)", 2048, 512, 128, False),
    ("mlp out (2048x512)@(512x128)", 2048, 128, 512, False),
    ("head (2048x128)@(128x96)", 2048, 96, 128, False),
    ("dW (128x2048)ᵀ@(2048x384)", 128, 384, 2048, True),
]


def _gelu_np(y):
    return 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * (y * y * y))))


def _tilefuse(mode: str, fn, args, device="cpu"):
    """A timed callable of fn compiled on `device` with TILEFUSE_GEMM=mode (the executable
    itself: a jitted call would look its executable up under the setting of the moment), inputs
    already on the device; and the GEMM implementations it runs."""
    import tilefuse as tx
    old, tx.config.gemm = tx.config.gemm, mode
    try:
        dev = tx.get_device(device)
        dev_args = [tx.device_put(a, dev) for a in args]
        exe = tx.jit(fn, device=dev).lower(*dev_args).compile()
    finally:
        tx.config.gemm = old
    impls = {l.impl for l in exe.program.launches if l.kind in ("dot_general", "fused_gemm")}
    return (lambda: exe(dev_args)[0].block_until_ready()), ",".join(sorted(impls))


def _opencl() -> str | None:
    """The first OpenCL device's name, or None where there is none."""
    import tilefuse as tx
    try:
        return next((d.name for d in tx.devices("opencl")), None)
    except tx.DeviceError:
        return None


def _others(a, b, transposed: bool, spec=None):
    """PyTorch and JAX matmuls (einsums: `spec`) where importable: name -> timed callable."""
    out = {}
    try:
        import torch
        ta, tb = torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(b)
        out["torch"] = (lambda: torch.einsum(spec, ta, tb)) if spec else \
            (lambda: ta.T @ tb) if transposed else (lambda: ta @ tb)
    except ImportError:
        pass
    try:
        import jax
        import jax.numpy as jnp
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        f = jax.jit((lambda x, y: jnp.einsum(spec, x, y)) if spec else
                    (lambda x, y: x.T @ y) if transposed else (lambda x, y: x @ y))
        out["jax"] = lambda: f(ja, jb).block_until_ready()
    except ImportError:
        pass
    return out


def run_case(name, m, n, k, transposed=False, dtype=np.float32, epilogue=False, repeat=10,
             clock=time.perf_counter, modes=("generated", "vendor"), others=True, batch=1, spec=None):
    """batch > 1: a batched product of (batch, m, k) and (batch, n, k) read transposed, the
    attention scores' q·kᵀ; or, with an einsum `spec`, of (m, k) and (batch, k, n)."""
    import tilefuse.numpy as tnp
    from tilefuse import nn
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m) if transposed else (m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    bias = rng.standard_normal(n).astype(dtype)
    flops = 2 * batch * m * n * k
    if batch > 1 and spec is None:
        a = rng.standard_normal((batch, m, k)).astype(dtype)
        b = rng.standard_normal((batch, n, k)).astype(dtype)
    if spec is not None:
        b = rng.standard_normal((batch, k, n)).astype(dtype)
        fn = lambda x, y: tnp.einsum(spec, x, y)
        args = (a, b)
        numpy_fn = lambda: np.einsum(spec, a, b, optimize=True)
    elif epilogue:
        fn = lambda x, w, c: nn.gelu(tnp.matmul(x, w) + c)
        args = (a, b, bias)
        numpy_fn = lambda: _gelu_np(a @ b + bias)
    elif batch > 1:
        fn = lambda q, kt: tnp.matmul(q, tnp.swapaxes(kt, 1, 2))
        args = (a, b)
        numpy_fn = lambda: a @ np.swapaxes(b, 1, 2)
    else:
        fn = (lambda x, w: tnp.matmul(x.T, w)) if transposed else tnp.matmul
        args = (a, b)
        a32, b32 = a.astype(np.float32), b.astype(np.float32)
        numpy_fn = (lambda: a32.T @ b32) if transposed else (lambda: a32 @ b32)
    fns = {"numpy": numpy_fn}
    impls = {}
    for mode in modes:
        fns[mode], impls[mode] = _tilefuse(mode, fn, args)
    if others and _opencl() and dtype == np.float32:  # the OpenCL template (PoCL: the same two cores)
        fns["opencl"], impls["opencl"] = _tilefuse("auto", fn, args, _opencl())
    if others and dtype == np.float32 and not epilogue and (batch == 1 or spec):
        fns.update(_others(a, b, transposed, spec))
    times = time_alternating(fns, warmup=2, repeat=repeat, block=1, settle=SETTLE, warm_s=WARM_S,
                             sample_s=SAMPLE_S, clock=clock)
    return {who: flops / t.median / 1e9 for who, t in times.items()}, impls, paired_ratios(times, "numpy")


SETTLE = 0.4  # seconds: OpenBLAS, OpenMP (torch) and Eigen (jax) threads spin after a call
WARM_S = 0.03  # seconds of calls before timing: a core that was idle runs the next calls slowly
SAMPLE_S = 0.01  # seconds of calls per sample (at least one call)


def _cell(g: dict, speedup: dict, who: str) -> str:
    return f"{g[who]:.0f} ({speedup[who]:.2f}x)" if who in g else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256,512,1024,2048")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-transformer", action="store_true")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time (all threads), the work each contender does, "
                         "insensitive to other processes' load; under `taskset -c 0` every contender "
                         "runs on one core")
    args = ap.parse_args()
    import tilefuse as tx
    from tilefuse.runtime.hardware import target_of
    cpu = tx.get_device("cpu")
    print(f"device: {cpu.info.name}, {cpu.info.compute_units} cores; {target_of(cpu.info)}\n")

    cases = [(f"square {s} f32", s, s, s, False, np.float32, False) for s in map(int, args.sizes.split(","))]
    if not args.no_transformer:
        cases += [(nm, m, n, k, t, np.float32, False) for nm, m, n, k, t in TRANSFORMER]
        cases.append(("gelu(x@W+b) (2048x128)@(128x512)", 2048, 512, 128, False, np.float32, True))
        cases.append(("batched 128x(64x32)@(32x64)ᵀ", 64, 64, 32, False, np.float32, False, 128))
        # a weight on a batch of matrices: no strided GEMM reads the rhs as it lies (dot_layouts)
        cases.append(("einsum ok,nkp->nop 8x(64x576)@(576x1024)", 64, 1024, 576, False, np.float32, False, 8,
                      "ok,nkp->nop"))
    import ml_dtypes
    cases.append(("square 1024 bf16", 1024, 1024, 1024, False, np.dtype(ml_dtypes.bfloat16), False))

    rows, others = [], set()
    for name, m, n, k, t, d, epi, *extra in cases:
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        batch, spec = (list(extra) + [1, None][len(extra):])[:2]
        g, impls, speedup = run_case(name, m, n, k, t, d, epi, args.repeat, clock, batch=batch, spec=spec)
        others |= set(g) - {"numpy", "generated", "vendor"}
        who = ("generated", "vendor", "opencl", "torch", "jax")
        rows.append([name, f"{g['numpy']:.0f}", *(_cell(g, speedup, w) for w in who)])
        print(f"  {name}: " + ", ".join(f"{w} {v:.0f}" for w, v in g.items()) +
              f"  [{' / '.join(impls.values())}]", flush=True)
    shown = [True, True, True, True, "opencl" in others, "torch" in others, "jax" in others]
    cols = ["GFLOP/s (paired speed-up over numpy)", "numpy", "tilefuse generated", "tilefuse vendor",
            "tilefuse opencl", "torch", "jax"]
    cols, rows = [c for c, k in zip(cols, shown) if k], [[c for c, k in zip(r, shown) if k] for r in rows]
    print()
    print(table(cols, rows, title="GEMM on the CPU: GFLOP/s of the medians; in brackets the median "
                                  "over rounds of numpy's time / the contender's (common.paired_ratios)"))
    print("\nnumpy on bf16 rows: the same product in float32 (numpy has no bfloat16 BLAS); on the "
          "gelu row: the unfused expression.")


if __name__ == "__main__":
    main()
