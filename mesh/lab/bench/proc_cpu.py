"""CPU time of processes from ``/proc`` (Linux): ``utime + stime`` of ``/proc/PID/stat`` (fields 14
and 15) covers every thread of the process, live or exited; children are not included, so a role
is given as root pids and their descendants are added when sampling starts.

Resolution is one clock tick (``SC_CLK_TCK``, usually 10 ms): over a window of seconds with
thousands of requests that is a small error on a per-request figure, and it is what ``top`` and
``ps`` use too.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

__all__ = ["CLK_TCK", "cpu_seconds", "descendants", "CpuSampler"]

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces or ')': split after the last ')'
    return data[data.rindex(b")") + 2:].split()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads), None if it is gone."""
    f = _stat_fields(pid)
    if f is None or len(f) < 13:
        return None
    return (int(f[11]) + int(f[12])) / CLK_TCK  # fields 14 and 15 of stat (f[0] is field 3)


def descendants(roots: Iterable[int]) -> list[int]:
    """``roots`` and every live descendant of theirs (one scan of /proc)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        names = []
    for name in names:
        if not name.isdigit():
            continue
        f = _stat_fields(int(name))
        if f is None or len(f) < 2:
            continue
        children.setdefault(int(f[1]), []).append(int(name))
    out: list[int] = []
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        out.append(pid)
        stack.extend(children.get(pid, ()))
    return out


class CpuSampler:
    """CPU seconds per role over a window: ``start()`` then ``stop()`` -> {role: seconds}.

    A process that is gone at ``stop()`` (it crashed mid-window) is left out of its role's sum
    and listed in ``lost``."""

    def __init__(self, roles: Mapping[str, Iterable[int]]) -> None:
        self.roles = {role: descendants(pids) for role, pids in roles.items()}
        self._t0: dict[int, float | None] = {}
        self.lost: list[int] = []

    def start(self) -> None:
        self._t0 = {pid: cpu_seconds(pid) for pids in self.roles.values() for pid in pids}

    def stop(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, pids in self.roles.items():
            total = 0.0
            for pid in pids:
                t0, t1 = self._t0.get(pid), cpu_seconds(pid)
                if t0 is None or t1 is None:
                    self.lost.append(pid)
                    continue
                total += t1 - t0
            out[role] = total
        return out
