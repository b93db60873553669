"""The periodic INFO summary line: what the last interval looked like, in the log an operator
already reads, every ``summary_interval_s`` seconds (``GatewayConfig``; 0: none).

One line an interval, from two of the status page's snapshots (``status_page.snapshot``: the
figures of ``/metrics``) taken an interval apart, so every count is the interval's own:

    summary 60 s: 412 requests, token hit rate 81.3% (predicted 80.9%); hit 371, miss_cold 12,
    miss_changed 9, miss_routed 4, miss_evicted 16; 4/4 routable; replicas: vllm-0 118 req 84.0% q1, ...

Replicas are listed busiest first, at most ``MAX_REPLICAS`` of them (the rest counted), each with
its requests, token hit rate (cached over prompt tokens the engine reported) and queue depth. No
prompt text: the figures are counts.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from prefix_router.serve.status_page import snapshot

if TYPE_CHECKING:
    from prefix_router.gateway import Gateway

__all__ = ["MAX_REPLICAS", "summary_line", "log_summaries"]

log = logging.getLogger("prefix_router.summary")

MAX_REPLICAS = 8  # replicas named on the line; a fleet of 256 would make it unreadable
_FIGURES = ("requests", "prompt_tokens", "cached_tokens", "predicted_tokens")  # a replica's counts


def _rate(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _since(row: dict, old: dict | None) -> dict:
    """A replica's counts over the interval: ``row`` less ``old`` (its row a snapshot before; None:
    new since), ``{figure: n, "outcomes": {result: n}}``. A count below its old value was reset (the
    replica left discovery, its series were forgotten, and it came back under the same name): all
    of ``row`` is the interval's then, as Prometheus's ``increase()`` reads a reset."""
    old = old or {}
    was = old.get("outcomes", {})
    if any(row[k] < old.get(k, 0.0) for k in _FIGURES) or any(row["outcomes"].get(k, 0.0) < n for k, n in was.items()):
        old, was = {}, {}
    return {**{k: row[k] - old.get(k, 0.0) for k in _FIGURES},
            "outcomes": {k: n - was.get(k, 0.0) for k, n in row["outcomes"].items()}}


def summary_line(before: dict | None, now: dict, interval_s: float) -> str:
    """The line for the interval between two snapshots (``before`` None: since start). Counts are
    per replica (``_since``), so a replica forgotten since ``before`` takes none of its counts off the
    interval's, and one that came back counts from 0."""
    old = {r["name"]: r for r in (before or {}).get("replicas", [])}
    rows = [(r["name"], r["queue_depth"], _since(r, old.get(r["name"]))) for r in now["replicas"]]
    total = {k: sum(d[k] for _, _, d in rows) for k in _FIGURES}
    outcomes = ", ".join(f"{o['result']} {int(sum(d['outcomes'].get(o['result'], 0.0) for _, _, d in rows))}"
                         for o in now["outcomes"])
    line = (f"summary {interval_s:g} s: {int(total['requests'])} requests, token hit rate "
            f"{_rate(total['cached_tokens'], total['prompt_tokens'])} (predicted "
            f"{_rate(total['predicted_tokens'], total['prompt_tokens'])}); {outcomes}; "
            f"{now['routable']}/{now['known']} routable")
    busy = sorted((r for r in rows if r[2]["requests"]), key=lambda r: -r[2]["requests"])
    if busy:
        named = [f"{name} {int(d['requests'])} req {_rate(d['cached_tokens'], d['prompt_tokens'])}"
                 + (f" q{queue:g}" if queue is not None else "") for name, queue, d in busy[:MAX_REPLICAS]]
        more = f", {len(busy) - MAX_REPLICAS} more" if len(busy) > MAX_REPLICAS else ""
        line += "; replicas: " + ", ".join(named) + more
    return line


async def log_summaries(gw: Gateway, interval_s: float) -> None:
    """Log ``summary_line`` every ``interval_s`` seconds until cancelled."""
    before = snapshot(gw)
    while True:
        await asyncio.sleep(interval_s)
        now = snapshot(gw)
        log.info("%s", summary_line(before, now, interval_s))
        before = now
