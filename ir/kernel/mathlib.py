"""Polynomials of the float32 math library that backends print in their own language (the LLVM
backend's vecmath, WGSL's helpers): a target whose built-ins are loose (WGSL promises exp only to
3 + 2|x| ulp) computes these instead. Coefficients from the highest degree down."""
from __future__ import annotations

# erf: |x| < 0.9: x·P(x²); 0.9 ≤ |x| < 3.95: 1 - exp(Q(|x| - 2.425)), Q ≈ log erfc; beyond: ±1
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


def horner(coeffs, x: str, fma: str = "fma") -> str:
    """The polynomial as nested fma calls in a C-like language: fma(fma(c0, x, c1), x, c2)..."""
    r = repr(float(coeffs[0]))
    for c in coeffs[1:]:
        r = f"{fma}({r}, {x}, {float(c)!r})"
    return r
