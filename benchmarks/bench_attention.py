"""Attention, B=4 H=4 D=64, S=256 and 1024, causal and not, forward and forward+backward:
tilefuse on `cpu` (nn.dot_product_attention, and the same attention written out with tnp and
found by the pattern pass), on the first OpenCL device (nn.dot_product_attention through the shared
FlashAttention tile builders, and the composite of ordinary kernels they replace), numpy's naive
code, and PyTorch's scaled_dot_product_attention and JAX's jit where importable, in one run,
in alternation (each round times every contender once, after a rest and a few unmeasured calls):
medians, GFLOP/s and ratios against tilefuse: of the medians, and "paired" (the median over rounds
of each round's time / tilefuse's in that round: steadier on a noisy machine, common.paired_ratios).

    python benchmarks/bench_attention.py [--seqs 256,1024] [--bhd 4,4,64] [--repeat 7] [--only fwd]
        [--opencl opencl:0]

(--bhd 32,4,32 --seqs 64: the char-GPT step's attention, benchmarks/bench_train.py.) FLOPs count
the two matmuls of the forward (4·B·H·S²·D, halved when causal) and 2.5 times that for
forward+backward. "extra MiB" is tilefuse's pool peak above the inputs during one call (the S x S
scores are never stored: linear in S), and numpy's / PyTorch's growth in RSS is not measured here
(see benchmarks/bench_train.py for whole-process peaks)."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fmt_seconds, paired_ratios, side_by_side, time_alternating  # noqa: E402

BASELINE = "tilefuse nn.dot_product_attention"  # the ratios' denominator
SETTLE = 0.4  # seconds between contenders: OpenMP's (torch) and Eigen's (jax) threads spin after a call
WARM_S = 0.05  # seconds of calls before each sample: the first calls after a rest run slowly

B, H, D = 4, 4, 64


# ---- numpy: the naive code (B, H, S, D) ----------------------------------------------------------

def _np_probs(q, k, causal):
    s = q @ np.swapaxes(k, -1, -2) * (1 / math.sqrt(q.shape[-1]))
    if causal:
        n = s.shape[-1]
        s = np.where(np.tri(n, dtype=bool), s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_forward(q, k, v, causal):
    return _np_probs(q, k, causal) @ v


def np_forward_backward(q, k, v, g, causal):
    p = _np_probs(q, k, causal)
    out = p @ v
    dv = np.swapaxes(p, -1, -2) @ g
    dp = g @ np.swapaxes(v, -1, -2)
    ds = p * (dp - np.sum(dp * p, -1, keepdims=True)) * (1 / math.sqrt(q.shape[-1]))
    return out, ds @ k, np.swapaxes(ds, -1, -2) @ q, dv


# ---- tilefuse ------------------------------------------------------------------------------------

def tilefuse_cases(q, k, v, g, causal, device="cpu"):
    """name -> (forward call, forward+backward call, extra MiB of the forward+backward)."""
    import tilefuse as tx
    import tilefuse.numpy as tnp
    from tilefuse import nn

    dev = tx.get_device(device)
    to_bshd = lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2))  # noqa: E731
    qs, ks, vs, gs = (tx.device_put(to_bshd(x), device) for x in (q, k, v, g))
    qh, kh, vh, gh = (tx.device_put(x, device) for x in (q, k, v, g))

    def api(q, k, v):
        return nn.dot_product_attention(q, k, v, causal=causal)

    def written(q, k, v):  # (B, H, S, D) written out: the pattern pass makes it fused_attention
        s = q @ tnp.swapaxes(k, -1, -2) * (1 / math.sqrt(D))
        if causal:
            s = tnp.where(tnp.tril(tnp.ones(s.shape[-2:], tnp.bool_)), s, -np.inf)
        return nn.softmax(s) @ v

    cases = ((BASELINE, api, (qs, ks, vs), gs, False),
             ("tilefuse written out (pattern)", written, (qh, kh, vh), gh, False))
    if device != "cpu":  # the tile builders, and the composite of ordinary kernels without them
        cases = ((f"tilefuse {device} nn.dot_product_attention", api, (qs, ks, vs), gs, False),
                 (f"tilefuse {device} composite (no template)", api, (qs, ks, vs), gs, True))
    out = {}
    for name, f, args, cot, composite in cases:
        fwd = tx.jit(f, device=device)
        both = tx.jit(lambda q, k, v, g, f=f: tx.vjp(f, q, k, v)[1](g), device=device)
        run_fwd = lambda fwd=fwd, args=args: fwd(*args).block_until_ready()  # noqa: E731
        run_both = lambda both=both, args=args, cot=cot: [  # noqa: E731
            x.block_until_ready() for x in both(*args, cot)]
        with _without_templates(dev.kind) if composite else contextlib.nullcontext():
            run_fwd()  # compiled now: without the builders for the composite
            run_both()
        pool = dev.backend.pool if device == "cpu" else dev.backend._state(dev).pool
        pool.reset_peak()
        before = pool.stats()["bytes_in_use"]
        run_both()
        extra = (pool.stats()["peak_bytes_in_use"] - before) / 2 ** 20
        out[name] = (run_fwd, run_both, extra)
    return out


@contextlib.contextmanager
def _without_templates(device_kind):
    """The attention builders of a device kind unregistered: the dispatcher picks the composite."""
    from tilefuse.runtime import dispatch
    impls = [i for kind in dispatch.ATTENTION_KINDS for i in dispatch.candidates(kind, device_kind)
             if i.name != "composite"]
    for i in impls:
        dispatch.unregister(i)
    try:
        yield
    finally:
        for i in impls:
            dispatch.register(i)


# ---- PyTorch and JAX, when importable ---------------------------------------------------------------

def torch_cases(q, k, v, g, causal):
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return {}
    tq, tk, tv, tg = (torch.from_numpy(x) for x in (q, k, v, g))

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    def both():
        a, b, c = (x.detach().requires_grad_() for x in (tq, tk, tv))
        F.scaled_dot_product_attention(a, b, c, is_causal=causal).backward(tg)
    return {f"torch {torch.__version__} SDPA": (fwd, both, None)}


def jax_cases(q, k, v, g, causal):
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return {}

    def attn(q, k, v):
        return jax.nn.dot_product_attention(jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2),
                                            jnp.swapaxes(v, 1, 2), is_causal=causal)
    fwd = jax.jit(attn)
    both = jax.jit(lambda q, k, v, g: jax.vjp(attn, q, k, v)[1](jnp.swapaxes(g, 1, 2)))
    args = [jnp.asarray(x) for x in (q, k, v)]
    cot = jnp.asarray(g)
    return {f"jax {jax.__version__} jit": (lambda: fwd(*args).block_until_ready(),
                                            lambda: jax.block_until_ready(both(*args, cot)), None)}


def _has_device(name: str) -> bool:
    import tilefuse as tx
    from tilefuse.ir.errors import TilefuseError
    try:
        tx.get_device(name)
    except TilefuseError:  # no such device here (no OpenCL platform, or fewer devices)
        return False
    return True


def main(argv=None):
    global B, H, D
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="256,1024")
    ap.add_argument("--bhd", default=f"{B},{H},{D}", help="batch, heads, head size")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--only", choices=("fwd", "both"), default=None)
    ap.add_argument("--opencl", default="opencl:0", help="the OpenCL device of the opencl rows "
                    "('' for none; skipped where there is none)")
    args = ap.parse_args(argv)
    B, H, D = (int(x) for x in args.bhd.split(","))
    rng = np.random.default_rng(0)
    for s in (int(x) for x in args.seqs.split(",")):
        for causal in (False, True):
            q, k, v, g = (rng.standard_normal((B, H, s, D)).astype(np.float32) for _ in range(4))
            flops = 4 * B * H * s * s * D * (0.5 if causal else 1.0)
            cases = tilefuse_cases(q, k, v, g, causal)
            if args.opencl and _has_device(args.opencl):
                cases.update(tilefuse_cases(q, k, v, g, causal, args.opencl))
            cases["numpy naive"] = (lambda: np_forward(q, k, v, causal),
                                    lambda: np_forward_backward(q, k, v, g, causal), None)
            cases.update(torch_cases(q, k, v, g, causal))
            cases.update(jax_cases(q, k, v, g, causal))
            results = {name: {} for name in cases}
            for phase, which, flop_scale in (("fwd", 0, 1.0), ("both", 1, 2.5)):
                if args.only not in (None, phase):
                    continue
                times = time_alternating({name: c[which] for name, c in cases.items()}, warmup=2 - which,
                                         repeat=args.repeat, block=1, settle=SETTLE, warm_s=WARM_S,
                                         max_seconds=60 + 60 * which)
                label = "fwd" if phase == "fwd" else "fwd+bwd"
                speedup = paired_ratios(times, BASELINE)
                for name, t in times.items():
                    gflops = flop_scale * flops / t.median / 1e9
                    results[name].update({label: t.median, f"{label} GFLOP/s": gflops})
                    if name != BASELINE:  # (a string: side_by_side adds no ratio of its own)
                        results[name][f"{label} paired"] = f"{1 / speedup[name]:.3f}x"
            for name, (_, _, extra) in cases.items():
                if extra is not None:
                    results[name]["extra MiB"] = extra
            metrics = [m for m in ("fwd", "fwd paired", "fwd GFLOP/s", "fwd+bwd", "fwd+bwd paired",
                                   "fwd+bwd GFLOP/s", "extra MiB") if any(m in r for r in results.values())]
            print(side_by_side(results, metrics, baseline=BASELINE,
                               formats={"fwd": fmt_seconds, "fwd+bwd": fmt_seconds},
                               title=f"attention B={B} H={H} D={D} S={s}{' causal' if causal else ''}"))
            print()


if __name__ == "__main__":
    main()
