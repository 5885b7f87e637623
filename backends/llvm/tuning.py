"""The CPU templates' parameter spaces for the auto-tuner (runtime/tuner.py).

`kernel_ir`: every kernel the renderer generates (elementwise chains, reductions, gathers, ...):
threads and chunks per thread (compile.py), SIMD width, interleaving and the reduction tile
(render.py). `attention`: FlashAttention (attention.py), forward and backward: the query and key
blocks and the register blocks. GEMM: the shared builder's space (runtime/tiled.py)."""
from __future__ import annotations

from dataclasses import asdict

from tilefuse.runtime import tuner

from . import attention
from .attention import AttentionParams
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


# ---- FlashAttention ------------------------------------------------------------------------------
# The blocks are compiled in: every configuration is a compile. The space stops at the first
# choice that covers the sequence or the features (larger ones run the same loops); the template's
# own rules (register blocks tiling the blocks, the stack) are AttentionParams.invalid, and the
# register file is the constraint here.

VECTOR_REGISTERS = 32  # the template's 16-lane vectors are AVX-512 registers (narrower ones split each)


def _up_to(choices: tuple, n: int) -> tuple:
    """The choices up to the first that reaches n."""
    return tuple(c for i, c in enumerate(choices) if i == 0 or choices[i - 1] < n)


def attention_space(kernel, device) -> dict:
    sp = attention.kernel_spec(kernel)
    vectors = -(-max(sp.d, sp.dv) // attention.LANES)
    return {"bq": _up_to((32, 64, 128, 256), sp.sq), "bk": _up_to((16, 32, 64, 128), sp.sk),
            "r": (1, 2, 4, 8), "chunk": _up_to((1, 2, 4, 8), vectors)}


def attention_default(kernel, device) -> dict:
    return asdict(AttentionParams())


def attention_check(params: dict, kernel, device) -> str | None:
    p = AttentionParams(**params)
    why = p.invalid(attention.kernel_spec(kernel))
    if why:
        return why
    # accumulators, the vectors loaded per step and the broadcast value, per micro-kernel
    scores = p.bk // attention.LANES
    for what, rows, width in (("scores", p.r, scores), ("products", p.r, p.chunk)):
        if rows * width + width + 1 > VECTOR_REGISTERS:
            return f"the {what}' {rows} x {width} register block needs more than {VECTOR_REGISTERS} registers"
    return None


def attention_key(kernel) -> tuple[str, str]:
    """Forward or backward, causal, with a bias: the signature; sizes by power-of-two class."""
    sp = attention.kernel_spec(kernel)
    sig = "attention-" + ("bwd" if sp.bwd else "fwd") + "-causal" * sp.causal + "-bias" * sp.has_bias
    return sig, "x".join(map(str, attention.shape_class(sp)))


def attention_build(kernel, device, backend, params: dict):
    return attention.build(kernel, device, backend, AttentionParams(**params))


tuner.register(tuner.Template("cpu_attention", "flash_attention", ("cpu",), attention_space,
                              attention_default, attention_build, attention_check, attention_key,
                              attention.applies))
