"""The training corpus every machine has without a download: the docstrings of a fixed list of
Python standard-library modules, as characters.

`load_corpus()` imports the modules (skipping any this Python lacks), collects module, class,
function and method docstrings in a fixed order (sorted names, duplicates dropped), and stops
at `max_chars`. `CharVocab` keeps the 95 most frequent characters and maps the rest to one
symbol, so the vocabulary has at most 96 entries. `WindowSampler` hands out training batches
from a position that a checkpoint can save.
"""
from __future__ import annotations

import collections
import functools
import importlib
import inspect
import warnings

import numpy as np

MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "builtins", "calendar",
    "cmath", "codecs", "collections", "concurrent.futures", "configparser", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fractions",
    "functools", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html.parser",
    "http.client", "http.server", "imaplib", "inspect", "io", "ipaddress", "itertools", "json",
    "logging", "lzma", "mailbox", "math", "mimetypes", "multiprocessing", "numbers", "operator",
    "os", "pathlib", "pickle", "pkgutil", "platform", "plistlib", "poplib", "pprint", "queue",
    "random", "re", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "signal",
    "smtplib", "socket", "sqlite3", "ssl", "statistics", "string", "struct", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "time", "timeit", "tokenize", "traceback",
    "types", "typing", "unittest", "urllib.parse", "urllib.request", "uuid", "warnings",
    "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile", "zlib",
    # packages define their functions in submodules: name those too
    "asyncio.base_events", "asyncio.events", "asyncio.futures", "asyncio.locks", "asyncio.queues",
    "asyncio.streams", "asyncio.subprocess", "asyncio.tasks", "asyncio.transports",
    "concurrent.futures._base", "concurrent.futures.process", "concurrent.futures.thread",
    "email.utils", "email.parser", "email.headerregistry", "multiprocessing.pool",
    "multiprocessing.managers", "multiprocessing.connection", "unittest.case", "unittest.mock",
    "importlib.abc", "importlib.metadata", "importlib.util", "xml.sax.saxutils", "xml.sax.handler",
    "xmlrpc.client", "xmlrpc.server", "http.cookiejar", "http.cookies", "urllib.robotparser",
    "wsgiref.handlers", "socketserver", "ftplib", "optparse", "getopt", "locale", "fnmatch",
    "filecmp", "fileinput", "doctest", "pdb", "bdb", "cProfile", "profile", "pstats", "trace",
    "dis", "pickletools", "code", "codeop", "compileall", "symtable", "tomllib", "graphlib",
    "reprlib", "contextvars", "zoneinfo", "ctypes", "netrc", "quopri", "binascii", "colorsys",
    "wave", "pydoc", "_pydecimal", "_pyio", "_collections_abc", "_strptime", "_threading_local",
)
MAX_CHARS = 1_500_000
RARE = "\u00bf"  # what every character outside the vocabulary becomes (decoded as '¿')


def _docs_of(module) -> list[str]:
    docs = [module.__doc__]
    for name in sorted(vars(module)):
        if name.startswith("_"):
            continue
        obj = vars(module)[name]
        if getattr(obj, "__module__", None) != module.__name__:
            continue  # defined elsewhere (imported names): collected with its own module
        if inspect.isclass(obj):
            docs.append(obj.__doc__)
            for attr in sorted(vars(obj)):
                if not attr.startswith("_") or attr == "__init__":
                    docs.append(getattr(vars(obj)[attr], "__doc__", None))
        elif callable(obj):
            docs.append(obj.__doc__)
    return [d for d in docs if isinstance(d, str)]


@functools.lru_cache(maxsize=4)
def load_corpus(max_chars: int = MAX_CHARS, modules: tuple = MODULES) -> str:
    """The docstring text, deterministic for a given Python version, at most max_chars long."""
    seen, parts, total = set(), [], 0
    for modname in modules:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(modname)
        except Exception:  # noqa: BLE001 - a module this Python lacks is skipped
            continue
        for doc in _docs_of(module):
            text = inspect.cleandoc(doc).strip()
            if len(text) < 40 or text in seen:  # one-liners and inherited duplicates add little
                continue
            seen.add(text)
            parts.append(text + "\n\n")
            total += len(parts[-1])
            if total >= max_chars:
                return "".join(parts)[:max_chars]
    return "".join(parts)


class CharVocab:
    """Characters <-> ids: the `size - 1` most frequent characters, sorted, then RARE."""

    def __init__(self, text: str, size: int = 96):
        counts = collections.Counter(text)
        keep = sorted(c for c, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size - 1])
        self.chars = keep + [RARE]
        self.rare_id = len(keep)
        self._ids = {c: i for i, c in enumerate(keep)}
        self._table = np.full(0x110000, self.rare_id, np.int32)
        self._table[[ord(c) for c in keep]] = np.arange(len(keep), dtype=np.int32)

    @property
    def size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        return self._table[codes]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in np.asarray(ids).reshape(-1))


class Corpus:
    """The encoded corpus split into a training part and a held-out tail."""

    def __init__(self, max_chars: int = MAX_CHARS, eval_fraction: float = 0.1, vocab_size: int = 96):
        text = load_corpus(max_chars)
        self.vocab = CharVocab(text, vocab_size)
        ids = self.vocab.encode(text)
        cut = int(len(ids) * (1.0 - eval_fraction))
        self.train, self.eval = ids[:cut], ids[cut:]

    def unigram_loss(self) -> float:
        """Cross entropy (nats/char) on the held-out part of the add-one unigram model of the
        training part: the loss a model that ignores context reaches."""
        p = np.bincount(self.train, minlength=self.vocab.size) + 1.0
        p /= p.sum()
        return float(-np.log(p[self.eval]).mean())


class WindowSampler:
    """Training batches of `batch` windows of seq + 1 characters (inputs and shifted targets).

    The train split is cut into non-overlapping windows; every epoch visits them all in an
    order drawn from (seed, epoch). `position` counts the windows handed out so far: it is all
    a checkpoint needs to continue the same stream of batches."""

    def __init__(self, tokens: np.ndarray, batch: int, seq: int, seed: int = 0, position: int = 0):
        self.tokens, self.batch, self.seq, self.seed = tokens, batch, seq, seed
        self.n_windows = (len(tokens) - 1) // seq
        if self.n_windows < 1:
            raise ValueError(f"a corpus of {len(tokens)} tokens has no window of {seq + 1}")
        self.position = position
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)}
        return self._orders[epoch]

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        idx = np.arange(self.position, self.position + self.batch)
        starts = np.array([self._order(int(i) // self.n_windows)[int(i) % self.n_windows] for i in idx])
        self.position += self.batch
        win = self.tokens[(starts * self.seq)[:, None] + np.arange(self.seq + 1)]
        return win[:, :-1].astype(np.int32), win[:, 1:].astype(np.int32)


def eval_batches(tokens: np.ndarray, batch: int, seq: int, max_batches: int = 8):
    """The first max_batches batches of consecutive held-out windows (the same every time)."""
    n = (len(tokens) - 1) // seq
    out = []
    for b in range(min(max_batches, n // batch)):
        starts = np.arange(b * batch, (b + 1) * batch) * seq
        win = tokens[starts[:, None] + np.arange(seq + 1)]
        out.append((win[:, :-1].astype(np.int32), win[:, 1:].astype(np.int32)))
    return out
