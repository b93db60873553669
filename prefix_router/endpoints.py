"""What each vLLM endpoint is to the gateway: the one table every path is sorted by.

vLLM 0.32's OpenAI server registers its routes from ``vllm/entrypoints/launchers/api_server/
routers.py`` (chat, completions, Responses, Anthropic Messages, pooling, scoring, audio, render,
tokenize, the SageMaker ``/invocations``, dev-mode and RL routes...). The gateway sorts each
request by method and path into a ``Kind``; ``kind_of`` is the only place that knows the lists,
and ``tests/vllm_tier/test_endpoints_vllm.py`` checks them against the routes of the installed
vLLM, so a route a later vLLM adds is seen.

Under tenants (``tenants.py``) the kind decides what a tenant's request gets: ``ROUTED`` and
``GENERATES`` go upstream with the tenant's ``cache_salt`` in the body (``Tenants.isolation``),
``SERVES`` and ``STORED`` as they came (nothing the engine caches is computed from them;
a stored Response only to the tenant that created it), ``UNSALTABLE``, ``OPERATOR`` and
``UNKNOWN`` are refused to tenants (an operator's admin key passes the last two).
"""

from __future__ import annotations

import enum
import re

__all__ = ["Kind", "GENERATES", "OPERATOR_POSTS", "ROUTED", "SERVES", "UNSALTABLE", "kind_of", "stored_id"]


class Kind(enum.Enum):
    """How the gateway treats a request (module docstring)."""

    ROUTED = "routed"  # routed by prefix and proxied: proxy.py
    GENERATES = "generates"  # the engine computes KV from its JSON body: one replica, the tenant's salt set
    UNSALTABLE = "unsaltable"  # the engine computes KV from a body that carries no cache_salt: refused to tenants
    SERVES = "serves"  # nothing cached is computed from the body (tokenize, render, health): one replica
    STORED = "stored"  # a stored Response by id: its home replica, its tenant only (response_homes.py)
    OPERATOR = "operator"  # changes the replicas' state: an admin key, every replica
    UNKNOWN = "unknown"  # not in vLLM 0.32: an admin key (or auth.tenant_paths), one replica


# by prefix: proxy.py (path: routed as a chat)
ROUTED = {"/v1/chat/completions": True, "/v1/completions": False, "/v1/responses": True, "/v1/messages": True}
# POSTs whose request types carry cache_salt (vllm/entrypoints/*/protocol.py: ``cache_salt`` and
# ``validate_cache_salt``): /invocations validates its body as a chat, completion or pooling
# request (serve/sagemaker/api_router.py), the batch endpoint takes a list of conversations
# with the chat request's other fields (openai/chat_completion/protocol.py)
GENERATES = frozenset({
    "/invocations", "/v1/chat/completions/batch", "/inference/v1/generate", "/generative_scoring", "/v1/systemone",
    "/v1/embeddings", "/v2/embed", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
    "/v2/rerank",
})
# POSTs the engine generates from whose request types have no cache_salt: audio (multipart
# form data, speech_to_text/*/protocol.py) and Cohere's chat (cohere/serving.py builds a chat
# request without one)
UNSALTABLE = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations", "/cohere/v2/chat"})
# POSTs from which nothing the prefix cache keeps is computed: token ids and templates
# rendered without generating, token counts, SageMaker's health check
SERVES = frozenset({
    "/v1/chat/completions/render", "/v1/chat/completions/derender", "/v1/completions/render",
    "/v1/completions/derender", "/v1/responses/render", "/v1/messages/count_tokens", "/v1/messages/render",
    "/cohere/v2/chat/render", "/tokenize", "/detokenize", "/ping",
})
# POSTs that change a replica's state (vLLM 0.32's routers under vllm/entrypoints/serve/, rl/,
# and the dev-mode ones): every replica gets them
OPERATOR_POSTS = frozenset({
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/release_kv_cache_memory", "/sleep",
    "/wake_up", "/pause", "/resume", "/abort_requests", "/inference/v1/abort_requests", "/collective_rpc",
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/start_profile", "/stop_profile", "/update_weights",
    "/update_weight_version", "/start_weight_update", "/start_draft_weight_update", "/finish_weight_update",
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/weight_checker",
    "/scale_elastic_ep", "/is_scaling_elastic_ep", "/fault_tolerance/apply",
})
_STORED = re.compile(r"^/v1/responses/([^/]{1,200})(/cancel)?$")
_READS = frozenset({"GET", "HEAD", "OPTIONS"})


def stored_id(path: str) -> str | None:
    """The response id of ``/v1/responses/{id}`` or ``.../{id}/cancel`` (a trailing slash too,
    which vLLM's Starlette redirects to the same route), else None."""
    match = _STORED.match(_untrailed(path))
    return match.group(1) if match else None


def _untrailed(path: str) -> str:
    return path[:-1] if len(path) > 1 and path.endswith("/") else path


def kind_of(method: str, path: str, tenant_paths: frozenset[str] | tuple[str, ...] = ()) -> Kind:
    """The ``Kind`` of ``method path``. ``tenant_paths``: unknown POST paths an operator lets
    tenants use (``auth.tenant_paths``), treated as ``GENERATES``. A trailing slash is read
    as the path without it: Starlette answers it with a redirect there."""
    path = _untrailed(path)
    if stored_id(path) is not None and (method in _READS or path.endswith("/cancel")):
        return Kind.STORED
    if method in _READS:
        return Kind.SERVES
    if path in ROUTED:
        return Kind.ROUTED if method == "POST" else Kind.UNKNOWN
    for kind, paths in ((Kind.GENERATES, GENERATES), (Kind.UNSALTABLE, UNSALTABLE), (Kind.SERVES, SERVES),
                        (Kind.OPERATOR, OPERATOR_POSTS)):
        if path in paths:
            return kind
    return Kind.GENERATES if path in tenant_paths else Kind.UNKNOWN
