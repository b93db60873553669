"""The gateway is transparent to every endpoint vLLM serves: the same request straight to a real
vLLM replica and through the gateway gets the same status and the same answer shape.

The list of endpoints is vLLM's own (its ``/openapi.json``, dev-mode endpoints included), so an
endpoint a later vLLM adds is checked without editing this test; only the ones that would stop
or reshape the engine for the rest of the module are left out, each with its reason.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from prefix_router.constants import REPLICA_HEADER
from prefix_router.serve.passthrough import REPLICAS_HEADER
from prefix_router.tools import launch

from .harness import get, tiny_model, vllm_spec

pytestmark = pytest.mark.vllm

# Left out: they change the engine for every later request, or need what the tiny CPU model lacks
LEFT_OUT = {
    "/sleep": "frees the weights; the engine serves nothing until /wake_up",
    "/wake_up": "only meaningful after /sleep",
    "/pause": "stops generation until /resume",
    "/resume": "only meaningful after /pause",
    "/collective_rpc": "runs arbitrary methods on the workers",
    "/v1/realtime": "a WebSocket",
    "/scale_elastic_ep": "needs data-parallel engines",
}
LEFT_OUT_PREFIXES = ("/update_weight", "/start_weight", "/start_draft", "/finish_weight", "/init_weight",
                     "/shutdown_weight", "/start_profile", "/stop_profile")

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about caches."}], "max_tokens": 4,
        "temperature": 0}
BODIES = {  # a request each endpoint can answer; the others get {"model": "tiny"}
    "/v1/chat/completions": CHAT, "/v1/chat/completions/render": CHAT,
    "/v1/chat/completions/batch": {"model": "tiny", "messages": [CHAT["messages"]] * 2, "max_tokens": 4,
                                   "temperature": 0},
    "/v1/completions": {"model": "tiny", "prompt": "Caches are", "max_tokens": 4, "temperature": 0},
    "/v1/completions/render": {"model": "tiny", "prompt": "Caches are"},
    "/v1/responses": {"model": "tiny", "input": "Tell me about caches.", "max_output_tokens": 4, "temperature": 0},
    "/v1/responses/render": {"model": "tiny", "input": "Tell me about caches."},
    "/v1/messages": {"model": "tiny", "max_tokens": 4, "temperature": 0, "system": "Be brief.",
                     "messages": [{"role": "user", "content": "Tell me about caches."}]},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/render": {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/tokenize": {"model": "tiny", "prompt": "Caches are"},
    "/detokenize": {"model": "tiny", "tokens": [5, 6, 7]},
}
GATEWAYS_OWN = ("/health", "/metrics")  # liveness and metrics of the gateway itself
STREAMED = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


def _routes(base: str) -> list[tuple[str, str]]:
    """(method, path) of every route vLLM's OpenAPI schema lists, path parameters filled in."""
    schema = json.loads(get(base + "/openapi.json", timeout=30))
    routes = []
    for path, methods in schema["paths"].items():
        if path in LEFT_OUT or path.startswith(LEFT_OUT_PREFIXES):
            continue
        for method in methods:
            routes.append((method.upper(), path.replace("{response_id}", "resp_not_there")))
    return sorted(routes)


def _send(base: str, method: str, path: str, body: dict | None) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def shape(value):
    """What of an answer must match: keys and counts, not ids, text or numbers."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def answer_shape(data: bytes):
    """A JSON answer's shape; a stream's events in order, each ``event:`` name and data's shape.

    A run of alike events counts as one: how many tokens vLLM puts in one delta depends on how
    its output loop meets the engine's steps, so one request's stream can come in 20 delta events
    once and 24 the next time (measured on vLLM's Responses stream); the kinds and their order do
    not vary.
    """
    text = data.decode("utf-8", "replace")
    if text.lstrip().startswith(("data:", "event:")):
        events, name = [], None
        for line in text.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                payload = line[5:].strip()
                event = [name, payload if payload == "[DONE]" else shape(json.loads(payload))]
                if not events or events[-1] != event:
                    events.append(event)
                name = None
        return events
    try:
        return shape(json.loads(text))
    except ValueError:
        return "text" if text else "empty"


@pytest.fixture(scope="module")
def replica_and_gateway(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("passthrough")
    spec = vllm_spec(log_dir, max_model_len=2048)
    spec.env["VLLM_SERVER_DEV_MODE"] = "1"  # the dev-mode endpoints (reset_prefix_cache...) are vLLM's too
    with launch.running([spec]) as (replica,):
        config = log_dir / "gateway.yaml"
        config.write_text("health: {timeout_s: 10.0, unhealthy_after: 3}\n")
        gateway = launch.gateway_server(log_dir, [replica], ["--config", str(config), "--tokenizer", str(tiny_model())])
        with launch.running([gateway]) as (url,):
            yield replica, url


def test_every_endpoint_vllm_serves_answers_the_same_through_the_gateway(replica_and_gateway):
    replica, gateway = replica_and_gateway
    routes = _routes(replica)
    assert len(routes) > 30, routes  # vLLM 0.32 lists about sixty
    compared, differ = [], []
    for method, path in routes:
        variants = [BODIES.get(path, {"model": "tiny"}) if method == "POST" else None]
        if path in STREAMED:
            variants.append({**variants[0], "stream": True})
        for body in variants:
            straight = _send(replica, method, path, body)
            through = _send(gateway, method, path, body)
            label = f"{method} {path}{' stream' if body and body.get('stream') else ''}"
            compared.append(f"{label}: {straight[0]}")
            own = path in GATEWAYS_OWN  # the same status; the answer is the gateway's
            seen = {(straight[0], None if own else json.dumps(answer_shape(straight[2])))}
            got = (through[0], None if own else json.dumps(answer_shape(through[2])))
            if got not in seen:
                # the status and shape of vLLM's own answers to one request can still vary (a
                # first request warms what a second finds ready): ask the replica once more
                again = _send(replica, method, path, body)
                seen.add((again[0], None if own else json.dumps(answer_shape(again[2]))))
            if got not in seen:
                differ.append((label, straight[0], through[0], straight[2][:300], through[2][:300]))
            elif not own and path != "/v1/models":
                assert REPLICA_HEADER in {k.lower() for k in through[1]} or REPLICAS_HEADER in {
                    k.lower() for k in through[1]}, label
    print(f"{len(compared)} requests compared:", "; ".join(compared))
    assert not differ, differ
