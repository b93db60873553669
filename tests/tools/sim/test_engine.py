"""The simulated engine's loop (``prefix_router/tools/sim/engine.py``): a client that leaves frees
its KV blocks, and ``/reset_prefix_cache`` forgets every block once none is held."""

from __future__ import annotations

import asyncio

from prefix_router.tools.sim.config import SimConfig
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
