"""Cause detection online: the SWE-agent sessions, clean and with one planted break each, sent
through a gateway in front of simulated replicas; ``prefix_router_changed_total{cause}``,
``GET /debug/changes`` and the request log must name each break and nothing else."""

from __future__ import annotations

import json

import pytest

from prefix_router.app import create_app
from prefix_router.tools.audit import audit
from prefix_router.misses.diagnosis import Cause, Change
from prefix_router.misses.change_sites import ChangeSites, redacted_excerpt
from prefix_router.config import config_from_dict
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import MODEL, metric
from .test_diagnosis import BREAK_AT, plant, sessions

KINDS = ["timestamp", "tools_reordered", "keys_shuffled", "trimmed", "retrieval"]


@pytest.fixture
async def gateway(aiohttp_client, tmp_path):
    async def start(servers, **extra):
        data = {"replicas": [str(s.make_url("")).rstrip("/") for s in servers],
                "scrape": {"interval_s": 0.2}, "request_log": str(tmp_path / "requests.jsonl"), **extra}
        return await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))

    return start


async def send_session(client, turns: list[dict], session: str, salt: str) -> None:
    for body in turns:
        body = {**body, "model": MODEL, "max_tokens": 2, "cache_salt": salt}
        resp = await client.post("/v1/chat/completions", json=body, headers={"X-Session-ID": session})
        assert resp.status == 200, await resp.text()


async def test_every_planted_break_is_counted_under_its_cause_at_its_message_and_clean_sessions_under_none(
        fleet, gateway, tmp_path):
    client = await gateway(await fleet(2))
    clean = sessions()
    for n, turns in enumerate(clean):
        await send_session(client, turns[: BREAK_AT + 2], f"clean-{n}", f"clean-{n}")
    metrics = await (await client.get("/metrics")).text()
    assert metric(metrics, "prefix_router_changed_total") == 0
    assert metric(metrics, "prefix_router_cache_requests_total", result="miss_changed") == 0

    expected: dict[str, tuple[Cause, int, int]] = {}  # kind -> (cause, message index, changes)
    for kind in KINDS:
        turns, cause, index = plant(clean[0], kind)
        turns = turns[: BREAK_AT + 2]
        await send_session(client, turns, f"{kind}-0", kind)
        expected[kind] = (cause, index, len(turns) - 1 if kind == "timestamp" else 1)
    metrics = await (await client.get("/metrics")).text()
    for kind, (cause, _, count) in expected.items():
        assert metric(metrics, "prefix_router_changed_total", cause=cause.value) == count, kind
        assert metric(metrics, "prefix_router_changed_lost_tokens_total", cause=cause.value) > 0, kind
    assert metric(metrics, "prefix_router_changed_total", cause="other") == 0

    view = await (await client.get("/debug/changes?top=50")).json()
    sites = {(s["cause"], s["message_index"]) for s in view["sites"]}
    assert sites == {(cause.value, index) for cause, index, _ in expected.values()}
    assert all(s["fix"] and s["lost_tokens"] > 0 for s in view["sites"])
    by_message = sorted((s["message_index"], s["token_position"]) for s in view["sites"])
    assert [p for _, p in by_message] == sorted(p for _, p in by_message)  # later messages, later tokens
    assert all(p > 0 for m, p in by_message if m > 0)
    assert "excerpt" not in json.dumps(view)  # snippets are off by default
    # the request log names the same breaks at the same turns, without text
    lines = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    logged = [(line["cause"], line["diverged_message"]) for line in lines if line.get("cause")]
    assert sorted(logged) == sorted((c.value, i) for c, i, count in expected.values() for _ in range(count))
    assert all("body" not in line for line in lines)


async def test_snippets_are_redacted_and_bounded_and_the_request_log_can_carry_bodies(fleet, gateway, tmp_path):
    client = await gateway(await fleet(1), changes={"snippets": True, "snippet_chars": 40},
                           request_log_bodies=True)
    turns, _, _ = plant(sessions()[0], "timestamp")
    await send_session(client, turns[:3], "s", "s")
    site = (await (await client.get("/debug/changes")).json())["sites"][0]
    assert site["cause"] == "volatile_value" and site["excerpt"].startswith("Current time: #")
    assert not any(c.isdigit() for c in site["excerpt"]) and len(site["excerpt"]) <= 40
    lines = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert [line["body"]["messages"] for line in lines] == [t["messages"] for t in turns[:3]]
    assert {line["path"] for line in lines} == {"/v1/chat/completions"}
    # prefix-router audit reads that log and finds the same breaks
    report = audit(str(tmp_path / "requests.jsonl"))
    assert [(b["turn"], b["cause"], b["message_index"]) for c in report["conversations"] for b in c["breaks"]] == [
        (1, "volatile_value", 0), (2, "volatile_value", 0)]


def test_excerpts_mask_ids_addresses_and_keys():
    body = {"messages": [{"role": "system", "content": "Intro line\nUser bob@example.com, key sk-live-4f9a8b7c6d5e4f3a2b1c "
                                                       "at 2026-12-01 09:30, run 7f3c9a1b2e4d5f60"}]}
    excerpt = redacted_excerpt(body, Change(Cause.VOLATILE_VALUE, 0, "system", ""), 200)
    assert excerpt == "User <email>, key <key> at #, run #"
    assert redacted_excerpt(body, Change(Cause.OTHER, 0, "system", ""), 12) == "Intro line |"


def test_one_break_estimated_a_token_apart_in_each_request_is_one_site():
    """Without a tokenizer the token position is an estimate from characters, and it wanders by
    a token from request to request; the site is the block where the prompts diverged."""
    sites = ChangeSites()
    for position in (1975, 1976, 1977, 1978):
        sites.record(Change(Cause.VOLATILE_VALUE, 0, "system", "d"), position, 100, block=30)
    sites.record(Change(Cause.VOLATILE_VALUE, 0, "system", "d"), 2100, 100, block=32)  # another block: another site
    view = sites.view(10)["sites"]
    assert [(s["count"], s["token_position"], s["lost_tokens"]) for s in view] == [(4, 1975, 400), (1, 2100, 100)]


def test_the_site_table_is_bounded_and_totals_keep_counting():
    sites = ChangeSites(max_sites=2)
    for position in range(5):
        sites.record(Change(Cause.KEY_ORDER, 3, "tool", "d"), position, 10)
    assert len(sites) == 2 and sites.by_cause[Cause.KEY_ORDER] == [5, 50]
    assert [s["token_position"] for s in sites.view(10)["sites"]] == [0, 1]


def test_latest_lists_the_sites_last_seen_first():
    """The status page's list: a site seen again moves to the front; ``n`` bounds it."""
    sites = ChangeSites()
    for message in (1, 2, 3):
        sites.record(Change(Cause.HISTORY_REWRITTEN, message, "user", "d"), message * 100, 10)
    sites.record(Change(Cause.HISTORY_REWRITTEN, 1, "user", "d"), 100, 10)
    assert [s.message_index for s in sites.latest(10)] == [1, 3, 2]
    assert [s.message_index for s in sites.latest(2)] == [1, 3]
    assert sites.latest(1)[0].count == 2 and sites.latest(1)[0].last_seen >= sites.latest(2)[1].last_seen
