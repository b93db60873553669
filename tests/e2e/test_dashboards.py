"""The Grafana dashboard and the alert rules against a real Prometheus (Debian package
``prometheus``): every rule file parses (``promtool``), and after a short replay through a
gateway in front of simulated replicas, every panel query and every alert expression returns
data. Skipped with the reason where Prometheus is not installed (``apt-get install prometheus``;
CI installs it, ``.ci/run``)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from prefix_router.tools.launch import Server, build_tiny_model, free_port, gateway_server, running, sim_server
from prefix_router.tools.replay.client import replay
from prefix_router.tools.replay.generate import builtin_workload

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "prefix-router.json"
ALERTS = ROOT / "dashboards" / "alerts.yaml"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None,
                                      reason="Prometheus is not installed (Debian package prometheus)")
COMPARISON = re.compile(r"\s(<=|>=|==|!=|<|>)\s")


def panel_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def as_signal(expr: str) -> str:
    """An alert expression with its one comparison turned into ``bool``: 0 or 1 per series, so it
    returns data whether or not the alert would fire."""
    found = COMPARISON.findall(expr)
    assert len(found) == 1, f"expected one comparison in {expr!r}"
    return COMPARISON.sub(lambda m: f" {m.group(1)} bool ", expr, count=1)


def test_the_dashboard_has_every_panel_the_operators_need_and_each_has_a_query():
    titles = " ".join(t for t, _ in panel_queries()).lower()
    for word in ("hit rate", "misses", "lost", "spillover", "queue", "time to first token", "route", "health",
                 "analysis"):
        assert word in titles, word
    exprs = [e for _, e in panel_queries()]
    assert any("vllm:prefix_cache_hits_total" in e for e in exprs)  # engine-reported beside predicted
    assert any("prefix_router_cached_tokens_predicted_total" in e for e in exprs)


@needs_prometheus
def test_the_alert_rules_pass_promtool():
    out = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def query(prom: str, expr: str) -> list:
    url = prom + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@needs_prometheus
def test_every_panel_query_and_alert_expression_returns_data_from_a_real_prometheus(tmp_path):
    # exact token blocks and KV events on, so the event and parity series exist too
    tokenizer = str(build_tiny_model(ROOT / ".cache" / "tiny-tokenizer", tokenizer_only=True))
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                         "replay_endpoint": "tcp://127.0.0.1:*"})
    sims = [sim_server(tmp_path, ["--model", "sim", "--time-scale", "20", "--tokenizer", tokenizer,
                                  "--kv-events-config", events]) for _ in range(3)]
    # and a disaggregated pair behind a gateway of its own, so the prefill/decode panel has series
    pair = [sim_server(tmp_path, ["--model", "sim", "--time-scale", "20", "--kv-transfer-config",
                                  json.dumps({"kv_connector": "NixlConnector", "kv_role": role})])
            for role in ("kv_producer", "kv_consumer")]
    with running(sims + pair) as urls:
        replicas, (prefill, decode) = urls[:3], urls[3:]
        # the tightest load bound and no holder's leave, so the spillover panel has series too
        (tmp_path / "gateway.yaml").write_text("routing:\n  load_factor: 1\n  holder_load_factor: 1\n"
                                               "  holder_share_factor: 1\n  holder_slack: 0\n")
        args = ["--config", str(tmp_path / "gateway.yaml"), "--tokenizer", tokenizer]
        split = gateway_server(tmp_path, [], ["--prefill", prefill, "--decode", decode])
        with running([gateway_server(tmp_path, replicas, args), split]) as (gateway, split_gateway):
            port = free_port()
            targets = lambda urls: [u.split("//")[1] for u in urls]  # noqa: E731
            config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                      "rule_files": [str(ALERTS)],
                      "scrape_configs": [{"job_name": "prefix-router",
                                          "static_configs": [{"targets": targets([gateway, split_gateway])}]},
                                         {"job_name": "vllm", "static_configs": [{"targets": targets(urls)}]}]}
            (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
            prom = Server([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                           f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                          port, tmp_path / "prometheus.log", health_path="/-/ready")
            with running([prom]) as (prom_url,):
                # cache-breaking clients too, so miss_changed and lost tokens have series
                requests = builtin_workload("mixed", sessions=12, seed=4)
                records = asyncio.run(replay(requests, gateway, model="sim", time_scale=20))
                records += asyncio.run(replay(requests[:20], split_gateway, model="sim", time_scale=20))
                assert all(r.error is None for r in records)
                time.sleep(4)  # a few scrapes after the last request
                empty = [title for title, expr in panel_queries()
                         if not query(prom_url, expr.replace("$__rate_interval", "1m"))]
                assert not empty, f"panels without data: {empty}"
                silent = [r["alert"] for r in alert_rules() if not query(prom_url, as_signal(r["expr"]))]
                assert not silent, f"alert expressions without data: {silent}"
