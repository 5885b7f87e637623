"""tilefuse.torch: PyTorch models on tilefuse devices (the `torch` extra).

    model = torch.compile(model, backend=tilefuse.torch.backend(device="opencl:0"))

AOTAutograd turns the model's forward and backward into core-ATen graphs; each ATen op maps to
tilefuse operations (aten.py), and each graph compiles with tx.jit on the device. Training with
loss.backward() and any torch optimizer works as in eager PyTorch. An op with no rule is an
UnsupportedOpError naming it: the backend never falls back to PyTorch silently."""
from __future__ import annotations

try:
    import torch
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tilefuse.torch needs PyTorch: pip install 'tilefuse[torch]'") from e

from .aten import UnsupportedOpError
from .compiler import backend, compile_fx_graph, decompositions
from .convert import DeviceTensor, to_array, to_tensor


def supported_ops() -> list[str]:
    """The ATen overloads the backend has rules for."""
    from .aten import BY_NAME, OPS
    return sorted({str(op) for op in OPS if isinstance(op, torch._ops.OpOverload)} | set(BY_NAME))


__all__ = [
    "DeviceTensor",
    "UnsupportedOpError",
    "backend",
    "compile_fx_graph",
    "decompositions",
    "supported_ops",
    "to_array",
    "to_tensor",
]
