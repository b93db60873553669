"""``prefix-router serve --workers 2``: two processes on one port, one set of metrics.

A real supervisor and workers in front of one simulated replica: requests on fresh connections
reach both workers (the kernel spreads SO_REUSEPORT connections), every scrape of ``/metrics``,
whichever worker answers it, counts all of them, a killed worker is replaced and what it had
counted stays counted, and SIGTERM stops the whole gateway cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

from prefix_router.tools.launch import gateway_server, running, sim_server
from prefix_router.metrics import sample_sum
from prefix_router.workers import MULTIPROC_ENV

from .helpers import MODEL


def _children(pid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(entry.name))
    return out


def _listening(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on TCP ``port`` (/proc/net/tcp)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    try:
        links = [os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir()]
    except OSError:
        return False
    return any(link == f"socket:[{inode}]" for link in links for inode in inodes)


def _chat(url: str, i: int) -> None:
    body = json.dumps({"model": MODEL, "max_tokens": 2,
                       "messages": [{"role": "user", "content": f"question {i} " * 20}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:  # a new connection per request
        assert response.status == 200


def _requests_counted(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return sample_sum(response.read().decode(), "prefix_router_requests_total", code="200")


def _wait(predicate, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    return predicate()


def test_two_workers_share_the_port_and_one_set_of_metrics_and_survive_a_crash(tmp_path):
    with running([sim_server(tmp_path, ["--model", MODEL, "--time-scale", "1000"])]) as (replica,):
        gateway = gateway_server(tmp_path, [replica], ["--workers", "2"])
        with running([gateway]) as (url,):
            workers = _wait(lambda: _children(gateway.pid) if len(_children(gateway.pid)) == 2 else None)
            assert workers and len(workers) == 2
            assert _wait(lambda: all(_listening(pid, gateway.port) for pid in workers)), "a worker never listened"
            for i in range(40):
                _chat(url, i)
            served = {pid: _served_by(pid, tmp_path) for pid in workers}
            assert all(served.values()) and sum(served.values()) == 40, served  # both took connections
            assert {_requests_counted(url) for _ in range(10)} == {40.0}  # whichever worker answers

            victim = next(iter(workers))
            os.kill(victim, signal.SIGKILL)
            replaced = _wait(lambda: (_children(gateway.pid) - {victim}) if len(_children(gateway.pid) - {victim}) == 2
                             else None)
            assert replaced and victim not in replaced
            assert _wait(lambda: all(_listening(pid, gateway.port) for pid in replaced))
            for i in range(40, 50):
                _chat(url, i)
            assert _wait(lambda: _requests_counted(url) == 50.0), "the dead worker's requests left the count"
            supervisor = gateway.pid
        assert not _children(supervisor)  # SIGTERM stopped the workers with the supervisor


def _served_by(pid: int, tmp_path: Path) -> float:
    """Requests worker ``pid`` counted: its own file of prometheus-client's multiprocess
    directory, read alone."""
    import shutil

    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    directory = next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
    alone = tmp_path / f"worker-{pid}"
    alone.mkdir()
    shutil.copy(Path(directory) / f"counter_{pid}.db", alone)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(alone))
    return sample_sum(generate_latest(registry).decode(), "prefix_router_requests_total", code="200")


def test_a_port_another_program_holds_is_refused_in_one_line_with_or_without_workers():
    import socket
    import subprocess
    import sys

    taken = socket.socket()  # another program's listener
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        for workers in ("1", "2"):
            done = subprocess.run([sys.executable, "-m", "prefix_router.cli", "serve", "--workers", workers, "--port",
                                   str(taken.getsockname()[1]), "--replica", "http://127.0.0.1:9"],
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 1, done.stderr[-2000:]
            last = done.stderr.strip().splitlines()[-1]
            assert last.startswith("prefix-router serve: cannot listen on 0.0.0.0:") and "in use" in last.lower(), last
            assert "Traceback" not in done.stderr
    finally:
        taken.close()


def test_workers_stop_when_their_supervisor_is_killed(tmp_path):
    with running([sim_server(tmp_path, ["--model", MODEL, "--time-scale", "1000"])]) as (replica,):
        gateway = gateway_server(tmp_path, [replica], ["--workers", "2"])
        # a supervisor killed cannot remove the metrics folder it made: give it one here
        (tmp_path / "metrics").mkdir()
        gateway.env[MULTIPROC_ENV] = str(tmp_path / "metrics")
        with running([gateway]) as (url,):
            workers = _wait(lambda: _children(gateway.pid) if len(_children(gateway.pid)) == 2 else None)
            assert workers
            os.kill(gateway.pid, signal.SIGKILL)
            assert _wait(lambda: not any(Path(f"/proc/{pid}").exists() and
                                         "zombie" not in _state(pid) for pid in workers)), "workers outlived it"


def _state(pid: int) -> str:
    try:
        return "zombie" if (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z") else "alive"
    except OSError:
        return "zombie"


def test_each_worker_routes_as_one_of_several_instances():
    # N workers are N pictures of the caches: a prompt nobody holds must go where every one of
    # them would send it (the ring), whatever routing.sole_router says
    from prefix_router.config import config_from_dict
    from prefix_router.gateway import Gateway

    for workers, sole in ((1, True), (2, False)):
        config = config_from_dict({"replicas": ["http://127.0.0.1:9"], "workers": workers})
        assert config.routing.sole_router is True
        assert Gateway(config, None).policy.config.sole_router is sole
