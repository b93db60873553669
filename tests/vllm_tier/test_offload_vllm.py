"""CPU offload tiers on the real engine: a vLLM CPU replica with the ``OffloadingConnector`` and
``self_describing_kv_events`` (its mover replaced for the CPU build: ``cpu_offload_spec.py``; the
manager, its LRU and the events are vLLM's own) beside a plain one, the gateway in front following
both replicas' KV events.

What it shows: a conversation's prefix pushed off the offloading replica's GPU by other traffic
and kept on its CPU tier is predicted as a CPU hit (the request log's ``predicted_offload_tokens``)
and routed there over the replica holding a quarter of it on its GPU, and the engine's
``cached_tokens`` (its GPU hit plus the tokens it loaded) is the prediction exactly.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from prefix_router.app import GATEWAY, create_app
from prefix_router.config import config_from_dict
from prefix_router.constants import REPLICA_HEADER
from prefix_router.prompts.tokenizer import HFTokenizer
from prefix_router.tools import launch

from ..helpers import text
from .harness import post_json, tiny_model, vllm_spec

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32


def _spec(log_dir: Path, offload: bool) -> launch.Server:
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{launch.free_port()}"}
    extra = ["--kv-events-config", json.dumps(events)]
    if offload:
        extra += ["--kv-transfer-config", json.dumps({
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20, "self_describing_kv_events": True,
                                          "spec_name": "CPUHostOffloadingSpec", "spec_module_path": "cpu_offload_spec"}})]
    spec = vllm_spec(log_dir, block_size=BLOCK_SIZE, num_blocks=256, max_model_len=2048, extra=extra)
    if offload:
        spec.env["PYTHONPATH"] = str(Path(__file__).parent)
    return spec


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("vllm-offload")
    with launch.running([_spec(log_dir, offload=True), _spec(log_dir, offload=False)]) as urls:
        yield urls


def _chat(base: str, messages: list) -> dict:
    return post_json(base + "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 2})


async def test_a_prefix_kept_on_a_real_cpu_tier_is_predicted_and_routed_to(engines, aiohttp_client, tmp_path):
    offloading, plain = engines
    log = tmp_path / "requests.jsonl"
    config = config_from_dict({"replicas": [{"url": offloading}, {"url": plain}], "tokenizer": str(tiny_model()),
                               "request_log": str(log), "health": {"timeout_s": 10.0, "unhealthy_after": 3},
                               "routing": {"cpu_hit_weight": 0.75}})
    client = await aiohttp_client(create_app(config, HFTokenizer(str(tiny_model()))))
    gw = client.server.app[GATEWAY]
    name = offloading.split("//")[1]
    for _ in range(300):  # the streams start once each replica's models are known
        if all(r.stream is not None and r.stream.fresh for r in gw.replicas.values()):
            break
        await asyncio.sleep(0.1)
    rng = random.Random(3)
    document = text(rng, 200)  # about 600 tokens
    chat = [{"role": "system", "content": document}, {"role": "user", "content": "summarize"}]
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, _chat, offloading, chat)
    for _ in range(14):  # other conversations push it off the offloading replica's GPU (256 blocks)
        await loop.run_in_executor(None, _chat, offloading, [{"role": "user", "content": text(rng, 200)}])
    await loop.run_in_executor(None, _chat, plain, [{"role": "system", "content": document[:len(document) // 4]},
                                                    {"role": "user", "content": "hi"}])
    view = gw.replicas[name].stream.view
    seen, still = -1, 0
    while still < 10:  # the CPU tier's events have all arrived once it stops changing for a second
        await asyncio.sleep(0.1)
        now = (len(view.offload["CPU"]) if "CPU" in view.offload else 0, view.removals)
        seen, still = now, still + 1 if now == seen else 0
    assert view.removals > 0 and len(view.offload["CPU"]) > 0, (view.removals, view.offload)
    chat += [{"role": "assistant", "content": "a summary"}, {"role": "user", "content": "and the details?"}]
    resp = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": chat, "max_tokens": 2})
    assert resp.status == 200, await resp.text()
    usage = (await resp.json())["usage"]
    await asyncio.sleep(1.0)
    line = [json.loads(x) for x in log.read_text().splitlines()][-1]
    assert resp.headers[REPLICA_HEADER] == name, line
    other = next(r for n, r in gw.replicas.items() if n != name)
    assert 0 < len(other.stream.view) < line["predicted_cached_tokens"] // BLOCK_SIZE  # its quarter, on its GPU
    assert line["predicted_offload_tokens"]["CPU"] > 0, line
    assert line["predicted_cached_tokens"] == line["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
