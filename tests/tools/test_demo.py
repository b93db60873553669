"""``prefix-router demo`` end to end: 4 simulated replicas, two gateways, the report's figures.

Runs the demo as a user would (its own processes), on the first 150 requests of the built-in
mixed workload to stay under half a minute, and checks that the report adds up and that prefix
affinity reuses more than round-robin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


from prefix_router.misses.diagnosis import Cause

from ..helpers import mooncake_trace

MISSES = ("miss_cold", "miss_changed", "miss_routed", "miss_evicted")


def test_demo_reports_consistent_figures_and_affinity_beats_round_robin(tmp_path):
    out = tmp_path / "demo.json"
    scratch = tmp_path / "tmp"  # the demo's temporary folders go here: none may be left behind
    scratch.mkdir()
    proc = subprocess.run([sys.executable, "-m", "prefix_router.cli", "demo", "--limit", "150", "--json", str(out),
                           "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TMPDIR": str(scratch)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(scratch.iterdir())
    assert "[prefix-affinity] 150/150 requests" in proc.stderr  # progress while it runs
    for heading in ("prefix-affinity", "round-robin", "side by side", "where clients changed their prefix"):
        assert heading in proc.stdout
    sites = proc.stdout.split("where clients changed their prefix", 1)[1]
    assert any(f"{cause.value} at " in sites for cause in Cause) and "fix: " in sites  # each site says why
    figures = json.loads(out.read_text())
    totals = {}
    for policy, rows in figures["per_replica"].items():
        *replicas, total = rows
        assert len(replicas) == 4 and total["replica"] == "total"
        assert total["requests"] == 150
        for key in ("requests", "prompt_tokens", "reused_tokens", "hit", *MISSES):
            assert total[key] == sum(r[key] for r in replicas), (policy, key)
        assert total["hit"] + sum(total[k] for k in MISSES) == total["requests"]  # every request classified
        assert all(r["ttft_p50_s"] <= r["ttft_p99_s"] for r in replicas if r["requests"])
        totals[policy] = total
    affinity, rr = totals["prefix-affinity"], totals["round-robin"]
    assert affinity["prompt_tokens"] == rr["prompt_tokens"]  # the same workload
    assert affinity["reused_tokens"] > rr["reused_tokens"]
    assert affinity["miss_routed"] < rr["miss_routed"]
    assert affinity["miss_changed"] > 0  # the workload's cache-breaking clients are reported
    assert figures["change_sites"] and {site["message_index"] for site in figures["change_sites"]} & {-1, 0}


def test_demo_replays_a_mooncake_trace_without_errors(tmp_path):
    trace = mooncake_trace(tmp_path)  # the shared trace, or one in its format in a clone without it
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "prefix_router.cli", "demo", "--trace", str(trace), "--limit", "40",
                           "--replicas", "2", "--json", str(out), "--cache-dir", str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]  # token ids the replicas accept
    for rows in json.loads(out.read_text())["per_replica"].values():
        assert rows[-1]["requests"] == 40 and rows[-1]["prompt_tokens"] > 0
