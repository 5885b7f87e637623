"""The hardware description (HDI): what each device is, for code generation and the roofline."""
from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeviceInfo:
    """A device's hardware description; backends fill it from the device itself."""
    kind: str
    name: str
    compute_units: int = 1
    simd_lanes_f32: int = 4  # float32 lanes of the native vector unit (or warp size on GPUs)
    l1_bytes: int = 32 << 10
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
        return f"{self.kind}|{self.name}|{self.cpu_name}|{self.compute_units}|{','.join(self.features)}"


def _read_cache_size(index: int) -> int:
    try:
        with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
            s = f.read().strip()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
        return int(s.rstrip("KMG")) * mult
    except (OSError, ValueError):
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
    lanes = 16 if "avx512f" in feats else 8 if "avx2" in feats or "avx" in feats else 4
    # FMAs of full vector width per cycle: two ports, except Zen 4, whose two 256-bit FMA units
    # take a 512-bit FMA together (measured: the GEMM micro-kernel in L2, 93-98 GFLOP/s a core
    # at ~3 GHz, i.e. 32 FLOP/cycle)
    fma = 1 if "fma" not in feats or (lanes == 16 and name == "znver4") else 2
    ghz = 3.0
    _HOST = DeviceInfo(kind="cpu", name=f"host CPU ({name})", compute_units=cores, simd_lanes_f32=lanes,
                       l1_bytes=_read_cache_size(0) or 48 << 10, l2_bytes=_read_cache_size(2) or 1 << 20,
                       l3_bytes=_read_cache_size(3), max_work_group=1, global_mem_bytes=_mem_bytes(),
                       peak_gflops=cores * ghz * lanes * 2 * fma, peak_gbps=12.0 * cores,
                       features=feats, cpu_name=name)
    return _HOST


def _mem_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def target_of(info: DeviceInfo):
    """The scheduler's view of a device (ir/kernel/target.Target), from its description: a CPU
    device (the host, or an OpenCL device of type CPU) runs work-groups of one work-item over
    SIMD vectors; a GPU stages tiles through shared memory."""
    from tilefuse.ir.kernel.target import Target
    cpu = info.kind == "cpu" or info.extra.get("device_type") == "cpu"
    # an OpenCL CPU device is this host: its caches as /sys reports them (OpenCL's cache size
    # is whatever the driver says, 480 MiB from one PoCL)
    caches = host_info() if cpu else info
    feats = caches.features if cpu else ()
    lanes = info.simd_lanes_f32 if cpu else 1
    return Target(kind="cpu" if cpu else "gpu", lanes=max(1, lanes),
                  vector_registers=32 if "avx512f" in feats else 16, cores=max(1, info.compute_units),
                  shared_bytes=0 if cpu else info.local_mem_bytes, max_group=max(1, info.max_work_group),
                  warp=max(1, info.sub_group), l1_bytes=caches.l1_bytes, l2_bytes=caches.l2_bytes,
                  l3_bytes=caches.l3_bytes, fp16=bool(info.extra.get("fp16", True)))
