"""How large each backend is: `python -m tilefuse.validate.lines` prints the non-blank lines of
every backend's files (a new chip's cost) and of the shared layers they print from (the kernel
IR, the scheduler, the builders, the printers), with the targets the project holds itself to."""
from __future__ import annotations

import os
import sys

TARGETS = {"opencl": 600, "cuda": 600, "llvm": 1000, "webgpu": 400}
# printers that several backends print with (as cstyle.py): shared, not one backend's cost
SHARED_PRINTERS = ("llvmir",)


def count(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def table(root: str) -> list[tuple[str, str, int]]:
    """(group, file, lines): every backend's files, then the shared modules backends print from."""
    rows = []
    backends = os.path.join(root, "backends")
    for entry in sorted(os.listdir(backends)):
        path = os.path.join(backends, entry)
        if os.path.isdir(path) and not entry.startswith("__"):
            for name in sorted(os.listdir(path)):
                if name.endswith(".py"):
                    group = "shared" if entry in SHARED_PRINTERS else entry
                    rows.append((group, f"backends/{entry}/{name}", count(os.path.join(path, name))))
        elif entry.endswith(".py") and entry != "__init__.py":
            rows.append(("shared", f"backends/{entry}", count(path)))
    kernel = os.path.join(root, "ir", "kernel")
    for name in sorted(os.listdir(kernel)):
        if name.endswith(".py") and name != "__init__.py":
            rows.append(("shared", f"ir/kernel/{name}", count(os.path.join(kernel, name))))
    return rows


def main(argv=None) -> int:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rows = table(root)
    totals: dict = {}
    for group, name, n in rows:
        totals[group] = totals.get(group, 0) + n
        print(f"{group:8} {name:40} {n:6}")
    print()
    for group, n in totals.items():
        target = TARGETS.get(group)
        note = "" if target is None else f"  (target < {target}{'' if n < target else ', over'})"
        print(f"{group:8} {n:6}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
