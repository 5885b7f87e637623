"""Kernel IR → LLVM IR with llvmlite, shared by the backends that hand LLVM IR to a target
machine: `llvm` (the host CPU, through the JIT) and `cuda` (NVPTX → PTX). tile.py prints tile kernels
(every kernel: the shared scheduler's and the builders'), ops.py the elementwise operations,
vecmath.py the vector math library; what a target adds (its
calling convention, where points come from, its libm) lives in its backend. Like cstyle.py for
the C-like printers, nothing here compiles, allocates or launches."""
