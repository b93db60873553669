"""``prefix_router/misses/diagnosis.py`` on real agent sessions: the SWE-agent trajectories in
``../shared/agent_traces`` (in a clone without that folder, the built-in agent workload's
sessions), each replayed turn by turn, clean and with one planted break."""

from __future__ import annotations

import copy
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_router.misses.diagnosis import VOLATILE, VOLATILE_SPANS, Cause, diagnose, fingerprint
from prefix_router.tools.replay.generate import builtin_workload
from prefix_router.tools.replay.workloads import load_trajectories

from ..helpers import SHARED

TRACES = sorted((SHARED / "agent_traces").glob("*.traj"))
BREAK_AT = 5  # the turn that carries the planted break
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
         for name in ("open", "edit", "search", "submit")]


def sessions() -> list[list[dict]]:
    """Each trajectory's turns as chat bodies (turn k: the history up to its k-th assistant message)."""
    requests = load_trajectories(TRACES) if TRACES else builtin_workload("agent", seed=0)
    out: dict[str, list[dict]] = {}
    for request in requests:
        out.setdefault(request.session, []).append(copy.deepcopy(request.body))
    return [turns for turns in out.values() if len(turns) > BREAK_AT + 1]


def observation_index(turns: list[dict]) -> int:
    """An old tool observation (a user or tool message after the task): the second one, in
    every turn from BREAK_AT - 1 on and never a turn's last message."""
    messages = turns[BREAK_AT - 1]["messages"]
    return [i for i, m in enumerate(messages) if m["role"] in ("user", "tool") and i > 1][1]


def plant(turns: list[dict], kind: str) -> tuple[list[dict], Cause, int]:
    """A mutated copy of a session, the cause expected at BREAK_AT and the message index."""
    turns = copy.deepcopy(turns)
    if kind == "timestamp":
        for t, body in enumerate(turns):  # every turn stamps its own time into the system prompt
            body["messages"][0]["content"] = f"Current time: 2026-11-30T10:{t:02d}:17Z\n" + body["messages"][0]["content"]
        return turns, Cause.VOLATILE_VALUE, 0
    if kind == "tools_reordered":
        for t, body in enumerate(turns):
            body["tools"] = TOOLS[::-1] if t >= BREAK_AT else TOOLS
        return turns, Cause.TOOLS_CHANGED, -1
    k = observation_index(turns)
    if kind == "keys_shuffled":
        for t, body in enumerate(turns):
            if len(body["messages"]) > k:
                result = {"output": body["messages"][k]["content"], "exit_code": 0, "cwd": "/repo"}
                if t >= BREAK_AT:
                    result = dict(reversed(list(result.items())))
                body["messages"][k]["content"] = json.dumps(result)
        return turns, Cause.KEY_ORDER, k
    if kind == "trimmed":
        for body in turns[BREAK_AT:]:
            body["messages"][k]["content"] = body["messages"][k]["content"][:40] + " [output trimmed]"
        return turns, Cause.HISTORY_REWRITTEN, k
    if kind == "retrieval":
        for body in turns[BREAK_AT:]:
            body["messages"].insert(1, {"role": "user", "content": "Relevant files (retrieved): setup.py, README.md"})
        return turns, Cause.INSERTED_BEFORE_HISTORY, 1
    raise ValueError(kind)


def test_unmodified_sessions_report_no_break():
    assert len(sessions()) >= 2  # the trajectories long enough to carry a break at turn BREAK_AT
    for turns in sessions():
        prints = [fingerprint(body) for body in turns]
        assert [diagnose(a, b) for a, b in zip(prints, prints[1:])] == [None] * (len(prints) - 1)


@pytest.mark.parametrize("kind", ["timestamp", "tools_reordered", "keys_shuffled", "trimmed", "retrieval"])
def test_each_planted_break_is_named_with_its_cause_and_position_and_nothing_else(kind):
    for turns in sessions():
        mutated, cause, index = plant(turns, kind)
        prints = [fingerprint(body) for body in mutated]
        changes = [diagnose(a, b) for a, b in zip(prints, prints[1:])]
        expected_turns = range(1, len(mutated)) if kind == "timestamp" else [BREAK_AT]
        for t, change in enumerate(changes, start=1):
            if t not in expected_turns:
                assert change is None, (kind, t, change)
                continue
            assert change is not None and change.cause is cause, (kind, t, change)
            assert change.message_index == index, (kind, t, change)
            assert change.role == ("tools" if index == -1 else mutated[t - 1]["messages"][index]["role"])
            assert change.fix
            if kind == "trimmed":  # an old message, with the history after it kept
                assert "later kept" in change.detail, change


def test_details_name_the_tools_and_what_was_removed():
    base = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "tools": TOOLS}
    filtered = {**base, "tools": TOOLS[:2]}
    edited = {**base, "tools": TOOLS[:3] + [{**TOOLS[3], "function": {**TOOLS[3]["function"], "description": "x"}}]}
    assert diagnose(fingerprint(base), fingerprint(filtered)).detail == "filtered: removed search, submit"
    assert diagnose(fingerprint(base), fingerprint(edited)).detail == "edited or added: submit"
    longer = {**base, "messages": base["messages"] + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]}
    assert diagnose(fingerprint(longer), fingerprint(base)).cause is Cause.HISTORY_REWRITTEN  # trimmed at the end
    other = {**base, "messages": [{"role": "system", "content": "a different assistant"}, {"role": "user", "content": "u2"}]}
    assert diagnose(fingerprint(base), fingerprint(other)).cause is Cause.OTHER


def test_a_number_format_change_in_tool_call_arguments_is_key_order():
    def turn(args: str) -> dict:
        return {"messages": [{"role": "user", "content": "go"},
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"id": "c1", "type": "function", "function": {"name": "open", "arguments": args}}]},
                             {"role": "tool", "tool_call_id": "c1", "content": "done"}]}

    change = diagnose(fingerprint(turn('{"path": "a.py", "line": 1}')), fingerprint(turn('{"line": 1.0, "path": "a.py"}')))
    assert change.cause is Cause.KEY_ORDER and change.message_index == 1 and change.role == "assistant"


def test_a_fingerprint_built_on_the_previous_one_equals_one_built_from_scratch():
    for turns in sessions():
        mutated, _, _ = plant(turns, "keys_shuffled")
        previous = None
        for body in mutated:
            incremental = fingerprint(body, previous)
            assert incremental == fingerprint(body)
            previous = incremental


def test_a_print_built_on_the_previous_one_and_given_digests_equals_one_built_from_scratch():
    from prefix_router.misses.diagnosis import digest, fingerprint

    tools = [{"type": "function", "function": {"name": "grep", "parameters": {"b": 1, "a": 2}}}]
    first = {"tools": tools, "messages": [{"role": "system", "content": "at 10:02 today"},
                                          {"role": "user", "content": "hi"}]}
    second = {"tools": tools, "messages": first["messages"] + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "grep", "arguments": '{"q": 1}'}}]},
        {"role": "user", "content": "next"}]}
    changed_tools = {**second, "tools": tools + [{"type": "function", "function": {"name": "ls"}}]}
    previous = fingerprint(first)
    for body in (second, changed_tools):
        digests = (digest(body["tools"]), *(digest(m) for m in body["messages"]))
        assert fingerprint(body, previous, digests) == fingerprint(body, previous) == fingerprint(body)
    assert fingerprint(changed_tools, previous).tool_names == ("grep", "ls")


# digits (ASCII and others \d matches), hex letters, the separators of dates, times and UUIDs, and
# letters that are neither, so that every alternative of the pattern gets to match and to fail
_VOLATILE_ALPHABET = "0123456789abcdefABCDEFxyzTZPMpm -:.+_\n\u0663\u096b\uff17"


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=_VOLATILE_ALPHABET, max_size=80))
def test_the_volatile_pattern_masks_what_it_would_mask_without_its_leading_lookahead(text):
    plain = re.compile(VOLATILE_SPANS)
    assert VOLATILE.sub("#", text) == plain.sub("#", text)


def test_a_requests_new_text_is_masked_and_parsed_only_up_to_the_budget(monkeypatch):
    """The mask and the JSON parse hold the GIL: a 30 MB message would hold the event loop for
    seconds. Past ``PRINT_BUDGET_CHARS`` of new text a message is hashed as it is."""
    from prefix_router.misses import diagnosis as causes

    masked: list[int] = []

    class Counting:  # the pattern, counting the characters it is run over
        @staticmethod
        def sub(repl, text):
            masked.append(len(text))
            return VOLATILE.sub(repl, text)

    monkeypatch.setattr(causes, "VOLATILE", Counting)
    budget = causes.PRINT_BUDGET_CHARS
    small = [{"role": "user", "content": f"turn {i} at 12:0{i % 10}"} for i in range(5)]
    huge = {"role": "user", "content": "1.a" * budget}
    body = {"messages": [*small, huge, {"role": "user", "content": "after it, 2026-12-06"}]}
    first = fingerprint(body)
    assert sum(masked) <= budget and len(masked) == len(small) + 1  # the huge message was not masked
    again = fingerprint({"messages": [*small, {**huge, "content": huge["content"] + "1"}, body["messages"][-1]]})
    assert first.masked[len(small)] != again.masked[len(small)]  # still told apart, as a rewrite
    assert first.masked[-1] == again.masked[-1] and first.masked[:len(small)] == again.masked[:len(small)]
