"""Retry policy, built in one place on tenacity.

Every policy has a stop (an attempt cap, and optionally a deadline) except the one explicit
exception, :meth:`RetryPolicy.forever` (``max_attempts=None``): a worker reconnecting to its
brokers keeps trying for as long as the process lives (a broker may be down for minutes), with
the same jittered exponential back-off, capped at ``cap_ms``; and an adapter waiting for its
engine to load (minutes of weights; bounded by ``--discovery-timeout-s`` when given); and an
indexer replica tailing the Valkey log it serves from (:mod:`mesh.indexer.shared`). Nothing
else may use it (``tests/test_worker_api.py`` holds the list): a request, an index forward or a
client call always gives up eventually.

Two uses:

* :meth:`RetryPolicy.delay_s` / :meth:`RetryPolicy.should_retry` for the broker's event-driven
  re-dispatch (no coroutine waits there: the broker schedules the next attempt on a timer), using
  tenacity's full-jitter exponential wait;
* :meth:`RetryPolicy.async_retrying` for awaitable operations (index forwarding, clients), a
  ``tenacity.AsyncRetrying`` that retries only the given exception types, stops at the attempt
  cap or the deadline, and logs each sleep as ``retry_scheduled``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import tenacity
from tenacity import RetryCallState

from mesh.errors import ConfigError

__all__ = ["RetryPolicy", "RetryBudget"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``max_attempts`` counts the first try; ``None`` means no attempt cap (only through
    :meth:`forever`). Waits are drawn from [0, min(base * 2**n, cap))."""

    max_attempts: int | None = 3
    base_ms: float = 25.0
    cap_ms: float = 250.0

    def __post_init__(self) -> None:
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ConfigError("max_attempts: must be >= 1 (or None: forever)")
        if not (0 < self.base_ms <= self.cap_ms):
            raise ConfigError("retry_base_ms: must be > 0 and <= retry_cap_ms")

    @classmethod
    def forever(cls, base_ms: float, cap_ms: float) -> "RetryPolicy":
        """Retry without an attempt cap (waits still capped at ``cap_ms``): for a worker's
        reconnects to its brokers only. A deadline passed to :meth:`async_retrying` still stops it."""
        return cls(max_attempts=None, base_ms=base_ms, cap_ms=cap_ms)

    @property
    def is_forever(self) -> bool:
        return self.max_attempts is None

    def _stop(self) -> tenacity.stop.stop_base:
        return tenacity.stop_never if self.max_attempts is None else tenacity.stop_after_attempt(self.max_attempts)

    def _wait(self) -> tenacity.wait.wait_base:
        return tenacity.wait_random_exponential(multiplier=self.base_ms / 1000.0, max=self.cap_ms / 1000.0)

    def delay_s(self, attempt: int) -> float:
        """Back-off before attempt ``attempt + 1`` (``attempt`` >= 1 is the try that failed)."""
        state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        state.attempt_number = attempt
        return float(self._wait()(state))

    def should_retry(self, attempt: int, remaining_s: float) -> bool:
        """True if another attempt is allowed after ``attempt`` tries with ``remaining_s`` left."""
        return (self.max_attempts is None or attempt < self.max_attempts) and remaining_s > 0

    def async_retrying(self, retry_on: tuple[type[BaseException], ...], *, deadline_s: float | None = None, log=None) -> tenacity.AsyncRetrying:
        """An AsyncRetrying bounded by attempts (none for :meth:`forever`) and (optionally) an
        absolute monotonic deadline."""
        stop = self._stop()
        if deadline_s is not None:
            budget = max(0.0, deadline_s - time.monotonic())
            stop = stop | tenacity.stop_after_delay(budget)

        def _before_sleep(rs: RetryCallState) -> None:
            if log is not None:
                exc = rs.outcome.exception() if rs.outcome else None
                log.info("retry_scheduled", attempt=rs.attempt_number, sleep_s=round(rs.upcoming_sleep, 4), error=repr(exc))

        return tenacity.AsyncRetrying(
            stop=stop,
            wait=self._wait(),
            retry=tenacity.retry_if_exception_type(retry_on),
            before_sleep=_before_sleep,
            reraise=True,
        )


class RetryBudget:
    """Concurrent retries are capped at max(minimum, ratio x in-flight) so failures cannot storm."""

    def __init__(self, ratio: float = 0.2, minimum: int = 3) -> None:
        self.ratio = ratio
        self.minimum = minimum
        self.active = 0

    def try_acquire(self, inflight: int) -> bool:
        if self.active >= max(self.minimum, int(self.ratio * inflight)):
            return False
        self.active += 1
        return True

    def release(self) -> None:
        self.active = max(0, self.active - 1)
