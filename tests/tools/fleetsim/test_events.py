"""KV events in the fleet simulator (``tools/fleetsim/events.py``): the simulated engine's events,
encoded as vLLM's publisher sends them, build the view ``serve`` builds of the engine's cache."""

from __future__ import annotations

import random

from prefix_router.cache.blocks import block_hashes, seed_hash
from prefix_router.cache.engine_map import EngineMap
from prefix_router.tools.fleetsim.events import EventFeed, publish
from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.kv_cache import extend_block_hashes
from prefix_router.tools.sim.kv_cache import seed_hash as sim_seed
from prefix_router.tools.sim.scheduler import Scheduler, SimRequest

BLOCK = 16


def _served(scheduler: Scheduler, ids: list[int], rid: str) -> None:
    scheduler.add(SimRequest(rid, ids, 2, model=""))
    t = 0.0
    while scheduler.has_work:
        t += 0.01
        scheduler.finish_step(scheduler.schedule(), t)


def test_a_served_prompts_blocks_reach_the_view_and_an_eviction_takes_them_away():
    rng = random.Random(1)
    scheduler = Scheduler(SimConfig(num_gpu_blocks=40, block_size=BLOCK), vocab_size=1 << 17)
    scheduler.kv.record_events = True
    feed = EventFeed(BLOCK, 40, EngineMap())
    first = [rng.randrange(300, 30_000) for _ in range(10 * BLOCK + 3)]
    _served(scheduler, first, "a")
    feed.receive(publish(scheduler.kv.take_events(), 0.1))
    ours = block_hashes(first, BLOCK, seed_hash(""))
    assert feed.view.match(ours) == 10 and feed.batches == 1
    for k in range(4):  # other prompts fill the cache past its 39 usable blocks: the first one's go
        _served(scheduler, [rng.randrange(300, 30_000) for _ in range(10 * BLOCK)], f"b{k}")
    feed.receive(publish(scheduler.kv.take_events(), 0.2))
    engine = []
    extend_block_hashes(engine, first, BLOCK, sim_seed(""))
    engine_kept = len(scheduler.kv.find_longest_cache_hit(engine, len(first)))
    assert feed.view.match(ours) == engine_kept < 10
