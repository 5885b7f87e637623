"""A nanoGPT-style character model in plain PyTorch, trained with torch.compile on tilefuse
devices: the only tilefuse line is the backend.

    model = torch.compile(model, backend=tilefuse.torch.backend(device="opencl:0"))

The model is nanoGPT's (github.com/karpathy/nanoGPT, model.py): token and position embeddings,
pre-LayerNorm blocks of causal self-attention (F.scaled_dot_product_attention) and a GELU MLP,
a final LayerNorm and a head tied to the token embedding, nanoGPT's initialisation and its AdamW
groups (weight decay on matrices only) and learning-rate schedule. The size is the project's
char-GPT (d 128, 2 layers, 4 heads, context 64, batch 32, vocabulary 96: about 0.42M parameters),
on the docstring corpus of examples/data.py, dropout off so that runs are comparable step by step.

    python examples/torch_gpt.py                        # eager, then cpu and opencl:0, 50 steps
    python examples/torch_gpt.py --devices cpu --steps 20
    python examples/torch_gpt.py --inductor             # also torch.compile's default backend

Every run starts from the same weights and sees the same batches; the script prints each run's
loss curve, its largest |loss - eager loss| over the steps (the target: 1e-3) and its median
step time, and exits with status 1 when a curve strays from eager's by more than --tolerance."""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 96
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd),
            "wpe": nn.Embedding(config.block_size, config.n_embd),
            "drop": nn.Dropout(config.dropout),
            "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            "ln_f": nn.LayerNorm(config.n_embd, bias=config.bias)})
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self, weight_decay=0.1, learning_rate=3e-3, betas=(0.9, 0.95)):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def make_batches(steps: int, batch: int, seq: int, seed: int = 0):
    """`steps` (inputs, targets) batches of the docstring corpus, as int64 tensors."""
    import data
    corpus = data.Corpus()
    sampler = data.WindowSampler(corpus.train, batch, seq, seed)
    out = []
    for _ in range(steps):
        x, y = sampler.next()
        out.append((torch.from_numpy(x).long(), torch.from_numpy(y).long()))
    return out, corpus.vocab.size


def get_lr(it: int, steps: int, learning_rate: float = 3e-3) -> float:
    """nanoGPT's schedule: linear warmup over the first tenth, then cosine decay to a tenth."""
    warmup, min_lr = max(1, steps // 10), learning_rate / 10
    if it < warmup:
        return learning_rate * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / max(1, steps - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def train(model: GPT, step_fn, batches, clip: float = 1.0):
    """nanoGPT's loop: AdamW with warmup and cosine decay, gradient clipping at 1.0.
    Returns (losses, step seconds)."""
    optimizer = model.configure_optimizers()
    losses, times = [], []
    for it, (x, y) in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it, len(batches))
        t0 = time.perf_counter()
        loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return losses, times


def run(name: str, template: GPT, batches, backend=None):
    """Train a copy of `template` eagerly (backend None), with tilefuse on a device ("cpu",
    "opencl:0", ...) or with Inductor ("inductor")."""
    torch._dynamo.reset()
    model = copy.deepcopy(template)
    if backend is None:
        step_fn = model
    elif backend == "inductor":
        step_fn = torch.compile(model)
    else:
        import tilefuse.torch
        step_fn = torch.compile(model, backend=tilefuse.torch.backend(device=backend))
    losses, times = train(model, step_fn, batches)
    return {"name": name, "losses": losses, "first": times[0],
            "step": statistics.median(times[min(3, len(times) - 1):])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default=None,
                    help="tilefuse devices, comma-separated (default: cpu and opencl:0 where present)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--inductor", action="store_true", help="also torch.compile's default backend")
    ap.add_argument("--tolerance", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads for every run (PyTorch's threads run the optimizer "
                         "and compete with a CPU device's: 1 suits tilefuse's cpu and PoCL devices)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import tilefuse as tx
    names = [d.name for d in tx.devices() if d.kind in ("cpu", "opencl")]
    devices = args.devices.split(",") if args.devices else [n for n in names if n in ("cpu", "opencl:0")]
    config = GPTConfig()
    batches, vocab = make_batches(args.steps, args.batch, config.block_size)
    config.vocab_size = vocab
    torch.manual_seed(1337)
    template = GPT(config)
    print(f"nanoGPT-style model: {sum(p.numel() for p in template.parameters()) / 1e6:.2f}M parameters, "
          f"{args.steps} steps of batch {args.batch} x {config.block_size}")
    runs = [run("eager", template, batches)]
    if args.inductor:
        runs.append(run("inductor", template, batches, "inductor"))
    runs += [run(f"tilefuse:{d}", template, batches, d) for d in devices]
    eager = runs[0]["losses"]
    failed = False
    print(f"\n{'run':18} {'loss@1':>8} {'loss@end':>9} {'max|dloss|':>11} {'first step':>11} "
          f"{'step (median)':>14}")
    for r in runs:
        diff = max(abs(a - b) for a, b in zip(r["losses"], eager))
        bad = r["name"] != "eager" and diff > args.tolerance
        failed |= bad
        print(f"{r['name']:18} {r['losses'][0]:8.4f} {r['losses'][-1]:9.4f} {diff:11.2e} "
              f"{r['first']:10.2f}s {r['step'] * 1e3:12.1f}ms" + ("  <- exceeds tolerance" if bad else ""))
    print("\nloss curves (every 10 steps):")
    for r in runs:
        print(f"  {r['name']:18} " + " ".join(f"{v:.4f}" for v in r["losses"][::10]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
