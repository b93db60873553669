"""The simulated replica's CPU offload tier (``prefix_router/tools/sim/offload.py``), through its
HTTP API and its KV events: a prefix evicted from the GPU and kept on the CPU tier is loaded back
and reported cached, as vLLM's OffloadingConnector does, and each change is announced as its
self-describing events announce it."""

from __future__ import annotations

from prefix_router.prompts.tokenizer import ByteTokenizer
from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.kv_events import BlockRemoved, BlockStored
from prefix_router.tools.sim.server import ENGINE, create_app

MODEL = "test-model"
BS = 16
EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"}


def config(**more) -> SimConfig:
    return SimConfig(**{"model": MODEL, "block_size": BS, "num_gpu_blocks": 40, "max_model_len": 512,
                        "time_scale": 1000, "cpu_offload_blocks": 200, **more})


async def complete(client, prompt: str) -> dict:
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert resp.status == 200
    return (await resp.json())["usage"]


def prompt(i: int) -> str:
    return f"document {i}: " + " ".join(f"w{i}x{j}" for j in range(300))


async def test_a_prefix_evicted_from_the_gpu_is_loaded_from_the_cpu_tier(aiohttp_client):
    client = await aiohttp_client(create_app(config(), ByteTokenizer()))
    kv = client.server.app[ENGINE].scheduler.kv
    first = await complete(client, prompt(0))
    full = (first["prompt_tokens"] - 1) // BS * BS
    for i in range(1, 4):  # 39 GPU blocks: three more documents push the first off the GPU
        await complete(client, prompt(i))
    hits_before = kv.num_hits
    again = await complete(client, prompt(0))
    assert again["prompt_tokens_details"]["cached_tokens"] == full > 0  # from the CPU tier
    assert kv.num_hits - hits_before < full  # vLLM's prefix-cache hits count the GPU's only
    assert kv.cpu.num_loaded_tokens > 0


async def test_the_cpu_tier_announces_each_block_with_its_tokens_and_evicts_the_least_recently_used(aiohttp_client):
    client = await aiohttp_client(create_app(config(cpu_offload_blocks=40, kv_events=EVENTS), ByteTokenizer()))
    publisher = client.server.app[ENGINE].publisher
    events: list = []
    publish = publisher.publish

    def recorded(batch):  # what each step publishes, as the publisher encodes it (tests/cache/test_events.py)
        events.extend(batch)
        publish(batch)
    publisher.publish = recorded
    await complete(client, prompt(0))
    await complete(client, prompt(1))  # 31 blocks each: the second pushes most of the first off the tier
    cpu = [e for e in events if e.medium == "CPU" and isinstance(e, BlockStored)]
    assert len(cpu) == 62 and all(len(e.block_hashes) == 1 and len(e.token_ids) == e.block_size == BS for e in cpu)
    assert [e.parent_block_hash for e in cpu[:2]] == [None, cpu[0].block_hashes[0]]
    removed = [h for e in events if e.medium == "CPU" and isinstance(e, BlockRemoved) for h in e.block_hashes]
    first_prompt = [e.block_hashes[0] for e in cpu[:31]]
    assert len(removed) == 62 - 40 and set(removed) <= set(first_prompt)
    assert removed == first_prompt[-len(removed):][::-1]  # its tail went first, its head stays
