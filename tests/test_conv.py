"""tilefuse.nn.conv2d on every device: against a direct numpy convolution (a sum over kernel taps,
not im2col), finite differences for its gradients, vmap, and the shape errors.

Each test traces all its cases into one jitted function: one compile per device."""
from __future__ import annotations

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse import nn
from tilefuse.ir.errors import ShapeError, TilefuseError
from tilefuse.ir import primitives as P
from tilefuse.ir.passes import partition, run_passes
from tilefuse.ir.passes.conv import decomposed_graph as conv_decomposition

from conftest import assert_close


def np_conv2d(x, w, stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1), groups=1):
    """out[n, o, y, x] = sum over taps (i, j) and the group's channels c of
    w[o, c, i, j] * x_padded[n, c, y * sh + i * dh, x * sw + j * dw], in float64."""
    (sh, sw), (dh, dw) = stride, dilation
    xp = np.pad(np.asarray(x, np.float64), ((0, 0), (0, 0)) + tuple(padding))
    n, _, hp, wp = xp.shape
    o, cg, kh, kw = w.shape
    oh, ow = (hp - (kh - 1) * dh - 1) // sh + 1, (wp - (kw - 1) * dw - 1) // sw + 1
    og = o // groups
    out = np.zeros((n, o, oh, ow))
    for g in range(groups):
        for i in range(kh):
            for j in range(kw):
                win = xp[:, g * cg:(g + 1) * cg, i * dh:i * dh + (oh - 1) * sh + 1:sh,
                         j * dw:j * dw + (ow - 1) * sw + 1:sw]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", win,
                                                         w[g * og:(g + 1) * og, :, i, j])
    return out


# (x shape, w shape, conv2d keywords, the same as explicit numpy arguments)
CASES = [
    ((2, 3, 7, 6), (4, 3, 3, 3), dict(padding=1), dict(padding=((1, 1), (1, 1)))),
    ((1, 4, 9, 8), (6, 2, 3, 2), dict(stride=2, padding=(1, 0), groups=2),  # non-square, groups
     dict(stride=(2, 2), padding=((1, 1), (0, 0)), groups=2)),
    ((1, 2, 8, 9), (3, 2, 2, 3), dict(stride=(1, 2), padding=((2, 0), (1, 1)), dilation=(2, 1)),
     dict(stride=(1, 2), padding=((2, 0), (1, 1)), dilation=(2, 1))),
    ((2, 4, 5, 5), (5, 4, 1, 1), dict(stride=2, padding="VALID"), dict(stride=(2, 2))),  # 1x1
    ((1, 6, 6, 7), (6, 1, 3, 3), dict(padding="SAME", groups=6),  # depthwise
     dict(padding=((1, 1), (1, 1)), groups=6)),
    ((1, 3, 7, 8), (2, 3, 3, 4), dict(padding="SAME", stride=2, dilation=2),
     dict(stride=(2, 2), padding=((2, 2), (2, 3)), dilation=(2, 2))),
]


def _data(rng, cases, dtype=np.float32):
    return [(rng.standard_normal(xs).astype(dtype), rng.standard_normal(ws).astype(dtype))
            for xs, ws, _, _ in cases]


def test_conv2d_matches_numpy(device, rng):
    data = _data(rng, CASES)
    # and vmap over a leading axis of x (the weights shared): a conv per example
    xs = rng.standard_normal((3, 2, 4, 6, 5)).astype(np.float32)
    w = rng.standard_normal((4, 2, 3, 2)).astype(np.float32)

    @tx.jit
    def convs(data, xs):
        batched = tx.vmap(lambda x: nn.conv2d(x, w, stride=(2, 1), padding=1, groups=2))(xs)
        return [nn.conv2d(x, w, **kw) for (x, w), (_, _, kw, _) in zip(data, CASES)], batched

    outs, batched = convs(data, xs)
    for out, (x, w_), (_, _, _, np_kw) in zip(outs, data, CASES):
        assert_close(out, np_conv2d(x, w_, **np_kw), np.float32, rtol=1e-4, atol=1e-4)
    for b in range(3):
        assert_close(np.asarray(batched)[b], np_conv2d(xs[b], w, (2, 1), ((1, 1), (1, 1)), groups=2),
                     np.float32, rtol=1e-4, atol=1e-4)


def test_conv2d_gradients(device, rng):
    # one conv with every option (one compile): stride, uneven padding, dilation, groups, a
    # non-square kernel
    x, w = rng.standard_normal((2, 4, 7, 8)), rng.standard_normal((4, 2, 3, 2))

    def conv(x, w):
        return nn.conv2d(x, w, stride=(2, 1), padding=((1, 0), (2, 1)), dilation=(1, 2), groups=2)

    tx.check_grads(tx.jit(conv), (x, w), modes=("rev",), atol=1e-6, rtol=1e-6)


def test_the_implicit_gemm_runs_convolutions_their_gradients_and_vmap(device, rng):
    """Sizes past the GEMM's threshold: the forward, both cotangent convolutions (lhs dilation for
    the strided forward's input gradient, the filter gradient's images in the columns) and the
    batching rule's feature groups all run as the implicit GEMM on every device that prints tile
    kernels, and agree with the numpy reference through jit(grad) and vmap."""
    x = rng.standard_normal((2, 8, 24, 24)).astype(np.float32)
    w = (rng.standard_normal((16, 4, 3, 3)) / 6).astype(np.float32)
    xs = rng.standard_normal((3, 1, 8, 10, 10)).astype(np.float32)
    ws = (rng.standard_normal((3, 16, 8, 3, 3)) / 8).astype(np.float32)

    def loss(x, w):
        y = nn.conv2d(x, w, stride=2, padding=1, groups=2)
        y = nn.conv2d(tnp.tanh(y), w, padding="SAME", groups=4)
        return tnp.sum(y * y)

    def f(x, w, xs, ws):
        per_example = tx.vmap(lambda x, w: nn.conv2d(x, w, padding=1))(xs, ws)
        return tx.value_and_grad(loss, argnums=(0, 1))(x, w), per_example
    got = tx.jit(f, device=device)(x, w, xs, ws)
    want = tx.jit(f, device="ref")(x, w, xs, ws)
    for g, r in zip(tx.tree_util.tree_leaves(got), tx.tree_util.tree_leaves(want)):
        r = np.asarray(r)
        assert_close(g, r, np.float32, rtol=2e-4, atol=2e-4 * float(np.abs(r).max()))
    if device.backend.tile_kernels:
        impls = [(l.kind, l.impl) for l in tx.jit(f, device=device).lower(x, w, xs, ws).compile().program.launches
                 if l.kind in ("conv", "fused_conv")]
        assert len(impls) == 7 and {i for _, i in impls} == {"tile_gemm"}, impls
        assert ("fused_conv", "tile_gemm") in impls, impls  # tanh(y), y * 2 * ...: epilogues


def test_nhwc_convolutions_run_as_the_implicit_gemm_in_rows_it_reads_whole(device, rng):
    """Flax's layouts (NHWC, HWIO): the conv_layouts pass gives the implicit GEMM an lhs with
    contiguous rows and contiguous output positions (one transpose each way, exact); forward and
    gradients against the reference."""
    x = rng.standard_normal((2, 18, 18, 8)).astype(np.float32)
    w = (rng.standard_normal((3, 3, 8, 16)) / 8).astype(np.float32)

    def f(x, w):
        y = tx.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return tnp.sum(tnp.tanh(y) ** 2)
    g = tx.value_and_grad(f, argnums=(0, 1))
    got, want = tx.jit(g, device=device)(x, w), tx.jit(g, device="ref")(x, w)
    for a, b in zip(tx.tree_util.tree_leaves(got), tx.tree_util.tree_leaves(want)):
        assert_close(a, b, np.float32, rtol=1e-4, atol=1e-4 * float(np.abs(np.asarray(b)).max()))
    convs = [e for e in run_passes(tx.make_graph(g)(x, w)).eqns if e.prim is P.conv]
    assert len(convs) == 3
    for e in convs:
        ls, _, os_ = e.params["dimension_numbers"]
        assert ls[-1] == 3 and tuple(os_[2:]) == (2, 3), e.params["dimension_numbers"]


def _fused_convs(fn, *args):
    return [e for e in run_passes(tx.make_graph(fn)(*args)).eqns if e.prim in (P.conv, P.fused_conv)]


def test_a_convolution_and_its_epilogue_are_one_kernel(device, rng):
    """ResNet's block: conv + bias per channel (b[None, :, None, None] or a reshape) + relu + the
    residual is one fused_conv whose extras are the bias vector and the residual, on every device
    against float64; NHWC's bias (along the last axis) too. A broadcast along another axis
    (a per-row value) is not a per-feature vector: it stays out of the epilogue."""
    x = (rng.standard_normal((2, 8, 12, 12)) * np.exp(rng.uniform(-3, 3, (2, 8, 12, 12)))).astype(np.float32)
    w = (rng.standard_normal((16, 8, 3, 3)) / 8).astype(np.float32)
    b, r = rng.standard_normal(16).astype(np.float32), rng.standard_normal((2, 16, 12, 12)).astype(np.float32)
    row = rng.standard_normal(12).astype(np.float32)
    xh, wh = np.transpose(x, (0, 2, 3, 1)).copy(), np.transpose(w, (2, 3, 1, 0)).copy()

    def block(x, w, b, r):
        return tnp.maximum(nn.conv2d(x, w, padding=1) + b[None, :, None, None], 0) + r

    def reshaped_bias(x, w, b):
        return tnp.tanh(nn.conv2d(x, w, padding=1) + tnp.reshape(b, (1, 16, 1, 1)))

    def nhwc(x, w, b):
        y = tx.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return tnp.maximum(y + b, 0)

    def per_row(x, w, row):
        return nn.conv2d(x, w, padding=1) * row[None, None, :, None]

    for fn, args, n_extras in ((block, (x, w, b, r), 2), (reshaped_bias, (x, w, b), 1)):
        (e,) = _fused_convs(fn, *args)
        assert e.prim is P.fused_conv and len(e.inputs) == 2 + n_extras, e
        assert e.inputs[2].aval.shape == (16,), e  # the bias as a vector, not broadcast out
    (e,) = _fused_convs(per_row, x, w, row)
    assert e.prim is P.conv, e

    want = np.maximum(np_conv2d(x, w, padding=((1, 1), (1, 1))) + b[None, :, None, None], 0)
    got = tx.jit(lambda *a: (block(*a), reshaped_bias(*a[:3]), nhwc(xh, wh, b), per_row(x, w, row)),
                 device=device)(x, w, b, r)
    scale = float(np.abs(want).max())
    assert_close(got[0], want + r, np.float32, rtol=1e-4, atol=1e-5 * scale)
    assert_close(got[1], np.tanh(np_conv2d(x, w, padding=((1, 1), (1, 1))) + b[None, :, None, None]),
                 np.float32, rtol=1e-4, atol=1e-5 * scale)
    assert_close(got[2], np.transpose(want, (0, 2, 3, 1)), np.float32, rtol=1e-4, atol=1e-5 * scale)
    assert_close(got[3], np_conv2d(x, w, padding=((1, 1), (1, 1))) * row[None, None, :, None], np.float32,
                 rtol=1e-4, atol=1e-5 * scale * float(np.abs(row).max()))


def test_conv_is_one_primitive_and_its_gradients_are_convolutions():
    """conv2d binds one conv; grad gives two more (the input's and the filter's cotangents), and
    no im2col: the implicit GEMM reads the windows where they lie."""
    x, w = np.ones((2, 4, 6, 6), np.float32), np.ones((4, 2, 3, 3), np.float32)

    def f(x, w):
        return nn.conv2d(x, w, stride=2, padding=1, groups=2)
    for fn, n_convs in ((f, 1), (tx.grad(lambda x, w: tnp.sum(f(x, w) ** 2), argnums=(0, 1)), 3)):
        kinds = [r.kind for r in partition(run_passes(tx.make_graph(fn)(x, w)))]
        convs = kinds.count("conv") + kinds.count("fused_conv")  # y * 2: the forward's epilogue under grad
        assert convs == n_convs and "concatenate" not in kinds and "dot_general" not in kinds, kinds


def test_the_composite_reads_the_windows_in_place():
    """The decomposition (the composite implementation's) is the explicit im2col: the strided
    windows are read by the concatenate's kernels (one pass over the patch matrix), no
    index-map-only kernel writes a window, and the GEMM stays a dot_general for the shared GEMM."""
    x, w = np.ones((2, 4, 6, 6), np.float32), np.ones((4, 2, 3, 3), np.float32)
    (eqn,) = [e for e in tx.make_graph(lambda x, w: nn.conv2d(x, w, stride=2, padding=1, groups=2))(x, w).eqns
              if e.prim is P.conv]
    regions = partition(run_passes(conv_decomposition(eqn)))
    kinds = [r.kind for r in regions]
    assert kinds.count("dot_general") == 1, kinds
    assert not any(r.kind == "fused" and {e.prim.name for e in r.eqns} & {"slice"} and
                   all(e.prim.name in ("slice", "transpose", "reshape") for e in r.eqns)
                   for r in regions), [str(r) for r in regions]
    (concat,) = [r for r in regions if r.kind == "concatenate"]
    assert [e.prim.name for e in concat.eqns].count("slice") == 9


def test_conv2d_shape_errors():
    x = np.ones((1, 4, 5, 5), np.float32)
    with pytest.raises(ShapeError, match=r"w has 3 input channels.*x \(1, 4, 5, 5\), w \(2, 3, 3, 3\)"):
        nn.conv2d(x, np.ones((2, 3, 3, 3), np.float32))
    with pytest.raises(ShapeError, match=r"groups=3 must .* dividing the input channels 4"):
        nn.conv2d(x, np.ones((3, 1, 3, 3), np.float32), groups=3)
    with pytest.raises(ShapeError, match=r"output channels 3"):
        nn.conv2d(x, np.ones((3, 2, 3, 3), np.float32), groups=2)
    with pytest.raises(ShapeError, match=r"kernel \(6, 3\) .* more than the padded input \(5, 5\)"):
        nn.conv2d(x, np.ones((2, 4, 6, 3), np.float32))
    with pytest.raises(ShapeError, match=r"spans \(7, 7\) with dilation \(3, 3\).*\(6, 6\)"):
        nn.conv2d(x, np.ones((2, 4, 3, 3), np.float32), dilation=3, padding=((1, 0), (0, 1)))
    with pytest.raises(ShapeError, match=r"x must be \(N, C, H, W\)"):
        nn.conv2d(x[0], np.ones((2, 4, 3, 3), np.float32))
    with pytest.raises(TilefuseError, match="stride"):
        nn.conv2d(x, np.ones((2, 4, 3, 3), np.float32), stride=0)
    with pytest.raises(TilefuseError, match="padding"):
        nn.conv2d(x, np.ones((2, 4, 3, 3), np.float32), padding="FULL")
