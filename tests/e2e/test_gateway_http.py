"""The gateway's HTTP surface, in process: limits, header forwarding, the OpenAI client,
metrics, prompt privacy and a fleet that is entirely down.

Simulated replicas (``prefix_router.tools.sim``) where the engine matters; a tiny echo server as the
"replica" where the test needs to see exactly what reached it.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import random
import uuid

import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from prefix_router.app import GATEWAY, create_app
from prefix_router.config import config_from_dict
from prefix_router.constants import REPLICA_HEADER
from prefix_router.serve.passthrough import REPLICAS_HEADER
from prefix_router.metrics import METRIC_NAMES
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import MODEL, text

ERROR_FIELDS = {"message", "type", "param", "code"}


def url_of(server) -> str:
    return str(server.make_url("")).rstrip("/")


def answer(response):
    """An aiohttp handler that always answers a fresh copy of ``response()``."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return response()

    return handler


# --- fixtures ------------------------------------------------------------------------------

class EchoReplica:
    """A minimal replica: records what reached it and answers a fixed completion."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.app = web.Application(client_max_size=1 << 30)
        self.app.router.add_post("/v1/completions", self.generate)
        self.app.router.add_post("/v1/chat/completions", self.generate)
        self.app.router.add_get("/health", answer(lambda: web.Response(text="ok")))
        self.app.router.add_get("/metrics", answer(lambda: web.Response(body=b"", content_type="text/plain")))
        self.app.router.add_get("/v1/models", answer(lambda: web.json_response(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "echo"}]})))

    async def generate(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.requests.append((request.path, dict(request.headers), raw))
        if self.status != 200:
            return web.json_response({"error": {"message": "engine failed", "type": "InternalServerError",
                                                "param": None, "code": self.status}}, status=self.status)
        chat = request.path.endswith("chat/completions")
        choice = ({"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"} if chat
                  else {"index": 0, "text": "ok", "finish_reason": "stop"})
        return web.json_response({
            "id": "cmpl-echo", "object": "chat.completion" if chat else "text_completion", "created": 0,
            "model": "echo-model", "choices": [choice],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11,
                      "prompt_tokens_details": {"cached_tokens": 0}}})


@pytest.fixture
async def echo(aiohttp_server):
    async def start(status: int = 200):
        replica = EchoReplica(status)
        replica.server = await aiohttp_server(replica.app)
        return replica

    return start


@pytest.fixture
async def gateway(aiohttp_client):
    async def start(servers, tokenizer=True, **sections):
        data = {"replicas": [url_of(s) for s in servers],
                "health": {"interval_s": 0.2, "unhealthy_after": 1}, "scrape": {"interval_s": 0.2}}
        data.update(sections)
        return await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer() if tokenizer else None))

    return start


def families(metrics_text: str) -> dict[str, object]:
    """Metric families by the name they are exported under: prometheus-client's parser drops the
    ``_total`` suffix from counter family names, so put it back for counters. The ``*_created``
    series prometheus-client adds to counters and histograms (creation timestamps, parsed as
    families of their own) are left out."""
    out = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name.endswith("_created"):
            continue
        name = family.name + "_total" if family.type == "counter" else family.name
        out[name] = family
    return out


# --- limits --------------------------------------------------------------------------------

async def test_a_body_above_max_body_bytes_gets_413_with_an_openai_error_and_never_reaches_a_replica(echo, gateway):
    replica = await echo()
    limit = 2048
    client = await gateway([replica.server], limits={"max_body_bytes": limit})
    prompt_room = limit - len(json.dumps({"model": MODEL, "prompt": "", "max_tokens": 1}))

    def body(size: int) -> bytes:
        raw = json.dumps({"model": MODEL, "prompt": "x" * (prompt_room + size - limit), "max_tokens": 1}).encode()
        assert len(raw) == size
        return raw

    resp = await client.post("/v1/completions", data=body(limit + 1), headers={"Content-Type": "application/json"})
    assert resp.status == 413
    error = (await resp.json())["error"]
    assert set(error) == ERROR_FIELDS and error["code"] == 413
    assert replica.requests == []

    async def chunks():  # no Content-Length: the limit must hold while reading
        raw = body(limit + 1)
        for i in range(0, len(raw), 256):
            yield raw[i:i + 256]

    resp = await client.post("/v1/completions", data=chunks(), headers={"Content-Type": "application/json"})
    assert resp.status == 413
    assert set((await resp.json())["error"]) == ERROR_FIELDS
    assert replica.requests == []

    resp = await client.post("/v1/completions", data=body(limit), headers={"Content-Type": "application/json"})
    assert resp.status == 200  # exactly at the limit is allowed
    assert len(replica.requests) == 1


# --- header forwarding ------------------------------------------------------------------------

async def test_the_clients_authorization_and_custom_headers_reach_the_replica_but_hop_by_hop_headers_do_not(echo, gateway):
    replica = await echo()
    client = await gateway([replica.server])
    token = f"Bearer sk-{uuid.uuid4().hex}"
    hop_by_hop = {"Proxy-Authorization": "Basic c2VjcmV0", "Keep-Alive": "timeout=5", "TE": "trailers",
                  "Trailer": "X-Checksum", "Proxy-Connection": "keep-alive"}
    headers = {"Authorization": token, "X-Tenant-Trace": "trace-42", "OpenAI-Organization": "org-1", **hop_by_hop}
    resp = await client.post("/v1/chat/completions", headers=headers,
                             json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 200, await resp.text()
    assert resp.headers[REPLICA_HEADER] == url_of(replica.server).split("//", 1)[1]
    [(path, seen, raw)] = replica.requests
    assert path == "/v1/chat/completions"
    seen = {k.lower(): v for k, v in seen.items()}
    assert seen["authorization"] == token
    assert seen["x-tenant-trace"] == "trace-42"
    assert seen["openai-organization"] == "org-1"
    for name in hop_by_hop:
        assert name.lower() not in seen, name
    assert seen["host"] == url_of(replica.server).split("//", 1)[1]  # the replica's, not the gateway's
    assert seen["content-type"] == "application/json"
    assert int(seen["content-length"]) == len(raw)
    assert json.loads(raw)["messages"] == [{"role": "user", "content": "hi"}]


async def test_a_replica_that_compresses_when_asked_still_gives_the_client_readable_json(aiohttp_server, gateway):
    """The proxy relays bytes without decoding them and without Content-Encoding, so it must
    not ask replicas (or a compressing proxy in front of them) for a compressed body."""
    seen_encodings = []

    async def generate(request: web.Request) -> web.Response:
        seen_encodings.append(request.headers.get("Accept-Encoding"))
        await request.read()
        resp = web.json_response({"id": "x", "object": "text_completion", "created": 0, "model": "m",
                                  "choices": [{"index": 0, "text": "ok" * 500, "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
        resp.enable_compression()  # honours the request's Accept-Encoding, as a gzip middleware would
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_get("/health", answer(lambda: web.Response(text="ok")))
    app.router.add_get("/metrics", answer(lambda: web.Response(body=b"")))
    app.router.add_get("/v1/models", answer(lambda: web.json_response({"data": [{"id": "m"}]})))
    client = await gateway([await aiohttp_server(app)])
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": "hello"},
                             headers={"Accept-Encoding": "identity"})
    assert resp.status == 200
    data = json.loads(await resp.read())
    assert data["choices"][0]["text"] == "ok" * 500
    assert seen_encodings and all(e in (None, "identity") for e in seen_encodings), seen_encodings


async def test_the_gateway_reads_a_replicas_metrics_served_the_way_prometheus_client_serves_them(aiohttp_server, gateway):
    """vLLM mounts prometheus-client's exposition app at /metrics, which gzips its output
    whenever the request accepts gzip; the gateway must still read queue depth and cache shape."""
    from prometheus_client import CollectorRegistry, Gauge, Info, generate_latest
    from prometheus_client.exposition import gzip_accepted

    registry = CollectorRegistry()
    Gauge("vllm:num_requests_waiting", "waiting", ["model_name"], registry=registry).labels(MODEL).set(7)
    Gauge("vllm:num_requests_running", "running", ["model_name"], registry=registry).labels(MODEL).set(3)
    Info("vllm:cache_config", "cache", registry=registry).info({"block_size": "32", "num_gpu_blocks": "1234"})

    async def metrics(request: web.Request) -> web.Response:  # what prometheus-client's apps do
        output, headers = generate_latest(registry), {"Content-Type": "text/plain; version=0.0.4"}
        if gzip_accepted(request.headers.get("Accept-Encoding", "")):
            output, headers["Content-Encoding"] = gzip.compress(output), "gzip"
        return web.Response(body=output, headers=headers)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", answer(lambda: web.Response(text="ok")))
    app.router.add_get("/v1/models", answer(lambda: web.json_response({"data": [{"id": MODEL}]})))
    client = await gateway([await aiohttp_server(app)])
    [replica] = client.server.app[GATEWAY].replicas.values()
    assert (replica.waiting, replica.running) == (7, 3)
    assert (replica.block_size, replica.num_gpu_blocks) == (32, 1234)
    assert replica.shadow.capacity == 1234


# --- models ----------------------------------------------------------------------------------

async def test_get_models_lists_the_replicas_model_once(fleet, gateway):
    client = await gateway(await fleet(2))
    gw = client.server.app[GATEWAY]
    resp = await client.get("/v1/models")
    assert resp.status == 200
    assert resp.headers[REPLICAS_HEADER] == ",".join(f"{name}=200" for name in gw.replicas)
    data = await resp.json()
    assert [m["id"] for m in data["data"]] == [MODEL]


async def test_get_models_is_answered_by_the_healthy_replicas(echo, gateway):
    replicas = [await echo(), await echo()]
    client = await gateway([r.server for r in replicas])
    gw = client.server.app[GATEWAY]
    first, second = gw.replicas.values()
    first.healthy = False
    resp = await client.get("/v1/models")
    assert resp.status == 200
    assert resp.headers[REPLICAS_HEADER] == f"{second.name}=200"
    assert (await resp.json())["data"][0]["id"] == MODEL


# --- the official OpenAI client ---------------------------------------------------------------

async def test_the_openai_client_streams_a_chat_completion_through_the_gateway_with_cached_token_usage(fleet, gateway):
    client = await gateway(await fleet(2))
    rng = random.Random(11)
    messages = [{"role": "system", "content": text(rng, 120)}, {"role": "user", "content": text(rng, 10)}]
    async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0) as oa:
        usages = []
        for _ in range(2):
            stream = await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True,
                                                      stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert content
            usage = chunks[-1].usage
            assert usage is not None and chunks[-1].choices == []
            assert usage.completion_tokens > 0
            assert isinstance(usage.prompt_tokens_details.cached_tokens, int)
            usages.append(usage)
    assert usages[0].prompt_tokens == usages[1].prompt_tokens
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    # The repeat lands where the first went and hits all but the last partial block.
    assert 0 < usages[1].prompt_tokens_details.cached_tokens < usages[1].prompt_tokens


async def test_the_openai_client_gets_a_non_streaming_completion_through_the_gateway(fleet, gateway):
    client = await gateway(await fleet(2))
    prompt = text(random.Random(12), 150)
    async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0) as oa:
        first = await oa.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        again = await oa.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    for completion in (first, again):
        assert completion.object == "text_completion"
        assert isinstance(completion.choices[0].text, str) and completion.choices[0].text
        assert completion.usage.prompt_tokens > 0 and completion.usage.completion_tokens > 0
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0


async def test_the_openai_client_sees_an_api_error_for_a_too_large_body(echo, gateway):
    replica = await echo()
    client = await gateway([replica.server], limits={"max_body_bytes": 1024})
    async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0) as oa:
        with pytest.raises(openai.APIStatusError) as info:
            await oa.completions.create(model=MODEL, prompt="y" * 4096, max_tokens=1)
    assert info.value.status_code == 413
    assert replica.requests == []


# --- metrics ---------------------------------------------------------------------------------

async def test_every_declared_metric_is_exported_after_one_request(fleet, gateway):
    client = await gateway(await fleet(2))
    before = families(await (await client.get("/metrics")).text())
    resp = await client.post("/v1/chat/completions",
                             json={"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
                                   "max_tokens": 3})
    assert resp.status == 200
    replica = resp.headers[REPLICA_HEADER]
    exported = families(await (await client.get("/metrics")).text())
    ours = {name for name in exported if name.startswith("prefix_router_")}
    assert set(METRIC_NAMES) == ours  # nothing declared is missing, nothing exported is undeclared
    assert set(before) == set(exported)  # families exist from the start; samples come with use

    def samples(name: str, **labels):
        suffixes = ("", "_total", "_count", "_sum", "_bucket")
        base = name.removesuffix("_total")
        return [s for s in exported[name].samples
                if s.name in {base + x for x in suffixes} and all(s.labels.get(k) == v for k, v in labels.items())]

    # Label sets used by one successful request.
    used = {
        "prefix_router_requests_total": {"replica": replica, "code": "200"},
        "prefix_router_cache_requests_total": {"replica": replica},
        "prefix_router_prompt_tokens_total": {"replica": replica},
        "prefix_router_cached_tokens_predicted_total": {"replica": replica},
        "prefix_router_cached_tokens_total": {"replica": replica},
        "prefix_router_replica_inflight": {"replica": replica},
        "prefix_router_replica_healthy": {"replica": replica},
        "prefix_router_replica_queue_depth": {"replica": replica},
        "prefix_router_replica_breaker_state": {"replica": replica},
        "prefix_router_admission_waiting": {},
        "prefix_router_admission_rejected_total": {"reason": "queue_full"},
        "prefix_router_changed_total": {"cause": "volatile_value"},  # every cause at 0 from the start
        "prefix_router_changed_lost_tokens_total": {"cause": "other"},
        "prefix_router_routing_seconds": {},
        "prefix_router_analysis_seconds": {},
        "prefix_router_ttft_seconds": {"replica": replica},
        "prefix_router_request_seconds": {"replica": replica},
    }
    for name, labels in used.items():
        assert samples(name, **labels), name
    # Label sets nobody used yet: declared and exported, without samples.
    for name in set(METRIC_NAMES) - set(used):
        assert name in ("prefix_router_lost_tokens_total", "prefix_router_spillovers_total",
                        "prefix_router_decode_requests_total", "prefix_router_cached_tokens_predicted_offload_total") or \
            name.startswith("prefix_router_kv_"), name  # no KV events, not disaggregated, no offload tier
        assert not samples(name), name
    assert sum(s.value for s in samples("prefix_router_requests_total")) == 1
    prompt_tokens = sum(s.value for s in samples("prefix_router_prompt_tokens_total"))
    assert prompt_tokens == len(ByteTokenizer().render_chat([{"role": "user", "content": "hello there"}]))


# --- privacy ---------------------------------------------------------------------------------

async def test_no_prompt_text_reaches_metrics_or_logs_even_when_requests_fail(fleet, echo, gateway, caplog):
    caplog.set_level(logging.DEBUG)
    marker = f"secret-{uuid.uuid4().hex}"
    good = await gateway(await fleet(2))
    broken = await echo(status=500)
    dead = await echo()
    failing = await gateway([broken.server, dead.server], upstream={"max_retries": 2})
    await dead.server.close()  # connection refused for whatever is routed there

    chat = {"model": MODEL, "messages": [{"role": "system", "content": f"You are {marker}."},
                                          {"role": "user", "content": f"Tell me about {marker}"}], "max_tokens": 3}
    completion = {"model": MODEL, "prompt": f"{marker} " * 20, "max_tokens": 3}
    assert (await good.post("/v1/chat/completions", json=chat)).status == 200
    assert (await good.post("/v1/chat/completions", json={**chat, "stream": True})).status == 200
    assert (await good.post("/v1/completions", json=completion)).status == 200
    assert (await good.post("/v1/completions", data=f'{{"prompt": "{marker}',
                            headers={"Content-Type": "application/json"})).status == 400
    for body, path in ((chat, "/v1/chat/completions"), (completion, "/v1/completions")):
        resp = await failing.post(path, json=body)
        assert resp.status == 502
        assert marker not in await resp.text()
    assert broken.requests  # the failure really came from upstream
    assert any(marker.encode() in raw for _, _, raw in broken.requests)

    for client in (good, failing):
        assert marker not in await (await client.get("/metrics")).text()
        assert marker not in json.dumps(await (await client.get("/replicas")).json())
    assert caplog.records  # logging was captured at all (the failures log warnings)
    assert any(r.levelno >= logging.WARNING and r.name.startswith("prefix_router") for r in caplog.records)
    for record in caplog.records:
        assert marker not in record.getMessage(), record.name
    assert marker not in caplog.text


async def test_the_request_log_has_one_line_per_request_with_predictions_and_no_prompt_text(fleet, gateway, tmp_path):
    marker = f"secret-{uuid.uuid4().hex}"
    log = tmp_path / "requests.jsonl"
    client = await gateway(await fleet(2), request_log=str(log))
    system = {"role": "system", "content": f"You are {marker}. " + text(random.Random(1), 400)}
    history = [system, {"role": "user", "content": f"first question about {marker}"}]
    session = {"X-Session-ID": f"user-{marker}"}
    for turn in range(3):
        resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 2},
                                 headers=session)
        assert resp.status == 200
        answer_ = (await resp.json())["choices"][0]["message"]["content"]
        history = history + [{"role": "assistant", "content": answer_}, {"role": "user", "content": f"more {turn}"}]
    await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "system", "content": "Changed. " + system["content"]}, *history[1:]], "max_tokens": 2}, headers=session)
    await client.close()  # the log is closed with the app
    raw = log.read_text()
    assert marker not in raw
    lines = [json.loads(line) for line in raw.splitlines()]
    assert len(lines) == 4
    assert {line["conversation"] for line in lines} == {lines[0]["conversation"]}
    assert len(lines[0]["conversation"]) == 16  # a hash of the session key, not the key
    assert [line["result"] for line in lines] == ["miss_cold", "hit", "hit", "miss_changed"]
    for line in lines[1:3]:  # exact prediction on a hit: what the replica reported
        assert line["predicted_cached_tokens"] == line["cached_tokens"] > 0
    assert lines[3]["diverged_message"] == 0 and lines[3]["diverged_token"] == 0 and lines[3]["lost_tokens"] > 0
    assert all(line["status"] == 200 and line["replica"] and line["route"] for line in lines)


# --- everything down ---------------------------------------------------------------------------

async def test_a_replica_failing_health_checks_is_logged_with_what_it_answered(aiohttp_server, gateway, caplog):
    async def not_found(request):
        return web.Response(status=404)

    app = web.Application()
    app.router.add_get("/{tail:.*}", not_found)
    server = await aiohttp_server(app)
    with caplog.at_level("WARNING", logger="prefix_router.fleet.replicas"):
        client = await gateway([server])
        assert (await client.get("/ready")).status == 503
    assert any(f"HTTP 404 from {url_of(server)}/health" in r.getMessage() for r in caplog.records), caplog.text

async def test_when_every_replica_is_down_requests_get_503_and_ready_is_503(fleet, gateway):
    servers = await fleet(2)
    client = await gateway(servers)
    assert (await client.get("/ready")).status == 200
    for server in servers:
        await server.close()
    gw = client.server.app[GATEWAY]
    for _ in range(100):  # health checks every 0.2 s, one failure marks a replica down
        if not any(r.healthy for r in gw.replicas.values()):
            break
        await asyncio.sleep(0.05)
    assert not any(r.healthy for r in gw.replicas.values())
    ready = await client.get("/ready")
    assert ready.status == 503
    assert (await ready.json())["healthy_replicas"] == 0
    for path, body in (("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"model": MODEL, "prompt": "hi"})):
        resp = await client.post(path, json=body)
        assert resp.status == 503
        error = (await resp.json())["error"]
        assert set(error) == ERROR_FIELDS and error["code"] == 503
    assert (await client.get("/v1/models")).status == 503
    assert (await client.get("/health")).status == 200  # the gateway itself is alive


async def test_a_request_for_full_kv_cache_reports_is_forwarded_without_it(echo, gateway):
    """vLLM's ``kv_cache_report_mode: full`` republishes every reused block as stored, with no
    removal to match: the KV events every gateway reads would hold those blocks forever."""
    replica = await echo()
    client = await gateway([replica.server])
    body = {"model": MODEL, "prompt": "hello", "vllm_xargs": {"kv_cache_report_mode": "full", "keep": 1}}
    assert (await client.post("/v1/completions", json=body)).status == 200
    sent = json.loads(replica.requests[-1][2])
    assert sent["vllm_xargs"] == {"keep": 1} and sent["prompt"] == "hello"
