"""``bench.workloads``: the hop's conversations keep their size and order, in both orders."""

from __future__ import annotations

import pytest

from bench.workloads import chat_mix, conversations, staggered


def test_staggered_bodies_keep_each_conversations_turns_in_order_and_open_one_in_four():
    count, turns, window = 500, 4, 64
    pairs = staggered(count, turns, window)
    assert sorted(pairs) == [(c, t) for c in range(count) for t in range(turns)]  # each body once
    at = {pair: i for i, pair in enumerate(pairs)}
    assert all(at[c, t - 1] < at[c, t] for c in range(count) for t in range(1, turns))
    assert min(at[c, t] - at[c, t - 1] for c in range(count) for t in range(1, turns)) >= window - 1
    # slots where every turn has a conversation to take it: past the start, before they run out
    steady = [(c, t) for c, t in pairs if (turns - 1) * window <= c + t * window < count]
    assert sum(t == 0 for _, t in steady) / len(steady) == pytest.approx(1 / turns, abs=0.01)


def test_the_fixed_rate_chat_mix_keeps_its_prompts_near_the_size_however_many_are_sent():
    def words(messages):
        return sum(len(m["content"].split()) for m in messages)

    for count in (64, 1200, 2400):
        mix = chat_mix(1000, count)
        assert len(mix) == count
        # each conversation's first turn is the only body with one user message
        opening = [words(m) for m in mix if len(m) == 2]
        assert max(words(m) for m in mix) <= 1.25 * sum(opening) / len(opening)
        assert sum(len(m) == 2 for m in mix) == pytest.approx(count / 4, abs=1)
        # a later turn extends its conversation's previous one, sent before it
        seen = set()
        for m in mix:
            if len(m) > 2:
                assert repr(m[:-2]) in seen, "a turn sent before the one it extends"
            seen.add(repr(m))
        # past the first and last few windows, one body in four opens a conversation
        if count >= 1200:
            steady = mix[64:-64]
            assert sum(len(m) == 2 for m in steady) / len(steady) == pytest.approx(0.25, abs=0.02)
    # what the fixed-rate benchmarks sent before: 16 conversations a turn each in turn, so the
    # 2,400 bodies of 200/s for 12 s end ~6x longer than they start
    old = conversations(1000, 16, 2400 // 16)
    assert words(old[-1]) > 5 * words(old[0])


def test_first_turns_first_sends_the_same_bodies_with_every_opening_ahead():
    mix, first = chat_mix(1000, 400), chat_mix(1000, 400, first_turns_first=True)
    assert sorted(map(repr, mix)) == sorted(map(repr, first))  # the same bodies
    assert all(len(m) == 2 for m in first[:100]) and all(len(m) > 2 for m in first[100:])



def test_a_vllm_bench_shape_becomes_the_request_list_of_its_dataset():
    from bench.workloads import VllmBenchShape, vllm_bench_requests

    rep = vllm_bench_requests(VllmBenchShape("r", "prefix_repetition", False, 50, 4.0, prefixes=5, prefix_len=40,
                                             suffix_len=10, output_len=3))
    assert len(rep) == 50 and len({r.body["prompt"][:160] for r in rep}) == 5
    assert all(len(r.body["prompt"]) == 200 and r.body["max_tokens"] == 3 for r in rep)
    one = vllm_bench_requests(VllmBenchShape("r", "random", False, 20, 4.0, prefixes=1, prefix_len=40, suffix_len=10))
    assert len(one) == 20 and len({r.body["prompt"][:160] for r in one}) == 1
