"""The static buffer planner: live ranges of intermediate buffers -> offsets in one arena.

Buffers whose live ranges (inclusive step intervals) intersect never overlap in memory; others
may share it. Placement is greedy, largest first, at the lowest 64-byte-aligned offset free of
every conflicting buffer already placed (the usual offline best-fit of static planners)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

ALIGN = 64


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Interval:
    """One buffer to place: `nbytes`, live from step `start` to step `end` (both included)."""
    key: Hashable
    nbytes: int
    start: int
    end: int

    def overlaps_in_time(self, o: "Interval") -> bool:
        return self.start <= o.end and o.start <= self.end


@dataclass(frozen=True)
class Plan:
    """Byte offsets of each buffer in an arena of `arena_bytes`."""
    offsets: dict
    arena_bytes: int
    total_bytes: int  # the sum of all buffers (what one allocation each would take)


def plan_buffers(buffers: Sequence[Interval], align: int = ALIGN) -> Plan:
    placed: list[tuple[int, Interval]] = []
    offsets = {}
    for b in sorted(buffers, key=lambda b: (-b.nbytes, b.start, b.end)):
        busy = sorted((off, off + o.nbytes) for off, o in placed if o.nbytes and b.overlaps_in_time(o))
        off = 0
        for lo, hi in busy:
            if off + b.nbytes <= lo:
                break
            off = max(off, align_up(hi, align))
        placed.append((off, b))
        offsets[b.key] = off
    arena = max((off + b.nbytes for off, b in placed), default=0)
    return Plan(offsets, align_up(arena, align), sum(b.nbytes for b in buffers))
