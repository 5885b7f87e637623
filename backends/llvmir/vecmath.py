"""Vectorisable float32 math written in LLVM IR: exp, log, log1p, expm1, tanh, logistic, erf,
sin, cos and pow as branch-free polynomials (no libm calls), so LLVM's loop vectoriser turns a
loop over them into SIMD code. float64 calls libm (scalar; float64 is rare in our kernels).

Every function takes an `Emit` (an IRBuilder wrapper) and a float value, scalar or vector, and
returns the result; special values follow C99/numpy: NaN propagates, ±inf map to the limits, -0.0
keeps its sign where the function is odd. Accuracy against float64 references is checked in
tests/backends/test_llvm_kernels.py (≤ 4 ulp on the whole float32 range tested)."""
from __future__ import annotations

import math

import llvmlite.ir as ir

from tilefuse.ir.kernel.mathlib import ERF_LARGE, ERF_SMALL

F32, F64, I32, I64 = ir.FloatType(), ir.DoubleType(), ir.IntType(32), ir.IntType(64)
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4  # Cody-Waite split of ln 2 (cephes)
LOG2E = 1.44269504088896341


def _lanes(ty):
    return ty.count if isinstance(ty, ir.VectorType) else 0


def _elem(ty):
    return ty.element if isinstance(ty, ir.VectorType) else ty


def _like(ty, elem):
    """`elem` with the vector shape of `ty`."""
    n = _lanes(ty)
    return ir.VectorType(elem, n) if n else elem


def _suffix(ty) -> str:
    e = _elem(ty)
    name = {"float": "f32", "double": "f64", "half": "f16", "i1": "i1", "i8": "i8", "i16": "i16",
            "i32": "i32", "i64": "i64"}[str(e)]
    n = _lanes(ty)
    return f"v{n}{name}" if n else name


class Emit:
    """A thin helper over IRBuilder: constants that splat over vectors, named intrinsics, Horner."""

    # the target scales by 2**n in one instruction (x86's AVX-512 vscalef), which llvm.ldexp
    # becomes; elsewhere ldexp is a libm call per lane, and scale2 builds the exponent bits
    # (set by the printer: backends/llvmir/tile.print_tile)
    scalef = False

    def __init__(self, builder: ir.IRBuilder):
        self.b = builder

    @property
    def module(self):
        return self.b.module

    def c(self, ty, value):
        """A constant of type `ty` (splatted when `ty` is a vector)."""
        e = _elem(ty)
        if isinstance(e, ir.IntType):
            value = int(value) & ((1 << e.width) - 1)
        k = ir.Constant(e, value)
        n = _lanes(ty)
        return ir.Constant(ty, [k] * n) if n else k

    def intrinsic(self, name: str, ret, args, overload=None):
        """Call llvm.<name>.<suffix of `overload` (default: ret; a tuple of types: their suffixes)> on
        args."""
        types = overload if isinstance(overload, tuple) else (ret if overload is None else overload,)
        full = f"llvm.{name}." + ".".join(_suffix(t) for t in types)
        fn = self.module.globals.get(full)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(ret, [a.type for a in args]), name=full)
        return self.b.call(fn, args)

    def libm(self, name: str, *args):
        """A scalar C library call (double), resolved in the process when the code is loaded."""
        fn = self.module.globals.get(name)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(F64, [F64] * len(args)), name=name)
        return self.b.call(fn, list(args))

    # float helpers
    def fma(self, a, b, c):
        return self.intrinsic("fma", a.type, [a, b, c])

    def fabs(self, x):
        return self.intrinsic("fabs", x.type, [x])

    def rint(self, x):
        return self.intrinsic("roundeven", x.type, [x])

    def floor(self, x):
        return self.intrinsic("floor", x.type, [x])

    def copysign(self, mag, sign):
        return self.intrinsic("copysign", mag.type, [mag, sign])

    def fmax(self, a, b):  # NaN-quiet: only for clamping values known not to be NaN
        return self.intrinsic("maxnum", a.type, [a, b])

    def fmin(self, a, b):
        return self.intrinsic("minnum", a.type, [a, b])

    def clamp_nan_through(self, x, lo: float, hi: float):
        """x within [lo, hi], NaN left as it is: ordered compares and selects, one max and one
        min instruction on x86 (maxnum and minnum, which return the number, cost three each)."""
        x = self.sel(self.lt(x, self.c(x.type, lo)), self.c(x.type, lo), x)
        return self.sel(self.gt(x, self.c(x.type, hi)), self.c(x.type, hi), x)

    def poly(self, x, coeffs):
        """Horner with FMA; coeffs from the highest degree down."""
        r = self.c(x.type, coeffs[0])
        for k in coeffs[1:]:
            r = self.fma(r, x, self.c(x.type, k))
        return r

    def isnan(self, x):
        return self.b.fcmp_unordered("uno", x, x)

    def lt(self, a, b):
        return self.b.fcmp_ordered("<", a, b)

    def gt(self, a, b):
        return self.b.fcmp_ordered(">", a, b)

    def eq(self, a, b):
        return self.b.fcmp_ordered("==", a, b)

    def sel(self, c, a, b):
        return self.b.select(c, a, b)

    def pow2i(self, n, ty):
        """2**n for an integer-valued float n in [-126, 127] (float) or [-1022, 1023] (double)."""
        e = _elem(ty)
        ity, shift, bias = (I32, 23, 127) if e == F32 else (I64, 52, 1023)
        ni = self.b.fptosi(n, _like(ty, ity))
        bits = self.b.shl(self.b.add(ni, self.c(ni.type, bias)), self.c(ni.type, shift))
        return self.b.bitcast(bits, ty)

    def scale2(self, y, n):
        """y * 2**n for integer-valued float n in [-150, 128], rounded once (a denormal result
        too): ldexp where the target has it in one instruction, else in two exact steps so that
        neither factor overflows."""
        if self.scalef and _elem(y.type) == F32:
            ni = self.b.fptosi(n, _like(y.type, I32))
            return self.intrinsic("ldexp", y.type, [y, ni], (y.type, ni.type))
        half = self.floor(self.b.fmul(n, self.c(n.type, 0.5)))
        return self.b.fmul(self.b.fmul(y, self.pow2i(half, y.type)),
                           self.pow2i(self.b.fsub(n, half), y.type))


# ---- float32 kernels -----------------------------------------------------------------------

EXP_P = (1.9875691500E-4, 1.3981999507E-3, 8.3334519073E-3, 4.1665795894E-2, 1.6666665459E-1,
         5.0000001201E-1)  # cephes expf: e**r = 1 + r + r²·P(r), |r| ≤ ln2/2


def _exp_reduce(em: Emit, x):
    """n = round(x / ln2), r = x - n·ln2 (Cody-Waite), for x already clamped."""
    b = em.b
    n = em.rint(b.fmul(x, em.c(x.type, LOG2E)))
    r = em.fma(n, em.c(x.type, -LN2_HI), x)
    r = em.fma(n, em.c(x.type, -LN2_LO), r)
    return n, r


def _exp_poly(em: Emit, r):
    """e**r - 1 for |r| ≤ ln2/2."""
    b = em.b
    return em.fma(b.fmul(r, r), em.poly(r, EXP_P), r)


def exp(em: Emit, x):
    b = em.b
    xc = em.clamp_nan_through(x, -104.0, 89.0)  # (a NaN lane's result is x, selected below)
    n, r = _exp_reduce(em, xc)
    y = b.fadd(_exp_poly(em, r), em.c(x.type, 1.0))
    return em.sel(em.isnan(x), x, em.scale2(y, n))


EXP_CORE_LO, EXP_CORE_HI = -86.5, 88.3  # 2**n·y stays a normal float: n in [-125, 127]


def exp_core(em: Emit, x):
    """e**x for x known to lie in [EXP_CORE_LO, EXP_CORE_HI] (no NaN): the scale 2**n goes
    straight into the exponent bits, the cheap form for tanh, logistic and erf."""
    b = em.b
    n, r = _exp_reduce(em, x)
    y = b.fadd(_exp_poly(em, r), em.c(x.type, 1.0))
    ity = _like(x.type, I32)
    bits = b.add(b.bitcast(y, ity), b.shl(b.fptosi(n, ity), em.c(ity, 23)))
    return b.bitcast(bits, x.type)


def _clamp(em: Emit, x, lo, hi):
    return em.fmin(em.fmax(x, em.c(x.type, lo)), em.c(x.type, hi))


LOG_P = (7.0376836292E-2, -1.1514610310E-1, 1.1676998740E-1, -1.2420140846E-1, 1.4249322787E-1,
         -1.6668057665E-1, 2.0000714765E-1, -2.4999993993E-1, 3.3333331174E-1)  # cephes logf


def _log_parts(em: Emit, x):
    """x > 0 finite → (e, f) with x = 2**e · (1 + f), f in [sqrt(.5) - 1, sqrt(2) - 1)."""
    b = em.b
    ity = _like(x.type, I32)
    tiny = em.lt(x, em.c(x.type, 1.17549435e-38))  # denormals: scale up by 2**23 first
    xs = em.sel(tiny, b.fmul(x, em.c(x.type, 8388608.0)), x)
    bits = b.bitcast(xs, ity)
    # move the mantissa into [sqrt(.5), sqrt(2)): bias the exponent field by the bits of sqrt(.5)
    bits = b.add(bits, em.c(ity, 0x3F800000 - 0x3F3504F3))
    e = b.sub(b.lshr(bits, em.c(ity, 23)), em.c(ity, 127))
    mbits = b.add(b.and_(bits, em.c(ity, 0x007FFFFF)), em.c(ity, 0x3F3504F3))
    f = b.fsub(b.bitcast(mbits, x.type), em.c(x.type, 1.0))
    ef = b.sitofp(e, x.type)
    ef = em.sel(tiny, b.fsub(ef, em.c(x.type, 23.0)), ef)
    return ef, f


def _log_core(em: Emit, ef, f):
    b = em.b
    z = b.fmul(f, f)
    y = b.fmul(b.fmul(em.poly(f, LOG_P), f), z)
    y = em.fma(ef, em.c(f.type, LN2_LO), y)
    y = em.fma(z, em.c(f.type, -0.5), y)
    return em.fma(ef, em.c(f.type, LN2_HI), b.fadd(f, y))


def _log_special(em: Emit, x, r):
    """NaN for x < 0 or NaN, -inf at ±0, inf at inf."""
    ty = x.type
    r = em.sel(em.eq(x, em.c(ty, math.inf)), x, r)
    r = em.sel(em.eq(x, em.c(ty, 0.0)), em.c(ty, -math.inf), r)
    return em.sel(em.b.fcmp_unordered("<", x, em.c(ty, 0.0)), em.c(ty, math.nan), r)


def log(em: Emit, x):
    ef, f = _log_parts(em, x)
    return _log_special(em, x, _log_core(em, ef, f))


def log1p(em: Emit, x):
    """log(u) + (x - (u - 1)) / u with u = 1 + x: the rounding of u corrected to first order."""
    b = em.b
    ty = x.type
    u = b.fadd(x, em.c(ty, 1.0))
    ef, f = _log_parts(em, u)
    r = _log_core(em, ef, f)
    corr = b.fdiv(b.fsub(x, b.fsub(u, em.c(ty, 1.0))), u)
    finite = em.lt(em.fabs(u), em.c(ty, math.inf))
    r = em.sel(b.and_(finite, em.gt(u, em.c(ty, 0.0))), b.fadd(r, corr), r)
    r = _log_special(em, u, r)
    return em.sel(em.eq(u, em.c(ty, 1.0)), x, r)  # |x| below half an ulp of 1 (and ±0): x


EXPM1_P = tuple(1.0 / math.factorial(k) for k in range(9, 2, -1))  # Taylor: r²/2 + r³·P(r)


def expm1(em: Emit, x):
    """2**n·(e**r - 1) + (2**n - 1); n = 0 gives e**r - 1 with no cancellation."""
    b = em.b
    ty = x.type
    xc = em.fmin(em.fmax(x, em.c(ty, -30.0)), em.c(ty, 89.0))
    n, r = _exp_reduce(em, xc)
    r2 = b.fmul(r, r)
    p = em.fma(r2, em.c(ty, 0.5), b.fmul(b.fmul(r2, r), em.poly(r, EXPM1_P)))
    p = b.fadd(p, r)
    small_n = em.fmin(n, em.c(ty, 29.0))
    t = em.pow2i(small_n, ty)
    small = em.fma(t, p, b.fsub(t, em.c(ty, 1.0)))
    big = em.scale2(b.fadd(p, em.c(ty, 1.0)), n)  # e**x: the -1 is below half an ulp
    res = em.sel(em.gt(n, em.c(ty, 29.0)), big, small)
    tiny = em.lt(em.fabs(x), em.c(ty, 2.0 ** -25))
    return em.sel(b.or_(tiny, em.isnan(x)), x, res)


TANH_P = (-5.70498872745E-3, 2.06390887954E-2, -5.37397155531E-2, 1.33314422036E-1,
          -3.33332819422E-1)  # cephes tanhf, |x| < 0.625: x + x³·P(x²)


def tanh(em: Emit, x):
    """Odd: computed on |x| and given the sign of x at the end (which also keeps -0.0)."""
    b = em.b
    ty = x.type
    ax = em.fabs(x)
    z = b.fmul(x, x)
    small = em.fma(b.fmul(ax, z), em.poly(z, TANH_P), ax)
    # (e - 1)/(e + 1) with e = e**(2|x|) ≥ 3.49: the rounding of e costs < 1 ulp; |x| ≥ 9 is ±1
    e = exp_core(em, b.fmul(em.fmin(ax, em.c(ty, 9.0)), em.c(ty, 2.0)))
    big = b.fdiv(b.fsub(e, em.c(ty, 1.0)), b.fadd(e, em.c(ty, 1.0)))
    r = em.copysign(em.sel(em.lt(ax, em.c(ty, 0.625)), small, big), x)
    return em.sel(em.isnan(x), x, r)


def logistic(em: Emit, x):
    """1/(1 + e**-x); below x = -88.3 (true value < 5e-39) it returns 0."""
    b = em.b
    ty = x.type
    t = exp_core(em, _clamp(em, b.fneg(x), EXP_CORE_LO, EXP_CORE_HI))
    r = b.fdiv(em.c(ty, 1.0), b.fadd(em.c(ty, 1.0), t))
    r = em.sel(em.lt(x, em.c(ty, -EXP_CORE_HI)), em.c(ty, 0.0), r)
    return em.sel(em.isnan(x), x, r)


# erf: |x| < 0.9: x·P(x²); 0.9 ≤ |x| < 3.95: 1 - exp(Q(|x| - 2.425)), Q ≈ log erfc; beyond: ±1
# (ir/kernel/mathlib.py; fitted toward minimax in float64).
def erf(em: Emit, x):
    b = em.b
    ty = x.type
    ax = em.fabs(x)
    small = b.fmul(x, em.poly(b.fmul(x, x), ERF_SMALL))
    t = b.fsub(em.fmin(ax, em.c(ty, 3.95)), em.c(ty, 2.425))
    big = b.fsub(em.c(ty, 1.0), exp_core(em, em.poly(t, ERF_LARGE)))  # log erfc in [-18.3, -1.6]
    big = em.sel(em.lt(ax, em.c(ty, 3.95)), big, em.c(ty, 1.0))
    big = em.copysign(big, x)
    return em.sel(em.lt(ax, em.c(ty, 0.9)), small, em.sel(em.isnan(x), x, big))


SIN_P = (-1.9515295891E-4, 8.3321608736E-3, -1.6666654611E-1)  # cephes sinf on [-pi/4, pi/4]
COS_P = (2.443315711809948E-5, -1.388731625493765E-3, 4.166664568298827E-2)  # cephes cosf
PIO2_HI = 1.5707963267948966  # pi/2 = HI + LO to ~107 bits; the FMA makes x - k·HI exact
PIO2_LO = 6.123233995736766e-17


def _sincos(em: Emit, x, cosine: bool):
    """Reduce in float64 (x - k·pi/2 with FMA and pi/2 to 107 bits: ≤ 2 ulp for |x| up to
    ~1e9, degrading beyond ~1e15), polynomials in float32, then pick sin/cos of the remainder
    and its sign from the quadrant k mod 4."""
    b = em.b
    ty = x.type
    dty = _like(ty, F64)
    xd = b.fpext(x, dty)
    k = em.rint(b.fmul(xd, em.c(dty, 2.0 / math.pi)))
    rd = em.fma(k, em.c(dty, -PIO2_HI), xd)
    rd = em.fma(k, em.c(dty, -PIO2_LO), rd)
    r = b.fptrunc(rd, ty)
    z = b.fmul(r, r)
    s = em.fma(b.fmul(r, z), em.poly(z, SIN_P), r)
    c = em.fma(b.fmul(z, z), em.poly(z, COS_P), em.fma(z, em.c(ty, -0.5), em.c(ty, 1.0)))
    if cosine:
        k = b.fadd(k, em.c(dty, 1.0))  # cos x = sin(x + pi/2)
    q = b.fsub(k, b.fmul(em.floor(b.fmul(k, em.c(dty, 0.25))), em.c(dty, 4.0)))  # k mod 4
    odd = b.or_(em.eq(q, em.c(dty, 1.0)), em.eq(q, em.c(dty, 3.0)))
    v = em.sel(odd, c, s)
    v = em.sel(b.fcmp_ordered(">=", q, em.c(dty, 2.0)), b.fneg(v), v)
    v = _clamp(em, v, -1.0, 1.0)  # past |x| ~ 1e15 the reduction is lost: stay in range
    v = em.sel(em.isnan(r), r, v)
    if cosine:
        return v
    return em.sel(em.lt(em.fabs(x), em.c(ty, 2.0 ** -12)), x, v)  # sin x = x there; keeps -0.0


def sin(em: Emit, x):
    return _sincos(em, x, False)


def cos(em: Emit, x):
    return _sincos(em, x, True)


# pow in float64 polynomials, rounded once to float32: log2 via atanh series, exp2 via Taylor.
LOG_ATANH = tuple(1.0 / k for k in range(17, 0, -2))  # log m = 2s·(1 + s²/3 + s⁴/5 + ...)
EXP2_TAYLOR = tuple(1.0 / math.factorial(k) for k in range(12, -1, -1))


def _log2_f64(em: Emit, x):
    """log2 of finite x > 0 (float64 vector/scalar), error ~1e-15."""
    b = em.b
    ty = x.type
    ity = _like(ty, I64)
    bits = b.add(b.bitcast(x, ity), em.c(ity, 0x3FF0000000000000 - 0x3FE6A09E667F3BCD))
    e = b.sitofp(b.sub(b.lshr(bits, em.c(ity, 52)), em.c(ity, 1023)), ty)
    mbits = b.add(b.and_(bits, em.c(ity, (1 << 52) - 1)), em.c(ity, 0x3FE6A09E667F3BCD))
    m = b.bitcast(mbits, ty)
    s = b.fdiv(b.fsub(m, em.c(ty, 1.0)), b.fadd(m, em.c(ty, 1.0)))
    lnm = b.fmul(b.fmul(s, em.c(ty, 2.0)), em.poly(b.fmul(s, s), LOG_ATANH))
    return em.fma(lnm, em.c(ty, LOG2E), e)


def _exp2_f64(em: Emit, t):
    """2**t for t in [-1100, 1100] (float64): overflow → inf, underflow → 0."""
    b = em.b
    ty = t.type
    tc = em.fmin(em.fmax(t, em.c(ty, -1100.0)), em.c(ty, 1100.0))
    n = em.rint(tc)
    u = b.fmul(b.fsub(tc, n), em.c(ty, math.log(2.0)))
    y = em.poly(u, EXP2_TAYLOR)
    # 2**n in two factors, each within the double exponent range
    h = em.floor(b.fmul(n, em.c(ty, 0.5)))
    return b.fmul(b.fmul(y, em.pow2i(em.fmax(em.fmin(h, em.c(ty, 1023.0)), em.c(ty, -1022.0)), ty)),
                  em.pow2i(em.fmax(em.fmin(b.fsub(n, h), em.c(ty, 1023.0)), em.c(ty, -1022.0)), ty))


def pow(em: Emit, x, y):
    """C99 pow for float32: the special cases of C (pow(x, ±0) = 1, pow(1, y) = 1, negative x
    with a non-integer y is NaN, odd integer y keeps the sign of x, ...)."""
    b = em.b
    ty = x.type
    dty = _like(ty, F64)
    xd, yd = b.fpext(x, dty), b.fpext(y, dty)
    ax = em.fabs(xd)
    fin = em.lt(ax, em.c(dty, math.inf))
    pos = em.gt(ax, em.c(dty, 0.0))
    l2 = _log2_f64(em, em.sel(b.and_(fin, pos), ax, em.c(dty, 1.0)))
    l2 = em.sel(fin, l2, em.c(dty, math.inf))
    l2 = em.sel(pos, l2, em.c(dty, -math.inf))
    prod = b.fmul(yd, l2)
    prod = em.sel(em.isnan(prod), em.c(dty, 0.0), prod)  # 0·inf: only at |x| = 1, fixed below
    r = b.fptrunc(_exp2_f64(em, prod), ty)
    is_int = em.eq(em.floor(yd), yd)
    half = b.fmul(yd, em.c(dty, 0.5))
    odd = b.and_(is_int, b.fcmp_ordered("!=", em.floor(half), half))
    neg = b.fcmp_ordered("<", x, em.c(ty, 0.0))
    signbit = b.icmp_signed("<", b.bitcast(x, _like(ty, I32)), em.c(_like(ty, I32), 0))
    r = em.sel(b.and_(odd, signbit), b.fneg(r), r)
    xfin = em.lt(em.fabs(x), em.c(ty, math.inf))
    r = em.sel(b.and_(b.and_(neg, xfin), b.not_(is_int)), em.c(ty, math.nan), r)
    r = em.sel(b.or_(em.isnan(x), em.isnan(y)), em.c(ty, math.nan), r)
    one = em.c(ty, 1.0)
    # |x| = 1: 1, or -1 for x = -1 and an odd y; ±inf counts as an even integer (C99)
    r = em.sel(b.and_(em.eq(x, em.c(ty, -1.0)), is_int), em.sel(odd, em.c(ty, -1.0), one), r)
    r = em.sel(em.eq(x, one), one, r)
    return em.sel(em.eq(y, em.c(ty, 0.0)), one, r)


FLOAT32 = {"exp": exp, "log": log, "log1p": log1p, "expm1": expm1, "tanh": tanh,
           "logistic": logistic, "erf": erf, "sin": sin, "cos": cos}
LIBM = {"exp": "exp", "log": "log", "log1p": "log1p", "expm1": "expm1", "tanh": "tanh",
        "erf": "erf", "sin": "sin", "cos": "cos"}


def _per_lane(em: Emit, f, *xs):
    """f over each lane of float64 vectors (libm is scalar)."""
    b, out = em.b, ir.Constant(xs[0].type, ir.Undefined)
    for i in range(xs[0].type.count):
        lane = ir.Constant(I32, i)
        out = b.insert_element(out, f(*(b.extract_element(x, lane) for x in xs)), lane)
    return out


def unary(em: Emit, op: str, x):
    """op(x) for a float32 scalar or vector, or float64 (libm, lane by lane)."""
    if _elem(x.type) == F32:
        return FLOAT32[op](em, x)
    if isinstance(x.type, ir.VectorType):
        return _per_lane(em, lambda v: unary(em, op, v), x)
    assert x.type == F64, x.type
    if op == "logistic":
        b = em.b
        return b.fdiv(em.c(F64, 1.0), b.fadd(em.c(F64, 1.0), em.libm("exp", b.fneg(x))))
    return em.libm(LIBM[op], x)


def binary_pow(em: Emit, x, y):
    if _elem(x.type) == F32:
        return pow(em, x, y)
    if isinstance(x.type, ir.VectorType):
        return _per_lane(em, lambda a, c: em.libm("pow", a, c), x, y)
    return em.libm("pow", x, y)
