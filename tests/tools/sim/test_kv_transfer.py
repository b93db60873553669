"""The simulated replica's KV connector (``prefix_router/tools/sim/kv_transfer.py``): a prefill
replica and a decode replica on loopback, driven with the request flow of vLLM's own proxy, and
each departure from it counted."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from prefix_router.serve.disagg import PREFILL_PARAMS
from prefix_router.tools.sim.kv_transfer import Connector
from prefix_router.tools.sim.server import CONNECTOR, ENGINE

from .test_server import CONFIG, MODEL, make_client, metric_samples, prompt_ids

PRODUCER = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
CONSUMER = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}


async def pair(aiohttp_client, lease_s: float = 30.0):
    extra = {"kv_connector_extra_config": {"lease_s": lease_s}}
    prefill = await make_client(aiohttp_client, dataclasses.replace(CONFIG, kv_transfer={**PRODUCER, **extra}))
    decode = await make_client(aiohttp_client, dataclasses.replace(CONFIG, kv_transfer=CONSUMER))
    return prefill, decode


async def post(client, **body):
    resp = await client.post("/v1/completions", json={"model": MODEL, **body})
    return resp.status, await resp.json()


async def violations(client) -> dict[str, float]:
    return {s.labels["kind"]: s.value for s in (await metric_samples(client))["sim:kv_contract_violations_total"]}


async def transfers(client) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for s in (await metric_samples(client))["sim:kv_transfers_total"]}


async def test_a_decode_pulls_the_prefills_blocks_and_computes_only_the_last_token(aiohttp_client):
    prefill, decode = await pair(aiohttp_client)
    prompt = prompt_ids(100)
    status, first = await post(prefill, prompt=prompt, max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
    params = first["kv_transfer_params"]
    assert status == 200 and params["do_remote_prefill"] is True and params["remote_block_ids"]
    assert prefill.server.app[ENGINE].scheduler.held  # held for the decode
    before = decode.server.app[ENGINE].scheduler.num_prompt_tokens
    status, second = await post(decode, prompt=prompt, max_tokens=5, kv_transfer_params=params)
    assert status == 200 and second["usage"]["completion_tokens"] == 5
    assert decode.server.app[ENGINE].scheduler.num_prompt_tokens - before == 100 - 96  # 6 full blocks pulled
    # the decode reports the prefill's own hit, as vLLM 0.32 does (kv_transfer_params.remote_prefill_cached_tokens)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == params["remote_prefill_cached_tokens"] == 0
    assert not prefill.server.app[ENGINE].scheduler.held  # freed once pulled
    assert (await transfers(decode))["pulled"] == 1
    assert set((await violations(prefill)).values()) == {0} and set((await violations(decode)).values()) == {0}
    # the same parameters again: the blocks are gone (vLLM would read freed blocks and answer 200)
    status, _ = await post(decode, prompt=prompt, max_tokens=5, kv_transfer_params=params)
    assert status == 200 and (await violations(decode))["unknown_transfer"] == 1


async def test_a_decode_without_parameters_computes_the_prompt_itself(aiohttp_client):
    _, decode = await pair(aiohttp_client)
    status, body = await post(decode, prompt=prompt_ids(50), max_tokens=2)
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (await transfers(decode))["computed"] == 1 and set((await violations(decode)).values()) == {0}


async def test_a_lease_that_ends_frees_the_blocks_and_a_late_decode_is_counted(aiohttp_client):
    prefill, decode = await pair(aiohttp_client, lease_s=0.5)  # modelled seconds: time_scale 1000
    prompt = prompt_ids(64)
    _, first = await post(prefill, prompt=prompt, max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
    for _ in range(40):
        if not prefill.server.app[ENGINE].scheduler.held:
            break
        await asyncio.sleep(0.05)
    assert not prefill.server.app[ENGINE].scheduler.held
    status, _ = await post(decode, prompt=prompt, max_tokens=2, kv_transfer_params=first["kv_transfer_params"])
    assert status == 200 and (await violations(decode))["unknown_transfer"] == 1


async def test_a_prefill_replica_that_cannot_be_reached_fails_the_decode_with_a_500(aiohttp_client):
    prefill, decode = await pair(aiohttp_client)
    _, first = await post(prefill, prompt=prompt_ids(64), max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
    params = {**first["kv_transfer_params"], "remote_port": 9}  # nothing listens on the discard port
    status, body = await post(decode, prompt=prompt_ids(64), max_tokens=2, kv_transfer_params=params)
    assert status == 500 and body["error"]["code"] == 500
    assert (await transfers(decode))["failed"] == 1


async def test_each_departure_from_the_proxys_flow_is_counted_by_kind(aiohttp_client):
    prefill, decode = await pair(aiohttp_client)
    await post(prefill, prompt=prompt_ids(40), max_tokens=1)  # a whole request on a prefill replica
    await post(prefill, prompt=prompt_ids(40), max_tokens=3, kv_transfer_params=dict(PREFILL_PARAMS))
    resp = await prefill.post("/v1/completions", json={"model": MODEL, "prompt": prompt_ids(40), "max_tokens": 1,
                                                       "stream": True, "kv_transfer_params": dict(PREFILL_PARAMS)})
    await resp.read()
    await post(decode, prompt=prompt_ids(40), max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
    _, first = await post(prefill, prompt=prompt_ids(80), max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
    await post(decode, prompt=prompt_ids(80, start=5000), max_tokens=1, kv_transfer_params=first["kv_transfer_params"])
    seen = await violations(prefill)
    assert (seen["whole_request_on_prefill_replica"], seen["prefill_not_one_token"], seen["prefill_streamed"]) == (1, 1, 1)
    seen = await violations(decode)
    assert (seen["prefill_on_decode_replica"], seen["prompt_mismatch"]) == (1, 1)


async def test_a_replica_without_a_connector_counts_parameters_it_was_sent(aiohttp_client):
    plain = await make_client(aiohttp_client)
    status, body = await post(plain, prompt=prompt_ids(40), max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
    assert status == 200 and "kv_transfer_params" not in body
    assert plain.server.app[CONNECTOR].violations["no_connector"] == 1


def test_a_connector_config_names_a_role_vllm_knows_and_nixls_flow():
    for bad in ({"kv_connector": "NixlConnector"}, {"kv_role": "kv_prefill"},
                {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}):
        with pytest.raises(ValueError, match="--kv-transfer-config"):
            Connector(bad)
    assert Connector(None).role is None and Connector(PRODUCER).role == "kv_producer"
