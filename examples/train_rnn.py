"""Train a character-level LSTM on the Python standard library's docstrings, with lax.scan.

    python examples/train_rnn.py                          # defaults: a few minutes on 2 cores
    python examples/train_rnn.py --hidden 128 --steps 100 --device opencl:0

The corpus is the transformer's (examples/data.py). The recurrence is one `lax.scan` over the
time axis: its body (the LSTM cell) is traced once and compiled once, whatever the sequence
length, and reverse mode runs a second scan backwards over the residuals the forward one stacked.
The input projection of every time step is one GEMM before the loop; sampling is a scan too, a
character per step drawn inside the loop. `init_params`, `loss_fn`, `make_train_step` and
`sample` are importable for tests and benchmarks.
"""
from __future__ import annotations

import argparse
import dataclasses
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
from tilefuse import lax  # noqa: E402

import data  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    """The model's shape (hashable: it is static in the jitted step)."""
    vocab: int = 96
    embed: int = 64
    hidden: int = 256
    seq: int = 64


def init_params(key, cfg: Config) -> dict:
    """Glorot input weights, recurrent weights scaled by 1/sqrt(hidden), forget-gate bias 1."""
    k = random.split(key, 4)
    h = cfg.hidden
    bias = np.zeros(4 * h, np.float32)
    bias[h:2 * h] = 1.0  # gates (i, f, g, o): remember by default
    return {
        "embed": nn.init_embedding(k[0], cfg.vocab, cfg.embed, stddev=0.1),
        "wx": nn.glorot_uniform()(k[1], (cfg.embed, 4 * h)),
        "wh": nn.normal(1.0 / math.sqrt(h))(k[2], (h, 4 * h)),
        "b": tnp.asarray(bias),
        "head": nn.init_linear(k[3], h, cfg.vocab),
    }


def lstm_cell(wh, carry, xw_t):
    """One step: xw_t is the input's projection (x_t @ wx + b), precomputed for all steps."""
    h, c = carry
    i, f, g, o = tnp.split(xw_t + h @ wh, 4, axis=-1)
    c = nn.sigmoid(f) * c + nn.sigmoid(i) * tnp.tanh(g)
    h = nn.sigmoid(o) * tnp.tanh(c)
    return (h, c), h


def zero_state(batch: int, cfg: Config):
    z = tnp.zeros((batch, cfg.hidden), tnp.float32)
    return z, z


def forward(params, x, cfg: Config, state=None):
    """Logits (batch, time, vocab) for int32 tokens x (batch, time), and the final (h, c)."""
    b = tnp.shape(x)[0]
    emb = nn.embedding(params["embed"], tnp.transpose(x))  # (time, batch, embed): scan over time
    xw = emb @ params["wx"] + params["b"]  # every step's input projection: one GEMM
    state, hs = lax.scan(lambda s, xw_t: lstm_cell(params["wh"], s, xw_t),
                         zero_state(b, cfg) if state is None else state, xw)
    return tnp.transpose(nn.linear(params["head"], hs), (1, 0, 2)), state


def loss_fn(params, x, y, cfg: Config):
    """Mean next-character cross entropy (nats)."""
    return nn.cross_entropy(forward(params, x, cfg)[0], y)


def make_optimizer(lr: float, steps: int, clip: float = 1.0):
    warmup = max(1, min(steps // 10, 100))
    schedule = optim.warmup_cosine(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.1)
    return optim.chain(optim.clip_by_global_norm(clip), optim.adam(schedule))


def make_train_step(cfg: Config, optimizer):
    """One jitted step: (params, opt_state, x, y) -> (params, opt_state, loss)."""
    def step(params, opt_state, x, y):
        loss, grads = tx.value_and_grad(loss_fn)(params, x, y, cfg)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss
    return tx.jit(step)


def sample(params, cfg: Config, vocab: data.CharVocab, key, prompt: str = "The ", length: int = 200,
           temperature: float = 0.8) -> str:
    """`length` characters after `prompt`: the prompt runs through the LSTM, then one scan draws
    a character per step and feeds it back (one jitted call for the whole text)."""
    @tx.jit
    def run(params, prompt_ids, key):
        _, state = forward(params, prompt_ids[None, :-1], cfg)

        def step(carry, i):
            (h, c), tok = carry
            xw = nn.embedding(params["embed"], tok) @ params["wx"] + params["b"]
            (h, c), out = lstm_cell(params["wh"], (h, c), xw)
            logits = nn.linear(params["head"], out)[0] / temperature
            nxt = random.categorical(random.fold_in(key, i), logits)
            return ((h, c), tnp.reshape(nxt, (1,))), nxt
        _, ids = lax.scan(step, (state, prompt_ids[-1:]), tnp.arange(length))
        return ids

    ids = vocab.encode(prompt).astype(np.int32)
    if len(ids) < 2:
        ids = np.concatenate([[vocab.encode(" ")[0]], ids]).astype(np.int32)
    return prompt + vocab.decode(np.asarray(run(params, ids, key)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64, help="characters per training window")
    p.add_argument("--embed", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    p.add_argument("--device", default=None, help="cpu, ref, opencl:0, cuda:0 (default: tilefuse's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--max-chars", type=int, default=data.MAX_CHARS, help="corpus size cap")
    p.add_argument("--sample", type=int, default=300, help="characters to generate at the end")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def train(args) -> dict:
    """Run the training that args describe; returns the final params, losses and held-out loss."""
    if args.device:
        tx.config.default_device = args.device
    corpus = data.Corpus(max_chars=args.max_chars)
    cfg = Config(vocab=corpus.vocab.size, embed=args.embed, hidden=args.hidden, seq=args.seq)
    optimizer = make_optimizer(args.lr, args.steps)
    init_key, key = random.split(random.key(args.seed))
    params = tx.device_put(init_params(init_key, cfg))
    opt_state = tx.device_put(optimizer.init(params))
    say = (lambda *a: None) if args.quiet else print
    n_params = sum(int(np.prod(tnp.shape(p))) for p in tx.tree_leaves(params))
    say(f"corpus: {len(corpus.train):,} train + {len(corpus.eval):,} held-out chars, vocab {cfg.vocab}; "
        f"LSTM: {n_params:,} parameters on {tx.default_device()}")
    train_step = make_train_step(cfg, optimizer)
    eval_loss = tx.jit(lambda p, x, y: loss_fn(p, x, y, cfg))
    sampler = data.WindowSampler(corpus.train, args.batch, args.seq, args.seed)
    held_out = data.eval_batches(corpus.eval, args.batch, args.seq, args.eval_batches)
    losses, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = sampler.next()
        params, opt_state, loss = train_step(params, opt_state, x, y)
        losses.append(loss)
        if step == 1:
            say(f"step 1: loss {float(loss):.3f} (first call, compile included: "
                f"{time.perf_counter() - t0:.1f} s)")
            t0 = time.perf_counter()
        elif step % args.log_every == 0 or step == args.steps:
            dt = time.perf_counter() - t0
            say(f"step {step}: loss {float(loss):.3f}, {args.log_every * x.size / dt:,.0f} chars/s")
            t0 = time.perf_counter()
    result = {"params": params, "losses": [float(v) for v in losses], "config": cfg,
              "unigram_loss": corpus.unigram_loss()}
    result["eval_loss"] = float(np.mean([float(eval_loss(params, x, y)) for x, y in held_out]))
    say(f"held-out loss {result['eval_loss']:.3f} nats/char vs the unigram baseline "
        f"{result['unigram_loss']:.3f}")
    if args.sample:
        result["sample"] = sample(params, cfg, corpus.vocab, random.fold_in(key, 1), length=args.sample)
        say("sample:\n" + result["sample"])
    return result


if __name__ == "__main__":
    train(parse_args())
