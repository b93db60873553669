"""``prefix-router gate`` on the SWE-agent sessions: a baseline written from the clean workload
passes the clean workload again and fails the workload with the planted breaks."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

from prefix_router.tools.gate import salted, verdict
from prefix_router.tools.replay.workloads import load_request_log

from ..misses.test_diagnosis import plant, sessions

KINDS = ["timestamp", "tools_reordered", "keys_shuffled", "trimmed", "retrieval"]


def write_workload(path, mutated: bool) -> None:
    """One copy of each session per kind, planted with that kind's break when ``mutated``."""
    with open(path, "w") as f:
        for kind in KINDS:
            for n, turns in enumerate(sessions()):
                turns = copy.deepcopy(turns)
                for body in turns:  # copies must not share a first user message
                    next(m for m in body["messages"] if m["role"] == "user")["content"] += f" ({kind})"
                if mutated:
                    turns, _, _ = plant(turns, kind)
                for body in turns:
                    f.write(json.dumps({**body, "max_tokens": 4, "session": f"{kind}-{n}"}) + "\n")


def gate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefix_router.cli", "gate", "--json", *args],
                          capture_output=True, text=True, timeout=300)


def test_the_gate_passes_the_clean_workload_and_fails_the_broken_one(tmp_path):
    clean, broken, baseline = tmp_path / "clean.jsonl", tmp_path / "broken.jsonl", tmp_path / "baseline.json"
    write_workload(clean, mutated=False)
    write_workload(broken, mutated=True)
    written = gate("--trace", str(clean), "--baseline", str(baseline), "--write-baseline")
    assert written.returncode == 0, written.stderr
    base = json.loads(baseline.read_text())["token_hit_rate"]
    assert 0 < base < 1
    again = gate("--trace", str(clean), "--baseline", str(baseline))
    assert again.returncode == 0, again.stdout + again.stderr
    result = json.loads(again.stdout)
    assert result["passed"] and len(result["runs"]) == 3 and all(r["errors"] == 0 for r in result["runs"])
    failed = gate("--trace", str(broken), "--baseline", str(baseline))
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert json.loads(failed.stdout)["token_hit_rate"] < base - 0.02


def test_the_gate_says_why_it_could_not_measure(tmp_path):
    assert gate("--trace", str(tmp_path / "none.jsonl"), "--min-hit-rate", "0.5").returncode == 2
    no_baseline = gate("--workload", "chat")
    assert no_baseline.returncode == 2 and "--baseline" in no_baseline.stderr
    unreadable = gate("--baseline", str(tmp_path / "missing.json"))
    assert unreadable.returncode == 2 and "--write-baseline" in unreadable.stderr


def test_each_run_gets_its_own_salt_and_keeps_a_requests_own_inside_it(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "cache_salt": "mine"}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    requests = load_request_log(path)
    a, b = salted(requests, "run-a"), salted(requests, "run-b")
    assert [r.body["cache_salt"] for r in a] == ["run-a/mine", "run-a"]
    assert {r.body["cache_salt"] for r in a}.isdisjoint(r.body["cache_salt"] for r in b)
    assert "cache_salt" not in requests[1].body  # the originals are untouched
    assert verdict(0.80, 0.81, 0.02) and not verdict(0.78, 0.81, 0.02)
