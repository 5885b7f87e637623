"""Numerics every device shares with numpy (issue 19: 10-12): float sums whose rounding error
grows like log n, not n; integer overflow that wraps alike everywhere; 16-bit means computed in
float32. Each test runs on every device (the `device` fixture), `ref` included."""
from __future__ import annotations

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp

TENTH = float(np.float32(0.1))  # the float32 nearest 0.1, which every element holds


@pytest.mark.parametrize("n", [10**7, 10**8])
def test_sum_of_many_tenths(device, n):
    """numpy's pairwise sum of 1e7 tenths is 1e-7 off; summed in order in float32 it was 0.27%
    off on cpu and 0.6% on opencl. Blocked sums (ir/kernel/schedule.py: BLOCK) stay within 1e-5."""
    x = np.full(n, 0.1, np.float32)
    try:
        total = float(tx.jit(tnp.sum)(x))
    except tx.OutOfMemoryError as e:  # WebGPU binds at most 128 MiB per buffer on llvmpipe
        pytest.skip(f"{device}: {e}")
    assert abs(total / (n * TENTH) - 1) < 1e-5, total
    if n == 10**7:  # the mean, and a sum fused with a prologue and an epilogue
        assert abs(float(tx.jit(tnp.mean)(x)) / TENTH - 1) < 1e-5
        y = float(tx.jit(lambda a: tnp.sum(a * 2.0 + 1.0) / 3.0)(x))
        assert abs(y / (n * (2 * TENTH + 1) / 3) - 1) < 1e-5


# 16 and 32 columns: a vector of columns per work-item on 16-wide devices (it summed in order: 1e-5 off)
@pytest.mark.parametrize("shape,axis", [((3, 2_000_000), 1), ((2_000_000, 3), 0), ((250_000, 16), 0), ((125_000, 32), 0)])
def test_long_row_and_column_sums(device, shape, axis):
    x = np.full(shape, 0.1, np.float32)
    got = np.asarray(tx.jit(lambda a: tnp.sum(a, axis=axis))(x), np.float64)
    np.testing.assert_allclose(got, shape[axis] * TENTH, rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint64])
def test_integer_overflow_wraps(device, dtype):
    """(x + 1) > x at the largest integer is False in numpy (it wraps); OpenCL C left it
    undefined and PoCL said True. (WebGPU refuses uint64: a skip there.)"""
    info = np.iinfo(dtype)
    x = np.array([info.max, info.min, 5, -1 if info.min else info.max - 1], dtype)

    def f(a):
        return (a + 1) > a, a + 1, a * 3, -a, a - 2, tnp.sum(tnp.stack([a, a]), axis=0)
    got = [np.asarray(g) for g in tx.jit(f)(x)]
    want = [x + dtype(1) > x, x + dtype(1), x * dtype(3), -x, x - dtype(2), x + x]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_float16_mean_beyond_its_range(device):
    """The sum of [60000, 60000] overflows float16; the mean does not (jnp: float32 inside)."""
    x = np.array([60000, 60000], np.float16)
    m, v, s = tx.jit(lambda a: (tnp.mean(a), tnp.var(a), tnp.std(a)))(x)
    assert m.dtype == np.float16 and float(m) == 60000.0
    assert float(v) == 0.0 and float(s) == 0.0
    rows = np.full((3, 4), 40000, np.float16)
    np.testing.assert_array_equal(np.asarray(tnp.mean(tx.device_put(rows, device), axis=1)),
                                  np.full(3, 40000, np.float16))


def test_signed_zero_constants_stay_apart(device):
    """x / 0.0 and x / -0.0 in one program were one kernel constant (0.0 == -0.0 in Python), and
    x + 0.0 was simplified to x (wrong for x = -0.0). WGSL may ignore a zero's sign (its spec,
    floating-point accuracy): there only the infinities are checked."""
    x = np.array([3.0, -2.0, -0.0, 0.0], np.float32)
    got = tx.jit(lambda a: (a / 0.0, a / -0.0, a + 0.0, a + -0.0, a - 0.0, a - -0.0, 0.0 + a))(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = (x / np.float32(0.0), x / np.float32(-0.0), x + np.float32(0.0), x + np.float32(-0.0),
                x - np.float32(0.0), x - np.float32(-0.0), np.float32(0.0) + x)
    for i, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g)
        np.testing.assert_array_equal(g, w, err_msg=f"output {i}")
        if device.kind != "webgpu":
            np.testing.assert_array_equal(np.signbit(g), np.signbit(w), err_msg=f"output {i}'s zero signs")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_narrowing_keeps_every_nan(device, dtype):
    """A NaN whose payload fills the low bits rounded to bfloat16 carried into the sign: OpenCL
    stored -0.0 for the mean of an empty bfloat16 array (PoCL's NAN is 0x7fffffff)."""
    bits = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFFC00000, 0x7FC00000, 0xFF800000, 0x7F7FFFFF,
                     0x3F800000, 0x80000000], np.uint32)
    x = np.tile(bits.view(np.float32), 3)  # vector lanes and a scalar tail
    got = np.asarray(tx.jit(lambda a: a.astype(dtype))(x))
    with np.errstate(invalid="ignore", over="ignore"):
        want = x.astype(tnp.dtype(dtype))
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    empty = np.zeros((2, 0), tnp.dtype(dtype))
    assert np.isnan(np.asarray(tx.jit(tnp.mean)(empty), np.float32)).all()


U64 = np.uint64
U64_EDGE = np.array([0, 1, 2**63 + 5, 2**64 - 1], U64)


def _uint64_ops(a, b, s, f):
    """uint64 through arithmetic, comparisons, shifts, casts and reductions (numpy or tilefuse)."""
    m = tnp if not isinstance(a, np.ndarray) else np
    return dict(
        add=a + b, sub=a - b, mul=a * b, floordiv=a // b, mod=a % b, lt=a < b, le=a <= b, eq=a == b, gt=a > b,
        max=m.maximum(a, b), min=m.minimum(a, b), shr=a >> s, shr3=a >> U64(3), add1=a + 1, neg=-a,
        f32=a.astype(np.float32), f64=a.astype(np.float64), i64=a.astype(np.int64), u32=a.astype(np.uint32),
        # back: int64 and uint32 keep (or zero-extend) the bits; floats below 2**64 come back exact
        i64_back=a.astype(np.int64).astype(U64), u32_back=a.astype(np.uint32).astype(U64),
        i8_back=a.astype(np.int8).astype(U64), f64_back=f.astype(U64), f32_back=f.astype(np.float32).astype(U64),
        sum=m.sum(a), prod=m.prod(b), argmax=m.argmax(a), argmin=m.argmin(b), amax=m.max(a), amin=m.min(a),
        cumsum=m.cumsum(a))


def test_uint64_computes_unsigned(device):
    """uint64 keeps its dtype through jit and computes unsigned: 2**63 + 5 and 2**64 - 1 are large,
    never negative, in division, comparisons, max/min, right shifts, casts and reductions (bit for
    bit with numpy). WebGPU has no 64-bit ints: there it is a DTypeError."""
    a, b = U64_EDGE, np.array([3, 7, 2**63 + 7, 2], U64)
    s = np.array([0, 1, 63, 5], U64)
    f = np.array([0.0, 1.0, 2.0**63 + 2**12, 2.0**64 - 2**40], np.float64)  # exact in float32 too
    if device.kind == "webgpu":
        with pytest.raises(tx.DTypeError, match="uint64"):
            tx.jit(_uint64_ops)(a, b, s, f)
        pytest.skip("webgpu: no 64-bit integers (WGSL); uint64 is refused with a DTypeError")
    got = tx.jit(_uint64_ops)(a, b, s, f)
    with np.errstate(over="ignore"):
        want = _uint64_ops(a, b, s, f)
    want["argmax"], want["argmin"] = np.int32(want["argmax"]), np.int32(want["argmin"])  # JAX's index dtype
    for k, w in want.items():
        g = np.asarray(got[k])
        assert g.dtype == np.asarray(w).dtype, (k, g.dtype, np.asarray(w).dtype)
        np.testing.assert_array_equal(g, w, err_msg=k)
    # division by zero: x // 0 is 0 (numpy's); x % 0 is x (JAX's lax.rem, as for every int dtype here)
    q, r = tx.jit(lambda x, y: (x // y, x % y))(a, np.zeros(4, U64))
    np.testing.assert_array_equal(np.asarray(q), np.zeros(4, U64))
    np.testing.assert_array_equal(np.asarray(r), a)
    # a scatter-add (atomics where the device has them) wraps too
    idx = np.array([0, 2, 2, 3], np.int32)
    got = tx.jit(lambda x: tnp.zeros(4, U64).at[idx].add(x))(a)
    want = np.zeros(4, U64)
    np.add.at(want, idx, a)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_uint64_scalars_keep_their_dtype(device):
    """A uint64 from Python stays uint64 (it became int64: 2**63 turned negative); a weak Python int
    takes uint64 as it takes uint8 (uint8 200 * 2 is 144, uint8)."""
    if device.kind == "webgpu":
        pytest.skip("webgpu: no 64-bit integers (WGSL); uint64 is refused with a DTypeError")
    big = tx.jit(lambda x: x + 1)(np.uint64(2**64 - 2))
    assert big.dtype == U64 and int(big) == 2**64 - 1
    assert tnp.uint64(2**64 - 1).dtype == U64 and int(tnp.uint64(2**64 - 1)) == 2**64 - 1
    x = tnp.asarray(np.array([2**63 + 5], U64))
    assert int(tnp.asarray(np.uint64(2**63 + 5))) == 2**63 + 5
    for y in (x * 2, x & 0xFFFFFFFFFFFF, x >> 1, tnp.where(x > 0, x, 2**63)):
        assert y.dtype == U64
    np.testing.assert_array_equal(np.asarray(tx.jit(lambda v: v & 0xFFFFFFFFFFFF)(x)), [(2**63 + 5) & 0xFFFFFFFFFFFF])
    np.testing.assert_array_equal(np.asarray(tnp.arange(2**63, 2**63 + 3, dtype=tnp.uint64)),
                                  np.arange(2**63, 2**63 + 3, dtype=U64))
    assert tnp.iinfo(tnp.uint64).max == 2**64 - 1 and tnp.full(2, 2**64 - 1, tnp.uint64).dtype == U64
    # (numpy alone makes [2**64 - 1, 0] float64, and 2**64 - 1 became 0)
    np.testing.assert_array_equal(np.asarray(tnp.asarray([2**64 - 1, 0], tnp.uint64)), np.array([2**64 - 1, 0], U64))
    small = tx.jit(lambda v: v * 2)(np.array([200], np.uint8))
    assert small.dtype == np.uint8 and int(small[0]) == 144
    assert (x + np.int64(1)).dtype == np.float64  # uint64 with a signed int: JAX's float64


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tanh_saturates_to_exactly_one(device, dtype):
    """Past |x| = 9.01 (19.06 in float64) tanh rounds to +-1. PoCL's tanh gave 1 - 1 ulp there,
    which the tanh-gelu's derivative, 0.5 (1 + tanh) + 0.5 x (1 - tanh^2) j', turned into
    errors of 1e-5 (x j' ~ 200): the gradient at x = -12 must be exactly 0, at 12 exactly 1."""
    from tilefuse import nn
    x = np.array([-1e30, -70.0, -30.0, -12.0, 12.0, 30.0, 70.0, 1e30, 0.5, -0.0], dtype)
    got = np.asarray(tx.jit(tnp.tanh)(x))
    want = np.tanh(x.astype(np.float64)).astype(dtype)
    np.testing.assert_array_equal(got[:8], want[:8])
    np.testing.assert_allclose(got[8:], want[8:], rtol=4 * np.finfo(dtype).eps)
    assert np.signbit(got[-1])
    z = np.array([-12.0, 12.0], dtype)
    grad = np.asarray(tx.jit(tx.grad(lambda t: nn.gelu(t).sum()))(z))
    np.testing.assert_array_equal(grad, np.array([0.0, 1.0], dtype))
