"""The OpenAI-compatible proxy: one request's pipeline, step by step (``handle_generate``).

1. Inbound (``inbound.read_inbound``): read and check the body (413 above
   ``limits.max_body_bytes``, OpenAI-style 400 for bad JSON or a body vLLM would refuse), find
   the tenant and the session, set the cache salt and ``stream_options.include_usage``.
2. Analysis (``analysis.analyze``): the prompt's token blocks and their chained hashes, its
   conversation and, for a conversation, the fingerprint that explains a changed prefix later.
   Small bodies are analysed on the event loop; big ones (``limits.inline_analysis_bytes``) in a
   worker thread, so tokenization and chat templates never hold up other requests.
3. Admission (``admission.py``): a wait while every replica is saturated, or a 429/503.
4. The policy's choice (``choose``): ``policy.select`` on the routable replicas that serve the
   request's model (``Gateway.serving``: a model or LoRA adapter no replica lists gets the
   gateway's own 404), reading each
   replica's cache as its KV events report it while they are fresh
   (``ReplicaState.cache_index``), else the shadow index.
5. Forward (``forward.forward``): the request to the chosen replica, retried where the policy
   chooses again when a replica fails before anything reached the client; the answer streamed
   back as it arrives (``relay.relay``) with ``x-prefix-router-replica`` naming the replica. In a
   disaggregated fleet the choice of step 4 is among the decode replicas, and a prefill leg on a
   prefill replica the policy chooses comes first (``disagg.serve_split``).
6. Learning (``learning.learn``): the cache outcome, its cause, metrics, the request log.

Every step but the policy's may end the request with an error response; nothing is retried
once a byte reached the client, and in-flight accounting is released however an attempt ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from aiohttp import web

from prefix_router.fleet.admission import QueueFull, QueueTimeout
from prefix_router.misses.diagnosis import fingerprint
from prefix_router.errors import openai_error
from prefix_router.serve.disagg import serve_split, short_suffix, unsplittable
from prefix_router.serve.forward import Outcome, forward
from prefix_router.gateway import Gateway
from prefix_router.serve.inbound import Inbound, read_inbound
from prefix_router.prompts.responses import RESPONSES
from prefix_router.serve.learning import learn
from prefix_router.serve.passthrough import handle_passthrough
from prefix_router.routing.bounds import ReplicaView
from prefix_router.routing.decision import Decision
from prefix_router.prompts.analysis import PromptInfo, analyze

__all__ = ["choose", "handle_generate", "route"]

log = logging.getLogger(__name__)


async def handle_generate(request: web.Request, gw: Gateway, path: str, chat: bool) -> web.StreamResponse:
    """``POST /v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` and ``/v1/messages``:
    the pipeline of the module docstring. A Responses request continuing a response that lives
    on one replica goes to that replica only; one whose history this gateway does not hold
    (another instance made it, or it was forgotten) is passed through to it (``passthrough.py``)."""
    inbound = await read_inbound(request, gw, path, chat)
    if isinstance(inbound, web.Response):
        return inbound
    if inbound.prompt is None:  # forwarded as checked: the tenant's salt set, kv_cache_report_mode dropped
        return await handle_passthrough(request, gw, inbound.payload, inbound.headers)
    routed = await route(gw, inbound)
    if isinstance(routed, web.Response):
        return routed
    info, decision, allowed = routed
    outcome = await _serve(request, gw, inbound, info, decision, allowed)
    learn(gw, inbound, info, outcome)
    return outcome.response


async def _serve(request: web.Request, gw: Gateway, inbound: Inbound, info: PromptInfo, decision: Decision,
                 allowed: frozenset[str] | None) -> Outcome:
    """Step 5: ``forward`` to the chosen replica; in a disaggregated fleet (replicas with
    ``role: prefill``), a prefill leg on the prefill replica the policy chooses first
    (``disagg.serve_split``) unless the request cannot be split or its decode replica lacks only
    a short suffix, ``decision`` having chosen the decode replica."""
    decode = lambda tried: choose(gw, info, inbound.session, tried, allowed)  # noqa: E731
    if not gw.prefill_names:
        return await forward(request, gw, inbound, info, decision, decode)
    whole = ("whole" if unsplittable(inbound.body, inbound.path) else
             "short" if gw.max_hit_blocks(info) == 0 or short_suffix(gw, info, decision) else None)  # no block to move
    if whole is None:
        pool = gw.serving(inbound.body.get("model"))
        prefill = gw.prefill_names if pool is None else gw.prefill_names & pool
        return await serve_split(request, gw, inbound, info, decision,
                                 lambda tried: choose(gw, info, inbound.session, tried, prefill), decode)
    outcome = await forward(request, gw, inbound, info, decision, decode)
    if outcome.replica is not None:
        gw.metrics.decode_requests.labels(outcome.replica.name, whole).inc()
    return dataclasses.replace(outcome, transfer=whole)


async def route(gw: Gateway, inbound: Inbound, subset: frozenset[str] | None = None
                ) -> tuple[PromptInfo, Decision, frozenset[str] | None] | web.Response:
    """Steps 2 to 4 for a checked request (the Endpoint Picker's too, ``epp/picker.py``): (its
    analysis, the policy's decision, the replicas a retry may choose among: None for any), or
    the error response to answer (404 for a model no replica serves, 429 or 503 from admission
    or when no replica can take it). ``subset``: the only replicas it may go to (the Endpoint
    Picker protocol's subset hint)."""
    allowed = await _serving(gw, inbound.body.get("model"))
    if isinstance(allowed, web.Response):
        return allowed
    if gw.prefill_names:  # disaggregated: the request is decoded (or served whole) off the prefill pool
        decoding = frozenset(gw.replicas).difference(gw.prefill_names)
        allowed = decoding if allowed is None else allowed & decoding
    if subset is not None:
        allowed = subset if allowed is None else allowed & subset
    home = None
    if inbound.path == RESPONSES and inbound.body.get("previous_response_id"):
        # only the replica storing it can continue it, and only if the model and the subset allow
        home = gw.response_homes.home(inbound.body["previous_response_id"])
        allowed = frozenset({home}) if allowed is None else allowed & {home}
    try:
        info = await _analysis(gw, inbound)
    except RecursionError:  # a body orjson read but Python's JSON and templates cannot walk
        return openai_error(400, "request body is nested too deeply", "body")
    rejected = await _admit(gw)
    if rejected is not None:
        return rejected
    decision = choose(gw, info, inbound.session, allowed=allowed)
    if decision is None:
        if home is not None:
            return openai_error(503, f"replica {home}, which holds previous_response_id, is not available",
                                "previous_response_id", type_="ServiceUnavailableError", headers={"Retry-After": "1"})
        return openai_error(503, "no healthy replica", type_="ServiceUnavailableError")
    gw.branches.record(info.hashes, gw.config.routing.max_key_blocks)
    gw.demand.record(info.hashes, gw.config.routing.max_key_blocks, time.monotonic())
    return info, decision, allowed


async def _serving(gw: Gateway, model) -> frozenset[str] | None | web.Response:
    """``Gateway.serving(model)``, looking at the replicas' model lists once more before refusing
    a model none listed (an adapter loaded since the last scrape is found at once); the 404 (no
    replica serves it) or 503 (those that do are down) to answer when no replica may take it."""
    allowed = gw.serving(model)
    if allowed is not None and not allowed and not gw.model_known(model):
        await gw.refresh_models()
        allowed = gw.serving(model)
    if allowed is None or allowed:
        return allowed
    if gw.model_known(model):
        return openai_error(503, f"no healthy replica serves the model `{model}`", "model",
                            type_="ServiceUnavailableError", headers={"Retry-After": "1"})
    return openai_error(404, f"The model `{model}` does not exist.", "model", type_="NotFoundError")


async def _analysis(gw: Gateway, inbound: Inbound) -> PromptInfo:
    """The prompt's analysis, on the event loop for a small body, else in a worker thread; its
    time, as the request waited for it, to ``prefix_router_analysis_seconds``."""
    started = time.perf_counter()
    if len(inbound.raw) <= gw.config.limits.inline_analysis_bytes:
        info = _analyze(gw, inbound)
    else:
        info = await asyncio.get_running_loop().run_in_executor(gw.executor, _analyze, gw, inbound)
    gw.metrics.analysis_seconds.observe(time.perf_counter() - started)
    if gw.config.log_prompts:  # an operator's explicit choice (off by default)
        log.info("request conversation=%s units=%d body=%.500r", info.conversation, info.num_units, inbound.raw)
    return info


def _analyze(gw: Gateway, inbound: Inbound) -> PromptInfo:
    """``analysis.analyze``, plus the fingerprint ``diagnosis.diagnose`` needs when the request
    belongs to a conversation (built on the previous one's, so only new messages cost)."""
    body = inbound.prompt
    info = analyze(body, inbound.chat, gw.tokenizer, gw.block_size, gw.config.routing.char_block_size,
                   inbound.session, inbound.session_by_user)
    if info.conversation:
        previous = gw.conversations.get(info.conversation)
        info.print = fingerprint(body, previous.print if previous is not None else None, info.message_hashes)
    return info


async def _admit(gw: Gateway) -> web.Response | None:
    """Wait in the admission queue while every replica is saturated; the 429 or 503 (with
    Retry-After) to answer when the queue is full or the wait timed out, else None."""
    try:
        await gw.admission.admit()
    except QueueFull:
        gw.metrics.admission_rejected.labels("queue_full").inc()
        return openai_error(429, f"every replica is saturated and {gw.config.admission.max_queue} requests are "
                            "already waiting; retry later", type_="RateLimitError", headers={"Retry-After": "1"})
    except QueueTimeout:
        gw.metrics.admission_rejected.labels("timeout").inc()
        return openai_error(503, f"every replica stayed saturated for {gw.config.admission.timeout_s:g} s; retry later",
                            type_="ServiceUnavailableError", headers={"Retry-After": "1"})
    return None


def choose(gw: Gateway, info: PromptInfo, session: str | None, exclude: frozenset[str] = frozenset(),
           allowed: frozenset[str] | None = None) -> Decision | None:
    """The policy's choice among the routable replicas not in ``exclude`` (those a retry already
    tried) and, when given, in ``allowed`` (those serving the request's model or holding its
    previous response); None when there is none. The ring key is the session key, else the
    chat's opening when ``routing.chat_opening_key`` is on. Restricting the ring to the replicas
    of one model is that model's own consistent-hash ring: a key keeps its place among them."""
    now = time.monotonic()
    half_life = gw.config.routing.share_half_life_s
    views = {}
    for r in gw.replicas.values():  # a pass over the fleet per request: kept to attribute reads
        if r.routable_at(now) and r.name not in exclude and (allowed is None or r.name in allowed):
            index = r.cache_index(info.exact)
            views[r.name] = ReplicaView(r.name, r.routing_load, index, r.recent_share(now, half_life),
                                        r.prefill_blocks, index is not r.shadow)
    if not views:
        return None
    started = time.perf_counter()
    key = session or (info.opening if gw.config.routing.chat_opening_key else None)
    decision = gw.policy.select(info.hashes, info.full_hash, views, key, gw.max_hit_blocks(info), info.first_turn)
    gw.metrics.routing_seconds.observe(time.perf_counter() - started)
    return decision
