"""The profiler: `with tx.profile() as prof:` records every launch on every device.

Each record holds the kernel's name, the graph equations it came from, the device and queue,
start and end (a monotonic clock on the host devices; the OpenCL event's own timestamps on
OpenCL, placed on the host clock through the event's queued time), and the FLOPs and bytes the
launch moves, estimated from the kernel IR (compiled kernels) or from the equation (the `ref`
interpreter). From them: `prof.summary()` (a table sorted by time: share, GFLOP/s, GB/s, percent
of the device's roofline from DeviceInfo, compute- or memory-bound), `prof.export_chrome_trace`
(Perfetto / chrome://tracing, one track per device and queue) and `prof.plot_roofline()`.

Launch loops read the module global `active` once per program call: with profiling off, that
load is the whole cost (benchmarks/bench_profiler.py measures it)."""
from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass

import numpy as np

from tilefuse.ir.kernel import ir as K

active: "Profile | None" = None  # the session that launches report to; None: profiling is off
_lock = threading.Lock()

# ops that are data movement, logic or comparisons, not floating-point arithmetic
_NOT_FLOPS = {"not", "and", "or", "xor", "shift_left", "shift_right_logical", "is_finite", "abs", "neg",
              "sign", "floor", "ceil", "round"}
_EQN_NO_FLOPS = {"convert_element_type", "broadcast_in_dim", "reshape", "transpose", "slice", "rev",
                 "concatenate", "pad", "gather", "select", "iota", "stop_gradient", "copy"}


@dataclass(frozen=True)
class LaunchInfo:
    """What a launch is: fixed per compiled step, so computed once per session."""
    name: str
    kind: str
    eqns: tuple  # the graph equations it computes
    impl: str
    device: object
    queue: str
    flops: float
    bytes: float
    kernel: object = None  # the kernel IR, for compiled launches

    @property
    def eqn_text(self) -> str:
        return ", ".join(dict.fromkeys(e.prim.name for e in self.eqns)) or self.name

    @property
    def sources(self) -> tuple:
        return tuple(dict.fromkeys(e.source for e in self.eqns if e.source))


@dataclass(frozen=True)
class Record:
    """One launch: what ran, and when (nanoseconds on the host's perf_counter clock)."""
    info: LaunchInfo
    start_ns: int
    end_ns: int

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) * 1e-9


# ---- cost estimates ---------------------------------------------------------------------------

def kernel_cost(kernel: K.Kernel) -> tuple[float, float]:
    """(FLOPs, bytes) of one run of a kernel: every floating-point op of its expression DAGs,
    counted once per parallel point, or once per reduction point for the ops that depend on the
    reduction index; bytes are what each buffer's loads or stores touch, at most the buffer."""
    red = int(np.prod(kernel.reduce_shape, dtype=np.int64)) if kernel.reduce_shape else 1
    size = kernel.size
    dep: dict = {}
    flops = 0
    loads: dict[int, int] = {}
    seen: set = set()
    for st in kernel.stores:
        for n in st.value.toposort() + st.offset.toposort():
            if n in seen:
                continue
            seen.add(n)
            per_point = red if K.reads_ridx(n, dep) or n.op == "reduce" else 1
            if n.op == "load":
                loads[n.arg] = loads.get(n.arg, 0) + per_point
            elif n.src and n.src[0].dtype.kind == "f" and n.op not in _NOT_FLOPS and \
                    n.op in K.UNARY + K.BINARY + ("reduce",):
                flops += per_point
    nbytes, rows = 0, kernel.row_stores
    for i, b in enumerate(kernel.buffers):
        item = np.dtype(b.dtype).itemsize
        touched = loads.get(i, 0) * size if i < kernel.n_inputs else \
            sum(red if st in rows else 1 for st in kernel.stores if st.buffer == i) * size
        nbytes += min(touched, b.size) * item
    return float(flops * size), float(nbytes)


def _size(x) -> int:
    return int(np.prod(getattr(x, "shape", ()), dtype=np.int64))


def _nbytes(x) -> int:
    return _size(x) * np.dtype(x.dtype).itemsize


def eqn_cost(prim, params: dict, inputs, outputs) -> tuple[float, float]:
    """(FLOPs, bytes) of one primitive application on arrays or avals: elementwise arithmetic one
    op per output element, a dot 2·M·N·K, a reduction one op per input element."""
    inputs = [getattr(x, "aval", x) for x in inputs]
    outputs = [getattr(x, "aval", x) for x in outputs]
    nbytes = float(sum(_nbytes(x) for x in inputs + outputs))
    floats = any(np.dtype(x.dtype).kind == "f" or np.dtype(x.dtype).name == "bfloat16"
                 for x in inputs + outputs)
    name = prim.name
    if not floats or name in _EQN_NO_FLOPS or not outputs:
        return 0.0, nbytes
    if name in ("fused_attention", "fused_attention_stats", "fused_attention_bwd"):
        return _attention_flops(inputs, params) * (2.5 if name.endswith("bwd") else 1.0), nbytes
    if name in ("conv", "fused_conv"):  # 2 per multiply-add: output elements x input features per group x taps
        rs = params["dimension_numbers"][1]
        w = inputs[1]
        return 2.0 * _size(outputs[0]) * int(np.prod([w.shape[a] for a in rs[1:]], dtype=np.int64)), nbytes
    if name == "dot_general":
        (lc, _), _ = params["dimension_numbers"]
        k = int(np.prod([inputs[0].shape[i] for i in lc], dtype=np.int64))
        return 2.0 * _size(outputs[0]) * k, nbytes
    if name.startswith("reduce_") or name.startswith("arg"):
        return float(_size(inputs[0])), nbytes
    return float(_size(outputs[0])), nbytes


def _attention_flops(inputs, params: dict) -> float:
    """softmax(q kᵀ) v: 2·Sq·Sk·(D + Dv) per batch entry, halved when causal (the backward pass
    does 2.5 times that: FlashAttention's count)."""
    q, k, v = inputs[:3]
    qd, kd, vd = params["dims"]
    qs = [q.shape[i] for i in qd]
    batch, sq, d = int(np.prod(qs[:-2], dtype=np.int64)), qs[-2], qs[-1]
    sk, dv = k.shape[kd[-2]], v.shape[vd[-1]]
    return 2.0 * batch * sq * sk * (d + dv) * (0.5 if params.get("causal") else 1.0)


# ---- the session --------------------------------------------------------------------------------

def _queue_of(device) -> str:
    kind = getattr(device, "kind", "")
    return {"cpu": "thread pool", "ref": "numpy"}.get(kind, "queue 0")


class Profile:
    """A profiling session (see the module docstring). Use it through `tx.profile()`."""

    def __init__(self):
        self._raw: list = []  # (info, host start ns, host end ns, event or None)
        self._steps: dict = {}  # id(steps) -> (steps, timed steps): wrapped once per program
        self._eqn_infos: dict = {}
        self._records: list[Record] | None = None
        self.t0_ns = time.perf_counter_ns()
        self._outer = None

    # -- the context --
    def __enter__(self) -> "Profile":
        global active
        with _lock:
            self._outer, active = active, self
        self.t0_ns = time.perf_counter_ns()
        return self

    def __exit__(self, *exc) -> None:
        global active
        with _lock:
            active = self._outer
        for dev in {id(r[0].device): r[0].device for r in self._raw}.values():
            sync = getattr(dev, "synchronize", None)
            if sync is not None:
                sync()  # every launch has finished: its end time is known
        self._records = None

    # -- hooks for the launch loops --
    def steps(self, steps: list, launches, device) -> list:
        """A compiled program's (fn, gather) steps with each fn timed; launches[i] describes
        steps[i]. Built once per program and session."""
        hit = self._steps.get(id(steps))
        if hit is not None and hit[0] is steps:
            return hit[1]
        timed = [(self._timed(fn, self._launch_info(launch, device)), gather)
                 for (fn, gather), launch in zip(steps, launches)]
        self._steps[id(steps)] = (steps, timed)
        return timed

    def _launch_info(self, launch, device) -> LaunchInfo:
        if launch.kernel is not None and launch.kernel.stores:
            flops, nbytes = kernel_cost(launch.kernel)
        else:
            flops = nbytes = 0.0
            for e in launch.eqns:
                f, b = eqn_cost(e.prim, e.params, e.inputs, e.outputs)
                flops, nbytes = flops + f, nbytes + b
        return LaunchInfo(launch.name, launch.kind, tuple(launch.eqns), launch.impl, device,
                          _queue_of(device), flops, nbytes, launch.kernel)

    def _timed(self, fn, info: LaunchInfo):
        raw, clock = self._raw, time.perf_counter_ns
        device = info.device
        host = getattr(device, "kind", "") in ("cpu", "ref")

        def run(buffers):
            t0 = clock()
            out = fn(buffers)
            event = out if hasattr(out, "profile") else None  # an OpenCL event: device timestamps
            if not host and event is None:
                device.synchronize()  # no event to ask: time the launch to its end on the host
            raw.append((info, t0, clock(), event))
            return out
        return run

    def apply(self, device):
        """An `apply(eqn, inputs)` for eval_graph that times each equation (the ref backend)."""
        raw, clock, infos = self._raw, time.perf_counter_ns, self._eqn_infos

        def apply(e, xs):
            t0 = clock()
            outs = e.prim.impl(*xs, **e.params)
            t1 = clock()
            info = infos.get(id(e))
            if info is None or info.eqns[0] is not e:
                flops, nbytes = eqn_cost(e.prim, e.params, e.inputs, e.outputs)
                info = infos[id(e)] = LaunchInfo(e.prim.name, "eqn", (e,), "ref", device,
                                                 _queue_of(device), flops, nbytes)
            raw.append((info, t0, t1, None))
            return outs
        return apply

    def call(self, device, prim, params: dict, fn, inputs):
        """Run and time one eager primitive call `fn()` on a host device (the ref backend)."""
        t0 = time.perf_counter_ns()
        outs = fn()
        t1 = time.perf_counter_ns()
        flops, nbytes = eqn_cost(prim, params, list(inputs), [np.asarray(o) for o in outs])
        info = LaunchInfo(prim.name, "eager", (), "ref", device, _queue_of(device), flops, nbytes)
        self._raw.append((info, t0, t1, None))
        return outs

    # -- results --
    @property
    def records(self) -> list[Record]:
        """Every launch, in launch order (reading this waits for pending OpenCL events)."""
        if self._records is None or len(self._records) != len(self._raw):
            self._records = [_resolve(*r) for r in list(self._raw)]
        return self._records

    def __len__(self):
        return len(self._raw)

    def rows(self) -> list[dict]:
        """One row per (device, kernel) with its calls, time, share and rates, slowest first."""
        groups: dict = {}
        for r in self.records:
            key = (str(r.info.device), r.info.name)
            g = groups.get(key)
            if g is None:
                g = groups[key] = {"kernel": r.info.name, "device": str(r.info.device), "calls": 0,
                                   "seconds": 0.0, "flops": 0.0, "bytes": 0.0, "eqns": r.info.eqn_text,
                                   "impl": r.info.impl, "info": r.info}
            g["calls"] += 1
            g["seconds"] += r.seconds
            g["flops"] += r.info.flops
            g["bytes"] += r.info.bytes
        total = sum(g["seconds"] for g in groups.values())
        for g in groups.values():
            _rates(g, total)
        return sorted(groups.values(), key=lambda g: -g["seconds"])

    def total_seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    def summary(self, top: int | None = None) -> str:
        """A table of the kernels, slowest first: calls, total time, share of the total, GFLOP/s,
        GB/s, percent of the roofline, the bound and the equations."""
        rows = self.rows()
        shown = rows if top is None else rows[:top]
        head = ["kernel", "device", "calls", "total ms", "share %", "GFLOP/s", "GB/s", "roofline %",
                "bound", "equations"]

        def num(v, f):
            return "-" if v is None else format(v, f)
        cells = [[g["kernel"], g["device"], str(g["calls"]), f"{g['seconds'] * 1e3:.3f}",
                  f"{g['share'] * 100:.1f}", num(g["gflops"], ".2f"), num(g["gbps"], ".2f"),
                  num(g["roofline"], ".1f"), g["bound"], _clip(g["eqns"], 40)] for g in shown]
        widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(head)]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        out = [line(head), line(["-" * w for w in widths])] + [line(c) for c in cells]
        if len(shown) < len(rows):
            out.append(f"... {len(rows) - len(shown)} more kernels")
        out.append(f"{len(self.records)} launches, {self.total_seconds() * 1e3:.3f} ms in kernels")
        return "\n".join(out)

    def __str__(self):
        return self.summary()

    def chrome_trace(self) -> dict:
        """The Chrome trace-event JSON object: one complete ("X") event per launch, a process per
        device and a thread per queue."""
        pids: dict = {}
        events = []
        for r in self.records:
            dev = str(r.info.device)
            pid = pids.setdefault(dev, len(pids) + 1)
            events.append({"name": r.info.name, "cat": r.info.kind or "kernel", "ph": "X", "pid": pid,
                           "tid": 1, "ts": (r.start_ns - self.t0_ns) / 1e3,
                           "dur": max(r.end_ns - r.start_ns, 0) / 1e3,
                           "args": {"equations": r.info.eqn_text, "sources": list(r.info.sources),
                                    "impl": r.info.impl, "flops": r.info.flops, "bytes": r.info.bytes}})
        meta = []
        queues = {str(r.info.device): r.info.queue for r in self.records}
        for dev, pid in pids.items():
            meta.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": dev}})
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 1,
                         "args": {"name": queues[dev]}})
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}

    def export_chrome_trace(self, path: str) -> str:
        """Write the trace as JSON to `path` (open it in https://ui.perfetto.dev); returns path."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return path

    def plot_roofline(self, path: str | None = None, device=None, annotate: int = 5):
        """The kernels on their device's roofline (matplotlib, from the `notebooks` or `tune`
        extra): arithmetic intensity against GFLOP/s, marker area by time share. Returns the
        Figure; saves it to `path` if given."""
        try:
            import matplotlib
            if path is not None:
                matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("plot_roofline needs matplotlib: pip install 'tilefuse[notebooks]'") from e
        rows = [g for g in self.rows() if g["flops"] > 0 and g["bytes"] > 0
                and (device is None or g["device"] == str(device))]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        devices = {g["device"]: g["info"].device for g in rows}
        intensities = [g["flops"] / g["bytes"] for g in rows] or [1.0]
        xs = np.logspace(math.log10(min(intensities) / 4), math.log10(max(intensities) * 4), 100)
        for name, dev in devices.items():
            info = getattr(dev, "info", None)
            if info is not None and info.peak_gflops and info.peak_gbps:
                ax.plot(xs, np.minimum(info.peak_gflops, xs * info.peak_gbps), label=f"{name} roofline")
        for i, g in enumerate(rows):
            ai = g["flops"] / g["bytes"]
            ax.scatter([ai], [g["gflops"]], s=20 + 400 * g["share"], alpha=0.6)
            if i < annotate:
                ax.annotate(_clip(g["kernel"], 24), (ai, g["gflops"]), fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP/byte)")
        ax.set_ylabel("GFLOP/s")
        ax.set_title("kernels on the roofline")
        if devices:
            ax.legend(fontsize=7)
        if path is not None:
            fig.savefig(path, dpi=120, bbox_inches="tight")
        return fig


def _resolve(info: LaunchInfo, t0: int, t1: int, event) -> Record:
    """A record on the host clock; an OpenCL event's device times are shifted so that its queued
    time falls at the host time of the enqueue."""
    if event is None:
        return Record(info, t0, t1)
    try:
        if hasattr(event, "wait"):  # (an OpenCL event; WebGPU's timestamps wait as they are read)
            event.wait()
        p = event.profile
        queued, start, end = p.queued, p.start, p.end
    except Exception:  # a driver without profiling information: the host's view of the launch
        return Record(info, t0, t1)
    return Record(info, t0 + (start - queued), t0 + (end - queued))


def _rates(g: dict, total: float) -> None:
    """Share, GFLOP/s, GB/s, percent of the roofline and the bound, into the row g."""
    s = g["seconds"]
    g["share"] = s / total if total > 0 else 1.0 / max(1, g["calls"])
    g["gflops"] = g["flops"] / s / 1e9 if s > 0 else None
    g["gbps"] = g["bytes"] / s / 1e9 if s > 0 else None
    info = getattr(g["info"].device, "info", None)
    peak_f, peak_b = (info.peak_gflops, info.peak_gbps) if info is not None else (0.0, 0.0)
    ai = g["flops"] / g["bytes"] if g["bytes"] else math.inf
    g["bound"] = "-" if not (peak_f and peak_b) else "compute" if ai >= peak_f / peak_b else "memory"
    g["roofline"] = None
    if s > 0 and peak_f and peak_b:
        if g["flops"]:
            g["roofline"] = 100 * g["gflops"] / min(peak_f, ai * peak_b)
        elif g["bytes"]:
            g["roofline"] = 100 * g["gbps"] / peak_b


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[:n - 1] + "…"


def profile() -> Profile:
    """`with tx.profile() as prof:` records every launch on every device until the block ends;
    then `print(prof.summary())`, `prof.export_chrome_trace("trace.json")`, `prof.plot_roofline()`."""
    return Profile()
