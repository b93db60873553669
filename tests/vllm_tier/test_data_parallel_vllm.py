"""A real vLLM server with two data-parallel ranks (``--data-parallel-size 2``, CPU build): two
engines, each its own prefix cache and KV-event publisher (ports offset by rank), behind one
HTTP port. With ``replicas[].data_parallel_size: 2`` the gateway makes each rank a replica,
follows each rank's events (``GET /kv_event_sources``), and sends each request with vLLM's
``X-data-parallel-rank`` header: every conversation stays on one rank, every prediction is that
rank's engine's, and each engine's own prompt-token counter shows the requests it was named for.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request

import pytest

from prefix_router.tools import launch

from .harness import get, tiny_model, vllm_spec

pytestmark = pytest.mark.vllm

RANKS = 2
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("vllm-dp")
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{launch.free_port_run(RANKS)}",
              "replay_endpoint": f"tcp://*:{launch.free_port_run(RANKS)}"}
    spec = vllm_spec(log_dir, block_size=32, num_blocks=512, max_model_len=2048,
                     extra=["--data-parallel-size", str(RANKS), "--kv-events-config", json.dumps(events)])
    with launch.running([spec]) as (url,):
        yield url


def _chat(url: str, messages: list[dict]) -> tuple[str, dict]:
    body = json.dumps({"model": "tiny", "max_tokens": 4, "messages": messages}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return resp.headers["x-prefix-router-replica"], json.load(resp)["usage"]


def _engine_prompt_tokens(url: str) -> dict[str, float]:
    """Each engine's ``vllm:prompt_tokens_total`` (label ``engine``, its rank) from the server's /metrics."""
    out: dict[str, float] = {}
    for line in get(url + "/metrics").decode().splitlines():
        if line.startswith("vllm:prompt_tokens_total{"):
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            out[engine] = out.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_each_rank_is_a_replica_with_its_own_cache_events_and_requests(server, tmp_path):
    assert set(_engine_prompt_tokens(server)) == {str(rank) for rank in range(RANKS)}  # two engines
    log = tmp_path / "requests.jsonl"
    config = tmp_path / "gateway.yaml"
    config.write_text(f"scrape: {{interval_s: 0.5}}\nsummary_interval_s: 0\nreplicas:\n"
                      f"  - {{url: {server}, data_parallel_size: {RANKS}}}\n")
    spec = launch.gateway_server(tmp_path, [], ["--config", str(config), "--tokenizer", str(tiny_model()),
                                                "--request-log", str(log)])
    with launch.running([spec]) as (url,):
        deadline = time.monotonic() + 60
        while True:
            view = json.loads(get(url + "/replicas"))["replicas"]
            if len(view) == RANKS and all((r["kv_events"] or {}).get("routing_by_events") for r in view):
                break
            assert time.monotonic() < deadline, view
            time.sleep(0.25)
        before = _engine_prompt_tokens(server)
        rng, homes, sent = random.Random(0), {}, {}
        for conversation in range(6):
            messages = [{"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(200))}]
            for _ in range(3):
                messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(20))})
                replica, usage = _chat(url, messages)
                messages.append({"role": "assistant", "content": "noted"})
                homes.setdefault(conversation, set()).add(replica)
                sent[replica] = sent.get(replica, 0) + usage["prompt_tokens"]
        after = _engine_prompt_tokens(server)
        deadline = time.monotonic() + 15  # a line waits for the events that explain a shortfall
        while len(log.read_text().splitlines()) < 18 and time.monotonic() < deadline:
            time.sleep(0.2)
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        view = {r["name"]: r for r in json.loads(get(url + "/replicas"))["replicas"]}
    host = server.removeprefix("http://")
    assert set(view) == {f"{host}@{rank}" for rank in range(RANKS)}
    assert all(len(names) == 1 for names in homes.values()), homes  # a conversation keeps its rank
    # the rank the gateway named ran the request: each engine counted the prompts sent to it
    for rank in range(RANKS):
        name = f"{host}@{rank}"
        assert after.get(str(rank), 0.0) - before.get(str(rank), 0.0) == sent.get(name, 0), (rank, sent)
    # each rank's own events predict its own engine's cache, every request
    assert len(lines) == 18 and sum(line["cached_tokens"] for line in lines) > 0
    assert [line["predicted_cached_tokens"] for line in lines] == [line["cached_tokens"] for line in lines]
    for name in view:
        assert view[name]["kv_events"]["parity_mismatches"] == 0
