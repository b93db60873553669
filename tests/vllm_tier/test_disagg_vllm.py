"""Prefill/decode disaggregation on the real engine: two vLLM CPU replicas, one a NixlConnector
producer (prefill) and one a consumer (decode), the KV cache moving between them through NIXL
with a CPU buffer (``"kv_buffer_device": "cpu"``; NIXL from ``make_env.sh``), the gateway in
front splitting each request into its two legs (``prefix_router/serve/disagg.py``).

What it shows: every API the gateway splits is served through both legs (the request log's
``transfer`` is ``pulled``, and the decode replica's ``vllm:external_prefix_cache_hits_total``
counts the tokens it took from its connector); a repeated prompt hits the prefill replica's
cache, and the client's ``cached_tokens`` is that hit (vLLM 0.32's decode reports its prefill's
``remote_prefill_cached_tokens``); the decode leg's greedy output is the output of the same
request served whole by one replica.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from prefix_router.app import create_app
from prefix_router.config import config_from_dict
from prefix_router.metrics import sample_sum
from prefix_router.prompts.tokenizer import HFTokenizer
from prefix_router.tools import launch

from .harness import get, post_json, require_vllm, tiny_model, vllm_spec

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32


def _nixl_spec(log_dir, role: str):
    spec = vllm_spec(log_dir, block_size=BLOCK_SIZE, num_blocks=256, max_model_len=2048, extra=[
        "--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                            "kv_buffer_device": "cpu"})])
    # the side channel where a decode replica asks a prefill replica for its blocks: one port each
    spec.env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(launch.free_port()))
    return spec


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    python = require_vllm()
    if subprocess.run([str(python), "-c", "import nixl"], capture_output=True).returncode:
        pytest.skip("NIXL is not installed in the vLLM environment: rerun tests/vllm_tier/make_env.sh")
    log_dir = tmp_path_factory.mktemp("vllm-disagg")
    with launch.running([_nixl_spec(log_dir, "kv_producer"), _nixl_spec(log_dir, "kv_consumer")]) as urls:
        yield urls


async def test_a_real_prefill_and_decode_pair_serves_every_api_through_the_gateway(pair, aiohttp_client, tmp_path):
    prefill, decode = pair
    log = tmp_path / "requests.jsonl"
    # CPU replicas computing prompts on two cores can take seconds to answer /health (a GPU replica
    # answers at once): patient health checks keep this test about the two legs, as test_gateway_vllm.py
    config = config_from_dict({"replicas": [{"url": prefill, "role": "prefill"}, {"url": decode, "role": "decode"}],
                               "tokenizer": str(tiny_model()), "request_log": str(log),
                               "health": {"timeout_s": 10.0, "unhealthy_after": 3}})
    client = await aiohttp_client(create_app(config, HFTokenizer(str(tiny_model()))))
    document = " ".join(f"line {i} of the shared document." for i in range(60))
    chat = {"model": "tiny", "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "user", "content": document + " Summarise it."}]}
    answers = []
    for _ in range(2):  # the second: the prefill replica holds the prompt
        resp = await client.post("/v1/chat/completions", json=chat)
        assert resp.status == 200, await resp.text()
        answers.append(await resp.json())
    resp = await client.post("/v1/chat/completions", json={**chat, "stream": True})
    text = await resp.text()
    assert resp.status == 200 and text.rstrip().endswith("data: [DONE]")
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": document, "max_tokens": 4,
                                                     "temperature": 0})
    assert resp.status == 200, await resp.text()
    resp = await client.post("/v1/responses", json={"model": "tiny", "input": document, "max_output_tokens": 4,
                                                   "temperature": 0})
    assert resp.status == 200, await resp.text()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["transfer"] for line in lines] == ["pulled"] * 5, lines
    assert lines[1]["cached_tokens"] >= len(document) // 8  # the prefill replica's hit on the repeat
    # the client sees the prefill replica's hit, the one the gateway accounts
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == lines[1]["cached_tokens"]
    # the decode replica took the first prompt (its cache empty) from its connector, not by computing
    # it: every full block but the last token's (later prompts it partly held already)
    external = sample_sum(get(decode + "/metrics").decode(), "vllm:external_prefix_cache_hits_total")
    assert external >= (lines[0]["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE, external
    # greedy decoding from the pulled KV gives what one replica computing it all gives
    whole = post_json(decode + "/v1/chat/completions", chat)
    assert whole["choices"][0]["message"]["content"] == answers[0]["choices"][0]["message"]["content"]
