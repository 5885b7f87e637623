"""GEMM on CUDA is the shared tile builder (ir/kernel/gemm.py, its shared-memory GPU form; with
16-bit operands its warp-MMA variant, mma.sync m16n8k16) printed by the NVPTX tile printer
(backends/cuda/tile.py). Without a GPU: the dispatcher picks it on an offline device for every
variant (float32, 16-bit, epilogues, batched, transposed operands), its PTX assembles with ptxas for
sm_80 and sm_90, and small problems run in the PTX interpreter (ptxemu.py, whose mma.sync follows
the PTX ISA's fragment figures on its own) to numpy's numbers. With a GPU, every variant against
the `ref` backend."""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
from gemm_cases import CASES as SMALL  # tests/gemm_cases.py
from gemm_cases import gemm_kernel
from test_cuda_ptx import ARCHS, assert_assembles, need_ptxas  # the ptxas this machine has (one discovery)
from tilefuse.backends.cuda import offline_device
from tilefuse.ir.errors import CompileError
from tilefuse.ir.kernel.gemm import GemmSchedule, build, default_schedule, gemm_spec
from tilefuse.ir.kernel.ir import Buffer, binary, const
from tilefuse.ir.kernel.tile import If, Range, Store, TileKernel, check_tile, mma, run_tile, var, vload
from tilefuse.runtime.hardware import target_of

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse import nn

BF16 = ml_dtypes.bfloat16
F16 = np.float16
R = np.random.default_rng(0)


def u(*shape, dtype=np.float32):
    return R.uniform(-1.0, 1.0, shape).astype(dtype)


# name -> (function, arguments): products past runtime/tiled.MIN_FLOPS, ragged sizes
CASES = {
    "f32": (lambda a, b: a @ b, (u(131, 77), u(77, 53))),
    "f16": (lambda a, b: a @ b, (u(131, 77, dtype=F16), u(77, 53, dtype=F16))),
    "bf16 transposed rhs": (lambda a, b: a @ b.T, (u(131, 77, dtype=BF16), u(53, 77, dtype=BF16))),
    "f32 transposed lhs": (lambda a, b: a.T @ b, (u(77, 131), u(77, 53))),
    "f16 batched": (lambda a, b: tnp.einsum("bij,bjk->bik", a, b), (u(3, 70, 41, dtype=F16), u(3, 41, 50, dtype=F16))),
    "f32 bias gelu residual": (lambda x, w, b, r: nn.gelu(x @ w + b) + r,
                               (u(131, 77), u(77, 53), u(53), u(131, 53))),
    "bf16 batched epilogue": (lambda a, b, r: nn.silu(tnp.einsum("bij,bkj->bik", a, b) + r),
                              (u(2, 70, 41, dtype=BF16), u(2, 50, 41, dtype=BF16), u(2, 70, 50, dtype=BF16))),
}


@functools.cache
def compiled(arch: str) -> dict:
    """name -> (the GEMM launch's implementation, its PTX) for every case, for `arch`."""
    out = {}
    for name, (fn, args) in CASES.items():
        prog = tx.jit(fn).lower(*args, device=offline_device(arch)).compile().program
        (gemm,) = [launch for launch in prog.launches if launch.kind in ("dot_general", "fused_gemm")]
        out[name] = gemm.impl, prog.sources()[f"{gemm.name}.cuda"]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_the_dispatcher_chooses_the_shared_builder_for_every_variant(arch):
    for name, (impl, ptx) in compiled(arch).items():
        assert impl == "tile_gemm", name
        assert f".target {arch}" in ptx and ".shared" in ptx and "bar.sync" in ptx, name
        dtype = np.dtype(CASES[name][1][0].dtype)
        if dtype == np.float32:
            assert "mma.sync" not in ptx and "fma.rn.f32" in ptx, name
        else:
            kind = "f16" if dtype == F16 else "bf16"
            assert f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32" in ptx, name


@need_ptxas
@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_assembles_with_ptxas(arch):
    assert_assembles({name: ptx for name, (_, ptx) in compiled(arch).items()}, arch)


def test_small_products_keep_the_generic_kernel():
    prog = tx.jit(lambda a, b: a @ b).lower(u(6, 16), u(16, 8), device=offline_device("sm_90")).compile().program
    assert [launch.impl for launch in prog.launches] == ["kernel_ir"]


def test_the_launch_is_one_block_per_tile_and_a_thread_per_register_tile():
    dev = offline_device("sm_90")
    k, _ = gemm_kernel(lambda a, b: tnp.einsum("bij,bjk->bik", a, b), [u(2, 300, 64), u(2, 64, 200)])
    s = GemmSchedule(True, 4, 4, 1, tm=64, tn=64, tk=8)
    run = dev.backend.compile_tile(build(gemm_spec(k), s, k.name, k.buffers, k.n_inputs), dev)
    assert (run.grid, run.block) == (2 * 5 * 4, 16 * 16)
    assert ".maxntid 256" in run.source  # ptxas budgets registers for the block


# ---- numbers without a GPU: the PTX interpreter (slow: small problems, small tiles) --------------

@pytest.mark.parametrize("case", ["plain", "A transposed", "B transposed", "batched einsum", "epilogue",
                                  "bfloat16"])
def test_the_ptx_computes_the_product_in_a_ptx_interpreter(case):
    """A ragged schedule (edges of every tile zero-filled) over tests/gemm_cases.py's problems."""
    f, args = SMALL[case]
    k, ins = gemm_kernel(f, args)
    _check_in_the_ptx_interpreter(f, args, k, gemm_spec(k), ins)


def _check_in_the_ptx_interpreter(f, args, k, spec, ins):
    """spec's kernel under a ragged shared schedule, printed for sm_80 and run by ptxemu, against `ref`."""
    import ptxemu
    dev = offline_device("sm_80")
    tk = build(spec, GemmSchedule(True, 2, 2, 1, tm=8, tn=8, tk=4), k.name, k.buffers, k.n_inputs)
    run = dev.backend.compile_tile(tk, dev)
    out = np.zeros(k.buffers[-1].size, k.buffers[-1].dtype)
    got = ptxemu.run(run.source, ins + [out], run.grid, run.block).astype(np.float32)
    want = np.asarray(tx.jit(f, device="ref")(*args)).astype(np.float32).reshape(-1)
    tol = 2e-2 if args[0].dtype != np.float32 else 1e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


MMA = GemmSchedule(True, 1, 1, 1, tm=16, tn=16, tk=16, mma="m16n8k16")  # two warps, ragged edges
MMA_CASES = {  # 16-bit problems: plain, bias + relu epilogue, batched with a transposed operand, K > tk
    "f16": (lambda x, w: x @ w, [u(13, 7, dtype=F16), u(7, 19, dtype=F16)]),
    "bf16 epilogue": SMALL["bfloat16"],
    "f16 batched, B transposed": (lambda q, k: tnp.einsum("bqd,bkd->bqk", q, k),
                                  [u(3, 5, 20, dtype=F16), u(3, 6, 20, dtype=F16)]),
    "bf16 A transposed, K = 40": (lambda x, w: x.T @ w, [u(40, 18, dtype=BF16), u(40, 9, dtype=BF16)]),
}


def _mma_kernel(case):
    f, args = MMA_CASES[case]
    k, ins = gemm_kernel(f, args)
    spec = gemm_spec(k)
    assert MMA.check(spec, target_of(offline_device("sm_80").info)) is None
    want = np.asarray(tx.jit(f, device="ref")(*args)).astype(np.float32).reshape(-1)
    return build(spec, MMA, k.name, k.buffers, k.n_inputs), ins, want


@pytest.mark.parametrize("case", MMA_CASES)
def test_the_mma_form_computes_the_product_in_the_reference_and_in_a_ptx_interpreter(case):
    """The tile IR's mma (run_tile gathers each warp's fragments by the layout table) and the
    printed mma.sync (ptxemu) give numpy's product."""
    import ptxemu
    tk, ins, want = _mma_kernel(case)
    check_tile(tk)
    out = np.zeros(tk.buffers[-1].size, tk.buffers[-1].dtype)
    run_tile(tk, [x.copy() for x in ins] + [out])
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    dev = offline_device("sm_80")
    run = dev.backend.compile_tile(tk, dev)
    assert "mma.sync.aligned.m16n8k16" in run.source and run.block == 64
    got = ptxemu.run(run.source, ins + [np.zeros_like(out)], run.grid, run.block).astype(np.float32)
    np.testing.assert_allclose(got, out.astype(np.float32), rtol=1e-6, atol=1e-6)


@need_ptxas
@pytest.mark.parametrize("arch", ARCHS)
def test_every_mma_schedule_size_assembles_with_ptxas(arch):
    """The default MMA schedules of small, medium and large products (32, 64 and 128 tiles)."""
    dev = offline_device(arch)
    texts = {}
    for m, n, kk in ((100, 90, 40), (1024, 1024, 64), (4096, 4096, 64)):
        k, _ = gemm_kernel(lambda x, w: x @ w, [u(m, kk, dtype=F16), u(kk, n, dtype=F16)])
        spec = gemm_spec(k)
        s = default_schedule(spec, target_of(dev.info))
        assert s.mma == "m16n8k16" and s.check(spec, target_of(dev.info)) is None
        texts[str(s)] = dev.backend.compile_tile(build(spec, s, k.name, k.buffers, k.n_inputs), dev).source
    assert_assembles(texts, arch)


# ---- convolutions: the same builder as an implicit GEMM (ir/kernel/conv.py) ---------------------

CONV_ON_GPU = {  # past the GEMM threshold: float32 (FMA), float16 (mma.sync), the filter gradient
    "f32 3x3": (lambda x, w: nn.conv2d(x, w, padding=1), (u(2, 8, 20, 20), u(16, 8, 3, 3))),
    "f16 strided groups": (lambda x, w: nn.conv2d(x, w, stride=2, padding=1, groups=2),
                           (u(2, 8, 30, 30, dtype=F16), u(32, 4, 3, 3, dtype=F16))),
    "f32 filter gradient": (tx.grad(lambda x, w: tnp.sum(nn.conv2d(x, w, padding=1) ** 2), argnums=1),
                            (u(4, 8, 16, 16), u(16, 8, 3, 3))),
}


@functools.cache
def compiled_convs(arch: str) -> dict:
    out = {}
    for name, (fn, args) in CONV_ON_GPU.items():
        prog = tx.jit(fn).lower(*args, device=offline_device(arch)).compile().program
        for launch in prog.launches:
            if launch.kind in ("conv", "fused_conv"):
                out[f"{name} {launch.name}"] = launch.impl, prog.sources()[f"{launch.name}.cuda"]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_convolutions_take_the_shared_builder(arch):
    got = compiled_convs(arch)
    assert len(got) == 4, sorted(got)  # two forwards, and the gradient's forward and filter gradient
    for name, (impl, ptx) in got.items():
        assert impl == "tile_gemm" and ".shared" in ptx, name
        assert ("mma.sync.aligned.m16n8k16" in ptx) == name.startswith("f16"), name


@need_ptxas
@pytest.mark.parametrize("arch", ARCHS)
def test_convolutions_assemble_with_ptxas(arch):
    assert_assembles({name: ptx for name, (_, ptx) in compiled_convs(arch).items()}, arch)


@pytest.mark.parametrize("case", ["3x3 padded", "strided, dilated, groups", "lhs dilated, batch groups, crop",
                                  "images in columns", "bfloat16", "epilogue, groups"])
def test_the_implicit_gemm_computes_convolutions_in_a_ptx_interpreter(case):
    from gemm_cases import CONV_CASES, conv_kernel
    f, args = CONV_CASES[case]
    k, spec, ins = conv_kernel(f, args)
    _check_in_the_ptx_interpreter(f, args, k, spec, ins)


def _one_mma(lanes: int, under_if: bool = False) -> TileKernel:
    """C[0:4] = mma of fragments read at offset 0 by every work-item (a type and structure check)."""
    zero = const(0, np.int64)
    d = mma(vload(0, zero, F16, 8), vload(0, zero, F16, 4), vload(1, zero, np.float32, 4))
    st = Store(1, zero, d)
    body = (If(binary("lt", var("l"), const(16, np.int64)), (st,)),) if under_if else (st,)
    return TileKernel("m", (Buffer("a", F16, 8), Buffer("c", np.float32, 4)), 1,
                      (Range("g", 1, "grid", (Range("l", lanes, "lane", body),)),))


def test_mma_is_checked_and_other_printers_refuse_it():
    check_tile(_one_mma(32))
    with pytest.raises(AssertionError, match="whole warps"):
        check_tile(_one_mma(48))
    with pytest.raises(AssertionError, match="under an If"):
        check_tile(_one_mma(32, under_if=True))
    tk, _, _ = _mma_kernel("f16")
    cpu = tx.devices("cpu")[0]
    with pytest.raises(CompileError, match="mma"):
        cpu.backend.compile_tile(tk, cpu)
    from tilefuse.backends.cstyle import print_tile
    with pytest.raises(CompileError, match="mma"):
        print_tile(tk)


# ---- on a GPU ---------------------------------------------------------------------------------

HAS_CUDA = any(d.kind == "cuda" for d in tx.devices())
RTOL = {np.dtype(np.float32): 1e-4, np.dtype(F16): 4e-3, np.dtype(BF16): 2e-2}


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU on this machine")
def test_every_variant_matches_the_reference_on_the_gpu():
    for name, (fn, args) in CASES.items():
        got = np.asarray(tx.jit(fn, device="cuda")(*args)).astype(np.float32)
        want = np.asarray(tx.jit(fn, device="ref")(*args)).astype(np.float32)
        rtol = RTOL[np.dtype(args[0].dtype)]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max(), err_msg=name)
