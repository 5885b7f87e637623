"""The hardware description (HDI): what each device is, for code generation and the roofline.

Backends read it from the device; `TILEFUSE_HDI` (a JSON file, or JSON text) or `tx.config.hdi`
(a dict or a path, set before a device is first used) overrides it, so that code generation for
hardware we do not have runs here: CI runs the suite as on an AVX2-only CPU whose OpenCL driver
has 8-wide vectors and no fp16. Keys (all optional; a section named after a device kind --
"cpu", "opencl", "cuda" -- applies to that kind only, after the common keys):

    vector_bits      SIMD width: CPU lanes (and, below 512, no avx512*/amx*/avx10* target
                     features; AVX itself stays, because without F16C LLVM converts float16
                     through compiler-rt calls the JIT does not link); OpenCL preferred widths
                     are capped at vector_bits / 8 / sizeof(type)
    vector_widths    OpenCL preferred widths per type, {"float": 8, "char": 16, ...}
    fp16             false: the OpenCL device has no cl_khr_fp16 (half is storage only)
    cpu_name         the LLVM target CPU (default with vector_bits < 512: x86-64-v3 or -v2)
    cpu_features     LLVM target features to remove, glob patterns: ["avx512*", "amx*"]
    buffer_align     bytes kernels may assume every buffer starts at (OpenCL: vector accesses
                     that need alignment are used where it is proven)
    compute_units, local_mem_bytes, max_work_group, l1_bytes, l1_ways, l2_bytes, l3_bytes

A description only narrows what a device can do (widths, local memory, work-group size, features
and fp16 are capped at what the device reports), so a simulated machine never asks the real
one for more than it has; caches and core counts are free."""
from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass, field, replace

import numpy as np

from tilefuse.ir.errors import CompileError, OutOfMemoryError, TilefuseError


@dataclass(frozen=True)
class DeviceInfo:
    """A device's hardware description; backends fill it from the device itself."""
    kind: str
    name: str
    compute_units: int = 1
    simd_lanes_f32: int = 4  # float32 lanes of the native vector unit (or warp size on GPUs)
    l1_bytes: int = 32 << 10
    l1_ways: int = 8  # the L1 data cache's associativity
    l2_bytes: int = 1 << 20
    l3_bytes: int = 0
    local_mem_bytes: int = 0  # OpenCL local / CUDA shared memory per work-group
    max_work_group: int = 1
    sub_group: int = 1
    global_mem_bytes: int = 0
    peak_gflops: float = 0.0  # float32, all units
    peak_gbps: float = 0.0
    features: tuple = ()
    cpu_name: str = ""
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def fingerprint(self) -> str:
        return f"{self.kind}|{self.name}|{self.cpu_name}|{self.compute_units}|{self.simd_lanes_f32}|" \
               f"{self.local_mem_bytes}|{','.join(self.features)}"


# ---- simulated descriptions (TILEFUSE_HDI, tx.config.hdi) --------------------------------------

KINDS = ("cpu", "opencl", "cuda", "ref")
KEYS = frozenset({"vector_bits", "vector_widths", "fp16", "cpu_name", "cpu_features", "buffer_align",
                  "compute_units", "local_mem_bytes", "max_work_group", "l1_bytes", "l1_ways", "l2_bytes",
                  "l3_bytes", "device_type"})
# CPU target features that need 512-bit vectors or AVX-512 encodings
WIDE_FEATURES = ("avx512*", "amx*", "avx10*", "evex512")


def _source():
    from .config import config
    return config.hdi if config.hdi is not None else os.environ.get("TILEFUSE_HDI") or None


def description(kind: str) -> dict:
    """The overrides for devices of `kind`: the common keys, then the kind's own section."""
    src = _source()
    if src is None:
        return {}
    where = "tx.config.hdi" if not isinstance(src, str) else "TILEFUSE_HDI"
    if isinstance(src, str):
        text = src if src.lstrip()[:1] in ("{", "[") else None
        if text is None:
            try:
                with open(src) as f:
                    text = f.read()
            except OSError as e:
                raise TilefuseError(f"{where}: cannot read the hardware description {src!r}: {e}") from None
        try:
            src = json.loads(text)
        except ValueError as e:
            raise TilefuseError(f"{where}: the hardware description is not valid JSON: {e}") from None
    if not isinstance(src, dict):
        raise TilefuseError(f"{where}: the hardware description must be a JSON object, "
                            f"got {type(src).__name__}")
    bad = [k for k in src if k not in KEYS and k not in KINDS]
    bad += [f"{k}.{j}" for k in KINDS if isinstance(src.get(k), dict) for j in src[k] if j not in KEYS]
    if bad:
        raise TilefuseError(f"{where}: unknown keys {bad} in the hardware description (known: "
                         f"{', '.join(sorted(KEYS))}, and sections {', '.join(KINDS)})")
    for section in [src] + [src[k] for k in KINDS if isinstance(src.get(k), dict)]:
        if section.get("device_type", "gpu") != "gpu":
            raise TilefuseError(f"{where}: device_type {section['device_type']!r}: a description can present a "
                                "device as a \"gpu\" (its GPU layouts run on a CPU's OpenCL), nothing else")
    out = {k: v for k, v in src.items() if k in KEYS}
    out.update(src.get(kind) or {})
    return out


def masked(features, patterns) -> tuple:
    """`features` without those matching any of the glob `patterns`."""
    return tuple(f for f in features if not any(fnmatch.fnmatchcase(f, p) for p in patterns))


def cpu_feature_masks(desc: dict) -> tuple:
    """The feature patterns a description removes from the host CPU's."""
    bits = desc.get("vector_bits")
    pats = tuple(desc.get("cpu_features") or ())
    if bits is not None and bits < 512:
        pats += WIDE_FEATURES
    return pats


def narrowed(info: DeviceInfo, desc: dict) -> DeviceInfo:
    """`info` with the description's device-neutral keys applied (capacities only narrow)."""
    if not desc:
        return info
    ch = {}
    for k in ("compute_units", "l1_bytes", "l1_ways", "l2_bytes", "l3_bytes"):
        if k in desc:
            ch[k] = int(desc[k])
    if "local_mem_bytes" in desc:
        ch["local_mem_bytes"] = min(int(desc["local_mem_bytes"]), info.local_mem_bytes)
    if "max_work_group" in desc:
        ch["max_work_group"] = max(1, min(int(desc["max_work_group"]), info.max_work_group))
    if "compute_units" in ch and info.compute_units:
        ch["peak_gflops"] = info.peak_gflops * ch["compute_units"] / info.compute_units
    extra = dict(info.extra)
    extra["simulated"] = True
    return replace(info, **ch, extra=extra)


def _read_cache(index: int, what: str = "size") -> int:
    """A cache's size in bytes (or another of /sys's numbers: ways_of_associativity); 0 if unknown."""
    try:
        with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/{what}") as f:
            s = f.read().strip()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
        return int(s.rstrip("KMG")) * mult
    except (OSError, ValueError, IndexError):
        return 0


_HOST = None


def host_info() -> DeviceInfo:
    """The host CPU: cores, SIMD width from the CPU features LLVM reports, caches from /sys."""
    global _HOST
    if _HOST is not None:
        return _HOST
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    name, feats = "generic", ()
    try:
        import llvmlite.binding as llvm
        name = llvm.get_host_cpu_name()
        feats = tuple(sorted(k for k, v in llvm.get_host_cpu_features().items() if v))
    except Exception:  # llvmlite missing or unable to read the host: a plain description
        pass
    desc = description("cpu")
    kept = masked(feats, cpu_feature_masks(desc))
    if kept != feats:  # a narrower CPU than the host: the host's name would imply more features
        feats, name = kept, "x86-64-v3" if "avx2" in kept else "x86-64-v2" if "sse4.2" in kept else "x86-64"
    name = desc.get("cpu_name", name)
    lanes = 16 if "avx512f" in feats else 8 if "avx2" in feats or "avx" in feats else 4
    lanes = min(lanes, max(4, desc.get("vector_bits", 512) // 32))
    # FMAs of full vector width per cycle: two ports, except Zen 4, whose two 256-bit FMA units
    # take a 512-bit FMA together (measured: the GEMM micro-kernel in L2, 93-98 GFLOP/s a core
    # at ~3 GHz, i.e. 32 FLOP/cycle)
    fma = 1 if "fma" not in feats or (lanes == 16 and name == "znver4") else 2
    ghz = 3.0
    _HOST = DeviceInfo(kind="cpu", name=f"host CPU ({name})", compute_units=cores, simd_lanes_f32=lanes,
                       l1_bytes=_read_cache(0) or 48 << 10, l1_ways=_read_cache(0, "ways_of_associativity") or 8,
                       l2_bytes=_read_cache(2) or 1 << 20, l3_bytes=_read_cache(3), max_work_group=1,
                       global_mem_bytes=_mem_bytes(),
                       peak_gflops=cores * ghz * lanes * 2 * fma, peak_gbps=12.0 * cores,
                       features=feats, cpu_name=name)
    _HOST = narrowed(_HOST, desc)
    return _HOST


def _mem_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def check_fits(tk, info: DeviceInfo) -> None:
    """Refuse a tile kernel a device cannot run whole: an array past one buffer's limit
    (extra["max_buffer"]), a loop past the driver's trip cap (extra["max_loop_trips"]: Mesa's
    llvmpipe silently ends a loop there, a wrong result)."""
    from tilefuse.ir.kernel.tile import loop_trips
    limit, cap = info.extra.get("max_buffer"), info.extra.get("max_loop_trips")
    big = max((b.size * np.dtype(b.dtype).itemsize for b in tk.buffers), default=0)
    if limit and big > limit:
        raise OutOfMemoryError(f"{info.kind}: cannot allocate an array of {big} bytes for kernel {tk.name}: "
                               f"a buffer holds at most {limit} on {info.name}")
    if cap and (trips := loop_trips(tk.body, sizes=tuple(tk.meta.get("sizes", ())))) > cap:
        raise CompileError(f"{info.kind}: kernel {tk.name} runs a loop {trips} times in one "
                           f"work-item; {info.name} stops loops at {cap}", backend=info.kind, kernel=str(tk))


def target_of(info: DeviceInfo):
    """The scheduler's view of a device (ir/kernel/target.Target), from its description: a CPU
    device (the host, or an OpenCL device of type CPU) runs work-groups of one work-item over
    SIMD vectors; a GPU stages tiles through shared memory."""
    from tilefuse.ir.kernel.target import MMA, Target
    cpu = info.kind == "cpu" or info.extra.get("device_type") == "cpu"
    # an OpenCL CPU device is this host: its caches as /sys reports them (OpenCL's cache size
    # is whatever the driver says, 480 MiB from one PoCL)
    caches = host_info() if cpu else info
    feats = caches.features if cpu else ()
    lanes = info.simd_lanes_f32 if cpu else 1
    return Target(kind="cpu" if cpu else "gpu", lanes=max(1, lanes),
                  vector_registers=32 if "avx512f" in feats else 16, cores=max(1, info.compute_units),
                  shared_bytes=0 if cpu else info.local_mem_bytes, max_group=max(1, info.max_work_group),
                  warp=max(1, info.sub_group), l1_bytes=caches.l1_bytes, l1_ways=max(1, caches.l1_ways),
                  l2_bytes=caches.l2_bytes, l3_bytes=caches.l3_bytes, fp16=bool(info.extra.get("fp16", True)),
                  mma=tuple(MMA(*m) for m in info.extra.get("mma", ())),  # (the backend's table: MMA's fields)
                  # the host's LLVM printer takes vectors of any width; 4 registers in flight: the
                  # transcendental chains are latency-bound (tanh/sigmoid/exp chain on one znver3
                  # core: 3.0 ns a point one vector at a time, 2.1 with 4). Sizes at run time: the
                  # LLVM printer's, and where a backend declares it (OpenCL, WebGPU: parameters)
                  unroll=4 if info.kind == "cpu" else 1, runtime_batch=info.kind == "cpu" or bool(info.extra.get("runtime_sizes")),
                  atomics=info.kind != "cpu", driver_compiled=info.kind == "opencl")
