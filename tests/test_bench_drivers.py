"""``bench.drivers``: wrk's own report read for requests, rate and the latency p50 (not its mean), and
the bodies its Lua script sends."""

from __future__ import annotations

import pytest

import json

from bench.drivers import parse_wrk, wrk_script

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


def test_the_wrk_script_sends_each_body_in_order_as_a_streaming_chat(tmp_path):
    script = wrk_script([[{"role": "user", "content": "one"}], [{"role": "user", "content": "two"}]], tmp_path, "b")
    bodies = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [b["messages"][0]["content"] for b in bodies] == ["one", "two"]
    assert all(b["stream"] and b["max_tokens"] == 8 for b in bodies)
    assert str(tmp_path / "b.jsonl") in script.read_text()
