"""The kernel IR (ir.py), the lowering of graph regions to it (lower.py) and its numpy
reference evaluator (interp.py)."""
from .interp import InterpBackend, run_kernel
from .ir import Buffer, Kernel, KExpr, Store, pp_kernel
from .lower import LoweredKernel, copy_kernel, kernel_name, lower_region

__all__ = ["Buffer", "InterpBackend", "KExpr", "Kernel", "LoweredKernel", "Store", "copy_kernel",
           "kernel_name", "lower_region", "pp_kernel", "run_kernel"]
