"""Other projects' traffic shapes (``tools/replay/shapes.py``): the sharing between prompts that
each dataset makes, which is what routing sees, seeded, and reachable by name."""

from __future__ import annotations

import pytest

from prefix_router.prompts.tokenizer import load_tokenizer
from prefix_router.tools.replay.generate import WORKLOADS, builtin_workload
from prefix_router.tools.replay.shapes import (SHAPES, coding_agents, generated_shared_prefix, prefix_repetition,
                                               random_shared_prefix, token_text)


def test_prefix_repetition_gives_each_prefix_its_share_of_prompts_each_with_a_suffix_of_its_own():
    requests = prefix_repetition(num_prompts=50, prefixes=4, prefix_len=40, suffix_len=10, rate=4.0, seed=3)
    prompts = [r.body["prompt"] for r in requests]
    assert len(prompts) == 4 * (50 // 4)  # vLLM's prompts_per_prefix = num_requests // num_prefixes
    assert all(len(load_tokenizer(None).encode(p)) == 40 + 10 for p in prompts)
    heads = {p[:160] for p in prompts}
    assert len(heads) == 4 and all(sum(p.startswith(h) for p in prompts) == 12 for h in heads)
    assert len({p[160:] for p in prompts}) == len(prompts)
    assert [p[:160] for p in prompts] != sorted(p[:160] for p in prompts)  # shuffled, not prefix by prefix
    times = [r.at_s for r in requests]
    assert times == sorted(times) and times[0] > 0
    assert prefix_repetition(num_prompts=50, prefixes=4, prefix_len=40, suffix_len=10, rate=4.0, seed=3) == requests
    with pytest.raises(ValueError, match="at least prefixes"):
        prefix_repetition(num_prompts=3, prefixes=4)


def test_random_with_a_shared_prefix_puts_one_prefix_before_every_prompt():
    requests = random_shared_prefix(num_prompts=30, prefix_len=20, input_len=5, output_len=7)
    prompts = [r.body["prompt"] for r in requests]
    assert len(prompts) == 30 and len({p[:80] for p in prompts}) == 1 and len({p[80:] for p in prompts}) == 30
    assert all(r.body["max_tokens"] == 7 for r in requests)


def test_generated_shared_prefix_spreads_each_groups_questions_over_the_run():
    requests = generated_shared_prefix(groups=3, per_group=4, system_len=16, question_len=4)
    by_group = {}
    for position, r in enumerate(requests):
        by_group.setdefault(r.meta["group"], []).append((position, r.body["prompt"]))
    assert sorted(len(v) for v in by_group.values()) == [4, 4, 4]
    for members in by_group.values():
        assert len({p[:64] for _, p in members}) == 1
    assert [g for g in (r.meta["group"] for r in requests)] != sorted(r.meta["group"] for r in requests)


def test_coding_agents_resend_a_growing_context_that_opens_with_one_shared_system_prompt():
    requests = coding_agents(sessions=5, system_len=100, turns=(3, 4), tool_len=(20, 30), output_len=8, seed=1)
    sessions = {}
    for r in requests:
        sessions.setdefault(r.session, []).append(r)
    assert len(sessions) == 5 and all(3 <= len(turns) <= 4 for turns in sessions.values())
    assert len({r.body["messages"][0]["content"] for r in requests}) == 1
    for turns in sessions.values():
        assert [t.turn for t in turns] == list(range(len(turns)))
        for before, after in zip(turns, turns[1:]):  # the next turn carries the last one's whole context
            assert after.body["messages"][:len(before.body["messages"])] == before.body["messages"]
            assert len(after.body["messages"]) == len(before.body["messages"]) + 2 and after.think_s > 0


def test_every_shape_is_a_workload_by_name_seeded():
    assert set(SHAPES) <= set(WORKLOADS)
    for name in SHAPES:
        made = builtin_workload(name, seed=4)
        assert made and made == builtin_workload(name, seed=4) and made != builtin_workload(name, seed=5)


def test_token_text_keeps_equal_ids_equal_and_refuses_ids_past_24_bits():
    assert token_text([5, 7, 5])[:4] == token_text([5])[:4] == token_text([5, 7, 5])[8:]
    assert len({token_text([i]) for i in range(5000)}) == 5000
    with pytest.raises(ValueError):
        token_text([1 << 24])
