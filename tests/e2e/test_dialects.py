"""Responses and Anthropic Messages through the gateway: a Responses chain routed home with its
history, streams relayed unchanged and their usage counted, and what a hostile or sloppy client
(or replica) sends. The replicas are small aiohttp apps that answer as vLLM 0.32 does; the chat
request each API is read as: ``tests/prompts/test_responses.py`` and ``test_anthropic.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
from aiohttp import web

from prefix_router.app import GATEWAY, create_app
from prefix_router.config import config_from_dict
from prefix_router.constants import REPLICA_HEADER
from prefix_router.prompts.responses import MESSAGES, RESPONSES
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import MODEL, metric
from ..prompts.test_responses import ANTHROPIC_USAGE, USAGE, _messages_stream, _responses_stream

# -- the gateway ------------------------------------------------------------------------------

_ids = itertools.count()
SEEN = web.AppKey("seen", list)  # the bodies of the generation requests a replica got


def replica_app() -> web.Application:
    """A replica answering vLLM's probes, /v1/responses (stored, streamed or not) and /v1/messages,
    each answer reporting that 64 of its 100 prompt tokens were cached."""
    app = web.Application()
    app[SEEN] = []
    store: set[str] = set()

    async def ok(_):
        return web.Response(text="")

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def stream(request, data: bytes) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(data)
        await resp.write_eof()
        return resp

    async def responses(request):
        body = await request.json()
        app[SEEN].append(body)
        previous = body.get("previous_response_id")
        if previous is not None and previous not in store:
            return web.json_response({"error": {"message": f"Response with id '{previous}' not found.",
                                                "code": 404}}, status=404)
        rid = f"resp_{next(_ids)}"
        store.add(rid)
        if body.get("stream"):
            return await stream(request, _responses_stream(rid, USAGE, text=f"answer {rid}"))
        return web.json_response({"id": rid, "object": "response", "status": "completed", "usage": USAGE, "output": [
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"answer {rid}"}]}]})

    async def messages(request):
        body = await request.json()
        app[SEEN].append(body)
        if body.get("stream"):
            return await stream(request, _messages_stream(ANTHROPIC_USAGE))
        return web.json_response({"id": "m", "type": "message", "content": [{"type": "text", "text": "hi"}],
                                  "usage": ANTHROPIC_USAGE})

    for path, handler in (("/health", ok), ("/metrics", ok), ("/v1/models", models)):
        app.router.add_get(path, handler)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    return app


def _response_id(data: bytes) -> str:
    """The id of a Responses answer, one body or a stream."""
    if not data.startswith(b"event:"):
        return json.loads(data)["id"]
    return next(json.loads(line[6:])["response"]["id"] for line in data.splitlines() if line.startswith(b"data: {"))


async def start(aiohttp_server, aiohttp_client, n: int = 2):
    apps = [replica_app() for _ in range(n)]
    servers = [await aiohttp_server(app) for app in apps]
    data = {"replicas": [str(s.make_url("")).rstrip("/") for s in servers], "health": {"interval_s": 0.2},
            "scrape": {"interval_s": 0.2}}
    client = await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))
    return apps, client, client.server.app[GATEWAY]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_responses_chain_is_routed_home_with_its_history_and_counted(aiohttp_server, aiohttp_client, stream):
    apps, client, gw = await start(aiohttp_server, aiohttp_client)
    rids, homes = [], []
    for turn in range(3):
        body = {"model": MODEL, "instructions": "Be brief.", "input": f"question {turn}", "stream": stream}
        if rids:
            body["previous_response_id"] = rids[-1]
        resp = await client.post("/v1/responses", json=body)
        assert resp.status == 200
        rids.append(_response_id(await resp.read()))
        homes.append(resp.headers[REPLICA_HEADER])
        assert gw.response_homes.home(rids[-1]) == homes[-1]
    assert len(set(homes)) == 1
    history = [m["content"] for m in gw.response_homes.history(rids[-1])]
    # what vLLM renders next: the instructions, then every turn and every answer
    assert history == ["Be brief.", *(text for i, rid in enumerate(rids) for text in (f"question {i}", f"answer {rid}"))]
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_cached_tokens_total", replica=homes[0]) == 3 * 64
    assert metric(page, "prefix_router_prompt_tokens_total", replica=homes[0]) == 3 * 100
    assert metric(page, "prefix_router_cache_requests_total") == 3


async def test_a_chain_whose_replica_is_down_gets_a_503_naming_previous_response_id(aiohttp_server, aiohttp_client):
    apps, client, gw = await start(aiohttp_server, aiohttp_client)
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": "q"})
    rid, home = (await resp.json())["id"], resp.headers[REPLICA_HEADER]
    gw.replicas[home].healthy = False
    chained = await client.post("/v1/responses", json={"model": MODEL, "input": "q2", "previous_response_id": rid})
    assert chained.status == 503
    error = (await chained.json())["error"]
    assert error["param"] == "previous_response_id" and home in error["message"]
    assert sum(len(app[SEEN]) for app in apps) == 1  # not sent to a replica that would answer 404


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_are_relayed_unchanged_and_their_usage_counted(aiohttp_server, aiohttp_client, stream):
    apps, client, gw = await start(aiohttp_server, aiohttp_client, n=1)
    body = {"model": MODEL, "max_tokens": 8, "system": "S", "stream": stream,
            "messages": [{"role": "user", "content": "hello"}], "metadata": {"user_id": "session-7"}}
    resp = await client.post("/v1/messages", json=body)
    assert resp.status == 200
    data = await resp.read()
    assert data == _messages_stream(ANTHROPIC_USAGE) if stream else json.loads(data)["usage"] == ANTHROPIC_USAGE
    assert apps[0][SEEN] == [body]  # forwarded as sent: no stream_options added
    assert gw.conversations.get("user:session-7") is not None  # metadata.user_id names the session
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_cached_tokens_total") == 64
    assert metric(page, "prefix_router_prompt_tokens_total") == 100


@pytest.mark.parametrize("path, body, param", [
    ("/v1/responses", {"model": MODEL, "input": 5}, "input"),
    ("/v1/responses", {"model": MODEL, "input": ["x"]}, "input"),
    ("/v1/responses", {"model": MODEL, "input": "x", "instructions": ["a"]}, "instructions"),
    ("/v1/messages", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/messages", {"model": MODEL, "messages": [{"content": "x"}]}, "messages"),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "system": 3}, "system"),
])
async def test_a_body_vllm_would_refuse_gets_an_openai_400_without_a_hop(aiohttp_server, aiohttp_client, path, body,
                                                                         param):
    apps, client, _ = await start(aiohttp_server, aiohttp_client, n=1)
    resp = await client.post(path, json=body)
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == param
    assert apps[0][SEEN] == []


# -- what a hostile or sloppy client (or replica) sends ----------------------------------------

async def test_a_chain_without_history_is_passed_through_with_the_tenants_salt(aiohttp_server, aiohttp_client):
    app = replica_app()
    server = await aiohttp_server(app)
    data = {"replicas": [str(server.make_url("")).rstrip("/")], "health": {"interval_s": 0.2},
            "scrape": {"interval_s": 0.2}, "auth": {"tenants": [{"name": "acme", "keys": ["key-of-acme"]}]}}
    client = await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))
    key = {"Authorization": "Bearer key-of-acme"}
    first = await client.post("/v1/responses", json={"model": MODEL, "input": "q", "store": False}, headers=key)
    rid = (await first.json())["id"]  # not stored: the gateway keeps its home, no history
    body = {"model": MODEL, "input": "q2", "previous_response_id": rid, "cache_salt": "someone-else",
            "vllm_xargs": {"kv_cache_report_mode": "full", "x": 1}, "seed": 12345678901234567890123}
    chained = await client.post("/v1/responses", json=body, headers=key)
    assert chained.status == 200
    sent = app[SEEN][-1]
    assert sent["cache_salt"] != "someone-else" and sent["cache_salt"] == app[SEEN][0]["cache_salt"]
    assert sent["vllm_xargs"] == {"x": 1}
    assert sent["seed"] == 12345678901234567890123  # exact: re-encoded from the client's bytes


def cutting_replica(path: str) -> web.Application:
    """A replica whose stream stops in the middle of an event (its process died)."""
    app = web.Application()

    async def ok(_):
        return web.Response(text="")

    async def generate(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        whole = _responses_stream("resp_cut", USAGE) if path == RESPONSES else _messages_stream(ANTHROPIC_USAGE)
        first = whole.index(b"\n\n") + 2
        await resp.write(whole[:first])  # one whole event: the client's stream has begun
        await asyncio.sleep(0.05)
        await resp.write(whole[first:first + 25])  # then half a line
        await asyncio.sleep(0.05)
        request.transport.abort()
        return resp

    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    app.router.add_post(path, generate)
    return app


@pytest.mark.parametrize("path", [RESPONSES, MESSAGES])
async def test_a_stream_cut_mid_event_ends_with_the_apis_own_error_event_on_a_line_of_its_own(
        aiohttp_server, aiohttp_client, path):
    server = await aiohttp_server(cutting_replica(path))
    data = {"replicas": [str(server.make_url("")).rstrip("/")], "health": {"interval_s": 0.2}}
    client = await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))
    body = ({"model": MODEL, "input": "q", "stream": True} if path == RESPONSES else
            {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "q"}]})
    resp = await client.post(path, json=body)
    text = (await resp.read()).decode()
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2].startswith("event: error\ndata: {"), text[-300:]
    error = json.loads(events[-2].split("data: ", 1)[1])
    assert error["type"] == "error" and "stopped streaming" in json.dumps(error)
    for event in events[:-2]:  # every event before it whole
        for line in event.split("\n"):
            assert line.startswith(("event: ", "data: {")) and (not line.startswith("data: ") or json.loads(line[6:]))


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "image", "source": "http://x/y.png"}]}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]}],
    [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": 5}]}]}],
    [{"role": "system", "content": 5}, {"role": "user", "content": "q"}],
    [{"role": "user", "content": "q", "extra": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}],
], ids=["image-source-string", "thinking-number", "tool-result-number", "system-number", "nested"])
async def test_odd_content_blocks_are_the_replicas_to_judge(aiohttp_server, aiohttp_client, messages):
    apps, client, _ = await start(aiohttp_server, aiohttp_client, n=1)
    body = {"model": MODEL, "max_tokens": 4, "messages": messages}
    resp = await client.post("/v1/messages", json=body)
    assert resp.status == 200 and apps[0][SEEN] == [body]


async def test_a_body_nested_deeper_than_python_walks_gets_a_400(aiohttp_server, aiohttp_client):
    apps, client, _ = await start(aiohttp_server, aiohttp_client, n=1)
    deep = "[" * 990 + "]" * 990  # orjson reads it; Python's json and the templates cannot
    raw = f'{{"model": "{MODEL}", "input": [{{"role": "user", "content": "x", "extra": {deep}}}]}}'
    resp = await client.post("/v1/responses", data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "body"
    assert apps[0][SEEN] == []


async def test_odd_usage_from_a_replica_is_counted_as_nothing(aiohttp_server, aiohttp_client):
    app = web.Application()

    async def ok(_):
        return web.Response(text="")

    async def answer(_):
        return web.json_response({"id": "r", "status": "completed", "output": 5,
                                  "usage": {"input_tokens": "abc", "output_tokens": -3}})

    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    app.router.add_post("/v1/responses", answer)
    server = await aiohttp_server(app)
    data = {"replicas": [str(server.make_url("")).rstrip("/")], "health": {"interval_s": 0.2}}
    client = await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": "q", "model_extra": 1})
    assert resp.status == 200
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_prompt_tokens_total") == 0
    assert metric(page, "prefix_router_requests_total", code="200") == 1
