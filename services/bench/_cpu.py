"""CPU time of the processes a benchmark runs, read from /proc: where the time of a write goes."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses


def cpu_seconds(pid: int) -> float:
    """User + system time of `pid` and of its live descendants, plus that of the children it has reaped
    (PostgreSQL's exited backends)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children[int(fields[1])].append(int(entry.name))
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        if (fields := _stat(current)) is None:
            continue
        # Fields after the name, from 0: state, ppid, ..., utime (11), stime (12), cutime (13), cstime (14).
        total += int(fields[11]) + int(fields[12])
        if current == pid:
            total += int(fields[13]) + int(fields[14])
        stack.extend(children.get(current, []))
    return total / _TICK


def snapshot(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}
