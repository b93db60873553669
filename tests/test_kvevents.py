"""vLLM's KV events: the wire format, the view they build, and the stream that repairs its gaps.

The encoder is the simulator's (``prefix_router/tools/sim/kv_events.py``, vLLM's structs and options); the
real vLLM classes encode the same batch in ``tests/vllm_tier/test_kv_events.py``.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from prefix_router.cache.blocks import block_hashes, seed_hash
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from prefix_router.cache.stream import EventStream
from prefix_router.serve.learning import evicted_in_flight_tokens
from prefix_router.tools.sim import kv_events as sim_events

BS = 4  # tokens per block
MODEL = "tiny"


def seed(lora, salt):
    return seed_hash(lora or MODEL, salt)


def stored(hashes, parent, tokens, salt=None, **kw):
    extra = kw.pop("extra_keys", [(salt,)] + [None] * (len(hashes) - 1) if salt else None)
    return sim_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                                  lora_id=None, medium="GPU", lora_name=None, extra_keys=extra, **kw)


def encode(*events, ts=1.0):
    return msgspec.msgpack.encode(sim_events._EventBatch(ts, list(events), 0))


# --- the wire format -----------------------------------------------------------------------

def test_a_map_encoded_batch_decodes_every_event_type():
    tokens = list(range(100, 108))
    batch = decode_batch(encode(stored([11, 12], None, tokens, salt="tenant-a"),
                                sim_events.BlockRemoved(block_hashes=[11], medium="GPU"),
                                sim_events.AllBlocksCleared(), ts=5.5))
    assert batch.ts == 5.5 and batch.data_parallel_rank == 0
    first, removed, cleared = batch.events
    assert first == BlockStored([11, 12], None, tokens, BS, None, "GPU", "tenant-a", None)
    assert removed == BlockRemoved([11], "GPU") and isinstance(cleared, AllBlocksCleared)


def test_the_array_encoding_of_earlier_vllm_releases_decodes_too():
    payload = msgspec.msgpack.encode([2.0, [["BlockStored", [b"\x01" * 32], None, [1, 2, 3, 4], BS, None, "GPU", None],
                                            ["BlockRemoved", [b"\x01" * 32], "GPU"], ["AllBlocksCleared"]]])
    batch = decode_batch(payload)
    assert batch.events[0].block_hashes == [b"\x01" * 32] and batch.events[0].token_ids == [1, 2, 3, 4]
    assert batch.events[1] == BlockRemoved([b"\x01" * 32], "GPU")
    assert isinstance(batch.events[2], AllBlocksCleared) and batch.data_parallel_rank is None


def test_events_of_unknown_types_are_skipped_and_garbage_raises_value_error():
    payload = msgspec.msgpack.encode([1.0, [{"type": "SomethingNew", "x": 1}, {"type": "AllBlocksCleared"}]])
    assert [type(e) for e in decode_batch(payload).events] == [AllBlocksCleared]
    for garbage in (b"", b"\xc1", msgspec.msgpack.encode({"not": "a batch"}),
                    msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]])):
        with pytest.raises(ValueError):
            decode_batch(garbage)


def test_the_salt_is_read_past_a_lora_name_in_the_first_blocks_extra_keys():
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
             "block_size": BS, "lora_id": 3, "medium": "GPU", "lora_name": "sql-adapter",
             "extra_keys": [["sql-adapter", ["mm-image", 0], "tenant-b"]]}
    got = decode_batch(msgspec.msgpack.encode([1.0, [event]])).events[0]
    assert got.lora_name == "sql-adapter" and got.cache_salt == "tenant-b"


# --- the view ------------------------------------------------------------------------------

def view():
    return EngineView(BS, seed)


def through_the_wire(v, *events):
    """Apply the simulator's events to ``v`` as the gateway receives them: encoded, decoded."""
    for event in decode_batch(encode(*events)).events:
        v.apply(event)


def test_stored_blocks_are_matched_by_the_gateways_own_hashes_of_their_tokens():
    v = view()
    tokens = list(range(200, 212))  # 3 blocks
    through_the_wire(v, stored([901, 902], None, tokens[:8]))  # the engine's digests are opaque to the gateway
    through_the_wire(v, stored([903], 902, tokens[8:12]))  # chained onto its parent by the engine's hash
    ours = block_hashes(tokens, BS, seed(None, None))
    assert v.match(ours) == 3 and len(v) == 3
    assert v.match(block_hashes(tokens, BS, seed(None, "other-salt"))) == 0
    v.apply(BlockRemoved([902]))
    assert v.match(ours) == 1 and v.held_lately(ours[1]) and not v.held_lately(ours[1] + 1)


def test_a_salted_prompt_is_seeded_with_its_salt():
    v = view()
    tokens = list(range(8))
    through_the_wire(v, stored([1, 2], None, tokens, salt="tenant-a"))
    assert v.match(block_hashes(tokens, BS, seed(None, "tenant-a"))) == 2
    assert v.match(block_hashes(tokens, BS, seed(None, None))) == 0


def test_a_hash_cached_in_two_blocks_stays_until_both_are_removed():
    v = view()
    tokens = list(range(4))
    through_the_wire(v, stored([7], None, tokens))
    through_the_wire(v, stored([7], None, tokens))  # two requests computed it before either was cached
    ours = block_hashes(tokens, BS, seed(None, None))
    v.apply(BlockRemoved([7]))
    assert v.match(ours) == 1
    v.apply(BlockRemoved([7]))
    assert v.match(ours) == 0 and len(v) == 0


def test_what_the_view_cannot_use_is_counted_not_guessed():
    v = view()
    through_the_wire(v, stored([5], 999, list(range(4))))  # a parent never seen: events were lost
    v.apply(BlockStored([6], None, list(range(8)), 8))  # an engine with another block size
    v.apply(BlockStored([7], None, list(range(4)), BS, medium="CPU"))  # an offload tier: no GPU hit
    assert len(v) == 0 and v.orphans == 1 and v.foreign_block_size == 1


def test_all_blocks_cleared_empties_the_view_but_not_the_requests_in_flight():
    v = view()
    through_the_wire(v, stored([1], None, list(range(4))))
    running = block_hashes(list(range(50, 58)), BS, seed(None, None))
    v.note_routed(running)  # sent before the clear was published: vLLM publishes it after a step
    v.apply(AllBlocksCleared())
    assert len(v) == 0 and v.match(block_hashes(list(range(4)), BS, seed(None, None))) == 0
    assert v.match(running) == 2  # it stores its blocks after the clear
    v.clear()  # an engine restart, or a lost gap: nothing is known
    assert v.match(running) == 0


# --- the stream ----------------------------------------------------------------------------

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


async def test_without_a_replay_socket_a_gap_is_lost():
    stream = EventStream("replica-0", "tcp://127.0.0.1:1", None, view())
    await stream.receive(0, encode(_root(50)[1]))
    await stream.receive(2, encode(_root(52)[1]))
    assert not stream.fresh and "no replay socket" in stream.stale_reason


async def test_a_replay_socket_that_does_not_answer_loses_the_gap_after_the_timeout():
    stream = EventStream("replica-0", "tcp://127.0.0.1:1", "tcp://127.0.0.1:9", view(), replay_timeout_s=0.2)
    await stream.receive(0, encode(_root(60)[1]))
    await stream.receive(3, encode(_root(63)[1]))
    assert not stream.fresh and "did not answer" in stream.stale_reason


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


# --- the view against the simulated engine ------------------------------------------------

def test_the_view_holds_exactly_what_the_engine_caches_through_evictions_and_stays_within_its_blocks():
    """A small simulated engine (vLLM's prefix-cache rules, prefix_router/tools/sim/kv_cache.py) under a
    random workload of shared prefixes, salts and adapters that overflows it many times: after
    every step the view built from its events holds the same blocks as its cache."""
    import random as _random

    from prefix_router.tools.sim.config import SimConfig
    from prefix_router.tools.sim.scheduler import Scheduler, SimRequest

    served = "served-model"
    scheduler = Scheduler(SimConfig(model=served, block_size=BS, num_gpu_blocks=48, max_model_len=150,
                                    max_num_batched_tokens=64, max_num_seqs=4))
    scheduler.kv.record_events = True
    v = EngineView(BS, lambda lora, salt: seed_hash(lora or served, salt))
    rng = _random.Random(5)
    documents = [[rng.randrange(1000) for _ in range(rng.randrange(8, 40))] for _ in range(6)]
    t = 0.0
    for i in range(200):
        prompt = rng.choice(documents) + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        scheduler.add(SimRequest(f"r{i}", prompt, rng.randrange(1, 12), model=rng.choice([served, served, "lora-a"]),
                                 cache_salt=rng.choice([None, None, "tenant"])))
        while scheduler.has_work and rng.random() < 0.7:
            step = scheduler.schedule()
            t += 1.0
            scheduler.finish_step(step, t)
            for event in decode_batch(encode(*scheduler.kv.take_events())).events:
                v.apply(event)
            assert set(v._blocks) == set(scheduler.kv.cached), i
            assert len(v) <= scheduler.kv.num_gpu_blocks
    assert v.orphans == 0 and v.stored > 3 * scheduler.kv.num_gpu_blocks  # it overflowed, many times
    while scheduler.has_work:
        scheduler.finish_step(scheduler.schedule(), t := t + 1.0)
    assert len(v) > 0 and scheduler.kv.reset_prefix_cache()  # POST /reset_prefix_cache, idle
    for event in decode_batch(encode(*scheduler.kv.take_events())).events:
        v.apply(event)
    assert len(v) == 0 and not scheduler.kv.cached


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
    ("a block size of zero", [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                     "token_ids": [1, 2, 3, 4], "block_size": 0}]]),
]


@pytest.mark.parametrize("case, raw", HOSTILE, ids=[c for c, _ in HOSTILE])
async def test_whatever_a_publisher_sends_is_counted_and_skipped_and_the_stream_goes_on(case, raw):
    stream = EventStream("replica-0", "tcp://127.0.0.1:1", None, view())
    await stream.receive(0, raw if isinstance(raw, _Raw) else msgspec.msgpack.encode(raw))
    root, event = _root(130)
    await stream.receive(1, encode(event))
    assert stream.undecodable == 1, case
    assert stream.fresh and stream.view.match([root]) == 1


def test_blocks_carrying_images_or_prompt_embeds_are_not_matched_by_their_tokens_alone():
    v = view()
    tokens = list(range(8))
    through_the_wire(v, stored([1, 2], None, tokens, extra_keys=[(("image-digest", 0),), None]))
    assert v.match(block_hashes(tokens, BS, seed(None, None))) == 0 and v.opaque == 2


def test_an_event_whose_tokens_are_not_its_blocks_is_skipped():
    v = view()
    through_the_wire(v, stored([1], None, list(range(8))))  # two blocks of tokens, one hash: a null block left out
    assert len(v) == 0 and v.misshapen == 1


async def test_events_describing_more_blocks_than_the_replica_holds_make_the_view_stale():
    stream = EventStream("replica-0", "tcp://127.0.0.1:1", None, EngineView(BS, seed, max_blocks=3))
    await stream.receive(0, encode(stored([1, 2], None, list(range(8)))))
    assert stream.fresh
    await stream.receive(1, encode(stored([3, 4], 2, list(range(8, 16)))))  # 4 > 3: no real cache
    assert not stream.fresh and "more blocks than the replica holds" in stream.stale_reason


def test_blocks_evicted_while_a_request_waits_are_told_apart_from_those_evicted_before_it_was_sent():
    v = view()
    tokens = list(range(400, 416))  # 4 blocks
    ours = block_hashes(tokens, BS, seed(None, None))
    through_the_wire(v, stored([41, 42, 43, 44], None, tokens))
    v.apply(BlockRemoved([44]))  # before the request: the routing saw it gone
    since = v.note_routed(ours[:3])
    assert v.evicted_since(ours, 3, since) == ()
    v.apply(BlockRemoved([43, 42]))  # another request's allocation evicts the tail first
    assert v.evicted_since(ours, 3, since) == (1, 2) and v.evicted_since(ours, 1, since) == ()
    later = v.note_routed(ours[:1])  # a request sent after those removals did not lose them
    assert v.evicted_since(ours, 3, later) == ()
    v.release_routed(ours[:3], now=1.0, served=True)
    v.release_routed(ours[:1], now=1.0, served=True)
    assert not v._evicted  # nothing kept past the requests that wanted the blocks


def test_the_tokens_evicted_in_flight_run_from_the_evicted_block_where_the_engines_hit_stopped():
    # blocks 1 and 5 of 8 predicted (16 tokens each) evicted while the request waited
    assert evicted_in_flight_tokens((1, 5), cached_blocks=1, predicted_tokens=128, to_tokens=16) == 112
    # block 1 stored again before the request was scheduled: the hit stopped at block 5
    assert evicted_in_flight_tokens((1, 5), cached_blocks=5, predicted_tokens=128, to_tokens=16) == 48
    # evicted after it was scheduled (a preemption): the engine hit all it was routed for
    assert evicted_in_flight_tokens((1, 5), cached_blocks=8, predicted_tokens=128, to_tokens=16) == 0
    # a hit short of the prediction at a block the events never showed evicted is not explained
    assert evicted_in_flight_tokens((1,), cached_blocks=3, predicted_tokens=128, to_tokens=16) == 0
    assert evicted_in_flight_tokens((), cached_blocks=0, predicted_tokens=128, to_tokens=16) == 0


def test_blocks_of_requests_in_flight_count_until_they_end_and_then_until_the_events_confirm_them():
    v = EngineView(BS, seed, pending_s=2.0)
    tokens = list(range(300, 308))
    ours = block_hashes(tokens, BS, seed(None, None))
    v.note_routed(ours)
    v.note_routed(ours)  # a second request with the same prompt
    assert v.match(ours) == 2 and len(v) == 0  # counted, not yet stored
    v.release_routed(ours, now=10.0, served=True)
    assert v.match(ours) == 2  # the other one still runs
    v.release_routed(ours, now=11.0, served=True)
    assert v.match(ours) == 2  # ended, events not in yet: held for pending_s
    v.release_routed([], now=13.5, served=True)  # time passes
    assert v.match(ours) == 0  # no event ever came: not held
    v.note_routed(ours)
    v.release_routed(ours, now=20.0, served=False)  # failed: nothing stored
    assert v.match(ours) == 0
    v.note_routed(ours)
    through_the_wire(v, stored([1, 2], None, tokens))
    v.release_routed(ours, now=30.0, served=True)
    assert v.match(ours) == 2 and not v._released  # confirmed by the events
