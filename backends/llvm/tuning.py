"""The CPU templates' parameter spaces for the auto-tuner (runtime/tuner.py).

`kernel_ir`: every kernel the renderer generates (elementwise chains, reductions, gathers, ...):
threads and chunks per thread (compile.py), SIMD width, interleaving and the reduction tile
(render.py). `gemm`: the packed GEMM template (gemm.py): the micro-tile, the cache blocks and the
threads, constrained by the register file and the caches of DeviceInfo. (FlashAttention is the
shared tile builders', tuned in their space: runtime/tiled.py.)"""
from __future__ import annotations

import hashlib
from dataclasses import asdict

from tilefuse.runtime import tuner

from .compile import KernelParams, default_params, interchanges
from .gemm import (GemmParams, a_readable_in_place, build_gemm, default_gemm_params, gemm_problem,
                   reads_a_in_place)


# ---- generated kernels --------------------------------------------------------------------------

def _thread_choices(n: int) -> tuple:
    return tuple(sorted({1, n, *(1 << i for i in range(1, 7) if 1 << i < n)}))


def kernel_space(kernel, device) -> dict:
    info = device.info
    threads = (1,) if kernel.serial or kernel.size < 2 else _thread_choices(info.compute_units)
    native = 32 * info.simd_lanes_f32
    space = {"threads": threads,
             "chunks_per_thread": (1, 2, 4, 8) if len(threads) > 1 else (1,),
             "vector_bits": tuple(b for b in (128, 256, 512) if b <= native) or (native,),
             "interleave": (1, 2, 4, 8)}
    if interchanges(kernel):
        space["reduce_tile"] = (64, 128, 256, 512, 1024)
    return space


def kernel_default(kernel, device) -> dict:
    p = asdict(default_params(kernel, device.info))
    return {k: p[k] for k in kernel_space(kernel, device)}


def kernel_check(params: dict, kernel, device) -> str | None:
    threads = params["threads"]
    if threads == 1 and params["chunks_per_thread"] != 1:
        return "one thread runs its range as one chunk"
    if threads > kernel.size:
        return f"{kernel.size} points are too few for {threads} threads"
    return None


def kernel_build(kernel, device, backend, params: dict):
    return backend.compile_kernel(kernel, device, KernelParams(**params))


tuner.register(tuner.Template("cpu_kernel", "kernel_ir", ("cpu",), kernel_space, kernel_default,
                              kernel_build, kernel_check))


# ---- the GEMM template -----------------------------------------------------------------------------
# The space is written in multiples (nr of the lanes, mc of mr, nc of nr), so the template's own
# divisibility rules hold by construction; the register file and the caches are the constraints.

def _gemm_params(params: dict, info) -> GemmParams:
    lanes = max(4, info.simd_lanes_f32)
    nr = params["nr"]
    return GemmParams(mr=params["mr"], nr=nr, lanes=lanes, kc=params["kc"],
                      mc=params["mr"] * params["mc_tiles"], nc=nr * params["nc_panels"],
                      threads=params["threads"], pack_a=params.get("pack_a", True))


def gemm_space(kernel, device) -> dict:
    info = device.info
    lanes = max(4, info.simd_lanes_f32)
    space = {"mr": (4, 6, 8, 10, 12, 14), "nr": (lanes, 2 * lanes, 3 * lanes, 4 * lanes),
             "kc": (64, 128, 192, 256, 384, 512), "mc_tiles": (2, 4, 8, 12, 16, 24),
             "nc_panels": (8, 16, 32, 64, 128), "threads": _thread_choices(info.compute_units)}
    if a_readable_in_place(gemm_problem(kernel)):
        space["pack_a"] = (True, False)
    return space


def gemm_default(kernel, device) -> dict:
    p = default_gemm_params(device.info)
    out = {"mr": p.mr, "nr": p.nr, "kc": p.kc, "mc_tiles": p.mc // p.mr, "nc_panels": p.nc // p.nr,
           "threads": p.threads}
    if a_readable_in_place(gemm_problem(kernel)):  # the default's choice made explicit (it depends on the problem)
        out["pack_a"] = not reads_a_in_place(gemm_problem(kernel), p, device.info)
    return out


def gemm_check(params: dict, kernel, device) -> str | None:
    info = device.info
    lanes = max(4, info.simd_lanes_f32)
    registers = 32 if "avx512f" in info.features else 16
    vectors = params["nr"] // lanes
    if params["mr"] * vectors + vectors + 1 > registers:
        return f"a {params['mr']}x{params['nr']} micro-tile needs more than {registers} vector registers"
    # the B micro-panel streams through L1 from L2: up to twice L1 measured fine (the defaults'
    # KC 512 x NR 32 = 64 KiB was the fastest KC on a 32 KiB L1, benchmarks/bench_gemm.py)
    if params["kc"] * params["nr"] * 4 > 2 * max(info.l1_bytes, 32 << 10):
        return "the B micro-panel (kc x nr) is over twice the size of L1"
    if params["mr"] * params["mc_tiles"] * params["kc"] * 4 > max(info.l2_bytes, 256 << 10):
        return "the A block (mc x kc) does not fit in L2"
    return None


def gemm_key(kernel) -> tuple[str, str]:
    """Problems alike in epilogue and operands share a signature; sizes by power-of-two class."""
    prob = gemm_problem(kernel)
    sig = hashlib.sha1(repr((prob.epilogue, len(prob.extra_strides), prob.roles)).encode()).hexdigest()[:16]
    return f"gemm-{sig}", "x".join(map(str, prob.shape_class()))


def gemm_build(kernel, device, backend, params: dict):
    return build_gemm(kernel, device, backend, _gemm_params(params, backend.info_of(device)))


tuner.register(tuner.Template("cpu_gemm", "generated_gemm", ("cpu",), gemm_space, gemm_default, gemm_build,
                              gemm_check, gemm_key, lambda kernel, device: gemm_problem(kernel) is not None))
