"""``bench.overhead_wrk`` reads wrk's own report: requests, rate and the latency p50, not its mean."""

from __future__ import annotations

import pytest

from bench.overhead_wrk import parse_wrk

# wrk 4.1 (Debian's package) with --latency, against a local server
REPORT = """Running 1s test @ http://127.0.0.1:8765/
  1 threads and 2 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.43ms    1.18ms  13.14ms   89.31%
    Req/Sec     1.41k   242.38     1.72k    50.00%
  Latency Distribution
     50%    1.06ms
     75%    1.56ms
     90%    2.73ms
     99%    5.99ms
  1407 requests in 1.01s, 5.91MB read
Requests/sec:   1399.48
Transfer/sec:      5.88MB
"""


def test_the_report_gives_requests_rate_and_the_median_latency():
    assert parse_wrk(REPORT) == (1407, 1399.48, "1.06ms")  # the median, not the 1.43 ms mean


@pytest.mark.parametrize("extra", ["  Non-2xx or 3xx responses: 12\n", "  Socket errors: connect 0, read 3, write 0, timeout 0\n"])
def test_a_run_with_failed_requests_is_refused(extra):
    with pytest.raises(ValueError, match="no clean run"):
        parse_wrk(REPORT.replace("Requests/sec:", extra + "Requests/sec:"))


def test_output_without_a_latency_distribution_is_refused():
    with pytest.raises(ValueError):
        parse_wrk(REPORT.split("  Latency Distribution")[0])


def test_staggered_bodies_keep_each_conversations_turns_in_order_and_open_one_in_four():
    from bench.gateway_overhead import staggered

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
    from bench.gateway_overhead import chat_mix, conversations

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
