"""Following a replica's KV event stream (prefix_router/cache/stream.py) over real ZMQ sockets.

``Engine`` below is a publisher written for this test from the wire format the module docstrings
describe (vLLM 0.32's ``ZmqEventPublisher``): a PUB socket sends ``(topic, seq, payload)``,
``seq`` 8 bytes big-endian from 0 per engine process, ``payload`` a msgpack ``[ts, events, rank]``
with map-encoded events; a ROUTER socket answers ``(empty, start seq)`` with every buffered batch
from there, ``(empty, topic, seq, payload)``, then an end marker whose seq is -1. The test decides
which batches go out live, so it can lose some on the way, restart the engine, or forget them.
Its live socket is an XPUB, a PUB that also hears each subscription arrive, so that a test never
publishes before the subscriber can receive (a PUB drops what it sends before then).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from prefix_router.cache.blocks import block_hashes, seed_hash
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.stream import MAX_SEQ, EventStream

from ..helpers import until

BS = 4  # tokens per block
MODEL = "tiny"
END = (-1).to_bytes(8, "big", signed=True)


def seed(lora: str | None, salt: str | None) -> int:
    return seed_hash(lora or MODEL, salt)


class Engine:
    """A KV event publisher on loopback: (X)PUB for the live stream, ROUTER for replays.

    Every batch is one prompt of one block of its own (``block(i)``), so a test can ask of any
    batch whether the view holds it."""

    def __init__(self) -> None:
        context = zmq.asyncio.Context.instance()
        self.pub = context.socket(zmq.XPUB)
        self.router = context.socket(zmq.ROUTER)
        for socket in (self.pub, self.router):
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind("tcp://127.0.0.1:*")
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []  # what a replay answers from
        self.replays = 0  # replay requests answered
        self._task = asyncio.create_task(self._serve_replay())

    @property
    def endpoint(self) -> str:
        return self.pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str:
        return self.router.getsockopt_string(zmq.LAST_ENDPOINT)

    @staticmethod
    def tokens(i: int) -> list[int]:
        return [1000 + BS * i + k for k in range(BS)]

    @classmethod
    def block(cls, i: int) -> int:
        """The gateway's hash of batch ``i``'s block."""
        return block_hashes(cls.tokens(i), BS, seed(None, None))[0]

    @classmethod
    def payload(cls, i: int, removed: int | None = None) -> bytes:
        """A batch storing block ``i`` (engine hash 5000 + i); and removing block ``removed``."""
        events = [{"type": "BlockStored", "block_hashes": [5000 + i], "parent_block_hash": None,
                   "token_ids": cls.tokens(i), "block_size": BS, "lora_id": None, "medium": "GPU",
                   "lora_name": None}]
        if removed is not None:
            events.append({"type": "BlockRemoved", "block_hashes": [5000 + removed], "medium": "GPU"})
        return msgspec.msgpack.encode([time.time(), events, 0])

    def publish(self, i: int, *, live: bool = True, removed: int | None = None) -> int:
        """Batch ``i`` under the next sequence number; ``live`` False: lost on the way to the
        subscriber (still in the replay buffer). Returns its sequence number."""
        seq, self.seq = self.seq, self.seq + 1
        payload = self.payload(i, removed)
        self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
        return seq

    async def subscribed(self) -> None:
        """Wait until a subscriber's subscription has arrived (what a PUB sends from then on reaches it)."""
        await asyncio.wait_for(self.pub.recv(), 5.0)

    def restart(self) -> None:
        """A new engine process: it counts from 0 and buffers only what it published."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replays += 1
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    await self.router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
            await self.router.send_multipart((client, b"", b"", END, b""))

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.router.close()
        self.pub.close()


@pytest.fixture
async def engine():
    engine = Engine()
    yield engine
    await engine.close()


@pytest.fixture
async def follow():
    """``await follow(engine, **EventStream options)``: a stream of ``engine`` running, subscribed
    and caught up with what the engine published before."""
    tasks = []

    async def start(engine: Engine, **options) -> EventStream:
        stream = EventStream("replica-0", engine.endpoint, engine.replay_endpoint, EngineView(BS, seed), **options)
        tasks.append(asyncio.create_task(stream.run()))
        await engine.subscribed()
        await until(lambda: stream.fresh or stream.stale)
        return stream

    yield start
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def live(engine: Engine, stream: EventStream, i: int, **kw) -> None:
    """Publish batch ``i`` live and wait until the stream applied it."""
    seq = engine.publish(i, **kw)
    await until(lambda: stream.last_seq == seq)


def holds(stream: EventStream, *batches: int) -> list[int]:
    """Which of ``batches``' blocks the view holds."""
    return [i for i in batches if stream.view.match([Engine.block(i)]) == 1]


async def test_stored_and_removed_blocks_on_the_live_stream_reach_the_view(engine, follow):
    stream = await follow(engine)
    for i in range(3):
        await live(engine, stream, i)
    assert holds(stream, 0, 1, 2) == [0, 1, 2]
    await live(engine, stream, 3, removed=1)
    assert holds(stream, 0, 1, 2, 3) == [0, 2, 3]
    assert stream.fresh and stream.batches == 4 and stream.events == 5


async def test_a_stream_joining_a_running_engine_replays_what_it_published_before(engine, follow):
    for i in range(5):
        engine.publish(i, live=False)  # nobody subscribed yet
    stream = await follow(engine)  # no live message comes: the engine went idle
    assert stream.fresh and holds(stream, *range(5)) == list(range(5))
    assert stream.gaps_repaired == 0 and stream.gaps_lost == 0  # joining is no gap


async def test_an_engine_that_published_nothing_gives_a_fresh_empty_view(engine, follow):
    stream = await follow(engine)
    assert stream.fresh and len(stream.view) == 0


async def test_batches_lost_on_the_way_are_repaired_by_replay_when_a_later_one_reveals_them(engine, follow):
    stream = await follow(engine)
    await live(engine, stream, 0)
    repaired = stream.gaps_repaired
    engine.publish(1, live=False)
    engine.publish(2, live=False)
    await live(engine, stream, 3)
    assert stream.gaps_repaired == repaired + 1 and stream.gaps_lost == 0
    assert holds(stream, 0, 1, 2, 3) == [0, 1, 2, 3] and stream.fresh


async def test_a_new_engine_process_counting_from_zero_clears_the_view(engine, follow):
    stream = await follow(engine)
    for i in range(3):
        await live(engine, stream, i)
    engine.restart()
    await live(engine, stream, 10)  # seq 0 again, another batch
    assert stream.restarts == 1 and stream.fresh
    assert holds(stream, 0, 1, 2, 10) == [10]


async def test_a_gap_the_engine_no_longer_buffers_marks_the_view_stale_until_rebuilt(engine, follow):
    rebuild = 3  # blocks the engine must store before the view is trusted again
    stream = await follow(engine, rebuild_blocks=lambda: rebuild)
    await live(engine, stream, 0)
    for i in range(1, 5):
        engine.publish(i, live=False)
    del engine.buffer[:2]  # the engine's buffer no longer reaches back to 1 and 2
    await live(engine, stream, 5)
    assert not stream.fresh and stream.gaps_lost == 1
    assert "no longer buffers" in stream.stale_reason
    assert holds(stream, 0) == []  # what it held before the gap is unknown now
    stored = 1  # batch 5, applied after the gap was lost
    for i in range(6, 6 + rebuild - stored):
        assert not stream.fresh
        await live(engine, stream, i)
    assert stream.fresh and stream.stale_reason == ""


async def test_a_stream_joining_an_engine_whose_buffer_no_longer_reaches_its_start_is_stale_but_no_gap(engine,
                                                                                                       follow):
    for i in range(4):
        engine.publish(i, live=False)
    del engine.buffer[:2]
    stream = await follow(engine)
    assert stream.stale and not stream.fresh and stream.gaps_lost == 0  # partial: not routed by
    assert holds(stream, 2, 3) == [2, 3]  # what it did hear counts towards the rebuilding


async def test_without_a_replay_socket_a_gap_is_lost(engine):
    stream = EventStream("replica-0", engine.endpoint, None, EngineView(BS, seed))
    await stream.receive(0, Engine.payload(0))
    await stream.receive(2, Engine.payload(2))  # 1 lost, and nothing to ask for it
    assert not stream.fresh and stream.gaps_lost == 1 and "no replay socket" in stream.stale_reason


async def test_a_replay_socket_that_does_not_answer_loses_the_gap_after_the_timeout(engine):
    silent = zmq.asyncio.Context.instance().socket(zmq.ROUTER)  # bound, never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    try:
        stream = EventStream("replica-0", engine.endpoint, silent.getsockopt_string(zmq.LAST_ENDPOINT),
                             EngineView(BS, seed), replay_timeout_s=0.1)
        await stream.receive(0, Engine.payload(0))
        started = time.monotonic()
        await stream.receive(3, Engine.payload(3))
        assert time.monotonic() - started >= 0.1
        assert not stream.fresh and "did not answer" in stream.stale_reason
    finally:
        silent.close()


async def test_a_batch_delivered_live_after_a_catch_up_replayed_it_is_applied_once(engine):
    stream = EventStream("replica-0", engine.endpoint, engine.replay_endpoint, EngineView(BS, seed))
    for i in range(3):
        engine.publish(i, live=False)
    await stream.receive(0, engine.buffer[0][1])
    assert await stream.catch_up() == 2  # 1 and 2: nothing live had revealed them
    await stream.receive(2, engine.buffer[2][1])  # 2 arrives live after all
    assert stream.restarts == 0 and stream.batches == 3
    assert holds(stream, 0, 1, 2) == [0, 1, 2]


async def test_concurrent_catch_ups_share_one_replay(engine):
    stream = EventStream("replica-0", engine.endpoint, engine.replay_endpoint, EngineView(BS, seed))
    for i in range(3):
        engine.publish(i, live=False)
    results = await asyncio.gather(*(stream.catch_up() for _ in range(5)))
    assert results == [3] * 5 and engine.replays == 1


async def test_what_no_engine_sends_is_counted_undecodable_and_the_stream_goes_on(engine, follow):
    stream = await follow(engine)
    await live(engine, stream, 0)
    engine.pub.send_multipart((b"", b"short", b"x"))  # a sequence number of 5 bytes
    engine.pub.send_multipart((b"", b"\x00" * 8))  # two frames
    await stream.receive(MAX_SEQ, Engine.payload(99))  # out of vLLM's range
    engine.buffer.append((engine.seq, b"\xc1"))  # not msgpack
    engine.pub.send_multipart((b"", engine.seq.to_bytes(8, "big"), b"\xc1"))
    engine.seq += 1
    await until(lambda: stream.undecodable >= 4)
    await live(engine, stream, 1)
    assert stream.undecodable == 4 and stream.fresh and stream.gaps_lost == 0
    assert holds(stream, 0, 1, 99) == [0, 1]


async def test_reset_forgets_the_sequence_so_the_new_process_is_replayed_from_its_first_batch(engine):
    stream = EventStream("replica-0", engine.endpoint, engine.replay_endpoint, EngineView(BS, seed))
    await stream.receive(0, Engine.payload(0))
    await stream.receive(1, Engine.payload(1))
    stream.reset()  # the replica's metrics showed a restart before its events did
    assert len(stream.view) == 0 and not stream.fresh
    engine.restart()
    engine.publish(20, live=False)
    await stream.receive(1, engine.payload(21))  # its second batch: the first comes by replay
    assert stream.restarts == 0 and holds(stream, 0, 1, 20, 21) == [20, 21]
