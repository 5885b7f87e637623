"""What is read from disk is never unpickled: the compile cache holds raw bytes behind a header
checked by hash, checkpoints load with allow_pickle=False (a pickled entry is refused, its code
never run), pyopencl's pickle caches stay off; the cache directory is private (0700)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from tilefuse.runtime import compile_cache as cc

import tilefuse as tx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# code that reads files: none of it may unpickle (backends/llvm/parallel.py pickles jobs to its
# own worker process over a pipe, never through a file, and is the one exception)
READERS = ("runtime", "backends", "tilefuse", "tracer", "ir", "autodiff", "examples")
PIPE_ONLY = {os.path.join("backends", "llvm", "parallel.py")}
UNSAFE = re.compile(r"pickle\.loads?\(|from pickle import load|marshal\.loads?\(|shelve\.open|"
                    r"allow_pickle\s*=\s*True|dill\.|joblib\.load")


def test_no_code_that_reads_files_unpickles():
    found = []
    for top in READERS:
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(d, name)
                rel = os.path.relpath(path, ROOT)
                if name.endswith(".py") and rel not in PIPE_ONLY:
                    with open(path, encoding="utf-8") as f:
                        text = f.read()
                    found += [f"{rel}: {m.group(0)}" for m in UNSAFE.finditer(text)]
                    if "np.load(" in text and "allow_pickle=False" not in text:
                        found.append(f"{rel}: np.load without allow_pickle=False")
    assert not found, found


def test_cache_directory_is_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        cache = cc.CompileCache("ns", str(tmp_path / "fresh"))
    finally:
        os.umask(old)
    assert cache.dir == str(tmp_path / "fresh" / "ns")
    for d in ("fresh", "fresh/ns"):
        assert os.stat(tmp_path / d).st_mode & 0o777 == 0o700, d


# ---- the trust boundary: a cache folder and its entries must be the user's alone ---------------

def _entry_in(cache, key=None, payload=b"object code"):
    key = key or cc.make_key("kernel", payload)
    cache.store(key, payload)
    return key


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_cache_folder_others_can_write_is_refused(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.warns(cc.UntrustedCacheWarning, match=r"others can write to it .* private temporary"):
        cache = cc.CompileCache("ns", str(shared))
    assert not cache.dir.startswith(str(shared)) and cache.dir.startswith(cc.private_dir())
    assert os.stat(cc.private_dir()).st_mode & 0o777 == 0o700
    key = _entry_in(cache)
    assert cache.load(key) == b"object code"  # it still caches, privately
    assert os.listdir(shared) == [] and os.stat(shared).st_mode & 0o7777 == mode  # left as it was


def test_a_cache_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    mine = cc.CompileCache("ns", str(tmp_path / "c"))
    key = _entry_in(mine, payload=b"code of another user")
    monkeypatch.setattr(cc, "current_uid", lambda: os.getuid() + 1)  # as if someone else ran this
    with pytest.warns(cc.UntrustedCacheWarning, match=r"belongs to uid \d+, not to you"):
        theirs = cc.CompileCache("ns", str(tmp_path / "c"))
    assert theirs.dir.startswith(cc.private_dir()) and theirs.load(key) is None


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "another owner", "symlink"])
def test_an_untrusted_entry_is_ignored_removed_and_rebuilt(tmp_path, monkeypatch, how):
    cache = cc.CompileCache("ns", str(tmp_path / "c"))
    key = _entry_in(cache, payload=b"planted code")
    if how == "group-writable":
        os.chmod(cache.path(key), 0o620)
    elif how == "world-writable":
        os.chmod(cache.path(key), 0o606)
    elif how == "symlink":  # an entry pointing elsewhere is not followed
        elsewhere = tmp_path / "elsewhere.bin"
        os.replace(cache.path(key), elsewhere)
        os.symlink(elsewhere, cache.path(key))
    else:
        monkeypatch.setattr(cc, "current_uid", lambda: os.getuid() + 1)
    before = cc.stats()
    if how == "symlink":
        got = cache.get_or_build(key, lambda: b"rebuilt")
    else:
        with pytest.warns(cc.UntrustedCacheWarning, match=r"compile cache entry .* removed and rebuilt"):
            got = cache.get_or_build(key, lambda: b"rebuilt")
    assert got == b"rebuilt" and cc.stats()["compiles"] == before["compiles"] + 1
    if how != "another owner":
        assert cache.load(key) == b"rebuilt" and not os.path.islink(cache.path(key))
        assert os.stat(cache.path(key)).st_mode & 0o777 == 0o600


def test_a_tuning_database_others_can_write_is_not_read(tmp_path):
    from tilefuse.runtime import tuner
    path = str(tmp_path / "tuning.sqlite")
    row = {"template": "t", "signature": "s", "shape_class": "c", "device": "d", "params": {"x": 1},
           "seconds": 1.0, "default_seconds": 2.0, "trials": 1}
    assert tuner.TuningDB(path).put(row)
    assert tuner.TuningDB(path).get("t", "s", "c", "d") == {"x": 1}
    os.chmod(path, 0o666)
    db = tuner.TuningDB(path)
    with pytest.warns(cc.UntrustedCacheWarning, match=r"tuning database .* others can write .* default "
                                                      r"parameters are used"):
        assert db.rows() == {}
    assert not db.put(row)


ENTRY_PLANTED = r"""
import json, sys, warnings
import numpy as np
import tilefuse as tx
from tilefuse.runtime import compile_cache as cc
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    y = tx.jit(lambda x: x * 3.0 + 1.0, device=sys.argv[1])(np.arange(4, dtype=np.float32))
print(json.dumps({"y": np.asarray(y).tolist(), "warnings": [str(x.message) for x in w
                  if issubclass(x.category, cc.UntrustedCacheWarning)]}))
"""


def test_jit_with_a_world_writable_cache_folder_caches_privately(device, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    env = {**os.environ, "TILEFUSE_CACHE_DIR": str(shared)}
    env.pop("TILEFUSE_TUNING_DB", None)
    out = subprocess.run([sys.executable, "-c", ENTRY_PLANTED, device.name], env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["y"] == [1.0, 4.0, 7.0, 10.0]
    if device.kind != "ref":  # (ref interprets the graph: it caches nothing)
        assert len(report["warnings"]) == 1 and str(shared) in report["warnings"][0], report
    assert os.listdir(shared) == []  # nothing read from it, nothing written to it


def test_cache_entries_are_keyed_and_verified_by_hash(tmp_path):
    cache = cc.CompileCache("ns", str(tmp_path))
    a, b = cc.make_key("kernel a"), cc.make_key("kernel b")
    assert len(a) == 64 and a != b  # a sha256 of everything that decides the code
    cache.store(a, b"code of a")
    os.replace(cache.path(a), cache.path(b))  # a valid entry under another key's name
    with pytest.warns(cc.CacheWarning):
        assert cache.load(b) is None
    cache.store(a, b"code of a")
    with open(cache.path(a), "r+b") as f:  # flip one bit of the payload
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))
    with pytest.warns(cc.CacheWarning):
        assert cache.load(a) is None


class _Exploit:
    """Unpickling this writes a marker file: proof that a pickle ran."""
    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_holding_a_pickle_is_refused_and_never_run(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_transformer as T
    monkeypatch.setattr(tx.config, "default_device", "ref")
    cfg = T.Config(vocab=20, d_model=8, layers=1, heads=2, seq=4)
    params = T.init_params(tx.random.key(0), cfg)
    opt_state = T.make_optimizer(1e-3, 10).init(params)
    path = str(tmp_path / "ck.npz")
    T.save_checkpoint(path, step=1, params=params, opt_state=opt_state, key=tx.random.key(1),
                      data_pos=0, cfg=cfg)
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    _Exploit.marker = str(tmp_path / "pwned")
    evil = np.empty(1, object)
    evil[0] = _Exploit()
    arrays["step"] = evil  # numpy pickles object arrays into the .npz
    np.savez(path, **arrays)
    with pytest.raises(tx.TilefuseError, match=r"cannot be used: its entry .step. holds Python objects"):
        T.load_checkpoint(path, params, opt_state, cfg)
    assert not os.path.exists(_Exploit.marker)


def test_opencl_leaves_no_pickle_cache(tmp_path):
    if not tx.devices("opencl"):
        pytest.skip("no OpenCL device")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path),
           "TILEFUSE_CACHE_DIR": str(tmp_path / "tf")}
    env.pop("PYOPENCL_NO_CACHE", None)
    code = ("import numpy as np, tilefuse as tx\n"
            "print(np.asarray(tx.jit(lambda x: x * 2 + 1, device='opencl:0')(np.ones(4, np.float32))))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0 and "[3. 3. 3. 3.]" in out.stdout, out.stderr
    written = [os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs]
    # PoCL's own kernel cache (native code it builds and keys itself) is the ICD's business;
    # ours holds the graph's front end, as JSON behind the cache's header, and OpenCL programs:
    # a first build's empty marker or the driver's binary (native code, as the llvm namespace's)
    ours = [w for w in written if w.startswith("tf")]
    assert not [w for w in written if "pytools" in w or "pyopencl" in w], written
    assert ours and all(w.split(os.sep)[1] in ("frontend", "opencl") for w in ours), ours
    for w in ours:
        payload = cc._check(open(tmp_path / w, "rb").read(), os.path.basename(w)[:-4])
        if w.split(os.sep)[1] == "frontend":
            json.loads(payload)
        else:
            assert payload is not None and not payload.startswith(b"\x80"), w  # (a pickle's first byte)


# ---- compile workers import the installed tilefuse, never the working directory's -------------

COMPILES_IN_WORKERS = r"""
import json, sys
import numpy as np
import tilefuse as tx, tilefuse.numpy as tnp
from tilefuse.backends.llvm import parallel
taken = []
take = parallel.take
def _take(key):
    obj = take(key)
    taken.append(obj is not None)
    return obj
parallel.take = _take
c = 0.37
f = lambda x: (tnp.exp(x * c).sum(0), tnp.tanh(x + c).max(1), tnp.sqrt(tnp.abs(x) + c).min(0),
               (x - c) * 2.0, tnp.log1p(tnp.abs(x) * c).mean(1))
x = np.linspace(-1, 1, 8 * 33, dtype=np.float32).reshape(8, 33)
got = tx.jit(f, device="cpu")(x)
want = (np.exp(x * c).sum(0), np.tanh(x + c).max(1), np.sqrt(np.abs(x) + c).min(0), (x - c) * 2.0,
        np.log1p(np.abs(x) * c).mean(1))
ok = all(np.allclose(np.asarray(g), w, rtol=2e-5, atol=1e-5) for g, w in zip(got, want))
print(json.dumps({"ok": ok, "from_workers": sum(taken), "kernels": len(taken)}))
"""


def test_compile_workers_never_import_from_the_working_directory(tmp_path):
    if "cpu" not in [d.name for d in tx.devices()]:
        pytest.skip("the cpu device is unavailable")
    marker = tmp_path / "pwned"
    work = tmp_path / "work"  # where the user runs their script: a hostile tilefuse/ and pickle.py
    (work / "tilefuse").mkdir(parents=True)
    plant = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    for name in ("tilefuse/__init__.py", "pickle.py", "json.py", "numpy.py"):
        (work / name).write_text(plant)
    script = tmp_path / "scripts" / "run.py"  # run from elsewhere: its own folder is on sys.path
    script.parent.mkdir()
    script.write_text(COMPILES_IN_WORKERS)
    env = {**os.environ, "TILEFUSE_CACHE_DIR": str(tmp_path / "cache"),  # every kernel is new
           "TILEFUSE_COMPILE_WORKERS": "2"}
    out = subprocess.run([sys.executable, str(script)], cwd=work, env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert not marker.exists(), marker.read_text()
    assert report["ok"] and report["kernels"] >= 4, report
    assert report["from_workers"] >= 1, report  # the workers ran (with the real tilefuse)
