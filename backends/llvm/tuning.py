"""The CPU templates' parameter spaces for the auto-tuner (runtime/tuner.py).

`kernel_ir`: every kernel the renderer generates (elementwise chains, reductions, gathers, ...):
threads and chunks per thread (compile.py), SIMD width, interleaving and the reduction tile
(render.py). GEMM and FlashAttention are the shared builders', tuned in their spaces
(runtime/tiled.py)."""
from __future__ import annotations

from dataclasses import asdict

from tilefuse.runtime import tuner

from .compile import KernelParams, default_params, interchanges


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
