"""Why a client's prefix changed: name the cause of a ``miss_changed`` from two requests.

A conversation's previous request and its new one are compared through fingerprints, never
their text, so the gateway can keep them per conversation (a few integers a message) and the
same code serves the offline audit. For every message: a hash of its raw content, a hash with
volatile spans masked (dates, times, UUIDs, long hex ids, numbers), and a hash of its JSON
content re-serialised with sorted keys and normalised numbers; for the tool list: one hash per
tool and the tools' names (names are the API's identifiers, not prompt text).

``diagnose`` finds the first place the new request departs from the previous one and names:

- ``tools_changed``: the tool list differs: reordered, filtered (some removed) or edited;
- ``volatile_value``: the first changed message is identical once dates, times, ids and
  counters are masked (a timestamp or request id in the system prompt);
- ``key_order``: it is the same JSON once keys are sorted and numbers normalised;
- ``inserted_before_history``: new messages sit before messages the previous request had
  (retrieval results or memory injected after the system prompt);
- ``history_rewritten``: an earlier message was edited, removed or summarised in place;
- ``other``: anything else (a different system prompt, a new conversation under an old id).

The fix for each, in one line, is ``FIXES[cause]``.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

__all__ = ["Cause", "FIXES", "MessagePrint", "RequestPrint", "Change", "fingerprint", "diagnose"]


class Cause(str, enum.Enum):
    """The ``cause`` label of ``prefix_router_changed_total``."""

    VOLATILE_VALUE = "volatile_value"
    TOOLS_CHANGED = "tools_changed"
    KEY_ORDER = "key_order"
    HISTORY_REWRITTEN = "history_rewritten"
    INSERTED_BEFORE_HISTORY = "inserted_before_history"
    OTHER = "other"


FIXES = {
    Cause.VOLATILE_VALUE: "move the timestamp or id out of the prefix, into the latest user message",
    Cause.TOOLS_CHANGED: "send the full tool list in a fixed order; refuse forbidden tools when they are called",
    Cause.KEY_ORDER: "serialise JSON with sorted keys and one number format (json.dumps(obj, sort_keys=True))",
    Cause.HISTORY_REWRITTEN: "compress history once and append after it, instead of trimming or editing it every turn",
    Cause.INSERTED_BEFORE_HISTORY: "put retrieved text and memory after the history, in the latest user message",
    Cause.OTHER: "keep every earlier message byte for byte as it was sent",
}

# Spans that change between requests without changing meaning. Order matters: UUIDs and ISO
# timestamps before the bare numbers inside them.
_VOLATILE = re.compile(
    r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"  # UUID
    r"|\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"  # ISO date/time
    r"|\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp][Mm])?"  # clock time
    r"|\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{12,}\b"  # long hex id with digits and letters
    r"|\d+(?:\.\d+)?")  # counters, epoch seconds, any number


def _hash(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))


def _text(content) -> str:
    """Message content as text: a string as it is, parts and anything else as JSON."""
    return content if isinstance(content, str) else json.dumps(content, sort_keys=False, default=str)


def _canonical(text: str) -> str | None:
    """JSON text with sorted keys and numbers as floats; None when ``text`` is not a JSON object or array."""
    stripped = text.strip()
    if not stripped or stripped[0] not in "[{":
        return None
    try:
        value = json.loads(stripped, parse_int=float)
    except (ValueError, RecursionError):
        return None
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class MessagePrint:
    """One message: its role and three hashes of its content and tool calls."""

    role: str
    raw: int  # as sent
    masked: int  # dates, times, ids and numbers replaced by one placeholder
    canonical: int  # JSON (content, tool-call arguments) with sorted keys and float numbers


@dataclass(frozen=True, slots=True)
class RequestPrint:
    """A request's tool list (names and one hash each, in order) and messages."""

    tool_names: tuple[str, ...]
    tool_hashes: tuple[int, ...]
    messages: tuple[MessagePrint, ...]


def _canonical_calls(calls) -> str:
    """Tool calls with their JSON ``arguments`` strings parsed, serialised with sorted keys."""
    out = []
    for call in calls if isinstance(calls, list) else [calls]:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            args = _canonical(function["arguments"])
            if args is not None:
                call = {**call, "function": {**function, "arguments": json.loads(args)}}
        out.append(call)
    return json.dumps(out, sort_keys=True, default=str)


def _message_print(message) -> MessagePrint:
    role = str(message.get("role")) if isinstance(message, dict) else "?"
    content = _text(message.get("content") if isinstance(message, dict) else message)
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    raw = content + ("\x00" + _text(calls) if calls else "")
    canonical = (_canonical(content) or content) + ("\x00" + _canonical_calls(calls) if calls else "")
    return MessagePrint(role, _hash(role + "\x00" + raw), _hash(role + "\x00" + _VOLATILE.sub("#", raw)),
                        _hash(role + "\x00" + canonical))


def fingerprint(body: dict) -> RequestPrint:
    """The fingerprint of a chat request body (a completion's ``prompt`` counts as one message)."""
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    names = tuple(str(((t.get("function") or {}).get("name") if isinstance(t, dict) else None) or "?")[:64]
                  for t in tools)
    hashes = tuple(_hash(json.dumps(t, sort_keys=True, default=str)) for t in tools)
    messages = body.get("messages")
    if not isinstance(messages, list):
        messages = [{"role": "prompt", "content": body.get("prompt")}]
    return RequestPrint(names, hashes, tuple(_message_print(m) for m in messages))


@dataclass(frozen=True, slots=True)
class Change:
    """Where and why a request departed from the previous one of its conversation."""

    cause: Cause
    message_index: int  # -1: the tool list
    role: str  # of the previous request's message there ("tools" for the tool list)
    detail: str  # no prompt text: tool names, message counts

    @property
    def fix(self) -> str:
        return FIXES[self.cause]


def _tools_change(prev: RequestPrint, new: RequestPrint) -> Change | None:
    if prev.tool_hashes == new.tool_hashes:
        return None
    old, now = dict(zip(prev.tool_hashes, prev.tool_names)), dict(zip(new.tool_hashes, new.tool_names))
    if set(old) == set(now):
        detail = "reordered"
    elif set(now) < set(old):
        detail = "filtered: removed " + ", ".join(sorted(old[h] for h in set(old) - set(now)))
    else:
        edited = sorted({now[h] for h in set(now) - set(old)})
        detail = "edited or added: " + ", ".join(edited)
    return Change(Cause.TOOLS_CHANGED, -1, "tools", detail)


def _index(prints: Sequence[MessagePrint], raw: int, start: int) -> int | None:
    return next((j for j in range(start, len(prints)) if prints[j].raw == raw), None)


def diagnose(prev: RequestPrint, new: RequestPrint) -> Change | None:
    """The first departure of ``new`` from ``prev`` inside what ``prev`` sent, or None when
    ``new`` only appends to it."""
    tools = _tools_change(prev, new)
    if tools is not None:
        return tools
    p, n = prev.messages, new.messages
    i = next((k for k in range(min(len(p), len(n))) if p[k].raw != n[k].raw), None)
    if i is None:
        if len(n) >= len(p):
            return None
        return Change(Cause.HISTORY_REWRITTEN, len(n), p[len(n)].role,
                      f"the last {len(p) - len(n)} messages were removed")
    old, now = p[i], n[i]
    if old.masked == now.masked:
        return Change(Cause.VOLATILE_VALUE, i, old.role, "only dates, times, ids or numbers changed")
    if old.canonical == now.canonical:
        return Change(Cause.KEY_ORDER, i, old.role, "the same JSON with another key order or number format")
    later = _index(n, old.raw, i + 1)
    if later is not None:
        return Change(Cause.INSERTED_BEFORE_HISTORY, i, old.role, f"{later - i} messages inserted before it")
    # the previous request's message i is gone or changed; is the rest of its history still there?
    kept = [k for k in range(i + 1, len(p)) if _index(n, p[k].raw, i) is not None]
    if kept:
        removed = sum(1 for k in range(i, kept[0]) if _index(n, p[k].raw, i) is None)
        return Change(Cause.HISTORY_REWRITTEN, i, old.role,
                      f"{removed} earlier messages edited, removed or summarised; {len(kept)} later ones kept")
    if i + 1 >= len(p) and old.role == now.role and i > 0:
        return Change(Cause.HISTORY_REWRITTEN, i, old.role, "the last message sent was edited")
    return Change(Cause.OTHER, i, old.role, "the text differs and none of the later history is kept")
