"""The fleet simulator's loop: replicas, a gateway and clients in one process, in virtual time.

Discrete events on one heap, ordered by time, then by the order they were made (so a seed gives
one run): a request arriving (the gateway routes it at once and the replica queues it), an engine
step ending on a replica, a scrape of a replica's queue. Each replica is the simulator's own
engine model (``tools/sim/scheduler.py``: vLLM's scheduler, prefix cache and eviction;
``tools/sim/config.py``: H100 timing), stepped by events instead of the wall clock: a step starts
when one ends or a request arrives at an idle replica, and takes ``SimConfig.step_seconds``. A
session's next turn is sent its think time after the previous one ended, as ``prefix-router
replay`` sends it; a request without a session at its trace time over ``rate_scale``. With
``kv_events_delay_s``, each step's KV events reach every gateway instance that much later
(``events.py``); with ``gateways`` above 1, requests go to the instances in turn, each counting
only its own in flight, as behind a Service that spreads connections.

With ``prefill_replicas``, the fleet is disaggregated (``serve/disagg.py``): each request is
first a one-token job on a prefill replica the policy chooses among the prefill pool, whose
blocks stay held (``SimRequest.hold_blocks``) until the decode replica pulls them; then, chosen
by the policy among the decode pool when the prefill ends (the gateway chooses it at arrival and
sends it then: the same load, a prefill later), a job on that replica that arrives after the
modelled transfer of the blocks it lacks (``kv_transfer.py``'s link) and computes only the
prompt's last token. TTFT is the decode's first token; the hit rate, the prefill pool's.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from prefix_router.config import RoutingConfig
from prefix_router.prompts.tokenizer import PromptTokenizer
from prefix_router.tools.fleetsim.events import publish
from prefix_router.tools.fleetsim.jobs import new_blocks, prompt_of
from prefix_router.tools.fleetsim.router import Sent, SimRouter
from prefix_router.tools.replay.request import CHAT, ReplayRequest
from prefix_router.tools.replay.summary import percentile
from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.kv_transfer import BYTES_PER_TOKEN
from prefix_router.tools.sim.scheduler import Scheduler, SimRequest, Step

__all__ = ["FleetConfig", "simulate"]

_ARRIVE, _STEP, _SCRAPE, _RUN, _EVENTS, _PULLED = 0, 1, 2, 3, 4, 5
_LONGEST_RUN = 4096  # decode-only steps applied at once at most
_MODEL = ""  # the bodies name none: the engine's first block is seeded as the gateway's is


@dataclass(frozen=True, kw_only=True)
class FleetConfig:
    """One simulated fleet: ``replicas`` engines of ``engine``, scraped every ``scrape_interval_s``
    (the gateway's ``scrape.interval_s``), a request's trace time divided by ``rate_scale``;
    ``gateways`` instances in front, following the engines' KV events ``kv_events_delay_s`` late
    (None: routing on their own guesses, the shadow indexes)."""

    replicas: int
    engine: SimConfig = field(default_factory=SimConfig)
    scrape_interval_s: float = 1.0
    rate_scale: float = 1.0
    char_block_size: int = 64
    default_max_tokens: int = 64
    decode_runs: bool = True  # apply runs of decode-only steps at once (``Scheduler.decode``): the same run, faster
    gateways: int = 1
    kv_events_delay_s: float | None = None
    routing: RoutingConfig | None = None  # this gateway's rule and knobs (serve's ``routing``); None: the defaults
    # a disaggregated fleet: this many prefill replicas beside the ``replicas`` decode ones (module docstring)
    prefill_replicas: int = 0
    decode_policy: str | None = None  # the decode pool's rule (SGLang's gateway: power-of-two); None: the policy's
    # a request whose decode replica lacks fewer prompt tokens goes whole to it (disaggregation.min_prefill_tokens)
    min_prefill_tokens: int = 0
    kv_gb_per_s: float = 25.0  # the link the KV cache crosses between the pools (tools/sim/kv_transfer.py)


class _Replica:
    __slots__ = ("name", "scheduler", "step", "run", "runs", "states")

    def __init__(self, name: str, engine: SimConfig, states: list, kv_events: bool) -> None:
        self.name = name
        self.scheduler = Scheduler(engine, vocab_size=1 << 17)
        self.step: Step | None = None  # the step running, if any
        self.run: list[float] | None = None  # or the end times of the decode-only steps running at once
        self.runs = 0  # runs started: an event of a run cut short is one of an earlier number
        self.states = states  # each gateway instance's ReplicaState of it
        self.scheduler.kv.record_events = kv_events

    @property
    def busy(self) -> bool:
        return self.step is not None or self.run is not None


def simulate(requests: Sequence[ReplayRequest], policy: str, fleet: FleetConfig, tokenizer: PromptTokenizer,
             progress: Callable[[int], None] | None = None, records: list[dict] | None = None) -> dict:
    """Run ``requests`` through a fleet routed by ``policy``; its figures: ``token_hit_rate`` (the
    engines' own counters), ``busiest_over_fair`` (requests to the busiest replica over the mean),
    ``ttft_p50_s``/``ttft_p99_s`` (send to first token), ``requests`` (served), ``rejected``
    (prompts no engine takes), ``duration_s`` (virtual: to the last request's end),
    ``offered_rps`` (requests over the span of their arrivals: below the trace's rate where
    sessions wait for their answers; None for one request). ``progress`` is called with each
    request done; ``records`` gets a dict a request served: its index, replica, the times it was
    sent, had its first token and ended, and its prompt and cached tokens.

    Python's cyclic collector is off meanwhile: a run keeps millions of objects alive to its end
    (every replica's KV blocks), which each full collection walked again, and leaves no cycles
    worth its time (docs/performance-notes.md)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(requests, policy, fleet, tokenizer, progress, records)
    finally:
        if enabled:
            gc.enable()


def _simulate(requests: Sequence[ReplayRequest], policy: str, fleet: FleetConfig, tokenizer: PromptTokenizer,
              progress: Callable[[int], None] | None, records: list[dict] | None) -> dict:
    engine, block_size = fleet.engine, fleet.engine.block_size
    # vLLM refuses to start with a max_model_len its KV cache cannot hold: a longer one would
    # leave a request no replica can ever schedule
    engine = replace(engine, max_model_len=min(engine.max_model_len, (engine.num_gpu_blocks - 1) * block_size))
    decoding = [f"replica-{i}" for i in range(fleet.replicas)]
    prefilling = [f"prefill-{i}" for i in range(fleet.prefill_replicas)]
    events = fleet.kv_events_delay_s is not None

    def instances(pool: list[str], rule: str) -> list[SimRouter]:  # a pool's router in each gateway instance
        return [SimRouter(pool, rule, block_size=block_size, capacity=engine.num_gpu_blocks, kv_events=events,
                          routing=fleet.routing) for _ in range(fleet.gateways)]

    # a disaggregated fleet's pools are chosen among apart, each by its own rule and ring
    routers = instances(prefilling or decoding, policy)
    decoders = instances(decoding, fleet.decode_policy or policy) if prefilling else routers
    replicas = {n: _Replica(n, engine, [r.replicas[n] for r in (decoders if n in decoders[0].replicas else routers)],
                            events) for n in decoding + prefilling}
    heap: list = []
    order = itertools.count()

    arrivals = 0  # arrivals on the heap: scrapes go on while any is to come or a request runs

    def push(t: float, kind: int, payload) -> None:
        nonlocal arrivals
        arrivals += kind == _ARRIVE
        heapq.heappush(heap, (t, next(order), kind, payload))

    chains: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        chains.setdefault(r.session if r.session is not None else f"#{i}", []).append(i)
    next_turn = {chain[k]: chain[k + 1] for chain in chains.values() for k in range(len(chain) - 1)}
    for chain in chains.values():
        push(requests[chain[0]].at_s / fleet.rate_scale, _ARRIVE, chain[0])
    for k, name in enumerate(replicas):  # a round of scrapes spread over the interval (fleet/replicas.spread)
        push(fleet.scrape_interval_s * (1 + k / len(replicas)), _SCRAPE, name)

    blocks = new_blocks()
    prefill_names = frozenset(prefilling)
    transfers: list[int] = []  # prompt tokens each decode leg pulled
    paused: dict[str, float] = {}  # replica -> its last scrape's time, for those idle since
    inflight: dict[SimRequest, tuple[int, Sent, float, SimRouter]] = {}
    ttfts: list[float] = []
    done = rejected = 0
    now = end = last_at = 0.0  # the last request's arrival, and the last end of one, bound the run (not late events)
    first_at = math.inf

    def start(replica: _Replica, t: float) -> None:
        steps = replica.scheduler.decode_run(_LONGEST_RUN) if fleet.decode_runs else 0
        if steps >= 2:  # each step's context grows by a token a request
            running = replica.scheduler.running
            context, n, ends = sum(r.num_computed_tokens for r in running), len(running), []
            for s in range(steps):
                t += engine.step_seconds(0, context + s * n)
                ends.append(t)
            replica.run, replica.step = ends, None
            replica.runs += 1
            push(t, _RUN, (replica.name, replica.runs))
            return
        step = replica.scheduler.schedule()
        replica.step = step if step.scheduled else None
        if replica.step is not None:
            duration = engine.step_seconds(step.num_prefill_tokens, step.num_decode_context_tokens, step.num_loaded_tokens)
            push(t + duration, _STEP, replica.name)

    def arrive(i: int, t: float) -> None:
        nonlocal rejected, first_at, last_at, end
        first_at, last_at, end = min(first_at, t), t, t
        request = requests[i]
        length = request.meta.get("input_length", request.meta.get("units", 0))
        try:  # a prompt known too long is refused before it is made
            info, ids = prompt_of(request, tokenizer, block_size=block_size, char_block_size=fleet.char_block_size,
                                  blocks=blocks) if length < engine.max_model_len else (None, [])
        except ValueError:
            ids = []
        if not ids or len(ids) >= engine.max_model_len:
            rejected += 1
            follow(i, t)
            return
        router = routers[i % len(routers)]
        max_tokens = max(int(request.body.get("max_tokens") or fleet.default_max_tokens), 1)
        if prefilling and (fleet.min_prefill_tokens or (len(ids) - 1) // block_size == 0):  # serve/proxy._serve
            decoder = decoders[i % len(decoders)]
            decision = decoder.choose(info, request.session, t)
            if ((len(ids) - 1) // block_size == 0
                    or len(ids) - decision.predicted_blocks * block_size < fleet.min_prefill_tokens):
                queue(i, decoder, decoder.acquire(info, decision, t), ids, max_tokens, t, t)
                return
        queue(i, router, router.send(info, request.session, t), ids, 1 if prefilling else max_tokens, t, t)

    def queue(i: int, router: SimRouter, sent: Sent, ids: list[int], max_tokens: int, t: float, arrived: float,
              pulled: int = 0) -> None:
        """A job for request ``i`` on its replica at ``t``: the whole request, a prefill leg (its
        blocks held) or a decode leg (``pulled`` prompt tokens come computed)."""
        request, info = requests[i], sent.info
        replica = replicas[sent.replica.name]
        if replica.name in paused:  # its scrapes resume, at their times, from the next one
            last, interval = paused.pop(replica.name), fleet.scrape_interval_s
            push(last + max(math.ceil((t - last) / interval), 1) * interval, _SCRAPE, replica.name)
        job = SimRequest(str(i), ids, max_tokens, model=_MODEL, arrival_s=t)
        job.hold_blocks, job.num_external_tokens = replica.name in prefill_names, pulled
        if info.exact and request.path != CHAT and not isinstance(request.body.get("prompt"), str):
            job.block_hashes = list(info.hashes)  # the gateway hashed these very ids, as the engine would
        inflight[job] = (i, sent, arrived, router)
        if replica.run is not None:  # the run ends with the step under way: the request waits for the next
            ends = replica.run
            m = min(bisect.bisect_right(ends, t) + 1, len(ends))
            if m < len(ends):
                replica.run = ends[:m]
                replica.runs += 1
                push(ends[m - 1], _RUN, (replica.name, replica.runs))
        replica.scheduler.add(job)
        if not replica.busy:
            start(replica, t)

    def follow(i: int, t: float) -> None:
        j = next_turn.get(i)
        if j is not None:
            push(t + requests[j].think_s / fleet.rate_scale, _ARRIVE, j)

    def step_ended(replica: _Replica, t: float) -> None:
        for job in replica.scheduler.finish_step(replica.step, t):
            if job.num_output_tokens == 1:
                if not job.hold_blocks:  # a prefill leg's token is not the client's
                    ttfts.append(t - inflight[job][2])
                SimRouter.first_token(inflight[job][1])
            if job.finish_reason is not None:
                ended(replica, job, t)
        published(replica, t)
        start(replica, t)

    def run_ended(replica: _Replica, t: float) -> None:
        ends, replica.run = replica.run, None
        for job in replica.scheduler.decode(len(ends), t):
            ended(replica, job, t)
        published(replica, t)
        start(replica, t)

    def published(replica: _Replica, t: float) -> None:  # the step's events, and its scheduling's before it
        if events and (batch := replica.scheduler.kv.take_events()):
            push(t + fleet.kv_events_delay_s, _EVENTS, (replica.name, publish(batch, t)))

    def prefilled(replica: _Replica, job: SimRequest, t: float) -> None:
        """A prefill leg ended: its decode leg is chosen and sent once the blocks it lacks moved."""
        i, sent, arrived, router = inflight.pop(job)
        router.finished(sent, job.num_output_tokens, t)
        request, ids = requests[i], job.token_ids[: job.num_prompt_tokens]
        router = decoders[i % len(decoders)]
        decode = router.send(sent.info, request.session, t)
        local = len(replicas[decode.replica.name].scheduler.kv.find_longest_cache_hit(job.block_hashes, len(ids)))
        moved = max(len(ids) - 1 - local * block_size, 0)
        transfers.append(moved)
        push(t + moved * BYTES_PER_TOKEN / (fleet.kv_gb_per_s * 1e9), _PULLED,
             (replica.name, job.request_id, i, router, decode, ids, arrived))

    def pulled(prefill: str, job_id: str, i: int, router: SimRouter, sent: Sent, ids: list[int], arrived: float,
               t: float) -> None:
        replicas[prefill].scheduler.release_held(job_id)
        max_tokens = int(requests[i].body.get("max_tokens") or fleet.default_max_tokens)
        queue(i, router, sent, ids, max(max_tokens, 1), t, arrived, pulled=len(ids))

    def ended(replica: _Replica, job: SimRequest, t: float) -> None:
        nonlocal done, end
        end = t
        if job.hold_blocks:
            prefilled(replica, job, t)
            return
        i, sent, sent_at, router = inflight.pop(job)
        router.finished(sent, job.num_output_tokens, t)
        done += 1
        if records is not None:
            records.append({"request": i, "replica": replica.name, "sent_s": sent_at,
                            "first_token_s": job.first_token_s, "end_s": t,
                            "prompt_tokens": job.num_prompt_tokens, "cached_tokens": job.num_cached_tokens})
        if progress is not None:
            progress(1)
        follow(i, t)

    while heap:
        now, _, kind, payload = heapq.heappop(heap)
        if kind == _ARRIVE:
            arrivals -= 1
            arrive(payload, now)
        elif kind == _STEP:
            step_ended(replicas[payload], now)
        elif kind == _RUN:
            if payload[1] == replicas[payload[0]].runs:
                run_ended(replicas[payload[0]], now)
        elif kind == _PULLED:
            pulled(*payload, now)
        elif kind == _EVENTS:
            for router in routers + decoders if prefilling else routers:
                if payload[0] in router.feeds:
                    router.feeds[payload[0]].receive(payload[1])
        elif inflight or arrivals:
            replica = replicas[payload]
            scheduler = replica.scheduler
            for state in replica.states:
                SimRouter.scraped(state, len(scheduler.waiting), len(scheduler.running))
            if any(state.inflight for state in replica.states) or scheduler.has_work:
                push(now + fleet.scrape_interval_s, _SCRAPE, payload)
            else:  # idle: its next scrapes would read what this one read, until a request is sent to it
                paused[payload] = now
    offered = (done + rejected) / (last_at - first_at) if last_at > first_at else None  # as capacity.trace_rate
    if not prefilling:
        return {**_figures(replicas, routers, ttfts, done, rejected, end), "offered_rps": offered}
    pool = {n: replicas[n] for n in prefilling}  # where prompts were computed
    return {**_figures(pool, routers, ttfts, done, rejected, end), "offered_rps": offered,
            "decode_busiest_over_fair": _figures({n: replicas[n] for n in decoding}, decoders, [], 0, 0, 0)[
                "busiest_over_fair"], "transfer_tokens": sum(transfers),
            "decode_computed_tokens": sum(replicas[n].scheduler.num_prompt_tokens for n in decoding),
            "held_at_end": sum(len(replicas[n].scheduler.held) for n in prefilling)}


def _figures(replicas: dict, routers: list[SimRouter], ttfts: list[float], done: int, rejected: int,
             end: float) -> dict:
    """The figures of ``simulate`` over ``replicas`` (a disaggregated fleet's prefill pool, or all)."""
    queries = sum(r.scheduler.kv.num_queries for r in replicas.values())
    hits = sum(r.scheduler.kv.num_hits for r in replicas.values())
    sent = [sum(router.sent_to[n] for router in routers) for n in replicas]
    fair = sum(sent) / len(replicas) if replicas else 0.0
    return {"token_hit_rate": hits / queries if queries else 0.0,
            "busiest_over_fair": max(sent) / fair if fair else 0.0,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "requests": done, "rejected": rejected, "duration_s": end,
            "preemptions": sum(r.scheduler.num_preemptions for r in replicas.values())}
