"""The peers' policies in the fleet simulator (``tools/fleetsim/peers.py``): consistent hashing
keeps its load bound; SGLang's cache_aware follows its tree, the smallest tree, or the least
loaded worker, as ``sgl-router/src/policies/cache_aware.rs`` does."""

from __future__ import annotations

import random

from prefix_router.tools.fleetsim.router import SimRouter

from .test_router import BLOCK, _info


def test_consistent_hashing_sends_one_prefix_to_one_replica_until_the_load_bound_then_spills():
    rng = random.Random(2)
    names = [f"r{i}" for i in range(8)]
    router = SimRouter(names, "consistent-hash", block_size=BLOCK, capacity=500)
    shared = [rng.randrange(300, 30_000) for _ in range(20 * BLOCK)]  # every request's first 256 tokens alike
    first = router.send(_info(rng, shared), None, 0.0)
    router.finished(first, 1, 0.0)
    held = []
    for t in range(40):
        s = router.send(_info(rng, shared), None, float(t))
        held.append(s)
        loads = [r.inflight for r in router.replicas.values()]
        total = sum(loads)
        assert max(loads) <= -(-1.25 * total // len(names)) + 1  # the bound, counting the request just sent
    owner = first.replica.name
    loads = {n: r.inflight for n, r in router.replicas.items()}
    assert held[0].replica.name == owner and loads[owner] == max(loads.values()) == -(-1.25 * 40 // len(names))
    assert len({s.replica.name for s in held}) > 4  # spilled along the ring


def _cache_aware(n: int = 4, **kw) -> SimRouter:
    router = SimRouter([f"r{i}" for i in range(n)], "sglang-cache-aware", block_size=BLOCK, capacity=500)
    for key, value in kw.items():
        setattr(router.policy, key, value)
    return router


def test_cache_aware_sends_a_prompt_to_the_tree_holding_most_of_it_and_a_new_one_to_the_smallest_tree():
    rng = random.Random(3)
    router = _cache_aware()
    trees = router.policy.trees
    shared = [rng.randrange(300, 30_000) for _ in range(8 * BLOCK)]
    first = router.send(_info(rng, shared, 2), None, 0.0)  # 10 blocks, 8 of them shared
    assert len(trees[first.replica.name]) == 10
    again = router.send(_info(rng, shared, 2), None, 1.0)  # 8 of 10 matched: over 0.3
    assert again.replica is first.replica
    sizes = {n: len(t) for n, t in trees.items()}
    new = router.send(_info(rng, [], 3), None, 2.0)  # nothing matched anywhere
    assert new.replica.name == min(sizes, key=sizes.get) and new.replica is not first.replica
    short = router.send(_info(rng, shared[: 2 * BLOCK], 8), None, 3.0)  # 2 of 10 blocks held: under 0.3
    assert short.replica is not first.replica


def test_cache_aware_sends_to_the_least_loaded_worker_when_loads_are_imbalanced_and_its_tree_learns_it():
    rng = random.Random(4)
    router = _cache_aware(balance_abs_threshold=3, balance_rel_threshold=1.5)
    shared = [rng.randrange(300, 30_000) for _ in range(8 * BLOCK)]
    sent = [router.send(_info(rng, shared, 1), None, float(t)) for t in range(4)]
    owner = sent[0].replica
    assert all(s.replica is owner for s in sent)  # balanced until one worker has 4 more than another
    spilled = router.send(_info(rng, shared, 1), None, 5.0)
    assert spilled.replica is not owner and spilled.replica.inflight == 1
    assert router.policy.trees[spilled.replica.name].match(spilled.info.hashes) == len(spilled.info.hashes)


def test_cache_aware_trees_never_learn_of_the_engines_evictions():
    rng = random.Random(5)
    router = _cache_aware(n=2)
    shared = [rng.randrange(300, 30_000) for _ in range(8 * BLOCK)]
    first = router.send(_info(rng, shared, 1), None, 0.0)
    router.finished(first, 1, 0.0)
    for t in range(400):  # 2,000 blocks, four times what the two replicas hold, to the smallest trees
        router.finished(router.send(_info(rng, [], 5), None, float(t)), 1, float(t))
    assert first.replica.shadow.match(first.info.hashes) == 0  # the gateway's own guess evicted it
    assert router.send(_info(rng, shared, 1), None, 500.0).replica is first.replica  # SGLang's tree did not


def test_cache_aware_spreads_prompts_past_a_prefix_every_tree_holds_as_a_tree_of_characters_does():
    rng = random.Random(6)
    router = _cache_aware()
    shared = [rng.randrange(300, 30_000) for _ in range(8 * BLOCK)]
    held = _info(rng, shared, 0).hashes
    for tree in router.policy.trees.values():
        tree.insert(held)
    chosen = [router.send(_info(rng, shared, 2), None, float(t)).replica.name for t in range(40)]
    assert len(set(chosen)) == 4  # each to the worker its own continuation names, not all to one
    prompt = _info(rng, shared, 2).hashes
    assert router.policy._tie(prompt, 8, list(router.policy.trees)) == router.policy._tie(prompt, 8, list(reversed(router.policy.trees)))


def test_vllm_routers_consistent_hash_keeps_a_session_on_one_replica_and_scatters_prompts_without_one():
    rng = random.Random(7)
    router = SimRouter([f"r{i}" for i in range(8)], "vllm-router-consistent-hash", block_size=BLOCK, capacity=500)
    shared = [rng.randrange(300, 30_000) for _ in range(8 * BLOCK)]
    session = {router.send(_info(rng, shared), "conversation-1", float(t)).replica.name for t in range(12)}
    assert len(session) == 1 and router.replicas[session.pop()].inflight == 12  # no load bound
    alone = {router.send(_info(rng, shared), None, float(t)).replica.name for t in range(40)}
    assert len(alone) >= 5  # one shared prefix, yet placed by the whole prompt's hash


def test_dynamos_cost_goes_to_the_holder_until_its_queue_costs_more_than_the_blocks_it_saves():
    rng = random.Random(9)
    router = SimRouter([f"r{i}" for i in range(4)], "dynamo-kv", block_size=BLOCK, capacity=5000)
    shared = [rng.randrange(300, 30_000) for _ in range(40 * BLOCK)]  # 40 blocks, then one of each prompt's own
    first = router.send(_info(rng, shared, 1), None, 0.0)
    router.first_token(first)
    router.finished(first, 1, 0.1)
    holder = first.replica.name
    assert router.active[holder] == 0 and router.send(_info(rng, shared, 1), None, 1.0).replica.name == holder
    # one request of 41 blocks active on the holder: there, at least 1 x (0 + 41 - 40) + 41 + 41 = 83;
    # anywhere else 1 x 41 + 0 + 41 = 82: a request in flight outweighs 40 blocks held, and it moves
    assert router.send(_info(rng, shared, 1), None, 2.0).replica.name != holder
    assert router.policy.weight == 1.0
