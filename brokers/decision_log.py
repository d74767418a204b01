"""``mesh broker --record-decisions FILE``: the shell that puts the decision recorder's lines on disk.

The pure :class:`~mesh.broker_core.recorder.DecisionRecorder` makes the lines (and decides when a
file is full); :class:`DecisionLog` appends them from a thread of its own, so the broker's event
loop never waits for the disk: :meth:`DecisionLog.put` takes a lock for a few deque appends and
returns. The queue is bounded (``queue_max`` lines): a slow or stalled disk costs records, never
loop time, and every record dropped is counted (``mesh_record_dropped{why="queue_full"}``; a
failed write: ``why="write_error"``). Headers and rotations are never dropped, so every file
still starts with its header.

Files: ``FILE`` is the current one; a rotation renames ``FILE`` to ``FILE.1``, ``FILE.1`` to
``FILE.2`` ... and deletes what would become ``FILE.<files>``: at most ``files`` files of about
``record_max_bytes`` each. A ``FILE`` left by an earlier run is rotated away at startup. Only
regular files are renamed (a FIFO or a device is written in place). The first header is written
and flushed at startup, so an unwritable path or a full disk is a startup error naming
``record_decisions``.
"""

from __future__ import annotations

import os
import threading
from collections import Counter, deque
from pathlib import Path
from typing import Any, Callable

from mesh.broker_core.recorder import ROTATE
from mesh.errors import ConfigError
from mesh.logs import RateLimiter

__all__ = ["DecisionLog"]


class DecisionLog:
    """Appends recorder lines to ``path`` on a thread (see the module docstring)."""

    def __init__(self, path: str, *, files: int, dropped: Counter[str], written: Counter[str], log: Any,
                 queue_max: int = 10_000, opener: Callable[[str], Any] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        import time

        self.path = path
        self.files = files
        self.dropped = dropped  # why -> records (queue_full: by the loop thread; write_error: by the writer)
        self.written = written  # records, files (by the writer thread)
        self.log = log
        self.queue_max = queue_max
        self._open = opener or (lambda p: open(p, "ab"))  # noqa: SIM115 - the writer thread owns and closes it
        self._clock = clock or time.monotonic
        self._q: deque[bytes | None] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._fh: Any = None
        self._thread: threading.Thread | None = None
        self._limiter = RateLimiter(10.0)
        self._force = False  # the line after a rotation (its header) is never dropped

    # ------------------------------------------------------------------ the loop's side
    def start(self, first: list[bytes | None]) -> None:
        """Rotate an old ``path`` away, write and flush ``first`` (the header) now, then start
        the writer thread. ConfigError naming ``record_decisions`` when the file cannot be written."""
        try:
            self._rotate_files()
            self._fh = self._open(self.path)
            self._fh.write(b"".join(x for x in first if x is not ROTATE))
            self._fh.flush()
        except OSError as exc:
            if self._fh is not None:
                try:
                    self._fh.close()
                except OSError:
                    pass
            raise ConfigError(f"record_decisions: cannot write {self.path}: {exc.strerror or exc}") from None
        first.clear()
        self.written["files"] += 1
        self.log.info("record_decisions_started", path=self.path, files=self.files, queue_max=self.queue_max)
        self._thread = threading.Thread(target=self._run, name="mesh-record-decisions", daemon=True)
        self._thread.start()

    def put(self, lines: list[bytes | None]) -> None:
        """Queue the recorder's lines (and clear the list); never blocks on the disk."""
        with self._cv:
            q = self._q
            for x in lines:
                if x is ROTATE:
                    q.append(x)
                    self._force = True
                elif self._force or len(q) < self.queue_max:
                    q.append(x)
                    self._force = False
                else:
                    self.dropped["queue_full"] += 1
            self._cv.notify()
        lines.clear()

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (for at most ``timeout_s``), then close the file."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self.log.warning("record_decisions_close_timeout", path=self.path, queued=len(self._q))
                return  # the daemon thread still owns the file
        self._close_file()

    # ------------------------------------------------------------------ the writer thread
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                batch, self._q = self._q, deque()
                closing = self._closed
            self._write(batch)
            if closing:
                with self._cv:
                    if not self._q:
                        return

    def _write(self, batch: deque[bytes | None]) -> None:
        buf: list[bytes] = []
        for x in batch:
            if x is ROTATE:
                self._flush(buf)
                buf = []
                self._rotate()
            else:
                buf.append(x)
        self._flush(buf)

    def _flush(self, buf: list[bytes]) -> None:
        if not buf:
            return
        lost = sum(1 for x in buf if not x.startswith(b'{"f'))  # records (headers and fleet lines are not counted)
        try:
            if self._fh is None:
                raise OSError("the file is not open (an earlier error)")
            self._fh.write(b"".join(buf))
            self._fh.flush()
        except OSError as exc:
            self.dropped["write_error"] += lost
            if self._limiter.allow("write_error", self._clock()):
                self.log.error("record_decisions_write_failed", path=self.path, error=str(exc)[:200], records=lost)
            return
        self.written["records"] += lost

    def _rotate(self) -> None:
        self._close_file()
        try:
            self._rotate_files()
            self._fh = self._open(self.path)
        except OSError as exc:
            self._fh = None
            if self._limiter.allow("rotate_error", self._clock()):
                self.log.error("record_decisions_rotate_failed", path=self.path, error=str(exc)[:200])
            return
        self.written["files"] += 1

    def _close_file(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            try:
                fh.close()
            except OSError as exc:
                self.log.error("record_decisions_close_failed", path=self.path, error=str(exc)[:200])

    def _rotate_files(self) -> None:
        """FILE -> FILE.1 -> ... (only regular files; the oldest beyond ``files`` is deleted)."""
        p = Path(self.path)
        if not p.is_file():
            return
        if self.files <= 1:
            os.unlink(p)
            return
        for i in range(self.files - 1, 0, -1):
            src = Path(f"{self.path}.{i - 1}") if i > 1 else p
            if src.is_file():
                os.replace(src, f"{self.path}.{i}")
