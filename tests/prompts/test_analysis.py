"""``prefix_router.prompts.analysis.analyze``: what a request body gives routing (the chat opening key)."""

from __future__ import annotations

import random

import pytest

from prefix_router.prompts.analysis import analyze, check_body
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import MODEL, text

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("get", "put")]


def _opening(body: dict, session: str | None = None) -> str | None:
    return analyze(body, True, ByteTokenizer(), 16, 64, session).opening


def _chat(messages, **extra) -> dict:
    return {"model": MODEL, "messages": messages, **extra}


def test_every_turn_of_a_chat_has_the_opening_of_its_first():
    rng = random.Random(3)
    messages = [{"role": "system", "content": text(rng, 200)}, {"role": "user", "content": text(rng, 30)}]
    first = _opening(_chat(messages, tools=TOOLS))
    assert first is not None
    for _ in range(4):
        messages += [{"role": "assistant", "content": text(rng, 20)}, {"role": "user", "content": text(rng, 20)}]
        assert _opening(_chat(messages, tools=TOOLS)) == first
    # a session key names the conversation but does not change the opening
    assert _opening(_chat(messages, tools=TOOLS), session="s1") == first


def test_the_opening_changes_with_anything_before_the_first_user_message_ends():
    rng = random.Random(4)
    system, user = {"role": "system", "content": text(rng, 200)}, {"role": "user", "content": text(rng, 30)}
    base = _opening(_chat([system, user], tools=TOOLS))
    variants = [
        _chat([system, {"role": "user", "content": user["content"] + " more"}], tools=TOOLS),
        _chat([{"role": "system", "content": system["content"] + " 12:00"}, user], tools=TOOLS),
        _chat([system, user], tools=TOOLS[::-1]),
        _chat([system, user]),
        _chat([system, user], tools=TOOLS, cache_salt="tenant-b"),
        {**_chat([system, user], tools=TOOLS), "model": "other"},
    ]
    openings = [_opening(v) for v in variants]
    assert None not in openings and base not in openings
    assert len(set(openings)) == len(openings)


def test_completions_and_chats_without_a_user_message_have_no_opening():
    assert analyze({"model": MODEL, "prompt": "hello there"}, False, ByteTokenizer(), 16, 64, None).opening is None
    assert _opening(_chat([{"role": "system", "content": "only a system prompt"}])) is None
    assert _opening(_chat("not a list")) is None


def test_a_chat_is_on_its_first_turn_until_an_assistant_or_tool_message_is_sent():
    def first_turn(messages, chat=True):
        body = {"model": MODEL, "messages": messages} if chat else {"model": MODEL, "prompt": "hi"}
        return analyze(body, chat, ByteTokenizer(), 16, 64, None).first_turn
    system, user = {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}
    assert first_turn([system, user]) is True
    assert first_turn([system, user, {"role": "user", "content": "and more"}]) is True
    assert first_turn([system, user, {"role": "assistant", "content": "hello"}, user]) is False
    assert first_turn([user, {"role": "tool", "content": "42", "tool_call_id": "t"}]) is False
    assert first_turn(None, chat=False) is None  # a completion's turns cannot be told apart


def test_routing_a_huge_prompt_without_a_tokenizer_takes_memory_in_proportion_to_its_text():
    """Character blocks are hashed from UTF-32 windows, not a list of code points: 5 million
    characters once took a list of 5 million ints and an array of as many 8-byte integers."""
    import tracemalloc

    body = {"model": MODEL, "messages": [{"role": "user", "content": "abcdefgh" * 625_000}]}
    tracemalloc.start()
    info = analyze(body, True, None, 16, 64, None)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(info.hashes) == info.num_units // 64 > 75_000
    assert peak < 30 * 2**20, f"{peak / 2**20:.0f} MiB"  # the text itself is 5 MB; the chat text another 5


@pytest.mark.parametrize("prompt", [[1, True], [1, -1], [1, 2.0], [1, 1 << 63], [1, "2"], [1, None], [[1], [True]]])
def test_a_prompt_that_is_not_token_ids_is_refused_as_vllm_refuses_it(prompt):
    """Booleans, negatives, floats, ids past int64, strings mixed in: 400 with param ``prompt``."""
    problem = check_body({"model": MODEL, "prompt": prompt}, chat=False)
    assert problem is not None and problem[1] == "prompt"


@pytest.mark.parametrize("prompt", [[0, 5, (1 << 63) - 1], [[1, 2], [3]], ["a", "b"], "text"])
def test_token_ids_strings_and_their_lists_are_accepted(prompt):
    assert check_body({"model": MODEL, "prompt": prompt}, chat=False) is None


def test_token_ids_are_routed_as_tokens_and_anything_else_by_its_characters():
    ids = list(range(100, 164))
    as_tokens = analyze({"model": MODEL, "prompt": ids}, False, None, 16, 64, None)
    assert as_tokens.exact and as_tokens.num_units == 64 and len(as_tokens.hashes) == 4
    with_a_bool = analyze({"model": MODEL, "prompt": [*ids[:-1], True]}, False, None, 16, 64, None)
    assert not with_a_bool.exact  # not token ids: cut into character blocks of its JSON text


def test_a_users_chats_are_conversations_of_their_own_and_a_header_session_is_one():
    from prefix_router.prompts.analysis import conversation_id

    def chat(first: str, *later: str) -> dict:
        return {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": first},
                                           *({"role": "user", "content": t} for t in later)]}

    a1, a2, b1 = chat("plan a trip"), chat("plan a trip", "to Rome"), chat("fix my code")
    by_user = [conversation_id(c, "user:alice", by_user=True) for c in (a1, a2, b1)]
    assert by_user[0] == by_user[1] != by_user[2] and all(c.startswith("user:alice|") for c in by_user)
    assert {conversation_id(c, "session-7") for c in (a1, a2, b1)} == {"session-7"}  # a session id is one
    assert conversation_id({"model": "m", "prompt": "p"}, "user:alice", by_user=True) == "user:alice"  # completion
