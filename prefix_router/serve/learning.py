"""The last step of a request (``learn``): what its answer teaches the gateway.

From the engine's ``usage`` (``prompt_tokens``, ``prompt_tokens_details.cached_tokens``,
``completion_tokens``): the request's cache outcome (``classify.classify``: hit,
miss_cold, miss_changed, miss_routed, miss_evicted) and the tokens lost; for a changed prefix,
what the client changed (``diagnosis.explain``) and where (``Gateway.record_change``); the
conversation's new memory; the decode blocks the replica now holds (shadow index); every
metric; and, when configured, the request's line in the request log (``misses/request_log.py``). A
Responses answer's replica and history are remembered for the requests that continue it
(``response_homes.py``).

Counts are kept in the gateway's blocks (``Gateway.unit_block_size``); for character blocks
(no tokenizer) the engine's token counts are scaled by units per token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from prefix_router.cache.offload import MEDIA
from prefix_router.misses.diagnosis import explain
from prefix_router.misses.change_sites import redacted_excerpt
from prefix_router.misses.classify import CacheResult, Conversation, Verdict, classify
from prefix_router.prompts.responses import count, output_messages
from prefix_router.serve.forward import Outcome
from prefix_router.gateway import Gateway
from prefix_router.serve.inbound import Inbound
from prefix_router.routing.decision import Route
from prefix_router.prompts.analysis import PromptInfo
from prefix_router.misses.request_log import conversation_tag, keyed_blocks

__all__ = ["flush_waiting_lines", "learn"]

log = logging.getLogger(__name__)


def learn(gw: Gateway, inbound: Inbound, info: PromptInfo, outcome: Outcome) -> None:
    """Count and remember what the request's answer says (module docstring). A request no
    replica answered teaches nothing here (its attempts were counted as they failed)."""
    replica, decision = outcome.replica, outcome.decision
    if replica is None or decision is None:
        return
    if outcome.response_id is not None:
        _remember_response(gw, inbound, outcome)
    name, route, m = replica.name, outcome.route.value, gw.metrics
    m.requests.labels(name, route, str(outcome.status)).inc()
    if outcome.route is Route.SPILL and decision.spilled_from:
        m.spillovers.labels(decision.spilled_from, name).inc()
    if outcome.ttft_s is not None:
        m.ttft.labels(name).observe(outcome.ttft_s)
    m.request_seconds.labels(name).observe(outcome.elapsed_s)
    usage = outcome.usage
    if outcome.status != 200 or not usage or not isinstance(usage, dict):
        log.debug("request to %s, route %s: HTTP %d after %.3f s", name, route, outcome.status, outcome.elapsed_s)
        if gw.request_log is not None:
            _log(gw, inbound, replica=name, route=route, status=outcome.status, ttft_s=outcome.ttft_s,
                 elapsed_s=round(outcome.elapsed_s, 6), conversation=conversation_tag(info.conversation),
                 **_legs(outcome))
        return
    prompt_tokens, cached_tokens, cached_blocks, to_tokens = _engine_hit(gw, info, usage)
    (outcome.decode or replica).shadow.add_output(count(usage.get("completion_tokens")) // gw.block_size, info.hashes)
    m.prompt_tokens.labels(name).inc(prompt_tokens)
    m.cached.labels(name).inc(cached_tokens)
    predicted = min(int(decision.predicted_blocks * to_tokens), prompt_tokens)
    m.cached_predicted.labels(name).inc(predicted)
    replica.prompt_tokens += prompt_tokens
    replica.cached_tokens += cached_tokens
    replica.predicted_tokens += predicted
    offload = {medium: int(n * to_tokens) for medium, n in zip(MEDIA, decision.offload) if n}
    for medium, tokens in offload.items():
        m.cached_predicted_offload.labels(name, medium).inc(tokens)
    conversation = info.conversation  # "" for a completion without a session key: see prompts/analysis.py
    previous = gw.conversations.get(conversation) if conversation else None
    verdict = classify(hashes=info.hashes, message_hashes=info.message_hashes, previous=previous,
                       cached_blocks=cached_blocks, predicted_blocks=decision.predicted_blocks,
                       best_blocks=decision.best_blocks, max_hit_blocks=gw.max_hit_blocks(info),
                       block_size=1, held_blocks=outcome.held_blocks)
    m.cache_requests.labels(name, verdict.result.value).inc()
    lost = int(verdict.lost_tokens * to_tokens)
    if verdict.lost_tokens:
        m.lost_tokens.labels(name, verdict.result.value.removeprefix("miss_")).inc(lost)
    change = _record_change(gw, inbound, info, verdict, previous, to_tokens, lost)
    if conversation:
        gw.conversations.put(conversation, Conversation.of(info.hashes, info.message_hashes, info.print))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("request to %s, route %s: %s, %d prompt tokens, %d cached (%d predicted), TTFT %s", name, route,
                  verdict.result.value, prompt_tokens, cached_tokens, predicted,
                  "-" if outcome.ttft_s is None else f"{outcome.ttft_s:.3f} s")
    if gw.request_log is not None:
        _log_with_evictions(gw, inbound, info, outcome, cached_blocks, to_tokens,
             replica=name, route=route, status=outcome.status, prompt_tokens=prompt_tokens,
             cached_tokens=cached_tokens, predicted_cached_tokens=predicted,
             **({"predicted_offload_tokens": offload} if offload else {}),
             result=verdict.result.value, lost_tokens=lost, cause=change.cause.value if change else None,
             diverged_message=change.message_index if change else None,
             diverged_token=int(verdict.diverged_block * to_tokens) if change else None,
             conversation=conversation_tag(conversation), spilled_from=decision.spilled_from,
             ttft_s=outcome.ttft_s, elapsed_s=round(outcome.elapsed_s, 6), **_legs(outcome),
             **(_chain(gw, info, usage) if gw.config.request_log_blocks else {}))


def _legs(outcome: Outcome) -> dict:
    """A disaggregated request's log fields: ``decode_replica`` (``replica`` being its prefill
    leg's, or the decode replica's when it was not split) and ``transfer``; none otherwise."""
    if outcome.transfer is None:
        return {}
    decode = outcome.decode or outcome.replica
    return {"decode_replica": decode.name if decode is not None else None, "transfer": outcome.transfer}


def _chain(gw: Gateway, info: PromptInfo, usage: dict) -> dict:
    """The request's prompt as ``prefix-router fleetsim`` replays it, no text (``misses/request_log.py``)."""
    return {"blocks": keyed_blocks(info.hashes, gw.request_log.key), "block_size": gw.unit_block_size(info),
            "units": info.num_units, "completion_tokens": count(usage.get("completion_tokens"))}


def _log_with_evictions(gw: Gateway, inbound: Inbound, info: PromptInfo, outcome: Outcome, cached_blocks: int,
                        to_tokens: float, **fields) -> None:
    """The request's log line, with the tokens its replica's KV events showed evicted while it
    was in flight (``evicted_in_flight_tokens``). vLLM publishes a step's events and its answers
    at once, so a removal that made the engine's hit stop short of the prediction may reach the
    gateway after the answer: such a line (the engine hit fewer blocks than predicted, and the
    block where its hit stopped is not yet seen evicted) waits for that removal, at most
    ``kv_events.parity_grace_s``, stamped with the answer's time; it may then come after lines
    of later answers. Every other line is written at once."""
    view = outcome.view
    predicted_blocks = outcome.decision.predicted_blocks
    written = False

    def evicted() -> tuple[int, ...]:
        return view.evicted_since(info.hashes, predicted_blocks, outcome.removals)

    def write(blocks: tuple[int, ...] | None = None) -> None:
        nonlocal written
        if written:
            return
        written = True
        _log(gw, inbound, evicted_in_flight_tokens=evicted_in_flight_tokens(
            evicted() if blocks is None else blocks, cached_blocks, fields["predicted_cached_tokens"], to_tokens),
            **fields)

    if view is None or cached_blocks >= predicted_blocks:  # no block past the hit was predicted: none to explain
        write(())
        return
    blocks = evicted()
    if cached_blocks in blocks:
        write(blocks)
        return
    fields["t"] = round(time.time(), 6)
    task = asyncio.get_running_loop().create_task(
        _when(lambda: cached_blocks in evicted(), gw.config.kv_events.parity_grace_s, write))
    gw.waiting_lines[task] = write
    task.add_done_callback(lambda done: gw.waiting_lines.pop(done, None))


async def _when(ready: Callable[[], bool], grace_s: float, write: Callable[[], None]) -> None:
    """``write()`` once ``ready()``, or after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while not ready() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    write()


async def flush_waiting_lines(gw: Gateway) -> None:
    """Write every log line still waiting for events now (the gateway stops; the log closes next)."""
    waiting = dict(gw.waiting_lines)
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    for write in waiting.values():
        write()  # once: a line its task wrote is not written again


def _engine_hit(gw: Gateway, info: PromptInfo, usage: dict) -> tuple[int, int, int, float]:
    """The engine's ``usage`` in the gateway's blocks: (prompt tokens, cached tokens, cached
    blocks of ``info``'s, tokens per such block). Exact token blocks map one to one; character
    blocks (no tokenizer) scale by the prompt's characters per token."""
    details = usage.get("prompt_tokens_details")
    prompt_tokens = count(usage.get("prompt_tokens"))
    cached_tokens = min(count(details.get("cached_tokens")) if isinstance(details, dict) else 0, prompt_tokens)
    unit = gw.unit_block_size(info)
    scale = (info.num_units / prompt_tokens) if (not info.exact and prompt_tokens) else 1.0
    cached_blocks = int(cached_tokens * scale) // unit
    if not info.exact and cached_tokens:
        # Character blocks straddle the engine's token blocks: allow one block of rounding, or a
        # full hit reads as an eviction of its last block.
        cached_blocks = min(cached_blocks + 1, gw.max_hit_blocks(info))
    return prompt_tokens, cached_tokens, cached_blocks, (unit / scale if scale else unit)


def evicted_in_flight_tokens(evicted_blocks: tuple[int, ...], cached_blocks: int, predicted_tokens: int,
                             to_tokens: float) -> int:
    """Of the ``predicted_tokens`` a request was routed for, those the replica's KV events showed
    evicted while it waited to be scheduled: from the first block evicted in flight
    (``EngineView.evicted_since``, ascending indices) at or past ``cached_blocks``, where the
    engine's hit stopped, to the prediction's end. A block evicted and stored again before the
    request was scheduled (another request recomputed it), or evicted after it was (vLLM preempts
    a running request and frees its blocks), did not stop the hit and counts for nothing.
    ``to_tokens``: tokens per block. 0 when no such block."""
    stop = next((i for i in evicted_blocks if i >= cached_blocks), None)
    return 0 if stop is None else predicted_tokens - min(int(stop * to_tokens), predicted_tokens)


def _record_change(gw: Gateway, inbound: Inbound, info: PromptInfo, verdict: Verdict, previous,
                   to_tokens: float, lost: int):
    """For a miss_changed: what the client changed (``diagnosis.Change``), counted in the change
    sites with a redacted excerpt when ``changes.snippets`` is on; else None."""
    if verdict.result is not CacheResult.MISS_CHANGED:
        return None
    change = explain(previous.print, info.print, verdict.diverged_message)
    excerpt = (redacted_excerpt(inbound.prompt, change, gw.config.changes.snippet_chars)
               if gw.config.changes.snippets else None)
    gw.record_change(change, verdict.diverged_block, int(verdict.diverged_block * to_tokens), lost, excerpt)
    return change


def _remember_response(gw: Gateway, inbound: Inbound, outcome: Outcome) -> None:
    """A Responses answer's replica and, for a finished one vLLM stores, its history: the
    prompt's messages and the output (``responses.output_messages``), as vLLM's ``msg_store``
    and ``response_store`` give them to a request continuing it."""
    answer, history = outcome.answer, None
    if (answer is not None and inbound.body.get("store") is not False and inbound.prompt is not None
            and answer.get("status") in ("completed", "incomplete")):
        history = [*inbound.prompt["messages"], *output_messages(answer)]
    home = outcome.decode or outcome.replica  # a split request's Response is stored where it was decoded
    gw.response_homes.remember(outcome.response_id, home.name, history, owner=inbound.tenant)


def _log(gw: Gateway, inbound: Inbound, **fields) -> None:
    """One request-log line; with ``request_log_bodies`` also the path and the body sent (the
    chat request a Responses or Messages body is rendered as, which the audit can read)."""
    if gw.config.request_log_bodies:
        fields.update(path=inbound.path, body=inbound.prompt)
    gw.request_log.write(**fields)
