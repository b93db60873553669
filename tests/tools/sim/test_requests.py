"""The simulated replica's request checks (``prefix_router/tools/sim/requests.py``), through its
HTTP API: each bad field a 400 (or 404) naming it in an OpenAI error body, and junk never a 5xx."""

from __future__ import annotations

import asyncio
import json

import pytest

from prefix_router.tools.sim.config import SimConfig

from .test_server import CHAT_MESSAGES, CONFIG, MODEL, client, complete, make_client, prompt_ids  # noqa: F401 (a fixture)


def assert_error(status: int, body: dict, expected_status: int) -> None:
    assert status == expected_status
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == expected_status


async def test_malformed_json_is_a_400(client):
    resp = await client.post("/v1/completions", data=b'{"prompt": "x",',
                             headers={"Content-Type": "application/json"})
    assert_error(resp.status, await resp.json(), 400)


@pytest.mark.parametrize("field, value", [("max_tokens", "x"), ("stream", "yes"), ("max_tokens", True),
                                          ("max_tokens", 0), ("stream_options", [])])
async def test_a_field_of_the_wrong_type_is_a_400_naming_it(client, field, value):
    status, body = await complete(client, prompt="hi", **{field: value})
    assert_error(status, body, 400)
    assert body["error"]["param"] == field


async def test_an_unknown_model_is_a_404_not_found(client):
    resp = await client.post("/v1/completions", json={"model": "other-model", "prompt": "hi"})
    body = await resp.json()
    assert_error(resp.status, body, 404)
    assert body["error"]["type"] == "NotFoundError"


async def test_an_empty_message_list_is_a_400(client):
    resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert_error(resp.status, await resp.json(), 400)


async def test_a_prompt_longer_than_max_model_len_is_a_400_about_the_context_length(client):
    status, body = await complete(client, prompt=prompt_ids(CONFIG.max_model_len + 1), max_tokens=1)
    assert_error(status, body, 400)
    assert "maximum context length" in body["error"]["message"]


async def test_a_prompt_of_exactly_max_model_len_is_refused_instead_of_hanging(aiohttp_client):
    # Chunked prefill (prompt > max_num_batched_tokens) used to stop one token short forever.
    config = SimConfig(model=MODEL, block_size=4, num_gpu_blocks=64, max_model_len=128,
                       max_num_batched_tokens=32, time_scale=1000)
    client = await make_client(aiohttp_client, config)
    status, body = await asyncio.wait_for(complete(client, prompt=prompt_ids(128), max_tokens=1), 5)
    assert_error(status, body, 400)
    status, body = await asyncio.wait_for(complete(client, prompt=prompt_ids(127), max_tokens=5), 5)
    assert status == 200
    assert body["usage"]["completion_tokens"] == 1  # stopped at max_model_len


async def test_max_tokens_above_max_model_len_is_a_400(client):
    status, body = await complete(client, prompt="hi", max_tokens=CONFIG.max_model_len + 1)
    assert_error(status, body, 400)
    assert body["error"]["param"] == "max_tokens"


async def test_no_choice_at_all_is_a_400(client):
    status, body = await complete(client, prompt="hi", n=0)
    assert_error(status, body, 400)
    assert body["error"]["param"] == "n"


JUNK_BODIES = [
    b"[]", b"[1, 2]", b"42", b"null", b'"text"', b"true", b"", b"\xff\xfe", b"{",
    b"[" * 50_000 + b"]" * 50_000,  # nested deeper than json.loads can recurse
    json.dumps({"prompt": [[1, 2], [3]]}).encode(),
    json.dumps({"prompt": {"a": [None, {"b": []}]}}).encode(),
    json.dumps({"prompt": [-1, 2]}).encode(),
    json.dumps({"prompt": [2**70]}).encode(),
    json.dumps({"prompt": [1.5]}).encode(),
    json.dumps({"messages": [None]}).encode(),
    json.dumps({"messages": [{"role": 7}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": {"nested": [1]}}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": [{"type": "image"}]}]}).encode(),
    json.dumps({"messages": [{"role": "system", "content": [{"type": []}]}]}).encode(),  # found by test_fuzz
    json.dumps({"messages": [{"role": "assistant", "content": None,
                              "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}]}).encode(),
    json.dumps({"messages": [{"role": "assistant", "tool_calls": [1, "x"]}]}).encode(),
    json.dumps({"messages": CHAT_MESSAGES, "tools": [{"function": None}]}).encode(),
    json.dumps({"messages": CHAT_MESSAGES, "tools": "all"}).encode(),
    json.dumps({"prompt": "x", "model": ["m"]}).encode(),
    json.dumps({"prompt": "x", "stream_options": {"include_usage": "yes"}, "stream": True}).encode(),
    json.dumps({"prompt": "x", "cache_salt": 5}).encode(),
    json.dumps({"prompt": "x", "chat_template_kwargs": 3, "messages": 3}).encode(),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
async def test_junk_bodies_never_get_a_server_error(client, path):
    for raw in JUNK_BODIES:
        resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        assert resp.status < 500, (path, raw[:80], await resp.text())
        if resp.status >= 400:
            assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}
