"""GEMM: the CPU template (backends/llvm/gemm.py) and numpy's BLAS against numpy, transposed and
batched operands read in place, 16-bit inputs, and the epilogue fusion pass
(ir/passes/gemm_epilogue.py): where it fires, what it computes, where it must not fire."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from tilefuse.ir.errors import ShapeError
from tilefuse.ir.passes import run_passes
from tilefuse.validate.primitives import epilogue_fn

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse import nn

F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)

# (M, N, K): 1..1023, primes, edges of the micro-tile (12 x 32) and of the K block (512)
SHAPES = [(1, 1, 1), (2, 3, 5), (7, 13, 11), (12, 32, 512), (13, 33, 513), (31, 37, 41),
          (64, 64, 64), (97, 101, 103), (255, 129, 67), (1023, 17, 33), (37, 1023, 19),
          (23, 29, 1023), (300, 70, 600)]


@pytest.fixture
def gemm_mode():
    """Set tx.config.gemm for one test; restored after."""
    old = tx.config.gemm
    yield lambda mode: setattr(tx.config, "gemm", mode)
    tx.config.gemm = old


def _impls(f, *args, device=None) -> list[str]:
    """The implementations the dispatcher chose for f's GEMM kernels (default device: None)."""
    prog = tx.jit(f, device=device).lower(*args).compile().program
    return [l.impl for l in prog.launches if l.kind in ("dot_general", "fused_gemm")]


def _check(got, want, k: int, dtype=F32):
    tol = {F32: 2e-6, F16: 2e-3, BF16: 1.6e-2}[np.dtype(dtype)] * math.sqrt(max(k, 1)) * 4
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)


def _modes(device):
    return ("generated", "vendor") if device.kind == "cpu" else ("auto",)


def test_gemm_matches_numpy_over_shapes(device, gemm_mode, rng):
    shapes = SHAPES if device.kind != "opencl" else SHAPES[::3]  # PoCL builds each in 0.5 s
    for mode in _modes(device):
        gemm_mode(mode)
        for m, n, k in shapes:
            a = rng.standard_normal((m, k)).astype(F32)
            b = rng.standard_normal((k, n)).astype(F32)
            _check(tx.jit(tnp.matmul)(a, b), a @ b, k)
        if device.kind == "cpu":
            assert set(_impls(tnp.matmul, a, b)) == {f"{mode}_gemm"}


def test_transposed_and_batched_operands_read_in_place(device, gemm_mode, rng):
    a = rng.standard_normal((37, 70)).astype(F32)
    b = rng.standard_normal((70, 45)).astype(F32)
    q = rng.standard_normal((2, 3, 33, 16)).astype(F32)
    kk = rng.standard_normal((2, 3, 40, 16)).astype(F32)
    cases = [
        (lambda a, b: tnp.matmul(a.T.T, b), (a, b), a @ b, 70),
        (lambda a, b: tnp.matmul(a, b.T), (a, b.T.copy()), a @ b, 70),
        (lambda a, b: tnp.matmul(a.T, b), (a.T.copy(), b), a @ b, 70),
        (lambda a, b: tnp.matmul(a.T, b.T), (a.T.copy(), b.T.copy()), a @ b, 70),
        (lambda q, k: tnp.einsum("bhsd,bhtd->bhst", q, k), (q, kk), np.einsum("bhsd,bhtd->bhst", q, kk), 16),
        (lambda q, k: tnp.matmul(q, tnp.swapaxes(k, -1, -2)), (q, kk), q @ np.swapaxes(kk, -1, -2), 16),
        (lambda x, w: tnp.matmul(x, w), (q, a[:16, :20].copy()), q @ a[:16, :20], 16),
    ]
    for mode in _modes(device):
        gemm_mode(mode)
        for f, args, want, k in cases:
            _check(tx.jit(f)(*args), want, k)
            if device.kind == "cpu":  # no transpose copy: the template (or BLAS) reads strides
                g = run_passes(tx.make_graph(f)(*args))
                assert [e.prim.name for e in g.eqns] == ["dot_general"], g
                assert _impls(f, *args) == [f"{mode}_gemm"]


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_16_bit_inputs_accumulate_in_float32(device, gemm_mode, rng, dtype):
    a = rng.standard_normal((45, 300)).astype(dtype)
    b = rng.standard_normal((300, 50)).astype(dtype)
    want = a.astype(F32) @ b.astype(F32)
    for mode in _modes(device):
        gemm_mode(mode)
        _check(tx.jit(tnp.matmul)(a, b), want, 300, dtype)


def _gelu_tanh(y):
    return 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3)))


def _gelu_erf(y):
    return 0.5 * y * (1 + np.vectorize(math.erf)(y / math.sqrt(2)))


def _epilogue(f):
    """The epilogue the pass must make: f of (product, *extras) traced over 0-d float32 values."""
    return epilogue_fn(f, f.__code__.co_argcount)


# (name, tilefuse function, numpy of the same expression, the epilogue the pass must make: the
# user's expression itself, over the product and the extras in the order it reads them)
EPILOGUES = [
    ("bias", lambda x, w, b, r: tnp.matmul(x, w) + b, lambda y, b, r: y + b, lambda y, b: y + b),
    ("bias_first", lambda x, w, b, r: b + tnp.matmul(x, w), lambda y, b, r: y + b, lambda y, b: b + y),
    ("relu", lambda x, w, b, r: nn.relu(tnp.matmul(x, w) + b), lambda y, b, r: np.maximum(y + b, 0),
     lambda y, b: nn.relu(y + b)),
    ("gelu_tanh", lambda x, w, b, r: nn.gelu(tnp.matmul(x, w) + b), lambda y, b, r: _gelu_tanh(y + b),
     lambda y, b: nn.gelu(y + b)),
    ("gelu_erf", lambda x, w, b, r: nn.gelu(tnp.matmul(x, w) + b, approximate=False),
     lambda y, b, r: _gelu_erf(y + b), lambda y, b: nn.gelu(y + b, approximate=False)),
    ("silu", lambda x, w, b, r: nn.silu(tnp.matmul(x, w) + b), lambda y, b, r: (y + b) / (1 + np.exp(-y - b)),
     lambda y, b: nn.silu(y + b)),
    ("residual", lambda x, w, b, r: r + tnp.matmul(x, w), lambda y, b, r: y + r, lambda y, r: r + y),
    ("gelu_residual", lambda x, w, b, r: nn.gelu(tnp.matmul(x, w) + b) + r,
     lambda y, b, r: _gelu_tanh(y + b) + r, lambda y, b, r: nn.gelu(y + b) + r),
    # the classic bug: a scale outside the bias is a*(xW + b), not a*xW + b
    ("scale_of_biased", lambda x, w, b, r: 0.5 * (tnp.matmul(x, w) + b), lambda y, b, r: 0.5 * (y + b),
     lambda y, b: 0.5 * (y + b)),
    ("scale_then_bias", lambda x, w, b, r: tnp.matmul(x, w) / 4.0 + b, lambda y, b, r: y / 4 + b,
     lambda y, b: y / 4.0 + b),
    ("relu_where", lambda x, w, b, r: tnp.where(tnp.matmul(x, w) > 0, tnp.matmul(x, w), 0.0),
     lambda y, b, r: np.maximum(y, 0), lambda y: tnp.where(y > 0, y, 0.0)),
    # what a closed list of activations missed (issue 18): any elementwise function is an epilogue
    ("clamp_large", lambda x, w, b, r: tnp.minimum(tnp.matmul(x, w), 3.0), lambda y, b, r: np.minimum(y, 3.0),
     lambda y: tnp.minimum(y, 3.0)),
    ("clip", lambda x, w, b, r: tnp.clip(tnp.matmul(x, w) + b, -2.5, 2.5), lambda y, b, r: np.clip(y + b, -2.5, 2.5),
     lambda y, b: tnp.clip(y + b, -2.5, 2.5)),
    ("sin", lambda x, w, b, r: tnp.sin(tnp.matmul(x, w)), lambda y, b, r: np.sin(y), lambda y: tnp.sin(y)),
    ("leaky_where_residual", lambda x, w, b, r: tnp.where(tnp.matmul(x, w) + r > 0, tnp.matmul(x, w) + r,
                                                          0.01 * (tnp.matmul(x, w) + r)),
     lambda y, b, r: np.where(y + r > 0, y + r, 0.01 * (y + r)), None),
    ("floor_cast", lambda x, w, b, r: tnp.floor(tnp.matmul(x, w)).astype(tnp.int32).astype(tnp.float32) * 0.5,
     lambda y, b, r: np.floor(y) * 0.5, None),
    ("masked_by_comparison", lambda x, w, b, r: tnp.matmul(x, w) * (r > 0).astype(tnp.float32),
     lambda y, b, r: y * (r > 0), None),
]


def test_epilogue_rewrites_fire_and_compute_the_unfused_result(device, gemm_mode, rng):
    x = rng.standard_normal((3, 50, 40)).astype(F32)  # K = 40; batch and rows merge to M = 150
    w = rng.standard_normal((40, 70)).astype(F32)
    b = rng.standard_normal(70).astype(F32)
    r = rng.standard_normal((3, 50, 70)).astype(F32)
    for mode in _modes(device):
        gemm_mode(mode)
        for name, f, ref, epilogue in EPILOGUES:
            g = run_passes(tx.make_graph(f)(x, w, b, r))
            fused = [e for e in g.eqns if e.prim.name == "fused_gemm"]
            assert len(fused) == 1, (name, g)
            if epilogue is not None:
                assert fused[0].params["epilogue"] == _epilogue(epilogue), (name, g)
            _check(tx.jit(f)(x, w, b, r), ref(x @ w, b, r), 40)
            if device.kind == "cpu":
                assert _impls(f, x, w, b, r) == [f"{mode}_gemm"], name
            elif device.kind == "opencl":  # the tiled GEMM with the epilogue in its store
                assert _impls(f, x, w, b, r) == ["tile_gemm"], name


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e2, 1e4])
def test_epilogue_holds_over_magnitudes(device, scale):
    """Issue 18's silent wrong result: minimum(x @ w, 100) and clip(x @ w, -50, 50) with products
    of 640 were taken for the identity (a closed list checked on values in [-30, 30])."""
    x = np.full((4, 8), 2.0, F32)
    w = np.full((8, 4), 40.0, F32)
    assert float(tx.jit(lambda x, w: tnp.minimum(x @ w, 100.0))(x, w)[0, 0]) == 100.0
    assert float(tx.jit(lambda x, w: tnp.clip(x @ w, -50.0, 50.0))(x, w)[0, 0]) == 50.0
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((9, 16)) * scale).astype(F32)
    w = rng.standard_normal((16, 12)).astype(F32)
    lo, hi = -0.3 * scale, 0.7 * scale
    fs = [(lambda x, w: tnp.clip(x @ w, lo, hi), lambda y: np.clip(y, lo, hi)),
          (lambda x, w: tnp.maximum(x @ w * 0.5, lo) - hi, lambda y: np.maximum(y * 0.5, lo) - hi),
          (lambda x, w: tnp.where(x @ w > hi, hi, x @ w), lambda y: np.where(y > hi, hi, y))]
    for f, ref in fs:
        want = ref(x.astype(np.float64) @ w.astype(np.float64))
        np.testing.assert_allclose(np.asarray(tx.jit(f)(x, w), np.float64), want, rtol=1e-5, atol=1e-5 * scale)


def test_epilogue_after_a_k_blocked_product_and_on_16_bit_outputs(device, gemm_mode, rng):
    """K > KC (512): the epilogue follows the last block's update; bfloat16 keeps one K block."""
    for dtype in (F32, BF16):
        x = rng.standard_normal((70, 700)).astype(dtype)
        w = (rng.standard_normal((700, 90)) / 20).astype(dtype)
        b = rng.standard_normal(90).astype(dtype)
        f = lambda x, w, b: nn.gelu(tnp.matmul(x, w) + b)
        want = _gelu_tanh(x.astype(F32) @ w.astype(F32) + b.astype(F32))
        for mode in _modes(device):
            gemm_mode(mode)
            _check(tx.jit(f)(x, w, b), want, 700, dtype)


# (name, function): the rewrite must leave the dot_general alone
NOT_FUSED = [
    ("column_bias", lambda x, w, c: tnp.matmul(x, w) + c),               # (M, 1): not along the rows
    ("product_read_twice", lambda x, w, c: (tnp.matmul(x, w) + 1.0, tnp.matmul(x, w) * 2.0)),
    ("product_is_an_output", lambda x, w, c: (nn.relu(tnp.matmul(x, w)), tnp.matmul(x, w))),
    ("other_dtype_extra", lambda x, w, c: tnp.matmul(x, w) + tnp.ones((6, 4), tnp.float64)),
]


def test_epilogue_rewrite_does_not_fire_when_wrong(rng):
    x = rng.standard_normal((6, 5)).astype(F32)
    w = rng.standard_normal((5, 4)).astype(F32)
    c = rng.standard_normal((6, 1)).astype(F32)
    for name, f in NOT_FUSED:
        g = run_passes(tx.make_graph(f)(x, w, c))
        assert not [e for e in g.eqns if e.prim.name == "fused_gemm"], (name, g)
        got = tx.jit(f, device="cpu")(x, w, c)
        want = tx.jit(f, device="ref")(x, w, c)
        for a, b in zip(*((o if isinstance(o, tuple) else (o,)) for o in (got, want))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_mismatched_contraction_is_a_shape_error_naming_both_shapes():
    a, b = np.ones((3, 4), F32), np.ones((5, 6), F32)
    with pytest.raises(ShapeError, match=r"\(3, 4\).*\(5, 6\)"):
        tx.jit(tnp.matmul)(a, b)


def test_gemm_setting_is_checked(gemm_mode):
    gemm_mode("fastest")
    a = np.ones((64, 64), F32)
    with pytest.raises(ValueError, match="generated"):
        tx.jit(tnp.matmul, device="cpu")(a, a)


def test_auto_takes_the_generic_kernel_for_tiny_products_and_measures_the_rest(gemm_mode, rng):
    gemm_mode("auto")
    tiny = rng.standard_normal((4, 4)).astype(F32)
    big = rng.standard_normal((96, 96)).astype(F32)
    half = big.astype(BF16)
    assert _impls(tnp.matmul, tiny, tiny, device="cpu") == ["kernel_ir"]
    assert _impls(tnp.matmul, half, half, device="cpu") == ["generated_gemm"]  # no 16-bit BLAS
    assert _impls(tnp.matmul, big, big, device="cpu")[0] in ("generated_gemm", "vendor_gemm")


@pytest.mark.parametrize("pack_a", [True, False])
def test_a_packed_or_read_in_place_computes_the_same(rng, pack_a):
    """Both ways of reading A (gemm.reads_a_in_place), over ragged micro-tiles and K blocks, a
    batch split over threads and a transposed B; A ends at its buffer's end (rows past M are
    never read in place)."""
    from dataclasses import replace

    from tilefuse.backends.llvm import gemm
    cpu = tx.get_device("cpu")
    p = replace(gemm.default_gemm_params(cpu.info), kc=64, mc=gemm.default_gemm_params(cpu.info).mr * 2,
                threads=2, pack_a=pack_a)
    # a packed row-major A and a transposed B are transposed in registers a LANES x LANES square
    # at a time: K blocks with and without a remainder past the last square, full and partial panels
    for (batch, m, n, k), bt in [((1, 13, 33, 129), False), ((3, 101, 47, 80), True), ((2, 25, 64, 64), False),
                                 ((1, 30, 70, 75), True)]:
        a = rng.standard_normal((batch, m, k)).astype(F32)
        b = rng.standard_normal((batch, n, k) if bt else (batch, k, n)).astype(F32)
        f = (lambda a, b: tnp.matmul(a, tnp.swapaxes(b, 1, 2))) if bt else tnp.matmul
        want = a @ (b.transpose(0, 2, 1) if bt else b)
        prog = tx.jit(f, device=cpu).lower(a, b).compile().program
        (launch,) = [l for l in prog.launches if l.kind == "dot_general"]
        run = gemm.build_gemm(launch.kernel, cpu, cpu.backend, p)
        assert gemm.reads_a_in_place(run.prob, p, cpu.info) == (not pack_a)
        out = np.zeros(want.shape, F32)
        run([a.view(np.uint8).reshape(-1), b.view(np.uint8).reshape(-1), out.view(np.uint8).reshape(-1)])
        _check(out, want, k)


def test_a_is_read_in_place_by_default_unless_its_rows_share_l1_sets():
    from dataclasses import replace

    from tilefuse.backends.llvm import gemm
    from tilefuse.runtime.hardware import host_info
    info = replace(host_info(), l1_bytes=32 << 10)  # 64 sets of 8 ways
    p = gemm.GemmParams(mr=12, nr=32, lanes=16)

    def prob(k, in_dtype=F32, a_k_stride=1):
        return gemm.GemmProblem(1, 2048, 128, k, (0, k, a_k_stride), (0, 128, 1), np.dtype(in_dtype),
                                F32, None, (), (("lhs",), ("rhs",)))
    assert gemm.reads_a_in_place(prob(128), p, info)       # rows 512 B apart: all in distinct sets
    assert gemm.reads_a_in_place(prob(512), p, info)       # 2 KiB apart: two sets, 6 rows each
    assert not gemm.reads_a_in_place(prob(1024), p, info)  # 4 KiB apart: 12 rows in one set
    assert not gemm.reads_a_in_place(prob(128, BF16), p, info)  # 16-bit A is converted by packing
    assert not gemm.reads_a_in_place(prob(128, a_k_stride=2048), p, info)  # neither axis contiguous

    def transposed(m, n):  # A's rows contiguous: in place where packing would not pay
        return gemm.GemmProblem(1, m, n, 2048, (0, 1, m), (0, n, 1), F32, F32, None, (), (("lhs",), ("rhs",)))
    two = replace(p, threads=2)
    assert gemm.reads_a_in_place(transposed(512, 128), two, info)      # four column panels per block
    assert gemm.reads_a_in_place(transposed(64, 1024), two, info)      # N split: each thread would pack A
    assert not gemm.reads_a_in_place(transposed(2048, 1024), two, info)  # 32 panels repay the packing
    assert not gemm.reads_a_in_place(prob(128), replace(p, pack_a=True), info)
    assert gemm.reads_a_in_place(prob(1024), replace(p, pack_a=False), info)


def test_params_from_device_info_and_explicit_params(rng):
    from tilefuse.backends.llvm import gemm
    from tilefuse.runtime.hardware import host_info
    p = gemm.default_gemm_params(host_info())
    assert p.nr == 2 * p.lanes and p.mc % p.mr == 0 and p.nc % p.nr == 0
    small = gemm.GemmParams(mr=4, nr=p.lanes, lanes=p.lanes, kc=16, mc=8, nc=p.lanes * 2, threads=2)
    a = rng.standard_normal((3, 101, 80)).astype(F32)  # odd batch: the rows are split over threads
    b = rng.standard_normal((3, 80, 90)).astype(F32)
    cpu = tx.get_device("cpu")
    prog = tx.jit(tnp.matmul, device=cpu).lower(a, b).compile().program
    (launch,) = [l for l in prog.launches if l.kind == "dot_general"]
    run = gemm.build_gemm(launch.kernel, cpu, cpu.backend, small)
    out = np.zeros((3, 101, 90), F32)
    run([a.view(np.uint8).reshape(-1), b.view(np.uint8).reshape(-1), out.view(np.uint8).reshape(-1)])
    _check(out, a @ b, 80)
