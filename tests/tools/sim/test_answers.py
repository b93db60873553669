"""The simulated replica's answers (``prefix_router/tools/sim/answers.py``): one request's answer in
each API's shape; the HTTP side is in ``test_server.py``."""

from __future__ import annotations

import json

from prefix_router.tools.sim.answers import Answer, usage_of
from prefix_router.tools.sim.scheduler import SimRequest


def finished(prompt: int, out: int, cached: int = 0) -> SimRequest:
    request = SimRequest("r", list(range(prompt)), out, model="m")
    request.token_ids += [7] * out
    request.num_cached_tokens, request.finish_reason = cached, "length"
    return request


def test_usage_counts_the_prompt_once_and_every_sequences_output():
    usage = usage_of([finished(30, 4, cached=16), finished(30, 2, cached=0)])
    assert usage == {"prompt_tokens": 30, "total_tokens": 36, "completion_tokens": 6,
                     "prompt_tokens_details": {"cached_tokens": 16}}


def test_a_prefill_legs_transfer_parameters_go_at_the_top_of_the_body():
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2]}
    for kind in ("completion", "chat", "responses"):
        body = Answer(kind, "x-1", "m", False).body([finished(20, 1)], ["a"], params)
        assert body["kv_transfer_params"] == params
        assert "kv_transfer_params" not in Answer(kind, "x-1", "m", False).body([finished(20, 1)], ["a"], None)


def test_a_responses_stream_numbers_its_events_and_closes_with_the_text_it_sent():
    answer = Answer("responses", "resp_1", "m", False)
    text = answer.start() + answer.chunk(0, "he", None, 0.01) + answer.chunk(0, "llo", "length", None)
    text += answer.end([finished(20, 2)])
    events = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "hello"
    assert events[-1]["response"]["usage"]["output_tokens"] == 2


def test_the_first_event_with_tokens_carries_the_simulators_own_times_and_no_other_does():
    for kind in ("completion", "chat", "responses"):
        answer = Answer(kind, "x-1", "m", False)
        first, later = answer.chunk(0, "he", None, 0.0123456789, 0.25), answer.chunk(0, "llo", None, None, None)
        events = [json.loads(line[6:]) for line in first.split("\n") if line.startswith("data: ")]
        timed = [e for e in events if "sim_ttft_s" in e]
        assert len(timed) == 1, kind  # on the event with the text (a chat's role chunk goes first)
        assert (timed[0]["sim_ttft_s"], timed[0]["sim_modelled_ttft_s"]) == (0.012346, 0.25)
        assert "sim_ttft_s" not in later and "sim_modelled_ttft_s" not in later
