"""The Responses and Anthropic Messages APIs routed by prefix, and LoRA adapters, against two real
vLLM replicas.

- The token ids the gateway computes for a Responses or Messages request are the ones vLLM
  renders for it (``/v1/responses/render`` and ``/v1/messages/render``, served with
  ``--enable-scale-out``), for every kind of input item and content block the mapping handles.
- Multi-turn conversations over both APIs reuse their history on the engine, a Responses chain
  reaches the replica holding each previous response, and a timestamp planted in the
  instructions or the system prompt is named ``volatile_value`` at message 0.
- A LoRA adapter loaded at run time on one replica is found at once, routed to that replica
  only, listed in the gateway's ``/v1/models``, and keeps a cache of its own (its name seeds the
  blocks, as vLLM's extra keys do); once unloaded, the gateway answers 404 for it.

The replicas store responses (``VLLM_ENABLE_RESPONSES_API_STORE=1``), as ``previous_response_id``
needs, load adapters at run time (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), and
have their prefix caches emptied between tests (``VLLM_SERVER_DEV_MODE=1``).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from prefix_router.constants import REPLICA_HEADER
from prefix_router.prompts.anthropic import messages_prompt
from prefix_router.prompts.responses import responses_prompt
from prefix_router.prompts.analysis import chat_tokens
from prefix_router.prompts.tokenizer import HFTokenizer
from prefix_router.tools import launch

from .harness import get, require_vllm, tiny_model, vllm_spec

pytestmark = pytest.mark.vllm

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
RESPONSES = [  # bodies of every input shape responses_prompt maps
    {"input": "hello there"},
    {"input": "hello there", "instructions": "Be brief."},
    {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"},
                                                              {"type": "input_text", "text": "again"}]}],
     "instructions": "x"},
    {"input": [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
               {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]},
    {"input": [{"role": "user", "content": "q"},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ans"}]},
               {"role": "user", "content": "q2"}]},
    {"input": [{"role": "user", "content": "weather?"},
               {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny"}], "tools": TOOLS},
    {"input": [{"role": "user", "content": "q"},
               {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think"}], "summary": []},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ans"}]},
               {"role": "user", "content": "q2"}]},
    {"input": [{"role": "user", "content": "q"},
               {"type": "message", "role": "assistant", "status": "incomplete",
                "content": [{"type": "output_text", "text": "partial answer"}]}]},
    {"input": "x", "tools": [*TOOLS, {"type": "custom", "name": "run", "description": "Run code"}]},
    {"input": "x", "tools": [{"type": "namespace", "name": "ns", "description": "d", "tools": [
        {"type": "function", "name": "f", "description": "fd", "parameters": {"type": "object", "properties": {}}}]}]},
    {"input": "hi", "cache_salt": "abc"},
]
MESSAGES = [  # and of every block messages_prompt maps
    {"messages": [{"role": "user", "content": "hello"}]},
    {"system": "Be brief.", "messages": [{"role": "user", "content": "hello"}]},
    {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0; cch=1a2b3"},
                {"type": "text", "text": "You are Claude."}, {"type": "text", "text": " More."}],
     "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
    {"messages": [{"role": "user", "content": "w?"},
                  {"role": "assistant", "content": [{"type": "text", "text": "let me"}, {
                      "type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris", "ü": 1}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                               {"type": "text", "text": "thanks"}]}],
     "tools": [{"name": "get_weather", "description": "W", "defer_loading": False,
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
     "tool_choice": {"type": "none"}},  # "auto" needs a tool-call parser the tiny model has none of
    {"messages": [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                                    {"type": "text", "text": "ans"}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                      {"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]}]}]},
    {"system": "S", "messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "reminder"},
                                 {"role": "user", "content": "q2"}]},
    {"messages": [{"role": "user", "content": "q"}], "cache_salt": "s1"},
]
INSTRUCTIONS = " ".join(["You are a careful coding agent working in a repository; keep answers short."] * 12)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("dialects")
    lora = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    specs = [vllm_spec(log_dir, max_model_len=4096, num_blocks=400, extra=["--enable-scale-out", *lora])
             for _ in range(2)]
    for spec in specs:
        spec.env.update(VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_RESPONSES_API_STORE="1",
                        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    with launch.running(specs) as urls:
        yield urls


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[dict, dict]:
    """(the answer, its headers); a stream's answer is its last usage-bearing event's object."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=300) as resp:
        data, headers = resp.read(), dict(resp.headers)
    if not body.get("stream"):
        return json.loads(data), headers
    events = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: {")]
    completed = [e["response"] for e in events if e.get("type") == "response.completed"]
    return (completed[0] if completed else {"usage": events[-2].get("usage")}), headers


@contextmanager
def _gateway(urls: list[str], tmp_path: Path):
    """A fresh gateway on emptied replicas; yields (base URL, its request log's lines)."""
    for url in urls:
        urllib.request.urlopen(urllib.request.Request(url + "/reset_prefix_cache", method="POST"), timeout=60)
    log = tmp_path / "requests.jsonl"
    config = tmp_path / "gateway.yaml"
    # the model lists read every second (10 s by default), so an unloaded adapter is seen gone soon
    config.write_text("health: {timeout_s: 10.0, unhealthy_after: 3}\nscrape: {models_interval_s: 1.0}\n")
    spec = launch.gateway_server(tmp_path, urls, ["--config", str(config), "--tokenizer", str(tiny_model()),
                                                  "--request-log", str(log)])
    lines: list[dict] = []
    with launch.running([spec]) as (url,):
        yield url, lines
    lines += [json.loads(line) for line in log.read_text().splitlines()]


def test_the_gateway_renders_responses_and_messages_as_vllm_does(engines):
    tokenizer = HFTokenizer(str(tiny_model()))
    differ = []
    for path, bodies, prompt in (("/v1/responses/render", RESPONSES, responses_prompt),
                                 ("/v1/messages/render", MESSAGES, messages_prompt)):
        for i, body in enumerate(bodies):
            body = {"model": "tiny", "max_tokens": 4, **body} if "messages" in path else {"model": "tiny", **body}
            engine, _ = _post(engines[0] + path, body)
            if chat_tokens(prompt(body), tokenizer) != engine["token_ids"]:
                differ.append((path, i))
    print(f"render parity: {len(RESPONSES)} Responses and {len(MESSAGES)} Messages bodies, {len(differ)} differ")
    assert not differ, differ


def _stamp(turn: int) -> str:
    return f"Current time: 2026-12-02T10:0{turn}:00Z. "


def _words(turn: int) -> str:
    words = "the replica keeps the prefix of this conversation in its cache while the agent works".split()
    return " ".join(words[(turn + k) % len(words)] for k in range(60))


def test_responses_chained_by_previous_response_id_reuse_history_on_the_replica_holding_it(engines, tmp_path):
    with _gateway(engines, tmp_path) as (url, lines):
        homes, previous = [], None
        for turn in range(4):
            body = {"model": "tiny", "instructions": INSTRUCTIONS, "input": _words(turn), "max_output_tokens": 4,
                    "temperature": 0, "stream": turn % 2 == 1}
            if previous is not None:
                body["previous_response_id"] = previous
            answer, headers = _post(url + "/v1/responses", body)
            previous = answer["id"]
            homes.append(headers[REPLICA_HEADER])
        # a response the gateway never saw, made straight on the other replica: its chain is found there
        other = next(u for u in engines if not u.endswith(homes[0]))
        answer, _ = _post(other + "/v1/responses", {"model": "tiny", "input": _words(9), "instructions": INSTRUCTIONS,
                                                    "max_output_tokens": 4})
        chained, headers = _post(url + "/v1/responses", {  # instructions do not carry over: sent again
            "model": "tiny", "input": "and then?", "instructions": INSTRUCTIONS, "max_output_tokens": 4,
            "previous_response_id": answer["id"]})
    print("Responses chain, cached / prompt tokens a turn:",
          ", ".join(f"{line['cached_tokens']}/{line['prompt_tokens']}" for line in lines),
          f"on {homes[0]}; a chain made on the other replica: {chained['usage']['input_tokens_details']['cached_tokens']} cached there")
    assert len(set(homes)) == 1, homes  # each turn on the replica holding the one before
    assert other.endswith(headers[REPLICA_HEADER])
    assert chained["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert len(lines) == 4, lines  # the chain the gateway did not make was passed through, not routed
    for line in lines[1:]:
        assert line["result"] == "hit" and line["cached_tokens"] > 0.6 * line["prompt_tokens"], line
        assert line["predicted_cached_tokens"] == line["cached_tokens"], line


def test_a_timestamp_in_the_instructions_or_the_system_prompt_is_named_volatile_value(engines, tmp_path):
    with _gateway(engines, tmp_path) as (url, lines):
        previous = None
        for turn in range(3):  # Responses: each turn's instructions carry the time
            body = {"model": "tiny", "instructions": _stamp(turn) + INSTRUCTIONS, "input": _words(turn),
                    "max_output_tokens": 4, "temperature": 0}
            if previous is not None:
                body["previous_response_id"] = previous
            previous = _post(url + "/v1/responses", body)[0]["id"]
        history = []  # (other times and words: nothing above is a prefix of these)
        for turn in range(3):  # Messages: the system prompt does, Claude Code's way
            history.append({"role": "user", "content": _words(turn + 3)})
            body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "stream": turn == 2,
                    "system": [{"type": "text", "text": _stamp(turn + 5) + INSTRUCTIONS}], "messages": history}
            answer, _ = _post(url + "/v1/messages", body, headers={"X-Session-ID": "claude"})
            history.append({"role": "assistant", "content": f"step {turn} done"})
        steady = []
        for turn in range(3):  # the fix: the same Messages client without the timestamp
            steady.append({"role": "user", "content": _words(turn + 6)})
            _post(url + "/v1/messages", {"model": "tiny", "max_tokens": 4, "temperature": 0, "system": INSTRUCTIONS,
                                         "messages": steady, "stream": turn == 1})
            steady.append({"role": "assistant", "content": f"step {turn} done"})
    print("timestamped then steady turns:", ", ".join(f"{line['result']}/{line.get('cause') or '-'}" for line in lines))
    assert len(lines) == 9, lines
    for line in lines[1:3] + lines[4:6]:
        assert line["result"] == "miss_changed" and line["cause"] == "volatile_value", line
        assert line["diverged_message"] == 0 and line["cached_tokens"] <= line["diverged_token"] < 64, line
    for line in lines[7:]:
        assert line["result"] == "hit" and line["cached_tokens"] > 0.6 * line["prompt_tokens"], line


def _operator(url: str, path: str, body: dict) -> str:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        return resp.read().decode()


def test_a_lora_adapter_loaded_on_one_replica_is_routed_there_with_a_cache_of_its_own(engines, tmp_path):
    adapter = launch.build_tiny_lora(tmp_path / "adapter", require_vllm())
    target = engines[1]
    chat = {"max_tokens": 4, "temperature": 0, "messages": [{"role": "system", "content": INSTRUCTIONS}]}
    with _gateway(engines, tmp_path) as (url, lines):
        _operator(target, "/v1/load_lora_adapter", {"lora_name": "tiny-lora", "lora_path": str(adapter)})
        served = []
        for turn in range(4):  # at once: the gateway looks again before it would refuse the name
            body = {**chat, "model": "tiny-lora",
                    "messages": [*chat["messages"], {"role": "user", "content": _words(turn)}]}
            served.append(_post(url + "/v1/chat/completions", body)[1][REPLICA_HEADER])
        listed = {m["id"] for m in json.loads(get(url + "/v1/models"))["data"]}
        base = {**chat, "model": "tiny", "messages": [*chat["messages"], {"role": "user", "content": _words(0)}]}
        _post(url + "/v1/chat/completions", base)  # the same prompt on the base model
        _operator(target, "/v1/unload_lora_adapter", {"lora_name": "tiny-lora"})
        time.sleep(2.5)  # the next read of the model lists (every second here) sees it gone
        request = urllib.request.Request(url + "/v1/chat/completions", json.dumps({**body, "model": "tiny-lora"}).encode(),
                                         {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as gone:
            urllib.request.urlopen(request, timeout=60)
    print(f"adapter turns on {sorted(set(served))} (loaded on {target}); cached / predicted:",
          ", ".join(f"{line['cached_tokens']}/{line['predicted_cached_tokens']}" for line in lines))
    assert all(target.endswith(name) for name in served), (target, served)
    assert listed == {"tiny", "tiny-lora"}
    assert gone.value.code == 404 and "tiny-lora" in json.loads(gone.value.read())["error"]["message"]
    assert len(lines) == 5, lines  # the 404 never reached a replica
    for line in lines[1:4]:  # the adapter's turns share its system prompt: hits, predicted exactly
        assert line["result"] == "hit" and line["predicted_cached_tokens"] == line["cached_tokens"] > 0, line
    # the base model computes the same tokens with other weights: nothing cached, none predicted
    assert lines[4]["cached_tokens"] == lines[4]["predicted_cached_tokens"] == 0, lines[4]
