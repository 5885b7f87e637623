"""What the scheduler knows of a device: the part of its hardware description (runtime's
DeviceInfo, which fills a Target) that decides how a tile kernel is laid out, and what its
renderer can print. Overridable like the description itself, so hardware nobody here has is
scheduled, rendered and tested by construction."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MMA:
    """A matrix-multiply-accumulate instruction: C[m x n] += A[m x k] B[k x n] in one step, per
    warp (GPU) or core (CPU), with inputs of `in_dtype` accumulated in `acc_dtype`."""
    name: str
    m: int
    n: int
    k: int
    in_dtype: str
    acc_dtype: str = "float32"


@dataclass(frozen=True)
class Target:
    """kind "cpu": work-groups of one work-item, memory per task in scratch (no shared memory);
    kind "gpu": work-groups of many work-items staging tiles through shared memory."""
    kind: str
    lanes: int = 4              # float32 lanes of a native vector register (1 on GPUs: SIMT)
    vector_registers: int = 16  # architectural vector registers (the register tile fits in them)
    cores: int = 1              # compute units: cores, SMs
    shared_bytes: int = 0       # shared (local) memory per work-group
    max_group: int = 1          # work-items per work-group
    warp: int = 1               # work-items that run in lockstep
    l1_bytes: int = 32 << 10
    l1_ways: int = 8            # the L1 data cache's associativity (rows at a stride of l1_bytes /
    #                             l1_ways share a set: more of them than ways evict each other)
    l2_bytes: int = 1 << 20
    l3_bytes: int = 0
    fp16: bool = True           # arithmetic on float16 (else storage only: computed in float32)
    mma: tuple = ()             # MMA instructions, best first
    atomics: bool = True        # the printer has atomic adds (else adds with no owner axis run on one task)
    unroll: int = 1             # CPU: vector registers one step fills (vectors of lanes x unroll, their
    #                             chains in flight together); 1 where the printer's vectors are capped
    runtime_batch: bool = False  # the printer takes sizes at run time (tile.size: the first axis's
    #                              extent, one matrix GEMM's M and K blocks, where the attention
    #                              backward's dk and dv start): code holds no batch size, so a new
    #                              one reuses compiled kernels
    driver_compiled: bool = False  # kernels are built by the device driver's compiler (OpenCL: any
    #                                vendor, any version), not tilefuse's own LLVM pipeline
