"""GEMM: the shared builder (ir/kernel/gemm.py, on every device that prints tile kernels) and, on
the CPU, numpy's BLAS against numpy, transposed and batched operands read in place, 16-bit inputs,
the packed form's schedules, and the epilogue fusion pass (ir/passes/gemm_epilogue.py): where it
fires, what it computes, where it must not fire."""
from __future__ import annotations

import math
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from tilefuse.ir.core import ShapedArray
from tilefuse.ir.errors import ShapeError
from tilefuse.ir.passes import run_passes
from tilefuse.validate.primitives import epilogue_fn

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse import nn
from tilefuse.runtime.hardware import target_of

F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)

# (M, N, K): 1..1023, primes, edges of the register tile (12 x 32) and of a K block (512)
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


IMPL = {"generated": "tile_gemm", "vendor": "vendor_gemm"}  # on the CPU, by tx.config.gemm


def test_gemm_matches_numpy_over_shapes(device, gemm_mode, rng):
    shapes = SHAPES if device.kind != "opencl" else SHAPES[::3]  # PoCL builds each in 0.5 s
    for mode in _modes(device):
        gemm_mode(mode)
        for m, n, k in shapes:
            a = rng.standard_normal((m, k)).astype(F32)
            b = rng.standard_normal((k, n)).astype(F32)
            _check(tx.jit(tnp.matmul)(a, b), a @ b, k)
        if device.kind == "cpu":
            assert set(_impls(tnp.matmul, a, b)) == {IMPL[mode]}


def test_transposed_and_batched_operands_read_in_place(device, gemm_mode, rng):
    # (products over tiled.MIN_FLOPS: smaller ones take the generic kernel)
    a = rng.standard_normal((37, 70)).astype(F32)
    b = rng.standard_normal((70, 64)).astype(F32)
    q = rng.standard_normal((2, 3, 33, 16)).astype(F32)
    kk = rng.standard_normal((2, 3, 48, 16)).astype(F32)
    cases = [
        (lambda a, b: tnp.matmul(a.T.T, b), (a, b), a @ b, 70),
        (lambda a, b: tnp.matmul(a, b.T), (a, b.T.copy()), a @ b, 70),
        (lambda a, b: tnp.matmul(a.T, b), (a.T.copy(), b), a @ b, 70),
        (lambda a, b: tnp.matmul(a.T, b.T), (a.T.copy(), b.T.copy()), a @ b, 70),
        (lambda q, k: tnp.einsum("bhsd,bhtd->bhst", q, k), (q, kk), np.einsum("bhsd,bhtd->bhst", q, kk), 16),
        (lambda q, k: tnp.matmul(q, tnp.swapaxes(k, -1, -2)), (q, kk), q @ np.swapaxes(kk, -1, -2), 16),
        (lambda x, w: tnp.matmul(x, w), (q, a[:16, :45].copy()), q @ a[:16, :45], 16),
    ]
    for mode in _modes(device):
        gemm_mode(mode)
        for f, args, want, k in cases:
            _check(tx.jit(f)(*args), want, k)
            if device.kind == "cpu":  # no transpose copy: the shared GEMM (or BLAS) reads strides
                g = run_passes(tx.make_graph(f)(*args))
                assert [e.prim.name for e in g.eqns] == ["dot_general"], g
                assert _impls(f, *args) == [IMPL[mode]]


def test_operands_whose_axes_do_not_collapse_are_transposed_for_the_gemm(device, rng):
    """einsum('ok,nkp->nop') (a weight applied to a batch of matrices) and a batch axis in the
    middle of the rhs: no strided GEMM reads those operands as they lie, so dot_layouts transposes
    them once and the GEMM takes the product (it ran as the generic kernel, 7x slower); with an
    epilogue too, under grad (whose cotangent products have the same shapes), on every device."""
    w = rng.standard_normal((48, 40)).astype(F32)
    x = rng.standard_normal((3, 40, 70)).astype(F32)
    a = rng.standard_normal((4, 30, 40)).astype(F32)
    bm = rng.standard_normal((40, 4, 50)).astype(F32)

    def f(w, x, a, bm):
        y = tnp.tanh(tnp.einsum("ok,nkp->nop", w, x))
        return y, tnp.einsum("bmk,kbn->bmn", a, bm), tx.grad(lambda w: tnp.sum(tnp.einsum("ok,nkp->nop", w, x) ** 2))(w)
    y, z, dw = tx.jit(f, device=device)(w, x, a, bm)
    prod = np.einsum("ok,nkp->nop", w, x)
    _check(y, np.tanh(prod), 40)
    _check(z, np.einsum("bmk,kbn->bmn", a, bm), 40)
    _check(dw, np.einsum("nop,nkp->ok", 2 * prod, x), 3 * 70 * 40)
    if device.backend.tile_kernels:
        impls = _impls(f, w, x, a, bm, device=device)
        assert len(impls) == 3 and set(impls) <= {"tile_gemm", "vendor_gemm"}, impls  # (one forward product)


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
                assert _impls(f, x, w, b, r) == [IMPL[mode]], name
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
    """K past a K block (768 with AVX-512's 48 KiB L1): the epilogue follows the last block's
    update; bfloat16 keeps one K block."""
    for dtype in (F32, BF16):
        x = rng.standard_normal((70, 1700)).astype(dtype)
        w = (rng.standard_normal((1700, 90)) / 20).astype(dtype)
        b = rng.standard_normal(90).astype(dtype)
        f = lambda x, w, b: nn.gelu(tnp.matmul(x, w) + b)
        want = _gelu_tanh(x.astype(F32) @ w.astype(F32) + b.astype(F32))
        for mode in _modes(device):
            gemm_mode(mode)
            _check(tx.jit(f)(x, w, b), want, 1700, dtype)


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
    assert _impls(tnp.matmul, half, half, device="cpu") == ["tile_gemm"]  # no 16-bit BLAS
    assert _impls(tnp.matmul, big, big, device="cpu")[0] in ("tile_gemm", "vendor_gemm")



def test_another_batch_size_takes_the_verdict_measured_for_its_product(gemm_mode, rng, monkeypatch, tmp_path):
    """The vendor-or-generated verdict is measured once per shape class; a class that differs
    only in its rows (another batch size of the same product) takes the verdict found for it
    without measuring again; any other size is measured."""
    from tilefuse.runtime import host_blas
    gemm_mode("auto")
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))  # no verdicts on disk
    monkeypatch.setattr(host_blas, "_measured", {})
    monkeypatch.setattr(host_blas, "_by_rows", {})
    measured = []
    monkeypatch.setattr(host_blas, "_measure", lambda kernel, spec, device: measured.append(spec.layout.m) or "vendor")
    w = rng.standard_normal((256, 192)).astype(F32)
    for rows in (512, 128, 2048):
        x = rng.standard_normal((rows, 256)).astype(F32)
        assert _impls(tnp.matmul, x, w, device="cpu") == ["vendor_gemm"]
        _check(tx.jit(tnp.matmul, device="cpu")(x, w), x @ w, 256)
    assert measured == [512]
    x = rng.standard_normal((512, 256)).astype(F32)
    _impls(tnp.matmul, x, rng.standard_normal((256, 512)).astype(F32), device="cpu")  # another N
    assert measured == [512, 512]

def test_a_graphs_gemms_are_built_together_first(gemm_mode, rng, monkeypatch, tmp_path):
    """The builders' GEMM kernels of a graph are built together before any is used (in worker
    processes on the CPU): first those the vendor-or-generated choice times (once per shape
    class), so that no timing waits for its own kernel's build, then the rest (other epilogues
    of a class); none is built on its own. The numbers are the products'."""
    from tilefuse.backends.llvm import compile as llvm
    from tilefuse.backends.llvm import parallel
    from tilefuse.runtime import host_blas
    gemm_mode("auto")
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))  # no verdicts on disk
    monkeypatch.setenv("TILEFUSE_COMPILE_WORKERS", "2")
    monkeypatch.setattr(host_blas, "_measured", {})
    monkeypatch.setattr(host_blas, "_by_rows", {})
    timed, together, alone = [], [0], []
    measure, compile_ir, build_objects = host_blas._measure, llvm.Target.compile_ir, parallel.build_objects

    def measure_counted(kernel, spec, device):
        timed.append(spec.layout.n)
        return measure(kernel, spec, device)

    def build_together(*a, **k):
        together[0] += 1
        try:
            return build_objects(*a, **k)
        finally:
            together[0] -= 1

    def compile_counted(self, text, fn_name, what):
        if not together[0] and fn_name.startswith("tf_tile_"):  # (a builder's kernel, on its own)
            alone.append(fn_name)
        return compile_ir(self, text, fn_name, what)
    monkeypatch.setattr(host_blas, "_measure", measure_counted)
    monkeypatch.setattr(parallel, "build_objects", build_together)
    monkeypatch.setattr(llvm.Target, "compile_ir", compile_counted)
    c = np.float32(rng.uniform(1, 2))  # epilogues no cache holds: their kernels are new
    x = rng.standard_normal((512, 96)).astype(F32)
    ws = [rng.standard_normal((96, n)).astype(F32) for n in (64, 128, 256, 512) for _ in range(2)]
    got = tx.jit(lambda x, *ws: [tnp.tanh(x @ w) * c for w in ws[::2]] + [(x @ w) * c + 1.0 for w in ws[1::2]],
                 device="cpu")(x, *ws)
    assert timed == [64, 128, 256, 512]  # four shape classes timed, each once
    assert alone == []
    for g, w in zip(got[:4], ws[::2]):
        _check(g, np.tanh(x @ w) * c, 96)
    for g, w in zip(got[4:], ws[1::2]):
        _check(g, (x @ w) * c + 1.0, 96)


def _run_schedule(device, f, args, sched):
    """f's GEMM kernel built by the shared builder under `sched` (None: the default) and run on
    `device`; None where the target refuses the schedule."""
    from tilefuse.ir.kernel import gemm
    prog = tx.jit(f, device=device).lower(*args).compile().program
    (launch,) = [l for l in prog.launches if l.kind in ("dot_general", "fused_gemm")]
    k = launch.kernel
    spec = gemm.gemm_spec(k)
    if sched is None:
        sched = gemm.default_schedule(spec, target_of(device.info))
    if sched.check(spec, target_of(device.info)) is not None:  # e.g. more registers than the target has
        return None
    run = device.backend.compile_tile(gemm.build(spec, sched, k.name, k.buffers, k.n_inputs), device)
    bufs = [device.backend.put(np.ascontiguousarray(a).view(np.uint8).reshape(-1), device) for a in args]
    out = device.backend.alloc(k.buffers[-1].size * spec.out_dtype.itemsize, device)
    run([*bufs, out])
    return np.array(device.backend.to_host(out, ShapedArray((k.buffers[-1].size,), spec.out_dtype), device))


# the packed form's ways: A packed or read in place, K in blocks or whole, ragged register tiles and
# task blocks, a batch, a transposed B (packed along k), 16-bit inputs; (schedule fields, operands)
PACKED = [dict(wm=4, wn=1, vec=4, mc=8, nc=8, kc=16), dict(wm=6, wn=2, vec=8, mc=24, nc=32, kc=50),
          dict(wm=12, wn=2, vec=16, mc=24, nc=64, kc=64), dict(wm=3, wn=3, vec=4, mc=9, nc=24, kc=0)]
PROBLEMS = [((1, 13, 33, 129), False, F32), ((3, 101, 47, 80), True, F32), ((2, 25, 64, 64), False, F32),
            ((1, 30, 70, 75), True, F32), ((3, 101, 90, 80), False, F32), ((1, 45, 50, 300), False, BF16)]


@pytest.mark.parametrize("pack_a", [True, False])
def test_packed_schedules_compute_the_same(device, rng, pack_a):
    from tilefuse.ir.kernel import gemm
    if not getattr(device.backend, "tile_kernels", False) or target_of(device.info).kind != "cpu":
        pytest.skip("the packed form is the CPU targets' (GPUs run the shared-memory form)")
    ran = 0
    for (batch, m, n, k), bt, dtype in PROBLEMS:
        a = rng.standard_normal((batch, m, k)).astype(dtype)
        b = rng.standard_normal((batch, n, k) if bt else (batch, k, n)).astype(dtype)
        f = (lambda a, b: tnp.matmul(a, tnp.swapaxes(b, 1, 2))) if bt else tnp.matmul
        want = a.astype(F32) @ (b.transpose(0, 2, 1) if bt else b).astype(F32)
        for fields in PACKED:
            sched = gemm.GemmSchedule(False, **fields, pack_a=pack_a)
            if dtype != F32 and sched.kc:  # a 16-bit C holds no partial sums: one K block
                sched = replace(sched, kc=0)
            got = _run_schedule(device, f, (a, b), sched)
            if got is not None:
                _check(got.reshape(want.shape), want, k, dtype)
                ran += 1
        _check(_run_schedule(device, f, (a, b), None).reshape(want.shape), want, k, dtype)
    assert ran >= 3 * len(PROBLEMS)


def test_packed_defaults_follow_the_problem_and_the_target():
    """Registers set the register tile, L1 the K blocks (a 16-bit C keeps one), L2 the panels;
    A is packed where reading it in place costs (16 bits, k strided, a driver's compiler); what
    cannot run is refused."""
    from tilefuse.ir.kernel import gemm
    from tilefuse.ir.kernel.matmul import MatmulLayout
    from tilefuse.ir.kernel.target import Target
    avx512 = Target("cpu", lanes=16, vector_registers=32, cores=2, l1_bytes=48 << 10, l1_ways=12, l2_bytes=2 << 20)
    avx2 = Target("cpu", lanes=8, vector_registers=16, cores=4, l1_bytes=32 << 10, l2_bytes=1 << 20)

    def spec(m, n, k, dtype=F32, a_strides=None, out=None):
        lay = MatmulLayout(1, m, n, k, a_strides or (0, k, 1), (0, n, 1), np.dtype(dtype))
        return gemm.GemmSpec(lay, np.dtype(out or dtype), None, 0, 1, (), 2)
    for t, tile in ((avx512, (12, 2, 16)), (avx2, (6, 2, 8))):
        for s in (spec(2048, 128, 128), spec(1024, 1024, 4096), spec(128, 384, 2048, a_strides=(0, 1, 128)),
                  spec(1000, 1000, 1000, BF16)):
            p = gemm.default_schedule(s, t)
            assert (p.wm, p.wn, p.vec) == tile and p.check(s, t) is None, (s, p)
            kc, blocks = gemm._k_blocks(s.layout.k, p.kc)
            assert blocks == 1 or (s.out_dtype == F32 and kc * p.wn * p.vec * 4 <= 2 * t.l1_bytes)
            assert p.pack_a == (s.layout.dtype != F32 or s.layout.a_strides[2] != 1)
            assert p.kc * p.nc * 4 <= t.l2_bytes // 2
        assert gemm.default_schedule(spec(1024, 1024, 4096), t).kc > 0  # K in blocks
        assert gemm.default_schedule(spec(1000, 1000, 4096, BF16), t).kc == 0  # a 16-bit C: one block
    # a driver's compiler (OpenCL) gets A packed: one pointer at constant offsets in the micro-kernel
    driver = replace(avx512, driver_compiled=True)
    assert gemm.default_schedule(spec(2048, 128, 128), driver).pack_a
    # A's rows read in place share an L1 set at a stride of l1_bytes / l1_ways (4 KiB on an 8-way 32 KiB
    # L1): the register tile keeps no more rows than the set has ways, or packs A where that is too few
    zen4 = replace(avx512, l1_bytes=32 << 10, l1_ways=8)
    for k, rows in ((1024, 8), (2048, 8), (512, 12), (1000, 12), (128, 12)):
        p = gemm.default_schedule(spec(1024, 1024, k), zen4)
        assert (p.wm, p.pack_a) == (rows, False) and p.check(spec(1024, 1024, k), zen4) is None, (k, p)
    assert gemm.default_schedule(spec(1024, 1024, 1024), avx512).wm == 12  # 12 ways keep 12 rows
    p = gemm.default_schedule(spec(1024, 1024, 4096), replace(zen4, l1_ways=2))
    assert (p.wm, p.pack_a) == (12, True)  # two rows a set (16 KiB apart): packed instead
    s = spec(64, 64, 4096, BF16)
    assert "partial sums" in gemm.GemmSchedule(False, 4, 1, 16, mc=8, nc=16, kc=512).check(s, avx512)
    assert "scratch" in gemm.GemmSchedule(False, 4, 1, 16, mc=8, nc=512, kc=0).check(spec(64, 512, 1 << 20), avx512)
    assert "registers" in gemm.GemmSchedule(False, 12, 2, 8, mc=12, nc=16).check(spec(64, 64, 64), avx2)
