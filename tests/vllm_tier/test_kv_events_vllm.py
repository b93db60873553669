"""The gateway routing by real vLLM replicas' KV events (``--kv-events-config``).

Two vLLM CPU replicas serve the tiny model with 32-token blocks and a KV cache small enough to
evict (as ``test_gateway_vllm.py``), each publishing its events on a ZMQ PUB socket with a
replay socket; the gateway finds them through ``GET /kv_event_sources``. The agent replay's
every predicted cached token count must then be the engine's (less what the events showed
evicted while the request waited), and a gateway cutting prompts
differently from the engine (another tokenizer, another block size) must say so.
"""

from __future__ import annotations

import json
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from prefix_router.tools import launch
from prefix_router.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from prefix_router.metrics import sample_sum

from .harness import get, post_json, require_vllm, tiny_model, vllm_spec
from .test_gateway_vllm import (BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, _expected_cached, _read_log, _replay, _reset,
                                _unexplained, _workload)

pytestmark = pytest.mark.vllm


def test_the_gateway_decodes_what_vllms_own_publisher_encodes():
    python = require_vllm()
    script = """
import sys, msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
batch = KVEventBatch(ts=3.5, data_parallel_rank=0, events=[
    BlockStored(block_hashes=[b"\\x01" * 32, 7], parent_block_hash=None, token_ids=list(range(64)), block_size=32,
                lora_id=None, medium="GPU", lora_name=None, extra_keys=[("salt-a",), None], group_idx=0),
    BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0), AllBlocksCleared()])
sys.stdout.buffer.write(msgspec.msgpack.Encoder().encode(batch))
"""
    payload = subprocess.run([str(python), "-c", script], check=True, capture_output=True, timeout=120).stdout
    batch = decode_batch(payload)
    stored, removed, cleared = batch.events
    assert batch.ts == 3.5 and batch.data_parallel_rank == 0
    assert stored == BlockStored([b"\x01" * 32, 7], None, list(range(64)), 32, None, "GPU", "salt-a", 0)
    assert removed == BlockRemoved([7], "GPU", 0) and isinstance(cleared, AllBlocksCleared)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("vllm-events")
    specs = []
    for _ in range(2):
        pub, replay = launch.free_port(), launch.free_port()
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                  "replay_endpoint": f"tcp://*:{replay}"}
        spec = vllm_spec(log_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
                         extra=["--kv-events-config", json.dumps(events)])
        spec.env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache between tests
        specs.append(spec)
    with launch.running(specs) as urls:
        yield urls


@contextmanager
def _gateway(urls, tmp_path: Path, tokenizer: Path, block_size: int | None = None):
    """A fresh gateway on emptied replicas, their events found through /kv_event_sources;
    ``block_size`` overrides the replicas' own. Yields (base URL, request log path)."""
    _reset(urls)
    log = tmp_path / "requests.jsonl"
    config = tmp_path / "gateway.yaml"
    replicas = "".join(f"  - {{url: {u}, block_size: {block_size or 'null'}}}\n" for u in urls)
    config.write_text("health: {timeout_s: 10.0, unhealthy_after: 3}\nscrape: {interval_s: 0.5}\n"
                      f"replicas:\n{replicas}")
    spec = launch.gateway_server(tmp_path, [], ["--config", str(config), "--tokenizer", str(tokenizer),
                                                "--request-log", str(log)])
    with launch.running([spec]) as (url,):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the streams start once each replica's models are known
            view = json.loads(get(url + "/replicas"))["replicas"]
            if all(r["kv_events"] is not None and r["kv_events"]["routing_by_events"] for r in view):
                break
            time.sleep(0.2)
        assert all(r["kv_events"] is not None and r["kv_events"]["routing_by_events"] for r in view), view
        yield url, log


def _logged(tmp_path: Path) -> str:
    return "".join(p.read_text() for p in tmp_path.glob("gateway-*.log"))


def _metrics(url: str) -> str:
    return get(url + "/metrics").decode()


def _metrics_once(url: str, done, timeout_s: float = 15.0) -> str:
    """The gateway's /metrics once ``done(page)``, or after ``timeout_s`` (parity checks wait
    ``parity_grace_s`` after each request, and may ask the replay socket first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        page = _metrics(url)
        if done(page) or time.monotonic() > deadline:
            return page
        time.sleep(0.25)


def test_with_events_every_prediction_is_the_engines_under_eviction(engines, tmp_path):
    requests, kind = _workload()
    with _gateway(engines, tmp_path, tiny_model()) as (url, log):
        _replay(url, requests)
        checked = lambda p: sum(sample_sum(p, "prefix_router_kv_parity_total", result=r)  # noqa: E731
                                for r in ("match", "mismatch")) >= len(requests)
        page = _metrics_once(url, checked)  # the last requests' parity checks may wait parity_grace_s
        view = json.loads(get(url + "/replicas"))["replicas"]
    lines = _read_log(log)
    # a request queued behind another may find part of its prefix evicted to make room for that
    # one's blocks (a slow machine, a small cache): the events say which, and it must be all
    wrong = [d for d in lines if _expected_cached(d) != d["cached_tokens"]]
    differ = _unexplained(wrong)  # ... and two requests of one prefix may reach the engine swapped
    evicted = sum(1 for d in lines if d["evicted_in_flight_tokens"])
    events = sample_sum(page, "prefix_router_kv_events_total")
    print(f"\n{kind}: {len(lines)} requests; predictions exact {len(lines) - len(wrong)}/{len(lines)} "
          f"({evicted} with blocks evicted in flight, {(len(wrong) - len(differ)) // 2} pairs swapped at the engine); "
          f"events {events:.0f}; "
          f"parity {[(r['kv_events']['parity_matches'], r['kv_events']['parity_mismatches']) for r in view]}")
    assert len(lines) == len(requests) and not differ, differ
    assert sample_sum(page, "prefix_router_kv_parity_total", result="mismatch") == 0
    assert sample_sum(page, "prefix_router_kv_parity_total", result="match") == len(lines)
    assert all(r["kv_events"]["routing_by_events"] and r["kv_events"]["gaps_lost"] == 0 for r in view)




def test_a_gateway_with_another_tokenizer_raises_the_parity_alarm_and_says_why(engines, tmp_path):
    # a tokenizer trained on other text, in which this test's prompt words are whole tokens: it
    # cuts the prompts differently from the served model's, with or without ../shared
    corpus = tmp_path / "other-corpus"
    corpus.mkdir()
    (corpus / "other.traj").write_text(json.dumps({"history": [
        {"role": "user", "content": "question words of a prompt " * 400}]}))
    wrong = launch.build_tiny_model(tmp_path / "tiny-tokenizer-other", require_vllm(), corpus=corpus,
                                    tokenizer_only=True)
    with _gateway(engines, tmp_path, wrong) as (url, log):
        for i in range(4):
            body = {"model": "tiny", "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"question {i}: " + "words of a prompt " * 30}]}
            post_json(url + "/v1/chat/completions", body)
        page = _metrics_once(url, lambda p: sample_sum(p, "prefix_router_kv_parity_total", result="mismatch") >= 3)
        view = json.loads(get(url + "/replicas"))["replicas"]
    assert sample_sum(page, "prefix_router_kv_parity_total", result="mismatch") >= 3
    hints = [r["kv_events"]["parity_hint"] for r in view if r["kv_events"]["parity_mismatches"]]
    assert hints and all("tokenizer" in h for h in hints), hints
    assert "picture of its cache is wrong" in _logged(tmp_path)


def test_a_gateway_with_another_block_size_names_the_block_size(engines, tmp_path):
    with _gateway(engines, tmp_path, tiny_model(), block_size=16) as (url, _):
        for i in range(3):
            post_json(url + "/v1/completions", {"model": "tiny", "max_tokens": 2, "prompt": f"{i} " + "a b c d " * 40})
        page = _metrics_once(url, lambda p: sample_sum(p, "prefix_router_kv_parity_total", result="mismatch") >= 3)
        view = json.loads(get(url + "/replicas"))["replicas"]
    assert sample_sum(page, "prefix_router_kv_parity_total", result="mismatch") == 3
    hints = [r["kv_events"]["parity_hint"] for r in view if r["kv_events"]["parity_mismatches"]]
    assert hints and all("block size" in h for h in hints), hints
    assert "picture of its cache is wrong" in _logged(tmp_path)
