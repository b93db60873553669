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


# --- modelled time to first token: step durations, not the process's lag ---------------------

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


async def test_modelled_ttft_leaves_out_the_time_the_process_fell_behind():
    # time runs 10x faster: a loop blocked for 50 ms of wall time is 0.5 modelled seconds of lag,
    # which the modelled clock (and vllm:time_to_first_token_seconds) follows but busy_s does not
    config, engine = _engine(time_scale=10)
    request = SimRequest("a", prompt_ids(1000), 1, model=MODEL)
    engine.submit(request)
    time.sleep(0.05)  # the event loop is busy elsewhere: the step cannot start on time
    await _first_tokens(engine, request)
    prefill_s = config.step_seconds(1000, 0)
    assert request.modelled_ttft_s == pytest.approx(prefill_s, rel=1e-9)
    assert request.first_token_s - request.arrival_s >= prefill_s + 0.5 * 0.9  # the lag, in modelled seconds
    assert engine.busy_s == pytest.approx(prefill_s, rel=1e-9)


async def test_modelled_ttft_counts_the_steps_a_request_queued_behind():
    # A's 8,192 prompt tokens fill the first step's token budget: B, arriving with it, waits that
    # step, then prefills beside A's first decode (whose context is A's prompt)
    config, engine = _engine(time_scale=1000)
    a = SimRequest("a", prompt_ids(config.max_num_batched_tokens), 2, model=MODEL)
    b = SimRequest("b", prompt_ids(100, start=20_000), 1, model=MODEL)
    engine.submit(a)
    engine.submit(b)
    await _first_tokens(engine, a, b)
    first = config.step_seconds(config.max_num_batched_tokens, 0)
    assert a.modelled_ttft_s == pytest.approx(first, rel=1e-9)
    assert b.modelled_ttft_s == pytest.approx(first + config.step_seconds(100, config.max_num_batched_tokens), rel=1e-9)
