"""The training step of examples/torch_gpt.py (a nanoGPT-style model in plain PyTorch: d 128,
2 layers, 4 heads, context 64, batch 32, vocabulary 96, AdamW) run eagerly, with torch.compile's
default backend (Inductor) and with tilefuse.torch's backend on each tilefuse device, each in its
own subprocess, from the same weights on the same batches.

    python benchmarks/bench_torch.py                      # eager, inductor, tilefuse:cpu, :opencl:0
    python benchmarks/bench_torch.py --steps 20 --only eager,tilefuse:cpu

One table (ratios against eager): the median step (forward, backward, clipping, AdamW; after 3
steps), the first step (dynamo + AOTAutograd + compiling; for tilefuse with a cold persistent
compile cache), peak RSS and the loss at the end, then each compiled run's largest |loss - eager
loss| over the steps. --threads runs everything once per PyTorch thread count (torch.set_num_threads;
0: PyTorch's default, one per core): the optimizer and the glue between graphs run on PyTorch's
threads, which compete with a CPU device's. Benchmark on a quiet machine (PyTorch's OpenMP threads
spin, and slow down several-fold when another process is busy on the cores)."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "examples")]

from common import emit, fmt_seconds, run_worker, side_by_side  # noqa: E402


def worker(args) -> None:
    import torch
    import torch_gpt
    if args.threads:
        torch.set_num_threads(args.threads)
    batches, vocab = torch_gpt.make_batches(args.steps, 32, 64, seed=args.seed)
    torch.manual_seed(1337)
    template = torch_gpt.GPT(torch_gpt.GPTConfig(vocab_size=vocab))
    backend = {"eager": None, "inductor": "inductor"}.get(args.worker)
    if args.worker.startswith("tilefuse:"):
        backend = args.worker.split(":", 1)[1]
    result = torch_gpt.run(args.worker, template, batches, backend)
    emit({"losses": result["losses"], "first_s": result["first"], "step_s": result["step"]})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", default="", help="comma list of: eager, inductor, tilefuse:<device>")
    ap.add_argument("--threads", default="0,1",
                    help="comma list of torch.set_num_threads values (0: PyTorch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.threads = int(args.threads)
        worker(args)
        return 0
    import tilefuse as tx
    runners = ["eager", "inductor"] + [f"tilefuse:{d.name}" for d in tx.devices()
                                       if d.kind in ("cpu", "opencl")]
    if args.only:
        runners = [r for r in runners if r in args.only.split(",")]
    results, losses = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_torch_") as tmp:
        for threads in [int(t) for t in args.threads.split(",")]:
            for r in runners:
                name = f"{r} ({threads or 'default'} torch threads)"
                print(f"running {name} ...", flush=True)
                env = {"TILEFUSE_CACHE_DIR": os.path.join(tmp, f"cache_{threads}_{r.replace(':', '_')}")}
                t0 = time.perf_counter()
                res = run_worker([__file__, "--worker", r, "--steps", str(args.steps), "--threads",
                                  str(threads), "--seed", str(args.seed)], env=env)
                if "error" in res:
                    print(f"  {name} failed: {res['error']}")
                    continue
                losses[name] = res["losses"]
                results[name] = {"step": res["step_s"], "first step": res["first_s"],
                                 "peak RSS MiB": round(res["peak_rss_mib"]),
                                 "loss": f"{res['losses'][-1]:.4f}"}
                print(f"  step {fmt_seconds(res['step_s'])}, first {fmt_seconds(res['first_s'])} "
                      f"({time.perf_counter() - t0:.0f} s in all)", flush=True)
    secs = {"step": fmt_seconds, "first step": fmt_seconds}
    print()
    base = next((r for r in results if r.startswith("eager")), None)
    print(side_by_side(results, ["step", "first step", "peak RSS MiB", "loss"], baseline=base,
                       formats=secs, title=f"nanoGPT-style train step (examples/torch_gpt.py), "
                                           f"{args.steps} steps, median after 3"))
    eager = {r.split(" ", 1)[1]: ls for r, ls in losses.items() if r.startswith("eager")}
    print("\nloss against eager with the same threads (same weights and batches; target 1e-3):")
    for r, ls in losses.items():
        ref = eager.get(r.split(" ", 1)[1])
        if not r.startswith("eager") and ref is not None:
            d = max(abs(a - b) for a, b in zip(ls, ref))
            print(f"  {r}: max |diff| {d:.2e} over {len(ls)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
