"""The CUDA backend without a GPU: every kernel of a primitive table and of fused programs (an MLP
forward and backward, softmax, layer norm) compiles to PTX that `ptxas` assembles for sm_80 and
sm_90; the launch configuration against DeviceInfo values; the driver's absence is reported."""
from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import tempfile

import ml_dtypes
import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
from tilefuse import lax
from tilefuse.backends import cuda
from tilefuse.backends.cuda import device_info, offline_device, ptx_for, sm_target
from tilefuse.ir import primitives as P
from tilefuse.ir.errors import DeviceError
from tilefuse.tracer.core import bind1
from tilefuse.tracer.pytree import tree_leaves
from tilefuse.validate.programs import layernorm, softmax


def find_ptxas() -> str | None:
    """ptxas from the PATH, a CUDA toolkit, or NVIDIA's pip package in this environment
    (`nvidia-cuda-nvcc`: nvidia/cu13/bin/ptxas; the -cu12 package: nvidia/cuda_nvcc/bin/ptxas),
    which .ci/run installs where the machine has none."""
    found = shutil.which("ptxas")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or ()) if spec else []
    candidates = [p for r in roots for p in sorted(glob.glob(os.path.join(r, "*", "bin", "ptxas")))]
    candidates += ["/usr/local/bin/ptxas", "/usr/local/cuda/bin/ptxas"]
    return next((p for p in candidates if os.access(p, os.X_OK)), None)


PTXAS = find_ptxas()
need_ptxas = pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed (neither the CUDA "
                                "toolkit nor the nvidia-cuda-nvcc pip package that .ci/run installs)")
ARCHS = ("sm_80", "sm_90")

R = np.random.default_rng(0)
F32, F64, I32 = np.float32, np.float64, np.int32


def u(*shape, dtype=F32):
    return R.uniform(0.5, 1.5, shape).astype(dtype)


def i(*shape):
    return R.integers(-5, 6, shape).astype(I32)


def u64(*shape):  # uint64 from both halves of the range (2**63 and up too)
    return R.integers(0, 2**64 - 1, shape, dtype=np.uint64, endpoint=True)


def un(prim, **kw):
    return lambda x: bind1(prim, x, **kw)


def bi(prim):
    return lambda x, y: bind1(prim, x, y)


def dot(contract, batch=((), ())):
    return lambda a, b: bind1(P.dot_general, a, b, dimension_numbers=(contract, batch))


IDX = np.array([0, 2, 2, 3], I32)
UNARY_F = ("neg", "exp", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "sin", "cos",
           "erf", "abs_", "sign", "floor", "ceil", "round_", "stop_gradient")
BINARY_F = ("add", "sub", "mul", "div", "rem", "pow_", "max_", "min_")
CMP = ("eq", "ne", "lt", "le", "gt", "ge")

# name -> (function, args): one row per primitive (a few more for dtypes the GPU path treats apart)
TABLE = {
    **{p: (un(getattr(P, p)), (u(3, 5),)) for p in UNARY_F},
    **{f"{p}_f64": (un(getattr(P, p)), (u(3, 5, dtype=F64),)) for p in UNARY_F},
    **{p: (bi(getattr(P, p)), (u(3, 5), u(3, 5))) for p in BINARY_F + CMP},
    **{f"{p}_f64": (bi(getattr(P, p)), (u(3, 5, dtype=F64), u(3, 5, dtype=F64))) for p in BINARY_F},
    **{f"{p}_i32": (bi(getattr(P, p)), (i(3, 5), i(3, 5)))
       for p in ("add", "mul", "div", "rem", "max_", "min_", "and_", "or_", "xor", "shift_left",
                 "shift_right_logical")},
    **{f"{p}_u64": (bi(getattr(P, p)), (u64(3, 5), u64(3, 5)))
       for p in ("add", "mul", "div", "rem", "max_", "min_", "lt", "shift_right_logical")},
    "convert_u64": (lambda x, f: (bind1(P.convert_element_type, x, new_dtype=np.dtype(F64)),
                                  bind1(P.convert_element_type, f, new_dtype=np.dtype(np.uint64))),
                    (u64(3, 5), u(3, 5, dtype=F64))),
    "reduce_sum_u64": (un(P.reduce_sum, axes=(1,)), (u64(2, 7),)),
    "argmax_u64": (un(P.argmax, axis=1, index_dtype=np.dtype(I32)), (u64(3, 5),)),
    "scatter_add_u64": (lambda x, upd: bind1(P.scatter_add, x, IDX, upd, axis=0), (u64(5, 2), u64(4, 2))),
    "not_": (un(P.not_), (i(3, 5) > 0,)),
    "is_finite": (un(P.is_finite), (u(3, 5),)),
    "integer_pow": (un(P.integer_pow, y=3), (u(3, 5),)),
    "convert_element_type": (lambda x: (bind1(P.convert_element_type, x, new_dtype=np.dtype(I32)),
                                        bind1(P.convert_element_type, x, new_dtype=np.dtype(np.float16)),
                                        bind1(P.convert_element_type, x,
                                              new_dtype=np.dtype(ml_dtypes.bfloat16))), (u(3, 5),)),
    "bf16_tanh": (un(P.tanh), (u(3, 5).astype(ml_dtypes.bfloat16),)),
    "f16_exp": (un(P.exp), (u(3, 5).astype(np.float16),)),
    "select": (lambda p, a, b: bind1(P.select, p, a, b), (i(3, 5) > 0, u(3, 5), u(3, 5))),
    "iota": (lambda x: x + bind1(P.iota, dtype=np.dtype(F32), shape=(3, 5), dimension=1), (u(3, 5),)),
    "broadcast_in_dim": (un(P.broadcast_in_dim, shape=(2, 3), broadcast_dimensions=(1,)), (u(3),)),
    "reshape": (lambda x: bind1(P.reshape, x * 2, new_sizes=(3, 2)), (u(2, 3),)),
    "transpose": (lambda x: bind1(P.transpose, x * 2, permutation=(2, 0, 1)), (u(2, 3, 4),)),
    "rev": (un(P.rev, dimensions=(0, 2)), (u(2, 3, 2),)),
    "slice_": (un(P.slice_, start_indices=(1, 0), limit_indices=(5, 6), strides=(2, 3)), (u(5, 6),)),
    "concatenate": (lambda a, b: bind1(P.concatenate, a, b, dimension=1), (u(2, 1), u(2, 3))),
    "pad": (lambda x, v: bind1(P.pad, x, v, padding_config=((1, 2, 1), (0, 1, 0))),
            (u(3, 2), np.float32(0.5))),
    "reduce_sum": (un(P.reduce_sum, axes=(0, 2)), (u(2, 3, 2),)),
    "reduce_sum_col": (un(P.reduce_sum, axes=(0,)), (u(64, 33),)),
    "reduce_max": (un(P.reduce_max, axes=(1,)), (u(2, 4),)),
    "reduce_min": (un(P.reduce_min, axes=(0, 1)), (u(2, 4),)),
    "reduce_prod": (un(P.reduce_prod, axes=(1,)), (u(2, 3),)),
    "reduce_sum_i32": (un(P.reduce_sum, axes=(1,)), (i(2, 7),)),
    "argmax": (un(P.argmax, axis=1, index_dtype=np.dtype(I32)), (u(3, 5),)),
    "argmin": (un(P.argmin, axis=0, index_dtype=np.dtype(I32)), (u(3, 5),)),
    "dot_general": (dot(((1,), (0,))), (u(4, 3), u(3, 5))),
    "dot_general_batched": (dot(((2,), (1,)), ((0,), (0,))), (u(2, 3, 4), u(2, 4, 2))),
    "gather": (lambda x: bind1(P.gather, x, IDX, axis=0), (u(4, 3),)),
    "dynamic_slice": (lambda x, i: bind1(P.dynamic_slice, x, i, np.int32(1), slice_sizes=(2, 2)),
                      (u(4, 3), np.array(3, I32))),
    "dynamic_update_slice": (lambda x, v, i: bind1(P.dynamic_update_slice, x, v, i, np.int32(0)),
                             (u(4, 3), u(2, 3), np.array(1, I32))),
    "scatter_add": (lambda x, upd: bind1(P.scatter_add, x, IDX, upd, axis=0), (u(5, 2), u(4, 2))),
    "scatter_add_f64": (lambda x, upd: bind1(P.scatter_add, x, IDX, upd, axis=0),
                        (u(5, 2, dtype=F64), u(4, 2, dtype=F64))),
}


def mlp_loss(params, x, y):
    w1, b1, w2, b2 = params
    h = tnp.tanh(x @ w1 + b1)
    logits = h @ w2 + b2
    return tnp.mean(tnp.sum((softmax(logits) - y) ** 2, axis=-1))


def mlp_value_and_grad(params, x, y):
    return mlp_loss(params, x, y), tx.grad(mlp_loss)(params, x, y)


def _scan(c, xs):  # the step program (a row of xs read in place, the counter) and the row writer
    return lax.scan(lambda c, x: (tnp.tanh(c * x), c + x), c, xs)


PROGRAMS = {
    "scan_p": (_scan, (u(3), u(5, 3))),
    "while_p": (lambda x: lax.while_loop(lambda c: c[0] < 4, lambda c: (c[0] + 1, c[1] * 1.5), (0, x)), (u(3),)),
    "cond_p": (lambda p, x: lax.cond(p, tnp.sin, tnp.cos, x), (np.bool_(True), u(3))),
    "softmax": (softmax, (u(4, 33),)),
    "layernorm": (layernorm, (u(3, 40), u(40), u(40))),
    "fused_gemm": (lambda x, w, b: tnp.tanh(x @ w + b), (u(6, 16), u(16, 8), u(8))),  # made by a pass
    "mlp forward+backward": (mlp_value_and_grad,
                             ((u(8, 16), u(16), u(16, 4), u(4)), u(5, 8), u(5, 4))),
}
ALL = {**TABLE, **PROGRAMS}


# whole primitives: the shared FlashAttention's PTX is checked in test_cuda_attention.py, the
# implicit GEMM's (conv) in test_cuda_gemm.py, and where they do not apply they run as the kernels
# of their decomposition (covered above)
COMPOSITES = {"fused_attention", "fused_attention_stats", "fused_attention_bwd", "conv", "fused_conv"}
# numpy on the host on every device (runtime/host.py): no kernel to render; tests/test_linalg.py
COMPOSITES |= {p.name for p in P.HOST_PRIMITIVES}
INLINED = {"tile_call", "custom_vjp_call", "custom_jvp_call"}  # replaced by its body before lowering (ir/passes/inline.py)


def test_the_table_covers_every_primitive():
    prims = {n for n in dir(P) if isinstance(getattr(P, n), P.Primitive)} - {"debug_print"} - COMPOSITES - INLINED
    prims -= {"dim_value"}  # only in shape-generic templates, never in a graph a backend sees
    names = {k.removesuffix("_f64").removesuffix("_i32").removesuffix("_u64").removesuffix("_col").removesuffix("_batched")
             for k in ALL}
    assert prims <= names | {"stop_gradient"}, sorted(prims - names)


def _ptxas(ptx: str, arch: str, path: str):
    with open(path, "w") as f:
        f.write(ptx)
    return subprocess.run([PTXAS, f"-arch={arch}", path, "-o", os.devnull],
                          capture_output=True, text=True, timeout=60)


def assert_assembles(texts: dict, arch: str) -> None:
    """ptxas accepts every PTX text of {label: ptx} for `arch` (the failures named together)."""
    failures = []
    with tempfile.TemporaryDirectory() as d:
        for n, (where, ptx) in enumerate(texts.items()):
            r = _ptxas(ptx, arch, os.path.join(d, f"k{n}.ptx"))
            if r.returncode:
                failures.append(f"{where}: {r.stderr.strip()[:400]}")
    assert not failures, "\n".join(failures)


@need_ptxas
@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_assembles_with_ptxas(arch):
    """All the PTX of the table and the programs, for `arch`; each text assembled once."""
    texts: dict[str, str] = {}
    for name, (fn, args) in ALL.items():
        srcs = ptx_for(fn, *args, sm=arch)
        assert srcs, f"{name}: no kernels"
        for k, ptx in srcs.items():
            assert f".target {arch}" in ptx and ".entry" in ptx, (name, k)
            texts.setdefault(ptx, f"{name}/{k}")
    assert_assembles({where: ptx for ptx, where in texts.items()}, arch)


def test_ptx_uses_thread_indices_and_atomics():
    ptx = ptx_for(*TABLE["scatter_add"][:1], *TABLE["scatter_add"][1])
    text = "\n".join(ptx.values())
    assert "%ctaid.x" in text and "%tid.x" in text
    assert "atom.global.add.f32" in text or "red.global.add.f32" in text
    u64 = "\n".join(ptx_for(*TABLE["scatter_add_u64"][:1], *TABLE["scatter_add_u64"][1]).values())
    assert "atom.global.add.u64" in u64 or "red.global.add.u64" in u64
    # a reduction runs its loop per thread: no call to anything external
    red = "\n".join(ptx_for(softmax, u(4, 33)).values())
    assert "call" not in red and ".extern" not in red


def test_lower_sources_on_an_offline_device_include_ptx():
    dev = offline_device("sm_80")
    srcs = tx.jit(softmax).lower(u(2, 8), device=dev).sources()
    ptx = [k for k in srcs if k.endswith(".cuda")]
    assert ptx and all(".target sm_80" in srcs[k] for k in ptx)
    with pytest.raises(DeviceError, match="offline"):
        tx.jit(softmax, device=dev)(u(2, 8))


def test_cuda_is_absent_with_the_reason_when_there_is_no_driver():
    try:
        cuda.driver.lib()
    except DeviceError:
        pass
    else:
        pytest.skip("a CUDA driver is present on this machine")
    devs, why = tx.devices(all=True)
    assert all(d.kind != "cuda" for d in devs)
    assert "cuda" in why and "CUDA" in why["cuda"]


# ---- launches and numbers -------------------------------------------------------------------

def _kernels(fn, args):
    """The kernels fn(*args) lowers to, each with the graph variables of its buffers, the graph's
    inputs by variable id, and its outputs."""
    from tilefuse.ir.kernel import lower_region
    from tilefuse.ir.passes import partition, run_passes
    g = run_passes(tx.make_graph(fn)(*args))
    env = {v.id: np.ascontiguousarray(a).reshape(-1)
           for v, a in zip((*g.invars, *g.constvars), (*tree_leaves(args), *g.consts))}
    return [lk for r in partition(g) for lk in lower_region(r)], env, g.outvars


def test_a_launch_is_a_block_per_grid_point_and_a_thread_per_lane():
    """Ordinary kernels go through the shared scheduler (ir/kernel/schedule.py) as tile kernels."""
    dev = offline_device("sm_90")
    ((lk,), _, _) = _kernels(lambda x: (x * 2 + 1).sum(axis=1), (u(1000, 300),))
    k = lk.kernel
    run = dev.backend.compile_kernel(k, dev)
    assert run.grid == int(np.prod([r.extent for r in run.kernel.grid()]))
    assert run.block == int(np.prod([r.extent for r in run.kernel.lanes()]))
    assert 32 <= run.block <= 1024 and ".target sm_90" in run.source


@pytest.mark.parametrize("name", [n for n in ALL if n not in ("scan_p", "while_p", "cond_p")])
def test_every_kernel_computes_its_numbers_in_a_ptx_interpreter(name):
    """The scheduled PTX of the table and the programs (control flow aside: the runtime runs it)
    run in the PTX interpreter, kernel after kernel, against the ref backend."""
    import ptxemu
    fn, args = ALL[name]
    dev = offline_device("sm_80")
    lks, env, outvars = _kernels(fn, args)
    for lk in lks:  # in order; an output a kernel adds into (scatter_add's) is the one made before
        k = lk.kernel
        bufs = [env.get(v.id, np.zeros(b.size, b.dtype)) for v, b in zip(lk.args, k.buffers)]
        run = dev.backend.compile_kernel(k, dev)
        ptxemu.run(run.source, bufs, run.grid, run.block)
        env.update({v.id: b for v, b in zip(lk.args, bufs)})
    wants = tree_leaves(tx.jit(fn, device="ref")(*args))
    assert len(wants) == len(outvars)
    for v, w in zip(outvars, wants):
        w = np.asarray(w).reshape(-1)
        got = env[v.id] if hasattr(v, "id") else np.asarray(v.val).reshape(-1)
        if w.dtype.kind in "fV" or w.dtype == ml_dtypes.bfloat16:
            small = w.dtype.itemsize == 2
            np.testing.assert_allclose(got.astype(np.float64), w.astype(np.float64), rtol=1e-2 if small else 1e-5,
                                       atol=1e-2 if small else 1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(got, w, err_msg=name)


def test_device_info_and_targets_from_driver_attributes():
    info = device_info("H200", (9, 0), 132, shared_per_block=48 << 10, l2_bytes=60 << 20,
                       clock_khz=1_980_000, mem_clock_khz=2_619_000, bus_bits=6144)
    assert info.kind == "cuda" and info.compute_units == 132 and info.sub_group == 32
    assert info.local_mem_bytes == 48 << 10 and info.extra["sm"] == "sm_90"
    assert info.peak_gflops == pytest.approx(132 * 128 * 2 * 1.98)
    assert info.peak_gbps == pytest.approx(2 * 2.619e9 * 6144 / 8 / 1e9)
    assert sm_target((8, 0)) == "sm_80" and sm_target((8, 6)) == "sm_86"
    assert sm_target((8, 7)) == "sm_80" and sm_target((10, 0)) == "sm_90"
    with pytest.raises(DeviceError, match="older"):
        sm_target((7, 5))
