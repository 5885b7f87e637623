"""Default against tuned: the GEMM shapes of the char-GPT training step (examples/
train_transformer.py: batch 32, seq 64, d_model 128, 2 layers) on the CPU GEMM template, next to
numpy's BLAS on the same buffers; FlashAttention's forward and backward at the step's attention
shape and a longer sequence; and the training step itself before and after `tx.tune`.

    python benchmarks/bench_tuning.py                    # 30 trials per GEMM, 8 per step kernel
    python benchmarks/bench_tuning.py --trials 10 --no-step
    python benchmarks/bench_tuning.py --no-gemm --no-step --attention-trials 20

Each GEMM problem (one per shape class: the tuning database's granularity) is timed with the
template's default parameters (from DeviceInfo) and with those optuna's TPE found in --trials
trials, next to numpy's matmul on contiguous operands of the same sizes (for a fused_gemm, "+epi",
followed by the same epilogue in numpy; the faster of its default threads and one thread). The
three are timed alike (the median of 15 calls), shape after shape in eleven rounds, numpy in
subprocesses; the table holds the median of the rounds. The target: tuned at least 15% faster
than the default wherever the default is not already within 5% of numpy.
Attention (batch 32, 4 heads, head dim 32, causal; seq 64 as in the step, and 512): each of the
template's kernels (forward, backward) is tuned for --attention-trials trials, the two times again
medians measured in alternation. The step is then tuned whole and timed compiled without and with
the tuning database, in alternation.
The tuning goes to temporary databases, not the user's. The machines are shared and noisy: read ratios."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "examples")]
from common import table, time_median  # noqa: E402


def gemm_kernels(step, args):
    """One kernel per GEMM shape class that the template runs in the step, slowest first."""
    import tilefuse as tx
    from tilefuse.runtime import tuner
    step(*args)
    with tx.profile() as prof:
        step(*args)
    seen, out = set(), []
    for r in sorted(prof.records, key=lambda r: -r.seconds):
        k = r.info.kernel
        t = tuner.template_for(r.info.impl, k, r.info.device) if k is not None else None
        if t is None or t.name != "tile_gemm":
            continue
        key = t.key(k)
        if key not in seen:
            seen.add(key)
            out.append((k, _problem(k), r.info.device))
    return out


def _problem(kernel):
    """The sizes, epilogue and extras' strides of a GEMM kernel (what the numpy timer needs)."""
    from types import SimpleNamespace

    from tilefuse.ir.kernel.gemm import gemm_spec
    s = gemm_spec(kernel)
    lay = s.layout
    return SimpleNamespace(batch=lay.batch, m=lay.m, n=lay.n, k=lay.k, epilogue=s.epilogue,
                           extra_strides=tuple((lay.m * lay.n, lay.n) if full else (0, 0) for _, full in s.extras))


def numpy_worker() -> None:
    """In a subprocess, one case per line of stdin (a _numpy_case as JSON): numpy's matmul on
    contiguous float32 operands of its sizes, then the epilogue in numpy (a ScalarFn's rows;
    extras: rows along n, or of C's shape); prints the median seconds of 15 calls."""
    import numpy as np
    from tilefuse.ir.primitives import ScalarFn
    rng = np.random.default_rng(0)
    calls = {}
    for line in sys.stdin:
        if line not in calls:
            batch, m, n, k, epilogue, rows = json.loads(line)
            a = rng.standard_normal((batch, m, k)).astype(np.float32)[0 if batch == 1 else slice(None)]
            b = rng.standard_normal((batch, k, n)).astype(np.float32)[0 if batch == 1 else slice(None)]
            c = np.matmul(a, b)
            extras = [rng.standard_normal(n if row else c.shape).astype(np.float32) for row in rows]
            fn = ScalarFn.from_rows(_tuples(epilogue)) if epilogue else (lambda y: y)
            calls[line] = lambda a=a, b=b, c=c, extras=extras, fn=fn: fn(np.matmul(a, b, out=c), *extras)
        print(time_median(calls[line], warmup=2, repeat=15).median, flush=True)


def _tuples(x):
    """JSON's lists back to the tuples a ScalarFn's rows are made of."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _numpy_case(p) -> tuple:
    rows = p.epilogue.to_rows() if p.epilogue is not None else None
    if rows is not None:  # dtype parameters (casts) by name, for JSON
        rows = (rows[0], tuple((n, ins, tuple((k, getattr(v, "name", v)) for k, v in ps)) for n, ins, ps in rows[1]),
                rows[2])
    return (p.batch, p.m, p.n, p.k, rows, [s == (0, 0) for s in p.extra_strides])


class NumpyTimer:
    """numpy's BLAS (BLAS takes transposed operands at the same speed) and, for a fused_gemm, its
    epilogue computed after it by numpy, in two worker processes: OpenBLAS's default threads and
    one thread (on a busy machine its spinning threads can be much slower than one); a case's time
    is the faster of the two. Not in this process: OpenBLAS's threads spin ~0.1 s after each call
    and would slow the template's measurements, so the caller waits SPIN_S before timing its own."""
    SPIN_S = 0.15

    def __init__(self):
        import subprocess
        self.workers = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--numpy-worker"],
                                         env={**os.environ, **env}, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
                        for env in ({}, {"OPENBLAS_NUM_THREADS": "1"})]

    def seconds(self, prob) -> float:
        import time
        best = float("inf")
        for w in self.workers:
            w.stdin.write(json.dumps(_numpy_case(prob)) + "\n")
            w.stdin.flush()
            answer = w.stdout.readline()
            if not answer:
                raise RuntimeError(f"the numpy worker exited ({w.wait()})")
            best = min(best, float(answer))
        time.sleep(self.SPIN_S)
        return best

    def close(self):
        for w in self.workers:
            w.stdin.close()
            w.wait()


def template_call(kernel, dev, params: dict):
    """The template with `params` on buffers of the kernel's sizes: a call to time."""
    from tilefuse.runtime import tuner
    run = tuner.template_for("tile_gemm", kernel, dev).build(kernel, dev, dev.backend, params)
    bufs = tuner.random_buffers(kernel, dev)
    return lambda: run(bufs)


ROUNDS = 11  # numpy, default and tuned timed in alternation, the median of the rounds' medians


def bench_gemms(trials: int) -> list:
    import statistics

    import tilefuse as tx
    import train_transformer as tt
    from tilefuse.runtime import tuner
    tx.config.gemm = "generated"  # every GEMM on the template, to tune it
    try:
        step, args = tt.tuning_workload()
        found = gemm_kernels(step, args)
        results = [(kernel, prob, dev, tune_with_bar(kernel, dev, trials)) for kernel, prob, dev in found]
        times = [{"numpy": [], "default": [], "tuned": []} for _ in results]
        calls = []  # per problem: the default's call and the tuned one's (the same when equal)
        for kernel, _, dev, res in results:
            default = tuner.template_for("tile_gemm", kernel, dev).default(kernel, dev)
            calls.append({"default": template_call(kernel, dev, default)})
            calls[-1]["tuned"] = calls[-1]["default"] if res.best == default else \
                template_call(kernel, dev, res.best)
        numpy = NumpyTimer()
        try:  # shape by shape, so that the machine's slow and fast spells fall on all three alike
            for _ in range(ROUNDS):
                for t, call, (_, prob, _, _) in zip(times, calls, results):
                    t["numpy"].append(numpy.seconds(prob))  # timed as numpy_worker times numpy
                    t["default"].append(time_median(call["default"], warmup=2, repeat=15).median)
                    t["tuned"].append(t["default"][-1] if call["tuned"] is call["default"]
                                      else time_median(call["tuned"], warmup=2, repeat=15).median)
        finally:
            numpy.close()
        rows = []
        for rounds, (_, prob, _, res) in zip(times, results):
            numpy_s, d, t = (statistics.median(rounds[c]) for c in ("numpy", "default", "tuned"))
            near = d <= 1.05 * numpy_s
            shape = f"{prob.batch}x{prob.m}x{prob.n}x{prob.k}" + (" +epi" if prob.epilogue else "")
            rows.append((shape, f"{numpy_s * 1e3:.3f}", f"{d * 1e3:.3f}",
                         f"{t * 1e3:.3f}", f"{d / t:.2f}x", f"{numpy_s / d:.2f}x", f"{numpy_s / t:.2f}x",
                         "n/a: default within 5% of numpy" if near else ("met" if d / t >= 1.15 else "missed"),
                         " ".join(f"{k}={v}" for k, v in res.best.items())))
        return rows
    finally:
        tx.config.gemm = "auto"


ATTENTION_SHAPES = ((32, 64, 4, 32), (32, 512, 4, 32))  # (batch, seq, heads, head dim), causal


def attention_kernels(batch: int, seq: int, heads: int, dim: int) -> list:
    """The FlashAttention kernels (forward, backward) of a causal attention's value and gradient."""
    import numpy as np
    import tilefuse as tx
    from tilefuse import nn
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((batch, seq, heads, dim)).astype(np.float32) for _ in range(4))

    def loss(q, k, v):
        return (nn.dot_product_attention(q, k, v, causal=True) * g).sum()
    step = tx.jit(tx.grad(loss, argnums=(0, 1, 2)), device="cpu")
    step(q, k, v)
    with tx.profile() as prof:
        step(q, k, v)
    return [(r.info.kernel, r.info.device) for r in prof.records if r.info.impl == "tile_attention"]


def tune_with_bar(kernel, dev, trials: int):
    """tuner.tune_kernel with a progress bar, closed however the tuning ends."""
    from tilefuse.runtime import tuner
    bar = tuner.progress_bar(trials, True)
    try:
        return tuner.tune_kernel(kernel, dev, trials=trials, bar=bar)
    finally:
        if bar is not None:
            bar.close()


def bench_attention(trials: int) -> list:
    rows = []
    for shape in ATTENTION_SHAPES:
        for kernel, dev in attention_kernels(*shape):
            res = tune_with_bar(kernel, dev, trials)
            d, t = res.default_seconds, res.best_seconds
            rows.append(("x".join(map(str, shape)), res.signature.removeprefix("tile-attention-"),
                         f"{d * 1e3:.3f}", f"{t * 1e3:.3f}", f"{d / t:.2f}x",
                         " ".join(f"{k}={v}" for k, v in res.best.items())))
    return rows


def bench_step(trials: int, min_share: float, db: str) -> list:
    """The step tuned whole; tx.tune then times it compiled without and with the tuning database,
    in alternation."""
    import tilefuse as tx
    import train_transformer as tt
    step, args = tt.tuning_workload()
    tx.config.tuning_db = db
    report = tx.tune(step, *args, trials=trials, min_share=min_share)
    print(report.table())
    before, after = report.default_seconds, report.tuned_seconds
    return [("train step", f"{before * 1e3:.1f}", f"{after * 1e3:.1f}", f"{before / after:.2f}x",
             f"{len(report.results)} kernels tuned, {len(report.skipped)} skipped")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=30, help="trials per GEMM shape")
    p.add_argument("--step-trials", type=int, default=8, help="trials per kernel of the step")
    p.add_argument("--min-share", type=float, default=0.005, help="skip step kernels under this share")
    p.add_argument("--no-step", action="store_true")
    p.add_argument("--attention-trials", type=int, default=20, help="trials per attention kernel")
    p.add_argument("--no-gemm", action="store_true")
    p.add_argument("--no-attention", action="store_true")
    p.add_argument("--numpy-worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.numpy_worker:
        return numpy_worker()
    import tilefuse as tx
    with tempfile.TemporaryDirectory() as d:
        if not a.no_gemm:
            tx.config.tuning_db = os.path.join(d, "gemm.sqlite")
            rows = bench_gemms(a.trials)
            print(table(["GEMM (batch x m x n x k)", "numpy ms", "default ms", "tuned ms", "tuned vs default",
                         "default vs numpy", "tuned vs numpy", "15% target", "tuned parameters"], rows,
                        title=f"CPU GEMM template on the train step's shapes, {a.trials} trials each"))
        if not a.no_attention:
            tx.config.tuning_db = os.path.join(d, "attention.sqlite")
            rows = bench_attention(a.attention_trials)
            print(table(["attention (batch x seq x heads x dim)", "kernel", "default ms", "tuned ms",
                         "tuned vs default", "tuned parameters"], rows,
                        title=f"CPU FlashAttention template, {a.attention_trials} trials per kernel"))
        if not a.no_step:
            rows = bench_step(a.step_trials, a.min_share, os.path.join(d, "step.sqlite"))
            print(table(["workload", "default ms", "tuned ms", "speedup", "tuning"], rows,
                        title=f"training step on {tx.default_device()}, {a.step_trials} trials per kernel"))


if __name__ == "__main__":
    main()
