"""Retry policy, built in one place on tenacity. Every policy has a stop; none retries forever.

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
    """``max_attempts`` counts the first try. Waits are drawn from [0, min(base * 2**n, cap))."""

    max_attempts: int = 3
    base_ms: float = 25.0
    cap_ms: float = 250.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError("max_attempts: must be >= 1")
        if not (0 < self.base_ms <= self.cap_ms):
            raise ConfigError("retry_base_ms: must be > 0 and <= retry_cap_ms")

    def _wait(self) -> tenacity.wait.wait_base:
        return tenacity.wait_random_exponential(multiplier=self.base_ms / 1000.0, max=self.cap_ms / 1000.0)

    def delay_s(self, attempt: int) -> float:
        """Back-off before attempt ``attempt + 1`` (``attempt`` >= 1 is the try that failed)."""
        state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        state.attempt_number = attempt
        return float(self._wait()(state))

    def should_retry(self, attempt: int, remaining_s: float) -> bool:
        """True if another attempt is allowed after ``attempt`` tries with ``remaining_s`` left."""
        return attempt < self.max_attempts and remaining_s > 0

    def async_retrying(self, retry_on: tuple[type[BaseException], ...], *, deadline_s: float | None = None, log=None) -> tenacity.AsyncRetrying:
        """An AsyncRetrying bounded by attempts and (optionally) an absolute monotonic deadline."""
        stop = tenacity.stop_after_attempt(self.max_attempts)
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
