"""Global configuration: `tx.config.<name> = value` or a TILEFUSE_<NAME> environment variable."""
from __future__ import annotations

import os


def _env_bool(name: str, default: bool = False) -> bool:
    v = os.environ.get(name)
    return default if v is None else v.strip().lower() not in ("", "0", "false", "no", "off")


class Config:
    """Settings read by jit, the passes and the dispatcher. Those that change compiled code are
    part of every jit cache key (`cache_key`)."""

    _COMPILE_KEYS = ("gemm", "fusion", "default_device")

    def __init__(self):
        self.default_device: str | None = os.environ.get("TILEFUSE_DEVICE") or None
        self.explain_retrace: bool = _env_bool("TILEFUSE_EXPLAIN_RETRACE")
        self.debug_nans: bool = _env_bool("TILEFUSE_DEBUG_NANS")
        self.debug: int = int(os.environ.get("TILEFUSE_DEBUG", "0") or 0)
        self.check: bool = _env_bool("TILEFUSE_CHECK")
        self.dump_dir: str | None = os.environ.get("TILEFUSE_DUMP") or None
        self.gemm: str = os.environ.get("TILEFUSE_GEMM", "auto")
        self.fusion: bool = _env_bool("TILEFUSE_FUSION", True)

    def cache_key(self) -> tuple:
        return tuple(getattr(self, k) for k in self._COMPILE_KEYS)

    def update(self, **kw) -> None:
        for k, v in kw.items():
            if not hasattr(self, k):
                raise AttributeError(f"tilefuse.config has no setting {k!r}")
            setattr(self, k, v)

    def __repr__(self):
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in vars(self).items()) + ")"


config = Config()
