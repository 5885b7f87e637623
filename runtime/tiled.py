"""Kernels built by the shared tile-level builders (ir/kernel/: GEMM, FlashAttention) for the
backends that print tile kernels: the builder writes the algorithm under a schedule the scheduler
picks from the device's Target, or the tuning database holds (one parameter space for every
backend); the backend only prints and launches. A backend takes a builder for its device kind
with register_gemm or register_attention (it may keep a vendor library beside it)."""
from __future__ import annotations

import dataclasses
import hashlib
import threading

import numpy as np
from tilefuse.ir import primitives as P
from tilefuse.ir.errors import TilefuseError
from tilefuse.ir.kernel import attention, conv, gemm
from tilefuse.ir.kernel.matmul import MIN_FLOPS  # smaller products: the generic kernel
from tilefuse.ir.kernel.schedule import Schedule, default_schedule
from tilefuse.ir.kernel.tile import key_text

from . import dispatch, tuner
from .config import config
from .hardware import check_fits, target_of

CONV_KINDS = ("conv", "fused_conv")
_gemm_kinds: list[str] = []


def _target(device):
    return target_of(device.info)


def gemm_spec(kernel):
    """The GEMM a kernel poses: a dot_general's or fused_gemm's, or a conv's implicit GEMM; kept in
    its meta (the dispatcher's candidates, the batch build and each launch's build ask it)."""
    meta = kernel.meta
    if "gemm_spec" not in meta:
        meta["gemm_spec"] = conv.conv_spec(kernel) if meta.get("kind") in CONV_KINDS else gemm.gemm_spec(kernel)
    return meta["gemm_spec"]


def gemm_applies(kernel, device) -> bool:
    """Whether the shared GEMM builds this kernel on the device; kept in its meta per target
    (five candidates ask it of each GEMM a compile meets)."""
    t = _target(device)
    memo = kernel.meta.setdefault("gemm_applies", {})
    if t not in memo:
        spec = gemm_spec(kernel)
        memo[t] = spec is not None and spec.layout.flops >= MIN_FLOPS and \
            gemm.default_schedule(spec, t).check(spec, t) is None
    return memo[t]


def _built_once(kernel, what: str, device, params, build):
    """build() for this kernel, device and schedule, kept in the kernel's meta: the dispatcher asks
    whether a builder applies, a graph's batch build makes its tile kernels, then each launch's
    build asks again; the same TileKernel object each time also keeps its printed key (key_text)."""
    memo = kernel.meta.setdefault(what, {})
    where = (getattr(device, "name", device), _target(device), repr(params))
    if where not in memo:
        memo[where] = build()
    return memo[where]


def gemm_tile(kernel, device, params: dict | None = None):
    """The shared GEMM's tile kernel for a GEMM kind kernel under the default schedule (or `params`)."""
    return _built_once(kernel, "tile_gemm", device, params, lambda: _gemm_tile(kernel, device, params))


def _gemm_tile(kernel, device, params):
    spec, t = gemm_spec(kernel), _target(device)
    sched = gemm.default_schedule(spec, t) if params is None else gemm.schedule_of(params, t)
    why = sched.check(spec, t)
    if why is not None:
        raise ValueError(f"GEMM schedule {sched}: {why}")
    key = gemm.size_free_key(spec, sched, kernel.buffers, kernel.n_inputs, t.runtime_batch)
    (tk,) = _size_free(key, t, kernel.name, lambda: [
        gemm.build(spec, sched, kernel.name, kernel.buffers, kernel.n_inputs, t.runtime_batch)],
        lambda _, made: [gemm.at_sizes(made[0], spec, sched, kernel.name, kernel.buffers)])
    return tk


# The builders' tile kernels by what they are made of but the sizes their code reads at run time
# (gemm.size_free_key, attention.size_free_key): a new batch size's GEMM and FlashAttention
# kernels, and a layer's GEMM like an earlier layer's, are that one's at their sizes (at_sizes),
# not built and printed again (~0.4 ms a GEMM, ~3 ms an attention backward)
_size_free_tiles: dict = {}
SIZE_FREE_MOST = 64  # entries kept, the oldest going first (the char-GPT step has 17 such keys)
_tables = threading.Lock()  # (the compile thread and a caller's may build at once)


def forget_size_free() -> None:
    """Drop the kept tile kernels (tx.clear_caches)."""
    with _tables:
        _size_free_tiles.clear()


def _size_free(key, t, name: str, build, at_sizes) -> list:
    """build()'s tile kernels, or, where a kernel named `was` with this size-free key on target
    t was built before (key None: no such key), at_sizes(was, its tile kernels); under
    TILEFUSE_CHECK compared with what building gives."""
    made = _size_free_tiles.get((key, t)) if key is not None else None
    if made is None:
        tks = build()
        if key is not None:
            with _tables:
                if len(_size_free_tiles) >= SIZE_FREE_MOST:
                    del _size_free_tiles[next(iter(_size_free_tiles))]
                _size_free_tiles[key, t] = (name, tks)
        return tks
    tks = at_sizes(*made)
    if config.check:
        view = lambda ks: [(k.name, k.body, k.meta.get("sizes"), key_text(k)) for k in ks]  # noqa: E731
        assert view(tks) == view(build()), f"{name}: made of another's tile kernels, not as built"
    return tks


def gemm_build(kernel, device, backend, params: dict | None = None):
    return backend.compile_tile(gemm_tile(kernel, device, params), device)


def _key(kernel) -> tuple[str, str]:
    """Problems alike in epilogue, operands' layout and dtypes share a signature; sizes by class."""
    spec = gemm_spec(kernel)
    lay = spec.layout
    sig = repr((spec.epilogue, lay.a_strides[2] == 1, lay.b_strides[2] == 1, lay.dtype.name,
                spec.out_dtype.name, tuple(full for _, full in spec.extras)))
    return "gemm-" + hashlib.sha1(sig.encode()).hexdigest()[:16], "x".join(str(tuner.size_class(n)) for n in (lay.batch, lay.m, lay.n, lay.k))


def register_gemm(device_kind: str, priority: int, chosen=None) -> None:
    """The shared GEMM runs dot_general and fused_gemm kernels on `device_kind` (whose backend
    prints tile kernels), searched by the tuner in gemm.space; `chosen(kernel, device)`: where the
    backend takes it (beside a vendor library), by default wherever it applies."""
    def applies(kernel, device):
        return (chosen is None or chosen(kernel, device)) and gemm_applies(kernel, device)
    tiles = lambda kernel, device: [gemm_tile(kernel, device)]  # noqa: E731
    for kind in ("dot_general", "fused_gemm"):
        dispatch.register(dispatch.Implementation("tile_gemm", kind, gemm_build, (device_kind,), applies,
                                                  priority, tiles))
    # convolutions: the same builder as an implicit GEMM (ir/kernel/conv.py); the composite beside it
    for kind in CONV_KINDS:
        dispatch.register(dispatch.Implementation("tile_gemm", kind, gemm_build, (device_kind,), gemm_applies,
                                                  priority, tiles))
    _gemm_kinds.append(device_kind)
    tuner.register(tuner.Template(
        "tile_gemm", "tile_gemm", tuple(_gemm_kinds),
        lambda kernel, device: gemm.space(gemm_spec(kernel), _target(device)),
        lambda kernel, device: gemm.params_of(gemm.default_schedule(gemm_spec(kernel), _target(device))),
        gemm_build,
        lambda params, kernel, device: gemm.schedule_of(params, _target(device)).check(
            gemm_spec(kernel), _target(device)),
        _key, gemm_applies))


def _attention_spec(kernel):
    """The Spec of a fused_attention(_bwd) kernel the builders take, or None: a feature axis that
    is not the last, empty operands, a backward in 16 bits (its row statistics wait in the result)."""
    eqns = kernel.meta.get("eqns", ())
    if len(eqns) != 1 or eqns[0].prim not in (P.fused_attention, P.fused_attention_stats, P.fused_attention_bwd):
        return None
    e = eqns[0]
    if not all(a.aval.size > 0 for a in e.inputs) or \
            any(d[-1] != a.aval.ndim - 1 for d, a in zip(e.params["dims"], e.inputs[:3])):
        return None
    sp = attention.spec_of(e)
    return None if sp.bwd and e.inputs[0].aval.dtype.itemsize < 4 else sp


def _attention_kernels(kernel, device, params: dict | None = None):
    """The FlashAttention tile kernels of a fused_attention (one) or fused_attention_bwd (one to
    three, run in order) kernel under the default schedule (or `params`), or None where the
    builders do not apply, no schedule fits, or a kernel is past the device's limits."""
    return _built_once(kernel, "tile_attention", device, params,
                       lambda: _attention_tiles(kernel, device, params))


def _attention_tiles(kernel, device, params):
    sp, t = _attention_spec(kernel), _target(device)
    if sp is None:
        return None
    sched = attention.default_attention_schedule(sp, t) if params is None else attention.schedule_of(params, t)
    if sched is None or sched.check(sp, t) is not None:
        return None
    if sched.vec and np.dtype(kernel.buffers[0].dtype).itemsize > 4:  # the CPU form's vectors of float64 (16 lanes
        return None  # of float32's width) the LLVM tile printer refuses: the decomposition runs
    key = attention.size_free_key(sp, sched, kernel.buffers, kernel.n_inputs, t.runtime_batch)
    tks = _size_free(key, t, kernel.name, lambda: _attention_built(kernel, sp, sched, t),
                     lambda was, made: attention.at_sizes(made, was, sp, sched, kernel.name, kernel.buffers))
    try:
        for tk in tks:
            check_fits(tk, device.info)
    except TilefuseError:
        return None
    return tks


def _attention_built(kernel, sp, sched, t) -> list:
    if sp.bwd:
        return attention.build_backward(sp, sched, kernel.name, kernel.buffers, kernel.n_inputs, t.runtime_batch)
    return [attention.build_forward(sp, sched, kernel.name, kernel.buffers, kernel.n_inputs)]


def _attention_build(kernel, device, backend, params: dict | None = None):
    tks = _attention_kernels(kernel, device, params)
    if tks is None:
        raise ValueError(f"attention schedule {params}: does not fit {kernel.name} on {device}")
    runs = [backend.compile_tile(tk, device) for tk in tks]
    if len(runs) == 1:
        return runs[0]

    def run(buffers):  # (no event: a profiler times the kernels together, to the last one's end)
        for r in runs:
            r(buffers)
    return run


def attention_tuning_key(kernel, backend_name: str = "tile") -> tuple[str, str]:
    """Forward or backward, causal, with a bias: the signature; sizes by power-of-two class."""
    sp = attention.spec_of(kernel.meta["eqns"][0])
    sig = f"{backend_name}-attention-" + ("bwd" if sp.bwd else "fwd") + "-causal" * sp.causal \
        + "-bias" * sp.has_bias
    return sig, "x".join(str(tuner.size_class(n)) for n in (sp.nb, sp.sq, sp.sk)) + f"/{sp.d}x{sp.dv}"


_attention_kinds: list[str] = []


def register_attention(device_kind: str, priority: int) -> None:
    """The shared FlashAttention (ir/kernel/attention.py), forward and backward, on `device_kind`,
    searched by the tuner in attention.space."""
    for kind in dispatch.ATTENTION_KINDS:
        dispatch.register(dispatch.Implementation(
            "tile_attention", kind, _attention_build, (device_kind,),
            lambda kernel, device: _attention_kernels(kernel, device) is not None, priority,
            lambda kernel, device: _attention_kernels(kernel, device) or []))
    _attention_kinds.append(device_kind)
    tuner.register(tuner.Template(
        "tile_attention", "tile_attention", tuple(_attention_kinds),
        lambda kernel, device: attention.space(_attention_spec(kernel), _target(device)),
        lambda kernel, device: attention.params_of(attention.default_attention_schedule(
            _attention_spec(kernel), _target(device))),
        _attention_build,
        lambda params, kernel, device: None if _attention_kernels(kernel, device, params) is not None else
        f"{params}: no such schedule fits {kernel.name} on {getattr(device, 'name', device)}",
        attention_tuning_key, lambda kernel, device: _attention_kernels(kernel, device) is not None))


GROUPS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
UNROLLS = (1, 2, 4, 8)


def _kernel_default(kernel, device, unroll: int | None = None) -> Schedule:
    t = _target(device)
    if unroll is not None:
        t = dataclasses.replace(t, unroll=unroll)
    return default_schedule(kernel, t, config.deterministic)


def register_kernels(device_kind: str) -> None:
    """Every kernel of `device_kind` goes through the shared scheduler (its backend's
    compile_kernel); the tuner searches the work-group size of those that take one, and on a
    target whose vectors may be wider than a register (Target.unroll) the registers per step."""
    _kernel_kinds.append(device_kind)

    def space(kernel, device):
        s, t = _kernel_default(kernel, device), _target(device)
        if t.unroll > 1:
            return {"unroll": UNROLLS}
        if s.serial:
            return {"group": (s.group,)}
        return {"group": tuple(g for g in GROUPS if g <= t.max_group)}

    def default(kernel, device):
        t = _target(device)
        return {"unroll": t.unroll} if t.unroll > 1 else {"group": _kernel_default(kernel, device).group}

    def build(kernel, device, backend, params):
        if "unroll" in params:
            return backend.compile_kernel(kernel, device, _kernel_default(kernel, device, params["unroll"]))
        s = _kernel_default(kernel, device)
        return backend.compile_kernel(kernel, device, dataclasses.replace(s, group=params["group"]))

    def check(params, kernel, device):
        g = params.get("group", 1)
        return None if g <= _target(device).max_group else \
            f"the device's work-groups hold at most {_target(device).max_group} work-items"
    tuner.register(tuner.Template("tile_kernel", "kernel_ir", tuple(_kernel_kinds), space, default, build, check))


_kernel_kinds: list[str] = []

__all__ = ["attention_tuning_key", "gemm_applies", "gemm_build", "register_attention", "register_gemm",
           "register_kernels"]
