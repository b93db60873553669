"""``prefix-router fleetsim`` (``tools/fleetsim/cli.py``), run as a user runs it."""

from __future__ import annotations

import json

import pytest

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


def test_a_target_rate_finds_the_fewest_replicas_that_serve_it(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    assert main(["fleetsim", "--workload", "sglang-shared-prefix", "--limit", "300", "--replicas", "16",
                 "--policy", "round-robin", "--slo-ttft-p99", "1", "--target-rate", "40", "--json", str(out)]) == 0
    assert "fewest replicas for 40 req/s at TTFT p99 <= 1 s" in capsys.readouterr().out
    found = json.loads(out.read_text())["round-robin"]
    assert 1 < found["replicas"] <= 16 and found["ttft_p99_s"] <= 1


def test_gateway_instances_following_kv_events_are_one_flag_each(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    assert main(["fleetsim", "--workload", "chat", "--limit", "30", "--replicas", "3", "--policy", "prefix-router",
                 "--gateways", "2", "--kv-events-delay", "0.1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["prefix-router"]["requests"] == 30


def test_a_rate_sessions_cannot_reach_is_named_not_met_by_one_replica(capsys):
    assert main(["fleetsim", "--workload", "one-system-prompt", "--limit", "60", "--replicas", "4",
                 "--policy", "least-loaded", "--slo-ttft-p99", "5", "--target-rate", "1e5"]) == 0
    assert "none: the trace comes at" in capsys.readouterr().out


def test_a_target_rate_too_far_from_the_traces_own_is_refused(capsys):
    assert main(["fleetsim", "--workload", "chat", "--limit", "20", "--replicas", "2", "--policy", "least-loaded",
                 "--slo-ttft-p99", "1", "--target-rate", "1e-300"]) == 2
    assert "--target-rate: the trace comes at" in capsys.readouterr().err


def test_a_json_file_that_cannot_be_written_is_said_without_a_traceback(capsys):
    assert main(["fleetsim", "--workload", "chat", "--limit", "5", "--replicas", "2", "--policy", "round-robin",
                 "--json", "/dev/full"]) == 1
    assert "could not write /dev/full" in capsys.readouterr().err


def test_a_disaggregated_fleet_is_two_flags_and_its_table_says_whose_figures_they_are(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    assert main(["fleetsim", "--workload", "chat", "--limit", "40", "--replicas", "2", "--prefill-replicas", "2",
                 "--decode-policy", "prefix-router", "--policy", "round-robin", "--json", str(out)]) == 0
    assert "the prefill pool's" in capsys.readouterr().out
    figures = json.loads(out.read_text())["round-robin"]
    assert figures["requests"] == 40 and figures["transfer_tokens"] > 0 and figures["held_at_end"] == 0
    assert main(["fleetsim", "--replicas", "2", "--decode-policy", "round-robin"]) == 2  # no decode pool


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


@pytest.mark.parametrize("bad", [["--rate-scale", "nan"], ["--rate-scale", "inf"], ["--scrape-interval", "1e-300"],
                                 ["--slo-ttft-p99", "0"], ["--slo-ttft-p99", "nan"], ["--limit", "0"],
                                 ["--num-gpu-blocks", "1"], ["--replicas", "1000000"], ["--json", "/nonexistent/out.json"],
                                 ["--target-rate", "5"], ["--slo-ttft-p99", "2", "--target-rate", "-1"],
                                 ["--gateways", "0"], ["--gateways", "33"], ["--kv-events-delay", "-1"],
                                 ["--kv-events-delay", "nan"], ["--rate-scale", "1e300"], ["--cpu-offload-blocks", "-5"],
                                 ["--slo-ttft-p99", "1", "--target-rate", "5", "--rate-scale", "2"]])
def test_numbers_out_of_range_are_refused_before_anything_runs(bad, capsys):
    args = ["fleetsim", "--workload", "chat", "--replicas", "2", *bad]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("prefix-router fleetsim:") and "Traceback" not in err


@pytest.mark.parametrize("record", [
    {"timestamp": 0, "input_length": float("inf"), "output_length": 1, "hash_ids": [1]},
    {"timestamp": float("nan"), "input_length": 10, "output_length": 1, "hash_ids": [1]},
    {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [True]},
    {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-3]},
    {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "7"},
    {"t": 1.0, "elapsed_s": 0.1, "blocks": ["ab"], "block_size": 10**9, "units": 20},
    {"t": 1.0, "elapsed_s": 0.1, "blocks": ["ab"], "block_size": 16, "units": 5},
    {"t": float("nan"), "elapsed_s": 0.1, "blocks": ["ab"], "block_size": 16, "units": 20},
    {"t": 1.0, "elapsed_s": 0.1, "blocks": "abc", "block_size": 16, "units": 20},
    {"t": 1.0, "elapsed_s": 0.1, "blocks": ["ab"], "block_size": 16, "units": 20, "conversation": 5},
    {"t": 1.0, "elapsed_s": 0.1, "blocks": ["ab"], "block_size": 16, "units": 20, "completion_tokens": float("inf")},
])
def test_a_trace_record_that_is_not_one_is_refused_naming_its_line(record, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps(record) + "\n")
    assert main(["fleetsim", "--trace", str(trace), "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:1" in err and "Traceback" not in err


def test_an_empty_trace_is_refused(tmp_path, capsys):
    trace = tmp_path / "empty.jsonl"
    trace.write_text("\n\n")
    assert main(["fleetsim", "--trace", str(trace), "--replicas", "2"]) == 2
    assert "no requests" in capsys.readouterr().err


def test_a_cpu_offload_tier_is_reused_where_the_gpu_overflows(tmp_path):
    figures = {}
    for cpu in ("0", "5000"):  # 300 GPU blocks a replica: the chats overflow them
        out = tmp_path / f"{cpu}.json"
        assert main(["fleetsim", "--workload", "chat", "--limit", "200", "--replicas", "2", "--num-gpu-blocks", "300",
                     "--cpu-offload-blocks", cpu, "--kv-events-delay", "0.05", "--policy", "prefix-router",
                     "--json", str(out)]) == 0
        figures[cpu] = json.loads(out.read_text())["prefix-router"]
    assert figures["5000"]["token_hit_rate"] > figures["0"]["token_hit_rate"]  # loads count as hits, as in vLLM
