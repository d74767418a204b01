"""CPU placement for benchmarks (mesh.lab.bench.cpu_pinning): the plan, and real pinning of real threads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from mesh.lab.bench.cpu_pinning import Placement, pin_process, pinned_self, plan

linux_2cpu = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs Linux with 2+ usable CPUs")


def test_plan_gives_the_process_under_test_one_cpu_and_the_harness_the_rest():
    assert plan({0, 1}) == Placement(frozenset({1}), frozenset({0}))
    p = plan({2, 5, 7, 9})
    assert p == Placement(frozenset({9}), frozenset({2, 5, 7}))
    assert p.as_dict() == {"process_under_test": [9], "harness": [2, 5, 7]}
    assert p.under_test.isdisjoint(p.harness)


def test_plan_is_none_without_two_cpus():
    assert plan({3}) is None
    assert plan(set()) is None


def _masks(pid: int) -> dict[int, set[int]]:
    """Each live thread's CPU mask. A thread listed in /proc that exits before its mask is read
    (another test's worker thread finishing) has none: skipped, as pin_process skips it."""
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(t)] = os.sched_getaffinity(int(t))
        except ProcessLookupError:
            continue
    return out


@linux_2cpu
def test_pin_process_pins_every_thread_of_a_running_process():
    cpu = max(os.sched_getaffinity(0))
    # a child with extra threads, started before the pinning
    code = "import threading, sys, time\n" \
           "ev = threading.Event()\n" \
           "ts = [threading.Thread(target=ev.wait, daemon=True) for _ in range(3)]\n" \
           "[t.start() for t in ts]\n" \
           "print('up', flush=True)\n" \
           "sys.stdin.readline()\n"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        assert len(_masks(child.pid)) >= 4
        pin_process(child.pid, frozenset({cpu}))
        masks = _masks(child.pid)
        assert masks and all(m == {cpu} for m in masks.values()), masks
    finally:
        child.stdin.close()
        assert child.wait(10) == 0


@linux_2cpu
def test_pinned_self_pins_threads_started_inside_and_restores_the_old_masks():
    before = _masks(os.getpid())
    cpu = min(os.sched_getaffinity(0))
    seen: list[set[int]] = []
    with pinned_self(frozenset({cpu})):
        assert os.sched_getaffinity(0) == {cpu}
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join(5)
    assert seen == [{cpu}]  # a thread started while pinned inherits the mask
    after = _masks(os.getpid())
    for tid, mask in before.items():
        if tid in after:
            assert after[tid] == mask, (tid, mask, after[tid])


def test_pinned_self_with_none_changes_nothing():
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    with pinned_self(None):
        pass
    if before is not None:
        assert os.sched_getaffinity(0) == before
