"""The status page (prefix_router/serve/status_page.py): which clients get it, the figures it reads
from the gateway's own metrics and state, and what it must never show (prompt text, anything a
browser would run). The page served at ``GET /``: tests/test_app.py; in a real browser:
tests/e2e/test_status_page.py."""

from __future__ import annotations

import re
import time
from html.parser import HTMLParser

import pytest

from prefix_router.config import config_from_dict
from prefix_router.fleet.replicas import apply_health, apply_metrics
from prefix_router.gateway import Gateway
from prefix_router.metrics import sample_sum
from prefix_router.misses.diagnosis import Cause, Change
from prefix_router.prompts.tokenizer import ByteTokenizer
from prefix_router.serve.status_page import REFRESH_S, render, snapshot, wants_html


class _Tables(HTMLParser):
    """Each ``<table id=...>`` of a page: its head, its body rows by ``data-key``, its foot row."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, dict] = {}
        self.table: dict | None = None
        self.section, self.row, self.cell = "", None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.table = self.tables[attrs.get("id", "")] = {"head": [], "rows": {}, "foot": []}
        elif tag in ("thead", "tbody", "tfoot"):
            self.section = tag
        elif tag == "tr" and self.table is not None:
            self.row = []
            if self.section == "tbody":
                self.table["rows"][attrs.get("data-key")] = self.row
        elif tag in ("td", "th") and self.row is not None:
            self.cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            self.row.append("".join(self.cell).strip())
            self.cell = None
        elif tag == "tr" and self.row is not None:
            if self.section == "thead":
                self.table["head"] = self.row
            elif self.section == "tfoot":
                self.table["foot"] = self.row
            self.row = None
        elif tag == "table":
            self.table = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def tables(page: str) -> dict[str, dict[str, dict[str, str]]]:
    """Table id -> row key -> {column header: cell text}; the foot row under the key ``None``.
    Shared with the browser test, which reads the DOM Chromium rendered."""
    parser = _Tables()
    parser.feed(page)
    out = {}
    for table_id, t in parser.tables.items():
        rows = {key: dict(zip(t["head"], cells)) for key, cells in t["rows"].items()}
        if t["foot"]:
            rows[None] = dict(zip(t["head"], t["foot"]))
        out[table_id] = rows
    return out


def number(cell: str) -> int:
    return int(cell.replace(",", ""))


def percent(cell: str) -> float:
    """A rate as shown (``73.2%``), as a fraction."""
    assert cell.endswith("%"), cell
    return float(cell[:-1]) / 100


# --- who gets the page ------------------------------------------------------------------------

@pytest.mark.parametrize(("accept", "html"), [
    (None, True), ("", True),
    ("text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8", True),  # a browser
    ("*/*", True),  # curl, python-requests
    ("text/*", True),
    ("application/json", False),  # the OpenAI SDKs
    ("application/json, text/plain, */*", False),  # axios: names JSON
    ("application/problem+json", False),
    ("text/html;q=0", False), ("*/*;q=0", False), ("text/html;q=zero", False),
    ("application/json, text/html", True),  # names HTML: takes it
    ("image/png", False),
    # weights that are no weight refuse their range, and none raises: str.isdigit takes "²" and
    # Arabic-Indic digits, which float() refuses or reads
    ("text/html;q=\u00b2", False), ("text/html;q=\u0663", False), ("*/*;q=\u00b9", False),
    ("text/html;q=-1", False), ("text/html;q=1e999", False), ("text/html;q=", False), ("TEXT/HTML;Q=1", True),
    (",".join(["image/png;q=0.1"] * 500) + ",text/html;q=0.001", True),
])
def test_which_accept_headers_take_the_page(accept, html):
    assert wants_html(accept) is html


# --- the figures ------------------------------------------------------------------------------

@pytest.fixture
def gateway():
    """A Gateway of three replicas, health and scrape applied: routable."""
    made = []

    def build(**sections) -> Gateway:
        config = config_from_dict({"replicas": [f"http://127.0.0.1:{p}" for p in (1, 2, 3)], **sections})
        gw = Gateway(config, ByteTokenizer())
        for replica in gw.replicas.values():
            apply_health(replica, True, config.health)
            apply_metrics(replica, "")
        made.append(gw)
        return gw

    yield build
    for gw in made:
        gw.executor.shutdown(wait=False)


def _traffic(gw: Gateway) -> None:
    """Counts as ``serve/learning.py`` makes them, on two replicas and one another worker knew."""
    m = gw.metrics
    for name, prompt, cached, predicted, results in (
            ("127.0.0.1:1", 12_345, 9_000, 9_500, {"hit": 7, "miss_cold": 2, "miss_changed": 3}),
            ("127.0.0.1:2", 800, 200, 300, {"miss_routed": 1, "miss_evicted": 2, "hit": 1}),
            ("gone:9", 100, 50, 50, {"hit": 1})):
        m.prompt_tokens.labels(name).inc(prompt)
        m.cached.labels(name).inc(cached)
        m.cached_predicted.labels(name).inc(predicted)
        for result, n in results.items():
            m.cache_requests.labels(name, result).inc(n)
    m.lost_tokens.labels("127.0.0.1:1", "changed").inc(640)
    m.lost_tokens.labels("127.0.0.1:2", "evicted").inc(96)


def test_the_page_shows_the_metrics_figures_per_replica_and_by_outcome(gateway):
    gw = gateway()
    _traffic(gw)
    page = render(snapshot(gw))
    shown, metrics = tables(page), gw.metrics.page().decode()
    for name in ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", "gone:9"):
        row = shown["replicas"][name]
        prompt = sample_sum(metrics, "prefix_router_prompt_tokens_total", replica=name)
        cached = sample_sum(metrics, "prefix_router_cached_tokens_total", replica=name)
        predicted = sample_sum(metrics, "prefix_router_cached_tokens_predicted_total", replica=name)
        assert number(row["prompt tokens"]) == prompt and number(row["cached tokens"]) == cached
        assert number(row["requests"]) == sample_sum(metrics, "prefix_router_cache_requests_total", replica=name)
        if prompt:
            assert percent(row["token hit rate"]) == pytest.approx(cached / prompt, abs=0.0005)
            assert percent(row["predicted hit rate"]) == pytest.approx(predicted / prompt, abs=0.0005)
        else:
            assert row["token hit rate"] == row["predicted hit rate"] == "–"
    assert shown["replicas"]["gone:9"]["state"] == "not known to this worker"
    assert list(shown["replicas"])[:3] == list(gw.replicas)  # the configuration's order, then the others
    total = sample_sum(metrics, "prefix_router_cache_requests_total")
    for result, row in shown["outcomes"].items():
        count = sample_sum(metrics, "prefix_router_cache_requests_total", result=result)
        assert number(row["requests"]) == count and percent(row["share"]) == pytest.approx(count / total, abs=0.0005)
    assert number(shown["outcomes"]["miss_changed"]["lost tokens"]) == sample_sum(
        metrics, "prefix_router_lost_tokens_total", cause="changed")
    assert number(shown["outcomes"]["miss_routed"]["lost tokens"]) == 0  # no series yet: none lost
    foot = shown["replicas"][None]
    assert percent(foot["token hit rate"]) == pytest.approx(
        sample_sum(metrics, "prefix_router_cached_tokens_total") / sample_sum(metrics, "prefix_router_prompt_tokens_total"),
        abs=0.0005)
    assert f'<meta http-equiv="refresh" content="{REFRESH_S}">' in page


def test_each_replica_state_is_named(gateway):
    gw = gateway()
    a, b, c = gw.replicas.values()
    b.last_failure = "HTTP 503 from http://127.0.0.1:2/health"
    for _ in range(gw.config.health.unhealthy_after):
        apply_health(b, False, gw.config.health)
    c.draining_since = time.monotonic()
    shown = tables(render(snapshot(gw)))["replicas"]
    assert shown[a.name]["state"] == "routable"
    assert shown[b.name]["state"].startswith("down") and "HTTP 503" in shown[b.name]["state"]
    assert shown[c.name]["state"].startswith("draining")
    assert "1 of 3 replicas routable" in render(snapshot(gw))


def test_change_sites_are_listed_latest_first_without_their_text(gateway):
    gw = gateway()
    gw.changes.record(Change(Cause.VOLATILE_VALUE, 0, "system", "d"), 32, 500, excerpt="Current time: # SECRETWORD")
    gw.changes.record(Change(Cause.TOOLS_CHANGED, -1, "tools", "search reordered"), 0, 80)
    gw.changes.record(Change(Cause.KEY_ORDER, 4, "tool", "d"), 900, 60)
    gw.changes.record(Change(Cause.VOLATILE_VALUE, 0, "system", "d"), 32, 500)  # seen again: first
    page = render(snapshot(gw))
    rows = list(tables(page)["changes"].values())
    assert [(r["cause"], r["message"], r["role"], number(r["token"]), number(r["count"]), number(r["lost tokens"]))
            for r in rows] == [("volatile_value", "0", "system", 32, 2, 1000), ("key_order", "4", "tool", 900, 1, 60),
                               ("tools_changed", "tool list", "tools", 0, 1, 80)]
    assert all(r["last seen"].endswith("s ago") for r in rows)
    assert "SECRETWORD" not in page and "search reordered" not in page  # no excerpt, no detail
    assert "4 changes in all" in page


def test_every_value_is_escaped_and_the_page_loads_and_runs_nothing(gateway):
    gw = gateway()
    gw.changes.record(Change(Cause.OTHER, 1, '<script>alert("x")</script>', "d"), 16, 10)
    snap = snapshot(gw)
    snap["replicas"][0]["name"] = '"><img src=x onerror=alert(1)>'
    page = render(snap)
    assert "<script" not in page.lower() and "<img" not in page.lower()
    assert "&lt;script&gt;" in page and "&lt;img src=x" in page
    # no asset from anywhere: only the three JSON views are linked, relative to the gateway
    assert re.findall(r'(?:src|href)="([^"]*)"', page) == ["/replicas", "/debug/changes", "/metrics"]


def test_no_traffic_yet_is_a_page_of_dashes_and_zeros(gateway):
    page = render(snapshot(gateway(routing={"policy": "round-robin"})))
    shown = tables(page)
    assert {r["token hit rate"] for r in shown["replicas"].values()} == {"–"}
    assert {r["requests"] for r in shown["outcomes"].values()} == {"0"}
    assert "changes" not in shown and "none yet" in page and "policy round-robin" in page
