"""Processes for fleet benchmarks: simulated replicas and a gateway on loopback.

Each replica and the gateway run as ``prefix-router`` subprocesses (``python -m router.cli``),
so they share no event loop with the load generator or each other, as in a deployment.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["free_port", "start", "wait_healthy", "fleet", "gateway", "scrape", "metric_sum"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: Path) -> subprocess.Popen:
    out = open(log, "w")
    return subprocess.Popen([sys.executable, "-m", "router.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                            cwd=ROOT, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1.0):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


@contextlib.contextmanager
def fleet(n: int, log_dir: Path, sim_args: list[str]):
    """``n`` simulated replicas; yields their base URLs."""
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in range(n)]
    procs = [start(["sim", "--port", str(p), *sim_args], log_dir / f"sim-{p}.log") for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc in zip(urls, procs):
            wait_healthy(url, proc)
        yield urls
    finally:
        _stop(procs)


@contextlib.contextmanager
def gateway(replicas: list[str], log_dir: Path, extra: list[str] = ()):
    """A gateway in front of ``replicas``; yields its base URL."""
    port = free_port()
    args = ["serve", "--host", "127.0.0.1", "--port", str(port), *extra]
    for url in replicas:
        args += ["--replica", url]
    proc = start(args, log_dir / f"gateway-{port}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        _stop([proc])


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def metric_sum(text: str, name: str) -> float:
    """Sum of one metric's samples in a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
