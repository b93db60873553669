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

import asyncio
import dataclasses
import json
import logging
import math
import time
import uuid
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from prefix_router.constants import REPLICA_HEADER
from prefix_router.errors import openai_error
from prefix_router.gateway import Gateway
from prefix_router.prompts.analysis import PromptInfo
from prefix_router.prompts.responses import RESPONSES, chat_usage
from prefix_router.routing.decision import Decision, Route
from prefix_router.serve.bodies import loads
from prefix_router.serve.forward import Choose, InFlight, Outcome, attempts, breaker_record, forward, headers_for
from prefix_router.serve.inbound import Inbound, patched

__all__ = ["PREFILL_PARAMS", "TRANSFER_KEY", "decode_body", "dumps", "prefill_body", "prefill_refusal", "serve_split",
           "short_suffix", "unsplittable"]

log = logging.getLogger(__name__)
_WARNED: set[str] = set()  # prefill replicas already named for answering without kv_transfer_params

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


# -- the two legs ----------------------------------------------------------------------------------

@dataclasses.dataclass(slots=True)
class _Prefilled:
    """A prefill leg's end: the slot of the attempt that served it (None when none did), its
    decision and answer; ``refused``: a 4xx to give the client as it came."""

    slot: InFlight | None = None
    decision: Decision | None = None
    answer: Any = None
    refused: web.Response | None = None
    failed: list = dataclasses.field(default_factory=list)  # prefill replicas that answered 5xx


def short_suffix(gw: Gateway, info: PromptInfo, decision: Decision) -> bool:
    """Whether the decode replica of ``decision`` lacks fewer than
    ``disaggregation.min_prefill_tokens`` of the prompt's tokens (so it computes them itself)."""
    least = gw.config.disaggregation.min_prefill_tokens
    if least <= 0:
        return False
    unit = gw.unit_block_size(info)
    return info.num_units - decision.predicted_blocks * unit < least * (unit / gw.block_size if not info.exact else 1)


async def serve_split(request: web.Request, gw: Gateway, inbound: Inbound, info: PromptInfo, decision: Decision,
                      choose_prefill: Choose, choose_decode: Choose) -> Outcome:
    """One request as two legs (module docstring): the prefill leg on the replica
    ``choose_prefill`` gives (another after a 5xx or no answer; a 4xx goes to the client as the
    request's own fault), then the decode leg on ``decision``'s replica (retried by
    ``forward`` where ``choose_decode`` says, without the transfer, which the failed attempt may
    have used up). No prefill replica serving it, or one answering without
    ``kv_transfer_params``, leaves the decode replica to compute the prompt. The Outcome
    accounts the prompt's cache on the prefill replica (that is where it was computed); its
    ``decode`` and ``transfer`` say the rest."""
    started = time.perf_counter()
    refused = prefill_refusal(inbound.body, inbound.path)
    if refused is not None:
        return Outcome(openai_error(400, *refused), 400)
    try:
        payload = dumps(prefill_body(inbound.body, inbound.path), inbound.raw)
    except RecursionError:  # orjson's depth limit, then Python's
        return Outcome(openai_error(400, "request body is nested too deeply", "body"), 400)
    rid = f"prefix-router-{uuid.uuid4().hex}"  # one X-Request-Id on both legs, as vLLM's proxy does
    headers = {**{k: v for k, v in inbound.headers.items() if k.lower() != "x-request-id"}, "X-Request-Id": rid}
    legs = dataclasses.replace(inbound, headers=headers)
    prefilled = await _prefill(gw, legs, info, choose_prefill, payload)
    if prefilled.refused is not None:
        return Outcome(prefilled.refused, prefilled.refused.status, prefilled.slot.replica, prefilled.decision,
                       prefilled.decision.route, held_blocks=prefilled.slot.held_blocks, elapsed_s=
                       time.perf_counter() - started)
    body, carried = decode_body(inbound.body, prefilled.answer)
    transfer = "pulled" if carried else ("no_params" if prefilled.slot is not None else "prefill_failed")
    if prefilled.slot is not None and not carried and prefilled.slot.replica.name not in _WARNED:
        _WARNED.add(prefilled.slot.replica.name)  # once a replica: the metric counts the rest
        log.warning("prefill replica %s answered without kv_transfer_params, so the decode replica computes the "
                    "prompt: is it started with --kv-transfer-config and kv_role kv_producer? (said once; "
                    "prefix_router_decode_requests_total{transfer=\"no_params\"} counts them)",
                    prefilled.slot.replica.name)
    # the client's body as checked (it carries no kv_transfer_params: refused at the door), the
    # transfer spliced in front of its bytes rather than the prompt encoded again
    whole = inbound.payload
    decoding = patched(whole, inbound.body, {TRANSFER_KEY: body[TRANSFER_KEY]}) if carried else whole
    outcome = await forward(request, gw, dataclasses.replace(legs, payload=decoding), info, decision, choose_decode,
                            retry_payload=whole, started=started)
    if carried and outcome.route is Route.RETRY:  # the retry went without the transfer
        carried, transfer = False, "decode_retried"
    if outcome.replica is not None:
        gw.metrics.decode_requests.labels(outcome.replica.name, transfer).inc()
        for replica in prefilled.failed:  # the request was servable: their 5xx were theirs
            breaker_record(gw, replica, False)
    if not carried or outcome.replica is None or outcome.status != 200:  # the decode's own failures are its
        return dataclasses.replace(outcome, transfer=transfer)
    return _accounted(outcome, prefilled, transfer, inbound.path)


def dumps(body: dict, raw: bytes = b"") -> bytes:
    """A leg's body as JSON: orjson, or Python's json for lone surrogates and integers beyond 64
    bits, which orjson refuses, and for NaN and infinities, which it would write as null (``raw``:
    the client's bytes, where they show). Raises RecursionError for a body nested too deeply."""
    if b"NaN" not in raw and b"Infinity" not in raw:
        try:
            return orjson.dumps(body)
        except TypeError:
            pass
    return json.dumps(body).encode()


def prefill_refusal(body: dict[str, Any], path: str) -> tuple[str, str] | None:
    """(message, param) of the 400 vLLM would give for a field the prefill leg replaces or drops
    (the token limits, ``stream_options``, ``min_tokens``), else None. Checked before the prefill
    leg: once it ran, the prompt's blocks stay held for a decode that would be refused, until the
    lease ends. Values are read as vLLM's pydantic models read them (``"5"`` and ``5.0`` are 5)."""
    limits = {}
    for field in (*_LIMITS[path], "min_tokens", "min_completion_tokens"):
        value = body.get(field)
        if value is None:
            continue
        number = _integer(value)
        least = 0 if field.startswith("min_") else 1
        if number is None or not least <= number < 1 << 63:
            return f"{field} must be an integer of at least {least}, got {str(value)[:40]!r}", field
        limits[field] = number
    most = limits.get("max_completion_tokens", limits.get("max_tokens"))
    least = limits.get("min_completion_tokens", limits.get("min_tokens"))
    if most is not None and least is not None and least > most:
        return f"min_tokens must be less than or equal to max_tokens={most}, got {least}.", "min_tokens"
    if body.get("stream_options") is not None and body.get("stream") is not True:
        return "Stream options can only be defined when `stream=True`.", "stream_options"
    return None


def _integer(value: Any) -> int | None:
    """``value`` as pydantic's lax mode reads an integer, else None."""
    if isinstance(value, (bool, int)):
        return int(value)
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value.strip())
    return None


def _accounted(outcome: Outcome, prefilled: _Prefilled, transfer: str, path: str) -> Outcome:
    """The decode leg's outcome with the prefill leg's cache accounting: its replica, decision,
    held blocks and view, and its usage's prompt counts (the decode's count pulled tokens as
    cached) with the decode's completion tokens."""
    slot, usage = prefilled.slot, outcome.usage
    prefill_usage = chat_usage(path, prefilled.answer.get("usage") if isinstance(prefilled.answer, dict) else None)
    if isinstance(prefill_usage, dict) and isinstance(usage, dict):
        usage = {**prefill_usage, "completion_tokens": usage.get("completion_tokens")}
    return dataclasses.replace(outcome, replica=slot.replica, decision=prefilled.decision,
                               route=prefilled.decision.route, usage=usage, held_blocks=slot.held_blocks,
                               view=slot.view, removals=slot.removals, decode=outcome.replica, transfer=transfer)


async def _prefill(gw: Gateway, inbound: Inbound, info: PromptInfo, choose: Choose, payload: bytes) -> _Prefilled:
    """The prefill leg (``payload``), retried on another prefill replica after a 5xx or no answer,
    up to ``upstream.max_retries`` times; an empty ``_Prefilled`` when none served it."""
    answered_5xx = []  # blamed only once the request was served (as forward.py does)
    for _, replica, decision, route in attempts(gw, choose):
        with InFlight(gw, replica, info, decision) as slot:
            try:
                async with gw.http.post(replica.url + inbound.path, data=payload,
                                        headers=headers_for(replica, inbound.headers), allow_redirects=False) as upstream:
                    data = await upstream.read()
                    status, content_type = upstream.status, upstream.headers.get("Content-Type", "application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                slot.ok, slot.failed = False, True
                log.warning("prefill leg on %s failed (%s)", replica.name, type(exc).__name__)
                gw.metrics.requests.labels(replica.name, route.value, "0").inc()
                continue
            if status >= 500:
                slot.failed = True
                answered_5xx.append(replica)
                gw.metrics.requests.labels(replica.name, route.value, str(status)).inc()
                continue
            slot.relayed(status)
            slot.prefilled()
            for earlier in answered_5xx:
                breaker_record(gw, earlier, False)
            if status == 404:  # perhaps a model it no longer serves: its list is read at the next round
                replica.models_read_at = -math.inf
            if status != 200:  # the request's own fault: every replica would say the same
                refused = web.Response(body=data, status=status, headers={"Content-Type": content_type,
                                                                           REPLICA_HEADER: replica.name})
                return _Prefilled(slot, dataclasses.replace(decision, route=route), refused=refused)
            try:
                answer = loads(data)
            except (ValueError, RecursionError):
                answer = None
            return _Prefilled(slot, dataclasses.replace(decision, route=route), answer)
    return _Prefilled(failed=answered_5xx)
