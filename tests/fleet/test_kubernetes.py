"""Pod discovery through the Kubernetes API (``prefix_router/fleet/kubernetes.py``), black box: the
gateway, configured with a kubeconfig as an operator would, against a fake API server that speaks
LIST and WATCH with resource versions, bookmarks and 410 Gone (``kube_api.py``, written from the
API's documentation: no API server runs here), in front of simulated replicas on loopback
addresses that stand for pod IPs."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from prefix_router.app import GATEWAY, create_app
from prefix_router.config import KubernetesConfig, ReplicaConfig, config_from_dict
from prefix_router.constants import (DP_SIZE_ANNOTATION, KV_EVENTS_PORT_ANNOTATION, KV_EVENTS_REPLAY_PORT_ANNOTATION,
                                     MAX_DATA_PARALLEL_SIZE, REPLICA_HEADER)
from prefix_router.fleet.kubernetes import namespace_of, target
from prefix_router.prompts.tokenizer import ByteTokenizer
from prefix_router.tools.launch import free_port
from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.server import create_app as create_sim

from ..helpers import MODEL
from .kube_api import FakeKubeApi, kubeconfig

CONFIG = KubernetesConfig(label_selector="app=vllm")


def pod(ip: str = "10.0.0.7", ready: str = "True", **meta) -> dict:
    return {"metadata": {"name": "p", "labels": {"app": "vllm"}, **meta},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]}}


def test_a_pod_takes_traffic_while_ready_with_an_ip_and_not_terminating():
    assert target(pod(), CONFIG) == ReplicaConfig(url="http://10.0.0.7:8000")
    assert target(pod(ready="False"), CONFIG) is None
    assert target(pod(ip=None), CONFIG) is None
    assert target(pod(deletionTimestamp="2026-12-07T10:00:00Z"), CONFIG) is None  # Ready still True then
    assert target({"metadata": {"name": "p"}, "status": {"podIP": "10.0.0.7"}}, CONFIG) is None  # no conditions
    assert target(pod(ip="fd00::7"), CONFIG).url == "http://[fd00::7]:8000"
    assert target(pod(labels={"llm-d.ai/role": "prefill"}), CONFIG).role == "prefill"
    assert target(pod(labels={"llm-d.ai/role": "encode"}), CONFIG).role == "both"  # unknown: serves whole


def test_a_pods_annotations_give_its_data_parallel_ranks_and_kv_event_ports(caplog):
    notes = {DP_SIZE_ANNOTATION: "4", KV_EVENTS_PORT_ANNOTATION: "5557", KV_EVENTS_REPLAY_PORT_ANNOTATION: "5600"}
    rc = target(pod(annotations=notes), CONFIG)
    assert (rc.data_parallel_size, rc.kv_events, rc.kv_events_replay) == (4, "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5600")
    assert target(pod(ip="fd00::7", annotations=notes), CONFIG).kv_events == "tcp://[fd00::7]:5557"
    for bad in ("0", "-1", "four", "4.0", "²", str(MAX_DATA_PARALLEL_SIZE + 1), "", "9" * 5000):
        with caplog.at_level(logging.WARNING):
            rc = target(pod(name=f"bad{bad}", annotations={DP_SIZE_ANNOTATION: bad}), CONFIG)
        assert rc.data_parallel_size == 1  # served as one replica, vLLM balancing its ranks
        assert DP_SIZE_ANNOTATION in caplog.text
        caplog.clear()
    rc = target(pod(annotations={KV_EVENTS_PORT_ANNOTATION: "70000", KV_EVENTS_REPLAY_PORT_ANNOTATION: "5600"}), CONFIG)
    assert rc.kv_events is None and rc.kv_events_replay is None  # found through /kv_event_sources then


def test_the_namespace_is_the_configured_one_else_the_kubeconfigs_else_default(monkeypatch, tmp_path):
    from prefix_router.fleet import kubernetes

    monkeypatch.setattr(kubernetes, "_NAMESPACE_FILE", tmp_path / "absent")
    assert namespace_of(KubernetesConfig(namespace="a"), "b") == "a"
    assert namespace_of(CONFIG, "b") == "b"  # a kubeconfig's context, even inside a pod
    assert namespace_of(CONFIG) == "default"
    (tmp_path / "namespace").write_text("llm\n")
    monkeypatch.setattr(kubernetes, "_NAMESPACE_FILE", tmp_path / "namespace")
    assert namespace_of(CONFIG) == "llm"  # in a pod, its service account's


@pytest.fixture
async def cluster(aiohttp_server, aiohttp_client, tmp_path):
    """``await cluster(n)``: (the fake API, the gateway's client, the pods' host:port): n simulated
    replicas (each of ``ranks`` data-parallel engines), one a loopback address each (127.0.0.2 ...)
    on one port, as pods share their container port."""

    async def start(n: int = 3, *, gone_as_http: bool = False, ranks: int = 1):
        port = free_port()
        ips = [f"127.0.0.{i + 2}" for i in range(n)]
        for ip in ips:
            sim = create_sim(SimConfig(model=MODEL, num_gpu_blocks=2000, max_model_len=8192, time_scale=1000.0,
                                       data_parallel_size=ranks), ByteTokenizer())
            await aiohttp_server(sim, host=ip, port=port)
        api = FakeKubeApi()
        api.gone_as_http = gone_as_http
        server = await aiohttp_server(api.app)
        config = config_from_dict({
            "discovery": {"kubernetes": {"label_selector": "app=vllm", "port": port, "resync_s": 2,
                                         "kubeconfig": kubeconfig(tmp_path / "kubeconfig", str(server.make_url("")))}},
            "health": {"interval_s": 30.0}, "scrape": {"interval_s": 30.0}, "kv_events": {"enabled": False}})
        api.put("vllm-0", ips[0])
        client = await aiohttp_client(create_app(config, ByteTokenizer()))
        return api, client, [f"{ip}:{port}" for ip in ips]

    return start


async def routable(client, name: str, within_s: float = 1.0) -> float:
    """Seconds until ``name`` is on the ring (fails past ``within_s``)."""
    gw, started = client.server.app[GATEWAY], time.monotonic()
    while time.monotonic() - started < within_s:
        replica = gw.replicas.get(name)
        if replica is not None and replica.routable:
            return time.monotonic() - started
        await asyncio.sleep(0.02)
    raise AssertionError(f"{name} not routable within {within_s} s")


async def gone(client, name: str, within_s: float = 1.0) -> None:
    gw, started = client.server.app[GATEWAY], time.monotonic()
    while time.monotonic() - started < within_s:
        replica = gw.replicas.get(name)
        if replica is None or not replica.routable:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{name} still routable after {within_s} s")


async def served_by(client, sessions: int = 40) -> set[str]:
    names = set()
    for i in range(sessions):
        resp = await client.post("/v1/chat/completions", headers={"X-Session-ID": f"s{i}"},
                                 json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status == 200, await resp.text()
        names.add(resp.headers[REPLICA_HEADER])
    return names


async def test_pods_join_when_ready_and_leave_when_unready_terminating_deleted_or_relabelled(cluster):
    api, client, names = await cluster(3)
    assert await served_by(client) == {names[0]}  # listed before serving
    api.put("vllm-1", names[1].split(":")[0])
    await routable(client, names[1])
    assert names[1] in await served_by(client)  # takes traffic within a second
    api.put("vllm-2", names[2].split(":")[0], ready=False)  # listed, not ready: no traffic
    await asyncio.sleep(0.3)
    assert names[2] not in client.server.app[GATEWAY].replicas
    api.put("vllm-2", names[2].split(":")[0])
    await routable(client, names[2])
    api.put("vllm-1", names[1].split(":")[0], ready=False)
    await gone(client, names[1])
    api.put("vllm-2", names[2].split(":")[0], deleting=True)  # terminating, still Ready
    await gone(client, names[2])
    assert await served_by(client) == {names[0]}
    api.put("vllm-1", names[1].split(":")[0])
    await routable(client, names[1])
    api.put("vllm-1", names[1].split(":")[0], labels={"app": "other"})  # out of the selector: DELETED
    await gone(client, names[1])
    api.delete("vllm-0")
    await gone(client, names[0])
    watches = [q for q in api.requests if q.get("watch")]
    assert watches and all(q.get("allowWatchBookmarks") and q.get("resourceVersion") for q in watches)


@pytest.mark.parametrize("gone_as_http", [False, True])
async def test_a_dropped_watch_and_a_410_lose_no_pod(cluster, gone_as_http):
    api, client, names = await cluster(3, gone_as_http=gone_as_http)
    api.put("vllm-1", names[1].split(":")[0])
    await routable(client, names[1])
    lists = sum(1 for q in api.requests if not q.get("watch"))
    api.drop_watches()  # a connection reset mid-stream
    await asyncio.sleep(0.2)
    api.put("vllm-2", names[2].split(":")[0])  # while the watch is being made again
    await routable(client, names[2])
    assert sum(1 for q in api.requests if not q.get("watch")) == lists  # resumed from where it was, no LIST
    api.expire()  # compaction: the watcher's resourceVersion is now too old
    api.drop_watches()
    lists = sum(1 for q in api.requests if not q.get("watch"))
    await asyncio.sleep(0.3)
    api.put("vllm-1", names[1].split(":")[0], ready=False)
    await gone(client, names[1], within_s=3.0)
    assert sum(1 for q in api.requests if not q.get("watch")) > lists  # listed again after the 410
    gw = client.server.app[GATEWAY]
    assert gw.replicas[names[0]].routable and gw.replicas[names[2]].routable  # nothing lost on the way


async def test_an_unreachable_api_keeps_the_pods_known(cluster):
    api, client, names = await cluster(2)
    api.put("vllm-1", names[1].split(":")[0])
    await routable(client, names[1])
    api.app.router._resources.clear()  # every call now 404s ... as an API server gone wrong
    api.drop_watches()
    await asyncio.sleep(2.5)  # past a resync
    assert await served_by(client) == set(names)


async def test_a_pod_annotated_with_data_parallel_ranks_is_a_replica_per_rank(cluster):
    api, client, names = await cluster(2, ranks=4)
    gw = client.server.app[GATEWAY]
    ip = names[1].split(":")[0]
    api.put("vllm-1", ip, annotations={DP_SIZE_ANNOTATION: "4"})
    ranks = [f"{names[1]}@{r}" for r in range(4)]
    for name in ranks:
        await routable(client, name)  # every rank on the ring within a second
    assert names[1] not in gw.replicas
    assert {n for n in await served_by(client, 80) if n.startswith(names[1])} == set(ranks)
    api.put("vllm-1", ip, annotations={DP_SIZE_ANNOTATION: "2"})  # restarted with fewer ranks
    for name in ranks[2:]:
        await gone(client, name)
    assert all(gw.replicas[n].routable for n in ranks[:2])
    api.put("vllm-1", ip)  # no annotation: one replica, vLLM balancing its ranks
    await routable(client, names[1])
    for name in ranks[:2]:
        await gone(client, name)
    api.delete("vllm-1")
    await gone(client, names[1])
