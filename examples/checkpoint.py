"""Files of a training run that survive kills and full disks and refuse damaged or crafted
content: the helpers examples/train_transformer.py uses, written to be copied into your own
training loop (they need numpy only, and tilefuse for the error class).

- `write_npz(path, arrays)`: atomically (a temporary file beside `path`, fsync, rename), so a
  kill leaves the previous checkpoint whole; on any failure the temporary file is removed, and
  a full disk is a CheckpointError that says how much space the file needs and how much is free.
- `remove_stale_temporaries(path)`: the temporary files of processes that were killed while
  writing (call it at the start of a run: they would keep a full disk full).
- `read_npz(path)`: every entry of an .npz without unpickling anything (allow_pickle=False);
  an error names the entry at fault. `int_entry` and `json_entry` read scalar entries checked.
- `append_line(path, text)` and `read_jsonl(path)`: a metrics log; a torn last line (a kill in
  the middle of a write) is dropped when it is read back.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
import warnings
import zipfile

import numpy as np
from tilefuse.ir.errors import TilefuseError


class CheckpointError(TilefuseError):
    """A checkpoint or log of a training run cannot be written or used."""


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _disk_full(path: str, need: int) -> CheckpointError:
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    return CheckpointError(f"cannot write {path}: the disk is full (it needs about {_size(need)}, "
                           f"{_size(free)} are free); the previous file is intact: free some space "
                           "(or write elsewhere) and continue")


def _no_space(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def temporary_name(path: str) -> str:
    return f"{path}.tmp{os.getpid()}"


def write_npz(path: str, arrays: dict) -> None:
    """Write `arrays` to `path` atomically; see the module docstring."""
    need = sum(np.asarray(a).nbytes + 512 for a in arrays.values()) + 4096  # + .npy and zip headers
    if shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free < need:
        raise _disk_full(path, need)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if _no_space(e):
            raise _disk_full(path, need) from e
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a power cut
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_temporaries(path: str) -> list[str]:
    """Remove `path`'s temporary files whose writer is gone (killed while writing); returns them."""
    removed = []
    for tmp in glob.glob(glob.escape(path) + ".tmp*"):
        suffix = tmp[len(path) + 4:]
        if suffix.isdigit() and (int(suffix) == os.getpid() or _alive(int(suffix))):
            continue  # being written now
        with contextlib.suppress(OSError):
            os.unlink(tmp)
            removed.append(tmp)
    return removed


def read_npz(path: str, bad) -> dict[str, np.ndarray]:
    """Every entry of the .npz at `path`; `bad(why)` makes the error to raise (naming the file)."""
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise bad(f"it is corrupt or truncated ({type(e).__name__}: {e})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise bad("it is a single array, not a checkpoint (.npz)")
    arrays = {}
    with z:
        for k in z.files:
            try:
                arrays[k] = z[k]
            except ValueError as e:
                if "allow_pickle" in str(e):
                    raise bad(f"its entry {k!r} holds Python objects (a pickle), which are never "
                              "loaded") from None
                raise bad(f"its entry {k!r} is damaged ({e})") from None
            except (OSError, EOFError, zipfile.BadZipFile, KeyError, RuntimeError) as e:
                raise bad(f"its entry {k!r} is damaged ({type(e).__name__}: {e})") from None
    return arrays


def int_entry(arrays: dict, name: str, bad, minimum: int = 0) -> int:
    """A scalar integer entry, at least `minimum`."""
    a = arrays[name]
    if a.shape != () or a.dtype.kind not in "iu" or int(a) < minimum:
        what = f"{a.dtype}{list(a.shape)}" if a.shape != () or a.dtype.kind not in "iu" else int(a)
        raise bad(f"its {name!r} entry is {what}, not an integer >= {minimum}")
    return int(a)


def json_entry(arrays: dict, name: str, bad):
    """A scalar string entry holding JSON."""
    a = arrays[name]
    if a.shape != () or a.dtype.kind != "U":
        raise bad(f"its {name!r} entry is {a.dtype}{list(a.shape)}, not a JSON string")
    try:
        return json.loads(str(a))
    except ValueError as e:
        raise bad(f"its {name!r} entry is not valid JSON ({e})") from None


def append_line(path: str, text: str) -> None:
    """Append one line in one write (a kill leaves at most that line torn)."""
    try:
        with open(path, "a") as f:
            f.write(text.rstrip("\n") + "\n")
    except OSError as e:
        if _no_space(e):
            raise _disk_full(path, len(text) + 1) from e
        raise


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSON-lines file; a torn last line is dropped, other damaged lines are
    dropped with a warning naming them."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    records, damaged = [], []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict):
            if i < len(lines) - 1:  # a last line without its newline is torn: expected after a kill
                damaged.append(i + 1)
            continue
        records.append(rec)
    if damaged:
        warnings.warn(f"{path}: lines {damaged} are damaged and were dropped", stacklevel=2)
    return records


def write_text(path: str, text: str) -> None:
    """Replace a text file atomically."""
    tmp = temporary_name(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if _no_space(e):
            raise _disk_full(path, len(text)) from e
        raise
