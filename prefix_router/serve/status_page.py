"""``GET /``: the status page, what an operator reads first.

One HTML page rendered here (no script, no external asset, every value escaped, a Content
Security Policy that lets none run), reloaded by the browser every ``REFRESH_S`` seconds:

- each replica: its state (routable, down and why, draining, breaker open, recovering; KV events
  stale), queue depth and requests in flight, the requests and prompt tokens it was sent through
  this gateway, the cached tokens its engine reported, its token hit rate (cached over prompt
  tokens) and the gateway's predicted one;
- requests by cache outcome (``hit`` and the four miss kinds of ``misses/classify.py``) and the
  tokens each miss kind lost;
- the latest sites where clients changed their prefix (``misses/change_sites.py``): cause, message
  index, role, token position, count, lost tokens, when last seen, the fix.

Requests and tokens are read from the gateway's own counters (``Metrics.counter_samples``), so
they are the figures of ``/metrics``, every worker's under ``--workers N``; states, loads and
change sites are this process's, as in ``/replicas`` and ``/debug/changes``. No prompt text is on
the page: a site holds none, and its redacted excerpt (``changes.snippets``) is left out.
"""

from __future__ import annotations

import re
import time
from html import escape
from typing import TYPE_CHECKING


from prefix_router.misses.classify import CacheResult

if TYPE_CHECKING:
    from prefix_router.fleet.replicas import ReplicaState
    from prefix_router.gateway import Gateway

__all__ = ["HEADERS", "REFRESH_S", "render", "snapshot", "wants_html"]

REFRESH_S = 5  # seconds between reloads: about a scrape's interval, slow enough to read a figure
CHANGE_SITES = 10  # the latest change sites shown
# A page that runs nothing and loads nothing (an injected tag would stay inert text), and differs
# by Accept (``wants_html``: a JSON client at ``/`` gets the replicas' answer).
HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Vary": "Accept",
           "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'"}
# The series the page reads.
SERIES = ("prefix_router_cache_requests_total", "prefix_router_prompt_tokens_total",
          "prefix_router_cached_tokens_total", "prefix_router_cached_tokens_predicted_total",
          "prefix_router_lost_tokens_total")
HINTS = {  # by outcome label: what each asks of an operator (docs/operations.md#what-each-miss-asks-of-you)
    CacheResult.HIT.value: "served at least the longest prefix known anywhere",
    CacheResult.MISS_COLD.value: "nothing of the prompt was known anywhere: nothing to fix",
    CacheResult.MISS_CHANGED.value: "the client rewrote its own prefix: where, below",
    CacheResult.MISS_ROUTED.value: "another replica held more: spills, replicas joining or leaving",
    CacheResult.MISS_EVICTED.value: "the replica held it and evicted it: its KV cache is short for the traffic",
}
# the miss kinds that count lost tokens (``prefix_router_lost_tokens_total{cause}``)
LOSING = (CacheResult.MISS_CHANGED.value, CacheResult.MISS_ROUTED.value, CacheResult.MISS_EVICTED.value)
_QVALUE = re.compile(r"[0-9]+(?:\.[0-9]*)?", re.ASCII)  # a weight, as ``wants_html`` takes it
_STYLE = """body{font:14px/1.35 system-ui,sans-serif;margin:1em 1.5em;color:#222}
h1{font-size:20px;margin:0 0 .2em}h2{font-size:16px;margin:1em 0 .3em}p{margin:.2em 0}
table{border-collapse:collapse}th,td{padding:2px 9px;border-bottom:1px solid #ddd;text-align:left}
th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}tfoot td{font-weight:600}
.ok{color:#176117}.warn{color:#8a5a00}.bad{color:#a31515}.dim{color:#777}"""


def wants_html(accept: str | None) -> bool:
    """Whether a client's ``Accept`` header takes the page: none, one naming ``text/html``, or a
    wildcard (``*/*``, ``text/*``: curl, a script's default) from a client that names no JSON type.
    A client asking for JSON (the OpenAI SDK's ``application/json``) is left to the replicas."""
    if not accept:
        return True
    ranges = {}
    for part in accept.lower().split(","):
        media, *params = (p.strip() for p in part.split(";"))
        q = next((p.partition("=")[2] for p in params if p.startswith("q=")), "1")
        # a weight is ASCII digits and one dot (RFC 9110 12.4.2); any other (``q=abc``, ``q=-1``,
        # ``q=1e999``, ``q=²``, which str.isdigit takes and float() refuses) refuses the range
        ranges[media] = _QVALUE.fullmatch(q) is not None and float(q) > 0
    if ranges.get("text/html"):
        return True
    if any(m == "application/json" or m.endswith("+json") for m in ranges):
        return False
    return bool(ranges.get("*/*") or ranges.get("text/*"))


def _state(r: ReplicaState, now: float) -> tuple[str, str]:
    """(the replica's state in words, its CSS class)."""
    stale = r.stream is not None and not r.stream.fresh
    if r.draining_since is not None:
        return "draining (left discovery)", "warn"
    if not r.healthy:
        return "down" + (f": {r.last_failure[:160]}" if r.last_failure else ""), "bad"
    if r.routable_at(now):
        return ("routable; KV events stale: routing by its guess" if stale else "routable"), "warn" if stale else "ok"
    breaker = r.breaker.state(now).name.lower().replace("_", "-")
    if breaker != "closed":
        return f"breaker {breaker}", "bad"
    return "recovering: on the ring after its next scrape", "warn"


_FIGURES = ("requests", "prompt_tokens", "cached_tokens", "predicted_tokens")  # per replica, SERIES[0:4]


def _sums(series: dict[str, list[tuple[dict[str, str], float]]], name: str, label: str,
          prefix: str = "") -> dict[str, float]:
    """The samples of ``series[name]`` summed by the value of ``label`` (with ``prefix``)."""
    sums: dict[str, float] = {}
    for labels, value in series[name]:
        key = prefix + labels.get(label, "")
        sums[key] = sums.get(key, 0.0) + value
    return sums


def snapshot(gw: Gateway, now: float | None = None) -> dict:
    """The page's figures: ``{"generated": unix s, "policy", "routing", "routable" and "known"
    (replica counts), "replicas": [{name, role, state, css, queue_depth, inflight, requests,
    prompt_tokens, cached_tokens, predicted_tokens, outcomes: {result: requests}}], "outcomes": [{result, requests, lost_tokens}],
    "changes": [{cause, message_index, role, token_position, count, lost_tokens, seen_s_ago, fix}],
    "changes_total"}``; requests and tokens are counts since start, ``seen_s_ago`` seconds. Replicas
    in the configuration's order, then any only the metrics name (another worker's)."""
    now = time.monotonic() if now is None else now
    series = gw.metrics.counter_samples(SERIES)
    by_replica = [_sums(series, name, "replica") for name in SERIES[:4]]
    names = {name: None for sums in by_replica for name in sums}
    figures = {name: dict(zip(_FIGURES, (sums.get(name, 0.0) for sums in by_replica))) for name in names}
    for name, row in figures.items():  # its requests by outcome: the summary line's deltas (summary.py)
        row["outcomes"] = {}
    for labels, value in series[SERIES[0]]:
        outcomes = figures[labels.get("replica", "")]["outcomes"]
        outcomes[labels.get("result", "")] = outcomes.get(labels.get("result", ""), 0.0) + value
    replicas = []
    for r in gw.replicas.values():
        state, css = _state(r, now)
        replicas.append({"name": r.name, "role": r.config.role, "state": state, "css": css, "queue_depth": r.load,
                         "inflight": r.inflight, **figures.pop(r.name, {**dict.fromkeys(_FIGURES, 0.0), "outcomes": {}})})
    for name, row in sorted(figures.items()):
        replicas.append({"name": name, "role": "", "state": "not known to this worker", "css": "dim",
                         "queue_depth": None, "inflight": None, **row})
    by_result = {**dict.fromkeys((r.value for r in CacheResult), 0.0), **_sums(series, SERIES[0], "result")}
    lost = _sums(series, SERIES[4], "cause", prefix="miss_")
    shown = ("cause", "message_index", "role", "token_position", "count", "lost_tokens", "fix")
    changes = [{**{k: v for k, v in site.as_dict().items() if k in shown},  # never its excerpt
                "seen_s_ago": max(0.0, now - site.last_seen)} for site in gw.changes.latest(CHANGE_SITES)]
    return {"generated": time.time(), "policy": gw.config.routing.policy,
            "routing": "exact token blocks" if gw.tokenizer is not None else "approximate blocks (no tokenizer)",
            "routable": sum(r.routable_at(now) for r in gw.replicas.values()), "known": len(gw.replicas),
            "replicas": replicas,
            "outcomes": [{"result": result, "requests": count, "lost_tokens": lost.get(result, 0.0)}
                         for result, count in by_result.items()],
            "changes": changes, "changes_total": sum(count for count, _ in gw.changes.by_cause.values())}


def _num(value: float | None) -> str:
    return "–" if value is None else f"{int(value):,}"


def _rate(part: float, whole: float) -> str:
    """A share as a percentage with one decimal; a dash for nothing sent."""
    return f"{100 * part / whole:.1f}%" if whole else "–"


def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago" if seconds < 7200 \
        else f"{seconds / 3600:.0f} h ago"


def _table(table_id: str, head: list[str], rows: list[tuple[str, list[tuple[str, str]]]],
           foot: list[tuple[str, str]] | None = None) -> str:
    """An HTML table: ``rows`` are (the row's ``data-key``, [(cell text, CSS class)]); every text
    and key escaped here."""
    cells = lambda row: "".join(  # noqa: E731
        f'<td class="{c}">{escape(t)}</td>' if c else f"<td>{escape(t)}</td>" for t, c in row)
    body = "".join(f'<tr data-key="{escape(key)}">{cells(row)}</tr>' for key, row in rows)
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    tfoot = f"<tfoot><tr>{cells(foot)}</tr></tfoot>" if foot else ""
    return f'<table id="{table_id}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody>{tfoot}</table>'


def _replica_table(replicas: list[dict]) -> str:
    rows = [(r["name"], [(r["name"] + (f" ({r['role']})" if r["role"] not in ("", "both") else ""), ""),
                         (r["state"], r["css"]), (_num(r["queue_depth"]), "n"), (_num(r["inflight"]), "n"),
                         (_num(r["requests"]), "n"), (_num(r["prompt_tokens"]), "n"), (_num(r["cached_tokens"]), "n"),
                         (_rate(r["cached_tokens"], r["prompt_tokens"]), "n"),
                         (_rate(r["predicted_tokens"], r["prompt_tokens"]), "n")]) for r in replicas]
    total = {k: sum(r[k] for r in replicas) for k in _FIGURES}
    foot = [("all replicas", ""), ("", ""), ("", ""), ("", ""), (_num(total["requests"]), "n"),
            (_num(total["prompt_tokens"]), "n"), (_num(total["cached_tokens"]), "n"),
            (_rate(total["cached_tokens"], total["prompt_tokens"]), "n"),
            (_rate(total["predicted_tokens"], total["prompt_tokens"]), "n")]
    return _table("replicas", ["replica", "state", "queue depth", "in flight", "requests", "prompt tokens",
                               "cached tokens", "token hit rate", "predicted hit rate"], rows, foot)


def _outcome_table(outcomes: list[dict]) -> str:
    total = sum(o["requests"] for o in outcomes)
    rows = [(o["result"], [(o["result"], ""), (_num(o["requests"]), "n"), (_rate(o["requests"], total), "n"),
                           (_num(o["lost_tokens"]) if o["result"] in LOSING else "", "n"),
                           (HINTS.get(o["result"], ""), "dim")]) for o in outcomes]
    return _table("outcomes", ["outcome", "requests", "share", "lost tokens", "what it means"], rows)


def _change_table(changes: list[dict]) -> str:
    if not changes:
        return '<p class="dim" id="changes">none yet</p>'
    rows = [(str(i), [(c["cause"], ""), ("tool list" if c["message_index"] == -1 else str(c["message_index"]), "n"),
                      (c["role"], ""), (_num(c["token_position"]), "n"), (_num(c["count"]), "n"),
                      (_num(c["lost_tokens"]), "n"), (_ago(c["seen_s_ago"]), "n"), (c["fix"], "dim")])
            for i, c in enumerate(changes)]
    return _table("changes", ["cause", "message", "role", "token", "count", "lost tokens", "last seen", "fix"], rows)


def render(snap: dict) -> str:
    """The page for ``snapshot``'s figures."""
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(snap["generated"]))
    summary = (f"{snap['routable']} of {snap['known']} replicas routable · policy {snap['policy']} · "
               f"routing on {snap['routing']} · {generated}, reloaded every {REFRESH_S} s")
    n = snap["changes_total"]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="refresh" content="{REFRESH_S}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>prefix-router status</title><style>{_STYLE}</style></head><body>"
            f"<h1>prefix-router</h1><p>{escape(summary)}</p>"
            f"<h2>Replicas</h2>{_replica_table(snap['replicas'])}"
            f"<h2>Cache outcomes</h2>{_outcome_table(snap['outcomes'])}"
            f"<h2>Where clients changed their prefix, latest first</h2>"
            f'<p class="dim">{_num(n)} change{"" if n == 1 else "s"} in all; message index, role and token '
            f"position of each site, never its text</p>{_change_table(snap['changes'])}"
            '<p class="dim">As JSON: <a href="/replicas">/replicas</a>, <a href="/debug/changes">/debug/changes</a>, '
            '<a href="/metrics">/metrics</a></p></body></html>\n')
