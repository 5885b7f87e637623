"""Declarations of the OpenCL C builtins a kernel calls, so that PoCL can build it without
parsing Clang's opencl-c.h.

PoCL spends most of a small program's build (about 120 of 135 ms on a trivial kernel) having
Clang parse opencl-c.h's 18,000 lines of builtin declarations; the types and macros come from
opencl-c-base.h, which it reads anyway. Its own header skips opencl-c.h where `_OPENCL_H_` is
defined, so the backend builds with that macro and these declarations in front of the source:
the overloads of exactly the builtins the source calls, spelt as opencl-c.h spells them (the
same mangled names, so the same kernel-library functions are linked). A builtin missing here
fails the build with an implicit declaration, and the program is built again the usual way
(backends/opencl/build.py counts those, and the suite fails on any)."""
from __future__ import annotations

import re

INTS = ("char", "uchar", "short", "ushort", "int", "uint", "long", "ulong")
FLOATS = ("float", "double")
WIDTHS = ("", "2", "3", "4", "8", "16")
SPACES = ("__global", "__local", "__private")
_SIGNED = {"char": "char", "uchar": "char", "short": "short", "ushort": "short", "int": "int", "uint": "int",
           "long": "long", "ulong": "long", "float": "int", "double": "long"}  # same-sized integers
_UNSIGNED = {"char": "uchar", "uchar": "uchar", "short": "ushort", "ushort": "ushort", "int": "uint",
             "uint": "uint", "long": "ulong", "ulong": "ulong", "float": "uint", "double": "ulong"}

OV, CONST, PURE = "__attribute__((overloadable))", "__attribute__((overloadable, const))", \
    "__attribute__((overloadable, pure))"
FLOAT_UNARY = {"exp", "log", "log1p", "expm1", "tanh", "sqrt", "rsqrt", "sin", "cos", "erf", "floor", "ceil",
               "rint", "fabs", "round", "trunc", "exp2", "log2", "tan", "atan", "asin", "acos", "sinh", "cosh",
               "cbrt", "lgamma", "tgamma", "erfc", "sign"}
FLOAT_BINARY = {"pow", "fmod", "atan2", "fmax", "fmin", "copysign", "hypot"}
WORK_ITEM = {"get_global_id", "get_local_id", "get_group_id", "get_num_groups", "get_local_size",
             "get_global_size", "get_global_offset"}
_CONVERT = re.compile(r"convert_(%s)(2|3|4|8|16)?(_sat)?(_rte|_rtz|_rtp|_rtn)?$" % "|".join(INTS + FLOATS))
_VLOAD = re.compile(r"(vload|vstore)(2|3|4|8|16)$")
_HALF = re.compile(r"(vload|vstore)_half(2|3|4|8|16)?(_rte|_rtz|_rtp|_rtn)?$")


def _decls(name: str, fp64: bool) -> list[str]:
    floats = FLOATS if fp64 else FLOATS[:1]
    gen = [(t, t + w) for t in INTS + floats for w in WIDTHS]
    if name in FLOAT_UNARY:
        return [f"{t}{w} {CONST} {name}({t}{w});" for t in floats for w in WIDTHS]
    if name in FLOAT_BINARY:
        return [f"{t}{w} {CONST} {name}({t}{w}, {t}{w});" for t in floats for w in WIDTHS]
    if name == "fma":
        return [f"{t}{w} {CONST} fma({t}{w}, {t}{w}, {t}{w});" for t in floats for w in WIDTHS]
    if name in ("min", "max"):
        return [f"{v} {CONST} {name}({v}, {v});" for _, v in gen] + \
               [f"{v} {CONST} {name}({v}, {t});" for t, v in gen if v != t]
    if name == "abs":
        return [f"{_UNSIGNED[t]}{v[len(t):]} {CONST} abs({v});" for t, v in gen if t in INTS]
    if name in ("isnan", "isfinite", "isinf", "signbit"):
        return [f"{'int' if v == t else _SIGNED[t] + v[len(t):]} {CONST} {name}({v});"
                for t, v in gen if t in floats]
    if name == "select":
        return [f"{v} {CONST} select({v}, {v}, {m[t]}{v[len(t):]});" for t, v in gen for m in (_SIGNED, _UNSIGNED)]
    if name in WORK_ITEM:
        return [f"size_t {CONST} {name}(uint);"]
    if name == "barrier":
        return ["void __attribute__((overloadable, convergent)) barrier(cl_mem_fence_flags);"]
    if name in ("atomic_add", "atomic_cmpxchg", "atom_add", "atom_cmpxchg"):
        extra = ", {t} cmp" if "cmpxchg" in name else ""
        return [f"{t} {OV} {name}(volatile {s} {t}*{extra.format(t=t)}, {t});"
                for t in (("int", "uint") + (("long", "ulong") if name.startswith("atom_") else ()))
                for s in SPACES[:2]]
    m = _CONVERT.match(name)
    if m and not (m.group(3) and m.group(1) in FLOATS):  # (saturation is to integers only)
        w = m.group(2) or ""
        return [f"{m.group(1)}{w} {CONST} {name}({t}{w});" for t in INTS + floats]
    m = _VLOAD.match(name)
    if m:
        w = m.group(2)
        if m.group(1) == "vload":
            return [f"{t}{w} {PURE} {name}(size_t, const {s} {t}*);" for t in INTS + floats
                    for s in SPACES + ("__constant",)]
        return [f"void {OV} {name}({t}{w}, size_t, {s} {t}*);" for t in INTS + floats for s in SPACES]
    m = _HALF.match(name)
    if m:
        w = m.group(2) or ""
        if m.group(1) == "vload":
            return [f"float{w} {PURE} {name}(size_t, const {s} half*);" for s in SPACES + ("__constant",)]
        return [f"void {OV} {name}({t}{w}, size_t, {s} half*);" for t in floats for s in SPACES]
    return []


def with_declarations(source: str) -> str:
    """The source after the declarations of every builtin it calls (double's overloads where it
    enables cl_khr_fp64: in a program of several kernels, any of them may)."""
    fp64 = "cl_khr_fp64" in source
    names = sorted(set(re.findall(r"\b([a-z_][a-z0-9_]*)\s*\(", source)))
    decls = [d for n in names for d in _decls(n, fp64)]
    head = ["#pragma OPENCL EXTENSION cl_khr_fp64 : enable"] if fp64 else []
    return "\n".join(head + decls + [source])
