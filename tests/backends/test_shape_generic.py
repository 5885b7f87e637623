"""Shape-generic kernels on the devices whose printer takes sizes at run time (the CPU's LLVM
printer; the OpenCL C printer, as kernel parameters; WGSL, from a buffer): a kernel's cache text
(ir/kernel/schedule.code_text; a builder's tile kernel: tile.key_text) holds only what the
scheduler's code depends on (not the first axis's extent, a batch size, which the code reads at
run time: tile.batch; not how the axes it merged into one made it up), so a new batch size reuses
compiled code.

The structural guard: for every kernel of real programs lowered at several batch sizes, whenever
two kernels share a cache text they print to the same code (LLVM IR, OpenCL C, WGSL). A printer that
starts reading the first extent fails here, not in a user's results. Then end to end: new batch
sizes compile nothing new and match numpy."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.nn as nn
import tilefuse.numpy as tnp
from conftest import assert_close
from tilefuse.backends.llvm import compile as lc
from tilefuse.backends.llvmir.tile import print_tile
from tilefuse.ir.kernel.schedule import code_text, default_schedule, schedule
from tilefuse.ir.kernel.tile import key_text
from tilefuse.runtime.hardware import host_info, target_of
from tilefuse.runtime.compiler import _front
from tilefuse.validate.programs import layernorm, softmax

BATCHES = (2, 3, 33)
rng = np.random.default_rng(0)


def mlp_loss(w1, w2, x, y):
    h = nn.gelu(x @ w1)
    logits = h @ w2
    return tnp.mean((nn.log_softmax(logits) * y).sum(-1) ** 2)


def col_and_row(x, b):
    z = tnp.tanh(x * 1.5 + b)
    return z.sum(0), z.max(-1), tnp.argmax(z, axis=-1), z.T * 2.0


def bias_grads(x, dy):
    """Sums over the batch's rows, as a bias's and a layer norm's gradients: at 70 rows a batch
    entry, 140 to 2,310 steps (within one block of 1,024, past it, past two); the last over two
    axes that do not merge (a broadcast along one)."""
    return dy.sum(0), (x * dy).sum(0), tnp.max(x, axis=0), (x.reshape(-1, 7, 24) * dy[:7]).sum((0, 1))


def attention_grads(q, k, v):
    """The fused attention's backward (the CPU form's packed dq, dk, dv, whose dk and dv start
    at offsets that grow with the batch)."""
    return tx.grad(lambda q, k, v: (nn.dot_product_attention(q, k, v, causal=True) ** 2).sum(),
                   argnums=(0, 1, 2))(q, k, v)


def embed_grad(table, ids):
    return tx.grad(lambda t: (t[ids] ** 2).sum())(table)


PROGRAMS = {  # name: (function, arguments at batch size n)
    "softmax": (softmax, lambda n: (rng.standard_normal((n, 5, 24)).astype(np.float32),)),
    "layernorm": (layernorm, lambda n: (rng.standard_normal((n, 40)).astype(np.float32),
                                        rng.standard_normal(40).astype(np.float32),
                                        rng.standard_normal(40).astype(np.float32))),
    "mlp_grad": (tx.grad(mlp_loss, argnums=(0, 1)),
                 lambda n: (rng.standard_normal((16, 32)).astype(np.float32),
                            rng.standard_normal((32, 10)).astype(np.float32),
                            rng.standard_normal((n, 16)).astype(np.float32),
                            rng.standard_normal((n, 10)).astype(np.float32))),
    "col_and_row": (col_and_row, lambda n: (rng.standard_normal((n, 9)).astype(np.float32),
                                            rng.standard_normal(9).astype(np.float32))),
    "bias_grads": (bias_grads, lambda n: (rng.standard_normal((70 * n, 24)).astype(np.float32) * 1e3,
                                          rng.standard_normal((70 * n, 24)).astype(np.float32))),
    "attention_grads": (attention_grads, lambda n: tuple(rng.standard_normal((n, 40, 2, 16)).astype(np.float32)
                                                        for _ in range(3))),
    "embed_grad": (embed_grad, lambda n: (rng.standard_normal((11, 8)).astype(np.float32),
                                          rng.integers(0, 11, (n, 3)).astype(np.int32))),
}


def _inputs(name: str, n: int):
    """The inputs of PROGRAMS[name] at batch n: the same numbers whichever tests ran before."""
    global rng
    rng = np.random.default_rng(zlib.crc32(f"{name}/{n}".encode()))
    return PROGRAMS[name][1](n)


def _kernels(f, args):
    g = tx.make_graph(f)(*args)
    return [lk.kernel for lks in _front(g, True, cached=False)[0][2] for lk in lks if lk.kernel is not None]


def _generic(device):
    """The device's Target, or a skip where its printer takes no sizes at run time."""
    if not device.backend.tile_kernels:
        pytest.skip(f"{device.name}: no shape-generic kernels (it prints no tile kernels)")
    t = target_of(device.info)
    if not t.runtime_batch:
        pytest.skip(f"{device.name}: this description takes no sizes at run time")
    return t


def _code(device, tk) -> str:
    """The code the device's printer makes of a tile kernel."""
    if device.kind == "cpu":
        return print_tile(tk, "f")
    if device.kind == "webgpu":
        from tilefuse.backends.webgpu.wgsl import print_wgsl as print_c
    else:
        from tilefuse.backends.cstyle import print_tile as print_c
    printed = print_c(tk)
    return printed.source.replace(printed.name, "f")  # (the kernel's name: not code)


def _built(device) -> int:
    """Kernels' code built (or loaded) in this process for the device."""
    if device.kind == "cpu":
        return lc.memory_cache_stats()["kernels"]
    if device.kind == "webgpu":
        return len(device.backend._pipelines)
    return len(device.backend._state(device).kernels)


def test_equal_cache_text_means_equal_code(device):
    t = _generic(device)
    by_text: dict = {}
    shared = 0
    for name, (f, _) in PROGRAMS.items():
        for n in BATCHES:
            for k in _kernels(f, _inputs(name, n)):
                if not k.size:
                    continue
                s = lc.scheduled(k, device.info)[0] if device.kind == "cpu" else default_schedule(k, t)
                tk = schedule(k, t, s)
                text, code = code_text(k, t, s), _code(device, tk)
                for key in (text, key_text(tk)):  # (the LLVM backend keys by the first, OpenCL by the second)
                    if key in by_text:
                        shared += 1
                        assert by_text[key] == code, f"{k.name}: equal cache text, different code"
                    by_text[key] = code
    assert shared > 20, "few kernels were shared between batch sizes"


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_new_batch_sizes_reuse_compiled_kernels(device, name):
    """Once every kernel of one batch size is built, a new batch size builds only the kernels
    whose code depends on it (reductions over the batch axis, constants such as 1/n)."""
    _generic(device)
    f, _ = PROGRAMS[name]
    jf = tx.jit(f, device=device)
    for n in BATCHES:
        args = _inputs(name, n)
        before = _built(device)
        got = jf(*args)
        want = tx.jit(f, device="ref")(*args)
        for a, b in zip(tx.tree_leaves(got), tx.tree_leaves(want)):
            b = np.asarray(b)  # float32 sums in another order: errors relative to the largest value
            assert_close(np.asarray(a), b, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(b).max(initial=0))))
        built = _built(device) - before
        total = len([k for k in _kernels(f, args) if k.size])
        if n != BATCHES[0]:
            assert built < total, f"batch {n}: all {total} kernels built again"



def attention_vjp(q, k, v, dout):
    """The attention backward's packed (dq, dk, dv), sliced at offsets of B·H·T·D elements."""
    _, back = tx.vjp(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True), q, k, v)
    return back(dout)


def mean_grads(x, y):
    """Means' gradients: cos(x) · 1/n over all of x (n put into the graph as a number), and
    2 y / 3 over each row of y (a count that is no size of the batch: it stays a constant)."""
    return tx.grad(lambda x: tnp.mean(tnp.sin(x)))(x), tx.grad(lambda y: (tnp.mean(y * y, axis=1)).sum())(y)


def test_counts_in_constants_are_read_at_run_time(device):
    """Floats equal to a kernel's run-time extents or size, or their reciprocals (a mean's 1/n),
    are read as sizes (schedule.sized_constants): the means' gradients build nothing at a new
    batch size, and match the interpreter."""
    _generic(device)
    jf = tx.jit(mean_grads, device=device)
    for i, n in enumerate((70, 90, 131)):
        args = (rng.standard_normal((n, 8)).astype(np.float32) * 10, rng.standard_normal((n, 3)).astype(np.float32))
        before = _built(device)
        got = jf(*args)
        if i:
            assert _built(device) == before, f"batch {n}: kernels built again"
        want = tx.jit(mean_grads, device="ref")(*args)
        for a, b in zip(tx.tree_leaves(got), tx.tree_leaves(want)):
            assert_close(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def whole_reductions(x):
    return x.sum(), x.max(), x.min(), tnp.mean(x), tnp.mean(x * x)


def test_whole_array_reductions_serve_every_size(device):
    """A reduction of a whole array (a loss's sum or mean: one point, one axis after merging),
    in vectors on CPUs, reads its extent at run time: sizes whose runs split into blocks, whole
    vectors and ragged ends differently (70 to 35,000 elements) build nothing after the first,
    and sums over values of wide magnitudes stay within float32's blocked-summation error."""
    _generic(device)
    jf = tx.jit(whole_reductions, device=device)
    for i, n in enumerate((10, 147, 1000, 5000)):
        x = (rng.standard_normal((n, 7)) * 10.0 ** rng.integers(-3, 4, (n, 7))).astype(np.float32)
        before = _built(device)
        got = [float(v) for v in jf(x)]
        if i > 1 or (i and device.kind == "cpu"):  # (a GPU's work-group per point: wider past 70)
            assert _built(device) == before, f"{n} rows: kernels built again"
        x64 = x.astype(np.float64)
        want = [x64.sum(), x64.max(), x64.min(), x64.mean(), (x64 * x64).mean()]
        scale = [np.abs(x64).sum(), 0, 0, np.abs(x64).mean(), (x64 * x64).mean()]
        for g, w, sc in zip(got, want, scale):
            assert abs(g - w) <= 1e-5 * sc + 1e-6 * abs(w), (n, g, w)


def _thirds(x, y):
    """A flat packing of three arrays of x's size, sliced back: offsets of whole copies."""
    packed = tnp.concatenate([x.ravel(), y.ravel(), (x * 2).ravel()])
    return packed[x.size:2 * x.size] * 3 + packed[2 * x.size:]


SIZED = {  # name: (tilefuse function of x, y; numpy's in float64; the size of its terms, for the error)
    "mean": (lambda x, y: tnp.mean(x) + x * 0, lambda x, y: x.mean() + x * 0,
             lambda x, y: np.abs(x).mean() + 0 * x),
    "by_size": (lambda x, y: x / x.size + y.sum() / y.shape[0], lambda x, y: x / x.size + y.sum() / y.shape[0],
                lambda x, y: np.abs(x) / x.size + np.abs(y).sum() / y.shape[0]),
    "reciprocals": (lambda x, y: x * (1.0 / x.shape[0]) - y * (1.0 / y.size),
                    lambda x, y: x * (1.0 / x.shape[0]) - y * (1.0 / y.size),
                    lambda x, y: np.abs(x) / x.shape[0] + np.abs(y) / y.size),
    "packed": (_thirds, lambda x, y: y.ravel() * 3 + x.ravel() * 2, lambda x, y: np.abs(y.ravel()) * 3 + np.abs(x.ravel()) * 2),
    "whole": (lambda x, y: (tnp.max(x * y), tnp.min(x - y), tnp.sum(x * y), tnp.mean(x * x)),
              lambda x, y: ((x * y).max(), (x - y).min(), (x * y).sum(), (x * x).mean()),
              lambda x, y: (abs((x * y).max()), abs((x - y).min()), np.abs(x * y).sum(), (x * x).mean())),
    "mean_grad": (tx.grad(lambda x, y: tnp.mean(tnp.sin(x) * y)), lambda x, y: np.cos(x) * y / x.size,
                  lambda x, y: np.abs(y) / x.size),
}


@pytest.mark.parametrize("name", list(SIZED))
def test_sized_constants_at_random_sizes(device, name):
    """Programs whose kernels hold sizes as constants (counts, reciprocals, packed offsets, whole
    reductions), jitted once and called at random sizes (8 to 2,000 rows, values over five
    decades) on every device: a kernel reused at a size must compute that size's numbers (within
    float32's rounding of the terms; an n off by one is 1e-5 to 1e-1 off)."""
    f, ref, terms = SIZED[name]
    r = np.random.default_rng(zlib.crc32(name.encode()))
    jf = tx.jit(f, device=device)
    cols = int(r.integers(1, 9))
    for n in r.integers(8, 2000, 5):
        x = (r.standard_normal((n, cols)) * 10.0 ** r.integers(-2, 3, (n, cols))).astype(np.float32)
        y = r.standard_normal((n, cols)).astype(np.float32)
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        want, scale = ref(x64, y64), terms(x64, y64)
        want, scale = (want, scale) if isinstance(want, tuple) else ((want,), (scale,))
        for g, w, sc in zip(tx.tree_leaves(jf(x, y)), want, scale):
            g = np.asarray(g, np.float64)
            tol = 2e-6 * np.asarray(sc) + (1e-5 * np.asarray(sc) if name == "whole" else 0)  # (sums: more roundings)
            assert np.all(np.abs(g - w) <= tol + 1e-30), (name, n, cols, float(np.max(np.abs(g - w))))


def test_packed_slice_offsets_are_read_at_run_time(device):
    """The slices of the attention backward's packed result start at whole copies of their
    output: one cache text at every batch size (schedule.sized_constants), each batch's results
    the interpreter's."""
    t = _generic(device)
    texts = []
    for n in (70, 90, 131):
        args = [rng.standard_normal((n, 40, 2, 16)).astype(np.float32) for _ in range(4)]
        ks = [k for k in _kernels(attention_vjp, args) if "slice" in k.name and k.size]
        texts.append({code_text(k, t, default_schedule(k, t)) for k in ks})
        got, want = tx.jit(attention_vjp, device=device)(*args), tx.jit(attention_vjp, device="ref")(*args)
        for a, b in zip(tx.tree_leaves(got), tx.tree_leaves(want)):
            assert_close(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert texts[0] and texts[0] == texts[1] == texts[2], "the slices' code depends on the batch size"


def test_an_empty_batch_then_a_full_one(device):
    """An empty kernel has the cache text of the same kernel at any batch size, and no code: it
    must not stand in the cache for them (it did: a null function pointer, a segfault)."""
    f = tx.jit(lambda x: tnp.tanh(x * 1.7 + 0.3) * 2.0, device=device)
    for n in (0, 5, 0, 9):
        x = rng.standard_normal((n, 8)).astype(np.float32)
        assert_close(np.asarray(f(x)), np.tanh(x * 1.7 + 0.3) * 2.0)


# ---- GEMM: M (and the weight gradient's K) at run time ------------------------------------------

def _gemm_tiles(f, args):
    """The shared GEMM's tile kernels of f's graph under the host's default schedules."""
    from tilefuse.ir.kernel import gemm
    t = target_of(host_info())
    out = []
    for k in _kernels(f, args):
        spec = gemm.gemm_spec(k)
        if spec is not None and spec.layout.flops:
            s = gemm.default_schedule(spec, t)
            if s.check(spec, t) is None:
                out.append(gemm.build(spec, s, k.name, k.buffers, k.n_inputs, t.runtime_batch))
    return out


def linear_grads(w, x, dy):
    """y = x @ w (M = the batch's rows) and its weight gradient xᵀ dy (K = the batch's rows)."""
    return x @ w, x.T @ dy


@pytest.mark.parametrize("rows", [(100, 150, 300), (2500, 3100, 4200), (30, 300, 2500)])
def test_gemm_code_serves_every_batch_size(rows):
    """The packed GEMM reads M, and a transposed A's K (the weight gradient's: the batch's rows),
    at run time: both products' tile kernels at several batch sizes have one cache text each,
    whether K is one block (a few rows) or several (past any host's K block: 2500 and more), that
    text prints one LLVM IR, and the jitted products, run on one compiled code, match numpy."""
    t = target_of(host_info())
    if not t.runtime_batch:
        pytest.skip("this CPU description takes no sizes at run time")
    mk = lambda n: (rng.standard_normal((48, 40)).astype(np.float32),  # noqa: E731
                    rng.standard_normal((n, 48)).astype(np.float32), rng.standard_normal((n, 40)).astype(np.float32))
    texts = [[key_text(tk) for tk in _gemm_tiles(linear_grads, mk(n))] for n in rows]
    assert len(texts[0]) == 2, "both products go to the shared GEMM"
    assert len(set(texts[0]) & set(texts[1]) & set(texts[2])) == 2, "a new batch size changed the GEMM's code"
    code = [{key_text(tk): print_tile(tk, "f") for tk in _gemm_tiles(linear_grads, mk(n))} for n in (rows[0], rows[2])]
    assert all(code[1][text] == c for text, c in code[0].items() if text in code[1]), \
        "equal cache text, different code"
    old = tx.config.gemm
    tx.config.gemm = "generated"
    try:
        jf = tx.jit(linear_grads, device="cpu")
        for i, n in enumerate(rows):
            w, x, dy = mk(n)
            before = lc.memory_cache_stats()["kernels"]
            y, gw = jf(w, x, dy)
            assert_close(np.asarray(y), x @ w, rtol=1e-4, atol=1e-4)
            assert_close(np.asarray(gw), x.T @ dy, rtol=1e-4, atol=1e-3 * np.sqrt(n))
            if i:
                assert lc.memory_cache_stats()["kernels"] == before, f"{n} rows: built again"
    finally:
        tx.config.gemm = old


def test_a_gemm_with_an_earlier_ones_size_free_key_is_that_one_at_its_sizes():
    """gemm.at_sizes, which a new batch size's GEMMs (and a layer's like an earlier layer's) take
    instead of a build: for the forward product and the weight gradient at rows from a few to past
    K's block, every tile kernel made of another with the same size_free_key equals the one
    building gives (body, run-time sizes, grid, cache text); kernels whose code differs (a K of one
    block against several) have different keys."""
    from tilefuse.ir.kernel import gemm
    t = target_of(host_info())
    if not t.runtime_batch:
        pytest.skip("this CPU description takes no sizes at run time")
    built = []
    for n in (7, 12, 13, 30, 100, 301, 2500, 4200):  # (12 rows: one row block, 13: two)
        w, x, dy = (rng.standard_normal((48, 40)).astype(np.float32), rng.standard_normal((n, 48)).astype(np.float32),
                    rng.standard_normal((n, 40)).astype(np.float32))
        for k in _kernels(linear_grads, (w, x, dy)):
            spec = gemm.gemm_spec(k)
            if spec is not None and spec.layout.flops:
                s = gemm.default_schedule(spec, t)
                tk = gemm.build(spec, s, k.name, k.buffers, k.n_inputs, t.runtime_batch)
                built.append((gemm.size_free_key(spec, s, k.buffers, k.n_inputs, True), spec, s, k, tk))
    pairs = 0
    for key, spec, s, k, own in built:
        for key2, *_, tk in built:
            if key2 == key and key is not None:
                made = gemm.at_sizes(tk, spec, s, k.name, k.buffers)
                assert (made.body, made.points(), key_text(made), made.buffers, made.name) == \
                    (own.body, own.points(), key_text(own), own.buffers, own.name)
                assert {m: v for m, v in made.meta.items() if m != "key_text"} == \
                    {m: v for m, v in own.meta.items() if m != "key_text"}
                pairs += tk is not own
            elif key2 != key:
                assert key_text(tk) != key_text(own) or tk.meta["sizes"] != own.meta["sizes"] or key2 is None
    assert pairs >= 20, pairs


def test_gemms_from_their_size_free_key_under_the_check(device, monkeypatch):
    """Jitted products at new batch sizes, their GEMMs made of earlier ones (gemm.at_sizes),
    each compared with its own build (TILEFUSE_CHECK), match numpy."""
    from tilefuse.runtime import tiled
    monkeypatch.setattr(tx.config, "check", True)
    monkeypatch.setattr(tx.config, "gemm", "generated")
    jf = tx.jit(linear_grads, device=device)
    before = set(tiled._size_free_tiles)
    for n in (40, 64, 12, 24, 300, 2500):
        w, x, dy = (rng.standard_normal((48, 40)).astype(np.float32), rng.standard_normal((n, 48)).astype(np.float32),
                    rng.standard_normal((n, 40)).astype(np.float32) * 1e3)
        y, gw = jf(w, x, dy)
        assert_close(np.asarray(y), x @ w, rtol=1e-4, atol=1e-4)
        assert_close(np.asarray(gw), x.T @ dy, rtol=1e-4, atol=1e-3 * np.sqrt(n) * 1e3)
    if device == "cpu" and target_of(host_info()).runtime_batch:
        assert len(set(tiled._size_free_tiles) - before) <= 4  # (two products, K in one block or several)
        assert tiled._size_free_tiles
        tx.clear_caches()  # (which drops them with the programs)
        assert not tiled._size_free_tiles


def test_run_time_trip_counts_stay_rolled():
    """Loops over a run-time size carry LLVM's no-unroll hint (their remainder loops cost compile
    time, not speed); loops of constant trip count do not, and the IR is valid LLVM."""
    import llvmlite.binding as llvm
    from tilefuse.ir.kernel.ir import KExpr
    from tilefuse.ir.kernel.tile import Range, walk
    if not target_of(host_info()).runtime_batch:
        pytest.skip("this CPU description takes no sizes at run time")
    w, x, dy = (rng.standard_normal(s).astype(np.float32) for s in ((48, 40), (2500, 48), (2500, 40)))
    for tk in _gemm_tiles(linear_grads, (w, x, dy)):
        text = print_tile(tk, "f")
        llvm.parse_assembly(text).verify()
        sized = [r for r in walk(tk.body) if isinstance(r, Range) and r.kind != "unroll" and isinstance(r.extent, KExpr)]
        assert sized, "the GEMM of 2,500 rows has a loop over a run-time size"
        assert 0 < text.count("!llvm.loop !") <= len(sized)
        assert 'llvm.loop.unroll.disable' in text
    x = rng.standard_normal((4, 16, 8)).astype(np.float32)
    for tk in _gemm_tiles(lambda a, b: a @ tnp.swapaxes(b, 1, 2), (x, x)):  # a batched product: constants
        assert "llvm.loop" not in print_tile(tk, "f")


def test_attention_code_serves_every_batch_size():
    """The shared FlashAttention's tile kernels, forward and the CPU form's backward (whose dk and
    dv start at run-time offsets), print one cache text at every batch size the scheduler gives
    one schedule (it picks a task per head from twice the cores' batch entries)."""
    from tilefuse.ir.kernel import attention
    from tilefuse.runtime import tiled
    from tilefuse.runtime.device import get_device
    if not target_of(host_info()).runtime_batch:
        pytest.skip("this CPU description takes no sizes at run time")
    cpu = get_device("cpu")
    f, _ = PROGRAMS["attention_grads"]
    by_schedule: dict = {}
    for n in BATCHES:
        ks = [k for k in _kernels(f, _inputs("attention_grads", n)) if tiled._attention_kernels(k, cpu)]
        t = target_of(cpu.info)
        tks = [tk for k in ks for tk in _attention_built(k, t)]  # (built: not made of another's)
        scheds = repr([attention.default_attention_schedule(tiled._attention_spec(k), t) for k in ks])
        by_schedule.setdefault(scheds, []).append(sorted(key_text(tk) for tk in tks))
    shared = [texts for texts in by_schedule.values() if len(texts) > 1]
    assert shared, "no two batch sizes took one schedule"
    for texts in shared:
        assert len(texts[0]) >= 2 and all(t == texts[0] for t in texts), "a new batch size changed the code"


def _attention_built(k, t) -> list:
    from tilefuse.ir.kernel import attention
    from tilefuse.runtime import tiled
    sp = tiled._attention_spec(k)
    return tiled._attention_built(k, sp, attention.default_attention_schedule(sp, t), t)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_an_earlier_ones_size_free_key_is_that_one_at_its_sizes(causal):
    """attention.at_sizes, which a new batch size's FlashAttention kernels take instead of a
    build: forward and backward at batch sizes 1 to 9, every set of tile kernels made of another
    with the same size_free_key equals what building gives (names, bodies, run-time sizes, grids,
    cache texts); sets whose code differs (another schedule: a task per head) differ in key."""
    from tilefuse.ir.kernel import attention
    from tilefuse.runtime import tiled
    from tilefuse.runtime.device import get_device
    t = target_of(get_device("cpu").info)

    def attn(q, k, v, do):
        out, pull = tx.vjp(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=causal), q, k, v)
        return (out, *pull(do))
    built = []
    for n in (1, 2, 3, 4, 5, 8, 9):
        q, k, v, do = (rng.standard_normal((n, 24, 2, 16)).astype(np.float32) for _ in range(4))
        for kern in _kernels(attn, (q, k, v, do)):
            sp = tiled._attention_spec(kern)
            if sp is not None:
                sched = attention.default_attention_schedule(sp, t)
                key = attention.size_free_key(sp, sched, kern.buffers, kern.n_inputs, t.runtime_batch)
                built.append((key, sp, sched, kern, tiled._attention_built(kern, sp, sched, t)))
    view = lambda tks: [(tk.name, tk.body, tk.points(), key_text(tk), tk.buffers,  # noqa: E731
                         {m: v for m, v in tk.meta.items() if m != "key_text"}) for tk in tks]
    pairs = 0
    for key, sp, sched, kern, own in built:
        for key2, _, _, other, tks in built:
            if key is not None and key2 == key:
                assert view(attention.at_sizes(tks, other.name, sp, sched, kern.name, kern.buffers)) == view(own)
                pairs += tks is not own
            elif key is not None and key2 is not None and (key2[0].bwd, key2[1]) != (key[0].bwd, key[1]):
                assert [key_text(tk) for tk in tks] != [key_text(tk) for tk in own]
    assert pairs >= 8, pairs


# ---- kernels at a new batch size made from a template's (runtime/compiler._Lowering) --------------

def _step(w1, w2, x, y, g):
    """An MLP's gradients, a layer norm and a softmax: elementwise, row and reduction kernels;
    and sums of parameters alone (a weight decay's, a gradient norm's: kernels of no axes that
    are the same at every batch size)."""
    return tx.grad(mlp_loss, argnums=(0, 1))(w1, w2, x, y), layernorm(x, g, g), softmax(x * 2.0), \
        tnp.sum(w1 * w1) + tnp.sum(tnp.abs(g))


def test_kernels_made_at_a_new_batch_size_are_those_lowering_gives(device, monkeypatch):
    """A shape-generic trace's kernels at a new batch size are its template region's, lowered once
    with symbolic sizes, at the new first extent (schedule.at_first_extent): each equals the
    instance's own lowering (stores, extents, buffers), and on a CPU that takes the first extent
    at run time its schedule and code text, taken from its twin, are those it has on its own.
    Results match the interpreter."""
    from tilefuse.ir.kernel.ir import Kernel
    from tilefuse.ir.kernel.lower import lower_region
    from tilefuse.ir.kernel.schedule import at_first_extent, first_extent_twin
    from tilefuse.runtime import compiler, frontend_cache, tiered
    assert tiered.wait_idle(120)
    monkeypatch.setattr(frontend_cache, "load", lambda *a, **k: None)
    monkeypatch.setattr(tx.config, "tiered", False)
    made, instances = [], []
    lower = compiler._lower_instance

    def lower_instance(r, front, values):
        out = lower(r, front, values)
        made.extend(lk.kernel for lk in out if "twin" in lk.kernel.meta)
        instances.append((r, out))
        return out
    monkeypatch.setattr(compiler, "_lower_instance", lower_instance)
    d = 16
    w1, w2 = rng.standard_normal((d, 32)).astype(np.float32) * 0.3, rng.standard_normal((32, 5)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, d).astype(np.float32)
    jf = tx.jit(_step, device=device)
    for n in (12, 7, 5, 3, 9):  # (below d: the GEMMs' decisions compare the batch with it)
        x = rng.standard_normal((n, d)).astype(np.float32)
        y = np.eye(5, dtype=np.float32)[rng.integers(0, 5, n)]
        got = jf(w1, w2, x, y, g)
        want = tx.jit(_step, device="ref")(w1, w2, x, y, g)
        for a, b in zip(tx.tree_leaves(got), tx.tree_leaves(want)):  # (float32 sums that cancel:
            # an error of a few ulps of the array's largest terms, not of each element)
            assert_close(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-5 * max(1.0, float(np.abs(b).max())))
    assert jf.trace_count == 1
    if device.kind == "ref":
        return
    assert len(made) >= 3 * 8, f"{len(made)} kernels made from the template's lowering"  # (at 5, 3, 9)
    assert sum(not m.shape for m in made) >= 3, "the sums of parameters were lowered again at each size"
    # the layer norm's count (its row length: a symbol the trace read as a value) is folded in the
    # template region as the instance folds it, so its row kernel is made too
    assert any("sqrt" in {e.prim.name for e in m.meta["eqns"]} for m in made), "the layer norm was lowered again"
    t = target_of(device.info)
    for r, out in instances:
        if not any("twin" in lk.kernel.meta for lk in out):
            continue
        own = [lk.kernel for lk in lower_region(r)]
        for lk, k in zip(out, own):
            m = lk.kernel
            assert (m.shape, m.reduce_shape, m.buffers, m.n_inputs) == (k.shape, k.reduce_shape, k.buffers, k.n_inputs)
            assert m.stores == k.stores
            if first_extent_twin(m, t) is not None:
                assert default_schedule(m, t) == default_schedule(k, t)
                assert code_text(m, t, default_schedule(m, t)) == code_text(k, t, default_schedule(k, t))
    # a twin's layout is the kernel's own at its first extent
    k = next(m for m in made if len(m.meta["twin"].meta.get("merged", m).shape) < len(m.shape)) \
        if device.kind == "cpu" else None
    if k is not None:
        again = at_first_extent(k.meta["twin"], k.shape[0], k.buffers, {})
        fresh = Kernel(k.name, k.buffers, k.n_inputs, k.shape, k.reduce_shape, k.stores)
        from tilefuse.ir.kernel.schedule import laid_out
        assert (laid_out(again, t).shape, laid_out(again, t).stores) == (laid_out(fresh, t).shape, laid_out(fresh, t).stores)


@pytest.mark.parametrize("sizes", [(64, 96, 50), (64, 50, 96)])
def test_a_constant_equal_to_one_sizes_extent_is_not_shared(device, sizes, monkeypatch):
    """768.0 is the laid-out extent (n x 8) of the kernel at n = 96, where sized_constants reads
    it as that size: a kernel at another size whose twin is that one (or the other way round)
    must not take its code."""
    from tilefuse.runtime import frontend_cache, tiered
    assert tiered.wait_idle(120)
    monkeypatch.setattr(frontend_cache, "load", lambda *a, **k: None)
    monkeypatch.setattr(tx.config, "tiered", False)
    jf = tx.jit(lambda x: tnp.tanh(x) * 768.0 + 1.0, device=device)
    for n in sizes:
        x = rng.standard_normal((n, 8)).astype(np.float32)
        assert_close(np.asarray(jf(x)), np.tanh(x) * np.float32(768.0) + 1.0, rtol=1e-6, atol=1e-5)
    assert jf.trace_count == 1


def test_a_size_folded_for_a_twin_is_held_to_its_value(device, monkeypatch):
    """A twin's template region has the sizes it reads as values that were the same at the first
    two sizes (a layer norm's count, here another argument's length) folded to their values
    under guards: where such a size changes too, the kernel is lowered at its own sizes (made
    from the twin, it would divide by the old one)."""
    from tilefuse.runtime import frontend_cache, tiered
    assert tiered.wait_idle(120)
    monkeypatch.setattr(frontend_cache, "load", lambda *a, **k: None)
    monkeypatch.setattr(tx.config, "tiered", False)
    jf = tx.jit(lambda x, z: tnp.tanh(x) / z.shape[0] + 1.0, device=device)
    for n, m in ((12, 5), (7, 5), (5, 5), (6, 8), (4, 8), (9, 5)):
        x = rng.standard_normal((n, 16)).astype(np.float32)
        z = np.zeros(m, np.float32)
        assert_close(np.asarray(jf(x, z)), np.tanh(x) / np.float32(m) + 1.0, rtol=1e-6, atol=1e-6)
    assert jf.trace_count == 1


def _batch_sums(x):
    """Sums over the batch's rows (a bias's gradient), over the batch and another axis (merged
    into one), a GEMM over them (a weight's gradient), a maximum over them, and over the batch
    and the last axis (not merged: a strided reduction): the batch is a reduction's extent."""
    return tnp.sum(x * x, axis=0), tnp.sum(tnp.tanh(x), axis=(0, 1)), tnp.einsum("nij,nik->jk", x, x * 0.5), \
        tnp.max(x, axis=0), tnp.sum(x, axis=(0, 2))


def _batch_sums_numpy(x):
    return (x * x).sum(0), np.tanh(x).sum((0, 1)), np.einsum("nij,nik->jk", x, x * np.float32(0.5)), \
        x.max(0), x.sum((0, 2))


def test_sums_over_the_batch_are_made_from_their_twins(device, monkeypatch):
    """Kernels whose first reduction extent is the batch are made from their template region's
    lowering at the new extent (at_first_extent's r0): each equals the instance's own lowering,
    and on a CPU that takes sizes at run time the generic reductions (that extent read at run
    time) share their twin's schedule and code text, which are those they have on their own."""
    from tilefuse.ir.kernel.lower import lower_region
    from tilefuse.ir.kernel.schedule import first_extent_twin
    from tilefuse.runtime import compiler, frontend_cache, tiered
    assert tiered.wait_idle(120)
    monkeypatch.setattr(frontend_cache, "load", lambda *a, **k: None)
    monkeypatch.setattr(tx.config, "tiered", False)
    instances = []
    lower = compiler._lower_instance

    def lower_instance(r, front, values):
        out = lower(r, front, values)
        instances.append((r, out))
        return out
    monkeypatch.setattr(compiler, "_lower_instance", lower_instance)
    jf = tx.jit(_batch_sums, device=device)
    # (from GENERIC_REDUCE_MIN rows up the reductions are generic; below it, made from the twin
    # but scheduled on their own), values over wide magnitudes
    for n in (40, 24, 17, 33, 20, 9, 64):
        x = (rng.standard_normal((n, 8, 16)) * 10.0 ** rng.uniform(-3, 3, (n, 8, 16))).astype(np.float32)
        for a, b in zip(jf(x), _batch_sums_numpy(x)):
            assert_close(np.asarray(a), b, rtol=2e-5, atol=2e-5 * max(1.0, float(np.abs(b).max())))
    assert jf.trace_count == 1
    if device.kind == "ref":
        return
    made = [(r, lk.kernel, own) for r, out in instances
            for lk, own in zip(out, [lk.kernel for lk in lower_region(r)]) if "twin" in lk.kernel.meta]
    over_batch = [m for _, m, _ in made if m.reduce_shape != m.meta["twin"].reduce_shape]
    assert len(over_batch) >= 3 * 3, f"{len(over_batch)} kernels over the batch made from their twins"
    t = target_of(device.info)
    shared = 0
    for _, m, own in made:
        assert (m.shape, m.reduce_shape, m.buffers, m.n_inputs, m.stores) == \
            (own.shape, own.reduce_shape, own.buffers, own.n_inputs, own.stores)
        if first_extent_twin(m, t) is not None:
            shared += m.reduce_shape != m.meta["twin"].reduce_shape
            assert default_schedule(m, t) == default_schedule(own, t)
            assert code_text(m, t, default_schedule(m, t)) == code_text(own, t, default_schedule(own, t))
    if device.kind == "cpu":
        assert shared >= 2 * 3, f"{shared} sums over the batch share their twin's code"
