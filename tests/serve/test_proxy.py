"""One request's pipeline (prefix_router/serve/proxy.py): the gateway application in front of
scripted replicas on loopback, and ``route`` and ``choose`` on a Gateway of their own."""

from __future__ import annotations

import json
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from prefix_router.app import GATEWAY, create_app
from prefix_router.config import config_from_dict
from prefix_router.constants import REPLICA_HEADER
from prefix_router.fleet.replicas import apply_health, apply_metrics
from prefix_router.gateway import Gateway
from prefix_router.prompts.tokenizer import ByteTokenizer
from prefix_router.serve.inbound import inbound_of
from prefix_router.serve.proxy import choose, route

from ..helpers import MODEL, metric

CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"
ERROR_FIELDS = {"message", "type", "param", "code"}


class Replica:
    """A scripted vLLM replica: ``status`` for generation (a chat completion or a Response when
    200), ``models`` in ``/v1/models``, ``waiting`` requests queued in ``/metrics``. Counts the
    generation requests it received."""

    def __init__(self, status: int = 200, models: tuple[str, ...] = (MODEL,), waiting: int = 0) -> None:
        self.status, self.models, self.waiting = status, list(models), waiting
        self.requests = 0
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_get("/v1/models", self.list_models)
        self.app.router.add_post(CHAT, self.generate)
        self.app.router.add_post(RESPONSES, self.generate)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f"vllm:num_requests_waiting {self.waiting}\nvllm:num_requests_running 0\n")

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def generate(self, request: web.Request) -> web.Response:
        await request.read()
        self.requests += 1
        if self.status != 200:
            return web.json_response({"error": {"message": "engine failed", "code": self.status}}, status=self.status)
        if request.path == RESPONSES:
            return web.json_response({
                "id": f"resp_{self.requests}", "object": "response", "status": "completed",
                "output": [{"type": "message", "content": [{"type": "output_text", "text": "ok"}]}],
                "usage": {"input_tokens": 10, "output_tokens": 1, "input_tokens_details": {"cached_tokens": 0}}})
        return web.json_response({
            "id": "chatcmpl-1", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}})


@pytest.fixture
async def gateway(aiohttp_server, aiohttp_client):
    """``await gateway(replicas, **sections)``: (a client of the gateway app in front of them,
    their names in order); the app's Gateway is ``client.gw``."""

    async def start(replicas: list[Replica], **sections):
        urls = [str((await aiohttp_server(r.app)).make_url("")).rstrip("/") for r in replicas]
        data = {"replicas": urls, "health": {"interval_s": 60.0}, "scrape": {"interval_s": 60.0}, **sections}
        client = await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))
        client.gw = client.server.app[GATEWAY]
        return client, list(client.gw.replicas)

    return start


def chat(text: str = "hello there", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1, **extra}


async def error_of(resp, status: int) -> dict:
    data = await resp.json()
    assert resp.status == status, data
    assert set(data["error"]) == ERROR_FIELDS and data["error"]["code"] == status
    return data["error"]


def open_breaker(gw: Gateway, name: str) -> None:
    """As if ``name``'s last requests all failed: off the ring for the cooldown."""
    for _ in range(gw.config.breaker.failures):
        gw.replicas[name].breaker.record(False, time.monotonic())


# --- through the application -------------------------------------------------------------------

async def test_an_answer_names_its_replica_and_a_conversations_turns_stay_on_it(gateway):
    client, names = await gateway([Replica(), Replica(), Replica()])
    messages, served = [], set()
    for i in range(6):
        messages.append({"role": "user", "content": f"turn {i}: " + "words " * 20})
        resp = await client.post(CHAT, json={"model": MODEL, "messages": messages}, headers={"X-Session-ID": "s-7"})
        assert resp.status == 200
        served.add(resp.headers[REPLICA_HEADER])
        messages.append({"role": "assistant", "content": "ok"})
    assert len(served) == 1 and served <= set(names)
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_analysis_seconds_count") == 6
    assert metric(page, "prefix_router_routing_seconds_count") == 6


async def test_a_replica_answering_5xx_is_retried_on_another_before_anything_reached_the_client(gateway):
    bad, good = Replica(500), Replica()
    client, (bad_name, good_name) = await gateway([bad, good])
    for i in range(50):  # sessions until one was placed on the failing replica first
        resp = await client.post(CHAT, json=chat(), headers={"X-Session-ID": f"s-{i}"})
        assert resp.status == 200 and resp.headers[REPLICA_HEADER] == good_name
        if bad.requests:
            break
    assert bad.requests == 1
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_requests_total", replica=good_name, route="retry", code="200") == 1
    assert metric(page, "prefix_router_requests_total", replica=bad_name, code="500") == 1


async def test_a_model_no_replica_serves_gets_the_gateways_own_404_and_reaches_no_replica(gateway):
    replica = Replica()
    client, _ = await gateway([replica])
    error = await error_of(await client.post(CHAT, json={**chat(), "model": "no-such-model"}), 404)
    assert error["type"] == "NotFoundError" and error["param"] == "model"
    assert replica.requests == 0


async def test_an_adapter_loaded_since_the_last_scrape_is_found_at_once(gateway):
    replica = Replica()
    client, _ = await gateway([replica])
    replica.models.append("sql-lora")  # vllm serve --enable-lora, then /v1/load_lora_adapter
    resp = await client.post(CHAT, json={**chat(), "model": "sql-lora"})
    assert resp.status == 200 and replica.requests == 1


async def test_a_model_only_a_replica_that_is_down_serves_gets_503_with_retry_after(gateway):
    general, special = Replica(), Replica(models=(MODEL, "special"))
    client, (_, special_name) = await gateway([general, special], breaker={"failures": 1})
    open_breaker(client.gw, special_name)
    resp = await client.post(CHAT, json={**chat(), "model": "special"})
    error = await error_of(resp, 503)
    assert error["param"] == "model" and resp.headers["Retry-After"] == "1"
    assert general.requests == special.requests == 0


async def test_with_every_replica_saturated_and_the_queue_full_the_request_gets_429_with_retry_after(gateway):
    replica = Replica(waiting=5)
    client, _ = await gateway([replica], admission={"saturated_depth": 1, "max_queue": 0})
    resp = await client.post(CHAT, json=chat())
    error = await error_of(resp, 429)
    assert error["type"] == "RateLimitError" and resp.headers["Retry-After"] == "1"
    assert replica.requests == 0
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_admission_rejected_total", reason="queue_full") == 1


async def test_a_request_that_waited_past_the_admission_timeout_gets_503_with_retry_after(gateway):
    replica = Replica(waiting=5)
    client, _ = await gateway([replica], admission={"saturated_depth": 1, "timeout_s": 0.05})
    resp = await client.post(CHAT, json=chat())
    error = await error_of(resp, 503)
    assert "0.05 s" in error["message"] and resp.headers["Retry-After"] == "1"
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_admission_rejected_total", reason="timeout") == 1


async def test_a_response_is_continued_on_the_replica_that_holds_it(gateway):
    client, _ = await gateway([Replica(), Replica()])
    resp = await client.post(RESPONSES, json={"model": MODEL, "input": "hello"})
    created = await resp.json()
    home = resp.headers[REPLICA_HEADER]
    for i in range(6):  # whatever the prompt, the ring does not decide
        resp = await client.post(RESPONSES, json={"model": MODEL, "input": f"and {i}?",
                                                  "previous_response_id": created["id"]})
        assert resp.status == 200 and resp.headers[REPLICA_HEADER] == home
    assert client.gw.response_homes.history(created["id"])  # remembered: routed by prefix, not passed through


async def test_when_the_replica_holding_the_previous_response_is_down_the_request_gets_503_naming_it(gateway):
    client, names = await gateway([Replica(), Replica()], breaker={"failures": 1})
    client.gw.response_homes.remember("resp_1", names[1], [{"role": "user", "content": "hello"}])
    open_breaker(client.gw, names[1])
    resp = await client.post(RESPONSES, json={"model": MODEL, "input": "next", "previous_response_id": "resp_1"})
    error = await error_of(resp, 503)
    assert names[1] in error["message"] and error["param"] == "previous_response_id"
    assert resp.headers["Retry-After"] == "1"


# --- route and choose --------------------------------------------------------------------------

def make_gateway(**sections) -> Gateway:
    gw = Gateway(config_from_dict({"replicas": ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"],
                                   **sections}), ByteTokenizer())
    for replica in gw.replicas.values():
        apply_health(replica, True, gw.config.health)
        apply_metrics(replica, "")
    return gw


def inbound(gw: Gateway, body: dict):
    raw = json.dumps(body).encode()
    return inbound_of(make_mocked_request("POST", CHAT, headers={}), gw, CHAT, True, raw)


async def test_a_big_body_analysed_in_a_worker_thread_is_routed_as_on_the_event_loop():
    body = chat("a long prompt " * 200)
    inline, threaded = make_gateway(), make_gateway(limits={"inline_analysis_bytes": 0})
    try:
        (info_a, decision_a, _), (info_b, decision_b, _) = [await route(gw, inbound(gw, body))
                                                            for gw in (inline, threaded)]
        assert info_a.hashes == info_b.hashes and info_a.full_hash == info_b.full_hash
        assert decision_a.replica == decision_b.replica
        assert info_b.print is not None  # the conversation's fingerprint, made in the thread too
    finally:
        inline.executor.shutdown(wait=False)
        threaded.executor.shutdown(wait=False)


async def test_route_keeps_to_the_endpoint_pickers_subset_hint():
    gw = make_gateway()
    try:
        for name in gw.replicas:
            for i in range(5):
                _, decision, allowed = await route(gw, inbound(gw, chat(f"prompt {i}")), subset=frozenset({name}))
                assert decision.replica == name and allowed == {name}
    finally:
        gw.executor.shutdown(wait=False)


async def test_choose_picks_among_the_replicas_not_tried_and_allowed_and_none_when_none_is_left():
    gw = make_gateway()
    try:
        info, first, _ = await route(gw, inbound(gw, chat()))
        names = frozenset(gw.replicas)
        retry = choose(gw, info, None, exclude=frozenset({first.replica}))
        assert retry.replica in names - {first.replica}
        assert choose(gw, info, None, exclude=names) is None
        only = next(iter(names - {first.replica}))
        assert choose(gw, info, None, allowed=frozenset({only})).replica == only
        assert choose(gw, info, None, exclude=frozenset({only}), allowed=frozenset({only})) is None
    finally:
        gw.executor.shutdown(wait=False)


async def test_choose_leaves_out_replicas_that_are_not_routable():
    gw = make_gateway(breaker={"failures": 1})
    try:
        info, first, _ = await route(gw, inbound(gw, chat()))
        open_breaker(gw, first.replica)
        assert choose(gw, info, None).replica != first.replica
        for name in gw.replicas:
            open_breaker(gw, name)
        assert choose(gw, info, None) is None
    finally:
        gw.executor.shutdown(wait=False)


async def test_a_continued_response_whose_home_is_outside_the_subset_hint_is_refused_not_sent_there():
    gw = make_gateway()
    try:
        inside, home = list(gw.replicas)[:2]
        gw.response_homes.remember("resp_1", home, [{"role": "user", "content": "hello"}])
        raw = json.dumps({"model": MODEL, "input": "next", "previous_response_id": "resp_1"}).encode()
        request = inbound_of(make_mocked_request("POST", RESPONSES, headers={}), gw, RESPONSES, True, raw)
        routed = await route(gw, request, subset=frozenset({inside}))
        assert isinstance(routed, web.Response) and routed.status == 503, routed[1]
    finally:
        gw.executor.shutdown(wait=False)


async def test_one_users_new_chat_is_no_rewrite_of_the_last_but_a_rewrite_within_a_chat_is(aiohttp_client, fleet):
    """``user`` names an end user, not a conversation: a second chat of one user, interleaved with
    the first, is not ``miss_changed``; a timestamp changed inside one chat's system prompt is."""
    sims = await fleet(2)
    config = config_from_dict({"replicas": [str(s.make_url("")).rstrip("/") for s in sims], "summary_interval_s": 0})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    system = "You are a careful assistant. " + "Keep answers short and exact. " * 40

    async def turn(system_text: str, *users: str) -> None:
        messages = [{"role": "system", "content": system_text}]
        for k, text in enumerate(users):
            messages += [{"role": "user", "content": text}] + ([{"role": "assistant", "content": "ok"}]
                                                                if k < len(users) - 1 else [])
        body = {"model": MODEL, "max_tokens": 2, "user": "alice", "messages": messages}
        assert (await client.post("/v1/chat/completions", json=body)).status == 200

    async def changed() -> float:
        return metric(await (await client.get("/metrics")).text(), "prefix_router_cache_requests_total",
                      result="miss_changed")

    await turn(system, "plan a trip to Rome for me please")
    await turn(system, "why does my parser reject this input")
    await turn(system, "plan a trip to Rome for me please", "three days, trains only")
    await turn(system, "why does my parser reject this input", "here is the stack trace")
    assert await changed() == 0
    await turn("Today is 2026-12-07 18:00. " + system, "plan a trip to Rome for me please", "three days, trains only",
               "and a museum")
    assert await changed() == 1
