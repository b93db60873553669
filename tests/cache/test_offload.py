"""A replica's offload tiers (``prefix_router/cache/offload.py``): the blocks its engine keeps in CPU
memory or storage, taken from vLLM's self-describing offload events as the gateway receives them
(encoded, decoded), matched past the GPU's blocks for the whole fleet in one walk
(``cache/holders.py: offload_depths``), and valued by the policy (``routing/policy.py``)."""

from __future__ import annotations

from collections import deque

from prefix_router.cache.blocks import block_hashes
from prefix_router.cache.engine_map import EngineMap
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.events import BlockRemoved, decode_batch
from prefix_router.cache.intake import runs
from prefix_router.cache.holders import match_all, offload_depths
from prefix_router.cache.offload import MEDIA, OffloadTier
from prefix_router.config import RoutingConfig
from prefix_router.routing.bounds import ReplicaView
from prefix_router.routing.policy import PrefixAffinityPolicy
from prefix_router.routing.prefix_stats import BranchStats
from prefix_router.routing.ring import Ring
from prefix_router.tools.sim import kv_events as sim_events

from .test_engine_view import through_the_wire
from .test_events import BS, encode, seed, stored

TOKENS = list(range(300, 300 + 10 * BS))  # a prompt of 10 blocks
OURS = block_hashes(TOKENS, BS, seed(None, None))
ENGINE = list(range(1001, 1011))  # the engine's hash of each block


def offloaded(first: int, last: int, medium: str = "CPU") -> sim_events.BlockStored:
    """An offloaded chunk of blocks ``first``..``last - 1`` as vLLM's OffloadingEventsTracker
    announces it: each GPU-sized block's hash, the chunk's tokens, the parent before it."""
    return sim_events.BlockStored(block_hashes=ENGINE[first:last], parent_block_hash=ENGINE[first - 1] if first else None,
                                  token_ids=TOKENS[first * BS:last * BS], block_size=BS, lora_id=None, medium=medium,
                                  lora_name=None)


def test_a_re_announced_block_stays_until_its_last_announcement_is_removed():
    holders = EngineMap()
    tier = OffloadTier(holders.tier("CPU"), holders.slot())
    tier.store([1, 2], OURS[:2])
    tier.store([2, 3], OURS[1:3])  # the next chunk re-announces block 1 (a shared prefix not chunk-aligned)
    assert len(tier) == 3
    tier.remove([1, 2])
    assert len(tier) == 2 and holders.tier("CPU").stored(OURS[:3], tier.bit) == [False, True, True]
    tier.remove([2, 3, 99])  # an unknown key is ignored
    assert len(tier) == 0 and holders.tier("CPU").stored(OURS[:3], tier.bit) == [False, False, False]


def test_offload_events_fill_the_views_tiers_and_its_gpu_keeps_its_own():
    v = EngineView(BS, seed)
    through_the_wire(v, stored(ENGINE[:4], None, TOKENS[:4 * BS]))  # 4 blocks on the GPU
    through_the_wire(v, offloaded(0, 4), offloaded(4, 8))  # 8 offloaded to CPU, in chunks of 4
    through_the_wire(v, offloaded(8, 10, "STORAGE"))
    v.apply(BlockRemoved(ENGINE[2:4], medium="GPU"))  # evicted from the GPU, kept on the CPU
    assert v.match(OURS) == 2 and len(v) == 2 and len(v.offload["CPU"]) == 8 and len(v.offload["STORAGE"]) == 2
    depths = offload_depths(OURS, {"r": v}, {"r": v.match(OURS)}, len(OURS), MEDIA)
    assert depths == {"r": [6, 2]}  # CPU from block 2 to 8, storage from 8 to 10
    assert offload_depths(OURS, {"r": v}, {"r": 2}, 5, MEDIA) == {"r": [3, 0]}  # capped
    v.apply(BlockRemoved(ENGINE[5:6], medium="CPU"))
    assert offload_depths(OURS, {"r": v}, {"r": 2}, len(OURS), MEDIA) == {"r": [3, 0]}  # the run stops at the gap


def test_placeholders_and_foreign_tiers_are_counted_not_guessed():
    v = EngineView(BS, seed)
    placeholder = sim_events.BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[], block_size=0,
                                         lora_id=None, medium="CPU", lora_name=None)  # no self-describing events
    through_the_wire(v, placeholder, offloaded(0, 2, "REMOTE_ONLY"))
    assert len(v.offload["CPU"]) == 0 and v.offload["CPU"].opaque == 1 and "REMOTE_ONLY" not in v.offload
    orphan = offloaded(3, 5)  # its parent never announced anywhere
    through_the_wire(v, orphan)
    assert v.orphans == 2
    v.clear()  # an engine restart: every tier goes
    assert v.offload == {}


def test_a_prefix_on_a_cpu_tier_outweighs_a_shorter_one_on_a_gpu_as_its_weight_says():
    holders = EngineMap()
    gpu_only, offloading = EngineView(BS, seed, holders=holders), EngineView(BS, seed, holders=holders)
    through_the_wire(gpu_only, stored(ENGINE[:4], None, TOKENS[:4 * BS]))
    through_the_wire(offloading, stored(ENGINE[:2], None, TOKENS[:2 * BS]), offloaded(0, 8))
    views = {"a": ReplicaView("a", 0, gpu_only, 0.0, 0, True), "b": ReplicaView("b", 0, offloading, 0.0, 0, True)}
    assert match_all(OURS, {n: v.shadow for n, v in views.items()}, 9) == {"a": 4, "b": 2}
    ring = Ring.of(["a", "b"], 160)

    def choose(**weights):
        policy = PrefixAffinityPolicy(RoutingConfig(**weights), ring, BranchStats(4))
        return policy.select(OURS, 0, views, session_key="s", max_hit_blocks=9, first_turn=False)

    decision = choose(cpu_hit_weight=0.75)  # 2 + 0.75 x 6 = 6.5 against 4
    assert (decision.replica, decision.predicted_blocks, decision.offload) == ("b", 8, (6, 0))
    assert decision.best_blocks == 8 and decision.matches == {"a": 4, "b": 8}
    assert choose(cpu_hit_weight=0.25).replica == "a"  # 2 + 1.5 < 4
    ignored = choose()  # the default: routed by GPU blocks, the tier's hit still predicted
    assert (ignored.replica, ignored.predicted_blocks, ignored.offload) == ("a", 4, ())
    assert ignored.matches == {"a": 4, "b": 8}


def test_offloaded_blocks_announced_out_of_order_in_one_batch_are_chained_by_their_parents():
    # vLLM announces each offloaded block as its own event, in no prefix order within a batch
    # (OffloadingEventsTracker._take_stored_event: "Events are self-contained (own parent)")
    v = EngineView(BS, seed)
    for run in runs(decode_batch(encode(*[offloaded(i, i + 1) for i in (3, 1, 0, 2, 4)])).events, 1 << 20):
        deque(v.apply_run(run), maxlen=0)  # as cache/stream.py applies a message
    assert v.orphans == 0 and len(v.offload["CPU"]) == 5
    assert offload_depths(OURS, {"r": v}, {"r": 0}, len(OURS), MEDIA) == {"r": [5, 0]}


def apply_as_the_stream_does(v: EngineView, *events) -> None:
    for run in runs(decode_batch(encode(*events)).events, 1 << 20):
        deque(v.apply_run(run), maxlen=0)


def test_a_long_chain_announced_children_first_is_chained_in_one_pass():
    tokens = list(range(2000 * BS))
    engine = list(range(10_000, 12_000))
    chain = [sim_events.BlockStored(block_hashes=[engine[i]], parent_block_hash=engine[i - 1] if i else None,
                                    token_ids=tokens[i * BS:(i + 1) * BS], block_size=BS, lora_id=None, medium="CPU",
                                    lora_name=None) for i in range(2000)]
    v = EngineView(BS, seed)
    calls = 0
    parent_name = v._parent_name

    def counted(key):
        nonlocal calls
        calls += 1
        return parent_name(key)
    v._parent_name = counted
    apply_as_the_stream_does(v, *reversed(chain))
    assert v.orphans == 0 and len(v.offload["CPU"]) == 2000
    assert calls < 3 * 2000  # linear: each chunk's parent looked up a bounded number of times


def test_a_chunk_whose_parent_the_gpu_stores_in_the_same_message_is_chained_as_one_at_a_time_would():
    gpu = stored(ENGINE[:1], None, TOKENS[:BS])
    for apply in (lambda v, *e: through_the_wire(v, *e), apply_as_the_stream_does):
        v = EngineView(BS, seed)
        apply(v, gpu, offloaded(1, 3))
        assert v.orphans == 0 and len(v.offload["CPU"]) == 2


def test_many_engine_hashes_naming_one_block_overflow_the_view():
    v = EngineView(BS, seed, max_blocks=10)
    events = [sim_events.BlockStored(block_hashes=[50_000 + i], parent_block_hash=None, token_ids=TOKENS[:BS],
                                     block_size=BS, lora_id=None, medium="CPU", lora_name=None) for i in range(400)]
    apply_as_the_stream_does(v, *events)
    assert v.overflowed and v.offload["CPU"].keys <= 16 * 10 and len(v.offload["CPU"]) == 1
