"""Which replica holds each stored Response (``ResponseHomes``), so its later requests find it.

vLLM keeps a Response created by ``POST /v1/responses`` (``store`` is true by default) in that
replica's memory (``vllm/entrypoints/openai/responses/serving.py``: ``response_store``, a dict in
the server process): ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and a new
request naming it as ``previous_response_id`` succeed only on that replica; any other answers 404.
The gateway remembers the replica of every response id it relayed, newest first, bounded, and,
for a response it routed by prefix (``proxy.py``), the chat messages vLLM stored with it and its
output: a later request naming it as ``previous_response_id`` is rendered, as vLLM renders it,
from those (``responses.responses_prompt``).

Under tenants a Response belongs to the tenant that created it: vLLM would serve it to anyone
who names its id, so the gateway remembers each id's tenant and answers 404 to any other
(``owned_by``). An id this gateway process never relayed has no known owner and is 404 to every
tenant (with ``--workers N`` each worker knows the ids it relayed itself).
"""

from __future__ import annotations

import re
from collections import OrderedDict

__all__ = ["ResponseHomes", "response_id_of_stream"]

# the first event of a Responses stream is ``response.created``, whose ``response`` object
# carries the id (``resp_`` and hex digits in vLLM 0.32: ``random_uuid``)
_STREAM_ID = re.compile(rb'"response"\s*:\s*\{\s*"id"\s*:\s*"([^"\\]{1,200})"')


def response_id_of_stream(data: bytes) -> str | None:
    """The response id in a Responses SSE chunk (its ``response.created`` event), else None."""
    match = _STREAM_ID.search(data)
    return match.group(1).decode("utf-8", "replace") if match else None


def _history_chars(history: tuple[dict, ...]) -> int:
    """What a history is charged: its messages' text, plus 100 characters a message."""
    return sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or "")) + 100 for m in history)


class ResponseHomes:
    """Response id -> replica name, at most ``capacity`` ids (least recently used dropped first),
    and the histories of some of them within ``history_chars``.

    About 160 bytes an entry: 91 for the ordered dict's slot (measured with tracemalloc over
    100,000 ids) and about 70 for a ``resp_`` id of 32 hex digits, so 100,000 ids take about 16 MB.
    Each history is charged its whole length (``_history_chars``) although consecutive turns of
    one conversation share their message objects, so the memory they take stays below the
    budget; the least recently used histories are dropped first (their ids stay).
    Raises ``ValueError`` for a capacity or budget below 1.
    """

    def __init__(self, capacity: int = 100_000, history_chars: int = 64_000_000) -> None:
        if capacity < 1 or history_chars < 1:
            raise ValueError("capacity and history_chars must be at least 1")
        self.capacity = capacity
        self.history_chars = history_chars
        self._homes: OrderedDict[str, str] = OrderedDict()
        self._owners: dict[str, str] = {}  # response id -> tenant, for ids created under tenants
        self._histories: OrderedDict[str, tuple[tuple[dict, ...], int]] = OrderedDict()
        self._charged = 0

    def __len__(self) -> int:
        return len(self._homes)

    def remember(self, response_id: str, replica: str, history: list[dict] | None = None,
                 owner: str | None = None) -> None:
        """``response_id`` was created on ``replica``; ``history``: the chat messages a request
        continuing it starts with (its prompt's messages, then its output as assistant messages);
        ``owner``: the tenant that created it (kept from its first sighting: a later one cannot
        claim it)."""
        self._homes[response_id] = replica
        self._homes.move_to_end(response_id)
        if owner is not None:
            self._owners.setdefault(response_id, owner)
        while len(self._homes) > self.capacity:
            dropped, _ = self._homes.popitem(last=False)
            self._owners.pop(dropped, None)
            self._drop_history(dropped)
        if history is not None:
            self._drop_history(response_id)
            kept = tuple(history)
            cost = _history_chars(kept)
            if cost <= self.history_chars:
                self._histories[response_id] = (kept, cost)
                self._charged += cost
            while self._charged > self.history_chars:
                self._drop_history(next(iter(self._histories)))

    def history(self, response_id: str) -> list[dict] | None:
        """The history remembered with ``response_id``, or None."""
        entry = self._histories.get(response_id)
        if entry is None:
            return None
        self._histories.move_to_end(response_id)
        return list(entry[0])

    def _drop_history(self, response_id: str) -> None:
        entry = self._histories.pop(response_id, None)
        if entry is not None:
            self._charged -= entry[1]

    def owned_by(self, response_id: str, tenant: str) -> bool:
        """Whether ``tenant`` created ``response_id`` (as far as this process saw)."""
        return self._owners.get(response_id) == tenant

    def home(self, response_id: str) -> str | None:
        """The replica holding ``response_id``, or None when this gateway never saw it."""
        replica = self._homes.get(response_id)
        if replica is not None:
            self._homes.move_to_end(response_id)
        return replica
