"""Building OpenCL programs (cached) and turning pyopencl failures into tilefuse errors."""
from __future__ import annotations

import os
import warnings

from tilefuse.ir.errors import CompileError, DeviceError, OutOfMemoryError, TilefuseError

# build options: plain IEEE semantics (no fast-math: NaN and inf must survive max/min/isnan)
OPTIONS: tuple = ("-w",)  # warnings (e.g. the float16 ABI note without AVX-512) are noise


def cache_dir() -> str:
    """pyopencl's binary cache lives beside ours. PoCL and NVIDIA cache builds themselves (keyed
    by source and device), so pyopencl skips its own cache there; other ICDs use this folder."""
    root = os.environ.get("TILEFUSE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tilefuse")
    return os.path.join(root, "opencl")


_ALLOC_CODES = ("MEM_OBJECT_ALLOCATION_FAILURE", "OUT_OF_HOST_MEMORY", "INVALID_BUFFER_SIZE")


def _code_name(e) -> str:
    import pyopencl as cl
    code = getattr(e, "code", None)
    for name in dir(cl.status_code):
        if not name.startswith("_") and getattr(cl.status_code, name) == code:
            return name
    return str(code)


def translate(e: Exception, action: str, device, nbytes: int | None = None) -> TilefuseError:
    """The tilefuse error for a pyopencl failure while doing `action` on `device`."""
    code = _code_name(e)
    if code in _ALLOC_CODES or (code == "OUT_OF_RESOURCES" and nbytes is not None):
        size = f" of {nbytes} bytes" if nbytes is not None else ""
        return OutOfMemoryError(f"{device}: could not {action}{size} ({code}); free arrays you no "
                                "longer need or use smaller shapes")
    if code == "OUT_OF_RESOURCES":
        return DeviceError(f"{device}: the device ran out of resources to {action} (OUT_OF_RESOURCES); "
                           "the kernel may need too many registers or too large a work-group")
    return DeviceError(f"{device}: failed to {action}: {code}: {e}")


class ProgramCache:
    """Built kernels in memory, keyed by (source, device); building goes through pyopencl, whose
    binary cache (or the ICD's own) makes a second process skip the compiler. One program may
    hold several kernels: PoCL spends most of a build in fixed costs, so a batch builds faster."""

    def __init__(self):
        self._mem: dict = {}
        self.builds = 0  # program builds this process asked for (hits in memory do not count)

    def kernels(self, ctx, cl_device, source: str, names: list, kernel_text: str = "") -> list:
        import pyopencl as cl
        key = (source, cl_device.int_ptr)
        got = self._mem.get(key)
        if got is not None:
            return got
        self.builds += 1
        what = f"kernel {names[0]}" if len(names) == 1 else f"{len(names)} kernels"
        try:
            with warnings.catch_warnings():  # a non-empty build log is not an error
                warnings.simplefilter("ignore", cl.CompilerWarning)
                prg = cl.Program(ctx, source).build(options=list(OPTIONS), devices=[cl_device],
                                                    cache_dir=cache_dir())
            got = [cl.Kernel(prg, n) for n in names]
        except cl.Error as e:
            if _code_name(e) in _ALLOC_CODES + ("OUT_OF_RESOURCES",):
                raise translate(e, f"build {what}", cl_device.name) from None
            raise CompileError(f"opencl: building {what} for {cl_device.name.strip()} failed; "
                               f"build log:\n{build_log(e)}", backend="opencl", kernel=kernel_text,
                               source=source) from None
        self._mem[key] = got
        return got

    def kernel(self, ctx, cl_device, source: str, name: str, kernel_text: str = ""):
        return self.kernels(ctx, cl_device, source, [name], kernel_text)[0]


def build_log(e: Exception) -> str:
    """The compiler's log from a failed build (pyopencl puts it in the message)."""
    msg = str(e)
    start = msg.find("Build on")
    text = msg[start:] if start >= 0 else msg
    return "\n".join(ln for ln in text.splitlines() if "(source saved as" not in ln).strip()
