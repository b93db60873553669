"""``GhostRing`` (``cache/ghosts.py``): the blocks of an engine's last removals, with their stamps,
in bounded arrays."""

from __future__ import annotations

import random

from prefix_router.cache.ghosts import GhostRing


def test_the_ghost_ring_keeps_the_blocks_of_the_last_removals_with_their_stamps():
    rng = random.Random(3)
    ring, removals = GhostRing(50), []  # every (block, stamp) removed, in order
    for stamp in range(400):
        batch = [rng.randrange(120) for _ in range(rng.randrange(0, 9))]
        ring.note(batch, stamp)
        removals += [(h, stamp) for h in dict.fromkeys(reversed(batch))][::-1]
        last = dict(removals[-50:])  # a block's last removal among the last 50 slots written
        kept = {h: s for h, s in last.items() if max(i for i, (b, _) in enumerate(removals) if b == h) >= len(removals) - 50}
        asked = list(range(120))
        assert ring.stamps(asked).tolist() == [kept.get(h, -1) for h in asked] and len(ring) == len(kept)
    assert ring.nbytes < 50 * 40


def test_an_idle_ring_costs_nothing_and_a_batch_past_its_bound_keeps_its_newest():
    ring = GhostRing(100_000)
    assert ring.nbytes == 0 and ring.stamps([1, 2]).tolist() == [-1, -1]
    small = GhostRing(3)
    small.note([1, 2, 3, 4, 5], 7)
    assert small.stamps([1, 2, 3, 4, 5]).tolist() == [-1, -1, 7, 7, 7] and len(small) == 3


def test_a_ring_filled_a_block_at_a_time_grows_to_its_bound():
    """vLLM publishes one ``BlockRemoved`` a block evicted: the ring must keep growing past the
    size it first took, not wrap there."""
    ring = GhostRing(5000)
    for h in range(1, 5001):
        ring.note([h], h)
    assert len(ring) == 5000 and ring.stamps([1, 1024, 1025, 5000]).tolist() == [1, 1024, 1025, 5000]
    ring.note([5001], 5001)
    assert len(ring) == 5000 and ring.stamps([1, 2, 5001]).tolist() == [-1, 2, 5001]
    assert GhostRing(0).stamps([1]).tolist() == [-1]
