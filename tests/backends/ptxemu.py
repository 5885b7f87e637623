"""A small PTX interpreter for the CUDA backend's kernels, so that their numbers are checked where no
GPU is (tests/backends/test_cuda_*.py; `emulated_device()` runs the whole backend on it). It covers
the instructions those kernels emit;
threads run one by one between barriers, and warp collectives (ldmatrix, mma.sync) run for the
whole warp at once, with the lane layouts the PTX ISA gives for the m16n8k16 fragments. Slow (a
Python loop per instruction): small problems only."""
import ctypes
import re
import struct

import ml_dtypes
import numpy as np

M = {8: 0xFF, 16: 0xFFFF, 32: 0xFFFFFFFF, 64: 0xFFFFFFFFFFFFFFFF}


LOCAL = 1 << 48  # where local memory's addresses start


def f32(bits):
    return struct.unpack("<f", struct.pack("<I", bits & M[32]))[0]


def b32(x):
    return struct.unpack("<I", struct.pack("<f", np.float32(x)))[0]


def f64(bits):
    return struct.unpack("<d", struct.pack("<Q", bits & M[64]))[0]


def b64(x):
    return struct.unpack("<Q", struct.pack("<d", np.float64(x)))[0]


def bf16v(bits):
    return f32((bits & 0xFFFF) << 16)


def b16bf(x):
    return int(np.array([x], np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)[0])


def f16v(bits):
    return float(np.array([bits & 0xFFFF], np.uint16).view(np.float16)[0])


def b16f(x):
    return int(np.array([np.float16(x)], np.float16).view(np.uint16)[0])


# float types: bits -> value, value -> bits, numpy type
FLOAT = {"f32": (f32, b32, np.float32), "f64": (f64, b64, np.float64), "f16": (f16v, b16f, np.float16),
         "bf16": (bf16v, b16bf, ml_dtypes.bfloat16)}


def sgn(v, w):
    v &= M[w]
    return v - (1 << w) if v >> (w - 1) else v


def width(t):
    if t == "pred":
        return 1
    return int(re.sub(r"\D", "", t))


class Kernel:
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
        self.params = re.findall(r"\.param \.u64 [^\n]*?(\w+_param_\d+)", ptx)
        body = ptx[ptx.index("{", ptx.index(".entry")) + 1: ptx.rindex("}")]
        self.code, self.labels = [], {}
        for line in body.splitlines():
            line = line.split("//")[0].strip()
            if not line or line.startswith("."):
                continue
            if line.endswith(":"):
                self.labels[line[:-1]] = len(self.code)
                continue
            line = line.rstrip(";").strip()
            pred = None
            if line.startswith("@"):
                p, line = line.split(None, 1)
                pred = (p[1:].lstrip("!"), p.startswith("@!"))
            op, _, rest = line.partition(" ")
            ops = self._operands(rest.strip())
            self.code.append((pred, op, op.split("."), ops))

    @staticmethod
    def _operands(s):
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


class Thread:
    def __init__(self, tid, ctaid, ntid, nctaid):
        self.regs = {"%tid.x": tid, "%ctaid.x": ctaid, "%ntid.x": ntid, "%nctaid.x": nctaid}
        self.pc, self.state, self.tid = 0, "run", tid


def imm(tok):
    if tok.startswith("0f"):
        return int(tok[2:], 16)
    if tok.startswith("0d"):
        return int(tok[2:], 16)
    if tok.startswith(("0x", "-0x")):
        return int(tok, 16)
    return int(tok)


class Emu:
    def __init__(self, kernel, gmem, params):
        self.k, self.g, self.params = kernel, gmem, params

    def val(self, t, tok, w=64):
        if tok.startswith("%"):
            return t.regs[tok]
        if tok in self.k.shared:
            return self.k.shared[tok]
        if tok in self.k.local:
            return LOCAL + t.tid * self.local_size + self.local_at[tok]
        return imm(tok) & M[max(w, 8)] if w > 1 else imm(tok)

    def addr(self, t, tok):
        inner = tok.strip("[]")
        m = re.match(r"([%\w.]+)\s*(?:\+\s*(-?\d+))?$", inner)
        base, off = m.group(1), int(m.group(2) or 0)
        if base in self.params:
            return ("param", base)
        return self.val(t, base) + off

    def mem(self, space, a):
        """(memory, address in it): local addresses (generic ones too) lie above LOCAL."""
        if space == "local" or a >= LOCAL:
            return self.lmem, a - LOCAL
        return (self.smem if space == "shared" else self.g), a

    def load(self, space, a, nbytes):
        mem, a = self.mem(space, a)
        return int.from_bytes(bytes(mem[a:a + nbytes]), "little")

    def store(self, space, a, nbytes, v):
        mem, a = self.mem(space, a)
        mem[a:a + nbytes] = np.frombuffer((v & M[nbytes * 8]).to_bytes(nbytes, "little"), np.uint8)

    def run_block(self, ctaid, ntid, nctaid):
        self.smem = np.zeros(max(self.k.shared_size, 16), np.uint8)
        self.local_at, self.local_size = {}, 0
        for name, n in self.k.local.items():
            self.local_at[name], self.local_size = self.local_size, self.local_size + (n + 15) // 16 * 16
        self.lmem = np.zeros(max(self.local_size * ntid, 16), np.uint8)
        ts = [Thread(i, ctaid, ntid, nctaid) for i in range(ntid)]
        while any(t.state != "done" for t in ts):
            for t in ts:
                if t.state == "run":
                    self.step_until_block(t)
            live = [t for t in ts if t.state != "done"]
            if live and all(t.state == "bar" for t in live):
                for t in live:
                    t.state, t.pc = "run", t.pc + 1
                continue
            progressed = False
            for w in range(0, ntid, 32):
                warp = ts[w:w + 32]
                if all(t.state == "coll" for t in warp):
                    pcs = {t.pc for t in warp}
                    assert len(pcs) == 1, pcs
                    self.collective(warp)
                    for t in warp:
                        t.state, t.pc = "run", t.pc + 1
                    progressed = True
            if not progressed and not any(t.state == "run" for t in ts) and not all(t.state == "bar" for t in live):
                raise RuntimeError(f"deadlock: {[t.state for t in ts]}")

    def step_until_block(self, t):
        code = self.k.code
        while True:
            pred, op, parts, ops = code[t.pc]
            if pred is not None:
                p = t.regs[pred[0]]
                if bool(p) == pred[1]:
                    t.pc += 1
                    continue
            head = parts[0]
            if head == "bar":
                t.state = "bar"
                return
            if head in ("ldmatrix", "mma"):
                t.state = "coll"
                return
            if head == "ret":
                t.state = "done"
                return
            if head == "bra":
                t.pc = self.k.labels[ops[0]]
                continue
            self.execute(t, op, parts, ops)
            t.pc += 1

    def execute(self, t, op, parts, ops):
        R = t.regs
        head, ty = parts[0], parts[-1]
        if head == "ld":
            space = parts[1]
            a = self.addr(t, ops[1])
            if space == "param":
                R[ops[0]] = self.params[a[1]]
                return
            if parts[2].startswith("v"):
                w = width(parts[3]) // 8
                regs = [r.strip() for r in ops[0].strip("{}").split(",")]
                for i, r in enumerate(regs):
                    R[r] = self.load(space, a + i * w, w)
            else:
                v = self.load(space, a, width(ty) // 8)
                R[ops[0]] = sgn(v, width(ty)) & M[64] if ty[0] == "s" else v  # ld.s32 into a 64-bit register
            return
        if head == "st":
            space = parts[1]
            a = self.addr(t, ops[0])
            if parts[2].startswith("v"):
                w = width(parts[3]) // 8
                regs = [r.strip() for r in ops[1].strip("{}").split(",")]
                for i, r in enumerate(regs):
                    self.store(space, a + i * w, w, self.val(t, r, w * 8))
            else:
                w = width(ty)
                self.store(space, a, w // 8, self.val(t, ops[1], w))
            return
        if head in ("red", "atom"):  # red/atom.global.add.T [a], v (atom also returns the old value)
            a = self.addr(t, ops[-2])
            nb = width(ty) // 8
            old = self.load(parts[1], a, nb)
            v = self.val(t, ops[-1], width(ty))
            if ty in FLOAT:
                get, put, np_t = FLOAT[ty]
                new = put(np_t(get(old)) + np_t(get(v)))
            else:
                new = old + v
            self.store(parts[1], a, nb, new)
            if head == "atom":
                R[ops[0]] = old
            return
        if head == "cvta":
            R[ops[0]] = self.val(t, ops[1])
            return
        w = width(ty) if ty != "pred" else 1
        V = lambda i: self.val(t, ops[i], w)  # noqa: E731
        if head == "mov":
            if ops[0].startswith("{"):  # unpack into halves
                parts_ = [r.strip() for r in ops[0].strip("{}").split(",")]
                x, hw = V(1), w // len(parts_)
                for i, r in enumerate(parts_):
                    if r != "_":
                        R[r] = (x >> (hw * i)) & M[hw]
                return
            if ops[1].startswith("{"):  # pack
                parts_ = [r.strip() for r in ops[1].strip("{}").split(",")]
                hw = w // len(parts_)
                R[ops[0]] = sum((self.val(t, r, hw) & M[hw]) << (hw * i) for i, r in enumerate(parts_))
                return
            R[ops[0]] = V(1)
            return
        if head == "setp":
            cmp, ct = parts[1], parts[2]
            cw = width(ct)
            a, b = self.val(t, ops[1], cw), self.val(t, ops[2], cw)
            if ct in FLOAT:
                a, b = FLOAT[ct][0](a), FLOAT[ct][0](b)
                unordered = a != a or b != b
                if cmp in ("nan", "num"):  # unordered (either is NaN), ordered (neither)
                    R[ops[0]] = int(unordered == (cmp == "nan"))
                    return
                if unordered:  # ltu, equ, neu, ...: true; eq, ne, lt, ...: false
                    R[ops[0]] = int(cmp.endswith("u"))
                    return
                cmp = cmp[:2]
            elif ct[0] == "s":
                a, b = sgn(a, cw), sgn(b, cw)
            r = {"eq": a == b, "ne": a != b, "lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}[cmp]
            R[ops[0]] = int(r)
            return
        if head == "selp":
            R[ops[0]] = V(1) if t.regs[ops[3]] else V(2)
            return
        if head in ("and", "or", "xor", "not") and ty == "pred":
            a = t.regs[ops[1]]
            if head == "not":
                R[ops[0]] = 1 - a
                return
            b = t.regs[ops[2]]
            R[ops[0]] = {"and": a & b, "or": a | b, "xor": a ^ b}[head]
            return
        if ty in FLOAT and head not in ("cvt",):
            get, put, np_t = FLOAT[ty]
            x = [np_t(get(V(i))) for i in range(1, len(ops))]
            if head == "add":
                r = x[0] + x[1]
            elif head == "sub":
                r = x[0] - x[1]
            elif head == "mul":
                r = x[0] * x[1]
            elif head == "fma":
                r = np_t(np.longdouble(x[0]) * np.longdouble(x[1]) + np.longdouble(x[2]))
            elif head == "div":
                r = x[0] / x[1]
            elif head == "rcp":
                r = np_t(1) / x[0]
            elif head == "sqrt":
                r = np.sqrt(x[0])
            elif head == "rsqrt":
                r = np_t(1) / np.sqrt(x[0])
            elif head == "abs":
                r = abs(x[0])
            elif head == "neg":
                r = -x[0]
            elif head == "min":
                r = min(x[0], x[1])
            elif head == "max":
                r = max(x[0], x[1])
            elif head == "copysign":  # sign of a onto b
                r = np.copysign(x[1], x[0])
            elif head == "ex2":
                r = np_t(2.0 ** float(x[0]))
            elif head == "lg2":
                r = np_t(np.log2(float(x[0]))) if x[0] > 0 else np_t(-np.inf if x[0] == 0 else np.nan)
            elif head == "testp":  # testp.finite / .infinite / .nan / .notanumber / .number
                v = float(x[0])
                R[ops[0]] = int({"finite": np.isfinite(v), "infinite": np.isinf(v), "nan": np.isnan(v),
                                 "notanumber": np.isnan(v), "number": not np.isnan(v)}[parts[1]])
                return
            else:
                raise NotImplementedError(op)
            R[ops[0]] = put(r)
            return
        if head == "cvt":
            dt, st = [p for p in parts[1:] if p not in ("rn", "rni", "rzi", "rmi", "rpi", "rz", "sat", "ftz")][:2]
            x = self.val(t, ops[1], width(st))
            if st == dt and st in FLOAT:
                v = FLOAT[st][0](x)
                rnd = np.rint if "rni" in parts else np.floor if "rmi" in parts else np.ceil if "rpi" in parts \
                    else np.trunc
                R[ops[0]] = FLOAT[dt][1](rnd(v))
            elif st in FLOAT and dt in FLOAT:
                R[ops[0]] = FLOAT[dt][1](FLOAT[dt][2](np.float64(FLOAT[st][0](x))))
            elif dt in FLOAT and st[0] in "su":
                R[ops[0]] = FLOAT[dt][1](FLOAT[dt][2](sgn(x, width(st)) if st[0] == "s" else x & M[width(st)]))
            elif st in FLOAT and dt[0] in "su":  # (rni, rmi, rpi: rounded first; saturating as PTX is)
                v = float(FLOAT[st][0](x))
                v = np.rint(v) if "rni" in parts else np.floor(v) if "rmi" in parts else np.ceil(v) if "rpi" in parts \
                    else np.trunc(v)
                lo, hi = (-(1 << (width(dt) - 1)), (1 << (width(dt) - 1)) - 1) if dt[0] == "s" else (0, M[width(dt)])
                v = 0 if v != v else int(min(max(v, lo), hi))
                R[ops[0]] = v & M[width(dt)]
            else:  # integer conversions
                v = sgn(x, width(st)) if st[0] == "s" else x & M[width(st)]
                R[ops[0]] = v & M[width(dt)]
            return
        # integer ops
        a = V(1) & M[w]
        b = V(2) & M[w] if len(ops) > 2 else 0
        signed = ty[0] == "s"
        if head == "add":
            r = a + b
        elif head == "sub":
            r = a - b
        elif head == "mul":
            mode = parts[1]
            if mode == "lo":
                r = a * b
            elif mode == "hi":
                r = ((sgn(a, w) * sgn(b, w)) if signed else a * b) >> w
            elif mode == "wide":
                r = (sgn(a, w) * sgn(b, w)) if signed else a * b
                R[ops[0]] = r & M[2 * w]
                return
        elif head == "mad":
            c = V(3) & M[w]
            mode = parts[1]
            if mode == "lo":
                r = a * b + c
            elif mode == "wide":
                r = ((sgn(a, w) * sgn(b, w)) if signed else a * b) + (c if not signed else c)
                c2 = self.val(t, ops[3], 2 * w)
                r = ((sgn(a, w) * sgn(b, w)) if signed else a * b) + c2
                R[ops[0]] = r & M[2 * w]
                return
            else:
                raise NotImplementedError(op)
        elif head == "and":
            r = a & b
        elif head == "or":
            r = a | b
        elif head == "xor":
            r = a ^ b
        elif head == "not":
            r = ~a
        elif head == "neg":
            r = -a
        elif head == "abs":
            r = abs(sgn(a, w))
        elif head == "shf":  # funnel shift of the pair (b:a) by c, the word that stays
            c = V(3) & (31 if "wrap" in parts else 63)
            c = min(c, 32)
            pair = (b << 32) | a
            r = ((pair << c) >> 32) if parts[1] == "l" else (pair >> c)
        elif head == "shl":
            r = a << b if b < w else 0
        elif head == "shr":
            r = (sgn(a, w) >> min(b, w)) if signed else (a >> b if b < w else 0)
        elif head == "bfe":
            pos, ln = V(2) & 0xFF, V(3) & 0xFF
            r = (a >> pos) & ((1 << ln) - 1)
        elif head in ("min", "max"):
            x, y = (sgn(a, w), sgn(b, w)) if signed else (a, b)
            r = min(x, y) if head == "min" else max(x, y)
        elif head == "div":
            r = int(sgn(a, w) / sgn(b, w)) if signed else a // b
        elif head == "rem":
            r = (sgn(a, w) - int(sgn(a, w) / sgn(b, w)) * sgn(b, w)) if signed else a % b
        else:
            raise NotImplementedError(op)
        R[ops[0]] = r & M[w]

    def collective(self, warp):
        pred, op, parts, ops = self.k.code[warp[0].pc]
        regs = lambda s: [r.strip() for r in s.strip("{}").split(",")]  # noqa: E731
        if parts[0] == "ldmatrix":
            n = int(parts[4][1:])
            addrs = [self.addr(t, ops[1]) for t in warp]
            for i in range(n):
                for lane, t in enumerate(warp):
                    row, pair = lane // 4, lane % 4
                    a = addrs[8 * i + row] + 4 * pair
                    t.regs[regs(ops[0])[i]] = self.load("shared", a, 4)
            return
        # mma.sync.aligned.m16n8k16.row.col.f32.X.X.f32
        kind = parts[7]
        conv = f16v if kind == "f16" else (lambda h: f32((h & 0xFFFF) << 16))
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        C = np.zeros((16, 8), np.float32)
        for lane, t in enumerate(warp):
            g, tq = lane // 4, lane % 4
            ar = [t.regs[r] for r in regs(ops[1])]
            for i in range(8):
                h = (ar[i // 2] >> (16 * (i % 2))) & 0xFFFF
                row = g if i < 2 or 4 <= i < 6 else g + 8
                col = tq * 2 + (i & 1) + (8 if i >= 4 else 0)
                A[row, col] = conv(h)
            br = [t.regs[r] for r in regs(ops[2])]
            for i in range(4):
                h = (br[i // 2] >> (16 * (i % 2))) & 0xFFFF
                B[tq * 2 + (i & 1) + (8 if i >= 2 else 0), g] = conv(h)
            cr = [f32(t.regs[r]) for r in regs(ops[3])]
            for i in range(4):
                C[g + (8 if i >= 2 else 0), tq * 2 + (i & 1)] = cr[i]
        D = (A @ B + C).astype(np.float32)
        for lane, t in enumerate(warp):
            g, tq = lane // 4, lane % 4
            for i, r in enumerate(regs(ops[0])):
                t.regs[r] = b32(D[g + (8 if i >= 2 else 0), tq * 2 + (i & 1)])


def run(ptx, buffers, grid, block):
    """buffers: numpy arrays (inputs then outputs), written back in place; returns the last."""
    k = Kernel(ptx)
    addrs, total = [], 4096
    for b in buffers:
        addrs.append(total)
        total += (b.nbytes + 255) // 256 * 256 + 256
    g = np.zeros(total, np.uint8)
    for a, b in zip(addrs, buffers):
        g[a:a + b.nbytes] = np.frombuffer(np.ascontiguousarray(b).tobytes(), np.uint8)
    emu = Emu(k, g, dict(zip(k.params, addrs)))
    with np.errstate(all="ignore"):  # IEEE results (inf, NaN) as the GPU gives them
        for c in range(grid):
            emu.run_block(c, block, grid)
    for a, b in zip(addrs, buffers):
        b[...] = np.frombuffer(g[a:a + b.nbytes].tobytes(), b.dtype).reshape(b.shape)
    return buffers[-1]


# ---- an emulated CUDA device: the backend whole (pool, copies, launches) over this interpreter ----

class EmuContext:
    """backends/cuda/driver.Context's interface over one emulated global memory: addresses are
    offsets into `mem`, launches run here (slow: small programs only)."""

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
        return None, Kernel(ptx)

    def launch(self, kernel, grid: int, block: int, ptrs) -> None:
        emu = Emu(kernel, self.mem, dict(zip(kernel.params, ptrs)))
        with np.errstate(all="ignore"):
            for c in range(grid):
                emu.run_block(c, block, grid)


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
