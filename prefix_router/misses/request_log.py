"""The optional request log: one JSON line per finished request, for audits and tests.

Off by default (``request_log`` in the configuration names the file). Each line holds what the
gateway decided and what the engine reported, never prompt text: ``t`` (Unix seconds),
``replica``, ``route`` (affinity, sticky, balance, spill, fallback, retry: ``policy.Route``),
``status``, ``prompt_tokens``, ``cached_tokens`` (the engine's
``prompt_tokens_details.cached_tokens``),
``predicted_cached_tokens`` (what the gateway believed the replica held), ``predicted_offload_tokens``
(of those, what it loads from a CPU or storage tier, by medium; only where some are),
``evicted_in_flight_tokens`` (of those, the ones the replica's KV events showed evicted while the
request waited: they were held when it was routed, and the engine recomputed them), ``result`` (hit or a
miss kind, see ``misses/classify.py``), ``lost_tokens``, ``cause``, ``diverged_message`` and
``diverged_token`` (for ``miss_changed``: ``misses/diagnosis.py``), ``conversation`` (a 64-bit hash of the
conversation id, so the session key itself stays out), ``ttft_s`` and ``elapsed_s``. In a
disaggregated fleet also ``decode_replica`` and ``transfer`` (``serve/disagg.py``), ``replica`` and
the cache fields being the prefill replica's where the request was split.

With ``request_log_bodies`` on (an operator's choice: prompt text), each line also holds
``path`` and ``body``, the request as sent to the replica (for ``/v1/responses`` and
``/v1/messages``, the chat request vLLM renders from it, history included: ``prompts/responses.py``):
``prefix-router audit``, ``prefix-router gate`` and ``replay`` read such a log.

With ``request_log_blocks`` on, each served request's line also holds ``blocks``: its prompt's
chain of block hashes, each re-hashed with a keyed BLAKE2b (``keyed_blocks``), the key from the
environment variable ``PREFIX_ROUTER_REQUEST_LOG_KEY`` (a secret of at least 16 characters; a
random one for the process when unset, so chains of two runs do not meet), with ``block_size``
and ``units`` (the prompt's tokens, or
characters without a tokenizer) and ``completion_tokens``. The gateway's own hashes are of token
ids under a seed anyone can compute, so a guessed prompt could be checked against them; keyed,
equal prefixes still give equal leading entries, which is all ``prefix-router fleetsim`` needs to
replay the traffic on a fleet of any size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Sequence

import xxhash

__all__ = ["KEY_ENV", "RequestLog", "conversation_tag", "keyed_blocks", "log_key"]

KEY_ENV = "PREFIX_ROUTER_REQUEST_LOG_KEY"

log = logging.getLogger(__name__)


def conversation_tag(conversation: str) -> str | None:
    """A conversation id as 16 hex digits (xxh3-64), or None for no conversation."""
    return xxhash.xxh3_64_hexdigest(conversation.encode("utf-8", "surrogatepass")) if conversation else None


def log_key() -> bytes:
    """The key of ``keyed_blocks``: ``PREFIX_ROUTER_REQUEST_LOG_KEY``'s UTF-8 bytes (at least 16
    characters; one over 64 bytes is hashed down to 64), else 32 random bytes. Raises ValueError
    for a shorter key: a short secret can be guessed, and with it every prompt."""
    value = os.environ.get(KEY_ENV)
    if value is None or not value.strip():
        log.warning("%s is not set: the request log's block chains are keyed at random for this process, so "
                    "they meet no other process's or run's (set one secret for every gateway process)", KEY_ENV)
        return secrets.token_bytes(32)
    if len(value.strip()) < 16:
        raise ValueError(f"{KEY_ENV} must be a secret of at least 16 characters")
    key = value.strip().encode("utf-8", "surrogatepass")
    return key if len(key) <= 64 else hashlib.blake2b(key).digest()


def keyed_blocks(hashes: Sequence[int], key: bytes) -> list[str]:
    """Each block hash under a keyed BLAKE2b (a MAC: without the key no guessed prompt can be
    checked against it, however many of a log's entries are known), 16 hex digits each: chained
    as the hashes are, so equal prefixes give equal leading entries."""
    return [hashlib.blake2b(h.to_bytes(8, "little"), digest_size=8, key=key).hexdigest() for h in hashes]


class RequestLog:
    """Appends JSON lines to ``path`` (line buffered: each line is on disk when the request ends).

    Raises ``OSError`` when the file cannot be opened, ``ValueError`` when ``blocks`` is on and
    ``PREFIX_ROUTER_REQUEST_LOG_KEY`` is too short.
    """

    def __init__(self, path: str, blocks: bool = False) -> None:
        self.path = path
        self.key = log_key() if blocks else None  # of ``keyed_blocks``, with ``request_log_blocks`` on
        self._file = open(path, "a", buffering=1, encoding="utf-8")

    def write(self, **fields) -> None:
        """One request's line; ``t`` is added."""
        self._file.write(json.dumps({"t": round(time.time(), 6), **fields}, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
