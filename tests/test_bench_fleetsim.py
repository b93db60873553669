"""``python -m bench fleetsim``: the HTTP matrix's workloads through the fleet simulator, side by side."""

from __future__ import annotations

import json

from bench.commands.fleetsim import _cell, main


def _row(system, hit, p50):
    return {"system": system, "hit_rate": hit, "busiest_requests_of_fair": 1.2, "ttft_p50_s": 2 * p50,
            "ttft_p99_s": 1.0, "hop_ttft_p50_s": p50, "hop_ttft_p99_s": 0.9}


def test_the_goals_are_judged_on_the_routers_unscaled_ttft():
    sim = {"token_hit_rate": 0.505, "busiest_over_fair": 1.1, "ttft_p50_s": 0.108, "ttft_p99_s": 0.8}
    cell = _cell(_row("prefix-router", 0.5, 0.1), sim)
    assert cell["hit_within_1_point"] and cell["p50_within_10_percent"] and cell["p50_http"] == 0.1
    far = _cell(_row("prefix-router", 0.48, 0.09), sim)
    assert not far["hit_within_1_point"] and not far["p50_within_10_percent"]


def test_the_command_runs_each_modelled_system_of_a_workload(tmp_path):
    compare = tmp_path / "results.json"
    compare.write_text(json.dumps({"num_blocks": 2000, "block_size": 16, "workloads": [
        {"name": "a dozen agent sessions", "replicas": 4,
         "rows": [_row("prefix-router", 0.87, 0.04), _row("sglang-router cache_aware", 0.87, 0.04),
                  _row("vllm-router cache_aware", 0.68, 0.06)]}]}))
    out = tmp_path / "out"
    assert main(["--compare", str(compare), "--out", str(out)]) == 0
    cells = json.loads((out / "results.json").read_text())["results"]["cells"]
    assert [c["policy"] for c in cells] == ["prefix-router", "sglang-cache-aware"]  # vllm-router's cache_aware: no model
    assert all(0 < c["hit_sim"] <= 1 and c["p50_sim"] > 0 for c in cells)
    assert "| a dozen agent sessions | prefix-router (prefix-router) |" in (out / "README.md").read_text()
