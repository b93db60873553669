"""The trace replayer (prefix_router/tools/replay): loaders, the built-in workload, the client and summaries."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from prefix_router.tools.replay.cli import add_parser as add_replay_parser
from prefix_router.tools.replay.cli import run as replay_cli_run
from prefix_router.tools.replay.client import replay
from prefix_router.tools.replay.generate import builtin_workload
from prefix_router.tools.replay.summary import percentile, summarize
from prefix_router.tools.replay.workloads import (CHAT, COMPLETIONS, load_mooncake, load_trajectories, token_text,
                                     trajectory_messages)
from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.server import create_app
from prefix_router.prompts.tokenizer import ByteTokenizer

from .helpers import agent_traces



def is_prefix(shorter: list, longer: list) -> bool:
    return len(shorter) <= len(longer) and longer[: len(shorter)] == shorter


def by_session(requests) -> dict[str, list]:
    sessions: dict[str, list] = {}
    for r in requests:
        sessions.setdefault(r.session, []).append(r)
    for turns in sessions.values():
        assert [t.turn for t in turns] == list(range(len(turns)))
    return sessions


# -- Mooncake ----------------------------------------------------------------------------

BLOCK = 8  # tokens per hash id in these small traces

MOONCAKE_LINES = [
    {"timestamp": 0, "input_length": 20, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 1500, "input_length": 17, "output_length": 9, "hash_ids": [1, 2, 4]},
    {"timestamp": 2250, "input_length": 8, "output_length": 1, "hash_ids": [7]},
]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_mooncake_records_become_token_prompts_of_their_input_length(tmp_path):
    requests = load_mooncake(write_jsonl(tmp_path / "t.jsonl", MOONCAKE_LINES), block_size=BLOCK)
    assert len(requests) == len(MOONCAKE_LINES)
    for req, rec in zip(requests, MOONCAKE_LINES):
        assert req.path == COMPLETIONS
        assert len(req.body["prompt"]) == rec["input_length"]
        assert req.body["max_tokens"] == rec["output_length"]
        assert req.at_s == rec["timestamp"] / 1000
        assert req.session is None


def test_mooncake_equal_hash_ids_give_equal_tokens_and_different_ids_differ(tmp_path):
    a, b, c = (r.body["prompt"] for r in load_mooncake(write_jsonl(tmp_path / "t.jsonl", MOONCAKE_LINES),
                                                        block_size=BLOCK))
    assert a[: 2 * BLOCK] == b[: 2 * BLOCK]  # ids 1, 2 shared
    assert a[2 * BLOCK :] != b[2 * BLOCK : len(a)]  # id 3 vs id 4
    assert c != a[:BLOCK] and c != a[BLOCK : 2 * BLOCK]  # id 7 vs ids 1, 2


def test_a_malformed_mooncake_line_raises_naming_its_line_number(tmp_path):
    lines = [MOONCAKE_LINES[0], "", '{"timestamp": 1, "input_length": 3}']  # line 3 lacks hash_ids
    with pytest.raises(ValueError, match=r":3:"):
        load_mooncake(write_jsonl(tmp_path / "bad.jsonl", lines), block_size=BLOCK)
    with pytest.raises(ValueError, match=r":2:"):
        load_mooncake(write_jsonl(tmp_path / "bad2.jsonl", [MOONCAKE_LINES[0], "{not json"]), block_size=BLOCK)


def test_a_mooncake_input_length_that_does_not_fit_its_blocks_is_refused(tmp_path):
    record = {"timestamp": 0, "input_length": 2 * BLOCK + 1, "output_length": 1, "hash_ids": [1, 2]}
    with pytest.raises(ValueError, match=r":1:"):
        load_mooncake(write_jsonl(tmp_path / "t.jsonl", [record]), block_size=BLOCK)


# -- SWE-agent trajectories --------------------------------------------------------------

def write_traj(path: Path, task: str = "Fix the bug in foo.py") -> Path:
    """A tiny SWE-agent trajectory, tool calls and ids stored as Python reprs as SWE-agent does."""
    history = [
        {"role": "system", "content": "You are an autonomous programmer.", "agent": "main"},
        {"role": "user", "content": task, "agent": "main"},
        {"role": "assistant", "content": "Let me look.", "thought": "Let me look.", "action": "open foo.py",
         "tool_calls": repr([{"function": {"arguments": '{"path": "foo.py"}', "name": "open"},
                              "id": "call_1", "type": "function"}])},
        {"role": "tool", "content": "[File: foo.py]\n1: x = 1", "tool_call_ids": repr(["call_1"])},
        {"role": "assistant", "content": "Now edit.",
         "tool_calls": repr([{"function": {"arguments": '{"line": 1, "text": "x = 2"}', "name": "edit"},
                              "id": "call_2", "type": "function"}])},
        {"role": "tool", "content": [{"type": "text", "text": "File updated."}], "tool_call_ids": repr(["call_2"])},
        {"role": "assistant", "content": "Done.", "tool_calls": repr([{"function": {"name": "submit"},
                                                                       "id": "call_3", "type": "function"}])},
        {"role": "tool", "content": "submitted", "tool_call_ids": repr(["call_3"])},
    ]
    path.write_text(json.dumps({"history": history, "info": {}}))
    return path


def test_trajectory_tool_calls_become_openai_tool_calls_with_json_arguments(tmp_path):
    history = json.loads(write_traj(tmp_path / "a.traj").read_text())["history"]
    messages = trajectory_messages(history)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                             "assistant", "tool"]
    call = messages[2]["tool_calls"][0]
    assert call == {"id": "call_1", "type": "function",
                    "function": {"name": "open", "arguments": '{"path": "foo.py"}'}}
    assert json.loads(messages[4]["tool_calls"][0]["function"]["arguments"]) == {"line": 1, "text": "x = 2"}
    assert messages[6]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert messages[3]["tool_call_id"] == "call_1"
    assert messages[5]["content"] == "File updated."
    ByteTokenizer().render_chat(messages)  # renders: arguments are valid JSON


def test_trajectory_turns_are_append_only_and_end_before_an_assistant_message(tmp_path):
    requests = load_trajectories([write_traj(tmp_path / "a.traj")], think_s=1.5)
    full = trajectory_messages(json.loads((tmp_path / "a.traj").read_text())["history"])
    assert len(requests) == 3  # one per assistant message
    for turn, req in enumerate(requests):
        messages = req.body["messages"]
        assert req.path == CHAT
        assert req.session == "traj-0" and req.turn == turn
        assert req.think_s == (0.0 if turn == 0 else 1.5)
        assert messages[-1]["role"] != "assistant"
        assert full[len(messages)]["role"] == "assistant"
    for prev, nxt in zip(requests, requests[1:]):
        assert is_prefix(prev.body["messages"], nxt.body["messages"])
        assert len(nxt.body["messages"]) > len(prev.body["messages"])


def test_trajectory_copies_share_the_system_prompt_but_not_the_task(tmp_path):
    paths = [write_traj(tmp_path / "a.traj", "task A"), write_traj(tmp_path / "b.traj", "task B")]
    requests = load_trajectories(paths, sessions=5)
    sessions = by_session(requests)
    assert len(sessions) == 5
    firsts = [turns[0].body["messages"] for turns in sessions.values()]
    assert len({m[0]["content"] for m in firsts}) == 1
    first_users = [next(m["content"] for m in msgs if m["role"] == "user") for msgs in firsts]
    assert len(set(first_users)) == 5
    assert len({r.at_s for r in requests if r.turn == 0}) == 5  # staggered starts


def test_the_shared_agent_traces_load_as_append_only_chat_sessions(tmp_path):
    paths = agent_traces(tmp_path)  # the shared ones, or the built-in agent sessions in their format
    requests = load_trajectories(paths)
    sessions = by_session(requests)
    assert len(sessions) == len(paths)
    tokenizer = ByteTokenizer()
    for turns in sessions.values():
        for req in turns:
            assert req.path == CHAT
            assert req.body["messages"] and req.body["messages"][-1]["role"] != "assistant"
            tokenizer.render_chat(req.body["messages"])
        for prev, nxt in zip(turns, turns[1:]):
            assert is_prefix(prev.body["messages"], nxt.body["messages"])


# -- built-in workload -------------------------------------------------------------------

def test_the_builtin_workload_repeats_for_a_seed_and_changes_with_it():
    first = builtin_workload("mixed", seed=3, sessions=10)
    again = builtin_workload("mixed", seed=3, sessions=10)
    other = builtin_workload("mixed", seed=4, sessions=10)
    assert [r.body for r in first] == [r.body for r in again]
    assert [(r.at_s, r.session, r.think_s) for r in first] == [(r.at_s, r.session, r.think_s) for r in again]
    assert [r.body for r in first] != [r.body for r in other]


def test_an_unknown_builtin_workload_name_raises_value_error():
    with pytest.raises(ValueError, match="unknown workload"):
        builtin_workload("nope")


def test_mixed_sessions_without_a_breaker_are_append_only():
    sessions = by_session(builtin_workload("mixed"))
    clean = [turns for turns in sessions.values() if turns[0].meta["breaker"] is None]
    assert clean
    for turns in clean:
        for prev, nxt in zip(turns, turns[1:]):
            assert is_prefix(prev.body["messages"], nxt.body["messages"])
            assert prev.body.get("tools") == nxt.body.get("tools")


@pytest.mark.parametrize("name, seed", [("mixed", 0), ("mixed", 1), ("breakers", 0)])
def test_every_cache_breaker_really_breaks_the_prefix(name, seed):
    sessions = by_session(builtin_workload(name, seed=seed))
    broken = {}
    for turns in sessions.values():
        breaker = turns[0].meta["breaker"]
        if breaker is None:
            continue
        pairs = list(zip(turns, turns[1:]))
        if breaker == "timestamp":
            ok = all(p.body["messages"][0]["content"] != n.body["messages"][0]["content"] for p, n in pairs)
        elif breaker == "tools_reordered":
            ok = any([t["function"]["name"] for t in p.body["tools"]] != [t["function"]["name"] for t in n.body["tools"]]
                     for p, n in pairs)
            assert all(sorted(map(json.dumps, p.body["tools"])) == sorted(map(json.dumps, n.body["tools"]))
                       for p, n in pairs)  # same tools, other order
        else:
            assert breaker == "trimmed"
            ok = any(not is_prefix(p.body["messages"], n.body["messages"]) for p, n in pairs)
        assert ok, (breaker, turns[0].session)
        broken[breaker] = broken.get(breaker, 0) + 1
    assert set(broken) == {"timestamp", "tools_reordered", "trimmed"}


# -- replay against an in-process simulated replica --------------------------------------

SIM = SimConfig(model="sim-model", block_size=16, num_gpu_blocks=4096, max_model_len=16_384, time_scale=1000)


@pytest.fixture
async def sim_url(aiohttp_server):
    server = await aiohttp_server(create_app(SIM, ByteTokenizer()))
    return str(server.make_url(""))


@pytest.mark.parametrize("stream", [True, False])
async def test_replay_records_every_request_with_usage_and_timings(sim_url, stream):
    requests = builtin_workload("chat", seed=2, sessions=3, rate=50.0, think_s=0.5, max_tokens=6)
    records = await replay(requests, sim_url, model=SIM.model, time_scale=1000, stream=stream)
    assert len(records) == len(requests)
    assert [r.index for r in records] == list(range(len(requests)))
    for record, req in zip(records, requests):
        assert record.status == 200 and record.error is None, record.error
        assert (record.session, record.turn) == (req.session, req.turn)
        assert record.ttft_s is not None and record.latency_s is not None
        assert record.ttft_s <= record.latency_s
        if not stream:
            assert record.ttft_s == record.latency_s
        # a stream says the replica's own part of the TTFT; a body in one piece does not
        assert (0 < record.replica_ttft_s <= record.ttft_s) if stream else record.replica_ttft_s is None
        assert record.prompt_tokens == len(ByteTokenizer().render_chat(req.body["messages"]))
        assert record.completion_tokens == 6
        assert 0 <= record.cached_tokens < record.prompt_tokens
    later_turns = [r for r in records if r.turn > 0]
    assert any(r.cached_tokens > 0 for r in later_turns)  # append-only histories hit


async def test_replay_sends_mooncake_prompts_that_hit_on_shared_hash_ids(sim_url, tmp_path):
    requests = load_mooncake(write_jsonl(tmp_path / "t.jsonl", MOONCAKE_LINES), block_size=BLOCK)
    records = await replay(requests, sim_url, time_scale=1000)
    assert [r.error for r in records] == [None] * 3
    assert [r.prompt_tokens for r in records] == [20, 17, 8]
    assert [r.completion_tokens for r in records] == [5, 9, 1]
    assert records[1].cached_tokens == 2 * BLOCK  # ids 1, 2 (block_size 16 = one sim block)


def test_mooncake_text_prompts_read_back_as_the_token_ids_with_the_byte_tokenizer(tmp_path):
    trace = write_jsonl(tmp_path / "t.jsonl", MOONCAKE_LINES)
    ids = load_mooncake(trace, block_size=BLOCK)
    texts = load_mooncake(trace, block_size=BLOCK, text=True)
    tok = ByteTokenizer()
    for a, b in zip(ids, texts):
        assert isinstance(b.body["prompt"], str) and b.body["prompt"].isascii()
        decoded = tok.encode(b.body["prompt"])
        assert len(decoded) == len(a.body["prompt"])
        # one token per id, equal exactly where the ids are equal
        assert all((decoded[i] == decoded[j]) == (a.body["prompt"][i] == a.body["prompt"][j])
                   for i in range(len(decoded)) for j in range(len(decoded)))
    with pytest.raises(ValueError, match="does not fit"):
        token_text([1 << 24])


async def test_replay_of_mooncake_text_prompts_hits_like_the_token_ids(sim_url, tmp_path):
    requests = load_mooncake(write_jsonl(tmp_path / "t.jsonl", MOONCAKE_LINES), block_size=BLOCK, text=True)
    records = await replay(requests, sim_url, time_scale=1000)
    assert [r.error for r in records] == [None] * 3
    assert [r.prompt_tokens for r in records] == [rec["input_length"] for rec in MOONCAKE_LINES]
    assert records[1].cached_tokens == 2 * BLOCK


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


# -- CLI ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["missing.jsonl", "missing.traj"])
def test_the_replay_cli_exits_2_when_the_trace_file_is_missing(tmp_path, capsys, name):
    parser = argparse.ArgumentParser()
    add_replay_parser(parser.add_subparsers())
    args = parser.parse_args(["replay", "--target", "http://127.0.0.1:9", "--trace", str(tmp_path / name)])
    assert replay_cli_run(args) == 2
    assert "prefix-router replay:" in capsys.readouterr().err
