"""Replay summaries (``prefix_router/tools/replay/summary.py``): the token hit rate of the records,
failed requests counted and explained, percentiles."""

from __future__ import annotations

import json

import pytest

from prefix_router.tools.replay.client import replay
from prefix_router.tools.replay.generate import builtin_workload
from prefix_router.tools.replay.summary import percentile, summarize

from .test_client import sim_url  # noqa: F401 (a fixture)


async def test_summarize_computes_the_token_hit_rate_of_the_records(sim_url):
    requests = builtin_workload("agent", seed=5, sessions=2, rate=50.0, think_s=0.5, max_tokens=4)
    records = await replay(requests, sim_url, time_scale=1000)
    summary = summarize(records, time_scale=1000)
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    assert summary["requests"] == len(records) and summary["errors"] == 0
    assert (summary["prompt_tokens"], summary["cached_tokens"]) == (prompt, cached)
    assert summary["token_hit_rate"] == pytest.approx(cached / prompt)
    assert 0 < summary["token_hit_rate"] < 1
    assert summary["ttft_p50_s"] <= summary["ttft_p99_s"]


def test_summarize_counts_failed_records_as_errors_and_leaves_them_out_of_tokens():
    from prefix_router.tools.replay.client import Record

    good = Record(0, None, 0, 0.0, 0.1, 0.2, 100, 40, 5, 200, None, None)
    bad = Record(1, None, 0, 0.0, None, None, 50, 50, None, 500, "boom", None)
    summary = summarize([good, bad])
    assert summary["errors"] == 1
    assert summary["token_hit_rate"] == pytest.approx(0.4)


def test_a_summary_of_failed_requests_says_why_they_failed():
    from prefix_router.tools.replay.client import Record
    from prefix_router.tools.replay.summary import format_summary

    not_found = json.dumps({"error": {"message": "The model `gpt-4` does not exist.", "code": 404}})
    records = [Record(i, None, 0, 0.0, None, None, None, None, None, 404, not_found, None) for i in range(5)]
    records.append(Record(5, None, 0, 0.0, None, None, None, None, None, 0, "ClientConnectorError: refused", None))
    summary = summarize(records)
    assert summary["errors"] == 6
    assert summary["error_kinds"] == [[5, "HTTP 404: The model `gpt-4` does not exist."],
                                      [1, "no response: ClientConnectorError: refused"]]
    assert "5 x HTTP 404: The model `gpt-4` does not exist." in format_summary(summary)


def test_percentile_interpolates_linearly():
    values = list(range(1, 101))
    assert percentile(values, 0) == 1
    assert percentile(values, 100) == 100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(list(reversed(values)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
