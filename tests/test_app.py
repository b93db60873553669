"""The gateway's application (``prefix_router/app.py``): what it answers itself. Requests the HTTP
parser refuses get an OpenAI error, ``/ready`` is right from the first request, and
``/debug/changes`` checks its count. Requests routed through it: ``tests/e2e/``."""

from __future__ import annotations

import asyncio
import json

import pytest

from prefix_router.app import create_app
from prefix_router.config import config_from_dict
from prefix_router.prompts.tokenizer import ByteTokenizer

from .helpers import MODEL


@pytest.mark.parametrize("top", ["\u00b2", "\u0661", "-1", "0"])
async def test_the_change_view_refuses_a_count_that_is_not_ascii_digits_as_json(aiohttp_client, fleet, top):
    (sim,) = await fleet(1)
    client = await aiohttp_client(create_app(config_from_dict({"replicas": [str(sim.make_url("")).rstrip("/")]}),
                                             ByteTokenizer()))
    resp = await client.get("/debug/changes", params={"top": top})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "top"


@pytest.mark.parametrize("raw", [b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
                                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"])
async def test_requests_the_http_parser_refuses_get_an_openai_error(aiohttp_server, raw):
    server = await aiohttp_server(create_app(config_from_dict({}), ByteTokenizer()))
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(raw)
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 400") and b"application/json" in head
    error = json.loads(body)["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]


async def test_a_gateway_started_with_every_replica_down_is_not_ready_from_its_first_request(aiohttp_client):
    from prefix_router.tools.launch import free_port

    down = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens there
    client = await aiohttp_client(create_app(config_from_dict(
        {"replicas": down, "health": {"interval_s": 60}, "scrape": {"interval_s": 60}}), ByteTokenizer()))
    ready = await client.get("/ready")  # before any periodic check could have run
    assert ready.status == 503 and (await ready.json())["healthy_replicas"] == 0
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert resp.status == 503
