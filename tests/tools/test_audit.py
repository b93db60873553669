"""``prefix-router audit`` on a log of the SWE-agent sessions, clean and with planted breaks: every
break named with its cause, message, turn and token position, nothing else, and the fix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prefix_router.tools.audit import audit, format_report
from prefix_router.misses.diagnosis import FIXES
from prefix_router.misses.request_log import conversation_tag
from prefix_router.prompts.analysis import conversation_id
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..misses.test_diagnosis import BREAK_AT, plant, sessions

KINDS = ["timestamp", "tools_reordered", "keys_shuffled", "trimmed", "retrieval"]


def write_log(path, with_session: bool = True, fields=None) -> dict[str, list[tuple[int, str, int]]]:
    """The clean sessions and one mutated copy per kind, one request body a line; returns, per
    session, the breaks planted: (turn, cause, message index). ``fields(session)``: what each
    line carries beside its body (default: its ``session``; nothing without ``with_session``)."""
    if fields is None:
        fields = (lambda name: {"session": name}) if with_session else (lambda name: {})
    planted = {}
    with open(path, "w") as f:
        for n, turns in enumerate(sessions()):
            for body in turns:
                f.write(json.dumps({**body, **fields(f"clean-{n}")}) + "\n")
            planted[f"clean-{n}"] = []
        for kind in KINDS:
            base = sessions()[1]
            for body in base:  # no two sessions share a first user message
                next(m for m in body["messages"] if m["role"] == "user")["content"] += f" ({kind})"
            turns, cause, index = plant(base, kind)
            for body in turns:
                f.write(json.dumps({**body, **fields(kind)}) + "\n")
            at = range(1, len(turns)) if kind == "timestamp" else [BREAK_AT]
            planted[kind] = [(t, cause.value, index) for t in at]
    return planted


def found(report: dict) -> dict[str, list[tuple[int, str, int]]]:
    return {c["id"]: [(b["turn"], b["cause"], b["message_index"]) for b in c["breaks"]] for c in report["conversations"]}


def test_the_audit_names_every_planted_break_and_no_other(tmp_path):
    path = tmp_path / "requests.jsonl"
    planted = write_log(path)
    out = subprocess.run([sys.executable, "-m", "prefix_router.cli", "audit", str(path), "--json"],
                         capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert found(report) == planted
    for c in report["conversations"]:
        if c["breaks"]:
            assert c["reused_if_fixed"] > c["reused_tokens"]
            assert all(b["lost_tokens"] > 0 and b["fix"] == FIXES[b["cause"]] for b in c["breaks"])
        else:
            assert c["reused_if_fixed"] == c["reused_tokens"]
    assert report["totals"]["breaks"] == sum(len(b) for b in planted.values())
    text = subprocess.run([sys.executable, "-m", "prefix_router.cli", "audit", str(path)],
                          capture_output=True, text=True, check=True).stdout
    for cause in {b[1] for breaks in planted.values() for b in breaks}:
        assert cause in text and FIXES[cause] in text


def test_a_log_still_being_written_is_read_up_to_its_last_complete_line(tmp_path):
    path = tmp_path / "requests.jsonl"
    planted = write_log(path)
    whole = audit(str(path))
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines) + lines[-1][: len(lines[-1]) // 2])  # a line cut short, no newline
    cut = audit(str(path))
    assert found(cut) == planted == found(whole)
    assert cut["totals"] == whole["totals"]
    path.write_text("".join(lines[:-1]) + "{cut" + "\n" + lines[-1])  # a broken line before the end is an error
    with pytest.raises(ValueError, match="not JSON"):
        audit(str(path))


def test_without_session_fields_conversations_are_found_as_the_gateway_finds_them(tmp_path):
    path = tmp_path / "requests.jsonl"
    planted = write_log(path, with_session=False)
    report = audit(str(path))
    # A timestamp in the system prompt, reordered tools, a rewritten observation: the first user
    # message stays, so each is still one conversation with its break. A user message inserted
    # before the first one starts another conversation (documented: send a session id).
    expected = [breaks for session, breaks in planted.items() if session != "retrieval"] + [[], []]
    assert sorted(found(report).values()) == sorted(expected)
    assert report["totals"]["conversations"] == len(planted) + 1
    # named by that hash, the client having sent no session id and no ``user``
    bodies = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(c["id"] for c in report["conversations"]) == sorted({conversation_id(b, None) for b in bodies})
    assert {c["grouped_by"] for c in report["conversations"]} == {"prompt"}


def by_user(planted: dict, user) -> dict[str, list[tuple[int, str, int]]]:
    """What the audit should find when each session's lines carry ``user(session)`` and no
    session id: the planted breaks under ``user:<user>``; the retrieval copy's inserted user
    message changes its first user message, which starts the user's second chat (``#2``)."""
    expected = {f"user:{user(name)}": breaks for name, breaks in planted.items() if name != "retrieval"}
    return {**expected, f"user:{user('retrieval')}": [], f"user:{user('retrieval')} #2": []}


def test_lines_with_a_user_field_are_grouped_and_named_by_it(tmp_path):
    path = tmp_path / "requests.jsonl"
    user = lambda name: f"dev-{name}"  # noqa: E731
    planted = write_log(path, fields=lambda name: {"user": user(name)})
    out = subprocess.run([sys.executable, "-m", "prefix_router.cli", "audit", str(path), "--json"],
                         capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    expected = by_user(planted, user)
    assert found(report) == expected
    assert {c["grouped_by"] for c in report["conversations"]} == {"user"}
    text = subprocess.run([sys.executable, "-m", "prefix_router.cli", "audit", str(path)],
                          capture_output=True, text=True, check=True).stdout
    for name, breaks in expected.items():
        assert (f"conversation {name}: " in text) == bool(breaks)
    assert "conversation u:" not in text
    first_user = next(m for m in sessions()[0][0]["messages"] if m["role"] == "user")["content"]
    assert first_user not in text and first_user not in out.stdout  # ids and hashes, no prompt text


def test_one_users_chats_interleaved_are_its_conversations_not_breaks(tmp_path):
    path = tmp_path / "requests.jsonl"
    chats = sessions()
    rows = [{**turns[t], "user": "alice"} for t in range(max(map(len, chats))) for turns in chats if t < len(turns)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = audit(str(path))
    openings = list(dict.fromkeys(conversation_id(row, None) for row in rows))  # each chat's, in order of first line
    assert len(openings) == len(chats) > 1
    names = ["user:alice"] + [f"user:alice #{n}" for n in range(2, len(chats) + 1)]
    assert [(c["id"], c["requests"]) for c in report["conversations"]] == [
        (name, sum(conversation_id(row, None) == opening for row in rows)) for name, opening in zip(names, openings)]
    assert report["totals"]["breaks"] == 0


def test_a_session_field_wins_over_user(tmp_path):
    path = tmp_path / "requests.jsonl"
    planted = write_log(path, fields=lambda name: {"session": name, "user": "alice"})  # one user, many sessions
    report = audit(str(path))
    assert found(report) == planted
    assert {c["grouped_by"] for c in report["conversations"]} == {"session"}


def test_a_gateway_log_is_grouped_by_its_conversation_tag_and_named_by_user_where_it_keyed_one(tmp_path):
    """The gateway logs its session key as a tag only: a tag of ``user:<user>`` is the body's
    ``user`` (grouped and named as above); another tag (a session header) is kept and named as
    logged; a tag of the first-user-message hash is what a line without one gets."""
    path = tmp_path / "requests.jsonl"
    chats = sessions()
    header_tag = conversation_tag("a session header's value")
    user_turns, cause, index = plant(chats[0], "tools_reordered")  # the tool list reordered at BREAK_AT
    rows = [{"t": float(t), "path": "/v1/chat/completions", "body": {**body, "user": "alice"},
             "conversation": conversation_tag("user:alice")} for t, body in enumerate(user_turns)]
    rows += [{"t": float(t), "path": "/v1/chat/completions", "body": {**body, "user": "bob"}, "conversation": header_tag}
             for t, body in enumerate(chats[1])]
    rows += [{"t": float(t), "path": "/v1/chat/completions", "body": body,
              "conversation": conversation_tag(conversation_id(body, None))} for t, body in enumerate(chats[-1][:2])]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = audit(str(path))
    got = {c["id"]: (c["grouped_by"], c["requests"]) for c in report["conversations"]}
    assert got == {"user:alice": ("user", len(user_turns)), header_tag: ("session", len(chats[1])),
                   conversation_id(chats[-1][0], None): ("prompt", 2)}
    assert found(report) == {"user:alice": [(BREAK_AT, cause.value, index)], header_tag: [],
                             conversation_id(chats[-1][0], None): []}


def test_exact_token_positions_lie_inside_the_changed_message(tmp_path):
    path = tmp_path / "requests.jsonl"
    write_log(path)
    tokenizer = ByteTokenizer()
    report = audit(str(path), tokenizer, block_size=16)
    assert report["unit"] == "tokens"
    bodies = [json.loads(line) for line in path.read_text().splitlines()]
    for c in report["conversations"]:
        for b in c["breaks"]:
            if b["message_index"] < 0:
                continue
            messages, tools = bodies[b["line"] - 1]["messages"], bodies[b["line"] - 1].get("tools")
            index = b["message_index"]
            before = len(tokenizer.render_chat(messages[:index], tools=tools, add_generation_prompt=False)) if index else 0
            through = len(tokenizer.render_chat(messages[: index + 1], tools=tools, add_generation_prompt=False))
            assert before // 16 * 16 <= b["token_position"] <= through, b


def test_a_gateway_request_log_without_bodies_is_refused_with_the_reason(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"t": 1.0, "replica": "a:1", "status": 200, "result": "hit"}) + "\n")
    out = subprocess.run([sys.executable, "-m", "prefix_router.cli", "audit", str(path)], capture_output=True, text=True)
    assert out.returncode == 2 and "request_log_bodies" in out.stderr
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=":1: not JSON"):
        audit(str(path))


@pytest.mark.parametrize("field", ["session", "user"])
def test_a_clients_control_characters_are_escaped_in_the_text_report(tmp_path, field):
    """A session id or user is the client's: a newline in it would forge a report line, an ANSI
    escape would clear or recolour the operator's terminal. The text shows them escaped; the JSON
    keeps them as sent."""
    path = tmp_path / "requests.jsonl"
    hostile = "\n\x1b[2J\x1b[31m\u202e<b>"
    planted = write_log(path, fields=lambda name: {field: name + hostile})
    report = audit(str(path))
    assert {c["id"].removeprefix("user:").split(" #")[0] for c in report["conversations"]} == \
        {name + hostile for name in planted}
    text = format_report(report)
    assert "\x1b" not in text and "\u202e" not in text
    lines = text.splitlines()
    assert all(line.startswith(("conversation ", "  ", "by cause:", "/", "reused", "breaks:")) for line in lines if line)
    named = [line for line in lines if line.startswith("conversation ")]
    assert len(named) >= 4 and all(r"\n\x1b[2J\x1b[31m\u202e<b>: " in line for line in named)
