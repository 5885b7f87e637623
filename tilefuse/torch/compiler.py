"""The torch.compile backend: AOTAutograd's forward and backward graphs (core ATen ops) become
jitted tilefuse functions on one device.

Flow: dynamo captures an FX graph; AOTAutograd traces it with the core ATen decompositions (plus
ours: scaled_dot_product_attention as one tilefuse::attention op), splits forward from backward
(min-cut rematerialisation, as Inductor), and hands each graph to `compile_fx_graph`. That
checks every op has a rule (aten.py), then wraps an interpreter of the graph in tx.jit: the
first call with given shapes traces the interpreter, so the graph tilefuse optimises and fuses
is the whole ATen graph, and later calls run the compiled executable directly."""
from __future__ import annotations

import linecache

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.node import map_arg

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse import random as txr

from . import aten as A
from . import aten_nn
from .convert import host_array, numpy_dtype, to_array, to_tensor

# ---- tilefuse::attention: SDPA as one op, forward and backward ----------------------------

@torch.library.custom_op("tilefuse::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
              scale: float | None) -> Tensor:
    """softmax(q kᵀ·scale + mask) v with torch's SDPA rules; compiled graphs run it as one
    tilefuse fused_attention (eagerly it is PyTorch's own SDPA)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


@attention.register_fake
def _attention_fake(q, k, v, mask, causal, scale):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


@torch.library.custom_op("tilefuse::attention_backward", mutates_args=())
def attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, mask: Tensor | None,
                       causal: bool, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of tilefuse::attention (compiled: one fused_attention_bwd, which reads the
    forward's output `out`)."""
    with torch.enable_grad():
        qkv = [t.detach().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*qkv, attn_mask=mask, is_causal=causal, scale=scale)
        return torch.autograd.grad(out, qkv, grad)


@attention_backward.register_fake
def _attention_backward_fake(grad, q, k, v, out, mask, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_setup(ctx, inputs, output):
    q, k, v, mask, causal, scale = inputs
    ctx.save_for_backward(q, k, v, output, mask)
    ctx.causal, ctx.scale = causal, scale


def _attention_vjp(ctx, grad):
    q, k, v, out, mask = ctx.saved_tensors
    dq, dk, dv = attention_backward(grad, q, k, v, out, mask, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


attention.register_autograd(_attention_vjp, setup_context=_attention_setup)


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as tilefuse::attention where fused_attention computes it (no dropout, no grouped
    heads, no gradient for the mask); else PyTorch's own SDPA (decomposed by AOTAutograd)."""
    fused = (dropout_p == 0.0 and not enable_gqa and q.dim() >= 3 and q.dtype.is_floating_point
             and (attn_mask is None or not attn_mask.requires_grad))
    if fused:
        return attention(q, k, v, attn_mask, is_causal, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


A.OPS[torch.ops.tilefuse.attention.default] = aten_nn.attention_rule
A.OPS[torch.ops.tilefuse.attention_backward.default] = aten_nn.attention_backward_rule
# SDPA reaches AOTAutograd's decompositions below autograd: its derivative stays the flash
# kernel's. Dynamo's graph is rewritten first (use_tilefuse_attention) so that autograd sees
# tilefuse::attention and its backward instead.
_SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)


def use_tilefuse_attention(gm: torch.fx.GraphModule) -> int:
    """Point dynamo's SDPA calls at _sdpa; returns how many it changed."""
    changed = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _SDPA_TARGETS:
            n.target = _sdpa
            changed += 1
    if changed:
        gm.recompile()
    return changed


def decompositions() -> dict:
    """The decompositions AOTAutograd applies: PyTorch's core ATen set."""
    from torch._decomp import core_aten_decompositions
    return dict(core_aten_decompositions())


# ---- one FX graph -> one jitted function --------------------------------------------------

def _name(target) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload) else \
        getattr(target, "__name__", repr(target))


def _where(node) -> str:
    """The user's line that made a node, from the stack trace dynamo recorded."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    for line in reversed(trace):
        line = line.strip()
        if line.startswith("File "):
            try:
                fn, rest = line[6:].split('", line ', 1)
                lineno = int(rest.split(",")[0])
                return f"{fn}:{lineno}  `{linecache.getline(fn, lineno).strip()}`"
            except ValueError:
                return line
    return ""


def check_supported(gm: torch.fx.GraphModule) -> None:
    """Raise UnsupportedOpError naming every op of the graph that has no tilefuse rule."""
    missing: dict = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and A.rule_for(n.target) is None:
            missing.setdefault(_name(n.target), n)
        elif n.op in ("call_module", "call_method"):
            missing.setdefault(f"{n.op} {n.target}", n)
    if missing:
        lines = [f"  {op}" + (f"  (from {_where(n)})" if _where(n) else "") for op, n in missing.items()]
        raise A.UnsupportedOpError(
            "tilefuse.torch has no rule for these ATen ops, so it cannot compile this graph "
            "(it never falls back to eager PyTorch on its own):\n" + "\n".join(lines) +
            "\nWrite the code with supported ops, or keep that part out of torch.compile "
            "(torch.compiler.disable). tilefuse.torch.supported_ops() lists what is supported.")


def _conform(node, value, meta):
    """Cast a rule's result to PyTorch's dtype for the node and check its shape."""
    if isinstance(meta, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(meta):
            raise A.UnsupportedOpError(f"tilefuse.torch: the rule for {_name(node.target)} returned "
                                       f"{type(value).__name__}, expected {len(meta)} results")
        return tuple(_conform(node, v, m) for v, m in zip(value, meta))
    if not isinstance(meta, torch.Tensor) or value is None:
        return value
    value = tnp.asarray(value) if isinstance(value, (bool, int, float)) else value
    want = tuple(meta.shape)
    if all(isinstance(s, int) for s in want) and tuple(tnp.shape(value)) != want:
        raise tx.ShapeError(f"tilefuse.torch: the rule for {_name(node.target)} ({node.name}) gave "
                            f"shape {tuple(tnp.shape(value))}, PyTorch's is {want}"
                            + (f"\n  from {_where(node)}" if _where(node) else ""))
    dt = numpy_dtype(meta.dtype)
    return tnp.astype(value, dt) if tnp.result_type(value) != dt else value


def interpret(gm: torch.fx.GraphModule, inputs: list, key=None) -> list:
    """Evaluate an ATen graph on tilefuse values (under jit: traced once per signature)."""
    env: dict = {}
    it = iter(inputs)
    count = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(it)
        elif n.op == "get_attr":
            v = getattr(gm, n.target)  # a constant tensor of the graph: a constant here too
            env[n] = tnp.asarray(host_array(v)) if isinstance(v, torch.Tensor) else v
        elif n.op == "call_function":
            args = map_arg(n.args, env.__getitem__)
            kwargs = dict(map_arg(n.kwargs, env.__getitem__))
            if n.target in A.RANDOM:
                kwargs["key"] = txr.fold_in(key, count)
                count += 1
            try:
                out = A.rule_for(n.target)(*args, **kwargs)
            except Exception as e:
                if hasattr(e, "add_note"):
                    where = _where(n)
                    e.add_note(f"in tilefuse.torch's rule for {_name(n.target)} ({n.name})"
                               + (f", from {where}" if where else ""))
                raise
            env[n] = _conform(n, out, n.meta.get("val"))
        elif n.op == "output":
            return list(map_arg(n.args[0], env.__getitem__))
    raise AssertionError("an FX graph without an output node")


class CompiledGraph:
    """One ATen graph compiled for a device; called (boxed) with the graph's inputs, it returns
    its outputs as tensors."""

    def __init__(self, gm: torch.fx.GraphModule, device):
        check_supported(gm)
        # boxed: called with one list of inputs; an instance attribute, so the wrapper
        # torch._dynamo.disable puts around backward graphs copies it (functools.wraps)
        self._boxed_call = True
        self.gm, self.device = gm, device
        self.host_memory = device.backend.host_memory(device)
        places = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.tensor_in = [i for i, n in enumerate(places) if isinstance(n.meta.get("val"), torch.Tensor)]
        self.static_in = [i for i in range(len(places)) if i not in self.tensor_in]
        out = next(n for n in gm.graph.nodes if n.op == "output")
        # each output: ("input", i) passes input i through, ("value", k) is the jitted function's
        # k-th result, ("static", j) the j-th Python value (a size) the trace found
        self.outputs, self._values, self._statics, self._out_dtypes = [], [], [], []
        # outputs that stay on the device where it is not host memory: the new values of inputs
        # the graph mutates (AOTAutograd puts them first and copies them into the inputs: an
        # optimizer's parameters), and the activations a forward graph saves for its backward
        # graph (from the index partition() notes)
        self._saved_from = gm.meta.get("tilefuse_saved_from", len(out.args[0]))
        self._mutated = 0 if gm.meta.get("tilefuse_backward") else _mutated_inputs()
        self._stay = []
        for j, o in enumerate(out.args[0]):
            if isinstance(o, torch.fx.Node) and o.op == "placeholder":
                self.outputs.append(("input", places.index(o)))
            elif isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor):
                self.outputs.append(("value", len(self._values)))
                self._values.append(j)
                self._out_dtypes.append(o.meta["val"].dtype)
                self._stay.append(j >= self._saved_from or j < self._mutated)
            else:
                self.outputs.append(("static", len(self._statics)))
                self._statics.append(j)
        self.random = any(n.op == "call_function" and n.target in A.RANDOM for n in gm.graph.nodes)
        self._jitted: dict = {}  # static inputs (sizes) -> (jitted function, static outputs)
        self.calls = 0

    def _specialise(self, statics: tuple):
        """The jitted function for one set of static inputs (sizes of a dynamic-shape graph):
        the arrays (and a seed when the graph draws random numbers) are its only arguments."""
        found: list = []

        def run(*arrays):
            inputs = [None] * (len(self.tensor_in) + len(self.static_in))
            for i, a in zip(self.tensor_in, arrays):
                inputs[i] = a
            for i, s in zip(self.static_in, statics):
                inputs[i] = s
            key = txr.key(arrays[-1]) if self.random else None
            outs = interpret(self.gm, inputs, key)
            found[:] = [outs[j] for j in self._statics]
            return [outs[j] for j in self._values]
        run.__name__ = run.__qualname__ = f"torch_graph_{id(self.gm):x}"
        entry = self._jitted[statics] = (tx.jit(run, device=self.device), found)
        return entry

    def __call__(self, *args):
        # AOTAutograd calls boxed: one list, which we empty so inputs can be freed early
        boxed = len(args) == 1 and type(args[0]) is list
        args = args[0] if boxed else list(args)
        dev = self.device
        arrays = [to_array(args[i], dev) for i in self.tensor_in]
        statics = tuple(int(args[i]) if isinstance(args[i], (int, torch.SymInt)) else args[i]
                        for i in self.static_in)
        jitted, found = self._jitted.get(statics) or self._specialise(statics)
        self.calls += 1
        if self.random:  # a fresh key per call from torch's generator (torch.manual_seed holds)
            arrays.append(np.asarray(torch.randint(0, 2**31 - 1, ()).item(), np.int32))
        results = jitted(*arrays)
        made: dict = {}
        outs = []
        for kind, x in self.outputs:
            if kind == "input":
                outs.append(args[x])
            elif kind == "value":
                a = results[x]
                if id(a) not in made:
                    t = to_tensor(a, self.host_memory, self._stay[x])
                    made[id(a)] = t if t.dtype == self._out_dtypes[x] else t.to(self._out_dtypes[x])
                outs.append(made[id(a)])
            else:
                outs.append(found[x])
        args.clear()
        return outs


def partition(joint_module, joint_inputs, *, num_fwd_outputs, **kwargs):
    """AOTAutograd's min-cut partition (as Inductor's), noting on the forward graph where its
    outputs for the backward graph start, so they can stay on the device."""
    from functorch.compile import min_cut_rematerialization_partition
    fw, bw = min_cut_rematerialization_partition(joint_module, joint_inputs,
                                                 num_fwd_outputs=num_fwd_outputs, **kwargs)
    fw.meta["tilefuse_saved_from"] = num_fwd_outputs
    bw.meta["tilefuse_backward"] = True
    return fw, bw


def _mutated_inputs() -> int:
    """How many inputs the graph AOTAutograd is compiling mutates (their new values are its
    first outputs), from the metadata of the trace in progress; 0 when there is none."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None)
    return getattr(meta, "num_mutated_inp_runtime_indices", 0) or 0


def compile_fx_graph(gm: torch.fx.GraphModule, example_inputs, device) -> CompiledGraph:
    return CompiledGraph(gm, device)


def backend(device=None):
    """A torch.compile backend that runs on a tilefuse device:
    `torch.compile(model, backend=tilefuse.torch.backend(device="opencl:0"))`.

    Forward and backward become core-ATen graphs (AOTAutograd), each compiled by tx.jit for
    `device` (default: tilefuse's default device when the graph compiles). The backend's
    `.graphs` lists the CompiledGraphs it made (each with .gm, .device and .calls)."""
    from torch._dynamo.backends.common import aot_autograd

    dev = tx.get_device(device) if device is not None else None

    graphs: list = []

    def compiler(gm, example_inputs):
        graph = compile_fx_graph(gm, example_inputs, dev or tx.default_device())
        graphs.append(graph)
        return graph

    aot = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, inference_compiler=compiler,
                       decompositions=decompositions(),
                       partition_fn=partition)

    def tilefuse_backend(gm: torch.fx.GraphModule, example_inputs):
        use_tilefuse_attention(gm)
        return aot(gm, example_inputs)
    tilefuse_backend.graphs = graphs  # every CompiledGraph made so far (forward, backward...)
    return tilefuse_backend
