"""The status page in a real headless Chromium (Debian package ``chromium``): a gateway
(``prefix-router serve``) in front of two simulated replicas (``prefix-router sim``), a few
conversations with hits and misses of more than one kind, then the DOM Chromium renders from
``GET /`` must show the figures ``/metrics`` exports and the change sites ``/debug/changes``
lists, and no prompt text; a screenshot must come out as a PNG. Skipped where Chromium is not
installed, unless ``PREFIX_ROUTER_REQUIRE_CHROMIUM=1`` (CI sets it and installs Chromium:
``.ci/run``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from prefix_router.metrics import sample_sum
from prefix_router.tools.launch import build_tiny_model, gateway_server, running, sim_server

from ..serve.test_status_page import number, percent, tables

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRED = os.environ.get("PREFIX_ROUTER_REQUIRE_CHROMIUM") == "1"
pytestmark = pytest.mark.skipif(CHROMIUM is None and not REQUIRED,
                                reason="Chromium is not installed (Debian package chromium)")
SECRET = "ZEBRAQUOKKA"  # in every user message: the page must never show it
HEAD = "You are the support assistant of a hardware shop. Answer in two sentences. " * 3


def chromium(tmp: Path, *args: str, timeout_s: float = 90) -> str:
    """Run headless Chromium with a profile of its own in ``tmp``; its stdout. Its process group
    is killed when it overruns ``timeout_s``. Its stderr (dbus complaints in a container: no
    session bus) is kept for the failure message only."""
    assert CHROMIUM is not None, "PREFIX_ROUTER_REQUIRE_CHROMIUM=1 but chromium is not installed"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           f"--user-data-dir={tmp / 'chromium-profile'}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"chromium {args[-2:]} still running after {timeout_s:g} s") from None
    assert proc.returncode == 0, f"chromium exited with {proc.returncode}:\n{err[-3000:]}"
    return out


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def chat(gateway: str, session: str, messages: list[dict]) -> None:
    body = json.dumps({"model": "sim", "max_tokens": 8, "messages": messages}).encode()
    request = urllib.request.Request(gateway + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "X-Session-ID": session})
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.status == 200


def traffic(gateway: str) -> int:
    """Three conversations: a first turn, the same turn again, then a next turn whose system
    prompt's timestamp moved (a changed prefix: ``volatile_value``); a request count."""
    sent = 0
    for n in range(3):
        def system(minute: int) -> dict:
            return {"role": "system", "content": f"{HEAD}Current time: 2026-11-30T10:{minute:02d}:00Z. "
                                                 f"Conversation {n}. " + "Be exact. " * 30}
        first = [system(0), {"role": "user", "content": f"{SECRET} question {n}: which cable fits?"}]
        chat(gateway, f"s-{n}", first)
        chat(gateway, f"s-{n}", first)
        chat(gateway, f"s-{n}", [system(7), *first[1:], {"role": "assistant", "content": "The blue one."},
                                 {"role": "user", "content": f"{SECRET} and the red one?"}])
        sent += 3
    return sent


def test_the_status_page_in_a_browser_shows_what_metrics_exports(tmp_path):
    assert CHROMIUM is not None, "PREFIX_ROUTER_REQUIRE_CHROMIUM=1 but chromium is not installed"
    tokenizer = str(build_tiny_model(ROOT / ".cache" / "tiny-tokenizer", tokenizer_only=True))
    sims = [sim_server(tmp_path, ["--model", "sim", "--time-scale", "100", "--tokenizer", tokenizer])
            for _ in range(2)]
    with running(sims) as replicas, running([gateway_server(tmp_path, replicas, ["--tokenizer", tokenizer])]) \
            as (gateway,):
        sent = traffic(gateway)
        deadline = time.monotonic() + 10  # each answer is counted once relayed: wait for the last
        while sample_sum(metrics := get(gateway + "/metrics"), "prefix_router_cache_requests_total") < sent:
            assert time.monotonic() < deadline, "the gateway did not count every request"
            time.sleep(0.1)
        changes = json.loads(get(gateway + "/debug/changes"))["sites"]
        dom = chromium(tmp_path, "--dump-dom", gateway + "/")
        shot = tmp_path / "status.png"
        chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,900", gateway + "/")

    shown = tables(dom)
    names = sorted({line.split('replica="')[1].split('"')[0] for line in metrics.splitlines()
                    if line.startswith("prefix_router_prompt_tokens_total{")})
    assert names and set(names) <= set(shown["replicas"])
    for name in names:
        row = shown["replicas"][name]
        prompt = sample_sum(metrics, "prefix_router_prompt_tokens_total", replica=name)
        cached = sample_sum(metrics, "prefix_router_cached_tokens_total", replica=name)
        predicted = sample_sum(metrics, "prefix_router_cached_tokens_predicted_total", replica=name)
        assert row["state"] == "routable"
        assert number(row["prompt tokens"]) == prompt and number(row["cached tokens"]) == cached
        assert percent(row["token hit rate"]) == pytest.approx(cached / prompt, abs=0.0005)
        assert percent(row["predicted hit rate"]) == pytest.approx(predicted / prompt, abs=0.0005)
    kinds = {}
    for result, row in shown["outcomes"].items():
        kinds[result] = sample_sum(metrics, "prefix_router_cache_requests_total", result=result)
        assert number(row["requests"]) == kinds[result], result
    assert kinds["hit"] > 0 and sum(1 for k, n in kinds.items() if k.startswith("miss_") and n) >= 2, kinds
    # every site /debug/changes lists (as many as the page shows), with its figures
    rows = {(r["cause"], r["message"], r["role"], number(r["token"]), number(r["count"]), number(r["lost tokens"]))
            for r in shown["changes"].values()}
    assert changes and rows == {(s["cause"], "tool list" if s["message_index"] == -1 else str(s["message_index"]),
                                 s["role"], s["token_position"], s["count"], s["lost_tokens"]) for s in changes}
    assert SECRET not in dom and "hardware shop" not in dom
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert struct.unpack(">II", png[16:24]) == (1280, 900)  # the IHDR's width and height
