"""Hostile input, generated (hypothesis): whatever a client sends, the gateway answers below 500,
every error is an OpenAI-style JSON error, and the process neither crashes nor logs a traceback.

The gateway (tiny tokenizer, so chat templates are rendered) and one simulated replica run as
their own processes, as in production; requests go over plain ``http.client`` so bodies and
headers are sent exactly as generated.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_router.tools.launch import build_tiny_model, gateway_server, running, sim_server

from ..helpers import MODEL

ROOT = Path(__file__).resolve().parents[2]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# text with lone surrogates too: JSON may escape them ("\ud800") and Python decodes them
any_text = st.text(st.characters(exclude_categories=()) | st.sampled_from(["\ud800", "\udfff", "\x00", "\ufeff"]),
                   max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
contents = st.text(max_size=200) | st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "bogus"]) | json_values},
    optional={"text": st.text(max_size=50) | json_values}), max_size=3) | json_values
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]) | json_values},
    optional={"content": contents, "tool_calls": json_values, "name": json_values, "tool_call_id": json_values}),
    max_size=5)
bodies = st.fixed_dictionaries({}, optional={
    "model": st.just(MODEL) | any_text | json_values,
    "messages": messages | json_values,
    "prompt": st.text(max_size=200) | st.lists(st.integers(-10, 70_000), max_size=50) | json_values,
    "max_tokens": st.integers(-5, 40) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values}) | json_values,
    "tools": json_values,
    "cache_salt": any_text | json_values,
    "user": any_text | json_values,
})
paths = st.sampled_from(["/v1/chat/completions", "/v1/completions"])
# header names and values a client can put on the wire (http.client refuses CR/LF itself)
header_names = st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"), min_size=1,
                       max_size=30)
header_values = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=300)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tokenizer = build_tiny_model(ROOT / ".cache" / "tiny-tokenizer", corpus=ROOT.parent / "shared" / "agent_traces",
                                 tokenizer_only=True)
    logs = tmp_path_factory.mktemp("fuzz")
    with running([sim_server(logs, ["--model", MODEL, "--tokenizer", str(tokenizer), "--time-scale", "1000",
                                    "--num-blocks", "20000"])]) as (replica,):
        server = gateway_server(logs, [replica], ["--tokenizer", str(tokenizer)])
        with running([server]) as (url,):
            yield urlsplit(url).netloc, server
        log = server.log.read_text()
    assert "Traceback" not in log, log[-3000:]


def post(netloc: str, path: str, raw: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(netloc, timeout=30)
    try:
        conn.request("POST", path, body=raw, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def check(status: int, data: bytes, http_layer_ok: bool = False) -> None:
    """Below 500; an error is OpenAI-style JSON, except (``http_layer_ok``) a request that is not
    valid HTTP, which aiohttp's parser answers 400 in plain text before any handler runs."""
    assert status < 500, (status, data[:500])
    if http_layer_ok and status == 400 and not data.startswith(b"{"):
        return
    if status >= 400:
        error = json.loads(data)["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert error["code"] == status or status == 404 and error.get("code") in (404, None)


@FUZZ
@given(path=paths, body=bodies)
def test_any_json_body_gets_an_answer_below_500(gateway, path, body):
    netloc, server = gateway
    check(*post(netloc, path, json.dumps(body).encode()))


@FUZZ
@given(path=paths, raw=st.binary(max_size=2000) | st.text(max_size=500).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_any_bytes_as_a_body_get_an_openai_error_below_500(gateway, path, raw):
    netloc, server = gateway
    check(*post(netloc, path, raw))


@FUZZ
@given(path=paths, headers=st.dictionaries(header_names, header_values, max_size=6))
def test_any_headers_get_an_answer_below_500(gateway, path, headers):
    netloc, server = gateway
    headers = {k: v for k, v in headers.items() if k.lower() not in ("content-length", "transfer-encoding", "host",
                                                                      "content-type", "expect", "connection")}
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    check(*post(netloc, path, json.dumps(body).encode(), headers), http_layer_ok=True)
