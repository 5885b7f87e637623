"""The pass pipeline, readable top to bottom, and the pass manager that runs it.

`run_passes(graph, dump_dir=..., check=...)`: with a dump directory every pass's graph is
written there as text and DOT (TILEFUSE_DUMP); with check every result is type-checked
(TILEFUSE_CHECK). The runtime passes those settings in: ir reads no configuration itself."""
from __future__ import annotations

import itertools
import os
import weakref
from typing import Callable, Sequence

from ..core import Graph, typecheck_graph
from .attention import attention_stats, fuse_attention
from .conv import conv_layouts
from .cse import cse
from .dce import dce
from .fold import fold_constants
from .gemm_epilogue import fuse_gemm_epilogues
from .inline import inline_calls
from .loops import hoist_loop_invariants, prune_control_flow
from .simplify import dot_layouts, fold_transpose_into_dot, simplify
from .. import primitives as P

PIPELINE: tuple[tuple[str, Callable[[Graph], Graph]], ...] = (
    ("inline_calls", inline_calls),                        # calls (tile_op, custom_vjp) become their bodies
    ("dce", dce),                                          # drop what nobody reads
    ("prune_control_flow", prune_control_flow),            # and the loop/branch outputs nobody reads
    ("cse", cse),                                          # one copy of each computation
    ("fold_constants", fold_constants),                    # evaluate what is known now
    ("simplify", simplify),                                # x*1, double transposes, ...
    ("fold_transpose_into_dot", fold_transpose_into_dot),  # dot absorbs operand transposes
    ("conv_layouts", conv_layouts),                        # conv reads NCHW-like rows, writes whole positions
    ("hoist_loop_invariants", hoist_loop_invariants),      # loop bodies' work on constants, once
    ("fuse_attention", fuse_attention),                    # softmax(q·kᵀ·scale + mask)·v -> one op
    ("dot_layouts", dot_layouts),                          # the other dots' operands as the GEMM reads them
    ("fuse_gemm_epilogues", fuse_gemm_epilogues),          # dot + bias + activation -> fused_gemm
    ("cse_after", cse),                                    # rewrites expose new duplicates
    ("attention_stats", attention_stats),                  # attention's backward reads its forward's stats
    ("dce_after", dce),                                    # and leave dead producers behind
    ("prune_after", prune_control_flow),                   # and loop constants nobody reads now
)

# Structural rewrites into primitives that have differentiation and batching rules, run on a
# function's graph before it is differentiated (jit(grad(f)) and grad(jit(f))), so the rule of
# the fused primitive writes the backward: autodiff's own backward would read the intermediates
# (the attention weights) and keep the forward from fusing.
BEFORE_AD: tuple[tuple[str, Callable[[Graph], Graph]], ...] = (
    ("fuse_attention", fuse_attention),                    # its VJP is fused_attention_bwd
)


_prepared: "weakref.WeakKeyDictionary[Graph, Graph]" = weakref.WeakKeyDictionary()
_UNCHANGED = Graph((), (), (), ())


def prepare_for_ad(graph: Graph) -> Graph:
    """The BEFORE_AD rewrites of a graph about to be differentiated (once per graph: a jitted
    function's graph is replayed at every call under grad)."""
    hit = _prepared.get(graph)
    if hit is None:
        hit = run_passes(graph, BEFORE_AD)
        _prepared[graph] = hit if hit is not graph else _UNCHANGED  # (no strong ref to the key)
    return graph if hit is _UNCHANGED else hit


def in_bodies(fn: Callable[[Graph], Graph]) -> Callable[[Graph], Graph]:
    """A pass run on the bodies of control flow first (innermost first), then on the graph."""
    def run(graph: Graph) -> Graph:
        if any(e.prim in P.CONTROL_FLOW for e in graph.eqns):
            eqns = []
            for e in graph.eqns:
                params = P.replace_subgraphs(e.params, run) if e.prim in P.CONTROL_FLOW else e.params
                eqns.append(e if params is e.params else e.replace(params=params))
            if any(a is not b for a, b in zip(eqns, graph.eqns)):
                graph = graph.replace(eqns=tuple(eqns))
        return fn(graph)
    return run


_dump_ids = itertools.count()


class Dump:
    """Writes the stages of one compilation into dump_dir/<nnnn>_<name>/ (nothing if dir is None)."""

    def __init__(self, dump_dir: str | None, name: str = "graph"):
        self.dir = None
        self.step = 0
        if dump_dir:
            self.dir = os.path.join(dump_dir, f"{next(_dump_ids):04d}_{name}")
            os.makedirs(self.dir, exist_ok=True)

    def _path(self, stage: str, ext: str) -> str:
        return os.path.join(self.dir, f"{self.step:02d}_{stage}.{ext}")

    def graph(self, stage: str, g: Graph) -> None:
        if self.dir is None:
            return
        with open(self._path(stage, "txt"), "w") as f:
            f.write(str(g) + "\n")
        with open(self._path(stage, "dot"), "w") as f:
            f.write(g.to_dot(stage) + "\n")
        self.step += 1

    def text(self, stage: str, text: str) -> None:
        if self.dir is None:
            return
        with open(self._path(stage, "txt"), "w") as f:
            f.write(text + "\n")
        self.step += 1


def run_passes(graph: Graph, passes: Sequence = PIPELINE, *, dump: Dump | None = None,
               check: bool = False, trace: Callable[[str, Graph], None] | None = None) -> Graph:
    """Run `passes` in order. `trace(name, graph)` is called after each (for TILEFUSE_DEBUG=2)."""
    if dump is not None:
        dump.graph("input", graph)
    if check:
        typecheck_graph(graph)
    for name, fn in passes:
        graph = in_bodies(fn)(graph)
        if check:
            try:
                typecheck_graph(graph)
            except AssertionError as err:
                raise AssertionError(f"the graph does not type-check after pass {name}: {err}") from err
        if dump is not None:
            dump.graph(name, graph)
        if trace is not None:
            trace(name, graph)
    return graph
