"""A simulated server of data-parallel ranks (``prefix_router/tools/sim/data_parallel.py``), driven
through its HTTP API: the rank header picks the engine (out of range: vLLM's 400), vLLM's balancer
spreads the rest, and ``/metrics`` and ``/kv_event_sources`` show each engine as vLLM 0.32 does."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from prefix_router.constants import DP_RANK_HEADER
from prefix_router.prompts.tokenizer import ByteTokenizer
from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.server import ENGINES, create_app

MODEL = "test-model"
RANKS = 4
TEXT = "a prompt of several blocks " * 12
CONFIG = SimConfig(model=MODEL, block_size=16, num_gpu_blocks=256, max_model_len=1024, time_scale=1000,
                   data_parallel_size=RANKS)


def completion(prompt: str, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}


def prompts_by_engine(app) -> list[int]:
    return [e.scheduler.num_prompt_tokens + e.scheduler.kv.num_hits for e in app[ENGINES].engines]


async def test_the_rank_header_picks_the_engine_and_one_out_of_range_is_refused(aiohttp_client):
    client = await aiohttp_client(create_app(CONFIG, ByteTokenizer()))
    app = client.server.app
    for rank in range(RANKS):
        before = prompts_by_engine(app)
        resp = await client.post("/v1/completions", json=completion(TEXT), headers={DP_RANK_HEADER: str(rank)})
        assert resp.status == 200
        after = prompts_by_engine(app)
        assert [b != a for b, a in zip(before, after)] == [r == rank for r in range(RANKS)]
    resp = await client.post("/v1/completions", json=completion(TEXT), headers={DP_RANK_HEADER: str(RANKS)})
    assert resp.status == 400
    assert (await resp.json())["error"]["message"] == f"data_parallel_rank {RANKS} is out of range [0, {RANKS})."
    usage = (await (await client.post("/v1/completions", json=completion(TEXT), headers={DP_RANK_HEADER: "1"})).json())["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == (usage["prompt_tokens"] - 1) // 16 * 16 > 0  # rank 1's cache
    resp = await client.post("/v1/completions", json=completion(TEXT), headers={DP_RANK_HEADER: "one"})
    assert resp.status == 200  # not an integer: ignored, as vLLM does


async def test_requests_naming_no_rank_are_spread_by_vllms_balancer(aiohttp_client):
    client = await aiohttp_client(create_app(CONFIG, ByteTokenizer()))
    answers = await asyncio.gather(*(client.post("/v1/completions", json=completion(f"p{i} " * 30, max_tokens=50))
                                     for i in range(2 * RANKS)))
    assert all(a.status == 200 for a in answers)
    assert all(n > 0 for n in prompts_by_engine(client.server.app))  # every engine ran some


async def test_metrics_and_event_sources_show_each_engine(aiohttp_client):
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0"}
    client = await aiohttp_client(create_app(replace(CONFIG, kv_events=events), ByteTokenizer()))
    await client.post("/v1/completions", json=completion(TEXT), headers={DP_RANK_HEADER: "2"})
    text = await (await client.get("/metrics")).text()
    families = {f.name: f for f in text_string_to_metric_families(text)}  # one family each: a valid page
    queries = {s.labels["engine"]: s.value for s in families["vllm:prefix_cache_queries"].samples
               if s.name.endswith("_total")}
    assert set(queries) == {str(r) for r in range(RANKS)} and queries["2"] > 0 == queries["0"]
    sources = await (await client.get("/kv_event_sources")).json()
    assert sorted(sources) == [str(r) for r in range(RANKS)]
    assert len({s["endpoint"] for s in sources.values()}) == RANKS  # a publisher each


def test_ranks_whose_event_ports_would_collide_are_refused_before_anything_binds():
    import pytest

    events = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    with pytest.raises(ValueError, match="leave 4 ports"):
        create_app(replace(CONFIG, kv_events=events), ByteTokenizer())
    with pytest.raises(ValueError, match="past 65535"):
        create_app(replace(CONFIG, kv_events={**events, "endpoint": "tcp://*:65534", "replay_endpoint": None}),
                   ByteTokenizer())
    create_app(replace(CONFIG, kv_events={**events, "replay_endpoint": "tcp://*:5600"}), ByteTokenizer())  # room for 4


def test_more_ranks_than_the_gateway_would_split_are_refused():
    import pytest

    from prefix_router.constants import MAX_DATA_PARALLEL_SIZE

    with pytest.raises(ValueError, match="data_parallel_size"):
        replace(CONFIG, data_parallel_size=MAX_DATA_PARALLEL_SIZE + 1).validate()
