"""The engines' views in one compact map (``cache/engine_map.py``) answer what
the per-block views did (``bench/per_block_view.py``, ``EngineView`` before the map), under random
events, routings, resets and closes, including what vLLM rarely sends (a hash stored twice, two
engine hashes for one block, removals of hashes never stored, bytes digests)."""

from __future__ import annotations

import random

import pytest

from bench.per_block_view import PerBlockEngineView
from prefix_router.cache.blocks import block_hashes, seed_hash
from prefix_router.cache.engine_map import EngineMap
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.events import AllBlocksCleared, BlockRemoved, BlockStored

BLOCK = 4
SEED = seed_hash("model")


def _engine_hash(h: int, flavour: int) -> int | bytes:
    """The engine's digest of a block: one-to-one stand-ins; flavour 2 as bytes (sha256 digests)."""
    if flavour == 2:
        return (h ^ 0x77).to_bytes(32, "big")
    return h ^ (0x5A5A5A5A if flavour == 0 else 0x1234567)


def _prompts(rng: random.Random) -> list[list[int]]:
    docs = [[rng.randrange(50) for _ in range(BLOCK * rng.randrange(1, 5))] for _ in range(3)]
    return [doc + [rng.randrange(50) for _ in range(BLOCK * rng.randrange(0, 4))] for doc in docs for _ in range(3)]


def _same(view: EngineView, model: PerBlockEngineView, prompts, routed) -> None:
    """The two answer alike; where the ring keeps fewer ghosts (``max_ghosts`` small, blocks
    removed again), the view's ghosts are a subset of the model's, newest kept."""
    assert len(view) == len(model) and view.blocks() == set(model._blocks)
    exact = model.max_ghosts > 100
    assert len(view._ghosts) <= len(model._ghosts) and (len(view._ghosts) == len(model._ghosts) or not exact)
    for prompt in prompts:
        hashes = block_hashes(prompt, BLOCK, SEED)
        assert view.match(hashes) == model.match(hashes)
        lately, model_lately = [view.held_lately(h) for h in hashes], [model.held_lately(h) for h in hashes]
        assert all(m for v, m in zip(lately, model_lately) if v)
        if exact:
            assert view.match_ever(hashes) == model.match_ever(hashes) and lately == model_lately
    for hashes, since, since_model in routed:
        evicted = view.evicted_since(hashes, len(hashes), since)
        assert set(evicted) <= set(model.evicted_since(hashes, len(hashes), since_model))
        if exact:
            assert evicted == model.evicted_since(hashes, len(hashes), since_model)


@pytest.mark.parametrize("seed", range(60))
def test_views_in_one_map_answer_as_per_block_views_under_random_operations(seed):
    rng = random.Random(seed)
    fleet = EngineMap()
    ghosts = rng.choice([4, 1000])  # at 4, a block removed again leaves an empty slot in the ring: at most 4
    pairs = [(EngineView(BLOCK, lambda lora, salt: SEED, pending_s=0.5, max_ghosts=ghosts, holders=fleet),
              PerBlockEngineView(BLOCK, lambda lora, salt: SEED, pending_s=0.5, max_ghosts=ghosts)) for _ in range(3)]
    routed: list[list] = [[] for _ in pairs]
    prompts = _prompts(rng)
    for t in range(150):
        i = rng.randrange(len(pairs))
        view, model = pairs[i]
        prompt = rng.choice(prompts)
        hashes = block_hashes(prompt, BLOCK, SEED)
        flavour = rng.choice([0, 0, 0, 1, 2])
        op = rng.randrange(9)
        if op <= 2:
            start = rng.randrange(len(hashes) + 1) if rng.random() < 0.3 else 0
            parent = None if start == 0 else _engine_hash(hashes[start - 1], flavour)
            event = BlockStored([_engine_hash(h, flavour) for h in hashes[start:]], parent,
                                prompt[start * BLOCK:len(hashes) * BLOCK], BLOCK)
        elif op <= 4:
            gone = hashes[rng.randrange(len(hashes) + 1):]
            event = BlockRemoved([_engine_hash(h, flavour) for h in gone] + [rng.getrandbits(40)])
        elif op == 5:
            routed[i].append((hashes, view.note_routed(hashes), model.note_routed(hashes)))
            event = None
        elif op == 6 and routed[i]:
            hashes, _, _ = routed[i].pop(rng.randrange(len(routed[i])))
            served = rng.random() < 0.6
            view.release_routed(hashes, t * 0.1, served)
            model.release_routed(hashes, t * 0.1, served)
            event = None
        elif op == 7:
            event = AllBlocksCleared() if rng.random() < 0.7 else None
            if event is None:
                view.clear(), model.clear()
        else:
            event = None
            view.release_routed([], t * 0.1, True), model.release_routed([], t * 0.1, True)  # time passes
        if event is not None:
            view.apply(event)
            model.apply(event)
        for v, m in pairs:
            _same(v, m, prompts, [])
        _same(view, model, prompts, routed[i])
        for prompt in prompts:  # and the fleet's one walk answers each view's own match
            hashes = block_hashes(prompt, BLOCK, SEED)
            drops = {1 << b: d for bits, d in fleet.drops(hashes, sum(v.bit for v, _ in pairs))
                     for b in range(bits.bit_length()) if bits >> b & 1}
            assert drops == {v.bit: m.match(hashes) for v, m in pairs if m.match(hashes)}


def test_a_closed_view_leaves_the_map_and_its_requests_in_flight_end_on_their_own():
    fleet = EngineMap()
    a, b = EngineView(BLOCK, lambda lora, salt: SEED, holders=fleet), EngineView(BLOCK, lambda lora, salt: SEED,
                                                                                 holders=fleet)
    tokens = list(range(12))
    hashes = block_hashes(tokens, BLOCK, SEED)
    for v in (a, b):
        v.apply(BlockStored([_engine_hash(h, 0) for h in hashes], None, tokens, BLOCK))
    a.apply(BlockRemoved([_engine_hash(hashes[2], 0)]))
    since = a.note_routed(hashes + [123])
    bit = a.bit
    a.close()
    assert len(fleet) == 3 and fleet.drops(hashes, bit | b.bit) == [(b.bit, 3)]
    assert EngineView(BLOCK, lambda lora, salt: SEED, holders=fleet).bit == bit  # the freed slot, not a new one
    a.release_routed(hashes + [123], 1.0, served=False)  # on its private map: the fleet's is untouched
    assert a.evicted_since(hashes, 3, since - 1) == (2,) and fleet.drops(hashes, b.bit) == [(b.bit, 3)]
    b.close()
    assert len(fleet) == 0


def test_a_fleet_of_many_masks_sweeps_the_ones_no_block_uses():
    rng = random.Random(7)
    fleet = EngineMap()
    bits = [fleet.slot() for _ in range(70)]
    chains = [block_hashes([i] * 12, BLOCK, SEED) for i in range(600)]
    last = []
    for chain in chains:  # each chain held by six replicas of its own, then by the last of them alone
        holders = rng.sample(bits, 6)
        for bit in holders:
            fleet.store(chain, bit)
        for bit in holders[:-1]:
            fleet.unstore(chain, bit)
        last.append(holders[-1])
    assert len(fleet._masks) <= 4097  # ~10 masks a chain were made, 6,000 in all: the unused were swept
    for chain, bit in zip(chains, last):
        assert fleet.stored(chain, bit) == [True] * 3 and fleet.drops(chain, sum(bits)) == [(bit, 3)]
