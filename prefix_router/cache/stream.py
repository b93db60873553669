"""Following one replica's KV event stream: subscribe, spot gaps, repair them by replay.

``EventStream.run`` connects a SUB socket to the replica's publisher and applies every batch to
its ``EngineView`` in sequence order (``prefix_router/cache/events.py`` has the wire format):

- the first message of a stream that started earlier (seq > 0), and any later jump past the
  next number, is a gap: the missing batches are asked of the publisher's replay socket (a
  DEALER sends ``(empty, start seq)``; ``ZmqEventPublisher._service_replay``) and applied first;
- a number at or below the last one seen comes from a new engine process (vLLM counts from 0
  in each): the view is cleared, and what the new process published before is replayed;
- a gap the replay cannot fill (no replay socket, no answer within ``replay_timeout_s``, an
  answer over REPLAY_MAX_BYTES, or the publisher's buffer no longer reaches back; a message over
  MAX_MESSAGE_BYTES is one) clears the view and marks it stale: the gateway
  then routes this replica by its own guess (the shadow index) until the engine has stored as
  many new blocks as it can hold (``rebuild_blocks``), by when what the view missed has been
  evicted or stored again. A prefix held since before the gap and never freed stays unknown
  to the view; the engine's ``cached_tokens`` on the next request shows it (``parity``).

One stream per replica and gateway process, sharing nothing: every gateway instance that
subscribes to every replica builds the same picture. Messages waiting unread apply as one stretch.

ZMQ authenticates nobody: whoever reaches the publisher's ports, or binds them, can wipe or steer
this replica's view (its routing), never another replica's, never a request's content. What it
cannot do is take the gateway's memory or its event loop: the constants below bound both, per
stream, and ``tests/cache/test_stream_hostile.py`` measures them against such a publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

import xxhash
import zmq
import zmq.asyncio
from zmq.utils import monitor as zmq_monitor

from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.events import END_SEQ, decode_events, to_event
from prefix_router.cache.intake import runs

__all__ = ["EventStream", "REBUILD_BLOCKS"]

# What any publisher can make a stream hold or do: a message of at most MAX_MESSAGE_BYTES, decoded
# typed (cache/events.py) into a bounded multiple of that, applied SLICE_BLOCKS at a time; at most
# LIVE_QUEUE messages queued; a replay of at most REPLAY_MAX_BYTES; sequence numbers below MAX_SEQ.
MAX_MESSAGE_BYTES = 4 << 20
"""Bytes in one message (ZMQ's MAXMSGSIZE, on the SUB and the replay DEALER: a larger message
drops the connection, and is lost like any gap). The largest batch one vLLM engine step
publishes, a 128K-token prompt stored in one step with LoRA, salt and an image on every block,
is 2.24 MiB; an 8,192-token step 0.1-0.64 MiB (``bench/results/kv-event-sizes/README.md``, from
vLLM's own event classes and encoder: ``python -m bench kv-event-sizes``)."""
LIVE_QUEUE = 8
"""Messages the SUB socket queues unread (RCVHWM; ZMQ's default, 1,000, is 4 GB at the cap). A
full queue stops ZMQ reading the connection, so the publisher queues the rest (vLLM's PUB holds
``hwm``, 100,000 batches) and nothing is lost."""
REPLAY_MAX_BYTES = 64 << 20
"""Bytes read from one replay answer, counting REPLAY_MESSAGE_BYTES more for each message: past
it the stream stops reading and the gap is lost (what ZMQ queued meanwhile goes with the socket).
The publisher buffers 10,000 batches (``buffer_steps``); 64 MiB is ~650 of its 8,192-token
prefill steps, or the whole buffer at 6.7 KB a batch."""
REPLAY_MESSAGE_BYTES = 256  # what a message kept costs beyond its bytes (tuple, int, bytes object)
SLICE_S = 0.005  # a stream's run between yields to the event loop (a ready socket never yields by itself)
SLICE_BLOCKS = 2048  # blocks the view stores or removes in one step: a few ms, so the loop stays responsive
MAX_SEQ = 1 << 63  # vLLM counts from 0 (``itertools.count``); -1, read unsigned 2**64 - 1, ends a replay
RESUBSCRIBE_WAIT_S = 1.0  # after a dropped connection: a publisher that drops it on purpose costs a replay a second
CONNECT_WAIT_S = 5.0  # a publisher not connected by then: catch up anyway (the live stream repairs later)
SUBSCRIBE_WAIT_S = 0.05  # after CONNECTED, for the subscription to reach the publisher (a loopback round trip)
BATCH_BYTES = 256 << 10
"""Bytes of messages, read as they wait and applied as one stretch of events (``_apply``): a busy
engine publishes a message a step, mostly of a few one-block events, and the view's cost is mostly
per call (``bench/results/kv-intake/``). Bounds what one read holds beside one message at the cap."""
BATCH_MESSAGES = 256  # and messages: a flood of empty ones is read a bounded stretch at a time
SEEN_BATCHES = 1024  # digests kept to tell a batch delivered twice from a restarted engine's
REBUILD_BLOCKS = 28_000  # when the replica's capacity is unknown: prefix_router/tools/sim/config.py's H100 replica

_NO_ANSWER = "the replay socket did not answer"

log = logging.getLogger(__name__)


def _dropped(event: list[bytes]) -> bool:
    """Whether a socket monitor's message says the connection dropped."""
    return zmq_monitor.parse_monitor_message(event)["event"] == zmq.EVENT_DISCONNECTED


class EventStream:
    """One replica's event stream into ``view``.

    ``endpoint`` / ``replay_endpoint``: ZMQ addresses (``tcp://host:5557``); ``rebuild_blocks``:
    a callable giving the replica's capacity in blocks (read at each gap: ``num_gpu_blocks``).
    Counters for ``/replicas`` and the metrics: ``batches``, ``events``, ``gaps_repaired``,
    ``gaps_lost``, ``restarts``, ``undecodable`` (messages, events and sequence numbers no engine
    sends); ``stale`` with ``stale_reason``.
    """

    def __init__(self, name: str, endpoint: str, replay_endpoint: str | None, view: EngineView, *,
                 topic: str = "", rebuild_blocks: Callable[[], int] = lambda: REBUILD_BLOCKS,
                 replay_timeout_s: float = 2.0, context: zmq.asyncio.Context | None = None) -> None:
        self.name = name
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.view = view
        self.topic = topic
        self.rebuild_blocks, self.replay_timeout_s = rebuild_blocks, replay_timeout_s
        self._context = context or zmq.asyncio.Context.instance()
        self.last_seq: int | None = None
        self.last_event_at: float | None = None  # monotonic seconds of the last batch applied
        self.batches = self.events = 0
        self.gaps_repaired = self.gaps_lost = self.restarts = self.undecodable = 0
        self.stale, self.stale_reason = False, ""
        self._rebuild_left = 0  # blocks the engine must store before a stale view is trusted again
        self._lock = asyncio.Lock()  # one of receive and catch_up at a time: batches apply in order
        self._seen: OrderedDict[int, int] = OrderedDict()  # seq -> payload digest, the last SEEN_BATCHES
        self.stopped = False  # run() ended (an error): the view is no longer followed
        self._catching_up: asyncio.Future | None = None  # the catch_up running, which others join
        self._ran_since = 0.0  # perf_counter seconds of the last yield to the event loop
        self._epoch = 0  # counts the view's forgettings (reset, marked stale) that a batch being applied must see

    @property
    def fresh(self) -> bool:
        """Whether the view may be routed by: a stream heard from, with no lost gap, and still
        followed (``run`` not ended by an error)."""
        return self.last_seq is not None and not self.stale and not self.stopped

    def reset(self) -> None:
        """A new engine process (seen by other means: its metrics went back): forget the
        sequence too, so that its batches are replayed from its first."""
        self.view.clear()
        self._epoch += 1
        self.last_seq = None
        self._seen.clear()
        self.stale, self.stale_reason = False, ""

    async def run(self) -> None:
        """Follow the stream forever (cancel to stop). A publisher that sends what ZMQ refuses
        (a message over MAX_MESSAGE_BYTES, a malformed frame) loses its connection, which ZMQ
        does not reconnect: the stream subscribes anew after RESUBSCRIBE_WAIT_S."""
        try:
            while True:
                await self._subscribed()
                await asyncio.sleep(RESUBSCRIBE_WAIT_S)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("replica %s: following its KV events failed; routing it by the gateway's guess", self.name)
            raise
        finally:
            self.stopped = True

    async def _subscribed(self) -> None:
        """One subscription, until its connection drops."""
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.RCVHWM, LIVE_QUEUE)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            # wait until the publisher can have the subscription (CONNECTED, then a moment for
            # the subscription message), at most CONNECT_WAIT_S
            sub.connect(self.endpoint)
            if await monitor.poll(CONNECT_WAIT_S * 1000) and _dropped(await monitor.recv_multipart()):
                return
            await asyncio.sleep(SUBSCRIBE_WAIT_S)
            # what the engine published before this gateway subscribed (an idle engine may
            # publish nothing more for a long time): its buffer, or an empty stream. Only once
            # the subscription is in place: a batch published before it would be lost with
            # nothing after it to reveal the gap, while the view said it knew the cache.
            with contextlib.suppress(zmq.ZMQError):
                await self.catch_up()
            while True:
                ready = dict(await poller.poll())
                if monitor in ready and _dropped(await monitor.recv_multipart()):
                    log.info("replica %s: its KV event publisher's connection dropped; subscribing again", self.name)
                    return
                if sub in ready:
                    await self.receive_all(await self._waiting(sub))
        finally:
            sub.disable_monitor()
            monitor.close()
            sub.close()

    async def _waiting(self, sub: zmq.asyncio.Socket) -> list[tuple[int, bytes]]:
        """The messages ``sub`` has ready, as (seq, payload): at least one, then what waits
        unread, up to BATCH_BYTES or BATCH_MESSAGES. Malformed ones count as undecodable."""
        read = [await sub.recv_multipart()]
        taken = sum(map(len, read[0]))
        with contextlib.suppress(zmq.Again):
            while taken < BATCH_BYTES and len(read) < BATCH_MESSAGES:
                read.append(await sub.recv_multipart(flags=zmq.NOBLOCK))
                taken += sum(map(len, read[-1]))
        messages = [(int.from_bytes(f[1], "big"), f[2]) for f in read if len(f) == 3 and len(f[1]) == 8]
        self.undecodable += len(read) - len(messages)
        return messages

    async def _yield(self) -> None:
        """Let the event loop run if this stream has run for SLICE_S since it last did."""
        if time.perf_counter() - self._ran_since >= SLICE_S:
            await asyncio.sleep(0)
            self._ran_since = time.perf_counter()

    async def receive(self, seq: int, payload: bytes) -> None:
        """Apply one message from the live stream, after any batches it shows are missing."""
        await self.receive_all([(seq, payload)])

    async def receive_all(self, messages: list[tuple[int, bytes]]) -> None:
        """Apply (seq, payload) messages from the live stream in order, each after any batches it
        shows are missing; a number vLLM never sends (below 0, from 2**63) counts as undecodable."""
        async with self._lock:
            following: list[tuple[int, bytes | memoryview]] = []
            for seq, payload in messages:
                if not 0 <= seq < MAX_SEQ:
                    self.undecodable += 1
                    continue
                last = following[-1][0] if following else self.last_seq
                if last is None or seq != last + 1:
                    await self._apply(following)
                    following = []
                    if not await self._receive(seq, payload):
                        continue
                following.append((seq, payload))
            await self._apply(following)

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
            replayed, short = await self._replay(start, MAX_SEQ)
            if short == _NO_ANSWER:
                return 0  # the live stream repairs what this missed
            if short is not None:
                self._lose(f"batches from {start} missed, and {short}")
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
            following: list[tuple[int, memoryview]] = []
            for seq, payload in replayed:
                last = following[-1][0] if following else self.last_seq
                if last is not None and last >= 0 and seq != last + 1:
                    await self._apply(following)
                    following = []
                    self._lose(f"the replay skipped batches {last + 1}-{seq - 1}")
                following.append((seq, payload))
            await self._apply(following)
            return len(replayed)

    async def _receive(self, seq: int, payload: bytes) -> bool:
        """Ready the view for a message that does not follow the last one: a batch applied
        already (False), a restarted engine, or a gap to repair first (True)."""
        last = self.last_seq if self.last_seq != -1 else None
        if last is not None and seq <= last and self._seen.get(seq) == xxhash.xxh3_64_intdigest(payload):
            return False  # delivered live after a catch-up had replayed it: applied already
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
        return True

    async def _repair(self, start: int, until: int) -> None:
        if self.replay_endpoint is None:
            replayed, short = [], "no replay socket is configured"
        else:
            replayed, short = await self._replay(start, until)
        if short is None and len(replayed) == until - start:  # increasing, in [start, until): every one
            await self._apply(replayed)
            self.gaps_repaired += start > 0  # joining a running stream is no gap
            return
        self._lose(f"batches {start}-{until - 1} missed, and {short or 'the publisher no longer buffers them'}")

    def _lose(self, reason: str) -> None:
        self.gaps_lost += 1
        self.mark_stale(reason)

    def mark_stale(self, reason: str) -> None:
        """Stop routing by the view until it is rebuilt (``rebuild_blocks`` stored from empty)."""
        self.view.clear()
        self._epoch += 1
        self.stale, self.stale_reason = True, reason
        self._rebuild_left = max(self.rebuild_blocks(), 1)
        log.warning("replica %s: KV events %s; routing it by the gateway's own guess until the view is "
                    "rebuilt (%d blocks stored)", self.name, reason, self._rebuild_left)

    async def _replay(self, start: int, until: int) -> tuple[list[tuple[int, memoryview]], str | None]:
        """Batches ``start .. until - 1`` from the replay socket, in order, and None; or those
        read and why it stopped short: no end marker within ``replay_timeout_s`` (_NO_ANSWER), or
        more than REPLAY_MAX_BYTES. vLLM sends each batch once, in order: a sequence number at or
        below the last one kept, or out of the range, is dropped."""
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        # vLLM's ROUTER sends the whole buffer at once; a bounded receive queue would drop part
        # of it silently (measured: 3,500 of 10,000 batches with the default high-water mark)
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        out: list[tuple[int, memoryview]] = []
        read = 0
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await dealer.poll(left * 1000):
                    return out, _NO_ANSWER
                # uncopied, the reading keeps pace with what ZMQ queues unasked: a 400 MB answer
                # raised RSS by ~68 MB, the budget's and little more (copied: 120-140 MB)
                frames = [f.buffer for f in await dealer.recv_multipart(copy=False)]
                size = sum(map(len, frames)) + REPLAY_MESSAGE_BYTES
                read += size
                if read > REPLAY_MAX_BYTES:
                    return out, f"the replay answered more than {REPLAY_MAX_BYTES:,} bytes"
                await self._yield()
                if len(frames) != 4 or len(frames[2]) != 8:  # (empty, topic, seq, payload)
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return out, None
                if start <= seq < until and (not out or seq > out[-1][0]):
                    out.append((seq, frames[3]))
        finally:
            dealer.close()

    def _steps(self, raw_events: list) -> Iterator[int]:
        """Apply a batch's wire events to the view, one step (a run of events of one kind, or a
        slice of one long event; ``cache/intake.py``) at a time."""
        events = []
        for i, raw in enumerate(raw_events):
            try:
                event = to_event(raw)
            except Exception:  # noqa: BLE001 - whatever a publisher sends must not stop the stream
                self.undecodable += 1
                continue
            if event is not None:
                events.append(event)
            if i % 1024 == 1023:
                yield 0
        self.events += len(events)
        for run in runs(events, SLICE_BLOCKS):
            bad = self.view.bad_events
            try:
                yield from self.view.apply_run(run, SLICE_BLOCKS)
            except Exception:  # noqa: BLE001 - whatever a publisher sends must not stop the stream
                self.undecodable += 1
            self.undecodable += self.view.bad_events - bad
            yield 1

    async def _apply(self, messages: list[tuple[int, bytes | memoryview]]) -> None:
        """Apply messages whose numbers follow on one another, in groups of up to BATCH_BYTES (one
        larger alone), a group's events as one stretch (``_steps``): the view's calls paid once."""
        group: list[tuple[int, bytes | memoryview]] = []
        for seq, payload in messages:
            if group and sum(len(p) for _, p in group) + len(payload) > BATCH_BYTES:
                await self._apply_group(group)
                group = []
            group.append((seq, payload))
        if group:
            await self._apply_group(group)

    async def _apply_group(self, group: list[tuple[int, bytes | memoryview]]) -> None:
        await self._yield()  # before its decoding, one call
        raw_events, decoded = [], 0
        for seq, payload in group:
            self.last_seq = seq
            self._seen[seq] = xxhash.xxh3_64_intdigest(payload)
            if len(self._seen) > SEEN_BATCHES:
                self._seen.popitem(last=False)
            try:
                raw_events += decode_events(payload)[1]
                decoded += 1
            except ValueError:
                self.undecodable += 1
        if not decoded:
            return
        stored_before, epoch = self.view.stored, self._epoch
        await self._yield()
        for _ in self._steps(raw_events):
            await self._yield()  # requests go between the steps of a long batch or replay
            if self._epoch != epoch:
                return  # the view was forgotten meanwhile (reset, marked stale): so is the rest
        self.batches += decoded
        self.last_event_at = time.monotonic()
        if self.view.overflowed:  # what these batches stored is no rebuilding
            self.mark_stale(f"the events describe more blocks than the replica holds ({self.view.max_blocks})")
        elif self.stale and self._rebuild_left > 0:
            self._rebuild_left -= self.view.stored - stored_before
            if self._rebuild_left <= 0:
                self.stale, self.stale_reason = False, ""
                log.info("replica %s: KV event view rebuilt; routing by it again", self.name)
