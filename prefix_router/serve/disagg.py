"""Prefill/decode disaggregation: the two legs of one request, as vLLM's NixlConnector takes them.

A disaggregated fleet computes prompts on prefill replicas and generates on decode replicas, the
KV cache moving from one to the other through vLLM's KV connector (NIXL). The gateway sends each
request twice, with one ``X-Request-Id`` on both legs:

- prefill leg: the client's body asking for one token, not streamed, with ``kv_transfer_params``
  telling the engine a remote decode follows (``PREFILL_PARAMS``; ``prefill_body``). The engine
  answers with the parameters a decode replica needs to pull the prompt's blocks
  (``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port`` ...) and holds
  those blocks for a lease (``kv_lease_duration``, 30 s by default in vLLM 0.32), after which a
  decode reads freed blocks without an error: the decode leg must follow at once;
- decode leg: the client's body as sent (streamed if asked) with the prefill answer's
  ``kv_transfer_params`` copied unchanged (``decode_body``); without them the decode replica
  computes the prompt itself.

Sources: vLLM's own proxy (https://github.com/vllm-project/vllm/blob/030ea52/tests/v1/kv_connector/
nixl_integration/toy_proxy_server.py); llm-d's sidecar, ``pkg/sidecar/proxy/connector_nixlv2.go``, which
also sets ``max_output_tokens`` for ``/v1/responses``; the engine side in vLLM 0.32's
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``. A request the engine cannot hand over
in one transfer goes whole to one replica (``unsplittable``). A client never sets
``kv_transfer_params`` itself: with them a request could pull another tenant's blocks.
"""

from __future__ import annotations

from typing import Any

from prefix_router.prompts.responses import RESPONSES

__all__ = ["PREFILL_PARAMS", "TRANSFER_KEY", "decode_body", "prefill_body", "unsplittable"]

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TRANSFER_KEY = "kv_transfer_params"
# what a prefill leg asks of a NixlConnector engine: compute, hold the blocks for a remote decode
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
# the token limit each API names, set to 1 on the prefill leg (Responses has only its own)
_LIMITS = {COMPLETIONS: ("max_tokens",), CHAT: ("max_tokens", "max_completion_tokens"),
           RESPONSES: ("max_output_tokens",)}
# asked of the prefill leg, these would make its one token wrong or its answer a stream
_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def unsplittable(body: dict[str, Any], path: str) -> str | None:
    """Why the request goes whole to one replica instead of two legs, or None to split it.

    ``path``: the API's path (``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``;
    any other is not split). ``n`` above 1 and a list of several prompts are not split: the
    engine answers with one child's ``kv_transfer_params`` only (``RequestOutput.add`` keeps the
    last; a list's first), so the other children's blocks stay held until the lease ends and
    the decode children pull the same blocks (tried on vLLM 0.32, CPU build). Nor is a Response
    continuing a ``previous_response_id``: its history is stored on the replica that made it."""
    if path not in _LIMITS:
        return f"{path} is not split into prefill and decode"
    if body.get("n") not in (None, 1):  # vLLM reads "2" and 2.0 as 2
        return "n > 1: the engine hands one transfer over per request"
    prompt = body.get("prompt") if path == COMPLETIONS else None
    if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt):
        return "a list of prompts: the engine hands one transfer over per request"
    embeds = body.get("prompt_embeds")
    if isinstance(embeds, list) and len(embeds) > 1:
        return "a list of prompt embeddings: the engine hands one transfer over per request"
    if body.get("use_beam_search"):
        return "beam search runs several sequences"
    if path == RESPONSES and body.get("previous_response_id") is not None:
        return "a continued Response: its history is stored on one replica"
    return None


def prefill_body(body: dict[str, Any], path: str) -> dict[str, Any]:
    """The prefill leg's body: a shallow copy of the client's ``body`` for ``path`` (one that
    ``unsplittable`` splits) with ``PREFILL_PARAMS``, ``stream`` false (for Responses also
    ``store`` and ``background``: vLLM 0.32 stores a Response by default), the API's token limits
    at 1 (``max_completion_tokens`` only where sent) and what would change that one token or
    stream it dropped (``stream_options``, ``min_tokens``, ``min_completion_tokens``). Raises
    KeyError for a path that is not split."""
    out = {k: v for k, v in body.items() if k not in _DROPPED}
    out[TRANSFER_KEY] = dict(PREFILL_PARAMS)
    out["stream"] = False
    if path == RESPONSES:  # a one-token Response is not to be stored, nor answered before it is made
        out["store"], out["background"] = False, False
    for i, limit in enumerate(_LIMITS[path]):
        if i == 0 or limit in body:
            out[limit] = 1
    return out


def decode_body(body: dict[str, Any], prefill_answer: Any) -> tuple[dict[str, Any], bool]:
    """The decode leg's body and whether it carries a transfer: the client's ``body`` with the
    ``kv_transfer_params`` of ``prefill_answer`` (the prefill leg's JSON answer) copied
    unchanged. An answer without them (a replica with no KV connector, or one that could not
    hold the blocks) gives the body without any: the decode replica computes the prompt itself.
    Whatever the client put under the key is never sent."""
    params = prefill_answer.get(TRANSFER_KEY) if isinstance(prefill_answer, dict) else None
    out = {k: v for k, v in body.items() if k != TRANSFER_KEY}
    if isinstance(params, dict) and params:
        out[TRANSFER_KEY] = params
        return out, True
    return out, False
