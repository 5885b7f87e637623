"""The hardware description and its simulated narrowings (TILEFUSE_HDI, tx.config.hdi): code for
machines we do not have (an AVX2-only CPU, an OpenCL device with 8-wide vectors and no fp16) is
generated and run here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import tilefuse as tx
from tilefuse.ir.errors import TilefuseError
from tilefuse.runtime import hardware
from tilefuse.runtime.hardware import DeviceInfo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def no_description(monkeypatch):
    monkeypatch.delenv("TILEFUSE_HDI", raising=False)
    monkeypatch.setattr(tx.config, "hdi", None)


def test_description_sources(no_description, monkeypatch, tmp_path):
    assert hardware.description("cpu") == {}
    monkeypatch.setenv("TILEFUSE_HDI", '{"vector_bits": 256, "opencl": {"fp16": false, "vector_bits": 128}}')
    assert hardware.description("cpu") == {"vector_bits": 256}
    assert hardware.description("opencl") == {"vector_bits": 128, "fp16": False}
    path = tmp_path / "avx2.json"
    path.write_text(json.dumps({"cpu_name": "haswell", "cpu": {"compute_units": 3}}))
    monkeypatch.setenv("TILEFUSE_HDI", str(path))
    assert hardware.description("cpu") == {"cpu_name": "haswell", "compute_units": 3}
    assert hardware.description("opencl") == {"cpu_name": "haswell"}
    monkeypatch.setattr(tx.config, "hdi", {"local_mem_bytes": 1024})  # the setting wins
    assert hardware.description("cuda") == {"local_mem_bytes": 1024}


@pytest.mark.parametrize("text,match", [
    ("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object"),
    ('{"vector_width": 8}', r"unknown keys \['vector_width'\]"),
    ('{"opencl": {"fp61": false}}', r"unknown keys \['opencl.fp61'\]"),
    ('{"opencl": {"device_type": "tpu"}}', "device_type 'tpu'"),
    ("/nonexistent/hdi.json", "cannot read the hardware description")])
def test_bad_descriptions_are_clear_errors(no_description, monkeypatch, text, match):
    monkeypatch.setenv("TILEFUSE_HDI", text)
    with pytest.raises(TilefuseError, match="TILEFUSE_HDI: .*" + match):
        hardware.description("cpu")


def test_narrowing():
    feats = ("avx", "avx2", "avx512bw", "avx512f", "amx-tile", "evex512", "fma", "sse4.2")
    assert hardware.masked(feats, hardware.cpu_feature_masks({"vector_bits": 256})) == \
        ("avx", "avx2", "fma", "sse4.2")
    assert hardware.masked(feats, hardware.cpu_feature_masks({"cpu_features": ["fma", "avx2"]})) == \
        ("avx", "avx512bw", "avx512f", "amx-tile", "evex512", "sse4.2")
    info = DeviceInfo("opencl", "dev", compute_units=8, local_mem_bytes=1 << 16, max_work_group=256,
                      peak_gflops=80.0)
    got = hardware.narrowed(info, {"local_mem_bytes": 1 << 20, "max_work_group": 64, "compute_units": 2,
                                   "l2_bytes": 1 << 19})
    assert (got.local_mem_bytes, got.max_work_group, got.compute_units, got.l2_bytes) == \
        (1 << 16, 64, 2, 1 << 19)  # capacities only narrow; caches and cores are free
    assert got.peak_gflops == 20.0 and got.extra["simulated"] and got.fingerprint != info.fingerprint
    assert hardware.narrowed(info, {}) is info


AVX2_RUN = textwrap.dedent("""
    import numpy as np, tilefuse as tx, tilefuse.numpy as tnp, tilefuse.nn as nn
    from tilefuse.backends.llvm.compile import get_target, kernel_ir
    cpu = tx.get_device("cpu")
    info = cpu.info
    assert not [f for f in info.features if f.startswith(("avx512", "amx", "avx10"))], info.features
    assert info.simd_lanes_f32 == 8 and info.cpu_name == "haswell", info
    target = get_target(info)
    assert target.cpu == "haswell" and "-avx512f" in target.features.split(","), target.features

    def f(x, w, b):
        h = tnp.tanh(x @ w + b)
        return h.sum(0), nn.softmax(h * 3.0, axis=-1), tnp.exp(-h * h).astype(np.float16), \\
            tnp.argmax(h, axis=1), tnp.mean(h.astype(tnp.bfloat16), axis=0)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype(np.float32) * 0.2 for s in ((37, 50), (50, 70), (70,))]
    want = tx.jit(f, device="ref")(*args)
    for dev in [d for d in tx.devices() if d.kind != "ref"]:
        for g, w in zip(tx.jit(f, device=dev)(*args), want):
            g, w = np.asarray(g).astype(np.float64), np.asarray(w).astype(np.float64)
            np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2, err_msg=str(dev))
    ocl = [d for d in tx.devices() if d.kind == "opencl"]
    for d in ocl:
        assert d.info.extra["preferred_width"]["float"] <= 8 and not d.info.extra["fp16"]
        assert "cl_khr_fp16" not in d.info.features
    # the code LLVM makes for this description has no 512-bit registers
    from tilefuse.ir.kernel.ir import Buffer, Kernel, Store, affine, load
    import llvmlite.binding as llvm
    f32 = np.dtype(np.float32)
    k = Kernel("k", (Buffer("x", f32, 4096), Buffer("y", f32, 4096)), 1, (4096,), (),
               (Store(1, affine([1]), load(0, affine([1]), f32) * 2.0),))
    mod = llvm.parse_assembly(kernel_ir(k, info))
    target.optimize(mod)
    asm = target.tm.emit_assembly(mod)
    assert "ymm" in asm and "zmm" not in asm
    print("ok", [str(d) for d in tx.devices()])
""")


def test_a_simulated_avx2_machine(tmp_path):
    """The description of the AVX2 machine the issue came from (.ci/hdi-avx2.json): the CPU
    backend compiles for haswell without AVX-512 (its compile workers too: a fresh cache makes
    the graph's kernels compile in parallel), OpenCL renders 8-wide vectors without fp16, and
    every device agrees with ref."""
    env = {**os.environ, "TILEFUSE_HDI": os.path.join(ROOT, ".ci", "hdi-avx2.json"),
           "TILEFUSE_CACHE_DIR": str(tmp_path), "TILEFUSE_COMPILE_WORKERS": "2"}
    p = subprocess.run([sys.executable, "-c", AVX2_RUN], capture_output=True, text=True, env=env,
                       timeout=600, cwd=str(tmp_path))
    assert p.returncode == 0 and "ok" in p.stdout, p.stdout + p.stderr


NARROW_OPENCL = textwrap.dedent("""
    import sys
    import numpy as np, tilefuse as tx, tilefuse.numpy as tnp, tilefuse.nn as nn
    W = int(sys.argv[1])
    dev = tx.devices("opencl")[0]
    assert dev.info.extra["preferred_width"]["float"] == W == dev.info.simd_lanes_f32, dev.info.extra
    assert not dev.info.extra["fp16"] and "cl_khr_fp16" not in dev.info.features

    def chain(x):
        return tnp.tanh(x * 1.7 + 0.3) * nn.sigmoid(x) + tnp.exp(-x * x) * 0.5

    def masked(q, k, v):  # its mask compares and combines bool (uchar) vectors
        m = (tnp.arange(12)[None, :] % 3 != 1) | (tnp.arange(7)[:, None] == 0)
        return nn.dot_product_attention(q, k, v, mask=m)

    def bools(a, b):
        return (a < b) == (b != 0), tnp.where((a == b) | (a > 2), a, b), (a + 1) > a
    rng = np.random.default_rng(0)
    ints = [rng.integers(-3, 4, (5, 12)).astype(np.int32) for _ in range(2)]
    ints[0][0, :3] = 2**31 - 1
    cases = [(chain, [rng.uniform(-2, 2, (33, 65)).astype(np.float16)]),  # rows at odd offsets
             (chain, [rng.uniform(-2, 2, (9, 64)).astype(np.float16)]),
             (masked, [rng.standard_normal(s).astype(np.float32)
                       for s in ((1, 7, 3, 8), (1, 12, 3, 8), (1, 12, 3, 8))]),
             (bools, ints)]
    for f, args in cases:
        want = tx.tree_leaves(tx.jit(f, device="ref")(*args))
        got = tx.tree_leaves(tx.jit(f, device=dev)(*args))
        for g, w in zip(got, want):
            g, w = np.asarray(g), np.asarray(w)
            assert g.dtype == w.dtype and g.shape == w.shape, (f.__name__, g.dtype, w.dtype)
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=1e-2, atol=1e-2,
                                       err_msg=f.__name__)
    print("ok")
""")


@pytest.mark.parametrize("bits", [128, 256])
def test_opencl_at_other_vector_widths(tmp_path, bits):
    """An OpenCL device with 4- or 8-wide vectors and no fp16 (PoCL on an AVX2 machine: 8):
    float16 rows at odd offsets used to crash the process (PoCL's vload_half8 is an aligned
    move), a mask of bool vectors failed to build; both run, and agree with ref."""
    if not tx.devices("opencl"):
        pytest.skip("no OpenCL device")
    env = {**os.environ, "TILEFUSE_HDI": json.dumps({"opencl": {"vector_bits": bits, "fp16": False}}),
           "TILEFUSE_CACHE_DIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", NARROW_OPENCL, str(bits // 32)], capture_output=True,
                       text=True, env=env, timeout=600, cwd=str(tmp_path))
    assert p.returncode == 0 and "ok" in p.stdout, f"exit status {p.returncode}\n{p.stdout}{p.stderr}"


OPENCL_AS_GPU = textwrap.dedent("""
    import numpy as np, tilefuse as tx, tilefuse.numpy as tnp, tilefuse.nn as nn
    from tilefuse.runtime.hardware import target_of
    dev = tx.devices("opencl")[0]
    t = target_of(dev.info)
    assert dev.info.extra["device_type"] == "gpu" and t.kind == "gpu" and t.shared_bytes > 0, t
    assert t.runtime_batch and t.max_group > 1, t

    def loss(w, b, x, y):
        h = nn.gelu(nn.layer_norm(None, x) @ w + b)
        return ((h.sum(-1) - y) ** 2).mean() + (x.T @ h).sum() * 1e-3
    step = tx.jit(tx.grad(loss, argnums=(0, 1)), device=dev)
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((48, 40)).astype(np.float32) * 0.2, np.zeros(40, np.float32)
    built = []
    for n in (300, 170, 600):  # a new batch size reuses the kernels whose code holds none
        x, y = rng.standard_normal((n, 48)).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        want = tx.jit(tx.grad(loss, argnums=(0, 1)), device="ref")(w, b, x, y)
        got = step(w, b, x, y)
        for g, v in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(v), rtol=2e-4, atol=2e-4)
        built.append(len(dev.backend._state(dev).kernels))
    assert built[1] - built[0] < built[0] and built[2] - built[1] < built[0], built
    print("ok", built)
""")


def test_an_opencl_cpu_device_presented_as_a_gpu(tmp_path):
    """{"opencl": {"device_type": "gpu"}}: PoCL runs the GPU layouts (work-groups of many work-items,
    tiles staged through local memory, cooperative reductions), shape-generic as a GPU driver's
    would be; a layer-norm MLP's gradient agrees with ref at three batch sizes, the later ones
    building few kernels (.ci/hdi-many-cores.json runs the backend tests so)."""
    if not tx.devices("opencl"):
        pytest.skip("no OpenCL device")
    env = {**os.environ, "TILEFUSE_HDI": json.dumps({"opencl": {"device_type": "gpu"}}),
           "TILEFUSE_CACHE_DIR": str(tmp_path), "TILEFUSE_TIERED": "0"}
    p = subprocess.run([sys.executable, "-c", OPENCL_AS_GPU], capture_output=True, text=True, env=env,
                       timeout=600, cwd=str(tmp_path))
    assert p.returncode == 0 and "ok" in p.stdout, f"exit status {p.returncode}\n{p.stdout}{p.stderr}"
