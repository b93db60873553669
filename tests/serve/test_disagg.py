"""The two legs of a disaggregated request (``serve/disagg.py``), against the bodies vLLM's own
proxy (``toy_proxy_server.py``) and llm-d's sidecar build, as the module docstring cites."""

from __future__ import annotations

import copy
import json
import time

import pytest
from aiohttp import web

from prefix_router.app import GATEWAY, create_app
from prefix_router.config import config_from_dict
from prefix_router.fleet.breaker import BreakerState
from prefix_router.prompts.tokenizer import ByteTokenizer
from prefix_router.serve.disagg import (PREFILL_PARAMS, TRANSFER_KEY, decode_body, prefill_body, prefill_refusal,
                                       unsplittable)

from ..helpers import MODEL, metric

CONSUMER = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}

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


# -- the flow, through the gateway: scripted prefill replicas, simulated decode replicas ------------

class Prefill:
    """A scripted prefill replica: ``answer`` decides each prefill leg's (status, body); records
    the bodies and X-Request-Ids it received."""

    def __init__(self, answer) -> None:
        self.answer, self.seen = answer, []
        self.app = web.Application()
        self.app.router.add_get("/health", self.plain)
        self.app.router.add_get("/metrics", self.plain)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post(CHAT, self.generate)

    async def plain(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append((body, request.headers.get("X-Request-Id")))
        status, answer = self.answer(body)
        return web.json_response(answer, status=status)


def _answered(params: dict | None):
    def answer(body):
        out = {"id": "chatcmpl-p", "object": "chat.completion", "choices": [{"index": 0, "message": {
            "role": "assistant", "content": "x"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 32}}}
        return 200, ({**out, "kv_transfer_params": params} if params is not None else out)
    return answer


@pytest.fixture
async def split_gateway(aiohttp_server, aiohttp_client, fleet, tmp_path):
    """``await split_gateway(prefills)``: the gateway in front of ``prefills`` (scripted) and two
    simulated decode replicas; (client, decode URLs, request log path)."""

    async def start(prefills, **disaggregation):
        urls = [str((await aiohttp_server(p.app)).make_url("")).rstrip("/") for p in prefills]
        decode = [str(s.make_url("")).rstrip("/") for s in await fleet(2, kv_transfer=CONSUMER)]
        log = tmp_path / "log.jsonl"
        config = config_from_dict({"replicas": [{"url": u, "role": "prefill"} for u in urls]
                                   + [{"url": u, "role": "decode"} for u in decode],
                                   "health": {"interval_s": 60.0}, "scrape": {"interval_s": 60.0},
                                   "request_log": str(log), "disaggregation": disaggregation})
        return await aiohttp_client(create_app(config, ByteTokenizer())), decode, log

    return start


def _lines(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


async def test_a_decode_whose_transfer_fails_is_retried_without_it_on_another_decode_replica(split_gateway):
    # the prefill's parameters name a host nothing listens on: the decode replica answers 500, as vLLM does
    gone = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r", "remote_block_ids": [1],
            "remote_host": "127.0.0.1", "remote_port": 9}
    prefill = Prefill(_answered(gone))
    client, _, log = await split_gateway([prefill])
    resp = await client.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hello " * 20}],
                                         "max_tokens": 3})
    assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 3
    body, request_id = prefill.seen[0]
    assert body["max_tokens"] == 1 and body["stream"] is False and body[TRANSFER_KEY] == PREFILL_PARAMS
    assert request_id and request_id.startswith("prefix-router-")
    (line,) = _lines(log)
    assert line["transfer"] == "decode_retried" and line["replica"] == line["decode_replica"]
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_requests_total", code="500") == 1  # the first decode attempt


async def test_a_prefill_4xx_goes_to_the_client_and_no_decode_leg_is_sent(split_gateway):
    refusing = Prefill(lambda body: (400, {"error": {"message": "bad", "type": "BadRequestError", "param": None,
                                                    "code": 400}}))
    client, _, log = await split_gateway([refusing])
    resp = await client.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "words " * 30}]})
    assert resp.status == 400 and (await resp.json())["error"]["message"] == "bad"
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_decode_requests_total") == 0


async def test_a_failing_prefill_is_retried_on_another_and_none_left_means_the_decode_computes(split_gateway):
    failing = Prefill(lambda body: (500, {"error": {"message": "engine dead", "code": 500}}))
    client, _, log = await split_gateway([failing, Prefill(_answered(None))])
    for i in range(4):
        resp = await client.post(CHAT, json={"model": MODEL, "max_tokens": 2,
                                             "messages": [{"role": "user", "content": f"{i} " + "words " * 30}]})
        assert resp.status == 200
    # the second prefill answered without kv_transfer_params: every decode computed the prompt itself
    assert {line["transfer"] for line in _lines(log)} == {"no_params"}
    client, _, log = await split_gateway([failing])
    resp = await client.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "words " * 30}],
                                         "max_tokens": 2})
    assert resp.status == 200 and _lines(log)[-1]["transfer"] == "prefill_failed"


async def test_a_decode_replica_lacking_only_a_short_suffix_serves_the_request_whole(split_gateway):
    prefill = Prefill(_answered(None))
    client, _, log = await split_gateway([prefill], min_prefill_tokens=64)
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "words " * 80}]}
    assert (await client.post(CHAT, json=body)).status == 200  # new: split (the decode then holds it)
    assert (await client.post(CHAT, json=body)).status == 200
    body["messages"].append({"role": "user", "content": "more"})  # a few tokens past what the decode holds
    assert (await client.post(CHAT, json=body)).status == 200
    other = {**body, "messages": [{"role": "user", "content": "other " * 80}]}
    assert (await client.post(CHAT, json=other)).status == 200
    assert [line["transfer"] for line in _lines(log)] == ["no_params", "short", "short", "no_params"]
    assert len(prefill.seen) == 2


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2 ** 70),
                                          ("max_tokens", "x"), ("max_tokens", 1.5), ("max_completion_tokens", 0),
                                          ("min_tokens", -1), ("min_tokens", 99), ("stream_options", {})])
def test_a_field_the_prefill_leg_replaces_is_checked_before_it_as_vllm_would(field, value):
    body = {"model": "m", "messages": [], "max_tokens": 8, field: value}
    message, param = prefill_refusal(body, CHAT)
    assert param == (field if field != "min_tokens" or value == -1 else "min_tokens") and message


@pytest.mark.parametrize("value", [1, "5", 5.0, True, None])
def test_what_vllms_pydantic_reads_as_a_positive_integer_passes(value):
    assert prefill_refusal({"max_tokens": value, "stream": True, "stream_options": {"include_usage": True}}, CHAT) is None
    assert prefill_refusal({"max_output_tokens": value}, RESPONSES) is None


async def test_a_request_the_decode_would_refuse_holds_no_prefill_blocks_it_gets_its_400_first(split_gateway):
    prefill = Prefill(_answered(None))
    client, _, log = await split_gateway([prefill])
    long = [{"role": "user", "content": "words " * 40}]
    for body in ({"max_tokens": 0}, {"max_tokens": 4, "min_tokens": 9}, {"stream_options": {"include_usage": True}}):
        resp = await client.post(CHAT, json={"model": MODEL, "messages": long, **body})
        assert resp.status == 400, body
    nested = b'{"model":"' + MODEL.encode() + b'","messages":[{"role":"user","content":"' + b"w " * 40 + \
        b'"}],"x":' + b"[" * 1000 + b"]" * 1000 + b"}"
    resp = await client.post(CHAT, data=nested, headers={"Content-Type": "application/json"})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "body"
    assert not prefill.seen


async def test_nan_and_infinities_reach_both_legs_as_the_client_wrote_them(split_gateway):
    prefill = Prefill(_answered(None))
    client, _, _ = await split_gateway([prefill])
    raw = b'{"model":"' + MODEL.encode() + b'","max_tokens":2,"temperature":NaN,"top_p":Infinity,' \
          b'"messages":[{"role":"user","content":"' + b"word " * 40 + b'"}]}'
    await client.post(CHAT, data=raw, headers={"Content-Type": "application/json"})
    body, _ = prefill.seen[0]
    assert body["temperature"] != body["temperature"] and body["top_p"] == float("inf")  # not null


async def test_a_prompt_with_no_full_block_goes_whole_to_its_decode_replica(split_gateway):
    prefill = Prefill(_answered(None))
    client, _, log = await split_gateway([prefill])
    resp = await client.post(CHAT, json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 200 and not prefill.seen and _lines(log)[0]["transfer"] == "short"


async def test_a_prefill_replica_failing_every_request_opens_its_breaker_when_the_decode_serves_them(split_gateway):
    failing = Prefill(lambda body: (500, {"error": {"message": "engine dead", "code": 500}}))
    client, _, log = await split_gateway([failing])
    gw = client.server.app[GATEWAY]
    (name,) = gw.prefill_names
    for i in range(gw.config.breaker.failures):
        resp = await client.post(CHAT, json={"model": MODEL, "max_tokens": 2,
                                             "messages": [{"role": "user", "content": f"{i} " + "words " * 30}]})
        assert resp.status == 200
    assert gw.replicas[name].breaker.state(time.monotonic()) is not BreakerState.CLOSED
    assert {line["transfer"] for line in _lines(log)} == {"prefill_failed"}


async def test_a_decode_leg_refused_after_the_transfer_is_the_decode_replicas_in_the_accounting(split_gateway):
    client, decode, log = await split_gateway([Prefill(_answered({"do_remote_prefill": True, "remote_port": 9}))])
    resp = await client.post(CHAT, json={"model": MODEL, "max_tokens": 10 ** 6,  # past the decode's model length
                                         "messages": [{"role": "user", "content": "words " * 30}]})
    assert resp.status == 400
    (line,) = _lines(log)
    assert line["replica"] == line["decode_replica"] and line["replica"] in {u.split("//")[1] for u in decode}
