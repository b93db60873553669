"""``prefix-router demo`` end to end: 4 simulated replicas, two gateways, the report's figures.

Runs the demo as a user would (its own processes), on the first 150 requests of the built-in
mixed workload to stay under half a minute, and checks that the report adds up, names replicas
``replica-0`` .., draws its PNG beside the JSON, ends on a verdict that repeats the table's ratios,
and that prefix affinity reuses more than round-robin.
"""

from __future__ import annotations

import json
import os
import re
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
        assert [r["replica"] for r in replicas] == [f"replica-{i}" for i in range(4)] and total["replica"] == "total"
        assert len({r["url"] for r in replicas}) == 4 and all(r["url"].startswith("http://127.0.0.1:") for r in replicas)
        assert all(r["ttft_p50_s"] is not None for r in replicas if r["requests"])  # the replicas' modelled times
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
    _check_names_plot_and_verdict(proc.stdout, figures, out.with_suffix(".png"))


def _check_names_plot_and_verdict(stdout: str, figures: dict, png) -> None:
    assert "127.0.0.1" not in stdout  # replicas by name, not by port
    assert [line.split()[0] for line in stdout.splitlines() if line.startswith("replica-")] == \
        [f"replica-{i}" for i in range(4)] * 2
    assert f"plot: {png}" in stdout.splitlines() and figures["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    *_, last = stdout.rstrip("\n").splitlines()
    assert last == figures["verdict"] and last.startswith("verdict: prefix-affinity reused ")
    numbers = re.findall(r"(\d+\.\d\d)x", last)
    table = stdout.split("side by side", 1)[1]

    def ratio(row: str) -> str:
        return next(line for line in table.splitlines() if line.startswith(row)).split()[-1].rstrip("x")
    assert numbers == [ratio("reused tokens"), ratio("prefill tokens computed"), ratio("TTFT (modelled) p50"),
                       ratio("TTFT (modelled) p99")]
    a, b = (figures["per_replica"][p][-1] for p in ("prefix-affinity", "round-robin"))  # and the figures
    assert numbers == [f"{a['reused_tokens'] / b['reused_tokens']:.2f}",
                       f"{(a['prompt_tokens'] - a['reused_tokens']) / (b['prompt_tokens'] - b['reused_tokens']):.2f}",
                       f"{a['ttft_p50_s'] / b['ttft_p50_s']:.2f}", f"{a['ttft_p99_s'] / b['ttft_p99_s']:.2f}"]


def test_demo_replays_a_mooncake_trace_without_errors(tmp_path):
    trace = mooncake_trace(tmp_path)  # the shared trace, or one in its format in a clone without it
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "prefix_router.cli", "demo", "--trace", str(trace), "--limit", "40",
                           "--replicas", "2", "--json", str(out), "--cache-dir", str(tmp_path / "cache"), "--no-plot"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]  # token ids the replicas accept
    assert not list(tmp_path.glob("*.png")) and "plot:" not in proc.stdout  # --no-plot draws none
    for rows in json.loads(out.read_text())["per_replica"].values():
        assert rows[-1]["requests"] == 40 and rows[-1]["prompt_tokens"] > 0


def test_an_output_in_a_missing_folder_is_refused_before_the_run(tmp_path):
    for flag in ("--json", "--plot"):
        missing = tmp_path / "no-such-folder" / "out"
        proc = subprocess.run([sys.executable, "-m", "prefix_router.cli", "demo", flag, str(missing),
                               "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == f"prefix-router demo: {flag} {missing}: there is no folder " \
                                                        f"{missing.parent}"
