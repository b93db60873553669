"""A client's body within bounds: its bytes by a deadline, its JSON by its shape, its head cheaply.

A body costs the gateway more than its bytes once it is parsed: 30 MB of ``[],`` parse to ten
million empty lists, about 1 GB, and hold the event loop for seconds (JSON parsers hold the GIL,
so a thread does not help). So every body is bounded three ways before it is materialised:

- bytes: ``limits.max_body_bytes``, by Content-Length and while reading (413), and again after
  a gzip or deflate body is inflated (``inflate``: the application reads bodies as they came,
  ``create_app`` turns aiohttp's own decompression off, which inflated a 200 KB gzip bomb to
  ~250 MB before any check);
- time: ``limits.body_timeout_s`` from the headers to the body's last byte (408), so a client
  sending one byte every few seconds cannot hold a connection and its buffer open for ever;
- shape: ``limits.max_json_elements``, an upper bound on the values a body holds, counted
  before parsing (``elements_bound``), so what a body parses to stays within a small multiple
  of its bytes (413).

A passthrough request needs only a few top-level keys of its body (``model``, a cache salt it
may carry): ``head_of`` reads them with msgspec, which skips every other value without building
it. Every error is OpenAI-style JSON (``errors.openai_error``).
"""

from __future__ import annotations

import asyncio
import json
import zlib
from typing import Any

import aiohttp
import msgspec
import orjson
from aiohttp import web

from prefix_router.config import LimitsConfig
from prefix_router.errors import openai_error

__all__ = ["Head", "elements_bound", "head_of", "inflate", "loads", "parse", "read_body", "shape_refusal"]

MAX_MEMBERS = 8  # gzip members read from one body (clients send one); each copies the rest of the body
# Content-Encoding: zlib's window bits (gzip's header; zlib's, else raw deflate, as aiohttp reads it)
_WBITS = {"gzip": (16 + zlib.MAX_WBITS,), "x-gzip": (16 + zlib.MAX_WBITS,), "deflate": (zlib.MAX_WBITS, -zlib.MAX_WBITS)}


async def read_body(request: web.Request, limits: LimitsConfig) -> bytes | web.Response:
    """The whole body, or the error to answer: 413 past ``max_body_bytes`` (by Content-Length
    before reading, else while reading: aiohttp's ``client_max_size``), 408 when it has not
    arrived ``body_timeout_s`` after the headers, 400 when it cannot be read (a broken
    Content-Encoding), 415 for an encoding other than gzip or deflate. A gzip or deflate body
    comes back inflated (``inflate``). A 408 or 413 closes the connection: the rest of the body
    is not read."""
    limit = limits.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        return _closing(openai_error(413, f"request body of {request.content_length} bytes exceeds the limit of {limit}"))
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in _WBITS and encoding not in ("identity", ""):
        return openai_error(415, f"Content-Encoding {encoding[:40]!r} is not read here (gzip, deflate or none)",
                            type_="UnsupportedMediaTypeError")
    try:
        async with asyncio.timeout(limits.body_timeout_s):  # not wait_for: no task of its own a request
            raw = await request.read()
        return inflate(raw, encoding, limit) if encoding in _WBITS else raw
    except asyncio.TimeoutError:
        return _closing(openai_error(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                                     type_="RequestTimeoutError"))
    except web.HTTPRequestEntityTooLarge:
        return _closing(openai_error(413, f"request body exceeds the limit of {limit} bytes"))
    except (web.RequestPayloadError, aiohttp.http_exceptions.HttpProcessingError) as exc:
        # e.g. Content-Encoding: gzip on a body that is not gzip
        return openai_error(400, f"request body could not be read ({type(exc).__name__})", "body")


def inflate(raw: bytes, encoding: str, limit: int) -> bytes | web.Response:
    """``raw`` decompressed (``encoding``: gzip or deflate; up to MAX_MEMBERS gzip members one
    after another, as RFC 1952 allows), never past ``limit`` bytes: the 413 past it, the 400 for
    data that is not what the encoding says, or for more members (each costs a Python step: a
    body of empty members would hold the loop)."""
    for wbits in _WBITS[encoding]:
        out, rest, members = bytearray(), raw, 0
        try:
            while rest:
                members += 1
                if members > MAX_MEMBERS:
                    raise zlib.error("too many members")
                inflater = zlib.decompressobj(wbits)
                out += inflater.decompress(rest, limit + 1 - len(out))
                if len(out) > limit or inflater.unconsumed_tail:
                    return _closing(openai_error(413, f"request body exceeds the limit of {limit} bytes once "
                                                      f"decompressed ({encoding})"))
                if not inflater.eof:
                    raise zlib.error("truncated")
                rest = inflater.unused_data
            return bytes(out)
        except zlib.error:
            continue
    return openai_error(400, f"request body could not be read (not {encoding} data)", "body")


def _closing(response: web.Response) -> web.Response:
    response.force_close()
    return response


def elements_bound(raw: bytes) -> int:
    """An upper bound on the JSON values in ``raw``: every value but the first of an array or
    object follows a comma, and every array or object opens with a bracket or brace, so values
    <= commas + brackets + braces + 1 (those inside strings count too: the bound is loose for
    text full of commas). Three ``bytes.count`` passes over the body, in C; none for a body
    shorter than the limit it is checked against (see ``shape_refusal``)."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1


def shape_refusal(raw: bytes, limits: LimitsConfig) -> web.Response | None:
    """The 413 for a body that may hold more than ``limits.max_json_elements`` values, else None.
    A body of fewer bytes than the limit cannot (each value takes a byte at least): not counted."""
    cap = limits.max_json_elements
    if len(raw) <= cap:
        return None
    bound = elements_bound(raw)
    if bound <= cap:
        return None
    return _closing(openai_error(
        413, f"request body holds up to {bound} JSON values (commas, brackets and braces), over the limit of {cap} "
             f"(limits.max_json_elements)", "body"))


def loads(data: bytes) -> Any:
    """JSON from bytes: orjson, or Python's json for what orjson refuses and it takes (lone
    surrogates, NaN and Infinity, as vLLM writes a -inf logprob). Raises ValueError or
    RecursionError for what neither takes, with the standard parser's message. orjson reads
    integers beyond 64 bits as floats: no field vLLM takes holds one (a seed is int64)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def parse(raw: bytes, limits: LimitsConfig) -> dict | web.Response:
    """The body as a JSON object, or the error to answer: 413 (``shape_refusal``), 400 (not
    JSON, nested too deeply, not an object)."""
    refused = shape_refusal(raw, limits)
    if refused is not None:
        return refused
    try:
        body = loads(raw)
    except RecursionError:  # orjson reads 1,024 levels; Python's own JSON fewer
        return openai_error(400, "request body is nested too deeply", "body")
    except ValueError as exc:
        return openai_error(400, f"JSON decode error: {str(exc)[:200]}", "body")
    if not isinstance(body, dict):
        return openai_error(400, "request body must be a JSON object", "body")
    return body


class Head(msgspec.Struct):
    """The top-level keys a passthrough request is sorted, routed and isolated by; other keys
    are skipped without being built. ``msgspec.UNSET`` where absent, None where JSON null:
    ``get`` reads both as None, ``sent`` tells them apart."""

    model: Any = msgspec.UNSET
    cache_salt: Any = msgspec.UNSET
    previous_response_id: Any = msgspec.UNSET
    vllm_xargs: Any = msgspec.UNSET
    request_id: Any = msgspec.UNSET
    kv_transfer_params: Any = msgspec.UNSET
    ec_transfer_params: Any = msgspec.UNSET
    sampling_params: Any = msgspec.UNSET  # /inference/v1/generate's, where extra_args reach the engine

    def get(self, key: str) -> Any:
        """The value of ``key``, None when absent (as ``dict.get``)."""
        value = getattr(self, key, None)
        return None if value is msgspec.UNSET else value

    def sent(self) -> set[str]:
        """The keys the body holds, null ones included."""
        return {f for f in self.__struct_fields__ if getattr(self, f) is not msgspec.UNSET}


_HEAD = msgspec.json.Decoder(Head)


def head_of(raw: bytes) -> Head | None:
    """The ``Head`` of a JSON object body; None when ``raw`` is not one (not JSON, not an
    object, or what msgspec refuses: NaN, lone surrogates). msgspec validates the whole text
    but builds only the values of ``Head``'s fields."""
    try:
        return _HEAD.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
