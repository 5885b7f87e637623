"""Building OpenCL programs (cached) and turning pyopencl failures into tilefuse errors."""
from __future__ import annotations

import os
import warnings

from tilefuse.ir.errors import CompileError, DeviceError, OutOfMemoryError, TilefuseError
from tilefuse.runtime import compile_cache

from .prelude import with_declarations

# build options: plain IEEE semantics (no fast-math: NaN and inf must survive max/min/isnan)
OPTIONS: tuple = ("-w",)  # warnings (e.g. the float16 ABI note without AVX-512) are noise


def _device_id(cl_device) -> tuple:
    """What decides a program binary besides its source: the device, its driver and platform,
    and PoCL's code-generation settings (POCL_LLVM_CPU_NAME and the like; not where it caches)."""
    env = tuple(sorted((k, v) for k, v in os.environ.items()
                       if k.startswith("POCL_") and k not in ("POCL_CACHE_DIR", "POCL_DEBUG")))
    return (cl_device.name, cl_device.version, cl_device.driver_version, cl_device.platform.name,
            cl_device.platform.version, env)


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
    """Built kernels in memory, keyed by (source, device), and program binaries on disk (the
    compile cache's "opencl" namespace), kept from a program's second build on, in any process (a
    marker records the first), for drivers that do not cache builds themselves.
    Not on PoCL: it caches each program and each kernel it compiled at a launch, and asking it for
    a binary compiles every kernel again for any work-group size (0.5 s for a GEMM), which made a
    script's second run as slow as its first (an MLP's training on opencl:0, runs 1/2/3 of one
    process each on the same caches: 10.1/12.9/0.95 s with binaries, 13.8/1.3/1.2 s without).
    One program may hold several kernels: a build has fixed costs, so a batch builds faster.
    On PoCL a program is built with the declarations of the builtins it calls in place of
    opencl-c.h (backends/opencl/prelude.py: 40-50 ms a program instead of 150-200); one that
    builds only with the header is built with it and counted in `header_builds`."""

    def __init__(self):
        self._mem: dict = {}
        self._disk = None
        self.builds = 0  # program builds this process asked for (hits in memory do not count)
        self.header_builds: list = []  # names of the programs PoCL built only with opencl-c.h

    def kernels(self, ctx, cl_device, source: str, names: list, kernel_text: str = "") -> list:
        import pyopencl as cl
        key = (source, cl_device.int_ptr)
        got = self._mem.get(key)
        if got is not None:
            return got
        self.builds += 1
        if _is_pocl(cl_device):
            prg = self._from_source(ctx, cl_device, source, names, kernel_text)
        else:
            if self._disk is None:
                self._disk = compile_cache.CompileCache("opencl", compile_cache.default_dir())
            disk_key = compile_cache.make_key("opencl-program", source, OPTIONS, _device_id(cl_device))
            prg = self._from_binary(ctx, cl_device, disk_key)
            if prg is None:
                prg = self._from_source(ctx, cl_device, source, names, kernel_text)
                prg = self._keep_binary(prg, ctx, cl_device, disk_key)
        got = [cl.Kernel(prg, n) for n in names]
        self._mem[key] = got
        return got

    def _keep_binary(self, prg, ctx, cl_device, disk_key: str):
        """Record a program's first build; store its binary at the second (and use the program
        built from it: its launches compile nothing more)."""
        if not self._disk.dir:
            return prg
        seen_key = compile_cache.make_key("opencl-built-once", disk_key)
        if not self._disk.has(seen_key):
            self._disk.store(seen_key, b"")
            return prg
        binary = _binary(prg, cl_device)
        if not binary:
            return prg
        self._disk.store(disk_key, binary)
        return _built(ctx, cl_device, binary) or prg

    def _from_binary(self, ctx, cl_device, disk_key: str):
        """The program built from its binary in the disk cache, or None (absent, or one the driver
        refuses: removed, to be rebuilt from source)."""
        binary = self._disk.load(disk_key)
        prg = None if binary is None else _built(ctx, cl_device, binary)
        if binary is not None and prg is None:
            self._disk.remove(disk_key)
        return prg

    def _from_source(self, ctx, cl_device, source: str, names: list, kernel_text: str):
        import pyopencl as cl
        what = f"kernel {names[0]}" if len(names) == 1 else f"{len(names)} kernels"
        pocl = _is_pocl(cl_device)
        with warnings.catch_warnings():  # a non-empty build log is not an error
            warnings.simplefilter("ignore", cl.CompilerWarning)
            if pocl:
                try:  # (PoCL's _kernel.h reads opencl-c.h unless _OPENCL_H_ is defined)
                    return cl.Program(ctx, with_declarations(source)).build(
                        options=list(OPTIONS) + ["-D_OPENCL_H_"], devices=[cl_device])
                except cl.Error:
                    pass
            try:
                prg = cl.Program(ctx, source).build(options=list(OPTIONS), devices=[cl_device])
            except cl.Error as e:
                if _code_name(e) in _ALLOC_CODES + ("OUT_OF_RESOURCES",):
                    raise translate(e, f"build {what}", cl_device.name) from None
                raise CompileError(f"opencl: building {what} for {cl_device.name.strip()} failed; "
                                   f"build log:\n{build_log(e)}", backend="opencl", kernel=kernel_text,
                                   source=source) from None
        if pocl:
            self.header_builds.append(what if len(names) > 1 else names[0])
        return prg

    def kernel(self, ctx, cl_device, source: str, name: str, kernel_text: str = ""):
        return self.kernels(ctx, cl_device, source, [name], kernel_text)[0]


def _is_pocl(cl_device) -> bool:
    return cl_device.platform.name == "Portable Computing Language"


def _built(ctx, cl_device, binary: bytes):
    """The program built from a binary, or None where the driver refuses it."""
    import pyopencl as cl
    try:
        return cl.Program(ctx, [cl_device], [binary]).build(options=list(OPTIONS))
    except cl.Error:
        return None


def _binary(prg, cl_device) -> bytes:
    """The program's binary for cl_device (b"" where the driver gives none)."""
    import pyopencl as cl
    try:
        devices = prg.get_info(cl.program_info.DEVICES)
        return bytes(prg.get_info(cl.program_info.BINARIES)[devices.index(cl_device)])
    except (cl.Error, ValueError):
        return b""


def build_log(e: Exception) -> str:
    """The compiler's log from a failed build (pyopencl puts it in the message)."""
    msg = str(e)
    start = msg.find("Build on")
    text = msg[start:] if start >= 0 else msg
    return "\n".join(ln for ln in text.splitlines() if "(source saved as" not in ln).strip()
