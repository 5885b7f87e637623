"""The public differentiation API: vjp, grad, value_and_grad, jvp, jacfwd, jacrev, hessian,
custom_vjp, custom_jvp and stop_gradient, over pytrees of arrays (JAX's signatures)."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import numpy as np

from tilefuse.ir import dtypes
from tilefuse.ir import primitives as P
from tilefuse.ir.errors import TilefuseError, TransformError, for_user, with_user_line
from tilefuse.tracer.core import bind1, bind_custom_jvp, bind_custom_vjp, get_aval, is_array_like
from tilefuse.tracer.pytree import PyTreeDef, tree_flatten, tree_map, tree_unflatten

from . import ops
from .jvp import jvp_flat
from .vjp import vjp_flat


def _error(msg: str) -> TransformError:
    return TransformError(with_user_line(msg))


def _user_frames(fn: Callable) -> Callable:
    """Re-raise tilefuse errors, and the user's own code's, with our internal frames dropped (errors.for_user)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # (ours, or the user's code's: what the user sees)
            raise for_user(e)
    return wrapper


def _fname(fun) -> str:
    return getattr(fun, "__name__", type(fun).__name__)


# ---- naming arguments in errors --------------------------------------------------------------

def _param_names(fun) -> list[str]:
    try:
        params = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _arg_name(fun, i: int) -> str:
    names = _param_names(fun)
    return f"{names[i]!r} (position {i})" if i < len(names) else f"at position {i}"


def _leaf_paths(td: PyTreeDef, prefix: str = "") -> list[str]:
    """'['w']', '[0]', ... for each leaf of a tree definition, in leaf order."""
    if td.node_type is None:
        return [prefix]
    keys = td.aux if td.node_type is dict else range(len(td.children))
    return [p for k, c in zip(keys, td.children) for p in _leaf_paths(c, f"{prefix}[{k!r}]")]


def _check_leaves(where: str, fun, args, argnums) -> tuple[list, PyTreeDef]:
    """The leaves of the differentiated arguments; each must be a floating-point array."""
    for i in argnums:
        leaves, td = tree_flatten(args[i])
        for x, path in zip(leaves, _leaf_paths(td)):
            what = f"argument {_arg_name(fun, i)}{' leaf ' + path if path else ''} of {_fname(fun)}"
            if not is_array_like(x):
                raise _error(f"{where}: {what} is a {type(x).__name__}, not an array; pass "
                             "arrays (or pytrees of arrays), or leave it out of argnums")
            d = get_aval(x).dtype
            if not dtypes.is_float(d):
                raise _error(f"{where}: {what} has dtype {d}; only floating-point inputs can be "
                             "differentiated. Leave it out of argnums (it then gets no "
                             "gradient) or convert it to a float dtype.")
    return tree_flatten(tuple(args[i] for i in argnums))


def _normalize_argnums(where: str, fun, argnums, nargs: int) -> tuple[tuple[int, ...], bool]:
    single = isinstance(argnums, (int, np.integer)) and not isinstance(argnums, bool)
    nums = (argnums,) if single else argnums
    if not isinstance(nums, (tuple, list)) or not nums or not all(
            isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in nums):
        raise _error(f"{where}: argnums must be an int or a non-empty tuple of ints, got {argnums!r}")
    for i in nums:
        if not -nargs <= i < nargs:
            raise _error(f"{where}: argnums={argnums!r} is out of range: {_fname(fun)} was called "
                         f"with {nargs} positional argument(s)")
    out = tuple(int(i) % nargs for i in nums)
    if len(set(out)) != len(out):
        raise _error(f"{where}: argnums={argnums!r} repeats an argument")
    return out, single


def _split_aux(where: str, fun, out, has_aux: bool):
    if not has_aux:
        return out, None
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        got = f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else \
            f"a {type(out).__name__}"
        raise _error(f"{where}(..., has_aux=True): {_fname(fun)} must return a pair "
                     f"(output, aux), got {got}")
    return out[0], out[1]


def _flat_fun(where: str, fun, args, kwargs, argnums, in_tree, has_aux, store: dict):
    """fun as a function of the differentiated leaves, returning (output leaves, aux)."""
    def flat(*leaves):
        diff = tree_unflatten(in_tree, leaves)
        full = list(args)
        for i, v in zip(argnums, diff):
            full[i] = v
        out, aux = _split_aux(where, fun, fun(*full, **kwargs), has_aux)
        out_leaves, store["out_tree"] = tree_flatten(out)
        for k, o in enumerate(out_leaves):
            if not is_array_like(o):
                raise _error(f"{where}: {_fname(fun)} returned a {type(o).__name__} (output leaf "
                             f"{k}); it must return arrays (or pytrees of arrays)")
        return out_leaves, aux
    return flat


def _materialize_all(cts, primals) -> list:
    return [ops.materialize(ops.instantiate(c, x)) for c, x in zip(cts, primals)]


def _unflatten_args(in_tree, leaves, single):
    tree = tree_unflatten(in_tree, leaves)
    return tree[0] if single else tree


# ---- reverse mode ------------------------------------------------------------------------------

@_user_frames
def vjp(fun: Callable, *primals, has_aux: bool = False):
    """(out, vjp_fn) or (out, vjp_fn, aux): vjp_fn(cotangent shaped like out) returns a tuple
    with one cotangent per primal, each shaped like it."""
    nums = tuple(range(len(primals)))
    leaves, in_tree = _check_leaves("vjp", fun, primals, nums)
    store: dict = {}
    flat = _flat_fun("vjp", fun, primals, {}, nums, in_tree, has_aux, store)
    outs, pullback, aux = vjp_flat(flat, leaves, prepare=True)
    out_tree = store["out_tree"]

    @_user_frames
    def vjp_fn(cotangent):
        ct_leaves, ct_tree = tree_flatten(cotangent)
        if ct_tree != out_tree:
            raise _error(f"vjp_fn: the cotangent must have the structure of {_fname(fun)}'s "
                         f"output {out_tree}, got {ct_tree}")
        cts = []
        for k, (c, o) in enumerate(zip(ct_leaves, outs)):
            ca, oa = get_aval(c), get_aval(o)
            if ca.shape != oa.shape:
                raise _error(f"vjp_fn: cotangent leaf {k} has shape {ca.shape} but the output "
                             f"has shape {oa.shape}")
            cts.append(ops.convert(c, oa.dtype) if dtypes.is_float(ca.dtype) else c)
        return _unflatten_args(in_tree, _materialize_all(pullback(cts), leaves), False)

    out = tree_unflatten(out_tree, outs)
    return (out, vjp_fn, aux) if has_aux else (out, vjp_fn)


def _value_and_grad(where, fun, argnums, has_aux, args, kwargs):
    nums, single = _normalize_argnums(where, fun, argnums, len(args))
    leaves, in_tree = _check_leaves(where, fun, args, nums)
    store: dict = {}
    flat = _flat_fun(where, fun, args, kwargs, nums, in_tree, has_aux, store)
    outs, pullback, aux = vjp_flat(flat, leaves, prepare=True)
    a = get_aval(outs[0]) if len(outs) == 1 else None
    if a is None or a.shape != ():
        got = f"an output of type {a}" if a is not None else f"{len(outs)} output arrays"
        hint = ("; if the rest is auxiliary data, pass has_aux=True"
                if not has_aux and store["out_tree"].node_type in (tuple, list) else "")
        raise _error(f"{where}: {_fname(fun)} must return a scalar (shape ()), got {got}{hint}. "
                     "For a non-scalar output use tx.vjp (one cotangent) or tx.jacrev (the "
                     "full Jacobian).")
    if not dtypes.is_float(a.dtype):
        raise _error(f"{where}: {_fname(fun)} returned a {a.dtype} value; only floating-point "
                     "outputs can be differentiated")
    cts = pullback([np.ones((), a.dtype)])
    grads = _unflatten_args(in_tree, _materialize_all(cts, leaves), single)
    value = tree_unflatten(store["out_tree"], outs)
    return ((value, aux) if has_aux else value), grads


def value_and_grad(fun: Callable, argnums=0, has_aux: bool = False) -> Callable:
    """f -> (value, gradient) of a scalar function; with has_aux, ((value, aux), gradient)."""
    @_user_frames
    @functools.wraps(fun)
    def value_and_grad_f(*args, **kwargs):
        return _value_and_grad("value_and_grad", fun, argnums, has_aux, args, kwargs)
    return value_and_grad_f


def grad(fun: Callable, argnums=0, has_aux: bool = False) -> Callable:
    """f -> the gradient of scalar f with respect to argument(s) argnums (pytrees welcome);
    with has_aux, f returns (value, aux) and grad(f) returns (gradient, aux)."""
    @_user_frames
    @functools.wraps(fun)
    def grad_f(*args, **kwargs):
        value, g = _value_and_grad("grad", fun, argnums, has_aux, args, kwargs)
        return (g, value[1]) if has_aux else g
    return grad_f


# ---- forward mode ------------------------------------------------------------------------------

@_user_frames
def jvp(fun: Callable, primals: Sequence, tangents: Sequence, has_aux: bool = False):
    """(out, tangent_out) of fun at primals along tangents (tuples, one entry per argument)."""
    for name, v in (("primals", primals), ("tangents", tangents)):
        if not isinstance(v, (tuple, list)):
            raise _error(f"jvp: {name} must be a tuple or list with one entry per argument of "
                         f"{_fname(fun)}, got a {type(v).__name__}")
    if len(primals) != len(tangents):
        raise _error(f"jvp: {len(primals)} primals but {len(tangents)} tangents")
    nums = tuple(range(len(primals)))
    leaves, in_tree = _check_leaves("jvp", fun, tuple(primals), nums)
    t_leaves, t_tree = tree_flatten(tuple(tangents))
    if t_tree != in_tree:
        raise _error(f"jvp: tangents must have the structure of the primals {in_tree}, got {t_tree}")
    ts = []
    for k, (p, t) in enumerate(zip(leaves, t_leaves)):
        pa, ta = get_aval(p), get_aval(t)
        if pa.shape != ta.shape or (pa.dtype != ta.dtype and not ta.weak_type):
            raise _error(f"jvp: tangent leaf {k} is {ta.str_short()} but its primal is "
                         f"{pa.str_short()}; they must match in shape and dtype")
        ts.append(ops.convert(t, pa.dtype) if pa.dtype != ta.dtype else t)
    store: dict = {}
    flat = _flat_fun("jvp", fun, tuple(primals), {}, nums, in_tree, has_aux, store)
    outs, touts, aux = jvp_flat(flat, leaves, ts)
    out_tree = store["out_tree"]
    result = (tree_unflatten(out_tree, outs), tree_unflatten(out_tree, _materialize_all(touts, outs)))
    return result + (aux,) if has_aux else result


# ---- Jacobians -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _vmap():
    """tx.vmap once it exists (one batched call per Jacobian), else None (a loop of calls)."""
    from tilefuse.tracer.vmap import vmap
    try:
        vmap(lambda x: x)(np.zeros((1,), np.float32))
    except NotImplementedError:
        return None
    return vmap


def _map_basis(fn: Callable, basis: list, axis: int):
    """Map fn over the rows of the basis arrays (a leading axis of length n each).
    fn(row) -> (fixed, per_row): `fixed` does not depend on the row (primal outputs, aux),
    `per_row` is a list of arrays. Returns (fixed, the per_row arrays stacked along `axis`,
    0 or -1)."""
    vmap = _vmap()
    if vmap is not None:  # one batched call
        fixed, per_row = vmap(fn, out_axes=(None, axis))(basis)
        return fixed, list(per_row)
    n = basis[0].shape[0]
    rows = [fn([b[k] for b in basis]) for k in range(n)]
    if not rows:  # an empty input: one call on a zero row, for the shapes
        rows = [fn([np.zeros(b.shape[1:], b.dtype) for b in basis])]
    fixed, sample = rows[0]
    stacked = []
    for i, s in enumerate(sample):
        a = get_aval(s)
        st = ops.stack([r[1][i] for r in rows[:n]], a.shape, a.dtype)
        stacked.append(st if axis == 0 else ops.transpose(st, (*range(1, a.ndim + 1), 0)))
    return fixed, stacked


def _std_basis(avals) -> list[np.ndarray]:
    """The standard basis of the concatenated, flattened leaves, split back per leaf:
    one (N, *shape) array per leaf, N the total size."""
    total = sum(a.size for a in avals)
    eye = np.eye(total)
    out, off = [], 0
    for a in avals:
        out.append(eye[:, off:off + a.size].reshape((total, *a.shape)).astype(a.dtype))
        off += a.size
    return out


def _check_float_outputs(where, fun, outs):
    for k, o in enumerate(outs):
        d = get_aval(o).dtype
        if not dtypes.is_float(d):
            raise _error(f"{where}: output leaf {k} of {_fname(fun)} has dtype {d}; only "
                         "floating-point outputs have a Jacobian")


def jacrev(fun: Callable, argnums=0, has_aux: bool = False) -> Callable:
    """The Jacobian by reverse mode: one forward pass, one pullback per output element.
    jac[out leaf][in leaf] has shape out_shape + in_shape."""
    def jacfun(*args, **kwargs):
        nums, single = _normalize_argnums("jacrev", fun, argnums, len(args))
        leaves, in_tree = _check_leaves("jacrev", fun, args, nums)
        store: dict = {}
        flat = _flat_fun("jacrev", fun, args, kwargs, nums, in_tree, has_aux, store)
        outs, pullback, aux = vjp_flat(flat, leaves, prepare=True)
        _check_float_outputs("jacrev", fun, outs)
        out_avals, in_avals = [get_aval(o) for o in outs], [get_aval(x) for x in leaves]
        _, stacked = _map_basis(lambda cts: ((), _materialize_all(pullback(cts), leaves)),
                                _std_basis(out_avals), axis=0)
        jac, off = [], 0
        for oa in out_avals:
            jac.append(_unflatten_args(in_tree, [
                ops.reshape(ops.slice_axis(s, 0, off, off + oa.size), oa.shape + ia.shape)
                for s, ia in zip(stacked, in_avals)], single))
            off += oa.size
        jac = tree_unflatten(store["out_tree"], jac)
        return (jac, aux) if has_aux else jac
    return _user_frames(functools.wraps(fun)(jacfun))


def jacfwd(fun: Callable, argnums=0, has_aux: bool = False) -> Callable:
    """The Jacobian by forward mode: one JVP per input element.
    jac[out leaf][in leaf] has shape out_shape + in_shape."""
    def jacfun(*args, **kwargs):
        nums, single = _normalize_argnums("jacfwd", fun, argnums, len(args))
        leaves, in_tree = _check_leaves("jacfwd", fun, args, nums)
        store: dict = {}
        flat = _flat_fun("jacfwd", fun, args, kwargs, nums, in_tree, has_aux, store)
        in_avals = [get_aval(x) for x in leaves]

        def push(ts):
            o, t, aux = jvp_flat(flat, leaves, ts)
            return (o, aux), _materialize_all(t, o)
        (outs, aux), stacked = _map_basis(push, _std_basis(in_avals), axis=-1)
        _check_float_outputs("jacfwd", fun, outs)
        out_avals = [get_aval(o) for o in outs]
        jac = []
        for s, oa in zip(stacked, out_avals):
            per_in, off = [], 0
            for ia in in_avals:  # (*out_shape, n_in) -> (*out_shape, *in_shape)
                block = ops.slice_axis(s, oa.ndim, off, off + ia.size)
                per_in.append(ops.reshape(block, oa.shape + ia.shape))
                off += ia.size
            jac.append(_unflatten_args(in_tree, per_in, single))
        jac = tree_unflatten(store["out_tree"], jac)
        return (jac, aux) if has_aux else jac
    return _user_frames(functools.wraps(fun)(jacfun))


def hessian(fun: Callable, argnums=0, has_aux: bool = False) -> Callable:
    """The Hessian of a scalar function: jacfwd(jacrev(f)) (forward over reverse)."""
    return jacfwd(jacrev(fun, argnums, has_aux), argnums, has_aux)


# ---- user-defined derivatives and gradient barriers ----------------------------------------

class _Custom:
    """What custom_vjp and custom_jvp share: the arguments split into differentiable leaves and
    the nondiff_argnums (static Python values, passed to the rule first, as in JAX)."""

    def __init__(self, fun: Callable, nondiff_argnums=()):
        functools.update_wrapper(self, fun)
        self.fun, self.nondiff_argnums = fun, tuple(nondiff_argnums)

    def _split(self, args, kwargs):
        if kwargs:
            args = inspect.signature(self.fun).bind(*args, **kwargs).args
        static = tuple(args[i] for i in self.nondiff_argnums)
        dyn = tuple(a for i, a in enumerate(args) if i not in self.nondiff_argnums)
        leaves, in_tree = tree_flatten(dyn)

        def full_args(xs) -> list:
            it, st = iter(tree_unflatten(in_tree, xs)), iter(static)
            return [next(st) if i in self.nondiff_argnums else next(it) for i in range(len(args))]
        return static, dyn, leaves, in_tree, full_args

    def _flat_fun(self, full_args, store) -> Callable:
        def fun_flat(*xs):
            out_leaves, store["out_tree"] = tree_flatten(self.fun(*full_args(xs)))
            return out_leaves
        fun_flat.__name__ = _fname(self.fun)
        return fun_flat


class custom_vjp(_Custom):
    """A function with a user-supplied reverse-mode derivative (JAX's API):

        f = custom_vjp(f)    # or custom_vjp(f, nondiff_argnums=(1,))
        f.defvjp(fwd, bwd)   # fwd(*args) -> (out, residuals); bwd(*nondiff_args, residuals, ct)
                             # -> tuple of one cotangent per other argument (None: no gradient)

    Reverse mode (grad, vjp, jacrev) uses fwd/bwd in every composition: jit keeps the function
    whole in its graph with the rule beside it, and vmap batches the function and the rule, so
    grad(jit(f)), vmap(grad(f)) and grad(vmap(f)) use the rule too. Forward mode and plain calls
    run f itself."""

    def __init__(self, fun: Callable, nondiff_argnums=()):
        super().__init__(fun, nondiff_argnums)
        self.fwd, self.bwd = None, None

    def defvjp(self, fwd: Callable, bwd: Callable) -> "custom_vjp":
        self.fwd, self.bwd = fwd, bwd
        return self

    @_user_frames
    def __call__(self, *args, **kwargs):
        name = _fname(self.fun)
        if self.fwd is None:
            raise _error(f"custom_vjp: {name} has no VJP yet; call {name}.defvjp(fwd, bwd)")
        static, dyn, leaves, in_tree, full_args = self._split(args, kwargs)
        arg_trees = [tree_flatten(a)[1] for a in dyn]
        store: dict = {}

        def fwd_flat(*xs):
            r = self.fwd(*full_args(xs))
            if not (isinstance(r, (tuple, list)) and len(r) == 2):
                raise _error(f"custom_vjp: the fwd of {name} must return a pair (output, "
                             f"residuals), got a {type(r).__name__}")
            out_leaves, store["out_tree"] = tree_flatten(r[0])
            return out_leaves, r[1]

        def bwd_flat(residuals, cts):
            r = self.bwd(*static, residuals, tree_unflatten(store["out_tree"], cts))
            if not isinstance(r, (tuple, list)) or len(r) != len(dyn):
                raise _error(f"custom_vjp: the bwd of {name} must return a tuple with one "
                             f"cotangent per argument ({len(dyn)} differentiable), got {type(r).__name__}"
                             f"{' of ' + str(len(r)) if isinstance(r, (tuple, list)) else ''}")
            flat = []
            for i, (c, td) in enumerate(zip(r, arg_trees)):
                if c is None:
                    flat += [None] * td.n_leaves
                    continue
                c_leaves, c_tree = tree_flatten(c)
                if c_tree != td:
                    raise _error(f"custom_vjp: the bwd of {name} returned a cotangent for "
                                 f"argument {i} with structure {c_tree}, expected {td}")
                flat += c_leaves
            for k, (c, x) in enumerate(zip(flat, leaves)):
                if c is not None and get_aval(c).shape != get_aval(x).shape:
                    raise _error(f"custom_vjp: the bwd of {name} returned a cotangent of shape "
                                 f"{get_aval(c).shape} for an input of shape {get_aval(x).shape}")
            return flat

        outs = bind_custom_vjp(self._flat_fun(full_args, store), fwd_flat, bwd_flat, *leaves,
                               out_tree_thunk=lambda: store["out_tree"])
        return tree_unflatten(store["out_tree"], outs)


class custom_jvp(_Custom):
    """A function with a user-supplied forward-mode derivative (JAX's API):

        f = custom_jvp(f)           # or custom_jvp(f, nondiff_argnums=(1,))
        @f.defjvp
        def f_jvp(primals, tangents):   # (*nondiff_args, primals, tangents) with nondiff_argnums
            x, = primals; t, = tangents
            return f(x), tangent_out

    or f.defjvps(lambda t, out, *primals: ..., ...), one tangent function per argument. Forward
    mode (jvp, jacfwd) uses the rule; reverse mode (grad, vjp) transposes it, which needs the
    tangent output linear in the tangents, as JAX requires. jit keeps the function whole with its
    rule and vmap batches both, so every composition uses it; plain calls run f."""

    def __init__(self, fun: Callable, nondiff_argnums=()):
        super().__init__(fun, nondiff_argnums)
        self.jvp = None

    def defjvp(self, jvp: Callable) -> Callable:
        self.jvp = jvp
        return jvp

    def defjvps(self, *tangent_fns) -> None:
        """One function per argument, t_out_i = fn_i(tangent_i, primal_out, *primals) (None: no
        dependence); the output tangent is their sum."""
        def jvp(primals, tangents):
            out = self.fun(*primals)
            total = None
            for fn, t in zip(tangent_fns, tangents, strict=True):
                if fn is not None:
                    c = fn(t, out, *primals)
                    total = c if total is None else tree_map(ops.add, total, c)
            return out, total if total is not None else tree_map(lambda o: ops.zeros(get_aval(o)), out)
        self.jvp = jvp

    @_user_frames
    def __call__(self, *args, **kwargs):
        name = _fname(self.fun)
        if self.jvp is None:
            raise _error(f"custom_jvp: {name} has no JVP yet; decorate one with @{name}.defjvp")
        static, dyn, leaves, in_tree, full_args = self._split(args, kwargs)
        store: dict = {}

        def jvp_flat(primals, tangents):
            r = self.jvp(*static, tuple(tree_unflatten(in_tree, primals)),
                         tuple(tree_unflatten(in_tree, tangents)))
            if not (isinstance(r, (tuple, list)) and len(r) == 2):
                raise _error(f"custom_jvp: the JVP of {name} must return a pair (primal output, "
                             f"tangent output), got a {type(r).__name__}")
            out_leaves, store["out_tree"] = tree_flatten(r[0])
            t_leaves, t_tree = tree_flatten(r[1])
            if t_tree != store["out_tree"]:
                raise _error(f"custom_jvp: the JVP of {name} returned a tangent output of structure "
                             f"{t_tree} for a primal output of structure {store['out_tree']}")
            for o, t in zip(out_leaves, t_leaves):
                if get_aval(t).shape != get_aval(o).shape:
                    raise _error(f"custom_jvp: the JVP of {name} returned a tangent of shape "
                                 f"{get_aval(t).shape} for an output of shape {get_aval(o).shape}")
            return out_leaves, [ops.convert(t, get_aval(o).dtype) for o, t in zip(out_leaves, t_leaves)]

        outs = bind_custom_jvp(self._flat_fun(full_args, store), jvp_flat, *leaves)
        return tree_unflatten(store["out_tree"], outs)


def stop_gradient(x: Any) -> Any:
    """x unchanged, but no derivative flows through it (a pytree of arrays welcome)."""
    def leaf(v):
        if is_array_like(v) and dtypes.is_float(get_aval(v).dtype):
            return bind1(P.stop_gradient, v)
        return v
    return tree_map(leaf, x)


__all__ = ["custom_jvp", "custom_vjp", "grad", "hessian", "jacfwd", "jacrev", "jvp",
           "stop_gradient", "value_and_grad", "vjp"]
