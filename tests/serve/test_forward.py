"""Sending a routed request to its replica (prefix_router/serve/forward.py): ``InFlight``'s
accounting of one attempt, and ``forward``'s attempts, retries and circuit-breaker verdicts.

``forward`` runs in a small aiohttp app of the test's (``Harness``) with the decision and the
retry choice the test gives, in front of scripted replicas on loopback.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from prefix_router.cache.blocks import seed_hash
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.stream import EventStream
from prefix_router.config import config_from_dict
from prefix_router.constants import REPLICA_HEADER
from prefix_router.fleet.breaker import BreakerState
from prefix_router.fleet.replicas import apply_health, apply_metrics
from prefix_router.gateway import Gateway
from prefix_router.prompts.analysis import PromptInfo, analyze
from prefix_router.prompts.tokenizer import ByteTokenizer
from prefix_router.routing.decision import Decision, Route
from prefix_router.serve.forward import InFlight, Outcome, forward
from prefix_router.serve.inbound import inbound_of

from ..helpers import MODEL, metric

CHAT = "/v1/chat/completions"


def make_gateway(urls: list[str], **sections) -> Gateway:
    """A Gateway from a configuration listing ``urls``, every replica routable (as after a
    passed health check and a scrape)."""
    gw = Gateway(config_from_dict({"replicas": urls, **sections}), ByteTokenizer())
    for replica in gw.replicas.values():
        apply_health(replica, True, gw.config.health)
        apply_metrics(replica, "")
    return gw


def body(words: int = 60, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": " ".join(["word"] * words)}], **extra}


def analysis(gw: Gateway, request_body: dict) -> PromptInfo:
    return analyze(request_body, True, gw.tokenizer, gw.block_size, gw.config.routing.char_block_size, None)


def released(gw: Gateway) -> bool:
    """Whether every replica is back to no request in flight."""
    return all(r.inflight == 0 and r.prefill_blocks == 0 and r.sent_since_scrape == 0 for r in gw.replicas.values())


# --- InFlight ----------------------------------------------------------------------------------

@pytest.fixture
def slot():
    """``slot(predicted=0, **sections)``: (gateway, replica, prompt, an InFlight not acquired yet)."""
    made = []

    def build(predicted: int = 0, **sections):
        gw = make_gateway(["http://127.0.0.1:1"], **sections)
        made.append(gw)
        [replica] = gw.replicas.values()
        info = analysis(gw, body())
        return gw, replica, info, InFlight(gw, replica, info, Decision(replica.name, Route.AFFINITY, predicted))

    yield build
    for gw in made:
        gw.executor.shutdown(wait=False)


def test_acquire_counts_the_attempt_on_its_replica_once(slot):
    gw, replica, info, attempt = slot(predicted=2)
    blocks = -(-info.num_units // gw.block_size)  # the prompt's blocks, the partial last one included
    for _ in range(2):  # the second acquire does nothing
        attempt.acquire()
        assert (replica.inflight, replica.sent_since_scrape) == (1, 1)
        assert replica.prefill_blocks == attempt.prefill == blocks - 2
        assert replica.recent == 1.0  # one request in its share of recent requests
        assert replica.shadow.match(info.hashes) == len(info.hashes) > 0
        assert metric(gw.metrics.page().decode(), "prefix_router_replica_inflight", replica=replica.name) == 1


def test_release_takes_it_all_back_once_and_nothing_before_acquire(slot):
    gw, replica, info, attempt = slot()
    attempt.release()  # before acquire: nothing to take back
    assert replica.inflight == 0
    attempt.acquire()
    for _ in range(2):
        attempt.release()
        assert released(gw)
        assert metric(gw.metrics.page().decode(), "prefix_router_replica_inflight", replica=replica.name) == 0


def test_the_first_token_takes_the_prefill_off_and_the_release_does_not_take_it_again(slot):
    gw, replica, info, attempt = slot()
    replica.prefill_blocks = 5  # another request's, still queued
    attempt.acquire()
    attempt.prefilled()
    assert replica.prefill_blocks == 5
    attempt.release()
    assert replica.prefill_blocks == 5


def test_a_scrape_while_in_flight_keeps_the_release_off_the_new_count(slot):
    """The scrape reset ``sent_since_scrape``; the count after it holds only later requests."""
    gw, replica, info, attempt = slot()
    attempt.acquire()
    apply_metrics(replica, "vllm:num_requests_running 1\n")
    later = InFlight(gw, replica, info, Decision(replica.name, Route.AFFINITY)).acquire()
    attempt.release()
    assert replica.sent_since_scrape == 1 and replica.inflight == 1
    later.release()
    assert released(gw)


def test_a_failed_attempts_blocks_leave_the_shadow_index_but_blocks_held_before_stay(slot):
    gw, replica, info, attempt = slot()
    held = info.hashes[:2]
    replica.shadow.insert(held)  # an earlier request's prefix
    attempt.acquire()
    attempt.ok, attempt.failed = False, True
    attempt.release()
    assert replica.shadow.match(info.hashes) == len(held)


def test_a_served_attempts_blocks_stay_in_the_shadow_index(slot):
    gw, replica, info, attempt = slot()
    attempt.acquire()
    attempt.relayed(200)
    attempt.release()
    assert replica.shadow.match(info.hashes) == len(info.hashes)


def test_the_breaker_hears_each_attempts_verdict(slot):
    gw, replica, info, _ = slot(breaker={"failures": 2, "cooldown_s": 0.01})
    for _ in range(2):
        with InFlight(gw, replica, info, Decision(replica.name, Route.AFFINITY)) as attempt:
            attempt.ok, attempt.failed = False, True
    assert replica.breaker.state(time.monotonic()) is BreakerState.OPEN
    assert metric(gw.metrics.page().decode(), "prefix_router_replica_breaker_state",
                  replica=replica.name) == BreakerState.OPEN
    time.sleep(0.01)  # the cooldown: the next attempt is the half-open trial
    with InFlight(gw, replica, info, Decision(replica.name, Route.AFFINITY)) as attempt:
        attempt.relayed(200)
    assert replica.breaker.state(time.monotonic()) is BreakerState.CLOSED


def test_a_half_open_trial_that_says_nothing_of_the_replica_lets_the_next_request_be_the_trial(slot):
    gw, replica, info, _ = slot(breaker={"failures": 1, "cooldown_s": 10.0})
    replica.breaker.record(False, time.monotonic() - 10.0)  # opened a cooldown ago: half-open now
    with InFlight(gw, replica, info, Decision(replica.name, Route.AFFINITY)):
        assert not replica.breaker.allows(time.monotonic())  # the trial is in flight
    # no verdict (ok None: its client left, or every replica refused the request)
    assert replica.breaker.allows(time.monotonic())
    assert replica.breaker.state(time.monotonic()) is BreakerState.HALF_OPEN


def test_with_fresh_kv_events_the_prompt_counts_in_the_engine_view_while_in_flight(slot):
    gw, replica, info, attempt = slot()
    view = EngineView(gw.block_size, lambda lora, salt: seed_hash(lora or MODEL, salt))
    replica.stream = EventStream(replica.name, "tcp://127.0.0.1:1", None, view)
    replica.stream.last_seq = -1  # heard from: an engine that published nothing yet
    attempt.acquire()
    assert view.match(info.hashes) == len(info.hashes)
    attempt.ok, attempt.failed = False, True
    attempt.release()
    assert view.match(info.hashes) == 0  # a failed request's blocks are not coming


# --- forward -----------------------------------------------------------------------------------

class Replica:
    """A scripted replica: answers ``status`` (a chat completion with usage when 200, as one body
    or as a stream), or never answers (``hang``). Counts the generation requests it received."""

    def __init__(self, status: int = 200, hang: bool = False) -> None:
        self.status, self.hang = status, hang
        self.requests = 0
        self.release = asyncio.Event()  # ends a hanging answer (the fixture's teardown)
        self.app = web.Application()
        self.app.router.add_post(CHAT, self.generate)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        sent = await request.json()
        self.requests += 1
        if self.hang:
            await self.release.wait()
        if self.status != 200:
            return web.json_response({"error": {"message": "engine failed", "code": self.status}}, status=self.status)
        usage = {"prompt_tokens": 20, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
        if not sent.get("stream"):
            return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "usage": usage,
                                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in ({"choices": [{"index": 0, "delta": {"content": "ok"}}]}, {"choices": [], "usage": usage}):
            compact = json.dumps(event, separators=(",", ":"))  # as vLLM writes its events
            await response.write(f"data: {compact}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response


class Harness:
    """An app whose one handler runs ``forward`` with the first of ``order`` as the decision and
    the next untried one of ``order`` as each retry's choice."""

    def __init__(self, gw: Gateway, order: list[str]) -> None:
        self.gw, self.order = gw, order
        self.outcomes: list[Outcome] = []
        self.app = web.Application()
        self.app.router.add_post(CHAT, self.handle)

    def choose(self, tried: frozenset[str]) -> Decision | None:
        name = next((n for n in self.order if n not in tried), None)
        return None if name is None else Decision(name, Route.BALANCE)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        inbound = inbound_of(request, self.gw, CHAT, True, await request.read())
        info = analysis(self.gw, inbound.prompt)
        outcome = await forward(request, self.gw, inbound, info, Decision(self.order[0], Route.AFFINITY), self.choose)
        self.outcomes.append(outcome)
        return outcome.response


@pytest.fixture
async def forwarding(aiohttp_server, aiohttp_client, unused_tcp_port):
    """``await forwarding(replicas, **sections)``: (client, gateway, harness, replica names), the
    decision going to ``replicas[0]``, retries down the list. A replica given as None is a port
    nobody listens on."""
    made = []

    async def start(replicas: list[Replica | None], **sections):
        urls = []
        for replica in replicas:
            if replica is None:
                urls.append(f"http://127.0.0.1:{unused_tcp_port}")
            else:
                urls.append(str((await aiohttp_server(replica.app)).make_url("")).rstrip("/"))
                made.append(replica)
        gw = make_gateway(urls, **sections)
        gw.http = aiohttp.ClientSession()
        names = list(gw.replicas)
        harness = Harness(gw, names)
        client = await aiohttp_client(harness.app)
        made.append(gw)
        return client, gw, harness, names

    yield start
    for thing in made:
        if isinstance(thing, Replica):
            thing.release.set()
        else:
            await thing.http.close()
            thing.executor.shutdown(wait=False)


async def test_a_replica_answering_5xx_is_retried_on_the_next_and_the_answer_is_a_retry(forwarding):
    bad, good = Replica(500), Replica()
    client, gw, harness, (bad_name, good_name) = await forwarding([bad, good])
    resp = await client.post(CHAT, json=body())
    assert resp.status == 200 and resp.headers[REPLICA_HEADER] == good_name
    [outcome] = harness.outcomes
    assert outcome.replica is gw.replicas[good_name] and outcome.route is Route.RETRY
    assert bad.requests == good.requests == 1
    page = gw.metrics.page().decode()
    assert metric(page, "prefix_router_requests_total", replica=bad_name, route="affinity", code="500") == 1
    assert released(gw)


async def test_a_5xx_is_blamed_on_its_replica_once_another_replica_served_the_request(forwarding):
    client, gw, _, (bad_name, good_name) = await forwarding([Replica(500), Replica()])
    await client.post(CHAT, json=body())
    assert gw.replicas[bad_name].breaker.failures == 1
    assert gw.replicas[good_name].breaker.failures == 0


async def test_a_request_every_replica_refuses_gets_a_502_and_counts_against_no_breaker(forwarding):
    """A request that makes every replica fail is the request's fault: a client must not be able
    to open breakers by sending it."""
    client, gw, harness, names = await forwarding([Replica(500), Replica(503)])
    resp = await client.post(CHAT, json=body())
    error = (await resp.json())["error"]
    assert resp.status == 502 and error["type"] == "BadGatewayError"
    assert error["message"] == f"replica {names[1]} answered 503"  # the last attempt's
    assert harness.outcomes[0].replica is None and harness.outcomes[0].decision is None
    assert all(r.breaker.failures == 0 for r in gw.replicas.values())
    assert released(gw)


async def test_a_half_open_replica_whose_trial_every_replica_refused_may_be_tried_again(forwarding):
    client, gw, _, (trial_name, _other) = await forwarding([Replica(500), Replica(500)],
                                                          breaker={"failures": 1, "cooldown_s": 10.0})
    breaker = gw.replicas[trial_name].breaker
    breaker.record(False, time.monotonic() - 10.0)  # opened a cooldown ago: half-open
    assert (await client.post(CHAT, json=body())).status == 502
    assert breaker.allows(time.monotonic()) and not breaker.trial_inflight


async def test_a_replica_refusing_connections_is_retried_and_blamed_at_once(forwarding):
    client, gw, _, (dead_name, good_name) = await forwarding([None, Replica()])
    resp = await client.post(CHAT, json=body())
    assert resp.status == 200 and resp.headers[REPLICA_HEADER] == good_name
    assert gw.replicas[dead_name].breaker.failures == 1
    page = gw.metrics.page().decode()
    assert metric(page, "prefix_router_requests_total", replica=dead_name, route="affinity", code="0") == 1
    assert gw.replicas[dead_name].shadow.match(analysis(gw, body()).hashes) == 0  # its blocks were taken back


async def test_attempts_stop_after_max_retries(forwarding):
    replicas = [Replica(500) for _ in range(3)]
    client, gw, _, _ = await forwarding(replicas, upstream={"max_retries": 1})
    assert (await client.post(CHAT, json=body())).status == 502
    assert [r.requests for r in replicas] == [1, 1, 0]


async def test_a_stream_whose_headers_do_not_come_in_time_is_retried_elsewhere(forwarding):
    slow, good = Replica(hang=True), Replica()
    client, gw, harness, (slow_name, good_name) = await forwarding([slow, good], upstream={"header_timeout_s": 0.1})
    resp = await client.post(CHAT, json=body(stream=True))
    text = await resp.text()
    assert resp.status == 200 and resp.headers[REPLICA_HEADER] == good_name
    assert text.endswith("data: [DONE]\n\n") and '"usage"' not in text  # the client did not ask for it
    assert harness.outcomes[0].usage["prompt_tokens"] == 20  # the gateway read it on the way
    assert gw.replicas[slow_name].breaker.failures == 1 and released(gw)


async def test_a_replica_whose_breaker_opened_meanwhile_is_skipped_without_an_attempt(forwarding):
    bad, opened, good = Replica(500), Replica(), Replica()
    client, gw, _, names = await forwarding([bad, opened, good], breaker={"failures": 1})
    gw.replicas[names[1]].breaker.record(False, time.monotonic())  # open, as if another request failed there
    assert (await client.post(CHAT, json=body())).headers[REPLICA_HEADER] == names[2]
    assert opened.requests == 0


async def test_a_4xx_is_the_replicas_answer_relayed_as_it_is_and_not_retried(forwarding):
    refusing, other = Replica(400), Replica()
    client, gw, harness, (name, _) = await forwarding([refusing, other])
    gw.replicas[name].breaker.record(False, time.monotonic())  # one failure earlier
    resp = await client.post(CHAT, json=body())
    assert resp.status == 400 and resp.headers[REPLICA_HEADER] == name
    assert other.requests == 0 and harness.outcomes[0].route is Route.AFFINITY
    assert gw.replicas[name].breaker.failures == 0  # it answered: the replica works


async def test_a_404_has_the_replicas_model_list_read_again_at_the_next_round(forwarding):
    """vLLM answers 404 for a model it does not serve: an adapter unloaded since the last read of
    its ``/v1/models`` (every ``scrape.models_interval_s``) is then seen gone within a round."""
    client, gw, _, (name, _) = await forwarding([Replica(404), Replica()])
    gw.replicas[name].models_read_at = time.monotonic()
    resp = await client.post(CHAT, json=body())
    assert resp.status == 404 and resp.headers[REPLICA_HEADER] == name
    assert gw.replicas[name].models_read_at == float("-inf")
