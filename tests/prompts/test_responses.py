"""The Responses API read as the chat request vLLM renders for it
(``prefix_router/prompts/responses.py``): instructions, history and items as chat messages, tools
as function tools, and the events of a Responses or Messages stream read however it is cut.

Through the gateway, with small aiohttp replicas that answer as vLLM 0.32 does:
``tests/e2e/test_dialects.py``; against vLLM's own render endpoints:
``tests/vllm_tier/test_apis_and_adapters_vllm.py``. Anthropic Messages:
``test_anthropic.py``.
"""

from __future__ import annotations

import json

import pytest

from prefix_router.fleet.response_homes import ResponseHomes
from prefix_router.prompts.responses import MESSAGES, RESPONSES, Events, chat_usage, responses_prompt

from ..helpers import MODEL

# -- the chat request each API is read as -------------------------------------------------------


def test_responses_instructions_history_and_items_become_chat_messages():
    history = [{"role": "system", "content": "old instructions"}, {"role": "user", "content": "q1"},
               {"role": "assistant", "content": "a1"}]
    body = {"model": MODEL, "instructions": "new instructions", "cache_salt": "s", "input": [
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "look it up"}], "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get", "namespace": "ns", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "other", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}
    chat = responses_prompt(body, history)
    assert chat["cache_salt"] == "s" and chat["model"] == MODEL
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "user", "assistant", "tool"]
    assert chat["messages"][0]["content"] == "new instructions"  # the old ones do not carry over
    merged = chat["messages"][4]  # reasoning and both calls in one assistant message
    assert merged["reasoning"] == "look it up"
    assert [c["function"]["name"] for c in merged["tool_calls"]] == ["ns__get", "other"]
    assert chat["messages"][5] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


def test_a_last_incomplete_assistant_message_is_continued():
    body = {"input": [{"role": "user", "content": "q"}, {"type": "message", "role": "assistant", "status": "incomplete",
                                                         "content": [{"type": "output_text", "text": "so far"}]}]}
    chat = responses_prompt(body)
    assert chat["messages"][-1] == {"role": "assistant", "content": "so far"}
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False


def test_reading_a_responses_body_leaves_the_clients_items_unchanged():
    item = {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}
    body = {"input": [item, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}
    before = json.dumps(body)
    responses_prompt(body)
    assert json.dumps(body) == before  # the call was merged into a copy of the item, not into the item


def test_responses_tools_are_shown_as_chat_function_tools():
    tools = [{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True},
             {"type": "custom", "name": "run"}, {"type": "web_search"},
             {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "g"}]}]
    chat = responses_prompt({"input": "x", "tools": tools})
    names = [t["function"]["name"] for t in chat["tools"]]
    assert names == ["f", "run", "ns__g"]  # a built-in tool is not shown to the model
    assert chat["tools"][0]["function"]["strict"] is True
    assert chat["tools"][1]["function"]["parameters"]["required"] == ["input"]


# -- answers ----------------------------------------------------------------------------------

def _responses_stream(rid: str, usage: dict, text: str = "hi") -> bytes:
    response = {"id": rid, "object": "response", "status": "completed", "usage": usage,
                "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]}
    events = [("response.created", {"response": {**response, "status": "in_progress", "usage": None, "output": []},
                                    "type": "response.created"}),
              ("response.output_text.delta", {"delta": text, "type": "response.output_text.delta"}),
              ("response.completed", {"response": response, "type": "response.completed"})]
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


def _messages_stream(usage: dict, text: str = "hi") -> bytes:
    events = [("message_start", {"type": "message_start", "message": {
                  "id": "m1", "usage": {"input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"],
                                        "output_tokens": 0}}}),
              ("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": text}}),
              ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": usage}),
              ("message_stop", {"type": "message_stop"})]
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


USAGE = {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 64}, "output_tokens": 3}
ANTHROPIC_USAGE = {"input_tokens": 36, "output_tokens": 3, "cache_creation_input_tokens": 0,
                   "cache_read_input_tokens": 64}


@pytest.mark.parametrize("cut", [1, 7, 64, 10_000])
def test_events_pass_a_stream_unchanged_and_read_it_however_it_is_cut(cut):
    for stream, path in ((_responses_stream("resp_1", USAGE), RESPONSES), (_messages_stream(ANTHROPIC_USAGE), MESSAGES)):
        events = Events(path)
        out = b"".join(events.feed(stream[i:i + cut]) for i in range(0, len(stream), cut)) + events.flush()
        assert out == stream and events.saw_data
        assert chat_usage(path, events.usage) == {"prompt_tokens": 100, "completion_tokens": 3,
                                                  "prompt_tokens_details": {"cached_tokens": 64}}
        if path == RESPONSES:
            assert events.response_id == "resp_1" and events.response["output"][0]["content"][0]["text"] == "hi"


def test_the_first_token_is_the_first_delta_event_not_the_first_event():
    events = Events(RESPONSES)
    events.feed(_responses_stream("resp_2", USAGE).split(b"event: response.output_text.delta")[0])
    assert not events.saw_data and events.response_id == "resp_2"


def test_response_histories_are_bounded_by_their_characters_and_their_ids_outlive_them():
    homes = ResponseHomes(capacity=10, history_chars=1_000)
    turn = [{"role": "user", "content": "x" * 300}]  # charged 400 characters
    homes.remember("r1", "a", turn)
    homes.remember("r2", "b", turn)
    homes.remember("r3", "a", turn)  # over the budget: the oldest history goes, its home stays
    assert homes.history("r1") is None and homes.home("r1") == "a"
    assert homes.history("r3") == turn and homes.history("r2") == turn
    homes.remember("big", "b", [{"role": "user", "content": "x" * 2_000}])  # larger than the budget: not kept
    assert homes.history("big") is None and homes.history("r3") == turn
    for i in range(10):
        homes.remember(f"n{i}", "a")
    assert homes.home("r3") is None and homes.history("r3") is None  # an id dropped takes its history along
