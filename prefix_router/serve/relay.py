"""Passing a replica's answer back to the client (``relay``): a body in one write, a stream as
its chunks arrive, in whole SSE lines, with the engine's final usage read on the way.

Per chunk the relay does no more than cut at the last newline, look for the usage event
(``UsageFilter``) and write; whatever has arrived goes out in one write, so a replica's burst
of events (or a backlog while this process was busy) costs one write, not two per event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from prefix_router.constants import REPLICA_HEADER
from prefix_router.errors import error_body
from prefix_router.serve.bodies import loads

__all__ = ["CLIENT_GONE", "Relayed", "UsageFilter", "relay"]

log = logging.getLogger(__name__)

CLIENT_GONE = 499  # nginx's status for a client that closed the connection before the answer ended
# bytes queued for a client above which a stream write is timed (limits.client_write_timeout_s);
# aiohttp pauses writing at 64 KiB, so below this the client is keeping up
_CLIENT_BUFFER_BYTES = 64 * 1024
_NOT_RELAYED = {"content-length", "content-encoding", "transfer-encoding", "connection", "keep-alive",
                "server", "date"}  # aiohttp sets its own


class _StreamResponse(web.StreamResponse):
    """A stream whose headers go out in one write with its first chunk, not in one of their own:
    a write (a send syscall, and a TCP segment on the wire) less a stream (its cost in
    ``docs/performance-notes.md``). ``relay`` prepares the response once the replica's first
    chunk is in hand, so the client sees no byte later.
    aiohttp's own ``web.Response`` buffers its headers the same way (``_send_headers_immediately``,
    aiohttp 3.11 and later; without it a stream's headers are written at once, as before)."""

    _send_headers_immediately = False


@dataclasses.dataclass(frozen=True, slots=True)
class Relayed:
    """What reached the client: the response, the status counted (``CLIENT_GONE`` when the client
    left, 502 for a stream the replica cut after it started), the engine's ``usage`` object when
    it sent one, the seconds from sending to the first token (None when none came), and the
    answer's JSON object when it was one body (a 200 not streamed), else None."""

    response: web.StreamResponse
    status: int
    usage: dict | None
    ttft_s: float | None
    answer: dict | None = None


class UsageFilter:
    """A replica's SSE stream, fed in chunks as they arrive, given back in whole lines.

    vLLM ends a stream that asked for ``stream_options.include_usage`` with one event whose
    ``choices`` is empty and whose ``usage`` carries ``cached_tokens``
    (``vllm/entrypoints/openai/chat_completion/serving.py``). The filter keeps that usage and,
    when the client did not ask for it, drops the event and its blank line. vLLM then also moves
    ``system_fingerprint`` from the terminal chunk (the one with a ``finish_reason``) to the
    usage event, so the filter holds a terminal chunk back until the next event and, when that
    is the usage event it drops, puts the fingerprint back where a client without usage finds
    it. A chunk without such events passes as it is (one bytes object per chunk, however many
    events it holds); a line cut between two chunks waits for its end.
    """

    __slots__ = ("keep_usage", "usage", "saw_data", "_tail", "_skip_blank", "_held")

    def __init__(self, keep_usage: bool) -> None:
        self.keep_usage = keep_usage
        self.usage: dict | None = None
        self.saw_data = False  # a data event (the first token's) has passed
        self._tail = b""  # a line not ended yet
        self._skip_blank = False  # a dropped usage event's blank line is still to come
        self._held: list[bytes] | None = None  # a terminal chunk's lines, until the next event

    @staticmethod
    def error_event(message: str) -> bytes:
        """The event that ends a stream the replica cut: an OpenAI-style error object."""
        return b"data: " + json.dumps(error_body(502, message)).encode() + b"\n\n"

    def feed(self, chunk: bytes) -> bytes:
        """The complete lines of ``self._tail + chunk`` to send, usage event filtered."""
        data = self._tail + chunk if self._tail else chunk
        cut = data.rfind(b"\n") + 1
        self._tail = data[cut:]
        return self._lines(data[:cut])

    def flush(self) -> bytes:
        """What is left when the stream ended: a held chunk, a last line without its newline."""
        data, self._tail = self._tail, b""
        out = self._lines(data)
        if self._held is not None:
            out, self._held = b"".join(self._held) + out, None
        return out

    def _lines(self, data: bytes) -> bytes:
        if not data:
            return data
        if not self.saw_data and b"data: {" in data:
            self.saw_data = True
        if (b'"usage":{' not in data and not self._skip_blank and self._held is None
                and (self.keep_usage or b'"finish_reason":"' not in data)):
            return data  # the common case: nothing to look at line by line
        out: list[bytes] = []
        parts = data.split(b"\n")  # SSE lines end in \n; a \r before it stays with its line
        for line in [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else []):
            blank = line in (b"\n", b"\r\n")
            if self._skip_blank and blank:
                self._skip_blank = False
                continue
            usage_line = line.startswith(b"data: {") and b'"usage":{' in line and b'"choices":[]' in line
            if self._held is not None:
                if blank:
                    self._held.append(line)
                    continue
                if not usage_line:
                    out += self._held
                    self._held = None
            if usage_line:
                try:
                    event = loads(line[6:])
                    self.usage = event.get("usage")
                except (ValueError, AttributeError):
                    event = None
                if not self.keep_usage:
                    self._skip_blank = True
                    if self._held is not None:
                        out += self._stamped(self._held, event)
                        self._held = None
                    continue
            elif not self.keep_usage and line.startswith(b"data: {") and b'"finish_reason":"' in line:
                self._held = [line]
                continue
            out.append(line)
        return b"".join(out)

    @staticmethod
    def _stamped(held: list[bytes], usage_event) -> list[bytes]:
        """The held terminal chunk with the usage event's ``system_fingerprint``, if it had one
        and the chunk has none."""
        fingerprint = usage_event.get("system_fingerprint") if isinstance(usage_event, dict) else None
        line = held[0]
        body = line.rstrip(b"\r\n")
        if not isinstance(fingerprint, str) or b'"system_fingerprint"' in line or not body.endswith(b"}"):
            return held
        patched = body[:-1] + b',"system_fingerprint":' + json.dumps(fingerprint).encode() + b"}" + line[len(body):]
        return [patched, *held[1:]]


async def relay(request: web.Request, upstream: aiohttp.ClientResponse, name: str, *, stream: bool,
                client_wants_usage: bool, write_timeout_s: float, sent_at: float,
                watch: Callable[[bytes], None] | None = None, events=None,
                on_first_token: Callable[[], None] | None = None) -> Relayed:
    """Pass ``upstream`` (replica ``name``'s answer, status below 500) to the client.

    ``stream``: the client asked for SSE; a non-200 answer is relayed whole either way.
    ``write_timeout_s``: how long a stream write may wait on a client that reads nothing.
    ``sent_at``: ``time.perf_counter()`` when the request was sent, for the TTFT.
    ``watch``: called with each chunk of a stream as it arrives (the passthrough reads a
    Responses stream's id with it). ``events``: what reads the stream on the way, a
    ``UsageFilter`` unless given (``responses.Events`` for Responses and Messages streams); its
    ``usage`` is the usage returned. ``on_first_token``: called once when a stream's first data
    event arrives (the replica finished the prompt's prefill); not for an answer in one body.
    Raises nothing for the client's side (a client that left is ``CLIENT_GONE``); a replica that
    fails mid-stream gets an error event in the stream and status 502. A stream's headers go to
    the client with its first chunk, so a replica that fails before it raises
    ``aiohttp.ClientError`` or ``asyncio.TimeoutError`` with nothing sent, and the caller retries.
    """
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_RELAYED}
    headers[REPLICA_HEADER] = name
    if not stream or upstream.status != 200:
        return await _relay_body(upstream, headers, sent_at)
    upstream_chunks = upstream.content.iter_any().__aiter__()
    try:  # the client's headers wait for the first chunk: a replica failing before it is retried
        first = await upstream_chunks.__anext__()
    except StopAsyncIteration:
        first = b""

    async def chunks():
        if first:
            yield first
        async for chunk in upstream_chunks:
            yield chunk

    response = _StreamResponse(status=200, headers={**headers, "Cache-Control": "no-cache"})
    try:
        await response.prepare(request)
    except ConnectionError:  # the client left while the replica was answering
        return Relayed(response, CLIENT_GONE, None, None)
    client = _Client(request, response, name, write_timeout_s)
    if events is None:
        events = UsageFilter(keep_usage=client_wants_usage)
    status, ttft = await _pump(chunks(), client, events, watch, sent_at, on_first_token)
    if status != CLIENT_GONE:
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
    return Relayed(response, status, events.usage, ttft)


async def _relay_body(upstream: aiohttp.ClientResponse, headers: dict, sent_at: float) -> Relayed:
    """An answer relayed in one write; a 200's JSON object read for its usage, its TTFT the
    whole answer's time (the first token arrives with the last)."""
    data = await upstream.read()
    usage = ttft = answer = None
    if upstream.status == 200:
        with contextlib.suppress(ValueError, RecursionError):
            answer = loads(data)
        if isinstance(answer, dict):
            usage = answer.get("usage")
        else:
            answer = None
        ttft = time.perf_counter() - sent_at
    return Relayed(web.Response(body=data, status=upstream.status, headers=headers), upstream.status, usage, ttft,
                   answer)


async def _pump(chunks, client: _Client, events, watch: Callable[[bytes], None] | None,
                sent_at: float, on_first_token: Callable[[], None] | None = None) -> tuple[int, float | None]:
    """Pass a started stream's ``chunks`` through ``events`` to ``client``: (the status counted,
    the seconds from ``sent_at`` to the first data event or None). A replica that fails here
    gets an error event sent after what already reached the client (no retry: 502)."""
    status, ttft = 200, None
    try:
        async for chunk in chunks:
            if watch is not None:
                watch(chunk)
            data = events.feed(chunk)
            if ttft is None and events.saw_data:
                ttft = time.perf_counter() - sent_at
                if on_first_token is not None:
                    on_first_token()
            if data and not await client.send(data):
                return CLIENT_GONE, ttft
        data = events.flush()
        if data and not await client.send(data):
            status = CLIENT_GONE
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        log.warning("stream from %s ended early: %s", client.name, type(exc).__name__)
        message = f"replica {client.name} stopped streaming ({type(exc).__name__})"
        status = 502 if await client.send(events.error_event(message)) else CLIENT_GONE
    return status, ttft


class _Client:
    """Writes to a streaming client that may stop reading or leave."""

    __slots__ = ("transport", "response", "name", "timeout_s")

    def __init__(self, request: web.Request, response: web.StreamResponse, name: str, timeout_s: float) -> None:
        self.transport = request.transport
        self.response = response
        self.name = name
        self.timeout_s = timeout_s

    async def send(self, data: bytes) -> bool:
        """Write to the client; False when it left or read nothing for the write timeout (the
        connection is then aborted: leaving the upstream context closes it, and the engine aborts)."""
        transport = self.transport
        try:
            if transport is not None and transport.get_write_buffer_size() > _CLIENT_BUFFER_BYTES:
                async with asyncio.timeout(self.timeout_s):  # not reading: wait, but not forever
                    await self.response.write(data)
            else:
                await self.response.write(data)
            return True
        except TimeoutError:
            log.warning("client of a stream from %s read nothing for %g s; closing it", self.name, self.timeout_s)
            transport.abort()
        except ConnectionError:  # the client went away (aiohttp's ClientConnectionResetError)
            pass
        return False
