"""The KV event stream (``prefix_router/cache/stream.py``): joining late, repairing gaps through
the replay socket, marking the view stale when a gap is lost, engine restarts, and whatever a
publisher sends counted and skipped. What a hostile publisher costs: ``test_stream_hostile.py``.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from prefix_router.cache.blocks import block_hashes
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.stream import EventStream
from prefix_router.tools.sim import kv_events as sim_events

from .test_engine_view import view
from .test_events import BS, encode, seed, stored


def _root(i):
    """A one-block prompt of its own per batch: its gateway hash, and its event."""
    tokens = [1000 + 4 * i + k for k in range(4)]
    return block_hashes(tokens, BS, seed(None, None))[0], stored([5000 + i], None, tokens)


@pytest.fixture
async def publisher():
    pub = sim_events.EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    task = asyncio.create_task(pub.serve_replay())
    yield pub
    task.cancel()
    pub.close()


def published(pub, first: int, n: int):
    """``n`` one-block prompts published on ``pub`` (nobody listening yet): their roots, a
    stream for ``pub``, and the payloads in its buffer."""
    roots = [_root(i) for i in range(first, first + n)]
    for _, event in roots:
        pub.publish([event])
    return roots, stream_for(pub), [p for _, p in pub._buffer]


def stream_for(pub, **kw):
    endpoint, replay = pub.endpoints
    return EventStream("replica-0", endpoint, kw.pop("replay", replay), view(), **kw)


async def test_a_stream_joined_late_replays_what_was_published_before(publisher):
    roots, stream, _ = published(publisher, 0, 5)  # nobody subscribed yet
    root, event = _root(5)
    await stream.receive(5, encode(event))  # the first message the stream sees
    assert all(stream.view.match([h]) == 1 for h, _ in roots + [(root, event)])
    assert stream.fresh and stream.gaps_repaired == 0 and stream.last_seq == 5


async def test_a_gap_mid_stream_is_repaired_through_the_replay_socket(publisher):
    roots, stream, payloads = published(publisher, 10, 4)
    await stream.receive(0, payloads[0])
    await stream.receive(3, payloads[3])  # 1 and 2 lost on the way
    assert stream.gaps_repaired == 1 and stream.fresh
    assert [stream.view.match([h]) for h, _ in roots] == [1, 1, 1, 1]


async def test_a_gap_the_publisher_no_longer_buffers_marks_the_view_stale_until_rebuilt():
    pub = sim_events.EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=2)
    replay_task = asyncio.create_task(pub.serve_replay())
    try:
        roots = [_root(i) for i in range(20, 30)]
        for _, event in roots:
            pub.publish([event])
        stream = stream_for(pub, rebuild_blocks=lambda: 3)
        first = msgspec.msgpack.encode(sim_events._EventBatch(1.0, [roots[0][1]], 0))
        await stream.receive(0, first)
        assert stream.fresh
        await stream.receive(8, pub._buffer[0][1])  # 1-7 lost; the buffer keeps only 8 and 9
        assert not stream.fresh and stream.gaps_lost == 1 and "no longer buffers" in stream.stale_reason
        assert stream.view.match([roots[0][0]]) == 0  # cleared: what it held before is unknown
        await stream.receive(9, pub._buffer[1][1])
        assert not stream.fresh  # 2 blocks stored since, of 3
        await stream.receive(10, encode(_root(40)[1]))
        assert stream.fresh
    finally:
        replay_task.cancel()
        pub.close()


async def test_a_sequence_that_goes_back_is_a_restarted_engine_and_clears_the_view():
    stream = EventStream("replica-0", "tcp://127.0.0.1:1", None, view())
    old, _ = _root(70)
    await stream.receive(0, encode(_root(70)[1]))
    await stream.receive(1, encode(_root(71)[1]))
    new, event = _root(72)
    await stream.receive(0, encode(event))  # a new process counts from 0 again
    assert stream.restarts == 1 and stream.fresh
    assert stream.view.match([old]) == 0 and stream.view.match([new]) == 1


async def test_undecodable_messages_are_counted_and_skipped():
    stream = EventStream("replica-0", "tcp://127.0.0.1:1", None, view())
    await stream.receive(0, b"\xc1")
    await stream.receive(1, encode(_root(80)[1]))
    assert stream.undecodable == 1 and stream.fresh and stream.view.match([_root(80)[0]]) == 1


async def test_the_stream_follows_a_live_publisher_over_zmq(publisher):
    stream = stream_for(publisher)
    task = asyncio.create_task(stream.run())
    try:
        roots = [_root(i) for i in range(90, 95)]
        for _ in range(100):  # a SUB socket joins asynchronously: publish until it hears
            publisher.publish([roots[0][1]])
            await asyncio.sleep(0.02)
            if stream.batches:
                break
        for _, event in roots[1:]:
            publisher.publish([event])
        for _ in range(100):
            await asyncio.sleep(0.02)
            if all(stream.view.match([h]) for h, _ in roots):
                break
        assert all(stream.view.match([h]) == 1 for h, _ in roots)
        assert stream.fresh
    finally:
        task.cancel()


async def test_catch_up_fetches_a_last_batch_no_later_message_revealed_and_ignores_it_arriving_late(publisher):
    roots, stream, payloads = published(publisher, 100, 3)
    await stream.receive(0, payloads[0])  # 1 and 2 never arrive live
    assert await stream.catch_up() == 2
    assert [stream.view.match([h]) for h, _ in roots] == [1, 1, 1] and stream.last_seq == 2
    await stream.receive(2, payloads[2])  # delivered after all: the same batch, not a restart
    assert stream.restarts == 0 and stream.view.match([roots[0][0]]) == 1
    assert await stream.catch_up() == 0  # nothing new


async def test_a_stream_started_before_the_engine_published_anything_is_fresh_and_empty(publisher):
    stream = stream_for(publisher)
    assert not stream.fresh  # nothing heard yet
    assert await stream.catch_up() == 0
    assert stream.fresh and len(stream.view) == 0
    root, event = _root(110)
    publisher.publish([event])
    await stream.receive(0, publisher._buffer[0][1])
    assert stream.view.match([root]) == 1 and stream.gaps_lost == 0


async def test_a_stream_started_on_a_busy_engine_replays_its_buffer_at_once(publisher):
    roots = [_root(i) for i in range(120, 125)]
    for _, event in roots:
        publisher.publish([event])
    stream = stream_for(publisher)
    task = asyncio.create_task(stream.run())
    try:
        for _ in range(100):  # no live message comes: the engine went idle
            await asyncio.sleep(0.02)
            if stream.fresh:
                break
        assert stream.fresh and all(stream.view.match([h]) == 1 for h, _ in roots)
    finally:
        task.cancel()


# --- what a publisher sends -----------------------------------------------------------------

class _Raw(bytes):
    """Bytes sent as they are (msgspec cannot even encode what they decode to)."""


HOSTILE = [
    ("a timestamp that is no number", [None, []]),
    ("a batch nested past any recursion limit", _Raw(b"\x91" * 100_000 + b"\x90")),  # [[[...[]...]]]
    ("hashes that are lists", [1.0, [{"type": "BlockRemoved", "block_hashes": [[1]], "medium": "GPU"}]]),
    ("a parent that is a map", [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": {"a": 1},
                                       "token_ids": [1, 2, 3, 4], "block_size": 4}]]),
    ("float token ids", [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                "token_ids": [1.5, 2, 3, 4], "block_size": 4}]]),
    ("token ids past 64 bits", [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                       "token_ids": [1 << 64 - 1, 2, 3, 4], "block_size": 4}]]),
]


@pytest.mark.parametrize("case, raw", HOSTILE, ids=[c for c, _ in HOSTILE])
async def test_whatever_a_publisher_sends_is_counted_and_skipped_and_the_stream_goes_on(case, raw):
    stream = EventStream("replica-0", "tcp://127.0.0.1:1", None, view())
    await stream.receive(0, raw if isinstance(raw, _Raw) else msgspec.msgpack.encode(raw))
    root, event = _root(130)
    await stream.receive(1, encode(event))
    assert stream.undecodable == 1, case
    assert stream.fresh and stream.view.match([root]) == 1


async def test_a_block_size_of_zero_is_counted_and_the_rest_of_its_batch_applies():
    # vLLM's offloading connector announces chunks it cannot describe so (no tokens, block size 0)
    stream = EventStream("replica-0", "tcp://127.0.0.1:1", None, view())
    root, event = _root(130)
    zero = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
            "block_size": 0}
    await stream.receive(0, msgspec.msgpack.encode([1.0, [zero]]))
    await stream.receive(1, encode(event))
    assert stream.undecodable == 0 and stream.view.foreign_block_size == 1
    assert stream.fresh and stream.view.match([root]) == 1


async def test_events_describing_more_blocks_than_the_replica_holds_make_the_view_stale():
    stream = EventStream("replica-0", "tcp://127.0.0.1:1", None, EngineView(BS, seed, max_blocks=3))
    await stream.receive(0, encode(stored([1, 2], None, list(range(8)))))
    assert stream.fresh
    await stream.receive(1, encode(stored([3, 4], 2, list(range(8, 16)))))  # 4 > 3: no real cache
    assert not stream.fresh and "more blocks than the replica holds" in stream.stale_reason
