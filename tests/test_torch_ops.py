"""tilefuse.torch's ATen op table against eager PyTorch on every device, forward and backward.

Each row is a small PyTorch function; AOTAutograd (the same path torch.compile takes, minus
dynamo) traces it into core-ATen forward and backward graphs, which tilefuse compiles for the
device. The forward's outputs (values and dtypes) and the gradients of a random cotangent must
match eager PyTorch. On OpenCL a deterministic 1-in-N sample of the rows runs (PoCL builds each
new kernel in ~0.5 s), as for the project's other table tests: TILEFUSE_OPENCL_SAMPLE=1 runs all."""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="tilefuse.torch needs PyTorch (the `torch` extra)")
F = torch.nn.functional

import tilefuse.torch as tt  # noqa: E402
from tilefuse.torch import aten as A  # noqa: E402


def aot(fn, device):
    """fn compiled through AOTAutograd with the backend's decompositions, on `device`."""
    from functorch.compile import aot_function, min_cut_rematerialization_partition
    comp = lambda gm, example_inputs: tt.compile_fx_graph(gm, example_inputs, device)  # noqa: E731
    return aot_function(fn, fw_compiler=comp, bw_compiler=comp, decompositions=tt.decompositions(),
                        partition_fn=min_cut_rematerialization_partition)


def r(*shape):
    return lambda g: torch.randn(*shape, generator=g)


def pos(*shape):
    return lambda g: torch.rand(*shape, generator=g) + 0.5


def ints(high, *shape):
    return lambda g: torch.randint(0, high, shape, generator=g)


def boolean(*shape):
    return lambda g: torch.rand(*shape, generator=g) > 0.5


def away0(*shape):  # values that keep clear of non-differentiable points (0 for abs, ties for max)
    return lambda g: ((torch.rand(*shape, generator=g) + 0.2)
                      * (torch.randint(0, 2, shape, generator=g) * 2 - 1))


def distinct(*shape):  # no ties, so max/argmax/pooling have one gradient
    return lambda g: torch.randperm(int(np.prod(shape)), generator=g).float().reshape(shape) / 10


# (name, function, input makers); every float input gets a gradient unless the row says grad=False
ROWS = [
    # elementwise
    ("abs", torch.abs, [away0(3, 4)]),
    ("neg", torch.neg, [r(3, 4)]),
    ("exp", torch.exp, [r(3, 4)]),
    ("log", torch.log, [pos(3, 4)]),
    ("log1p", torch.log1p, [pos(3, 4)]),
    ("expm1", torch.expm1, [r(3, 4)]),
    ("sqrt", torch.sqrt, [pos(3, 4)]),
    ("rsqrt", torch.rsqrt, [pos(3, 4)]),
    ("tanh", torch.tanh, [r(3, 4)]),
    ("sigmoid", torch.sigmoid, [r(3, 4)]),
    ("sin_cos", lambda x: torch.sin(x) * torch.cos(x), [r(3, 4)]),
    ("erf", torch.erf, [r(3, 4)]),
    ("reciprocal", torch.reciprocal, [away0(3, 4)]),
    ("relu", F.relu, [away0(3, 4)]),
    ("gelu", F.gelu, [r(3, 4)]),
    ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), [r(3, 4)]),
    ("silu", F.silu, [r(3, 4)]),
    ("elu", F.elu, [away0(3, 4)]),
    ("leaky_relu", lambda x: F.leaky_relu(x, 0.1), [away0(3, 4)]),
    ("hardtanh", lambda x: F.hardtanh(x, -0.5, 0.5), [r(3, 4)]),
    ("softplus", F.softplus, [r(3, 4)]),
    ("rounding", lambda x: (torch.floor(x), torch.ceil(x), torch.round(x), torch.trunc(x), torch.sign(x)),
     [r(3, 4)], {"grad": False}),
    # binary, with PyTorch's promotion
    ("add_alpha", lambda a, b: torch.add(a, b, alpha=0.5), [r(3, 4), r(4)]),
    ("sub", lambda a, b: a - b, [r(3, 1), r(1, 4)]),
    ("mul_div", lambda a, b: a * b / (b * b + 1), [r(3, 4), r(3, 4)]),
    ("pow", lambda a, b: a ** 3 + a ** b + 2.0 ** b, [pos(3, 4), r(3, 4)]),
    ("maximum_minimum", lambda a, b: torch.maximum(a, b) + torch.minimum(a, b) * 2,
     [distinct(3, 4), r(3, 4)]),
    ("where", lambda c, a, b: torch.where(c, a, b), [boolean(3, 4), r(3, 4), r(4)]),
    ("clamp", lambda x: torch.clamp(x, -0.5, 0.7), [r(3, 4)]),
    ("compare", lambda a, b: (a < b, a <= 0.1, torch.eq(a, b), a != b, a > b, a >= b), [r(3, 4), r(3, 4)],
     {"grad": False}),
    ("logical", lambda a, b: (a & b, a | b, a ^ b, ~a), [boolean(3, 4), boolean(3, 4)], {"grad": False}),
    ("int_float_promotion", lambda i, x: i * x + i // 2 + i % 3, [ints(9, 3, 4), r(3, 4)]),
    ("remainder_fmod", lambda a: (torch.remainder(a, 0.7), torch.fmod(a, 0.7)), [r(3, 4)], {"grad": False}),
    ("masked_fill", lambda x, m: x.masked_fill(m, -2.0), [r(3, 4), boolean(3, 4)]),
    ("lerp_addcmul", lambda a, b, c: torch.lerp(a, b, 0.3) + torch.addcmul(a, b, c, value=0.5),
     [r(3, 4), r(3, 4), r(3, 4)]),
    # reductions
    ("sum", lambda x: (x.sum(), x.sum(dim=1), x.sum(dim=(0, 2), keepdim=True)), [r(2, 3, 4)]),
    ("mean", lambda x: (x.mean(), x.mean(dim=-1, keepdim=True)), [r(2, 3, 4)]),
    ("amax_amin", lambda x: (x.amax(dim=1), x.amin(dim=(0, 1))), [distinct(2, 3, 4)]),
    ("max_dim", lambda x: torch.max(x, dim=1), [distinct(3, 5)]),
    ("max_all", lambda x: x.max() + x.min(), [distinct(3, 5)]),
    ("argmax", lambda x: (x.argmax(dim=1), x.argmin(), x.argmax(dim=0, keepdim=True)), [distinct(3, 5)],
     {"grad": False}),
    ("var_std", lambda x: (x.var(dim=1), x.std(dim=0, unbiased=False), torch.var_mean(x, dim=1)),
     [r(4, 5)]),
    ("prod", lambda x: (x.prod(dim=1), x.prod()), [pos(3, 4)]),
    ("cumsum", lambda x: torch.cumsum(x, dim=1), [r(3, 5)]),
    ("logsumexp", lambda x: torch.logsumexp(x, dim=-1), [r(3, 5)]),
    ("any_all", lambda b: (b.any(), b.all(dim=1), b.any(dim=0, keepdim=True)), [boolean(3, 4)],
     {"grad": False}),
    # shapes and indexing
    ("view_permute", lambda x: x.view(4, 6).t().reshape(2, 12).permute(1, 0) * 1, [r(2, 3, 4)]),
    ("expand_unsqueeze_squeeze", lambda x: x.unsqueeze(0).expand(3, -1, -1).squeeze(2) * 1, [r(4, 1)]),
    ("cat_stack", lambda a, b: (torch.cat([a, b], dim=1), torch.stack([a, a * 2], dim=0)),
     [r(2, 3), r(2, 4)]),
    ("split_chunk", lambda x: (*x.split(2, dim=1), *x.chunk(2, dim=0)), [r(4, 5)]),
    ("slice_select", lambda x: (x[1:, ::2], x[:, -1], x[0, 1:3], x.narrow(1, 1, 2)), [r(3, 5)]),
    ("flip_roll_repeat", lambda x: (x.flip(0), x.roll(1, dims=1), x.repeat(2, 1)), [r(3, 4)]),
    ("pad", lambda x: (F.pad(x, (1, 2)), F.pad(x, (0, 0, 1, 1), value=0.5), F.pad(x, (-1, 1))), [r(3, 4)]),
    ("tril_triu", lambda x: (torch.tril(x), torch.triu(x, diagonal=1)), [r(4, 4)]),
    ("gather", lambda x, i: torch.gather(x, 1, i), [r(3, 5), ints(5, 3, 2)]),
    ("scatter", lambda x, i, s: (x.scatter(1, i, s), x.scatter_add(1, i, s)),
     [r(3, 5), lambda g: torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(3)]), r(3, 2)]),
    ("index", lambda x, i: (x[i], x[:, i], x[i, i]), [r(5, 5), ints(5, 3)]),
    ("index_select", lambda x, i: torch.index_select(x, 1, i), [r(3, 5), ints(5, 4)]),
    ("index_put", lambda x, i, v: x.index_put((i,), v, accumulate=True), [r(5, 3), ints(5, 4), r(4, 3)]),
    ("embedding", lambda w, i: F.embedding(i, w), [r(10, 4), ints(10, 2, 3)]),
    ("arange_full", lambda x: x + torch.arange(4) * 0.5 + torch.full((3, 1), 2.0) + torch.ones_like(x),
     [r(3, 4)]),
    ("to_dtype", lambda x: (x.to(torch.int64) + 1, x.double() * 2, (x > 0).float()), [r(3, 4)],
     {"grad": False}),
    # linear algebra
    ("mm", torch.mm, [r(3, 4), r(4, 5)]),
    ("bmm", torch.bmm, [r(2, 3, 4), r(2, 4, 5)]),
    ("matmul_broadcast", torch.matmul, [r(2, 1, 3, 4), r(3, 4, 2)]),
    ("linear", F.linear, [r(2, 3, 4), r(5, 4), r(5)]),
    ("einsum", lambda a, b: torch.einsum("bij,bjk->bik", a, b), [r(2, 3, 4), r(2, 4, 5)]),
    ("baddbmm", lambda c, a, b: torch.baddbmm(c, a, b, beta=0.5, alpha=2.0),
     [r(2, 3, 5), r(2, 3, 4), r(2, 4, 5)]),
    # neural-network ops
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (4,), w, b), [r(2, 3, 4), r(4), r(4)]),
    ("batch_norm_train", lambda x, w, b: F.batch_norm(x, torch.zeros(3), torch.ones(3), w, b, training=True),
     [r(4, 3, 2, 2), r(3), r(3)]),
    ("batch_norm_eval", lambda x, m, v, w, b: F.batch_norm(x, m.detach(), v.detach().abs() + 0.5, w, b),
     [r(4, 3, 2, 2), r(3), r(3), r(3), r(3)]),
    ("group_norm", lambda x, w, b: F.group_norm(x, 2, w, b), [r(2, 4, 3, 3), r(4), r(4)]),
    ("conv2d", lambda x, w, b: F.conv2d(x, w, b, padding=1), [r(2, 3, 5, 5), r(4, 3, 3, 3), r(4)]),
    ("conv2d_stride_dilation", lambda x, w: F.conv2d(x, w, stride=2, dilation=2),
     [r(1, 2, 7, 7), r(3, 2, 2, 2)]),
    ("conv2d_groups", lambda x, w: F.conv2d(x, w, groups=2, padding=(0, 1)), [r(1, 4, 4, 4), r(4, 2, 3, 3)]),
    ("conv1d", lambda x, w, b: F.conv1d(x, w, b, padding=1), [r(2, 3, 6), r(4, 3, 3), r(4)]),
    ("max_pool2d", lambda x: F.max_pool2d(x, 2), [distinct(2, 3, 4, 4)]),
    ("max_pool2d_pad_ceil", lambda x: F.max_pool2d(x, 3, stride=2, padding=1, ceil_mode=True),
     [distinct(1, 2, 6, 6)]),
    ("max_pool2d_relu_ties", lambda x: F.max_pool2d(F.relu(x), 2), [r(1, 2, 4, 4)]),
    ("avg_pool2d", lambda x: F.avg_pool2d(x, 2), [r(2, 3, 4, 4)]),
    ("avg_pool2d_pad", lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False),
     [r(1, 2, 5, 5)]),
    ("adaptive_avg_pool2d", lambda x: F.adaptive_avg_pool2d(x, 1), [r(2, 3, 4, 4)]),
    ("softmax", lambda x: (F.softmax(x, dim=-1), F.log_softmax(x, dim=0)), [r(3, 5)]),
    ("cross_entropy", lambda x, t: F.cross_entropy(x, t), [r(6, 5), ints(5, 6)]),
    ("cross_entropy_smoothing_ignore",
     lambda x, t: F.cross_entropy(x, t, ignore_index=0, label_smoothing=0.1),
     [r(6, 5), ints(5, 6)]),
    ("nll_mse_l1", lambda x, t, y: (F.nll_loss(F.log_softmax(x, 1), t), F.mse_loss(x, y), F.l1_loss(x, y)),
     [r(6, 5), ints(5, 6), r(6, 5)]),
    ("sdpa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
     [r(1, 2, 5, 4), r(1, 2, 5, 4), r(1, 2, 5, 4)]),
    ("sdpa_causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
     [r(2, 2, 6, 4), r(2, 2, 6, 4), r(2, 2, 6, 4)]),
    ("sdpa_mask",
     lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m | torch.eye(5, dtype=torch.bool)),
     [r(1, 2, 5, 4), r(1, 2, 5, 4), r(1, 2, 5, 3), boolean(5, 5)]),
    ("dropout_eval", lambda x: F.dropout(x, 0.5, training=False) * 2, [r(3, 4)]),
]

SAMPLE = int(os.environ.get("TILEFUSE_OPENCL_SAMPLE", "8"))


def _sampled_out(device, name) -> bool:
    return device.kind == "opencl" and SAMPLE > 1 and zlib.crc32(name.encode()) % SAMPLE != 0


def _as_list(out):
    from torch.utils._pytree import tree_leaves
    return tree_leaves(out)


def _close(got, want, what):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, eager {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, eager {tuple(want.shape)}"
    if want.dtype.is_floating_point:
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want), f"{what}: {got} != {want}"


@pytest.mark.parametrize("row", ROWS, ids=[row[0] for row in ROWS])
def test_aten_op(device, row):
    name, fn, makers, *opts = row
    opts = opts[0] if opts else {}
    if _sampled_out(device, name):
        pytest.skip(f"opencl runs a 1-in-{SAMPLE} sample of this table (TILEFUSE_OPENCL_SAMPLE=1: all)")
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    inputs = [m(g) for m in makers]
    grad = opts.get("grad", True)
    if grad:
        inputs = [x.requires_grad_() if x.dtype.is_floating_point else x for x in inputs]
    want = _as_list(fn(*inputs))
    got = _as_list(aot(fn, device)(*inputs))
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        _close(a.detach(), b.detach(), f"{name} output {k}")
    if not grad:
        return
    float_in = [x for x in inputs if x.requires_grad]
    outs = [(i, o) for i, o in enumerate(want) if o.requires_grad]
    cots = [torch.randn(o.shape, generator=g) for _, o in outs]
    want_g = torch.autograd.grad(sum((o * c).sum() for (_, o), c in zip(outs, cots)), float_in,
                                 allow_unused=True)
    got_g = torch.autograd.grad(sum((got[i] * c).sum() for (i, _), c in zip(outs, cots)), float_in,
                                allow_unused=True)
    for k, (a, b) in enumerate(zip(got_g, want_g)):
        if b is None:
            assert a is None or not a.abs().max(), f"{name}: gradient {k} should be zero"
            continue
        _close(a, b, f"{name} gradient of input {k}")


def test_every_row_names_ops_the_backend_has():
    """The table's ops are ones the backend maps (a row never passes by running eager code)."""
    assert len(ROWS) == len({row[0] for row in ROWS})
    assert "aten.convolution_backward.default" in tt.supported_ops()


def test_unsupported_op_is_a_clear_error(device):
    """An op without a rule (here aten.sort) fails at compile time naming the op and the user's
    line, before anything runs: no silent fallback to eager PyTorch."""
    def f(x):
        return torch.sort(x, dim=1).values * 2

    torch._dynamo.reset()
    x = torch.randn(3, 4)
    with pytest.raises(Exception) as info:
        torch.compile(f, backend=tt.backend(device=device))(x)
    msg = str(info.value)
    assert "aten.sort" in msg and "no rule" in msg and "test_torch_ops.py" in msg
    assert isinstance(info.value, A.UnsupportedOpError) or "UnsupportedOpError" in msg
