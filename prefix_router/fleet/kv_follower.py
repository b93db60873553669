"""Each replica's cache as its engine reports it: finding the event streams, and checking them.

``follow_events`` runs beside the other pollers. For every replica without a stream it finds
the publisher: ``replicas[].kv_events`` when configured, else the replica's own
``GET /kv_event_sources`` (vLLM 0.32: its ``--kv-events-config`` per data-parallel rank, with the
bind address ``tcp://*:5557``, whose ``*`` is the replica's host as the gateway reaches it), else
``kv_events.port`` on the replica's host. It then starts an ``EventStream`` into an
``EngineView`` (``prefix_router/cache/stream.py``, ``prefix_router/cache/events.py``) and keeps it until the replica
leaves. A data-parallel rank (``replicas[].data_parallel_size``) follows its own engine's
publisher: its entry in ``/kv_event_sources``, else the configured ports plus its rank, as vLLM
offsets them. A server of several ranks not known as such follows none: vLLM spreads its
requests over the ranks, and no one rank's events say what it holds.

``ReplicaState.cache_index`` is what routing reads: the engine's view while its stream is fresh
and the prompt was cut into exact token blocks (events carry token ids: character blocks never
match), else the gateway's own guess, the shadow index.

Parity (``check_parity``): when a request the gateway routed ends, the engine has stored every
full block of its prompt, and while the request ran none could be evicted. So the view must hold
the prompt's last full block by then, or have seen it removed since; ``kv_events.parity_grace_s``
covers the step the events take to arrive. A block the events never showed means the gateway
cuts or hashes prompts differently from the engine: the tokenizer, the chat template, the block
size, the model name or LoRA that seeds the first block, or the cache salt. Every such request
counts in ``prefix_router_kv_parity_total{result="mismatch"}``, and the log says which it likely is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp

from prefix_router.cache.blocks import BlockHash, seed_hash
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.stream import EventStream

if TYPE_CHECKING:
    from prefix_router.gateway import Gateway
    from prefix_router.fleet.replicas import ReplicaState

__all__ = ["follow_events", "event_endpoints", "check_parity", "parity_hint"]

log = logging.getLogger(__name__)

RETRY_SOURCES_S = 30.0  # a replica that publishes no events is asked again this often
_warned_ranks: set[str] = set()  # replicas found to run several data-parallel ranks, warned of once


def _on_host(address: str | None, host: str) -> str | None:
    """A bind address (``tcp://*:5557``) as a connect address on ``host``."""
    if not isinstance(address, str) or not address.startswith("tcp://"):
        return None
    bound, _, port = address[len("tcp://"):].rpartition(":")
    if bound in ("*", "0.0.0.0", "::", "[::]", ""):
        bound = f"[{host}]" if ":" in host else host
    return f"tcp://{bound}:{port}"


def _offset(endpoint: str | None, rank: int) -> str | None:
    """``tcp://host:port`` with ``rank`` added to its port (vLLM's ``offset_endpoint_port`` in
    ``vllm/distributed/kv_events.py``: each data-parallel rank publishes on base port + rank)."""
    if endpoint is None or not rank:
        return endpoint
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + rank}" if port.isdigit() else endpoint


def _by_rank(sources):
    """``/kv_event_sources`` as a map of rank (a string) to its publisher's configuration: vLLM
    0.32 answers one (``entrypoints/serve/instrumentator/basic.py``); a list (ranks in order, or
    each naming its ``data_parallel_rank``), or one under ``"sources"``, is read as one too."""
    if isinstance(sources, dict) and isinstance(sources.get("sources"), list):
        sources = sources["sources"]
    if not isinstance(sources, list):
        return sources
    out = {}
    for i, entry in enumerate(sources):
        if isinstance(entry, dict):
            rank = entry.get("data_parallel_rank", entry.get("rank", i))
            out.setdefault(str(rank), entry)
    return out


async def event_endpoints(gw: Gateway, replica: ReplicaState) -> tuple[str, str | None] | None:
    """(publisher, replay socket) for ``replica``, or None when it publishes no events."""
    if replica.config.kv_events:  # rank 0's; rank r's ports are r higher, as vLLM's publisher offsets them
        rank = replica.rank or 0
        return _offset(replica.config.kv_events, rank), _offset(replica.config.kv_events_replay, rank)
    host = urlsplit(replica.url).hostname or ""
    try:
        async with gw.http.get(replica.url + "/kv_event_sources", timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
            sources = await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        sources = None
    sources = _by_rank(sources)
    if isinstance(sources, dict) and sources:
        rank = str(replica.rank) if replica.rank is not None else "0"  # each rank publishes its own events
        rank0 = sources.get(rank) or (next(iter(sources.values())) if replica.rank is None else None)
        if len(sources) > 1 and replica.rank is None:
            # vLLM balances requests over its ranks, each with its own cache: no one rank's events
            # say what the server holds, and following one would read as a cache gone wrong
            if replica.name not in _warned_ranks:
                _warned_ranks.add(replica.name)
                log.warning("replica %s runs %d data-parallel ranks, each its own prefix cache; routing it by the "
                            "gateway's own guess (replicas[].data_parallel_size: %d makes each rank a replica, "
                            "followed by its own events)", replica.name, len(sources), len(sources))
            return None
        if isinstance(rank0, dict) and rank0.get("enable_kv_cache_events") and rank0.get("publisher") == "zmq":
            endpoint = _on_host(rank0.get("endpoint"), host)
            if endpoint:
                return endpoint, _on_host(rank0.get("replay_endpoint"), host)
    events = gw.config.kv_events
    if sources is None and events.port:  # no /kv_event_sources (vLLM before 0.32): the configured ports
        replay = f"tcp://{host}:{events.replay_port}" if events.replay_port else None
        rank = replica.rank or 0
        return _offset(f"tcp://{host}:{events.port}", rank), _offset(replay, rank)
    return None


def _seeder(replica: ReplicaState):
    def seed(lora_name: str | None, cache_salt: str | None) -> BlockHash:
        # the gateway seeds a prompt by the model name the request gives (analysis.analyze): the
        # adapter's name for a LoRA request, else the replica's first served name
        return seed_hash(lora_name or (replica.models[0] if replica.models else ""), cache_salt)
    return seed


async def follow_events(gw: Gateway) -> None:
    """Start and stop one event stream per replica, forever (cancel to stop them all)."""
    tasks: dict[str, asyncio.Task] = {}
    asked: dict[str, float] = {}
    try:
        while True:
            now = time.monotonic()
            for name in [n for n in tasks if n not in gw.replicas or tasks[n].done()]:
                task = tasks.pop(name)  # dropped by discovery, or its stream failed (logged): try again
                task.cancel()
                replica = gw.replicas.get(name)
                if replica is not None and replica.stream is not None and replica.stream.stopped:
                    replica.stream.view.close()
                    replica.stream = None
            for name in [n for n in asked if n not in gw.replicas]:
                del asked[name]
            for replica in list(gw.replicas.values()):
                if replica.name in tasks or not replica.models or now - asked.get(replica.name, -1e9) < RETRY_SOURCES_S:
                    continue
                asked[replica.name] = now
                try:
                    found = await event_endpoints(gw, replica)
                except Exception:  # noqa: BLE001 - a replica's odd answer must not stop the others' streams
                    log.exception("replica %s: reading its KV event sources failed", replica.name)
                    continue
                if found is None:
                    continue
                endpoint, replay = found
                capacity = replica.num_gpu_blocks or replica.shadow.capacity
                if replica.stream is not None:  # a stream whose task ended without stopping: its view goes too
                    replica.stream.view.close()
                # ghosts: the last two caches' worth of removals (the miss accounting's "evicted", and
                # a request's blocks evicted while it waited, unless the whole cache turned over twice)
                view = EngineView(replica.block_size or gw.block_size, _seeder(replica), max_blocks=2 * capacity + 1024,
                                  max_ghosts=2 * capacity, holders=gw.engine_holders)
                replica.stream = EventStream(
                    replica.name, endpoint, replay, view, topic=gw.config.kv_events.topic,
                    rebuild_blocks=lambda r=replica: r.num_gpu_blocks or r.shadow.capacity,
                    replay_timeout_s=gw.config.kv_events.replay_timeout_s)
                tasks[replica.name] = asyncio.create_task(replica.stream.run())
                for result in ("match", "mismatch"):  # every series from the start, at 0
                    gw.metrics.kv_parity.labels(replica.name, result)
                for outcome in ("repaired", "lost"):
                    gw.metrics.kv_gaps.labels(replica.name, outcome)
                gw.metrics.kv_events.labels(replica.name)
                log.info("replica %s: following its KV events at %s (replay %s)", replica.name, endpoint,
                         replay or "none")
            gw.export_event_metrics()
            await asyncio.sleep(gw.config.scrape.interval_s)
    finally:
        for task in tasks.values():
            task.cancel()
        for task in tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task


def parity_hint(view: EngineView, hashes: Sequence[BlockHash]) -> str:
    """The likeliest reason the engine stored other blocks than the gateway hashed."""
    if view.foreign_block_size:
        return "the engine's block size differs from the gateway's (set replicas[].block_size, or let it be scraped)"
    if not view.held_lately(hashes[0]):
        return ("the prompt's first block differs: the model name or LoRA adapter (the first served name seeds "
                "it), the cache salt, or the tokenizer")
    depth = view.match(hashes)
    return f"the prompt diverges from the engine's at block {depth}: the tokenizer or the chat template"


def check_parity(gw: Gateway, replica: ReplicaState, hashes: Sequence[BlockHash], sent_at: float) -> None:
    """After a request to ``replica`` ended: count whether the events showed its prompt's last
    full block (now, or after ``parity_grace_s``). ``sent_at``: monotonic time it was sent."""
    stream = replica.stream
    if stream is None or not stream.fresh or not hashes:
        return
    if stream.view.held_lately(hashes[-1]):
        replica.parity_ok += 1
        gw.metrics.kv_parity.labels(replica.name, "match").inc()
        return
    task = asyncio.get_running_loop().create_task(_recheck(gw, replica, stream, list(hashes), sent_at))
    _rechecks.add(task)
    task.add_done_callback(_rechecks.discard)


_rechecks: set[asyncio.Task] = set()  # pending parity rechecks (a task needs a reference)


async def _recheck(gw: Gateway, replica: ReplicaState, stream: EventStream, hashes: list[BlockHash],
                   sent_at: float) -> None:
    await asyncio.sleep(gw.config.kv_events.parity_grace_s)
    if (stream.last_event_at is None or stream.last_event_at < sent_at) and stream.fresh:
        # nothing arrived since the request was sent: a message lost that no later one revealed
        # (a subscriber joining late, the engine's last step before it went idle); ask for it
        await stream.catch_up()
    if replica.stream is not stream or not stream.fresh:
        return  # the view was rebuilt meanwhile: says nothing
    if stream.view.held_lately(hashes[-1]):
        replica.parity_ok += 1
        gw.metrics.kv_parity.labels(replica.name, "match").inc()
        return
    if stream.last_event_at is None or stream.last_event_at < sent_at:
        # still nothing since the request was sent: the events stopped, not the hashes that differ
        stream.mark_stale("no KV events arrived for a request the engine served")
        return
    replica.parity_mismatch += 1
    gw.metrics.kv_parity.labels(replica.name, "mismatch").inc()
    hint = parity_hint(stream.view, hashes)
    if hint != replica.parity_hint:  # once per cause, not once per request
        log.warning("replica %s: the engine did not store the blocks the gateway hashed for a prompt it served; "
                    "the gateway's picture of its cache is wrong. Likely cause: %s", replica.name, hint)
    replica.parity_hint = hint
