"""tilefuse: a JAX-style functional tracing compiler. jit, grad and vmap transform pure
numpy-style functions; the traced graph is fused and compiled for the CPU (LLVM), OpenCL and
CUDA devices."""
from __future__ import annotations

__version__ = "0.1.0"

from tilefuse.ir import dtypes as _dtypes
from tilefuse.ir.errors import (ArgumentError, CompileError, ConcretizationError, DeviceError,
                                DTypeError, NaNError, OperandShapeError, OutOfMemoryError, ShapeError,
                                StaticArgumentError, TilefuseError, TracerLeakError, TransformError)
from tilefuse.runtime import device as _device
from tilefuse.runtime import memory as _memory
from tilefuse.runtime.array import Array
from tilefuse.runtime.config import config
from tilefuse.runtime.device import default_device, device_get, device_put, devices, get_device
from tilefuse.runtime.dlpack import from_dlpack
from tilefuse.runtime.profiler import profile
# the CLI package (python -m tilefuse.tune runs its __main__) is imported before the function takes
# its name, so a later `import tilefuse.tune` cannot replace tx.tune with the package
from tilefuse import tune as _tune_cli  # noqa: F401
from tilefuse.runtime.tuner import tune  # noqa: E402
from tilefuse.tracer import core as _core
from tilefuse.tracer import jit as _jit
from tilefuse.tracer.pytree import (register_dataclass, register_pytree_node, tree_flatten,
                                    tree_leaves, tree_map, tree_structure, tree_unflatten)

_memory.keep_host_memory()  # (glibc: freed host memory kept for reuse, not faulted in again each step)
_core.set_eager_apply(_device.apply_primitive)
_jit.hooks.resolve_device = _device.resolve_device


def _compile(graph, device, tiered: bool = False):
    """jit's compile: tiered (runtime/tiered.py) where a call asks and the device takes it."""
    from tilefuse.runtime import tiered as _tiered
    return _tiered.compile(graph, device) if tiered else device.compile(graph)


_jit.hooks.compile = _compile
_jit.hooks.config = config

from tilefuse import numpy  # noqa: E402  (installs the array operators)
from tilefuse import nn, optim, random  # noqa: E402
from tilefuse import lax  # noqa: E402
from tilefuse.api import debug_print, elementwise_grad, make_graph  # noqa: E402
from tilefuse.autodiff import (check_grads, custom_jvp, custom_vjp, grad, hessian, jacfwd, jacrev,  # noqa: E402
                               jvp, stop_gradient, value_and_grad, vjp)
from tilefuse.tracer.jit import jit  # noqa: E402
from tilefuse.tracer.vmap import vmap  # noqa: E402
from tilefuse.tile_op import Tensor, TileOp, tile_op  # noqa: E402
from tilefuse import flatten_util, tree_util  # noqa: E402,F401  (JAX's module names)

float16, bfloat16, float32, float64 = _dtypes.float16, _dtypes.bfloat16, _dtypes.float32, _dtypes.float64
int32, int64, uint32, bool_ = _dtypes.int32, _dtypes.int64, _dtypes.uint32, _dtypes.bool_


def memory_stats(device=None) -> dict:
    """Pool statistics of a device: bytes in use, peak, allocations, cache hits."""
    return (get_device(device) if device is not None else default_device()).memory_stats()


def clear_caches() -> None:
    """Drop every compiled program in memory (each jitted function's, eager operations') and hand
    the devices' cached pool blocks back; the next calls trace and compile again (from the disk
    cache where it holds them)."""
    _jit.clear_all()
    _device.clear_caches()
