"""numpy's float32 math written in the kernel IR's arithmetic and bit operations, for targets
whose built-in functions are loose or undefined where numpy's are not: WGSL promises exp only
to 3 + 2|x| ulp, log to 2^-21 absolute near 1, and pow nothing for x <= 0. `expand` rewrites a
tile kernel's exp, log, expm1, log1p, tanh, logistic, erf and pow into these (float16 and
bfloat16 through float32), so a backend prints arithmetic, selects and bitcasts only. The
polynomials are Cephes' (exp, log) and a fit of erf; the LLVM backend's vecmath prints the same
erf. Written for drivers that may reassociate float arithmetic (a Cody-Waite reduction reads
its multiple of ln 2 a second time through an integer, which such algebra cannot merge)."""
from __future__ import annotations

import dataclasses

import numpy as np

from .ir import KExpr, binary, bitcast, cast, const, select, unary
from .tile import If, Range, Store, TileKernel

F32, I32 = np.dtype(np.float32), np.dtype(np.int32)
EXPANDED = ("exp", "log", "expm1", "log1p", "tanh", "logistic", "erf", "pow")

# erf: |x| < 0.9: x·P(x²); 0.9 ≤ |x| < 3.95: 1 - exp(Q(|x| - 2.425)), Q ≈ log erfc; beyond: ±1
# (fitted toward minimax in float64); coefficients from the highest degree down
ERF_SMALL = (8.53883902891539e-05, -0.0008181927260011435, 0.005204435903578997,
             -0.026860753074288368, 0.11283719539642334, -0.37612634897232056, 1.128379225730896)
ERF_LARGE = (-7.444486360697056e-09, 1.625219169909542e-06, -1.4225823179003783e-05,
             8.458823140244931e-05, -0.0004566970746964216, 0.0023295078426599503,
             -0.011532275937497616, -0.9413756132125854, -5.2112836837768555, -7.410668849945068)
# Cephes expf on |r| ≤ ln2/2: exp(r) ≈ 1 + r + r²·P(r); ln 2 = LN2_HI - LN2_LO, LN2_HI exact in 9 bits
EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
LN2_HI, LN2_LO = 0.693359375, 2.12194440e-4
# Cephes logf on m = f - 1, f in [sqrt(1/2), sqrt(2)): log(1 + m) ≈ m - m²/2 + m³·P(m)
LOG_P = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
         -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)
TINY = 1.17549435e-38  # the smallest normal float32


def c(v) -> KExpr:
    return const(v, F32)


def i(v) -> KExpr:
    return const(v, I32)


def add(a, b):
    return binary("add", a, b)


def sub(a, b):
    return binary("sub", a, b)


def mul(a, b):
    return binary("mul", a, b)


def horner(coeffs, x: KExpr) -> KExpr:
    r = c(coeffs[0])
    for k in coeffs[1:]:
        r = add(mul(r, x), c(k))
    return r


def bits(x: KExpr) -> KExpr:
    return bitcast(x, I32)


def pow2(n: KExpr) -> KExpr:
    """2**n for an int32 n in [-126, 127]: its bits."""
    return bitcast(binary("shift_left", add(n, i(127)), i(23)), F32)


def copysign(x: KExpr, s: KExpr) -> KExpr:
    """|x| with s's sign bit (x >= 0)."""
    return bitcast(binary("or", bits(x), binary("and", bits(s), i(-(1 << 31)))), F32)


def isnan(x):
    return binary("ne", x, x)


def finite(x):
    return binary("ne", binary("and", bits(x), i(0x7F800000)), i(0x7F800000))


def either(a, b):
    return binary("or", a, b)


def both(a, b):
    return binary("and", a, b)


def _reduce(x: KExpr) -> tuple[KExpr, KExpr]:
    """(n, r): x = n ln 2 + r, |r| <= ln2/2, n an int32 (x clamped to where exp is 0 or inf)."""
    xc = binary("min", binary("max", x, c(-104.0)), c(89.0))
    nf = unary("round", mul(xc, c(1.4426950408889634)))
    n = cast(nf, I32)
    return n, add(sub(xc, mul(nf, c(LN2_HI))), mul(cast(n, F32), c(LN2_LO)))


def _expm1_r(r: KExpr) -> KExpr:
    return add(mul(horner(EXP_P, r), mul(r, r)), r)


def exp(x: KExpr) -> KExpr:
    n, r = _reduce(x)
    h = binary("div", n, i(2))  # 2^n in two halves, each a normal float
    p = mul(mul(add(_expm1_r(r), c(1.0)), pow2(h)), pow2(sub(n, h)))
    return select(isnan(x), x, p)


def _log_m(m: KExpr, e: KExpr) -> KExpr:
    """log(1 + m) + e ln 2 for m in [sqrt(1/2) - 1, sqrt(2) - 1]."""
    z = mul(m, m)
    t = add(mul(c(-0.5), z), mul(mul(horner(LOG_P, m), m), z))
    return add(mul(e, c(LN2_HI)), add(m, add(mul(e, c(-LN2_LO)), t)))


def log(x: KExpr) -> KExpr:
    sub_ = binary("lt", x, c(TINY))  # a denormal: scaled by 2^23 first
    b = bits(select(sub_, mul(x, c(8388608.0)), x))
    f = bitcast(binary("or", binary("and", b, i(0x007FFFFF)), i(0x3F000000)), F32)  # in [0.5, 1)
    small = binary("lt", f, c(0.70710678))
    e = sub(binary("and", binary("shift_right_logical", b, i(23)), i(0xFF)), i(126))
    e = sub(sub(e, select(small, i(1), i(0))), select(sub_, i(23), i(0)))
    r = _log_m(sub(select(small, add(f, f), f), c(1.0)), cast(e, F32))
    neg = binary("lt", x, c(0.0))
    return select(binary("eq", x, c(0.0)), c(-np.inf),
                  select(either(neg, unary("not", finite(x))), select(neg, c(np.nan), x), r))


def expm1(x: KExpr) -> KExpr:
    n, r = _reduce(x)  # 2^n expm1(r) + (2^n - 1)
    t = pow2(binary("min", n, i(127)))
    e = select(binary("gt", n, i(127)), exp(x), add(mul(_expm1_r(r), t), sub(t, c(1.0))))
    e = select(binary("lt", x, c(-20.0)), c(-1.0), e)
    return select(either(binary("lt", unary("abs", x), c(1e-30)), isnan(x)), x, e)  # (-0.0 stays)


def log1p(x: KExpr) -> KExpr:
    near = both(binary("gt", x, c(-0.2928932)), binary("lt", x, c(0.41421356)))  # no 1 + x - 1
    return select(binary("eq", x, c(0.0)), x, select(near, _log_m(x, c(0.0)), log(add(c(1.0), x))))


def tanh(x: KExpr) -> KExpr:
    ax = unary("abs", x)
    e = expm1(mul(c(-2.0), ax))
    t = select(binary("gt", ax, c(9.0)), c(1.0), binary("div", unary("neg", e), add(e, c(2.0))))
    return copysign(t, x)


def logistic(x: KExpr) -> KExpr:
    return binary("div", c(1.0), add(c(1.0), exp(unary("neg", x))))


def erf(x: KExpr) -> KExpr:
    ax = unary("abs", x)
    big = sub(c(1.0), exp(horner(ERF_LARGE, sub(binary("min", ax, c(3.95)), c(2.425)))))
    big = select(binary("ge", ax, c(3.95)), c(1.0), big)
    small = mul(x, horner(ERF_SMALL, mul(x, x)))
    return select(isnan(x), x, select(binary("lt", ax, c(0.9)), small, copysign(big, x)))


def _trunc(x):
    return select(binary("lt", x, c(0.0)), unary("ceil", x), unary("floor", x))


def pow_(x: KExpr, y: KExpr) -> KExpr:
    """C's pow: exp(y log|x|) (its relative error about 2^-24 |y log x|: no wider float here),
    with the sign of an odd integer power and C's answers at zeros, infinities and NaN."""
    ax = unary("abs", x)
    whole = binary("eq", _trunc(y), y)
    odd = both(both(whole, binary("lt", unary("abs", y), c(16777216.0))),
               binary("ne", _trunc(mul(y, c(0.5))), mul(y, c(0.5))))
    inf = c(np.inf)
    r = exp(mul(y, log(ax)))
    r = select(either(binary("eq", ax, c(0.0)), unary("not", finite(ax))),
               select(binary("eq", binary("eq", ax, c(0.0)), binary("lt", y, c(0.0))), inf, c(0.0)), r)
    r = select(odd, copysign(r, x), r)
    r = select(both(unary("not", finite(y)), unary("not", isnan(y))),
               select(binary("eq", ax, c(1.0)), c(1.0),
                      select(binary("eq", binary("lt", ax, c(1.0)), binary("lt", y, c(0.0))), inf, c(0.0))), r)
    r = select(both(both(binary("lt", x, c(0.0)), unary("not", whole)), finite(x)), c(np.nan), r)
    r = select(either(isnan(x), isnan(y)), add(x, y), r)
    return select(either(binary("eq", y, c(0.0)), binary("eq", x, c(1.0))), c(1.0), r)


RULES = {"exp": exp, "log": log, "expm1": expm1, "log1p": log1p, "tanh": tanh, "logistic": logistic,
         "erf": erf, "pow": pow_}


def expand_expr(root: KExpr, ops, memo: dict) -> KExpr:
    """root with the `ops` among RULES written out (memo: node -> its rewrite, shared per kernel)."""
    for n in root.toposort():
        if n in memo:
            continue
        src = tuple(memo[s] for s in n.src)
        if n.op in ops and n.op in RULES and np.dtype(n.dtype).kind == "f" and np.dtype(n.dtype).itemsize <= 4:
            out = RULES[n.op](*(cast(s, F32) for s in src))
            memo[n] = cast(out, n.dtype)
        else:
            memo[n] = n if src == n.src else KExpr(n.op, n.dtype, src, n.arg)
    return memo[root]


def expand(k: TileKernel, ops=EXPANDED) -> TileKernel:
    """The tile kernel with its `ops` (float32 and narrower) written out in arithmetic."""
    memo: dict = {}

    def ex(n):
        return expand_expr(n, ops, memo) if isinstance(n, KExpr) else n

    def stmt(s):
        if isinstance(s, Range):
            return dataclasses.replace(s, extent=ex(s.extent), body=tuple(map(stmt, s.body)))
        if isinstance(s, If):
            return dataclasses.replace(s, cond=ex(s.cond), body=tuple(map(stmt, s.body)))
        if isinstance(s, Store):
            return dataclasses.replace(s, offset=ex(s.offset), value=ex(s.value))
        return s
    return dataclasses.replace(k, body=tuple(map(stmt, k.body)))
