"""fused_gemm on OpenCL and CUDA devices where their GEMM templates (which run the epilogue in
their stores) do not apply: the product through the dispatcher into a temporary, then the
epilogue as one fused elementwise kernel. The generic kernel IR would run the whole fused_gemm
as one loop nest: slower than the tiled GEMM the rewrite replaced."""
from __future__ import annotations

from tilefuse.ir.kernel.matmul import MIN_FLOPS, matmul_layout
from tilefuse.ir.passes.gemm_epilogue import unfused_graph

from .composite import run_graph



def applies(kernel, device) -> bool:
    eqns = kernel.meta.get("eqns", ())
    if len(eqns) != 1 or eqns[0].prim.name != "fused_gemm" or "operands" not in kernel.meta:
        return False
    lay = matmul_layout(eqns[0])
    return lay is not None and lay.flops >= MIN_FLOPS


def build(kernel, device, backend):
    """run(buffers) over the fused kernel's buffers (its operands, then its output)."""
    (eqn,) = kernel.meta["eqns"]
    operands = kernel.meta["operands"]
    slot = {v.id: i for i, v in enumerate(operands)}
    slot[eqn.outputs[0].id] = len(operands)
    return run_graph(unfused_graph(eqn), slot, device, backend)
