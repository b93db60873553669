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
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

__all__ = ["Cause", "FIXES", "VOLATILE", "MessagePrint", "RequestPrint", "Change", "digest", "fingerprint", "diagnose", "explain"]


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
# timestamps before the bare numbers inside them. Every alternative starts with a digit or a hex
# letter, and the leading lookahead says so: sre then rejects every other position with one test
# instead of five, about half the time (docs/performance-notes.md); the tests hold it equal to
# the pattern without it.
VOLATILE_SPANS = (
    r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"  # UUID
    r"|\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"  # ISO date/time
    r"|\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp][Mm])?"  # clock time
    r"|\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{12,}\b"  # long hex id with digits and letters
    r"|\d+(?:\.\d+)?")  # counters, epoch seconds, any number
VOLATILE = re.compile(r"(?=[\da-fA-F])(?:" + VOLATILE_SPANS + ")")
# Characters of new message text one request's fingerprint masks and parses as JSON: the
# regular expression and the parser hold the GIL, so one hostile message of 30 MB held the event
# loop for seconds (bench/results/hostile-bodies/README.md, the text rows). Text past it is hashed as
# it is: a change there reads as a rewrite, not as a volatile value or a reordering. Real turns
# add far less (an agent's tool output is tens of KB).
PRINT_BUDGET_CHARS = 256 * 1024


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


def digest(value) -> int:
    """A stable 64-bit hash of one message (or the tool list): a plain ``{role, content}`` message
    hashes its text as it is, anything else its JSON, so long messages are not re-serialised.
    The gateway's per-message hashes (``analysis.PromptInfo.message_hashes``) are these."""
    if isinstance(value, dict) and isinstance(value.get("content"), str) and len(value) == 2 and "role" in value:
        return xxhash.xxh3_64_intdigest(value["content"].encode("utf-8", "surrogatepass"),
                                        xxhash.xxh3_64_intdigest(str(value["role"]).encode("utf-8", "surrogatepass")))
    return xxhash.xxh3_64_intdigest(json.dumps(value, separators=(",", ":"), default=str).encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class MessagePrint:
    """One message: its role and three hashes of its content and tool calls."""

    role: str
    raw: int  # ``digest`` of the message as sent
    masked: int  # dates, times, ids and numbers replaced by one placeholder
    canonical: int  # JSON (content, tool-call arguments) with sorted keys and float numbers


@dataclass(frozen=True, slots=True)
class RequestPrint:
    """A request's tool list (names and one hash each, in order) and its messages' hashes.

    Kept per conversation by the gateway, so compact: three ``array("Q")`` of one hash per
    message and a tuple of interned roles, about 32 bytes a message.
    """

    tool_names: tuple[str, ...]
    tool_hashes: tuple[int, ...]
    roles: tuple[str, ...]
    raw: array
    masked: array
    canonical: array
    tools_digest: int = 0  # ``digest`` of the tool list, to reuse the tool hashes while it stays

    def __len__(self) -> int:
        return len(self.raw)

    def message(self, i: int) -> MessagePrint:
        return MessagePrint(self.roles[i], self.raw[i], self.masked[i], self.canonical[i])


def tool_name(tool) -> str:
    """A tool's ``function.name`` (at most 64 characters), "?" when the tool has none."""
    function = tool.get("function") if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return str(name or "?")[:64]


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


def _masked_and_canonical(role: str, message, budget: int) -> tuple[int, int, int]:
    """(masked hash, canonical hash, characters of ``budget`` spent). A message longer than
    ``budget`` characters is hashed as it is for both (``PRINT_BUDGET_CHARS``)."""
    if not isinstance(message, dict):
        text = _text(message)
        if len(text) > budget:
            h = _hash(role + "\x00" + text)
            return h, h, 0
        return _hash(role + "\x00" + VOLATILE.sub("#", text)), _hash(role + "\x00" + (_canonical(text) or text)), len(text)
    content = message.get("content")
    if isinstance(content, list) and content and all(isinstance(t, int) for t in content[:8]):
        h = digest(message)  # a token-id prompt: no text to mask
        return h, h, 0
    content = _text(content)
    calls = message.get("tool_calls")
    raw = content + ("\x00" + _text(calls) if calls else "")
    if len(raw) > budget:
        h = _hash(role + "\x00" + raw)
        return h, h, 0
    canonical = (_canonical(content) or content) + ("\x00" + _canonical_calls(calls) if calls else "")
    return _hash(role + "\x00" + VOLATILE.sub("#", raw)), _hash(role + "\x00" + canonical), len(raw)


def fingerprint(body: dict, previous: RequestPrint | None = None,
                digests: Sequence[int] | None = None) -> RequestPrint:
    """The fingerprint of a chat request body (a completion's ``prompt`` counts as one message).

    With ``previous`` (the conversation's last print), messages it already had (same ``digest``)
    reuse its masked and canonical hashes, and an unchanged tool list its tool hashes, so a turn
    costs the regular-expression and JSON work of what is new only. ``digests``: the request's
    ``digest`` of its tool list then of each message, when the caller has them
    (``analysis.PromptInfo.message_hashes``). New messages are masked and parsed up to
    ``PRINT_BUDGET_CHARS`` in all; later ones are hashed as they are.
    """
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    messages = body.get("messages")
    if not isinstance(messages, list):
        messages = [{"role": "prompt", "content": body.get("prompt")}]
        digests = None
    if digests is None or len(digests) != len(messages) + 1:
        digests = (digest(body.get("tools")), *(digest(m) for m in messages))
    if previous is not None and previous.tools_digest == digests[0] and len(previous.tool_names) == len(tools):
        names, tool_hashes = previous.tool_names, previous.tool_hashes
    else:
        names = tuple(tool_name(t) for t in tools)
        tool_hashes = tuple(_hash(json.dumps(t, sort_keys=True, default=str)) for t in tools)
    known = {} if previous is None else {
        h: (m, c) for h, m, c in zip(previous.raw, previous.masked, previous.canonical)}
    roles, raw, masked, canonical = [], array("Q"), array("Q"), array("Q")
    budget = PRINT_BUDGET_CHARS
    for message, h in zip(messages, digests[1:]):
        role = sys.intern(str(message.get("role"))[:32] if isinstance(message, dict) else "?")
        if h in known:
            m, c = known[h]
        else:
            m, c, spent = _masked_and_canonical(role, message, budget)
            budget -= spent
        roles.append(role)
        raw.append(h)
        masked.append(m)
        canonical.append(c)
    return RequestPrint(names, tool_hashes, tuple(roles), raw, masked, canonical, digests[0])


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


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def diagnose(prev: RequestPrint, new: RequestPrint) -> Change | None:
    """The first departure of ``new`` from ``prev`` inside what ``prev`` sent, or None when
    ``new`` only appends to it."""
    tools = _tools_change(prev, new)
    if tools is not None:
        return tools
    p, n = prev.raw, new.raw
    i = next((k for k in range(min(len(p), len(n))) if p[k] != n[k]), None)
    if i is None:
        if len(n) >= len(p):
            return None
        return Change(Cause.HISTORY_REWRITTEN, len(n), prev.roles[len(n)],
                      f"the last {_count(len(p) - len(n), 'message')} removed")
    old, now = prev.message(i), new.message(i)
    if old.masked == now.masked:
        return Change(Cause.VOLATILE_VALUE, i, old.role, "only dates, times, ids or numbers changed")
    if old.canonical == now.canonical:
        return Change(Cause.KEY_ORDER, i, old.role, "the same JSON with another key order or number format")
    where: dict[int, int] = {}  # message hash -> its first index in ``new`` from i on
    for j in range(len(n) - 1, i - 1, -1):
        where[n[j]] = j
    if where.get(old.raw, i) > i:
        return Change(Cause.INSERTED_BEFORE_HISTORY, i, old.role, _count(where[old.raw] - i, "message") + " inserted before it")
    # the previous request's message i is gone or changed; is the rest of its history still there?
    kept = [k for k in range(i + 1, len(p)) if p[k] in where]
    if kept:
        removed = sum(1 for k in range(i, kept[0]) if p[k] not in where)
        return Change(Cause.HISTORY_REWRITTEN, i, old.role,
                      f"{_count(removed, 'earlier message')} edited, removed or summarised; {len(kept)} later kept")
    if i + 1 >= len(p) and old.role == now.role and i > 0:
        return Change(Cause.HISTORY_REWRITTEN, i, old.role, "the last message sent was edited")
    return Change(Cause.OTHER, i, old.role, "the text differs and none of the later history is kept")


def explain(prev: RequestPrint | None, new: RequestPrint | None, message_index: int | None) -> Change:
    """``diagnose`` for a request whose token blocks are known to depart from the previous
    request's inside what it sent (a ``miss_changed``): never None. When the messages and tools
    are the same, something outside them changed (model, cache salt, chat template options):
    ``other`` at ``message_index`` (the first differing message hash, if known)."""
    change = diagnose(prev, new) if prev is not None and new is not None else None
    if change is None:
        change = Change(Cause.OTHER, message_index if message_index is not None else 0, "request",
                        "messages and tools unchanged: model, cache salt or chat template options changed")
    return change
