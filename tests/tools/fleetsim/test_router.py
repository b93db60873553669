"""The gateway's routing in virtual time (``tools/fleetsim/router.py``): its accounting comes back
to nothing when requests end, whichever policy routes (the peers' own: ``test_peers.py``)."""

from __future__ import annotations

import random

import pytest

from prefix_router.prompts.tokenizer import load_tokenizer
from prefix_router.tools.fleetsim.jobs import prompt_of
from prefix_router.tools.fleetsim.router import POLICIES, SimRouter
from prefix_router.tools.replay.request import COMPLETIONS, ReplayRequest

BLOCK = 16


def _info(rng: random.Random, shared: list[int], own_blocks: int | None = None):
    blocks = rng.randrange(1, 6) if own_blocks is None else own_blocks
    own = [rng.randrange(300, 30_000) for _ in range(blocks * BLOCK)]
    request = ReplayRequest(COMPLETIONS, {"prompt": shared + own, "max_tokens": 8})
    return prompt_of(request, load_tokenizer(None), block_size=BLOCK, char_block_size=64)[0]


@pytest.mark.parametrize("policy", POLICIES)
def test_what_a_request_counts_on_its_replica_is_taken_back_when_it_ends(policy):
    rng = random.Random(1)
    router = SimRouter([f"r{i}" for i in range(5)], policy, block_size=BLOCK, capacity=500)
    shared = [rng.randrange(300, 30_000) for _ in range(20 * BLOCK)]
    sent = []
    for t in range(60):
        sent.append(router.send(_info(rng, shared), None, float(t)))
        if rng.random() < 0.3:
            router.first_token(sent[rng.randrange(len(sent))])
        if t % 17 == 0:
            r = router.replicas[f"r{t % 5}"]
            router.scraped(r, 1, r.inflight)
    assert sum(r.inflight for r in router.replicas.values()) == 60
    for s in sent:
        router.finished(s, 40, 60.0)
    for r in router.replicas.values():
        assert (r.inflight, r.prefill_blocks, r.sent_since_scrape) == (0, 0, 0)
    assert sum(router.sent_to.values()) == 60
