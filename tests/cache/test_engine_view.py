"""The view a replica's KV events build (``prefix_router/cache/engine_view.py``): what it holds,
what it cannot use, and the blocks of requests in flight.

The events are the simulator's (``prefix_router/tools/sim/kv_events.py``), encoded and decoded
as the gateway receives them (``tests/cache/test_events.py``).
"""

from __future__ import annotations

from prefix_router.cache.blocks import block_hashes, seed_hash
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from prefix_router.serve.learning import evicted_in_flight_tokens

from .test_events import BS, encode, seed, stored


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


def test_blocks_carrying_images_or_prompt_embeds_are_not_matched_by_their_tokens_alone():
    v = view()
    tokens = list(range(8))
    through_the_wire(v, stored([1, 2], None, tokens, extra_keys=[(("image-digest", 0),), None]))
    assert v.match(block_hashes(tokens, BS, seed(None, None))) == 0 and v.opaque == 2


def test_an_event_whose_tokens_are_not_its_blocks_is_skipped():
    v = view()
    through_the_wire(v, stored([1], None, list(range(8))))  # two blocks of tokens, one hash: a null block left out
    assert len(v) == 0 and v.misshapen == 1


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
            assert v.blocks() == set(scheduler.kv.cached), i
            assert len(v) <= scheduler.kv.num_gpu_blocks
    assert v.orphans == 0 and v.stored > 3 * scheduler.kv.num_gpu_blocks  # it overflowed, many times
    while scheduler.has_work:
        scheduler.finish_step(scheduler.schedule(), t := t + 1.0)
    assert len(v) > 0 and scheduler.kv.reset_prefix_cache()  # POST /reset_prefix_cache, idle
    for event in decode_batch(encode(*scheduler.kv.take_events())).events:
        v.apply(event)
    assert len(v) == 0 and not scheduler.kv.cached


# --- requests in flight -------------------------------------------------------------------

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
    # the answer may come before the events: a removal that arrives after the request ended,
    # and the block stored again by the request's own prefill, still tell it was evicted
    v.apply(BlockRemoved([41]))
    through_the_wire(v, stored([51, 52], None, tokens[:8]))
    assert v.evicted_since(ours, 3, since) == (0, 1, 2) and v.evicted_since(ours, 3, v.note_routed([])) == ()
    assert v.held_lately(ours[0]) and v.held_lately(ours[1])


def test_removals_between_two_routings_are_told_apart_by_their_stamps():
    v = view()
    tokens = list(range(500, 500 + 64 * BS))
    ours = block_hashes(tokens, BS, seed(None, None))
    engine = list(range(1000, 1064))
    through_the_wire(v, stored(engine, None, tokens))
    first = v.note_routed(ours[:1])
    v.apply(BlockRemoved(engine[32:]))
    second = v.note_routed(ours[:1])
    v.apply(BlockRemoved(engine[1:32]))
    assert v.evicted_since(ours, 64, first) == tuple(range(1, 64))
    assert v.evicted_since(ours, 64, second) == tuple(range(1, 32))


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
