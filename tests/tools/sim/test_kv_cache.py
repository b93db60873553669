"""Each prefix-caching rule of vLLM's v1 engine, pinned with a small exact case.

Rules and their vLLM sources are listed in ``prefix_router/tools/sim/kv_cache.py``. Block size 4 keeps the
cases small enough to work through by hand; expected values are derived in the test from the
block size and prompt lengths, never copied from a run.
"""

from __future__ import annotations

from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.kv_cache import KVCache, extend_block_hashes, seed_hash
from prefix_router.tools.sim.scheduler import Scheduler, SimRequest

BS = 4


def hashes(tokens, model="m", salt=None):
    out = []
    extend_block_hashes(out, tokens, BS, seed_hash(model, salt))
    return out


def sched(num_blocks=64, **kw) -> Scheduler:
    cfg = dict(model="m", block_size=BS, num_gpu_blocks=num_blocks, max_model_len=1000,
               max_num_batched_tokens=1000, max_num_seqs=16)
    cfg.update(kw)
    return Scheduler(SimConfig(**cfg))


def run(s: Scheduler, *requests: SimRequest) -> None:
    """Add requests and step the engine until all finish."""
    for r in requests:
        s.add(r)
    t = 0.0
    while s.has_work:
        step = s.schedule()
        assert step.scheduled, "engine stalled"
        t += 1.0
        s.finish_step(step, t)


def req(tokens, max_tokens=1, salt=None, model="m", rid="r"):
    return SimRequest(rid, list(tokens), max_tokens, model=model, cache_salt=salt)


def test_only_full_blocks_are_cached_and_hit():
    s = sched()
    prompt = list(range(100, 100 + 2 * BS + 2))  # two full blocks and a partial one
    run(s, req(prompt))
    again = req(prompt + [7, 7, 7])  # shares all 10 tokens, but only 2 blocks were full
    run(s, again)
    assert again.num_cached_tokens == 2 * BS


def test_hit_is_capped_below_the_last_prompt_token():
    s = sched()
    prompt = list(range(100, 100 + 3 * BS))  # exactly three full blocks
    run(s, req(prompt))
    same = req(prompt)
    run(s, same)
    # The last token must be computed for logits, so the third block is recomputed.
    assert same.num_cached_tokens == (len(prompt) - 1) // BS * BS == 2 * BS


def test_block_identity_is_chained_to_its_parents():
    a = list(range(100, 100 + 2 * BS))
    b = [1, 2, 3, 4] + a[BS:]  # same second block under a different first block
    assert hashes(a)[1] != hashes(b)[1]
    s = sched()
    run(s, req(a + [9]))
    other = req(b + [9])
    run(s, other)
    assert other.num_cached_tokens == 0


def test_cache_salt_and_model_enter_the_first_block():
    tokens = list(range(100, 100 + 2 * BS + 1))
    assert hashes(tokens, salt="a")[0] != hashes(tokens, salt="b")[0]
    assert hashes(tokens, model="m")[0] != hashes(tokens, model="adapter")[0]
    s = sched()
    run(s, req(tokens, salt="a"))
    other_salt, same_salt, no_salt = req(tokens, salt="b"), req(tokens, salt="a"), req(tokens)
    run(s, other_salt)
    run(s, same_salt)
    run(s, no_salt)
    assert other_salt.num_cached_tokens == 0
    assert same_salt.num_cached_tokens == 2 * BS
    assert no_salt.num_cached_tokens == 0


def test_running_requests_hold_references_and_their_blocks_are_never_taken():
    s = sched(num_blocks=1 + 6)  # six usable blocks
    prompt = list(range(100, 100 + 2 * BS))
    running = req(prompt, max_tokens=BS, rid="running")
    sharer = req(prompt + [5], max_tokens=BS, rid="sharer")
    s.add(running)
    s.add(sharer)
    s.finish_step(s.schedule(), 1.0)
    held = list(running.blocks)
    assert [b.ref_cnt for b in held[:2]] == [2, 2]  # the shared prefix is referenced twice
    # A request needing more blocks than are free must wait: held blocks are never taken.
    big = req(range(300, 300 + 3 * BS + 1), rid="big")
    s.add(big)
    s.finish_step(s.schedule(), 2.0)
    assert big in s.waiting and big.num_cached_tokens is None
    assert running.blocks[: len(held)] == held and all(b.ref_cnt >= 1 for b in held)
    run(s)
    assert big.finish_reason == "length"


def test_freed_blocks_stay_hittable_until_reused():
    s = sched(num_blocks=1 + 8)
    prompt = list(range(100, 100 + 2 * BS + 1))
    run(s, req(prompt))
    assert s.kv.num_free_blocks == 8  # all blocks back in the free queue...
    again = req(prompt)
    run(s, again)
    assert again.num_cached_tokens == 2 * BS  # ...and their contents still hit


def test_least_recently_freed_prefix_is_evicted_first():
    s = sched(num_blocks=1 + 6)
    first = list(range(100, 100 + 2 * BS + 1))  # 2 full blocks + a partial one
    second = list(range(200, 200 + 2 * BS + 1))
    run(s, req(first, rid="first"))
    run(s, req(second, rid="second"))
    # A new 3-block request takes the unhashed partial block of `second`, one never-used
    # block, then the least recently freed hashed block: `first`'s tail (freed tail first).
    run(s, req(range(300, 300 + 2 * BS + 1), rid="new"))
    assert len(s.kv.find_longest_cache_hit(hashes(first), len(first))) == 1
    assert len(s.kv.find_longest_cache_hit(hashes(second), len(second))) == 2


def test_a_request_is_freed_tail_first_so_its_head_survives_longest():
    kv = KVCache(num_gpu_blocks=1 + 3, block_size=BS)
    tokens = list(range(100, 100 + 3 * BS))
    block_hashes = hashes(tokens)
    held = []
    assert kv.allocate(held, [], len(tokens))
    kv.cache_full_blocks(held, block_hashes, 0, 3)
    kv.free(held)
    taken = []
    assert kv.allocate(taken, [], 1)  # one new block: evicts the tail
    assert taken[0] is held[2]
    assert [b.block_id for b in kv.find_longest_cache_hit(block_hashes, len(tokens) + 1)] == [held[0].block_id, held[1].block_id]


def test_unhashed_blocks_are_reused_before_any_cached_block():
    kv = KVCache(num_gpu_blocks=1 + 3, block_size=BS)
    tokens = list(range(100, 100 + 2 * BS + 1))  # two full blocks and one partial
    held = []
    assert kv.allocate(held, [], len(tokens))
    kv.cache_full_blocks(held, hashes(tokens), 0, 2)
    kv.free(held)
    taken = []
    assert kv.allocate(taken, [], 1)
    assert taken[0] is held[2] and taken[0].block_hash is None
    assert len(kv.find_longest_cache_hit(hashes(tokens), len(tokens))) == 2


def test_the_null_block_is_not_usable():
    kv = KVCache(num_gpu_blocks=5, block_size=BS)
    assert kv.num_free_blocks == 4
    held = []
    assert not kv.allocate(held, [], 5 * BS)
    assert kv.allocate(held, [], 4 * BS)
    assert kv.usage == 1.0 and 0 not in {b.block_id for b in held}


def test_a_hit_on_a_free_block_counts_against_free_capacity():
    kv = KVCache(num_gpu_blocks=1 + 2, block_size=BS)
    tokens = list(range(100, 100 + BS + 1))
    held = []
    kv.allocate(held, [], len(tokens))
    kv.cache_full_blocks(held, hashes(tokens), 0, 1)
    kv.free(held)
    hit = kv.find_longest_cache_hit(hashes(tokens), len(tokens))
    assert len(hit) == 1
    # Hit block (free, must be taken out of the queue) + 2 new blocks > 2 free blocks.
    assert kv.num_blocks_to_allocate([], hit, 3 * BS) == 3
    assert not kv.allocate([], hit, 3 * BS)


def test_generated_tokens_extend_the_cached_sequence():
    s = sched()
    prompt = list(range(100, 100 + 2 * BS - 1))
    first = req(prompt, max_tokens=BS + 2)
    run(s, first)
    # The engine computed KV for every token but the last sampled one.
    computed = first.token_ids[:-1]
    follow_up = req(first.token_ids + [5])
    run(s, follow_up)
    assert follow_up.num_cached_tokens == len(computed) // BS * BS


def test_blocks_become_hittable_as_soon_as_they_are_scheduled():
    s = sched()
    prompt = list(range(100, 100 + 3 * BS + 1))
    a, b = req(prompt, rid="a"), req(prompt, rid="b")
    s.add(a)
    s.add(b)
    s.schedule()  # both admitted in one step: b already hits what a just scheduled
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 3 * BS


def test_duplicate_blocks_keep_a_hash_hittable_when_one_copy_is_evicted():
    kv = KVCache(num_gpu_blocks=1 + 4, block_size=BS)
    tokens = list(range(100, 100 + BS + 1))
    h = hashes(tokens)
    a, b = [], []
    kv.allocate(a, [], len(tokens))
    kv.allocate(b, [], len(tokens))
    kv.cache_full_blocks(a, h, 0, 1)
    kv.cache_full_blocks(b, h, 0, 1)  # computed twice before either was looked up
    assert kv.get_cached_block(h[0]) is a[0]  # the first inserted wins lookups
    kv.free(a)
    kv.free(b)
    taken = []
    kv.allocate(taken, [], 3 * BS)  # takes 2 partial blocks, then evicts a[0]
    assert a[0] in taken
    assert kv.get_cached_block(h[0]) is b[0]


def test_the_free_queue_hands_out_blocks_in_vllms_order_though_unused_blocks_are_made_when_taken():
    """vLLM's free queue starts as every block in id order; a request's blocks are freed tail
    first, cached ones to the back, uncached ones to the front; allocation takes from the front,
    and a hit takes a free cached block out of the middle. The pool makes a block only when it is
    first taken: the blocks it hands out, and its count of free ones, are those of one queue of
    all the blocks (the model here) under random requests, hits, partial blocks and frees."""
    import random
    from collections import OrderedDict

    rng = random.Random(5)
    n = 40
    kv = KVCache(n, BS)
    model = OrderedDict((i, None) for i in range(1, n))  # the whole queue, front first
    docs = [[rng.randrange(50) for _ in range(BS * rng.randrange(1, 6))] for _ in range(6)]
    running = []
    for _ in range(400):
        if running and (rng.random() < 0.45 or kv.num_free_blocks < 8):
            held, cached = running.pop(rng.randrange(len(running)))
            kv.free(held)
            first = [b.block_id for b in reversed(held) if b.ref_cnt == 0 and b.block_hash is None]
            for b in reversed(held):
                if b.ref_cnt == 0 and b.block_hash is not None:
                    model[b.block_id] = None
            for block_id in reversed(first):
                model[block_id] = None
                model.move_to_end(block_id, last=False)
        else:
            doc = rng.choice(docs)
            extra = rng.randrange(0, 2 * BS)
            tokens = doc + [rng.randrange(50) for _ in range(extra)]
            hs = hashes(tokens)
            hit = kv.find_longest_cache_hit(hs, len(tokens))
            held: list = []
            free_hits = [b.block_id for b in hit if b.ref_cnt == 0]
            if not kv.allocate(held, hit, len(tokens)):
                continue
            for block_id in free_hits:
                del model[block_id]
            for b in held[len(hit):]:
                assert b.block_id == next(iter(model)), "a block out of vLLM's order"
                del model[b.block_id]
            kv.cache_full_blocks(held, hs, len(hit), len(tokens) // BS)
            running.append((held, None))
        assert kv.num_free_blocks == len(model)
    assert len(kv.blocks) < n or len(model) < n  # made as taken
