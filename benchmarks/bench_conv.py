"""Convolution on the CPU: tilefuse.nn.conv2d (one conv primitive: the shared GEMM builder as an
implicit GEMM, ir/kernel/conv.py) against a numpy im2col (sliding windows + tensordot on BLAS)
and torch.nn.functional.conv2d where importable, in one run, timed in alternation; GFLOP/s of the
median time and ratios to numpy. (benchmarks/bench_gemm.py has the plain GEMMs.)

    python benchmarks/bench_conv.py [--repeat 10] [--batch 8]

Rows: ResNet-ish NCHW float32 layers at 32x32 (a 3x3 conv, a strided 3x3 downsampling conv, a
1x1 projection), forward; the 3x3 conv with a bias per channel and relu (one fused_conv: the
epilogue runs on the output tile); and the 3x3 conv forward + backward (gradients of x and w: 3x
the forward's FLOPs). numpy has no autodiff, so its backward row is left out."""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import table, time_alternating  # noqa: E402

LAYERS = [  # (name, C, O, kernel, stride, padding)
    ("3x3 conv C64->64", 64, 64, 3, 1, 1),
    ("3x3 stride 2 C64->128", 64, 128, 3, 2, 1),
    ("1x1 conv C64->256", 64, 256, 1, 1, 0),
]
SIZE = 32


def _out(n, k, s, p):
    return (n + 2 * p - k) // s + 1


def numpy_conv(x, w, stride, padding):
    """im2col by sliding windows, then one tensordot over (C, KH, KW) on BLAS."""
    k = w.shape[-1]
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (k, k), axis=(2, 3))[:, :, ::stride, ::stride]
    return np.tensordot(win, w, axes=([1, 4, 5], [1, 2, 3])).transpose(0, 3, 1, 2)


def _tilefuse(fn, args):
    import tilefuse as tx
    cpu = tx.get_device("cpu")
    dev_args = [tx.device_put(a, cpu) for a in args]
    f = tx.jit(fn, device=cpu)
    impls = {l.impl for l in f.lower(*dev_args).compile().program.launches
             if l.kind in ("dot_general", "fused_gemm", "conv", "fused_conv")}

    def run():
        out = f(*dev_args)
        for o in out if isinstance(out, tuple) else (out,):
            o.block_until_ready()
    return run, ",".join(sorted(impls))


def _torch(x, w, b, stride, padding, backward):
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    tx_, tw = torch.from_numpy(x), torch.from_numpy(w)
    if not backward:
        tb = None if b is None else torch.from_numpy(b)

        def run():
            with torch.no_grad():
                y = F.conv2d(tx_, tw, tb, stride=stride, padding=padding)
                if tb is not None:
                    F.relu(y, inplace=True)
        return run
    tx_.requires_grad_(True)
    tw.requires_grad_(True)

    def run_bwd():
        torch.autograd.grad(F.conv2d(tx_, tw, stride=stride, padding=padding).square().sum(), (tx_, tw))
    return run_bwd


def run_case(n, c, o, k, s, p, backward, repeat, bias_relu=False):
    import tilefuse.numpy as tnp
    from tilefuse import grad, nn
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, SIZE, SIZE)).astype(np.float32)
    w = (rng.standard_normal((o, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)
    oh = _out(SIZE, k, s, p)
    flops = 2 * n * o * c * k * k * oh * oh * (3 if backward else 1)
    b = rng.standard_normal(o).astype(np.float32) if bias_relu else None
    conv = lambda x, w: nn.conv2d(x, w, stride=s, padding=p)  # noqa: E731
    fn = grad(lambda x, w: tnp.sum(tnp.square(conv(x, w))), argnums=(0, 1)) if backward else conv
    np_fn, args = (lambda: numpy_conv(x, w, s, p)), (x, w)
    if bias_relu:
        fn = lambda x, w, b: nn.relu(conv(x, w) + b[None, :, None, None])  # noqa: E731
        np_fn, args = (lambda: np.maximum(numpy_conv(x, w, s, p) + b[None, :, None, None], 0)), (x, w, b)
    fns, impls = {}, ""
    if not backward:
        want = np_fn()
        fns["numpy"] = np_fn
    fns["tilefuse"], impls = _tilefuse(fn, args)
    if not backward:  # the same numbers as numpy's
        import tilefuse as tx
        got = np.asarray(tx.jit(fn, device="cpu")(*args))
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    t = _torch(x, w, b, s, p, backward)
    if t is not None:
        fns["torch"] = t
    timings = time_alternating(fns, warmup=2, repeat=repeat, max_seconds=20)
    return {who: flops / t.median / 1e9 for who, t in timings.items()}, impls


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    import tilefuse as tx
    cpu = tx.get_device("cpu")
    print(f"device: {cpu.info.name}, {cpu.info.compute_units} cores; NCHW float32, "
          f"N={args.batch}, H=W={SIZE}\n")
    cases = [(name, c, o, k, s, p, False, False) for name, c, o, k, s, p in LAYERS]
    cases.append((LAYERS[0][0] + " +bias, relu", *LAYERS[0][1:], False, True))
    cases.append((LAYERS[0][0] + " fwd+bwd", *LAYERS[0][1:], True, False))
    rows, whos = [], ["numpy", "tilefuse", "torch"]
    for name, c, o, k, s, p, bwd, bias_relu in cases:
        g, impls = run_case(args.batch, c, o, k, s, p, bwd, args.repeat, bias_relu)
        base = g.get("numpy")
        cell = lambda who: "-" if who not in g else (  # noqa: E731
            f"{g[who]:.1f}" + (f" ({g[who] / base:.2f}x)" if base and who != "numpy" else ""))
        rows.append([name, *[cell(who) for who in whos]])
        print(f"  {name}: " + ", ".join(f"{who} {v:.1f}" for who, v in g.items()) + f"  [{impls}]",
              flush=True)
    print()
    print(table(["GFLOP/s (ratio to numpy)", *whos], rows, title="conv2d on the CPU, medians"))


if __name__ == "__main__":
    main()
