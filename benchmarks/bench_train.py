"""The char-GPT training step of examples/train_transformer.py (d_model 128, 2 layers, 4 heads,
seq 64, batch 32, vocab 96, AdamW with warmup + cosine and global-norm clipping; ~430k
parameters) in tilefuse on every available device, PyTorch eager and JAX jit where installed,
from the same initial parameters and the same batches, each framework in its own subprocess.

    python benchmarks/bench_train.py                       # everything available, 50 steps
    python benchmarks/bench_train.py --steps 20 --only tilefuse:cpu,torch

One table (ratios against tilefuse on `cpu`): step time (median after warm-up), first call
(tracing + compiling + running; for tilefuse cold and with the persistent compile cache
TILEFUSE_CACHE_DIR warm), a new batch size after the run (half the batch, as an epoch's last
batch: its first call, and the time until a call of it runs at compiled speed, within
twice the step time, which includes its interpreted calls and any wait for a compile), then a
third size (3/4 of the batch: what a notebook meets), peak RSS of the subprocess, and the loss
after N steps. Then the
loss-curve agreement: the largest |loss difference| per step between tilefuse and PyTorch
(and JAX) over the steps both ran; the target is 1e-3 in float32. The `ref` device is tilefuse's
numpy interpreter of the same graph: the numpy reference. A worker that passes --max-seconds
stops early; its loss column then says at which step.

The PyTorch and JAX ports mirror the tilefuse model line by line: same parameter names and
values (copied from tilefuse's init_params), pre-LayerNorm blocks, tanh GELU, causal attention
scaled by 1/sqrt(head_dim), untied head, AdamW (b1 0.9, b2 0.95, eps 1e-8, weight decay 0.1 on
matrices only), the same schedule and clipping rule, dropout off."""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "examples")]

from common import USER_TIERED, emit, fmt_seconds, run_worker, side_by_side  # noqa: E402

BATCH, SEQ, D_MODEL, LAYERS, HEADS, VOCAB = 32, 64, 128, 2, 4, 96
LR, B1, B2, EPS, WEIGHT_DECAY, CLIP = 3e-3, 0.9, 0.95, 1e-8, 0.1, 1.0
TOLERANCE = 1e-3
NEW_BATCH_MOST_S = 20.0  # calls of the new batch size until one runs at compiled speed, at most


def schedule(count: int, steps: int) -> float:
    """train_transformer.make_optimizer's learning rate for the update after `count` updates:
    linear warmup from 0, then cosine to LR / 10 (float32 as tilefuse computes it)."""
    f = np.float32
    warmup = max(1, min(steps // 10, 100))
    c = f(count)
    if c < warmup:
        return float(f(LR) * (c / f(warmup)))
    t = np.clip((c - f(warmup)) / f(max(max(steps, warmup + 1) - warmup, 1)), f(0), f(1))
    return float(f(LR * 0.1) + f(LR - LR * 0.1) * f(0.5) * (f(1) + np.cos(f(math.pi) * t)))


# ---- shared inputs: one file of initial parameters and batches --------------------------------

def flatten(tree, prefix=""):
    """{'blocks.0.qkv.w': array, ...} from nested dicts and lists."""
    if isinstance(tree, dict):
        return {k2: v2 for k, v in tree.items() for k2, v2 in flatten(v, f"{prefix}{k}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k2: v2 for i, v in enumerate(tree) for k2, v2 in flatten(v, f"{prefix}{i}.").items()}
    return {prefix[:-1]: np.asarray(tree)}


def unflatten(flat: dict):
    """The inverse of flatten: dicts, with all-digit keys turned into lists."""
    root: dict = {}
    for path, v in flat.items():
        node = root
        parts = path.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v

    def fix(n):
        if not isinstance(n, dict):
            return n
        if n and all(k.isdigit() for k in n):
            return [fix(n[str(i)]) for i in range(len(n))]
        return {k: fix(v) for k, v in n.items()}
    return fix(root)


def prepare(path: str, steps: int, seed: int) -> None:
    """Write the initial parameters (tilefuse's init_params, on the numpy device) and `steps`
    training batches from the docstring corpus to path (.npz, no pickle)."""
    import data
    import tilefuse as tx
    import tilefuse.random as random
    import train_transformer as tt
    corpus = data.Corpus()
    cfg = tt.Config(vocab=corpus.vocab.size)
    assert cfg.vocab == VOCAB, cfg
    saved, tx.config.default_device = tx.config.default_device, "ref"  # numpy: no compiling
    try:
        init_key, _ = random.split(random.key(seed))
        params = tx.tree_map(np.asarray, tt.init_params(init_key, cfg))
    finally:
        tx.config.default_device = saved
    sampler = data.WindowSampler(corpus.train, BATCH, SEQ, seed)
    xs, ys = zip(*(sampler.next() for _ in range(steps)))
    arrays = {f"p/{k}": v for k, v in flatten(params).items()}
    np.savez(path, xs=np.stack(xs), ys=np.stack(ys), **arrays)


def load(path: str):
    with np.load(path, allow_pickle=False) as z:
        params = unflatten({k[2:]: z[k] for k in z.files if k.startswith("p/")})
        return params, z["xs"], z["ys"]


# ---- the frameworks: each returns step(i, x, y) -> loss (a float: it waits for the result) ---

def tilefuse_step(params, steps: int, device: str):
    import tilefuse as tx
    import train_transformer as tt
    tx.config.default_device = device
    cfg = tt.Config(vocab=VOCAB, d_model=D_MODEL, layers=LAYERS, heads=HEADS, seq=SEQ)
    optimizer = tt.make_optimizer(LR, steps, weight_decay=WEIGHT_DECAY, clip=CLIP)
    state = {"params": tx.device_put(params), "key": tx.device_put(np.zeros(2, np.uint32))}
    state["opt"] = tx.device_put(optimizer.init(state["params"]))
    train_step = tt.make_train_step(cfg, optimizer)

    def step(i, x, y):
        state["params"], state["opt"], state["key"], loss = train_step(
            state["params"], state["opt"], state["key"], x, y)
        return float(loss)
    return step


def torch_step(params, steps: int, device: str):
    import torch
    import torch.nn.functional as F
    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in flatten(params).items()}
    p = unflatten(leaves)
    decay = [t for t in leaves.values() if t.ndim >= 2]
    no_decay = [t for t in leaves.values() if t.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(B1, B2), eps=EPS)
    dh = D_MODEL // HEADS

    def ln(q, h):
        return F.layer_norm(h, (D_MODEL,), q["scale"], q["bias"], 1e-5)

    def forward(x):
        b, t = x.shape
        h = p["tok"][x] + p["pos"][:t]
        for blk in p["blocks"]:
            qkv = (ln(blk["ln1"], h) @ blk["qkv"]["w"] + blk["qkv"]["b"]).view(b, t, 3, HEADS, dh)
            q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))  # (b, heads, t, dh)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + a.transpose(1, 2).reshape(b, t, D_MODEL) @ blk["proj"]["w"] + blk["proj"]["b"]
            m = F.gelu(ln(blk["ln2"], h) @ blk["fc"]["w"] + blk["fc"]["b"], approximate="tanh")
            h = h + m @ blk["fc_out"]["w"] + blk["fc_out"]["b"]
        return ln(p["ln_f"], h) @ p["head"]["w"] + p["head"]["b"]

    def step(i, x, y):
        for g in opt.param_groups:
            g["lr"] = schedule(i, steps)
        opt.zero_grad(set_to_none=True)
        x, y = torch.from_numpy(x).long(), torch.from_numpy(y).long()
        loss = F.cross_entropy(forward(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        with torch.no_grad():  # tilefuse's rule: scale by CLIP / norm when norm >= CLIP
            norm = torch.sqrt(sum((t.grad * t.grad).sum() for t in leaves.values()))
            factor = torch.where(norm < CLIP, 1.0, CLIP / norm)
            for t in leaves.values():
                t.grad.mul_(factor)
        opt.step()
        return loss.item()
    return step


def jax_step(params, steps: int, device: str):
    import jax
    import jax.numpy as jnp
    jax.config.update("jax_platforms", "cpu")
    dh = D_MODEL // HEADS
    warmup = max(1, min(steps // 10, 100))

    def ln(q, h):
        mu = h.mean(-1, keepdims=True)
        c = h - mu
        return c * jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-5) * q["scale"] + q["bias"]

    def gelu(x):
        return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))

    def loss_fn(p, x, y):
        b, t = x.shape
        h = p["tok"][x] + p["pos"][:t]
        causal = jnp.tril(jnp.ones((t, t), bool))
        for blk in p["blocks"]:
            qkv = (ln(blk["ln1"], h) @ blk["qkv"]["w"] + blk["qkv"]["b"]).reshape(b, t, 3, HEADS, dh)
            s = jnp.einsum("bqhd,bkhd->bhqk", qkv[:, :, 0], qkv[:, :, 1]) / math.sqrt(dh)
            w = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
            a = jnp.einsum("bhqk,bkhd->bqhd", w, qkv[:, :, 2]).reshape(b, t, D_MODEL)
            h = h + a @ blk["proj"]["w"] + blk["proj"]["b"]
            h = h + gelu(ln(blk["ln2"], h) @ blk["fc"]["w"] + blk["fc"]["b"]) @ blk["fc_out"]["w"] \
                + blk["fc_out"]["b"]
        logits = ln(p["ln_f"], h) @ p["head"]["w"] + p["head"]["b"]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, y[..., None], axis=-1).mean()

    def lr_at(c):
        c = c.astype(jnp.float32)
        t = jnp.clip((c - warmup) / max(max(steps, warmup + 1) - warmup, 1), 0.0, 1.0)
        cos = LR * 0.1 + (LR - LR * 0.1) * 0.5 * (1.0 + jnp.cos(jnp.pi * t))
        return jnp.where(c < warmup, LR * (c / warmup), cos)

    @jax.jit
    def train_step(p, mu, nu, count, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        norm = jnp.sqrt(sum(jnp.sum(v * v) for v in jax.tree_util.tree_leaves(g)))
        factor = jnp.where(norm < CLIP, 1.0, CLIP / norm)
        g = jax.tree_util.tree_map(lambda v: v * factor, g)
        mu = jax.tree_util.tree_map(lambda m, v: B1 * m + (1 - B1) * v, mu, g)
        nu = jax.tree_util.tree_map(lambda n, v: B2 * n + (1 - B2) * v * v, nu, g)
        t = (count + 1).astype(jnp.float32)
        c1, c2, lr = 1 - B1 ** t, 1 - B2 ** t, lr_at(count)

        def update(w, m, n):
            u = (m / c1) / (jnp.sqrt(n / c2) + EPS)
            return w - lr * (u + WEIGHT_DECAY * w if w.ndim >= 2 else u)
        return jax.tree_util.tree_map(update, p, mu, nu), mu, nu, count + 1, loss

    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    state = [jax.tree_util.tree_map(jnp.asarray, params), zeros, zeros, jnp.zeros((), jnp.int32)]

    def step(i, x, y):
        out = train_step(*state, x, y)
        state[:] = out[:4]
        return float(out[4])
    return step


FRAMEWORKS = {"tilefuse": tilefuse_step, "torch": torch_step, "jax": jax_step}


def worker(args) -> None:
    """Run one framework: the first call timed alone, then the other steps; emit the results."""
    name, _, device = args.worker.partition(":")
    params, xs, ys = load(args.inputs)
    step = FRAMEWORKS[name](params, args.steps, device)
    t0 = time.perf_counter()
    losses = [step(0, xs[0], ys[0])]
    first = time.perf_counter() - t0
    times, start = [], time.perf_counter()
    for i in range(1, args.steps if not args.first_only else 1):
        t0 = time.perf_counter()
        losses.append(step(i, xs[i], ys[i]))
        times.append(time.perf_counter() - t0)
        if args.max_seconds and time.perf_counter() - start > args.max_seconds:
            break
    measured = times[args.warmup:] or times
    out = {"first_call_s": first, "step_s": float(np.median(measured)) if measured else None,
           "losses": losses}
    if not args.first_only:  # a new batch size (an epoch's last, smaller batch), then a third
        i = len(losses) % len(xs)
        for prefix, b in (("new_batch", BATCH // 2), ("third_batch", BATCH * 3 // 4)):
            out[f"{prefix}_first_s"], out[f"{prefix}_compiled_s"] = _new_size(step, i, xs, ys, b, out["step_s"])
    emit(out)


def _new_size(step, i, xs, ys, b, step_s) -> tuple[float, float]:
    """A batch of b rows: its first call, and the time until a call runs at compiled speed
    (within twice the step's time, scaled to b rows)."""
    x, y = xs[i][:b], ys[i][:b]
    fast = 2 * step_s * b / xs[i].shape[0] if step_s else math.inf
    t0 = time.perf_counter()
    step(i, x, y)
    first = last = time.perf_counter() - t0
    while last > fast and time.perf_counter() - t0 < NEW_BATCH_MOST_S:
        t1 = time.perf_counter()
        step(i, x, y)
        last = time.perf_counter() - t1
    return first, time.perf_counter() - t0


# ---- the driver -------------------------------------------------------------------------------

def available_runners(only: list[str] | None) -> list[str]:
    names = []
    try:
        import tilefuse as tx
        names += [f"tilefuse:{d}" for d in tx.devices()]
    except Exception as e:  # noqa: BLE001 - reported, the others still run
        print(f"tilefuse is unavailable: {e}")
    names += [n for n in ("torch", "jax") if importlib.util.find_spec(n) is not None]
    if only:
        names = [n for n in names if n in only or n.split(":")[0] in only]
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50, help="training steps per framework")
    ap.add_argument("--warmup", type=int, default=2, help="steps after the first not timed")
    ap.add_argument("--max-seconds", type=float, default=240,
                    help="stop a framework's steps after this long (0: never)")
    ap.add_argument("--only", default="", help="comma list: tilefuse, tilefuse:cpu, torch, jax")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--inputs", help=argparse.SUPPRESS)
    ap.add_argument("--first-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    runners = available_runners([s for s in args.only.split(",") if s] or None)
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        inputs = os.path.join(tmp, "inputs.npz")
        prepare(inputs, args.steps, args.seed)
        base = [__file__, "--inputs", inputs, "--steps", str(args.steps), "--warmup",
                str(args.warmup), "--max-seconds", str(args.max_seconds)]
        results, losses = {}, {}
        for r in runners:
            print(f"running {r} ...", flush=True)
            env = {}
            if r.startswith("tilefuse"):  # cold: a fresh persistent cache; warm: the same again
                env["TILEFUSE_CACHE_DIR"] = os.path.join(tmp, "cache_" + r.replace(":", "_"))
                env["TILEFUSE_TIERED"] = USER_TIERED  # first calls as a user's script meets them
            res = run_worker(base + ["--worker", r], env=env)
            if "error" in res:
                print(f"  {r} failed: {res['error']}")
                results[r] = {"step": "failed"}
                continue
            row = {"step": res["step_s"], "first call": res["first_call_s"],
                   "new batch: first call": res.get("new_batch_first_s", "-"),
                   "new batch: compiled after": res.get("new_batch_compiled_s", "-"),
                   "3rd batch size: first call": res.get("third_batch_first_s", "-"),
                   "3rd batch size: compiled after": res.get("third_batch_compiled_s", "-"),
                   "peak RSS MiB": round(res["peak_rss_mib"]),
                   "loss": f"{res['losses'][-1]:.4f} @{len(res['losses'])}"}
            if r.startswith("tilefuse"):
                warm = run_worker(base + ["--worker", r, "--first-only"], env=env)
                row["first call, cache warm"] = warm.get("first_call_s", "failed")
            results[r], losses[r] = row, res["losses"]
            print(f"  step {fmt_seconds(row['step'])}, first call {fmt_seconds(row['first call'])}, "
                  f"{len(res['losses'])} steps", flush=True)

    cols = ["step", "first call", "first call, cache warm", "new batch: first call",
            "new batch: compiled after", "3rd batch size: first call", "3rd batch size: compiled after"]
    secs = {m: fmt_seconds for m in cols}
    base_name = next((r for r in ("tilefuse:cpu", *runners) if r in results), None)
    print()
    print(side_by_side(results, [*cols, "peak RSS MiB", "loss"],
                       baseline=base_name, formats=secs,
                       title=f"char-GPT train step: d_model {D_MODEL}, {LAYERS} layers, {HEADS} heads, "
                             f"seq {SEQ}, batch {BATCH}, vocab {VOCAB}, AdamW (median after warm-up)"))
    return agreement(losses)


def agreement(losses: dict[str, list]) -> int:
    """Print the largest per-step |loss difference| of each tilefuse device against PyTorch and
    JAX over the steps both ran; 1 if one exceeds the tolerance."""
    refs = [r for r in ("torch", "jax") if r in losses]
    ours = [r for r in losses if r.startswith("tilefuse")]
    if not refs or not ours:
        print("\nloss-curve agreement: needs tilefuse and PyTorch or JAX results")
        return 0
    print(f"\nloss-curve agreement (same initial parameters and batches, float32; target {TOLERANCE:g}):")
    worst = 0.0
    for a in ours + (["jax"] if "jax" in refs and "torch" in refs else []):
        for b in refs:
            if a == b:
                continue
            n = min(len(losses[a]), len(losses[b]))
            d = float(np.max(np.abs(np.subtract(losses[a][:n], losses[b][:n]))))
            worst = max(worst, d) if a.startswith("tilefuse") else worst
            print(f"  {a} vs {b}: max |diff| {d:.2e} over {n} steps "
                  f"({'ok' if d <= TOLERANCE else 'ABOVE TOLERANCE'})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
