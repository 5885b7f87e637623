"""Compile latency: small public-style programs end to end, each in a fresh process, the way a
new user meets them: cold (an empty TILEFUSE_CACHE_DIR) and warm (a second process on the cache
the first one filled), against numpy (with autograd for the gradients), JAX and PyTorch (eager)
where they are installed (absent ones are skipped), and tilefuse's own numpy interpreter (`ref`);
tilefuse's `opencl` device too where one is (cold: PoCL's program cache empty as well).

    python benchmarks/bench_compile.py                      # every program, every framework
    python benchmarks/bench_compile.py --programs mlp,rnn --frameworks cpu,jax
    python benchmarks/bench_compile.py --breakdown          # where tilefuse cpu's cold time goes
    python benchmarks/bench_compile.py --chain 1000,2000,4000,10000   # x = x * a + b under jit

The programs (each a training loop on small random data, with the same final loss everywhere,
checked): logistic regression, an MLP classifier (JAX's MNIST example, smaller), an RNN with a
Python loop under grad (autograd's RNN example: no jit, op by op) and the same under jit, a small
convnet and a VAE. A column's time is the library's import, the program and the process's exit
(a background compile still under way at exit is stopped and waited for); the breakdown adds
up tilefuse's phases inclusively (tracing, passes, fusion, lowering, kernel builds, ...)."""
from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import USER_TIERED, emit, fmt_seconds, run_worker, table  # noqa: E402

FRAMEWORKS = ("numpy", "jax", "torch", "cpu", "opencl", "ref")
CACHED = ("cpu", "opencl", "ref", "jax")  # tilefuse's devices and JAX: cold and warm columns


# ---- the frameworks, behind one small interface -------------------------------------------------

class Lib:
    """What a program needs from a framework: a numpy-like namespace, value_and_grad over a dict
    of parameters, jit (the identity where there is none), conv2d (NCHW/OIHW, valid) and the
    conversions in and out."""
    np = None
    jit = staticmethod(lambda f: f)

    def asarray(self, a):
        return a

    def item(self, x) -> float:
        return float(x)

    def logsumexp(self, x, axis):
        m = self.np.max(x, axis=axis, keepdims=True)
        return m + self.np.log(self.np.sum(self.np.exp(x - m), axis=axis, keepdims=True))


class AutogradLib(Lib):
    def __init__(self):
        import autograd
        import autograd.numpy as anp
        self.np = anp
        self._vg = autograd.value_and_grad

    def value_and_grad(self, f):
        return self._vg(f)

    def conv2d(self, x, w):  # im2col by slices, then one tensordot
        o, c, kh, kw = w.shape
        oh, ow = x.shape[2] - kh + 1, x.shape[3] - kw + 1
        cols = self.np.stack([x[:, :, i:i + oh, j:j + ow] for i in range(kh) for j in range(kw)], axis=2)
        return self.np.einsum("nckhw,ock->nohw", cols, self.np.reshape(w, (o, c, kh * kw)))


class JaxLib(Lib):
    def __init__(self):
        import jax
        import jax.numpy as jnp
        self.np, self._jax = jnp, jax
        self.jit = jax.jit

    def asarray(self, a):
        return self._jax.numpy.asarray(a)

    def value_and_grad(self, f):
        return self._jax.value_and_grad(f)

    def conv2d(self, x, w):
        return self._jax.lax.conv_general_dilated(x, w, (1, 1), "VALID")


class TilefuseLib(Lib):
    def __init__(self, device):
        import tilefuse as tx
        import tilefuse.numpy as tnp
        tx.config.default_device = device
        self.np, self._tx = tnp, tx
        self.jit = tx.jit

    def asarray(self, a):
        return self._tx.device_put(a)

    def value_and_grad(self, f):
        return self._tx.value_and_grad(f)

    def conv2d(self, x, w):
        return self._tx.nn.conv2d(x, w)


class _TorchNumpy:
    """The few numpy names the programs use, on torch tensors."""

    def __init__(self, torch):
        self.t = torch

    def __getattr__(self, name):  # tanh, exp, log, log1p, abs, sigmoid
        return getattr(self.t, name)

    def sum(self, x, axis=None, keepdims=False):
        return self.t.sum(x) if axis is None else self.t.sum(x, dim=axis, keepdim=keepdims)

    def mean(self, x, axis=None, keepdims=False):
        return self.t.mean(x) if axis is None else self.t.mean(x, dim=axis, keepdim=keepdims)

    def max(self, x, axis, keepdims=False):
        return self.t.amax(x, dim=axis, keepdim=keepdims)

    def maximum(self, x, y):
        return self.t.clamp(x, min=y) if isinstance(y, float) else self.t.maximum(x, y)

    def concatenate(self, xs, axis=0):
        return self.t.cat(xs, dim=axis)


class TorchLib(Lib):
    def __init__(self):
        import torch
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
        self.t, self.np = torch, _TorchNumpy(torch)

    def asarray(self, a):
        return self.t.from_numpy(np.ascontiguousarray(a))

    def value_and_grad(self, f):
        def vg(params, *args):
            p = {k: v.detach().requires_grad_() for k, v in params.items()}
            loss = f(p, *args)
            grads = self.t.autograd.grad(loss, list(p.values()))
            return loss.detach(), dict(zip(p, grads))
        return vg

    def conv2d(self, x, w):
        return self.t.nn.functional.conv2d(x, w)


def make_lib(name: str) -> Lib:
    return {"numpy": AutogradLib, "jax": JaxLib, "torch": TorchLib}[name]() if name in ("numpy", "jax", "torch") \
        else TilefuseLib(name)


# ---- the programs ---------------------------------------------------------------------------

def _dense(rng, sizes):
    return {k: v for i, (m, n) in enumerate(zip(sizes, sizes[1:]))
            for k, v in ((f"w{i}", rng.normal(0, 1 / np.sqrt(m), (m, n))), (f"b{i}", np.zeros(n)))}


def _xent(L, logits, onehot):
    logp = logits - L.logsumexp(logits, 1)
    return -L.np.mean(L.np.sum(logp * onehot, axis=1))


def _onehot(rng, n, k):
    return np.eye(k)[rng.integers(0, k, n)]


class LogReg:
    steps, lr, jit = 100, 0.5, True

    def init(self, rng):
        return {"w": np.zeros(32), "b": np.zeros(())}

    def data(self, rng):
        x = rng.normal(size=(512, 32))
        return x, np.sign(x @ rng.normal(size=32) + 0.1 * rng.normal(size=512))

    def loss(self, L, p, x, s):
        z = -s * (x @ p["w"] + p["b"])
        return L.np.mean(L.np.log1p(L.np.exp(z)))


class MLP:
    steps, lr, jit = 50, 0.1, True

    def init(self, rng):
        return _dense(rng, [64, 128, 128, 10])

    def data(self, rng):
        return rng.normal(size=(128, 64)), _onehot(rng, 128, 10)

    def loss(self, L, p, x, y):
        for i in range(3):
            x = x @ p[f"w{i}"] + p[f"b{i}"]
            if i < 2:
                x = L.np.maximum(x, 0.0)
        return _xent(L, x, y)


class RNN:
    """autograd's rnn.py: a Python loop over time under grad, no jit (jit=True: the same unrolled
    under jit, a graph of ~1,000 equations)."""
    steps, lr, jit, T, V, H = 10, 0.1, False, 30, 32, 64

    def init(self, rng):
        return {"w": rng.normal(0, 0.1, (self.V + self.H, self.H)), "b": np.zeros(self.H),
                "wo": rng.normal(0, 0.1, (self.H, self.V)), "bo": np.zeros(self.V),
                "h0": np.zeros((1, self.H))}

    def data(self, rng):
        return (np.stack([_onehot(rng, 16, self.V) for _ in range(self.T)]),)

    def loss(self, L, p, xs):
        h = p["h0"] * L.np.sum(xs[0], axis=1, keepdims=True)  # (16, H)
        total = 0.0
        for t in range(self.T - 1):
            h = L.np.tanh(L.np.concatenate([xs[t], h], axis=1) @ p["w"] + p["b"])
            total = total + _xent(L, h @ p["wo"] + p["bo"], xs[t + 1])
        return total / (self.T - 1)


class RNNJit(RNN):
    jit = True


class ConvNet:
    steps, lr, jit = 20, 0.1, True

    def init(self, rng):
        return {"c1": rng.normal(0, 1 / 3, (8, 1, 3, 3)), "c2": rng.normal(0, 1 / np.sqrt(72), (16, 8, 3, 3)),
                **_dense(rng, [16, 10])}

    def data(self, rng):
        return rng.normal(size=(32, 1, 16, 16)), _onehot(rng, 32, 10)

    def loss(self, L, p, x, y):
        h = L.np.maximum(L.conv2d(x, p["c1"]), 0.0)
        h = L.np.maximum(L.conv2d(h, p["c2"]), 0.0)
        h = L.np.mean(L.np.mean(h, axis=3), axis=2)  # global average pool: (32, 16)
        return _xent(L, h @ p["w0"] + p["b0"], y)


class VAE:
    steps, lr, jit = 30, 0.05, True

    def init(self, rng):
        p = {f"e{k}": v for k, v in _dense(rng, [64, 32]).items()}
        p.update({f"m{k}": v for k, v in _dense(rng, [32, 8]).items()})
        p.update({f"v{k}": v for k, v in _dense(rng, [32, 8]).items()})
        p.update({f"d{k}": v for k, v in _dense(rng, [8, 32, 64]).items()})
        return p

    def data(self, rng):
        return (rng.random((64, 64)) > 0.5).astype(float), rng.normal(size=(64, 8))

    def loss(self, L, p, x, eps):
        n = L.np
        h = n.tanh(x @ p["ew0"] + p["eb0"])
        mu, logvar = h @ p["mw0"] + p["mb0"], h @ p["vw0"] + p["vb0"]
        z = mu + n.exp(0.5 * logvar) * eps
        logits = n.tanh(z @ p["dw0"] + p["db0"]) @ p["dw1"] + p["db1"]
        recon = n.sum(n.maximum(logits, 0.0) - logits * x + n.log1p(n.exp(-n.abs(logits))))
        kl = -0.5 * n.sum(1.0 + logvar - mu * mu - n.exp(logvar))
        return (recon + kl) / 64.0


PROGRAMS = {"logreg": LogReg, "mlp": MLP, "rnn": RNN, "rnn_jit": RNNJit, "convnet": ConvNet, "vae": VAE}


def run_program(L: Lib, prog) -> tuple[float, float]:
    """Train; return (the first step's seconds, the final loss)."""
    rng = np.random.default_rng(0)
    params = {k: L.asarray(np.asarray(v, np.float32)) for k, v in prog.init(rng).items()}
    data = [L.asarray(np.asarray(d, np.float32)) for d in prog.data(rng)]
    vg = L.value_and_grad(functools.partial(prog.loss, L))
    lr = prog.lr

    def step(params, *data):
        loss, g = vg(params, *data)
        return {k: params[k] - lr * g[k] for k in params}, loss
    if prog.jit:
        step = L.jit(step)
    t = time.perf_counter()
    params, loss = step(params, *data)
    L.item(loss)
    first = time.perf_counter() - t
    for _ in range(prog.steps - 1):
        params, loss = step(params, *data)
    return first, L.item(loss)


# ---- tilefuse's phases (inclusive seconds; nested phases are counted in their parents too) ------

PHASES = [  # (label, module, attribute)
    ("trace (jit)", "tilefuse.tracer.jit", "trace_to_graph"),
    ("eager ops (grad without jit)", "tilefuse.runtime.device", "_apply_primitive"),
    ("compile_graph", "tilefuse.runtime.compiler", "compile_graph"),
    ("  front-end cache", "tilefuse.runtime.frontend_cache", "load"),
    ("  passes", "tilefuse.runtime.compiler", "run_passes"),
    ("  fusion (partition)", "tilefuse.runtime.compiler", "partition"),
    ("  lowering", "tilefuse.runtime.compiler", "lower_region"),
    ("  front-end cache store", "tilefuse.runtime.frontend_cache", "store"),
    ("  kernels + planning", "tilefuse.runtime.compiler", "_compile_front"),
    ("    choose implementations", "tilefuse.runtime.dispatch", "choose"),
    ("      GEMM: time generated vs BLAS", "tilefuse.runtime.host_blas", "_measure"),
    ("    parallel builds (workers)", "tilefuse.backends.llvm.parallel", "build_objects"),
    ("      start of workers", "tilefuse.backends.llvm.parallel._Worker", "__init__"),
    ("    kernel builds (dispatch)", "tilefuse.runtime.dispatch", "compile_kernel"),
    ("      render LLVM IR", "tilefuse.backends.llvm.compile", "llvm_text"),
    ("      LLVM parse+opt+codegen", "tilefuse.backends.llvm.compile.Target", "compile_ir"),
    ("        LLVM optimisation", "tilefuse.backends.llvm.compile.Target", "optimize"),
    ("      link (JIT)", "tilefuse.backends.llvm.compile.Target", "load"),
    ("      GEMM templates", "tilefuse.backends.llvm.compile.Target", "module"),
    ("    other backends' kernels", "tilefuse.runtime.tuner", "build"),
]


def _install_timers() -> dict:
    """Wrap each phase's function with a timer; {label: [seconds, calls]}."""
    import importlib
    acc: dict = {}
    for label, mod, attr in PHASES:
        owner_path, _, cls = mod.rpartition(".") if mod.endswith(("._Worker", ".Target")) else (mod, "", "")
        owner = importlib.import_module(owner_path)
        if cls:
            owner = getattr(owner, cls)
        fn = getattr(owner, attr)
        slot = acc.setdefault(label, [0.0, 0])
        depth = [0]

        def timed(*a, _fn=fn, _slot=slot, _depth=depth, **k):
            if _depth[0]:  # recursive (compile_graph of a loop body): count once
                return _fn(*a, **k)
            _depth[0] += 1
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                _depth[0] -= 1
                _slot[0] += time.perf_counter() - t
                _slot[1] += 1
        setattr(owner, attr, timed)
    return acc


# ---- workers and the driver ---------------------------------------------------------------

def worker(program: str, framework: str, breakdown: bool) -> None:
    t0 = time.perf_counter()
    L = make_lib(framework)
    imported = time.perf_counter() - t0
    acc = _install_timers() if breakdown and framework in ("cpu", "ref") else {}
    t = time.perf_counter()
    first, loss = run_program(L, PROGRAMS[program]())
    emit({"import_s": imported, "run_s": time.perf_counter() - t, "first_s": first, "loss": loss,
          "phases": {k: v for k, v in acc.items() if v[1]}})


def chain_worker(n: int, breakdown: bool) -> None:
    import tilefuse as tx
    acc = _install_timers() if breakdown else {}

    def f(x, a, b):
        for _ in range(n):
            x = x * a + b
        return x
    x = np.linspace(0, 1, 64, dtype=np.float32)
    t = time.perf_counter()
    out = np.asarray(tx.jit(f, device="cpu")(x, np.float32(0.999), np.float32(0.001)))
    want = x.copy()
    for _ in range(n):
        want = want * np.float32(0.999) + np.float32(0.001)
    assert np.allclose(out, want, rtol=1e-4), "the chain computed a wrong result"
    emit({"run_s": time.perf_counter() - t, "phases": {k: v for k, v in acc.items() if v[1]}})


def _available(framework: str) -> bool:
    if framework == "opencl":
        import tilefuse as tx
        return any(d.kind == "opencl" for d in tx.devices())
    mod = {"numpy": "autograd", "jax": "jax", "torch": "torch"}.get(framework)
    if mod is None:
        return True
    import importlib.util
    return importlib.util.find_spec(mod) is not None


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "error" in r:
        return "error"
    return fmt_seconds(_end_to_end(r))


def _end_to_end(r: dict) -> float:
    return r["import_s"] + r["run_s"] + r["exit_s"]


def _phase_table(title: str, phases: dict, total: float) -> str:
    rows = [(label, fmt_seconds(phases[label][0]), phases[label][1], f"{100 * phases[label][0] / total:.0f}%")
            for label, _, _ in PHASES if label in phases]
    return table(["phase (inclusive)", "time", "calls", "of total"], rows, title=title)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", default=",".join(PROGRAMS))
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--breakdown", action="store_true", help="tilefuse cpu's phases, cold")
    ap.add_argument("--chain", default="", help="chain lengths to compile (x = x * a + b under jit)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", nargs=2, metavar=("PROGRAM", "FRAMEWORK"), help=argparse.SUPPRESS)
    ap.add_argument("--chain-worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker, args.breakdown)
    if args.chain_worker:
        return chain_worker(args.chain_worker, args.breakdown)
    me = os.path.abspath(__file__)

    def run(argv, cache):
        # (PoCL's own cache too: a new user's is empty)
        return run_worker([me, *argv], env={"TILEFUSE_CACHE_DIR": cache, "POCL_CACHE_DIR": os.path.join(cache, "pocl"),
                                            "TILEFUSE_TIERED": USER_TIERED}, timeout=args.timeout)

    if args.chain:
        rows = []
        for n in (int(s) for s in args.chain.split(",")):
            cache = tempfile.mkdtemp(prefix="tf-chain-")
            r = run(["--chain-worker", str(n)] + (["--breakdown"] if args.breakdown else []), cache)
            shutil.rmtree(cache, ignore_errors=True)
            if "error" in r:
                rows.append((n, r["error"], "", ""))
                continue
            ph = r["phases"]
            fusion = ph.get("  fusion (partition)", [float("nan")])[0]
            rows.append((n, fmt_seconds(r["run_s"]), fmt_seconds(fusion) if ph else "-",
                         f"{r['run_s'] / n * 1e3:.2f}"))
        print(table(["operations", "first call (cold)", "of which fusion", "ms / operation"], rows,
                    title="a chain of x = x * a + b under jit, cold compile cache, one process each"))
        return

    frameworks = [f for f in args.frameworks.split(",") if f]
    for f in frameworks:
        if not _available(f):
            print(f"{f}: not installed, skipped" + (" (pip install autograd)" if f == "numpy" else ""))
    frameworks = [f for f in frameworks if _available(f)]
    results: dict = {}
    breakdowns = []
    for prog in args.programs.split(","):
        for fw in frameworks:
            cache = tempfile.mkdtemp(prefix="tf-bench-")
            try:
                cold = run(["--worker", prog, fw], cache)
                warm = run(["--worker", prog, fw], cache) if fw in CACHED else None
                if args.breakdown and fw == "cpu":
                    shutil.rmtree(cache, ignore_errors=True)
                    os.makedirs(cache)
                    b = run(["--worker", prog, fw, "--breakdown"], cache)
                    if "error" in b:
                        print(f"{prog}: the breakdown failed: {b['error']}", file=sys.stderr)
                    else:
                        breakdowns.append((prog, b))
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            results[prog, fw] = (cold, warm)
            for r in (cold, warm):
                if r and "error" in r:
                    print(f"{prog} on {fw}: {r['error']}", file=sys.stderr)

    headers = ["program"]
    for fw in frameworks:
        headers += [f"{fw} cold", f"{fw} warm"] if fw in CACHED else [fw]
    headers += ["cpu cold / best other", "loss spread"]
    rows = []
    for prog in args.programs.split(","):
        row, others, losses = [prog], [], []
        for fw in frameworks:
            cold, warm = results[prog, fw]
            row.append(_cell(cold))
            if fw in CACHED:
                row.append(_cell(warm))
            if cold and "error" not in cold:
                losses.append(cold["loss"])
                if fw in ("numpy", "jax", "torch"):
                    others.append(_end_to_end(cold))
        cpu = results.get((prog, "cpu"), (None,))[0]
        row.append(f"{_end_to_end(cpu) / min(others):.2f}x"
                   if cpu and "error" not in cpu and others else "-")
        spread = (max(losses) - min(losses)) / max(abs(np.median(losses)), 1e-6) if losses else float("nan")
        row.append(f"{spread:.1e}")
        rows.append(row)
    print(table(headers, rows, title="end to end (import + program + exit), one fresh process each; cold: an "
                "empty compile cache, warm: the cache the cold run filled"))
    first = [[prog] + [fmt_seconds(results[prog, fw][0]["first_s"]) if "error" not in results[prog, fw][0]
                       else "error" for fw in frameworks] for prog in args.programs.split(",")]
    print()
    print(table(["program"] + [f"{fw} first step (cold)" for fw in frameworks], first))
    for prog, b in breakdowns:
        print()
        print(_phase_table(f"tilefuse cpu, cold: {prog} (program {fmt_seconds(b['run_s'])}, import "
                           f"{fmt_seconds(b['import_s'])}, first step {fmt_seconds(b['first_s'])})",
                           b["phases"], b["run_s"]))


if __name__ == "__main__":
    main()
