"""The two legs of a disaggregated request (``serve/disagg.py``), against the bodies vLLM's own
proxy (``toy_proxy_server.py``) and llm-d's sidecar build, as the module docstring cites."""

from __future__ import annotations

import copy

import pytest

from prefix_router.serve.disagg import PREFILL_PARAMS, TRANSFER_KEY, decode_body, prefill_body, unsplittable

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"


def _chat(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 8, "temperature": 0.0, **extra}


def test_the_prefill_leg_asks_for_one_token_unstreamed_and_holds_the_blocks_for_a_remote_decode():
    body = _chat(max_completion_tokens=64, min_completion_tokens=4)
    before = copy.deepcopy(body)
    leg = prefill_body(body, CHAT)
    # vLLM's toy_proxy_server.py, literally: a change to the module's constant must show here
    assert leg[TRANSFER_KEY] == {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert leg[TRANSFER_KEY] == PREFILL_PARAMS and leg[TRANSFER_KEY] is not PREFILL_PARAMS
    assert leg["stream"] is False and leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1
    for dropped in ("stream_options", "min_tokens", "min_completion_tokens"):
        assert dropped not in leg
    assert leg["messages"] == body["messages"] and leg["temperature"] == 0.0
    assert body == before  # the client's body is the decode leg's: untouched


def test_each_api_limits_its_own_token_count():
    assert prefill_body(_chat(), CHAT).get("max_completion_tokens") is None  # only where the client sent it
    leg = prefill_body({"model": "m", "prompt": "p"}, COMPLETIONS)
    assert leg["max_tokens"] == 1 and "max_completion_tokens" not in leg
    leg = prefill_body({"model": "m", "input": "hi", "max_output_tokens": 500, "stream": True}, RESPONSES)
    assert leg["max_output_tokens"] == 1 and "max_tokens" not in leg and leg["stream"] is False
    assert leg["store"] is False and leg["background"] is False  # vLLM would store it, or answer at once
    with pytest.raises(KeyError):
        prefill_body({"model": "m"}, "/v1/messages")


def test_the_decode_leg_carries_the_prefill_answers_parameters_unchanged():
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
              "remote_engine_id": "e1", "remote_host": "10.0.0.7", "remote_port": 5600, "tp_size": 1}
    body = _chat()
    leg, carried = decode_body(body, {"id": "cmpl-1", "choices": [], TRANSFER_KEY: params})
    assert carried and leg[TRANSFER_KEY] == params
    assert {k: v for k, v in leg.items() if k != TRANSFER_KEY} == body  # streamed and limited as asked


@pytest.mark.parametrize("answer", [{"choices": []}, {TRANSFER_KEY: None}, {TRANSFER_KEY: {}}, None, ["x"]])
def test_without_parameters_the_decode_replica_computes_the_prompt_and_nothing_of_the_clients_is_sent(answer):
    body = _chat(**{TRANSFER_KEY: {"do_remote_prefill": True, "remote_block_ids": [[7]], "remote_host": "evil"}})
    leg, carried = decode_body(body, answer)
    assert not carried and TRANSFER_KEY not in leg and leg["messages"] == body["messages"]
    leg, carried = decode_body(body, {TRANSFER_KEY: {"remote_host": "prefill-0"}})
    assert carried and leg[TRANSFER_KEY] == {"remote_host": "prefill-0"}


@pytest.mark.parametrize("body, path, reason", [
    ({"n": 2}, CHAT, "n > 1"), ({"n": "2"}, CHAT, "n > 1"), ({"n": 2.0}, COMPLETIONS, "n > 1"),
    ({"prompt_embeds": ["e1", "e2"]}, COMPLETIONS, "prompt embeddings"),
    ({"input": "x", "previous_response_id": "resp_1"}, RESPONSES, "continued Response"),
    ({"prompt": ["a", "b"]}, COMPLETIONS, "a list of prompts"),
    ({"prompt": [[1, 2], [3, 4]]}, COMPLETIONS, "a list of prompts"),
    ({"use_beam_search": True}, COMPLETIONS, "beam search"),
    ({}, "/v1/messages", "not split"),
])
def test_what_one_transfer_cannot_carry_goes_whole_to_one_replica(body, path, reason):
    assert reason in unsplittable({"model": "m", **body}, path)


@pytest.mark.parametrize("body, path", [
    ({"n": 1, "messages": []}, CHAT), ({"n": None}, CHAT), ({"prompt": [1, 2, 3]}, COMPLETIONS),
    ({"prompt": ["one"]}, COMPLETIONS), ({"prompt": "p"}, COMPLETIONS), ({"input": "x"}, RESPONSES),
])
def test_one_prompt_one_sequence_is_split(body, path):
    assert unsplittable({"model": "m", **body}, path) is None
