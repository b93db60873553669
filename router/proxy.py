"""The OpenAI-compatible proxy: route, forward, stream back, then learn from the engine's usage.

Per request (``handle_generate``):

1. Read and check the body (413 above ``limits.max_body_bytes``, OpenAI-style 400 for bad JSON).
2. ``prompts.analyze`` in a worker thread (tokenization and chat templates never block the
   event loop), a wait in the admission queue when every replica is saturated
   (``admission.py``), then ``policy.select`` on the routable replicas.
3. Forward to the chosen replica with the client's headers (Authorization included). Streaming
   requests get ``stream_options.include_usage`` so the engine reports ``cached_tokens``; when
   the client did not ask for it, that usage chunk is dropped on the way back. Connect errors,
   5xx answers and header timeouts go to the next ring candidate while nothing has reached
   the client, and each attempt's outcome goes to the replica's circuit breaker.
4. Stream SSE back as it arrives (whole lines, a chunk a write), with ``x-prefix-router-replica`` naming the
   replica. Then classify the cache outcome, update the shadow index, branch statistics and
   conversation memory, check the replica's KV events showed the prompt's blocks
   (``cacheview.check_parity``), count everything in ``GatewayMetrics`` and, when configured,
   write the request's line to the request log (``requestlog.py``).

Routing reads each replica's cache as its KV events report it while they are fresh
(``ReplicaState.cache_index``), else the shadow index; both count a request's blocks from the
moment it is sent.

In-flight slots are released in ``finally``, so errors and client disconnects free them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time

import aiohttp
import orjson
from aiohttp import web

from .admission import QueueFull, QueueTimeout
from .breaker import BreakerState
from .causes import explain, fingerprint
from .cacheview import check_parity
from .changes import redacted_excerpt
from .conversations import CacheResult, Conversation, classify
from .errors import error_body, openai_error
from .gateway import Gateway
from .kvevents import EngineView
from .policy import Decision, ReplicaView, Route
from .prompts import PromptInfo, analyze, check_body
from .requestlog import conversation_tag

__all__ = ["handle_generate", "REPLICA_HEADER"]

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-prefix-router-replica"
# bytes queued for a client above which a stream write is timed (limits.client_write_timeout_s);
# aiohttp pauses writing at 64 KiB, so below this the client is keeping up
_CLIENT_BUFFER_BYTES = 64 * 1024
_CLIENT_GONE = 499  # nginx's status for a client that closed the connection before the answer ended
_NOT_RELAYED = {"content-length", "content-encoding", "transfer-encoding", "connection", "keep-alive",
                "server", "date"}  # aiohttp sets its own
# Not forwarded: hop-by-hop headers, and Content-Encoding, since aiohttp hands the handler the
# decompressed body (a gzip header on a plain body made replicas answer 500)
_HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
               "proxy-authorization", "proxy-connection", "te", "trailer", "accept-encoding", "content-encoding"}


async def _read_raw(request: web.Request, limit: int) -> bytes | web.Response:
    if request.content_length is not None and request.content_length > limit:
        return openai_error(413, f"request body of {request.content_length} bytes exceeds the limit of {limit}")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        return openai_error(413, f"request body exceeds the limit of {limit} bytes")
    except (web.RequestPayloadError, aiohttp.http_exceptions.HttpProcessingError) as exc:
        # e.g. Content-Encoding: gzip on a body that is not gzip
        return openai_error(400, f"request body could not be read ({type(exc).__name__})", "body")


def _loads(data: bytes):
    """JSON from bytes: orjson, or Python's json for what orjson refuses and it takes (lone
    surrogates, NaN and Infinity, as vLLM writes a -inf logprob). Raises ValueError or
    RecursionError for what neither takes, with the standard parser's message."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def _parse(raw: bytes) -> dict | web.Response:
    try:
        body = _loads(raw)
    except (ValueError, RecursionError) as exc:
        return openai_error(400, f"JSON decode error: {str(exc)[:200]}", "body")
    if not isinstance(body, dict):
        return openai_error(400, "request body must be a JSON object", "body")
    return body


def _patched(raw: bytes, body: dict, extra: dict) -> bytes:
    """The client's body with the ``extra`` top-level keys set (usage reporting, a tenant's salt).

    When none of them is in the body, they are spliced in front of the client's bytes (no
    re-serialisation of a prompt that may be megabytes); otherwise the body is re-encoded.
    """
    if not extra:
        return raw
    stripped = raw.lstrip()
    if body and stripped.startswith(b"{") and not any(k in body for k in extra):
        return b"{" + json.dumps(extra, separators=(",", ":"))[1:-1].encode() + b"," + stripped[1:]
    return json.dumps({**body, **extra}).encode()


def _session_key(request: web.Request, body: dict, gw: Gateway) -> str | None:
    key = request.headers.get(gw.config.routing.session_header)
    if key:
        return key[:256]
    user = body.get("user")
    if gw.config.routing.use_user_field and isinstance(user, str) and user:
        return "user:" + user[:256]
    return None


def _forward_headers(request: web.Request, gw: Gateway) -> dict[str, str]:
    """The client's headers, less hop-by-hop ones. Under tenants the client's Authorization (a
    tenant key) is dropped, so replicas never see it; the HTTP session then sends
    ``auth.upstream_api_key`` when one is configured (``app.create_app``)."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
    if gw.tenants.enabled:
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
    return headers


async def handle_generate(request: web.Request, gw: Gateway, path: str, chat: bool) -> web.StreamResponse:
    """``POST /v1/completions`` and ``/v1/chat/completions``: read, route, forward."""
    tenant = None
    if gw.tenants.enabled:
        tenant = gw.tenants.tenant_of(request)
        if tenant is None:
            return openai_error(401, "missing or unknown API key (Authorization: Bearer KEY)", type_="AuthenticationError")
    raw = await _read_raw(request, gw.config.limits.max_body_bytes)
    if isinstance(raw, web.Response):
        return raw
    body = _parse(raw)
    if isinstance(body, web.Response):
        return body
    problem = check_body(body, chat)
    if problem is not None:
        return openai_error(400, *problem)
    if not any(r.routable for r in gw.replicas.values()):
        return openai_error(503, "no healthy replica", type_="ServiceUnavailableError")
    stream = body.get("stream") is True
    options = body.get("stream_options")
    client_wants_usage = isinstance(options, dict) and options.get("include_usage") is True
    extra: dict = {}
    if stream and not client_wants_usage:  # the engine reports cached_tokens; dropped on the way back
        extra["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_cache_report_mode" in xargs:
        # "full" makes vLLM publish BlockStored again for every block a request reuses, with no
        # BlockRemoved to match: the events every gateway reads would hold those blocks forever
        extra["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_cache_report_mode"}
    session = _session_key(request, body, gw)
    if tenant is not None:
        salt = gw.tenants.salt(tenant, body.get("cache_salt"))
        if body.get("cache_salt") != salt:
            extra["cache_salt"] = salt
        if session is not None:
            session = f"{tenant.name}:{session}"  # tenants' session ids never meet
    payload = _patched(raw, body, extra)
    body.update(extra)  # what the replica sees is what routing hashes (the salt seeds the blocks)
    if len(raw) <= gw.config.limits.inline_analysis_bytes:
        info = _analyze(gw, body, chat, session)
    else:
        info = await asyncio.get_running_loop().run_in_executor(gw.executor, _analyze, gw, body, chat, session)
    if gw.config.log_prompts:  # an operator's explicit choice (off by default)
        log.info("request conversation=%s units=%d body=%.500r", info.conversation, info.num_units, raw)
    rejected = await _admit(gw)
    if rejected is not None:
        return rejected
    now = time.monotonic()
    half_life = gw.config.routing.share_half_life_s
    healthy = {r.name: ReplicaView(r.name, r.routing_load, r.cache_index(info.exact), r.recent_share(now, half_life))
               for r in gw.replicas.values() if r.routable}
    if not healthy:
        return openai_error(503, "no healthy replica", type_="ServiceUnavailableError")
    started = time.perf_counter()
    key = session or (info.opening if gw.config.routing.chat_opening_key else None)
    decision = gw.policy.select(info.hashes, info.full_hash, healthy, key, gw.max_hit_blocks(info))
    gw.metrics.routing_seconds.observe(time.perf_counter() - started)
    gw.branches.record(info.hashes, gw.config.routing.max_key_blocks)
    gw.demand.record(info.hashes, gw.config.routing.max_key_blocks, now)
    upstream_request = _Upstream(path, payload, {**_forward_headers(request, gw), "Content-Type": "application/json"},
                                 stream, client_wants_usage, body)
    return await _forward(request, gw, decision, info, upstream_request)


def _analyze(gw: Gateway, body: dict, chat: bool, session: str | None) -> PromptInfo:
    """``prompts.analyze``, plus the fingerprint ``causes.diagnose`` needs when the request
    belongs to a conversation (built on the previous one's, so only new messages cost).
    Runs on the event loop, or in a worker thread for big bodies (``limits.inline_analysis_bytes``)."""
    info = analyze(body, chat, gw.tokenizer, gw.block_size, gw.config.routing.char_block_size, session)
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


@dataclasses.dataclass(frozen=True, slots=True)
class _Upstream:
    """What is sent to a replica, whichever replica it is."""

    path: str
    payload: bytes
    headers: dict[str, str]
    stream: bool
    client_wants_usage: bool
    body: dict  # as parsed (and patched): for the request log's bodies and change excerpts


async def _forward(request: web.Request, gw: Gateway, decision: Decision, info: PromptInfo,
                   up: _Upstream) -> web.StreamResponse:
    """Try the decision's candidates in order until one answers below 500 (retries bounded).

    A streaming attempt gets ``upstream.header_timeout_s`` for the replica's response headers.
    Each attempt's outcome goes to the replica's circuit breaker (router/breaker.py), except
    what says nothing of the replica: a client that left, and a 5xx that no replica got past.
    A replica that answered 5xx is blamed only once another replica served the same request:
    a request every replica refuses is the request's fault, so a client cannot open breakers
    by sending requests that make replicas fail.
    """
    last_error = "no replica answered"
    header_timeout = gw.config.upstream.header_timeout_s if up.stream else None
    answered_5xx = []  # replicas to blame if a later one serves the request
    for name in decision.candidates[: gw.config.upstream.max_retries + 1]:
        replica = gw.replicas.get(name)
        if replica is None or not replica.breaker.allows(time.monotonic()):
            continue  # dropped by discovery, or its breaker opened, while an earlier attempt ran
        sent_at = time.monotonic()
        replica.breaker.on_send(sent_at)
        replica.note_sent(sent_at, gw.config.routing.share_half_life_s)
        replica.sent_since_scrape += 1
        gw.admission.notify()  # this request's load is counted: the next waiter, if any, may go
        epoch = replica.scrape_epoch
        replica.inflight += 1
        gw.metrics.inflight.labels(name).set(replica.inflight)
        if name != decision.replica:
            decision = _retarget(decision, name)
        held = min(replica.cache_index(info.exact).match_ever(info.hashes), gw.max_hit_blocks(info))
        decision = dataclasses.replace(decision, held_blocks=held)
        # vLLM makes blocks hittable as soon as they are scheduled: count them at once, so a
        # burst of one prefix sees it; take back what this attempt added if it fails.
        added = replica.shadow.insert(info.hashes)
        view = replica.stream.view if replica.stream is not None and info.exact else None
        watch = (view, view.note_routed(info.hashes)) if view is not None else None
        t0 = time.perf_counter()
        outcome: bool | None = None  # None: says nothing of the replica (cancelled, client gone, 5xx)
        try:
            upstream = await asyncio.wait_for(
                gw.http.post(replica.url + up.path, data=up.payload, headers=up.headers), header_timeout)
            async with upstream:
                if upstream.status < 500:
                    response, status = await _relay(request, gw, upstream, name, decision, info, up, t0, watch)
                    if status == 200 and info.exact:
                        check_parity(gw, replica, info.hashes, sent_at)
                    if status != _CLIENT_GONE:
                        outcome = status != 502  # 502: the replica cut the stream
                    if outcome:
                        for earlier in answered_5xx:
                            _breaker_record(gw, earlier, False)
                    return response
                last_error = f"replica {name} answered {upstream.status}"
                code = str(upstream.status)
                answered_5xx.append(replica)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # client-side writes never raise here
            last_error = f"replica {name}: {type(exc).__name__}"
            code = "0"
            outcome = False
            log.warning("upstream %s failed (%s)", name, type(exc).__name__)
        finally:
            if replica.scrape_epoch == epoch:
                replica.sent_since_scrape = max(replica.sent_since_scrape - 1, 0)
            replica.inflight -= 1
            gw.metrics.inflight.labels(name).set(replica.inflight)
            gw.admission.notify()
            if outcome is None:
                replica.breaker.release_trial()  # a half-open breaker may try again
            else:
                _breaker_record(gw, replica, outcome)
            if view is not None:
                view.release_routed(info.hashes, time.monotonic(), served=outcome is True)
        replica.shadow.forget(added)
        gw.metrics.requests.labels(name, decision.route.value, code).inc()
    return openai_error(502, last_error, type_="BadGatewayError")


def _breaker_record(gw: Gateway, replica, ok: bool) -> None:
    """One attempt's outcome to the replica's breaker; log and export a change of state."""
    changed = replica.breaker.record(ok, time.monotonic())
    if changed is BreakerState.OPEN:
        log.warning("replica %s: circuit breaker open after %d consecutive failed requests; no requests for %.0f s",
                    replica.name, replica.breaker.failures, replica.breaker.cooldown_s)
    elif changed is BreakerState.CLOSED:
        log.info("replica %s: circuit breaker closed (a trial request succeeded)", replica.name)
    if changed is not None:
        gw.metrics.breaker_state.labels(replica.name).set(changed)


def _retarget(decision: Decision, name: str) -> Decision:
    """The decision after a retry moved the request to ``name`` (counted as a fallback)."""
    return dataclasses.replace(decision, replica=name, route=Route.FALLBACK, spilled_from=None,
                               predicted_blocks=decision.matches.get(name, 0))


class _UsageFilter:
    """A replica's SSE stream, fed in chunks as they arrive, given back in whole lines.

    vLLM ends a stream that asked for ``stream_options.include_usage`` with one event whose
    ``choices`` is empty and whose ``usage`` carries ``cached_tokens``
    (``vllm/entrypoints/openai/serving_chat.py``). The filter keeps that usage and, when the
    client did not ask for it, drops the event and its blank line. A chunk without such an
    event passes as it is (one bytes object per chunk, however many events it holds); a line
    cut between two chunks waits for its end.
    """

    __slots__ = ("keep_usage", "usage", "saw_data", "_tail", "_skip_blank")

    def __init__(self, keep_usage: bool) -> None:
        self.keep_usage = keep_usage
        self.usage: dict | None = None
        self.saw_data = False  # a data event (the first token's) has passed
        self._tail = b""  # a line not ended yet
        self._skip_blank = False  # a dropped usage event's blank line is still to come

    def feed(self, chunk: bytes) -> bytes:
        """The complete lines of ``self._tail + chunk`` to send, usage event filtered."""
        data = self._tail + chunk if self._tail else chunk
        cut = data.rfind(b"\n") + 1
        self._tail = data[cut:]
        return self._lines(data[:cut])

    def flush(self) -> bytes:
        """What is left when the stream ended: a last line without its newline."""
        data, self._tail = self._tail, b""
        return self._lines(data)

    def _lines(self, data: bytes) -> bytes:
        if not data:
            return data
        if not self.saw_data and b"data: {" in data:
            self.saw_data = True
        if b'"usage":{' not in data and not self._skip_blank:
            return data  # the common case: nothing to look at line by line
        out = []
        parts = data.split(b"\n")  # SSE lines end in \n; a \r before it stays with its line
        for line in [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else []):
            if self._skip_blank and line in (b"\n", b"\r\n"):
                self._skip_blank = False
                continue
            if line.startswith(b"data: {") and b'"usage":{' in line and b'"choices":[]' in line:
                try:
                    self.usage = _loads(line[6:]).get("usage")
                except (ValueError, AttributeError):
                    pass
                if not self.keep_usage:
                    self._skip_blank = True
                    continue
            out.append(line)
        return b"".join(out)


async def _relay(request, gw: Gateway, upstream: aiohttp.ClientResponse, name: str, decision: Decision,
                 info: PromptInfo, up: _Upstream, t0: float,
                 watch: tuple[EngineView, int] | None) -> tuple[web.StreamResponse, int]:
    """Pass the replica's answer to the client (streams chunk by chunk as they arrive, in whole
    lines), then account for it. ``watch``: the replica's event view and ``note_routed``'s answer.
    Returns the response and the status counted (502 for a stream cut after it started)."""
    usage = None
    ttft = None
    status = upstream.status
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_RELAYED}
    headers[REPLICA_HEADER] = name
    if not up.stream or upstream.status != 200:
        data = await upstream.read()
        if upstream.status == 200:
            try:
                usage = _loads(data).get("usage")
            except (ValueError, AttributeError):
                usage = None
            ttft = time.perf_counter() - t0
        response = web.Response(body=data, status=upstream.status, headers=headers)
    else:
        response = web.StreamResponse(status=200, headers={**headers, "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
        except ConnectionError:  # the client left while the replica was answering
            return response, _CLIENT_GONE
        transport = request.transport
        write_timeout = gw.config.limits.client_write_timeout_s

        async def send(data: bytes) -> bool:
            """Write to the client; False when it left or read nothing for the write timeout."""
            try:
                if transport is not None and transport.get_write_buffer_size() > _CLIENT_BUFFER_BYTES:
                    async with asyncio.timeout(write_timeout):  # not reading: wait, but not forever
                        await response.write(data)
                else:
                    await response.write(data)
                return True
            except TimeoutError:
                log.warning("client of a stream from %s read nothing for %g s; closing it", name, write_timeout)
                transport.abort()  # leaving the upstream context closes it: the engine aborts
            except ConnectionError:  # the client went away (aiohttp's ClientConnectionResetError)
                pass
            return False

        events = _UsageFilter(keep_usage=up.client_wants_usage)
        try:
            # Whatever has arrived goes out in one write: a replica's burst of events (or a
            # backlog while this process was busy) costs one write, not two per event.
            async for chunk in upstream.content.iter_any():
                data = events.feed(chunk)
                if ttft is None and events.saw_data:
                    ttft = time.perf_counter() - t0
                if data and not await send(data):
                    status = _CLIENT_GONE
                    break
            else:
                data = events.flush()
                if data and not await send(data):
                    status = _CLIENT_GONE
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # Bytes already reached the client: no retry; end the stream with an error event.
            log.warning("stream from %s ended early: %s", name, type(exc).__name__)
            error = error_body(502, f"replica {name} stopped streaming ({type(exc).__name__})")
            status = 502 if await send(b"data: " + json.dumps(error).encode() + b"\n\n") else _CLIENT_GONE
        usage = events.usage
        if status != _CLIENT_GONE:
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
    _account(gw, name, decision, info, up, status, usage, ttft, time.perf_counter() - t0, watch)
    return response, status


def _account(gw: Gateway, name: str, decision: Decision, info: PromptInfo, up: _Upstream, status: int,
              usage: dict | None, ttft: float | None, elapsed: float,
              watch: tuple[EngineView, int] | None = None) -> None:
    m = gw.metrics
    m.requests.labels(name, decision.route.value, str(status)).inc()
    if decision.route is Route.SPILL and decision.spilled_from:
        m.spillovers.labels(decision.spilled_from, name).inc()
    if ttft is not None:
        m.ttft.labels(name).observe(ttft)
    m.request_seconds.labels(name).observe(elapsed)
    if status != 200 or not usage:
        if gw.request_log is not None:
            _log(gw, up, replica=name, route=decision.route.value, status=status, ttft_s=ttft,
                 elapsed_s=round(elapsed, 6), conversation=conversation_tag(info.conversation))
        return
    prompt_tokens = int(usage.get("prompt_tokens") or 0)
    cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    unit = gw.unit_block_size(info)
    scale = (info.num_units / prompt_tokens) if (not info.exact and prompt_tokens) else 1.0
    cached_blocks = int(cached_tokens * scale) // unit
    if not info.exact and cached_tokens:
        # Character blocks straddle the engine's token blocks: allow one block of rounding, or a
        # full hit reads as an eviction of its last block.
        cached_blocks = min(cached_blocks + 1, gw.max_hit_blocks(info))
    to_tokens = unit / scale if scale else unit
    gw.replicas[name].shadow.add_output(int(usage.get("completion_tokens") or 0) // gw.block_size, info.hashes)
    m.prompt_tokens.labels(name).inc(prompt_tokens)
    m.cached.labels(name).inc(cached_tokens)
    predicted = min(int(decision.predicted_blocks * to_tokens), prompt_tokens)
    m.cached_predicted.labels(name).inc(predicted)
    conversation = info.conversation  # "" for a completion without a session key: see prompts.py
    previous = gw.conversations.get(conversation) if conversation else None
    verdict = classify(hashes=info.hashes, message_hashes=info.message_hashes, previous=previous,
                       cached_blocks=cached_blocks, predicted_blocks=decision.predicted_blocks,
                       best_blocks=decision.best_blocks, max_hit_blocks=gw.max_hit_blocks(info),
                       block_size=1, held_blocks=decision.held_blocks)
    m.cache_requests.labels(name, verdict.result.value).inc()
    lost = int(verdict.lost_tokens * to_tokens)
    if verdict.lost_tokens:
        m.lost_tokens.labels(name, verdict.result.value.removeprefix("miss_")).inc(lost)
    change = None
    if verdict.result is CacheResult.MISS_CHANGED:
        change = explain(previous.print, info.print, verdict.diverged_message)
        excerpt = (redacted_excerpt(up.body, change, gw.config.changes.snippet_chars)
                   if gw.config.changes.snippets else None)
        gw.record_change(change, int(verdict.diverged_block * to_tokens), lost, excerpt)
    if conversation:
        gw.conversations.put(conversation, Conversation.of(info.hashes, info.message_hashes, info.print))
    if gw.request_log is not None:
        evicted = 0  # predicted tokens the engine evicted while the request waited to be scheduled
        if watch is not None:
            first = watch[0].first_evicted(info.hashes, decision.predicted_blocks, watch[1])
            if first is not None:
                evicted = predicted - min(int(first * to_tokens), predicted)
        _log(gw, up, replica=name, route=decision.route.value, status=status, prompt_tokens=prompt_tokens,
             cached_tokens=cached_tokens, predicted_cached_tokens=predicted, evicted_in_flight_tokens=evicted,
             result=verdict.result.value,
             lost_tokens=lost, cause=change.cause.value if change else None,
             diverged_message=change.message_index if change else None,
             diverged_token=int(verdict.diverged_block * to_tokens) if change else None,
             conversation=conversation_tag(conversation), spilled_from=decision.spilled_from,
             ttft_s=ttft, elapsed_s=round(elapsed, 6))


def _log(gw: Gateway, up: _Upstream, **fields) -> None:
    """One request-log line; with ``request_log_bodies`` also the path and the body sent."""
    if gw.config.request_log_bodies:
        fields.update(path=up.path, body=up.body)
    gw.request_log.write(**fields)
