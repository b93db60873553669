"""The last step of a request (prefix_router/serve/learning.py): what an answer's usage teaches
the gateway, counted into its metrics, its memory and the request log.

Each test routes a real request through a real Gateway (``proxy.route``: analysis, admission,
the policy), then hands ``learn`` the outcome an engine would report: the decision's
predictions set by the test, ``usage`` as vLLM writes it.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from prefix_router.config import config_from_dict
from prefix_router.fleet.replicas import apply_health, apply_metrics
from prefix_router.gateway import Gateway
from prefix_router.misses.request_log import conversation_tag
from prefix_router.prompts.tokenizer import ByteTokenizer
from prefix_router.routing.decision import Route
from prefix_router.serve.forward import Outcome
from prefix_router.serve.inbound import inbound_of
from prefix_router.serve.learning import evicted_in_flight_tokens, flush_waiting_lines, learn
from prefix_router.serve.proxy import route

from ..helpers import MODEL, metric, until

CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"
SYSTEM = " ".join(f"rule {i}: answer briefly and cite sources." for i in range(20))


@pytest.fixture
def gateway():
    """``gateway(tokenizer=True, **sections)``: a Gateway of two routable replicas."""
    made = []

    def build(tokenizer: bool = True, **sections) -> Gateway:
        config = config_from_dict({"replicas": ["http://127.0.0.1:1", "http://127.0.0.1:2"], **sections})
        gw = Gateway(config, ByteTokenizer() if tokenizer else None)
        for replica in gw.replicas.values():
            apply_health(replica, True, config.health)
            apply_metrics(replica, "")
        made.append(gw)
        return gw

    yield build
    for gw in made:
        gw.executor.shutdown(wait=False)
        if gw.request_log is not None:
            gw.request_log.close()


async def routed(gw: Gateway, body: dict, path: str = CHAT, headers: dict | None = None):
    """(inbound, info, decision) of a request routed by ``gw``."""
    inbound = inbound_of(make_mocked_request("POST", path, headers=headers or {}), gw, path, True,
                         json.dumps(body).encode())
    info, decision, _ = await route(gw, inbound)
    return inbound, info, decision


def chat(user: str = "what is new?", system: str = SYSTEM) -> dict:
    return {"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def usage(gw: Gateway, info, cached_blocks: int, completion_tokens: int = 1) -> dict:
    """The engine's usage for ``info``'s prompt with ``cached_blocks`` of it cached."""
    return {"prompt_tokens": info.num_units, "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_blocks * gw.block_size}}


def outcome(gw: Gateway, decision, engine_usage: dict | None, *, status: int = 200, route_: Route | None = None,
            **kw) -> Outcome:
    return Outcome(web.Response(), status, gw.replicas[decision.replica], decision, route_ or decision.route,
                   engine_usage, ttft_s=0.01, elapsed_s=0.02, **kw)


def page(gw: Gateway) -> str:
    return gw.metrics.page().decode()


async def test_a_hit_counts_the_engines_tokens_and_the_prediction(gateway):
    gw = gateway()
    inbound, info, decision = await routed(gw, chat())
    most = gw.max_hit_blocks(info)
    decision = dataclasses.replace(decision, predicted_blocks=most, best_blocks=most)
    reported = usage(gw, info, cached_blocks=most)
    learn(gw, inbound, info, outcome(gw, decision, reported))
    m, name = page(gw), decision.replica
    assert metric(m, "prefix_router_cache_requests_total", replica=name, result="hit") == 1
    assert metric(m, "prefix_router_prompt_tokens_total", replica=name) == info.num_units
    assert metric(m, "prefix_router_cached_tokens_total", replica=name) == most * gw.block_size
    assert metric(m, "prefix_router_cached_tokens_predicted_total", replica=name) == min(most * gw.block_size,
                                                                                         info.num_units)
    assert metric(m, "prefix_router_requests_total", replica=name, route=decision.route.value, code="200") == 1
    assert metric(m, "prefix_router_ttft_seconds_count", replica=name) == 1
    assert metric(m, "prefix_router_lost_tokens_total") == 0


async def test_a_prompt_nothing_knew_anything_of_is_a_cold_miss_that_lost_nothing(gateway):
    gw = gateway()
    inbound, info, decision = await routed(gw, chat())
    learn(gw, inbound, info, outcome(gw, decision, usage(gw, info, cached_blocks=0)))
    assert metric(page(gw), "prefix_router_cache_requests_total", result="miss_cold") == 1
    assert metric(page(gw), "prefix_router_lost_tokens_total") == 0


async def test_a_replica_that_served_less_than_it_was_believed_to_hold_is_an_eviction(gateway):
    gw = gateway()
    inbound, info, decision = await routed(gw, chat())
    decision = dataclasses.replace(decision, predicted_blocks=3, best_blocks=3)
    learn(gw, inbound, info, outcome(gw, decision, usage(gw, info, cached_blocks=1)))
    m = page(gw)
    assert metric(m, "prefix_router_cache_requests_total", result="miss_evicted") == 1
    assert metric(m, "prefix_router_lost_tokens_total", cause="evicted") == (3 - 1) * gw.block_size


async def test_another_replica_believed_to_hold_more_is_a_routing_miss(gateway):
    gw = gateway()
    inbound, info, decision = await routed(gw, chat())
    decision = dataclasses.replace(decision, predicted_blocks=1, best_blocks=4)
    learn(gw, inbound, info, outcome(gw, decision, usage(gw, info, cached_blocks=1)))
    m = page(gw)
    assert metric(m, "prefix_router_cache_requests_total", result="miss_routed") == 1
    assert metric(m, "prefix_router_lost_tokens_total", cause="routed") == (4 - 1) * gw.block_size


async def test_a_client_rewriting_its_own_prefix_is_a_changed_miss_with_its_cause_and_site(gateway):
    gw = gateway()
    session = {"X-Session-ID": "s-1"}
    first = chat(system="Current time: 2026-11-30T10:00:00Z. " + SYSTEM)
    inbound, info, decision = await routed(gw, first, headers=session)
    learn(gw, inbound, info, outcome(gw, decision, usage(gw, info, cached_blocks=0)))
    again = chat(system="Current time: 2026-11-30T10:00:07Z. " + SYSTEM)
    again["messages"] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and now?"}]
    inbound, info, decision = await routed(gw, again, headers=session)
    learn(gw, inbound, info, outcome(gw, decision, usage(gw, info, cached_blocks=0)))
    m = page(gw)
    assert metric(m, "prefix_router_cache_requests_total", result="miss_changed") == 1
    assert metric(m, "prefix_router_changed_total") == 1  # whatever cause the diagnosis names
    assert metric(m, "prefix_router_lost_tokens_total", cause="changed") > 0
    [site] = gw.changes.sites.values()
    assert site.message_index == 0 and site.count == 1  # the system prompt


async def test_the_conversation_is_remembered_for_its_next_request(gateway):
    gw = gateway()
    inbound, info, decision = await routed(gw, chat())
    assert gw.conversations.get(info.conversation) is None
    learn(gw, inbound, info, outcome(gw, decision, usage(gw, info, cached_blocks=0)))
    assert list(gw.conversations.get(info.conversation).hashes) == info.hashes


async def test_the_answers_whole_blocks_take_room_in_the_replicas_shadow_index(gateway):
    gw = gateway()
    inbound, info, decision = await routed(gw, chat())
    shadow = gw.replicas[decision.replica].shadow
    before = len(shadow)
    learn(gw, inbound, info, outcome(gw, decision, usage(gw, info, 0, completion_tokens=3 * gw.block_size + 1)))
    assert len(shadow) - before == 3


@pytest.mark.parametrize("status, reported", [(400, None), (200, None), (200, "not an object")])
async def test_an_answer_without_a_usable_usage_counts_the_request_only(gateway, status, reported):
    gw = gateway()
    inbound, info, decision = await routed(gw, chat())
    learn(gw, inbound, info, outcome(gw, decision, reported, status=status))
    m = page(gw)
    assert metric(m, "prefix_router_requests_total", replica=decision.replica, code=str(status)) == 1
    assert metric(m, "prefix_router_cache_requests_total") == 0 and metric(m, "prefix_router_prompt_tokens_total") == 0


async def test_a_request_no_replica_answered_teaches_nothing(gateway):
    gw = gateway()
    inbound, info, _ = await routed(gw, chat())
    learn(gw, inbound, info, Outcome(web.Response(status=502), 502))
    assert metric(page(gw), "prefix_router_requests_total") == 0  # its attempts were counted as they failed
    assert gw.conversations.get(info.conversation) is None


async def test_a_spilled_request_counts_a_spillover_from_the_replica_it_was_meant_for(gateway):
    gw = gateway()
    inbound, info, decision = await routed(gw, chat())
    preferred = next(n for n in gw.replicas if n != decision.replica)
    decision = dataclasses.replace(decision, route=Route.SPILL, spilled_from=preferred)
    learn(gw, inbound, info, outcome(gw, decision, usage(gw, info, 0)))
    assert metric(page(gw), "prefix_router_spillovers_total", from_replica=preferred,
                  to_replica=decision.replica) == 1


async def test_the_request_log_line_holds_the_prediction_and_the_outcome_but_no_prompt(gateway, tmp_path):
    path = tmp_path / "requests.jsonl"
    gw = gateway(request_log=str(path))
    inbound, info, decision = await routed(gw, chat())
    decision = dataclasses.replace(decision, predicted_blocks=3, best_blocks=3)
    learn(gw, inbound, info, outcome(gw, decision, usage(gw, info, cached_blocks=2)))
    [line] = [json.loads(x) for x in path.read_text().splitlines()]
    assert line["replica"] == decision.replica and line["status"] == 200
    assert (line["prompt_tokens"], line["cached_tokens"]) == (info.num_units, 2 * gw.block_size)
    assert line["predicted_cached_tokens"] == 3 * gw.block_size
    assert (line["result"], line["lost_tokens"]) == ("miss_evicted", gw.block_size)
    assert line["conversation"] == conversation_tag(info.conversation)
    assert "body" not in line and "briefly" not in path.read_text()


class LateView:
    """A KV-event view whose removals come after the request's answer (vLLM publishes a step's
    events and its answers at once): ``evicted`` is what it has shown so far."""

    def __init__(self) -> None:
        self.evicted = ()

    def evicted_since(self, hashes, n: int, since: int) -> tuple[int, ...]:
        return tuple(i for i in self.evicted if i < n)


async def learned_late(gateway, path, predicted: int, cached: int, view: LateView) -> Gateway:
    """A gateway logging to ``path`` that learned one answer: ``predicted`` blocks routed for,
    ``cached`` hit, the replica's KV events ``view`` (a line waits up to 30 s for them)."""
    gw = gateway(request_log=str(path), kv_events={"parity_grace_s": 30.0})
    inbound, info, decision = await routed(gw, chat())
    decision = dataclasses.replace(decision, predicted_blocks=predicted, best_blocks=predicted)
    learn(gw, inbound, info, outcome(gw, decision, usage(gw, info, cached_blocks=cached), view=view))
    return gw


async def test_a_line_waits_for_the_events_that_show_what_was_evicted_while_its_request_waited(gateway, tmp_path):
    path = tmp_path / "requests.jsonl"
    view = LateView()
    gw = await learned_late(gateway, path, predicted=3, cached=0, view=view)
    answered_at = time.time()
    assert path.read_text() == ""  # its events have not come
    view.evicted = (0, 1, 2)  # they come: the whole prediction was evicted before it ran
    await until(path.read_text)
    line = json.loads(path.read_text())
    assert line["evicted_in_flight_tokens"] == line["predicted_cached_tokens"] == 3 * gw.block_size
    assert line["t"] <= answered_at  # stamped when it was answered, not when written


async def test_a_line_still_waiting_is_written_when_the_gateway_stops(gateway, tmp_path):
    path = tmp_path / "requests.jsonl"
    gw = await learned_late(gateway, path, predicted=3, cached=0, view=LateView())
    assert path.read_text() == "" and gw.waiting_lines
    await flush_waiting_lines(gw)
    assert json.loads(path.read_text())["evicted_in_flight_tokens"] == 0 and not gw.waiting_lines


async def test_a_line_whose_prediction_held_is_written_at_once(gateway, tmp_path):
    path = tmp_path / "requests.jsonl"
    gw = await learned_late(gateway, path, predicted=2, cached=3, view=LateView())
    assert json.loads(path.read_text())["evicted_in_flight_tokens"] == 0 and not gw.waiting_lines


async def test_with_bodies_logged_the_line_holds_the_path_and_the_request_as_routed(gateway, tmp_path):
    path = tmp_path / "requests.jsonl"
    gw = gateway(request_log=str(path), request_log_bodies=True)
    inbound, info, decision = await routed(gw, chat())
    learn(gw, inbound, info, outcome(gw, decision, usage(gw, info, 0)))
    line = json.loads(path.read_text())
    assert line["path"] == CHAT and line["body"] == inbound.prompt


@pytest.mark.parametrize("store, remembered", [(True, True), (False, False)])
async def test_a_responses_answer_is_remembered_on_its_replica_with_its_history_if_stored(gateway, store, remembered):
    gw = gateway()
    body = {"model": MODEL, "input": "hello", "store": store}
    inbound, info, decision = await routed(gw, body, RESPONSES)
    answer = {"id": "resp_1", "status": "completed",
              "output": [{"type": "message", "content": [{"type": "output_text", "text": "hi there"}]}]}
    learn(gw, inbound, info, outcome(gw, decision, usage(gw, info, 0), answer=answer, response_id="resp_1"))
    assert gw.response_homes.home("resp_1") == decision.replica
    history = gw.response_homes.history("resp_1")
    if remembered:
        assert history == [*inbound.prompt["messages"], {"role": "assistant", "content": "hi there"}]
    else:
        assert history is None


async def test_in_character_blocks_a_full_hit_is_a_hit_not_an_eviction_of_its_last_block(gateway):
    """Without a tokenizer the engine's tokens are scaled to the gateway's character blocks, and
    a block's worth of rounding is allowed: character blocks straddle the engine's."""
    gw = gateway(tokenizer=False)
    inbound, info, decision = await routed(gw, chat())
    assert not info.exact
    most = gw.max_hit_blocks(info)
    decision = dataclasses.replace(decision, predicted_blocks=most, best_blocks=most)
    prompt_tokens = info.num_units // 4  # ~4 characters a token
    # the engine cached its token blocks up to the last whole one: a little under ``most`` character blocks
    chars_per_token = info.num_units / prompt_tokens
    cached_tokens = int((most - 0.5) * gw.config.routing.char_block_size / chars_per_token)
    reported = {"prompt_tokens": prompt_tokens, "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    learn(gw, inbound, info, outcome(gw, decision, reported))
    m = page(gw)
    assert metric(m, "prefix_router_cache_requests_total", result="hit") == 1
    assert metric(m, "prefix_router_prompt_tokens_total") == prompt_tokens


@pytest.mark.parametrize("evicted, cached, predicted, to_tokens, lost", [
    ((), 2, 64, 16.0, 0),  # nothing evicted in flight
    ((1,), 2, 64, 16.0, 0),  # evicted below where the engine's hit stopped: it did not stop the hit
    ((2, 3), 2, 64, 16.0, 64 - 2 * 16),  # from the first evicted block at the stop to the prediction's end
    ((1, 3), 2, 64, 16.0, 64 - 3 * 16),  # the first at or past the stop counts
    ((9,), 2, 64, 16.0, 0),  # past the prediction's end: clamped
    ((2,), 2, 60, 7.5, 60 - 15),  # character blocks: 7.5 tokens a block
])
def test_tokens_evicted_in_flight_run_from_where_the_hit_stopped_to_the_predictions_end(evicted, cached, predicted,
                                                                                       to_tokens, lost):
    assert evicted_in_flight_tokens(evicted, cached, predicted, to_tokens) == lost


async def test_with_blocks_logged_the_line_holds_the_keyed_chain_fleetsim_replays(gateway, tmp_path, monkeypatch):
    from prefix_router.misses.request_log import KEY_ENV, keyed_blocks
    from prefix_router.tools.fleetsim.jobs import load_jobs, prompt_of
    from prefix_router.prompts.tokenizer import load_tokenizer

    monkeypatch.setenv(KEY_ENV, "twelve three four five")
    path = tmp_path / "requests.jsonl"
    gw = gateway(request_log=str(path), request_log_blocks=True)
    infos = []
    for _ in range(2):  # one conversation, two turns
        inbound, info, decision = await routed(gw, chat())
        learn(gw, inbound, info, outcome(gw, decision, usage(gw, info, 0)))
        infos.append(info)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["blocks"] == keyed_blocks(infos[0].hashes, b"twelve three four five")
    assert (lines[0]["units"], lines[0]["block_size"]) == (infos[0].num_units, gw.unit_block_size(infos[0]))
    assert "body" not in lines[0] and "briefly" not in path.read_text()
    jobs = load_jobs(str(path))
    assert len(jobs) == 2 and jobs[0].session == lines[0]["conversation"]
    _, ids = prompt_of(jobs[0], load_tokenizer(None), block_size=gw.block_size, char_block_size=64)
    assert len(ids) == infos[0].num_units
