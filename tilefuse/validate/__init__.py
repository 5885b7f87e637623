"""Cross-backend validation: every primitive, fusion pattern, GEMM form and attention form on
every available device, against the reference, with per-dtype tolerances.

    python -m tilefuse.validate                         # every device, every case
    python -m tilefuse.validate --device cpu --dtype float32,bfloat16 --group gemm,attention

prints a table (case x device: pass or FAIL, and the largest error) and exits non-zero if any
case fails. Primitives are checked against the table's independent numpy references (on `ref`
too), programs against the same program run on `ref`. The test suite runs these same cases
through `check` (tests/ir/test_primitives.py, tests/test_validate.py): one table, one check."""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np

from .compare import Comparison, agrees, assert_close, tolerance

GROUPS = ("primitive", "fusion", "gemm", "attention")


@dataclass(frozen=True)
class Case:
    """One record of a table (a primitive record or a program) in one dtype."""
    group: str
    record: object
    dtype: np.dtype

    @property
    def name(self) -> str:
        return str(self.record)

    @property
    def id(self) -> str:
        return f"{self.name}-{np.dtype(self.dtype).name}"

    def runs_on(self, device) -> bool:
        """Programs compare a device with `ref`, so they do not run on `ref` itself; a case of a
        dtype the device lacks (float64 on WebGPU) does not run there."""
        import tilefuse as tx
        params = getattr(self.record, "params", None) or {}
        wanted = [self.dtype] + [v for v in params.values() if isinstance(v, np.dtype)]  # (convert's new_dtype)
        if not all(map(tx.get_device(device).supports, wanted)):
            return False
        return self.group == "primitive" or getattr(device, "kind", str(device)) != "ref"

    def comparisons(self, device):
        """The case's results against their references, with `device` the default device (as
        the tests' fixture makes it: operations without array operands, iota, run there)."""
        import tilefuse as tx
        from . import primitives, programs
        module = primitives if self.group == "primitive" else programs
        old = tx.config.default_device
        tx.config.default_device = str(device)
        try:
            yield from module.comparisons(self.record, self.dtype, device)
        finally:
            tx.config.default_device = old


def cases(groups=None, dtypes=None, match: str | None = None) -> list[Case]:
    """The cases of the tables, filtered by group, dtype (names or dtypes) and name substring."""
    from . import primitives, programs
    want = None if not dtypes else {np.dtype(d).name for d in dtypes}
    out = [Case("primitive", op, np.dtype(d)) for op in primitives.OPS for d in op.dtypes]
    out += [Case(p.group, p, np.dtype(d)) for p in programs.PROGRAMS for d in p.dtypes]
    return [c for c in out if (not groups or c.group in groups)
            and (want is None or c.dtype.name in want)
            and (match is None or match.lower() in c.name.lower())]


def check(case: Case, device) -> None:
    """Raise AssertionError naming the result unless every result of the case agrees (the tests)."""
    for c in case.comparisons(device):
        try:
            assert_close(c.actual, c.expected, c.dtype, c.rtol, c.atol)
        except AssertionError as e:
            raise AssertionError(f"{c.label} on {device}: {e}") from None


@dataclass
class Outcome:
    """A case on a device: passed or not, the largest error, and what failed."""
    ok: bool
    max_error: float
    message: str = ""

    def cell(self) -> str:
        return f"{'ok' if self.ok else 'FAIL'} {self.max_error:.1e}"


def evaluate(case: Case, device) -> Outcome:
    """Run a case and report instead of raising (the command line)."""
    worst = 0.0
    try:
        for c in case.comparisons(device):
            ok, err = agrees(c)
            worst = max(worst, err)
            if not ok:
                r, a = tolerance(c.dtype) if c.rtol is None else (c.rtol, c.atol)
                return Outcome(False, worst, f"{c.label}: max error {err:.3g} (rtol {r:g}, atol {a:g})")
    except Exception as e:  # a crash is a failure of this case on this device, not of the run
        return Outcome(False, float("inf"), f"{type(e).__name__}: {e}")
    return Outcome(True, worst)


def run(devices, selected: list[Case], progress: bool = True) -> dict:
    """{(case id, device name): Outcome} for every case on every device it runs on."""
    todo = [(c, d) for c in selected for d in devices if c.runs_on(d)]
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(todo), unit="case", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            pass
    results = {}
    for c, d in todo:
        if bar is not None:
            bar.set_description(f"{d} {c.id}"[:40])
        results[(c.id, str(d))] = evaluate(c, d)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return results


def table(devices, selected: list[Case], results: dict, failures_only: bool = False) -> str:
    names = [str(d) for d in devices]
    head = ["case", "group", *names]
    rows = []
    for c in selected:
        cells = [results[(c.id, n)].cell() if (c.id, n) in results else "-" for n in names]
        if failures_only and not any(x.startswith("FAIL") for x in cells):
            continue
        rows.append([c.id, c.group, *cells])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda r: "| " + " | ".join(x.ljust(w) for x, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def main(argv=None, selected: list[Case] | None = None) -> int:
    """The command line; `selected` replaces the tables' cases (for tests)."""
    import faulthandler

    import tilefuse as tx
    if not faulthandler.is_enabled() and sys.__stderr__ is not None:
        faulthandler.enable(file=sys.__stderr__)  # a crash in a device's code names its case
    p = argparse.ArgumentParser(prog="python -m tilefuse.validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", action="append", help="a device (cpu, ref, opencl:0, ...) or kind; "
                   "repeat or separate with commas (default: every available device)")
    p.add_argument("--dtype", help="only these dtypes, comma-separated (float32,bfloat16,...)")
    p.add_argument("--group", help=f"only these groups, comma-separated ({','.join(GROUPS)})")
    p.add_argument("--case", help="only cases whose name contains this text")
    p.add_argument("--failures-only", action="store_true", help="print only the rows that failed")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    tx.config.tiered = False  # every call runs the device's compiled kernels

    present, missing = tx.devices(all=True)
    if a.device:
        wanted = [w.strip() for arg in a.device for w in arg.split(",") if w.strip()]
        devices = []
        for w in wanted:
            got = [d for d in present if d.name == w or d.kind == w]
            if not got:
                p.error(f"device {w!r} is not available (present: {', '.join(map(str, present))}"
                        + "".join(f"; {k}: {why}" for k, why in missing.items()) + ")")
            devices += [d for d in got if d not in devices]
    else:
        devices = present
    groups = [g.strip() for g in a.group.split(",")] if a.group else None
    if groups and not set(groups) <= set(GROUPS):
        p.error(f"unknown group in {a.group!r}; the groups are {', '.join(GROUPS)}")
    try:
        dtypes = [np.dtype(getattr(tx, d.strip(), d.strip())) for d in a.dtype.split(",")] \
            if a.dtype else None
    except TypeError as e:
        p.error(f"unknown dtype in {a.dtype!r}: {e}")
    chosen = selected if selected is not None else cases(groups, dtypes, a.case)
    if not chosen:
        p.error("no case matches the filters")

    t0 = time.perf_counter()
    results = run(devices, chosen, progress=not a.no_progress)
    print(table(devices, chosen, results, a.failures_only))
    failed = {k: o for k, o in results.items() if not o.ok}
    for (cid, dev), o in failed.items():
        print(f"FAIL {cid} on {dev}: {o.message}")
    for kind, why in missing.items():
        print(f"not run on {kind}: {why}")
    print(f"{len(results) - len(failed)} of {len(results)} passed on {', '.join(map(str, devices))} "
          f"in {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


__all__ = ["Case", "Comparison", "Outcome", "assert_close", "cases", "check", "evaluate", "main", "run",
           "tolerance"]
