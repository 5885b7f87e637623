"""Global configuration: `tx.config.<name> = value` or a TILEFUSE_<NAME> environment variable."""
from __future__ import annotations

import os


def _env_bool(name: str, default: bool = False) -> bool:
    v = os.environ.get(name)
    return default if v is None else v.strip().lower() not in ("", "0", "false", "no", "off")


def _env_tiered() -> bool | str:
    v = os.environ.get("TILEFUSE_TIERED", "auto").strip().lower()
    return "auto" if v == "auto" else _env_bool("TILEFUSE_TIERED")


class Config:
    """Settings read by jit, the passes and the dispatcher. Those that change compiled code are
    part of every jit cache key (`cache_key`, kept ready because jit reads it on every call)."""

    def __init__(self):
        object.__setattr__(self, "_compile_keys", ["gemm", "fusion", "default_device", "deterministic"])
        object.__setattr__(self, "_key", None)
        self.default_device: str | None = os.environ.get("TILEFUSE_DEVICE") or None
        self.explain_retrace: bool = _env_bool("TILEFUSE_EXPLAIN_RETRACE")
        self.debug_nans: bool = _env_bool("TILEFUSE_DEBUG_NANS")
        self.debug: int = int(os.environ.get("TILEFUSE_DEBUG", "0") or 0)
        self.check: bool = _env_bool("TILEFUSE_CHECK")
        self.dump_dir: str | None = os.environ.get("TILEFUSE_DUMP") or None
        self.gemm: str = os.environ.get("TILEFUSE_GEMM", "auto")
        self.fusion: bool = _env_bool("TILEFUSE_FUSION", True)
        # bit-for-bit repeatable results where a device would add floats in a racy order
        # (scatter-add with atomics on OpenCL/CUDA): those kernels then run serially
        self.deterministic: bool = _env_bool("TILEFUSE_DETERMINISTIC")
        # compiled programs kept per jitted function (and of eager operations), the least
        # recently used dropped first: each holds kernels and device constants; 0: no bound
        self.jit_cache_size: int = int(os.environ.get("TILEFUSE_JIT_CACHE_SIZE", "256") or 0)
        # a jitted graph's first calls run on the reference interpreter while its kernels compile
        # in the background (runtime/tiered.py; CPU devices): "auto" while its interpreted calls
        # took under the compile's estimate; True until the compile is done; False: never
        self.tiered: bool | str = _env_tiered()
        # jit traces with symbolic sizes, so a call at new sizes (an epoch's last batch) reuses
        # the trace where its guards allow instead of running the Python again (tracer/shape_poly.py)
        self.shape_generic: bool = _env_bool("TILEFUSE_SHAPE_GENERIC", True)
        # a simulated hardware description (runtime/hardware.py): a dict, or a JSON file's path;
        # None reads TILEFUSE_HDI. Read when a device is first used.
        self.hdi = None
        object.__setattr__(self, "_frozen", True)  # from here on, only known settings can be set

    def define(self, name: str, default, env: str | None = None, compiles: bool = False) -> None:
        """Add a setting (for a later layer); `env` names its environment variable; `compiles`
        makes it part of jit's cache key (it changes the compiled code)."""
        if env is not None and env in os.environ:
            raw = os.environ[env]
            default = _env_bool(env) if isinstance(default, bool) else type(default)(raw) \
                if default is not None else raw
        if compiles and name not in self._compile_keys:
            self._compile_keys.append(name)
        object.__setattr__(self, name, default)
        object.__setattr__(self, "_key", None)

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False) and not hasattr(self, name):
            known = ", ".join(k for k in vars(self) if not k.startswith("_"))
            raise AttributeError(f"tilefuse.config has no setting {name!r} (known: {known}); a new "
                                 "setting is added with tx.config.define(name, default, env=...)")
        object.__setattr__(self, name, value)
        if name in self._compile_keys:
            object.__setattr__(self, "_key", None)

    def cache_key(self) -> tuple:
        key = self._key
        if key is None:
            key = tuple(getattr(self, k, None) for k in self._compile_keys)
            object.__setattr__(self, "_key", key)
        return key

    def update(self, **kw) -> None:
        for k, v in kw.items():
            if not hasattr(self, k):
                raise AttributeError(f"tilefuse.config has no setting {k!r}")
            setattr(self, k, v)

    def __repr__(self):
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in vars(self).items()
                                     if not k.startswith("_")) + ")"


config = Config()
