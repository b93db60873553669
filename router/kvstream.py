"""Following one replica's KV event stream: subscribe, spot gaps, repair them by replay.

``EventStream.run`` connects a SUB socket to the replica's publisher and applies every batch to
its ``EngineView`` in sequence order (``router/kvevents.py`` has the wire format):

- the first message of a stream that started earlier (seq > 0), and any later jump past the
  next number, is a gap: the missing batches are asked of the publisher's replay socket (a
  DEALER sends ``(empty, start seq)``; ``ZmqEventPublisher._service_replay``) and applied first;
- a number at or below the last one seen comes from a new engine process (vLLM counts from 0
  in each): the view is cleared, and what the new process published before is replayed;
- a gap the replay cannot fill (no replay socket, no answer within ``replay_timeout_s``, or the
  publisher's buffer no longer reaches back) clears the view and marks it stale: the gateway
  then routes this replica by its own guess (the shadow index) until the engine has stored as
  many new blocks as it can hold (``rebuild_blocks``), by when what the view missed has been
  evicted or stored again. A prefix held since before the gap and never freed stays unknown
  to the view; the engine's ``cached_tokens`` on the next request shows it (``parity``).

One stream per replica and gateway process; they share nothing, so every gateway instance that
subscribes to every replica builds the same picture.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import xxhash
import zmq
import zmq.asyncio

from .kvevents import END_SEQ, EngineView, decode_batch

__all__ = ["EventStream", "REBUILD_BLOCKS"]

MAX_MESSAGE_BYTES = 64 << 20  # one batch larger than this is not an engine's (a 128K-token prompt is ~1 MB)
YIELD_EVERY = 64  # batches applied between yields to the event loop during a replay
CONNECT_WAIT_S = 5.0  # a publisher not connected by then: catch up anyway (the live stream repairs later)
SUBSCRIBE_WAIT_S = 0.05  # after CONNECTED, for the subscription to reach the publisher (a loopback round trip)
SEEN_BATCHES = 1024  # digests kept to tell a batch delivered twice from a restarted engine's
REBUILD_BLOCKS = 28_000  # when the replica's capacity is unknown: router/tools/sim/config.py's H100 replica

log = logging.getLogger(__name__)


class EventStream:
    """One replica's event stream into ``view``.

    ``endpoint`` / ``replay_endpoint``: ZMQ addresses (``tcp://host:5557``); ``rebuild_blocks``:
    a callable giving the replica's capacity in blocks (read at each gap: ``num_gpu_blocks``).
    Counters for ``/replicas`` and the metrics: ``batches``, ``events``, ``gaps_repaired``,
    ``gaps_lost``, ``restarts``, ``undecodable``; ``stale`` with ``stale_reason``.
    """

    def __init__(self, name: str, endpoint: str, replay_endpoint: str | None, view: EngineView, *,
                 topic: str = "", rebuild_blocks: Callable[[], int] = lambda: REBUILD_BLOCKS,
                 replay_timeout_s: float = 2.0, context: zmq.asyncio.Context | None = None) -> None:
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.view = view
        self.topic = topic
        self.rebuild_blocks = rebuild_blocks
        self.replay_timeout_s = replay_timeout_s
        self._context = context or zmq.asyncio.Context.instance()
        self.last_seq: int | None = None
        self.last_event_at: float | None = None  # monotonic seconds of the last batch applied
        self.batches = self.events = 0
        self.gaps_repaired = self.gaps_lost = self.restarts = self.undecodable = 0
        self.stale = False
        self.stale_reason = ""
        self._rebuild_left = 0  # blocks the engine must store before a stale view is trusted again
        self._lock = asyncio.Lock()  # one of receive and catch_up at a time: batches apply in order
        self._seen: OrderedDict[int, int] = OrderedDict()  # seq -> payload digest, the last SEEN_BATCHES
        self.stopped = False  # run() ended (an error): the view is no longer followed
        self._catching_up: asyncio.Future | None = None  # the catch_up running, which others join

    @property
    def fresh(self) -> bool:
        """Whether the view may be routed by: a stream heard from, with no lost gap, and still
        followed (``run`` not ended by an error)."""
        return self.last_seq is not None and not self.stale and not self.stopped

    def reset(self) -> None:
        """A new engine process (seen by other means: its metrics went back): forget the
        sequence too, so that its batches are replayed from its first."""
        self.view.clear()
        self.last_seq = None
        self._seen.clear()
        self.stale, self.stale_reason = False, ""

    async def run(self) -> None:
        """Follow the stream forever (cancel to stop)."""
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            await self._connected(sub)
            # what the engine published before this gateway subscribed (an idle engine may
            # publish nothing more for a long time): its buffer, or an empty stream. Only once
            # the subscription is in place: a batch published before it would be lost with
            # nothing after it to reveal the gap, while the view said it knew the cache.
            with contextlib.suppress(zmq.ZMQError):
                await self.catch_up()
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.undecodable += 1
                    continue
                await self.receive(int.from_bytes(frames[1], "big"), frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("replica %s: following its KV events failed; routing it by the gateway's guess", self.name)
            raise
        finally:
            self.stopped = True
            sub.close()

    async def _connected(self, sub) -> None:
        """Connect ``sub`` and wait until the publisher can have its subscription (ZMQ's
        CONNECTED event, then a moment for the subscription message), at most CONNECT_WAIT_S."""
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        try:
            sub.connect(self.endpoint)
            if await monitor.poll(CONNECT_WAIT_S * 1000):
                await monitor.recv_multipart()
            await asyncio.sleep(SUBSCRIBE_WAIT_S)
        finally:
            sub.disable_monitor()
            monitor.close()

    async def receive(self, seq: int, payload: bytes) -> None:
        """Apply one message from the live stream, after any batches it shows are missing."""
        async with self._lock:
            await self._receive(seq, payload)

    async def catch_up(self) -> int:
        """Ask the replay socket for every batch after the last one seen: a message lost on the
        way that no later one has revealed yet (a SUB socket joining late, or the engine's last
        step before going idle). Returns the batches applied. Calls made while one runs wait for
        it rather than asking again (every parity recheck may call this)."""
        if not self.replay_endpoint:
            return 0
        running = self._catching_up
        if running is not None and not running.done():
            return await asyncio.shield(running)
        self._catching_up = asyncio.ensure_future(self._catch_up())
        return await asyncio.shield(self._catching_up)

    async def _catch_up(self) -> int:
        async with self._lock:
            start = 0 if self.last_seq is None else self.last_seq + 1
            replayed = await self._replay(start, 1 << 63)
            if replayed is None:
                return 0
            if not replayed:
                if self.last_seq is None:
                    self.last_seq = -1  # the engine has published nothing: its cache is empty, and so is the view
                return 0
            if replayed[0][0] != start:
                reason = f"batches {start}-{replayed[0][0] - 1} missed, and the publisher no longer buffers them"
                if self.last_seq is None:  # joining a long-running engine: not a gap, but the view is partial
                    self.mark_stale(reason)
                else:
                    self._lose(reason)
            applied = 0
            for seq, payload in replayed:
                if self.last_seq is not None and self.last_seq >= 0 and seq != self.last_seq + 1:
                    self._lose(f"the replay skipped batches {self.last_seq + 1}-{seq - 1}")
                self._apply(seq, payload)
                applied += 1
                if applied % YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # a long replay must not hold up requests
            return applied

    async def _receive(self, seq: int, payload: bytes) -> None:
        last = self.last_seq if self.last_seq != -1 else None
        if last is not None and seq <= last and self._seen.get(seq) == xxhash.xxh3_64_intdigest(payload):
            return  # delivered live after a catch-up had replayed it: applied already
        if last is not None and seq <= last:
            self.restarts += 1
            log.info("replica %s: KV event sequence went back from %d to %d (engine restarted); "
                     "clearing its view", self.name, last, seq)
            self.view.clear()
            self.last_seq = last = None
            self.stale, self.stale_reason = False, ""
        start = 0 if last is None else last + 1
        if seq > start:
            await self._repair(start, seq)
        self._apply(seq, payload)

    async def _repair(self, start: int, until: int) -> None:
        replayed = await self._replay(start, until) if self.replay_endpoint else None
        if (replayed is not None and len(replayed) == until - start
                and all(seq == start + i for i, (seq, _) in enumerate(replayed))):
            for i, (seq, payload) in enumerate(replayed):
                self._apply(seq, payload)
                if (i + 1) % YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # a long replay must not hold up requests
            self.gaps_repaired += start > 0  # joining a running stream is no gap
            return
        if self.replay_endpoint is None:
            reason = f"batches {start}-{until - 1} missed, and no replay socket is configured"
        elif replayed is None:
            reason = f"batches {start}-{until - 1} missed, and the replay socket did not answer"
        else:
            reason = f"batches {start}-{until - 1} missed, and the publisher no longer buffers them"
        self._lose(reason)

    def _lose(self, reason: str) -> None:
        self.gaps_lost += 1
        self.mark_stale(reason)

    def mark_stale(self, reason: str) -> None:
        """Stop routing by the view until it is rebuilt (``rebuild_blocks`` stored from empty)."""
        self.view.clear()
        self.stale, self.stale_reason = True, reason
        self._rebuild_left = max(self.rebuild_blocks(), 1)
        log.warning("replica %s: KV events %s; routing it by the gateway's own guess until the view is "
                    "rebuilt (%d blocks stored)", self.name, reason, self._rebuild_left)

    async def _replay(self, start: int, until: int) -> list[tuple[int, bytes]] | None:
        """Batches ``start .. until - 1`` from the replay socket, in order; None on no answer."""
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        # vLLM's ROUTER sends the whole buffer at once; a bounded receive queue would drop part
        # of it silently (measured: 3,500 of 10,000 batches with the default high-water mark)
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await dealer.poll(left * 1000):
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:  # (empty, topic, seq, payload)
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return out
                if seq < 0:
                    continue
                if start <= seq < until:
                    out.append((seq, frames[3]))
        finally:
            dealer.close()

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self._seen[seq] = xxhash.xxh3_64_intdigest(payload)
        if len(self._seen) > SEEN_BATCHES:
            self._seen.popitem(last=False)
        try:
            batch = decode_batch(payload)
        except ValueError:
            self.undecodable += 1
            return
        stored_before = self.view.stored
        for event in batch.events:
            try:
                self.view.apply(event)
            except Exception:  # noqa: BLE001 - whatever a publisher sends must not stop the stream
                self.undecodable += 1
        self.batches += 1
        self.events += len(batch.events)
        if self.view.overflowed:
            self.mark_stale(f"the events describe more blocks than the replica holds ({self.view.max_blocks})")
        self.last_event_at = time.monotonic()
        if self.stale and self._rebuild_left > 0:
            self._rebuild_left -= self.view.stored - stored_before
            if self._rebuild_left <= 0:
                self.stale, self.stale_reason = False, ""
                log.info("replica %s: KV event view rebuilt; routing by it again", self.name)
