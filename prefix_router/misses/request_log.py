"""The optional request log: one JSON line per finished request, for audits and tests.

Off by default (``request_log`` in the configuration names the file). Each line holds what the
gateway decided and what the engine reported, never prompt text: ``t`` (Unix seconds),
``replica``, ``route`` (affinity, sticky, balance, spill, fallback, retry: ``policy.Route``),
``status``, ``prompt_tokens``, ``cached_tokens`` (the engine's
``prompt_tokens_details.cached_tokens``),
``predicted_cached_tokens`` (what the gateway believed the replica held),
``evicted_in_flight_tokens`` (of those, the ones the replica's KV events showed evicted while the
request waited: they were held when it was routed, and the engine recomputed them), ``result`` (hit or a
miss kind, see ``misses/classify.py``), ``lost_tokens``, ``cause``, ``diverged_message`` and
``diverged_token`` (for ``miss_changed``: ``misses/diagnosis.py``), ``conversation`` (a 64-bit hash of the
conversation id, so the session key itself stays out), ``ttft_s`` and ``elapsed_s``.

With ``request_log_bodies`` on (an operator's choice: prompt text), each line also holds
``path`` and ``body``, the request as sent to the replica (for ``/v1/responses`` and
``/v1/messages``, the chat request vLLM renders from it, history included: ``prompts/responses.py``):
``prefix-router audit``, ``prefix-router gate`` and ``replay`` read such a log.
"""

from __future__ import annotations

import json
import time

import xxhash

__all__ = ["RequestLog", "conversation_tag"]


def conversation_tag(conversation: str) -> str | None:
    """A conversation id as 16 hex digits (xxh3-64), or None for no conversation."""
    return xxhash.xxh3_64_hexdigest(conversation.encode("utf-8", "surrogatepass")) if conversation else None


class RequestLog:
    """Appends JSON lines to ``path`` (line buffered: each line is on disk when the request ends).

    Raises ``OSError`` when the file cannot be opened.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1, encoding="utf-8")

    def write(self, **fields) -> None:
        """One request's line; ``t`` is added."""
        self._file.write(json.dumps({"t": round(time.time(), 6), **fields}, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
