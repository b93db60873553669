"""The gateway in front of replicas that offload KV blocks to CPU memory, black box: simulated
replicas whose CPU tier announces its blocks as vLLM's OffloadingConnector does with
``self_describing_kv_events`` (``prefix_router/tools/sim/offload.py``; vLLM 0.32's CPU build
refuses the connector: "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs").
A prefix evicted from one replica's GPU and still on its CPU tier is predicted as a CPU hit and
routed there over a replica that holds less of it on its GPU, unless the tier's weight is 0."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from prefix_router.app import GATEWAY, create_app
from prefix_router.config import config_from_dict
from prefix_router.constants import REPLICA_HEADER
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import MODEL, metric, text
from .test_kv_events_gateway import EVENTS


async def post(session, url: str, messages: list) -> tuple[str | None, dict]:
    async with session.post(url + "/v1/chat/completions",
                            json={"model": MODEL, "messages": messages, "max_tokens": 4}) as resp:
        body = await resp.json()
        assert resp.status == 200, body
        return resp.headers.get(REPLICA_HEADER), body["usage"]


@pytest.mark.parametrize("cpu_weight", [0.75, 0.0])
async def test_a_prefix_on_a_cpu_tier_is_predicted_and_routed_to_over_recomputing_it(fleet, aiohttp_client, tmp_path,
                                                                                    cpu_weight):
    servers = await fleet(2, num_gpu_blocks=80, max_model_len=1200, block_size=16, kv_events=EVENTS,
                          cpu_offload_blocks=1000)
    urls = [str(s.make_url("")).rstrip("/") for s in servers]
    log = tmp_path / "requests.jsonl"
    config = config_from_dict({"replicas": [{"url": u} for u in urls], "request_log": str(log),
                               "routing": {"cpu_hit_weight": cpu_weight}, "kv_events": {"parity_grace_s": 0.3}})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    gw = client.server.app[GATEWAY]
    rng = random.Random(5)
    document = text(rng, 700)
    chat = [{"role": "system", "content": document}, {"role": "user", "content": "summarize"}]
    resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": chat, "max_tokens": 4})
    assert resp.status == 200
    holder = resp.headers[REPLICA_HEADER]
    (holder_url,) = [u for u in urls if u.endswith(holder)]
    (other_url,) = [u for u in urls if u != holder_url]
    async with aiohttp.ClientSession() as direct:  # around the gateway, as another router's traffic would go
        for _ in range(4):  # other documents push this one off the holder's GPU; its CPU tier keeps it
            await post(direct, holder_url, [{"role": "user", "content": text(rng, 700)}])
        # the other replica computes the document's opening only
        await post(direct, other_url, [{"role": "system", "content": document[:len(document) // 4]},
                                       {"role": "user", "content": "hi"}])
    views = {name: r.stream.view for name, r in gw.replicas.items()}
    for _ in range(200):  # the events reach the gateway
        if len(views[holder].offload.get("CPU", ())) > 40 and views[holder].removals > 0:
            break
        await asyncio.sleep(0.02)
    chat += [{"role": "assistant", "content": "a summary"}, {"role": "user", "content": "and the details?"}]
    resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": chat, "max_tokens": 4})
    usage = (await resp.json())["usage"]
    await asyncio.sleep(0.5)
    line = [json.loads(x) for x in log.read_text().splitlines()][-1]
    if cpu_weight:
        assert resp.headers[REPLICA_HEADER] == holder  # loading it beats recomputing three quarters of it
        assert line["predicted_offload_tokens"]["CPU"] > 0
        assert line["predicted_cached_tokens"] == line["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        shown = {r["name"]: r for r in (await (await client.get("/replicas")).json())["replicas"]}
        assert shown[holder]["kv_events"]["offload"]["CPU"]["blocks"] > 40
        page = await (await client.get("/metrics")).text()
        assert metric(page, "prefix_router_cached_tokens_predicted_offload_total", replica=holder, medium="CPU") > 0
    else:
        assert resp.headers[REPLICA_HEADER] != holder  # the tier ignored: the GPU's quarter wins
        assert "predicted_offload_tokens" not in line and line["predicted_cached_tokens"] == line["cached_tokens"]
