"""The demo's report (``prefix_router/tools/demo_report.py``) from made-up replays: replicas named
``replica-i`` in launch order with their URLs kept, TTFT from the replicas' modelled times, and a
verdict whose ratios are the side-by-side table's, each direction in words, a TTFT called faster or
slower only where the percentile's confidence ranges do not overlap."""

from __future__ import annotations

import random
import re
import statistics

import pytest

from prefix_router.tools.demo_report import PolicyRun, percentile_range, replica_names, report, verdict
from prefix_router.tools.replay.client import Record

URLS = ["http://127.0.0.1:41007", "http://127.0.0.1:33001", "http://127.0.0.1:52113"]


def _record(i: int, replica: str, prompt: int, cached: int, wall_s: float, modelled_s: float) -> Record:
    return Record(i, None, 0, 0.0, wall_s, wall_s * 2, prompt, cached, 4, 200, None, replica, wall_s / 2, modelled_s)


def _metrics(results: dict[str, dict[str, int]]) -> str:
    """A gateway /metrics page: per replica (gateway name), requests by cache result."""
    lines = ["# TYPE prefix_router_cache_requests counter"]
    lines += [f'prefix_router_cache_requests_total{{replica="{name}",result="{result}"}} {n}'
              for name, counts in results.items() for result, n in counts.items()]
    return "\n".join(lines) + "\n"


def _run(policy: str, records: list[Record], results: dict[str, dict[str, int]]) -> PolicyRun:
    return PolicyRun(policy, URLS, records, _metrics(results), [], 12.0)


def _runs() -> tuple[PolicyRun, PolicyRun]:
    a = [_record(0, "127.0.0.1:33001", 1000, 800, 0.9, 0.10), _record(1, "127.0.0.1:33001", 1000, 900, 0.1, 0.20),
         _record(2, "127.0.0.1:41007", 2000, 1500, 0.5, 0.30), _record(3, "127.0.0.1:41007", 500, 0, 0.2, 2.00)]
    b = [_record(0, "127.0.0.1:41007", 1000, 0, 0.3, 0.40), _record(1, "127.0.0.1:33001", 1000, 600, 0.3, 0.50),
         _record(2, "127.0.0.1:52113", 2000, 1000, 0.3, 0.60), _record(3, "127.0.0.1:41007", 500, 0, 0.3, 1.00)]
    hits = {"127.0.0.1:33001": {"hit": 2}, "127.0.0.1:41007": {"hit": 1, "miss_cold": 1}}
    return (_run("prefix-affinity", a, hits),
            _run("round-robin", b, {"127.0.0.1:41007": {"miss_cold": 1, "miss_routed": 1},
                                    "127.0.0.1:33001": {"hit": 1}, "127.0.0.1:52113": {"miss_routed": 1}}))


def _row(text: str, row: str) -> str:
    return next(line for line in text.split("side by side", 1)[1].splitlines() if line.startswith(row))


def _ratio_column(text: str, row: str) -> str:
    return _row(text, row).split()[-1]


def test_replicas_are_named_in_launch_order_and_keep_their_urls():
    assert replica_names(URLS) == {"127.0.0.1:41007": "replica-0", "127.0.0.1:33001": "replica-1",
                                   "127.0.0.1:52113": "replica-2"}
    text, figures = report(list(_runs()), "title")
    for policy, rows in figures["per_replica"].items():
        assert [r["replica"] for r in rows] == ["replica-0", "replica-1", "replica-2", "total"]
        assert [r.get("url") for r in rows] == [*URLS, None]
    a = {r["replica"]: r for r in figures["per_replica"]["prefix-affinity"]}
    assert (a["replica-0"]["requests"], a["replica-1"]["requests"], a["replica-2"]["requests"]) == (2, 2, 0)
    assert (a["replica-0"]["hit"], a["replica-0"]["miss_cold"], a["replica-1"]["hit"]) == (1, 1, 2)
    assert "127.0.0.1" not in text
    tables = [line.split()[0] for line in text.splitlines() if line.startswith("replica-")]
    assert tables == ["replica-0", "replica-1", "replica-2"] * 2


def test_ttft_is_the_replicas_modelled_time_and_the_clients_wall_clock_only_for_real_vllm():
    runs = list(_runs())
    text, figures = report(runs, "title")
    total = figures["per_replica"]["prefix-affinity"][-1]
    modelled = [r.replica_modelled_ttft_s for r in runs[0].records]
    assert total["ttft_p50_s"] == pytest.approx(statistics.median(modelled))
    assert figures["ttft"] == "TTFT (modelled)" and "TTFT (modelled) p50" in text
    # with 4 requests the median's 95% range is order statistics 1 to 4: their fastest and slowest
    assert _row(text, "TTFT (modelled) p50").split()[5:9] == ["250", "ms", "(100-2000)", "550"]
    _, wall = report(runs, "title", modelled=False)
    assert wall["per_replica"]["prefix-affinity"][-1]["ttft_p50_s"] == pytest.approx(
        statistics.median(r.ttft_s for r in runs[0].records))
    assert wall["ttft"] == "TTFT (wall clock)"


def test_the_verdict_gives_the_side_by_side_ratios_with_their_directions_in_words():
    runs = _runs()
    text, figures = report(list(runs), "title")
    line = figures["verdict"]
    found = re.fullmatch(r"verdict: prefix-affinity reused (\S+) the tokens of round-robin \((\w+)\), computed (\S+) "
                         r"the prefill tokens \((\w+)\); TTFT \(modelled\) p50 (\S+) \(([\w ]+)\), p99 (\S+) \(([\w ]+)\)",
                         line)
    assert found, line
    reused, more, prefill, fewer, p50, p50_word, p99, p99_word = found.groups()
    # the table's ratio column, and the records' own figures
    assert reused == _ratio_column(text, "reused tokens")
    assert prefill == _ratio_column(text, "prefill tokens computed")
    assert (p50, p99) == (_ratio_column(text, "TTFT (modelled) p50"), _ratio_column(text, "TTFT (modelled) p99"))
    a, b = runs[0].records, runs[1].records
    assert reused == f"{sum(r.cached_tokens for r in a) / sum(r.cached_tokens for r in b):.2f}x"
    computed = [sum(r.prompt_tokens - r.cached_tokens for r in rs) for rs in (a, b)]
    assert prefill == f"{computed[0] / computed[1]:.2f}x"
    median = [statistics.median(r.replica_modelled_ttft_s for r in rs) for rs in (a, b)]
    assert p50 == f"{median[0] / median[1]:.2f}x"
    assert (more, fewer) == ("more", "fewer")
    # four requests a policy: each percentile's range spans most of them, and they overlap
    assert (p50_word, p99_word) == ("no clear difference", "no clear difference")


def _totals(p50_a: tuple[float, float], p50_b: tuple[float, float]) -> dict[str, dict]:
    row = {"reused_tokens": 1000, "hit_rate": 0.5, "prompt_tokens": 2000, "ttft_p99_s": 1.0, "ttft_p99_range_s": (0.9, 1.1)}
    return {"prefix-affinity": {**row, "ttft_p50_s": sum(p50_a) / 2, "ttft_p50_range_s": p50_a},
            "round-robin": {**row, "ttft_p50_s": sum(p50_b) / 2, "ttft_p50_range_s": p50_b}}


def test_a_ttft_is_faster_or_slower_only_where_the_ranges_do_not_overlap():
    assert "p50 0.50x (faster), p99 1.00x (no clear difference)" in verdict(_totals((0.04, 0.06), (0.09, 0.11)))
    assert "p50 2.00x (slower)" in verdict(_totals((0.09, 0.11), (0.04, 0.06)))
    assert "p50 0.83x (no clear difference)" in verdict(_totals((0.04, 0.06), (0.05, 0.07)))


def test_the_percentile_range_covers_the_true_percentile_about_95_times_in_100():
    rng = random.Random(7)
    for q in (50, 99):
        trials = [percentile_range([rng.random() for _ in range(317)], q) for _ in range(400)]
        covered = sum(lo <= q / 100 <= hi for lo, hi in trials) / len(trials)  # uniform on [0, 1): p_q = q / 100
        assert 0.9 <= covered <= 1.0, (q, covered)
        assert all(lo <= hi for lo, hi in trials)
    assert percentile_range([], 50) is None and percentile_range([3.0], 99) == (3.0, 3.0)


def test_the_verdict_says_so_when_a_token_ratio_reads_1_00x():
    totals = {"prefix-affinity": {"reused_tokens": 1000, "hit_rate": 0.5, "prompt_tokens": 2000, "ttft_p50_s": 0.1,
                                  "ttft_p99_s": None, "ttft_p50_range_s": (0.1, 0.1), "ttft_p99_range_s": None},
              "round-robin": {"reused_tokens": 1001, "hit_rate": 0.5, "prompt_tokens": 2000, "ttft_p50_s": 0.1,
                              "ttft_p99_s": 0.2, "ttft_p50_range_s": (0.1, 0.1), "ttft_p99_range_s": (0.2, 0.2)}}
    line = verdict(totals)
    assert "reused 1.00x the tokens of round-robin (about the same)" in line
    assert "p50 1.00x (no clear difference), p99 - (not measured)" in line
