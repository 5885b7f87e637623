"""tile_op: a new operator written once, in Python over tensors with named dimensions, and
compiled by every backend.

    @tx.tile_op
    def rms_norm(x: tx.Tensor["M", "N"], w: tx.Tensor["N"], eps: float = 1e-6) -> tx.Tensor["M", "N"]:
        return x * tnp.rsqrt(tnp.mean(x * x, axis=-1, keepdims=True) + eps) * w

Each call checks the arguments' shapes against the names (and fixed sizes, dtypes) across all
arguments, traces the body once per shape signature and binds it as one `tile_op` primitive
(ir.primitives.tile_call) holding the body's graph: the surrounding graph sees one unit. The
compiler inlines the body before fusion (ir/passes/inline.py), so an elementwise-plus-reduction
body compiles to the same fused kernels as the code written inline.

Arguments annotated `Tensor[...]` are the operator's arrays; the others are static (hashable,
part of the trace key), and `tunable` names parameters whose values the auto-tuner may choose.
Reverse mode differentiates the body unless `@op.defvjp` gives a VJP; vmap batches the body into
a new tile_op. A body of only `pass` or `...` with a recognised signature (matmul, batched
matmul, attention, softmax, layer norm) binds the library's implementation of that operator."""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from tilefuse import nn
from tilefuse import numpy as tnp
from tilefuse.autodiff.jvp import jvp_flat
from tilefuse.autodiff.rules import jvp_rules, vjp_rules
from tilefuse.autodiff.vjp import vjp_flat
from tilefuse.ir import primitives as P
from tilefuse.ir.core import Graph, ShapedArray, eval_graph
from tilefuse.ir.errors import (ArgumentError, DTypeError, ShapeError, TilefuseError, TransformError,
                                for_user, with_user_line)
from tilefuse.tracer.core import Tracer, bind, bind1, get_aval, is_array_like
from tilefuse.tracer.staging import closed_graph
from tilefuse.tracer.vmap import batch_rules, vmap

__all__ = ["Tensor", "TensorSpec", "TileOp", "tile_op"]


# ---- annotations --------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    """What `Tensor[...]` makes: dimension names (str), fixed sizes (int), an optional leading
    `...` (batch dimensions shared by every argument that has one) and an optional dtype."""
    dims: tuple
    dtype: np.dtype | None = None

    def __repr__(self):
        parts = ["..." if d is Ellipsis else repr(d) for d in self.dims]
        if self.dtype is not None:
            parts.append(self.dtype.name)
        return f"Tensor[{', '.join(parts)}]"


class Tensor:
    """The annotation of a tile_op's array parameters: Tensor["M", "K"], Tensor["M", 64, float16],
    Tensor[..., "N"]."""

    def __class_getitem__(cls, item) -> TensorSpec:
        items = item if isinstance(item, tuple) else (item,)
        dims, dtype = [], None
        for i, it in enumerate(items):
            if isinstance(it, str) or (isinstance(it, int) and not isinstance(it, bool)):
                dims.append(it)
            elif it is Ellipsis:
                if i != 0:
                    raise ArgumentError(f"Tensor{list(items)}: `...` may only come first")
                dims.append(it)
            elif i == len(items) - 1 and _as_dtype(it) is not None:
                dtype = _as_dtype(it)
            else:
                raise ArgumentError(f"Tensor{list(items)}: entries are dimension names (str), fixed "
                                    f"sizes (int), a leading ... and a final dtype; got {it!r}")
        return TensorSpec(tuple(dims), dtype)


def _as_dtype(x) -> np.dtype | None:
    try:
        return np.dtype(x)
    except TypeError:
        return None


def _unify(op: str, bound: dict, name, size, arg: str, shape) -> None:
    seen = bound.setdefault(name, (size, arg, shape))
    if seen[0] != size:
        what = "the batch dimensions ..." if name is Ellipsis else f"dimension {name!r}"
        raise ShapeError(with_user_line(
            f"{op}: {what} is {seen[0]} in argument {seen[1]!r} (shape {seen[2]}) but {size} in "
            f"argument {arg!r} (shape {shape})"))


def _check_spec(op: str, spec: TensorSpec, aval: ShapedArray, arg: str, bound: dict) -> None:
    """Check one array against its annotation, binding each name to its size on first sight."""
    shape, dims = tuple(aval.shape), spec.dims
    named = dims[1:] if dims[:1] == (Ellipsis,) else dims
    if len(shape) < len(named) or (len(named) == len(dims) and len(shape) != len(dims)):
        raise ShapeError(with_user_line(
            f"{op}: argument {arg!r} has shape {shape} but is annotated {spec} "
            f"({'at least ' if named is not dims else ''}{len(named)} dimensions)"))
    lead = len(shape) - len(named)
    if named is not dims:
        _unify(op, bound, Ellipsis, shape[:lead], arg, shape)
    for d, n in zip(named, shape[lead:]):
        if isinstance(d, int) and d != n:
            raise ShapeError(with_user_line(
                f"{op}: argument {arg!r} has shape {shape}, but {spec} fixes that dimension to {d}"))
        if isinstance(d, str):
            _unify(op, bound, d, n, arg, shape)
    if spec.dtype is not None and aval.dtype != spec.dtype:
        raise DTypeError(with_user_line(
            f"{op}: argument {arg!r} has dtype {aval.dtype} but is annotated {spec}"))


# ---- empty bodies: the library's own operators ----------------------------------------------

def _is_empty_body(fun) -> bool:
    """Whether fun's body is only `pass` or `...` (after an optional docstring)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fun)))
    except (OSError, TypeError, SyntaxError):
        return False
    fn = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)), None)
    if fn is None:
        return False
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return all(isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                           and s.value.value is Ellipsis) for s in body)


def _attention(q, k, v, **kw):
    # nn's layout is (..., seq, heads, head_dim); the form's is (B, H, S, D)
    out = nn.dot_product_attention(*(tnp.swapaxes(a, 1, 2) for a in (q, k, v)), **kw)
    return tnp.swapaxes(out, 1, 2)


def _layer_norm(x, scale=None, bias=None, **kw):
    return nn.layer_norm({"scale": scale, "bias": bias}, x, **kw)


@dataclass(frozen=True)
class _Form:
    """A recognised operator: argument and result patterns ("*" is a shared batch prefix), the
    words its function name must contain (None: any name), and the implementation."""
    name: str
    text: str
    words: tuple | None
    args: tuple
    result: tuple
    impl: Callable


FORMS = (
    _Form("matmul", "(M, K), (K, N) -> (M, N)", None, (("m", "k"), ("k", "n")), ("m", "n"), tnp.matmul),
    _Form("batched matmul", "(B, M, K), (B, K, N) -> (B, M, N), any batch dims or ...", None,
          (("*", "m", "k"), ("*", "k", "n")), ("*", "m", "n"), tnp.matmul),
    _Form("attention", "q (B, H, S, D), k (B, H, T, D), v (B, H, T, E) -> (B, H, S, E)", None,
          (("b", "h", "s", "d"), ("b", "h", "t", "d"), ("b", "h", "t", "e")), ("b", "h", "s", "e"),
          _attention),
    _Form("softmax", "(..., N) -> (..., N), in a function named *softmax*", ("softmax",),
          (("*", "n"),), ("*", "n"), nn.softmax),
    _Form("layer norm", "(..., N) [, scale (N), bias (N)] -> (..., N), in a function named "
          "*layer_norm* or *layernorm*", ("layer_norm", "layernorm"),
          (("*", "n"),), ("*", "n"), _layer_norm),
    _Form("layer norm", "", ("layer_norm", "layernorm"),
          (("*", "n"), ("n",), ("n",)), ("*", "n"), _layer_norm),
)


def _matches(form: _Form, fname: str, arg_dims: list, result_dims) -> bool:
    if form.words is not None and not any(w in fname.lower() for w in form.words):
        return False
    if len(arg_dims) != len(form.args):
        return False
    env: dict = {}
    for pat, dims in zip((*form.args, form.result), (*arg_dims, result_dims)):
        if pat[0] == "*":
            pat = pat[1:]
            if len(dims) < len(pat) or env.setdefault("*", dims[:len(dims) - len(pat)]) != \
                    dims[:len(dims) - len(pat)]:
                return False
            dims = dims[len(dims) - len(pat):]
        if len(dims) != len(pat) or any(env.setdefault(p, d) != d for p, d in zip(pat, dims)):
            return False
    return True


def _recognise(fname: str, arg_specs: list, result: TensorSpec | None) -> Callable:
    if result is not None:
        for form in FORMS:
            if _matches(form, fname, [s.dims for s in arg_specs], result.dims):
                return form.impl
    sig = ", ".join(str(s.dims) for s in arg_specs) + f" -> {result.dims if result else '(none)'}"
    forms = "\n".join(f"  {f.name}: {f.text}" for f in FORMS if f.text)
    raise ArgumentError(
        f"tile_op {fname}: its body is empty (`pass` or `...`), which binds a library operator, but "
        f"its signature {sig} is none of the recognised forms:\n{forms}\n"
        "Write the body, or annotate the arguments and the result as one of these.")


# ---- the decorator --------------------------------------------------------------------------

@dataclass(frozen=True)
class _UserVJP:
    """A VJP given with @op.defvjp, with the call's static arguments it takes (hashable: it is a
    parameter of the primitive)."""
    fun: Callable
    statics: tuple

    @property
    def __name__(self):
        return self.fun.__name__

    def __call__(self, args, out, ct) -> tuple:
        cts = self.fun(*args, out, ct, **dict(self.statics))
        cts = tuple(cts) if isinstance(cts, (tuple, list)) else (cts,)
        if len(cts) != len(args):
            raise TransformError(with_user_line(
                f"tile_op VJP {self.fun.__name__} returned {len(cts)} cotangents for {len(args)} "
                "array arguments; return one per array argument (None for no gradient)"))
        return cts


class TileOp:
    """A user-defined operator (see the module docstring). `tunable` maps parameter names to
    their candidate values; `config` holds the values used when a call does not pass them."""

    def __init__(self, fun: Callable, tunable: dict | None = None):
        functools.update_wrapper(self, fun)
        self.fun, self.name = fun, fun.__name__
        self._sig = inspect.signature(fun)
        try:
            hints = inspect.get_annotations(fun, eval_str=True)
        except NameError as e:  # string annotations (from __future__) name something out of scope
            raise ArgumentError(f"tile_op {self.name}: its annotations cannot be evaluated ({e}); "
                                "define Tensor[...] names at module level") from None
        self.arrays: list[str] = []
        for p in self._sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
                raise ArgumentError(f"tile_op {self.name}: parameter {p.name!r} is {p.kind.description}; "
                                    "use plain named parameters")
            if isinstance(hints.get(p.name), TensorSpec):
                self.arrays.append(p.name)
        self.specs = {n: hints[n] for n in self.arrays}
        self.result = hints.get("return") if isinstance(hints.get("return"), TensorSpec) else None
        self.tunable = {k: tuple(v) for k, v in (tunable or {}).items()}
        for k, v in self.tunable.items():
            if k not in self._sig.parameters or k in self.specs or not v:
                raise ArgumentError(f"tile_op {self.name}: tunable {k!r} must name a non-array "
                                    "parameter of the function and list at least one value")
        self.config = {k: v[0] for k, v in self.tunable.items()}
        self.body = fun
        if _is_empty_body(fun):
            impl = _recognise(self.name, [self.specs[n] for n in self.arrays], self.result)

            def library_body(**kw):
                arrays = [kw.pop(n) for n in self.arrays]
                return impl(*arrays, **kw)
            self.body = library_body
        self._graphs: dict = {}
        self._vjp: Callable | None = None
        self.trace_count = 0

    def __repr__(self):
        return f"<tile_op {self.name}({', '.join(f'{n}: {self.specs[n]}' for n in self.arrays)})>"

    def configure(self, **values) -> "TileOp":
        """Choose tunable values (each one of its candidates) for the calls that do not pass them."""
        for k, v in values.items():
            if v not in self.tunable.get(k, ()):
                raise ArgumentError(f"tile_op {self.name}: {k}={v!r} is not among its tunable "
                                    f"values {self.tunable.get(k)}")
        self.config.update(values)
        return self

    def defvjp(self, bwd: Callable) -> Callable:
        """Decorator: bwd(*array_args, out, g, **statics it names) -> one cotangent per array
        argument (None: no gradient), used by reverse mode instead of differentiating the body
        (forward mode, jvp, still differentiates the body)."""
        self._vjp = bwd
        self._vjp_takes = frozenset(inspect.signature(bwd).parameters)  # read once, not per call
        return bwd

    # ---- calls ----
    def __call__(self, *args, **kwargs):
        try:
            return self._call(args, kwargs)
        except Exception as e:  # (ours, or the user's code's: what the user sees)
            raise for_user(e)

    def _call(self, args, kwargs):
        try:
            ba = self._sig.bind(*args, **kwargs)
        except TypeError as e:
            raise ArgumentError(f"tile_op {self.name}: {e}") from None
        for k, v in self.config.items():
            ba.arguments.setdefault(k, v)
        ba.apply_defaults()
        arrays = [ba.arguments[n] for n in self.arrays]
        statics = tuple((k, v) for k, v in ba.arguments.items() if k not in self.specs)
        avals = []
        bound: dict = {}
        for n, x in zip(self.arrays, arrays):
            if not is_array_like(x):
                raise ArgumentError(f"tile_op {self.name}: argument {n!r} is a {type(x).__name__}, "
                                    f"not an array (it is annotated {self.specs[n]})")
            avals.append(get_aval(x).strip_weak())
            _check_spec(self.name, self.specs[n], avals[-1], n, bound)
        try:
            key = (tuple(avals), statics)
            hash(key)
        except TypeError:
            raise ArgumentError(f"tile_op {self.name}: its non-array arguments {dict(statics)} must be "
                                "hashable (they are part of the trace key)") from None
        graph, consts = self._graphs.get(key) or self._trace(key, bound)
        bwd = None
        if self._vjp is not None:
            bwd = _UserVJP(self._vjp, tuple((k, v) for k, v in statics if k in self._vjp_takes))
        return bind1(P.tile_call, *consts, *arrays, graph=graph, name=self.name,
                     n_consts=len(consts), bwd=bwd)

    def _trace(self, key, bound: dict):
        avals, statics = key

        def body(*xs):
            out = self.body(**dict(statics), **dict(zip(self.arrays, xs)))
            if not is_array_like(out):
                raise ArgumentError(f"tile_op {self.name} returned a {type(out).__name__}; a tile_op "
                                    "returns one array")
            return [out], None
        graph, consts = closed_graph(body, avals)
        self.trace_count += 1
        if self.result is not None:
            _check_spec(self.name, self.result, graph.out_avals[0], "<result>", dict(bound))
        if not any(isinstance(c, Tracer) for c in consts):  # a closure over an outer trace is not kept
            self._graphs[key] = (graph, consts)
        return graph, consts


def tile_op(fun: Callable | None = None, *, tunable: dict | None = None):
    """Decorator: make `fun` a TileOp (use as @tile_op or @tile_op(tunable={...}))."""
    if fun is None:
        return lambda f: TileOp(f, tunable)
    return TileOp(fun, tunable)


# ---- the primitive's rules: each transforms the body ----------------------------------------

def _run_body(graph: Graph, *xs):
    return eval_graph(graph, xs, lambda e, vals: bind(e.prim, *vals, **e.params))[0]


def _tile_vjp(ct, *primals, out, needs, graph, name, n_consts, bwd):
    if bwd is not None:
        cts = bwd(primals[n_consts:], out, ct)
        return (None,) * n_consts + tuple(c if w else None for c, w in zip(cts, needs[n_consts:]))
    _, pullback, _ = vjp_flat(lambda *xs: ([_run_body(graph, *xs)], None), list(primals))
    return tuple(c if w else None for c, w in zip(pullback([ct]), needs))


def _tile_jvp(tangents, *primals, out, graph, name, n_consts, bwd):
    _, (t,), _ = jvp_flat(lambda *xs: ([_run_body(graph, *xs)], None), list(primals), list(tangents))
    return t


@dataclass(frozen=True)
class _BatchedVJP:
    """A user VJP under vmap: run it per example; an unbatched argument's cotangent is summed."""
    inner: Any
    dims: tuple

    @property
    def __name__(self):
        return self.inner.__name__

    def __call__(self, args, out, ct) -> tuple:
        cts = vmap(lambda *a: self.inner(a[:-2], a[-2], a[-1]), in_axes=(*self.dims, 0, 0))(*args, out, ct)
        return tuple(c if d is not None or c is None else tnp.sum(c, axis=0) for c, d in zip(cts, self.dims))


_batched: dict = {}  # (graph, dims, avals) -> the batched body


def _tile_batch(vals, dims, *, graph, name, n_consts, bwd):
    avals = tuple(get_aval(v).strip_weak() for v in vals)
    key = (graph, tuple(dims), avals)
    hit = _batched.get(key)
    if hit is None:
        batched = vmap(functools.partial(_run_body, graph), in_axes=tuple(dims))
        hit = _batched[key] = closed_graph(lambda *xs: ([batched(*xs)], None), avals)
    bgraph, consts = hit
    out = bind1(P.tile_call, *consts, *vals, graph=bgraph, name=name, n_consts=len(consts) + n_consts,
                bwd=None if bwd is None else _BatchedVJP(bwd, tuple(dims[n_consts:])))
    return [out], [0]


vjp_rules[P.tile_call] = _tile_vjp
jvp_rules[P.tile_call] = _tile_jvp
batch_rules[P.tile_call] = _tile_batch
