"""The replayer's trace loaders (``prefix_router/tools/replay/workloads.py``): Mooncake traces as
token ids or text, SWE-agent trajectories as append-only chat sessions. The built-in workloads,
the client, summaries and the command line: ``test_generate.py``, ``test_client.py``,
``test_summary.py``, ``test_cli.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefix_router.tools.replay.workloads import (CHAT, COMPLETIONS, load_mooncake, load_request_log,
                                                  load_trajectories, token_text, trajectory_messages)
from prefix_router.prompts.tokenizer import ByteTokenizer

from ...helpers import agent_traces


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


def test_a_request_log_is_read_in_the_order_its_requests_were_answered(tmp_path):
    """The gateway stamps a line with its answer's time, and a line that waits for its replica's
    KV events may land after lines of later answers: turns follow ``t``, not the file."""
    first = {"messages": [{"role": "user", "content": "hi"}], "session": "s"}
    second = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"},
                           {"role": "user", "content": "more"}], "session": "s"}
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"t": 10.5, "body": second, "session": "s"}) + "\n"
                    + json.dumps({"t": 10.0, "body": first, "session": "s"}) + "\n"
                    + json.dumps({"body": first, "session": "other"}) + "\n")
    requests = load_request_log(path)
    # a line without ``t`` keeps its place after the line before it
    assert [(r.session, r.turn, r.meta["line"]) for r in requests] == [("s", 0, 2), ("other", 0, 3), ("s", 1, 1)]
