"""FlashAttention on OpenCL: fused_attention and fused_attention_bwd as OpenCL C templates whose
keys, values and queries are staged through local memory block by block; the S x S scores are
never stored.

Forward: one work-group per (batch index, block of BQ queries). Its work-items share the
queries' tile and, for each block of BK keys, kᵀ and v (and the bias) loaded cooperatively into
local memory; each work-item owns an equal share of the block's rows, taken in register blocks
of ROWS rows: the scores S = q kᵀ come from a register-blocked product (vectors of VW floats
along the keys), the online softmax keeps each row's running max m and sum l and rescales the
row's output by exp(m_old - m_new), and O += P v accumulates in registers (vectors along the
features) between the row's output tile in local memory. Causal masking stops a block at its
last visible key.

Backward, two kernels and no atomics (every result element has one writer):
  dq:   one work-group per (batch index, block of queries). A first sweep over the keys
        recomputes each row's log-sum-exp, and D_i = dO_i·O_i; both also go to a workspace for
        the second kernel. A second sweep recomputes P = exp(S - lse), dP = dO vᵀ,
        dS = P (dP - D) scale, and accumulates dQ += dS k.
  dkdv: one work-group per (batch index, block of keys): every query block that sees it is
        staged (q and dO both ways, lse, D), Pᵀ and dSᵀ are recomputed with vectors along the
        queries, and dV += Pᵀ dO, dK += dSᵀ q accumulate.
Where there are enough batch indices to fill the cores (CPU devices), `per_head` saves the dq
kernel's second sweep (8 matrix products per block pair become 6): the first kernel only
computes lse and D, and one work-group per batch index takes its key blocks in turn, adding
dS k into dQ's rows (its own: no atomics) as well.

CPU devices (PoCL) get one work-item per work-group and no barriers (PoCL would otherwise run
the loop over the work-items inside the micro-kernel's loop, its accumulators in memory),
register blocks of 4 rows and VW the preferred float vector width; GPUs get scalars, a
work-item per row and tiles padded by one float against bank conflicts. Block sizes come from
the device's local memory and work-group limits (`AttentionParams`, open to the tuner). Shapes,
strides and parameters are constants in the source; operands may have any layout whose feature
axis is the last."""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, replace

import numpy as np
from tilefuse.ir import primitives as P
from tilefuse.ir.errors import CompileError
from tilefuse.ir.kernel.attention import Spec, spec_of
from tilefuse.runtime import tuner

F32 = np.dtype(np.float32)
WIDTHS = (1, 2, 4, 8, 16)  # OpenCL vector widths


def _pad(n: int, m: int) -> int:
    return -(-n // m) * m


# ---- block sizes ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionParams:
    """The template's parameters: queries and keys per block, work-items per work-group (each
    owns an equal share of the block's rows), rows per register block, the vector width along
    the tiles' rows, vectors per register block of an accumulation, and the backward's scheme."""
    bq: int = 64
    bk: int = 64
    items: int = 1
    rows: int = 4
    vw: int = 16
    chunk: int = 4
    per_head: bool = False  # backward: dQ in the dK/dV kernel, one work-group per batch index


    def ld(self, n: int) -> int:
        """Row length of a local tile of n columns: whole vectors, or one float of padding with
        scalars (GPUs: work-items reading down a column then hit different banks)."""
        return _pad(n, self.vw) if self.vw > 1 else n + 1

    def local_floats(self, sp: Spec) -> int:
        """Local memory of the template's largest kernel, in floats."""
        dp, dvp, ldk, ldq = _pad(sp.d, self.vw), _pad(sp.dv, self.vw), self.ld(self.bk), self.ld(self.bq)
        bias_k, bias_q = (self.bq * ldk, self.bk * ldq) if sp.has_bias else (0, 0)
        rows = self.bq * (self.ld(sp.d) + 4)  # the queries, and per row m, l (lse, D)
        if not sp.bwd:
            return rows + sp.d * ldk + (self.bk + self.bq) * dvp + self.bq * ldk + bias_k
        dq = (rows + self.bq * (self.ld(sp.dv) + dp) + (sp.d + sp.dv) * ldk + self.bk * dp
              + 2 * self.bq * ldk + bias_k)
        dkdv = (self.bk * (self.ld(sp.d) + self.ld(sp.dv) + dp + dvp) + (sp.d + sp.dv) * ldq
                + self.bq * (dp + dvp) * (2 if self.per_head else 1) + 2 * self.bk * ldq + 2 * ldq
                + bias_q)
        return max(dq, dkdv)

    def check(self, info, sp: Spec) -> str | None:
        """Why these parameters cannot run on the device, or None."""
        if self.vw not in WIDTHS or min(self.bq, self.bk, self.items, self.rows, self.chunk) < 1:
            return f"bad parameters {self}"
        share = self.items * self.rows
        if self.bq % share or self.bk % share or self.bq % self.vw or self.bk % self.vw:
            return f"{self}: work-items x rows must divide the blocks, and the vector width both"
        if self.per_head and self.items != 1:
            return f"{self}: the backward per batch index runs one work-item per work-group"
        if self.items > info.max_work_group:
            return f"{self}: the device's work-groups hold at most {info.max_work_group} work-items"
        if 4 * self.local_floats(sp) > info.local_mem_bytes:
            return f"{self}: {4 * self.local_floats(sp)} bytes of local memory exceed the " \
                   f"device's {info.local_mem_bytes}"
        return None


def default_params(info, sp: Spec) -> AttentionParams | None:
    """CPUs: 128 x 64 blocks (64 x 64 backward), one work-item per work-group (PoCL would put
    the loop over work-items inside the micro-kernel's loop), register blocks of 4 rows in
    vectors of the preferred width, the backward per batch index where there are enough of
    them to fill the cores. GPUs: 64 x 32 blocks, scalars, 32 work-items of one-row
    register blocks. Blocks halved until the tiles fit in local memory (None if they never do)."""
    if info.extra.get("device_type") == "cpu":
        vw = info.extra.get("preferred_width", {}).get("float", 4)
        p = AttentionParams(64 if sp.bwd else 128, 64, 1, 4, vw if vw in WIDTHS else 4, 4,
                            per_head=sp.nb >= 2 * info.compute_units)
    else:
        p = AttentionParams(64, 32, 32, 1, 1, 64)
    while p.check(info, sp) is not None:
        share = max(p.items * p.rows, p.vw)
        if p.bk >= p.bq and p.bk // 2 >= share:
            p = replace(p, bk=p.bk // 2)
        elif p.bq // 2 >= share:
            p = replace(p, bq=p.bq // 2)
        elif p.items > 1:
            p = replace(p, items=p.items // 2)
        else:
            return None
    return p


def applies(kernel, device) -> bool:
    """float32 operands whose feature axis is the last one, with blocks that fit the device."""
    eqns = kernel.meta.get("eqns", ())
    if len(eqns) != 1 or eqns[0].prim not in (P.fused_attention, P.fused_attention_bwd):
        return False
    e = eqns[0]
    if not (all(a.aval.dtype == F32 for a in e.inputs) and all(a.aval.size > 0 for a in e.inputs)
            and all(d[-1] == a.aval.ndim - 1 for d, a in zip(e.params["dims"], e.inputs[:3]))):
        return False
    return default_params(device.info, spec_of(e)) is not None


# ---- OpenCL C ----------------------------------------------------------------------------------

def _prelude(sp: Spec, p: AttentionParams) -> str:
    vw = p.vw
    vec, ivec = ("float", "int") if vw == 1 else (f"float{vw}", f"int{vw}")
    load = "(*(p))" if vw == 1 else f"vload{vw}(0, (p))"
    store = "(*(p) = (x))" if vw == 1 else f"vstore{vw}((x), 0, (p))"
    lane = "0" if vw == 1 else f"(({ivec})({', '.join(map(str, range(vw)))}))"
    hmax, hsum, h, w = [], [], "x", vw
    while w > 1:
        w //= 2
        t = f"float{w}" if w > 1 else "float"
        hmax.append(f"const {t} m{w} = fmax({h}.lo, {h}.hi);")
        hsum.append(f"const {t} m{w} = {h}.lo + {h}.hi;")
        h = f"m{w}"
    bases = []
    for name, bstrides in zip(("q", "k", "v", "o", "b"), sp.batch_strides):
        terms, inner = [], 1
        for n, s in reversed(list(zip(sp.batch, bstrides))):
            if s and n > 1:
                terms.append(f"((t / {inner}L) % {n}L) * {s}L")
            inner *= n
        bases.append(f"static inline long base_{name}(long t) {{ return {' + '.join(terms) or '0L'}; }}")
    bases = "\n".join(bases)
    limit = "max(0L, min((long)SK, (i) + OFF + 1L))" if sp.causal else "(long)SK"
    return f"""
#define SQ {sp.sq}L
#define SK {sp.sk}L
#define NB {sp.nb}L
#define D {sp.d}
#define DV {sp.dv}
#define OFF {sp.offset}L
#define SCALE {sp.scale!r}f
#define VW {vw}
#define RQ {p.rows}
#define NT {p.items}
#define RSQ {sp.rows[0]}L
#define RSK {sp.rows[1]}L
#define RSV {sp.rows[2]}L
#define RSO {sp.rows[3]}L
#define BS0 {sp.bias_strides[0]}L
#define BS1 {sp.bias_strides[1]}L
#define LIMIT(i) ({limit})
// one work-item: no barriers. Several: a barrier before and after every loop holding barriers
// too, so that PoCL's parallel regions have one entry each (it asserts otherwise)
#define SYNC() {"barrier(CLK_LOCAL_MEM_FENCE)" if p.items > 1 else ""}
typedef {vec} VEC;
#define VLOAD(p) {load}
#define VSTORE(x, p) {store}
#define LANE {lane}
static inline float hmax(VEC x) {{ {" ".join(hmax) or "const float m1 = x;"} return m1; }}
static inline float hsum(VEC x) {{ {" ".join(hsum) or "const float m1 = x;"} return m1; }}
static inline void store_vec(__global float* p, VEC x, int left) {{
    if (left >= VW) {{ VSTORE(x, p); return; }}
    float t[VW];
    VSTORE(x, t);
    for (int i = 0; i < left; i++) p[i] = t[i];
}}
{bases}
"""


def _stage(p: AttentionParams, dst, ld, src, base, rs, cs, valid_r, valid_c, rows, cols,
           transpose=False, fill="0.0f"):
    """Cooperative load of a rows x cols tile: dst[r*ld + c] (dst[c*ld + r] transposed) =
    src[base + r*rs + c*cs] for r < valid_r, c < valid_c, else `fill`. Scalars: consecutive
    work-items read consecutive columns (coalesced). Vectors: row by row, whole vectors where
    the row is valid and contiguous."""
    val = f"(r < {valid_r} && c < {valid_c}) ? {src}[{base} + r * {rs} + c * {cs}] : {fill}"
    at = f"c * {ld} + r" if transpose else f"r * {ld} + c"
    if p.vw == 1:
        return (f"for (int x = tid; x < {rows * cols}; x += NT) {{ "
                f"const int r = x / {cols}, c = x % {cols}; {dst}[{at}] = {val}; }}")
    if transpose or cs != "1" or cols % p.vw:
        return f"for (int r = tid; r < {rows}; r += NT) for (int c = 0; c < {cols}; c++) {dst}[{at}] = {val};"
    return (f"for (int r = tid; r < {rows}; r += NT) for (int c0 = 0; c0 < {cols}; c0 += VW) {{ "
            f"__local float* d_ = {dst} + r * {ld} + c0; "
            f"if (r < {valid_r} && c0 + VW <= {valid_c}) VSTORE(VLOAD({src} + {base} + r * {rs} + c0), d_); "
            f"else for (int c = c0; c < c0 + VW; c++) d_[c - c0] = {val}; }}")


def _mm(p: AttentionParams, out, ldo, nv, a, lda, b, ldb, n, init="zero", a_t=False):
    """out[(R0 + r)*ldo + c*VW] = init + Σ_{x<n} a[(R0 + r)*lda + x] · b[x*ldb + c*VW] for the
    register block's rows r < RQ and c < nv (a[x*lda + R0 + r] with a_t): a's scalars broadcast,
    b's rows as vectors, chunks of `chunk` vectors in registers. init: "zero", "load" (out's
    values) or "scaled" (out's values times alpha[r])."""
    a_at = f"x * {lda} + R0 + r" if a_t else f"(R0 + r) * {lda} + x"
    out_ = []
    for c0 in range(0, nv, p.chunk):
        nc = min(nv, c0 + p.chunk) - c0
        at = f"{out} + (R0 + r) * {ldo} + (c + {c0}) * VW"
        first = {"zero": "(VEC)(0.0f)", "load": f"VLOAD({at})", "scaled": f"VLOAD({at}) * alpha[r]"}[init]
        out_.append(f"""{{
            VEC acc[RQ][{nc}];
            #pragma unroll
            for (int r = 0; r < RQ; r++)
                #pragma unroll
                for (int c = 0; c < {nc}; c++) acc[r][c] = {first};
            for (int x = 0; x < {n}; x++) {{
                VEC b_[{nc}];
                #pragma unroll
                for (int c = 0; c < {nc}; c++) b_[c] = VLOAD({b} + x * {ldb} + (c + {c0}) * VW);
                #pragma unroll
                for (int r = 0; r < RQ; r++) {{
                    const VEC a_ = (VEC)({a}[{a_at}]);
                    #pragma unroll
                    for (int c = 0; c < {nc}; c++) acc[r][c] = fma(a_, b_[c], acc[r][c]);
                }}
            }}
            #pragma unroll
            for (int r = 0; r < RQ; r++)
                #pragma unroll
                for (int c = 0; c < {nc}; c++) VSTORE(acc[r][c], {at});
        }}""")
    return "\n            ".join(out_)


def _params(sp: Spec, extra: str) -> str:
    bias = "__global const float* restrict bias, " if sp.has_bias else ""
    return f"__global const float* restrict q, __global const float* restrict k, " \
           f"__global const float* restrict v, {bias}{extra}"


def _scores_row(sp: Spec, ldk: int) -> str:
    """Row r's chunk c of the block's scores (in Ps) scaled, biased and masked to -inf past the
    row's last visible key (lim): x."""
    bias = f" + VLOAD(Bs + (R0 + r) * {ldk} + c * VW)" if sp.has_bias else ""
    return (f"VEC x = VLOAD(Ps + (R0 + r) * {ldk} + c * VW) * SCALE{bias}; "
            f"x = select(x, (VEC)(-INFINITY), LANE + c * VW >= lim);")


def _query_block_head(p: AttentionParams) -> str:
    return f"""    const int tid = get_local_id(0), PER = {p.bq} / NT;
    const long t = get_group_id(1), i0 = (long)get_group_id(0) * {p.bq};
    const long qb = base_q(t), kb = base_k(t), vb = base_v(t), ob = base_o(t), bb = base_b(t);
    const int nq = (int)min({p.bq}L, SQ - i0);
    const long kend = LIMIT(i0 + nq - 1);"""


def _key_block_stage(sp: Spec, p: AttentionParams, tiles: tuple) -> str:
    """Stage the key block j0's tiles: Kt (kᵀ), Vt (vᵀ), Ks (k), Vs (v), Bs (the bias)."""
    ldk, bk = p.ld(p.bk), p.bk
    dp, dvp = _pad(sp.d, p.vw), _pad(sp.dv, p.vw)
    src = {"Kt": ("k", "kb", "RSK", "D", sp.d, ldk, True),
           "Vt": ("v", "vb", "RSV", "DV", sp.dv, ldk, True),
           "Ks": ("k", "kb", "RSK", "D", dp, dp, False),
           "Vs": ("v", "vb", "RSV", "DV", dvp, dvp, False)}
    out = []
    for name in tiles:
        buf, base, rs, n, cols, ld, tr = src[name]
        out.append(_stage(p, name, ld, buf, f"{base} + j0 * {rs}", rs, "1", "nk", n, bk, cols, tr))
    if sp.has_bias:
        out.append(_stage(p, "Bs", ldk, "bias", "bb + i0 * BS0 + j0 * BS1", "BS0", "BS1", "nq", "nk",
                          p.bq, bk))
    return "\n        ".join(out)


def _own_rows(what: str) -> str:
    """A loop over this work-item's rows of the block (row index rr)."""
    return f"for (int rr = tid * PER; rr < (tid + 1) * PER; rr++) {{ {what} }}"


def _row_stats(nvk: int, ldk: int, sp: Spec, write_p: bool) -> str:
    """Online softmax over the register block's rows of the scores in Ps: running max Ms and
    sum Ls; alpha[r] = exp(m_old - m_new); with write_p, P = exp(x - m_new) into Ps."""
    store = f"VSTORE(e, Ps + (R0 + r) * {ldk} + c * VW);" if write_p else ""
    return f"""float alpha[RQ];
            #pragma unroll
            for (int r = 0; r < RQ; r++) {{
                const int lim = (int)clamp(LIMIT(i0 + R0 + r) - j0, 0L, (long){nvk} * VW);
                VEC xs[{nvk}];
                float mx = -INFINITY;
                #pragma unroll
                for (int c = 0; c < {nvk}; c++) {{ {_scores_row(sp, ldk)} xs[c] = x; mx = fmax(mx, hmax(x)); }}
                const float m0 = Ms[R0 + r], mn = fmax(m0, mx), ms = mn == -INFINITY ? 0.0f : mn;
                alpha[r] = exp(m0 - ms);
                VEC sum = (VEC)(0.0f);
                #pragma unroll
                for (int c = 0; c < {nvk}; c++) {{ const VEC e = exp(xs[c] - ms); {store} sum += e; }}
                Ls[R0 + r] = Ls[R0 + r] * alpha[r] + hsum(sum);
                Ms[R0 + r] = mn;
            }}"""


def forward_source(name: str, sp: Spec, p: AttentionParams) -> str:
    ldq, ldk = p.ld(sp.d), p.ld(p.bk)
    dvp = _pad(sp.dv, p.vw)
    nvk, nvo = p.bk // p.vw, dvp // p.vw
    bias = f", Bs[{p.bq * ldk}]" if sp.has_bias else ""
    return f"""
__kernel __attribute__((reqd_work_group_size(NT, 1, 1)))
void {name}({_params(sp, "__global float* restrict out")}) {{
    __local float Qs[{p.bq * ldq}], Kt[{sp.d * ldk}], Vs[{p.bk * dvp}], Ps[{p.bq * ldk}],
        Os[{p.bq * dvp}], Ms[{p.bq}], Ls[{p.bq}]{bias};
{_query_block_head(p)}
    {_stage(p, "Qs", ldq, "q", "qb + i0 * RSQ", "RSQ", "1", "nq", "D", p.bq, sp.d)}
    {_own_rows(f"Ms[rr] = -INFINITY; Ls[rr] = 0.0f; for (int c = 0; c < {dvp}; c++) Os[rr * {dvp} + c] = 0.0f;")}
    SYNC();
    for (long j0 = 0; j0 < kend; j0 += {p.bk}) {{
        const int nk = (int)min({p.bk}L, kend - j0);
        SYNC();
        {_key_block_stage(sp, p, ("Kt", "Vs"))}
        SYNC();
        for (int R0 = tid * PER; R0 < (tid + 1) * PER; R0 += RQ) {{
            {_mm(p, "Ps", ldk, nvk, "Qs", ldq, "Kt", ldk, "D")}
            {_row_stats(nvk, ldk, sp, True)}
            {_mm(p, "Os", dvp, nvo, "Ps", ldk, "Vs", dvp, "nk", "scaled")}
        }}
    }}
    SYNC();
    for (int rr = tid * PER; rr < (tid + 1) * PER && i0 + rr < SQ; rr++) {{
        const float inv = Ls[rr] > 0.0f ? 1.0f / Ls[rr] : 0.0f;
        for (int c = 0; c < {nvo}; c++)
            store_vec(out + ob + (i0 + rr) * RSO + c * VW, VLOAD(Os + rr * {dvp} + c * VW) * inv, DV - c * VW);
    }}
}}
"""


def dq_source(name: str, sp: Spec, p: AttentionParams) -> str:
    """The backward's first kernel: lse and D into the workspace, then dQ (per_head: only lse
    and D, the second kernel computes dQ)."""
    ldq, ldo, ldk = p.ld(sp.d), p.ld(sp.dv), p.ld(p.bk)
    dp = _pad(sp.d, p.vw)
    nvk = p.bk // p.vw
    bias = f", Bs[{p.bq * ldk}]" if sp.has_bias else ""
    extra = ("__global const float* restrict o, __global const float* restrict dout, "
             "__global float* restrict packed, __global float* restrict ws")
    sweep2_tiles = f", Vt[{sp.dv * ldk}], Ks[{p.bk * dp}], Ts[{p.bq * ldk}], dQs[{p.bq * dp}]"
    return f"""
__kernel __attribute__((reqd_work_group_size(NT, 1, 1)))
void {name}({_params(sp, extra)}) {{
    __local float Qs[{p.bq * ldq}], dOs[{p.bq * ldo}], Kt[{sp.d * ldk}], Ps[{p.bq * ldk}],
        Ms[{p.bq}], Ls[{p.bq}]{bias}{"" if p.per_head else sweep2_tiles};
{_query_block_head(p)}
    {_stage(p, "Qs", ldq, "q", "qb + i0 * RSQ", "RSQ", "1", "nq", "D", p.bq, sp.d)}
    {_stage(p, "dOs", ldo, "dout", "ob + i0 * RSO", "RSO", "1", "nq", "DV", p.bq, sp.dv)}
    {_own_rows("Ms[rr] = -INFINITY; Ls[rr] = 0.0f;")}
    SYNC();
    for (long j0 = 0; j0 < kend; j0 += {p.bk}) {{  // sweep 1: each row's max and sum
        const int nk = (int)min({p.bk}L, kend - j0);
        SYNC();
        {_key_block_stage(sp, p, ("Kt",))}
        SYNC();
        for (int R0 = tid * PER; R0 < (tid + 1) * PER; R0 += RQ) {{
            {_mm(p, "Ps", ldk, nvk, "Qs", ldq, "Kt", ldk, "D")}
            {_row_stats(nvk, ldk, sp, False)}
        }}
    }}
    SYNC();
    for (int rr = tid * PER; rr < (tid + 1) * PER; rr++) {{  // lse (+inf: no key visible, P = 0), D = dO·O
        const long i = i0 + rr;
        const float lse = Ls[rr] > 0.0f ? Ms[rr] + log(Ls[rr]) : INFINITY;
        float di = 0.0f;
        if (i < SQ) {{
            for (int c = 0; c < DV; c++) di = fma(dOs[rr * {ldo} + c], o[ob + i * RSO + c], di);
            ws[t * SQ + i] = lse;
            ws[NB * SQ + t * SQ + i] = di;
        }}
        Ms[rr] = lse;
        Ls[rr] = di;
    }}
{"" if p.per_head else _dq_sweep(sp, p)}}}
"""


def _dq_sweep(sp: Spec, p: AttentionParams) -> str:
    """The dq kernel's second sweep: dS per key block, dQ += dS k, dQ stored."""
    ldq, ldo, ldk = p.ld(sp.d), p.ld(sp.dv), p.ld(p.bk)
    dp = _pad(sp.d, p.vw)
    nvk, nvd = p.bk // p.vw, dp // p.vw
    return f"""
    {_own_rows(f"for (int c = 0; c < {dp}; c++) dQs[rr * {dp} + c] = 0.0f;")}
    SYNC();
    for (long j0 = 0; j0 < kend; j0 += {p.bk}) {{  // sweep 2: dS and dQ
        const int nk = (int)min({p.bk}L, kend - j0);
        SYNC();
        {_key_block_stage(sp, p, ("Kt", "Vt", "Ks"))}
        SYNC();
        for (int R0 = tid * PER; R0 < (tid + 1) * PER; R0 += RQ) {{
            {_mm(p, "Ps", ldk, nvk, "Qs", ldq, "Kt", ldk, "D")}
            {_mm(p, "Ts", ldk, nvk, "dOs", ldo, "Vt", ldk, "DV")}
            for (int r = 0; r < RQ; r++) {{  // P = exp(S - lse), dS = P (dP - D) scale
                const int lim = (int)clamp(LIMIT(i0 + R0 + r) - j0, 0L, (long){nvk} * VW);
                const float lse = Ms[R0 + r], di = Ls[R0 + r];
                #pragma unroll
                for (int c = 0; c < {nvk}; c++) {{
                    {_scores_row(sp, ldk)}
                    const int at = (R0 + r) * {ldk} + c * VW;
                    VSTORE(exp(x - lse) * (VLOAD(Ts + at) - di) * SCALE, Ps + at);
                }}
            }}
            {_mm(p, "dQs", dp, nvd, "Ps", ldk, "Ks", dp, "nk", "load")}
        }}
    }}
    SYNC();
    for (int rr = tid * PER; rr < (tid + 1) * PER && i0 + rr < SQ; rr++)
        for (int c = 0; c < {nvd}; c++)
            store_vec(packed + qb + (i0 + rr) * RSQ + c * VW, VLOAD(dQs + rr * {dp} + c * VW), D - c * VW);
"""


def dkdv_source(name: str, sp: Spec, p: AttentionParams) -> str:
    """The backward's second kernel: dK and dV per key block, over the query blocks that see it.
    per_head: one work-group per batch index takes its key blocks in turn and accumulates dQ
    += dS k as well, in dQ's own rows (no other work-group writes them)."""
    ldkk, ldvv, ldq = p.ld(sp.d), p.ld(sp.dv), p.ld(p.bq)
    dp, dvp = _pad(sp.d, p.vw), _pad(sp.dv, p.vw)
    nvq, nvd, nvo = p.bq // p.vw, dp // p.vw, dvp // p.vw
    bias = f", Bt[{p.bk * ldq}]" if sp.has_bias else ""
    mask_bias = " + VLOAD(Bt + at)" if sp.has_bias else ""
    causal = "x = select(x, (VEC)(-INFINITY), LANE + c * VW + d0 < 0);" if sp.causal else ""
    first = f"(max(j0 - OFF, 0L) / {p.bq}) * {p.bq}" if sp.causal else "0"
    extra = ("__global const float* restrict o, __global const float* restrict dout, "
             "__global float* restrict packed, __global const float* restrict ws")
    dq_tile, dq_zero, dq_update = "", "", ""
    if p.per_head:
        dq_tile = f", dQs[{p.bq * dp}]"
        dq_zero = "for (long i = 0; i < SQ; i++) for (int c = 0; c < D; c++) packed[qb + i * RSQ + c] = 0.0f;"
        dq_update = f"""{_stage(p, "dQs", dp, "packed", "qb + i0 * RSQ", "RSQ", "1", "nq", "D", p.bq, dp)}
            for (int R0 = 0; R0 < {p.bq}; R0 += RQ) {{
                {_mm(p, "dQs", dp, nvd, "St", ldq, "Ks", ldkk, "nk", "load", a_t=True)}
            }}
            for (int rr = 0; rr < nq; rr++)
                for (int c = 0; c < {nvd}; c++)
                    store_vec(packed + qb + (i0 + rr) * RSQ + c * VW, VLOAD(dQs + rr * {dp} + c * VW), D - c * VW);"""
    key_blocks = (f"for (long j0 = 0; j0 < SK; j0 += {p.bk}) {{" if p.per_head else
                  f"{{ const long j0 = (long)get_group_id(0) * {p.bk};")
    return f"""
__kernel __attribute__((reqd_work_group_size(NT, 1, 1)))
void {name}({_params(sp, extra)}) {{
    __local float Ks[{p.bk * ldkk}], Vs[{p.bk * ldvv}], Qt[{sp.d * ldq}], dOt[{sp.dv * ldq}],
        Qs[{p.bq * dp}], dOs[{p.bq * dvp}], Pt[{p.bk * ldq}], St[{p.bk * ldq}], Lq[{ldq}],
        Dq[{ldq}], dKs[{p.bk * dp}], dVs[{p.bk * dvp}]{bias}{dq_tile};
    const int tid = get_local_id(0), PER = {p.bk} / NT;
    const long t = get_group_id(1);
    const long qb = base_q(t), kb = base_k(t), vb = base_v(t), ob = base_o(t), bb = base_b(t);
    {dq_zero}
    {key_blocks}
    const int nk = (int)min({p.bk}L, SK - j0);
    SYNC();
    {_stage(p, "Ks", ldkk, "k", "kb + j0 * RSK", "RSK", "1", "nk", "D", p.bk, dp)}
    {_stage(p, "Vs", ldvv, "v", "vb + j0 * RSV", "RSV", "1", "nk", "DV", p.bk, sp.dv)}
    {_own_rows(f"for (int c = 0; c < {dp}; c++) dKs[rr * {dp} + c] = 0.0f; for (int c = 0; c < {dvp}; c++) dVs[rr * {dvp} + c] = 0.0f;")}
    SYNC();
    for (long i0 = {first}; i0 < SQ; i0 += {p.bq}) {{
        const int nq = (int)min({p.bq}L, SQ - i0);
        SYNC();
        {_stage(p, "Qt", ldq, "q", "qb + i0 * RSQ", "RSQ", "1", "nq", "D", p.bq, sp.d, True)}
        {_stage(p, "dOt", ldq, "dout", "ob + i0 * RSO", "RSO", "1", "nq", "DV", p.bq, sp.dv, True)}
        {_stage(p, "Qs", dp, "q", "qb + i0 * RSQ", "RSQ", "1", "nq", "D", p.bq, dp)}
        {_stage(p, "dOs", dvp, "dout", "ob + i0 * RSO", "RSO", "1", "nq", "DV", p.bq, dvp)}
        {_stage(p, "Lq", ldq, "ws", "t * SQ + i0", "1", "0", "nq", "1", ldq, 1, True, "INFINITY")}
        {_stage(p, "Dq", ldq, "ws", "NB * SQ + t * SQ + i0", "1", "0", "nq", "1", ldq, 1, True)}
        {_stage(p, "Bt", ldq, "bias", "bb + i0 * BS0 + j0 * BS1", "BS0", "BS1", "nq", "nk", p.bq, p.bk, True)
         if sp.has_bias else ""}
        SYNC();
        for (int R0 = tid * PER; R0 < (tid + 1) * PER; R0 += RQ) {{
            {_mm(p, "Pt", ldq, nvq, "Ks", ldkk, "Qt", ldq, "D")}
            {_mm(p, "St", ldq, nvq, "Vs", ldvv, "dOt", ldq, "DV")}
            for (int r = 0; r < RQ; r++) {{  // Pᵀ = exp(Sᵀ - lse), dSᵀ = Pᵀ (dPᵀ - D) scale
                const int d0 = (int)(i0 + OFF - (j0 + R0 + r));  // query i sees key j when i + OFF >= j
                #pragma unroll
                for (int c = 0; c < {nvq}; c++) {{
                    const int at = (R0 + r) * {ldq} + c * VW;
                    VEC x = VLOAD(Pt + at) * SCALE{mask_bias};
                    {causal}
                    const VEC pr = exp(x - VLOAD(Lq + c * VW));
                    VSTORE(pr, Pt + at);
                    VSTORE(pr * (VLOAD(St + at) - VLOAD(Dq + c * VW)) * SCALE, St + at);
                }}
            }}
            {_mm(p, "dVs", dvp, nvo, "Pt", ldq, "dOs", dvp, "nq", "load")}
            {_mm(p, "dKs", dp, nvd, "St", ldq, "Qs", dp, "nq", "load")}
        }}
        {dq_update}
    }}
    SYNC();
    for (int rr = tid * PER; rr < (tid + 1) * PER && j0 + rr < SK; rr++) {{
        const long j = j0 + rr;
        for (int c = 0; c < {nvd}; c++)
            store_vec(packed + {sp.sizes[0]}L + kb + j * RSK + c * VW, VLOAD(dKs + rr * {dp} + c * VW), D - c * VW);
        for (int c = 0; c < {nvo}; c++)
            store_vec(packed + {sp.sizes[0] + sp.sizes[1]}L + vb + j * RSV + c * VW, VLOAD(dVs + rr * {dvp} + c * VW), DV - c * VW);
    }}
    }}
}}
"""


# ---- building and launching ------------------------------------------------------------------------

class _Launch:
    """run(buffers): enqueues the template's kernels in order on the device's queue; returns an
    event spanning them (for the profiler)."""

    def __init__(self, state, kernels, grids, local, ws_bytes, backend, device, source):
        self._state, self._kernels, self._grids, self._local = state, kernels, grids, local
        self._ws_bytes, self._backend, self._device = ws_bytes, backend, device
        self.source = source

    def __call__(self, buffers):
        from .build import translate
        st = self._state
        ws = self._backend.alloc(self._ws_bytes, self._device) if self._ws_bytes else None
        args = [getattr(b, "mem", b) for b in buffers] + ([ws.mem] if ws is not None else [])
        events = []
        try:
            with st.launch_lock:  # a cl.Kernel holds its arguments: set and enqueue as one step
                for knl, grid in zip(self._kernels, self._grids):
                    knl.set_args(*args)
                    events.append(st.cl.enqueue_nd_range_kernel(st.queue, knl, grid, self._local))
        except st.cl.Error as e:
            raise translate(e, "launch the attention kernels", st.info.name) from None
        finally:
            if ws is not None:  # the in-order queue runs later users of the block after these
                self._backend.free(ws, self._device)
        ev = events[0] if len(events) == 1 else _Span(events)
        st.last_event = ev
        return ev


class _Span:
    """Several events seen as one launch (`wait()`, `profile.queued/start/end` like a pyopencl
    event's): queued and started with the first, ended with the last. The times are read when
    asked for, once the events have completed."""

    def __init__(self, events):
        self._events = events
        self.profile = _SpanProfile(events)

    def wait(self):
        self._events[-1].wait()


class _SpanProfile:
    def __init__(self, events):
        self._first, self._last = events[0], events[-1]

    queued = property(lambda self: self._first.profile.queued)
    start = property(lambda self: self._first.profile.start)
    end = property(lambda self: self._last.profile.end)


def build(kernel, device, backend, params: AttentionParams | None = None):
    """run(buffers): the FlashAttention kernels of the template kernel's equation."""
    (eqn,) = kernel.meta["eqns"]
    sp = spec_of(eqn)
    st = backend._state(device)
    p = params or default_params(st.info, sp)
    why = p.check(st.info, sp) if p is not None else "no block size fits the device"
    if why is not None:
        raise CompileError(f"opencl attention: {why}", backend="opencl", kernel=str(kernel))
    name = "tf_attn_" + hashlib.sha1(repr((sp, p)).encode()).hexdigest()[:16]
    nqb, nkb = -(-sp.sq // p.bq), -(-sp.sk // p.bk)
    local = (p.items, 1)
    if not sp.bwd:
        names, src = [name], _prelude(sp, p) + forward_source(name, sp, p)
        grids = [(nqb * p.items, sp.nb)]
    else:
        names = [name + "_dq", name + "_dkdv"]
        src = _prelude(sp, p) + dq_source(names[0], sp, p) + dkdv_source(names[1], sp, p)
        grids = [(nqb * p.items, sp.nb), ((1 if p.per_head else nkb) * p.items, sp.nb)]
    knls = backend.programs.kernels(st.ctx, st.dev, src, names, str(kernel))
    ws_bytes = 4 * 2 * sp.nb * sp.sq if sp.bwd else 0
    return _Launch(st, knls, grids, local, ws_bytes, backend, device, src)


# ---- the auto-tuner's view (runtime/tuner.py) ------------------------------------------------------
# Every configuration is a compile; AttentionParams.check prunes what the device cannot hold and
# what does not tile the blocks. CPU devices (PoCL) vectorise within one work-item; GPUs spread a
# block's rows over the work-items of a work-group.

def _spec(kernel) -> Spec:
    return spec_of(kernel.meta["eqns"][0])


def _space(kernel, device) -> dict:
    sp = _spec(kernel)
    space = {"bq": (16, 32, 64, 128, 256), "bk": (16, 32, 64, 128)}
    if device.info.extra.get("device_type") == "cpu":
        space.update(items=(1,), rows=(1, 2, 4, 8), vw=(4, 8, 16), chunk=(1, 2, 4, 8))
    else:
        space.update(items=(8, 16, 32, 64, 128), rows=(1, 2), vw=(1, 2, 4), chunk=(8, 16, 32, 64))
    space["per_head"] = (False, True) if sp.bwd else (False,)
    return space


def _default(kernel, device) -> dict:
    return asdict(default_params(device.info, _spec(kernel)))


def _check(params: dict, kernel, device) -> str | None:
    return AttentionParams(**params).check(device.info, _spec(kernel))


def tuning_key(kernel, backend_name: str = "opencl") -> tuple[str, str]:
    """Forward or backward, causal, with a bias: the signature; sizes by power-of-two class (the
    CUDA template's key too)."""
    sp = _spec(kernel)
    sig = f"{backend_name}-attention-" + ("bwd" if sp.bwd else "fwd") + "-causal" * sp.causal \
        + "-bias" * sp.has_bias
    return sig, "x".join(str(tuner.size_class(n)) for n in (sp.nb, sp.sq, sp.sk)) + f"/{sp.d}x{sp.dv}"


tuner.register(tuner.Template("opencl_attention", "flash_attention", ("opencl",), _space, _default,
                              lambda kernel, device, backend, params: build(kernel, device, backend,
                                                                            AttentionParams(**params)),
                              _check, tuning_key, applies))
