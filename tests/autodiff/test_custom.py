"""custom_vjp and custom_jvp hold in every composition (issue 18): their rules, deliberately unlike
the true derivatives here so a test fails when a transformation loses them, are used under jit,
vmap, nested grads, tile_ops and the persistent front-end cache, on every device."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp


@tx.custom_vjp
def clip_gradient(x):
    return x


def _clip_fwd(x):
    return x, None


def _clip_bwd(_, g):
    return (tnp.clip(g, -1.0, 1.0),)


clip_gradient.defvjp(_clip_fwd, _clip_bwd)


def f_vjp(x):
    """True derivative 10x; with the rule clip(5, -1, 1) * 2x = 2x."""
    return (5.0 * clip_gradient(x * x)).sum()


@tx.custom_jvp
def twice_sine(x):
    return tnp.sin(x)


@twice_sine.defjvp
def _twice_sine_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return tnp.sin(x), 2.0 * tnp.cos(x) * t  # twice the true derivative: the rule must win


def f_jvp(x):
    return twice_sine(x).sum()


X = np.array([0.3, -1.2, 2.0], np.float32)
XS = np.stack([X, X * 0.5, -X])

# (name, the composition, its argument, what the rules make of it)
COMPOSITIONS = [
    ("grad", tx.grad(f_vjp), X, 2 * X),
    ("jit(grad)", tx.jit(tx.grad(f_vjp)), X, 2 * X),
    ("grad(jit)", tx.grad(tx.jit(f_vjp)), X, 2 * X),
    ("jit(grad(jit))", tx.jit(tx.grad(tx.jit(f_vjp))), X, 2 * X),
    ("vmap(grad)", tx.vmap(tx.grad(f_vjp)), XS, 2 * XS),
    ("vmap(grad(jit))", tx.vmap(tx.grad(tx.jit(f_vjp))), XS, 2 * XS),
    ("grad(vmap)", tx.grad(lambda xs: tx.vmap(f_vjp)(xs).sum()), XS, 2 * XS),
    ("grad(vmap(jit))", tx.grad(lambda xs: tx.vmap(tx.jit(f_vjp))(xs).sum()), XS, 2 * XS),
    ("jvp: grad", tx.grad(f_jvp), X, 2 * np.cos(X)),
    ("jvp: grad(jit)", tx.grad(tx.jit(f_jvp)), X, 2 * np.cos(X)),
    ("jvp: jit(grad(jit))", tx.jit(tx.grad(tx.jit(f_jvp))), X, 2 * np.cos(X)),
    ("jvp: vmap(grad(jit))", tx.vmap(tx.grad(tx.jit(f_jvp))), XS, 2 * np.cos(XS)),
    ("jvp: grad(vmap(jit))", tx.grad(lambda xs: tx.vmap(tx.jit(f_jvp))(xs).sum()), XS, 2 * np.cos(XS)),
    ("jvp: grad(grad)", tx.grad(lambda x: tx.grad(f_jvp)(x).sum()), X, -2 * np.sin(X)),
    ("jvp: jvp", lambda x: tx.jvp(f_jvp, (x,), (np.ones_like(x),))[1], X, 2 * np.cos(X).sum()),
    ("jvp: jvp(jit)", lambda x: tx.jvp(tx.jit(f_jvp), (x,), (np.ones_like(x),))[1], X, 2 * np.cos(X).sum()),
    ("jvp: jit(jvp)", tx.jit(lambda x: tx.jvp(f_jvp, (x,), (tnp.ones_like(x),))[1]), X, 2 * np.cos(X).sum()),
    ("jvp: vmap(jvp(jit))", tx.vmap(lambda x: tx.jvp(tx.jit(f_jvp), (x,), (tnp.ones_like(x),))[1]), XS,
     2 * np.cos(XS).sum(1)),
    ("jvp: jacfwd(jit)", tx.jacfwd(tx.jit(lambda x: twice_sine(x))), X, np.diag(2 * np.cos(X))),
]


@pytest.mark.parametrize("name,fn,x,want", COMPOSITIONS, ids=[c[0] for c in COMPOSITIONS])
def test_custom_rules_hold_in_every_composition(device, name, fn, x, want):
    np.testing.assert_allclose(np.asarray(fn(x)), want, rtol=1e-5, atol=1e-6)


def test_the_issue_case():
    """grad(f), jit(grad(f)) and grad(jit(f)) agree; grad(jit(f)) gave 5.0."""
    @tx.custom_vjp
    def c(x):
        return x
    c.defvjp(lambda x: (x, None), lambda _, g: (tnp.clip(g, -1.0, 1.0),))

    def f(x):
        return 5.0 * c(x)
    assert [float(g(2.0)) for g in (tx.grad(f), tx.jit(tx.grad(f)), tx.grad(tx.jit(f)))] == [1.0, 1.0, 1.0]


def test_tile_op_vjp_through_a_jitted_caller(device):
    """grad of a function calling a jitted function that calls a tile_op with a VJP."""
    @tx.tile_op
    def double(x: tx.Tensor["N"]) -> tx.Tensor["N"]:  # noqa: F821
        return x * 2.0

    @double.defvjp
    def _double_vjp(x, out, g):
        return (g * 3.0,)  # not the true 2: the rule must win

    inner = tx.jit(lambda x: double(x).sum())
    got = tx.grad(lambda x: inner(x) * 1.0)(X)
    np.testing.assert_allclose(np.asarray(got), np.full(3, 3.0), rtol=1e-6)


def test_nondiff_argnums_and_pytrees(device):
    def scaled(x, k):
        return {"y": x["a"] * k}
    f = tx.custom_vjp(scaled, nondiff_argnums=(1,))
    f.defvjp(lambda x, k: (scaled(x, k), x["a"]),
             lambda k, a, ct: ({"a": ct["y"] * (k + 1.0)},))  # k + 1, not k
    g = tx.grad(tx.jit(lambda x: f(x, 3.0)["y"].sum()))({"a": X})
    np.testing.assert_allclose(np.asarray(g["a"]), np.full(3, 4.0))

    h = tx.custom_jvp(lambda x, p: x ** p, nondiff_argnums=(1,))
    h.defjvp(lambda p, primals, tangents: (primals[0] ** p, 10.0 * tangents[0]))
    np.testing.assert_allclose(np.asarray(tx.grad(lambda x: h(x, 2).sum())(X)), np.full(3, 10.0))


def test_defjvps_sums_one_rule_per_argument(device):
    f = tx.custom_jvp(lambda x, y: x * y)
    f.defjvps(lambda tx_, out, x, y: 3.0 * tx_ * y, lambda ty, out, x, y: 3.0 * ty * x)
    gx, gy = tx.grad(lambda x, y: f(x, y).sum(), argnums=(0, 1))(X, 2 * X)
    np.testing.assert_allclose(np.asarray(gx), 3 * 2 * X, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gy), 3 * X, rtol=1e-6)


def test_rule_errors_name_the_function():
    bad = tx.custom_jvp(lambda x: x)
    bad.defjvp(lambda p, t: p[0])
    with pytest.raises(tx.TilefuseError, match="pair"):
        tx.jvp(bad, (X,), (X,))
    undefined = tx.custom_jvp(lambda x: x)
    with pytest.raises(tx.TilefuseError, match="defjvp"):
        undefined(X)


def test_rules_survive_the_persistent_front_end_cache(tmp_path):
    """Two processes compile grad(jit(f)) with one cache folder: the second reads the front end
    from disk and still applies both rules."""
    script = textwrap.dedent("""
        import numpy as np, tilefuse as tx, tilefuse.numpy as tnp
        @tx.custom_vjp
        def c(x):
            return x
        c.defvjp(lambda x: (x, None), lambda _, g: (tnp.clip(g, -1.0, 1.0),))
        @tx.custom_jvp
        def s(x):
            return tnp.sin(x)
        s.defjvp(lambda p, t: (tnp.sin(p[0]), 2.0 * tnp.cos(p[0]) * t[0]))
        f = lambda x: (5.0 * c(x * x)).sum() + s(x).sum()
        x = np.array([0.3, -1.2, 2.0], np.float32)
        print(np.asarray(tx.jit(tx.grad(tx.jit(f)))(x)).tolist())
    """)
    env = dict(os.environ, TILEFUSE_CACHE_DIR=str(tmp_path), TILEFUSE_TIERED="0")  # (compiled, cached)
    outs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
            .stdout for _ in range(2)]
    want = 2 * X + 2 * np.cos(X)
    for out in outs:
        np.testing.assert_allclose(eval(out), want, rtol=1e-5)
    assert any(name.startswith("frontend") or "frontend" in name for name in os.listdir(tmp_path)), \
        os.listdir(tmp_path)
