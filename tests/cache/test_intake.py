"""A view fed runs of events (``cache/intake.py``, as ``cache/stream.py`` feeds it) ends where the
same events one at a time take it, whatever the runs hold: stores chained onto blocks an earlier
event of the run stored, one hash stored twice, removals of blocks stored in the same message,
resets, events that cannot be read."""

from __future__ import annotations

import random
import struct

import pytest

from prefix_router.cache.blocks import block_hashes, seed_hash
from prefix_router.cache.engine_map import EngineMap
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefix_router.cache.intake import runs

BLOCK = 4
SEED = seed_hash("model")


def _view(fleet: EngineMap) -> EngineView:
    return EngineView(BLOCK, lambda lora, salt: SEED, max_ghosts=50, holders=fleet)


def _events(rng: random.Random, docs: list[list[int]], mixed: bool) -> list:
    """A message's worth of events: chains stored a request at a time (each event's parent the
    last block of the one before), removals of one block each, sometimes a reset or a bad event;
    ``mixed``: now and then another engine hash for the same block (never from one vLLM engine)."""
    out = []
    for _ in range(rng.randrange(1, 30)):
        doc = rng.choice(docs)
        hashes = block_hashes(doc, BLOCK, SEED)
        engine = [h ^ (rng.choice([0x5A5A, 0x5A5A, 0x777]) if mixed else 0x5A5A) for h in hashes]
        r = rng.random()
        if r < 0.5:
            start = rng.randrange(len(hashes))
            end = rng.randrange(start + 1, len(hashes) + 1)
            tokens = doc[start * BLOCK:end * BLOCK]
            if rng.random() < 0.05:
                tokens = [2**63 + 5] * len(tokens)  # a token id no block can be hashed with
            out.append(BlockStored(engine[start:end], engine[start - 1] if start else None, tokens, BLOCK))
        elif r < 0.93:
            out += [BlockRemoved([h]) for h in rng.sample(engine, rng.randrange(1, len(engine) + 1))]
        elif r < 0.96:
            out.append(BlockRemoved([rng.getrandbits(40)], medium="CPU"))
        else:
            out.append(AllBlocksCleared())
    return out


def _state(view: EngineView, docs, mixed: bool) -> tuple:
    """What the view holds; with ``mixed`` engine hashes not its removal count and ghosts: where
    two engine hashes name one block, a removal of one and a store of the other count a removal
    or not by their order, and runs may put a stretch's removals first."""
    prompts = [block_hashes(d, BLOCK, SEED) for d in docs]
    held = (view.blocks(), len(view), sorted(zip(*view._engine.items())), view._engine_extra, view._block_extra,
            [view.match(p) for p in prompts], view.stored, view.orphans)
    return held if mixed else (*held, [view.match_ever(p) for p in prompts], view.removals)


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("seed", range(30))
def test_runs_of_events_build_the_view_one_at_a_time_builds(seed, mixed):
    rng = random.Random(seed)
    docs = [[rng.randrange(40) for _ in range(BLOCK * rng.randrange(2, 9))] for _ in range(5)]
    whole, single = _view(EngineMap()), _view(EngineMap())
    bad = 0
    for _ in range(12):
        events = _events(rng, docs, mixed)
        routed = block_hashes(rng.choice(docs), BLOCK, SEED)
        since = (whole.note_routed(routed), single.note_routed(routed))
        for event in events:
            try:
                single.apply(event)
            except struct.error:  # the event is skipped, as the stream skips it
                bad += 1
        for run in runs(events, rng.choice([3, 1 << 62])):
            list(whole.apply_run(run, 2))
        assert _state(whole, docs, mixed) == _state(single, docs, mixed)
        assert whole.bad_events == bad
        if not mixed:
            assert whole.evicted_since(routed, len(routed), since[0]) == \
                single.evicted_since(routed, len(routed), since[1])
        whole.release_routed(routed, 0.0, True)
        single.release_routed(routed, 0.0, True)


def test_runs_put_a_stretchs_removals_first_unless_they_meet_its_stores():
    def stored(keys, parent=None):
        return BlockStored(keys, parent, list(range(len(keys) * BLOCK)), BLOCK)

    def kinds(events, slice_blocks=100):
        return [[type(e).__name__[5] + str(e.block_hashes[0]) if e.__class__ is not AllBlocksCleared else "C"
                 for e in run] for run in runs(events, slice_blocks)]

    # a step's events, a request at a time: evictions of old blocks, then the new ones stored
    assert kinds([BlockRemoved([1]), stored([10]), BlockRemoved([2]), stored([20]), stored([21], 20)]) == \
        [["R1", "R2"], ["S10", "S20", "S21"]]
    # a block stored, then removed (or chained onto a removed one): the stretch ends before it
    assert kinds([stored([10]), BlockRemoved([3]), BlockRemoved([10]), stored([30])]) == \
        [["R3"], ["S10"], ["R10"], ["S30"]]
    assert kinds([BlockRemoved([5]), stored([6], 5)]) == [["R5"], ["S6"]]
    assert kinds([BlockRemoved([5]), AllBlocksCleared(), BlockRemoved([6])]) == [["R5"], ["C"], ["R6"]]
    assert kinds([stored([1, 2]), stored([3, 4]), stored([5, 6])], 4) == [["S1", "S3"], ["S5"]]
