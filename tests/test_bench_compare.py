"""``python -m bench compare`` on a small scale: every system runs, the figures add up, and the
pooled-cache bound bounds them.

Runs the benchmark as a user would, with the peer routers installed by the benchmark itself
(``bench.systems.ensure_peers``, pip from PyPI into ``.venv-peers``); where that install fails
(no package index), the peers are left out with the reason and this gateway is still checked.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from bench.commands import compare
from bench.meters import hop_ttfts
from bench.pooled import pooled_hit_rate, prompt_token_ids, spread_hit_rate, unbounded_hit_rate
from bench.systems import SYSTEMS, Gateway, ensure_peers
from bench.workloads import VllmBenchShape, generated_shared_prefix, one_system_prompt, shape_bound
from prefix_router.tools.replay.client import Record
from prefix_router.tools.replay.generate import builtin_workload
from prefix_router.tools.replay.workloads import ReplayRequest

PLOTS = ("ttft.png", "reused_per_replica.png", "hit_rate_over_time.png", "overhead.png")


def test_quick_mode_fills_unset_knobs_and_explicit_ones_win():
    args = compare.parse_args(["--quick", "--replicas", "3"])
    assert args.replicas == 3  # explicit
    assert args.limit == compare.MODES["quick"]["limit"] and args.mode == "quick"
    assert compare.parse_args([]).replicas == compare.MODES["full"]["replicas"]
    with pytest.raises(SystemExit):
        compare.parse_args(["--systems", "prefix-router,no-such-router"])


def test_the_pooled_bound_counts_each_shared_block_once_and_loses_what_it_evicts():
    block = 16
    shared = list(range(1000, 1000 + 4 * block))
    conversation = [ReplayRequest("/v1/completions", {"prompt": shared + [i] * block, "max_tokens": 1})
                    for i in range(3)]
    # the first request computes everything; each later one reuses the 4 shared blocks
    total = sum(len(prompt_token_ids(r)) for r in conversation)
    assert pooled_hit_rate(conversation, 1000, block) == pytest.approx(2 * 4 * block / total)
    # unrelated 5-block prompts in between fill a 5-block cache and evict the shared blocks
    other = [ReplayRequest("/v1/completions", {"prompt": [5000 + i] * (5 * block), "max_tokens": 1})
             for i in range(2)]
    mixed = [conversation[0], other[0], conversation[1], other[1], conversation[2]]
    assert pooled_hit_rate(mixed, 1000, block) == pytest.approx(2 * 4 * block / (total + 10 * block))
    assert pooled_hit_rate(mixed, 6, block) == 0.0  # 6 blocks: the null block and 5 usable


def test_the_generated_shared_prefix_shape_is_sglangs_groups_of_one_system_prompt_and_own_questions():
    requests = generated_shared_prefix(groups=4, per_group=5, system_len=64, question_len=16, output_len=8)
    assert len(requests) == 20
    by_group = {}
    for r in requests:
        tokens = prompt_token_ids(r)
        assert len(tokens) == 64 + 16 and r.body["max_tokens"] == 8
        by_group.setdefault(r.meta["group"], set()).add(tuple(tokens[:64]))
    assert all(len(prefixes) == 1 for prefixes in by_group.values())  # one system prompt a group
    assert len({next(iter(p)) for p in by_group.values()}) == 4  # and a different one per group
    assert [r.at_s for r in requests] == sorted(r.at_s for r in requests)
    # with each system prompt computed once and nothing else shared, the unbounded cache reuses
    # (per_group - 1) / per_group of the system prompts' full blocks
    assert unbounded_hit_rate(requests, 16) == pytest.approx(4 * 4 * 64 / (20 * 80))


def test_sessions_sharing_one_system_prompt_append_their_turns():
    requests = one_system_prompt(sessions=10, system_len=32, output_len=4)
    systems = {r.body["messages"][0]["content"] for r in requests}
    assert len(systems) == 1
    by_session = {}
    for r in requests:
        by_session.setdefault(r.session, []).append(r.body["messages"])
    for turns in by_session.values():
        for earlier, later in zip(turns, turns[1:]):
            assert later[: len(earlier)] == earlier


def test_the_shape_bound_computes_each_prefix_once():
    shape = VllmBenchShape("t", "prefix_repetition", False, num_prompts=640, rate=20, prefixes=32,
                           prefix_len=2000, suffix_len=200)
    assert shape_bound(shape) == pytest.approx(19 / 20 * 2000 / 2200)


def test_sessions_spread_evenly_compute_their_shared_prefix_once_per_replica():
    block = 16
    shared = list(range(1000, 1000 + 4 * block))  # 4 blocks every session starts with
    requests = []
    for s in range(4):
        own = [2000 + s] * (2 * block)
        for turn in range(3):  # each turn appends two blocks to the session's prompt
            own = own + [3000 + 10 * s + turn] * (2 * block)
            requests.append(ReplayRequest("/v1/completions", {"prompt": shared + own + [7], "max_tokens": 1},
                                          session=f"s{s}", turn=turn))
    total = sum(len(prompt_token_ids(r)) for r in requests)
    # per session: turn 2 reuses turn 1's prompt, turn 3 turn 2's (all but the last token)
    within = sum(len(prompt_token_ids(r)) - 1 for r in requests if r.turn < 2) // block * block
    assert spread_hit_rate(requests, 1, block) == pytest.approx(unbounded_hit_rate(requests, block))
    for replicas in (1, 2, 4):
        # the shared blocks are computed once per replica that holds sessions, reused by the rest
        reused_shared = (4 - replicas) * 4 * block
        assert spread_hit_rate(requests, replicas, block) == pytest.approx((within + reused_shared) / total)
    assert spread_hit_rate([ReplayRequest("/v1/completions", {"prompt": shared})], 2, block) is None


def test_the_pooled_bound_reads_chat_prompts_as_the_simulator_renders_them():
    requests = builtin_workload("agent", sessions=2, seed=3)
    tokens = [prompt_token_ids(r) for r in requests]
    assert all(isinstance(t, list) and t for t in tokens)
    assert 0 < pooled_hit_rate(requests, 100_000, 16) < 1


def test_time_compression_scales_the_replicas_time_to_first_token_and_not_the_rest():
    # wall TTFT 0.030 s of which the replica's own 0.020 s, at time scale 10: the replica's part
    # is 0.2 modelled seconds, the 0.010 s of client, network and router stays 0.010
    record = lambda ttft, own, status=200: Record(0, None, 0, 0.0, ttft, ttft, 1, 0, 1, status, None, None, own)  # noqa: E731
    records = [record(0.030, 0.020), record(0.030, None), record(0.5, 0.4, status=500), record(None, None)]
    assert hop_ttfts(records, 10.0) == pytest.approx([0.030 + 9 * 0.020])
    assert hop_ttfts(records, 1.0) == pytest.approx([0.030])


def test_a_small_run_of_every_system_adds_up(tmp_path):
    systems = [s for s in SYSTEMS if isinstance(s, Gateway)]
    try:
        ensure_peers()
        systems = list(SYSTEMS)
    except subprocess.CalledProcessError as exc:
        print(f"peer routers left out: installing them failed ({exc})")
    out = tmp_path / "out"
    argv = ["--quick", "--traces", "--shapes", "none", "--replicas", "2", "--sessions", "3", "--rates", "20",
            "--seconds", "1",
            "--systems", ",".join(s.name for s in systems), "--out", str(out), "--log-dir", str(tmp_path / "logs")]
    assert compare.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["machine"]["cores"] and results["machine"]["python"] and results["commit"] and results["date"]
    assert [w["name"] for w in results["workloads"]] == ["builtin-chat", "builtin-agent"]  # no trace given
    for w in results["workloads"]:
        assert [r["system"] for r in w["rows"]] == [s.name for s in systems]
        for r in w["rows"]:
            assert r["errors"] == 0, (w["name"], r["system"], r["first_error"])
            assert r["requests"] == w["requests"]
            assert len(r["reused_per_replica"]) == 2
            # these workloads fit in the fleet's cache: no router can beat one pooled cache
            assert 0 < r["hit_rate"] <= w["pooled_bound"] + 1e-9, (w["name"], r["system"])
            assert r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"]
            # every router passes the simulator's own time through; counting the router's at
            # real speed can only lower a time-compressed TTFT
            assert 0 < r["hop_ttft_p50_s"] <= r["ttft_p50_s"] and 0 < r["hop_ttft_p99_s"] <= r["ttft_p99_s"]
        rates = {r["system"]: r["hit_rate"] for r in w["rows"]}
        assert rates["prefix-router"] > rates["round-robin"], w["name"]
    table = (out / "README.md").read_text()
    assert table.count("| builtin-agent |") == len(systems)
    assert f"- Command: `python -m bench compare {argv[0]} " in table  # the header says how it ran
    overhead = results["overhead"]
    assert [r["system"] for r in overhead["rows"]] == [s.name for s in systems]
    assert all(r["errors"] == 0 and r["cpu_ms"] >= 0 for r in overhead["rows"])
    # /proc counts CPU in 10 ms ticks: 20 requests through a Rust router (~1 ms each) can read 0,
    # ours (~3 ms each) cannot
    assert all(r["cpu_ms"] > 0 for r in overhead["rows"] if r["system"] == "prefix-router")
    assert set(overhead["sustained"]) == {s.name for s in systems}
    for name in PLOTS:
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name


def test_a_run_stopped_midway_keeps_the_workloads_it_finished(tmp_path, monkeypatch):
    real = compare.run_cell

    def stop_at_the_agent_workload(system, work, *rest):
        if work.name == "builtin-agent":
            raise KeyboardInterrupt  # an operator's Ctrl-C two hours into a full run
        return real(system, work, *rest)

    monkeypatch.setattr(compare, "run_cell", stop_at_the_agent_workload)
    out = tmp_path / "out"
    argv = ["--quick", "--traces", "--shapes", "none", "--replicas", "2", "--sessions", "3", "--no-overhead",
            "--systems", "prefix-router", "--out", str(out), "--log-dir", str(tmp_path / "logs")]
    with pytest.raises(KeyboardInterrupt):
        compare.main(argv)
    results = json.loads((out / "results.json").read_text())
    assert [w["name"] for w in results["workloads"]] == ["builtin-chat"]
    assert results["workloads"][0]["rows"][0]["requests"] == results["workloads"][0]["requests"]
    assert "partial: 1 of 2 workloads so far" in (out / "README.md").read_text()
