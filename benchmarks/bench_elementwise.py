"""Elementwise chain and row softmax on float32: tilefuse `cpu` against numpy, and JAX / PyTorch
where importable, in one run; medians and ratios in one table.

    python benchmarks/bench_elementwise.py [--sizes 4M,16M] [--repeat 15] [--threshold]

Until the jit pipeline (runtime/compiler.py) lands, tilefuse runs hand-built kernels (exactly
what the fusion produces: one kernel for the chain; max / sum-of-exp / normalise for softmax);
`tilefuse_fns` switches to `tx.jit` by itself once the `cpu` device is available.
`--threshold` measures one thread against the pool, to set PARALLEL_MIN_NS (backends/llvm)."""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import numpy as np

os.environ.setdefault("TILEFUSE_TIERED", "0")  # compiled programs are timed (common.py says why)

CHAIN = "tanh(x*1.7+0.3)*sigmoid(x)+exp(-x*x)*0.5"
COLS = 1024  # softmax rows of 1024


def chain_np(x):
    return np.tanh(x * 1.7 + 0.3) * (1 / (1 + np.exp(-x))) + np.exp(-x * x) * 0.5


def softmax_np(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


# ---- tilefuse -------------------------------------------------------------------------------------

def tilefuse_fns(n):
    """(chain, softmax) callables on float32 inputs of n elements, and how they run."""
    try:
        import tilefuse as tx
        import tilefuse.numpy as tnp
        tx.devices("cpu")[0]
        tx.get_device("cpu")

        def chain(x):
            return tnp.tanh(x * 1.7 + 0.3) * tnp.sigmoid(x) + tnp.exp(-x * x) * 0.5

        def softmax(x):
            e = tnp.exp(x - tnp.max(x, axis=1, keepdims=True))
            return e / tnp.sum(e, axis=1, keepdims=True)
        jc, js = tx.jit(chain), tx.jit(softmax)
        return (lambda x: jc(x).block_until_ready()), (lambda x: js(x).block_until_ready()), "tx.jit"
    except Exception:  # the pipeline is not there yet: the kernels it would produce
        return _kernel_chain(n), _kernel_softmax(n), "kernels"


def _kernel_chain(n):
    from tilefuse.backends.llvm import create
    from tilefuse.ir.kernel import ir as K
    f32 = np.dtype(np.float32)
    be = create()
    x = K.load(0, K.idx(0), f32)
    c = lambda v: K.const(v, f32)  # noqa: E731
    v = K.binary("add", K.binary("mul", K.unary("tanh", K.binary("add", K.binary("mul", x, c(1.7)), c(0.3))),
                                 K.unary("logistic", x)),
                 K.binary("mul", K.unary("exp", K.unary("neg", K.binary("mul", x, x))), c(0.5)))
    k = K.Kernel("chain", (K.Buffer("x", f32, n), K.Buffer("y", f32, n)), 1, (n,), (),
                 (K.Store(1, K.idx(0), v),))
    ck = be.compile_kernel(k)

    def run(xs):
        out = be.alloc(4 * n)  # from the pool: no page faults after the first call
        ck([xs, out])
        return out
    return run


def _kernel_softmax(n):
    from tilefuse.backends.llvm import create
    from tilefuse.ir.kernel import ir as K
    f32 = np.dtype(np.float32)
    be = create()
    rows = n // COLS
    X, R = K.Buffer("x", f32, n), K.Buffer("r", f32, rows)
    ld = K.load(0, K.affine([COLS], reduce_strides=[1]), f32)
    kmax = be.compile_kernel(K.Kernel("max", (X, R), 1, (rows,), (COLS,),
                                      (K.Store(1, K.idx(0), K.reduce("max", ld)),)))
    e = K.unary("exp", K.binary("sub", ld, K.load(1, K.idx(0), f32)))
    ksum = be.compile_kernel(K.Kernel("sum", (X, R, R), 2, (rows,), (COLS,),
                                      (K.Store(2, K.idx(0), K.reduce("sum", e)),)))
    out = K.binary("div", K.unary("exp", K.binary("sub", K.load(0, K.affine([COLS, 1]), f32),
                                                  K.load(1, K.idx(0), f32))), K.load(2, K.idx(0), f32))
    knorm = be.compile_kernel(K.Kernel("norm", (X, R, R, X), 3, (rows, COLS), (),
                                       (K.Store(3, K.affine([COLS, 1]), out),)))

    def run(xs):
        m, s, y = be.alloc(4 * rows), be.alloc(4 * rows), be.alloc(4 * n)
        kmax([xs, m])
        ksum([xs, m, s])
        knorm([xs, m, s, y])
        return y
    return run


# ---- others -----------------------------------------------------------------------------------------

def jax_fns():
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None
    chain = jax.jit(lambda x: jnp.tanh(x * 1.7 + 0.3) * jax.nn.sigmoid(x) + jnp.exp(-x * x) * 0.5)
    soft = jax.jit(lambda x: jax.nn.softmax(x, axis=1))
    return (lambda x: chain(x).block_until_ready()), (lambda x: soft(x).block_until_ready()), jax.device_put


def torch_fns():
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(max(1, len(__import__("os").sched_getaffinity(0))))

    def chain(x):
        return torch.tanh(x * 1.7 + 0.3) * torch.sigmoid(x) + torch.exp(-x * x) * 0.5
    return chain, (lambda x: torch.softmax(x, dim=1)), torch.from_numpy


def median_ms(fn, x, repeat):
    fn(x)  # warm up (compile, caches, first-touch of pooled memory)
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(x)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3, min(ts) * 1e3


def parse_size(s):
    return int(float(s.rstrip("MK")) * {"M": 1 << 20, "K": 1 << 10}.get(s[-1], 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4M,16M")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threshold", action="store_true")
    args = ap.parse_args()
    if args.threshold:
        return threshold()
    rows = []
    for size in args.sizes.split(","):
        n = parse_size(size)
        x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        x2 = x.reshape(-1, COLS)
        tchain, tsoft, how = tilefuse_fns(n)
        if how == "tx.jit":
            import tilefuse as tx
            tf_put = tx.device_put
        else:
            tf_put = np.ravel  # the kernels read flat buffers
        impls = [("numpy", chain_np, softmax_np, lambda a: a), (f"tilefuse ({how})", tchain, tsoft, tf_put)]
        for name, mk in (("JAX jit", jax_fns), ("PyTorch", torch_fns)):
            got = mk()
            if got is not None:
                impls.append((name, *got))
        for name, chain, soft, put in impls:
            for bench, fn, arg in (("chain", chain, x), ("softmax", soft, x2)):
                med, best = median_ms(fn, put(arg), args.repeat)
                rows.append((size, bench, name, med, best))
    print_table(rows)


def print_table(rows):
    print(f"\n{CHAIN} and row softmax (rows of {COLS}), float32; median (min) of the runs\n")
    print("(ratios: the other's median / this one's; above 1 = faster than it)\n")
    print("| size | benchmark | implementation | median ms | min ms | vs numpy | vs JAX jit |")
    print("|---|---|---|---|---|---|---|")
    for size, bench, name, med, best in rows:
        ref = {r[2]: r[3] for r in rows if r[0] == size and r[1] == bench}
        vs_np = f"{ref['numpy'] / med:.1f}x" if "numpy" in ref else ""
        vs_jax = f"{ref['JAX jit'] / med:.2f}x" if "JAX jit" in ref else "—"
        print(f"| {size} | {bench} | {name} | {med:.2f} | {best:.2f} | {vs_np} | {vs_jax} |")


def threshold():
    """µs per call of a simple kernel (x*2+1) on one thread and on the pool, by size."""
    from tilefuse.backends.llvm import compile as C
    from tilefuse.backends.llvm import create
    from tilefuse.ir.kernel import ir as K
    f32 = np.dtype(np.float32)
    be = create()
    print("| points | 1 thread µs | pool µs |\n|---|---|---|")
    for n in (1 << 12, 1 << 14, 1 << 15, 1 << 16, 1 << 17, 1 << 18, 1 << 20):
        k = K.Kernel("t", (K.Buffer("x", f32, n), K.Buffer("y", f32, n)), 1, (n,), (),
                     (K.Store(1, K.idx(0), K.load(0, K.idx(0), f32) * 2.0 + 1.0),))
        ck = be.compile_kernel(k)
        xs, ys = np.ones(n, np.float32), np.empty(n, np.float32)
        ptrs = (ctypes.c_void_p * 2)(xs.ctypes.data, ys.ctypes.data)
        pool = C.get_pool(be.info_of(None).compute_units)
        bounds = C._chunks(n, pool.n, max(C.estimate_ns(k), 2 * C.PARALLEL_MIN_NS))  # as if parallel
        one = median_ms(lambda _: ck._fn(ptrs, 0, n), None, 200)[0] * 1e3
        launch = pool.launcher(ck._fn, bounds)
        par = median_ms(lambda _: launch(ptrs), None, 200)[0] * 1e3
        print(f"| {n} | {one:.1f} | {par:.1f} |")


if __name__ == "__main__":
    main()
