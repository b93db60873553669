"""Drives the scheduler in (scaled) time: the simulated replica's engine loop.

Each iteration schedules one step, computes its modelled duration from the time model in
``SimConfig.step_seconds``, waits ``duration / time_scale`` of wall time (less when the loop
is behind), then applies the step: requests that reached their length get a token and the
streams waiting on them are woken. Requests that arrive during a step wait for the next one,
as in vLLM's busy loop (``EngineCore.step``). Modelled time runs ``time_scale`` times faster
than the wall clock and is what ``/metrics`` histograms report.

Steps that fall behind the wall clock run back to back (yielding to the event loop every
``YIELD_EVERY_S``), so a fleet on a small machine degrades into "slower than modelled" rather than
dropping work; ``lag_s`` says by how much. The modelled clock does not jump to catch up: a request
is stamped with the wall clock's modelled time when it arrives, and a step admits only requests
that arrived by its modelled start (``Scheduler.schedule``), so a request's time to first token
(``first_token_s - arrival_s``: the rest of the step in flight, the steps queued ahead of it, its
own prefill) is the same on a loaded machine as on an idle one, as long as its arrival is stamped
on time; only when nothing runs does the clock move to the next arrival.
"""

from __future__ import annotations

import asyncio
import logging

from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.metrics import EngineMetrics
from prefix_router.tools.sim.scheduler import Scheduler, SimRequest

__all__ = ["Engine"]

log = logging.getLogger(__name__)

# When behind the wall clock, run steps back to back for up to this long before letting the
# event loop serve HTTP: streams then get several tokens per write instead of one per step.
YIELD_EVERY_S = 0.002


class Engine:
    """One replica's engine: ``submit`` requests, ``run`` the loop as a task, ``abort`` on disconnect."""

    def __init__(self, config: SimConfig, *, vocab_size: int, metrics_registry=None, first: Engine | None = None) -> None:
        """``first``: the first engine of a server of data-parallel ranks, whose ``/metrics``
        registry this one shares (``EngineMetrics``); its rank is the next."""
        self.config = config
        self.scheduler = Scheduler(config, vocab_size=vocab_size)
        self.metrics = EngineMetrics(config, self.scheduler, metrics_registry,
                                     first=None if first is None else first.metrics)
        self.rank = self.metrics.rank
        self._loop = asyncio.get_running_loop()
        self._wall_origin = self._loop.time()
        self._clock_s = 0.0  # modelled time at the end of the last step
        self._wake = asyncio.Event()
        self.lag_s = 0.0  # how far the modelled clock ran behind the wall clock, at most
        self.publisher = None  # a kv_events.EventPublisher: each step's KV events go out through it

    def now_s(self) -> float:
        """Modelled seconds since start, from the wall clock."""
        return (self._loop.time() - self._wall_origin) * self.config.time_scale

    def submit(self, *requests: SimRequest) -> None:
        """Queue requests (the sequences of one prompt: one arrival) at the current modelled
        time; they wait for the step in flight, if any, to end."""
        now_s = self.now_s()
        for request in requests:
            request.arrival_s = now_s
            self.scheduler.add(request)
        self._wake.set()

    def abort(self, request: SimRequest) -> None:
        """Drop a request whose client went away; frees its blocks."""
        if request.finish_reason is None:
            self.scheduler.abort(request, self._clock_s)
            self.metrics.on_finish(request)

    def reset_prefix_cache(self) -> bool:
        """``KVCache.reset_prefix_cache``, its ``AllBlocksCleared`` published at once (an idle
        engine runs no step that would carry it). False while requests hold blocks."""
        done = self.scheduler.kv.reset_prefix_cache()
        if done and self.publisher is not None:
            self.publisher.publish(self.scheduler.kv.take_events())
        return done

    async def run(self) -> None:
        """The engine loop; runs until cancelled."""
        scheduler, config, metrics = self.scheduler, self.config, self.metrics
        last_yield = self._loop.time()
        while True:
            if not scheduler.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            start_s = self._clock_s
            if not scheduler.running:  # idle until the first arrival queued
                start_s = max(start_s, scheduler.waiting[0].arrival_s)
            step = scheduler.schedule(start_s)
            if not step.scheduled:
                # Nothing fits (every block held by requests that cannot run): wait for an abort,
                # a wait that passes in modelled time too.
                self._wake.clear()
                await self._wake.wait()
                self._clock_s = max(start_s, self.now_s())
                continue
            for request in step.admitted:
                metrics.on_scheduled(request, start_s)
            duration = config.step_seconds(step.num_prefill_tokens, step.num_decode_context_tokens,
                                           step.num_loaded_tokens)
            self._clock_s = start_s + duration
            now = self._loop.time()
            delay = self._wall_origin + self._clock_s / config.time_scale - now
            if delay > 0:
                await asyncio.sleep(delay)
                last_yield = self._loop.time()
            else:
                self.lag_s = max(self.lag_s, -delay * config.time_scale)
                if now - last_yield >= YIELD_EVERY_S:
                    await asyncio.sleep(0)  # let arrivals and streams in
                    last_yield = self._loop.time()
            for request in scheduler.finish_step(step, self._clock_s):
                if request.num_output_tokens == 1:
                    metrics.on_first_token(request)
                if request.finish_reason is not None:
                    metrics.on_finish(request)
                if request.on_update is not None:
                    request.on_update()
            if self.publisher is not None:
                events = scheduler.kv.take_events()
                if events:
                    self.publisher.publish(events)
