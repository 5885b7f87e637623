"""Tune every kernel of a model's workload and store the results in the tuning database.

    python -m tilefuse.tune --model examples/train_transformer.py [--trials 20] [--device cpu]

The model file defines `tuning_workload()` returning `(fn, args)` (or `(fn, args, kwargs)`):
the function to tune (jitted or not) and arguments to call it with. The database is
TILEFUSE_TUNING_DB (default: tuning.sqlite in the compile cache folder); later compiles of the
same kernels on the same device read it. In Python, `tx.tune(fn, *args)` does the same."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time


def load_workload(path: str):
    """(fn, args, kwargs) from the model file's tuning_workload()."""
    path = os.path.abspath(path)
    sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location("_tilefuse_tune_model", path)
    if spec is None:
        raise SystemExit(f"cannot load {path}: not a Python file")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    make = getattr(module, "tuning_workload", None)
    if make is None:
        raise SystemExit(f"{path} defines no tuning_workload() returning (fn, args): add one to tune it")
    fn, args, *rest = make()
    return fn, tuple(args), (rest[0] if rest else {})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tilefuse.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Python file defining tuning_workload()")
    p.add_argument("--trials", type=int, default=20, help="configurations tried per kernel")
    p.add_argument("--device", default=None, help="cpu, opencl:0, ... (default: tilefuse's)")
    p.add_argument("--min-share", type=float, default=0.0,
                   help="skip kernels under this fraction of the profiled time")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)

    import tilefuse as tx
    from tilefuse.runtime import tuner
    if a.device:
        tx.config.default_device = a.device
    fn, args, kwargs = load_workload(a.model)
    t0 = time.perf_counter()
    report = tx.tune(fn, *args, trials=a.trials, device=a.device, min_share=a.min_share,
                     progress=not a.no_progress, **kwargs)
    print(report.table())
    for name, why in report.skipped:
        print(f"skipped {name}: {why}")
    where = tuner.db_path() or "(nowhere: tuning_db is off)"
    print(f"{time.perf_counter() - t0:.1f} s; results in {where}")
    return 0
