"""Train a character-level GPT on the Python standard library's docstrings.

    python examples/train_transformer.py                     # defaults: a few minutes on 2 cores
    python examples/train_transformer.py --out runs/a        # checkpoints + metrics.jsonl there
    python examples/train_transformer.py --out runs/a --resume --steps 2000

The model is a pre-LayerNorm decoder (causal multi-head attention, GELU MLP, learned positions,
untied or --tied embeddings), trained with AdamW, warmup + cosine learning rate and global-norm
gradient clipping, all inside one jitted step. `init_params`, `loss_fn` and `make_train_step`
are importable for tests, notebooks and benchmarks. A checkpoint (an .npz without pickles,
written atomically) holds the step, parameters, optimizer state, random key and data
position, so a resumed run continues bit for bit as if it had never stopped: after a kill (the
killed writer's temporary file is removed at the next start), a full disk (reported with the
space needed) or a torn last line of metrics.jsonl. examples/checkpoint.py holds those helpers.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tilefuse as tx  # noqa: E402
import tilefuse.nn as nn  # noqa: E402
import tilefuse.numpy as tnp  # noqa: E402
import tilefuse.optim as optim  # noqa: E402
import tilefuse.random as random  # noqa: E402
from tilefuse import distributed, lax  # noqa: E402
from tilefuse.ir.errors import TilefuseError  # noqa: E402

import checkpoint as ckpt_io  # noqa: E402
import data  # noqa: E402

CHECKPOINT = "checkpoint.npz"
METRICS = "metrics.jsonl"


@dataclasses.dataclass(frozen=True)
class Config:
    """The model's shape (hashable: it is static in the jitted step)."""
    vocab: int = 96
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    seq: int = 64
    tied: bool = False
    dropout: float = 0.0
    scan_layers: bool = False  # blocks' parameters stacked, the layers run by one lax.scan


# ---- the model --------------------------------------------------------------------------------

def init_params(key, cfg: Config) -> dict:
    """GPT-2 style initialisation: N(0, 0.02) weights, residual projections scaled down by
    sqrt(2 * layers), zero biases, unit LayerNorm scales."""
    d = cfg.d_model
    w = nn.normal(0.02)
    w_res = nn.normal(0.02 / math.sqrt(2 * cfg.layers))
    keys = random.split(key, 3 + cfg.layers)
    params = {
        "tok": nn.init_embedding(keys[0], cfg.vocab, d),
        "pos": nn.init_embedding(keys[1], cfg.seq, d, stddev=0.01),
        "blocks": [],
        "ln_f": nn.init_layer_norm(d),
    }
    for i in range(cfg.layers):
        k = random.split(keys[3 + i], 4)
        params["blocks"].append({
            "ln1": nn.init_layer_norm(d),
            "qkv": nn.init_linear(k[0], d, 3 * d, w_init=w),
            "proj": nn.init_linear(k[1], d, d, w_init=w_res),
            "ln2": nn.init_layer_norm(d),
            "fc": nn.init_linear(k[2], d, 4 * d, w_init=w),
            "fc_out": nn.init_linear(k[3], 4 * d, d, w_init=w_res),
        })
    if not cfg.tied:
        params["head"] = nn.init_linear(keys[2], d, cfg.vocab, w_init=w)
    if cfg.scan_layers:  # the same values, each leaf stacked along a leading layer axis
        params["blocks"] = tx.tree_map(lambda *xs: tnp.stack(xs), *params["blocks"])
    return params


def _block(p, h, cfg: Config, key, train: bool):
    b, t, d = tnp.shape(h)
    nh = cfg.heads
    qkv = tnp.reshape(nn.linear(p["qkv"], nn.layer_norm(p["ln1"], h)), (b, t, 3, nh, d // nh))
    a = nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    a = nn.linear(p["proj"], tnp.reshape(a, (b, t, d)))
    k1, k2 = random.split(key) if train and cfg.dropout > 0 else (None, None)
    h = h + nn.dropout(k1, a, cfg.dropout, deterministic=not train)
    m = nn.linear(p["fc_out"], nn.gelu(nn.linear(p["fc"], nn.layer_norm(p["ln2"], h))))
    return h + nn.dropout(k2, m, cfg.dropout, deterministic=not train)


def forward(params, x, cfg: Config, key=None, train: bool = False):
    """Logits (batch, time, vocab) for int32 tokens x (batch, time), time <= cfg.seq."""
    t = tnp.shape(x)[1]
    h = nn.embedding(params["tok"], x) + params["pos"][:t]
    if cfg.scan_layers:  # one block traced and compiled once, run over the stacked layers
        keys = tnp.stack([random.fold_in(key, i) for i in range(cfg.layers)]) \
            if train and cfg.dropout > 0 else tnp.zeros((cfg.layers,), tnp.float32)
        h, _ = lax.scan(lambda h, pk: (_block(pk[0], h, cfg, pk[1], train), None), h,
                        (params["blocks"], keys))
    for i, p in enumerate([] if cfg.scan_layers else params["blocks"]):
        k = random.fold_in(key, i) if train and cfg.dropout > 0 else None
        h = _block(p, h, cfg, k, train)
    h = nn.layer_norm(params["ln_f"], h)
    if cfg.tied:
        return tnp.matmul(h, tnp.transpose(params["tok"]))
    return nn.linear(params["head"], h)


def loss_fn(params, x, y, cfg: Config, key=None, train: bool = False):
    """Mean next-character cross entropy (nats)."""
    return nn.cross_entropy(forward(params, x, cfg, key, train), y)


def decay_mask(params):
    """Weight decay on matrices (weights and embeddings), not on biases or LayerNorms."""
    mask = tx.tree_map(lambda p: tnp.ndim(p) >= 2, params)
    if isinstance(params.get("blocks"), dict):  # stacked layers (--scan-layers): one axis more
        mask["blocks"] = tx.tree_map(lambda p: tnp.ndim(p) >= 3, params["blocks"])
    return mask


def make_optimizer(lr: float, steps: int, warmup: int | None = None, weight_decay: float = 0.1,
                   clip: float = 1.0):
    """AdamW with linear warmup and cosine decay to lr / 10, after global-norm clipping."""
    warmup = max(1, min(steps // 10, 100)) if warmup is None else warmup
    schedule = optim.warmup_cosine(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.1)
    return optim.chain(optim.clip_by_global_norm(clip),
                       optim.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay,
                                   mask=decay_mask))


def make_train_step(cfg: Config, optimizer):
    """One jitted step: (params, opt_state, key, x, y) -> (params, opt_state, key, loss): the
    forward and backward passes, the optimizer update and the next random key."""
    def step(params, opt_state, key, x, y):
        key, sub = random.split(key)
        loss, grads = tx.value_and_grad(lambda p: loss_fn(p, x, y, cfg, sub, True))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, key, loss
    return tx.jit(step)


def tuning_workload(batch: int = 32, cfg: Config = Config()):
    """The jitted training step and one batch of arguments (random tokens): what
    `python -m tilefuse.tune --model examples/train_transformer.py` tunes."""
    optimizer = make_optimizer(3e-3, 300)
    params = tx.device_put(init_params(random.key(0), cfg))
    opt_state = tx.device_put(optimizer.init(params))
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.vocab, (batch, cfg.seq)).astype(np.int32) for _ in range(2))
    return make_train_step(cfg, optimizer), (params, opt_state, random.key(1), x, y)


def make_distributed_step(cfg: Config, optimizer, bucket_mb: float = 25.0, compress=None):
    """make_train_step's step, data-parallel over MPI (tilefuse.distributed): each rank
    differentiates its slice of the global batch with its own dropout key, gradients are
    averaged across ranks, and the loss returned is the mean over ranks. `.dp` is the trainer."""
    dp = distributed.data_parallel(lambda p, x, y, k: loss_fn(p, x, y, cfg, k, True), optimizer,
                                   batch_argnums=(0, 1), bucket_mb=bucket_mb, compress=compress)

    def step(params, opt_state, key, x, y):
        key, sub = random.split(key)
        params, opt_state, loss = dp.step(params, opt_state, x, y, random.fold_in(sub, dp.rank))
        return params, opt_state, key, loss
    step.dp = dp
    return step


def make_eval_loss(cfg: Config):
    return tx.jit(lambda params, x, y: loss_fn(params, x, y, cfg))


def generate(params, cfg: Config, vocab: data.CharVocab, key, prompt: str = "The ",
             length: int = 200, temperature: float = 0.8) -> str:
    """Sample `length` characters after `prompt`, one jitted forward pass per character."""
    @tx.jit
    def next_token(params, window, pos, key, i):
        logits = forward(params, window, cfg)[0]  # (seq, vocab); causal: padding after pos is unseen
        last = tnp.take(logits, tnp.reshape(pos, (1,)), axis=0)[0]
        return random.categorical(random.fold_in(key, i), last / temperature)

    ids = list(vocab.encode(prompt)) or [0]
    for i in range(length):
        ctx = ids[-cfg.seq:]
        window = np.zeros((1, cfg.seq), np.int32)
        window[0, :len(ctx)] = ctx
        tok = next_token(params, window, np.int32(len(ctx) - 1), key, np.int32(i))
        ids.append(int(tok))
    return vocab.decode(ids)


# ---- checkpoints ----------------------------------------------------------------------------

def _flatten(tree, prefix: str) -> dict[str, object]:
    """Leaves by path ('params/blocks/0/qkv/w'), in a fixed order."""
    out = {}
    if isinstance(tree, dict):
        for k in sorted(tree):
            out.update(_flatten(tree[k], f"{prefix}/{k}"))
    elif isinstance(tree, tuple) and hasattr(tree, "_fields"):
        for k in tree._fields:
            out.update(_flatten(getattr(tree, k), f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}/{i}"))
    elif tree is not None:
        out[prefix] = tree
    return out


def _unflatten(template, arrays: dict, prefix: str):
    if isinstance(template, dict):
        return {k: _unflatten(v, arrays, f"{prefix}/{k}") for k, v in template.items()}
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return type(template)(*(_unflatten(getattr(template, k), arrays, f"{prefix}/{k}")
                                for k in template._fields))
    if isinstance(template, (list, tuple)):
        return type(template)(_unflatten(v, arrays, f"{prefix}/{i}") for i, v in enumerate(template))
    if template is None:
        return None
    return arrays[prefix]


def save_checkpoint(path: str, *, step: int, params, opt_state, key, data_pos: int, cfg: Config) -> None:
    """Write the training state to path atomically (examples/checkpoint.py: a temporary file,
    fsync, rename; removed on failure; a full disk says how much space it needs)."""
    arrays = {k: np.asarray(v) for k, v in {**_flatten(params, "params"),
                                            **_flatten(opt_state, "opt")}.items()}
    arrays["step"] = np.asarray(step, np.int64)
    arrays["data_pos"] = np.asarray(data_pos, np.int64)
    arrays["rng_key"] = np.asarray(key)
    arrays["config"] = np.asarray(json.dumps(dataclasses.asdict(cfg)))
    ckpt_io.write_npz(path, arrays)


def load_checkpoint(path: str, params_template, opt_template, cfg: Config) -> dict:
    """The state saved at path, checked against the model's structure; a file that cannot be
    read, or an entry that is damaged, crafted or does not match, raises a TilefuseError naming
    the file and the entry (nothing is half-loaded, nothing is unpickled)."""
    def bad(why):
        return ckpt_io.CheckpointError(f"checkpoint {path} cannot be used: {why}; delete it or train "
                                       "without --resume")
    arrays = ckpt_io.read_npz(path, bad)
    for k in ("step", "data_pos", "rng_key", "config"):
        if k not in arrays:
            raise bad(f"it has no {k!r} entry")
    step = ckpt_io.int_entry(arrays, "step", bad)
    data_pos = ckpt_io.int_entry(arrays, "data_pos", bad)
    saved_cfg = ckpt_io.json_entry(arrays, "config", bad)
    if saved_cfg != dataclasses.asdict(cfg):
        raise bad(f"it was written for the model {saved_cfg}, not {dataclasses.asdict(cfg)}")
    want = {**_flatten(params_template, "params"), **_flatten(opt_template, "opt")}
    for k, v in want.items():
        if k not in arrays:
            raise bad(f"the entry {k!r} is missing")
        if arrays[k].shape != tnp.shape(v) or arrays[k].dtype != np.dtype(v.dtype):
            raise bad(f"the entry {k!r} is {arrays[k].dtype}{list(arrays[k].shape)}, expected "
                      f"{np.dtype(v.dtype)}{list(tnp.shape(v))}")
        if arrays[k].dtype.kind == "f" and not np.isfinite(arrays[k]).all():
            raise bad(f"the entry {k!r} holds NaN or infinity")
    if arrays["rng_key"].shape != (2,) or arrays["rng_key"].dtype != np.uint32:
        raise bad("its rng_key is not a uint32 pair")
    return {"step": step, "data_pos": data_pos,
            "key": tx.device_put(arrays["rng_key"]),
            "params": tx.device_put(_unflatten(params_template, arrays, "params")),
            "opt_state": tx.device_put(_unflatten(opt_template, arrays, "opt"))}


# ---- the training loop -------------------------------------------------------------------------

def _int_at_least(low: int):
    """An argparse type: an int >= low (argparse reports anything else as a usage error)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{v} is not an integer >= {low}")
        return v
    parse.__name__ = f"int >= {low}"
    return parse


def _float_in(low: float, high: float = math.inf, high_open: bool = False):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (low <= v and (v < high if high_open else v <= high)):
            raise argparse.ArgumentTypeError(f"{v} is not in [{low}, {high}{')' if high_open else ']'}")
        return v
    parse.__name__ = "number"
    return parse


def parse_args(argv=None):
    positive, counter = _int_at_least(1), _int_at_least(0)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=counter, default=300, help="total optimizer steps")
    p.add_argument("--batch", type=positive, default=32)
    p.add_argument("--seq", type=positive, default=64, help="context length in characters")
    p.add_argument("--d-model", type=positive, default=128)
    p.add_argument("--layers", type=positive, default=2)
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--tied", action="store_true", help="share the input and output embeddings")
    p.add_argument("--dropout", type=_float_in(0.0, 1.0, high_open=True), default=0.0)
    p.add_argument("--lr", type=_float_in(0.0), default=3e-3, help="peak learning rate")
    p.add_argument("--weight-decay", type=_float_in(0.0), default=0.1)
    p.add_argument("--device", default=None, help="cpu, ref, opencl:0, cuda:0 (default: tilefuse's)")
    p.add_argument("--seed", type=counter, default=0)
    p.add_argument("--out", default=None, help="directory for checkpoints and metrics.jsonl")
    p.add_argument("--resume", action="store_true", help=f"continue from OUT/{CHECKPOINT}")
    p.add_argument("--eval-every", type=counter, default=100, help="0: only at the end")
    p.add_argument("--log-every", type=positive, default=10)
    p.add_argument("--ckpt-every", type=counter, default=100, help="0: only at the end")
    p.add_argument("--eval-batches", type=positive, default=4)
    p.add_argument("--max-chars", type=positive, default=data.MAX_CHARS, help="corpus size cap")
    p.add_argument("--sample", type=counter, default=300, help="characters to generate at the end")
    p.add_argument("--stop-at", type=counter, default=None,
                   help="stop after this step as if interrupted (checkpoint kept): tests resuming")
    p.add_argument("--quiet", action="store_true", help="no progress bar or prints")
    p.add_argument("--scan-layers", action="store_true",
                   help="stack the blocks' parameters and run the layers with lax.scan (one block compiled)")
    p.add_argument("--distributed", action="store_true",
                   help="data-parallel over MPI: mpirun -n N python train_transformer.py --distributed "
                        "(the global --batch is split across ranks; rank 0 prints and writes)")
    p.add_argument("--bucket-mb", type=_float_in(1e-6), default=25.0,
                   help="gradient bucket size (--distributed)")
    p.add_argument("--compress", choices=["int8"], default=None,
                   help="int8 gradient compression with error feedback (--distributed)")
    args = p.parse_args(argv)
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out} is a file; it names the directory for checkpoints and {METRICS}")
    if args.resume and args.out is None:
        p.error(f"--resume needs --out DIR (the checkpoint is DIR/{CHECKPOINT})")
    return args


def _progress(total, initial, quiet):
    if quiet:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def _log(msg, quiet):
    if not quiet:
        print(msg, flush=True)


def train(args) -> dict:
    """Run the training that args describe; returns the final params, losses and metrics."""
    if args.device:
        tx.config.default_device = args.device
    if args.distributed and distributed.init().rank:  # rank 0 alone prints, logs and checkpoints
        args = argparse.Namespace(**{**vars(args), "quiet": True, "out": None, "resume": False, "sample": 0})
    corpus = data.Corpus(max_chars=args.max_chars)
    cfg = Config(vocab=corpus.vocab.size, d_model=args.d_model, layers=args.layers,
                 heads=args.heads, seq=args.seq, tied=args.tied, dropout=args.dropout,
                 scan_layers=getattr(args, "scan_layers", False))
    if cfg.d_model % cfg.heads:
        raise TilefuseError(f"--d-model {cfg.d_model} must be a multiple of --heads {cfg.heads}")
    if len(corpus.train) <= args.seq or len(corpus.eval) <= args.seq:
        raise TilefuseError(f"--max-chars {args.max_chars} gives {len(corpus.train)} training and "
                            f"{len(corpus.eval)} held-out characters: too few for windows of --seq "
                            f"{args.seq} + 1; raise --max-chars or lower --seq")
    optimizer = make_optimizer(args.lr, args.steps, weight_decay=args.weight_decay)
    init_key, key = random.split(random.key(args.seed))
    params = tx.device_put(init_params(init_key, cfg))
    opt_state = tx.device_put(optimizer.init(params))
    step, data_pos = 0, 0
    ckpt = os.path.join(args.out, CHECKPOINT) if args.out else None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for name in (CHECKPOINT, METRICS):  # left by a run killed while it wrote them
            ckpt_io.remove_stale_temporaries(os.path.join(args.out, name))
    if args.resume:
        if ckpt is None:
            raise TilefuseError("--resume needs --out DIR (the checkpoint is DIR/checkpoint.npz)")
        if os.path.exists(ckpt):
            state = load_checkpoint(ckpt, params, opt_state, cfg)
            step, data_pos, key = state["step"], state["data_pos"], state["key"]
            params, opt_state = state["params"], state["opt_state"]
            _log(f"resumed from {ckpt} at step {step}", args.quiet)
        else:
            _log(f"no checkpoint at {ckpt}: starting from step 0", args.quiet)
    metrics_path = os.path.join(args.out, METRICS) if args.out else None
    if metrics_path:  # drop records past the checkpoint (about to be redone) and a torn last line
        old = []
        if step and os.path.exists(metrics_path):
            old = [rec for rec in ckpt_io.read_jsonl(metrics_path)
                   if isinstance(rec.get("step"), int) and rec["step"] <= step]
        ckpt_io.write_text(metrics_path, "".join(json.dumps(rec) + "\n" for rec in old))

    n_params = sum(int(np.prod(tnp.shape(p))) for p in tx.tree_leaves(params))
    unigram = corpus.unigram_loss()
    _log(f"corpus: {len(corpus.train):,} train + {len(corpus.eval):,} held-out chars, vocab "
         f"{cfg.vocab}; model: {n_params:,} parameters on {tx.default_device()}", args.quiet)

    train_step = make_train_step(cfg, optimizer)
    if args.distributed:  # every rank starts from rank 0's state, fresh or resumed
        train_step = make_distributed_step(cfg, optimizer, args.bucket_mb, args.compress)
        params, opt_state, key, pos = train_step.dp.broadcast(
            (params, opt_state, key, np.array([step, data_pos], np.int64)), "training state")
        step, data_pos = int(pos[0]), int(pos[1])
    sampler = data.WindowSampler(corpus.train, args.batch, args.seq, args.seed, data_pos)
    held_out = data.eval_batches(corpus.eval, args.batch, args.seq, args.eval_batches)
    if not held_out:
        raise TilefuseError(f"the {len(corpus.eval)} held-out characters hold no batch of --batch "
                            f"{args.batch} windows of --seq {args.seq}; raise --max-chars")
    eval_loss_fn = make_eval_loss(cfg)

    def evaluate():
        return float(np.mean([float(eval_loss_fn(params, x, y)) for x, y in held_out]))

    def checkpoint():
        if ckpt:
            save_checkpoint(ckpt, step=step, params=params, opt_state=opt_state, key=key,
                            data_pos=data_pos, cfg=cfg)

    stop = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    bar = _progress(args.steps, step, args.quiet)
    losses, history = [], []  # losses stay on the device until the end: no sync per step
    t0, tokens = time.perf_counter(), 0
    eval_loss = None
    try:
        while step < stop:
            x, y = sampler.next()
            params, opt_state, key, loss = train_step(params, opt_state, key, x, y)
            step, data_pos = step + 1, sampler.position
            losses.append(loss)
            tokens += x.size
            if bar is not None:
                bar.update(1)
            evaluated = bool(args.eval_every) and (step % args.eval_every == 0 or step == args.steps)
            logged = step % args.log_every == 0 or evaluated or step == args.steps
            if logged:
                rec = {"step": step, "loss": float(loss)}  # reading it waits for the device
                rec["tokens_per_s"] = tokens / (time.perf_counter() - t0)
                if evaluated:
                    eval_loss = rec["eval_loss"] = evaluate()
                history.append(rec)
                if metrics_path:
                    ckpt_io.append_line(metrics_path, json.dumps(rec))
                if bar is not None:
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}",
                                    **({"eval": f"{eval_loss:.3f}"} if eval_loss is not None else {}))
            if args.ckpt_every and step % args.ckpt_every == 0:
                checkpoint()
            if logged:  # time the next window from here: evaluation and saving are not steps
                t0, tokens = time.perf_counter(), 0
    except KeyboardInterrupt:
        checkpoint()
        if bar is not None:
            bar.close()
        _log(f"\ninterrupted at step {step}" + (f"; continue with --resume --out {args.out}"
                                                 if ckpt else ""), args.quiet)
        raise
    if bar is not None:
        bar.close()
    checkpoint()
    result = {"params": params, "opt_state": opt_state, "step": step,
              "losses": [float(v) for v in losses],
              "history": history, "unigram_loss": unigram, "config": cfg}
    if step < args.steps:  # stopped early on purpose (--stop-at)
        return result
    result["eval_loss"] = eval_loss if eval_loss is not None else evaluate()
    _log(f"step {step}: held-out loss {result['eval_loss']:.3f} nats/char vs the unigram "
         f"baseline {unigram:.3f}", args.quiet)
    if args.sample:
        text = generate(params, cfg, corpus.vocab, random.fold_in(key, 1), length=args.sample)
        result["sample"] = text
        _log("sample:\n" + text, args.quiet)
    return result


def main(argv=None):
    args = parse_args(argv)
    try:
        train(args)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
