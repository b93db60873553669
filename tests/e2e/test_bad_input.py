"""Bad input, case by case: an OpenAI-style 4xx, never a 5xx, and nothing reaches a replica
that the gateway can already refuse. Generated input: tests/e2e/test_fuzz.py."""

from __future__ import annotations

import json

import pytest

from prefix_router.constants import REPLICA_HEADER

from ..helpers import MODEL
from .test_gateway import gateway  # noqa: F401 (fixture)


def _error(status: int, body: dict) -> dict:
    error = body["error"]
    assert error["code"] == status and error["message"]
    return error


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"model": MODEL, "messages": True}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": ["hello"]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, "messages"),
    ("/v1/chat/completions", {"model": 7, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/chat/completions", {"model": MODEL, "stream": "yes", "messages": [{"role": "user", "content": "hi"}]}, "stream"),
    ("/v1/chat/completions", {"model": MODEL, "cache_salt": 1, "messages": [{"role": "user", "content": "hi"}]}, "cache_salt"),
    ("/v1/chat/completions", {"model": MODEL, "tools": {}, "messages": [{"role": "user", "content": "hi"}]}, "tools"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": {"text": "hi"}}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, "two"]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [-1, 2]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
])
async def test_fields_of_the_wrong_shape_get_a_400_naming_the_field_before_any_replica_sees_them(
        fleet, gateway, path, body, param):
    sims = await fleet(1)
    client = await gateway(sims)
    resp = await client.post(path, json=body)
    assert resp.status == 400
    error = _error(400, await resp.json())
    assert error["param"] == param and f"'{param}" in error["message"]
    assert REPLICA_HEADER not in resp.headers


@pytest.mark.parametrize("raw", [b"\xff\xfe{not utf-8", b'{"model": "sim", "messages": [', b"[1, 2]", b"", b"null"])
async def test_bodies_that_are_not_a_json_object_get_a_400(fleet, gateway, raw):
    client = await gateway(await fleet(1))
    resp = await client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    _error(400, await resp.json())


async def test_unknown_paths_and_methods_get_the_replicas_own_404_and_405(fleet, gateway):
    # Paths the gateway has no handler for go to a replica (prefix_router/serve/passthrough.py): a later vLLM's
    # endpoints work through it, and a client sees what vLLM would have said.
    client = await gateway(await fleet(1))
    resp = await client.post("/v1/embeddingz", json={})
    assert resp.status == 404 and REPLICA_HEADER in resp.headers
    resp = await client.get("/v1/chat/completions")
    assert resp.status == 405 and REPLICA_HEADER in resp.headers and "POST" in resp.headers["Allow"]


async def test_with_every_replica_down_a_passthrough_gets_an_openai_style_503(aiohttp_server, gateway):
    from aiohttp import web

    async def failing(_):
        return web.Response(status=500)

    down = web.Application()
    down.router.add_get("/health", failing)
    client = await gateway([await aiohttp_server(down)])
    resp = await client.get("/version")
    assert resp.status == 503
    _error(503, await resp.json())


async def test_an_unknown_model_gets_a_404_in_vllms_words(fleet, gateway):
    # The gateway reads each replica's /v1/models every scrape.models_interval_s, and again before refusing a
    # model none listed (a LoRA adapter loaded since), so its 404 is the one vLLM would give.
    client = await gateway(await fleet(1))
    resp = await client.post("/v1/chat/completions",
                             json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 404
    assert "no-such-model" in _error(404, await resp.json())["message"]


async def test_odd_tools_and_tool_calls_never_break_the_gateways_fingerprints(fleet, gateway):
    # The gateway fingerprints every conversation's messages and tools (prefix_router/misses/diagnosis.py);
    # what it cannot read there must be the replica's to judge, never a 500 from here.
    client = await gateway(await fleet(1))
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"function": "x"}, 7, {"function": {"arguments": "{"}}]},
                {"role": "tool", "content": [{"type": "text", "text": "{\"a\": 1}"}]}]
    for tools in ([{"function": "str"}, 5, {"function": None}], [{"type": "function"}], []):
        for turn in (messages[:1], messages):
            resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": turn, "tools": tools},
                                     headers={"X-Session-ID": "odd"})
            assert resp.status < 500, await resp.text()


async def test_an_oversized_header_gets_a_400_and_the_gateway_keeps_serving(fleet, gateway):
    client = await gateway(await fleet(1))
    resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                             headers={"X-Huge": "x" * 20_000})
    assert resp.status == 400
    resp = await client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                           "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 200


@pytest.mark.parametrize("where", ["model", "cache_salt", "user", "content", "session"])
async def test_lone_surrogates_anywhere_get_an_answer_below_500(fleet, gateway, where):
    # JSON may escape a lone surrogate ("\ud800"), which Python decodes into a str no strict
    # UTF-8 encoder accepts; a header may carry bytes that are not UTF-8 at all
    client = await gateway(await fleet(1))
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Content-Type": "application/json"}
    if where == "content":
        body["messages"][0]["content"] = "hi \ud800 there"
    elif where == "session":
        headers["X-Session-ID"] = "s\udcff\udcfe"  # what aiohttp makes of the raw bytes \xff\xfe
    else:
        body[where] = "x\ud800"
    raw = json.dumps(body).encode()
    resp = await client.post("/v1/chat/completions", data=raw, headers=headers)
    assert resp.status < 500, await resp.text()
    if resp.status >= 400:
        _error(resp.status, await resp.json())


async def test_a_gzip_body_is_forwarded_decompressed_and_a_broken_one_gets_a_400(fleet, gateway, aiohttp_server):
    import gzip

    from .test_gateway_http import EchoReplica

    echo = EchoReplica()
    client = await gateway([await aiohttp_server(echo.app)])
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    resp = await client.post("/v1/chat/completions", data=gzip.compress(raw),
                             headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert resp.status == 200
    (_, headers, forwarded), = echo.requests
    assert "Content-Encoding" not in headers and json.loads(forwarded) == json.loads(raw)
    resp = await client.post("/v1/chat/completions", data=raw,
                             headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert resp.status == 400
    _error(400, await resp.json())
    assert len(echo.requests) == 1
