"""The persistent compile cache: compiled artefacts (object code, PTX, binaries) on disk, keyed by
a sha256 of everything that decides them (kernel text, parameters, toolchain version, device
fingerprint, backend version). Backend-neutral: payloads are bytes.

Directory `TILEFUSE_CACHE_DIR` (default ~/.cache/tilefuse; "off" disables it), created 0700.
Each entry is written atomically (temporary file + os.replace) with a header holding the key
hash and a sha256 of the payload; an entry whose header, length or checksum does not match is
counted as corrupt, removed, and rebuilt — never loaded. The backends' payloads are not pickled
(the front-end cache's are JSON: runtime/frontend_cache.py). A namespace keeps at most
MAX_ENTRIES entries: opening it drops the least recently used beyond that.

Trust: object code from the cache runs as the user, and a checksum is no authentication (anyone
who can write an entry can write its header). The trust boundary is ownership: a cache folder
(and every entry read from it) must belong to the user running tilefuse and be writable by
nobody else. A folder that is not (a shared or world-writable TILEFUSE_CACHE_DIR, another user's
home) is refused with one UntrustedCacheWarning, and this process caches in a private temporary
folder instead; an entry that is not is ignored, removed and rebuilt."""
from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import stat
import struct
import tempfile
import threading
import warnings
from typing import Callable

MAGIC = b"TFCACHE1"
MAX_ENTRIES = 8192
_HEADER = struct.Struct("<8s32sQ32s")  # magic, key digest, payload length, payload sha256

_stats = {"compiles": 0, "disk_hits": 0, "disk_writes": 0, "corrupt": 0, "write_errors": 0,
          "untrusted": 0}
_lock = threading.Lock()


def stats() -> dict:
    """Process-wide counters: compiles (builds run), disk_hits (entries loaded), disk_writes,
    corrupt (entries rejected), write_errors, untrusted (entries of another owner or mode refused)."""
    with _lock:
        return dict(_stats)


def reset_stats() -> None:
    with _lock:
        for k in _stats:
            _stats[k] = 0


def _count(name: str) -> None:
    with _lock:
        _stats[name] += 1


def make_key(*parts) -> str:
    """The hex sha256 of the parts (strings, numbers, tuples of them), unambiguously joined."""
    h = hashlib.sha256()
    for p in parts:
        b = repr(p).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def default_dir() -> str | None:
    d = os.environ.get("TILEFUSE_CACHE_DIR")
    if d is not None and d.strip().lower() in ("", "0", "off", "none"):
        return None
    return d or os.path.join(os.path.expanduser("~"), ".cache", "tilefuse")


class CacheWarning(RuntimeWarning):
    """A cache entry on disk was damaged and is being rebuilt."""


class UntrustedCacheWarning(CacheWarning):
    """A cache folder, database or entry belongs to another user or others can write to it."""


# ---- trust: the folder's owner and mode --------------------------------------------------------

def current_uid() -> int | None:
    """The user whose files we trust (None where the OS has no owners); tests replace it."""
    return os.getuid() if hasattr(os, "getuid") else None


def untrusted(st: os.stat_result) -> str | None:
    """Why a file or folder with this stat cannot be trusted, or None: it must be the user's and
    writable by nobody else."""
    uid = current_uid()
    if uid is None:
        return None
    if st.st_uid != uid:
        return f"it belongs to uid {st.st_uid}, not to you (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others can write to it (mode {stat.S_IMODE(st.st_mode):o})"
    return None


_warned: set = set()
_private: list = []  # this process's fallback folder, made on first need


def warn_untrusted(path: str, why: str, what: str = "cache folder",
                   instead: str = "this process caches in a private temporary folder") -> None:
    """One warning per path: what is refused and why, and what to do."""
    with _lock:
        if path in _warned:
            return
        _warned.add(path)
    warnings.warn(f"tilefuse: the {what} {path} is not used because {why} (what it holds runs as "
                  f"you; a checksum proves nothing about who wrote it): {instead}. Keep the cache "
                  "in a folder of your own that nobody else can write (chmod 700, TILEFUSE_CACHE_DIR).",
                  UntrustedCacheWarning, stacklevel=3)


def private_dir() -> str:
    """A folder of this process's own (0700, removed at exit): where caching goes when the
    configured folder cannot be trusted."""
    with _lock:
        if not _private:
            d = tempfile.mkdtemp(prefix="tilefuse-cache-")
            atexit.register(shutil.rmtree, d, True)
            _private.append(d)
        return _private[0]


def trusted_dir(directory: str) -> str:
    """`directory`, created 0700 if missing, when it can be trusted; else (with a warning) the
    process's private folder."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        why = untrusted(os.stat(directory))
    except OSError:  # read-only, no space, ...: the caller goes without a disk cache
        return directory
    if why is None:
        return directory
    warn_untrusted(directory, why)
    return private_dir()


class CompileCache:
    """One namespace (e.g. "llvm") of the on-disk cache. `directory=None` keeps nothing on disk."""

    def __init__(self, namespace: str, directory: str | None = None):
        self.namespace = namespace
        self.dir = None
        if directory:
            ns = os.path.join(trusted_dir(directory), namespace)
            if trusted_dir(ns) != ns:  # planted by someone else
                ns = os.path.join(private_dir(), namespace)
            self.dir = ns
            try:
                os.makedirs(ns, mode=0o700, exist_ok=True)
                os.chmod(ns, 0o700)  # ours (checked): now readable by nobody else either
            except OSError:
                self.dir = None  # read-only home, no space, ...: compile without a disk cache
            else:
                self.prune(MAX_ENTRIES)

    def prune(self, max_entries: int) -> int:
        """Remove the least recently used entries beyond max_entries; returns how many."""
        try:
            entries = [e for e in os.scandir(self.dir) if e.name.endswith(".bin")]
        except OSError:
            return 0
        if len(entries) <= max_entries:
            return 0

        def mtime(e):  # another process may prune the same folder: a vanished entry is oldest
            try:
                return e.stat().st_mtime
            except OSError:
                return 0.0
        entries.sort(key=mtime)
        drop = entries[:len(entries) - int(max_entries * 0.8)]
        for e in drop:
            try:
                os.unlink(e.path)
            except OSError:
                pass
        return len(drop)

    def path(self, key: str) -> str:
        return os.path.join(self.dir, key + ".bin")

    def has(self, key: str) -> bool:
        """Whether an entry exists (not whether it is sound: load checks that)."""
        return bool(self.dir) and os.path.exists(self.path(key))

    def load(self, key: str) -> bytes | None:
        """The payload stored under `key`, or None when absent or not trustworthy."""
        if not self.dir:
            return None
        try:
            fd = os.open(self.path(key), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)  # the file read, not the name: no race with a swap
            why = untrusted(st) or (None if stat.S_ISREG(st.st_mode) else "it is not a regular file")
            data = None if why else f.read()
        if why:
            _count("untrusted")
            warn_untrusted(self.path(key), why, "compile cache entry", "it is removed and rebuilt")
            self.remove(key)
            return None
        payload = _check(data, key)
        if payload is not None:
            try:
                os.utime(self.path(key))  # recently used: kept by prune
            except OSError:
                pass
        if payload is None:
            _count("corrupt")
            warnings.warn(f"tilefuse: the compile cache entry {self.path(key)} is corrupt (its header, "
                          "length or checksum does not match); it is ignored and rebuilt",
                          CacheWarning, stacklevel=2)
            self.remove(key)
            return None
        _count("disk_hits")
        return payload

    def remove(self, key: str) -> None:
        try:
            os.unlink(self.path(key))
        except OSError:
            pass

    def store(self, key: str, payload: bytes) -> None:
        if not self.dir:
            return
        header = _HEADER.pack(MAGIC, bytes.fromhex(key), len(payload), hashlib.sha256(payload).digest())
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(header)
                    f.write(payload)
                os.replace(tmp, self.path(key))
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:
            _count("write_errors")
            return
        _count("disk_writes")

    def get_or_build(self, key: str, build: Callable[[], bytes], use: Callable | None = None):
        """use(payload) (the payload itself without `use`): from the entry on disk, else from
        build() (counted as a compile), then stored. An entry that `use` fails on (object code
        that does not link: damaged before its checksum was taken) is a miss like a corrupt one:
        removed, rebuilt and replaced."""
        payload = self.load(key)
        if payload is not None:
            if use is None:
                return payload
            try:
                return use(payload)
            except Exception as e:  # noqa: BLE001 - whatever it is, the entry is at fault: rebuild
                _count("corrupt")
                warnings.warn(f"tilefuse: the compile cache entry {self.path(key)} does not load "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); it is "
                              "ignored and rebuilt", CacheWarning, stacklevel=2)
                self.remove(key)
        _count("compiles")
        payload = build()
        self.store(key, payload)
        return payload if use is None else use(payload)


def _check(data: bytes, key: str) -> bytes | None:
    if len(data) < _HEADER.size:
        return None
    magic, digest, length, checksum = _HEADER.unpack_from(data)
    payload = data[_HEADER.size:]
    if magic != MAGIC or digest != bytes.fromhex(key) or length != len(payload):
        return None
    if hashlib.sha256(payload).digest() != checksum:
        return None
    return payload
