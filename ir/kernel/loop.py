"""A scan's step as a loop inside one tile kernel: each work-item owns one point of the carry,
keeps it in registers and runs every step itself, so the loop costs one launch, not one per step.

The step is given as its lowered kernels (`Part`s, in launch order), each buffer named by its role
in the scan: ("const", j), ("carry", j), ("x", j) (row t of xs), ("temp", key) (a value one part
passes to a later one), and for outputs a tuple of roles ("carry", j) (the next carry), ("y", j)
(row t of ys), ("temp", key). Legal when no part reduces or adds, at most one part (the main one)
runs over more than one point, and a point never needs another point's carry:
  - a carry of one element (uniform: a fori_loop's counter), and every temp, is one element
    computed by a one-point part; every work-item computes it in its own register;
  - any other carry has the main part's size, is written by it once at an offset that maps its
    points one-to-one onto the carry, and is read only there (the same offset node), by it.
Otherwise `loop_kernel` returns None and the caller launches the step's kernels per step.

The tile kernel's buffers: consts, initial carries, xs (inputs), then final carries, ys."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ir import INDEX, Buffer, KExpr, Kernel, affine_forms, binary, cast, const
from .schedule import divmod_index, substitute
from .tile import Alloc, If, Range, Store, TileKernel, tload, var


@dataclass(frozen=True)
class Part:
    """One kernel of the step and the scan role of each of its buffers."""
    kernel: Kernel
    ins: tuple   # per input buffer: a role
    outs: tuple  # per output buffer: a tuple of roles


def _ic(v: int) -> KExpr:
    return const(int(v), INDEX)


def _bijective(off: KExpr, shape) -> bool:
    """Whether the offset maps the points of `shape` one-to-one onto 0 .. size-1."""
    form = affine_forms([off]).get(off)
    if form is None or form.get("c", 0) != 0 or any(k != "c" and k[0] != "idx" for k in form):
        return False
    axes = sorted((form.get(("idx", a), 0), n) for a, n in enumerate(shape) if n > 1)
    span = 1
    for coeff, n in axes:
        if coeff != span:
            return False
        span *= n
    return True


def _loads(roots) -> list:
    seen, out = set(), []
    for r in roots:
        for n in r.toposort():
            if n.op == "load" and n not in seen:
                seen.add(n)
                out.append(n)
    return out


def loop_kernel(name: str, parts: list, consts: list, carries: list, xs: list, ys: list,
                length: int, reverse: bool, group: int = 1) -> TileKernel | None:
    """The tile kernel running all `length` steps (see the module docstring), or None where the
    step is not of that shape. consts, carries, xs, ys: the scan's buffers (xs and ys whole,
    length rows); group: work-items per work-group (1 on a CPU)."""
    if length < 1 or not parts:
        return None
    if any(p.kernel.has_reduce or any(s.mode != "set" for s in p.kernel.stores) for p in parts):
        return None
    big = [p for p in parts if p.kernel.size > 1]
    if len(big) > 1:
        return None
    main = big[0] if big else None
    shape = tuple(main.kernel.shape) if main else ()
    N = main.kernel.size if main else 1
    uniform = [c.size == 1 for c in carries]
    # each carry written exactly once; a point's carry at the offset of its store
    own: dict = {}
    written = [0] * len(carries)
    for p in parts:
        k = p.kernel
        for st in k.stores:
            for role in p.outs[st.buffer - k.n_inputs]:
                if role[0] == "carry":
                    j = role[1]
                    written[j] += 1
                    if not uniform[j]:
                        if p is not main or carries[j].size != N or not _bijective(st.offset, shape):
                            return None
                        own[j] = st.offset
                    elif k.size != 1:
                        return None
                elif role[0] == "temp" and k.size != 1:
                    return None
    if any(w != 1 for w in written):
        return None

    nk, nc, nx = len(consts), len(carries), len(xs)
    x_at, X_at, ys_at = nk + nc, nk + nc + nx, nk + 2 * nc + nx
    rows = [x.size // length for x in xs]
    yrows = [y.size // length for y in ys]
    t = var("t")
    trow = binary("sub", _ic(length - 1), t) if reverse else t
    g, lane = var("g"), var("l")
    G = max(1, min(int(group), N))
    u = binary("add", binary("mul", g, _ic(G)), lane) if G > 1 else g
    I = divmod_index(u, shape)
    temps: dict = {}  # temp key -> its register's name and dtype

    def point_env(k: Kernel, at: list) -> dict:
        return {KExpr("idx", INDEX, (), a): (at[a] if k.size > 1 else _ic(0)) for a in range(len(k.shape))}

    def step(p: Part) -> list | None:
        k = p.kernel
        roots = [e for st in k.stores for e in (st.offset, st.value)]
        env = point_env(k, I)
        loads = _loads(roots)
        offs = substitute([ld.src[0] for ld in loads], env) if loads else {}
        for ld in loads:
            b = ld.arg
            if b >= k.n_inputs:
                return None  # a part reading an output
            role = p.ins[b]
            off = offs[ld.src[0]]
            if role[0] == "const":
                env[ld] = tload(role[1], off, ld.dtype)
            elif role[0] == "x":
                env[ld] = tload(x_at + role[1], binary("add", binary("mul", trow, _ic(rows[role[1]])), off), ld.dtype)
            elif role[0] == "carry":
                j = role[1]
                if not uniform[j] and (p is not main or ld.src[0] != own.get(j)):
                    return None  # another point's carry
                env[ld] = tload(f"c{j}", _ic(0), ld.dtype)
            elif role[0] == "temp":
                if role[1] not in temps:
                    return None
                env[ld] = tload(temps[role[1]][0], _ic(0), ld.dtype)
            else:
                return None
        new = substitute(roots, env)
        out = []
        for st in k.stores:
            d = np.dtype(k.buffers[st.buffer].dtype)
            val = cast(new[st.value], d)
            for role in p.outs[st.buffer - k.n_inputs]:
                if role[0] == "carry":
                    out.append(Store(f"n{role[1]}", _ic(0), val))
                elif role[0] == "y":
                    j = role[1]
                    out.append(Store(ys_at + j, binary("add", binary("mul", trow, _ic(yrows[j])),
                                                       new[st.offset]), val))
                elif role[0] == "temp":
                    reg = temps.setdefault(role[1], (f"v{len(temps)}", d))[0]
                    out.append(Store(reg, _ic(0), val))
                else:
                    return None
        return out

    body: list = []
    for p in parts:
        got = step(p)
        if got is None:
            return None
        body += got
    body += [Store(f"c{j}", _ic(0), tload(f"n{j}", _ic(0), c.dtype)) for j, c in enumerate(carries)]

    def at(j: int) -> KExpr:
        return _ic(0) if uniform[j] else substitute([own[j]], point_env(main.kernel, I))[own[j]]
    first = binary("eq", u, _ic(0))
    stmts: list = [Alloc(f"{r}{j}", np.dtype(c.dtype), 1, "register") for j, c in enumerate(carries) for r in "cn"]
    stmts += [Alloc(reg, d, 1, "register") for reg, d in temps.values()]
    stmts += [Store(f"c{j}", _ic(0), tload(nk + j, at(j), c.dtype)) for j, c in enumerate(carries)]
    stmts.append(Range("t", int(length), "serial", tuple(body)))
    final = [Store(X_at + j, at(j), tload(f"c{j}", _ic(0), c.dtype)) for j, c in enumerate(carries)]
    stmts += [s for j, s in enumerate(final) if not uniform[j]]
    if any(uniform) and N > 1:  # one work-item writes the carries every work-item holds
        stmts.append(If(first, tuple(s for j, s in enumerate(final) if uniform[j])))
    else:
        stmts += [s for j, s in enumerate(final) if uniform[j]]
    inner = tuple(stmts)
    if G > 1:
        inner = (If(binary("lt", u, _ic(N)), inner),)
        tree = (Range("g", -(-N // G), "grid", (Range("l", G, "lane", inner),)),)
    else:
        tree = (Range("g", N, "grid", inner),)
    buffers = (*consts, *carries, *xs, *[Buffer(f"{c.name}_out", c.dtype, c.size) for c in carries], *ys)
    return TileKernel(name, tuple(buffers), nk + nc + nx, tree, meta={"loop": length})


__all__ = ["Part", "loop_kernel"]
