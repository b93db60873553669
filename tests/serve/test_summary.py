"""The periodic summary line: each line's counts are its interval's own, they add up to what
``/metrics`` counts, replicas come busiest first and a large fleet's line stays short."""

from __future__ import annotations

import logging
import random
import re

from prefix_router.app import create_app
from prefix_router.config import config_from_dict
from prefix_router.metrics import sample_sum
from prefix_router.prompts.tokenizer import ByteTokenizer
from prefix_router.serve.summary import MAX_REPLICAS, summary_line
from tests.helpers import MODEL, text, until


def _snap(replicas: dict[str, tuple[float, float, float]], outcomes: dict[str, dict[str, float]]) -> dict:
    """A status-page snapshot: replica -> (requests, prompt tokens, cached tokens); ``outcomes``:
    replica -> {result: requests}."""
    totals: dict[str, float] = {}
    for by_result in outcomes.values():
        for result, n in by_result.items():
            totals[result] = totals.get(result, 0.0) + n
    return {"routable": len(replicas), "known": len(replicas),
            "replicas": [{"name": n, "queue_depth": 0, "requests": r, "prompt_tokens": p, "cached_tokens": c,
                          "predicted_tokens": c, "outcomes": outcomes.get(n, {})} for n, (r, p, c) in replicas.items()],
            "outcomes": [{"result": k, "requests": v} for k, v in totals.items()]}


def test_a_line_counts_its_interval_alone_busiest_replica_first():
    before = _snap({"a": (10, 1000, 500), "b": (5, 400, 0)}, {"a": {"hit": 6, "miss_cold": 4}, "b": {"hit": 2, "miss_cold": 3}})
    after = _snap({"a": (12, 1300, 650), "b": (10, 1400, 900)}, {"a": {"hit": 7, "miss_cold": 5}, "b": {"hit": 6, "miss_cold": 4}})
    line = summary_line(before, after, 60)
    requests, prompt, cached = 2 + 5, 300 + 1000, 150 + 900
    assert line.startswith(f"summary 60 s: {requests} requests, token hit rate {100 * cached / prompt:.1f}%")
    assert "hit 5, miss_cold 2" in line
    assert line.index("b 5 req") < line.index("a 2 req")  # busiest first
    assert f"b 5 req {100 * 900 / 1000:.1f}%" in line


def test_a_large_fleet_names_its_busiest_replicas_and_counts_the_rest():
    fleet = {f"r{i}": (i + 1, 100.0, 50.0) for i in range(3 * MAX_REPLICAS)}
    line = summary_line(None, _snap(fleet, {"r0": {"hit": 1}}), 10)
    named = re.findall(r"(r\d+) \d+ req", line)
    assert named == [f"r{i}" for i in range(3 * MAX_REPLICAS - 1, 2 * MAX_REPLICAS - 1, -1)]
    assert line.endswith(f", {2 * MAX_REPLICAS} more")


def test_a_replica_forgotten_or_back_under_its_name_takes_nothing_off_the_interval():
    """Discovery forgets a drained replica's series (``Metrics.forget_replica``): the outcome sums
    drop, and a replica back under the same name counts from 0. Neither is a negative count."""
    before = _snap({"a": (10, 1000, 500), "b": (50, 5000, 4000)},
                   {"a": {"hit": 6, "miss_cold": 4}, "b": {"hit": 40, "miss_cold": 10}})
    gone = _snap({"a": (13, 1300, 650)}, {"a": {"hit": 8, "miss_cold": 5}})
    line = summary_line(before, gone, 60)
    assert line.startswith("summary 60 s: 3 requests, token hit rate 50.0%") and "hit 2, miss_cold 1" in line
    back = _snap({"a": (13, 1300, 650), "b": (2, 100, 0)}, {"a": {"hit": 8, "miss_cold": 5}, "b": {"miss_cold": 2}})
    line = summary_line(before, back, 60)
    assert line.startswith("summary 60 s: 5 requests") and "hit 2, miss_cold 3" in line and "b 2 req 0.0%" in line
    assert "-" not in line.replace("(predicted -)", "").replace(" - ", "")


async def test_a_forgotten_replicas_series_leave_no_negative_count_in_the_next_line(aiohttp_client, fleet):
    from prefix_router.app import GATEWAY
    from prefix_router.serve.status_page import snapshot

    sims = await fleet(2)
    urls = [str(s.make_url("")).rstrip("/") for s in sims]
    client = await aiohttp_client(create_app(config_from_dict({"replicas": urls}), ByteTokenizer()))
    gw = client.app[GATEWAY]
    rng = random.Random(1)
    for turn in range(8):
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": text(rng, 30 + turn)}]}
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
    before = snapshot(gw)
    for name in list(gw.replicas):
        gw.metrics.forget_replica(name)
    line = summary_line(before, snapshot(gw), 60)
    assert re.fullmatch(r"summary 60 s: 0 requests, token hit rate - \(predicted -\); "
                        r"hit 0, miss_cold 0, miss_changed 0, miss_routed 0, miss_evicted 0; 2/2 routable", line), line


def test_an_idle_interval_is_one_short_line():
    snap = _snap({"a": (3, 100, 50)}, {"a": {"hit": 3}})
    line = summary_line(snap, snap, 60)
    assert line.startswith("summary 60 s: 0 requests, token hit rate - (predicted -)") and "replicas:" not in line


async def test_the_gateway_logs_lines_whose_counts_add_up_to_its_metrics(aiohttp_client, fleet, caplog):
    sims = await fleet(2)
    config = config_from_dict({"replicas": [str(s.make_url("")).rstrip("/") for s in sims],
                               "summary_interval_s": 1})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    caplog.set_level(logging.INFO, logger="prefix_router.summary")
    rng = random.Random(0)
    system = text(rng, 400)
    for turn in range(6):
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": system},
                                                             {"role": "user", "content": text(rng, 20 + turn)}]}
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
    page = await (await client.get("/metrics")).text()
    wanted = sample_sum(page, "prefix_router_cache_requests_total")

    def logged() -> tuple[int, int]:
        lines = [r.getMessage() for r in caplog.records if r.name == "prefix_router.summary"]
        return sum(int(re.match(r"summary \S+ s: (\d+) requests", m).group(1)) for m in lines), len(lines)

    await until(lambda: logged()[0] == wanted, 5)
    lines = logged()[1]
    await until(lambda: logged()[1] > lines, 5)  # the next interval, idle, adds nothing
    assert wanted == 6 and logged()[0] == wanted
