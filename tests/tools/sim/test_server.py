"""The simulated vLLM replica's HTTP API (``prefix_router/tools/sim/server.py``), driven in-process.

Its request checks, metrics and engine loop through the same API: ``test_requests.py``,
``test_metrics.py``, ``test_engine.py``."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.server import create_app
from prefix_router.prompts.tokenizer import ByteTokenizer

MODEL = "test-model"
CONFIG = SimConfig(model=MODEL, block_size=16, num_gpu_blocks=256, max_model_len=1024, time_scale=1000)
CHAT_MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


def prompt_ids(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def expected_hit(prompt_len: int, block_size: int) -> int:
    """Full prompt blocks, never covering the last prompt token (vLLM's cap)."""
    return (prompt_len - 1) // block_size * block_size


def sse_events(text: str) -> list[str]:
    """Payloads of an SSE body, checking the `data: ...\\n\\n` framing on the way."""
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


async def make_client(aiohttp_client, config: SimConfig = CONFIG):
    return await aiohttp_client(create_app(config, ByteTokenizer()))


@pytest.fixture
async def client(aiohttp_client):
    return await make_client(aiohttp_client)


async def complete(client, **body):
    resp = await client.post("/v1/completions", json={"model": MODEL, **body})
    return resp.status, await resp.json()


async def metric_samples(client) -> dict[str, list]:
    resp = await client.get("/metrics")
    assert resp.status == 200
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(await resp.text()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


# -- completions -------------------------------------------------------------------------

async def test_a_token_id_completion_returns_a_text_completion_with_usage(client):
    prompt = prompt_ids(50)
    status, body = await complete(client, prompt=prompt, max_tokens=7)
    assert status == 200
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    choice = body["choices"][0]
    assert isinstance(choice["text"], str) and len(choice["text"].split()) == 7
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] == 7
    assert usage["total_tokens"] == len(prompt) + 7
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("length", [50, 64, 17])
async def test_a_repeated_prompt_hits_its_full_blocks_except_the_last_token(client, length):
    prompt = prompt_ids(length, start=5000 + length)
    await complete(client, prompt=prompt, max_tokens=3)
    status, body = await complete(client, prompt=prompt, max_tokens=3)
    assert status == 200
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_hit(length, CONFIG.block_size)


async def test_cache_salt_separates_tenants_and_matching_salts_share(client):
    prompt = prompt_ids(80)
    await complete(client, prompt=prompt, max_tokens=2, cache_salt="tenant-a")
    _, other = await complete(client, prompt=prompt, max_tokens=2, cache_salt="tenant-b")
    _, unsalted = await complete(client, prompt=prompt, max_tokens=2)
    _, same = await complete(client, prompt=prompt, max_tokens=2, cache_salt="tenant-a")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert unsalted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_hit(80, CONFIG.block_size)


async def test_an_empty_cache_salt_is_a_400_with_an_openai_error_body(client):
    status, body = await complete(client, prompt=prompt_ids(20), max_tokens=2, cache_salt="")
    assert status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == "cache_salt"
    assert body["error"]["code"] == 400


# -- streaming ---------------------------------------------------------------------------

async def test_a_streamed_completion_is_framed_as_sse_and_ends_with_done(client):
    resp = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": "hello there", "max_tokens": 12, "stream": True,
        "stream_options": {"include_usage": True}})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 12
    assert usage_chunk["usage"]["prompt_tokens"] == len(ByteTokenizer().encode("hello there"))
    text_chunks = chunks[:-1]
    assert all(c["object"] == "text_completion" for c in text_chunks)
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    text = "".join(c["choices"][0]["text"] for c in text_chunks)
    assert len(text.split()) == 12


async def test_a_streamed_chat_starts_with_the_assistant_role_and_counts_max_tokens(client):
    resp = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 9, "stream": True,
        "stream_options": {"include_usage": True}})
    assert resp.status == 200
    events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 9
    assert usage_chunk["usage"]["prompt_tokens"] == len(ByteTokenizer().render_chat(CHAT_MESSAGES))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert len(text.split()) == 9


async def test_a_streamed_chat_sends_its_role_chunk_with_the_first_token_after_the_prefill(aiohttp_client):
    # vLLM yields the role chunk on the engine's first output (``first_iteration`` in
    # OpenAIServingChat.chat_completion_stream_generator); vllm bench serve times a chat's first
    # token at that chunk. In real time (time_scale 1) a 1,000-token prefill takes
    # 1,000 / prefill_tokens_per_s of modelled time; the first chunk may not come before it.
    config = SimConfig(model=MODEL, block_size=16, num_gpu_blocks=256, max_model_len=2048, time_scale=1)
    client = await make_client(aiohttp_client, config)
    messages = [{"role": "user", "content": "x" * 1000}]
    started = asyncio.get_running_loop().time()
    resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 50,
                                                           "stream": True})
    assert resp.status == 200
    first = await resp.content.readuntil(b"\n\n")
    waited = asyncio.get_running_loop().time() - started
    prefill_s = config.step_seconds(len(ByteTokenizer().render_chat(messages)), 0)
    assert json.loads(first[len(b"data: "):])["choices"][0]["delta"]["role"] == "assistant"
    assert waited >= prefill_s, (waited, prefill_s)
    second = json.loads((await resp.content.readuntil(b"\n\n"))[len(b"data: "):])
    assert second["choices"][0]["delta"]["content"], "the first token comes with the role chunk"
    # ... and tells its own time to it, which a benchmark scales apart from the routers' time
    assert prefill_s <= second["sim_ttft_s"] <= waited, (prefill_s, second["sim_ttft_s"], waited)
    # ... and its modelled time to it: the one prefill step, whatever the machine's load
    assert second["sim_modelled_ttft_s"] == pytest.approx(prefill_s, abs=1e-6)
    third = json.loads((await resp.content.readuntil(b"\n\n"))[len(b"data: "):])
    assert third["choices"][0]["delta"]["content"] and "sim_ttft_s" not in third
    assert "sim_modelled_ttft_s" not in third
    resp.close()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "no usage please"}),
    ("/v1/chat/completions", {"messages": CHAT_MESSAGES}),
])
@pytest.mark.parametrize("options", [None, {"include_usage": False}])
async def test_a_stream_has_no_usage_chunk_unless_include_usage_is_true(client, path, body, options):
    request = {"model": MODEL, "max_tokens": 4, "stream": True, **body}
    if options is not None:
        request["stream_options"] = options
    resp = await client.post(path, json=request)
    assert resp.status == 200
    events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" not in c and c["choices"] for c in chunks)


async def test_a_non_streamed_chat_returns_an_assistant_message(client):
    resp = await client.post("/v1/chat/completions",
                             json={"model": MODEL, "messages": CHAT_MESSAGES, "max_completion_tokens": 5})
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert len(body["choices"][0]["message"]["content"].split()) == 5
    assert body["usage"]["completion_tokens"] == 5


# -- other endpoints ---------------------------------------------------------------------


async def test_models_lists_the_configured_model(client):
    resp = await client.get("/v1/models")
    assert resp.status == 200
    body = await resp.json()
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["max_model_len"] == CONFIG.max_model_len


async def test_health_is_200(client):
    assert (await client.get("/health")).status == 200


async def test_tokenize_counts_prompt_and_chat_tokens(client):
    tokenizer = ByteTokenizer()
    resp = await client.post("/tokenize", json={"model": MODEL, "prompt": "count these bytes"})
    body = await resp.json()
    assert body["count"] == len(body["tokens"]) == len(tokenizer.encode("count these bytes"))
    resp = await client.post("/tokenize", json={"model": MODEL, "messages": CHAT_MESSAGES})
    body = await resp.json()
    assert body["count"] == len(body["tokens"])
    assert body["tokens"] == tokenizer.render_chat(CHAT_MESSAGES)


# -- n sequences, Responses ------------------------------------------------------------------

async def test_n_sequences_are_n_choices_and_usage_counts_the_prompt_once(client):
    status, body = await complete(client, prompt=prompt_ids(40), max_tokens=3, n=3)
    assert status == 200
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == 40 and body["usage"]["completion_tokens"] == 9


async def test_a_streamed_chat_of_n_sequences_sends_each_its_role_and_finish(client):
    resp = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4, "n": 2, "stream": True,
        "stream_options": {"include_usage": True}})
    events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 8


async def test_a_response_is_stored_and_continued_by_its_id(client):
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": "Say hi. " * 10, "max_output_tokens": 3})
    first = await resp.json()
    assert resp.status == 200 and first["object"] == "response" and first["status"] == "completed"
    assert first["usage"]["output_tokens"] == 3 and first["output"][0]["content"][0]["type"] == "output_text"
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": "Again.", "max_output_tokens": 2,
                                                   "previous_response_id": first["id"]})
    second = await resp.json()
    assert resp.status == 200
    # the continuation's prompt is the first's, its output and the new input: it hits the first's blocks
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_no"})
    assert resp.status == 404 and (await resp.json())["error"]["param"] == "previous_response_id"


async def test_a_streamed_response_sends_deltas_then_completed_with_usage(client):
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": "Say hi.", "max_output_tokens": 4,
                                                   "stream": True})
    text = await resp.text()
    kinds = [line[len("event: "):] for line in text.split("\n") if line.startswith("event: ")]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    last = json.loads(text.rstrip().split("\n")[-1][len("data: "):])
    assert last["response"]["usage"]["output_tokens"] == 4
    deltas = [json.loads(line[6:])["delta"] for line in text.split("\n")
              if line.startswith("data: ") and '"response.output_text.delta"' in line]
    assert "".join(deltas) == last["response"]["output"][0]["content"][0]["text"]
