"""numpy's BLAS beside the shared GEMM (ir/kernel/gemm.py, runtime/tiled.py) on a device whose
buffers are host memory (the CPU): the vendor candidate, np.matmul on strided views of the
kernel's buffers (the way XLA calls a vendor library), and the choice between the two, measured
once per shape class. float16/bfloat16 operands are widened to float32 first (numpy has no 16-bit
BLAS); a fused_gemm's epilogue runs after it in numpy. A backend takes it with register()."""
from __future__ import annotations

import functools
import hashlib
import time

import numpy as np
from numpy.lib.stride_tricks import as_strided
from tilefuse.ir.kernel import gemm

from . import compile_cache, dispatch, tiled, tuner

F32 = np.dtype(np.float32)


def _typed(buf, dtype, size):
    return buf[:size * dtype.itemsize].view(dtype)


class VendorGemm:
    """np.matmul for one GemmSpec; `run(buffers)` in kernel.buffers order."""

    def __init__(self, spec: gemm.GemmSpec, buffers):
        self.spec = spec
        self._bufs = [(np.dtype(b.dtype), b.size) for b in buffers]

    def _operand(self, buffers, i, shape, strides):
        dt, size = self._bufs[i]
        x = _typed(buffers[i], dt, size)
        x = as_strided(x, shape, tuple(s * dt.itemsize for s in strides), writeable=False)
        return x if dt == F32 else x.astype(F32)

    def __call__(self, buffers) -> None:
        s, lay = self.spec, self.spec.layout
        a = self._operand(buffers, s.a, (lay.batch, lay.m, lay.k), lay.a_strides)
        b = self._operand(buffers, s.b, (lay.batch, lay.k, lay.n), lay.b_strides)
        c = _typed(buffers[s.c], s.out_dtype, lay.batch * lay.m * lay.n).reshape(lay.batch, lay.m, lay.n)
        if s.epilogue is None and s.out_dtype == F32:
            np.matmul(a, b, out=c)
            return
        y = np.matmul(a, b)
        if s.epilogue is not None:  # the ScalarFn on the product as the graph had it
            extras = [_typed(buffers[i], *self._bufs[i]).reshape(c.shape if full else (lay.n,))
                      for i, full in s.extras]
            y = s.epilogue(y.astype(s.epilogue.in_dtypes[0], copy=False), *extras)
        c[...] = y


def build_vendor(kernel, device=None, backend=None) -> VendorGemm:
    return VendorGemm(gemm.gemm_spec(kernel), kernel.buffers)


# ---- the choice ------------------------------------------------------------------------------------

# The vendor must win by this much in isolation: one measurement on a shared machine is noisy,
# and OpenBLAS's threads keep spinning after a call, taking the cores from the kernels that
# follow — a cost the isolated measurement cannot see. The example's train step
# (benchmarks/bench_train.py, 2 idle cores): generated only 55 ms, vendor only 90 ms (attention
# and elementwise kernels twice as slow beside the spinning threads), auto with a margin of 1.3
# 80 ms (some shape classes went to BLAS).
VENDOR_MARGIN = 2.0
MODES = ("auto", "generated", "vendor", "generic")  # generic: the kernel IR's loop nest (to compare)
_measured: dict = {}  # shape class -> "generated" | "vendor"


@functools.lru_cache(maxsize=1)
def _digest() -> str:
    h = hashlib.sha256()
    for path in (__file__, gemm.__file__, tiled.__file__):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _best_time(fn, buffers, rounds: int = 5) -> float:
    """The best seconds of fn on buffers after two warm calls (pages touched, pool woken): the
    best is what the code can do, where medians on a shared machine also measure the neighbours."""
    fn(buffers)
    fn(buffers)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn(buffers)
        best = min(best, time.perf_counter() - t)
    return best


# OpenBLAS's threads spin for 2^28 cycles (~0.1 s measured) after a call: the generated GEMM timed
# in that window shares its cores with them and looks two to three times slower (the vendor then
# won by the margin for some shape classes in a third of cold runs, and its spinning threads
# slowed the whole train step 2x). So the vendor is timed only when the generated GEMM falls short
# of GOOD_FRACTION of the device's peak (no BLAS can then beat it by the margin), after it, and
# the generated GEMM is never timed within VENDOR_SPIN_S of a vendor call.
GOOD_FRACTION = 0.25
VENDOR_SPIN_S = 0.12
_last_vendor_call = [0.0]


def _measure(kernel, spec: gemm.GemmSpec, device) -> str:
    """The generated GEMM, unless it falls short of GOOD_FRACTION of the peak and the vendor is
    faster by VENDOR_MARGIN, twice over (one noisy verdict for the vendor costs every later step
    its spinning threads); timed on scratch buffers of the kernel's sizes."""
    backend = device.backend
    bufs = [backend.put(np.zeros(max(b.size * np.dtype(b.dtype).itemsize, 1), np.uint8), device)
            for b in kernel.buffers]
    try:
        gen, ven = tiled.gemm_build(kernel, device, backend), None
        for _ in range(2):
            time.sleep(max(0.0, _last_vendor_call[0] + VENDOR_SPIN_S - time.perf_counter()))
            t_gen = _best_time(gen, bufs)
            if spec.layout.flops >= GOOD_FRACTION * device.info.peak_gflops * 1e9 * t_gen:
                return "generated"
            ven = ven or VendorGemm(spec, kernel.buffers)
            t_ven = _best_time(ven, bufs)
            _last_vendor_call[0] = time.perf_counter()
            if t_ven * VENDOR_MARGIN >= t_gen:
                return "generated"
        return "vendor"
    finally:
        for b in bufs:
            backend.free(b, device)


def _shape_class(spec: gemm.GemmSpec) -> tuple:
    """Problems that run alike: sizes bucketed to powers of two, layouts and dtypes exact."""
    lay = spec.layout
    return (*(tuner.size_class(n) for n in (lay.batch, lay.m, lay.n, lay.k)), lay.a_strides[2] == 1,
            lay.b_strides[2] == 1, lay.dtype.name, spec.out_dtype.name, spec.epilogue is not None)


def choice(kernel, device) -> str:
    """"generated" (the shared GEMM), "vendor" or "generic" (the kernel IR) for a dot_general kind
    kernel: forced by TILEFUSE_GEMM / tx.config.gemm, else (auto) the generic kernel
    for tiny or unreadable problems, the vendor where the shared GEMM has no schedule, the shared
    GEMM for 16-bit floats (numpy has no 16-bit BLAS), and otherwise the faster of the two,
    measured once per shape class."""
    spec = tiled.gemm_spec(kernel)
    decided = _decided(spec, kernel, device)
    if decided is not None:
        return decided
    key = _key(spec, device)
    if not _known(key):
        verdict = _measure(kernel, spec, device)
        _cache().store(_disk_key(key), verdict.encode())
        _learn(key, verdict)
    return _measured[key]


def _decided(spec, kernel, device) -> str | None:
    """choice() without measuring, or None where it measures (or knows the verdict)."""
    from tilefuse.runtime.config import config
    mode = config.gemm
    if mode not in MODES:
        raise ValueError(f"tilefuse.config.gemm is {mode!r}; choose one of {', '.join(MODES)} "
                         "(or set TILEFUSE_GEMM)")
    lay = spec and spec.layout
    if spec is None or lay.k == 0 or lay.batch * lay.m * lay.n == 0:
        return "generic"
    if mode != "auto":
        return mode
    if lay.flops < tiled.MIN_FLOPS:
        return "generic"
    if not tiled.gemm_applies(kernel, device):
        return "vendor"
    if lay.dtype != F32 or spec.out_dtype != F32:
        return "generated"
    return None


def _key(spec, device) -> tuple:
    return _shape_class(spec) + (device.info.fingerprint,)


def _cache():
    return compile_cache.CompileCache("gemm-choice", compile_cache.default_dir())


def _disk_key(key: tuple) -> str:
    return compile_cache.make_key("gemm-choice", _digest(), repr(key), VENDOR_MARGIN)


def _known(key: tuple) -> bool:
    """Whether the verdict for this shape class is at hand: measured here, kept in the disk cache
    (measured once per machine), or found for another batch size of the same product."""
    if key in _measured:
        return True
    verdict = _cache().load(_disk_key(key))
    if verdict is None and _rows_only(key) in _by_rows:
        # another batch size of a product measured here (an epoch's last batch): its rows
        # differ, its layout and its other sizes not, and both are timed alike; a second
        # of measuring would be the new batch's whole compile
        verdict = _by_rows[_rows_only(key)].encode()
    if verdict is None:
        return False
    _learn(key, verdict.decode() if verdict in (b"generated", b"vendor") else "generated")
    return True


def _learn(key: tuple, verdict: str) -> None:
    _measured[key] = verdict
    _by_rows.setdefault(_rows_only(key), verdict)


def prebuild(kernels, device) -> None:
    """The generated GEMMs that choice() is about to time, built together where the backend can
    (compile_tiles: the CPU's worker processes) instead of one by one as each is timed: a cold
    compile of the char-GPT step timed 8 shape classes, 0.2-0.35 s each, nearly all of it the
    build of a kernel the program then runs."""
    if device.kind not in _kinds:
        return
    tiles, keys = [], set()
    for k in kernels:
        spec = tiled.gemm_spec(k) if k.meta.get("kind") in ("dot_general", "fused_gemm") else None
        if spec is None or _decided(spec, k, device) is not None:
            continue
        key = _key(spec, device)
        if key not in keys and not _known(key):
            keys.add(key)
            tiles.append(tiled.gemm_tile(k, device))
    if tiles:
        device.backend.compile_tiles(tiles, device)


_by_rows: dict = {}  # a shape class without its rows (M) -> the verdict first found for it


def _rows_only(key: tuple) -> tuple:
    return key[:1] + key[2:]  # (_shape_class: batch, M, N, K, ...)


_kinds: set = set()  # the device kinds that registered


def register(device_kind: str, priority: int) -> None:
    """The shared GEMM (at `priority`) and numpy's BLAS on `device_kind`, whichever choice() says."""
    _kinds.add(device_kind)
    tiled.register_gemm(device_kind, priority, chosen=lambda kernel, device: choice(kernel, device) == "generated")
    for kind in ("dot_general", "fused_gemm"):
        dispatch.register(dispatch.Implementation(
            "vendor_gemm", kind, build_vendor, (device_kind,),
            lambda kernel, device: choice(kernel, device) == "vendor", priority=priority - 5))
