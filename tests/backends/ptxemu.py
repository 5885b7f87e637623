"""A small PTX interpreter for the CUDA backend's kernels, so that their numbers are checked where no
GPU is (tests/backends/test_cuda_*.py; `emulated_device()` runs the whole backend on it). It covers
the instructions those kernels emit.

How it runs. `Kernel` parses the PTX once and decodes every instruction into a small function over
numpy arrays. A launch runs its blocks together (up to CHUNK threads at a time), the threads in
lockstep as SIMT hardware does: a register is one array over the threads, of the unsigned type of
its declared width (a predicate: bool), read and written through views as the instruction's type,
so that f32 arithmetic is float32 arithmetic (one IEEE rounding per instruction), f16 is float16,
and integers wrap at their width. A predicated instruction runs on the threads whose predicate
holds; where a branch sends threads apart, the ones at the lowest pc run first until they reach
the pc where others wait, and there go on together (min-pc reconvergence). bar.sync waits for all
live threads of the blocks run together (for a race-free kernel the same as waiting for one block);
the warp collectives (ldmatrix, mma.sync) run once all 32 lanes of a warp reach them, with the lane
layouts the PTX ISA gives for the m16n8k16 fragments; atomics apply in thread order. Memory: global
is the caller's bytes, each block has its own shared bytes, each thread its own local bytes (local
addresses, generic ones too, lie above LOCAL). A kernel's text is decoded once (`kernel`), however
often the backend loads it."""
import ctypes
import functools
import re

import ml_dtypes
import numpy as np

M = {8: 0xFF, 16: 0xFFFF, 32: 0xFFFFFFFF, 64: 0xFFFFFFFFFFFFFFFF}
LOCAL = 1 << 48  # where local memory's addresses start
CHUNK = 1 << 14  # at most this many threads (whole blocks) run together

U = {n: np.dtype(f"u{n}") for n in (1, 2, 4, 8)}  # the bits of a value of n bytes
BOOL, I64, U64, F32, F64 = (np.dtype(t) for t in (bool, np.int64, np.uint64, np.float32, np.float64))
BF16 = np.dtype(ml_dtypes.bfloat16)
# a PTX type -> the numpy type an instruction of that type computes in
DT = {"pred": BOOL, "b8": U[1], "u8": U[1], "s8": np.dtype("i1"), "b16": U[2], "u16": U[2],
      "s16": np.dtype("i2"), "f16": np.dtype(np.float16), "bf16": BF16, "b32": U[4], "u32": U[4],
      "s32": np.dtype("i4"), "f32": F32, "b64": U[8], "u64": U[8], "s64": np.dtype("i8"), "f64": F64}
FLOAT = {"f16", "bf16", "f32", "f64"}
SPECIAL = ("%tid.x", "%ctaid.x", "%ntid.x", "%nctaid.x", "%laneid")

OP, BRA, BARRIER, RET, COLLECTIVE = range(5)  # kinds of instruction
RUN, WAIT_BAR, WAIT_WARP, DONE = range(4)  # states of a thread
ALL = slice(None)  # `sel` for every thread


def width(t):
    return 1 if t == "pred" else int(t.lstrip("bfsu"))


def imm(tok):
    if tok.startswith(("0f", "0d")):
        return int(tok[2:], 16)
    if tok.startswith(("0x", "-0x")):
        return int(tok, 16)
    return int(tok)


def _regs(s):
    return [r.strip() for r in s.strip("{}").split(",")]


def _mul_hi(a, b, t):
    """The high half of the product of a and b (numpy type t), as PTX mul.hi gives it."""
    w = t.itemsize * 8
    if w <= 32:
        wide = I64 if t.kind == "i" else U64
        return ((a.astype(wide) * b.astype(wide)) >> w).astype(t)
    ua, ub = a.view(U64), b.view(U64)  # 64 bits: from the 32-bit halves
    lo = np.uint64(M[32])
    al, ah, bl, bh = ua & lo, ua >> 32, ub & lo, ub >> 32
    lh, hl = al * bh, ah * bl
    hi = ah * bh + (lh >> 32) + (hl >> 32) + (((al * bl) >> 32) + (lh & lo) + (hl & lo) >> 32)
    if t.kind == "i":  # two's complement: less b where a < 0, less a where b < 0
        hi = hi - np.where(a < 0, ub, U64.type(0)) - np.where(b < 0, ua, U64.type(0))
    return hi.view(t)


def _div(a, b, t):
    """a / b rounded toward zero (PTX div), a % b with the sign of a (PTX rem)."""
    if t.kind == "u":
        return a // b, a % b
    q = a // b
    q = q + ((q < 0) & (q * b != a)).astype(t)
    return q, a - q * b


class Memory:
    """Bytes (a uint8 array) and their views as 2-, 4- and 8-byte words: loads and stores at arrays
    of byte addresses, aligned ones through the views."""

    def __init__(self, b):
        self.b = b
        self.words = {n: b[:b.size // n * n].view(U[n]) for n in (2, 4, 8)}
        self.shift = {2: 1, 4: 2, 8: 3}

    def load(self, a, n):
        if n == 1:
            return self.b[a]
        if not (a & (n - 1)).any():
            return self.words[n][a >> self.shift[n]]
        return self.b[a[:, None] + np.arange(n)].view(U[n])[:, 0]

    def store(self, a, n, v):
        if n == 1:
            self.b[a] = v
        elif not (a & (n - 1)).any():
            self.words[n][a >> self.shift[n]] = v
        else:
            v = np.ascontiguousarray(np.broadcast_to(v, a.shape), U[n])
            self.b[a[:, None] + np.arange(n)] = v.view(np.uint8).reshape(-1, n)


class Kernel:
    """A kernel's PTX parsed and decoded once: its shared and local arrays, parameters, registers
    (name -> numpy type of their bits), labels and `code`, one (kind, predicate register or None,
    negated, function(emu, threads), branch target, text) per instruction."""

    def __init__(self, ptx):
        self.shared = {}
        off = 0
        for name, n in re.findall(r"\.shared\s+\.align\s+\d+\s+\.b8\s+(\w+)\[(\d+)\]", ptx):
            self.shared[name] = off
            off += int(n)
            off = (off + 15) // 16 * 16
        self.shared_size = off
        # a thread's stack (register arrays indexed at run time): its own bytes of local memory
        self.local = {name: int(n) for name, n in
                      re.findall(r"\.local\s+\.align\s+\d+\s+\.b8\s+(\w+)\[(\d+)\]", ptx)}
        self.local_at, self.local_size = {}, 0
        for name, n in self.local.items():
            self.local_at[name], self.local_size = self.local_size, self.local_size + (n + 15) // 16 * 16
        self.params = re.findall(r"\.param \.u64 [^\n]*?(\w+_param_\d+)", ptx)
        self.regs = {name: U[4] for name in SPECIAL}
        self._reg_kinds = {}  # "%r" of ".reg .b32 %r<189>" -> its bits' type
        for ty, names in re.findall(r"\.reg\s+\.(\w+)\s+([^;]+);", ptx):
            for name in names.split(","):
                name = name.strip()
                dt = BOOL if ty == "pred" else U[max(width(ty), 8) // 8]
                if "<" in name:
                    self._reg_kinds[name.split("<")[0]] = dt
                else:
                    self.regs[name] = dt
        body = ptx[ptx.index("{", ptx.index(".entry")) + 1: ptx.rindex("}")]
        lines, self.labels = [], {}
        for line in body.splitlines():
            line = line.split("//")[0].strip()
            if not line or line.startswith("."):
                continue
            if line.endswith(":"):
                self.labels[line[:-1]] = len(lines)
                continue
            lines.append(line.rstrip(";").strip())
        self.code = [self._instruction(line) for line in lines]

    @staticmethod
    def _operands(s):
        if "{" not in s:  # (an address [base+offset] has no comma)
            return [o.strip() for o in s.split(",")] if s else []
        out, depth, cur = [], 0, ""
        for ch in s:
            if ch in "{[":
                depth += 1
            if ch in "}]":
                depth -= 1
            if ch == "," and depth == 0:
                out.append(cur.strip())
                cur = ""
            else:
                cur += ch
        if cur.strip():
            out.append(cur.strip())
        return out

    def _instruction(self, line):
        text, pred, neg = line, None, False
        if line.startswith("@"):
            p, line = line.split(None, 1)
            pred, neg = p[1:].lstrip("!"), p.startswith("@!")
            self.reg(pred)
        op, _, rest = line.partition(" ")
        ops, parts = self._operands(rest.strip()), op.split(".")
        head = parts[0]
        if head == "bra":
            return BRA, pred, neg, None, self.labels[ops[0]], text
        if head in ("bar", "barrier"):
            return BARRIER, pred, neg, None, None, text
        if head == "ret":
            return RET, pred, neg, None, None, text
        kind = COLLECTIVE if head in ("ldmatrix", "mma") else OP
        try:
            fn = self._decode(head, parts, ops)
        except (KeyError, ValueError, IndexError, NotImplementedError) as e:  # fails when it runs
            def fn(emu, sel, e=e):
                raise NotImplementedError(f"{text}: {e!r}")
        return kind, pred, neg, fn, None, text

    # ---- operands: functions of (emu, threads) ----

    def reg(self, tok):
        """The numpy type of register tok's bits."""
        if tok not in self.regs:
            self.regs[tok] = self._reg_kinds.get(tok.rstrip("0123456789"), U64)
        return self.regs[tok]

    def rd(self, tok, t):
        """f(emu, sel): operand tok's value as numpy type t at threads sel (an array, or a scalar
        for a constant)."""
        t = np.dtype(t)
        if tok.startswith("%"):
            d = self.reg(tok)
            if d == t:
                return lambda e, sel: e.R[tok][sel]
            if t == BOOL:
                return lambda e, sel: e.R[tok][sel] != 0
            if d == BOOL or (t.kind in "iu" and d.itemsize != t.itemsize):
                return lambda e, sel: e.R[tok][sel].astype(t)  # zero-extends or truncates
            if d.itemsize == t.itemsize:
                return lambda e, sel: e.R[tok][sel].view(t)
            u = U[t.itemsize]
            return lambda e, sel: e.R[tok][sel].astype(u).view(t)
        if tok in self.local:  # each thread's own
            off = self.local_at[tok]
            return lambda e, sel: (e.lbase[sel] + np.uint64(off)).astype(t)
        v = self.shared[tok] if tok in self.shared else imm(tok)
        if t == BOOL:
            const = np.bool_(v)
        else:
            const = np.array(v & M[8 * t.itemsize], U[t.itemsize]).view(t)[()]
        return lambda e, sel: const

    def wr(self, tok, t):
        """f(emu, sel, value of numpy type t): into register tok at threads sel."""
        t, d = np.dtype(t), self.reg(tok)
        if d == t or d == BOOL or t.kind in "iub":  # assignment casts: integers wrap or extend
            return lambda e, sel, v: e.R[tok].__setitem__(sel, v)
        if d.itemsize == t.itemsize:  # a float's bits
            return lambda e, sel, v: e.R[tok].__setitem__(sel, v.view(d))
        u = U[t.itemsize]
        return lambda e, sel, v: e.R[tok].__setitem__(sel, v.view(u))

    def address(self, tok):
        """f(emu, sel): the int64 addresses of a memory operand [base+offset] (an array or a
        scalar), or ("param", name)."""
        m = re.match(r"([%\w.$]+)\s*(?:\+\s*(-?\d+))?$", tok.strip("[]").strip())
        base, off = m.group(1), int(m.group(2) or 0)
        if base in self.params:
            return ("param", base)
        get = self.rd(base, I64)
        if not off:
            return get
        off = np.int64(off)
        return lambda e, sel: get(e, sel) + off

    # ---- instructions ----

    def _decode(self, head, parts, ops):
        """f(emu, sel): instruction head.parts ops at threads sel."""
        ty = parts[-1]
        if head in ("ld", "st", "atom", "red"):
            return self._memory(head, parts, ops)
        if head == "cvta":
            return self._unary(ops, U64, U64, lambda x: x)
        if head == "mov":
            return self._mov(ty, ops)
        if head == "setp":
            return self._setp(parts[1], parts[2], ops)
        if head == "selp":
            t = DT[ty]
            a, b, c, w = self.rd(ops[1], t), self.rd(ops[2], t), self.rd(ops[3], BOOL), self.wr(ops[0], t)
            return lambda e, sel: w(e, sel, np.where(c(e, sel), a(e, sel), b(e, sel)))
        if head == "cvt":
            return self._cvt(parts, ops)
        if head == "ldmatrix":
            return self._ldmatrix(parts, ops)
        if head == "mma":
            return self._mma(parts, ops)
        if ty == "pred":
            fn = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor,
                  "not": np.logical_not}[head]
            return self._nary(ops, BOOL, BOOL, fn)
        if ty in FLOAT:
            return self._float(head, parts, ty, ops)
        return self._integer(head, parts, ty, ops)

    def _nary(self, ops, t_in, t_out, fn):
        """ops[0] = fn(ops[1], ops[2], ...), operands read as t_in, the result written as t_out."""
        xs, w = [self.rd(o, t_in) for o in ops[1:]], self.wr(ops[0], t_out)
        if len(xs) == 1:
            (a,) = xs
            return lambda e, sel: w(e, sel, fn(a(e, sel)))
        if len(xs) == 2:
            a, b = xs
            return lambda e, sel: w(e, sel, fn(a(e, sel), b(e, sel)))
        return lambda e, sel: w(e, sel, fn(*[x(e, sel) for x in xs]))

    def _unary(self, ops, t_in, t_out, fn):
        return self._nary(ops[:2], t_in, t_out, fn)

    def _mov(self, ty, ops):
        t = DT[ty]
        if ops[0].startswith("{"):  # unpack into parts
            dsts = _regs(ops[0])
            u, hu = U[t.itemsize], U[t.itemsize // len(dsts)]
            x = self.rd(ops[1], u)
            ws = [(8 * hu.itemsize * i, self.wr(r, hu)) for i, r in enumerate(dsts) if r != "_"]

            def unpack(e, sel):
                v = x(e, sel)
                for sh, w in ws:
                    w(e, sel, (v >> u.type(sh)).astype(hu))
            return unpack
        if ops[1].startswith("{"):  # pack
            srcs = _regs(ops[1])
            u, hu = U[t.itemsize], U[t.itemsize // len(srcs)]
            xs = [(u.type(8 * hu.itemsize * i), self.rd(r, hu)) for i, r in enumerate(srcs)]
            w = self.wr(ops[0], u)

            def pack(e, sel):
                v = 0
                for sh, x in xs:
                    v = v | (x(e, sel).astype(u) << sh)
                w(e, sel, v)
            return pack
        return self._unary(ops, t, t, lambda x: x)

    def _setp(self, cmp, ct, ops):
        t = DT[ct]
        a, b, w = self.rd(ops[1], t), self.rd(ops[2], t), self.wr(ops[0], BOOL)
        if ct in FLOAT:
            if cmp in ("nan", "num"):  # unordered (either is NaN), ordered (neither)
                want = cmp == "nan"
                return lambda e, sel: w(e, sel, (np.isnan(a(e, sel)) | np.isnan(b(e, sel))) == want)
            f = CMP[cmp[:2]]
            if cmp.endswith("u"):  # ltu, equ, neu, ...: true where unordered
                def fn(e, sel):
                    x, y = a(e, sel), b(e, sel)
                    return w(e, sel, f(x, y) | np.isnan(x) | np.isnan(y))
                return fn
            if cmp == "ne":  # ordered: false where unordered
                def fn(e, sel):
                    x, y = a(e, sel), b(e, sel)
                    return w(e, sel, (x != y) & ~np.isnan(x) & ~np.isnan(y))
                return fn
        else:
            f = CMP[cmp]
        return lambda e, sel: w(e, sel, f(a(e, sel), b(e, sel)))

    def _cvt(self, parts, ops):
        dt, st = [p for p in parts[1:] if p not in ("rn", "rni", "rzi", "rmi", "rpi", "rz", "sat", "ftz")][:2]
        td, ts = DT[dt], DT[st]
        rnd = np.rint if "rni" in parts else np.floor if "rmi" in parts else np.ceil if "rpi" in parts \
            else np.trunc
        if st == dt and st in FLOAT:  # round to an integer value
            return self._unary(ops, ts, td, lambda x: rnd(x.astype(F64)).astype(td))
        if st in FLOAT and dt in FLOAT:
            return self._unary(ops, ts, td, lambda x: x.astype(F64).astype(td))
        if dt in FLOAT:  # from an integer
            return self._unary(ops, ts, td, lambda x: x.astype(td))
        if st in FLOAT:  # to an integer: (rni, rmi, rpi: rounded first) saturating as PTX is; NaN: 0
            w = width(dt)
            lo, hi = (-2.0 ** (w - 1), 2.0 ** (w - 1)) if dt[0] == "s" else (0.0, 2.0 ** w)
            top, bottom = td.type(M[w] >> (dt[0] == "s")), td.type(lo)

            def to_int(x):
                v = rnd(x.astype(F64))
                over, under = v >= hi, v < lo
                r = np.where(over | under | (v != v), 0.0, v).astype(td)
                return np.where(over, top, np.where(under, bottom, r))
            return self._unary(ops, ts, td, to_int)
        return self._unary(ops, ts, td, lambda x: x.astype(td))  # integer conversions

    def _float(self, head, parts, ty, ops):
        t = DT[ty]
        one = t.type(1)
        if head == "testp":  # testp.finite / .infinite / .nan / .notanumber / .number
            fn = {"finite": np.isfinite, "infinite": np.isinf, "nan": np.isnan, "notanumber": np.isnan,
                  "number": lambda x: ~np.isnan(x)}[parts[1]]
            return self._unary(ops, t, BOOL, fn)
        if head == "fma":
            L = np.longdouble
            return self._nary(ops, t, t, lambda a, b, c: (a.astype(L) * b.astype(L) + c.astype(L)).astype(t))
        nan = "NaN" in parts  # min/max: .NaN gives NaN where either is; else the other operand
        fn = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
              "rcp": lambda x: one / x, "sqrt": np.sqrt, "rsqrt": lambda x: one / np.sqrt(x),
              "abs": np.abs, "neg": np.negative,
              "min": np.minimum if nan else np.fmin, "max": np.maximum if nan else np.fmax,
              "copysign": lambda a, b: np.copysign(b, a),  # sign of a onto b
              "ex2": lambda x: np.power(2.0, x.astype(F64)).astype(t),
              "lg2": lambda x: np.log2(x.astype(F64)).astype(t)}[head]
        return self._nary(ops, t, t, fn)

    def _integer(self, head, parts, ty, ops):
        t = DT[ty]
        w, signed = width(ty), ty[0] == "s"
        if head in ("mul", "mad") and parts[1] == "wide":
            t2 = DT[ty[0] + str(2 * w)]
            if head == "mul":
                return self._nary(ops, t, t2, lambda a, b: a.astype(t2) * b.astype(t2))
            a, b, c, wr = self.rd(ops[1], t), self.rd(ops[2], t), self.rd(ops[3], t2), self.wr(ops[0], t2)
            return lambda e, sel: wr(e, sel, a(e, sel).astype(t2) * b(e, sel).astype(t2) + c(e, sel))
        if head in ("mul", "mad"):
            mul = (lambda a, b: _mul_hi(a, b, t)) if parts[1] == "hi" else np.multiply
            if head == "mul":
                return self._nary(ops, t, t, mul)
            return self._nary(ops, t, t, lambda a, b, c: mul(a, b) + c)
        if head in ("shl", "shr"):
            a, b, wr = self.rd(ops[1], t), self.rd(ops[2], U[4]), self.wr(ops[0], t)
            if head == "shl":
                return lambda e, sel: wr(e, sel, _shift(np.left_shift, a(e, sel), b(e, sel), w, False))
            return lambda e, sel: wr(e, sel, _shift(np.right_shift, a(e, sel), b(e, sel), w, signed))
        if head == "shf":  # funnel shift of the pair (b:a) by c, the word that stays
            left, wrap = parts[1] == "l", "wrap" in parts

            def shf(a, b, c):
                c = c & 31 if wrap else np.minimum(c & 63, 32)
                pair = (b.astype(U64) << 32) | a.astype(U64)
                c = c.astype(U64)
                return ((pair << c) >> 32 if left else pair >> c).astype(U[4])
            return self._nary(ops, U[4], U[4], shf)
        if head == "bfe":  # bits pos .. pos + len - 1 of a (len, pos: their low bytes)
            ut = U[t.itemsize]
            a, pos, ln = (self.rd(o, ut) for o in ops[1:4])
            wr = self.wr(ops[0], ut)

            def bfe(e, sel):
                p, n = pos(e, sel) & 0xFF, ln(e, sel) & 0xFF
                x = np.where(p >= w, ut.type(0), a(e, sel) >> (p & (w - 1)))
                mask = np.where(n >= w, ut.type(M[w]), (ut.type(1) << (n & (w - 1))) - ut.type(1))
                return wr(e, sel, x & mask)
            return bfe
        if head in ("div", "rem"):
            i = head == "rem"
            return self._nary(ops, t, t, lambda a, b: _div(a, b, t)[i])
        fn = {"add": np.add, "sub": np.subtract, "and": np.bitwise_and, "or": np.bitwise_or,
              "xor": np.bitwise_xor, "not": np.invert, "neg": np.negative, "abs": np.abs,
              "min": np.minimum, "max": np.maximum}[head]
        return self._nary(ops, t, t, fn)

    def _memory(self, head, parts, ops):
        space = parts[1] if parts[1] in ("global", "shared", "local", "param", "const") else "generic"
        vec = [p for p in parts if re.fullmatch(r"v\d", p)]
        ty = parts[-1]
        n = width(ty) // 8
        if head == "ld":
            a = self.address(ops[1])
            if isinstance(a, tuple):  # ("param", name)
                name, w = a[1], self.wr(ops[0], U64)
                return lambda e, sel: w(e, sel, U64.type(e.params[name]))
            t = DT["s" + str(8 * n)] if ty[0] == "s" else U[n]  # ld.s32 into a 64-bit register: extended
            ws = [(np.int64(i * n), self.wr(r, t)) for i, r in enumerate(_regs(ops[0]) if vec else [ops[0]])]

            def load(e, sel):
                at = a(e, sel)
                for off, w in ws:
                    w(e, sel, e.load(space, at + off, sel, n).view(t))
            return load
        if head == "st":
            a = self.address(ops[0])
            srcs = _regs(ops[1]) if vec else [ops[1]]
            xs = [(np.int64(i * n), self.rd(r, U[n])) for i, r in enumerate(srcs)]

            def store(e, sel):
                at = a(e, sel)
                for off, x in xs:
                    e.store(space, at + off, sel, n, x(e, sel))
            return store
        # red/atom.space.add.T [a], v (atom also returns the old value)
        if "add" not in parts:
            raise NotImplementedError(".".join(parts))
        t = DT[ty]
        a, x = self.address(ops[-2]), self.rd(ops[-1], t)
        w = self.wr(ops[0], U[n]) if head == "atom" else None

        def atomic(e, sel):
            old = e.atomic_add(space, a(e, sel), sel, x(e, sel), t)
            if w is not None:
                w(e, sel, old)
        return atomic

    def _ldmatrix(self, parts, ops):
        count = int(parts[4][1:])
        a, dsts = self.address(ops[1]), _regs(ops[0])
        for r in dsts:
            self.reg(r)
        lane = np.arange(32)
        row, pair = lane // 4, lane % 4

        def ldmatrix(e, sel):  # sel: whole warps; matrix i's row r from lane 8 i + r's address
            at = (a(e, sel) + e.sbase[sel]).reshape(-1, 32)
            for i in range(count):
                e.R[dsts[i]][sel] = e.mem["shared"].load((at[:, 8 * i + row] + 4 * pair).reshape(-1), 4)
        return ldmatrix

    def _mma(self, parts, ops):
        # mma.sync.aligned.m16n8k16.row.col.f32.X.X.f32: the fragments of PTX ISA's figures
        if parts[7] == "f16":
            conv = lambda h: h.astype(U[2]).view(np.float16).astype(F64)  # noqa: E731
        else:
            conv = lambda h: (h << np.uint32(16)).view(F32).astype(F64)  # noqa: E731
        dr, ar, br, cr = (_regs(o) for o in ops[:4])
        for r in dr + ar + br + cr:
            self.reg(r)
        lane = np.arange(32)
        g, tq = lane // 4, lane % 4

        def mma(e, sel):  # sel: whole warps
            nw = len(sel) // 32
            wi = np.arange(nw)[:, None]
            get = lambda r: e.R[r][sel].reshape(nw, 32)  # noqa: E731
            A, B, C = np.zeros((nw, 16, 16)), np.zeros((nw, 16, 8)), np.zeros((nw, 16, 8), np.float32)
            av, bv, cv = [get(r) for r in ar], [get(r) for r in br], [get(r).view(F32) for r in cr]
            for i in range(8):
                h = (av[i // 2] >> np.uint32(16 * (i % 2))) & np.uint32(0xFFFF)
                row = g if i < 2 or 4 <= i < 6 else g + 8
                A[wi, row, tq * 2 + (i & 1) + (8 if i >= 4 else 0)] = conv(h)
            for i in range(4):
                h = (bv[i // 2] >> np.uint32(16 * (i % 2))) & np.uint32(0xFFFF)
                B[wi, tq * 2 + (i & 1) + (8 if i >= 2 else 0), g] = conv(h)
            for i in range(4):
                C[wi, g + (8 if i >= 2 else 0), tq * 2 + (i & 1)] = cv[i]
            D = (A @ B + C).astype(np.float32)
            for i, r in enumerate(dr):
                e.R[r][sel] = D[wi, g + (8 if i >= 2 else 0), tq * 2 + (i & 1)].reshape(-1).view(U[4])
        return mma


CMP = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
       "ge": np.greater_equal, "lo": np.less, "ls": np.less_equal, "hi": np.greater, "hs": np.greater_equal}


def _shift(op, a, b, w, signed):
    """a shifted by b (unsigned), PTX's way: by w or more gives 0, or the sign for shr.s."""
    big = b >= w
    if signed:
        return op(a, np.minimum(b, w - 1).astype(a.dtype))
    return np.where(big, a.dtype.type(0), op(a, (b & (w - 1)).astype(a.dtype)))


class Emu:
    """Runs `kernel`'s blocks over global memory `gmem` (uint8), `params` its parameters' values."""

    def __init__(self, kernel, gmem, params):
        self.k, self.g, self.params = kernel, gmem, params

    def run(self, grid, block):
        per = max(1, CHUNK // block)
        with np.errstate(all="ignore"):  # IEEE results (inf, NaN) as the GPU gives them
            for c in range(0, grid, per):
                self.run_blocks(np.arange(c, min(grid, c + per)), block, grid)

    def run_blocks(self, ctaids, ntid, nctaid):
        k, n = self.k, len(ctaids) * ntid
        self.all = np.arange(n)  # the threads run together, block after block
        tid, blk = self.all % ntid, self.all // ntid
        self.R = {name: np.zeros(n, dt) for name, dt in k.regs.items()}
        self.R["%tid.x"][:], self.R["%ctaid.x"][:] = tid, ctaids[blk]
        self.R["%ntid.x"][:], self.R["%nctaid.x"][:], self.R["%laneid"][:] = ntid, nctaid, tid % 32
        per_block = max(k.shared_size, 16)
        self.sbase = blk * per_block  # where each thread's block's shared bytes start
        self.lbase = (LOCAL + self.all * k.local_size).astype(U64)  # each thread's local bytes
        self.mem = {"global": Memory(self.g), "shared": Memory(np.zeros(per_block * len(ctaids), np.uint8)),
                    "local": Memory(np.zeros(max(k.local_size * n, 16), np.uint8))}
        wpb = (ntid + 31) // 32
        self.warp = blk * wpb + tid // 32
        self.warp_size = np.bincount(self.warp)
        self.pc, self.state = np.zeros(n, np.int64), np.zeros(n, np.int8)
        self.schedule()

    # ---- memory at arrays of addresses ----

    def _at(self, space, a, sel):
        """[(memory, byte addresses, which of a or None for all)]: generic addresses above LOCAL
        are local, the others global."""
        if space == "shared":
            return [(self.mem["shared"], a + self.sbase[sel], None)]
        if space == "local":
            return [(self.mem["local"], a - LOCAL, None)]
        if space == "generic":
            a = np.broadcast_to(a, (len(self.all[sel]),))
            loc = a >= LOCAL
            if loc.any():
                if loc.all():
                    return [(self.mem["local"], a - LOCAL, None)]
                return [(self.mem["local"], a[loc] - LOCAL, loc), (self.mem["global"], a[~loc], ~loc)]
        return [(self.mem["global"], a, None)]

    def load(self, space, a, sel, n):
        parts = self._at(space, a, sel)
        if len(parts) == 1:
            return parts[0][0].load(parts[0][1], n)
        out = np.empty(len(parts[0][2]), U[n])
        for mem, at, which in parts:
            out[which] = mem.load(at, n)
        return out

    def store(self, space, a, sel, n, v):
        for mem, at, which in self._at(space, a, sel):
            vw = v if which is None or np.ndim(v) == 0 else v[which]
            mem.store(at, n, vw)

    def atomic_add(self, space, a, sel, v, t):
        """Adds v (numpy type t) at addresses a thread after thread; the old values (bits)."""
        n = t.itemsize
        ((mem, at, _),) = self._at(space if space != "generic" else "global", a, sel)
        at = np.broadcast_to(at, (len(self.all[sel]),))
        v = np.broadcast_to(v, at.shape)
        addrs, inv, counts = np.unique(at, return_inverse=True, return_counts=True)
        if counts.max() == 1:
            old = mem.load(at, n)
            mem.store(at, n, (old.view(t) + v).astype(t).view(U[n]))
            return old
        old = np.empty(at.shape, U[n])
        order = np.argsort(inv, kind="stable")  # thread order within each address
        start = 0
        for addr, c in zip(addrs, counts):
            idx = order[start:start + c]
            start += c
            one = np.array([addr])
            seq = np.add.accumulate(np.concatenate([mem.load(one, n).view(t), v[idx]]), dtype=t)
            old[idx] = seq[:-1].view(U[n])
            mem.store(one, n, seq[-1:].view(U[n]))
        return old

    # ---- threads in lockstep ----

    def schedule(self):
        pc, state, end = self.pc, self.state, len(self.k.code) + 1
        while True:
            run = state == RUN
            if run.any():
                lanes = ALL if run.all() else np.flatnonzero(run)
                p = pc[lanes]
                m = p.min()
                at = p == m
                if at.all():
                    self.step(int(m), lanes, end)
                else:  # the threads furthest behind first, until they reach the others
                    self.step(int(m), self.all[lanes][at], int(p[~at].min()))
                continue
            waiting = state == WAIT_WARP
            if waiting.any() and self.collectives(waiting):
                continue
            live = state != DONE
            if not live.any():
                return
            if waiting.any():
                raise RuntimeError(f"deadlock: {np.bincount(state, minlength=4)} (run, bar, warp, done)")
            state[live], pc[live] = RUN, pc[live] + 1  # all live threads at a barrier: on

    def step(self, pc, lanes, bound):
        """Runs threads `lanes` (all at pc) until they branch apart, wait (barrier, collective),
        finish, or reach pc `bound` (where other threads wait for them)."""
        code, R = self.k.code, self.R
        while True:
            kind, pred, neg, fn, target, _ = code[pc]
            on = lanes
            if pred is not None:
                pv = R[pred][lanes]
                if neg:
                    pv = ~pv
                if not pv.all():
                    on = self.all[lanes][pv] if pv.any() else None
            if kind == OP:
                if on is not None:
                    fn(self, on)
                pc += 1
            elif kind == BRA:
                if on is lanes:
                    pc = target
                elif on is None:
                    pc += 1
                else:
                    self.pc[on] = target
                    self.pc[self.all[lanes][~pv]] = pc + 1
                    return
            elif on is None:
                pc += 1
            else:  # threads `on` finish or wait (barrier, warp collective); the others go on
                if on is not lanes:
                    self.pc[self.all[lanes][~pv]] = pc + 1
                self.pc[on] = pc
                self.state[on] = DONE if kind == RET else WAIT_BAR if kind == BARRIER else WAIT_WARP
                return
            if pc >= bound:
                self.pc[lanes] = pc
                return

    def collectives(self, waiting):
        """Runs the warp collectives whose warps' threads have all arrived; False if none has."""
        arrived = np.bincount(self.warp[waiting], minlength=len(self.warp_size))
        ready = waiting & (arrived == self.warp_size)[self.warp]
        if not ready.any():
            return False
        lanes = np.flatnonzero(ready)
        pcs = self.pc[lanes]
        for p in np.unique(pcs):
            sel = lanes[pcs == p]
            whole = np.bincount(self.warp[sel], minlength=len(self.warp_size))
            assert len(sel) % 32 == 0 and set(whole[self.warp[sel]]) == {32}, \
                f"warp collective at {self.k.code[p][5]}: lanes apart"
            self.k.code[p][3](self, sel)
        self.state[lanes], self.pc[lanes] = RUN, pcs + 1
        return True


@functools.lru_cache(maxsize=64)
def kernel(ptx):
    """Kernel(ptx), parsed and decoded once for each text (the backend loads many kernels again)."""
    return Kernel(ptx)


def run(ptx, buffers, grid, block):
    """buffers: numpy arrays (inputs then outputs), written back in place; returns the last."""
    k = kernel(ptx)
    addrs, total = [], 4096
    for b in buffers:
        addrs.append(total)
        total += (b.nbytes + 255) // 256 * 256 + 256
    g = np.zeros(total, np.uint8)
    for a, b in zip(addrs, buffers):
        g[a:a + b.nbytes] = np.frombuffer(np.ascontiguousarray(b).tobytes(), np.uint8)
    Emu(k, g, dict(zip(k.params, addrs))).run(grid, block)
    for a, b in zip(addrs, buffers):
        b[...] = np.frombuffer(g[a:a + b.nbytes].tobytes(), b.dtype).reshape(b.shape)
    return buffers[-1]


# ---- an emulated CUDA device: the backend whole (pool, copies, launches) over this interpreter ----

class EmuContext:
    """backends/cuda/driver.Context's interface over one emulated global memory: addresses are
    offsets into `mem`, launches run here."""

    def __init__(self, size: int = 1 << 24):
        self.mem, self.top = np.zeros(size, np.uint8), 4096

    def mem_alloc(self, nbytes: int) -> int:
        a, self.top = self.top, self.top + (int(nbytes) + 255) // 256 * 256 + 256
        if self.top > self.mem.size:
            self.mem = np.concatenate([self.mem, np.zeros(max(self.top, self.mem.size), np.uint8)])
        return a

    def mem_free(self, ptr: int) -> None:
        pass

    def htod(self, dst: int, host: int, nbytes: int) -> None:
        ctypes.memmove(self.mem.ctypes.data + dst, host, nbytes)

    def dtoh(self, host: int, src: int, nbytes: int) -> None:
        ctypes.memmove(host, self.mem.ctypes.data + src, nbytes)

    def dtod(self, dst: int, src: int, nbytes: int) -> None:
        self.mem[dst:dst + nbytes] = self.mem[src:src + nbytes].copy()

    def synchronize(self) -> None:
        pass

    def load_module(self, ptx: str, fn_name: str):
        assert f".entry {fn_name}(" in ptx, fn_name
        return None, kernel(ptx)

    def launch(self, kernel, grid: int, block: int, ptrs) -> None:
        Emu(kernel, self.mem, dict(zip(kernel.params, ptrs))).run(grid, block)


def emulated_device(sm: str = "sm_80"):
    """A CUDA device of compute capability `sm` whose kernels run in this interpreter: the whole
    backend (its pool, copies and launches) without a GPU."""
    from tilefuse.backends.cuda import CUDABackend, OfflineCUDABackend
    from tilefuse.runtime.device import Device

    class EmulatedCUDABackend(OfflineCUDABackend):
        put = CUDABackend.put

        def context(self, device=None):
            if not hasattr(self, "_emu"):
                self._emu = EmuContext()
            return self._emu

    backend = EmulatedCUDABackend(sm)
    return Device(backend, 0, backend._infos[0], True)
