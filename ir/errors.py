"""The one error hierarchy every layer raises; it lives at the bottom so all can import it."""
from __future__ import annotations

import functools
import linecache
import os
import sys
import sysconfig

_HERE = os.path.dirname(os.path.abspath(__file__))
_PARENT = os.path.dirname(_HERE)
# Installed, our subpackages share one folder `tilefuse/`; in a source checkout they are
# the repository's top-level folders. Frames from these folders are ours, not the user's.
if os.path.basename(_PARENT) == "tilefuse":
    INTERNAL_DIRS = (_PARENT + os.sep,)
else:
    INTERNAL_DIRS = tuple(os.path.join(_PARENT, d) + os.sep for d in
                          ("tilefuse", "ir", "tracer", "autodiff", "backends", "runtime"))
_SKIP_FILES = ("contextlib.py", "functools.py", "<frozen")
# Python's and installed packages' code (numpy's...): an exception raised there belongs to whoever called it
_LIBRARY_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "purelib", "platlib")})


@functools.lru_cache(maxsize=4096)  # asked for every frame of every traced operation
def is_internal(filename: str) -> bool:
    """Whether a code file belongs to tilefuse (or to stdlib glue such as contextlib)."""
    if filename.startswith("<"):
        return filename.startswith("<frozen")
    filename = os.path.abspath(filename)
    return filename.startswith(INTERNAL_DIRS) or filename.endswith(_SKIP_FILES)


# Asked for every traced operation (each equation records its user's line): whether a code
# object is ours, and a line's text, are looked up once (bounded: a notebook makes new code)
_ours: dict = {}
_lines: dict = {}
_MEMO_MOST = 1 << 14


def _user_code_frame(frame):
    """The innermost frame from `frame` outward whose code is not ours, or None."""
    ours = _ours
    while frame is not None:
        code = frame.f_code
        mine = ours.get(code)
        if mine is None:
            if len(ours) > _MEMO_MOST:
                ours.clear()
            # code that we generate (a dataclass's __init__) is named "<string>" but runs in our module
            mine = ours[code] = is_internal(code.co_filename) or \
                frame.f_globals.get("__name__", "").startswith("tilefuse.")
        if not mine:
            return frame
        frame = frame.f_back
    return None


def user_frame() -> tuple[str, int, str] | None:
    """The innermost stack frame outside tilefuse: (file, line, source text)."""
    frame = _user_code_frame(sys._getframe(1))
    if frame is None:
        return None
    fn = frame.f_code.co_filename
    return fn, frame.f_lineno, linecache.getline(fn, frame.f_lineno).strip()


def user_line() -> str:
    """'file:line (source)' of the user's code that is running now, or ''."""
    frame = _user_code_frame(sys._getframe(1))
    if frame is None:
        return ""
    key = (frame.f_code, frame.f_lineno)
    text = _lines.get(key)
    if text is None:
        if len(_lines) > _MEMO_MOST:
            _lines.clear()
        fn = frame.f_code.co_filename
        src = linecache.getline(fn, frame.f_lineno).strip()
        text = _lines[key] = f"{fn}:{frame.f_lineno}" + (f"  `{src}`" if src else "")
    return text


class TilefuseError(Exception):
    """Base of every error tilefuse raises for a user. A message that does not say where yet
    gets the user's line appended ("\n  at file:line  `source`"): the innermost frame outside
    tilefuse when the error is made."""

    def __init__(self, *args):
        if len(args) == 1 and isinstance(args[0], str) and _AT not in args[0]:
            where = user_line()
            if where:
                args = (f"{args[0]}{_AT}{where}",)
        super().__init__(*args)


class ShapeError(TilefuseError, ValueError):
    """Operands whose shapes do not fit the operation."""


class DTypeError(TilefuseError, TypeError):
    """Operands whose dtypes do not fit the operation."""


class UnsupportedDTypeError(DTypeError):
    """A dtype the device cannot hold (float64 on WebGPU, on an OpenCL device without fp64)."""


class OperandShapeError(ShapeError, TypeError):
    """Operands whose shapes cannot meet in an operation where JAX raises TypeError (the shape
    rules of its lax primitives, matmul, reshape, concatenate): catchable as either."""


class ConcretizationError(TilefuseError, TypeError):
    """A Python value was needed from a traced (abstract) value (a TypeError, as JAX's
    TracerBoolConversionError is)."""


class ArgumentError(TilefuseError, TypeError):
    """An argument a function or transformation cannot take: not an array and not static,
    an unhashable static argument, a non-array output."""


class StaticArgumentError(ArgumentError, ValueError):
    """jit's static_argnums or static_argnames name no parameter of the function (a ValueError,
    as in JAX)."""


class TracerLeakError(TilefuseError):
    """A tracer was used after the transformation that created it had finished."""


class CompileError(TilefuseError):
    """A backend failed to compile a kernel; carries the backend and the source."""

    def __init__(self, message: str, *, backend: str = "", kernel: str = "", source: str = ""):
        self.backend, self.kernel, self.source = backend, kernel, source
        full = message
        if kernel:
            full += f"\n--- kernel {kernel} ---"
        if source:
            full += f"\n--- source ({backend}) ---\n{source}"
        super().__init__(full)


class DeviceError(TilefuseError):
    """A device is missing, unavailable or failed at run time."""


class OutOfMemoryError(TilefuseError, MemoryError):
    """A device allocation could not be satisfied."""


class TransformError(TilefuseError):
    """A transformation (grad, vmap, jvp, ...) was asked for something it cannot do."""


_AT = "\n  at "


def with_user_line(msg: str) -> str:
    where = user_line()
    return f"{msg}{_AT}{where}" if where else msg


def without_user_line(e: BaseException) -> str:
    """An error's message without the line it was made at (for reasons kept past that call)."""
    return str(e).split(_AT)[0]


def for_user(e: BaseException) -> BaseException:
    """What an API boundary (jit, grad, vmap, tile_op) re-raises: the exception with our internal
    frames dropped from its traceback where it is the user's to read, as JAX filters its frames:
    a tilefuse error (the exception it was raised from hidden too), or one their own code raised
    inside a transformation (a TypeError in the traced function: its innermost frame is theirs).
    An exception raised inside tilefuse is a bug: its traceback stays whole."""
    if isinstance(e, TilefuseError):
        e.__suppress_context__ = True
    else:  # whose code raised it: the innermost frame that is neither a library's nor Python's
        raised_in = None
        tb = e.__traceback__
        while tb is not None:
            name = tb.tb_frame.f_code.co_filename
            if is_internal(name) or not name.startswith(_LIBRARY_DIRS):
                raised_in = name
            tb = tb.tb_next
        if raised_in is None or is_internal(raised_in):
            return e
    return e.with_traceback(filter_traceback(e.__traceback__))


def filter_traceback(tb):
    """Drop our internal frames from a traceback so users see their own lines."""
    frames = []
    while tb is not None:
        if not is_internal(tb.tb_frame.f_code.co_filename):
            frames.append(tb)
        tb = tb.tb_next
    if not frames:
        return None
    for a, b in zip(frames, frames[1:] + [None]):
        a.tb_next = b
    return frames[0]


class NaNError(TilefuseError, FloatingPointError):
    """debug_nans found a NaN; names the equation and the user's line that produced it."""


__all__ = [n for n in dir() if n.endswith("Error")] + ["user_line", "user_frame", "with_user_line",
                                                      "without_user_line", "filter_traceback", "for_user"]
