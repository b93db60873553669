"""The simulated engine's loop (``prefix_router/tools/sim/engine.py``): a client that leaves frees
its KV blocks, ``/reset_prefix_cache`` forgets every block once none is held, and a request's
modelled time to first token counts the steps it waited through but not the process's lag."""

from __future__ import annotations

import asyncio
import time

import pytest

from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.engine import Engine
from prefix_router.tools.sim.scheduler import SimRequest
from prefix_router.tools.sim.server import ENGINE

from .test_server import MODEL, complete, expected_hit, make_client, metric_samples, prompt_ids


async def test_a_client_that_disconnects_mid_stream_frees_its_kv_blocks(aiohttp_client):
    # Real time (time_scale 1): 6 ms a token, so 1,000 tokens outlast the disconnect by far.
    config = SimConfig(model=MODEL, block_size=16, num_gpu_blocks=256, max_model_len=2048, time_scale=1)
    client = await make_client(aiohttp_client, config)
    kv = client.server.app[ENGINE].scheduler.kv
    resp = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt_ids(100), "max_tokens": 1000, "stream": True})
    assert resp.status == 200
    first = await resp.content.readline()
    assert first.startswith(b"data: ")
    assert kv.num_free_blocks < config.num_gpu_blocks - 1  # the request holds blocks now
    resp.close()
    for _ in range(200):
        if kv.num_free_blocks == config.num_gpu_blocks - 1:
            break
        await asyncio.sleep(0.01)
    assert kv.num_free_blocks == config.num_gpu_blocks - 1
    samples = await metric_samples(client)
    assert samples["vllm:kv_cache_usage_perc"][0].value == 0
    assert samples["vllm:num_requests_running"][0].value == 0


async def test_reset_prefix_cache_forgets_every_block_and_is_refused_while_a_request_holds_blocks(aiohttp_client):
    # vLLM's dev-mode endpoint (BlockPool.reset_prefix_cache): benchmarks reuse replicas with it
    config = SimConfig(model=MODEL, block_size=16, num_gpu_blocks=256, max_model_len=2048, time_scale=1)
    client = await make_client(aiohttp_client, config)
    prompt = prompt_ids(64, start=7000)
    await complete(client, prompt=prompt, max_tokens=1)
    stream = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt_ids(100), "max_tokens": 1000, "stream": True})
    await stream.content.readline()  # running: it holds blocks
    refused = await client.post("/reset_prefix_cache")
    assert (refused.status, await refused.json()) == (200, {"success": False})
    stream.close()
    for _ in range(200):
        done = await (await client.post("/reset_prefix_cache")).json()
        if done["success"]:
            break
        await asyncio.sleep(0.01)
    assert done == {"success": True}
    _, again = await complete(client, prompt=prompt, max_tokens=1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _, third = await complete(client, prompt=prompt, max_tokens=1)  # it caches again after
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_hit(64, config.block_size)


# --- modelled time to first token: the engine's clock, not the process's lag ------------------

def _engine(**overrides):
    config = SimConfig(model=MODEL, block_size=16, num_gpu_blocks=2048, max_model_len=16_384, **overrides)
    return config, Engine(config, vocab_size=32_000)


async def _first_tokens(engine, *requests) -> None:
    """Run ``engine`` until every request has its first token."""
    task = asyncio.create_task(engine.run())
    try:
        for _ in range(2000):
            if all(r.first_token_s is not None for r in requests):
                return
            await asyncio.sleep(0.001)
        raise AssertionError("no first token")
    finally:
        task.cancel()


def _ttft(request: SimRequest) -> float:
    return request.first_token_s - request.arrival_s


async def test_a_request_that_waits_on_a_busy_process_gets_its_modelled_ttft():
    # time runs 10x faster: a loop blocked for 50 ms of wall time is 0.5 modelled seconds late;
    # the step still starts at the request's arrival on the modelled clock
    config, engine = _engine(time_scale=10)
    request = SimRequest("a", prompt_ids(1000), 1, model=MODEL)
    engine.submit(request)
    time.sleep(0.05)  # the event loop is busy elsewhere: the step cannot start on time
    await _first_tokens(engine, request)
    assert _ttft(request) == pytest.approx(config.step_seconds(1000, 0), rel=1e-9)
    assert engine.lag_s >= 0.5 * 0.9  # it ran behind the wall clock


async def test_a_backlog_of_the_past_is_not_queueing_for_a_later_arrival():
    # A arrives, the process stalls for 1 modelled second, B arrives: on the modelled clock A
    # prefilled and finished (2 steps) long before B arrived, so B waits for nothing, although
    # the engine computes A's steps after B reached it
    config, engine = _engine(time_scale=10)
    a = SimRequest("a", prompt_ids(4000), 2, model=MODEL)
    b = SimRequest("b", prompt_ids(100, start=20_000), 1, model=MODEL)
    engine.submit(a)
    time.sleep(0.1)
    engine.submit(b)
    await _first_tokens(engine, a, b)
    assert b.arrival_s - a.arrival_s >= 1.0 * 0.9
    assert _ttft(a) == pytest.approx(config.step_seconds(4000, 0), rel=1e-9)
    assert _ttft(b) == pytest.approx(config.step_seconds(100, 0), rel=1e-9)


async def test_modelled_ttft_counts_the_steps_a_request_queued_behind():
    # A's 8,192 prompt tokens fill the first step's token budget: B, arriving with it, waits that
    # step, then prefills beside A's first decode (whose context is A's prompt)
    config, engine = _engine(time_scale=1000)
    a = SimRequest("a", prompt_ids(config.max_num_batched_tokens), 2, model=MODEL)
    b = SimRequest("b", prompt_ids(100, start=20_000), 1, model=MODEL)
    engine.submit(a, b)  # one arrival
    await _first_tokens(engine, a, b)
    first = config.step_seconds(config.max_num_batched_tokens, 0)
    assert _ttft(a) == pytest.approx(first, rel=1e-9)
    assert _ttft(b) == pytest.approx(first + config.step_seconds(100, config.max_num_batched_tokens), rel=1e-9)
