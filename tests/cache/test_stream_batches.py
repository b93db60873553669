"""Messages read together (``EventStream.receive_all``, ``_waiting``): applied as one stretch of
events, they build the view that applying them one at a time builds, and a live stream that
falls behind reads what waits in fewer applications than messages."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from prefix_router.cache import stream as stream_module
from prefix_router.cache.stream import EventStream
from prefix_router.tools.sim import kv_events as sim_events

from .test_engine_view import view
from .test_events import BS, encode, stored
from .test_stream_gaps import _root, publisher, stream_for  # noqa: F401 - the fixture


def _steps(seed: int, steps: int) -> list[bytes]:
    """An engine's messages, one a step: each step evicts some held blocks (a ``BlockRemoved``
    each) and stores a few requests' blocks, chained onto blocks stored in earlier steps or new
    roots; now and then a block evicted earlier is stored again."""
    rng = random.Random(seed)
    held: list[int] = []
    evicted: list[int] = []
    next_key = 1
    messages = []
    for _ in range(steps):
        events = []
        for _ in range(rng.randrange(0, 3)):
            if len(held) > 6:
                key = held.pop(rng.randrange(len(held)))
                evicted.append(key)
                events.append(sim_events.BlockRemoved(block_hashes=[key], medium="GPU"))
        for _ in range(rng.randrange(1, 4)):
            parent = rng.choice(held) if held and rng.random() < 0.6 else None
            n = rng.randrange(1, 4)
            keys = [next_key + i for i in range(n)]
            if evicted and rng.random() < 0.2:
                keys[0] = evicted.pop()
            next_key += n
            tokens = [rng.randrange(50) for _ in range(n * BS)]  # few distinct: the same blocks meet again
            events.append(stored(keys, parent, tokens))
            held += [k for k in keys if k not in held]
        messages.append(encode(*events))
    return messages


def _picture(stream: EventStream) -> tuple:
    v = stream.view
    return sorted(v.blocks()), len(v), v.stored, stream.batches, stream.events, stream.undecodable, stream.last_seq


@pytest.mark.parametrize("batch_bytes", [1, 300, 1 << 20])
@pytest.mark.parametrize("seed", range(6))
async def test_messages_applied_together_build_the_view_one_at_a_time_builds(seed, batch_bytes, monkeypatch):
    messages = _steps(seed, 60)
    alone = EventStream("replica-0", "tcp://127.0.0.1:1", None, view())
    for seq, payload in enumerate(messages):
        await alone.receive(seq, payload)
    monkeypatch.setattr(stream_module, "BATCH_BYTES", batch_bytes)
    together = EventStream("replica-0", "tcp://127.0.0.1:1", None, view())
    await together.receive_all(list(enumerate(messages)))
    assert _picture(together) == _picture(alone)
    assert len(alone.view) > 0


async def test_a_read_with_a_batch_seen_and_a_new_engine_in_it_handles_each_as_alone_would():
    roots = [_root(i) for i in range(200, 206)]
    payloads = [encode(event) for _, event in roots]
    stream = EventStream("replica-0", "tcp://127.0.0.1:1", None, view())
    # 0-2, then 2 again (seen: skipped), then a new process counting from 0 (its 0-1 are roots 3-4),
    # then a number out of vLLM's range
    await stream.receive_all([(0, payloads[0]), (1, payloads[1]), (2, payloads[2]), (2, payloads[2]),
                              (0, payloads[3]), (1, payloads[4]), (1 << 63, payloads[5])])
    assert stream.restarts == 1 and stream.undecodable == 1 and stream.last_seq == 1
    assert [stream.view.match([h]) for h, _ in roots] == [0, 0, 0, 1, 1, 0]


async def test_a_stream_that_falls_behind_applies_what_waits_in_fewer_steps_than_messages(publisher,  # noqa: F811
                                                                                        monkeypatch):
    groups = []
    apply_group = EventStream._apply_group

    async def counted(self, group):
        groups.append(len(group))
        await apply_group(self, group)

    monkeypatch.setattr(EventStream, "_apply_group", counted)
    stream = stream_for(publisher)
    task = asyncio.create_task(stream.run())
    try:
        first = _root(300)
        for _ in range(100):  # a SUB socket joins asynchronously: publish until it hears
            publisher.publish([first[1]])
            await asyncio.sleep(0.02)
            if stream.batches:
                break
        roots = [_root(i) for i in range(301, 321)]
        groups.clear()
        for _, event in roots:  # the event loop is busy meanwhile: they wait in the sockets
            publisher.publish([event])
        time.sleep(0.2)
        for _ in range(100):
            await asyncio.sleep(0.02)
            if all(stream.view.match([h]) for h, _ in roots):
                break
        assert all(stream.view.match([h]) == 1 for h, _ in roots) and stream.fresh
        assert sum(groups) >= len(roots) and len(groups) < len(roots)
    finally:
        task.cancel()


async def test_a_read_takes_a_bounded_number_of_waiting_messages_however_small():
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context()
    pub, sub = context.socket(zmq.PUB), context.socket(zmq.SUB)
    try:
        pub.bind("inproc://flood")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect("inproc://flood")
        await asyncio.sleep(0.05)
        for seq in range(3 * stream_module.BATCH_MESSAGES):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), b"\x90"])  # an empty batch: a few bytes
        await asyncio.sleep(0.05)
        stream = EventStream("replica-0", "tcp://127.0.0.1:1", None, view())
        reads = [await stream._waiting(sub) for _ in range(3)]
        assert [len(r) for r in reads] == [stream_module.BATCH_MESSAGES] * 3
        assert [seq for r in reads for seq, _ in r] == list(range(3 * stream_module.BATCH_MESSAGES))
    finally:
        pub.close(0)
        sub.close(0)
        context.term()
