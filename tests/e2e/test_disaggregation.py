"""Prefill/decode disaggregation, black box: the gateway in front of 2 prefill and 4 decode
simulated replicas that play vLLM's NixlConnector roles and count every departure from the
request flow of vLLM's own proxy (``prefix_router/tools/sim/kv_transfer.py``), driven with the
official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys

import openai
from prometheus_client.parser import text_string_to_metric_families

from prefix_router.app import GATEWAY, create_app
from prefix_router.config import config_from_dict
from prefix_router.gateway import replica_name
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import MODEL, text
from .test_gateway import healthy_url

PRODUCER = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
CONSUMER = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}


def url_of(server) -> str:
    return str(server.make_url("")).rstrip("/")


async def samples(http, url: str, name: str, label: str) -> dict[str, float]:
    page = await (await http.get(url + "/metrics")).text()
    return {s.labels[label]: s.value for f in text_string_to_metric_families(page) for s in f.samples
            if s.name == name}


async def start(fleet, aiohttp_client, tmp_path, prefill_urls=(), **sim):
    prefill = [url_of(s) for s in await fleet(2 - len(prefill_urls), kv_transfer=PRODUCER, **sim)]
    decode = [url_of(s) for s in await fleet(4, kv_transfer=CONSUMER, **sim)]
    prefill += list(prefill_urls)
    log = tmp_path / "requests.jsonl"
    config = config_from_dict({
        "replicas": [{"url": u, "role": "prefill"} for u in prefill] + [{"url": u, "role": "decode"} for u in decode],
        "health": {"interval_s": 0.2, "unhealthy_after": 1}, "request_log": str(log)})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    return client, prefill, decode, log


async def no_violation(client, urls: list[str]) -> None:
    for url in urls:
        seen = await samples(client.session, url, "sim:kv_contract_violations_total", "kind")
        assert seen and not any(seen.values()), (url, {k: v for k, v in seen.items() if v})


async def test_every_api_is_served_in_two_legs_and_repeated_prompts_reach_their_prefill_replica(
        fleet, aiohttp_client, tmp_path):
    client, prefill, decode, log = await start(fleet, aiohttp_client, tmp_path)
    rng = random.Random(3)
    documents = [text(rng, 120) for _ in range(4)]
    async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0) as oa:
        for turn in range(3):  # each document asked about three times, every API and mode
            for d, doc in enumerate(documents):
                messages = [{"role": "user", "content": f"{doc}\nquestion {turn}"}]
                chat = await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
                assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
                stream = await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True)
                pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
                assert "".join(pieces)
                done = await oa.completions.create(model=MODEL, prompt=f"{doc} ({turn})", max_tokens=3,
                                                   stream=d % 2 == 0)
                if d % 2 == 0:
                    assert [c async for c in done]
                else:
                    assert done.usage.completion_tokens == 3
                response = await oa.responses.create(model=MODEL, input=f"{doc}\nresponse {turn}",
                                                     max_output_tokens=3)
                assert response.status == "completed" and response.usage.output_tokens == 3
        several = await oa.chat.completions.create(model=MODEL, max_tokens=2, n=3,
                                                   messages=[{"role": "user", "content": documents[0]}])
        assert len(several.choices) == 3
        continued = await oa.responses.create(model=MODEL, input="and then?", previous_response_id=response.id,
                                              max_output_tokens=2)
        assert continued.status == "completed"
        streamed = await oa.responses.create(model=MODEL, input=documents[1], max_output_tokens=3, stream=True)
        assert [e.type async for e in streamed][-1] == "response.completed"
    await no_violation(client, prefill + decode)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(line["status"] == 200 for line in lines) and len(lines) == 4 * 3 * 4 + 3
    prefill_names = {replica_name(u) for u in prefill}
    split = [line for line in lines if line["transfer"] == "pulled"]
    assert len(split) == 4 * 3 * 4 + 1  # all but n > 1 and the continued Response, which go whole
    assert {line["replica"] for line in split} == prefill_names  # both prefill replicas used
    assert {line["decode_replica"] for line in split} <= {replica_name(u) for u in decode}
    assert {line["transfer"] for line in lines if line not in split} == {"whole"}
    # repeated prompts: after its first request, each prefill computes little of a document it holds
    pulled = sum([(await samples(client.session, u, "sim:kv_transfers_total", "outcome"))["pulled"] for u in decode])
    assert pulled == len(split)
    hits = sum(line["cached_tokens"] for line in split)
    assert hits >= 0.6 * sum(line["prompt_tokens"] for line in split), "repeated prompts missed their prefill replica"
    page = await (await client.get("/metrics")).text()
    assert "prefix_router_decode_requests_total" in page


def spawn_prefill(port: int) -> subprocess.Popen:
    """A prefill replica in its own process, so it can be killed for real."""
    return subprocess.Popen([sys.executable, "-m", "prefix_router.cli", "sim", "--port", str(port), "--model", MODEL,
                             "--num-blocks", "20000", "--time-scale", "20", "--kv-transfer-config",
                             json.dumps(PRODUCER)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def test_a_prefill_replica_killed_mid_run_fails_no_request(fleet, aiohttp_client, tmp_path,
                                                                 unused_tcp_port_factory):
    port = unused_tcp_port_factory()
    victim = spawn_prefill(port)
    try:
        client, prefill, decode, log = await start(fleet, aiohttp_client, tmp_path, [await healthy_url(port)],
                                                   time_scale=20.0)
        gw = client.server.app[GATEWAY]
        rng = random.Random(5)

        async def one(i: int) -> tuple[int, str]:
            await asyncio.sleep(i * 0.01)
            body = {"model": MODEL, "max_tokens": 40, "stream": i % 2 == 0,
                    "messages": [{"role": "user", "content": f"{i} " + text(rng, 200)}]}
            resp = await client.post("/v1/chat/completions", json=body)
            return resp.status, await resp.text()

        tasks = [asyncio.create_task(one(i)) for i in range(80)]
        dead = gw.replicas[replica_name(f"http://127.0.0.1:{port}")]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while dead.recent < 10 and loop.time() < deadline:  # it served prefill legs, and more are coming
            await asyncio.sleep(0.005)
        victim.send_signal(signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    finally:
        victim.kill()
        victim.wait()
    for i, (status, raw) in enumerate(results):
        assert status == 200, raw
        assert raw.rstrip().endswith("data: [DONE]") if i % 2 == 0 else json.loads(raw)["choices"]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(line["replica"] == dead.name for line in lines), "the killed replica served nothing: no test"
    assert any(line["route"] == "retry" and line["replica"] != dead.name for line in lines), "nothing retried: no test"
    transfers = {line["transfer"] for line in lines}
    assert "pulled" in transfers
    await no_violation(client, [u for u in prefill + decode if not u.endswith(f":{port}")])
