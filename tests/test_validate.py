"""The validation suite's programs (fusion patterns, GEMM and attention forms) on every device
against `ref` — the same cases and check as `python -m tilefuse.validate` — and its command line:
a table, and a non-zero exit status when a case fails."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tilefuse import validate
from tilefuse.validate.compare import Comparison

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM_CASES = [c for c in validate.cases() if c.group != "primitive"]


@pytest.mark.parametrize("case", PROGRAM_CASES, ids=[c.id for c in PROGRAM_CASES])
def test_program(case, device):
    if not case.runs_on(device):
        pytest.skip("programs are compared with ref" if device.kind == "ref" else f"{device} has no {case.dtype}")
    validate.check(case, device)


class _Broken(validate.Case):
    def comparisons(self, device):
        yield Comparison("deliberately wrong", np.ones(3, np.float32), np.zeros(3, np.float32), np.float32)


def test_the_table_and_the_exit_status(capsys):
    good = validate.cases(groups=("primitive",), dtypes=("float32",), match="tanh")[0]
    bad = _Broken("primitive", "broken", np.dtype(np.float32))
    assert validate.main(["--device", "ref", "--no-progress"], selected=[good, bad]) == 1
    out = capsys.readouterr().out
    assert "| tanh-float32" in out and "ok " in out and "| broken-float32" in out and "FAIL 1.0e+00" in out
    assert "FAIL broken-float32 on ref: deliberately wrong" in out
    assert validate.main(["--device", "ref", "--no-progress"], selected=[good]) == 0


def test_the_command_line():
    p = subprocess.run([sys.executable, "-m", "tilefuse.validate", "--device", "ref", "--dtype", "float32",
                        "--case", "reduce_max", "--no-progress"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("| reduce_max")]
    assert lines and all("ok" in ln for ln in lines)
    bad = subprocess.run([sys.executable, "-m", "tilefuse.validate", "--group", "nonsense"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "unknown group" in bad.stderr
