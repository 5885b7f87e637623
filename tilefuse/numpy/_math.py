"""Elementwise math of numpy's namespace composed from tilefuse's primitives: inverse
trigonometric and hyperbolic functions, rounding, sign and exponent manipulation, integer
arithmetic and bit counting, and the real-valued views of numpy's complex helpers.

arctan is Cephes' atan (a rational approximation on [0, tan(pi/8)] after range reduction,
float32 or float64 coefficients by dtype), so every backend computes it with the kernels it
already has. Branches are `where`s whose untaken side is fed a safe value, so gradients carry no
NaN from it; a sign is taken with a select rather than abs, so derivatives at 0 are the
function's (arctan'(0) = 1), not abs's subgradient 0."""

from __future__ import annotations

import builtins
import math

import numpy as np

import tilefuse.numpy as tnp
from tilefuse.ir import dtypes as _dt
from tilefuse.ir import primitives as P
from tilefuse.ir.errors import DTypeError, with_user_line
from tilefuse.tracer.core import bind1

__all__ = [
    "arctan",
    "arctan2",
    "arcsin",
    "arccos",
    "arcsinh",
    "arccosh",
    "arctanh",
    "atan",
    "atan2",
    "asin",
    "acos",
    "asinh",
    "acosh",
    "atanh",
    "trunc",
    "fix",
    "signbit",
    "copysign",
    "deg2rad",
    "radians",
    "rad2deg",
    "degrees",
    "fabs",
    "fmax",
    "fmin",
    "heaviside",
    "logaddexp2",
    "sinc",
    "modf",
    "frexp",
    "ldexp",
    "nextafter",
    "spacing",
    "i0",
    "gcd",
    "lcm",
    "divmod",
    "float_power",
    "pow",
    "left_shift",
    "right_shift",
    "bitwise_left_shift",
    "bitwise_right_shift",
    "bitwise_invert",
    "bitwise_count",
    "isneginf",
    "isposinf",
    "real",
    "imag",
    "conj",
    "conjugate",
    "angle",
    "iscomplex",
    "isreal",
    "iscomplexobj",
    "isrealobj",
    "unwrap",
    "euler_gamma",
]

euler_gamma = 0.5772156649015329


def _float(x):
    (x,) = tnp._promote(x, to_float=True)
    return x


def _c(x, v):
    """The constant v in x's dtype (a strong scalar, so float16 stays float16)."""
    return np.asarray(v, tnp._aval(x).dtype)


def _select_abs(x):
    """|x| whose derivative at 0 is +1 (a select, not abs's subgradient): for odd functions
    computed as sign * f(|x|)."""
    return tnp.where(x < 0, -x, x)


def _is64(x) -> bool:
    return tnp._aval(x).dtype == _dt.float64


# ---- inverse trigonometric ---------------------------------------------------------------------

# Cephes atan.c (double) and atanf.c (single): atan(t) = t + t z P(z)/Q(z), z = t², |t| <= tan(pi/8)
_ATAN_P = (
    -8.750608600031904122785e-1,
    -1.615753718733365076637e1,
    -7.500855792314704667340e1,
    -1.228866684490136173410e2,
    -6.485021904942025371773e1,
)
_ATAN_Q = (
    2.485846490142306297962e1,
    1.650270098316988542046e2,
    4.328810604912902668951e2,
    4.853903996359136964868e2,
    1.945506571482613964425e2,
)
_ATANF = (8.05374449538e-2, -1.38776856032e-1, 1.99777106478e-1, -3.33329491539e-1)


def _poly(z, coeffs):
    acc = None
    for c in coeffs:
        acc = _c(z, c) if acc is None else acc * z + c
    return acc


def _atan_unit(t):
    """atan(t) for t in [0, 1]: above tan(pi/8) through atan(t) = pi/4 + atan((t-1)/(t+1))."""
    big = t > 0.41421356237309504880
    u = tnp.where(big, (t - 1.0) / (t + 1.0), t)
    z = u * u
    if _is64(t):
        core = u + u * z * _poly(z, _ATAN_P) / _poly(z, (1.0,) + _ATAN_Q)
        return tnp.where(big, core + (math.pi / 4 + 0.5 * 6.123233995736765886130e-17), core)
    core = u + u * z * _poly(z, _ATANF)
    return tnp.where(big, core + math.pi / 4, core)


def arctan2(x1, x2):
    """The angle of (x2, x1) in [-pi, pi], with numpy's signed zeros and infinities."""
    y, x = tnp._broadcast_all(*tnp._promote(x1, x2, to_float=True), op="arctan2")
    ay, ax = _select_abs(y), _select_abs(x)
    swap = ay > ax
    num, den = tnp.where(swap, ax, ay), tnp.where(swap, ay, ax)
    both_inf = tnp.isinf(ax) & tnp.isinf(ay)
    safe_den = tnp.where((den == 0) | both_inf, tnp.ones_like(den), den)
    ratio = tnp.where(both_inf, tnp.ones_like(num), tnp.where(den == 0, tnp.zeros_like(num), num / safe_den))
    q = _atan_unit(ratio)
    q = tnp.where(swap, math.pi / 2 - q, q)
    q = tnp.where(signbit(x), math.pi - q, q)
    return tnp.where(signbit(y), -q, q)


def arctan(x):
    x = _float(x)
    return arctan2(x, tnp.ones_like(x))


def arcsin(x):
    x = _float(x)
    return arctan2(x, tnp.sqrt((1.0 - x) * (1.0 + x)))


def arccos(x):
    x = _float(x)
    return arctan2(tnp.sqrt((1.0 - x) * (1.0 + x)), x)


def _large(x):
    """Above it, sqrt(t² ± 1) is t to the dtype's precision (and t² may overflow)."""
    return 1e8 if _is64(x) else 1e4


def arcsinh(x):
    x = _float(x)
    t = _select_abs(x)
    big = t > _large(x)
    ts = tnp.where(big, tnp.ones_like(t), t)
    small = tnp.log1p(ts + ts * ts / (1.0 + tnp.sqrt(1.0 + ts * ts)))
    tl = tnp.where(big, t, tnp.ones_like(t))
    r = tnp.where(big, tnp.log(tl) + math.log(2.0), small)
    return tnp.where(x < 0, -r, r)


def arccosh(x):
    x = _float(x)
    big = x > _large(x)
    xs = tnp.where(big, tnp.ones_like(x), x) - 1.0
    small = tnp.log1p(xs + tnp.sqrt(xs * (xs + 2.0)))
    xl = tnp.where(big, x, tnp.ones_like(x))
    return tnp.where(big, tnp.log(xl) + math.log(2.0), small)


def arctanh(x):
    x = _float(x)
    return 0.5 * tnp.log1p(2.0 * x / (1.0 - x))


atan, atan2, asin, acos, asinh, acosh, atanh = arctan, arctan2, arcsin, arccos, arcsinh, arccosh, arctanh


# ---- rounding and signs --------------------------------------------------------------------------


def trunc(x):
    x = tnp._operand(x)
    if not _dt.is_float(tnp._aval(x).dtype):
        return x
    return tnp.where(x < 0, tnp.ceil(x), tnp.floor(x))


fix = trunc


def signbit(x):
    """Whether the sign bit is set: x < 0, and -0.0 (told from +0.0 by 1/x); NaN counts as
    positive (its sign bit is not readable without a bit cast)."""
    x = tnp._operand(x)
    d = tnp._aval(x).dtype
    if _dt.is_bool(d):
        return tnp.zeros_like(x, dtype=tnp.bool_)
    if not _dt.is_float(d):
        return x < 0
    zero = x == 0
    inv = 1.0 / tnp.where(zero, x, tnp.ones_like(x))
    return (x < 0) | (zero & (inv < 0))


def copysign(x1, x2):
    x1, x2 = tnp._broadcast_all(*tnp._promote(x1, x2, to_float=True), op="copysign")
    a = tnp.abs(x1)
    return tnp.where(signbit(x2), -a, a)


def deg2rad(x):
    return _float(x) * (math.pi / 180)


def rad2deg(x):
    return _float(x) * (180 / math.pi)


radians, degrees = deg2rad, rad2deg


def fabs(x):
    return tnp.abs(_float(x))


def fmax(x1, x2):
    """maximum that ignores NaN (numpy.fmax)."""
    x1, x2 = tnp._broadcast_all(*tnp._promote(x1, x2), op="fmax")
    return tnp.where(tnp.isnan(x2), x1, tnp.where(tnp.isnan(x1), x2, tnp.maximum(x1, x2)))


def fmin(x1, x2):
    x1, x2 = tnp._broadcast_all(*tnp._promote(x1, x2), op="fmin")
    return tnp.where(tnp.isnan(x2), x1, tnp.where(tnp.isnan(x1), x2, tnp.minimum(x1, x2)))


def heaviside(x1, x2):
    x1, x2 = tnp._broadcast_all(*tnp._promote(x1, x2, to_float=True), op="heaviside")
    step = tnp.where(x1 < 0, tnp.zeros_like(x1), tnp.where(x1 > 0, tnp.ones_like(x1), x2))
    return tnp.where(tnp.isnan(x1), x1, step)


def logaddexp2(x1, x2):
    x1, x2 = tnp._promote(x1, x2, to_float=True)
    ln2 = math.log(2.0)
    return tnp.logaddexp(x1 * ln2, x2 * ln2) * (1 / ln2)


def sinc(x):
    """sin(pi x)/(pi x), 1 at 0 (where its derivative is 0, as JAX's)."""
    x = _float(x)
    zero = x == 0
    px = math.pi * tnp.where(zero, tnp.ones_like(x), x)
    return tnp.where(zero, tnp.ones_like(x), tnp.sin(px) / px)


def modf(x):
    """(fractional part, integral part), both with x's sign (numpy's; modf(±inf) = (±0, ±inf))."""
    x = _float(x)
    i = trunc(x)
    frac = tnp.where(tnp.isinf(x), copysign(tnp.zeros_like(x), x), x - i)
    return frac, i


def _exact_pow2(x, k):
    """x * 2**k for integer k, by exact power-of-two factors: one per low bit of |k| (up to the
    largest finite 2**(2**i)), then that largest factor repeated for the high part."""
    top = 9 if _is64(x) else 6  # 2**512 and 2**64: the largest 2**(2**i) the dtype holds
    neg = k < 0
    m = tnp.where(neg, -k, k)
    for i in range(top):
        on = tnp.bitwise_and(m, 1 << i) != 0
        x = tnp.where(on, x * tnp.where(neg, _c(x, 2.0 ** -(1 << i)), _c(x, 2.0 ** (1 << i))), x)
    high = right_shift(m, top)
    step = tnp.where(neg, _c(x, 2.0 ** -(1 << top)), _c(x, 2.0 ** (1 << top)))
    for j in range(5 if _is64(x) else 6):  # |k| < 2**(top) * 5 covers every finite result
        x = tnp.where(high > j, x * step, x)
    return x


def ldexp(x1, x2):
    x1 = _float(x1)
    x2 = tnp.asarray(x2) if not isinstance(x2, (tnp.Tracer, tnp.Array)) else x2
    if np.dtype(tnp._aval(x2).dtype).kind not in "iu":
        raise DTypeError(with_user_line(f"ldexp: the exponent must be an integer, got {tnp._aval(x2).dtype}"))
    x1, x2 = tnp._broadcast_all(x1, tnp.astype(x2, tnp.int32), op="ldexp")
    return _exact_pow2(x1, x2)


def frexp(x):
    """(mantissa in [0.5, 1) with x's sign, int32 exponent) with x = mantissa * 2**exponent;
    (x, 0) for 0, inf and NaN."""
    x = _float(x)
    a = tnp.abs(x)
    special = (a == 0) | ~tnp.isfinite(x)
    safe = tnp.where(special, tnp.ones_like(a), a)
    e = tnp.astype(tnp.floor(tnp.log2(safe)), tnp.int32) + 1
    m = _exact_pow2(safe, -e)
    # log2 rounds near powers of two: put the mantissa in [0.5, 1) exactly
    hi = m >= 1
    m, e = tnp.where(hi, m * 0.5, m), tnp.where(hi, e + 1, e)
    lo = m < 0.5
    m, e = tnp.where(lo, m * 2.0, m), tnp.where(lo, e - 1, e)
    m = tnp.where(x < 0, -m, m)
    return tnp.where(special, x, m), tnp.where(special, tnp.zeros_like(e), e)


def _ulp(x):
    """The gap above |x| in x's dtype (the smallest subnormal at 0)."""
    fi = _dt.finfo(tnp._aval(x).dtype)
    _, e = frexp(x)
    p = fi.nmant + 1
    smallest = float(fi.smallest_subnormal)
    return tnp.maximum(ldexp(tnp.ones_like(x), e - p), smallest)


def nextafter(x1, x2):
    """The next representable value after x1 toward x2."""
    x1, x2 = tnp._broadcast_all(*tnp._promote(x1, x2, to_float=True), op="nextafter")
    fi = _dt.finfo(tnp._aval(x1).dtype)
    up = x2 > x1
    away = up == (x1 >= 0)  # moving away from zero
    ulp = _ulp(x1)
    m, _ = frexp(x1)
    # toward zero from a power of two the gap below is half the gap above
    ulp = tnp.where(~away & (tnp.abs(m) == 0.5) & (tnp.abs(x1) > float(fi.smallest_normal)), ulp * 0.5, ulp)
    step = tnp.where(up, ulp, -ulp)
    out = tnp.where(
        x1 == 0, tnp.where(up, _c(x1, fi.smallest_subnormal), -_c(x1, fi.smallest_subnormal)), x1 + step
    )
    out = tnp.where(x1 == x2, x2, out)
    return tnp.where(tnp.isnan(x1) | tnp.isnan(x2), x1 + x2, out)


def spacing(x):
    """The distance to the next value away from zero, with x's sign (numpy.spacing)."""
    x = _float(x)
    away = tnp.where(x < 0, -tnp.inf, tnp.inf)  # -0.0 looks up, as numpy
    out = nextafter(x, away) - x
    return tnp.where(tnp.isinf(x), tnp.full_like(x, np.nan), out)


def i0(x):
    """The modified Bessel function of the first kind, order 0: its power series below 15, its
    asymptotic series above."""
    x = _float(x)
    a = tnp.abs(x)
    small = a <= (30.0 if _is64(x) else 15.0)
    s = tnp.where(small, a, tnp.zeros_like(a))
    q = (s * 0.5) ** 2
    term, total = tnp.ones_like(s), tnp.ones_like(s)
    for k in range(1, 60 if _is64(x) else 40):
        term = term * q / float(k * k)
        total = total + term
    big = tnp.where(small, tnp.full_like(a, 31.0), a)
    inv8 = 1.0 / (8.0 * big)
    series, t = tnp.ones_like(big), tnp.ones_like(big)
    for k in range(1, 12):
        t = t * float((2 * k - 1) ** 2) * inv8 / float(k)
        series = series + t
    asym = tnp.exp(big) / tnp.sqrt(2 * math.pi * big) * series
    return tnp.where(small, total, asym)


# ---- integers ----------------------------------------------------------------------------------


def _ints(name, *xs):
    xs = tnp._broadcast_all(*tnp._promote(*xs), op=name)
    d = tnp._aval(xs[0]).dtype
    if not (_dt.is_int(d) or _dt.is_bool(d)):
        raise DTypeError(with_user_line(f"{name}: needs integer operands, got {d}"))
    return xs


def gcd(x1, x2):
    """Greatest common divisor by Euclid's algorithm, run to the dtype's worst case (the steps of
    consecutive Fibonacci numbers) as one loop (lax.fori_loop: one kernel that holds the loop), not
    unrolled: 94 unrolled remainders took PoCL minutes to compile."""
    from tilefuse import lax  # (tilefuse.lax imports this package)
    a, b = _ints("gcd", x1, x2)
    steps = 47 if np.dtype(tnp._aval(a).dtype).itemsize <= 4 else 93

    def euclid_step(_, ab):
        a, b = ab
        zero = b == 0
        return tnp.where(zero, a, b), tnp.where(zero, b, tnp.remainder(a, tnp.where(zero, tnp.ones_like(b), b)))
    return lax.fori_loop(0, steps, euclid_step, (tnp.abs(a), tnp.abs(b)))[0]


def lcm(x1, x2):
    a, b = _ints("lcm", x1, x2)
    a, b = tnp.abs(a), tnp.abs(b)
    g = gcd(a, b)  # |a| (|b| / g): where it overflows, it wraps as numpy's and JAX's
    return tnp.where(g == 0, tnp.zeros_like(g), a * (b // tnp.where(g == 0, tnp.ones_like(g), g)))


def divmod(x1, x2):  # noqa: A001 (numpy's name)
    return tnp.floor_divide(x1, x2), tnp.remainder(x1, x2)


def float_power(x1, x2):
    """x1 ** x2 computed in float64, given in the operands' float type (float32 for float32 and
    ints, as jax.numpy.float_power without x64)."""
    x1, x2 = tnp._promote(x1, x2, to_float=True)
    out = tnp.power(tnp.astype(x1, tnp.float64), tnp.astype(x2, tnp.float64))
    return tnp.astype(out, tnp._aval(x1).dtype)


pow = tnp.power  # noqa: A001


def _shift_operands(name, x1, x2):
    x, s = _ints(name, x1, x2)
    bits = np.dtype(tnp._aval(x).dtype).itemsize * 8
    out_of_range = (s < 0) | (s >= bits)
    return x, tnp.where(out_of_range, tnp.zeros_like(s), s), out_of_range


def left_shift(x1, x2):
    """x1 << x2; shifts past the width give 0 (numpy's and JAX's rule)."""
    x, s, out = _shift_operands("left_shift", x1, x2)
    return tnp.where(out, tnp.zeros_like(x), bind1(P.shift_left, x, s))


def right_shift(x1, x2):
    """Arithmetic shift for signed integers (the sign fills in); past the width: 0 or -1."""
    x, s, out = _shift_operands("right_shift", x1, x2)
    logical = bind1(P.shift_right_logical, x, s)
    d = np.dtype(tnp._aval(x).dtype)
    if d.kind == "u":
        return tnp.where(out, tnp.zeros_like(x), logical)
    neg = x < 0
    filled = tnp.invert(bind1(P.shift_right_logical, tnp.invert(x), s))
    return tnp.where(
        out, tnp.where(neg, -tnp.ones_like(x), tnp.zeros_like(x)), tnp.where(neg, filled, logical)
    )


bitwise_left_shift, bitwise_right_shift, bitwise_invert = left_shift, right_shift, tnp.invert


def bitwise_count(x):
    """The number of 1 bits of |x| (numpy's and JAX's), as uint8 in numpy; int32 here."""
    x = tnp._operand(x)
    d = np.dtype(tnp._aval(x).dtype)
    if d.kind not in "iub":
        raise DTypeError(with_user_line(f"bitwise_count: needs integers, got {d}"))
    if d == np.bool_:
        return tnp.astype(x, tnp.int32)
    v = tnp.abs(x) if d.kind == "i" else x
    count = tnp.zeros(tnp.shape(x), tnp.int32)
    for i in range(d.itemsize * 8):
        bit = tnp.bitwise_and(bind1(P.shift_right_logical, v, np.full(tnp.shape(v), i, d)), np.asarray(1, d))
        count = count + tnp.astype(bit, tnp.int32)
    return count


# ---- infinities and numpy's complex helpers on real arrays ---------------------------------------


def isneginf(x):
    return (
        tnp.equal(x, -np.inf)
        if _dt.is_float(tnp._aval(tnp._operand(x)).dtype)
        else tnp.zeros_like(x, dtype=tnp.bool_)
    )


def isposinf(x):
    return (
        tnp.equal(x, np.inf)
        if _dt.is_float(tnp._aval(tnp._operand(x)).dtype)
        else tnp.zeros_like(x, dtype=tnp.bool_)
    )


def real(x):
    return tnp._operand(x)


def imag(x):
    return tnp.zeros_like(x)


def conj(x):
    return tnp._operand(x)


conjugate = conj


def angle(z, deg: bool = False):
    z = _float(z)
    a = arctan2(tnp.zeros_like(z), z)
    return a * (180 / math.pi) if deg else a


def iscomplex(x):
    return tnp.zeros_like(x, dtype=tnp.bool_)


def isreal(x):
    return tnp.ones_like(x, dtype=tnp.bool_)


def iscomplexobj(x) -> bool:
    return False


def isrealobj(x) -> bool:
    return True


def unwrap(p, discont=None, axis: int = -1, period: float = 2 * math.pi):
    """Unwrap by taking the complement of jumps larger than discont (default period/2)."""
    p = _float(p)
    axis = tnp._norm_axis(axis, tnp.ndim(p))
    if discont is None:
        discont = period / 2
    dd = tnp.diff(p, axis=axis)
    half = period / 2
    ddmod = tnp.remainder(dd + half, period) - half
    ddmod = tnp.where((ddmod == -half) & (dd > 0), tnp.full_like(ddmod, half), ddmod)
    correct = tnp.where(tnp.abs(dd) < discont, tnp.zeros_like(dd), ddmod - dd)
    csum = tnp.cumsum(correct, axis=axis)
    first = tnp._slice_axis(p, axis, 0, builtins.min(1, tnp.shape(p)[axis]))
    rest = tnp._slice_axis(p, axis, 1, tnp.shape(p)[axis]) + csum if tnp.shape(p)[axis] > 1 else None
    if rest is None:
        return p
    return tnp.concatenate([first, rest], axis=axis)
