"""The CUDA GEMM template (backends/cuda/gemm.py): every variant (float32 SIMT, float16 and
bfloat16 on tensor cores; with and without a fused epilogue; batched; transposed operands; ragged
sizes) is chosen by the dispatcher on an offline CUDA device and its PTX assembles with ptxas for
sm_80 and sm_90; the tile configuration against DeviceInfo values (an H200). With a GPU, every
variant's results against the `ref` backend."""
from __future__ import annotations

import functools
import os
import tempfile

import ml_dtypes
import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse.backends.cuda import device_info, offline_device
from tilefuse.backends.cuda.gemm import (SIMT_TILES, TENSOR_CORE_TILES, CudaGemmParams, build,
                                         default_params, tile_count)
from tilefuse.backends.llvm.gemm import GemmProblem
from tilefuse.ir import primitives as P
from tilefuse.ir.errors import CompileError
from tilefuse.tracer.core import bind1
from tilefuse.validate.primitives import epilogue_fn
from tilefuse import nn
from test_cuda_ptx import ARCHS, _ptxas, need_ptxas  # the ptxas this machine has (one discovery)

BF16 = ml_dtypes.bfloat16
R = np.random.default_rng(0)


def u(*shape, dtype=np.float32):
    return R.uniform(-1.0, 1.0, shape).astype(dtype)


def dot(contract, batch=((), ())):
    return lambda a, b: bind1(P.dot_general, a, b, dimension_numbers=(contract, batch))


def fused(epilogue, contract=((1,), (0,)), batch=((), ())):
    return lambda a, b, *extras: bind1(P.fused_gemm, a, b, *extras, dimension_numbers=(contract, batch),
                                       preferred_element_type=None, epilogue=epilogue)


MM = dot(((1,), (0,)))
F16 = np.float16
# every kind of elementwise op a fused_gemm's epilogue may hold: arithmetic on extras, the
# activations, comparisons, selects, casts through integers
EVERY_STEP = epilogue_fn(lambda y, b, r: tnp.where(
    nn.gelu(tnp.tanh(nn.silu(nn.sigmoid(nn.relu(0.5 * y + 0.1) + b)))) + r > 0,
    tnp.floor(nn.gelu(y, approximate=False) * 4).astype(tnp.int32).astype(tnp.float32), -y), 3)


def epi(f, n, dtype=np.float32):
    return epilogue_fn(f, n, dtype)


# name -> (function, arguments): ragged sizes (no dimension a multiple of a tile) unless named
CASES = {
    "f32": (MM, (u(131, 77), u(77, 53))),
    "f16": (MM, (u(131, 77, dtype=np.float16), u(77, 53, dtype=np.float16))),
    "bf16": (MM, (u(131, 77, dtype=BF16), u(77, 53, dtype=BF16))),
    "f32 large tiles": (MM, (u(2048, 40), u(40, 2048))),
    "f16 large tiles": (MM, (u(2048, 40, dtype=np.float16), u(40, 2048, dtype=np.float16))),
    "f16 batched": (dot(((2,), (1,)), ((0,), (0,))), (u(3, 70, 41, dtype=np.float16),
                                                       u(3, 41, 50, dtype=np.float16))),
    # k and n multiples of 16 bytes: the tiles are copied in 16-byte vectors
    "f16 vector copies": (MM, (u(136, 64, dtype=np.float16), u(64, 72, dtype=np.float16))),
    "f32 vector copies": (MM, (u(100, 48), u(48, 40))),
    "bf16 vector copies, both transposed": (dot(((0,), (1,))), (u(64, 136, dtype=BF16), u(72, 64, dtype=BF16))),
    "f32 transposed lhs": (dot(((0,), (0,))), (u(77, 131), u(77, 53))),
    "bf16 transposed rhs": (dot(((1,), (1,))), (u(131, 77, dtype=BF16), u(53, 77, dtype=BF16))),
    "f32 every epilogue step": (fused(EVERY_STEP), (u(131, 77), u(77, 53), u(53), u(131, 53))),
    "f16 bias gelu residual": (fused(epi(lambda y, b, r: nn.gelu(y + b) + r, 3, F16)),
                               (u(131, 77, dtype=np.float16), u(77, 53, dtype=np.float16),
                                u(53, dtype=np.float16), u(131, 53, dtype=np.float16))),
    "f16 tanh(x @ w + b), fused by the pass": (lambda x, w, b: tnp.tanh(x @ w + b),
                                               (u(96, 64, dtype=np.float16), u(64, 80, dtype=np.float16),
                                                u(80, dtype=np.float16))),
    "bf16 batched transposed epilogue": (
        fused(epi(lambda y, r: nn.silu(y + r), 2, BF16), contract=((2,), (2,)), batch=((0,), (0,))),
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


# tiles the tuner may pick (name -> params, operand dtype): an odd number of 8-column fragments
# per warp, the element-wise copy path (the tile splits into 16-byte vectors unevenly), one warp row
TUNED = {"odd fragments": (CudaGemmParams(64, 48, 32, 2, 2), np.float16),
         "element copies": (CudaGemmParams(32, 64, 16, 1, 4), BF16),
         "tall": (CudaGemmParams(256, 64, 32, 4, 2), np.float16),
         "simt narrow": (CudaGemmParams(64, 32, 8, 2, 1), np.float32)}


@functools.cache
def tuned(arch: str) -> dict:
    """name -> PTX of the TUNED tiles, each built for a ragged product on `arch`."""
    dev = offline_device(arch)
    out = {}
    for name, (params, dtype) in TUNED.items():
        assert params.check(dev.info, dtype != np.float32) is None, name
        prog = tx.jit(MM).lower(u(131, 77, dtype=dtype), u(77, 53, dtype=dtype), device=dev).compile().program
        out[name] = build(prog.launches[0].kernel, dev, dev.backend, params).source
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_the_dispatcher_chooses_the_template_for_every_variant(arch):
    for name, (impl, ptx) in compiled(arch).items():
        assert impl == "cuda_gemm", name
        assert f".target {arch}" in ptx and ".shared" in ptx and "bar.sync" in ptx, name
        dtype = np.dtype(CASES[name][1][0].dtype)
        if dtype == np.float32:
            assert "mma.sync" not in ptx and "fma.rn.f32" in ptx, name
        else:
            kind = "f16" if dtype == np.float16 else "bf16"
            assert f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32" in ptx, name
            assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx, name


@need_ptxas
@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_assembles_with_ptxas(arch):
    failures = []
    with tempfile.TemporaryDirectory() as d:
        texts = {**{k: ptx for k, (_, ptx) in compiled(arch).items()}, **tuned(arch)}
        for n, (name, ptx) in enumerate(texts.items()):
            r = _ptxas(ptx, arch, os.path.join(d, f"gemm{n}.ptx"))
            if r.returncode:
                failures.append(f"{name}: {r.stderr.strip()[:400]}")
    assert not failures, "\n".join(failures)


def test_small_products_keep_the_generic_kernel():
    prog = tx.jit(MM).lower(u(6, 16), u(16, 8), device=offline_device("sm_90")).compile().program
    assert [launch.impl for launch in prog.launches] == ["kernel_ir"]


# ---- tile configuration -----------------------------------------------------------------------

# an H200: 132 SMs, 1024 threads per block, 48 KiB of static shared memory per block (of the
# 228 KiB an SM has: a block beyond 48 KiB needs dynamic shared memory, which the template avoids)
H200 = device_info("NVIDIA H200", (9, 0), 132, max_threads_per_block=1024, shared_per_block=48 << 10)


def problem(m, n, k, dtype=np.float32, batch=1) -> GemmProblem:
    return GemmProblem(batch, m, n, k, (m * k, k, 1), (k * n, n, 1), np.dtype(dtype), np.dtype(dtype),
                       (), (), (("lhs",), ("rhs",)))


def test_large_products_take_the_largest_tile():
    for dtype, tiles in ((np.float16, TENSOR_CORE_TILES), (BF16, TENSOR_CORE_TILES), (np.float32, SIMT_TILES)):
        p = default_params(H200, problem(4096, 4096, 4096, dtype))
        assert p == tiles[0] and p.threads == 256, dtype
        assert tile_count(problem(4096, 4096, 4096, dtype), p) == 32 * 32


def test_smaller_products_take_smaller_tiles_to_reach_every_sm():
    # 1024 x 2048: 128 tiles of 128 x 128 < 132 SMs; 256 of 64 x 128
    assert default_params(H200, problem(1024, 2048, 512, np.float16)) == CudaGemmParams(64, 128, 32, 2, 4)
    # too small for one wave of any tile: the smallest
    assert default_params(H200, problem(256, 256, 64, np.float16)) == TENSOR_CORE_TILES[-1]
    assert default_params(H200, problem(256, 256, 64)) == SIMT_TILES[-1]
    # the batch counts: 8 x 4 x 4 tiles of 128 x 128
    assert default_params(H200, problem(512, 512, 64, np.float16, batch=9)) == TENSOR_CORE_TILES[0]


def test_tiles_respect_the_device_limits():
    big = TENSOR_CORE_TILES[0]
    assert big.check(H200, True) is None and big.shared_bytes(True) == 2 * 256 * 40
    assert SIMT_TILES[0].check(H200, False) is None and SIMT_TILES[0].accumulators == 64
    few_threads = device_info("small", (8, 0), 8, max_threads_per_block=128)
    assert "threads" in big.check(few_threads, True)
    assert default_params(few_threads, problem(4096, 4096, 4096, np.float16)).threads == 128
    little_shared = device_info("little", (8, 0), 8, shared_per_block=12 << 10)
    assert "shared memory" in big.check(little_shared, True)
    assert "fragments" in CudaGemmParams(128, 128, 24, 2, 4).check(H200, True)  # bk not a multiple of 16
    assert "accumulators" in CudaGemmParams(256, 256, 16, 2, 4).check(H200, False)
    with pytest.raises(CompileError, match="no CUDA GEMM tile"):
        default_params(device_info("tiny", (8, 0), 8, max_threads_per_block=64), problem(64, 64, 64))


def test_the_launch_is_one_block_per_tile():
    dev = offline_device("sm_90")
    a, b = u(2, 300, 64, dtype=np.float16), u(2, 64, 200, dtype=np.float16)
    prog = tx.jit(dot(((2,), (1,)), ((0,), (0,)))).lower(a, b, device=dev).compile().program
    (launch,) = prog.launches
    run = build(launch.kernel, dev, dev.backend)
    p = default_params(dev.info, problem(300, 200, 64, np.float16, batch=2))
    assert p == TENSOR_CORE_TILES[-1]  # 2 x 5 x 4 tiles of 64 x 64: fewer than 132 SMs
    assert (run.grid, run.block) == (2 * 5 * 4, 128)


# ---- on a GPU ---------------------------------------------------------------------------------

HAS_CUDA = any(d.kind == "cuda" for d in tx.devices())
need_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU on this machine")
RTOL = {np.dtype(np.float32): 1e-4, np.dtype(np.float16): 4e-3, np.dtype(BF16): 2e-2}


@pytest.mark.parametrize("case", ["f16", "bf16", "f16 bias gelu residual", "f32 every epilogue step"])
def test_tensor_core_kernels_compute_the_product_in_a_ptx_interpreter(case):
    """Without a GPU: the tensor-core kernel of a ragged product (mma.sync and ldmatrix fragments,
    zero-filled edges) runs in a PTX interpreter (ptxemu.py) and matches the reference."""
    import ptxemu
    fn, args = CASES[case]
    dev = offline_device("sm_80")
    prog = tx.jit(fn).lower(*args, device=dev).compile().program
    (launch,) = [lc for lc in prog.launches if lc.kind in ("dot_general", "fused_gemm")]
    run = build(launch.kernel, dev, dev.backend)
    pos = {v.id: i for i, v in enumerate(prog.graph.invars)}
    ins = [np.ascontiguousarray(args[pos[v.id]]) for v in launch.kernel.meta["operands"]]
    out = np.zeros(launch.kernel.buffers[-1].size, launch.kernel.buffers[-1].dtype)
    got = ptxemu.run(run.source, ins + [out], run.grid, run.block).astype(np.float32)
    want = np.asarray(tx.jit(fn, device="ref")(*args)).astype(np.float32).reshape(got.shape)
    rtol = RTOL[np.dtype(args[0].dtype)]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


@need_gpu
def test_every_variant_matches_the_reference_on_the_gpu():
    for name, (fn, args) in CASES.items():
        prog = tx.jit(fn, device="cuda").lower(*args).compile().program
        assert [lc.impl for lc in prog.launches if lc.kind in ("dot_general", "fused_gemm")] == ["cuda_gemm"]
        got = np.asarray(tx.jit(fn, device="cuda")(*args)).astype(np.float32)
        want = np.asarray(tx.jit(fn, device="ref")(*args)).astype(np.float32)
        rtol = RTOL[np.dtype(args[0].dtype)]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max(), err_msg=name)
