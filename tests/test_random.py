"""tilefuse.random: Threefry known answers, keys, distributions, and the same bits everywhere."""
from __future__ import annotations

import math

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
import tilefuse.random as random
from tilefuse.ir.errors import TilefuseError


# ---- an independent numpy reference of Threefry-2x32 and the counter scheme --------------------

def np_threefry(k0, k1, x0, x1):
    m = np.uint32(0xFFFFFFFF)
    k0, k1 = np.uint32(k0), np.uint32(k1)
    x0, x1 = np.array(x0, np.uint32), np.array(x1, np.uint32)
    ks = [k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA)]
    rot = [(13, 15, 26, 6), (17, 29, 16, 24)]

    def rotl(v, r):
        return ((v << np.uint32(r)) | (v >> np.uint32(32 - r))) & m

    with np.errstate(over="ignore"):
        x0, x1 = x0 + ks[0], x1 + ks[1]
        for i in range(5):
            for r in rot[i % 2]:
                x0 = x0 + x1
                x1 = rotl(x1, r) ^ x0
            x0 = x0 + ks[(i + 1) % 3]
            x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def np_bits(key, n):
    w0, w1 = np_threefry(key[0], key[1], np.zeros(n, np.uint32), np.arange(n, dtype=np.uint32))
    return w0 ^ w1


# Random123's known-answer vectors for threefry2x32_20: (key, counter) -> output
KAT = [((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6b200159, 0x99ba4efe)),
       ((0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff), (0x1cb996fc, 0xbb002be7)),
       ((0x13198a2e, 0x03707344), (0x243f6a88, 0x85a308d3), (0xc4923a9c, 0x483df7a0))]


@pytest.mark.parametrize("key,ctr,want", KAT)
def test_threefry_known_answers(key, ctr, want):
    x0, x1 = (np.array([c], np.uint32) for c in ctr)
    k0, k1 = (np.uint32(k) for k in key)
    got = [int(np.asarray(w)[0]) for w in random.threefry_2x32(k0, k1, x0, x1)]
    assert got == list(want)
    jitted = tx.jit(lambda a, b, c, d: random.threefry_2x32(a, b, c, d))
    got = [int(np.asarray(w)[0]) for w in jitted(np.array(k0), np.array(k1), x0, x1)]
    assert got == list(want)
    assert [int(w[0]) for w in np_threefry(*key, *x0, x1)] == list(want)  # the reference agrees


def test_bits_on_every_device_match_the_reference(device):
    k = random.key(1234)
    got = np.asarray(tx.jit(lambda k: random.bits(k, (7, 9)))(k))
    np.testing.assert_array_equal(got, np_bits([0, 1234], 63).reshape(7, 9))
    u = np.asarray(tx.jit(lambda k: random.uniform(k, (100,)))(k))
    np.testing.assert_array_equal(u, (np_bits([0, 1234], 100) >> 9).astype(np.float32) * 2.0 ** -23)


def test_key_and_split_values():
    np.testing.assert_array_equal(np.asarray(random.key(0)), [0, 0])
    np.testing.assert_array_equal(np.asarray(random.key(42)), [0, 42])
    np.testing.assert_array_equal(np.asarray(random.key(2**40 + 5)), [256, 5])
    np.testing.assert_array_equal(np.asarray(random.key(-1)), [0, 0xFFFFFFFF])
    ks = np.asarray(random.split(random.key(0), 3))
    w0, w1 = np_threefry(0, 0, np.zeros(3, np.uint32), np.arange(3, dtype=np.uint32))
    np.testing.assert_array_equal(ks, np.stack([w0, w1], 1))
    assert ks[0].tolist() == [0x6b200159, 0x99ba4efe]
    # a traced seed gives the same key
    np.testing.assert_array_equal(np.asarray(tx.jit(random.key)(np.int32(42))), [0, 42])


def test_determinism_and_distinct_streams():
    k = random.key(7)
    a = np.asarray(random.normal(k, (1000,)))
    np.testing.assert_array_equal(a, np.asarray(random.normal(random.key(7), (1000,))))
    assert not np.array_equal(a, np.asarray(random.normal(random.key(8), (1000,))))
    k1, k2 = random.split(k)
    x1, x2 = np.asarray(random.normal(k1, (5000,))), np.asarray(random.normal(k2, (5000,)))
    assert abs(np.corrcoef(x1, x2)[0, 1]) < 0.05  # independent streams: |r| ~ 0.014
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.1
    f = [np.asarray(random.fold_in(k, i)).tolist() for i in range(4)]
    assert len({tuple(v) for v in f} | {tuple(np.asarray(k).tolist())}) == 5
    np.testing.assert_array_equal(np.asarray(random.fold_in(k, 3)), f[3])


def test_jit_equals_eager():
    k = random.key(3)
    draws = {
        "normal": lambda k: random.normal(k, (4, 5)),
        "uniform": lambda k: random.uniform(k, (6,), minval=-2.0, maxval=3.0),
        "split": lambda k: random.split(k, 4),
        "fold_in": lambda k: random.fold_in(k, 11),
        "bernoulli": lambda k: random.bernoulli(k, 0.3, (9,)),
        "categorical": lambda k: random.categorical(k, tnp.asarray([[0.0, 1.0, 2.0]] * 5)),
        "permutation": lambda k: random.permutation(k, 12),
        "randint": lambda k: random.randint(k, (8,), 3, 17),
    }
    for name, f in draws.items():
        got, want = np.asarray(tx.jit(f)(k)), np.asarray(f(k))
        if got.dtype.kind == "f":  # the bits are exact; fusion may round the float maths once more
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)


def _ks_uniform(u):
    u = np.sort(u)
    n = len(u)
    return max(np.max(np.arange(1, n + 1) / n - u), np.max(u - np.arange(n) / n))


def test_uniform_moments_and_range():
    n = 20000
    u = np.asarray(random.uniform(random.key(0), (n,)))
    assert u.dtype == np.float32 and u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 4 * math.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 0.003
    assert _ks_uniform(u) < 1.63 / math.sqrt(n)  # Kolmogorov-Smirnov at the 1% level
    v = np.asarray(random.uniform(random.key(1), (n,), minval=-3.0, maxval=5.0))
    assert v.min() >= -3.0 and v.max() <= 5.0 and abs(v.mean() - 1.0) < 0.1
    for dt in (tnp.float16, tnp.bfloat16, tnp.float64):
        w = np.asarray(random.uniform(random.key(2), (4000,), dt))
        assert w.dtype == dt and w.min() >= 0 and w.max() < 1
        assert abs(float(w.astype(np.float64).mean()) - 0.5) < 0.03


def test_normal_moments():
    n = 40000
    x = np.asarray(random.normal(random.key(5), (n,))).astype(np.float64)
    assert np.isfinite(x).all()
    assert abs(x.mean()) < 4 / math.sqrt(n)
    assert abs(x.std() - 1) < 0.02
    assert abs(((x - x.mean()) ** 3).mean()) < 0.06  # skewness 0
    assert abs(((x - x.mean()) ** 4).mean() / x.var() ** 2 - 3) < 0.15  # kurtosis 3
    # the normal CDF at a few points
    for z, p in ((-1.0, 0.158655), (0.0, 0.5), (1.5, 0.933193)):
        assert abs((x < z).mean() - p) < 0.01
    assert np.asarray(random.normal(random.key(5), (3, 2), tnp.float16)).dtype == np.float16


def test_bernoulli_categorical_gumbel():
    b = np.asarray(random.bernoulli(random.key(0), 0.3, (20000,)))
    assert b.dtype == np.bool_ and abs(b.mean() - 0.3) < 0.015
    p = np.array([0.1, 0.2, 0.7])
    c = np.asarray(random.categorical(random.key(1), np.log(p), shape=(20000,)))
    np.testing.assert_allclose(np.bincount(c, minlength=3) / len(c), p, atol=0.015)
    # batched logits along axis 0
    logits = np.log(np.array([[0.9, 0.5], [0.1, 0.5]], np.float32))
    c2 = np.asarray(random.categorical(random.key(2), logits, axis=0, shape=(5000, 2)))
    assert c2.shape == (5000, 2)
    np.testing.assert_allclose(c2.mean(0), [0.1, 0.5], atol=0.03)
    g = np.asarray(random.gumbel(random.key(3), (20000,))).astype(np.float64)
    assert abs(g.mean() - 0.5772) < 0.03 and abs(g.var() - math.pi ** 2 / 6) < 0.1


def test_permutation_and_randint():
    perm = tx.jit(lambda k, i: random.permutation(random.fold_in(k, i), 10))
    perms = [np.asarray(perm(random.key(0), np.int32(i))) for i in range(300)]
    for q in perms:
        assert sorted(q.tolist()) == list(range(10))
    assert len({tuple(q) for q in perms}) == 300
    firsts = np.bincount([q[0] for q in perms], minlength=10)
    assert firsts.min() > 10 and firsts.max() < 55  # about 30 each
    x = tnp.asarray(np.arange(12, dtype=np.float32).reshape(6, 2))
    y = np.asarray(random.permutation(random.key(9), x))
    order = np.asarray(random.permutation(random.key(9), 6))
    np.testing.assert_array_equal(y, np.asarray(x)[order])
    r = np.asarray(random.randint(random.key(4), (30000,), -3, 4))
    assert r.dtype == np.int32 and r.min() == -3 and r.max() == 3
    np.testing.assert_allclose(np.bincount(r + 3) / len(r), np.full(7, 1 / 7), atol=0.01)


def test_bad_keys_are_reported():
    with pytest.raises(TilefuseError, match="random.normal: expected a key"):
        random.normal(np.zeros(3, np.uint32), (2,))
    with pytest.raises(TilefuseError, match="expected a key"):
        random.uniform(random.split(random.key(0), 2), (2,))
    with pytest.raises(TilefuseError, match="float dtype"):
        random.uniform(random.key(0), (2,), tnp.int32)


def test_vmap_over_keys_equals_one_key_at_a_time():
    keys = random.split(random.key(0), 4)
    batched = np.asarray(tx.vmap(lambda k: random.normal(k, (3,)))(keys))
    one_by_one = np.stack([np.asarray(random.normal(keys[i], (3,))) for i in range(4)])
    np.testing.assert_array_equal(batched, one_by_one)
