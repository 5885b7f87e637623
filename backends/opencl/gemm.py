"""The OpenCL GEMM template: dot_general as a tiled kernel staged through local memory.

A work-group computes a TM x TN tile of C[b] (one batch per grid row z); each work-item keeps a
WM x WN block of it in registers, at rows ty + i*LY and columns tx + j*LX, so that neighbouring
work-items touch neighbouring addresses (coalesced on GPUs, vectorised across work-items by
PoCL on CPUs). Panels of A (TK x TM) and B (TK x TN) are loaded cooperatively into local
memory, with zeros past the edges, so every shape runs without bounds checks in the inner loop.
Strides come from the dot_general's layout (ir/kernel/matmul.py) and are compiled in, so
transposed and batched operands are read in place. A fused_gemm's epilogue (bias, scale,
activation, residual) runs on each value as it is stored. The parameters (the local-memory form's
`GemmTiles`, the CPU forms' register tiles) come from DeviceInfo by default; the auto-tuner
searches them ("opencl_gemm", at the end of this file)."""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import numpy as np

from tilefuse.ir.kernel.lower import epilogue_leaves
from tilefuse.ir.kernel.matmul import MatmulLayout, matmul_layout
from tilefuse.runtime import dispatch, tuner

from .render import LANE, Rendered, cname, pointwise_function

VECTOR_TILE = (6, 16, 2)  # CPU devices: rows, vector width, vectors per row (12 accumulators)
DOT_TILE = (4, 4, 16)  # CPU devices, A·Bᵀ: rows, columns, vector width along k (16 accumulators)
MIN_FLOPS = 1 << 18  # below this the generic kernel is as fast and needs no tile padding
_CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


@dataclass(frozen=True)
class GemmTiles:
    tm: int = 64   # rows of C per work-group
    tn: int = 64   # columns of C per work-group
    tk: int = 16   # depth of the local-memory panels
    wm: int = 4    # rows per work-item
    wn: int = 4    # columns per work-item

    @property
    def local(self) -> tuple[int, int]:
        return self.tn // self.wn, self.tm // self.wm

    def valid(self, info) -> bool:
        lx, ly = self.local
        local_bytes = 8 * self.tk * (self.tm + self.tn + 2)
        return (self.tm % self.wm == 0 and self.tn % self.wn == 0 and lx * ly <= info.max_work_group
                and local_bytes <= info.local_mem_bytes)


def default_tiles(info) -> GemmTiles:
    """64 x 64 tiles of 4 x 4 per work-item (256 work-items) where the device allows, halved
    until the work-group and the panels fit."""
    t = GemmTiles()
    while not t.valid(info) and t.tm > 8:
        t = GemmTiles(t.tm // 2, t.tn // 2, t.tk, t.wm, t.wn)
    return t


def _params(ctype: str, n_inputs: int) -> str:
    """The kernel's parameters: the graph kernel's buffers, inputs then the output."""
    return ", ".join([f"__global const {ctype}* restrict in{i}" for i in range(n_inputs)]
                     + [f"__global {ctype}* restrict out0"])


@dataclass(frozen=True)
class Epilogue:
    """A fused_gemm's epilogue as OpenCL C: `defs` (the function `epilogue`, rendered from
    ir/kernel/lower.epilogue_expr) and `apply(v, z, m, n)`, the expression of C[z, m, n] from the
    product's value v, reading the extras (residuals of C's shape, row vectors along n) as kernel
    parameters in<i>. Empty for a dot_general."""
    defs: str = ""
    extras: tuple = ()  # per extra: (kernel input number, whether it has C's shape)

    def apply(self, v: str, z: str, m: str, n: str) -> str:
        if not self.defs:
            return v
        xs = [f"in{i}[{z} * ((long)M * N) + {m} * N + {n}]" if full else f"in{i}[{n}]"
              for i, full in self.extras]
        return f"epilogue({', '.join([v, *xs])})"


def kernel_epilogue(kernel) -> Epilogue | None:
    """epilogue_of the kernel's equation, kept in its meta (applies and build both ask)."""
    if "opencl_epilogue" not in kernel.meta:
        lay, e = _layout(kernel)
        kernel.meta["opencl_epilogue"] = None if lay is None else epilogue_of(e, lay, kernel.meta["operands"])
    return kernel.meta["opencl_epilogue"]


def epilogue_of(e, lay: MatmulLayout, operands) -> Epilogue | None:
    """The Epilogue of fused_gemm equation e (None where an extra is neither C-shaped nor a row
    vector along n); an empty one for a dot_general."""
    if e.prim.name != "fused_gemm":
        return Epilogue()
    out = e.outputs[0].aval
    pos = {v.id: i for i, v in enumerate(operands)}
    extras = []
    for x in e.inputs[2:]:
        if x.aval.shape not in (out.shape, (lay.n,)) or not hasattr(x, "id"):
            return None
        extras.append((pos[x.id], x.aval.shape == out.shape))
    expr, leaves = epilogue_leaves(e.params["epilogue"])
    return Epilogue(pointwise_function("epilogue", expr, leaves), tuple(extras))


def _source(name: str, lay: MatmulLayout, t: GemmTiles, ctype: str, a: int, b: int,
            n_inputs: int, epi: Epilogue) -> str:
    lx, ly = t.local
    sab, sam, sak = lay.a_strides
    sbb, sbk, sbn = lay.b_strides
    params = _params(ctype, n_inputs)
    # load the panels walking the operand's unit-stride axis fastest
    a_idx = ("kk = i % TK, mm = i / TK" if sak == 1 else "mm = i % TM, kk = i / TM")
    b_idx = ("nn = i % TN, kk = i / TN" if sbn == 1 or sbk != 1 else "kk = i % TK, nn = i / TK")
    return f"""
#define M {lay.m}
#define N {lay.n}
#define K {lay.k}
#define TM {t.tm}
#define TN {t.tn}
#define TK {t.tk}
#define LX {lx}
#define LY {ly}
{epi.defs}
__kernel __attribute__((reqd_work_group_size(LX, LY, 1)))
void {name}({params}) {{
    __local {ctype} As[TK][TM + 1];
    __local {ctype} Bs[TK][TN + 1];
    const int tx = get_local_id(0), ty = get_local_id(1), tid = ty * LX + tx;
    const long m0 = (long)get_group_id(1) * TM, n0 = (long)get_group_id(0) * TN;
    const long z = get_group_id(2);
    __global const {ctype}* A = in{a} + z * {sab}L;
    __global const {ctype}* B = in{b} + z * {sbb}L;
    {ctype} acc[{t.wm}][{t.wn}];
    for (int i = 0; i < {t.wm}; i++)
        for (int j = 0; j < {t.wn}; j++) acc[i][j] = 0;
    for (long k0 = 0; k0 < K; k0 += TK) {{
        for (int i = tid; i < TK * TM; i += LX * LY) {{
            const int {a_idx};
            const long m = m0 + mm, k = k0 + kk;
            As[kk][mm] = (m < M && k < K) ? A[m * {sam}L + k * {sak}L] : 0;
        }}
        for (int i = tid; i < TK * TN; i += LX * LY) {{
            const int {b_idx};
            const long n = n0 + nn, k = k0 + kk;
            Bs[kk][nn] = (n < N && k < K) ? B[k * {sbk}L + n * {sbn}L] : 0;
        }}
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int kk = 0; kk < TK; kk++) {{
            {ctype} ra[{t.wm}], rb[{t.wn}];
            for (int i = 0; i < {t.wm}; i++) ra[i] = As[kk][ty + i * LY];
            for (int j = 0; j < {t.wn}; j++) rb[j] = Bs[kk][tx + j * LX];
            for (int i = 0; i < {t.wm}; i++)
                for (int j = 0; j < {t.wn}; j++) acc[i][j] = fma(ra[i], rb[j], acc[i][j]);
        }}
        barrier(CLK_LOCAL_MEM_FENCE);
    }}
    __global {ctype}* C = out0 + z * ((long)M * N);
    for (int i = 0; i < {t.wm}; i++) {{
        const long m = m0 + ty + i * LY;
        for (int j = 0; j < {t.wn}; j++) {{
            const long n = n0 + tx + j * LX;
            if (m < M && n < N) C[m * N + n] = {epi.apply("acc[i][j]", "z", "m", "n")};
        }}
    }}
}}
"""


def _vector_source(name: str, lay: MatmulLayout, wm: int, vw: int, nv: int, ctype: str, a: int,
                   b: int, n_inputs: int, epi: Epilogue) -> str:
    """CPU devices: one work-item per work-group computes a wm x (nv*vw) tile of C in explicit
    vector registers, k innermost, B's rows read as vectors (B must be unit-stride along n). A
    work-group of one has no barriers and no per-work-item context for PoCL to spill, so the
    accumulators stay in registers, as in a BLIS micro-kernel (without the packing)."""
    sab, sam, sak = lay.a_strides
    sbb, sbk, _ = lay.b_strides
    v = f"{ctype}{vw}"
    params = _params(ctype, n_inputs)
    acc = [[f"c{i}_{j}" for j in range(nv)] for i in range(wm)]
    decl = "\n    ".join(f"{v} {', '.join(f'{c} = 0' for c in row)};" for row in acc)
    fmas = "\n        ".join(
        f"{{ const {v} a = ({v})(A[r{i} * {sam}L + k * {sak}L]); "
        + " ".join(f"{acc[i][j]} = fma(a, b{j}, {acc[i][j]});" for j in range(nv)) + " }"
        for i in range(wm))
    rows = "\n    ".join(f"const long r{i} = min(m0 + {i}L, (long)M - 1);" for i in range(wm))
    def finish(i, j):  # the epilogue lane by lane (the extras' rows may end mid-vector)
        if not epi.defs:
            return acc[i][j]
        lanes = ", ".join(epi.apply(f"{acc[i][j]}.s{LANE[l]}", "z", f"(m0 + {i})",
                                    f"min(n0 + {j * vw + l}L, (long)N - 1)") for l in range(vw))
        return f"({v})({lanes})"
    stores = "\n    ".join(
        f"if (m0 + {i} < M) {{ __global {ctype}* Ci = C + (m0 + {i}) * N + n0; "
        + " ".join(f"store(Ci + {j * vw}, {finish(i, j)}, N - n0 - {j * vw});" for j in range(nv))
        + " }" for i in range(wm))
    return f"""
#define M {lay.m}
#define N {lay.n}
#define K {lay.k}
{epi.defs}
static inline void store(__global {ctype}* p, {v} x, long left) {{
    if (left >= {vw}) {{ vstore{vw}(x, 0, p); return; }}
    {ctype} t[{vw}];
    vstore{vw}(x, 0, t);
    for (long i = 0; i < left; i++) p[i] = t[i];
}}
static inline {v} load_tail(__global const {ctype}* p, long left) {{
    {ctype} t[{vw}];
    for (int i = 0; i < {vw}; i++) t[i] = i < left ? p[i] : 0;
    return vload{vw}(0, t);
}}
__kernel void {name}({params}) {{
    const long m0 = (long)get_global_id(0) * {wm}, n0 = (long)get_global_id(1) * {nv * vw};  // m fastest: neighbours share B's strip
    const long z = get_global_id(2);
    __global const {ctype}* A = in{a} + z * {sab}L;
    __global const {ctype}* B = in{b} + z * {sbb}L;
    __global {ctype}* C = out0 + z * ((long)M * N);
    {rows}
    {decl}
    const int full = n0 + {nv * vw} <= N;
    for (long k = 0; k < K; k++) {{
        __global const {ctype}* Bk = B + k * {sbk}L + n0;
        {v} {", ".join(f"b{j}" for j in range(nv))};
        if (full) {{ {" ".join(f"b{j} = vload{vw}(0, Bk + {j * vw});" for j in range(nv))} }}
        else {{ {" ".join(f"b{j} = load_tail(Bk + {j * vw}, N - n0 - {j * vw});" for j in range(nv))} }}
        {fmas}
    }}
    {stores}
}}
"""


def _dot_source(name: str, lay: MatmulLayout, wm: int, wn: int, vw: int, ctype: str, a: int, b: int,
                n_inputs: int, epi: Epilogue) -> str:
    """CPU devices, both operands unit-stride along k (A·Bᵀ, the backward's x·Wᵀ): one work-item
    computes a wm x wn tile as wm*wn dot products, each accumulated in a vector along k and
    summed across its lanes once at the end."""
    sab, sam, _ = lay.a_strides
    sbb, _, sbn = lay.b_strides
    v = f"{ctype}{vw}"
    params = _params(ctype, n_inputs)
    rows = "\n    ".join(f"__global const {ctype}* a{i} = A + min(m0 + {i}L, (long)M - 1) * {sam}L;"
                          for i in range(wm))
    cols = "\n    ".join(f"__global const {ctype}* b{j} = B + min(n0 + {j}L, (long)N - 1) * {sbn}L;"
                          for j in range(wn))
    acc = [[f"c{i}_{j}" for j in range(wn)] for i in range(wm)]
    decl = "\n    ".join(f"{v} {', '.join(f'{c} = 0' for c in row)};" for row in acc)
    loads = " ".join(f"const {v} x{i} = vload{vw}(0, a{i} + k);" for i in range(wm)) + " " + \
        " ".join(f"const {v} y{j} = vload{vw}(0, b{j} + k);" for j in range(wn))
    fmas = " ".join(f"{acc[i][j]} = fma(x{i}, y{j}, {acc[i][j]});" for i in range(wm) for j in range(wn))
    tail = " ".join(f"t{i}_{j} = fma(a{i}[k], b{j}[k], t{i}_{j});" for i in range(wm) for j in range(wn))
    tails = "\n    ".join(f"{ctype} {', '.join(f't{i}_{j} = 0' for j in range(wn))};" for i in range(wm))
    stores = "\n    ".join(
        f"if (m0 + {i} < M) {{ " + " ".join(
            f"if (n0 + {j} < N) C[(m0 + {i}) * N + n0 + {j}] = "
            f"{epi.apply(f'(hsum({acc[i][j]}) + t{i}_{j})', 'z', f'(m0 + {i})', f'(n0 + {j})')};"
            for j in range(wn)) + " }" for i in range(wm))
    halves, h, width = [], "x", vw
    while width > 1:
        width //= 2
        halves.append(f"const {ctype}{width if width > 1 else ''} h{width} = {h}.lo + {h}.hi;")
        h = f"h{width}"
    return f"""
#define M {lay.m}
#define N {lay.n}
#define K {lay.k}
{epi.defs}
static inline {ctype} hsum({v} x) {{
    {" ".join(halves)}
    return h1;
}}
__kernel void {name}({params}) {{
    const long m0 = (long)get_global_id(0) * {wm}, n0 = (long)get_global_id(1) * {wn};
    const long z = get_global_id(2);
    __global const {ctype}* A = in{a} + z * {sab}L;
    __global const {ctype}* B = in{b} + z * {sbb}L;
    __global {ctype}* C = out0 + z * ((long)M * N);
    {rows}
    {cols}
    {decl}
    {tails}
    long k = 0;
    for (; k + {vw} <= K; k += {vw}) {{
        {loads}
        {fmas}
    }}
    for (; k < K; k++) {{ {tail} }}
    {stores}
}}
"""


def _layout(kernel):
    (e,) = kernel.meta["eqns"]
    if any(not hasattr(v, "id") for v in e.inputs):  # a literal operand
        return None, e
    return matmul_layout(e), e


def _variant(info, lay: MatmulLayout) -> str:
    """CPU devices: "vector" (B unit-stride along n) or "dot" (A and B unit-stride along k);
    otherwise, and on GPUs, "local" (local-memory tiles, any strides)."""
    if info.extra["device_type"] != "cpu":
        return "local"
    if lay.b_strides[2] == 1:
        return "vector"
    return "dot" if lay.a_strides[2] == 1 and lay.b_strides[1] == 1 else "local"


def applies(kernel, device) -> bool:
    lay, e = _layout(kernel)
    return (lay is not None and lay.dtype in _CTYPES and np.dtype(e.outputs[0].aval.dtype) == lay.dtype
            and lay.flops >= MIN_FLOPS and (lay.dtype != np.float64 or device.info.extra["fp64"])
            and kernel_epilogue(kernel) is not None)


def default_params(info, lay: MatmulLayout) -> dict:
    """The variant's parameters from DeviceInfo: "vector" wm, vw, nv; "dot" wm, wn, vw; "local"
    the GemmTiles fields."""
    variant = _variant(info, lay)
    if variant == "vector":
        return dict(zip(("wm", "vw", "nv"), VECTOR_TILE))
    if variant == "dot":
        return dict(zip(("wm", "wn", "vw"), DOT_TILE))
    return asdict(default_tiles(info))


def check(params: dict, info, lay: MatmulLayout) -> str | None:
    """Why `params` cannot run the kernel's variant on the device, or None."""
    variant = _variant(info, lay)
    if variant == "local":
        return None if GemmTiles(**params).valid(info) else \
            f"{params}: the work-group or its local-memory panels exceed the device"
    if params["vw"] not in (2, 4, 8, 16):
        return f"vector width {params['vw']} is not an OpenCL vector"
    acc = params["wm"] * (params["nv"] if variant == "vector" else params["wn"])
    if acc > 32:
        return f"{acc} vector accumulators exceed the 32 vector registers"
    return None


def build(kernel, device, backend, params: dict | None = None):
    """The kernel's variant with `params` (default_params where None) as an OpenCL kernel."""
    from . import CompiledKernel
    st = backend._state(device)
    lay, e = _layout(kernel)
    p = params or default_params(st.info, lay)
    operands = kernel.meta["operands"]
    pos = {v.id: i for i, v in enumerate(operands)}
    name = cname(kernel) + "_gemm"
    a, b, ctype = pos[e.inputs[0].id], pos[e.inputs[1].id], _CTYPES[lay.dtype]
    epi = kernel_epilogue(kernel)
    units = lay.batch * lay.m * lay.n
    variant = _variant(st.info, lay)
    if variant == "vector":
        wm, vw, nv = p["wm"], p["vw"], p["nv"]
        src = _vector_source(name, lay, wm, vw, nv, ctype, a, b, kernel.n_inputs, epi)
        grid, local, mode = (-(-lay.m // wm), -(-lay.n // (vw * nv)), lay.batch), (1, 1, 1), "gemm_vector"
    elif variant == "dot":
        wm, wn, vw = p["wm"], p["wn"], p["vw"]
        src = _dot_source(name, lay, wm, wn, vw, ctype, a, b, kernel.n_inputs, epi)
        grid, local, mode = (-(-lay.m // wm), -(-lay.n // wn), lay.batch), (1, 1, 1), "gemm_dot"
    else:
        t = GemmTiles(**p)
        src = _source(name, lay, t, ctype, a, b, kernel.n_inputs, epi)
        lx, ly = t.local
        grid, local, mode = (-(-lay.n // t.tn) * lx, -(-lay.m // t.tm) * ly, lay.batch), (lx, ly, 1), "gemm"
    knl = backend.programs.kernel(st.ctx, st.dev, src, name, str(kernel))
    return CompiledKernel(kernel, Rendered(name, src, units, mode, 1), knl, st, grid, local)


IMPLEMENTATION = dispatch.register(dispatch.Implementation(
    "tiled_gemm", "dot_general", build, device_kinds=("opencl",), applies=applies, priority=10))
# fused_gemm: the epilogue in the tile's store (before gemm_then_epilogue, which runs it apart)
dispatch.register(dispatch.Implementation(
    "tiled_gemm", "fused_gemm", build, device_kinds=("opencl",), applies=applies, priority=20))


# ---- the auto-tuner's view (runtime/tuner.py) ------------------------------------------------------
# Each configuration is a compile; `check` prunes what the device cannot hold.

def _space(kernel, device) -> dict:
    lay, _ = _layout(kernel)
    variant = _variant(device.info, lay)
    if variant == "vector":
        return {"wm": (2, 4, 6, 8), "vw": (4, 8, 16), "nv": (1, 2, 4)}
    if variant == "dot":
        return {"wm": (2, 4, 8), "wn": (2, 4, 8), "vw": (4, 8, 16)}
    return {"tm": (16, 32, 64, 128), "tn": (16, 32, 64, 128), "tk": (8, 16, 32), "wm": (2, 4, 8),
            "wn": (2, 4, 8)}


def _key(kernel) -> tuple[str, str]:
    """Variant, epilogue and operands' layout: the signature; sizes by power-of-two class."""
    lay, e = _layout(kernel)
    sig = repr((e.params.get("epilogue"), lay.a_strides[2] == 1, lay.b_strides[2] == 1, lay.dtype.name))
    return "opencl-gemm-" + hashlib.sha1(sig.encode()).hexdigest()[:16], \
        "x".join(str(tuner.size_class(n)) for n in (lay.batch, lay.m, lay.n, lay.k))


tuner.register(tuner.Template(
    "opencl_gemm", "tiled_gemm", ("opencl",), _space,
    lambda kernel, device: default_params(device.info, _layout(kernel)[0]), build,
    lambda params, kernel, device: check(params, device.info, _layout(kernel)[0]), _key, applies))
