"""The gateway's application (``prefix_router/app.py``): what it answers itself. Requests the HTTP
parser refuses get an OpenAI error, ``/ready`` is right from the first request,
``/debug/changes`` checks its count, and ``GET /`` is the status page for whoever takes HTML (its
figures: ``tests/serve/test_status_page.py``). Requests routed through it: ``tests/e2e/``."""

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


BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


async def test_root_is_the_status_page_for_a_browser_and_curl_and_the_replicas_answer_for_the_rest(
        aiohttp_client, fleet):
    (sim,) = await fleet(1)
    url = str(sim.make_url("")).rstrip("/")
    client = await aiohttp_client(create_app(config_from_dict({"replicas": [url]}), ByteTokenizer()))
    for headers in (BROWSER, {"Accept": "*/*"}):
        resp = await client.get("/", headers=headers)
        page = await resp.text()
        assert resp.status == 200 and resp.content_type == "text/html" and "default-src 'none'" in \
            resp.headers["Content-Security-Policy"]
        assert '<meta http-equiv="refresh"' in page and url.split("//")[1] in page
    head = await client.head("/", headers=BROWSER)
    assert head.status == 200 and head.content_type == "text/html" and await head.read() == b""
    # a JSON client and other methods get what the replica answers, as before the page existed
    for method, headers in (("GET", {"Accept": "application/json"}), ("POST", {}), ("DELETE", BROWSER)):
        async with client.session.request(method, str(sim.make_url("/")), headers=headers) as direct:
            expected = direct.status
        resp = await client.request(method, "/", headers=headers)
        assert resp.status == expected != 200 and resp.content_type != "text/html"
        assert resp.headers.get("x-prefix-router-replica") == url.split("//")[1]


async def test_the_status_page_needs_an_admin_key_once_keys_are_configured(aiohttp_client, fleet):
    (sim,) = await fleet(1)
    config = config_from_dict({"replicas": [str(sim.make_url("")).rstrip("/")],
                               "auth": {"tenants": [{"name": "acme", "keys": ["sk-acme-0001"]}],
                                        "admin_keys": ["sk-admin-0001"]}})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    assert (await client.get("/", headers=BROWSER)).status == 401
    assert (await client.get("/", headers={**BROWSER, "Authorization": "Bearer sk-acme-0001"})).status == 403
    resp = await client.get("/", headers={**BROWSER, "Authorization": "Bearer sk-admin-0001"})
    assert resp.status == 200 and resp.content_type == "text/html"


async def test_the_endpoint_pickers_http_port_serves_the_page_whatever_the_client_accepts(aiohttp_client):
    client = await aiohttp_client(create_app(config_from_dict({}), ByteTokenizer(), proxy=False))
    resp = await client.get("/", headers={"Accept": "application/json"})
    assert resp.status == 200 and resp.content_type == "text/html"  # nothing behind it to answer instead
    assert (await client.post("/")).status == 405
