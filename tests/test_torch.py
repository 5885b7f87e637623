"""tilefuse.torch end to end on every device: torch.compile(model, backend=tilefuse.torch.backend)
trains plain PyTorch models (a GPT-2-style block, a small CNN) with loss.backward() and torch
optimizers exactly as eager PyTorch does; dropout draws from torch's generator; outputs stay on
devices whose memory is not the host's; unchanged inputs are not copied again."""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="tilefuse.torch needs PyTorch (the `torch` extra)")
nn, F = torch.nn, torch.nn.functional

import tilefuse as tx  # noqa: E402
import tilefuse.torch as tt  # noqa: E402
from tilefuse.torch import convert  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles afresh: dynamo's per-function cache (8 entries) would otherwise fill
    up across devices and fall back to eager PyTorch, and a test would compare eager with eager."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(model, device):
    backend = tt.backend(device=device)
    return torch.compile(model, backend=backend), backend


def _assert_ran(backend, device, graphs=2):
    """The backend compiled (forward and backward) graphs for `device` and ran each of them."""
    assert len(backend.graphs) >= graphs
    assert all(g.device is device and g.calls > 0 for g in backend.graphs)


class Block(nn.Module):
    """nanoGPT's block: pre-norm causal self-attention and a GELU MLP, with dropout."""

    def __init__(self, d, heads, dropout=0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=20, d=16, heads=2, seq=8, dropout=0.0):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.block, self.ln = Block(d, heads, dropout), nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        logits = self.head(self.ln(self.block(x)))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 3 * 3, 5)

    def forward(self, x):
        return self.fc(F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).flatten(1))


def _train(model, step_fn, optimizer, batches):
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = step_fn(*batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _assert_params_close(a, b, tol):
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=tol, atol=tol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_gpt_block_trains_like_eager(device):
    torch.manual_seed(0)
    eager = TinyGPT()
    ours = copy.deepcopy(eager)
    compiled, backend = _compiled(ours, device)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 20, (2, 8), generator=g), torch.randint(0, 20, (2, 8), generator=g))
               for _ in range(3)]
    # SGD: Adam would turn rounding noise in gradients that are exactly zero in exact arithmetic
    # (the key projection's bias: softmax ignores a constant added to a row) into full steps
    want = _train(eager, eager, torch.optim.SGD(eager.parameters(), lr=0.2), batches)
    got = _train(ours, compiled, torch.optim.SGD(ours.parameters(), lr=0.2), batches)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    _assert_params_close(eager, ours, 1e-5)
    assert want[-1] < want[0]  # it learns: the test compares training, not a constant
    _assert_ran(backend, device)


def test_cnn_trains_like_eager_with_batch_norm_statistics(device):
    torch.manual_seed(0)
    eager = SmallCNN()
    ours = copy.deepcopy(eager)
    compiled, backend = _compiled(ours, device)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 5, (4,), generator=g))
               for _ in range(3)]

    def step(model):
        return lambda x, y: F.cross_entropy(model(x), y)
    want = _train(eager, step(eager), torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9), batches)
    got = _train(ours, step(compiled), torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9), batches)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    _assert_params_close(eager, ours, 1e-5)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ours.bn, name), getattr(eager.bn, name))
    eager.eval(), ours.eval()
    x = batches[0][0]
    with torch.no_grad():  # evaluation: running statistics, the inference graph
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
    _assert_ran(backend, device, graphs=3)


def test_dropout_draws_from_torchs_generator(device):
    x = torch.randn(64, 32, requires_grad=True)
    f, backend = _compiled(lambda v: F.dropout(v, 0.25, training=True), device)
    torch.manual_seed(3)
    y = f(x)
    y.backward(torch.ones_like(y))
    keep = y != 0
    assert abs(keep.float().mean().item() - 0.75) < 0.03
    torch.testing.assert_close(y[keep], x[keep] / 0.75)
    torch.testing.assert_close(x.grad, keep.float() / 0.75)  # the forward's mask, not a new one
    torch.manual_seed(3)
    assert torch.equal(f(x), y)       # torch.manual_seed reproduces the draw
    assert not torch.equal(f(x), y)   # and each call draws afresh
    _assert_ran(backend, device)


def test_activations_stay_on_a_device_whose_memory_is_not_the_hosts(device, monkeypatch):
    """As on a discrete GPU: the activations the forward graph saves for the backward graph are
    DeviceTensors, never copied to the host; the outputs the user gets (the loss, the
    gradients) are host tensors."""
    monkeypatch.setattr(type(device.backend), "host_memory", lambda self, d: False)
    copies = []
    host_tensor = convert.host_tensor
    monkeypatch.setattr(convert, "host_tensor", lambda a: copies.append(a.shape) or host_tensor(a))
    saved = []
    pack = lambda t: saved.append(type(t)) or t  # noqa: E731  (sees what autograd saves)
    torch.manual_seed(0)
    eager = TinyGPT()
    ours = copy.deepcopy(eager)
    compiled, backend = _compiled(ours, device)
    idx = torch.randint(0, 20, (2, 8))
    params = {tuple(p.shape) for p in ours.parameters()}
    for _ in range(2):  # two backward passes accumulate into .grad
        eager(idx, idx).backward()
        copies.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = compiled(idx, idx)
        assert type(loss) is torch.Tensor and copies == [()]  # the loss, for the user
        assert tt.DeviceTensor in saved
        copies.clear()
        loss.backward()
        assert set(copies) <= params  # the gradients, nothing else
    for (name, p), (_, q) in zip(eager.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    _assert_ran(backend, device)


def test_device_tensor_behaves_as_a_host_tensor(device):
    """PyTorch reading a DeviceTensor sees its values; writing one in place makes the new values
    the ones a compiled graph takes next."""
    y = convert.to_tensor(tx.device_put(np.full(3, 2.0, np.float32), device), False, stay=True)
    assert isinstance(y, tt.DeviceTensor) and y.tilefuse_device is device
    assert convert.to_array(y, device) is y._store._array  # its own Array: no copy
    assert y.tolist() == [2.0, 2.0, 2.0] and (y * 2).tolist() == [4.0, 4.0, 4.0]
    assert convert.to_array(y, device) is y._store._array  # read, not written: still no copy
    y.add_(1.0)
    assert y.tolist() == [3.0, 3.0, 3.0]
    assert convert.to_array(y, device).numpy().tolist() == [3.0, 3.0, 3.0]
    y[0].mul_(2.0)  # a write through a view of the host copy
    assert convert.to_array(y, device).numpy().tolist() == [6.0, 3.0, 3.0]
    assert y.detach()._store is y._store


def test_unchanged_inputs_are_not_copied_again(device):
    w = torch.randn(4, 4)
    a = convert.to_array(w, device)
    assert convert.to_array(w, device) is a  # the same tensor, unchanged: the same Array
    w.mul_(2.0)  # written in place (as an optimizer does): copied again, new values
    b = convert.to_array(w, device)
    assert b is not a and np.allclose(b.numpy(), w.numpy())


def test_new_shapes_recompile_and_agree(device):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    compiled, backend = _compiled(model, device)
    for batch in (3, 5, 3):  # dynamo marks the batch dynamic after the second shape
        x = torch.randn(batch, 4)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    # a graph with a symbolic batch size ran (its sizes are static arguments of tx.jit)
    assert any(g.static_in and g.calls == 2 and g.device is device for g in backend.graphs)


def test_backend_rejects_an_unknown_device():
    with pytest.raises(tx.DeviceError, match="unknown device"):
        tt.backend(device="tpu:0")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_linear_gelu(device, dtype):
    """16-bit tensors cross as their bits (numpy's DLPack has no bfloat16) and compute as
    PyTorch does: the same values and gradients, in the same dtype."""
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(8, 4, generator=g).to(dt).requires_grad_()
    x = torch.randn(3, 4, generator=g).to(dt)

    def f(w, x):
        return F.gelu(F.linear(x, w)).sum()
    want = f(w, x)
    want.backward()
    want_grad, w.grad = w.grad.clone(), None
    compiled, backend = _compiled(f, device)
    got = compiled(w, x)
    got.backward()
    assert got.dtype == dt and w.grad.dtype == dt
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad, want_grad, rtol=2e-2, atol=2e-2)
    _assert_ran(backend, device)


def test_compiled_optimizer_step_matches_eager(device):
    """torch.compile(optimizer.step) through the backend: AdamW's update as one tilefuse graph
    (AOTAutograd writes the new parameters and moments back into PyTorch's tensors)."""
    torch.manual_seed(0)
    eager = nn.Linear(6, 3)
    ours = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=0.05)
    opt_o = torch.optim.AdamW(ours.parameters(), lr=0.05)
    step, backend = _compiled(opt_o.step, device)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(4, 6, generator=g)
        for model, opt, fn in ((eager, opt_e, opt_e.step), (ours, opt_o, step)):
            opt.zero_grad()
            model(x).square().sum().backward()
            fn()
    _assert_params_close(eager, ours, 1e-6)
    assert any(g.device is device and g.calls == 3 for g in backend.graphs)


def test_parameters_a_compiled_optimizer_writes_are_not_uploaded_again(device, monkeypatch):
    """On a device whose memory is not the host's: the compiled optimizer's new parameters come
    back as DeviceTensors that AOTAutograd copies into the parameters; each parameter then
    stands for that Array, so the next forward pass takes it without copying it up again."""
    monkeypatch.setattr(type(device.backend), "host_memory", lambda self, d: False)
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))
    ours = copy.deepcopy(eager)
    forward, _ = _compiled(ours, device)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    step, _ = _compiled(opt_o.step, device)
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        x = torch.randn(8, 5, generator=g)
        for model, opt, fn, run in ((eager, opt_e, opt_e.step, eager), (ours, opt_o, step, forward)):
            opt.zero_grad()
            run(x).square().mean().backward()
            fn()
        arrays = [convert._known(p, device) for p in ours.parameters()]  # None: would upload
        assert all(a is not None and a.device is device for a in arrays)
        for a, p in zip(arrays, ours.parameters()):
            np.testing.assert_array_equal(a.numpy(), p.detach().numpy())
    _assert_params_close(eager, ours, 1e-6)
