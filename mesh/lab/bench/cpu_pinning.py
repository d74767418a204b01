"""CPU placement for benchmarks: the process under test on its own core, the load harness on the rest.

Why: on a small machine the benchmark's harness (load driver and simulated workers) shares the
CPUs with the process under test. Left to the kernel, the two busy Python threads regularly end
up queued on the *same* CPU while the other one idles between ZeroMQ I/O-thread wake-ups: with
~30,000 short wake-ups a second, the idle CPU's average idle time stays below the cost of
pulling a task, so it does not steal the waiting thread for tens of milliseconds (seen with
``perf sched`` on a 2-vCPU VM: 35-45 ms windows with one CPU idle and both main threads on the
other). Those windows, not the code under test, then set the latency tail. Pinning every thread
of the process under test to one CPU and every thread of the harness to the others gives each
side the core it was meant to have, as separate machines would in production.

Linux only (``os.sched_setaffinity``); elsewhere, or with fewer than two usable CPUs, :func:`plan`
returns None and nothing is pinned.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

__all__ = ["Placement", "plan", "pin_process", "pinned_self"]


@dataclass(frozen=True)
class Placement:
    """Which CPUs the process under test and the harness may run on (disjoint sets)."""

    under_test: frozenset[int]
    harness: frozenset[int]

    def as_dict(self) -> dict[str, list[int]]:
        return {"process_under_test": sorted(self.under_test), "harness": sorted(self.harness)}


def plan(cpus: set[int] | None = None) -> Placement | None:
    """One CPU (the highest-numbered usable one) for the process under test, the rest for the
    harness; None when pinning is unavailable or fewer than two CPUs are usable."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    usable = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(usable) < 2:
        return None
    return Placement(under_test=frozenset(usable[-1:]), harness=frozenset(usable[:-1]))


def _thread_ids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:  # no procfs: only the main thread can be named
        return [pid]


def pin_process(pid: int, cpus: frozenset[int]) -> None:
    """Pin every current thread of ``pid`` to ``cpus`` (threads it starts later inherit the mask
    of the thread that starts them). Threads that exit meanwhile are skipped."""
    for tid in _thread_ids(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue


@contextmanager
def pinned_self(cpus: frozenset[int] | None) -> Iterator[None]:
    """Pin this process's threads to ``cpus`` for the duration (no-op for None); the previous
    mask of each thread is restored afterwards. Threads started inside inherit the pinning."""
    if cpus is None:
        yield
        return
    me = os.getpid()
    before = {}
    for tid in _thread_ids(me):
        try:
            before[tid] = os.sched_getaffinity(tid)
        except ProcessLookupError:
            continue
    pin_process(me, cpus)
    try:
        yield
    finally:
        for tid, mask in before.items():
            try:
                os.sched_setaffinity(tid, mask)
            except ProcessLookupError:
                continue
