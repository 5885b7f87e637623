"""The auto-tuner on the CPU: a short search on a GEMM finds a configuration at least as fast as
the default, stores it, and a fresh process's dispatcher builds with it; invalid configurations
are pruned and failing ones survived; a corrupt database is reported and ignored; the command
line tunes a model file. Few trials and small shapes: these tests time real kernels."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse.ir.errors import CompileError
from tilefuse.runtime import tuner

pytest.importorskip("optuna")
needs_cpu = pytest.mark.skipif(not tx.devices("cpu"), reason="the CPU backend is unavailable")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def db(tmp_path, monkeypatch):
    path = str(tmp_path / "tuning.sqlite")
    monkeypatch.setattr(tx.config, "tuning_db", path)
    return path


def _run_python(code: str, db: str, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "TILEFUSE_TUNING_DB": db, **env}
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


@needs_cpu
def test_gemm_tuning_is_stored_and_used_by_a_fresh_process(db, monkeypatch):
    monkeypatch.setattr(tx.config, "gemm", "generated")  # the template, not numpy's BLAS
    rng = np.random.default_rng(0)
    a = rng.standard_normal((96, 64)).astype(np.float32)
    b = rng.standard_normal((64, 160)).astype(np.float32)
    f = tx.jit(lambda x, y: x @ y, device="cpu")
    report = tx.tune(f, a, b, trials=8, progress=False, repeat=3)
    (res,) = [r for r in report.results if r.template == "cpu_gemm"]
    assert res.stored and res.trials == 8 and res.best_seconds <= res.default_seconds
    if res.best != res.default:  # then the whole function was timed both ways
        assert report.default_seconds > 0 and report.tuned_seconds > 0

    # measured again, interleaved: the stored configuration is at least as fast (within noise;
    # the best of five rounds, since other processes share the cores)
    dev = tx.get_device("cpu")
    t = next(t for t in tuner.templates() if t.name == "cpu_gemm")
    runs = [t.build(res.ir, dev, dev.backend, p) for p in (res.default, res.best)]
    bufs = tuner.random_buffers(res.ir, dev)
    times = [[], []]
    for _ in range(5):
        for i, run in enumerate(runs):
            times[i].append(tuner.measure(run, bufs, dev, repeat=3))
    assert min(times[1]) <= 1.3 * min(times[0]), (res.default, res.best, times)
    np.testing.assert_allclose(np.asarray(f(a, b)), a @ b, rtol=1e-4, atol=1e-4)

    code = textwrap.dedent("""
        import json, numpy as np, tilefuse as tx
        from tilefuse.runtime import tuner
        rng = np.random.default_rng(0)
        a = rng.standard_normal((96, 64)).astype(np.float32)
        b = rng.standard_normal((64, 160)).astype(np.float32)
        y = tx.jit(lambda x, y: x @ y, device="cpu")(a, b)
        assert np.allclose(np.asarray(y), a @ b, rtol=1e-4, atol=1e-4)
        print(json.dumps([p for k, p in tuner.applied.items() if k[0] == "cpu_gemm"]))
    """)
    p = _run_python(code, db, TILEFUSE_GEMM="generated")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [res.best]


@needs_cpu
def test_invalid_configurations_are_pruned_and_failing_builds_survived(db):
    from tilefuse.backends.llvm import tuning
    built = []

    def check(params, kernel, device):
        return "too wide" if params["interleave"] >= 4 else None

    def build(kernel, device, backend, params):
        built.append(dict(params))
        if params["interleave"] == 2 and params["vector_bits"] == 128:
            raise CompileError("this configuration does not build")
        return tuning.kernel_build(kernel, device, backend, params)

    def space(kernel, device):
        return {"threads": (1,), "chunks_per_thread": (1,), "vector_bits": (128, 256),
                "interleave": (1, 2, 4, 8)}
    default = {"threads": 1, "chunks_per_thread": 1, "vector_bits": 256, "interleave": 1}
    t = tuner.Template("test_template", "kernel_ir", ("cpu",), space, lambda k, d: default, build, check)
    f = tx.jit(lambda x: tnp.tanh(x) * 2.0, device="cpu")
    x = np.linspace(-1, 1, 4096, dtype=np.float32)
    with tx.profile() as prof:
        f(x)
    kernel = prof.records[0].info.kernel
    res = tuner.tune_kernel(kernel, "cpu", trials=16, template=t, store=False, repeat=3)
    assert res.trials == 16 and res.pruned > 0 and res.failed > 0 and not res.stored
    assert all(p["interleave"] < 4 for p in built)
    assert res.best["interleave"] < 4 and (res.best["interleave"], res.best["vector_bits"]) != (2, 128)


@needs_cpu
def test_a_corrupt_database_is_reported_and_ignored(db):
    with open(db, "wb") as fh:
        fh.write(b"this is not a SQLite database\n" * 64)
    x = np.arange(8, dtype=np.float32)
    with pytest.warns(tuner.TuningDBWarning, match="cannot be read"):
        y = tx.jit(lambda v: v * 3.0 - 1.0, device="cpu")(x)
    np.testing.assert_array_equal(np.asarray(y), x * 3 - 1)
    with pytest.warns(tuner.TuningDBWarning, match="cannot be written"):  # and left as it is
        assert not tuner.database().put({"template": "t", "signature": "s", "shape_class": "c", "device": "d",
                                         "params": {}, "seconds": 1.0, "default_seconds": 1.0, "trials": 1})


@needs_cpu
def test_the_command_line_tunes_a_model_file(tmp_path, db):
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent("""
        import numpy as np
        import tilefuse as tx
        import tilefuse.numpy as tnp

        def tuning_workload():
            x = np.linspace(-2, 2, 1 << 15, dtype=np.float32).reshape(64, -1)
            return tx.jit(lambda x: tnp.sum(tnp.exp(-x * x), axis=1)), (x,)
    """))
    p = subprocess.run([sys.executable, "-m", "tilefuse.tune", "--model", str(model), "--trials", "3",
                        "--device", "cpu", "--no-progress"], env={**os.environ, "TILEFUSE_TUNING_DB": db},
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "tuned 1 kernels on cpu" in p.stdout and db in p.stdout
    (row,) = tuner.TuningDB(db).entries()
    assert row["template"] == "cpu_kernel" and row["trials"] == 3


@pytest.mark.skipif(not tx.devices("opencl"), reason="no OpenCL device")
def test_opencl_work_group_size_is_tuned_and_used(db):
    dev = tx.devices("opencl")[0]
    x = np.linspace(-2, 2, 1 << 14, dtype=np.float32)
    f = tx.jit(lambda v: tnp.exp(-v * v) * 3.0, device=dev)
    report = tx.tune(f, x, trials=6, progress=False, repeat=3, verify=False)
    (res,) = report.results
    assert res.template == "opencl_kernel" and res.stored and res.best_seconds <= res.default_seconds
    tuner.applied.clear()
    np.testing.assert_allclose(np.asarray(f(x)), np.exp(-x * x) * 3, rtol=1e-5, atol=1e-6)
    assert [p for k, p in tuner.applied.items() if k[0] == "opencl_kernel"] == [res.best]


@needs_cpu
def test_the_gemm_defaults_satisfy_the_tuners_constraints():
    """Stored defaults are re-checked by every later compile: a default the constraints reject
    would never be used from the database."""
    from tilefuse.backends.llvm import tuning
    dev = tx.get_device("cpu")
    assert tuning.gemm_check(tuning.gemm_default(None, dev), None, dev) is None
