"""``python -m bench overhead``: its options name the systems and drivers of the six scripts it
replaced, and a short run of each driver fills its tables (processes on loopback, ~1 minute)."""

from __future__ import annotations

import json
import shutil

import pytest

from bench import ROOT
from bench.commands import overhead
from bench.hop import sustained
from bench.systems import Peer, Picker


def _labels(argv: list[str], driver: str) -> list[str]:
    args = overhead.parse_args(argv)
    return [e.label for e in overhead.entries(overhead.names(args, driver), args.trees, ROOT, args.workers
                                              if driver == "wrk" else 0, args.envoy)]


def test_each_driver_defaults_to_the_systems_the_readme_quotes():
    assert _labels(["--drivers", "rates"], "rates") == ["prefix-router", "aiohttp floor", "vllm-router consistent_hash"]
    assert _labels(["--drivers", "rates"], "wrk") == [
        "prefix-router", "prefix-router, first turns only", "prefix-router, no tokenizer", "aiohttp floor",
        "vllm-router consistent_hash"]
    assert _labels(["--drivers", "rates", "--workers", "2"], "wrk")[-2:] == [
        "prefix-router --workers 1, unpinned", "prefix-router --workers 2, unpinned"]


def test_trees_are_labelled_and_each_gets_its_gateway_rows(tmp_path):
    argv = ["--drivers", "rates", "--tree", f"before={tmp_path}", "--tree", ".", "--systems",
            "gateway,no-tokenizer,epp-duplex,sglang-router cache_aware"]
    args = overhead.parse_args(argv)
    assert [(g.name, g.tree) for g in args.trees] == [("before", tmp_path), ("prefix-router", ROOT)]
    rows = overhead.entries(overhead.names(args, "rates"), args.trees, tmp_path / "tok", 0, args.envoy)
    assert [r.label for r in rows] == ["before", "prefix-router", "before, no tokenizer", "prefix-router, no tokenizer",
                                       "epp + envoy, duplex", "sglang-router cache_aware"]
    assert "--tokenizer" in rows[0].system.args and "--tokenizer" not in rows[2].system.args
    assert isinstance(rows[4].system, Picker) and rows[4].system.mode == "duplex"
    assert isinstance(rows[5].system, Peer)
    # the ratios of an A/B of trees divide by the first tree
    assert overhead.base_of([r.label for r in rows], args.trees) == "before"


def test_unknown_systems_and_drivers_are_refused_before_anything_runs():
    with pytest.raises(SystemExit):
        overhead.parse_args(["--drivers", "rates", "--systems", "gateway,nginx"])
    with pytest.raises(SystemExit):
        overhead.parse_args(["--drivers", "rates,ab"])


def test_the_sustained_rate_is_the_highest_before_the_first_that_fails_the_bar():
    rows = [{"system": "s", "rate": r, "errors": 0, "added_ttft_p99_ms": p99}
            for r, p99 in ((25, 2.0), (50, 12.0), (100, 3.0))]
    assert sustained(rows, [25, 50, 100]) == {"s": 25}  # 100/s passes, but after 50/s failed
    assert sustained([{**rows[0], "errors": 1}], [25]) == {"s": None}


def test_a_short_run_of_every_driver_fills_its_tables(tmp_path):
    drivers = "rates,decision,profile" + (",wrk" if shutil.which("wrk") else "")
    out = tmp_path / "out"
    argv = ["--drivers", drivers, "--systems", "gateway,floor", "--rates", "40", "--seconds", "1", "--reps", "1",
            "--wrk-seconds", "1", "--bodies", "256", "--profile-rate", "40", "--profile-seconds", "2",
            "--out", str(out)]
    assert overhead.main(argv) == 0
    results = json.loads((out / "results.json").read_text())["results"]
    assert [r["system"] for r in results["rates"]] == ["prefix-router", "aiohttp floor"]
    assert all(r["errors"] == 0 and r["requests"] == 40 for r in results["rates"])
    # /proc counts in 10 ms ticks: 40 requests of ~2 ms each through this gateway cannot read 0
    assert results["rates"][0]["cpu_ms"] > 0
    assert results["decision"][0]["routing_p50_ms"] > 0
    assert results["profile"][0]["cpu_ms"] > 0 and 0 < sum(results["profile"][0]["shares"].values())
    if "wrk" in drivers:
        assert [r["system"] for r in results["wrk"]] == ["prefix-router", "aiohttp floor"]
        assert all(r["requests"] > 0 and r["cpu_ms"] > 0 for r in results["wrk"])
    readme = (out / "README.md").read_text()
    assert readme.startswith("# The cost of the hop\n") and "- Command: `python -m bench overhead --drivers" in readme
    assert "| CPU ms a request, ~1,000 tokens | prefix-router | aiohttp floor |" in readme
    assert "### Where the CPU goes" in readme and "### The routing decision in-process" in readme
