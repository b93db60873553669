"""The admission queue: requests wait at the gateway, not at a saturated replica.

When every routable replica is saturated (``Gateway.saturated``: its engine reported a queue
at the last scrape, and that queue plus the requests sent since reach
``AdmissionConfig.saturated_depth``), a new request waits here, first come first served, until
some replica is not; it is then routed with what the gateway knows at
that moment, so it lands where capacity freed rather than where it would have queued. The
queue is bounded (``max_queue``: beyond it, 429 at once) and so is the wait (``timeout_s``:
then 503); both answers carry ``Retry-After``, as the OpenAI API and vLLM's clients expect
when backing off. Waiters are woken when a request finishes and after every scrape
(``notify``). ``saturated_depth: 0`` turns the queue off.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from prefix_router.config import AdmissionConfig

__all__ = ["Admission", "QueueFull", "QueueTimeout"]


class QueueFull(Exception):
    """``max_queue`` requests are already waiting (answer 429)."""


class QueueTimeout(Exception):
    """A request waited ``timeout_s`` without a replica freeing up (answer 503)."""


class Admission:
    """FIFO gate in front of the policy. ``saturated()`` says whether every routable replica is
    at or above the saturated depth (the caller computes it from live replica state)."""

    def __init__(self, config: AdmissionConfig, saturated: Callable[[], bool]) -> None:
        self.config = config
        self._saturated = saturated
        self._waiters: deque[asyncio.Future] = deque()

    def __len__(self) -> int:
        """Requests waiting now."""
        return len(self._waiters)

    async def admit(self) -> float:
        """Return when the request may be routed: at once unless saturated or others wait first.
        Returns the seconds waited. Raises ``QueueFull`` or ``QueueTimeout``; a caller cancelled
        while waiting (its client left) gives up its place, or its turn to the next waiter."""
        if self.config.saturated_depth == 0 or (not self._waiters and not self._saturated()):
            return 0.0
        if len(self._waiters) >= self.config.max_queue:
            raise QueueFull
        loop = asyncio.get_running_loop()
        started = loop.time()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        admitted = False
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.config.timeout_s)
            admitted = True
        except asyncio.TimeoutError:
            admitted = waiter.done() and not waiter.cancelled()  # admitted at the deadline
            if not admitted:
                raise QueueTimeout from None
        finally:
            if not admitted:
                if waiter.done() and not waiter.cancelled():
                    self.notify()  # cancelled after its turn came: pass the turn on
                waiter.cancel()
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        return loop.time() - started

    def notify(self) -> None:
        """Capacity may have freed (a request finished, a scrape came in) or was just taken (a
        request was sent: the proxy calls this after counting it): admit the first waiter if
        some replica is below saturation. One at a time, so each admitted request adds to a
        replica's load before the next is considered."""
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()  # cancelled while waiting
        if self._waiters and not self._saturated():
            self._waiters.popleft().set_result(None)
