"""A circuit breaker for a remote datastore: a datastore that stops answering costs a decoder a few
steps, then nothing.

While the datastore answers, the breaker is ``CLOSED`` and every step asks it. After ``failures``
consecutive failed or late calls it opens: no step asks it (each drafts from local sources), until
a backoff has passed; then it is ``HALF_OPEN`` and lets one call through, a probe, which the
caller sends without waiting for it (``drafter.core.scheduler.DraftScheduler``). A probe answered in time
closes the breaker; a failed one opens it again for twice the backoff, up to ``max_backoff``, so
that drafting resumes within about that long once the datastore is back, while a datastore that
stays down is asked a couple of times a second at most.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class BreakerState(enum.Enum):
    CLOSED = "closed"  # the datastore answers: ask it every step
    OPEN = "open"  # it failed repeatedly: do not ask it until the backoff has passed
    HALF_OPEN = "half-open"  # the backoff has passed: one probe is (or may be) in flight


class Admission(enum.Enum):
    """What ``CircuitBreaker.admit`` allows the caller to do now."""

    CALL = "call"  # ask the datastore, as usual
    PROBE = "probe"  # send one call without waiting for it; report its outcome when it is done
    SKIP = "skip"  # do not ask it: draft from local sources


class CircuitBreaker:
    """The state of one remote datastore as its callers see it; thread-safe.

    name         how log lines name the datastore
    failures     consecutive failed or late calls that open the breaker
    backoff      seconds it stays open the first time; doubled after each failed probe
    max_backoff  the longest it stays open: drafting resumes within about this long (plus a probe's
                 round trip and a step) once the datastore answers again
    clock        seconds, monotonic (injectable for tests)
    """

    def __init__(
        self,
        name: str,
        *,
        failures: int = 3,
        backoff: float = 0.1,
        max_backoff: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures < 1 or not 0 < backoff <= max_backoff:
            raise ValueError(
                f"need failures >= 1 and 0 < backoff <= max_backoff, got {failures}, {backoff}, {max_backoff}"
            )
        self.name, self.failures, self.backoff, self.max_backoff = name, failures, backoff, max_backoff
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failed = 0  # consecutive failures while closed
        self._wait = backoff  # how long the current (or next) opening lasts
        self._reopen_at = 0.0
        self.openings = 0  # times it opened from closed
        self.probes = 0  # probes admitted

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    @property
    def closed(self) -> bool:
        """Whether callers may ask the datastore (``admit`` would say ``CALL``); changes nothing."""
        return self.state is BreakerState.CLOSED

    def admit(self) -> Admission:
        """Whether to ask the datastore now. ``PROBE`` once its backoff has passed (again, should a
        probe's outcome never be reported); the caller then reports the probe's outcome."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return Admission.CALL
            now = self._clock()
            if now < self._reopen_at:
                return Admission.SKIP
            self._state, self._reopen_at = BreakerState.HALF_OPEN, now + self._wait
            self.probes += 1
            return Admission.PROBE

    def succeeded(self) -> None:
        """A call was answered in time: close (the datastore is back) and forget past failures."""
        with self._lock:
            if self._state is not BreakerState.CLOSED:
                log.info("%s answers again: drafting from it", self.name)
            self._state, self._failed, self._wait = BreakerState.CLOSED, 0, self.backoff

    def failed(self) -> None:
        """A call failed or was late. Closed: open after ``failures`` in a row. Half-open (the probe
        failed): open again, for twice as long (at most ``max_backoff``)."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                self._failed += 1
                if self._failed < self.failures:
                    return
                self.openings += 1
                log.warning(
                    "%s failed %d calls in a row: drafting from local sources, probing it every %g s at most",
                    self.name,
                    self._failed,
                    self.max_backoff,
                )
            elif self._state is BreakerState.HALF_OPEN:
                self._wait = min(self._wait * 2, self.max_backoff)
                log.debug("%s: probe failed, next in %g s", self.name, self._wait)
            else:  # a call admitted before the breaker opened, failing late: already open
                return
            self._state, self._failed = BreakerState.OPEN, 0
            self._reopen_at = self._clock() + self._wait
