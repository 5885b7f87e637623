"""Symbolic sizes: a dimension traced as an expression over symbols, so that one trace of a
function serves every batch size (jit's shape-generic retrace, tracer/jit.py).

A `Dim` carries its value at the trace (the hint) and answers every question Python asks of it
with that value, as a plain int would: `==`, `<`, `bool()`, `int()`, `range(d)`. Each answer is
recorded as a guard in its `ShapeEnv`; the traced graph stands for another value of the symbols
only where every guard gives the same answer there (torch.compile's dynamic shapes guard the same
way). A question answered by the exact value — int(), index(), float(), str(), hash() (a dict
or set lookup that misses compares nothing, so the hash itself is the question) — is a guard
`d == hint`: the trace is then specialised to that size (sound, never reused for another).
Arithmetic with ints and other Dims builds expressions instead, which is what reaches shapes and
parameters (reshape's sizes, a mean's count); instantiate() substitutes the symbols' values into
the traced graph. Nothing here is ever wrong for a size it was not traced at:
either the guards hold there and every decision the trace made is the one a trace at that size
would make, or the graph is not reused."""
from __future__ import annotations

import contextlib
import operator
import threading
import weakref

import numpy as np

_FOLD = {"+": operator.add, "*": operator.mul, "//": operator.floordiv, "%": operator.mod}


class ShapeEnv:
    """One symbolic trace's symbols (their values at the trace) and the guards it recorded."""

    def __init__(self):
        self.hints: list[int] = []
        self.guards: dict = {}  # (op, key_l, key_r) -> (lhs, rhs, answer), deduplicated
        self.specialised: set[int] = set()  # symbols whose exact value some step needed
        self.frozen = False
        self.lock = threading.Lock()  # (holds, beside a recording on another thread)

    @contextlib.contextmanager
    def recording(self):
        """After the trace: a window in which Python runs on the template's Dims again (the
        compiler's front end on its graph) with its questions kept apart from the trace's, in
        the dict it yields (the trace's guards and specialisations are as before afterwards)."""
        with self.lock:
            saved = self.guards, self.specialised, self.frozen
            self.guards, self.specialised, self.frozen = {}, set(), False
            try:
                yield self.guards
            finally:
                self.guards, self.specialised, self.frozen = saved

    def freeze(self) -> None:
        """The trace is over: a Dim of it kept by the program (a size stored in a global, a
        leaked tracer's shape) is from now on the int it was at the trace, as under JAX; only
        the template's expressions still stand for other sizes, and only through evaluate."""
        self.frozen = True

    def all_specialised(self) -> bool:
        return len(self.specialised) == len(self.hints)

    def symbol(self, hint: int) -> "Dim":
        self.hints.append(int(hint))
        return Dim(self, ("s", len(self.hints) - 1), int(hint))

    def guard(self, op: str, lhs, rhs, answer: bool) -> bool:
        if self.frozen:
            return answer
        key, entry = guard_entry(op, lhs, rhs, answer)
        if key[1] == key[2]:  # (an expression against itself answers alike at every size: where
            # the two are one object, a tuple's == never asks, so whether it is recorded would
            # depend on the objects, and a front end made in another process would differ)
            return answer
        if key not in self.guards:
            self.guards[key] = entry
        return answer

    def holds(self, values) -> bool:
        """Whether every guard answers at these symbol values as it did at the trace."""
        with self.lock:
            return guards_hold(self.guards, values)


def recorded(env: ShapeEnv, fn, *args) -> tuple:
    """(fn(*args), the guards it asked of env's symbols): run in env.recording()'s window."""
    with env.recording() as guards:
        out = fn(*args)
    return out, dict(guards)


def guards_hold(guards: dict, values) -> bool:
    """Whether every guard of `guards` (a ShapeEnv's, or a recording's) answers at these symbol
    values as it did when it was asked."""
    try:
        for op, lhs, rhs, answer in guards.values():
            if _COMPARE[op](evaluate(lhs, values), evaluate(rhs, values)) != answer:
                return False
    except ArithmeticError:  # (a guard below one that fails there: a division by zero)
        return False
    return True


# Graphs instantiated from a shape-generic trace, each with a function that gives the compiler's
# front end for it from the template's own (tracer/shape_poly.py), or None: the compiler asks
# here (it knows nothing of traces), a graph that dies leaves.
_front_ends: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def set_front_end(graph, front_end) -> None:
    _front_ends[graph] = front_end


def front_end(graph):
    return _front_ends.get(graph)


# A shape-generic trace's instance at its own sizes (it compiles concretely), each with the same
# kind of function for its template: a tiered build has that front end made beside its compile.
_base_front_ends: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def set_base_front_end(graph, front_end) -> None:
    _base_front_ends[graph] = front_end


def base_front_end(graph):
    return _base_front_ends.get(graph)


_COMPARE = {"==": operator.eq, "<": operator.lt, "<=": operator.le}


def _key(x):
    return x.key if isinstance(x, Dim) else int(x)


def guard_entry(op: str, lhs, rhs, answer: bool) -> tuple:
    """(key, entry) of a guard as a guards dict holds it (ShapeEnv.guard's; a stored front end's
    guards read back; the sizes a lowering twin folds, held to their values)."""
    return (op, _key(lhs), _key(rhs)), (op, lhs, rhs, answer)


class Values(list):
    """Symbol values (by symbol number) with a memo of the Dims evaluated at them: a graph's
    avals share their Dim objects, so each is evaluated once per instantiation."""

    def __init__(self, values):
        super().__init__(values)
        self.memo: dict = {}


def evaluate(x, values) -> int:
    """x (an int or a Dim) at these symbol values (a list, or Values to memoise)."""
    if type(x) is not Dim:
        return x
    k = x.key
    if k[0] == "s":
        return values[k[1]]
    memo = getattr(values, "memo", None)
    if memo is None:
        return _eval_key(k, values)
    v = memo.get(id(x))  # (the Dim is alive: its template holds it)
    if v is None:
        v = memo[id(x)] = _eval_key(k, values)
    return v


def _eval_key(k, values) -> int:
    if isinstance(k, int):
        return k
    if k[0] == "s":
        return values[k[1]]
    if k[0] == "neg":
        return -_eval_key(k[1], values)
    return _FOLD[k[0]](_eval_key(k[1], values), _eval_key(k[2], values))


def _dim_or_int(x):
    """An operand of Dim arithmetic: a Dim, or an int (numpy's too); None for anything else."""
    if isinstance(x, Dim):
        return x
    if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
        return int(x)
    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "iu":
        return int(x)
    return None


class Dim:
    """A traced dimension: an expression over an env's symbols and its value at the trace."""
    __slots__ = ("env", "key", "hint")

    def __init__(self, env: ShapeEnv, key, hint: int):
        self.env, self.key, self.hint = env, key, hint

    @property
    def __class__(self):
        # isinstance(d, int) is True, as for the int it stands for: Python code that branches on
        # it takes the int's branch (a proxy's trick, as unittest.mock's). C code (numpy, range)
        # sees the real type and converts through __index__, which guards.
        return int

    # ---- arithmetic builds expressions ----------------------------------------------------
    def _op(self, op: str, other, reverse=False):
        o = _dim_or_int(other)
        if o is None:
            if isinstance(other, (float, np.floating)):  # a float needs the value: specialise
                v = self._value()
                return _FOLD[op](other, v) if reverse else _FOLD[op](v, other)
            return NotImplemented
        a, b = (o, self) if reverse else (self, o)
        ha, hb = _hint(a), _hint(b)
        if self.env.frozen:  # the int it was at the trace
            return _FOLD[op](ha, hb)
        if op in ("//", "%"):
            if hb == 0:
                raise ZeroDivisionError("integer division or modulo by zero")
            if type(b) is Dim:  # the trace went on because the divisor was not 0
                self.env.guard("==", b, 0, False)
        # identities that hold for every value (x + 0, x * 1, x * 0, x // 1, x % 1)
        const_a, const_b = type(a) is not Dim, type(b) is not Dim  # (one of them is a Dim)
        if op == "+" and (const_b and b == 0 or const_a and a == 0):
            return a if const_b else b
        if op == "*" and (const_b and b in (0, 1) or const_a and a in (0, 1)):
            c, d = (b, a) if const_b else (a, b)
            return d if c == 1 else 0
        if op in ("//", "%") and const_b and b == 1:
            return a if op == "//" else 0
        if op in ("+", "*"):  # commutative: the constant on the right, folded into one there
            if const_a:
                a, b = b, a
            if type(b) is not Dim and a.key[0] == op and type(a.key[2]) is int:
                return Dim(self.env, (op, a.key[1], _FOLD[op](a.key[2], b)), _FOLD[op](ha, hb))
        return Dim(self.env, (op, _key(a), _key(b)), _FOLD[op](ha, hb))

    def __add__(self, o): return self._op("+", o)
    def __radd__(self, o): return self._op("+", o, True)
    def __mul__(self, o): return self._op("*", o)
    def __rmul__(self, o): return self._op("*", o, True)
    def __floordiv__(self, o): return self._op("//", o)
    def __rfloordiv__(self, o): return self._op("//", o, True)
    def __mod__(self, o): return self._op("%", o)
    def __rmod__(self, o): return self._op("%", o, True)

    def __sub__(self, o):
        o = _dim_or_int(o)
        return NotImplemented if o is None else self + (-o)

    def __rsub__(self, o):
        o = _dim_or_int(o)
        return NotImplemented if o is None else o + (-self)

    def __neg__(self):
        if self.env.frozen:
            return -self.hint
        if self.key[0] == "neg":
            return Dim(self.env, self.key[1], -self.hint)
        return Dim(self.env, ("neg", self.key), -self.hint)

    def __pos__(self):
        return self

    def __truediv__(self, o):  # a float: needs the value (a Dim o answers through __rtruediv__)
        return self._value() / o

    def __rtruediv__(self, o):
        return o / self._value()

    def __pow__(self, o):
        return self._value() ** o

    def __rpow__(self, o):
        return o ** self._value()

    def __abs__(self):
        return self if self >= 0 else -self

    def __divmod__(self, o):
        return self // o, self % o

    # ---- questions are answered at the hint and guarded ------------------------------------
    def _compare(self, op: str, other, swap=False):
        o = _dim_or_int(other)
        if o is None:
            if isinstance(other, (float, np.floating)):  # 3 == 3.0, as ints compare: by value
                o = float(other)
                return _COMPARE[op](o, self._value()) if swap else _COMPARE[op](self._value(), o)
            return NotImplemented
        lhs, rhs = (o, self) if swap else (self, o)
        return self.env.guard(op, lhs, rhs, _COMPARE[op](_hint(lhs), _hint(rhs)))

    def __eq__(self, o): return self._compare("==", o)
    def __ne__(self, o):
        r = self._compare("==", o)
        return r if r is NotImplemented else not r
    def __lt__(self, o): return self._compare("<", o)
    def __le__(self, o): return self._compare("<=", o)
    def __gt__(self, o): return self._compare("<", o, True)
    def __ge__(self, o): return self._compare("<=", o, True)

    def __bool__(self):
        return self != 0

    def __hash__(self):
        # a hash is the value's (== answers by the value): a lookup that misses compares nothing,
        # so the hash itself must be guarded
        return hash(self._value())

    def _value(self) -> int:
        """The exact value, with the guard that the trace holds for this value only."""
        self.env.guard("==", self, self.hint, True)
        if self.key[0] == "s":
            self.env.specialised.add(self.key[1])
        return self.hint

    __index__ = __int__ = _value

    def __float__(self):
        return float(self._value())

    def __complex__(self):
        return complex(self._value())

    def __round__(self, n=None):
        return self._value() if n is None else round(self._value(), n)

    def __repr__(self):  # (shapes print as tuples, so in error messages through repr: no guard)
        return str(self.hint)

    def __str__(self):  # a string is a value the program may compare: guarded
        return str(self._value())

    def __format__(self, spec):
        return format(self._value(), spec)

    def _bits(self, other, op, reverse=False):  # by value (a Dim other answers in turn)
        return op(other, self._value()) if reverse else op(self._value(), other)

    def __and__(self, o): return self._bits(o, operator.and_)
    def __rand__(self, o): return self._bits(o, operator.and_, True)
    def __or__(self, o): return self._bits(o, operator.or_)
    def __ror__(self, o): return self._bits(o, operator.or_, True)
    def __xor__(self, o): return self._bits(o, operator.xor)
    def __rxor__(self, o): return self._bits(o, operator.xor, True)
    def __lshift__(self, o): return self._bits(o, operator.lshift)
    def __rlshift__(self, o): return self._bits(o, operator.lshift, True)
    def __rshift__(self, o): return self._bits(o, operator.rshift)
    def __rrshift__(self, o): return self._bits(o, operator.rshift, True)
    def __invert__(self): return ~self._value()
    def __trunc__(self): return self._value()
    def __floor__(self): return self._value()
    def __ceil__(self): return self._value()

    def __getattr__(self, name):  # int's methods and attributes (bit_length, real, ...) by value
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._value(), name)

    def __reduce__(self):  # a traced graph is never pickled symbolic
        raise TypeError("a symbolic dimension cannot be pickled")


def _hint(x) -> int:
    return x.hint if isinstance(x, Dim) else x


def key_json(key):
    """A Dim's key (Dim.key: nested tuples of "s" and a symbol's number, "neg", an operator, ints)
    as JSON holds it (lists)."""
    return [key_json(k) for k in key] if type(key) is tuple else key


def dim_of_key(env: ShapeEnv, key) -> "Dim | int":
    """The expression `key` (key_json's form) over env's symbols, as a Dim whose hint is its value
    at env's hints (an int key, an int). ValueError where key is not such an expression: an
    unknown operator or symbol, a wrong arity (read from a file: nothing in it is trusted)."""
    def parse(k):
        if type(k) is int:
            return k
        if type(k) is list and k:
            op, args = k[0], k[1:]
            if op == "s" and len(args) == 1 and type(args[0]) is int and 0 <= args[0] < len(env.hints):
                return ("s", args[0])
            if op == "neg" and len(args) == 1:
                return ("neg", parse(args[0]))
            if op in _FOLD and len(args) == 2:
                return (op, parse(args[0]), parse(args[1]))
        raise ValueError(f"not a size expression: {k!r}")
    parsed = parse(key)
    if type(parsed) is int:
        return parsed
    try:
        hint = _eval_key(parsed, env.hints)
    except ArithmeticError as e:
        raise ValueError(f"a size expression that does not evaluate: {e}") from None
    return Dim(env, parsed, hint)


def is_symbolic(shape) -> bool:
    return any(type(d) is Dim for d in shape)


def distinct(items) -> list:
    """items without repeats, in order, told apart by ==: where a set would hash them (a Dim's
    hash asks its exact value, specialising the trace), each comparison is a guard instead."""
    out: list = []
    for x in items:
        if not any(x == y for y in out):
            out.append(x)
    return out


_trial = threading.local()  # (per thread: a compile on another one asks its sizes as ever)


@contextlib.contextmanager
def index_hints():
    """A window in which an index constant made of a Dim (kernel.ir.ic) is the Dim's value at the
    trace, unguarded. Only for a trial whose kernel is thrown away (fusion asking whether a union
    of a template's equations lowers as one row kernel: a question of its structure and of
    shapes compared, which stay guarded); a kernel made so would be the trace's sizes' only."""
    saved = getattr(_trial, "hints", False)
    _trial.hints = True
    try:
        yield
    finally:
        _trial.hints = saved


def index_int(v) -> int:
    """int(v) for an index constant: a Dim's hint, unguarded, within index_hints()."""
    if type(v) is Dim and getattr(_trial, "hints", False):
        return v.hint
    return int(v)


class _ByValue:
    """A Dim in a key hashed by its value at the trace without a guard, and compared by ==
    (guarded): a lookup that misses then asks nothing, which suits a table whose misses only
    cost an optimisation (common-subexpression elimination), never a wrong result."""
    __slots__ = ("dim",)

    def __init__(self, dim: "Dim"):
        self.dim = dim

    def __hash__(self):
        return hash(self.dim.hint)

    def __eq__(self, other):
        return self.dim == (other.dim if type(other) is _ByValue else other)


def by_value(x):
    """x with every Dim inside (tuples, lists, slices) a _ByValue: see there."""
    t = type(x)
    if t is Dim:
        return _ByValue(x)
    if t is tuple or t is list:
        return tuple(by_value(v) for v in x)
    if t is slice:
        return ("slice", by_value(x.start), by_value(x.stop), by_value(x.step))
    return x


def concrete(x, values):
    """x with every Dim inside (tuples, lists, dicts, slices) replaced by its value."""
    t = type(x)
    if t is Dim:
        return evaluate(x, values)
    if t is tuple or t is list:
        out = [concrete(v, values) for v in x]
        return out if t is list else tuple(out)
    if t is dict:
        return {k: concrete(v, values) for k, v in x.items()}
    if t is slice:
        return slice(concrete(x.start, values), concrete(x.stop, values), concrete(x.step, values))
    return x


def slice_indices(s: slice, n) -> tuple:
    """slice.indices(n) for a size n that may be a Dim: Python's rule, written with comparisons
    (guarded) and arithmetic, so that x[:t] keeps t symbolic."""
    if type(n) is not Dim and type(s.start) is not Dim and type(s.stop) is not Dim:
        return s.indices(n)
    step = 1 if s.step is None else s.step
    if step == 0:
        raise ValueError("slice step cannot be zero")
    lower, upper = (-1, n - 1) if step < 0 else (0, n)

    def clamp(v, default):
        if v is None:
            return default
        if v < 0:
            v = v + n
            return lower if v < lower else v
        return upper if v > upper else v
    return (clamp(s.start, upper if step < 0 else lower), clamp(s.stop, lower if step < 0 else upper),
            step)

