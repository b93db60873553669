"""A circuit breaker per replica: passive health from the answers real requests get.

Active health checks (``replicas.poll_health``) catch a replica that is down or hung, since
its ``/health`` fails too. They miss one whose ``/health`` answers 200 while generation fails
(a broken model load, a CUDA error, a full disk for logs): every request sent there costs a
failed attempt and a retry hop. The breaker counts consecutive failed attempts (5xx answers,
connect errors, timeouts, streams cut) and, at ``BreakerConfig.failures``:

- **open**: the replica takes no requests for ``cooldown_s``;
- **half-open** after that: one trial request is let through;
- the trial succeeding **closes** it; failing, it opens again for twice as long, up to
  ``max_cooldown_s``.

The pattern and its three states follow Nygard, *Release It!* (2007), as Envoy's outlier
detection and most service meshes apply it. The class is synchronous and takes ``now``
(monotonic seconds) from the caller, so tests drive the clock.
"""

from __future__ import annotations

import enum

from prefix_router.config import BreakerConfig

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(enum.IntEnum):
    """Exported as the value of ``prefix_router_replica_breaker_state``."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    """Consecutive-failure breaker for one replica."""

    __slots__ = ("config", "failures", "opened_at", "cooldown_s", "trial_inflight")

    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        self.failures = 0  # consecutive failed attempts
        self.opened_at: float | None = None  # None: closed
        self.cooldown_s = config.cooldown_s
        self.trial_inflight = False

    def state(self, now: float) -> BreakerState:
        """Closed, open (cooling down) or half-open (cooldown over: ready for a trial)."""
        if self.opened_at is None:
            return BreakerState.CLOSED
        return BreakerState.OPEN if now - self.opened_at < self.cooldown_s else BreakerState.HALF_OPEN

    def allows(self, now: float) -> bool:
        """Whether a request may be sent now: closed, or half-open with no trial in flight."""
        state = self.state(now)
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self.trial_inflight)

    def on_send(self, now: float) -> None:
        """A request is being sent; in the half-open state it is the trial."""
        if self.state(now) is BreakerState.HALF_OPEN:
            self.trial_inflight = True

    def release_trial(self) -> None:
        """An attempt ended saying nothing of the replica (its client left, or every replica
        refused the request): a half-open breaker may send another trial."""
        self.trial_inflight = False

    def record(self, ok: bool, now: float) -> BreakerState | None:
        """Count one attempt's outcome; returns the new state when it changed, else None."""
        before = self.state(now)
        self.trial_inflight = False
        if ok:
            self.failures = 0
            if self.opened_at is None:
                return None
            self.opened_at, self.cooldown_s = None, self.config.cooldown_s
            return BreakerState.CLOSED
        self.failures += 1
        if before is BreakerState.HALF_OPEN:
            self.opened_at = now
            self.cooldown_s = min(2 * self.cooldown_s, self.config.max_cooldown_s)
            return BreakerState.OPEN
        if before is BreakerState.CLOSED and self.failures >= self.config.failures:
            self.opened_at = now
            return BreakerState.OPEN
        return None  # already open: a request sent before it opened failed too
