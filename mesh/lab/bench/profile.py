"""Sampling profiles of benchmark processes: py-spy on a running process, summarised as top entries.

``mesh bench http --profile`` samples the router (and one adapter, one gateway) while the highest
concurrency cell runs, so the page it writes says where each process's time went beside the figures
it measured. py-spy is a separate program (the ``bench`` extra installs it); without it, or when the
kernel refuses to let it attach (ptrace), the profile is reported as missing with the reason, and
the benchmark's figures are unaffected.

:func:`summarize_raw` is pure: it reads py-spy's ``--format raw`` output (one collapsed stack per
line, ``frame;frame;... count``) and returns the top frames by self and by inclusive share.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

__all__ = ["Sampler", "py_spy_path", "summarize_raw"]

_RATE_HZ = 100


def py_spy_path() -> str | None:
    """py-spy beside this interpreter (a venv's bin/), else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("py-spy")


def _frame_name(frame: str) -> str:
    """``func (path/to/module.py:12)`` -> ``func (to/module.py)``: short, and one entry per function."""
    name, _, loc = frame.partition(" (")
    path = loc.rstrip(")").split(":")[0]
    tail = "/".join(path.split("/")[-2:])
    return f"{name} ({tail})" if tail else name


def summarize_raw(text: str, top: int = 10) -> dict:
    """Top ``top`` frames by self share (the sample's innermost frame) and by inclusive share (on the
    stack at all; the main thread's entry frames, on every stack, left out), in percent of the samples.
    Malformed lines are skipped and counted."""
    self_n: Counter[str] = Counter()
    incl_n: Counter[str] = Counter()
    total = skipped = 0
    stacks: list[tuple[list[str], int]] = []
    for line in text.splitlines():
        stack, _, count = line.strip().rpartition(" ")
        if not stack or not count.isdigit():
            skipped += bool(line.strip())
            continue
        n = int(count)
        frames = [_frame_name(f) for f in stack.split(";") if f]
        if not frames:
            skipped += 1
            continue
        total += n
        stacks.append((frames, n))
        self_n[frames[-1]] += n
        for f in set(frames):
            incl_n[f] += n
    for f in _trunk(stacks):  # on (nearly) every sample's stack: says nothing about where the time went
        incl_n.pop(f, None)

    def rows(c: Counter[str]) -> list[dict]:
        return [{"frame": f, "pct": round(100.0 * n / total, 1)} for f, n in c.most_common(top)] if total else []

    return {"samples": total, "skipped_lines": skipped, "self": rows(self_n), "inclusive": rows(incl_n)}


def _trunk(stacks: list[tuple[list[str], int]]) -> list[str]:
    """The main thread's entry frames: from the most sampled outermost frame down, as long as every
    sample below it passes through one and the same frame (``<module>``, ``main``, the event loop's
    ``run``...). The first frame where the stacks part is no longer trunk."""
    if not stacks:
        return []
    roots = Counter[str]()
    for frames, n in stacks:
        roots[frames[0]] += n
    group = [frames for frames, _ in stacks if frames[0] == roots.most_common(1)[0][0]]
    trunk: list[str] = []
    depth = 0
    while True:
        here = {frames[depth] for frames in group if len(frames) > depth}
        if len(here) != 1 or any(len(frames) <= depth + 1 for frames in group):
            if len(here) == 1 and all(len(frames) > depth for frames in group):
                trunk.append(next(iter(here)))  # every sample reaches it, some end there (its own C code)
            return trunk
        trunk.append(next(iter(here)))
        depth += 1


class Sampler:
    """One py-spy per process, started together, read together: ``start()`` then ``finish()``."""

    def __init__(self, targets: dict[str, int], seconds: float, out_dir: Path) -> None:
        self.targets = dict(targets)  # role -> pid
        self.seconds = max(1, int(round(seconds)))
        self.out_dir = Path(out_dir)
        self._procs: dict[str, tuple[subprocess.Popen, Path]] = {}
        self.errors: dict[str, str] = {}

    def start(self) -> None:
        exe = py_spy_path()
        for role, pid in self.targets.items():
            if exe is None:
                self.errors[role] = "py-spy is not installed (pip install '.[bench]')"
                continue
            out = self.out_dir / f"profile-{role}-{pid}.txt"
            self.out_dir.mkdir(parents=True, exist_ok=True)
            args = [exe, "record", "-p", str(pid), "-d", str(self.seconds), "-r", str(_RATE_HZ), "-f", "raw", "-o", str(out),
                    "--nonblocking"]
            try:
                p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
            except OSError as exc:
                self.errors[role] = f"py-spy did not start: {exc}"
                continue
            self._procs[role] = (p, out)

    def finish(self, top: int = 10) -> dict[str, dict]:
        """Wait for every sampler (bounded), return ``{role: summary | {"error": why}}``."""
        result: dict[str, dict] = {role: {"error": why} for role, why in self.errors.items()}
        for role, (p, out) in self._procs.items():
            try:
                _, err = p.communicate(timeout=self.seconds + 30)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            text = out.read_text(errors="replace") if out.is_file() else ""
            if p.returncode != 0 or not text:
                why = (err or b"").decode(errors="replace").strip().splitlines()
                result[role] = {"error": (why[-1] if why else f"py-spy exited {p.returncode}")[:300]}
                continue
            result[role] = {"pid": self.targets[role], "rate_hz": _RATE_HZ, **summarize_raw(text, top)}
        return result
