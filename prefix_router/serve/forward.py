"""Sending a routed request to its replica (``forward``): attempts, retries, the circuit breaker,
and the in-flight accounting that routing reads.

An attempt that fails before anything reached the client (a connect error, a 5xx, no response
headers within ``upstream.header_timeout_s`` for a stream) is retried, up to
``upstream.max_retries`` times, on the replica the policy chooses among those not tried yet.
Each attempt's outcome goes to the replica's circuit breaker (prefix_router/fleet/breaker.py), except what
says nothing of the replica: a client that left, and a 5xx that no replica got past. A replica
that answered 5xx is blamed only once another replica served the same request: a request every
replica refuses is the request's fault, so a client cannot open breakers by sending requests
that make replicas fail.

While an attempt is in flight (``InFlight``, also the Endpoint Picker's: ``epp/picker.py``) its replica counts it in ``inflight`` (the load
bound's load), in ``sent_since_scrape`` (its queue depth) and in its share of recent requests;
its blocks count as cached at once, in the shadow index and in the KV event view, since vLLM
makes blocks hittable as soon as they are scheduled and a burst of one prefix must see them.
Its uncached blocks count in ``prefill_blocks`` (what new work compares) until the replica's
first token (a stream's first data event; an answer in one body, until it ends). All of it is
taken back when the attempt ends, whatever the way.
"""

from __future__ import annotations

import asyncio
import math
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

import aiohttp
from aiohttp import web

from prefix_router.cache.engine_view import EngineView
from prefix_router.constants import DP_RANK_HEADER
from prefix_router.fleet.breaker import BreakerState
from prefix_router.fleet.kv_follower import check_parity
from prefix_router.prompts.responses import MESSAGES, RESPONSES, Events, chat_usage
from prefix_router.errors import openai_error
from prefix_router.gateway import Gateway
from prefix_router.serve.inbound import Inbound
from prefix_router.routing.decision import Decision, Route
from prefix_router.prompts.analysis import PromptInfo
from prefix_router.serve.relay import CLIENT_GONE, relay
from prefix_router.fleet.replicas import ReplicaState

__all__ = ["InFlight", "Outcome", "answered", "attempts", "forward", "headers_for"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """How a request ended: what learning (prefix_router/serve/learning.py) needs.

    ``replica`` and ``decision`` are None when no replica answered below 500 (the response is
    then the gateway's 502). ``route``: the decision's route, or ``retry`` for an attempt after
    the first. ``usage``: the engine's, in the chat's shape whatever the API
    (``responses.chat_usage``). ``held_blocks``: blocks the replica held now or lately when it was
    sent (a miss of those is an eviction). ``view``: the replica's KV-event view the request was
    routed by (None without one), and ``removals`` its removals when the request was sent, for
    ``EngineView.evicted_since``. ``answer``: the answer's JSON object when it
    came in one body, or a Responses stream's completed response; ``response_id``: a Responses
    answer's id. Times in seconds from sending (a disaggregated request's: from its prefill leg's).
    """

    response: web.StreamResponse
    status: int
    replica: ReplicaState | None = None
    decision: Decision | None = None
    route: Route | None = None
    usage: dict | None = None
    ttft_s: float | None = None
    elapsed_s: float = 0.0
    held_blocks: int = 0
    view: EngineView | None = None
    removals: int = 0
    answer: dict | None = None
    response_id: str | None = None
    # a disaggregated request's (serve/disagg.py): the decode leg's replica, the fields above
    # being its prefill leg's cache accounting, and how the prompt's KV reached the decode
    decode: ReplicaState | None = None
    transfer: str | None = None


Choose = Callable[[frozenset[str]], Decision | None]  # the policy's choice among replicas not tried


async def forward(request: web.Request, gw: Gateway, inbound: Inbound, info: PromptInfo, decision: Decision,
                  choose: Choose, *, retry_payload: bytes | None = None, started: float | None = None) -> Outcome:
    """Send the request where ``decision`` says, retrying where ``choose`` says (module docstring).

    ``retry_payload``: the body a retry sends in place of ``inbound.payload`` (a decode leg's
    retry goes without the transfer its first attempt may have consumed: ``disagg.py``).
    ``started``: ``time.perf_counter()`` the request's times count from (a decode leg's: its
    prefill leg's dispatch), else each attempt's own sending."""
    answered_5xx: list[ReplicaState] = []  # replicas to blame if a later one serves the request
    last_error = "no replica answered"
    for attempt, replica, decision, route in attempts(gw, choose, decision):
        payload = retry_payload if attempt and retry_payload is not None else inbound.payload
        outcome = await _attempt(request, gw, inbound, info, replica, decision, route, answered_5xx, payload, started)
        if isinstance(outcome, Outcome):
            return outcome
        last_error = outcome
    return Outcome(openai_error(502, last_error, type_="BadGatewayError"), 502)


def attempts(gw: Gateway, choose: Choose, decision: Decision | None = None
             ) -> Iterator[tuple[int, ReplicaState, Decision, Route]]:
    """Each attempt to make, up to ``upstream.max_retries`` retries: (its number, the replica,
    the decision, its route: ``retry`` after the first). The first goes where ``decision`` says
    (``choose`` decides it when None), each later one where ``choose`` says among the replicas
    not tried yet; a replica dropped by discovery, or whose breaker opened while an earlier
    attempt ran, is skipped (counting as tried). Ends when the retries are spent or ``choose``
    finds none."""
    tried: set[str] = set()
    for attempt in range(gw.config.upstream.max_retries + 1):
        if attempt or decision is None:
            decision = choose(frozenset(tried))
            if decision is None:
                return
        tried.add(decision.replica)
        replica = gw.replicas.get(decision.replica)
        if replica is None or not replica.breaker.allows(time.monotonic()):
            continue
        yield attempt, replica, decision, Route.RETRY if attempt else decision.route


async def _attempt(request: web.Request, gw: Gateway, inbound: Inbound, info: PromptInfo, replica: ReplicaState,
                   decision: Decision, route: Route, answered_5xx: list[ReplicaState], payload: bytes,
                   started: float | None) -> Outcome | str:
    """One attempt on ``replica``: its Outcome once it answered below 500, else why it failed."""
    header_timeout = gw.config.upstream.header_timeout_s if inbound.stream else None
    with InFlight(gw, replica, info, decision) as slot:
        t0 = time.perf_counter() if started is None else started
        try:
            # asyncio.timeout, not wait_for: no task of its own per request (None: no limit)
            async with asyncio.timeout(header_timeout):
                upstream = await gw.http.post(replica.url + inbound.path, data=payload, headers=headers_for(replica,
                                              inbound.headers), allow_redirects=False)
            async with upstream:
                if upstream.status >= 500:
                    slot.failed = True
                    answered_5xx.append(replica)
                    gw.metrics.requests.labels(replica.name, route.value, str(upstream.status)).inc()
                    return f"replica {replica.name} answered {upstream.status}"
                events = Events(inbound.path) if inbound.path in (RESPONSES, MESSAGES) else None
                relayed = await relay(request, upstream, replica.name, stream=inbound.stream,
                                      client_wants_usage=inbound.client_wants_usage,
                                      write_timeout_s=gw.config.limits.client_write_timeout_s, sent_at=t0,
                                      events=events, on_first_token=slot.prefilled)
                elapsed = time.perf_counter() - t0
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # client-side writes never raise here
            slot.ok, slot.failed = False, True
            log.warning("upstream %s failed (%s)", replica.name, type(exc).__name__)
            gw.metrics.requests.labels(replica.name, route.value, "0").inc()
            return f"replica {replica.name}: {type(exc).__name__}"
        slot.relayed(relayed.status)
        if relayed.status == 404:  # perhaps a model it no longer serves (an adapter unloaded):
            replica.models_read_at = -math.inf  # its list is read again at the next round
        if slot.ok:
            for earlier in answered_5xx:
                breaker_record(gw, earlier, False)
    usage, answer, response_id = answered(inbound.path, events, relayed.answer, relayed.usage)
    return Outcome(relayed.response, relayed.status, replica, decision, route, usage, relayed.ttft_s, elapsed,
                   slot.held_blocks, slot.view, slot.removals, answer, response_id)


def headers_for(replica: ReplicaState, headers: dict[str, str]) -> dict[str, str]:
    """The headers a request goes to ``replica`` with: with its data-parallel rank, where it is one
    (a client's own rank header never passes: the rank is the routing's choice)."""
    if replica.rank is None:
        return headers  # the client's was dropped with the hop-by-hop headers (inbound.forward_headers)
    return {**headers, DP_RANK_HEADER: str(replica.rank)}


def answered(path: str, events, answer: dict | None, usage) -> tuple[dict | None, dict | None, str | None]:
    """What learning reads of an answer to ``path``: (its usage in the chat's shape, its JSON
    object, a Responses answer's id). ``answer`` and ``usage``: the one body's; ``events``: what
    read the stream (``responses.Events`` gives a Responses stream's completed response and id),
    or None."""
    if answer is None and events is not None:
        answer = getattr(events, "response", None)
    response_id = answer.get("id") if path == RESPONSES and answer is not None else getattr(events, "response_id", None)
    return chat_usage(path, usage), answer, response_id if isinstance(response_id, str) and response_id else None


class InFlight:
    """The accounting of one attempt in flight on a replica (module docstring): ``acquire`` counts
    it on the replica, ``release`` takes it off, each at most once whatever calls it again, so an
    attempt that ends several ways at once (an answer, a client that left, a fallback that served
    it: the Endpoint Picker's paths) is counted once. ``with InFlight(...) as slot`` does both.
    ``ok``: the attempt's verdict for the breaker (None: says nothing of the replica)."""

    def __init__(self, gw: Gateway, replica: ReplicaState, info: PromptInfo, decision: Decision) -> None:
        self.gw, self.replica, self.info, self.decision = gw, replica, info, decision
        self.ok: bool | None = None
        self.served = False  # the replica answered 200 and the client got it all
        self.failed = False  # no answer, or a 5xx: the request goes elsewhere, its blocks will not be here
        self.view: EngineView | None = None
        self.removals = 0
        # what the replica held before this attempt's own blocks count (routing's view of it)
        self.held_blocks = min(replica.cache_index(info.exact).match_ever(info.hashes), gw.max_hit_blocks(info))
        # the prompt's blocks (partial last one included) the replica is not believed to hold:
        # in blocks, so token and character prompts count alike
        self.prefill = max(-(-info.num_units // gw.unit_block_size(info)) - decision.predicted_blocks, 0)
        self.acquired = self.released = False

    def prefilled(self) -> None:
        """The replica sent the first token: the prompt's prefill no longer queues on it."""
        self.replica.prefill_blocks -= self.prefill
        self.prefill = 0

    def relayed(self, status: int) -> None:
        """The replica answered below 500 and the answer went to the client with ``status``."""
        self.served = status == 200
        if status != CLIENT_GONE:
            self.ok = status != 502  # 502: the replica cut the stream

    def __enter__(self) -> InFlight:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()

    def acquire(self) -> InFlight:
        """Count the attempt on its replica (load, prefill queued, breaker trial, shadow index,
        the engine view's routed blocks). A second call does nothing."""
        if self.acquired:
            return self
        self.acquired = True
        gw, r, info = self.gw, self.replica, self.info
        self.sent_at = now = time.monotonic()
        r.breaker.on_send(now)
        r.note_sent(now, gw.config.routing.share_half_life_s)
        r.sent_since_scrape += 1
        self.epoch = r.scrape_epoch
        r.inflight += 1
        r.prefill_blocks += self.prefill
        gw.metrics.inflight.labels(r.name).set(r.inflight)
        gw.admission.notify()  # this request's load is counted: the next waiter, if any, may go
        self.added = r.shadow.insert(info.hashes)  # what it held before, for forget
        self.view = r.stream.view if r.stream is not None and info.exact else None
        self.removals = self.view.note_routed(info.hashes) if self.view is not None else 0
        return self

    def release(self) -> None:
        """Take the attempt off its replica and give the breaker its verdict (``ok``); a failed
        attempt's blocks leave the shadow index. Does nothing before ``acquire`` or a second time."""
        if not self.acquired or self.released:
            return
        self.released = True
        gw, r, info = self.gw, self.replica, self.info
        if self.served and info.exact:  # before the view lets go of the blocks it was told of
            check_parity(gw, r, info.hashes, self.sent_at)
        if r.scrape_epoch == self.epoch:
            r.sent_since_scrape = max(r.sent_since_scrape - 1, 0)
        r.inflight -= 1
        self.prefilled()  # if no first token came
        gw.metrics.inflight.labels(r.name).set(r.inflight)
        gw.admission.notify()
        if self.ok is None:
            r.breaker.release_trial()  # a half-open breaker may try again
        else:
            breaker_record(gw, r, self.ok)
        if self.view is not None:
            self.view.release_routed(info.hashes, time.monotonic(), served=self.ok is True)
        if self.failed:
            r.shadow.forget(info.hashes, self.added)  # take back what a failed attempt added


def breaker_record(gw: Gateway, replica: ReplicaState, ok: bool) -> None:
    """One attempt's outcome to the replica's breaker; log and export a change of state."""
    changed = replica.breaker.record(ok, time.monotonic())
    if changed is BreakerState.OPEN:
        log.warning("replica %s: circuit breaker open after %d consecutive failed requests; no requests for %.0f s",
                    replica.name, replica.breaker.failures, replica.breaker.cooldown_s)
    elif changed is BreakerState.CLOSED:
        log.info("replica %s: circuit breaker closed (a trial request succeeded)", replica.name)
    if changed is not None:
        gw.metrics.breaker_state.labels(replica.name).set(changed)
