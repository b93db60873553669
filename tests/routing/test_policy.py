"""The prefix-affinity policy (``prefix_router/routing/policy.py``), pure: rings, branch statistics
and shadow indexes built by hand. The baselines: ``test_baselines.py``."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from prefix_router.cache.blocks import BlockHash
from prefix_router.config import RoutingConfig
from prefix_router.cache.shadow import ShadowIndex
from prefix_router.routing.prefix_stats import BranchStats
from prefix_router.routing.bounds import load_bound
from prefix_router.routing.bounds import ReplicaView
from prefix_router.routing.decision import Route
from prefix_router.routing.policy import PrefixAffinityPolicy
from prefix_router.routing.ring import Ring

NAMES = [f"replica-{i}:8000" for i in range(4)]
_fresh = itertools.count(10_000)


# The ring with bounded loads on its own: new work off (match_threshold 0), so a prompt nobody
# holds goes by its key, as it does for several instances without KV events
RING_ONLY = RoutingConfig(match_threshold=0.0)


def fresh(n: int) -> list[BlockHash]:
    return [BlockHash(next(_fresh)) for _ in range(n)]


def setup(config: RoutingConfig | None = None, names=NAMES):
    config = config or RoutingConfig()
    ring = Ring(config.virtual_nodes)
    for name in names:
        ring.add(name)
    branches = BranchStats(config.branch_threshold)
    policy = PrefixAffinityPolicy(config, ring, branches)
    views = {n: ReplicaView(n, 0, ShadowIndex(10_000)) for n in names}
    return policy, ring, branches, views


def select(policy, hashes, views, **kw):
    return policy.select(hashes, full_hash=int(hashes[-1]) ^ 0xABC if hashes else 1, replicas=views, **kw)


def wanted(policy, hashes, times=1):
    """Record ``times`` requests for ``hashes`` in the policy's demand, as the proxy does."""
    for _ in range(times):
        policy.demand.record(hashes, len(hashes), now=0.0)


def retry_order(policy, hashes, views):
    """The replicas in the order a request failing everywhere tries them: the proxy asks the
    policy again after each failure, without the replicas tried (prefix_router/serve/forward.py)."""
    order = []
    while len(order) < len(views):
        order.append(select(policy, hashes, {n: v for n, v in views.items() if n not in order}).replica)
    return order


def assert_retries_reach_every_replica(policy, hashes, decision, views):
    order = retry_order(policy, hashes, views)
    assert order[0] == decision.replica
    assert sorted(order) == sorted(views)


# --- affinity ------------------------------------------------------------------------------

def test_an_idle_fleet_sends_each_prompt_to_the_ring_owner_of_its_key():
    policy, ring, _, views = setup(RING_ONLY)
    owners = Counter()
    for _ in range(200):
        hashes = fresh(6)
        d = select(policy, hashes, views)
        assert d.route is Route.AFFINITY
        assert d.replica == ring.owner(d.key)
        assert retry_order(policy, hashes, views) == ring.candidates(d.key)  # retries walk the ring
        assert d.key_depth == 1  # nothing learned: the first block keys the prompt
        assert d.spilled_from is None
        owners[d.replica] += 1
    assert set(owners) == set(NAMES)


def test_prompts_sharing_the_key_blocks_share_a_replica_and_the_rest_does_not_matter():
    policy, _, _, views = setup()
    for _ in range(50):
        head = fresh(1)
        a = select(policy, head + fresh(5), views)
        b = select(policy, head + fresh(9), views)
        assert a.key == b.key and a.replica == b.replica


def _owner_and_views(config, owner_load, other_load):
    policy, ring, _, views = setup(config)
    hashes = fresh(4)
    owner = select(policy, hashes, views).replica
    for name, view in views.items():
        view.load = owner_load if name == owner else other_load
    return policy, ring, views, hashes, owner


def test_an_owner_over_the_bound_spills_to_the_next_ring_candidate():
    config = RoutingConfig(load_factor=1.25, load_slack=1, match_threshold=0.0)
    # owner 5, others 2: mean 12 / 4 = 3, ceil(max(3.75, 4)) = 4, and 5 + 1 > 4
    policy, ring, views, hashes, owner = _owner_and_views(config, owner_load=5, other_load=2)
    d = select(policy, hashes, views)
    assert d.route is Route.SPILL
    assert d.spilled_from == owner
    assert d.replica == ring.candidates(d.key)[1]
    assert_retries_reach_every_replica(policy, hashes, d, views)


def test_an_owner_at_the_bound_keeps_the_request():
    config = RoutingConfig(load_factor=1.25, load_slack=1, match_threshold=0.0)
    # owner 3, others 2: mean 10 / 4 = 2.5, ceil(max(3.125, 3.5)) = 4, and 3 + 1 <= 4
    policy, _, views, hashes, owner = _owner_and_views(config, owner_load=3, other_load=2)
    d = select(policy, hashes, views)
    assert d.replica == owner and d.route is Route.AFFINITY and d.spilled_from is None


def test_the_spill_walks_the_ring_past_every_replica_over_the_bound():
    policy, ring, _, views = setup(RoutingConfig(load_factor=1.0, load_slack=0, match_threshold=0.0))
    hashes = fresh(4)
    order = ring.candidates(select(policy, hashes, views).key)
    for name, load in zip(order, [3, 3, 1, 1]):  # ceil(9 / 4) = 3: the first two are full
        views[name].load = load
    d = select(policy, hashes, views)
    assert d.replica == order[2] and d.route is Route.SPILL and d.spilled_from == order[0]


def test_a_spill_goes_to_the_fitting_replica_holding_most_of_the_prompt_not_just_the_next_one():
    policy, ring, _, views = setup(RoutingConfig(load_factor=1.0, load_slack=0, match_threshold=0.0))
    hashes = fresh(6)
    order = ring.candidates(select(policy, hashes, views).key)
    views[order[0]].shadow.insert(hashes)  # the owner holds it all but is full
    views[order[0]].load = 2  # ceil(3 / 4) = 1: only idle replicas fit
    views[order[3]].shadow.insert(hashes[:4])  # an earlier spill computed most of it there
    views[order[2]].shadow.insert(hashes[:1])
    wanted(policy, hashes)  # every recent request wanted this prompt: hot, no holder's leave
    d = select(policy, hashes, views)
    assert d.replica == order[3] and d.route is Route.SPILL and d.spilled_from == order[0]
    assert d.predicted_blocks == 4 and d.best_blocks == 6 and d.best_replica == order[0]
    views[order[3]].load = 1  # that one busy too: ceil(4 / 4) = 1, so the next best
    assert select(policy, hashes, views).replica == order[2]


def test_a_hot_prefix_concentrates_on_its_holder_until_the_bound_then_spreads_along_the_ring():
    policy, ring, _, views = setup()
    doc = fresh(20)  # one document, many questions about it
    placed = []
    for _ in range(40):  # all in flight at once: nothing finishes
        hashes = doc + fresh(2)
        d = select(policy, hashes, views)
        views[d.replica].shadow.insert(hashes)
        views[d.replica].load += 1
        wanted(policy, hashes)
        placed.append(d.replica)
    loads = sorted(v.load for v in views.values())
    # The bound holds every replica within ceil(max(1.25 x 10, 10 + 1)) = 13 at the end.
    assert loads[-1] <= load_bound(40 - 1, 4, 1.25, 1)
    # The first holder took a second request (mean 0.5: ceil(max(0.625, 1.5)) = 2), not a third
    # (mean 0.75: ceil(1.75) = 2); later requests joined whichever holders had room.
    assert placed[0] == placed[1] != placed[2]
    assert len(set(placed)) == len(NAMES)


def test_documents_each_wanted_by_a_few_requests_stay_on_one_holder_each_past_the_bound():
    # SGLang's generated-shared-prefix shape: 8 documents, questions about each in turn, all in
    # flight. Each document draws 1/8 of the demand, and 1/8 x 4 replicas <= 1 holder: cold, so
    # its holder keeps its questions past the bound (up to the holder bound) instead of
    # computing the document a second time elsewhere. The documents are placed by the ring
    # (new work off), which gives some replicas more of them than others.
    policy, _, _, views = setup(RING_ONLY)
    docs = [[BlockHash(100 * d + i) for i in range(20)] for d in range(8)]  # fixed: the ring's spread is known
    holders = {d: set() for d in range(8)}
    for q in range(64):
        d = q % 8
        hashes = docs[d] + [BlockHash(5_000 + q)]
        decision = select(policy, hashes, views)
        views[decision.replica].shadow.insert(hashes)
        views[decision.replica].load += 1
        wanted(policy, hashes)
        holders[d].add(decision.replica)
    assert all(len(h) == 1 for h in holders.values()), holders
    loads = sorted(v.load for v in views.values())
    assert loads[-1] > load_bound(63, 4, 1.25, 1)  # the plain bound would have replicated
    defaults = RoutingConfig()
    assert loads[-1] <= load_bound(63, 4, defaults.holder_load_factor, defaults.holder_slack)


def test_documents_nobody_holds_are_new_work_and_spread_evenly_before_their_questions_follow():
    # The same 8 documents with new work on (the default): the first question of each finds
    # nothing anywhere, so it goes to the least loaded replica (none has prompt queued for
    # prefill here; the fewest blocks among equals), not the ring owner of its key; each replica
    # gets two documents (2 x 21 blocks), and every later question follows its document's one
    # holder, so the loads come out equal: 64 / 4 = 16 each.
    policy, _, _, views = setup()
    docs = [[BlockHash(100 * d + i) for i in range(20)] for d in range(8)]
    holders = {d: set() for d in range(8)}
    for q in range(64):
        d = q % 8
        hashes = docs[d] + [BlockHash(5_000 + q)]
        decision = select(policy, hashes, views)
        assert (decision.route is Route.BALANCE) is (q < 8), (q, decision)
        views[decision.replica].shadow.insert(hashes)
        views[decision.replica].load += 1
        wanted(policy, hashes)
        holders[d].add(decision.replica)
    assert all(len(h) == 1 for h in holders.values()), holders
    assert Counter(next(iter(h)) for h in holders.values()) == {name: 2 for name in NAMES}
    assert sorted(v.load for v in views.values()) == [16] * 4


# --- the longest cached prefix --------------------------------------------------------------

def test_a_replica_holding_more_of_the_prompt_wins_over_the_owner_as_sticky():
    policy, ring, _, views = setup()
    hashes = fresh(8)
    owner = select(policy, hashes, views).replica
    holder = next(n for n in ring.candidates(select(policy, hashes, views).key) if n != owner)
    views[holder].shadow.insert(hashes[:5])
    d = select(policy, hashes, views)
    assert d.route is Route.STICKY and d.replica == holder
    assert d.predicted_blocks == 5 and d.best_replica == holder and d.best_blocks == 5
    assert d.matches[owner] == 0
    assert d.spilled_from is None
    assert_retries_reach_every_replica(policy, hashes, d, views)


def test_history_on_the_owner_itself_is_plain_affinity():
    policy, _, _, views = setup()
    hashes = fresh(8)
    owner = select(policy, hashes, views).replica
    views[owner].shadow.insert(hashes)
    d = select(policy, hashes, views)
    assert d.replica == owner and d.route is Route.AFFINITY and d.predicted_blocks == len(hashes)


def _holder_of_history(policy, views, hashes, hot: bool):
    owner = select(policy, hashes, views).replica
    holder = next(n for n in NAMES if n != owner)
    views[holder].shadow.insert(hashes)
    wanted(policy, hashes)  # this conversation's earlier turn: all of the demand for its history...
    if not hot:  # ...unless three other conversations sent as much meanwhile
        for _ in range(3):
            wanted(policy, fresh(8))
    return owner, holder


def test_a_replica_holding_a_hot_history_but_over_the_bound_is_skipped():
    policy, _, _, views = setup()
    hashes = fresh(8)
    owner, holder = _holder_of_history(policy, views, hashes, hot=True)
    # share 1 x 4 replicas > 1 holder: hot. Others idle: mean 3 / 4, ceil(max(0.9375, 1.75)) = 2,
    # and 2 + 1 > 2
    views[holder].load = 2
    d = select(policy, hashes, views)
    assert d.replica == owner and d.route is Route.SPILL and d.spilled_from == holder
    assert d.best_replica == holder and d.best_blocks == len(hashes)  # still reported, for miss classes


@pytest.mark.parametrize("case, load, others, keeps", [
    # share 1/4 x 4 replicas <= 1 holder: cold. The bound is (1.25, slack 1); the holder bound
    # (2, slack 4)
    # mean 3 / 4: bound ceil(max(0.9375, 1.75)) = 2, and 2 + 1 > 2; holder ceil(max(1.5, 4.75)) = 5
    ("over the bound at low load, within the holder bound", 2, 0, True),
    # mean 4 / 4: holder ceil(max(2, 5)) = 5 and 3 + 1 <= 5. With a slack of 2 (ceil(max(2, 3))
    # = 3) the fourth question on a nearly idle fleet recomputed the document elsewhere, though
    # vLLM runs all four in one batch: 7-8 documents a run on vLLM's prefix_repetition (8
    # replicas), a point of token hit rate
    ("three in flight on a nearly idle fleet", 3, 0, True),
    # mean 11 / 4: bound ceil(max(3.4375, 3.75)) = 4, 4 + 1 > 4; holder ceil(max(5.5, 6.75)) = 7
    ("over the bound at load, within the holder bound", 4, 2, True),
    # mean 7 / 4: holder ceil(max(3.5, 5.75)) = 6, and 6 + 1 > 6
    ("past the holder bound", 6, 0, False),
    # mean 17 / 4: holder ceil(max(8.5, 8.25)) = 9, and 10 + 1 > 9: at load the factor binds
    ("past the holder bound at load", 10, 2, False),
])
def test_a_replica_holding_a_cold_history_keeps_it_past_the_bound_up_to_the_holder_bound(case, load, others, keeps):
    policy, _, _, views = setup()
    hashes = fresh(8)
    owner, holder = _holder_of_history(policy, views, hashes, hot=False)
    for name in NAMES:
        views[name].load = load if name == holder else others
    d = select(policy, hashes, views)
    assert (d.replica == holder) is keeps, case
    assert d.route is (Route.STICKY if keeps else Route.SPILL)


def test_a_shared_system_prompt_held_by_every_idle_replica_leaves_the_choice_to_the_ring():
    policy, ring, _, views = setup()
    system = fresh(5)
    for view in views.values():
        view.shadow.insert(system)
    placed = Counter()
    for i in range(200):
        hashes = system + fresh(3)
        d = select(policy, hashes, views, session_key=f"conversation-{i}")
        assert d.replica == ring.owner(d.key) and d.route is Route.AFFINITY  # a tie: the key decides
        placed[d.replica] += 1
    assert set(placed) == set(NAMES) and max(placed.values()) < 2 * 200 / len(NAMES), placed


# (case, sole_router, engine views, the session key (None: a request naming no conversation),
#  blocks of the 8-block prompt each replica in ring order holds, loads in flight, recent
#  shares, the replica chosen by ring position, route).
# Loads sum to at most 3: mean (3 + 1) / 4 = 1, the bound ceil(max(1.25 x 1, 1 + 1)) = 2, so a
# replica with 1 in flight fits and none here is over it; shares sum to at most 6: mean 1.75,
# the share bound ceil(max(2.19, 2.75)) = 3, and a share of 2 fits.
EQUAL_HOLDER_CASES = [
    ("the only router sends a prefix every replica holds to the least loaded holder",
     True, False, None, [5, 5, 5, 5], [1, 1, 0, 1], [0, 0, 0, 0], 2, Route.BALANCE),
    ("between equal loads the holder sent the fewest requests lately takes it",
     True, False, None, [5, 5, 5, 5], [0, 0, 0, 0], [2, 1, 2, 1], 1, Route.BALANCE),
    ("with equal loads and shares the ring decides, where every instance would send it",
     True, False, None, [5, 5, 5, 5], [0, 0, 0, 0], [0, 0, 0, 0], 0, Route.AFFINITY),
    ("the least loaded owner among the holders is plain affinity",
     True, False, None, [5, 5, 5, 5], [0, 1, 1, 1], [0, 0, 0, 0], 0, Route.AFFINITY),
    ("only replicas holding the most are compared: a less loaded one holding less loses",
     True, False, None, [5, 5, 6, 6], [0, 0, 1, 1], [0, 0, 0, 0], 2, Route.STICKY),
    ("one of several instances without KV events leaves equal holders to the ring",
     False, False, None, [5, 5, 5, 5], [1, 1, 0, 1], [0, 0, 0, 0], 0, Route.AFFINITY),
    ("several instances reading every engine's own events tell equal holders apart by load",
     False, True, None, [5, 5, 5, 5], [1, 1, 0, 1], [0, 0, 0, 0], 2, Route.BALANCE),
    ("replicas holding nothing are left to the ring, whatever their loads",
     True, False, None, [0, 0, 0, 0], [1, 1, 0, 1], [0, 0, 0, 0], 0, Route.AFFINITY),
    ("a conversation's first turn goes to the least loaded holder, not its key's owner",
     True, False, "conversation-7", [5, 5, 5, 5], [1, 1, 0, 1], [0, 0, 0, 0], 2, Route.BALANCE),
    ("a conversation's first turn goes to its key's owner where instances have no common picture",
     False, False, "conversation-7", [5, 5, 5, 5], [1, 1, 0, 1], [0, 0, 0, 0], 0, Route.AFFINITY),
]


@pytest.mark.parametrize("case, sole, engine, session, held, loads, shares, expected, route", EQUAL_HOLDER_CASES,
                         ids=[c[0] for c in EQUAL_HOLDER_CASES])
def test_replicas_holding_equal_parts_of_the_prompt(case, sole, engine, session, held, loads, shares, expected,
                                                    route):
    # match_threshold 0: no new work, so the tie-break is all that decides
    policy, ring, _, views = setup(RoutingConfig(sole_router=sole, match_threshold=0.0))
    prompt = fresh(8)
    order = ring.candidates(select(policy, prompt, views, session_key=session).key)
    for name, blocks, load, share in zip(order, held, loads, shares):
        views[name] = ReplicaView(name, load, ShadowIndex(10_000), recent=share, engine=engine)
        views[name].shadow.insert(prompt[:blocks])
    d = select(policy, prompt, views, session_key=session)
    assert d.replica == order[expected], (case, d)
    assert d.route is route, (case, d)


def test_a_replica_that_alone_holds_more_of_a_shared_prefix_does_not_take_everything():
    # The first replica to compute a system prompt holds it alone for a while; the bound
    # keeps that from sending it every new conversation.
    policy, _, _, views = setup()
    system = fresh(5)
    first = NAMES[1]
    views[first].shadow.insert(system)
    placed = Counter()
    for i in range(40):
        hashes = system + fresh(3)
        d = select(policy, hashes, views, session_key=f"c{i}")
        views[d.replica].shadow.insert(hashes)
        views[d.replica].load += 1
        wanted(policy, hashes)
        placed[d.replica] += 1
    assert set(placed) == set(NAMES)
    assert max(placed.values()) <= load_bound(39, 4, 1.25, 1)


def test_without_a_session_key_the_branch_key_spreads_conversations_that_share_a_system_prompt():
    config = RoutingConfig(branch_threshold=3)
    policy, ring, branches, views = setup(config)
    system = fresh(6)
    for view in views.values():
        view.shadow.insert(system)  # a tie everywhere: the key decides
    placed = Counter()
    for _ in range(80):
        hashes = system + fresh(4)
        d = select(policy, hashes, views)
        branches.record(hashes, config.max_key_blocks)
        placed[d.replica] += 1
    assert len(placed) == len(NAMES), placed
    assert d.key_depth == len(system) + 1  # keyed past the shared prompt, by the conversation's first block


def test_every_turn_of_a_conversation_follows_its_history_when_the_fleet_is_idle():
    policy, _, _, views = setup()
    system = fresh(4)
    for view in views.values():
        view.shadow.insert(system)
    prompt = system + fresh(2)
    first = select(policy, prompt, views).replica
    for _ in range(6):
        views[first].shadow.insert(prompt)
        prompt = prompt + fresh(3)  # a new turn appends: only the replica that served the last holds it
        d = select(policy, prompt, views)
        assert d.replica == first and d.predicted_blocks == len(prompt) - 3


# --- session keys, caps, candidates ----------------------------------------------------------

def test_an_explicit_session_key_overrides_the_block_key():
    policy, _, _, views = setup()
    differs = 0
    for s in range(30):
        first, second = fresh(6), fresh(6)
        a = select(policy, first, views, session_key=f"session-{s}")
        b = select(policy, second, views, session_key=f"session-{s}")
        assert a.replica == b.replica and a.key == b.key
        differs += select(policy, first, views).replica != select(policy, second, views).replica
    assert differs > 0  # without the session key these prompt pairs would have been split


def test_different_session_keys_spread_over_the_replicas():
    policy, _, _, views = setup()
    hashes = fresh(6)
    placed = {select(policy, hashes, views, session_key=f"s{i}").replica for i in range(100)}
    assert placed == set(NAMES)


def test_predicted_blocks_are_capped_by_max_hit_blocks():
    policy, _, _, views = setup()
    hashes = fresh(10)
    owner = select(policy, hashes, views).replica
    views[owner].shadow.insert(hashes)
    cap = len(hashes) - 3
    d = select(policy, hashes, views, max_hit_blocks=cap)
    assert d.replica == owner
    assert d.predicted_blocks == cap and d.best_blocks == cap
    assert max(d.matches.values()) == cap


def test_retries_asked_without_the_replicas_tried_reach_every_replica_once():
    policy, _, _, views = setup()
    for i in range(100):
        for j, view in enumerate(views.values()):
            view.load = (i * 7 + j * 3) % 6  # a mix of idle and overloaded replicas
        hashes = fresh(5)
        assert_retries_reach_every_replica(policy, hashes, select(policy, hashes, views), views)


def test_only_the_given_healthy_replicas_are_candidates():
    policy, _, _, views = setup()
    healthy = dict(list(views.items())[:2])
    for _ in range(50):
        d = select(policy, fresh(4), healthy)
        assert d.replica in healthy


# --- the share bound: requests sent one at a time ---------------------------------------------

def _send(policy, views, name, hashes):
    views[name].recent += 1  # no decay within a test: every request counts 1
    wanted(policy, hashes)


def test_requests_sent_one_at_a_time_spread_a_shared_system_prompt_over_every_replica():
    # Nothing is ever in flight, so only the share bound can act: the replica that computed the
    # system prompt first may not take every new conversation that shares it.
    policy, _, _, views = setup()
    system = fresh(5)
    placed = Counter()
    for i in range(40):
        hashes = system + fresh(3)
        d = select(policy, hashes, views, session_key=f"c{i}")
        views[d.replica].shadow.insert(hashes)
        _send(policy, views, d.replica, hashes)
        placed[d.replica] += 1
    # without the share bound the first holder takes all 40; with it, once every replica holds
    # the system prompt, the keys' owners take the conversations (as uneven as 40 keys hash)
    assert set(placed) == set(NAMES)
    assert max(placed.values()) <= 40 / 2, placed


def test_a_lone_conversation_stays_with_its_history_on_the_keys_owner_whatever_its_share():
    policy, _, _, views = setup()
    prompt = fresh(4)
    first = select(policy, prompt, views, session_key="only").replica
    for _ in range(10):
        views[first].shadow.insert(prompt)
        _send(policy, views, first, prompt)
        prompt = prompt + fresh(2)
        d = select(policy, prompt, views, session_key="only")
        assert d.replica == first and d.route is Route.AFFINITY


@pytest.mark.parametrize("hot, holder_share, keeps", [
    # hot, the share bound (1.25, slack 1): shares 4, 1, 1, 1: ceil(max(1.25 x 8 / 4, 8 / 4 + 1)) = 3
    (True, 4, False),
    (True, 1, True),  # shares 1, 1, 1, 1: ceil(max(1.5625, 2.25)) = 3, and 1 + 1 <= 3
    # cold, the holder's share bound (1.5, slack 4): shares 6, 1, 1, 1: ceil(max(3.75, 6.5)) = 7
    # takes 6; shares 7, 1, 1, 1: ceil(max(4.125, 6.75)) = 7, not 7 + 1; shares 9, 1, 1, 1:
    # ceil(max(4.875, 7.25)) = 8
    (False, 6, True),
    (False, 7, False),
    (False, 9, False),
])
def test_a_replica_holding_the_history_but_over_its_share_loses_to_the_owner(hot, holder_share, keeps):
    policy, _, _, views = setup()
    hashes = fresh(8)
    owner, holder = _holder_of_history(policy, views, hashes, hot=hot)
    for name in NAMES:
        views[name].recent = holder_share if name == holder else 1
    d = select(policy, hashes, views)
    if keeps:
        assert d.replica == holder and d.route is Route.STICKY
    else:
        assert d.replica == owner and d.route is Route.SPILL and d.spilled_from == holder


@pytest.mark.parametrize("case, hot, load, keeps", [
    # shares 9, 1, 1, 1 are past the holder's share bound, ceil(max(1.5 x 13 / 4, 13 / 4 + 4)) = 8
    # idle: only the share counts say how busy the holder is, and they turn it away
    ("a cold history on an idle fleet", False, 0, False),
    # five in flight everywhere: mean 21 / 4, 0.25 x 5.25 >= 1, so the in-flight counts decide:
    # the bound ceil(max(6.5625, 6.25)) = 7 takes the holder's sixth; no share bound for the holder
    ("a cold history with five in flight everywhere", False, 5, True),
    # a hot prefix has no holder's leave: the plain share bound still turns the holder away
    ("a hot history with five in flight everywhere", True, 5, False),
])
def test_once_requests_are_in_flight_everywhere_a_cold_holder_answers_to_the_in_flight_bound_not_its_share(
        case, hot, load, keeps):
    policy, _, _, views = setup()
    hashes = fresh(8)
    owner, holder = _holder_of_history(policy, views, hashes, hot=hot)
    for name in NAMES:
        views[name].recent = 9 if name == holder else 1
        views[name].load = load
    d = select(policy, hashes, views)
    assert d.replica == (holder if keeps else owner), (case, d)  # the owner is exempt from the share bound
    assert d.route is (Route.STICKY if keeps else Route.SPILL), case


@pytest.mark.parametrize("case, sole_router, hot, keeps", [
    # shares 9, 1, 1, 1 on an idle fleet: past the holder's share bound, ceil(max(1.5 x 13 / 4,
    # 13 / 4 + 4)) = 8, which turns the only router's holder away (the case above)
    ("the only router counts every request: the share bound turns the holder away", True, False, False),
    # one of several instances counts its own part: the holder answers to the in-flight holder
    # bound alone, ceil(max(2 x 1 / 4, 1 / 4 + 4)) = 5, and 0 + 1 <= 5
    ("one of several instances keeps a cold history on its holder", False, False, True),
    # a hot prefix has no holder's leave, whoever counts
    ("one of several instances still spreads a hot prefix", False, True, False),
])
def test_one_of_several_instances_does_not_judge_a_holder_by_its_own_share_counts(case, sole_router, hot, keeps):
    policy, _, _, views = setup(RoutingConfig(sole_router=sole_router))
    hashes = fresh(8)
    owner, holder = _holder_of_history(policy, views, hashes, hot=hot)
    for name in NAMES:
        views[name].recent = 9 if name == holder else 1
    d = select(policy, hashes, views)
    assert d.replica == (holder if keeps else owner), (case, d)
    assert d.route is (Route.STICKY if keeps else Route.SPILL), case


# --- new work: a prompt mostly new everywhere -----------------------------------------------

# (case, blocks of the 10-block prompt each replica holds, blocks each holds in all, loads,
#  match_threshold, the replica chosen by index or "owner" for the key's ring owner, route).
# The threshold is worked out in the prompt's blocks: 0.5 x 10 = 5, so a replica holding 4
# leading blocks holds "a little" and one holding 5 holds enough to follow. Loads: 4 replicas,
# 2 or 3 in flight, the bound ceil(max(1.25 x 4 / 4, 4 / 4 + 1)) = 2 (3 / 4 + 1 rounds up to 2
# as well), so a replica with 2 in flight is over it.
NEW_WORK_CASES = [
    ("a prompt of which the best holder has under half goes to the idle replica holding the fewest blocks",
     [0, 4, 0, 0], [50, 40, 5, 30], [0, 0, 0, 0], 0.5, 2, Route.BALANCE),
    ("a prompt of which a replica holds half follows that replica",
     [0, 5, 0, 0], [50, 40, 5, 30], [0, 0, 0, 0], 0.5, 1, None),
    ("a prompt nobody holds any of is new work too, for the idle replica holding the fewest blocks",
     [0, 0, 0, 0], [50, 40, 5, 30], [0, 0, 0, 0], 0.5, 2, Route.BALANCE),
    ("a threshold of 0 sends a prompt nobody holds any of to the ring owner of its key",
     [0, 0, 0, 0], [50, 40, 5, 30], [0, 0, 0, 0], 0.0, "owner", Route.AFFINITY),
    ("a threshold of 0 turns new work off and the little that is held is followed",
     [0, 4, 0, 0], [50, 40, 5, 30], [0, 0, 0, 0], 0.0, 1, None),
    ("the replica holding the fewest blocks is passed over while it is over the load bound, for "
     "the least loaded of the others",
     [0, 4, 0, 0], [50, 40, 5, 30], [0, 0, 2, 1], 0.5, 1, Route.BALANCE),
    # loads 0, 1, 1, 1: the bound is 2, so every replica may take it; the idle one starts its
    # prefill at once, however many blocks it holds
    ("the least loaded replica within the bound takes new work before one holding fewer blocks",
     [0, 4, 0, 0], [50, 40, 5, 30], [0, 1, 1, 1], 0.5, 0, Route.BALANCE),
    ("between equally loaded replicas the one holding the fewest blocks takes new work",
     [0, 4, 0, 0], [50, 40, 5, 30], [1, 0, 1, 0], 0.5, 3, Route.BALANCE),
]


@pytest.mark.parametrize("case, held, sizes, loads, threshold, expected, route", NEW_WORK_CASES,
                         ids=[c[0] for c in NEW_WORK_CASES])
def test_new_work(case, held, sizes, loads, threshold, expected, route):
    policy, ring, _, views = setup(RoutingConfig(match_threshold=threshold))
    prompt = fresh(10)
    for view, h, size, load in zip(views.values(), held, sizes, loads):
        view.shadow.insert(prompt[:h] + fresh(size - h))
        view.load = load
    d = select(policy, prompt, views, session_key="new", first_turn=True)
    want = ring.owner(d.key) if expected == "owner" else NAMES[expected]
    assert d.replica == want
    if route is not None:
        assert d.route is route
    else:  # followed the holder: sticky, or affinity where the holder is the key's owner
        assert d.route in (Route.STICKY, Route.AFFINITY)
    assert d.best_blocks == max(held) and d.predicted_blocks == held[NAMES.index(want)]


# (case, loads, prompt blocks queued for prefill, the replica expected): the same prompt as above,
# of which replica 1 holds 4 of 10 blocks (new work at a threshold of 0.5); loads summing to 3
# make the bound ceil(max(1.25 x 4 / 4, 4 / 4 + 1)) = 2, so a replica at load 2 is over it
PREFILL_CASES = [
    ("the replica with the least prompt queued for prefill takes new work before a less loaded one",
     [1, 0, 1, 1], [0, 9, 20, 3], 0),
    ("between replicas with equal prompt queued for prefill the least loaded takes new work",
     [1, 1, 0, 1], [0, 0, 0, 5], 2),
    ("a replica with nothing queued for prefill is passed over while it is over the load bound",
     [2, 0, 0, 1], [0, 9, 20, 3], 3),
]


@pytest.mark.parametrize("case, loads, prefills, expected", PREFILL_CASES, ids=[c[0] for c in PREFILL_CASES])
def test_new_work_goes_where_the_least_prompt_is_queued_for_prefill(case, loads, prefills, expected):
    policy, _, _, views = setup(RoutingConfig(match_threshold=0.5))
    prompt = fresh(10)
    for view, held, load, prefill in zip(views.values(), [0, 4, 0, 0], loads, prefills):
        view.shadow.insert(prompt[:held] + fresh(20))
        view.load, view.prefill = load, prefill
    d = select(policy, prompt, views, session_key="new", first_turn=True)
    assert (d.replica, d.route) == (NAMES[expected], Route.BALANCE)


@pytest.mark.parametrize("case, sole, engine_views, balances", [
    ("the only router places a prompt nobody holds as new work", True, [False] * 4, True),
    ("one of several instances sends a prompt nobody holds to the ring owner, as every instance would",
     False, [False] * 4, False),
    ("one of several instances keeps it on the ring even when every replica's picture is its engine's",
     False, [True] * 4, False),
    ("the only router balances it whatever its pictures", True, [True, True, True, False], True),
])
def test_a_prompt_nobody_holds(case, sole, engine_views, balances):
    policy, ring, _, views = setup(RoutingConfig(sole_router=sole))
    for i, (view, engine) in enumerate(zip(views.values(), engine_views)):
        view.shadow.insert(fresh(10 + 10 * i))  # the ring owner is rarely the one holding the fewest
        view.engine = engine
    for i in range(20):
        d = select(policy, fresh(10), views, session_key=f"s{i}", first_turn=True)
        if balances:
            assert d.route is Route.BALANCE and d.replica == NAMES[0], (case, d)
        else:
            assert d.route is Route.AFFINITY and d.replica == ring.owner(d.key), (case, d)


def test_replicas_holding_equally_few_blocks_take_new_work_in_the_ring_order_of_its_key():
    policy, ring, _, views = setup()
    base = fresh(2)
    for view in views.values():
        view.shadow.insert(fresh(20))
    views[NAMES[0]].shadow.insert(base)  # 22 blocks: not among the fewest
    for i in range(20):
        d = select(policy, base + fresh(8), views, session_key=f"c{i}", first_turn=True)
        order = [n for n in ring.candidates(d.key) if n != NAMES[0]]
        assert d.route is Route.BALANCE and d.replica == order[0]


def test_new_conversations_on_a_shared_base_spread_one_a_replica_and_their_later_turns_stay():
    # Four system prompts share a base of 4 blocks and differ in the 6 after it: the first
    # conversation computes the base on one replica, and every later one would follow it there
    # if a holder of 4 of 10 blocks were worth following. New work spreads them instead, and
    # each then keeps its replica as its history grows.
    policy, _, _, views = setup()
    base = fresh(4)
    conversations = {f"c{i}": base + fresh(6) for i in range(4)}
    homes = {}
    for name, prompt in conversations.items():
        d = select(policy, prompt, views, session_key=name, first_turn=True)
        views[d.replica].shadow.insert(prompt)
        _send(policy, views, d.replica, prompt)
        homes[name] = d.replica
    assert sorted(homes.values()) == sorted(NAMES), homes
    for turn in range(3):
        for name in conversations:
            conversations[name] = prompt = conversations[name] + fresh(3)
            d = select(policy, prompt, views, session_key=name, first_turn=False)
            assert d.replica == homes[name] and d.route is not Route.BALANCE, (turn, name, d)
            views[d.replica].shadow.insert(prompt)
            _send(policy, views, d.replica, prompt)


def test_a_later_turn_that_adds_more_than_its_history_stays_with_its_history():
    # 10 blocks of history on one replica and a turn that adds 12 (a long tool output): the
    # holder has under half of the prompt, but moving the turn would recompute the history
    policy, _, _, views = setup()
    history = fresh(10)
    home = NAMES[2]
    views[home].shadow.insert(history + fresh(30))  # the home replica holds the most blocks too
    d = select(policy, history + fresh(12), views, session_key="s", first_turn=False)
    assert d.replica == home and d.route is not Route.BALANCE and d.predicted_blocks == 10


@pytest.mark.parametrize("case, shared, held, balances", [
    # a completion has no turns to read: only a match within the prefix that many prompts share
    # (its last block seen followed by branch_threshold = 4 different blocks) is new work
    ("a completion whose holder has only the shared prefix is new work", True, 4, True),
    ("a completion whose holder has more than the shared prefix follows it", True, 5, False),
    ("a completion before any prefix is known to be shared follows its holder", False, 4, False),
])
def test_new_work_for_completions(case, shared, held, balances):
    policy, _, branches, views = setup()
    prefix = fresh(4)
    if shared:
        for _ in range(4):
            branches.record(prefix + fresh(2), 6)
    prompt = prefix + fresh(12)  # 16 blocks: under half is under 8, so the threshold never decides
    views[NAMES[1]].shadow.insert(prompt[:held] + fresh(40))
    d = select(policy, prompt, views)
    assert (d.route is Route.BALANCE) is balances
    assert (d.replica == NAMES[1]) is not balances


# (case, replicas sharing the prefix in ring order of the request's key (True: holds it), share
# of recent requests through the prefix, the chosen replica by ring position). Four replicas; the
# 6-block prefix is shared (followed by 4 different blocks: BranchStats), the prompt is 8 blocks.
# Loads 1, 1, 1, 0 in ring order (total 3: mean (3 + 1) / 4 = 1, bound ceil(max(1.25, 2)) = 2),
# so every replica fits and the least loaded is the last. A prefix is hot, to be replicated, when
# its holders cannot serve its demand at their fair share: share x 4 > holders.
REPLICATE_CASES = [
    ("a prefix every request wants and three of four replicas hold counts for nothing: the idle "
     "replica without it takes the request", [True, True, True, False], 1.0, 3),
    ("a prefix half the requests want is replicated from its one holder: 0.5 x 4 = 2 > 1",
     [True, False, False, False], 0.5, 3),
    ("a prefix a quarter of the requests want stays with its one holder: 0.25 x 4 = 1, not over 1",
     [True, False, False, False], 0.25, 0),
    ("a prefix half the requests want and two replicas hold stays with them: 0.5 x 4 = 2, not over 2",
     [True, True, False, False], 0.5, 0),
]


@pytest.mark.parametrize("case, holds, share, expected", REPLICATE_CASES, ids=[c[0] for c in REPLICATE_CASES])
def test_a_shared_prefix_whose_demand_wants_another_holder(case, holds, share, expected):
    policy, ring, branches, views = setup(RoutingConfig(match_threshold=0.0))
    prefix = fresh(6)
    for _ in range(4):
        branches.record(prefix + fresh(2), 8)
    prompt = prefix + fresh(2)
    wanted(policy, prompt, times=round(share * 8))
    wanted(policy, fresh(8), times=round((1 - share) * 8))
    order = ring.candidates(select(policy, prompt, views).key)
    for name, held, load in zip(order, holds, [1, 1, 1, 0]):
        views[name].load = load
        if held:
            views[name].shadow.insert(prefix)
    d = select(policy, prompt, views)
    assert d.replica == order[expected], (case, d)
    assert d.best_blocks == 6 and d.predicted_blocks == (6 if holds[expected] else 0)


@pytest.mark.parametrize("case, holds, share, expected", REPLICATE_CASES[2:], ids=[c[0] for c in REPLICATE_CASES[2:]])
def test_an_exact_tie_of_demand_and_holders_reads_the_same_however_the_requests_were_spaced(case, holds, share, expected):
    """The ties of ``REPLICATE_CASES`` with shares that never decay (as several instances are
    tested, tests/fleet/test_discovery.py), the other requests first and the prefix's over the next
    seconds: later requests weigh a hair more (2 ** (dt / 1e9)), which must not make the prefix
    hot where the same requests at one moment left it cold."""
    policy, ring, branches, views = setup(RoutingConfig(match_threshold=0.0, share_half_life_s=1e9))
    prefix = fresh(6)
    for _ in range(4):
        branches.record(prefix + fresh(2), 8)
    prompt = prefix + fresh(2)
    others = round((1 - share) * 8)
    for t in range(8):
        policy.demand.record(fresh(8) if t < others else prompt, 8, now=float(t))
    assert policy.demand.share(prompt[5]) * len(views) > sum(holds)  # the noise the tie must survive
    order = ring.candidates(select(policy, prompt, views).key)
    for name, held, load in zip(order, holds, [1, 1, 1, 0]):
        views[name].load = load
        if held:
            views[name].shadow.insert(prefix)
    assert select(policy, prompt, views).replica == order[expected], case


def _replicate_setup(sole_router=True):
    """Four replicas, three holding a 6-block prefix that every recent request wanted and that 4
    different blocks followed (shared); loads 1, 1, 1, 0 in ring order of the prompt's key."""
    policy, ring, branches, views = setup(RoutingConfig(match_threshold=0.0, sole_router=sole_router))
    prefix = fresh(6)
    for _ in range(4):
        branches.record(prefix + fresh(2), 8)
    wanted(policy, prefix, times=8)
    return policy, ring, views, prefix


def test_a_conversations_history_past_the_shared_prefix_draws_its_later_turns_whatever_its_share():
    policy, ring, views, prefix = _replicate_setup()
    prompt = prefix + fresh(6)  # the history of one conversation, then its new turn
    wanted(policy, prompt[:10], times=8)  # half the recent requests were its turns: 0.5 x 4 > 1
    order = ring.candidates(select(policy, prompt, views, session_key="c").key)
    for name, load in zip(order, [1, 1, 1, 0]):
        views[name].load = load
    views[order[0]].shadow.insert(prefix)
    views[order[1]].shadow.insert(prefix)
    views[order[2]].shadow.insert(prompt[:10])  # the history: 4 blocks past the shared prefix
    d = select(policy, prompt, views, session_key="c")
    assert d.replica == order[2] and d.predicted_blocks == 10, d


def test_one_of_several_instances_without_events_leaves_a_prefix_to_replicate_to_the_ring():
    # several instances read pictures of their own: a holder outranks the idle replica, as before
    policy, ring, views, prefix = _replicate_setup(sole_router=False)
    prompt = prefix + fresh(2)
    order = ring.candidates(select(policy, prompt, views).key)
    for name, load in zip(order, [1, 1, 1, 0]):
        views[name].load = load
    for name in order[:3]:
        views[name].shadow.insert(prefix)
    assert select(policy, prompt, views).replica == order[0]


def test_a_routable_replica_the_ring_does_not_list_yet_is_no_crash_and_not_chosen():
    """The ring follows the fleet every half scrape interval (``Gateway.sync_ring``), the
    routable set at every request: a replica whose breaker just turned half-open can be routable
    and off the ring, holding the most of the prompt."""
    policy, ring, _, views = setup(RING_ONLY)
    off = NAMES[-1]
    ring.remove(off)
    hashes = fresh(6)
    views[off].shadow.insert(hashes)
    d = select(policy, hashes, views)
    assert d.replica != off and d.replica in ring and d.best_replica != off


# --- the holder's queue (prefill_queue_weight) --------------------------------------------------

# (case, weight, the holder's prefill queue, the others', their loads, whether the holder keeps it):
# the holder has 16 of the prompt's 20 blocks, so it computes 4 and any other replica 20; it is
# passed over where 4 + weight x its queue is more than 20 + weight x another's within the bound
QUEUE_CASES = [
    ("a holder 300 blocks of prefill deeper than a replica with none is passed over", 0.1, 300, [0, 50, 100],
     [0, 0, 0], False),
    ("a holder 100 blocks deeper keeps the prompt: recomputing 16 blocks weighs more", 0.1, 100, [0, 50, 100],
     [0, 0, 0], True),
    ("an exact tie of the estimates keeps the holder", 0.1, 160, [0, 50, 100], [0, 0, 0], True),
    ("a weight of 0 keeps the holder however deep its queue", 0.0, 10_000, [0, 0, 0], [0, 0, 0], True),
    ("replicas past the load bound are not where it goes, however short their queue", 0.1, 300, [0, 0, 0],
     [5, 5, 5], True),  # 15 in flight: the bound is ceil(max(1.25 x 16 / 4, 16 / 4 + 1)) = 5
]


@pytest.mark.parametrize("case, weight, queued, others, loads, keeps", QUEUE_CASES, ids=[c[0] for c in QUEUE_CASES])
def test_a_holder_with_a_deep_prefill_queue(case, weight, queued, others, loads, keeps):
    policy, _, _, views = setup(RoutingConfig(prefill_queue_weight=weight))
    hashes = fresh(20)
    holder = select(policy, hashes, views).replica
    views[holder].shadow.insert(hashes[:16])
    views[holder].prefill = queued
    rest = [n for n in NAMES if n != holder]
    for name, prefill, load in zip(rest, others, loads):
        views[name].prefill, views[name].load = prefill, load
    d = select(policy, hashes, views)
    if keeps:
        assert d.replica == holder and d.route is not Route.SPILL
    else:  # the replica that would start it soonest: the least queued of the others
        assert d.replica == rest[others.index(min(others))]
        assert d.route is Route.SPILL and d.spilled_from == holder and d.predicted_blocks == 0


@pytest.mark.parametrize("queued, expected", [(100, 0), (1_000, 1)])
def test_between_equal_holders_the_queue_decides_only_once_the_chosen_one_is_passed_over(queued, expected):
    """Between replicas holding equal parts the tie rule decides (load, then recent share), not
    the queues, which keeps sessions on one system prompt balanced; once the chosen one's queue
    scores worse than a replica holding nothing, the least score takes it: the other holder."""
    policy, _, _, views = setup(RoutingConfig(prefill_queue_weight=0.1))
    hashes = fresh(20)
    for name in NAMES[:2]:
        views[name].shadow.insert(hashes[:16])
    views[NAMES[1]].load = 1  # the tie goes to the first by load
    views[NAMES[0]].prefill = queued  # 4 + 10 or 4 + 100 against 20 elsewhere and 4 on the other holder
    d = select(policy, hashes, views)
    assert d.replica == NAMES[expected] and d.predicted_blocks == 16


def test_replicas_scoring_alike_once_the_holder_is_passed_over_go_to_the_one_holding_most():
    policy, _, _, views = setup(RoutingConfig(prefill_queue_weight=0.1))
    hashes = fresh(20)
    holder, partial, empty, busy = NAMES
    views[holder].shadow.insert(hashes[:16])
    views[holder].prefill = 1_000  # 4 + 100
    views[partial].shadow.insert(hashes[:8])
    views[partial].prefill = 80  # 12 + 8 = 20, as the replica holding nothing and queueing nothing
    views[busy].prefill = 500  # 20 + 50
    d = select(policy, hashes, views)
    assert d.replica == partial and d.predicted_blocks == 8 and d.spilled_from == holder
