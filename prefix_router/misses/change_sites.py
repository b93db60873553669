"""The gateway's record of why clients changed their prefixes: ``GET /debug/changes``.

Every ``miss_changed`` (see ``misses/classify.py``) is diagnosed by ``diagnosis.diagnose`` against
the conversation's previous request and recorded here under its site: (cause, message index,
role, the gateway's block where the prompts diverged). The site shows the token position of
the first change recorded there: without a tokenizer a position is an estimate from characters,
and one break estimated a token apart in each request is still one site. Counts and lost tokens accumulate per site; at most
``changes.max_sites`` sites are kept (later new sites are still counted in ``by_cause`` and in
``prefix_router_changed_total{cause}``), so memory is bounded whatever clients send. Each site
knows when it was last seen (``latest``: the status page's list).

A site holds no prompt text: the detail names tools (API identifiers) and message counts. With
``changes.snippets`` on, a site also keeps a redacted excerpt of the changed message
(``redacted_excerpt``), the first one seen there.
"""

from __future__ import annotations

import heapq
import re
import time
from dataclasses import dataclass

from prefix_router.misses.diagnosis import FIXES, VOLATILE, Cause, Change, tool_name

__all__ = ["ChangeSites", "Site", "redacted_excerpt"]

# Masked in excerpts besides the volatile spans: e-mail addresses and key-like strings (20+
# letters, digits, '-' or '_' with a digit among them: API keys, tokens, hashes).
_EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_KEYLIKE = re.compile(r"\b(?=[\w-]*\d)[\w-]{20,}\b")


@dataclass(slots=True)
class Site:
    """One divergence site and what it cost."""

    cause: Cause
    message_index: int  # -1: the tool list
    role: str
    token_position: int  # tokens before the divergence (estimated from characters without a tokenizer)
    count: int = 0
    lost_tokens: int = 0
    detail: str = ""  # the latest change's detail
    excerpt: str | None = None
    last_seen: float = 0.0  # monotonic s of the latest change recorded here
    seq: int = 0  # the table's count of changes recorded when this site's latest was: orders by recency

    def as_dict(self) -> dict:
        out = {"cause": self.cause.value, "message_index": self.message_index, "role": self.role,
               "token_position": self.token_position, "count": self.count, "lost_tokens": self.lost_tokens,
               "detail": self.detail, "fix": FIXES[self.cause]}
        if self.excerpt is not None:
            out["excerpt"] = self.excerpt
        return out


def redacted_excerpt(body: dict, change: Change, chars: int) -> str | None:
    """At most ``chars`` characters of the changed message of ``body`` (the new request), with
    dates, times, ids, numbers, e-mail addresses and key-like strings masked as ``#``, ``<email>``
    and ``<key>``. For a volatile value, the lines that held one (where the change is); else the
    message's first lines. The tool list's excerpt is its tool names. None when there is no text."""
    if change.message_index == -1:
        tools = body.get("tools") if isinstance(body.get("tools"), list) else []
        names = [tool_name(t) for t in tools]
        return ", ".join(names)[:chars] or None
    messages = body.get("messages")
    if not isinstance(messages, list):
        messages = [{"content": body.get("prompt")}]
    if not 0 <= change.message_index < len(messages) or not isinstance(messages[change.message_index], dict):
        return None
    content = messages[change.message_index].get("content")
    if not isinstance(content, str):
        return None
    lines = content[: chars * 64].splitlines()  # bounded work on a huge message
    if change.cause is Cause.VOLATILE_VALUE:
        lines = [line for line in lines if VOLATILE.search(line)] or lines
    text = " | ".join(line.strip() for line in lines if line.strip())
    text = _KEYLIKE.sub("<key>", _EMAIL.sub("<email>", text))
    return VOLATILE.sub("#", text)[:chars] or None


class ChangeSites:
    """Counts of prefix changes by cause and by site, at most ``max_sites`` sites."""

    def __init__(self, max_sites: int = 1000) -> None:
        self.max_sites = max_sites
        self.sites: dict[tuple[Cause, int, str, int], Site] = {}
        self.by_cause: dict[Cause, list[int]] = {cause: [0, 0] for cause in Cause}  # [count, lost tokens]
        self.recorded = 0  # changes recorded, every cause

    def __len__(self) -> int:
        return len(self.sites)

    def record(self, change: Change, token_position: int, lost_tokens: int, excerpt: str | None = None, *,
               block: int | None = None) -> Site | None:
        """Count one change at ``block`` (the gateway's block index of the divergence; the token
        position when not given); returns its site, or None when the site table is full and new."""
        totals = self.by_cause[change.cause]
        totals[0] += 1
        totals[1] += lost_tokens
        key = (change.cause, change.message_index, change.role, token_position if block is None else block)
        self.recorded += 1
        site = self.sites.get(key)
        if site is None:
            if len(self.sites) >= self.max_sites:
                return None
            site = self.sites[key] = Site(change.cause, change.message_index, change.role, token_position,
                                          excerpt=excerpt)
        site.last_seen, site.seq = time.monotonic(), self.recorded
        site.count += 1
        site.lost_tokens += lost_tokens
        site.detail = change.detail
        return site

    def top(self, n: int = 20) -> list[Site]:
        """The ``n`` sites that lost the most tokens (then the most frequent)."""
        return sorted(self.sites.values(), key=lambda s: (-s.lost_tokens, -s.count))[:n]

    def latest(self, n: int = 10) -> list[Site]:
        """The ``n`` sites where a change was recorded last, the latest first."""
        return heapq.nlargest(n, self.sites.values(), key=lambda s: s.seq)

    def view(self, n: int = 20) -> dict:
        """The ``/debug/changes`` document."""
        return {
            "by_cause": {cause.value: {"count": c, "lost_tokens": lost, "fix": FIXES[cause]}
                         for cause, (c, lost) in self.by_cause.items()},
            "sites": [site.as_dict() for site in self.top(n)],
            "sites_kept": len(self.sites), "max_sites": self.max_sites,
        }
