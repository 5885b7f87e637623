"""tilefuse.optim against hand-written numpy updates over several steps, eagerly and under jit."""
from __future__ import annotations

import math

import numpy as np
import pytest

import tilefuse as tx
import tilefuse.numpy as tnp
import tilefuse.optim as optim
from tilefuse.ir.errors import TilefuseError

STEPS = 5


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=(4,)).astype(np.float32)}
    grads = [{"w": rng.normal(size=(3, 4)).astype(np.float32) * 2,
              "b": rng.normal(size=(4,)).astype(np.float32)} for _ in range(STEPS)]
    return params, grads


def _run(opt, params, grads, jit):
    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s
    step = tx.jit(step) if jit else step
    state = opt.init(params)
    for g in grads:
        params, state = step(params, state, g)
    return {k: np.asarray(v) for k, v in params.items()}, state


def _check(opt, reference, jit, seed=0, rtol=2e-5, atol=1e-6):
    params, grads = _problem(seed)
    got, state = _run(opt, params, grads, jit)
    p = {k: v.astype(np.float64) for k, v in params.items()}
    want = reference(p, [{k: v.astype(np.float64) for k, v in g.items()} for g in grads])
    for k in p:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=k)
    return state


# ---- numpy references ---------------------------------------------------------------------------

def ref_sgd(lr, momentum=0.0, nesterov=False):
    def run(p, grads):
        t = {k: np.zeros_like(v) for k, v in p.items()}
        for g in grads:
            for k in p:
                t[k] = g[k] + momentum * t[k]
                d = g[k] + momentum * t[k] if nesterov else t[k]
                p[k] = p[k] - lr * d
        return p
    return run


def ref_adam(lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, mask=None, clip=None, lr_at=None):
    def run(p, grads):
        m = {k: np.zeros_like(v) for k, v in p.items()}
        v = {k: np.zeros_like(x) for k, x in p.items()}
        for t, g in enumerate(grads, 1):
            if clip is not None:
                norm = math.sqrt(sum((x ** 2).sum() for x in g.values()))
                if norm >= clip:
                    g = {k: x * clip / norm for k, x in g.items()}
            rate = lr if lr_at is None else lr_at(t - 1)
            for k in p:
                m[k] = b1 * m[k] + (1 - b1) * g[k]
                v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
                d = (m[k] / (1 - b1 ** t)) / (np.sqrt(v[k] / (1 - b2 ** t)) + eps)
                if wd and (mask is None or mask[k]):
                    d = d + wd * p[k]
                p[k] = p[k] - rate * d
        return p
    return run


def ref_warmup_cosine(init, peak, warmup, decay_steps, end):
    def lr(t):
        if t < warmup:
            return init + (peak - init) * t / warmup
        frac = min(max((t - warmup) / (decay_steps - warmup), 0.0), 1.0)
        return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * frac))
    return lr


# ---- tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_sgd(jit):
    _check(optim.sgd(0.1), ref_sgd(0.1), jit)
    _check(optim.sgd(0.1, momentum=0.9), ref_sgd(0.1, 0.9), jit)
    _check(optim.sgd(0.05, momentum=0.8, nesterov=True), ref_sgd(0.05, 0.8, True), jit)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_adam(jit):
    state = _check(optim.adam(1e-2), ref_adam(1e-2), jit)
    assert int(np.asarray(state[0].count)) == STEPS
    _check(optim.adam(3e-2, b1=0.8, b2=0.95, eps=1e-6), ref_adam(3e-2, 0.8, 0.95, 1e-6), jit, seed=1)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_adamw_decoupled_weight_decay(jit):
    _check(optim.adamw(1e-2, weight_decay=0.1), ref_adam(1e-2, wd=0.1), jit)
    # a mask, as a function of the params: no decay for the bias
    mask = {"w": True, "b": False}
    opt = optim.adamw(1e-2, weight_decay=0.5, mask=lambda p: {k: k == "w" for k in p})
    _check(opt, ref_adam(1e-2, wd=0.5, mask=mask), jit)
    # decoupled: a zero gradient still shrinks the weights by lr * wd * p, in step 1 exactly
    p = {"w": np.full((2,), 3.0, np.float32)}
    u, _ = optim.adamw(0.1, weight_decay=0.5).update({"w": np.zeros(2, np.float32)},
                                                      optim.adamw(0.1, weight_decay=0.5).init(p), p)
    np.testing.assert_allclose(np.asarray(u["w"]), -0.1 * 0.5 * 3.0, rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_clip_by_global_norm_and_chain(jit):
    g = {"a": np.array([3.0, 0.0], np.float32), "b": np.array([[4.0]], np.float32)}
    u, _ = optim.clip_by_global_norm(1.0).update(g, optim.EmptyState())
    np.testing.assert_allclose(np.asarray(u["a"]), [0.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(u["b"]), [[0.8]], rtol=1e-6)
    u, _ = optim.clip_by_global_norm(10.0).update(g, optim.EmptyState())  # under the limit: unchanged
    np.testing.assert_array_equal(np.asarray(u["a"]), g["a"])
    np.testing.assert_allclose(float(optim.global_norm(g)), 5.0, rtol=1e-6)
    opt = optim.chain(optim.clip_by_global_norm(1.5), optim.adamw(1e-2, weight_decay=0.01))
    _check(opt, ref_adam(1e-2, wd=0.01, clip=1.5), jit)


def test_schedules():
    s = optim.warmup_cosine(0.0, 1.0, 4, 20, 0.1)
    ref = ref_warmup_cosine(0.0, 1.0, 4, 20, 0.1)
    for t in [0, 1, 3, 4, 5, 12, 19, 20, 25]:
        np.testing.assert_allclose(float(s(t)), ref(t), rtol=1e-6, atol=1e-7, err_msg=str(t))
        np.testing.assert_allclose(float(tx.jit(s)(np.int32(t))), ref(t), rtol=1e-6, atol=1e-7)
    assert float(optim.constant_schedule(0.3)(7)) == pytest.approx(0.3)
    lin = optim.linear_schedule(1.0, 0.0, 10)
    assert [round(float(lin(t)), 6) for t in (0, 5, 10, 15)] == [1.0, 0.5, 0.0, 0.0]
    cos = optim.cosine_decay_schedule(2.0, 10, alpha=0.1)
    assert float(cos(0)) == pytest.approx(2.0) and float(cos(10)) == pytest.approx(0.2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_adamw_with_a_schedule(jit):
    sched = optim.warmup_cosine(0.0, 2e-2, 2, STEPS, 1e-3)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(sched, weight_decay=0.1))
    state = _check(opt, ref_adam(None, wd=0.1, clip=1.0, lr_at=ref_warmup_cosine(0.0, 2e-2, 2, STEPS, 1e-3)),
                   jit)
    assert int(np.asarray(state[1][2].count)) == STEPS  # the schedule's own step counter


def test_state_is_a_pytree_and_updates_keep_dtypes():
    params = {"w": tnp.ones((2, 2), tnp.bfloat16), "b": tnp.zeros((2,))}
    opt = optim.adamw(1e-1)
    state = opt.init(params)
    leaves = tx.tree_leaves(state)
    assert len(leaves) == 1 + 2 * 2 + 0  # count, mu and nu for both params
    assert state[0].mu["w"].dtype == tnp.bfloat16 and state[0].nu["b"].dtype == np.float32
    grads = {"w": tnp.ones((2, 2), tnp.bfloat16), "b": tnp.ones((2,))}
    u, state = opt.update(grads, state, params)
    new = optim.apply_updates(params, u)
    assert new["w"].dtype == tnp.bfloat16 and new["b"].dtype == np.float32
    assert float(np.asarray(new["b"])[0]) == pytest.approx(-0.1, rel=1e-5)


def test_adam_on_leaves_of_several_dtypes_equals_each_leaf_alone():
    """The bias corrections are made once per compute dtype and shared by the leaves of that
    dtype: a tree of float32, float64 and bfloat16 leaves updates each as it would alone."""
    rng = np.random.default_rng(3)
    params = {"a": rng.standard_normal(3).astype(np.float32), "d": rng.standard_normal(3),
              "h": tnp.asarray(rng.standard_normal(2), tnp.bfloat16), "b": rng.standard_normal(4).astype(np.float32)}
    opt = optim.adam(1e-2)
    together, alone = (params, opt.init(params)), {k: ({k: v}, opt.init({k: v})) for k, v in params.items()}
    for step in range(3):
        grads = {k: tnp.asarray(rng.standard_normal(np.shape(v)), tnp.result_type(v)) for k, v in params.items()}
        u, st = opt.update(grads, together[1])
        together = (optim.apply_updates(together[0], u), st)
        for k in params:
            u, st = opt.update({k: grads[k]}, alone[k][1])
            alone[k] = (optim.apply_updates(alone[k][0], u), st)
    for k in params:
        got, want = np.asarray(together[0][k]), np.asarray(alone[k][0][k])
        assert got.dtype == want.dtype == np.asarray(params[k]).dtype
        np.testing.assert_array_equal(got, want, err_msg=k)


def test_weight_decay_needs_params():
    opt = optim.adamw(1e-2, weight_decay=0.1)
    p = {"w": np.ones(2, np.float32)}
    with pytest.raises(TilefuseError, match="needs the params"):
        opt.update(p, opt.init(p))
    with pytest.raises(TilefuseError, match="chain: the state has"):
        opt.update(p, (), p)
