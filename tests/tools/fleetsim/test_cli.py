"""``prefix-router fleetsim`` (``tools/fleetsim/cli.py``), run as a user runs it."""

from __future__ import annotations

import json

from prefix_router.cli import main
from prefix_router.tools.fleetsim.router import POLICIES


def test_fleetsim_prints_a_row_a_policy_and_writes_their_figures(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    assert main(["fleetsim", "--workload", "chat", "--limit", "40", "--replicas", "3", "--num-gpu-blocks", "3000",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert list(figures) == list(POLICIES) and all(p in printed for p in POLICIES)
    for f in figures.values():
        assert {"token_hit_rate", "busiest_over_fair", "ttft_p50_s", "ttft_p99_s", "requests"} <= set(f)
        assert f["requests"] == 40 and 0 <= f["token_hit_rate"] <= 1


def test_an_objective_adds_each_policys_capacity(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    assert main(["fleetsim", "--workload", "chat", "--limit", "12", "--replicas", "2", "--policy", "prefix-router",
                 "--slo-ttft-p99", "30", "--json", str(out)]) == 0
    assert "capacity at TTFT p99 <= 30 s" in capsys.readouterr().out
    assert "capacity_rps" in json.loads(out.read_text())["prefix-router"]


def test_bad_input_is_refused_with_a_message_and_status_2(tmp_path, capsys):
    assert main(["fleetsim", "--replicas", "0"]) == 2
    assert main(["fleetsim", "--replicas", "2", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "prefix-router fleetsim:" in capsys.readouterr().err


def test_a_fleet_that_misses_the_objective_at_every_rate_says_so(capsys):
    assert main(["fleetsim", "--workload", "chat", "--limit", "8", "--replicas", "1", "--policy", "round-robin",
                 "--slo-ttft-p99", "0.0001"]) == 0
    assert "below every rate tried" in capsys.readouterr().out


def test_a_request_log_without_prompts_names_the_setting_that_writes_them(tmp_path, capsys):
    log = tmp_path / "requests.jsonl"
    log.write_text(json.dumps({"t": 1.0, "replica": "r", "route": "affinity", "status": 200}) + "\n")
    assert main(["fleetsim", "--trace", str(log), "--replicas", "2"]) == 2
    assert "request_log_blocks" in capsys.readouterr().err
