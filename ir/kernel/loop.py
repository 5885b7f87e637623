"""A scan's step as a loop inside one tile kernel: each work-item owns one point of the carry,
keeps it in registers and runs every step itself, so the loop costs one launch, not one per step.

The step is given as its lowered kernels (`Part`s, in launch order), each buffer named by its role
in the scan: ("const", j), ("carry", j), ("x", j) (row t of xs), ("temp", key) (a value one part
passes to a later one), and for outputs a tuple of roles ("carry", j) (the next carry), ("y", j)
(row t of ys), ("temp", key). Legal when no part reduces or adds, the parts over more than one point
(the main ones) run over one index space, and a point never needs another point's carry:
  - a carry of one element (uniform: a fori_loop's counter), and every temp, is one element
    computed by a one-point part; every work-item computes it in its own register;
  - any other carry has the main parts' size, is written by one of them once at an offset that
    maps its points one-to-one onto the carry, and is read only there (the same offset node).
Otherwise `loop_kernel` returns None and the caller launches the step's kernels per step.

The tile kernel's buffers: consts, initial carries, xs (inputs), then final carries, ys."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ir import INDEX, Buffer, KExpr, Kernel, affine_forms, binary, cast, ic
from .schedule import divmod_index, substitute
from .tile import Alloc, If, Range, Store, TileKernel, broadcast, lanes_of, tload, var, vload


@dataclass(frozen=True)
class Part:
    """One kernel of the step and the scan role of each of its buffers."""
    kernel: Kernel
    ins: tuple   # per input buffer: a role
    outs: tuple  # per output buffer: a tuple of roles



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
                length: int, reverse: bool, group: int = 1, lanes: int = 1) -> TileKernel | None:
    """The tile kernel running all `length` steps (see the module docstring), or None where the
    step is not of that shape. consts, carries, xs, ys: the scan's buffers (xs and ys whole,
    length rows); group: work-items per work-group (1 on a CPU); lanes: the vector width a
    work-item may hold its points in (a CPU's SIMD width, 1 elsewhere)."""
    if length < 1 or not parts:
        return None
    if any(p.kernel.has_reduce or any(s.mode != "set" for s in p.kernel.stores) for p in parts):
        return None
    big = [p for p in parts if p.kernel.size > 1]
    shape = tuple(big[0].kernel.shape) if big else ()
    if any(tuple(p.kernel.shape) != shape for p in big):
        return None
    N = big[0].kernel.size if big else 1
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
                        if k.size == 1 or carries[j].size != N or not _bijective(st.offset, shape):
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
    T = KExpr("idx", INDEX, (), -1)  # the step's row, as an index the offsets are affine in
    last = KExpr("idx", INDEX, (), len(shape) - 1)
    # a work-item holds W consecutive points of the last axis, as vectors, where every carry
    # walks that axis with stride 1
    W = int(lanes) if big and lanes > 1 and shape[-1] % lanes == 0 and all(
        affine_forms([o])[o].get(("idx", len(shape) - 1)) == 1 for o in own.values()) else 1
    units = N // W
    g, lane = var("g"), var("l")
    G = max(1, min(int(group), units))
    u = binary("add", binary("mul", g, ic(G)), lane) if G > 1 else g
    I = divmod_index(u, (*shape[:-1], shape[-1] // W) if W > 1 else shape)
    if W > 1:
        I[-1] = binary("mul", I[-1], ic(W))
    vector = (last, I[-1], W) if W > 1 else None
    trow = binary("sub", ic(length - 1), t) if reverse else t
    regs = {f"c{j}" for j in range(nc)}
    temps: dict = {}  # temp key -> its register's name and dtype

    def point_env(k: Kernel) -> dict:
        at = I if k.size > 1 else [ic(0)] * len(k.shape)
        return {T: trow, **{KExpr("idx", INDEX, (), a): at[a] for a in range(len(k.shape))}}

    def registers_at_zero(roots) -> dict:
        """A carry's register is read at its start (vload/load offsets said where the point is)."""
        env = {n: KExpr(n.op, n.dtype, (ic(0),), n.arg) for r in roots for n in r.toposort()
               if n.op in ("load", "vload") and (n.arg[0] if n.op == "vload" else n.arg) in regs}
        return substitute(roots, env)

    def step(p: Part) -> list | None:
        k = p.kernel
        roots = [e for st in k.stores for e in (st.offset, st.value)]
        moved = {}  # each load, at its buffer in the tile kernel (offsets still in the indices)
        for ld in _loads(roots):
            b, off = ld.arg, ld.src[0]
            if b >= k.n_inputs:
                return None  # a part reading an output
            role = p.ins[b]
            if role[0] == "const":
                moved[ld] = tload(role[1], off, ld.dtype)
            elif role[0] == "x":
                moved[ld] = tload(x_at + role[1], binary("add", binary("mul", T, ic(rows[role[1]])), off), ld.dtype)
            elif role[0] == "carry":
                j = role[1]
                if not uniform[j] and (k.size == 1 or off != own.get(j)):
                    return None  # another point's carry
                moved[ld] = tload(f"c{j}", off if not uniform[j] else ic(0), ld.dtype)
            elif role[0] == "temp" and role[1] in temps:
                moved[ld] = tload(temps[role[1]][0], ic(0), ld.dtype)
            else:
                return None
        moved = substitute(roots, moved)
        env = point_env(k)
        vec = vector if k.size > 1 else None
        roots2 = [moved[r] for r in roots]
        vsub = substitute(roots2, env, vec)
        fixed = registers_at_zero([vsub[r] for r in roots2])
        out = []
        for st in k.stores:
            d = np.dtype(k.buffers[st.buffer].dtype)
            val = cast(fixed[vsub[moved[st.value]]], d)
            wide = broadcast(val, W) if vec and lanes_of(val) == 1 else val
            for role in p.outs[st.buffer - k.n_inputs]:
                if role[0] == "carry":
                    out.append(Store(f"n{role[1]}", ic(0), wide))
                elif role[0] == "y":
                    j = role[1]
                    off = binary("add", binary("mul", T, ic(yrows[j])), moved[st.offset])
                    if vec and (affine_forms([off]).get(off) or {}).get(("idx", last.arg)) == 1:
                        out.append(Store(ys_at + j, substitute([off], {**env, last: I[-1]})[off], wide))
                    else:  # a scalar, or a scatter lane by lane
                        out.append(Store(ys_at + j, substitute([off], env, vec)[off], val))
                elif role[0] == "temp":
                    reg = temps.setdefault(role[1], (f"v{len(temps)}", d))[0]
                    out.append(Store(reg, ic(0), val))
                else:
                    return None
        return out

    body: list = []
    for p in parts:
        got = step(p)
        if got is None:
            return None
        body += got

    def at(j: int) -> KExpr:  # where a point's carry starts
        return ic(0) if uniform[j] else substitute([own[j]], point_env(big[0].kernel))[own[j]]

    def reg(j: int) -> KExpr:
        return tload(f"c{j}", ic(0), carries[j].dtype) if uniform[j] or W == 1 else \
            vload(f"c{j}", ic(0), carries[j].dtype, W)

    def glob(b: int, j: int) -> KExpr:
        return tload(b, at(j), carries[j].dtype) if uniform[j] or W == 1 else vload(b, at(j), carries[j].dtype, W)
    body += [Store(f"c{j}", ic(0), tload(f"n{j}", ic(0), c.dtype) if uniform[j] or W == 1 else
                   vload(f"n{j}", ic(0), c.dtype, W)) for j, c in enumerate(carries)]
    first = binary("eq", u, ic(0))
    stmts: list = [Alloc(f"{r}{j}", np.dtype(c.dtype), 1 if uniform[j] else W, "register")
                   for j, c in enumerate(carries) for r in "cn"]
    stmts += [Alloc(reg, d, 1, "register") for reg, d in temps.values()]
    stmts += [Store(f"c{j}", ic(0), glob(nk + j, j)) for j in range(nc)]
    stmts.append(Range("t", int(length), "serial", tuple(body)))
    final = [Store(X_at + j, at(j), reg(j)) for j in range(nc)]
    stmts += [s for j, s in enumerate(final) if not uniform[j]]
    if any(uniform) and N > 1:  # one work-item writes the carries every work-item holds
        stmts.append(If(first, tuple(s for j, s in enumerate(final) if uniform[j])))
    else:
        stmts += [s for j, s in enumerate(final) if uniform[j]]
    inner = tuple(stmts)
    if G > 1:
        inner = (If(binary("lt", u, ic(units)), inner),)
        tree = (Range("g", -(-units // G), "grid", (Range("l", G, "lane", inner),)),)
    else:
        tree = (Range("g", units, "grid", inner),)
    buffers = (*consts, *carries, *xs, *[Buffer(f"{c.name}_out", c.dtype, c.size) for c in carries], *ys)
    return TileKernel(name, tuple(buffers), nk + nc + nx, tree, meta={"loop": length})


__all__ = ["Part", "loop_kernel"]
